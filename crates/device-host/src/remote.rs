//! The daemon's side: [`RemoteDevice`], a [`Device`] whose work runs in a device-host process.
//!
//! Each OpenCL platform, and each GPU, gets one host process (`Platform`) and each of its
//! devices one `RemoteDevice`. The device's lanes stay in the daemon (so ordering, slicing, deadlines,
//! priorities and revocable-job isolation are exactly those of every other device); a lane's
//! executor only forwards each job to the host and finishes it when the host says it is done.
//! Session segments reach the host by memfd when a session first moves data to the device
//! ([`Device::register_host_memory`]; a GPU's host also page-locks it), so transfers copy
//! nothing on the way. Launch checks, slicing and row alignment are decided here, by the same
//! functions the device kind uses in the daemon ([`agora_devices::cuda::check_launch`] for a GPU).
//!
//! When the host dies (a driver assertion, a segfault, an OOM kill, or its own exit after a kernel
//! fault ended a GPU's context: the job that met the fault was answered first) or stops answering (a hang:
//! no job finished for [`HostSpec::hang_timeout`] while jobs wait), every job it had fails with
//! `DeviceLost` and [`Device::healthy`] turns false: the daemon replays those tasks from host
//! copies elsewhere and forgets the device's copies, exactly as for a lost GPU. Then
//! [`Device::revive`] starts a new host, which gets every live segment again; the device is back,
//! empty. The daemon and the other devices never notice beyond that.
//!
//! Must not: trust the host's replies beyond their framing (lengths are checked before any copy
//! into host memory); block the dispatcher (`revive` starts hosts on a thread of its own).

use std::collections::{BTreeMap, HashMap, HashSet};
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, OwnedFd};
use std::os::unix::net::UnixStream;
use std::os::unix::process::CommandExt;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::mpsc;
use std::sync::{Arc, Condvar, Mutex, RwLock, Weak};
use std::time::{Duration, Instant};

use agora_devices::lane::{Executor, JobEnd, Lane, Lanes};
use agora_devices::priority::{LaneClass, LanePriorities};
use agora_devices::{Device, DeviceBuffer, DeviceInfo, DeviceKind, DeviceReport, Job, LaunchLimits, Transfer, Work};
use agora_kernels::{ArgValue, KernelDef, KernelRef};
use agora_protocol::TaskError;
use agora_transport::socket::{recv_with_fds, send, send_with_fds};

use crate::host::{LINK_FOREIGN_BUFFER, LINK_WRONG_REPLY};
use crate::wire::{
    ArgWire, CudaWire, DeviceWire, HostRef, KernelWire, OpenClWire, Reply, Request, Submit, TransferWire, WorkWire,
    PROTOCOL,
};

/// Longest a synchronous request (an allocation, a read) waits for the host's answer.
const CALL_TIMEOUT: Duration = Duration::from_secs(10);

/// How long the watch thread may go without running before the daemon counts itself as having
/// been stalled (it runs at least once a second, [`watch`]).
const STALL_GAP: Duration = Duration::from_secs(3);

/// Longest a kernel's preparation (a GPU's NVRTC compile and JIT) waits for the host's answer: a
/// large tenant program takes seconds; the build that asked waits, not the dispatcher.
const PREPARE_TIMEOUT: Duration = Duration::from_secs(120);

/// How the daemon starts device hosts.
#[derive(Debug, Clone)]
pub struct HostSpec {
    /// The `agora` binary (its hidden `device-host` subcommand is the host).
    pub program: PathBuf,
    /// Lanes per device.
    pub lanes: usize,
    /// Device memory limit in bytes (0: the device's size).
    pub memory_limit: u64,
    /// Longest a host may take to start (PoCL compiles nothing at start, but loads LLVM).
    pub start_timeout: Duration,
    /// A host with jobs waiting that finishes none for this long is taken as hung and killed.
    pub hang_timeout: Duration,
    /// OS priority of the daemon-side lane threads.
    pub priorities: LanePriorities,
    /// More arguments for `agora device-host` (a GPU's tenant launch limit, a sim's settings).
    pub extra_args: Vec<String>,
}

/// Lists the OpenCL platforms by asking the host program (`device-host --list`), so the daemon
/// never loads an OpenCL runtime itself.
pub fn list_platforms(program: &std::path::Path) -> Result<Vec<String>, String> {
    let output = Command::new(program)
        .args(["device-host", "--list"])
        .stdin(Stdio::null())
        .output()
        .map_err(|e| format!("running {} device-host --list: {e}", program.display()))?;
    if !output.status.success() {
        return Err(String::from_utf8_lossy(&output.stderr).trim().to_string());
    }
    Ok(String::from_utf8_lossy(&output.stdout)
        .lines()
        .filter(|l| !l.trim().is_empty())
        .map(str::to_string)
        .collect())
}

/// Lists the GPUs by asking the host program (`device-host --list-gpus`), so the daemon never
/// loads the CUDA driver itself: their `--platform` names (`cuda:N`), and when there are none,
/// why (no driver, no device: normal on most machines). An error: the host program did not run.
pub fn list_gpus(program: &std::path::Path) -> Result<(Vec<String>, Option<String>), String> {
    let output = Command::new(program)
        .args(["device-host", "--list-gpus"])
        .stdin(Stdio::null())
        .output()
        .map_err(|e| format!("running {} device-host --list-gpus: {e}", program.display()))?;
    let why = String::from_utf8_lossy(&output.stderr).trim().to_string();
    if !output.status.success() {
        return Err(format!("{} device-host --list-gpus failed: {why}", program.display()));
    }
    let gpus: Vec<String> = String::from_utf8_lossy(&output.stdout)
        .lines()
        .filter(|l| !l.trim().is_empty())
        .map(str::to_string)
        .collect();
    let why_none = gpus.is_empty().then(|| {
        if why.is_empty() {
            "no GPU found".to_string()
        } else {
            why
        }
    });
    Ok((gpus, why_none))
}

/// Starts the host of `platform` (an OpenCL platform's name, `cuda:N`, or `sim`) and returns its
/// devices, the one of index `i` named `name(i)`, and one line per device it could not start.
pub fn start_platform(
    spec: &HostSpec,
    platform: &str,
    name: &dyn Fn(usize) -> String,
) -> Result<(Vec<RemoteDevice>, Vec<String>), String> {
    let shared = Arc::new(Platform::new(platform, spec.clone()));
    let (link, wires, problems) = Link::start(&shared)?;
    *shared.link.write().unwrap_or_else(|e| e.into_inner()) = link;
    shared.up.store(true, Ordering::Release);
    let weak = Arc::downgrade(&shared);
    std::thread::Builder::new()
        .name(format!("agora-host-watch-{}", name(0)))
        .spawn(move || watch(weak))
        .map_err(|e| format!("starting the device host's watch thread: {e}"))?;
    let mut devices = Vec::new();
    for (index, wire) in wires.into_iter().enumerate() {
        devices.push(RemoteDevice::new(shared.clone(), index as u16, name(index), wire)?);
    }
    Ok((devices, problems))
}

/// One platform's host, across its restarts.
pub(crate) struct Platform {
    name: String,
    spec: HostSpec,
    /// The host now (a dead one after a crash, until `revive`).
    link: RwLock<Arc<Link>>,
    /// Whether `link` is alive, without its lock: the dispatcher asks every loop
    /// ([`Device::healthy`]).
    up: AtomicBool,
    restart: Mutex<Restart>,
    /// Session segments the devices were given, by base address: re-sent to every new host.
    segments: Mutex<BTreeMap<usize, SegmentEntry>>,
    next_segment: AtomicU64,
    /// Programs that failed to build for good there.
    broken: Mutex<HashSet<String>>,
    restarts: AtomicU64,
    /// Revocable jobs whose flags the watch thread forwards: (job, flag, link).
    watched: Mutex<Vec<Watched>>,
    watch_wake: Condvar,
    /// What the host last reported of each device's load ([`Reply::Load`]): utilisation, cached
    /// bytes.
    loads: Mutex<HashMap<u16, (Option<u32>, u64)>>,
    /// When and why the last host failed, for `agora status` (an operator asking why a GPU's
    /// tasks were replayed finds it there, not only in the log).
    last_failure: Mutex<Option<(Instant, String)>>,
    /// Bytes copied through staging segments since start: host memory the host had no
    /// (writable) mapping of ([`DeviceReport::staged_bytes`]).
    staged_bytes: AtomicU64,
}

/// A revocable job the watch thread looks after: (job, its flag, its host).
type Watched = (u64, Arc<AtomicBool>, Weak<Link>);

/// A started host: its link, its devices and what it could not start.
type Started = (Arc<Link>, Vec<DeviceWire>, Vec<String>);

#[derive(Default)]
struct Restart {
    pending: Option<mpsc::Receiver<Result<Arc<Link>, String>>>,
    last_try: Option<Instant>,
}

struct SegmentEntry {
    id: u64,
    len: usize,
    fd: OwnedFd,
    /// Page-locked in the host (for a GPU's DMA).
    page_lock: bool,
    /// Mapped writable in the host: false for memory sealed against new writable mappings (a
    /// read-only export's region), which the host maps read-only and is never asked to write
    /// (such a destination goes through a staging segment).
    writable: bool,
    /// Devices of the platform that registered it.
    users: usize,
}

impl Platform {
    /// A platform whose host is not started yet (its link is a dead one until `Link::start`).
    fn new(name: &str, spec: HostSpec) -> Platform {
        Platform {
            name: name.to_string(),
            spec,
            link: RwLock::new(Arc::new(Link::dead())),
            up: AtomicBool::new(false),
            restart: Mutex::new(Restart::default()),
            segments: Mutex::new(BTreeMap::new()),
            next_segment: AtomicU64::new(1),
            broken: Mutex::new(HashSet::new()),
            restarts: AtomicU64::new(0),
            watched: Mutex::new(Vec::new()),
            watch_wake: Condvar::new(),
            loads: Mutex::new(HashMap::new()),
            last_failure: Mutex::new(None),
            staged_bytes: AtomicU64::new(0),
        }
    }

    fn link(&self) -> Arc<Link> {
        self.link.read().unwrap_or_else(|e| e.into_inner()).clone()
    }

