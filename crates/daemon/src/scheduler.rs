//! The scheduler: turns descriptors from session rings into device jobs.
//!
//! For each descriptor, in ring order: copy it out (done by the ring), decode it, resolve its
//! handles against the session's own tables, check it against the kernel's signature and size
//! check; then pick where it runs and plan the data it needs there (`memory::Placement`), and
//! either
//!
//! * run it **inline** on this thread, when its queue has nothing in flight, the chosen device
//!   computes on host memory, no transfer is needed and the estimated time is under
//!   `inline_max_ns` (a `noop`, a sync, a small kernel) — this skips a thread hand-off that would
//!   cost more than the task; or
//! * hand it to a **lane**: the lane its queue is bound to while the queue has work in flight (so
//!   issue order holds), else the lane the [`Policy`] picks among the devices that implement the
//!   kernel (late binding), honouring the queue's preferred device kind when one qualifies.
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
//! Moving a queue to another device (drain, failure, a kernel its bound device lacks) is the
//! `migration` module's: `dispatch` asks it first whether a task must wait, and every lane job
//! carries a ticket that sends the task back if the device loses it.
//!
//! Must not contain vendor code: devices are reached only through the `Device` trait.

use std::sync::atomic::Ordering;
use std::sync::Arc;

use agora_devices::{Device, DeviceBuffer, Job, Transfer, Work};
use agora_kernels::{ArgValue, KernelDef, LaunchShape};
use agora_protocol::descriptor::Decoded;
use agora_protocol::ring::RingError;
use agora_protocol::{Access, ArgTag, Completion, LaunchLimit, Op, ParamKind, TaskError, MAX_ARGS};

use crate::memory::{BufferRecord, Residency};
use crate::outcome::{FaultInjection, Role, Uses};
use crate::policy::latency::{self, LatencyPolicy, RevokeContext};
use crate::policy::model::Estimate;
use crate::policy::{Candidate, PerformanceModel, Policy};
use crate::revocation::{RevocationCounters, VictimSlot};
use crate::session::{QueueState, Session, SessionShared};
use crate::telemetry::{Span, TaskCounters, Telemetry};
use agora_protocol::control::QueueClass;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::histogram::Histogram;
use std::collections::HashMap;
use std::sync::atomic::AtomicU64;
use std::sync::Mutex;
use std::time::Instant;

#[path = "migration.rs"]
mod migration;
pub(crate) use migration::Migration;

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

/// Longest predicted time of one job, nanoseconds (2^50, 13 days).
const MAX_PREDICTED_NS: f64 = (1u64 << 50) as f64;

use crate::revocation::Done;

/// Submits a launch as `slices` jobs over consecutive row ranges, in order on one lane. The task
/// completes (once, with the first error if any) when its last slice has run; its transfers go
/// with the first slice. Between slices the lane may start urgent (latency-class) jobs. Slice
/// boundaries are multiples of the device's row alignment for the kernel (whole work-groups on
/// OpenCL), so there may be fewer slices than asked for.
fn submit_sliced(
    device: &dyn Device,
    lane: usize,
    transfers: Vec<Transfer>,
    work: Work,
    slices: u64,
    cancelled: Option<Arc<std::sync::atomic::AtomicBool>>,
    done: Done,
) {
    let Work::Launch {
        kernel,
        range,
        dims,
        args,
        arg_count,
        device_args,
        ..
    } = work
    else {
        unreachable!("only launches are sliced")
    };
    // Even slices in units of the device's row alignment: slice `i` starts at unit
    // `units * i / slices`, and the last one ends at the last row.
    let rows = range[0];
    let align = device.row_alignment(kernel, dims).max(1);
    let units = rows.div_ceil(align).max(1);
    let slices = slices.clamp(1, units);
    let boundary = |slice: u64| (align * (units * slice / slices)).min(rows);
    /// What the slices of one task share.
    struct Group {
        remaining: std::sync::atomic::AtomicU64,
        state: Mutex<GroupState>,
    }
    struct GroupState {
        first_error: Option<TaskError>,
        first_times: Option<agora_devices::JobTimes>,
        cold: bool,
        done: Option<Done>,
    }
    let group = Arc::new(Group {
        remaining: std::sync::atomic::AtomicU64::new(slices),
        state: Mutex::new(GroupState {
            first_error: None,
            first_times: None,
            cold: false,
            done: Some(done),
        }),
    });
    let mut transfers = Some(transfers);
    for slice in 0..slices {
        let (start, end) = (boundary(slice), boundary(slice + 1));
        let group = group.clone();
        device.submit(
            lane,
            Job {
                transfers: transfers.take().unwrap_or_default(),
                work: Work::Launch {
                    kernel,
                    range,
                    dims,
                    args,
                    arg_count,
                    device_args: device_args.clone(),
                    rows: Some(start..end),
                },
                keepalive: None,
                cancelled: cancelled.clone(),
                revoke: None,
                urgent: false,
                done: Box::new(move |result, times| {
                    let finished = {
                        let mut state = group.state.lock().unwrap_or_else(|e| e.into_inner());
                        if let Err(e) = result {
                            state.first_error.get_or_insert(e);
                        }
                        state.first_times.get_or_insert(times);
                        state.cold |= times.cold;
                        if group.remaining.fetch_sub(1, Ordering::AcqRel) == 1 {
                            let first = state.first_times.unwrap_or(times);
                            let outcome = state.first_error.map_or(Ok(()), Err);
                            let times = agora_devices::JobTimes {
                                finished: times.finished,
                                cold: state.cold,
                                ..first
                            };
                            state.done.take().map(|done| (done, outcome, times))
                        } else {
                            None
                        }
                    };
                    if let Some((done, outcome, times)) = finished {
                        done(outcome, times);
                    }
                }),
            },
        );
    }
}

