//! The Python exception classes (one per error kind, all under `agora.AgoraError`) and the
//! mapping from the Rust client's typed errors to them, message unchanged. Owns nothing else: the
//! classes hold no state, and raising is left to the callers.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use agora::{Error, TaskError};
use agora_protocol::control::ControlError;
use pyo3::create_exception;
use pyo3::exceptions::{PyException, PyValueError};
use pyo3::prelude::*;

create_exception!(agora, AgoraError, PyException, "Base class of every Agora error.");
create_exception!(
    agora,
    ConnectError,
    AgoraError,
    "No daemon answers on the socket: start one with `agora serve` or set AGORA_SOCKET."
);
create_exception!(
    agora,
    DisconnectedError,
    AgoraError,
    "The daemon stopped or was killed; open a new session once it is back."
);
create_exception!(
    agora,
    ClosedError,
    AgoraError,
    "The session, queue or buffer was closed or released by this program."
);
create_exception!(
    agora,
    ForkedChildError,
    AgoraError,
    "A session (or one of its queues, buffers, tasks) used in a process forked after it was opened: a forked child must open its own session (multiprocessing: the 'spawn' or 'forkserver' start method, or a session opened in the worker). The parent's session is not disturbed; the child's copies can be dropped."
);
create_exception!(
    agora,
    BufferInUseError,
    AgoraError,
    "A buffer cannot be released while NumPy arrays or memoryviews of it exist."
);
create_exception!(
    agora,
    TimeoutError,
    AgoraError,
    "The daemon did not answer a call within the session's control_timeout (it is overloaded or stuck)."
);

/// `agora.TimeoutError` as Python code sees it: [`TimeoutError`] and Python's built-in
/// `TimeoutError` both, so `except TimeoutError` catches a daemon that did not answer in time,
/// as it catches `asyncio.wait_for`'s. Made once, at import: `create_exception!` takes one base.
static TIMEOUT_ERROR: pyo3::sync::PyOnceLock<Py<pyo3::types::PyType>> = pyo3::sync::PyOnceLock::new();

