//! Surviving a daemon restart: what a session must remember to open itself again on a new
//! daemon, and the reconnection itself.
//!
//! When the daemon dies (killed, crashed, restarted or upgraded) every buffer's host copy is
//! still in this process's mapping of the session segment. So the client keeps, beside the
//! segment, a small registry of what it created — each live buffer's handle, heap range and
//! whether a launch wrote it after its last sync, each live queue's options, the names of the
//! kernels it looked up and the programs it built — and when it finds the daemon gone it:
//!
//! 1. consumes the completions the old daemon had posted (they are real results);
//! 2. completes every task still outstanding with [`TaskError::DaemonRestarted`], so waits
//!    return and the application can issue them again — except when every task the old
//!    daemon took had completed: the ones it never took (issued while it was already gone,
//!    say) are then kept, and issued again on the new daemon once it took the session
//!    (step 4), under their ids, so they complete as if nothing happened;
//! 3. connects again, with backoff, until [`ResumeState::timeout`] (30 s by default;
//!    `SessionOptions::reconnect_timeout`, or `AGORA_RECONNECT_TIMEOUT` in seconds, `0` = off);
//! 4. hands the segment back with `Request::Resume` (buffers and queues keep their handles;
//!    buffers whose newest contents may have been on a device come back *lost*: a task that
//!    reads them fails with `DataLost` until they are written whole), takes the new doorbell,
//!    and maps kernel ids that changed (a catalog that differs after an upgrade) and rebuilds the
//!    session's programs.
//!
//! Must not: block the task path. Nothing here runs while the daemon is alive except the
//! registry updates on the control path (buffer, queue, kernel and program creation) and one
//! relaxed load per launch ([`KernelIds::real`]).

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, RwLock};
use std::time::{Duration, Instant};

use agora_protocol::control::{
    Request, Response, ResumedBuffer, ResumedQueue, RESUME_BUFFERS_PER_MESSAGE, RESUME_QUEUES_PER_MESSAGE,
};
use agora_protocol::PROTOCOL_VERSION;

use crate::Error;

/// Default of how long a session tries to reach a restarted daemon.
pub const DEFAULT_RECONNECT_TIMEOUT: Duration = Duration::from_secs(30);

/// Environment variable overriding the reconnect timeout (seconds, fractions allowed; `0`
/// disables reconnection) when `SessionOptions::reconnect_timeout` is not set.
pub const RECONNECT_ENV: &str = "AGORA_RECONNECT_TIMEOUT";

/// The kernel id a launch sends for a kernel the restarted daemon no longer has: the daemon
/// answers `UnknownKernel` (never one of its own ids: those are small, or have bit 31 set).
const GONE_KERNEL: u32 = 0x7fff_ffff;

/// Where a buffer's newest contents are, as far as the client knows: shared by the `Buffer`
/// (which updates it as tasks are issued) and the registry (which reads it at a resume).
///
/// A daemon that dies takes with it the device copies of the tasks it *completed*; the tasks it
/// had not completed the application issues again. So a buffer is lost when a launch that wrote
/// it completed and no later `sync_from` (memset, copy) that brings it home did.
#[derive(Debug, Default)]
pub(crate) struct Whereabouts {
    /// The first launch writing the buffer issued since the last task that brings it home
    /// (0: none; then the host copy is, or will be, the newest).
    pub(crate) pending_write: AtomicU64,
    /// The last task bringing it home issued while a write was pending, and that write: while
    /// the homing task has not completed, the write's results are still on a device.
    pub(crate) homing: AtomicU64,
    pub(crate) homing_covers: AtomicU64,
}

impl Whereabouts {
    /// A launch that writes the buffer was issued as task `id`.
    pub(crate) fn written_by(&self, id: u64) {
        let _ = self
            .pending_write
            .compare_exchange(0, id, Ordering::Relaxed, Ordering::Relaxed);
    }

    /// Task `id` (a `sync_from`, memset or copy) brings the newest contents into the host copy.
    pub(crate) fn brought_home_by(&self, id: u64) {
        let write = self.pending_write.swap(0, Ordering::Relaxed);
        if write != 0 {
            self.homing_covers.store(write, Ordering::Relaxed);
            self.homing.store(id, Ordering::Relaxed);
        }
    }

