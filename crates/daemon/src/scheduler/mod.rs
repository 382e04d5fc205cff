//! The scheduler: turns descriptors from session rings into device jobs, as a pipeline of
//! stages. Read them in the order a task goes through them:
//!
//! 1. `validate` — the descriptor (copied out of the ring once, decoded) becomes a `Ready`
//!    task: handles resolved against the session's own tables, arguments checked against the
//!    kernel's signature and size rule, byte ranges against buffer lengths.
//! 2. `outcome` (the crate's) judges its inputs: a task that reads what a failed task should
//!    have written fails here without running (`Scheduler::dispatch`).
//! 3. `migration` — a queue being moved holds its tasks, in order, until its in-flight ones are
//!    done; its held and lost tasks come back through `dispatch`.
//! 4. `place` — where it runs (`Placement`): inline on this thread for a tiny task whose data
//!    is on the host, the lane its queue is bound to while the queue has work in flight (so
//!    issue order holds), else the lane the [`Policy`] picks among the devices that implement the
//!    kernel and take the launch within their limits (late binding; the queue's preferred kind
//!    first), or latency placement; and the revocation choice for latency work.
//! 5. `plan` — what it needs there (`Planned`): room in device memory, the transfers, the
//!    one-writer rule, the work; slicing (chunked launch) and revocability. On a device in a
//!    device host, buffers not there yet are allocated first without the dispatcher waiting
//!    (`allocation`): the task waits in its queue's held tasks and comes back through `dispatch`.
//! 6. `submit` — run inline, or hand the job to the lane (one job, row slices, or revocable).
//! 7. `complete` — when a lane job ends: metrics, model, trace, then in queue order the
//!    outcome and the completion posted to the client (`LaneCompletion::finish`).
//!
//! `books` holds the latency-class bookkeeping the place stage reads (urgent work per lane,
//! TReM's `q` and `l`, the victims).
//!
//! Device limits: a launch goes only to a device whose limits take it (`Device::check_launch`,
//! at binding time, before anything reaches the device): the check says how many row slices
//! (enqueues) it needs there at least, and the launch runs as at least that many. A launch that no
//! capable device takes completes with `TaskError::DeviceLimit` naming the limit; a busy queue
//! whose bound device cannot take its next launch moves, as for a kernel the device lacks.
//!
//! A descriptor that fails any check completes with a [`TaskError`] naming the problem; nothing a
//! client writes can stop the loop. Inline completions are batched and flushed before anything is
//! handed to a lane, so a queue's completions reach its ring in issue order.
//!
//! Must not contain vendor code: devices are reached only through the `Device` trait.

use std::sync::atomic::Ordering;
use std::sync::Arc;

use agora_devices::priority::{BatchPriority, LanePriorities};
use agora_devices::{Device, DeviceKind};
use agora_protocol::descriptor::Decoded;
use agora_protocol::ring::RingError;
use agora_protocol::{Completion, Op, TaskError, MAX_ARGS};

use crate::kernels::{KernelRegistry, KernelTable};
use crate::memory::Residency;
use crate::outcome::{FaultInjection, Role, Uses};
use crate::policy::latency::LatencyPolicy;
use crate::policy::{Candidate, PerformanceModel, Policy};
use crate::revocation::RevocationCounters;
use crate::session::{QueueState, Session, SessionShared};
use crate::telemetry::{TaskCounters, Telemetry};
use agora_protocol::control::QueueClass;
use books::LatencyBooks;
use migration::Answers;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::histogram::Histogram;
use std::collections::HashMap;
use std::sync::atomic::AtomicU64;
use std::sync::Mutex;
use std::time::Instant;

mod allocation;
mod books;
// The validate stage driven without a server, for the fuzzer (`agora_daemon::fuzzing`).
mod complete;
pub(crate) mod fuzzing;
mod inline;
mod migration;
mod place;
mod plan;
mod submit;
mod tenants;
mod validate;

pub(crate) use migration::Migration;
use validate::{data_roles, resolve, written_by_refused, Action, Ready};

/// What the scheduler knows of each device beyond the `Device` trait (from the configuration).
#[derive(Debug, Clone, Copy)]
pub(crate) struct DeviceFacts {
    /// Extra watts one busy lane draws.
    pub lane_watts: f64,
    /// Bytes per second between host memory and the device.
    pub bandwidth: f64,
}

/// Most descriptors taken from one session before the scheduler looks at the next session.
const BATCH: u32 = 256;

