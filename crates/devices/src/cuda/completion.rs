//! How a CUDA job finishes: an event recorded after its last command, polled by the device's
//! completion thread, which then finishes the job (in each lane's start order).
//!
//! Why not the driver's stream callbacks (`cuStreamAddCallback`, kept as the alternative behind
//! `AGORA_CUDA_COMPLETIONS=callbacks`): on an H200 a job finished from its callback reached the
//! client 51 µs after its launch, against 8.8 µs for a native launch + `cuStreamSynchronize`;
//! the callback thread's wake-up is most of the difference. The completion thread spins over the
//! oldest event of each lane while jobs are in flight (for an adaptive budget, as lanes do), then
//! polls every [`POLL`], waking early when a lane hands over a job; with nothing in flight it
//! polls for the next job a little longer than a client's round trip ([`IDLE_SPIN_MAX`], adaptive),
//! then sleeps on a condition variable. One thread per GPU, not one per command. It never blocks on
//! one event (`cuEventSynchronize`): a long kernel of one tenant would then hold every other
//! lane's completions until it ended.
//!
//! Per-launch limits: a tenant's fenced kernel is stopped once it ran `[programs] timeout_ms` from
//! the head of its lane ([`Watchdog`]): this thread writes the launch's number into the lane's stop
//! word, which the kernel's loops poll, and fails the job with `KernelTimeout` when it ended.
//!
//! Revocation: a revocable job's kernel polls its lane's revocation flag in mapped host memory;
//! while such a job is in flight this thread copies the job's flag into it (so a running kernel
//! stops at its next work-group, TReM-style), polling every [`MIRROR_POLL`] instead of blocking.
//!
//! Times: a job's kernel cannot start before the job ahead of it on the lane's stream ended, so
//! the thread starts each job's time no earlier than when it saw that one finish; jobs seen
//! finished in the same look as their predecessor are left out of the performance model (their
//! own time is unknown). Counted from when the lane enqueued them, pipelined kernels looked as
//! long as the queue ahead of them.
//!
//! Owns the in-flight queues and the event pool. It must not enqueue commands.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use agora_protocol::TaskError;
use agora_wait::AdaptiveSpin;
use cudarc::driver::sys::{self, CUevent, CUresult, CUstream};

use super::device::Shared;
use crate::lane::JobEnd;
use crate::{Transfer, Work};

/// Longest the completion thread polls before it blocks on the oldest event.
const SPIN_MAX: Duration = Duration::from_micros(500);
/// While a revocable kernel runs, how often the completion thread copies its flag: the
/// revocation latency it adds, at most.
const MIRROR_POLL: Duration = Duration::from_micros(50);
/// How long the completion thread sleeps between polls once its spin ran out (unless a lane hands
/// over a job first): the completion latency it adds, at most, to jobs longer than the spin.
const POLL: Duration = Duration::from_micros(100);
/// Longest the completion thread, with nothing in flight, polls for a lane's next job before it
/// sleeps (the budget adapts below it, down to [`agora_wait::MIN_BUDGET`]): a little more than a
/// client's round trip, so a client launching one kernel at a time finds the thread awake. Asleep,
/// every launch paid a wake-up (a futex and the scheduler) on top of the kernel.
const IDLE_SPIN_MAX: Duration = Duration::from_micros(250);

/// A started job: what it holds until its commands are done.
pub(super) struct Pending {
    pub(super) end: JobEnd,
    // The commands read and write the memory these point to.
    pub(super) transfers: Vec<Transfer>,
    pub(super) work: Work,
    /// A revocable launch whose kernel reads its lane's mapped flag: mirrored while it runs.
    pub(super) mirror: Option<Mirror>,
    /// A tenant's fenced launch: stopped when it runs longer than the per-launch limit.
    pub(super) watchdog: Option<Watchdog>,
}

/// The per-launch limit of a tenant's fenced kernel: once the launch has run `limit`, the
/// completion thread writes its number into the lane's stop word (mapped host memory), which the
/// kernel's threads poll at their loops' backward branches (see `fence`), and the job fails with
/// `KernelTimeout` when the kernel has stopped. The GPU goes on with the other tenants' work.
pub(super) struct Watchdog {
    /// The lane's stop word, where the host writes it.
    pub(super) stop: *mut u32,
    /// This launch's number.
    pub(super) launch: u32,
    pub(super) limit: Duration,
    /// When the launch was first seen at the head of its lane (running, or about to).
    pub(super) running_since: Option<Instant>,
    /// Whether its stop was asked for.
    pub(super) fired: bool,
}

