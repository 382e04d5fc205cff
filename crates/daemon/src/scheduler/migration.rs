//! Live migration of queues between devices, device drain, and what happens when a device fails.
//!
//! Owns: which devices are draining or failed; the tasks held back, in issue order, for queues
//! being moved; the tasks a failed device lost, on their way back to the dispatcher for replay.
//! Must not copy buffers itself or eagerly: a buffer moves only when a task that names it is
//! planned on the new device (`memory::Placement::prepare` plans device → host segment → device),
//! so only the buffers a moved queue's pending tasks use ever move. Must not touch queues that are
//! not being moved, nor reorder a queue's tasks.
//!
//! The protocol (DESIGN.md §3, "Late binding"), for one queue:
//! 1. **Orphan.** A task arrives for a queue that has tasks in flight on a device it must leave:
//!    the device is draining or failed, or it lacks the task's kernel, or the launch is beyond its
//!    limits (`Device::check_launch`). The task is held, and so is every later task of that
//!    queue, in order.
//! 2. **Let in-flight tasks finish** where they are; the lane's order keeps their completions in
//!    issue order, and they are posted before any held task can run.
//! 3. **Rebind.** Once nothing is in flight, the held tasks are dispatched again in order. The
//!    first one finds the queue idle, so the policy picks its lane among the devices that are not
//!    draining, implement the kernel and take the launch; the rest follow it to that lane.
//! 4. **Move only what is needed**, lazily, as each task is planned (step 4 above).
//!
//! The same hold serves a queue whose tasks in flight went to measure a device never measured
//! for the kernel (`QueueState::exploring`, set by `place`): its next launch and everything after
//! it wait for that measurement and are then placed by it, as tasks of an idle queue — not a
//! migration (nothing is counted), but the same order and release.
//!
//! Draining a device (`Request::Drain`, `agora drain`) just marks it: no policy picks it again,
//! and its queues migrate by the protocol as their next tasks arrive. Its buffers stay readable
//! there and move on demand; with `evacuate` (`agora drain --evacuate`, before removing the
//! device) the idle ones are written back to host memory and freed there at once.
//!
//! A **failed** device (its backend's `Device::healthy` turned false; its jobs fail with
//! `TaskError::DeviceLost`) is drained for good, and its copies are forgotten
//! (`Residency::forget_device`): a buffer whose only valid copy was there falls back to its older
//! host copy, marked lost. Each job it fails is not completed: its done callback sends the task
//! back here ([`Ticket::divert`]) with its in-flight count still held, and the dispatcher puts it
//! at the head of its queue's held tasks (before any newer one), so the queue waits for all of
//! them. Replayed in order, a task re-plans from the copies that survive. An input it read from
//! the host copy when it was first planned is still there (the lost mark is cleared for it);
//! a task that reads a lost buffer otherwise completes with `TaskError::DataLost`, and one whose
//! kernel no surviving device implements with `TaskError::NoDevice`. A job that fails on a device
//! that still works (it was reading a buffer from the dead one) is not replayed, since its queue's
//! later jobs are already queued behind it on that lane: it completes in order with `DataLost`
//! and the dispatcher only corrects its buffers' placement. A task is replayed at most
//! [`MAX_REPLAYS`] times; after that `DeviceLost` reaches the client.

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

use agora_protocol::{Access, Completion, TaskError};
use agora_transport::wake::Doorbell;

use super::allocation::AllocationWait;
use super::plan::NamedBuffers;
use super::{Action, Ready, Scheduler};
use crate::session::{QueueState, Session, SessionShared};

/// Most times one task is replayed after `DeviceLost` before the error reaches the client (a
/// backend that keeps losing the task must not make it loop forever).
pub(crate) const MAX_REPLAYS: u8 = 2;

/// How often the dispatcher asks a failed device whether it is back.
const REVIVE_EVERY: std::time::Duration = std::time::Duration::from_millis(100);

/// How long after a failure the dispatcher wakes just to ask (later, only when it runs anyway).
const REVIVE_FOR: std::time::Duration = std::time::Duration::from_secs(300);

/// Counters for the status report.
#[derive(Debug, Default, Clone, Copy)]
pub(crate) struct MigrationStats {
    /// Queues orphaned and moved (or being moved).
    pub migrations: u64,
    /// Lost tasks dispatched again.
    pub replayed: u64,
    /// Lost tasks that could not be replayed (completed with an error).
    pub lost: u64,
    /// Failed devices that came back (a device host restarted).
    pub revivals: u64,
    /// Tasks that waited for device memory (their buffers fit the device but not then), each
    /// counted once however often it was placed again before the room came.
    pub memory_waits: u64,
}

