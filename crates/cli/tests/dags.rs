//! Issue 16, deadlines on the daemon: a real `agora serve` process admits real-time DAGs of
//! kernel launches, releases periodic ones itself and sporadic ones on demand, runs their nodes
//! in dependency order on its deadline lanes ahead of batch work, and reports each release. Bad
//! declarations are refused with the arithmetic; a session's end frees its reservations.

use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};
use std::time::Duration;

use agora::{Arg, Error, Session};
use agora_protocol::control::ControlError;
use agora_test_support::{eventually, free_port, scrape_metrics as scrape, Daemon};

const AGORA: &str = env!("CARGO_BIN_EXE_agora");
const N: usize = 4096;

fn dag_refusal<T: std::fmt::Debug>(result: Result<T, Error>) -> String {
    match result {
        Err(Error::Control(ControlError::Dag(message))) => message,
        other => panic!("expected a DAG refusal, got {other:?}"),
    }
}

/// `fill(1, x)` then `saxpy(2, x, y)`: each release adds 2 to every element of `y`.
fn pipeline(session: &Session, x: &agora::Buffer, y: &agora::Buffer, period: Duration) -> agora::DagBuilder {
    let fill = session.kernel("fill").unwrap();
    let saxpy = session.kernel("saxpy").unwrap();
    let mut dag = session.dag("pipeline", period);
    let a = dag.node("fill", &fill, &[Arg::F32(1.0), Arg::Buffer(x)], N).unwrap();
    let b = dag
        .node("saxpy", &saxpy, &[Arg::F32(2.0), Arg::Buffer(x), Arg::Buffer(y)], N)
        .unwrap();
    dag.edge(a, b)
        .wcet(a, Duration::from_millis(2))
        .wcet(b, Duration::from_millis(2));
    dag
}

#[test]
fn a_sporadic_dag_runs_its_nodes_in_order_once_per_release() {
    let daemon = Daemon::start(AGORA, "dag-sporadic", &["--no-opencl", "--cpu-lanes", "2"]);
    let session = daemon.session();
    let x = session.buffer((N * 4) as u64).unwrap();
    let y = session.buffer((N * 4) as u64).unwrap();
    y.write_slice(&vec![0f32; N]).unwrap();
    let mut builder = pipeline(&session, &x, &y, Duration::from_millis(20));
    builder.sporadic();
    let dag = builder.declare().unwrap();
    let admission = dag.admission();
    assert_eq!(admission.lanes.len(), 2);
    assert!(
        admission.lanes.iter().all(|lane| lane.starts_with("cpu0/lane")),
        "{admission:?}"
    );
    assert_eq!(admission.wcet_source, ["declared", "declared"]);
    assert!(
        admission.utilisation > 0.19 && admission.utilisation < 0.3,
        "{admission:?}"
    );

    let mut releases = Vec::new();
    for expected in 0..5u64 {
        assert_eq!(dag.release().unwrap(), expected);
        releases.extend(dag.wait_results(1, Duration::from_secs(5)).unwrap());
        // The period is the least time between releases: wait it out before the next.
        std::thread::sleep(Duration::from_millis(21));
    }
    assert_eq!(releases.len(), 5, "{releases:?}");
    for (i, release) in releases.iter().enumerate() {
        assert_eq!(release.release, i as u64);
        assert!(release.met && release.failed.is_none(), "{release:?}");
        assert!(
            release.response_ns > 0 && release.response_ns < 20_000_000,
            "{release:?}"
        );
    }
    // saxpy ran once per release, after fill: y = 2 × 5.
    assert!(
        y.as_slice::<f32>().iter().all(|&v| v == 10.0),
        "y[0] = {}",
        y.as_slice::<f32>()[0]
    );

    // Too soon after the previous release: refused, with the period.
    dag.release().unwrap();
    let refused = dag_refusal(dag.release());
    assert!(refused.contains("least time between releases"), "{refused}");
    dag.withdraw().unwrap();
}

