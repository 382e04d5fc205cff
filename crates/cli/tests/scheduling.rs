//! The scheduler from the command line: configuration files, `agora model show`, and the
//! scheduling benchmarks' JSON (smoke runs: fields and verified results, not timings).

use std::process::Command;

const AGORA: &str = env!("CARGO_BIN_EXE_agora");

/// A new temporary directory for one test, removed when the returned value is dropped.
fn dir(tag: &str) -> agora_test_support::TempDir {
    agora_test_support::temp_dir(&format!("cli-sched-{tag}"))
}

fn agora(args: &[&str], state: &std::path::Path) -> std::process::Output {
    Command::new(AGORA)
        .args(args)
        .env("AGORA_STATE_DIR", state)
        .env_remove("AGORA_SOCKET")
        .output()
        .unwrap()
}

#[test]
fn print_config_is_a_valid_config_file_and_flags_override_the_file() {
    let scratch = dir("config");
    let dir = scratch.path();
    let file = dir.join("agora.toml");
    std::fs::write(
        &file,
        "[scheduler]\npolicy = \"energy\"\n[[sim]]\nname = \"s1\"\nmemory = \"64M\"\nkernels = [\"saxpy\"]\n",
    )
    .unwrap();
    let out = agora(&["serve", "--config", file.to_str().unwrap(), "--print-config"], dir);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let printed = String::from_utf8(out.stdout).unwrap();
    assert!(
        printed.contains("policy = \"energy\"") && printed.contains("name = \"s1\""),
        "{printed}"
    );
    // The printed text is itself a configuration file that gives the same settings.
    let again = dir.join("printed.toml");
    std::fs::write(&again, &printed).unwrap();
    let out = agora(
        &[
            "serve",
            "--config",
            again.to_str().unwrap(),
            "--policy",
            "perf",
            "--print-config",
        ],
        dir,
    );
    let reprinted = String::from_utf8(out.stdout).unwrap();
    assert_eq!(reprinted, printed.replace("policy = \"energy\"", "policy = \"perf\""));
}

#[test]
fn a_bad_config_file_is_refused_with_the_reason() {
    let scratch = dir("bad");
    let dir = scratch.path();
    let file = dir.join("agora.toml");
    std::fs::write(&file, "[cpu]\nlanes = \"two\"\n").unwrap();
    let out = agora(&["serve", "--config", file.to_str().unwrap()], dir);
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("agora.toml") && err.contains("lanes"), "{err}");
    let out = agora(&["serve", "--config", dir.join("missing.toml").to_str().unwrap()], dir);
    assert!(String::from_utf8_lossy(&out.stderr).contains("cannot read the configuration file"));
    let out = agora(&["serve", "--policy", "fastest"], dir);
    assert!(String::from_utf8_lossy(&out.stderr).contains("choose rr, perf or energy"));
    let out = agora(&["serve", "--latency-policy", "fastest"], dir);
    assert!(String::from_utf8_lossy(&out.stderr).contains("choose none, priority or elastic"));
    let out = agora(&["serve", "--latency-sla-ms", "0", "--print-config"], dir);
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("positive number of milliseconds"));
    std::fs::write(&file, "[scheduler]\nlatency_sla_ms = -5.0\n").unwrap();
    let out = agora(&["serve", "--config", file.to_str().unwrap()], dir);
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("scheduler.latency_sla_ms"), "{err}");
}

#[test]
fn model_show_prints_what_a_daemon_learned() {
    let scratch = dir("model");
    let dir = scratch.path();
    let out = agora(&["model", "show"], dir);
    assert!(String::from_utf8_lossy(&out.stdout).contains("no measurements"));
    let mut model = agora_daemon::policy::PerformanceModel::new(0.8);
    model.record("sgemm", "cpu0", 65_536, 2.0e6);
    model.record("sgemm", "cpu0", 1 << 20, 40.0e6);
    model.save(dir).unwrap();
    let out = agora(&["model", "show"], dir);
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        text.contains("sgemm") && text.contains("cpu0") && text.contains("2.00 ms"),
        "{text}"
    );
    assert!(text.contains("fit: t ≈"), "{text}");
    let out = agora(&["model", "show", "--json"], dir);
    let rows: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(rows.as_array().unwrap().len(), 2);
}

