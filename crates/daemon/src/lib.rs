//! The Agora daemon.
//!
//! One process per node owns every device and serves many client processes. Its parts, as in
//! DESIGN.md §3:
//!
//! * `server` — the dispatcher thread's event loop: accepts clients, answers
//!   control requests that change its state, polls session rings, sleeps when idle;
//! * `control` — the control thread: slow control-plane work (trace files, kernel listings,
//!   encoding and writing large replies) off the dispatcher;
//! * `session` — per-client state (segment, rings, queues, buffers, heap, counters), and the
//!   resume of a session whose client outlived its previous daemon;
//! * `memory` — where buffers live: the session heap allocator, valid copies per device,
//!   eviction under device-memory pressure and per-session device quotas;
//! * `scheduler` — descriptors → validated tasks → inline runs or device lanes; its child
//!   `migration` moves queues off draining or failed devices and replays lost tasks;
//! * `outcome` — what a task's success or failure means for the buffers it touches (a failed
//!   writer poisons its outputs; readers of poisoned data fail with `DependencyFailed`);
//! * `programs` — tenant programs: each session's executor process (`agora-executor`), its
//!   programs' kernels, the program cache and who may build;
//! * `revocation` — revocable launches (TReM): saving what a replay needs, the victim slots;
//! * `checkpoint` — checkpoint/restart of protected buffers (FTI): admission of checkpoint
//!   tasks, the capture, the writer thread over `agora-checkpoint`'s store, recovery;
//! * `limits` — per-uid limits (connections, sessions, heap, queues, buffers, control
//!   requests), the per-connection rate of control requests and the refusals;
//! * [`kernels`] — the kernel registry: the library's kernels and the operator's kernel
//!   packages, reloaded at run time (the snapshot launches are validated against);
//! * `handle` — generation-checked handle tables; `config` — the daemon's settings;
//! * [`telemetry`] — Prometheus metrics, task traces, RAPL readings;
//! * [`policy`] — pluggable placement policies (`rr`, `perf`, `energy`) and the learned
//!   performance model they read;
//! * devices come from `agora-devices`, kernels from `agora-kernels`.
//!
//! Use [`run`] for a foreground daemon that stops on SIGINT/SIGTERM, or [`spawn`] to embed one
//! in another program (as `agora demo` and the tests do).

mod checkpoint;
mod claims;
mod config;
mod control;
mod exports;
/// For the fuzzer only (`fuzz/`, target `validate`): the validate stage with a hand-made
/// session. Not an API; see `scheduler/fuzzing.rs`.
#[doc(hidden)]
pub mod fuzzing {
    pub use crate::scheduler::fuzzing::*;
}
mod handle;
pub mod kernels;
mod limits;
mod memory;
mod outcome;
pub mod policy;
mod programs;
mod realtime;
mod revocation;
mod scheduler;
mod server;
mod session;
mod state_files;
pub mod telemetry;

use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::sync::Arc;

use agora_devices::cpu::CpuDevice;
use agora_devices::Device;
use agora_transport::wake::Doorbell;

pub use config::{
    default_state_dir, format_bytes, parse_bytes, state_dir_for_socket, state_home, BatchPriority, ConfigError,
    DaemonConfig, PolicyKind, PowerModel, ProgramAccess, RealtimePacking, SimDeviceConfig, SimKernelProfile,
    SocketAccess, MAX_LATENCY_SLA, OWN_BINARY,
};
pub use limits::LimitSettings;

/// Why the daemon could not start or run.
#[derive(Debug, thiserror::Error)]
pub enum DaemonError {
    /// Another daemon answers on the socket.
    #[error("a daemon is already running on {0}; stop it or pick another path with --socket / AGORA_SOCKET")]
    AlreadyRunning(PathBuf),
    /// The daemon cannot listen on the socket path it was given; the message says why and what
    /// to do.
    #[error("{0}")]
    Socket(String),
    /// The state directory cannot be used (not a directory, not writable, another daemon's);
    /// the message says what to do.
    #[error("{0}")]
    StateDirectory(String),
    /// A kernel package could not be loaded; the message names the file, line and key.
    #[error("{0}")]
    Packages(String),
    /// An OS call failed.
    #[error("{what}: {cause}")]
    Io {
        /// What was being done.
        what: String,
        /// The error.
        cause: std::io::Error,
    },
}

impl DaemonError {
    pub(crate) fn io(what: impl Into<String>, cause: std::io::Error) -> Self {
        DaemonError::Io {
            what: what.into(),
            cause,
        }
    }
}

/// A daemon running on a background thread.
#[derive(Debug)]
pub struct DaemonHandle {
    stop: Arc<Doorbell>,
    thread: Option<std::thread::JoinHandle<Result<(), DaemonError>>>,
    socket: PathBuf,
}

impl DaemonHandle {
    /// The socket clients connect to.
    pub fn socket(&self) -> &Path {
        &self.socket
    }

    /// Stops the daemon and waits for it.
    pub fn stop(mut self) -> Result<(), DaemonError> {
        self.stop_inner()
    }

