//! The dispatcher never runs long work (#22 3c), against a real `agora serve` process: launches
//! the library's estimate calls tiny but whose scalars and buffers make them long (`sgemm` with
//! m = n = 1 and a huge k, `hpccg.spmv` with one row of millions of non-zeros,
//! and `nw.diagonal` with one big block) run on lanes, never inline on the dispatcher, which the
//! task trace shows row by row; the daemon exports its longest inline run and the longest
//! stretch of the dispatcher's work, and a tiny launch still runs inline once its shape has
//! been measured.

use agora::Arg;
use agora_test_support::Daemon;

const AGORA: &str = env!("CARGO_BIN_EXE_agora");

fn start(tag: &str) -> Daemon {
    Daemon::start(
        AGORA,
        &format!("dispatcher-{tag}"),
        &["--no-opencl", "--trace", "{dir}/trace.json"],
    )
}

/// (kernel name, trace row) of every executed span.
fn executions(daemon: &Daemon) -> Vec<(String, u64)> {
    let saved = daemon.agora(&["trace", "save"]);
    assert!(saved.status.success(), "{}", String::from_utf8_lossy(&saved.stderr));
    let text = std::fs::read_to_string(daemon.dir().join("trace.json")).unwrap();
    let trace: serde_json::Value = serde_json::from_str(&text).unwrap();
    let events = trace
        .get("traceEvents")
        .and_then(|e| e.as_array())
        .or_else(|| trace.as_array())
        .expect("a Chrome trace")
        .clone();
    events
        .iter()
        .filter(|e| e["ph"] == "X" && e["cat"] == "exec")
        .map(|e| {
            (
                e["name"].as_str().unwrap_or("").to_string(),
                e["tid"].as_u64().unwrap_or(0),
            )
        })
        .collect()
}

