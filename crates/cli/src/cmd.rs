//! The everyday subcommands: serve, status, kernels, run, demo.

use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use agora::{Session, SessionOptions};
use agora_apps::AppReport;
use agora_daemon::DaemonConfig;
use agora_protocol::control::shown;
use anyhow::{bail, Context, Result};
use clap::{Args, ValueEnum};

use crate::size::parse_bytes;
use crate::SocketArg;

/// `agora serve` options. Settings come from the defaults, then `--config FILE`, then these flags;
/// `--print-config` shows the result as a configuration file.
#[derive(Args, Debug)]
pub struct ServeArgs {
    /// Control socket to listen on; this flag, and $AGORA_SOCKET in its place, override the
    /// file's `[daemon] socket` [default: $AGORA_SOCKET, else $XDG_RUNTIME_DIR/agora/agora.sock,
    /// else /tmp/agora-$UID/agora.sock].
    #[arg(long, env = "AGORA_SOCKET", value_name = "PATH")]
    socket: Option<PathBuf>,
    /// Who may connect: user (this daemon's user and root; socket mode 0600), group:NAME (members
    /// of group NAME; 0660) or all (every local user: a node-wide daemon; 0666). Each tenant
    /// works in its own sessions only (`agora status` shows every tenant's unless
    /// --private-status) and is held to the per-uid limits [default: user].
    #[arg(long, value_name = "WHO", value_parser = agora_daemon::SocketAccess::parse)]
    socket_access: Option<agora_daemon::SocketAccess>,
    /// Show each user who is no admin only its own sessions, uids, Slurm jobs and DAGs in
    /// `agora status` and `agora top`, and refuse it other users' `agora status --session ID`
    /// (node-wide counters and devices stay visible) [default: off: everyone sees all, as with
    /// `ps` and `squeue`].
    #[arg(long)]
    private_status: bool,
    /// A TOML configuration file (devices, lanes, memory limits, policy, sim devices...); see
    /// `agora serve --print-config` for every setting and its default.
    #[arg(long, value_name = "FILE")]
    config: Option<PathBuf>,
    /// Print every effective setting as a configuration file and exit.
    #[arg(long)]
    print_config: bool,
    /// Placement policy: rr (round-robin), perf (least expected completion time, learned),
    /// energy (least predicted energy within the slack) [default: perf].
    #[arg(long, value_name = "NAME", value_parser = agora_daemon::PolicyKind::parse)]
    policy: Option<agora_daemon::PolicyKind>,
    /// Where the daemon keeps its performance model across restarts, and by default its level-1
    /// checkpoints (`checkpoints/`, unless `[checkpoint] local` says otherwise): cleaning or
    /// moving it loses them [default: $AGORA_STATE_DIR,
    /// else a directory of this socket's own under $XDG_STATE_HOME/agora/daemons (else
    /// ~/.local/state/agora/daemons), so daemons on different sockets learn apart].
    #[arg(long, value_name = "DIR")]
    state_dir: Option<PathBuf>,
    /// Most device memory one session may hold per device, e.g. 1G; beyond it the session's idle
    /// buffers are evicted to host memory [default: no limit but the device's].
    #[arg(long, value_name = "BYTES", value_parser = parse_bytes)]
    device_quota: Option<u64>,
    /// Back-pressure: once a session's batch work on lanes is predicted to run this long, no
    /// more of its batch tasks are taken from its ring until lanes finish some (its client
    /// waits for ring room); 1 to 3600000 (1 h) [default: 2000].
    #[arg(long, value_name = "MS")]
    session_lane_work_ms: Option<u64>,
    /// Batch kernels predicted to run longer than twice this are split into slices of about this
    /// length, so latency-class tasks wait at most about one slice; 0: never split [default: 1000].
    #[arg(long, value_name = "US")]
    preempt_target_us: Option<u64>,
    /// How latency-class work is protected: none (latency-first lanes and chunking only),
    /// priority (placed where it starts soonest; batch launches that are not sliced run revocable
    /// and are revoked and replayed on demand) or elastic (TReM: as priority, with lanes reserved
    /// for latency work and revocation only when a request would miss its SLA) [default: elastic].
    #[arg(long, value_name = "POLICY", value_parser = agora_daemon::policy::latency::LatencyPolicy::parse)]
    latency_policy: Option<agora_daemon::policy::latency::LatencyPolicy>,
    /// Response-time target of latency-class queues that set none, in ms [default: 200].
    #[arg(long, value_name = "MS")]
    latency_sla_ms: Option<f64>,
    /// OS priority of lane threads while they run batch-class jobs (latency-class jobs always run
    /// at normal priority): auto (batch, and idle while latency-class work is live: a
    /// latency-class task in the last second), idle (SCHED_IDLE: batch work yields the core to
    /// any other work), batch (SCHED_BATCH), normal (no difference) or nice:N. auto, idle and
    /// nice:N need CAP_SYS_NICE or RLIMIT_NICE >= 20 to bring a lane back to normal priority;
    /// without, the daemon says so and uses batch [default: auto].
    #[arg(long, value_name = "PRIORITY", value_parser = agora_daemon::BatchPriority::parse)]
    batch_priority: Option<agora_daemon::BatchPriority>,
    /// Added to the dispatcher thread's nice value, e.g. -5 to run it above lanes and clients
    /// (needs CAP_SYS_NICE or RLIMIT_NICE; without, the daemon says so and keeps it normal)
    /// [default: 0, unchanged].
    #[arg(long, value_name = "N", allow_hyphen_values = true)]
    dispatcher_nice: Option<i32>,
    /// Runs the dispatcher thread, and each device host's message loop, under SCHED_FIFO, so no
    /// lane or client thread preempts them (a nice value cannot: see `agora bench stall`); the
    /// dispatcher then keeps a core while it has work. Needs CAP_SYS_NICE or RLIMIT_RTPRIO >= 1;
    /// without, the daemon says so and goes on [default: off].
    #[arg(long)]
    dispatcher_realtime: bool,
    /// Most memory Agora uses on each OpenCL device, e.g. 512M [default: all it reports].
    #[arg(long, value_name = "BYTES", value_parser = parse_bytes)]
    opencl_memory_limit: Option<u64>,
    /// CPU lanes [default: one per core].
    #[arg(long, value_name = "N")]
    cpu_lanes: Option<usize>,
    /// Worker threads per CPU lane; a lane runs one task at a time over all its threads
    /// [default: 1].
    #[arg(long, value_name = "N")]
    cpu_threads_per_lane: Option<usize>,
    /// Largest buffer heap one session may have, e.g. 512M or 4G [default: 2G].
    #[arg(long, value_name = "BYTES", value_parser = parse_bytes)]
    session_quota: Option<u64>,
    /// Submission/completion ring entries per session (a power of two) [default: 1024].
    #[arg(long, value_name = "N")]
    ring_capacity: Option<u32>,
    /// Run tasks estimated below this many nanoseconds inline on the dispatcher (0: never)
    /// [default: 5000].
    #[arg(long, value_name = "NS")]
    inline_max_ns: Option<u64>,
    /// Longest the dispatcher polls for new work before it sleeps, in microseconds [default: 200].
    #[arg(long, value_name = "US")]
    max_spin_us: Option<u64>,
    /// On SIGTERM or Ctrl-C, seconds that work already running may take before the daemon
    /// gives up on it and exits (its clients see the daemon go away); a second signal exits at
    /// once [default: 5].
    #[arg(long, value_name = "SECONDS")]
    shutdown_timeout: Option<f64>,
    /// Lanes (command queues) per OpenCL device [default: 2].
    #[arg(long, value_name = "N")]
    opencl_lanes: Option<usize>,
    /// Do not look for OpenCL devices.
    #[arg(long)]
    no_opencl: bool,
    /// Run each OpenCL platform in a device-host process of its own (`[opencl] device_host`, the
    /// default): a driver crash or hang then costs a replay of that device's tasks, not the
    /// daemon and every session; each task pays a socket hop there and back.
    #[arg(long, conflicts_with = "no_opencl_device_host")]
    opencl_device_host: bool,
    /// Run OpenCL in the daemon's own process (`[opencl] device_host = false`): saves the hop
    /// (tens of microseconds per task), but a driver crash ends the daemon.
    #[arg(long)]
    no_opencl_device_host: bool,
    /// Run each GPU in a device-host process of its own (`[cuda] device_host`, the default): a
    /// kernel fault that ends the GPU's context then costs a replay of that GPU's tasks and a
    /// fresh context, not the GPU until the daemon restarts; each task pays a socket hop.
    #[arg(long, conflicts_with = "no_cuda_device_host")]
    cuda_device_host: bool,
    /// Run GPUs in the daemon's own process (`[cuda] device_host = false`): saves the hop, but a
    /// GPU whose context a kernel fault ended stays failed until the daemon restarts.
    #[arg(long)]
    no_cuda_device_host: bool,
    /// Lanes (streams) per GPU [default: 4].
    #[arg(long, value_name = "N")]
    cuda_lanes: Option<usize>,
    /// Most memory Agora uses on each GPU, e.g. 8G [default: all it reports].
    #[arg(long, value_name = "BYTES", value_parser = parse_bytes)]
    cuda_memory_limit: Option<u64>,
    /// Do not look for NVIDIA GPUs (without a CUDA driver there are none anyway).
    #[arg(long)]
    no_cuda: bool,
    /// Strict coherence, for finding missing sync_to/sync_from calls: every device, the CPU
    /// included, computes on its own copy of each buffer, so the host copy changes only at
    /// sync_from and device copies only at sync_to, wherever the daemon runs a task. Slower (a
    /// private copy per buffer on the CPU, no inline runs) [default: off].
    #[arg(long)]
    strict_coherence: bool,
    /// Serve Prometheus metrics on this address (`/metrics`), e.g. 127.0.0.1:9464 or just 9464
    /// (loopback). To expose them beyond this host, give a routable address and restrict access
    /// with a firewall or a reverse proxy: the endpoint has no authentication [default: off].
    #[arg(long, value_name = "ADDR", value_parser = parse_metrics_addr)]
    metrics: Option<std::net::SocketAddr>,
    /// A kernel package directory, or a directory of packages, to load (repeatable; adds to the
    /// configuration file's `[kernels] paths`). Packages are trusted code run inside the daemon;
    /// `agora kernels reload` picks up changes (docs/KERNELS.md) [default: $AGORA_KERNEL_PATH,
    /// else PREFIX/share/agora/packages and a source checkout's examples/packages, where they
    /// exist].
    #[arg(long = "kernels", value_name = "DIR")]
    kernel_paths: Vec<PathBuf>,
    /// Record a task trace (Chrome/Perfetto JSON) and write it to FILE at shutdown and on
    /// `agora trace save`; view it at ui.perfetto.dev or with `agora plot trace` [default: off].
    #[arg(long, value_name = "FILE")]
    trace: Option<PathBuf>,
    /// Most spans the trace keeps in memory (the oldest are dropped first) [default: 500000].
    #[arg(long, value_name = "N")]
    trace_capacity: Option<usize>,
    /// Longest one launch of a tenant program's kernel may run, in milliseconds, before the
    /// daemon kills the session's executor (the task fails with KernelTimeout) [default: 10000].
    #[arg(long, value_name = "MS", value_parser = clap::value_parser!(u64).range(1..=86_400_000))]
    program_timeout: Option<u64>,
    /// Most open connections per uid, all its clients and observers together [default: 256].
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(u64).range(1..))]
    limit_connections_per_uid: Option<u64>,
    /// Most live sessions per uid [default: 64].
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(u64).range(1..))]
    limit_sessions_per_uid: Option<u64>,
    /// Most heap bytes granted to one uid's sessions together, e.g. 16G: shared memory its
    /// clients can fill [default: half of physical memory].
    #[arg(long, value_name = "BYTES", value_parser = parse_bytes)]
    limit_heap_per_uid: Option<u64>,
    /// Most live queues per uid, all its sessions [default: 16384].
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(u64).range(1..))]
    limit_queues_per_uid: Option<u64>,
    /// Most live buffers per uid, all its sessions [default: 262144].
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(u64).range(1..))]
    limit_buffers_per_uid: Option<u64>,
    /// Most control requests of one uid waiting for the daemon's control thread (status,
    /// kernel lookups and lists, trace saves, program builds) [default: 4096].
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(u64).range(1..))]
    limit_control_requests_per_uid: Option<u64>,
    /// Control requests per second one connection may make on average (token bucket; beyond
    /// it requests are refused with a LimitReached error, the connection stays) [default: 100000].
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(u64).range(1..))]
    limit_control_rate: Option<u64>,
    /// Control requests one connection may make at once before the rate applies
    /// [default: 100000].
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(u64).range(1..))]
    limit_control_burst: Option<u64>,
    /// Milliseconds a connection may wait before its first request; then it is closed
    /// [default: 10000].
    #[arg(long, value_name = "MS", value_parser = clap::value_parser!(u64).range(1..=86_400_000))]
    hello_timeout_ms: Option<u64>,
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
            c.apply_toml_file(&text, path)
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
        if let Some(access) = &self.socket_access {
            c.socket_access = access.clone();
        }
        if self.private_status {
            c.private_status = true;
        }
        if let Some(s) = self.shutdown_timeout {
            anyhow::ensure!(
                s.is_finite() && (0.0..=86_400.0).contains(&s),
                "--shutdown-timeout {s}: give a number of seconds between 0 and 86400"
            );
            c.shutdown_timeout = Duration::from_secs_f64(s);
        }
        if let Some(v) = self.opencl_lanes {
            c.opencl_lanes = v;
        }
        if let Some(v) = self.opencl_memory_limit {
            c.opencl_memory_limit = v;
        }
        if let Some(v) = self.cuda_lanes {
            c.cuda_lanes = v;
        }
        if let Some(v) = self.cuda_memory_limit {
            c.cuda_memory_limit = v;
        }
        if let Some(v) = self.session_lane_work_ms {
            c.session_lane_work = Duration::from_millis(v);
        }
        if let Some(v) = self.preempt_target_us {
            c.preempt_target = Duration::from_micros(v);
        }
        if let Some(v) = self.latency_policy {
            c.latency_policy = v;
        }
        if let Some(ms) = self.latency_sla_ms {
            // The upper bound is `validate`'s; checked here too because a `Duration` cannot hold
            // every finite number of seconds.
            let most = agora_daemon::MAX_LATENCY_SLA.as_millis();
            anyhow::ensure!(
                ms.is_finite() && ms > 0.0 && ms <= most as f64,
                "--latency-sla-ms {ms}: the response-time target must be a positive number of milliseconds, at most {most} (1 h)"
            );
            c.latency_sla = Duration::from_secs_f64(ms / 1e3);
        }
        if let Some(v) = self.device_quota {
            c.device_quota = v;
        }
        if let Some(v) = self.batch_priority {
            c.batch_priority = v;
        }
        if let Some(v) = self.dispatcher_nice {
            c.dispatcher_nice = v;
        }
        if self.dispatcher_realtime {
            c.dispatcher_realtime = true;
        }
        if self.strict_coherence {
            c.strict_coherence = true;
        }
        if let Some(v) = self.policy {
            c.policy = v;
        }
        if let Some(v) = &self.state_dir {
            c.state_dir = Some(v.clone());
        }
        c.opencl &= !self.no_opencl;
        c.opencl_device_host |= self.opencl_device_host;
        c.opencl_device_host &= !self.no_opencl_device_host;
        c.cuda &= !self.no_cuda;
        c.cuda_device_host |= self.cuda_device_host;
        c.cuda_device_host &= !self.no_cuda_device_host;
        if self.metrics.is_some() {
            c.metrics = self.metrics;
        }
        if self.trace.is_some() {
            c.trace = self.trace.clone();
        }
        if let Some(v) = self.trace_capacity {
            c.trace_capacity = v;
        }
        c.kernel_paths.extend(self.kernel_paths.iter().cloned());
        if let Some(ms) = self.program_timeout {
            c.program_timeout = Duration::from_millis(ms);
        }
        let l = &mut c.limits;
        for (flag, setting) in [
            (self.limit_connections_per_uid, &mut l.connections_per_uid),
            (self.limit_sessions_per_uid, &mut l.sessions_per_uid),
            (self.limit_heap_per_uid, &mut l.heap_bytes_per_uid),
            (self.limit_queues_per_uid, &mut l.queues_per_uid),
            (self.limit_buffers_per_uid, &mut l.buffers_per_uid),
            (self.limit_control_requests_per_uid, &mut l.control_requests_per_uid),
            (self.limit_control_rate, &mut l.control_rate),
            (self.limit_control_burst, &mut l.control_burst),
        ] {
            if let Some(v) = flag {
                *setting = v;
            }
        }
        if let Some(ms) = self.hello_timeout_ms {
            l.hello_timeout = Duration::from_millis(ms);
        }
        if c.program_executor.is_none() {
            // Tenant programs and device hosts run in subcommands of this very binary: the
            // image this daemon runs, not the file at its path, which an upgrade in place
            // (`install` over it before `systemctl restart`) replaces while the old daemon
            // still serves — its children would then speak another version's protocol.
            c.program_executor = Some(agora_daemon::OWN_BINARY.into());
        }
        c.make_paths_absolute().context("invalid settings")?;
        c.validate().context("invalid settings")?;
        Ok(c)
    }
}

