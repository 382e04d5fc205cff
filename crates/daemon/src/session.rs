//! Per-client state: the segment, the rings' daemon ends, queues, buffers, heap and counters.
//!
//! Must not know about devices: the scheduler turns a session's descriptors into device jobs.

use std::os::unix::net::UnixStream;
use std::sync::atomic::{fence, AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock};

use agora_protocol::control::{
    encoded_len, ControlError, QueueClass, QueueStatus, SessionDetails, SessionStatus, REPLY_BUDGET, STATUS_QUEUES,
};
use agora_protocol::ring::{CompletionProducer, SubmissionConsumer};
use agora_protocol::Completion;
use agora_transport::shm::Segment;
use agora_transport::socket::FrameReader;
use agora_transport::wake::{futex_wake_all, Doorbell};

use crate::handle::HandleTable;
use crate::memory::{BufferRecord, DeviceUsage, Heap, HostMemory, UnreadReleases};

/// Back-pressure: a session with this many jobs on lanes gets no more of its descriptors taken
/// from its ring until some finish (its ring fills and its client waits for room). A sliced
/// launch is one job however many slices it has (its lane makes them as it starts them), so
/// this bounds the daemon's memory for queued work per session.
pub(crate) const MAX_LANE_JOBS: u64 = 4096;

/// What a session's outstanding lane work lets the dispatcher take from its ring.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum LaneRoom {
    /// Anything.
    Open,
    /// Descriptors of latency-class queues (and of none: they fail or complete without lanes).
    LatencyOnly,
    /// Nothing, until lanes finish some of its jobs.
    Closed,
}

/// Who is at the other end of a connection: pid, uid and primary gid from `SO_PEERCRED`, and
/// the supplementary groups from `SO_PEERGROUPS`, both as the kernel recorded them when the
/// peer connected (so a peer cannot change them afterwards, and no pid can be reused between
/// the accept and the read).
#[derive(Debug, Clone, Default)]
pub(crate) struct Credentials {
    pub pid: i32,
    pub uid: u32,
    pub gid: u32,
    /// The supplementary groups; empty when the kernel could not say (`SO_PEERGROUPS` needs
    /// Linux 4.13), and then only `gid` counts. Shared: credentials are copied into every
    /// session and reply that checks them.
    pub groups: Arc<[u32]>,
}

impl Credentials {
    /// Whether the peer is a member of any group of `gids`: its primary gid or one of its
    /// supplementary groups, as the kernel counts membership for the socket's own group
    /// permission (`socket_access = "group:NAME"`). Every group-based permission asks this.
    pub(crate) fn in_any_group(&self, gids: &[u32]) -> bool {
        gids.contains(&self.gid) || self.groups.iter().any(|g| gids.contains(g))
    }

    /// The primary gid and then the supplementary groups not equal to it, for refusals that
    /// say which groups the peer is in.
    pub(crate) fn all_groups(&self) -> Vec<u32> {
        let mut all = vec![self.gid];
        all.extend(self.groups.iter().filter(|&&g| g != self.gid));
        all
    }
}

/// What keeps a session's segment registered with one device (see [`SessionShared::pin_for`]).
type PinGuard = Box<dyn std::any::Any + Send + Sync>;

/// The part of a session that lanes touch when a job completes.
#[derive(Debug)]
pub(crate) struct SessionShared {
    /// Session id and client name, for traces.
    pub id: u64,
    pub tenant: Arc<str>,
    /// The segment's registrations with devices that copy from registered host memory without
    /// a staging copy (GPUs), by device index. Declared before `segment`: the registrations go
    /// before the memory is unmapped.
    pinned: Mutex<Vec<(usize, Option<PinGuard>)>>,
    pub segment: Segment,
    completions: Mutex<CompletionProducer>,
    /// Set when the client is gone: queued jobs are skipped.
    pub cancelled: Arc<AtomicBool>,
    pub completed: AtomicU64,
    pub failed: AtomicU64,
    /// Jobs handed to lanes and not yet completed.
    pub in_flight: AtomicU64,
    /// Back-pressure ([`Session::lane_admits_head`]): this session's jobs on lanes (handed to a
    /// lane, not finished), and the predicted nanoseconds of its batch-class ones among them.
    pub lane_jobs: AtomicU64,
    pub lane_ns: AtomicU64,
    /// Back-pressure: once its batch-class jobs on lanes are predicted to run this long, no more
    /// batch-class descriptors are taken from its ring until lanes finish some; a descriptor of
    /// a latency-class queue at the ring's head is still taken (`sessions.lane_work_ms`).
    /// Enough to keep the lanes busy, not enough to queue minutes of work that nothing can
    /// reorder or take back.
    pub max_lane_ns: u64,
    /// The dispatcher stopped taking this session's descriptors over the lane limits: the lane
    /// job that brings it back under them wakes the dispatcher.
    pub throttled: AtomicBool,
    /// Bytes planned to move host → device and device → host for this session.
    pub bytes_to_device: AtomicU64,
    pub bytes_to_host: AtomicU64,
    /// Device memory this session's buffers hold, per device (for quotas).
    pub device_usage: Arc<DeviceUsage>,
    /// Buffers released with their newest contents on a device, never read back.
    pub unread: Arc<UnreadReleases>,
    /// The real-time service, once the session declared a DAG: completions of its DAG node jobs
    /// ([`crate::realtime::DAG_TASK_BIT`]) go there, not to the client's ring.
    pub realtime: OnceLock<Arc<crate::realtime::Realtime>>,
    /// Execution time of its tasks per device index (the first [`ACCOUNTED_DEVICES`]),
    /// nanoseconds, for its Slurm job's accounting.
    pub device_ns: [AtomicU64; ACCOUNTED_DEVICES],
    /// The session's device-memory quota when its Slurm job sets one (bytes; 0: the daemon's
    /// `[sessions] device_quota`).
    pub device_quota: AtomicU64,
    /// The weight of the session's group (`device_usage.group`) in a lane's fair order of batch
    /// work ([`agora_devices::Share`]): the session is a tenant (weight 1) of its user's group
    /// (weight 1), or of its Slurm job's group (all the job's sessions), weighted by the job's
    /// shares. So a user gets no more of a lane, nor of a device's memory, for opening more
    /// sessions.
    pub share_group_weight: AtomicU32,
}

