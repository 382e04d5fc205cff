//! Bad input and failures, with real processes: the daemon runs as `agora serve` in its own
//! process; clients are this test process and `agora run` child processes.
//!
//! Each test starts its own daemon on a private socket, so tests run in parallel.

use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use agora::testing::{ArgTag, Op, RawArg, TaskDescriptor};
use agora::{Arg, Error, Session, TaskError};
use agora_protocol::control::ControlError;
use agora_test_support::{saxpy_ok, Daemon};

const AGORA: &str = env!("CARGO_BIN_EXE_agora");

/// `agora serve --socket S EXTRA` on a private socket, killed when dropped.
fn start(tag: &str, extra: &[&str]) -> Daemon {
    Daemon::start(AGORA, &format!("robust-{tag}"), extra)
}

/// Client processes of a test daemon.
trait Clients {
    /// `agora ARGS --socket S`, its output piped.
    fn client(&self, args: &[&str]) -> Command;
}

impl Clients for Daemon {
    fn client(&self, args: &[&str]) -> Command {
        let mut c = self.command(args);
        c.stdout(Stdio::piped()).stderr(Stdio::piped());
        c
    }
}

fn wait_until(what: &str, timeout: Duration, mut ok: impl FnMut() -> bool) {
    let deadline = Instant::now() + timeout;
    while !ok() {
        assert!(Instant::now() < deadline, "timed out waiting for: {what}");
        std::thread::sleep(Duration::from_millis(20));
    }
}

fn verified(output: std::process::Output) -> serde_json::Value {
    assert!(
        output.status.success(),
        "client failed: {}",
        String::from_utf8_lossy(&output.stderr)
    );
    let report: serde_json::Value = serde_json::from_slice(&output.stdout).expect("JSON report");
    assert_eq!(report["verified"], true, "report: {report}");
    report
}

/// A queue with ~300 large saxpy launches issued (seconds of work); keep the buffers alive.
fn busy_queue(s: &Session) -> (agora::Queue, [agora::Buffer; 2]) {
    let q = s.queue("long").unwrap();
    let saxpy = s.kernel("saxpy").unwrap();
    let n = 4_000_000usize;
    let x = s.buffer((n * 4) as u64).unwrap();
    let y = s.buffer((n * 4) as u64).unwrap();
    for _ in 0..300 {
        let _ = q.launch(&saxpy, &[Arg::F32(1.0), (&x).into(), (&y).into()], n).unwrap();
    }
    (q, [x, y])
}

/// Issue 2, case 1: garbage descriptors get per-task errors; the daemon and a second client are
/// unaffected.
#[test]
fn garbage_descriptors_fail_only_their_tasks() {
    let daemon = start("garbage", &["--no-opencl"]);
    let good = daemon
        .client(&["run", "gaussian", "--size", "160", "--json"])
        .spawn()
        .unwrap();
    let evil = daemon.session_named("evil");
    let queue = evil.queue("garbage").unwrap();
    let mut state = 0x2545_F491_4F6C_DD1Du64;
    let mut next = || {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        state
    };
    let mut failed = 0;
    for i in 0..5_000 {
        let mut d = TaskDescriptor::zeroed();
        for slot in bytemuck::bytes_of_mut(&mut d).iter_mut() {
            *slot = next() as u8;
        }
        // Always invalid: an unknown op, or a launch with a broken field.
        match i % 5 {
            0 => d.op = 100 + (next() % 1000) as u32,
            1 => {
                d.op = Op::Launch as u32;
                d.arg_count = 17 + (next() % 100) as u32;
            }
            2 => {
                d.op = Op::Launch as u32;
                d.arg_count = 1;
                d.args[0].tag = 8 + (next() % 100) as u32;
            }
            3 => {
                d.op = Op::Launch as u32;
                d.arg_count = 0;
                d.dims = [0, 4, 9][(next() % 3) as usize];
            }
            _ => {
                d.op = Op::Launch as u32;
                d.arg_count = 0;
                d.dims = 1;
                d.range = [0, 0, 0];
            }
        }
        let task = agora::testing::submit_raw(&evil, queue.handle(), d).unwrap();
        match task.wait() {
            Err(Error::Task(_)) => failed += 1,
            other => panic!("garbage descriptor {i} gave {other:?}"),
        }
    }
    assert_eq!(failed, 5_000);
    verified(good.wait_with_output().unwrap());
    // The garbage session itself still works, and the daemon counted the failures.
    saxpy_ok(&evil, 1000);
    let status = daemon.status();
    let evil_status = status.sessions.iter().find(|s| s.name == "evil").unwrap();
    assert!(evil_status.tasks_failed >= 5_000, "{evil_status:?}");
}