pub fn serve(args: ServeArgs) -> Result<()> {
    let config = args.config(args.socket.clone())?;
    if args.print_config {
        print!("{}", config.to_toml());
        return Ok(());
    }
    agora_daemon::run(config).map_err(|e| {
        let what = match e {
            agora_daemon::DaemonError::Socket(_)
            | agora_daemon::DaemonError::AlreadyRunning(_)
            | agora_daemon::DaemonError::Packages(_) => "the daemon cannot start",
            _ => "the daemon stopped with an error",
        };
        anyhow::Error::new(e).context(what)
    })
}

/// `agora status` options.
#[derive(Args, Debug)]
pub struct StatusArgs {
    /// Print JSON instead of a table.
    #[arg(long)]
    json: bool,
    /// Show one session (its id, as `agora status` lists it) with all its queues, instead of
    /// the summary (which lists the busiest sessions and their busiest queues).
    #[arg(long, value_name = "ID")]
    session: Option<u64>,
    #[command(flatten)]
    socket: SocketArg,
}

/// One session's line in `agora status` (`devices`: the daemon's device names, in order).
fn print_session(s: &agora::SessionStatus, devices: &[String]) {
    println!(
        "  #{:<4} {:<16} pid {:<7} uid {:<6} queues {:<3} buffers {:<4} heap {}/{} MiB · tasks {} ok {} failed {} in flight",
        s.id,
        shown(&s.name),
        s.pid,
        s.uid,
        s.queue_count,
        s.buffers,
        s.heap_used >> 20,
        s.heap_quota >> 20,
        s.tasks_completed,
        s.tasks_failed,
        s.in_flight
    );
    let device_memory: Vec<String> = s
        .device_memory
        .iter()
        .enumerate()
        .filter(|(_, bytes)| **bytes > 0)
        .map(|(i, bytes)| {
            let name = devices.get(i).map_or_else(|| format!("device {i}"), Clone::clone);
            format!("{name} {:.1} MiB", *bytes as f64 / f64::from(1u32 << 20))
        })
        .collect();
    if !device_memory.is_empty() {
        println!("        device memory: {}", device_memory.join(", "));
    }
    for q in &s.queues {
        // What the client asked for (a hint) beside what the policy chose.
        println!(
            "        queue {:<16} {:<7} in flight {:<5} prefers {:<7} {}",
            shown(&q.name),
            format!("{:?}", q.class).to_lowercase(),
            q.in_flight,
            q.preferred.map_or("any", |k| k.name()),
            match (&q.bound_to, &q.last_device) {
                (Some(bound), _) if q.moving => format!("bound to {bound}, moving (new tasks wait)"),
                (Some(bound), _) => format!("bound to {bound}"),
                (None, Some(last)) => format!("last ran on {last}"),
                (None, None) => "not run yet".to_string(),
            }
        );
    }
}

