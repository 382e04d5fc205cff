//! The event loop of the simulator: releases, slice ends, completions and dispatch.
//!
//! Owns the simulated state (jobs, instances, what runs where) and the policies' decisions. At
//! each event time it handles, in this fixed order: slices that end (completions, chunk
//! boundaries), then DAG releases, then one dispatch. Ties are broken by index everywhere and
//! the only randomness is the seeded ChaCha stream, drawn once per job at its release, so runs
//! are reproducible. It must not validate its inputs: [`super::simulate`] has.
//!
//! APEDF's "fits" is the job-level EDF check the lane can make at a release: the lane's own
//! pending jobs plus the new one, in deadline order with their remaining budgets, all finish
//! by their deadlines (after the current chunk, if launches are chunked). For a partition that
//! admission accepted this always holds on the home lane, so admitted sets never migrate.

use std::collections::VecDeque;

use chacha20::ChaCha8Rng;
use rand::{RngExt, SeedableRng};

use super::stats::{build_report, DagCounters};
use super::{Policy, SimulationConfig, SimulationReport, Workload};
use crate::admission::{inflated_wcet, Packing};

/// Static facts about one node, indexed by a global node number.
struct NodeInfo {
    dag: usize,
    wcet: u64,
    budget: u64,
    release_offset: u64,
    relative_deadline: u64,
    home: Option<usize>,
    /// Global numbers of successors.
    successors: Vec<usize>,
    predecessor_count: usize,
}

/// Where a released job may run.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Queue {
    /// Any lane (FIFO, global EDF, APEDF's fallback).
    Global,
    /// Only this lane (APEDF home or push target).
    Local(usize),
}

struct Job {
    node: usize,
    instance: usize,
    release: u64,
    deadline: u64,
    budget: u64,
    actual: u64,
    executed: u64,
    overrun: bool,
    /// Budget overrun accumulated in the whole system when this job was released.
    excess_at_release: u64,
    queue: Queue,
    on_lane: Option<usize>,
}

struct Instance {
    release: u64,
    /// Unfinished predecessors of each node of the DAG, by node index within the DAG.
    waiting_on: Vec<usize>,
    unfinished_nodes: usize,
    overrun_affected: bool,
}

#[derive(Clone, Copy)]
struct Running {
    job: usize,
    since: u64,
    slice_end: u64,
}

pub(super) struct Engine<'a> {
    workload: &'a Workload,
    config: SimulationConfig,
    nodes: Vec<NodeInfo>,
    /// Global number of node 0 of each DAG.
    first_node: Vec<usize>,
    jobs: Vec<Job>,
    /// Released, unfinished jobs in release order.
    pending: Vec<usize>,
    instances: Vec<Instance>,
    lanes: Vec<Option<Running>>,
    /// A job of this node is released and unfinished (one thread per node).
    node_busy: Vec<bool>,
    /// Instances whose job of this node waits for the previous one to finish.
    held: Vec<VecDeque<usize>>,
    last_lane: Vec<Option<usize>>,
    next_release: Vec<u64>,
    /// Microseconds executed beyond budgets, accounted up to each running job's `since`.
    excess_accounted: u64,
    counters: Vec<DagCounters>,
    rng: ChaCha8Rng,
    now: u64,
}

impl<'a> Engine<'a> {
    pub(super) fn new(workload: &'a Workload, config: &SimulationConfig) -> Self {
        let mut nodes = Vec::new();
        let mut first_node = Vec::with_capacity(workload.dags.len());
        for (dag_index, dag) in workload.dags.iter().enumerate() {
            let base = nodes.len();
            first_node.push(base);
            for node in 0..dag.node_count() {
                let timing = dag.node_timing(node);
                let home = workload.home_lanes.as_ref().map(|lanes| lanes[dag_index][node]);
                nodes.push(NodeInfo {
                    dag: dag_index,
                    wcet: dag.node(node).wcet_us,
                    budget: inflated_wcet(dag.node(node).wcet_us, config.wcet_margin),
                    release_offset: timing.release_offset_us,
                    relative_deadline: timing.relative_deadline_us,
                    home,
                    successors: dag.successors(node).iter().map(|&successor| base + successor).collect(),
                    predecessor_count: dag.predecessors(node).len(),
                });
            }
        }
        let apedf = config.policy.packing().is_some();
        let node_count = nodes.len();
        let last_lane = nodes.iter().map(|node| if apedf { node.home } else { None }).collect();
        Self {
            workload,
            config: *config,
            nodes,
            first_node,
            jobs: Vec::new(),
            pending: Vec::new(),
            instances: Vec::new(),
            lanes: vec![None; config.lanes],
            node_busy: vec![false; node_count],
            held: vec![VecDeque::new(); node_count],
            last_lane,
            next_release: vec![0; workload.dags.len()],
            excess_accounted: 0,
            counters: vec![DagCounters::default(); workload.dags.len()],
            rng: ChaCha8Rng::seed_from_u64(config.seed),
            now: 0,
        }
    }

