//! The dispatcher thread: one event loop that accepts clients, answers control requests, polls
//! session rings and runs the scheduler.
//!
//! Everything that can wake it is one of the [`Token`]s registered with epoll: the listener, a
//! connection's socket, a session's doorbell, or the stop signal. While work arrives it polls the
//! rings without system calls (checking epoll every millisecond for control traffic, and every
//! 20 µs while it spins for more); after an adaptive spin with nothing to do it announces that it
//! sleeps in every segment and blocks in `epoll_wait`, so an idle daemon uses no CPU. It skips the spin while our own long work (CPU
//! lanes, an OpenCL runtime on the CPU) holds every other core: spinning then keeps the last
//! core from the very client whose next submission it waits for.
//!
//! Threat model: every client is hostile. Control frames are reassembled without blocking (half a
//! frame cannot stall the loop), an oversize or undecodable frame closes that connection, a client
//! that does not read its replies is disconnected, and a corrupt ring index ends that session.
//! None of these affects another client. Work per request is bounded too: names longer than
//! [`MAX_NAME`] are refused before anything looks at them, and every reply fits in a frame (the
//! status summarises, a session's queues come in pages), whatever tenants create. Names that
//! others will read (client, queue, program, DAG) are refused when they hold a control,
//! zero-width or text-direction character (`check_name`): they reach the operator's terminal.
//!
//! Limits (`crate::limits`): each connection is booked to its uid at accept; connections,
//! sessions, heap, queues, buffers and outstanding control requests are checked per uid when a
//! request asks for more, every frame takes a token from its connection's bucket, and a
//! connection that says nothing within the hello timeout is closed. Refusals are typed replies
//! (`ControlError::LimitReached`); the ring polling never looks at any of it. When the daemon
//! runs out of descriptors (`EMFILE`/`ENFILE`), the listener leaves the epoll set for
//! [`ACCEPT_BACKOFF`] (it is level-triggered: it would otherwise wake the loop at once, forever),
//! a reserve descriptor is given up to accept the waiting connections and tell them why before
//! closing them, and the log line is written at most once per [`ACCEPT_LOG_EVERY`].
//!
//! Shutdown (the stop signal): stop accepting, stop reading rings, let the work already on
//! lanes finish for up to `shutdown_timeout`, then give up on the rest (clients see
//! `Disconnected`), stop the lanes without waiting long for a running kernel, and return.
//!
//! One file per part of the loop's work (each adds methods to [`Server`]): this one has the loop,
//! connections' frames and the dispatch of requests; `admission` accepts connections and applies
//! the per-uid limits; `sessions` opens, resumes and closes sessions; `reports` answers status,
//! usage and drain requests.

use std::collections::{HashMap, VecDeque};
use std::os::fd::{AsFd, OwnedFd};
use std::os::unix::net::{UnixListener, UnixStream};
use std::sync::atomic::{fence, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use agora_protocol::control::{
    check_name, decode_body, encoded_len, ControlError, DeviceStatus, LaneStatus, Request, Response, ResumedBuffer,
    ResumedQueue, StatusReport, MAX_NAME, REPLY_BUDGET, STATUS_SESSIONS,
};
use agora_protocol::segment::Geometry;
use agora_protocol::{DeviceKind, MAX_ARGS, PROTOCOL_VERSION};
use agora_transport::shm::Segment;
use agora_transport::socket::{send_with_fds, FrameReader};
use agora_transport::wake::{AdaptiveSpin, Doorbell};
use agora_transport::TransportError;
use agora_wait::Yielding;
use rustix::event::epoll;

use crate::config::DaemonConfig;
use crate::control::{send_whole, ControlJob, ControlPlane, Owed};
use crate::limits::{Books, KeyedLogGate, Limit, LogGate, TokenBucket};
use crate::scheduler::Scheduler;
use crate::session::{Credentials, QueueState, Session};
use crate::telemetry::Telemetry;
use crate::DaemonError;

mod admission;
mod jobs;
mod realtime;
mod reports;
mod sessions;
mod sharing;

/// Most kernel names a resuming client may ask new ids for.
const MAX_RESUMED_KERNELS: usize = 4096;

/// Drops reclaimed sessions off the dispatcher. Dropping one unmaps its segment (a heap its
/// tenant filled: measured 9 ms for 32 MiB touched), closes its memfd and doorbell and releases
/// its buffers' device copies; after the last tenant the allocator's free memory is returned
/// too (`malloc_trim`, up to tens of milliseconds after a heavy run). On the dispatcher each was
/// a stall of every tenant's tasks.
///
/// Devices that keep memory for a tenant between its allocations (a GPU keeps its tenant's
/// partition mapped) are told the tenant ended, after its buffers are dropped.
struct Reclaimer {
    sessions: std::sync::mpsc::Sender<(Box<Session>, bool)>,
}

impl Reclaimer {
    fn start(devices: &[Arc<dyn agora_devices::Device>]) -> Result<Self, DaemonError> {
        // Weak: the devices go with the scheduler, on the thread that drops the server, as before.
        let devices: Vec<std::sync::Weak<dyn agora_devices::Device>> = devices.iter().map(Arc::downgrade).collect();
        let (sessions, inbox) = std::sync::mpsc::channel::<(Box<Session>, bool)>();
        std::thread::Builder::new()
            .name("agora-reclaim".into())
            .spawn(move || {
                // Ends when the server (the sender) is gone.
                for (session, last_tenant) in inbox {
                    let tenant = session.id;
                    drop(session);
                    for device in devices.iter().filter_map(std::sync::Weak::upgrade) {
                        device.tenant_ended(tenant);
                    }
                    if last_tenant {
                        crate::memory::return_free_memory();
                    }
                }
            })
            .map_err(|e| DaemonError::io("starting the reclaim thread", e))?;
        Ok(Reclaimer { sessions })
    }

    /// Drops `session` on the reclaim thread (then returns free memory when it was the last).
    fn reclaim(&self, session: Box<Session>, last_tenant: bool) {
        if let Err(std::sync::mpsc::SendError((session, last_tenant))) = self.sessions.send((session, last_tenant)) {
            // The thread is gone (it cannot panic short of a bug): drop here.
            drop(session);
            if last_tenant {
                crate::memory::return_free_memory();
            }
        }
    }
}

/// What woke the loop.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Token {
    Listener,
    Stop,
    /// A lane sent a lost task back (migration inbox).
    Wake,
    Socket(u64),
    Doorbell(u64),
}

impl Token {
    fn encode(self) -> u64 {
        match self {
            Token::Listener => 1,
            Token::Stop => 2,
            Token::Wake => 3,
            Token::Socket(id) => (1 << 62) | id,
            Token::Doorbell(id) => (2 << 62) | id,
        }
    }
    fn decode(value: u64) -> Token {
        match value >> 62 {
            1 => Token::Socket(value & ((1 << 62) - 1)),
            2 => Token::Doorbell(value & ((1 << 62) - 1)),
            _ if value == 1 => Token::Listener,
            _ if value == 3 => Token::Wake,
            _ => Token::Stop,
        }
    }
}