/// A task held back for a queue being moved.
struct Held {
    task_id: u64,
    ready: Ready,
    /// For a task a failed device lost: its replay record.
    replay: Option<Replay>,
    /// The device it waited for allocations asked ahead on (it will not wait there again).
    allocated: Option<usize>,
    /// It waited for room already (counted in `memory_waits` once).
    waited_for_room: bool,
    /// A DAG node job's lane and deadline (`Scheduler::deadline_job`): it goes back to that
    /// lane with that deadline when it is dispatched again.
    deadline: Option<(crate::session::Binding, std::time::Instant)>,
}

#[derive(Clone, Copy)]
pub(super) struct Replay {
    /// The device the lost job was planned on.
    device: usize,
    /// Buffer slots whose host copy was current when the task was first planned.
    host_inputs: u16,
    /// Buffer slots whose copy on `device` was current when the task was first planned.
    device_inputs: u16,
    /// Times it has been replayed before.
    replays: u8,
}

// SAFETY: as for `Ticket`: a held task's action has not been planned, so its argument array
// holds scalars only (buffer entries are `ArgValue::None`, resolved to pointers by `plan` into
// its own copy); the rest is `Arc`s of `Send + Sync` records.
unsafe impl Send for Held {}

/// One queue's held tasks: lost tasks first (in issue order), then newer ones.
struct HeldQueue {
    queue: Arc<QueueState>,
    tasks: VecDeque<Held>,
    /// How many leading entries of `tasks` are lost tasks.
    replays: usize,
    /// Held for an answer its first task needs, not for its queue's tasks in flight: released
    /// once it came, whatever the queue still has in flight, instead of once that is nothing.
    waiting_for: Option<Answers>,
}

/// What a held queue's first task waits for, when not for its queue's tasks in flight.
pub(super) enum Answers {
    /// Its allocations on a device in a device host (`allocation`).
    Allocations(Arc<AllocationWait>),
    /// The write-backs of these buffers (evictions that did not wait; `memory::WriteBack`): it
    /// names them, or needs the room they free.
    WriteBacks(Vec<Arc<crate::memory::BufferRecord>>),
    /// Room for this many bytes in the daemon's capture memory (a checkpoint task while other
    /// captures wait to be written; the writer rings the dispatcher's doorbell as it frees them).
    CaptureMemory(Arc<crate::checkpoint::CaptureMemory>, u64),
}

impl HeldQueue {
    fn releasable(&self) -> bool {
        let drained = self.queue.in_flight.load(Ordering::Acquire) == 0;
        let answered = match &self.waiting_for {
            None => return drained,
            Some(Answers::Allocations(wait)) => wait.answered(),
            Some(Answers::WriteBacks(records)) => records.iter().all(|r| !r.writing_back.load(Ordering::Acquire)),
            Some(Answers::CaptureMemory(memory, bytes)) => memory.has_room(*bytes),
        };
        // Lost tasks that joined it wait for the rest of their queue to come back first.
        answered && (self.replays == 0 || drained)
    }
}

/// Why a queue's tasks are held (counted differently).
#[derive(Clone, Copy, PartialEq, Eq)]
enum HoldReason {
    /// A migration, counted when its hold begins.
    Moving,
    /// Room on its device: counted per task by [`Scheduler::wait_for_room`], which a task held
    /// again and again while the room does not come passes through each time.
    Room,
    /// An answer its first task waits for (allocations, write-backs): counted as neither.
    Answer,
    /// The measurement its task in flight is taking of a device never measured for the kernel
    /// (`QueueState::exploring`): counted as neither.
    Measurement,
}

/// A task a failed device lost, sent back by its done callback.
struct Lost {
    shared: Arc<SessionShared>,
    queue: Arc<QueueState>,
    task_id: u64,
    /// What a replay needs; `None` for a task that completed where it ran (its own device works;
    /// a device it read from died): only its buffers' placement is corrected.
    task: Option<(Action, NamedBuffers)>,
    /// Its buffer arguments: (slot, buffer, access).
    entries: Vec<(usize, Arc<crate::memory::BufferRecord>, Access)>,
    estimated_ns: f64,
    items: u64,
    replay: Replay,
}

// SAFETY: as for `Held`: `action` is the unplanned copy taken by the `Ticket`.
unsafe impl Send for Lost {}

/// Where lane threads send lost tasks; the dispatcher empties it.
pub(crate) struct Inbox {
    /// The daemon's devices (a ticket names its job's device by index).
    devices: Vec<Arc<dyn agora_devices::Device>>,
    lost: Mutex<Vec<Lost>>,
    pending: AtomicBool,
    /// Wakes the dispatcher if it sleeps.
    wake: Mutex<Option<Arc<Doorbell>>>,
}

impl Inbox {
    fn wake(&self) {
        if let Some(wake) = &*self.wake.lock().unwrap_or_else(|e| e.into_inner()) {
            wake.ring();
        }
    }
}

