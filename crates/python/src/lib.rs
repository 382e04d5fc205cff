//! `agora._native`: the Python face of the Rust client (`agora` crate), one class per Rust type.
//!
//! Owns the conversions between Python values and the client's types (scalars typed from the
//! kernel's signature, NumPy views of buffers through the buffer protocol) and the mapping from
//! the client's typed errors to one Python exception class per error kind. It must not speak
//! the wire protocol itself: everything goes through the Rust client, so Python, C and Rust
//! programs behave the same.
//!
//! Every call that can block releases the GIL (connect, buffer and queue creation, kernel
//! lookups, status, `wait`, `finish`, and a launch waiting for room in the rings), so other
//! Python threads run while one waits for the daemon. The waits for tasks and for ring room go
//! in slices with a check for signals between them, so Ctrl-C interrupts them at once; control
//! calls end within the session's `control_timeout` (TimeoutError).
//!
//! One module per class: `session`, `queue`, `buffer`, `kernel`, `task`, and `dag`
//! (`DagBuilder` and `Dag`); `errors` holds the exception classes and the error mapping.

mod buffer;
mod dag;
mod errors;
mod kernel;
mod program;
mod queue;
mod session;
mod task;

use pyo3::prelude::*;

use crate::buffer::PyBuffer;
use crate::errors::*;
use crate::kernel::PyKernel;
use crate::queue::PyQueue;
use crate::session::PySession;
use crate::task::PyTask;

/// The `agora._native` module.
#[pymodule]
fn _native(m: &Bound<'_, PyModule>) -> PyResult<()> {
    let py = m.py();
    m.add_class::<PySession>()?;
    m.add_class::<PyQueue>()?;
    m.add_class::<PyBuffer>()?;
    m.add_class::<PyKernel>()?;
    m.add_class::<program::PyProgram>()?;
    m.add_class::<PyTask>()?;
    m.add_class::<dag::PyDagBuilder>()?;
    m.add_class::<dag::PyDag>()?;
    macro_rules! exceptions {
        ($($name:ident),* $(,)?) => { $( m.add(stringify!($name), py.get_type::<$name>())?; )* };
    }
    exceptions!(
        AgoraError,
        ConnectError,
        DisconnectedError,
        ClosedError,
        ForkedChildError,
        EnvironmentSettingError,
        BufferInUseError,
        ProtocolError,
        OutOfBoundsError,
        TaskFailedError,
        MalformedTaskError,
        UnknownQueueError,
        UnknownKernelError,
        ArgumentCountError,
        ArgumentTypeError,
        InvalidHandleError,
        BufferTooSmallError,
        InvalidScalarError,
        InvalidRangeError,
        AliasedBuffersError,
        NoDeviceError,
        KernelFaultError,
        KernelTimeoutError,
        ResourceExhaustedError,
        ExportError,
        DagError,
        AttachmentError,
        CheckpointError,
        DaemonRestartedError,
        ProgramBuildError,
        CancelledError,
        DeviceOutOfMemoryError,
        DeviceFailedError,
        DependencyFailedError,
        QuotaExceededError,
        VersionMismatchError,
        TooManyError,
        LimitReachedError,
        BadRequestError,
        NotPermittedError,
    );
    m.add("TimeoutError", errors::timeout_error_type(py)?)?;
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    Ok(())
}
