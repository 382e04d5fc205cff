//! `agora bench insitu`: XEMEM's in situ workflow on Agora (issue #15), and what it costs.
//!
//! The **simulation** (this process) runs HPCCG's conjugate gradient through Agora's `hpccg.*`
//! kernels; every `interval` iterations (a communication point) it publishes its solution vector
//! in an exported buffer and signals the **analytics** process (`agora insitu-analytics`, a
//! separate process), through a small read-write export used as a mailbox: word 0 the
//! simulation's signal, word 1 the analytics' answer, word 2 a stop flag. The analytics attaches
//! the data, copies it into a private array and runs STREAM's four kernels over it. The four
//! configurations of the paper:
//!
//! * **synchronous**: the simulation waits until the analytics finished STREAM;
//!   **asynchronous**: the analytics answers as soon as it has attached, and runs STREAM beside
//!   the simulation;
//! * **one-time** attachment: one exported region for the whole run, attached once;
//!   **recurring**: a new region exported at every point (the previous one released), attached
//!   anew each time.
//!
//! Plus the simulation alone, and with a checkpoint of its state (x, r, p, the iteration and
//! r·r) at every point, per level. Reported: total time of each against the simulation alone,
//! per-attach latency (the analytics' own measurement, and a 512 MiB region attached and dropped
//! repeatedly), checkpoint overhead per level, and `recovered_exact`: a checkpointed run stopped
//! half way, recovered by a new session of the same application and finished, must produce
//! bit-for-bit the solution of the uninterrupted run (else the benchmark fails).

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use agora::{Arg, Buffer, CheckpointLevel, ExportReaders, Kernel, Queue, Session, SessionOptions};
use agora_kernels::hpccg::reference::problem;
use anyhow::{bail, Context, Result};
use clap::Args;
use serde::{Deserialize, Serialize};

use super::harness::{median, percentile, spread, DaemonProcess, ScratchDir, Spread};

/// `agora bench insitu` options.
#[derive(Args, Debug)]
pub struct InsituArgs {
    /// CG iterations per run (default 600, as in the paper; 60 with --quick).
    #[arg(long)]
    iterations: Option<u64>,
    /// Iterations between communication points (default 40: 15 points; 4 with --quick).
    #[arg(long)]
    interval: Option<u64>,
    /// Grid edge of HPCCG's problem (rows = edge³; default 32; 12 with --quick).
    #[arg(long)]
    grid: Option<usize>,
    /// Exported region the analytics copies and runs STREAM over, MiB (default 64; 2 with
    /// --quick; the paper used 512).
    #[arg(long)]
    region_mib: Option<u64>,
    /// Runs of every configuration, interleaved (default 3; 1 with --quick).
    #[arg(long)]
    repetitions: Option<usize>,
    /// Print JSON.
    #[arg(long)]
    json: bool,
    /// A short version for smoke checks.
    #[arg(long)]
    quick: bool,
    #[command(flatten)]
    pub socket: crate::SocketArg,
}

/// `agora insitu-analytics` (started by the benchmark): the analytics side.
#[derive(Args, Debug)]
pub struct AnalyticsArgs {
    /// The run's name prefix (exports are `PREFIX/control`, `PREFIX/state[.K]`).
    #[arg(long)]
    prefix: String,
    /// Answer as soon as attached (else after STREAM).
    #[arg(long)]
    asynchronous: bool,
    /// A new export at every point (else one for the run).
    #[arg(long)]
    recurring: bool,
    #[command(flatten)]
    pub socket: crate::SocketArg,
}

/// What the analytics process reports at its end (one JSON line).
#[derive(Serialize, Deserialize, Debug, Default)]
struct AnalyticsReport {
    /// Microseconds of each attach.
    attach_us: Vec<f64>,
    /// Seconds of each private copy + STREAM pass.
    stream_s: Vec<f64>,
    /// STREAM triad bandwidth of the last pass, GB/s.
    triad_gb_s: f64,
}

#[derive(Serialize, Debug)]
struct Configuration {
    name: &'static str,
    /// Seconds of the whole simulation run.
    seconds: Spread,
    /// Median over repetitions of (this / alone) - 1, each pair run back to back.
    overhead: f64,
}

