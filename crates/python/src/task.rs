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
        while !py.detach(|| task.wait_timeout(WAIT_SLICE)).or_raise()? {
            py.check_signals()?;
        }
        Ok(())
    }

    /// Whether the task has completed, without blocking.
    fn done(&self) -> PyResult<bool> {
        self.liveness.check("task")?;
        self.task.is_complete().or_raise()
    }

    fn __repr__(&self) -> String {
        format!("<agora.Task {}>", self.task.id())
    }
}
