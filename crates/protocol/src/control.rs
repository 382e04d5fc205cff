//! Control-socket messages.
//!
//! Frames are a little-endian `u32` length followed by a postcard-encoded message. A frame longer
//! than [`MAX_FRAME`] is a protocol error. The first message on a connection is either
//! [`Request::Hello`] (open a session; the reply carries the segment and doorbell descriptors as
//! `SCM_RIGHTS`) or [`Request::Status`] (a one-shot observer that opens no session).

use serde::{Deserialize, Serialize};

use crate::signature::KernelSignature;

/// Largest control frame accepted, in bytes.
pub const MAX_FRAME: u32 = 1 << 20;

/// Longest name a request may carry, in bytes (kernel, queue and client names). The daemon
/// refuses a longer one at once with [`ControlError::NameTooLong`], before any work that grows
/// with the name (the "did you mean" search) and without echoing it back.
pub const MAX_NAME: usize = 256;

/// Most sessions a [`StatusReport`] lists (the busiest; `live_sessions` counts them all).
pub const STATUS_SESSIONS: usize = 128;

/// Most queues a session lists in a [`StatusReport`] (the busiest; `queue_count` counts them
/// all). [`Request::SessionStatus`] pages through the rest.
pub const STATUS_QUEUES: usize = 8;

/// Most bytes of the encoded reply the daemon spends on the sessions of a [`StatusReport`], or
/// on one page of [`Request::SessionStatus`]: well under [`MAX_FRAME`], so that devices,
/// counters and framing always fit whatever names and counts tenants choose, and small enough
/// for a Unix socket's default send buffer, so that a reply is usually written in one go.
pub const REPLY_BUDGET: usize = 128 << 10;

/// Class of a queue (scheduling hints for later policies).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum QueueClass {
    /// Throughput work.
    #[default]
    Batch,
    /// Latency-sensitive work.
    Latency,
}