/// Groups of Slurm jobs have this bit set beside the job id.
pub(crate) const JOB_GROUP: u64 = 1 << 63;

/// Groups of users have this bit set beside the uid (and never [`JOB_GROUP`]'s).
pub(crate) const USER_GROUP: u64 = 1 << 62;

/// Devices whose time a session accounts (by index; later ones are not accounted).
pub(crate) const ACCOUNTED_DEVICES: usize = 16;

impl HostMemory for SessionShared {
    fn host_range(&self, offset: u64, len: u64) -> Option<*mut u8> {
        self.segment.view().heap_range(offset, len)
    }
}

impl SessionShared {
    /// A lane job's share: this session's tenant and weight, charged `predicted_ns` (at least a
    /// microsecond: transfers and fills are not predicted, and cost something).
    pub fn lane_share(&self, predicted_ns: u64) -> agora_devices::Share {
        agora_devices::Share {
            group: self.device_usage.group.load(Ordering::Relaxed),
            group_weight: self.share_group_weight.load(Ordering::Relaxed).max(1),
            tenant: self.id,
            weight: 1,
            cost_ns: predicted_ns.max(1_000),
        }
    }

    /// Makes the session a tenant of `group` (its Slurm job's) of weight `weight` on the lanes'
    /// fair order, and a part of that group's fair share of device memory.
    pub fn join_group(&self, group: u64, weight: u32) {
        self.share_group_weight.store(weight.max(1), Ordering::Relaxed);
        self.device_usage.group.store(group, Ordering::Relaxed);
    }

    /// Registers the segment with `device` (index `index`) the first time one of the session's
    /// tasks moves data to or from it, for devices that map it (device hosts) or page-lock it
    /// (GPUs, within the per-user limit of `books`; `uid` is the session's user:
    /// [`Device::register_host_memory`](agora_devices::Device::register_host_memory)). Tried once per device: a refusal (the
    /// limit, or the driver's) is logged and copies go through the driver's staging instead.
    pub fn pin_for(
        &self,
        index: usize,
        device: &dyn agora_devices::Device,
        uid: u32,
        books: &Arc<crate::memory::pinned::PinnedBooks>,
    ) {
        let mut pinned = self.pinned.lock().unwrap_or_else(|e| e.into_inner());
        if pinned.iter().any(|(i, _)| *i == index) {
            return;
        }
        if !device.maps_host_memory() && !device.wants_pinned_host_memory() {
            pinned.push((index, None));
            return;
        }
        // Page-locked memory counts against the user's limit; past it, copies go through the
        // driver's staging buffer. A device in a device host still maps the segment (it cannot
        // reach host memory otherwise), just without locking it.
        let bytes = self.segment.len();
        let ticket = if device.wants_pinned_host_memory() {
            match books.take(uid, bytes as u64) {
                Ok(ticket) => Some(ticket),
                Err(held) => {
                    tracing::warn!(
                        session = self.id,
                        uid,
                        device = %device.info().name,
                        bytes,
                        held,
                        limit = books.limit(),
                        "registering this session's memory with the device would pass the user's page-locked memory limit ([cuda] pinned_limit_per_user): its copies go through the driver's staging buffer"
                    );
                    None
                }
            }
        } else {
            None
        };
        let view = self.segment.view();
        let started = std::time::Instant::now();
        let guard = match device.register_host_memory(view.base(), bytes, self.segment.fd(), ticket.is_some()) {
            None => None,
            Some(Ok(guard)) => {
                tracing::debug!(session = self.id, device = %device.info().name, bytes, page_locked = ticket.is_some(), took_us = started.elapsed().as_micros() as u64, "segment registered");
                // The device's registration goes first, then the user's bytes come back.
                Some(Box::new((guard, ticket)) as PinGuard)
            }
            Some(Err(why)) => {
                tracing::warn!(session = self.id, device = %device.info().name, "{why}");
                None
            }
        };
        pinned.push((index, guard));
    }

    /// Posts completions (in order) and wakes the client if it sleeps.
    pub(crate) fn post(&self, completions: &[Completion]) {
        self.post_releasing(completions, || {});
    }

