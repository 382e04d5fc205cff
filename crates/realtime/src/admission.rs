//! Admission of periodic DAGs onto identical lanes: partitioned EDF, the basis of APEDF.
//!
//! Owns the reservations: which node of which admitted DAG is partitioned onto which lane, with
//! what budget, and the decision to admit or refuse a new DAG. Each node becomes a
//! constrained-deadline sporadic task `C = ⌈WCET × (1 + margin)⌉`, `D` = its derived deadline,
//! `T` = the DAG's period (see [`crate::model::ValidatedDag::node_timing`]). A DAG is admitted
//! only if every one of its nodes fits on some lane by the EDF test of [`crate::edf`]; its nodes
//! are tried in decreasing density, each on the lanes in [`Packing`] order. If one node fits
//! nowhere, the DAG's earlier nodes are taken back and nothing changes. Removing a DAG frees its
//! reservations.
//!
//! The global utilisation bound of first-fit EDF (López et al.: `(βm + 1)/(β + 1)` with
//! `β = ⌊1/δ_max⌋`) is a fast path: while the lanes were filled by first-fit only (no removal
//! since they were last empty) and fully preemptively, a DAG that keeps the total density under
//! it is placed with the density test alone, which the bound guarantees will succeed.
//!
//! It must not run anything or know about policies at run time: the simulator (and later the
//! daemon) read the partition from [`Admission::workload`].

use std::collections::BTreeMap;
use std::fmt;

use serde::{Deserialize, Serialize};
use thiserror::Error;

use crate::edf::{self, LaneTask};
use crate::model::ValidatedDag;
use crate::simulate::Workload;
use crate::units::Micros;

/// Order in which lanes are tried for each node.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum Packing {
    /// The lowest-indexed lane that fits: packs lanes full, keeps the high ones free, and has
    /// the utilisation bound that makes hard admission predictable.
    FirstFit,
    /// The lane with the lowest density that fits: spreads load, leaving slack on every lane.
    WorstFit,
}

/// How admission models the lanes and the nodes' budgets.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct AdmissionConfig {
    /// Number of identical lanes.
    pub lanes: usize,
    /// Lane order for each node.
    pub packing: Packing,
    /// Safety margin on every WCET: budget = ⌈WCET × (1 + margin)⌉. Covers interference the WCET
    /// does not (daemon threads, interrupts), as AMPERE inflates WCETs for its accelerator server.
    pub wcet_margin: f64,
    /// Launches are preemptible only every this many microseconds (0: at any time). A running
    /// chunk can block a more urgent job once, and the lane test charges that blocking.
    pub preemption_granularity_us: u64,
}

impl Default for AdmissionConfig {
    fn default() -> Self {
        Self {
            lanes: 4,
            packing: Packing::FirstFit,
            wcet_margin: 0.0,
            preemption_granularity_us: 0,
        }
    }
}

/// A configuration that cannot be used.
#[derive(Debug, Clone, PartialEq, Error)]
pub enum ConfigError {
    /// Zero lanes.
    #[error("admission needs at least one lane")]
    NoLanes,
    /// A margin that is negative, infinite or not a number.
    #[error("WCET margin {0} is not a finite number ≥ 0; use e.g. 0.05 for 5 %")]
    BadMargin(f64),
}

/// The budget reserved for a node: `⌈wcet × (1 + margin)⌉` microseconds.
pub fn inflated_wcet(wcet_us: u64, margin: f64) -> u64 {
    let inflated = (wcet_us as f64 * (1.0 + margin)).ceil();
    if inflated >= u64::MAX as f64 {
        u64::MAX
    } else {
        (inflated as u64).max(wcet_us)
    }
}

/// López's utilisation bound for first-fit EDF on `lanes` lanes when no task is denser than
/// `max_density`: `(β·lanes + 1)/(β + 1)`, `β = ⌊1/max_density⌋`. With `max_density ≤ 1` and
/// 4 lanes it is 2.5 — the "≈ 2.5" up to which AMPERE saw APEDF-FF miss virtually nothing.
pub fn first_fit_utilisation_bound(lanes: usize, max_density: f64) -> f64 {
    if max_density <= 0.0 {
        return lanes as f64;
    }
    let beta = (1.0 / max_density).floor().max(1.0);
    (beta * lanes as f64 + 1.0) / (beta + 1.0)
}

