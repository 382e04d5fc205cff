//! Stage 2, **place**: where a [`Ready`] task runs — a device and lane, or inline on the
//! dispatcher thread.
//!
//! Owns: the inline decision for tiny tasks, the candidates (devices that implement the kernel,
//! are usable and can take the launch within their limits, the queue's preferred kind first),
//! the throughput policy's choice, latency placement (where a latency task starts soonest), the
//! lanes the `elastic` policy keeps for latency work, and the revocation choice (TReM): whether
//! a latency task committed to a lane revokes the batch launch running there; and whether a
//! queue placed afresh went to explore a device (`QueueState::exploring`: its later launches then
//! wait for the measurement, `migration`).
//!
//! Must not: move data, allocate device memory or submit anything; its only effects are the
//! model's exploration mark, the queue's exploring flag and a victim's revocation flag.

use std::sync::atomic::Ordering;
use std::sync::Arc;

use agora_kernels::KernelDef;
use agora_protocol::control::QueueClass;
use agora_protocol::{DeviceKind, LaunchLimit, TaskError, MAX_ARGS};

use super::inline::{InlineGuard, ShapeClass};
use super::{Action, Ready, Scheduler, MAX_SLICES};
use crate::policy::latency::{self, LatencyPolicy, RevokeContext};
use crate::policy::model::{Estimate, TRANSFERS};
use crate::policy::Candidate;
use crate::policy::PerformanceModel;
use crate::session::Binding;

/// Where a task runs: the output of the place stage.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Placement {
    /// The device and lane.
    pub binding: Binding,
    /// Its queue had nothing in flight (it was free to go anywhere).
    pub idle: bool,
    /// A tiny task on the host device whose data is current on the host: may run inline.
    pub tiny_on_host: bool,
    /// The fewest row slices the launch must run as on that device (1 for anything else).
    pub required_slices: u64,
    /// Short enough to run inline by every measure (estimate, bytes, its shape's history).
    pub inline_allowed: bool,
    /// The shape class of a launch that was a candidate to run inline (its lane run is
    /// measured for the inline guard).
    pub shape: Option<ShapeClass>,
}

/// Predicted nanoseconds for copying `bytes` between host memory and the device named `device`:
/// what the model measured of its link for transfers of that size ([`TRANSFERS`], the size's
/// bucket), else `bandwidth` (bytes per second, the configured figure). Never extrapolated from
/// other sizes: small copies are mostly fixed cost, and scaling them up would book a big one
/// many times too long.
pub(super) fn transfer_ns(model: &PerformanceModel, device: &str, bandwidth: f64, bytes: u64) -> f64 {
    if bytes == 0 {
        return 0.0;
    }
    match model.estimate(TRANSFERS, device, bytes) {
        Estimate::Measured(ns) => ns,
        _ => bytes as f64 / bandwidth.max(1.0) * 1e9,
    }
}

impl Scheduler {
    /// Decides where `ready` runs.
    #[inline]
    pub(super) fn place(&mut self, ready: &Ready) -> Result<Placement, TaskError> {
        let queue = &ready.queue;
        let idle = queue.in_flight.load(Ordering::Acquire) == 0;
        if let Some((binding, _)) = self.deadline_job {
            // A DAG node job: the lane APEDF chose, never inline (its time is measured there).
            return Ok(Placement {
                binding,
                idle,
                tiny_on_host: false,
                required_slices: self.fit(binding.device(), ready)?,
                inline_allowed: false,
                shape: None,
            });
        }
        let kernel = ready.kernel().map(|k| &**k);
        // A tiny task whose data is current on the host runs inline on the host device (no
        // hand-off, no transfer) unless its queue prefers another kind of device.
        let host = self.host_device();
        // Short by the estimate: then by the bytes it touches and its shape's history.
        let candidate = idle && self.config.inline_max_ns > 0.0 && ready.estimated_ns <= self.config.inline_max_ns;
        let shape = if candidate { InlineGuard::class(ready) } else { None };
        let inline_allowed = candidate && self.inline_guard.allows(shape, ready.touched_bytes);
        let tiny_on_host = inline_allowed
            && kernel.is_none_or(|k| k.may_run_inline() && self.devices[host].implements(k) && self.usable(host))
            && queue.preferred.is_none_or(|p| p == self.devices[host].info().kind)
            && ready.buffers[..ready.slots]
                .iter()
                .flatten()
                .all(|(b, _, _)| b.placement().owner().is_none())
            && self.fit(host, ready) == Ok(1);
        let binding = if tiny_on_host {
            queue.exploring.store(false, Ordering::Relaxed);
            Binding::new(host, 0)
        } else if idle {
            self.choose(ready, kernel)?
        } else {
            let binding = queue.binding.load();
            if kernel.is_some_and(|k| !self.devices[binding.device()].implements(k)) {
                // Not reached: `must_hold` moves a busy queue whose device lacks the kernel.
                return Err(TaskError::NoDevice(ready.kernel_id()));
            }
            binding
        };
        // The fewest row slices the launch must run as there (`must_hold` moved a busy queue
        // whose bound device cannot take it at all).
        let required_slices = if tiny_on_host {
            1
        } else {
            self.fit(binding.device(), ready)?
        };
        Ok(Placement {
            binding,
            idle,
            tiny_on_host,
            required_slices,
            inline_allowed,
            shape,
        })
    }

