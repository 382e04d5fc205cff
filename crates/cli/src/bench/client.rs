//! The client side of the benchmarks, in its own process (`agora bench-client MODE`), and the
//! helpers that start such processes and collect their JSON results.

use std::io::{BufRead, BufReader, Write};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use agora::{Session, SessionOptions};
use anyhow::{bail, Context, Result};
use clap::{Args, ValueEnum};
use serde::{Deserialize, Serialize};

use super::harness::{monotonic_ns, percentile};

/// What a benchmark client process measures.
#[derive(ValueEnum, Clone, Copy, Debug)]
pub enum ClientMode {
    /// One noop at a time: launch, wait, repeat; report the round-trip distribution.
    Latency,
    /// Many noops in flight on one queue; report start and end timestamps.
    Throughput,
    /// As `latency`, on a queue that prefers the OpenCL device (the empty-kernel round trip).
    OpenclLatency,
    /// A control call right after a task: launch a noop, wait, then time one control round
    /// trip (a 64-byte buffer's allocation; released through the ring), `--iterations` times.
    Control,
    /// One noop at a time with a completion callback (`Task::on_complete`): the time from the
    /// launch to the callback running on the session's waiting thread, `--iterations` times.
    Callback,
    /// Open a session, run one task, then sit idle for `--iterations` milliseconds.
    Idle,
    /// Run workload `--app` at `--size` `--iterations` times after a warm-up; print each time.
    /// With `--stepwise`: once per `run` line on stdin instead.
    Workload,
    /// sync_to + fill + sync_from of `--size` bytes, `--iterations` times after a warm-up.
    /// With `--stepwise`: once per `run` line on stdin instead.
    Transfer,
    /// Verified rounds (sync_to, fill, saxpy, copy, sync_from over `--size` floats) until stdin
    /// closes, printing a [`SoakReport`] line of counts every 200 ms (`agora bench soak`).
    Soak,
    /// An MPI-style rank: `--iterations` bursts of [`PIPELINE_DEPTH`] `sgemm` launches of order
    /// `--size` (default 256) on one queue that prefers no device, each burst then `finish`;
    /// the product verified at the end (`agora bench sharing`'s fairness part).
    Pipeline,
}

/// Launches in flight per burst of [`ClientMode::Pipeline`].
pub(crate) const PIPELINE_DEPTH: u64 = 64;

/// `agora bench-client` options.
#[derive(Args, Debug)]
pub struct ClientArgs {
    /// What to measure.
    mode: ClientMode,
    /// Round trips, tasks, or idle milliseconds.
    #[arg(long)]
    iterations: u64,
    /// Print "ready" and wait for a line on stdin before starting (to start several at once).
    #[arg(long)]
    wait_go: bool,
    /// Workload and transfer modes: after the warm-up print "ready", then run once per `run`
    /// line read from stdin, printing each run's result as a JSON line, until stdin closes (so a
    /// benchmark can interleave these runs with its baseline's). `--iterations` is ignored.
    #[arg(long)]
    stepwise: bool,
    /// Workload name (workload mode).
    #[arg(long)]
    app: Option<String>,
    /// Workload size, or bytes (transfer mode).
    #[arg(long)]
    size: Option<u64>,
    /// Transfer mode: an exportable buffer (`shared_buffer`: its host copy a memory region of
    /// its own, as exports and attachments have) instead of one in the session's heap.
    #[arg(long)]
    shared: bool,
    /// Preferred device kind (cpu, opencl, cuda, sim).
    #[arg(long)]
    device_kind: Option<String>,
    /// Soak and the latency modes: a latency-class queue (else batch).
    #[arg(long)]
    latency_class: bool,
    #[command(flatten)]
    pub socket: crate::SocketArg,
}

#[derive(Serialize, Deserialize, Debug, Default, Clone)]
pub(crate) struct RepeatResult {
    pub(crate) seconds: Vec<f64>,
    pub(crate) verified: bool,
    /// Stepwise: when the timed part of the run began, nanoseconds of the system's monotonic clock
    /// (the same in every process), so runs of two clients can be laid on one time line.
    #[serde(default)]
    pub(crate) started_ns: u64,
}