    /// Posts completions like [`SessionShared::post`], running `release` first while holding
    /// the ring: a lane job releases its queue's in-flight count there, so the queue looks idle
    /// to the dispatcher no later than the client can see the completion (it may then run the
    /// queue's next task inline at once), and any completion the dispatcher posts after seeing
    /// it idle still lands after this one.
    pub(crate) fn post_releasing(&self, completions: &[Completion], release: impl FnOnce()) {
        if let Some(realtime) = self.realtime.get() {
            if completions.iter().any(|c| crate::realtime::is_dag_task(c.task_id)) {
                // DAG node jobs report to their release, not to the client; the rest go on (a
                // client's own task id with the DAG bit that routes nowhere included).
                let (nodes, own): (Vec<Completion>, Vec<Completion>) = completions
                    .iter()
                    .cloned()
                    .partition(|c| crate::realtime::is_dag_task(c.task_id) && realtime.owns(self.id, c.task_id));
                if own.is_empty() {
                    release();
                } else {
                    self.post_releasing(&own, release);
                }
                for node in nodes {
                    realtime.node_done(node.task_id, node.result());
                }
                return;
            }
        }
        if completions.is_empty() || self.is_closed() {
            // Once the daemon has given up on the session at shutdown, the jobs it cancels post
            // nothing: the client reports their tasks as `Disconnected` (the daemon went away),
            // not as cancelled by their own program.
            release();
            return;
        }
        {
            let mut producer = self.completions.lock().unwrap_or_else(|e| e.into_inner());
            release();
            for c in completions {
                producer.push(c);
            }
        }
        let mut failed = 0;
        let mut newest = 0;
        for c in completions {
            failed += u64::from(c.code != 0);
            newest = newest.max(c.task_id);
        }
        self.failed.fetch_add(failed, Ordering::Relaxed);
        self.completed
            .fetch_add(completions.len() as u64 - failed, Ordering::Relaxed);
        // Pairs with the client's fence between announcing itself in `client_waiters` and its
        // last look at the tail: one of us sees the other's write.
        fence(Ordering::SeqCst);
        let header = self.segment.view().header();
        if header.client_waiters.load(Ordering::Relaxed) != 0
            && newest >= header.client_wait_for.load(Ordering::Relaxed)
        {
            futex_wake_all(&header.completion_tail);
        }
    }

    /// One of its tasks ran `ns` nanoseconds on device `device`.
    pub(crate) fn add_device_time(&self, device: usize, ns: u64) {
        if let Some(counter) = self.device_ns.get(device) {
            counter.fetch_add(ns, Ordering::Relaxed);
        }
    }

    /// A job of this session (predicted `batch_ns` if batch-class, else 0) went to a lane.
    pub(crate) fn lane_work_started(&self, batch_ns: u64) {
        self.lane_jobs.fetch_add(1, Ordering::SeqCst);
        self.lane_ns.fetch_add(batch_ns, Ordering::SeqCst);
    }

    /// The job [`SessionShared::lane_work_started`] counted is done; true when the dispatcher
    /// stopped taking the session's descriptors and must now be woken to take them again.
    pub(crate) fn lane_work_done(&self, batch_ns: u64) -> bool {
        self.lane_jobs.fetch_sub(1, Ordering::SeqCst);
        self.lane_ns.fetch_sub(batch_ns, Ordering::SeqCst);
        // SeqCst with the dispatcher's store of `throttled` before its second look at the
        // counters: either it sees these decrements or this sees it throttled.
        self.throttled.load(Ordering::SeqCst)
            && self.lane_room() != LaneRoom::Closed
            && self.throttled.swap(false, Ordering::SeqCst)
    }

    /// What the session's outstanding lane work lets the dispatcher take.
    pub(crate) fn lane_room(&self) -> LaneRoom {
        if self.lane_jobs.load(Ordering::SeqCst) >= MAX_LANE_JOBS {
            LaneRoom::Closed
        } else if self.lane_ns.load(Ordering::SeqCst) >= self.max_lane_ns {
            LaneRoom::LatencyOnly
        } else {
            LaneRoom::Open
        }
    }

    /// Whether [`SessionShared::close`] was called.
    pub(crate) fn is_closed(&self) -> bool {
        self.segment.view().header().daemon_closed.load(Ordering::Acquire) != 0
    }

    /// Tells a waiting client the daemon is going away; completions are no longer posted.
    pub(crate) fn close(&self) {
        self.close_as(agora_protocol::segment::DAEMON_SHUT_DOWN);
    }

    /// Tells the client the daemon ended its session (it must not resume it on this daemon);
    /// completions are no longer posted.
    pub(crate) fn end(&self) {
        self.close_as(agora_protocol::segment::SESSION_ENDED);
    }

    fn close_as(&self, why: u32) {
        let header = self.segment.view().header();
        header.daemon_closed.store(why, Ordering::Release);
        // Bump the futex word's neighbour-free way: waking is enough, waiters re-check the flag.
        futex_wake_all(&header.completion_tail);
    }
}

/// A device and lane, packed into 32 bits (`device << 16 | lane`) so a queue's binding fits in
/// an atomic that lane threads read without a lock.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Binding(u32);

impl Binding {
    /// No lane yet.
    pub(crate) const UNBOUND: Binding = Binding(u32::MAX);

