//! Revocation (TReM): a long batch launch that cannot be sliced runs revocable; a latency task
//! that needs its lane asks it to stop, and the launch is replayed later from its inputs.
//!
//! Owns what a replay needs: before the launch starts (on the lane's thread, after the lane's
//! earlier jobs finished) it saves the prior contents of the launch's read-write buffers; when
//! the device reports the launch stopped early, it restores them and resubmits the launch at the
//! front of its lane, ahead of its queue's later tasks, so the client sees one completion with
//! the right results and nothing but time lost. Read-only buffers need nothing, write-only ones
//! are rewritten whole by the replay. The saved bytes are dropped when the task completes.
//!
//! Also owns the per-lane record of the revocable launch running there (the *victim* a latency
//! task may revoke). Whether to revoke is decided by `policy::latency::should_revoke`; this module
//! must not make that decision.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Instant;

use agora_devices::{Device, DeviceBuffer, Job, JobTimes, Revocation, Transfer, Work};
use agora_protocol::TaskError;
use prometheus_client::metrics::counter::Counter;

/// A job's completion callback.
pub(crate) type Done = Box<dyn FnOnce(Result<(), TaskError>, JobTimes) + Send>;

/// The revocable launch running on a lane.
#[derive(Debug, Clone)]
pub(crate) struct Victim {
    /// Set it to revoke.
    pub flag: Arc<AtomicBool>,
    /// When it started (`None`: submitted, not started yet; revoking it then only skips it).
    pub started: Option<Instant>,
    /// Its predicted execution time, nanoseconds.
    pub predicted_ns: f64,
    /// Times it was revoked already.
    pub revocations: u32,
    /// What revoking it costs before the lane is free: the rest of the current block of rows
    /// (or work-group wave) plus restoring its read-write buffers, nanoseconds.
    pub cost_ns: f64,
}

impl Victim {
    /// Predicted nanoseconds until it finishes if left alone.
    pub fn remaining_ns(&self) -> f64 {
        let elapsed = self.started.map_or(0.0, |t| t.elapsed().as_nanos() as f64);
        (self.predicted_ns - elapsed).max(0.0)
    }
}

/// The victim slot of one lane.
pub(crate) type VictimSlot = Arc<Mutex<Option<Victim>>>;

/// Counters of revocations (exported as metrics).
#[derive(Clone)]
pub(crate) struct RevocationCounters {
    /// Launches revoked.
    pub revoked: Counter,
    /// Execution time thrown away by revocations, nanoseconds.
    pub wasted_ns: Counter,
}

/// A read-write buffer of a revocable launch.
struct ReadWrite {
    /// Its host copy (the bytes the kernel computes on when the device shares host memory).
    host: *mut u8,
    len: usize,
    /// Its device copy, on devices with memory of their own.
    device_copy: Option<Arc<dyn DeviceBuffer>>,
    /// The launch's own transfers load it from the host copy (which the kernel does not change on
    /// such a device): a replay reloads it from there and nothing needs saving.
    loaded_from_host: bool,
    /// Its prior contents, once saved.
    saved: Option<Vec<u8>>,
}

struct State {
    work: Work,
    /// The first run's transfers, for a replay of a run that never started (skipped because it
    /// was revoked while queued): it still needs all of them.
    transfers: Vec<Transfer>,
    /// Whether a run started (saved the buffers): from then on a replay needs only restores.
    started: bool,
    buffers: Vec<ReadWrite>,
    done: Option<Done>,
}

// SAFETY: the host pointers refer to session memory kept mapped by the task (its buffers stay
// in use until `done` runs), and only one thread at a time touches them: the lane's thread while
// the launch runs, the completing thread after it stopped.
unsafe impl Send for State {}

/// One revocable launch.
struct Replay {
    device: Arc<dyn Device>,
    lane: usize,
    flag: Arc<AtomicBool>,
    session_cancelled: Arc<AtomicBool>,
    slot: VictimSlot,
    predicted_ns: f64,
    cost_ns: f64,
    counters: RevocationCounters,
    state: Mutex<State>,
    /// Times this launch was revoked.
    revocations: std::sync::atomic::AtomicU32,
}

/// Revocations after which a launch runs to completion (TReM's starvation guard: a batch task
/// that a steady stream of latency work keeps revoking would otherwise never finish).
pub(crate) const MAX_REVOCATIONS: u32 = 4;

