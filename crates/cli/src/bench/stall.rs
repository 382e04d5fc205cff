//! `agora bench stall`: an honest neighbour's round trips, quiet and beside an attacker whose
//! launches the model would call tiny but that run long (issue #22 item 3c): `sgemm` with
//! m = n = 1 and k = 2^22, and `nw.diagonal` over one 1024 × 1024 block, pipelined 16 at a time.
//! Such launches once ran on the dispatcher and froze every tenant for seconds; the inline guard
//! (a bound from the arguments, timed inline runs, overrunning shapes sent to lanes) keeps them
//! on lanes now. Reported: the neighbour's p50 / p99 quiet and under attack, their ratio, and the
//! dispatcher's longest stretch of work (`agora status`, since the daemon started) and its
//! stretches over 1 ms while the neighbour ran beside the attack (a difference of two readings
//! of `dispatcher_stalls`, so the daemon's start and the quiet phase are left out), the figures
//! the issue asks for.
//!
//! The neighbour is an `agora bench-client latency` process (one `noop` at a time, on a
//! latency-class queue unless `--neighbour-class batch`), the attacker a session of this process,
//! so the two are separate tenants as in the issue.
//!
//! `--attack departures` is the pressure of issue #22 item 2 instead: tenants that come one after
//! another, each pushing three buffers of `--departure-mib` MiB to the OpenCL device and leaving.
//! The neighbour then runs empty OpenCL kernels (`bench-client opencl-latency`), so it shares the
//! device, its lanes and its device host with them. A leaving tenant's segment and buffers once
//! were let go of on the host's message loop (the dispatcher's next allocation waited 0.1–0.5 s),
//! and its transfers were booked as no work at all (a neighbour's task could queue behind
//! 1.5 GiB of them).
//!
//! `--attack evictions` is memory pressure on the device: the daemon's OpenCL memory is limited
//! to 8 buffers of `--eviction-mib` MiB and a tenant updates 16 such buffers in turn on it
//! (`saxpy`, results left on the device), so every launch evicts a buffer whose only valid copy
//! is there: written home, which the dispatcher once waited for. The neighbour runs empty OpenCL
//! kernels, as for departures. The tenant's buffers are read back and checked at the end: no
//! eviction may lose an update.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;

use anyhow::{bail, Context, Result};
use clap::Args;
use serde::Serialize;

use super::client::{run_clients_with, ClientMode};
use super::harness::{load_average_at_start, spread, DaemonProcess, Spread};

/// `agora bench stall` options.
#[derive(Args, Debug)]
pub struct StallArgs {
    /// Print JSON.
    #[arg(long)]
    json: bool,
    /// A short version for smoke checks (5000 round trips, one run).
    #[arg(long)]
    quick: bool,
    /// Neighbour round trips per phase (default 100000; 5000 with --quick).
    #[arg(long)]
    iterations: Option<u64>,
    /// Runs, each with a fresh daemon (default 3; 1 with --quick).
    #[arg(long)]
    runs: Option<usize>,
    /// The daemon's `--batch-priority` (default: the daemon's own, `auto`: `batch`, and `idle`
    /// while latency-class work is live); `idle` puts batch lanes below every other thread of
    /// the machine.
    #[arg(long, value_name = "PRIORITY")]
    batch_priority: Option<String>,
    /// The daemon's `--dispatcher-nice` (default 0, unchanged), e.g. -5 to run the dispatcher
    /// above the clients and lanes (needs CAP_SYS_NICE or RLIMIT_NICE).
    #[arg(long, value_name = "N", allow_hyphen_values = true)]
    dispatcher_nice: Option<i32>,
    /// The daemon's `--dispatcher-realtime`: the dispatcher under SCHED_FIFO (needs
    /// CAP_SYS_NICE or RLIMIT_RTPRIO).
    #[arg(long)]
    dispatcher_realtime: bool,
    /// Where the tiny-launches attack runs: `cpu` (the daemon's CPU lanes, the default) or
    /// `opencl` (PoCL's threads on the same cores, through its device host). The departures
    /// attack always runs on OpenCL.
    #[arg(long, value_name = "KIND", default_value = "cpu", value_parser = ["cpu", "opencl"])]
    attack_device: String,
    /// The attack: `tiny-launches` (launches the model calls tiny that run long, pipelined 16 at
    /// a time: item 3c) or `departures` (tenants that push three big buffers to the OpenCL
    /// device and leave, one after another: item 2; the neighbour runs on OpenCL too).
    /// `evictions`: a tenant that updates twice as much data as the OpenCL device may hold, in
    /// turn, so each launch evicts a result whose only copy is on the device (item 2's pressure).
    #[arg(long, value_name = "KIND", default_value = "tiny-launches", value_parser = ["tiny-launches", "departures", "evictions"])]
    attack: String,
    /// The neighbour's queue class: `latency` (a tenant that says its round trips matter, the
    /// default) or `batch` (one that does not).
    #[arg(long, value_name = "CLASS", default_value = "latency", value_parser = ["latency", "batch"])]
    neighbour_class: String,
    /// Departures attack: MiB of each of a departing tenant's three buffers (default 512; 64 with
    /// --quick).
    #[arg(long, value_name = "MIB")]
    departure_mib: Option<u64>,
    /// Evictions attack: MiB of each of the tenant's 16 buffers; the daemon's OpenCL memory is
    /// limited to 8 of them (default 32; 8 with --quick).
    #[arg(long, value_name = "MIB")]
    eviction_mib: Option<u64>,
}

