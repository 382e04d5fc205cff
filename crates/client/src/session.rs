//! Sessions: the connection to the daemon, the shared segment and the completion bookkeeping.

use std::cell::RefCell;
use std::collections::HashMap;
use std::os::unix::net::UnixStream;
use std::path::PathBuf;
use std::sync::atomic::{fence, AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use agora_protocol::control::{
    check_name, ControlError, ExportReaders, ExportStatus, KernelListing, PackageListing, QueueClass, ReloadReport,
    Request, Response, ResumedQueue, SessionStatus, StatusReport, MAX_NAME,
};
use agora_protocol::ring::{CompletionConsumer, SubmissionProducer};
use agora_protocol::segment::Geometry;
use agora_protocol::{KernelSignature, Op, RawArg, TaskDescriptor, TaskError, PROTOCOL_VERSION};
use agora_transport::shm::Segment;
use agora_transport::socket::{
    client_socket_path, peer_hung_up, recv_before, recv_before_with_fds, recv_with_fds, send, send_with_fds,
};
use agora_transport::wake::{futex_wait, futex_wake_all, AdaptiveSpin, Doorbell};
use agora_transport::TransportError;

use crate::buffer::Buffer;
use crate::queue::{Queue, QueueOptions};
use crate::resume::{backoff, reconnect_timeout, ResumeState};
use crate::{Error, TaskFailures};

/// How long to wait for the daemon's answer to hello.
const HELLO_TIMEOUT: Duration = Duration::from_secs(10);

/// How long a control call waits for the daemon's answer unless
/// [`SessionOptions::control_timeout`] or `$AGORA_CONTROL_TIMEOUT` ([`CONTROL_TIMEOUT_ENV`])
/// says otherwise.
pub const DEFAULT_CONTROL_TIMEOUT: Duration = Duration::from_secs(30);

/// Environment variable with the control timeout, in seconds, when a session's options name
/// none: the one way to change it for `agora status`, `agora drain` or the Slurm prolog, which
/// an operator runs but cannot give Rust options to; and for Python and C programs that leave
/// theirs at the default.
pub const CONTROL_TIMEOUT_ENV: &str = "AGORA_CONTROL_TIMEOUT";

/// How long a blocked waiter sleeps before it checks that the daemon is still there.
const LIVENESS_CHECK: Duration = Duration::from_millis(20);

thread_local! {
    /// Each client thread's spin before it blocks on the completion futex: at least what a block
    /// costs (so a daemon hiccup of a few microseconds does not turn into a 50 µs wake-up), at
    /// most a little more than a round trip through a lane.
    static SPIN: RefCell<AdaptiveSpin> = RefCell::new(AdaptiveSpin::new(agora_wait::MIN_BUDGET, Duration::from_micros(200)));
    /// The spin of a thread waiting for room in full rings: a throughput wait (a pipelining
    /// client is ahead of the daemon), where spinning long only takes a core from the
    /// dispatcher it waits for, so its floor is low (measured: 4 pipelining clients on 2 cores
    /// ran a third slower with the latency floor).
    static ROOM_SPIN: RefCell<AdaptiveSpin> = RefCell::new(AdaptiveSpin::new(Duration::from_micros(1), Duration::from_micros(100)));
    /// Whether this thread's last submission found the dispatcher asleep and rang its doorbell:
    /// then the dispatcher needs a core to wake on, perhaps the one this thread would spin on.
    static WOKE_DISPATCHER: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

/// How to open a session.
#[derive(Debug, Clone, Default)]
pub struct SessionOptions {
    /// Socket path; default `$AGORA_SOCKET`, else the per-user default path.
    pub socket: Option<PathBuf>,
    /// Name shown by `agora status`, and with the user the application that owns its
    /// checkpoints: processes of one name and user share them. Default the program name (the
    /// base name of `argv[0]`), with `.rank<N>` appended when the process is rank `N` of an MPI
    /// or Slurm job ([`RANK_VARIABLES`]), so every rank has checkpoints of its own. A name given
    /// here is used as it is.
    pub name: Option<String>,
    /// Heap bytes to ask for (the daemon grants at most its per-session quota). Default
    /// `$AGORA_HEAP_BYTES` ([`HEAP_ENV`]), else the daemon's quota.
    pub heap_bytes: Option<u64>,
    /// Longest a control call (buffer, queue, kernel, status...) waits for the daemon before
    /// it fails with [`Error::Timeout`]; default `$AGORA_CONTROL_TIMEOUT` (seconds,
    /// [`CONTROL_TIMEOUT_ENV`]), else [`DEFAULT_CONTROL_TIMEOUT`] (30 s).
    pub control_timeout: Option<Duration>,
    /// How long the session keeps trying to reach a restarted daemon when it finds its daemon
    /// gone (killed, crashed, restarted or upgraded): tasks that were in flight then fail with
    /// [`TaskError::DaemonRestarted`] (those the dead daemon never took, behind only completed
    /// ones, are issued again by the session), and everything else — buffers with their host copies,
    /// queues, kernels, programs — carries on under the new daemon. Default
    /// `$AGORA_RECONNECT_TIMEOUT` (seconds) or [`crate::DEFAULT_RECONNECT_TIMEOUT`] (30 s);
    /// zero turns reconnection off (the session then fails with [`Error::Disconnected`]).
    pub reconnect_timeout: Option<Duration>,
}

/// A kernel looked up by name.
#[derive(Debug, Clone)]
pub struct Kernel {
    pub(crate) id: u32,
    signature: KernelSignature,
    /// The [`Inner::local_id`] of the session whose program it belongs to, whose ids only that
    /// session's queues understand; [`GLOBAL_KERNEL`] for a library kernel under its daemon id,
    /// which names the same kernel in every session of the daemon.
    owner: u64,
    /// A program kernel's hold on its program: the program is released when the last
    /// [`crate::Program`] and kernel of that build are dropped, so a kernel handle always names
    /// a kernel its session still has (held, never read).
    _program: Option<Arc<crate::program::ProgramLease>>,
}

/// [`Kernel::owner`] of a kernel any session may launch.
const GLOBAL_KERNEL: u64 = 0;

/// The source of [`Inner::local_id`] (0 is [`GLOBAL_KERNEL`]).
static NEXT_LOCAL_ID: AtomicU64 = AtomicU64::new(1);

/// How many times this process's ancestry forked since the client first opened a session:
/// bumped in the child of every `fork()` (a `pthread_atfork` handler), so a session whose
/// [`Inner::fork_generation`] differs was opened by another process (an ancestor). Comparing
/// it costs one load on every call; `getpid()` would cost a system call (glibc caches the pid
/// no more, since 2.25).
static FORK_GENERATION: AtomicU64 = AtomicU64::new(0);

/// `pthread_atfork`'s child handler (runs in the child, which has one thread then).
extern "C" fn forked_child() {
    FORK_GENERATION.fetch_add(1, Ordering::Relaxed);
}

/// Installs [`forked_child`], once per process (a child inherits it).
fn watch_forks() {
    static INSTALLED: std::sync::Once = std::sync::Once::new();
    INSTALLED.call_once(|| {
        // SAFETY: registers a handler that only bumps an atomic; `pthread_atfork` fails only
        // for lack of memory, and then forks go unnoticed as before.
        unsafe { libc::pthread_atfork(None, None, Some(forked_child)) };
    });
}

thread_local! {
    /// The check a binding installed for this thread's waits for room in the rings and for a
    /// daemon to come back ([`with_room_interrupt`]): true to give the wait up with
    /// [`Error::Interrupted`].
    static ROOM_INTERRUPT: std::cell::Cell<Option<fn() -> bool>> = const { std::cell::Cell::new(None) };
}

/// How often a wait for room in the rings consults [`ROOM_INTERRUPT`].
const ROOM_INTERRUPT_EVERY: Duration = Duration::from_millis(50);

/// Runs `f` with `interrupted` consulted about every 50 ms while a task issued in it waits for
/// room in the rings (when another thread took the room that [`Session::wait_for_room`] found),
/// and between attempts to reach a daemon while a call in it waits for one to come back (up to
/// the reconnect timeout): once it returns true, the call fails with [`Error::Interrupted`],
/// nothing is issued, and the session is not given up (the next call tries to resume it
/// again). For bindings whose waits must react to signals (Python's Ctrl-C); `interrupted` runs
/// on this thread.
#[doc(hidden)]
pub fn with_room_interrupt<R>(interrupted: fn() -> bool, f: impl FnOnce() -> R) -> R {
    struct Restore(Option<fn() -> bool>);
    impl Drop for Restore {
        fn drop(&mut self) {
            ROOM_INTERRUPT.with(|c| c.set(self.0));
        }
    }
    let _restore = Restore(ROOM_INTERRUPT.with(|c| c.replace(Some(interrupted))));
    f()
}

impl Kernel {
    /// A kernel of a program that session `owner` built.
    pub(crate) fn of_program(
        id: u32,
        signature: KernelSignature,
        owner: &Inner,
        program: Arc<crate::program::ProgramLease>,
    ) -> Self {
        Kernel {
            id,
            signature,
            owner: owner.local_id,
            _program: Some(program),
        }
    }

    /// Refused unless a queue of `session` may launch it: a program kernel's id means another
    /// kernel (or none) in any other session, so launching it there would run the wrong code.
    #[inline]
    pub(crate) fn check_session(&self, session: &Inner) -> Result<(), Error> {
        if self.owner == GLOBAL_KERNEL || self.owner == session.local_id {
            Ok(())
        } else {
            Err(Error::Task(TaskError::ForeignKernel { kernel: self.id }))
        }
    }

    /// Its signature as the daemon declares it.
    pub fn signature(&self) -> &KernelSignature {
        &self.signature
    }

    /// Its name.
    pub fn name(&self) -> &str {
        &self.signature.name
    }

    /// The id the daemon gave it, stable for the daemon's lifetime (a package reload gives a
    /// changed kernel a new id; the old one keeps running the version it named).
    pub fn id(&self) -> u32 {
        self.id
    }
}

struct Producer {
    ring: SubmissionProducer,
    next_id: u64,
}

/// Tasks a dead daemon never took, to issue again on the next one ([`Inner::untaken_tasks`]).
struct Replay {
    /// The oldest one's id (the rest follow in order).
    first: u64,
    descriptors: Vec<TaskDescriptor>,
}

struct Completions {
    ring: CompletionConsumer,
    /// The error of each failed task whose [`crate::Task`] handle is alive: a task's `wait`
    /// reports it every time it is asked, and dropping the handle forgets it.
    task_errors: HashMap<u64, TaskError>,
    /// Each queue's failures since its last `finish`.
    queue_failures: HashMap<u64, TaskFailures>,
}

/// `handles[slot]` of a failed task whose error `task_errors` holds.
const ERROR_STORED: u64 = 1 << 63;
/// `slot_queue[slot]` of a task no handle or queue reports (the release of a queue or buffer).
const UNTRACKED: u64 = u64::MAX;

/// What a new daemon answered to a resume.
struct Resumed {
    doorbell: Doorbell,
    /// The session's id there.
    session: u64,
    /// The new ids of the kernels the resume named, in its order.
    kernels: Vec<Option<u32>>,
}

/// Something a late reply created, to release.
#[derive(Debug, Clone, Copy)]
enum Orphan {
    Buffer(u64),
    Queue(u64),
}

/// The control connection of a session.
struct Control {
    stream: UnixStream,
    /// Bytes of a reply that has not fully arrived yet.
    pending: Vec<u8>,
    /// Replies still to come for calls that timed out: the daemon answers in request order,
    /// so the next call skips this many before reading its own.
    owed: usize,
    /// What those late replies created and nobody holds (a buffer or queue the daemon made
    /// after the caller gave up): released through the ring once seen, or the session's quota
    /// would keep them for its life.
    orphans: Vec<Orphan>,
    /// Descriptors that came with the last reply (an exportable or attached buffer's memory).
    fds: Vec<std::os::fd::OwnedFd>,
}

pub(crate) struct Inner {
    control: Mutex<Control>,
    pub(crate) control_timeout: Duration,
    /// A second handle on the control connection, to notice the daemon hanging up while
    /// waiting (replaced by a resume).
    liveness: Mutex<UnixStream>,
    segment: Segment,
    /// Rung after a submission when the daemon sleeps (replaced by a resume: each daemon makes
    /// its own).
    doorbell: std::sync::RwLock<Doorbell>,
    producer: Mutex<Producer>,
    completions: Mutex<Completions>,
    /// `done[id % capacity]` holds the newest consumed task id in that slot.
    done: Box<[AtomicU64]>,
    /// Queue handle of the task issued into each slot ([`UNTRACKED`] for releases).
    slot_queue: Box<[AtomicU64]>,
    /// Id of the task in each slot while its `Task` handle lives (0 after the handle is dropped),
    /// with [`ERROR_STORED`] set once its error is in `task_errors`. A slot is reused only after
    /// its previous task's completion was consumed, so this is exact.
    handles: Box<[AtomicU64]>,
    /// Tasks issued and tasks whose completion was consumed.
    issued: AtomicU64,
    consumed: AtomicU64,
    capacity: u64,
    /// Queues with failures not yet reported by a `finish` (a fast check for the common case).
    failing_queues: AtomicUsize,
    disconnected: AtomicBool,
    /// This program ended the session ([`Inner::end`]): every call fails with [`Error::Ended`].
    ended: AtomicBool,
    /// The session opened a latency-class queue: its waits never yield their core (a yield
    /// that goes to another program's busy thread, or to the daemon's batch lanes, loses the
    /// core for a time slice — milliseconds, far beyond a latency target).
    latency_tenant: AtomicBool,
    id: AtomicU64,
    /// This session's number in this process, never reused (unlike the daemon's session id,
    /// which a restarted daemon may give again): what kernels record as their owner.
    pub(crate) local_id: u64,
    /// What a resume after a daemon restart needs ([`crate::resume`]).
    pub(crate) resume: ResumeState,
    /// `Queue::snapshot`'s clock: the daemon's interval (set by `protect`) and the last
    /// checkpoint it issued (or the first protect).
    pub(crate) snapshots: Mutex<Option<SnapshotClock>>,
    /// Checkpoint levels whose directory the daemon found unusable, with its message naming the
    /// key, the directory and why (told by `protect`): `Queue::checkpoint` refuses them before
    /// issuing, since the task's failure could only give a code.
    pub(crate) checkpoint_unusable: Mutex<Vec<(u8, String)>>,
    /// Awaited tasks and the thread that waits for them ([`crate::awaiting`]).
    pub(crate) watch: Arc<crate::awaiting::Watch>,
    /// The process that opened the session, and [`FORK_GENERATION`] then: in a process forked
    /// from it every call fails with [`Error::ForkedChild`], and the `Drop`s release nothing
    /// (the rings, the control socket and this bookkeeping are the parent's).
    owner_pid: u32,
    fork_generation: u64,
    /// Heap buffers whose release this session issued lately ([`Inner::alloc_buffer`]).
    frees: Mutex<std::collections::VecDeque<PendingFree>>,
}

/// A heap buffer's release, issued through the ring: its range is free for the next
/// allocation only once the daemon took the release and every task issued before it (those
/// that may use the buffer) finished.
struct PendingFree {
    /// The release task's id.
    release: u64,
    /// The buffer's length.
    len: u64,
    /// When an allocation first found every task up to the release finished (the range is
    /// free then, or a moment later: the daemon frees it once the last job holding it is
    /// dropped, just after its completion is posted).
    settled: Option<Instant>,
}

/// How long a settled release ([`PendingFree::settled`]) is still counted on.
const FREE_SETTLES_WITHIN: Duration = Duration::from_secs(1);

/// Pauses between the allocation attempts after every release in flight settled (doubling
/// from 1 ms: about 60 ms in all).
const SETTLED_ATTEMPTS: u32 = 6;

/// `Queue::snapshot`'s clock.
#[derive(Clone, Copy, Debug)]
pub(crate) struct SnapshotClock {
    /// The daemon's checkpoint interval.
    pub(crate) interval: Duration,
    /// The last snapshot (or the first `protect`).
    pub(crate) since: Instant,
}

/// A connection to the daemon. Clone it freely; all clones share one session.
#[derive(Clone)]
pub struct Session {
    pub(crate) inner: Arc<Inner>,
}

impl std::fmt::Debug for Session {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Session")
            .field("id", &self.id())
            .finish_non_exhaustive()
    }
}

impl Session {
    /// Connects to the daemon named by `$AGORA_SOCKET`, else the default socket path.
    pub fn connect() -> Result<Session, Error> {
        Self::connect_with(SessionOptions::default())
    }

    /// Connects with explicit options.
    pub fn connect_with(options: SessionOptions) -> Result<Session, Error> {
        watch_forks();
        let path = client_socket_path(options.socket.clone());
        let stream = UnixStream::connect(&path).map_err(|cause| Error::Connect {
            path: path.clone(),
            cause,
        })?;
        let name = match options.name.clone() {
            Some(name) => {
                check_name("client", &name)?;
                name
            }
            // The program's name (and the process's rank), made into what the daemon accepts.
            None => default_session_name(
                &std::env::args()
                    .next()
                    .map(|a| a.rsplit('/').next().unwrap_or("").to_string())
                    .unwrap_or_default(),
            ),
        };
        let control_timeout = control_timeout(options.control_timeout)?;
        let reconnect = reconnect_timeout(options.reconnect_timeout)?;
        // A daemon that accepts but never answers (stuck, stopped, or not an Agora daemon) must
        // not hang us: bound the hello exchange, by the control timeout when one was set (it
        // was a fixed 10 s whatever $AGORA_CONTROL_TIMEOUT said).
        let hello_wait = if options.control_timeout.is_some() || std::env::var_os(CONTROL_TIMEOUT_ENV).is_some() {
            control_timeout
        } else {
            HELLO_TIMEOUT
        };
        let _ = stream.set_read_timeout(Some(hello_wait));
        let heap_bytes = match options.heap_bytes {
            Some(bytes) => Some(bytes),
            None => heap_bytes_from(std::env::var(HEAP_ENV).ok())?,
        };
        let hello = Request::Hello {
            version: PROTOCOL_VERSION,
            client_name: name.clone(),
            heap_bytes,
        };
        if let Err(e) = send(&stream, &hello) {
            // A daemon that refused the connection (a limit) said why before it closed it.
            return Err(refusal_waiting(&stream).map_or_else(|| Error::from(e), Error::Control));
        }
        let (response, fds): (Response, _) = recv_with_fds(&stream).map_err(|e| match e {
            agora_transport::TransportError::Os { cause, .. }
                if matches!(
                    cause.kind(),
                    std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                ) =>
            {
                // A daemon is there (it accepted): not "start one with agora serve".
                Error::Timeout {
                    request: "hello (opening the session)".into(),
                    after: hello_wait,
                }
            }
            other => Error::from(other),
        })?;
        let _ = stream.set_read_timeout(None);
        // A daemon that stops reading must not block a call forever either (requests are small,
        // so this only fires when it has not read for that long).
        let _ = stream.set_write_timeout(Some(control_timeout));
        let resume = ResumeState::new(reconnect, path.clone(), name.clone());
        let (session, sub_cap, comp_cap, heap_len) = match response {
            Response::Welcome {
                session,
                submission_capacity,
                completion_capacity,
                heap_len,
            } => (session, submission_capacity, completion_capacity, heap_len),
            Response::Error(e) => return Err(Error::Control(e)),
            other => return Err(Error::Protocol(format!("unexpected reply to hello: {other:?}"))),
        };
        let mut fds = fds.into_iter();
        let (Some(segment_fd), Some(doorbell_fd)) = (fds.next(), fds.next()) else {
            return Err(Error::Protocol("the daemon sent no segment".into()));
        };
        let geometry = Geometry::new(sub_cap, comp_cap, heap_len).map_err(|e| Error::Protocol(e.to_string()))?;
        let segment = Segment::open(segment_fd, geometry).map_err(|e| match e {
            // An address-space limit (or no memory) refuses the mapping: say what to change,
            // not "a protocol error".
            agora_transport::TransportError::Os { cause, .. } if cause.raw_os_error() == Some(libc::ENOMEM) => {
                Error::MapSegment {
                    bytes: geometry.total_len,
                    cause,
                }
            }
            other => Error::from(other),
        })?;
        let view = *segment.view();
        // Never have more tasks outstanding than either ring holds.
        let capacity = u64::from(sub_cap.min(comp_cap));
        let liveness = stream.try_clone().map_err(|e| Error::Protocol(e.to_string()))?;
        let inner = Inner {
            control: Mutex::new(Control {
                stream,
                pending: Vec::new(),
                owed: 0,
                orphans: Vec::new(),
                fds: Vec::new(),
            }),
            control_timeout,
            liveness: Mutex::new(liveness),
            doorbell: std::sync::RwLock::new(Doorbell::from_fd(doorbell_fd)),
            producer: Mutex::new(Producer {
                ring: SubmissionProducer::new(view),
                next_id: 1,
            }),
            completions: Mutex::new(Completions {
                ring: CompletionConsumer::new(view),
                task_errors: HashMap::new(),
                queue_failures: HashMap::new(),
            }),
            done: (0..capacity).map(|_| AtomicU64::new(0)).collect(),
            slot_queue: (0..capacity).map(|_| AtomicU64::new(0)).collect(),
            handles: (0..capacity).map(|_| AtomicU64::new(0)).collect(),
            issued: AtomicU64::new(0),
            consumed: AtomicU64::new(0),
            capacity,
            failing_queues: AtomicUsize::new(0),
            disconnected: AtomicBool::new(false),
            ended: AtomicBool::new(false),
            latency_tenant: AtomicBool::new(false),
            id: AtomicU64::new(session),
            local_id: NEXT_LOCAL_ID.fetch_add(1, Ordering::Relaxed),
            resume,
            snapshots: Mutex::new(None),
            checkpoint_unusable: Mutex::new(Vec::new()),
            watch: Arc::default(),
            segment,
            owner_pid: std::process::id(),
            fork_generation: FORK_GENERATION.load(Ordering::Relaxed),
            frees: Mutex::default(),
        };
        Ok(Session { inner: Arc::new(inner) })
    }

    /// Ends the session with the daemon now, whatever handles of it (buffers, queues, tasks,
    /// clones of this session) live on: the daemon reclaims it as for a client that exited (its
    /// heap quota, queues and device memory are free for others at once), and it is never
    /// resumed. Buffers' host memory stays mapped in this process until their last handle goes,
    /// so slices and views taken before stay readable; every later call on the session or its
    /// objects fails with [`Error::Ended`]. Dropping the last handle ends a session too; this
    /// is for programs (and bindings: Python's `session.close()`) whose handles outlive it.
    pub fn end(&self) {
        self.inner.end();
    }

    /// Session id assigned by the daemon (a new one after the session resumed on a restarted
    /// daemon).
    pub fn id(&self) -> u64 {
        self.inner.id.load(Ordering::Relaxed)
    }

    /// How many times the session resumed on a restarted daemon.
    pub fn resumes(&self) -> u64 {
        self.inner.resume.epoch.load(Ordering::Relaxed)
    }

    /// How many tasks the session issued again on a restarted daemon because the one that
    /// died never took them (issued while it was gone, or waiting in the ring): they complete
    /// as if nothing happened, instead of failing with [`TaskError::DaemonRestarted`].
    pub fn tasks_reissued(&self) -> u64 {
        self.inner.resume.reissued.load(Ordering::Relaxed)
    }

    /// Creates a batch-class queue.
    pub fn queue(&self, name: &str) -> Result<Queue, Error> {
        self.queue_with(QueueOptions {
            name: name.to_string(),
            class: QueueClass::Batch,
            preferred_device: None,
            sla: None,
        })
    }

    /// Creates a queue with options.
    pub fn queue_with(&self, options: QueueOptions) -> Result<Queue, Error> {
        check_name("queue", &options.name)?;
        if options.class == QueueClass::Latency {
            self.inner.latency_tenant.store(true, Ordering::Relaxed);
        }
        let name = options.name;
        let class = options.class;
        let preferred_device = options.preferred_device.map(|k| k.name().to_string());
        let sla_ms = options.sla.map(|d| d.as_secs_f64() * 1e3);
        match self.inner.request(&Request::CreateQueue {
            name: name.clone(),
            class,
            preferred_device: preferred_device.clone(),
            sla_ms,
        })? {
            Response::Queue { handle } => {
                self.inner.resume.queue_created(ResumedQueue {
                    handle,
                    name,
                    class,
                    preferred_device,
                    sla_ms,
                });
                Ok(Queue::new(self.inner.clone(), handle))
            }
            other => Err(unexpected(other)),
        }
    }

    /// Allocates a zero-filled buffer of `len` bytes in the session heap.
    pub fn buffer(&self, len: u64) -> Result<Buffer, Error> {
        match self.inner.alloc_buffer(len)? {
            Response::Buffer { handle, offset, len } => {
                let buffer = Buffer::new(self.inner.clone(), handle, offset, len)?;
                buffer.zero();
                Ok(buffer)
            }
            other => Err(unexpected(other)),
        }
    }

    /// Allocates an **exportable** buffer of `len` bytes (zero-filled): like
    /// [`Session::buffer`], but its host copy is a memory region of its own, so that
    /// [`Session::export`] can hand it to other processes without exposing anything else of the
    /// session. It counts against a second limit as large as the session's heap quota, and
    /// unlike heap buffers it is not kept across a daemon restart.
    pub fn shared_buffer(&self, len: u64) -> Result<Buffer, Error> {
        match self.inner.request_with_memory(&Request::AllocShared { len })? {
            (Response::SharedBuffer { handle, len }, Some(fd)) => {
                let region = agora_transport::shm::Region::open(fd, len, true)?;
                Buffer::in_region(self.inner.clone(), handle, region, false)
            }
            (Response::SharedBuffer { .. }, None) => Err(Error::Protocol(
                "an exportable buffer arrived without its memory".into(),
            )),
            (other, _) => Err(unexpected(other)),
        }
    }

    /// Publishes an exportable `buffer` under `name` (XEMEM's `xemem_make`): sessions of the
    /// users `readers` allows (and of this user) can [`Session::attach`] it, zero-copy.
    /// `writable`: attachers may attach read-write; otherwise its memory is sealed so that no
    /// attacher can ever map it writable. The export ends with [`Session::revoke`], with the
    /// buffer's release, or with this session.
    pub fn export(&self, buffer: &Buffer, name: &str, readers: &ExportReaders, writable: bool) -> Result<(), Error> {
        buffer.check_session(&self.inner, 0)?;
        match self.inner.request(&Request::Export {
            buffer: buffer.handle(),
            name: name.to_string(),
            readers: readers.clone(),
            writable,
        })? {
            Response::Exported { .. } => Ok(()),
            other => Err(unexpected(other)),
        }
    }

    /// Withdraws the export `name` (XEMEM's `xemem_remove`): nobody new can attach, and every
    /// attacher's tasks on it fail with [`TaskError::Attachment`]; the memory the attachers
    /// mapped stays readable to them until they drop their buffer. Returns the sessions that
    /// were attached.
    pub fn revoke(&self, name: &str) -> Result<Vec<u64>, Error> {
        match self.inner.request(&Request::Revoke { name: name.to_string() })? {
            Response::Exported { attachers, .. } => Ok(attachers),
            other => Err(unexpected(other)),
        }
    }

    /// Attaches the export `name` (XEMEM's `xemem_get` + `xemem_attach`): a buffer of this
    /// session backed by the exporter's memory, usable as a kernel argument and readable in
    /// place. It is the exporter's buffer: where its newest contents are is shared, so a
    /// task of either session that reads it gets them (the daemon moves them), while its
    /// host copy shows a device's results only after a `sync_from` by either side.
    /// `writable`: attach read-write (the export must allow it).
    pub fn attach(&self, name: &str, writable: bool) -> Result<Buffer, Error> {
        match self.inner.request_with_memory(&Request::Attach {
            name: name.to_string(),
            writable,
        })? {
            (
                Response::Attached {
                    handle, len, writable, ..
                },
                Some(fd),
            ) => {
                let region = agora_transport::shm::Region::open(fd, len, writable)?;
                Buffer::in_region(self.inner.clone(), handle, region, true)
            }
            (Response::Attached { .. }, None) => {
                Err(Error::Protocol("an attachment arrived without its memory".into()))
            }
            (other, _) => Err(unexpected(other)),
        }
    }

    /// The exports this user may see: its own and those it may attach (all, for an
    /// administrator).
    pub fn exports(&self) -> Result<Vec<ExportStatus>, Error> {
        match self.inner.request(&Request::Exports)? {
            Response::Exports(list) => Ok(list),
            other => Err(unexpected(other)),
        }
    }

    /// Protects `buffer` under `id` for checkpoints (FTI's `FTI_Protect`): every later
    /// [`Queue::checkpoint`] of this session saves it, and [`Session::recover`] restores it.
    /// Protecting an id again replaces its buffer; releasing the buffer unprotects it. The
    /// checkpoints belong to the application named by [`SessionOptions::name`] (the program's
    /// name by default) and the user, so a restarted process of the same name recovers them.
    /// At most 16 ids per session; pack small values (an iteration counter) into one buffer.
    pub fn protect(&self, id: u32, buffer: &Buffer) -> Result<(), Error> {
        buffer.check_session(&self.inner, 0)?;
        match self.inner.request(&Request::Protect {
            id,
            buffer: buffer.handle(),
        })? {
            Response::Protected {
                interval_ms, unusable, ..
            } => {
                self.inner.resume.protected(id, buffer.handle());
                *self.inner.checkpoint_unusable.lock().unwrap_or_else(|e| e.into_inner()) = unusable;
                let mut clock = self.inner.snapshots.lock().unwrap_or_else(|e| e.into_inner());
                let interval = Duration::from_millis(interval_ms);
                match clock.as_mut() {
                    Some(clock) => clock.interval = interval,
                    None => {
                        *clock = Some(SnapshotClock {
                            interval,
                            since: Instant::now(),
                        })
                    }
                }
                Ok(())
            }
            other => Err(unexpected(other)),
        }
    }

    /// Restores every protected buffer's host copy from the application's newest intact
    /// checkpoint (FTI's `FTI_Recover`; damaged newer ones are passed over and named in the
    /// report). Call it after protecting, before issuing tasks that use the buffers; then
    /// `sync_to` is not needed (the host copies are the current ones). An error when the
    /// application has no checkpoint, or a protected id is missing or has another size in it:
    /// then nothing is restored.
    pub fn recover(&self) -> Result<agora_protocol::control::RecoverReport, Error> {
        match self.inner.request(&Request::Recover)? {
            Response::Recovered(report) => Ok(report),
            other => Err(unexpected(other)),
        }
    }

    /// The application's complete checkpoints (what [`Session::recover`] would choose from, the
    /// newest last) and the outcome of its last checkpoint writes (FTI's `FTI_Status`).
    pub fn checkpoints(&self) -> Result<agora_protocol::control::CheckpointReport, Error> {
        match self.inner.request(&Request::Checkpoints)? {
            Response::Checkpoints(report) => Ok(report),
            other => Err(unexpected(other)),
        }
    }

    /// Allocates a buffer holding a copy of `data`.
    pub fn buffer_from<T: bytemuck::Pod>(&self, data: &[T]) -> Result<Buffer, Error> {
        let bytes: &[u8] = bytemuck::cast_slice(data);
        let buffer = self.buffer(bytes.len().max(1) as u64)?;
        buffer.write(0, bytes)?;
        Ok(buffer)
    }

    /// Looks a kernel up by name.
    pub fn kernel(&self, name: &str) -> Result<Kernel, Error> {
        check_name("kernel", name)?;
        match self.inner.request(&Request::LookupKernel { name: name.to_string() })? {
            Response::Kernel { id: real, signature } => {
                let id = self.inner.resume.kernel_found(real, name);
                Ok(Kernel {
                    id,
                    signature,
                    // Library kernels have one id per daemon, for every session; an id this
                    // session made up (the daemon's id was taken by a kernel an earlier daemon
                    // gave that number) means something only here.
                    owner: if id == real { GLOBAL_KERNEL } else { self.inner.local_id },
                    _program: None,
                })
            }
            other => Err(unexpected(other)),
        }
    }

    /// Every kernel the daemon offers.
    pub fn kernels(&self) -> Result<Vec<KernelSignature>, Error> {
        match self.inner.request(&Request::ListKernels)? {
            Response::Kernels(list) => Ok(list),
            other => Err(unexpected(other)),
        }
    }

    /// A summary of the daemon's state: counters, devices, and the busiest sessions with
    /// their busiest queues (see [`StatusReport::sessions`]); [`Session::session_status`] has
    /// all of one session's queues.
    pub fn status(&self) -> Result<StatusReport, Error> {
        match self.inner.request(&Request::Status)? {
            Response::Status(report) => Ok(*report),
            other => Err(unexpected(other)),
        }
    }

    /// Waits up to `timeout` until a task can be issued without waiting (the rings have room):
    /// true then, false if they are still full. Issuing waits by itself; this lets a caller
    /// that must stay responsive (Python checking for Ctrl-C) wait in slices.
    pub fn wait_for_room(&self, timeout: Duration) -> Result<bool, Error> {
        self.inner.wait_for_room_until(Instant::now() + timeout)
    }

    /// One live session (this one: [`Session::id`]) with all its queues, fetched page by page.
    pub fn session_status(&self, session: u64) -> Result<SessionStatus, Error> {
        session_pages(|request| self.inner.request(request), session)
    }
}

/// A session's details, all pages of its queues.
fn session_pages(
    mut ask: impl FnMut(&Request) -> Result<Response, Error>,
    session: u64,
) -> Result<SessionStatus, Error> {
    let mut first_queue = 0;
    let mut all: Option<SessionStatus> = None;
    loop {
        let page = match ask(&Request::SessionStatus { session, first_queue })? {
            Response::SessionDetails(page) => *page,
            other => return Err(unexpected(other)),
        };
        match &mut all {
            None => all = Some(page.session),
            Some(all) => all.queues.extend(page.session.queues),
        }
        match page.next_queue {
            Some(next) if next > first_queue => first_queue = next,
            _ => return Ok(all.expect("a page was read")),
        }
    }
}

/// A one-shot observer connection (no session) whose calls have the default deadline
/// (`$AGORA_CONTROL_TIMEOUT`, else 30 s).
struct Observer {
    control: Control,
    timeout: Duration,
}

impl Observer {
    fn connect(socket: Option<PathBuf>) -> Result<Observer, Error> {
        let timeout = control_timeout(None)?;
        let path = client_socket_path(socket);
        let stream = UnixStream::connect(&path).map_err(|cause| Error::Connect { path, cause })?;
        let _ = stream.set_write_timeout(Some(timeout));
        Ok(Observer {
            timeout,
            control: Control {
                stream,
                pending: Vec::new(),
                owed: 0,
                orphans: Vec::new(),
                fds: Vec::new(),
            },
        })
    }

    fn request(&mut self, request: &Request) -> Result<Response, Error> {
        call(&mut self.control, request, self.timeout, None).map_err(|(e, _)| e)
    }
}

/// Asks a daemon for its status summary without opening a session.
pub fn daemon_status(socket: Option<PathBuf>) -> Result<StatusReport, Error> {
    match Observer::connect(socket)?.request(&Request::Status)? {
        Response::Status(report) => Ok(*report),
        other => Err(unexpected(other)),
    }
}

/// The exports this user may see (`agora exports`), without opening a session.
pub fn daemon_exports(socket: Option<PathBuf>) -> Result<Vec<ExportStatus>, Error> {
    match Observer::connect(socket)?.request(&Request::Exports)? {
        Response::Exports(list) => Ok(list),
        other => Err(unexpected(other)),
    }
}

/// Asks a daemon for one session's details, all its queues included, without opening a
/// session.
pub fn daemon_session_status(socket: Option<PathBuf>, session: u64) -> Result<SessionStatus, Error> {
    let mut observer = Observer::connect(socket)?;
    session_pages(|request| observer.request(request), session)
}

/// What [`drain_device`] did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DrainOutcome {
    /// Whether the device is draining now.
    pub draining: bool,
    /// Queues bound to it with tasks in flight; they migrate when those finish.
    pub queues_bound: u64,
    /// Buffers written back and freed on the device (`evacuate`).
    pub evacuated_buffers: u64,
    /// Device bytes they held.
    pub evacuated_bytes: u64,
    /// Queue migrations since the daemon started, as of the drain (the status's `migrations`).
    pub migrations: u64,
}