fn is_read_write(kind: agora_protocol::ParamKind) -> bool {
    matches!(
        kind,
        agora_protocol::ParamKind::Buffer {
            access: agora_protocol::Access::ReadWrite,
            ..
        }
    )
}

/// Whether `work` has read-write buffers a replay would need to restore, and their bytes.
pub(crate) fn read_write_bytes(work: &Work) -> u64 {
    match work {
        Work::Launch {
            kernel,
            args,
            arg_count,
            ..
        } => kernel
            .params
            .iter()
            .zip(&args[..*arg_count])
            .filter(|(p, _)| is_read_write(p.kind))
            .map(|(_, a)| match a {
                agora_kernels::ArgValue::Buffer { len, .. } => *len,
                _ => 0,
            })
            .sum(),
        _ => 0,
    }
}

/// The read-write buffers of `work`, and whether `transfers` (the launch's own) load each from
/// its host copy.
fn read_write_buffers(work: &Work, transfers: &[Transfer]) -> Vec<ReadWrite> {
    match work {
        Work::Launch {
            kernel,
            args,
            arg_count,
            device_args,
            ..
        } => kernel
            .params
            .iter()
            .enumerate()
            .take(*arg_count)
            .filter(|(_, p)| is_read_write(p.kind))
            .filter_map(|(index, _)| match args[index] {
                agora_kernels::ArgValue::Buffer { ptr, len } => {
                    let device_copy = device_args[index].clone();
                    let loaded_from_host = device_copy.as_ref().is_some_and(|copy| {
                        transfers.iter().any(|t| {
                            matches!(t, Transfer::ToDevice { to, .. } if std::ptr::addr_eq(Arc::as_ptr(to), Arc::as_ptr(copy)))
                        })
                    });
                    Some(ReadWrite {
                        host: ptr,
                        len: len as usize,
                        device_copy,
                        loaded_from_host,
                        saved: None,
                    })
                }
                _ => None,
            })
            .collect(),
        _ => Vec::new(),
    }
}

/// The bytes a revocable run of `work` saves before it starts (its read-write buffers, less
/// those its own `transfers` load from their unchanged host copies): what revocability costs.
pub(crate) fn bytes_to_save(work: &Work, transfers: &[Transfer]) -> u64 {
    read_write_buffers(work, transfers)
        .iter()
        .filter(|b| !b.loaded_from_host)
        .map(|b| b.len as u64)
        .sum()
}

/// Submits a launch revocable on `lane` of `device`. `transfers` go with its first run;
/// `done` is called once, when it completes (after any number of revocations and replays).
#[allow(clippy::too_many_arguments)]
pub(crate) fn submit(
    device: Arc<dyn Device>,
    lane: usize,
    transfers: Vec<Transfer>,
    work: Work,
    session_cancelled: Arc<AtomicBool>,
    slot: VictimSlot,
    predicted_ns: f64,
    cost_ns: f64,
    counters: RevocationCounters,
    done: Done,
) {
    let buffers = read_write_buffers(&work, &transfers);
    let replay = Arc::new(Replay {
        device,
        lane,
        flag: Arc::new(AtomicBool::new(false)),
        session_cancelled,
        slot,
        predicted_ns,
        cost_ns,
        counters,
        state: Mutex::new(State {
            work,
            transfers: transfers.clone(),
            started: false,
            buffers,
            done: Some(done),
        }),
        revocations: std::sync::atomic::AtomicU32::new(0),
    });
    // Offered as the lane's victim from now: a latency task placed while it waits to start
    // (or is being started) can then still revoke it, which only skips it.
    {
        let mut slot = replay.slot.lock().unwrap_or_else(|e| e.into_inner());
        if slot.is_none() {
            *slot = Some(replay.victim(None));
        }
    }
    start(replay, transfers, false);
}

fn start(replay: Arc<Replay>, transfers: Vec<Transfer>, is_replay: bool) {
    let work = replay.state.lock().unwrap_or_else(|e| e.into_inner()).work.clone();
    let saver = replay.clone();
    let ender = replay.clone();
    let job = Job {
        transfers,
        work,
        keepalive: None,
        cancelled: Some(replay.session_cancelled.clone()),
        revoke: Some(Revocation {
            flag: replay.flag.clone(),
            save: Some(Box::new(move || saver.save())),
            replay: is_replay,
        }),
        urgent: false,
        slices: None,
        done: Box::new(move |result, times| ender.end(result, times)),
    };
    replay.device.submit(replay.lane, job);
}

