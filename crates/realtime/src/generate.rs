//! Seeded synthetic task sets: how many DAGs, how big, how busy, reproducibly.
//!
//! Owns the recipe used by tests and benchmarks: per-DAG utilisations by UUniFast-discard
//! (Bini & Buttazzo's UUniFast, redrawing any set where one DAG would exceed the cap), random
//! layered DAGs (nodes spread over layers, edges only from one layer to the next, each node
//! after the first layer with at least one predecessor), per-node WCETs by UUniFast within the
//! DAG, periods uniform in a range on a grid, and implicit deadlines. The same seed gives the
//! same set on every platform: the generator is ChaCha8, whose stream is fixed by its spec.
//!
//! It must not admit or simulate anything; it only makes [`ValidatedDag`]s.

use chacha20::ChaCha8Rng;
use rand::{Rng, RngExt, SeedableRng};
use serde::{Deserialize, Serialize};
use thiserror::Error;

use crate::model::{DagError, DagLimits, DagSpec, NodeSpec, ValidatedDag};

/// What kind of task sets to make.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct GeneratorConfig {
    /// DAGs per set.
    pub dag_count: usize,
    /// Target sum of the DAGs' utilisations.
    pub total_utilisation: f64,
    /// No DAG may get more than this utilisation (UUniFast-discard's cap), in `(0, 1]`: a DAG
    /// whose nodes add up to more than its period could not meet an implicit deadline on a
    /// critical path that holds every node.
    pub max_dag_utilisation: f64,
    /// Fewest nodes per DAG.
    pub min_nodes: usize,
    /// Most nodes per DAG.
    pub max_nodes: usize,
    /// Fewest layers per DAG.
    pub min_layers: usize,
    /// Most layers per DAG (never more than its nodes).
    pub max_layers: usize,
    /// Chance of each edge between consecutive layers.
    pub edge_probability: f64,
    /// Shortest period in microseconds.
    pub min_period_us: u64,
    /// Longest period in microseconds.
    pub max_period_us: u64,
    /// Periods are multiples of this many microseconds.
    pub period_step_us: u64,
    /// UUniFast-discard redraws at most this many times.
    pub max_draws: usize,
}

impl Default for GeneratorConfig {
    /// Eight DAGs of 2–6 nodes in 1–3 layers, edge probability 0.5, periods 10–100 ms on a
    /// 1 ms grid, total utilisation 1.
    fn default() -> Self {
        Self {
            dag_count: 8,
            total_utilisation: 1.0,
            max_dag_utilisation: 1.0,
            min_nodes: 2,
            max_nodes: 6,
            min_layers: 1,
            max_layers: 3,
            edge_probability: 0.5,
            min_period_us: 10_000,
            max_period_us: 100_000,
            period_step_us: 1_000,
            max_draws: 100_000,
        }
    }
}

/// A generated set.
#[derive(Debug, Clone, PartialEq)]
pub struct GeneratedSet {
    /// The DAGs, named `dag0`, `dag1`, ...
    pub dags: Vec<ValidatedDag>,
    /// The utilisation UUniFast drew for each DAG; their sum is the target. WCETs are whole
    /// microseconds, so each DAG's [`ValidatedDag::utilisation`] is within a few µs per node of it.
    pub utilisations: Vec<f64>,
}