/// Buffers the evictions attack updates in turn, and how many of them the device may hold.
const EVICTION_BUFFERS: usize = 16;
const EVICTION_ROOM: u64 = 8;

#[derive(Serialize, Debug)]
struct StallRun {
    quiet_p50_ns: u64,
    quiet_p99_ns: u64,
    attack_p50_ns: u64,
    attack_p99_ns: u64,
    /// The neighbour's p99 under attack over its quiet p99.
    p99_ratio: f64,
    /// The dispatcher's longest stretch of work since the daemon started, ms.
    dispatcher_longest_ms: f64,
    /// The dispatcher's stretches of work over 1 ms while the neighbour ran beside the attack
    /// (the aim: none); unlike the longest, this leaves out the daemon's start and the quiet
    /// phase.
    attack_stalls: u64,
    /// The neighbour's longest round trip under attack.
    attack_max_ns: u64,
    /// What lanes ran batch work at while the neighbour ran beside the attack (`agora status`
    /// at its end: for `auto`, `idle` while latency-class work is live).
    batch_priority_under_attack: String,
    /// Attack launches completed (from the attack's start to its end); with `--attack
    /// departures`, tenants that came, pushed their buffers and left.
    attack_launches: u64,
    /// Their rate over the attack (its set-up left out): what the neighbour's latency costs the
    /// batch work beside it.
    attack_launches_per_s: f64,
    /// Buffers the daemon evicted from device memory (since it started).
    evictions: u64,
}

/// A tenant of the daemon on `socket` named `name` (with a heap of `heap_bytes`, else the
/// default) and its queue `queue` preferring `device`.
fn tenant(
    socket: std::path::PathBuf,
    name: &str,
    heap_bytes: Option<u64>,
    queue: &str,
    device: agora::DeviceKind,
) -> Result<(agora::Session, agora::Queue)> {
    let session = agora::Session::connect_with(agora::SessionOptions {
        socket: Some(socket),
        name: Some(name.into()),
        heap_bytes,
        ..Default::default()
    })?;
    let queue = session.queue_with(agora::QueueOptions {
        name: queue.into(),
        preferred_device: Some(device),
        ..Default::default()
    })?;
    Ok((session, queue))
}

/// Tenants that come one after another until `stop`, each pushing three buffers of `bytes` to
/// the OpenCL device and leaving; counts departures in `done`.
fn departures(
    socket: std::path::PathBuf,
    bytes: u64,
    stop: Arc<AtomicBool>,
    done: Arc<AtomicU64>,
    ready: Arc<AtomicBool>,
) -> Result<()> {
    while !stop.load(Ordering::Relaxed) {
        let (session, queue) = tenant(
            socket.clone(),
            "departing",
            Some(3 * bytes + (16 << 20)),
            "push",
            agora::DeviceKind::OpenCl,
        )?;
        let mut buffers = Vec::new();
        for _ in 0..3 {
            let mut buffer = session.buffer(bytes)?;
            // Pages the tenant wrote: its segment is memory to give back when it leaves.
            buffer.as_mut_slice::<f32>().fill(1.0);
            buffers.push(buffer);
        }
        for buffer in &buffers {
            queue.sync_to(buffer)?;
        }
        queue.finish()?;
        ready.store(true, Ordering::Release);
        drop(buffers);
        drop(session);
        done.fetch_add(1, Ordering::Relaxed);
    }
    Ok(())
}

