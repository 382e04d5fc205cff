//! `agora bench migrate`: what moving a queue between devices costs (issue #7, live migration).
//!
//! Both measurements run against a daemon process of their own (cpu + opencl + two identical
//! `sim` devices, each of the last three with memory of its own), steer placement only through
//! the admin drain request (`agora drain`), and verify results: a move that loses data fails
//! the benchmark.
//!
//! 1. **Move time.** A queue's N MiB of live buffers are written on device A (so A holds their
//!    only current copy). A is then drained and the queue's next task, which reads all N MiB, runs
//!    on B: its wall time (drain request included) is `move`. The same task again on B, data now
//!    resident, is `resident`; `cost = move − resident` is what the move added, and the bytes it
//!    moved come from the daemon's per-session byte counters (they must be 2·N MiB: device → host
//!    → device, nothing else). Pairs: sim0 → opencl0 and opencl0 → sim0 (sim0 → sim1 without
//!    OpenCL).
//! 2. **Iterative application.** A STREAM-like loop (triad then scale over a working set of W MiB)
//!    runs never migrated and migrated once mid-run (sim0 drained while tasks are in flight; the
//!    queue moves to the identical sim1), alternating; the slowdown of the medians is compared with
//!    Arax's +7% for live migration.

use std::path::Path;
use std::time::Instant;

use agora::{Arg, Session, SessionOptions};
use anyhow::{bail, Context, Result};
use clap::Args;
use serde::Serialize;

use super::harness::{spread, DaemonProcess, ScratchDir, Spread};

/// `agora bench migrate` options.
#[derive(Args, Debug)]
pub struct MigrateArgs {
    /// Live-buffer sizes to move, MiB (default 1,16,64,256; 1,16 with --quick).
    #[arg(long, value_delimiter = ',')]
    sizes: Option<Vec<u64>>,
    /// Repetitions per measurement (default 5; 2 with --quick).
    #[arg(long)]
    reps: Option<usize>,
    /// Working set of the iterative application, MiB (default 16; 4 with --quick).
    #[arg(long)]
    app_mib: Option<u64>,
    /// Iterations of the iterative application (default 100; 30 with --quick).
    #[arg(long)]
    iterations: Option<usize>,
    /// Print JSON.
    #[arg(long)]
    json: bool,
    /// A short version for smoke checks.
    #[arg(long)]
    quick: bool,
}

/// The benchmark's devices. The sim devices are identical, so a move between them costs only the
/// move; their link is modeled at 12 GB/s (a PCIe 3 x16 figure).
const MIGRATE_CONFIG: &str = r#"
[cpu]
lanes = 2

[opencl]
lanes = 2

[[sim]]
name = "sim0"
lanes = 2
memory = "2G"
bandwidth = "12G"

[[sim]]
name = "sim1"
lanes = 2
memory = "2G"
bandwidth = "12G"
"#;

/// One queue move of `mib` MiB from `from` to `to`.
#[derive(Serialize, Debug)]
struct MoveResult {
    from: String,
    to: String,
    mib: u64,
    /// Bytes the move copied (device → host plus host → device), from the daemon's counters.
    bytes_moved: u64,
    /// Drain request plus the first task on the new device, milliseconds.
    move_ms: Spread,
    /// The same task on the new device with its data resident, milliseconds.
    resident_ms: Spread,
    /// What the move added (`move − resident`, per repetition), milliseconds.
    cost_ms: Spread,
    /// Bytes moved over the median cost, GB/s.
    gb_per_s: f64,
}

/// The iterative application, never vs once migrated.
#[derive(Serialize, Debug)]
struct AppResult {
    from: String,
    to: String,
    working_set_mib: u64,
    iterations: usize,
    never_s: Spread,
    migrated_s: Spread,
    /// Per repetition (the two variants run back to back): migrated minus never, milliseconds.
    added_ms: Spread,
    /// Median over repetitions of migrated / never − 1, percent (pairs cancel slow drifts of a
    /// shared machine).
    slowdown_pct: f64,
    /// Arax's live-migration overhead (thesis, ch. 2), percent.
    arax_anchor_pct: f64,
}

#[derive(Serialize, Debug)]
struct MigrateReport {
    moves: Vec<MoveResult>,
    app: AppResult,
}