#[test]
fn a_periodic_dag_is_released_by_the_daemon_and_meets_its_deadlines_beside_batch_work() {
    let port = free_port();
    let daemon = Daemon::start(
        AGORA,
        "dag-periodic",
        &["--no-opencl", "--cpu-lanes", "2", "--metrics", &port.to_string()],
    );
    let session = daemon.session();
    let x = session.buffer((N * 4) as u64).unwrap();
    let y = session.buffer((N * 4) as u64).unwrap();
    let dag = pipeline(&session, &x, &y, Duration::from_millis(20)).declare().unwrap();

    // A neighbour floods both lanes with long batch launches (sliced, so deadline jobs get in
    // at the next slice boundary).
    let neighbour = daemon.session();
    let big = 1 << 22;
    let a = neighbour.buffer((big * 4) as u64).unwrap();
    let b = neighbour.buffer((big * 4) as u64).unwrap();
    let saxpy = neighbour.kernel("saxpy").unwrap();
    let queues: Vec<_> = (0..2).map(|i| neighbour.queue(&format!("batch{i}")).unwrap()).collect();
    for _ in 0..8 {
        for q in &queues {
            q.launch(&saxpy, &[Arg::F32(1.0), Arg::Buffer(&a), Arg::Buffer(&b)], big)
                .unwrap();
        }
    }

    let releases = dag.wait_results(15, Duration::from_secs(10)).unwrap();
    assert!(releases.len() >= 15, "{} releases in 10 s", releases.len());
    for pair in releases.windows(2) {
        assert_eq!(
            pair[1].release,
            pair[0].release + 1,
            "releases come in order, none lost"
        );
    }
    // Admission's promise: no misses but those of overruns. On this shared 2-core machine the
    // OS may also stall the daemon itself for milliseconds (other tests run beside this one): a
    // release delayed that way shows it in its hand-off time or an overrun, and is the only kind
    // of miss tolerated, once.
    let missed: Vec<_> = releases.iter().filter(|r| !r.met).collect();
    let unexplained: Vec<_> = missed
        .iter()
        .filter(|r| r.overruns.is_empty() && r.handoff_ns < 5_000_000)
        .collect();
    assert!(
        unexplained.is_empty(),
        "admitted releases missed their deadline: {unexplained:?}"
    );
    assert!(missed.len() <= 1, "admitted releases missed their deadline: {missed:?}");
    for q in &queues {
        q.finish().unwrap();
    }
    let results = dag.results().unwrap();
    assert!(results.released >= 15 && results.stopped.is_none(), "{results:?}");

    // Observability: status, `agora status`, and the metrics show it.
    let status = daemon.status();
    let shown = status
        .dags
        .iter()
        .find(|d| d.id == dag.id())
        .expect("the DAG in status");
    assert!(shown.periodic && shown.met >= 14 && shown.missed <= 1, "{shown:?}");
    assert_eq!(shown.lanes.len(), 2);
    assert!(
        shown.response_p99_us > 0 && shown.response_max_us >= shown.response_p99_us,
        "{shown:?}"
    );
    let text = daemon.agora(&["status"]);
    let text = String::from_utf8_lossy(&text.stdout);
    assert!(text.contains("real-time DAGs") && text.contains("pipeline"), "{text}");
    let metrics = scrape(port);
    assert!(
        metrics.contains("agora_dag_releases_total{dag=\"pipeline\",outcome=\"met\"}"),
        "{metrics}"
    );
    assert!(
        metrics.contains("agora_dag_response_seconds_count{dag=\"pipeline\"}"),
        "{metrics}"
    );
    assert!(metrics.contains("agora_dags_admitted 1"), "{metrics}");
}