#[test]
fn launches_long_by_their_arguments_never_run_on_the_dispatcher() {
    let daemon = start("stall");
    let attacker = daemon.session();
    let q = attacker.queue("attack").unwrap();
    // sgemm, m = n = 1, k = 2^22: one work item (an estimate of 120 ns), 4 M multiply-adds.
    let k = 1usize << 22;
    let sgemm = attacker.kernel("sgemm").unwrap();
    let a = attacker.buffer_from(&vec![1.0f32; k]).unwrap();
    let b = attacker.buffer_from(&vec![2.0f32; k]).unwrap();
    let c = attacker.buffer_from(&[0.0f32]).unwrap();
    // spmv with one row of 2^22 non-zeros: one work item (35 ns by the estimate).
    let spmv = attacker.kernel("hpccg.spmv").unwrap();
    let row_ptr = attacker.buffer_from(&[0i32, k as i32]).unwrap();
    let cols = attacker.buffer_from(&vec![0i32; k]).unwrap();
    let vals = attacker.buffer_from(&vec![1.0f32; k]).unwrap();
    let x = attacker.buffer_from(&[3.0f32]).unwrap();
    let y = attacker.buffer_from(&[0.0f32]).unwrap();
    // nw.diagonal with one block of 1024 x 1024 cells: one work item, a million cells.
    let nw = attacker.kernel("nw.diagonal").unwrap();
    let side = 1024usize;
    let score = attacker.buffer_from(&vec![0i32; (side + 1) * (side + 1)]).unwrap();
    let reference = attacker.buffer_from(&vec![1i32; (side + 1) * (side + 1)]).unwrap();
    for _ in 0..8 {
        q.launch(
            &nw,
            &[
                (&score).into(),
                (&reference).into(),
                Arg::I32(side as i32),
                Arg::I32(10),
                Arg::I32(0),
                Arg::I32(side as i32),
            ],
            1u64,
        )
        .unwrap()
        .wait()
        .unwrap();
        // Each waited for, so its queue is idle when the next arrives: the inline case.
        q.launch(
            &sgemm,
            &[
                Arg::I32(1),
                Arg::I32(1),
                Arg::I32(k as i32),
                Arg::F32(1.0),
                (&a).into(),
                (&b).into(),
                Arg::F32(0.0),
                (&c).into(),
            ],
            (1u64, 1u64),
        )
        .unwrap()
        .wait()
        .unwrap();
        q.launch(
            &spmv,
            &[
                (&row_ptr).into(),
                (&cols).into(),
                (&vals).into(),
                (&x).into(),
                (&y).into(),
                Arg::I32(1),
                Arg::I32(k as i32),
            ],
            1u64,
        )
        .unwrap()
        .wait()
        .unwrap();
    }
    q.sync_from(&c).unwrap().wait().unwrap();
    q.sync_from(&y).unwrap().wait().unwrap();
    assert_eq!(c.as_slice::<f32>()[0], 2.0 * k as f32, "the results are still exact");
    assert_eq!(y.as_slice::<f32>()[0], 3.0 * k as f32);
    // A tiny launch: its first run measures its shape on a lane, later ones run inline.
    let noop = attacker.kernel("noop").unwrap();
    for _ in 0..20 {
        q.launch(&noop, &[], 1u64).unwrap().wait().unwrap();
    }
    let executions = executions(&daemon);
    let on = |kernel: &str, inline: bool| {
        executions
            .iter()
            .filter(|(name, row)| name == kernel && (*row == 0) == inline)
            .count()
    };
    // Row 0 is the dispatcher (inline); lanes follow.
    assert_eq!(on("sgemm", true), 0, "sgemm never runs on the dispatcher");
    assert_eq!(on("sgemm", false), 8);
    assert_eq!(on("hpccg.spmv", true), 0, "spmv never runs on the dispatcher");
    assert_eq!(on("hpccg.spmv", false), 8);
    assert_eq!(on("nw.diagonal", true), 0, "nw.diagonal never runs on the dispatcher");
    assert_eq!(on("nw.diagonal", false), 8);
    // Exported (status, metrics): here a figure for the log, not a timed assertion (a loaded
    // machine deschedules the dispatcher for whole time slices).
    let status = daemon.status();
    eprintln!(
        "dispatcher's longest stretch of work: {:.3} ms ({} over 1 ms)",
        status.dispatcher_longest_iteration_ms, status.dispatcher_stalls
    );
    assert_eq!(
        status.dispatcher_stalls > 0,
        status.dispatcher_longest_iteration_ms > 1.0,
        "stalls are the stretches over 1 ms"
    );
    assert!(on("noop", false) >= 1, "an unseen shape is measured on a lane first");
    assert!(on("noop", true) >= 15, "then it runs inline: {executions:?}");
}

/// The OS scheduling policy of each of the daemon's CPU lane threads (`agora-cpu-lane…`), from
/// `/proc` (field 41 of a thread's `stat`).
fn cpu_lane_policies(pid: u32) -> Vec<i32> {
    let mut policies = Vec::new();
    for task in std::fs::read_dir(format!("/proc/{pid}/task")).unwrap().flatten() {
        let comm = std::fs::read_to_string(task.path().join("comm")).unwrap_or_default();
        if !comm.starts_with("agora-cpu-lane") {
            continue;
        }
        let Ok(stat) = std::fs::read_to_string(task.path().join("stat")) else {
            continue; // The thread ended meanwhile.
        };
        // Fields after the command's closing parenthesis start at field 3 (the state).
        let fields: Vec<&str> = stat[stat.rfind(')').unwrap() + 2..].split(' ').collect();
        policies.push(fields[41 - 3].parse().unwrap());
    }
    policies
}

