//! Completion records and the typed per-task error they carry.
//!
//! A completion is 32 bytes: the task id, an error code, an argument index and two numbers
//! whose meaning depends on the code. [`TaskError`] converts both ways, so the daemon and every
//! client print the same message for the same failure.

use bytemuck::{Pod, Zeroable};

use crate::descriptor::ArgTag;

/// The record the daemon writes into the completion ring.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Pod, Zeroable)]
#[repr(C)]
pub struct Completion {
    /// The task id from the descriptor.
    pub task_id: u64,
    /// 0 on success, otherwise an error code.
    pub code: u16,
    /// Argument index, when the error concerns one.
    pub arg: u16,
    /// Zero, except for [`TaskError::DeviceQuota`]: the device's memory in MiB.
    pub reserved: u32,
    /// First detail value.
    pub a: u64,
    /// Second detail value.
    pub b: u64,
}

/// What is malformed in a descriptor.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Malformed {
    /// The operation code is unknown.
    UnknownOp(u32),
    /// `arg_count` exceeds [`crate::MAX_ARGS`].
    TooManyArguments(u32),
    /// An argument tag is unknown.
    BadArgumentTag {
        /// Which argument.
        index: u16,
        /// The tag found.
        tag: u32,
    },
    /// `dims` is not 1, 2 or 3.
    BadDimensions(u32),
}

/// Which device limit a launch exceeds ([`TaskError::DeviceLimit`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LaunchLimit {
    /// Work items of the whole launch, however it is split.
    Items,
    /// Work items in one dimension of the range (0, 1 or 2).
    Extent(u8),
    /// Work items of one enqueue (one device command), when even the smallest row slice of the
    /// launch exceeds it: dimensions 1 and 2 are never split.
    ItemsPerEnqueue,
    /// Work-groups of one enqueue, likewise.
    GroupsPerEnqueue,
    /// Row slices (enqueues) the launch would need to keep every enqueue within the device's
    /// limits.
    Enqueues,
    /// Work items of one work-group (the size the kernel runs with on that device).
    WorkGroupSize,
    /// Bytes of one buffer argument (by index): larger than one allocation on the device.
    BufferBytes(u8),
}

impl LaunchLimit {
    fn code(self) -> u16 {
        match self {
            LaunchLimit::Items => 0,
            LaunchLimit::Extent(d) => 1 + u16::from(d.min(2)),
            LaunchLimit::ItemsPerEnqueue => 4,
            LaunchLimit::GroupsPerEnqueue => 5,
            LaunchLimit::Enqueues => 6,
            LaunchLimit::WorkGroupSize => 7,
            LaunchLimit::BufferBytes(index) => 16 + u16::from(index),
        }
    }

    fn from_code(code: u16) -> Option<Self> {
        Some(match code {
            0 => LaunchLimit::Items,
            1..=3 => LaunchLimit::Extent((code - 1) as u8),
            4 => LaunchLimit::ItemsPerEnqueue,
            5 => LaunchLimit::GroupsPerEnqueue,
            6 => LaunchLimit::Enqueues,
            7 => LaunchLimit::WorkGroupSize,
            16..=271 => LaunchLimit::BufferBytes((code - 16) as u8),
            _ => return None,
        })
    }

    /// What the limit bounds, for messages.
    pub fn describe(self) -> String {
        match self {
            LaunchLimit::Items => "work items of one launch".into(),
            LaunchLimit::Extent(d) => format!("work items in dimension {d} of the range"),
            LaunchLimit::ItemsPerEnqueue => {
                "work items of one enqueue (its smallest row slice; dimensions 1 and 2 are never split)".into()
            }
            LaunchLimit::GroupsPerEnqueue => {
                "work-groups of one enqueue (its smallest row slice; dimensions 1 and 2 are never split)".into()
            }
            LaunchLimit::Enqueues => "row slices (enqueues) the launch needs".into(),
            LaunchLimit::WorkGroupSize => "work items of one work-group".into(),
            LaunchLimit::BufferBytes(index) => format!("bytes of buffer argument {index} (one device allocation)"),
        }
    }
}