/// Migration state; owned by the scheduler, used only on the dispatcher thread (except the
/// inbox, which lane threads fill).
pub(crate) struct Migration {
    draining: Vec<bool>,
    failed: Vec<bool>,
    /// Whether the operator drained the device (restored when a failed device comes back).
    drained_by_operator: Vec<bool>,
    /// For each failed device: when it failed and when the dispatcher last asked it to revive.
    reviving: Vec<Option<(std::time::Instant, std::time::Instant)>>,
    /// A device failed, or a session resumed with lost buffers: tasks are checked for reading
    /// lost data ([`check_lost`]); until then that check costs nothing.
    pub(super) any_failed: bool,
    inbox: Arc<Inbox>,
    /// Held queues by session id.
    held: HashMap<u64, Vec<HeldQueue>>,
    /// Replay count of the task being dispatched again (read by [`Ticket::new`]).
    pub(super) replaying: Option<Replay>,
    /// The device on which the task being dispatched again already waited for allocations
    /// asked ahead: it does not wait there again (`allocation`). Placed on another device (the
    /// first failed meanwhile), it waits there like any task.
    pub(super) allocated_late: Option<usize>,
    /// The task being dispatched again already waited for room (it is not counted again).
    pub(super) room_waited: bool,
    /// The replay being dispatched was held again (to wait for room or answers), its record
    /// with it: it counts as replayed when it is dispatched for good.
    replay_held: bool,
    pub stats: MigrationStats,
}

impl Migration {
    pub(crate) fn new(devices: Vec<Arc<dyn agora_devices::Device>>) -> Self {
        Migration {
            draining: vec![false; devices.len()],
            failed: vec![false; devices.len()],
            drained_by_operator: vec![false; devices.len()],
            reviving: vec![None; devices.len()],
            any_failed: false,
            inbox: Arc::new(Inbox {
                devices,
                lost: Mutex::new(Vec::new()),
                pending: AtomicBool::new(false),
                wake: Mutex::new(None),
            }),
            held: HashMap::new(),
            replaying: None,
            allocated_late: None,
            room_waited: false,
            replay_held: false,
            stats: MigrationStats::default(),
        }
    }

    /// The doorbell the dispatcher sleeps on, rung when a lost task arrives.
    pub(crate) fn set_wake(&self, wake: Arc<Doorbell>) {
        *self.inbox.wake.lock().unwrap_or_else(|e| e.into_inner()) = Some(wake);
    }

    /// Whether the policy may place new work on `device`.
    pub(crate) fn usable(&self, device: usize) -> bool {
        !self.draining.get(device).copied().unwrap_or(false)
    }

    pub(crate) fn is_draining(&self, device: usize) -> bool {
        self.draining[device]
    }

    pub(crate) fn is_failed(&self, device: usize) -> bool {
        self.failed[device]
    }

    /// Whether a failed device may come back soon ([`agora_devices::Device::revive`]): the
    /// dispatcher wakes now and then to ask it, for at most [`REVIVE_FOR`] after the failure.
    pub(crate) fn awaiting_revival(&self) -> bool {
        self.reviving
            .iter()
            .flatten()
            .any(|(failed, _)| failed.elapsed() < REVIVE_FOR)
    }

    /// Whether some queue has held tasks.
    #[cfg(test)]
    pub(crate) fn holding(&self) -> bool {
        !self.held.is_empty() || self.inbox.pending.load(Ordering::Acquire)
    }

    /// Whether the dispatcher must look again soon without being woken: some held tasks wait for
    /// their queue's tasks in flight (nothing wakes it when those finish), or lost tasks came
    /// back. Tasks that wait only for answers (allocations, write-backs) need no look: the
    /// answer rings the dispatcher's doorbell.
    pub(crate) fn needs_polling(&self) -> bool {
        self.inbox.pending.load(Ordering::Acquire)
            || self
                .held
                .values()
                .flatten()
                .any(|list| list.waiting_for.is_none() || list.replays > 0)
    }

    /// Forgets a closed session's held tasks (its client is gone; nothing will read them).
    pub(crate) fn forget_session(&mut self, session: u64) {
        self.held.remove(&session);
    }

    /// Whether `queue`'s tasks are being held (it is being moved).
    pub(super) fn is_held(&mut self, session: u64, queue: &Arc<QueueState>) -> bool {
        self.list_mut(session, queue).is_some()
    }

    /// Wakes the dispatcher when a moving queue drains, for completions posted outside a lane
    /// job's own callback.
    pub(super) fn drain_waker(&self) -> DrainWaker {
        DrainWaker(self.inbox.clone())
    }

