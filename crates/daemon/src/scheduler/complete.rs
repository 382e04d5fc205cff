//! Stage 5, **complete**: what happens when a lane job ends (on the lane's thread, or a device
//! runtime's callback thread).
//!
//! Owns: [`LaneCompletion`], everything a finished job must update — its metrics, the lane's
//! predicted work, the latency books, the performance model, the trace — and then, in issue
//! order within its queue (the queue's `Sequencer`), its outcome: sent back for replay if its
//! device lost it, else judged by the outcome rules (poisoned inputs and outputs), posted to the
//! client's completion ring, and the queue's in-flight count released.
//!
//! Must not: block, or touch anything the dispatcher thread owns alone (the scheduler's own
//! fields): it holds only shared handles (`Arc`s and atomics).

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use agora_devices::JobTimes;
use agora_kernels::KernelRef;
use agora_protocol::{Completion, TaskError};
use prometheus_client::metrics::histogram::Histogram;

use super::books::LatencyCharge;
use super::inline::{InlineGuard, ShapeClass};
use super::migration;
use super::plan::NamedBuffers;
use crate::policy::PerformanceModel;
use crate::revocation::Done;
use crate::session::{QueueState, SessionShared};
use crate::telemetry::{Span, TaskCounters, Telemetry};

/// What a lane job's end must do; see the module documentation.
pub(super) struct LaneCompletion {
    pub task_id: u64,
    /// The device's index.
    pub device: usize,
    pub queue: Arc<QueueState>,
    pub shared: Arc<SessionShared>,
    /// Its place in its queue's settling order.
    pub sequence: u64,
    pub named: NamedBuffers,
    pub ticket: migration::Ticket,
    /// Test-only: its work was skipped; it fails with `KernelFault`.
    pub injected: bool,
    pub kernel: Option<KernelRef>,
    /// Bytes its transfers copy (between host memory and the device, both ways).
    pub transfer_bytes: u64,
    pub name: &'static str,
    pub items: u64,
    pub device_name: Arc<str>,
    pub model: Arc<Mutex<PerformanceModel>>,
    /// Its predicted nanoseconds (kernel and transfers), booked on its lane's pending work.
    pub predicted: u64,
    /// Its predicted nanoseconds as counted in the session's outstanding lane work (0 for
    /// latency-class tasks), for back-pressure.
    pub session_ns: u64,
    pub lane_pending: Arc<AtomicU64>,
    /// Its lane's tenants, where it is booked under its session.
    pub lane_tenants: Arc<super::tenants::LaneTenants>,
    /// Its entry in the latency books (latency-class tasks).
    pub latency: Option<LatencyCharge>,
    pub counters: TaskCounters,
    /// The device's wait / execution / transfer histograms.
    pub histograms: Arc<[Histogram; 3]>,
    pub telemetry: Arc<Telemetry>,
    /// Its lane's row in the trace.
    pub row: u32,
    /// A launch that could have run inline: its execution time tells the inline guard whether
    /// its shape is short.
    pub inline_shape: Option<(ShapeClass, Arc<InlineGuard>)>,
}

impl LaneCompletion {
    /// As the `done` callback of a device job.
    pub(super) fn into_done(self) -> Done {
        Box::new(move |result, times| self.finish(result, times))
    }

    /// The job ended with `result` at `times`.
    pub(super) fn finish(self, mut result: Result<(), TaskError>, times: JobTimes) {
        if self.injected {
            result = result.and(Err(TaskError::KernelFault));
        }
        if result.is_ok() {
            self.counters.ok.inc()
        } else {
            self.counters.failed.inc()
        };
        let exec_start = times.transfers_done.unwrap_or(times.started);
        let execution = times.finished.saturating_duration_since(exec_start);
        self.lane_pending.fetch_sub(self.predicted, Ordering::Relaxed);
        self.lane_tenants.finished(self.shared.id, self.predicted);
        self.shared.add_device_time(self.device, execution.as_nanos() as u64);
        if self.shared.lane_work_done(self.session_ns) {
            // The session was held back over its lane limits and now has room.
            self.ticket.wake_dispatcher();
        }
        if let Some(charge) = self.latency {
            charge.settle(execution);
        }
        if let (Some((shape, guard)), Ok(())) = (&self.inline_shape, &result) {
            guard.measured_on_lane(*shape, execution.as_nanos() as f64);
        }
        if crate::realtime::is_dag_task(self.task_id) {
            if let Some(realtime) = self.shared.realtime.get() {
                realtime.executed(self.task_id, execution);
            }
        }
        if let (Some(done), Ok(()), false) = (times.transfers_done, &result, times.cold) {
            if self.transfer_bytes > 0 {
                // The device's link, learned as a kernel over bytes (`TRANSFERS`).
                let took = done.saturating_duration_since(times.started).as_nanos() as f64;
                self.model.lock().unwrap_or_else(|e| e.into_inner()).record(
                    crate::policy::model::TRANSFERS,
                    &self.device_name,
                    self.transfer_bytes,
                    took,
                );
            }
        }
        if let Some(k) = self.kernel {
            let mut model = self.model.lock().unwrap_or_else(|e| e.into_inner());
            if result.is_ok() && !times.cold {
                model.record(k.label(), &self.device_name, self.items, execution.as_nanos() as f64);
            } else {
                // Failed, or not typical: let a later task measure it.
                model.abandon_exploring(k.label(), &self.device_name, self.items);
            }
        }
        let histograms = &self.histograms;
        histograms[0].observe(times.started.saturating_duration_since(times.queued).as_secs_f64());
        histograms[1].observe(execution.as_secs_f64());
        if let Some(done) = times.transfers_done {
            histograms[2].observe(done.saturating_duration_since(times.started).as_secs_f64());
        }
        if let Some(trace) = &self.telemetry.trace {
            let span = |category, start, end| Span {
                category,
                name: self.name,
                row: self.row,
                start,
                end,
                session: self.shared.id,
                tenant: self.shared.tenant.clone(),
                task: self.task_id,
                queue: self.queue.name.clone(),
            };
            trace.record(span("wait", times.queued, times.started));
            if let Some(done) = times.transfers_done {
                trace.record(span("transfer", times.started, done));
            }
            trace.record(span("exec", exec_start, times.finished));
        }
        // The rest in issue order within the queue: a task is judged after the tasks it may
        // depend on.
        let (task_id, queue, shared, named, mut ticket) =
            (self.task_id, self.queue, self.shared, self.named, self.ticket);
        let sequencer_queue = queue.clone();
        sequencer_queue.sequencer.in_order(self.sequence, move || {
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
            // client sends next then frees their memory at once, not at the next sweep, and a
            // task issued next may evict them.
            drop(named);
            // Unbound as the completion is posted (under the ring's lock): the dispatcher may
            // run this queue's next task inline as soon as it sees zero, and that completion
            // must come after ours. (Unbinding after posting would keep a client that answers
            // each completion at once on lanes for good.)
            let mut drained = false;
            shared.post_releasing(&[completion], || {
                drained = queue.in_flight.fetch_sub(1, Ordering::AcqRel) == 1;
            });
            // The session's count last: a closing session is reclaimed when it reaches zero.
            shared.in_flight.fetch_sub(1, Ordering::Relaxed);
            drop(shared);
            // A queue being moved may go on now: wake the dispatcher to release its held tasks.
            ticket.queue_drained(&queue, drained);
        });
    }
}