/// Why a task failed. Every variant names the problem and, where it helps, what to do.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
pub enum TaskError {
    /// The descriptor's fixed fields are invalid (a corrupted or hand-written descriptor).
    #[error("malformed task descriptor: {}", describe_malformed(.0))]
    Malformed(Malformed),
    /// The queue handle does not name a live queue of this session.
    #[error("unknown queue handle {0:#x}: the queue was released or never created in this session")]
    UnknownQueue(u64),
    /// The kernel id is not in the daemon's kernel table.
    #[error("{}", unknown_kernel(*.0))]
    UnknownKernel(u32),
    /// Wrong number of arguments.
    #[error("wrong argument count: the kernel takes {expected}, the launch passed {got}")]
    ArgumentCount {
        /// Declared count.
        expected: u32,
        /// Passed count.
        got: u32,
    },
    /// An argument has the wrong type.
    #[error("argument {index} has the wrong type: expected {}, got {}", tag_name(*.expected), tag_name(*.got))]
    ArgumentType {
        /// Which argument.
        index: u16,
        /// Expected [`ArgTag`].
        expected: u32,
        /// Found [`ArgTag`].
        got: u32,
    },
    /// A buffer handle does not name a live buffer of this session.
    #[error(
        "argument {index}: invalid buffer handle {handle:#x} (released, never allocated, or from another session)"
    )]
    InvalidHandle {
        /// Which argument.
        index: u16,
        /// The handle.
        handle: u64,
    },
    /// A buffer of another session, refused by the client before the task is issued: buffer
    /// handles are numbered per session, so the daemon would take this session's buffer of the
    /// same number. Its kind is `invalid_handle`, like [`TaskError::InvalidHandle`].
    #[error(
        "argument {index}: buffer {handle:#x} belongs to another session (handles are numbered per session, \
         so this session would use its own buffer of that number); use buffers of the queue's own session, \
         or share one across sessions by exporting it and attaching the export"
    )]
    ForeignBuffer {
        /// Which argument.
        index: u16,
        /// The handle (in its own session).
        handle: u64,
    },
    /// A kernel of a program built by another session, refused by the client before the task is
    /// issued: program kernels are numbered per session, so the daemon would run this session's
    /// kernel of the same number. Its kind is `invalid_handle`, like [`TaskError::InvalidHandle`].
    #[error(
        "kernel id {kernel:#x} belongs to a program built by another session (program kernels are numbered per \
         session, so this session would run its own kernel of that number); launch it on a queue of the session \
         that built the program, or build the program in this session too"
    )]
    ForeignKernel {
        /// The kernel's id (in its own session).
        kernel: u32,
    },
    /// A buffer is too small for the launch's range and scalars.
    #[error("argument {index}: buffer too small for this launch: needs {needed} bytes, has {len}")]
    BufferTooSmall {
        /// Which argument.
        index: u16,
        /// Bytes the launch needs.
        needed: u64,
        /// Bytes the buffer has.
        len: u64,
    },
    /// A byte range (sync, memset, copy) lies outside the buffer.
    #[error("argument {index}: byte range ends at {end}, past the buffer's {len} bytes")]
    OutOfBounds {
        /// Which argument.
        index: u16,
        /// End of the requested range.
        end: u64,
        /// Buffer length.
        len: u64,
    },
    /// A scalar argument is outside what the kernel accepts.
    #[error("argument {index}: scalar value {value} is out of the kernel's accepted range")]
    InvalidScalar {
        /// Which argument.
        index: u16,
        /// The value (as i64 bits).
        value: i64,
    },
    /// The range is empty or too large.
    #[error("invalid range: {items} work items (each dimension must be at least 1, at most {max} items in all)")]
    InvalidRange {
        /// Items requested (saturated).
        items: u64,
        /// Most allowed.
        max: u64,
    },
    /// The kernel's size rule fixes its range exactly (the extents come from its scalar
    /// arguments, e.g. `(m, n)` for `sgemm`), and the launch asked for another one. Extents are
    /// saturated to the field widths on the wire.
    #[error(
        "invalid range {}: the range must be exactly {}, the extents this kernel's arguments give (its doc says which, e.g. sgemm's range is (m, n)); launch it over that range",
        extents(&[u64::from(*.got_x), u64::from(*.got_y), u64::from(*.got_z)]),
        extents(&[u64::from(*.expected_x), u64::from(*.expected_y)])
    )]
    RangeMismatch {
        /// The extent dimension 0 must have.
        expected_x: u32,
        /// The extent dimension 1 must have (1 for one-dimensional kernels).
        expected_y: u32,
        /// The launch's extent in dimension 0.
        got_x: u32,
        /// The launch's extent in dimension 1 (1 when it has one dimension).
        got_y: u32,
        /// The launch's extent in dimension 2 (1 when it has fewer dimensions).
        got_z: u16,
    },
    /// One buffer is passed twice and at least one use writes it.
    #[error("arguments {index} and {other} are the same buffer and one of them is written; pass distinct buffers")]
    Aliased {
        /// First use.
        index: u16,
        /// Second use.
        other: u64,
    },
    /// No usable device of this node implements the kernel: none does, or every one that does is
    /// drained or failed.
    #[error("{}", no_device(*.0))]
    NoDevice(u32),
    /// The kernel faulted while running (a bug in the kernel library; the daemon survived).
    #[error("the kernel faulted while running; the daemon logged the details")]
    KernelFault,
    /// The task was cancelled before it ran (its session or queue went away).
    #[error("the task was cancelled before it ran")]
    Cancelled,
    /// A device could not allocate memory for a buffer the task needs.
    #[error("argument {index}: the device has no room for {needed} more bytes; use smaller buffers or fewer at once")]
    DeviceOutOfMemory {
        /// Which argument.
        index: u16,
        /// Bytes requested.
        needed: u64,
    },
    /// The task's buffers do not fit in the session's device-memory quota, even with the
    /// session's other buffers evicted.
    #[error("the task's buffers need {needed} bytes of device memory at once but the session's device quota is {quota} bytes per device (the device has {device_mib} MiB), so it can never run there; use smaller buffers or ask the operator for a larger quota (agora serve --device-quota; in a Slurm job, more `agora` GRES shares or the prolog's AGORA_DEVICE_QUOTA_PER_SHARE)")]
    DeviceQuota {
        /// Bytes the task's buffers need on the device.
        needed: u64,
        /// The quota.
        quota: u64,
        /// The device's memory, MiB (sent in the completion record's `reserved` word).
        device_mib: u32,
    },
    /// The device reported an error running the task (logged by the daemon): an OpenCL error
    /// code (negative) or a CUDA driver result (positive).
    #[error("{}", device_failed(*.0))]
    DeviceFailed(i64),
    /// The device running the task failed (a backend reports this for every job on a device
    /// that is gone). The daemon replays such a task on another device when its inputs survive;
    /// a client sees this error only when no other device can run the kernel.
    #[error("the device running this task failed and no other device could run it; the daemon logged the details")]
    DeviceLost,
    /// A buffer the task reads had its only valid copy on a device that failed, so its contents
    /// are gone (the host copy is older). Writing the whole buffer again makes it usable.
    #[error("argument {index}: this buffer's newest contents are gone (their only copy was on a device that failed, or in a daemon that restarted before a sync_from); write it again (sync_to, or a memset/kernel that overwrites all of it) before reading it")]
    DataLost {
        /// Which argument.
        index: u16,
    },
    /// The launch exceeds a limit of every device that implements the kernel (the daemon splits
    /// a range too large for one enqueue into row slices where it can; this is what no split
    /// fixes). `value` is what the launch asks for, `max` the most the device takes.
    #[error("the launch exceeds a device limit: {} is {value}, at most {max} on every device that implements the kernel; use a smaller range or several launches", .limit.describe())]
    DeviceLimit {
        /// Which limit.
        limit: LaunchLimit,
        /// What the launch asks for.
        value: u64,
        /// The device's limit.
        max: u64,
    },
    /// A buffer the task reads holds what a failed task should have produced: the task did not
    /// run. `task` is the failure's origin (the first task in the chain that failed for a reason
    /// of its own) and `cause` its error code.
    #[error(
        "argument {index}: this buffer's contents should have come from task {task}, which failed ({}); the task did not run. Rewrite the buffer (sync_to, a memset or copy over all of it, or a launch that writes all of it without reading it: a write-only argument, or sgemm with beta = 0) to use it again",
        cause_name(*.cause)
    )]
    DependencyFailed {
        /// Which argument.
        index: u16,
        /// The task whose failure left the buffer without valid contents.
        task: u64,
        /// That task's error code (see [`TaskError::code`]).
        cause: u16,
    },
    /// The task's buffers together are larger than the device it must run on: it can never
    /// fit there, however long it waits. (A task whose buffers fit waits for room instead.)
    #[error("the task's buffers need {needed} bytes of device memory at once, but the device has {capacity} bytes in all; use smaller buffers or split the work")]
    DeviceTooSmall {
        /// Bytes of the task's buffers.
        needed: u64,
        /// The device's memory (what the daemon may use of it).
        capacity: u64,
    },
    /// A tenant program's kernel crashed its sandboxed executor process with a signal (e.g. 11,
    /// SIGSEGV, for an out-of-bounds access; 6, SIGABRT, for `abort()`). The daemon restarted the
    /// executor; other tenants were not affected.
    #[error("the tenant kernel crashed its sandbox with signal {signal} ({}); the executor was restarted: fix the kernel (an out-of-bounds access or abort())", signal_name(*.signal))]
    KernelCrashed {
        /// The signal number.
        signal: u16,
    },
    /// A tenant program's kernel ran longer than the per-launch limit; the daemon killed its
    /// executor (and restarted it).
    #[error("the tenant kernel ran longer than the {limit_ms} ms per-launch limit and was stopped; make launches shorter or ask the operator for a longer limit (agora serve --program-timeout)")]
    KernelTimeout {
        /// The limit in milliseconds.
        limit_ms: u64,
    },
    /// A tenant program's C kernel returned `code`, not 0: its own report that it failed. The
    /// code travels in the completion, since the tenant cannot read the daemon's log.
    #[error(
        "the tenant kernel returned {code} (a C kernel returns 0 for success), so the task failed and what it \
         wrote is not valid: look in your kernel's source for where it returns {code}"
    )]
    KernelReturned {
        /// What the kernel returned.
        code: i32,
    },
    /// A tenant program's kernel ended its sandboxed executor process with an exit status (it,
    /// or a library it uses, called `exit`; 127 is the dynamic linker's status for a symbol it
    /// could not resolve). The daemon restarted the executor. The status travels in the
    /// completion, since the tenant cannot read the daemon's log.
    #[error(
        "the tenant kernel ended its sandbox with exit status {status} ({}); the executor was restarted",
        exit_meaning(*.status)
    )]
    KernelExited {
        /// The exit status.
        status: i32,
    },
    /// A tenant OpenCL kernel's launch failed in its executor with this OpenCL error (the
    /// executor survived). The code travels in the completion, since the tenant cannot read the
    /// daemon's log.
    #[error(
        "the tenant kernel's launch failed in its sandbox with OpenCL error {code} ({}): check the kernel's \
         resources (e.g. the size of its __local arrays) and the launch's range",
        opencl_error_name(*.code)
    )]
    KernelOpenCl {
        /// The OpenCL error code (negative).
        code: i32,
    },
    /// The daemon stopped (it crashed, or was restarted or upgraded) while the task was issued
    /// but not complete; the client reconnected to the new daemon, which never saw the task.
    /// Issue it again (its inputs in host copies are intact; a buffer whose newest contents
    /// were on a device reports `DataLost` when read).
    #[error("the daemon restarted before this task completed; the session was resumed on the new daemon: issue the task again")]
    DaemonRestarted,
    /// The daemon found itself in a state it should never be in while handling the task (a bug
    /// of the daemon, not of the task or its kernel); it logged the details. `0` names the
    /// place for the report.
    #[error("internal error {0} of the Agora daemon (a bug, not your program's; the daemon logged the details): please report it")]
    Internal(u16),
    /// The daemon ran out of a host resource ([`Resource`]: file descriptors or memory) while
    /// preparing the task's kernel (an OpenCL program build, or a kernel's compilation at its
    /// first launch). Transient: nothing was cached as broken, and a later use builds again once
    /// `retry_ms` have passed. Issue the task again.
    #[error(
        "the daemon ran out of {} while preparing this task's kernel; this is transient (nothing was cached as broken): issue the task again{}, and if it keeps happening ask the operator to raise the daemon's limit ({})",
        Resource::from_code(*.resource).describe(),
        retry_after(*.retry_ms),
        Resource::from_code(*.resource).remedy()
    )]
    ResourceExhausted {
        /// Which resource ([`Resource::code`]).
        resource: u16,
        /// Milliseconds until the daemon tries again (0: at the next use).
        retry_ms: u64,
    },
    /// A checkpoint task the daemon could not take (nothing was captured; earlier checkpoints
    /// are untouched).
    #[error("checkpoint {checkpoint} refused: {}", checkpoint_refusal(*.reason, *.level, *.detail))]
    CheckpointRefused {
        /// Why ([`CHECKPOINT_NOTHING_PROTECTED`] and the other `CHECKPOINT_*` codes).
        reason: u16,
        /// The level asked for.
        level: u8,
        /// The checkpoint's id.
        checkpoint: u64,
        /// [`CHECKPOINT_NAME_IN_USE`]: the process id of the other live session that writes the
        /// application's checkpoints. [`CHECKPOINT_ID_NOT_NEWER`]: the application's newest id
        /// and where it came from, [`newest_detail`]. 0 otherwise. (One field for both keeps
        /// `TaskError` at 24 bytes: it rides in many `Result`s.)
        detail: u64,
    },
    /// Argument `index` is an attached buffer the task may not use that way: the attachment is
    /// read-only and the task writes it, or its export was revoked (or its exporter ended).
    #[error("argument {index} (buffer {handle:#x}): {}", attachment_refusal(*.reason))]
    Attachment {
        /// Argument index.
        index: u16,
        /// The buffer's handle.
        handle: u64,
        /// Why ([`ATTACHMENT_READ_ONLY`] or [`ATTACHMENT_REVOKED`]).
        reason: u16,
    },
    /// A launch's row window ([`crate::TaskDescriptor::window_first`]) cannot run: it lies
    /// outside the range, the kernel is not chunkable, or no device can run rows starting there.
    #[error("row window {first}..{end}: {}", window_refusal(*.reason))]
    BadWindow {
        /// Why ([`WINDOW_OUTSIDE`] and the other `WINDOW_*` codes).
        reason: u16,
        /// The window's first row.
        first: u64,
        /// One past its last row.
        end: u64,
    },
    /// The error code is not known to this client (a newer daemon).
    #[error("unknown error code {0} from the daemon: upgrade the client")]
    Unknown(u16),
}