    fn stop_inner(&mut self) -> Result<(), DaemonError> {
        self.stop.ring();
        match self.thread.take() {
            Some(t) => t
                .join()
                .unwrap_or_else(|_| Err(DaemonError::io("daemon thread", std::io::Error::other("panicked")))),
            None => Ok(()),
        }
    }
}

impl Drop for DaemonHandle {
    fn drop(&mut self) {
        let _ = self.stop_inner();
    }
}

/// The longest socket path the kernel takes: `sun_path` holds 108 bytes, the last one a NUL.
pub const MAX_SOCKET_PATH: usize = 107;

/// What to tell a user whose socket path cannot work.
const SOCKET_FIX: &str = "pick a socket path in a directory you can write with --socket PATH or AGORA_SOCKET \
     (the default is $XDG_RUNTIME_DIR/agora/agora.sock, else /tmp/agora-$UID/agora.sock)";

/// Who may connect, as the file system says it: the socket's mode and the group to own it.
#[derive(Debug, Clone, Copy)]
struct SocketPermissions {
    /// The socket file's permission bits.
    mode: u32,
    /// Every local user may connect (`all`).
    everyone: bool,
    /// The group that owns the socket (`group:NAME`).
    group: Option<u32>,
    /// The mode of a directory the daemon creates for the socket (search permission for the
    /// audience).
    directory_mode: u32,
}

impl SocketPermissions {
    fn of(access: &SocketAccess) -> Result<SocketPermissions, DaemonError> {
        let group = match access {
            SocketAccess::Group(name) => Some(group_id(name)?),
            _ => None,
        };
        Ok(SocketPermissions {
            mode: access.socket_mode(),
            everyone: *access == SocketAccess::All,
            group,
            directory_mode: match access {
                SocketAccess::User => 0o700,
                SocketAccess::Group(_) => 0o750,
                SocketAccess::All => 0o755,
            },
        })
    }

    /// Whether the audience may pass through `dir` (mode `mode`, group `gid`) to the socket.
    fn passes(&self, mode: u32, gid: u32) -> bool {
        match (self.everyone, self.group) {
            (true, _) => mode & 0o001 != 0,
            (false, Some(group)) => mode & 0o001 != 0 || (gid == group && mode & 0o010 != 0),
            // The daemon's own user: it created the socket there.
            (false, None) => true,
        }
    }
}

/// The id of group `name` (a name the system knows, or a number).
fn group_id(name: &str) -> Result<u32, DaemonError> {
    if let Ok(gid) = name.parse::<u32>() {
        return Ok(gid);
    }
    match nix::unistd::Group::from_name(name) {
        Ok(Some(group)) => Ok(group.gid.as_raw()),
        Ok(None) => Err(DaemonError::Socket(format!(
            "socket access group:{name}: no group named '{name}' on this machine; name an existing \
             group (getent group) or give its number"
        ))),
        Err(e) => Err(DaemonError::Socket(format!(
            "socket access group:{name}: cannot look the group up: {e}"
        ))),
    }
}

/// Warns when a directory on the way to the socket keeps out users that `access` admits (a
/// socket they may connect to is of no use behind a directory they may not enter).
fn warn_if_unreachable(path: &Path, access: &SocketAccess, permissions: SocketPermissions) {
    use std::os::unix::fs::MetadataExt;
    let absolute = std::path::absolute(path).unwrap_or_else(|_| path.to_path_buf());
    for dir in absolute.ancestors().skip(1) {
        let Ok(meta) = std::fs::metadata(dir) else {
            continue;
        };
        if !permissions.passes(meta.mode(), meta.gid()) {
            tracing::warn!(
                socket = %path.display(),
                directory = %dir.display(),
                mode = format!("{:o}", meta.mode() & 0o7777),
                %access,
                "the socket admits {access}, but this directory on its way keeps them out: \
                 give the directory search permission (chmod o+x, or g+x for the group), or \
                 put the socket elsewhere (e.g. /run/agora/agora.sock)"
            );
            return;
        }
    }
}

/// Checks, before any device starts, that the daemon can listen on `path`: the path fits in a
/// socket address, its directory exists (or is created) and is writable, nothing but a stale
/// socket is in the way, and no daemon answers there already. `bind` still handles what
/// changes in between. With `access` beyond the daemon's user, a group that does not exist is
/// refused, and a directory on the way that keeps the admitted users out is warned about.
pub fn check_socket_path(path: &Path, access: &SocketAccess) -> Result<(), DaemonError> {
    let permissions = SocketPermissions::of(access)?;
    check_socket_location(path, permissions)?;
    warn_if_unreachable(path, access, permissions);
    Ok(())
}