/// `agora status --session ID`: one session, every queue.
fn session_status(args: &StatusArgs, id: u64) -> Result<()> {
    let session = agora::daemon_session_status(args.socket.path(), id)?;
    if args.json {
        println!("{}", serde_json::to_string_pretty(&session)?);
        return Ok(());
    }
    // Device names for its device memory line (the summary has them in order).
    let devices: Vec<String> = agora::daemon_status(args.socket.path())
        .map(|r| r.devices.into_iter().map(|d| d.name).collect())
        .unwrap_or_default();
    print_session(&session, &devices);
    Ok(())
}

pub fn status(args: StatusArgs) -> Result<()> {
    if let Some(id) = args.session {
        return session_status(&args, id);
    }
    let report = agora::daemon_status(args.socket.path())?;
    if args.json {
        println!("{}", serde_json::to_string_pretty(&report)?);
        return Ok(());
    }
    println!(
        "agora {} · pid {} · up {:.0}s · policy {} · {} tasks done, {} failed",
        report.version, report.pid, report.uptime_s, report.policy, report.tasks_completed, report.tasks_failed
    );
    println!(
        "(tasks: what clients issued, buffer releases included; a lane counts jobs: a sliced launch is one job per slice, a \
         transfer one job, and tiny tasks run inline on the dispatcher are in no lane)"
    );
    for d in &report.devices {
        println!(
            "device {} ({}) · {} lanes × {} threads{}{}{}",
            d.name,
            d.kind,
            d.lanes.len(),
            d.threads_per_lane,
            d.utilization_percent
                .map(|p| format!(" · busy {p} % (the device's own figure, all its users)"))
                .unwrap_or_default(),
            if d.memory_bytes > 0 {
                format!(
                    " · memory {} of {} MiB in use{}",
                    d.memory_used >> 20,
                    d.memory_bytes >> 20,
                    if d.memory_cached > 0 {
                        format!(", {} MiB kept for tenants' next buffers", d.memory_cached >> 20)
                    } else {
                        String::new()
                    }
                )
            } else {
                String::new()
            },
            match (d.failed, d.draining) {
                (true, _) => " · FAILED (drained)",
                (false, true) => " · draining",
                _ => "",
            }
        );
        for (i, l) in d.lanes.iter().enumerate() {
            println!(
                "  lane {i}: {:<4} jobs queued {:<4} jobs done {:<8} busy {:.3}s",
                if l.busy { "busy" } else { "idle" },
                l.queued,
                l.completed,
                l.busy_ns as f64 / 1e9
            );
        }
    }
    println!(
        "sessions: {} live, {} closing · {} opened, {} closed since start",
        report.live_sessions, report.closing_sessions, report.sessions_opened, report.sessions_closed
    );
    let names: Vec<String> = report.devices.iter().map(|d| d.name.clone()).collect();
    for s in &report.sessions {
        print_session(s, &names);
        let more = s.queue_count.saturating_sub(s.queues.len() as u64);
        if more > 0 {
            println!(
                "        … and {more} more queue(s), the busiest shown: `agora status --session {}` lists them all",
                s.id
            );
        }
    }
    let listable = report.private.map_or(report.live_sessions, |view| view.sessions);
    let hidden = listable.saturating_sub(report.sessions.len() as u64);
    if hidden > 0 {
        println!("  … and {hidden} more session(s), the busiest shown: `agora status --session ID` shows any one");
    }
    if let Some(view) = report.private {
        println!(
            "  (uid {}'s sessions only: this daemon keeps each user's sessions private ([daemon] private_status); \
             {} of other users not shown)",
            view.uid,
            report.live_sessions.saturating_sub(view.sessions)
        );
    }
    if report.revocations > 0 {
        println!(
            "batch launches revoked for latency work since start: {} ({:.3} s of work replayed; latency policy {})",
            report.revocations, report.revoked_work_s, report.latency_policy
        );
    }
    println!(
        "dispatcher's longest stretch of work since start: {:.3} ms ({} over 1 ms)",
        report.dispatcher_longest_iteration_ms, report.dispatcher_stalls
    );
    if report.batch_priority == "auto" {
        println!(
            "batch lanes: {} now ({}; switches since start: {})",
            report.batch_priority_now,
            if report.batch_priority_now == "idle" {
                "auto: latency-class work is live"
            } else {
                "auto: idle only while latency-class work is live, none in the last second"
            },
            report.batch_priority_switches
        );
    } else if !report.batch_priority.is_empty() {
        println!("batch lanes: {}", report.batch_priority);
    }
    if report.evictions > 0 || report.memory_waits > 0 || report.allocation_retries > 0 {
        println!(
            "device memory pressure since start: {} buffers evicted, {} tasks waited for room, {} allocations retried after eviction",
            report.evictions, report.memory_waits, report.allocation_retries
        );
    }
    if report.migrations > 0 || report.tasks_replayed > 0 || report.tasks_lost > 0 {
        println!(
            "queue migrations since start: {} · tasks replayed after a device failure: {}, lost: {}",
            report.migrations, report.tasks_replayed, report.tasks_lost
        );
    }
    print_dags(&report.dags);
    if !report.jobs.is_empty() {
        println!("Slurm jobs on this node:");
        for job in &report.jobs {
            println!(
                "  job {} (uid {}, {} shares): {}",
                job.job,
                job.uid,
                job.shares,
                job_summary(job)
            );
        }
    }
    print_limits(&report);
    Ok(())
}