    /// Lane `lane` of device `device` (both below 2^16: devices and lanes are few).
    pub(crate) fn new(device: usize, lane: usize) -> Binding {
        debug_assert!(device < 0xffff && lane <= 0xffff);
        Binding(((device as u32) << 16) | lane as u32)
    }

    /// The device's index.
    pub(crate) fn device(self) -> usize {
        (self.0 >> 16) as usize
    }

    /// The lane's index on its device.
    pub(crate) fn lane(self) -> usize {
        (self.0 & 0xffff) as usize
    }

    /// Whether this names no lane.
    pub(crate) fn is_unbound(self) -> bool {
        self == Binding::UNBOUND
    }
}

/// A [`Binding`] that the dispatcher sets and lane threads read; beside it, the binding whose
/// leaving was last counted as a migration ([`AtomicBinding::first_move_from`]).
#[derive(Debug)]
pub(crate) struct AtomicBinding(AtomicU32, AtomicU32);

impl AtomicBinding {
    /// Unbound.
    pub(crate) fn unbound() -> Self {
        AtomicBinding(AtomicU32::new(Binding::UNBOUND.0), AtomicU32::new(Binding::UNBOUND.0))
    }

    pub(crate) fn load(&self) -> Binding {
        Binding(self.0.load(Ordering::Relaxed))
    }

    pub(crate) fn store(&self, binding: Binding) {
        self.0.store(binding.0, Ordering::Relaxed);
    }

    /// Whether leaving `binding` is news: true the first time it is called with a given
    /// binding, so a queue moving off a draining device counts once in the migration
    /// statistics however many of its tasks see it leave.
    pub(crate) fn first_move_from(&self, binding: Binding) -> bool {
        self.1.swap(binding.0, Ordering::Relaxed) != binding.0
    }
}

/// A queue as the daemon tracks it.
#[derive(Debug)]
pub(crate) struct QueueState {
    pub name: Arc<str>,
    pub class: QueueClass,
    /// Device kind the client prefers, honoured when a device of that kind implements the kernel.
    pub preferred: Option<agora_devices::DeviceKind>,
    /// Response-time target of each task of a latency-class queue, nanoseconds (`None`: the
    /// daemon's default).
    pub sla_ns: Option<f64>,
    /// Jobs of this queue handed to a lane and not completed.
    pub in_flight: AtomicU32,
    /// The lane the queue is bound to while `in_flight > 0` (afterwards: where its last task
    /// ran; unbound before its first task went to a lane). Read with [`QueueState::binding`].
    pub binding: AtomicBinding,
    /// Being moved to another device: its new tasks are held until its in-flight ones finish
    /// (set and cleared by the scheduler's migration; lanes read it to wake the dispatcher).
    pub moving: AtomicBool,
    /// Its tasks in flight went to a device to measure the kernel there for the first time: its
    /// later tasks wait for that measurement, then are placed by it (`Scheduler::must_hold`),
    /// rather than follow the first to a device that may prove many times slower. Written by the
    /// dispatcher only, when it places the queue afresh.
    pub exploring: AtomicBool,
    /// Its lane jobs settle and post their completions in issue order.
    pub sequencer: crate::outcome::Sequencer,
}

impl QueueState {
    /// A new queue, idle and unbound until its first task goes to a lane; its name is cut to 64
    /// characters for status displays.
    pub(crate) fn new(
        name: &str,
        class: QueueClass,
        preferred: Option<agora_devices::DeviceKind>,
        sla_ns: Option<f64>,
    ) -> Arc<QueueState> {
        Arc::new(QueueState {
            name: Arc::from(name.chars().take(64).collect::<String>()),
            class,
            preferred,
            sla_ns,
            in_flight: Default::default(),
            binding: AtomicBinding::unbound(),
            moving: Default::default(),
            exploring: Default::default(),
            sequencer: Default::default(),
        })
    }
}

/// One client session.
#[derive(Debug)]
pub(crate) struct Session {
    pub id: u64,
    pub credentials: Credentials,
    pub name: String,
    /// Shared with the control thread's replies (never duplicated: see `ControlPlane::submit`).
    pub stream: Arc<UnixStream>,
    pub reader: FrameReader,
    pub doorbell: Doorbell,
    pub shared: Arc<SessionShared>,
    pub submissions: SubmissionConsumer,
    pub queues: HandleTable<Arc<QueueState>>,
    pub buffers: HandleTable<Arc<BufferRecord>>,
    pub heap: Heap,
    /// Released buffers still named by running jobs; their heap range is freed when the last
    /// job drops its reference.
    pub zombies: Vec<Arc<BufferRecord>>,
    /// Descriptors taken from the ring so far (wrapping), for admission control.
    pub ingested: u32,
    pub submitted: u64,
    pub completion_capacity: u32,
    /// Kernels of the session's own programs (tenant code run by its executor), by id without
    /// [`crate::kernels::SESSION_KERNEL_BIT`]; the builder thread adds to it.
    pub program_kernels: Arc<crate::programs::ProgramKernels>,
    /// The session's programs and executor, from its first build on.
    pub programs: Option<Arc<crate::programs::SessionPrograms>>,
    /// While a resume is still arriving in parts: the new ids of the kernels the client named
    /// (sent with the last part's reply).
    pub resuming: Option<Vec<Option<u32>>>,
    /// The segment memfd's identity (device, inode): a resume must not hand back a segment a
    /// session of this daemon still uses.
    pub segment_identity: (u64, u64),
    /// Buffers protected for checkpoints (`Protect`), by the application's id for them.
    pub protected: std::collections::BTreeMap<u32, u64>,
    /// Exportable buffers and attachments: what they hold against the session's limit.
    pub shared_memory: crate::exports::SessionSharing,
    /// The Slurm job its process belongs to (`JobStart`), if any.
    pub job: Option<u64>,
    /// Its job lets it open latency-class queues.
    pub job_latency: bool,
    /// The segment's `control_sent` as the dispatcher last saw it: a change while it spins
    /// makes it look at the control sockets at once (`Server::control_sent`).
    pub control_seen: std::cell::Cell<u32>,
}