#[test]
fn declarations_that_cannot_work_are_refused_with_the_reason() {
    let daemon = Daemon::start(AGORA, "dag-refusals", &["--no-opencl", "--cpu-lanes", "2"]);
    let session = daemon.session();
    let x = session.buffer((N * 4) as u64).unwrap();
    let y = session.buffer((N * 4) as u64).unwrap();
    let period = Duration::from_millis(10);

    // A cycle.
    let mut cyclic = pipeline(&session, &x, &y, period);
    cyclic.edge(1, 0);
    let refused = dag_refusal(cyclic.declare());
    assert!(refused.contains("cycle"), "{refused}");

    // A period of zero.
    let refused = dag_refusal(pipeline(&session, &x, &y, Duration::ZERO).declare());
    assert!(refused.contains("period of 0"), "{refused}");

    // A deadline shorter than the critical path (2 ms + 2 ms).
    let mut tight = pipeline(&session, &x, &y, period);
    tight.deadline(Duration::from_millis(3));
    let refused = dag_refusal(tight.declare());
    assert!(
        refused.contains("critical path") || refused.contains("deadline"),
        "{refused}"
    );

    // A node whose launch is invalid: the buffer is too small for the range.
    let small = session.buffer(16).unwrap();
    let saxpy = session.kernel("saxpy").unwrap();
    let mut bad = session.dag("bad", period);
    bad.node(
        "saxpy",
        &saxpy,
        &[Arg::F32(1.0), Arg::Buffer(&small), Arg::Buffer(&y)],
        N,
    )
    .unwrap();
    bad.wcet(0, Duration::from_millis(1));
    let refused = dag_refusal(bad.declare());
    assert!(refused.contains("node 'saxpy'"), "{refused}");

    // No WCET declared and none measured: say how to get one.
    let fill = session.kernel("fill").unwrap();
    let mut unknown = session.dag("unmeasured", period);
    unknown
        .node("fill", &fill, &[Arg::F32(1.0), Arg::Buffer(&x)], N)
        .unwrap();
    let refused = dag_refusal(unknown.declare());
    assert!(refused.contains("no WCET"), "{refused}");

    // A declared WCET of nothing is refused, as the RTDAG files' tasks_wcet of 0 is.
    let mut nothing = session.dag("nothing", period);
    nothing
        .node("fill", &fill, &[Arg::F32(1.0), Arg::Buffer(&x)], N)
        .unwrap();
    nothing.wcet(0, Duration::ZERO);
    let refused = dag_refusal(nothing.declare());
    assert!(
        refused.contains("node 'fill'") && refused.contains("WCET of 0"),
        "{refused}"
    );

    // More than the lanes hold: 2 lanes, 0.9 each per DAG (a single node of 9 ms every 10 ms).
    let heavy = |name: &str, session: &Session| {
        let fill = session.kernel("fill").unwrap();
        let mut dag = session.dag(name, period);
        dag.node("fill", &fill, &[Arg::F32(1.0), Arg::Buffer(&x)], N).unwrap();
        dag.wcet(0, Duration::from_micros(8_000)).sporadic();
        dag.declare()
    };
    let first = heavy("heavy-1", &session).unwrap();
    let _second = heavy("heavy-2", &session).unwrap();
    let refused = dag_refusal(heavy("heavy-3", &session));
    assert!(refused.contains("fits on none of 2 lanes"), "{refused}");
    assert!(refused.contains("would have fit with a WCET of at most"), "{refused}");
    // Withdrawing one frees its lane.
    first.withdraw().unwrap();
    heavy("heavy-3", &session).unwrap();
}

/// Run as a child process by the next test: admits a DAG that takes the only lane, prints
/// `ready`, and waits to be killed.
#[test]
#[ignore = "a helper process of a_client_that_dies..., not a test by itself"]
fn dag_holder_process() {
    let Ok(socket) = std::env::var("AGORA_TEST_DAG_SOCKET") else {
        return;
    };
    let session = Session::connect_with(agora::SessionOptions {
        socket: Some(socket.into()),
        name: Some("doomed-holder".into()),
        ..Default::default()
    })
    .unwrap();
    let x = session.buffer((N * 4) as u64).unwrap();
    let fill = session.kernel("fill").unwrap();
    let mut dag = session.dag("hog", Duration::from_millis(10));
    dag.node("fill", &fill, &[Arg::F32(1.0), Arg::Buffer(&x)], N).unwrap();
    dag.wcet(0, Duration::from_millis(8));
    let _hog = dag.declare().unwrap();
    println!("holder-ready");
    std::thread::sleep(Duration::from_secs(120));
}