#[derive(Serialize, Debug)]
struct Report {
    iterations: u64,
    interval: u64,
    communication_points: u64,
    rows: usize,
    region_bytes: u64,
    repetitions: usize,
    simulation_alone_s: Spread,
    configurations: Vec<Configuration>,
    /// p50 of the analytics' attaches in the recurring configurations (region_bytes each).
    recurring_attach_us: f64,
    /// The analytics' one attach in the one-time configurations (median over runs).
    one_time_attach_us: f64,
    /// Attaching (and dropping) a fresh 512 MiB export, p50 / p99 over 50, microseconds.
    attach_512mib_us: f64,
    attach_512mib_p99_us: f64,
    /// Asynchronous analytics (one-time and recurring, the larger): simulation time / alone - 1.
    async_insitu_overhead: f64,
    /// Synchronous analytics, the larger of the two attachment models.
    sync_insitu_overhead: f64,
    /// A level-1 checkpoint at every point: simulation time / alone - 1.
    checkpoint_l1_overhead: f64,
    checkpoint_l2_overhead: f64,
    checkpoint_l3_overhead: f64,
    /// A checkpointed run stopped half way and recovered by a new session finished with the
    /// uninterrupted run's solution, bit for bit.
    recovered_exact: bool,
    /// CG residual norm at the end (sanity: it decreased).
    final_residual: f64,
    load_average_at_start: Option<f64>,
}

fn session(socket: &std::path::Path, name: &str) -> Result<Session> {
    Ok(Session::connect_with(SessionOptions {
        socket: Some(socket.to_path_buf()),
        name: Some(name.into()),
        heap_bytes: Some(1 << 30),
        ..Default::default()
    })?)
}

/// A word of a shared buffer, accessed atomically (the mailbox of the two processes).
fn word(buffer: &Buffer, index: usize) -> &AtomicU64 {
    let words = buffer.as_slice::<u64>();
    assert!(index < words.len());
    // SAFETY: the buffer's memory is mapped for as long as `buffer` lives (the returned
    // reference borrows it), 64-byte aligned, and every process touches these words only
    // through atomics.
    unsafe { AtomicU64::from_ptr(words.as_ptr().add(index).cast_mut()) }
}

/// Waits until `condition` holds, sleeping a little between looks (two processes on two cores
/// must not spin against each other).
fn wait_until(what: &str, mut condition: impl FnMut() -> bool) -> Result<()> {
    let deadline = Instant::now() + Duration::from_secs(120);
    let mut spins = 0u32;
    while !condition() {
        if Instant::now() > deadline {
            bail!("in situ: {what} did not happen within 120 s");
        }
        spins += 1;
        if spins < 64 {
            std::hint::spin_loop();
        } else {
            std::thread::sleep(Duration::from_micros(20));
        }
    }
    Ok(())
}

/// HPCCG's CG on Agora: the matrix, the vectors, and where the iteration is.
struct Solver {
    session: Session,
    queue: Queue,
    spmv: Kernel,
    dot: Kernel,
    waxpby: Kernel,
    row_ptr: Buffer,
    cols: Buffer,
    vals: Buffer,
    x: Buffer,
    r: Buffer,
    p: Buffer,
    ap: Buffer,
    tmp: Buffer,
    partial: Buffer,
    /// [iteration, r·r as f32 bits]: protected with the vectors, so a restart resumes exactly.
    scalars: Buffer,
    rows: usize,
    nnz: usize,
    iteration: u64,
    rtrans: f32,
}

impl Solver {
    fn new(socket: &std::path::Path, name: &str, grid: usize) -> Result<Self> {
        let session = session(socket, name)?;
        let (a, b, _) = problem(grid, grid, grid);
        let rows = a.rows;
        let blocks = rows.div_ceil(1024);
        let queue = session.queue("cg")?;
        let solver = Solver {
            spmv: session.kernel("hpccg.spmv")?,
            dot: session.kernel("hpccg.dot")?,
            waxpby: session.kernel("hpccg.waxpby")?,
            row_ptr: session.buffer_from(&a.row_ptr)?,
            cols: session.buffer_from(&a.cols)?,
            vals: session.buffer_from(&a.vals)?,
            x: session.buffer_from(&vec![0f32; rows])?,
            r: session.buffer_from(&b)?,
            p: session.buffer_from(&vec![0f32; rows])?,
            ap: session.buffer_from(&vec![0f32; rows])?,
            tmp: session.buffer_from(&vec![0f32; rows])?,
            partial: session.buffer_from(&vec![0f32; blocks])?,
            scalars: session.buffer_from(&[0u64; 2])?,
            rows,
            nnz: a.cols.len(),
            iteration: 0,
            rtrans: 0.0,
            queue,
            session,
        };
        // x0 = 0, so r0 = b - A·0 = b.
        for b in [&solver.row_ptr, &solver.cols, &solver.vals, &solver.x, &solver.r] {
            solver.queue.sync_to(b)?;
        }
        solver.queue.finish()?;
        Ok(solver)
    }