    /// The application rewrote the host copy and issued a `sync_to`: it is the newest.
    pub(crate) fn host_written(&self) {
        self.pending_write.store(0, Ordering::Relaxed);
        self.homing.store(0, Ordering::Relaxed);
        self.homing_covers.store(0, Ordering::Relaxed);
    }

    /// Whether a launch that wrote it was issued after the last task that brings it home.
    pub(crate) fn unread(&self) -> bool {
        self.pending_write.load(Ordering::Relaxed) != 0
    }

    /// Whether the newest contents died with a daemon, given which tasks it completed.
    fn lost(&self, is_done: impl Fn(u64) -> bool) -> bool {
        let write = self.pending_write.load(Ordering::Relaxed);
        let homing = self.homing.load(Ordering::Relaxed);
        let covers = self.homing_covers.load(Ordering::Relaxed);
        (write != 0 && is_done(write)) || (homing != 0 && !is_done(homing) && is_done(covers))
    }
}

/// A buffer as the registry knows it.
struct RegisteredBuffer {
    offset: u64,
    len: u64,
    whereabouts: Arc<Whereabouts>,
    /// The release task issued for it, while that task may not have completed: a resume that
    /// issues the untaken tasks again resumes the buffer too, so that its release (and the
    /// tasks before it) find it on the new daemon.
    released_by: Option<u64>,
}

/// A queue as the registry knows it (`released_by` as for a buffer).
struct RegisteredQueue {
    queue: ResumedQueue,
    released_by: Option<u64>,
}

/// A buffer, queue or program whose release task was issued (the registry forgets it once that
/// task completed).
#[derive(Clone, Copy)]
enum Released {
    Buffer(u64),
    Queue(u64),
    /// By its number in [`Registry::programs`].
    Program(u64),
}

/// A program built by the session: the request to build it again, and the ids (as the
/// application holds them) of its kernels, in the order the daemon listed them (`released_by`
/// as for a buffer). One per build reply: the same code built twice is recorded twice, as the
/// daemon counts two holds of one program.
struct RecordedProgram {
    request: Request,
    kernels: Vec<u32>,
    released_by: Option<u64>,
}

/// What a session created, to create it again on a new daemon.
#[derive(Default)]
pub(crate) struct Registry {
    buffers: HashMap<u64, RegisteredBuffer>,
    queues: BTreeMap<u64, RegisteredQueue>,
    /// Releases issued, by task id, oldest first, until their tasks complete.
    releases: VecDeque<(u64, Released)>,
    /// Library kernels looked up, by the id the application holds.
    kernels: BTreeMap<u32, String>,
    /// By number, in build order.
    programs: BTreeMap<u64, RecordedProgram>,
    next_program: u64,
    /// Buffers protected for checkpoints: id → buffer handle.
    protected: BTreeMap<u32, u64>,
}

impl Registry {
    /// The release task recorded for a registered buffer or queue (`None`: not registered).
    fn released_by(&mut self, what: Released) -> Option<&mut Option<u64>> {
        match what {
            Released::Buffer(handle) => self.buffers.get_mut(&handle).map(|b| &mut b.released_by),
            Released::Queue(handle) => self.queues.get_mut(&handle).map(|q| &mut q.released_by),
            Released::Program(number) => self.programs.get_mut(&number).map(|p| &mut p.released_by),
        }
    }

    fn forget(&mut self, what: Released) {
        match what {
            Released::Buffer(handle) => drop(self.buffers.remove(&handle)),
            Released::Queue(handle) => drop(self.queues.remove(&handle)),
            Released::Program(number) => drop(self.programs.remove(&number)),
        }
    }

    /// `what`'s release was issued as task `release` (`None`: it could not be, the object is
    /// forgotten at once); then forgets what completed releases released.
    fn released(&mut self, what: Released, release: Option<u64>, is_done: impl Fn(u64) -> bool) {
        match release {
            Some(id) => {
                if let Some(released_by) = self.released_by(what) {
                    *released_by = Some(id);
                    self.releases.push_back((id, what));
                }
            }
            None => self.forget(what),
        }
        self.forget_released(is_done);
    }