/// Every current kernel (library and packages) with its package and implementations, and every
/// loaded kernel package, without opening a session (`agora kernels`).
pub fn kernel_catalog(socket: Option<PathBuf>) -> Result<(Vec<KernelListing>, Vec<PackageListing>), Error> {
    match Observer::connect(socket)?.request(&Request::KernelCatalog)? {
        Response::KernelCatalog { kernels, packages } => Ok((kernels, packages)),
        other => Err(unexpected(other)),
    }
}

/// Admin: makes the daemon load its kernel packages again (`agora kernels reload`): new and
/// changed packages are picked up without a restart and without disturbing running tasks; a
/// package that no longer loads keeps its previous version and the report says why. Only root
/// or the daemon's own user may do this.
pub fn reload_kernels(socket: Option<PathBuf>) -> Result<ReloadReport, Error> {
    match Observer::connect(socket)?.request(&Request::ReloadKernels)? {
        Response::KernelsReloaded(report) => Ok(report),
        other => Err(unexpected(other)),
    }
}

/// Admin: marks the device named `device` draining (`drain`) or usable again, without opening
/// a session. A draining device gets no new placements and its queues migrate to other devices.
/// Only root or the daemon's own user may do this. `evacuate` (with `drain`) also writes the
/// device's idle buffers back to host memory and frees them there now.
pub fn drain_device(socket: Option<PathBuf>, device: &str, drain: bool, evacuate: bool) -> Result<DrainOutcome, Error> {
    let request = Request::Drain {
        device: device.to_string(),
        drain,
        evacuate,
    };
    match Observer::connect(socket)?.request(&request)? {
        Response::Drained {
            draining,
            queues_bound,
            evacuated_buffers,
            evacuated_bytes,
            migrations,
            ..
        } => Ok(DrainOutcome {
            draining,
            queues_bound,
            evacuated_buffers,
            evacuated_bytes,
            migrations,
        }),
        other => Err(unexpected(other)),
    }
}