impl Session {
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn new(
        id: u64,
        credentials: Credentials,
        name: String,
        stream: Arc<UnixStream>,
        reader: FrameReader,
        doorbell: Doorbell,
        segment: Segment,
        max_queues: usize,
        max_buffers: usize,
        max_lane_ns: u64,
    ) -> Self {
        let view = *segment.view();
        let segment_identity = segment_identity(segment.fd());
        let heap = Heap::new(view.geometry().heap_len);
        let completion_capacity = view.geometry().completion_capacity;
        let tenant: Arc<str> = Arc::from(name.as_str());
        let uid = credentials.uid;
        Session {
            id,
            credentials,
            name,
            stream,
            reader,
            doorbell,
            submissions: SubmissionConsumer::new(view),
            shared: Arc::new(SessionShared {
                id,
                tenant: tenant.clone(),
                completions: Mutex::new(CompletionProducer::new(view)),
                pinned: Mutex::new(Vec::new()),
                segment,
                cancelled: Arc::new(AtomicBool::new(false)),
                completed: AtomicU64::new(0),
                failed: AtomicU64::new(0),
                in_flight: AtomicU64::new(0),
                lane_jobs: AtomicU64::new(0),
                lane_ns: AtomicU64::new(0),
                throttled: AtomicBool::new(false),
                max_lane_ns,
                bytes_to_device: AtomicU64::new(0),
                bytes_to_host: AtomicU64::new(0),
                device_usage: Arc::new(DeviceUsage::in_group(id, USER_GROUP | u64::from(uid))),
                unread: Arc::new(UnreadReleases {
                    session: id,
                    ..Default::default()
                }),
                realtime: OnceLock::new(),
                device_ns: Default::default(),
                device_quota: AtomicU64::new(0),
                share_group_weight: AtomicU32::new(1),
            }),
            queues: HandleTable::new(max_queues),
            buffers: HandleTable::new(max_buffers),
            heap,
            zombies: Vec::new(),
            ingested: 0,
            submitted: 0,
            completion_capacity,
            program_kernels: Arc::default(),
            programs: None,
            resuming: None,
            segment_identity,
            protected: std::collections::BTreeMap::new(),
            shared_memory: crate::exports::SessionSharing::new(view.geometry().heap_len),
            job: None,
            job_latency: false,
            control_seen: std::cell::Cell::new(view.header().control_sent.load(Ordering::Relaxed)),
        }
    }

    /// Takes over the rings of a segment an earlier daemon served (a resumed session): the
    /// descriptors that daemon had not taken are dropped, and completions continue at the
    /// submission tail (the client fails the tasks it lost, moves its head there itself and
    /// issues the untaken ones again, after this reply: until then it posts nothing). Also clears what the
    /// earlier daemon may have left in the header (closed, asleep).
    pub(crate) fn take_over_rings(&mut self) {
        let view = *self.shared.segment.view();
        let (submissions, tail) = SubmissionConsumer::resume(view);
        self.submissions = submissions;
        self.ingested = tail;
        *self.shared.completions.lock().unwrap_or_else(|e| e.into_inner()) = CompletionProducer::resume(view, tail);
        let header = view.header();
        header.daemon_closed.store(0, Ordering::Release);
        header.daemon_sleeping.store(0, Ordering::Release);
    }

    /// The record of a buffer of this session at `offset` in its heap.
    fn buffer_record(&self, offset: u64, len: u64) -> BufferRecord {
        let owner: std::sync::Weak<dyn HostMemory> = Arc::downgrade(&self.shared) as std::sync::Weak<dyn HostMemory>;
        BufferRecord::new(
            offset,
            len,
            self.shared.device_usage.clone(),
            owner,
            self.shared.unread.clone(),
        )
    }

    /// Registers a buffer of a resumed session under its old handle and heap range. `lost`: its
    /// newest contents were on a device of the earlier daemon, so it reads as `DataLost` until
    /// written whole. Refuses (with the reason) a range outside the heap or over another
    /// buffer, and a handle the table cannot take.
    pub(crate) fn resume_buffer(&mut self, handle: u64, offset: u64, len: u64, lost: bool) -> Result<(), String> {
        if len == 0 || !self.heap.reserve(offset, len) {
            return Err(format!(
                "buffer {handle:#x}: bytes {offset}..+{len} are empty, misaligned, outside the heap or over another buffer"
            ));
        }
        let record = self.buffer_record(offset, len);
        if lost {
            record.placement().mark_lost();
        }
        self.buffers.insert_at(handle, Arc::new(record)).map_err(|why| {
            self.heap.free(offset, len);
            format!("buffer handle {handle:#x}: {why}")
        })
    }