    fn list_mut(&mut self, session: u64, queue: &Arc<QueueState>) -> Option<&mut HeldQueue> {
        // The common case, on the per-task path: nothing is being moved.
        if self.held.is_empty() {
            return None;
        }
        self.held
            .get_mut(&session)?
            .iter_mut()
            .find(|h| Arc::ptr_eq(&h.queue, queue))
    }

    fn list_or_new(&mut self, session: u64, queue: &Arc<QueueState>) -> &mut HeldQueue {
        self.held_list(session, queue, HoldReason::Moving)
    }

    /// The record of the replay being dispatched, for a task held again (see `replay_held`).
    fn take_replay(&mut self) -> Option<Replay> {
        let replay = self.replaying.take();
        self.replay_held |= replay.is_some();
        replay
    }

    /// The held list of `queue`, new if it had none (counted by `reason`: a migration, a wait
    /// for memory, or neither).
    fn held_list(&mut self, session: u64, queue: &Arc<QueueState>, reason: HoldReason) -> &mut HeldQueue {
        let lists = self.held.entry(session).or_default();
        match lists.iter().position(|h| Arc::ptr_eq(&h.queue, queue)) {
            Some(i) => &mut lists[i],
            None => {
                match reason {
                    HoldReason::Moving => {
                        self.stats.migrations += 1;
                        queue.binding.first_move_from(queue.binding.load());
                    }
                    HoldReason::Room | HoldReason::Answer | HoldReason::Measurement => {}
                }
                queue.moving.store(true, Ordering::Release);
                lists.push(HeldQueue {
                    queue: queue.clone(),
                    tasks: VecDeque::new(),
                    replays: 0,
                    waiting_for: None,
                });
                lists.last_mut().expect("just pushed")
            }
        }
    }
}

/// What a job's done callback needs to send its task back when the device lost it.
pub(super) struct Ticket {
    inbox: Arc<Inbox>,
    /// Taken when the task is sent back.
    action: Option<Action>,
    estimated_ns: f64,
    items: u64,
    replay: Replay,
}

// SAFETY: the only non-`Send` part is `action`'s argument array, whose buffer entries are still
// `ArgValue::None` here (the ticket is taken before planning fills in host pointers, and `plan`
// fills its own copy); scalars and `&'static` kernel definitions are plain data.
unsafe impl Send for Ticket {}

impl Ticket {
    /// Takes what a replay needs, before `action` is planned: a copy of the action and which
    /// of its buffers' host copies are current now.
    pub(super) fn new(
        migration: &mut Migration,
        device: usize,
        action: &Action,
        estimated_ns: f64,
        items: u64,
        buffers: &[Option<(Arc<crate::memory::BufferRecord>, Access, bool)>],
    ) -> Ticket {
        let (mut host_inputs, mut device_inputs) = (0u16, 0u16);
        for (slot, entry) in buffers.iter().enumerate() {
            if let Some((record, _, _)) = entry {
                let placement = record.placement();
                host_inputs |= u16::from(placement.host_valid()) << slot;
                device_inputs |= u16::from(placement.valid_on(device)) << slot;
            }
        }
        let replays = migration.replaying.take().map_or(0, |r| r.replays + 1);
        Ticket {
            inbox: migration.inbox.clone(),
            // Only a device with memory of its own can lose a task (one computing on host
            // memory cannot fail apart from the host); skipping the copy keeps the inline path,
            // which runs only there, as cheap as before.
            action: (!migration.inbox.devices[device].info().shares_host_memory).then(|| action.clone()),
            estimated_ns,
            items,
            replay: Replay {
                device,
                host_inputs,
                device_inputs,
                replays,
            },
        }
    }

    /// A ticket for a job on the host device (it cannot lose the job):
    /// never replays, only wakes the dispatcher when its queue drains.
    pub(super) fn unreplayable(migration: &Migration, device: usize) -> Ticket {
        // The host device: it computes on host memory, or (strict coherence) on private copies
        // in host memory; either way it cannot lose a job apart from the daemon.
        let info = migration.inbox.devices[device].info();
        debug_assert!(info.shares_host_memory || info.kind == agora_protocol::DeviceKind::Cpu);
        Ticket {
            inbox: migration.inbox.clone(),
            action: None,
            estimated_ns: 0.0,
            items: 0,
            replay: Replay {
                device,
                host_inputs: 0,
                device_inputs: 0,
                replays: MAX_REPLAYS,
            },
        }
    }

