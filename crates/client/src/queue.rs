//! Queues and tasks.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use agora_protocol::control::QueueClass;
pub use agora_protocol::DeviceKind;
use agora_protocol::{Op, ParamKind, RawArg, TaskDescriptor, MAX_ARGS};

use crate::buffer::Buffer;
use crate::session::{Inner, Kernel};
use crate::Error;

/// How [`Queue::launch_checkpointed`] cuts a launch and checkpoints it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CheckpointedLaunch {
    /// Rows of the first dimension per window (a checkpoint follows each; on OpenCL or CUDA a
    /// multiple of 1024 is safe).
    pub window_rows: u64,
    /// The id of the checkpoint after the first window; the `k`-th window's is this plus `k`.
    /// Larger than the application's previous checkpoints, and not 0 (ids start at 1).
    pub first_checkpoint: u64,
    /// The checkpoints' level.
    pub level: CheckpointLevel,
    /// Resume: the checkpoint [`Session::recover`](crate::Session::recover) restored (only later windows run).
    pub resume_after: Option<u64>,
}

/// The refusal of checkpoint id 0, made before anything is issued (ids start at 1: status calls
/// report 0 for "no checkpoint").
fn checkpoint_id_zero(level: CheckpointLevel) -> Error {
    Error::Task(crate::TaskError::CheckpointRefused {
        reason: agora_protocol::completion::CHECKPOINT_ID_ZERO,
        level: level as u8,
        checkpoint: 0,
        detail: 0,
    })
}

/// How durable a checkpoint is (FTI's levels, on one node and what it reaches).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u32)]
pub enum CheckpointLevel {
    /// Level 1: the node's local checkpoint directory. Survives the process and the daemon.
    Local = 1,
    /// Level 2: also a copy in the daemon's partner directory (another disk or node).
    Partner = 2,
    /// Level 3: Reed–Solomon coded across several files; survives losing some of them.
    Erasure = 3,
    /// Level 4: also a copy on the daemon's shared (parallel) file system.
    Shared = 4,
}

impl CheckpointLevel {
    /// The level numbered `level` (FTI's 1–4), for the C and Python APIs.
    pub fn from_number(level: u32) -> Option<CheckpointLevel> {
        Some(match level {
            1 => CheckpointLevel::Local,
            2 => CheckpointLevel::Partner,
            3 => CheckpointLevel::Erasure,
            4 => CheckpointLevel::Shared,
            _ => return None,
        })
    }
}

/// How to create a queue.
#[derive(Debug, Clone, Default)]
pub struct QueueOptions {
    /// Name shown by `agora status`.
    pub name: String,
    /// Scheduling class.
    pub class: QueueClass,
    /// Preferred kind of device, if any.
    pub preferred_device: Option<DeviceKind>,
    /// Response-time target of each task of a latency-class queue (the daemon's
    /// `scheduler.latency_sla_ms` when `None`). The daemon revokes batch work for a task only when
    /// it would miss this target otherwise. Ignored for batch queues.
    pub sla: Option<std::time::Duration>,
}

/// One kernel argument.
#[derive(Debug, Clone, Copy)]
pub enum Arg<'a> {
    /// A buffer.
    Buffer(&'a Buffer),
    /// `f32`.
    F32(f32),
    /// `f64`.
    F64(f64),
    /// `i32`.
    I32(i32),
    /// `u32`.
    U32(u32),
    /// `i64`.
    I64(i64),
    /// `u64`.
    U64(u64),
}

