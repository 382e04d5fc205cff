//! Daemon settings, each with a default that suits a shared node, and their TOML file format.
//!
//! [`DaemonConfig`] is what the daemon runs with. A configuration file (`agora serve --config
//! FILE`) sets any subset of it in sections (`[daemon]`, `[sessions]`, `[scheduler]`, `[cpu]`,
//! `[opencl]`, `[cuda]`, `[[sim]]`, `[telemetry]`, `[kernels]`, `[programs]`, `[limits]`,
//! `[checkpoint]`); what the file does not set
//! keeps its default, and
//! command-line flags override both. [`DaemonConfig::to_toml`] writes every effective setting in
//! the same format (`agora serve --print-config`), so its output is a valid configuration file.
//!
//! Each setting is written once: its field in [`DaemonConfig`] carries its doc and its default
//! (`#[default(...)]`, smart-default's derive), and one line of its file section says its key, how
//! the file writes the value and which field it sets (`section!` below); reading, printing and the
//! refusal of unknown keys (with the line and column) all follow from that line. A new setting is
//! its field plus that one line.
//!
//! Must not start anything: this module only describes.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::Duration;

use serde::{Deserialize, Serialize};
use smart_default::SmartDefault;

use crate::policy::latency::LatencyPolicy;

/// The daemon's own executable image, whatever became of the file it was started from
/// (`/proc/self/exe`: in the child about to `exec`, still the daemon's image). `agora serve`
/// runs its executors and device hosts from it, so an `agora` installed over the running one
/// is used only once the daemon restarts, never mixed with it.
pub const OWN_BINARY: &str = "/proc/self/exe";
pub use agora_devices::priority::BatchPriority;

/// Power draw of a device, for the `energy` policy and for energy reports.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PowerModel {
    /// Watts the device draws with no lane busy.
    pub idle_watts: f64,
    /// Watts the device draws with every lane busy (linear in between).
    pub active_watts: f64,
}

impl PowerModel {
    /// Extra watts one busy lane of `lanes` adds over idle.
    pub fn lane_watts(&self, lanes: usize) -> f64 {
        (self.active_watts - self.idle_watts).max(0.0) / lanes.max(1) as f64
    }
}

/// A `[[sim]]` device of the configuration.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SimDeviceConfig {
    /// Name (unique), e.g. `sim0`.
    pub name: String,
    /// Lanes.
    #[serde(default = "default_sim_lanes")]
    pub lanes: usize,
    /// Device memory, e.g. `"4G"` or a number of bytes.
    #[serde(default = "default_sim_memory", with = "bytes")]
    pub memory: u64,
    /// Speed relative to one CPU core for kernels without a profile entry.
    #[serde(default = "one")]
    pub speed: f64,
    /// Fixed cost of a launch without a profile entry, nanoseconds.
    #[serde(default = "default_launch_ns")]
    pub launch_ns: f64,
    /// Host link bandwidth in bytes per second, e.g. `"12G"`.
    #[serde(default = "default_bandwidth", with = "bytes")]
    pub bandwidth: u64,
    /// Kernels it implements (absent: every kernel).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kernels: Option<Vec<String>>,
    /// Per-kernel time profiles: `[sim.profile.sgemm] launch_ns = 20000, ns_per_item = 4.0`.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub profile: BTreeMap<String, SimKernelProfile>,
    /// Watts idle.
    #[serde(default = "default_sim_idle")]
    pub idle_watts: f64,
    /// Watts with every lane busy.
    #[serde(default = "default_sim_active")]
    pub active_watts: f64,
    /// Fault injection (tests, `agora bench migrate`): the device fails for good after running
    /// this many jobs; the daemon then drains it and moves its queues elsewhere.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub fail_after_jobs: Option<u64>,
    /// Fault injection (tests): the memory the device's runtime really gives, below `memory`
    /// (the daemon's books), e.g. `"6M"`: allocations past it are refused, as a driver that
    /// reports more free memory than it has; the daemon evicts idle buffers and retries.
    #[serde(default, skip_serializing_if = "Option::is_none", with = "opt_bytes")]
    pub runtime_memory: Option<u64>,
    /// Fault injection (tests): each allocation on the device, and each read of a buffer into
    /// host memory (a job's copy home, an eviction's write-back), is answered this many
    /// milliseconds late, as by a device
    /// host busy with other tenants' work. In the daemon the dispatcher waits for it; in a
    /// device host (`device_host`) only the tasks that need the answer.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub answer_delay_ms: Option<u64>,
    /// Tests of the device-host mechanism: the device runs in a device-host process, as a GPU
    /// does, so `fail_after_jobs` models a kernel fault that ends a GPU's context (the host
    /// exits, the daemon replays and starts a new one). There only `lanes`, `memory`,
    /// `fail_after_jobs` and `answer_delay_ms` apply, and only the library's kernels run on it.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub device_host: bool,
}

/// One kernel's modeled time on a sim device.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SimKernelProfile {
    /// Fixed cost per launch, nanoseconds.
    #[serde(default)]
    pub launch_ns: f64,
    /// Cost per work item, nanoseconds.
    pub ns_per_item: f64,
}

fn default_sim_lanes() -> usize {
    2
}
fn default_sim_memory() -> u64 {
    1 << 30
}
fn one() -> f64 {
    1.0
}
fn default_launch_ns() -> f64 {
    5_000.0
}
fn default_bandwidth() -> u64 {
    10_000_000_000
}
fn default_sim_idle() -> f64 {
    10.0
}
fn default_sim_active() -> f64 {
    60.0
}

impl SimDeviceConfig {
    /// A sim device with every default and this name.
    pub fn named(name: &str) -> Self {
        SimDeviceConfig {
            name: name.to_string(),
            lanes: default_sim_lanes(),
            memory: default_sim_memory(),
            speed: 1.0,
            launch_ns: default_launch_ns(),
            bandwidth: default_bandwidth(),
            kernels: None,
            profile: BTreeMap::new(),
            idle_watts: default_sim_idle(),
            active_watts: default_sim_active(),
            fail_after_jobs: None,
            runtime_memory: None,
            answer_delay_ms: None,
            device_host: false,
        }
    }

    /// Its power model.
    pub fn power(&self) -> PowerModel {
        PowerModel {
            idle_watts: self.idle_watts,
            active_watts: self.active_watts,
        }
    }
}

/// Which placement policy, and its parameters.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "lowercase")]
pub enum PolicyKind {
    /// Round-robin over the lanes that implement the kernel (Arax's default).
    Rr,
    /// Least expected completion time from the learned performance model (StarPU's dmda); the
    /// default.
    #[default]
    Perf,
    /// Least predicted energy among devices that finish within the slack.
    Energy,
}

impl PolicyKind {
    /// The name used in files, flags and `agora status`.
    pub fn name(self) -> &'static str {
        match self {
            PolicyKind::Rr => "rr",
            PolicyKind::Perf => "perf",
            PolicyKind::Energy => "energy",
        }
    }

    /// Parses a name.
    pub fn parse(text: &str) -> Result<Self, String> {
        match text {
            "rr" => Ok(PolicyKind::Rr),
            "perf" => Ok(PolicyKind::Perf),
            "energy" => Ok(PolicyKind::Energy),
            _ => Err(format!("unknown policy '{text}': choose rr, perf or energy")),
        }
    }
}

/// Who may connect to the daemon's control socket. Whoever connects is a tenant, confined to its
/// own sessions and held to the per-uid limits (`[limits]`); this decides who may be one.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(try_from = "String", into = "String")]
pub enum SocketAccess {
    /// The daemon's own user (and root): socket mode 0600. A personal daemon.
    User,
    /// Members of a group (a name, or a number): mode 0660, the socket owned by that group.
    Group(String),
    /// Every local user: mode 0666. A node-wide daemon, run by root or a service user.
    All,
}

impl SocketAccess {
    /// Parses `user`, `group:NAME` (or `group:GID`) or `all`.
    pub fn parse(text: &str) -> Result<SocketAccess, String> {
        match text {
            "user" => Ok(SocketAccess::User),
            "all" => Ok(SocketAccess::All),
            _ => match text.strip_prefix("group:") {
                Some(group) if !group.is_empty() && !group.contains(char::is_whitespace) => {
                    Ok(SocketAccess::Group(group.to_string()))
                }
                _ => Err(format!(
                    "unknown socket access '{text}': choose user (the daemon's user only), \
                     group:NAME (members of group NAME) or all (every local user)"
                )),
            },
        }
    }

    /// The socket file's permission bits.
    pub fn socket_mode(&self) -> u32 {
        match self {
            SocketAccess::User => 0o600,
            SocketAccess::Group(_) => 0o660,
            SocketAccess::All => 0o666,
        }
    }
}

impl std::fmt::Display for SocketAccess {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            SocketAccess::User => f.write_str("user"),
            SocketAccess::Group(group) => write!(f, "group:{group}"),
            SocketAccess::All => f.write_str("all"),
        }
    }
}

impl TryFrom<String> for SocketAccess {
    type Error = String;
    fn try_from(text: String) -> Result<SocketAccess, String> {
        SocketAccess::parse(&text)
    }
}

impl From<SocketAccess> for String {
    fn from(access: SocketAccess) -> String {
        access.to_string()
    }
}