/// Identifies an admitted DAG until it is removed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub struct DagId(pub u64);

impl fmt::Display for DagId {
    fn fmt(&self, formatter: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(formatter, "#{}", self.0)
    }
}

/// An admitted DAG and the lane each of its nodes is partitioned onto.
#[derive(Debug, Clone, PartialEq)]
pub struct AdmittedDag {
    /// The DAG.
    pub dag: ValidatedDag,
    /// Lane of each node, by node index.
    pub lanes: Vec<usize>,
}

/// What [`Admission::admit`] decided for an admitted DAG.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AdmissionDecision {
    /// The handle for [`Admission::remove`].
    pub id: DagId,
    /// Lane of each node, by node index.
    pub lanes: Vec<usize>,
    /// Whether the first-fit utilisation bound decided it (density test only on each lane).
    pub decided_by_bound: bool,
}

/// Why a DAG was not admitted, with what would have been needed.
#[derive(Debug, Clone, PartialEq)]
pub struct AdmissionRefused {
    /// The DAG's name.
    pub dag: String,
    /// The first node (in placement order) that fit on no lane.
    pub node: String,
    /// Its index.
    pub node_index: usize,
    /// Its WCET without margin.
    pub wcet_us: u64,
    /// Its budget (WCET with margin).
    pub budget_us: u64,
    /// Its derived relative deadline.
    pub relative_deadline_us: u64,
    /// The DAG's period.
    pub period_us: u64,
    /// Utilisation of each lane when the node was tried (the DAG's earlier nodes included).
    pub lane_utilisation: Vec<f64>,
    /// Density of each lane at the same moment.
    pub lane_density: Vec<f64>,
    /// The largest WCET (without margin) with which this node would have fit on some lane, all
    /// else equal; 0 if none would.
    pub largest_fitting_wcet_us: u64,
}

impl fmt::Display for AdmissionRefused {
    fn fmt(&self, formatter: &mut fmt::Formatter<'_>) -> fmt::Result {
        let lanes: Vec<String> = self
            .lane_utilisation
            .iter()
            .map(|value| format!("{value:.3}"))
            .collect();
        write!(
            formatter,
            "DAG '{}' refused: node '{}' (WCET {}, budget {}, deadline {}, period {}, utilisation {:.3}) \
             fits on none of {} lanes (lane utilisation {}); ",
            self.dag,
            self.node,
            Micros(self.wcet_us),
            Micros(self.budget_us),
            Micros(self.relative_deadline_us),
            Micros(self.period_us),
            self.budget_us as f64 / self.period_us as f64,
            self.lane_utilisation.len(),
            lanes.join(", "),
        )?;
        if self.largest_fitting_wcet_us > 0 {
            write!(
                formatter,
                "it would have fit with a WCET of at most {}; ",
                Micros(self.largest_fitting_wcet_us)
            )?;
        } else {
            write!(formatter, "no WCET would have fit; ")?;
        }
        write!(
            formatter,
            "remove a DAG, add lanes, lengthen the deadline or shorten the node"
        )
    }
}

impl std::error::Error for AdmissionRefused {}

/// Why [`Admission::admit`] or [`Admission::remove`] did nothing.
#[derive(Debug, Clone, PartialEq, Error)]
pub enum AdmissionError {
    /// The DAG does not fit.
    #[error("{0}")]
    Refused(Box<AdmissionRefused>),
    /// No admitted DAG has this id (never admitted, or already removed).
    #[error("no admitted DAG has id {0}; it was never admitted or was already removed")]
    UnknownDag(DagId),
}

/// One reservation on a lane.
#[derive(Debug, Clone, Copy)]
struct Reservation {
    owner: DagId,
    task: LaneTask,
}

/// The admitted DAGs and their reservations on each lane.
#[derive(Debug, Clone)]
pub struct Admission {
    config: AdmissionConfig,
    lanes: Vec<Vec<Reservation>>,
    admitted: BTreeMap<DagId, AdmittedDag>,
    next_id: u64,
    /// True while every reservation was placed by first-fit since the lanes were last empty:
    /// the condition under which the first-fit utilisation bound holds.
    first_fit_history: bool,
}

