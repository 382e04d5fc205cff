//! `agora.Kernel`: a kernel of the daemon (its library or a kernel package), looked up by name,
//! or of one of the session's programs; read-only data (name, doc, parameters) around the
//! client's kernel.

use pyo3::prelude::*;

/// A kernel: of the daemon (`session.kernel(name)`) or of a program (`program.name`).
#[pyclass(module = "agora._native", name = "Kernel", frozen)]
pub(crate) struct PyKernel {
    pub(crate) inner: agora::Kernel,
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