/// Most slices one chunked launch is split into.
const MAX_SLICES: u64 = 4096;

/// How long after its last task latency-class work still counts as live (`auto` batch lanes at
/// `idle`): long enough that a tenant sending requests a few times a second keeps the cores
/// between them (its client's own work competes with the lanes too), short enough that batch
/// work gets its priority back soon after the latency tenant stops.
const LATENCY_LIVE_HOLD: std::time::Duration = std::time::Duration::from_secs(1);

/// Longest predicted time of one job, nanoseconds (2^50, 13 days).
const MAX_PREDICTED_NS: f64 = (1u64 << 50) as f64;

/// Scheduler state owned by the dispatcher thread.
pub(crate) struct Scheduler {
    pub devices: Vec<Arc<dyn Device>>,
    policy: Box<dyn Policy>,
    /// Its settings, fixed at start.
    config: SchedulerConfig,
    inline_done: Vec<Completion>,
    candidates: Vec<Candidate>,
    telemetry: Arc<Telemetry>,
    /// Cached metric handles (looking one up allocates).
    /// Keyed by the operation name's address (names are `'static`), hashed cheaply: this is on
    /// the per-task path.
    counters: HashMap<(usize, QueueClass), TaskCounters, rustc_hash::FxBuildHasher>,
    histograms: Vec<Arc<[Histogram; 3]>>,
    bytes: [Counter; 2],
    /// Trace row of each device's lane 0 (lanes follow).
    first_row: Vec<u32>,
    /// Each device's name, shared by its lane jobs' completions (one allocation per device, not
    /// per job).
    device_names: Vec<Arc<str>>,
    /// The learned performance model (fed by every finished launch, read by policies).
    pub model: Arc<Mutex<PerformanceModel>>,
    facts: Vec<DeviceFacts>,
    /// Predicted nanoseconds of work queued or running, per device and lane.
    lane_pending: Vec<Vec<Arc<AtomicU64>>>,
    /// Whose work that is, per device and lane (a newcomer's wait under fair queueing).
    lane_tenants: Vec<Vec<Arc<tenants::LaneTenants>>>,
    /// Which buffers have device copies (eviction).
    pub residency: Residency,
    /// Host memory registered with devices, per user.
    pinned: Arc<crate::memory::pinned::PinnedBooks>,
    /// Device allocations a runtime refused though they fit the books, retried after eviction.
    pub allocation_retries: u64,
    /// Latency-class work per lane and in all, and the victims revocation may pick.
    books: LatencyBooks,
    /// Which launches may run inline (shape classes measured short).
    inline_guard: Arc<inline::InlineGuard>,
    revocation_counters: RevocationCounters,
    /// Queues being moved, draining and failed devices, lost tasks.
    pub migration: Migration,
    /// The kernels of the library and the packages (the control thread reloads them).
    pub kernels: Arc<KernelRegistry>,
    /// The snapshot launches are validated against, and the registry generation it is from.
    kernel_table: (Arc<KernelTable>, u64),
    /// Under `batch_priority = "auto"`: until when latency-class work counts as live (batch lanes
    /// at `idle`), [`LATENCY_LIVE_HOLD`] after the last latency-class task; `None` while it is not.
    latency_live_until: Option<Instant>,
    /// The dispatcher's clock, read once per iteration of its loop ([`Scheduler::tick`]).
    now: Instant,
    /// Switches of `auto` batch lanes between `batch` and `idle` since start.
    pub batch_priority_switches: u64,
    /// Set while a DAG node job goes through the stages ([`Scheduler::dispatch_node_job`]): the
    /// lane APEDF chose and the job's absolute deadline.
    deadline_job: Option<(crate::session::Binding, std::time::Instant)>,
    /// The device quota of the session whose task goes through the stages now (0: none), for
    /// placement: a device the task's buffers can never fit is no candidate.
    dispatch_quota: u64,
    /// That session's id, for placement (its own work on a lane, and its neighbours').
    dispatch_session: u64,
    /// The capture memory reserved for the checkpoint task being planned now (taken by its
    /// capture; dropped, so given back, if planning fails).
    capture_reserved: Option<crate::checkpoint::CaptureReservation>,
}

/// Predicted work on one lane beyond which it counts as long ([`Scheduler::long_work_on_lanes`]):
/// far beyond a round trip, well below a time slice.
const LONG_WORK_NS: u64 = 200_000;