/// A connection before and after it opened a session.
enum Conn {
    /// Connected, no hello yet.
    Pending {
        stream: Arc<UnixStream>,
        reader: FrameReader,
        credentials: Credentials,
    },
    /// A one-shot observer (`agora status`, `agora drain`).
    Observer {
        stream: Arc<UnixStream>,
        reader: FrameReader,
        credentials: Credentials,
    },
    /// A client session.
    Session(Box<Session>),
}

impl Conn {
    fn stream(&self) -> &Arc<UnixStream> {
        match self {
            Conn::Pending { stream, .. } | Conn::Observer { stream, .. } => stream,
            Conn::Session(s) => &s.stream,
        }
    }
}

pub(crate) struct Server {
    config: DaemonConfig,
    listener: UnixListener,
    /// The socket file it put in place and its claims on that path and its state directory
    /// (released when the server goes).
    ownership: crate::claims::Ownership,
    epoll: OwnedFd,
    stop: Arc<Doorbell>,
    /// Rung by lanes that send a lost task back to the dispatcher.
    wake: Arc<Doorbell>,
    scheduler: Scheduler,
    conns: HashMap<u64, Conn>,
    // Boxed because sessions move between `conns` (boxed in `Conn`) and here.
    #[allow(clippy::vec_box)]
    closing: Vec<Box<Session>>,
    /// Drops reclaimed sessions on a thread of its own (see [`Reclaimer`]).
    reclaimer: Reclaimer,
    next_id: u64,
    started: Instant,
    sessions_opened: u64,
    /// The dispatcher's longest stretch of work since start, nanoseconds.
    longest_iteration_ns: u64,
    /// Stretches of it over [`STALL_NS`](crate::telemetry::STALL_NS) since start.
    stalls: u64,
    sessions_closed: u64,
    retired_completed: u64,
    retired_failed: u64,
    spin: AdaptiveSpin,
    /// Cores this process may run on (its affinity and cgroup): while our own long work holds
    /// all but one, the dispatcher does not spin ([`Server::run`]). `usize::MAX` when
    /// `AGORA_DISPATCHER_SPIN_BESIDE_LONG_WORK=1` asks it to spin regardless (for comparison).
    host_cores: usize,
    telemetry: Arc<Telemetry>,
    /// Slow control-plane work, off this thread.
    control: ControlPlane,
    /// Per connection: replies handed to the control thread and not yet written. While one is
    /// owed, this thread's replies to that connection go through the control thread too, so
    /// that replies keep the order of their requests.
    owed: HashMap<u64, Owed>,
    /// Tenant programs: the daemon's cache of their binaries and who may build them.
    program_cache: Arc<crate::programs::ProgramCache>,
    program_policy: crate::programs::ProgramPolicy,
    /// What each uid holds, against the limits.
    books: Books,
    /// Each connection's control request bucket.
    buckets: HashMap<u64, TokenBucket>,
    /// Connections waiting for their first request, with the time they are closed (in order:
    /// the timeout is the same for all).
    hello_deadlines: VecDeque<(Instant, u64)>,
    /// An open `/dev/null`, given up when the daemon is out of descriptors so that it can
    /// still accept a waiting connection to tell it why and close it.
    reserve_fd: Option<std::fs::File>,
    /// While out of descriptors: the listener is out of the epoll set until then.
    listener_paused_until: Option<Instant>,
    /// When to look next whether the socket file is still in place ([`SOCKET_CHECK_EVERY`]).
    socket_check_at: Instant,
    /// What that look last found (logged when it changes).
    socket_state: crate::claims::SocketState,
    /// "Out of descriptors" is logged at most once per [`ACCEPT_LOG_EVERY`].
    accept_log: LogGate,
    /// Refused resumes, logged at most once a minute per session.
    resume_refusals: sessions::ResumeRefusals,
    /// Exported buffers by name (`Export`, `Attach`).
    exports: crate::exports::Exports,
    /// Real-time DAGs and their release thread (`None`: no deadline device).
    realtime: Option<(Arc<crate::realtime::Realtime>, std::thread::JoinHandle<()>)>,
    /// Slurm jobs running on this node.
    jobs: jobs::Jobs,
    /// Devices `agora slurm suspend` drained (`Request::PowerSave`), by index: resume undrains
    /// these only, so a device drained by hand before stays drained.
    suspended: std::collections::BTreeSet<usize>,
}

/// How often a spinning dispatcher looks for control traffic (one `epoll_wait` with no timeout).
const CONTROL_PEEK: Duration = Duration::from_micros(20);

/// How long the listener stays out of the epoll set after `accept` failed for want of
/// descriptors (it is level-triggered: left in, it would wake the loop at once, forever).
const ACCEPT_BACKOFF: Duration = Duration::from_millis(100);

/// At most one "out of descriptors" log line per this long (with the count of those suppressed).
const ACCEPT_LOG_EVERY: Duration = Duration::from_secs(10);

/// How often the daemon looks whether its socket file is still in place: a `/tmp` cleaner or a
/// careless `rm` leaves a daemon that runs on and that no client can reach (and a second daemon
/// is refused: this one holds the path's claim). One `lstat`; an idle daemon wakes for it.
const SOCKET_CHECK_EVERY: Duration = Duration::from_secs(5);

/// Most waiting connections accepted and refused per backoff when out of descriptors.
const SHED_PER_BACKOFF: usize = 256;