/// Scheduler state owned by the dispatcher thread.
pub(crate) struct Scheduler {
    pub devices: Vec<Arc<dyn Device>>,
    policy: Box<dyn Policy>,
    inline_max_ns: f64,
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
    /// The learned performance model (fed by every finished launch, read by policies).
    pub model: Arc<Mutex<PerformanceModel>>,
    facts: Vec<DeviceFacts>,
    /// Predicted nanoseconds of work queued or running, per device and lane.
    lane_pending: Vec<Vec<Arc<AtomicU64>>>,
    /// Which buffers have device copies (eviction).
    pub residency: Residency,
    /// Per-session device-memory quota in bytes (0: none).
    device_quota: u64,
    /// Target preemption latency of chunked launches, nanoseconds (0: no chunking).
    pub preempt_target_ns: f64,
    /// How latency-class work is protected (placement, reservation, revocation).
    pub latency_policy: LatencyPolicy,
    /// Response-time target of latency queues that set none, nanoseconds.
    pub default_sla_ns: f64,
    /// Shortest predicted batch launch made revocable, nanoseconds.
    pub revoke_min_ns: f64,
    /// Per device and lane: the revocable launch running there.
    victims: Vec<Vec<VictimSlot>>,
    /// Per device and lane: predicted nanoseconds of latency-class work queued or running.
    lane_urgent: Vec<Vec<Arc<AtomicU64>>>,
    /// Latency-class tasks in flight (TReM's `q`).
    latency_outstanding: Arc<AtomicU64>,
    /// Smoothed execution time of latency-class tasks (TReM's `l`), nanoseconds as `f64` bits.
    latency_exec_ns: Arc<AtomicU64>,
    revocation_counters: RevocationCounters,
    /// Queues being moved, draining and failed devices, lost tasks.
    pub migration: Migration,
    /// Test-only: tasks picked to fail (`DaemonConfig::inject_faults`).
    pub faults: Option<FaultInjection>,
}

/// Name of an operation in metrics and traces.
fn operation_name(action: &Action) -> &'static str {
    match action {
        Action::Launch { kernel, .. } => kernel.name,
        Action::SyncTo => "sync_to",
        Action::SyncFrom => "sync_from",
        Action::Fill { .. } => "memset",
        Action::Copy { .. } => "copy",
    }
}

fn class_name(class: QueueClass) -> &'static str {
    match class {
        QueueClass::Batch => "batch",
        QueueClass::Latency => "latency",
    }
}

/// What a resolved task does.
// `Launch` is the common case; boxing it would cost an allocation per task.
// Clone: a task's action is kept for replay when a device loses it.
#[allow(clippy::large_enum_variant)]
#[derive(Clone)]
enum Action {
    Launch {
        kernel: &'static KernelDef,
        range: [u64; 3],
        dims: usize,
        args: [ArgValue; MAX_ARGS],
        arg_count: usize,
    },
    SyncTo,
    SyncFrom,
    Fill {
        offset: u64,
        len: u64,
        value: u8,
    },
    Copy {
        src_offset: u64,
        dst_offset: u64,
        len: u64,
    },
}

/// A task whose arguments are resolved and checked.
struct Ready {
    queue: Arc<QueueState>,
    action: Action,
    estimated_ns: f64,
    /// Work items of a launch (the product of its range); 0 otherwise.
    items: u64,
    /// How many leading entries of `buffers` may hold a buffer (the hot path skips the rest).
    slots: usize,
    /// Buffer arguments with their access (transfers name buffers by argument index).
    buffers: [Option<(Arc<BufferRecord>, Access, bool)>; MAX_ARGS],
}

impl Scheduler {
    pub(crate) fn new(
        devices: Vec<Arc<dyn Device>>,
        facts: Vec<DeviceFacts>,
        policy: Box<dyn Policy>,
        model: Arc<Mutex<PerformanceModel>>,
        inline_max_ns: u64,
        device_quota: u64,
        telemetry: Arc<Telemetry>,
    ) -> Self {
        let per_lane = || -> Vec<Vec<Arc<AtomicU64>>> {
            devices
                .iter()
                .map(|d| (0..d.info().lanes).map(|_| Arc::new(AtomicU64::new(0))).collect())
                .collect()
        };
        let lane_pending = per_lane();
        let lane_urgent = per_lane();
        let victims = devices
            .iter()
            .map(|d| (0..d.info().lanes).map(|_| VictimSlot::default()).collect())
            .collect();
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
        Scheduler {
            devices,
            policy,
            inline_max_ns: inline_max_ns as f64,
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
            residency: Residency::default(),
            device_quota,
            preempt_target_ns: 1e6,
            latency_policy: LatencyPolicy::Elastic,
            default_sla_ns: 200e6,
            revoke_min_ns: 1e6,
            victims,
            lane_urgent,
            latency_outstanding: Arc::new(AtomicU64::new(0)),
            latency_exec_ns: Arc::new(AtomicU64::new(0f64.to_bits())),
            revocation_counters,
            migration,
            faults: None,
        }
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

    pub(crate) fn policy_name(&self) -> &'static str {
        self.policy.name()
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
        let available = session.submissions.available()?;
        let n = available.min(session.admission_room()).min(BATCH);
        for _ in 0..n {
            let descriptor = session.submissions.take();
            session.ingested = session.ingested.wrapping_add(1);
            session.submitted += 1;
            let task_id = descriptor.task_id;
            let outcome = descriptor.decode().and_then(|d| self.admit(session, &d));
            if let Err(error) = outcome {
                self.inline_done.push(Completion::failed(task_id, error));
                self.task_counters("invalid", QueueClass::Batch).failed.inc();
            }
        }
        if n > 0 {
            session.submissions.release();
            self.flush(&session.shared);
        }
        Ok(n)
    }

