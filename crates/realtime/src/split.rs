//! Deadline splitting: turning one end-to-end deadline into a release offset and a relative
//! deadline per node, for partitioned EDF.
//!
//! Owns the arithmetic of the rule documented on [`crate::model::ValidatedDag::node_timing`]
//! (declared deadlines kept, the rest shared tightest path first in proportion to WCET, offsets
//! as early as precedence allows, leftover slack given to the node before it). It must only be
//! called on a graph that [`crate::model`] has checked: acyclic, every path's declared deadlines
//! plus undeclared WCETs within the end-to-end deadline, all times under 2³² µs. Under those
//! preconditions every ratio it computes is at least 1, so no derived deadline is shorter than
//! its node's WCET, and integer arithmetic (rounding down) keeps every path within the deadline.

use crate::graph::longest_path;
use crate::model::{NodeSpec, NodeTiming};

/// Derives every node's timing; see the module doc for the preconditions.
pub(crate) fn split_deadlines(
    nodes: &[NodeSpec],
    end_to_end_deadline_us: u64,
    predecessors: &[Vec<usize>],
    successors: &[Vec<usize>],
    order: &[usize],
) -> Vec<NodeTiming> {
    let deadline = u128::from(end_to_end_deadline_us);
    let wcet = |index: usize| u128::from(nodes[index].wcet_us);
    let mut assigned: Vec<Option<u128>> = nodes
        .iter()
        .map(|node| node.relative_deadline_us.map(u128::from))
        .collect();

    while assigned.iter().any(Option::is_none) {
        // Start from the path with the most unassigned WCET (ties: most assigned deadline); it
        // has unassigned work, so its ratio is defined.
        let most_work = |index: usize| match assigned[index] {
            Some(fixed) => fixed,
            None => wcet(index) << 64,
        };
        let (_, mut path) = longest_path(order, predecessors, most_work);
        // Dinkelbach's iteration for the path minimising (deadline − fixed) / work: weigh each
        // node by the current ratio and look for a path that would overrun the deadline with
        // it. If there is one, its own ratio is strictly smaller; if not, the ratio is minimal.
        let (numerator, denominator) = loop {
            let (fixed, work) = path_sums(&path, &assigned, &wcet);
            let numerator = deadline - fixed;
            let denominator = work;
            let scaled = |index: usize| match assigned[index] {
                Some(fixed) => fixed * denominator,
                None => wcet(index) * numerator,
            };
            let (value, candidate) = longest_path(order, predecessors, scaled);
            if value <= deadline * denominator {
                break (numerator, denominator);
            }
            path = candidate;
        };
        for &index in &path {
            if assigned[index].is_none() {
                assigned[index] = Some(wcet(index) * numerator / denominator);
            }
        }
    }

    let relative: Vec<u64> = assigned
        .iter()
        .map(|value| u64::try_from(value.unwrap_or(0)).unwrap_or(u64::MAX))
        .collect();
    let mut offsets = vec![0u64; nodes.len()];
    for &index in order {
        offsets[index] = predecessors[index]
            .iter()
            .map(|&predecessor| offsets[predecessor] + relative[predecessor])
            .max()
            .unwrap_or(0);
    }
    (0..nodes.len())
        .map(|index| {
            let declared = nodes[index].relative_deadline_us.is_some();
            // Everything between this node's offset and its earliest successor's offset (or the
            // end-to-end deadline) is free for it: the successors' offsets are already fixed.
            let window_end = successors[index]
                .iter()
                .map(|&successor| offsets[successor])
                .min()
                .unwrap_or(end_to_end_deadline_us);
            let relative_deadline_us = if declared {
                relative[index]
            } else {
                relative[index].max(window_end - offsets[index])
            };
            NodeTiming {
                release_offset_us: offsets[index],
                relative_deadline_us,
                declared,
            }
        })
        .collect()
}

/// Sum of assigned deadlines and of unassigned WCETs along `path`.
fn path_sums(path: &[usize], assigned: &[Option<u128>], wcet: &impl Fn(usize) -> u128) -> (u128, u128) {
    path.iter().fold((0, 0), |(fixed, work), &index| match assigned[index] {
        Some(deadline) => (fixed + deadline, work),
        None => (fixed, work + wcet(index)),
    })
}
