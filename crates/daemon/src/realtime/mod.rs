//! Real-time task graphs in the daemon (AMPERE's periodic DAGs, issue #16): admission, the
//! release timer, per-release bookkeeping and APEDF placement of each node's job.
//!
//! Owns: the admitted DAGs ([`agora_realtime::Admission`] over the deadline lanes: the lanes of
//! one device, `[realtime] device`), the release thread (it releases periodic DAGs itself, no
//! client round trip per period), the route from each node job's task id back to its DAG and
//! release, the finished releases until the client reads them, and the DAG metrics.
//!
//! How a release runs: the release thread (or a `ReleaseDag` request) opens a release and queues
//! a [`NodeJob`] for each source node; the dispatcher ([`crate::server`]) takes them
//! ([`Realtime::take_jobs`]) and runs each through the scheduler's stages like a client's task,
//! on the lane APEDF picks ([`Realtime::choose_lane`]) with the node's absolute deadline, which
//! the lane orders EDF ahead of latency and batch work. A node job's completion does not reach
//! the client's ring: [`crate::session::SessionShared`] hands completions whose task id has
//! [`DAG_TASK_BIT`] to [`Realtime::node_done`], which queues the node's successors whose
//! predecessors are all done, and closes the release after its last node.
//!
//! Must not: touch the scheduler or sessions itself (the dispatcher owns them), or block a lane
//! thread for more than a short lock.

use std::collections::{BinaryHeap, HashMap, VecDeque};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use agora_protocol::control::{DagRelease, DagResults, DAG_RESULTS_KEPT};
use agora_protocol::{TaskDescriptor, TaskError};
use agora_realtime::{Admission, AdmissionConfig, DagId, NodeTiming, ValidatedDag};
use agora_transport::wake::Doorbell;

use crate::session::Binding;
use crate::telemetry::Telemetry;

/// Task ids with this bit are node jobs of DAGs (clients' ids never have it: the dispatcher
/// refuses such descriptors from rings).
pub(crate) const DAG_TASK_BIT: u64 = 1 << 63;

/// Whether `task_id` is a DAG node job's.
pub(crate) fn is_dag_task(task_id: u64) -> bool {
    task_id & DAG_TASK_BIT != 0
}

/// How long before a release is due the release thread stops sleeping and polls the clock (its
/// timed sleeps have a timer slack of 1 µs, so they end within a few tens of microseconds of
/// their time on an idle machine); the dispatcher polls too from then on (a wake-up from its
/// sleep takes about 100 µs on a VM). Not longer, because both take a core from the lanes
/// meanwhile.
const SPIN_BEFORE: Duration = Duration::from_micros(150);

/// A node job ready to run, for the dispatcher.
#[derive(Debug, Clone)]
pub(crate) struct NodeJob {
    /// The session that declared the DAG.
    pub session: u64,
    /// The launch, with the node job's task id and the node's queue set.
    pub descriptor: TaskDescriptor,
    /// The lane it runs on.
    pub lane: Binding,
    /// Its absolute deadline.
    pub deadline: Instant,
    /// A source node of its release: when the release was due (its jitter is measured when the
    /// dispatcher hands it over).
    pub due: Option<Instant>,
}

/// One node of an admitted DAG, as the daemon runs it.
#[derive(Debug)]
pub(crate) struct DagNode {
    /// The launch (task id and queue are set per job).
    pub launch: TaskDescriptor,
    /// The node's own queue in the declaring session.
    pub queue: u64,
    /// Its WCET, nanoseconds (declared, or the model's estimate × the model factor).
    pub wcet_ns: u64,
    /// Its budget on a lane (WCET with the margin), nanoseconds.
    pub budget_ns: u64,
}

/// An admitted DAG.
struct Dag {
    session: u64,
    name: String,
    validated: ValidatedDag,
    nodes: Vec<DagNode>,
    /// The deadline lane (index into [`Realtime::lanes`]) of each node, from admission.
    partition: Vec<usize>,
    period: Duration,
    deadline: Duration,
    /// Releases issued so far.
    released: u64,
    last_release: Option<Instant>,
    open: HashMap<u64, OpenRelease>,
    results: VecDeque<DagRelease>,
    dropped: u64,
    stopped: Option<String>,
    metrics: crate::telemetry::DagMetrics,
    /// Whether the release thread releases it.
    periodic: bool,
    /// Each node's lane name.
    lane_names: Vec<String>,
    /// Outcome counts since admission, for status.
    met: u64,
    missed: u64,
    overruns: u64,
    /// Response times of the last [`RECENT_RESPONSES`] releases, nanoseconds.
    recent: VecDeque<u64>,
}