/// [`TaskError::BadWindow`]: empty, outside the launch's first dimension, or on an operation
/// that is not a launch.
pub const WINDOW_OUTSIDE: u16 = 1;
/// [`TaskError::BadWindow`]: the kernel's rows are not independent (not chunkable).
pub const WINDOW_NOT_CHUNKABLE: u16 = 2;
/// [`TaskError::BadWindow`]: the window's bounds are not multiples of the row alignment of any
/// device that implements the kernel (OpenCL and CUDA run whole work-groups).
pub const WINDOW_MISALIGNED: u16 = 3;

fn window_refusal(reason: u16) -> String {
    match reason {
        WINDOW_OUTSIDE => "a window is non-empty, inside the launch's first dimension, and only on launches".into(),
        WINDOW_NOT_CHUNKABLE => "the kernel is not chunkable (its rows depend on each other), so it cannot run part of its range; launch it whole".into(),
        WINDOW_MISALIGNED => "no device that implements the kernel can start or end a window there (its work-groups span several rows); put window bounds at multiples of 1024 rows".into(),
        _ => format!("reason {reason} (a newer daemon)"),
    }
}

/// [`TaskError::Attachment`]: the task writes a buffer attached read-only.
pub const ATTACHMENT_READ_ONLY: u16 = 1;
/// [`TaskError::Attachment`]: the export was revoked, or its exporter's session ended.
pub const ATTACHMENT_REVOKED: u16 = 2;

fn attachment_refusal(reason: u16) -> String {
    match reason {
        ATTACHMENT_READ_ONLY => "attached read-only, and this task writes it; attach with writable=True if the export allows writers, or write a buffer of your own".into(),
        ATTACHMENT_REVOKED => "its export was revoked or its exporter's session ended; the memory you mapped stays readable, but tasks may no longer use it (drop it, and attach the exporter's new name if it publishes one)".into(),
        _ => format!("reason {reason} (a newer daemon)"),
    }
}