/// A request from a client.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub enum Request {
    /// Open a session.
    Hello {
        /// [`crate::PROTOCOL_VERSION`] of the client.
        version: u32,
        /// A name for status displays (the program name by default).
        client_name: String,
        /// Heap size wanted; the daemon grants at most its per-session quota.
        heap_bytes: Option<u64>,
    },
    /// Allocate a buffer in the session heap.
    AllocBuffer {
        /// Length in bytes (at least 1).
        len: u64,
    },
    /// Create a queue.
    CreateQueue {
        /// Display name.
        name: String,
        /// Class.
        class: QueueClass,
        /// Kind of device the client prefers for this queue, if any: a
        /// [`DeviceKind`](crate::DeviceKind) name, or `any` (the same as none). Sent as a string
        /// so that the daemon, not the decoder, answers an unknown name (with a message that
        /// lists the kinds): a client that knows a kind this daemon does not gets that message,
        /// not a decoding error. Replies carry [`DeviceKind`](crate::DeviceKind) itself.
        preferred_device: Option<String>,
        /// Response-time target of a latency-class queue's tasks, in milliseconds (the daemon's
        /// default when absent).
        sla_ms: Option<f64>,
    },
    /// Look a kernel up by name.
    LookupKernel {
        /// Kernel name.
        name: String,
    },
    /// List every kernel.
    ListKernels,
    /// Every current kernel with its package and implementations, and every package
    /// (`agora kernels`).
    KernelCatalog,
    /// Admin: load the kernel packages again (`agora kernels reload`): new and changed packages
    /// are picked up, running tasks are not disturbed, a package that no longer loads keeps its
    /// previous version. Only root or the daemon's own user may ask.
    ReloadKernels,
    /// Build a tenant program for this session (`session.program(...)`): it runs in the
    /// session's sandboxed executor process, never in the daemon.
    BuildProgram {
        /// `opencl` (OpenCL C source), `c` (a shared object with C-ABI functions, see
        /// `agora_kernel.h`, described by `manifest`), `cuda` (CUDA C source with `extern "C"
        /// __global__` kernels) or `ptx` (PTX text); the last two run only on NVIDIA GPUs, fenced.
        language: String,
        /// The source text (OpenCL, CUDA C, PTX) or the shared object's bytes (C); at most
        /// [`MAX_PROGRAM_BYTES`].
        code: Vec<u8>,
        /// A manifest in the kernel-package format (`[kernels.NAME]` tables): required for `c`,
        /// `cuda` and `ptx`, optional for `opencl` (it adds size rules and chunkability to the
        /// signatures the compiler reports).
        manifest: Option<String>,
        /// A name for messages and listings (e.g. the file it came from).
        name: String,
    },
    /// A summary of the daemon's state: counters, devices and the busiest sessions with their
    /// busiest queues (bounded, whatever tenants do; see [`STATUS_SESSIONS`], [`STATUS_QUEUES`]).
    Status,
    /// One session's details with one page of its queues (in handle order), from the queue at
    /// position `first_queue` on; [`SessionDetails::next_queue`] says where the next page
    /// starts. Any connection may ask, like [`Request::Status`].
    SessionStatus {
        /// Session id, as the status lists it.
        session: u64,
        /// Where the page starts: 0, or a previous page's `next_queue`.
        first_queue: u64,
    },
    /// Write the task trace to the daemon's trace file now (`agora serve --trace FILE`).
    SaveTrace,
    /// Admin: mark a device draining (`drain: true`) or usable again (`false`). A draining device
    /// gets no new placements; queues bound to it migrate once their in-flight tasks finish, and
    /// its buffers' valid copies move on demand. Only root or the daemon's own user may ask.
    Drain {
        /// Device name, as `agora devices` lists it.
        device: String,
        /// Drain (true) or undrain (false).
        drain: bool,
        /// With `drain`: also write every idle buffer's only valid copy on the device back to
        /// host memory and free its device memory now, so the device can be removed. Runs on
        /// the dispatcher (other clients wait meanwhile); buffers in use move on demand.
        evacuate: bool,
    },
    /// Open a session again after the daemon restarted, keeping what the client's last daemon
    /// had: its segment (the memfd follows as ancillary data; host copies of its buffers are
    /// still in it), its buffers and queues under their old handles, and its kernels by name.
    /// The daemon checks every part as untrusted input. Long lists are split: the rest follows
    /// in [`Request::ResumeMore`] messages, and the daemon replies once, to the last one.
    Resume {
        /// [`crate::PROTOCOL_VERSION`] of the client.
        version: u32,
        /// As in [`Request::Hello`].
        client_name: String,
        /// The session id the previous daemon gave (for logs).
        previous_session: u64,
        /// Submission ring capacity of the segment.
        submission_capacity: u32,
        /// Completion ring capacity of the segment.
        completion_capacity: u32,
        /// Heap length of the segment.
        heap_len: u64,
        /// Buffers to register again (the first part).
        buffers: Vec<ResumedBuffer>,
        /// Queues to create again (the first part).
        queues: Vec<ResumedQueue>,
        /// Names of the kernels the client looked up, in the order it wants their new ids.
        kernels: Vec<String>,
        /// Whether [`Request::ResumeMore`] messages follow.
        more: bool,
    },
    /// More buffers and queues of a [`Request::Resume`].
    ResumeMore {
        /// Buffers to register again.
        buffers: Vec<ResumedBuffer>,
        /// Queues to create again.
        queues: Vec<ResumedQueue>,
        /// Whether more messages follow.
        more: bool,
    },
    /// Protect a buffer under `id` (FTI's `protect`): checkpoints of this session (the `Checkpoint`
    /// task) save it, and [`Request::Recover`] restores it. Protecting an id again replaces the
    /// buffer. Checkpoints belong to the application named by the session's client name and the
    /// user: a process of the same name and user recovers them.
    Protect {
        /// The id the application gives the data (stable across its runs).
        id: u32,
        /// The buffer's handle.
        buffer: u64,
    },
    /// Restore every protected buffer from the newest intact checkpoint of this application
    /// (FTI's `recover`): each buffer's host copy gets the saved bytes. Ask before issuing tasks
    /// that use them; a protected id that the checkpoint lacks, or whose size differs, is an error
    /// that names it.
    Recover,
    /// This application's checkpoints, and the outcome of the last one written.
    Checkpoints,
    /// Allocate an exportable buffer: its host copy is a memory region of its own (a memfd that
    /// follows the reply as ancillary data), not a range of the session's heap, so that it can be
    /// handed to other sessions ([`Request::Export`]) without exposing anything else. It counts
    /// against the session's shared-memory limit (the heap quota again), and it is not kept
    /// across a daemon restart.
    AllocShared {
        /// Length in bytes (at least 1).
        len: u64,
    },
    /// Make an exportable buffer attachable by name (XEMEM's `make`). Names are the daemon's,
    /// one namespace for every user; a name is taken until its export is revoked or its
    /// exporter's session ends.
    Export {
        /// The buffer's handle (allocated with [`Request::AllocShared`]).
        buffer: u64,
        /// The name attachers ask for (at most [`MAX_NAME`] bytes, no control characters).
        name: String,
        /// Who may attach, besides the exporter's own uid.
        readers: ExportReaders,
        /// Whether attachers may write (attach read-write). A buffer exported read-only once stays
        /// read-only for every later attacher: its memory is sealed against new writers.
        writable: bool,
    },
    /// Withdraw an export (XEMEM's `remove`): the name is free again, nobody new can attach, and
    /// every attacher's tasks that name the buffer fail with `TaskError::Attachment` (revoked).
    /// Memory the attachers mapped stays readable to them until they drop the buffer.
    Revoke {
        /// The export's name.
        name: String,
    },
    /// Attach an exported buffer (XEMEM's `get` + `attach`): the reply carries a handle of this
    /// session for the same memory (the region's memfd follows as ancillary data; read-only
    /// unless `writable`). The buffer is the exporter's: its device copies, where its newest
    /// contents are, and the device memory it holds are shared with the exporter.
    Attach {
        /// The export's name.
        name: String,
        /// Attach read-write (the export must allow it).
        writable: bool,
    },
    /// The exports this connection's user may see (its own and those it may attach; root or the
    /// daemon's user sees all), for `agora exports`.
    Exports,
    /// Declare a real-time task graph (AMPERE's periodic DAGs): the daemon admits it only if
    /// every node fits its deadline lanes (EDF, APEDF partitioning), then releases it every
    /// period itself, or on [`Request::ReleaseDag`] only when it is sporadic.
    DeclareDag(Box<DagDeclaration>),
    /// Release one instance of an admitted DAG now (a sporadic activation). Refused when it comes
    /// sooner than the DAG's period after the previous release: the period is the minimum
    /// inter-arrival time admission counted with.
    ReleaseDag {
        /// The DAG's id (from [`Response::DagAdmitted`]).
        dag: u64,
    },
    /// The DAG's releases that finished since the previous call (oldest first).
    DagResults {
        /// The DAG's id.
        dag: u64,
    },
    /// Withdraw an admitted DAG: no more releases, its lane reservations are freed; a release in
    /// flight finishes.
    DropDag {
        /// The DAG's id.
        dag: u64,
    },
    /// A Slurm job starts on this node (from its prolog, `agora slurm job-start`; root or the
    /// daemon's user only): sessions of processes of the job get its limits, and are ended when
    /// the job ends.
    JobStart(JobStart),
    /// A Slurm job ended (from its epilog, `agora slurm job-end`): every session of the job is
    /// ended and reclaimed, even if a process of it still runs; the reply is its accounting.
    JobEnd {
        /// The job id.
        job: u64,
    },
    /// The client is about to write a buffer's host copy while a device may hold newer contents
    /// (results of a launch it never read back): from the reply with `granted: true` on, the host
    /// copy is the buffer's current contents and the device's are discarded, so no eviction
    /// writes them home over what the client writes (as `sync_to` does, without waiting in a
    /// queue). Not granted while a task planned and unfinished names the buffer or an eviction is
    /// writing the device's contents into the host copy: the client asks again.
    ClaimHost {
        /// The buffer's handle.
        buffer: u64,
    },
    /// Admin: Slurm's power saving (`agora slurm suspend` / `resume`). `suspend: true` drains
    /// every device and writes its idle buffers back to host memory (as `Drain` with
    /// `evacuate`), remembering the devices it drained; `false` undrains those only: a device
    /// drained before the suspend (`agora drain`) stays drained, as does one drained or
    /// undrained by hand since.
    PowerSave {
        /// Suspend (true) or resume (false).
        suspend: bool,
    },
}

/// A Slurm job on this node ([`Request::JobStart`]).
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct JobStart {
    /// The job id (`SLURM_JOB_ID`).
    pub job: u64,
    /// The job's user (`SLURM_JOB_UID`): only its processes' sessions join the job.
    pub uid: u32,
    /// The `agora` GRES shares the job was given on this node (`--gres=agora:K`).
    pub shares: u32,
    /// Heap quota of each of its sessions, bytes (`None`: the daemon's).
    pub heap_quota: Option<u64>,
    /// Whether its sessions may open latency-class queues (besides the daemon's own rule).
    pub latency: bool,
    /// Device memory each of its sessions may hold on one device, bytes (`None`: the daemon's
    /// `[sessions] device_quota`; never more than that when it is set). Missing from records
    /// of jobs a daemon of before wrote: none.
    #[serde(default)]
    pub device_quota: Option<u64>,
    /// Slurm's restart count of the job (squeue's `RestartCnt`): 0 on its first run, N after N
    /// requeues. A run after a requeue adds its use to the record the earlier runs left.
    /// Missing from records of jobs a daemon of before wrote: 0.
    #[serde(default)]
    pub restarts: u32,
}

