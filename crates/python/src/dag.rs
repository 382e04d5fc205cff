//! `agora.DagBuilder` and `agora.Dag`: real-time task graphs (the client's `Session::dag`).
//!
//! The Rust builder borrows its session, which a Python object cannot hold across calls, so
//! `DagBuilder` keeps the declaration itself: each node's kernel, argument objects (the buffers
//! stay alive with them) and range, checked against the kernel's signature when the node is
//! added, and builds the client's builder in `declare()`. `Dag` owns the admitted client DAG;
//! its waits go without the GIL and in slices, so Ctrl-C interrupts them.

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use pyo3::exceptions::{PyIndexError, PyTypeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyList};

use crate::errors::{closed, Liveness, OrRaise};
use crate::kernel::PyKernel;
use crate::queue::{parse_range, with_launch_args};
use crate::task::WAIT_SLICE;

/// `seconds` as a duration, or ValueError naming `what`.
pub(crate) fn duration(what: &str, seconds: f64) -> PyResult<Duration> {
    if !seconds.is_finite() || seconds < 0.0 {
        return Err(PyValueError::new_err(format!(
            "{what}={seconds}: give a non-negative number of seconds"
        )));
    }
    Duration::try_from_secs_f64(seconds)
        .map_err(|_| PyValueError::new_err(format!("{what}={seconds}: too many seconds")))
}

/// One node as declared: what `DagBuilder::node` gets in `declare()`.
struct Node {
    name: String,
    kernel: agora::Kernel,
    args: Vec<Py<PyAny>>,
    range: agora::NdRange,
    wcet: Option<Duration>,
    deadline: Option<Duration>,
}

/// A real-time DAG being declared (`session.dag(name, period)`): add nodes and edges, then
/// `declare()` it.
#[pyclass(module = "agora._native", name = "DagBuilder")]
pub(crate) struct PyDagBuilder {
    pub(crate) session: agora::Session,
    pub(crate) liveness: Liveness,
    pub(crate) name: String,
    pub(crate) period: Duration,
    nodes: Vec<Node>,
    edges: Vec<(usize, usize)>,
    deadline: Option<Duration>,
    sporadic: bool,
}

impl PyDagBuilder {
    pub(crate) fn new(session: agora::Session, liveness: Liveness, name: String, period: Duration) -> Self {
        PyDagBuilder {
            session,
            liveness,
            name,
            period,
            nodes: Vec::new(),
            edges: Vec::new(),
            deadline: None,
            sporadic: false,
        }
    }

    fn node_mut(&mut self, node: usize) -> PyResult<&mut Node> {
        let count = self.nodes.len();
        self.nodes
            .get_mut(node)
            .ok_or_else(|| PyIndexError::new_err(format!("no node {node}: the DAG has {count} nodes so far")))
    }
}

#[pymethods]
impl PyDagBuilder {
    /// Adds a node that launches `kernel` (a Kernel or its name) with `args` (a sequence of
    /// buffers and scalars, as `Queue.launch` takes them) over `range`; returns its index. The
    /// arguments are checked against the kernel's signature now.
    fn node(
        &mut self,
        py: Python<'_>,
        name: &str,
        kernel: &Bound<'_, PyAny>,
        args: &Bound<'_, PyAny>,
        range: &Bound<'_, PyAny>,
    ) -> PyResult<usize> {
        self.liveness.check("DAG builder")?;
        let kernel: agora::Kernel = if let Ok(k) = kernel.cast::<PyKernel>() {
            k.get().inner.clone()
        } else if let Ok(kernel_name) = kernel.extract::<String>() {
            let session = &self.session;
            crate::errors::interruptible(py, || session.kernel(&kernel_name)).or_raise()?
        } else {
            return Err(PyTypeError::new_err(
                "kernel must be a Kernel (session.kernel(name)) or a kernel name",
            ));
        };
        if args.is_instance_of::<pyo3::types::PyString>() {
            return Err(PyTypeError::new_err(
                "args must be a sequence of buffers and scalars, not a str",
            ));
        }
        let items: Vec<Bound<'_, PyAny>> = args
            .try_iter()
            .map_err(|_| PyTypeError::new_err("args must be a sequence of buffers and scalars"))?
            .collect::<PyResult<_>>()?;
        let range = parse_range(range)?;
        with_launch_args(&kernel, &items, |_| Ok(()))?;
        self.nodes.push(Node {
            name: name.to_string(),
            kernel,
            args: items.into_iter().map(Bound::unbind).collect(),
            range,
            wcet: None,
            deadline: None,
        });
        Ok(self.nodes.len() - 1)
    }