impl Admission {
    /// Empty lanes.
    pub fn new(config: AdmissionConfig) -> Result<Self, ConfigError> {
        if config.lanes == 0 {
            return Err(ConfigError::NoLanes);
        }
        if !config.wcet_margin.is_finite() || config.wcet_margin < 0.0 {
            return Err(ConfigError::BadMargin(config.wcet_margin));
        }
        Ok(Self {
            config,
            lanes: vec![Vec::new(); config.lanes],
            admitted: BTreeMap::new(),
            next_id: 0,
            first_fit_history: true,
        })
    }

    /// The configuration in force.
    pub fn config(&self) -> &AdmissionConfig {
        &self.config
    }

    /// Admits `dag` if each of its nodes fits on some lane; otherwise changes nothing.
    pub fn admit(&mut self, dag: ValidatedDag) -> Result<AdmissionDecision, AdmissionError> {
        let id = DagId(self.next_id);
        let tasks = lane_tasks_for(&dag, id, self.config.wcet_margin);
        let order = placement_order(&tasks);

        let decided_by_bound = self.bound_guarantees(&tasks);
        let mut lanes = vec![usize::MAX; tasks.len()];
        for &node in &order {
            let chosen = if decided_by_bound {
                self.pick_lane(&tasks[node], true)
                    .or_else(|| self.pick_lane(&tasks[node], false))
            } else {
                self.pick_lane(&tasks[node], false)
            };
            match chosen {
                Some(lane) => {
                    self.lanes[lane].push(Reservation {
                        owner: id,
                        task: tasks[node],
                    });
                    lanes[node] = lane;
                }
                None => {
                    let refusal = self.refusal(&dag, node, &tasks[node]);
                    self.release(id);
                    return Err(AdmissionError::Refused(Box::new(refusal)));
                }
            }
        }
        if self.config.packing != Packing::FirstFit {
            self.first_fit_history = false;
        }
        self.next_id += 1;
        self.admitted.insert(
            id,
            AdmittedDag {
                dag,
                lanes: lanes.clone(),
            },
        );
        Ok(AdmissionDecision {
            id,
            lanes,
            decided_by_bound,
        })
    }

    /// Removes an admitted DAG and frees its reservations.
    pub fn remove(&mut self, id: DagId) -> Result<ValidatedDag, AdmissionError> {
        let admitted = self.admitted.remove(&id).ok_or(AdmissionError::UnknownDag(id))?;
        self.release(id);
        // A hole left by a removal breaks the first-fit structure the bound relies on, until
        // the lanes are empty again.
        self.first_fit_history = self.admitted.is_empty();
        Ok(admitted.dag)
    }

    /// The admitted DAGs, by id.
    pub fn admitted(&self) -> impl Iterator<Item = (DagId, &AdmittedDag)> {
        self.admitted.iter().map(|(&id, admitted)| (id, admitted))
    }

    /// Number of admitted DAGs.
    pub fn admitted_count(&self) -> usize {
        self.admitted.len()
    }

    /// `Σ C/T` of the reservations on each lane (budgets include the margin).
    pub fn lane_utilisation(&self) -> Vec<f64> {
        self.lanes
            .iter()
            .map(|lane| edf::utilisation(&lane_tasks_of(lane)))
            .collect()
    }

    /// `Σ C/D` of the reservations on each lane.
    pub fn lane_density(&self) -> Vec<f64> {
        self.lanes
            .iter()
            .map(|lane| edf::density(&lane_tasks_of(lane)))
            .collect()
    }

    /// Sum of the admitted DAGs' utilisations (WCET without margin over period).
    pub fn admitted_utilisation(&self) -> f64 {
        self.admitted.values().map(|admitted| admitted.dag.utilisation()).sum()
    }

    /// The admitted DAGs with their partition, in id order, ready for the simulator.
    pub fn workload(&self) -> Workload {
        Workload {
            dags: self.admitted.values().map(|admitted| admitted.dag.clone()).collect(),
            home_lanes: Some(self.admitted.values().map(|admitted| admitted.lanes.clone()).collect()),
        }
    }

