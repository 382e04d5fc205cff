//! Periodic real-time DAGs as an application declares them, and the checked form the rest of
//! the crate works on.
//!
//! Owns [`DagSpec`]/[`NodeSpec`] (plain data, serialisable, possibly nonsense) and
//! [`ValidatedDag`] (acyclic, in range, feasible on paper, with a topological order, a critical
//! path and per-node release offsets and deadlines). The only way to get a [`ValidatedDag`] is
//! [`DagSpec::validate`], so admission and simulation never re-check a graph. Every error says
//! what is wrong with the numbers that make it wrong and what to change.
//!
//! It must not know about lanes, admission or policies: whether a valid DAG *fits* is the
//! business of [`crate::admission`].

use std::collections::HashMap;

use serde::{Deserialize, Serialize};
use thiserror::Error;

use crate::graph;
use crate::split;
use crate::units::{arrow_path, Micros};

/// One node (a kernel launch or a CPU step) of a periodic DAG.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct NodeSpec {
    /// Name, unique within its DAG; errors and reports use it.
    pub name: String,
    /// Worst-case execution time in microseconds, on one lane, without any safety margin.
    pub wcet_us: u64,
    /// A relative deadline the application fixed for this node (e.g. chosen by an offline
    /// optimiser, as RTDAG's `tasks_rel_deadline`). Deadline splitting keeps it exactly; nodes
    /// without one share the rest of the end-to-end deadline.
    #[serde(default)]
    pub relative_deadline_us: Option<u64>,
    /// The kind of device the node runs on ("cpu", "gpu", "fred", ...), carried for the
    /// placement layer; this crate treats all lanes as identical.
    #[serde(default)]
    pub device_kind: Option<String>,
}

impl NodeSpec {
    /// A node with a WCET and nothing else declared.
    pub fn new(name: impl Into<String>, wcet_us: u64) -> Self {
        Self {
            name: name.into(),
            wcet_us,
            relative_deadline_us: None,
            device_kind: None,
        }
    }
}

/// A periodic DAG: every `period_us` one instance of every node is released, sources first,
/// and each node may start once all its predecessors of the same instance have finished.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct DagSpec {
    /// Name, used in errors and reports.
    pub name: String,
    /// Release period in microseconds.
    pub period_us: u64,
    /// End-to-end relative deadline in microseconds; `None` means "equal to the period".
    #[serde(default)]
    pub deadline_us: Option<u64>,
    /// The nodes; edges refer to them by index.
    pub nodes: Vec<NodeSpec>,
    /// Precedence edges `(from, to)`: `to` may start only after `from` finished.
    #[serde(default)]
    pub edges: Vec<(usize, usize)>,
}

impl DagSpec {
    /// A DAG with no nodes yet, an implicit deadline (equal to the period) and no edges.
    pub fn new(name: impl Into<String>, period_us: u64) -> Self {
        Self {
            name: name.into(),
            period_us,
            deadline_us: None,
            nodes: Vec::new(),
            edges: Vec::new(),
        }
    }

    /// The end-to-end deadline in force: the declared one, or the period.
    pub fn effective_deadline_us(&self) -> u64 {
        self.deadline_us.unwrap_or(self.period_us)
    }

    /// Checks the DAG and derives its timing; see [`DagError`] for everything that is refused
    /// and [`ValidatedDag::node_timing`] for the deadline-splitting rule.
    pub fn validate(&self, limits: &DagLimits) -> Result<ValidatedDag, DagError> {
        validate(self, limits)
    }
}

/// Bounds on what [`DagSpec::validate`] accepts, so that a hostile or mistaken spec cannot make
/// validation, admission or simulation arbitrarily expensive.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct DagLimits {
    /// Most nodes in one DAG.
    pub max_nodes: usize,
    /// Most edges in one DAG (counted before duplicates are merged).
    pub max_edges: usize,
    /// Longest accepted period in microseconds. Keeping periods (and so every deadline and
    /// WCET) under 2³² µs lets the analysis multiply two times without overflowing.
    pub max_period_us: u64,
}

