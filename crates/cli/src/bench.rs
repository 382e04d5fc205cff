//! `agora bench …`: system benchmarks, reported side by side with a baseline measured in the
//! same run.
//!
//! Every benchmark starts its own daemon as a separate process on a private socket and stops it
//! afterwards (unless `--socket`/`AGORA_SOCKET` names a running one), so each command measures
//! from a clean state. Client sides run as separate processes (`agora bench-client …`), as real
//! applications would.

use std::io::{BufRead, BufReader, Write};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use agora::{Session, SessionOptions};
use anyhow::{bail, Context, Result};
use clap::{Args, Subcommand, ValueEnum};
use serde::{Deserialize, Serialize};

/// Benchmarks.
#[derive(Subcommand, Debug)]
pub enum BenchCommand {
    /// Per-task latency and throughput of empty (`noop`) tasks from separate client processes,
    /// beside an in-process call of the same kernel (the floor).
    Latency(LatencyArgs),
    /// Each program on each device kind, natively and through Agora (client process), and the
    /// transfer round trip; ratios and their geometric mean.
    Overhead(OverheadArgs),
    /// A mixed workload over cpu + opencl + sim devices under each placement policy, side by
    /// side: makespan, per-device utilisation, energy.
    Hetero(crate::bench_sched::HeteroArgs),
    /// Four client applications sharing the node at once vs the same four one after another
    /// (time-sharing): total time ratio.
    Sharing(crate::bench_sched::SharingArgs),
    /// Latency-class requests beside long batch kernels, unsliced vs chunked: response times,
    /// SLA met, preemption latency.
    Sla(crate::bench_sched::SlaArgs),
    /// Live migration: time to move a queue with N MiB of live buffers between devices with
    /// their own memory, and the slowdown of an iterative application migrated once mid-run.
    Migrate(crate::bench_migrate::MigrateArgs),
}

/// `agora bench overhead` options.
#[derive(Args, Debug)]
pub struct OverheadArgs {
    /// Print JSON.
    #[arg(long)]
    json: bool,
    /// A short version for smoke checks (small sizes, 2 repetitions).
    #[arg(long)]
    quick: bool,
    /// Repetitions per measurement (default 5), after one warm-up.
    #[arg(long)]
    reps: Option<usize>,
    /// Programs to run (default: all).
    #[arg(long, value_delimiter = ',')]
    programs: Option<Vec<String>>,
    /// Device kinds to run on (default: cpu,opencl).
    #[arg(long, value_delimiter = ',')]
    devices: Option<Vec<String>>,
    /// Bytes for the transfer round trip (default 1G; 64M with --quick).
    #[arg(long, value_parser = crate::size::parse_bytes)]
    transfer_bytes: Option<u64>,
}

/// `agora bench latency` options.
#[derive(Args, Debug)]
pub struct LatencyArgs {
    /// Print JSON.
    #[arg(long)]
    json: bool,
    /// A short version for smoke checks (seconds).
    #[arg(long)]
    quick: bool,
    /// Round trips per run (default 100000; 5000 with --quick).
    #[arg(long)]
    iterations: Option<u64>,
    /// Repetitions (default 3; 1 with --quick). Each run starts a fresh daemon.
    #[arg(long)]
    runs: Option<usize>,
}

/// What a benchmark client process measures.
#[derive(ValueEnum, Clone, Copy, Debug)]
pub enum ClientMode {
    /// One noop at a time: launch, wait, repeat; report the round-trip distribution.
    Latency,
    /// Many noops in flight on one queue; report start and end timestamps.
    Throughput,
    /// Open a session, run one task, then sit idle for `--iterations` milliseconds.
    Idle,
    /// Run workload `--app` at `--size` `--iterations` times after a warm-up; print each time.
    Workload,
    /// sync_to + fill + sync_from of `--size` bytes, `--iterations` times after a warm-up.
    Transfer,
}

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
    /// Workload name (workload mode).
    #[arg(long)]
    app: Option<String>,
    /// Workload size, or bytes (transfer mode).
    #[arg(long)]
    size: Option<u64>,
    /// Preferred device kind (cpu, opencl).
    #[arg(long)]
    device_kind: Option<String>,
}

#[derive(Serialize, Deserialize, Debug, Default, Clone)]
struct RepeatResult {
    seconds: Vec<f64>,
    verified: bool,
}