    fn bound_guarantees(&self, new_tasks: &[LaneTask]) -> bool {
        if self.config.packing != Packing::FirstFit
            || !self.first_fit_history
            || self.config.preemption_granularity_us > 0
        {
            return false;
        }
        let existing = self.lanes.iter().flatten().map(|reservation| &reservation.task);
        let all: Vec<&LaneTask> = existing.chain(new_tasks.iter()).collect();
        let densities = all
            .iter()
            .map(|task| task.budget_us as f64 / task.relative_deadline_us.max(1) as f64);
        let max_density = densities.clone().fold(0.0, f64::max);
        let total: f64 = densities.sum();
        max_density <= 1.0 && total <= first_fit_utilisation_bound(self.config.lanes, max_density) - 1e-9
    }

    /// The lane for `task` by the configured packing, with the density test alone
    /// (`density_only`) or the full EDF test.
    fn pick_lane(&self, task: &LaneTask, density_only: bool) -> Option<usize> {
        let fits = |lane: usize| {
            let mut tasks = lane_tasks_of(&self.lanes[lane]);
            tasks.push(*task);
            if density_only {
                edf::density(&tasks) <= 1.0 - 1e-9
            } else {
                edf::lane_test(&tasks, self.config.preemption_granularity_us).is_feasible()
            }
        };
        lane_order(&self.lanes, self.config.packing)
            .into_iter()
            .find(|&lane| fits(lane))
    }

    fn release(&mut self, id: DagId) {
        for lane in &mut self.lanes {
            lane.retain(|reservation| reservation.owner != id);
        }
    }

    fn refusal(&self, dag: &ValidatedDag, node: usize, task: &LaneTask) -> AdmissionRefused {
        let wcet_us = dag.node(node).wcet_us;
        let largest_fitting_wcet_us = (0..self.lanes.len())
            .map(|lane| self.largest_fitting_wcet(lane, task, wcet_us))
            .max()
            .unwrap_or(0);
        AdmissionRefused {
            dag: dag.name().to_owned(),
            node: dag.node(node).name.clone(),
            node_index: node,
            wcet_us,
            budget_us: task.budget_us,
            relative_deadline_us: task.relative_deadline_us,
            period_us: task.period_us,
            lane_utilisation: self.lane_utilisation(),
            lane_density: self.lane_density(),
            largest_fitting_wcet_us,
        }
    }

    /// Binary search for the largest WCET below `wcet_us` that fits on `lane`; the test is
    /// monotone in the budget.
    fn largest_fitting_wcet(&self, lane: usize, task: &LaneTask, wcet_us: u64) -> u64 {
        let fits = |wcet: u64| {
            let mut tasks = lane_tasks_of(&self.lanes[lane]);
            tasks.push(LaneTask {
                budget_us: inflated_wcet(wcet, self.config.wcet_margin),
                ..*task
            });
            edf::lane_test(&tasks, self.config.preemption_granularity_us).is_feasible()
        };
        let (mut fitting, mut failing) = (0u64, wcet_us);
        if !fits(0) {
            return 0;
        }
        while failing - fitting > 1 {
            let middle = fitting + (failing - fitting) / 2;
            if fits(middle) {
                fitting = middle;
            } else {
                failing = middle;
            }
        }
        fitting
    }
}

/// Each node of `dag` as a reservation of group `id`.
fn lane_tasks_for(dag: &ValidatedDag, id: DagId, margin: f64) -> Vec<LaneTask> {
    (0..dag.node_count())
        .map(|node| {
            let timing = dag.node_timing(node);
            LaneTask {
                group: id.0,
                period_us: dag.period_us(),
                release_offset_us: timing.release_offset_us,
                relative_deadline_us: timing.relative_deadline_us,
                budget_us: inflated_wcet(dag.node(node).wcet_us, margin),
            }
        })
        .collect()
}

fn lane_tasks_of(lane: &[Reservation]) -> Vec<LaneTask> {
    lane.iter().map(|reservation| reservation.task).collect()
}

