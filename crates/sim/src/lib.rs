//! `agora sim`: a discrete-event simulator of latency-class and batch tenants sharing devices,
//! for scales this machine cannot hold (TReM's evaluation, chapter 4 of the thesis).
//!
//! It drives the daemon's own latency rules ([`agora_daemon::policy::latency`]): the reserve
//! (`U = ceil(l · q / SLA)` for the tasks outstanding, or more for the latency work arriving),
//! when batch work may start, the play-out of the waiting latency tasks that predicts a miss,
//! when to revoke and which timer to set. The model:
//!
//! * `devices` identical devices, each running one task at a time;
//! * jobs arrive as a Poisson process; a job is *latency* (a request: 1–4 tasks, its response
//!   time is arrival → last task done, met when ≤ the SLA) or *batch* (20 tasks); the workload
//!   mix sets the share of **tasks** that are latency tasks (W1 80:20, W2 50:50);
//! * task durations are Pareto distributed (latency: mean 20 ms, α = 2.5; batch: mean 1 s,
//!   α = 1.5); a job has at most 8 tasks outstanding (queued or running);
//! * the offered load is work arriving per second over device capacity (1.0 = saturated);
//! * revocation takes `preempt_ms` on the victim's device; the victim's executed work is wasted
//!   and it is replayed from the start later;
//! * latency tasks are queued before batch tasks under every policy; `none` never revokes;
//! * what the rules may know: a batch task's duration (the daemon's performance model knows a
//!   kernel at a size; TReM's batch jobs repeat one kernel), but of a latency task only the
//!   running mean `l` of past ones (TReM's `l_e`), so the play-out predicts with `l` and misses
//!   when a task runs long;
//! * the rules are evaluated at every arrival and completion, every 100 ms, and at the
//!   `next_check_in` timer;
//! * batch completion ratios compare each batch job with itself in a second run of the same
//!   seed and policy with revocation off (TReM's Fig. 4.8: Elastic+TReM over Elastic).
//!
//! Deterministic: the same configuration and seed give the same report.

use std::cmp::Ordering;
use std::collections::{BinaryHeap, VecDeque};

use agora_daemon::policy::latency::{
    first_predicted_miss, may_start_batch, next_check_in, predicted_remaining, reserved_devices, reserved_for_arrivals,
    should_revoke, LatencyPolicy, RevokeContext, WaitingTask, MAX_REVOCATIONS_PER_TASK,
};
use serde::Serialize;

/// Workload mixes: the share of tasks that are latency tasks.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Mix {
    /// 80:20 latency:batch tasks.
    W1,
    /// 50:50.
    W2,
}

impl Mix {
    /// Parses `w1` or `w2`.
    pub fn parse(text: &str) -> Result<Mix, String> {
        match text {
            "w1" => Ok(Mix::W1),
            "w2" => Ok(Mix::W2),
            _ => Err(format!("unknown workload '{text}': choose w1 (80:20) or w2 (50:50)")),
        }
    }

    fn latency_task_share(self) -> f64 {
        match self {
            Mix::W1 => 0.8,
            Mix::W2 => 0.5,
        }
    }
}

/// One simulation.
#[derive(Debug, Clone, Serialize)]
pub struct SimConfig {
    /// Workload mix.
    pub workload: Mix,
    /// Offered load (1.0: arriving work equals capacity).
    pub load: f64,
    /// Devices.
    pub devices: usize,
    /// Revocation latency, milliseconds.
    pub preempt_ms: f64,
    /// Latency policy.
    pub policy: LatencyPolicy,
    /// Random seed.
    pub seed: u64,
    /// Response-time target of a latency request, milliseconds.
    pub sla_ms: f64,
    /// Simulated seconds of arrivals (the run continues until every arrived job is done).
    pub seconds: f64,
}