/// The scheduler's settings, built once from the daemon's configuration.
#[derive(Debug, Clone)]
pub(crate) struct SchedulerConfig {
    /// Tasks estimated below this many nanoseconds run inline when their queue is idle (0:
    /// never).
    pub inline_max_ns: f64,
    /// Per-session device-memory quota in bytes (0: none).
    pub device_quota: u64,
    /// Target preemption latency of chunked launches, nanoseconds (0: no chunking).
    pub preempt_target_ns: f64,
    /// How latency-class work is protected (placement, reservation, revocation).
    pub latency_policy: LatencyPolicy,
    /// Response-time target of latency queues that set none, nanoseconds.
    pub default_sla_ns: f64,
    /// Shortest predicted batch launch made revocable, nanoseconds.
    pub revoke_min_ns: f64,
    /// Largest share of a launch's predicted time its save may cost for it to run revocable.
    pub revoke_max_save_share: f64,
    /// Test-only: tasks picked to fail (`DaemonConfig::inject_faults`).
    pub faults: Option<FaultInjection>,
    /// Most host memory one user may have registered with GPUs (0: half the host's).
    pub pinned_limit_per_user: u64,
    /// The checkpoint service that takes `Checkpoint` tasks (`None`: they are refused).
    pub checkpoints: Option<Arc<crate::checkpoint::Checkpoints>>,
    /// The OS priority lanes run batch work at (the resolved `batch_priority`). While it is
    /// `idle` their long work holds no core against a client or the dispatcher, which preempt it
    /// at once; under `auto` the scheduler switches it as latency-class work comes and goes.
    pub lane_priorities: LanePriorities,
}

impl SchedulerConfig {
    /// The scheduler's part of the daemon's configuration, with the daemon's checkpoint service.
    pub(crate) fn from_daemon(
        config: &crate::config::DaemonConfig,
        checkpoints: Arc<crate::checkpoint::Checkpoints>,
    ) -> Self {
        SchedulerConfig {
            inline_max_ns: config.inline_max_ns as f64,
            device_quota: config.device_quota,
            preempt_target_ns: config.preempt_target.as_nanos() as f64,
            latency_policy: config.latency_policy,
            default_sla_ns: config.latency_sla.as_nanos() as f64,
            revoke_min_ns: config.revoke_min.as_nanos() as f64,
            revoke_max_save_share: config.revoke_max_save_share,
            faults: FaultInjection::new(config.inject_faults),
            pinned_limit_per_user: config.cuda_pinned_limit_per_user,
            checkpoints: Some(checkpoints),
            // Set by the daemon to the priorities lanes really got (`LanePriorities::resolve`).
            lane_priorities: LanePriorities::normal(),
        }
    }
}

fn class_name(class: QueueClass) -> &'static str {
    match class {
        QueueClass::Batch => "batch",
        QueueClass::Latency => "latency",
    }
}

impl Scheduler {
    pub(crate) fn new(
        devices: Vec<Arc<dyn Device>>,
        facts: Vec<DeviceFacts>,
        policy: Box<dyn Policy>,
        model: Arc<Mutex<PerformanceModel>>,
        config: SchedulerConfig,
        telemetry: Arc<Telemetry>,
        kernels: Arc<KernelRegistry>,
    ) -> Self {
        let per_lane = || -> Vec<Vec<Arc<AtomicU64>>> {
            devices
                .iter()
                .map(|d| (0..d.info().lanes).map(|_| Arc::new(AtomicU64::new(0))).collect())
                .collect()
        };
        let lane_pending = per_lane();
        let lane_tenants = devices
            .iter()
            .map(|d| (0..d.info().lanes).map(|_| Arc::default()).collect())
            .collect();
        let books = LatencyBooks::new(&devices);
        let inline_guard = Arc::new(inline::InlineGuard::new(
            config.inline_max_ns,
            telemetry.metrics.longest_inline.clone(),
            telemetry.metrics.inline_refused.clone(),
        ));
        let revocation_counters = telemetry.metrics.revocation_counters();
        let histograms = devices
            .iter()
            .map(|d| Arc::new(telemetry.metrics.device_histograms(&d.info().name)))
            .collect();
        let mut first_row = Vec::new();
        let mut row = 1u32;
        for d in &devices {
            first_row.push(row);
            row += d.info().lanes as u32;
        }
        let bytes = telemetry.metrics.byte_counters();
        let migration = Migration::new(devices.clone());
        let mut residency = Residency::default();
        let waker = migration.drain_waker();
        residency.set_waker(crate::memory::Waker(Arc::new(move || waker.wake_dispatcher())));
        let device_names = devices.iter().map(|d| Arc::from(d.info().name.as_str())).collect();
        let pinned = crate::memory::pinned::PinnedBooks::new(config.pinned_limit_per_user);
        Scheduler {
            device_names,
            devices,
            policy,
            config,
            inline_done: Vec::new(),
            candidates: Vec::new(),
            telemetry,
            counters: HashMap::default(),
            histograms,
            bytes,
            first_row,
            model,
            facts,
            lane_pending,
            lane_tenants,
            residency,
            pinned,
            allocation_retries: 0,
            books,
            inline_guard,
            revocation_counters,
            migration,
            kernel_table: (kernels.snapshot(), kernels.generation()),
            kernels,
            latency_live_until: None,
            now: Instant::now(),
            batch_priority_switches: 0,
            deadline_job: None,
            dispatch_quota: 0,
            dispatch_session: 0,
            capture_reserved: None,
        }
    }