fn device_kind(name: Option<&str>) -> Option<agora::DeviceKind> {
    name.and_then(agora::DeviceKind::parse)
}

/// Workload and transfer modes of the client.
fn client_repeat(socket: Option<PathBuf>, args: &ClientArgs) -> Result<()> {
    let session = Session::connect_with(SessionOptions {
        socket,
        name: Some("bench-overhead".into()),
        heap_bytes: None,
        control_timeout: None,
        reconnect_timeout: None,
    })?;
    let kind = device_kind(args.device_kind.as_deref());
    // One run: its seconds, whether its result was right, and when its timed part began.
    let mut run: Box<dyn FnMut() -> Result<(f64, bool, u64)>> = match args.mode {
        ClientMode::Workload => {
            let app = args.app.as_deref().context("--app")?;
            let workload = agora_apps::build(app, args.size.context("--size")?, None).context("unknown app")?;
            let session = &session;
            // The next run's buffers are made ready after each run, outside its time, so a
            // stepwise run starts its steps as soon as it is asked (two clients asked at once
            // start together).
            let mut prepared = None;
            Box::new(move || {
                let ready = match prepared.take() {
                    Some(ready) => ready,
                    None => agora_apps::prepare_on_agora(session, &workload, kind)?,
                };
                let started_ns = monotonic_ns();
                let r = ready.run(session, &workload)?;
                prepared = Some(agora_apps::prepare_on_agora(session, &workload, kind)?);
                Ok((r.seconds, r.verified, started_ns))
            })
        }
        ClientMode::Transfer => {
            let bytes = args.size.context("--size")?;
            let queue = agora_apps::queue(&session, "transfer", kind)?;
            let fill = session.kernel("fill")?;
            let mut buffer = if args.shared {
                session.shared_buffer(bytes)?
            } else {
                session.buffer(bytes)?
            };
            let n = bytes / 4;
            Box::new(move || {
                // A value on every page that only this run's fill can restore.
                buffer
                    .as_mut_slice::<f32>()
                    .iter_mut()
                    .step_by(1024)
                    .for_each(|v| *v = 0.0);
                let started_ns = monotonic_ns();
                let t = Instant::now();
                let _ = queue.sync_to(&buffer)?;
                let _ = queue.launch(&fill, &[agora::Arg::F32(1.5), (&buffer).into()], n)?;
                let _ = queue.sync_from(&buffer)?;
                queue.finish()?;
                let seconds = t.elapsed().as_secs_f64();
                Ok((seconds, buffer.as_slice::<f32>().iter().all(|v| *v == 1.5), started_ns))
            })
        }
        _ => unreachable!("other modes are handled by client()"),
    };
    let (_, mut verified, _) = run()?; // warm-up
    if args.stepwise {
        println!("ready");
        std::io::stdout().flush()?;
        for line in std::io::stdin().lines() {
            if line?.trim() != "run" {
                break;
            }
            let (seconds, ok, started_ns) = run()?;
            verified &= ok;
            println!(
                "{}",
                serde_json::to_string(&RepeatResult {
                    seconds: vec![seconds],
                    verified,
                    started_ns,
                })?
            );
            std::io::stdout().flush()?;
        }
        return Ok(());
    }
    let mut result = RepeatResult::default();
    for _ in 0..args.iterations {
        let (seconds, ok, _) = run()?;
        verified &= ok;
        result.seconds.push(seconds);
    }
    result.verified = verified;
    println!("{}", serde_json::to_string(&result)?);
    Ok(())
}

/// What a soak-mode client did since its previous line.
#[derive(Serialize, Deserialize, Debug, Default, Clone)]
pub(crate) struct SoakReport {
    /// Rounds completed and checked.
    pub(crate) rounds: u64,
    /// Tasks those rounds issued.
    pub(crate) tasks: u64,
    /// Rounds whose result was wrong.
    pub(crate) wrong: u64,
    /// The first wrong value seen, described (empty when none).
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub(crate) detail: String,
    /// Longest round, nanoseconds.
    pub(crate) max_round_ns: u64,
}

/// Tasks in one soak round.
const SOAK_TASKS_PER_ROUND: u64 = 7;

