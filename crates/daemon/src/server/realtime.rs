//! The control requests of real-time DAGs (`DeclareDag`, `ReleaseDag`, `DagResults`,
//! `DropDag`) and the dispatcher's part of running them: taking the node jobs the real-time
//! service queued and sending each through the scheduler.
//!
//! Owns: checking a declaration against the session (each node's launch resolves, its kernel
//! runs on the deadline device, a WCET exists), the nodes' queues, and the service's start.
//! Must not: decide admission or placement (`crate::realtime`, `agora_realtime`).

use std::sync::Arc;
use std::time::Duration;

use agora_protocol::control::{
    check_name, ControlError, DagAdmission, DagDeclaration, QueueClass, Response, MAX_DAG_NODES,
};
use agora_protocol::{DeviceKind, TaskDescriptor, TaskError};
use agora_realtime::{DagLimits, DagSpec, NodeSpec};

use super::{Conn, Server};
use crate::config::{DaemonConfig, RealtimePacking};
use crate::realtime::{DagNode, Declared, Realtime};
use crate::session::{Binding, QueueState, Session};

/// Most edges in one DAG.
const MAX_DAG_EDGES: usize = 4096;

/// The deadline device's index: `[realtime] device` by name, else the first CPU device.
pub(super) fn deadline_device(config: &DaemonConfig, devices: &[Arc<dyn agora_devices::Device>]) -> Option<usize> {
    match &config.realtime_device {
        Some(name) => devices.iter().position(|d| &d.info().name == name),
        None => devices.iter().position(|d| d.info().kind == DeviceKind::Cpu),
    }
}

/// Starts the real-time service on the deadline device's lanes (`None` without one: DAGs are
/// then refused with the reason).
pub(super) fn start_service(
    config: &DaemonConfig,
    devices: &[Arc<dyn agora_devices::Device>],
    wake: Arc<agora_transport::wake::Doorbell>,
    telemetry: Arc<crate::telemetry::Telemetry>,
) -> Option<(Arc<Realtime>, std::thread::JoinHandle<()>)> {
    let device = deadline_device(config, devices)?;
    let info = devices[device].info();
    let lanes = (0..info.lanes).map(|lane| Binding::new(device, lane)).collect();
    let names = (0..info.lanes)
        .map(|lane| format!("{}/lane{lane}", info.name))
        .collect();
    let packing = match config.realtime_packing {
        RealtimePacking::FirstFit => agora_realtime::Packing::FirstFit,
        RealtimePacking::WorstFit => agora_realtime::Packing::WorstFit,
    };
    let service = match Realtime::new(lanes, names, packing, config.realtime_wcet_margin, wake, telemetry) {
        Ok(service) => service,
        Err(why) => {
            tracing::warn!(%why, "real-time DAGs disabled");
            return None;
        }
    };
    match service.start_releases(config.realtime_release_nice) {
        Ok(thread) => Some((service, thread)),
        Err(why) => {
            tracing::warn!(%why, "real-time DAGs disabled: could not start the release thread");
            None
        }
    }
}

fn refuse(message: impl Into<String>) -> Option<Response> {
    Some(Response::Error(ControlError::Dag(message.into())))
}

/// Whether a client may declare DAGs (both lists empty: everyone may).
fn may_declare(config: &DaemonConfig, who: &crate::session::Credentials) -> bool {
    (config.realtime_uids.is_empty() && config.realtime_gids.is_empty())
        || config.realtime_uids.contains(&who.uid)
        || who.in_any_group(&config.realtime_gids)
}

fn micros_up(ns: u64) -> u64 {
    ns.div_ceil(1000)
}

impl Server {
    /// Runs the node jobs the real-time service queued (on the dispatcher thread).
    pub(super) fn run_node_jobs(&mut self) {
        let Some((service, _)) = &self.realtime else { return };
        if !service.has_jobs() {
            return;
        }
        let service = service.clone();
        for job in service.take_jobs() {
            let task_id = job.descriptor.task_id;
            match self.conns.get_mut(&job.session) {
                Some(Conn::Session(session)) => {
                    let dag = service.dag_of(task_id);
                    if let Some(due) = job.due {
                        service.handed_over(task_id, due);
                    }
                    if let (Some(error), Some(dag)) = (self.scheduler.dispatch_node_job(session, &job), dag) {
                        service.stop_dag(
                            dag,
                            format!("a node's launch no longer resolves ({error}); drop the DAG and declare it again"),
                        );
                    }
                }
                // The session ended meanwhile (its DAGs were withdrawn): close the route.
                _ => service.node_done(task_id, Err(TaskError::Cancelled)),
            }
        }
    }