/// A corrupt ring index ends that session only.
#[test]
fn a_corrupt_ring_ends_only_that_session() {
    let daemon = start("ring", &["--no-opencl"]);
    let evil = daemon.session_named("evil");
    let good = daemon.session_named("good");
    saxpy_ok(&evil, 10);
    agora::testing::corrupt_submission_tail(&evil);
    wait_until("the corrupt session to be ended", Duration::from_secs(10), || {
        daemon.status().sessions.iter().all(|s| s.name != "evil")
    });
    let queue = evil.queue("after").map(|_| ());
    assert!(matches!(queue, Err(Error::SessionEnded)), "{queue:?}");
    assert!(
        matches!(evil.queue("later"), Err(Error::SessionEnded)),
        "and every call after"
    );
    saxpy_ok(&good, 10_000);
}

/// `Session::end` ends the daemon's session while handles of it live on (Python's `close()`
/// with NumPy views alive kept it for as long as they lived: SRE audit, defect 4): the daemon
/// reclaims it, the buffer's memory stays readable here, and every later call says the program
/// ended it (not that the daemon went away).
#[test]
fn a_session_ended_by_its_program_is_reclaimed_while_its_buffers_live() {
    let daemon = start("end", &["--no-opencl"]);
    let session = daemon.session_named("ending");
    let buffer = session.buffer_from(&[7f32; 256]).unwrap();
    let queue = session.queue("q").unwrap();
    session.end();
    wait_until("the ended session to be reclaimed", Duration::from_secs(10), || {
        daemon.status().sessions.iter().all(|s| s.name != "ending")
    });
    assert_eq!(
        buffer.read_vec::<f32>(),
        vec![7f32; 256],
        "the host copy stays readable"
    );
    assert!(matches!(session.queue("later"), Err(Error::Ended)), "a control call");
    assert!(matches!(queue.sync_to(&buffer), Err(Error::Ended)), "a task");
    assert!(matches!(queue.finish(), Ok(()) | Err(Error::Ended)));
    session.end(); // twice: nothing
    drop((buffer, queue, session)); // releases after the end: not issued, no wait
    saxpy_ok(&daemon.session_named("after"), 1000);
}

/// A client whose address space cannot hold the session's heap (`ulimit -v`, a batch job's
/// limit) is told to ask for a smaller heap, not "protocol error ... same Agora version?" (SRE
/// audit, defect 7); with a smaller `AGORA_HEAP_BYTES` the same process works.
#[test]
fn a_client_that_cannot_map_its_heap_is_told_to_ask_for_a_smaller_one() {
    let daemon = start("address-space", &["--no-opencl"]);
    // 1 GiB of address space: the agora binary runs, the default 2 GiB heap cannot be mapped.
    let run = |heap: Option<&str>| {
        let mut command = Command::new("sh");
        command
            .arg("-c")
            .arg(format!("ulimit -v 1048576 && exec {AGORA} run vector-add --size 4096"))
            .env("AGORA_SOCKET", daemon.socket())
            .env_remove("AGORA_HEAP_BYTES");
        if let Some(heap) = heap {
            command.env("AGORA_HEAP_BYTES", heap);
        }
        command.output().unwrap()
    };
    let refused = run(None);
    let stderr = String::from_utf8_lossy(&refused.stderr);
    assert!(!refused.status.success(), "{stderr}");
    assert!(
        stderr.contains("cannot map the session's shared memory")
            && stderr.contains("AGORA_HEAP_BYTES")
            && !stderr.contains("same Agora version"),
        "{stderr}"
    );
    let fine = run(Some("64M"));
    assert!(fine.status.success(), "{}", String::from_utf8_lossy(&fine.stderr));
    saxpy_ok(&daemon.session_named("after"), 1000);
}