/// Soak mode: verified rounds until stdin closes (or the process is killed), a [`SoakReport`]
/// line every 200 ms and a last one at the end. Every 64 rounds the buffers are released and
/// allocated again, so the daemon sees registrations come and go, not only tasks.
fn client_soak(socket: Option<PathBuf>, args: &ClientArgs) -> Result<()> {
    let n = args.size.unwrap_or(4096).max(1);
    let bytes = n * 4;
    let session = Session::connect_with(SessionOptions {
        socket,
        name: Some(
            if args.latency_class {
                "bench-soak-latency"
            } else {
                "bench-soak-batch"
            }
            .into(),
        ),
        heap_bytes: Some((bytes * 3 * 2).max(4 << 20)),
        control_timeout: None,
        reconnect_timeout: None,
    })?;
    let queue = session.queue_with(agora::QueueOptions {
        name: "soak".into(),
        class: if args.latency_class {
            agora::QueueClass::Latency
        } else {
            agora::QueueClass::Batch
        },
        preferred_device: device_kind(args.device_kind.as_deref()),
        sla: None,
    })?;
    let fill = session.kernel("fill")?;
    let saxpy = session.kernel("saxpy")?;
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    {
        let stop = stop.clone();
        std::thread::spawn(move || {
            // Until stdin closes (the benchmark's way of ending the run).
            for line in std::io::stdin().lines() {
                if line.is_err() {
                    break;
                }
            }
            stop.store(true, std::sync::atomic::Ordering::Relaxed);
        });
    }
    let emit = |report: &mut SoakReport| -> Result<()> {
        let mut out = std::io::stdout().lock();
        writeln!(out, "{}", serde_json::to_string(&report)?)?;
        out.flush()?;
        *report = SoakReport::default();
        Ok(())
    };
    let mut buffers = None;
    let mut report = SoakReport::default();
    let mut last = Instant::now();
    let mut round: u64 = 0;
    while !stop.load(std::sync::atomic::Ordering::Relaxed) {
        if round.is_multiple_of(64) {
            drop(buffers.take()); // released before the next ones are allocated
            buffers = Some((session.buffer(bytes)?, session.buffer(bytes)?, session.buffer(bytes)?));
        }
        let Some((x, y, z)) = buffers.as_mut() else {
            unreachable!("allocated above")
        };
        round += 1;
        let started = Instant::now();
        // Values that only this round's tasks produce: y = a·x + v, exact in f32.
        let a = (1 + round % 3) as f32;
        let v = (round % 251) as f32;
        for (i, xi) in x.as_mut_slice::<f32>().iter_mut().enumerate() {
            *xi = ((i as u64 + round) % 113) as f32;
        }
        z.as_mut_slice::<f32>().fill(-1.0);
        let _ = queue.sync_to(x)?;
        let _ = queue.sync_to(z)?;
        let _ = queue.launch(&fill, &[agora::Arg::F32(v), (&*y).into()], n)?;
        let _ = queue.launch(&saxpy, &[agora::Arg::F32(a), (&*x).into(), (&*y).into()], n)?;
        let _ = queue.copy(y, 0, z, 0, 0)?;
        let _ = queue.sync_from(y)?;
        let _ = queue.sync_from(z)?;
        queue.finish()?;
        report.max_round_ns = report.max_round_ns.max(started.elapsed().as_nanos() as u64);
        report.rounds += 1;
        report.tasks += SOAK_TASKS_PER_ROUND;
        let x = x.as_slice::<f32>();
        let bad = [y.as_slice::<f32>(), z.as_slice::<f32>()].into_iter().find_map(|out| {
            out.iter()
                .zip(x)
                .position(|(o, xi)| *o != a * xi + v)
                .map(|i| (i, out[i]))
        });
        if let Some((i, got)) = bad {
            report.wrong += 1;
            if report.detail.is_empty() {
                report.detail = format!("round {round}: element {i} of {n} is {got}, expected {}", a * x[i] + v);
            }
        }
        if last.elapsed() >= Duration::from_millis(200) {
            emit(&mut report)?;
            last = Instant::now();
        }
    }
    emit(&mut report)
}