impl Default for SimConfig {
    fn default() -> Self {
        SimConfig {
            workload: Mix::W1,
            load: 1.0,
            devices: 4,
            preempt_ms: 22.0,
            policy: LatencyPolicy::Elastic,
            seed: 1,
            sla_ms: 200.0,
            seconds: 600.0,
        }
    }
}

/// What a simulation measured.
#[derive(Debug, Clone, Serialize)]
pub struct SimReport {
    /// The configuration.
    pub config: SimConfig,
    /// Latency requests finished within the SLA.
    pub sla_met_fraction: f64,
    /// Busy time (useful and wasted) over device time, while jobs were arriving.
    pub utilisation: f64,
    /// Wasted (revoked) work over all executed work.
    pub wasted_fraction: f64,
    /// Latency requests whose every task alone fits the SLA: the most any schedule can meet
    /// (a request with one task longer than the SLA misses however it is run).
    pub sla_attainable_fraction: f64,
    /// TReM's batch-completion figure (Fig. 4.8): per batch job, its completion time (arrival to
    /// last task done) over its completion time in the same run (same seed, same arrivals, same
    /// policy) with revocation off; the median over the jobs. 1.0 for `none`.
    pub batch_median_slowdown: f64,
    /// The 99th percentile of the same ratio.
    pub batch_p99_slowdown: f64,
    /// Median of batch jobs' completion time over their time alone on the devices (all tasks
    /// spread over `min(devices, 8)` devices, never shorter than the longest task). In an open
    /// system at load ≥ 1 this grows with the simulated time under every policy.
    pub batch_median_slowdown_vs_alone: f64,
    /// The 99th percentile of the same.
    pub batch_p99_slowdown_vs_alone: f64,
    /// Latency requests and batch jobs completed.
    pub latency_requests: usize,
    /// Batch jobs completed.
    pub batch_jobs: usize,
    /// Revocations.
    pub revocations: usize,
}

/// xorshift64*: small, fast and reproducible (the simulator needs no cryptographic quality).
struct Rng(u64);

impl Rng {
    fn new(seed: u64) -> Rng {
        Rng(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1)
    }
    fn uniform(&mut self) -> f64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        ((self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)) >> 11) as f64 / (1u64 << 53) as f64
    }
    fn exponential(&mut self, mean: f64) -> f64 {
        -(1.0 - self.uniform()).ln() * mean
    }
    /// Pareto with the given mean and shape α > 1.
    fn pareto(&mut self, mean: f64, alpha: f64) -> f64 {
        let scale = mean * (alpha - 1.0) / alpha;
        scale / (1.0 - self.uniform()).powf(1.0 / alpha)
    }
}

const LATENCY_MEAN_S: f64 = 0.020;
const LATENCY_ALPHA: f64 = 2.5;
const BATCH_MEAN_S: f64 = 1.0;
const BATCH_ALPHA: f64 = 1.5;
const BATCH_TASKS: usize = 20;
const MAX_OUTSTANDING: usize = 8;
/// TReM recomputes its reservation every 100 ms (and at each completion).
const TICK_S: f64 = 0.1;
/// Mean tasks per latency request (uniform 1..=4).
const LATENCY_TASKS_MEAN: f64 = 2.5;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Class {
    Latency,
    Batch,
}

struct Job {
    class: Class,
    arrival: f64,
    durations: Vec<f64>,
    next: usize,
    outstanding: usize,
    done: usize,
}

#[derive(Clone, Copy)]
struct Task {
    job: usize,
    duration: f64,
    /// Times this task was revoked (the starvation guard counts them).
    revocations: u32,
}

#[derive(Clone, Copy)]
struct Running {
    task: Task,
    class: Class,
    started: f64,
    /// Bumped when the device's task is revoked, so its stale completion event is ignored.
    epoch: u64,
}

#[derive(Debug, PartialEq)]
struct Event {
    time: f64,
    sequence: u64,
    kind: EventKind,
}

