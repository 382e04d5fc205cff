//! Prometheus metrics (prometheus-client), served as text on `/metrics` by a small HTTP thread.

use std::net::SocketAddr;
use std::sync::atomic::AtomicU64;
use std::sync::{Arc, Mutex};

use agora_devices::Device;
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{exponential_buckets, Histogram};
use prometheus_client::registry::Registry;

/// A stretch of the dispatcher's work longer than this counts as a stall (issue 22 item 3c's
/// aim: at most about a millisecond, whatever tenants do).
pub(crate) const STALL_NS: u64 = 1_000_000;

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct TaskLabels {
    kernel: String,
    class: String,
    outcome: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct DeviceLabels {
    device: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct LaneLabels {
    device: String,
    lane: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct LimitLabels {
    limit: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct DagLabels {
    dag: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct DagOutcomeLabels {
    dag: String,
    outcome: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct DirectionLabels {
    direction: String,
}

/// The daemon's metrics.
pub(crate) struct Metrics {
    registry: Mutex<Registry>,
    tasks: Family<TaskLabels, Counter>,
    queue_wait: Family<DeviceLabels, Histogram>,
    execution: Family<DeviceLabels, Histogram>,
    transfer: Family<DeviceLabels, Histogram>,
    bytes: Family<DirectionLabels, Counter>,
    /// Live sessions.
    pub sessions: Gauge,
    /// Sessions opened since start.
    pub sessions_opened: Counter,
    lane_busy: Family<LaneLabels, Gauge<f64, AtomicU64>>,
    lane_queued: Family<LaneLabels, Gauge>,
    lane_completed: Family<LaneLabels, Gauge>,
    memory_used: Family<DeviceLabels, Gauge>,
    memory_cached: Family<DeviceLabels, Gauge>,
    staged: Family<DeviceLabels, Gauge>,
    utilization: Family<DeviceLabels, Gauge>,
    memory_total: Family<DeviceLabels, Gauge>,
    revoked: Counter,
    revoked_wasted_ns: Counter,
    /// The longest task the dispatcher ran inline, seconds (the longest it stalled every tenant
    /// for a task).
    pub longest_inline: Gauge<f64, AtomicU64>,
    /// The dispatcher's longest stretch of work without looking at the rings again (a loop
    /// iteration's dispatching, or its handling of socket events), seconds.
    pub longest_iteration: Gauge<f64, AtomicU64>,
    /// Stretches of the dispatcher's work over [`STALL_NS`], counted: unlike the longest, a
    /// difference of two readings measures one phase of a run (issue 22's aim: none).
    pub stalls: Counter,
    /// 1 while lanes run batch work at `SCHED_IDLE` because latency-class work is live
    /// (`batch_priority = "auto"`), else 0.
    pub batch_lanes_idle: Gauge,
    /// Launches sent to a lane because their shape class was unseen or ran long inline.
    pub inline_refused: Counter,
    /// Times a task waited for device memory instead of failing.
    pub memory_waits: Counter,
    /// Times a checkpoint task waited for the daemon's capture memory.
    pub capture_waits: Counter,
    /// Bytes captured checkpoints hold in the daemon's memory until written (reserved ones
    /// included).
    pub capture_bytes: Gauge,
    /// Buffers evicted from device memory to make room for a task.
    pub evictions: Counter,
    /// Device allocations a runtime refused though they fit the books, retried after eviction.
    pub allocation_retries: Counter,
    /// Tasks that waited for a device host to answer their allocations (the dispatcher did not).
    pub allocations_awaited: Counter,
    /// Buffers released with their newest contents on a device, never read back to the host.
    pub unread_releases: Counter,
    /// Requests and connections refused by each limit (`crate::limits`).
    limit_refusals: Family<LimitLabels, Counter>,
    dag_response: Family<DagLabels, Histogram>,
    dag_releases: Family<DagOutcomeLabels, Counter>,
    dag_overruns: Family<DagLabels, Counter>,
    /// Deadline jobs APEDF pushed off the lane their node was partitioned onto.
    pub dag_migrations: Counter,
    /// Lateness of the release timer (period jitter).
    pub dag_release_jitter: Histogram,
    /// DAGs admitted now.
    pub dags_admitted: Gauge,
}

/// The metric handles of one admitted DAG.
#[derive(Clone)]
pub(crate) struct DagMetrics {
    /// End-to-end response time of each release.
    pub response: Histogram,
    /// Releases that met their deadline.
    pub met: Counter,
    /// Releases that missed it.
    pub missed: Counter,
    /// Releases that had a node fail.
    pub failed: Counter,
    /// Node runs longer than their WCET.
    pub overruns: Counter,
}

/// Cached counters of one (kernel, class): ok and failed.
#[derive(Clone)]
pub(crate) struct TaskCounters {
    /// Completed successfully.
    pub ok: Counter,
    /// Failed.
    pub failed: Counter,
}

fn seconds_histogram() -> Histogram {
    // 1 µs to ~4.5 min in factors of 4.
    Histogram::new(exponential_buckets(1e-6, 4.0, 15))
}

impl Metrics {
    pub(crate) fn new() -> Self {
        let mut registry = Registry::default();
        let tasks = Family::<TaskLabels, Counter>::default();
        registry.register(
            "agora_tasks",
            "Tasks finished, by kernel (or operation), queue class and outcome",
            tasks.clone(),
        );
        let queue_wait = Family::<DeviceLabels, Histogram>::new_with_constructor(seconds_histogram);
        registry.register(
            "agora_task_queue_wait_seconds",
            "Time tasks waited in a lane before starting (inline runs wait 0)",
            queue_wait.clone(),
        );
        let execution = Family::<DeviceLabels, Histogram>::new_with_constructor(seconds_histogram);
        registry.register(
            "agora_task_execution_seconds",
            "Time tasks ran, transfers excluded",
            execution.clone(),
        );
        let transfer = Family::<DeviceLabels, Histogram>::new_with_constructor(seconds_histogram);
        registry.register(
            "agora_task_transfer_seconds",
            "Time a task's transfers took",
            transfer.clone(),
        );
        let bytes = Family::<DirectionLabels, Counter>::default();
        registry.register(
            "agora_transferred_bytes",
            "Bytes moved between host copies and devices",
            bytes.clone(),
        );
        let sessions = Gauge::default();
        registry.register("agora_sessions", "Live client sessions", sessions.clone());
        let sessions_opened = Counter::default();
        registry.register(
            "agora_sessions_opened",
            "Sessions opened since start",
            sessions_opened.clone(),
        );
        let lane_busy = Family::<LaneLabels, Gauge<f64, AtomicU64>>::default();
        registry.register(
            "agora_lane_busy_seconds",
            "Wall time each lane had work in flight since start",
            lane_busy.clone(),
        );
        let lane_queued = Family::<LaneLabels, Gauge>::default();
        registry.register(
            "agora_lane_queued_tasks",
            "Tasks waiting in each lane",
            lane_queued.clone(),
        );
        let lane_completed = Family::<LaneLabels, Gauge>::default();
        registry.register(
            "agora_lane_completed_tasks",
            "Tasks each lane finished since start",
            lane_completed.clone(),
        );
        let memory_used = Family::<DeviceLabels, Gauge>::default();
        registry.register(
            "agora_device_memory_used_bytes",
            "Device memory allocated for buffers",
            memory_used.clone(),
        );
        let memory_cached = Family::<DeviceLabels, Gauge>::default();
        registry.register(
            "agora_device_memory_cached_bytes",
            "Device memory kept for tenants beyond their buffers (a GPU's partitions; given back under pressure)",
            memory_cached.clone(),
        );
        let staged = Family::<DeviceLabels, Gauge>::default();
        registry.register(
            "agora_device_host_staged_bytes",
            "Bytes a device host moved through staging copies since start (host memory it could not map; its devices together)",
            staged.clone(),
        );
        let utilization = Family::<DeviceLabels, Gauge>::default();
        registry.register(
            "agora_device_utilization_percent",
            "Percent of the device's last sample period with a kernel running, anyone's (GPUs, from NVML; absent elsewhere)",
            utilization.clone(),
        );
        let revoked = Counter::default();
        registry.register(
            "agora_revocations",
            "Batch launches revoked for latency-class work (and replayed)",
            revoked.clone(),
        );
        let revoked_wasted_ns = Counter::default();
        registry.register(
            "agora_revoked_work_nanoseconds",
            "Execution time thrown away by revocations",
            revoked_wasted_ns.clone(),
        );
        let unread_releases = Counter::default();
        registry.register(
            "agora_unread_releases",
            "Buffers released with their newest contents on a device, never read back to the host (a missing sync_from?)",
            unread_releases.clone(),
        );
        let memory_total = Family::<DeviceLabels, Gauge>::default();
        registry.register(
            "agora_device_memory_bytes",
            "Device memory (0: computes on host memory)",
            memory_total.clone(),
        );
        let longest_inline = Gauge::<f64, AtomicU64>::default();
        registry.register(
            "agora_dispatcher_longest_inline_seconds",
            "The longest task the dispatcher thread ran inline since start (every tenant waits meanwhile)",
            longest_inline.clone(),
        );
        let longest_iteration = Gauge::<f64, AtomicU64>::default();
        registry.register(
            "agora_dispatcher_longest_iteration_seconds",
            "The dispatcher thread's longest stretch of work since start (dispatching what the rings held, or handling socket events): how long a new task could wait for it",
            longest_iteration.clone(),
        );
        let stalls = Counter::default();
        registry.register(
            "agora_dispatcher_stalls_over_1ms",
            "Stretches of the dispatcher thread's work that took over 1 ms (every tenant's new task waited meanwhile)",
            stalls.clone(),
        );
        let batch_lanes_idle = Gauge::default();
        registry.register(
            "agora_batch_lanes_idle",
            "1 while lanes run batch work at SCHED_IDLE because latency-class work is live (batch_priority auto), else 0",
            batch_lanes_idle.clone(),
        );
        let inline_refused = Counter::default();
        registry.register(
            "agora_inline_refused",
            "Tiny-looking launches sent to a lane because their shape was unseen or ran long inline",
            inline_refused.clone(),
        );
        let memory_waits = Counter::default();
        registry.register(
            "agora_memory_waits",
            "Tasks whose buffers fit their device, but not then, that waited for earlier tasks to free memory (each counted once)",
            memory_waits.clone(),
        );
        let capture_waits = Counter::default();
        registry.register(
            "agora_checkpoint_capture_waits",
            "Checkpoint tasks that waited because other captures, not yet written, filled the daemon's capture memory ([checkpoint] capture_memory)",
            capture_waits.clone(),
        );
        let capture_bytes = Gauge::default();
        registry.register(
            "agora_checkpoint_capture_bytes",
            "Bytes captured checkpoints hold (or have reserved) in the daemon's memory until they are written; at most [checkpoint] capture_memory, or one capture larger than it",
            capture_bytes.clone(),
        );
        let evictions = Counter::default();
        registry.register(
            "agora_evictions",
            "Buffers evicted from device memory to host memory to make room for a task (tenants over their fair share of the device first)",
            evictions.clone(),
        );
        let allocation_retries = Counter::default();
        registry.register(
            "agora_allocation_retries",
            "Device allocations a runtime refused although they fit the daemon's books, retried after evicting idle buffers",
            allocation_retries.clone(),
        );
        let allocations_awaited = Counter::default();
        registry.register(
            "agora_allocations_awaited",
            "Tasks that waited in their queue for a device host to answer their device allocations, asked without stalling the dispatcher",
            allocations_awaited.clone(),
        );
        let limit_refusals = Family::<LimitLabels, Counter>::default();
        registry.register(
            "agora_limit_refusals",
            "Requests and connections refused by a per-uid limit, the control request rate, the hello timeout or the daemon's open-file limit",
            limit_refusals.clone(),
        );
        let dag_response = Family::<DagLabels, Histogram>::new_with_constructor(seconds_histogram);
        registry.register(
            "agora_dag_response_seconds",
            "End-to-end response time of each release of a real-time DAG",
            dag_response.clone(),
        );
        let dag_releases = Family::<DagOutcomeLabels, Counter>::default();
        registry.register(
            "agora_dag_releases",
            "Finished releases of real-time DAGs, by outcome (met, missed, failed)",
            dag_releases.clone(),
        );
        let dag_overruns = Family::<DagLabels, Counter>::default();
        registry.register(
            "agora_dag_overruns",
            "DAG node runs longer than their WCET (the only misses admission does not cover)",
            dag_overruns.clone(),
        );
        let dag_migrations = Counter::default();
        registry.register(
            "agora_dag_migrations",
            "Deadline jobs pushed off their partitioned lane by APEDF",
            dag_migrations.clone(),
        );
        let dag_release_jitter = seconds_histogram();
        registry.register(
            "agora_dag_release_jitter_seconds",
            "Lateness of the daemon's release timer: from a periodic DAG release's due time to its release",
            dag_release_jitter.clone(),
        );
        let dags_admitted = Gauge::default();
        registry.register(
            "agora_dags_admitted",
            "Real-time DAGs admitted now",
            dags_admitted.clone(),
        );
        Metrics {
            dag_response,
            dag_releases,
            dag_overruns,
            dag_migrations,
            dag_release_jitter,
            dags_admitted,
            limit_refusals,
            registry: Mutex::new(registry),
            memory_waits,
            capture_waits,
            capture_bytes,
            evictions,
            allocation_retries,
            allocations_awaited,
            longest_inline,
            longest_iteration,
            stalls,
            batch_lanes_idle,
            inline_refused,
            tasks,
            queue_wait,
            execution,
            transfer,
            bytes,
            sessions,
            sessions_opened,
            lane_busy,
            lane_queued,
            lane_completed,
            memory_used,
            memory_cached,
            staged,
            utilization,
            memory_total,
            revoked,
            revoked_wasted_ns,
            unread_releases,
        }
    }

    /// The metric handles of the DAG named `dag` (cache them: this allocates).
    pub(crate) fn dag_metrics(&self, dag: &str) -> DagMetrics {
        let outcome = |outcome: &str| {
            self.dag_releases
                .get_or_create(&DagOutcomeLabels {
                    dag: dag.into(),
                    outcome: outcome.into(),
                })
                .clone()
        };
        let (met, missed, failed) = (outcome("met"), outcome("missed"), outcome("failed"));
        let response = self.dag_response.get_or_create(&DagLabels { dag: dag.into() }).clone();
        let overruns = self.dag_overruns.get_or_create(&DagLabels { dag: dag.into() }).clone();
        DagMetrics {
            response,
            met,
            missed,
            failed,
            overruns,
        }
    }

    /// The refusal counter of one limit (by its name).
    pub(crate) fn limit_refusals(&self, limit: &str) -> Counter {
        self.limit_refusals
            .get_or_create(&LimitLabels { limit: limit.into() })
            .clone()
    }

    /// Counters for tasks of `kernel` in queues of `class` (cache the result: it allocates).
    // Each lookup is its own statement: `get_or_create` returns a read guard, and a second lookup
    // that inserts while the first guard lives would deadlock on the family's lock.
    pub(crate) fn task_counters(&self, kernel: &str, class: &str) -> TaskCounters {
        let labels = |outcome: &str| TaskLabels {
            kernel: kernel.into(),
            class: class.into(),
            outcome: outcome.into(),
        };
        let ok = self.tasks.get_or_create(&labels("ok")).clone();
        let failed = self.tasks.get_or_create(&labels("error")).clone();
        TaskCounters { ok, failed }
    }

    /// Histograms (queue wait, execution, transfer) of `device`.
    pub(crate) fn device_histograms(&self, device: &str) -> [Histogram; 3] {
        let labels = DeviceLabels { device: device.into() };
        let wait = self.queue_wait.get_or_create(&labels).clone();
        let execution = self.execution.get_or_create(&labels).clone();
        let transfer = self.transfer.get_or_create(&labels).clone();
        [wait, execution, transfer]
    }

    /// Byte counters: host to device, device to host.
    pub(crate) fn byte_counters(&self) -> [Counter; 2] {
        let labels = |d: &str| DirectionLabels { direction: d.into() };
        let to_device = self.bytes.get_or_create(&labels("host_to_device")).clone();
        let to_host = self.bytes.get_or_create(&labels("device_to_host")).clone();
        [to_device, to_host]
    }

    /// Revocation counters.
    pub(crate) fn revocation_counters(&self) -> crate::revocation::RevocationCounters {
        crate::revocation::RevocationCounters {
            revoked: self.revoked.clone(),
            wasted_ns: self.revoked_wasted_ns.clone(),
        }
    }

    /// The text exposition, with device gauges read now.
    pub(crate) fn render(&self, devices: &[Arc<dyn Device>]) -> String {
        for device in devices {
            let status = device.status();
            let d = DeviceLabels {
                device: status.name.clone(),
            };
            self.memory_used.get_or_create(&d).set(status.memory_used as i64);
            self.memory_cached.get_or_create(&d).set(status.memory_cached as i64);
            self.staged.get_or_create(&d).set(status.staged_bytes as i64);
            if let Some(percent) = status.utilization_percent {
                self.utilization.get_or_create(&d).set(i64::from(percent));
            }
            self.memory_total.get_or_create(&d).set(status.memory_bytes as i64);
            for (i, lane) in status.lanes.iter().enumerate() {
                let l = LaneLabels {
                    device: status.name.clone(),
                    lane: i.to_string(),
                };
                self.lane_busy.get_or_create(&l).set(lane.busy_ns as f64 / 1e9);
                self.lane_queued.get_or_create(&l).set(lane.queued as i64);
                self.lane_completed.get_or_create(&l).set(lane.completed as i64);
            }
        }
        let mut out = String::new();
        let registry = self.registry.lock().unwrap_or_else(|e| e.into_inner());
        if prometheus_client::encoding::text::encode(&mut out, &registry).is_err() {
            out.clear();
        }
        out
    }
}

/// Serves `/metrics` on `addr` from a background thread until the process exits.
pub(crate) fn serve(
    addr: SocketAddr,
    telemetry: Arc<super::Telemetry>,
    devices: Vec<Arc<dyn Device>>,
) -> Result<std::thread::JoinHandle<()>, String> {
    let server = tiny_http::Server::http(addr).map_err(|e| format!("cannot listen on {addr} for metrics: {e}"))?;
    tracing::info!(%addr, "metrics on http://{addr}/metrics");
    std::thread::Builder::new()
        .name("agora-metrics".into())
        .spawn(move || {
            for request in server.incoming_requests() {
                let response = if request.url() == "/metrics" {
                    let body = telemetry.metrics.render(&devices);
                    let header = tiny_http::Header::from_bytes(
                        &b"Content-Type"[..],
                        &b"application/openmetrics-text; version=1.0.0; charset=utf-8"[..],
                    )
                    .expect("static header is valid");
                    tiny_http::Response::from_string(body).with_header(header)
                } else {
                    tiny_http::Response::from_string("Agora metrics are at /metrics\n").with_status_code(404)
                };
                let _ = request.respond(response);
            }
        })
        .map_err(|e| e.to_string())
}
