//! `agora.Buffer`: a buffer whose host copy lives in memory shared with the daemon. Owns the
//! client buffer, the dtype and shape it was made from, NumPy views through the buffer protocol
//! (counted, so `release()` refuses while one exists), and the element-type check of launches.

use std::ffi::{c_int, c_void};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use agora_protocol::ScalarType;
use pyo3::exceptions::PyValueError;
use pyo3::ffi;
use pyo3::prelude::*;
use pyo3::types::PyDict;

use crate::errors::{closed, ArgumentTypeError, BufferInUseError, Liveness, OrRaise};

/// A buffer: an opaque handle whose host copy lives in memory shared with the daemon.
///
/// Supports the buffer protocol, so `numpy()` (and `memoryview(buf)`) view the host copy in place.
/// Each view holds a reference to the buffer, which keeps it alive; `release()` refuses while any
/// view exists.
#[pyclass(module = "agora._native", name = "Buffer")]
pub(crate) struct PyBuffer {
    /// The client buffer (`None` once released). Only ever locked to clone or take it, never
    /// held while the GIL is let go and taken back: a thread holding the GIL that issues a task
    /// on the same buffer would wait for the lock, and the holder for the GIL (a deadlock). A
    /// task being issued holds its own `Arc`, so `release()` meanwhile frees the buffer after it.
    inner: Mutex<Option<Arc<agora::Buffer>>>,
    /// Live buffer-protocol exports (NumPy arrays, memoryviews).
    pub(crate) exports: AtomicUsize,
    pub(crate) dtype: Option<Py<PyAny>>,
    pub(crate) shape: Option<Py<PyAny>>,
    pub(crate) liveness: Liveness,
}

impl PyBuffer {
    pub(crate) fn new(buffer: agora::Buffer, liveness: Liveness) -> Self {
        PyBuffer {
            inner: Mutex::new(Some(Arc::new(buffer))),
            exports: AtomicUsize::new(0),
            dtype: None,
            shape: None,
            liveness,
        }
    }

    /// Warns (`ResourceWarning`) that `buffer` is being released while a kernel's writes to it
    /// were never read back (no `sync_from` after the launch): its results are lost. Most
    /// likely a forgotten `queue.sync_from(buf)`.
    fn warn_unread(py: Python<'_>, buffer: &agora::Buffer) -> PyResult<()> {
        if !buffer.needs_sync_from() {
            return Ok(());
        }
        let message = format!(
            "agora.Buffer of {} bytes released with a kernel's results never read back: no queue.sync_from(buf) \
             after the last launch that wrote it (strict coherence: agora serve --strict-coherence)",
            buffer.len()
        );
        let message = std::ffi::CString::new(message).unwrap_or_default();
        let category = py.get_type::<pyo3::exceptions::PyResourceWarning>();
        PyErr::warn(py, &category, &message, 1)
    }

    /// `claim_host`: attempts without the GIL, checking for signals between them (a claim waits
    /// while a task uses the buffer, at most the session's control timeout).
    fn claim(&self, py: Python<'_>) -> PyResult<()> {
        let mut wait = self.with(|b| b.claim_wait())?;
        while !crate::errors::interruptible(py, || self.with(|b| b.try_claim_host()))?.or_raise()? {
            let pause = wait.next_pause().or_raise()?;
            let began = std::time::Instant::now();
            py.detach(|| std::thread::sleep(pause));
            wait.paused(began, pause);
            py.check_signals()?;
        }
        Ok(())
    }

    /// The client buffer, unless this buffer was released or its session closed.
    pub(crate) fn handle(&self) -> PyResult<Arc<agora::Buffer>> {
        self.liveness.check("buffer")?;
        let handle = self.inner.lock().unwrap_or_else(|e| e.into_inner()).clone();
        handle.ok_or_else(|| closed("buffer"))
    }