#[derive(Debug, PartialEq)]
enum EventKind {
    Arrival,
    Finish {
        device: usize,
        epoch: u64,
    },
    /// A revocation finished: the device is free again.
    Revoked {
        device: usize,
    },
    Recompute,
    /// The timer of `next_check_in`.
    Check,
}

impl Eq for Event {}
impl Ord for Event {
    fn cmp(&self, other: &Self) -> Ordering {
        // Earliest first (BinaryHeap is a max-heap), ties in insertion order.
        other
            .time
            .total_cmp(&self.time)
            .then(other.sequence.cmp(&self.sequence))
    }
}
impl PartialOrd for Event {
    fn partial_cmp(&self, other: &Self) -> Option<Ordering> {
        Some(self.cmp(other))
    }
}

struct Sim {
    config: SimConfig,
    rng: Rng,
    events: BinaryHeap<Event>,
    sequence: u64,
    jobs: Vec<Job>,
    latency_ready: VecDeque<Task>,
    batch_ready: VecDeque<Task>,
    devices: Vec<Option<Running>>,
    /// Devices unavailable until a revocation completes.
    revoke_until: Vec<Option<f64>>,
    epochs: Vec<u64>,
    reserved: usize,
    /// `l`: running mean of latency tasks' execution times (old:new 4:1).
    mean_latency_exec: f64,
    /// Latency tasks arrived since the last tick.
    arrived_tick: usize,
    /// Arriving latency work, device-seconds per second, averaged over the ticks.
    latency_work_rate: f64,
    busy: f64,
    wasted: f64,
    executed: f64,
    revocations: usize,
    latency_responses: Vec<f64>,
    /// Requests whose longest task alone exceeds the SLA: no scheduling meets them.
    hopeless: usize,
    batch_done: Vec<BatchDone>,
    /// Whether `should_revoke` is consulted at all (off for the batch-completion baseline).
    revocation: bool,
    busy_at_end_of_arrivals: Option<f64>,
    /// The pending `Check` timer.
    check_at: Option<f64>,
}

/// A finished batch job.
#[derive(Clone, Copy)]
struct BatchDone {
    job: usize,
    /// Arrival to last task done.
    response: f64,
    /// Its completion time alone on the devices.
    alone: f64,
}

impl Sim {
    fn push(&mut self, time: f64, kind: EventKind) {
        self.sequence += 1;
        self.events.push(Event {
            time,
            sequence: self.sequence,
            kind,
        });
    }

    fn arrival(&mut self, now: f64) {
        let share = self.config.workload.latency_task_share();
        // Jobs are latency with the probability that gives the wanted share of *tasks*.
        let latency_jobs = share / LATENCY_TASKS_MEAN;
        let batch_jobs = (1.0 - share) / BATCH_TASKS as f64;
        let is_latency = self.rng.uniform() < latency_jobs / (latency_jobs + batch_jobs);
        let (class, durations) = if is_latency {
            let n = 1 + (self.rng.uniform() * 4.0) as usize;
            let d = (0..n.min(4))
                .map(|_| self.rng.pareto(LATENCY_MEAN_S, LATENCY_ALPHA))
                .collect();
            self.arrived_tick += n;
            (Class::Latency, d)
        } else {
            let d = (0..BATCH_TASKS)
                .map(|_| self.rng.pareto(BATCH_MEAN_S, BATCH_ALPHA))
                .collect();
            (Class::Batch, d)
        };
        self.jobs.push(Job {
            class,
            arrival: now,
            durations,
            next: 0,
            outstanding: 0,
            done: 0,
        });
        let job = self.jobs.len() - 1;
        self.release(job);
    }

    /// Makes up to the outstanding limit of a job's tasks ready.
    fn release(&mut self, job: usize) {
        let j = &mut self.jobs[job];
        while j.outstanding < MAX_OUTSTANDING && j.next < j.durations.len() {
            let task = Task {
                job,
                duration: j.durations[j.next],
                revocations: 0,
            };
            j.next += 1;
            j.outstanding += 1;
            match j.class {
                Class::Latency => self.latency_ready.push_back(task),
                Class::Batch => self.batch_ready.push_back(task),
            }
        }
    }

