//! Migration from the command line, against `agora serve` processes: `agora drain` / `undrain`
//! and what `agora status` shows, a `sim` device failing (fault injection from the config file)
//! while a client keeps working, and `agora bench migrate --quick --json` (fields and verified
//! results, not timings).

use std::process::Command;

use agora::{DeviceKind, QueueOptions, Session, SessionOptions};
use agora_test_support::Daemon;

const AGORA: &str = env!("CARGO_BIN_EXE_agora");

/// `agora serve --config FILE --socket S` on a private socket, FILE holding `config`; killed
/// when dropped.
fn start(tag: &str, config: &str) -> Daemon {
    let dir = agora_test_support::temp_dir(&format!("cli-mig-{tag}"));
    std::fs::write(dir.path().join("agora.toml"), config).unwrap();
    Daemon::start_in(AGORA, dir, &["--config", "{dir}/agora.toml"])
}

/// `agora ARGS --socket S`: whether it succeeded, its output and its errors.
fn agora(daemon: &Daemon, args: &[&str]) -> (bool, String, String) {
    let out = daemon.agora(args);
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

#[test]
fn drain_and_undrain_from_the_command_line_show_in_status() {
    let daemon = start("drain", "[[sim]]\nname = \"sim0\"\n");
    let (ok, out, err) = agora(&daemon, &["drain", "sim0"]);
    assert!(ok, "{err}");
    assert!(out.contains("sim0 is draining"), "{out}");
    let (_, status, _) = agora(&daemon, &["status"]);
    assert!(
        status.contains("device sim0 (sim)") && status.contains("draining"),
        "{status}"
    );
    let (ok, out, err) = agora(&daemon, &["undrain", "sim0"]);
    assert!(ok, "{err}");
    assert!(out.contains("takes new work again"), "{out}");
    let (_, status, _) = agora(&daemon, &["status"]);
    assert!(!status.contains("draining"), "{status}");
    let (ok, out, err) = agora(&daemon, &["drain", "sim0", "--evacuate"]);
    assert!(ok, "{err}");
    assert!(out.contains("evacuated 0 buffer(s)"), "{out}");
    assert!(agora(&daemon, &["undrain", "sim0"]).0);
    // A name the daemon does not have: a clear error listing the ones it has.
    let (ok, _, err) = agora(&daemon, &["drain", "gpu7"]);
    assert!(!ok);
    assert!(err.contains("unknown device 'gpu7'") && err.contains("sim0"), "{err}");
}

/// Issue 22: a queue idle on a device when it is drained moves with its next task, and that
/// move is counted once (before, the migrations counter stayed 0 after such a drain); `agora
/// drain` reports the count.
#[test]
fn a_drain_that_moves_an_idle_queue_counts_the_migration() {
    let daemon = start("idle-move", "[[sim]]\nname = \"sim0\"\nlanes = 1\n");
    let session = Session::connect_with(SessionOptions {
        socket: Some(daemon.socket().to_path_buf()),
        ..Default::default()
    })
    .unwrap();
    let q = session
        .queue_with(QueueOptions {
            name: "mover".into(),
            preferred_device: Some(DeviceKind::Sim),
            ..Default::default()
        })
        .unwrap();
    let add = session.kernel("vector_add").unwrap();
    // Large enough not to run inline on the dispatcher.
    let n = 1 << 20;
    let a = session.buffer_from(&vec![1.0f32; n]).unwrap();
    let out = session.buffer(n as u64 * 4).unwrap();
    let run = || {
        q.launch(&add, &[(&a).into(), (&a).into(), (&out).into()], n).unwrap();
        q.sync_from(&out).unwrap().wait().unwrap();
        assert!(out.as_slice::<f32>().iter().all(|v| *v == 2.0));
    };
    let last_device = || {
        let me = session.session_status(session.id()).unwrap();
        me.queues
            .iter()
            .find(|q| q.name == "mover")
            .and_then(|q| q.last_device.clone())
    };
    run();
    assert_eq!(last_device().as_deref(), Some("sim0"));
    let migrations = || {
        agora::daemon_status(Some(daemon.socket().to_path_buf()))
            .unwrap()
            .migrations
    };
    assert_eq!(migrations(), 0);
    let (ok, out_text, err) = agora(&daemon, &["drain", "sim0"]);
    assert!(ok, "{err}");
    assert!(out_text.contains("0 queue migration(s)"), "{out_text}");
    run();
    // Wherever the policy sends it (the CPU, or the OpenCL device it has not measured yet).
    let now = last_device();
    assert!(
        now.as_deref().is_some_and(|d| d != "sim0"),
        "the queue left the drained device: {now:?}"
    );
    assert_eq!(migrations(), 1);
    run();
    assert_eq!(migrations(), 1, "one move, however many tasks follow");
    let (_, status, _) = agora(&daemon, &["status"]);
    assert!(status.contains("queue migrations since start: 1"), "{status}");
    let (ok, _, err) = agora(&daemon, &["undrain", "sim0"]);
    assert!(ok, "{err}");
    let (ok, out_text, err) = agora(&daemon, &["drain", "sim0"]);
    assert!(ok, "{err}");
    assert!(out_text.contains("1 queue migration(s)"), "{out_text}");
}

#[test]
fn a_failing_sim_device_is_drained_and_the_client_keeps_exact_results() {
    let daemon = start(
        "fail",
        // Jobs alternate launch, read-back: the 5th (a launch) is the first to fail, so every
        // output that finished on the device was home before it failed. (With an odd count a
        // finished output would die with the device unread: that task's read-back then reports
        // DataLost, as the client tests check.)
        "[[sim]]\nname = \"flaky\"\nlanes = 1\nlaunch_ns = 300000\nfail_after_jobs = 4\n",
    );
    let session = Session::connect_with(SessionOptions {
        socket: Some(daemon.socket().to_path_buf()),
        ..Default::default()
    })
    .unwrap();
    let q = session
        .queue_with(QueueOptions {
            name: "q".into(),
            preferred_device: Some(DeviceKind::Sim),
            ..Default::default()
        })
        .unwrap();
    let add = session.kernel("vector_add").unwrap();
    let n = 4096usize;
    let a = session
        .buffer_from(&(0..n).map(|i| i as f32).collect::<Vec<_>>())
        .unwrap();
    let outs: Vec<_> = (0..16).map(|_| session.buffer(n as u64 * 4).unwrap()).collect();
    let mut tasks = Vec::new();
    for out in &outs {
        tasks.push(q.launch(&add, &[(&a).into(), (&a).into(), out.into()], n).unwrap());
        tasks.push(q.sync_from(out).unwrap());
    }
    for task in tasks {
        task.wait().unwrap();
    }
    for out in &outs {
        assert!(out
            .as_slice::<f32>()
            .iter()
            .enumerate()
            .all(|(i, v)| *v == 2.0 * i as f32));
    }
    let (_, status, _) = agora(&daemon, &["status"]);
    assert!(
        status.contains("device flaky (sim)") && status.contains("FAILED"),
        "{status}"
    );
    assert!(status.contains("tasks replayed after a device failure"), "{status}");
    let (ok, _, err) = agora(&daemon, &["undrain", "flaky"]);
    assert!(!ok && err.contains("failed"), "{err}");
}

#[test]
fn bench_migrate_quick_json_has_sane_fields() {
    let scratch = agora_test_support::temp_dir("cli-mig-bench");
    let dir = scratch.path();
    let out = Command::new(AGORA)
        .args(["bench", "migrate", "--quick", "--json"])
        .env("AGORA_STATE_DIR", dir)
        .env_remove("AGORA_SOCKET")
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let report: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let moves = report["moves"].as_array().unwrap();
    assert!(!moves.is_empty());
    for m in moves {
        let mib = m["mib"].as_u64().unwrap();
        // Exactly the queue's live buffers, device → host → device: nothing else moved.
        assert_eq!(m["bytes_moved"].as_u64().unwrap(), 2 * (mib << 20), "{m}");
        for key in ["move_ms", "resident_ms", "cost_ms"] {
            let (min, median, max) = (
                m[key]["min"].as_f64().unwrap(),
                m[key]["median"].as_f64().unwrap(),
                m[key]["max"].as_f64().unwrap(),
            );
            assert!(min <= median && median <= max && min.is_finite(), "{key}: {m}");
        }
        assert!(m["move_ms"]["min"].as_f64().unwrap() > 0.0);
        assert!(m["gb_per_s"].as_f64().unwrap() > 0.0);
        assert_ne!(m["from"], m["to"]);
    }
    let app = &report["app"];
    assert!(app["never_s"]["median"].as_f64().unwrap() > 0.0);
    assert!(app["migrated_s"]["median"].as_f64().unwrap() > 0.0);
    assert!(app["slowdown_pct"].as_f64().unwrap().is_finite());
    assert_eq!(app["arax_anchor_pct"].as_f64().unwrap(), 7.0);
    assert_eq!(app["from"], "sim0");
    assert_eq!(app["to"], "sim1");
}

/// With every device drained (as `agora slurm suspend` leaves a node), a launch fails saying
/// that the devices are drained and how to bring one back — not only that no device implements
/// the kernel.
#[test]
fn a_launch_with_every_device_drained_says_so() {
    let daemon = Daemon::start(AGORA, "cli-mig-all-drained", &["--no-opencl"]);
    let (ok, _, err) = agora(&daemon, &["drain", "cpu0"]);
    assert!(ok, "{err}");
    let session = daemon.session();
    let saxpy = session.kernel("saxpy").unwrap();
    let n = 1usize << 16;
    let x = session.buffer_from(&vec![1.0f32; n]).unwrap();
    let y = session.buffer_from(&vec![1.0f32; n]).unwrap();
    let q = session.queue("drained").unwrap();
    let e = q
        .launch(&saxpy, &[agora::Arg::F32(1.0), (&x).into(), (&y).into()], n)
        .unwrap()
        .wait()
        .unwrap_err()
        .to_string();
    assert!(e.contains("drained") && e.contains("agora undrain"), "{e}");
    assert!(agora(&daemon, &["undrain", "cpu0"]).0);
    // What the failed launch should have written is poisoned until rewritten.
    q.sync_to(&y).unwrap();
    q.launch(&saxpy, &[agora::Arg::F32(1.0), (&x).into(), (&y).into()], n)
        .unwrap()
        .wait()
        .unwrap();
}