    /// Declares node `node`'s worst-case execution time, in seconds (else the daemon's
    /// performance model estimates it, which needs the launch to have run there before).
    fn wcet(mut slf: PyRefMut<'_, Self>, node: usize, seconds: f64) -> PyResult<PyRefMut<'_, Self>> {
        let wcet = duration("wcet", seconds)?;
        if wcet.is_zero() {
            return Err(PyValueError::new_err(format!(
                "wcet={seconds}: give the longest one run of node {node} may take, more than 0 seconds \
                 (or no wcet, and the daemon's performance model estimates it)"
            )));
        }
        slf.node_mut(node)?.wcet = Some(wcet);
        Ok(slf)
    }

    /// Fixes node `node`'s relative deadline, in seconds (deadline splitting keeps it as given).
    fn node_deadline(mut slf: PyRefMut<'_, Self>, node: usize, seconds: f64) -> PyResult<PyRefMut<'_, Self>> {
        let deadline = duration("node_deadline", seconds)?;
        slf.node_mut(node)?.deadline = Some(deadline);
        Ok(slf)
    }

    /// Node `b` starts after node `a` finished, in each release.
    fn edge(mut slf: PyRefMut<'_, Self>, a: usize, b: usize) -> PyResult<PyRefMut<'_, Self>> {
        slf.node_mut(a)?;
        slf.node_mut(b)?;
        slf.edges.push((a, b));
        Ok(slf)
    }

    /// The end-to-end deadline of each release, in seconds (default: the period).
    fn deadline(mut slf: PyRefMut<'_, Self>, seconds: f64) -> PyResult<PyRefMut<'_, Self>> {
        slf.deadline = Some(duration("deadline", seconds)?);
        Ok(slf)
    }

    /// Released only by `Dag.release()`; the period is then the least time between releases.
    fn sporadic(mut slf: PyRefMut<'_, Self>) -> PyRefMut<'_, Self> {
        slf.sporadic = true;
        slf
    }

    /// How many nodes it has so far.
    fn __len__(&self) -> usize {
        self.nodes.len()
    }

    /// Sends the DAG for admission: the admitted `Dag`, or DagError saying why it does not fit
    /// (which node, the lanes' utilisation, the WCET that would have fit), or that it has a
    /// cycle. The builder can be declared again (another DAG of the same shape).
    fn declare(&self, py: Python<'_>) -> PyResult<PyDag> {
        self.liveness.check("DAG builder")?;
        let mut builder = self.session.dag(&self.name, self.period);
        for node in &self.nodes {
            let items: Vec<Bound<'_, PyAny>> = node.args.iter().map(|a| a.bind(py).clone()).collect();
            let index = with_launch_args(&node.kernel, &items, |call| {
                builder.node(&node.name, &node.kernel, call, node.range).or_raise()
            })?;
            if let Some(wcet) = node.wcet {
                builder.wcet(index, wcet);
            }
            if let Some(deadline) = node.deadline {
                builder.node_deadline(index, deadline);
            }
        }
        for &(a, b) in &self.edges {
            builder.edge(a, b);
        }
        if let Some(deadline) = self.deadline {
            builder.deadline(deadline);
        }
        if self.sporadic {
            builder.sporadic();
        }
        let dag = crate::errors::interruptible(py, || builder.declare()).or_raise()?;
        Ok(PyDag {
            id: dag.id(),
            admission: dag.admission().clone(),
            inner: Mutex::new(Some(Arc::new(dag))),
            liveness: self.liveness.clone(),
        })
    }

    fn __repr__(&self) -> String {
        format!(
            "<agora.DagBuilder '{}' period={}s, {} nodes, {} edges{}>",
            self.name,
            self.period.as_secs_f64(),
            self.nodes.len(),
            self.edges.len(),
            if self.sporadic { ", sporadic" } else { "" }
        )
    }
}

/// An admitted real-time DAG: the daemon releases it every period (or on `release()` when
/// sporadic); `results()` reports each release. `withdraw()` (or the end of a `with` block, or
/// garbage collection) withdraws it.
#[pyclass(module = "agora._native", name = "Dag")]
pub(crate) struct PyDag {
    id: u64,
    admission: agora::DagAdmission,
    /// Shared with a call in progress, which must not hold the lock while it waits for the
    /// daemon (another thread may take it while holding the GIL).
    inner: Mutex<Option<Arc<agora::Dag>>>,
    liveness: Liveness,
}

impl PyDag {
    fn dag(&self) -> PyResult<Arc<agora::Dag>> {
        self.liveness.check("DAG")?;
        let guard = self.inner.lock().unwrap_or_else(|e| e.into_inner());
        guard.clone().ok_or_else(|| closed("DAG"))
    }
}

/// One release as a dict.
fn release_dict<'py>(py: Python<'py>, r: &agora::DagRelease) -> PyResult<Bound<'py, PyDict>> {
    let d = PyDict::new(py);
    d.set_item("release", r.release)?;
    d.set_item("response_s", r.response_ns as f64 / 1e9)?;
    d.set_item("response_ns", r.response_ns)?;
    d.set_item("met", r.met)?;
    d.set_item("jitter_s", r.jitter_ns as f64 / 1e9)?;
    d.set_item("jitter_ns", r.jitter_ns)?;
    d.set_item("handoff_s", r.handoff_ns as f64 / 1e9)?;
    d.set_item("handoff_ns", r.handoff_ns)?;
    match &r.failed {
        Some((node, message)) => d.set_item("failed", (*node, message.as_str()))?,
        None => d.set_item("failed", py.None())?,
    }
    d.set_item("overruns", r.overruns.clone())?;
    Ok(d)
}

#[pymethods]
impl PyDag {
    /// The daemon's id of this DAG.
    #[getter]
    fn id(&self) -> u64 {
        self.id
    }

    /// How it was admitted, as a dict: `lanes` (each node's lane), `wcet_ns`, `wcet_source`
    /// (`declared` or `model`), `utilisation`, `lane_utilisation`, `decided_by_bound`.
    #[getter]
    fn admission<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let a = &self.admission;
        let d = PyDict::new(py);
        d.set_item("dag", a.dag)?;
        d.set_item("lanes", a.lanes.clone())?;
        d.set_item("wcet_ns", a.wcet_ns.clone())?;
        d.set_item("wcet_source", a.wcet_source.clone())?;
        d.set_item("utilisation", a.utilisation)?;
        d.set_item("lane_utilisation", a.lane_utilisation.clone())?;
        d.set_item("decided_by_bound", a.decided_by_bound)?;
        Ok(d)
    }

    /// Releases one instance now (a sporadic activation); returns its number. DagError when it
    /// comes sooner than the period after the previous one, or the DAG was stopped.
    fn release(&self, py: Python<'_>) -> PyResult<u64> {
        let dag = self.dag()?;
        crate::errors::interruptible(py, || dag.release()).or_raise()
    }

    /// The releases finished since the previous call (oldest first), as a dict: `releases` (a
    /// list of dicts: `release`, `response_s`, `met`, `jitter_s` (due to released by the
    /// daemon's timer; 0 on request), `handoff_s` (due to first nodes handed to lanes), `failed`
    /// (None or `(node, message)`), `overruns`, and the times in nanoseconds, `response_ns`,
    /// `jitter_ns`, `handoff_ns`),
    /// `dropped` (finished but not kept), `released` (issued so far), `stopped` (None, or why the
    /// daemon stopped releasing it).
    fn results<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let dag = self.dag()?;
        let results = crate::errors::interruptible(py, || dag.results()).or_raise()?;
        let d = PyDict::new(py);
        let releases = PyList::empty(py);
        for r in &results.releases {
            releases.append(release_dict(py, r)?)?;
        }
        d.set_item("releases", releases)?;
        d.set_item("dropped", results.dropped)?;
        d.set_item("released", results.released)?;
        d.set_item("stopped", results.stopped)?;
        Ok(d)
    }

    /// Collects finished releases until `count` have arrived or `timeout_s` seconds passed;
    /// returns those that arrived (a list of dicts, as in `results()`). Ctrl-C interrupts it.
    #[pyo3(signature = (count, timeout_s=10.0))]
    fn wait_results<'py>(&self, py: Python<'py>, count: usize, timeout_s: f64) -> PyResult<Bound<'py, PyList>> {
        let until = Instant::now() + duration("timeout_s", timeout_s)?;
        let dag = self.dag()?;
        let mut releases = Vec::new();
        let mut slice_end = Instant::now() + WAIT_SLICE;
        loop {
            releases.extend(crate::errors::interruptible(py, || dag.results()).or_raise()?.releases);
            let now = Instant::now();
            if releases.len() >= count || now >= until {
                break;
            }
            if now >= slice_end {
                py.check_signals()?;
                slice_end = now + WAIT_SLICE;
            }
            py.detach(|| std::thread::sleep(Duration::from_millis(1)));
        }
        let list = PyList::empty(py);
        for r in &releases {
            list.append(release_dict(py, r)?)?;
        }
        Ok(list)
    }

    /// Withdraws the DAG: no more releases, its reservations are freed (releases in flight
    /// finish). Withdrawing twice does nothing.
    fn withdraw(&self, py: Python<'_>) -> PyResult<()> {
        let taken = self.inner.lock().unwrap_or_else(|e| e.into_inner()).take();
        let Some(dag) = taken else { return Ok(()) };
        self.liveness.check("DAG")?;
        match Arc::try_unwrap(dag) {
            Ok(dag) => crate::errors::interruptible(py, || dag.withdraw()).or_raise(),
            // Another thread's call holds it: the last one to let go withdraws it.
            Err(_shared) => Ok(()),
        }
    }

    fn __enter__(slf: Py<Self>) -> Py<Self> {
        slf
    }

    /// Leaving a `with` block withdraws the DAG (its error raised only when no exception is
    /// propagating).
    #[pyo3(signature = (exc_type, _exc_value, _traceback))]
    fn __exit__(
        &self,
        py: Python<'_>,
        exc_type: &Bound<'_, PyAny>,
        _exc_value: &Bound<'_, PyAny>,
        _traceback: &Bound<'_, PyAny>,
    ) -> PyResult<bool> {
        let outcome = self.withdraw(py);
        if exc_type.is_none() {
            outcome?;
        }
        Ok(false)
    }

    fn __repr__(&self) -> String {
        let open = self.inner.lock().unwrap_or_else(|e| e.into_inner()).is_some();
        if open && !self.liveness.is_closed() {
            format!(
                "<agora.Dag id={} utilisation={:.3}>",
                self.id, self.admission.utilisation
            )
        } else {
            format!("<agora.Dag id={} withdrawn>", self.id)
        }
    }
}