    /// Runs `f` on the client buffer, unless this buffer was released or its session closed.
    pub(crate) fn with<T>(&self, f: impl FnOnce(&agora::Buffer) -> T) -> PyResult<T> {
        Ok(f(&*self.handle()?))
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
    /// buffer was made from (else uint8), also when only `shape` is given; `shape` defaults to the
    /// shape it was made from when no `dtype` is given (else as many elements as fit).
    /// The array keeps the buffer alive; the buffer cannot be released while it exists.
    #[pyo3(signature = (dtype=None, shape=None))]
    pub(crate) fn numpy<'py>(
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
            (None, Some(s)) => (slf.dtype.as_ref().map(|d| d.bind(py).clone()), Some(s.clone())),
            (Some(d), s) => (Some(d.clone()), s.cloned()),
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
    /// zero-copy way). Claims the host copy first (see `claim_host`). A buffer made by
    /// `buffer_from` takes only arrays of the dtype it was made from, as launches check it.
    #[pyo3(signature = (array, offset=0))]
    fn write(&self, py: Python<'_>, array: &Bound<'_, PyAny>, offset: u64) -> PyResult<()> {
        let numpy = py.import("numpy")?;
        let array = numpy.call_method1("ascontiguousarray", (array,))?;
        let dtype = array.getattr("dtype")?;
        check_byte_order(&dtype, "the array")?;
        if let Some(held) = &self.dtype {
            // float64 data (a Python list, a default NumPy array) written into a float32
            // buffer was taken as its bytes, and kernels then computed on garbage.
            let held: String = held.bind(py).getattr("name")?.extract()?;
            let written: String = dtype.getattr("name")?.extract()?;
            if held != written {
                return Err(ArgumentTypeError::new_err(format!(
                    "the buffer holds {held} elements (it was made from a {held} array) but the array written \
                     is {written}; write `array.astype(numpy.{held})` (or write raw bytes through a view: \
                     `buf.numpy(dtype=...)`)"
                )));
            }
        }
        let bytes: Vec<u8> = array.call_method0("tobytes")?.extract()?;
        // Refused before the claim, which would discard results for nothing.
        self.with(|b| b.check_write(offset, bytes.len() as u64))?.or_raise()?;
        self.claim(py)?;
        // Claimed above, waiting the Python way: `write_claimed` does not ask again.
        self.with(|b| b.write_claimed(offset, &bytes))?.or_raise()
    }

    /// Before writing the host copy through a NumPy view over a kernel's results that were
    /// never read back (a launch wrote the buffer after its last `sync_from`): discards those
    /// results and makes the host copy the buffer's current contents, so no eviction (the
    /// daemon making room on their device) writes them over what you write. Returns at once
    /// when there is nothing to claim; on an exported or attached buffer it always asks the
    /// daemon (another session's results may be on a device; granted at once when the host
    /// copy is current). Waits while a task the daemon started uses the buffer (at most the
    /// control timeout: TimeoutError). `write()` claims by itself.
    fn claim_host(&self, py: Python<'_>) -> PyResult<()> {
        self.claim(py)
    }

    /// Whether this process may write the host copy (False only for a buffer attached
    /// read-only).
    #[getter]
    fn writable(&self) -> PyResult<bool> {
        self.with(|b| b.is_writable())
    }

    /// Whether the buffer's memory can be exported or is attached (`shared_buffer`, `attach`).
    #[getter]
    fn shared(&self) -> PyResult<bool> {
        self.with(|b| b.is_shared())
    }

    /// Number of NumPy arrays and memoryviews currently viewing this buffer.
    #[getter]
    fn views(&self) -> usize {
        self.exports.load(Ordering::Acquire)
    }

    /// Releases the buffer now (it is also released when garbage collected). Raises
    /// BufferInUseError while views of it exist. Releasing a released buffer, or one whose
    /// session was closed, is allowed (clean-up code need not check). Warns with a
    /// `ResourceWarning` when a kernel wrote the buffer after its last `sync_from` (its results
    /// were never read back).
    fn release(&self, py: Python<'_>) -> PyResult<()> {
        let views = self.exports.load(Ordering::Acquire);
        if views > 0 {
            return Err(BufferInUseError::new_err(format!(
                "{views} NumPy array(s) or memoryview(s) still view this buffer; delete them (`del array`) before releasing it"
            )));
        }
        let released = self.inner.lock().unwrap_or_else(|e| e.into_inner()).take();
        match released {
            Some(buffer) => Self::warn_unread(py, &buffer),
            None => Ok(()),
        }
    }

    fn __repr__(&self) -> String {
        match self.inner.lock().unwrap_or_else(|e| e.into_inner()).as_ref() {
            Some(_) if self.liveness.is_closed() => "<agora.Buffer closed>".to_string(),
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
        let (ptr, len, writable) = {
            let this = slf.borrow();
            this.with(|b| {
                let bytes = b.as_slice::<u8>();
                (bytes.as_ptr() as *mut u8, bytes.len(), b.is_writable())
            })?
        };
        // A buffer attached read-only is mapped read-only: views of it are read-only too.
        if !writable && flags & ffi::PyBUF_WRITABLE == ffi::PyBUF_WRITABLE {
            return Err(pyo3::exceptions::PyBufferError::new_err(
                "the buffer is attached read-only: ask for a read-only view (numpy() gives one)",
            ));
        }
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
            (*view).readonly = c_int::from(!writable);
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

impl Drop for PyBuffer {
    /// Garbage collected without `release()`: warns as `release()` does (through
    /// `sys.unraisablehook` when warnings are errors, as for an unclosed file).
    fn drop(&mut self) {
        let inner = self.inner.get_mut().unwrap_or_else(|e| e.into_inner()).take();
        if let Some(buffer) = inner.filter(|b| b.needs_sync_from()) {
            Python::attach(|py| {
                if let Err(error) = PyBuffer::warn_unread(py, &buffer) {
                    error.write_unraisable(py, None);
                }
            });
        }
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

/// Refuses `dtype` unless its byte order is the machine's: kernels read native numbers, so a
/// big-endian array (as FITS, HDF5 or network formats give) would be read as garbage.
/// `what` names the call's array in the message.
pub(crate) fn check_byte_order(dtype: &Bound<'_, PyAny>, what: &str) -> PyResult<()> {
    if dtype.getattr("isnative")?.extract::<bool>()? {
        return Ok(());
    }
    let held: String = dtype.getattr("str")?.extract()?;
    let native: String = dtype.call_method1("newbyteorder", ("=",))?.getattr("str")?.extract()?;
    Err(ArgumentTypeError::new_err(format!(
        "{what} has dtype '{held}', whose byte order is not this machine's: kernels read native \
         numbers, so convert it first with `arr.astype('{native}')` \
         (or `arr.astype(arr.dtype.newbyteorder('='))`)"
    )))
}

/// A buffer made by `buffer_from` remembers its dtype: passing float64 data to a kernel that
/// reads f32 would silently compute garbage, so it is refused here with the fix in the message.
/// Buffers made by `buffer(n)` hold raw bytes and are not checked.
pub(crate) fn check_element_type(
    buffer: &PyBuffer,
    element: ScalarType,
    index: usize,
    name: &str,
    kernel: &str,
) -> PyResult<()> {
    let Some(dtype) = &buffer.dtype else { return Ok(()) };
    Python::attach(|py| check_byte_order(dtype.bind(py), &format!("argument {index} ('{name}') of {kernel}")))?;
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