/// Settings of one daemon. Each field carries its doc and its default (`#[default(...)]`).
#[derive(Debug, Clone, SmartDefault)]
pub struct DaemonConfig {
    /// Control socket path.
    #[default(agora_transport::socket::socket_path(None))]
    pub socket: PathBuf,
    /// Who may connect to the control socket (`[daemon] socket_access`, `agora serve
    /// --socket-access`): the daemon's own user (the default), a group's members, or every local
    /// user (a node-wide daemon).
    #[default(SocketAccess::User)]
    pub socket_access: SocketAccess,
    /// Whether a user who is no admin sees only its own sessions, uids, Slurm jobs and DAGs in
    /// `agora status` / `agora top` and may not ask for another user's session (`[daemon]
    /// private_status`, `agora serve --private-status`; Slurm's `PrivateData`). Off by default:
    /// like `ps`, `squeue` and `nvidia-smi`, every tenant sees what runs on the node.
    #[default(false)]
    pub private_status: bool,
    /// CPU lanes.
    #[default(agora_devices::cpu::CpuDevice::default_partition().0)]
    pub cpu_lanes: usize,
    /// Threads per CPU lane.
    #[default(agora_devices::cpu::CpuDevice::default_partition().1)]
    pub cpu_threads_per_lane: usize,
    /// Power model of the CPU device (used where RAPL counters cannot be read).
    #[default(default_cpu_power())]
    pub cpu_power: PowerModel,
    /// Largest heap a session may have, in bytes (its buffer quota).
    #[default(2 << 30)]
    pub session_quota: u64,
    /// Most device memory one session's buffers may hold on one device (0: no limit but the
    /// device's own). Beyond it the session's idle buffers are evicted to make room.
    #[default(0)]
    pub device_quota: u64,
    /// Submission and completion ring capacity per session (entries, a power of two).
    #[default(1024)]
    pub ring_capacity: u32,
    /// Most queues per session.
    #[default(4096)]
    pub max_queues: usize,
    /// Most buffers per session.
    #[default(1 << 16)]
    pub max_buffers: usize,
    /// Back-pressure: once a session's batch-class jobs on lanes are predicted to run this long
    /// (all lanes together), no more of its batch-class tasks are taken from its ring until lanes
    /// finish some: the ring fills and the client waits for room.
    #[default(Duration::from_secs(2))]
    pub session_lane_work: Duration,
    /// Tasks estimated below this many nanoseconds run inline on the dispatcher thread when their
    /// queue has nothing in flight, skipping the hand-off to a lane. 0 disables inline runs.
    #[default(5_000)]
    pub inline_max_ns: u64,
    /// Address to serve Prometheus metrics on (`/metrics`), if any.
    #[default(None)]
    pub metrics: Option<std::net::SocketAddr>,
    /// File to write the task trace to (Chrome/Perfetto JSON), if tracing.
    #[default(None)]
    pub trace: Option<PathBuf>,
    /// Most spans the trace keeps (oldest dropped first).
    #[default(500_000)]
    pub trace_capacity: usize,
    /// Whether to look for OpenCL devices.
    #[default(true)]
    pub opencl: bool,
    /// Lanes (command queues) per OpenCL device.
    #[default(2)]
    pub opencl_lanes: usize,
    /// Most memory Agora uses on each OpenCL device (0: all it reports).
    #[default(0)]
    pub opencl_memory_limit: u64,
    /// Power model of each OpenCL device.
    #[default(default_cpu_power())]
    pub opencl_power: PowerModel,
    /// Whether each OpenCL platform runs in a device-host process of its own (the
    /// `[programs] executor` binary's `device-host` subcommand), so a driver crash or hang ends
    /// that process, not the daemon: its devices' tasks are replayed elsewhere and a new host
    /// starts. On by default: the hop costs an empty kernel about 20–45 µs more than in the
    /// daemon on a 2-core VM, and programs nothing measurable (docs/PERFORMANCE.md). Off (or
    /// without an executor binary, as in a daemon embedded in a test), OpenCL runs in the
    /// daemon's process, and a driver that asserts or segfaults ends the daemon.
    #[default(true)]
    pub opencl_device_host: bool,
    /// An OpenCL device host (or a `sim` in a host) with jobs waiting that finishes none for
    /// this long is taken as hung, killed and restarted (its tasks replayed elsewhere).
    #[default(Duration::from_secs(60))]
    pub opencl_hang_timeout: Duration,
    /// Whether to look for NVIDIA GPUs (through the CUDA driver, if installed).
    #[default(true)]
    pub cuda: bool,
    /// Whether each GPU runs in a device-host process of its own (the `[programs] executor`
    /// binary's `device-host` subcommand), so a kernel fault, which leaves a CUDA context
    /// unusable for every tenant in it, ends that process: the faulting task fails with
    /// `KernelFault`, the GPU's other tasks are replayed from their host copies, and a new host
    /// brings the GPU back with a fresh context. On by default; each task pays the socket hop
    /// (docs/GPU.md). Off (or without an executor binary), GPUs run in the daemon, and a GPU
    /// whose context faulted stays failed until the daemon restarts.
    #[default(true)]
    pub cuda_device_host: bool,
    /// A GPU's device host with jobs waiting that finishes none for this long is taken as hung,
    /// killed and restarted with a fresh context (its tasks replayed). A trusted package kernel
    /// that runs longer in one launch needs a larger value; tenants' own kernels stop at
    /// `[programs] timeout_ms` long before.
    #[default(Duration::from_secs(60))]
    pub cuda_hang_timeout: Duration,
    /// Lanes (streams) per GPU.
    #[default(4)]
    pub cuda_lanes: usize,
    /// Most memory Agora uses on each GPU (0: all it reports).
    #[default(0)]
    pub cuda_memory_limit: u64,
    /// Power model of each GPU.
    #[default(PowerModel { idle_watts: 70.0, active_watts: 400.0 })]
    pub cuda_power: PowerModel,
    /// Most host memory one user's sessions may have registered (page-locked) with GPUs, in
    /// bytes; a session beyond it copies through the driver's staging buffer instead (0: half
    /// the host's memory).
    #[default(0)]
    pub cuda_pinned_limit_per_user: u64,
    /// Modeled devices.
    #[default(Vec::new())]
    pub sims: Vec<SimDeviceConfig>,
    /// Longest the dispatcher polls the rings after its last work before it blocks.
    #[default(Duration::from_micros(200))]
    pub max_spin: Duration,
    /// On SIGTERM/SIGINT, how long work already on lanes may run before the daemon gives up on
    /// it and exits (its clients see `Disconnected`). A second signal exits at once.
    #[default(Duration::from_secs(5))]
    pub shutdown_timeout: Duration,
    /// Placement policy. `perf` by default: under `rr`, a pipelined stream of tiny kernels landed
    /// on the OpenCL device behind its device host and stayed there (`agora bench latency`: 4
    /// pipelining clients at 44–90 k tasks/s in 3 `--quick` runs of 4, against 1.0–1.7 M/s under
    /// `perf`; docs/PERFORMANCE.md), and `perf` finishes `bench hetero` in about half the time.
    #[default(PolicyKind::Perf)]
    pub policy: PolicyKind,
    /// `perf`: weight of the old average when a new measurement arrives (0.8 = XiTAO's 4:1).
    #[default(0.8)]
    pub history_weight: f64,
    /// `energy`: a device may be chosen when its predicted finish is within this factor of the
    /// earliest predicted finish (the task's slack).
    #[default(1.5)]
    pub energy_slack: f64,
    /// Where the daemon keeps state across restarts (the performance model, and level-1
    /// checkpoints unless `[checkpoint] local` is set). `None`: a
    /// directory of this daemon's own, derived from its socket ([`state_dir_for_socket`]), so
    /// daemons on different sockets do not overwrite each other's learning. Set (by
    /// `--state-dir`, `$AGORA_STATE_DIR` or `[daemon] state_dir`), it is used as it is: daemons
    /// given the same directory share it. [`DaemonConfig::effective_state_dir`] is the one used.
    #[default(state_dir_from_env())]
    pub state_dir: Option<PathBuf>,
    /// Users allowed to open latency-class queues (with `latency_gids`; both empty: everyone).
    #[default(Vec::new())]
    pub latency_uids: Vec<u32>,
    /// Groups whose members (by primary or supplementary group) may open latency-class queues.
    #[default(Vec::new())]
    pub latency_gids: Vec<u32>,
    /// Target preemption latency for batch kernels: launches predicted to run longer are split
    /// into slices of about this length, between which a lane can run latency-class tasks.
    /// 0 disables chunking.
    #[default(Duration::from_millis(1))]
    pub preempt_target: Duration,
    /// How latency-class work is protected: `none` (latency-first lanes and chunking only),
    /// `priority` (also placed where it starts soonest, revoking batch launches on demand) or
    /// `elastic` (TReM: as priority, with lanes reserved for latency work and revocation only
    /// when the request would miss its SLA otherwise).
    #[default(LatencyPolicy::Elastic)]
    pub latency_policy: LatencyPolicy,
    /// Response-time target of latency-class queues that set none.
    #[default(Duration::from_millis(200))]
    pub latency_sla: Duration,
    /// Strict coherence (for finding missing `sync_to`/`sync_from` calls): every device, the CPU
    /// included, computes on its own copy of each buffer, so the host copy changes only at
    /// `sync_from` (and host-side memset/copy) and device copies only at `sync_to`, wherever a
    /// task runs. A program that forgets one then reads stale data on every device, not only on
    /// those with memory of their own. Costs a private copy per buffer on the CPU, the copies
    /// between them, and inline runs.
    #[default(false)]
    pub strict_coherence: bool,
    /// Batch launches predicted shorter than this are never made revocable (a latency task
    /// waits for them): revocability costs a drained lane and a copy of the read-write buffers.
    #[default(Duration::from_millis(1))]
    pub revoke_min: Duration,
    /// Largest share of a launch's predicted time that saving its read-write buffers (what a
    /// replay restores) may cost for it to run revocable. Above it the launch runs whole: on a
    /// GPU, saving a 64 MiB buffer before each of nw's 100 µs diagonals made it 450× slower.
    #[default(0.05)]
    pub revoke_max_save_share: f64,
    /// OS priority of lane threads (and CPU gang helpers) while they run batch-class jobs;
    /// latency-class jobs always run at normal priority (`SCHED_OTHER` at the daemon's nice
    /// value). A lane's threads switch when the class of its work changes, and a latency job
    /// queued behind a batch job raises the lane at once. `normal`: no difference (before 0.1);
    /// `batch`: `SCHED_BATCH` (a waking batch thread does not preempt others; no privilege
    /// needed); `idle`: `SCHED_IDLE` (batch work runs only when no normal thread wants the
    /// core, so latency work — the dispatcher, clients, lanes with latency jobs — runs at once);
    /// `nice:N`: nice value + N; `auto`: `batch` while no latency-class work is live, `idle`
    /// while some is (a latency-class task in the last second).
    ///
    /// Default `auto`. `idle` is the only setting under which a waking latency thread always
    /// preempts batch work at once, but it starves batch lanes whenever normal threads spin —
    /// and Agora's clients and dispatcher spin briefly by design: with `idle`, the pipelined
    /// throughput of `agora bench latency` (lane jobs of one batch queue) fell from about 1.6 to
    /// 0.2–0.7 M tasks/s on the 2-core VM. `auto` pays that only while a latency tenant is at
    /// work, which is when the trade is wanted: `agora bench stall` measured a latency-class
    /// neighbour's p99 beside CPU-bound batch launches at ~1× its quiet p99 under `idle` against
    /// 3–10× under `batch` (see docs/PERFORMANCE.md). `batch` never starves and never needs
    /// privileges. Returning a thread from `idle` or `nice:N` to normal needs `CAP_SYS_NICE` or
    /// `RLIMIT_NICE` ≥ 20 (sched(7)); the daemon tries the round trip at start and, where it
    /// fails, says so in one line and uses `batch`, which every user may use (so `auto` is
    /// `batch` for an unprivileged daemon). On a node shared with other busy programs, `idle`
    /// batch work waits for them: use `batch` there.
    #[default(BatchPriority::Auto)]
    pub batch_priority: BatchPriority,
    /// Nice value added to the dispatcher thread's (0: unchanged). Negative values raise it
    /// above the lanes and clients (e.g. -5), which needs `CAP_SYS_NICE` or a sufficient
    /// `RLIMIT_NICE`; without it the daemon logs one line and keeps the normal priority. Off by
    /// default: the dispatcher spins for work, and above normal priority it would take a core
    /// from the clients on small machines.
    #[default(0)]
    pub dispatcher_nice: i32,
    /// Runs the dispatcher thread under `SCHED_FIFO` (priority 1), so no lane or client thread
    /// preempts it. A nice value cannot do that: the kernel's scheduler (EEVDF) gives a waiting
    /// thread of any weight a whole slice now and then, and on a machine whose cores are busy the
    /// dispatcher then waits a scheduler tick (4 ms) with every tenant's tasks behind it
    /// (`agora bench stall`, PERFORMANCE.md). Off by default: a real-time dispatcher keeps a core
    /// whenever it has work or spins for it, which on small machines is a core the clients and
    /// lanes lose (the kernel's real-time throttling still leaves them 5 %). Each device host's
    /// message loop runs under `SCHED_FIFO` too: it answers the dispatcher's synchronous requests
    /// (an allocation), which would otherwise wait for it to get a core. Needs `CAP_SYS_NICE` or
    /// `RLIMIT_RTPRIO` ≥ 1; without, the daemon logs one line and goes on.
    #[default(false)]
    pub dispatcher_realtime: bool,
    /// Test-only fault injection `(seed, per mille)`: tasks the rule picks fail with
    /// `KernelFault` without running (see `agora_protocol::testing`). Not in the configuration
    /// file; the default comes from `AGORA_INJECT_FAULTS=SEED:PER_MILLE`.
    #[default(crate::outcome::FaultInjection::setting_from_env())]
    pub inject_faults: Option<(u64, u64)>,
    /// Kernel package directories (`[kernels] paths`; `agora serve --kernels DIR`, repeatable,
    /// adds to them): each a package (a directory with `package.toml`) or a directory of
    /// packages. Packages are trusted code: their kernels run inside the daemon. Default:
    /// [`agora_packages::default_paths`].
    #[default(agora_packages::default_paths())]
    pub kernel_paths: Vec<PathBuf>,
    /// Who may build tenant programs (`[programs] allow`): everyone, or nobody but the users and
    /// groups of `program_uids` / `program_gids`.
    #[default(ProgramAccess::Everyone)]
    pub programs_allow: ProgramAccess,
    /// Users who may build tenant programs when `programs_allow` is `nobody`.
    #[default(Vec::new())]
    pub program_uids: Vec<u32>,
    /// Groups whose members (by primary or supplementary group) may build tenant programs when
    /// `programs_allow` is `nobody`.
    #[default(Vec::new())]
    pub program_gids: Vec<u32>,
    /// Most programs one session may build.
    #[default(64)]
    pub max_programs: usize,
    /// Longest one launch of a tenant program's kernel may run before the daemon kills its
    /// executor (`agora serve --program-timeout MS`, `[programs] timeout_ms`); the task fails
    /// with `KernelTimeout`.
    #[default(Duration::from_secs(10))]
    pub program_timeout: Duration,
    /// The program run as a session's executor (`PROGRAM executor ...`) and as device hosts
    /// (`PROGRAM device-host ...`): the `agora` binary. `None`: `$AGORA_EXECUTOR`, else (for
    /// `agora serve`) [`OWN_BINARY`], the image the daemon runs; a daemon embedded in another
    /// program has none unless one of those is set, and refuses to build programs, saying so.
    #[default(executor_from_env())]
    pub program_executor: Option<PathBuf>,
    /// Most bytes of compiled program binaries the daemon keeps under its state directory
    /// (`programs/`), so that building the same source again costs almost nothing (0: no cache).
    #[default(256 << 20)]
    pub program_cache_bytes: u64,
    /// Whether the kernels of tenant OpenCL programs may also run inside the daemon, on its own
    /// OpenCL devices, where the scheduler places them like a package's (`[programs] in_daemon`;
    /// default false). Faster (no executor round trip, the daemon's work-group choice, device
    /// memory of its own), but the code is then no longer contained: a tenant kernel that
    /// crashes PoCL crashes the daemon. For nodes whose tenants are trusted. Their CPU placement
    /// (and C programs, always) stays in the sandboxed executor.
    #[default(false)]
    pub programs_in_daemon: bool,
    /// Whether the kernels of tenant OpenCL programs may run on the daemon's GPUs, compiled to
    /// PTX and fenced into the tenant's partition of GPU memory (`[programs] on_gpus`; default
    /// true). A program the fence pass refuses runs elsewhere.
    #[default(true)]
    pub programs_on_gpus: bool,
    /// Per-uid limits, the control request rate and the hello timeout (`[limits]`).
    #[default(crate::limits::LimitSettings::default())]
    pub limits: crate::limits::LimitSettings,
    /// Who may use admin requests (drain, `agora kernels reload`, `agora trace save`) besides
    /// the groups of `admin_gids` (`[daemon] admin_uids`). `None` (the default): root and the
    /// daemon's own user. Set, it is the whole list: root is admin only if listed.
    #[default(None)]
    pub admin_uids: Option<Vec<u32>>,
    /// Groups whose members (by primary or supplementary group) may use admin requests
    /// (`[daemon] admin_gids`; default none).
    #[default(Vec::new())]
    pub admin_gids: Vec<u32>,
    /// Level 1 of checkpoints (`[checkpoint] local`): the node's fast local storage (tmpfs
    /// allowed). `None`: `checkpoints/` under the daemon's state directory.
    #[default(None)]
    pub checkpoint_local: Option<PathBuf>,
    /// Level 2 (`[checkpoint] partner`): a second directory (another disk, or a partner node's
    /// mount) that gets a copy of each level-2 checkpoint. `None`: level 2 is refused.
    #[default(None)]
    pub checkpoint_partner: Option<PathBuf>,
    /// Level 4 (`[checkpoint] shared`): a parallel or shared file system path that gets a copy of
    /// each level-4 checkpoint. `None`: level 4 is refused.
    #[default(None)]
    pub checkpoint_shared: Option<PathBuf>,
    /// Block size of differential checkpoints: only blocks whose hash changed since the last
    /// checkpoint are written (FTI's dCP).
    #[default(64 << 10)]
    pub checkpoint_block_bytes: u64,
    /// Level 3's Reed–Solomon data shards (files a checkpoint is split into).
    #[default(4)]
    pub checkpoint_data_shards: usize,
    /// Level 3's parity shards: a checkpoint survives the loss of any this many of its files.
    #[default(2)]
    pub checkpoint_parity_shards: usize,
    /// Complete checkpoints kept per application (older ones are deleted after a new one).
    #[default(2)]
    pub checkpoint_keep: usize,
    /// How often a client's `snapshot()` checkpoints (FTI's checkpoint interval): it is called
    /// every iteration and issues a level-1 checkpoint once this long has passed since the last.
    #[default(Duration::from_secs(60))]
    pub checkpoint_interval: Duration,
    /// Most bytes one user's checkpoints may take on disk, all applications and directories
    /// together (`[checkpoint] quota_per_user`; 0: no limit). A checkpoint that would pass it
    /// fails before anything is written (its write reports why); earlier ones stay intact.
    #[default(0)]
    pub checkpoint_quota_per_user: u64,
    /// Most bytes all tenants' captured checkpoints may hold in the daemon's memory until they are
    /// written (`[checkpoint] capture_memory`; 0: a quarter of the memory the daemon may use,
    /// its cgroup's limit or the node's). A checkpoint task waits while others' captures fill it.
    #[default(0)]
    pub checkpoint_capture_memory: u64,
    /// The device whose lanes run real-time DAGs (`[realtime] device`, a name such as `cpu0`).
    /// `None`: the first CPU device. Admission partitions DAG nodes onto its lanes.
    #[default(None)]
    pub realtime_device: Option<String>,
    /// How admission picks a lane for each node (`[realtime] packing`): first-fit packs lanes
    /// and has the utilisation bound, worst-fit spreads load.
    #[default(RealtimePacking::FirstFit)]
    pub realtime_packing: RealtimePacking,
    /// Safety margin on every node's WCET (`[realtime] wcet_margin`): budget = WCET × (1 +
    /// margin). Covers the daemon's own interference.
    #[default(0.1)]
    pub realtime_wcet_margin: f64,
    /// A node without a declared WCET is counted with the performance model's estimate times
    /// this (`[realtime] model_factor`): the model keeps a mean, not a percentile.
    #[default(2.0)]
    pub realtime_model_factor: f64,
    /// Users allowed to declare real-time DAGs (`[realtime] uids`; with `gids` both empty:
    /// everyone).
    #[default(Vec::new())]
    pub realtime_uids: Vec<u32>,
    /// Groups whose members (by primary or supplementary group) may declare real-time DAGs
    /// (`[realtime] gids`).
    #[default(Vec::new())]
    pub realtime_gids: Vec<u32>,
    /// Most DAGs one session may have admitted at once (`[realtime] max_dags_per_session`).
    #[default(64)]
    pub realtime_max_dags_per_session: usize,
    /// Added to the release thread's nice value (`[realtime] release_nice`): negative, so that
    /// it preempts lanes busy with nodes and releases DAGs on time (needs CAP_SYS_NICE or
    /// RLIMIT_NICE; without, the daemon says so and keeps it normal).
    #[default(-10)]
    pub realtime_release_nice: i32,
    /// Refuse sessions of processes that belong to no running Slurm job (`[slurm] require_job`;
    /// off by default). Root, the daemon's user and admin uids are exempt.
    #[default(false)]
    pub slurm_require_job: bool,
}