    /// Kernel `index` of the session's programs.
    #[inline]
    pub(crate) fn program_kernel(&self, index: u32) -> Option<agora_kernels::KernelRef> {
        self.program_kernels.get(index)
    }

    /// How many more descriptors we may take before the client must consume completions.
    pub(crate) fn admission_room(&self) -> u32 {
        let head = self
            .shared
            .segment
            .view()
            .header()
            .completion_head
            .load(Ordering::Acquire);
        let outstanding = self.ingested.wrapping_sub(head);
        // A head the client could not honestly have published counts as a full ring.
        self.completion_capacity.saturating_sub(outstanding)
    }

    /// Whether the descriptor at the head of the ring may be taken now, as far as the session's
    /// outstanding lane work goes ([`LaneRoom`]). Call only when one is available. When not, the
    /// session is marked throttled, so that the lane job that makes room wakes the dispatcher.
    pub(crate) fn lane_admits_head(&self) -> bool {
        let admits = |room: LaneRoom| match room {
            LaneRoom::Open => true,
            LaneRoom::Closed => false,
            LaneRoom::LatencyOnly => {
                let head = self.submissions.peek();
                self.queues.get(head.queue).is_none_or(|q| q.class != QueueClass::Batch)
            }
        };
        if admits(self.shared.lane_room()) {
            return true;
        }
        self.shared.throttled.store(true, Ordering::SeqCst);
        // A second look after announcing it (pairs with `lane_work_done`).
        admits(self.shared.lane_room())
    }

    pub(crate) fn alloc_buffer(&mut self, len: u64) -> Result<(u64, u64), ControlError> {
        if len == 0 {
            return Err(ControlError::EmptyBuffer);
        }
        self.reclaim_zombies();
        let Some(offset) = self.heap.alloc(len) else {
            return Err(ControlError::QuotaExceeded {
                requested: len,
                available: self.heap.capacity() - self.heap.used(),
                largest_free: self.heap.largest_free(),
                quota: self.heap.capacity(),
            });
        };
        let record = self.buffer_record(offset, len);
        match self.buffers.insert(Arc::new(record)) {
            Some(handle) => Ok((handle, offset)),
            None => {
                self.heap.free(offset, len);
                Err(ControlError::TooMany {
                    what: "buffers".into(),
                    limit: self.buffers.len() as u64,
                })
            }
        }
    }

    /// Allocates an exportable buffer (its own region, see [`crate::exports`]); returns its
    /// handle and region (whose memfd goes to the client).
    pub(crate) fn alloc_shared(&mut self, len: u64) -> Result<(u64, Arc<agora_transport::shm::Region>), ControlError> {
        if len == 0 {
            return Err(ControlError::EmptyBuffer);
        }
        self.shared_memory.reserve(len)?;
        let region = match agora_transport::shm::Region::create("agora-shared", len) {
            Ok(region) => Arc::new(region),
            Err(e) => {
                self.shared_memory.give_back(len);
                return Err(ControlError::Export(format!(
                    "could not create the memory of a {len}-byte exportable buffer: {e}"
                )));
            }
        };
        let record = self.region_record(region.clone());
        self.insert_shared(Arc::new(record), len).map(|handle| (handle, region))
    }

    /// Registers a buffer of another session's region under a new handle of this one (an
    /// attachment; `len` was reserved against this session's limit by the caller).
    pub(crate) fn insert_shared(&mut self, record: Arc<BufferRecord>, len: u64) -> Result<u64, ControlError> {
        match self.buffers.insert(record) {
            Some(handle) => Ok(handle),
            None => {
                self.shared_memory.give_back(len);
                Err(ControlError::TooMany {
                    what: "buffers".into(),
                    limit: self.buffers.len() as u64,
                })
            }
        }
    }

    fn region_record(&self, region: Arc<agora_transport::shm::Region>) -> BufferRecord {
        let owner: std::sync::Weak<dyn HostMemory> = Arc::downgrade(&self.shared) as std::sync::Weak<dyn HostMemory>;
        BufferRecord::in_region(
            region,
            self.shared.device_usage.clone(),
            owner,
            self.shared.unread.clone(),
        )
    }

    pub(crate) fn release_buffer(&mut self, handle: u64) -> bool {
        match self.buffers.remove(handle) {
            Some(record) if record.region.is_some() => {
                // No heap range to free: the region goes with the last holder of the record (a
                // job, an attacher). Its export, if any, ends; an attachment is left.
                self.protected.retain(|_, protected| *protected != handle);
                self.shared_memory.released(handle, record.len);
                true
            }
            Some(record) => {
                // A released buffer is no longer protected (later checkpoints leave it out).
                self.protected.retain(|_, protected| *protected != handle);
                self.zombies.push(record);
                self.reclaim_zombies();
                true
            }
            None => false,
        }
    }