/// Releases whose response times a DAG keeps for status (p99 and max).
const RECENT_RESPONSES: usize = 1024;

/// A release whose nodes have not all finished.
struct OpenRelease {
    due: Instant,
    /// Predecessors not finished yet, per node.
    waiting_for: Vec<u32>,
    unfinished: usize,
    /// Lateness of the release timer.
    jitter_ns: u64,
    /// Due time to the first hand-off to a lane.
    handoff_ns: Option<u64>,
    failed: Option<(u32, String)>,
    overruns: Vec<u32>,
}

/// Where a node job's completion goes.
#[derive(Clone, Copy)]
struct Route {
    session: u64,
    dag: u64,
    release: u64,
    node: usize,
    /// The deadline lane its job runs on, and the budget booked there.
    lane: usize,
    budget_ns: u64,
}

struct State {
    admission: Admission,
    dags: HashMap<u64, Dag>,
    routes: HashMap<u64, Route>,
    next_task: u64,
    /// Due times of periodic DAGs' next releases, earliest first.
    timers: BinaryHeap<std::cmp::Reverse<(Instant, u64)>>,
    /// Budgets of node jobs handed to each deadline lane and not finished, nanoseconds.
    backlog_ns: Vec<u64>,
    stopping: bool,
}

/// The daemon's real-time service; see the module documentation.
pub(crate) struct Realtime {
    state: Mutex<State>,
    /// Wakes the release thread when a timer is added or the daemon stops.
    timer: Condvar,
    jobs: Mutex<Vec<NodeJob>>,
    pending: AtomicBool,
    /// A release is due within [`SPIN_BEFORE`]: the dispatcher polls instead of sleeping, so
    /// that the release's first nodes do not wait for it to wake up.
    imminent: AtomicBool,
    /// The dispatcher's doorbell.
    wake: Arc<Doorbell>,
    /// The deadline lanes.
    pub lanes: Vec<Binding>,
    lane_names: Vec<String>,
    packing: agora_realtime::Packing,
    telemetry: Arc<Telemetry>,
}

impl std::fmt::Debug for Realtime {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Realtime").field("lanes", &self.lane_names).finish()
    }
}

/// A DAG as the server declares it, its nodes resolved.
pub(crate) struct Declared {
    pub session: u64,
    pub validated: ValidatedDag,
    pub nodes: Vec<DagNode>,
    pub period: Duration,
    pub deadline: Duration,
    pub periodic: bool,
}

impl Realtime {
    /// A service partitioning onto `lanes` (named `lane_names`); `wake` is the dispatcher's.
    pub(crate) fn new(
        lanes: Vec<Binding>,
        lane_names: Vec<String>,
        packing: agora_realtime::Packing,
        wcet_margin: f64,
        wake: Arc<Doorbell>,
        telemetry: Arc<Telemetry>,
    ) -> Result<Arc<Self>, String> {
        let admission = Admission::new(AdmissionConfig {
            lanes: lanes.len(),
            packing,
            wcet_margin,
            preemption_granularity_us: 0,
        })
        .map_err(|e| e.to_string())?;
        let backlog_ns = vec![0; lanes.len()];
        Ok(Arc::new(Realtime {
            state: Mutex::new(State {
                admission,
                dags: HashMap::new(),
                routes: HashMap::new(),
                next_task: 0,
                timers: BinaryHeap::new(),
                backlog_ns,
                stopping: false,
            }),
            timer: Condvar::new(),
            jobs: Mutex::new(Vec::new()),
            pending: AtomicBool::new(false),
            imminent: AtomicBool::new(false),
            wake,
            lanes,
            lane_names,
            packing,
            telemetry,
        }))
    }