/// `batch_priority = "auto"` (the default), against a real daemon: CPU lanes run a batch tenant's
/// kernels at `SCHED_BATCH`, move to `SCHED_IDLE` when a latency tenant submits (its round trips
/// then never wait for batch work's time slice) and back to `SCHED_BATCH` once latency work has
/// been quiet for a second, while the batch work goes on; `agora status` says which and counts
/// the switches. A daemon without the privilege to come back from `SCHED_IDLE` says `batch` and
/// never switches.
#[test]
fn batch_lanes_yield_while_a_latency_tenant_is_live_and_get_their_priority_back_after() {
    const SCHED_BATCH: i32 = 3;
    const SCHED_IDLE: i32 = 5;
    let daemon = Daemon::start(AGORA, "dispatcher-auto", &["--no-opencl"]);
    let privileged = match daemon.status().batch_priority.as_str() {
        "auto" => true,
        "batch" => false,
        other => panic!("default batch priority {other}"),
    };
    // The batch tenant: sgemm m = n = 1, k = 2^22 (milliseconds each), pipelined on the CPU
    // until told to stop.
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let batch = {
        let (session, stop) = (daemon.session_named("batch-tenant"), stop.clone());
        std::thread::spawn(move || {
            let q = session
                .queue_with(agora::QueueOptions {
                    name: "batch".into(),
                    class: agora::QueueClass::Batch,
                    preferred_device: Some(agora::DeviceKind::Cpu),
                    sla: None,
                })
                .unwrap();
            let k = 1usize << 22;
            let sgemm = session.kernel("sgemm").unwrap();
            let a = session.buffer_from(&vec![1.0f32; k]).unwrap();
            let b = session.buffer_from(&vec![2.0f32; k]).unwrap();
            let c = session.buffer_from(&[0.0f32]).unwrap();
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                for _ in 0..8 {
                    q.launch(
                        &sgemm,
                        &[
                            Arg::I32(1),
                            Arg::I32(1),
                            Arg::I32(k as i32),
                            Arg::F32(1.0),
                            (&a).into(),
                            (&b).into(),
                            Arg::F32(0.0),
                            (&c).into(),
                        ],
                        (1u64, 1u64),
                    )
                    .unwrap();
                }
                q.finish().unwrap();
            }
        })
    };
    let pid = daemon.pid();
    let within = std::time::Duration::from_secs(10);
    let policies_are = |wanted: i32, unwanted: i32| {
        let seen = cpu_lane_policies(pid);
        seen.contains(&wanted) && !seen.contains(&unwanted)
    };
    assert!(
        agora_test_support::eventually(within, || policies_are(SCHED_BATCH, SCHED_IDLE)),
        "batch work alone runs at SCHED_BATCH: {:?}",
        cpu_lane_policies(pid)
    );
    let latency = daemon.session_named("latency-tenant");
    let q = latency
        .queue_with(agora::QueueOptions {
            name: "requests".into(),
            class: agora::QueueClass::Latency,
            preferred_device: None,
            sla: None,
        })
        .unwrap();
    let noop = latency.kernel("noop").unwrap();
    q.launch(&noop, &[], 1u64).unwrap().wait().unwrap();
    let quiet_since = std::time::Instant::now();
    if privileged {
        assert!(
            agora_test_support::eventually(within, || policies_are(SCHED_IDLE, SCHED_BATCH)),
            "latency work live: batch work runs at SCHED_IDLE: {:?}",
            cpu_lane_policies(pid)
        );
        let status = daemon.status();
        assert_eq!(
            (status.batch_priority_now.as_str(), status.batch_priority_switches),
            ("idle", 1)
        );
    }
    // Latency work goes quiet: back within a second or so, with the batch work still running.
    assert!(
        agora_test_support::eventually(within, || policies_are(SCHED_BATCH, SCHED_IDLE)),
        "latency work quiet: batch work back at SCHED_BATCH: {:?}",
        cpu_lane_policies(pid)
    );
    if privileged {
        assert!(
            quiet_since.elapsed() >= std::time::Duration::from_millis(950),
            "latency work counts as live for a second after its last task"
        );
    }
    let status = daemon.status();
    assert_eq!(status.batch_priority_now, "batch");
    assert_eq!(status.batch_priority_switches, if privileged { 2 } else { 0 });
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    batch.join().unwrap();
}
