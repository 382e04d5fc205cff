//! Utilisation sweeps: how each policy fares as the offered load grows, the basis of
//! `agora bench rt`.
//!
//! Owns the experiment loop and its summary only: for each target utilisation from
//! `start_utilisation` up to the number of lanes it generates seeded sets, runs FIFO and global
//! EDF on every DAG regardless of admission, and for APEDF-FF and APEDF-WF both admits the set
//! (in order, skipping refused DAGs) and simulates the admitted part, and simulates the whole set
//! on a best-effort partition. It must not print or serialise anything itself: the reports
//! derive `Serialize`, and the caller chooses the format.

use serde::{Deserialize, Serialize};
use thiserror::Error;

use crate::admission::{best_effort_placement, Admission, AdmissionConfig, ConfigError};
use crate::generate::{generate, GenerateError, GeneratorConfig};
use crate::simulate::{simulate, ExecutionTimeModel, Policy, SimulationConfig, SimulationError, Workload};

/// What to sweep.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct SweepConfig {
    /// Identical lanes; the sweep ends at this utilisation ("full").
    pub lanes: usize,
    /// First target utilisation.
    pub start_utilisation: f64,
    /// Step between targets.
    pub step: f64,
    /// Sets generated per target.
    pub sets_per_point: usize,
    /// Shape of the sets (its `total_utilisation` is replaced by each target).
    pub generator: GeneratorConfig,
    /// Simulated release window per run.
    pub duration_us: u64,
    /// Preemption granularity of the simulated lanes (admission charges it as blocking).
    pub preemption_granularity_us: u64,
    /// Actual execution times.
    pub execution: ExecutionTimeModel,
    /// WCET margin for admission and APEDF budgets.
    pub wcet_margin: f64,
    /// Seed of the whole sweep.
    pub seed: u64,
}

impl SweepConfig {
    /// Targets 0.5, 1.0, ... up to `lanes`, ten sets each of `4 × lanes` DAGs, one simulated
    /// second, fully preemptive, actual times 0.5–1.0 of WCET, no margin.
    pub fn new(lanes: usize) -> Self {
        Self {
            lanes,
            start_utilisation: 0.5,
            step: 0.5,
            sets_per_point: 10,
            generator: GeneratorConfig {
                dag_count: 4 * lanes.max(1),
                ..GeneratorConfig::default()
            },
            duration_us: 1_000_000,
            preemption_granularity_us: 0,
            execution: ExecutionTimeModel::default(),
            wcet_margin: 0.0,
            seed: 1,
        }
    }

    fn targets(&self) -> Vec<f64> {
        let full = self.lanes as f64;
        let mut targets = Vec::new();
        let mut index = 0usize;
        loop {
            let target = self.start_utilisation + index as f64 * self.step;
            if target > full - 1e-9 {
                break;
            }
            targets.push(target);
            index += 1;
        }
        targets.push(full);
        targets
    }
}

/// One policy at one target utilisation, summed over the sets.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct PolicyPoint {
    /// The policy.
    pub policy: Policy,
    /// DAG instances released when running every DAG of every set.
    pub releases: u64,
    /// End-to-end misses among them.
    pub deadline_misses: u64,
    /// `deadline_misses / releases`.
    pub miss_ratio: f64,
    /// Migrations when running every DAG.
    pub migrations: u64,
    /// APEDF only: mean over the sets of the utilisation admission accepted.
    pub admitted_utilisation: Option<f64>,
    /// APEDF only: instances of admitted DAGs released when running only those.
    pub admitted_releases: Option<u64>,
    /// APEDF only: their end-to-end misses (0 unless something is wrong).
    pub admitted_misses: Option<u64>,
}

/// All policies at one target utilisation.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct SweepPoint {
    /// Offered total utilisation.
    pub target_utilisation: f64,
    /// One entry per policy, in [`Policy::ALL`] order.
    pub policies: Vec<PolicyPoint>,
}

/// The figures `agora bench rt` reports.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct BenchSummary {
    /// Lanes.
    pub lanes: usize,
    /// Misses of admitted DAGs under APEDF-FF and APEDF-WF, over the whole sweep.
    pub admitted_misses: u64,
    /// Mean utilisation APEDF-FF admitted from the sets offered at full utilisation.
    pub apedf_admitted_utilisation: f64,
    /// Global EDF's miss ratio at full utilisation, every DAG running.
    pub gedf_miss_ratio_at_full: f64,
    /// FIFO's miss ratio at full utilisation, every DAG running.
    pub fifo_miss_ratio_at_full: f64,
}

/// A whole sweep.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct SweepReport {
    /// Per target utilisation, ascending.
    pub points: Vec<SweepPoint>,
    /// The headline figures.
    pub summary: BenchSummary,
}