    pub(super) fn run(mut self) -> SimulationReport {
        loop {
            let next_release = self
                .next_release
                .iter()
                .copied()
                .filter(|&time| time < self.config.duration_us)
                .min();
            let next_slice_end = self.lanes.iter().flatten().map(|running| running.slice_end).min();
            let Some(now) = [next_release, next_slice_end].into_iter().flatten().min() else {
                break;
            };
            self.now = now;
            for lane in 0..self.lanes.len() {
                if let Some(running) = self.lanes[lane] {
                    if running.slice_end == now {
                        self.end_slice(lane, running);
                    }
                }
            }
            for dag in 0..self.next_release.len() {
                if self.next_release[dag] == now && now < self.config.duration_us {
                    self.release_instance(dag);
                    self.next_release[dag] += self.workload.dags[dag].period_us();
                }
            }
            self.dispatch();
        }
        debug_assert!(
            self.pending.is_empty(),
            "every released job finishes once releases stop"
        );
        let names = self.workload.dags.iter().map(|dag| dag.name().to_owned()).collect();
        build_report(
            self.config.policy,
            self.config.lanes,
            self.config.duration_us,
            self.now,
            names,
            self.counters,
        )
    }

    // ----- execution accounting -----

    /// Adds `amount` of execution to `job`, accounting any part beyond its budget.
    fn execute(&mut self, job: usize, amount: u64) {
        let record = &mut self.jobs[job];
        let excess_before = record.executed.saturating_sub(record.budget);
        record.executed += amount;
        let excess_after = record.executed.saturating_sub(record.budget);
        self.excess_accounted += excess_after - excess_before;
    }

    /// Budget overrun in the whole system up to now, including running slices.
    fn excess_now(&self) -> u64 {
        let in_progress: u64 = self
            .lanes
            .iter()
            .flatten()
            .map(|running| {
                let job = &self.jobs[running.job];
                let executed = job.executed + (self.now - running.since);
                executed.saturating_sub(job.budget) - job.executed.saturating_sub(job.budget)
            })
            .sum();
        self.excess_accounted + in_progress
    }

    fn end_slice(&mut self, lane: usize, running: Running) {
        self.execute(running.job, self.now - running.since);
        self.lanes[lane] = None;
        self.jobs[running.job].on_lane = None;
        if self.jobs[running.job].executed >= self.jobs[running.job].actual {
            self.complete(running.job);
        }
        // Otherwise a chunk boundary: the job stays pending and dispatch decides what runs next.
    }

    // ----- releases and completions -----

    fn release_instance(&mut self, dag: usize) {
        let instance = self.instances.len();
        let node_count = self.workload.dags[dag].node_count();
        let base = self.first_node[dag];
        let waiting_on: Vec<usize> = (0..node_count)
            .map(|node| self.nodes[base + node].predecessor_count)
            .collect();
        self.instances.push(Instance {
            release: self.now,
            waiting_on,
            unfinished_nodes: node_count,
            overrun_affected: false,
        });
        self.counters[dag].releases += 1;
        for node in 0..node_count {
            if self.nodes[base + node].predecessor_count == 0 {
                self.node_ready(base + node, instance);
            }
        }
    }

    /// All predecessors of `node` in `instance` have finished.
    fn node_ready(&mut self, node: usize, instance: usize) {
        if self.node_busy[node] {
            self.held[node].push_back(instance);
        } else {
            self.node_busy[node] = true;
            self.release_job(node, instance);
        }
    }

    fn release_job(&mut self, node: usize, instance: usize) {
        let info = &self.nodes[node];
        // Draw every random number for the job here, in a fixed order, so the stream does not
        // depend on the policy's decisions.
        let fraction = if self.config.execution.min_fraction < self.config.execution.max_fraction {
            self.rng
                .random_range(self.config.execution.min_fraction..=self.config.execution.max_fraction)
        } else {
            self.config.execution.min_fraction
        };
        let mut actual = ((info.wcet as f64 * fraction).round() as u64).clamp(1, info.wcet);
        let mut overrun = false;
        if let Some(injection) = self.config.overrun {
            if self.rng.random_bool(injection.probability) {
                overrun = true;
                actual = actual.max((info.wcet as f64 * injection.factor).ceil() as u64);
            }
        }
        let dag = info.dag;
        let deadline = self.instances[instance].release + info.release_offset + info.relative_deadline;
        let budget = info.budget;
        let job = self.jobs.len();
        self.jobs.push(Job {
            node,
            instance,
            release: self.now,
            deadline,
            budget,
            actual,
            executed: 0,
            overrun,
            excess_at_release: 0,
            queue: Queue::Global,
            on_lane: None,
        });
        self.jobs[job].excess_at_release = self.excess_now();
        if overrun {
            self.counters[dag].overrun_jobs += 1;
        }
        self.jobs[job].queue = self.choose_queue(job);
        self.pending.push(job);
    }