    /// Forgets the released buffers and queues whose release tasks completed (oldest first:
    /// each release costs O(1) amortised).
    fn forget_released(&mut self, is_done: impl Fn(u64) -> bool) {
        while let Some(&(id, what)) = self.releases.front() {
            if !is_done(id) {
                break;
            }
            self.releases.pop_front();
            // Unless the handle was given to a new object since.
            if self.released_by(what).is_some_and(|by| *by == Some(id)) {
                self.forget(what);
            }
        }
    }
}

/// Kernel ids as the application holds them (in `Kernel` values) → the ids the current daemon
/// knows. The identity until a resume finds a kernel whose id changed.
#[derive(Default)]
pub(crate) struct KernelIds {
    remapped: AtomicBool,
    map: RwLock<HashMap<u32, u32>>,
    next_private: AtomicU32,
}

impl KernelIds {
    /// The id to send for the kernel the application knows as `id`.
    #[inline]
    pub(crate) fn real(&self, id: u32) -> u32 {
        if !self.remapped.load(Ordering::Relaxed) {
            return id;
        }
        self.map
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .get(&id)
            .copied()
            .unwrap_or(id)
    }

    /// The id to give the application for a kernel the current daemon calls `real`: itself,
    /// unless an earlier daemon's id that the application still holds is the same number.
    pub(crate) fn adopt(&self, real: u32) -> u32 {
        if !self.remapped.load(Ordering::Relaxed) {
            return real;
        }
        let mut map = self.map.write().unwrap_or_else(|e| e.into_inner());
        if !map.contains_key(&real) {
            return real;
        }
        let private = GONE_KERNEL - 1 - self.next_private.fetch_add(1, Ordering::Relaxed);
        map.insert(private, real);
        private
    }

    /// Records that the application's `id` now means `real` (`None`: gone).
    fn set(&self, id: u32, real: Option<u32>) {
        let real = real.unwrap_or(GONE_KERNEL);
        let mut map = self.map.write().unwrap_or_else(|e| e.into_inner());
        let current = map.get(&id).copied().unwrap_or(id);
        if current != real {
            map.insert(id, real);
            self.remapped.store(true, Ordering::Release);
        }
    }
}

/// A session's reconnection state.
pub(crate) struct ResumeState {
    pub(crate) registry: Mutex<Registry>,
    pub(crate) kernel_ids: KernelIds,
    /// How long to keep trying to reach a new daemon (zero: do not).
    pub(crate) timeout: Duration,
    pub(crate) socket: PathBuf,
    pub(crate) client_name: String,
    /// Resumes so far; a thread that saw the daemon gone resumes only if nobody did since.
    pub(crate) epoch: AtomicU64,
    /// Held while one thread resumes; the others wait for it.
    pub(crate) recovering: Mutex<()>,
    /// Set when reconnection was given up (or is off): the session is closed for good.
    pub(crate) given_up: AtomicBool,
    /// Tasks issued again on a new daemon because the dead one never took them.
    pub(crate) reissued: AtomicU64,
}

impl ResumeState {
    pub(crate) fn new(timeout: Duration, socket: PathBuf, client_name: String) -> Self {
        ResumeState {
            registry: Mutex::default(),
            kernel_ids: KernelIds::default(),
            timeout,
            socket,
            client_name,
            epoch: AtomicU64::new(0),
            recovering: Mutex::new(()),
            given_up: AtomicBool::new(timeout.is_zero()),
            reissued: AtomicU64::new(0),
        }
    }

