//! `agora.Session`: the connection to the daemon. Owns the client session and the factories of
//! queues, buffers and kernels; parses the queue options Python passes as strings.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use agora::{QueueClass, QueueOptions, SessionOptions};
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyTuple};

use crate::buffer::PyBuffer;
use crate::dag::PyDagBuilder;
use crate::errors::{closed, Liveness, OrRaise, ProtocolError};
use crate::kernel::PyKernel;
use crate::program::PyProgram;
use crate::queue::PyQueue;

/// A connection to the Agora daemon: creates queues and buffers, looks kernels up.
#[pyclass(module = "agora._native", name = "Session")]
pub(crate) struct PySession {
    pub(crate) inner: Mutex<Option<agora::Session>>,
    /// Shared with every queue, buffer and task made from this session.
    pub(crate) liveness: Liveness,
}

impl PySession {
    pub(crate) fn session(&self) -> PyResult<agora::Session> {
        self.liveness.check("session")?;
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
    /// `control_timeout`: seconds a control call (buffer, queue, kernel, status) may wait for
    /// the daemon before it raises TimeoutError (default $AGORA_CONTROL_TIMEOUT, else 30).
    /// `reconnect_timeout`: seconds the session keeps trying to reach a restarted daemon when
    /// its daemon dies (default $AGORA_RECONNECT_TIMEOUT, else 30; 0 turns reconnection off).
    /// Tasks in flight then raise DaemonRestartedError (those the dead daemon never took, behind
    /// only completed ones, are issued again: `tasks_reissued`); buffers, queues, kernels and
    /// programs carry on.
    #[new]
    #[pyo3(signature = (socket=None, name=None, heap_bytes=None, control_timeout=None, reconnect_timeout=None))]
    fn new(
        py: Python<'_>,
        socket: Option<std::path::PathBuf>,
        name: Option<String>,
        heap_bytes: Option<u64>,
        control_timeout: Option<f64>,
        reconnect_timeout: Option<f64>,
    ) -> PyResult<Self> {
        let reconnect_timeout = match reconnect_timeout {
            None => None,
            Some(s) if s.is_finite() && (0.0..=86_400.0).contains(&s) => Some(std::time::Duration::from_secs_f64(s)),
            Some(s) => {
                return Err(PyValueError::new_err(format!(
                    "reconnect_timeout={s}: give a number of seconds from 0 (off) to a day, or None"
                )))
            }
        };
        let control_timeout = match control_timeout {
            None => None,
            Some(s) if s.is_finite() && s > 0.0 && s <= 86_400.0 => Some(std::time::Duration::from_secs_f64(s)),
            Some(s) => {
                return Err(PyValueError::new_err(format!(
                    "control_timeout={s}: give a positive number of seconds (at most a day), or None"
                )))
            }
        };
        let name = name.or_else(|| {
            let argv0 = py.import("sys").ok()?.getattr("argv").ok()?.get_item(0).ok()?;
            let argv0: String = argv0.extract().ok()?;
            let base = std::path::Path::new(&argv0).file_name()?.to_string_lossy().into_owned();
            // Made into what the daemon accepts, with `.rank<N>` for a rank of an MPI or Slurm
            // job (an explicit name that is too long is refused).
            (!base.is_empty()).then(|| agora::default_session_name(&format!("python:{base}")))
        });
        let options = SessionOptions {
            socket,
            name,
            heap_bytes,
            control_timeout,
            reconnect_timeout,
        };
        let session = crate::errors::interruptible(py, || agora::Session::connect_with(options)).or_raise()?;
        Ok(PySession {
            inner: Mutex::new(Some(session)),
            liveness: Liveness::default(),
        })
    }

    /// Session id given by the daemon.
    #[getter]
    fn id(&self) -> PyResult<u64> {
        Ok(self.session()?.id())
    }

    /// How many times the session resumed on a restarted daemon.
    #[getter]
    fn resumes(&self) -> PyResult<u64> {
        Ok(self.session()?.resumes())
    }

    /// How many tasks the session issued again on a restarted daemon because the one that died
    /// never took them (they complete as if nothing happened, instead of raising
    /// DaemonRestartedError).
    #[getter]
    fn tasks_reissued(&self) -> PyResult<u64> {
        Ok(self.session()?.tasks_reissued())
    }

    /// Creates a queue: an ordered stream of tasks, bound to no device. `sla_ms`: the
    /// response-time target of a latency-class queue's tasks (the daemon's default when None).
    #[pyo3(signature = (name="", queue_class="batch", device=None, sla_ms=None))]
    fn queue(
        &self,
        py: Python<'_>,
        name: &str,
        queue_class: &str,
        device: Option<&str>,
        sla_ms: Option<f64>,
    ) -> PyResult<PyQueue> {
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
        let queue = crate::errors::interruptible(py, || session.queue_with(options)).or_raise()?;
        Ok(PyQueue {
            inner: Mutex::new(Some(Arc::new(queue))),
            session,
            liveness: self.liveness.clone(),
            kernels: Mutex::new(HashMap::new()),
        })
    }

    /// Allocates a buffer of `nbytes` bytes (zeroed) in the session's shared memory.
    fn buffer(&self, py: Python<'_>, nbytes: u64) -> PyResult<PyBuffer> {
        if nbytes == 0 {
            return Err(PyValueError::new_err("buffers must be at least 1 byte long"));
        }
        let session = self.session()?;
        let buffer = crate::errors::interruptible(py, || session.buffer(nbytes)).or_raise()?;
        Ok(PyBuffer::new(buffer, self.liveness.clone()))
    }

    /// Allocates a buffer holding a copy of `array` (anything NumPy can turn into an array); the
    /// buffer remembers its dtype and shape, so `numpy()` views it the same way.
    fn buffer_from(&self, py: Python<'_>, array: &Bound<'_, PyAny>) -> PyResult<Py<PyBuffer>> {
        let numpy = py.import("numpy")?;
        let array = numpy.call_method1("ascontiguousarray", (array,))?;
        crate::buffer::check_byte_order(&array.getattr("dtype")?, "the array")?;
        let nbytes: u64 = array.getattr("nbytes")?.extract()?;
        if nbytes == 0 {
            return Err(PyValueError::new_err("cannot make a buffer from an empty array"));
        }
        let mut buffer = self.buffer(py, nbytes)?;
        buffer.dtype = Some(array.getattr("dtype")?.unbind());
        buffer.shape = Some(array.getattr("shape")?.unbind());
        let buffer = Py::new(py, buffer)?;
        let view = PyBuffer::numpy(buffer.bind(py).borrow(), py, None, None)?;
        numpy.call_method1("copyto", (&view, &array))?;
        Ok(buffer)
    }

    /// Allocates an exportable buffer of `nbytes` bytes (zeroed): like `buffer()`, but its memory
    /// is a region of its own that `export()` can hand to other processes. With `dtype` (and
    /// `shape`), `nbytes` is computed and `numpy()` views it that way.
    #[pyo3(signature = (nbytes=None, *, dtype=None, shape=None))]
    fn shared_buffer(
        &self,
        py: Python<'_>,
        nbytes: Option<u64>,
        dtype: Option<&Bound<'_, PyAny>>,
        shape: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<PyBuffer> {
        let numpy = py.import("numpy")?;
        let dtype = dtype.map(|d| numpy.call_method1("dtype", (d,))).transpose()?;
        if let Some(dtype) = &dtype {
            crate::buffer::check_byte_order(dtype, "dtype")?;
        }
        let nbytes = match (nbytes, &dtype, shape) {
            (Some(n), _, _) => n,
            (None, Some(dtype), Some(shape)) => {
                let elements: u64 = numpy.call_method1("prod", (shape,))?.extract()?;
                let itemsize: u64 = dtype.getattr("itemsize")?.extract()?;
                elements * itemsize
            }
            _ => return Err(PyValueError::new_err("give nbytes, or dtype and shape")),
        };
        if nbytes == 0 {
            return Err(PyValueError::new_err("buffers must be at least 1 byte long"));
        }
        let session = self.session()?;
        let buffer = crate::errors::interruptible(py, || session.shared_buffer(nbytes)).or_raise()?;
        let mut buffer = PyBuffer::new(buffer, self.liveness.clone());
        buffer.dtype = dtype.map(|d| d.unbind());
        buffer.shape = shape.map(|s| s.clone().unbind());
        Ok(buffer)
    }

    /// Publishes an exportable buffer under `name` (XEMEM's make): sessions of this user, of the
    /// `uids` and of the `gids` given can `attach(name)` it, zero-copy. `writable`: attachers may
    /// attach read-write; otherwise no attacher can ever write it. The export ends with
    /// `revoke(name)`, with the buffer's release, or with this session.
    #[pyo3(signature = (buffer, name, *, uids=Vec::new(), gids=Vec::new(), writable=false))]
    fn export(
        &self,
        py: Python<'_>,
        buffer: &crate::buffer::PyBuffer,
        name: &str,
        uids: Vec<u32>,
        gids: Vec<u32>,
        writable: bool,
    ) -> PyResult<()> {
        let session = self.session()?;
        let b = buffer.handle()?;
        let readers = agora::ExportReaders { uids, gids };
        crate::errors::interruptible(py, || session.export(&b, name, &readers, writable)).or_raise()
    }

    /// Withdraws the export `name`: nobody new can attach, and attachers' tasks on it raise
    /// AttachmentError (their NumPy views stay readable). Returns the sessions that were attached.
    fn revoke(&self, py: Python<'_>, name: &str) -> PyResult<Vec<u64>> {
        let session = self.session()?;
        crate::errors::interruptible(py, || session.revoke(name)).or_raise()
    }

    /// Attaches the export `name`: a buffer backed by the exporter's memory (no copy), usable
    /// as a kernel argument; `numpy(dtype, shape)` views it in place (read-only unless
    /// `writable`, which the export must allow).
    #[pyo3(signature = (name, *, writable=false, dtype=None, shape=None))]
    fn attach(
        &self,
        py: Python<'_>,
        name: &str,
        writable: bool,
        dtype: Option<&Bound<'_, PyAny>>,
        shape: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<PyBuffer> {
        let session = self.session()?;
        let dtype = match dtype {
            Some(d) => Some(py.import("numpy")?.call_method1("dtype", (d,))?.unbind()),
            None => None,
        };
        let buffer = crate::errors::interruptible(py, || session.attach(name, writable)).or_raise()?;
        let mut buffer = PyBuffer::new(buffer, self.liveness.clone());
        buffer.dtype = dtype;
        buffer.shape = shape.map(|s| s.clone().unbind());
        Ok(buffer)
    }

    /// The exports this user may see, as a list of dicts (`name`, `session`, `client`, `uid`,
    /// `len`, `writable`, `readers`, `attachers`, `attaches`).
    fn exports(&self, py: Python<'_>) -> PyResult<Py<PyAny>> {
        let session = self.session()?;
        let list = crate::errors::interruptible(py, || session.exports()).or_raise()?;
        to_dict(py, serde_json::to_string(&list))
    }

    /// Starts a real-time DAG named `name`, released every `period` seconds (its end-to-end
    /// deadline is the period unless `deadline()` says otherwise): add nodes (kernel launches)
    /// and edges to the builder, then `declare()` it for admission.
    fn dag(&self, name: &str, period: f64) -> PyResult<PyDagBuilder> {
        let period = crate::dag::duration("period", period)?;
        Ok(PyDagBuilder::new(
            self.session()?,
            self.liveness.clone(),
            name.to_string(),
            period,
        ))
    }

    /// Looks a kernel up by name.
    fn kernel(&self, py: Python<'_>, name: &str) -> PyResult<PyKernel> {
        let session = self.session()?;
        let kernel = crate::errors::interruptible(py, || session.kernel(name)).or_raise()?;
        Ok(PyKernel { inner: kernel })
    }

    /// Builds a program from your own code; its kernels run in this session's sandboxed executor
    /// process and are launched like the built-in ones (`queue.launch(program.name, ...)`).
    ///
    /// `program(source)`: OpenCL C source (the signatures come from the compiler; a `manifest`
    /// may add size rules). `program(source, language="cuda", manifest=...)`: CUDA C source
    /// with `extern "C" __global__` kernels; `program(source, language="ptx", manifest=...)`:
    /// PTX text. Both need a manifest (`[kernels.NAME]` tables: params, sizes, and
    /// `cuda = { entry = "..." }` when the function's name differs), run only on NVIDIA GPUs,
    /// fenced into this session's memory, one thread per work item (a daemon without such a
    /// GPU builds them, and a launch raises NoDeviceError; CUDA C needs NVRTC on the node, and
    /// without it raises BadRequestError). `program(library=...,
    /// manifest=...)`: a C shared object (bytes or a path) exporting `agora_kernel.h`
    /// functions, described by a manifest. A build that fails raises `ProgramBuildError` with
    /// the compiler's log (or the fence's refusal: the line and why).
    #[pyo3(signature = (source=None, *, language="opencl", library=None, manifest=None))]
    fn program(
        &self,
        py: Python<'_>,
        source: Option<&str>,
        language: &str,
        library: Option<&Bound<'_, PyAny>>,
        manifest: Option<&str>,
    ) -> PyResult<PyProgram> {
        let session = self.session()?;
        let program = match (source, library) {
            (Some(source), None) => {
                let source = source.to_string();
                let manifest = manifest.map(str::to_string);
                match language {
                    "opencl" => crate::errors::interruptible(py, || match manifest {
                        Some(m) => session.program_opencl_with_manifest(&source, &m),
                        None => session.program_opencl(&source),
                    }),
                    "cuda" | "ptx" => {
                        let manifest = manifest.ok_or_else(|| {
                            PyValueError::new_err(format!(
                                "a '{language}' program needs a manifest ([kernels.NAME] tables: params, sizes, \
                                 cuda = {{ entry = \"...\" }} when the function's name differs; see docs/write-your-own-kernel.md)"
                            ))
                        })?;
                        crate::errors::interruptible(py, || {
                            if language == "cuda" {
                                session.program_cuda(&source, &manifest)
                            } else {
                                session.program_ptx(&source, &manifest)
                            }
                        })
                    }
                    _ => {
                        return Err(PyValueError::new_err(format!(
                            "language '{language}': source programs are OpenCL C ('opencl'), CUDA C ('cuda') or PTX ('ptx'); \
                             pass a C shared object as library=..."
                        )))
                    }
                }
            }
            (None, Some(library)) => {
                let bytes: Vec<u8> = if let Ok(b) = library.extract::<Vec<u8>>() {
                    b
                } else {
                    let path: std::path::PathBuf = library.extract().map_err(|_| {
                        PyValueError::new_err("library must be the shared object's bytes or its path")
                    })?;
                    std::fs::read(&path).map_err(|e| {
                        PyValueError::new_err(format!("cannot read the library {}: {e}", path.display()))
                    })?
                };
                let manifest = manifest
                    .ok_or_else(|| {
                        PyValueError::new_err(
                            "a C library needs a manifest ([kernels.NAME] tables: params, sizes, cpu.symbol; see docs/KERNELS.md)",
                        )
                    })?
                    .to_string();
                crate::errors::interruptible(py, || session.program_library(&bytes, &manifest))
            }
            _ => {
                return Err(PyValueError::new_err(
                    "give either source (program(source), OpenCL C; language=\"cuda\" or \"ptx\" with manifest=...) \
                     or a C library (program(library=..., manifest=...))",
                ))
            }
        }
        .or_raise()?;
        Ok(PyProgram { inner: program })
    }

    /// Signatures of every kernel the daemon offers (name, params, doc).
    fn kernels(&self, py: Python<'_>) -> PyResult<Vec<Py<PyDict>>> {
        let session = self.session()?;
        let signatures = crate::errors::interruptible(py, || session.kernels()).or_raise()?;
        signatures.iter().map(|s| signature_dict(py, s)).collect()
    }

    /// The daemon's status summary as a dict: counters, devices and lanes, and the busiest
    /// sessions (`live_sessions` counts them all), each with its busiest queues (`queue_count`
    /// counts them all). `session_status()` has every queue of one session. On a daemon that
    /// keeps each user's sessions private, `private` is `{uid, sessions}` and the sessions,
    /// uids, jobs and DAGs listed are yours only (else `private` is None).
    fn status(&self, py: Python<'_>) -> PyResult<Py<PyAny>> {
        let session = self.session()?;
        let report = crate::errors::interruptible(py, || session.status()).or_raise()?;
        to_dict(py, serde_json::to_string(&report))
    }

    /// Protects `buffer` under `id` for checkpoints (FTI's protect): every later
    /// `queue.checkpoint()` of this session saves it and `recover()` restores it. The
    /// checkpoints belong to the application named by the session's `name` and the user.
    fn protect(&self, py: Python<'_>, id: &Bound<'_, PyAny>, buffer: &crate::buffer::PyBuffer) -> PyResult<()> {
        let id = crate::queue::int_argument(
            id,
            "protected id",
            0,
            u64::from(u32::MAX),
            "protected ids are unsigned 32-bit numbers",
        )? as u32;
        let session = self.session()?;
        let b = buffer.handle()?;
        crate::errors::interruptible(py, || session.protect(id, &b)).or_raise()
    }

    /// Restores every protected buffer from the application's newest intact checkpoint (FTI's
    /// recover) and returns what it used as a dict (`checkpoint`, `level`, `restored`, `skipped`:
    /// damaged newer checkpoints passed over). Raises CheckpointError when there is none.
    fn recover(&self, py: Python<'_>) -> PyResult<Py<PyAny>> {
        let session = self.session()?;
        let report = crate::errors::interruptible(py, || session.recover()).or_raise()?;
        to_dict(py, serde_json::to_string(&report))
    }

    /// The application's complete checkpoints (oldest first) and its last writes, as a dict.
    fn checkpoints(&self, py: Python<'_>) -> PyResult<Py<PyAny>> {
        let session = self.session()?;
        let report = crate::errors::interruptible(py, || session.checkpoints()).or_raise()?;
        to_dict(py, serde_json::to_string(&report))
    }

    /// One live session (default: this one) with all its queues, as a dict.
    #[pyo3(signature = (session_id=None))]
    fn session_status(&self, py: Python<'_>, session_id: Option<u64>) -> PyResult<Py<PyAny>> {
        let session = self.session()?;
        let id = session_id.unwrap_or_else(|| session.id());
        let details = crate::errors::interruptible(py, || session.session_status(id)).or_raise()?;
        to_dict(py, serde_json::to_string(&details))
    }

    /// Closes the session: the daemon ends it at once (its heap quota, queues and device memory
    /// are free for others, whatever objects of it this program still holds), and from now on
    /// every call on it and on its queues, buffers and tasks raises ClosedError. NumPy arrays
    /// already viewing its buffers stay readable: the memory stays mapped in this process until
    /// they are garbage collected. Closing twice does nothing.
    fn close(&self) {
        self.liveness.close();
        if let Some(session) = self.inner.lock().unwrap_or_else(|e| e.into_inner()).take() {
            session.end();
        }
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

/// A report as Python dicts and lists (through JSON).
fn to_dict(py: Python<'_>, json: serde_json::Result<String>) -> PyResult<Py<PyAny>> {
    let text = json.map_err(|e| ProtocolError::new_err(e.to_string()))?;
    Ok(py.import("json")?.call_method1("loads", (text,))?.unbind())
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