impl Server {
    pub(crate) fn new(
        config: DaemonConfig,
        listener: UnixListener,
        ownership: crate::claims::Ownership,
        scheduler: Scheduler,
        stop: Arc<Doorbell>,
        telemetry: Arc<Telemetry>,
    ) -> Result<Self, DaemonError> {
        listener
            .set_nonblocking(true)
            .map_err(|e| DaemonError::io("configuring the listener", e))?;
        let epoll =
            epoll::create(epoll::CreateFlags::CLOEXEC).map_err(|e| DaemonError::io("creating epoll", e.into()))?;
        epoll::add(
            &epoll,
            &listener,
            epoll::EventData::new_u64(Token::Listener.encode()),
            epoll::EventFlags::IN,
        )
        .map_err(|e| DaemonError::io("watching the listener", e.into()))?;
        epoll::add(
            &epoll,
            stop.fd(),
            epoll::EventData::new_u64(Token::Stop.encode()),
            epoll::EventFlags::IN,
        )
        .map_err(|e| DaemonError::io("watching the stop signal", e.into()))?;
        let wake = Arc::new(
            Doorbell::new().map_err(|e| DaemonError::io("creating the wake doorbell", std::io::Error::other(e)))?,
        );
        epoll::add(
            &epoll,
            wake.fd(),
            epoll::EventData::new_u64(Token::Wake.encode()),
            epoll::EventFlags::IN,
        )
        .map_err(|e| DaemonError::io("watching the wake doorbell", e.into()))?;
        scheduler.migration.set_wake(wake.clone());
        if let Some(checkpoints) = scheduler.checkpoints() {
            checkpoints.set_wake(wake.clone(), telemetry.metrics.capture_bytes.clone());
        }
        let spin = AdaptiveSpin::new(agora_wait::MIN_BUDGET.min(config.max_spin), config.max_spin);
        let host_cores = match std::env::var_os("AGORA_DISPATCHER_SPIN_BESIDE_LONG_WORK") {
            Some(v) if v == "1" => usize::MAX,
            _ => std::thread::available_parallelism().map_or(1, |n| n.get()),
        };
        let control = ControlPlane::start(crate::control::ControlContext {
            telemetry: telemetry.clone(),
            kernels: scheduler.kernels.clone(),
        })
        .map_err(|e| DaemonError::io("starting the control thread", e))?;
        let program_cache = Arc::new(crate::programs::ProgramCache::new(
            &config.effective_state_dir(),
            config.program_cache_bytes,
        ));
        let program_policy = crate::programs::ProgramPolicy::of(&config);
        let realtime = realtime::start_service(&config, &scheduler.devices, wake.clone(), telemetry.clone());
        let mut books = Books::new(config.limits.clone());
        books.attach_counters(|limit| telemetry.metrics.limit_refusals(limit));
        let reclaimer = Reclaimer::start(&scheduler.devices)?;
        Ok(Server {
            books,
            buckets: HashMap::new(),
            hello_deadlines: VecDeque::new(),
            reserve_fd: std::fs::File::open("/dev/null").ok(),
            listener_paused_until: None,
            socket_check_at: Instant::now() + SOCKET_CHECK_EVERY,
            socket_state: crate::claims::SocketState::Ours,
            accept_log: LogGate::new(ACCEPT_LOG_EVERY),
            resume_refusals: Default::default(),
            exports: Default::default(),
            realtime,
            jobs: jobs::Jobs::load(&config.effective_state_dir()),
            suspended: Default::default(),
            program_cache,
            program_policy,
            config,
            listener,
            ownership,
            epoll,
            stop,
            wake,
            scheduler,
            conns: HashMap::new(),
            closing: Vec::new(),
            reclaimer,
            next_id: 1,
            started: Instant::now(),
            sessions_opened: 0,
            longest_iteration_ns: 0,
            stalls: 0,
            sessions_closed: 0,
            retired_completed: 0,
            retired_failed: 0,
            spin,
            host_cores,
            telemetry,
            control,
            owed: HashMap::new(),
        })
    }

    /// Runs until the stop signal.
    /// The kernel registry (for a reload the daemon's signal handling asks for).
    pub(crate) fn kernels(&self) -> Arc<crate::kernels::KernelRegistry> {
        self.scheduler.kernels.clone()
    }

    /// The socket file this daemon put in place (for a last-moment exit to remove).
    pub(crate) fn socket_file(&self) -> crate::claims::SocketFile {
        self.ownership.socket_file.clone()
    }

    pub(crate) fn run(&mut self) -> Result<(), DaemonError> {
        if self.config.dispatcher_nice != 0 {
            match agora_devices::priority::renice_current_thread(self.config.dispatcher_nice) {
                Ok(nice) => tracing::info!(nice, "dispatcher thread reniced"),
                Err(why) => tracing::warn!(
                    "dispatcher_nice = {} not applied ({why}); the dispatcher runs at normal priority",
                    self.config.dispatcher_nice
                ),
            }
        }
        if self.config.dispatcher_realtime {
            match agora_devices::priority::make_current_thread_realtime() {
                Ok(()) => tracing::info!("dispatcher thread runs under SCHED_FIFO"),
                Err(why) => {
                    tracing::warn!("dispatcher_realtime not applied ({why}); the dispatcher runs at normal priority")
                }
            }
        }
        let mut last_poll = Instant::now();
        let mut broken: Vec<u64> = Vec::new();
        loop {
            let mut worked = 0u32;
            let began = Instant::now();
            self.scheduler.tick(began);
            // Failed devices and tasks they lost, before any session's new tasks.
            self.scheduler.migration_tick();
            // Released DAG nodes next: they have deadlines.
            self.run_node_jobs();
            for (&id, conn) in self.conns.iter_mut() {
                if let Conn::Session(session) = conn {
                    match self.scheduler.ingest(session) {
                        Ok(n) => worked += n,
                        Err(e) => {
                            tracing::warn!(session = id, pid = session.credentials.pid, error = %e, "ending session: corrupt submission ring");
                            broken.push(id);
                        }
                    }
                }
            }
            for id in broken.drain(..) {
                self.close(id);
            }
            self.iteration_took(began);
            if worked > 0 {
                if last_poll.elapsed() > Duration::from_millis(1) {
                    last_poll = Instant::now();
                    if self.poll_events(Some(Duration::ZERO))? {
                        return self.shutdown();
                    }
                }
                continue;
            }
            let conns = &self.conns;
            // Yielding while it spins hands the core to a lane thread sharing it, which runs a
            // job the dispatcher just handed over. While no lane has a job only a client could
            // share the core: yield rarely (two threads that yield to each other may stay on one
            // core, two that keep it busy the OS spreads over two). Never while our lanes run
            // long kernels: the yield would go to them for a time slice.
            let yielding = if self.scheduler.long_work_on_lanes() {
                Yielding::Never
            } else if self.scheduler.lanes_have_jobs() {
                Yielding::Cooperative
            } else {
                Yielding::Rarely
            };
            let realtime = self.realtime.as_ref().map(|(service, _)| service.clone());
            let node_jobs = || realtime.as_ref().is_some_and(|service| service.wants_dispatcher());
            // While our own long work (CPU lanes, PoCL's threads) holds every core but this one, a
            // client's next submission needs this very core: spinning would keep it from the
            // client for the whole budget (measured, `agora bench stall`: a neighbour's p99 of
            // ~215 µs, the 200 µs budget, against ~12.5 µs blocking at once). Block; its doorbell
            // wakes us.
            // A DAG release about to come still asks for the spin (its hand-off is timed).
            let spin_pays = self.scheduler.cores_held_by_long_work() + 1 < self.host_cores || node_jobs();
            // A control request (a buffer, a queue, a host-copy claim) would otherwise wait for
            // the whole spin (up to its budget, ~100 µs measured): peek at epoll at once when a
            // session's segment says it sent one (`control_sent`), and now and then in any case,
            // a system call every `CONTROL_PEEK` at most (level-triggered: nothing is consumed).
            // The count is only a hint: a client that bumps it without sending buys a peek that
            // finds nothing, and the spin ends by its budget as ever.
            let epoll_set = &self.epoll;
            let mut control_ready = false;
            let mut polls = 0u32;
            let mut last_peek = None;
            let mut ready = || {
                if Self::any_pending(conns) || node_jobs() {
                    return true;
                }
                polls = polls.wrapping_add(1);
                let sent = Self::control_sent(conns);
                // Time is read every few polls only: most spins end within a microsecond.
                if sent || polls.is_multiple_of(8) {
                    let now = Instant::now();
                    let since = *last_peek.get_or_insert(now);
                    if sent || now.duration_since(since) >= CONTROL_PEEK {
                        last_peek = Some(now);
                        let zero = rustix::time::Timespec { tv_sec: 0, tv_nsec: 0 };
                        let mut slot = [std::mem::MaybeUninit::<epoll::Event>::uninit()];
                        control_ready = epoll::wait(epoll_set, &mut slot[..], Some(&zero))
                            .is_ok_and(|(events, _)| !events.is_empty());
                    }
                }
                control_ready
            };
            if spin_pays && self.spin.spin_with(&mut ready, yielding) {
                if control_ready {
                    last_poll = Instant::now();
                    if self.poll_events(Some(Duration::ZERO))? {
                        return self.shutdown();
                    }
                }
                continue;
            }
            // Going to sleep: announce it, then look once more (pairs with the client's fence
            // between publishing its tail and reading `daemon_sleeping`).
            self.set_sleeping(1);
            fence(Ordering::SeqCst);
            if Self::any_pending(&self.conns) || self.node_jobs_pending() {
                self.set_sleeping(0);
                continue;
            }
            let housekeeping = !self.closing.is_empty()
                // Held tasks of moving queues are released once their in-flight tasks finish;
                // lanes do not wake us for that, so look again soon (tasks waiting for a device
                // host's answers are woken by them).
                || self.scheduler.holding()
                // A failed device may come back (its device host restarting): ask it now and then.
                || self.scheduler.migration.awaiting_revival()
                || self
                    .conns
                    .values()
                    .any(|c| matches!(c, Conn::Session(s) if !s.zombies.is_empty()));
            let timeout = if self.scheduler.holding() {
                Some(Duration::from_millis(1))
            } else {
                housekeeping.then(|| Duration::from_millis(20))
            };
            // Hello deadlines, a paused listener and the end of live latency work (batch lanes
            // back from `idle`) wake the loop too.
            let timeout = match (timeout, self.next_timer()) {
                (Some(a), Some(b)) => Some(a.min(b)),
                (a, b) => a.or(b),
            };
            let slept = Instant::now();
            let stop = self.poll_events(timeout)?;
            self.set_sleeping(0);
            if spin_pays {
                self.spin.blocked_for(slept.elapsed());
            }
            last_poll = Instant::now();
            if stop {
                return self.shutdown();
            }
        }
    }