    /// The lane for a task whose queue is free to go anywhere: the policy's choice among the
    /// candidates, or latency placement.
    fn choose(&mut self, ready: &Ready, kernel: Option<&KernelDef>) -> Result<Binding, TaskError> {
        let queue = &ready.queue;
        let host = self.host_device();
        let only = match &ready.action {
            // A launch whose buffers were allocated ahead on a device (one in a device host:
            // `allocation`) goes back there: the policy chose it, and placed afresh it would
            // leave the allocations unused — and a device it went to explore would stay marked
            // as being explored and never be measured.
            Action::Launch { .. } => self.migration.allocated_late.filter(|&d| self.usable(d)),
            // Host-side work runs on the device that shares host memory; a sync_from whose
            // valid copy is on a device runs there (any lane can read a device buffer, but the
            // owner's lanes are the natural place), everything else is an ordering point.
            Action::SyncFrom => Some(
                ready.buffers[0]
                    .as_ref()
                    .and_then(|(b, _, _)| b.placement().owner())
                    .unwrap_or(host),
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
                    .unwrap_or(host),
            ),
            _ => Some(host),
        };
        // Host-side work and transfers out of a draining device run on the host device.
        let only = only.map(|d| if self.usable(d) { d } else { host });
        let beyond_limits = self.candidates_for(ready, kernel, only);
        if self.candidates.is_empty() {
            return Err(beyond_limits.unwrap_or(TaskError::NoDevice(ready.kernel_id())));
        }
        let c = if self.places_for_latency(queue.class, kernel) {
            self.soonest_start(ready.estimated_ns)
        } else {
            self.keep_reserve(queue.class, kernel);
            self.policy
                .choose(kernel.map_or("transfer", |k| k.label()), &self.candidates)
        };
        debug_assert!(kernel.is_none_or(|k| self.devices[c.device].implements(k)));
        let mut exploring = false;
        if let (Some(k), true) = (kernel, self.policy.wants_predictions()) {
            if c.device != host {
                let name = &self.devices[c.device].info().name;
                let mut model = self.model.lock().unwrap_or_else(|e| e.into_inner());
                if c.exec_ns.is_none() {
                    model.start_exploring(k.label(), name, ready.items);
                }
                exploring = model.estimate(k.label(), name, ready.items) == Estimate::Untried;
            }
        }
        // Its later tasks wait for the measurement rather than follow it there (`must_hold`).
        queue.exploring.store(exploring, Ordering::Relaxed);
        Ok(Binding::new(c.device, self.warm_lane(queue.binding.load(), c)))
    }

    /// The lane of `chosen`'s device to use: the queue's previous lane when it is on that device
    /// and no busier (by jobs and by predicted work), else the chosen one. Which of a device's
    /// equally loaded lanes runs a task makes no difference to the device, but the previous one's
    /// thread is probably still spinning for its next job (and its caches hold the queue's data):
    /// a client issuing one task at a time keeps one lane thread awake instead of waking each lane
    /// in turn (a round-robin policy would otherwise keep every lane of the device spinning, more
    /// threads than a small node has cores).
    ///
    /// "No busier", not "idle": the client sees its last task's completion a moment before that
    /// lane counts the job as done, so its next task finds its own lane at load 1. A tie with a
    /// lane holding another tenant's work went to the rotation, which put a 4 KiB `sync_to` behind
    /// a neighbour's 1.5 GiB of transfers about half the time (1.4 s instead of 0.3 ms).
    pub(super) fn warm_lane(&self, previous: Binding, chosen: Candidate) -> usize {
        // Among the candidates: the policy's filters (drained lanes, lanes kept for latency work)
        // apply to the previous lane too.
        let stay = !previous.is_unbound()
            && previous.device() == chosen.device
            && previous.lane() != chosen.lane
            && self.candidates.iter().any(|c| {
                c.device == chosen.device
                    && c.lane == previous.lane()
                    && c.load <= chosen.load
                    && c.queue_ns <= chosen.queue_ns
            });
        if stay {
            previous.lane()
        } else {
            chosen.lane
        }
    }