fn device_kind(name: Option<&str>) -> Option<agora::DeviceKind> {
    match name {
        Some("cpu") => Some(agora::DeviceKind::Cpu),
        Some("opencl") => Some(agora::DeviceKind::OpenCl),
        _ => None,
    }
}

/// Workload and transfer modes of the client.
fn client_repeat(socket: Option<PathBuf>, args: &ClientArgs) -> Result<()> {
    let session = Session::connect_with(SessionOptions {
        socket,
        name: Some("bench-overhead".into()),
        heap_bytes: None,
    })?;
    let kind = device_kind(args.device_kind.as_deref());
    let mut result = RepeatResult {
        verified: true,
        ..Default::default()
    };
    match args.mode {
        ClientMode::Workload => {
            let app = args.app.as_deref().context("--app")?;
            let workload = agora_apps::build(app, args.size.context("--size")?, None).context("unknown app")?;
            for rep in 0..=args.iterations {
                let r = agora_apps::run_on_agora(&session, &workload, kind)?;
                result.verified &= r.verified;
                if rep > 0 {
                    result.seconds.push(r.seconds);
                }
            }
        }
        ClientMode::Transfer => {
            let bytes = args.size.context("--size")?;
            let queue = agora_apps::queue(&session, "transfer", kind)?;
            let fill = session.kernel("fill")?;
            let buffer = session.buffer(bytes)?;
            let n = bytes / 4;
            for rep in 0..=args.iterations {
                let t = Instant::now();
                let _ = queue.sync_to(&buffer)?;
                let _ = queue.launch(&fill, &[agora::Arg::F32(1.5), (&buffer).into()], n)?;
                let _ = queue.sync_from(&buffer)?;
                queue.finish()?;
                if rep > 0 {
                    result.seconds.push(t.elapsed().as_secs_f64());
                }
            }
            result.verified = buffer.as_slice::<f32>().iter().all(|v| *v == 1.5);
        }
        _ => unreachable!("other modes are handled by client()"),
    }
    println!("{}", serde_json::to_string(&result)?);
    Ok(())
}

#[derive(Serialize, Deserialize, Debug, Default, Clone)]
struct ClientResult {
    tasks: u64,
    start_ns: u64,
    end_ns: u64,
    p50_ns: u64,
    p99_ns: u64,
    max_ns: u64,
    mean_ns: f64,
}

fn monotonic_ns() -> u64 {
    let t = rustix::time::clock_gettime(rustix::time::ClockId::Monotonic);
    t.tv_sec as u64 * 1_000_000_000 + t.tv_nsec as u64
}

fn percentile(sorted: &[u64], p: f64) -> u64 {
    if sorted.is_empty() {
        return 0;
    }
    let index = ((sorted.len() - 1) as f64 * p).round() as usize;
    sorted[index]
}