    /// Where `len` bytes at `ptr` are for the host: a segment range, or `None` outside them (or,
    /// when the host is to `write` them, in a segment it maps read-only).
    fn segment_of(&self, ptr: *const u8, len: usize, write: bool) -> Option<HostRef> {
        let address = ptr as usize;
        let segments = self.segments.lock().unwrap_or_else(|e| e.into_inner());
        let (base, entry) = segments.range(..=address).next_back()?;
        let offset = address - base;
        (offset.checked_add(len)? <= entry.len && (entry.writable || !write)).then_some(HostRef {
            segment: entry.id,
            offset: offset as u64,
        })
    }

    fn register(
        self: &Arc<Self>,
        base: *mut u8,
        len: usize,
        fd: BorrowedFd<'_>,
        page_lock: bool,
    ) -> Result<SegmentGuard, String> {
        let mut segments = self.segments.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(entry) = segments.get_mut(&(base as usize)) {
            entry.users += 1;
        } else {
            let fd = fd
                .try_clone_to_owned()
                .map_err(|e| format!("keeping the segment's descriptor for the device host: {e}"))?;
            let id = self.next_segment.fetch_add(1, Ordering::Relaxed);
            let writable = writable(fd.as_fd());
            // Sent under the table's lock: a host starting now maps the table after this.
            self.link().map_segment(id, len, fd.as_fd(), page_lock, writable);
            segments.insert(
                base as usize,
                SegmentEntry {
                    id,
                    len,
                    fd,
                    page_lock,
                    writable,
                    users: 1,
                },
            );
        }
        Ok(SegmentGuard {
            platform: self.clone(),
            base: base as usize,
        })
    }

    /// For a failed host: starts a new one (on a thread), and installs it once it is up.
    fn revive(self: &Arc<Self>) -> bool {
        if self.link().alive() {
            // Down while alive: it said it is exiting (`Reply::Exiting`); the new host starts
            // once it has gone.
            return self.up.load(Ordering::Acquire);
        }
        let mut restart = self.restart.lock().unwrap_or_else(|e| e.into_inner());
        let Some(pending) = &restart.pending else {
            // At most one attempt per second: a host that cannot start must not spin.
            if restart.last_try.is_some_and(|t| t.elapsed() < Duration::from_secs(1)) {
                return false;
            }
            restart.last_try = Some(Instant::now());
            let (result, receiver) = mpsc::channel();
            let platform = self.clone();
            let started = std::thread::Builder::new()
                .name("agora-host-start".into())
                .spawn(move || {
                    let _ = result.send(Link::start(&platform).map(|(link, _, _)| link));
                });
            if started.is_ok() {
                restart.pending = Some(receiver);
            }
            return false;
        };
        match pending.try_recv() {
            Ok(Ok(link)) => {
                restart.pending = None;
                // Counted before the new host is visible: whoever sees it sees the count too.
                let restarts = self.restarts.fetch_add(1, Ordering::Relaxed) + 1;
                {
                    // The segments registered meanwhile went to the dead host: send them all.
                    let mut segments = self.segments.lock().unwrap_or_else(|e| e.into_inner());
                    for entry in segments.values_mut() {
                        // Sealed since it was registered (a region exported read-only): the new
                        // host may map it read-only only, and is never asked to write it.
                        entry.writable &= writable(entry.fd.as_fd());
                        link.map_segment(entry.id, entry.len, entry.fd.as_fd(), entry.page_lock, entry.writable);
                    }
                    *self.link.write().unwrap_or_else(|e| e.into_inner()) = link;
                    // The dead host's last reports; the new one reports its own.
                    self.loads.lock().unwrap_or_else(|e| e.into_inner()).clear();
                    self.up.store(true, Ordering::Release);
                }
                tracing::warn!(platform = %self.name, restarts, "device host restarted: its devices are back, empty");
                true
            }
            Ok(Err(e)) => {
                restart.pending = None;
                tracing::warn!(platform = %self.name, "device host did not restart: {e}; trying again");
                false
            }
            Err(mpsc::TryRecvError::Empty) => false,
            Err(mpsc::TryRecvError::Disconnected) => {
                restart.pending = None;
                false
            }
        }
    }
}

/// Keeps a segment registered with the platform's host; unregisters it when the last device's
/// guard goes.
struct SegmentGuard {
    platform: Arc<Platform>,
    base: usize,
}

impl Drop for SegmentGuard {
    fn drop(&mut self) {
        let mut segments = self.platform.segments.lock().unwrap_or_else(|e| e.into_inner());
        let Some(entry) = segments.get_mut(&self.base) else {
            return;
        };
        entry.users -= 1;
        if entry.users == 0 {
            let id = entry.id;
            segments.remove(&self.base);
            self.platform.link().send_later(Request::UnmapSegment { segment: id });
        }
    }
}

/// A job the host runs now.
struct PendingJob {
    end: JobEnd,
    /// Staging segments for its memory outside every session segment.
    staging: Vec<Staging>,
    lane: Arc<LaneCount>,
    /// When it was sent.
    sent: Instant,
    /// Host work to run here once the host is done with the job's transfers (fills and copies
    /// on memory outside every segment, such as an exported buffer's region).
    after: Option<Work>,
}

/// A staging segment: a memfd the daemon makes for host memory outside every session segment
/// (a revoked task's saved buffers, for one), mapped by the host for one job or read. A source
/// is copied in when it is made; a destination is copied out when the host is done
/// ([`Staging::deliver`]). Unmapped there when dropped.
struct Staging {
    id: u64,
    map: memmap2::MmapRaw,
    /// Where the bytes go, for a destination.
    target: Option<*mut u8>,
    link: Weak<Link>,
}

// SAFETY: `target` is a job's destination, kept valid until the job finishes by its JobEnd (the
// daemon's completion holds the memory); only the thread that finishes the job writes it.
unsafe impl Send for Staging {}

impl Staging {
    /// Stages `len` bytes at `ptr` for `link`'s host: a copy now for a source, later for a
    /// destination.
    fn new(
        platform: &Platform,
        link: &Arc<Link>,
        ptr: *mut u8,
        len: usize,
        source: bool,
    ) -> Result<(HostRef, Staging), TaskError> {
        let fd = rustix::fs::memfd_create("agora-staging", rustix::fs::MemfdFlags::CLOEXEC)
            .map_err(|e| staging_error(len, "memfd_create", e.raw_os_error()))?;
        rustix::fs::ftruncate(&fd, len.max(1) as u64).map_err(|e| staging_error(len, "sizing", e.raw_os_error()))?;
        let file = std::fs::File::from(fd);
        let map = memmap2::MmapOptions::new()
            .len(len.max(1))
            .map_raw(&file)
            .map_err(|e| staging_error(len, "mapping", e.raw_os_error().unwrap_or(libc::ENOMEM)))?;
        if source {
            // SAFETY: `ptr` is the job's source, valid for `len` bytes while it is queued; the map
            // is at least `len` bytes long and fresh.
            unsafe { std::ptr::copy_nonoverlapping(ptr, map.as_mut_ptr(), len) };
        }
        let id = platform.next_segment.fetch_add(1, Ordering::Relaxed);
        platform.staged_bytes.fetch_add(len as u64, Ordering::Relaxed);
        link.map_segment(id, len.max(1), file.as_fd(), false, true);
        Ok((
            HostRef { segment: id, offset: 0 },
            Staging {
                id,
                map,
                target: (!source).then_some(ptr),
                link: Arc::downgrade(link),
            },
        ))
    }

    /// Copies a destination's bytes to where they belong (the host has written them).
    fn deliver(&self, len: usize) {
        if let Some(target) = self.target {
            let len = len.min(self.map.len());
            // SAFETY: the destination is valid for `len` bytes until its job finishes (or, for a
            // `read_later`, until its `done` is called, which comes after this); the map holds at
            // least `len` bytes (clamped).
            unsafe { std::ptr::copy_nonoverlapping(self.map.as_ptr(), target, len) };
        }
    }
}

impl Drop for Staging {
    fn drop(&mut self) {
        if let Some(link) = self.link.upgrade() {
            link.send_later(Request::UnmapSegment { segment: self.id });
        }
    }
}

/// Jobs of one daemon lane that the host has not finished (for work that must wait for them).
#[derive(Default)]
struct LaneCount {
    count: Mutex<usize>,
    idle: Condvar,
}

impl LaneCount {
    fn add(&self) {
        *self.count.lock().unwrap_or_else(|e| e.into_inner()) += 1;
    }
    fn done(&self) {
        let mut count = self.count.lock().unwrap_or_else(|e| e.into_inner());
        *count = count.saturating_sub(1);
        if *count == 0 {
            self.idle.notify_all();
        }
    }
    fn wait_idle(&self) {
        let mut count = self.count.lock().unwrap_or_else(|e| e.into_inner());
        while *count > 0 {
            count = self.idle.wait(count).unwrap_or_else(|e| e.into_inner());
        }
    }
}

/// The time the daemon as a whole did not run, as its watch thread sees it: a virtual machine
/// paused by its hypervisor (seen here: the guest's kernel reported its workqueues stuck for
/// 53 s), or a daemon stopped with SIGSTOP. A host's hang limits count only the time the daemon
/// ran, so on resuming it does not take every device host for hung (their answers, sent
/// meanwhile, are waiting in the socket) and replay their tasks elsewhere.
struct StallClock {
    /// When the watch thread last ran.
    last_tick: Instant,
    /// All the time the daemon was stalled.
    stalled: Duration,
}

impl StallClock {
    fn new() -> StallClock {
        StallClock {
            last_tick: Instant::now(),
            stalled: Duration::ZERO,
        }
    }
}

/// Who waits for the reply to a request.
enum Waiter {
    /// A thread blocked in [`Link::call_within`].
    Thread(mpsc::Sender<Reply>),
    /// A request sent with [`Link::call_later`] at `since`: `done` takes the reply, or the
    /// error that ended the host first.
    Later {
        since: Instant,
        done: Box<dyn FnOnce(Result<Reply, TaskError>) + Send>,
    },
}

