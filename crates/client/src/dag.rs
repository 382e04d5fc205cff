//! Real-time task graphs (AMPERE's periodic DAGs): build one with [`Session::dag`], declare it,
//! and the daemon admits it only if its deadlines can be met (EDF on its deadline lanes, APEDF
//! partitioning), then releases it every period itself — no round trip per period — or on
//! [`Dag::release`] when sporadic. Each release's outcome comes back through [`Dag::results`].
//!
//! A node is a kernel launch with its arguments, as on a queue; the daemon runs it on a queue of
//! its own, after the node's predecessors of the same release. Its buffers are the session's:
//! read what a release wrote after its result arrived.

use std::sync::Arc;
use std::time::{Duration, Instant};

use agora_protocol::control::{
    DagAdmission, DagDeclaration, DagNodeDeclaration, DagRelease, DagResults, Request, Response,
};

use crate::error::Error;
use crate::queue::{launch_descriptor, Arg, NdRange};
use crate::session::{unexpected, Inner, Kernel, Session};

/// A DAG being built ([`Session::dag`]); [`DagBuilder::declare`] sends it to the daemon. It
/// holds its session (not a borrow), so bindings can keep it as long as they like.
pub struct DagBuilder {
    session: Arc<Inner>,
    declaration: DagDeclaration,
}

impl std::fmt::Debug for DagBuilder {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DagBuilder")
            .field("declaration", &self.declaration)
            .finish()
    }
}

/// An admitted DAG. Dropping it withdraws it (releases in flight finish).
pub struct Dag {
    session: Arc<Inner>,
    id: u64,
    admission: DagAdmission,
    withdrawn: bool,
}

impl std::fmt::Debug for Dag {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Dag")
            .field("id", &self.id)
            .field("admission", &self.admission)
            .finish()
    }
}

impl Session {
    /// Starts a real-time DAG named `name`, released every `period` (its end-to-end deadline is
    /// the period unless [`DagBuilder::deadline`] says otherwise).
    pub fn dag(&self, name: &str, period: Duration) -> DagBuilder {
        DagBuilder {
            session: self.inner.clone(),
            declaration: DagDeclaration {
                name: name.to_string(),
                period_ns: period.as_nanos().min(u64::MAX as u128) as u64,
                deadline_ns: None,
                periodic: true,
                nodes: Vec::new(),
                edges: Vec::new(),
            },
        }
    }
}

impl DagBuilder {
    /// Adds a node that launches `kernel` with `args` over `range`; returns its index.
    pub fn node(
        &mut self,
        name: &str,
        kernel: &Kernel,
        args: &[Arg<'_>],
        range: impl Into<NdRange>,
    ) -> Result<usize, Error> {
        let descriptor = launch_descriptor(&self.session, kernel, args, range.into(), None)?;
        self.declaration.nodes.push(DagNodeDeclaration {
            name: name.to_string(),
            launch: bytemuck::bytes_of(&descriptor).to_vec(),
            wcet_ns: None,
            relative_deadline_ns: None,
        });
        Ok(self.declaration.nodes.len() - 1)
    }

    /// Declares node `node`'s worst-case execution time (else the daemon's performance model
    /// estimates it, which needs the launch to have run there before). Runs longer than it are
    /// reported as overruns.
    pub fn wcet(&mut self, node: usize, wcet: Duration) -> &mut Self {
        if let Some(n) = self.declaration.nodes.get_mut(node) {
            n.wcet_ns = Some(wcet.as_nanos().min(u64::MAX as u128) as u64);
        }
        self
    }

    /// Fixes node `node`'s relative deadline (deadline splitting keeps it as given).
    pub fn node_deadline(&mut self, node: usize, deadline: Duration) -> &mut Self {
        if let Some(n) = self.declaration.nodes.get_mut(node) {
            n.relative_deadline_ns = Some(deadline.as_nanos().min(u64::MAX as u128) as u64);
        }
        self
    }

    /// `to` starts after `from` finished, in each release.
    pub fn edge(&mut self, from: usize, to: usize) -> &mut Self {
        self.declaration.edges.push((from as u32, to as u32));
        self
    }

    /// The end-to-end deadline of each release (default: the period).
    pub fn deadline(&mut self, deadline: Duration) -> &mut Self {
        self.declaration.deadline_ns = Some(deadline.as_nanos().min(u64::MAX as u128) as u64);
        self
    }

    /// Released only by [`Dag::release`]; the period is then the least time between releases.
    pub fn sporadic(&mut self) -> &mut Self {
        self.declaration.periodic = false;
        self
    }

    /// Sends the DAG for admission: `Err(Error::Control(ControlError::Dag))` says why it does not
    /// fit (which node, the lanes' utilisation, the WCET that would have fit).
    pub fn declare(&self) -> Result<Dag, Error> {
        let inner = &self.session;
        match inner.request(&Request::DeclareDag(Box::new(self.declaration.clone())))? {
            Response::DagAdmitted(admission) => Ok(Dag {
                session: inner.clone(),
                id: admission.dag,
                admission: *admission,
                withdrawn: false,
            }),
            other => Err(unexpected(other)),
        }
    }
}

impl Dag {
    /// The daemon's id of this DAG.
    pub fn id(&self) -> u64 {
        self.id
    }

    /// How it was admitted: each node's lane and WCET, the utilisation.
    pub fn admission(&self) -> &DagAdmission {
        &self.admission
    }

    /// Releases one instance now (a sporadic activation); returns its number.
    pub fn release(&self) -> Result<u64, Error> {
        match self.session.request(&Request::ReleaseDag { dag: self.id })? {
            Response::DagReleased { release } => Ok(release),
            other => Err(unexpected(other)),
        }
    }

    /// The releases finished since the previous call, oldest first.
    pub fn results(&self) -> Result<DagResults, Error> {
        match self.session.request(&Request::DagResults { dag: self.id })? {
            Response::DagResults(results) => Ok(results),
            other => Err(unexpected(other)),
        }
    }

    /// Collects finished releases until `count` have arrived or `timeout` passed (polling the
    /// daemon every millisecond); returns those that arrived.
    pub fn wait_results(&self, count: usize, timeout: Duration) -> Result<Vec<DagRelease>, Error> {
        let until = Instant::now() + timeout;
        let mut releases = Vec::new();
        loop {
            releases.extend(self.results()?.releases);
            if releases.len() >= count || Instant::now() >= until {
                return Ok(releases);
            }
            std::thread::sleep(Duration::from_millis(1));
        }
    }

    /// Withdraws the DAG: no more releases, its reservations are freed.
    pub fn withdraw(mut self) -> Result<(), Error> {
        self.withdrawn = true;
        match self.session.request(&Request::DropDag { dag: self.id })? {
            Response::DagDropped => Ok(()),
            other => Err(unexpected(other)),
        }
    }
}

impl Drop for Dag {
    fn drop(&mut self) {
        // A daemon that is gone took the graph with it (a resume does not bring graphs back),
        // and a drop must not wait for the next one.
        if !self.withdrawn && !self.session.daemon_gone() {
            let _ = self.session.request(&Request::DropDag { dag: self.id });
        }
    }
}