/// Slurm's power saving: `suspend` drains every device of the daemon and writes its idle
/// buffers back to host memory; resume (`suspend: false`) undrains the devices a suspend drained,
/// and only those. Admin only. Returns every device's state after.
pub fn power_save(socket: Option<PathBuf>, suspend: bool) -> Result<Vec<agora_protocol::control::PowerDevice>, Error> {
    match Observer::connect(socket)?.request(&Request::PowerSave { suspend })? {
        Response::PowerSaved(devices) => Ok(devices),
        other => Err(unexpected(other)),
    }
}

/// What the daemon said to a job's registration ([`slurm_job_start`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct JobRegistered {
    /// The job was registered already (its prolog ran again, as on a requeue): its use so far is
    /// kept; its shares and quotas are now the ones just given.
    pub again: bool,
    /// Why the daemon could not record the running job for a restart (naming the file), if it
    /// could not: the job is registered, but a daemon restart would forget it.
    pub not_recorded: Option<String>,
}

/// What the daemon said to a job's end ([`slurm_job_end`]).
#[derive(Clone, Debug, PartialEq)]
pub struct JobEnded {
    /// What the job used on the node.
    pub account: agora_protocol::control::JobAccount,
    /// Why the daemon could not write the job's accounting record (naming the file), if it
    /// could not: `account` is then the job's only record.
    pub not_recorded: Option<String>,
}