#[derive(Serialize, Deserialize, Debug, Default, Clone)]
pub(crate) struct ClientResult {
    pub(crate) tasks: u64,
    pub(crate) start_ns: u64,
    pub(crate) end_ns: u64,
    pub(crate) p50_ns: u64,
    pub(crate) p99_ns: u64,
    pub(crate) max_ns: u64,
    pub(crate) mean_ns: f64,
}

/// The client side, in its own process.
pub fn client(args: ClientArgs) -> Result<()> {
    let socket = args.socket.path();
    if matches!(args.mode, ClientMode::Workload | ClientMode::Transfer) {
        return client_repeat(socket, &args);
    }
    if matches!(args.mode, ClientMode::Soak) {
        return client_soak(socket, &args);
    }
    let session = Session::connect_with(SessionOptions {
        socket,
        name: Some(format!("bench-{:?}", args.mode).to_lowercase()),
        // A pipeline rank's three matrices need more than the noop modes' megabyte.
        heap_bytes: (!matches!(args.mode, ClientMode::Pipeline)).then_some(1 << 20),
        control_timeout: None,
        reconnect_timeout: None,
    })?;
    let class = if args.latency_class {
        agora::QueueClass::Latency
    } else {
        agora::QueueClass::Batch
    };
    let queue = match args.mode {
        ClientMode::OpenclLatency => session.queue_with(agora::QueueOptions {
            name: "bench opencl".into(),
            class,
            preferred_device: Some(agora::DeviceKind::OpenCl),
            sla: None,
        })?,
        // `--device-kind`: the latency round trip through one kind's lanes (with inline runs
        // off, the default policy would otherwise spread the noops over every device's lanes).
        _ => match device_kind(args.device_kind.as_deref()) {
            Some(kind) => session.queue_with(agora::QueueOptions {
                name: "bench".into(),
                class,
                preferred_device: Some(kind),
                sla: None,
            })?,
            None if args.latency_class => session.queue_with(agora::QueueOptions {
                name: "bench".into(),
                class,
                preferred_device: None,
                sla: None,
            })?,
            None => session.queue("bench")?,
        },
    };
    let noop = session.kernel("noop")?;
    // Warm up: page in the rings, let the spinners adapt.
    let warm_up = if matches!(args.mode, ClientMode::OpenclLatency) {
        200
    } else {
        2_000
    };
    for _ in 0..warm_up {
        queue.launch(&noop, &[], 1u64)?.wait()?;
    }
    if args.wait_go {
        println!("ready");
        std::io::stdout().flush()?;
        let mut line = String::new();
        std::io::stdin().read_line(&mut line)?;
    }
    let mut result = ClientResult {
        tasks: args.iterations,
        ..Default::default()
    };
    match args.mode {
        ClientMode::Latency | ClientMode::OpenclLatency => {
            let mut samples = Vec::with_capacity(args.iterations as usize);
            result.start_ns = monotonic_ns();
            for _ in 0..args.iterations {
                let t = Instant::now();
                queue.launch(&noop, &[], 1u64)?.wait()?;
                samples.push(t.elapsed().as_nanos() as u64);
            }
            result.end_ns = monotonic_ns();
            result.describe(samples);
        }
        ClientMode::Control => {
            let mut samples = Vec::with_capacity(args.iterations as usize);
            result.start_ns = monotonic_ns();
            for _ in 0..args.iterations {
                queue.launch(&noop, &[], 1u64)?.wait()?;
                let t = Instant::now();
                let buffer = session.buffer(64)?;
                samples.push(t.elapsed().as_nanos() as u64);
                drop(buffer);
            }
            result.end_ns = monotonic_ns();
            result.describe(samples);
        }
        ClientMode::Callback => {
            // The callback times itself (the caller's own wake-up afterwards is not part of
            // what a callback costs) and hands the time over.
            let (sender, told) = std::sync::mpsc::channel();
            let mut samples = Vec::with_capacity(args.iterations as usize);
            result.start_ns = monotonic_ns();
            for _ in 0..args.iterations {
                let sender = sender.clone();
                let t = Instant::now();
                queue.launch(&noop, &[], 1u64)?.on_complete(move |outcome| {
                    let _ = sender.send(outcome.map(|()| t.elapsed().as_nanos() as u64));
                });
                samples.push(told.recv().context("the callback ran")??);
            }
            result.end_ns = monotonic_ns();
            result.describe(samples);
        }
        ClientMode::Throughput => {
            result.start_ns = monotonic_ns();
            for _ in 0..args.iterations {
                let _ = queue.launch(&noop, &[], 1u64)?;
            }
            queue.finish()?;
            result.end_ns = monotonic_ns();
        }
        ClientMode::Idle => {
            std::thread::sleep(Duration::from_millis(args.iterations));
        }
        ClientMode::Pipeline => {
            let n = args.size.unwrap_or(256).clamp(1, 4096);
            let sgemm = session.kernel("sgemm")?;
            let elements = (n * n) as usize;
            let a = session.buffer_from(&vec![1.0f32; elements])?;
            let b = session.buffer_from(&vec![1.0f32; elements])?;
            let c = session.buffer((elements * 4) as u64)?;
            queue.sync_to(&a)?;
            queue.sync_to(&b)?;
            let order = agora::Arg::I32(n as i32);
            let args_of = [
                order,
                order,
                order,
                agora::Arg::F32(1.0),
                (&a).into(),
                (&b).into(),
                agora::Arg::F32(0.0),
                (&c).into(),
            ];
            queue.finish()?;
            result.tasks = args.iterations * PIPELINE_DEPTH;
            result.start_ns = monotonic_ns();
            for _ in 0..args.iterations {
                for _ in 0..PIPELINE_DEPTH {
                    let _ = queue.launch(&sgemm, &args_of, (n, n))?;
                }
                queue.finish()?;
            }
            result.end_ns = monotonic_ns();
            queue.sync_from(&c)?.wait()?;
            // C = 1·A·B + 0·C with A and B all ones: every element is n.
            if c.read_vec::<f32>().iter().any(|v| *v != n as f32) {
                bail!("sgemm {n}: wrong product");
            }
        }
        ClientMode::Workload | ClientMode::Transfer | ClientMode::Soak => unreachable!("handled above"),
    }
    println!("{}", serde_json::to_string(&result)?);
    Ok(())
}

