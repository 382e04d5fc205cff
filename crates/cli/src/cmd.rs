//! The everyday subcommands: serve, status, kernels, run, demo.

use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use agora::{Session, SessionOptions};
use agora_apps::AppReport;
use agora_daemon::DaemonConfig;
use anyhow::{bail, Context, Result};
use clap::{Args, ValueEnum};

use crate::size::parse_bytes;

/// `agora serve` options. Settings come from the defaults, then `--config FILE`, then these flags;
/// `--print-config` shows the result as a configuration file.
#[derive(Args, Debug)]
pub struct ServeArgs {
    /// A TOML configuration file (devices, lanes, memory limits, policy, sim devices...); see
    /// `agora serve --print-config` for every setting and its default.
    #[arg(long, value_name = "FILE")]
    config: Option<PathBuf>,
    /// Print every effective setting as a configuration file and exit.
    #[arg(long)]
    print_config: bool,
    /// Placement policy: rr (round-robin), perf (least expected completion time, learned),
    /// energy (least predicted energy within the slack).
    #[arg(long, value_name = "NAME", value_parser = agora_daemon::PolicyKind::parse)]
    policy: Option<agora_daemon::PolicyKind>,
    /// Where the daemon keeps its performance model across restarts (default: $AGORA_STATE_DIR,
    /// else $XDG_STATE_HOME/agora, else ~/.local/state/agora).
    #[arg(long, value_name = "DIR")]
    state_dir: Option<PathBuf>,
    /// Most device memory one session may hold per device, e.g. 1G (default: no limit but the
    /// device's); beyond it the session's idle buffers are evicted to host memory.
    #[arg(long, value_name = "BYTES", value_parser = parse_bytes)]
    device_quota: Option<u64>,
    /// Batch kernels predicted to run longer than twice this are split into slices of about this
    /// length, so latency-class tasks wait at most about one slice (default 1000; 0: never split).
    #[arg(long, value_name = "US")]
    preempt_target_us: Option<u64>,
    /// How latency-class work is protected: none (latency-first lanes and chunking only),
    /// priority (placed where it starts soonest; batch launches that are not sliced run revocable
    /// and are revoked and replayed on demand) or elastic (TReM: as priority, with lanes reserved
    /// for latency work and revocation only when a request would miss its SLA). Default elastic.
    #[arg(long, value_name = "POLICY", value_parser = agora_daemon::policy::latency::LatencyPolicy::parse)]
    latency_policy: Option<agora_daemon::policy::latency::LatencyPolicy>,
    /// Response-time target of latency-class queues that set none, in ms (default 200).
    #[arg(long, value_name = "MS")]
    latency_sla_ms: Option<f64>,
    /// Most memory Agora uses on each OpenCL device, e.g. 512M (default: all it reports).
    #[arg(long, value_name = "BYTES", value_parser = parse_bytes)]
    opencl_memory_limit: Option<u64>,
    /// CPU lanes (default: one per core).
    #[arg(long, value_name = "N")]
    cpu_lanes: Option<usize>,
    /// Worker threads per CPU lane; a lane runs one task at a time over all its threads.
    #[arg(long, value_name = "N")]
    cpu_threads_per_lane: Option<usize>,
    /// Largest buffer heap one session may have, e.g. 512M or 4G.
    #[arg(long, value_name = "BYTES", value_parser = parse_bytes)]
    session_quota: Option<u64>,
    /// Submission/completion ring entries per session (a power of two).
    #[arg(long, value_name = "N")]
    ring_capacity: Option<u32>,
    /// Run tasks estimated below this many nanoseconds inline on the dispatcher (0: never).
    #[arg(long, value_name = "NS")]
    inline_max_ns: Option<u64>,
    /// Longest the dispatcher polls for new work before it sleeps, in microseconds.
    #[arg(long, value_name = "US")]
    max_spin_us: Option<u64>,
    /// Lanes (command queues) per OpenCL device.
    #[arg(long, value_name = "N")]
    opencl_lanes: Option<usize>,
    /// Do not look for OpenCL devices.
    #[arg(long)]
    no_opencl: bool,
    /// Serve Prometheus metrics on this address (`/metrics`), e.g. 127.0.0.1:9464 or just 9464
    /// (loopback). To expose them beyond this host, give a routable address and restrict access
    /// with a firewall or a reverse proxy: the endpoint has no authentication.
    #[arg(long, value_name = "ADDR", value_parser = parse_metrics_addr)]
    metrics: Option<std::net::SocketAddr>,
    /// Record a task trace (Chrome/Perfetto JSON) and write it to FILE at shutdown and on
    /// `agora trace save`; view it at ui.perfetto.dev or with `agora plot trace`.
    #[arg(long, value_name = "FILE")]
    trace: Option<PathBuf>,
    /// Most spans the trace keeps in memory (the oldest are dropped first) [default: 500000].
    #[arg(long, value_name = "N")]
    trace_capacity: Option<usize>,
}