    fn count_running(&self, class: Class) -> usize {
        self.devices.iter().flatten().filter(|r| r.class == class).count()
    }

    fn recompute_reserve(&mut self) {
        let current = self.latency_ready.len() + self.count_running(Class::Latency);
        let for_outstanding = reserved_devices(
            self.mean_latency_exec,
            current,
            self.config.sla_ms / 1e3,
            self.config.devices,
        );
        self.reserved = for_outstanding.max(reserved_for_arrivals(self.latency_work_rate, self.config.devices));
    }

    fn start(&mut self, device: usize, task: Task, class: Class, now: f64) {
        self.epochs[device] += 1;
        let epoch = self.epochs[device];
        self.devices[device] = Some(Running {
            task,
            class,
            started: now,
            epoch,
        });
        self.push(now + task.duration, EventKind::Finish { device, epoch });
    }

    /// Starts what may start on free devices; then lets waiting latency tasks revoke batch ones.
    fn schedule(&mut self, now: f64) {
        let policy = self.config.policy;
        for device in 0..self.devices.len() {
            if self.devices[device].is_some() || self.revoke_until[device].is_some() {
                continue;
            }
            if let Some(task) = self.latency_ready.pop_front() {
                self.start(device, task, Class::Latency, now);
            } else if may_start_batch(
                policy,
                self.count_running(Class::Batch),
                self.config.devices,
                self.reserved,
            ) {
                if let Some(task) = self.batch_ready.pop_front() {
                    self.start(device, task, Class::Batch, now);
                }
            }
        }
        if !self.revocation || self.latency_ready.is_empty() {
            return;
        }
        let cost = self.config.preempt_ms / 1e3;
        let sla = self.config.sla_ms / 1e3;
        self.revoke_waiting(now, cost, sla);
        if policy == LatencyPolicy::Elastic && !self.latency_ready.is_empty() {
            let l = self.mean_latency_exec;
            let waiting: Vec<WaitingTask> = self
                .latency_ready
                .iter()
                .map(|t| WaitingTask {
                    predicted_s: l,
                    deadline_in_s: self.jobs[t.job].arrival + sla - now,
                })
                .collect();
            if let Some(wait) = next_check_in(&waiting, cost) {
                let at = now + wait;
                if self.check_at.is_none_or(|pending| at < pending) {
                    self.check_at = Some(at);
                    self.push(at, EventKind::Check);
                }
            }
        }
    }