// SAFETY: `stop` is the lane's mapped word, alive while the device is; the host only writes it
// with volatile stores, which the kernel only reads.
unsafe impl Send for Watchdog {}

impl Watchdog {
    /// Starts the clock when the launch reaches the head of its lane, and stops the kernel once
    /// it ran past the limit.
    fn watch(&mut self, now: Instant) {
        let since = *self.running_since.get_or_insert(now);
        if !self.fired && now.duration_since(since) >= self.limit {
            // SAFETY: see the type.
            unsafe { std::ptr::write_volatile(self.stop, self.launch) };
            self.fired = true;
        }
    }
}

/// A revocable job's flag, and the lane's mapped byte its kernel polls.
pub(super) struct Mirror {
    pub(super) flag: Arc<AtomicBool>,
    pub(super) host: *mut u8,
}

// SAFETY: `host` is the lane's mapped byte, alive while the device is; writes to it are volatile
// byte stores that the kernel only reads.
unsafe impl Send for Mirror {}

impl Mirror {
    /// Copies a set flag into the mapped byte (the kernel's work-groups see it as they start).
    fn copy(&self) {
        if self.flag.load(Ordering::Acquire) {
            // SAFETY: see the type.
            unsafe { std::ptr::write_volatile(self.host, 1) };
        }
    }
}

impl Pending {
    /// The job's outcome once its commands ended with `result`: `Cancelled` when its kernel
    /// polled a revocation flag that is now set (its writes may be partial; the daemon restores
    /// and replays it). The flag may have been set after the last block started, so the run may
    /// be complete: then the replay is needless, never wrong.
    fn outcome(&self, result: Result<(), TaskError>) -> Result<(), TaskError> {
        if let Some(watchdog) = self.watchdog.as_ref().filter(|w| w.fired) {
            // The stopped kernel has ended: clear its number, so the lane's launch numbers can
            // wrap around without a stale one ever stopping a later launch.
            // SAFETY: see `Watchdog`; only this thread writes the word.
            unsafe { std::ptr::write_volatile(watchdog.stop, 0) };
        }
        match (&result, &self.mirror, &self.watchdog) {
            // Stopped at the limit: its writes are partial (the daemon poisons them).
            (Ok(()), _, Some(watchdog)) if watchdog.fired => Err(TaskError::KernelTimeout {
                limit_ms: watchdog.limit.as_millis() as u64,
            }),
            (Ok(()), Some(mirror), _) if mirror.flag.load(Ordering::Acquire) => Err(TaskError::Cancelled),
            _ => result,
        }
    }

    /// Finishes the job, letting go of its device buffers first (the scheduler may evict and
    /// reuse their memory as soon as it sees the task done).
    pub(super) fn finish(self, result: Result<(), TaskError>) {
        let Pending {
            end, transfers, work, ..
        } = self;
        drop(work);
        drop(transfers);
        end.finish(result);
    }
}

struct InFlight {
    event: CUevent,
    pending: Pending,
}

// SAFETY: an event handle is a process-wide driver handle; the rest is Send.
unsafe impl Send for InFlight {}

/// The in-flight jobs of a device's lanes, and the thread that finishes them.
pub(super) struct Completions {
    lanes: Mutex<Vec<VecDeque<InFlight>>>,
    wake: Condvar,
    sleeping: AtomicBool,
    stopping: AtomicBool,
    /// Jobs in the lanes' queues: what the idle thread polls without taking the lock.
    in_flight: AtomicUsize,
    /// Finished events, for reuse (creating one per job would cost a driver call each).
    events: Mutex<Vec<CUevent>>,
    /// Per lane, when its last job was seen finished: the next job on the lane's stream could
    /// not start before (see [`JobEnd::started_no_earlier_than`]).
    last_finished: Mutex<Vec<Option<Instant>>>,
}

// SAFETY: event handles are process-wide driver handles; everything is behind mutexes or atomic.
unsafe impl Send for Completions {}
// SAFETY: as above.
unsafe impl Sync for Completions {}

