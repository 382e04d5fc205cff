//! `agora.Queue`: an ordered stream of tasks. Owns the client queue, the conversion of Python
//! launch arguments (checked against the kernel's signature before anything is issued) and the
//! kernels it looked up by name.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use agora::{Arg, Error};
use agora_protocol::{ParamKind, ScalarType};
use pyo3::exceptions::{PyTypeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::PyTuple;

use crate::buffer::{check_element_type, PyBuffer};
use crate::errors::{closed, ArgumentCountError, ArgumentTypeError, Liveness, OrRaise};
use crate::kernel::PyKernel;
use crate::task::{PyTask, WAIT_SLICE};

/// An ordered stream of tasks, bound to no device.
#[pyclass(module = "agora._native", name = "Queue")]
pub(crate) struct PyQueue {
    /// Shared with a `finish()` in progress, which must not hold the lock while it waits
    /// (another thread's `launch` takes it while holding the GIL).
    pub(crate) inner: Mutex<Option<Arc<agora::Queue>>>,
    pub(crate) session: agora::Session,
    pub(crate) liveness: Liveness,
    /// Kernels launched by name, looked up once.
    pub(crate) kernels: Mutex<HashMap<String, agora::Kernel>>,
}

impl PyQueue {
    /// The client queue, unless this queue or its session was closed.
    fn queue(&self) -> PyResult<Arc<agora::Queue>> {
        self.liveness.check("queue")?;
        let guard = self.inner.lock().unwrap_or_else(|e| e.into_inner());
        guard.clone().ok_or_else(|| closed("queue"))
    }

    /// Issues a task with `f`. Waiting for room in the rings (the daemon is behind) goes
    /// without the GIL and in slices, so other threads run and Ctrl-C interrupts it.
    pub(crate) fn issue(
        &self,
        py: Python<'_>,
        f: impl FnOnce(&agora::Queue) -> Result<agora::Task, Error> + Send,
    ) -> PyResult<PyTask> {
        let queue = self.queue()?;
        let session = &self.session;
        while !crate::errors::interruptible(py, || session.wait_for_room(WAIT_SLICE)).or_raise()? {
            py.check_signals()?;
        }
        // Another thread may have taken the room meanwhile: then this waits, still without
        // the GIL, and a signal handler that raises (Ctrl-C) ends the wait with its exception,
        // nothing issued.
        let task = crate::errors::interruptible(py, || f(&queue)).or_raise()?;
        Ok(PyTask {
            task,
            liveness: self.liveness.clone(),
        })
    }
}

/// A scalar argument converted to the type the kernel's signature declares.
fn scalar(value: &Bound<'_, PyAny>, ty: ScalarType, index: usize, name: &str, kernel: &str) -> PyResult<Arg<'static>> {
    // "an f32", "an i32", "a u32", as the type names are read.
    let article = if ty.name().starts_with('u') { "a" } else { "an" };
    let wrong = |what: &str| {
        ArgumentTypeError::new_err(format!(
            "argument {index} ('{name}') of {kernel} is {article} {} scalar; got {what}",
            ty.name()
        ))
    };
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

/// `value` as an integer in `min..=max`, or a ValueError naming `what`, the value, the range
/// and `hint` (a TypeError for a value that is not an integer).
pub(crate) fn int_argument(value: &Bound<'_, PyAny>, what: &str, min: u64, max: u64, hint: &str) -> PyResult<u64> {
    let n: i128 = value.extract()?;
    if n < i128::from(min) || n > i128::from(max) {
        return Err(PyValueError::new_err(format!(
            "{what} {n} is out of range ({min} to {max}): {hint}"
        )));
    }
    Ok(n as u64)
}

pub(crate) fn parse_range(range: &Bound<'_, PyAny>) -> PyResult<agora::NdRange> {
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
    ///
    /// `rows=(first, end)` runs only those rows of the range's first dimension (a row window;
    /// chunkable kernels only): the kernel still sees the whole range.
    #[pyo3(signature = (kernel, *args, range, rows=None))]
    fn launch(
        &self,
        kernel: &Bound<'_, PyAny>,
        args: &Bound<'_, PyTuple>,
        range: &Bound<'_, PyAny>,
        rows: Option<(u64, u64)>,
    ) -> PyResult<PyTask> {
        let mode = match rows {
            Some((first, end)) => LaunchMode::Rows(first..end),
            None => LaunchMode::Whole,
        };
        self.launch_with(kernel, args, range, mode)
            .map(|task| task.expect("a launch issues a task"))
    }

    /// A long chunkable launch with a checkpoint of the session's protected buffers after every
    /// `window_rows` rows (FTI's partial-task checkpoints): checkpoint ids `first_checkpoint`,
    /// `first_checkpoint + 1`, ... After a crash, protect the same buffers, `recover()`, and call
    /// this again with `resume_after` = the recovered checkpoint: only the later windows run.
    /// Returns the last task (None when nothing was left to run).
    #[pyo3(signature = (kernel, *args, range, window_rows, first_checkpoint, level=1, resume_after=None))]
    #[allow(clippy::too_many_arguments)]
    fn launch_checkpointed(
        &self,
        kernel: &Bound<'_, PyAny>,
        args: &Bound<'_, PyTuple>,
        range: &Bound<'_, PyAny>,
        window_rows: u64,
        first_checkpoint: u64,
        level: u32,
        resume_after: Option<u64>,
    ) -> PyResult<Option<PyTask>> {
        let level = agora::CheckpointLevel::from_number(level).ok_or_else(|| {
            PyValueError::new_err(format!(
                "checkpoint level {level}: levels are 1 (local), 2 (partner), 3 (erasure coded) and 4 (shared)"
            ))
        })?;
        let plan = agora::CheckpointedLaunch {
            window_rows,
            first_checkpoint,
            level,
            resume_after,
        };
        self.launch_with(kernel, args, range, LaunchMode::Checkpointed(plan))
    }

    /// Makes the devices see the buffer's host copy (call after writing it).
    fn sync_to(&self, py: Python<'_>, buffer: &PyBuffer) -> PyResult<PyTask> {
        let b = buffer.handle()?;
        self.issue(py, |q| q.sync_to(&b))
    }

    /// Makes the host copy current (read it after this task completes).
    fn sync_from(&self, py: Python<'_>, buffer: &PyBuffer) -> PyResult<PyTask> {
        let b = buffer.handle()?;
        self.issue(py, |q| q.sync_from(&b))
    }

    /// Checkpoints the session's protected buffers (FTI's checkpoint) as a task of this queue:
    /// after the queue's earlier tasks, it captures the buffers' current contents and completes;
    /// the daemon writes them in the background at `level` (1 local, 2 also the partner
    /// directory, 3 erasure coded, 4 also the shared file system), writing only blocks that
    /// changed. `id` must grow from one checkpoint to the next (the iteration number, say).
    #[pyo3(signature = (id, level=None))]
    fn checkpoint(&self, py: Python<'_>, id: &Bound<'_, PyAny>, level: Option<&Bound<'_, PyAny>>) -> PyResult<PyTask> {
        // Checked here, as ValueErrors naming the argument: id 0 would otherwise surface as a
        // TaskFailedError for a task that was never issued, a negative one as a bare
        // OverflowError.
        let id = int_argument(
            id,
            "checkpoint id",
            1,
            u64::MAX,
            "ids start at 1 (0 means \"no checkpoint\"); use e.g. the number of iterations done",
        )?;
        let level = match level {
            None => 1,
            Some(level) => int_argument(
                level,
                "checkpoint level",
                1,
                4,
                "levels are 1 (local), 2 (partner), 3 (erasure coded) and 4 (shared)",
            )? as u32,
        };
        let level = agora::CheckpointLevel::from_number(level).ok_or_else(|| {
            pyo3::exceptions::PyValueError::new_err(format!(
                "checkpoint level {level}: levels are 1 (local), 2 (partner), 3 (erasure coded) and 4 (shared)"
            ))
        })?;
        self.issue(py, |q| q.checkpoint(id, level))
    }

    /// FTI's snapshot: call it every iteration; once the daemon's checkpoint interval
    /// (`[checkpoint] interval_s`) has passed since the last one (or the first `protect`), it
    /// issues a level-1 checkpoint and returns its task, else None. The daemon numbers it: the
    /// id after the application's newest checkpoint, so it mixes with explicit checkpoint(id)
    /// calls; it counts checkpoints, not iterations.
    fn snapshot(&self, py: Python<'_>) -> PyResult<Option<PyTask>> {
        let queue = self.queue()?;
        let task = crate::errors::interruptible(py, || queue.snapshot()).or_raise()?;
        Ok(task.map(|task| PyTask {
            task,
            liveness: self.liveness.clone(),
        }))
    }

    /// Sets every byte of `buffer` to `value`.
    #[pyo3(signature = (buffer, value=0))]
    fn memset(&self, py: Python<'_>, buffer: &PyBuffer, value: i64) -> PyResult<PyTask> {
        // Taken as any int so that a value out of a byte's range gets a message naming it, not
        // pyo3's bare "out of range integral type conversion".
        let value = u8::try_from(value).map_err(|_| {
            pyo3::exceptions::PyValueError::new_err(format!(
                "memset value={value}: give a byte value, 0 to 255 (every byte of the buffer is set to it)"
            ))
        })?;
        let b = buffer.handle()?;
        self.issue(py, |q| q.memset(&b, value))
    }

    /// Copies `nbytes` bytes (0: all of `src` from `src_offset`) from `src` to `dst`.
    #[pyo3(signature = (src, dst, src_offset=0, dst_offset=0, nbytes=0))]
    #[allow(clippy::too_many_arguments)]
    fn copy(
        &self,
        py: Python<'_>,
        src: &PyBuffer,
        dst: &PyBuffer,
        src_offset: u64,
        dst_offset: u64,
        nbytes: u64,
    ) -> PyResult<PyTask> {
        let (s, d) = (src.handle()?, dst.handle()?);
        self.issue(py, |q| q.copy(&s, src_offset, &d, dst_offset, nbytes))
    }

    /// Waits (without holding the GIL) for every task issued so far; raises when any task issued
    /// since the previous `finish()` failed: the exception has the class of the earliest failure,
    /// `count` (how many failed) and `failures` (`[(task_id, exception), ...]`). Ctrl-C
    /// interrupts the wait at once, leaving the tasks running (and their failures for the next
    /// `finish()`).
    fn finish(&self, py: Python<'_>) -> PyResult<()> {
        let queue = self.queue()?;
        while !crate::errors::interruptible(py, || queue.finish_timeout(WAIT_SLICE)).or_raise()? {
            py.check_signals()?;
        }
        Ok(())
    }

    /// Releases the queue (after its issued tasks). Closing a closed queue does nothing.
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
            Some(_) if self.liveness.is_closed() => "<agora.Queue closed>".to_string(),
            Some(q) => format!("<agora.Queue {:#x}>", q.handle()),
            None => "<agora.Queue closed>".to_string(),
        }
    }
}

/// What `launch_with` issues.
enum LaunchMode {
    Whole,
    Rows(std::ops::Range<u64>),
    Checkpointed(agora::CheckpointedLaunch),
}

impl PyQueue {
    /// Checks and borrows a launch's arguments, then issues it as `mode` says.
    fn launch_with(
        &self,
        kernel: &Bound<'_, PyAny>,
        args: &Bound<'_, PyTuple>,
        range: &Bound<'_, PyAny>,
        mode: LaunchMode,
    ) -> PyResult<Option<PyTask>> {
        self.liveness.check("queue")?;
        let kernel: agora::Kernel = if let Ok(k) = kernel.cast::<PyKernel>() {
            k.get().inner.clone()
        } else if let Ok(name) = kernel.extract::<String>() {
            // Not locked while the lookup waits for the daemon without the GIL: a thread that
            // holds the GIL and launches by name meanwhile would wait for this lock, and this
            // thread for the GIL (a deadlock, met by callbacks launching on the await thread).
            let cached = self
                .kernels
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .get(&name)
                .cloned();
            match cached {
                Some(k) => k,
                None => {
                    let session = &self.session;
                    let k = crate::errors::interruptible(args.py(), || session.kernel(&name)).or_raise()?;
                    self.kernels
                        .lock()
                        .unwrap_or_else(|e| e.into_inner())
                        .insert(name, k.clone());
                    k
                }
            }
        } else {
            return Err(PyTypeError::new_err(
                "kernel must be a Kernel (session.kernel(name)) or a kernel name",
            ));
        };
        let range = parse_range(range)?;
        let items: Vec<Bound<'_, PyAny>> = args.iter().collect();
        with_launch_args(&kernel, &items, |call| match mode {
            LaunchMode::Whole => self.issue(args.py(), |q| q.launch(&kernel, call, range)).map(Some),
            LaunchMode::Rows(rows) => self
                .issue(args.py(), |q| q.launch_rows(&kernel, call, range, rows))
                .map(Some),
            LaunchMode::Checkpointed(plan) => {
                let queue = self.queue()?;
                let task =
                    crate::errors::interruptible(args.py(), || queue.launch_checkpointed(&kernel, call, range, &plan))
                        .or_raise()?;
                Ok(task.map(|task| PyTask {
                    task,
                    liveness: self.liveness.clone(),
                }))
            }
        })
    }
}

/// Checks a launch's arguments `items` against `kernel`'s signature (count, buffer or scalar,
/// a buffer's remembered dtype), borrows the buffers among them and calls `f` with them converted
/// (scalars to the signature's types). Shared by `Queue.launch` and `DagBuilder.node`.
pub(crate) fn with_launch_args<R>(
    kernel: &agora::Kernel,
    items: &[Bound<'_, PyAny>],
    f: impl FnOnce(&[Arg<'_>]) -> PyResult<R>,
) -> PyResult<R> {
    let params = &kernel.signature().params;
    if items.len() != params.len() {
        return Err(ArgumentCountError::new_err(format!(
            "{} takes {} arguments ({}), got {}",
            kernel.name(),
            params.len(),
            params.iter().map(|p| p.name.as_str()).collect::<Vec<_>>().join(", "),
            items.len()
        )));
    }
    // Borrow every buffer argument for the duration of `f`.
    let mut buffers: Vec<Option<PyRef<'_, PyBuffer>>> = Vec::with_capacity(items.len());
    for (index, (item, param)) in items.iter().zip(params).enumerate() {
        match param.kind {
            ParamKind::Buffer { .. } => {
                let buffer = item.cast::<PyBuffer>().map_err(|_| {
                    ArgumentTypeError::new_err(format!(
                        "argument {index} ('{}') of {} is a buffer; got {}",
                        param.name,
                        kernel.name(),
                        item.get_type().name().map(|n| n.to_string()).unwrap_or_default()
                    ))
                })?;
                let buffer = buffer.borrow();
                buffer.liveness.check("buffer")?;
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
    let handles: Vec<Arc<agora::Buffer>> = distinct.iter().map(|b| b.handle()).collect::<PyResult<_>>()?;
    let mut call: Vec<Arg<'_>> = Vec::with_capacity(items.len());
    for (index, ((item, param), slot)) in items.iter().zip(params).zip(&slots).enumerate() {
        match (param.kind, slot) {
            (ParamKind::Buffer { .. }, Some(slot)) => {
                call.push(Arg::Buffer(&handles[*slot]));
            }
            (ParamKind::Scalar(ty), _) => call.push(scalar(item, ty, index, &param.name, kernel.name())?),
            (ParamKind::Buffer { .. }, None) => unreachable!("buffer parameters were borrowed above"),
        }
    }
    f(&call)
}