/// Issue 2, case 2: each kind of mistake is a typed error naming the problem.
#[test]
fn mistakes_are_typed_errors_naming_the_problem() {
    let daemon = start("typed", &["--no-opencl"]);
    let s = daemon.session_named("typed");
    let q = s.queue("q").unwrap();
    match s.kernel("saxp") {
        Err(Error::Control(ControlError::UnknownKernel { name, suggestions })) => {
            assert_eq!(name, "saxp");
            assert!(suggestions.contains(&"saxpy".to_string()));
        }
        other => panic!("{other:?}"),
    }
    let saxpy = s.kernel("saxpy").unwrap();
    let x = s.buffer(64 * 4).unwrap();
    let y = s.buffer(64 * 4).unwrap();
    let task_error = |r: Result<(), Error>| match r {
        Err(Error::Task(e)) => e,
        other => panic!("expected a task error, got {other:?}"),
    };
    let e = task_error(q.launch(&saxpy, &[Arg::F32(1.0), (&x).into()], 64u64).unwrap().wait());
    assert_eq!(e, TaskError::ArgumentCount { expected: 3, got: 2 });
    let e = task_error(
        q.launch(&saxpy, &[Arg::F32(1.0), Arg::F32(2.0), (&y).into()], 64u64)
            .unwrap()
            .wait(),
    );
    assert_eq!(
        e,
        TaskError::ArgumentType {
            index: 1,
            expected: ArgTag::Buffer as u32,
            got: ArgTag::F32 as u32
        }
    );
    let e = task_error(
        q.launch(&saxpy, &[Arg::F32(1.0), (&x).into(), (&y).into()], 1000u64)
            .unwrap()
            .wait(),
    );
    assert_eq!(
        e,
        TaskError::BufferTooSmall {
            index: 1,
            needed: 4000,
            len: 256
        }
    );
    assert!(e.to_string().contains("needs 4000 bytes, has 256"), "{e}");
    let e = task_error(
        q.launch(&saxpy, &[Arg::F32(1.0), (&x).into(), (&x).into()], 64u64)
            .unwrap()
            .wait(),
    );
    assert!(matches!(e, TaskError::Aliased { index: 1, other: 2 }), "{e:?}");
    let gaussian = s.kernel("gaussian.fan1").unwrap();
    let m = s.buffer(16 * 4).unwrap();
    let e = task_error(
        q.launch(&gaussian, &[(&m).into(), (&x).into(), Arg::I32(4), Arg::I32(3)], 3u64)
            .unwrap()
            .wait(),
    );
    assert_eq!(e, TaskError::InvalidScalar { index: 3, value: 3 });
    // Raw descriptors: an unknown kernel id and a forged buffer handle.
    let mut d = TaskDescriptor::zeroed();
    d.op = Op::Launch as u32;
    d.kernel = 9999;
    d.dims = 1;
    d.range = [1, 1, 1];
    let e = task_error(agora::testing::submit_raw(&s, q.handle(), d).unwrap().wait());
    assert_eq!(e, TaskError::UnknownKernel(9999));
    let mut d = TaskDescriptor::zeroed();
    d.op = Op::SyncTo as u32;
    d.arg_count = 1;
    d.args[0] = RawArg::buffer(0xdead_0000_0001);
    let e = task_error(agora::testing::submit_raw(&s, q.handle(), d).unwrap().wait());
    assert_eq!(
        e,
        TaskError::InvalidHandle {
            index: 0,
            handle: 0xdead_0000_0001
        }
    );
    assert!(e.to_string().contains("invalid buffer handle"), "{e}");
    // A queue handle from nowhere.
    let mut d = TaskDescriptor::zeroed();
    d.op = Op::SyncTo as u32;
    d.arg_count = 1;
    d.args[0] = RawArg::buffer(agora::testing::buffer_handle(&x));
    let e = task_error(agora::testing::submit_raw(&s, 0x77, d).unwrap().wait());
    assert_eq!(e, TaskError::UnknownQueue(0x77));
    // After all that, the session works.
    saxpy_ok(&s, 100);
}

