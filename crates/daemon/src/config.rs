//! Daemon settings, each with a default that suits a shared node.

use std::path::PathBuf;
use std::time::Duration;

/// Settings of one daemon.
#[derive(Debug, Clone)]
pub struct DaemonConfig {
    /// Control socket path.
    pub socket: PathBuf,
    /// CPU lanes.
    pub cpu_lanes: usize,
    /// Threads per CPU lane.
    pub cpu_threads_per_lane: usize,
    /// Largest heap a session may have, in bytes (its buffer quota).
    pub session_quota: u64,
    /// Submission and completion ring capacity per session (entries, a power of two).
    pub ring_capacity: u32,
    /// Most queues per session.
    pub max_queues: usize,
    /// Most buffers per session.
    pub max_buffers: usize,
    /// Tasks estimated below this many nanoseconds run inline on the dispatcher thread when their
    /// queue has nothing in flight, skipping the hand-off to a lane. 0 disables inline runs.
    pub inline_max_ns: u64,
    /// Address to serve Prometheus metrics on (`/metrics`), if any.
    pub metrics: Option<std::net::SocketAddr>,
    /// File to write the task trace to (Chrome/Perfetto JSON), if tracing.
    pub trace: Option<PathBuf>,
    /// Most spans the trace keeps (oldest dropped first).
    pub trace_capacity: usize,
    /// Whether to look for OpenCL devices.
    pub opencl: bool,
    /// Lanes (command queues) per OpenCL device.
    pub opencl_lanes: usize,
    /// Longest the dispatcher polls the rings after its last work before it blocks.
    pub max_spin: Duration,
}

impl Default for DaemonConfig {
    fn default() -> Self {
        let (lanes, threads) = agora_devices::cpu::CpuDevice::default_partition();
        DaemonConfig {
            socket: agora_transport::socket::socket_path(None),
            cpu_lanes: lanes,
            cpu_threads_per_lane: threads,
            session_quota: 2 << 30,
            ring_capacity: 1024,
            max_queues: 4096,
            max_buffers: 1 << 16,
            inline_max_ns: 5_000,
            max_spin: Duration::from_micros(200),
            opencl: true,
            metrics: None,
            trace: None,
            trace_capacity: 500_000,
            opencl_lanes: 2,
        }
    }
}