/// What a job used on this node ([`Request::JobEnd`]), as its epilog records it.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct JobAccount {
    /// The job id.
    pub job: u64,
    /// Its user.
    pub uid: u32,
    /// Its `agora` shares.
    pub shares: u32,
    /// Sessions its processes opened.
    pub sessions: u64,
    /// Sessions still open when it ended (ended by the daemon).
    pub sessions_ended_by_daemon: u64,
    /// Tasks completed and failed.
    pub tasks_completed: u64,
    /// Tasks that failed.
    pub tasks_failed: u64,
    /// Seconds of device time by device kind (`cpu`, `opencl`, ...): lane execution of its tasks.
    pub device_seconds: Vec<(String, f64)>,
    /// Bytes moved host → device and device → host.
    pub bytes_to_device: u64,
    /// Bytes moved device → host.
    pub bytes_to_host: u64,
    /// Energy of its device time, joules, from the daemon's power model (busy-lane watts ×
    /// time), not a measurement.
    pub energy_model_joules: f64,
    /// Seconds from its start to its end on this daemon.
    pub wall_seconds: f64,
}

/// Most nodes in one DAG ([`Request::DeclareDag`]).
pub const MAX_DAG_NODES: usize = 256;

/// Finished releases the daemon keeps per DAG until the client reads them
/// ([`Request::DagResults`]); older ones are counted as dropped.
pub const DAG_RESULTS_KEPT: usize = 4096;

/// A task graph to admit ([`Request::DeclareDag`]).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct DagDeclaration {
    /// A name for reports, metrics and errors (at most [`MAX_NAME`] bytes).
    pub name: String,
    /// Release period, nanoseconds (for a sporadic DAG: the minimum time between releases).
    pub period_ns: u64,
    /// End-to-end relative deadline, nanoseconds; `None`: the period.
    pub deadline_ns: Option<u64>,
    /// Whether the daemon releases it every period by itself (`false`: only on
    /// [`Request::ReleaseDag`]).
    pub periodic: bool,
    /// The nodes, in any order; edges name them by index.
    pub nodes: Vec<DagNodeDeclaration>,
    /// Precedence edges `(from, to)`: `to` starts after `from` finished, in each release.
    pub edges: Vec<(u32, u32)>,
}

/// One node of a [`DagDeclaration`]: a kernel launch.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct DagNodeDeclaration {
    /// Its name within the DAG.
    pub name: String,
    /// The launch, as the 320 bytes of a `TaskDescriptor` with `op = Launch` (its task id and
    /// queue are ignored: each node gets a queue of its own in the daemon).
    pub launch: Vec<u8>,
    /// A declared worst-case execution time, nanoseconds; `None`: the learned performance
    /// model's estimate, with the daemon's margin. Runs longer than it count as overruns.
    pub wcet_ns: Option<u64>,
    /// A relative deadline for this node (kept as declared by deadline splitting).
    pub relative_deadline_ns: Option<u64>,
}

/// How a DAG was admitted ([`Response::DagAdmitted`]).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct DagAdmission {
    /// Its id, for release, results and drop.
    pub dag: u64,
    /// Each node's lane (`cpu0/lane1`), by node index.
    pub lanes: Vec<String>,
    /// Each node's WCET counted, nanoseconds (before the margin), by node index.
    pub wcet_ns: Vec<u64>,
    /// Where each WCET came from: `declared` or `model`.
    pub wcet_source: Vec<String>,
    /// The DAG's utilisation (budgets over the period, margin included).
    pub utilisation: f64,
    /// Utilisation of each deadline lane with this DAG admitted.
    pub lane_utilisation: Vec<f64>,
    /// Whether the first-fit utilisation bound decided it (no exact test needed).
    pub decided_by_bound: bool,
}

/// One finished release of a DAG.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct DagRelease {
    /// Its number (0, 1, ...).
    pub release: u64,
    /// Nanoseconds from the release to the end of its last node.
    pub response_ns: u64,
    /// Whether it ended by its deadline (and every node succeeded).
    pub met: bool,
    /// Nanoseconds from the time it was due to the time the daemon's release timer released it
    /// (the period jitter; 0 for a release on request).
    pub jitter_ns: u64,
    /// Nanoseconds from the time it was due to the time its first nodes were handed to lanes
    /// (the jitter plus the dispatcher's hand-off).
    pub handoff_ns: u64,
    /// The first failure of one of its nodes, `(node, message)`.
    pub failed: Option<(u32, String)>,
    /// Nodes that ran longer than their WCET (the only misses admission does not cover).
    pub overruns: Vec<u32>,
}

/// Reply to [`Request::DagResults`].
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct DagResults {
    /// Finished releases since the previous call, oldest first.
    pub releases: Vec<DagRelease>,
    /// Releases finished but not kept (more than [`DAG_RESULTS_KEPT`] unread).
    pub dropped: u64,
    /// Releases issued so far.
    pub released: u64,
    /// Why the daemon stopped releasing the DAG, if it did (e.g. a node's buffer was released).
    pub stopped: Option<String>,
}

/// Who may attach an export besides its exporter's uid ([`Request::Export`]).
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ExportReaders {
    /// Users allowed.
    pub uids: Vec<u32>,
    /// Groups whose members may attach: the attaching process's primary group or any of its
    /// supplementary groups, as the kernel reported them when it connected.
    pub gids: Vec<u32>,
}

/// Most readers (uids plus gids) one export lists.
pub const MAX_EXPORT_READERS: usize = 64;

/// One export as [`Request::Exports`] lists it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ExportStatus {
    /// Its name.
    pub name: String,
    /// The exporting session, its client name and its uid.
    pub session: u64,
    /// The exporting client's name.
    pub client: String,
    /// The exporter's uid.
    pub uid: u32,
    /// Length in bytes.
    pub len: u64,
    /// Whether attachers may write.
    pub writable: bool,
    /// Who may attach besides the exporter's uid.
    pub readers: ExportReaders,
    /// Sessions attached now.
    pub attachers: Vec<u64>,
    /// Attachments made since it was exported.
    pub attaches: u64,
}

/// A buffer a resuming client had (see [`Request::Resume`]).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ResumedBuffer {
    /// Its handle under the previous daemon (kept, so the client's descriptors stay valid).
    pub handle: u64,
    /// Offset of its host copy in the heap.
    pub offset: u64,
    /// Length in bytes.
    pub len: u64,
    /// Its newest contents may have been on a device of the previous daemon (a launch wrote it
    /// after its last `sync_from`): the daemon marks it lost, so a task that reads it fails with
    /// `DataLost` until it is written whole again.
    pub lost: bool,
}

/// A queue a resuming client had (see [`Request::Resume`]).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ResumedQueue {
    /// Its handle under the previous daemon.
    pub handle: u64,
    /// As in [`Request::CreateQueue`].
    pub name: String,
    /// As in [`Request::CreateQueue`].
    pub class: QueueClass,
    /// As in [`Request::CreateQueue`].
    pub preferred_device: Option<String>,
    /// As in [`Request::CreateQueue`].
    pub sla_ms: Option<f64>,
}