fn parse_metrics_addr(text: &str) -> Result<std::net::SocketAddr, String> {
    if let Ok(port) = text.parse::<u16>() {
        return Ok(std::net::SocketAddr::from(([127, 0, 0, 1], port)));
    }
    text.parse()
        .map_err(|_| format!("'{text}' is not an address: use HOST:PORT, e.g. 127.0.0.1:9464, or a port"))
}

impl ServeArgs {
    /// Defaults, then the configuration file, then the flags (and `--socket` / `$AGORA_SOCKET`).
    pub(crate) fn config(&self, socket: Option<PathBuf>) -> Result<DaemonConfig> {
        let mut c = DaemonConfig::default();
        if let Some(path) = &self.config {
            let text = std::fs::read_to_string(path)
                .with_context(|| format!("cannot read the configuration file {}", path.display()))?;
            c.apply_toml(&text)
                .with_context(|| format!("in the configuration file {}", path.display()))?;
        }
        if socket.is_some() {
            c.socket = agora_transport::socket::socket_path(socket);
        }
        if let Some(v) = self.cpu_lanes {
            c.cpu_lanes = v;
        }
        if let Some(v) = self.cpu_threads_per_lane {
            c.cpu_threads_per_lane = v;
        }
        if let Some(v) = self.session_quota {
            c.session_quota = v;
        }
        if let Some(v) = self.ring_capacity {
            c.ring_capacity = v;
        }
        if let Some(v) = self.inline_max_ns {
            c.inline_max_ns = v;
        }
        if let Some(v) = self.max_spin_us {
            c.max_spin = Duration::from_micros(v);
        }
        if let Some(v) = self.opencl_lanes {
            c.opencl_lanes = v.max(1);
        }
        if let Some(v) = self.opencl_memory_limit {
            c.opencl_memory_limit = v;
        }
        if let Some(v) = self.preempt_target_us {
            c.preempt_target = Duration::from_micros(v);
        }
        if let Some(v) = self.latency_policy {
            c.latency_policy = v;
        }
        if let Some(ms) = self.latency_sla_ms {
            anyhow::ensure!(
                ms.is_finite() && ms > 0.0,
                "--latency-sla-ms {ms}: the response-time target must be a positive number of milliseconds"
            );
            c.latency_sla = Duration::from_secs_f64(ms / 1e3);
        }
        if let Some(v) = self.device_quota {
            c.device_quota = v;
        }
        if let Some(v) = self.policy {
            c.policy = v;
        }
        if let Some(v) = &self.state_dir {
            c.state_dir = v.clone();
        }
        c.opencl &= !self.no_opencl;
        if self.metrics.is_some() {
            c.metrics = self.metrics;
        }
        if self.trace.is_some() {
            c.trace = self.trace.clone();
        }
        if let Some(v) = self.trace_capacity {
            c.trace_capacity = v;
        }
        c.validate().context("invalid settings")?;
        Ok(c)
    }
}

pub fn serve(socket: Option<PathBuf>, args: ServeArgs) -> Result<()> {
    let config = args.config(socket)?;
    if args.print_config {
        print!("{}", config.to_toml());
        return Ok(());
    }
    agora_daemon::run(config).context("the daemon stopped with an error")
}

/// `agora status` options.
#[derive(Args, Debug)]
pub struct StatusArgs {
    /// Print JSON instead of a table.
    #[arg(long)]
    json: bool,
}