/// Nodes by decreasing density (`C/D`, compared exactly), ties by index: dense nodes are
/// hardest to place, so they go first while lanes are emptiest.
fn placement_order(tasks: &[LaneTask]) -> Vec<usize> {
    let mut order: Vec<usize> = (0..tasks.len()).collect();
    order.sort_by(|&left, &right| {
        let left_key = u128::from(tasks[left].budget_us) * u128::from(tasks[right].relative_deadline_us);
        let right_key = u128::from(tasks[right].budget_us) * u128::from(tasks[left].relative_deadline_us);
        right_key.cmp(&left_key).then(left.cmp(&right))
    });
    order
}

fn lane_order(lanes: &[Vec<Reservation>], packing: Packing) -> Vec<usize> {
    let mut order: Vec<usize> = (0..lanes.len()).collect();
    if packing == Packing::WorstFit {
        let densities: Vec<f64> = lanes.iter().map(|lane| edf::density(&lane_tasks_of(lane))).collect();
        order.sort_by(|&left, &right| densities[left].total_cmp(&densities[right]).then(left.cmp(&right)));
    }
    order
}

/// A home lane for every node of every DAG, even those admission would refuse: nodes are
/// placed as [`Admission::admit`] would, and a node that fits nowhere goes to the lane with the
/// lowest density. This is how APEDF partitions a set it cannot guarantee; the simulator then
/// shows what happens.
pub fn best_effort_placement(dags: &[ValidatedDag], config: &AdmissionConfig) -> Vec<Vec<usize>> {
    let mut lanes: Vec<Vec<Reservation>> = vec![Vec::new(); config.lanes.max(1)];
    dags.iter()
        .enumerate()
        .map(|(index, dag)| {
            let id = DagId(index as u64);
            let tasks = lane_tasks_for(dag, id, config.wcet_margin);
            let mut placement = vec![0; tasks.len()];
            for node in placement_order(&tasks) {
                let order = lane_order(&lanes, config.packing);
                let fitting = order.iter().copied().find(|&lane| {
                    let mut candidate = lane_tasks_of(&lanes[lane]);
                    candidate.push(tasks[node]);
                    edf::lane_test(&candidate, config.preemption_granularity_us).is_feasible()
                });
                let lane = fitting.unwrap_or_else(|| lane_order(&lanes, Packing::WorstFit)[0]);
                lanes[lane].push(Reservation {
                    owner: id,
                    task: tasks[node],
                });
                placement[node] = lane;
            }
            placement
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::{DagLimits, DagSpec, NodeSpec};

    /// A single-node DAG with an implicit deadline.
    fn single(name: &str, wcet_us: u64, period_us: u64) -> ValidatedDag {
        let mut dag = DagSpec::new(name, period_us);
        dag.nodes.push(NodeSpec::new("only", wcet_us));
        dag.validate(&DagLimits::default()).unwrap()
    }

    fn admission(lanes: usize, packing: Packing) -> Admission {
        Admission::new(AdmissionConfig {
            lanes,
            packing,
            ..AdmissionConfig::default()
        })
        .unwrap()
    }

    #[test]
    fn first_fit_fills_the_first_lane_and_worst_fit_spreads() {
        let mut first_fit = admission(2, Packing::FirstFit);
        let mut worst_fit = admission(2, Packing::WorstFit);
        for index in 0..2 {
            let dag = single(&format!("d{index}"), 300, 1_000);
            assert_eq!(first_fit.admit(dag.clone()).unwrap().lanes, vec![0]);
            assert_eq!(worst_fit.admit(dag).unwrap().lanes, vec![index]);
        }
        assert_eq!(first_fit.lane_utilisation(), vec![0.6, 0.0]);
        assert_eq!(worst_fit.lane_utilisation(), vec![0.3, 0.3]);
    }

    #[test]
    fn a_refusal_names_the_node_the_lanes_and_what_would_have_fit() {
        let mut lanes = admission(2, Packing::FirstFit);
        lanes.admit(single("a", 700, 1_000)).unwrap();
        lanes.admit(single("b", 600, 1_000)).unwrap();
        let before = lanes.lane_utilisation();
        let error = lanes.admit(single("c", 500, 1_000)).unwrap_err();
        let AdmissionError::Refused(refusal) = &error else {
            panic!("{error}")
        };
        assert_eq!(refusal.dag, "c");
        assert_eq!(refusal.node, "only");
        assert_eq!(refusal.lane_utilisation, vec![0.7, 0.6]);
        assert_eq!(refusal.largest_fitting_wcet_us, 400);
        let message = error.to_string();
        assert!(message.contains("lane utilisation 0.700, 0.600"), "{message}");
        assert!(message.contains("at most 400 µs"), "{message}");
        // Nothing changed.
        assert_eq!(lanes.lane_utilisation(), before);
        assert_eq!(lanes.admitted_count(), 2);
    }

    #[test]
    fn a_partly_placed_dag_is_taken_back_whole() {
        let mut lanes = admission(1, Packing::FirstFit);
        let mut dag = DagSpec::new("parallel", 1_000);
        dag.nodes = vec![NodeSpec::new("x", 600), NodeSpec::new("y", 600)];
        let error = lanes.admit(dag.validate(&DagLimits::default()).unwrap()).unwrap_err();
        assert!(matches!(error, AdmissionError::Refused(_)));
        assert_eq!(lanes.lane_utilisation(), vec![0.0]);
    }

    #[test]
    fn removal_frees_the_reservations() {
        let mut lanes = admission(1, Packing::FirstFit);
        let first = lanes.admit(single("a", 800, 1_000)).unwrap();
        assert!(lanes.admit(single("b", 800, 1_000)).is_err());
        let removed = lanes.remove(first.id).unwrap();
        assert_eq!(removed.name(), "a");
        assert_eq!(lanes.lane_utilisation(), vec![0.0]);
        assert!(lanes.admit(single("b", 800, 1_000)).is_ok());
        assert!(matches!(lanes.remove(first.id), Err(AdmissionError::UnknownDag(id)) if id == first.id));
    }

    #[test]
    fn the_margin_inflates_budgets() {
        assert_eq!(inflated_wcet(1_000, 0.0), 1_000);
        assert_eq!(inflated_wcet(1_000, 0.05), 1_050);
        assert_eq!(inflated_wcet(3, 0.1), 4);
        let mut lanes = Admission::new(AdmissionConfig {
            lanes: 1,
            wcet_margin: 0.25,
            ..AdmissionConfig::default()
        })
        .unwrap();
        assert!(lanes.admit(single("a", 800, 1_000)).is_ok());
        assert_eq!(lanes.lane_utilisation(), vec![1.0]);
        assert!(lanes.admit(single("b", 1, 1_000)).is_err());
    }

    #[test]
    fn bad_configurations_are_refused() {
        let no_lanes = AdmissionConfig {
            lanes: 0,
            ..AdmissionConfig::default()
        };
        assert_eq!(Admission::new(no_lanes).unwrap_err(), ConfigError::NoLanes);
        let negative = AdmissionConfig {
            wcet_margin: -0.1,
            ..AdmissionConfig::default()
        };
        assert!(matches!(Admission::new(negative), Err(ConfigError::BadMargin(_))));
    }

    #[test]
    fn the_first_fit_bound_decides_light_sets_until_a_removal() {
        assert_eq!(first_fit_utilisation_bound(4, 1.0), 2.5);
        assert_eq!(first_fit_utilisation_bound(4, 0.5), 3.0);
        let mut lanes = admission(4, Packing::FirstFit);
        let first = lanes.admit(single("a", 500, 1_000)).unwrap();
        assert!(first.decided_by_bound);
        lanes.admit(single("b", 500, 1_000)).unwrap();
        lanes.remove(first.id).unwrap();
        assert!(!lanes.admit(single("c", 100, 1_000)).unwrap().decided_by_bound);
    }

    #[test]
    fn best_effort_placement_places_everything() {
        let dags: Vec<ValidatedDag> = (0..5).map(|index| single(&format!("d{index}"), 900, 1_000)).collect();
        let placement = best_effort_placement(
            &dags,
            &AdmissionConfig {
                lanes: 2,
                ..AdmissionConfig::default()
            },
        );
        assert_eq!(placement.len(), 5);
        assert_eq!(placement[0], vec![0]);
        assert_eq!(placement[1], vec![1]);
        assert!(placement.iter().all(|lanes| lanes.len() == 1 && lanes[0] < 2));
    }
}