fn check_socket_location(path: &Path, permissions: SocketPermissions) -> Result<(), DaemonError> {
    let bad = |message: String| Err(DaemonError::Socket(message));
    let length = path.as_os_str().len();
    if length == 0 {
        return bad(format!("the socket path is empty: {SOCKET_FIX}"));
    }
    if length > MAX_SOCKET_PATH {
        return bad(format!(
            "the socket path {} is {length} bytes long, but a Unix socket path can be at most \
             {MAX_SOCKET_PATH} bytes: pick a shorter path with --socket PATH or AGORA_SOCKET, or set \
             XDG_RUNTIME_DIR to a short directory (the default socket is \
             $XDG_RUNTIME_DIR/agora/agora.sock)",
            path.display()
        ));
    }
    let dir = match path.parent() {
        Some(d) if !d.as_os_str().is_empty() => d,
        _ => Path::new("."),
    };
    if !dir.exists() {
        if let Err(e) = create_socket_directory(dir, permissions) {
            return bad(format!(
                "cannot create the socket's directory {}: {e}; {SOCKET_FIX}",
                dir.display()
            ));
        }
    }
    if !dir.is_dir() {
        return bad(format!(
            "the socket's directory {} is not a directory; {SOCKET_FIX}",
            dir.display()
        ));
    }
    if let Err(e) = rustix::fs::access(dir, rustix::fs::Access::WRITE_OK | rustix::fs::Access::EXEC_OK) {
        return bad(format!(
            "cannot create the socket in {}: {}; {SOCKET_FIX}",
            dir.display(),
            std::io::Error::from(e)
        ));
    }
    match std::fs::symlink_metadata(path) {
        Ok(meta) => {
            use std::os::unix::fs::FileTypeExt;
            if !meta.file_type().is_socket() {
                return bad(format!(
                    "{} exists and is not a socket, so the daemon will not replace it; \
                     move it away or {SOCKET_FIX}",
                    path.display()
                ));
            }
            if UnixStream::connect(path).is_ok() {
                return Err(DaemonError::AlreadyRunning(path.to_path_buf()));
            }
            // A socket nobody answers on: a daemon died; `bind` replaces it.
            Ok(())
        }
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
        Err(e) => bad(format!(
            "cannot use the socket path {}: {e}; {SOCKET_FIX}",
            path.display()
        )),
    }
}

/// Creates the socket's directory (and missing parents) for the audience of `permissions`
/// (a group's directory belongs to that group).
fn create_socket_directory(dir: &Path, permissions: SocketPermissions) -> std::io::Result<()> {
    use std::os::unix::fs::{DirBuilderExt, PermissionsExt};
    std::fs::DirBuilder::new()
        .recursive(true)
        .mode(permissions.directory_mode)
        .create(dir)?;
    // The umask may have taken bits away.
    std::fs::set_permissions(dir, std::fs::Permissions::from_mode(permissions.directory_mode))?;
    if let Some(group) = permissions.group {
        std::os::unix::fs::chown(dir, None, Some(group))?;
    }
    Ok(())
}

/// Gives the bound socket at `path` its mode and group, whatever the umask was.
fn set_socket_permissions(path: &Path, permissions: SocketPermissions) -> Result<(), DaemonError> {
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(permissions.mode))
        .map_err(|e| DaemonError::io(format!("setting the mode of {}", path.display()), e))?;
    if let Some(group) = permissions.group {
        std::os::unix::fs::chown(path, None, Some(group)).map_err(|e| {
            DaemonError::Socket(format!(
                "cannot give the socket {} to group {group}: {e}; the daemon's user must belong to \
                 the group (or run as root)",
                path.display()
            ))
        })?;
    }
    Ok(())
}

/// Listens at `path` (claimed by this daemon: `claims::claim_socket`); returns the listener and
/// the socket file it put there.
pub(crate) fn bind(path: &Path, access: &SocketAccess) -> Result<(UnixListener, claims::SocketFile), DaemonError> {
    let permissions = SocketPermissions::of(access)?;
    if path.exists() {
        if UnixStream::connect(path).is_ok() {
            return Err(DaemonError::AlreadyRunning(path.to_path_buf()));
        }
        // A socket file nobody answers on is left over from a daemon that died: replace it.
        std::fs::remove_file(path)
            .map_err(|e| DaemonError::io(format!("removing stale socket {}", path.display()), e))?;
    }
    if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty() && !d.exists()) {
        create_socket_directory(dir, permissions)
            .map_err(|e| DaemonError::io(format!("creating {}", dir.display()), e))?;
    }
    // Bound under a staging name, then renamed into place: the socket path appears only once
    // it listens (between bind and listen a connect is refused, and a client or script that
    // waits for the path to appear would see "connection refused").
    let staging = path.with_file_name(format!(
        ".{}.{}",
        path.file_name().map(|n| n.to_string_lossy()).unwrap_or_default(),
        std::process::id()
    ));
    if staging.as_os_str().len() > MAX_SOCKET_PATH {
        let listener =
            UnixListener::bind(path).map_err(|e| DaemonError::io(format!("binding {}", path.display()), e))?;
        if let Err(e) = set_socket_permissions(path, permissions) {
            let _ = std::fs::remove_file(path);
            return Err(e);
        }
        return Ok((listener, claims::SocketFile::placed(path)));
    }
    let _ = std::fs::remove_file(&staging);
    let listener =
        UnixListener::bind(&staging).map_err(|e| DaemonError::io(format!("binding {}", staging.display()), e))?;
    // Before the rename: the socket appears with the permissions it keeps.
    if let Err(e) = set_socket_permissions(&staging, permissions) {
        let _ = std::fs::remove_file(&staging);
        return Err(e);
    }
    if let Err(e) = std::fs::rename(&staging, path) {
        let _ = std::fs::remove_file(&staging);
        return Err(DaemonError::io(
            format!("moving the socket into place at {}", path.display()),
            e,
        ));
    }
    Ok((listener, claims::SocketFile::placed(path)))
}