    /// Called by the job's done callback. When the device lost the task (and it may still be
    /// replayed), sends it back to the dispatcher and returns `None`: the callback must then not
    /// complete it nor release its in-flight count. Otherwise hands `named` back, with `result`
    /// rewritten when the job failed reading from a device that died.
    pub(super) fn divert(
        &mut self,
        result: &mut Result<(), TaskError>,
        shared: &Arc<SessionShared>,
        queue: &Arc<QueueState>,
        task_id: u64,
        named: NamedBuffers,
    ) -> Option<NamedBuffers> {
        if *result != Err(TaskError::DeviceLost) || shared.cancelled.load(Ordering::Acquire) {
            return Some(named);
        }
        let entries = named
            .slots()
            .iter()
            .enumerate()
            .filter_map(|(slot, e)| e.as_ref().map(|(record, access, _)| (slot, record.clone(), *access)))
            .collect();
        let device_works = self.inbox.devices[self.replay.device].healthy();
        let replayable = !device_works && self.replay.replays < MAX_REPLAYS;
        let (task, named) = match (replayable, self.action.take()) {
            (true, Some(action)) => (Some((action, named)), None),
            (_, action) => {
                self.action = action;
                (None, Some(named))
            }
        };
        if task.is_none() && device_works {
            // Its own device works: a device it read a buffer from died, and that buffer's only
            // current copy with it. Completed here, in order (a replay would let the queue's
            // later jobs, already on this lane, overtake it), naming the buffer it could not read.
            let fetched = !(self.replay.host_inputs | self.replay.device_inputs);
            let slot = named.as_ref().and_then(|n| {
                n.slots()
                    .iter()
                    .enumerate()
                    .position(|(i, e)| e.is_some() && fetched & (1 << i) != 0)
            });
            if let Some(index) = slot {
                *result = Err(TaskError::DataLost { index: index as u16 });
            }
        }
        let inbox = self.inbox.clone();
        inbox.lost.lock().unwrap_or_else(|e| e.into_inner()).push(Lost {
            shared: shared.clone(),
            queue: queue.clone(),
            task_id,
            task,
            entries,
            estimated_ns: self.estimated_ns,
            items: self.items,
            replay: self.replay,
        });
        inbox.pending.store(true, Ordering::Release);
        inbox.wake();
        named
    }

    /// Called by the done callback after the queue's in-flight count dropped (`drained`: to
    /// zero): a queue being moved can be released now, so the dispatcher should look.
    pub(super) fn queue_drained(&self, queue: &QueueState, drained: bool) {
        if drained && queue.moving.load(Ordering::Acquire) {
            self.inbox.wake();
        }
    }

    /// Wakes the dispatcher if it sleeps (a session it held back has room again).
    pub(super) fn wake_dispatcher(&self) {
        self.inbox.wake();
    }
}

/// See [`Migration::drain_waker`].
pub(super) struct DrainWaker(Arc<Inbox>);

impl DrainWaker {
    /// Wakes the dispatcher if it sleeps (held tasks may be released).
    pub(super) fn wake_dispatcher(&self) {
        self.0.wake();
    }

    /// `drained`: the queue's in-flight count dropped to zero.
    pub(super) fn queue_drained(&self, queue: &QueueState, drained: bool) {
        if drained && queue.moving.load(Ordering::Acquire) {
            self.0.wake();
        }
    }
}

/// Whether `ready` reads a buffer that a device failure lost; `Err(DataLost)` names it.
pub(super) fn check_lost(ready: &Ready) -> Result<(), TaskError> {
    for (slot, entry) in ready.buffers[..ready.slots].iter().enumerate() {
        let Some((record, access, overwrites)) = entry else {
            continue;
        };
        if !record.placement().lost {
            continue;
        }
        let reads = match &ready.action {
            // Rewrites the host copy: that is how a client repairs a lost buffer.
            Action::SyncTo => false,
            Action::SyncFrom | Action::Checkpoint { .. } => true,
            Action::Launch { .. } => !(*access == Access::Write && *overwrites),
            Action::Fill { offset, len, .. } => !(*offset == 0 && *len == record.len),
            Action::Copy { dst_offset, len, .. } => slot == 0 || !(*dst_offset == 0 && *len == record.len),
        };
        if reads {
            return Err(TaskError::DataLost { index: slot as u16 });
        }
    }
    Ok(())
}

impl Scheduler {
    /// Some buffer may now be lost without a device failure (a session resumed after a daemon
    /// restart with buffers whose newest contents died): from now on tasks are checked for
    /// reading lost data.
    pub(crate) fn buffers_lost_elsewhere(&mut self) {
        self.migration.any_failed = true;
    }