    /// Once per iteration of the dispatcher's loop, with the time it began: under `auto`, batch
    /// lanes go back to `batch` once latency-class work has been quiet for [`LATENCY_LIVE_HOLD`].
    #[inline]
    pub(crate) fn tick(&mut self, now: Instant) {
        self.now = now;
        if self.latency_live_until.is_some_and(|until| now >= until) {
            self.latency_live_until = None;
            self.switch_batch_priority(false);
        }
    }

    /// When the dispatcher must look at the clock again for [`Scheduler::tick`] (while latency
    /// work counts as live), if ever.
    pub(crate) fn next_tick(&self) -> Option<Instant> {
        self.latency_live_until
    }

    /// A latency-class task arrived: under `auto`, batch lanes run at `idle` from now until
    /// latency work has been quiet for [`LATENCY_LIVE_HOLD`].
    #[inline]
    fn latency_seen(&mut self) {
        if self.config.lane_priorities.batch() != BatchPriority::Auto {
            return;
        }
        if self.latency_live_until.is_none() {
            self.switch_batch_priority(true);
        }
        self.latency_live_until = Some(self.now + LATENCY_LIVE_HOLD);
    }

    fn switch_batch_priority(&mut self, latency_live: bool) {
        if self.config.lane_priorities.set_latency_live(latency_live) {
            self.batch_priority_switches += 1;
            self.telemetry.metrics.batch_lanes_idle.set(i64::from(latency_live));
            tracing::debug!(latency_live, "batch lanes switched (batch_priority auto)");
        }
    }

    /// Whether some lane holds long work (at least [`LONG_WORK_NS`] predicted, queued or
    /// running): then the node's cores are busy with our own kernels, and a dispatcher that
    /// yielded its core while it waits would hand it to them for a whole time slice.
    pub(crate) fn long_work_on_lanes(&self) -> bool {
        self.lane_pending
            .iter()
            .flatten()
            .any(|pending| pending.load(Ordering::Relaxed) >= LONG_WORK_NS)
    }

    /// Host cores our own long work holds: for every lane with long work (at least
    /// [`LONG_WORK_NS`] predicted) queued or running, the cores its device's kernels run on
    /// (`DeviceInfo::host_cores_per_lane`: a CPU lane's threads, PoCL's compute units, none for
    /// a GPU). CPU lanes count none while batch lanes run at `SCHED_IDLE`: any normal thread
    /// takes their core at once (long latency-class work, which runs at normal priority, is rare
    /// enough to leave out). An OpenCL runtime's threads are its own, at normal priority.
    pub(crate) fn cores_held_by_long_work(&self) -> usize {
        let batch_lanes_idle = self.config.lane_priorities.batch_now() == BatchPriority::Idle;
        self.devices
            .iter()
            .zip(&self.lane_pending)
            .filter(|(device, _)| !(batch_lanes_idle && device.info().kind == DeviceKind::Cpu))
            .map(|(device, lanes)| {
                let busy = lanes
                    .iter()
                    .filter(|pending| pending.load(Ordering::Relaxed) >= LONG_WORK_NS)
                    .count();
                busy * device.info().host_cores_per_lane
            })
            .sum()
    }

    /// Whether some lane has a job queued or running.
    pub(crate) fn lanes_have_jobs(&self) -> bool {
        self.devices
            .iter()
            .any(|device| (0..device.info().lanes).any(|lane| device.lane_load(lane) > 0))
    }

