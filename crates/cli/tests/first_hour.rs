//! A user's first hour (issue #19), with real processes: what `agora run` refuses before it
//! allocates, where it says the work ran, what a requested device kind means, and listings piped
//! into `head`. No test here depends on timing.

use std::process::{Command, Output, Stdio};

use agora_test_support::Daemon;

const AGORA: &str = env!("CARGO_BIN_EXE_agora");

/// `agora serve --socket S EXTRA` on a private socket and state directory, killed when dropped.
fn start(tag: &str, extra: &[&str]) -> Daemon {
    Daemon::start(AGORA, &format!("first-hour-{tag}"), extra)
}

fn has_opencl(daemon: &Daemon) -> bool {
    daemon.status().devices.iter().any(|d| d.kind == "opencl")
}

fn stderr(out: &Output) -> String {
    String::from_utf8_lossy(&out.stderr).into_owned()
}

fn stdout(out: &Output) -> String {
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// A failed command: exit status 1, one `error:` line naming `what`, no panic.
fn refused(out: &Output, what: &str) -> String {
    let err = stderr(out);
    assert_eq!(out.status.code(), Some(1), "exit status; stderr: {err}");
    assert!(!err.contains("panicked"), "a panic: {err}");
    assert_eq!(err.matches("error:").count(), 1, "one error line: {err}");
    assert!(err.contains(what), "expected '{what}' in: {err}");
    err
}

#[test]
fn impossible_sizes_are_refused_before_anything_is_allocated() {
    let daemon = start("sizes", &["--session-quota", "64M", "--no-opencl"]);
    // These used to abort (allocation failed), panic (capacity overflow) or clamp silently.
    refused(
        &daemon.agora(&["run", "saxpy", "--size", "99999999999999"]),
        "too large",
    );
    refused(
        &daemon.agora(&["run", "pathfinder", "--size", "18446744073709551615"]),
        "too large",
    );
    refused(&daemon.agora(&["run", "saxpy", "--size", "0"]), "at least 1");
    refused(&daemon.agora(&["run", "gaussian", "--size", "1"]), "at least 2");
    refused(
        &daemon.agora(&["run", "saxpy", "--iterations", "99999999999"]),
        "launches",
    );
    // Beyond the session's quota: said once, before the client allocates 160 MB.
    let err = refused(
        &daemon.agora(&["run", "saxpy", "--size", "20000000"]),
        "heap quota of 64.0 MiB",
    );
    assert_eq!(err.matches("heap quota").count(), 1, "the quota is said once: {err}");
    // Nothing was allocated: the daemon saw no buffer.
    let status = daemon.status();
    assert_eq!(
        status.tasks_completed, 0,
        "no task (not even a buffer release) reached the daemon"
    );
    // An unknown workload lists every one, backprop included.
    refused(&daemon.agora(&["run", "nope"]), "backprop");
}

#[test]
fn run_says_where_its_tasks_ran_and_a_device_kind_is_a_requirement() {
    let daemon = start("kinds", &["--no-opencl"]);
    // Sizes large enough to go to a lane (tiny tasks run inline on the dispatcher).
    let out = daemon.agora(&["run", "vector-add", "--size", "1000000", "--device-kind", "cpu"]);
    assert!(out.status.success(), "{}", stderr(&out));
    assert!(stdout(&out).contains("tasks on cpu0"), "{}", stdout(&out));
    let out = daemon.agora(&["run", "saxpy", "--size", "1000000", "--json"]);
    let report: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(report["devices"], serde_json::json!(["cpu0"]), "{report}");
    // No OpenCL device: an error, not a silent run elsewhere...
    refused(
        &daemon.agora(&["run", "saxpy", "--size", "1000", "--device-kind", "opencl"]),
        "no opencl device",
    );
    // ...unless the user allows a fallback, and then the report says where it ran.
    let out = daemon.agora(&[
        "run",
        "saxpy",
        "--size",
        "1000000",
        "--device-kind",
        "opencl",
        "--fallback",
    ]);
    assert!(out.status.success(), "{}", stderr(&out));
    assert!(stdout(&out).contains("on cpu0"), "{}", stdout(&out));
    assert!(
        stderr(&out).contains("--fallback"),
        "the fallback is announced: {}",
        stderr(&out)
    );
}

#[test]
fn a_drained_kind_is_an_error_without_fallback() {
    let daemon = start("drained", &[]);
    if !has_opencl(&daemon) {
        eprintln!("no OpenCL device: skipped");
        return;
    }
    assert!(daemon.agora(&["drain", "opencl0"]).status.success());
    refused(
        &daemon.agora(&["run", "saxpy", "--size", "1000", "--device-kind", "opencl"]),
        "opencl0 is draining",
    );
    assert!(daemon.agora(&["undrain", "opencl0"]).status.success());
    let out = daemon.agora(&["run", "saxpy", "--size", "1000000", "--device-kind", "opencl"]);
    assert!(out.status.success(), "{}", stderr(&out));
    assert!(stdout(&out).contains("on opencl0"), "{}", stdout(&out));
}

/// Rodinia's fixed time step made hotspot unstable above about 1100², so OpenCL's rounding grew
/// into a failed verification; the time step now shrinks with the cells.
#[test]
fn hotspot_on_a_large_grid_verifies_on_opencl() {
    let daemon = start("hotspot", &[]);
    if !has_opencl(&daemon) {
        eprintln!("no OpenCL device: skipped");
        return;
    }
    let out = daemon.agora(&["run", "hotspot", "--size", "1536", "--device-kind", "opencl", "--json"]);
    assert!(out.status.success(), "{}", stderr(&out));
    let report: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(report["verified"], true, "{report}");
    assert_eq!(report["devices"], serde_json::json!(["opencl0"]), "{report}");
}

/// Each listing command piped into `head -1`, and into a pipe already closed: no panic, no
/// error, the first line intact.
#[test]
fn listings_piped_into_head_do_not_panic() {
    let mut daemon = start("pipes", &["--no-opencl", "--trace-capacity", "1000"]);
    // Something for `model show` to list (the model is saved at shutdown).
    assert!(daemon.agora(&["run", "backprop", "--size", "1000"]).status.success());
    let state = daemon.state_dir();
    let socket = daemon.socket().to_str().unwrap().to_string();
    let connected: Vec<Vec<&str>> = vec![
        vec!["status"],
        vec!["devices"],
        vec!["kernels"],
        vec!["top", "--once"],
        vec!["run", "--list"],
    ];
    let offline: Vec<Vec<&str>> = vec![
        vec!["--help"],
        vec!["serve", "--help"],
        vec!["serve", "--print-config"],
        vec!["model", "show"],
        vec!["sim", "--seconds", "5"],
    ];
    let run = |args: &[&str], closed: bool| -> Output {
        let mut agora = Command::new(AGORA);
        agora
            .args(args)
            .env("AGORA_STATE_DIR", &state)
            .env("AGORA_SOCKET", &socket)
            .stderr(Stdio::piped());
        if closed {
            // A pipe whose reader is gone before the first write: every write fails.
            let (reader, writer) = std::io::pipe().unwrap();
            drop(reader);
            agora.stdout(writer);
            return agora.output().unwrap();
        }
        let mut child = agora.stdout(Stdio::piped()).spawn().unwrap();
        let head = Command::new("head")
            .arg("-1")
            .stdin(child.stdout.take().unwrap())
            .output()
            .unwrap();
        let mut out = child.wait_with_output().unwrap();
        out.stdout = head.stdout;
        out
    };
    for args in connected.iter().chain(&offline) {
        for closed in [false, true] {
            let out = run(args, closed);
            let err = stderr(&out);
            assert!(
                !err.contains("panicked"),
                "agora {args:?} (closed: {closed}) panicked: {err}"
            );
            assert!(!err.contains("error"), "agora {args:?} (closed: {closed}): {err}");
            if !closed {
                assert!(!out.stdout.is_empty(), "agora {args:?} | head -1 printed nothing");
            }
        }
    }
    daemon.stop();
    // The model saved at shutdown: `model show` aligns its columns to the longest kernel name.
    let out = Command::new(AGORA)
        .args(["model", "show", "--state-dir"])
        .arg(&state)
        .output()
        .unwrap();
    let text = stdout(&out);
    let rows: Vec<&str> = text.lines().filter(|l| l.starts_with("backprop.")).collect();
    assert!(rows.iter().any(|r| r.starts_with("backprop.adjust_weights")), "{text}");
    let device_column: Vec<usize> = rows.iter().map(|r| r.find(" cpu0").expect("device column")).collect();
    assert!(
        device_column.windows(2).all(|w| w[0] == w[1]),
        "the device column moves with the kernel name:\n{text}"
    );
}

#[test]
fn status_trace_and_sim_say_what_they_count() {
    let daemon = start("counts", &["--no-opencl", "--trace", "{dir}/trace.json"]);
    assert!(daemon.agora(&["run", "saxpy", "--size", "100000"]).status.success());
    let status = stdout(&daemon.agora(&["status"]));
    assert!(
        status.contains("tasks done") && status.contains("jobs done"),
        "{status}"
    );
    assert!(
        !status.contains("completed "),
        "lanes no longer say 'completed': {status}"
    );
    let saved = daemon.agora(&["trace", "save"]);
    let text = stdout(&saved);
    assert!(saved.status.success(), "{}", stderr(&saved));
    assert!(text.contains("executions") && text.contains("waits"), "{text}");
    refused(
        &Command::new(AGORA).args(["sim", "--plot", "x.svg"]).output().unwrap(),
        "--sweep",
    );
}

#[test]
fn the_bundled_workloads_and_the_demo_put_no_false_alarm_in_the_log() {
    // Strict coherence: the CPU computes on private copies, so every buffer a workload's kernels
    // write and it does not read back (device scratch: gaussian's multipliers, hotspot's second
    // grid...) ends its life unread, as on an accelerator.
    let dir = agora_test_support::temp_dir("first-hour-scratch");
    let log = dir.path().join("daemon.log");
    let file = std::fs::File::create(&log).unwrap();
    let daemon = Daemon::start_in_with(AGORA, dir, &["--no-opencl", "--strict-coherence"], |c| {
        c.stderr(Stdio::from(file));
    });
    for (app, size) in [
        ("gaussian", "64"),
        ("hotspot", "64"),
        ("pathfinder", "1000"),
        ("backprop", "1024"),
    ] {
        let out = daemon.agora(&["run", app, "--size", size]);
        assert!(out.status.success(), "{app}: {}", stderr(&out));
        assert!(stdout(&out).contains("verified OK"), "{app}: {}", stdout(&out));
    }
    let text = std::fs::read_to_string(&log).unwrap();
    assert!(
        !text.contains("WARN") && !text.contains("ERROR"),
        "scratch buffers released unread are no operator's business:\n{text}"
    );
    // The main job of the README: every client verified, nothing that looks like a problem.
    let state = agora_test_support::temp_dir("first-hour-demo");
    let demo = Command::new(AGORA)
        .args(["demo", "--gaussian-size", "64", "--saxpy-size", "4096"])
        .env("AGORA_STATE_DIR", state.path())
        .output()
        .unwrap();
    let (out, err) = (stdout(&demo), stderr(&demo));
    assert!(demo.status.success(), "{out}{err}");
    assert!(out.contains("all results verified"), "{out}");
    assert!(!out.contains("WARN") && !err.contains("WARN"), "{out}{err}");
}