/// How admission partitions DAG nodes onto lanes (`[realtime] packing`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "kebab-case")]
pub enum RealtimePacking {
    /// The lowest lane that fits.
    #[default]
    FirstFit,
    /// The least loaded lane that fits.
    WorstFit,
}

/// Who may build tenant programs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "lowercase")]
pub enum ProgramAccess {
    /// Every tenant.
    #[default]
    Everyone,
    /// Only the users and groups listed in `[programs] uids` / `gids`.
    Nobody,
}

/// The directory under which daemons keep their state: `$XDG_STATE_HOME/agora`, else
/// `~/.local/state/agora`, else `/tmp/agora-$UID/state`. Each daemon without a state directory
/// of its own setting uses [`state_dir_for_socket`], a subdirectory of it.
pub fn state_home() -> PathBuf {
    if let Some(dir) = std::env::var_os("XDG_STATE_HOME").filter(|d| !d.is_empty()) {
        return PathBuf::from(dir).join("agora");
    }
    if let Some(home) = std::env::var_os("HOME").filter(|d| !d.is_empty()) {
        return PathBuf::from(home).join(".local/state/agora");
    }
    PathBuf::from(format!("/tmp/agora-{}/state", rustix::process::getuid().as_raw()))
}

/// The state directory of the daemon on `socket` when none is set:
/// `state_home()/daemons/NAME-HASH`, where NAME is the socket's file name and HASH a hash of its
/// absolute path, so each socket has its own and the same socket finds it again after a restart.
pub fn state_dir_for_socket(socket: &Path) -> PathBuf {
    state_home().join("daemons").join(socket_key(socket))
}

/// The state directory a daemon on `socket` uses unless its configuration sets one:
/// `$AGORA_STATE_DIR` when set, else [`state_dir_for_socket`]. What `agora model show` reads.
pub fn default_state_dir(socket: &Path) -> PathBuf {
    state_dir_from_env().unwrap_or_else(|| state_dir_for_socket(socket))
}

/// `$AGORA_STATE_DIR`, when set and not empty.
fn state_dir_from_env() -> Option<PathBuf> {
    std::env::var_os("AGORA_STATE_DIR")
        .filter(|d| !d.is_empty())
        .map(PathBuf::from)
}

/// `NAME-HASH` for a socket path: its file name (characters other than letters, digits, `.`,
/// `_` and `-` replaced, at most 32 kept) and the FNV-1a hash of its absolute path. The hash is
/// fixed here (not `std`'s hasher, which may change between Rust versions).
fn socket_key(socket: &Path) -> String {
    use std::os::unix::ffi::OsStrExt;
    let absolute = std::path::absolute(socket).unwrap_or_else(|_| socket.to_path_buf());
    let hash = absolute
        .as_os_str()
        .as_bytes()
        .iter()
        .fold(0xcbf2_9ce4_8422_2325_u64, |h, b| {
            (h ^ u64::from(*b)).wrapping_mul(0x0000_0100_0000_01b3)
        });
    let name: String = socket
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default()
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-') {
                c
            } else {
                '_'
            }
        })
        .take(32)
        .collect();
    let name = if name.is_empty() { "socket".into() } else { name };
    format!("{name}-{hash:016x}")
}

/// `$AGORA_EXECUTOR`, when set and not empty.
fn executor_from_env() -> Option<PathBuf> {
    std::env::var_os("AGORA_EXECUTOR")
        .filter(|p| !p.is_empty())
        .map(PathBuf::from)
}

/// The CPU device's power model: a server core draws roughly 2 W idle and 10–12 W busy (PoCL
/// runs on the same cores, so OpenCL devices get the same model by default).
fn default_cpu_power() -> PowerModel {
    let (lanes, threads) = agora_devices::cpu::CpuDevice::default_partition();
    let cores = (lanes * threads) as f64;
    PowerModel {
        idle_watts: 2.0 * cores,
        active_watts: 12.0 * cores,
    }
}

/// A configuration file that could not be used.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    /// Not valid TOML, or a setting of the wrong type or name.
    #[error("{0}")]
    Parse(String),
    /// Valid TOML with a value that cannot work.
    #[error("{0}")]
    Invalid(String),
}

// The file format. Each section is one line per key: the key, how the file writes the value
// (the field's own type, or a unit such as `Micros` or `Bytes`) and the `DaemonConfig` field it
// sets. Reading (`apply`), printing (`of`) and the refusal of unknown keys all come from these
// lines, so a new setting is its field in `DaemonConfig` (doc and `#[default]`) plus one line here.
// The sections stay flat in `DaemonConfig` (`config.cpu_lanes`, not `config.cpu.lanes`): some 500
// places read it, and the file's nesting is a matter of this table alone.