    /// Trace row names: the dispatcher, then every lane.
    pub(crate) fn trace_rows(devices: &[Arc<dyn Device>]) -> Vec<String> {
        let mut rows = vec!["dispatcher (inline)".to_string()];
        for d in devices {
            for lane in 0..d.info().lanes {
                rows.push(format!("{}/lane{lane}", d.info().name));
            }
        }
        rows
    }

    fn task_counters(&mut self, name: &'static str, class: QueueClass) -> &TaskCounters {
        let metrics = &self.telemetry.metrics;
        self.counters
            .entry((name.as_ptr() as usize, class))
            .or_insert_with(|| metrics.task_counters(name, class_name(class)))
    }

    /// Revocations since start and the execution time they threw away, seconds.
    pub(crate) fn revocations(&self) -> (u64, f64) {
        let c = &self.revocation_counters;
        (c.revoked.get(), c.wasted_ns.get() as f64 / 1e9)
    }

    /// Watts one busy lane of device `device` draws, by the power model.
    pub(crate) fn lane_watts(&self, device: usize) -> f64 {
        self.facts.get(device).map_or(0.0, |f| f.lane_watts)
    }

    /// Whether held tasks wait for something that does not wake the dispatcher when it comes
    /// (their queue's tasks in flight), so it must come back soon. Allocations' and evictions'
    /// answers ring its doorbell.
    pub(crate) fn holding(&self) -> bool {
        self.migration.needs_polling()
    }

    /// Its settings.
    pub(crate) fn config(&self) -> &SchedulerConfig {
        &self.config
    }