impl Waiter {
    fn answer(self, reply: Result<Reply, TaskError>) {
        match (self, reply) {
            (Waiter::Thread(thread), Ok(reply)) => {
                let _ = thread.send(reply);
            }
            // Dropping the sender wakes the thread with `Disconnected`: `DeviceLost`.
            (Waiter::Thread(_), Err(_)) => {}
            (Waiter::Later { done, .. }, reply) => done(reply),
        }
    }
}

/// One host process and the socket to it.
pub(crate) struct Link {
    writer: Mutex<Option<UnixStream>>,
    alive: AtomicBool,
    child: Mutex<Option<Child>>,
    jobs: Mutex<HashMap<u64, PendingJob>>,
    requests: Mutex<HashMap<u64, Waiter>>,
    next_id: AtomicU64,
    /// Kernels the host knows, by the address of their definition (held, so it is not reused).
    kernels: Mutex<HashMap<usize, (u32, KernelRef)>>,
    /// When a job last finished (or the first job was sent after none waited).
    progress: Mutex<Instant>,
    /// Time the daemon itself did not run, so the host's hang limits leave it out.
    stalls: Mutex<StallClock>,
    /// When the host last answered an allocation or a read (or the first request was sent after
    /// none waited). Its message loop answers them one after another: one that answers others
    /// is busy, not hung, however long a request waits behind them.
    answered: Mutex<Instant>,
    hang_timeout: Duration,
    /// The daemon closed it on purpose.
    closing: AtomicBool,
    /// Messages that need no answer, sent by whoever sends next (or the watch thread, woken for
    /// them): the reader thread drops buffers and staging segments as it finishes jobs, and must
    /// never wait for the socket itself (a lane thread blocked on a full socket, while the host
    /// waits for the reader to take its replies, would otherwise deadlock the three).
    outbox: Mutex<Vec<Request>>,
    platform: Weak<Platform>,
}

impl Link {
    fn dead() -> Link {
        Link {
            writer: Mutex::new(None),
            alive: AtomicBool::new(false),
            child: Mutex::new(None),
            jobs: Mutex::default(),
            requests: Mutex::default(),
            next_id: AtomicU64::new(1),
            kernels: Mutex::default(),
            progress: Mutex::new(Instant::now()),
            stalls: Mutex::new(StallClock::new()),
            answered: Mutex::new(Instant::now()),
            hang_timeout: Duration::from_secs(60),
            closing: AtomicBool::new(false),
            outbox: Mutex::new(Vec::new()),
            platform: Weak::new(),
        }
    }

    fn alive(&self) -> bool {
        self.alive.load(Ordering::Acquire)
    }