    fn flush(&mut self, shared: &SessionShared) {
        shared.post(&self.inline_done);
        self.inline_done.clear();
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
            _ => {
                let ready = resolve(session, d)?;
                self.dispatch(session, d.task_id, ready)
            }
        }
    }

    /// How `device` can take `ready`: the fewest row slices (enqueues) a launch must run as
    /// there (1 for anything else), or the device limit it exceeds.
    fn fit(&self, device: usize, ready: &Ready) -> Result<u64, TaskError> {
        let Action::Launch {
            kernel, range, dims, ..
        } = &ready.action
        else {
            return Ok(1);
        };
        let mut lens = [0u64; MAX_ARGS];
        for (len, entry) in lens.iter_mut().zip(&ready.buffers[..ready.slots]) {
            if let Some((record, _, _)) = entry {
                *len = record.len;
            }
        }
        let slices = self.devices[device].check_launch(kernel, &range[..*dims], &lens[..ready.slots])?;
        if slices > MAX_SLICES {
            return Err(TaskError::DeviceLimit {
                limit: LaunchLimit::Enqueues,
                value: slices,
                max: MAX_SLICES,
            });
        }
        Ok(slices)
    }

    /// Lanes a task may go to when its queue is unbound, with the predictions the policy asks for.
    /// When devices that implement the kernel were left out only for their limits, returns the
    /// first limit exceeded (a device of the preferred kind first).
    fn candidates_for(&mut self, ready: &Ready, kernel: Option<&KernelDef>, only: Option<usize>) -> Option<TaskError> {
        let preferred = ready.queue.preferred;
        self.candidates.clear();
        let mut beyond_limits = None;
        for pass in 0..2 {
            for (index, device) in self.devices.iter().enumerate() {
                if only.is_some_and(|o| o != index) || kernel.is_some_and(|k| !device.implements(k)) {
                    continue;
                }
                // Draining and failed devices get no new placements (a forced `only` device was
                // already chosen with that in mind).
                if only.is_none() && !self.usable(index) {
                    continue;
                }
                // First pass: only the preferred kind; second pass (if none qualified): any.
                if pass == 0 && preferred.is_some_and(|p| p != device.info().kind) {
                    continue;
                }
                // Only devices whose limits take the launch.
                if let Err(e) = self.fit(index, ready) {
                    beyond_limits.get_or_insert(e);
                    continue;
                }
                for lane in 0..device.info().lanes {
                    self.candidates.push(Candidate {
                        lane_watts: self.facts[index].lane_watts,
                        ..Candidate::with_load(index, lane, device.lane_load(lane))
                    });
                }
            }
            if !self.candidates.is_empty() || preferred.is_none() {
                break;
            }
        }
        if !self.policy.wants_predictions() && !self.places_for_latency(ready.queue.class, kernel) {
            return beyond_limits;
        }
        let model = self.model.lock().unwrap_or_else(|e| e.into_inner());
        let mut per_device: Vec<Option<(f64, Option<f64>)>> = vec![None; self.devices.len()];
        for c in self.candidates.iter_mut() {
            let (transfer_ns, exec_ns) = *per_device[c.device].get_or_insert_with(|| {
                let device = &self.devices[c.device];
                let info = device.info();
                let missing: u64 = ready.buffers[..ready.slots]
                    .iter()
                    .flatten()
                    .filter(|(_, _, overwrites)| !overwrites)
                    .map(|(record, _, _)| {
                        record
                            .placement()
                            .missing_bytes(c.device, info.shares_host_memory, record.len)
                    })
                    .sum();
                let transfer_ns = missing as f64 / self.facts[c.device].bandwidth.max(1.0) * 1e9;
                let exec_ns = match kernel {
                    None => Some(0.0),
                    Some(k) => match model.estimate(k.name, &info.name, ready.items) {
                        Estimate::Untried if model.is_exploring(k.name, &info.name, ready.items) => {
                            // Someone is measuring it: assume the library's estimate meanwhile.
                            Some(ready.estimated_ns)
                        }
                        estimate => estimate.ns(),
                    },
                };
                (transfer_ns, exec_ns)
            });
            c.transfer_ns = transfer_ns;
            c.exec_ns = exec_ns;
            c.queue_ns = self.lane_pending[c.device][c.lane].load(Ordering::Relaxed) as f64;
        }
        beyond_limits
    }

    fn host_device(&self) -> usize {
        self.devices
            .iter()
            .position(|d| d.info().shares_host_memory)
            .unwrap_or(0)
    }

    /// Dispatches a resolved task, judging first whether its inputs are valid (`outcome`): a
    /// task fed by a failed one fails here without running. A task that fails before it reaches
    /// a device still settles in its queue's order (poisoning what it would have written):
    /// at once when the queue has nothing in flight, else after the queue's earlier jobs.
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
        let queue = ready.queue.clone();
        if admitted.is_err() && self.migration.is_held(session.id, &queue) {
            // Held behind the queue's earlier tasks: judged again when released.
            admitted = Ok(());
        }
        // Kept to settle a failure; cheap next to the work of dispatching.
        let (buffers, slots) = (ready.buffers.clone(), ready.slots);
        let outcome = admitted.and_then(|()| self.place_and_submit(session, task_id, ready, roles));
        let Err(error) = outcome else {
            return Ok(());
        };
        if queue.in_flight.load(Ordering::Acquire) == 0 {
            return Uses {
                buffers: &buffers[..slots],
                roles: &roles[..slots],
            }
            .settle(task_id, Err(error));
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
            let uses = Uses {
                buffers: &buffers[..slots],
                roles: &roles[..slots],
            };
            let error = uses.settle(task_id, Err(error)).err().unwrap_or(error);
            shared.post(&[Completion::failed(task_id, error)]);
            let drained = settling.in_flight.fetch_sub(1, Ordering::AcqRel) == 1;
            shared.in_flight.fetch_sub(1, Ordering::Relaxed);
            waker.queue_drained(&settling, drained);
        });
        Ok(())
    }

    /// Places, plans and submits (or runs inline) a task whose inputs are valid.
    fn place_and_submit(
        &mut self,
        session: &Session,
        task_id: u64,
        ready: Ready,
        roles: [Role; MAX_ARGS],
    ) -> Result<(), TaskError> {
        // A queue being moved holds its tasks, in order, until its in-flight ones are done.
        if self.must_hold(session, &ready)? {
            self.hold(session, task_id, ready);
            return Ok(());
        }
        let queue = ready.queue.clone();
        let idle = queue.in_flight.load(Ordering::Acquire) == 0;
        let kernel = match &ready.action {
            Action::Launch { kernel, .. } => Some(*kernel),
            _ => None,
        };
        // Where it runs. A tiny task whose data is current on the host runs inline on the host
        // device (no hand-off, no transfer) unless its queue prefers another kind of device.
        let host = self.host_device();
        let tiny_on_host = idle
            && self.inline_max_ns > 0.0
            && ready.estimated_ns <= self.inline_max_ns
            && kernel.is_none_or(|k| self.devices[host].implements(k) && self.usable(host))
            && queue.preferred.is_none_or(|p| p == self.devices[host].info().kind)
            && ready.buffers[..ready.slots]
                .iter()
                .flatten()
                .all(|(b, _, _)| b.placement().owner().is_none())
            && self.fit(host, &ready) == Ok(1);
        let (device, lane) = if tiny_on_host {
            (host, 0)
        } else if idle {
            let only = match &ready.action {
                Action::Launch { .. } => None,
                // Host-side work runs on the device that shares host memory; a sync_from whose
                // valid copy is on a device runs there (any lane can read a device buffer, but the
                // owner's lanes are the natural place), everything else is an ordering point.
                Action::SyncFrom => Some(
                    ready.buffers[0]
                        .as_ref()
                        .and_then(|(b, _, _)| b.placement().owner())
                        .unwrap_or(self.host_device()),
                ),
                // A queue that prefers a device with memory of its own gets its data pushed there
                // at once; otherwise a sync_to only marks the host copy as the current one.
                Action::SyncTo => Some(
                    queue
                        .preferred
                        .and_then(|kind| {
                            self.devices
                                .iter()
                                .position(|d| d.info().kind == kind && !d.info().shares_host_memory)
                        })
                        .unwrap_or(self.host_device()),
                ),
                _ => Some(self.host_device()),
            };
            // Host-side work and transfers out of a draining device run on the host device.
            let only = only.map(|d| if self.usable(d) { d } else { host });
            let beyond_limits = self.candidates_for(&ready, kernel, only);
            if self.candidates.is_empty() {
                if let Some(e) = beyond_limits {
                    return Err(e);
                }
                let id = kernel.and_then(|k| agora_kernels::find(k.name)).map_or(0, |(i, _)| i);
                return Err(TaskError::NoDevice(id));
            }
            let c = if self.places_for_latency(queue.class, kernel) {
                self.soonest_start(ready.estimated_ns)
            } else {
                self.keep_reserve(queue.class, kernel);
                self.policy
                    .choose(kernel.map_or("transfer", |k| k.name), &self.candidates)
            };
            debug_assert!(kernel.is_none_or(|k| self.devices[c.device].implements(k)));
            if let (Some(k), true, None) = (kernel, self.policy.wants_predictions(), c.exec_ns) {
                let name = &self.devices[c.device].info().name;
                let mut model = self.model.lock().unwrap_or_else(|e| e.into_inner());
                model.start_exploring(k.name, name, ready.items);
            }
            (c.device, c.lane)
        } else {
            let binding = queue.binding.load(Ordering::Relaxed);
            let device = (binding >> 16) as usize;
            if kernel.is_some_and(|k| !self.devices[device].implements(k)) {
                // Not reached: `must_hold` moves a busy queue whose device lacks the kernel.
                let id = kernel.and_then(|k| agora_kernels::find(k.name)).map_or(0, |(i, _)| i);
                return Err(TaskError::NoDevice(id));
            }
            (device, (binding & 0xffff) as usize)
        };
        // The fewest row slices the launch must run as there (`must_hold` moved a busy queue
        // whose bound device cannot take it at all).
        let required_slices = self.fit(device, &ready)?;

        if queue.class == QueueClass::Latency && kernel.is_some() && !tiny_on_host {
            let sla_ns = queue.sla_ns.unwrap_or(self.default_sla_ns);
            self.maybe_revoke(device, lane, ready.estimated_ns, sla_ns);
        }

        // What data it needs there, and the work itself. Its buffers are in use from now until
        // it finishes, so eviction leaves them alone.
        let name = operation_name(&ready.action);
        let items = ready.items;
        let estimated_ns = ready.estimated_ns;
        let named = NamedBuffers::new(ready.buffers, ready.slots, roles, &mut self.residency);
        // Test-only: a task picked to fail keeps its transfers but its work does not run.
        let injected = self.faults.is_some_and(|f| f.picks(task_id));
        if !self.devices[device].info().shares_host_memory {
            let needed: u64 = named
                .slots()
                .iter()
                .flatten()
                .filter(|(record, _, _)| !record.placement().is_on(device))
                .map(|(record, _, _)| record.len)
                .sum();
            let usage = &session.shared.device_usage;
            if needed > 0
                && !self
                    .residency
                    .make_room(&self.devices, device, needed, usage, self.device_quota)
                && self.device_quota > 0
                && usage.0[device].load(Ordering::Relaxed) + needed > self.device_quota
            {
                // Over the session's device quota even with all its idle buffers evicted.
                return Err(TaskError::DeviceQuota {
                    needed,
                    quota: self.device_quota,
                });
            }
        }
        let mut transfers: Vec<Transfer> = Vec::new();
        // Taken before planning: what a replay needs if the device loses the task.
        let mut ticket = migration::Ticket::new(
            &mut self.migration,
            device,
            &ready.action,
            estimated_ns,
            items,
            named.slots(),
        );
        let work = match self.plan(session, device, ready.action, named.slots(), &mut transfers) {
            Err(TaskError::DeviceLost) => return self.lost_while_planning(session, task_id, &queue, ticket, named),
            planned => planned?,
        };
        let work = if injected { Work::Nothing } else { work };
        for (record, _, _) in named.slots().iter().flatten() {
            self.residency.register(record);
        }
        for t in &transfers {
            let (counter, bytes) = match t {
                Transfer::ToDevice { len, .. } => (&session.shared.bytes_to_device, *len),
                Transfer::ToHost { len, .. } => (&session.shared.bytes_to_host, *len),
            };
            counter.fetch_add(bytes as u64, Ordering::Relaxed);
            let direction = usize::from(matches!(t, Transfer::ToHost { .. }));
            self.bytes[direction].inc_by(bytes as u64);
        }

        if idle
            && self.inline_max_ns > 0.0
            && self.devices[device].info().shares_host_memory
            && transfers.is_empty()
            && ready.estimated_ns <= self.inline_max_ns
            && required_slices == 1
        {
            // Tiny, and nothing to move: run it here and now.
            let tracing = self.telemetry.trace.is_some();
            let start = tracing.then(Instant::now);
            let result = match injected {
                false => self.devices[device].run_inline(&work),
                true => Err(TaskError::KernelFault),
            };
            let result = named.settle(task_id, result);
            let counters = self.task_counters(name, queue.class);
            if result.is_ok() {
                counters.ok.inc()
            } else {
                counters.failed.inc()
            };
            if let (Some(trace), Some(start)) = (&self.telemetry.trace, start) {
                trace.record(Span {
                    category: "exec",
                    name,
                    row: 0,
                    start,
                    end: Instant::now(),
                    session: session.shared.id,
                    tenant: session.shared.tenant.clone(),
                    task: task_id,
                    queue: queue.name.clone(),
                });
            }
            self.inline_done.push(match result {
                Ok(()) => Completion::ok(task_id),
                Err(e) => Completion::failed(task_id, e),
            });
            drop(named);
            return Ok(());
        }
        if idle {
            queue
                .binding
                .store(((device as u32) << 16) | lane as u32, Ordering::Relaxed);
        }
        // Completions of earlier inline tasks must reach the ring before this job's.
        self.flush(&session.shared);
        queue.in_flight.fetch_add(1, Ordering::AcqRel);
        session.shared.in_flight.fetch_add(1, Ordering::Relaxed);
        let shared = session.shared.clone();
        let counters = self.task_counters(name, queue.class).clone();
        let histograms = self.histograms[device].clone();
        let telemetry = self.telemetry.clone();
        let row = self.first_row[device] + lane as u32;
        // Predicted time of this job on its lane, for the policies' queue-wait estimates.
        let device_name: Arc<str> = Arc::from(self.devices[device].info().name.as_str());
        let predicted = match kernel {
            Some(k) => {
                let model = self.model.lock().unwrap_or_else(|e| e.into_inner());
                model.estimate(k.name, &device_name, items).ns().unwrap_or(estimated_ns)
            }
            None => 0.0,
        }
        // At most 2^50 ns (13 days): a huge range extrapolated from small ones must not make the
        // lanes' sums of predictions wrap.
        .min(MAX_PREDICTED_NS) as u64;
        let pending = self.lane_pending[device][lane].clone();
        pending.fetch_add(predicted, Ordering::Relaxed);
        let model = self.model.clone();
        let urgent = queue.class == QueueClass::Latency;
        // Latency work's own accounting: its queued time per lane, TReM's `q` and `l`.
        let latency_books = urgent.then(|| {
            let books = (
                self.lane_urgent[device][lane].clone(),
                self.latency_outstanding.clone(),
                self.latency_exec_ns.clone(),
            );
            books.0.fetch_add(predicted, Ordering::Relaxed);
            books.1.fetch_add(1, Ordering::Relaxed);
            books
        });
        let slices = self
            .slices_for(device, &work, queue.class, predicted as f64)
            .max(required_slices);
        let revocable = slices <= 1 && self.revocable(device, &work, queue.class, predicted as f64);
        let sequence = queue.sequencer.ticket();
        let done: Done = Box::new(move |mut result, times| {
            if injected {
                result = result.and(Err(TaskError::KernelFault));
            }
            if result.is_ok() {
                counters.ok.inc()
            } else {
                counters.failed.inc()
            };
            let exec_start = times.transfers_done.unwrap_or(times.started);
            pending.fetch_sub(predicted, Ordering::Relaxed);
            if let Some((lane_urgent, outstanding, exec_ns)) = latency_books {
                lane_urgent.fetch_sub(predicted, Ordering::Relaxed);
                outstanding.fetch_sub(1, Ordering::Relaxed);
                let ns = times.finished.saturating_duration_since(exec_start).as_nanos() as f64;
                // Smoothed like the performance model (4:1); racing updates lose one sample.
                let old = f64::from_bits(exec_ns.load(Ordering::Relaxed));
                let new = if old == 0.0 { ns } else { 0.8 * old + 0.2 * ns };
                exec_ns.store(new.to_bits(), Ordering::Relaxed);
            }
            if let Some(k) = kernel {
                let mut model = model.lock().unwrap_or_else(|e| e.into_inner());
                if result.is_ok() && !times.cold {
                    let ns = times.finished.saturating_duration_since(exec_start).as_nanos() as f64;
                    model.record(k.name, &device_name, items, ns);
                } else {
                    // Failed, or not typical: let a later task measure it.
                    model.abandon_exploring(k.name, &device_name, items);
                }
            }
            histograms[0].observe(times.started.saturating_duration_since(times.queued).as_secs_f64());
            histograms[1].observe(times.finished.saturating_duration_since(exec_start).as_secs_f64());
            if let Some(done) = times.transfers_done {
                histograms[2].observe(done.saturating_duration_since(times.started).as_secs_f64());
            }
            if let Some(trace) = &telemetry.trace {
                let span = |category, start, end| Span {
                    category,
                    name,
                    row,
                    start,
                    end,
                    session: shared.id,
                    tenant: shared.tenant.clone(),
                    task: task_id,
                    queue: queue.name.clone(),
                };
                trace.record(span("wait", times.queued, times.started));
                if let Some(done) = times.transfers_done {
                    trace.record(span("transfer", times.started, done));
                }
                trace.record(span("exec", exec_start, times.finished));
            }
            // The rest in issue order within the queue: a task is judged after the tasks it may
            // depend on.
            let sequencer_queue = queue.clone();
            sequencer_queue.sequencer.in_order(sequence, move || {
                // Lost with its device: back to the dispatcher for replay, still counted in flight.
                let Some(named) = ticket.divert(&mut result, &shared, &queue, task_id, named) else {
                    return;
                };
                // A failure poisons what it wrote; a task fed by one that failed meanwhile fails.
                let result = named.settle(task_id, result);
                let completion = match result {
                    Ok(()) => Completion::ok(task_id),
                    Err(e) => Completion::failed(task_id, e),
                };
                // Let go of the buffers before the client can see the completion: a release the
                // client sends next then frees their memory at once, not at the next sweep, and
                // a task issued next may evict them.
                drop(named);
                shared.post(&[completion]);
                // Post first, then unbind: the dispatcher may run this queue's next task inline
                // as soon as it sees zero, and that completion must come after ours.
                let drained = queue.in_flight.fetch_sub(1, Ordering::AcqRel) == 1;
                shared.in_flight.fetch_sub(1, Ordering::Relaxed);
                drop(shared);
                // A queue being moved may go on now: wake the dispatcher to release its held tasks.
                ticket.queue_drained(&queue, drained);
            });
        });
        if revocable {
            let rw_bytes = crate::revocation::read_write_bytes(&work) as f64;
            // The CPU stops at its next block of rows (1/256 of the launch); restoring the
            // read-write buffers costs a copy of them.
            let cost_ns = predicted as f64 / 256.0 + rw_bytes / self.facts[device].bandwidth.max(1.0) * 1e9;
            crate::revocation::submit(
                self.devices[device].clone(),
                lane,
                transfers,
                work,
                session.shared.cancelled.clone(),
                self.victims[device][lane].clone(),
                predicted as f64,
                cost_ns,
                self.revocation_counters.clone(),
                done,
            );
            return Ok(());
        }
        let cancelled = Some(session.shared.cancelled.clone());
        if slices <= 1 {
            self.devices[device].submit(
                lane,
                Job {
                    transfers,
                    work,
                    keepalive: None,
                    cancelled,
                    revoke: None,
                    urgent,
                    done,
                },
            );
        } else {
            submit_sliced(&*self.devices[device], lane, transfers, work, slices, cancelled, done);
        }
        Ok(())
    }

    /// Whether latency-class placement applies: latency launches under a latency policy go to
    /// the lane where they would start soonest, whatever the throughput policy.
    fn places_for_latency(&self, class: QueueClass, kernel: Option<&KernelDef>) -> bool {
        class == QueueClass::Latency && kernel.is_some() && self.latency_policy != LatencyPolicy::None
    }

    /// Predicted nanoseconds before a latency task handed to `lane` of `device` would start: the
    /// latency work queued there, plus what the lane's current batch work makes it wait — nothing
    /// when idle, the revocation cost of a revocable launch, one slice where launches are sliced,
    /// else everything queued there.
    fn latency_wait_ns(&self, device: usize, lane: usize) -> f64 {
        let urgent = self.lane_urgent[device][lane].load(Ordering::Relaxed) as f64;
        let pending = self.lane_pending[device][lane].load(Ordering::Relaxed) as f64;
        if self.devices[device].lane_load(lane) == 0 {
            return urgent;
        }
        let victim = self.victims[device][lane]
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone();
        let batch = (pending - urgent).max(0.0);
        let blocking = match victim {
            Some(v) => v.cost_ns.min(v.remaining_ns()),
            None if self.devices[device].runs_row_slices() && self.preempt_target_ns > 0.0 => {
                batch.min(self.preempt_target_ns)
            }
            None => batch,
        };
        urgent + blocking
    }

    /// The candidate where a latency task would finish soonest (start wait + transfers +
    /// execution); `estimated_ns` stands in for executions never measured.
    fn soonest_start(&self, estimated_ns: f64) -> Candidate {
        let finish =
            |c: &Candidate| self.latency_wait_ns(c.device, c.lane) + c.transfer_ns + c.exec_ns.unwrap_or(estimated_ns);
        self.candidates
            .iter()
            .min_by(|a, b| finish(a).total_cmp(&finish(b)))
            .cloned()
            .expect("candidates are not empty")
    }

    /// TReM's `U = ceil(l · q / SLA)`: lanes reserved for latency work now.
    fn reserved_lanes(&self) -> usize {
        let lanes = self.devices.iter().map(|d| d.info().lanes).sum();
        let l = f64::from_bits(self.latency_exec_ns.load(Ordering::Relaxed)) / 1e9;
        let q = self.latency_outstanding.load(Ordering::Relaxed) as usize;
        latency::reserved_devices(l, q, self.default_sla_ns / 1e9, lanes)
    }

    /// Elastic: a batch launch stays off the lanes reserved for latency work (those holding the
    /// most latency work, then the least loaded), unless only reserved lanes can run it, or the
    /// lane's device can preempt it (slices launches or polls revocation): a reserve is for
    /// lanes a latency task could not otherwise get within its SLA, and keeping batch work off a
    /// lane it would leave within a millisecond only costs throughput.
    fn keep_reserve(&mut self, class: QueueClass, kernel: Option<&KernelDef>) {
        if class != QueueClass::Batch || kernel.is_none() || self.latency_policy != LatencyPolicy::Elastic {
            return;
        }
        let reserved = self.reserved_lanes();
        if reserved == 0 {
            return;
        }
        let mut lanes: Vec<(usize, usize, u64, u64)> = Vec::new();
        for (d, device) in self.devices.iter().enumerate() {
            for l in 0..device.info().lanes {
                let urgent = self.lane_urgent[d][l].load(Ordering::Relaxed);
                let pending = self.lane_pending[d][l].load(Ordering::Relaxed);
                lanes.push((d, l, urgent, pending));
            }
        }
        lanes.sort_by(|a, b| b.2.cmp(&a.2).then(a.3.cmp(&b.3)));
        let reserve: Vec<(usize, usize)> = lanes.iter().take(reserved).map(|x| (x.0, x.1)).collect();
        let devices = &self.devices;
        let preempt_target_ns = self.preempt_target_ns;
        let allowed = |c: &Candidate| {
            let device = &devices[c.device];
            !reserve.contains(&(c.device, c.lane))
                || device.polls_revocation()
                || (device.runs_row_slices() && preempt_target_ns > 0.0)
        };
        if self.candidates.iter().any(allowed) {
            self.candidates.retain(allowed);
        }
    }

    /// A latency task was handed to `lane` of `device`: revoke the batch launch running there if
    /// the latency policy says so.
    fn maybe_revoke(&self, device: usize, lane: usize, estimated_ns: f64, sla_ns: f64) {
        let Some(victim) = self.victims[device][lane]
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
        else {
            return;
        };
        if victim.flag.load(Ordering::Relaxed) {
            return;
        }
        let mut latency_running = 0;
        for (d, device) in self.devices.iter().enumerate() {
            for l in 0..device.info().lanes {
                latency_running += usize::from(self.lane_urgent[d][l].load(Ordering::Relaxed) > 0);
            }
        }
        // The task is committed to this lane now (placement already weighed the other lanes):
        // without a revocation it starts after the latency work queued here and the victim.
        let urgent_here = self.lane_urgent[device][lane].load(Ordering::Relaxed) as f64;
        let context = RevokeContext {
            latency_running,
            reserved: self.reserved_lanes().max(1),
            victim_remaining_s: victim.remaining_ns() / 1e9,
            victim_elapsed_s: victim.started.map_or(0.0, |t| t.elapsed().as_secs_f64()),
            victim_revocations: victim.revocations,
            sla_s: sla_ns / 1e9,
            revoke_cost_s: victim.cost_ns / 1e9,
            earliest_free_s: (urgent_here + victim.remaining_ns()) / 1e9,
            slack_s: (sla_ns - estimated_ns - urgent_here).max(0.0) / 1e9,
        };
        if latency::should_revoke(self.latency_policy, &context) {
            victim.flag.store(true, Ordering::Release);
        }
    }

    /// Whether a launch runs revocable: a batch launch that was not sliced, on a device that
    /// polls revocation, under a latency policy, predicted long enough that a latency task could
    /// not simply wait for it (`revoke_min`, and twice the preemption target). Short launches
    /// are not worth the lane drain and the copy of their read-write buffers.
    fn revocable(&self, device: usize, work: &Work, class: QueueClass, predicted_ns: f64) -> bool {
        class == QueueClass::Batch
            && self.latency_policy != LatencyPolicy::None
            && matches!(work, Work::Launch { .. })
            && self.devices[device].polls_revocation()
            && predicted_ns >= self.revoke_min_ns.max(2.0 * self.preempt_target_ns)
    }

    /// How many row slices to split a launch into so that a latency task waits at most about
    /// `preempt_target` for the lane (chunked launch): batch launches only, on devices that take
    /// slices, when the prediction exceeds twice the target. 1: do not split.
    fn slices_for(&self, device: usize, work: &Work, class: QueueClass, predicted_ns: f64) -> u64 {
        let target = self.preempt_target_ns;
        let Work::Launch { range, .. } = work else { return 1 };
        if class != QueueClass::Batch
            || target <= 0.0
            || predicted_ns < 2.0 * target
            || !self.devices[device].runs_row_slices()
        {
            return 1;
        }
        ((predicted_ns / target).ceil() as u64).clamp(1, range[0].min(MAX_SLICES))
    }

    /// Plans data placement for `action` on `device` and builds its work.
    fn plan(
        &self,
        session: &Session,
        device: usize,
        action: Action,
        buffers: &[Option<(Arc<BufferRecord>, Access, bool)>],
        transfers: &mut Vec<Transfer>,
    ) -> Result<Work, TaskError> {
        let devices = &self.devices;
        let host = |record: &BufferRecord| heap_ptr(session, record, 0, record.len);
        Ok(match action {
            Action::Launch {
                kernel,
                range,
                dims,
                mut args,
                arg_count,
            } => {
                let mut device_args: [Option<Arc<dyn DeviceBuffer>>; MAX_ARGS] = Default::default();
                for (index, entry) in buffers.iter().enumerate() {
                    let Some((record, access, overwrites)) = entry else {
                        continue;
                    };
                    let ptr = host(record)?;
                    let mut placement = record.placement();
                    device_args[index] = placement
                        .prepare(
                            devices,
                            device,
                            *access,
                            *overwrites,
                            ptr,
                            record.len,
                            &record.usage,
                            transfers,
                        )
                        .map_err(|e| match e {
                            TaskError::DeviceOutOfMemory { needed, .. } => TaskError::DeviceOutOfMemory {
                                index: index as u16,
                                needed,
                            },
                            other => other,
                        })?;
                    args[index] = ArgValue::Buffer { ptr, len: record.len };
                }
                Work::Launch {
                    kernel,
                    range,
                    dims,
                    args,
                    arg_count,
                    device_args,
                    rows: None,
                }
            }
            Action::SyncTo => {
                let (record, _, _) = buffers[0].as_ref().ok_or(TaskError::KernelFault)?;
                let mut placement = record.placement();
                placement.host_written();
                if !devices[device].info().shares_host_memory {
                    // Eager: the queue runs on a device with its own memory; copy in now.
                    placement.prepare(
                        devices,
                        device,
                        Access::Read,
                        false,
                        host(record)?,
                        record.len,
                        &record.usage,
                        transfers,
                    )?;
                }
                Work::Nothing
            }
            Action::SyncFrom => {
                let (record, _, _) = buffers[0].as_ref().ok_or(TaskError::KernelFault)?;
                let ptr = host(record)?;
                record.placement().fetch_to_host(devices, ptr, record.len, transfers);
                Work::Nothing
            }
            Action::Fill { offset, len, value } => {
                let (record, _, _) = buffers[0].as_ref().ok_or(TaskError::KernelFault)?;
                let base = host(record)?;
                let mut placement = record.placement();
                // A partial fill keeps the rest of the buffer: bring it home first.
                placement.fetch_to_host(devices, base, record.len, transfers);
                placement.host_written();
                Work::Fill {
                    ptr: heap_ptr(session, record, offset, len)?,
                    len: len as usize,
                    value,
                }
            }
            Action::Copy {
                src_offset,
                dst_offset,
                len,
            } => {
                let (src, _, _) = buffers[0].as_ref().ok_or(TaskError::KernelFault)?;
                let (dst, _, _) = buffers[1].as_ref().ok_or(TaskError::KernelFault)?;
                let src_base = host(src)?;
                src.placement().fetch_to_host(devices, src_base, src.len, transfers);
                if !Arc::ptr_eq(src, dst) {
                    let dst_base = host(dst)?;
                    dst.placement().fetch_to_host(devices, dst_base, dst.len, transfers);
                }
                dst.placement().host_written();
                Work::Copy {
                    src: heap_ptr(session, src, src_offset, len)?,
                    dst: heap_ptr(session, dst, dst_offset, len)?,
                    len: len as usize,
                }
            }
        })
    }
}