impl Default for DagLimits {
    fn default() -> Self {
        Self {
            max_nodes: 256,
            max_edges: 4_096,
            max_period_us: 3_600_000_000,
        }
    }
}

/// Timing derived for one node: where its window starts in each DAG instance and how long it is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct NodeTiming {
    /// Latest time after the DAG's release at which this node is released if every predecessor
    /// meets its own deadline; it is released earlier when they finish earlier.
    pub release_offset_us: u64,
    /// Relative deadline, counted from `release_offset_us`. The node's absolute deadline in an
    /// instance released at `r` is `r + release_offset_us + relative_deadline_us`.
    pub relative_deadline_us: u64,
    /// Whether the application declared this deadline (kept as declared) or it was derived.
    pub declared: bool,
}

/// The path whose WCETs add up to the most, from a source to a sink.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct CriticalPath {
    /// Node indices from source to sink.
    pub nodes: Vec<usize>,
    /// Sum of their WCETs in microseconds: no schedule finishes an instance faster.
    pub wcet_us: u64,
}

/// A DAG that passed [`DagSpec::validate`]: acyclic, feasible on an unloaded machine, and with
/// per-node timing for partitioned scheduling.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ValidatedDag {
    spec: DagSpec,
    deadline_us: u64,
    predecessors: Vec<Vec<usize>>,
    successors: Vec<Vec<usize>>,
    topological_order: Vec<usize>,
    critical_path: CriticalPath,
    timing: Vec<NodeTiming>,
}

impl ValidatedDag {
    /// The spec as validated, with duplicate edges merged.
    pub fn spec(&self) -> &DagSpec {
        &self.spec
    }

    /// The DAG's name.
    pub fn name(&self) -> &str {
        &self.spec.name
    }

    /// Release period in microseconds.
    pub fn period_us(&self) -> u64 {
        self.spec.period_us
    }

    /// End-to-end relative deadline in microseconds (the period when none was declared).
    pub fn deadline_us(&self) -> u64 {
        self.deadline_us
    }

    /// Number of nodes.
    pub fn node_count(&self) -> usize {
        self.spec.nodes.len()
    }

    /// The node at `index`.
    pub fn node(&self, index: usize) -> &NodeSpec {
        &self.spec.nodes[index]
    }

    /// Predecessors of node `index`, ascending.
    pub fn predecessors(&self, index: usize) -> &[usize] {
        &self.predecessors[index]
    }

    /// Successors of node `index`, ascending.
    pub fn successors(&self, index: usize) -> &[usize] {
        &self.successors[index]
    }

    /// Every node once, each after all its predecessors (lowest index first among the ready).
    pub fn topological_order(&self) -> &[usize] {
        &self.topological_order
    }

    /// The path with the largest WCET sum.
    pub fn critical_path(&self) -> &CriticalPath {
        &self.critical_path
    }

    /// Derived release offset and relative deadline of node `index`.
    ///
    /// The rule (deadline splitting for partitioned EDF): declared node deadlines are kept as
    /// declared. The rest of the end-to-end deadline is shared *tightest path first*: take the
    /// source-to-sink path with the least remaining deadline per microsecond of still-unassigned
    /// WCET, give each of its unassigned nodes that path's ratio times its WCET (rounded down),
    /// and repeat until every node has a deadline. Release offsets are then as early as
    /// precedence allows (the latest predecessor's offset plus its deadline), and a derived
    /// deadline is stretched to the earliest offset of its successors (or the end-to-end
    /// deadline for a sink) so no slack is left unused.
    ///
    /// Why: proportional to WCET keeps every node on the critical path equally tight rather
    /// than starving the last one, taking the tightest path first guarantees that every path's
    /// deadlines add up to at most the end-to-end deadline (each later path had at least the
    /// same ratio), and windows that follow precedence let admission analyse the nodes of one
    /// DAG on one lane with their offsets instead of as if all were released at once. A node
    /// that meets its own deadline has therefore finished before any successor's window opens,
    /// and an instance whose nodes all meet theirs meets the end-to-end deadline.
    pub fn node_timing(&self, index: usize) -> NodeTiming {
        self.timing[index]
    }

