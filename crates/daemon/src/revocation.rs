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

use agora_devices::{Device, DeviceBuffer, Job, JobTimes, Revocation, Share, Transfer, Work};
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
    /// Its session's share of lanes: a replay goes ahead of that tenant's later jobs.
    share: Share,
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

/// One read-write buffer argument of a launch.
struct ReadWriteArg<'a> {
    host: *mut u8,
    len: u64,
    device_copy: Option<&'a Arc<dyn DeviceBuffer>>,
}

/// The read-write buffer arguments of `work` (none unless it is a launch). Allocates nothing:
/// the scheduler asks for their size on its dispatch path.
fn read_write_args(work: &Work) -> impl Iterator<Item = ReadWriteArg<'_>> {
    let launch = match work {
        Work::Launch {
            kernel,
            args,
            arg_count,
            device_args,
            ..
        } => Some((kernel, args, *arg_count, device_args)),
        _ => None,
    };
    launch.into_iter().flat_map(|(kernel, args, arg_count, device_args)| {
        kernel
            .params
            .iter()
            .enumerate()
            .take(arg_count)
            .filter(|(_, p)| is_read_write(p.kind))
            .filter_map(move |(index, _)| match args[index] {
                agora_kernels::ArgValue::Buffer { ptr, len } => Some(ReadWriteArg {
                    host: ptr,
                    len,
                    device_copy: device_args[index].as_ref(),
                }),
                _ => None,
            })
    })
}

/// Whether `transfers` load `copy` from its host copy.
fn loads(transfers: &[Transfer], copy: Option<&Arc<dyn DeviceBuffer>>) -> bool {
    copy.is_some_and(|copy| {
        transfers.iter().any(
            |t| matches!(t, Transfer::ToDevice { to, .. } if std::ptr::addr_eq(Arc::as_ptr(to), Arc::as_ptr(copy))),
        )
    })
}

/// The bytes of `work`'s read-write buffers (what restoring them for a replay moves).
pub(crate) fn read_write_bytes(work: &Work) -> u64 {
    read_write_args(work).map(|a| a.len).sum()
}

/// The read-write buffers of `work`, and whether `transfers` (the launch's own) load each from
/// its host copy.
fn read_write_buffers(work: &Work, transfers: &[Transfer]) -> Vec<ReadWrite> {
    read_write_args(work)
        .map(|a| ReadWrite {
            host: a.host,
            len: a.len as usize,
            loaded_from_host: loads(transfers, a.device_copy),
            device_copy: a.device_copy.cloned(),
            saved: None,
        })
        .collect()
}