/// The client side, in its own process.
pub fn client(socket: Option<PathBuf>, args: ClientArgs) -> Result<()> {
    if matches!(args.mode, ClientMode::Workload | ClientMode::Transfer) {
        return client_repeat(socket, &args);
    }
    let session = Session::connect_with(SessionOptions {
        socket,
        name: Some(format!("bench-{:?}", args.mode).to_lowercase()),
        heap_bytes: Some(1 << 20),
    })?;
    let queue = session.queue("bench")?;
    let noop = session.kernel("noop")?;
    // Warm up: page in the rings, let the spinners adapt.
    for _ in 0..2_000 {
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
        ClientMode::Latency => {
            let mut samples = Vec::with_capacity(args.iterations as usize);
            result.start_ns = monotonic_ns();
            for _ in 0..args.iterations {
                let t = Instant::now();
                queue.launch(&noop, &[], 1u64)?.wait()?;
                samples.push(t.elapsed().as_nanos() as u64);
            }
            result.end_ns = monotonic_ns();
            samples.sort_unstable();
            result.p50_ns = percentile(&samples, 0.50);
            result.p99_ns = percentile(&samples, 0.99);
            result.max_ns = *samples.last().unwrap_or(&0);
            result.mean_ns = samples.iter().sum::<u64>() as f64 / samples.len().max(1) as f64;
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
        ClientMode::Workload | ClientMode::Transfer => unreachable!("handled above"),
    }
    println!("{}", serde_json::to_string(&result)?);
    Ok(())
}

/// A daemon process started for one measurement.
pub(crate) struct DaemonProcess {
    child: Option<Child>,
    pub(crate) socket: PathBuf,
    dir: Option<PathBuf>,
}

impl DaemonProcess {
    /// Starts `agora serve` on a private socket, or reuses `existing`.
    pub(crate) fn start(existing: Option<&Path>, extra: &[&str]) -> Result<Self> {
        if let Some(socket) = existing {
            return Ok(DaemonProcess {
                child: None,
                socket: socket.to_path_buf(),
                dir: None,
            });
        }
        static COUNTER: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
        let n = COUNTER.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let dir = std::env::temp_dir().join(format!("agora-bench-{}-{n}", std::process::id()));
        std::fs::create_dir_all(&dir)?;
        let socket = dir.join("agora.sock");
        let child = Command::new(std::env::current_exe()?)
            .arg("serve")
            .arg("--socket")
            .arg(&socket)
            .args(extra)
            .env("AGORA_LOG", "warn")
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .spawn()
            .context("starting the daemon")?;
        let deadline = Instant::now() + Duration::from_secs(10);
        while std::os::unix::net::UnixStream::connect(&socket).is_err() {
            if Instant::now() > deadline {
                bail!("the daemon did not open {} within 10 s", socket.display());
            }
            std::thread::sleep(Duration::from_millis(5));
        }
        Ok(DaemonProcess {
            child: Some(child),
            socket,
            dir: Some(dir),
        })
    }

    fn pid(&self) -> Option<u32> {
        self.child.as_ref().map(|c| c.id())
    }
}

impl Drop for DaemonProcess {
    fn drop(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = Command::new("kill").arg("-TERM").arg(child.id().to_string()).status();
            let deadline = Instant::now() + Duration::from_secs(5);
            while Instant::now() < deadline {
                if let Ok(Some(_)) = child.try_wait() {
                    break;
                }
                std::thread::sleep(Duration::from_millis(10));
            }
            let _ = child.kill();
            let _ = child.wait();
        }
        if let Some(dir) = self.dir.take() {
            let _ = std::fs::remove_dir_all(dir);
        }
    }
}