    /// [`Self::node_timing`] for every node, by index.
    pub fn timings(&self) -> &[NodeTiming] {
        &self.timing
    }

    /// Sum of the nodes' WCETs divided by the period: the share of one lane the DAG needs.
    pub fn utilisation(&self) -> f64 {
        let total: u64 = self.spec.nodes.iter().map(|node| node.wcet_us).sum();
        total as f64 / self.spec.period_us as f64
    }
}

/// Why a [`DagSpec`] was refused by [`DagSpec::validate`].
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum DagError {
    /// The DAG has no nodes.
    #[error("DAG '{dag}' has no nodes; give it at least one node")]
    NoNodes {
        /// The DAG's name.
        dag: String,
    },
    /// More nodes than [`DagLimits::max_nodes`].
    #[error("DAG '{dag}' has {count} nodes but at most {limit} are accepted; merge nodes or split the DAG")]
    TooManyNodes {
        /// The DAG's name.
        dag: String,
        /// Nodes declared.
        count: usize,
        /// The limit in force.
        limit: usize,
    },
    /// More edges than [`DagLimits::max_edges`].
    #[error("DAG '{dag}' has {count} edges but at most {limit} are accepted; remove redundant edges")]
    TooManyEdges {
        /// The DAG's name.
        dag: String,
        /// Edges declared.
        count: usize,
        /// The limit in force.
        limit: usize,
    },
    /// A period of zero.
    #[error("DAG '{dag}' has a period of 0 µs; a periodic DAG needs a positive period")]
    ZeroPeriod {
        /// The DAG's name.
        dag: String,
    },
    /// A period above [`DagLimits::max_period_us`].
    #[error("DAG '{dag}' has a period of {period} but at most {limit} is accepted; use a shorter period", period = Micros(*period_us), limit = Micros(*limit_us))]
    PeriodTooLong {
        /// The DAG's name.
        dag: String,
        /// Declared period.
        period_us: u64,
        /// The limit in force.
        limit_us: u64,
    },
    /// An end-to-end deadline of zero.
    #[error("DAG '{dag}' has a deadline of 0 µs; give it a positive deadline or leave it out to use the period")]
    ZeroDeadline {
        /// The DAG's name.
        dag: String,
    },
    /// A deadline longer than the period (each node is a constrained-deadline task).
    #[error("DAG '{dag}' has a deadline of {deadline} but a period of {period}; Agora needs deadline ≤ period so that instances do not overlap: shorten the deadline or lengthen the period", deadline = Micros(*deadline_us), period = Micros(*period_us))]
    DeadlineLongerThanPeriod {
        /// The DAG's name.
        dag: String,
        /// Declared deadline.
        deadline_us: u64,
        /// Declared period.
        period_us: u64,
    },
    /// Two nodes with the same name.
    #[error("DAG '{dag}' has two nodes named '{name}' (indices {first} and {second}); node names must be unique")]
    DuplicateNodeName {
        /// The DAG's name.
        dag: String,
        /// The repeated name.
        name: String,
        /// Index of its first use.
        first: usize,
        /// Index of its second use.
        second: usize,
    },
    /// A node with a WCET of zero.
    #[error("node '{node}' of DAG '{dag}' has a WCET of 0 µs; give it at least 1 µs or remove it")]
    ZeroWcet {
        /// The DAG's name.
        dag: String,
        /// The node's name.
        node: String,
    },
    /// A declared node deadline shorter than the node's WCET.
    #[error("node '{node}' of DAG '{dag}' has a relative deadline of {deadline} but a WCET of {wcet}; no lane can finish it in time: lengthen its deadline or leave it out", deadline = Micros(*relative_deadline_us), wcet = Micros(*wcet_us))]
    NodeDeadlineShorterThanWcet {
        /// The DAG's name.
        dag: String,
        /// The node's name.
        node: String,
        /// Declared relative deadline.
        relative_deadline_us: u64,
        /// Declared WCET.
        wcet_us: u64,
    },
    /// An edge naming a node index that does not exist.
    #[error("edge {edge} of DAG '{dag}' is {from} → {to} but the DAG has only {node_count} nodes (indices 0 to {last}); fix the edge", last = node_count.saturating_sub(1))]
    EdgeOutOfRange {
        /// The DAG's name.
        dag: String,
        /// Position of the edge in the list.
        edge: usize,
        /// Its source index.
        from: usize,
        /// Its destination index.
        to: usize,
        /// Number of nodes.
        node_count: usize,
    },
    /// An edge from a node to itself.
    #[error("edge {edge} of DAG '{dag}' goes from node '{node}' to itself; remove it")]
    SelfEdge {
        /// The DAG's name.
        dag: String,
        /// Position of the edge in the list.
        edge: usize,
        /// The node's name.
        node: String,
    },
    /// The edges form a cycle.
    #[error("DAG '{dag}' has a cycle {cycle}; a node cannot wait for itself: remove one of these edges", cycle = arrow_path(nodes))]
    Cycle {
        /// The DAG's name.
        dag: String,
        /// Names along the cycle, first repeated at the end.
        nodes: Vec<String>,
    },
    /// The critical path alone takes longer than the deadline.
    #[error("DAG '{dag}': critical path {path} needs {needed} of WCET but the deadline is {deadline}; shorten these nodes, run them in parallel, or lengthen the deadline", path = arrow_path(path), needed = Micros(*wcet_us), deadline = Micros(*deadline_us))]
    DeadlineShorterThanCriticalPath {
        /// The DAG's name.
        dag: String,
        /// Names along the critical path.
        path: Vec<String>,
        /// Sum of their WCETs.
        wcet_us: u64,
        /// The end-to-end deadline.
        deadline_us: u64,
    },
    /// Declared node deadlines (plus the WCET of undeclared nodes) on one path exceed the DAG's
    /// deadline, so the declared deadlines cannot all be honoured.
    #[error("DAG '{dag}': path {path} needs {needed} ({declared} of declared node deadlines plus {wcet} of WCET of the other nodes) but the deadline is {deadline}; shorten the declared node deadlines or lengthen the DAG's deadline", path = arrow_path(path), needed = Micros(declared_us + wcet_us), declared = Micros(*declared_us), wcet = Micros(*wcet_us), deadline = Micros(*deadline_us))]
    DeclaredDeadlinesExceedDeadline {
        /// The DAG's name.
        dag: String,
        /// Names along the offending path.
        path: Vec<String>,
        /// Sum of declared node deadlines on it.
        declared_us: u64,
        /// Sum of WCETs of its nodes without a declared deadline.
        wcet_us: u64,
        /// The end-to-end deadline.
        deadline_us: u64,
    },
}