    fn dot(&self, x: &Buffer, y: &Buffer) -> Result<f32> {
        let n = self.rows as i32;
        let blocks = self.rows.div_ceil(1024) as u64;
        self.queue.launch(
            &self.dot,
            &[Arg::I32(n), x.into(), y.into(), (&self.partial).into()],
            blocks,
        )?;
        self.queue.sync_from(&self.partial)?;
        self.queue.finish()?;
        // In order, as the kernel's contract says: the sum is the same in every run.
        Ok(self.partial.as_slice::<f32>().iter().sum())
    }

    fn waxpby(&self, alpha: f32, x: &Buffer, beta: f32, y: &Buffer, w: &Buffer) -> Result<()> {
        self.queue.launch(
            &self.waxpby,
            &[Arg::F32(alpha), x.into(), Arg::F32(beta), y.into(), w.into()],
            self.rows as u64,
        )?;
        Ok(())
    }

    /// One CG iteration (HPCCG's loop body).
    fn step(&mut self) -> Result<()> {
        self.iteration += 1;
        if self.iteration == 1 {
            self.rtrans = self.dot(&self.r, &self.r)?;
            self.waxpby(1.0, &self.r, 0.0, &self.r, &self.p)?;
        } else {
            let old = self.rtrans;
            self.rtrans = self.dot(&self.r, &self.r)?;
            let beta = finite(self.rtrans / old);
            self.waxpby(1.0, &self.r, beta, &self.p, &self.tmp)?;
            self.queue.copy(&self.tmp, 0, &self.p, 0, 0)?;
        }
        self.queue.launch(
            &self.spmv,
            &[
                (&self.row_ptr).into(),
                (&self.cols).into(),
                (&self.vals).into(),
                (&self.p).into(),
                (&self.ap).into(),
                Arg::I32(self.rows as i32),
                Arg::I32(self.nnz as i32),
            ],
            self.rows as u64,
        )?;
        let alpha = finite(self.rtrans / self.dot(&self.p, &self.ap)?);
        self.waxpby(1.0, &self.x, alpha, &self.p, &self.tmp)?;
        self.queue.copy(&self.tmp, 0, &self.x, 0, 0)?;
        self.waxpby(1.0, &self.r, -alpha, &self.ap, &self.tmp)?;
        self.queue.copy(&self.tmp, 0, &self.r, 0, 0)?;
        Ok(())
    }

    fn protect(&self) -> Result<()> {
        self.session.protect(1, &self.x)?;
        self.session.protect(2, &self.r)?;
        self.session.protect(3, &self.p)?;
        self.session.protect(4, &self.scalars)?;
        Ok(())
    }

    /// A checkpoint of the state after the current iteration, as a task of the queue.
    fn checkpoint(&self, id: u64, level: CheckpointLevel) -> Result<()> {
        self.queue.finish()?;
        self.scalars
            .write_slice(&[self.iteration, u64::from(self.rtrans.to_bits())])?;
        self.queue.sync_to(&self.scalars)?;
        self.queue.checkpoint(id, level)?;
        Ok(())
    }

    /// Restores the state from the application's newest checkpoint.
    fn recover(&mut self) -> Result<u64> {
        self.protect()?;
        let report = self.session.recover()?;
        let [iteration, bits] = <[u64; 2]>::try_from(self.scalars.read_vec::<u64>().as_slice())
            .map_err(|_| anyhow::anyhow!("the recovered scalars are not two words"))?;
        self.iteration = iteration;
        self.rtrans = f32::from_bits(bits as u32);
        for b in [&self.x, &self.r, &self.p] {
            self.queue.sync_to(b)?;
        }
        self.queue.finish()?;
        Ok(report.checkpoint)
    }