    fn any_pending(conns: &HashMap<u64, Conn>) -> bool {
        conns.values().any(|c| match c {
            Conn::Session(s) => s
                .submissions
                .available()
                .map_or(true, |n| n > 0 && s.admission_room() > 0 && s.lane_admits_head()),
            _ => false,
        })
    }

    /// Whether a session's client sent a control request since the dispatcher last looked
    /// (its segment's `control_sent` changed); notes what it saw.
    fn control_sent(conns: &HashMap<u64, Conn>) -> bool {
        let mut sent = false;
        for conn in conns.values() {
            if let Conn::Session(s) = conn {
                let now = s.shared.segment.view().header().control_sent.load(Ordering::Acquire);
                if now != s.control_seen.get() {
                    s.control_seen.set(now);
                    sent = true;
                }
            }
        }
        sent
    }

    fn set_sleeping(&self, value: u32) {
        for conn in self.conns.values() {
            if let Conn::Session(s) = conn {
                s.shared
                    .segment
                    .view()
                    .header()
                    .daemon_sleeping
                    .store(value, Ordering::SeqCst);
            }
        }
    }

    /// Waits for events (up to `timeout`, forever when `None`) and handles them.
    /// Returns whether the daemon must stop.
    fn poll_events(&mut self, timeout: Option<Duration>) -> Result<bool, DaemonError> {
        self.resume_listener();
        let mut events = Vec::with_capacity(64);
        let ts = timeout.map(|t| rustix::time::Timespec {
            tv_sec: t.as_secs() as i64,
            tv_nsec: i64::from(t.subsec_nanos()),
        });
        match epoll::wait(&self.epoll, rustix::buffer::spare_capacity(&mut events), ts.as_ref()) {
            Ok(_) => {}
            Err(rustix::io::Errno::INTR) => {}
            Err(e) => return Err(DaemonError::io("waiting for events", e.into())),
        }
        let began = Instant::now();
        let mut stop = false;
        for event in events.drain(..) {
            match Token::decode(event.data.u64()) {
                Token::Listener => self.accept(),
                Token::Stop => {
                    self.stop.drain();
                    stop = true;
                }
                Token::Wake => self.wake.drain(),
                Token::Socket(id) => self.readable(id),
                Token::Doorbell(id) => {
                    if let Some(Conn::Session(s)) = self.conns.get(&id) {
                        s.doorbell.drain();
                    }
                }
            }
        }
        self.housekeeping();
        self.iteration_took(began);
        Ok(stop)
    }

    /// Notes a stretch of the dispatcher's work that began at `began` (exported as its longest,
    /// and counted as a stall when over a millisecond).
    #[inline]
    fn iteration_took(&mut self, began: Instant) {
        let took = began.elapsed().as_nanos() as u64;
        if took > crate::telemetry::STALL_NS {
            self.stalls += 1;
            self.telemetry.metrics.stalls.inc();
        }
        if took > self.longest_iteration_ns {
            self.longest_iteration_ns = took;
            self.telemetry.metrics.longest_iteration.set(took as f64 / 1e9);
        }
    }

    /// How long until the next hello deadline or the listener's return, if any.
    fn next_timer(&self) -> Option<Duration> {
        let now = Instant::now();
        let hello = self.hello_deadlines.front().map(|(at, _)| *at);
        [
            hello,
            self.listener_paused_until,
            self.scheduler.next_tick(),
            Some(self.socket_check_at),
        ]
        .into_iter()
        .flatten()
        .min()
        .map(|at| at.saturating_duration_since(now))
    }

    /// Puts the listener back into the epoll set once its backoff is over.
    fn resume_listener(&mut self) {
        if self.listener_paused_until.is_some_and(|at| at <= Instant::now()) {
            self.listener_paused_until = None;
            if let Err(e) = epoll::add(
                &self.epoll,
                &self.listener,
                epoll::EventData::new_u64(Token::Listener.encode()),
                epoll::EventFlags::IN,
            ) {
                tracing::error!(error = %e, "could not watch the listener again; retrying");
                self.listener_paused_until = Some(Instant::now() + ACCEPT_BACKOFF);
            }
        }
    }

    fn housekeeping(&mut self) {
        self.expire_hellos();
        if self.socket_check_at <= Instant::now() {
            self.socket_check_at = Instant::now() + SOCKET_CHECK_EVERY;
            self.keep_socket_in_place();
        }
        for conn in self.conns.values_mut() {
            if let Conn::Session(s) = conn {
                s.reclaim_zombies();
            }
        }
        let mut i = 0;
        while i < self.closing.len() {
            if self.closing[i].shared.in_flight.load(Ordering::Acquire) == 0 {
                let session = self.closing.swap_remove(i);
                self.retire(session);
            } else {
                i += 1;
            }
        }
    }