pub fn status(socket: Option<PathBuf>, args: StatusArgs) -> Result<()> {
    let report = agora::daemon_status(socket)?;
    if args.json {
        println!("{}", serde_json::to_string_pretty(&report)?);
        return Ok(());
    }
    println!(
        "agora {} · pid {} · up {:.0}s · policy {} · {} tasks done, {} failed",
        report.version, report.pid, report.uptime_s, report.policy, report.tasks_completed, report.tasks_failed
    );
    for d in &report.devices {
        println!(
            "device {} ({}) · {} lanes × {} threads{}",
            d.name,
            d.kind,
            d.lanes.len(),
            d.threads_per_lane,
            match (d.failed, d.draining) {
                (true, _) => " · FAILED (drained)",
                (false, true) => " · draining",
                _ => "",
            }
        );
        for (i, l) in d.lanes.iter().enumerate() {
            println!(
                "  lane {i}: {:<4} queued {:<4} completed {:<8} busy {:.3}s",
                if l.busy { "busy" } else { "idle" },
                l.queued,
                l.completed,
                l.busy_ns as f64 / 1e9
            );
        }
    }
    println!(
        "sessions: {} live, {} closing · {} opened, {} closed since start",
        report.sessions.len(),
        report.closing_sessions,
        report.sessions_opened,
        report.sessions_closed
    );
    for s in &report.sessions {
        println!(
            "  #{:<4} {:<16} pid {:<7} uid {:<6} queues {:<3} buffers {:<4} heap {}/{} MiB · tasks {} ok {} failed {} in flight",
            s.id,
            s.name,
            s.pid,
            s.uid,
            s.queues.len(),
            s.buffers,
            s.heap_used >> 20,
            s.heap_quota >> 20,
            s.tasks_completed,
            s.tasks_failed,
            s.in_flight
        );
        for q in &s.queues {
            // What the client asked for (a hint) beside what the policy chose.
            println!(
                "        queue {:<16} {:<7} in flight {:<5} prefers {:<7} {}",
                q.name,
                format!("{:?}", q.class).to_lowercase(),
                q.in_flight,
                q.preferred.as_deref().unwrap_or("any"),
                match (&q.bound_to, &q.last_device) {
                    (Some(bound), _) if q.moving => format!("bound to {bound}, moving (new tasks wait)"),
                    (Some(bound), _) => format!("bound to {bound}"),
                    (None, Some(last)) => format!("last ran on {last}"),
                    (None, None) => "not run yet".to_string(),
                }
            );
        }
    }
    if report.revocations > 0 {
        println!(
            "batch launches revoked for latency work since start: {} ({:.3} s of work replayed; latency policy {})",
            report.revocations, report.revoked_work_s, report.latency_policy
        );
    }
    if report.evictions > 0 {
        println!("buffers evicted from device memory since start: {}", report.evictions);
    }
    if report.migrations > 0 || report.tasks_replayed > 0 || report.tasks_lost > 0 {
        println!(
            "queue migrations since start: {} · tasks replayed after a device failure: {}, lost: {}",
            report.migrations, report.tasks_replayed, report.tasks_lost
        );
    }
    Ok(())
}

/// `agora drain` / `agora undrain` options.
#[derive(Args, Debug)]
pub struct DrainArgs {
    /// Device name, as `agora devices` lists it (e.g. `opencl0`, `sim0`).
    device: String,
    /// (drain) Also write the device's idle buffers back to host memory and free them there now,
    /// before removing the device; buffers in use move when their tasks need them.
    #[arg(long)]
    evacuate: bool,
}

pub fn drain(socket: Option<PathBuf>, args: DrainArgs, on: bool) -> Result<()> {
    let verb = if on { "drain" } else { "undrain" };
    let outcome = agora::drain_device(socket, &args.device, on, args.evacuate && on)
        .with_context(|| format!("could not {verb} device '{}'", args.device))?;
    if outcome.draining {
        println!(
            "device {} is draining: no new placements; {} busy queue(s) bound to it migrate when their in-flight tasks finish",
            args.device, outcome.queues_bound
        );
        if args.evacuate {
            println!(
                "evacuated {} buffer(s), {:.1} MiB of device memory, to host memory",
                outcome.evacuated_buffers,
                outcome.evacuated_bytes as f64 / (1 << 20) as f64
            );
        }
    } else {
        println!("device {} takes new work again", args.device);
    }
    Ok(())
}