    fn solution(&self) -> Result<Vec<f32>> {
        self.queue.sync_from(&self.x)?;
        self.queue.finish()?;
        Ok(self.x.read_vec())
    }

    fn residual(&self) -> Result<f64> {
        Ok(f64::from(self.dot(&self.r, &self.r)?).sqrt())
    }
}

fn finite(value: f32) -> f32 {
    if value.is_finite() {
        value
    } else {
        0.0
    }
}

/// What runs beside the simulation in one run.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Mode {
    Alone,
    Insitu { asynchronous: bool, recurring: bool },
    Checkpoint(CheckpointLevel),
}

struct Setup<'a> {
    socket: &'a std::path::Path,
    grid: usize,
    iterations: u64,
    interval: u64,
    region_bytes: u64,
}

/// One simulation run; returns its seconds, the analytics' report (in situ modes) and the
/// final solution.
fn simulate(setup: &Setup<'_>, mode: Mode, run: usize) -> Result<(f64, Option<AnalyticsReport>, Vec<f32>)> {
    let name = format!("insitu-sim-{}-{run}", std::process::id());
    let mut solver = Solver::new(setup.socket, &name, setup.grid)?;
    let readers = ExportReaders::default();
    let prefix = format!("insitu/{}/{run}", std::process::id());
    let mut analytics = None;
    let mut control = None;
    let mut region = None;
    if let Mode::Insitu {
        asynchronous,
        recurring,
    } = mode
    {
        let mailbox = solver.session.shared_buffer(64)?;
        solver
            .session
            .export(&mailbox, &format!("{prefix}/control"), &readers, true)?;
        if !recurring {
            let state = solver.session.shared_buffer(setup.region_bytes)?;
            solver
                .session
                .export(&state, &format!("{prefix}/state"), &readers, false)?;
            region = Some(state);
        }
        let mut command = std::process::Command::new(std::env::current_exe()?);
        command
            .args(["insitu-analytics", "--prefix", &prefix, "--socket"])
            .arg(setup.socket)
            .stdout(std::process::Stdio::piped());
        if asynchronous {
            command.arg("--asynchronous");
        }
        if recurring {
            command.arg("--recurring");
        }
        analytics = Some(command.spawn().context("starting the analytics process")?);
        control = Some(mailbox);
    }
    if let Mode::Checkpoint(_) = mode {
        solver.protect()?;
    }
    if let Some(mailbox) = &control {
        // The clock starts once the analytics process is up and attached to the mailbox.
        wait_until("the analytics process's start", || {
            word(mailbox, 3).load(Ordering::Acquire) == 1
        })?;
    }
    let started = Instant::now();
    let mut point = 0u64;
    while solver.iteration < setup.iterations {
        solver.step()?;
        if solver.iteration % setup.interval != 0 {
            continue;
        }
        point += 1;
        match mode {
            Mode::Alone => {}
            Mode::Checkpoint(level) => solver.checkpoint(point, level)?,
            Mode::Insitu { recurring, .. } => {
                let mailbox = control.as_ref().expect("in situ has a mailbox");
                let bytes = (solver.rows as u64 * 4).min(setup.region_bytes);
                if recurring {
                    let state = solver.session.shared_buffer(setup.region_bytes)?;
                    solver.queue.copy(&solver.x, 0, &state, 0, bytes)?;
                    solver.queue.finish()?;
                    solver
                        .session
                        .export(&state, &format!("{prefix}/state.{point}"), &readers, false)?;
                    // The previous region goes (its export ends); the analytics may still map it.
                    region = Some(state);
                } else {
                    let state = region.as_ref().expect("a one-time region");
                    solver.queue.copy(&solver.x, 0, state, 0, bytes)?;
                    solver.queue.finish()?;
                }
                word(mailbox, 0).store(point, Ordering::Release);
                wait_until("the analytics' answer", || {
                    word(mailbox, 1).load(Ordering::Acquire) >= point
                })?;
            }
        }
    }
    solver.queue.finish()?;
    let seconds = started.elapsed().as_secs_f64();
    let mut report = None;
    if let (Some(child), Some(mailbox)) = (analytics, control.as_ref()) {
        word(mailbox, 2).store(1, Ordering::Release);
        let output = child.wait_with_output()?;
        if !output.status.success() {
            bail!("the analytics process failed ({})", output.status);
        }
        let text = String::from_utf8_lossy(&output.stdout);
        let line = text.lines().last().context("the analytics printed no report")?;
        report = Some(serde_json::from_str(line).context("the analytics' report")?);
    }
    drop(region);
    Ok((seconds, report, solver.solution()?))
}