impl Replay {
    /// On the lane's thread as the launch starts: record it as the lane's victim and save its
    /// read-write buffers (first run only: a replay restores the same prior contents).
    fn save(&self) -> Result<(), TaskError> {
        let mut state = self.state.lock().unwrap_or_else(|e| e.into_inner());
        state.started = true;
        state.transfers.clear();
        for b in state
            .buffers
            .iter_mut()
            .filter(|b| b.saved.is_none() && !b.loaded_from_host)
        {
            let mut bytes = vec![0u8; b.len];
            match &b.device_copy {
                // SAFETY: `bytes` has `len` bytes; the device copy is a live buffer of this
                // device at least `len` long (the daemon sized it from the same record).
                Some(copy) => unsafe { self.device.read(copy.as_ref(), bytes.as_mut_ptr(), b.len)? },
                // SAFETY: `host` is the buffer's in-heap range of `len` bytes, kept mapped by the
                // task; every earlier job of the lane finished, so nothing writes it now.
                None => unsafe { std::ptr::copy_nonoverlapping(b.host, bytes.as_mut_ptr(), b.len) },
            }
            b.saved = Some(bytes);
        }
        drop(state);
        if self.revocations.load(Ordering::Relaxed) >= MAX_REVOCATIONS {
            // Not offered as a victim any more: it runs to completion.
            return Ok(());
        }
        *self.slot.lock().unwrap_or_else(|e| e.into_inner()) = Some(self.victim(Some(Instant::now())));
        Ok(())
    }

    fn victim(&self, started: Option<Instant>) -> Victim {
        Victim {
            flag: self.flag.clone(),
            started,
            predicted_ns: self.predicted_ns,
            revocations: self.revocations.load(Ordering::Relaxed),
            cost_ns: self.cost_ns,
        }
    }

    /// The launch ended: completed, failed, or revoked (then restore and replay).
    fn end(self: Arc<Self>, result: Result<(), TaskError>, times: JobTimes) {
        self.slot.lock().unwrap_or_else(|e| e.into_inner()).take();
        let revoked = result == Err(TaskError::Cancelled)
            && self.flag.load(Ordering::Acquire)
            && !self.session_cancelled.load(Ordering::Acquire);
        if !revoked {
            let done = self.state.lock().unwrap_or_else(|e| e.into_inner()).done.take();
            if let Some(done) = done {
                done(result, times);
            }
            return;
        }
        self.counters.revoked.inc();
        self.revocations.fetch_add(1, Ordering::Relaxed);
        self.counters
            .wasted_ns
            .inc_by(times.finished.saturating_duration_since(times.started).as_nanos() as u64);
        // Restore. On a host-memory device the kernel wrote the host copy: copy the saved bytes
        // back now (the lane starts nothing until this job ends). On a device with memory of its
        // own, the replay's transfers reload the device copy, from the saved bytes or from the
        // unchanged host copy.
        let mut transfers = Vec::new();
        {
            let mut state = self.state.lock().unwrap_or_else(|e| e.into_inner());
            if !state.started {
                // Skipped before it started: nothing ran, nothing to restore; the replay needs
                // the transfers the skipped run did not make.
                transfers = std::mem::take(&mut state.transfers);
            }
            for b in state.buffers.iter().filter(|_| state.started) {
                match (&b.device_copy, &b.saved) {
                    (None, Some(saved)) => {
                        // SAFETY: as in `save`; the stopped launch no longer writes.
                        unsafe { std::ptr::copy_nonoverlapping(saved.as_ptr(), b.host, b.len) }
                    }
                    (Some(copy), saved) if saved.is_some() || b.loaded_from_host => {
                        transfers.push(Transfer::ToDevice {
                            // The saved bytes live in `state` until the task completes; without them
                            // the launch loaded this buffer from its host copy, which it did not
                            // change.
                            host: saved.as_ref().map_or(b.host as *const u8, |s| s.as_ptr()),
                            len: b.len,
                            to: copy.clone(),
                        })
                    }
                    _ => {}
                }
            }
        }
        self.flag.store(false, Ordering::Release);
        tracing::debug!(lane = self.lane, device = %self.device.info().name, "launch revoked; replaying it");
        start(self, transfers, true);
    }
}