    /// Dispatch hook: whether `ready` must be held because its queue is being moved, or must
    /// start moving (busy on a device it must leave; this orphans the queue). Borrows the task:
    /// this runs for every task, most of which go straight on.
    pub(super) fn must_hold(&mut self, session: u64, ready: &Ready) -> Result<bool, TaskError> {
        if self.migration.list_mut(session, &ready.queue).is_some() {
            return Ok(true);
        }
        if self.migration.any_failed {
            check_lost(ready)?;
        }
        let queue = &ready.queue;
        if queue.in_flight.load(Ordering::Acquire) == 0 {
            // An idle queue leaves a device it may not use with this task, nothing held: one
            // migration per binding left, however many tasks it takes to land elsewhere.
            let last = queue.binding.load();
            if !last.is_unbound() && !self.usable(last.device()) && queue.binding.first_move_from(last) {
                self.migration.stats.migrations += 1;
            }
            return Ok(false);
        }
        let device = queue.binding.load().device();
        let kernel = match &ready.action {
            Action::Launch { kernel, .. } => Some(kernel),
            _ => None,
        };
        let Some(bound) = self.devices.get(device) else {
            return Ok(false);
        };
        // A launch beyond the bound device's limits moves the queue like a missing kernel: the
        // launch goes where it fits, or fails naming the limit once the queue is free.
        // So does, for a queue that prefers no device kind, a launch whose buffers can never be on
        // it at once (its quota or its size: `never_fits_task`).
        let takes = kernel.is_none_or(|k| bound.implements(k))
            && self.fit(device, ready).is_ok()
            && (queue.preferred.is_some() || self.never_fits_task(device, ready).is_none());
        if self.usable(device) && takes {
            // Its tasks in flight went to measure the device for the first time: a launch waits
            // for that measurement and is placed by it, like a task of an idle queue, instead of
            // following them to a device that may be many times slower (a pipelined stream would
            // otherwise run there whole, as it is never idle).
            if kernel.is_some() && queue.exploring.load(Ordering::Relaxed) {
                self.migration.held_list(session, queue, HoldReason::Measurement);
                return Ok(true);
            }
            return Ok(false);
        }
        tracing::debug!(
            session,
            queue = %queue.name,
            from = %bound.info().name,
            reason = if !self.usable(device) { "draining" } else { "kernel missing, or beyond the device's limits or memory" },
            "migrating a queue: holding its tasks until its in-flight ones finish"
        );
        self.migration.list_or_new(session, queue);
        Ok(true)
    }

    /// Holds `ready` at the head of its queue's held tasks until the queue's in-flight tasks
    /// finish: its buffers do not fit on its device now (memory pressure). Released like a
    /// moving queue's tasks, it is placed again then.
    pub(super) fn wait_for_room(&mut self, session: &Session, task_id: u64, ready: Ready) {
        let queue = ready.queue.clone();
        if !self.migration.room_waited {
            self.telemetry.metrics.memory_waits.inc();
            self.migration.stats.memory_waits += 1;
        }
        let replay = self.migration.take_replay();
        let list = self.migration.held_list(session.id, &queue, HoldReason::Room);
        // The list is new: `must_hold` would have held the task behind an existing one.
        list.replays = usize::from(replay.is_some());
        list.tasks.push_back(Held {
            task_id,
            ready,
            replay,
            allocated: None,
            waited_for_room: true,
            deadline: self.deadline_job,
        });
    }

    /// Holds `ready` at the head of its queue's held tasks until `answers` came (its
    /// allocations, asked ahead: `allocation`; or write-backs of buffers it names or whose room
    /// it needs); its queue's later tasks wait behind it.
    pub(super) fn wait_for_answers(&mut self, session: &Session, task_id: u64, ready: Ready, answers: Answers) {
        let queue = ready.queue.clone();
        let allocated = match &answers {
            Answers::Allocations(wait) => Some(wait.device()),
            Answers::WriteBacks(_) | Answers::CaptureMemory(..) => None,
        };
        let waited_for_room = self.migration.room_waited;
        let replay = self.migration.take_replay();
        let list = self.migration.held_list(session.id, &queue, HoldReason::Answer);
        // The list is new: `must_hold` would have held the task behind an existing one.
        list.waiting_for = Some(answers);
        // A replay keeps its record (its replay count, the inputs that survived) and its place
        // ahead of the queue's other lost tasks.
        list.replays = usize::from(replay.is_some());
        list.tasks.push_back(Held {
            task_id,
            ready,
            replay,
            allocated,
            waited_for_room,
            deadline: self.deadline_job,
        });
    }

    /// Appends `ready` to its queue's held tasks (after [`Scheduler::must_hold`] said so).
    pub(super) fn hold(&mut self, session: &Session, task_id: u64, ready: Ready) {
        let queue = ready.queue.clone();
        let waited_for_room = self.migration.room_waited;
        self.migration.list_or_new(session.id, &queue).tasks.push_back(Held {
            task_id,
            ready,
            replay: None,
            allocated: None,
            waited_for_room,
            deadline: self.deadline_job,
        });
    }