    /// Starts a host for `platform` and waits until it is ready.
    fn start(platform: &Arc<Platform>) -> Result<Started, String> {
        let spec = &platform.spec;
        let (ours, theirs) = rustix::net::socketpair(
            rustix::net::AddressFamily::UNIX,
            rustix::net::SocketType::STREAM,
            rustix::net::SocketFlags::CLOEXEC,
            None,
        )
        .map_err(|e| format!("socketpair: {e}"))?;
        let mut command = Command::new(&spec.program);
        command
            // What `ps` shows whatever the path (the daemon's own image is `/proc/self/exe`).
            .arg0("agora")
            .args(["device-host", "--fd", "3", "--platform"])
            .arg(&platform.name)
            .args(["--lanes", &spec.lanes.to_string()])
            .args(["--memory-limit", &spec.memory_limit.to_string()])
            .args(&spec.extra_args)
            .stdin(Stdio::null())
            .stdout(Stdio::null());
        let socket = theirs.as_raw_fd();
        // SAFETY: the closure runs in the forked child before exec and calls only
        // async-signal-safe functions (fcntl, dup2, setsid, prctl) on a descriptor open in the
        // child (`theirs` lives until spawn returns).
        unsafe {
            command.pre_exec(move || {
                let socket = libc::fcntl(socket, libc::F_DUPFD_CLOEXEC, 10);
                if socket < 0
                    || libc::dup2(socket, 3) < 0
                    // Its own session: a terminal's ^C goes to the daemon, which stops it in order.
                    || libc::setsid() < 0
                    || libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL as libc::c_ulong, 0, 0, 0) < 0
                {
                    return Err(std::io::Error::last_os_error());
                }
                Ok(())
            })
        };
        // The spawner thread lives as long as the daemon: the parent-death signal follows the
        // thread that forked, not the process.
        let child = agora_executor::supervisor::spawn(command)
            .map_err(|e| format!("starting {} device-host: {e}", spec.program.display()))?;
        drop(theirs);
        let stream = UnixStream::from(ours);
        let pid = child.id();
        let link = Arc::new(Link {
            writer: Mutex::new(Some(
                stream
                    .try_clone()
                    .map_err(|e| format!("cloning the host's socket: {e}"))?,
            )),
            alive: AtomicBool::new(true),
            child: Mutex::new(Some(child)),
            hang_timeout: spec.hang_timeout,
            platform: Arc::downgrade(platform),
            ..Link::dead()
        });
        let _ = stream.set_read_timeout(Some(spec.start_timeout));
        let ready = recv_with_fds::<Reply>(&stream);
        let _ = stream.set_read_timeout(None);
        let (devices, problems) = match ready {
            Ok((
                Reply::Ready {
                    protocol,
                    devices,
                    problems,
                },
                _,
            )) if protocol == PROTOCOL => (devices, problems),
            Ok((Reply::Ready { protocol, .. }, _)) => {
                link.fail("its protocol differs");
                return Err(format!(
                    "the device host speaks protocol {protocol}, the daemon {PROTOCOL}: the agora binary changed under the daemon"
                ));
            }
            Ok(_) => {
                link.fail("it did not start with Ready");
                return Err("the device host did not start with Ready".into());
            }
            Err(e) => {
                link.fail("it did not start");
                return Err(format!(
                    "the device host (pid {pid}) did not start within {:?}: {e}",
                    spec.start_timeout
                ));
            }
        };
        let reader = link.clone();
        let platform = Arc::downgrade(platform);
        std::thread::Builder::new()
            .name(format!("agora-host{pid}"))
            .spawn(move || reader.read(stream, platform))
            .map_err(|e| format!("starting the device host's reader thread: {e}"))?;
        tracing::info!(pid, devices = devices.len(), "device host ready");
        Ok((link, devices, problems))
    }

    /// Queues a message that needs no answer (see `outbox`); never waits for the socket.
    fn send_later(&self, request: Request) {
        if !self.alive() {
            return;
        }
        self.outbox.lock().unwrap_or_else(|e| e.into_inner()).push(request);
        if let Some(platform) = self.platform.upgrade() {
            platform.watch_wake.notify_one();
        }
    }

    /// Sends what `send_later` queued.
    fn flush(&self) {
        if self.outbox.lock().unwrap_or_else(|e| e.into_inner()).is_empty() {
            return;
        }
        let _ = self.send_queued(&mut self.writer.lock().unwrap_or_else(|e| e.into_inner()));
    }

    fn send_queued(&self, writer: &mut Option<UnixStream>) -> Result<(), String> {
        let queued = std::mem::take(&mut *self.outbox.lock().unwrap_or_else(|e| e.into_inner()));
        let Some(stream) = writer.as_ref() else {
            return Ok(());
        };
        for request in &queued {
            send(stream, request).map_err(|e| e.to_string())?;
        }
        Ok(())
    }

    fn send(&self, request: &Request) -> Result<(), ()> {
        let mut writer = self.writer.lock().unwrap_or_else(|e| e.into_inner());
        let queued = self.send_queued(&mut writer);
        let Some(stream) = writer.as_ref() else {
            return Err(());
        };
        if let Err(e) = queued.and_then(|()| send(stream, request).map_err(|e| e.to_string())) {
            drop(writer);
            self.fail(&format!("sending to it failed: {e}"));
            return Err(());
        }
        Ok(())
    }

    fn map_segment(&self, segment: u64, len: usize, fd: BorrowedFd<'_>, page_lock: bool, writable: bool) {
        let writer = self.writer.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(stream) = writer.as_ref() {
            let request = Request::MapSegment {
                segment,
                len: len as u64,
                page_lock,
                writable,
            };
            if let Err(e) = send_with_fds(stream, &request, &[fd]) {
                drop(writer);
                self.fail(&format!("sending it a segment failed: {e}"));
            }
        }
    }

    /// A request answered by one reply.
    fn call(&self, make: impl FnOnce(u64) -> Request) -> Result<Reply, TaskError> {
        // Calls come from the dispatcher (allocations, evictions' reads): a hung host must not
        // hold every tenant for the whole hang timeout. An allocation or a read of a buffer
        // answers in milliseconds; ten seconds is a host that stopped.
        self.call_within(self.hang_timeout.min(CALL_TIMEOUT), make)
    }

    /// A request answered by one reply within `limit`, or the host is taken as hung.
    fn call_within(&self, limit: Duration, make: impl FnOnce(u64) -> Request) -> Result<Reply, TaskError> {
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        let (reply, answer) = mpsc::channel();
        {
            let mut requests = self.requests.lock().unwrap_or_else(|e| e.into_inner());
            if !self.alive() {
                return Err(TaskError::DeviceLost);
            }
            self.first_waiting(&requests);
            requests.insert(id, Waiter::Thread(reply));
        }
        self.send(&make(id)).map_err(|()| TaskError::DeviceLost)?;
        let (sent, stalled_before) = (Instant::now(), self.stalled());
        let mut wait = limit;
        loop {
            match answer.recv_timeout(wait) {
                Ok(reply) => return Ok(reply),
                Err(mpsc::RecvTimeoutError::Disconnected) => return Err(TaskError::DeviceLost),
                Err(mpsc::RecvTimeoutError::Timeout) => {}
            }
            // Time the daemon did not run does not count (`StallClock`). Right after such a
            // stall this thread may run before the watch thread has counted it: then it waits
            // for the watch thread a little. A host that answers other requests meanwhile is
            // working through a backlog: it is waited for too (both bounded, should the watch
            // thread be gone or the host never come to this request).
            let waited = sent.elapsed();
            let allowed = limit + self.stalled().saturating_sub(stalled_before);
            if waited < allowed {
                wait = allowed - waited;
            } else if (self.watch_overdue() || self.answered_within(limit)) && waited < 3 * limit {
                wait = Duration::from_millis(50);
            } else {
                self.fail(&format!("it did not answer a request within {limit:?}"));
                return Err(TaskError::DeviceLost);
            }
        }
    }

    /// Starts the clock of answers when a request is about to wait and none did (`requests` is
    /// the table, locked by the caller).
    fn first_waiting(&self, requests: &HashMap<u64, Waiter>) {
        if requests.is_empty() {
            *self.answered.lock().unwrap_or_else(|e| e.into_inner()) = Instant::now();
        }
    }

    /// Whether the host answered an allocation or a read within the last `limit`.
    fn answered_within(&self, limit: Duration) -> bool {
        self.answered.lock().unwrap_or_else(|e| e.into_inner()).elapsed() < limit
    }

    /// All the time the daemon did not run, so far ([`StallClock`]).
    fn stalled(&self) -> Duration {
        self.stalls.lock().unwrap_or_else(|e| e.into_inner()).stalled
    }

    /// Whether the watch thread has not run for longer than it ever should: the daemon was just
    /// stalled, and the watch thread has not counted it yet.
    fn watch_overdue(&self) -> bool {
        self.stalls
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .last_tick
            .elapsed()
            > STALL_GAP
    }

    /// The watch thread's beat: a gap since its last one (less the `working` time it spent on
    /// the host in between) longer than it ever sleeps means the daemon did not run meanwhile;
    /// that time is counted ([`StallClock`]) and the host's clocks (its late requests, its
    /// progress) move on by it, so no hang limit counts it.
    fn tick(&self, working: Duration) {
        let now = Instant::now();
        let lost = {
            let mut stalls = self.stalls.lock().unwrap_or_else(|e| e.into_inner());
            let gap = now.saturating_duration_since(stalls.last_tick).saturating_sub(working);
            stalls.last_tick = now;
            if gap <= STALL_GAP {
                return;
            }
            // The watch thread sleeps at most a second between beats.
            let lost = gap - Duration::from_secs(1);
            stalls.stalled += lost;
            lost
        };
        for waiter in self.requests.lock().unwrap_or_else(|e| e.into_inner()).values_mut() {
            if let Waiter::Later { since, .. } = waiter {
                *since = (*since + lost).min(now);
            }
        }
        for clock in [&self.progress, &self.answered] {
            let mut clock = clock.lock().unwrap_or_else(|e| e.into_inner());
            *clock = (*clock + lost).min(now);
        }
        tracing::warn!(
            stalled_ms = lost.as_millis() as u64,
            "the daemon did not run for {lost:?} (its machine or process was paused): the device host's hang limits leave that time out"
        );
    }

    /// A request whose reply `done` receives later, on the reader thread (or the error that ended
    /// the host first, on whichever thread noticed). The caller does not wait: the dispatcher
    /// uses it for allocations, so a host busy with other tenants' work cannot stall it. A host
    /// that leaves it unanswered for [`CALL_TIMEOUT`] is taken as hung ([`Link::check_hang`]).
    fn call_later(&self, make: impl FnOnce(u64) -> Request, done: Box<dyn FnOnce(Result<Reply, TaskError>) + Send>) {
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        {
            let mut requests = self.requests.lock().unwrap_or_else(|e| e.into_inner());
            if !self.alive() {
                drop(requests);
                done(Err(TaskError::DeviceLost));
                return;
            }
            self.first_waiting(&requests);
            requests.insert(
                id,
                Waiter::Later {
                    since: Instant::now(),
                    done,
                },
            );
        }
        // On failure `fail` answered it (it was in `requests`).
        let _ = self.send(&make(id));
    }

    /// The host's id for `kernel`, defining it there first if need be.
    fn kernel_id(&self, kernel: &KernelRef) -> Result<u32, TaskError> {
        let key = &**kernel as *const KernelDef as usize;
        let mut kernels = self.kernels.lock().unwrap_or_else(|e| e.into_inner());
        if let Some((id, _)) = kernels.get(&key) {
            return Ok(*id);
        }
        let id = kernels.len() as u32;
        let def = kernel_wire(kernel);
        // Sent under the kernels' lock: no other lane can name the id before the host knows it.
        self.send(&Request::DefineKernel { kernel: id, def })
            .map_err(|()| TaskError::DeviceLost)?;
        kernels.insert(key, (id, kernel.clone()));
        Ok(id)
    }

    /// Sends a job; on a dead host, hands the job's end back to be failed.
    // The error is the job itself, handed back on a rare path: boxing it would cost every job.
    #[allow(clippy::result_large_err)]
    fn submit(&self, submit: Request, pending: PendingJob) -> Result<(), PendingJob> {
        let Request::Submit(Submit { job, .. }) = &submit else {
            return Err(pending);
        };
        let job = *job;
        {
            let mut jobs = self.jobs.lock().unwrap_or_else(|e| e.into_inner());
            if !self.alive() {
                return Err(pending);
            }
            if jobs.is_empty() {
                *self.progress.lock().unwrap_or_else(|e| e.into_inner()) = Instant::now();
            }
            pending.lane.add();
            jobs.insert(job, pending);
        }
        // On failure `fail` already finished it (it was in `jobs`).
        let _ = self.send(&submit);
        Ok(())
    }

    /// The reader thread: finishes jobs and answers calls until the host goes.
    fn read(self: Arc<Self>, stream: UnixStream, platform: Weak<Platform>) {
        let mut frames = crate::FrameReader::new();
        let why = loop {
            let reply = match frames.next::<Reply>(&stream) {
                Ok(reply) => reply,
                Err(e) => break format!("{e}"),
            };
            match reply {
                Reply::Done {
                    job,
                    outcome,
                    cold,
                    started_after_ns,
                    transfers_after_ns,
                } => {
                    let Some(mut pending) = self.jobs.lock().unwrap_or_else(|e| e.into_inner()).remove(&job) else {
                        continue;
                    };
                    *self.progress.lock().unwrap_or_else(|e| e.into_inner()) = Instant::now();
                    let mut result = outcome.result();
                    if result.is_ok() {
                        for staging in &pending.staging {
                            staging.deliver(staging.map.len());
                        }
                        if let Some(work) = pending.after.take() {
                            result = agora_devices::run_host_work(&work).unwrap_or(Err(TaskError::KernelFault));
                        }
                    }
                    if cold {
                        pending.end.mark_cold();
                    }
                    // The host's times, on the daemon's clock from when the job was sent: a job
                    // that waited behind others there is not timed with their work (the
                    // performance model would learn the queue, not the kernel).
                    pending
                        .end
                        .started_no_earlier_than(pending.sent + Duration::from_nanos(started_after_ns));
                    if let Some(ns) = transfers_after_ns {
                        let _ = pending
                            .end
                            .transfers_marker()
                            .set(pending.sent + Duration::from_nanos(ns));
                    }
                    pending.lane.done();
                    let staging = std::mem::take(&mut pending.staging);
                    pending.end.finish(result);
                    drop(staging);
                }
                Reply::Allocated { request, .. }
                | Reply::ReadDone { request, .. }
                | Reply::Prepared { request, .. } => {
                    // A preparation is answered by a thread of its own, not the message loop.
                    if !matches!(reply, Reply::Prepared { .. }) {
                        *self.answered.lock().unwrap_or_else(|e| e.into_inner()) = Instant::now();
                    }
                    let waiter = self.requests.lock().unwrap_or_else(|e| e.into_inner()).remove(&request);
                    if let Some(waiter) = waiter {
                        waiter.answer(Ok(reply));
                    }
                }
                Reply::Broken { program, .. } => {
                    if let Some(platform) = platform.upgrade() {
                        tracing::warn!(platform = %platform.name, program, "program failed to build in the device host; its kernels go elsewhere");
                        platform
                            .broken
                            .lock()
                            .unwrap_or_else(|e| e.into_inner())
                            .insert(program);
                    }
                }
                Reply::Load {
                    device,
                    utilization_percent,
                    memory_cached,
                } => {
                    if let Some(platform) = platform.upgrade() {
                        platform
                            .loads
                            .lock()
                            .unwrap_or_else(|e| e.into_inner())
                            .insert(device, (utilization_percent, memory_cached));
                    }
                }
                Reply::Exiting => {
                    // Failed from now (`Device::healthy`): a job answered `DeviceLost` next is
                    // replayed. Revived only once the host has gone (`Platform::revive`).
                    if let Some(platform) = platform.upgrade() {
                        if std::ptr::eq(Arc::as_ptr(&platform.link()), Arc::as_ptr(&self)) {
                            platform.up.store(false, Ordering::Release);
                        }
                    }
                }
                Reply::Ready { .. } => {}
            }
        };
        self.fail(&format!("its socket closed ({why})"));
    }

    /// The daemon stops: the host sees its socket end and exits; nothing is reported as failed.
    fn close(&self) {
        self.closing.store(true, Ordering::Release);
        if let Some(stream) = self.writer.lock().unwrap_or_else(|e| e.into_inner()).take() {
            let _ = rustix::net::shutdown(&stream, rustix::net::Shutdown::Both);
        }
        if let Some(mut child) = self.child.lock().unwrap_or_else(|e| e.into_inner()).take() {
            // It exits on the socket's end; a host stuck in its driver is killed after a while.
            let deadline = Instant::now() + Duration::from_secs(2);
            while Instant::now() < deadline {
                if let Ok(Some(_)) = child.try_wait() {
                    return;
                }
                std::thread::sleep(Duration::from_millis(10));
            }
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// The host is gone or useless: kill it, fail everything it had.
    fn fail(&self, why: &str) {
        let jobs = {
            let mut jobs = self.jobs.lock().unwrap_or_else(|e| e.into_inner());
            let was_alive = self.alive.swap(false, Ordering::AcqRel);
            if was_alive {
                if let Some(platform) = self.platform.upgrade() {
                    // Only the platform's current host makes it down (a host that failed while
                    // starting was never its link).
                    if std::ptr::eq(Arc::as_ptr(&platform.link()), self) {
                        platform.up.store(false, Ordering::Release);
                    }
                }
            }
            if was_alive && !self.closing.load(Ordering::Acquire) {
                let status = self
                    .child
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .take()
                    .map(|mut child| {
                        let _ = child.kill();
                        child.wait()
                    });
                let status = match status {
                    Some(Ok(status)) => describe_exit(status),
                    _ => "unknown".into(),
                };
                tracing::error!(
                    "device host failed: {why}; it ended with {status}. Its devices fail their jobs with DeviceLost (replayed elsewhere from host copies) until a new host starts"
                );
                if let Some(platform) = self.platform.upgrade() {
                    *platform.last_failure.lock().unwrap_or_else(|e| e.into_inner()) =
                        Some((Instant::now(), format!("{why}; it ended with {status}")));
                }
            }
            std::mem::take(&mut *jobs)
        };
        *self.writer.lock().unwrap_or_else(|e| e.into_inner()) = None;
        let waiters = std::mem::take(&mut *self.requests.lock().unwrap_or_else(|e| e.into_inner()));
        for (_, waiter) in waiters {
            waiter.answer(Err(TaskError::DeviceLost));
        }
        for (_, pending) in jobs {
            pending.lane.done();
            pending.end.finish(Err(TaskError::DeviceLost));
        }
    }

    /// Kills a host that has jobs waiting and finished none for `hang_timeout`, or left a
    /// request sent with [`Link::call_later`] unanswered for as long as a blocking call waits
    /// while it answered no other (`answered`).
    fn check_hang(&self) {
        if !self.alive() {
            return;
        }
        let limit = self.hang_timeout.min(CALL_TIMEOUT);
        let oldest_late = self
            .requests
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .values()
            .filter_map(|w| match w {
                Waiter::Later { since, .. } => Some(since.elapsed()),
                Waiter::Thread(_) => None,
            })
            .max();
        // Hung: it answered nothing for the limit while a request waited longer, or it left
        // one unanswered for three times the limit however busy it was with others.
        let silent = self.answered.lock().unwrap_or_else(|e| e.into_inner()).elapsed();
        if let Some(waited) = oldest_late.filter(|w| (*w > limit && silent > limit) || *w > 3 * limit) {
            self.fail(&format!(
                "it did not answer a request within {limit:?} (waited {waited:?}; its last answer to any came {silent:?} ago)"
            ));
            return;
        }
        if self.jobs.lock().unwrap_or_else(|e| e.into_inner()).is_empty() {
            return;
        }
        let since = self.progress.lock().unwrap_or_else(|e| e.into_inner()).elapsed();
        if since > self.hang_timeout {
            self.fail(&format!("it finished no job for {since:?} while jobs waited (hung)"));
        }
    }
}

/// `kernel` as the host gets it: the library's by name (the host is the same binary), any
/// other whole.
pub(crate) fn kernel_wire(kernel: &KernelDef) -> KernelWire {
    let library = agora_kernels::find(&kernel.name).is_some_and(|(_, def)| std::ptr::eq(def, kernel));
    KernelWire {
        name: kernel.name.to_string(),
        params: kernel.params.iter().map(|p| (p.name.to_string(), p.kind)).collect(),
        chunkable: kernel.chunkable,
        library,
        opencl: kernel.opencl.as_ref().map(|imp| OpenClWire {
            program: imp.program.to_string(),
            source: imp.source.to_string(),
            entry: imp.entry.to_string(),
            local: imp.local,
            binaries: imp
                .binaries
                .iter()
                .map(|b| (b.device.to_string(), b.bytes.to_vec()))
                .collect(),
        }),
        cuda: kernel.cuda.as_ref().map(|imp| CudaWire {
            program: imp.program.to_string(),
            ptx: matches!(imp.code, agora_kernels::CudaCode::Ptx(_)),
            code: imp.code.text().to_string(),
            entry: imp.entry.to_string(),
            guarded: imp.guarded,
        }),
    }
}

fn describe_exit(status: std::process::ExitStatus) -> String {
    use std::os::unix::process::ExitStatusExt;
    match (status.code(), status.signal()) {
        (Some(crate::host::FAULT_EXIT_CODE), _) => format!(
            "exit code {}: a kernel fault made its device unusable (the task that met it failed)",
            crate::host::FAULT_EXIT_CODE
        ),
        (Some(code), _) => format!("exit code {code}"),
        (None, Some(signal)) => format!("signal {signal}"),
        _ => status.to_string(),
    }
}

/// The platform's watch thread: forwards revocation flags to the host (polling every 100 µs
/// while a revocable job runs there) and checks for hangs once a second.
fn watch(platform: Weak<Platform>) {
    let mut last_hang_check = Instant::now();
    // The time the last round spent on the host (sending, checking): not a stall of the
    // daemon's, however long a busy host made it.
    let mut working = Duration::ZERO;
    loop {
        let Some(p) = platform.upgrade() else { return };
        let mut watched = p.watched.lock().unwrap_or_else(|e| e.into_inner());
        if watched.is_empty() {
            watched = p
                .watch_wake
                .wait_timeout(watched, Duration::from_secs(1))
                .unwrap_or_else(|e| e.into_inner())
                .0;
        }
        let mut revoke = Vec::new();
        watched.retain(|(job, flag, link)| {
            let Some(link) = link.upgrade().filter(|l| l.alive()) else {
                return false;
            };
            if !link.jobs.lock().unwrap_or_else(|e| e.into_inner()).contains_key(job) {
                return false;
            }
            if flag.load(Ordering::Acquire) {
                revoke.push((*job, link));
                return false;
            }
            true
        });
        let busy = !watched.is_empty();
        drop(watched);
        let link = p.link();
        link.tick(std::mem::take(&mut working));
        let began = Instant::now();
        for (job, link) in revoke {
            let _ = link.send(&Request::Revoke { job });
        }
        link.flush();
        drop(link);
        if last_hang_check.elapsed() >= Duration::from_secs(1) {
            last_hang_check = Instant::now();
            p.link().check_hang();
        }
        working = began.elapsed();
        drop(p);
        if busy {
            std::thread::sleep(Duration::from_micros(100));
        }
    }
}

/// The buffer an allocation's `reply` made, its `len` bytes already counted in `memory_used`
/// (given back when it was refused).
fn allocated(
    reply: Result<Reply, TaskError>,
    id: u64,
    len: u64,
    device: u16,
    link: &Arc<Link>,
    memory_used: &Arc<AtomicU64>,
) -> Result<Arc<dyn DeviceBuffer>, TaskError> {
    let result = match reply {
        Ok(Reply::Allocated { outcome, .. }) => outcome.result(),
        Ok(_) => Err(link_bug(LINK_WRONG_REPLY, "an allocation answered with another reply")),
        Err(e) => Err(e),
    };
    match result {
        Ok(()) => Ok(Arc::new(RemoteBuffer {
            id,
            len,
            device,
            link: Arc::downgrade(link),
            memory_used: memory_used.clone(),
        })),
        Err(e) => {
            memory_used.fetch_sub(len, Ordering::Relaxed);
            Err(e)
        }
    }
}

/// A buffer in a host's device memory.
#[derive(Debug)]
pub(crate) struct RemoteBuffer {
    id: u64,
    len: u64,
    device: u16,
    link: Weak<Link>,
    memory_used: Arc<AtomicU64>,
}

impl std::fmt::Debug for Link {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Link")
            .field("alive", &self.alive())
            .finish_non_exhaustive()
    }
}