impl ClientResult {
    /// Fills the distribution fields from one time per iteration, in nanoseconds.
    fn describe(&mut self, mut samples: Vec<u64>) {
        samples.sort_unstable();
        self.p50_ns = percentile(&samples, 0.50);
        self.p99_ns = percentile(&samples, 0.99);
        self.max_ns = *samples.last().unwrap_or(&0);
        self.mean_ns = samples.iter().sum::<u64>() as f64 / samples.len().max(1) as f64;
    }
}

/// Starts `count` client processes; with `wait_go` they start measuring together.
pub(crate) fn run_clients(socket: &Path, mode: ClientMode, iterations: u64, count: usize) -> Result<Vec<ClientResult>> {
    run_clients_with(socket, mode, iterations, count, &[])
}

/// [`run_clients`] with more `agora bench-client` options (`extra`).
pub(crate) fn run_clients_with(
    socket: &Path,
    mode: ClientMode,
    iterations: u64,
    count: usize,
    extra: &[&str],
) -> Result<Vec<ClientResult>> {
    let exe = std::env::current_exe()?;
    let mode_name = clap::ValueEnum::to_possible_value(&mode)
        .map(|v| v.get_name().to_string())
        .unwrap_or_else(|| format!("{mode:?}").to_lowercase());
    let mut children = Vec::new();
    for _ in 0..count {
        let mut cmd = Command::new(&exe);
        cmd.args(["bench-client", &mode_name, "--iterations", &iterations.to_string()])
            .args(extra)
            .arg("--socket")
            .arg(socket)
            .stdout(Stdio::piped())
            .stdin(Stdio::piped());
        if count > 1 {
            cmd.arg("--wait-go");
        }
        children.push(cmd.spawn().context("starting a benchmark client")?);
    }
    let mut readers = Vec::new();
    for child in &mut children {
        let stdout = child.stdout.take().context("client stdout")?;
        let mut reader = BufReader::new(stdout);
        if count > 1 {
            let mut line = String::new();
            reader.read_line(&mut line)?;
            if line.trim() != "ready" {
                bail!("a benchmark client failed to start: {line}");
            }
        }
        readers.push(reader);
    }
    for child in &mut children {
        if let Some(stdin) = child.stdin.as_mut() {
            writeln!(stdin, "go")?;
        }
    }
    let mut results = Vec::new();
    for (mut child, mut reader) in children.into_iter().zip(readers) {
        let mut line = String::new();
        reader.read_line(&mut line)?;
        let status = child.wait()?;
        if !status.success() {
            bail!("a benchmark client failed ({status})");
        }
        results.push(serde_json::from_str(line.trim()).with_context(|| format!("client output: {line}"))?);
    }
    Ok(results)
}