    /// Puts a new socket in place when the daemon's was removed (this daemon holds the path's
    /// claim, so the path is its own to fill); says so once when another file took the path.
    fn keep_socket_in_place(&mut self) {
        use crate::claims::SocketState;
        let state = self.ownership.socket_file.state();
        let path = self.ownership.socket_file.path().to_path_buf();
        match state {
            SocketState::Ours => {}
            SocketState::Missing => match crate::bind(&path, &self.config.socket_access).and_then(|(listener, file)| {
                listener
                    .set_nonblocking(true)
                    .map_err(|e| DaemonError::io("configuring the listener", e))?;
                Ok((listener, file))
            }) {
                Ok((listener, file)) => {
                    let watched = self.listener_paused_until.is_none();
                    if watched {
                        let _ = epoll::delete(&self.epoll, &self.listener);
                        if let Err(e) = epoll::add(
                            &self.epoll,
                            &listener,
                            epoll::EventData::new_u64(Token::Listener.encode()),
                            epoll::EventFlags::IN,
                        ) {
                            tracing::error!(error = %e, "could not watch the new listener; retrying");
                            self.listener_paused_until = Some(Instant::now() + ACCEPT_BACKOFF);
                        }
                    }
                    self.listener = listener;
                    self.ownership.socket_file = file;
                    tracing::warn!(
                        socket = %path.display(),
                        "the daemon's socket file was removed while it ran (a /tmp cleaner, or rm): put a new one in place; clients reach the daemon again (a socket directory that cleaners skip, e.g. /run, avoids this)"
                    );
                }
                Err(e) => {
                    if self.socket_state != SocketState::Missing {
                        tracing::error!(
                            socket = %path.display(),
                            error = %e,
                            "the daemon's socket file was removed and a new one could not be put in place: no client can reach this daemon; it tries again every {} s",
                            SOCKET_CHECK_EVERY.as_secs()
                        );
                    }
                    self.socket_state = SocketState::Missing;
                    return;
                }
            },
            SocketState::Replaced => {
                if self.socket_state != SocketState::Replaced {
                    tracing::error!(
                        socket = %path.display(),
                        "another file took the daemon's socket path: no client can reach this daemon; remove that file (a new socket is then put in place within {} s) or restart the daemon",
                        SOCKET_CHECK_EVERY.as_secs()
                    );
                }
                self.socket_state = SocketState::Replaced;
                return;
            }
        }
        self.socket_state = SocketState::Ours;
    }

    fn retire(&mut self, session: Box<Session>) {
        self.books.reclaimed(
            session.credentials.uid,
            session.shared.segment.view().geometry().heap_len,
        );
        self.retired_completed += session.shared.completed.load(Ordering::Relaxed);
        self.retired_failed += session.shared.failed.load(Ordering::Relaxed);
        tracing::info!(
            session = session.id,
            pid = session.credentials.pid,
            buffers = session.buffers.len(),
            "session reclaimed"
        );
        let tenants_left = self.closing.is_empty() && !self.conns.values().any(|c| matches!(c, Conn::Session(_)));
        self.reclaimer.reclaim(session, tenants_left);
    }

    fn readable(&mut self, id: u64) {
        let Some(conn) = self.conns.get_mut(&id) else {
            return;
        };
        let (reader, stream) = match conn {
            Conn::Pending { reader, stream, .. } | Conn::Observer { reader, stream, .. } => (reader, &*stream),
            Conn::Session(s) => (&mut s.reader, &s.stream),
        };
        let frames = match reader.read_frames(stream) {
            Ok(frames) => frames,
            Err(TransportError::Closed) => return self.close(id),
            Err(e) => {
                tracing::warn!(connection = id, error = %e, "closing a connection that broke the protocol");
                return self.close(id);
            }
        };
        for frame in frames {
            let response = match decode_body::<Request>(&frame) {
                Ok(request) => match self.take_token(id) {
                    Ok(()) => self.handle(id, request),
                    Err(refusal) => {
                        // A request is a request: the connection stops waiting for its hello.
                        self.observe_if_pending(id, &request);
                        Some(Response::Error(refusal))
                    }
                },
                Err(e) => {
                    tracing::warn!(connection = id, error = %e, "closing a connection that sent an undecodable request");
                    return self.close(id);
                }
            };
            let Some(response) = response else { continue };
            if self.owed.get(&id).is_some_and(|o| o.load(Ordering::Acquire) > 0) {
                // Behind a reply the control thread still owes this connection.
                if let Some(response) = self.offload(id, ControlJob::Reply(response)) {
                    tracing::warn!(connection = id, "closing a connection whose reply could not be ordered");
                    drop(response);
                    return self.close(id);
                }
                continue;
            }
            let Some(conn) = self.conns.get(&id) else {
                return;
            };
            if let Err(e) = send_whole(conn.stream(), &response, Duration::ZERO) {
                tracing::warn!(connection = id, error = %e, "closing a connection that does not read its replies");
                return self.close(id);
            }
        }
    }

