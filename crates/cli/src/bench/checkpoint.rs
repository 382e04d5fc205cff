//! `agora bench checkpoint`: what checkpointing costs an iterative application, and what
//! differential checkpoints save (issue #15).
//!
//! An application protects a state of W MiB and, every iteration, rewrites a fraction of it (a
//! `copy` of fresh bytes into a moving window of the state, on the queue). The same loop runs
//! without checkpoints and with a level-1 checkpoint task after every iteration, alternating, on
//! a daemon process of its own; the client is this process. Reported: the time per iteration
//! with / without (the checkpoint's cost to the application: the capture runs in its queue, the
//! write in the background), how many bytes each checkpoint wrote against the protected bytes
//! (differential checkpoints write only changed blocks), the writer's throughput, and the time
//! to recover the newest checkpoint into a fresh session, whose bytes must equal the final state
//! (else the benchmark fails).

use std::time::{Duration, Instant};

use agora::{CheckpointLevel, Session, SessionOptions};
use anyhow::{bail, Context, Result};
use clap::Args;
use serde::Serialize;

use super::harness::{median, spread, DaemonProcess, Spread};

/// `agora bench checkpoint` options.
#[derive(Args, Debug)]
pub struct CheckpointArgs {
    /// Protected state, MiB (default 64; 4 with --quick).
    #[arg(long)]
    state_mib: Option<u64>,
    /// Share of the state rewritten per iteration (default 0.1).
    #[arg(long, default_value_t = 0.1)]
    changed: f64,
    /// Iterations per run (default 20; 5 with --quick).
    #[arg(long)]
    iterations: Option<u64>,
    /// Runs with and without checkpoints, alternating (default 3; 1 with --quick).
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

#[derive(Serialize, Debug)]
struct Report {
    state_bytes: u64,
    changed_fraction: f64,
    iterations: u64,
    repetitions: usize,
    /// Seconds per iteration without checkpoints.
    plain_iteration_s: Spread,
    /// Seconds per iteration with a checkpoint task after each.
    checkpointed_iteration_s: Spread,
    /// Median with / without, per repetition pair.
    checkpoint_overhead_ratio: f64,
    /// Bytes written / bytes protected, for every checkpoint after a run's first.
    dcp_written_fraction: Spread,
    /// The first checkpoint of a run: everything is new.
    first_written_fraction: f64,
    /// The writer's throughput over all writes, MiB/s (bytes written / write seconds).
    write_mib_s: f64,
    /// Wall time of `recover()` of the newest checkpoint into a fresh session.
    recover_s: f64,
    verified: bool,
    /// A long sgemm (C = A·B, `partial_rows`² × `partial_rows`) launched whole vs issued as row
    /// windows of `partial_window_rows` with a level-1 checkpoint of C after each (partial-task
    /// checkpoints): seconds, min / median / max of the repetitions.
    partial_rows: u64,
    partial_window_rows: u64,
    partial_whole_s: Spread,
    partial_checkpointed_s: Spread,
    /// Median over repetitions of checkpointed / whole.
    partial_overhead_ratio: f64,
    /// The checkpointed launch's result equals the whole launch's, bit for bit.
    partial_verified: bool,
    load_average_at_start: Option<f64>,
}

/// One sgemm of `rows`² × `rows`, whole (`window: None`) or checkpointed in windows of that
/// many rows (ids from `first_id`); seconds and the result.
fn sgemm_run(
    socket: &std::path::Path,
    name: &str,
    rows: u64,
    window: Option<u64>,
    first_id: u64,
) -> Result<(f64, Vec<f32>)> {
    let s = session(socket, name)?;
    let q = s.queue("sgemm")?;
    let n = rows as usize;
    let a: Vec<f32> = (0..n * n).map(|i| ((i * 7) % 13) as f32 * 0.25).collect();
    let b: Vec<f32> = (0..n * n).map(|i| ((i * 5) % 11) as f32 * 0.5).collect();
    let (a, b, c) = (
        s.buffer_from(&a)?,
        s.buffer_from(&b)?,
        s.buffer_from(&vec![0f32; n * n])?,
    );
    for buffer in [&a, &b, &c] {
        q.sync_to(buffer)?;
    }
    let sgemm = s.kernel("sgemm")?;
    let args = [
        agora::Arg::I32(n as i32),
        agora::Arg::I32(n as i32),
        agora::Arg::I32(n as i32),
        agora::Arg::F32(1.0),
        (&a).into(),
        (&b).into(),
        agora::Arg::F32(0.0),
        (&c).into(),
    ];
    q.finish()?;
    let started = Instant::now();
    match window {
        None => {
            q.launch(&sgemm, &args, (rows, rows))?;
        }
        Some(window_rows) => {
            s.protect(1, &c)?;
            q.launch_checkpointed(
                &sgemm,
                &args,
                (rows, rows),
                &agora::CheckpointedLaunch {
                    window_rows,
                    first_checkpoint: first_id,
                    level: CheckpointLevel::Local,
                    resume_after: None,
                },
            )?;
        }
    }
    q.finish()?;
    let seconds = started.elapsed().as_secs_f64();
    q.sync_from(&c)?;
    q.finish()?;
    Ok((seconds, c.read_vec()))
}

fn session(socket: &std::path::Path, name: &str) -> Result<Session> {
    Ok(Session::connect_with(SessionOptions {
        socket: Some(socket.to_path_buf()),
        name: Some(name.into()),
        heap_bytes: Some(1 << 30),
        ..Default::default()
    })?)
}

/// One run: `iterations` of rewriting a window of the state, with a checkpoint after each when
/// `checkpoint_from` is set (ids from it on). Returns seconds per iteration and the final state.
fn run(
    socket: &std::path::Path,
    name: &str,
    state_bytes: u64,
    window: u64,
    iterations: u64,
    checkpoint_from: Option<u64>,
) -> Result<(f64, Vec<u8>)> {
    let s = session(socket, name)?;
    let q = s.queue("iterate")?;
    // Random bytes, so that no two blocks are alike (content-addressed blocks would store a
    // state of identical blocks once, and make differential checkpoints look better than they
    // are); the fresh bytes of each iteration come from a moving offset of `noise`.
    let state = s.buffer_from(&random_bytes(state_bytes, 1))?;
    let noise = s.buffer_from(&random_bytes(state_bytes, 2))?;
    if checkpoint_from.is_some() {
        s.protect(1, &state)?;
    }
    q.sync_to(&state)?;
    q.sync_to(&noise)?;
    q.finish()?;
    let room = state_bytes - window + 1;
    let started = Instant::now();
    for i in 0..iterations {
        let (from, to) = ((i * 4099 + 17) % room, (i * window) % room);
        q.copy(&noise, from, &state, to, window)?;
        if let Some(first) = checkpoint_from {
            q.checkpoint(first + i, CheckpointLevel::Local)?;
        }
    }
    q.finish()?;
    let seconds = started.elapsed().as_secs_f64() / iterations as f64;
    q.sync_from(&state)?;
    q.finish()?;
    Ok((seconds, state.as_slice::<u8>().to_vec()))
}

/// `len` bytes from a xorshift generator seeded by `seed`.
fn random_bytes(len: u64, seed: u64) -> Vec<u8> {
    let mut x = 0x9e37_79b9_7f4a_7c15u64 ^ seed;
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            (x >> 24) as u8
        })
        .collect()
}