/// [`TaskError::CheckpointRefused`]: the session protected no buffer.
pub const CHECKPOINT_NOTHING_PROTECTED: u16 = 1;
/// [`TaskError::CheckpointRefused`]: the level is not 1–4, or needs a directory the daemon
/// has not configured.
pub const CHECKPOINT_LEVEL_UNAVAILABLE: u16 = 2;
/// [`TaskError::CheckpointRefused`]: the id is not larger than the application's newest one.
pub const CHECKPOINT_ID_NOT_NEWER: u16 = 3;
/// [`TaskError::CheckpointRefused`]: the daemon has no checkpoint store (its directory could
/// not be created; the daemon's log says why).
pub const CHECKPOINT_NO_STORE: u16 = 4;
/// [`TaskError::CheckpointRefused`]: the id is 0. Ids start at 1: `agora_checkpoint_status` and
/// the like report 0 for "no checkpoint", so a checkpoint 0 could not be told from none.
pub const CHECKPOINT_ID_ZERO: u16 = 5;
/// [`TaskError::CheckpointRefused`]: another live session of the same user and application
/// name (its pid in the error) already writes the application's checkpoints. Two processes
/// writing one checkpoint stream would refuse each other's ids and, after a restart, recover
/// each other's data.
pub const CHECKPOINT_NAME_IN_USE: u16 = 6;

/// [`TaskError::CheckpointRefused`]: the level's directory is configured but unusable (the
/// daemon's log, and the client's own refusal, name it and why).
pub const CHECKPOINT_LEVEL_UNUSABLE: u16 = 7;

/// [`TaskError::CheckpointRefused`]'s `newest_from`: the newest id was in the checkpoint store
/// when this daemon first looked (written by an earlier run of the application, or an earlier
/// daemon).
pub const NEWEST_FROM_STORE: u8 = 1;
/// `newest_from`: taken by `snapshot()`.
pub const NEWEST_FROM_SNAPSHOT: u8 = 2;
/// `newest_from`: taken by an explicit `checkpoint(id)` since the daemon started.
pub const NEWEST_FROM_CHECKPOINT: u8 = 3;
/// The largest newest id a [`TaskError::CheckpointRefused`] carries (48 bits; a larger one is
/// reported as this, "at least").
pub const NEWEST_MAX: u64 = (1 << 48) - 1;

/// [`TaskError::CheckpointRefused`]'s `detail` for [`CHECKPOINT_ID_NOT_NEWER`]: the newest id
/// (capped at [`NEWEST_MAX`]) and where it came from (`NEWEST_FROM_*`).
pub fn newest_detail(newest: u64, from: u8) -> u64 {
    newest.min(NEWEST_MAX) | u64::from(from) << 48
}

fn checkpoint_refusal(reason: u16, level: u8, detail: u64) -> String {
    let pid = detail as u32;
    let (newest, newest_from) = (detail & NEWEST_MAX, (detail >> 48) as u8);
    match reason {
        CHECKPOINT_NOTHING_PROTECTED => "no buffer is protected in this session; protect the data first (session.protect(id, buffer))".into(),
        CHECKPOINT_LEVEL_UNAVAILABLE => format!("level {level} is not available on this daemon (levels are 1-4; level 2 needs [checkpoint] partner and level 4 [checkpoint] shared in the daemon's configuration)"),
        CHECKPOINT_ID_NOT_NEWER => {
            let at_least = if newest >= NEWEST_MAX { "at least " } else { "" };
            let from = match newest_from {
                NEWEST_FROM_STORE => ", found in the checkpoint store (an earlier run of the application wrote it)",
                NEWEST_FROM_SNAPSHOT => ", taken by snapshot() (a snapshot takes the id after the newest)",
                NEWEST_FROM_CHECKPOINT => ", taken by an earlier checkpoint() of the application",
                _ => "",
            };
            format!("its id is not larger than this application's newest checkpoint, {at_least}{newest}{from}; use increasing ids (e.g. the iteration number), or recover() to go on from an older one")
        }
        CHECKPOINT_LEVEL_UNUSABLE => format!("level {level}'s directory ([checkpoint] partner for level 2, shared for level 4) is configured but unusable (the daemon's log names it and why); fix it and restart the daemon, or use level 1 or 3"),
        CHECKPOINT_NO_STORE => "the daemon has no checkpoint store (see its log for why its directory is unusable)".into(),
        CHECKPOINT_ID_ZERO => "checkpoint ids start at 1 (0 means \"no checkpoint\" to agora_checkpoint_status); use e.g. the number of iterations done".into(),
        CHECKPOINT_NAME_IN_USE => format!(
            "another live session (pid {pid}) of the same user and application already checkpoints under this \
             session's name, and two processes writing one checkpoint stream would recover each other's data; \
             give each process its own name (Rust SessionOptions::name, Python agora.Session(name=...), \
             C AgoraSessionOptions.name with agora_session_open_with), e.g. with its rank in it \
             (MPI and Slurm ranks get \".rank<N>\" in their default name)"
        ),
        _ => format!("reason {reason} (a newer daemon)"),
    }
}

/// A host resource the daemon can run out of ([`TaskError::ResourceExhausted`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Resource {
    /// File descriptors (`EMFILE`, `ENFILE`; OpenCL's `CL_OUT_OF_RESOURCES`).
    FileDescriptors,
    /// Host memory (`ENOMEM`; OpenCL's `CL_OUT_OF_HOST_MEMORY`).
    Memory,
    /// A resource this client does not know (a newer daemon).
    Other,
}

impl Resource {
    /// Its code on the wire.
    pub fn code(self) -> u16 {
        match self {
            Resource::FileDescriptors => 1,
            Resource::Memory => 2,
            Resource::Other => 0,
        }
    }

    /// The resource of a wire code.
    pub fn from_code(code: u16) -> Resource {
        match code {
            1 => Resource::FileDescriptors,
            2 => Resource::Memory,
            _ => Resource::Other,
        }
    }

    /// What ran out, for messages.
    pub fn describe(self) -> &'static str {
        match self {
            Resource::FileDescriptors => "file descriptors",
            Resource::Memory => "host memory",
            Resource::Other => "a host resource",
        }
    }

    /// What the operator can do, for messages.
    pub fn remedy(self) -> &'static str {
        match self {
            Resource::FileDescriptors => "ulimit -n, or LimitNOFILE= in its service unit",
            Resource::Memory => "free memory on the node, or lower other tenants' quotas",
            Resource::Other => "see the daemon's log",
        }
    }
}

/// `(x, y, z)` without trailing extents of 1 (at least one extent).
fn extents(dims: &[u64]) -> String {
    let used = dims.iter().rposition(|d| *d != 1).map_or(1, |last| last + 1);
    let list: Vec<String> = dims[..used].iter().map(u64::to_string).collect();
    format!("({})", list.join(", "))
}

/// When to issue a task again, for messages.
fn retry_after(retry_ms: u64) -> String {
    if retry_ms == 0 {
        String::new()
    } else {
        format!(" in {retry_ms} ms or later")
    }
}

fn cause_name(code: u16) -> &'static str {
    TaskError::decode(code, 0, 0, 0, 0).kind()
}

fn tag_name(tag: u32) -> &'static str {
    ArgTag::from_u32(tag).map(ArgTag::name).unwrap_or("an unknown tag")
}