    /// Lets waiting latency tasks revoke running batch tasks, as `should_revoke` decides.
    fn revoke_waiting(&mut self, now: f64, cost: f64, sla: f64) {
        let policy = self.config.policy;
        // At most one device per waiting latency task, counting revocations already under way.
        let mut rounds = self
            .latency_ready
            .len()
            .saturating_sub(self.revoke_until.iter().flatten().count());
        while rounds > 0 {
            rounds -= 1;
            // The victim: the batch task that has run the least (least work wasted), among those
            // the starvation guard still allows.
            let victim = self
                .devices
                .iter()
                .enumerate()
                .filter_map(|(d, r)| r.filter(|r| r.class == Class::Batch).map(|r| (d, r)))
                .min_by(|a, b| {
                    (a.1.task.revocations >= MAX_REVOCATIONS_PER_TASK)
                        .cmp(&(b.1.task.revocations >= MAX_REVOCATIONS_PER_TASK))
                        .then(b.1.started.total_cmp(&a.1.started))
                });
            let Some((device, running)) = victim else { break };
            // Batch tasks' durations are known (the daemon's performance model knows a kernel
            // at a size; TReM's batch jobs repeat one kernel). A latency task's is not: the rules
            // see the running mean `l` of latency tasks, as TReM's `l_e`.
            let l = self.mean_latency_exec;
            let free_in: Vec<f64> = (0..self.devices.len())
                .map(|d| match (self.devices[d], self.revoke_until[d]) {
                    (_, Some(until)) => until - now,
                    (Some(r), None) if r.class == Class::Batch => r.started + r.task.duration - now,
                    (Some(r), None) => predicted_remaining(l, now - r.started),
                    (None, None) => 0.0,
                })
                .collect();
            let waiting: Vec<WaitingTask> = self
                .latency_ready
                .iter()
                .map(|t| WaitingTask {
                    predicted_s: l,
                    deadline_in_s: self.jobs[t.job].arrival + sla - now,
                })
                .collect();
            let (earliest_free_s, slack_s) = match first_predicted_miss(&free_in, &waiting, cost) {
                Some(miss) => (miss.start_in_s, miss.latest_start_in_s),
                // Nothing to save: only `priority` revokes now.
                None => (0.0, 0.0),
            };
            let context = RevokeContext {
                latency_running: self.count_running(Class::Latency),
                reserved: self.reserved,
                victim_remaining_s: running.started + running.task.duration - now,
                victim_elapsed_s: now - running.started,
                victim_revocations: running.task.revocations,
                sla_s: sla,
                revoke_cost_s: cost,
                earliest_free_s,
                slack_s,
            };
            if !should_revoke(policy, &context) {
                break;
            }
            let executed = now - running.started;
            self.busy += executed;
            self.executed += executed;
            self.wasted += executed;
            self.revocations += 1;
            self.devices[device] = None;
            self.epochs[device] += 1;
            // Replayed from the start later, ahead of the job's other ready tasks.
            self.batch_ready.push_front(Task {
                revocations: running.task.revocations + 1,
                ..running.task
            });
            // The device is unavailable while the revocation takes effect; a latency task then
            // starts there (the queue is latency-first).
            self.revoke_until[device] = Some(now + cost);
            self.busy += cost;
            self.push(now + cost, EventKind::Revoked { device });
        }
    }

    fn finish(&mut self, device: usize, now: f64) {
        let Some(running) = self.devices[device].take() else {
            return;
        };
        self.busy += running.task.duration;
        self.executed += running.task.duration;
        if running.class == Class::Latency {
            self.mean_latency_exec = 0.8 * self.mean_latency_exec + 0.2 * running.task.duration;
        }
        let job = &mut self.jobs[running.task.job];
        job.outstanding -= 1;
        job.done += 1;
        if job.done == job.durations.len() {
            let response = now - job.arrival;
            match job.class {
                Class::Latency => {
                    self.latency_responses.push(response);
                    if job.durations.iter().any(|d| *d > self.config.sla_ms / 1e3) {
                        self.hopeless += 1;
                    }
                }
                Class::Batch => {
                    // Alone: the tasks on all devices, at most 8 at a time, never shorter than the
                    // longest task.
                    let total: f64 = job.durations.iter().sum();
                    let longest = job.durations.iter().copied().fold(0.0, f64::max);
                    let width = self.config.devices.min(MAX_OUTSTANDING) as f64;
                    self.batch_done.push(BatchDone {
                        job: running.task.job,
                        response,
                        alone: (total / width).max(longest),
                    });
                }
            }
        } else {
            self.release(running.task.job);
        }
        self.recompute_reserve();
    }
}

fn percentile(values: &mut [f64], p: f64) -> f64 {
    if values.is_empty() {
        return 0.0;
    }
    values.sort_by(f64::total_cmp);
    values[((values.len() - 1) as f64 * p).round() as usize]
}