/// Why a sweep could not run.
#[derive(Debug, Clone, PartialEq, Error)]
pub enum SweepError {
    /// Sweep settings that cannot work.
    #[error("sweep setting {field} is invalid: {reason}")]
    InvalidConfig {
        /// The field.
        field: &'static str,
        /// What is wrong.
        reason: &'static str,
    },
    /// Generating a set failed.
    #[error(transparent)]
    Generate(#[from] GenerateError),
    /// Admission rejected the configuration.
    #[error(transparent)]
    Admission(#[from] ConfigError),
    /// A simulation failed.
    #[error(transparent)]
    Simulation(#[from] SimulationError),
}

/// Runs the sweep described by `config`.
pub fn sweep(config: &SweepConfig) -> Result<SweepReport, SweepError> {
    if config.lanes == 0 {
        return Err(SweepError::InvalidConfig {
            field: "lanes",
            reason: "must be at least 1",
        });
    }
    if !(config.step > 0.0 && config.start_utilisation > 0.0) {
        return Err(SweepError::InvalidConfig {
            field: "step",
            reason: "step and start_utilisation must be positive",
        });
    }
    if config.sets_per_point == 0 {
        return Err(SweepError::InvalidConfig {
            field: "sets_per_point",
            reason: "must be at least 1",
        });
    }
    let targets = config.targets();
    let mut points = Vec::with_capacity(targets.len());
    let mut admitted_misses = 0;
    for (point_index, &target) in targets.iter().enumerate() {
        let mut totals: Vec<PolicyPoint> = Policy::ALL
            .iter()
            .map(|&policy| PolicyPoint {
                policy,
                releases: 0,
                deadline_misses: 0,
                miss_ratio: 0.0,
                migrations: 0,
                admitted_utilisation: policy.packing().map(|_| 0.0),
                admitted_releases: policy.packing().map(|_| 0),
                admitted_misses: policy.packing().map(|_| 0),
            })
            .collect();
        for set_index in 0..config.sets_per_point {
            let set_seed = config
                .seed
                .wrapping_mul(1_000_003)
                .wrapping_add((point_index * 10_007 + set_index) as u64);
            let generator = GeneratorConfig {
                total_utilisation: target,
                ..config.generator
            };
            let set = generate(&generator, set_seed)?;
            for total in &mut totals {
                let simulation = SimulationConfig {
                    lanes: config.lanes,
                    policy: total.policy,
                    duration_us: config.duration_us,
                    preemption_granularity_us: config.preemption_granularity_us,
                    execution: config.execution,
                    overrun: None,
                    wcet_margin: config.wcet_margin,
                    seed: set_seed,
                };
                let mut everything = Workload {
                    dags: set.dags.clone(),
                    home_lanes: None,
                };
                if let Some(packing) = total.policy.packing() {
                    let admission_config = AdmissionConfig {
                        lanes: config.lanes,
                        packing,
                        wcet_margin: config.wcet_margin,
                        preemption_granularity_us: config.preemption_granularity_us,
                    };
                    everything.home_lanes = Some(best_effort_placement(&set.dags, &admission_config));
                    let mut admission = Admission::new(admission_config)?;
                    for dag in &set.dags {
                        // A refused DAG is simply left out, as an operator would.
                        let _ = admission.admit(dag.clone());
                    }
                    let admitted = simulate(&admission.workload(), &simulation)?;
                    admitted_misses += admitted.total.deadline_misses;
                    *total.admitted_utilisation.get_or_insert(0.0) += admission.admitted_utilisation();
                    *total.admitted_releases.get_or_insert(0) += admitted.total.releases;
                    *total.admitted_misses.get_or_insert(0) += admitted.total.deadline_misses;
                }
                let report = simulate(&everything, &simulation)?;
                total.releases += report.total.releases;
                total.deadline_misses += report.total.deadline_misses;
                total.migrations += report.total.migrations;
            }
        }
        for total in &mut totals {
            total.miss_ratio = if total.releases == 0 {
                0.0
            } else {
                total.deadline_misses as f64 / total.releases as f64
            };
            if let Some(utilisation) = total.admitted_utilisation.as_mut() {
                *utilisation /= config.sets_per_point as f64;
            }
        }
        points.push(SweepPoint {
            target_utilisation: target,
            policies: totals,
        });
    }
    let full = points.last().map(|point| point.policies.as_slice()).unwrap_or_default();
    let find = |policy: Policy| full.iter().find(|entry| entry.policy == policy);
    let summary = BenchSummary {
        lanes: config.lanes,
        admitted_misses,
        apedf_admitted_utilisation: find(Policy::ApedfFirstFit)
            .and_then(|entry| entry.admitted_utilisation)
            .unwrap_or(0.0),
        gedf_miss_ratio_at_full: find(Policy::GlobalEdf).map_or(0.0, |entry| entry.miss_ratio),
        fifo_miss_ratio_at_full: find(Policy::Fifo).map_or(0.0, |entry| entry.miss_ratio),
    };
    Ok(SweepReport { points, summary })
}