    /// Answers one request. `None` when the reply was sent already (hello with descriptors) or
    /// will be, by the control thread.
    fn handle(&mut self, id: u64, request: Request) -> Option<Response> {
        // Requests the control thread answers wait there; a uid may have only so many waiting.
        let offloaded = matches!(
            request,
            Request::Status
                | Request::SessionStatus { .. }
                | Request::SaveTrace
                | Request::ListKernels
                | Request::KernelCatalog
                | Request::ReloadKernels
                | Request::BuildProgram { .. }
                | Request::LookupKernel { .. }
                | Request::Recover
                | Request::Checkpoints
        );
        if offloaded {
            if let Err(refusal) = self.check_uid(id, Limit::ControlRequests) {
                self.observe_if_pending(id, &request);
                return Some(Response::Error(refusal));
            }
        }
        match request {
            // Any connection may ask these; a pending one becomes an observer.
            Request::Status => {
                self.observe(id);
                let report = Response::Status(Box::new(self.status(self.private_viewer(id))));
                // Snapshotted here; encoded and written by the control thread.
                self.offload(id, ControlJob::Reply(report))
            }
            Request::SessionStatus { session, first_queue } => {
                self.observe(id);
                let device_names = self.device_names();
                let viewer = self.private_viewer(id);
                let reply = match self.conns.get(&session) {
                    // Another user's session on a private daemon reads as unknown: whether it
                    // exists is not the asker's to learn either.
                    Some(Conn::Session(s)) if viewer.is_none_or(|uid| uid == s.credentials.uid) => {
                        Response::SessionDetails(Box::new(s.details(&device_names, first_queue)))
                    }
                    _ => Response::Error(ControlError::UnknownSession(session)),
                };
                self.offload(id, ControlJob::Reply(reply))
            }
            Request::Drain {
                device,
                drain,
                evacuate,
            } => {
                self.observe(id);
                Some(self.drain(id, &device, drain, evacuate))
            }
            // Serialises up to the whole trace: admin only, like drain and reload.
            Request::SaveTrace => match self.require_admin(id, "save the trace") {
                Ok(()) => self.offload(id, ControlJob::SaveTrace),
                Err(refusal) => Some(refusal),
            },
            Request::ListKernels => self.offload(id, ControlJob::ListKernels),
            Request::KernelCatalog => self.offload(id, ControlJob::KernelCatalog),
            Request::ReloadKernels => match self.require_admin(id, "reload kernel packages") {
                Ok(()) => self.offload(id, ControlJob::ReloadKernels),
                Err(refusal) => Some(refusal),
            },
            Request::BuildProgram {
                language,
                code,
                manifest,
                name,
            } => self.build_program(id, language, code, manifest, name),
            Request::LookupKernel { name } => match check_name("kernel", &name) {
                // Refused before the "did you mean" search, whose work grows with the name.
                Err(e) => Some(Response::Error(e)),
                Ok(()) => {
                    let in_own_program = match self.conns.get(&id) {
                        Some(Conn::Session(session)) => session.program_kernels.has_named(&name),
                        _ => false,
                    };
                    self.offload(id, ControlJob::LookupKernel { name, in_own_program })
                }
            },
            // Names others will see are refused before anything keeps them (`check_name`).
            Request::Hello { client_name, .. } if check_name("client", &client_name).is_err() => {
                check_name("client", &client_name).err().map(Response::Error)
            }
            Request::Hello {
                version,
                client_name,
                heap_bytes,
            } => match self.conns.get(&id)? {
                Conn::Pending { .. } => self.hello(id, version, client_name, heap_bytes),
                Conn::Session(_) => Some(Response::Error(ControlError::BadRequest(
                    "a session is already open on this connection".into(),
                ))),
                Conn::Observer { .. } => Some(observer_error()),
            },
            Request::Resume { client_name, .. } if check_name("client", &client_name).is_err() => {
                check_name("client", &client_name).err().map(Response::Error)
            }
            Request::Resume {
                version,
                client_name,
                previous_session,
                submission_capacity,
                completion_capacity,
                heap_len,
                buffers,
                queues,
                kernels,
                more,
            } => match self.conns.get(&id)? {
                Conn::Pending { .. } => self.resume(
                    id,
                    version,
                    client_name,
                    previous_session,
                    Geometry::new(submission_capacity, completion_capacity, heap_len),
                    kernels,
                    (buffers, queues, more),
                ),
                Conn::Session(_) => Some(Response::Error(ControlError::BadRequest(
                    "a session is already open on this connection".into(),
                ))),
                Conn::Observer { .. } => Some(observer_error()),
            },
            Request::ResumeMore { buffers, queues, more } => self.resume_more(id, buffers, queues, more),
            Request::AllocBuffer { .. } | Request::CreateQueue { .. }
                if matches!(self.conns.get(&id), Some(Conn::Session(_))) =>
            {
                let limit = if matches!(request, Request::AllocBuffer { .. }) {
                    Limit::Buffers
                } else {
                    Limit::Queues
                };
                match self.check_uid(id, limit) {
                    Ok(()) => self.in_session_request(id, request),
                    Err(refusal) => Some(Response::Error(refusal)),
                }
            }
            Request::AllocShared { len } => self.alloc_shared(id, len),
            Request::Export {
                buffer,
                name,
                readers,
                writable,
            } => self.export(id, buffer, name, readers, writable),
            Request::Revoke { name } => self.revoke(id, name),
            Request::Attach { name, writable } => self.attach(id, name, writable),
            Request::Exports => self.list_exports(id),
            Request::DeclareDag(declaration) => self.declare_dag(id, *declaration),
            Request::ReleaseDag { dag } => self.dag_request(id, |service, session| {
                service
                    .release_now(session, dag)
                    .map(|release| Response::DagReleased { release })
            }),
            Request::DagResults { dag } => self.dag_request(id, |service, session| {
                service.results(session, dag).map(Response::DagResults)
            }),
            Request::DropDag { dag } => self.dag_request(id, |service, session| {
                service.drop_dag(session, dag).map(|()| Response::DagDropped)
            }),
            Request::JobStart(spec) => {
                self.observe(id);
                self.job_start(id, spec)
            }
            Request::JobEnd { job } => {
                self.observe(id);
                self.job_end(id, job)
            }
            Request::PowerSave { suspend } => {
                self.observe(id);
                Some(self.power_save(id, suspend))
            }
            other => self.in_session_request(id, other),
        }
    }

    /// Answers the requests that need an open session (`AllocBuffer`, `CreateQueue`).
    fn in_session_request(&mut self, id: u64, request: Request) -> Option<Response> {
        match request {
            Request::AllocBuffer { len } => self.in_session(id, |_, session| match session.alloc_buffer(len) {
                Ok((handle, offset)) => Response::Buffer { handle, offset, len },
                Err(e) => Response::Error(e),
            }),
            Request::CreateQueue {
                name,
                class,
                preferred_device,
                sla_ms,
            } => self.in_session(id, |config, session| {
                create_queue(config, session, name, class, preferred_device, sla_ms, None)
            }),
            Request::Protect { id: protected, buffer } => {
                let unusable_levels = self.scheduler.checkpoints().map(|c| c.unusable()).unwrap_or_default();
                self.in_session(id, |config, session| {
                if session.buffers.get(buffer).is_none() {
                    return Response::Error(ControlError::Checkpoint(format!(
                        "no buffer with handle {buffer} in this session; protect a buffer the session holds"
                    )));
                }
                if session.shared_memory.is_read_only_attachment(buffer) {
                    return Response::Error(ControlError::Checkpoint(format!(
                        "buffer {buffer:#x} is attached read-only: recovering a checkpoint into it would write its exporter's memory; protect a copy of your own"
                    )));
                }
                if !session.protected.contains_key(&protected) && session.protected.len() >= MAX_ARGS {
                    return Response::Error(ControlError::Checkpoint(format!(
                        "at most {MAX_ARGS} buffers can be protected in one session; pack small values into one buffer"
                    )));
                }
                session.protected.insert(protected, buffer);
                Response::Protected {
                    ids: session.protected.keys().copied().collect(),
                    interval_ms: config.checkpoint_interval.as_millis().try_into().unwrap_or(u64::MAX),
                    unusable: unusable_levels.clone(),
                }
            })
            }
            // Answered here, on the dispatcher, so no eviction can start between the check and
            // the claim.
            Request::ClaimHost { buffer } => self.in_session(id, |_, session| {
                let Some(record) = session.buffers.get(buffer) else {
                    return Response::Error(ControlError::BadRequest(format!(
                        "no buffer with handle {buffer:#x} in this session"
                    )));
                };
                if session.shared_memory.is_read_only_attachment(buffer) {
                    return Response::Error(ControlError::BadRequest(format!(
                        "buffer {buffer:#x} is attached read-only: its host copy cannot be written"
                    )));
                }
                Response::HostClaim {
                    granted: record.claim_host(),
                }
            }),
            Request::Recover => self.recover(id),
            Request::Checkpoints => {
                let Some(service) = self.scheduler.checkpoints().cloned() else {
                    return Some(Response::Error(ControlError::Checkpoint(
                        "the daemon has no checkpoint service".into(),
                    )));
                };
                let app = match self.conns.get(&id) {
                    Some(Conn::Session(session)) => {
                        crate::checkpoint::application(session.credentials.uid, &session.name)
                    }
                    _ => {
                        return Some(Response::Error(ControlError::BadRequest(
                            "open a session with Hello first".into(),
                        )))
                    }
                };
                self.offload(id, ControlJob::Checkpoints(service, app))
            }
            _ => Some(Response::Error(ControlError::BadRequest(
                "not a session request".into(),
            ))),
        }
    }