pub fn devices(socket: Option<PathBuf>) -> Result<()> {
    let report = agora::daemon_status(socket)?;
    println!(
        "{:<10} {:<7} {:>6} {:>12}  description",
        "device", "kind", "lanes", "memory"
    );
    for d in &report.devices {
        let memory = if d.memory_bytes == 0 {
            "host".to_string()
        } else {
            format!("{} MiB", d.memory_bytes >> 20)
        };
        println!(
            "{:<10} {:<7} {:>6} {:>12}  {}",
            d.name,
            d.kind,
            d.lanes.len(),
            memory,
            d.description
        );
    }
    Ok(())
}

/// Asks the daemon to write its task trace now.
pub fn trace_save(socket: Option<PathBuf>) -> Result<()> {
    use agora_protocol::control::{Request, Response};
    let path = agora_transport::socket::socket_path(socket);
    let stream = std::os::unix::net::UnixStream::connect(&path).with_context(|| {
        format!(
            "cannot reach the daemon at {}; is `agora serve` running?",
            path.display()
        )
    })?;
    agora_transport::socket::send(&stream, &Request::SaveTrace)?;
    match agora_transport::socket::recv::<Response>(&stream)? {
        Response::TraceSaved { path, spans } => {
            println!("wrote {spans} spans to {path}");
            Ok(())
        }
        Response::Error(e) => bail!("{e}"),
        other => bail!("unexpected reply from the daemon: {other:?}"),
    }
}

pub fn kernels(socket: Option<PathBuf>) -> Result<()> {
    let session = Session::connect_with(SessionOptions {
        socket,
        name: Some("agora kernels".into()),
        heap_bytes: Some(4096),
    })?;
    for k in session.kernels()? {
        println!("{k}\n    {}", k.doc);
    }
    Ok(())
}

/// `agora run` options.
#[derive(Args, Debug)]
pub struct RunArgs {
    /// Which workload (see `agora run --list`).
    #[arg(required_unless_present = "list")]
    app: Option<String>,
    /// List the workloads and what --size means for each.
    #[arg(long)]
    list: bool,
    /// Problem size (program-specific; see --list).
    #[arg(long)]
    size: Option<u64>,
    /// Iterations, for iterative programs (e.g. saxpy launches).
    #[arg(long)]
    iterations: Option<usize>,
    /// Print the report as JSON.
    #[arg(long)]
    json: bool,
    /// Which kind of device the workload's queue prefers.
    #[arg(long, value_enum, default_value_t = DeviceChoice::Any)]
    device_kind: DeviceChoice,
}

/// A device-kind preference on the command line.
#[derive(ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub enum DeviceChoice {
    /// The CPU device.
    Cpu,
    /// An OpenCL device.
    Opencl,
    /// Whatever the daemon picks.
    Any,
}

impl DeviceChoice {
    pub(crate) fn kind(self) -> Option<agora::DeviceKind> {
        match self {
            DeviceChoice::Cpu => Some(agora::DeviceKind::Cpu),
            DeviceChoice::Opencl => Some(agora::DeviceKind::OpenCl),
            DeviceChoice::Any => None,
        }
    }
}

pub fn run(socket: Option<PathBuf>, args: RunArgs) -> Result<()> {
    if args.list {
        for (name, size) in agora_apps::PROGRAMS {
            println!(
                "{name:<12} --size = {size} (default {})",
                agora_apps::default_size(name)
            );
        }
        return Ok(());
    }
    let app = args.app.clone().unwrap_or_default();
    let size = args.size.unwrap_or_else(|| agora_apps::default_size(&app));
    let Some(workload) = agora_apps::build(&app, size, args.iterations) else {
        let names: Vec<&str> = agora_apps::PROGRAMS.iter().map(|(n, _)| *n).collect();
        bail!("unknown workload '{app}'; choose one of: {}", names.join(", "));
    };
    let session = Session::connect_with(SessionOptions {
        socket,
        name: Some(format!("agora run {app}")),
        heap_bytes: None,
    })?;
    let report = agora_apps::run_on_agora(&session, &workload, args.device_kind.kind())?;
    if args.json {
        println!("{}", serde_json::to_string(&report)?);
    } else {
        println!(
            "{} size {}: {} tasks in {:.3}s, max error {:.2e}, {}",
            report.app,
            report.size,
            report.tasks,
            report.seconds,
            report.max_error,
            if report.verified {
                "verified OK"
            } else {
                "VERIFICATION FAILED"
            }
        );
    }
    if !report.verified {
        bail!("{} result does not match the host reference", report.app);
    }
    Ok(())
}