/// The bytes a revocable run of `work` saves before it starts (its read-write buffers, less
/// those its own `transfers` load from their unchanged host copies): what revocability costs.
pub(crate) fn bytes_to_save(work: &Work, transfers: &[Transfer]) -> u64 {
    read_write_args(work)
        .filter(|a| !loads(transfers, a.device_copy))
        .map(|a| a.len)
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
    share: Share,
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
        share,
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
        exclusive: false,
        deadline: None,
        slices: None,
        share: replay.share,
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

#[cfg(test)]
mod tests {
    //! The replay protocol in isolation: a CPU device and host buffers, no daemon.
    use std::sync::mpsc;
    use std::time::Duration;

    use agora_devices::cpu::CpuDevice;
    use agora_devices::sim::{SimDevice, SimSpec};
    use agora_kernels::ArgValue;
    use agora_protocol::MAX_ARGS;

    use super::*;

    /// `saxpy(2, x, y)` over `x.len()` items on host memory (`y` is read-write).
    fn saxpy(x: &mut [f32], y: &mut [f32], device_args: [Option<Arc<dyn DeviceBuffer>>; MAX_ARGS]) -> Work {
        let mut args = [ArgValue::None; MAX_ARGS];
        args[0] = ArgValue::Scalar(u64::from(2.0f32.to_bits()));
        args[1] = ArgValue::Buffer {
            ptr: x.as_mut_ptr().cast(),
            len: (x.len() * 4) as u64,
        };
        args[2] = ArgValue::Buffer {
            ptr: y.as_mut_ptr().cast(),
            len: (y.len() * 4) as u64,
        };
        Work::Launch {
            kernel: agora_kernels::find("saxpy").unwrap().1.into(),
            range: [x.len() as u64, 1, 1],
            dims: 1,
            args,
            arg_count: 3,
            device_args,
            rows: None,
        }
    }

    fn counters() -> RevocationCounters {
        RevocationCounters {
            revoked: Counter::default(),
            wasted_ns: Counter::default(),
        }
    }

    /// A job that holds the lane until `release` sends (its completion runs on the lane).
    fn hold_lane(device: &dyn Device) -> mpsc::Sender<()> {
        let (release, wait) = mpsc::channel::<()>();
        device.submit(
            0,
            Job {
                transfers: Vec::new(),
                work: Work::Nothing,
                keepalive: None,
                cancelled: None,
                revoke: None,
                urgent: false,
                exclusive: false,
                deadline: None,
                slices: None,
                share: Share::default(),
                done: Box::new(move |_, _| {
                    let _ = wait.recv_timeout(Duration::from_secs(10));
                }),
            },
        );
        release
    }

    #[test]
    fn only_read_write_buffers_the_launch_does_not_load_itself_need_saving() {
        let (mut x, mut y) = (vec![1.0f32; 64], vec![1.0f32; 64]);
        let sim: Arc<dyn Device> = Arc::new(SimDevice::new(SimSpec::default()).unwrap());
        let (x_copy, y_copy) = (sim.alloc(1, 256).unwrap().unwrap(), sim.alloc(1, 256).unwrap().unwrap());
        let mut device_args: [Option<Arc<dyn DeviceBuffer>>; MAX_ARGS] = Default::default();
        device_args[1] = Some(x_copy.clone());
        device_args[2] = Some(y_copy.clone());
        let work = saxpy(&mut x, &mut y, device_args);
        // y (read-write, 256 bytes) only; x is read.
        assert_eq!(read_write_bytes(&work), 256);
        assert_eq!(
            bytes_to_save(&work, &[]),
            256,
            "y's device copy is what a replay restores"
        );
        let load = |to: &Arc<dyn DeviceBuffer>| Transfer::ToDevice {
            host: y.as_ptr().cast(),
            len: 256,
            to: to.clone(),
        };
        assert_eq!(
            bytes_to_save(&work, &[load(&x_copy)]),
            256,
            "loading x does not cover y"
        );
        assert_eq!(
            bytes_to_save(&work, &[load(&y_copy)]),
            0,
            "the launch loads y from its unchanged host copy: a replay reloads it from there"
        );
        // On a device that shares host memory, the host copy is what the kernel changes.
        let work = saxpy(&mut x, &mut y, Default::default());
        assert_eq!(bytes_to_save(&work, &[]), 256);
        assert_eq!(bytes_to_save(&Work::Nothing, &[]), 0);
    }

    #[test]
    fn a_launch_revoked_while_queued_is_skipped_then_replayed_and_completes_once() {
        let device: Arc<dyn Device> = Arc::new(CpuDevice::new(1, 1).unwrap());
        let (mut x, mut y) = ((0..1000).map(|i| i as f32).collect::<Vec<_>>(), vec![1.0f32; 1000]);
        let work = saxpy(&mut x, &mut y, Default::default());
        let release = hold_lane(&*device);
        let slot: VictimSlot = Arc::new(Mutex::new(None));
        let (done, results) = mpsc::channel();
        let counters = counters();
        submit(
            device.clone(),
            0,
            Vec::new(),
            work,
            Arc::new(AtomicBool::new(false)),
            Share::default(),
            slot.clone(),
            1e6,
            1e3,
            counters.clone(),
            Box::new(move |result, _| done.send(result).unwrap()),
        );
        // Offered as the lane's victim while it waits; revoking it then only skips it.
        let victim = slot.lock().unwrap().clone().expect("a victim while queued");
        assert!(victim.started.is_none());
        assert_eq!(victim.remaining_ns(), 1e6);
        victim.flag.store(true, Ordering::Release);
        release.send(()).unwrap();
        assert_eq!(results.recv_timeout(Duration::from_secs(10)).unwrap(), Ok(()));
        assert!(
            results.recv_timeout(Duration::from_millis(100)).is_err(),
            "completed once"
        );
        assert_eq!(counters.revoked.get(), 1);
        // Ran exactly once: y = 2x + 1.
        for (i, v) in y.iter().enumerate() {
            assert_eq!(*v, 2.0 * i as f32 + 1.0, "y[{i}]");
        }
        assert!(slot.lock().unwrap().is_none(), "no victim once it completed");
        device.shutdown();
    }

    #[test]
    fn a_launch_stopped_part_way_is_restored_from_what_it_saved_and_replayed_exactly() {
        let device: Arc<dyn Device> = Arc::new(CpuDevice::new(1, 1).unwrap());
        let (mut x, mut y) = ((0..1000).map(|i| i as f32).collect::<Vec<_>>(), vec![1.0f32; 1000]);
        let work = saxpy(&mut x, &mut y, Default::default());
        let (done, results) = mpsc::channel();
        let counters = counters();
        let replay = Arc::new(Replay {
            device: device.clone(),
            lane: 0,
            flag: Arc::new(AtomicBool::new(false)),
            session_cancelled: Arc::new(AtomicBool::new(false)),
            share: Share::default(),
            slot: Arc::new(Mutex::new(None)),
            predicted_ns: 1e6,
            cost_ns: 1e3,
            counters: counters.clone(),
            state: Mutex::new(State {
                buffers: read_write_buffers(&work, &[]),
                work,
                transfers: Vec::new(),
                started: false,
                done: Some(Box::new(move |result, _| done.send(result).unwrap())),
            }),
            revocations: std::sync::atomic::AtomicU32::new(0),
        });
        // As the lane starts it: y's prior contents saved, offered as the running victim.
        replay.save().unwrap();
        assert!(replay.slot.lock().unwrap().as_ref().unwrap().started.is_some());
        // Part of the kernel ran (it updated some rows in place), then it saw the flag.
        for v in &mut y[..300] {
            *v += 123.0;
        }
        replay.flag.store(true, Ordering::Release);
        let now = std::time::Instant::now();
        let times = JobTimes {
            queued: now,
            started: now,
            transfers_done: None,
            finished: now,
            cold: false,
        };
        replay.clone().end(Err(TaskError::Cancelled), times);
        assert_eq!(results.recv_timeout(Duration::from_secs(10)).unwrap(), Ok(()));
        assert_eq!(counters.revoked.get(), 1);
        assert!(!replay.flag.load(Ordering::Acquire), "cleared for the replay");
        for (i, v) in y.iter().enumerate() {
            assert_eq!(*v, 2.0 * i as f32 + 1.0, "y[{i}]: restored, then run once");
        }
        device.shutdown();
    }

    #[test]
    fn a_launch_whose_session_was_cancelled_is_not_replayed() {
        let device: Arc<dyn Device> = Arc::new(CpuDevice::new(1, 1).unwrap());
        let (mut x, mut y) = (vec![1.0f32; 16], vec![1.0f32; 16]);
        let work = saxpy(&mut x, &mut y, Default::default());
        let release = hold_lane(&*device);
        let cancelled = Arc::new(AtomicBool::new(false));
        let slot: VictimSlot = Arc::new(Mutex::new(None));
        let (done, results) = mpsc::channel();
        let counters = counters();
        submit(
            device.clone(),
            0,
            Vec::new(),
            work,
            cancelled.clone(),
            Share::default(),
            slot.clone(),
            1e6,
            1e3,
            counters.clone(),
            Box::new(move |result, _| done.send(result).unwrap()),
        );
        // Both: the session went away and a latency task revoked it.
        cancelled.store(true, Ordering::Release);
        slot.lock()
            .unwrap()
            .as_ref()
            .unwrap()
            .flag
            .store(true, Ordering::Release);
        release.send(()).unwrap();
        assert_eq!(
            results.recv_timeout(Duration::from_secs(10)).unwrap(),
            Err(TaskError::Cancelled)
        );
        assert_eq!(
            counters.revoked.get(),
            0,
            "a cancelled session's launch is not replayed"
        );
        assert_eq!(y, vec![1.0f32; 16], "never ran");
        device.shutdown();
    }
}