/// A task's buffer arguments, marked in use (not evictable) for as long as it lives.
struct NamedBuffers {
    buffers: [Option<(Arc<BufferRecord>, Access, bool)>; MAX_ARGS],
    slots: usize,
    /// How the task uses each (for its outcome).
    roles: [Role; MAX_ARGS],
}

impl NamedBuffers {
    fn new(
        buffers: [Option<(Arc<BufferRecord>, Access, bool)>; MAX_ARGS],
        slots: usize,
        roles: [Role; MAX_ARGS],
        residency: &mut Residency,
    ) -> Self {
        for (record, _, _) in buffers[..slots].iter().flatten() {
            record.in_use.fetch_add(1, Ordering::AcqRel);
            residency.touch(record);
        }
        NamedBuffers { buffers, slots, roles }
    }

    /// The entries that may hold a buffer.
    fn slots(&self) -> &[Option<(Arc<BufferRecord>, Access, bool)>] {
        &self.buffers[..self.slots]
    }

    /// The outcome to report for `task`, which ran with `result` (see `outcome`).
    fn settle(&self, task: u64, result: Result<(), TaskError>) -> Result<(), TaskError> {
        Uses {
            buffers: self.slots(),
            roles: &self.roles[..self.slots],
        }
        .settle(task, result)
    }
}

