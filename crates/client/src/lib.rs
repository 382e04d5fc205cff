//! Rust client for Agora, the node-level runtime that lets many processes share every
//! accelerator of a server.
//!
//! An application opens a [`Session`] with the local daemon, creates [`Queue`]s (ordered streams
//! of tasks, bound to no device), [`Buffer`]s (whose host copy lives in memory shared with the
//! daemon, so writing one needs no extra copy), looks [`Kernel`]s up by name and issues
//! [`Task`]s. The daemon picks the device for each task as late as possible.
//!
//! ```no_run
//! use agora::{Arg, Session};
//!
//! # fn main() -> Result<(), agora::Error> {
//! let session = Session::connect()?; // $AGORA_SOCKET, else the default socket path
//! let queue = session.queue("example")?;
//! let saxpy = session.kernel("saxpy")?; // y <- a*x + y
//! let n = 1 << 20;
//! let x = session.buffer_from(&vec![1.0f32; n])?; // host copies live in shared memory
//! let y = session.buffer_from(&vec![2.0f32; n])?;
//! queue.sync_to(&x)?;
//! queue.sync_to(&y)?;
//! queue.launch(&saxpy, &[Arg::F32(3.0), (&x).into(), (&y).into()], n)?;
//! queue.sync_from(&y)?;
//! queue.finish()?; // waits for the queue; reports its first failure
//! assert!(y.as_slice::<f32>().iter().all(|v| *v == 5.0));
//! # Ok(()) }
//! ```
//!
//! # Threads
//! A `Session` is cheap to clone and may be used from many threads at once; so may queues,
//! buffers (for reading) and tasks.
//!
//! # Async
//! A [`Task`] is a future's worth of work: `queue.launch(...)?.await?` in async code (any
//! executor: tokio, smol, a hand-written one) suspends the caller, not the executor's thread,
//! and returns what [`Task::wait`] would. One thread per session waits for all its awaited
//! tasks and wakes their wakers ([`Completion`]); dropping the future leaves the task running.
//! Without an executor, [`Task::on_complete`] has that thread call a closure with the outcome.
//!
//! # Errors
//! A task's failure (bad arguments, unknown kernel, buffer too small…) is reported by
//! [`Task::wait`] or, for tasks nobody waited on, by [`Queue::finish`], as [`Error::Task`] with a
//! [`TaskError`] that names the problem.
//!
//! # When the daemon restarts
//! If the daemon stops, crashes or is restarted, the session notices within about 20 ms and
//! reconnects (for up to [`SessionOptions::reconnect_timeout`], 30 s by default): buffers keep
//! their host copies, queues, kernels and programs carry on, and the tasks that were in flight
//! fail with [`TaskError::DaemonRestarted`] so the application can issue them again (tasks the
//! dead daemon never took — issued while it was gone, behind only completed ones — are issued
//! again by the session itself: [`Session::tasks_reissued`]). A buffer
//! that a launch wrote after its last `sync_from` comes back lost (`DataLost` when read, until
//! written whole). With reconnection off, or no daemon back in time, calls return
//! [`Error::Disconnected`].

mod awaiting;
mod buffer;
mod dag;
mod error;
mod program;
mod queue;
mod resume;
mod session;

pub use agora_protocol::control::{
    CheckpointReport, CheckpointSummary, CheckpointWrite, ExportReaders, ExportStatus, KernelListing, PackageListing,
    QueueClass, QueueStatus, RecoverReport, ReloadReport, SessionStatus, StatusReport,
};
pub use agora_protocol::control::{DagAdmission, DagRelease, DagResults, JobAccount, JobStart};
pub use agora_protocol::{KernelSignature, LaunchLimit, TaskError};
pub use awaiting::Completion;
pub use buffer::Buffer;
#[doc(hidden)]
pub use buffer::ClaimWait;
pub use dag::{Dag, DagBuilder};
pub use error::{Error, TaskFailures};
pub use program::Program;
pub use queue::{Arg, CheckpointLevel, CheckpointedLaunch, DeviceKind, NdRange, Queue, QueueOptions, Task};
pub use resume::{DEFAULT_RECONNECT_TIMEOUT, RECONNECT_ENV};
#[doc(hidden)]
pub use session::default_session_name;
#[doc(hidden)]
pub use session::with_room_interrupt;
pub use session::{
    daemon_exports, daemon_session_status, daemon_status, drain_device, kernel_catalog, power_save, reload_kernels,
    slurm_job_end, slurm_job_start, DrainOutcome, JobEnded, JobRegistered, Kernel, Session, SessionOptions,
    CONTROL_TIMEOUT_ENV, DEFAULT_CONTROL_TIMEOUT, HEAP_ENV, RANK_VARIABLES,
};

/// The Rust guide's snippets, compiled (and run unless marked `no_run`) as doctests, so the guide
/// shows programs that build on their own.
#[cfg(doctest)]
#[doc = include_str!("../../../docs/getting-started-rust.md")]
pub struct RustGuide;

/// Low-level hooks for testing the daemon against malformed input. Not part of the stable API.
#[doc(hidden)]
pub mod testing {
    pub use crate::session::testing::*;
    pub use agora_protocol::control::{ControlError, Request, Response};
    pub use agora_protocol::{descriptor, ArgTag, Op, RawArg, TaskDescriptor};
}