/// Runs the analytics side (`agora insitu-analytics`).
pub fn analytics(args: AnalyticsArgs) -> Result<()> {
    let socket = agora_transport::socket::socket_path(args.socket.path());
    let session = session(&socket, "insitu-analytics")?;
    let mailbox = session.attach(&format!("{}/control", args.prefix), true)?;
    word(&mailbox, 3).store(1, Ordering::Release);
    let mut report = AnalyticsReport::default();
    let mut attached: Option<Buffer> = None;
    let mut private: Vec<f32> = Vec::new();
    let (mut b, mut c) = (Vec::new(), Vec::new());
    let mut seen = 0u64;
    loop {
        wait_until("the simulation's signal", || {
            word(&mailbox, 0).load(Ordering::Acquire) > seen || word(&mailbox, 2).load(Ordering::Acquire) == 1
        })?;
        let point = word(&mailbox, 0).load(Ordering::Acquire);
        if point == seen {
            break; // stopped
        }
        seen = point;
        if args.recurring || attached.is_none() {
            let name = if args.recurring {
                format!("{}/state.{point}", args.prefix)
            } else {
                format!("{}/state", args.prefix)
            };
            let started = Instant::now();
            let state = session.attach(&name, false)?;
            report.attach_us.push(started.elapsed().as_secs_f64() * 1e6);
            attached = Some(state); // the previous attachment is dropped here
        }
        if args.asynchronous {
            word(&mailbox, 1).store(point, Ordering::Release);
        }
        let state = attached.as_ref().expect("attached above");
        let started = Instant::now();
        private.clear();
        private.extend_from_slice(state.as_slice::<f32>());
        report.triad_gb_s = stream(&mut private, &mut b, &mut c);
        report.stream_s.push(started.elapsed().as_secs_f64());
        if !args.asynchronous {
            word(&mailbox, 1).store(point, Ordering::Release);
        }
    }
    println!("{}", serde_json::to_string(&report)?);
    Ok(())
}

/// STREAM's copy, scale, add and triad over `a` (with `b`, `c` of its length); returns the
/// triad's bandwidth, GB/s.
fn stream(a: &mut [f32], b: &mut Vec<f32>, c: &mut Vec<f32>) -> f64 {
    let n = a.len();
    b.resize(n, 0.0);
    c.resize(n, 0.0);
    let scalar = 3.0f32;
    c.copy_from_slice(a);
    for (bi, ci) in b.iter_mut().zip(c.iter()) {
        *bi = scalar * ci;
    }
    for ((ci, ai), bi) in c.iter_mut().zip(a.iter()).zip(b.iter()) {
        *ci = ai + bi;
    }
    let started = Instant::now();
    for ((ai, bi), ci) in a.iter_mut().zip(b.iter()).zip(c.iter()) {
        *ai = bi + scalar * ci;
    }
    let seconds = started.elapsed().as_secs_f64().max(1e-9);
    std::hint::black_box(&a);
    (3 * n * 4) as f64 / seconds / 1e9
}

/// Attaching a fresh 512 MiB export and dropping it, `count` times: microseconds each.
fn attach_512mib(socket: &std::path::Path, count: usize) -> Result<Vec<f64>> {
    let exporter = session(socket, "insitu-attach-exporter")?;
    let attacher = session(socket, "insitu-attach-attacher")?;
    let mut times = Vec::with_capacity(count);
    for i in 0..count {
        let region = exporter.shared_buffer(512 << 20)?;
        let name = format!("insitu/attach/{}/{i}", std::process::id());
        exporter.export(&region, &name, &ExportReaders::default(), false)?;
        let started = Instant::now();
        let attached = attacher.attach(&name, false)?;
        times.push(started.elapsed().as_secs_f64() * 1e6);
        drop(attached);
        drop(region);
    }
    Ok(times)
}

