//! Graph algorithms on a DAG's adjacency lists: topological order, a cycle when there is none,
//! and longest weighted paths.
//!
//! Owns only index arithmetic on `predecessors`/`successors` lists; it knows nothing about
//! time, names or errors, so [`crate::model`] can word the errors and [`crate::split`] can pick
//! the weights. Every tie is broken towards the lower node index so that the same DAG always
//! gives the same order and the same path, which keeps reports and tests reproducible.

use std::cmp::Reverse;
use std::collections::BinaryHeap;

/// Kahn's algorithm, always taking the lowest-indexed ready node. Returns the order, or the
/// nodes that could not be ordered (they lie on or behind a cycle) when there is a cycle.
pub(crate) fn topological_order(
    predecessors: &[Vec<usize>],
    successors: &[Vec<usize>],
) -> Result<Vec<usize>, Vec<usize>> {
    let node_count = predecessors.len();
    let mut remaining_inputs: Vec<usize> = predecessors.iter().map(Vec::len).collect();
    let mut ready: BinaryHeap<Reverse<usize>> = (0..node_count)
        .filter(|&node| remaining_inputs[node] == 0)
        .map(Reverse)
        .collect();
    let mut order = Vec::with_capacity(node_count);
    while let Some(Reverse(node)) = ready.pop() {
        order.push(node);
        for &successor in &successors[node] {
            remaining_inputs[successor] -= 1;
            if remaining_inputs[successor] == 0 {
                ready.push(Reverse(successor));
            }
        }
    }
    if order.len() == node_count {
        Ok(order)
    } else {
        Err((0..node_count).filter(|&node| remaining_inputs[node] > 0).collect())
    }
}

/// One cycle among `unordered` (the nodes Kahn's algorithm could not order), in edge direction,
/// starting and ending with the same node.
///
/// Every unordered node has an unordered predecessor (otherwise it would have been ordered), so
/// walking backwards must revisit a node; the walk between the two visits is a cycle.
pub(crate) fn find_cycle(predecessors: &[Vec<usize>], unordered: &[usize]) -> Vec<usize> {
    let mut is_unordered = vec![false; predecessors.len()];
    for &node in unordered {
        is_unordered[node] = true;
    }
    let mut position_in_walk = vec![usize::MAX; predecessors.len()];
    let mut walk = Vec::new();
    let mut node = unordered[0];
    loop {
        if position_in_walk[node] != usize::MAX {
            let mut cycle: Vec<usize> = walk[position_in_walk[node]..].to_vec();
            // The walk went against the edges: reverse it to read in edge direction.
            cycle.reverse();
            cycle.push(cycle[0]);
            return cycle;
        }
        position_in_walk[node] = walk.len();
        walk.push(node);
        node = predecessors[node]
            .iter()
            .copied()
            .find(|&predecessor| is_unordered[predecessor])
            .unwrap_or(node);
    }
}

/// The heaviest source-to-sink path under `weight`, as (total weight, nodes in order).
///
/// `order` must be a topological order. Ties go to the lower-indexed predecessor and sink.
pub(crate) fn longest_path(
    order: &[usize],
    predecessors: &[Vec<usize>],
    weight: impl Fn(usize) -> u128,
) -> (u128, Vec<usize>) {
    let node_count = predecessors.len();
    let mut best = vec![0u128; node_count];
    let mut best_predecessor = vec![usize::MAX; node_count];
    for &node in order {
        let mut chosen: Option<usize> = None;
        for &predecessor in &predecessors[node] {
            chosen = match chosen {
                Some(current)
                    if best[predecessor] < best[current]
                        || (best[predecessor] == best[current] && predecessor > current) =>
                {
                    Some(current)
                }
                _ => Some(predecessor),
            };
        }
        best_predecessor[node] = chosen.unwrap_or(usize::MAX);
        best[node] = chosen.map_or(0, |current| best[current]).saturating_add(weight(node));
    }
    let mut end = 0;
    for node in 1..node_count {
        if best[node] > best[end] {
            end = node;
        }
    }
    let mut path = vec![end];
    let mut node = end;
    while best_predecessor[node] != usize::MAX {
        node = best_predecessor[node];
        path.push(node);
    }
    path.reverse();
    (best[end], path)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn lists(node_count: usize, edges: &[(usize, usize)]) -> (Vec<Vec<usize>>, Vec<Vec<usize>>) {
        let mut predecessors = vec![Vec::new(); node_count];
        let mut successors = vec![Vec::new(); node_count];
        for &(from, to) in edges {
            successors[from].push(to);
            predecessors[to].push(from);
        }
        (predecessors, successors)
    }

    #[test]
    fn orders_a_diamond_and_finds_its_heaviest_branch() {
        let (predecessors, successors) = lists(4, &[(0, 1), (0, 2), (1, 3), (2, 3)]);
        let order = topological_order(&predecessors, &successors).unwrap();
        assert_eq!(order, vec![0, 1, 2, 3]);
        let weights = [1u128, 2, 5, 1];
        let (length, path) = longest_path(&order, &predecessors, |node| weights[node]);
        assert_eq!((length, path), (7, vec![0, 2, 3]));
    }

    #[test]
    fn finds_the_cycle_behind_a_tail() {
        // 0 → 1 → 2 → 3 → 1: node 0 orders, 1..3 do not.
        let (predecessors, successors) = lists(4, &[(0, 1), (1, 2), (2, 3), (3, 1)]);
        let unordered = topological_order(&predecessors, &successors).unwrap_err();
        assert_eq!(unordered, vec![1, 2, 3]);
        let cycle = find_cycle(&predecessors, &unordered);
        assert_eq!(cycle.first(), cycle.last());
        assert_eq!(cycle.len(), 4);
        for pair in cycle.windows(2) {
            assert!(successors[pair[0]].contains(&pair[1]));
        }
    }
}