/// Updates [`EVICTION_BUFFERS`] buffers of `bytes` in turn on the OpenCL device until `stop`
/// (`y += x`, results left there), so each launch evicts another result; counts launches in
/// `done`. At the end reads every buffer back and checks that no update was lost.
fn evictions(
    socket: std::path::PathBuf,
    bytes: u64,
    stop: Arc<AtomicBool>,
    done: Arc<AtomicU64>,
    ready: Arc<AtomicBool>,
) -> Result<()> {
    use agora::Arg;
    let n = (bytes / 4) as usize;
    let (session, queue) = tenant(
        socket,
        "evicting",
        Some((EVICTION_BUFFERS as u64 + 1) * bytes + (16 << 20)),
        "update",
        agora::DeviceKind::OpenCl,
    )?;
    let saxpy = session.kernel("saxpy")?;
    let x = session.buffer_from(&vec![1.0f32; n])?;
    let ys = (0..EVICTION_BUFFERS)
        .map(|i| session.buffer_from(&vec![i as f32; n]))
        .collect::<Result<Vec<_>, _>>()?;
    let mut updates = [0u32; EVICTION_BUFFERS];
    ready.store(true, Ordering::Release);
    'attack: while !stop.load(Ordering::Relaxed) {
        for (i, y) in ys.iter().enumerate() {
            if stop.load(Ordering::Relaxed) {
                break 'attack;
            }
            queue
                .launch(&saxpy, &[Arg::F32(1.0), (&x).into(), y.into()], n)?
                .wait()?;
            updates[i] += 1;
            done.fetch_add(1, Ordering::Relaxed);
        }
    }
    for (i, y) in ys.iter().enumerate() {
        queue.sync_from(y)?.wait()?;
        let expected = i as f32 + updates[i] as f32;
        if let Some(wrong) = y.as_slice::<f32>().iter().find(|v| **v != expected) {
            bail!(
                "buffer {i} holds {wrong} after {} updates, not {expected}: an eviction lost data",
                updates[i]
            );
        }
    }
    Ok(())
}

/// Pipelines the attack on `socket` until `stop`; counts completed launches in `done`.
fn attack(
    device: agora::DeviceKind,
    socket: std::path::PathBuf,
    stop: Arc<AtomicBool>,
    done: Arc<AtomicU64>,
    ready: Arc<AtomicBool>,
) -> Result<()> {
    use agora::Arg;
    // By default on the CPU: the device whose cores the dispatcher and the neighbour share (the
    // issue's attack ran there, on the dispatcher itself).
    let (session, queue) = tenant(socket, "attacker", None, "attack", device)?;
    let sgemm = session.kernel("sgemm")?;
    let diagonal = session.kernel("nw.diagonal")?;
    let k = 1usize << 22;
    let a = session.buffer_from(&vec![1.0f32; k])?;
    let b = session.buffer_from(&vec![1.0f32; k])?;
    let c = session.buffer_from(&[0.0f32; 1])?;
    let n = 1024usize;
    let score = session.buffer_from(&vec![0i32; (n + 1) * (n + 1)])?;
    let reference = session.buffer_from(&vec![1i32; (n + 1) * (n + 1)])?;
    ready.store(true, Ordering::Release);
    while !stop.load(Ordering::Relaxed) {
        let mut tasks = Vec::with_capacity(16);
        for i in 0..16 {
            tasks.push(if i % 2 == 0 {
                queue.launch(
                    &sgemm,
                    &[
                        Arg::I32(1),
                        Arg::I32(1),
                        Arg::I32(k as i32),
                        Arg::F32(1.0),
                        (&a).into(),
                        (&b).into(),
                        Arg::F32(0.0),
                        (&c).into(),
                    ],
                    (1u64, 1u64),
                )?
            } else {
                queue.launch(
                    &diagonal,
                    &[
                        (&score).into(),
                        (&reference).into(),
                        Arg::I32(n as i32),
                        Arg::I32(10),
                        Arg::I32(0),
                        Arg::I32(n as i32),
                    ],
                    1u64,
                )?
            });
        }
        for task in tasks {
            task.wait()?;
            done.fetch_add(1, Ordering::Relaxed);
        }
    }
    Ok(())
}