fn describe_malformed(m: &Malformed) -> String {
    match m {
        Malformed::UnknownOp(op) => format!("unknown operation code {op}"),
        Malformed::TooManyArguments(n) => {
            format!("{n} arguments, at most {} allowed", crate::MAX_ARGS)
        }
        Malformed::BadArgumentTag { index, tag } => {
            format!("argument {index} has unknown tag {tag}")
        }
        Malformed::BadDimensions(d) => format!("{d} range dimensions, expected 1 to 3"),
    }
}

impl Completion {
    /// A successful completion.
    pub fn ok(task_id: u64) -> Self {
        Completion {
            task_id,
            ..Default::default()
        }
    }

    /// A failed completion.
    pub fn failed(task_id: u64, error: TaskError) -> Self {
        let (code, arg, a, b) = error.encode();
        Completion {
            task_id,
            code,
            arg,
            reserved: match error {
                TaskError::DeviceQuota { device_mib, .. } => device_mib,
                _ => 0,
            },
            a,
            b,
        }
    }

    /// The outcome this record carries.
    pub fn result(&self) -> Result<(), TaskError> {
        if self.code == 0 {
            Ok(())
        } else {
            Err(TaskError::decode(self.code, self.arg, self.a, self.b, self.reserved))
        }
    }
}

impl TaskError {
    /// Short stable name of the error kind, for metrics and bindings.
    pub fn kind(&self) -> &'static str {
        match self {
            TaskError::Malformed(_) => "malformed",
            TaskError::UnknownQueue(_) => "unknown_queue",
            TaskError::UnknownKernel(_) => "unknown_kernel",
            TaskError::ArgumentCount { .. } => "argument_count",
            TaskError::ArgumentType { .. } => "argument_type",
            TaskError::InvalidHandle { .. } | TaskError::ForeignBuffer { .. } | TaskError::ForeignKernel { .. } => {
                "invalid_handle"
            }
            TaskError::BufferTooSmall { .. } => "buffer_too_small",
            TaskError::OutOfBounds { .. } => "out_of_bounds",
            TaskError::InvalidScalar { .. } => "invalid_scalar",
            TaskError::InvalidRange { .. } => "invalid_range",
            TaskError::RangeMismatch { .. } => "range_mismatch",
            TaskError::Aliased { .. } => "aliased",
            TaskError::NoDevice(_) => "no_device",
            TaskError::KernelFault => "kernel_fault",
            TaskError::Cancelled => "cancelled",
            TaskError::DeviceOutOfMemory { .. } => "device_out_of_memory",
            TaskError::DeviceQuota { .. } => "device_quota",
            TaskError::DeviceFailed(_) => "device_failed",
            TaskError::DeviceLost => "device_lost",
            TaskError::DataLost { .. } => "data_lost",
            TaskError::DeviceLimit { .. } => "device_limit",
            TaskError::DependencyFailed { .. } => "dependency_failed",
            TaskError::Internal(_) => "internal",
            TaskError::DeviceTooSmall { .. } => "device_too_small",
            TaskError::KernelCrashed { .. } => "kernel_crashed",
            TaskError::KernelTimeout { .. } => "kernel_timeout",
            TaskError::KernelReturned { .. } => "kernel_returned",
            TaskError::KernelExited { .. } => "kernel_exited",
            TaskError::KernelOpenCl { .. } => "kernel_opencl",
            TaskError::DaemonRestarted => "daemon_restarted",
            TaskError::ResourceExhausted { .. } => "resource_exhausted",
            TaskError::CheckpointRefused { .. } => "checkpoint_refused",
            TaskError::Attachment { .. } => "attachment",
            TaskError::BadWindow { .. } => "bad_window",
            TaskError::Unknown(_) => "unknown",
        }
    }

    /// The error's code on the wire (stable across versions).
    pub fn code(&self) -> u16 {
        self.encode().0
    }

    /// Where a failure began: for [`TaskError::DependencyFailed`] the original task and its
    /// error's code, otherwise `task` (the task that failed with `self`) and this error's code.
    pub fn origin(&self, task: u64) -> (u64, u16) {
        match *self {
            TaskError::DependencyFailed { task, cause, .. } => (task, cause),
            _ => (task, self.code()),
        }
    }

    fn encode(self) -> (u16, u16, u64, u64) {
        match self {
            TaskError::Malformed(Malformed::UnknownOp(op)) => (1, 0, u64::from(op), 0),
            TaskError::Malformed(Malformed::TooManyArguments(n)) => (2, 0, u64::from(n), 0),
            TaskError::Malformed(Malformed::BadArgumentTag { index, tag }) => (3, index, u64::from(tag), 0),
            TaskError::Malformed(Malformed::BadDimensions(d)) => (4, 0, u64::from(d), 0),
            TaskError::UnknownQueue(q) => (5, 0, q, 0),
            TaskError::UnknownKernel(k) => (6, 0, u64::from(k), 0),
            TaskError::ArgumentCount { expected, got } => (7, 0, u64::from(expected), u64::from(got)),
            TaskError::ArgumentType { index, expected, got } => (8, index, u64::from(expected), u64::from(got)),
            TaskError::InvalidHandle { index, handle } => (9, index, handle, 0),
            TaskError::ForeignBuffer { index, handle } => (35, index, handle, 0),
            TaskError::ForeignKernel { kernel } => (36, 0, u64::from(kernel), 0),
            TaskError::BufferTooSmall { index, needed, len } => (10, index, needed, len),
            TaskError::OutOfBounds { index, end, len } => (11, index, end, len),
            TaskError::InvalidScalar { index, value } => (12, index, value as u64, 0),
            TaskError::InvalidRange { items, max } => (13, 0, items, max),
            TaskError::Aliased { index, other } => (14, index, other, 0),
            TaskError::NoDevice(k) => (15, 0, u64::from(k), 0),
            TaskError::KernelFault => (16, 0, 0, 0),
            TaskError::Cancelled => (17, 0, 0, 0),
            TaskError::DeviceOutOfMemory { index, needed } => (18, index, needed, 0),
            TaskError::DeviceFailed(code) => (19, 0, code as u64, 0),
            TaskError::DeviceQuota { needed, quota, .. } => (20, 0, needed, quota),
            TaskError::DeviceLost => (21, 0, 0, 0),
            TaskError::DataLost { index } => (22, index, 0, 0),
            TaskError::DeviceLimit { limit, value, max } => (23, limit.code(), value, max),
            TaskError::DependencyFailed { index, task, cause } => (24, index, task, u64::from(cause)),
            TaskError::Internal(place) => (25, place, 0, 0),
            TaskError::DeviceTooSmall { needed, capacity } => (27, 0, needed, capacity),
            TaskError::KernelCrashed { signal } => (28, signal, 0, 0),
            TaskError::KernelTimeout { limit_ms } => (29, 0, limit_ms, 0),
            TaskError::KernelReturned { code } => (37, 0, i64::from(code) as u64, 0),
            TaskError::KernelExited { status } => (38, 0, i64::from(status) as u64, 0),
            TaskError::KernelOpenCl { code } => (39, 0, i64::from(code) as u64, 0),
            TaskError::DaemonRestarted => (30, 0, 0, 0),
            TaskError::ResourceExhausted { resource, retry_ms } => (31, resource, retry_ms, 0),
            // The pid rides in the upper half of `b` (older clients read the level's byte only).
            // For CHECKPOINT_ID_NOT_NEWER (no pid) the newest id's origin and the id itself.
            TaskError::CheckpointRefused {
                reason,
                level,
                checkpoint,
                detail,
            } => (
                32,
                reason,
                checkpoint,
                if reason == CHECKPOINT_ID_NOT_NEWER {
                    u64::from(level) | detail << 8
                } else {
                    u64::from(level) | (detail & 0xffff_ffff) << 32
                },
            ),
            TaskError::Attachment { index, handle, reason } => (33, index, handle, u64::from(reason)),
            TaskError::BadWindow { reason, first, end } => (34, reason, first, end),
            TaskError::RangeMismatch {
                expected_x,
                expected_y,
                got_x,
                got_y,
                got_z,
            } => (
                26,
                got_z,
                u64::from(expected_x) << 32 | u64::from(expected_y),
                u64::from(got_x) << 32 | u64::from(got_y),
            ),
            TaskError::Unknown(code) => (code, 0, 0, 0),
        }
    }

    fn decode(code: u16, arg: u16, a: u64, b: u64, reserved: u32) -> Self {
        let a32 = a as u32;
        match code {
            1 => TaskError::Malformed(Malformed::UnknownOp(a32)),
            2 => TaskError::Malformed(Malformed::TooManyArguments(a32)),
            3 => TaskError::Malformed(Malformed::BadArgumentTag { index: arg, tag: a32 }),
            4 => TaskError::Malformed(Malformed::BadDimensions(a32)),
            5 => TaskError::UnknownQueue(a),
            6 => TaskError::UnknownKernel(a32),
            7 => TaskError::ArgumentCount {
                expected: a32,
                got: b as u32,
            },
            8 => TaskError::ArgumentType {
                index: arg,
                expected: a32,
                got: b as u32,
            },
            9 => TaskError::InvalidHandle { index: arg, handle: a },
            35 => TaskError::ForeignBuffer { index: arg, handle: a },
            36 => TaskError::ForeignKernel { kernel: a32 },
            10 => TaskError::BufferTooSmall {
                index: arg,
                needed: a,
                len: b,
            },
            11 => TaskError::OutOfBounds {
                index: arg,
                end: a,
                len: b,
            },
            12 => TaskError::InvalidScalar {
                index: arg,
                value: a as i64,
            },
            13 => TaskError::InvalidRange { items: a, max: b },
            14 => TaskError::Aliased { index: arg, other: a },
            15 => TaskError::NoDevice(a32),
            16 => TaskError::KernelFault,
            17 => TaskError::Cancelled,
            18 => TaskError::DeviceOutOfMemory { index: arg, needed: a },
            19 => TaskError::DeviceFailed(a as i64),
            20 => TaskError::DeviceQuota {
                needed: a,
                quota: b,
                device_mib: reserved,
            },
            21 => TaskError::DeviceLost,
            22 => TaskError::DataLost { index: arg },
            23 => match LaunchLimit::from_code(arg) {
                Some(limit) => TaskError::DeviceLimit {
                    limit,
                    value: a,
                    max: b,
                },
                None => TaskError::Unknown(code),
            },
            25 => TaskError::Internal(arg),
            27 => TaskError::DeviceTooSmall { needed: a, capacity: b },
            28 => TaskError::KernelCrashed { signal: arg },
            29 => TaskError::KernelTimeout { limit_ms: a },
            37 => TaskError::KernelReturned { code: a as i64 as i32 },
            38 => TaskError::KernelExited {
                status: a as i64 as i32,
            },
            39 => TaskError::KernelOpenCl { code: a as i64 as i32 },
            30 => TaskError::DaemonRestarted,
            31 => TaskError::ResourceExhausted {
                resource: arg,
                retry_ms: a,
            },
            32 => TaskError::CheckpointRefused {
                reason: arg,
                level: b as u8,
                checkpoint: a,
                detail: if arg == CHECKPOINT_ID_NOT_NEWER {
                    b >> 8
                } else {
                    b >> 32
                },
            },
            33 => TaskError::Attachment {
                index: arg,
                handle: a,
                reason: b as u16,
            },
            34 => TaskError::BadWindow {
                reason: arg,
                first: a,
                end: b,
            },
            24 => TaskError::DependencyFailed {
                index: arg,
                task: a,
                cause: b as u16,
            },
            26 => TaskError::RangeMismatch {
                expected_x: (a >> 32) as u32,
                expected_y: a as u32,
                got_x: (b >> 32) as u32,
                got_y: b as u32,
                got_z: arg,
            },
            other => TaskError::Unknown(other),
        }
    }
}