/// One stepwise run of a client.
#[derive(Debug, Clone, Copy)]
pub(crate) struct TimedRun {
    /// Seconds of its timed part.
    pub(crate) seconds: f64,
    /// Whether every result so far was right.
    pub(crate) verified: bool,
    /// When its timed part began, on the system's monotonic clock ([`monotonic_ns`]).
    pub(crate) started_ns: u64,
}

impl TimedRun {
    /// When its timed part ended, on the same clock.
    pub(crate) fn ended_ns(&self) -> u64 {
        self.started_ns + (self.seconds * 1e9) as u64
    }
}

/// A workload- or transfer-mode client process run step by step (`--stepwise`): one run per
/// [`StepClient::step`], so a benchmark can interleave them with its baseline's runs.
pub(crate) struct StepClient {
    child: std::process::Child,
    stdin: Option<std::process::ChildStdin>,
    stdout: BufReader<std::process::ChildStdout>,
}

impl StepClient {
    /// Starts the client (mode `mode`, options `extra`) and waits until it has warmed up.
    pub(crate) fn start(socket: &Path, mode: &str, extra: &[String]) -> Result<Self> {
        let mut child = Command::new(std::env::current_exe()?)
            .args(["bench-client", mode, "--stepwise", "--iterations", "0"])
            .args(extra)
            .arg("--socket")
            .arg(socket)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .context("starting a benchmark client")?;
        let stdin = child.stdin.take().context("client stdin")?;
        let stdout = BufReader::new(child.stdout.take().context("client stdout")?);
        let mut client = StepClient {
            child,
            stdin: Some(stdin),
            stdout,
        };
        let line = client.line()?;
        if line.trim() != "ready" {
            bail!("a benchmark client failed to start: {line}");
        }
        Ok(client)
    }

    fn line(&mut self) -> Result<String> {
        let mut line = String::new();
        if self.stdout.read_line(&mut line)? == 0 {
            let status = self.child.wait()?;
            bail!("a benchmark client stopped ({status})");
        }
        Ok(line)
    }

    /// Runs once: the seconds it took, and whether every result so far was right.
    pub(crate) fn step(&mut self) -> Result<(f64, bool)> {
        let run = self.timed_step()?;
        Ok((run.seconds, run.verified))
    }

    /// Runs once, saying when on the system's monotonic clock the timed part began.
    pub(crate) fn timed_step(&mut self) -> Result<TimedRun> {
        self.ask()?;
        self.answer()
    }

    /// Asks for one run without waiting for it ([`StepClient::answer`] reads its result): asking
    /// two clients first, then reading both, starts them together.
    pub(crate) fn ask(&mut self) -> Result<()> {
        let stdin = self.stdin.as_mut().context("client stdin")?;
        writeln!(stdin, "run")?;
        stdin.flush()?;
        Ok(())
    }

    /// The result of the run asked for last.
    pub(crate) fn answer(&mut self) -> Result<TimedRun> {
        let line = self.line()?;
        let result: RepeatResult =
            serde_json::from_str(line.trim()).with_context(|| format!("benchmark client output: {line}"))?;
        Ok(TimedRun {
            seconds: result.seconds.first().copied().unwrap_or(f64::NAN),
            verified: result.verified,
            started_ns: result.started_ns,
        })
    }

    /// Ends the client (closing its stdin) and waits for it.
    pub(crate) fn finish(mut self) -> Result<()> {
        drop(self.stdin.take());
        let status = self.child.wait()?;
        if !status.success() {
            bail!("a benchmark client failed ({status})");
        }
        Ok(())
    }
}

impl Drop for StepClient {
    fn drop(&mut self) {
        if self.stdin.take().is_some() {
            // Dropped on an error path: do not leave the process behind.
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}
