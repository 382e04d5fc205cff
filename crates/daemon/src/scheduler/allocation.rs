//! Allocations on devices whose memory another process allocates (a device in a device host:
//! `Device::allocates_far`). Asking and waiting on the dispatcher cost every tenant a round
//! trip to that process, milliseconds when it is busy with other tenants' transfers or
//! departures (issue 22, 3c: half the dispatcher's stalls under tenant churn). So the place
//! stage asks without waiting (`Device::alloc_later`) and the task waits for the answers at the
//! head of its queue's held tasks, as it would for room (`migration`); the dispatcher goes on
//! serving everyone else. When the last answer arrives the dispatcher is woken, the buffers
//! are adopted as (not yet valid) copies on the device, and the task is dispatched again: placed
//! back on that device (`place`: not afresh, which would leave the allocations unused), it finds
//! its buffers there and plans its transfers.
//!
//! A refusal (the runtime's memory is fuller than the books say) or a device lost meanwhile
//! leaves the buffer without a copy: the task, dispatched again, allocates the way it would
//! have without this stage (synchronously, where a refusal evicts and retries or waits for
//! room). So does a task that already waited once: at most one wait per task. A replayed task
//! and a DAG node job wait like any other, their replay record, or lane and deadline, held with
//! them.
//!
//! Owns: the answers in flight ([`AllocationWait`]) and the device usage they count (each
//! buffer's own: an attached buffer's bytes are its exporter's, as when allocated synchronously).
//! Must not: plan transfers or touch a copy's validity; install an allocation into a buffer that
//! got a copy on that device meanwhile (another queue's task allocated it first: the new one is
//! dropped, freeing it in the host).

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use agora_devices::DeviceBuffer;
use agora_protocol::TaskError;

use super::migration::DrainWaker;
use super::place::Placement;
use super::validate::Ready;
use super::Scheduler;
use crate::memory::{BufferRecord, Residency};

type Answer = Option<Result<Arc<dyn DeviceBuffer>, TaskError>>;

/// One task's allocations on one device, asked and not all answered or not yet adopted.
pub(super) struct AllocationWait {
    device: usize,
    /// Each buffer, its answer once it came, and whether it was adopted.
    answers: Mutex<Vec<(Arc<BufferRecord>, Answer, bool)>>,
    /// Answers still to come.
    remaining: AtomicUsize,
    waker: DrainWaker,
}

impl std::fmt::Debug for AllocationWait {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AllocationWait")
            .field("device", &self.device)
            .field("remaining", &self.remaining.load(Ordering::Relaxed))
            .finish_non_exhaustive()
    }
}

impl AllocationWait {
    /// The device the allocations are asked on.
    pub(super) fn device(&self) -> usize {
        self.device
    }

    /// Whether every answer came.
    pub(super) fn answered(&self) -> bool {
        self.remaining.load(Ordering::Acquire) == 0
    }

    fn answer(&self, slot: usize, result: Result<Arc<dyn DeviceBuffer>, TaskError>) {
        self.answers.lock().unwrap_or_else(|e| e.into_inner())[slot].1 = Some(result);
        if self.remaining.fetch_sub(1, Ordering::AcqRel) == 1 {
            self.waker.wake_dispatcher();
        }
    }

    /// Makes each allocation that succeeded its buffer's copy on the device (registered for
    /// eviction). A refused or lost one leaves its buffer as it was. Returns how many were
    /// refused.
    pub(super) fn adopt(&self, residency: &mut Residency) -> usize {
        let mut answers = self.answers.lock().unwrap_or_else(|e| e.into_inner());
        let mut refused = 0;
        for (record, answer, adopted) in answers.iter_mut() {
            match answer.take() {
                Some(Ok(buffer)) => {
                    *adopted = record.placement().adopt(self.device, buffer);
                    if *adopted {
                        residency.register(record);
                    }
                }
                Some(Err(error)) => {
                    tracing::debug!(%error, bytes = record.len, "an allocation asked ahead was refused; the task allocates again");
                    refused += 1;
                }
                None => {}
            }
        }
        refused
    }
}

impl Drop for AllocationWait {
    /// Bytes not adopted (refused, lost, adopted by another copy first, or the session went)
    /// stop counting as their buffer's owner's.
    fn drop(&mut self) {
        let answers = self.answers.get_mut().unwrap_or_else(|e| e.into_inner());
        for (record, _, adopted) in answers.iter() {
            if !*adopted {
                record.usage.bytes[self.device].fetch_sub(record.len, Ordering::Relaxed);
            }
        }
    }
}

/// The buffers `ready` names that are being written home by an eviction that did not wait.
pub(super) fn written_back(ready: &Ready) -> Option<Vec<Arc<BufferRecord>>> {
    let records: Vec<Arc<BufferRecord>> = ready.buffers[..ready.slots]
        .iter()
        .flatten()
        .filter(|(record, _, _)| record.writing_back.load(Ordering::Acquire))
        .map(|(record, _, _)| record.clone())
        .collect();
    (!records.is_empty()).then_some(records)
}

impl Scheduler {
    /// Finishes the evictions whose write-back was answered, counting them in the metrics.
    pub(super) fn finish_write_backs(&mut self) {
        let before = self.residency.evictions;
        self.residency.finish_write_backs(&self.devices);
        self.telemetry
            .metrics
            .evictions
            .inc_by(self.residency.evictions - before);
    }

    /// Place-stage hook for a task whose buffers fit its device by the books but are not all
    /// there yet: when the device allocates far, asks for the missing ones without waiting and
    /// returns the wait the task must go through; `None` when the task allocates as it plans.
    pub(super) fn allocate_later(&mut self, ready: &Ready, placement: &Placement) -> Option<Arc<AllocationWait>> {
        let device = placement.binding.device();
        if !self.devices[device].allocates_far() || self.migration.allocated_late == Some(device) {
            return None;
        }
        // The others work on the host copy: an allocation for them would sit unused.
        if !ready.action.makes_device_copies() {
            return None;
        }
        let buffers = &ready.buffers[..ready.slots];
        let mut missing: Vec<Arc<BufferRecord>> = Vec::new();
        for (record, _, _) in buffers.iter().flatten() {
            if !missing.iter().any(|m| Arc::ptr_eq(m, record)) && !record.placement().is_on(device) {
                missing.push(record.clone());
            }
        }
        if missing.is_empty() {
            return None;
        }
        // Counted from the moment they are asked, each against the usage its copy is given back
        // to (`BufferRecord::usage`: an attached buffer's is its exporter's, not this session's).
        for record in &missing {
            record.usage.bytes[device].fetch_add(record.len, Ordering::Relaxed);
        }
        let wait = Arc::new(AllocationWait {
            device,
            remaining: AtomicUsize::new(missing.len()),
            answers: Mutex::new(missing.iter().map(|r| (r.clone(), None, false)).collect()),
            waker: self.migration.drain_waker(),
        });
        for (slot, record) in missing.iter().enumerate() {
            let answered = wait.clone();
            self.devices[device].alloc_later(
                record.usage.tenant,
                record.len,
                Box::new(move |result| answered.answer(slot, result)),
            );
        }
        self.telemetry.metrics.allocations_awaited.inc();
        Some(wait)
    }
}