    fn complete(&mut self, job: usize) {
        if let Some(position) = self.pending.iter().position(|&pending| pending == job) {
            self.pending.remove(position);
        }
        let record = &self.jobs[job];
        let (node, instance, deadline) = (record.node, record.instance, record.deadline);
        let affected =
            record.overrun || self.instances[instance].overrun_affected || self.excess_now() > record.excess_at_release;
        self.instances[instance].overrun_affected |= affected;
        let dag = self.nodes[node].dag;
        if self.now > deadline {
            self.counters[dag].node_deadline_misses += 1;
        }

        let base = self.first_node[dag];
        for index in 0..self.nodes[node].successors.len() {
            let successor = self.nodes[node].successors[index];
            let waiting = &mut self.instances[instance].waiting_on[successor - base];
            *waiting -= 1;
            if *waiting == 0 {
                self.node_ready(successor, instance);
            }
        }

        let record = &mut self.instances[instance];
        record.unfinished_nodes -= 1;
        if record.unfinished_nodes == 0 {
            let response = self.now - record.release;
            let deadline = self.workload.dags[dag].deadline_us();
            let counters = &mut self.counters[dag];
            counters.response_times_us.push(response);
            counters.ratios.push(response as f64 / deadline as f64);
            if response > deadline {
                counters.deadline_misses += 1;
                if record.overrun_affected {
                    counters.overrun_misses += 1;
                }
            }
        }

        match self.held[node].pop_front() {
            Some(next_instance) => self.release_job(node, next_instance),
            None => self.node_busy[node] = false,
        }
    }

    // ----- APEDF placement at release -----

    fn choose_queue(&self, job: usize) -> Queue {
        let Some(packing) = self.config.policy.packing() else {
            return Queue::Global;
        };
        let Some(home) = self.nodes[self.jobs[job].node].home else {
            return Queue::Global;
        };
        if self.lane_fits(home, job) {
            return Queue::Local(home);
        }
        let mut others: Vec<usize> = (0..self.lanes.len()).filter(|&lane| lane != home).collect();
        if packing == Packing::WorstFit {
            let committed: Vec<u64> = (0..self.lanes.len()).map(|lane| self.committed_work(lane)).collect();
            others.sort_by_key(|&lane| (committed[lane], lane));
        }
        others
            .into_iter()
            .find(|&lane| self.lane_fits(lane, job))
            .map_or(Queue::Global, Queue::Local)
    }

    fn remaining_budget(&self, job: usize) -> u64 {
        let record = &self.jobs[job];
        let mut executed = record.executed;
        if let Some(lane) = record.on_lane {
            if let Some(running) = self.lanes[lane] {
                executed += self.now - running.since;
            }
        }
        record.budget.saturating_sub(executed)
    }

    fn committed_work(&self, lane: usize) -> u64 {
        self.pending
            .iter()
            .filter(|&&job| self.jobs[job].queue == Queue::Local(lane))
            .map(|&job| self.remaining_budget(job))
            .sum()
    }

    /// Whether `lane`'s own jobs plus `job` all meet their deadlines under EDF with their
    /// remaining budgets, starting after the running chunk when launches are chunked.
    fn lane_fits(&self, lane: usize, job: usize) -> bool {
        let mut work: Vec<(u64, u64)> = self
            .pending
            .iter()
            .filter(|&&pending| self.jobs[pending].queue == Queue::Local(lane))
            .map(|&pending| (self.jobs[pending].deadline, self.remaining_budget(pending)))
            .collect();
        work.push((self.jobs[job].deadline, self.jobs[job].budget));
        work.sort_unstable();
        let blocking = match self.lanes[lane] {
            Some(running) if self.config.preemption_granularity_us > 0 => running.slice_end - self.now,
            _ => 0,
        };
        let mut finish = self.now + blocking;
        work.into_iter().all(|(deadline, remaining)| {
            finish += remaining;
            finish <= deadline
        })
    }

    // ----- dispatch -----

    fn key(&self, job: usize) -> (u64, u64, usize) {
        let record = &self.jobs[job];
        match self.config.policy {
            Policy::Fifo => (record.release, 0, job),
            _ => (record.deadline, record.release, job),
        }
    }