    /// Dispatch hook: planning on `device` found it gone (it failed after the policy chose it).
    /// The task goes back for replay like a job the device lost.
    pub(super) fn lost_while_planning(
        &mut self,
        session: &Session,
        task_id: u64,
        queue: &Arc<QueueState>,
        mut ticket: Ticket,
        named: NamedBuffers,
    ) -> Result<(), TaskError> {
        // Counted in flight as if it had reached a lane: taking it back releases the count.
        queue.in_flight.fetch_add(1, Ordering::AcqRel);
        session.shared.in_flight.fetch_add(1, Ordering::AcqRel);
        match ticket.divert(&mut Err(TaskError::DeviceLost), &session.shared, queue, task_id, named) {
            None => Ok(()),
            Some(_) => {
                queue.in_flight.fetch_sub(1, Ordering::AcqRel);
                session.shared.in_flight.fetch_sub(1, Ordering::AcqRel);
                Err(TaskError::DeviceLost)
            }
        }
    }

    /// Whether the policy may place new work on `device`: not draining, and not failed even if
    /// the dispatcher has not noticed yet.
    pub(super) fn usable(&self, device: usize) -> bool {
        self.migration.usable(device) && self.devices[device].healthy()
    }

    /// Dispatcher hook, once per loop: finishes evictions whose write-back was answered,
    /// notices failed devices and takes lost tasks back.
    pub(crate) fn migration_tick(&mut self) {
        if self.residency.writing_back() {
            self.finish_write_backs();
        }
        for device in 0..self.devices.len() {
            if !self.migration.failed[device] {
                if !self.devices[device].healthy() {
                    self.device_failed(device);
                }
                continue;
            }
            let Some((failed, asked)) = &mut self.migration.reviving[device] else {
                continue;
            };
            if asked.elapsed() < REVIVE_EVERY {
                continue;
            }
            *asked = std::time::Instant::now();
            let down_for = failed.elapsed();
            // Its copies were forgotten when it failed, so it comes back empty.
            if self.devices[device].revive() {
                self.migration.failed[device] = false;
                self.migration.reviving[device] = None;
                let drained = self.migration.drained_by_operator[device];
                self.migration.draining[device] = drained;
                self.migration.stats.revivals += 1;
                let name = &self.devices[device].info().name;
                let down_ms = down_for.as_millis() as u64;
                // A device drained before it failed stays drained: saying that new work may go
                // to it would send the operator looking for a drain that did not hold.
                if drained {
                    tracing::warn!(
                        device = %name,
                        down_ms,
                        "device is back (its device host restarted) but stays drained, as it was before it failed: \
                         `agora undrain {name}` to use it again"
                    );
                } else {
                    tracing::warn!(
                        device = %name,
                        down_ms,
                        "device is back (its device host restarted); new work may go to it again"
                    );
                }
            }
        }
        // A plain load first: this runs once per dispatcher loop, and a swap would take the
        // cache line from the lanes every time.
        if !self.migration.inbox.pending.load(Ordering::Acquire)
            || !self.migration.inbox.pending.swap(false, Ordering::AcqRel)
        {
            return;
        }
        let lost = std::mem::take(&mut *self.migration.inbox.lost.lock().unwrap_or_else(|e| e.into_inner()));
        for lost in lost {
            // The transfers and writes planned for it never happened. On a device that still
            // works (the job failed reading from a dead one), later row slices of a chunked launch
            // may have run and written part of its outputs: trust no written copy there.
            let alive = self.devices[lost.replay.device].healthy();
            let mut replay = lost.replay;
            for (slot, record, access) in &lost.entries {
                let bit = 1 << slot;
                if alive && access.writes() {
                    replay.host_inputs &= !bit;
                    replay.device_inputs &= !bit;
                }
                record.placement().job_lost(
                    replay.device,
                    replay.host_inputs & bit != 0,
                    replay.device_inputs & bit != 0,
                );
            }
            // Completed where it ran: nothing more to do.
            let Some((action, named)) = lost.task else {
                self.migration.stats.lost += 1;
                continue;
            };
            // It no longer runs anywhere: release its in-flight count now that it is held (the
            // queue stays orphaned through its held list, so nothing overtakes it).
            lost.queue.in_flight.fetch_sub(1, Ordering::AcqRel);
            lost.shared.in_flight.fetch_sub(1, Ordering::AcqRel);
            if lost.shared.cancelled.load(Ordering::Acquire) {
                drop(named);
                lost.shared
                    .post(&[Completion::failed(lost.task_id, TaskError::DeviceLost)]);
                continue;
            }
            let ready = Ready {
                queue: lost.queue.clone(),
                action,
                estimated_ns: lost.estimated_ns,
                items: lost.items,
                // Not kept for a replay: all of its buffers (it only bounds inline runs).
                touched_bytes: named.buffers[..named.slots]
                    .iter()
                    .flatten()
                    .map(|(r, _, _)| r.len)
                    .sum(),
                slots: named.slots,
                buffers: named.buffers.clone(),
            };
            drop(named);
            let list = self.migration.list_or_new(lost.shared.id, &lost.queue);
            let at = list.replays;
            list.tasks.insert(
                at,
                Held {
                    task_id: lost.task_id,
                    ready,
                    replay: Some(replay),
                    allocated: None,
                    waited_for_room: false,
                    deadline: None,
                },
            );
            list.replays += 1;
        }
    }