/// Slurm's prolog: registers `job` with the daemon (root or the daemon's user only). Registering
/// a running job again with the same uid keeps its use; another uid is refused.
pub fn slurm_job_start(
    socket: Option<PathBuf>,
    job: agora_protocol::control::JobStart,
) -> Result<JobRegistered, Error> {
    match Observer::connect(socket)?.request(&Request::JobStart(job))? {
        Response::JobStarted { again, not_recorded } => Ok(JobRegistered { again, not_recorded }),
        other => Err(unexpected(other)),
    }
}

/// Slurm's epilog: ends `job` on the daemon (its sessions are ended and reclaimed) and returns
/// its accounting, and whether the daemon could record it.
pub fn slurm_job_end(socket: Option<PathBuf>, job: u64) -> Result<JobEnded, Error> {
    match Observer::connect(socket)?.request(&Request::JobEnd { job })? {
        Response::JobEnded { account, not_recorded } => Ok(JobEnded {
            account: *account,
            not_recorded,
        }),
        other => Err(unexpected(other)),
    }
}

pub(crate) fn unexpected(response: Response) -> Error {
    match response {
        Response::Error(e) => Error::Control(e),
        other => Error::Protocol(format!("unexpected reply: {other:?}")),
    }
}

/// How long to wait for the daemon's reply to `request`: the control timeout, but for a program
/// build at least the daemon's own limit on it plus a margin. A compilation may legitimately take
/// most of that limit, and the daemon then answers with the program or a build error; a client
/// that gave up first reported a stuck daemon, and its next requests met the late reply's queue.
fn reply_wait(request: &Request, control_timeout: Duration) -> Duration {
    use agora_protocol::control::{BUILD_REPLY_MARGIN_SECONDS, PROGRAM_BUILD_SECONDS};
    match request {
        Request::BuildProgram { .. } => {
            control_timeout.max(Duration::from_secs(PROGRAM_BUILD_SECONDS + BUILD_REPLY_MARGIN_SECONDS))
        }
        _ => control_timeout,
    }
}

/// The name of a request, for [`Error::Timeout`].
fn request_name(request: &Request) -> &'static str {
    match request {
        Request::Hello { .. } => "hello",
        Request::AllocBuffer { .. } => "buffer allocation",
        Request::CreateQueue { .. } => "queue creation",
        Request::LookupKernel { .. } => "kernel lookup",
        Request::ListKernels => "kernel listing",
        Request::Status => "status",
        Request::SessionStatus { .. } => "session status",
        Request::SaveTrace => "trace save",
        Request::Drain { .. } => "drain",
        Request::KernelCatalog => "kernel catalog",
        Request::ReloadKernels => "kernel reload",
        Request::BuildProgram { .. } => "program build",
        Request::Resume { .. } | Request::ResumeMore { .. } => "session resume",
        Request::Protect { .. } => "protect",
        Request::AllocShared { .. } => "exportable buffer allocation",
        Request::Export { .. } => "export",
        Request::Revoke { .. } => "revoke",
        Request::Attach { .. } => "attach",
        Request::Exports => "exports listing",
        Request::Recover => "recover",
        Request::Checkpoints => "checkpoint listing",
        Request::DeclareDag(_) => "DAG declaration",
        Request::ReleaseDag { .. } => "DAG release",
        Request::DagResults { .. } => "DAG results",
        Request::DropDag { .. } => "DAG withdrawal",
        Request::JobStart(_) => "job start",
        Request::JobEnd { .. } => "job end",
        Request::ClaimHost { .. } => "host copy claim",
        Request::PowerSave { suspend: true } => "suspend",
        Request::PowerSave { suspend: false } => "resume",
    }
}

/// The environment variables that give a process's rank in its parallel job, in the order
/// they are read: the MPI launchers' own first (MPICH, Intel MPI and other PMI-1/2 launchers;
/// PMIx, as Open MPI 5 and `srun --mpi=pmix` set; Open MPI; MVAPICH2), then Slurm's task id.
/// Slurm's comes last because a program that `mpirun` starts inside a Slurm batch script
/// inherits the script's `SLURM_PROCID` (0 for every rank), while the launcher's variable is the
/// rank. The first that holds a decimal number is the rank.
pub const RANK_VARIABLES: [&str; 5] = [
    "PMI_RANK",
    "PMIX_RANK",
    "OMPI_COMM_WORLD_RANK",
    "MV2_COMM_WORLD_RANK",
    "SLURM_PROCID",
];

/// The process's rank in its MPI or Slurm job ([`RANK_VARIABLES`], read through `var`), if it
/// is one.
fn rank(var: impl Fn(&str) -> Option<String>) -> Option<String> {
    RANK_VARIABLES.iter().find_map(|variable| {
        let value = var(variable)?;
        let value = value.trim();
        (!value.is_empty() && value.len() <= 10 && value.bytes().all(|b| b.is_ascii_digit()))
            .then(|| value.trim_start_matches('0').to_string())
            .map(|n| if n.is_empty() { "0".to_string() } else { n })
    })
}

/// The control timeout: the option if given, else `$AGORA_CONTROL_TIMEOUT`, else
/// [`DEFAULT_CONTROL_TIMEOUT`].
fn control_timeout(option: Option<Duration>) -> Result<Duration, Error> {
    match option {
        Some(timeout) => Ok(timeout),
        None => Ok(control_timeout_from(std::env::var(CONTROL_TIMEOUT_ENV).ok())?.unwrap_or(DEFAULT_CONTROL_TIMEOUT)),
    }
}

/// [`CONTROL_TIMEOUT_ENV`]'s value (`None`: not set, or empty). 0 is refused: every call would
/// time out at once.
fn control_timeout_from(value: Option<String>) -> Result<Option<Duration>, Error> {
    seconds_from_env(CONTROL_TIMEOUT_ENV, value, "control timeout", None)
}

/// A timeout in seconds from the environment variable `variable` whose value is `value`
/// (`None`: not set, or empty): fractions allowed, at most a day, 0 only where `zero` says what
/// it means. Anything else is refused naming the variable rather than ignored: a user who set
/// it (for a slow daemon, a long maintenance window) would otherwise get the default without
/// knowing why.
pub(crate) fn seconds_from_env(
    variable: &'static str,
    value: Option<String>,
    what: &str,
    zero: Option<&str>,
) -> Result<Option<Duration>, Error> {
    const LONGEST: Duration = Duration::from_secs(86_400);
    let Some(value) = value else {
        return Ok(None);
    };
    let text = value.trim();
    if text.is_empty() {
        return Ok(None);
    }
    match text.parse::<f64>() {
        Ok(s) if s.is_finite() && (s > 0.0 || (s == 0.0 && zero.is_some())) && s <= LONGEST.as_secs_f64() => {
            Ok(Some(Duration::from_secs_f64(s)))
        }
        _ => Err(Error::Environment {
            variable,
            message: format!(
                "{variable}={value:?} is no {what}: give a {}number of seconds (at most {}, a day{}), or unset \
             it for 30 s",
                if zero.is_some() { "" } else { "positive " },
                LONGEST.as_secs(),
                zero.map(|z| format!("; 0 {z}")).unwrap_or_default(),
            ),
        }),
    }
}

/// Environment variable with the heap a session asks for when its options name none: bytes, or
/// with a `K`, `M` or `G` suffix (powers of 1024), e.g. `256M`. A daemon counts each session's
/// whole heap against its user's limit whether or not it is used, so the ranks of an MPI-style
/// job that each need little can all get in without a change to the program:
/// `export AGORA_HEAP_BYTES=256M`.
pub const HEAP_ENV: &str = "AGORA_HEAP_BYTES";

/// [`HEAP_ENV`]'s value as bytes (`None`: not set, or empty); a value that is no size is
/// refused, naming the variable.
fn heap_bytes_from(value: Option<String>) -> Result<Option<u64>, Error> {
    let Some(value) = value else {
        return Ok(None);
    };
    let text = value.trim();
    if text.is_empty() {
        return Ok(None);
    }
    let (digits, unit) = match text.char_indices().last() {
        Some((at, c)) if c.is_ascii_alphabetic() => (&text[..at], c.to_ascii_uppercase()),
        _ => (text, 'B'),
    };
    let shift = match unit {
        'B' => 0,
        'K' => 10,
        'M' => 20,
        'G' => 30,
        _ => u32::MAX,
    };
    let bytes = digits
        .trim()
        .parse::<u64>()
        .ok()
        .filter(|_| shift != u32::MAX)
        .and_then(|n| n.checked_mul(1u64.checked_shl(shift)?))
        .filter(|&n| n > 0);
    match bytes {
        Some(bytes) => Ok(Some(bytes)),
        None => Err(Error::Environment {
            variable: HEAP_ENV,
            message: format!(
                "{HEAP_ENV}={value:?} is no heap size: give bytes, or a number with K, M or G (e.g. 256M), or unset it"
            ),
        }),
    }
}

/// The session name a program called `program` gets by default: `program` made into a name
/// the daemon accepts, with `.rank<N>` when the process is a rank of an MPI or Slurm job
/// ([`RANK_VARIABLES`]), so that each rank writes checkpoints of its own. For bindings that
/// name their programs themselves (Python's `python:<script>`).
#[doc(hidden)]
pub fn default_session_name(program: &str) -> String {
    default_name(
        program.to_string(),
        rank(|variable| std::env::var(variable).ok()).as_deref(),
    )
}