/// Issue 2, case 3: an exhausted segment quota is an allocation error, not a crash.
#[test]
fn quota_exhaustion_is_an_allocation_error() {
    let daemon = start("quota", &["--no-opencl", "--session-quota", "1M"]);
    let s = daemon.session_named("quota");
    let mut held = Vec::new();
    let error = loop {
        match s.buffer(100_000) {
            Ok(b) => held.push(b),
            Err(e) => break e,
        }
        assert!(held.len() < 100, "a 1 MiB quota held {} buffers of 100 kB", held.len());
    };
    match &error {
        Error::Control(ControlError::QuotaExceeded { requested, quota, .. }) => {
            assert_eq!(*requested, 100_000);
            assert_eq!(*quota, 1 << 20);
        }
        other => panic!("{other:?}"),
    }
    assert!(
        error.to_string().contains("--session-quota"),
        "the message says what to do: {error}"
    );
    assert_eq!(held.len(), 10);
    // Releasing buffers makes room again (releases travel through the ring).
    held.truncate(2);
    let q = s.queue("q").unwrap();
    q.finish().unwrap();
    wait_until("released buffers to be reclaimed", Duration::from_secs(5), || {
        s.buffer(500_000).is_ok()
    });
    // Another client is unaffected.
    saxpy_ok(&daemon.session_named("other"), 1000);
}

/// Issue 2, case 4: a client killed with tasks in flight is reclaimed; others keep running.
#[test]
fn a_killed_client_is_reclaimed() {
    let daemon = start("kill", &["--no-opencl"]);
    let mut victim = daemon
        .client(&["run", "saxpy", "--size", "2000000", "--iterations", "100000", "--json"])
        .spawn()
        .unwrap();
    let victim_pid = victim.id() as i32;
    wait_until("the victim to have tasks in flight", Duration::from_secs(15), || {
        daemon
            .status()
            .sessions
            .iter()
            .any(|s| s.pid == victim_pid && s.tasks_submitted > 10 && s.in_flight > 0)
    });
    let survivor = daemon
        .client(&["run", "gaussian", "--size", "200", "--json"])
        .spawn()
        .unwrap();
    victim.kill().unwrap(); // SIGKILL
    let _ = victim.wait();
    wait_until(
        "the victim's session, buffers and lanes to be reclaimed",
        Duration::from_secs(15),
        || {
            let s = daemon.status();
            s.sessions.iter().all(|x| x.pid != victim_pid)
                && s.closing_sessions == 0
                && s.devices.iter().flat_map(|d| &d.lanes).all(|l| l.queued == 0)
        },
    );
    verified(survivor.wait_with_output().unwrap());
    let status = daemon.status();
    assert!(status.sessions_closed >= 2, "{status:?}");
    saxpy_ok(&daemon.session_named("after"), 10_000);
}

/// Issue 2, case 5: the daemon killed while a client waits: the wait returns `Disconnected`
/// within a bounded time.
#[test]
fn a_killed_daemon_disconnects_waiting_clients() {
    let mut daemon = start("daemon-kill", &["--no-opencl"]);
    let s = daemon.session_without_resume("waiter");
    let (q, _buffers) = busy_queue(&s);
    let waiter = std::thread::spawn(move || {
        let r = q.finish();
        (r, Instant::now())
    });
    std::thread::sleep(Duration::from_millis(200));
    let mut child = daemon.take_child();
    child.kill().unwrap(); // SIGKILL
    let killed = Instant::now();
    let _ = child.wait();
    let (result, returned) = waiter.join().unwrap();
    assert!(matches!(result, Err(Error::Disconnected)), "{result:?}");
    let delay = returned.saturating_duration_since(killed);
    assert!(
        delay < Duration::from_secs(2),
        "the wait returned {delay:?} after the kill"
    );
    assert!(matches!(s.buffer(16), Err(Error::Disconnected)));
    drop(daemon);
}