fn validate(spec: &DagSpec, limits: &DagLimits) -> Result<ValidatedDag, DagError> {
    let dag = || spec.name.clone();
    let node_count = spec.nodes.len();
    if node_count == 0 {
        return Err(DagError::NoNodes { dag: dag() });
    }
    if node_count > limits.max_nodes {
        return Err(DagError::TooManyNodes {
            dag: dag(),
            count: node_count,
            limit: limits.max_nodes,
        });
    }
    if spec.edges.len() > limits.max_edges {
        return Err(DagError::TooManyEdges {
            dag: dag(),
            count: spec.edges.len(),
            limit: limits.max_edges,
        });
    }
    if spec.period_us == 0 {
        return Err(DagError::ZeroPeriod { dag: dag() });
    }
    if spec.period_us > limits.max_period_us {
        return Err(DagError::PeriodTooLong {
            dag: dag(),
            period_us: spec.period_us,
            limit_us: limits.max_period_us,
        });
    }
    let deadline_us = spec.effective_deadline_us();
    if deadline_us == 0 {
        return Err(DagError::ZeroDeadline { dag: dag() });
    }
    if deadline_us > spec.period_us {
        return Err(DagError::DeadlineLongerThanPeriod {
            dag: dag(),
            deadline_us,
            period_us: spec.period_us,
        });
    }

    let mut first_use: HashMap<&str, usize> = HashMap::with_capacity(node_count);
    for (index, node) in spec.nodes.iter().enumerate() {
        if let Some(&first) = first_use.get(node.name.as_str()) {
            return Err(DagError::DuplicateNodeName {
                dag: dag(),
                name: node.name.clone(),
                first,
                second: index,
            });
        }
        first_use.insert(&node.name, index);
        if node.wcet_us == 0 {
            return Err(DagError::ZeroWcet {
                dag: dag(),
                node: node.name.clone(),
            });
        }
        if let Some(relative_deadline_us) = node.relative_deadline_us {
            if relative_deadline_us < node.wcet_us {
                return Err(DagError::NodeDeadlineShorterThanWcet {
                    dag: dag(),
                    node: node.name.clone(),
                    relative_deadline_us,
                    wcet_us: node.wcet_us,
                });
            }
        }
    }

    let mut predecessors = vec![Vec::new(); node_count];
    let mut successors = vec![Vec::new(); node_count];
    for (edge, &(from, to)) in spec.edges.iter().enumerate() {
        if from >= node_count || to >= node_count {
            return Err(DagError::EdgeOutOfRange {
                dag: dag(),
                edge,
                from,
                to,
                node_count,
            });
        }
        if from == to {
            return Err(DagError::SelfEdge {
                dag: dag(),
                edge,
                node: spec.nodes[from].name.clone(),
            });
        }
        successors[from].push(to);
        predecessors[to].push(from);
    }
    for list in predecessors.iter_mut().chain(successors.iter_mut()) {
        list.sort_unstable();
        list.dedup();
    }
    let mut normalised = spec.clone();
    normalised.edges = successors
        .iter()
        .enumerate()
        .flat_map(|(from, targets)| targets.iter().map(move |&to| (from, to)))
        .collect();

    let topological_order = match graph::topological_order(&predecessors, &successors) {
        Ok(order) => order,
        Err(unordered) => {
            let cycle = graph::find_cycle(&predecessors, &unordered);
            let nodes = cycle.iter().map(|&index| spec.nodes[index].name.clone()).collect();
            return Err(DagError::Cycle { dag: dag(), nodes });
        }
    };

    // Periods are bounded by `max_period_us`, but WCETs are not yet: sums saturate, which can only
    // make a path look longer than the deadline, never shorter.
    let wcet = |index: usize| u128::from(spec.nodes[index].wcet_us);
    let (critical_length, critical_nodes) = graph::longest_path(&topological_order, &predecessors, wcet);
    let critical_wcet_us = u64::try_from(critical_length).unwrap_or(u64::MAX);
    let names = |path: &[usize]| path.iter().map(|&index| spec.nodes[index].name.clone()).collect();
    if critical_wcet_us > deadline_us {
        return Err(DagError::DeadlineShorterThanCriticalPath {
            dag: dag(),
            path: names(&critical_nodes),
            wcet_us: critical_wcet_us,
            deadline_us,
        });
    }

    let declared_or_wcet = |index: usize| {
        let node = &spec.nodes[index];
        u128::from(node.relative_deadline_us.unwrap_or(node.wcet_us))
    };
    let (needed, path) = graph::longest_path(&topological_order, &predecessors, declared_or_wcet);
    if needed > u128::from(deadline_us) {
        let declared_us = path
            .iter()
            .filter_map(|&index| spec.nodes[index].relative_deadline_us)
            .sum();
        let wcet_us = path
            .iter()
            .filter(|&&index| spec.nodes[index].relative_deadline_us.is_none())
            .map(|&index| spec.nodes[index].wcet_us)
            .sum();
        return Err(DagError::DeclaredDeadlinesExceedDeadline {
            dag: dag(),
            path: names(&path),
            declared_us,
            wcet_us,
            deadline_us,
        });
    }

    let timing = split::split_deadlines(&spec.nodes, deadline_us, &predecessors, &successors, &topological_order);
    let validated = ValidatedDag {
        spec: normalised,
        deadline_us,
        predecessors,
        successors,
        topological_order,
        critical_path: CriticalPath {
            nodes: critical_nodes,
            wcet_us: critical_wcet_us,
        },
        timing,
    };
    debug_assert!(validated
        .timing
        .iter()
        .all(|node| node.release_offset_us + node.relative_deadline_us <= deadline_us));
    Ok(validated)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn chain(names: &[(&str, u64)], period_us: u64) -> DagSpec {
        let mut dag = DagSpec::new("pipeline", period_us);
        dag.nodes = names.iter().map(|&(name, wcet)| NodeSpec::new(name, wcet)).collect();
        dag.edges = (1..names.len()).map(|index| (index - 1, index)).collect();
        dag
    }

    fn refuse(dag: &DagSpec) -> DagError {
        dag.validate(&DagLimits::default()).unwrap_err()
    }

    #[test]
    fn critical_path_longer_than_the_deadline_is_refused_with_the_arithmetic() {
        let mut dag = chain(&[("a", 2_000), ("b", 3_000), ("c", 2_000)], 10_000);
        dag.deadline_us = Some(5_000);
        let error = refuse(&dag);
        assert!(matches!(
            error,
            DagError::DeadlineShorterThanCriticalPath {
                wcet_us: 7_000,
                deadline_us: 5_000,
                ..
            }
        ));
        assert!(
            error
                .to_string()
                .contains("critical path a → b → c needs 7 ms of WCET but the deadline is 5 ms"),
            "{error}"
        );
    }

    #[test]
    fn a_cycle_is_named_node_by_node() {
        let mut dag = chain(&[("source", 1), ("a", 1), ("b", 1), ("c", 1)], 100);
        dag.edges.push((3, 1));
        let error = refuse(&dag);
        let DagError::Cycle { nodes, .. } = &error else {
            panic!("{error}")
        };
        assert_eq!(nodes.first(), nodes.last());
        assert_eq!(nodes.len(), 4);
        for name in ["a", "b", "c"] {
            assert!(nodes.iter().any(|node| node == name));
        }
        assert!(error.to_string().contains(" → "), "{error}");
    }

    #[test]
    fn every_structural_error_has_its_own_variant() {
        let limits = DagLimits::default();
        let empty = DagSpec::new("empty", 100);
        assert!(matches!(refuse(&empty), DagError::NoNodes { .. }));

        let mut zero_period = chain(&[("a", 1)], 0);
        zero_period.deadline_us = Some(1);
        assert!(matches!(refuse(&zero_period), DagError::ZeroPeriod { .. }));

        let mut long_deadline = chain(&[("a", 1)], 100);
        long_deadline.deadline_us = Some(101);
        assert!(matches!(
            refuse(&long_deadline),
            DagError::DeadlineLongerThanPeriod { .. }
        ));

        let mut zero_deadline = chain(&[("a", 1)], 100);
        zero_deadline.deadline_us = Some(0);
        assert!(matches!(refuse(&zero_deadline), DagError::ZeroDeadline { .. }));

        let too_long = chain(&[("a", 1)], limits.max_period_us + 1);
        assert!(matches!(refuse(&too_long), DagError::PeriodTooLong { .. }));

        let mut out_of_range = chain(&[("a", 1), ("b", 1)], 100);
        out_of_range.edges.push((1, 2));
        let error = refuse(&out_of_range);
        assert!(matches!(
            error,
            DagError::EdgeOutOfRange {
                edge: 1,
                from: 1,
                to: 2,
                node_count: 2,
                ..
            }
        ));
        assert!(error.to_string().contains("indices 0 to 1"), "{error}");

        let mut self_edge = chain(&[("a", 1), ("b", 1)], 100);
        self_edge.edges.push((1, 1));
        assert!(matches!(refuse(&self_edge), DagError::SelfEdge { edge: 1, .. }));

        let duplicate = chain(&[("a", 1), ("b", 1), ("a", 1)], 100);
        assert!(matches!(
            refuse(&duplicate),
            DagError::DuplicateNodeName {
                first: 0,
                second: 2,
                ..
            }
        ));

        let zero_wcet = chain(&[("a", 0)], 100);
        assert!(matches!(refuse(&zero_wcet), DagError::ZeroWcet { .. }));

        let big = chain(&(0..5).map(|_| ("x", 1)).collect::<Vec<_>>(), 100);
        let small_limits = DagLimits { max_nodes: 4, ..limits };
        assert!(matches!(
            big.validate(&small_limits),
            Err(DagError::TooManyNodes { count: 5, limit: 4, .. })
        ));
        let few_edges = DagLimits { max_edges: 1, ..limits };
        let two_edges = chain(&[("a", 1), ("b", 1), ("c", 1)], 100);
        assert!(matches!(
            two_edges.validate(&few_edges),
            Err(DagError::TooManyEdges { count: 2, limit: 1, .. })
        ));

        let mut short_node_deadline = chain(&[("a", 10), ("b", 10)], 100);
        short_node_deadline.nodes[1].relative_deadline_us = Some(9);
        assert!(matches!(
            refuse(&short_node_deadline),
            DagError::NodeDeadlineShorterThanWcet { .. }
        ));

        let mut declared_too_long = chain(&[("a", 10), ("b", 10), ("c", 10)], 100);
        declared_too_long.nodes[0].relative_deadline_us = Some(50);
        declared_too_long.nodes[1].relative_deadline_us = Some(45);
        let error = refuse(&declared_too_long);
        assert!(
            matches!(
                error,
                DagError::DeclaredDeadlinesExceedDeadline {
                    declared_us: 95,
                    wcet_us: 10,
                    deadline_us: 100,
                    ..
                }
            ),
            "{error}"
        );
    }

    #[test]
    fn a_chain_splits_its_deadline_in_proportion_to_wcet() {
        let dag = chain(&[("a", 1_000), ("b", 3_000)], 8_000)
            .validate(&DagLimits::default())
            .unwrap();
        assert_eq!(dag.critical_path().wcet_us, 4_000);
        assert_eq!(dag.critical_path().nodes, vec![0, 1]);
        let timing = dag.timings();
        assert_eq!(
            (timing[0].release_offset_us, timing[0].relative_deadline_us),
            (0, 2_000)
        );
        assert_eq!(
            (timing[1].release_offset_us, timing[1].relative_deadline_us),
            (2_000, 6_000)
        );
    }

    #[test]
    fn side_branches_get_the_slack_the_critical_path_leaves() {
        // a → {b (long), c (short)} → d, deadline 100: the critical path a-b-d fills it exactly;
        // c gets everything between a's and d's windows.
        let mut dag = DagSpec::new("diamond", 100);
        dag.nodes = vec![
            NodeSpec::new("a", 10),
            NodeSpec::new("b", 30),
            NodeSpec::new("c", 5),
            NodeSpec::new("d", 10),
        ];
        dag.edges = vec![(0, 1), (0, 2), (1, 3), (2, 3)];
        let dag = dag.validate(&DagLimits::default()).unwrap();
        let timing = dag.timings();
        assert_eq!(timing[0].relative_deadline_us, 20);
        assert_eq!((timing[1].release_offset_us, timing[1].relative_deadline_us), (20, 60));
        assert_eq!((timing[2].release_offset_us, timing[2].relative_deadline_us), (20, 60));
        assert_eq!((timing[3].release_offset_us, timing[3].relative_deadline_us), (80, 20));
    }

    #[test]
    fn declared_node_deadlines_are_kept_and_the_rest_share_what_is_left() {
        let mut dag = chain(&[("a", 10), ("b", 10), ("c", 20)], 100);
        dag.nodes[0].relative_deadline_us = Some(40);
        let dag = dag.validate(&DagLimits::default()).unwrap();
        let timing = dag.timings();
        assert!(timing[0].declared);
        assert_eq!(timing[0].relative_deadline_us, 40);
        // 60 µs left for 30 µs of WCET: ratio 2.
        assert_eq!((timing[1].release_offset_us, timing[1].relative_deadline_us), (40, 20));
        assert_eq!((timing[2].release_offset_us, timing[2].relative_deadline_us), (60, 40));
    }

    #[test]
    fn duplicate_edges_are_merged() {
        let mut dag = chain(&[("a", 1), ("b", 1)], 10);
        dag.edges.push((0, 1));
        let dag = dag.validate(&DagLimits::default()).unwrap();
        assert_eq!(dag.spec().edges, vec![(0, 1)]);
        assert_eq!(dag.predecessors(1), &[0]);
    }
}
