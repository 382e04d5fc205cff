//! Property tests of the guarantees that tie the crate together.

use agora_realtime::generate::{random_layered_dag, uunifast};
use agora_realtime::{
    generate, simulate, Admission, AdmissionConfig, DagError, DagLimits, DagSpec, ExecutionTimeModel, GeneratorConfig,
    NodeSpec, Packing, Policy, SimulationConfig, ValidatedDag,
};
use chacha20::ChaCha8Rng;
use proptest::prelude::*;
use rand::SeedableRng;

/// A generated set, with some DAGs' deadlines tightened below their periods so that
/// constrained deadlines are exercised too.
fn task_set(seed: u64, dag_count: usize, utilisation: f64, max_nodes: usize, tightness: f64) -> Vec<ValidatedDag> {
    let config = GeneratorConfig {
        dag_count,
        total_utilisation: utilisation.min(dag_count as f64 * 0.6),
        max_dag_utilisation: 0.9,
        min_nodes: 1,
        max_nodes,
        max_layers: 4,
        ..GeneratorConfig::default()
    };
    let set = generate(&config, seed).expect("generator config is valid");
    set.dags
        .into_iter()
        .enumerate()
        .map(|(index, dag)| {
            if index % 2 == 1 {
                return dag;
            }
            let mut spec = dag.spec().clone();
            let critical = dag.critical_path().wcet_us;
            let slack = spec.period_us - critical;
            spec.deadline_us = Some(critical + (slack as f64 * tightness) as u64);
            spec.validate(&DagLimits::default())
                .expect("a deadline at least the critical path is valid")
        })
        .collect()
}