#[test]
fn a_client_that_dies_frees_its_reservations_and_a_session_may_hold_only_so_many() {
    let daemon = Daemon::start(AGORA, "dag-limits", &["--no-opencl", "--cpu-lanes", "1"]);
    let period = Duration::from_millis(10);
    let mut child = Command::new(std::env::current_exe().unwrap())
        .args([
            "--exact",
            "dag_holder_process",
            "--ignored",
            "--nocapture",
            "--test-threads=1",
        ])
        .env("AGORA_TEST_DAG_SOCKET", daemon.socket())
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
    assert!(
        lines.any(|l| l.is_ok_and(|l| l.trim_end().ends_with("holder-ready"))),
        "the holder process did not start"
    );

    let other = daemon.session_without_resume("other");
    let z = other.buffer((N * 4) as u64).unwrap();
    let fill2 = other.kernel("fill").unwrap();
    let attempt = || {
        let mut dag = other.dag("wants-the-lane", period);
        dag.node("fill", &fill2, &[Arg::F32(1.0), Arg::Buffer(&z)], N).unwrap();
        dag.wcet(0, Duration::from_millis(8)).sporadic();
        dag.declare()
    };
    let refused = dag_refusal(attempt());
    assert!(refused.contains("fits on none of 1 lanes"), "{refused}");
    // The holder dies with its DAG admitted (and being released every 10 ms).
    child.kill().unwrap();
    child.wait().unwrap();
    let mut admitted = None;
    assert!(
        eventually(Duration::from_secs(10), || {
            admitted = attempt().ok();
            admitted.is_some()
        }),
        "the dead client's reservation was not freed"
    );
    drop(admitted);

    // One session may have 64 admitted at once.
    let mut many = Vec::new();
    for i in 0..64 {
        let mut dag = other.dag(&format!("tiny-{i}"), Duration::from_secs(1));
        dag.node("fill", &fill2, &[Arg::F32(1.0), Arg::Buffer(&z)], N).unwrap();
        dag.wcet(0, Duration::from_micros(10)).sporadic();
        many.push(dag.declare().unwrap());
    }
    let mut dag = other.dag("one-too-many", Duration::from_secs(1));
    dag.node("fill", &fill2, &[Arg::F32(1.0), Arg::Buffer(&z)], N).unwrap();
    dag.wcet(0, Duration::from_micros(10));
    let refused = dag_refusal(dag.declare());
    assert!(refused.contains("max_dags_per_session"), "{refused}");
}

#[test]
fn a_dag_whose_buffer_is_released_stops_with_the_reason() {
    let daemon = Daemon::start(AGORA, "dag-released-buffer", &["--no-opencl", "--cpu-lanes", "2"]);
    let session = daemon.session();
    let x = session.buffer((N * 4) as u64).unwrap();
    let y = session.buffer((N * 4) as u64).unwrap();
    let mut builder = pipeline(&session, &x, &y, Duration::from_millis(5));
    builder.sporadic();
    let dag = builder.declare().unwrap();
    dag.release().unwrap();
    assert_eq!(dag.wait_results(1, Duration::from_secs(5)).unwrap().len(), 1);
    drop(x);
    // The release goes through the ring: make sure it was taken before the next DAG release.
    session.queue("sync").unwrap().finish().unwrap();
    std::thread::sleep(Duration::from_millis(6));
    dag.release().unwrap();
    let release = dag.wait_results(1, Duration::from_secs(5)).unwrap().remove(0);
    assert!(!release.met, "{release:?}");
    let (node, message) = release.failed.clone().expect("the release failed");
    assert_eq!(node, 0, "the fill node names the released buffer");
    assert!(message.contains("handle"), "{message}");
    let results = dag.results().unwrap();
    assert!(
        results
            .stopped
            .as_deref()
            .is_some_and(|s| s.contains("no longer resolves")),
        "{results:?}"
    );
    std::thread::sleep(Duration::from_millis(6));
    let refused = dag_refusal(dag.release());
    assert!(refused.contains("was stopped"), "{refused}");
}

#[test]
fn only_the_users_the_operator_names_may_declare_dags() {
    let dir = agora_test_support::temp_dir("dag-permission");
    // Nobody runs these tests as uid 4242.
    std::fs::write(dir.path().join("agora.toml"), "[realtime]\nuids = [4242]\n").unwrap();
    let daemon = Daemon::start_in(AGORA, dir, &["--no-opencl", "--config", "{dir}/agora.toml"]);
    let session = daemon.session();
    let x = session.buffer((N * 4) as u64).unwrap();
    let fill = session.kernel("fill").unwrap();
    let mut dag = session.dag("not-mine", Duration::from_millis(10));
    dag.node("fill", &fill, &[Arg::F32(1.0), Arg::Buffer(&x)], N).unwrap();
    dag.wcet(0, Duration::from_millis(1));
    match dag.declare() {
        Err(Error::Control(ControlError::NotPermitted(message))) => {
            assert!(message.contains("[realtime] uids"), "{message}")
        }
        other => panic!("expected NotPermitted, got {other:?}"),
    }
}