/// Starts `count` client processes; with `wait_go` they start measuring together.
fn run_clients(socket: &Path, mode: ClientMode, iterations: u64, count: usize) -> Result<Vec<ClientResult>> {
    let exe = std::env::current_exe()?;
    let mode_name = format!("{mode:?}").to_lowercase();
    let mut children = Vec::new();
    for _ in 0..count {
        let mut cmd = Command::new(&exe);
        cmd.args(["bench-client", &mode_name, "--iterations", &iterations.to_string()])
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

/// CPU time (user + system) of a process, in clock ticks (1/100 s).
fn cpu_ticks(pid: u32) -> Result<u64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat"))?;
    // Fields after the command name, which is in parentheses and may contain spaces.
    let rest = stat.rsplit_once(')').map(|(_, r)| r).context("parsing /proc stat")?;
    let fields: Vec<&str> = rest.split_whitespace().collect();
    // utime and stime are fields 14 and 15 of the full line, 12 and 13 after the name.
    Ok(fields[11].parse::<u64>()? + fields[12].parse::<u64>()?)
}

#[derive(Serialize, Debug, Default, Clone)]
struct LatencyRun {
    p50_ns: u64,
    p99_ns: u64,
    max_ns: u64,
    mean_ns: f64,
    throughput_tasks_per_s: f64,
    multi_client_throughput_tasks_per_s: f64,
    lane_p50_ns: u64,
    lane_p99_ns: u64,
}

#[derive(Serialize, Debug, Clone, Copy)]
pub(crate) struct Spread {
    pub(crate) min: f64,
    pub(crate) median: f64,
    pub(crate) max: f64,
}

pub(crate) fn spread(values: &[f64]) -> Spread {
    let mut v = values.to_vec();
    v.sort_by(f64::total_cmp);
    Spread {
        min: v[0],
        median: v[v.len() / 2],
        max: v[v.len() - 1],
    }
}

/// The in-process floor: the noop kernel called directly, timed the same way as a round trip.
fn floor_ns(iterations: u64) -> (u64, u64) {
    let (_, noop) = agora_kernels::find("noop").expect("noop kernel");
    let cpu = noop.cpu.expect("noop has a CPU implementation");
    // SAFETY: no arguments, so no memory is referenced.
    let call = unsafe { agora_kernels::KernelCall::new(&[1], &[]) };
    let mut samples = Vec::with_capacity(iterations as usize);
    for _ in 0..iterations {
        let t = Instant::now();
        cpu(std::hint::black_box(&call), std::hint::black_box(0..1));
        samples.push(t.elapsed().as_nanos() as u64);
    }
    samples.sort_unstable();
    (percentile(&samples, 0.5), percentile(&samples, 0.99))
}

fn latency(socket: Option<PathBuf>, args: LatencyArgs) -> Result<()> {
    let iterations = args.iterations.unwrap_or(if args.quick { 5_000 } else { 100_000 });
    let runs = args.runs.unwrap_or(if args.quick { 1 } else { 3 }).max(1);
    let pipelined = if args.quick { 100_000 } else { 1_000_000 };
    let per_client = pipelined / 4;
    if !args.json {
        eprintln!(
            "agora bench latency: {runs} run(s); {iterations} noop round trips, {pipelined} pipelined, 4 × {per_client} from 4 processes"
        );
    }
    let mut results = Vec::new();
    for run in 0..runs {
        let daemon = DaemonProcess::start(socket.as_deref(), &[])?;
        let lat = run_clients(&daemon.socket, ClientMode::Latency, iterations, 1)?.remove(0);
        let single = run_clients(&daemon.socket, ClientMode::Throughput, pipelined, 1)?.remove(0);
        let multi = run_clients(&daemon.socket, ClientMode::Throughput, per_client, 4)?;
        drop(daemon);
        let start = multi.iter().map(|r| r.start_ns).min().unwrap_or(0);
        let end = multi.iter().map(|r| r.end_ns).max().unwrap_or(0);
        let multi_tasks: u64 = multi.iter().map(|r| r.tasks).sum();
        // The same round trip with inline runs disabled: every noop is handed to a CPU lane.
        let (lane_p50_ns, lane_p99_ns) = if socket.is_none() {
            let daemon = DaemonProcess::start(None, &["--inline-max-ns", "0"])?;
            let r = run_clients(&daemon.socket, ClientMode::Latency, iterations / 2, 1)?.remove(0);
            (r.p50_ns, r.p99_ns)
        } else {
            (0, 0)
        };
        let r = LatencyRun {
            p50_ns: lat.p50_ns,
            p99_ns: lat.p99_ns,
            max_ns: lat.max_ns,
            mean_ns: lat.mean_ns,
            throughput_tasks_per_s: single.tasks as f64 / ((single.end_ns - single.start_ns) as f64 / 1e9),
            multi_client_throughput_tasks_per_s: multi_tasks as f64 / ((end - start) as f64 / 1e9),
            lane_p50_ns,
            lane_p99_ns,
        };
        if !args.json {
            eprintln!(
                "  run {}: p50 {} ns, p99 {} ns, max {} ns, pipelined {:.2} M/s, 4 clients {:.2} M/s, via lane p50 {} ns",
                run + 1,
                r.p50_ns,
                r.p99_ns,
                r.max_ns,
                r.throughput_tasks_per_s / 1e6,
                r.multi_client_throughput_tasks_per_s / 1e6,
                r.lane_p50_ns
            );
        }
        results.push(r);
    }
    let (floor_p50, floor_p99) = floor_ns(iterations);

    // Idle CPU: a daemon with one connected, idle client, over a few seconds.
    let idle_ms: u64 = if args.quick { 1_000 } else { 3_000 };
    let (idle_daemon_pct, idle_client_pct) = {
        let daemon = DaemonProcess::start(socket.as_deref(), &[])?;
        let mut client = Command::new(std::env::current_exe()?)
            .args(["bench-client", "idle", "--iterations", &(idle_ms + 1_500).to_string()])
            .arg("--socket")
            .arg(&daemon.socket)
            .stdout(Stdio::null())
            .spawn()?;
        std::thread::sleep(Duration::from_millis(700)); // connected, warmed up, now idle
        let daemon_pid = daemon.pid();
        let d0 = daemon_pid.map(cpu_ticks).transpose()?;
        let c0 = cpu_ticks(client.id())?;
        std::thread::sleep(Duration::from_millis(idle_ms));
        let d1 = daemon_pid.map(cpu_ticks).transpose()?;
        let c1 = cpu_ticks(client.id())?;
        let _ = client.wait();
        let seconds = idle_ms as f64 / 1000.0;
        let pct = |a: u64, b: u64| (b - a) as f64 / 100.0 / seconds * 100.0;
        (d0.zip(d1).map(|(a, b)| pct(a, b)), pct(c0, c1))
    };

    let col = |f: fn(&LatencyRun) -> f64| spread(&results.iter().map(f).collect::<Vec<_>>());
    let p50 = col(|r| r.p50_ns as f64);
    let p99 = col(|r| r.p99_ns as f64);
    let max = col(|r| r.max_ns as f64);
    let thr = col(|r| r.throughput_tasks_per_s);
    let multi = col(|r| r.multi_client_throughput_tasks_per_s);
    let lane50 = col(|r| r.lane_p50_ns as f64);
    let lane99 = col(|r| r.lane_p99_ns as f64);
    let ratio = p50.median / (floor_p50.max(1) as f64);

    if args.json {
        let out = serde_json::json!({
            "iterations": iterations,
            "runs": results,
            "p50_ns": p50.median,
            "p99_ns": p99.median,
            "max_ns": max.median,
            "throughput_tasks_per_s": thr.median,
            "multi_client_throughput_tasks_per_s": multi.median,
            "lane_p50_ns": lane50.median,
            "lane_p99_ns": lane99.median,
            "floor_p50_ns": floor_p50,
            "floor_p99_ns": floor_p99,
            "p50_over_floor": ratio,
            "idle_daemon_cpu_percent": idle_daemon_pct,
            "idle_client_cpu_percent": idle_client_pct,
            "spread": {
                "p50_ns": p50, "p99_ns": p99, "max_ns": max,
                "throughput_tasks_per_s": thr, "multi_client_throughput_tasks_per_s": multi,
                "lane_p50_ns": lane50, "lane_p99_ns": lane99,
            },
        });
        println!("{}", serde_json::to_string_pretty(&out)?);
        return Ok(());
    }
    println!(
        "\n{:<40} {:>12} {:>12} {:>12}",
        "metric (over runs)", "min", "median", "max"
    );
    let row = |name: &str, s: &Spread, scale: f64| {
        println!(
            "{name:<40} {:>12.0} {:>12.0} {:>12.0}",
            s.min / scale,
            s.median / scale,
            s.max / scale
        );
    };
    row("round trip p50 (ns)", &p50, 1.0);
    row("round trip p99 (ns)", &p99, 1.0);
    row("round trip max (ns)", &max, 1.0);
    row("pipelined, 1 client (k tasks/s)", &thr, 1e3);
    row("pipelined, 4 clients (k tasks/s)", &multi, 1e3);
    if socket.is_none() {
        row("round trip via a lane, p50 (ns)", &lane50, 1.0);
        row("round trip via a lane, p99 (ns)", &lane99, 1.0);
    }
    println!(
        "{:<40} {:>12} {:>12}",
        "in-process noop call (floor), p50/p99", floor_p50, floor_p99
    );
    println!("{:<40} {:>12.1}", "round trip p50 / floor", ratio);
    match idle_daemon_pct {
        Some(d) => println!(
            "idle for {:.1} s: daemon {d:.1}% of a core, connected client {idle_client_pct:.1}%",
            idle_ms as f64 / 1e3
        ),
        None => println!("idle client {idle_client_pct:.1}% of a core (daemon not ours, not measured)"),
    }
    Ok(())
}

/// Runs a benchmark.
pub fn run(socket: Option<PathBuf>, command: BenchCommand) -> Result<()> {
    match command {
        BenchCommand::Latency(args) => latency(socket, args),
        BenchCommand::Overhead(args) => overhead(socket, args),
        BenchCommand::Hetero(args) => crate::bench_sched::hetero(args),
        BenchCommand::Sharing(args) => crate::bench_sched::sharing(socket, args),
        BenchCommand::Sla(args) => crate::bench_sched::sla(args),
        BenchCommand::Migrate(args) => crate::bench_migrate::migrate(args),
    }
}

/// Runs a repeat-mode client process and returns its result.
fn repeat_client(socket: &Path, mode: &str, extra: &[String]) -> Result<RepeatResult> {
    let out = Command::new(std::env::current_exe()?)
        .args(["bench-client", mode])
        .args(extra)
        .arg("--socket")
        .arg(socket)
        .stderr(Stdio::inherit())
        .output()
        .context("starting a benchmark client")?;
    if !out.status.success() {
        bail!("a benchmark client failed ({})", out.status);
    }
    serde_json::from_slice(&out.stdout).context("benchmark client output")
}

fn minimum(values: &[f64]) -> f64 {
    values.iter().copied().fold(f64::INFINITY, f64::min)
}

fn median(values: &[f64]) -> f64 {
    let mut v = values.to_vec();
    v.sort_by(f64::total_cmp);
    if v.is_empty() {
        return f64::NAN;
    }
    v[v.len() / 2]
}

/// Sizes for the overhead benchmark: a few hundred milliseconds natively per run.
fn overhead_size(program: &str, quick: bool) -> u64 {
    match (program, quick) {
        ("gaussian", false) => 1024,
        ("gaussian", true) => 256,
        ("hotspot", false) => 512,
        ("hotspot", true) => 64,
        ("nw", false) => 2048,
        ("nw", true) => 256,
        ("pathfinder", false) => 100_000,
        ("pathfinder", true) => 10_000,
        ("lavamd", false) => 6,
        ("lavamd", true) => 2,
        ("backprop", false) => 1 << 20,
        ("backprop", true) => 1 << 14,
        (_, false) => 4 << 20,
        (_, true) => 1 << 18,
    }
}

#[derive(Serialize, Debug)]
struct OverheadRow {
    program: String,
    device: String,
    size: u64,
    launches: usize,
    native_s: f64,
    agora_s: f64,
    ratio: f64,
    /// Best Agora run over best native run: robust to the noise of a shared 2-core VM.
    ratio_min: f64,
    native_runs_s: Vec<f64>,
    agora_runs_s: Vec<f64>,
    verified: bool,
}

fn overhead(socket: Option<PathBuf>, args: OverheadArgs) -> Result<()> {
    let reps = args.reps.unwrap_or(if args.quick { 2 } else { 5 }).max(1);
    let programs: Vec<String> = args
        .programs
        .clone()
        .unwrap_or_else(|| agora_apps::PROGRAMS.iter().map(|(n, _)| n.to_string()).collect());
    let kinds = args
        .devices
        .clone()
        .unwrap_or_else(|| vec!["cpu".into(), "opencl".into()]);
    let mut native_cl = if kinds.iter().any(|k| k == "opencl") {
        match agora_apps::native::NativeOpenCl::open() {
            Ok(cl) => Some(cl),
            Err(e) => bail!("the OpenCL baseline needs an OpenCL device ({e}); run `make setup` or pass --devices cpu"),
        }
    } else {
        None
    };
    let daemon = DaemonProcess::start(socket.as_deref(), &[])?;
    let mut rows = Vec::new();
    for program in &programs {
        let size = overhead_size(program, args.quick);
        let workload = agora_apps::build(program, size, None).with_context(|| format!("unknown program {program}"))?;
        for kind in &kinds {
            let mut native_runs = Vec::new();
            let mut verified = true;
            for rep in 0..=reps {
                let r = match kind.as_str() {
                    "cpu" => agora_apps::native::run_cpu(&workload).map_err(anyhow::Error::msg)?,
                    "opencl" => agora_apps::native::run_opencl(native_cl.as_mut().context("OpenCL")?, &workload)
                        .map_err(anyhow::Error::msg)?,
                    other => bail!("unknown device kind {other}: use cpu or opencl"),
                };
                verified &= r.verified;
                if rep > 0 {
                    native_runs.push(r.seconds);
                }
            }
            let extra = [
                "--iterations".to_string(),
                reps.to_string(),
                "--app".into(),
                program.clone(),
                "--size".into(),
                size.to_string(),
                "--device-kind".into(),
                kind.clone(),
            ];
            let agora = repeat_client(&daemon.socket, "workload", &extra)?;
            verified &= agora.verified;
            let row = OverheadRow {
                program: program.clone(),
                device: kind.clone(),
                size,
                launches: workload.launches(),
                native_s: median(&native_runs),
                agora_s: median(&agora.seconds),
                ratio: median(&agora.seconds) / median(&native_runs),
                ratio_min: minimum(&agora.seconds) / minimum(&native_runs),
                native_runs_s: native_runs,
                agora_runs_s: agora.seconds,
                verified,
            };
            if !args.json {
                eprintln!(
                    "  {:<12} {:<7} native {:>9.4}s  agora {:>9.4}s  ratio {:.3}{}",
                    row.program,
                    row.device,
                    row.native_s,
                    row.agora_s,
                    row.ratio,
                    if row.verified { "" } else { "  VERIFICATION FAILED" }
                );
            }
            rows.push(row);
        }
    }
    let geomean = (rows.iter().map(|r| r.ratio.ln()).sum::<f64>() / rows.len().max(1) as f64).exp();
    let geomean_min = (rows.iter().map(|r| r.ratio_min.ln()).sum::<f64>() / rows.len().max(1) as f64).exp();

    // Transfer round trip on the OpenCL device: write, fill on the device, read back.
    let transfer = if let Some(cl) = native_cl.as_mut() {
        let bytes = args
            .transfer_bytes
            .unwrap_or(if args.quick { 64 << 20 } else { 1 << 30 });
        let mut host = vec![0u8; bytes as usize];
        let mut device = cl.transfer_buffer(bytes as usize).map_err(anyhow::Error::msg)?;
        let mut native_runs = Vec::new();
        for rep in 0..=reps {
            let s = agora_apps::native::transfer_round_trip(cl, &mut device, &mut host).map_err(anyhow::Error::msg)?;
            if rep > 0 {
                native_runs.push(s);
            }
        }
        let extra = [
            "--iterations".to_string(),
            reps.to_string(),
            "--size".into(),
            bytes.to_string(),
            "--device-kind".into(),
            "opencl".into(),
        ];
        let agora = repeat_client(&daemon.socket, "transfer", &extra)?;
        Some((
            bytes,
            median(&native_runs),
            median(&agora.seconds),
            agora.verified,
            native_runs,
            agora.seconds,
        ))
    } else {
        None
    };
    drop(daemon);

    let all_verified = rows.iter().all(|r| r.verified) && transfer.as_ref().is_none_or(|t| t.3);
    if args.json {
        let out = serde_json::json!({
            "repetitions": reps,
            "programs": rows,
            "geomean_ratio": geomean,
            "geomean_ratio_min": geomean_min,
            "transfer_bytes": transfer.as_ref().map(|t| t.0),
            "transfer_native_s": transfer.as_ref().map(|t| t.1),
            "transfer_agora_s": transfer.as_ref().map(|t| t.2),
            "transfer_ratio": transfer.as_ref().map(|t| t.2 / t.1),
            "transfer_ratio_min": transfer.as_ref().map(|t| minimum(&t.5) / minimum(&t.4)),
            "transfer_native_runs_s": transfer.as_ref().map(|t| t.4.clone()),
            "transfer_agora_runs_s": transfer.as_ref().map(|t| t.5.clone()),
            "verified": all_verified,
        });
        println!("{}", serde_json::to_string_pretty(&out)?);
    } else {
        println!(
            "\n{:<12} {:<7} {:>8} {:>9} {:>11} {:>11} {:>7} {:>9}",
            "program", "device", "size", "launches", "native (s)", "agora (s)", "ratio", "best/best"
        );
        for r in &rows {
            println!(
                "{:<12} {:<7} {:>8} {:>9} {:>11.4} {:>11.4} {:>7.3} {:>9.3}",
                r.program, r.device, r.size, r.launches, r.native_s, r.agora_s, r.ratio, r.ratio_min
            );
        }
        println!(
            "geometric mean of ratios: {geomean:.3} (medians of {reps} runs each); of best-run ratios: {geomean_min:.3}"
        );
        if let Some((bytes, native, agora, _, _, _)) = &transfer {
            println!(
                "transfer round trip of {} MiB (write, fill on device, read): native {native:.3}s, agora {agora:.3}s, ratio {:.3}",
                bytes >> 20,
                agora / native
            );
        }
    }
    if !all_verified {
        bail!("a result did not match its host reference");
    }
    Ok(())
}