/// Kernel ids with this bit set name kernels of programs the session built itself (tenant
/// programs), numbered in the order they were installed.
pub const SESSION_KERNEL_BIT: u32 = 1 << 31;

/// [`TaskError::NoDevice`]'s message: for a tenant program's kernel, which the tenant knows by
/// name, not by id, also where such kernels run.
fn no_device(kernel: u32) -> String {
    if kernel & SESSION_KERNEL_BIT != 0 {
        format!(
            "no usable device on this node runs this kernel (kernel {} of the programs this session built, id {kernel}): \
             a CUDA C or PTX program's kernels run only on an NVIDIA GPU, and no GPU on this node runs them (the \
             program's build log said so); an OpenCL C or C program's run on the CPU device, which is then \
             drained or failed (`agora status` shows which)",
            kernel & !SESSION_KERNEL_BIT
        )
    } else {
        format!(
            "no usable device on this node runs this kernel (id {kernel}): none implements it, its OpenCL C did not \
             compile on the device that would (a broken kernel package: the daemon logged the compiler's output), or \
             every device that does is drained or failed (`agora status` shows which; `agora undrain DEVICE` brings \
             one back)"
        )
    }
}

/// [`TaskError::DeviceFailed`]'s message: the code's name, and for a kernel whose OpenCL C did
/// not compile (a broken kernel package: tenant programs are compiled when built, library
/// kernels are tested) what follows from it, since the code alone reads like a failed device.
fn device_failed(code: i64) -> String {
    const CL_BUILD_PROGRAM_FAILURE: i64 = -11;
    if code == CL_BUILD_PROGRAM_FAILURE {
        return "the kernel's OpenCL C did not compile for this device (CL_BUILD_PROGRAM_FAILURE): its kernel \
                package is broken, the device is fine. The daemon logged the compiler's output; the device no longer \
                offers this kernel (later launches fail with NoDevice) until the package is fixed and reloaded \
                (`agora kernels reload`)"
            .to_string();
    }
    let name = if code < 0 { known_opencl_error(code) } else { None };
    match (code < 0, name) {
        (true, Some(name)) => {
            format!("the device failed to run the task (OpenCL error {code}, {name}); the daemon logged the details")
        }
        (true, None) => {
            format!("the device failed to run the task (OpenCL error {code}); the daemon logged the details")
        }
        (false, _) => format!("the device failed to run the task (CUDA error {code}); the daemon logged the details"),
    }
}