/// The daemon and session a measurement runs against.
struct Ctx<'a> {
    socket: &'a Path,
    session: &'a Session,
    /// Every device of the daemon.
    all: &'a [String],
}

/// Lets the policy use exactly `usable` among `all` devices (drains the rest).
fn only(socket: &Path, all: &[String], usable: &[&str]) -> Result<()> {
    // Undrain first, so there is always somewhere to go.
    for name in all.iter().filter(|n| usable.contains(&n.as_str())) {
        agora::drain_device(Some(socket.to_path_buf()), name, false, false)?;
    }
    for name in all.iter().filter(|n| !usable.contains(&n.as_str())) {
        agora::drain_device(Some(socket.to_path_buf()), name, true, false)?;
    }
    Ok(())
}

fn session_bytes(session: &Session) -> Result<u64> {
    let me = session.session_status(session.id())?;
    Ok(me.bytes_to_device + me.bytes_to_host)
}

fn last_device(session: &Session, queue: &str) -> Result<String> {
    let me = session.session_status(session.id())?;
    me.queues
        .iter()
        .find(|q| q.name == queue)
        .and_then(|q| q.last_device.clone())
        .context("queue missing from the status")
}

fn ms(since: Instant) -> f64 {
    since.elapsed().as_secs_f64() * 1e3
}

/// One repetition of a move of `mib` MiB: (move ms, resident ms, bytes moved).
fn move_once(
    Ctx { socket, session, all }: &Ctx<'_>,
    (from, to): (&str, &str),
    mib: u64,
    rep: usize,
) -> Result<(f64, f64, u64)> {
    only(socket, all, &[from])?;
    let name = format!("move-{from}-{to}-{mib}-{rep}");
    let q = session.queue(&name)?;
    let fill = session.kernel("fill")?;
    let saxpy = session.kernel("saxpy")?;
    let half = mib << 19; // bytes in each of x and y
    let n = (half / 4) as usize;
    let x = session.buffer(half)?;
    let y = session.buffer(half)?;
    // Written on `from`, whole: its copies are the only current ones, nothing was copied in.
    q.launch(&fill, &[Arg::F32(1.0), (&x).into()], n)?;
    q.launch(&fill, &[Arg::F32(2.0), (&y).into()], n)?;
    q.finish()?;
    if last_device(session, &name)? != from {
        bail!("the queue did not start on {from}");
    }
    let before = session_bytes(session)?;
    let started = Instant::now();
    only(socket, all, &[to])?;
    q.launch(&saxpy, &[Arg::F32(1.0), (&x).into(), (&y).into()], n)?;
    q.finish()?;
    let moved_ms = ms(started);
    let moved = session_bytes(session)? - before;
    if last_device(session, &name)? != to {
        bail!("the queue did not move to {to}");
    }
    let started = Instant::now();
    q.launch(&saxpy, &[Arg::F32(1.0), (&x).into(), (&y).into()], n)?;
    q.finish()?;
    let resident_ms = ms(started);
    if session_bytes(session)? - before != moved {
        bail!("a task with resident data moved bytes");
    }
    q.sync_from(&y)?.wait()?;
    if let Some((i, v)) = y.as_slice::<f32>().iter().enumerate().find(|(_, v)| **v != 4.0) {
        bail!("wrong result after moving {from} → {to}: y[{i}] = {v}, expected 4");
    }
    Ok((moved_ms, resident_ms, moved))
}