    fn registry(&self) -> std::sync::MutexGuard<'_, Registry> {
        self.registry.lock().unwrap_or_else(|e| e.into_inner())
    }

    pub(crate) fn buffer_created(&self, handle: u64, offset: u64, len: u64, whereabouts: Arc<Whereabouts>) {
        self.registry().buffers.insert(
            handle,
            RegisteredBuffer {
                offset,
                len,
                whereabouts,
                released_by: None,
            },
        );
    }

    /// A buffer's release was issued as task `release` (`None`: it could not be issued, the
    /// session is gone). `is_done` says which tasks completed: the registry forgets released
    /// buffers and queues once their release tasks have.
    pub(crate) fn buffer_released(&self, handle: u64, release: Option<u64>, is_done: impl Fn(u64) -> bool) {
        let mut registry = self.registry();
        // The daemon unprotects a released buffer too.
        registry.protected.retain(|_, protected| *protected != handle);
        registry.released(Released::Buffer(handle), release, is_done);
    }

    /// A buffer was protected for checkpoints under `id`.
    pub(crate) fn protected(&self, id: u32, handle: u64) {
        self.registry().protected.insert(id, handle);
    }

    /// Protects the session's buffers again with `call` (a new daemon does not know what the
    /// old one was told); returns how many it refused.
    pub(crate) fn protect_again(&self, mut call: impl FnMut(&Request) -> Option<Response>) -> usize {
        let protected: Vec<(u32, u64)> = self.registry().protected.iter().map(|(i, h)| (*i, *h)).collect();
        protected
            .into_iter()
            .filter(|(id, buffer)| {
                !matches!(
                    call(&Request::Protect {
                        id: *id,
                        buffer: *buffer
                    }),
                    Some(Response::Protected { .. })
                )
            })
            .count()
    }

    pub(crate) fn queue_created(&self, queue: ResumedQueue) {
        self.registry().queues.insert(
            queue.handle,
            RegisteredQueue {
                queue,
                released_by: None,
            },
        );
    }

    /// A queue's release was issued as task `release` (as [`ResumeState::buffer_released`]).
    pub(crate) fn queue_released(&self, handle: u64, release: Option<u64>, is_done: impl Fn(u64) -> bool) {
        self.registry().released(Released::Queue(handle), release, is_done);
    }

    /// A library kernel was looked up: returns the id to give the application.
    pub(crate) fn kernel_found(&self, real: u32, name: &str) -> u32 {
        let id = self.kernel_ids.adopt(real);
        self.registry().kernels.insert(id, name.to_string());
        id
    }

    /// A program was built: returns the ids to give the application for its kernels, and its
    /// number here (for [`ResumeState::program_released`]).
    pub(crate) fn program_built(&self, request: Request, real: &[u32]) -> (Vec<u32>, u64) {
        let kernels: Vec<u32> = real.iter().map(|&r| self.kernel_ids.adopt(r)).collect();
        let mut registry = self.registry();
        let number = registry.next_program;
        registry.next_program += 1;
        registry.programs.insert(
            number,
            RecordedProgram {
                request,
                kernels: kernels.clone(),
                released_by: None,
            },
        );
        (kernels, number)
    }

    /// Program `number`'s release was issued as task `release` (as
    /// [`ResumeState::buffer_released`]).
    pub(crate) fn program_released(&self, number: u64, release: Option<u64>, is_done: impl Fn(u64) -> bool) {
        self.registry().released(Released::Program(number), release, is_done);
    }

    /// The resume messages for a session with this segment geometry: a `Resume` and as many
    /// `ResumeMore` as the lists need (the segment's memfd goes with the first), plus the
    /// application's kernel ids in the order the request names them. `is_done`: whether the
    /// daemon that died completed a task (a buffer whose `sync_from` it did not complete is
    /// lost). `replaying`: the tasks it did not complete will be issued again (they are all
    /// untaken), so the buffers and queues they release are resumed too.
    pub(crate) fn messages(
        &self,
        previous_session: u64,
        submission_capacity: u32,
        completion_capacity: u32,
        heap_len: u64,
        replaying: bool,
        is_done: impl Fn(u64) -> bool,
    ) -> (Vec<Request>, Vec<u32>) {
        let registry = self.registry();
        let resumed = |released_by: Option<u64>| released_by.is_none_or(|id| replaying && !is_done(id));
        let mut buffers: Vec<ResumedBuffer> = registry
            .buffers
            .iter()
            .filter(|(_, b)| resumed(b.released_by))
            .map(|(&handle, b)| ResumedBuffer {
                handle,
                offset: b.offset,
                len: b.len,
                lost: b.whereabouts.lost(&is_done),
            })
            .collect();
        buffers.sort_by_key(|b| b.handle & 0xffff_ffff);
        let queues: Vec<ResumedQueue> = registry
            .queues
            .values()
            .filter(|q| resumed(q.released_by))
            .map(|q| q.queue.clone())
            .collect();
        let (ids, names): (Vec<u32>, Vec<String>) = registry.kernels.iter().map(|(&i, n)| (i, n.clone())).unzip();
        drop(registry);
        let mut buffer_parts = buffers.chunks(RESUME_BUFFERS_PER_MESSAGE);
        let mut queue_parts = queues.chunks(RESUME_QUEUES_PER_MESSAGE);
        let parts = buffer_parts.len().max(queue_parts.len()).max(1);
        let mut messages = Vec::with_capacity(parts);
        for part in 0..parts {
            let buffers = buffer_parts.next().unwrap_or_default().to_vec();
            let queues = queue_parts.next().unwrap_or_default().to_vec();
            let more = part + 1 < parts;
            messages.push(if part == 0 {
                Request::Resume {
                    version: PROTOCOL_VERSION,
                    client_name: self.client_name.clone(),
                    previous_session,
                    submission_capacity,
                    completion_capacity,
                    heap_len,
                    buffers,
                    queues,
                    kernels: names.clone(),
                    more,
                }
            } else {
                Request::ResumeMore { buffers, queues, more }
            });
        }
        (messages, ids)
    }

    /// The current daemon's id → the application's id, for every kernel the session knows
    /// (looked up or built): taken before a resume remaps them, to translate the launches
    /// issued again.
    pub(crate) fn kernels_by_real_id(&self) -> HashMap<u32, u32> {
        let registry = self.registry();
        let ids = registry
            .kernels
            .keys()
            .copied()
            .chain(registry.programs.values().flat_map(|p| p.kernels.iter().copied()));
        ids.map(|id| (self.kernel_ids.real(id), id)).collect()
    }

    /// Applies the new daemon's kernel ids (`real[i]` for `ids[i]`).
    pub(crate) fn kernels_resumed(&self, ids: &[u32], real: &[Option<u32>]) {
        for (&id, &real) in ids.iter().zip(real) {
            self.kernel_ids.set(id, real);
        }
    }

    /// Builds the session's programs again with `call`, in their original order, and maps their
    /// kernels' ids. A program that no longer builds leaves its kernels gone (their launches
    /// fail with `UnknownKernel`); returns how many did not build. A released program is built
    /// again only while its release may still be issued on the new daemon (`replaying`, the
    /// release not done), as for buffers; otherwise its kernels are gone.
    pub(crate) fn rebuild_programs(
        &self,
        mut call: impl FnMut(&Request) -> Option<Response>,
        replaying: bool,
        is_done: impl Fn(u64) -> bool,
    ) -> usize {
        let mut programs: Vec<(Request, Vec<u32>)> = Vec::new();
        for p in self.registry().programs.values() {
            if p.released_by.is_none_or(|id| replaying && !is_done(id)) {
                programs.push((p.request.clone(), p.kernels.clone()));
            } else {
                for &id in &p.kernels {
                    self.kernel_ids.set(id, None);
                }
            }
        }
        let mut failed = 0;
        for (request, ids) in programs {
            match call(&request) {
                Some(Response::Program { kernels, .. }) if kernels.len() == ids.len() => {
                    for (&id, (real, _)) in ids.iter().zip(&kernels) {
                        self.kernel_ids.set(id, Some(*real));
                    }
                }
                _ => {
                    failed += 1;
                    for &id in &ids {
                        self.kernel_ids.set(id, None);
                    }
                }
            }
        }
        failed
    }
}