fn build(config: DaemonConfig, stop: Arc<Doorbell>) -> Result<server::Server, DaemonError> {
    config
        .validate()
        .map_err(|e| DaemonError::io("checking the configuration", std::io::Error::other(e.to_string())))?;
    for warning in config.warnings() {
        tracing::warn!("{warning}");
    }
    for note in config.notes() {
        tracing::info!("{note}");
    }
    // Before any device starts: a socket that cannot work fails at once, saying what to do; so
    // does a socket path or a state directory that another daemon holds.
    check_socket_path(&config.socket, &config.socket_access)?;
    let claims = vec![
        Some(claims::claim_socket(&config.socket)?),
        claims::claim_state_dir(&config.effective_state_dir())?,
    ];
    if config.socket_access != SocketAccess::User
        && config.programs_allow == ProgramAccess::Everyone
        && !rustix::process::geteuid().is_root()
    {
        // Executors take on their tenant's uid only when the daemon may switch to it.
        tracing::warn!(
            access = %config.socket_access,
            uid = rustix::process::getuid().as_raw(),
            "other users may connect and build tenant programs, which then run (sandboxed) as \
             this daemon's user, not their own: run a node-wide daemon as root, so each executor \
             runs as its tenant, or let only some build programs ([programs] allow = \"nobody\", \
             uids / gids)"
        );
    }
    let priorities = lane_priorities(config.batch_priority);
    let mut cpu = CpuDevice::with_priorities(config.cpu_lanes, config.cpu_threads_per_lane, &priorities)
        .map_err(|e| DaemonError::io("starting CPU lanes", e))?;
    if config.strict_coherence {
        // Strict coherence: the CPU computes on private copies, like a device with memory of
        // its own, so the host copy changes only at sync_from (see `DaemonConfig`).
        cpu = cpu.with_private_copies();
        tracing::info!("strict coherence: every device computes on its own copy of each buffer");
    }
    tracing::info!(
        device = %cpu.info().name,
        lanes = cpu.info().lanes,
        threads_per_lane = cpu.info().threads_per_lane,
        "device ready"
    );
    // Host memory moves at memcpy speed; these are starting points for the policies' transfer
    // estimates, not measurements.
    let mut facts = vec![scheduler::DeviceFacts {
        lane_watts: config.cpu_power.lane_watts(cpu.info().lanes),
        bandwidth: 10e9,
    }];
    let mut devices: Vec<Arc<dyn Device>> = vec![Arc::new(cpu)];
    // GPUs first: when the CUDA backend serves them, NVIDIA's OpenCL platform (the same GPUs) is
    // left out, so each GPU has one context. Listed after the OpenCL devices. By default each
    // GPU runs in a device host of its own (`[cuda] device_host`), so a kernel fault that ends
    // its context costs a replay and a fresh context, not the GPU.
    let host_spec = |program: PathBuf,
                     lanes: usize,
                     memory_limit: u64,
                     hang_timeout: std::time::Duration,
                     mut extra_args: Vec<String>| {
        if config.dispatcher_realtime {
            // The host's message loop answers the dispatcher's synchronous requests (an
            // allocation): a real-time dispatcher waiting for a loop that waits for a core
            // would lose what it was made real-time for.
            extra_args.push("--loop-realtime".into());
        }
        agora_device_host::HostSpec {
            program,
            lanes,
            memory_limit,
            start_timeout: std::time::Duration::from_secs(60),
            hang_timeout,
            priorities: priorities.clone(),
            extra_args,
        }
    };
    #[cfg(feature = "cuda")]
    let gpu_host_program = config
        .program_executor
        .clone()
        .filter(|_| config.cuda && config.cuda_device_host);
    #[cfg(feature = "cuda")]
    let gpu_hosts: Vec<String> = match &gpu_host_program {
        Some(program) => match agora_device_host::list_gpus(program) {
            Ok((gpus, why_none)) => {
                if let Some(why) = why_none {
                    tracing::info!("{why}");
                }
                gpus
            }
            Err(problem) => {
                tracing::warn!("{problem}; continuing without GPUs");
                Vec::new()
            }
        },
        None => Vec::new(),
    };
    #[cfg(not(feature = "cuda"))]
    let gpu_hosts: Vec<String> = Vec::new();
    #[cfg(feature = "cuda")]
    let gpus = if config.cuda && gpu_host_program.is_none() {
        let (found, problems) = agora_devices::cuda::discover(
            config.cuda_lanes,
            config.cuda_memory_limit,
            &priorities,
            // Tenants' own kernels get the same per-launch limit on a GPU as in their executor.
            Some(config.program_timeout),
        );
        for problem in problems {
            tracing::info!("{problem}");
        }
        found
    } else {
        Vec::new()
    };
    #[cfg(not(feature = "cuda"))]
    let gpus: Vec<std::convert::Infallible> = Vec::new();
    let cuda_serves_gpus = !gpus.is_empty() || !gpu_hosts.is_empty();
    let host_program = config.program_executor.clone().filter(|_| config.opencl_device_host);
    if let (true, Some(program)) = (config.opencl, host_program) {
        let served_by_cuda = |platform: &str| cuda_serves_gpus && platform == agora_devices::opencl::NVIDIA_PLATFORM;
        let spec = host_spec(
            program,
            config.opencl_lanes,
            config.opencl_memory_limit,
            config.opencl_hang_timeout,
            Vec::new(),
        );
        match agora_device_host::list_platforms(&spec.program) {
            Err(problem) => tracing::warn!("{problem}; continuing without OpenCL"),
            Ok(platforms) => {
                let mut next_index = 0;
                for platform in platforms {
                    if served_by_cuda(&platform) {
                        tracing::info!("OpenCL platform {platform} left out: its GPUs are served by the CUDA backend");
                        continue;
                    }
                    let first = next_index;
                    match agora_device_host::start_platform(&spec, &platform, &|i| format!("opencl{}", first + i)) {
                        Ok((found, problems)) => {
                            for problem in problems {
                                tracing::warn!("{problem}; continuing without it");
                            }
                            for device in found {
                                next_index += 1;
                                let lane_watts = config.opencl_power.lane_watts(device.info().lanes);
                                device_ready(&mut devices, &mut facts, Arc::new(device), lane_watts, 8e9);
                            }
                        }
                        Err(problem) => {
                            tracing::warn!("OpenCL platform {platform}: its device host did not start: {problem}; continuing without it")
                        }
                    }
                }
            }
        }
    } else if config.opencl {
        let served_by_cuda = |platform: &str| cuda_serves_gpus && platform == agora_devices::opencl::NVIDIA_PLATFORM;
        let (found, problems) = agora_devices::opencl::discover_except(
            config.opencl_lanes,
            config.opencl_memory_limit,
            &priorities,
            &served_by_cuda,
        );
        for problem in problems {
            tracing::warn!("{problem}; continuing without it");
        }
        for device in found {
            let lane_watts = config.opencl_power.lane_watts(device.info().lanes);
            device_ready(&mut devices, &mut facts, Arc::new(device), lane_watts, 8e9);
        }
    }
    #[cfg(feature = "cuda")]
    for device in gpus {
        let lane_watts = config.cuda_power.lane_watts(device.info().lanes);
        device_ready(&mut devices, &mut facts, Arc::new(device), lane_watts, 25e9);
    }
    #[cfg(feature = "cuda")]
    if let Some(program) = gpu_host_program {
        let limit = config.program_timeout.as_millis().to_string();
        let spec = host_spec(
            program,
            config.cuda_lanes,
            config.cuda_memory_limit,
            config.cuda_hang_timeout,
            vec!["--tenant-launch-limit-ms".into(), limit],
        );
        for (index, gpu) in gpu_hosts.iter().enumerate() {
            match agora_device_host::start_platform(&spec, gpu, &|_| format!("cuda{index}")) {
                Ok((found, problems)) => {
                    for problem in problems {
                        tracing::warn!("{problem}; continuing without it");
                    }
                    for device in found {
                        let lane_watts = config.cuda_power.lane_watts(device.info().lanes);
                        device_ready(&mut devices, &mut facts, Arc::new(device), lane_watts, 25e9);
                    }
                }
                Err(problem) => {
                    tracing::warn!("GPU {gpu}: its device host did not start: {problem}; continuing without it")
                }
            }
        }
    }
    for sim in config.sims.iter().filter(|sim| sim.device_host) {
        // Tests of the device-host mechanism (see `SimDeviceConfig::device_host`).
        let Some(program) = config.program_executor.clone() else {
            return Err(DaemonError::io(
                format!("starting sim device {}", sim.name),
                std::io::Error::other("device_host = true needs an executor binary ([programs] executor)"),
            ));
        };
        let mut extra_args = vec!["--sim-name".to_string(), sim.name.clone()];
        if let Some(after) = sim.fail_after_jobs {
            extra_args.extend(["--sim-fail-after-jobs".to_string(), after.to_string()]);
        }
        if let Some(delay) = sim.answer_delay_ms {
            extra_args.extend(["--sim-answer-delay-ms".to_string(), delay.to_string()]);
        }
        let spec = host_spec(program, sim.lanes, sim.memory, config.opencl_hang_timeout, extra_args);
        let (found, _) =
            agora_device_host::start_platform(&spec, agora_device_host::host::SIM_PLATFORM, &|_| sim.name.clone())
                .map_err(|e| DaemonError::io(format!("starting sim device {}", sim.name), std::io::Error::other(e)))?;
        for device in found {
            tracing::info!(device = %device.info().name, "device ready (in a device host)");
            facts.push(scheduler::DeviceFacts {
                lane_watts: sim.power().lane_watts(sim.lanes),
                bandwidth: sim.bandwidth as f64,
            });
            devices.push(Arc::new(device));
        }
    }
    for sim in config.sims.iter().filter(|sim| !sim.device_host) {
        let spec = agora_devices::sim::SimSpec {
            priorities: priorities.clone(),
            ..sim_spec(sim)
        };
        let device = agora_devices::sim::SimDevice::new(spec)
            .map_err(|e| DaemonError::io(format!("starting sim device {}", sim.name), e))?;
        tracing::info!(
            device = %device.info().name,
            description = %device.info().description,
            lanes = device.info().lanes,
            "device ready"
        );
        facts.push(scheduler::DeviceFacts {
            lane_watts: sim.power().lane_watts(sim.lanes),
            bandwidth: sim.bandwidth as f64,
        });
        devices.push(Arc::new(device));
    }
    // Devices are named in the model, the metrics, `agora drain` and the trace: a `[[sim]]`
    // device named like a real one (`cpu0`) would make one of the two unreachable.
    for (index, device) in devices.iter().enumerate() {
        let name = &device.info().name;
        if devices[..index].iter().any(|d| d.info().name == *name) {
            return Err(DaemonError::io(
                "starting devices",
                std::io::Error::other(format!(
                    "two devices are named {name}: a [[sim]] device may not take the name of another device \
                     (this node's are named cpu0, opencl0.., cuda0..); rename it in the configuration file"
                )),
            ));
        }
    }
    if devices.len() > memory::MAX_DEVICES {
        return Err(DaemonError::io(
            "starting devices",
            std::io::Error::other(format!("at most {} devices are supported", memory::MAX_DEVICES)),
        ));
    }
    let state_dir = config.effective_state_dir();
    let model = load_model(&config, &state_dir);
    let model = Arc::new(std::sync::Mutex::new(model));
    start_model_saver(Arc::downgrade(&model), state_dir);
    if let Some(path) = &config.trace {
        telemetry::TraceRecorder::check_writable(path).map_err(|e| {
            DaemonError::io(
                format!(
                    "writing the trace file {} (give --trace, or [telemetry] trace, a path in a writable directory)",
                    path.display()
                ),
                e,
            )
        })?;
    }
    let trace = config.trace.as_ref().map(|path| {
        tracing::info!(file = %path.display(), capacity = config.trace_capacity, "tracing tasks");
        telemetry::TraceRecorder::new(
            path.clone(),
            config.trace_capacity,
            scheduler::Scheduler::trace_rows(&devices),
        )
    });
    let telemetry = Arc::new(telemetry::Telemetry {
        metrics: telemetry::Metrics::new(),
        trace,
    });
    if let Some(addr) = config.metrics {
        telemetry::serve_metrics(addr, telemetry.clone(), devices.clone())
            .map_err(|e| DaemonError::io("starting the metrics server", std::io::Error::other(e)))?;
    }
    let kernels = Arc::new(
        kernels::KernelRegistry::load(config.kernel_paths.clone())
            .map_err(|e| DaemonError::Packages(format!("kernel packages: {e}")))?,
    );
    config
        .check_kernel_names(&kernels.snapshot())
        .map_err(|e| DaemonError::Packages(e.to_string()))?;
    let checkpoints = checkpoint::Checkpoints::start(&config);
    let scheduler = scheduler::Scheduler::new(
        devices,
        facts,
        policy::build(config.policy, &config),
        model,
        scheduler::SchedulerConfig {
            lane_priorities: priorities.clone(),
            ..scheduler::SchedulerConfig::from_daemon(&config, checkpoints)
        },
        telemetry.clone(),
        kernels.clone(),
    );
    tracing::info!(
        policy = config.policy.name(),
        preempt_target_us = config.preempt_target.as_micros() as u64,
        latency_policy = config.latency_policy.name(),
        latency_sla_ms = config.latency_sla.as_secs_f64() * 1e3,
        batch_priority = %priorities.batch(),
        "scheduling"
    );
    if config.policy == PolicyKind::Energy {
        match telemetry::rapl::unavailable_reason() {
            None => tracing::info!("RAPL energy counters are readable: CPU energy can be measured"),
            Some(reason) => tracing::info!(
                %reason,
                idle_watts = config.cpu_power.idle_watts,
                active_watts = config.cpu_power.active_watts,
                "RAPL energy counters are not readable; the CPU's energy comes from the configured power model"
            ),
        }
    }
    // Bind last: a daemon that fails to start must not leave a socket file behind.
    let (listener, socket_file) = bind(&config.socket, &config.socket_access)?;
    tracing::info!(
        socket = %config.socket.display(),
        access = %config.socket_access,
        kernels = kernels.snapshot().current().len(),
        packages = kernels.snapshot().listing().1.len(),
        "listening"
    );
    let ownership = claims::Ownership {
        socket_file,
        _claims: claims,
    };
    server::Server::new(config, listener, ownership, scheduler, stop, telemetry)
}

