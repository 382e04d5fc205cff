//! `agora._native`: the Python face of the Rust client (`agora` crate), one class per Rust type.
//!
//! Owns the conversions between Python values and the client's types (scalars typed from the
//! kernel's signature, NumPy views of buffers through the buffer protocol) and the mapping from
//! the client's typed errors to one Python exception class per error kind. It must not speak
//! the wire protocol itself: everything goes through the Rust client, so Python, C and Rust
//! programs behave the same.
//!
//! Blocking calls (connect, `wait`, `finish`) release the GIL, so other Python threads run while
//! one waits for the daemon.

use std::collections::HashMap;
use std::ffi::{c_int, c_void};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Mutex;

use agora::{Arg, Error, QueueClass, QueueOptions, SessionOptions, TaskError};
use agora_protocol::control::ControlError;
use agora_protocol::{ParamKind, ScalarType};
use pyo3::exceptions::{PyException, PyTypeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyTuple};
use pyo3::{create_exception, ffi};

create_exception!(agora, AgoraError, PyException, "Base class of every Agora error.");
create_exception!(
    _native,
    ConnectError,
    AgoraError,
    "No daemon answers on the socket: start one with `agora serve` or set AGORA_SOCKET."
);
create_exception!(
    _native,
    DisconnectedError,
    AgoraError,
    "The daemon stopped or was killed; open a new session once it is back."
);
create_exception!(
    _native,
    ClosedError,
    AgoraError,
    "The session, queue or buffer was closed or released by this program."
);
create_exception!(
    _native,
    BufferInUseError,
    AgoraError,
    "A buffer cannot be released while NumPy arrays or memoryviews of it exist."
);
create_exception!(
    _native,
    ProtocolError,
    AgoraError,
    "The daemon answered something this client does not understand (version mismatch?)."
);
create_exception!(
    _native,
    OutOfBoundsError,
    AgoraError,
    "A byte range lies outside its buffer."
);
create_exception!(
    _native,
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

/// The Python exception for an error that is not a task's.
fn client_exception(error: &Error, message: String) -> PyErr {
    match error {
        Error::Connect { .. } => ConnectError::new_err(message),
        Error::Disconnected => DisconnectedError::new_err(message),
        Error::OutOfBounds { .. } => OutOfBoundsError::new_err(message),
        Error::Protocol(_) => ProtocolError::new_err(message),
        Error::Control(control) => match control {
            ControlError::VersionMismatch { .. } => VersionMismatchError::new_err(message),
            ControlError::QuotaExceeded { .. } => QuotaExceededError::new_err(message),
            ControlError::EmptyBuffer => PyValueError::new_err(message),
            ControlError::UnknownKernel { .. } => UnknownKernelError::new_err(message),
            ControlError::TooMany { .. } => TooManyError::new_err(message),
            ControlError::BadRequest(_) => BadRequestError::new_err(message),
            ControlError::NotPermitted(_) => NotPermittedError::new_err(message),
        },
        Error::Task(_) | Error::Tasks(_) => TaskFailedError::new_err(message),
    }
}

/// The Python exception for a task's error.
fn task_exception(task: &TaskError, message: String) -> PyErr {
    match task {
        TaskError::Malformed(_) => MalformedTaskError::new_err(message),
        TaskError::UnknownQueue(_) => UnknownQueueError::new_err(message),
        TaskError::UnknownKernel(_) => UnknownKernelError::new_err(message),
        TaskError::ArgumentCount { .. } => ArgumentCountError::new_err(message),
        TaskError::ArgumentType { .. } => ArgumentTypeError::new_err(message),
        TaskError::InvalidHandle { .. } => InvalidHandleError::new_err(message),
        TaskError::BufferTooSmall { .. } => BufferTooSmallError::new_err(message),
        TaskError::OutOfBounds { .. } => OutOfBoundsError::new_err(message),
        TaskError::InvalidScalar { .. } => InvalidScalarError::new_err(message),
        // A range beyond every capable device's limits is a range too large for this node.
        TaskError::InvalidRange { .. } | TaskError::DeviceLimit { .. } => InvalidRangeError::new_err(message),
        TaskError::Aliased { .. } => AliasedBuffersError::new_err(message),
        TaskError::NoDevice(_) => NoDeviceError::new_err(message),
        TaskError::KernelFault => KernelFaultError::new_err(message),
        TaskError::Cancelled => CancelledError::new_err(message),
        // A session quota is a device-memory limit too.
        TaskError::DeviceOutOfMemory { .. } | TaskError::DeviceQuota { .. } => DeviceOutOfMemoryError::new_err(message),
        // A device that failed under the task, or data lost with it.
        TaskError::DeviceFailed(_) | TaskError::DeviceLost | TaskError::DataLost { .. } => {
            DeviceFailedError::new_err(message)
        }
        TaskError::DependencyFailed { .. } => DependencyFailedError::new_err(message),
        _ => TaskFailedError::new_err(message),
    }
}

/// Converts a client result into a Python one.
trait OrRaise<T> {
    fn or_raise(self) -> PyResult<T>;
}

impl<T> OrRaise<T> for Result<T, Error> {
    fn or_raise(self) -> PyResult<T> {
        self.map_err(to_python)
    }
}

fn closed(what: &str) -> PyErr {
    ClosedError::new_err(format!(
        "this {what} was closed; create a new one (a `with` block closes it at its end)"
    ))
}

/// A connection to the Agora daemon: creates queues and buffers, looks kernels up.
#[pyclass(module = "agora._native", name = "Session")]
struct PySession {
    inner: Mutex<Option<agora::Session>>,
}

impl PySession {
    fn session(&self) -> PyResult<agora::Session> {
        self.inner
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
            .ok_or_else(|| closed("session"))
    }
}

fn parse_class(name: &str) -> PyResult<QueueClass> {
    match name {
        "batch" => Ok(QueueClass::Batch),
        "latency" => Ok(QueueClass::Latency),
        other => Err(PyValueError::new_err(format!(
            "unknown queue class '{other}': use 'batch' (throughput work) or 'latency' (response-time work)"
        ))),
    }
}

fn parse_device(name: &str) -> PyResult<agora::DeviceKind> {
    agora::DeviceKind::parse(name).ok_or_else(|| {
        PyValueError::new_err(format!(
            "unknown device kind '{name}': use one of {}, or None to let the daemon choose",
            agora::DeviceKind::ALL
                .iter()
                .map(|k| format!("'{}'", k.name()))
                .collect::<Vec<_>>()
                .join(", ")
        ))
    })
}

#[pymethods]
impl PySession {
    /// Opens a session with the daemon on `socket` (default: $AGORA_SOCKET, else the per-user
    /// default path).
    #[new]
    #[pyo3(signature = (socket=None, name=None, heap_bytes=None))]
    fn new(
        py: Python<'_>,
        socket: Option<std::path::PathBuf>,
        name: Option<String>,
        heap_bytes: Option<u64>,
    ) -> PyResult<Self> {
        let name = name.or_else(|| {
            let argv0 = py.import("sys").ok()?.getattr("argv").ok()?.get_item(0).ok()?;
            let argv0: String = argv0.extract().ok()?;
            let base = std::path::Path::new(&argv0).file_name()?.to_string_lossy().into_owned();
            (!base.is_empty()).then(|| format!("python:{base}"))
        });
        let options = SessionOptions {
            socket,
            name,
            heap_bytes,
        };
        let session = py.detach(|| agora::Session::connect_with(options)).or_raise()?;
        Ok(PySession {
            inner: Mutex::new(Some(session)),
        })
    }

    /// Session id given by the daemon.
    #[getter]
    fn id(&self) -> PyResult<u64> {
        Ok(self.session()?.id())
    }

    /// Creates a queue: an ordered stream of tasks, bound to no device. `sla_ms`: the
    /// response-time target of a latency-class queue's tasks (the daemon's default when None).
    #[pyo3(signature = (name="", queue_class="batch", device=None, sla_ms=None))]
    fn queue(&self, name: &str, queue_class: &str, device: Option<&str>, sla_ms: Option<f64>) -> PyResult<PyQueue> {
        let sla = match sla_ms {
            None => None,
            Some(ms) if ms.is_finite() && ms > 0.0 => Some(std::time::Duration::from_secs_f64(ms / 1e3)),
            Some(ms) => {
                return Err(PyValueError::new_err(format!(
                    "sla_ms={ms}: give a positive number of milliseconds, or None"
                )))
            }
        };
        let options = QueueOptions {
            name: name.to_string(),
            class: parse_class(queue_class)?,
            preferred_device: device.map(parse_device).transpose()?,
            sla,
        };
        let session = self.session()?;
        let queue = session.queue_with(options).or_raise()?;
        Ok(PyQueue {
            inner: Mutex::new(Some(queue)),
            session,
            kernels: Mutex::new(HashMap::new()),
        })
    }

    /// Allocates a buffer of `nbytes` bytes (zeroed) in the session's shared memory.
    fn buffer(&self, nbytes: u64) -> PyResult<PyBuffer> {
        if nbytes == 0 {
            return Err(PyValueError::new_err("buffers must be at least 1 byte long"));
        }
        let buffer = self.session()?.buffer(nbytes).or_raise()?;
        Ok(PyBuffer::new(buffer))
    }

    /// Allocates a buffer holding a copy of `array` (anything NumPy can turn into an array); the
    /// buffer remembers its dtype and shape, so `numpy()` views it the same way.
    fn buffer_from(&self, py: Python<'_>, array: &Bound<'_, PyAny>) -> PyResult<Py<PyBuffer>> {
        let numpy = py.import("numpy")?;
        let array = numpy.call_method1("ascontiguousarray", (array,))?;
        let nbytes: u64 = array.getattr("nbytes")?.extract()?;
        if nbytes == 0 {
            return Err(PyValueError::new_err("cannot make a buffer from an empty array"));
        }
        let mut buffer = self.buffer(nbytes)?;
        buffer.dtype = Some(array.getattr("dtype")?.unbind());
        buffer.shape = Some(array.getattr("shape")?.unbind());
        let buffer = Py::new(py, buffer)?;
        let view = PyBuffer::numpy(buffer.bind(py).borrow(), py, None, None)?;
        numpy.call_method1("copyto", (&view, &array))?;
        Ok(buffer)
    }

    /// Looks a kernel up by name.
    fn kernel(&self, name: &str) -> PyResult<PyKernel> {
        let kernel = self.session()?.kernel(name).or_raise()?;
        Ok(PyKernel { inner: kernel })
    }

    /// Signatures of every kernel the daemon offers (name, params, doc).
    fn kernels(&self, py: Python<'_>) -> PyResult<Vec<Py<PyDict>>> {
        let signatures = self.session()?.kernels().or_raise()?;
        signatures.iter().map(|s| signature_dict(py, s)).collect()
    }

    /// The daemon's status (devices, lanes, sessions, queues) as a dict.
    fn status(&self, py: Python<'_>) -> PyResult<Py<PyAny>> {
        let report = self.session()?.status().or_raise()?;
        let text = serde_json::to_string(&report).map_err(|e| ProtocolError::new_err(e.to_string()))?;
        Ok(py.import("json")?.call_method1("loads", (text,))?.unbind())
    }

    /// Closes the session. Buffers and queues still referenced stay usable until they go.
    fn close(&self) {
        self.inner.lock().unwrap_or_else(|e| e.into_inner()).take();
    }

    fn __enter__(slf: Py<Self>) -> Py<Self> {
        slf
    }

    #[pyo3(signature = (*_exc))]
    fn __exit__(&self, _exc: &Bound<'_, PyTuple>) -> bool {
        self.close();
        false
    }

    fn __repr__(&self) -> String {
        match self.inner.lock().unwrap_or_else(|e| e.into_inner()).as_ref() {
            Some(s) => format!("<agora.Session id={}>", s.id()),
            None => "<agora.Session closed>".to_string(),
        }
    }
}

fn signature_dict(py: Python<'_>, signature: &agora::KernelSignature) -> PyResult<Py<PyDict>> {
    let dict = PyDict::new(py);
    dict.set_item("name", &signature.name)?;
    dict.set_item("doc", &signature.doc)?;
    let params: Vec<(String, String)> = signature
        .params
        .iter()
        .map(|p| (p.name.clone(), p.kind.to_string()))
        .collect();
    dict.set_item("params", params)?;
    Ok(dict.unbind())
}

/// A kernel of the daemon's library, looked up by name.
#[pyclass(module = "agora._native", name = "Kernel", frozen)]
struct PyKernel {
    inner: agora::Kernel,
}

#[pymethods]
impl PyKernel {
    /// Its name.
    #[getter]
    fn name(&self) -> &str {
        self.inner.name()
    }

    /// What it computes.
    #[getter]
    fn doc(&self) -> &str {
        &self.inner.signature().doc
    }

    /// Parameters as (name, kind) pairs, e.g. ("x", "buffer<f32, read>").
    #[getter]
    fn params(&self) -> Vec<(String, String)> {
        self.inner
            .signature()
            .params
            .iter()
            .map(|p| (p.name.clone(), p.kind.to_string()))
            .collect()
    }

    fn __repr__(&self) -> String {
        format!("<agora.Kernel {}>", self.inner.signature())
    }
}

/// A buffer: an opaque handle whose host copy lives in memory shared with the daemon.
///
/// Supports the buffer protocol, so `numpy()` (and `memoryview(buf)`) view the host copy in place.
/// Each view holds a reference to the buffer, which keeps it alive; `release()` refuses while any
/// view exists.
#[pyclass(module = "agora._native", name = "Buffer")]
struct PyBuffer {
    inner: Mutex<Option<agora::Buffer>>,
    /// Live buffer-protocol exports (NumPy arrays, memoryviews).
    exports: AtomicUsize,
    dtype: Option<Py<PyAny>>,
    shape: Option<Py<PyAny>>,
}

impl PyBuffer {
    fn new(buffer: agora::Buffer) -> Self {
        PyBuffer {
            inner: Mutex::new(Some(buffer)),
            exports: AtomicUsize::new(0),
            dtype: None,
            shape: None,
        }
    }

    fn with<T>(&self, f: impl FnOnce(&mut agora::Buffer) -> T) -> PyResult<T> {
        let mut guard = self.inner.lock().unwrap_or_else(|e| e.into_inner());
        guard.as_mut().map(f).ok_or_else(|| closed("buffer"))
    }
}

#[pymethods]
impl PyBuffer {
    /// Length in bytes.
    #[getter]
    fn nbytes(&self) -> PyResult<u64> {
        self.with(|b| b.len())
    }

    fn __len__(&self) -> PyResult<usize> {
        Ok(self.nbytes()? as usize)
    }

    /// A NumPy array viewing the host copy in place (no copy). `dtype` defaults to the dtype the
    /// buffer was made from (else uint8), `shape` to its shape (else as many elements as fit).
    /// The array keeps the buffer alive; the buffer cannot be released while it exists.
    #[pyo3(signature = (dtype=None, shape=None))]
    fn numpy<'py>(
        slf: PyRef<'py, Self>,
        py: Python<'py>,
        dtype: Option<&Bound<'py, PyAny>>,
        shape: Option<&Bound<'py, PyAny>>,
    ) -> PyResult<Bound<'py, PyAny>> {
        let numpy = py.import("numpy")?;
        let (dtype, shape) = match (dtype, shape) {
            (None, None) => (
                slf.dtype.as_ref().map(|d| d.bind(py).clone()),
                slf.shape.as_ref().map(|s| s.bind(py).clone()),
            ),
            (d, s) => (d.cloned(), s.cloned()),
        };
        let dtype = numpy.call_method1("dtype", (dtype.unwrap_or_else(|| numpy.getattr("uint8").unwrap()),))?;
        let itemsize: u64 = dtype.getattr("itemsize")?.extract()?;
        let nbytes = slf.nbytes()?;
        let count = match &shape {
            None => nbytes / itemsize.max(1),
            Some(shape) => {
                let elements: u64 = numpy.call_method1("prod", (shape,))?.extract()?;
                if elements * itemsize > nbytes {
                    return Err(PyValueError::new_err(format!(
                        "a view of shape {shape} and dtype {dtype} needs {} bytes; the buffer has {nbytes}",
                        elements * itemsize
                    )));
                }
                elements
            }
        };
        let kwargs = PyDict::new(py);
        kwargs.set_item("dtype", &dtype)?;
        kwargs.set_item("count", count)?;
        let this = slf.into_pyobject(py)?;
        let array = numpy.call_method("frombuffer", (this,), Some(&kwargs))?;
        match shape {
            Some(shape) => array.call_method1("reshape", (shape,)),
            None => Ok(array),
        }
    }

    /// Copies `array`'s bytes into the host copy at byte `offset` (a copy; `numpy()` is the
    /// zero-copy way).
    #[pyo3(signature = (array, offset=0))]
    fn write(&self, py: Python<'_>, array: &Bound<'_, PyAny>, offset: u64) -> PyResult<()> {
        let numpy = py.import("numpy")?;
        let bytes: Vec<u8> = numpy
            .call_method1("ascontiguousarray", (array,))?
            .call_method0("tobytes")?
            .extract()?;
        self.with(|b| b.write(offset, &bytes))?.or_raise()
    }

    /// Number of NumPy arrays and memoryviews currently viewing this buffer.
    #[getter]
    fn views(&self) -> usize {
        self.exports.load(Ordering::Acquire)
    }

    /// Releases the buffer now (it is also released when garbage collected). Raises
    /// BufferInUseError while views of it exist.
    fn release(&self) -> PyResult<()> {
        let views = self.exports.load(Ordering::Acquire);
        if views > 0 {
            return Err(BufferInUseError::new_err(format!(
                "{views} NumPy array(s) or memoryview(s) still view this buffer; delete them (`del array`) before releasing it"
            )));
        }
        self.inner.lock().unwrap_or_else(|e| e.into_inner()).take();
        Ok(())
    }

    fn __repr__(&self) -> String {
        match self.inner.lock().unwrap_or_else(|e| e.into_inner()).as_ref() {
            Some(b) => format!("<agora.Buffer {} bytes>", b.len()),
            None => "<agora.Buffer released>".to_string(),
        }
    }

    /// Buffer protocol: a writable, contiguous byte view of the host copy. The view owns a
    /// reference to this object (`obj`), so the mapping outlives every view.
    unsafe fn __getbuffer__(slf: Bound<'_, Self>, view: *mut ffi::Py_buffer, flags: c_int) -> PyResult<()> {
        if view.is_null() {
            return Err(pyo3::exceptions::PyBufferError::new_err("null view"));
        }
        let (ptr, len) = {
            let this = slf.borrow();
            this.with(|b| {
                let bytes = b.as_mut_slice::<u8>();
                (bytes.as_mut_ptr(), bytes.len())
            })?
        };
        slf.borrow().exports.fetch_add(1, Ordering::AcqRel);
        // SAFETY: `view` is non-null and points at a Py_buffer the caller (CPython) owns; `ptr`
        // and `len` describe the buffer's range of the session mapping, which stays mapped while
        // `obj` (this Buffer, which owns the client Buffer and through it the session) is
        // referenced by the view. `release()` refuses while exports > 0, so the range is not
        // released under a view.
        unsafe {
            (*view).obj = slf.into_any().into_ptr();
            (*view).buf = ptr as *mut c_void;
            (*view).len = len as isize;
            (*view).readonly = 0;
            (*view).itemsize = 1;
            (*view).format = if flags & ffi::PyBUF_FORMAT == ffi::PyBUF_FORMAT {
                c"B".as_ptr() as *mut _
            } else {
                std::ptr::null_mut()
            };
            (*view).ndim = 1;
            (*view).shape = if flags & ffi::PyBUF_ND == ffi::PyBUF_ND {
                &mut (*view).len
            } else {
                std::ptr::null_mut()
            };
            (*view).strides = if flags & ffi::PyBUF_STRIDES == ffi::PyBUF_STRIDES {
                &mut (*view).itemsize
            } else {
                std::ptr::null_mut()
            };
            (*view).suboffsets = std::ptr::null_mut();
            (*view).internal = std::ptr::null_mut();
        }
        Ok(())
    }

    unsafe fn __releasebuffer__(&self, _view: *mut ffi::Py_buffer) {
        self.exports.fetch_sub(1, Ordering::AcqRel);
    }
}