/// Most buffers one [`Request::Resume`] or [`Request::ResumeMore`] carries (keeps each message
/// far below [`MAX_FRAME`]).
pub const RESUME_BUFFERS_PER_MESSAGE: usize = 8192;
/// Most queues one resume message carries.
pub const RESUME_QUEUES_PER_MESSAGE: usize = 512;

/// A reply from the daemon.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub enum Response {
    /// Session opened; the segment memfd and the doorbell eventfd follow as ancillary data.
    Welcome {
        /// Session id (unique for the daemon's lifetime).
        session: u64,
        /// Submission ring capacity.
        submission_capacity: u32,
        /// Completion ring capacity.
        completion_capacity: u32,
        /// Heap bytes granted.
        heap_len: u64,
    },
    /// Buffer allocated.
    Buffer {
        /// Handle.
        handle: u64,
        /// Offset of its host copy in the heap.
        offset: u64,
        /// Length.
        len: u64,
    },
    /// Queue created.
    Queue {
        /// Handle.
        handle: u64,
    },
    /// Kernel found.
    Kernel {
        /// Id to put in launch descriptors.
        id: u32,
        /// Its signature.
        signature: KernelSignature,
    },
    /// All kernels.
    Kernels(Vec<KernelSignature>),
    /// Reply to [`Request::KernelCatalog`].
    KernelCatalog {
        /// Current kernels in id order.
        kernels: Vec<KernelListing>,
        /// Loaded packages.
        packages: Vec<PackageListing>,
    },
    /// Reply to [`Request::ReloadKernels`].
    KernelsReloaded(ReloadReport),
    /// Reply to [`Request::BuildProgram`]: the program's kernels, callable by these ids from this
    /// session only.
    Program {
        /// Kernel ids and signatures (names as in the program).
        kernels: Vec<(u32, KernelSignature)>,
        /// The compiler's log (warnings), possibly empty.
        log: String,
        /// Whether the build came from the daemon's program cache.
        cached: bool,
    },
    /// Daemon state.
    Status(Box<StatusReport>),
    /// One session and a page of its queues (reply to [`Request::SessionStatus`]).
    SessionDetails(Box<SessionDetails>),
    /// Trace written.
    TraceSaved {
        /// The file.
        path: String,
        /// Spans written.
        spans: u64,
    },
    /// A device's drain state changed (reply to [`Request::Drain`]).
    Drained {
        /// The device.
        device: String,
        /// Whether it is draining now.
        draining: bool,
        /// Queues bound to it with tasks in flight (they migrate when those finish).
        queues_bound: u64,
        /// Buffers whose device copy was dropped by `evacuate` (written back first when it was
        /// the only valid copy).
        evacuated_buffers: u64,
        /// Bytes of device memory those held.
        evacuated_bytes: u64,
        /// Queues moved off devices since the daemon started (the status's `migrations`), as of
        /// this reply: compare with a later status to see the moves this drain caused.
        migrations: u64,
    },
    /// The session is open again (reply to the last message of a [`Request::Resume`]); a new
    /// doorbell eventfd follows as ancillary data.
    Resumed {
        /// The new session id.
        session: u64,
        /// The new id of each kernel named in the request, in its order (`None`: the daemon has
        /// no kernel of that name any more).
        kernels: Vec<Option<u32>>,
    },
    /// The request failed.
    Error(ControlError),
    /// Reply to [`Request::Protect`].
    Protected {
        /// Ids protected now.
        ids: Vec<u32>,
        /// The daemon's snapshot interval (`[checkpoint] interval_s`), milliseconds: how often
        /// the client's `snapshot()` checkpoints.
        interval_ms: u64,
        /// Levels whose configured directory is unusable, each with the refusal naming the
        /// key, the directory and why: the client refuses checkpoints at them before issuing.
        unusable: Vec<(u8, String)>,
    },
    /// Reply to [`Request::Recover`].
    Recovered(RecoverReport),
    /// Reply to [`Request::Checkpoints`].
    Checkpoints(CheckpointReport),
    /// An exportable buffer (reply to [`Request::AllocShared`]); its memfd follows as ancillary
    /// data.
    SharedBuffer {
        /// Handle.
        handle: u64,
        /// Length.
        len: u64,
    },
    /// Reply to [`Request::Export`] and [`Request::Revoke`].
    Exported {
        /// The name.
        name: String,
        /// Sessions attached when a revoke took effect (empty for an export).
        attachers: Vec<u64>,
    },
    /// Reply to [`Request::Attach`]; the region's memfd follows as ancillary data.
    Attached {
        /// The buffer's handle in this session.
        handle: u64,
        /// Length.
        len: u64,
        /// Whether this session may write it.
        writable: bool,
        /// The exporting session.
        exporter: u64,
    },
    /// Reply to [`Request::Exports`].
    Exports(Vec<ExportStatus>),
    /// Reply to [`Request::DeclareDag`].
    DagAdmitted(Box<DagAdmission>),
    /// Reply to [`Request::ReleaseDag`]: the release's number.
    DagReleased {
        /// Its number.
        release: u64,
    },
    /// Reply to [`Request::DagResults`].
    DagResults(DagResults),
    /// Reply to [`Request::DropDag`].
    DagDropped,
    /// Reply to [`Request::JobStart`].
    JobStarted {
        /// The job was registered already (Slurm ran its prolog again, as on a requeue): its use
        /// so far is kept, and its shares and quotas are now this request's (for sessions it
        /// opens from now on).
        again: bool,
        /// Why the daemon could not record the running job for a restart
        /// (`STATE_DIR/jobs/running/JOB.json`, named), if it could not: the job is registered,
        /// but a daemon restart would forget it.
        not_recorded: Option<String>,
    },
    /// Reply to [`Request::JobEnd`].
    JobEnded {
        /// What the job used.
        account: Box<JobAccount>,
        /// Why the daemon could not write the job's accounting record (`STATE_DIR/jobs/JOB.json`,
        /// named), if it could not: `account` is then the job's only record.
        not_recorded: Option<String>,
    },
    /// Reply to [`Request::ClaimHost`].
    HostClaim {
        /// Whether the host copy is now the client's to write; `false`: a task that uses the
        /// buffer, or an eviction's write-back into its host copy, is not finished yet.
        granted: bool,
    },
    /// Reply to [`Request::PowerSave`]: every device, in the daemon's order.
    PowerSaved(Vec<PowerDevice>),
}

/// One device after a [`Request::PowerSave`].
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct PowerDevice {
    /// Its name.
    pub device: String,
    /// Whether this request drained it (suspend) or undrained it (resume); `false`: it was left
    /// as it was (drained by hand, or already drained by an earlier suspend).
    pub changed: bool,
    /// Whether it is draining now.
    pub draining: bool,
    /// Buffers written back to host memory and freed on it (suspend).
    pub evacuated_buffers: u64,
    /// Device bytes they held.
    pub evacuated_bytes: u64,
}