/// Runs the event loop once, with or without revocation.
fn run(config: &SimConfig, revocation: bool) -> Sim {
    let devices = config.devices.max(1);
    let share = config.workload.latency_task_share();
    // Mean work per job, for the arrival rate that gives the offered load.
    let latency_jobs = share / LATENCY_TASKS_MEAN;
    let batch_jobs = (1.0 - share) / BATCH_TASKS as f64;
    let p_latency = latency_jobs / (latency_jobs + batch_jobs);
    let work_per_job =
        p_latency * LATENCY_TASKS_MEAN * LATENCY_MEAN_S + (1.0 - p_latency) * BATCH_TASKS as f64 * BATCH_MEAN_S;
    let mean_interarrival = work_per_job / (config.load.max(1e-6) * devices as f64);
    let mut sim = Sim {
        config: SimConfig {
            devices,
            ..config.clone()
        },
        rng: Rng::new(config.seed),
        events: BinaryHeap::new(),
        sequence: 0,
        jobs: Vec::new(),
        latency_ready: VecDeque::new(),
        batch_ready: VecDeque::new(),
        devices: vec![None; devices],
        revoke_until: vec![None; devices],
        epochs: vec![0; devices],
        reserved: 0,
        mean_latency_exec: LATENCY_MEAN_S,
        arrived_tick: 0,
        latency_work_rate: 0.0,
        busy: 0.0,
        wasted: 0.0,
        executed: 0.0,
        revocations: 0,
        latency_responses: Vec::new(),
        hopeless: 0,
        batch_done: Vec::new(),
        revocation,
        busy_at_end_of_arrivals: None,
        check_at: None,
    };
    let first = sim.rng.exponential(mean_interarrival);
    sim.push(first, EventKind::Arrival);
    sim.push(TICK_S, EventKind::Recompute);
    while let Some(event) = sim.events.pop() {
        let now = event.time;
        match event.kind {
            EventKind::Arrival => {
                if now > config.seconds {
                    sim.busy_at_end_of_arrivals.get_or_insert(sim.busy);
                    continue;
                }
                sim.arrival(now);
                let next = now + sim.rng.exponential(mean_interarrival);
                sim.push(next, EventKind::Arrival);
                sim.recompute_reserve();
            }
            EventKind::Finish { device, epoch } => {
                if sim.devices[device].is_some_and(|r| r.epoch == epoch) {
                    sim.finish(device, now);
                }
            }
            EventKind::Revoked { device } => sim.revoke_until[device] = None,
            EventKind::Check => {
                if sim.check_at == Some(now) {
                    sim.check_at = None;
                }
            }
            EventKind::Recompute => {
                // Latency work that arrived in this tick, predicted with `l`, averaged over the
                // ticks (old:new 19:1, about 2 s), so bursts do not swing the reserve.
                let sample = sim.arrived_tick as f64 * sim.mean_latency_exec / TICK_S;
                sim.arrived_tick = 0;
                sim.latency_work_rate = 0.95 * sim.latency_work_rate + 0.05 * sample;
                sim.recompute_reserve();
                if now < config.seconds || !sim.latency_ready.is_empty() || !sim.batch_ready.is_empty() {
                    sim.push(now + TICK_S, EventKind::Recompute);
                }
            }
        }
        sim.schedule(now);
    }
    sim
}