/// The iterative application once: seconds.
fn app_once(
    Ctx { socket, session, all }: &Ctx<'_>,
    (from, to): (&str, &str),
    mib: u64,
    iterations: usize,
    migrate: bool,
    rep: usize,
) -> Result<f64> {
    only(socket, all, &[from])?;
    let name = format!("app-{migrate}-{rep}");
    let q = session.queue(&name)?;
    let triad = session.kernel("stream.triad")?;
    let scale = session.kernel("stream.scale")?;
    let n = ((mib << 20) / 12) as usize; // three f32 arrays
    let b0: Vec<f32> = (0..n).map(|i| (i % 100) as f32).collect();
    let c0: Vec<f32> = (0..n).map(|i| (i % 10) as f32).collect();
    let a = session.buffer(n as u64 * 4)?;
    let b = session.buffer_from(&b0)?;
    let c = session.buffer_from(&c0)?;
    q.sync_to(&b)?;
    q.sync_to(&c)?;
    let started = Instant::now();
    let mut tasks = Vec::with_capacity(2 * iterations);
    for it in 0..iterations {
        tasks.push(q.launch(&triad, &[Arg::F32(0.5), (&b).into(), (&c).into(), (&a).into()], n)?);
        tasks.push(q.launch(&scale, &[Arg::F32(0.5), (&a).into(), (&c).into()], n)?);
        if migrate && it == iterations / 2 {
            // Mid-run, with this iteration's tasks and earlier ones in flight.
            only(socket, all, &[to])?;
        }
    }
    for task in tasks {
        task.wait()?;
    }
    let seconds = started.elapsed().as_secs_f64();
    let ran_on = last_device(session, &name)?;
    if ran_on != if migrate { to } else { from } {
        bail!("the application ended on {ran_on}");
    }
    q.sync_from(&c)?.wait()?;
    // Elements are independent: check a prefix against the same arithmetic on the host.
    let check = n.min(4096);
    for i in 0..check {
        let (bv, mut cv) = (b0[i], c0[i]);
        for _ in 0..iterations {
            let av = bv + 0.5f32 * cv;
            cv = 0.5f32 * av;
        }
        let got = c.as_slice::<f32>()[i];
        if got != cv {
            bail!("wrong result (migrate = {migrate}): c[{i}] = {got}, expected {cv}");
        }
    }
    Ok(seconds)
}