    fn lane_is_open(&self, lane: usize) -> bool {
        self.lanes[lane].is_none() || self.config.preemption_granularity_us == 0
    }

    fn dispatch(&mut self) {
        // Fully preemptive lanes can be reconsidered now: bring their accounting up to date.
        if self.config.preemption_granularity_us == 0 {
            for lane in 0..self.lanes.len() {
                if let Some(running) = self.lanes[lane] {
                    self.execute(running.job, self.now - running.since);
                    self.lanes[lane] = Some(Running {
                        since: self.now,
                        ..running
                    });
                }
            }
        }
        let open: Vec<usize> = (0..self.lanes.len()).filter(|&lane| self.lane_is_open(lane)).collect();
        if open.is_empty() {
            return;
        }
        let mut pick: Vec<Option<usize>> = vec![None; self.lanes.len()];
        if self.config.policy.packing().is_some() {
            self.pick_apedf(&open, &mut pick);
        } else {
            self.pick_global(&open, &mut pick);
        }
        for &lane in &open {
            let current = self.lanes[lane].map(|running| running.job);
            if current == pick[lane] {
                continue;
            }
            if let Some(preempted) = current {
                self.jobs[preempted].on_lane = None;
                self.lanes[lane] = None;
            }
        }
        for &lane in &open {
            if let Some(job) = pick[lane] {
                if self.lanes[lane].is_none() {
                    self.start(lane, job);
                }
            }
        }
    }

    fn candidate(&self, job: usize) -> bool {
        self.jobs[job].on_lane.is_none_or(|lane| self.lane_is_open(lane))
    }

    fn pick_global(&self, open: &[usize], pick: &mut [Option<usize>]) {
        let mut candidates: Vec<usize> = self
            .pending
            .iter()
            .copied()
            .filter(|&job| self.candidate(job))
            .collect();
        candidates.sort_by_key(|&job| self.key(job));
        candidates.truncate(open.len());
        let mut unplaced = Vec::new();
        for job in candidates {
            match self.jobs[job].on_lane {
                Some(lane) => pick[lane] = Some(job),
                None => unplaced.push(job),
            }
        }
        let mut free: Vec<usize> = open.iter().copied().filter(|&lane| pick[lane].is_none()).collect();
        for job in unplaced {
            let preferred =
                self.last_lane[self.jobs[job].node].and_then(|last| free.iter().position(|&lane| lane == last));
            let lane = free.remove(preferred.unwrap_or(0));
            pick[lane] = Some(job);
        }
    }

    fn pick_apedf(&self, open: &[usize], pick: &mut [Option<usize>]) {
        for &lane in open {
            pick[lane] = self
                .pending
                .iter()
                .copied()
                .filter(|&job| self.jobs[job].queue == Queue::Local(lane))
                .min_by_key(|&job| self.key(job));
        }
        let mut globals: Vec<usize> = self
            .pending
            .iter()
            .copied()
            .filter(|&job| self.jobs[job].queue == Queue::Global && self.candidate(job))
            .collect();
        globals.sort_by_key(|&job| self.key(job));
        let mut taken = vec![false; self.lanes.len()];
        for job in globals {
            let key = self.key(job);
            let beats = |lane: usize| !taken[lane] && pick[lane].is_none_or(|current| key < self.key(current));
            let current_lane = self.jobs[job].on_lane.filter(|&lane| beats(lane));
            let last = self.last_lane[self.jobs[job].node]
                .filter(|&lane| self.lane_is_open(lane) && beats(lane) && pick[lane].is_none());
            let idle = open.iter().copied().find(|&lane| beats(lane) && pick[lane].is_none());
            let latest = open
                .iter()
                .copied()
                .filter(|&lane| beats(lane))
                .max_by_key(|&lane| pick[lane].map(|current| self.key(current)));
            let Some(lane) = current_lane.or(last).or(idle).or(latest) else {
                // Later global jobs have later deadlines: none of them can win a lane either.
                break;
            };
            pick[lane] = Some(job);
            taken[lane] = true;
        }
    }

    fn start(&mut self, lane: usize, job: usize) {
        let node = self.jobs[job].node;
        if self.last_lane[node].is_some_and(|last| last != lane) {
            self.counters[self.nodes[node].dag].migrations += 1;
        }
        self.last_lane[node] = Some(lane);
        let remaining = self.jobs[job].actual - self.jobs[job].executed;
        let slice = match self.config.preemption_granularity_us {
            0 => remaining,
            chunk => remaining.min(chunk),
        };
        self.jobs[job].on_lane = Some(lane);
        self.lanes[lane] = Some(Running {
            job,
            since: self.now,
            slice_end: self.now + slice,
        });
    }
}