/// Runs one simulation, and the same one (same seed, same arrivals) without revocation for the
/// batch-completion ratios.
pub fn simulate(config: &SimConfig) -> SimReport {
    let sim = run(config, true);
    let baseline = run(config, false);
    let horizon = config.seconds * sim.config.devices as f64;
    let utilisation = (sim.busy_at_end_of_arrivals.unwrap_or(sim.busy) / horizon).min(1.0);
    let sla = config.sla_ms / 1e3;
    let met = sim.latency_responses.iter().filter(|r| **r <= sla).count();
    let latency_requests = sim.latency_responses.len();
    let batch_jobs = sim.batch_done.len();
    // The arrivals do not depend on the schedule, so job indices match across the two runs.
    let mut without: Vec<Option<f64>> = vec![None; sim.jobs.len()];
    for done in &baseline.batch_done {
        without[done.job] = Some(done.response);
    }
    let mut vs_no_revocation: Vec<f64> = sim
        .batch_done
        .iter()
        .filter_map(|done| without[done.job].map(|w| done.response / w))
        .collect();
    let mut vs_alone: Vec<f64> = sim.batch_done.iter().map(|d| d.response / d.alone).collect();
    let fraction = |part: usize, all: usize| if all == 0 { 1.0 } else { part as f64 / all as f64 };
    SimReport {
        config: sim.config.clone(),
        sla_met_fraction: fraction(met, latency_requests),
        sla_attainable_fraction: fraction(latency_requests - sim.hopeless, latency_requests),
        utilisation,
        wasted_fraction: if sim.executed > 0.0 {
            sim.wasted / sim.executed
        } else {
            0.0
        },
        batch_median_slowdown: percentile(&mut vs_no_revocation, 0.5),
        batch_p99_slowdown: percentile(&mut vs_no_revocation, 0.99),
        batch_median_slowdown_vs_alone: percentile(&mut vs_alone, 0.5),
        batch_p99_slowdown_vs_alone: percentile(&mut vs_alone, 0.99),
        latency_requests,
        batch_jobs,
        revocations: sim.revocations,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn quick(policy: LatencyPolicy, load: f64) -> SimReport {
        simulate(&SimConfig {
            policy,
            load,
            seconds: 120.0,
            ..SimConfig::default()
        })
    }

    #[test]
    fn the_same_seed_gives_the_same_report() {
        let a = quick(LatencyPolicy::Elastic, 1.0);
        let b = quick(LatencyPolicy::Elastic, 1.0);
        assert_eq!(serde_json_like(&a), serde_json_like(&b));
        let c = simulate(&SimConfig {
            seed: 2,
            seconds: 120.0,
            ..SimConfig::default()
        });
        assert_ne!(a.latency_requests, c.latency_requests, "another seed, another run");
    }

    fn serde_json_like(r: &SimReport) -> String {
        format!(
            "{} {} {} {} {} {}",
            r.sla_met_fraction,
            r.utilisation,
            r.wasted_fraction,
            r.batch_median_slowdown,
            r.latency_requests,
            r.revocations
        )
    }

    #[test]
    fn revocation_protects_latency_work_and_none_never_revokes() {
        let none = quick(LatencyPolicy::None, 1.5);
        let elastic = quick(LatencyPolicy::Elastic, 1.5);
        assert_eq!(none.revocations, 0);
        assert_eq!(none.wasted_fraction, 0.0);
        assert!(
            elastic.sla_met_fraction > none.sla_met_fraction,
            "elastic {} vs none {}",
            elastic.sla_met_fraction,
            none.sla_met_fraction
        );
    }

    #[test]
    fn batch_ratios_compare_with_the_same_run_without_revocation() {
        // `none` never revokes: its run without revocation is the same run, job for job.
        let none = quick(LatencyPolicy::None, 1.0);
        assert_eq!((none.batch_median_slowdown, none.batch_p99_slowdown), (1.0, 1.0));
        assert!(none.batch_median_slowdown_vs_alone > 1.0);
        // Revocations replay batch tasks: some job finishes later than without them.
        let priority = quick(LatencyPolicy::Priority, 1.0);
        assert!(priority.revocations > 0);
        assert!(priority.batch_p99_slowdown > 1.0, "{}", priority.batch_p99_slowdown);
        for r in [&none, &priority] {
            assert!(r.sla_met_fraction <= r.sla_attainable_fraction + 1e-12);
        }
    }

    #[test]
    fn utilisation_follows_the_offered_load() {
        let u: Vec<f64> = [0.25, 0.5, 1.0]
            .iter()
            .map(|l| quick(LatencyPolicy::None, *l).utilisation)
            .collect();
        assert!(u[0] < u[1] && u[1] < u[2], "{u:?}");
        // Heavy-tailed (Pareto 1.5) batch work makes short runs noisy: a wide band around 0.25.
        assert!((0.1..0.45).contains(&u[0]), "{u:?}");
    }
}