/// The OS priority lanes run batch jobs at: `requested`, when a thread of this process can go
/// there and back (tried on a scratch thread); else the setting it falls back to, said in one
/// line (see `agora_devices::priority`): at info level when it falls back to `batch` (what an
/// unprivileged daemon is expected to get), as a warning when not even that works.
fn lane_priorities(requested: agora_devices::priority::BatchPriority) -> agora_devices::priority::LanePriorities {
    use agora_devices::priority::{BatchPriority, LanePriorities};
    let priorities = LanePriorities::resolve(requested);
    if let Some(why) = priorities.fallback() {
        let message = format!(
            "batch_priority \"{requested}\" cannot be used ({why}); lanes run batch work at \"{}\" instead \
             (for \"{requested}\": run as root, grant CAP_SYS_NICE, or raise RLIMIT_NICE to 20, e.g. LimitNICE=20 \
             in systemd)",
            priorities.batch()
        );
        if priorities.batch() == BatchPriority::Normal {
            tracing::warn!("{message}");
        } else {
            tracing::info!("{message}");
        }
    }
    priorities
}

/// The performance model saved in `state_dir`, or an empty one. A daemon whose state directory
/// is its socket's own and has no model there yet starts from the file older versions shared
/// between all daemons (`state_home()/perf-model.json`), if there is one; it saves to its own.
fn load_model(config: &DaemonConfig, state_dir: &Path) -> policy::PerformanceModel {
    let own = policy::PerformanceModel::path(state_dir);
    let shared = policy::PerformanceModel::path(&state_home());
    let from = if config.state_dir.is_none() && !own.exists() && shared.exists() {
        shared
    } else {
        own
    };
    let dir = from.parent().unwrap_or(state_dir);
    match policy::PerformanceModel::load(dir, config.history_weight) {
        Ok(model) => {
            let entries = model.rows().len();
            tracing::info!(file = %from.display(), entries, saved_to = %state_dir.display(), "performance model loaded");
            model
        }
        Err(error) => {
            // State is an optimisation: whatever is wrong with it, the daemon starts.
            tracing::warn!(%error, "starting with an empty performance model");
            let mut model = policy::PerformanceModel::new(config.history_weight);
            if matches!(error, policy::ModelLoadError::Newer { .. }) {
                model.leave_file_alone();
            }
            model
        }
    }
}