/// The reconnect timeout: the option if given, else `$AGORA_RECONNECT_TIMEOUT`, else
/// [`DEFAULT_RECONNECT_TIMEOUT`].
pub(crate) fn reconnect_timeout(option: Option<Duration>) -> Result<Duration, Error> {
    match option {
        Some(t) => Ok(t),
        None => Ok(reconnect_timeout_from(std::env::var(RECONNECT_ENV).ok())?.unwrap_or(DEFAULT_RECONNECT_TIMEOUT)),
    }
}

/// [`RECONNECT_ENV`]'s value (`None`: not set, or empty); 0 turns reconnection off. It was
/// ignored when no number: a job that set `5m` for a long maintenance window got 30 s.
fn reconnect_timeout_from(value: Option<String>) -> Result<Option<Duration>, Error> {
    crate::session::seconds_from_env(
        RECONNECT_ENV,
        value,
        "reconnect timeout",
        Some("turns reconnection off"),
    )
}

/// Waits between connection attempts: short at first (a restarting daemon is usually back
/// within a fraction of a second), doubling to at most 100 ms, never past `deadline`.
pub(crate) fn backoff(attempt: u32, deadline: Instant) {
    let wait = Duration::from_millis(5u64 << attempt.min(5)).min(Duration::from_millis(100));
    let left = deadline.saturating_duration_since(Instant::now());
    std::thread::sleep(wait.min(left));
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_reconnect_timeout_from_the_environment_is_seconds_or_refused_naming_it() {
        let read = |v: &str| reconnect_timeout_from(Some(v.to_string()));
        assert_eq!(reconnect_timeout_from(None).unwrap(), None);
        assert_eq!(read(" ").unwrap(), None);
        assert_eq!(read("0").unwrap(), Some(Duration::ZERO), "0 turns reconnection off");
        assert_eq!(read("300").unwrap(), Some(Duration::from_secs(300)));
        assert_eq!(read("0.25").unwrap(), Some(Duration::from_millis(250)));
        for bad in ["-1", "nan", "inf", "86401", "5m", "lots"] {
            let message = read(bad).unwrap_err().to_string();
            assert!(
                message.contains("AGORA_RECONNECT_TIMEOUT") && message.contains("seconds"),
                "{bad}: {message}"
            );
        }
        assert_eq!(
            reconnect_timeout(Some(Duration::from_secs(7))).unwrap(),
            Duration::from_secs(7)
        );
    }

    #[test]
    fn kernel_ids_stay_the_identity_until_one_changes() {
        let ids = KernelIds::default();
        assert_eq!(ids.real(7), 7);
        assert_eq!(ids.adopt(7), 7);
        ids.set(7, Some(7));
        assert!(!ids.remapped.load(Ordering::Relaxed), "an unchanged id changes nothing");
        // After an upgrade kernel 7 is 9, and 3 is gone.
        ids.set(7, Some(9));
        ids.set(3, None);
        assert_eq!(ids.real(7), 9);
        assert_eq!(ids.real(3), GONE_KERNEL);
        assert_eq!(ids.real(5), 5, "ids nobody remapped are themselves");
        // A kernel the new daemon numbers 7 must not be confused with the application's old 7.
        let fresh = ids.adopt(7);
        assert_ne!(fresh, 7);
        assert_eq!(ids.real(fresh), 7);
        assert_eq!(ids.real(7), 9);
        // A second restart maps the application's ids again, from what they mean now.
        ids.set(fresh, Some(12));
        assert_eq!(ids.real(fresh), 12);
    }

    #[test]
    fn a_buffer_is_lost_only_when_a_completed_write_never_came_home() {
        let w = Whereabouts::default();
        assert!(!w.lost(|_| false), "a fresh buffer's host copy is all there is");
        w.written_by(3);
        w.written_by(4);
        assert!(w.unread());
        assert!(
            !w.lost(|_| false),
            "writes the dead daemon never completed are issued again"
        );
        assert!(
            w.lost(|id| id == 3),
            "the first write completed: its results were on a device"
        );
        // A sync_from (task 9) brings them home: lost only if the write completed and it did not.
        w.brought_home_by(9);
        assert!(!w.unread());
        assert!(w.lost(|id| id == 3));
        assert!(!w.lost(|id| id == 3 || id == 9));
        assert!(!w.lost(|_| false));
        // A later write, then a sync_to: the host copy is the newest again.
        w.written_by(12);
        assert!(w.lost(|_| true));
        w.host_written();
        assert!(!w.lost(|_| true));
    }

    #[test]
    fn long_lists_are_split_into_parts_under_the_frame_limit() {
        let state = ResumeState::new(Duration::from_secs(1), PathBuf::from("/nonexistent"), "t".into());
        for i in 0..(RESUME_BUFFERS_PER_MESSAGE as u64 * 2 + 5) {
            let whereabouts = Whereabouts::default();
            if i % 2 == 0 {
                whereabouts.written_by(1);
            }
            state.buffer_created(1 << 32 | i, i * 64, 64, Arc::new(whereabouts));
        }
        state.queue_created(ResumedQueue {
            handle: 1 << 32,
            name: "q".into(),
            class: agora_protocol::control::QueueClass::Batch,
            preferred_device: None,
            sla_ms: None,
        });
        state.kernel_found(4, "saxpy");
        let (messages, ids) = state.messages(1, 1024, 1024, 1 << 30, false, |_| true);
        assert_eq!(messages.len(), 3);
        assert_eq!(ids, vec![4]);
        let mut seen = 0;
        for (i, m) in messages.iter().enumerate() {
            let frame = agora_protocol::control::encode_frame(m).unwrap();
            assert!(frame.len() < agora_protocol::control::MAX_FRAME as usize / 2);
            let (buffers, more) = match m {
                Request::Resume {
                    buffers, more, kernels, ..
                } => {
                    assert_eq!(i, 0);
                    assert_eq!(kernels, &vec!["saxpy".to_string()]);
                    (buffers, *more)
                }
                Request::ResumeMore { buffers, more, .. } => (buffers, *more),
                _ => unreachable!(),
            };
            assert_eq!(more, i + 1 < messages.len());
            for b in buffers {
                assert_eq!(b.lost, (b.handle & 0xffff_ffff) % 2 == 0);
            }
            seen += buffers.len();
        }
        assert_eq!(seen, RESUME_BUFFERS_PER_MESSAGE * 2 + 5);
    }

    #[test]
    fn a_release_not_yet_taken_is_resumed_only_when_the_untaken_tasks_are_issued_again() {
        let state = ResumeState::new(Duration::from_secs(1), PathBuf::from("/nonexistent"), "t".into());
        for i in 0..3u64 {
            state.buffer_created(1 << 32 | i, i * 64, 64, Arc::default());
        }
        let queue = |handle| ResumedQueue {
            handle,
            name: "q".into(),
            class: agora_protocol::control::QueueClass::Batch,
            preferred_device: None,
            sla_ms: None,
        };
        state.queue_created(queue(1 << 32));
        state.queue_created(queue(1 << 32 | 1));
        let resumed = |replaying: bool, done: u64| {
            let (messages, _) = state.messages(1, 64, 64, 1 << 20, replaying, |id| id <= done);
            let Request::Resume { buffers, queues, .. } = &messages[0] else {
                unreachable!()
            };
            let mut buffers: Vec<u64> = buffers.iter().map(|b| b.handle & 0xff).collect();
            buffers.sort_unstable();
            (buffers, queues.iter().map(|q| q.handle & 0xff).collect::<Vec<_>>())
        };
        // Buffer 1's release is task 10, queue 1's task 11; neither completed.
        state.buffer_released(1 << 32 | 1, Some(10), |id| id <= 9);
        state.queue_released(1 << 32 | 1, Some(11), |id| id <= 9);
        assert_eq!(
            resumed(true, 9),
            (vec![0, 1, 2], vec![0, 1]),
            "replayed releases need their objects"
        );
        assert_eq!(
            resumed(false, 9),
            (vec![0, 2], vec![0]),
            "releases failed with the lost tasks"
        );
        assert_eq!(
            resumed(true, 11),
            (vec![0, 2], vec![0]),
            "completed releases are not resumed"
        );
        // A release that could not be issued forgets the buffer at once; completed releases are
        // forgotten at the next release.
        state.buffer_released(1 << 32 | 2, None, |id| id <= 11);
        assert_eq!(state.registry().buffers.len(), 1);
        assert_eq!(state.registry().queues.len(), 1);
        assert!(state.registry().releases.is_empty());
    }
}