impl DeviceBuffer for RemoteBuffer {
    fn len(&self) -> u64 {
        self.len
    }
    fn as_any(&self) -> &dyn std::any::Any {
        self
    }
}

impl Drop for RemoteBuffer {
    fn drop(&mut self) {
        self.memory_used.fetch_sub(self.len, Ordering::Relaxed);
        if let Some(link) = self.link.upgrade() {
            link.send_later(Request::Free {
                device: self.device,
                buffer: self.id,
            });
        }
    }
}

/// A device served by a device-host process: an OpenCL device, a GPU, or (in tests) a sim.
pub struct RemoteDevice {
    platform: Arc<Platform>,
    index: u16,
    info: DeviceInfo,
    polls_revocation: bool,
    runs_tenant_programs: bool,
    wants_page_locked: bool,
    min_items_per_slice: u64,
    lanes: Lanes,
    memory_used: Arc<AtomicU64>,
    next_buffer: AtomicU64,
}

impl std::fmt::Debug for RemoteDevice {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RemoteDevice")
            .field("name", &self.info.name)
            .finish_non_exhaustive()
    }
}

impl RemoteDevice {
    fn new(platform: Arc<Platform>, index: u16, name: String, wire: DeviceWire) -> Result<Self, String> {
        let l = wire.limits;
        let limits = LaunchLimits {
            max_items: l[0],
            max_extent: [l[1], l[2], l[3]],
            max_items_per_enqueue: l[4],
            max_groups_per_enqueue: l[5],
            max_group: [l[6], l[7], l[8]],
            max_group_items: l[9],
            max_buffer_bytes: l[10],
        };
        let mut lanes = Vec::new();
        let mut threads = Vec::new();
        for lane in 0..wire.lanes {
            let executor = RemoteExecutor {
                platform: platform.clone(),
                device: index,
                lane,
                count: Arc::default(),
                next_job: Arc::new(AtomicU64::new(0)),
                forwards_urgency: wire.kind == DeviceKind::Cuda,
            };
            // The lane only forwards jobs; while idle on a small machine it sleeps at once, so
            // the host's threads and the link's readers have the cores ([`crate::readers_spin`];
            // measured in docs/PERFORMANCE.md, "Device hosts: the hop").
            let (started, thread) = Lane::start_with(
                format!("agora-{name}-lane{lane}"),
                Box::new(executor),
                LaneClass::new(&platform.spec.priorities),
                crate::readers_spin(),
            )
            .map_err(|e| e.to_string())?;
            started.set_starts_on_caller(daemon_starts_on_caller());
            lanes.push(started);
            threads.push(thread);
        }
        Ok(RemoteDevice {
            info: DeviceInfo {
                name,
                kind: wire.kind,
                description: format!("{} (device host)", wire.description),
                memory_bytes: wire.memory_bytes,
                lanes: wire.lanes as usize,
                threads_per_lane: 1,
                shares_host_memory: false,
                limits,
                host_cores_per_lane: wire.host_cores_per_lane as usize,
            },
            polls_revocation: wire.polls_revocation,
            runs_tenant_programs: wire.runs_tenant_programs,
            wants_page_locked: wire.wants_page_locked,
            min_items_per_slice: wire.min_items_per_slice.max(1),
            platform,
            index,
            lanes: Lanes::new(lanes, threads),
            memory_used: Arc::default(),
            next_buffer: AtomicU64::new(1),
        })
    }