    fn state(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Starts the release thread, its nice value changed by `nice` (negative: it must preempt
    /// lanes busy with nodes to release the next DAG on time; refused without `CAP_SYS_NICE` or
    /// `RLIMIT_NICE`, which the log says).
    pub(crate) fn start_releases(self: &Arc<Self>, nice: i32) -> std::io::Result<std::thread::JoinHandle<()>> {
        let service = self.clone();
        std::thread::Builder::new()
            .name("agora-releases".into())
            .spawn(move || {
                // Timed sleeps end at their time, not up to 50 µs later (the default slack).
                if let Err(why) = rustix::thread::set_current_timer_slack(std::num::NonZeroU64::new(1000)) {
                    tracing::debug!(%why, "release thread keeps the default timer slack");
                }
                if nice != 0 {
                    match agora_devices::priority::renice_current_thread(nice) {
                        Ok(now) => tracing::debug!(nice = now, "release thread reniced"),
                        Err(why) => tracing::info!(
                        "the DAG release thread keeps its priority ({why}); releases may come late while lanes are busy"
                    ),
                    }
                }
                service.release_loop()
            })
    }

    /// Stops the release thread (at shutdown).
    pub(crate) fn stop(&self) {
        self.state().stopping = true;
        self.timer.notify_all();
    }

    /// DAGs `session` has admitted now.
    pub(crate) fn count_for(&self, session: u64) -> usize {
        self.state().dags.values().filter(|d| d.session == session).count()
    }

    /// Admits `declared` or says why not (the refusal gives the arithmetic). Returns its id,
    /// each node's lane name, whether the bound decided, and each lane's utilisation after.
    pub(crate) fn admit(&self, declared: Declared) -> Result<(u64, Vec<String>, bool, Vec<f64>), String> {
        let mut state = self.state();
        let decision = state
            .admission
            .admit(declared.validated.clone())
            .map_err(|e| e.to_string())?;
        let id = decision.id.0;
        let name = declared.validated.name().to_string();
        let lanes: Vec<String> = decision.lanes.iter().map(|&l| self.lane_names[l].clone()).collect();
        let now = Instant::now();
        if declared.periodic {
            // The first release one period from now: the client has time to read its admission.
            state.timers.push(std::cmp::Reverse((now + declared.period, id)));
        }
        state.dags.insert(
            id,
            Dag {
                session: declared.session,
                metrics: self.telemetry.metrics.dag_metrics(&name),
                name,
                validated: declared.validated,
                nodes: declared.nodes,
                partition: decision.lanes,
                period: declared.period,
                deadline: declared.deadline,
                released: 0,
                last_release: None,
                open: HashMap::new(),
                results: VecDeque::new(),
                dropped: 0,
                stopped: None,
                periodic: declared.periodic,
                lane_names: lanes.clone(),
                met: 0,
                missed: 0,
                overruns: 0,
                recent: VecDeque::new(),
            },
        );
        self.telemetry.metrics.dags_admitted.set(state.dags.len() as i64);
        let utilisation = state.admission.lane_utilisation();
        drop(state);
        self.timer.notify_all();
        Ok((id, lanes, decision.decided_by_bound, utilisation))
    }

    /// The admitted DAGs (at most `limit`, by id), for status.
    pub(crate) fn status(&self, limit: usize) -> Vec<agora_protocol::control::DagStatus> {
        let state = self.state();
        let mut ids: Vec<u64> = state.dags.keys().copied().collect();
        ids.sort_unstable();
        ids.truncate(limit);
        ids.iter()
            .map(|id| {
                let dag = &state.dags[id];
                let mut recent: Vec<u64> = dag.recent.iter().copied().collect();
                recent.sort_unstable();
                let p99 = recent
                    .get(((recent.len().max(1) - 1) as f64 * 0.99).round() as usize)
                    .copied()
                    .unwrap_or(0);
                agora_protocol::control::DagStatus {
                    id: *id,
                    name: dag.name.clone(),
                    session: dag.session,
                    period_us: dag.period.as_micros() as u64,
                    deadline_us: dag.deadline.as_micros() as u64,
                    periodic: dag.periodic,
                    lanes: dag
                        .lane_names
                        .iter()
                        .take(agora_protocol::control::STATUS_DAG_LANES)
                        .cloned()
                        .collect(),
                    releases: dag.released,
                    met: dag.met,
                    missed: dag.missed,
                    overruns: dag.overruns,
                    response_p99_us: p99 / 1000,
                    response_max_us: recent.last().copied().unwrap_or(0) / 1000,
                    stopped: dag.stopped.clone(),
                }
            })
            .collect()
    }

    /// Releases `dag` of `session` now (a sporadic activation); its release number.
    pub(crate) fn release_now(&self, session: u64, dag: u64) -> Result<u64, String> {
        let now = Instant::now();
        let mut state = self.state();
        let entry = state
            .dags
            .get(&dag)
            .filter(|d| d.session == session)
            .ok_or_else(|| format!("no DAG #{dag} is admitted in this session"))?;
        if let Some(reason) = &entry.stopped {
            return Err(format!("DAG '{}' was stopped: {reason}", entry.name));
        }
        if let Some(last) = entry.last_release {
            let since = now.saturating_duration_since(last);
            if since < entry.period {
                return Err(format!(
                    "DAG '{}' released again {} µs after its previous release; its period ({} µs) is the least time between releases that admission counted with: wait, or declare a shorter period",
                    entry.name,
                    since.as_micros(),
                    entry.period.as_micros()
                ));
            }
        }
        let release = self.open_release(&mut state, dag, now);
        drop(state);
        self.ring();
        Ok(release)
    }

    /// Takes the finished releases of `dag` (of `session`) since the last call.
    pub(crate) fn results(&self, session: u64, dag: u64) -> Result<DagResults, String> {
        let mut state = self.state();
        let entry = state
            .dags
            .get_mut(&dag)
            .filter(|d| d.session == session)
            .ok_or_else(|| format!("no DAG #{dag} is admitted in this session"))?;
        Ok(DagResults {
            releases: entry.results.drain(..).collect(),
            dropped: std::mem::take(&mut entry.dropped),
            released: entry.released,
            stopped: entry.stopped.clone(),
        })
    }

    /// Withdraws `dag` of `session`: its reservations are freed; node jobs in flight finish.
    pub(crate) fn drop_dag(&self, session: u64, dag: u64) -> Result<(), String> {
        let mut state = self.state();
        if state.dags.get(&dag).is_none_or(|d| d.session != session) {
            return Err(format!("no DAG #{dag} is admitted in this session"));
        }
        Self::remove(&mut state, dag);
        self.telemetry.metrics.dags_admitted.set(state.dags.len() as i64);
        Ok(())
    }

    /// The session ended: its DAGs are withdrawn and their reservations freed. Returns how many.
    pub(crate) fn session_ended(&self, session: u64) -> usize {
        let mut state = self.state();
        let ids: Vec<u64> = state
            .dags
            .iter()
            .filter(|(_, d)| d.session == session)
            .map(|(&id, _)| id)
            .collect();
        for &id in &ids {
            Self::remove(&mut state, id);
        }
        self.telemetry.metrics.dags_admitted.set(state.dags.len() as i64);
        ids.len()
    }

    fn remove(state: &mut State, dag: u64) {
        state.dags.remove(&dag);
        let _ = state.admission.remove(DagId(dag));
        // Its timer entry is skipped when it comes due (no DAG by that id).
    }

    /// Stops releasing `dag` for `reason` (a node whose launch no longer resolves, say); its
    /// reservations stay until the client drops it or ends, and its results say why.
    pub(crate) fn stop_dag(&self, dag: u64, reason: String) {
        if let Some(entry) = self.state().dags.get_mut(&dag) {
            if entry.stopped.is_none() {
                tracing::warn!(dag = %entry.name, %reason, "DAG stopped");
                entry.stopped = Some(reason);
            }
        }
    }

    /// Whether `task_id` is a node job in flight of a DAG of `session` (a client's own task id
    /// with [`DAG_TASK_BIT`] set is not: it completes to the client as usual).
    pub(crate) fn owns(&self, session: u64, task_id: u64) -> bool {
        self.state()
            .routes
            .get(&task_id)
            .is_some_and(|route| route.session == session)
    }

    /// The DAG a node job's task id belongs to.
    pub(crate) fn dag_of(&self, task_id: u64) -> Option<u64> {
        self.state().routes.get(&task_id).map(|r| r.dag)
    }

    /// Opens release number `dag.released` due at `due` and queues its source nodes.
    fn open_release(&self, state: &mut State, dag: u64, due: Instant) -> u64 {
        let State {
            dags,
            routes,
            next_task,
            backlog_ns,
            ..
        } = state;
        let Some(entry) = dags.get_mut(&dag) else { return 0 };
        let release = entry.released;
        entry.released += 1;
        entry.last_release = Some(due);
        let count = entry.nodes.len();
        let waiting_for: Vec<u32> = (0..count)
            .map(|n| entry.validated.predecessors(n).len() as u32)
            .collect();
        let sources: Vec<usize> = (0..count).filter(|&n| waiting_for[n] == 0).collect();
        entry.open.insert(
            release,
            OpenRelease {
                due,
                waiting_for,
                unfinished: count,
                jitter_ns: Instant::now().saturating_duration_since(due).as_nanos() as u64,
                handoff_ns: None,
                failed: None,
                overruns: Vec::new(),
            },
        );
        let mut jobs = Vec::with_capacity(sources.len());
        for node in sources {
            jobs.push(self.node_job(entry, dag, release, node, due, true, routes, next_task, backlog_ns));
        }
        self.queue_jobs(jobs);
        release
    }

    /// The job of `node` in `release` (due at `due`): its task id, route, lane (APEDF) and
    /// absolute deadline.
    #[allow(clippy::too_many_arguments)]
    fn node_job(
        &self,
        entry: &Dag,
        dag: u64,
        release: u64,
        node: usize,
        due: Instant,
        source: bool,
        routes: &mut HashMap<u64, Route>,
        next_task: &mut u64,
        backlog_ns: &mut [u64],
    ) -> NodeJob {
        let timing: NodeTiming = entry.validated.node_timing(node);
        let deadline =
            due + Duration::from_micros(timing.release_offset_us.saturating_add(timing.relative_deadline_us));
        let budget_ns = entry.nodes[node].budget_ns;
        let lane = self.choose_lane(entry.partition[node], budget_ns, deadline, backlog_ns);
        backlog_ns[lane] += budget_ns;
        *next_task += 1;
        let task_id = DAG_TASK_BIT | *next_task;
        routes.insert(
            task_id,
            Route {
                session: entry.session,
                dag,
                release,
                node,
                lane,
                budget_ns,
            },
        );
        let mut descriptor = entry.nodes[node].launch;
        descriptor.task_id = task_id;
        descriptor.queue = entry.nodes[node].queue;
        NodeJob {
            session: entry.session,
            descriptor,
            lane: self.lanes[lane],
            deadline,
            due: source.then_some(due),
        }
    }

    /// APEDF: the node's partitioned lane while its job fits there (the budgets queued on the
    /// lane plus its own end by its deadline); else another lane where it fits, first-fit or
    /// worst-fit as admission packs; else the least loaded lane (global EDF's choice).
    fn choose_lane(&self, partition: usize, budget_ns: u64, deadline: Instant, backlog_ns: &[u64]) -> usize {
        let window = deadline.saturating_duration_since(Instant::now()).as_nanos() as u64;
        let fits = |lane: usize| backlog_ns[lane].saturating_add(budget_ns) <= window;
        if fits(partition) {
            return partition;
        }
        let least = (0..backlog_ns.len())
            .min_by_key(|&l| backlog_ns[l])
            .unwrap_or(partition);
        let other = match self.packing {
            agora_realtime::Packing::FirstFit => (0..backlog_ns.len()).find(|&l| fits(l)),
            agora_realtime::Packing::WorstFit => Some(least).filter(|&l| fits(l)),
        };
        let chosen = other.unwrap_or(least);
        if chosen != partition {
            self.telemetry.metrics.dag_migrations.inc();
        }
        chosen
    }

    fn queue_jobs(&self, jobs: Vec<NodeJob>) {
        if jobs.is_empty() {
            return;
        }
        self.jobs.lock().unwrap_or_else(|e| e.into_inner()).extend(jobs);
        self.pending.store(true, Ordering::Release);
        self.ring();
    }

    fn ring(&self) {
        self.wake.ring();
    }

    /// Whether node jobs wait for the dispatcher.
    pub(crate) fn has_jobs(&self) -> bool {
        self.pending.load(Ordering::Acquire)
    }

    /// Whether the dispatcher should poll rather than sleep: node jobs wait, or a release is
    /// about to come.
    pub(crate) fn wants_dispatcher(&self) -> bool {
        self.pending.load(Ordering::Acquire) || self.imminent.load(Ordering::Acquire)
    }

    /// The node jobs waiting for the dispatcher.
    pub(crate) fn take_jobs(&self) -> Vec<NodeJob> {
        self.pending.store(false, Ordering::Release);
        std::mem::take(&mut *self.jobs.lock().unwrap_or_else(|e| e.into_inner()))
    }

    /// The dispatcher handed a source node of a release due at `due` to its lane (the first
    /// such hand-off of a release is its hand-off time).
    pub(crate) fn handed_over(&self, task_id: u64, due: Instant) {
        let handoff = Instant::now().saturating_duration_since(due);
        let mut state = self.state();
        let Some(route) = state.routes.get(&task_id).copied() else {
            return;
        };
        if let Some(open) = state
            .dags
            .get_mut(&route.dag)
            .and_then(|d| d.open.get_mut(&route.release))
        {
            if open.handoff_ns.is_none() {
                open.handoff_ns = Some(handoff.as_nanos() as u64);
                self.telemetry
                    .metrics
                    .dag_release_jitter
                    .observe(open.jitter_ns as f64 / 1e9);
            }
        }
    }

    /// A node job ran for `execution` on its lane (before its completion is posted): a run
    /// longer than the node's WCET is an overrun.
    pub(crate) fn executed(&self, task_id: u64, execution: Duration) {
        let mut state = self.state();
        let Some(route) = state.routes.get(&task_id).copied() else {
            return;
        };
        let Some(entry) = state.dags.get_mut(&route.dag) else {
            return;
        };
        if execution.as_nanos() as u64 > entry.nodes[route.node].wcet_ns {
            entry.metrics.overruns.inc();
            entry.overruns += 1;
            if let Some(open) = entry.open.get_mut(&route.release) {
                open.overruns.push(route.node as u32);
            }
        }
    }

    /// A node job completed with `result`: queues its successors that are now ready, and closes
    /// its release after its last node.
    pub(crate) fn node_done(&self, task_id: u64, result: Result<(), TaskError>) {
        let now = Instant::now();
        let mut state = self.state();
        let Some(route) = state.routes.remove(&task_id) else {
            return;
        };
        state.backlog_ns[route.lane] = state.backlog_ns[route.lane].saturating_sub(route.budget_ns);
        let State {
            dags,
            routes,
            next_task,
            backlog_ns,
            ..
        } = &mut *state;
        let Some(entry) = dags.get_mut(&route.dag) else { return };
        let Some(mut open) = entry.open.remove(&route.release) else {
            return;
        };
        if let Err(error) = result {
            if open.failed.is_none() {
                open.failed = Some((route.node as u32, error.to_string()));
            }
        }
        open.unfinished -= 1;
        let mut ready = Vec::new();
        for &next in entry.validated.successors(route.node) {
            open.waiting_for[next] -= 1;
            if open.waiting_for[next] == 0 {
                ready.push(next);
            }
        }
        let mut jobs = Vec::new();
        for node in ready {
            jobs.push(self.node_job(
                entry,
                route.dag,
                route.release,
                node,
                open.due,
                false,
                routes,
                next_task,
                backlog_ns,
            ));
        }
        if open.unfinished > 0 {
            entry.open.insert(route.release, open);
        } else {
            let response = now.saturating_duration_since(open.due);
            let met = open.failed.is_none() && response <= entry.deadline;
            entry.metrics.response.observe(response.as_secs_f64());
            match (&open.failed, met) {
                (Some(_), _) => entry.metrics.failed.inc(),
                (None, true) => entry.metrics.met.inc(),
                (None, false) => entry.metrics.missed.inc(),
            };
            if met {
                entry.met += 1;
            } else {
                entry.missed += 1;
            }
            if entry.recent.len() >= RECENT_RESPONSES {
                entry.recent.pop_front();
            }
            entry.recent.push_back(response.as_nanos() as u64);
            if entry.results.len() >= DAG_RESULTS_KEPT {
                entry.results.pop_front();
                entry.dropped += 1;
            }
            entry.results.push_back(DagRelease {
                release: route.release,
                response_ns: response.as_nanos() as u64,
                met,
                jitter_ns: open.jitter_ns,
                handoff_ns: open.handoff_ns.unwrap_or(0),
                failed: open.failed,
                overruns: open.overruns,
            });
        }
        drop(state);
        self.queue_jobs(jobs);
    }

    /// The release thread: sleeps until the next periodic release is due, polls the clock for
    /// the last [`SPIN_BEFORE`], opens the release, and schedules the next one a period later.
    fn release_loop(&self) {
        let mut state = self.state();
        loop {
            if state.stopping {
                return;
            }
            let Some(&std::cmp::Reverse((due, dag))) = state.timers.peek() else {
                state = self.timer.wait(state).unwrap_or_else(|e| e.into_inner());
                continue;
            };
            let now = Instant::now();
            if due > now + SPIN_BEFORE {
                state = self
                    .timer
                    .wait_timeout(state, due - now - SPIN_BEFORE)
                    .unwrap_or_else(|e| e.into_inner())
                    .0;
                continue;
            }
            if due > now {
                drop(state);
                // The dispatcher wakes now and polls until the release is out.
                self.imminent.store(true, Ordering::Release);
                self.ring();
                while Instant::now() < due {
                    std::hint::spin_loop();
                }
                state = self.state();
                continue;
            }
            // Cleared after the release's jobs are queued (they keep the dispatcher awake).
            let _imminent = ClearOnDrop(&self.imminent);
            state.timers.pop();
            let Some(entry) = state.dags.get(&dag) else { continue };
            if entry.stopped.is_some() {
                continue;
            }
            let period = entry.period;
            self.open_release(&mut state, dag, due);
            // The next release a period after this one was due, not after it happened (no
            // drift); one that is already a whole period late is skipped, not bunched.
            let mut next = due + period;
            let now = Instant::now();
            while next + period <= now {
                next += period;
            }
            state.timers.push(std::cmp::Reverse((next, dag)));
        }
    }
}

/// Clears its flag when dropped.
struct ClearOnDrop<'a>(&'a AtomicBool);

impl Drop for ClearOnDrop<'_> {
    fn drop(&mut self) {
        self.0.store(false, Ordering::Release);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use agora_realtime::{DagLimits, DagSpec, NodeSpec};

    fn service(lanes: usize) -> Arc<Realtime> {
        let bindings = (0..lanes).map(|l| Binding::new(0, l)).collect();
        let names = (0..lanes).map(|l| format!("cpu0/lane{l}")).collect();
        Realtime::new(
            bindings,
            names,
            agora_realtime::Packing::FirstFit,
            0.0,
            Arc::new(Doorbell::new().unwrap()),
            Arc::new(Telemetry {
                metrics: crate::telemetry::Metrics::new(),
                trace: None,
            }),
        )
        .unwrap()
    }

    fn chain(name: &str, period_us: u64, wcet_us: u64) -> Declared {
        let mut spec = DagSpec::new(name, period_us);
        spec.nodes = vec![NodeSpec::new("a", wcet_us), NodeSpec::new("b", wcet_us)];
        spec.edges = vec![(0, 1)];
        let validated = spec.validate(&DagLimits::default()).unwrap();
        let node = |q| DagNode {
            launch: TaskDescriptor::zeroed(),
            queue: q,
            wcet_ns: wcet_us * 1000,
            budget_ns: wcet_us * 1000,
        };
        Declared {
            session: 7,
            validated,
            nodes: vec![node(1), node(2)],
            period: Duration::from_micros(period_us),
            deadline: Duration::from_micros(period_us),
            periodic: false,
        }
    }

    #[test]
    fn a_release_runs_sources_then_successors_and_reports_its_response() {
        let rt = service(2);
        let (dag, lanes, _, _) = rt.admit(chain("pipe", 10_000, 1_000)).unwrap();
        assert_eq!(lanes.len(), 2);
        assert_eq!(rt.release_now(7, dag).unwrap(), 0);
        let jobs = rt.take_jobs();
        assert_eq!(jobs.len(), 1, "only the source");
        assert_eq!(jobs[0].descriptor.queue, 1);
        assert!(is_dag_task(jobs[0].descriptor.task_id));
        rt.node_done(jobs[0].descriptor.task_id, Ok(()));
        let jobs = rt.take_jobs();
        assert_eq!(jobs.len(), 1, "then its successor");
        assert_eq!(jobs[0].descriptor.queue, 2);
        assert!(rt.results(7, dag).unwrap().releases.is_empty(), "not finished yet");
        rt.executed(jobs[0].descriptor.task_id, Duration::from_millis(5));
        rt.node_done(jobs[0].descriptor.task_id, Ok(()));
        let results = rt.results(7, dag).unwrap();
        assert_eq!(results.releases.len(), 1);
        let release = &results.releases[0];
        assert!(release.met, "{release:?}");
        assert_eq!(release.overruns, [1], "node b ran 5 ms against a 1 ms WCET");
        assert!(rt.results(7, dag).unwrap().releases.is_empty(), "read once");
    }

    #[test]
    fn sporadic_releases_closer_than_the_period_are_refused_and_others_sessions_cannot_touch_it() {
        let rt = service(1);
        let (dag, ..) = rt.admit(chain("s", 1_000_000, 1_000)).unwrap();
        rt.release_now(7, dag).unwrap();
        let refused = rt.release_now(7, dag).unwrap_err();
        assert!(refused.contains("least time between releases"), "{refused}");
        assert!(rt.release_now(8, dag).unwrap_err().contains("no DAG"));
        assert!(rt.drop_dag(8, dag).is_err());
        rt.drop_dag(7, dag).unwrap();
        assert!(rt.results(7, dag).is_err());
    }

    #[test]
    fn admission_refuses_what_does_not_fit_and_a_session_end_frees_the_lanes() {
        let rt = service(1);
        rt.admit(chain("big", 10_000, 4_000)).unwrap();
        let refused = rt.admit(chain("more", 10_000, 4_000)).unwrap_err();
        assert!(refused.contains("fits on none of 1 lanes"), "{refused}");
        assert_eq!(rt.session_ended(7), 1);
        rt.admit(chain("more", 10_000, 4_000)).unwrap();
    }

    #[test]
    fn a_failed_node_fails_its_release() {
        let rt = service(2);
        let (dag, ..) = rt.admit(chain("f", 10_000, 1_000)).unwrap();
        rt.release_now(7, dag).unwrap();
        let job = rt.take_jobs().remove(0);
        rt.node_done(job.descriptor.task_id, Err(TaskError::KernelFault));
        let job = rt.take_jobs().remove(0);
        rt.node_done(job.descriptor.task_id, Ok(()));
        let release = rt.results(7, dag).unwrap().releases.remove(0);
        assert!(!release.met);
        assert_eq!(release.failed.as_ref().map(|f| f.0), Some(0));
    }

    #[test]
    fn the_release_thread_releases_periodic_dags_every_period() {
        let rt = service(1);
        let mut declared = chain("periodic", 5_000, 100);
        declared.periodic = true;
        let (dag, ..) = rt.admit(declared).unwrap();
        let thread = rt.start_releases(0).unwrap();
        let start = Instant::now();
        let mut released = 0;
        while released < 4 && start.elapsed() < Duration::from_secs(5) {
            for job in rt.take_jobs() {
                // Each source job, then its successor: finish both at once.
                rt.node_done(job.descriptor.task_id, Ok(()));
                for next in rt.take_jobs() {
                    rt.node_done(next.descriptor.task_id, Ok(()));
                }
                released += 1;
            }
            std::thread::sleep(Duration::from_micros(500));
        }
        rt.stop();
        thread.join().unwrap();
        assert!(released >= 4, "released {released} in {:?}", start.elapsed());
        let results = rt.results(7, dag).unwrap();
        assert!(results.released >= 4);
        assert!(start.elapsed() >= Duration::from_millis(20), "four periods of 5 ms");
    }
}