/// Logs a discovered device with memory of its own and adds it, with its power and bandwidth
/// estimates for the policies (starting points, not measurements).
fn device_ready(
    devices: &mut Vec<Arc<dyn Device>>,
    facts: &mut Vec<scheduler::DeviceFacts>,
    device: Arc<dyn Device>,
    lane_watts: f64,
    bandwidth: f64,
) {
    tracing::info!(
        device = %device.info().name,
        description = %device.info().description,
        lanes = device.info().lanes,
        memory_mib = device.info().memory_bytes >> 20,
        "device ready"
    );
    facts.push(scheduler::DeviceFacts { lane_watts, bandwidth });
    devices.push(device);
}

/// The device layer's description of a configured sim device.
fn sim_spec(sim: &SimDeviceConfig) -> agora_devices::sim::SimSpec {
    agora_devices::sim::SimSpec {
        name: sim.name.clone(),
        lanes: sim.lanes,
        memory_bytes: sim.memory,
        speed: sim.speed,
        launch_ns: sim.launch_ns,
        profile: sim
            .profile
            .iter()
            .map(|(kernel, p)| {
                (
                    kernel.clone(),
                    agora_devices::sim::KernelProfile {
                        launch_ns: p.launch_ns,
                        ns_per_item: p.ns_per_item,
                    },
                )
            })
            .collect(),
        kernels: sim.kernels.clone(),
        bandwidth: sim.bandwidth as f64,
        fail_after_jobs: sim.fail_after_jobs,
        runtime_memory_bytes: sim.runtime_memory,
        answer_delay: sim.answer_delay_ms.map(std::time::Duration::from_millis),
        ..Default::default()
    }
}

