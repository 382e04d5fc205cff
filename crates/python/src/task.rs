//! `agora.Task`: an issued task. Owns the client task handle; `wait()` and `done()` report its
//! outcome, every time they are asked.

use std::sync::Mutex;

use pyo3::prelude::*;

use crate::errors::OrRaise;

/// An issued task.
#[pyclass(module = "agora._native", name = "Task")]
pub(crate) struct PyTask {
    pub(crate) id: u64,
    /// `None` once waited for.
    pub(crate) inner: Mutex<Option<agora::Task>>,
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