    /// The host process's pid now (None while it is down).
    pub fn host_pid(&self) -> Option<u32> {
        let link = self.platform.link();
        let child = link.child.lock().unwrap_or_else(|e| e.into_inner());
        child.as_ref().map(Child::id)
    }

    /// Times the platform's host was restarted.
    pub fn host_restarts(&self) -> u64 {
        self.platform.restarts.load(Ordering::Relaxed)
    }

    fn own<'a>(&self, buffer: &'a dyn DeviceBuffer, link: &Arc<Link>) -> Result<&'a RemoteBuffer, TaskError> {
        own_buffer(buffer, link, self.index)
    }

    fn broken(&self, program: &str) -> bool {
        self.platform
            .broken
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .contains(program)
    }
}

/// The error for a request the link cannot follow (a bug of this side or the host's), logged
/// for the report: never `KernelFault`, which would blame the task's kernel.
fn link_bug(place: u16, what: &str) -> TaskError {
    tracing::error!(
        place,
        what,
        "internal error on the device-host link: a bug of the daemon; please report it with this line"
    );
    TaskError::Internal(place)
}

/// Whether memory behind `fd` may be mapped writable by another process: not once it is sealed
/// against new writable mappings (`F_SEAL_FUTURE_WRITE`, a read-only export's region) or
/// against writes. A descriptor whose seals cannot be read (not a memfd) is taken as writable:
/// the sessions' segments, the only such memory, are never sealed against writing.
fn writable(fd: BorrowedFd<'_>) -> bool {
    rustix::fs::fcntl_get_seals(fd).map_or(true, |seals| {
        !seals.intersects(rustix::fs::SealFlags::WRITE | rustix::fs::SealFlags::FUTURE_WRITE)
    })
}

/// The error for a staging segment the daemon could not make (`errno` from `what`): the daemon
/// out of descriptors or memory, a transient `ResourceExhausted` for the task to try again, never
/// `KernelFault`, which would blame its kernel.
fn staging_error(len: usize, what: &str, errno: i32) -> TaskError {
    let resource = match errno {
        libc::EMFILE | libc::ENFILE => agora_protocol::Resource::FileDescriptors,
        _ => agora_protocol::Resource::Memory,
    };
    tracing::warn!(
        len,
        errno,
        "staging host memory for the device host: {what} failed: {}; transient, try the task again",
        std::io::Error::from_raw_os_error(errno)
    );
    TaskError::ResourceExhausted {
        resource: resource.code(),
        retry_ms: 0,
    }
}

/// Whether `buffer` is a buffer of `device` on this `link`. A check, not a claim: a job's
/// transfer out of another device's buffer is a read from that device, not a bug, so nothing is
/// logged (`own_buffer` on such a buffer logged one as a link bug of the daemon).
fn is_own(buffer: &dyn DeviceBuffer, link: &Arc<Link>, device: u16) -> bool {
    buffer
        .as_any()
        .downcast_ref::<RemoteBuffer>()
        .is_some_and(|remote| std::ptr::eq(remote.link.as_ptr(), Arc::as_ptr(link)) && remote.device == device)
}

fn own_buffer<'a>(buffer: &'a dyn DeviceBuffer, link: &Arc<Link>, device: u16) -> Result<&'a RemoteBuffer, TaskError> {
    let remote = buffer
        .as_any()
        .downcast_ref::<RemoteBuffer>()
        .ok_or_else(|| link_bug(LINK_FOREIGN_BUFFER, "a buffer of another kind of device"))?;
    if !std::ptr::eq(remote.link.as_ptr(), Arc::as_ptr(link)) {
        // A buffer of a host that died: its bytes died with it.
        return Err(TaskError::DeviceLost);
    }
    if remote.device != device {
        return Err(link_bug(LINK_FOREIGN_BUFFER, "a buffer of another device of the host"));
    }
    Ok(remote)
}

impl Device for RemoteDevice {
    fn info(&self) -> &DeviceInfo {
        &self.info
    }

    fn implements(&self, kernel: &KernelDef) -> bool {
        match self.info.kind {
            // As `CudaDevice::implements`: a tenant's program only where it runs fenced.
            #[cfg(feature = "cuda")]
            DeviceKind::Cuda => agora_devices::cuda::programs::KernelCode::of(kernel).is_some_and(|code| {
                (!agora_kernels::is_tenant_program(code.program()) || self.runs_tenant_programs)
                    && !self.broken(code.program())
            }),
            // A sim computes with the library's CPU code, which only the library's kernels
            // bring to the host.
            DeviceKind::Sim => {
                matches!(kernel.cpu, Some(agora_kernels::CpuImpl::Builtin(_)))
                    && agora_kernels::find(&kernel.name).is_some_and(|(_, def)| std::ptr::eq(def, kernel))
            }
            _ => match &kernel.opencl {
                // Tenant programs not allowed in the daemon stay off OpenCL devices here too: the
                // host process holds every tenant's segment, so it contains crashes, not tenants.
                Some(imp) => !agora_kernels::runs_only_fenced(&imp.program) && !self.broken(&imp.program),
                None => false,
            },
        }
    }

    fn prepare(&self, kernel: &KernelDef) -> Option<Result<(), String>> {
        if self.info.kind != DeviceKind::Cuda || !self.implements(kernel) {
            // OpenCL devices build at the first launch (their build log fails that task).
            return None;
        }
        let reply = self
            .platform
            .link()
            .call_within(PREPARE_TIMEOUT, |request| Request::Prepare {
                request,
                device: self.index,
                def: kernel_wire(kernel),
            });
        match reply {
            Ok(Reply::Prepared { outcome, .. }) => outcome,
            Ok(_) => Some(Err("the device host answered something else".into())),
            Err(e) => Some(Err(format!("the device host of {}: {e}", self.info.name))),
        }
    }

    fn tenant_ended(&self, tenant: u64) {
        if self.info.kind == DeviceKind::Cuda {
            self.platform.link().send_later(Request::TenantEnded { tenant });
        }
    }

    fn submit(&self, lane: usize, job: Job) {
        self.lanes.submit(lane, job);
    }

    fn lane_load(&self, lane: usize) -> usize {
        self.lanes.load(lane)
    }

    fn run_inline(&self, _work: &Work) -> Result<(), TaskError> {
        // Never called: this device does not share host memory.
        Err(TaskError::KernelFault)
    }

    fn alloc(&self, tenant: u64, len: u64) -> Option<Result<Arc<dyn DeviceBuffer>, TaskError>> {
        let link = self.platform.link();
        let id = self.next_buffer.fetch_add(1, Ordering::Relaxed);
        let reply = link.call(|request| Request::Alloc {
            request,
            device: self.index,
            buffer: id,
            tenant,
            len,
        });
        // Counted before the answer, as `alloc_later` does; given back below if refused.
        self.memory_used.fetch_add(len, Ordering::Relaxed);
        Some(allocated(reply, id, len, self.index, &link, &self.memory_used))
    }

    fn allocates_far(&self) -> bool {
        true
    }

    fn alloc_later(&self, tenant: u64, len: u64, done: agora_devices::AllocationDone) {
        let link = self.platform.link();
        let id = self.next_buffer.fetch_add(1, Ordering::Relaxed);
        self.memory_used.fetch_add(len, Ordering::Relaxed);
        let (device, memory_used, weak) = (self.index, self.memory_used.clone(), Arc::downgrade(&link));
        link.call_later(
            |request| Request::Alloc {
                request,
                device: self.index,
                buffer: id,
                tenant,
                len,
            },
            Box::new(move |reply| {
                let result = match weak.upgrade() {
                    Some(link) => allocated(reply, id, len, device, &link, &memory_used),
                    None => {
                        memory_used.fetch_sub(len, Ordering::Relaxed);
                        Err(TaskError::DeviceLost)
                    }
                };
                done(result)
            }),
        );
    }

    unsafe fn read(&self, from: &dyn DeviceBuffer, host: *mut u8, len: usize) -> Result<(), TaskError> {
        let link = self.platform.link();
        let buffer = self.own(from, &link)?;
        let (target, staging) = match self.platform.segment_of(host, len, true) {
            Some(segment) => (segment, None),
            None => {
                let (target, staging) = Staging::new(&self.platform, &link, host, len, false)?;
                (target, Some(staging))
            }
        };
        let reply = link.call(|request| Request::Read {
            request,
            device: self.index,
            buffer: buffer.id,
            host: target,
            len: len as u64,
        })?;
        let Reply::ReadDone { outcome, .. } = reply else {
            return Err(link_bug(LINK_WRONG_REPLY, "a read answered with another reply"));
        };
        outcome.result()?;
        if let Some(staging) = staging {
            staging.deliver(len);
        }
        Ok(())
    }

    unsafe fn read_later(
        &self,
        from: &dyn DeviceBuffer,
        host: *mut u8,
        len: usize,
        done: agora_devices::ReadDone,
    ) -> bool {
        let link = self.platform.link();
        let Ok(buffer) = self.own(from, &link) else {
            return false;
        };
        // Host memory outside the segments (an exportable buffer's region) is read into a
        // staging segment, copied to `host` on the reader thread once the host has answered:
        // reading it synchronously would hold the dispatcher for the host's whole answer.
        let (target, staging) = match self.platform.segment_of(host, len, true) {
            Some(segment) => (segment, None),
            None => match Staging::new(&self.platform, &link, host, len, false) {
                Ok((target, staging)) => (target, Some(staging)),
                Err(_) => return false,
            },
        };
        let buffer = buffer.id;
        link.call_later(
            |request| Request::Read {
                request,
                device: self.index,
                buffer,
                host: target,
                len: len as u64,
            },
            Box::new(move |reply| {
                let result = match reply {
                    Ok(Reply::ReadDone { outcome, .. }) => outcome.result(),
                    Ok(_) => Err(link_bug(LINK_WRONG_REPLY, "a read answered with another reply")),
                    Err(e) => Err(e),
                };
                if let (Ok(()), Some(staging)) = (&result, &staging) {
                    // Before `done`: the caller keeps `host` valid until then.
                    staging.deliver(len);
                }
                drop(staging);
                done(result)
            }),
        );
        true
    }