    /// Whether node jobs wait for the dispatcher, or a release is about to come.
    pub(super) fn node_jobs_pending(&self) -> bool {
        self.realtime
            .as_ref()
            .is_some_and(|(service, _)| service.wants_dispatcher())
    }

    /// `Request::DeclareDag`.
    pub(super) fn declare_dag(&mut self, id: u64, declaration: DagDeclaration) -> Option<Response> {
        let Some(service) = self.realtime.as_ref().map(|(service, _)| service.clone()) else {
            return refuse(
                "this daemon runs no real-time DAGs: it has no deadline device (a CPU device, or [realtime] device names none it has)",
            );
        };
        let device = deadline_device(&self.config, &self.scheduler.devices)?;
        let Some(Conn::Session(session)) = self.conns.get_mut(&id) else {
            return Some(Response::Error(ControlError::BadRequest(
                "open a session with Hello first".into(),
            )));
        };
        if !may_declare(&self.config, &session.credentials) {
            return Some(Response::Error(ControlError::NotPermitted(format!(
                "uid {} (in groups {:?}) may not declare real-time DAGs; this daemon allows uids {:?} and members of groups {:?} \
                 ([realtime] uids / gids): ask the operator",
                session.credentials.uid,
                session.credentials.all_groups(),
                self.config.realtime_uids,
                self.config.realtime_gids
            ))));
        }
        if let Err(e) = check_name("DAG", &declaration.name) {
            return Some(Response::Error(e));
        }
        let limit = self.config.realtime_max_dags_per_session;
        if service.count_for(id) >= limit {
            return refuse(format!(
                "this session has {limit} DAGs admitted, the most one session may have ([realtime] max_dags_per_session): drop one first"
            ));
        }
        let DagDeclaration {
            name,
            period_ns,
            deadline_ns,
            periodic,
            nodes,
            edges,
        } = declaration;
        if nodes.is_empty() || nodes.len() > MAX_DAG_NODES {
            return refuse(format!(
                "DAG '{name}' has {} nodes: declare between 1 and {MAX_DAG_NODES}",
                nodes.len()
            ));
        }
        if edges.len() > MAX_DAG_EDGES {
            return refuse(format!(
                "DAG '{name}' has {} edges: at most {MAX_DAG_EDGES}",
                edges.len()
            ));
        }
        if period_ns == 0 {
            return refuse(format!(
                "DAG '{name}' has a period of 0: give the time between releases (for a sporadic DAG, the least time between them)"
            ));
        }
        // Each node's launch, checked as its first release would check it, on its own queue.
        let mut specs = Vec::with_capacity(nodes.len());
        let mut dag_nodes = Vec::with_capacity(nodes.len());
        let mut sources = Vec::with_capacity(nodes.len());
        let mut failure = None;
        for (index, node) in nodes.iter().enumerate() {
            if let Err(e) = check_name("node", &node.name) {
                failure = Some(e.to_string());
                break;
            }
            let Some(mut launch) = (node.launch.len() == std::mem::size_of::<TaskDescriptor>())
                .then(|| bytemuck::pod_read_unaligned::<TaskDescriptor>(&node.launch))
            else {
                failure = Some(format!(
                    "node '{}' (#{index}): its launch is {} bytes, not a {}-byte task descriptor",
                    node.name,
                    node.launch.len(),
                    std::mem::size_of::<TaskDescriptor>()
                ));
                break;
            };
            let queue = match new_node_queue(session, &name, &node.name) {
                Ok(handle) => handle,
                Err(why) => {
                    failure = Some(why);
                    break;
                }
            };
            dag_nodes.push(queue);
            launch.queue = queue;
            let estimate = match self.scheduler.check_node_launch(session, &launch, device) {
                Ok(estimate) => estimate,
                Err(error) => {
                    failure = Some(format!("node '{}' (#{index}): {error}", node.name));
                    break;
                }
            };
            let (wcet_ns, source) = match (node.wcet_ns, estimate) {
                (Some(0), _) => {
                    // As the RTDAG files' tasks_wcet: a WCET of nothing would make every run an
                    // overrun and reserve nothing.
                    failure = Some(format!(
                        "node '{}' (#{index}): a declared WCET of 0: declare the longest one run may take, or none and the performance model estimates it",
                        node.name
                    ));
                    break;
                }
                (Some(declared), _) => (declared, "declared"),
                (None, Some(ns)) => ((ns * self.config.realtime_model_factor).ceil().max(1.0) as u64, "model"),
                (None, None) => {
                    failure = Some(format!(
                        "node '{}' (#{index}): no WCET: declare one, or run the launch once on {} so the performance model knows it",
                        node.name,
                        self.scheduler.devices[device].info().name
                    ));
                    break;
                }
            };
            sources.push(source.to_string());
            specs.push((launch, wcet_ns));
        }
        if let Some(why) = failure {
            for queue in dag_nodes {
                session.queues.remove(queue);
            }
            return refuse(format!("DAG '{name}' refused: {why}"));
        }
        let mut spec = DagSpec::new(name.clone(), micros_up(period_ns));
        spec.deadline_us = deadline_ns.map(micros_up);
        spec.nodes = nodes
            .iter()
            .zip(&specs)
            .map(|(node, (_, wcet_ns))| NodeSpec {
                name: node.name.clone(),
                wcet_us: micros_up(*wcet_ns),
                relative_deadline_us: node.relative_deadline_ns.map(micros_up),
                device_kind: None,
            })
            .collect();
        spec.edges = edges.iter().map(|&(a, b)| (a as usize, b as usize)).collect();
        let limits = DagLimits {
            max_nodes: MAX_DAG_NODES,
            max_edges: MAX_DAG_EDGES,
            ..DagLimits::default()
        };
        let validated = match spec.validate(&limits) {
            Ok(validated) => validated,
            Err(error) => {
                for queue in dag_nodes {
                    session.queues.remove(queue);
                }
                return refuse(error.to_string());
            }
        };
        let margin = self.config.realtime_wcet_margin;
        let utilisation = validated.utilisation() * (1.0 + margin);
        let period = Duration::from_micros(validated.period_us());
        let deadline = Duration::from_micros(validated.deadline_us());
        let wcets: Vec<u64> = specs.iter().map(|(_, wcet)| *wcet).collect();
        let declared = Declared {
            session: id,
            nodes: specs
                .iter()
                .zip(&dag_nodes)
                .map(|((launch, wcet_ns), &queue)| DagNode {
                    launch: *launch,
                    queue,
                    wcet_ns: *wcet_ns,
                    budget_ns: agora_realtime::inflated_wcet(*wcet_ns, margin),
                })
                .collect(),
            validated,
            period,
            deadline,
            periodic,
        };
        match service.admit(declared) {
            Ok((dag, lanes, decided_by_bound, lane_utilisation)) => {
                let _ = session.shared.realtime.set(service.clone());
                tracing::info!(session = id, dag, %name, ?lanes, "DAG admitted");
                Some(Response::DagAdmitted(Box::new(DagAdmission {
                    dag,
                    lanes,
                    wcet_ns: wcets,
                    wcet_source: sources,
                    utilisation,
                    lane_utilisation,
                    decided_by_bound,
                })))
            }
            Err(refusal) => {
                for queue in dag_nodes {
                    session.queues.remove(queue);
                }
                refuse(refusal)
            }
        }
    }

    /// `Request::ReleaseDag`, `DagResults`, `DropDag`: `what` on the service for this session.
    pub(super) fn dag_request(
        &mut self,
        id: u64,
        what: impl FnOnce(&Realtime, u64) -> Result<Response, String>,
    ) -> Option<Response> {
        let Some(service) = self.realtime.as_ref().map(|(service, _)| service.clone()) else {
            return refuse("this daemon runs no real-time DAGs");
        };
        match self.conns.get(&id) {
            Some(Conn::Session(_)) => {
                Some(what(&service, id).unwrap_or_else(|e| Response::Error(ControlError::Dag(e))))
            }
            _ => Some(Response::Error(ControlError::BadRequest(
                "open a session with Hello first".into(),
            ))),
        }
    }
}

/// A queue of its own for one node (its jobs settle in order there), named after the DAG.
fn new_node_queue(session: &mut Session, dag: &str, node: &str) -> Result<u64, String> {
    let queue = QueueState::new(&format!("dag:{dag}/{node}"), QueueClass::Batch, None, None);
    session
        .queues
        .insert(queue)
        .ok_or_else(|| "the session has as many queues as it may have; release some".to_string())
}