/// A program's name as a client name the daemon accepts: each character it refuses in names
/// ([`agora_protocol::control::is_unshowable`]) made `_`, cut at a character boundary so that
/// with `.rank<N>` appended for a `rank` it has at most [`MAX_NAME`] bytes.
fn default_name(name: String, rank: Option<&str>) -> String {
    let suffix = rank.map(|rank| format!(".rank{rank}")).unwrap_or_default();
    let mut name: String = name
        .chars()
        .map(|c| {
            if agora_protocol::control::is_unshowable(c) {
                '_'
            } else {
                c
            }
        })
        .collect();
    let room = MAX_NAME.saturating_sub(suffix.len());
    if name.len() > room {
        let mut end = room;
        while !name.is_char_boundary(end) {
            end -= 1;
        }
        name.truncate(end);
    }
    name + &suffix
}

/// The error a daemon wrote on a connection it then closed (it refuses connections beyond a
/// limit that way), if one is waiting to be read.
fn refusal_waiting(stream: &UnixStream) -> Option<ControlError> {
    let mut pending = Vec::new();
    match recv_before::<Response>(stream, &mut pending, Instant::now() + Duration::from_millis(100)) {
        Ok(Response::Error(e)) => Some(e),
        _ => None,
    }
}

/// Sends `request` and reads its reply, within `timeout`. On failure, also says whether the
/// connection is lost for good (`true`: later calls cannot work). `sent`: the session
/// segment's `SegmentHeader::control_sent`, bumped once the request is written, so a dispatcher
/// spinning on the rings reads the socket at once (`None` for observers, which have no segment,
/// and for the calls of a resume).
fn call(
    control: &mut Control,
    request: &Request,
    timeout: Duration,
    sent: Option<&agora_protocol::sync::AtomicU32>,
) -> Result<Response, (Error, bool)> {
    let deadline = Instant::now() + timeout;
    let timed_out = || Error::Timeout {
        request: request_name(request).to_string(),
        after: timeout,
    };
    let lost = |e: TransportError| {
        let e = Error::from(e);
        let gone = matches!(e, Error::Disconnected);
        (e, gone)
    };
    // Late replies to calls that timed out come first (the daemon answers in order).
    while control.owed > 0 {
        match recv_before::<Response>(&control.stream, &mut control.pending, deadline) {
            Ok(late) => {
                control.owed -= 1;
                match late {
                    Response::Buffer { handle, .. } => control.orphans.push(Orphan::Buffer(handle)),
                    Response::Queue { handle } => control.orphans.push(Orphan::Queue(handle)),
                    _ => {}
                }
            }
            Err(TransportError::TimedOut) => return Err((timed_out(), false)),
            Err(e) => return Err(lost(e)),
        }
    }
    if let Err(e) = send(&control.stream, request) {
        return Err(match e {
            // Part of the request may have gone: the stream is out of step for good.
            TransportError::Os { cause, .. }
                if matches!(
                    cause.kind(),
                    std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                ) =>
            {
                let _ = control.stream.shutdown(std::net::Shutdown::Both);
                (timed_out(), true)
            }
            other => match refusal_waiting(&control.stream) {
                // The daemon refused the connection (a limit) and said why before closing it.
                Some(refusal) => (Error::Control(refusal), true),
                None => lost(other),
            },
        });
    }
    if let Some(sent) = sent {
        // After the write: a dispatcher that sees the count change finds the bytes there.
        sent.fetch_add(1, Ordering::Release);
    }
    control.fds.clear();
    match recv_before_with_fds::<Response>(&control.stream, &mut control.pending, &mut control.fds, deadline) {
        Ok(response) => Ok(response),
        Err(TransportError::TimedOut) => {
            control.owed += 1;
            Err((timed_out(), false))
        }
        Err(e) => Err(lost(e)),
    }
}

impl Inner {
    /// Whether this process is a child forked after the session was opened (then nothing of
    /// the session may be touched: see [`Error::ForkedChild`]). One load.
    #[inline]
    pub(crate) fn in_forked_child(&self) -> bool {
        FORK_GENERATION.load(Ordering::Relaxed) != self.fork_generation
    }

    /// [`Error::ForkedChild`] in a process forked after the session was opened.
    #[inline]
    pub(crate) fn check_process(&self) -> Result<(), Error> {
        if self.in_forked_child() {
            return Err(Error::ForkedChild {
                owner_pid: self.owner_pid,
            });
        }
        if self.ended.load(Ordering::Acquire) {
            return Err(Error::Ended);
        }
        Ok(())
    }

    /// Ends the session with the daemon now ([`Session::end`]): hangs up its connection, so the
    /// daemon reclaims the session as for a client that exited, and never resumes it. The
    /// segment stays mapped here until the last handle goes (views of buffers stay readable);
    /// the daemon no longer reads its rings, so releases from `Drop`s are not issued.
    pub(crate) fn end(&self) {
        if self.in_forked_child() || self.ended.swap(true, Ordering::AcqRel) {
            return;
        }
        self.resume.given_up.store(true, Ordering::Release);
        self.disconnected.store(true, Ordering::Release);
        // The second handle on the connection: another thread's control call may hold the
        // first for its whole timeout. Shutting one shuts the socket for both.
        let _ = self
            .liveness
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .shutdown(std::net::Shutdown::Both);
        // Wakes this process's threads that wait for completions: they see the session ended.
        futex_wake_all(&self.segment.view().header().completion_tail);
    }

    /// One control call, within the session's control timeout (waiting for another thread's
    /// call included).
    pub(crate) fn request(&self, request: &Request) -> Result<Response, Error> {
        self.check_process()?;
        self.recover_if_gone()?;
        let epoch = self.resume.epoch.load(Ordering::Acquire);
        match self.request_once(request) {
            // The daemon went away during the call: once the session resumed on a new daemon,
            // ask that one (the old daemon's answer, if any, died with it).
            Err(Error::Disconnected) if !self.resume.given_up.load(Ordering::Acquire) => {
                self.recover(epoch)?;
                self.request_once(request)
            }
            other => other,
        }
    }

    /// [`Inner::request`] for a reply that carries a memory descriptor (an exportable or
    /// attached buffer's region): the reply and the descriptor, if one came.
    pub(crate) fn request_with_memory(
        &self,
        request: &Request,
    ) -> Result<(Response, Option<std::os::fd::OwnedFd>), Error> {
        self.check_process()?;
        self.recover_if_gone()?;
        let epoch = self.resume.epoch.load(Ordering::Acquire);
        match self.request_once_with_fd(request) {
            Err(Error::Disconnected) if !self.resume.given_up.load(Ordering::Acquire) => {
                self.recover(epoch)?;
                self.request_once_with_fd(request)
            }
            other => other,
        }
    }

    fn request_once(&self, request: &Request) -> Result<Response, Error> {
        self.request_once_with_fd(request).map(|(response, _)| response)
    }

    fn request_once_with_fd(&self, request: &Request) -> Result<(Response, Option<std::os::fd::OwnedFd>), Error> {
        let limit = reply_wait(request, self.control_timeout);
        // Time this process did not run (a paused VM) does not count against the daemon.
        let mut deadline = agora_wait::Deadline::after(limit);
        let mut control = loop {
            match self.control.try_lock() {
                Ok(guard) => break guard,
                Err(std::sync::TryLockError::Poisoned(e)) => break e.into_inner(),
                Err(std::sync::TryLockError::WouldBlock) => {
                    let Some(wait) = deadline.next_wait() else {
                        return Err(Error::Timeout {
                            request: request_name(request).to_string(),
                            after: limit,
                        });
                    };
                    let wait = wait.min(Duration::from_micros(200));
                    let began = Instant::now();
                    std::thread::sleep(wait);
                    deadline.waited(began, wait);
                }
            }
        };
        let left = deadline.left();
        let sent = &self.segment.view().header().control_sent;
        let response = call(&mut control, request, left, Some(sent)).map_err(|(e, gone)| {
            if gone {
                self.disconnected.store(true, Ordering::Relaxed);
            }
            match e {
                // Report the whole limit, not what was left of it after waiting for the lock.
                Error::Timeout { request, .. } => Error::Timeout { request, after: limit },
                other => other,
            }
        });
        let orphans = std::mem::take(&mut control.orphans);
        let fd = control.fds.pop();
        drop(control);
        self.release_orphans(&orphans);
        Ok((response?, fd))
    }

    /// Releases what late replies created (through the ring, like a dropped `Buffer` or
    /// `Queue`).
    fn release_orphans(&self, orphans: &[Orphan]) {
        for orphan in orphans {
            let mut d = TaskDescriptor::zeroed();
            let queue = match *orphan {
                Orphan::Buffer(handle) => {
                    d.op = Op::ReleaseBuffer as u32;
                    d.arg_count = 1;
                    d.args[0] = RawArg::buffer(handle);
                    0
                }
                Orphan::Queue(handle) => {
                    d.op = Op::ReleaseQueue as u32;
                    handle
                }
            };
            let _ = self.submit(queue, d, false);
        }
    }

    pub(crate) fn segment(&self) -> &Segment {
        &self.segment
    }

    /// A heap buffer of `len` bytes was released as task `release`.
    pub(crate) fn buffer_freeing(&self, release: u64, len: u64) {
        let mut frees = self.frees.lock().unwrap_or_else(|e| e.into_inner());
        // Every task `capacity` ids before this one finished (its slot had to be free), so
        // those releases settled long ago: this keeps the list short.
        while frees.front().is_some_and(|f| f.release + self.capacity <= release) {
            frees.pop_front();
        }
        frees.push_back(PendingFree {
            release,
            len,
            settled: None,
        });
    }

    /// What this session's recent heap releases may still free: (bytes, how many are not
    /// settled yet, i.e. a task issued before them has not finished). Forgets the releases
    /// settled for a while.
    fn frees_in_flight(&self) -> (u64, usize) {
        if self.frees.lock().unwrap_or_else(|e| e.into_inner()).is_empty() {
            return (0, 0);
        }
        if self.pending_in_ring() {
            self.drain();
        }
        let mut frees = self.frees.lock().unwrap_or_else(|e| e.into_inner());
        // The oldest task not finished: a release before it has settled. Outstanding tasks are
        // among the last `capacity` ids (a slot is reused only after its task finished).
        let next_id = self.producer.lock().unwrap_or_else(|e| e.into_inner()).next_id;
        let oldest_running = (next_id.saturating_sub(self.capacity).max(1)..next_id)
            .find(|&id| !self.is_done(id))
            .unwrap_or(next_id);
        let now = Instant::now();
        frees.retain_mut(|f| {
            if f.release < oldest_running {
                let settled = *f.settled.get_or_insert(now);
                now.duration_since(settled) < FREE_SETTLES_WITHIN
            } else {
                true
            }
        });
        // Rounded up to pages: a range may be a little longer than its buffer, and erring
        // high only costs a short wait before an allocation that cannot succeed fails.
        let bytes = frees.iter().map(|f| f.len.div_ceil(4096) * 4096).sum();
        let unsettled = frees.iter().filter(|f| f.settled.is_none()).count();
        (bytes, unsettled)
    }

    /// Allocates a heap buffer (`Request::AllocBuffer`). A release (a dropped [`Buffer`]) goes
    /// through the task ring, ordered after the tasks that may use the buffer, while an
    /// allocation is a control request the daemon may answer before it has read the ring: so
    /// when the heap has no room but this session's releases in flight would make it, this
    /// waits for them (they free their range once the daemon took them and every task issued
    /// before them finished) and asks again, within the control timeout; the daemon's last
    /// answer is returned, a refusal with its true numbers included. (Done here rather than
    /// by the daemon reading the ring before it refuses: only this side knows which releases are
    /// in flight, and the daemon must not hold its control loop while tasks finish.)
    pub(crate) fn alloc_buffer(&self, len: u64) -> Result<Response, Error> {
        let request = Request::AllocBuffer { len };
        let mut deadline: Option<agora_wait::Deadline> = None;
        let mut settled_attempts = 0;
        let mut pause = Duration::from_millis(1);
        loop {
            let response = self.request(&request)?;
            let Response::Error(ControlError::QuotaExceeded {
                requested, available, ..
            }) = &response
            else {
                return Ok(response);
            };
            let (freeing, unsettled) = self.frees_in_flight();
            if freeing == 0 || available.saturating_add(freeing) < *requested {
                return Ok(response);
            }
            let deadline = deadline.get_or_insert_with(|| agora_wait::Deadline::after(self.control_timeout));
            if unsettled > 0 {
                // Asks again once one more release settled (not at every completion: the
                // daemon limits a connection's request rate).
                loop {
                    let Some(wait) = deadline.next_wait() else {
                        return Ok(response);
                    };
                    let seen = self.consumed.load(Ordering::Acquire);
                    let began = Instant::now();
                    self.wait_for_completions_until(seen, began + wait)?;
                    deadline.waited(began, wait);
                    if self.frees_in_flight().1 < unsettled {
                        break;
                    }
                }
                continue;
            }
            if settled_attempts == SETTLED_ATTEMPTS {
                return Ok(response);
            }
            settled_attempts += 1;
            let Some(wait) = deadline.next_wait() else {
                return Ok(response);
            };
            let wait = wait.min(pause);
            let began = Instant::now();
            std::thread::sleep(wait);
            deadline.waited(began, wait);
            pause *= 2;
        }
    }