    pub(crate) fn policy_name(&self) -> &'static str {
        self.policy.name()
    }

    /// The checkpoint service (for the control requests that protect and recover).
    pub(crate) fn checkpoints(&self) -> Option<&Arc<crate::checkpoint::Checkpoints>> {
        self.config.checkpoints.as_ref()
    }

    /// Writes the performance model to `state_dir` if it changed.
    pub(crate) fn save_model(&self, state_dir: &std::path::Path) {
        save_model(&self.model, state_dir);
    }

    /// Takes what the session's ring holds (up to admission control and one batch).
    /// Returns how many descriptors were taken, or the ring's corruption.
    pub(crate) fn ingest(&mut self, session: &mut Session) -> Result<u32, RingError> {
        // Queues being moved whose in-flight tasks have finished go first: their tasks are older.
        self.release_held(session);
        // Releases of buffers never read back count in the daemon's metrics too (no buffer can
        // hold device-only contents before a session's first descriptor).
        let metrics = &self.telemetry.metrics;
        session
            .shared
            .unread
            .daemon
            .get_or_init(|| metrics.unread_releases.clone());
        let available = session.submissions.available()?;
        let n = available.min(session.admission_room()).min(BATCH);
        let mut taken = 0;
        for _ in 0..n {
            // Back-pressure: over its lane limits, the session's ring stays full and its client
            // waits (a lane job that makes room wakes us).
            if !session.lane_admits_head() {
                break;
            }
            taken += 1;
            let descriptor = session.submissions.take();
            // Released before the task can act: a descriptor past the head was never acted on,
            // so a client whose daemon dies may issue it again on the next one (a resume
            // replays what was not taken) without running anything twice. One store per task;
            // the client reads the head only when it stages.
            session.submissions.release();
            session.ingested = session.ingested.wrapping_add(1);
            session.submitted += 1;
            let task_id = descriptor.task_id;
            let outcome = descriptor.decode().and_then(|d| self.admit(session, &d));
            if let Err(error) = outcome {
                self.inline_done.push(Completion::failed(task_id, error));
                self.task_counters("invalid", QueueClass::Batch).failed.inc();
            }
        }
        if taken > 0 {
            self.flush(&session.shared);
        }
        Ok(taken)
    }

    fn flush(&mut self, shared: &SessionShared) {
        shared.post(&self.inline_done);
        self.inline_done.clear();
    }

    /// Checks a DAG node's launch at declaration, as the validate stage would check it, for
    /// device `device` (the deadline lanes'): `Ok` with the performance model's estimate of its
    /// time there, nanoseconds (`None`: never measured), or the error its first release would
    /// fail with.
    pub(crate) fn check_node_launch(
        &mut self,
        session: &Session,
        descriptor: &agora_protocol::TaskDescriptor,
        device: usize,
    ) -> Result<Option<f64>, TaskError> {
        let decoded = descriptor.decode()?;
        if decoded.op != Op::Launch {
            return Err(TaskError::Malformed(agora_protocol::completion::Malformed::UnknownOp(
                descriptor.op,
            )));
        }
        let generation = self.kernels.generation();
        if generation != self.kernel_table.1 {
            self.kernel_table = (self.kernels.snapshot(), generation);
        }
        let ready = resolve(session, &self.kernel_table.0, &decoded)?;
        let Some(kernel) = ready.kernel() else {
            return Err(TaskError::UnknownKernel(decoded.kernel));
        };
        if !self.devices[device].implements(kernel) {
            return Err(TaskError::NoDevice(decoded.kernel));
        }
        self.fit(device, &ready)?;
        let model = self.model.lock().unwrap_or_else(|e| e.into_inner());
        Ok(model
            .estimate(kernel.label(), &self.device_names[device], ready.items)
            .ns())
    }

    /// Runs a DAG node job (from the real-time service) through the stages like a client's task,
    /// on its chosen lane with its deadline; an error completes it (to its release) at once.
    /// Returns the error of a launch that no longer resolves (a buffer of it was released, say):
    /// the DAG cannot run again.
    pub(crate) fn dispatch_node_job(
        &mut self,
        session: &mut Session,
        job: &crate::realtime::NodeJob,
    ) -> Option<TaskError> {
        let descriptor = job.descriptor;
        let task_id = descriptor.task_id;
        let mut unresolved = None;
        let outcome = descriptor.decode().and_then(|decoded| {
            let generation = self.kernels.generation();
            if generation != self.kernel_table.1 {
                self.kernel_table = (self.kernels.snapshot(), generation);
            }
            let ready = resolve(session, &self.kernel_table.0, &decoded).inspect_err(|e| unresolved = Some(*e))?;
            self.deadline_job = Some((job.lane, job.deadline));
            let dispatched = self.dispatch(session, task_id, ready);
            self.deadline_job = None;
            dispatched
        });
        if let Err(error) = outcome {
            self.inline_done.push(Completion::failed(task_id, error));
        }
        self.flush(&session.shared);
        unresolved
    }

    /// Resolves and dispatches one decoded descriptor; `Err` completes it with that error.
    fn admit(&mut self, session: &mut Session, d: &Decoded<'_>) -> Result<(), TaskError> {
        match d.op {
            Op::ReleaseBuffer => {
                let handle = d.buffer_arg(0)?;
                if !session.release_buffer(handle) {
                    return Err(TaskError::InvalidHandle { index: 0, handle });
                }
                self.inline_done.push(Completion::ok(d.task_id));
                Ok(())
            }
            Op::ReleaseQueue => {
                session.queues.remove(d.queue).ok_or(TaskError::UnknownQueue(d.queue))?;
                self.inline_done.push(Completion::ok(d.task_id));
                Ok(())
            }
            Op::ReleaseProgram => {
                // Launches issued before it resolved their kernels already (the ring's order),
                // and hold them: the executor keeps the code until they are done.
                if !session.programs.as_ref().is_some_and(|p| p.release(d.kernel)) {
                    return Err(TaskError::UnknownKernel(d.kernel));
                }
                self.inline_done.push(Completion::ok(d.task_id));
                Ok(())
            }
            _ => {
                let generation = self.kernels.generation();
                if generation != self.kernel_table.1 {
                    self.kernel_table = (self.kernels.snapshot(), generation);
                }
                let ready = match resolve(session, &self.kernel_table.0, d) {
                    Ok(ready) => ready,
                    // Refused: what it would have written is poisoned, in its queue's order.
                    Err(error) => {
                        return match written_by_refused(session, &self.kernel_table.0, d) {
                            Some(written) => {
                                let roles = data_roles(&written);
                                self.fail_ready(session, d.task_id, written, roles, error)
                            }
                            None => Err(error),
                        }
                    }
                };
                self.dispatch(session, d.task_id, ready)
            }
        }
    }

    /// Dispatches a resolved task, judging first whether its inputs are valid (`outcome`): a
    /// task fed by a failed one fails here without running. A task that fails before it reaches
    /// a device still settles in its queue's order (poisoning what it would have written):
    /// at once when the queue has nothing in flight, else after the queue's earlier jobs.
    #[inline]
    fn dispatch(&mut self, session: &Session, task_id: u64, ready: Ready) -> Result<(), TaskError> {
        let roles = data_roles(&ready);
        let uses = Uses {
            buffers: &ready.buffers[..ready.slots],
            roles: &roles[..ready.slots],
        };
        let mut admitted = uses.admit(task_id);
        if self.migration.any_failed {
            // Data lost with a failed device says more than a failure it caused.
            admitted = migration::check_lost(&ready).and(admitted);
        }
        match admitted {
            Ok(()) => self.place_and_submit(session, task_id, ready, roles),
            // Held behind the queue's earlier tasks: judged again when released.
            Err(_) if self.migration.is_held(session.id, &ready.queue) => {
                self.place_and_submit(session, task_id, ready, roles)
            }
            Err(error) => self.fail_ready(session, task_id, ready, roles, error),
        }
    }

    /// `ready` failed before reaching a device: settles it (see [`Scheduler::fail`]).
    fn fail_ready(
        &mut self,
        session: &Session,
        task_id: u64,
        ready: Ready,
        roles: [Role; MAX_ARGS],
        error: TaskError,
    ) -> Result<(), TaskError> {
        let queue = ready.queue.clone();
        let (buffers, slots) = (ready.buffers, ready.slots);
        self.fail(session, task_id, &queue, error, move |task, result| {
            Uses {
                buffers: &buffers[..slots],
                roles: &roles[..slots],
            }
            .settle(task, result)
        })
    }

    /// A task failed with `error` before reaching a device: it still settles in its queue's
    /// order (poisoning what it would have written, through `settle`) — at once when the queue
    /// has nothing in flight (then `Err` completes it), else after the queue's earlier jobs.
    fn fail(
        &mut self,
        session: &Session,
        task_id: u64,
        queue: &Arc<QueueState>,
        error: TaskError,
        settle: impl FnOnce(u64, Result<(), TaskError>) -> Result<(), TaskError> + Send + 'static,
    ) -> Result<(), TaskError> {
        if queue.in_flight.load(Ordering::Acquire) == 0 {
            return settle(task_id, Err(error));
        }
        // Counted in flight until it settles, so nothing runs inline ahead of it.
        queue.in_flight.fetch_add(1, Ordering::AcqRel);
        session.shared.in_flight.fetch_add(1, Ordering::Relaxed);
        self.flush(&session.shared);
        let shared = session.shared.clone();
        let waker = self.migration.drain_waker();
        let sequence = queue.sequencer.ticket();
        let settling = queue.clone();
        queue.sequencer.in_order(sequence, move || {
            let error = settle(task_id, Err(error)).err().unwrap_or(error);
            let mut drained = false;
            shared.post_releasing(&[Completion::failed(task_id, error)], || {
                drained = settling.in_flight.fetch_sub(1, Ordering::AcqRel) == 1;
            });
            shared.in_flight.fetch_sub(1, Ordering::Relaxed);
            waker.queue_drained(&settling, drained);
        });
        Ok(())
    }

    /// The stages after validation, in order: place, plan, then run inline or submit to the
    /// lane (whose completion is `complete`'s). A failure settles through `fail`.
    #[inline]
    fn place_and_submit(
        &mut self,
        session: &Session,
        task_id: u64,
        ready: Ready,
        roles: [Role; MAX_ARGS],
    ) -> Result<(), TaskError> {
        if ready.queue.class == QueueClass::Latency {
            self.latency_seen();
        }
        self.dispatch_quota = self.device_quota(session);
        self.dispatch_session = session.id;
        // A queue being moved holds its tasks, in order, until its in-flight ones are done.
        match self.must_hold(session.id, &ready) {
            Ok(true) => {
                self.hold(session, task_id, ready);
                return Ok(());
            }
            Ok(false) => {}
            Err(error) => return self.fail_ready(session, task_id, ready, roles, error),
        }
        // A buffer it names is being written home by an eviction that did not wait.
        if self.residency.writing_back() {
            if let Some(records) = allocation::written_back(&ready) {
                self.wait_for_answers(session, task_id, ready, Answers::WriteBacks(records));
                return Ok(());
            }
        }
        let placement = match self.place(&ready) {
            Ok(placement) => placement,
            Err(error) => return self.fail_ready(session, task_id, ready, roles, error),
        };
        let mut waits_if_refused = None;
        match self.room(session, &ready, &placement) {
            Ok(plan::Room::Now) => {}
            // Rare (only tasks that move data to a device): kept to wait with, should the
            // device runtime refuse the allocation after all.
            Ok(plan::Room::NowAllocating) => {
                // On a device host: asked ahead, the task (not the dispatcher) waits for them.
                if let Some(wait) = self.allocate_later(&ready, &placement) {
                    self.wait_for_answers(session, task_id, ready, Answers::Allocations(wait));
                    return Ok(());
                }
                waits_if_refused = Some(ready.clone())
            }
            // Evictions to make its room are writing buffers home (a device in a device host):
            // it waits for them, not the dispatcher.
            Ok(plan::Room::AfterWriteBacks(records)) => {
                self.wait_for_answers(session, task_id, ready, Answers::WriteBacks(records));
                return Ok(());
            }
            Ok(plan::Room::Later) => {
                // Memory pressure: it waits (with its queue's later tasks) until earlier tasks
                // finish and their buffers can be evicted; only a task that can never fit fails.
                self.wait_for_room(session, task_id, ready);
                return Ok(());
            }
            Err(error) => return self.fail_ready(session, task_id, ready, roles, error),
        }
        // A checkpoint's capture holds a copy of its buffers in the daemon until the writer is
        // done with it: it waits while other captures fill the daemon's capture memory.
        if let (Action::Checkpoint { .. }, Some(service)) = (&ready.action, &self.config.checkpoints) {
            let bytes: u64 = ready.buffers[..ready.slots]
                .iter()
                .flatten()
                .map(|(r, _, _)| r.len)
                .sum();
            match service.reserve_capture(bytes) {
                Some(reservation) => self.capture_reserved = Some(reservation),
                None => {
                    let memory = service.capture_memory().clone();
                    self.telemetry.metrics.capture_waits.inc();
                    self.wait_for_answers(session, task_id, ready, Answers::CaptureMemory(memory, bytes));
                    return Ok(());
                }
            }
        }
        self.revoke_for(&ready, &placement);
        let queue = ready.queue.clone();
        let planned = self.plan_task(session, task_id, ready, roles, &placement);
        // Not taken by a capture: planning failed (or this is no checkpoint).
        self.capture_reserved = None;
        let planned = match planned {
            Ok(Some(planned)) => planned,
            // Its device failed while it was planned: it went back for replay.
            Ok(None) => return Ok(()),
            // The runtime refused its memory even after eviction (the books said it fits):
            // buffers other tasks hold take the room; it waits for them like a `Later`.
            Err(plan::Failed {
                error: TaskError::DeviceOutOfMemory { .. },
                named: Some(named),
            }) if waits_if_refused.is_some() => {
                drop(named);
                if let Some(ready) = waits_if_refused {
                    self.wait_for_room(session, task_id, ready);
                }
                return Ok(());
            }
            Err(plan::Failed {
                error,
                named: Some(named),
            }) => {
                return self.fail(session, task_id, &queue, error, move |task, result| {
                    named.settle(task, result)
                })
            }
            Err(plan::Failed { error, named: None }) => return Err(error),
        };
        if self.runs_inline(&placement, &planned) {
            self.run_inline(session, task_id, &placement, planned);
        } else {
            self.submit(session, task_id, &placement, planned);
        }
        Ok(())
    }
}