    /// `Request::Recover`: checks the session's protected buffers here (none in use by a task)
    /// and leaves the reading and writing to the control thread.
    fn recover(&mut self, id: u64) -> Option<Response> {
        let refuse = |message: String| Some(Response::Error(ControlError::Checkpoint(message)));
        let Some(service) = self.scheduler.checkpoints().cloned() else {
            return refuse("the daemon has no checkpoint service".into());
        };
        let job = match self.conns.get(&id)? {
            Conn::Session(session) => {
                if session.protected.is_empty() {
                    return refuse("nothing is protected in this session: protect the buffers to restore first (session.protect(id, buffer))".into());
                }
                let mut buffers = Vec::new();
                for (protected, handle) in &session.protected {
                    let Some(record) = session.buffers.get(*handle) else {
                        continue;
                    };
                    if record.in_use.load(Ordering::Acquire) != 0 || record.writing_back.load(Ordering::Acquire) {
                        return refuse(format!(
                            "protected id {protected} is in use by a task; recover before issuing tasks that use the protected buffers"
                        ));
                    }
                    buffers.push((*protected, record.clone()));
                }
                crate::checkpoint::RecoverJob {
                    service,
                    app: crate::checkpoint::application(session.credentials.uid, &session.name),
                    buffers,
                }
            }
            Conn::Pending { .. } => {
                return Some(Response::Error(ControlError::BadRequest(
                    "open a session with Hello first".into(),
                )))
            }
            Conn::Observer { .. } => return Some(observer_error()),
        };
        self.offload(id, ControlJob::Recover(Box::new(job)))
    }

    /// A pending connection whose request was refused becomes what the request would have
    /// made it: an observer unless it was a hello (which it may send again).
    fn observe_if_pending(&mut self, id: u64, request: &Request) {
        if !matches!(request, Request::Hello { .. }) {
            self.observe(id);
        }
    }

    /// Answers a request that needs an open session with `answer`.
    fn in_session(
        &mut self,
        id: u64,
        answer: impl FnOnce(&DaemonConfig, &mut Session) -> Response,
    ) -> Option<Response> {
        match self.conns.get_mut(&id)? {
            Conn::Pending { .. } => Some(Response::Error(ControlError::BadRequest(
                "open a session with Hello first".into(),
            ))),
            Conn::Observer { .. } => Some(observer_error()),
            Conn::Session(session) => Some(answer(&self.config, session)),
        }
    }

    /// `Request::BuildProgram`: checks what it can at once (session, name, permission, size,
    /// language, count) and hands the build to the control thread, which replies.
    fn build_program(
        &mut self,
        id: u64,
        language: String,
        code: Vec<u8>,
        manifest: Option<String>,
        name: String,
    ) -> Option<Response> {
        let refuse = |e: ControlError| Some(Response::Error(e));
        if let Err(e) = check_name("program", &name) {
            return refuse(e);
        }
        let config = &self.config;
        let session = match self.conns.get_mut(&id)? {
            Conn::Pending { .. } => {
                return refuse(ControlError::BadRequest("open a session with Hello first".into()));
            }
            Conn::Observer { .. } => return Some(observer_error()),
            Conn::Session(session) => session,
        };
        if let Err(e) = self.program_policy.check(&session.credentials) {
            return refuse(e);
        }
        if let Err(e) = crate::programs::check_request(&language, &code, manifest.as_deref()) {
            return refuse(e);
        }
        // Tenant OpenCL C and C run in the session's executor, on its shared memory; under strict
        // coherence every device computes on private copies the executor cannot see, so every
        // launch would fail with NoDevice. Said at the build, once, with what to do.
        if config.strict_coherence && matches!(language.as_str(), "opencl" | "c") {
            return refuse(ControlError::BadRequest(format!(
                "this daemon runs with strict coherence (--strict-coherence), where every device computes on private \
                 copies of the buffers, and tenant {language} programs run on the session's own memory: they cannot \
                 run here. Check your program's sync_to/sync_from on a daemon without strict coherence, or check \
                 the coherence of the rest with the library kernels here"
            )));
        }
        // The session's program count is checked by the builder: a build of a program it holds
        // already is no new program, and only the builder knows (it hashes the code).
        let programs = match &session.programs {
            Some(programs) => programs.clone(),
            None => {
                let created = crate::programs::SessionPrograms::new(
                    config,
                    session.id,
                    &session.shared.segment,
                    session.credentials.clone(),
                    session.program_kernels.clone(),
                );
                match created {
                    Ok(programs) => session.programs.insert(Arc::new(programs)).clone(),
                    Err(e) => return refuse(e),
                }
            }
        };
        let job = crate::programs::BuildJob {
            programs,
            cache: self.program_cache.clone(),
            language,
            code,
            manifest,
            name: if name.is_empty() { "program".into() } else { name },
            max_programs: config.max_programs,
            in_daemon: config.programs_in_daemon,
            on_gpus: config.programs_on_gpus,
            devices: self.scheduler.devices.iter().map(Arc::downgrade).collect(),
        };
        self.offload(id, ControlJob::BuildProgram(Box::new(job)))
    }

    /// A pending connection that asks for status or a drain becomes an observer (it may not
    /// open a session afterwards).
    fn observe(&mut self, id: u64) {
        if let Some(Conn::Pending { .. }) = self.conns.get(&id) {
            if let Some(Conn::Pending {
                stream,
                reader,
                credentials,
            }) = self.conns.remove(&id)
            {
                self.conns.insert(
                    id,
                    Conn::Observer {
                        stream,
                        reader,
                        credentials,
                    },
                );
            }
        }
    }

    /// Hands `job` to the control thread, which replies on the connection; answers here only if
    /// that is impossible.
    fn offload(&mut self, id: u64, job: ControlJob) -> Option<Response> {
        let stream = self.conns.get(&id)?.stream();
        let owed = self.owed.entry(id).or_default();
        match self.control.submit(stream, job, owed) {
            Ok(()) => None,
            Err(job) => Some(crate::control::answer(
                &crate::control::ControlContext {
                    telemetry: self.telemetry.clone(),
                    kernels: self.scheduler.kernels.clone(),
                },
                job,
            )),
        }
    }