/// The admitted real-time DAGs, one line each.
pub(crate) fn print_dags(dags: &[agora_protocol::control::DagStatus]) {
    if dags.is_empty() {
        return;
    }
    println!("real-time DAGs (admitted now):");
    for d in dags {
        let stopped = d
            .stopped
            .as_deref()
            .map(|s| format!(" · STOPPED: {}", shown(s)))
            .unwrap_or_default();
        println!(
            "  #{:<4} {:<20} session {:<5} {} every {:.3} ms, deadline {:.3} ms · {} releases: {} met, {} missed, {} overruns · response p99 {:.3} ms, max {:.3} ms · nodes on {}{stopped}",
            d.id,
            shown(&d.name),
            d.session,
            if d.periodic { "released" } else { "sporadic, at least" },
            d.period_us as f64 / 1e3,
            d.deadline_us as f64 / 1e3,
            d.releases,
            d.met,
            d.missed,
            d.overruns,
            d.response_p99_us as f64 / 1e3,
            d.response_max_us as f64 / 1e3,
            d.lanes.join(", ")
        );
    }
}

/// Each uid's use against the per-uid limits, and what the limits refused.
fn print_limits(report: &agora::StatusReport) {
    if !report.uids.is_empty() {
        println!("limits per uid (in use / limit):");
    }
    let of = |u: agora_protocol::control::LimitUse, bytes: bool| {
        let show = |n: u64| if bytes { human_bytes(n) } else { n.to_string() };
        if u.max == u64::MAX {
            format!("{} (exempt)", show(u.used))
        } else {
            format!("{}/{}", show(u.used), show(u.max))
        }
    };
    for u in &report.uids {
        println!(
            "  uid {:<6} connections {} · sessions {} · heap {} · queues {} · buffers {} · control requests waiting {}",
            u.uid,
            of(u.connections, false),
            of(u.sessions, false),
            of(u.heap_bytes, true),
            of(u.queues, false),
            of(u.buffers, false),
            of(u.control_requests, false)
        );
    }
    let refused: Vec<String> = report
        .limit_refusals
        .iter()
        .filter(|(_, n)| *n > 0)
        .map(|(limit, n)| format!("{limit}: {n}"))
        .collect();
    if !refused.is_empty() {
        println!("refused by limits since start: {}", refused.join(" · "));
    }
}

/// `agora undrain` options, and the device `agora drain` names.
#[derive(Args, Debug)]
pub struct DeviceArgs {
    /// Device name, as `agora devices` lists it (e.g. `opencl0`, `sim0`).
    device: String,
    #[command(flatten)]
    socket: SocketArg,
}

/// `agora drain` options: `--evacuate` is drain's alone (an undrained device that takes new
/// work would fill up again), so `agora undrain --help` does not offer it.
#[derive(Args, Debug)]
pub struct DrainArgs {
    #[command(flatten)]
    target: DeviceArgs,
    /// Also write the device's idle buffers back to host memory and free them there now,
    /// before removing the device; buffers in use move when their tasks need them.
    #[arg(long)]
    evacuate: bool,
}

pub fn drain(args: DrainArgs) -> Result<()> {
    set_draining(args.target, true, args.evacuate)
}

pub fn undrain(args: DeviceArgs) -> Result<()> {
    set_draining(args, false, false)
}