/// Saves the performance model every few seconds while it changes, so a daemon that is killed
/// loses little of what it learned. Ends when the daemon (the model's owner) is gone.
fn start_model_saver(model: std::sync::Weak<std::sync::Mutex<policy::PerformanceModel>>, state_dir: PathBuf) {
    let _ = std::thread::Builder::new()
        .name("agora-model-saver".into())
        .spawn(move || loop {
            for _ in 0..50 {
                std::thread::sleep(std::time::Duration::from_millis(100));
                if model.strong_count() == 0 {
                    return;
                }
            }
            match model.upgrade() {
                Some(model) => scheduler::save_model(&model, &state_dir),
                None => return,
            }
        });
}

/// Runs a daemon in the foreground until SIGINT or SIGTERM: the first signal shuts it down
/// gracefully within about `shutdown_timeout`, a second one exits at once. SIGHUP reloads the
/// kernel packages (as `agora kernels reload`; systemd's `ExecReload`) and nothing else: the
/// configuration file is read at start only. (Its default action, ending the process at once,
/// lost the running work, the trace and the model, and left the socket file behind.)
pub fn run(config: DaemonConfig) -> Result<(), DaemonError> {
    raise_open_file_limit();
    let stop = Arc::new(
        Doorbell::new()
            .map_err(|e| DaemonError::io("creating the stop signal", std::io::Error::other(e.to_string())))?,
    );
    let (reader, writer) = UnixStream::pair().map_err(|e| DaemonError::io("creating the signal pipe", e))?;
    for signal in [signal_hook::consts::SIGINT, signal_hook::consts::SIGTERM] {
        signal_hook::low_level::pipe::register(
            signal,
            writer.try_clone().map_err(|e| DaemonError::io("signal pipe", e))?,
        )
        .map_err(|e| DaemonError::io("installing signal handlers", e))?;
    }
    let (reload_reader, reload_writer) =
        UnixStream::pair().map_err(|e| DaemonError::io("creating the signal pipe", e))?;
    signal_hook::low_level::pipe::register(signal_hook::consts::SIGHUP, reload_writer)
        .map_err(|e| DaemonError::io("installing signal handlers", e))?;
    let mut server = build(config, stop.clone())?;
    // Forward the signal pipe to the stop doorbell so the loop has one stop source (a signal
    // that came while the daemon started waits in the pipe). The first signal starts a graceful
    // shutdown (bounded by `shutdown_timeout`); a second one means the operator will not wait:
    // exit at once.
    let forward = stop;
    let socket = server.socket_file();
    std::thread::Builder::new()
        .name("agora-signals".into())
        .spawn(move || {
            let mut byte = [0u8; 1];
            if std::io::Read::read(&mut &reader, &mut byte).is_ok() {
                tracing::info!("signal received: shutting down (a second signal exits at once)");
                forward.ring();
            }
            if std::io::Read::read(&mut &reader, &mut byte).is_ok() {
                tracing::warn!("second signal: exiting now, without waiting for running work");
                socket.remove();
                std::process::exit(1);
            }
        })
        .map_err(|e| DaemonError::io("starting the signal thread", e))?;
    let kernels = server.kernels();
    std::thread::Builder::new()
        .name("agora-reload".into())
        .spawn(move || {
            let mut byte = [0u8; 1];
            while std::io::Read::read(&mut &reload_reader, &mut byte).is_ok_and(|n| n > 0) {
                let report = kernels.reload();
                for error in &report.errors {
                    tracing::warn!(%error, "kernel package reload (SIGHUP)");
                }
                tracing::info!(
                    packages = report.packages.len(),
                    changed = report.changed.len(),
                    removed = report.removed.len(),
                    kernels = report.kernels,
                    "SIGHUP: kernel packages reloaded (the configuration file is read at start only)"
                );
            }
        })
        .map_err(|e| DaemonError::io("starting the signal thread", e))?;
    server.run()
}