    /// The revocation choice: a latency launch committed to `placement` may revoke the batch
    /// launch running on that lane (TReM), when the latency policy's rules say it is worth it.
    pub(super) fn revoke_for(&self, ready: &Ready, placement: &Placement) {
        let queue = &ready.queue;
        if queue.class == QueueClass::Latency && ready.kernel().is_some() && !placement.tiny_on_host {
            let sla_ns = queue.sla_ns.unwrap_or(self.config.default_sla_ns);
            let b = placement.binding;
            self.maybe_revoke(b.device(), b.lane(), ready.estimated_ns, sla_ns);
        }
    }

    /// Why `ready`'s buffers can never be on `device` at once (a launch whose working set is
    /// larger than the device, or than the device quota of the session being dispatched), or
    /// `None` when they can. A queue with no preferred device kind places such a launch on
    /// another device (one that shares host memory takes any working set): before, the policy
    /// could choose the device the launch could never run on, and it failed with the quota's
    /// error though the user had asked for no device. A queue that prefers the device's kind
    /// keeps it, and the launch fails there naming the working set, the quota and the device's
    /// size (issue #22 item 2): the user asked for that device.
    pub(super) fn never_fits_task(&self, device: usize, ready: &Ready) -> Option<TaskError> {
        if self.devices[device].info().shares_host_memory || !matches!(ready.action, Action::Launch { .. }) {
            return None;
        }
        let buffers = &ready.buffers[..ready.slots];
        let working_set: u64 = buffers
            .iter()
            .enumerate()
            .filter_map(|(slot, entry)| {
                let (record, _, _) = entry.as_ref()?;
                // A buffer passed twice needs one copy.
                let first = buffers[..slot]
                    .iter()
                    .flatten()
                    .all(|(other, _, _)| !Arc::ptr_eq(other, record));
                first.then_some(record.len)
            })
            .sum();
        self.never_fits_within(device, working_set, self.dispatch_quota)
    }

