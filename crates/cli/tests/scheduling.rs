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

/// Out-of-range tuning flags are refused at start (audit A7), and `--opencl-lanes 0` and
/// `--session-lane-work-ms 0` are refused rather than turned into 1.
#[test]
fn tuning_flags_out_of_range_are_refused() {
    let scratch = dir("tuning");
    let dir = scratch.path();
    for (flag, value, says) in [
        ("--max-spin-us", "999999999999", "daemon.max_spin_us"),
        ("--inline-max-ns", "99999999999", "daemon.inline_max_ns"),
        ("--cpu-lanes", "2000", "cpu.lanes"),
        ("--cpu-threads-per-lane", "2000", "cpu.threads_per_lane"),
        ("--latency-sla-ms", "1e12", "at most 3600000"),
        ("--opencl-lanes", "0", "opencl.lanes"),
        ("--cuda-lanes", "0", "cuda.lanes"),
        ("--session-lane-work-ms", "0", "sessions.lane_work_ms"),
        ("--session-lane-work-ms", "99999999999", "at most 3600000"),
    ] {
        let out = agora(&["serve", flag, value, "--print-config"], dir);
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(
            !out.status.success(),
            "{flag} {value} accepted: {}",
            String::from_utf8_lossy(&out.stdout)
        );
        assert!(err.contains(flag) && err.contains(says), "{flag} {value}: {err}");
    }
}