    fn runs_row_slices(&self) -> bool {
        true
    }

    fn slices(&self, kernel: &KernelDef) -> bool {
        match self.info.kind {
            #[cfg(feature = "cuda")]
            DeviceKind::Cuda => agora_devices::cuda::slices(kernel),
            _ => kernel.chunkable,
        }
    }

    fn min_items_per_slice(&self) -> u64 {
        self.min_items_per_slice
    }

    fn wants_pinned_host_memory(&self) -> bool {
        self.wants_page_locked
    }

    fn check_launch(&self, kernel: &KernelDef, range: &[u64], buffer_lens: &[u64]) -> Result<u64, TaskError> {
        match self.info.kind {
            #[cfg(feature = "cuda")]
            DeviceKind::Cuda => {
                return agora_devices::cuda::check_launch(&self.info.limits, kernel, range, buffer_lens)
            }
            DeviceKind::Sim => return self.info.limits.check(range, [1; 3], buffer_lens, kernel.chunkable),
            _ => {}
        }
        let local = kernel.opencl.as_ref().map_or([1; 3], |imp| {
            agora_devices::opencl::fixed_work_group(range.len().clamp(1, 3), imp.local)
        });
        self.info
            .limits
            .check(range, local.map(|l| l as u64), buffer_lens, kernel.chunkable)
    }

    fn row_alignment(&self, kernel: &KernelDef, dims: usize) -> u64 {
        match self.info.kind {
            #[cfg(feature = "cuda")]
            DeviceKind::Cuda => return agora_devices::cuda::row_alignment(kernel, dims),
            DeviceKind::Sim => return 1,
            _ => {}
        }
        kernel.opencl.as_ref().map_or(1, |imp| {
            agora_devices::opencl::fixed_work_group(dims.clamp(1, 3), imp.local)[0].max(1) as u64
        })
    }

    fn polls_revocation(&self) -> bool {
        self.polls_revocation
    }

    fn memory_used(&self) -> u64 {
        self.memory_used.load(Ordering::Relaxed)
    }

    fn healthy(&self) -> bool {
        self.platform.up.load(Ordering::Acquire)
    }

    fn maps_host_memory(&self) -> bool {
        true
    }

    fn register_host_memory(
        &self,
        base: *mut u8,
        len: usize,
        fd: BorrowedFd<'_>,
        page_lock: bool,
    ) -> Option<Result<Box<dyn std::any::Any + Send + Sync>, String>> {
        Some(
            self.platform
                .register(base, len, fd, page_lock && self.wants_page_locked)
                .map(|guard| Box::new(guard) as Box<dyn std::any::Any + Send + Sync>),
        )
    }

    fn revive(&self) -> bool {
        // Jobs queued before the crash must all have failed first: none may reach the new host.
        if (0..self.lanes.len()).any(|lane| self.lanes.load(lane) > 0) {
            return false;
        }
        self.platform.revive()
    }

    fn status(&self) -> DeviceReport {
        // What an operator looking at `agora status` wants of a host: which process it is now
        // and how often it had to be replaced.
        let host = match self.host_pid() {
            Some(pid) => format!("host pid {pid}"),
            None => "host down".to_string(),
        };
        let failure = match &*self.platform.last_failure.lock().unwrap_or_else(|e| e.into_inner()) {
            Some((at, why)) => format!("; last failure {} s ago: {why}", at.elapsed().as_secs()),
            None => String::new(),
        };
        let (utilization_percent, memory_cached) = self
            .platform
            .loads
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .get(&self.index)
            .copied()
            .unwrap_or((None, 0));
        DeviceReport {
            name: self.info.name.clone(),
            kind: self.info.kind,
            description: format!(
                "{}: {host}, restarted {} time(s){failure}",
                self.info.description,
                self.host_restarts()
            ),
            memory_bytes: self.info.memory_bytes,
            memory_used: self.memory_used(),
            memory_cached,
            utilization_percent,
            threads_per_lane: 1,
            lanes: self.lanes.statuses(),
            failed: !self.healthy(),
            staged_bytes: self.platform.staged_bytes.load(Ordering::Relaxed),
        }
    }

    fn shutdown(&self) {
        self.lanes.shutdown();
        self.platform.link().close();
    }
}

impl Drop for RemoteDevice {
    fn drop(&mut self) {
        self.shutdown();
    }
}

/// A daemon lane's executor: forwards each job to the host.
struct RemoteExecutor {
    platform: Arc<Platform>,
    device: u16,
    lane: u32,
    count: Arc<LaneCount>,
    next_job: Arc<AtomicU64>,
    /// Whether the host is told which jobs are urgent: a GPU runs them on its lanes'
    /// high-priority streams. Elsewhere the daemon's lane has done all that urgency does (and a
    /// job marked urgent would go through the host lane's thread, a wake-up more).
    forwards_urgency: bool,
}

impl RemoteExecutor {
    /// Host memory as the host names it; memory outside every segment goes through a staging
    /// segment, after the lane's earlier jobs are done (they might still write it).
    fn host_ref(
        &self,
        link: &Arc<Link>,
        ptr: *mut u8,
        len: usize,
        source: bool,
        drained: &mut bool,
        staging: &mut Vec<Staging>,
    ) -> Result<HostRef, TaskError> {
        if let Some(segment) = self.platform.segment_of(ptr, len, !source) {
            return Ok(segment);
        }
        if !*drained {
            self.count.wait_idle();
            *drained = true;
        }
        let (host, staged) = Staging::new(&self.platform, link, ptr, len, source)?;
        staging.push(staged);
        Ok(host)
    }

    fn forward(&self, transfers: Vec<Transfer>, work: Work, end: JobEnd) -> Result<(), Unsent> {
        let link = self.platform.link();
        if !link.alive() {
            return Err(Box::new((end, TaskError::DeviceLost)));
        }
        let mut drained = false;
        let mut staging = Vec::new();
        let mut wire_transfers = Vec::with_capacity(transfers.len());
        // Reads from other devices' buffers happen here, first, with this lane idle: the host
        // cannot reach them. A plan never has this job move those bytes before it reads them.
        for transfer in &transfers {
            if let Transfer::ToHost {
                from,
                device,
                host,
                len,
            } = transfer
            {
                if !is_own(from.as_ref(), &link, self.device) {
                    if !drained {
                        self.count.wait_idle();
                        drained = true;
                    }
                    // SAFETY: `host` is the buffer's host copy, valid for `len` bytes until the
                    // job finishes.
                    if let Err(e) = unsafe { device.read(from.as_ref(), *host, *len) } {
                        return Err(Box::new((end, e)));
                    }
                }
            }
        }
        let result = (|| {
            for transfer in &transfers {
                match transfer {
                    Transfer::ToDevice { host, len, to } => wire_transfers.push(TransferWire::ToDevice {
                        host: self.host_ref(&link, *host as *mut u8, *len, true, &mut drained, &mut staging)?,
                        len: *len as u64,
                        buffer: own_buffer(to.as_ref(), &link, self.device)?.id,
                    }),
                    Transfer::ToHost { from, host, len, .. } => {
                        // Another device's buffer was read above.
                        if !is_own(from.as_ref(), &link, self.device) {
                            continue;
                        }
                        let buffer = own_buffer(from.as_ref(), &link, self.device)?;
                        let target = self.host_ref(&link, *host, *len, false, &mut drained, &mut staging)?;
                        wire_transfers.push(TransferWire::ToHost {
                            buffer: buffer.id,
                            host: target,
                            len: *len as u64,
                        });
                    }
                }
            }
            Ok::<_, TaskError>(())
        })();
        if let Err(e) = result {
            return Err(Box::new((end, e)));
        }
        let work = match &work {
            Work::Nothing => WorkWire::Nothing,
            Work::Fill { ptr, len, value } => match self.platform.segment_of(*ptr, *len, true) {
                Some(host) => WorkWire::Fill {
                    host,
                    len: *len as u64,
                    value: *value,
                },
                None => return self.on_host(&work, wire_transfers, staging, end, &link),
            },
            Work::Copy { src, dst, len } => {
                match (
                    self.platform.segment_of(*src, *len, false),
                    self.platform.segment_of(*dst, *len, true),
                ) {
                    (Some(src), Some(dst)) => WorkWire::Copy {
                        src,
                        dst,
                        len: *len as u64,
                    },
                    _ => return self.on_host(&work, wire_transfers, staging, end, &link),
                }
            }
            Work::Launch {
                kernel,
                range,
                dims,
                args,
                arg_count,
                device_args,
                rows,
            } => {
                let id = match link.kernel_id(kernel) {
                    Ok(id) => id,
                    Err(e) => return Err(Box::new((end, e))),
                };
                let mut wire_args = Vec::with_capacity(*arg_count);
                for index in 0..*arg_count {
                    wire_args.push(match (&args[index], &device_args[index]) {
                        (_, Some(buffer)) => match own_buffer(buffer.as_ref(), &link, self.device) {
                            Ok(b) => ArgWire::Buffer {
                                buffer: b.id,
                                len: b.len,
                            },
                            Err(e) => return Err(Box::new((end, e))),
                        },
                        (ArgValue::Scalar(bits), None) => ArgWire::Scalar(*bits),
                        _ => ArgWire::None,
                    });
                }
                WorkWire::Launch {
                    kernel: id,
                    range: *range,
                    dims: *dims as u8,
                    args: wire_args,
                    rows: rows.as_ref().map(|r| (r.start, r.end)),
                }
            }
        };
        self.send(wire_transfers, work, staging, end, &link, None)
    }