impl<'a> From<&'a Buffer> for Arg<'a> {
    fn from(b: &'a Buffer) -> Self {
        Arg::Buffer(b)
    }
}
impl From<f32> for Arg<'_> {
    fn from(v: f32) -> Self {
        Arg::F32(v)
    }
}
impl From<f64> for Arg<'_> {
    fn from(v: f64) -> Self {
        Arg::F64(v)
    }
}
impl From<i32> for Arg<'_> {
    fn from(v: i32) -> Self {
        Arg::I32(v)
    }
}
impl From<u32> for Arg<'_> {
    fn from(v: u32) -> Self {
        Arg::U32(v)
    }
}
impl From<i64> for Arg<'_> {
    fn from(v: i64) -> Self {
        Arg::I64(v)
    }
}
impl From<u64> for Arg<'_> {
    fn from(v: u64) -> Self {
        Arg::U64(v)
    }
}

impl Arg<'_> {
    fn raw(&self) -> RawArg {
        match *self {
            Arg::Buffer(b) => RawArg::buffer(b.handle()),
            Arg::F32(v) => RawArg::f32(v),
            Arg::F64(v) => RawArg::f64(v),
            Arg::I32(v) => RawArg::i32(v),
            Arg::U32(v) => RawArg::u32(v),
            Arg::I64(v) => RawArg::i64(v),
            Arg::U64(v) => RawArg::u64(v),
        }
    }
}

/// The index space of a launch: 1 to 3 dimensions.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct NdRange {
    dims: [u64; 3],
    count: u32,
}

impl NdRange {
    /// A 1-D range.
    pub fn d1(x: u64) -> Self {
        NdRange {
            dims: [x, 1, 1],
            count: 1,
        }
    }
    /// A 2-D range.
    pub fn d2(x: u64, y: u64) -> Self {
        NdRange {
            dims: [x, y, 1],
            count: 2,
        }
    }
    /// A 3-D range.
    pub fn d3(x: u64, y: u64, z: u64) -> Self {
        NdRange {
            dims: [x, y, z],
            count: 3,
        }
    }
}

impl From<u64> for NdRange {
    fn from(x: u64) -> Self {
        NdRange::d1(x)
    }
}
impl From<usize> for NdRange {
    fn from(x: usize) -> Self {
        NdRange::d1(x as u64)
    }
}
impl From<u32> for NdRange {
    fn from(x: u32) -> Self {
        NdRange::d1(u64::from(x))
    }
}
/// Plain integer literals default to `i32`; a negative extent becomes 0, which the daemon refuses
/// as an invalid range.
impl From<i32> for NdRange {
    fn from(x: i32) -> Self {
        NdRange::d1(x.max(0) as u64)
    }
}
impl From<(u64, u64)> for NdRange {
    fn from((x, y): (u64, u64)) -> Self {
        NdRange::d2(x, y)
    }
}
impl From<(u64, u64, u64)> for NdRange {
    fn from((x, y, z): (u64, u64, u64)) -> Self {
        NdRange::d3(x, y, z)
    }
}

/// An issued task. Dropping it does not cancel it; its failure, if any, is reported by the
/// queue's next [`Queue::finish`] in any case.
pub struct Task {
    session: Arc<Inner>,
    id: u64,
}

impl std::fmt::Debug for Task {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Task").field("id", &self.id).finish()
    }
}

impl Task {
    pub(crate) fn new(session: Arc<Inner>, id: u64) -> Self {
        Task { session, id }
    }

    /// Task id within the session.
    pub fn id(&self) -> u64 {
        self.id
    }

    /// Blocks until the task completes; returns its error if it failed. Asked again, it returns
    /// the same outcome.
    pub fn wait(&self) -> Result<(), Error> {
        self.session.wait(self.id)
    }

    /// Waits at most about `timeout` (plus up to 20 ms) for the task: `Ok(true)` once it
    /// completed successfully, its error if it failed (as [`Task::wait`]), `Ok(false)` if it is
    /// still running. For callers that must react to something else while they wait (a
    /// language binding checking for Ctrl-C between slices).
    pub fn wait_timeout(&self, timeout: Duration) -> Result<bool, Error> {
        if !self.session.wait_done_until(self.id, Instant::now() + timeout)? {
            return Ok(false);
        }
        self.wait().map(|()| true)
    }