/// Writes `model` to `state_dir` if it changed since the last save; a failure is logged (the
/// daemon keeps serving with the model in memory) and the model stays unsaved, so the next
/// periodic save and the one at shutdown try again (one failed save, on a full disk say, left
/// it unsaved for good).
pub(crate) fn save_model(model: &Mutex<PerformanceModel>, state_dir: &std::path::Path) {
    let mut snapshot = {
        let mut model = model.lock().unwrap_or_else(|e| e.into_inner());
        if !model.is_dirty() {
            return;
        }
        model.mark_saved();
        model.clone()
    };
    // Said once per run of failures, not at every periodic try.
    static FAILING: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);
    match snapshot.save(state_dir) {
        Ok(()) => {
            if FAILING.swap(false, Ordering::Relaxed) {
                tracing::info!(dir = %state_dir.display(), "performance model saved again");
            } else {
                tracing::debug!(dir = %state_dir.display(), "performance model saved");
            }
        }
        Err(error) => {
            model.lock().unwrap_or_else(|e| e.into_inner()).mark_unsaved();
            if !FAILING.swap(true, Ordering::Relaxed) {
                tracing::warn!(%error, "could not save the performance model; the daemon tries again every few seconds and at shutdown");
            }
        }
    }
}

#[cfg(test)]
mod tests;