    fn lock_completions(&self) -> MutexGuard<'_, Completions> {
        self.completions.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Issues `descriptor` on `queue`; returns its task id. `tracked`: a [`crate::Task`] handle
    /// and the queue's `finish` report its outcome (false for releases, which nobody waits
    /// for). Waits while too many tasks are outstanding.
    pub(crate) fn submit(&self, queue: u64, descriptor: TaskDescriptor, tracked: bool) -> Result<u64, Error> {
        self.stage(queue, descriptor, tracked, true)
    }

    /// Issues a release from a `Drop` (untracked); its task id, or `None` when it could not be
    /// issued. Unlike [`Inner::submit`] it never waits for a daemon to come back: a drop after
    /// the daemon stopped would otherwise hang for the reconnect timeout (each buffer a
    /// program drops at exit). With the daemon gone the release is staged in the ring if there
    /// is room, and a later resume issues it again after the tasks before it
    /// ([`Inner::untaken_tasks`]); with no room it is not issued at all (`None`: the client
    /// forgets the object, and a new daemon never learns of it).
    pub(crate) fn submit_release(&self, queue: u64, descriptor: TaskDescriptor) -> Option<u64> {
        self.stage(queue, descriptor, false, false).ok()
    }

    /// [`Inner::submit`]'s work; `may_resume`: whether to resume a session whose daemon is
    /// gone (and wait for room while it is), or give up at once.
    fn stage(&self, queue: u64, mut descriptor: TaskDescriptor, tracked: bool, may_resume: bool) -> Result<u64, Error> {
        self.check_process()?;
        loop {
            if may_resume {
                self.recover_if_gone()?;
            } else if self.resume.given_up.load(Ordering::Acquire) && self.daemon_gone() {
                // Gone for good (or reconnection is off): no daemon will read the ring again.
                return Err(Error::Disconnected);
            }
            let mut producer = if may_resume {
                self.producer.lock().unwrap_or_else(|e| e.into_inner())
            } else {
                match self.producer_unless_resuming() {
                    Some(producer) => producer,
                    None => return Err(Error::Disconnected),
                }
            };
            let issued = self.issued.load(Ordering::Relaxed);
            let id = producer.next_id;
            // Room in the rings, and this id's slot is free: completions of different queues
            // arrive out of order, so the task `capacity` ids earlier may still be running.
            let slot_free = id <= self.capacity || self.is_done(id - self.capacity);
            if issued - self.consumed.load(Ordering::Acquire) < self.capacity && slot_free {
                descriptor.task_id = id;
                descriptor.queue = queue;
                if producer.ring.stage(&descriptor) {
                    producer.next_id += 1;
                    let slot = (id % self.capacity) as usize;
                    self.slot_queue[slot].store(if tracked { queue } else { UNTRACKED }, Ordering::Relaxed);
                    // Published by the ring's release below, before the completion can arrive.
                    self.handles[slot].store(if tracked { id } else { 0 }, Ordering::Relaxed);
                    producer.ring.publish();
                    self.issued.store(issued + 1, Ordering::Release);
                    drop(producer);
                    self.ring_doorbell_if_asleep();
                    return Ok(id);
                }
            }
            drop(producer);
            if !may_resume && self.daemon_gone() {
                return Err(Error::Disconnected);
            }
            self.wait_for_progress(may_resume)?;
        }
    }