/// What a recovery restored.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct RecoverReport {
    /// The checkpoint used (its id, as the application gave it).
    pub checkpoint: u64,
    /// Its level (1–4).
    pub level: u8,
    /// The protected ids restored.
    pub restored: Vec<u32>,
    /// Newer checkpoints passed over because they were damaged, one message each.
    pub skipped: Vec<String>,
}

/// One complete checkpoint of an application.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct CheckpointSummary {
    /// Its id, as the application gave it.
    pub checkpoint: u64,
    /// Its level (1–4).
    pub level: u8,
    /// Bytes it holds.
    pub bytes: u64,
    /// Protected ids in it.
    pub entries: u32,
    /// When it was written, milliseconds since the Unix epoch.
    pub created_unix_ms: u64,
}

/// The outcome of one checkpoint write (done in the background after the task captured the bytes).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct CheckpointWrite {
    /// The checkpoint's id.
    pub checkpoint: u64,
    /// Its level (1–4).
    pub level: u8,
    /// Bytes of the protected data.
    pub bytes_total: u64,
    /// Bytes written (differential checkpoints write only blocks that changed).
    pub bytes_written: u64,
    /// Seconds the write took.
    pub seconds: f64,
    /// Why it failed, if it did (then the previous checkpoints are what recovery uses).
    pub error: Option<String>,
}

/// Reply to [`Request::Checkpoints`].
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct CheckpointReport {
    /// The application: the session's client name.
    pub application: String,
    /// Its complete checkpoints, oldest first.
    pub checkpoints: Vec<CheckpointSummary>,
    /// The last checkpoint writes of this application, oldest first (at most 64).
    pub writes: Vec<CheckpointWrite>,
    /// Checkpoint tasks whose bytes are captured but not yet written.
    pub writing: u32,
}

/// [`ControlError::VersionMismatch`]'s message: which side is older, and what to install.
fn version_mismatch(daemon: u32, client: u32) -> String {
    let older = if client < daemon {
        "this client library is older than the daemon"
    } else {
        "this client library is newer than the daemon"
    };
    format!(
        "protocol version mismatch: the daemon speaks version {daemon}, this client {client} ({older}); \
         use the client of the daemon's Agora build (the Python wheel, libagora or the agora crate \
         built with it), or restart the daemon from the client's build"
    )
}

/// Why a control request failed.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, thiserror::Error)]
pub enum ControlError {
    /// Protocol versions differ.
    #[error("{}", version_mismatch(*daemon, *client))]
    VersionMismatch {
        /// Daemon's version.
        daemon: u32,
        /// Client's version.
        client: u32,
    },
    /// The session heap cannot hold the buffer.
    #[error("allocation of {requested} bytes failed: {available} of the session's {quota}-byte heap quota left (largest free block {largest_free}); free buffers, open the session with a larger heap_bytes (AGORA_HEAP_BYTES) up to the quota, or ask the operator for a larger quota (agora serve --session-quota; in a Slurm job, the prolog's AGORA_HEAP_QUOTA)")]
    QuotaExceeded {
        /// Bytes requested.
        requested: u64,
        /// Bytes free in all.
        available: u64,
        /// Largest contiguous free block.
        largest_free: u64,
        /// The quota.
        quota: u64,
    },
    /// A zero-length allocation.
    #[error("buffers must be at least 1 byte long")]
    EmptyBuffer,
    /// No kernel by that name.
    #[error("unknown kernel '{name}'{}", suggestion(.suggestions))]
    UnknownKernel {
        /// The name asked for.
        name: String,
        /// Close names that do exist.
        suggestions: Vec<String>,
    },
    /// Too many queues, buffers or programs in one session.
    #[error("{}", too_many(what, *limit))]
    TooMany {
        /// What ran out (`queues`, `buffers`, `programs`).
        what: String,
        /// The limit.
        limit: u64,
    },
    /// The request is not valid in this state (e.g. a second hello).
    #[error("bad request: {0}")]
    BadRequest(String),
    /// The daemon's settings do not allow this client to do that (e.g. open a latency queue).
    #[error("not permitted: {0}")]
    NotPermitted(String),
    /// A name longer than [`MAX_NAME`] bytes.
    #[error("{what} name of {len} bytes is too long: at most {limit} bytes")]
    NameTooLong {
        /// Which name (`kernel`, `queue`, `client`).
        what: String,
        /// Its length in bytes.
        len: u64,
        /// The limit ([`MAX_NAME`]).
        limit: u64,
    },
    /// A tenant program did not build: the compiler's or loader's log says why.
    #[error("the program '{name}' did not build:\n{log}")]
    ProgramBuild {
        /// The program's name.
        name: String,
        /// The compiler's log, or the loader's reason.
        log: String,
    },
    /// No live session has that id (it ended, or never existed), or none the asker may see (a
    /// private daemon answers the same for another user's session).
    #[error("no live session #{0} you may see: run `agora status` for the live ones (a daemon with private status shows you yours only)")]
    UnknownSession(u64),
    /// One of the daemon's limits refused the request (per uid, per connection, or the daemon's
    /// own open files): nothing changed, the connection stays usable unless it was refused at
    /// connect time. `agora status` shows each uid's use against the limits.
    #[error("limit reached: {limit} is {max} and uid {uid} is at {value}; free some, wait, or ask the operator to raise it ({setting})")]
    LimitReached {
        /// Which limit, in words (`sessions per uid`, `control requests per second per
        /// connection`, ...).
        limit: String,
        /// The uid it was counted for.
        uid: u32,
        /// The use the request found (for a rate: the rate).
        value: u64,
        /// The limit.
        max: u64,
        /// The configuration key and `agora serve` flag that set it.
        setting: String,
    },
    /// A resume handed back a segment that a session of this daemon still uses (its client's
    /// connection closed while its tasks still run): try again once that session has ended.
    #[error("the segment is still in use by session #{session}, which is ending; try again shortly")]
    SegmentInUse {
        /// The session that holds it.
        session: u64,
    },
    /// A checkpoint request that could not be done (the message says why and what to do).
    #[error("{0}")]
    Checkpoint(String),
    /// An export, attach or revoke that could not be done (the message says why and what to do).
    #[error("{0}")]
    Export(String),
    /// A task graph refused at declaration (the message gives the arithmetic and what would
    /// fit), or a release, result or drop that could not be done.
    #[error("{0}")]
    Dag(String),
    /// A kernel looked up by name that no package or library defines, but one of the session's
    /// own programs does: those are reached through their program, never by name (another
    /// session's program may define the same name).
    #[error(
        "no kernel named '{name}' is installed, but one of this session's programs defines one: launch it through \
         its program (Python program.{name} or program[\"{name}\"], Rust program.kernel(\"{name}\"), C \
         agora_program_kernel), not by name"
    )]
    ProgramKernelByName {
        /// The name asked for.
        name: String,
    },
}