/// Runs `agora bench checkpoint`.
pub fn checkpoint(socket: Option<std::path::PathBuf>, args: CheckpointArgs) -> Result<()> {
    let say = |line: String| {
        if !args.json {
            println!("{line}");
        }
    };
    let load_average_at_start = super::harness::load_average_at_start();
    let state_bytes = args.state_mib.unwrap_or(if args.quick { 4 } else { 64 }) << 20;
    let iterations = args.iterations.unwrap_or(if args.quick { 5 } else { 20 }).max(2);
    let reps = args.repetitions.unwrap_or(if args.quick { 1 } else { 3 }).max(1);
    if !(args.changed > 0.0 && args.changed <= 1.0) {
        bail!("--changed is a share of the state: more than 0, at most 1");
    }
    let window = ((state_bytes as f64 * args.changed) as u64).clamp(1, state_bytes);
    let daemon = DaemonProcess::start(socket.as_deref(), &[])?;
    let name = "bench-checkpoint";
    let (mut plain, mut checkpointed, mut ratios) = (Vec::new(), Vec::new(), Vec::new());
    let mut next_id = 1;
    let mut last_state = Vec::new();
    for rep in 0..reps {
        let (without, _) = run(&daemon.socket, name, state_bytes, window, iterations, None)?;
        let (with, state) = run(&daemon.socket, name, state_bytes, window, iterations, Some(next_id))?;
        next_id += iterations;
        say(format!(
            "run {}: {:.3} ms per iteration without checkpoints, {:.3} ms with one after each",
            rep + 1,
            without * 1e3,
            with * 1e3
        ));
        plain.push(without);
        checkpointed.push(with);
        ratios.push(with / without);
        last_state = state;
    }
    // Every capture is written before the figures are read.
    let s = session(&daemon.socket, name)?;
    let deadline = Instant::now() + Duration::from_secs(120);
    let report = loop {
        let report = s.checkpoints()?;
        if report.writing == 0 {
            break report;
        }
        if Instant::now() > deadline {
            bail!("checkpoints still being written after 120 s");
        }
        std::thread::sleep(Duration::from_millis(10));
    };
    if let Some(failed) = report.writes.iter().find(|w| w.error.is_some()) {
        bail!("checkpoint {} failed: {:?}", failed.checkpoint, failed.error);
    }
    // The daemon remembers the application's last 16 writes: the figures come from those.
    let firsts: Vec<u64> = (0..reps as u64).map(|r| 1 + r * iterations).collect();
    let (mut later, mut first) = (Vec::new(), Vec::new());
    for w in &report.writes {
        let fraction = w.bytes_written as f64 / w.bytes_total.max(1) as f64;
        if firsts.contains(&w.checkpoint) {
            first.push(fraction);
        } else {
            later.push(fraction);
        }
    }
    let written: u64 = report.writes.iter().map(|w| w.bytes_written).sum();
    let write_seconds: f64 = report.writes.iter().map(|w| w.seconds).sum();
    let write_mib_s = written as f64 / (1 << 20) as f64 / write_seconds.max(1e-9);

    let fresh = session(&daemon.socket, name)?;
    let state = fresh.buffer(state_bytes)?;
    fresh.protect(1, &state)?;
    let started = Instant::now();
    let recovered = fresh.recover().context("recovering the newest checkpoint")?;
    let recover_s = started.elapsed().as_secs_f64();
    let verified = recovered.checkpoint == next_id - 1 && state.as_slice::<u8>() == &last_state[..];
    drop(fresh);
    drop(s);

    // Partial-task checkpoints: a long launch checkpointed every window vs whole.
    let (partial_rows, partial_window_rows) = if args.quick { (256, 64) } else { (1536, 96) };
    let (mut whole, mut windowed, mut partial_ratios) = (Vec::new(), Vec::new(), Vec::new());
    let mut partial_verified = true;
    let mut first_id = 1;
    for _ in 0..reps {
        let (w, reference) = sgemm_run(&daemon.socket, "bench-partial", partial_rows, None, 0)?;
        let (c, result) = sgemm_run(
            &daemon.socket,
            "bench-partial",
            partial_rows,
            Some(partial_window_rows),
            first_id,
        )?;
        first_id += partial_rows.div_ceil(partial_window_rows);
        partial_verified &= result == reference;
        say(format!(
            "sgemm {partial_rows}²: whole {:.3} s, in windows of {partial_window_rows} rows with a checkpoint after each {:.3} s",
            w, c
        ));
        whole.push(w);
        windowed.push(c);
        partial_ratios.push(c / w);
    }

    let result = Report {
        state_bytes,
        changed_fraction: args.changed,
        iterations,
        repetitions: reps,
        plain_iteration_s: spread(&plain),
        checkpointed_iteration_s: spread(&checkpointed),
        checkpoint_overhead_ratio: median(&ratios),
        dcp_written_fraction: spread(&later),
        first_written_fraction: first.first().copied().unwrap_or(f64::NAN),
        write_mib_s,
        recover_s,
        verified,
        partial_rows,
        partial_window_rows,
        partial_whole_s: spread(&whole),
        partial_checkpointed_s: spread(&windowed),
        partial_overhead_ratio: median(&partial_ratios),
        partial_verified,
        load_average_at_start,
    };
    say(format!(
        "state {} MiB, {:.0}% rewritten per iteration: with a checkpoint after every iteration (an upper bound: \
         applications checkpoint every many iterations) {:.2}x the time per iteration; each checkpoint after the first wrote {:.1}% of the state (median; the first {:.0}%); \
         writer {:.0} MiB/s; recovery {:.1} ms, {}",
        state_bytes >> 20,
        args.changed * 100.0,
        result.checkpoint_overhead_ratio,
        result.dcp_written_fraction.median * 100.0,
        result.first_written_fraction * 100.0,
        write_mib_s,
        recover_s * 1e3,
        if verified { "exact" } else { "WRONG" }
    ));
    if args.json {
        println!("{}", serde_json::to_string_pretty(&result)?);
    }
    say(format!(
        "partial-task checkpoints: a {partial_rows}² sgemm checkpointed every {partial_window_rows} rows takes {:.3}x its whole launch (median), result {}",
        result.partial_overhead_ratio,
        if partial_verified { "identical" } else { "DIFFERENT" }
    ));
    if !verified {
        bail!("the recovered state differs from the last checkpointed one");
    }
    if !partial_verified {
        bail!("the checkpointed sgemm's result differs from the whole launch's");
    }
    Ok(())
}
