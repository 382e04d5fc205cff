//! `agora sim`: a discrete-event simulator of latency-class and batch tenants sharing devices,
//! for scales this machine cannot hold (TReM's evaluation, chapter 4 of the thesis).
//!
//! It drives the daemon's own latency rules ([`agora_daemon::policy::latency`]): reservation
//! `U = ceil(l · q / SLA)`, when batch work may start, when to revoke. The model:
//!
//! * `devices` identical devices, each running one task at a time;
//! * jobs arrive as a Poisson process; a job is *latency* (a request: 1–4 tasks, its response
//!   time is arrival → last task done, met when ≤ the SLA) or *batch* (20 tasks); the workload
//!   mix sets the share of **tasks** that are latency tasks (W1 80:20, W2 50:50);
//! * task durations are Pareto distributed (latency: mean 10 ms, α = 2.5; batch: mean 100 ms,
//!   α = 1.5); a job has at most 8 tasks outstanding (queued or running);
//! * the offered load is work arriving per second over device capacity (1.0 = saturated);
//! * revocation takes `preempt_ms` on the victim's device; the victim's executed work is wasted
//!   and it is replayed from the start later;
//! * latency tasks are queued before batch tasks under every policy; `none` never revokes;
//!   `elastic` computes `q` as the larger of the outstanding latency tasks now and their average
//!   over the 100 ms ticks, so the reserve stays while latency traffic lasts.
//!
//! Deterministic: the same configuration and seed give the same report.

use std::cmp::Ordering;
use std::collections::{BinaryHeap, VecDeque};

use agora_daemon::policy::latency::{may_start_batch, reserved_devices, should_revoke, LatencyPolicy, RevokeContext};
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
    /// Median of batch jobs' response time over their time alone on the devices.
    pub batch_median_slowdown: f64,
    /// 99th percentile of the same.
    pub batch_p99_slowdown: f64,
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
    revoking: Vec<bool>,
    epochs: Vec<u64>,
    reserved: usize,
    /// Outstanding latency tasks, averaged over the 100 ms ticks (old:new 4:1), so the reserve
    /// follows the latency traffic rather than each instant's queue.
    smoothed_outstanding: f64,
    mean_latency_exec: f64,
    busy: f64,
    wasted: f64,
    executed: f64,
    revocations: usize,
    latency_responses: Vec<f64>,
    batch_slowdowns: Vec<f64>,
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
        // Any sustained latency traffic keeps a reserve; it lapses about 2.5 s after the traffic
        // stops (the average decays below 0.005), so batch work is not starved for ever.
        let recent = if self.smoothed_outstanding > 0.005 {
            self.smoothed_outstanding.ceil() as usize
        } else {
            0
        };
        let outstanding = current.max(recent);
        self.reserved = reserved_devices(
            self.mean_latency_exec,
            outstanding,
            self.config.sla_ms / 1e3,
            self.config.devices,
        );
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
            if self.devices[device].is_some() || self.revoking[device] {
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
        let cost = self.config.preempt_ms / 1e3;
        let mut waiting = self.latency_ready.len();
        while waiting > 0 {
            // The victim: the batch task that has run the least (least work wasted).
            let victim = self
                .devices
                .iter()
                .enumerate()
                .filter_map(|(d, r)| r.filter(|r| r.class == Class::Batch).map(|r| (d, r)))
                .min_by(|a, b| b.1.started.total_cmp(&a.1.started));
            let Some((device, running)) = victim else { break };
            let remaining = running.started + running.task.duration - now;
            // The simulator knows durations exactly; the daemon would use predictions.
            let earliest_free_s = self
                .devices
                .iter()
                .flatten()
                .map(|r| r.started + r.task.duration - now)
                .fold(f64::INFINITY, f64::min);
            let head = self.latency_ready[self.latency_ready.len() - waiting];
            let slack_s = self.jobs[head.job].arrival + self.config.sla_ms / 1e3 - now - head.duration;
            let context = RevokeContext {
                latency_running: self.count_running(Class::Latency),
                reserved: self.reserved,
                victim_remaining_s: remaining,
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
            self.batch_ready.push_front(running.task);
            self.revoking[device] = true;
            // The device is unavailable while the revocation takes effect; its latency task then
            // starts there (the queue is latency-first).
            self.busy += cost;
            self.push(now + cost, EventKind::Revoked { device });
            waiting -= 1;
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
                Class::Latency => self.latency_responses.push(response),
                Class::Batch => {
                    // Alone: the tasks on all devices, at most 8 at a time, never shorter than the
                    // longest task.
                    let total: f64 = job.durations.iter().sum();
                    let longest = job.durations.iter().copied().fold(0.0, f64::max);
                    let width = self.config.devices.min(MAX_OUTSTANDING) as f64;
                    self.batch_slowdowns.push(response / (total / width).max(longest));
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

/// Runs one simulation.
pub fn simulate(config: &SimConfig) -> SimReport {
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
        revoking: vec![false; devices],
        epochs: vec![0; devices],
        reserved: 0,
        smoothed_outstanding: 0.0,
        mean_latency_exec: LATENCY_MEAN_S,
        busy: 0.0,
        wasted: 0.0,
        executed: 0.0,
        revocations: 0,
        latency_responses: Vec::new(),
        batch_slowdowns: Vec::new(),
    };
    let first = sim.rng.exponential(mean_interarrival);
    sim.push(first, EventKind::Arrival);
    sim.push(0.1, EventKind::Recompute);
    let mut busy_at_end_of_arrivals = None;
    while let Some(event) = sim.events.pop() {
        let now = event.time;
        match event.kind {
            EventKind::Arrival => {
                if now > config.seconds {
                    busy_at_end_of_arrivals.get_or_insert(sim.busy);
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
            EventKind::Revoked { device } => sim.revoking[device] = false,
            EventKind::Recompute => {
                let current = (sim.latency_ready.len() + sim.count_running(Class::Latency)) as f64;
                sim.smoothed_outstanding = 0.8 * sim.smoothed_outstanding + 0.2 * current;
                sim.recompute_reserve();
                if now < config.seconds || !sim.latency_ready.is_empty() || !sim.batch_ready.is_empty() {
                    sim.push(now + 0.1, EventKind::Recompute);
                }
            }
        }
        sim.schedule(now);
    }
    let horizon = config.seconds * devices as f64;
    let utilisation = (busy_at_end_of_arrivals.unwrap_or(sim.busy) / horizon).min(1.0);
    let met = sim
        .latency_responses
        .iter()
        .filter(|r| **r <= config.sla_ms / 1e3)
        .count();
    let latency_requests = sim.latency_responses.len();
    let batch_jobs = sim.batch_slowdowns.len();
    SimReport {
        config: sim.config.clone(),
        sla_met_fraction: if latency_requests == 0 {
            1.0
        } else {
            met as f64 / latency_requests as f64
        },
        utilisation,
        wasted_fraction: if sim.executed > 0.0 {
            sim.wasted / sim.executed
        } else {
            0.0
        },
        batch_median_slowdown: percentile(&mut sim.batch_slowdowns, 0.5),
        batch_p99_slowdown: percentile(&mut sim.batch_slowdowns, 0.99),
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