    /// How `device` can take `ready`: the fewest row slices (enqueues) a launch must run as
    /// there (1 for anything else), or the device limit it exceeds.
    pub(super) fn fit(&self, device: usize, ready: &Ready) -> Result<u64, TaskError> {
        let Action::Launch {
            kernel,
            range,
            dims,
            window,
            ..
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
        if let Some((first, end)) = *window {
            // A window runs as one enqueue of its rows, on a device whose work-groups fit its
            // bounds (a group spanning the bound would run rows outside the window).
            let align = self.devices[device].row_alignment(kernel, *dims).max(1);
            if first % align != 0 || (end != range[0] && end % align != 0) {
                return Err(TaskError::BadWindow {
                    reason: agora_protocol::completion::WINDOW_MISALIGNED,
                    first,
                    end,
                });
            }
            let mut rows = *range;
            rows[0] = end - first;
            let slices = self.devices[device].check_launch(kernel, &rows[..*dims], &lens[..ready.slots])?;
            if slices > 1 {
                return Err(TaskError::DeviceLimit {
                    limit: LaunchLimit::ItemsPerEnqueue,
                    value: rows[..*dims].iter().product(),
                    max: rows[..*dims].iter().product::<u64>() / slices,
                });
            }
            return Ok(1);
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
                // Only devices whose limits take the launch, and, for a queue that left the choice
                // to the daemon, where its buffers can be at once (`never_fits_task`).
                let never_fits = if only.is_none() && preferred.is_none() {
                    self.never_fits_task(index, ready)
                } else {
                    None
                };
                if let Some(e) = self.fit(index, ready).err().or(never_fits) {
                    beyond_limits.get_or_insert(e);
                    continue;
                }
                for lane in 0..device.info().lanes {
                    // What this session would wait there: its own work and about one job of
                    // each other tenant (lanes serve tenants fairly), not the lane's whole
                    // backlog (`tenants`).
                    let pending = self.lane_pending[index][lane].load(Ordering::Relaxed) as f64;
                    let wait = self.lane_tenants[index][lane]
                        .wait_ns(self.dispatch_session)
                        .map_or(pending, |w| w.min(pending));
                    self.candidates.push(Candidate {
                        lane_watts: self.facts[index].lane_watts,
                        queue_ns: wait,
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
        let host = self.host_device();
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
                let transfer_ns = transfer_ns(&model, &info.name, self.facts[c.device].bandwidth, missing);
                let exec_ns = match kernel {
                    None => Some(0.0),
                    Some(k) => match model.estimate(k.label(), &info.name, ready.items) {
                        Estimate::Untried if model.is_exploring(k.label(), &info.name, ready.items) => {
                            // Someone is measuring it: assume the library's estimate meanwhile.
                            Some(ready.estimated_ns)
                        }
                        // The host device, never measured on a lane (inline runs are not
                        // recorded): the library's estimate, made for a host core. So a task
                        // estimated tiny is not sent off to explore a device behind a hand-off
                        // it cannot win back (see `policy::EXPLORE_WORTH_NS`).
                        Estimate::Untried if c.device == host => Some(ready.estimated_ns),
                        estimate => estimate.ns(),
                    },
                };
                (transfer_ns, exec_ns)
            });
            c.transfer_ns = transfer_ns;
            c.exec_ns = exec_ns;
        }
        beyond_limits
    }

    /// The device that runs host-side work: the one that computes on host memory, else (strict
    /// coherence: the CPU computes on private copies) the CPU.
    pub(super) fn host_device(&self) -> usize {
        self.devices
            .iter()
            .position(|d| d.info().shares_host_memory)
            .or_else(|| self.devices.iter().position(|d| d.info().kind == DeviceKind::Cpu))
            .unwrap_or(0)
    }

    /// Whether latency-class placement applies: latency launches under a latency policy go to
    /// the lane where they would start soonest, whatever the throughput policy.
    fn places_for_latency(&self, class: QueueClass, kernel: Option<&KernelDef>) -> bool {
        class == QueueClass::Latency && kernel.is_some() && self.config.latency_policy != LatencyPolicy::None
    }

    /// Predicted nanoseconds before a latency task handed to `lane` of `device` would start: the
    /// latency work queued there, plus what the lane's current batch work makes it wait — nothing
    /// when idle, the revocation cost of a revocable launch, one slice where launches are sliced,
    /// else everything queued there.
    fn latency_wait_ns(&self, device: usize, lane: usize) -> f64 {
        let urgent = self.books.urgent_ns(device, lane) as f64;
        let pending = self.lane_pending[device][lane].load(Ordering::Relaxed) as f64;
        if self.devices[device].lane_load(lane) == 0 {
            return urgent;
        }
        let victim = self.books.victim(device, lane);
        let batch = (pending - urgent).max(0.0);
        let blocking = match victim {
            Some(v) => v.cost_ns.min(v.remaining_ns()),
            None if self.devices[device].runs_row_slices() && self.config.preempt_target_ns > 0.0 => {
                batch.min(self.config.preempt_target_ns)
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
        latency::reserved_devices(
            self.books.execution_s(),
            self.books.outstanding(),
            self.config.default_sla_ns / 1e9,
            lanes,
        )
    }

    /// Elastic: a batch launch stays off the lanes reserved for latency work (those holding the
    /// most latency work, then the least loaded), unless only reserved lanes can run it, or the
    /// lane's device can preempt it (slices launches or polls revocation): a reserve is for
    /// lanes a latency task could not otherwise get within its SLA, and keeping batch work off a
    /// lane it would leave within a millisecond only costs throughput.
    fn keep_reserve(&mut self, class: QueueClass, kernel: Option<&KernelDef>) {
        if class != QueueClass::Batch || kernel.is_none() || self.config.latency_policy != LatencyPolicy::Elastic {
            return;
        }
        let reserved = self.reserved_lanes();
        if reserved == 0 {
            return;
        }
        let mut lanes: Vec<(usize, usize, u64, u64)> = Vec::new();
        for (d, device) in self.devices.iter().enumerate() {
            for l in 0..device.info().lanes {
                let urgent = self.books.urgent_ns(d, l);
                let pending = self.lane_pending[d][l].load(Ordering::Relaxed);
                lanes.push((d, l, urgent, pending));
            }
        }
        lanes.sort_by(|a, b| b.2.cmp(&a.2).then(a.3.cmp(&b.3)));
        let reserve: Vec<(usize, usize)> = lanes.iter().take(reserved).map(|x| (x.0, x.1)).collect();
        let devices = &self.devices;
        let preempt_target_ns = self.config.preempt_target_ns;
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
        let Some(victim) = self.books.victim(device, lane) else {
            return;
        };
        if victim.flag.load(Ordering::Relaxed) {
            return;
        }
        let latency_running = self.books.lanes_with_urgent_work();
        // The task is committed to this lane now (placement already weighed the other lanes):
        // without a revocation it starts after the latency work queued here and the victim.
        let urgent_here = self.books.urgent_ns(device, lane) as f64;
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
        if latency::should_revoke(self.config.latency_policy, &context) {
            victim.flag.store(true, Ordering::Release);
        }
    }
}
