//! How much APEDF-FF admits on four lanes, the figure AMPERE quotes as "about 2.5", and the
//! sweep behind `agora bench rt`.

use agora_realtime::{generate, sweep, Admission, AdmissionConfig, GeneratorConfig, SweepConfig};

const SETS: u64 = 20;

fn admit_in_order(config: &GeneratorConfig, seed: u64) -> (f64, bool) {
    let set = generate(config, seed).unwrap();
    let mut admission = Admission::new(AdmissionConfig {
        lanes: 4,
        ..AdmissionConfig::default()
    })
    .unwrap();
    // Offer every DAG even after a refusal (no short-circuit): a later, smaller one may fit.
    let outcomes: Vec<bool> = set.dags.into_iter().map(|dag| admission.admit(dag).is_ok()).collect();
    let all = outcomes.iter().all(|&admitted| admitted);
    (admission.admitted_utilisation(), all)
}

/// Typical generated sets: 16 DAGs of 2–6 nodes in 1–3 layers, periods 10–100 ms. Measured when
/// this was written: 3.50 admitted on average out of 3.5 offered, 20 of 20 sets fully admitted at
/// 2.5.
#[test]
fn apedf_first_fit_admits_at_least_two_and_a_half_on_four_lanes() {
    let offered = GeneratorConfig {
        dag_count: 16,
        total_utilisation: 3.5,
        ..GeneratorConfig::default()
    };
    let mean = (0..SETS).map(|seed| admit_in_order(&offered, seed).0).sum::<f64>() / SETS as f64;
    let at_bound = GeneratorConfig {
        total_utilisation: 2.5,
        ..offered
    };
    let fully_admitted = (0..SETS)
        .filter(|&seed| admit_in_order(&at_bound, 1_000 + seed).1)
        .count();
    println!("APEDF-FF on 4 lanes: mean admitted {mean:.3} of 3.5 offered; {fully_admitted}/{SETS} sets at 2.5 fully admitted");
    assert!(mean >= 2.5, "mean admitted utilisation {mean:.3}");
    assert!(
        fully_admitted as u64 >= SETS * 9 / 10,
        "{fully_admitted}/{SETS} sets at 2.5 admitted"
    );
}

#[test]
fn the_sweep_summary_has_the_bench_fields_and_no_admitted_miss() {
    let config = SweepConfig {
        sets_per_point: 2,
        duration_us: 300_000,
        step: 1.0,
        ..SweepConfig::new(4)
    };
    let report = sweep(&config).unwrap();
    let targets: Vec<f64> = report.points.iter().map(|point| point.target_utilisation).collect();
    assert_eq!(targets, vec![0.5, 1.5, 2.5, 3.5, 4.0]);
    assert_eq!(report.summary.admitted_misses, 0);
    let json = serde_json::to_value(&report.summary).unwrap();
    for field in [
        "lanes",
        "admitted_misses",
        "apedf_admitted_utilisation",
        "gedf_miss_ratio_at_full",
        "fifo_miss_ratio_at_full",
    ] {
        assert!(json.get(field).is_some(), "missing {field} in {json}");
    }
    assert_eq!(json["lanes"], 4);
    assert!(report.summary.apedf_admitted_utilisation >= 2.5, "{json}");
}