/// How a task uses each of its buffer arguments (what it reads, writes, rewrites whole).
fn data_roles(ready: &Ready) -> [Role; MAX_ARGS] {
    let mut roles = [Role::default(); MAX_ARGS];
    for (slot, entry) in ready.buffers[..ready.slots].iter().enumerate() {
        let Some((record, access, overwrites)) = entry else {
            continue;
        };
        roles[slot] = match &ready.action {
            Action::Launch { .. } => Role::launch(*access, *overwrites),
            // Rewrites the host copy whole (the placement treats any sync_to so).
            Action::SyncTo => Role::write(0, record.len, record.len),
            Action::SyncFrom => Role::READ,
            Action::Fill { offset, len, .. } => Role::write(*offset, *len, record.len),
            Action::Copy { dst_offset, len, .. } => {
                let same = matches!(&ready.buffers[1 - slot], Some((other, _, _)) if Arc::ptr_eq(other, record));
                match (slot, same) {
                    (0, _) => Role::READ,
                    (_, false) => Role::write(*dst_offset, *len, record.len),
                    // Copying within one buffer keeps the rest of it.
                    (_, true) => Role {
                        reads: true,
                        writes: true,
                        whole: false,
                    },
                }
            }
        };
    }
    roles
}

impl Drop for NamedBuffers {
    fn drop(&mut self) {
        for (record, _, _) in self.buffers[..self.slots].iter().flatten() {
            record.in_use.fetch_sub(1, Ordering::AcqRel);
        }
    }
}

