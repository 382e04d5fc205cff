//! `agora.Task`: an issued task. Owns the client task handle; `wait()` and `done()` report its
//! outcome, every time they are asked.

use std::time::Duration;

use pyo3::prelude::*;

use crate::errors::{Liveness, OrRaise};

/// How long a wait runs without the GIL before it checks for signals (Ctrl-C).
pub(crate) const WAIT_SLICE: Duration = Duration::from_millis(50);

/// An issued task.
#[pyclass(module = "agora._native", name = "Task", frozen)]
pub(crate) struct PyTask {
    pub(crate) task: agora::Task,
    pub(crate) liveness: Liveness,
}

#[pymethods]
impl PyTask {
    /// Task id within the session.
    #[getter]
    fn id(&self) -> u64 {
        self.task.id()
    }

    /// Blocks (without holding the GIL) until the task completes; raises its error if it
    /// failed — every time it is asked. Ctrl-C (any signal whose handler raises) interrupts the
    /// wait at once and leaves the task running; wait again, or `done()`, later.
    fn wait(&self, py: Python<'_>) -> PyResult<()> {
        self.liveness.check("task")?;
        let task = &self.task;
        while !crate::errors::interruptible(py, || task.wait_timeout(WAIT_SLICE)).or_raise()? {
            py.check_signals()?;
        }
        Ok(())
    }

    /// Whether the task has completed, without blocking.
    fn done(&self) -> PyResult<bool> {
        self.liveness.check("task")?;
        self.task.is_complete().or_raise()
    }

    /// `await task` in a coroutine: suspends it, not the event loop, until the task completes;
    /// raises the task's error if it failed. One thread per session waits for all the session's
    /// awaited tasks (`agora._aio`). Cancelling the coroutine leaves the task running.
    fn __await__(slf: Bound<'_, Self>) -> PyResult<Bound<'_, PyAny>> {
        slf.get().liveness.check("task")?;
        let py = slf.py();
        py.import("agora._aio")?.getattr("await_task")?.call1((slf,))
    }

    /// Calls `callback(task)` once the task completes, on the session's waiting thread (the
    /// one `await` uses; never the caller's, even when the task is already complete): inside,
    /// `task.wait()` returns or raises its outcome at once. Callbacks of one session run one after
    /// another, so one that blocks delays the others; an exception in one is logged (logger
    /// `agora`) and the others still run. A callback pending when its session is closed runs
    /// then, and `task.wait()` inside raises `ClosedError`.
    fn add_done_callback(slf: Bound<'_, Self>, callback: Bound<'_, PyAny>) -> PyResult<()> {
        slf.get().liveness.check("task")?;
        let py = slf.py();
        py.import("agora._aio")?
            .getattr("add_done_callback")?
            .call1((slf, callback))?;
        Ok(())
    }

    /// How many completions this process has taken from the task's session so far (for
    /// `agora._aio`'s waiting thread).
    fn _completions_seen(&self) -> PyResult<u64> {
        self.liveness.check("task")?;
        Ok(self.task.completions_seen())
    }

    /// Blocks (GIL released) at most about `timeout` seconds until the session's completions
    /// taken pass `seen`: whether any task of the session completed meanwhile.
    fn _wait_for_completions(&self, py: Python<'_>, seen: u64, timeout: f64) -> PyResult<bool> {
        self.liveness.check("task")?;
        let timeout = Duration::try_from_secs_f64(timeout.max(0.0)).unwrap_or(WAIT_SLICE);
        let task = &self.task;
        crate::errors::interruptible(py, || task.wait_for_completions(seen, timeout)).or_raise()
    }

    /// The same number for every task of one session (for per-session state in `agora._aio`).
    fn _session_key(&self) -> usize {
        self.task.session_key()
    }

    fn __repr__(&self) -> String {
        format!("<agora.Task {}>", self.task.id())
    }
}