pub fn migrate(args: MigrateArgs) -> Result<()> {
    let sizes = args
        .sizes
        .clone()
        .unwrap_or_else(|| if args.quick { vec![1, 16] } else { vec![1, 16, 64, 256] });
    let reps = args.reps.unwrap_or(if args.quick { 2 } else { 5 }).max(1);
    let app_mib = args.app_mib.unwrap_or(if args.quick { 4 } else { 16 }).max(1);
    let iterations = args.iterations.unwrap_or(if args.quick { 30 } else { 100 }).max(2);
    if sizes.iter().any(|s| *s == 0 || *s > 1024) {
        bail!("--sizes: each size must be 1 to 1024 MiB");
    }
    let scratch = ScratchDir::new("bench-migrate")?;
    let config = scratch.path().join("agora.toml");
    std::fs::write(
        &config,
        format!(
            "{MIGRATE_CONFIG}\n[daemon]\nstate_dir = \"{}\"\n",
            scratch.path().join("state").display()
        ),
    )?;
    let daemon = DaemonProcess::start(None, &["--config", config.to_str().context("path")?])?;
    let socket = daemon.socket.clone();
    let all: Vec<String> = agora::daemon_status(Some(socket.clone()))?
        .devices
        .into_iter()
        .map(|d| d.name)
        .collect();
    let pairs: Vec<(&str, &str)> = if all.iter().any(|d| d == "opencl0") {
        vec![("sim0", "opencl0"), ("opencl0", "sim0")]
    } else {
        vec![("sim0", "sim1")]
    };
    let largest = sizes.iter().max().copied().unwrap_or(1).max(app_mib);
    let session = Session::connect_with(SessionOptions {
        socket: Some(socket.clone()),
        name: Some("agora bench migrate".into()),
        heap_bytes: Some((largest << 20) * 2 + (64 << 20)),
        control_timeout: None,
        reconnect_timeout: None,
    })?;
    if !args.json {
        println!(
            "agora bench migrate: devices {}; {reps} repetitions; moves of {:?} MiB over {}; \
             iterative application over {app_mib} MiB × {iterations} iterations, sim0 → sim1 mid-run",
            all.join(", "),
            sizes,
            pairs
                .iter()
                .map(|(a, b)| format!("{a} → {b}"))
                .collect::<Vec<_>>()
                .join(", ")
        );
    }
    let ctx = Ctx {
        socket: &socket,
        session: &session,
        all: &all,
    };
    let mut moves = Vec::new();
    for &pair in &pairs {
        // Untimed: builds the OpenCL programs and warms the allocators.
        move_once(&ctx, pair, 1, usize::MAX).context("warm-up move")?;
        for &mib in &sizes {
            let mut moved_ms = Vec::new();
            let mut resident_ms = Vec::new();
            let mut cost_ms = Vec::new();
            let mut bytes = 0;
            for rep in 0..reps {
                let (m, r, b) = move_once(&ctx, pair, mib, rep)
                    .with_context(|| format!("moving {mib} MiB {} → {}", pair.0, pair.1))?;
                moved_ms.push(m);
                resident_ms.push(r);
                cost_ms.push(m - r);
                bytes = b;
            }
            let cost = spread(&cost_ms);
            moves.push(MoveResult {
                from: pair.0.to_string(),
                to: pair.1.to_string(),
                mib,
                bytes_moved: bytes,
                move_ms: spread(&moved_ms),
                resident_ms: spread(&resident_ms),
                cost_ms: cost,
                gb_per_s: bytes as f64 / (cost.median.max(1e-3) * 1e-3) / 1e9,
            });
        }
    }
    let app_pair = ("sim0", "sim1");
    let mut never = Vec::new();
    let mut migrated = Vec::new();
    // One untimed run first (kernel code and memory warm), then alternate the two variants.
    app_once(&ctx, app_pair, app_mib, iterations, false, usize::MAX)?;
    for rep in 0..reps {
        never.push(app_once(&ctx, app_pair, app_mib, iterations, false, rep)?);
        migrated.push(app_once(&ctx, app_pair, app_mib, iterations, true, rep)?);
    }
    let (never_s, migrated_s) = (spread(&never), spread(&migrated));
    let added: Vec<f64> = migrated.iter().zip(&never).map(|(m, n)| (m - n) * 1e3).collect();
    let ratios: Vec<f64> = migrated.iter().zip(&never).map(|(m, n)| m / n - 1.0).collect();
    let report = MigrateReport {
        moves,
        app: AppResult {
            from: app_pair.0.to_string(),
            to: app_pair.1.to_string(),
            working_set_mib: app_mib,
            iterations,
            never_s,
            migrated_s,
            added_ms: spread(&added),
            slowdown_pct: spread(&ratios).median * 100.0,
            arax_anchor_pct: 7.0,
        },
    };
    drop(session);
    drop(daemon);
    drop(scratch);
    if args.json {
        println!("{}", serde_json::to_string_pretty(&report)?);
        return Ok(());
    }
    println!(
        "\n{:<18} {:>6} {:>10}  {:>26}  {:>26}  {:>26} {:>8}",
        "move", "MiB", "moved MiB", "move ms min/med/max", "resident ms min/med/max", "cost ms min/med/max", "GB/s"
    );
    for m in &report.moves {
        println!(
            "{:<18} {:>6} {:>10.1}  {:>8.2} {:>8.2} {:>8.2}  {:>8.2} {:>8.2} {:>8.2}  {:>8.2} {:>8.2} {:>8.2} {:>8.2}",
            format!("{} → {}", m.from, m.to),
            m.mib,
            m.bytes_moved as f64 / (1 << 20) as f64,
            m.move_ms.min,
            m.move_ms.median,
            m.move_ms.max,
            m.resident_ms.min,
            m.resident_ms.median,
            m.resident_ms.max,
            m.cost_ms.min,
            m.cost_ms.median,
            m.cost_ms.max,
            m.gb_per_s
        );
    }
    let app = &report.app;
    println!(
        "\niterative application ({} MiB, {} iterations, {} → {} once mid-run): never {:.3}/{:.3}/{:.3} s, \
         migrated {:.3}/{:.3}/{:.3} s (min/median/max); added per pair {:.1}/{:.1}/{:.1} ms \
         → slowdown {:+.1}% (median of pairs; Arax: +{:.0}%)",
        app.working_set_mib,
        app.iterations,
        app.from,
        app.to,
        app.never_s.min,
        app.never_s.median,
        app.never_s.max,
        app.migrated_s.min,
        app.migrated_s.median,
        app.migrated_s.max,
        app.added_ms.min,
        app.added_ms.median,
        app.added_ms.max,
        app.slowdown_pct,
        app.arax_anchor_pct
    );
    Ok(())
}