    /// The producer, unless a resume holds it (the daemon is gone meanwhile): a release from a
    /// `Drop` must not wait out a reconnection. It did, and deadlocked the Python client: the
    /// resuming thread checks for Ctrl-C under the GIL while it holds the producer, and the
    /// thread that dropped a buffer held the GIL while it waited for the producer.
    fn producer_unless_resuming(&self) -> Option<std::sync::MutexGuard<'_, Producer>> {
        loop {
            match self.producer.try_lock() {
                Ok(producer) => return Some(producer),
                Err(std::sync::TryLockError::Poisoned(e)) => return Some(e.into_inner()),
                // Held: briefly by another thread issuing a task, or for as long as a resume
                // takes, which marks the daemon gone before it takes the lock.
                Err(std::sync::TryLockError::WouldBlock) if self.daemon_gone() => return None,
                Err(std::sync::TryLockError::WouldBlock) => std::thread::yield_now(),
            }
        }
    }

    fn ring_doorbell_if_asleep(&self) {
        // Pairs with the daemon's fence between announcing sleep and its last look at the ring.
        fence(Ordering::SeqCst);
        let asleep = self.segment.view().header().daemon_sleeping.load(Ordering::Relaxed) != 0;
        if asleep {
            self.doorbell.read().unwrap_or_else(|e| e.into_inner()).ring();
        }
        WOKE_DISPATCHER.with(|woke| woke.set(asleep));
    }

    /// Consumes every available completion. Returns how many.
    fn drain(&self) -> usize {
        let mut c = self.lock_completions();
        let n = self.drain_locked(&mut c);
        drop(c);
        if n > 0 {
            self.consumed_more(n as u64);
        }
        n
    }

    /// [`Inner::drain`]'s work with the completions locked (the caller adds to `consumed`).
    fn drain_locked(&self, c: &mut Completions) -> usize {
        let mut n = 0usize;
        while let Some(completion) = c.ring.take() {
            self.complete(c, completion.task_id, completion.result());
            n += 1;
        }
        if n > 0 {
            c.ring.release();
        }
        n
    }

    /// Records task `id`'s outcome.
    fn complete(&self, c: &mut Completions, id: u64, result: Result<(), TaskError>) {
        let slot = (id % self.capacity) as usize;
        if let Err(e) = result {
            let queue = self.slot_queue[slot].load(Ordering::Relaxed);
            if queue != UNTRACKED {
                let failures = c.queue_failures.entry(queue).or_default();
                if failures.count == 0 {
                    self.failing_queues.fetch_add(1, Ordering::Relaxed);
                }
                failures.push(id, e);
                // Kept for the task's own `wait` only while its handle lives.
                let stored = id | ERROR_STORED;
                if self.handles[slot]
                    .compare_exchange(id, stored, Ordering::AcqRel, Ordering::Relaxed)
                    .is_ok()
                {
                    c.task_errors.insert(id, e);
                }
            }
        }
        self.done[slot].fetch_max(id, Ordering::Release);
    }

    /// `n` more tasks are complete: wakes the threads that may wait for them.
    fn consumed_more(&self, n: u64) {
        self.consumed.fetch_add(n, Ordering::Release);
        // Another thread may be blocked waiting for one of the tasks just consumed.
        let header = self.segment.view().header();
        if header.client_waiters.load(Ordering::SeqCst) > 0 {
            futex_wake_all(&header.completion_tail);
        }
    }

    pub(crate) fn is_done(&self, id: u64) -> bool {
        self.done[(id % self.capacity) as usize].load(Ordering::Acquire) >= id
    }

    fn pending_in_ring(&self) -> bool {
        let header = self.segment.view().header();
        header.completion_tail.load(Ordering::Acquire) != header.completion_head.load(Ordering::Relaxed)
    }

    /// Consumes what has arrived and says whether task `id` is complete, never blocking nor
    /// reconnecting (unlike [`Inner::poll`], which may resume a session on a restarted daemon).
    pub(crate) fn done_now(&self, id: u64) -> bool {
        if self.pending_in_ring() {
            self.drain();
        }
        self.is_done(id)
    }

    /// Non-blocking: consumes what has arrived and says whether task `id` is complete.
    pub(crate) fn poll(&self, id: u64) -> Result<bool, Error> {
        self.check_process()?;
        if self.pending_in_ring() {
            self.drain();
        }
        if self.is_done(id) {
            return Ok(true);
        }
        if self.disconnected.load(Ordering::Relaxed) {
            self.recover_if_gone()?;
            return Ok(self.is_done(id));
        }
        Ok(false)
    }

    /// Blocks until task `id` is complete; returns its error if it failed (every time).
    pub(crate) fn wait(&self, id: u64) -> Result<(), Error> {
        self.wait_done(id)?;
        match self.task_error(id) {
            Some(e) => Err(Error::Task(e)),
            None => Ok(()),
        }
    }

    /// Blocks until task `id` is complete, leaving any error of it for later.
    pub(crate) fn wait_done(&self, id: u64) -> Result<(), Error> {
        self.check_process()?;
        while !self.is_done(id) {
            if self.pending_in_ring() {
                self.drain();
                continue;
            }
            if SPIN.with(|s| {
                s.borrow_mut()
                    .spin_with(|| self.pending_in_ring() || self.is_done(id), self.yielding())
            }) {
                continue;
            }
            self.block(id, || self.is_done(id), &SPIN)?;
        }
        Ok(())
    }

    /// Like [`Inner::wait_done`], but gives up at `deadline`: true once task `id` is complete,
    /// false if it is still running then. Overshoots the deadline by at most one sleep on the
    /// completion futex ([`LIVENESS_CHECK`]).
    pub(crate) fn wait_done_until(&self, id: u64, deadline: Instant) -> Result<bool, Error> {
        self.check_process()?;
        loop {
            if self.is_done(id) {
                return Ok(true);
            }
            if self.pending_in_ring() {
                self.drain();
                continue;
            }
            if Instant::now() >= deadline {
                return Ok(false);
            }
            if SPIN.with(|s| {
                s.borrow_mut()
                    .spin_with(|| self.pending_in_ring() || self.is_done(id), self.yielding())
            }) {
                continue;
            }
            self.block(id, || self.is_done(id), &SPIN)?;
        }
    }

    /// Completions taken from the ring so far (see [`crate::Task::completions_seen`]).
    pub(crate) fn completions_seen(&self) -> u64 {
        self.consumed.load(Ordering::Acquire)
    }

    /// Waits until completions taken pass `seen`, or `deadline`; returns which. Blocks on the
    /// completion futex without spinning: its caller is a background thread that waits for
    /// many tasks at once, where a spin would cost a core and gain nothing.
    pub(crate) fn wait_for_completions_until(&self, seen: u64, deadline: Instant) -> Result<bool, Error> {
        self.check_process()?;
        loop {
            if self.consumed.load(Ordering::Acquire) != seen {
                return Ok(true);
            }
            if self.pending_in_ring() {
                self.drain();
                continue;
            }
            if Instant::now() >= deadline {
                return Ok(false);
            }
            self.block(0, || self.consumed.load(Ordering::Acquire) != seen, &ROOM_SPIN)?;
        }
    }

    /// Whether a task issued now would not wait (see [`Inner::submit`]).
    fn has_room(&self) -> bool {
        let producer = self.producer.lock().unwrap_or_else(|e| e.into_inner());
        let id = producer.next_id;
        let slot_free = id <= self.capacity || self.is_done(id - self.capacity);
        // The ring's own test too, as `submit`'s `stage` makes it.
        let ring_free = producer.ring.free_slots() > 0;
        drop(producer);
        self.issued.load(Ordering::Relaxed) - self.consumed.load(Ordering::Acquire) < self.capacity
            && slot_free
            && ring_free
    }

    /// How this thread's waits may yield the core (see `latency_tenant`).
    fn yielding(&self) -> agora_wait::Yielding {
        if self.latency_tenant.load(Ordering::Relaxed) {
            // Except when this thread just woke the dispatcher: on a machine whose other cores
            // run batch lanes, a spin that never yields keeps the dispatcher off the one core
            // it could wake on for the whole spin budget (measured, `agora bench stall
            // --batch-priority batch`: a latency neighbour's p99 of 212 µs under attack with
            // Never, 20 µs yielding every 10 µs; a yield to a stranger that keeps the core
            // stops the yields of the spin).
            if WOKE_DISPATCHER.with(std::cell::Cell::get) {
                return agora_wait::Yielding::Rarely;
            }
            agora_wait::Yielding::Never
        } else {
            agora_wait::Yielding::Cooperative
        }
    }

    /// Waits until [`Inner::has_room`] or `deadline`; returns which.
    fn wait_for_room_until(&self, deadline: Instant) -> Result<bool, Error> {
        self.check_process()?;
        loop {
            self.recover_if_gone()?;
            if self.has_room() {
                return Ok(true);
            }
            if self.pending_in_ring() {
                self.drain();
                continue;
            }
            if Instant::now() >= deadline {
                return Ok(false);
            }
            if ROOM_SPIN.with(|s| s.borrow_mut().spin(|| self.pending_in_ring())) {
                continue;
            }
            let before = self.consumed.load(Ordering::Acquire);
            self.block(0, || self.consumed.load(Ordering::Acquire) != before, &ROOM_SPIN)?;
        }
    }

    /// Waits until at least one completion arrives (to make room in the rings), or the
    /// thread's interrupt check ([`with_room_interrupt`]) says to give up. `may_resume`: false
    /// for a release from a `Drop`, which gives up (`Disconnected`) once the daemon is gone
    /// rather than resume the session.
    fn wait_for_progress(&self, may_resume: bool) -> Result<(), Error> {
        let before = self.consumed.load(Ordering::Acquire);
        let interrupted = ROOM_INTERRUPT.with(std::cell::Cell::get);
        let mut checked = Instant::now();
        loop {
            if self.drain() > 0 || self.consumed.load(Ordering::Acquire) != before {
                return Ok(());
            }
            if let Some(interrupted) = interrupted {
                if checked.elapsed() >= ROOM_INTERRUPT_EVERY {
                    if interrupted() {
                        return Err(Error::Interrupted);
                    }
                    checked = Instant::now();
                }
            }
            if ROOM_SPIN.with(|s| s.borrow_mut().spin(|| self.pending_in_ring())) {
                continue;
            }
            if may_resume {
                self.block(0, || self.consumed.load(Ordering::Acquire) != before, &ROOM_SPIN)?;
            } else {
                // A release from a `Drop`: a daemon that died with the rings full is not waited
                // for (`Inner::submit_release`).
                self.sleep_for_completion(0, || self.consumed.load(Ordering::Acquire) != before, &ROOM_SPIN);
                if self.daemon_gone() && !self.pending_in_ring() {
                    return Err(Error::Disconnected);
                }
            }
        }
    }

    /// Sleeps on the completion futex once, unless `satisfied()` or completions are pending.
    /// `target`: the task id this thread needs (0: any completion).
    /// `spin`: the spinner that gave up before (told how long the block took).
    fn block(
        &self,
        target: u64,
        satisfied: impl Fn() -> bool,
        spin: &'static std::thread::LocalKey<RefCell<AdaptiveSpin>>,
    ) -> Result<(), Error> {
        self.sleep_for_completion(target, satisfied, spin);
        if self.disconnected.load(Ordering::Relaxed) && !self.pending_in_ring() {
            // Resumed on a new daemon: the tasks the old one left are complete (failed with
            // DaemonRestarted), so the caller's condition is worth checking again.
            self.recover_if_gone()?;
        }
        Ok(())
    }

    /// [`Inner::block`]'s sleep, without resuming a session whose daemon it finds gone (it
    /// marks it `disconnected`).
    fn sleep_for_completion(
        &self,
        target: u64,
        satisfied: impl Fn() -> bool,
        spin: &'static std::thread::LocalKey<RefCell<AdaptiveSpin>>,
    ) {
        let header = self.segment.view().header();
        header.client_waiters.fetch_add(1, Ordering::SeqCst);
        header.client_wait_for.fetch_min(target, Ordering::SeqCst);
        // Pairs with the daemon's fence between posting and reading `client_waiters`
        // (`SessionShared::post_releasing`): one of us sees the other's write. The SeqCst
        // accesses alone may already pair with that fence; the fence makes it plain, and lets
        // the loom model (crates/protocol/tests/loom.rs) check exactly this code. It costs
        // nothing next to the futex call that follows.
        std::sync::atomic::fence(Ordering::SeqCst);
        let tail = header.completion_tail.load(Ordering::SeqCst);
        let mut timed_out = false;
        if tail == header.completion_head.load(Ordering::Relaxed) && !satisfied() {
            let start = Instant::now();
            futex_wait(&header.completion_tail, tail, LIVENESS_CHECK);
            let waited = start.elapsed();
            timed_out = waited >= LIVENESS_CHECK;
            spin.with(|s| s.borrow_mut().blocked_for(waited));
        }
        if header.client_waiters.fetch_sub(1, Ordering::SeqCst) == 1 {
            // Last waiter out. A waiter arriving right now may lose its target to this reset and
            // then sleep until its liveness timeout (20 ms) at worst; it cannot hang.
            header.client_wait_for.store(u64::MAX, Ordering::SeqCst);
        }
        if header.daemon_closed.load(Ordering::Acquire) != 0
            || (timed_out && peer_hung_up(&self.liveness.lock().unwrap_or_else(|e| e.into_inner())))
        {
            self.disconnected.store(true, Ordering::Relaxed);
        }
    }

    /// Whether the daemon is known to be gone (a call found the socket closed) or said it
    /// shut down or ended this session: a call now would first try to resume the session.
    pub(crate) fn daemon_gone(&self) -> bool {
        self.disconnected.load(Ordering::Acquire)
            || self.segment.view().header().daemon_closed.load(Ordering::Acquire) != 0
    }

    /// `Ok` while the daemon is there (or the session resumed on a new one); `Disconnected`
    /// when it is gone for good.
    fn recover_if_gone(&self) -> Result<(), Error> {
        let epoch = self.resume.epoch.load(Ordering::Acquire);
        if !self.disconnected.load(Ordering::Acquire) {
            // A daemon that shut down (or ended this session) says so in the segment: resume
            // before issuing into a ring nobody reads (one load of a line it rarely writes).
            if self.segment.view().header().daemon_closed.load(Ordering::Acquire) == 0 {
                return Ok(());
            }
            self.disconnected.store(true, Ordering::Release);
        }
        self.recover(epoch)
    }

    /// Resumes the session on a new daemon (see [`crate::resume`]), unless another thread did
    /// since `seen_epoch`. `Disconnected` when reconnection is off, or no daemon took the
    /// session back within the reconnect timeout; a daemon's refusal (another version, a
    /// limit) as its error, once (later calls say `Disconnected`).
    fn recover(&self, seen_epoch: u64) -> Result<(), Error> {
        if self.ended.load(Ordering::Acquire) {
            return Err(Error::Ended);
        }
        let _recovering = self.resume.recovering.lock().unwrap_or_else(|e| e.into_inner());
        if self.resume.epoch.load(Ordering::Acquire) != seen_epoch {
            return Ok(());
        }
        let header = self.segment.view().header();
        if header.daemon_closed.load(Ordering::Acquire) == agora_protocol::segment::SESSION_ENDED {
            // The daemon runs on and ended this session itself: it is not to be resumed, and
            // every call says so (the first to notice may have been one whose error nobody
            // reads, such as a release in a `Drop`).
            self.resume.given_up.store(true, Ordering::Release);
            return Err(Error::SessionEnded);
        }
        if self.resume.given_up.load(Ordering::Acquire) {
            return Err(Error::Disconnected);
        }
        let give_up = |e: Error| {
            self.resume.given_up.store(true, Ordering::Release);
            self.disconnected.store(true, Ordering::Release);
            Err(e)
        };
        // Marked gone before the producer is taken, so that a release from a `Drop` does not
        // wait for the resume (`producer_unless_resuming`); cleared once it succeeded.
        self.disconnected.store(true, Ordering::Release);
        // Nothing else is issued, consumed or asked while the session moves.
        let mut control = self.control.lock().unwrap_or_else(|e| e.into_inner());
        let mut producer = self.producer.lock().unwrap_or_else(|e| e.into_inner());
        let geometry = *self.segment.view().geometry();
        let deadline = Instant::now() + self.resume.timeout;
        let mut attempt = 0;
        // Decided once, at the first look at what the old daemon left (a new daemon that takes
        // the rings over and then refuses the resume moves the head).
        let mut replay: Option<Option<Replay>> = None;
        let (stream, resumed, kernel_ids) = loop {
            let stream = match UnixStream::connect(&self.resume.socket) {
                Ok(stream) => stream,
                Err(_) if Instant::now() < deadline => {
                    // Only before any daemon was reached: from then on the replay decision
                    // stands, and it must not be taken again after a new daemon moved the head.
                    if replay.is_none()
                        && ROOM_INTERRUPT
                            .with(std::cell::Cell::get)
                            .is_some_and(|interrupted| interrupted())
                    {
                        return Err(Error::Interrupted);
                    }
                    backoff(attempt, deadline);
                    attempt += 1;
                    continue;
                }
                Err(_) => return give_up(Error::Disconnected),
            };
            // The completions stay locked from the last look at what the old daemon posted
            // until the head has moved past the tasks it lost: the new daemon continues the
            // completion ring at the submission tail, and the slots between were never written.
            let mut completions = self.lock_completions();
            let taken = self.drain_locked(&mut completions);
            let replay = replay.get_or_insert_with(|| self.untaken_tasks(&producer));
            // Made after that last look: a buffer whose sync_from the old daemon completed is
            // not lost.
            let (messages, kernel_ids) = self.resume.messages(
                self.id.load(Ordering::Relaxed),
                geometry.submission_capacity,
                geometry.completion_capacity,
                geometry.heap_len,
                replay.is_some(),
                |id| self.is_done(id),
            );
            let outcome = self.try_resume(&stream, &messages);
            if outcome.is_ok() {
                let replayed_from = replay.as_ref().map_or(producer.next_id, |r| r.first);
                self.complete_lost_tasks(&mut completions, producer.next_id, replayed_from);
            }
            drop(completions);
            if taken > 0 {
                self.consumed_more(taken as u64);
            }
            match outcome {
                Ok(resumed) => break (stream, resumed, kernel_ids),
                Err((e, retry)) => {
                    if !retry || Instant::now() >= deadline {
                        return give_up(e);
                    }
                    backoff(attempt, deadline);
                    attempt += 1;
                }
            }
        };
        let _ = stream.set_read_timeout(None);
        let _ = stream.set_write_timeout(Some(self.control_timeout));
        match stream.try_clone() {
            Ok(liveness) => *self.liveness.lock().unwrap_or_else(|e| e.into_inner()) = liveness,
            Err(e) => return give_up(Error::Protocol(e.to_string())),
        }
        control.stream = stream;
        control.pending.clear();
        control.owed = 0;
        *self.doorbell.write().unwrap_or_else(|e| e.into_inner()) = resumed.doorbell;
        self.id.store(resumed.session, Ordering::Relaxed);
        let kernels_before = match &replay {
            Some(Some(_)) => self.resume.kernels_by_real_id(),
            _ => HashMap::new(),
        };
        self.resume.kernels_resumed(&kernel_ids, &resumed.kernels);
        let timeout = self.control_timeout;
        // Programs whose release the old daemon did not complete are built again only when that
        // release is issued again (with the untaken tasks), so that it finds them.
        self.resume.rebuild_programs(
            |request| call(&mut control, request, reply_wait(request, timeout), None).ok(),
            matches!(replay, Some(Some(_))),
            |id| self.is_done(id),
        );
        // A buffer the new daemon refuses to protect is left out of later checkpoints (a
        // checkpoint with none protected fails, saying so).
        let _refused = self
            .resume
            .protect_again(|request| call(&mut control, request, timeout, None).ok());
        if let Some(Some(replay)) = replay {
            self.issue_again(&mut producer, replay, &kernels_before);
        }
        drop(producer);
        drop(control);
        self.disconnected.store(false, Ordering::Release);
        self.resume.epoch.fetch_add(1, Ordering::AcqRel);
        Ok(())
    }

    /// The tasks the dead daemon never took, if they can be issued again on the next one:
    /// when every task before them completed, they continue exactly where the data stands.
    /// (When one it took did not complete, a later task may read what that one should have
    /// written: then every outstanding task fails with `DaemonRestarted`, for the application
    /// to issue again in order.) The daemon releases each descriptor before acting on it, so
    /// an untaken one never ran.
    fn untaken_tasks(&self, producer: &Producer) -> Option<Replay> {
        let descriptors = producer.ring.untaken()?;
        let first = producer.next_id.checked_sub(descriptors.len() as u64)?;
        if descriptors.is_empty() || first == 0 {
            return None;
        }
        let earlier_done = (producer.next_id.saturating_sub(self.capacity).max(1)..first).all(|id| self.is_done(id));
        let in_order = descriptors.iter().zip(first..).all(|(d, id)| d.task_id == id);
        (earlier_done && in_order).then_some(Replay { first, descriptors })
    }

    /// After a resume: issues the tasks the old daemon never took again, in their order and
    /// under their ids (their `Task` handles complete as if nothing happened), with kernel ids
    /// translated to the new daemon's (`kernels_before`: the old daemon's id → the
    /// application's).
    fn issue_again(&self, producer: &mut Producer, replay: Replay, kernels_before: &HashMap<u32, u32>) {
        let count = replay.descriptors.len();
        for (i, mut descriptor) in replay.descriptors.into_iter().enumerate() {
            if descriptor.op == Op::Launch as u32 || descriptor.op == Op::ReleaseProgram as u32 {
                if let Some(&id) = kernels_before.get(&descriptor.kernel) {
                    descriptor.kernel = self.resume.kernel_ids.real(id);
                }
            }
            if !producer.ring.stage(&descriptor) {
                // Cannot happen (the new daemon took the ring over empty, and these fitted in
                // it before); if it did, the rest fail as lost tasks would.
                let mut c = self.lock_completions();
                for id in replay.first + i as u64..replay.first + count as u64 {
                    self.complete(&mut c, id, Err(TaskError::DaemonRestarted));
                }
                drop(c);
                self.consumed_more((count - i) as u64);
                break;
            }
        }
        producer.ring.publish();
        self.doorbell.read().unwrap_or_else(|e| e.into_inner()).ring();
        self.resume.reissued.fetch_add(count as u64, Ordering::Relaxed);
    }

    /// After a resume: fails every task the lost daemon left outstanding before `replayed_from`
    /// (the first task issued again) with [`TaskError::DaemonRestarted`] and moves the
    /// completion head to the submission tail, where the new daemon posts from.
    fn complete_lost_tasks(&self, c: &mut Completions, next_id: u64, replayed_from: u64) {
        let mut lost = 0u64;
        // A slot is reused only after its previous task completed, so the outstanding tasks are
        // among the last `capacity` ids.
        for id in next_id.saturating_sub(self.capacity).max(1)..replayed_from {
            if !self.is_done(id) {
                self.complete(c, id, Err(TaskError::DaemonRestarted));
                lost += 1;
            }
        }
        let header = self.segment.view().header();
        let tail = header.submission_tail.load(Ordering::Relaxed);
        let head = header.completion_head.load(Ordering::Relaxed);
        c.ring.skip(tail.wrapping_sub(head));
        if lost > 0 {
            self.consumed_more(lost);
        }
    }

    /// One resume exchange on a fresh connection. On failure, the error and whether trying
    /// again later may help.
    fn try_resume(&self, stream: &UnixStream, messages: &[Request]) -> Result<Resumed, (Error, bool)> {
        let _ = stream.set_read_timeout(Some(HELLO_TIMEOUT));
        let _ = stream.set_write_timeout(Some(HELLO_TIMEOUT));
        let later = |e: TransportError| (Error::from(e), true);
        let (first, rest) = messages.split_first().expect("a resume has a first message");
        send_with_fds(stream, first, &[self.segment.fd()]).map_err(later)?;
        for message in rest {
            send(stream, message).map_err(later)?;
        }
        let (response, fds): (Response, _) = recv_with_fds(stream).map_err(later)?;
        match response {
            Response::Resumed { session, kernels } => match fds.into_iter().next() {
                Some(fd) => Ok(Resumed {
                    doorbell: Doorbell::from_fd(fd),
                    session,
                    kernels,
                }),
                None => Err((
                    Error::Protocol("the daemon sent no doorbell with its resume".into()),
                    true,
                )),
            },
            // The daemon still tears down this segment's previous session (it closed our
            // connection but lives): it will be free in a moment.
            Response::Error(e @ ControlError::SegmentInUse { .. }) => Err((Error::Control(e), true)),
            Response::Error(e @ ControlError::LimitReached { .. }) => Err((Error::Control(e), true)),
            Response::Error(e) => Err((Error::Control(e), false)),
            other => Err((Error::Protocol(format!("unexpected reply to resume: {other:?}")), false)),
        }
    }

    /// The error of completed task `id`, whose `Task` handle is alive, if it failed.
    pub(crate) fn task_error(&self, id: u64) -> Option<TaskError> {
        let slot = (id % self.capacity) as usize;
        let flag = self.handles[slot].load(Ordering::Acquire);
        // Common case: the slot still holds this task, with no error stored.
        if flag == id {
            return None;
        }
        self.lock_completions().task_errors.get(&id).copied()
    }

    /// The handle of task `id` is gone: forget its error.
    pub(crate) fn forget(&self, id: u64) {
        if self.in_forked_child() {
            // The bookkeeping is a copy of the parent's, whose locks another thread of the
            // parent may have held at the fork.
            return;
        }
        let slot = (id % self.capacity) as usize;
        match self.handles[slot].compare_exchange(id, 0, Ordering::AcqRel, Ordering::Acquire) {
            Ok(_) => {}
            Err(flag) => {
                if flag == id | ERROR_STORED {
                    // Fails only if the slot was reused meanwhile; the error goes either way.
                    let _ = self.handles[slot].compare_exchange(flag, 0, Ordering::AcqRel, Ordering::Relaxed);
                }
                // Its error was stored, or the slot was reused (then it may have been).
                self.lock_completions().task_errors.remove(&id);
            }
        }
    }

    /// Takes `queue`'s failures since its previous `finish`.
    pub(crate) fn take_queue_failures(&self, queue: u64) -> Option<TaskFailures> {
        if self.failing_queues.load(Ordering::Relaxed) == 0 {
            return None;
        }
        let failures = self.lock_completions().queue_failures.remove(&queue)?;
        self.failing_queues.fetch_sub(1, Ordering::Relaxed);
        Some(failures)
    }
}

