//! A deterministic discrete-event simulator of identical lanes running periodic DAG jobs.
//!
//! Owns the model of run time: DAG instances released exactly every period (release jitter is
//! therefore 0), node jobs released when their last predecessor of the same instance finishes,
//! one job of a node at a time (a node is one thread, as in RTDAG), actual execution times drawn
//! from a seeded generator, preemption only at chunk boundaries, and the four policies of
//! [`Policy`]. It reports deadline misses (end to end and per node), response times relative to
//! the deadline, and migrations. Same inputs and seed, same report, bit for bit.
//!
//! It must not decide admission: it runs whatever [`Workload`] it is given, so it can show what
//! happens to sets admission would refuse. APEDF needs each node's home lane, which
//! [`crate::admission::Admission::workload`] or [`crate::admission::best_effort_placement`]
//! provide.

mod engine;
mod stats;

use serde::{Deserialize, Serialize};
use thiserror::Error;

use crate::admission::Packing;
use crate::model::ValidatedDag;

pub use stats::{DagReport, DurationPercentiles, RatioPercentiles, SimulationReport, TotalReport};

/// How ready jobs are given lanes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum Policy {
    /// Release order, on any free lane; a running job is never displaced by a later one.
    Fifo,
    /// Global EDF: the earliest absolute deadlines run, on any lanes.
    GlobalEdf,
    /// APEDF with first-fit pushes: a job runs on its home lane while that lane's EDF queue still
    /// meets every deadline; otherwise it is pushed to the lowest-indexed lane where it does;
    /// otherwise it joins a global EDF queue that every lane serves.
    ApedfFirstFit,
    /// APEDF with worst-fit pushes: as [`Policy::ApedfFirstFit`], but pushed to the lane with
    /// the least committed work where it fits.
    ApedfWorstFit,
}

impl Policy {
    /// Every policy, in report order.
    pub const ALL: [Policy; 4] = [
        Policy::Fifo,
        Policy::GlobalEdf,
        Policy::ApedfFirstFit,
        Policy::ApedfWorstFit,
    ];

    /// Short name for reports: `fifo`, `gedf`, `apedf-ff`, `apedf-wf`.
    pub fn name(self) -> &'static str {
        match self {
            Policy::Fifo => "fifo",
            Policy::GlobalEdf => "gedf",
            Policy::ApedfFirstFit => "apedf-ff",
            Policy::ApedfWorstFit => "apedf-wf",
        }
    }

    /// The packing an APEDF policy pushes with; `None` for the global policies.
    pub fn packing(self) -> Option<Packing> {
        match self {
            Policy::ApedfFirstFit => Some(Packing::FirstFit),
            Policy::ApedfWorstFit => Some(Packing::WorstFit),
            Policy::Fifo | Policy::GlobalEdf => None,
        }
    }
}

/// Actual execution time of each job as a fraction of its WCET, uniform in
/// `[min_fraction, max_fraction]`.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct ExecutionTimeModel {
    /// Smallest fraction, above 0.
    pub min_fraction: f64,
    /// Largest fraction, at most 1 (use [`OverrunInjection`] for jobs beyond their WCET).
    pub max_fraction: f64,
}

impl Default for ExecutionTimeModel {
    fn default() -> Self {
        Self {
            min_fraction: 0.5,
            max_fraction: 1.0,
        }
    }
}

/// Makes some jobs run past their WCET, to see what overruns cost and whom they hurt.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct OverrunInjection {
    /// Chance that a job overruns, in `[0, 1]`.
    pub probability: f64,
    /// An overrunning job runs `factor × WCET`, with `factor ≥ 1`.
    pub factor: f64,
}

/// What to simulate and how.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct SimulationConfig {
    /// Number of identical lanes.
    pub lanes: usize,
    /// The scheduling policy.
    pub policy: Policy,
    /// DAG instances are released in `[0, duration_us)`; the simulation then runs until every
    /// released job has finished.
    pub duration_us: u64,
    /// A running job can be preempted only after each this many microseconds of execution,
    /// because Agora preempts batch launches by cutting them into chunks. 0: at any time.
    pub preemption_granularity_us: u64,
    /// Actual execution times.
    pub execution: ExecutionTimeModel,
    /// Optional injected WCET overruns.
    pub overrun: Option<OverrunInjection>,
    /// Margin on WCETs for the budgets APEDF reasons with; use the admission's margin.
    pub wcet_margin: f64,
    /// Seed of the execution-time generator.
    pub seed: u64,
}

