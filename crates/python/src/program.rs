//! `agora.Program`: a tenant program built by the daemon from the session's own code (OpenCL C
//! source, or a C shared object with a manifest). Its kernels run in the session's sandboxed
//! executor process and are launched like the built-in ones: `queue.launch(program.name, ...)`.

use pyo3::exceptions::{PyAttributeError, PyKeyError};
use pyo3::prelude::*;

use crate::kernel::PyKernel;

/// A program built from the session's own code; its kernels are attributes
/// (`program.saxpy`) and items (`program["saxpy"]`). The session holds it while this object or
/// one of its kernels lives; `del` of the last gives it back (its slot under `[programs]
/// max_per_session`, which counts programs held at once, is free). The same source built again
/// while held is this program (`cached` is True).
#[pyclass(module = "agora._native", name = "Program", frozen)]
pub(crate) struct PyProgram {
    pub(crate) inner: agora::Program,
}

impl PyProgram {
    /// The message for a kernel name the program does not have.
    fn no_kernel(&self, name: &str) -> String {
        format!(
            "the program has no kernel '{name}'; it has: {}",
            self.names().join(", ")
        )
    }
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

    /// The kernel `name`; `KeyError` when the program has none of that name (as
    /// `program[name]`; `program.name` raises `AttributeError`, as attribute access must).
    fn kernel(&self, name: &str) -> PyResult<PyKernel> {
        self.inner
            .kernel(name)
            .map(|kernel| PyKernel { inner: kernel })
            .ok_or_else(|| PyKeyError::new_err(self.no_kernel(name)))
    }

    fn __getattr__(&self, name: &str) -> PyResult<PyKernel> {
        self.inner
            .kernel(name)
            .map(|kernel| PyKernel { inner: kernel })
            .ok_or_else(|| PyAttributeError::new_err(self.no_kernel(name)))
    }

    fn __getitem__(&self, name: &str) -> PyResult<PyKernel> {
        self.kernel(name)
    }

    fn __contains__(&self, name: &str) -> bool {
        self.inner.kernel(name).is_some()
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