    /// Whether the task has completed (successfully or not), without blocking.
    pub fn is_complete(&self) -> Result<bool, Error> {
        self.session.poll(self.id)
    }

    /// For a binding that waits for many tasks of a session on one thread (Python's `await
    /// task`): how many completions this process has taken from the session's ring so far.
    #[doc(hidden)]
    pub fn completions_seen(&self) -> u64 {
        self.session.completions_seen()
    }

    /// Waits at most about `timeout` (plus up to 20 ms) until the session's completions taken
    /// pass `seen` (from [`Task::completions_seen`]): `Ok(true)` when some task of the session
    /// completed meanwhile, whichever, `Ok(false)` if none did.
    #[doc(hidden)]
    pub fn wait_for_completions(&self, seen: u64, timeout: Duration) -> Result<bool, Error> {
        self.session.wait_for_completions_until(seen, Instant::now() + timeout)
    }

    /// Whether the task is known complete from what already arrived, without blocking or
    /// reconnecting (for [`crate::Completion`]'s `poll`).
    pub(crate) fn completed_now(&self) -> bool {
        self.session.done_now(self.id)
    }

    pub(crate) fn session(&self) -> &Arc<Inner> {
        &self.session
    }

    /// The same number for every task of one session while any of them (or the session) lives:
    /// a key for per-session state in a binding.
    #[doc(hidden)]
    pub fn session_key(&self) -> usize {
        Arc::as_ptr(&self.session) as usize
    }
}

impl Drop for Task {
    fn drop(&mut self) {
        self.session.forget(self.id);
    }
}

/// An ordered stream of tasks, bound to no device. Tasks of one queue run and complete in issue
/// order; different queues are independent and may run at the same time.
pub struct Queue {
    session: Arc<Inner>,
    handle: u64,
    last: AtomicU64,
}

impl std::fmt::Debug for Queue {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Queue")
            .field("handle", &format_args!("{:#x}", self.handle))
            .finish()
    }
}

impl Queue {
    pub(crate) fn new(session: Arc<Inner>, handle: u64) -> Self {
        Queue {
            session,
            handle,
            last: AtomicU64::new(0),
        }
    }

    fn issue(&self, descriptor: TaskDescriptor) -> Result<Task, Error> {
        let id = self.session.submit(self.handle, descriptor, true)?;
        self.last.fetch_max(id, Ordering::AcqRel);
        Ok(Task::new(self.session.clone(), id))
    }