impl SimulationConfig {
    /// One second on `lanes` lanes under `policy`, fully preemptive, actual times 0.5–1.0 of
    /// WCET, no overruns, no margin, seed 0.
    pub fn new(lanes: usize, policy: Policy) -> Self {
        Self {
            lanes,
            policy,
            duration_us: 1_000_000,
            preemption_granularity_us: 0,
            execution: ExecutionTimeModel::default(),
            overrun: None,
            wcet_margin: 0.0,
            seed: 0,
        }
    }
}

/// DAGs to run, with each node's home lane for the APEDF policies.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct Workload {
    /// The DAGs.
    pub dags: Vec<ValidatedDag>,
    /// `home_lanes[d][n]`: the lane node `n` of DAG `d` is partitioned onto. Required by APEDF,
    /// ignored by FIFO and global EDF.
    pub home_lanes: Option<Vec<Vec<usize>>>,
}

/// Most DAG instances one simulation may release, to bound its memory and time.
pub const MAX_RELEASES: u64 = 5_000_000;

/// A simulation that cannot be run as asked.
#[derive(Debug, Clone, PartialEq, Error)]
pub enum SimulationError {
    /// Zero lanes.
    #[error("the simulation needs at least one lane")]
    NoLanes,
    /// Execution fractions outside `0 < min ≤ max ≤ 1`.
    #[error("execution fractions {min}..{max} are not within 0 < min ≤ max ≤ 1; use OverrunInjection for jobs beyond their WCET")]
    BadExecutionModel {
        /// Configured minimum.
        min: f64,
        /// Configured maximum.
        max: f64,
    },
    /// Overrun probability outside `[0, 1]` or factor below 1.
    #[error("overrun injection needs a probability in [0, 1] and a factor ≥ 1, got {probability} and {factor}")]
    BadOverrun {
        /// Configured probability.
        probability: f64,
        /// Configured factor.
        factor: f64,
    },
    /// A margin that is negative or not finite.
    #[error("WCET margin {0} is not a finite number ≥ 0")]
    BadMargin(f64),
    /// An APEDF policy without home lanes.
    #[error("policy {policy} needs a home lane for every node; take the workload from Admission::workload or best_effort_placement")]
    MissingPlacement {
        /// The policy's name.
        policy: &'static str,
    },
    /// Home lanes for a different number of DAGs than the workload has.
    #[error(
        "home lanes are given for {found} DAGs but the workload has {dags}; rebuild the placement from the same DAGs"
    )]
    PlacementDagCount {
        /// DAGs in the workload.
        dags: usize,
        /// Home-lane lists given.
        found: usize,
    },
    /// Home lanes that do not match a DAG's nodes.
    #[error("home lanes give {found} entries for DAG '{dag}' but it has {expected} nodes; rebuild the placement from the same DAGs")]
    PlacementShape {
        /// The DAG's name.
        dag: String,
        /// Nodes it has.
        expected: usize,
        /// Entries given.
        found: usize,
    },
    /// A home lane that does not exist.
    #[error("node {node} of DAG '{dag}' has home lane {lane} but there are only {lanes} lanes")]
    LaneOutOfRange {
        /// The DAG's name.
        dag: String,
        /// Node index.
        node: usize,
        /// The home lane given.
        lane: usize,
        /// Lanes simulated.
        lanes: usize,
    },
    /// The duration would release too many instances.
    #[error("a duration of {duration_us} µs releases {releases} DAG instances, above the limit of {limit}; simulate a shorter duration")]
    TooManyReleases {
        /// Configured duration.
        duration_us: u64,
        /// Instances it would release.
        releases: u64,
        /// [`MAX_RELEASES`].
        limit: u64,
    },
}

/// Runs `workload` under `config` and reports what happened.
pub fn simulate(workload: &Workload, config: &SimulationConfig) -> Result<SimulationReport, SimulationError> {
    check(workload, config)?;
    Ok(engine::Engine::new(workload, config).run())
}