/// An ordered stream of tasks, bound to no device.
#[pyclass(module = "agora._native", name = "Queue")]
struct PyQueue {
    inner: Mutex<Option<agora::Queue>>,
    session: agora::Session,
    /// Kernels launched by name, looked up once.
    kernels: Mutex<HashMap<String, agora::Kernel>>,
}

impl PyQueue {
    fn issue(&self, f: impl FnOnce(&agora::Queue) -> Result<agora::Task, Error>) -> PyResult<PyTask> {
        let guard = self.inner.lock().unwrap_or_else(|e| e.into_inner());
        let queue = guard.as_ref().ok_or_else(|| closed("queue"))?;
        let task = f(queue).or_raise()?;
        Ok(PyTask {
            id: task.id(),
            inner: Mutex::new(Some(task)),
        })
    }
}

/// A scalar argument converted to the type the kernel's signature declares.
fn scalar(value: &Bound<'_, PyAny>, ty: ScalarType, index: usize, name: &str) -> PyResult<Arg<'static>> {
    let wrong =
        |what: &str| ArgumentTypeError::new_err(format!("argument {index} ('{name}') is a {ty:?} scalar; got {what}"));
    if value.is_instance_of::<PyBuffer>() {
        return Err(wrong("a Buffer"));
    }
    let described = || value.get_type().name().map(|n| n.to_string()).unwrap_or_default();
    Ok(match ty {
        ScalarType::F32 => Arg::F32(value.extract::<f32>().map_err(|_| wrong(&described()))?),
        ScalarType::F64 => Arg::F64(value.extract::<f64>().map_err(|_| wrong(&described()))?),
        ScalarType::I32 => Arg::I32(
            value
                .extract::<i32>()
                .map_err(|_| wrong(&format!("{value} (not an i32)")))?,
        ),
        ScalarType::U32 => Arg::U32(
            value
                .extract::<u32>()
                .map_err(|_| wrong(&format!("{value} (not a u32)")))?,
        ),
        ScalarType::I64 => Arg::I64(
            value
                .extract::<i64>()
                .map_err(|_| wrong(&format!("{value} (not an i64)")))?,
        ),
        ScalarType::U64 => Arg::U64(
            value
                .extract::<u64>()
                .map_err(|_| wrong(&format!("{value} (not a u64)")))?,
        ),
    })
}

fn parse_range(range: &Bound<'_, PyAny>) -> PyResult<agora::NdRange> {
    if let Ok(x) = range.extract::<u64>() {
        return Ok(agora::NdRange::d1(x));
    }
    let dims: Vec<u64> = range.extract().map_err(|_| {
        PyTypeError::new_err("range must be an int or a tuple of 1 to 3 non-negative ints, e.g. range=(1024, 768)")
    })?;
    match dims[..] {
        [x] => Ok(agora::NdRange::d1(x)),
        [x, y] => Ok(agora::NdRange::d2(x, y)),
        [x, y, z] => Ok(agora::NdRange::d3(x, y, z)),
        _ => Err(PyValueError::new_err(format!(
            "range has {} dimensions; kernels take 1 to 3",
            dims.len()
        ))),
    }
}

#[pymethods]
impl PyQueue {
    /// Launches `kernel` (a Kernel or its name) with `args` over `range` (an int or a tuple of up
    /// to 3 ints). Scalars are converted to the types of the kernel's signature.
    #[pyo3(signature = (kernel, *args, range))]
    fn launch(
        &self,
        kernel: &Bound<'_, PyAny>,
        args: &Bound<'_, PyTuple>,
        range: &Bound<'_, PyAny>,
    ) -> PyResult<PyTask> {
        let kernel: agora::Kernel = if let Ok(k) = kernel.cast::<PyKernel>() {
            k.get().inner.clone()
        } else if let Ok(name) = kernel.extract::<String>() {
            let mut cache = self.kernels.lock().unwrap_or_else(|e| e.into_inner());
            match cache.get(&name) {
                Some(k) => k.clone(),
                None => {
                    let k = self.session.kernel(&name).or_raise()?;
                    cache.insert(name, k.clone());
                    k
                }
            }
        } else {
            return Err(PyTypeError::new_err(
                "kernel must be a Kernel (session.kernel(name)) or a kernel name",
            ));
        };
        let params = &kernel.signature().params;
        if args.len() != params.len() {
            return Err(ArgumentCountError::new_err(format!(
                "{} takes {} arguments ({}), got {}",
                kernel.name(),
                params.len(),
                params.iter().map(|p| p.name.as_str()).collect::<Vec<_>>().join(", "),
                args.len()
            )));
        }
        let range = parse_range(range)?;
        // Borrow every buffer argument for the duration of the issue.
        let items: Vec<Bound<'_, PyAny>> = args.iter().collect();
        let mut buffers: Vec<Option<PyRef<'_, PyBuffer>>> = Vec::with_capacity(items.len());
        for (index, (item, param)) in items.iter().zip(params).enumerate() {
            match param.kind {
                ParamKind::Buffer { .. } => {
                    let buffer = item.cast::<PyBuffer>().map_err(|_| {
                        ArgumentTypeError::new_err(format!(
                            "argument {index} ('{}') is a buffer; got {}",
                            param.name,
                            item.get_type().name().map(|n| n.to_string()).unwrap_or_default()
                        ))
                    })?;
                    let buffer = buffer.borrow();
                    if let ParamKind::Buffer { element, .. } = param.kind {
                        check_element_type(&buffer, element, index, &param.name, kernel.name())?;
                    }
                    buffers.push(Some(buffer));
                }
                ParamKind::Scalar(_) => buffers.push(None),
            }
        }
        // Lock each distinct buffer once: the same buffer may be passed twice (sgemm's `a, a`),
        // and a std Mutex locked twice by one thread deadlocks.
        let mut distinct: Vec<&PyBuffer> = Vec::new();
        let slots: Vec<Option<usize>> = buffers
            .iter()
            .map(|b| {
                b.as_ref().map(|b| {
                    let b: &PyBuffer = b;
                    match distinct.iter().position(|d| std::ptr::eq(*d, b)) {
                        Some(slot) => slot,
                        None => {
                            distinct.push(b);
                            distinct.len() - 1
                        }
                    }
                })
            })
            .collect();
        let guards: Vec<std::sync::MutexGuard<'_, Option<agora::Buffer>>> = distinct
            .iter()
            .map(|b| b.inner.lock().unwrap_or_else(|e| e.into_inner()))
            .collect();
        let mut call: Vec<Arg<'_>> = Vec::with_capacity(items.len());
        for (index, ((item, param), slot)) in items.iter().zip(params).zip(&slots).enumerate() {
            match (param.kind, slot) {
                (ParamKind::Buffer { .. }, Some(slot)) => {
                    call.push(Arg::Buffer(guards[*slot].as_ref().ok_or_else(|| closed("buffer"))?));
                }
                (ParamKind::Scalar(ty), _) => call.push(scalar(item, ty, index, &param.name)?),
                (ParamKind::Buffer { .. }, None) => unreachable!("buffer parameters were borrowed above"),
            }
        }
        self.issue(|q| q.launch(&kernel, &call, range))
    }

    /// Makes the devices see the buffer's host copy (call after writing it).
    fn sync_to(&self, buffer: &PyBuffer) -> PyResult<PyTask> {
        let guard = buffer.inner.lock().unwrap_or_else(|e| e.into_inner());
        let b = guard.as_ref().ok_or_else(|| closed("buffer"))?;
        self.issue(|q| q.sync_to(b))
    }

    /// Makes the host copy current (read it after this task completes).
    fn sync_from(&self, buffer: &PyBuffer) -> PyResult<PyTask> {
        let guard = buffer.inner.lock().unwrap_or_else(|e| e.into_inner());
        let b = guard.as_ref().ok_or_else(|| closed("buffer"))?;
        self.issue(|q| q.sync_from(b))
    }

    /// Sets every byte of `buffer` to `value`.
    #[pyo3(signature = (buffer, value=0))]
    fn memset(&self, buffer: &PyBuffer, value: u8) -> PyResult<PyTask> {
        let guard = buffer.inner.lock().unwrap_or_else(|e| e.into_inner());
        let b = guard.as_ref().ok_or_else(|| closed("buffer"))?;
        self.issue(|q| q.memset(b, value))
    }

    /// Copies `nbytes` bytes (0: all of `src` from `src_offset`) from `src` to `dst`.
    #[pyo3(signature = (src, dst, src_offset=0, dst_offset=0, nbytes=0))]
    fn copy(&self, src: &PyBuffer, dst: &PyBuffer, src_offset: u64, dst_offset: u64, nbytes: u64) -> PyResult<PyTask> {
        let same = std::ptr::eq(src, dst);
        let src_guard = src.inner.lock().unwrap_or_else(|e| e.into_inner());
        let s = src_guard.as_ref().ok_or_else(|| closed("buffer"))?;
        if same {
            return self.issue(|q| q.copy(s, src_offset, s, dst_offset, nbytes));
        }
        let dst_guard = dst.inner.lock().unwrap_or_else(|e| e.into_inner());
        let d = dst_guard.as_ref().ok_or_else(|| closed("buffer"))?;
        self.issue(|q| q.copy(s, src_offset, d, dst_offset, nbytes))
    }

    /// Waits (without holding the GIL) for every task issued so far; raises when any task issued
    /// since the previous `finish()` failed: the exception has the class of the earliest failure,
    /// `count` (how many failed) and `failures` (`[(task_id, exception), ...]`).
    fn finish(&self, py: Python<'_>) -> PyResult<()> {
        let guard = self.inner.lock().unwrap_or_else(|e| e.into_inner());
        let queue = guard.as_ref().ok_or_else(|| closed("queue"))?;
        py.detach(|| queue.finish()).or_raise()
    }

    /// Releases the queue (after its issued tasks).
    fn close(&self) {
        self.inner.lock().unwrap_or_else(|e| e.into_inner()).take();
    }

    fn __enter__(slf: Py<Self>) -> Py<Self> {
        slf
    }

    /// Leaving a `with` block waits for the queue (raising its first failure) and releases it.
    #[pyo3(signature = (exc_type, _exc_value, _traceback))]
    fn __exit__(
        &self,
        py: Python<'_>,
        exc_type: &Bound<'_, PyAny>,
        _exc_value: &Bound<'_, PyAny>,
        _traceback: &Bound<'_, PyAny>,
    ) -> PyResult<bool> {
        let outcome = if exc_type.is_none() { self.finish(py) } else { Ok(()) };
        self.close();
        outcome.map(|()| false)
    }

    fn __repr__(&self) -> String {
        match self.inner.lock().unwrap_or_else(|e| e.into_inner()).as_ref() {
            Some(q) => format!("<agora.Queue {:#x}>", q.handle()),
            None => "<agora.Queue closed>".to_string(),
        }
    }
}

/// An issued task.
#[pyclass(module = "agora._native", name = "Task")]
struct PyTask {
    id: u64,
    /// `None` once waited for.
    inner: Mutex<Option<agora::Task>>,
}

#[pymethods]
impl PyTask {
    /// Task id within the session.
    #[getter]
    fn id(&self) -> u64 {
        self.id
    }

    /// Blocks (without holding the GIL) until the task completes; raises its error if it
    /// failed — every time it is asked.
    fn wait(&self, py: Python<'_>) -> PyResult<()> {
        let guard = self.inner.lock().unwrap_or_else(|e| e.into_inner());
        match guard.as_ref() {
            Some(task) => py.detach(|| task.wait()).or_raise(),
            None => Ok(()),
        }
    }

    /// Whether the task has completed, without blocking.
    fn done(&self) -> PyResult<bool> {
        match self.inner.lock().unwrap_or_else(|e| e.into_inner()).as_ref() {
            Some(task) => task.is_complete().or_raise(),
            None => Ok(true),
        }
    }

    fn __repr__(&self) -> String {
        format!("<agora.Task {}>", self.id)
    }
}

/// NumPy's name for the dtype matching a kernel's element type.
fn numpy_name(element: ScalarType) -> &'static str {
    match element {
        ScalarType::I32 => "int32",
        ScalarType::U32 => "uint32",
        ScalarType::I64 => "int64",
        ScalarType::U64 => "uint64",
        ScalarType::F32 => "float32",
        ScalarType::F64 => "float64",
    }
}