#[test]
fn bench_hetero_and_sharing_report_their_fields() {
    let scratch = dir("bench");
    let dir = scratch.path();
    let out = agora(
        &["bench", "hetero", "--quick", "--json", "--tenants", "2", "--learn", "1"],
        dir,
    );
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let results: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let policies: Vec<&str> = results
        .as_array()
        .unwrap()
        .iter()
        .map(|r| r["policy"].as_str().unwrap())
        .collect();
    assert_eq!(policies, ["rr", "perf", "energy"]);
    for r in results.as_array().unwrap() {
        assert!(r["makespan_s"].as_f64().unwrap() > 0.0);
        assert!(r["energy_j"].as_f64().unwrap() > 0.0);
        assert!(["measured", "model"].contains(&r["energy_source"].as_str().unwrap()));
        assert_eq!(
            r["utilisation"].as_array().unwrap().len(),
            4,
            "cpu, opencl and two sim devices"
        );
    }
    let out = agora(&["bench", "sharing", "--quick", "--json"], dir);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let r: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let (shared, sequential, ratio) = (
        r["shared_s"].as_f64().unwrap(),
        r["sequential_s"].as_f64().unwrap(),
        r["ratio"].as_f64().unwrap(),
    );
    assert!(shared > 0.0 && sequential > 0.0);
    assert!((ratio - shared / sequential).abs() < 1e-9);
}

#[test]
fn bench_sla_reports_preemption_figures() {
    let scratch = dir("sla");
    let dir = scratch.path();
    let out = agora(&["bench", "sla", "--quick", "--json", "--batch-matrix", "384"], dir);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let r: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    for field in [
        "preempt_chunked_p50_ms",
        "preempt_chunked_p99_ms",
        "preempt_none_p99_ms",
        "preempt_revoke_p50_ms",
        "preempt_revoke_p99_ms",
        "sla_met_fraction",
        "batch_per_s_revoked",
    ] {
        assert!(r[field].as_f64().unwrap() >= 0.0, "{field}: {}", r[field]);
    }
    assert!(r["revoked"]["p50_ms"].as_f64().unwrap() <= r["revoked"]["p99_ms"].as_f64().unwrap());
    assert!(r["chunked"]["p50_ms"].as_f64().unwrap() <= r["chunked"]["p99_ms"].as_f64().unwrap());
}

#[test]
fn sim_is_deterministic_and_reports_the_trem_figures() {
    let scratch = dir("sim");
    let dir = scratch.path();
    let args = [
        "sim",
        "--workload",
        "w2",
        "--load",
        "1.5",
        "--devices",
        "4",
        "--preempt-ms",
        "22",
        "--policy",
        "elastic",
        "--seed",
        "7",
        "--seconds",
        "60",
        "--json",
    ];
    let first = agora(&args, dir);
    assert!(first.status.success(), "{}", String::from_utf8_lossy(&first.stderr));
    let second = agora(&args, dir);
    assert_eq!(first.stdout, second.stdout, "the same seed gives the same result");
    let r: serde_json::Value = serde_json::from_slice(&first.stdout).unwrap();
    for field in [
        "sla_met_fraction",
        "utilisation",
        "wasted_fraction",
        "batch_median_slowdown",
        "batch_p99_slowdown",
        "batch_median_slowdown_vs_alone",
        "sla_attainable_fraction",
    ] {
        let v = r[field].as_f64().unwrap_or(-1.0);
        assert!(v >= 0.0, "{field}: {}", r[field]);
    }
    let met = r["sla_met_fraction"].as_f64().unwrap();
    assert!(met <= r["sla_attainable_fraction"].as_f64().unwrap() && met <= 1.0);
    let svg = dir.join("sweep.svg");
    let out = agora(
        &[
            "sim",
            "--sweep",
            "preempt",
            "--seconds",
            "20",
            "--plot",
            svg.to_str().unwrap(),
        ],
        dir,
    );
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let text = std::fs::read_to_string(&svg).unwrap();
    assert!(text.starts_with("<svg") && text.contains("elastic") && text.contains("polyline"));
    let out = agora(&["sim", "--policy", "fastest"], dir);
    assert!(String::from_utf8_lossy(&out.stderr).contains("choose none, priority or elastic"));
}