    /// Frees the heap ranges of released buffers that no job references any more.
    pub(crate) fn reclaim_zombies(&mut self) {
        let heap = &mut self.heap;
        self.zombies.retain(|record| {
            if Arc::strong_count(record) == 1 {
                heap.free(record.offset, record.len);
                false
            } else {
                true
            }
        });
    }

    /// The session with its busiest queues (at most [`STATUS_QUEUES`], listed in handle order):
    /// its entry in a status report, bounded whatever the client created.
    pub(crate) fn status(&self, device_names: &[String]) -> SessionStatus {
        let mut busiest: Vec<(usize, &Arc<QueueState>)> = self.queues.values_from(0).collect();
        // Most in flight first; ties keep handle order (the sort is stable).
        busiest.sort_by_key(|(_, q)| std::cmp::Reverse(q.in_flight.load(Ordering::Relaxed)));
        busiest.truncate(STATUS_QUEUES);
        busiest.sort_by_key(|(slot, _)| *slot);
        let mut status = self.summary();
        status.queues = busiest.into_iter().map(|(_, q)| q.status(device_names)).collect();
        status
    }

    /// The session with one page of its queues, from slot `first` on, as many as fit in
    /// [`REPLY_BUDGET`] bytes; and the slot the next page starts at, if any.
    pub(crate) fn details(&self, device_names: &[String], first: u64) -> SessionDetails {
        let mut session = self.summary();
        let mut bytes = encoded_len(&session);
        let mut next_queue = None;
        for (slot, queue) in self.queues.values_from(usize::try_from(first).unwrap_or(usize::MAX)) {
            let entry = queue.status(device_names);
            let len = encoded_len(&entry);
            if bytes + len > REPLY_BUDGET && !session.queues.is_empty() {
                next_queue = Some(slot as u64);
                break;
            }
            bytes += len;
            session.queues.push(entry);
        }
        SessionDetails {
            session,
            first_queue: first,
            next_queue,
        }
    }

    /// Everything but the queue list.
    fn summary(&self) -> SessionStatus {
        let shared = &self.shared;
        SessionStatus {
            id: self.id,
            pid: self.credentials.pid,
            uid: self.credentials.uid,
            gid: self.credentials.gid,
            name: self.name.clone(),
            queues: Vec::new(),
            queue_count: self.queues.len() as u64,
            latency_queues: self.queues.values().filter(|q| q.class == QueueClass::Latency).count() as u64,
            buffers: self.buffers.len() as u64,
            heap_used: self.heap.used(),
            heap_quota: self.heap.capacity(),
            tasks_submitted: self.submitted,
            tasks_completed: shared.completed.load(Ordering::Relaxed),
            tasks_failed: shared.failed.load(Ordering::Relaxed),
            in_flight: shared.in_flight.load(Ordering::Relaxed),
            bytes_to_device: shared.bytes_to_device.load(Ordering::Relaxed),
            bytes_to_host: shared.bytes_to_host.load(Ordering::Relaxed),
            unread_releases: shared.unread.count.load(Ordering::Relaxed),
            device_memory: {
                let mut bytes: Vec<u64> = shared
                    .device_usage
                    .bytes
                    .iter()
                    .map(|b| b.load(Ordering::Relaxed))
                    .collect();
                while bytes.last() == Some(&0) {
                    bytes.pop();
                }
                bytes
            },
        }
    }
}

impl QueueState {
    /// The queue as the status shows it.
    fn status(&self, device_names: &[String]) -> QueueStatus {
        let in_flight = u64::from(self.in_flight.load(Ordering::Relaxed));
        let binding = self.binding.load();
        QueueStatus {
            name: self.name.to_string(),
            class: self.class,
            in_flight,
            bound_to: (in_flight > 0 && !binding.is_unbound()).then(|| {
                let device = device_names.get(binding.device()).map_or("?", |n| n.as_str());
                format!("{device}/lane{}", binding.lane())
            }),
            preferred: self.preferred,
            sla_ms: self.sla_ns.map(|ns| ns / 1e6),
            moving: self.moving.load(Ordering::Relaxed),
            last_device: (!binding.is_unbound())
                .then(|| device_names.get(binding.device()).cloned())
                .flatten(),
        }
    }
}

/// A memfd's (device, inode), which names it whatever descriptor refers to it.
pub(crate) fn segment_identity(fd: std::os::fd::BorrowedFd<'_>) -> (u64, u64) {
    rustix::fs::fstat(fd).map_or((0, 0), |st| (st.st_dev, st.st_ino))
}

#[cfg(test)]
mod tests {
    //! A session's own bookkeeping, on a real segment with no client: its heap and buffer
    //! table, its lane-work back-pressure, its device-memory report, the packed binding.
    use super::*;
    use agora_protocol::segment::Geometry;

    /// A session whose heap is `heap` bytes, with at most `max_buffers` buffers and
    /// `max_lane_ns` of outstanding batch work.
    fn session(heap: u64, max_buffers: usize, max_lane_ns: u64) -> Session {
        let geometry = Geometry::new(8, 8, heap).unwrap();
        let segment = Segment::create("agora-session-test", geometry).unwrap();
        let (stream, _peer) = UnixStream::pair().unwrap();
        Session::new(
            9,
            Credentials::default(),
            "unit".into(),
            Arc::new(stream),
            FrameReader::default(),
            Doorbell::new().unwrap(),
            segment,
            16,
            max_buffers,
            max_lane_ns,
        )
    }