/// Sends `signal` (e.g. `-TERM`) to `pid`.
fn signal(pid: u32, signal: &str) {
    let status = Command::new("kill").arg(signal).arg(pid.to_string()).status().unwrap();
    assert!(status.success());
}

/// Waits for `child` to exit, at most `limit`; returns its status and when it was seen gone.
fn exits_within(child: &mut Child, limit: Duration) -> (std::process::ExitStatus, Instant) {
    let deadline = Instant::now() + limit;
    loop {
        if let Some(exit) = child.try_wait().unwrap() {
            return (exit, Instant::now());
        }
        assert!(Instant::now() < deadline, "the daemon did not exit within {limit:?}");
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// SIGTERM with no grace period (`--shutdown-timeout 0`): a clean shutdown that exits 0,
/// removes the socket and wakes waiters, who learn that the daemon went away (their tasks were
/// not cancelled by anyone they could blame).
#[test]
fn sigterm_shuts_down_cleanly() {
    let mut daemon = start("term", &["--no-opencl", "--shutdown-timeout", "0"]);
    let s = daemon.session_without_resume("waiter");
    let (q, _buffers) = busy_queue(&s);
    let waiter = std::thread::spawn(move || q.finish());
    std::thread::sleep(Duration::from_millis(200));
    signal(daemon.pid(), "-TERM");
    let mut child = daemon.take_child();
    let (exit, _) = exits_within(&mut child, Duration::from_secs(10));
    assert!(exit.success(), "exit status {exit}");
    assert!(!daemon.socket().exists(), "the socket file is removed");
    let result = waiter.join().unwrap();
    assert!(matches!(&result, Err(Error::Disconnected)), "{result:?}");
    assert!(matches!(s.buffer(16), Err(Error::Disconnected)));
}

/// Issue 22: a task running when SIGTERM arrives finishes within `--shutdown-timeout` and its
/// client gets the result; a task too long for it does not hold the daemon (before: a 20 s task
/// held shutdown for 19 s), and its client, and the client of the task queued behind it, learn
/// that the daemon went away (`Disconnected`, not `Cancelled`).
#[test]
fn sigterm_waits_for_running_work_only_up_to_the_shutdown_timeout() {
    // A short task (0.5 s) finishes during the grace period.
    let config = "[[sim]]\nname = \"slow\"\nlanes = 1\nlaunch_ns = 500000000\n";
    let mut daemon = with_config("grace", config, &["--shutdown-timeout", "10"]);
    let s = daemon.session_named("short");
    let (q, x, out) = sim_queue(&s);
    let add = s.kernel("vector_add").unwrap();
    let task = q
        .launch(&add, &[(&x).into(), (&x).into(), (&out).into()], 1024usize)
        .unwrap();
    std::thread::sleep(Duration::from_millis(100));
    signal(daemon.pid(), "-TERM");
    let mut child = daemon.take_child();
    task.wait().expect("the running task completes during the grace period");
    let (exit, _) = exits_within(&mut child, Duration::from_secs(10));
    assert!(exit.success(), "exit status {exit}");

    // A 20 s task: the daemon gives up on it after 1 s.
    let config = "[[sim]]\nname = \"slow\"\nlanes = 1\nlaunch_ns = 20000000000\n";
    let mut daemon = with_config("give-up", config, &["--shutdown-timeout", "1"]);
    let s = daemon.session_without_resume("long");
    let (q, x, out) = sim_queue(&s);
    let running = q
        .launch(&add_of(&s), &[(&x).into(), (&x).into(), (&out).into()], 1024usize)
        .unwrap();
    let queued = q
        .launch(&add_of(&s), &[(&x).into(), (&x).into(), (&out).into()], 1024usize)
        .unwrap();
    std::thread::sleep(Duration::from_millis(300));
    let sent = Instant::now();
    signal(daemon.pid(), "-TERM");
    let mut child = daemon.take_child();
    let (exit, gone) = exits_within(&mut child, Duration::from_secs(15));
    assert!(exit.success(), "exit status {exit}");
    let took = gone - sent;
    eprintln!("shutdown with a 20 s task running and --shutdown-timeout 1: {took:?}");
    assert!(
        took >= Duration::from_millis(900) && took < Duration::from_secs(6),
        "the daemon exited {took:?} after SIGTERM"
    );
    for task in [running, queued] {
        let result = task.wait();
        assert!(matches!(result, Err(Error::Disconnected)), "{result:?}");
    }
}

/// Issue 22: a second SIGTERM exits at once, whatever the grace period.
#[test]
fn a_second_sigterm_exits_at_once() {
    let config = "[[sim]]\nname = \"slow\"\nlanes = 1\nlaunch_ns = 20000000000\n";
    let mut daemon = with_config("twice", config, &["--shutdown-timeout", "60"]);
    let s = daemon.session_without_resume("long");
    let (q, x, out) = sim_queue(&s);
    let task = q
        .launch(&add_of(&s), &[(&x).into(), (&x).into(), (&out).into()], 1024usize)
        .unwrap();
    std::thread::sleep(Duration::from_millis(300));
    signal(daemon.pid(), "-TERM");
    std::thread::sleep(Duration::from_millis(300));
    let mut child = daemon.take_child();
    assert!(child.try_wait().unwrap().is_none(), "still in its grace period");
    signal(child.id(), "-TERM");
    let (exit, _) = exits_within(&mut child, Duration::from_secs(5));
    assert!(!exit.success(), "an abrupt exit says so: {exit}");
    assert!(!daemon.socket().exists(), "the socket file is removed");
    assert!(matches!(task.wait(), Err(Error::Disconnected)));
}

/// A daemon with a configuration file (and no OpenCL).
fn with_config(tag: &str, config: &str, extra: &[&str]) -> Daemon {
    let dir = agora_test_support::temp_dir(&format!("robust-{tag}"));
    let file = dir.path().join("agora.toml");
    std::fs::write(&file, config).unwrap();
    let mut args = vec!["--no-opencl", "--config", file.to_str().unwrap()];
    args.extend_from_slice(extra);
    let args: Vec<String> = args.iter().map(|a| a.to_string()).collect();
    let args: Vec<&str> = args.iter().map(|a| a.as_str()).collect();
    Daemon::start_in(AGORA, dir, &args)
}

/// A queue that prefers `sim` devices, with a 4 KiB input and output.
fn sim_queue(s: &Session) -> (agora::Queue, agora::Buffer, agora::Buffer) {
    let q = s
        .queue_with(agora::QueueOptions {
            name: "sim".into(),
            preferred_device: Some(agora::DeviceKind::Sim),
            ..Default::default()
        })
        .unwrap();
    let x = s.buffer_from(&vec![1.0f32; 1024]).unwrap();
    let out = s.buffer(4096).unwrap();
    (q, x, out)
}

fn add_of(s: &Session) -> agora::Kernel {
    s.kernel("vector_add").unwrap()
}

/// Many threads of one session plus client processes at once: nothing fails or hangs.
#[test]
fn stress_many_threads_and_processes() {
    let daemon = start("stress", &["--no-opencl"]);
    let session = daemon.session_named("stress");
    let others: Vec<Child> = (0..3)
        .map(|_| {
            daemon
                .client(&["run", "saxpy", "--size", "100000", "--json"])
                .spawn()
                .unwrap()
        })
        .collect();
    let threads: Vec<_> = (0..16)
        .map(|t| {
            let s = session.clone();
            std::thread::spawn(move || {
                let q = s.queue(&format!("t{t}")).unwrap();
                let noop = s.kernel("noop").unwrap();
                let saxpy = s.kernel("saxpy").unwrap();
                let n = 1000 + t * 7;
                let x = s.buffer_from(&vec![1.0f32; n]).unwrap();
                let y = s.buffer_from(&vec![0.0f32; n]).unwrap();
                for i in 0..2000 {
                    if i % 2 == 0 {
                        let _ = q.launch(&noop, &[], 1u64).unwrap();
                    } else {
                        let task = q.launch(&saxpy, &[Arg::F32(1.0), (&x).into(), (&y).into()], n).unwrap();
                        if i % 50 == 1 {
                            task.wait().unwrap();
                        }
                    }
                }
                q.sync_from(&y).unwrap();
                q.finish().unwrap();
                assert!(y.as_slice::<f32>().iter().all(|v| *v == 1000.0), "thread {t}");
            })
        })
        .collect();
    for t in threads {
        t.join().expect("a stress thread failed");
    }
    for c in others {
        verified(c.wait_with_output().unwrap());
    }
}

/// `agora status --json` shows two live clients; `agora run` verifies; idle costs no CPU.
#[test]
fn status_shows_clients_and_an_idle_daemon_sleeps() {
    let daemon = start("status", &[]);
    let a = daemon.session_named("tenant-a");
    let b = daemon.session_named("tenant-b");
    let _qa = a.queue("qa").unwrap();
    let out = daemon.client(&["status", "--json"]).output().unwrap();
    assert!(out.status.success());
    let status: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let names: Vec<&str> = status["sessions"]
        .as_array()
        .unwrap()
        .iter()
        .map(|s| s["name"].as_str().unwrap())
        .collect();
    assert!(names.contains(&"tenant-a") && names.contains(&"tenant-b"), "{names:?}");
    let pid = std::process::id() as i64;
    assert!(status["sessions"].as_array().unwrap().iter().all(|s| s["pid"] == pid));
    verified(
        daemon
            .client(&["run", "gaussian", "--size", "64", "--json"])
            .output()
            .unwrap(),
    );
    // Idle with two connected clients: a spinning daemon would use ~100 % of a core.
    let ticks = |pid: u32| -> u64 {
        let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap();
        let fields: Vec<&str> = stat.rsplit_once(')').unwrap().1.split_whitespace().collect();
        fields[11].parse::<u64>().unwrap() + fields[12].parse::<u64>().unwrap()
    };
    std::thread::sleep(Duration::from_millis(300));
    let before = ticks(daemon.pid());
    std::thread::sleep(Duration::from_secs(2));
    let used = ticks(daemon.pid()) - before;
    assert!(used < 20, "an idle daemon used {used} ticks (of 200) in 2 s");
    drop((a, b));
}

/// A buffer allocation whose reply came after the caller gave up (`TimeoutError`) is released
/// once the late reply is read, instead of holding its heap for the session's life (before,
/// the daemon's buffer stayed, with no handle to free it: a later allocation of the rest of the
/// heap was refused).
#[test]
fn a_buffer_whose_allocation_timed_out_is_released_when_its_reply_comes() {
    let daemon = start("late-alloc", &["--no-opencl"]);
    let session = Session::connect_with(agora::SessionOptions {
        socket: Some(daemon.socket().to_path_buf()),
        control_timeout: Some(Duration::from_millis(300)),
        ..Default::default()
    })
    .unwrap();
    let me = session.id();
    signal(daemon.pid(), "-STOP");
    let late = session.buffer(64 << 20);
    signal(daemon.pid(), "-CONT");
    assert!(matches!(late, Err(Error::Timeout { .. })), "{late:?}");
    // The next control call reads the late reply; what it created goes.
    let mut held = (u64::MAX, u64::MAX);
    wait_until("the orphan's release", Duration::from_secs(10), || {
        let me = session.session_status(me).unwrap();
        held = (me.buffers, me.heap_used);
        held == (0, 0)
    });
    assert_eq!(held, (0, 0));
    let whole = session.buffer(1 << 30).expect("the heap is whole again");
    drop(whole);
}