/// Hooks for the daemon's hostile-input tests.
pub mod testing {
    use super::*;

    /// Submits a raw descriptor (its `task_id` and `queue` are overwritten so the completion can
    /// be matched; every other field goes to the daemon as given).
    pub fn submit_raw(session: &Session, queue: u64, descriptor: TaskDescriptor) -> Result<crate::Task, Error> {
        let id = session.inner.submit(queue, descriptor, true)?;
        Ok(crate::Task::new(session.inner.clone(), id))
    }

    /// Publishes an impossible submission tail (a corrupt ring).
    pub fn corrupt_submission_tail(session: &Session) {
        let producer = session.inner.producer.lock().unwrap_or_else(|e| e.into_inner());
        producer.ring.publish_raw_tail(u32::MAX / 2);
        drop(producer);
        session.inner.doorbell.read().unwrap_or_else(|e| e.into_inner()).ring();
    }

    /// Sends a control request as given and returns the daemon's reply.
    pub fn control_raw(session: &Session, request: &Request) -> Result<Response, Error> {
        session.inner.request(request)
    }

    /// Raw handle of a buffer or queue.
    pub fn buffer_handle(buffer: &crate::Buffer) -> u64 {
        buffer.handle()
    }

    /// The session's own view of its segment (header, rings, heap), to write anything into it
    /// (valid while the session lives).
    pub fn segment_view(session: &Session) -> agora_protocol::segment::SegmentView {
        *session.inner.segment().view()
    }

    /// The session's segment memfd (to try to shrink or grow it).
    pub fn segment_fd(session: &Session) -> std::os::fd::BorrowedFd<'_> {
        session.inner.segment().fd()
    }

    /// How the calling thread's waits on `session` may yield their core now: `never`,
    /// `rarely` or `cooperative` (see `Inner::yielding`).
    pub fn wait_yielding(session: &Session) -> &'static str {
        match session.inner.yielding() {
            agora_wait::Yielding::Never => "never",
            agora_wait::Yielding::Rarely => "rarely",
            agora_wait::Yielding::Cooperative => "cooperative",
        }
    }

    /// Rings the daemon's doorbell for the session (makes it look at the rings now).
    pub fn ring_doorbell(session: &Session) {
        session.inner.doorbell.read().unwrap_or_else(|e| e.into_inner()).ring();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_program_s_name_always_makes_a_client_name_the_daemon_accepts() {
        assert_eq!(default_name("solver".into(), None), "solver");
        let heap = |v: &str| heap_bytes_from(Some(v.to_string()));
        assert_eq!(heap_bytes_from(None).unwrap(), None);
        assert_eq!(heap(" ").unwrap(), None);
        assert_eq!(heap("4096").unwrap(), Some(4096));
        assert_eq!(heap("256M").unwrap(), Some(256 << 20));
        assert_eq!(heap("2g").unwrap(), Some(2 << 30));
        assert_eq!(heap("64 K").unwrap(), Some(64 << 10));
        for bad in ["0", "-1", "1.5G", "12T", "M", "lots", "99999999999999G"] {
            let error = heap(bad).unwrap_err();
            assert!(
                matches!(error, Error::Environment { variable: HEAP_ENV, .. }),
                "{bad}: {error:#?}"
            );
            let message = error.to_string();
            assert!(
                message.contains("AGORA_HEAP_BYTES") && message.contains("256M") && !message.contains("bad request"),
                "{bad}: {message}"
            );
        }
        assert_eq!(default_name("run\u{1b}[2J\n\u{202e}x".into(), None), "run_[2J__x");
        let control = |v: &str| control_timeout_from(Some(v.to_string()));
        assert_eq!(control_timeout_from(None).unwrap(), None);
        assert_eq!(control(" ").unwrap(), None);
        assert_eq!(control("120").unwrap(), Some(Duration::from_secs(120)));
        assert_eq!(control("0.5").unwrap(), Some(Duration::from_millis(500)));
        for bad in ["0", "-1", "nan", "inf", "86401", "30s", "lots"] {
            let error = control(bad).unwrap_err();
            assert!(
                matches!(
                    error,
                    Error::Environment {
                        variable: CONTROL_TIMEOUT_ENV,
                        ..
                    }
                ),
                "{bad}: {error:#?}"
            );
            let message = error.to_string();
            assert!(
                message.contains("AGORA_CONTROL_TIMEOUT")
                    && message.contains("seconds")
                    && !message.contains("bad request"),
                "{bad}: {message}"
            );
        }
        assert_eq!(
            control_timeout(Some(Duration::from_secs(7))).unwrap(),
            Duration::from_secs(7)
        );
        let long = default_name("é".repeat(MAX_NAME), None);
        assert!(long.len() <= MAX_NAME && long.chars().all(|c| c == 'é'));
        for name in ["a\tb", "\u{feff}", &"\u{7f}".repeat(400)] {
            for rank in [None, Some("4294967295")] {
                assert!(
                    check_name("client", &default_name(name.to_string(), rank)).is_ok(),
                    "{name:?}"
                );
            }
        }
    }

    #[test]
    fn each_rank_of_a_parallel_job_gets_a_default_name_of_its_own() {
        assert_eq!(default_name("solver".into(), Some("3")), "solver.rank3");
        // A long name is cut, never the rank.
        let long = default_name("é".repeat(MAX_NAME), Some("12"));
        assert!(long.len() <= MAX_NAME && long.ends_with("é.rank12"), "{long}");

        let env = |pairs: &'static [(&'static str, &'static str)]| {
            move |variable: &str| pairs.iter().find(|(k, _)| *k == variable).map(|(_, v)| v.to_string())
        };
        assert_eq!(rank(env(&[])), None);
        assert_eq!(rank(env(&[("SLURM_PROCID", "5")])).as_deref(), Some("5"));
        assert_eq!(rank(env(&[("OMPI_COMM_WORLD_RANK", "007")])).as_deref(), Some("7"));
        assert_eq!(rank(env(&[("PMIX_RANK", "0")])).as_deref(), Some("0"));
        // mpirun inside a Slurm batch script: the launcher's rank, not the script's task id.
        assert_eq!(
            rank(env(&[("SLURM_PROCID", "0"), ("PMI_RANK", "2")])).as_deref(),
            Some("2")
        );
        assert_eq!(
            rank(env(&[("SLURM_PROCID", "0"), ("MV2_COMM_WORLD_RANK", "6")])).as_deref(),
            Some("6")
        );
        // What is no rank is passed over.
        assert_eq!(
            rank(env(&[("PMI_RANK", ""), ("SLURM_PROCID", "1")])).as_deref(),
            Some("1")
        );
        assert_eq!(rank(env(&[("PMI_RANK", "x/../1")])), None);
        assert_eq!(rank(env(&[("PMI_RANK", "-1")])), None);
    }
}