/// Raises the soft limit on open files to the hard one: every connection and session holds
/// descriptors, and the common soft default (1024) would let a few users' idle connections take
/// them all (the per-uid limits assume the daemon has as many as the node allows it).
fn raise_open_file_limit() {
    use rustix::process::{getrlimit, setrlimit, Resource, Rlimit};
    let limit = getrlimit(Resource::Nofile);
    if limit.current < limit.maximum {
        let raised = Rlimit {
            current: limit.maximum,
            maximum: limit.maximum,
        };
        match setrlimit(Resource::Nofile, raised) {
            Ok(()) => tracing::debug!(from = ?limit.current, to = ?limit.maximum, "open-file limit raised"),
            Err(e) => tracing::info!(error = %e, soft = ?limit.current, "could not raise the open-file limit"),
        }
    }
}

/// Starts a daemon on a background thread; it stops when the handle is stopped or dropped.
pub fn spawn(config: DaemonConfig) -> Result<DaemonHandle, DaemonError> {
    let stop = Arc::new(
        Doorbell::new()
            .map_err(|e| DaemonError::io("creating the stop signal", std::io::Error::other(e.to_string())))?,
    );
    let socket = config.socket.clone();
    let mut server = build(config, stop.clone())?;
    let thread = std::thread::Builder::new()
        .name("agora-dispatcher".into())
        .spawn(move || server.run())
        .map_err(|e| DaemonError::io("starting the dispatcher", e))?;
    Ok(DaemonHandle {
        stop,
        thread: Some(thread),
        socket,
    })
}

/// A task failed because the daemon is wrong, not the task: logged with `what` (for the bug
/// report), and reported to the client as `TaskError::Internal(place)` — never as a kernel
/// fault, which would send the user looking for a bug in their kernel.
pub(crate) fn internal_error(place: u16, what: &str) -> agora_protocol::TaskError {
    tracing::error!(
        place,
        what,
        "internal error: a bug of the daemon; please report it with this line"
    );
    agora_protocol::TaskError::Internal(place)
}