/// Looks up buffer argument `index` (handle in `handle`) in the session.
fn buffer(session: &Session, index: usize, handle: u64) -> Result<&Arc<BufferRecord>, TaskError> {
    session.buffers.get(handle).ok_or(TaskError::InvalidHandle {
        index: index as u16,
        handle,
    })
}

/// Checks that `[offset, offset+len)` (len 0 = to the end) lies in `record`; returns the range.
fn byte_range(record: &BufferRecord, index: usize, offset: u64, len: u64) -> Result<(u64, u64), TaskError> {
    let len = if len == 0 {
        record.len.saturating_sub(offset)
    } else {
        len
    };
    let end = offset.saturating_add(len);
    if end > record.len {
        return Err(TaskError::OutOfBounds {
            index: index as u16,
            end,
            len: record.len,
        });
    }
    Ok((offset, len))
}

fn heap_ptr(session: &Session, record: &BufferRecord, offset: u64, len: u64) -> Result<*mut u8, TaskError> {
    // The heap allocator only hands out in-heap ranges, so this cannot fail unless the daemon
    // is wrong; report it as a fault of this task rather than trusting it.
    session
        .shared
        .segment
        .view()
        .heap_range(record.offset + offset, len)
        .ok_or(TaskError::KernelFault)
}

fn resolve(session: &Session, d: &Decoded<'_>) -> Result<Ready, TaskError> {
    let queue = session
        .queues
        .get(d.queue)
        .ok_or(TaskError::UnknownQueue(d.queue))?
        .clone();
    let mut buffers: [Option<(Arc<BufferRecord>, Access, bool)>; MAX_ARGS] = Default::default();
    let (action, estimated_ns) = match d.op {
        Op::Launch => {
            let kernel = agora_kernels::library()
                .get(d.kernel as usize)
                .ok_or(TaskError::UnknownKernel(d.kernel))?;
            kernel.check_arguments(d.args)?;
            let mut args = [ArgValue::None; MAX_ARGS];
            let mut scalars = [0u64; MAX_ARGS];
            let mut lens = [0u64; MAX_ARGS];
            for (index, (arg, param)) in d.args.iter().zip(kernel.params).enumerate() {
                if arg.tag == ArgTag::Buffer as u32 {
                    let record = buffer(session, index, arg.value)?;
                    let access = match param.kind {
                        ParamKind::Buffer { access, .. } => access,
                        ParamKind::Scalar(_) => return Err(TaskError::KernelFault),
                    };
                    // One buffer twice is fine only when neither use writes it.
                    for (earlier, entry) in buffers.iter().enumerate().take(index) {
                        if let Some((other, other_access, _)) = entry {
                            if Arc::ptr_eq(other, record) && (access.writes() || other_access.writes()) {
                                return Err(TaskError::Aliased {
                                    index: earlier as u16,
                                    other: index as u64,
                                });
                            }
                        }
                    }
                    lens[index] = record.len;
                    buffers[index] = Some((record.clone(), access, false));
                } else {
                    scalars[index] = arg.value;
                    args[index] = ArgValue::Scalar(arg.value);
                }
            }
            let needed: [std::cell::Cell<u64>; MAX_ARGS] = Default::default();
            let shape = LaunchShape {
                range: d.range,
                scalars: &scalars[..d.args.len()],
                buffer_lens: &lens[..d.args.len()],
                needed: &needed,
            };
            (kernel.check)(&shape)?;
            // A write-only argument whose checked range is the whole buffer is overwritten
            // entirely: its old contents need not reach the device.
            for (index, entry) in buffers.iter_mut().enumerate() {
                if let Some((record, access, overwrites)) = entry {
                    *overwrites = *access == Access::Write && needed[index].get() >= record.len;
                }
            }
            let mut range = [1u64; 3];
            range[..d.range.len()].copy_from_slice(d.range);
            let estimated = kernel.estimated_ns(shape.items());
            (
                Action::Launch {
                    kernel,
                    range,
                    dims: d.range.len(),
                    args,
                    arg_count: d.args.len(),
                },
                estimated,
            )
        }
        Op::SyncTo | Op::SyncFrom => {
            let record = buffer(session, 0, d.buffer_arg(0)?)?;
            byte_range(record, 0, d.u64_arg_or(1, 0)?, d.u64_arg_or(2, 0)?)?;
            buffers[0] = Some((record.clone(), Access::Read, false));
            (
                if d.op == Op::SyncTo {
                    Action::SyncTo
                } else {
                    Action::SyncFrom
                },
                0.0,
            )
        }
        Op::Memset => {
            let record = buffer(session, 0, d.buffer_arg(0)?)?;
            let value = d.u64_arg_or(1, 0)?;
            if value > 255 {
                return Err(TaskError::InvalidScalar {
                    index: 1,
                    value: value as i64,
                });
            }
            let (offset, len) = byte_range(record, 0, d.u64_arg_or(2, 0)?, d.u64_arg_or(3, 0)?)?;
            buffers[0] = Some((record.clone(), Access::Write, false));
            (
                Action::Fill {
                    offset,
                    len,
                    value: value as u8,
                },
                len as f64 * 0.05,
            )
        }
        Op::Copy => {
            let src = buffer(session, 0, d.buffer_arg(0)?)?;
            let dst = buffer(session, 1, d.buffer_arg(1)?)?;
            let (src_offset, len) = byte_range(src, 0, d.u64_arg_or(2, 0)?, d.u64_arg_or(4, 0)?)?;
            let dst_offset = d.u64_arg_or(3, 0)?;
            byte_range(dst, 1, dst_offset, len)?;
            buffers[0] = Some((src.clone(), Access::Read, false));
            buffers[1] = Some((dst.clone(), Access::Write, false));
            (
                Action::Copy {
                    src_offset,
                    dst_offset,
                    len,
                },
                len as f64 * 0.1,
            )
        }
        Op::ReleaseBuffer | Op::ReleaseQueue => unreachable!("handled by admit"),
    };
    let items = match &action {
        Action::Launch { range, dims, .. } => range[..*dims].iter().product(),
        _ => 0,
    };
    let slots = match d.op {
        Op::Launch => d.args.len(),
        Op::Copy => 2,
        _ => 1,
    };
    Ok(Ready {
        queue,
        action,
        estimated_ns,
        items,
        slots,
        buffers,
    })
}

/// Writes `model` to `state_dir` if it changed since the last save; a failure is logged (the
/// daemon keeps serving with the model in memory).
pub(crate) fn save_model(model: &Mutex<PerformanceModel>, state_dir: &std::path::Path) {
    let mut snapshot = {
        let mut model = model.lock().unwrap_or_else(|e| e.into_inner());
        if !model.is_dirty() {
            return;
        }
        model.mark_saved();
        model.clone()
    };
    match snapshot.save(state_dir) {
        Ok(()) => tracing::debug!(dir = %state_dir.display(), "performance model saved"),
        Err(error) => tracing::warn!(%error, "could not save the performance model"),
    }
}