impl Completions {
    pub(super) fn new(lanes: usize) -> Self {
        Completions {
            lanes: Mutex::new((0..lanes).map(|_| VecDeque::new()).collect()),
            wake: Condvar::new(),
            sleeping: AtomicBool::new(false),
            stopping: AtomicBool::new(false),
            in_flight: AtomicUsize::new(0),
            events: Mutex::new(Vec::new()),
            last_finished: Mutex::new(vec![None; lanes]),
        }
    }

    /// Records an event after `stream`'s commands so far and queues `pending` to finish when it
    /// has happened. On a driver error the job is handed back with it (boxed: rare, and the job
    /// is large).
    pub(super) fn track(
        &self,
        shared: &Shared,
        lane: usize,
        stream: CUstream,
        pending: Pending,
    ) -> Result<(), Box<(Pending, TaskError)>> {
        let event = match self.events.lock().unwrap_or_else(|e| e.into_inner()).pop() {
            Some(event) => event,
            None => {
                let flags = sys::CUevent_flags::CU_EVENT_DISABLE_TIMING as u32;
                let mut event = std::ptr::null_mut();
                // SAFETY: creates an event in the current context (the lane thread's).
                match unsafe { sys::cuEventCreate(&mut event, flags) } {
                    CUresult::CUDA_SUCCESS => event,
                    code => return Err(Box::new((pending, shared.error(code)))),
                }
            }
        };
        // SAFETY: a live event and stream of the same context.
        let recorded = unsafe { sys::cuEventRecord(event, stream) };
        if recorded != CUresult::CUDA_SUCCESS {
            self.events.lock().unwrap_or_else(|e| e.into_inner()).push(event);
            return Err(Box::new((pending, shared.error(recorded))));
        }
        {
            let mut lanes = self.lanes.lock().unwrap_or_else(|e| e.into_inner());
            lanes[lane].push_back(InFlight { event, pending });
            // Under the lock, as `ready`'s decrement: the count never goes below zero.
            self.in_flight.fetch_add(1, Ordering::SeqCst);
        }
        if self.sleeping.load(Ordering::SeqCst) {
            // Under the lock, so the wake is not lost between its check and its wait.
            let _guard = self.lanes.lock().unwrap_or_else(|e| e.into_inner());
            self.wake.notify_one();
        }
        Ok(())
    }

    /// Stops the completion thread once nothing is in flight.
    pub(super) fn stop(&self) {
        self.stopping.store(true, Ordering::SeqCst);
        let _guard = self.lanes.lock().unwrap_or_else(|e| e.into_inner());
        self.wake.notify_one();
    }

    /// Destroys the pooled events (the context must be current; the thread has stopped).
    pub(super) fn destroy_events(&self) {
        for event in self.events.lock().unwrap_or_else(|e| e.into_inner()).drain(..) {
            // SAFETY: no command records or waits on a pooled event.
            let _ = unsafe { sys::cuEventDestroy_v2(event) };
        }
    }

    /// Takes every job whose event has happened (or failed), oldest first per lane.
    fn ready(&self, shared: &Shared) -> Vec<(Pending, Result<(), TaskError>, CUevent)> {
        let mut lanes = self.lanes.lock().unwrap_or_else(|e| e.into_inner());
        let mut last_finished = self.last_finished.lock().unwrap_or_else(|e| e.into_inner());
        let mut done = Vec::new();
        let now = Instant::now();
        for (lane, last) in lanes.iter_mut().zip(last_finished.iter_mut()) {
            if let Some(watchdog) = lane.front_mut().and_then(|head| head.pending.watchdog.as_mut()) {
                watchdog.watch(now);
            }
            let mut first = true;
            while let Some(head) = lane.front() {
                // SAFETY: a live event recorded on a stream of this context.
                let result = match unsafe { sys::cuEventQuery(head.event) } {
                    CUresult::CUDA_ERROR_NOT_READY => break,
                    CUresult::CUDA_SUCCESS => Ok(()),
                    code => Err(shared.error(code)),
                };
                let mut head = lane.pop_front().expect("a head");
                if first {
                    if let Some(previous) = *last {
                        head.pending.end.started_no_earlier_than(previous);
                    }
                } else {
                    // Finished in the same look as the one before it on this lane: it ran
                    // somewhere in between, its own time is unknown, so the model skips it.
                    head.pending.end.mark_cold();
                }
                first = false;
                *last = Some(now);
                let result = head.pending.outcome(result);
                done.push((head.pending, result, head.event));
            }
        }
        self.in_flight.fetch_sub(done.len(), Ordering::SeqCst);
        done
    }

