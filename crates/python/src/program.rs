//! `agora.Program`: a tenant program built by the daemon from the session's own code (OpenCL C
//! source, or a C shared object with a manifest). Its kernels run in the session's sandboxed
//! executor process and are launched like the built-in ones: `queue.launch(program.name, ...)`.

use pyo3::exceptions::PyAttributeError;
use pyo3::prelude::*;

use crate::kernel::PyKernel;

/// A program built from the session's own code; its kernels are attributes
/// (`program.saxpy`) and items (`program["saxpy"]`).
#[pyclass(module = "agora._native", name = "Program", frozen)]
pub(crate) struct PyProgram {
    pub(crate) inner: agora::Program,
}

#[pymethods]
impl PyProgram {
    /// The kernels' names.
    #[getter]
    fn names(&self) -> Vec<String> {
        self.inner.kernels().iter().map(|k| k.name().to_string()).collect()
    }

    /// The compiler's log (warnings), possibly empty.
    #[getter]
    fn log(&self) -> &str {
        self.inner.build_log()
    }

    /// Whether the daemon took the build from its program cache.
    #[getter]
    fn cached(&self) -> bool {
        self.inner.cached()
    }

    /// The kernel `name`.
    fn kernel(&self, name: &str) -> PyResult<PyKernel> {
        match self.inner.kernel(name) {
            Some(kernel) => Ok(PyKernel { inner: kernel.clone() }),
            None => Err(PyAttributeError::new_err(format!(
                "the program has no kernel '{name}'; it has: {}",
                self.names().join(", ")
            ))),
        }
    }

    fn __getattr__(&self, name: &str) -> PyResult<PyKernel> {
        self.kernel(name)
    }

    fn __getitem__(&self, name: &str) -> PyResult<PyKernel> {
        self.kernel(name)
    }

    fn __dir__(&self) -> Vec<String> {
        let mut names = self.names();
        names.extend(["names", "log", "cached", "kernel"].map(String::from));
        names
    }

    fn __repr__(&self) -> String {
        format!("<agora.Program kernels: {}>", self.names().join(", "))
    }
}