/// `agora demo` options.
#[derive(Args, Debug)]
pub struct DemoArgs {
    /// Gaussian matrix order.
    #[arg(long, default_value_t = 384)]
    gaussian_size: usize,
    /// Elements per saxpy stream.
    #[arg(long, default_value_t = 1 << 20)]
    saxpy_size: usize,
    /// Concurrent client processes of each kind.
    #[arg(long, default_value_t = 2)]
    clients: usize,
}

pub fn demo(args: DemoArgs) -> Result<()> {
    let dir = std::env::temp_dir().join(format!("agora-demo-{}", std::process::id()));
    std::fs::create_dir_all(&dir)?;
    let socket = dir.join("agora.sock");
    let config = DaemonConfig {
        socket: socket.clone(),
        ..DaemonConfig::default()
    };
    println!(
        "agora demo: embedded daemon on {} ({} CPU lanes × {} threads)",
        socket.display(),
        config.cpu_lanes,
        config.cpu_threads_per_lane
    );
    let daemon = agora_daemon::spawn(config)?;
    let exe = std::env::current_exe()?;
    let started = Instant::now();
    let mut children = Vec::new();
    for i in 0..args.clients.max(1) {
        for (app, size, extra) in [
            ("gaussian", args.gaussian_size, vec![]),
            (
                "saxpy",
                args.saxpy_size,
                vec!["--iterations".to_string(), "200".to_string()],
            ),
        ] {
            let child = Command::new(&exe)
                .args(["run", app, "--json", "--size", &size.to_string()])
                .args(&extra)
                .env("AGORA_SOCKET", &socket)
                .stdout(Stdio::piped())
                .stderr(Stdio::inherit())
                .spawn()
                .with_context(|| format!("starting client {app} #{i}"))?;
            children.push((format!("{app}#{i}"), child));
        }
    }
    println!(
        "started {} client processes (gaussian + saxpy streams), all sharing the daemon",
        children.len()
    );
    let mut reports: Vec<(String, u32, Option<AppReport>)> = Vec::new();
    for (label, child) in children {
        let pid = child.id();
        let out = child.wait_with_output()?;
        let report = serde_json::from_slice::<AppReport>(&out.stdout).ok();
        reports.push((label, pid, report));
    }
    let wall = started.elapsed();
    let status = agora::daemon_status(Some(socket.clone()))?;
    daemon.stop()?;
    let _ = std::fs::remove_dir_all(&dir);

    println!(
        "\n{:<12} {:>8} {:>10} {:>9} {:>10}  result",
        "client", "pid", "size", "tasks", "time (s)"
    );
    let mut all_ok = true;
    let mut tasks = 0;
    for (label, pid, report) in &reports {
        match report {
            Some(r) => {
                tasks += r.tasks;
                all_ok &= r.verified;
                println!(
                    "{:<12} {:>8} {:>10} {:>9} {:>10.3}  {}",
                    label,
                    pid,
                    r.size,
                    r.tasks,
                    r.seconds,
                    if r.verified {
                        "verification OK"
                    } else {
                        "VERIFICATION FAILED"
                    }
                );
            }
            None => {
                all_ok = false;
                println!(
                    "{label:<12} {pid:>8} {:>10} {:>9} {:>10}  client failed (see its error above)",
                    "-", "-", "-"
                );
            }
        }
    }
    println!(
        "\n{} tasks from {} clients in {:.2}s wall; daemon counted {} completed, {} failed",
        tasks,
        reports.len(),
        wall.as_secs_f64(),
        status.tasks_completed,
        status.tasks_failed
    );
    if !all_ok {
        bail!("at least one client failed or did not verify");
    }
    println!("all results verified against host references");
    Ok(())
}