    /// Host work on memory outside every segment (an exported buffer's region): the host moves
    /// the job's data (a job of transfers only), then the work runs here when it is done; later
    /// jobs of the lane wait for it, as they wait for host work on any OpenCL lane.
    fn on_host(
        &self,
        work: &Work,
        transfers: Vec<TransferWire>,
        staging: Vec<Staging>,
        end: JobEnd,
        link: &Arc<Link>,
    ) -> Result<(), Unsent> {
        self.count.wait_idle();
        if transfers.is_empty() && staging.is_empty() {
            let result = agora_devices::run_host_work(work).unwrap_or(Err(TaskError::KernelFault));
            end.finish(result);
            return Ok(());
        }
        self.send(transfers, WorkWire::Nothing, staging, end, link, Some(work.clone()))?;
        self.count.wait_idle();
        Ok(())
    }

    /// Sends a job to the host; `after`: host work to run here once the host is done with it.
    fn send(
        &self,
        transfers: Vec<TransferWire>,
        work: WorkWire,
        staging: Vec<Staging>,
        end: JobEnd,
        link: &Arc<Link>,
        after: Option<Work>,
    ) -> Result<(), Unsent> {
        let job = (self.next_job.fetch_add(1, Ordering::Relaxed) << 24)
            | (u64::from(self.device) << 12)
            | u64::from(self.lane);
        let revocable = end.revoke_flag().cloned();
        let submit = Request::Submit(Submit {
            job,
            device: self.device,
            lane: self.lane,
            transfers,
            work,
            revocable: revocable.is_some(),
            urgent: self.forwards_urgency && end.urgent(),
        });
        if let Some(flag) = revocable {
            let mut watched = self.platform.watched.lock().unwrap_or_else(|e| e.into_inner());
            watched.push((job, flag, Arc::downgrade(link)));
            self.platform.watch_wake.notify_one();
        }
        let pending = PendingJob {
            end,
            staging,
            lane: self.count.clone(),
            sent: Instant::now(),
            after,
        };
        link.submit(submit, pending)
            .map_err(|pending| Box::new((pending.end, TaskError::DeviceLost)))
    }
}

/// A job an executor could not forward to its host, handed back with why. Boxed: a [`JobEnd`]
/// is large and a failed forward rare, so the common path moves a pointer's worth of error.
type Unsent = Box<(JobEnd, TaskError)>;

impl Executor for RemoteExecutor {
    fn run(&mut self, transfers: Vec<Transfer>, work: Work, end: JobEnd) {
        if let Err(unsent) = self.forward(transfers, work, end) {
            let (end, e) = *unsent;
            end.finish(Err(e));
        }
    }

    /// Whether forwarding the job waits for nothing: every byte it names is in a segment the
    /// host maps (no staging after earlier jobs, no read from another device), and the host is
    /// not so far behind that its socket could be full (a send would then block the caller,
    /// the dispatcher).
    fn starts_at_once(&self, transfers: &[Transfer], work: &Work) -> bool {
        let link = self.platform.link();
        // A dead host fails the job: on the lane's thread, not inside the caller's submit.
        if !link.alive() || *self.count.count.lock().unwrap_or_else(|e| e.into_inner()) >= CALLER_START_MAX_IN_FLIGHT {
            return false;
        }
        let mapped = |ptr: *const u8, len: usize, write: bool| self.platform.segment_of(ptr, len, write).is_some();
        transfers.iter().all(|transfer| match transfer {
            Transfer::ToDevice { host, len, .. } => mapped(*host, *len, false),
            Transfer::ToHost { from, host, len, .. } => {
                is_own(from.as_ref(), &link, self.device) && mapped(*host, *len, true)
            }
        }) && match work {
            Work::Fill { ptr, len, .. } => mapped(*ptr, *len, true),
            Work::Copy { src, dst, len } => mapped(*src, *len, false) && mapped(*dst, *len, true),
            Work::Launch { .. } | Work::Nothing => true,
        }
    }
}

/// Most jobs the host has not finished for a lane whose next job the caller may still start
/// itself ([`RemoteExecutor::starts_at_once`]): a socket holds hundreds of small frames, so
/// below this a send never waits for the host to read.
const CALLER_START_MAX_IN_FLIGHT: usize = 32;

/// Whether the daemon's dispatcher sends an idle host lane's job itself rather than waking the
/// lane's thread to send it (one wake-up less per small task; docs/PERFORMANCE.md, "Device
/// hosts: the hop"). `AGORA_DEVICE_HOST_DAEMON_START_ON_CALLER=0` turns it off, for comparison
/// (`AGORA_DEVICE_HOST_START_ON_CALLER=0` does the same on the host's side).
fn daemon_starts_on_caller() -> bool {
    std::env::var_os("AGORA_DEVICE_HOST_DAEMON_START_ON_CALLER").is_none_or(|v| v != "0")
}

#[cfg(test)]
mod tests {
    //! The daemon's side of a device in a host, without a host (a dead link): what it decides
    //! itself from the host's description of the device.
    use super::*;
    use agora_kernels::{Cost, CudaCode, CudaImpl, Param, SizeCheck};

    fn platform() -> Arc<Platform> {
        // Never started: its link stays the dead one.
        Arc::new(Platform::new(
            "test",
            HostSpec {
                program: "/nonexistent/agora".into(),
                lanes: 1,
                memory_limit: 0,
                start_timeout: Duration::from_secs(1),
                hang_timeout: Duration::from_secs(1),
                priorities: LanePriorities::normal(),
                extra_args: Vec::new(),
            },
        ))
    }

    /// What an H100's host says of its GPU (`describe` of a `CudaDevice`).
    fn gpu_wire(runs_tenant_programs: bool) -> DeviceWire {
        DeviceWire {
            kind: DeviceKind::Cuda,
            description: "NVIDIA H100".into(),
            memory_bytes: 80 << 30,
            lanes: 1,
            polls_revocation: false,
            runs_tenant_programs,
            wants_page_locked: true,
            min_items_per_slice: 270_336,
            limits: [
                u64::MAX,
                u64::MAX,
                u64::MAX,
                u64::MAX,
                agora_devices::cuda::MAX_ITEMS_PER_ENQUEUE,
                u64::MAX,
                1024,
                1024,
                64,
                1024,
                u64::MAX,
            ],
            host_cores_per_lane: 0,
        }
    }

    fn tenant_kernel() -> KernelDef {
        fn any(_: &agora_kernels::LaunchShape<'_>) -> Result<(), TaskError> {
            Ok(())
        }
        KernelDef {
            name: "tenant.scale".into(),
            doc: "".into(),
            params: vec![Param {
                name: "x".into(),
                kind: agora_protocol::ParamKind::Scalar(agora_protocol::ScalarType::F32),
            }]
            .into(),
            cost: Cost::PerItemNs(1.0),
            chunkable: true,
            check: SizeCheck::Builtin(any),
            cpu: None,
            opencl: None,
            cuda: Some(CudaImpl {
                program: "tenant-fenced/0123".into(),
                code: CudaCode::Ptx(".version 8.0".into()),
                entry: "scale".into(),
                guarded: false,
            }),
        }
    }

    #[test]
    fn a_gpu_in_a_host_is_judged_in_the_daemon_as_the_cuda_backend_judges_it() {
        let gpu = RemoteDevice::new(platform(), 0, "cuda0".into(), gpu_wire(true)).unwrap();
        assert_eq!(gpu.info().kind, DeviceKind::Cuda);
        let tenant = tenant_kernel();
        let (_, saxpy) = agora_kernels::find("saxpy").unwrap();
        // Library kernels (their OpenCL C, compiled as CUDA C) and fenced tenant programs run.
        assert!(gpu.implements(saxpy) && gpu.implements(&tenant));
        let unfenced = RemoteDevice::new(platform(), 0, "cuda1".into(), gpu_wire(false)).unwrap();
        assert!(
            !unfenced.implements(&tenant),
            "a GPU without partitions runs no tenant code"
        );
        // A plain (tenant) kernel is never sliced on a GPU, however chunkable its manifest says
        // it is; the library's guarded kernels are.
        assert!(!gpu.slices(&tenant) && gpu.slices(saxpy));
        // Launch limits and alignment: the backend's own functions over the host's limits.
        for range in [vec![1u64 << 20], vec![1 << 34], vec![1 << 16, 1 << 20]] {
            let lens = vec![0u64; saxpy.params.len()];
            assert_eq!(
                gpu.check_launch(saxpy, &range, &lens),
                agora_devices::cuda::check_launch(&gpu.info().limits, saxpy, &range, &lens),
                "{range:?}"
            );
        }
        assert_eq!(
            gpu.row_alignment(saxpy, 1),
            agora_devices::cuda::row_alignment(saxpy, 1)
        );
        assert!(
            gpu.check_launch(saxpy, &[1 << 34], &[0, 0, 0]).unwrap() >= 4,
            "beyond one enqueue: sliced"
        );
        assert_eq!(gpu.min_items_per_slice(), 270_336);
        assert!(gpu.wants_pinned_host_memory() && gpu.maps_host_memory());
        // With its host down, preparing a program answers at once (no wait for a reply).
        let started = Instant::now();
        assert!(matches!(gpu.prepare(&tenant), Some(Err(_))));
        assert!(started.elapsed() < Duration::from_secs(1));
    }

    /// A staging segment the daemon cannot make is its own transient shortage, never the
    /// kernel's fault: the task may be tried again.
    #[test]
    fn a_staging_segment_that_cannot_be_made_is_a_transient_resource_error() {
        use agora_protocol::Resource;
        let resource = |errno| match staging_error(4096, "memfd_create", errno) {
            TaskError::ResourceExhausted { resource, .. } => Resource::from_code(resource),
            other => panic!("{other:?}"),
        };
        assert_eq!(resource(libc::EMFILE), Resource::FileDescriptors);
        assert_eq!(resource(libc::ENFILE), Resource::FileDescriptors);
        assert_eq!(resource(libc::ENOMEM), Resource::Memory);
    }

    #[test]
    fn an_opencl_device_in_a_host_takes_no_gpu_only_code() {
        let mut wire = gpu_wire(true);
        wire.kind = DeviceKind::OpenCl;
        let device = RemoteDevice::new(platform(), 0, "opencl0".into(), wire).unwrap();
        let (_, saxpy) = agora_kernels::find("saxpy").unwrap();
        assert!(device.implements(saxpy));
        assert!(!device.implements(&tenant_kernel()), "CUDA code has no OpenCL to run");
        assert_eq!(device.prepare(saxpy), None, "OpenCL builds at the first launch");
    }
}