    /// Copies the set flags of running revocable jobs into their lanes' mapped bytes.
    fn mirror_flags(lanes: &[VecDeque<InFlight>]) {
        for job in lanes.iter().flatten() {
            if let Some(mirror) = &job.pending.mirror {
                mirror.copy();
            }
        }
    }

    /// Whether a revocable job whose kernel polls a mapped flag is in flight (copying its flag).
    /// (Watchdogs need no faster polling: the thread looks every [`POLL`] while anything is in
    /// flight, and a per-launch limit is counted in milliseconds.)
    fn mirroring(&self) -> bool {
        let lanes = self.lanes.lock().unwrap_or_else(|e| e.into_inner());
        Self::mirror_flags(&lanes);
        lanes.iter().flatten().any(|job| job.pending.mirror.is_some())
    }

    /// The completion thread's loop.
    pub(super) fn run(self: Arc<Self>, shared: Arc<Shared>) {
        if shared.bind().is_err() {
            tracing::error!(device = %shared.name, "the completion thread cannot use the GPU's context");
        }
        let mut spin = AdaptiveSpin::new(agora_wait::MIN_BUDGET, SPIN_MAX);
        let mut idle_spin = AdaptiveSpin::new(agora_wait::MIN_BUDGET, IDLE_SPIN_MAX);
        loop {
            let done = self.ready(&shared);
            if !done.is_empty() {
                let mut events = Vec::with_capacity(done.len());
                for (pending, result, event) in done {
                    pending.finish(result);
                    events.push(event);
                }
                self.events.lock().unwrap_or_else(|e| e.into_inner()).extend(events);
                shared.free_deferred();
                continue;
            }
            if self.in_flight.load(Ordering::Acquire) == 0 {
                let next_job = || self.in_flight.load(Ordering::Acquire) > 0 || self.stopping.load(Ordering::Acquire);
                // Stopping ends the spin too, and then the thread returns below.
                if idle_spin.spin(next_job) && !self.stopping.load(Ordering::Acquire) {
                    continue;
                }
                let mut lanes = self.lanes.lock().unwrap_or_else(|e| e.into_inner());
                if lanes.iter().all(VecDeque::is_empty) {
                    if self.stopping.load(Ordering::SeqCst) {
                        return;
                    }
                    let asleep = Instant::now();
                    self.sleeping.store(true, Ordering::SeqCst);
                    lanes = self.wake.wait(lanes).unwrap_or_else(|e| e.into_inner());
                    self.sleeping.store(false, Ordering::SeqCst);
                    idle_spin.blocked_for(asleep.elapsed());
                }
                drop(lanes);
                continue;
            }
            let ready = spin.spin(|| {
                let lanes = self.lanes.lock().unwrap_or_else(|e| e.into_inner());
                Self::mirror_flags(&lanes);
                lanes.iter().filter_map(|l| l.front()).any(|head| {
                    // SAFETY: as in `ready`.
                    let state = unsafe { sys::cuEventQuery(head.event) };
                    state != CUresult::CUDA_ERROR_NOT_READY
                })
            });
            if !ready {
                // Nothing finished within the spin: wait a little, or until a lane hands over a
                // new job (it may be a short latency-class one, worth spinning for again).
                // Never a blocking wait on one event: a long kernel on one lane would hold every
                // other lane's completions, another tenant's latency work included, until it ends.
                let mirroring = self.mirroring();
                let lanes = self.lanes.lock().unwrap_or_else(|e| e.into_inner());
                self.sleeping.store(true, Ordering::SeqCst);
                // Not `spin.blocked_for`: a poll is not an event, and growing the budget after
                // each one would keep this thread spinning through every long kernel; the spin
                // that ran out already halved it.
                let _ = self
                    .wake
                    .wait_timeout(lanes, if mirroring { MIRROR_POLL } else { POLL })
                    .unwrap_or_else(|e| e.into_inner());
                self.sleeping.store(false, Ordering::SeqCst);
            }
        }
    }
}