fn check(workload: &Workload, config: &SimulationConfig) -> Result<(), SimulationError> {
    if config.lanes == 0 {
        return Err(SimulationError::NoLanes);
    }
    let execution = config.execution;
    let fractions_ok = execution.min_fraction > 0.0
        && execution.min_fraction <= execution.max_fraction
        && execution.max_fraction <= 1.0;
    if !fractions_ok {
        return Err(SimulationError::BadExecutionModel {
            min: execution.min_fraction,
            max: execution.max_fraction,
        });
    }
    if let Some(overrun) = config.overrun {
        let ok = (0.0..=1.0).contains(&overrun.probability) && overrun.factor >= 1.0 && overrun.factor.is_finite();
        if !ok {
            return Err(SimulationError::BadOverrun {
                probability: overrun.probability,
                factor: overrun.factor,
            });
        }
    }
    if !config.wcet_margin.is_finite() || config.wcet_margin < 0.0 {
        return Err(SimulationError::BadMargin(config.wcet_margin));
    }
    let releases: u64 = workload
        .dags
        .iter()
        .map(|dag| config.duration_us.div_ceil(dag.period_us()))
        .fold(0u64, u64::saturating_add);
    if releases > MAX_RELEASES {
        return Err(SimulationError::TooManyReleases {
            duration_us: config.duration_us,
            releases,
            limit: MAX_RELEASES,
        });
    }
    if config.policy.packing().is_some() {
        let home_lanes = workload.home_lanes.as_ref().ok_or(SimulationError::MissingPlacement {
            policy: config.policy.name(),
        })?;
        if home_lanes.len() != workload.dags.len() {
            return Err(SimulationError::PlacementDagCount {
                dags: workload.dags.len(),
                found: home_lanes.len(),
            });
        }
        for (dag, lanes) in workload.dags.iter().zip(home_lanes) {
            if lanes.len() != dag.node_count() {
                return Err(SimulationError::PlacementShape {
                    dag: dag.name().to_owned(),
                    expected: dag.node_count(),
                    found: lanes.len(),
                });
            }
            if let Some((node, &lane)) = lanes.iter().enumerate().find(|(_, &lane)| lane >= config.lanes) {
                return Err(SimulationError::LaneOutOfRange {
                    dag: dag.name().to_owned(),
                    node,
                    lane,
                    lanes: config.lanes,
                });
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::{DagLimits, DagSpec, NodeSpec};

    fn single(name: &str, wcet_us: u64, period_us: u64, deadline_us: Option<u64>) -> ValidatedDag {
        let mut dag = DagSpec::new(name, period_us);
        dag.deadline_us = deadline_us;
        dag.nodes.push(NodeSpec::new("only", wcet_us));
        dag.validate(&DagLimits::default()).unwrap()
    }

    fn exact(lanes: usize, policy: Policy, duration_us: u64) -> SimulationConfig {
        SimulationConfig {
            duration_us,
            execution: ExecutionTimeModel {
                min_fraction: 1.0,
                max_fraction: 1.0,
            },
            ..SimulationConfig::new(lanes, policy)
        }
    }

    #[test]
    fn fifo_misses_what_edf_meets() {
        let workload = Workload {
            dags: vec![single("long", 6_000, 10_000, None), single("short", 1_000, 4_000, None)],
            home_lanes: None,
        };
        let fifo = simulate(&workload, &exact(1, Policy::Fifo, 20_000)).unwrap();
        let edf = simulate(&workload, &exact(1, Policy::GlobalEdf, 20_000)).unwrap();
        assert!(fifo.dags[1].deadline_misses > 0);
        assert_eq!(edf.total.deadline_misses, 0);
        assert_eq!(edf.dags[0].releases, 2);
        assert_eq!(edf.dags[1].releases, 5);
        assert_eq!(edf.dags[1].release_jitter_us, 0);
        // The short DAG preempts the long one, except at 16 ms where their deadlines tie at
        // 20 ms and the earlier release (the long one) keeps the lane.
        assert_eq!(edf.dags[1].response_time.p50_us, 1_000);
        assert_eq!(edf.dags[1].response_time.max_us, 2_000);
        assert_eq!(edf.dags[1].response_over_deadline.max, 0.5);
    }

    #[test]
    fn chunked_launches_block_urgent_jobs() {
        let workload = Workload {
            dags: vec![
                single("batch", 8_000, 20_000, None),
                single("urgent", 1_000, 5_000, Some(1_500)),
            ],
            home_lanes: None,
        };
        let preemptive = simulate(&workload, &exact(1, Policy::GlobalEdf, 20_000)).unwrap();
        assert_eq!(preemptive.total.deadline_misses, 0);
        let chunked = SimulationConfig {
            preemption_granularity_us: 8_000,
            ..exact(1, Policy::GlobalEdf, 20_000)
        };
        let chunked = simulate(&workload, &chunked).unwrap();
        assert!(chunked.dags[1].deadline_misses > 0);
    }

    #[test]
    fn overruns_are_counted_apart() {
        let workload = Workload {
            dags: vec![single("tight", 6_000, 10_000, None)],
            home_lanes: None,
        };
        let config = SimulationConfig {
            overrun: Some(OverrunInjection {
                probability: 1.0,
                factor: 2.0,
            }),
            ..exact(1, Policy::GlobalEdf, 30_000)
        };
        let report = simulate(&workload, &config).unwrap();
        assert_eq!(report.dags[0].overrun_jobs, 3);
        assert!(report.total.deadline_misses > 0);
        assert_eq!(report.total.overrun_misses, report.total.deadline_misses);
    }

    #[test]
    fn apedf_pushes_a_job_its_home_lane_cannot_take_and_counts_the_migration() {
        let workload = Workload {
            dags: vec![single("a", 6_000, 10_000, None), single("b", 6_000, 10_000, None)],
            home_lanes: Some(vec![vec![0], vec![0]]),
        };
        let report = simulate(&workload, &exact(2, Policy::ApedfFirstFit, 50_000)).unwrap();
        assert_eq!(report.total.deadline_misses, 0);
        assert_eq!(report.dags[0].migrations, 0);
        assert_eq!(report.dags[1].migrations, 1);
        let worst_fit = simulate(&workload, &exact(2, Policy::ApedfWorstFit, 50_000)).unwrap();
        assert_eq!(worst_fit.total.deadline_misses, 0);
    }

    #[test]
    fn a_seed_fixes_the_run() {
        let workload = Workload {
            dags: vec![single("a", 3_000, 10_000, None), single("b", 2_000, 7_000, None)],
            home_lanes: None,
        };
        let config = SimulationConfig {
            duration_us: 200_000,
            ..SimulationConfig::new(1, Policy::GlobalEdf)
        };
        let first = simulate(&workload, &config).unwrap();
        assert_eq!(first, simulate(&workload, &config).unwrap());
        let other = simulate(&workload, &SimulationConfig { seed: 99, ..config }).unwrap();
        assert_ne!(first.dags[0].response_time, other.dags[0].response_time);
    }

    #[test]
    fn unusable_configurations_are_refused() {
        let dags = vec![single("a", 1_000, 10_000, None)];
        let workload = Workload {
            dags: dags.clone(),
            home_lanes: None,
        };
        let base = SimulationConfig::new(2, Policy::GlobalEdf);
        let refuse = |workload: &Workload, config: SimulationConfig| simulate(workload, &config).unwrap_err();

        assert_eq!(
            refuse(&workload, SimulationConfig { lanes: 0, ..base }),
            SimulationError::NoLanes
        );
        let bad_fraction = ExecutionTimeModel {
            min_fraction: 0.5,
            max_fraction: 1.5,
        };
        assert!(matches!(
            refuse(
                &workload,
                SimulationConfig {
                    execution: bad_fraction,
                    ..base
                }
            ),
            SimulationError::BadExecutionModel { .. }
        ));
        let bad_overrun = Some(OverrunInjection {
            probability: 2.0,
            factor: 1.5,
        });
        assert!(matches!(
            refuse(
                &workload,
                SimulationConfig {
                    overrun: bad_overrun,
                    ..base
                }
            ),
            SimulationError::BadOverrun { .. }
        ));
        assert!(matches!(
            refuse(
                &workload,
                SimulationConfig {
                    wcet_margin: f64::NAN,
                    ..base
                }
            ),
            SimulationError::BadMargin(_)
        ));
        assert!(matches!(
            refuse(
                &workload,
                SimulationConfig {
                    duration_us: u64::MAX,
                    ..base
                }
            ),
            SimulationError::TooManyReleases { .. }
        ));

        let apedf = SimulationConfig {
            policy: Policy::ApedfFirstFit,
            ..base
        };
        assert!(matches!(
            refuse(&workload, apedf),
            SimulationError::MissingPlacement { policy: "apedf-ff" }
        ));
        let wrong_count = Workload {
            dags: dags.clone(),
            home_lanes: Some(vec![]),
        };
        assert!(matches!(
            refuse(&wrong_count, apedf),
            SimulationError::PlacementDagCount { dags: 1, found: 0 }
        ));
        let wrong_shape = Workload {
            dags: dags.clone(),
            home_lanes: Some(vec![vec![0, 1]]),
        };
        assert!(matches!(
            refuse(&wrong_shape, apedf),
            SimulationError::PlacementShape {
                expected: 1,
                found: 2,
                ..
            }
        ));
        let wrong_lane = Workload {
            dags,
            home_lanes: Some(vec![vec![2]]),
        };
        assert!(matches!(
            refuse(&wrong_lane, apedf),
            SimulationError::LaneOutOfRange { lane: 2, lanes: 2, .. }
        ));
    }
}