// Bounds of the tuning settings (`DaemonConfig::validate_tuning`). Each is far beyond any useful
// value, so a refusal means a typo or a wrong unit, not a setting someone needs.
/// CPU lanes: each is a thread pinned to work; 1024 is more cores than a node has.
pub const MAX_CPU_LANES: usize = 1024;
/// Threads per CPU lane: a lane runs one task over all of them; more than a node's cores only
/// adds switching.
pub const MAX_CPU_THREADS_PER_LANE: usize = 1024;
/// CPU worker threads in all (lanes × threads per lane): 4096 OS threads is already many times
/// a large node's cores, and each holds a stack.
pub const MAX_CPU_THREADS: usize = 4096;
/// Lanes (command queues or streams) per OpenCL device or GPU: drivers overlap a handful; 64
/// only multiplies the device's queues and the scheduler's choices.
pub const MAX_DEVICE_LANES: usize = 64;
/// How long the dispatcher polls before it sleeps: it spins a whole core meanwhile, so beyond a
/// second an idle daemon would burn a core to save a wake-up that costs microseconds.
pub const MAX_SPIN: Duration = Duration::from_secs(1);
/// Tasks predicted below this run on the dispatcher thread, which places no other session's
/// work meanwhile; beyond 10 ms that stall would be the whole node's.
pub const MAX_INLINE_NS: u64 = 10_000_000;
/// The default response-time target of latency-class queues: beyond an hour it is no latency
/// target (and a larger one overflowed a `Duration` in the flag's conversion).
pub const MAX_LATENCY_SLA: Duration = Duration::from_secs(3600);
/// The batch work a session may have queued on lanes before its ring stops being read: beyond
/// an hour back-pressure never acts, and a session could hold the lanes' queues (and the
/// daemon's memory) for that long.
pub const MAX_SESSION_LANE_WORK: Duration = Duration::from_secs(3600);

section! {
    /// `[daemon]`
    DaemonSection "daemon." {
        socket: PathBuf => socket,
        socket_access: SocketAccess => socket_access,
        private_status: bool => private_status,
        state_dir: Option<PathBuf> => state_dir,
        inline_max_ns: u64 => inline_max_ns,
        max_spin_us: Micros => max_spin,
        shutdown_timeout_s: Seconds => shutdown_timeout,
        admin_uids: Option<Vec<u32>> => admin_uids,
        admin_gids: Vec<u32> => admin_gids,
    }
}

section! {
    /// `[limits]`
    LimitsSection "limits." {
        connections_per_uid: u64 => limits.connections_per_uid,
        sessions_per_uid: u64 => limits.sessions_per_uid,
        heap_bytes_per_uid: Bytes => limits.heap_bytes_per_uid,
        queues_per_uid: u64 => limits.queues_per_uid,
        buffers_per_uid: u64 => limits.buffers_per_uid,
        control_requests_per_uid: u64 => limits.control_requests_per_uid,
        control_rate: u64 => limits.control_rate,
        control_burst: u64 => limits.control_burst,
        hello_timeout_ms: LimitMs => limits.hello_timeout,
        exempt_uids: Vec<u32> => limits.exempt_uids,
    }
}

section! {
    /// `[sessions]`
    SessionsSection "sessions." {
        quota: Bytes => session_quota,
        device_quota: Bytes => device_quota,
        ring_capacity: u32 => ring_capacity,
        max_queues: usize => max_queues,
        max_buffers: usize => max_buffers,
        lane_work_ms: TargetMs => session_lane_work,
        latency_uids: Vec<u32> => latency_uids,
        latency_gids: Vec<u32> => latency_gids,
    }
}

section! {
    /// `[scheduler]`, with `[scheduler.perf]` and `[scheduler.energy]`.
    SchedulerSection "scheduler." {
        policy: PolicyKind => policy,
        preempt_target_us: Micros => preempt_target,
        latency_policy: LatencyPolicy => latency_policy,
        latency_sla_ms: TargetMs => latency_sla,
        revoke_min_us: Micros => revoke_min,
        revoke_max_save_share: f64 => revoke_max_save_share,
        strict_coherence: bool => strict_coherence,
        batch_priority: PriorityName => batch_priority,
        dispatcher_nice: i32 => dispatcher_nice,
        dispatcher_realtime: bool => dispatcher_realtime,
    }
    subsections { perf: PerfSection, energy: EnergySection }
}

section! {
    /// `[scheduler.perf]`
    PerfSection "scheduler.perf." {
        history_weight: f64 => history_weight,
    }
}

section! {
    /// `[scheduler.energy]`
    EnergySection "scheduler.energy." {
        slack: f64 => energy_slack,
    }
}

section! {
    /// `[cpu]`
    CpuSection "cpu." {
        lanes: usize => cpu_lanes,
        threads_per_lane: usize => cpu_threads_per_lane,
        idle_watts: f64 => cpu_power.idle_watts,
        active_watts: f64 => cpu_power.active_watts,
    }
}

section! {
    /// `[opencl]`
    OpenClSection "opencl." {
        enabled: bool => opencl,
        lanes: usize => opencl_lanes,
        memory_limit: Bytes => opencl_memory_limit,
        device_host: bool => opencl_device_host,
        hang_timeout_ms: LimitMs => opencl_hang_timeout,
        idle_watts: f64 => opencl_power.idle_watts,
        active_watts: f64 => opencl_power.active_watts,
    }
}

section! {
    /// `[cuda]`
    CudaSection "cuda." {
        enabled: bool => cuda,
        device_host: bool => cuda_device_host,
        hang_timeout_ms: LimitMs => cuda_hang_timeout,
        lanes: usize => cuda_lanes,
        memory_limit: Bytes => cuda_memory_limit,
        pinned_limit_per_user: Bytes => cuda_pinned_limit_per_user,
        idle_watts: f64 => cuda_power.idle_watts,
        active_watts: f64 => cuda_power.active_watts,
    }
}

section! {
    /// `[kernels]`
    KernelsSection "kernels." {
        paths: Vec<PathBuf> => kernel_paths,
    }
}

section! {
    /// `[programs]`
    ProgramsSection "programs." {
        allow: ProgramAccess => programs_allow,
        uids: Vec<u32> => program_uids,
        gids: Vec<u32> => program_gids,
        max_per_session: usize => max_programs,
        timeout_ms: LimitMs => program_timeout,
        executor: Option<PathBuf> => program_executor,
        cache_bytes: Bytes => program_cache_bytes,
        in_daemon: bool => programs_in_daemon,
        on_gpus: bool => programs_on_gpus,
    }
}

section! {
    /// `[checkpoint]`
    CheckpointSection "checkpoint." {
        local: Option<PathBuf> => checkpoint_local,
        partner: Option<PathBuf> => checkpoint_partner,
        shared: Option<PathBuf> => checkpoint_shared,
        block_bytes: Bytes => checkpoint_block_bytes,
        data_shards: usize => checkpoint_data_shards,
        parity_shards: usize => checkpoint_parity_shards,
        keep: usize => checkpoint_keep,
        interval_s: Seconds => checkpoint_interval,
        quota_per_user: Bytes => checkpoint_quota_per_user,
        capture_memory: Bytes => checkpoint_capture_memory,
    }
}

section! {
    /// `[realtime]`
    RealtimeSection "realtime." {
        device: Option<String> => realtime_device,
        packing: RealtimePacking => realtime_packing,
        wcet_margin: f64 => realtime_wcet_margin,
        model_factor: f64 => realtime_model_factor,
        uids: Vec<u32> => realtime_uids,
        gids: Vec<u32> => realtime_gids,
        max_dags_per_session: usize => realtime_max_dags_per_session,
        release_nice: i32 => realtime_release_nice,
    }
}

section! {
    /// `[slurm]`
    SlurmSection "slurm." {
        require_job: bool => slurm_require_job,
    }
}

section! {
    /// `[telemetry]`
    TelemetrySection "telemetry." {
        metrics: Option<std::net::SocketAddr> => metrics,
        trace: Option<PathBuf> => trace,
        trace_capacity: usize => trace_capacity,
    }
}

/// The whole file: its sections, and the `[[sim]]` devices (which replace the configured ones
/// when there is at least one).
#[derive(Debug, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct File {
    #[serde(default)]
    daemon: DaemonSection,
    #[serde(default)]
    sessions: SessionsSection,
    #[serde(default)]
    scheduler: SchedulerSection,
    #[serde(default)]
    cpu: CpuSection,
    #[serde(default)]
    opencl: OpenClSection,
    #[serde(default)]
    cuda: CudaSection,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    sim: Vec<SimDeviceConfig>,
    #[serde(default)]
    telemetry: TelemetrySection,
    #[serde(default)]
    kernels: KernelsSection,
    #[serde(default)]
    programs: ProgramsSection,
    #[serde(default)]
    limits: LimitsSection,
    #[serde(default)]
    checkpoint: CheckpointSection,
    #[serde(default)]
    realtime: RealtimeSection,
    #[serde(default)]
    slurm: SlurmSection,
}

impl File {
    fn apply(self, c: &mut DaemonConfig) -> Result<(), ConfigError> {
        self.daemon.apply(c)?;
        self.sessions.apply(c)?;
        self.scheduler.apply(c)?;
        self.cpu.apply(c)?;
        self.opencl.apply(c)?;
        self.cuda.apply(c)?;
        if !self.sim.is_empty() {
            c.sims = self.sim;
        }
        self.kernels.apply(c)?;
        self.programs.apply(c)?;
        self.limits.apply(c)?;
        self.checkpoint.apply(c)?;
        self.realtime.apply(c)?;
        self.slurm.apply(c)?;
        self.telemetry.apply(c)
    }

    fn of(c: &DaemonConfig) -> Self {
        File {
            daemon: DaemonSection::of(c),
            sessions: SessionsSection::of(c),
            scheduler: SchedulerSection::of(c),
            cpu: CpuSection::of(c),
            opencl: OpenClSection::of(c),
            cuda: CudaSection::of(c),
            sim: c.sims.clone(),
            telemetry: TelemetrySection::of(c),
            kernels: KernelsSection::of(c),
            programs: ProgramsSection::of(c),
            limits: LimitsSection::of(c),
            checkpoint: CheckpointSection::of(c),
            realtime: RealtimeSection::of(c),
            slurm: SlurmSection::of(c),
        }
    }
}

