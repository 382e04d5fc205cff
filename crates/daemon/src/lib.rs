//! The Agora daemon.
//!
//! One process per node owns every device and serves many client processes. Its parts, as in
//! DESIGN.md §3:
//!
//! * [`server`](crate::server) — the dispatcher thread's event loop: accepts clients, answers
//!   control requests, polls session rings, sleeps when idle;
//! * `session` — per-client state (segment, rings, queues, buffers, heap, counters);
//! * `memory` — where buffers live (today: the session heap allocator);
//! * `scheduler` — descriptors → validated tasks → inline runs or device lanes;
//! * [`policy`] — pluggable placement policies (`rr` today);
//! * devices come from `agora-devices`, kernels from `agora-kernels`.
//!
//! Use [`run`] for a foreground daemon that stops on SIGINT/SIGTERM, or [`spawn`] to embed one
//! in another program (as `agora demo` and the tests do).

mod config;
mod handle;
mod memory;
pub mod policy;
mod scheduler;
mod server;
mod session;
mod telemetry;

use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::sync::Arc;

use agora_devices::cpu::CpuDevice;
use agora_devices::Device;
use agora_transport::wake::Doorbell;

pub use config::DaemonConfig;

/// Why the daemon could not start or run.
#[derive(Debug, thiserror::Error)]
pub enum DaemonError {
    /// Another daemon answers on the socket.
    #[error("a daemon is already running on {0}; stop it or pick another path with --socket / AGORA_SOCKET")]
    AlreadyRunning(PathBuf),
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

fn bind(path: &Path) -> Result<UnixListener, DaemonError> {
    if path.exists() {
        if UnixStream::connect(path).is_ok() {
            return Err(DaemonError::AlreadyRunning(path.to_path_buf()));
        }
        // A socket file nobody answers on is left over from a daemon that died: replace it.
        std::fs::remove_file(path)
            .map_err(|e| DaemonError::io(format!("removing stale socket {}", path.display()), e))?;
    }
    if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty() && !d.exists()) {
        use std::os::unix::fs::DirBuilderExt;
        std::fs::DirBuilder::new()
            .recursive(true)
            .mode(0o700)
            .create(dir)
            .map_err(|e| DaemonError::io(format!("creating {}", dir.display()), e))?;
    }
    UnixListener::bind(path).map_err(|e| DaemonError::io(format!("binding {}", path.display()), e))
}

fn build(config: DaemonConfig, stop: Arc<Doorbell>) -> Result<server::Server, DaemonError> {
    let cpu = CpuDevice::new(config.cpu_lanes, config.cpu_threads_per_lane)
        .map_err(|e| DaemonError::io("starting CPU lanes", e))?;
    tracing::info!(
        device = %cpu.info().name,
        lanes = cpu.info().lanes,
        threads_per_lane = cpu.info().threads_per_lane,
        "device ready"
    );
    let mut devices: Vec<Arc<dyn Device>> = vec![Arc::new(cpu)];
    if config.opencl {
        let (found, problems) = agora_devices::opencl::discover(config.opencl_lanes);
        for problem in problems {
            tracing::warn!("{problem}; continuing without it");
        }
        for device in found {
            tracing::info!(
                device = %device.info().name,
                description = %device.info().description,
                lanes = device.info().lanes,
                memory_mib = device.info().memory_bytes >> 20,
                "device ready"
            );
            devices.push(Arc::new(device));
        }
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
    let scheduler = scheduler::Scheduler::new(
        devices,
        Box::new(policy::RoundRobin::default()),
        config.inline_max_ns,
        telemetry.clone(),
    );
    tracing::info!(socket = %config.socket.display(), kernels = agora_kernels::library().len(), "listening");
    // Bind last: a daemon that fails to start must not leave a socket file behind.
    let listener = bind(&config.socket)?;
    server::Server::new(config, listener, scheduler, stop, telemetry)
}

/// Runs a daemon in the foreground until SIGINT or SIGTERM.
pub fn run(config: DaemonConfig) -> Result<(), DaemonError> {
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
    // Forward the signal pipe to the stop doorbell so the loop has one stop source.
    let forward = stop.clone();
    std::thread::Builder::new()
        .name("agora-signals".into())
        .spawn(move || {
            let mut byte = [0u8; 1];
            if std::io::Read::read(&mut &reader, &mut byte).is_ok() {
                tracing::info!("signal received");
                forward.ring();
            }
        })
        .map_err(|e| DaemonError::io("starting the signal thread", e))?;
    let mut server = build(config, stop)?;
    server.run()
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