    /// A device failed: drain it for good and forget its memory.
    fn device_failed(&mut self, device: usize) {
        self.migration.failed[device] = true;
        self.migration.drained_by_operator[device] = self.migration.draining[device];
        self.migration.draining[device] = true;
        let now = std::time::Instant::now();
        self.migration.reviving[device] = Some((now, now));
        self.migration.any_failed = true;
        let (copies, lost) = self.residency.forget_device(device);
        tracing::error!(
            device = %self.devices[device].info().name,
            copies,
            buffers_lost = lost,
            "device failed: drained; its queues move to other devices and its lost tasks are replayed where their inputs survive"
        );
    }

    /// Marks `device` draining or not. A failed device cannot be undrained.
    pub(crate) fn set_draining(&mut self, device: usize, drain: bool) -> Result<(), String> {
        if !drain && self.migration.failed[device] {
            return Err(format!(
                "device {} failed; it stays drained until it comes back (an OpenCL device's host restarts by itself) or the daemon restarts",
                self.devices[device].info().name
            ));
        }
        if self.migration.draining[device] != drain {
            tracing::info!(device = %self.devices[device].info().name, drain, "drain state changed");
        }
        self.migration.drained_by_operator[device] = drain;
        self.migration.draining[device] = drain;
        Ok(())
    }

    /// Writes `device`'s idle buffers back to host memory and frees them there (drain with
    /// evacuation). Returns (buffers, bytes).
    pub(crate) fn evacuate(&mut self, device: usize) -> (u64, u64) {
        let (buffers, bytes) = self.residency.evacuate(&self.devices, device);
        tracing::info!(device = %self.devices[device].info().name, buffers, bytes, "evacuated");
        (buffers, bytes)
    }

    /// Ingest hook: dispatches, in order, the held tasks of this session's queues that have
    /// nothing left in flight.
    pub(super) fn release_held(&mut self, session: &Session) {
        if self.migration.held.is_empty() {
            return;
        }
        let Some(lists) = self.migration.held.get_mut(&session.id) else {
            return;
        };
        let mut free = Vec::new();
        let mut adopting = Vec::new();
        lists.retain_mut(|list| {
            if list.releasable() {
                list.queue.moving.store(false, Ordering::Release);
                free.push(std::mem::take(&mut list.tasks));
                if let Some(Answers::Allocations(wait)) = list.waiting_for.take() {
                    adopting.push(wait);
                }
                false
            } else {
                true
            }
        });
        for wait in adopting {
            wait.adopt(&mut self.residency);
        }
        if lists.is_empty() {
            self.migration.held.remove(&session.id);
        }
        if free.is_empty() {
            return;
        }
        for tasks in free {
            for held in tasks {
                // A task released here may start a new move (its kernel is missing on the new
                // device): the rest of the queue then waits behind it again.
                if let Some(list) = self.migration.list_mut(session.id, &held.ready.queue) {
                    if held.replay.is_some() {
                        let at = list.replays;
                        list.tasks.insert(at, held);
                        list.replays += 1;
                    } else {
                        list.tasks.push_back(held);
                    }
                    continue;
                }
                if let Some(replay) = held.replay {
                    // Inputs it read from the host copy are still exactly what it read.
                    for (slot, entry) in held.ready.buffers[..held.ready.slots].iter().enumerate() {
                        if let (Some((record, _, _)), true) = (entry, replay.host_inputs & (1 << slot) != 0) {
                            record.placement().lost = false;
                        }
                    }
                    self.migration.replaying = Some(replay);
                }
                let replayed = held.replay.is_some();
                self.migration.allocated_late = held.allocated;
                self.migration.room_waited = held.waited_for_room;
                self.deadline_job = held.deadline;
                let outcome = self.dispatch(session, held.task_id, held.ready);
                self.migration.replaying = None;
                self.migration.allocated_late = None;
                self.migration.room_waited = false;
                self.deadline_job = None;
                let held_again = std::mem::take(&mut self.migration.replay_held);
                match outcome {
                    Ok(()) => self.migration.stats.replayed += u64::from(replayed && !held_again),
                    Err(error) => {
                        self.migration.stats.lost += u64::from(replayed);
                        self.inline_done.push(Completion::failed(held.task_id, error));
                    }
                }
            }
        }
        self.flush(&session.shared);
    }
}