/// The names of the OpenCL error codes a task can meet (`CL_*`, OpenCL 1.2 and 2.x).
fn known_opencl_error(code: i64) -> Option<&'static str> {
    Some(match code {
        -1 => "CL_DEVICE_NOT_FOUND",
        -2 => "CL_DEVICE_NOT_AVAILABLE",
        -3 => "CL_COMPILER_NOT_AVAILABLE",
        -4 => "CL_MEM_OBJECT_ALLOCATION_FAILURE",
        -5 => "CL_OUT_OF_RESOURCES",
        -6 => "CL_OUT_OF_HOST_MEMORY",
        -7 => "CL_PROFILING_INFO_NOT_AVAILABLE",
        -8 => "CL_MEM_COPY_OVERLAP",
        -9 => "CL_IMAGE_FORMAT_MISMATCH",
        -10 => "CL_IMAGE_FORMAT_NOT_SUPPORTED",
        -11 => "CL_BUILD_PROGRAM_FAILURE",
        -12 => "CL_MAP_FAILURE",
        -13 => "CL_MISALIGNED_SUB_BUFFER_OFFSET",
        -14 => "CL_EXEC_STATUS_ERROR_FOR_EVENTS_IN_WAIT_LIST",
        -15 => "CL_COMPILE_PROGRAM_FAILURE",
        -16 => "CL_LINKER_NOT_AVAILABLE",
        -17 => "CL_LINK_PROGRAM_FAILURE",
        -30 => "CL_INVALID_VALUE",
        -33 => "CL_INVALID_DEVICE",
        -34 => "CL_INVALID_CONTEXT",
        -36 => "CL_INVALID_COMMAND_QUEUE",
        -38 => "CL_INVALID_MEM_OBJECT",
        -44 => "CL_INVALID_PROGRAM",
        -45 => "CL_INVALID_PROGRAM_EXECUTABLE",
        -46 => "CL_INVALID_KERNEL_NAME",
        -47 => "CL_INVALID_KERNEL_DEFINITION",
        -48 => "CL_INVALID_KERNEL",
        -49 => "CL_INVALID_ARG_INDEX",
        -50 => "CL_INVALID_ARG_VALUE",
        -51 => "CL_INVALID_ARG_SIZE",
        -52 => "CL_INVALID_KERNEL_ARGS",
        -53 => "CL_INVALID_WORK_DIMENSION",
        -54 => "CL_INVALID_WORK_GROUP_SIZE",
        -55 => "CL_INVALID_WORK_ITEM_SIZE",
        -56 => "CL_INVALID_GLOBAL_OFFSET",
        -57 => "CL_INVALID_EVENT_WAIT_LIST",
        -58 => "CL_INVALID_EVENT",
        -59 => "CL_INVALID_OPERATION",
        -61 => "CL_INVALID_BUFFER_SIZE",
        -63 => "CL_INVALID_GLOBAL_WORK_SIZE",
        _ => return None,
    })
}

/// [`TaskError::UnknownKernel`]'s message: for an id of the session's own programs, the likely
/// reason (its program was released) and what to do.
fn unknown_kernel(kernel: u32) -> String {
    if kernel & SESSION_KERNEL_BIT != 0 {
        format!(
            "unknown kernel id {kernel} (kernel {} of the programs this session built): its program was released \
             (every handle to it dropped: Python del, C agora_program_destroy) or was never built in this session; \
             keep the program (or one of its kernels) while you launch its kernels, or build it again",
            kernel & !SESSION_KERNEL_BIT
        )
    } else {
        format!("unknown kernel id {kernel}: look kernels up by name with Session::kernel")
    }
}

/// A signal's conventional name, for messages.
fn signal_name(signal: u16) -> &'static str {
    match signal {
        4 => "SIGILL",
        6 => "SIGABRT",
        7 => "SIGBUS",
        8 => "SIGFPE",
        9 => "SIGKILL",
        11 => "SIGSEGV",
        24 => "SIGXCPU",
        25 => "SIGXFSZ",
        31 => "SIGSYS",
        _ => "a signal",
    }
}

/// What an executor's exit status says, for [`TaskError::KernelExited`].
fn exit_meaning(status: i32) -> &'static str {
    match status {
        127 => "a symbol could not be resolved: the code calls a function that nothing it is linked with defines",
        _ => "the kernel, or a library it uses, called exit()",
    }
}