/// A file section: one optional field per key (absent: the setting keeps its value), read into
/// and written from the [`DaemonConfig`] fields the lines name, through [`InFile`]. `$path` is
/// the section's dotted prefix, for messages.
macro_rules! section {
    (
        $(#[$doc:meta])*
        $name:ident $path:literal {
            $( $key:ident : $file:ty => $($field:ident).+ ),* $(,)?
        }
        $( subsections { $( $sub:ident : $subty:ident ),* $(,)? } )?
    ) => {
        $(#[$doc])*
        #[derive(Debug, Default, Serialize, Deserialize)]
        #[serde(deny_unknown_fields)]
        struct $name {
            $(
                #[serde(default, skip_serializing_if = "Option::is_none")]
                $key: Option<$file>,
            )*
            $($(
                #[serde(default)]
                $sub: $subty,
            )*)?
        }

        impl $name {
            /// Sets what the section names.
            fn apply(self, c: &mut DaemonConfig) -> Result<(), ConfigError> {
                $(
                    if let Some(value) = self.$key {
                        c.$($field).+ = <$file as InFile<_>>::read(value, concat!($path, stringify!($key)))?;
                    }
                )*
                $($( self.$sub.apply(c)?; )*)?
                Ok(())
            }

            /// Every setting of the section, as `c` has it.
            fn of(c: &DaemonConfig) -> Self {
                $name {
                    $( $key: <$file as InFile<_>>::write(&c.$($field).+), )*
                    $($( $sub: $subty::of(c), )*)?
                }
            }
        }
    };
}
use section;

/// How the file writes a setting of type `T`.
trait InFile<T>: Sized {
    /// The file's value for `value` (`None`: leave the key out).
    fn write(value: &T) -> Option<Self>;
    /// The setting for the file's value at `key` (dotted, for messages).
    fn read(self, key: &str) -> Result<T, ConfigError>;
}

/// Most settings are written as they are.
impl<T: Clone> InFile<T> for T {
    fn write(value: &T) -> Option<Self> {
        Some(value.clone())
    }
    fn read(self, _key: &str) -> Result<T, ConfigError> {
        Ok(self)
    }
}

/// A byte count: a number, or a string with a suffix (`"512M"`); printed with a suffix when exact.
#[derive(Debug, Serialize, Deserialize)]
#[serde(transparent)]
struct Bytes(#[serde(with = "bytes")] u64);

impl InFile<u64> for Bytes {
    fn write(value: &u64) -> Option<Self> {
        Some(Bytes(*value))
    }
    fn read(self, _key: &str) -> Result<u64, ConfigError> {
        Ok(self.0)
    }
}

/// A batch priority by name (`"idle"`, `"batch"`, `"normal"`, `"nice:N"`).
#[derive(Debug, Serialize, Deserialize)]
#[serde(transparent)]
struct PriorityName(String);

impl InFile<BatchPriority> for PriorityName {
    fn write(value: &BatchPriority) -> Option<Self> {
        Some(PriorityName(value.name()))
    }
    fn read(self, key: &str) -> Result<BatchPriority, ConfigError> {
        BatchPriority::parse(&self.0).map_err(|e| ConfigError::Invalid(format!("{key}: {e}")))
    }
}

/// A duration in whole microseconds (keys ending in `_us`).
#[derive(Debug, Serialize, Deserialize)]
#[serde(transparent)]
struct Micros(u64);

impl InFile<Duration> for Micros {
    fn write(value: &Duration) -> Option<Self> {
        Some(Micros(value.as_micros() as u64))
    }
    fn read(self, _key: &str) -> Result<Duration, ConfigError> {
        Ok(Duration::from_micros(self.0))
    }
}

/// A duration in seconds (keys ending in `_s`): zero or more, at most a day.
#[derive(Debug, Serialize, Deserialize)]
#[serde(transparent)]
struct Seconds(f64);

impl InFile<Duration> for Seconds {
    fn write(value: &Duration) -> Option<Self> {
        Some(Seconds(value.as_secs_f64()))
    }
    fn read(self, key: &str) -> Result<Duration, ConfigError> {
        let s = self.0;
        if !(s.is_finite() && (0.0..=86_400.0).contains(&s)) {
            return Err(ConfigError::Invalid(format!(
                "{key} = {s}: give a number of seconds between 0 and 86400"
            )));
        }
        Ok(Duration::from_secs_f64(s))
    }
}

/// A response-time target in milliseconds (keys ending in `_ms`): positive.
#[derive(Debug, Serialize, Deserialize)]
#[serde(transparent)]
struct TargetMs(f64);

impl InFile<Duration> for TargetMs {
    fn write(value: &Duration) -> Option<Self> {
        Some(TargetMs(value.as_secs_f64() * 1e3))
    }
    fn read(self, key: &str) -> Result<Duration, ConfigError> {
        let ms = self.0;
        if !(ms.is_finite() && ms > 0.0) {
            return Err(ConfigError::Invalid(format!(
                "{key} = {ms}: the response-time target must be a positive number of milliseconds"
            )));
        }
        // A finite target can still be too long for a `Duration` (1e300 ms): refuse it rather
        // than panic.
        Duration::try_from_secs_f64(ms / 1e3).map_err(|_| {
            ConfigError::Invalid(format!(
                "{key} = {ms}: the response-time target is too long (give milliseconds, e.g. 200)"
            ))
        })
    }
}

/// A time limit in whole milliseconds (keys ending in `_ms`): at least 1 ms, at most a day.
#[derive(Debug, Serialize, Deserialize)]
#[serde(transparent)]
struct LimitMs(u64);

impl InFile<Duration> for LimitMs {
    fn write(value: &Duration) -> Option<Self> {
        Some(LimitMs(value.as_millis() as u64))
    }
    fn read(self, key: &str) -> Result<Duration, ConfigError> {
        if !(1..=86_400_000).contains(&self.0) {
            return Err(ConfigError::Invalid(format!(
                "{key} = {}: give a number of milliseconds between 1 and 86400000",
                self.0
            )));
        }
        Ok(Duration::from_millis(self.0))
    }
}

impl DaemonConfig {
    /// Most bytes captured checkpoints may hold in memory until written: the one set, else a
    /// quarter of the memory this process may use (its cgroup's limit or the node's).
    pub fn effective_capture_memory(&self) -> u64 {
        if self.checkpoint_capture_memory > 0 {
            self.checkpoint_capture_memory
        } else {
            crate::limits::memory_limit() / 4
        }
    }

    /// The state directory this daemon uses: the one set, else its socket's own.
    pub fn effective_state_dir(&self) -> PathBuf {
        self.state_dir
            .clone()
            .unwrap_or_else(|| state_dir_for_socket(&self.socket))
    }

    /// The defaults with what `text` (a configuration file) sets applied.
    pub fn from_toml(text: &str) -> Result<DaemonConfig, ConfigError> {
        let mut config = DaemonConfig::default();
        config.apply_toml(text)?;
        Ok(config)
    }

    /// Applies the settings of a configuration file over these.
    pub fn apply_toml(&mut self, text: &str) -> Result<(), ConfigError> {
        let file: File = toml::from_str(text).map_err(|e| ConfigError::Parse(e.to_string()))?;
        file.apply(self)?;
        self.validate()
    }

    /// Applies the configuration file `path`, whose text is `text`, over these settings. A
    /// relative path the file sets (`state_dir = "state"`) is taken from the file's directory,
    /// as `include` paths are in most configuration formats: the file then means the same
    /// whoever starts the daemon from wherever (a unit runs it from `/`, where `state_dir =
    /// "agora"` became `/agora`).
    pub fn apply_toml_file(&mut self, text: &str, path: &Path) -> Result<(), ConfigError> {
        self.apply_toml(text)?;
        // The file made absolute first: a bare name (`--config agora.toml`) has an empty parent,
        // which `absolute` refuses.
        let base = std::path::absolute(path)
            .map(|file| file.parent().map(Path::to_path_buf).unwrap_or(file))
            .map_err(|e| ConfigError::Invalid(format!("{}: cannot find its directory: {e}", path.display())))?;
        // Parsed once more only to see which keys the file names: the values it did not set
        // (defaults, the environment's) keep their own meaning.
        let table: toml::Table = toml::from_str(text).map_err(|e| ConfigError::Parse(e.to_string()))?;
        let names = |key: &str| {
            let (section, name) = key.split_once('.').expect("path keys are SECTION.NAME");
            table
                .get(section)
                .and_then(|s| s.as_table())
                .is_some_and(|s| s.contains_key(name))
        };
        for (key, paths) in self.path_settings() {
            if names(key) {
                for path in paths.into_iter().filter(|p| p.is_relative()) {
                    *path = base.join(&*path);
                }
            }
        }
        Ok(())
    }

    /// Makes every path setting absolute, taking relative ones (from flags or the environment)
    /// from the current directory: the daemon's log lines, `agora status` and `--print-config`
    /// then name paths a reader elsewhere can open (`agora model show` from another directory
    /// read the wrong file before).
    pub fn make_paths_absolute(&mut self) -> Result<(), ConfigError> {
        for (key, paths) in self.path_settings() {
            for path in paths {
                *path = std::path::absolute(&*path).map_err(|e| {
                    ConfigError::Invalid(format!("{key} = {}: cannot make it absolute: {e}", path.display()))
                })?;
            }
        }
        Ok(())
    }

    /// Every setting that holds paths, by its key in the file, with the paths it holds now.
    fn path_settings(&mut self) -> Vec<(&'static str, Vec<&mut PathBuf>)> {
        vec![
            ("daemon.socket", vec![&mut self.socket]),
            ("daemon.state_dir", self.state_dir.iter_mut().collect()),
            ("kernels.paths", self.kernel_paths.iter_mut().collect()),
            ("programs.executor", self.program_executor.iter_mut().collect()),
            ("checkpoint.local", self.checkpoint_local.iter_mut().collect()),
            ("checkpoint.partner", self.checkpoint_partner.iter_mut().collect()),
            ("checkpoint.shared", self.checkpoint_shared.iter_mut().collect()),
            ("telemetry.trace", self.trace.iter_mut().collect()),
        ]
    }

    /// Checks values that parse but cannot work.
    pub fn validate(&self) -> Result<(), ConfigError> {
        let bad = |m: String| Err(ConfigError::Invalid(m));
        // NaN passes every `<` check below, and an infinite power or cost poisons the policies'
        // arithmetic: every number of the file must be finite.
        let mut floats = vec![
            ("scheduler.perf.history_weight", self.history_weight),
            ("scheduler.energy.slack", self.energy_slack),
            ("cpu.idle_watts", self.cpu_power.idle_watts),
            ("cpu.active_watts", self.cpu_power.active_watts),
            ("opencl.idle_watts", self.opencl_power.idle_watts),
            ("opencl.active_watts", self.opencl_power.active_watts),
            ("cuda.idle_watts", self.cuda_power.idle_watts),
            ("cuda.active_watts", self.cuda_power.active_watts),
        ];
        for sim in &self.sims {
            floats.extend([
                ("sim.speed", sim.speed),
                ("sim.launch_ns", sim.launch_ns),
                ("sim.idle_watts", sim.idle_watts),
                ("sim.active_watts", sim.active_watts),
            ]);
            for profile in sim.profile.values() {
                floats.extend([
                    ("sim.profile.launch_ns", profile.launch_ns),
                    ("sim.profile.ns_per_item", profile.ns_per_item),
                ]);
            }
        }
        if let Some((key, value)) = floats.into_iter().find(|(_, v)| !v.is_finite()) {
            return bad(format!("{key} = {value} must be a finite number"));
        }
        if !(0.0..=10.0).contains(&self.realtime_wcet_margin) {
            return bad(format!(
                "realtime.wcet_margin = {} must be between 0 and 10 (e.g. 0.1 for 10 %)",
                self.realtime_wcet_margin
            ));
        }
        if !(1.0..=100.0).contains(&self.realtime_model_factor) {
            return bad(format!(
                "realtime.model_factor = {} must be between 1 and 100",
                self.realtime_model_factor
            ));
        }
        if !self.ring_capacity.is_power_of_two() || !(2..=1 << 16).contains(&self.ring_capacity) {
            return bad(format!(
                "ring capacity (--ring-capacity, sessions.ring_capacity) = {} must be a power of two between 2 and 65536",
                self.ring_capacity
            ));
        }
        self.validate_tuning().map_err(ConfigError::Invalid)?;
        if self.program_timeout.is_zero() {
            return bad("the program timeout (--program-timeout, programs.timeout_ms) must be at least 1 ms".into());
        }
        self.limits.validate().map_err(ConfigError::Invalid)?;
        if self.session_quota == 0 {
            return bad("the session quota (--session-quota, sessions.quota) must be more than 0".into());
        }
        if !(0.0..1.0).contains(&self.history_weight) {
            return bad(format!(
                "scheduler.perf.history_weight = {} must be in [0, 1): the weight of the old average",
                self.history_weight
            ));
        }
        if !(-20..=19).contains(&self.dispatcher_nice) {
            return bad(format!(
                "scheduler.dispatcher_nice = {} must be between -20 and 19 (0: unchanged)",
                self.dispatcher_nice
            ));
        }
        if self.energy_slack < 1.0 {
            return bad(format!(
                "scheduler.energy.slack = {} must be at least 1 (1: only the fastest device qualifies)",
                self.energy_slack
            ));
        }
        self.validate_checkpoint().map_err(ConfigError::Invalid)?;
        let mut names = std::collections::HashSet::new();
        for sim in &self.sims {
            if sim.name.is_empty() || !names.insert(sim.name.as_str()) {
                return bad(format!(
                    "sim device names must be unique and not empty ('{}')",
                    sim.name
                ));
            }
            if sim.lanes == 0 || sim.memory == 0 || sim.speed <= 0.0 || sim.bandwidth == 0 {
                return bad(format!(
                    "sim device '{}': lanes, memory, speed and bandwidth must be positive",
                    sim.name
                ));
            }
        }
        Ok(())
    }

    /// Checks `[checkpoint]` against the store's rules here, at load: the store checks them
    /// again when the daemon opens it, but refusing them there leaves a daemon whose every
    /// checkpoint fails, telling clients the directory is unusable.
    /// The dispatcher's and the devices' tuning: each value within [`TUNING_BOUNDS`]' reasons.
    /// A value far outside them was accepted before and cost the node silently (a dispatcher
    /// that spun for days burnt a core on an idle daemon); a refusal at start says so instead.
    fn validate_tuning(&self) -> Result<(), String> {
        let count = |flag: &str, key: &str, value: usize, most: usize| {
            if (1..=most).contains(&value) {
                Ok(())
            } else {
                Err(format!("{flag}, {key}) = {value} must be between 1 and {most}"))
            }
        };
        count("CPU lanes (--cpu-lanes", "cpu.lanes", self.cpu_lanes, MAX_CPU_LANES)?;
        count(
            "threads per CPU lane (--cpu-threads-per-lane",
            "cpu.threads_per_lane",
            self.cpu_threads_per_lane,
            MAX_CPU_THREADS_PER_LANE,
        )?;
        let threads = self.cpu_lanes.saturating_mul(self.cpu_threads_per_lane);
        if threads > MAX_CPU_THREADS {
            return Err(format!(
                "CPU lanes × threads per lane = {} × {} = {threads} threads: at most {MAX_CPU_THREADS} \
                 (lower --cpu-lanes / cpu.lanes or --cpu-threads-per-lane / cpu.threads_per_lane)",
                self.cpu_lanes, self.cpu_threads_per_lane
            ));
        }
        count(
            "OpenCL lanes (--opencl-lanes",
            "opencl.lanes",
            self.opencl_lanes,
            MAX_DEVICE_LANES,
        )?;
        count(
            "GPU lanes (--cuda-lanes",
            "cuda.lanes",
            self.cuda_lanes,
            MAX_DEVICE_LANES,
        )?;
        if self.max_spin > MAX_SPIN {
            return Err(format!(
                "the dispatcher's spin (--max-spin-us, daemon.max_spin_us) = {} µs must be at most {} µs (1 s)",
                self.max_spin.as_micros(),
                MAX_SPIN.as_micros()
            ));
        }
        if self.inline_max_ns > MAX_INLINE_NS {
            return Err(format!(
                "the inline limit (--inline-max-ns, daemon.inline_max_ns) = {} ns must be at most {MAX_INLINE_NS} ns (10 ms; 0: never inline)",
                self.inline_max_ns
            ));
        }
        if self.latency_sla.is_zero() || self.latency_sla > MAX_LATENCY_SLA {
            return Err(format!(
                "the latency target (--latency-sla-ms, scheduler.latency_sla_ms) = {} ms must be more than 0 and at most {} ms (1 h)",
                self.latency_sla.as_secs_f64() * 1e3,
                MAX_LATENCY_SLA.as_millis()
            ));
        }
        if self.session_lane_work.is_zero() || self.session_lane_work > MAX_SESSION_LANE_WORK {
            return Err(format!(
                "the batch work a session may queue on lanes (--session-lane-work-ms, sessions.lane_work_ms) = {} ms \
                 must be more than 0 and at most {} ms (1 h)",
                self.session_lane_work.as_secs_f64() * 1e3,
                MAX_SESSION_LANE_WORK.as_millis()
            ));
        }
        Ok(())
    }

    fn validate_checkpoint(&self) -> Result<(), String> {
        use agora_checkpoint::{MAX_BLOCK_BYTES, MAX_SHARDS, MIN_BLOCK_BYTES};
        if !(MIN_BLOCK_BYTES..=MAX_BLOCK_BYTES).contains(&self.checkpoint_block_bytes) {
            return Err(format!(
                "checkpoint.block_bytes = {} must be between {MIN_BLOCK_BYTES} (\"4K\") and {MAX_BLOCK_BYTES} (\"64M\")",
                self.checkpoint_block_bytes
            ));
        }
        for (key, value) in [
            ("data_shards", self.checkpoint_data_shards),
            ("parity_shards", self.checkpoint_parity_shards),
        ] {
            if !(1..MAX_SHARDS).contains(&value) {
                return Err(format!(
                    "checkpoint.{key} = {value} must be between 1 and {} (data_shards + parity_shards at most {MAX_SHARDS}), e.g. 4 data and 2 parity",
                    MAX_SHARDS - 1
                ));
            }
        }
        let shards = self.checkpoint_data_shards + self.checkpoint_parity_shards;
        if shards > MAX_SHARDS {
            return Err(format!(
                "checkpoint.data_shards + checkpoint.parity_shards = {shards} must be at most {MAX_SHARDS} (Reed–Solomon over bytes), e.g. 4 and 2"
            ));
        }
        if self.checkpoint_keep == 0 {
            return Err(
                "checkpoint.keep = 0 must be at least 1: the checkpoint just written is kept (2 keeps one to fall back to)"
                    .into(),
            );
        }
        for (key, dir) in [
            ("local", &self.checkpoint_local),
            ("partner", &self.checkpoint_partner),
            ("shared", &self.checkpoint_shared),
        ] {
            if dir.as_ref().is_some_and(|d| d.as_os_str().is_empty()) {
                return Err(format!(
                    "checkpoint.{key} is empty: name a directory, or leave the key out"
                ));
            }
        }
        Ok(())
    }

    /// Checks the names the settings give kernels (the sim devices' lists and profiles) against
    /// the kernels the daemon has, the packages' included.
    pub(crate) fn check_kernel_names(&self, table: &crate::kernels::KernelTable) -> Result<(), ConfigError> {
        for sim in &self.sims {
            for kernel in sim.kernels.iter().flatten().chain(sim.profile.keys()) {
                if table.find(kernel).is_none() {
                    return Err(ConfigError::Invalid(format!(
                        "sim device '{}' names kernel '{kernel}', which neither the library nor a kernel package has (`agora kernels` lists them)",
                        sim.name
                    )));
                }
            }
        }
        Ok(())
    }

    /// What in these settings deserves a warning at start although they work: a session quota
    /// above the heap one uid may hold (every session is granted its whole heap against its
    /// uid's limit, so a session that asks for no smaller heap is always refused).
    pub fn warnings(&self) -> Vec<String> {
        let mut warnings = Vec::new();
        if self.session_quota > self.limits.heap_bytes_per_uid {
            warnings.push(format!(
                "the session quota (--session-quota, sessions.quota) = {} is more than the heap one uid may hold \
                 ([limits] heap_bytes_per_uid, --limit-heap-per-uid = {}): only sessions that ask for a smaller \
                 heap can open; lower the first or raise the second",
                format_bytes(self.session_quota),
                format_bytes(self.limits.heap_bytes_per_uid)
            ));
        }
        warnings
    }

    /// Facts about these settings an operator should know but that are no mistake: logged at
    /// start at INFO. Each session reserves its whole heap against its uid's heap limit, so with
    /// the defaults (a 2 GiB quota, half the node's memory per uid) a uid gets far fewer
    /// sessions than `sessions_per_uid`: an 8-rank job failed at rank 6 on a 23 GiB node with
    /// nothing in the log to say why.
    pub fn notes(&self) -> Vec<String> {
        let mut notes = Vec::new();
        let (quota, heap, sessions) = (
            self.session_quota,
            self.limits.heap_bytes_per_uid,
            self.limits.sessions_per_uid,
        );
        // A quota above the heap limit is `warnings`' case.
        if quota == 0 || quota > heap || quota.saturating_mul(sessions) <= heap {
            return notes;
        }
        let fit = heap / quota;
        // The largest power of two that lets `sessions_per_uid` sessions fit: the value to
        // suggest for the clients' AGORA_HEAP_BYTES.
        let per_session = heap / sessions;
        let smaller = if per_session >= 1 << 20 {
            let size = 1u64 << per_session.ilog2();
            format!(
                " ({} with AGORA_HEAP_BYTES={} in the clients' environment)",
                (heap / size).min(sessions),
                format_bytes(size)
            )
        } else {
            String::new()
        };
        notes.push(format!(
            "a uid can open at most {fit} sessions of the default heap{smaller}, not [limits] sessions_per_uid = \
             {sessions}: each session reserves its whole heap (sessions.quota, --session-quota = {}) against \
             [limits] heap_bytes_per_uid (--limit-heap-per-uid = {}); lower the quota or raise the limit to \
             change it",
            format_bytes(quota),
            format_bytes(heap)
        ));
        notes
    }

    /// Every effective setting as a configuration file (what `agora serve --print-config` shows).
    pub fn to_toml(&self) -> String {
        let file = File::of(self);
        let body = toml::to_string_pretty(&file).unwrap_or_else(|e| format!("# cannot print: {e}\n"));
        let mut out = String::from(
            "# Agora daemon configuration: every effective setting (defaults, then the file, then flags).\n\
             # Relative paths in a file given with --config are taken from that file's directory.\n\
             # Sizes take suffixes (\"512M\", \"2G\"); memory_limit / device_quota 0 means no limit.\n\
             # sessions.latency_uids / latency_gids: who may open latency-class queues (both empty: anyone).\n\
             # sessions.lane_work_ms: a session whose batch work on lanes is predicted to run this long\n\
             #   gets no more batch tasks taken from its ring until lanes finish some (its client waits).\n\
             # scheduler.preempt_target_us: batch kernels are sliced to about this length so latency\n\
             #   tasks wait at most about one slice (0: no slicing).\n\
             # scheduler.latency_policy: none | priority | elastic (revocation of batch launches that are\n\
             #   not sliced; elastic also reserves lanes for latency work). latency_sla_ms: the\n\
             #   response-time target of latency queues that set none. revoke_min_us: shorter batch\n\
             #   launches are never revocable. revoke_max_save_share (0.05): nor are launches whose\n\
             #   read-write buffers take longer than this share of the launch to save.\n\
             # scheduler.batch_priority: auto | idle | batch | normal | nice:N, the OS priority of lane\n\
             #   threads running batch jobs (latency jobs run at normal). auto: batch, and idle while\n\
             #   latency-class work is live. auto, idle and nice:N need CAP_SYS_NICE or RLIMIT_NICE >= 20\n\
             #   to come back to normal; without, the daemon says so and uses batch.\n\
             # scheduler.dispatcher_nice: added to the dispatcher thread's nice value (0: unchanged;\n\
             #   negative raises it, which needs CAP_SYS_NICE or RLIMIT_NICE). dispatcher_realtime:\n\
             #   SCHED_FIFO for the dispatcher and the device hosts' message loops (no lane or client\n\
             #   preempts them; the dispatcher keeps a core while it has work; needs CAP_SYS_NICE or\n\
             #   RLIMIT_RTPRIO).\n\
             # scheduler.policy: perf (least expected finish, learned; the default) | rr | energy. Add\n\
             #   modeled devices with [[sim]] sections, e.g.\n\
             #   [[sim]]\n\
             #   name = \"sim0\"\n\
             #   lanes = 2\n\
             #   memory = \"1G\"\n\
             #   speed = 4.0            # x one CPU core, for kernels without a profile\n\
             #   kernels = [\"sgemm\"]    # absent: every kernel\n\
             #   [sim.profile.sgemm]\n\
             #   launch_ns = 20000\n\
             #   ns_per_item = 30.0\n",
        );
        if self.state_dir.is_none() {
            out.push_str(&format!(
                "# [daemon] state_dir: not set, so this daemon keeps its performance model in its socket's own\n\
                 #   directory, {}\n",
                self.effective_state_dir().display()
            ));
        }
        if self.metrics.is_none() {
            out.push_str("# [telemetry] metrics = \"127.0.0.1:9464\" serves Prometheus metrics (off by default)\n");
        }
        out.push_str(
            "# [cuda]: NVIDIA GPUs (when a CUDA driver is installed). lanes: streams per GPU; memory_limit: most\n\
             #   device memory used per GPU (0: all); pinned_limit_per_user: most host memory one user's sessions\n\
             #   may have page-locked for copies (0: half the host's; beyond it copies use the driver's staging);\n\
             #   device_host: each GPU in a process of its own, so a kernel fault costs a replay, not the GPU.\n",
        );
        out.push_str(
            "# [programs]: tenant programs (OpenCL C or C shared objects a session builds), run in one sandboxed\n\
             #   executor process per session. allow = \"everyone\" | \"nobody\" (then only uids / gids may);\n\
             #   timeout_ms: longest launch before the executor is killed; cache_bytes: compiled binaries kept\n\
             #   under the state directory (0: none); executor: the agora binary (default: $AGORA_EXECUTOR,\n\
             #   else the running agora).\n",
        );
        out.push_str(
            "# [limits]: what one uid may hold across all its connections and sessions (refusals are typed errors\n\
             #   naming the limit and this setting; `agora status` shows each uid's use). heap_bytes_per_uid defaults\n\
             #   to half of physical memory; control_rate / control_burst: control requests per second (token bucket)\n\
             #   per connection; hello_timeout_ms: a connection that sends nothing is closed; exempt_uids: counted,\n\
             #   never refused (default none: root and the daemon's user are limited too).\n\
             # [daemon] admin_uids: who may drain devices, reload kernel packages and save the trace (default: root\n\
             #   and the daemon's user; set, it is the whole list); admin_gids: groups whose members may too.\n\
             # Every *_gids / gids list counts a member by its primary or any supplementary group.\n\
             # [daemon] socket_access: who may connect: \"user\" (the daemon's user and root: socket mode 0600),\n\
             #   \"group:NAME\" (0660, owned by group NAME) or \"all\" (0666: a node-wide daemon for every local user).\n\
             # [daemon] private_status: true shows each user who is no admin its own sessions, uids, jobs and DAGs\n\
             #   only in `agora status` / `agora top` (node-wide counters and devices stay); false (default): all.\n",
        );
        if self.trace.is_none() {
            out.push_str("# [telemetry] trace = \"agora.trace.json\" records a task trace (off by default)\n");
        }
        // Directories without a value are left out of the body (TOML has no "unset"): say
        // what each does when set.
        let unset: Vec<&str> = [
            (
                self.checkpoint_local.is_none(),
                "local (level 1; default: checkpoints/ under state_dir)",
            ),
            (
                self.checkpoint_partner.is_none(),
                "partner (level 2; unset: level 2 is refused)",
            ),
            (
                self.checkpoint_shared.is_none(),
                "shared (level 4; unset: level 4 is refused)",
            ),
        ]
        .into_iter()
        .filter_map(|(unset, text)| unset.then_some(text))
        .collect();
        if !unset.is_empty() {
            out.push_str(&format!(
                "# [checkpoint] directories not set here: {}\n",
                unset.join(", ")
            ));
        }
        if self.checkpoint_capture_memory == 0 {
            out.push_str(&format!(
                "# [checkpoint] capture_memory = \"0\": captured checkpoints waiting to be written hold at most a quarter of\n\
                 #   the memory this daemon may use (its cgroup's limit or the node's): {} MiB here\n",
                self.effective_capture_memory() >> 20
            ));
        }
        out.push('\n');
        out.push_str(&body);
        out
    }
}

/// Parses `N`, `NK`, `NM`, `NG`, `NT` (powers of 1024; an optional trailing `B` or `iB`).
pub fn parse_bytes(text: &str) -> Result<u64, String> {
    let t = text.trim().trim_end_matches(['B', 'b']).trim_end_matches('i');
    let (digits, shift) = match t.chars().last() {
        Some('K' | 'k') => (&t[..t.len() - 1], 10),
        Some('M' | 'm') => (&t[..t.len() - 1], 20),
        Some('G' | 'g') => (&t[..t.len() - 1], 30),
        Some('T' | 't') => (&t[..t.len() - 1], 40),
        _ => (t, 0),
    };
    let n: u64 = digits
        .trim()
        .parse()
        .map_err(|_| format!("'{text}' is not a size (try 4096, 64M or 2G)"))?;
    n.checked_mul(1 << shift)
        .ok_or_else(|| format!("'{text}' is too large"))
}

/// Writes a byte count the way a person would (`2G`, `512M`, `1000`).
pub fn format_bytes(n: u64) -> String {
    for (shift, suffix) in [(40, "T"), (30, "G"), (20, "M"), (10, "K")] {
        // Only when exact and short: 10 GB/s reads better as 10000000000 than as 9765625K.
        if n != 0 && n.is_multiple_of(1u64 << shift) && (n >> shift) < 10_000 {
            return format!("{}{suffix}", n >> shift);
        }
    }
    n.to_string()
}

/// Serde for byte sizes: a number, or a string with a suffix.
mod bytes {
    use serde::{Deserialize, Deserializer, Serializer};

    #[derive(Deserialize)]
    #[serde(untagged)]
    enum Size {
        Number(u64),
        Text(String),
    }

    pub fn serialize<S: Serializer>(n: &u64, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&super::format_bytes(*n))
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<u64, D::Error> {
        match Size::deserialize(d)? {
            Size::Number(n) => Ok(n),
            Size::Text(t) => super::parse_bytes(&t).map_err(serde::de::Error::custom),
        }
    }
}

/// Serde for an optional byte size (see [`bytes`]).
mod opt_bytes {
    use serde::{Deserialize, Deserializer, Serializer};

    pub fn serialize<S: Serializer>(n: &Option<u64>, s: S) -> Result<S::Ok, S::Error> {
        match n {
            Some(n) => super::bytes::serialize(n, s),
            None => s.serialize_none(),
        }
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Option<u64>, D::Error> {
        #[derive(Deserialize)]
        struct Wrapped(#[serde(with = "super::bytes")] u64);
        Ok(Option::<Wrapped>::deserialize(d)?.map(|w| w.0))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn printed_config_parses_back_to_the_same_settings() {
        let mut config = DaemonConfig {
            policy: PolicyKind::Energy,
            metrics: Some(([127, 0, 0, 1], 9464).into()),
            trace: Some("agora.trace.json".into()),
            latency_sla: Duration::from_micros(12_500),
            device_quota: 3 << 20,
            socket_access: SocketAccess::Group("gpu-users".into()),
            ..Default::default()
        };
        config.sims.push(SimDeviceConfig {
            kernels: Some(vec!["sgemm".into()]),
            ..SimDeviceConfig::named("fast")
        });
        config.sims[0].profile.insert(
            "sgemm".into(),
            SimKernelProfile {
                launch_ns: 1.0,
                ns_per_item: 2.0,
            },
        );
        let text = config.to_toml();
        let back = DaemonConfig::from_toml(&text).unwrap();
        assert_eq!(back.to_toml(), text);
        assert_eq!(back.policy, PolicyKind::Energy);
        assert_eq!((back.metrics, &back.trace), (config.metrics, &config.trace));
        assert_eq!(
            (back.latency_sla, back.device_quota),
            (config.latency_sla, config.device_quota)
        );
        assert!(text.contains("device_quota = \"3M\"\n"), "{text}");
        assert_eq!(back.sims, config.sims);
    }

    /// Found by the `config` fuzz target: values that parse but must not be accepted.
    #[test]
    fn numbers_that_cannot_work_are_refused_not_accepted_or_panicking() {
        for text in [
            // Used to panic: a finite target too long for a `Duration`.
            "[scheduler]\nlatency_sla_ms = 1e300",
            // Used to be accepted: NaN passes `slack < 1` and `speed <= 0`.
            "[scheduler.energy]\nslack = nan",
            "[[sim]]\nname = \"s\"\nspeed = nan",
            "[cpu]\nactive_watts = inf",
            "[[sim]]\nname = \"s\"\n[sim.profile.sgemm]\nns_per_item = -inf",
        ] {
            match DaemonConfig::from_toml(text) {
                Err(ConfigError::Invalid(m)) => assert!(!m.is_empty()),
                other => panic!("{text}: {other:?}"),
            }
        }
    }

    /// Tuning values far out of range (audit A7) are refused naming the flag, the key and the
    /// range; before, each was accepted (a spin of 11 days burnt a core on an idle daemon) and a
    /// flag's 0 lanes became 1 without a word.
    #[test]
    fn tuning_out_of_range_is_refused_naming_flag_key_and_range() {
        for (text, names) in [
            (
                "[daemon]\nmax_spin_us = 999999999999",
                ["--max-spin-us", "daemon.max_spin_us", "at most 1000000"],
            ),
            (
                "[daemon]\ninline_max_ns = 99999999999",
                ["--inline-max-ns", "daemon.inline_max_ns", "at most 10000000"],
            ),
            (
                "[cpu]\nlanes = 2000",
                ["--cpu-lanes", "cpu.lanes", "between 1 and 1024"],
            ),
            (
                "[cpu]\nthreads_per_lane = 0",
                ["--cpu-threads-per-lane", "cpu.threads_per_lane", "between 1 and 1024"],
            ),
            (
                "[cpu]\nlanes = 64\nthreads_per_lane = 500",
                ["cpu.lanes", "cpu.threads_per_lane", "at most 4096"],
            ),
            (
                "[opencl]\nlanes = 0",
                ["--opencl-lanes", "opencl.lanes", "between 1 and 64"],
            ),
            ("[cuda]\nlanes = 65", ["--cuda-lanes", "cuda.lanes", "between 1 and 64"]),
            (
                "[scheduler]\nlatency_sla_ms = 1e12",
                ["--latency-sla-ms", "scheduler.latency_sla_ms", "at most 3600000"],
            ),
            (
                "[sessions]\nlane_work_ms = 1e9",
                ["--session-lane-work-ms", "sessions.lane_work_ms", "at most 3600000"],
            ),
        ] {
            match DaemonConfig::from_toml(text) {
                Err(ConfigError::Invalid(m)) => {
                    for name in names {
                        assert!(m.contains(name), "{text}: '{name}' not in: {m}");
                    }
                }
                other => panic!("{text}: {other:?}"),
            }
        }
        // The bounds themselves are accepted.
        let edge =
            "[daemon]\nmax_spin_us = 1000000\ninline_max_ns = 10000000\n[cpu]\nlanes = 4\nthreads_per_lane = 1024\n\
                    [opencl]\nlanes = 64\n[scheduler]\nlatency_sla_ms = 3600000\n[sessions]\nlane_work_ms = 3600000";
        DaemonConfig::from_toml(edge).unwrap();
    }

    /// A bare file name (`agora serve --config agora.toml`, the README's example) is in the
    /// current directory (audit C-D6): it failed with "cannot make an empty path absolute".
    #[test]
    fn a_file_named_without_a_directory_is_the_current_directorys() {
        let mut config = DaemonConfig::default();
        config
            .apply_toml_file("[daemon]\nstate_dir = \"relstate\"\n", Path::new("agora.toml"))
            .unwrap();
        assert_eq!(
            config.state_dir,
            Some(std::env::current_dir().unwrap().join("relstate"))
        );
    }

    /// Relative paths in a configuration file are the file's directory's (audit A5); before,
    /// they were the daemon's working directory's and were reported relative. Paths the file
    /// does not set keep their meaning, and `make_paths_absolute` takes the rest from the
    /// current directory.
    #[test]
    fn relative_paths_in_a_file_are_taken_from_its_directory() {
        let text = "[daemon]\nstate_dir = \"relstate\"\nsocket = \"/abs/agora.sock\"\n[kernels]\npaths = [\"pkgs\", \"/opt/p\"]\n\
                    [programs]\nexecutor = \"bin/agora\"\n[checkpoint]\nlocal = \"ckpt\"\npartner = \"../partner\"\n\
                    [telemetry]\ntrace = \"t.json\"\n";
        let mut config = DaemonConfig {
            kernel_paths: Vec::new(),
            checkpoint_shared: Some("shared".into()),
            ..Default::default()
        };
        config
            .apply_toml_file(text, Path::new("/etc/agora/agora.toml"))
            .unwrap();
        let dir = Path::new("/etc/agora");
        assert_eq!(config.state_dir, Some(dir.join("relstate")));
        assert_eq!(config.socket, PathBuf::from("/abs/agora.sock"));
        assert_eq!(config.kernel_paths, vec![dir.join("pkgs"), PathBuf::from("/opt/p")]);
        assert_eq!(config.program_executor, Some(dir.join("bin/agora")));
        assert_eq!(config.checkpoint_local, Some(dir.join("ckpt")));
        assert_eq!(config.checkpoint_partner, Some(dir.join("../partner")));
        assert_eq!(config.trace, Some(dir.join("t.json")));
        // Not set by the file: not the file's directory's, but the current one's once made absolute.
        assert_eq!(config.checkpoint_shared, Some(PathBuf::from("shared")));
        config.make_paths_absolute().unwrap();
        assert_eq!(
            config.checkpoint_shared,
            Some(std::env::current_dir().unwrap().join("shared"))
        );
        assert_eq!(config.state_dir, Some(dir.join("relstate")));
    }

    #[test]
    fn socket_access_reads_user_group_and_all_and_refuses_anything_else() {
        let read = |value: &str| DaemonConfig::from_toml(&format!("[daemon]\nsocket_access = \"{value}\""));
        assert_eq!(DaemonConfig::default().socket_access, SocketAccess::User);
        assert_eq!(read("all").unwrap().socket_access, SocketAccess::All);
        assert_eq!(
            read("group:hpc").unwrap().socket_access,
            SocketAccess::Group("hpc".into())
        );
        assert_eq!(SocketAccess::Group("hpc".into()).socket_mode(), 0o660);
        for bad in ["everyone", "group:", "group:a b", ""] {
            let err = read(bad).unwrap_err().to_string();
            assert!(err.contains("choose user"), "{bad}: {err}");
        }
    }

    #[test]
    fn a_file_sets_only_what_it_names() {
        let c = DaemonConfig::from_toml(
            "[scheduler]\npolicy = \"energy\"\n[sessions]\nquota = \"512M\"\n[opencl]\nmemory_limit = 1048576\n\
             [cuda]\nhang_timeout_ms = 300000\n[[sim]]\nname = \"s\"\nmemory = \"64M\"\n",
        )
        .unwrap();
        assert_eq!(c.policy, PolicyKind::Energy);
        assert_eq!(c.session_quota, 512 << 20);
        assert_eq!(c.opencl_memory_limit, 1 << 20);
        // A GPU host's hang limit is its own: a long trusted kernel need not slow OpenCL's.
        assert_eq!(c.cuda_hang_timeout, Duration::from_secs(300));
        assert_eq!(c.opencl_hang_timeout, DaemonConfig::default().opencl_hang_timeout);
        assert_eq!(c.sims[0].memory, 64 << 20);
        assert_eq!(c.sims[0].lanes, 2);
        assert_eq!(c.ring_capacity, DaemonConfig::default().ring_capacity);
    }

    #[test]
    fn mistakes_are_named() {
        let err = |t: &str| DaemonConfig::from_toml(t).unwrap_err().to_string();
        assert!(err("[scheduler]\npolicy = \"fastest\"").contains("unknown variant"));
        assert!(err("[cpu]\nlanez = 2").contains("lanez"));
        assert!(err("[sessions]\nquota = \"lots\"").contains("not a size"));
        assert!(err("[sessions]\nring_capacity = 1000").contains("power of two"));
        assert!(err("[[sim]]\nname = \"a\"\n[[sim]]\nname = \"a\"").contains("unique"));
        assert!(err("[scheduler.perf]\nhistory_weight = 1.5").contains("[0, 1)"));
        let e = err("[scheduler]\nbatch_priority = \"fifo\"");
        assert!(e.contains("scheduler.batch_priority") && e.contains("idle"), "{e}");
        assert!(err("[scheduler]\ndispatcher_nice = -21").contains("between -20 and 19"));
    }

    #[test]
    fn checkpoint_settings_the_store_would_refuse_are_refused_at_load() {
        let err = |t: &str| match DaemonConfig::from_toml(&format!("[checkpoint]\n{t}")) {
            Err(ConfigError::Invalid(m)) => m,
            other => panic!("{t}: {other:?}"),
        };
        let e = err("block_bytes = \"0\"");
        assert!(
            e.contains("checkpoint.block_bytes = 0") && e.contains("4096") && e.contains("64M"),
            "{e}"
        );
        assert!(err("block_bytes = \"128M\"").contains("between"));
        let e = err("data_shards = 0");
        assert!(
            e.contains("checkpoint.data_shards = 0") && e.contains("between 1 and 255"),
            "{e}"
        );
        assert!(err("parity_shards = 0").contains("checkpoint.parity_shards = 0"));
        let e = err("parity_shards = 300");
        assert!(e.contains("checkpoint.parity_shards = 300") && e.contains("256"), "{e}");
        let e = err("data_shards = 200\nparity_shards = 100");
        assert!(e.contains("= 300") && e.contains("at most 256"), "{e}");
        let e = err("keep = 0");
        assert!(e.contains("checkpoint.keep = 0") && e.contains("at least 1"), "{e}");
        assert!(err("local = \"\"").contains("checkpoint.local is empty"));
        // The edges are accepted, and so is every default.
        DaemonConfig::from_toml("[checkpoint]\nblock_bytes = \"4K\"\ndata_shards = 1\nparity_shards = 255\nkeep = 1")
            .unwrap();
        DaemonConfig::default().validate().unwrap();
    }

    #[test]
    fn batch_priorities_by_name() {
        assert_eq!(DaemonConfig::default().batch_priority, BatchPriority::Auto);
        assert_eq!(DaemonConfig::default().dispatcher_nice, 0);
        assert!(!DaemonConfig::default().dispatcher_realtime);
        let c = DaemonConfig::from_toml("[scheduler]\ndispatcher_realtime = true\n").unwrap();
        assert!(c.dispatcher_realtime);
        assert!(DaemonConfig::from_toml(&c.to_toml()).unwrap().dispatcher_realtime);
        for (text, priority) in [
            ("normal", BatchPriority::Normal),
            ("batch", BatchPriority::Batch),
            ("idle", BatchPriority::Idle),
            ("nice:10", BatchPriority::Nice(10)),
            ("auto", BatchPriority::Auto),
        ] {
            let c = DaemonConfig::from_toml(&format!("[scheduler]\nbatch_priority = \"{text}\"\n")).unwrap();
            assert_eq!(c.batch_priority, priority);
            assert!(c.to_toml().contains(&format!("batch_priority = \"{text}\"\n")));
        }
        let c = DaemonConfig::from_toml("[scheduler]\ndispatcher_nice = -5\n").unwrap();
        assert_eq!(c.dispatcher_nice, -5);
        assert_eq!(DaemonConfig::from_toml(&c.to_toml()).unwrap().dispatcher_nice, -5);
    }

    #[test]
    fn each_socket_has_its_own_state_directory() {
        let a = state_dir_for_socket(Path::new("/run/user/1000/agora/agora.sock"));
        let b = state_dir_for_socket(Path::new("/tmp/agora-test/agora.sock"));
        assert_ne!(a, b);
        assert_eq!(a, state_dir_for_socket(Path::new("/run/user/1000/agora/agora.sock")));
        assert_eq!(a.parent(), b.parent());
        let name = a.file_name().unwrap().to_str().unwrap();
        assert!(
            name.starts_with("agora.sock-") && name.len() == "agora.sock-".len() + 16,
            "{name}"
        );
        let odd = socket_key(Path::new("/tmp/a dir/my socket\u{e9}"));
        assert!(odd.starts_with("my_socket_-"), "{odd}");
        let config = DaemonConfig {
            socket: "/tmp/x.sock".into(),
            state_dir: None,
            ..Default::default()
        };
        assert_eq!(
            config.effective_state_dir(),
            state_dir_for_socket(Path::new("/tmp/x.sock"))
        );
        let config = DaemonConfig {
            state_dir: Some("/srv/agora".into()),
            ..config
        };
        assert_eq!(config.effective_state_dir(), PathBuf::from("/srv/agora"));
    }

    #[test]
    fn sizes() {
        assert_eq!(parse_bytes("64M").unwrap(), 64 << 20);
        assert_eq!(parse_bytes("2GiB").unwrap(), 2 << 30);
        assert!(parse_bytes("lots").is_err());
        assert!(parse_bytes("99999999999T").is_err());
        assert_eq!(format_bytes(2 << 30), "2G");
        assert_eq!(format_bytes(1000), "1000");
        assert_eq!(format_bytes(10_000_000_000), "10000000000");
    }

    #[test]
    fn sim_devices_may_name_only_kernels_the_daemon_has() {
        let table = crate::kernels::KernelRegistry::library_only().snapshot();
        let mut c = DaemonConfig::default();
        let mut sim = SimDeviceConfig::named("sim0");
        sim.kernels = Some(vec!["saxpy".into()]);
        c.sims = vec![sim.clone()];
        c.check_kernel_names(&table).unwrap();
        sim.kernels = Some(vec!["imaging.blurr".into()]);
        c.sims = vec![sim];
        let error = c.check_kernel_names(&table).unwrap_err().to_string();
        assert!(
            error.contains("imaging.blurr") && error.contains("kernel package"),
            "{error}"
        );
    }

    #[test]
    fn kernel_paths_come_from_the_environment_or_the_file() {
        let file = DaemonConfig::from_toml("[kernels]\npaths = [\"/opt/agora/packages\"]\n").unwrap();
        assert_eq!(file.kernel_paths, vec![PathBuf::from("/opt/agora/packages")]);
        assert!(file.to_toml().contains("/opt/agora/packages"));
    }

    #[test]
    fn a_session_quota_no_uid_can_hold_is_warned_about_and_zero_is_refused() {
        let mut c = DaemonConfig::default();
        assert!(c.warnings().is_empty(), "the defaults fit");
        c.limits.heap_bytes_per_uid = 1 << 30;
        c.session_quota = 2 << 30;
        let warnings = c.warnings();
        assert!(
            warnings.len() == 1 && warnings[0].contains("heap_bytes_per_uid") && warnings[0].contains("= 2G"),
            "{warnings:?}"
        );
        c.session_quota = 0;
        assert!(c.validate().unwrap_err().to_string().contains("must be more than 0"));
    }

    /// With a heap limit that holds fewer sessions of the default heap than `sessions_per_uid`
    /// (the defaults on most nodes), the start-up note says how many, and which heap a client
    /// may ask for to open them all (audit A8).
    #[test]
    fn the_sessions_a_uid_can_open_under_its_heap_limit_are_noted() {
        let mut c = DaemonConfig::default();
        c.limits.heap_bytes_per_uid = 12_638_029_824; // half of a 23.5 GiB node
        c.session_quota = 2 << 30;
        c.limits.sessions_per_uid = 64;
        let notes = c.notes();
        assert_eq!(notes.len(), 1, "{notes:?}");
        assert!(
            notes[0].contains("at most 5 sessions of the default heap (64 with AGORA_HEAP_BYTES=128M"),
            "{}",
            notes[0]
        );
        assert!(
            notes[0].contains("sessions_per_uid = 64") && notes[0].contains("= 2G"),
            "{}",
            notes[0]
        );
        // Enough heap for every session: nothing to say.
        c.limits.heap_bytes_per_uid = 128 << 30;
        assert!(c.notes().is_empty());
        // A quota above the limit is a warning, not a note.
        c.limits.heap_bytes_per_uid = 1 << 30;
        assert!(c.notes().is_empty() && c.warnings().len() == 1);
    }
}