/// A buffer made by `buffer_from` remembers its dtype: passing float64 data to a kernel that
/// reads f32 would silently compute garbage, so it is refused here with the fix in the message.
/// Buffers made by `buffer(n)` hold raw bytes and are not checked.
fn check_element_type(buffer: &PyBuffer, element: ScalarType, index: usize, name: &str, kernel: &str) -> PyResult<()> {
    let Some(dtype) = &buffer.dtype else { return Ok(()) };
    let held: String = Python::attach(|py| dtype.bind(py).getattr("name").and_then(|n| n.extract()))?;
    let wanted = numpy_name(element);
    if held == wanted {
        return Ok(());
    }
    Err(ArgumentTypeError::new_err(format!(
        "argument {index} ('{name}') of {kernel} holds {held} elements but the kernel reads {wanted}; \
         make the buffer from `array.astype(numpy.{wanted})`"
    )))
}

/// The `agora._native` module.
#[pymodule]
fn _native(m: &Bound<'_, PyModule>) -> PyResult<()> {
    let py = m.py();
    m.add_class::<PySession>()?;
    m.add_class::<PyQueue>()?;
    m.add_class::<PyBuffer>()?;
    m.add_class::<PyKernel>()?;
    m.add_class::<PyTask>()?;
    macro_rules! exceptions {
        ($($name:ident),* $(,)?) => { $( m.add(stringify!($name), py.get_type::<$name>())?; )* };
    }
    exceptions!(
        AgoraError,
        ConnectError,
        DisconnectedError,
        ClosedError,
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
        CancelledError,
        DeviceOutOfMemoryError,
        DeviceFailedError,
        DependencyFailedError,
        QuotaExceededError,
        VersionMismatchError,
        TooManyError,
        BadRequestError,
        NotPermittedError,
    );
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    Ok(())
}