/// [`ControlError::TooMany`]'s message: for programs, which count those held at once, what
/// frees one (a service that builds per request hits this limit).
fn too_many(what: &str, limit: u64) -> String {
    if what == "programs" {
        format!(
            "session limit reached: at most {limit} programs at once per session: drop programs you no longer \
             need (Rust: drop; Python: del; C: agora_program_destroy), build each source once and keep its \
             Program (the same source built again reuses it), or ask the operator to raise [programs] \
             max_per_session"
        )
    } else {
        format!("session limit reached: at most {limit} {what} per session")
    }
}

/// Most bytes of a tenant program's code in one [`Request::BuildProgram`] (it must fit in a
/// frame with its manifest; larger code belongs in a kernel package the operator installs).
pub const MAX_PROGRAM_BYTES: usize = 960 * 1024;

/// Longest the daemon lets one OpenCL program's compilation in an executor take before it
/// stops it and fails the build (a C shared object's loading gets much less). A client waits
/// for a build's reply at least this long plus [`BUILD_REPLY_MARGIN_SECONDS`], whatever its
/// control timeout: a legitimate long compilation then ends in a program or a build error,
/// never in the client's timeout.
pub const PROGRAM_BUILD_SECONDS: u64 = 60;

/// What a client adds to [`PROGRAM_BUILD_SECONDS`] when it waits for a build's reply: the
/// executor's start (at most 20 s) and the reply's way back.
pub const BUILD_REPLY_MARGIN_SECONDS: u64 = 30;

/// One kernel as `agora kernels` lists it.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct KernelListing {
    /// Its id.
    pub id: u32,
    /// Its signature.
    pub signature: KernelSignature,
    /// The package it comes from; `None` for the built-in library.
    pub package: Option<String>,
    /// Its implementations: `cpu`, `opencl`.
    pub implementations: Vec<String>,
    /// Whether launches may be sliced along dimension 0.
    pub chunkable: bool,
}

/// One loaded package.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct PackageListing {
    /// Its name.
    pub name: String,
    /// Its version, if it declares one.
    pub version: Option<String>,
    /// The directory it was loaded from.
    pub dir: String,
    /// How many kernels it defines.
    pub kernels: u32,
}

/// What a reload of the kernel packages did.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct ReloadReport {
    /// Packages loaded now.
    pub packages: Vec<String>,
    /// Kernels added or changed (they have new ids).
    pub changed: Vec<String>,
    /// Packages that are gone.
    pub removed: Vec<String>,
    /// Why packages (or kernels) were refused; each such package keeps its previous version.
    pub errors: Vec<String>,
    /// Kernels callable now, the library's included.
    pub kernels: u32,
}

/// `Err(NameTooLong)` when `name` is longer than [`MAX_NAME`] bytes; `Err(BadRequest)` when it
/// holds a character that [`is_unshowable`] (the message names the character and where, never
/// echoing the name). Names a tenant gives are printed on other users' terminals (`agora
/// status`, `agora top`, the daemon's log): an escape sequence there could rewrite the
/// operator's screen, a newline forge a line, a bidirectional override show one name as another.
pub fn check_name(what: &str, name: &str) -> Result<(), ControlError> {
    if name.len() > MAX_NAME {
        return Err(ControlError::NameTooLong {
            what: what.to_string(),
            len: name.len() as u64,
            limit: MAX_NAME as u64,
        });
    }
    if let Some((at, c)) = name.char_indices().find(|&(_, c)| is_unshowable(c)) {
        return Err(ControlError::BadRequest(format!(
            "the {what} name holds U+{:04X} ({}) at byte {at}: names are shown on other users' terminals \
             (`agora status`), so control, zero-width and text-direction characters are refused; use printable ones",
            c as u32,
            if c.is_control() {
                "a control character"
            } else {
                "a zero-width or text-direction character"
            }
        )));
    }
    Ok(())
}

/// Whether `c` must not reach a terminal in a name: a control character (C0, DEL, C1: escape
/// sequences, newlines, tabs), or one of Unicode's invisible format characters that change how
/// text around them reads (zero-width spaces and joiners, bidirectional marks, embeddings,
/// overrides and isolates — "Trojan Source", CVE-2021-42574 — the byte order mark).
pub fn is_unshowable(c: char) -> bool {
    c.is_control()
        || matches!(
            c,
            '\u{00AD}' | '\u{061C}' | '\u{180E}' | '\u{200B}'..='\u{200F}' | '\u{202A}'..='\u{202E}'
                | '\u{2060}'..='\u{2064}' | '\u{2066}'..='\u{206F}' | '\u{FEFF}' | '\u{FFF9}'..='\u{FFFB}'
        )
}

/// `text` as it may be printed on a terminal: each [`is_unshowable`] character written as its
/// escape (`\u{1b}`), the rest as is. For names from a daemon that did not check them (an older
/// one), and other text that tenants write.
pub fn shown(text: &str) -> std::borrow::Cow<'_, str> {
    if !text.chars().any(is_unshowable) {
        return std::borrow::Cow::Borrowed(text);
    }
    let mut out = String::with_capacity(text.len() + 8);
    for c in text.chars() {
        if is_unshowable(c) {
            out.extend(c.escape_unicode());
        } else {
            out.push(c);
        }
    }
    std::borrow::Cow::Owned(out)
}

fn suggestion(names: &[String]) -> String {
    if names.is_empty() {
        "; run `agora kernels` to list them".to_string()
    } else {
        format!("; did you mean {}?", names.join(", "))
    }
}

/// State of one lane.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct LaneStatus {
    /// Whether a task is running.
    pub busy: bool,
    /// Tasks waiting in the lane.
    pub queued: u64,
    /// Tasks run to the end.
    pub completed: u64,
    /// Nanoseconds spent running tasks.
    pub busy_ns: u64,
}

/// State of one device.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct DeviceStatus {
    /// Name, e.g. `cpu0`.
    pub name: String,
    /// Kind (in JSON, as [`DeviceKind::name`](crate::DeviceKind::name) spells it: `cpu`,
    /// `opencl`, `cuda`, `sim`).
    pub kind: crate::DeviceKind,
    /// What it is (e.g. the OpenCL platform and device name).
    pub description: String,
    /// Device memory in bytes (0 for devices that compute on host memory).
    pub memory_bytes: u64,
    /// Device memory allocated for buffers now.
    pub memory_used: u64,
    /// Device memory kept for tenants beyond their buffers (a GPU keeps each tenant's partition
    /// mapped between its allocations; given back under pressure and when the tenant ends).
    #[serde(default)]
    pub memory_cached: u64,
    /// Percent of the last sample period in which the device ran a kernel, anyone's (a GPU's
    /// figure from NVML); absent where the device does not measure it.
    #[serde(default)]
    pub utilization_percent: Option<u32>,
    /// Threads per lane.
    pub threads_per_lane: u32,
    /// Lanes.
    pub lanes: Vec<LaneStatus>,
    /// Draining: no new placements; its queues migrate (`agora drain`, or after a failure).
    pub draining: bool,
    /// The device failed (its jobs fail with `DeviceLost`); it stays drained.
    pub failed: bool,
}