proptest! {
    // No regression files: a failure prints its minimal case, which goes into a unit test.
    #![proptest_config(ProptestConfig { cases: 256, failure_persistence: None, ..ProptestConfig::default() })]

    /// THE property: whatever admission admits meets every deadline under APEDF when jobs run
    /// at most their WCET and lanes are fully preemptive — end to end and per node, without a
    /// single migration.
    #[test]
    fn admitted_sets_never_miss_under_apedf(
        seed in any::<u64>(),
        lanes in 1usize..=4,
        dag_count in 1usize..=12,
        offered_per_lane in 0.3f64..1.2,
        max_nodes in 1usize..=8,
        tightness in 0.0f64..=1.0,
        first_fit in any::<bool>(),
        margin in prop_oneof![Just(0.0), 0.0f64..0.2],
        min_fraction in prop_oneof![Just(1.0), 0.1f64..=1.0],
    ) {
        let dags = task_set(seed, dag_count, offered_per_lane * lanes as f64, max_nodes, tightness);
        let packing = if first_fit { Packing::FirstFit } else { Packing::WorstFit };
        let mut admission = Admission::new(AdmissionConfig {
            lanes,
            packing,
            wcet_margin: margin,
            preemption_granularity_us: 0,
        }).unwrap();
        for dag in &dags {
            let _ = admission.admit(dag.clone());
        }
        let workload = admission.workload();
        let longest_period = workload.dags.iter().map(ValidatedDag::period_us).max().unwrap_or(0);
        let config = SimulationConfig {
            duration_us: 3 * longest_period,
            execution: ExecutionTimeModel { min_fraction, max_fraction: 1.0 },
            wcet_margin: margin,
            seed,
            ..SimulationConfig::new(lanes, if first_fit { Policy::ApedfFirstFit } else { Policy::ApedfWorstFit })
        };
        let report = simulate(&workload, &config).unwrap();
        prop_assert_eq!(report.total.deadline_misses, 0, "admitted {} DAGs", workload.dags.len());
        prop_assert_eq!(report.total.node_deadline_misses, 0);
        prop_assert_eq!(report.total.migrations, 0);
    }

    /// Same seed, same set; UUniFast's utilisations add up to the target.
    #[test]
    fn generation_is_deterministic_and_uunifast_sums_to_the_target(
        seed in any::<u64>(),
        dag_count in 1usize..=20,
        per_dag in 0.05f64..0.6,
    ) {
        let config = GeneratorConfig { dag_count, total_utilisation: per_dag * dag_count as f64, ..GeneratorConfig::default() };
        let first = generate(&config, seed).unwrap();
        let second = generate(&config, seed).unwrap();
        prop_assert_eq!(&first, &second);
        let sum: f64 = first.utilisations.iter().sum();
        prop_assert!((sum - config.total_utilisation).abs() < 1e-9 * config.total_utilisation.max(1.0));
        prop_assert!(first.utilisations.iter().all(|&value| (0.0..=1.0).contains(&value)));

        let mut rng = ChaCha8Rng::seed_from_u64(seed);
        let raw = uunifast(dag_count, 3.0, &mut rng);
        prop_assert_eq!(raw.len(), dag_count);
        prop_assert!((raw.iter().sum::<f64>() - 3.0).abs() < 1e-9);
        prop_assert!(raw.iter().all(|&value| value >= 0.0));

        let mut rng = ChaCha8Rng::seed_from_u64(seed);
        let spec = random_layered_dag("probe".to_owned(), 0.5, &config, &mut rng);
        prop_assert!(spec.validate(&DagLimits::default()).is_ok());
    }

    /// Any edge list: either the DAG validates and its order and timing respect every edge, or it
    /// is refused, and a refused cycle really is one.
    #[test]
    fn topological_order_and_timing_respect_every_edge(
        wcets in prop::collection::vec(1u64..1_000, 1..12),
        raw_edges in prop::collection::vec((0usize..12, 0usize..12), 0..30),
        declared in prop::collection::vec(prop::option::weighted(0.2, 1u64..3_000), 12),
    ) {
        let node_count = wcets.len();
        let mut spec = DagSpec::new("random", 100_000);
        spec.nodes = wcets
            .iter()
            .enumerate()
            .map(|(index, &wcet)| NodeSpec {
                relative_deadline_us: declared[index].map(|extra| wcet + extra),
                ..NodeSpec::new(format!("n{index}"), wcet)
            })
            .collect();
        spec.edges = raw_edges
            .into_iter()
            .map(|(from, to)| (from % node_count, to % node_count))
            .filter(|(from, to)| from != to)
            .collect();
        match spec.validate(&DagLimits::default()) {
            Ok(dag) => {
                let order = dag.topological_order();
                let mut position = vec![usize::MAX; node_count];
                for (index, &node) in order.iter().enumerate() {
                    prop_assert_eq!(position[node], usize::MAX, "node {} twice", node);
                    position[node] = index;
                }
                prop_assert!(position.iter().all(|&index| index < node_count));
                for &(from, to) in &spec.edges {
                    prop_assert!(position[from] < position[to], "edge {} → {} out of order", from, to);
                    let (before, after) = (dag.node_timing(from), dag.node_timing(to));
                    prop_assert!(before.release_offset_us + before.relative_deadline_us <= after.release_offset_us);
                }
                for (index, timing) in dag.timings().iter().enumerate() {
                    prop_assert!(timing.relative_deadline_us >= spec.nodes[index].wcet_us);
                    prop_assert!(timing.release_offset_us + timing.relative_deadline_us <= dag.deadline_us());
                    if let Some(declared) = spec.nodes[index].relative_deadline_us {
                        prop_assert_eq!(timing.relative_deadline_us, declared);
                    }
                }
                let path = &dag.critical_path().nodes;
                for pair in path.windows(2) {
                    prop_assert!(spec.edges.contains(&(pair[0], pair[1])));
                }
            }
            Err(DagError::Cycle { nodes, .. }) => {
                prop_assert_eq!(nodes.first(), nodes.last());
                let index_of = |name: &String| spec.nodes.iter().position(|node| &node.name == name).unwrap();
                for pair in nodes.windows(2) {
                    prop_assert!(spec.edges.contains(&(index_of(&pair[0]), index_of(&pair[1]))));
                }
            }
            Err(DagError::DeclaredDeadlinesExceedDeadline { .. }) => {}
            Err(other) => prop_assert!(false, "unexpected refusal: {}", other),
        }
    }
}
