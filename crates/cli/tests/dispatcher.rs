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

/// `sgemm` with m = n = 1 and inner extent `k` (c = a · b over `k` floats): one work item the
/// library's estimate calls tiny, `k` multiply-adds of real work.
fn thin_sgemm(
    q: &agora::Queue,
    sgemm: &agora::Kernel,
    (a, b, c): (&agora::Buffer, &agora::Buffer, &agora::Buffer),
    k: usize,
) -> agora::Task {
    q.launch(
        sgemm,
        &[
            Arg::I32(1),
            Arg::I32(1),
            Arg::I32(k as i32),
            Arg::F32(1.0),
            a.into(),
            b.into(),
            Arg::F32(0.0),
            c.into(),
        ],
        (1u64, 1u64),
    )
    .unwrap()
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
        thin_sgemm(&q, &sgemm, (&a, &b, &c), k).wait().unwrap();
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

/// Field `n` (from 1, as proc(5) counts) of a `/proc/.../stat` file, if it can be read.
fn stat_field(path: &std::path::Path, n: usize) -> Option<String> {
    let stat = std::fs::read_to_string(path).ok()?;
    // Fields after the command's closing parenthesis start at field 3 (the state).
    let fields: Vec<&str> = stat[stat.rfind(')')? + 2..].split(' ').collect();
    fields.get(n - 3).map(|f| f.to_string())
}

/// The OS scheduling policy of thread `tid` of process `pid` (field 41 of its `stat`).
fn thread_policy(pid: u32, tid: u32) -> Option<i32> {
    stat_field(std::path::Path::new(&format!("/proc/{pid}/task/{tid}/stat")), 41)?
        .parse()
        .ok()
}

/// The OS scheduling policy of each of the daemon's CPU lane threads (`agora-cpu-lane…`).
fn cpu_lane_policies(pid: u32) -> Vec<i32> {
    let mut policies = Vec::new();
    for task in std::fs::read_dir(format!("/proc/{pid}/task")).unwrap().flatten() {
        let comm = std::fs::read_to_string(task.path().join("comm")).unwrap_or_default();
        if !comm.starts_with("agora-cpu-lane") {
            continue;
        }
        // A thread that ended meanwhile is left out.
        if let Some(policy) = stat_field(&task.path().join("stat"), 41).and_then(|p| p.parse().ok()) {
            policies.push(policy);
        }
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
                    thin_sgemm(&q, &sgemm, (&a, &b, &c), k);
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
    // A request before each look keeps latency work live however slowly a loaded machine looks.
    let request = || q.launch(&noop, &[], 1u64).unwrap().wait().unwrap();
    request();
    if privileged {
        assert!(
            agora_test_support::eventually(within, || {
                request();
                policies_are(SCHED_IDLE, SCHED_BATCH)
            }),
            "latency work live: batch work runs at SCHED_IDLE: {:?}",
            cpu_lane_policies(pid)
        );
        request();
        let status = daemon.status();
        assert_eq!(
            (status.batch_priority_now.as_str(), status.batch_priority_switches),
            ("idle", 1)
        );
    }
    let quiet_since = std::time::Instant::now();
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

/// `--dispatcher-realtime`: the dispatcher (the daemon's main thread) runs under `SCHED_FIFO`,
/// and so does each device host's message loop (its main thread), which answers the
/// dispatcher's synchronous requests; the threads either starts (lanes, PoCL's workers) do not.
/// Without the privilege both stay at normal priority.
#[test]
fn a_realtime_dispatcher_has_realtime_device_host_loops() {
    const SCHED_OTHER: i32 = 0;
    const SCHED_FIFO: i32 = 1;
    let privileged = std::thread::spawn(|| agora_devices::priority::make_current_thread_realtime().is_ok())
        .join()
        .unwrap();
    let expected = if privileged { SCHED_FIFO } else { SCHED_OTHER };
    let daemon = Daemon::start(AGORA, "dispatcher-realtime", &["--dispatcher-realtime"]);
    let session = daemon.session();
    agora_test_support::require_opencl(&session);
    let pid = daemon.pid();
    assert_eq!(thread_policy(pid, pid), Some(expected), "the dispatcher");
    let hosts: Vec<u32> = std::fs::read_dir("/proc")
        .unwrap()
        .flatten()
        .filter_map(|entry| entry.file_name().to_str()?.parse::<u32>().ok())
        .filter(|&child| {
            stat_field(std::path::Path::new(&format!("/proc/{child}/stat")), 4) == Some(pid.to_string())
                && std::fs::read(format!("/proc/{child}/cmdline"))
                    .is_ok_and(|c| String::from_utf8_lossy(&c).contains("device-host"))
        })
        .collect();
    assert!(!hosts.is_empty(), "no device host among the daemon's children");
    for host in hosts {
        assert_eq!(
            thread_policy(host, host),
            Some(expected),
            "device host {host}'s message loop"
        );
        for task in std::fs::read_dir(format!("/proc/{host}/task")).unwrap().flatten() {
            let tid: u32 = task.file_name().to_str().unwrap().parse().unwrap();
            if tid != host {
                assert_ne!(
                    thread_policy(host, tid),
                    Some(SCHED_FIFO),
                    "thread {tid} of host {host} inherited it"
                );
            }
        }
    }
}