/// Runs `agora bench insitu`.
pub fn insitu(socket: Option<std::path::PathBuf>, args: InsituArgs) -> Result<()> {
    let say = |line: String| {
        if !args.json {
            println!("{line}");
        }
    };
    let load_average_at_start = super::harness::load_average_at_start();
    let iterations = args.iterations.unwrap_or(if args.quick { 60 } else { 600 }).max(2);
    let interval = args
        .interval
        .unwrap_or(if args.quick { 4 } else { 40 })
        .clamp(1, iterations);
    let grid = args.grid.unwrap_or(if args.quick { 12 } else { 32 }).max(2);
    let region_bytes = args.region_mib.unwrap_or(if args.quick { 2 } else { 64 }).max(1) << 20;
    let reps = args.repetitions.unwrap_or(if args.quick { 1 } else { 3 }).max(1);

    // The benchmark's checkpoint directories and configuration.
    let dir = ScratchDir::new("bench-insitu")?;
    let config = dir.path().join("agora.toml");
    std::fs::write(
        &config,
        format!(
            "[checkpoint]\nlocal = \"{}\"\npartner = \"{}\"\n",
            dir.path().join("local").display(),
            dir.path().join("partner").display()
        ),
    )?;
    let config_arg = config.display().to_string();
    let daemon = DaemonProcess::start(socket.as_deref(), &["--no-opencl", "--config", &config_arg])?;
    let setup = Setup {
        socket: &daemon.socket,
        grid,
        iterations,
        interval,
        region_bytes,
    };
    let modes: [(&'static str, Mode); 7] = [
        (
            "sync, one-time attach",
            Mode::Insitu {
                asynchronous: false,
                recurring: false,
            },
        ),
        (
            "sync, recurring attach",
            Mode::Insitu {
                asynchronous: false,
                recurring: true,
            },
        ),
        (
            "async, one-time attach",
            Mode::Insitu {
                asynchronous: true,
                recurring: false,
            },
        ),
        (
            "async, recurring attach",
            Mode::Insitu {
                asynchronous: true,
                recurring: true,
            },
        ),
        ("checkpoint L1 every point", Mode::Checkpoint(CheckpointLevel::Local)),
        ("checkpoint L2 every point", Mode::Checkpoint(CheckpointLevel::Partner)),
        ("checkpoint L3 every point", Mode::Checkpoint(CheckpointLevel::Erasure)),
    ];
    say(format!(
        "in situ: CG on {grid}³ = {} rows, {iterations} iterations, a communication point every {interval} ({} points), {} MiB region, {reps} repetition(s)",
        grid * grid * grid,
        iterations / interval,
        region_bytes >> 20
    ));
    let mut alone = Vec::new();
    let mut times: Vec<Vec<f64>> = vec![Vec::new(); modes.len()];
    let mut ratios: Vec<Vec<f64>> = vec![Vec::new(); modes.len()];
    let (mut recurring_attaches, mut one_time_attaches) = (Vec::new(), Vec::new());
    let mut reference = Vec::new();
    let mut run = 0;
    for rep in 0..reps {
        let (base, _, solution) = simulate(&setup, Mode::Alone, run)?;
        run += 1;
        alone.push(base);
        reference = solution;
        say(format!("run {}: simulation alone {:.3} s", rep + 1, base));
        for (index, (name, mode)) in modes.iter().enumerate() {
            let (seconds, report, solution) = simulate(&setup, *mode, run)?;
            run += 1;
            if solution != reference {
                bail!("{name}: the simulation's solution differs from the run alone's");
            }
            times[index].push(seconds);
            ratios[index].push(seconds / base - 1.0);
            if let (Some(report), Mode::Insitu { recurring, .. }) = (&report, mode) {
                if *recurring {
                    recurring_attaches.extend(&report.attach_us);
                } else {
                    one_time_attaches.extend(&report.attach_us);
                }
                if report.stream_s.len() as u64 != iterations / interval {
                    bail!(
                        "{name}: the analytics ran {} times, expected {}",
                        report.stream_s.len(),
                        iterations / interval
                    );
                }
            }
            say(format!(
                "  {name:<28} {:.3} s ({:+.1} %)",
                seconds,
                100.0 * (seconds / base - 1.0)
            ));
        }
    }

    // Recovery: a checkpointed run stopped half way, recovered and finished by a new session.
    let half = (iterations / interval / 2).max(1) * interval;
    let name = format!("insitu-restart-{}", std::process::id());
    {
        let mut solver = Solver::new(&daemon.socket, &name, grid)?;
        solver.protect()?;
        let mut point = 0;
        while solver.iteration < half {
            solver.step()?;
            if solver.iteration % interval == 0 {
                point += 1;
                solver.checkpoint(point, CheckpointLevel::Local)?;
            }
        }
        solver.queue.finish()?;
        wait_written(&solver.session)?;
        // The run ends here, as a crash would end it (the checkpoints are the daemon's).
    }
    let mut resumed = Solver::new(&daemon.socket, &name, grid)?;
    let from = resumed.recover()?;
    while resumed.iteration < iterations {
        resumed.step()?;
    }
    let recovered_exact = resumed.solution()? == reference;
    let final_residual = resumed.residual()?;
    if !recovered_exact {
        bail!("the run recovered from checkpoint {from} did not end with the uninterrupted run's solution");
    }
    say(format!(
        "recovered from checkpoint {from} (iteration {half}) and finished: solution identical bit for bit (residual {final_residual:.3e})"
    ));

    let attach_big = attach_512mib(&daemon.socket, if args.quick { 10 } else { 50 })?;
    let mut sorted: Vec<u64> = attach_big.iter().map(|&t| t as u64).collect();
    sorted.sort_unstable();
    let med = |v: &[f64]| if v.is_empty() { 0.0 } else { median(v) };
    let overhead = |index: usize| med(&ratios[index]);
    let report = Report {
        iterations,
        interval,
        communication_points: iterations / interval,
        rows: grid * grid * grid,
        region_bytes,
        repetitions: reps,
        simulation_alone_s: spread(&alone),
        configurations: modes
            .iter()
            .enumerate()
            .map(|(i, (name, _))| Configuration {
                name,
                seconds: spread(&times[i]),
                overhead: overhead(i),
            })
            .collect(),
        recurring_attach_us: med(&recurring_attaches),
        one_time_attach_us: med(&one_time_attaches),
        attach_512mib_us: percentile(&sorted, 0.5) as f64,
        attach_512mib_p99_us: percentile(&sorted, 0.99) as f64,
        async_insitu_overhead: overhead(2).max(overhead(3)),
        sync_insitu_overhead: overhead(0).max(overhead(1)),
        checkpoint_l1_overhead: overhead(4),
        checkpoint_l2_overhead: overhead(5),
        checkpoint_l3_overhead: overhead(6),
        recovered_exact,
        final_residual,
        load_average_at_start,
    };
    if args.json {
        println!("{}", serde_json::to_string_pretty(&report)?);
    } else {
        println!(
            "attach: one-time {:.1} µs, recurring p50 {:.1} µs ({} MiB regions), a 512 MiB region p50 {:.1} µs (p99 {:.1})",
            report.one_time_attach_us,
            report.recurring_attach_us,
            region_bytes >> 20,
            report.attach_512mib_us,
            report.attach_512mib_p99_us
        );
        println!(
            "overhead vs the simulation alone (median of runs): async in situ {:+.1} %, sync {:+.1} %, checkpoints L1 {:+.1} % / L2 {:+.1} % / L3 {:+.1} %",
            100.0 * report.async_insitu_overhead,
            100.0 * report.sync_insitu_overhead,
            100.0 * report.checkpoint_l1_overhead,
            100.0 * report.checkpoint_l2_overhead,
            100.0 * report.checkpoint_l3_overhead
        );
    }
    Ok(())
}

/// Waits until the daemon has written every checkpoint the session's application captured.
fn wait_written(session: &Session) -> Result<()> {
    let deadline = Instant::now() + Duration::from_secs(120);
    loop {
        let report = session.checkpoints()?;
        if report.writing == 0 {
            if let Some(failed) = report.writes.iter().find(|w| w.error.is_some()) {
                bail!("checkpoint {} failed: {:?}", failed.checkpoint, failed.error);
            }
            return Ok(());
        }
        if Instant::now() > deadline {
            bail!("checkpoints still being written after 120 s");
        }
        std::thread::sleep(Duration::from_millis(10));
    }
}