    /// The sessions of live connections.
    fn live_sessions(&self) -> impl Iterator<Item = &Session> + '_ {
        self.conns.values().filter_map(|c| match c {
            Conn::Session(s) => Some(&**s),
            _ => None,
        })
    }

    /// Every session: live, and closing (its client gone, its work still in flight).
    fn every_session(&self) -> impl Iterator<Item = &Session> + '_ {
        self.live_sessions().chain(self.closing.iter().map(|s| &**s))
    }

    /// Work handed to lanes and not yet completed, all sessions (closing ones included).
    fn in_flight(&self) -> u64 {
        self.every_session()
            .map(|s| s.shared.in_flight.load(Ordering::Acquire))
            .sum()
    }

    fn shutdown(&mut self) -> Result<(), DaemonError> {
        // No more DAG releases.
        if let Some((service, thread)) = self.realtime.take() {
            service.stop();
            let _ = thread.join();
        }
        // 1. Nobody new: the socket goes first, so a client that starts now is told at once
        // that no daemon runs, and no ring is read again.
        let _ = epoll::delete(&self.epoll, &self.listener);
        self.ownership.socket_file.remove();
        let started = Instant::now();
        let deadline = started + self.config.shutdown_timeout;
        tracing::info!(
            sessions = self.conns.len(),
            in_flight = self.in_flight(),
            timeout_s = self.config.shutdown_timeout.as_secs_f64(),
            "shutting down: letting running work finish"
        );
        // 2. Work already on lanes finishes (its completions reach the clients) until the
        // deadline. Lanes post completions without this thread; it only reclaims sessions.
        while self.in_flight() > 0 && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(5));
            self.housekeeping();
        }
        // 3. Give up on the rest: closed segments take no more completions, so clients see
        // the daemon go away (`Disconnected`) rather than their tasks cancelled.
        let abandoned = self.in_flight();
        for session in self.every_session() {
            session.shared.close();
            session.shared.cancelled.store(true, Ordering::Release);
        }
        // 4. Stop the lanes: queued jobs are cancelled; a kernel still running cannot be
        // interrupted, so it is waited for only briefly (a helper thread owns the wait).
        let devices = self.scheduler.devices.clone();
        let (stopped, lanes_stopped) = std::sync::mpsc::channel();
        let stopper = std::thread::Builder::new()
            .name("agora-stop-lanes".into())
            .spawn(move || {
                for device in &devices {
                    device.shutdown();
                }
                let _ = stopped.send(());
            });
        let lanes_stopped = stopper.is_ok() && lanes_stopped.recv_timeout(LANE_STOP_WAIT).is_ok();
        if !lanes_stopped {
            tracing::warn!("a kernel is still running; exiting without waiting for it");
        }
        // After the lanes stopped (or were given up on), so every finished task is in the model.
        self.scheduler.save_model(&self.config.effective_state_dir());
        // Captured checkpoints are written before the daemon exits.
        if let Some(checkpoints) = self.scheduler.checkpoints() {
            checkpoints.stop();
        }
        if let Some(trace) = &self.telemetry.trace {
            match trace.save() {
                Ok((path, spans)) => tracing::info!(file = %path.display(), spans, "trace written"),
                Err(e) => tracing::error!(error = %e, "could not write the trace"),
            }
        }
        if abandoned > 0 {
            // Work given up on: its clients see the daemon go and issue it again.
            tracing::warn!(
                abandoned,
                seconds = started.elapsed().as_secs_f64(),
                "stopped with work still running (shutdown_timeout reached)"
            );
        } else {
            tracing::info!(seconds = started.elapsed().as_secs_f64(), "stopped");
        }
        self.conns.clear();
        self.closing.clear();
        self.owed.clear();
        let _ = self.listener.as_fd();
        Ok(())
    }
}

/// How long shutdown waits for the lanes to stop once it has given up on their work: a kernel
/// that is running cannot be interrupted, and the daemon does not wait for it.
const LANE_STOP_WAIT: Duration = Duration::from_millis(200);

/// `Request::CreateQueue`.
fn create_queue(
    config: &DaemonConfig,
    session: &mut Session,
    name: String,
    class: agora_protocol::control::QueueClass,
    preferred_device: Option<String>,
    sla_ms: Option<f64>,
    resumed_handle: Option<u64>,
) -> Response {
    if let Err(refusal) = check_name("queue", &name) {
        return Response::Error(refusal);
    }
    if let Some(ms) = sla_ms {
        if !(ms.is_finite() && ms > 0.0 && ms <= 3.6e6) {
            return Response::Error(ControlError::BadRequest(format!(
                "queue SLA of {ms} ms: give a response-time target between 0 and one hour, or none"
            )));
        }
    }
    let preferred = match preferred_device.as_deref() {
        None | Some("any") => None,
        Some(kind) => match DeviceKind::parse(kind) {
            Some(k) => Some(k),
            None => {
                let kinds: Vec<_> = DeviceKind::ALL.iter().map(|k| k.name()).collect();
                return Response::Error(ControlError::BadRequest(format!(
                    "unknown device kind '{kind}': use {} or any",
                    kinds.join(", ")
                )));
            }
        },
    };
    if class == agora_protocol::control::QueueClass::Latency
        && !session.job_latency
        && !may_open_latency(config, &session.credentials)
    {
        return Response::Error(ControlError::NotPermitted(format!(
            "uid {} (in groups {:?}) may not open latency-class queues; this daemon allows uids {:?} and members of \
             groups {:?} (sessions.latency_uids / latency_gids): use a batch queue or ask the operator",
            session.credentials.uid,
            session.credentials.all_groups(),
            config.latency_uids,
            config.latency_gids
        )));
    }
    let queue = QueueState::new(&name, class, preferred, sla_ms.map(|ms| ms * 1e6));
    if let Some(handle) = resumed_handle {
        return match session.queues.insert_at(handle, queue) {
            Ok(()) => Response::Queue { handle },
            Err(why) => Response::Error(ControlError::BadRequest(format!("queue handle {handle:#x}: {why}"))),
        };
    }
    match session.queues.insert(queue) {
        Some(handle) => Response::Queue { handle },
        None => Response::Error(ControlError::TooMany {
            what: "queues".into(),
            limit: config.max_queues as u64,
        }),
    }
}

fn observer_error() -> Response {
    Response::Error(ControlError::BadRequest("this connection is an observer".into()))
}

/// A device's own report as the control protocol shows it (not yet draining; the caller knows).
fn device_status(report: agora_devices::DeviceReport) -> DeviceStatus {
    DeviceStatus {
        name: report.name,
        kind: report.kind,
        description: report.description,
        memory_bytes: report.memory_bytes,
        memory_used: report.memory_used,
        memory_cached: report.memory_cached,
        utilization_percent: report.utilization_percent,
        threads_per_lane: report.threads_per_lane as u32,
        lanes: report
            .lanes
            .into_iter()
            .map(|lane| LaneStatus {
                busy: lane.busy,
                queued: lane.queued,
                completed: lane.completed,
                busy_ns: lane.busy_ns,
            })
            .collect(),
        draining: false,
        failed: report.failed,
    }
}

/// Whether a client may open latency-class queues (both lists empty: everyone may).
fn may_open_latency(config: &DaemonConfig, who: &crate::session::Credentials) -> bool {
    (config.latency_uids.is_empty() && config.latency_gids.is_empty())
        || config.latency_uids.contains(&who.uid)
        || who.in_any_group(&config.latency_gids)
}