/// Why no set could be made.
#[derive(Debug, Clone, PartialEq, Error)]
pub enum GenerateError {
    /// A configuration field that cannot work.
    #[error("generator setting {field} is invalid: {reason}")]
    InvalidConfig {
        /// The field's name.
        field: &'static str,
        /// What is wrong with it.
        reason: String,
    },
    /// UUniFast-discard redrew too often.
    #[error("UUniFast-discard gave up after {draws} draws: {dag_count} DAGs rarely reach a utilisation of {total} with each at most {cap}; add DAGs or raise the cap")]
    TooManyDiscards {
        /// Draws made.
        draws: usize,
        /// DAGs per set.
        dag_count: usize,
        /// Target total.
        total: f64,
        /// Per-DAG cap.
        cap: f64,
    },
    /// A generated DAG failed validation (a bug in the generator).
    #[error("generated DAG is invalid: {0}")]
    Invalid(#[from] DagError),
}

/// UUniFast (Bini & Buttazzo, 2005): `count` utilisations, uniformly distributed over those that
/// sum to `total`.
pub fn uunifast<R: Rng + ?Sized>(count: usize, total: f64, rng: &mut R) -> Vec<f64> {
    let mut utilisations = Vec::with_capacity(count);
    let mut remaining = total;
    for index in 1..count {
        let next = remaining * rng.random::<f64>().powf(1.0 / (count - index) as f64);
        utilisations.push(remaining - next);
        remaining = next;
    }
    if count > 0 {
        utilisations.push(remaining);
    }
    utilisations
}

/// UUniFast, redrawn until no value exceeds `cap`, at most `max_draws` times.
pub fn uunifast_discard<R: Rng + ?Sized>(
    count: usize,
    total: f64,
    cap: f64,
    max_draws: usize,
    rng: &mut R,
) -> Option<Vec<f64>> {
    (0..max_draws)
        .map(|_| uunifast(count, total, rng))
        .find(|utilisations| utilisations.iter().all(|&value| value <= cap))
}

/// Makes one set from `config`; the same `seed` gives the same set.
pub fn generate(config: &GeneratorConfig, seed: u64) -> Result<GeneratedSet, GenerateError> {
    check(config)?;
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    let utilisations = uunifast_discard(
        config.dag_count,
        config.total_utilisation,
        config.max_dag_utilisation,
        config.max_draws,
        &mut rng,
    )
    .ok_or(GenerateError::TooManyDiscards {
        draws: config.max_draws,
        dag_count: config.dag_count,
        total: config.total_utilisation,
        cap: config.max_dag_utilisation,
    })?;
    let limits = DagLimits {
        max_nodes: config.max_nodes.max(DagLimits::default().max_nodes),
        ..DagLimits::default()
    };
    let dags = utilisations
        .iter()
        .enumerate()
        .map(|(index, &utilisation)| {
            random_layered_dag(format!("dag{index}"), utilisation, config, &mut rng).validate(&limits)
        })
        .collect::<Result<Vec<_>, _>>()?;
    Ok(GeneratedSet { dags, utilisations })
}

/// One random layered DAG with the given utilisation, period drawn from `config`.
pub fn random_layered_dag<R: Rng + ?Sized>(
    name: String,
    utilisation: f64,
    config: &GeneratorConfig,
    rng: &mut R,
) -> DagSpec {
    let node_count = rng.random_range(config.min_nodes..=config.max_nodes);
    let layer_count = rng.random_range(config.min_layers.min(node_count)..=config.max_layers.min(node_count));
    // One node per layer first so that no layer is empty, the rest anywhere; sorting by layer
    // makes indices follow the layers.
    let mut layer_of: Vec<usize> = (0..layer_count)
        .chain((layer_count..node_count).map(|_| rng.random_range(0..layer_count)))
        .collect();
    layer_of.sort_unstable();

    let steps = (config.min_period_us / config.period_step_us)..=(config.max_period_us / config.period_step_us);
    let period_us = rng.random_range(steps) * config.period_step_us;

    let mut wcets: Vec<u64> = uunifast(node_count, utilisation, rng)
        .into_iter()
        .map(|share| ((share * period_us as f64).floor() as u64).max(1))
        .collect();
    // Rounding up tiny nodes to 1 µs could push the sum past the period; take it back from
    // the largest node.
    while wcets.iter().sum::<u64>() > period_us {
        if let Some(largest) = wcets.iter_mut().max() {
            *largest -= 1;
        }
    }

    let mut edges = Vec::new();
    for node in 0..node_count {
        let layer = layer_of[node];
        if layer == 0 {
            continue;
        }
        let parents: Vec<usize> = (0..node).filter(|&parent| layer_of[parent] == layer - 1).collect();
        let mut chosen: Vec<usize> = parents
            .iter()
            .copied()
            .filter(|_| rng.random_bool(config.edge_probability))
            .collect();
        if chosen.is_empty() {
            chosen.push(parents[rng.random_range(0..parents.len())]);
        }
        edges.extend(chosen.into_iter().map(|parent| (parent, node)));
    }

    DagSpec {
        name,
        period_us,
        deadline_us: None,
        nodes: wcets
            .iter()
            .enumerate()
            .map(|(index, &wcet)| NodeSpec::new(format!("n{index}"), wcet))
            .collect(),
        edges,
    }
}

fn check(config: &GeneratorConfig) -> Result<(), GenerateError> {
    let invalid = |field: &'static str, reason: &str| {
        Err(GenerateError::InvalidConfig {
            field,
            reason: reason.to_owned(),
        })
    };
    if config.dag_count == 0 {
        return invalid("dag_count", "must be at least 1");
    }
    if !(config.total_utilisation > 0.0 && config.total_utilisation.is_finite()) {
        return invalid("total_utilisation", "must be a positive number");
    }
    if !(config.max_dag_utilisation > 0.0 && config.max_dag_utilisation <= 1.0) {
        return invalid("max_dag_utilisation", "must be in (0, 1]");
    }
    if config.total_utilisation > config.max_dag_utilisation * config.dag_count as f64 {
        return invalid("total_utilisation", "exceeds dag_count × max_dag_utilisation");
    }
    if config.min_nodes == 0 || config.min_nodes > config.max_nodes {
        return invalid("min_nodes", "must be at least 1 and at most max_nodes");
    }
    if config.min_layers == 0 || config.min_layers > config.max_layers {
        return invalid("min_layers", "must be at least 1 and at most max_layers");
    }
    if !(0.0..=1.0).contains(&config.edge_probability) {
        return invalid("edge_probability", "must be in [0, 1]");
    }
    if config.period_step_us == 0 {
        return invalid("period_step_us", "must be positive");
    }
    if config.min_period_us / config.period_step_us == 0 || config.min_period_us > config.max_period_us {
        return invalid("min_period_us", "must be at least one step and at most max_period_us");
    }
    if config.max_period_us > DagLimits::default().max_period_us {
        return invalid("max_period_us", "exceeds the longest period DAG validation accepts");
    }
    if config.max_nodes as u64 > config.min_period_us {
        return invalid(
            "max_nodes",
            "must not exceed the shortest period in µs (each node needs 1 µs)",
        );
    }
    if config.max_draws == 0 {
        return invalid("max_draws", "must be at least 1");
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn layered_dags_have_parents_in_the_previous_layer() {
        let config = GeneratorConfig {
            dag_count: 20,
            total_utilisation: 5.0,
            ..GeneratorConfig::default()
        };
        let set = generate(&config, 3).unwrap();
        for dag in &set.dags {
            assert!((config.min_nodes..=config.max_nodes).contains(&dag.node_count()));
            assert!((10_000..=100_000).contains(&dag.period_us()));
            assert_eq!(dag.period_us() % 1_000, 0);
            assert_eq!(dag.deadline_us(), dag.period_us());
        }
    }

    #[test]
    fn impossible_targets_are_refused() {
        let config = GeneratorConfig {
            dag_count: 2,
            total_utilisation: 3.0,
            ..GeneratorConfig::default()
        };
        assert!(matches!(
            generate(&config, 0),
            Err(GenerateError::InvalidConfig {
                field: "total_utilisation",
                ..
            })
        ));
        let config = GeneratorConfig {
            dag_count: 2,
            total_utilisation: 1.999_999,
            max_draws: 3,
            ..GeneratorConfig::default()
        };
        assert!(matches!(
            generate(&config, 0),
            Err(GenerateError::TooManyDiscards { .. })
        ));
    }
}