    #[test]
    fn a_peer_is_in_a_group_by_its_primary_gid_or_any_supplementary_one() {
        let tenant = Credentials {
            pid: 1,
            uid: 1001,
            gid: 1001,
            groups: Arc::from([1001, 1003, 27]),
        };
        assert!(tenant.in_any_group(&[1001]), "the primary gid");
        assert!(tenant.in_any_group(&[5, 1003]), "a supplementary group");
        assert!(!tenant.in_any_group(&[1002]), "a group it is not in");
        assert!(!tenant.in_any_group(&[]), "no group listed");
        assert_eq!(tenant.all_groups(), [1001, 1003, 27]);
        // Without SO_PEERGROUPS only the primary gid counts.
        let primary_only = Credentials {
            groups: Arc::from([]),
            ..tenant
        };
        assert!(primary_only.in_any_group(&[1001]) && !primary_only.in_any_group(&[1003]));
        assert_eq!(primary_only.all_groups(), [1001]);
    }

    #[test]
    fn buffers_come_from_the_heap_and_refusals_say_what_is_left() {
        let mut s = session(1 << 16, 2, u64::MAX);
        assert!(matches!(s.alloc_buffer(0), Err(ControlError::EmptyBuffer)));
        let (a, a_offset) = s.alloc_buffer(1 << 14).unwrap();
        match s.alloc_buffer(1 << 20) {
            Err(ControlError::QuotaExceeded {
                requested,
                available,
                quota,
                ..
            }) => {
                assert_eq!(requested, 1 << 20);
                assert_eq!(quota, s.heap.capacity());
                assert_eq!(available, quota - (1 << 14));
            }
            other => panic!("{other:?}"),
        }
        let (_b, _) = s.alloc_buffer(1 << 10).unwrap();
        // The table is full: refused, and the heap range it took is given back.
        let used = s.heap.used();
        assert!(matches!(
            s.alloc_buffer(64),
            Err(ControlError::TooMany { limit: 2, .. })
        ));
        assert_eq!(s.heap.used(), used, "the refused buffer's range was freed");
        // A released buffer's range is reused at once when nothing references it.
        assert!(s.release_buffer(a));
        assert!(!s.release_buffer(a), "a handle is released once");
        let (_, again) = s.alloc_buffer(1 << 14).unwrap();
        assert_eq!(again, a_offset);
    }

    #[test]
    fn a_released_buffer_a_task_still_uses_keeps_its_range_until_the_task_lets_go() {
        let mut s = session(1 << 16, 8, u64::MAX);
        let (handle, offset) = s.alloc_buffer(4096).unwrap();
        let in_use = s.buffers.get(handle).unwrap().clone(); // as a dispatched task holds it
        assert!(s.release_buffer(handle));
        let (_, other) = s.alloc_buffer(4096).unwrap();
        assert_ne!(other, offset, "still referenced: its range is not handed out");
        drop(in_use);
        s.reclaim_zombies();
        let (_, reused) = s.alloc_buffer(4096).unwrap();
        assert_eq!(reused, offset, "reclaimed once the task let go");
    }

    #[test]
    fn outstanding_lane_work_closes_batch_then_everything_and_reopens() {
        let s = session(1 << 16, 8, 1_000);
        let shared = &s.shared;
        assert_eq!(shared.lane_room(), LaneRoom::Open);
        shared.lane_work_started(600);
        shared.lane_work_started(600);
        assert_eq!(
            shared.lane_room(),
            LaneRoom::LatencyOnly,
            "1.2 µs of batch work over 1 µs"
        );
        // Not throttled: finishing work needs no wake-up.
        assert!(!shared.lane_work_done(600));
        assert_eq!(shared.lane_room(), LaneRoom::Open);
        assert!(!shared.lane_work_done(600));
        for _ in 0..MAX_LANE_JOBS {
            shared.lane_work_started(0);
        }
        assert_eq!(shared.lane_room(), LaneRoom::Closed);
        // The dispatcher stopped taking descriptors: the job that makes room says to wake it,
        // once.
        shared.throttled.store(true, Ordering::SeqCst);
        assert!(shared.lane_work_done(0), "room again: wake the dispatcher");
        assert!(!shared.lane_work_done(0), "already woken");
    }

    #[test]
    fn the_status_reports_device_memory_per_device_without_trailing_zeros() {
        let s = session(1 << 16, 8, u64::MAX);
        assert!(s.summary().device_memory.is_empty());
        s.shared.device_usage.bytes[2].store(4096, Ordering::Relaxed);
        assert_eq!(s.summary().device_memory, vec![0, 0, 4096]);
        assert_eq!(
            s.shared.device_usage.tenant, 9,
            "devices know the session as the tenant"
        );
    }

    #[test]
    fn a_binding_packs_device_and_lane() {
        let b = Binding::new(3, 17);
        assert_eq!((b.device(), b.lane()), (3, 17));
        assert!(Binding::UNBOUND.is_unbound() && !b.is_unbound());
        let atomic = AtomicBinding::unbound();
        atomic.store(b);
        assert_eq!(atomic.load(), b);
    }
}