pub fn stall(args: StallArgs) -> Result<()> {
    let departing = args.attack == "departures";
    let evicting = args.attack == "evictions";
    if args.departure_mib.is_some() && !departing {
        bail!("--departure-mib sizes the departures attack: add --attack departures");
    }
    if args.eviction_mib.is_some() && !evicting {
        bail!("--eviction-mib sizes the evictions attack: add --attack evictions");
    }
    if (departing || evicting) && args.attack_device != "cpu" {
        bail!(
            "--attack-device chooses where the tiny-launches attack runs; the {} attack always runs on OpenCL",
            args.attack
        );
    }
    let departure_bytes = args.departure_mib.unwrap_or(if args.quick { 64 } else { 512 }) << 20;
    let eviction_bytes = args.eviction_mib.unwrap_or(if args.quick { 8 } else { 32 }).max(1) << 20;
    // The neighbour shares the attacked device: the CPU's dispatcher and cores for tiny launches
    // (its `noop`s run inline), the OpenCL device's lanes and host for departures and evictions.
    let neighbour = if departing || evicting {
        ClientMode::OpenclLatency
    } else {
        ClientMode::Latency
    };
    let on_opencl = departing || evicting || args.attack_device == "opencl";
    let iterations = args.iterations.unwrap_or(if args.quick { 5_000 } else { 100_000 });
    let runs = args.runs.unwrap_or(if args.quick { 1 } else { 3 }).max(1);
    let load = load_average_at_start();
    if !args.json {
        eprintln!(
            "agora bench stall: {runs} run(s) of {iterations} neighbour round trips, quiet then beside the {} attack",
            args.attack
        );
    }
    let mut results = Vec::new();
    // As the daemon reports it (after any fallback for want of privilege).
    let mut batch_priority = String::new();
    for run in 0..runs {
        let mut daemon_args: Vec<String> = match &args.batch_priority {
            Some(priority) => vec!["--batch-priority".into(), priority.clone()],
            None => Vec::new(),
        };
        if let Some(nice) = args.dispatcher_nice {
            daemon_args.extend(["--dispatcher-nice".into(), nice.to_string()]);
        }
        if args.dispatcher_realtime {
            daemon_args.push("--dispatcher-realtime".into());
        }
        if evicting {
            // Room for half of the tenant's buffers (and the neighbour's few bytes).
            let limit = EVICTION_ROOM * eviction_bytes + (1 << 20);
            daemon_args.extend(["--opencl-memory-limit".into(), limit.to_string()]);
        }
        let daemon_args: Vec<&str> = daemon_args.iter().map(String::as_str).collect();
        let daemon = DaemonProcess::start(None, &daemon_args)?;
        if on_opencl
            && !agora::daemon_status(Some(daemon.socket.clone()))?
                .devices
                .iter()
                .any(|d| d.kind == agora::DeviceKind::OpenCl)
        {
            // A queue only prefers a kind: without the device, the attack would run on the CPU
            // and the figures would say nothing of OpenCL.
            bail!(
                "this attack runs on OpenCL, but the daemon has no OpenCL device (`agora devices` lists what it finds; `bash scripts/setup.sh` installs PoCL)"
            );
        }
        let neighbour_options: &[&str] = if args.neighbour_class == "latency" {
            &["--latency-class"]
        } else {
            &[]
        };
        let quiet = run_clients_with(&daemon.socket, neighbour, iterations, 1, neighbour_options)?.remove(0);
        let (stop, done, ready) = (
            Arc::new(AtomicBool::new(false)),
            Arc::new(AtomicU64::new(0)),
            Arc::new(AtomicBool::new(false)),
        );
        let device = match args.attack_device.as_str() {
            "opencl" => agora::DeviceKind::OpenCl,
            _ => agora::DeviceKind::Cpu,
        };
        let attacker = {
            let (socket, stop, done, ready) = (daemon.socket.clone(), stop.clone(), done.clone(), ready.clone());
            std::thread::spawn(move || {
                if departing {
                    departures(socket, departure_bytes, stop, done, ready)
                } else if evicting {
                    evictions(socket, eviction_bytes, stop, done, ready)
                } else {
                    attack(device, socket, stop, done, ready)
                }
            })
        };
        while !ready.load(Ordering::Acquire) && !attacker.is_finished() {
            std::thread::sleep(std::time::Duration::from_millis(10));
        }
        let attack_began = std::time::Instant::now();
        // Let the attack reach its steady state (the model has seen the shapes).
        std::thread::sleep(std::time::Duration::from_millis(500));
        let stalls_before = agora::daemon_status(Some(daemon.socket.clone()))?.dispatcher_stalls;
        let attacked = run_clients_with(&daemon.socket, neighbour, iterations, 1, neighbour_options);
        let after = agora::daemon_status(Some(daemon.socket.clone()))?;
        let stalls_after = after.dispatcher_stalls;
        batch_priority = after.batch_priority.clone();
        stop.store(true, Ordering::Relaxed);
        attacker
            .join()
            .map_err(|_| anyhow::anyhow!("the attacker thread panicked"))?
            .context("the attacker")?;
        let launches = done.load(Ordering::Relaxed);
        let attack_seconds = attack_began.elapsed().as_secs_f64();
        let attacked = attacked?.remove(0);
        let status = agora::daemon_status(Some(daemon.socket.clone()))?;
        if evicting && status.evictions == 0 {
            bail!("the evictions attack evicted nothing: the daemon did not limit its OpenCL memory");
        }
        let r = StallRun {
            quiet_p50_ns: quiet.p50_ns,
            quiet_p99_ns: quiet.p99_ns,
            attack_p50_ns: attacked.p50_ns,
            attack_p99_ns: attacked.p99_ns,
            p99_ratio: attacked.p99_ns as f64 / quiet.p99_ns.max(1) as f64,
            dispatcher_longest_ms: status.dispatcher_longest_iteration_ms,
            attack_stalls: stalls_after.saturating_sub(stalls_before),
            attack_max_ns: attacked.max_ns,
            batch_priority_under_attack: after.batch_priority_now.clone(),
            attack_launches: launches,
            attack_launches_per_s: launches as f64 / attack_seconds,
            evictions: status.evictions,
        };
        if !args.json {
            eprintln!(
                "  run {}: quiet p50/p99 {} / {} ns; under attack {} / {} ns (p99 ×{:.1}, longest {:.2} ms; batch lanes at {}); dispatcher's longest stretch {:.2} ms, {} over 1 ms under attack; {} attack {} ({:.1}/s)",
                run + 1,
                r.quiet_p50_ns,
                r.quiet_p99_ns,
                r.attack_p50_ns,
                r.attack_p99_ns,
                r.p99_ratio,
                r.attack_max_ns as f64 / 1e6,
                r.batch_priority_under_attack,
                r.dispatcher_longest_ms,
                r.attack_stalls,
                r.attack_launches,
                if departing { "departures" } else { "launches" },
                r.attack_launches_per_s
            );
        }
        results.push(r);
    }
    let col = |f: fn(&StallRun) -> f64| spread(&results.iter().map(f).collect::<Vec<_>>());
    let (quiet99, attack99, ratio, longest, stalls, rate): (Spread, Spread, Spread, Spread, Spread, Spread) = (
        col(|r| r.quiet_p99_ns as f64),
        col(|r| r.attack_p99_ns as f64),
        col(|r| r.p99_ratio),
        col(|r| r.dispatcher_longest_ms),
        col(|r| r.attack_stalls as f64),
        col(|r| r.attack_launches_per_s),
    );
    let attack_max = col(|r| r.attack_max_ns as f64);
    if args.json {
        let out = serde_json::json!({
            "iterations": iterations,
            "batch_priority": batch_priority,
            "neighbour_class": args.neighbour_class,
            "dispatcher_nice": args.dispatcher_nice.unwrap_or(0),
            "dispatcher_realtime": args.dispatcher_realtime,
            "attack": args.attack,
            "attack_device": if departing || evicting { "opencl" } else { args.attack_device.as_str() },
            "departure_bytes": if departing { Some(departure_bytes) } else { None },
            "eviction_bytes": if evicting { Some(eviction_bytes) } else { None },
            "load_average_at_start": load,
            "runs": results,
            "quiet_p99_ns": quiet99.median,
            "attack_p99_ns": attack99.median,
            "p99_ratio": ratio.median,
            "dispatcher_longest_ms": longest.median,
            "attack_stalls": stalls.median,
            "attack_launches_per_s": rate.median,
            "attack_max_ns": attack_max.median,
            "spread": { "quiet_p99_ns": quiet99, "attack_p99_ns": attack99, "p99_ratio": ratio, "dispatcher_longest_ms": longest, "attack_stalls": stalls, "attack_launches_per_s": rate, "attack_max_ns": attack_max },
        });
        println!("{}", serde_json::to_string_pretty(&out)?);
        return Ok(());
    }
    println!(
        "\n{:<44} {:>10} {:>10} {:>10}",
        "metric (over runs)", "min", "median", "max"
    );
    let micros = |s: &Spread| Spread {
        min: s.min / 1e3,
        median: s.median / 1e3,
        max: s.max / 1e3,
    };
    for (name, s) in [
        ("neighbour p99, quiet (µs)", micros(&quiet99)),
        ("neighbour p99, under attack (µs)", micros(&attack99)),
        ("p99 under attack / quiet (aim ≤ 2)", ratio),
        ("dispatcher's longest stretch (ms; aim ≤ 1)", longest),
        ("neighbour's longest, under attack (µs)", micros(&attack_max)),
        ("stretches over 1 ms under attack (aim 0)", stalls),
        (
            if departing {
                "departures per second"
            } else {
                "attack launches per second"
            },
            rate,
        ),
    ] {
        println!("{name:<44} {:>10.2} {:>10.2} {:>10.2}", s.min, s.median, s.max);
    }
    Ok(())
}