/// The class behind `agora.TimeoutError` (see [`TIMEOUT_ERROR`]).
pub(crate) fn timeout_error_type(py: Python<'_>) -> PyResult<&Bound<'_, pyo3::types::PyType>> {
    TIMEOUT_ERROR
        .get_or_try_init(py, || {
            let builtins = py.import("builtins")?;
            let namespace = pyo3::types::PyDict::new(py);
            namespace.set_item("__module__", "agora")?;
            namespace.set_item(
                "__doc__",
                "The daemon did not answer a call within the session's control_timeout (it is overloaded or \
                 stuck). Also a built-in TimeoutError.",
            )?;
            let bases = (py.get_type::<TimeoutError>(), builtins.getattr("TimeoutError")?);
            let made = builtins.getattr("type")?.call1(("TimeoutError", bases, namespace))?;
            Ok::<_, PyErr>(made.cast_into::<pyo3::types::PyType>()?.unbind())
        })
        .map(|made| made.bind(py))
}
create_exception!(
    agora,
    ProtocolError,
    AgoraError,
    "The daemon answered something this client does not understand (version mismatch?)."
);
create_exception!(
    agora,
    OutOfBoundsError,
    AgoraError,
    "A byte range lies outside its buffer."
);
create_exception!(
    agora,
    TaskFailedError,
    AgoraError,
    "Base class of the errors a task completes with."
);
create_exception!(
    agora,
    MalformedTaskError,
    TaskFailedError,
    "The task descriptor was malformed."
);
create_exception!(
    agora,
    UnknownQueueError,
    TaskFailedError,
    "The queue was released or never created."
);
create_exception!(
    agora,
    UnknownKernelError,
    AgoraError,
    "No kernel of that name (or id) exists."
);
create_exception!(
    agora,
    ArgumentCountError,
    TaskFailedError,
    "The launch passed the wrong number of arguments."
);
create_exception!(
    agora,
    ArgumentTypeError,
    TaskFailedError,
    "An argument has the wrong type for the kernel."
);
create_exception!(
    agora,
    InvalidHandleError,
    TaskFailedError,
    "A buffer handle is not valid in this session."
);
create_exception!(
    agora,
    BufferTooSmallError,
    TaskFailedError,
    "A buffer is too small for the launch."
);
create_exception!(
    agora,
    InvalidScalarError,
    TaskFailedError,
    "A scalar argument is outside the kernel's accepted range."
);
create_exception!(
    agora,
    InvalidRangeError,
    TaskFailedError,
    "The launch range is empty, or too large (for the protocol or for every device that could run it)."
);
create_exception!(
    agora,
    AliasedBuffersError,
    TaskFailedError,
    "The same buffer was passed twice and one is written."
);
create_exception!(
    agora,
    NoDeviceError,
    TaskFailedError,
    "No device of this node implements the kernel."
);
create_exception!(
    agora,
    KernelFaultError,
    TaskFailedError,
    "The kernel faulted while running."
);
create_exception!(
    agora,
    KernelTimeoutError,
    TaskFailedError,
    "A tenant kernel ran longer than the daemon's per-launch limit and was stopped."
);
create_exception!(
    agora,
    CheckpointError,
    AgoraError,
    "A protect, recover or checkpoint listing the daemon could not do; the message says why and what to do."
);
create_exception!(
    agora,
    ExportError,
    AgoraError,
    "An export, attach or revoke the daemon refused (unknown name, not permitted, name taken, not an exportable buffer); the message says why and what to do."
);
create_exception!(
    agora,
    DagError,
    AgoraError,
    "A real-time DAG the daemon refused (it does not fit its deadline lanes: the message gives the arithmetic and what would fit; a cycle; a node whose launch is invalid), or a release, result or withdrawal it could not do."
);
create_exception!(
    agora,
    AttachmentError,
    TaskFailedError,
    "The task used an attached buffer in a way the attachment does not allow: it writes a buffer attached read-only, or the export was revoked (or its exporter ended)."
);
create_exception!(
    agora,
    ResourceExhaustedError,
    TaskFailedError,
    "The daemon ran out of file descriptors or memory while preparing the task's kernel; transient: issue the task again later."
);
create_exception!(
    agora,
    DaemonRestartedError,
    TaskFailedError,
    "The daemon restarted before the task completed; the session reconnected to the new daemon (buffers, queues, kernels and programs kept): issue the task again."
);
create_exception!(
    agora,
    ProgramBuildError,
    AgoraError,
    "A program did not build; the message carries the compiler's log."
);
create_exception!(
    agora,
    CancelledError,
    TaskFailedError,
    "The task was cancelled before it ran."
);
create_exception!(
    agora,
    DeviceOutOfMemoryError,
    TaskFailedError,
    "The device had no room for the task's buffers."
);
create_exception!(
    agora,
    DeviceFailedError,
    TaskFailedError,
    "The device failed to run the task."
);
create_exception!(
    agora,
    DependencyFailedError,
    TaskFailedError,
    "A buffer the task reads should have been written by a task that failed; the task did not run."
);
create_exception!(
    agora,
    QuotaExceededError,
    AgoraError,
    "The session's buffer quota is used up."
);
create_exception!(
    agora,
    VersionMismatchError,
    AgoraError,
    "Client and daemon are different Agora versions."
);
create_exception!(
    agora,
    TooManyError,
    AgoraError,
    "A per-session limit (queues, buffers) was reached."
);
create_exception!(
    agora,
    LimitReachedError,
    AgoraError,
    "A limit of the daemon refused the request (per uid: connections, sessions, heap bytes, queues, buffers, waiting control requests; per connection: the control request rate). The message names the limit, the use and the setting that raises it."
);
create_exception!(
    agora,
    EnvironmentSettingError,
    AgoraError,
    "A setting in the environment (AGORA_HEAP_BYTES, AGORA_CONTROL_TIMEOUT, AGORA_RECONNECT_TIMEOUT) has a value the client cannot use; the message names it and what it accepts. Nothing was asked of the daemon."
);
create_exception!(
    agora,
    BadRequestError,
    AgoraError,
    "The daemon refused a malformed request."
);
create_exception!(
    agora,
    NotPermittedError,
    AgoraError,
    "The daemon's settings do not allow this (e.g. latency queues for this user)."
);
/// The Python exception for a client error: one class per kind, the Rust message unchanged
/// (it already says what to do). `Queue.finish()`'s error has the class of its earliest failure
/// and carries them all: `count` (how many failed) and `failures` (a list of `(task_id,
/// exception)`, the earliest up to 1024).
fn to_python(error: Error) -> PyErr {
    let message = error.to_string();
    match &error {
        Error::Tasks(failures) => {
            let first = failures.first().map_or(TaskError::Unknown(0), |(_, e)| *e);
            let error = task_exception(&first, message);
            Python::attach(|py| {
                let list: Vec<(u64, Py<PyAny>)> = failures
                    .failures
                    .iter()
                    .map(|(id, e)| (*id, task_exception(e, e.to_string()).into_value(py).into_any()))
                    .collect();
                let value = error.value(py);
                // Setting attributes on a fresh exception instance cannot fail short of memory
                // exhaustion; the exception is still raised without them then.
                let _ = value.setattr("count", failures.count);
                let _ = value.setattr("failures", list);
            });
            error
        }
        Error::Task(task) => task_exception(task, message),
        other => client_exception(other, message),
    }
}

/// How the Rust client's [`Error::Timeout`] names the limit it ran into.
const RUST_CONTROL_TIMEOUT: &str = "SessionOptions::control_timeout";

/// The Python exception for an error that is not a task's.
fn client_exception(error: &Error, message: String) -> PyErr {
    match error {
        Error::Connect { .. } => ConnectError::new_err(message),
        Error::Disconnected | Error::SessionEnded => DisconnectedError::new_err(message),
        // Another thread's call, under way when this program closed the session.
        Error::Ended => ClosedError::new_err(
            "this session was closed (session.close(), or the end of its `with` block) while the call waited; open a new session to go on",
        ),
        Error::OutOfBounds { .. } => OutOfBoundsError::new_err(message),
        Error::ReadOnly => pyo3::exceptions::PyPermissionError::new_err(message),
        Error::Protocol(_) => ProtocolError::new_err(message),
        // The limit by the name Python sets it with, not the Rust client's.
        Error::Timeout { .. } => {
            let message = message.replace(
                RUST_CONTROL_TIMEOUT,
                "the control_timeout of agora.Session(control_timeout=...)",
            );
            Python::attach(|py| match timeout_error_type(py) {
                Ok(class) => PyErr::from_type(class.clone(), message),
                Err(_) => TimeoutError::new_err(message),
            })
        }
        Error::Control(control) => match control {
            ControlError::VersionMismatch { .. } => VersionMismatchError::new_err(message),
            ControlError::QuotaExceeded { .. } => QuotaExceededError::new_err(message),
            ControlError::EmptyBuffer => PyValueError::new_err(message),
            ControlError::UnknownKernel { .. } | ControlError::ProgramKernelByName { .. } => {
                UnknownKernelError::new_err(message)
            }
            ControlError::TooMany { .. } => TooManyError::new_err(message),
            ControlError::LimitReached { .. } => LimitReachedError::new_err(message),
            ControlError::BadRequest(_) => BadRequestError::new_err(message),
            ControlError::NotPermitted(_) => NotPermittedError::new_err(message),
            ControlError::ProgramBuild { .. } => ProgramBuildError::new_err(message),
            // A refused request, like any other the daemon cannot serve.
            ControlError::NameTooLong { .. } | ControlError::UnknownSession(_) => BadRequestError::new_err(message),
            // Only a resume gets it, and the client retries it itself.
            ControlError::SegmentInUse { .. } => BadRequestError::new_err(message),
            ControlError::Checkpoint(_) => CheckpointError::new_err(message),
            ControlError::Export(_) => ExportError::new_err(message),
            ControlError::Dag(_) => DagError::new_err(message),
        },
        Error::ForkedChild { .. } => ForkedChildError::new_err(message),
        Error::MapSegment { .. } => pyo3::exceptions::PyMemoryError::new_err(message),
        Error::Environment { .. } => EnvironmentSettingError::new_err(message),
        // The exception the signal handler raised (Ctrl-C's KeyboardInterrupt), kept by
        // `signal_pending` when the client asked it.
        Error::Interrupted => PENDING_SIGNAL
            .with(|p| p.borrow_mut().take())
            .unwrap_or_else(|| pyo3::exceptions::PyKeyboardInterrupt::new_err(message)),
        Error::Task(_) | Error::Tasks(_) => TaskFailedError::new_err(message),
    }
}

thread_local! {
    /// The exception a signal handler raised during a wait in the client ([`signal_pending`]),
    /// raised when that wait returns [`Error::Interrupted`].
    static PENDING_SIGNAL: std::cell::RefCell<Option<PyErr>> = const { std::cell::RefCell::new(None) };
}

/// Runs the client call `f` without the GIL, with [`signal_pending`] as its interrupt check:
/// a signal handler that raises (Ctrl-C) ends its waits — for room in the rings, or for a
/// restarted daemon (up to the reconnect timeout) — with its exception, nothing issued.
pub(crate) fn interruptible<T: Send>(py: Python<'_>, f: impl FnOnce() -> T + Send) -> T {
    py.detach(|| agora::with_room_interrupt(signal_pending, f))
}

/// The client's interrupt check for a wait that runs without the GIL
/// ([`agora::with_room_interrupt`]): runs the signal handlers (taking the GIL for the moment);
/// true, with the exception kept for the caller, when one raised.
pub(crate) fn signal_pending() -> bool {
    Python::attach(|py| match py.check_signals() {
        Ok(()) => false,
        Err(e) => {
            PENDING_SIGNAL.with(|p| *p.borrow_mut() = Some(e));
            true
        }
    })
}

/// The Python exception for a task's error.
fn task_exception(task: &TaskError, message: String) -> PyErr {
    match task {
        TaskError::Malformed(_) => MalformedTaskError::new_err(message),
        TaskError::UnknownQueue(_) => UnknownQueueError::new_err(message),
        TaskError::UnknownKernel(_) => UnknownKernelError::new_err(message),
        TaskError::ArgumentCount { .. } => ArgumentCountError::new_err(message),
        TaskError::ArgumentType { .. } => ArgumentTypeError::new_err(message),
        TaskError::InvalidHandle { .. } | TaskError::ForeignBuffer { .. } | TaskError::ForeignKernel { .. } => {
            InvalidHandleError::new_err(message)
        }
        TaskError::BufferTooSmall { .. } => BufferTooSmallError::new_err(message),
        TaskError::OutOfBounds { .. } => OutOfBoundsError::new_err(message),
        TaskError::InvalidScalar { .. } => InvalidScalarError::new_err(message),
        // A range beyond every capable device's limits is a range too large for this node; one
        // that differs from the range the kernel's size rule fixes is an invalid range too.
        TaskError::InvalidRange { .. }
        | TaskError::RangeMismatch { .. }
        | TaskError::DeviceLimit { .. }
        | TaskError::BadWindow { .. } => InvalidRangeError::new_err(message),
        TaskError::Aliased { .. } => AliasedBuffersError::new_err(message),
        TaskError::NoDevice(_) => NoDeviceError::new_err(message),
        TaskError::KernelFault
        | TaskError::KernelCrashed { .. }
        | TaskError::KernelReturned { .. }
        | TaskError::KernelExited { .. }
        | TaskError::KernelOpenCl { .. } => KernelFaultError::new_err(message),
        TaskError::KernelTimeout { .. } => KernelTimeoutError::new_err(message),
        TaskError::ResourceExhausted { .. } => ResourceExhaustedError::new_err(message),
        TaskError::Attachment { .. } => AttachmentError::new_err(message),
        TaskError::DaemonRestarted => DaemonRestartedError::new_err(message),
        TaskError::Cancelled => CancelledError::new_err(message),
        // A session quota is a device-memory limit too.
        TaskError::DeviceOutOfMemory { .. } | TaskError::DeviceQuota { .. } | TaskError::DeviceTooSmall { .. } => {
            DeviceOutOfMemoryError::new_err(message)
        }
        // A device that failed under the task, or data lost with it.
        TaskError::DeviceFailed(_) | TaskError::DeviceLost | TaskError::DataLost { .. } => {
            DeviceFailedError::new_err(message)
        }
        TaskError::DependencyFailed { .. } => DependencyFailedError::new_err(message),
        _ => TaskFailedError::new_err(message),
    }
}

/// Converts a client result into a Python one.
pub(crate) trait OrRaise<T> {
    fn or_raise(self) -> PyResult<T>;
}

impl<T> OrRaise<T> for Result<T, Error> {
    fn or_raise(self) -> PyResult<T> {
        self.map_err(to_python)
    }
}

/// Whether a session is still open, shared by the session and every queue, buffer and task made
/// from it: after `Session.close()` each of their calls raises ClosedError.
#[derive(Clone, Default)]
pub(crate) struct Liveness(Arc<AtomicBool>);

impl Liveness {
    /// Marks the session closed, for every object made from it.
    pub(crate) fn close(&self) {
        self.0.store(true, Ordering::Release);
    }

    pub(crate) fn is_closed(&self) -> bool {
        self.0.load(Ordering::Acquire)
    }

    /// Raises ClosedError, naming `what`, once the session was closed.
    pub(crate) fn check(&self, what: &str) -> PyResult<()> {
        if self.is_closed() {
            // The session itself is not "this session's session".
            let whose = if what == "session" {
                "this session".to_string()
            } else {
                format!("this {what}'s session")
            };
            return Err(ClosedError::new_err(format!(
                "{whose} was closed (session.close(), or the end of its `with` block); open a new session to go on"
            )));
        }
        Ok(())
    }
}

/// ClosedError for an object of kind `what` (`session`, `queue`, `buffer`, `DAG`) that this
/// program closed, released or withdrew: each says what ended it, as that object ends.
pub(crate) fn closed(what: &str) -> PyErr {
    let message = match what {
        "buffer" => "this buffer was released (buf.release()); make a new one with session.buffer() or session.buffer_from()".to_string(),
        "queue" => "this queue was closed (queue.close(), or the end of its `with` block); create a new one with session.queue()".to_string(),
        "DAG" => "this DAG was withdrawn (dag.withdraw(), or the end of its `with` block); declare it again to go on".to_string(),
        "session" => "this session was closed (session.close(), or the end of its `with` block); open a new session to go on".to_string(),
        other => format!("this {other} was closed; create a new one"),
    };
    ClosedError::new_err(message)
}