    /// Launches `kernel` over `range` with `args` (checked by the daemon against the kernel's
    /// signature; a mismatch fails the task with an error naming the argument).
    pub fn launch(&self, kernel: &Kernel, args: &[Arg<'_>], range: impl Into<NdRange>) -> Result<Task, Error> {
        self.launch_window(kernel, args, range.into(), None)
    }

    /// Launches `kernel` over `range` but runs only rows `rows` of its first dimension (a row
    /// window): the kernel sees the whole range (sizes, indices), and the other rows are left
    /// as they are. Only for chunkable kernels, whose rows are independent; a window whose
    /// bounds no device can run (OpenCL and CUDA run whole work-groups: use multiples of 1024
    /// rows) fails with `BadWindow`. [`Queue::launch_checkpointed`] builds on it.
    pub fn launch_rows(
        &self,
        kernel: &Kernel,
        args: &[Arg<'_>],
        range: impl Into<NdRange>,
        rows: std::ops::Range<u64>,
    ) -> Result<Task, Error> {
        self.launch_window(kernel, args, range.into(), Some(rows))
    }

    /// A long chunkable launch with a checkpoint after every `plan.window_rows` rows (FTI's
    /// partial-task checkpoints, LEGaTO's approach B): the launch is issued as row windows, each
    /// followed by a checkpoint task (id `plan.first_checkpoint + k` after window `k`) of the
    /// session's protected buffers, which should include the launch's outputs. After a crash,
    /// the application protects the same buffers, calls [`Session::recover`](crate::Session::recover), and launches again
    /// with `plan.resume_after` set to the checkpoint it recovered: only the windows after it
    /// run. Returns the last task issued (the last checkpoint; `None` when resumed after the last
    /// window: nothing was left to run).
    pub fn launch_checkpointed(
        &self,
        kernel: &Kernel,
        args: &[Arg<'_>],
        range: impl Into<NdRange>,
        plan: &CheckpointedLaunch,
    ) -> Result<Option<Task>, Error> {
        // Refused before the first window runs, as its checkpoint would be.
        if plan.first_checkpoint == 0 {
            return Err(checkpoint_id_zero(plan.level));
        }
        let range = range.into();
        let rows = range.dims[0];
        let window = plan.window_rows.max(1);
        let windows = rows.div_ceil(window);
        let start = match plan.resume_after {
            None => 0,
            Some(id) if id >= plan.first_checkpoint && id - plan.first_checkpoint < windows => {
                id - plan.first_checkpoint + 1
            }
            Some(id) => {
                return Err(Error::Protocol(format!(
                    "resume_after {id} is not a checkpoint of this launch (its checkpoints are {} to {})",
                    plan.first_checkpoint,
                    plan.first_checkpoint + windows - 1
                )))
            }
        };
        let mut last = None;
        for k in start..windows {
            let rows = k * window..((k + 1) * window).min(rows);
            self.launch_window(kernel, args, range, Some(rows))?;
            last = Some(self.checkpoint(plan.first_checkpoint + k, plan.level)?);
        }
        Ok(last)
    }

    fn launch_window(
        &self,
        kernel: &Kernel,
        args: &[Arg<'_>],
        range: NdRange,
        window: Option<std::ops::Range<u64>>,
    ) -> Result<Task, Error> {
        let d = launch_descriptor(&self.session, kernel, args, range, window)?;
        let task = self.issue(d)?;
        // What it writes has its newest contents on a device until a sync_from.
        for (arg, param) in args.iter().zip(&kernel.signature().params) {
            if let (Arg::Buffer(b), ParamKind::Buffer { access, .. }) = (arg, param.kind) {
                if access.writes() {
                    b.whereabouts().written_by(task.id());
                }
            }
        }
        Ok(task)
    }

    fn transfer(&self, op: Op, buffer: &Buffer, offset: u64, len: u64) -> Result<Task, Error> {
        buffer.check_session(&self.session, 0)?;
        let mut d = TaskDescriptor::zeroed();
        d.op = op as u32;
        d.arg_count = 3;
        d.args[0] = RawArg::buffer(buffer.handle());
        d.args[1] = RawArg::u64(offset);
        d.args[2] = RawArg::u64(len);
        let task = self.issue(d)?;
        // sync_from brings the newest contents home; after sync_to they are the host's.
        if op == Op::SyncFrom {
            buffer.whereabouts().brought_home_by(task.id());
        } else {
            buffer.whereabouts().host_written();
        }
        Ok(task)
    }

    /// Checkpoints the session's protected buffers (FTI's `FTI_Checkpoint`) as a task of this
    /// queue: it runs after the queue's earlier tasks, captures the buffers' current contents
    /// (from whichever device holds them) and completes; the daemon writes them in the
    /// background at `level`, with integrity hashes, writing only blocks that changed since the
    /// application's last checkpoint. `id` must be larger than the application's previous
    /// checkpoint's (the iteration number, say). [`Session::checkpoints`](crate::Session::checkpoints) reports the writes.
    ///
    /// Ids start at 1: id 0 is refused here, before anything is issued
    /// ([`TaskError::CheckpointRefused`](crate::TaskError::CheckpointRefused) with reason
    /// [`CHECKPOINT_ID_ZERO`](agora_protocol::completion::CHECKPOINT_ID_ZERO)), because status
    /// calls report 0 for "no checkpoint" (C's `agora_checkpoint_status`).
    pub fn checkpoint(&self, id: u64, level: CheckpointLevel) -> Result<Task, Error> {
        self.issue_checkpoint(id, level, false)
    }

    /// A checkpoint task; a `snapshot` one is numbered by the daemon (`id` is then ignored).
    fn issue_checkpoint(&self, id: u64, level: CheckpointLevel, snapshot: bool) -> Result<Task, Error> {
        if id == 0 {
            return Err(checkpoint_id_zero(level));
        }
        let unusable = self
            .session
            .checkpoint_unusable
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        if let Some((_, why)) = unusable.iter().find(|(l, _)| *l == level as u8) {
            return Err(Error::Control(agora_protocol::control::ControlError::Checkpoint(
                format!("checkpoint {id} refused at level {}: {why}", level as u8),
            )));
        }
        drop(unusable);
        let mut d = TaskDescriptor::zeroed();
        d.op = Op::Checkpoint as u32;
        d.arg_count = 2;
        d.args[0] = RawArg::u64(id);
        d.args[1] = RawArg::u32(level as u32);
        if snapshot {
            d.arg_count = 3;
            d.args[2] = RawArg::u32(1);
        }
        self.issue(d)
    }

    /// FTI's `FTI_Snapshot`: call it every iteration; once the daemon's checkpoint interval
    /// (`[checkpoint] interval_s`, 60 s by default) has passed since the last snapshot (or the
    /// first `protect`), it issues a level-1 [`Queue::checkpoint`] and returns its task, else
    /// `None`. The daemon numbers it: the id after the application's newest checkpoint (its
    /// own or an explicit [`Queue::checkpoint`]'s), so snapshots and explicit ids interleave; an
    /// explicit id is refused only when it is not above the newest, snapshots included. A
    /// snapshot's id is therefore not an iteration number: keep the iteration in a protected
    /// buffer if you resume from snapshots.
    pub fn snapshot(&self) -> Result<Option<Task>, Error> {
        {
            let mut clock = self.session.snapshots.lock().unwrap_or_else(|e| e.into_inner());
            match clock.as_mut() {
                Some(clock) if clock.since.elapsed() >= clock.interval => {
                    clock.since = std::time::Instant::now();
                }
                _ => return Ok(None),
            }
        }
        // The id is a placeholder (not 0, which is refused): the daemon picks the real one.
        self.issue_checkpoint(1, CheckpointLevel::Local, true).map(Some)
    }

    /// Makes the devices see the buffer's host copy (after the host wrote it).
    pub fn sync_to(&self, buffer: &Buffer) -> Result<Task, Error> {
        self.transfer(Op::SyncTo, buffer, 0, 0)
    }

    /// Makes the host copy current (read it after this task completes).
    pub fn sync_from(&self, buffer: &Buffer) -> Result<Task, Error> {
        self.transfer(Op::SyncFrom, buffer, 0, 0)
    }

    /// Sets every byte of `buffer` to `value`.
    pub fn memset(&self, buffer: &Buffer, value: u8) -> Result<Task, Error> {
        buffer.check_session(&self.session, 0)?;
        let mut d = TaskDescriptor::zeroed();
        d.op = Op::Memset as u32;
        d.arg_count = 2;
        d.args[0] = RawArg::buffer(buffer.handle());
        d.args[1] = RawArg::u32(u32::from(value));
        let task = self.issue(d)?;
        // Memsets run on the host copy.
        buffer.whereabouts().brought_home_by(task.id());
        Ok(task)
    }

    /// Copies `len` bytes (0 = all of `src` from `src_offset`) between buffers.
    pub fn copy(&self, src: &Buffer, src_offset: u64, dst: &Buffer, dst_offset: u64, len: u64) -> Result<Task, Error> {
        src.check_session(&self.session, 0)?;
        dst.check_session(&self.session, 1)?;
        let mut d = TaskDescriptor::zeroed();
        d.op = Op::Copy as u32;
        d.arg_count = 5;
        d.args[0] = RawArg::buffer(src.handle());
        d.args[1] = RawArg::buffer(dst.handle());
        d.args[2] = RawArg::u64(src_offset);
        d.args[3] = RawArg::u64(dst_offset);
        d.args[4] = RawArg::u64(len);
        let task = self.issue(d)?;
        // Copies run on the host copies, bringing both buffers' newest contents there.
        src.whereabouts().brought_home_by(task.id());
        dst.whereabouts().brought_home_by(task.id());
        Ok(task)
    }

    /// Waits for every task issued so far on this queue. Fails with [`Error::Tasks`] when any
    /// task issued since the previous `finish` failed (whether or not its `Task::wait` reported
    /// it already): how many, and each one's id and error.
    pub fn finish(&self) -> Result<(), Error> {
        let last = self.last.load(Ordering::Acquire);
        if last > 0 {
            self.session.wait_done(last)?;
        }
        match self.session.take_queue_failures(self.handle) {
            Some(failures) => Err(Error::Tasks(failures)),
            None => Ok(()),
        }
    }

    /// Like [`Queue::finish`], waiting at most about `timeout` (plus up to 20 ms): `Ok(false)` if
    /// tasks are still running then (their failures stay for a later `finish`), else what
    /// `finish` returns, with `Ok(true)` for success.
    pub fn finish_timeout(&self, timeout: Duration) -> Result<bool, Error> {
        let last = self.last.load(Ordering::Acquire);
        if last > 0 && !self.session.wait_done_until(last, Instant::now() + timeout)? {
            return Ok(false);
        }
        self.finish().map(|()| true)
    }

    /// Raw handle (for diagnostics).
    pub fn handle(&self) -> u64 {
        self.handle
    }
}

impl Drop for Queue {
    fn drop(&mut self) {
        if self.session.in_forked_child() {
            // The parent's queue: this copy just goes.
            return;
        }
        let mut d = TaskDescriptor::zeroed();
        d.op = Op::ReleaseQueue as u32;
        let release = self.session.submit_release(self.handle, d);
        let session = &self.session;
        session
            .resume
            .queue_released(self.handle, release, |id| session.is_done(id));
    }
}

/// The descriptor of a launch (task id and queue left zero), checked as far as the client can.
pub(crate) fn launch_descriptor(
    session: &Inner,
    kernel: &Kernel,
    args: &[Arg<'_>],
    range: NdRange,
    window: Option<std::ops::Range<u64>>,
) -> Result<TaskDescriptor, Error> {
    let mut d = TaskDescriptor::zeroed();
    if let Some(rows) = window {
        let refuse = || {
            Error::Task(agora_protocol::TaskError::BadWindow {
                reason: agora_protocol::completion::WINDOW_OUTSIDE,
                first: rows.start,
                end: rows.end,
            })
        };
        if rows.start >= rows.end || rows.end > range.dims[0] {
            return Err(refuse());
        }
        d.window_first = u32::try_from(rows.start).map_err(|_| refuse())?;
        d.window_rows = u32::try_from(rows.end - rows.start).map_err(|_| refuse())?;
    }
    d.op = Op::Launch as u32;
    kernel.check_session(session)?;
    d.kernel = session.resume.kernel_ids.real(kernel.id);
    if args.len() > MAX_ARGS {
        return Err(Error::Task(agora_protocol::TaskError::ArgumentCount {
            expected: kernel.signature().params.len() as u32,
            got: args.len() as u32,
        }));
    }
    d.arg_count = args.len() as u32;
    for (index, (slot, arg)) in d.args.iter_mut().zip(args).enumerate() {
        if let Arg::Buffer(b) = arg {
            b.check_session(session, index)?;
        }
        *slot = arg.raw();
    }
    d.dims = range.count;
    d.range = range.dims;
    Ok(d)
}