/// State of one queue.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct QueueStatus {
    /// Display name.
    pub name: String,
    /// Class.
    pub class: QueueClass,
    /// Tasks running or queued on a lane.
    pub in_flight: u64,
    /// `device/lane` it is bound to, when it has work in flight.
    pub bound_to: Option<String>,
    /// The device kind the client prefers (a hint; in JSON as
    /// [`DeviceKind::name`](crate::DeviceKind::name) spells it).
    pub preferred: Option<crate::DeviceKind>,
    /// Response-time target of a latency-class queue, ms.
    pub sla_ms: Option<f64>,
    /// The device its last task handed to a lane ran on (what the policy chose).
    pub last_device: Option<String>,
    /// Being moved to another device (live migration): new tasks wait for the in-flight ones.
    pub moving: bool,
}

/// State of one session.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct SessionStatus {
    /// Session id.
    pub id: u64,
    /// Client pid (from SO_PEERCRED).
    pub pid: i32,
    /// Client uid.
    pub uid: u32,
    /// Client gid.
    pub gid: u32,
    /// Client name.
    pub name: String,
    /// Some of its live queues: in a [`StatusReport`], the busiest (at most [`STATUS_QUEUES`]);
    /// in [`SessionDetails`], one page. `queue_count` counts them all.
    pub queues: Vec<QueueStatus>,
    /// Live queues, all of them.
    pub queue_count: u64,
    /// How many of them are latency-class.
    pub latency_queues: u64,
    /// Live buffers.
    pub buffers: u64,
    /// Heap bytes in use.
    pub heap_used: u64,
    /// Heap quota.
    pub heap_quota: u64,
    /// Tasks taken from the ring.
    pub tasks_submitted: u64,
    /// Tasks completed successfully.
    pub tasks_completed: u64,
    /// Tasks failed.
    pub tasks_failed: u64,
    /// Tasks taken but not yet completed.
    pub in_flight: u64,
    /// Bytes copied from this session's host copies to devices.
    pub bytes_to_device: u64,
    /// Bytes copied from devices to this session's host copies.
    pub bytes_to_host: u64,
    /// Buffers this session released whose newest contents were on a device and never read back
    /// to the host copy (results nobody saw: a missing `sync_from`?).
    pub unread_releases: u64,
    /// Device memory its buffers' device copies hold, bytes, per device in the order of
    /// [`StatusReport::devices`] (devices after the last one it uses left out): on a GPU, its
    /// tenant partition's buffers.
    #[serde(default)]
    pub device_memory: Vec<u64>,
}

/// A snapshot of the whole daemon.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct StatusReport {
    /// Daemon pid.
    pub pid: u32,
    /// Agora version.
    pub version: String,
    /// Seconds since start.
    pub uptime_s: f64,
    /// Active placement policy.
    pub policy: String,
    /// Devices.
    pub devices: Vec<DeviceStatus>,
    /// The busiest live sessions (at most [`STATUS_SESSIONS`], fewer when their entries would
    /// not fit in [`REPLY_BUDGET`]), by id; `live_sessions` counts them all.
    pub sessions: Vec<SessionStatus>,
    /// Live sessions, all of them.
    pub live_sessions: u64,
    /// Sessions that ended but still have tasks running (reclaimed when those finish).
    pub closing_sessions: u64,
    /// Sessions opened since start.
    pub sessions_opened: u64,
    /// Sessions ended since start (clean or not).
    pub sessions_closed: u64,
    /// Tasks completed since start, all sessions.
    pub tasks_completed: u64,
    /// Tasks failed since start, all sessions.
    pub tasks_failed: u64,
    /// Buffers evicted from device memory to host memory since start.
    pub evictions: u64,
    /// Times a task waited for device memory (memory pressure) instead of failing, since start.
    pub memory_waits: u64,
    /// The dispatcher's longest stretch of work since start, milliseconds: how long a new task
    /// could have waited for it (issue 22: at most about a millisecond, whatever tenants do).
    pub dispatcher_longest_iteration_ms: f64,
    /// Stretches of the dispatcher's work over 1 ms since start. Two readings' difference
    /// counts the stalls of the time between them, which the longest (since start) cannot.
    #[serde(default)]
    pub dispatcher_stalls: u64,
    /// The OS priority lanes run batch work at, as configured after any fallback (`auto`,
    /// `batch`, `idle`, `normal`, `nice:N`).
    #[serde(default)]
    pub batch_priority: String,
    /// What it is now: for `auto`, `idle` while latency-class work is live, else `batch`.
    #[serde(default)]
    pub batch_priority_now: String,
    /// Switches of `auto` batch lanes between `batch` and `idle` since start.
    #[serde(default)]
    pub batch_priority_switches: u64,
    /// Device allocations a runtime refused although the books said they fit, retried after
    /// evicting idle buffers, since start.
    pub allocation_retries: u64,
    /// How latency-class work is protected (`none`, `priority`, `elastic`).
    pub latency_policy: String,
    /// Batch launches revoked for latency-class work (and replayed) since start.
    pub revocations: u64,
    /// Execution time those revocations threw away, seconds.
    pub revoked_work_s: f64,
    /// Queues moved to another device since start (drain, failure, or a kernel the bound
    /// device lacks).
    pub migrations: u64,
    /// Tasks a failed device lost that were replayed on another device.
    pub tasks_replayed: u64,
    /// Tasks a failed device lost that could not be replayed (their inputs were gone).
    pub tasks_lost: u64,
    /// Each uid with connections or sessions now: its use against the daemon's per-uid limits
    /// (at most [`STATUS_UIDS`], the most connected first).
    pub uids: Vec<UidUsage>,
    /// Requests refused by each limit since start (limit name, count), every limit listed.
    pub limit_refusals: Vec<(String, u64)>,
    /// Real-time DAGs admitted now (at most [`STATUS_DAGS`]).
    #[serde(default)]
    pub dags: Vec<DagStatus>,
    /// Slurm jobs running on this node as the daemon knows them (at most [`STATUS_JOBS`]), with
    /// their use so far.
    #[serde(default)]
    pub jobs: Vec<JobAccount>,
    /// `Some` when this report is one user's view of a daemon that keeps each user's sessions
    /// private (`[daemon] private_status`): `sessions`, `uids`, `jobs` and `dags` then hold the
    /// asker's own only; the counters and devices stay the node's.
    #[serde(default)]
    pub private: Option<PrivateView>,
    /// The daemon's state directory (its performance model, job records, checkpoints), for
    /// `agora model show` to read the file this daemon writes whatever `--state-dir` it was given.
    #[serde(default)]
    pub state_dir: Option<String>,
}

/// Whose view a private [`StatusReport`] is.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct PrivateView {
    /// The asker's uid: the sessions, uids, jobs and DAGs listed are this uid's.
    pub uid: u32,
    /// Its live sessions, all of them (the report lists the busiest).
    pub sessions: u64,
}

/// Most jobs a [`StatusReport`] lists.
pub const STATUS_JOBS: usize = 64;

