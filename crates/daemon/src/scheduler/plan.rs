//! Stage 3, **plan**: what a placed task needs on its device — room in device memory (eviction,
//! the session's device quota), the transfers that make its inputs current there, the one-writer
//! rule for its outputs, and the device work itself — and, for lane jobs, whether it is sliced
//! (chunked launch) or revocable.
//!
//! Owns: [`NamedBuffers`] (a task's buffers, marked in use so eviction leaves them alone until
//! it finishes), the migration ticket taken before planning (what a replay needs if the device
//! loses the task), the test-only fault injection's effect on the work, and the byte counters.
//!
//! Must not: choose a device (`place` did), or hand anything to a device (`submit` does).

use std::sync::atomic::Ordering;
use std::sync::Arc;

use agora_devices::{DeviceBuffer, Transfer, Work};
use agora_kernels::{ArgValue, KernelRef};
use agora_protocol::control::QueueClass;
use agora_protocol::{Access, TaskError, MAX_ARGS};

use super::migration;
use super::place::Placement;
use super::validate::{heap_ptr, operation_name, Action, Ready};
use super::{Scheduler, MAX_SLICES};
use crate::memory::{BufferRecord, Residency, Validity};
use crate::outcome::{Role, Uses};
use crate::policy::latency::LatencyPolicy;
use crate::session::{QueueState, Session};

/// Whether a task's buffers fit on its device.
#[derive(Debug)]
pub(super) enum Room {
    /// Now, nothing to allocate.
    Now,
    /// Now by the books, allocating on the device: should its runtime refuse even after
    /// eviction, the task waits as for `Later`.
    NowAllocating,
    /// Once the write-backs of these buffers (evictions from a device in a device host, in
    /// flight) are finished: it waits for them.
    AfterWriteBacks(Vec<Arc<BufferRecord>>),
    /// Once earlier tasks free theirs: it waits.
    Later,
}

/// Buffers marked in use while a task is being placed, so eviction leaves them alone.
struct Pinned<'a>(&'a [Option<(Arc<BufferRecord>, Access, bool)>]);

impl<'a> Pinned<'a> {
    fn new(buffers: &'a [Option<(Arc<BufferRecord>, Access, bool)>]) -> Self {
        for (record, _, _) in buffers.iter().flatten() {
            record.in_use.fetch_add(1, Ordering::AcqRel);
        }
        Pinned(buffers)
    }
}

impl Drop for Pinned<'_> {
    fn drop(&mut self) {
        for (record, _, _) in self.0.iter().flatten() {
            record.in_use.fetch_sub(1, Ordering::AcqRel);
        }
    }
}

/// Planning failed: the error, and the task's buffers to settle it with (none when its device
/// failed meanwhile and the migration took them).
pub(super) struct Failed {
    pub error: TaskError,
    // Boxed: rare, and it keeps the common `Ok` small.
    pub named: Option<Box<NamedBuffers>>,
}

/// A placed task with its data planned: the output of the plan stage.
pub(super) struct Planned {
    pub queue: Arc<QueueState>,
    pub kernel: Option<KernelRef>,
    /// Its name in metrics and traces.
    pub name: &'static str,
    pub items: u64,
    pub estimated_ns: f64,
    /// Data movements that go first, in order.
    pub transfers: Vec<Transfer>,
    pub work: Work,
    pub named: NamedBuffers,
    /// Sends the task back for replay if its device loses it.
    /// `None` for a task placed to run inline (see [`Scheduler::plan_task`]). Boxed: it holds
    /// a copy of the action (~0.5 kB) that a planned task would otherwise carry and copy
    /// through the stages whether it has a ticket or not.
    pub ticket: Option<Box<migration::Ticket>>,
    /// Test-only: picked to fail (its work does not run).
    pub injected: bool,
    /// A checkpoint task's capture, run when its job is done (the job then runs alone on its
    /// lane). Boxed: rare.
    pub capture: Option<Box<crate::checkpoint::CheckpointCapture>>,
}