/// An OpenCL error code's name, for messages ("an OpenCL error" for a code not in the table).
pub fn opencl_error_name(code: i32) -> &'static str {
    known_opencl_error(i64::from(code)).unwrap_or("an OpenCL error")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_executors_exit_status_and_a_launchs_opencl_error_are_explained() {
        let exited = TaskError::KernelExited { status: 127 }.to_string();
        assert!(
            exited.contains("exit status 127") && exited.contains("symbol could not be resolved"),
            "{exited}"
        );
        let exited = TaskError::KernelExited { status: 3 }.to_string();
        assert!(
            exited.contains("exit status 3") && exited.contains("exit()"),
            "{exited}"
        );
        let failed = TaskError::KernelOpenCl { code: -54 }.to_string();
        assert!(
            failed.contains("-54") && failed.contains("CL_INVALID_WORK_GROUP_SIZE"),
            "{failed}"
        );
        assert!(!failed.contains("logged"), "{failed}");
    }

    #[test]
    fn every_error_round_trips_through_a_completion() {
        let errors = [
            TaskError::Malformed(Malformed::UnknownOp(9)),
            TaskError::Malformed(Malformed::TooManyArguments(40)),
            TaskError::Malformed(Malformed::BadArgumentTag { index: 3, tag: 77 }),
            TaskError::Malformed(Malformed::BadDimensions(0)),
            TaskError::UnknownQueue(5),
            TaskError::UnknownKernel(12),
            TaskError::ArgumentCount { expected: 3, got: 2 },
            TaskError::ArgumentType {
                index: 1,
                expected: 1,
                got: 6,
            },
            TaskError::InvalidHandle {
                index: 2,
                handle: 0xdead,
            },
            TaskError::ForeignBuffer { index: 1, handle: 3 },
            TaskError::ForeignKernel { kernel: 0x8000_0001 },
            TaskError::BufferTooSmall {
                index: 1,
                needed: 4096,
                len: 1024,
            },
            TaskError::OutOfBounds {
                index: 0,
                end: 99,
                len: 64,
            },
            TaskError::InvalidScalar { index: 3, value: -4 },
            TaskError::InvalidRange { items: 0, max: 5 },
            TaskError::Aliased { index: 1, other: 2 },
            TaskError::NoDevice(4),
            TaskError::KernelFault,
            TaskError::Cancelled,
            TaskError::DeviceOutOfMemory {
                index: 2,
                needed: 1 << 30,
            },
            TaskError::DeviceFailed(-5),
            TaskError::DeviceQuota {
                needed: 1 << 21,
                quota: 1 << 20,
                device_mib: 81_079,
            },
            TaskError::DeviceLost,
            TaskError::DataLost { index: 3 },
            TaskError::DeviceLimit {
                limit: LaunchLimit::Items,
                value: 1 << 40,
                max: 1 << 36,
            },
            TaskError::DeviceLimit {
                limit: LaunchLimit::Extent(2),
                value: 1 << 33,
                max: u32::MAX as u64,
            },
            TaskError::DeviceLimit {
                limit: LaunchLimit::ItemsPerEnqueue,
                value: 1 << 35,
                max: 1 << 32,
            },
            TaskError::DeviceLimit {
                limit: LaunchLimit::GroupsPerEnqueue,
                value: 1 << 33,
                max: 1 << 31,
            },
            TaskError::DeviceLimit {
                limit: LaunchLimit::Enqueues,
                value: 5000,
                max: 4096,
            },
            TaskError::DeviceLimit {
                limit: LaunchLimit::WorkGroupSize,
                value: 64,
                max: 32,
            },
            TaskError::DeviceLimit {
                limit: LaunchLimit::BufferBytes(15),
                value: 3 << 30,
                max: 2 << 30,
            },
            TaskError::DependencyFailed {
                index: 1,
                task: 77,
                cause: 16,
            },
            TaskError::Internal(3),
            TaskError::DeviceTooSmall {
                needed: 1 << 30,
                capacity: 1 << 29,
            },
            TaskError::KernelCrashed { signal: 11 },
            TaskError::KernelTimeout { limit_ms: 2000 },
            TaskError::KernelReturned { code: 42 },
            TaskError::KernelReturned { code: -7 },
            TaskError::KernelExited { status: 127 },
            TaskError::KernelExited { status: -1 },
            TaskError::KernelOpenCl { code: -54 },
            TaskError::ResourceExhausted {
                resource: Resource::FileDescriptors.code(),
                retry_ms: 400,
            },
            TaskError::CheckpointRefused {
                reason: CHECKPOINT_ID_NOT_NEWER,
                level: 2,
                checkpoint: 41,
                detail: newest_detail(1_795_966_155_633, NEWEST_FROM_SNAPSHOT),
            },
            TaskError::CheckpointRefused {
                reason: CHECKPOINT_NAME_IN_USE,
                level: 1,
                checkpoint: 6,
                detail: 4_000_000,
            },
            TaskError::Attachment {
                index: 2,
                handle: 0x1_0000_0005,
                reason: ATTACHMENT_REVOKED,
            },
            TaskError::BadWindow {
                reason: WINDOW_MISALIGNED,
                first: 1000,
                end: 2048,
            },
            TaskError::RangeMismatch {
                expected_x: 100_000,
                expected_y: u32::MAX,
                got_x: 4,
                got_y: 7,
                got_z: 3,
            },
        ];
        for e in errors {
            let c = Completion::failed(42, e);
            assert_eq!(c.task_id, 42);
            assert_eq!(c.result(), Err(e));
            assert!(!e.to_string().is_empty());
        }
        assert_eq!(Completion::ok(1).result(), Ok(()));
        assert_eq!(
            Completion {
                code: 999,
                ..Default::default()
            }
            .result(),
            Err(TaskError::Unknown(999))
        );
    }

    #[test]
    fn a_tenant_kernel_s_return_code_reaches_the_tenant() {
        let e = TaskError::KernelReturned { code: 42 };
        assert!(e.to_string().contains("returned 42"), "{e}");
        assert_eq!(Completion::failed(1, e).result(), Err(e));
    }

    #[test]
    fn a_tenant_program_kernel_without_a_device_is_explained() {
        let e = TaskError::NoDevice(SESSION_KERNEL_BIT | 2).to_string();
        assert!(
            e.contains("kernel 2 of the programs this session built") && e.contains("NVIDIA GPU"),
            "{e}"
        );
        let e = TaskError::NoDevice(7).to_string();
        assert!(
            e.contains("(id 7)") && e.contains("did not compile") && !e.contains("NVIDIA"),
            "{e}"
        );
    }

    /// A device error names its code (audit K-D7: a package whose OpenCL C did not compile read
    /// "the device failed to run the task (OpenCL error -11)", on a device that was fine).
    #[test]
    fn a_device_error_names_its_code_and_a_failed_compile_says_so() {
        let e = TaskError::DeviceFailed(-11).to_string();
        assert!(
            e.contains("did not compile") && e.contains("CL_BUILD_PROGRAM_FAILURE") && e.contains("the device is fine"),
            "{e}"
        );
        let e = TaskError::DeviceFailed(-54).to_string();
        assert!(e.contains("OpenCL error -54, CL_INVALID_WORK_GROUP_SIZE"), "{e}");
        let e = TaskError::DeviceFailed(-9999).to_string();
        assert!(e.contains("OpenCL error -9999)"), "{e}");
        let e = TaskError::DeviceFailed(700).to_string();
        assert!(e.contains("CUDA error 700"), "{e}");
    }

    #[test]
    fn messages_name_the_problem() {
        let e = TaskError::ArgumentType {
            index: 1,
            expected: ArgTag::Buffer as u32,
            got: ArgTag::F32 as u32,
        };
        assert_eq!(e.to_string(), "argument 1 has the wrong type: expected buffer, got f32");
        let e = TaskError::BufferTooSmall {
            index: 2,
            needed: 400,
            len: 40,
        };
        assert!(e.to_string().contains("needs 400 bytes, has 40"));
        let e = TaskError::DependencyFailed {
            index: 0,
            task: 12,
            cause: TaskError::KernelFault.code(),
        };
        assert!(e.to_string().contains("task 12, which failed (kernel_fault)"), "{e}");
        assert_eq!(e.origin(99), (12, 16));
        assert_eq!(TaskError::Cancelled.origin(5), (5, 17));
        let e = TaskError::DeviceLimit {
            limit: LaunchLimit::Extent(1),
            value: 1 << 33,
            max: 1 << 32,
        };
        assert!(
            e.to_string()
                .contains("work items in dimension 1 of the range is 8589934592, at most 4294967296"),
            "{e}"
        );
    }

    #[test]
    fn a_range_mismatch_states_the_range_the_kernel_requires() {
        let e = TaskError::RangeMismatch {
            expected_x: 100_000,
            expected_y: 100_000,
            got_x: 4,
            got_y: 4,
            got_z: 1,
        };
        let message = e.to_string();
        assert!(
            message.starts_with("invalid range (4, 4): the range must be exactly (100000, 100000)"),
            "{message}"
        );
        assert!(!message.contains("at most"), "{message}");
        assert_eq!(e.kind(), "range_mismatch");
        assert_eq!(e.code(), 26);
        // One-dimensional rules and three-dimensional launches.
        let e = TaskError::RangeMismatch {
            expected_x: 1000,
            expected_y: 1,
            got_x: 10,
            got_y: 1,
            got_z: 2,
        };
        assert!(
            e.to_string()
                .starts_with("invalid range (10, 1, 2): the range must be exactly (1000),"),
            "{e}"
        );
    }

    #[test]
    fn an_unknown_launch_limit_is_an_unknown_error() {
        let c = Completion {
            code: 23,
            arg: 9,
            ..Default::default()
        };
        assert_eq!(c.result(), Err(TaskError::Unknown(23)));
    }
}