/// Most DAGs a [`StatusReport`] lists (each with at most [`STATUS_DAG_LANES`] node lanes, so
/// that they fit beside the sessions in [`REPLY_BUDGET`]).
pub const STATUS_DAGS: usize = 32;

/// Most node lanes one [`DagStatus`] lists.
pub const STATUS_DAG_LANES: usize = 16;

/// One admitted real-time DAG, for `agora status` and `agora top`.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct DagStatus {
    /// Its id.
    pub id: u64,
    /// Its name.
    pub name: String,
    /// The session that declared it.
    pub session: u64,
    /// Period, microseconds.
    pub period_us: u64,
    /// End-to-end deadline, microseconds.
    pub deadline_us: u64,
    /// Whether the daemon releases it by itself (else on request only).
    pub periodic: bool,
    /// Lane of each node (the first [`STATUS_DAG_LANES`]).
    pub lanes: Vec<String>,
    /// Releases issued so far.
    pub releases: u64,
    /// Finished releases that met their deadline.
    pub met: u64,
    /// Finished releases that missed it (a node failing included).
    pub missed: u64,
    /// Node runs longer than their WCET.
    pub overruns: u64,
    /// Response time of the last (up to 1024) releases, p99 and max, microseconds.
    pub response_p99_us: u64,
    /// The longest of them.
    pub response_max_us: u64,
    /// Why the daemon stopped releasing it, if it did.
    pub stopped: Option<String>,
}

/// Most uids a [`StatusReport`] lists.
pub const STATUS_UIDS: usize = 64;

/// Use of one limit against its value.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct LimitUse {
    /// In use now.
    pub used: u64,
    /// The limit (`u64::MAX`: the uid is exempt).
    pub max: u64,
}

/// One uid's use of the daemon against its per-uid limits.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct UidUsage {
    /// The uid.
    pub uid: u32,
    /// Exempt from the per-uid limits (`[limits] exempt_uids`).
    pub exempt: bool,
    /// Open connections (sessions, observers, connections that have not said hello yet).
    pub connections: LimitUse,
    /// Live sessions.
    pub sessions: LimitUse,
    /// Heap bytes granted to its sessions (ended sessions count until reclaimed).
    pub heap_bytes: LimitUse,
    /// Live queues, all its sessions.
    pub queues: LimitUse,
    /// Live buffers, all its sessions.
    pub buffers: LimitUse,
    /// Control requests handed to the control thread and not answered yet.
    pub control_requests: LimitUse,
}

/// One session and one page of its queues.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct SessionDetails {
    /// The session; `queues` holds this page's queues, `queue_count` counts them all.
    pub session: SessionStatus,
    /// Where the page started.
    pub first_queue: u64,
    /// Where the next page starts (ask again with this `first_queue`); `None` on the last page.
    /// Queues created or released between pages may be missed or listed twice.
    pub next_queue: Option<u64>,
}

/// The size of `message` encoded (without the frame's length prefix).
pub fn encoded_len<T: Serialize>(message: &T) -> usize {
    postcard::to_stdvec(message).map_or(usize::MAX, |v| v.len())
}

/// Encodes a message into a frame (length prefix included). The caller checks the length
/// against [`MAX_FRAME`] (the transport refuses to send a longer frame).
pub fn encode_frame<T: Serialize>(message: &T) -> Result<Vec<u8>, postcard::Error> {
    let mut out = vec![0u8; 4];
    let body = postcard::to_stdvec(message)?;
    out.extend_from_slice(&body);
    let len = body.len() as u32;
    out[..4].copy_from_slice(&len.to_le_bytes());
    Ok(out)
}

/// Decodes a frame body (without its length prefix).
pub fn decode_body<'a, T: Deserialize<'a>>(body: &'a [u8]) -> Result<T, postcard::Error> {
    postcard::from_bytes(body)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn frames_round_trip() {
        let r = Request::AllocBuffer { len: 77 };
        let f = encode_frame(&r).unwrap();
        let len = u32::from_le_bytes(f[..4].try_into().unwrap()) as usize;
        assert_eq!(len, f.len() - 4);
        let back: Request = decode_body(&f[4..]).unwrap();
        assert_eq!(back, r);
    }

    #[test]
    fn garbage_bodies_fail_cleanly() {
        let mut state = 12345u32;
        for n in 0..2000usize {
            let body: Vec<u8> = (0..(n % 64))
                .map(|_| {
                    state = state.wrapping_mul(1_664_525).wrapping_add(1_013_904_223);
                    (state >> 24) as u8
                })
                .collect();
            let _ = decode_body::<Request>(&body);
        }
    }

    #[test]
    fn names_that_would_rewrite_a_terminal_are_refused_without_being_echoed() {
        for ok in ["saxpy", "my app (run 3)", "données-été", "模型/推理", "a.b_c-d:1"] {
            assert!(check_name("client", ok).is_ok(), "{ok}");
        }
        for (bad, code, at) in [
            ("\u{1b}[2Jroot", "U+001B", 0),
            ("job\n  #1    sshd", "U+000A", 3),
            ("tab\there", "U+0009", 3),
            ("del\u{7f}", "U+007F", 3),
            ("c1\u{9b}31m", "U+009B", 2),
            ("user\u{202e}gnp.exe", "U+202E", 4),
            ("zero\u{200b}width", "U+200B", 4),
            ("iso\u{2066}late", "U+2066", 3),
            ("\u{feff}bom", "U+FEFF", 0),
        ] {
            match check_name("queue", bad) {
                Err(ControlError::BadRequest(message)) => {
                    assert!(
                        message.contains(code) && message.contains(&format!("at byte {at}")),
                        "{bad:?}: {message}"
                    );
                    assert!(!message.contains(bad), "the name is echoed: {message}");
                    assert!(message.starts_with("the queue name"), "{message}");
                }
                other => panic!("{bad:?} was not refused: {other:?}"),
            }
        }
        // Length first: a long name is refused for its length, whatever it holds.
        assert!(matches!(
            check_name("kernel", &"\u{1b}".repeat(MAX_NAME + 1)),
            Err(ControlError::NameTooLong { .. })
        ));
    }

    #[test]
    fn shown_escapes_what_a_terminal_would_obey_and_keeps_the_rest() {
        assert!(matches!(
            shown("plain ümlaut 名"),
            std::borrow::Cow::Borrowed("plain ümlaut 名")
        ));
        assert_eq!(shown("\u{1b}[31mred\n"), "\\u{1b}[31mred\\u{a}");
        assert_eq!(shown("a\u{202e}b"), "a\\u{202e}b");
        assert!(!shown("\u{1b}\u{9b}\u{200f}\u{7f}").chars().any(is_unshowable));
    }

    #[test]
    fn unknown_kernel_message_suggests() {
        let e = ControlError::UnknownKernel {
            name: "saxp".into(),
            suggestions: vec!["saxpy".into()],
        };
        assert_eq!(e.to_string(), "unknown kernel 'saxp'; did you mean saxpy?");
    }
}