impl Scheduler {
    /// Plans `ready` on the device `placement` chose. `Ok(None)`: the device failed meanwhile
    /// and the task went back for replay.
    #[inline]
    pub(super) fn plan_task(
        &mut self,
        session: &Session,
        task_id: u64,
        ready: Ready,
        roles: [Role; MAX_ARGS],
        placement: &Placement,
    ) -> Result<Option<Box<Planned>>, Failed> {
        let device = placement.binding.device();
        let queue = ready.queue.clone();
        let kernel = ready.kernel().cloned();
        let name = operation_name(&ready.action);
        let (items, estimated_ns) = (ready.items, ready.estimated_ns);
        let checkpoint = match &ready.action {
            Action::Checkpoint {
                checkpoint,
                level,
                snapshot,
                ids,
            } => Some((*checkpoint, *level, *snapshot, *ids)),
            _ => None,
        };
        // Its buffers are in use from now until it finishes, so eviction leaves them alone.
        let named = NamedBuffers::new(ready.buffers, ready.slots, roles, &mut self.residency);
        // Test-only: a task picked to fail keeps its transfers but its work does not run.
        let injected = self.config.faults.is_some_and(|f| f.picks(task_id));
        let mut transfers: Vec<Transfer> = Vec::new();
        // Taken before planning: what a replay needs if the device loses the task. Not for a
        // task bound to run inline on the host device (the common tiny task): that device
        // cannot fail apart from the daemon, so there is nothing to replay, and the inline path
        // stays free of the ticket's work (should it go to a lane after all, it gets a ticket
        // that never replays, as every host-device job's would be).
        let ticket = (!placement.tiny_on_host).then(|| {
            Box::new(migration::Ticket::new(
                &mut self.migration,
                device,
                &ready.action,
                estimated_ns,
                items,
                named.slots(),
            ))
        });
        // Judged before anything is planned, so a refusal leaves the buffers' copies as they were.
        let capture = match checkpoint {
            None => None,
            Some((checkpoint, level, snapshot, ids)) => {
                let reserved = self.capture_reserved.take();
                match self.admit_checkpoint(
                    session,
                    (checkpoint, snapshot),
                    level,
                    ids,
                    named.slots(),
                    device,
                    reserved,
                ) {
                    Ok(capture) => Some(Box::new(capture)),
                    Err(error) => {
                        return Err(Failed {
                            error,
                            named: Some(Box::new(named)),
                        })
                    }
                }
            }
        };
        let work = match self.plan(session, device, ready.action, named.slots(), &mut transfers) {
            Ok(work) => work,
            Err(TaskError::DeviceLost) => {
                let ticket = ticket.map_or_else(|| migration::Ticket::unreplayable(&self.migration, device), |t| *t);
                return self
                    .lost_while_planning(session, task_id, &queue, ticket, named)
                    .map(|()| None)
                    .map_err(|error| Failed { error, named: None });
            }
            Err(error) => {
                return Err(Failed {
                    error,
                    named: Some(Box::new(named)),
                })
            }
        };
        let work = if injected { Work::Nothing } else { work };
        for (record, access, _) in named.slots().iter().flatten() {
            if access.writes() {
                record.placement().written_by(task_id);
            }
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
        // A device host must see the segment before anything of the session is on the device:
        // a write-only launch moves no bytes there, but its output is read back (or evicted)
        // into the segment later.
        if !transfers.is_empty() || self.devices[device].maps_host_memory() {
            session.shared.pin_for(
                device,
                self.devices[device].as_ref(),
                session.credentials.uid,
                &self.pinned,
            );
            // So must it see an exportable buffer's region, which lies outside the segment.
            for (record, _, _) in named.slots().iter().flatten() {
                record.map_region_for(device, self.devices[device].as_ref());
            }
        }
        // Boxed: the stages hand it on by pointer (a launch's work is about a kilobyte).
        Ok(Some(Box::new(Planned {
            queue,
            kernel,
            name,
            items,
            estimated_ns,
            transfers,
            work,
            named,
            ticket,
            injected,
            capture,
        })))
    }

    /// Judges a checkpoint task (level, id, whether it is a snapshot the daemon numbers) and
    /// makes its capture of the protected buffers in `slots` (ids in `ids`, slot by slot), to
    /// run on `device`, with its capture memory (`reserved` before planning).
    #[allow(clippy::too_many_arguments)]
    fn admit_checkpoint(
        &self,
        session: &Session,
        (checkpoint, snapshot): (u64, bool),
        level: u32,
        ids: [u32; MAX_ARGS],
        slots: &[Option<(Arc<BufferRecord>, Access, bool)>],
        device: usize,
        reserved: Option<crate::checkpoint::CaptureReservation>,
    ) -> Result<crate::checkpoint::CheckpointCapture, TaskError> {
        let service = self.config.checkpoints.clone().ok_or(TaskError::CheckpointRefused {
            reason: agora_protocol::completion::CHECKPOINT_NO_STORE,
            level: level.min(255) as u8,
            checkpoint,
            detail: 0,
        })?;
        let app = crate::checkpoint::application(session.credentials.uid, &session.name);
        let writer = crate::checkpoint::Writer {
            session: session.id,
            pid: session.credentials.pid,
            gone: session.shared.cancelled.clone(),
        };
        let (level, checkpoint) = service.admit(&app, &writer, checkpoint, snapshot, level)?;
        let may_wait = self.devices[device].info().shares_host_memory;
        // Reserved by `place_and_submit` before planning, for every checkpoint task of a daemon
        // with a store (the only caller).
        let reservation = reserved.ok_or(TaskError::CheckpointRefused {
            reason: agora_protocol::completion::CHECKPOINT_NO_STORE,
            level: crate::checkpoint::level_number(level),
            checkpoint,
            detail: 0,
        })?;
        let buffers = slots
            .iter()
            .zip(ids)
            .filter_map(|(slot, id)| slot.as_ref().map(|(record, _, _)| (id, record.clone())))
            .collect();
        Ok(crate::checkpoint::CheckpointCapture {
            service,
            app,
            checkpoint,
            level,
            buffers,
            may_wait,
            reservation,
        })
    }

    /// Whether `ready`'s buffers fit on the device `placement` chose: now (after evicting idle
    /// buffers, the session's own first when it is over its device quota), later (its queue
    /// waits for room: earlier tasks must finish and free theirs), or never (its buffers
    /// together exceed the device or the session's quota). Only tasks that make device copies
    /// ask: host-side work bound to a device's lane, and a `sync_to` that can never be there,
    /// fit now.
    pub(super) fn room(&mut self, session: &Session, ready: &Ready, placement: &Placement) -> Result<Room, TaskError> {
        let device = placement.binding.device();
        let info = self.devices[device].info();
        // Host-side work bound to a device lane needs no room there, nor can it be too big.
        if info.shares_host_memory || !ready.action.makes_device_copies() {
            return Ok(Room::Now);
        }
        let (mut working_set, mut missing) = (0u64, 0u64);
        let buffers = &ready.buffers[..ready.slots];
        for (slot, (record, _, _)) in buffers
            .iter()
            .enumerate()
            .filter_map(|(i, e)| e.as_ref().map(|e| (i, e)))
        {
            // A buffer passed twice (read twice) needs one copy.
            let first = buffers[..slot]
                .iter()
                .flatten()
                .all(|(other, _, _)| !Arc::ptr_eq(other, record));
            if first {
                working_set += record.len;
                if !record.placement().is_on(device) {
                    missing += record.len;
                }
            }
        }
        if let Some(never) = self.never_fits(session, device, working_set) {
            // A sync_to only pushes its buffer ahead of the tasks that will need it there: one
            // that can never be on the device leaves it in the host copy, now the current one
            // (`plan`), and the task that needs it there fails with this error instead.
            if matches!(ready.action, Action::SyncTo) {
                return Ok(Room::Now);
            }
            return Err(never);
        }
        let quota = self.device_quota(session);
        if missing == 0 {
            return Ok(Room::Now);
        }
        // (Below: `missing` bytes will be allocated.)
        // Its own buffers are not evicted to make room for it.
        let _pinned = Pinned::new(buffers);
        let usage = &session.shared.device_usage;
        let evicted_before = self.residency.evictions;
        let fits = self.residency.make_room(&self.devices, device, missing, usage, quota);
        self.telemetry
            .metrics
            .evictions
            .inc_by(self.residency.evictions - evicted_before);
        if fits {
            return Ok(Room::NowAllocating);
        }
        Ok(
            match self
                .residency
                .room_after_write_backs(&self.devices, device, missing, usage, quota)
            {
                Some(records) => Room::AfterWriteBacks(records),
                None => Room::Later,
            },
        )
    }

    /// The session's device quota (bytes per device; 0: none): its job's, else the daemon's.
    pub(super) fn device_quota(&self, session: &Session) -> u64 {
        match session.shared.device_quota.load(Ordering::Relaxed) {
            0 => self.config.device_quota,
            job => job,
        }
    }

    /// Why a working set of `bytes` can never be on `device` for `session` (larger than the
    /// device, or than the session's quota), or `None` when it can.
    pub(super) fn never_fits(&self, session: &Session, device: usize, bytes: u64) -> Option<TaskError> {
        self.never_fits_within(device, bytes, self.device_quota(session))
    }

    /// Why a working set of `bytes` can never be on `device` under a device quota of `quota`
    /// bytes (0: none), or `None` when it can.
    pub(super) fn never_fits_within(&self, device: usize, bytes: u64, quota: u64) -> Option<TaskError> {
        let info = self.devices[device].info();
        if bytes > info.memory_bytes {
            Some(TaskError::DeviceTooSmall {
                needed: bytes,
                capacity: info.memory_bytes,
            })
        } else if quota > 0 && bytes > quota {
            Some(TaskError::DeviceQuota {
                needed: bytes,
                quota,
                device_mib: u32::try_from(info.memory_bytes >> 20).unwrap_or(u32::MAX),
            })
        } else {
            None
        }
    }

    /// Whether a launch runs revocable: a batch launch that was not sliced, on a device that
    /// polls revocation, under a latency policy, predicted long enough that a latency task could
    /// not simply wait for it (`revoke_min`, and twice the preemption target), and whose
    /// read-write buffers (`save_bytes()` of them must be saved before it starts, for a replay;
    /// asked last) take at most `revoke_max_save_share` of it to save. Short launches are not
    /// worth the lane drain, nor launches that would spend longer saving than computing.
    pub(super) fn revocable(
        &self,
        device: usize,
        work: &Work,
        class: QueueClass,
        predicted_ns: f64,
        save_bytes: impl FnOnce() -> u64,
    ) -> bool {
        class == QueueClass::Batch
            && self.config.latency_policy != LatencyPolicy::None
            && matches!(work, Work::Launch { kernel, .. } if kernel.chunkable)
            && self.devices[device].polls_revocation()
            && predicted_ns >= self.config.revoke_min_ns.max(2.0 * self.config.preempt_target_ns)
            && save_bytes() as f64 / self.facts[device].bandwidth.max(1.0) * 1e9
                <= self.config.revoke_max_save_share * predicted_ns
    }

    /// How many row slices to split a launch into so that a latency task waits at most about
    /// `preempt_target` for the lane (chunked launch): batch launches only, on devices that take
    /// slices, when the prediction exceeds twice the target. 1: do not split.
    pub(super) fn slices_for(&self, device: usize, work: &Work, class: QueueClass, predicted_ns: f64) -> u64 {
        let target = self.config.preempt_target_ns;
        let Work::Launch {
            range, kernel, rows, ..
        } = work
        else {
            return 1;
        };
        // A row window runs as one enqueue (lanes slice only whole launches).
        if rows.is_some()
            || class != QueueClass::Batch
            || !kernel.chunkable
            || target <= 0.0
            || predicted_ns < 2.0 * target
            || !self.devices[device].slices(kernel)
        {
            return 1;
        }
        // No slice smaller than the device fills at once (a GPU's resident threads): below that a
        // slice costs its launch and completion for a fraction of the device.
        let items = range.iter().fold(1u64, |a, r| a.saturating_mul((*r).max(1)));
        let by_size = (items / self.devices[device].min_items_per_slice().max(1)).max(1);
        ((predicted_ns / target).ceil() as u64).clamp(1, range[0].min(MAX_SLICES).min(by_size))
    }

    /// Plans data placement for `action` on `device` and builds its work.
    fn plan(
        &mut self,
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
                window,
                ..
            } => {
                let mut device_args: [Option<Arc<dyn DeviceBuffer>>; MAX_ARGS] = Default::default();
                // What each argument's copies were before it was planned, to undo what planning
                // claimed when a later argument fails: its transfers never run.
                let mut before = [Validity::default(); MAX_ARGS];
                let undo = |before: &[Validity]| {
                    for (index, entry) in buffers[..before.len()].iter().enumerate().rev() {
                        if let Some((record, _, _)) = entry {
                            record.placement().restore(before[index]);
                        }
                    }
                };
                for (index, entry) in buffers.iter().enumerate() {
                    let Some((record, access, overwrites)) = entry else {
                        continue;
                    };
                    let ptr = match host(record) {
                        Ok(ptr) => ptr,
                        Err(e) => {
                            undo(&before[..index]);
                            return Err(e);
                        }
                    };
                    let mut placement = record.placement();
                    before[index] = placement.validity();
                    let mut prepared = placement.prepare(
                        devices,
                        device,
                        *access,
                        *overwrites,
                        ptr,
                        record.len,
                        &record.usage,
                        transfers,
                    );
                    drop(placement);
                    if let Err(TaskError::DeviceOutOfMemory { needed, .. }) = prepared {
                        // The runtime refused what the books said fits (the room stage made
                        // room by them): free at least that much more of idle buffers and try
                        // once more, so a tenant within its share is not failed by the
                        // runtime's own view of its memory.
                        let evicted_before = self.residency.evictions;
                        let freed = self.residency.evict_at_least(devices, device, needed);
                        self.telemetry
                            .metrics
                            .evictions
                            .inc_by(self.residency.evictions - evicted_before);
                        tracing::debug!(device = %devices[device].info().name, needed, freed, "device allocation refused; evicted and retrying");
                        self.allocation_retries += 1;
                        self.telemetry.metrics.allocation_retries.inc();
                        let mut placement = record.placement();
                        placement.restore(before[index]);
                        prepared = placement.prepare(
                            devices,
                            device,
                            *access,
                            *overwrites,
                            ptr,
                            record.len,
                            &record.usage,
                            transfers,
                        );
                    }
                    device_args[index] = match prepared {
                        Ok(buffer) => buffer,
                        Err(e) => {
                            undo(&before[..=index]);
                            return Err(match e {
                                TaskError::DeviceOutOfMemory { needed, .. } => TaskError::DeviceOutOfMemory {
                                    index: index as u16,
                                    needed,
                                },
                                other => other,
                            });
                        }
                    };
                    args[index] = ArgValue::Buffer { ptr, len: record.len };
                }
                Work::Launch {
                    kernel,
                    range,
                    dims,
                    args,
                    arg_count,
                    device_args,
                    rows: window.map(|(first, end)| first..end),
                }
            }
            Action::SyncTo => {
                let (record, _, _) = buffers[0]
                    .as_ref()
                    .ok_or_else(|| crate::internal_error(3, "a transfer task without its buffer"))?;
                let never_fits = self.never_fits(session, device, record.len).is_some();
                let mut placement = record.placement();
                placement.host_written();
                if !devices[device].info().shares_host_memory && !never_fits {
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
                let (record, _, _) = buffers[0]
                    .as_ref()
                    .ok_or_else(|| crate::internal_error(3, "a transfer task without its buffer"))?;
                let ptr = host(record)?;
                record.placement().fetch_to_host(devices, ptr, record.len, transfers);
                Work::Nothing
            }
            // Every protected buffer's host copy made current, as sync_from does; the capture
            // copies them when the job is done.
            Action::Checkpoint { .. } => {
                for (record, _, _) in buffers.iter().flatten() {
                    let ptr = host(record)?;
                    record.placement().fetch_to_host(devices, ptr, record.len, transfers);
                }
                Work::Nothing
            }
            Action::Fill { offset, len, value } => {
                let (record, _, _) = buffers[0]
                    .as_ref()
                    .ok_or_else(|| crate::internal_error(3, "a transfer task without its buffer"))?;
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
                let (src, _, _) = buffers[0]
                    .as_ref()
                    .ok_or_else(|| crate::internal_error(3, "a transfer task without its buffer"))?;
                let (dst, _, _) = buffers[1]
                    .as_ref()
                    .ok_or_else(|| crate::internal_error(3, "a transfer task without its buffer"))?;
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
pub(super) struct NamedBuffers {
    pub(super) buffers: [Option<(Arc<BufferRecord>, Access, bool)>; MAX_ARGS],
    pub(super) slots: usize,
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
    pub(super) fn slots(&self) -> &[Option<(Arc<BufferRecord>, Access, bool)>] {
        &self.buffers[..self.slots]
    }

    /// The outcome to report for `task`, which ran with `result` (see `outcome`).
    /// A task that did not complete leaves no device copy claiming its output (see
    /// `Placement::writer_failed`).
    pub(super) fn settle(&self, task: u64, result: Result<(), TaskError>) -> Result<(), TaskError> {
        let result = Uses {
            buffers: self.slots(),
            roles: &self.roles[..self.slots],
        }
        .settle(task, result);
        if result.is_err() {
            for ((record, _, _), role) in self
                .slots()
                .iter()
                .zip(&self.roles)
                .filter_map(|(e, r)| Some((e.as_ref()?, r)))
            {
                if role.writes {
                    record.placement().writer_failed(task);
                }
            }
        }
        result
    }
}

impl Drop for NamedBuffers {
    fn drop(&mut self) {
        for (record, _, _) in self.buffers[..self.slots].iter().flatten() {
            record.in_use.fetch_sub(1, Ordering::AcqRel);
        }
    }
}