fn set_draining(args: DeviceArgs, on: bool, evacuate: bool) -> Result<()> {
    let verb = if on { "drain" } else { "undrain" };
    let outcome = agora::drain_device(args.socket.path(), &args.device, on, evacuate)
        .with_context(|| format!("could not {verb} device '{}'", args.device))?;
    if outcome.draining {
        println!(
            "device {} is draining: no new placements; {} busy queue(s) bound to it migrate when their in-flight tasks finish, \
             idle ones with their next task ({} queue migration(s) since the daemon started; `agora status` counts them)",
            args.device, outcome.queues_bound, outcome.migrations
        );
        if evacuate {
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

/// `agora slurm …`.
#[derive(clap::Subcommand, Debug)]
pub enum SlurmCommand {
    /// Print the lines an administrator adds to slurm.conf and gres.conf for this node: node
    /// features naming Agora and its device kinds, and a count-only GRES `agora` of one share
    /// per lane of the node's devices (jobs ask `--gres=agora:K`).
    Conf(SlurmConfArgs),
    /// For Slurm's Prolog (as root): registers a job with this node's daemon, so that sessions
    /// of its processes join it (its heap quota, latency permission) and end with it.
    JobStart(SlurmJobStartArgs),
    /// For Slurm's Epilog (as root): ends a job's sessions on this node's daemon, even those of
    /// processes still running, and prints its accounting (device time per kind, bytes moved,
    /// modelled energy); also written to STATE_DIR/jobs/JOB.json.
    JobEnd(SlurmJobEndArgs),
    /// For Slurm's SuspendProgram: drains every device of this node's daemon, writing idle
    /// buffers back to host memory, so nothing is left on a device that powers down.
    Suspend(SlurmPowerArgs),
    /// For Slurm's ResumeProgram: makes every device of this node's daemon usable again.
    Resume(SlurmPowerArgs),
}

/// `agora slurm job-start`.
#[derive(Args, Debug)]
pub struct SlurmJobStartArgs {
    #[command(flatten)]
    pub socket: SocketArg,
    /// The job id [default: $SLURM_JOB_ID].
    #[arg(long, env = "SLURM_JOB_ID")]
    pub job: u64,
    /// The job's uid [default: $SLURM_JOB_UID].
    #[arg(long, env = "SLURM_JOB_UID")]
    pub uid: u32,
    /// The `agora` GRES shares the job has on this node (`--gres=agora:K`).
    #[arg(long, default_value_t = 0)]
    pub shares: u32,
    /// Heap quota of each of the job's sessions, e.g. 256M [default: the daemon's].
    #[arg(long, value_parser = parse_size)]
    pub heap_quota: Option<u64>,
    /// The job's sessions may open latency-class queues.
    #[arg(long)]
    pub latency: bool,
    /// Device memory each of the job's sessions may hold on one device, e.g. 2G [default: the
    /// daemon's `[sessions] device_quota`, which also bounds this].
    #[arg(long, value_parser = parse_size)]
    pub device_quota: Option<u64>,
    /// Slurm's restart count of the job [default: $SLURM_JOB_RESTART_COUNT, else 0]: after a
    /// requeue, the epilog's record adds this run's use to the earlier runs'.
    #[arg(long, env = "SLURM_JOB_RESTART_COUNT", default_value_t = 0)]
    pub restarts: u32,
}

/// `agora slurm job-end`.
#[derive(Args, Debug)]
pub struct SlurmJobEndArgs {
    #[command(flatten)]
    pub socket: SocketArg,
    /// The job id [default: $SLURM_JOB_ID].
    #[arg(long, env = "SLURM_JOB_ID")]
    pub job: u64,
    /// Print JSON instead of one line.
    #[arg(long)]
    pub json: bool,
}

/// `agora slurm suspend` / `resume`.
#[derive(Args, Debug)]
pub struct SlurmPowerArgs {
    #[command(flatten)]
    pub socket: SocketArg,
}

fn parse_size(text: &str) -> Result<u64, String> {
    agora_daemon::parse_bytes(text).map_err(|e| e.to_string())
}

/// `agora slurm conf`.
#[derive(Args, Debug)]
pub struct SlurmConfArgs {
    #[command(flatten)]
    pub socket: SocketArg,
    /// The node's name in slurm.conf (default: this host's name).
    #[arg(long)]
    pub node: Option<String>,
}

/// Runs `agora slurm …`.
pub fn slurm(command: SlurmCommand) -> Result<()> {
    match command {
        SlurmCommand::Conf(args) => slurm_conf(args),
        SlurmCommand::JobStart(args) => {
            let job = args.job;
            let registered = agora::slurm_job_start(
                args.socket.path(),
                agora::JobStart {
                    job,
                    uid: args.uid,
                    shares: args.shares,
                    heap_quota: args.heap_quota,
                    latency: args.latency,
                    device_quota: args.device_quota,
                    restarts: args.restarts,
                },
            )
            .with_context(|| format!("registering Slurm job {job} with the Agora daemon"))?;
            if registered.again {
                println!(
                    "agora: job {job} was registered already (its prolog ran again): its use so far is kept; now {} shares, and the quotas given apply to the sessions it opens from now on",
                    args.shares
                );
            } else {
                println!("agora: job {job} registered ({} shares)", args.shares);
            }
            if let Some(why) = registered.not_recorded {
                bail!(
                    "Slurm job {job} is registered, but the daemon {why}: a daemon restart would forget the job (its epilog would then find none); the daemon's STATE_DIR/jobs/running must be writable and have room"
                );
            }
            Ok(())
        }
        SlurmCommand::JobEnd(args) => {
            let job = args.job;
            let ended = agora::slurm_job_end(args.socket.path(), job)
                .with_context(|| format!("ending Slurm job {job} on the Agora daemon"))?;
            if args.json {
                println!("{}", serde_json::to_string_pretty(&ended.account)?);
            } else {
                println!("{}", job_summary(&ended.account));
            }
            if let Some(why) = ended.not_recorded {
                bail!(
                    "Slurm job {job} ended, but the daemon {why}: the accounting printed above is the job's only record, keep it; the daemon's STATE_DIR/jobs must be writable and have room"
                );
            }
            Ok(())
        }
        SlurmCommand::Suspend(args) => power(args, true),
        SlurmCommand::Resume(args) => power(args, false),
    }
}

/// One line for Slurm's AdminComment: what the job used through Agora on this node.
fn job_summary(a: &agora::JobAccount) -> String {
    let devices: Vec<String> = a
        .device_seconds
        .iter()
        .map(|(kind, s)| format!("{kind} {s:.3}s"))
        .collect();
    format!(
        "agora: {} sessions ({} ended by the daemon), {} tasks ({} failed), device time {}, {} to devices, {} back, {:.1} J (model)",
        a.sessions,
        a.sessions_ended_by_daemon,
        a.tasks_completed + a.tasks_failed,
        a.tasks_failed,
        if devices.is_empty() { "none".to_string() } else { devices.join(", ") },
        human_bytes(a.bytes_to_device),
        human_bytes(a.bytes_to_host),
        a.energy_model_joules
    )
}

/// Drains (`suspend`) every device of the node's daemon, or undrains (`resume`) those a suspend
/// drained.
fn power(args: SlurmPowerArgs, suspend: bool) -> Result<()> {
    let devices = agora::power_save(args.socket.path(), suspend).with_context(|| {
        format!(
            "{} the Agora daemon's devices",
            if suspend { "suspending" } else { "resuming" }
        )
    })?;
    for device in &devices {
        let state = match (suspend, device.changed, device.draining) {
            (true, true, _) => "drained",
            (true, false, _) => "was drained already",
            (false, true, _) => "usable again",
            (false, false, true) => {
                "stays drained (drained by hand, not by the suspend: `agora undrain` it when it should take work)"
            }
            (false, false, false) => "usable",
        };
        if suspend {
            println!(
                "{}: {state}, {} buffers ({}) written back to host memory",
                device.device,
                device.evacuated_buffers,
                human_bytes(device.evacuated_bytes)
            );
        } else {
            println!("{}: {state}", device.device);
        }
    }
    Ok(())
}

fn slurm_conf(args: SlurmConfArgs) -> Result<()> {
    let report = agora::daemon_status(args.socket.path())?;
    let node = match args.node {
        Some(node) => node,
        // Slurm's default NodeName is the short host name.
        None => std::fs::read_to_string("/proc/sys/kernel/hostname")
            .map(|h| h.trim().split('.').next().unwrap_or("").to_string())
            .unwrap_or_else(|_| "localhost".into()),
    };
    let lanes: usize = report.devices.iter().map(|d| d.lanes.len()).sum();
    let mut kinds: Vec<String> = report.devices.iter().map(|d| d.kind.to_string()).collect();
    kinds.sort();
    kinds.dedup();
    let devices: Vec<String> = report
        .devices
        .iter()
        .map(|d| format!("{} ({}, {} lanes)", d.name, d.kind, d.lanes.len()))
        .collect();
    let features: Vec<String> = std::iter::once("agora".to_string())
        .chain(kinds.iter().map(|k| format!("agora-{k}")))
        .collect();
    println!("# Agora on {node}: {}; {lanes} lanes in all.", devices.join(", "));
    println!("# A share is one lane's time: a job asking --gres=agora:K may keep about K lanes busy.");
    println!("# slurm.conf, once:");
    println!("GresTypes=agora");
    println!("# slurm.conf, on this node's NodeName line (with its other settings):");
    println!("NodeName={node} Features={} Gres=agora:{lanes}", features.join(","));
    println!("# gres.conf on this node (a count, no device files):");
    println!("NodeName={node} Name=agora Count={lanes}");
    Ok(())
}

/// `agora exports`.
#[derive(Args, Debug)]
pub struct ExportsArgs {
    #[command(flatten)]
    pub socket: SocketArg,
    /// Print JSON (a list of exports) instead of a table.
    #[arg(long)]
    pub json: bool,
}

/// Lists the exports the caller may see.
pub fn exports(args: ExportsArgs) -> Result<()> {
    let list = agora::daemon_exports(args.socket.path())?;
    if args.json {
        println!("{}", serde_json::to_string_pretty(&list)?);
        return Ok(());
    }
    if list.is_empty() {
        println!("no exports you may see (a session publishes one with session.export(buffer, name))");
        return Ok(());
    }
    // Columns as wide as their longest entry: export names run to 256 bytes.
    let name_width = list
        .iter()
        .map(|e| shown(&e.name).chars().count())
        .max()
        .unwrap_or(0)
        .max(24);
    let client_width = list
        .iter()
        .map(|e| shown(&e.client).chars().count())
        .max()
        .unwrap_or(0)
        .max(16);
    println!(
        "{:<name_width$} {:>8} {:<client_width$} {:>6} {:>10} {:<10} {:>8}  readers",
        "name", "session", "client", "uid", "size", "mode", "attached"
    );
    for e in &list {
        let readers = if e.readers.uids.is_empty() && e.readers.gids.is_empty() {
            "its uid".to_string()
        } else {
            format!("uids {:?} gids {:?}", e.readers.uids, e.readers.gids)
        };
        println!(
            "{:<name_width$} {:>8} {:<client_width$} {:>6} {:>10} {:<10} {:>8}  {}",
            shown(&e.name),
            format!("#{}", e.session),
            shown(&e.client),
            e.uid,
            human_bytes(e.len),
            if e.writable { "read-write" } else { "read-only" },
            e.attachers.len(),
            readers
        );
    }
    Ok(())
}

/// Asks the daemon to write its task trace now.
pub fn trace_save(socket: Option<PathBuf>) -> Result<()> {
    use agora_protocol::control::{Request, Response};
    let path = agora_transport::socket::client_socket_path(socket);
    let stream = std::os::unix::net::UnixStream::connect(&path).with_context(|| {
        format!(
            "cannot reach the daemon at {}; is `agora serve` running?",
            path.display()
        )
    })?;
    agora_transport::socket::send(&stream, &Request::SaveTrace)?;
    match agora_transport::socket::recv::<Response>(&stream)? {
        Response::TraceSaved { path, spans } => {
            // The daemon counts every span; say what they are, as `agora plot trace` draws only
            // executions and transfers.
            let kinds = std::fs::read(&path)
                .ok()
                .and_then(|bytes| serde_json::from_slice::<serde_json::Value>(&bytes).ok())
                .map(|json| crate::plot::span_kinds(&json))
                .filter(|kinds| !kinds.is_empty())
                .map(|kinds| {
                    let parts: Vec<String> = kinds.iter().map(|(kind, n)| format!("{n} {kind}")).collect();
                    format!(" ({})", parts.join(", "))
                })
                .unwrap_or_default();
            println!("wrote {spans} spans{kinds} to {path}");
            Ok(())
        }
        Response::Error(e) => bail!("{e}"),
        other => bail!("unexpected reply from the daemon: {other:?}"),
    }
}

/// `agora kernels` options.
#[derive(Args, Debug)]
pub struct KernelsArgs {
    /// What to do: list the kernels (no action); `reload` the kernel packages without
    /// restarting the daemon (admins only: the daemon's `[daemon] admin_uids` and members of
    /// `admin_gids`; by default root and the daemon's user); or `check DIR...`: load the
    /// packages in DIR as the daemon would and compile their OpenCL C on this node's OpenCL
    /// devices (and their CUDA C with NVRTC where installed), without a daemon. The daemon
    /// compiles a package's OpenCL C only at a kernel's first launch, so check a package before
    /// installing it.
    #[arg(value_name = "ACTION", value_parser = ["reload", "check"])]
    action: Option<String>,
    /// For `check`: package directories, or directories of packages.
    #[arg(value_name = "DIR")]
    dirs: Vec<PathBuf>,
    /// Print JSON instead of text.
    #[arg(long)]
    json: bool,
    #[command(flatten)]
    socket: crate::SocketArg,
}

pub fn kernels(args: KernelsArgs) -> Result<()> {
    if args.action.as_deref() == Some("check") {
        return check_packages(&args.dirs, args.json);
    }
    if !args.dirs.is_empty() {
        bail!("directories are for `agora kernels check DIR...`; `agora kernels` and `agora kernels reload` take none");
    }
    if args.action.as_deref() == Some("reload") {
        let report = agora::reload_kernels(args.socket.path()).context("could not reload the kernel packages")?;
        if args.json {
            println!("{}", serde_json::to_string_pretty(&report)?);
        } else {
            println!(
                "{} package(s) loaded, {} kernel(s) added or changed, {} package(s) removed; {} kernel(s) callable",
                report.packages.len(),
                report.changed.len(),
                report.removed.len(),
                report.kernels
            );
            for name in &report.changed {
                println!("  new or changed: {name}");
            }
            for name in &report.removed {
                println!("  removed: {name}");
            }
            for error in &report.errors {
                println!("  refused: {error}");
            }
        }
        if !report.errors.is_empty() {
            bail!(
                "{} package problem(s); the packages concerned keep their previous version",
                report.errors.len()
            );
        }
        return Ok(());
    }
    let (kernels, packages) = agora::kernel_catalog(args.socket.path())?;
    if args.json {
        println!(
            "{}",
            serde_json::to_string_pretty(&serde_json::json!({ "kernels": kernels, "packages": packages }))?
        );
        return Ok(());
    }
    for k in &kernels {
        let origin = k
            .package
            .as_deref()
            .map_or("built-in".to_string(), |p| format!("package {p}"));
        let chunkable = if k.chunkable { ", chunkable" } else { "" };
        println!(
            "{}\n    {}\n    [{origin}; {}{chunkable}]",
            k.signature,
            k.signature.doc,
            k.implementations.join(", ")
        );
    }
    if packages.is_empty() {
        println!("\nno kernel packages (agora serve --kernels DIR installs some; see docs/KERNELS.md)");
    } else {
        println!("\npackages:");
        for p in &packages {
            let version = p.version.as_deref().map(|v| format!(" {v}")).unwrap_or_default();
            println!("  {}{version}: {} kernel(s) from {}", p.name, p.kernels, p.dir);
        }
    }
    Ok(())
}

/// `agora kernels check DIR...`: loads each package as the daemon would (manifest, size rules,
/// shared object and symbols) and compiles its OpenCL C on every OpenCL device of this node and
/// its CUDA C with NVRTC (for compute_80) where NVRTC is installed. Fails when any package does
/// not load or any implementation does not compile.
fn check_packages(dirs: &[PathBuf], json: bool) -> Result<()> {
    if dirs.is_empty() {
        bail!("give the package directories to check: agora kernels check DIR... (a package directory, with package.toml, or a directory of packages)");
    }
    let mut report = Vec::new();
    let mut problems = 0usize;
    for dir in dirs {
        let packages = agora_packages::discover(dir).map_err(|e| anyhow::anyhow!("{}: {e}", dir.display()))?;
        if packages.is_empty() {
            bail!(
                "{}: no package here (a package directory has a package.toml)",
                dir.display()
            );
        }
        for package_dir in packages {
            let package = match agora_packages::load(&package_dir) {
                Ok(package) => package,
                Err(e) => {
                    problems += 1;
                    report
                        .push(serde_json::json!({ "dir": package_dir.display().to_string(), "error": e.to_string() }));
                    if !json {
                        println!("{}: does not load: {e}", package_dir.display());
                    }
                    continue;
                }
            };
            if !json {
                let version = package.version.as_deref().map(|v| format!(" {v}")).unwrap_or_default();
                println!(
                    "package {}{version} ({}): loads, {} kernel(s)",
                    package.name,
                    package_dir.display(),
                    package.kernels.len()
                );
            }
            let mut kernels = Vec::new();
            for kernel in &package.kernels {
                let name = kernel.def.name.to_string();
                let mut checks = Vec::new();
                if kernel.def.cpu.is_some() {
                    checks.push(("cpu".to_string(), Ok("its symbol is bound".to_string())));
                }
                if let Some(imp) = &kernel.def.opencl {
                    match agora_devices::opencl::check_build(imp) {
                        Ok(devices) if devices.is_empty() => checks.push((
                            "opencl".to_string(),
                            Ok("not compiled: no OpenCL device on this node".to_string()),
                        )),
                        Ok(devices) => {
                            for (device, outcome) in devices {
                                use agora_devices::opencl::BuildProblem;
                                let outcome = match outcome {
                                    Ok(()) => Ok("compiles".to_string()),
                                    Err(BuildProblem::DoesNotCompile(log)) => Err(("DOES NOT COMPILE", log)),
                                    Err(BuildProblem::CannotRun(why)) => Err(("CANNOT RUN", why)),
                                };
                                checks.push((format!("opencl on {device}"), outcome));
                            }
                        }
                        Err(why) => checks.push(("opencl".to_string(), Ok(format!("not compiled: {why}")))),
                    }
                }
                if let Some(imp) = &kernel.def.cuda {
                    let outcome = match &imp.code {
                        agora_kernels::CudaCode::Source(source) if agora_devices::cuda::programs::nvrtc_available() => {
                            agora_devices::cuda::programs::compile_ptx(&imp.program, source, 80)
                                .map(|_| "compiles (NVRTC, compute_80)".to_string())
                                .map_err(|e| ("DOES NOT COMPILE", e.log))
                        }
                        agora_kernels::CudaCode::Source(_) => Ok(
                            "not compiled: NVRTC is not installed here (set AGORA_NVRTC to libnvrtc.so)".to_string(),
                        ),
                        agora_kernels::CudaCode::Ptx(_) => {
                            Ok("PTX: assembled by the driver on a GPU, not here".to_string())
                        }
                    };
                    checks.push(("cuda".to_string(), outcome));
                }
                for (what, outcome) in &checks {
                    match outcome {
                        Ok(said) if !json => println!("  {name}: {what}: {said}"),
                        Err((problem, log)) => {
                            problems += 1;
                            if !json {
                                println!("  {name}: {what}: {problem}:\n{}", indent(log.trim_end(), "      "));
                            }
                        }
                        Ok(_) => {}
                    }
                }
                kernels.push(serde_json::json!({
                    "name": name,
                    "checks": checks.iter().map(|(what, outcome)| match outcome {
                        Ok(said) => serde_json::json!({ "what": what, "ok": true, "said": said }),
                        Err((problem, log)) => {
                            serde_json::json!({ "what": what, "ok": false, "problem": problem, "log": log })
                        }
                    }).collect::<Vec<_>>(),
                }));
            }
            report.push(serde_json::json!({
                "dir": package_dir.display().to_string(),
                "package": package.name,
                "version": package.version,
                "kernels": kernels,
            }));
        }
    }
    if json {
        println!(
            "{}",
            serde_json::to_string_pretty(&serde_json::json!({ "packages": report, "problems": problems }))?
        );
    }
    if problems > 0 {
        bail!("{problems} problem(s) found: fix them before installing these packages (the daemon would refuse a package that does not load, and fail the first launch of a kernel that does not compile)");
    }
    Ok(())
}

/// `text` with `prefix` before each line.
fn indent(text: &str, prefix: &str) -> String {
    text.lines()
        .map(|line| format!("{prefix}{line}"))
        .collect::<Vec<_>>()
        .join("\n")
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
    /// Problem size (program-specific; see --list). Checked against the session's heap quota
    /// before anything is allocated.
    #[arg(long)]
    size: Option<u64>,
    /// Iterations, for iterative programs (e.g. saxpy launches).
    #[arg(long)]
    iterations: Option<usize>,
    /// Print the report as JSON.
    #[arg(long)]
    json: bool,
    /// Which kind of device must run the workload's tasks: an error if no device of that kind
    /// can (none, or all drained), unless --fallback.
    #[arg(long, value_enum, default_value_t = DeviceChoice::Any)]
    device_kind: DeviceChoice,
    /// With --device-kind: run wherever the daemon can when that kind cannot take the work (the
    /// report says where it ran).
    #[arg(long)]
    fallback: bool,
    /// Check the workload's coherence: run it on a private daemon started for this run with
    /// strict coherence (every device, the CPU included, computes on its own copy of each
    /// buffer), so a missing sync_to/sync_from fails verification wherever the tasks run; also
    /// reports buffers released with results never read back. Ignores --socket.
    #[arg(long)]
    check: bool,
    #[command(flatten)]
    socket: SocketArg,
}

/// A device-kind preference on the command line.
#[derive(ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub enum DeviceChoice {
    /// The CPU device.
    Cpu,
    /// An OpenCL device.
    Opencl,
    /// An NVIDIA GPU.
    Cuda,
    /// Whatever the daemon picks.
    Any,
}

impl DeviceChoice {
    pub(crate) fn kind(self) -> Option<agora::DeviceKind> {
        match self {
            DeviceChoice::Cpu => Some(agora::DeviceKind::Cpu),
            DeviceChoice::Opencl => Some(agora::DeviceKind::OpenCl),
            DeviceChoice::Cuda => Some(agora::DeviceKind::Cuda),
            DeviceChoice::Any => None,
        }
    }
}

/// Bytes as a short human figure (binary units).
fn human_bytes(bytes: u64) -> String {
    const UNITS: [&str; 6] = ["B", "KiB", "MiB", "GiB", "TiB", "PiB"];
    let mut value = bytes as f64;
    let mut unit = 0;
    while value >= 1024.0 && unit + 1 < UNITS.len() {
        value /= 1024.0;
        unit += 1;
    }
    if unit == 0 {
        format!("{bytes} B")
    } else {
        format!("{value:.1} {}", UNITS[unit])
    }
}

/// Why no device of `kind` can take work now, if none can: there is none, or every one is
/// drained or failed.
fn kind_unavailable(status: &agora::StatusReport, kind: &str) -> Option<String> {
    let of_kind: Vec<_> = status.devices.iter().filter(|d| d.kind == kind).collect();
    if of_kind.iter().any(|d| !d.draining && !d.failed) {
        return None;
    }
    let all: Vec<String> = status
        .devices
        .iter()
        .map(|d| format!("{} ({})", d.name, d.kind))
        .collect();
    Some(if of_kind.is_empty() {
        format!("the daemon has no {kind} device (it has {})", all.join(", "))
    } else {
        let names: Vec<String> = of_kind
            .iter()
            .map(|d| {
                format!(
                    "{} is {}",
                    d.name,
                    if d.failed {
                        "failed"
                    } else {
                        "draining (`agora undrain` it)"
                    }
                )
            })
            .collect();
        names.join(", ")
    })
}

/// Devices named in `devices` whose kind is not `kind`.
fn foreign_devices(status: &agora::StatusReport, devices: &[String], kind: &str) -> Vec<String> {
    devices
        .iter()
        .filter(|name| status.devices.iter().any(|d| &&d.name == name && d.kind != kind))
        .cloned()
        .collect()
}

pub fn run(args: RunArgs) -> Result<()> {
    if args.list {
        let width = agora_apps::PROGRAMS.iter().map(|(n, _)| n.len()).max().unwrap_or(0);
        for (name, size) in agora_apps::PROGRAMS {
            println!(
                "{name:<width$}  --size = {size} (default {})",
                agora_apps::default_size(name)
            );
        }
        return Ok(());
    }
    let app = args.app.clone().unwrap_or_default();
    let size = args.size.unwrap_or_else(|| agora_apps::default_size(&app));
    // Checked arithmetic on the sizes before anything is allocated here or in the daemon.
    let bytes = agora_apps::footprint(&app, size, args.iterations).map_err(anyhow::Error::msg)?;
    // --check: a private daemon in strict coherence mode, stopped when the run ends.
    let private = args.check.then(strict_daemon).transpose()?;
    let session = Session::connect_with(SessionOptions {
        socket: private
            .as_ref()
            .map(|(_, socket, _)| socket.clone())
            .or(args.socket.path()),
        name: Some(format!("agora run {app}")),
        heap_bytes: None,
        control_timeout: None,
        reconnect_timeout: None,
    })?;
    let status = session.status()?;
    let quota = status
        .sessions
        .iter()
        .find(|s| s.id == session.id())
        .map_or(u64::MAX, |s| s.heap_quota);
    if bytes > quota {
        bail!(
            "{app} --size {size} needs {} of buffers, more than this session's heap quota of {} \
             (the daemon's --session-quota, or in a Slurm job its prolog's AGORA_HEAP_QUOTA); use a smaller --size",
            human_bytes(bytes),
            human_bytes(quota)
        );
    }
    let kind = args.device_kind.kind();
    if let Some(kind) = kind {
        if let Some(why) = kind_unavailable(&status, kind.name()) {
            if !args.fallback {
                bail!(
                    "--device-kind {}: {why}; pass --fallback to run on another device",
                    kind.name()
                );
            }
            eprintln!(
                "note: --device-kind {}: {why}; running elsewhere (--fallback)",
                kind.name()
            );
        }
    }

    // Building the inputs and the host reference can take long (gaussian's is O(n³)).
    let preparing = crate::progress::spinner(&format!("{app} {size}: building inputs and the host reference"));
    let shown = show_after_a_moment(&preparing);
    let workload = agora_apps::build(&app, size, args.iterations)
        .ok_or_else(|| anyhow::anyhow!(agora_apps::unknown_program(&app)))?;
    shown.store(true, std::sync::atomic::Ordering::Relaxed);
    preparing.finish_and_clear();

    let monitor = Monitor::start(&session, workload.name, workload.steps.len() as u64, &app);
    let outcome = agora_apps::run_on_agora(&session, &workload, kind);
    let seen = monitor.stop();
    let mut report = outcome?;
    for device in seen {
        if !report.devices.contains(&device) {
            report.devices.insert(0, device);
        }
    }
    let ran_on = if report.devices.is_empty() {
        "the daemon's dispatcher (tiny tasks run inline there, on the CPU)".to_string()
    } else {
        report.devices.join(", ")
    };
    if args.json {
        println!("{}", serde_json::to_string(&report)?);
    } else {
        println!(
            "{} size {}: {} tasks on {} in {:.3}s, max error {:.2e}, {}",
            report.app,
            report.size,
            report.tasks,
            ran_on,
            report.seconds,
            report.max_error,
            if report.verified {
                "verified OK"
            } else {
                "VERIFICATION FAILED"
            }
        );
    }
    if args.check {
        let status = session.status()?;
        let unread = status
            .sessions
            .iter()
            .find(|s| s.id == session.id())
            .map_or(0, |s| s.unread_releases);
        println!(
            "strict coherence check: {}; {unread} buffer(s) released with results never read back (sync_from)",
            if report.verified {
                "results match the host reference"
            } else {
                "results DIFFER from the host reference: a sync_to or sync_from is missing (or the kernels are wrong)"
            }
        );
    }
    if !report.verified {
        bail!("{} result does not match the host reference", report.app);
    }
    if let (Some(kind), false) = (kind, args.fallback) {
        let status = session.status()?;
        let foreign = foreign_devices(&status, &report.devices, kind.name());
        if !foreign.is_empty() {
            bail!(
                "--device-kind {}: tasks ran on {} (the device became unavailable, or lacks a kernel); pass --fallback to accept that",
                kind.name(),
                foreign.join(", ")
            );
        }
    }
    Ok(())
}

/// A daemon in this process with strict coherence on a private socket (`agora run --check`),
/// with the rest of its settings at their defaults; stopped when the handle is dropped, its
/// directory removed after it (the tuple's fields drop in order).
fn strict_daemon() -> Result<(agora_daemon::DaemonHandle, PathBuf, crate::bench::harness::ScratchDir)> {
    let scratch = crate::bench::harness::ScratchDir::new("check")
        .context("cannot create the private daemon's directory under $TMPDIR")?;
    let dir = scratch.path();
    let socket = dir.join("agora.sock");
    let config = DaemonConfig {
        socket: socket.clone(),
        state_dir: Some(dir.join("state")),
        strict_coherence: true,
        ..Default::default()
    };
    let handle = agora_daemon::spawn(config).context("starting a private daemon for --check")?;
    Ok((handle, socket, scratch))
}

/// Shows `bar` if it is still running after a second; the flag returned stops that.
fn show_after_a_moment(bar: &indicatif::ProgressBar) -> std::sync::Arc<std::sync::atomic::AtomicBool> {
    let done = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let (bar, flag) = (bar.clone(), done.clone());
    std::thread::spawn(move || {
        std::thread::sleep(Duration::from_secs(1));
        if !flag.load(std::sync::atomic::Ordering::Relaxed) {
            crate::progress::show(&bar);
        }
    });
    done
}

/// Watches a run from a second thread: a progress bar of the session's completed tasks (shown
/// after a second), and the devices the daemon binds the workload's queue to.
struct Monitor {
    stop: std::sync::Arc<std::sync::atomic::AtomicBool>,
    thread: Option<std::thread::JoinHandle<Vec<String>>>,
}

impl Monitor {
    fn start(session: &Session, queue: &'static str, total: u64, app: &str) -> Monitor {
        let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let (session, flag) = (session.clone(), stop.clone());
        let bar = crate::progress::bar(total, app);
        let thread = std::thread::spawn(move || {
            let own = || session.session_status(session.id()).ok();
            let base = own().map_or(0, |s| s.tasks_completed + s.tasks_failed);
            let started = Instant::now();
            let mut devices: Vec<String> = Vec::new();
            let mut shown = false;
            while !flag.load(std::sync::atomic::Ordering::Relaxed) {
                std::thread::sleep(Duration::from_millis(100));
                let Some(me) = own() else {
                    continue;
                };
                bar.set_position((me.tasks_completed + me.tasks_failed).saturating_sub(base).min(total));
                for q in me.queues.iter().filter(|q| q.name == queue) {
                    if let Some(bound) = &q.bound_to {
                        let device = bound.split('/').next().unwrap_or(bound).to_string();
                        if !devices.contains(&device) {
                            devices.push(device);
                        }
                    }
                }
                if !shown && started.elapsed() >= Duration::from_secs(1) {
                    crate::progress::show(&bar);
                    shown = true;
                }
            }
            bar.finish_and_clear();
            devices
        });
        Monitor {
            stop,
            thread: Some(thread),
        }
    }

    fn stop(mut self) -> Vec<String> {
        self.stop.store(true, std::sync::atomic::Ordering::Relaxed);
        self.thread.take().and_then(|t| t.join().ok()).unwrap_or_default()
    }
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
    // Removed when the demo ends, however it ends (declared first, dropped after the daemon).
    let scratch = crate::bench::harness::ScratchDir::new("demo")?;
    let dir = scratch.path().to_path_buf();
    let socket = dir.join("agora.sock");
    let config = DaemonConfig {
        socket: socket.clone(),
        // A throwaway daemon: its model goes with its directory.
        state_dir: Some(dir.join("state")),
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

    println!(
        "\n{:<12} {:>8} {:>10} {:>9} {:>10}  {:<16} result",
        "client", "pid", "size", "tasks", "time (s)", "ran on"
    );
    let mut all_ok = true;
    let mut tasks = 0;
    let mut releases = 0;
    for (label, pid, report) in &reports {
        match report {
            Some(r) => {
                tasks += r.tasks;
                // Its buffers and its one queue.
                releases += r.buffers + 1;
                all_ok &= r.verified;
                println!(
                    "{:<12} {:>8} {:>10} {:>9} {:>10.3}  {:<16} {}",
                    label,
                    pid,
                    r.size,
                    r.tasks,
                    r.seconds,
                    if r.devices.is_empty() {
                        "dispatcher".to_string()
                    } else {
                        r.devices.join(",")
                    },
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
                    "{label:<12} {pid:>8} {:>10} {:>9} {:>10}  {:<16} client failed (see its error above)",
                    "-", "-", "-", "-"
                );
            }
        }
    }
    println!(
        "\n{} tasks (transfers and launches) from {} clients in {:.2}s wall",
        tasks,
        reports.len(),
        wall.as_secs_f64()
    );
    println!(
        "{}",
        demo_count_line(tasks, releases, status.tasks_completed, status.tasks_failed)
    );
    if !all_ok {
        bail!("at least one client failed or did not verify");
    }
    println!("all results verified against host references");
    Ok(())
}

/// The daemon's task count beside the clients': the daemon also counts the releases of the
/// clients' buffers and queues (each is freed by a task on the same ring, ordered after the tasks
/// that use it, when the client ends), at most `releases` of them.
fn demo_count_line(tasks: u64, releases: u64, completed: u64, failed: u64) -> String {
    let counted = completed + failed;
    let mut line = format!("the daemon counted {completed} completed and {failed} failed: ");
    match counted.checked_sub(tasks) {
        Some(extra) if extra <= releases => line.push_str(&format!(
            "the clients' {tasks} tasks plus {extra} releases of their {releases} buffers and queues \
             (freed by tasks on the same ring as each client ends)"
        )),
        _ => line.push_str(&format!(
            "not the clients' {tasks} tasks plus at most {releases} releases of their buffers and queues; \
             the difference is unexplained"
        )),
    }
    line
}

#[cfg(test)]
mod tests {
    use clap::CommandFactory;

    use super::*;

    #[derive(clap::Parser)]
    struct Serve {
        #[command(flatten)]
        args: ServeArgs,
    }

    /// `serve --help` states the default of every setting, as the daemon's configuration has it.
    #[test]
    fn serve_help_states_the_defaults() {
        let help = Serve::command().render_long_help().to_string();
        let c = DaemonConfig::default();
        for default in [
            format!("[default: {}]", c.policy.name()),
            format!("[default: {}G]", c.session_quota >> 30),
            format!("[default: {}]", c.ring_capacity),
            format!("[default: {}]", c.inline_max_ns),
            format!("[default: {}]", c.max_spin.as_micros()),
            format!("[default: {}]", c.opencl_lanes),
            format!("[default: {}]", c.cuda_lanes),
            format!("[default: {}]", c.cpu_threads_per_lane),
            format!("[default: {}]", c.preempt_target.as_micros()),
            format!("[default: {}]", c.session_lane_work.as_millis()),
            format!("[default: {}]", c.latency_sla.as_millis()),
            format!("[default: {}]", c.trace_capacity),
            format!("[default: {}]", c.program_timeout.as_millis()),
            format!("[default: {}]", c.batch_priority),
            format!("[default: {}, unchanged]", c.dispatcher_nice),
            format!("[default: {}]", c.limits.connections_per_uid),
            format!("[default: {}]", c.limits.sessions_per_uid),
            format!("[default: {}]", c.limits.queues_per_uid),
            format!("[default: {}]", c.limits.buffers_per_uid),
            format!("[default: {}]", c.limits.control_requests_per_uid),
            format!("[default: {}]", c.limits.control_rate),
            format!("[default: {}]", c.limits.control_burst),
            format!("[default: {}]", c.limits.hello_timeout.as_millis()),
        ] {
            assert!(help.contains(&default), "serve --help lacks {default}:\n{help}");
        }
        // Every option says its default (flags that switch something on need none).
        for arg in Serve::command().get_arguments() {
            let id = arg.get_id().as_str();
            if matches!(
                id,
                "print_config"
                    | "no_opencl"
                    | "opencl_device_host"
                    | "no_opencl_device_host"
                    | "cuda_device_host"
                    | "no_cuda_device_host"
                    | "no_cuda"
                    | "config"
                    | "help"
                    | "version"
            ) {
                continue;
            }
            let text = arg
                .get_long_help()
                .or(arg.get_help())
                .map(|h| h.to_string())
                .unwrap_or_default();
            assert!(text.contains("[default:"), "--{id} does not state its default: {text}");
        }
    }

    #[test]
    fn the_demo_explains_the_daemons_count() {
        let line = demo_count_line(1948, 14, 1958, 0);
        assert!(line.contains("1948 tasks plus 10 releases of their 14"), "{line}");
        assert!(!line.contains("unexplained"), "{line}");
        assert!(demo_count_line(1948, 14, 1963, 0).contains("unexplained"));
        assert!(demo_count_line(1948, 14, 1940, 0).contains("unexplained"));
    }

    #[test]
    fn bytes_read_as_people_write_them() {
        assert_eq!(human_bytes(512), "512 B");
        assert_eq!(human_bytes(2 << 30), "2.0 GiB");
        assert_eq!(human_bytes(3_200_000_000), "3.0 GiB");
    }
}