/// A relative path in a configuration file is taken from the file's directory, not from the
/// directory the daemon starts in, and is printed absolute (audit A5); a relative flag is the
/// current directory's, printed absolute too.
#[test]
fn relative_paths_in_a_config_file_are_the_files_directorys() {
    let scratch = dir("relative");
    let files = scratch.path().join("cfgdir");
    let cwd = scratch.path().join("cwd");
    std::fs::create_dir_all(&files).unwrap();
    std::fs::create_dir_all(&cwd).unwrap();
    let file = files.join("agora.toml");
    std::fs::write(
        &file,
        "[daemon]\nstate_dir = \"relstate\"\n[checkpoint]\nlocal = \"ckpt\"\n",
    )
    .unwrap();
    let out = Command::new(AGORA)
        .args(["serve", "--config", file.to_str().unwrap(), "--print-config"])
        .args(["--trace", "t.json"])
        .current_dir(&cwd)
        .env_remove("AGORA_STATE_DIR")
        .env_remove("AGORA_SOCKET")
        .output()
        .unwrap();
    let printed = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let line = |key: &str, path: &std::path::Path| format!("{key} = \"{}\"", path.display());
    for expected in [
        line("state_dir", &files.join("relstate")),
        line("local", &files.join("ckpt")),
        line("trace", &cwd.join("t.json")),
    ] {
        assert!(printed.contains(&expected), "no '{expected}' in:\n{printed}");
    }
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
    // The fairness part: every rank ran (and verified its product) at a positive rate.
    let rates = r["fairness_rates"].as_array().unwrap();
    assert_eq!(rates.len(), r["repetitions"].as_u64().unwrap() as usize);
    for rates in rates {
        let rates: Vec<f64> = rates.as_array().unwrap().iter().map(|v| v.as_f64().unwrap()).collect();
        assert_eq!(rates.len(), 4, "four ranks by default");
        assert!(rates.iter().all(|r| *r > 0.0), "{rates:?}");
    }
    assert!(r["fairness_max_over_min"]["min"].as_f64().unwrap() >= 1.0);
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

/// Issue #19, item 13: daemons on different sockets keep their models apart (with no state
/// directory set, each socket has its own under `$XDG_STATE_HOME/agora/daemons`), and `agora
/// model show --socket S` reads the model of the daemon on S and names its file.
#[test]
fn daemons_on_different_sockets_learn_apart_and_model_show_reads_each_ones_own() {
    use agora_test_support::Daemon;

    let scratch = dir("keyed");
    let xdg = scratch.path().join("xdg");
    let own_state = |c: &mut Command| {
        c.env_remove("AGORA_STATE_DIR").env("XDG_STATE_HOME", &xdg);
    };
    // Inline runs (tiny tasks on the dispatcher) are not measured: use lanes.
    let args = ["--no-opencl", "--inline-max-ns", "0"];
    let mut a = Daemon::start_in_with(
        AGORA,
        agora_test_support::temp_dir("cli-sched-keyed-a"),
        &args,
        own_state,
    );
    let mut b = Daemon::start_in_with(
        AGORA,
        agora_test_support::temp_dir("cli-sched-keyed-b"),
        &args,
        own_state,
    );
    for (daemon, kernel) in [(&a, "vector_add"), (&b, "stream.add")] {
        let session = daemon.session();
        let k = session.kernel(kernel).unwrap();
        let q = session.queue("learn").unwrap();
        let n = 4096usize;
        let x = session.buffer_from(&vec![1.0f32; n]).unwrap();
        let y = session.buffer_from(&vec![1.0f32; n]).unwrap();
        let z = session.buffer((n * 4) as u64).unwrap();
        for _ in 0..3 {
            q.launch(&k, &[(&x).into(), (&y).into(), (&z).into()], n).unwrap();
            q.finish().unwrap();
        }
    }
    // SIGTERM: each saves its model.
    a.stop();
    b.stop();
    let show = |daemon: &Daemon, json: bool| {
        let mut args = vec!["model", "show"];
        if json {
            args.push("--json");
        }
        let mut c = daemon.command(&args);
        own_state(&mut c);
        let out = c.output().unwrap();
        assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
        String::from_utf8(out.stdout).unwrap()
    };
    let kernels = |daemon: &Daemon| {
        let rows: serde_json::Value = serde_json::from_str(&show(daemon, true)).unwrap();
        let mut names: Vec<String> = rows
            .as_array()
            .unwrap()
            .iter()
            .map(|r| r["kernel"].as_str().unwrap().to_string())
            .collect();
        names.dedup();
        names
    };
    assert_eq!(kernels(&a), ["vector_add"]);
    assert_eq!(kernels(&b), ["stream.add"]);
    // The table names the file it read: each daemon's own, under XDG_STATE_HOME.
    let file_of = |daemon: &Daemon| {
        let text = show(daemon, false);
        let first = text.lines().next().unwrap_or_default().to_string();
        assert!(
            first.starts_with("performance model ") && first.contains(&daemon.socket().display().to_string()),
            "{text}"
        );
        let path = first["performance model ".len()..]
            .split(" (")
            .next()
            .unwrap()
            .to_string();
        assert!(std::path::Path::new(&path).is_file(), "{path}");
        assert!(
            path.starts_with(&xdg.join("agora/daemons").display().to_string()),
            "{path}"
        );
        path
    };
    assert_ne!(file_of(&a), file_of(&b));
    assert!(!xdg.join("agora/perf-model.json").exists(), "no shared file");
    // An explicit state directory still wins over the socket's own.
    let out = agora(
        &["model", "show", "--socket", a.socket().to_str().unwrap()],
        scratch.path(),
    );
    assert!(
        String::from_utf8_lossy(&out.stdout).contains("no measurements"),
        "{}",
        String::from_utf8_lossy(&out.stdout)
    );
}

/// `agora model show` asks a running daemon where it keeps its model: one started with
/// `--state-dir` (or `[daemon] state_dir`) is read there, not at the socket's default place
/// (before, it said "no measurements" for a daemon that had them). A kernel with no rows is an
/// error, not an empty table.
#[test]
fn model_show_reads_a_running_daemon_s_own_state_directory() {
    use agora_test_support::Daemon;

    let scratch = dir("running-state");
    let state = scratch.path().join("elsewhere");
    let daemon = Daemon::start(
        AGORA,
        "cli-sched-running-state",
        &[
            "--no-opencl",
            "--inline-max-ns",
            "0",
            "--state-dir",
            state.to_str().unwrap(),
        ],
    );
    let session = daemon.session();
    agora_test_support::saxpy_ok(&session, 1 << 14);
    // The model is saved every 5 s while it changes.
    let saved = agora_test_support::eventually(std::time::Duration::from_secs(30), || {
        state.join("perf-model.json").exists()
    });
    assert!(saved);
    let show = |args: &[&str]| {
        let mut c = Command::new(AGORA);
        c.args(["model", "show", "--socket", daemon.socket().to_str().unwrap()])
            .args(args)
            .env_remove("AGORA_STATE_DIR")
            .env("XDG_STATE_HOME", scratch.path().join("xdg"));
        c.output().unwrap()
    };
    let out = show(&[]);
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    assert!(
        text.contains("saxpy") && text.contains(&state.display().to_string()) && text.contains("running"),
        "{text}"
    );
    let out = show(&["--kernel", "no_such_kernel"]);
    assert!(!out.status.success());
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("no measurements of kernel 'no_such_kernel'"),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}
