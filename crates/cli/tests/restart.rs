//! Issue 20, item 5: clients survive a daemon restart. A real `agora serve` process is killed
//! with SIGKILL and started again on the same socket while client processes and threads run
//! verified work; each session reconnects by itself, hands its segment back, and carries on with
//! the same buffers, queues, kernels and programs. Tasks that were in flight fail with
//! `DaemonRestarted` (the application issues them again); a buffer whose newest contents were
//! only on a device comes back lost (`DataLost`) until it is written whole.
//!
//! The gap (from the new daemon listening to the first task completed on it) is measured and
//! printed: `cargo test --release --test restart -- --nocapture`.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use agora::{Arg, DeviceKind, Error, QueueOptions, Session, SessionOptions, TaskError};
use agora_test_support::Daemon;

const AGORA: &str = env!("CARGO_BIN_EXE_agora");
const RESTARTS: usize = 10;
const N: usize = 4096;

fn session(socket: &Path, name: &str) -> Session {
    Session::connect_with(SessionOptions {
        socket: Some(socket.to_path_buf()),
        name: Some(name.into()),
        reconnect_timeout: Some(Duration::from_secs(20)),
        ..Default::default()
    })
    .expect("session opens")
}

/// What the verified loop saw.
#[derive(Default)]
struct Progress {
    /// When each verified round completed.
    completed: Mutex<Vec<Instant>>,
    rounds: AtomicU64,
    /// Tasks that failed with `DaemonRestarted` (and were issued again).
    restarted: AtomicU64,
}

/// One round of saxpy whose inputs depend on `round`, fully rewritten each time: `Ok(true)`
/// verified, `Ok(false)` a task failed with `DaemonRestarted`, or read data that died with the
/// daemon (`DataLost`: a `sync_from` the dead daemon never took, issued again on the new one)
/// — issue the round again; `Err` any other failure.
fn round(
    session: &Session,
    queue: &agora::Queue,
    saxpy: &agora::Kernel,
    x: &agora::Buffer,
    y: &agora::Buffer,
    r: u64,
) -> Result<bool, String> {
    let xs: Vec<f32> = (0..N).map(|i| ((i as u64 + r) % 1000) as f32).collect();
    let ys: Vec<f32> = vec![(r % 7) as f32; N];
    x.write_slice(&xs).unwrap();
    y.write_slice(&ys).unwrap();
    let resumes = session.resumes();
    let tasks = (|| -> Result<Vec<agora::Task>, Error> {
        Ok(vec![
            queue.sync_to(x)?,
            queue.sync_to(y)?,
            queue.launch(saxpy, &[Arg::F32(3.0), x.into(), y.into()], N)?,
            queue.sync_from(y)?,
        ])
    })();
    let tasks = match tasks {
        Ok(t) => t,
        Err(Error::Task(TaskError::DaemonRestarted)) => return Ok(false),
        Err(e) => return Err(format!("issuing round {r}: {e}")),
    };
    let mut restarted = false;
    for task in &tasks {
        match task.wait() {
            Ok(()) => {}
            Err(Error::Task(TaskError::DaemonRestarted)) => restarted = true,
            // The launch completed on the dead daemon, the read was issued again on the new one.
            Err(Error::Task(TaskError::DataLost { .. })) if session.resumes() > resumes => restarted = true,
            // A task after one that the restart lost may read what it should have written.
            Err(Error::Task(TaskError::DependencyFailed { .. } | TaskError::DataLost { .. })) if restarted => {}
            Err(e) => return Err(format!("round {r}: {e}")),
        }
    }
    if restarted {
        return Ok(false);
    }
    let got = y.read_vec::<f32>();
    for (i, v) in got.iter().enumerate() {
        let want = 3.0 * xs[i] + ys[i];
        if *v != want {
            return Err(format!("round {r}: y[{i}] = {v}, expected {want}"));
        }
    }
    Ok(true)
}

/// The verified loop of one session, until `stop`.
fn work(session: Session, device: DeviceKind, progress: Arc<Progress>, stop: Arc<AtomicBool>) -> Result<(), String> {
    let queue = session
        .queue_with(QueueOptions {
            name: format!("loop-{}", device.name()),
            preferred_device: Some(device),
            ..Default::default()
        })
        .map_err(|e| e.to_string())?;
    let saxpy = session.kernel("saxpy").map_err(|e| e.to_string())?;
    let x = session.buffer(N as u64 * 4).map_err(|e| e.to_string())?;
    let y = session.buffer(N as u64 * 4).map_err(|e| e.to_string())?;
    let mut r = 0u64;
    while !stop.load(Ordering::Relaxed) {
        if round(&session, &queue, &saxpy, &x, &y, r)? {
            progress.rounds.fetch_add(1, Ordering::Relaxed);
            progress.completed.lock().unwrap().push(Instant::now());
            r += 1;
        } else {
            progress.restarted.fetch_add(1, Ordering::Relaxed);
        }
    }
    Ok(())
}

/// Kills and restarts `daemon` `RESTARTS` times, each once every one of `loops` shows
/// `rounds_between` more verified rounds; returns each loop's gaps (new daemon listening →
/// its first round completed after it).
fn restart_under(daemon: &mut Daemon, loops: &[Arc<Progress>], rounds_between: u64) -> Vec<Vec<Duration>> {
    let wait_for_rounds = |what: &str| {
        let targets: Vec<u64> = loops
            .iter()
            .map(|p| p.rounds.load(Ordering::Relaxed) + rounds_between)
            .collect();
        let deadline = Instant::now() + Duration::from_secs(60);
        while loops
            .iter()
            .zip(&targets)
            .any(|(p, t)| p.rounds.load(Ordering::Relaxed) < *t)
        {
            assert!(Instant::now() < deadline, "no verified progress within 60 s {what}");
            std::thread::sleep(Duration::from_millis(2));
        }
    };
    let mut ready_times = Vec::new();
    for i in 0..RESTARTS {
        wait_for_rounds(&format!("before restart {i}"));
        daemon.restart();
        ready_times.push(Instant::now());
    }
    wait_for_rounds("after the last restart");
    loops
        .iter()
        .map(|progress| {
            let completed = progress.completed.lock().unwrap();
            ready_times
                .iter()
                .map(|ready| {
                    let first = completed
                        .iter()
                        .find(|t| *t > ready)
                        .expect("a round completed after each restart");
                    first.duration_since(*ready)
                })
                .collect()
        })
        .collect()
}

fn spread(gaps: &[Duration]) -> String {
    let mut ms: Vec<f64> = gaps.iter().map(|g| g.as_secs_f64() * 1e3).collect();
    ms.sort_by(f64::total_cmp);
    format!(
        "min {:.1} ms, median {:.1} ms, max {:.1} ms",
        ms[0],
        ms[ms.len() / 2],
        ms[ms.len() - 1]
    )
}

#[test]
fn rust_sessions_carry_on_with_verified_work_across_ten_sigkill_restarts() {
    let mut daemon = Daemon::start(AGORA, "restart-rust", &[]);
    let stop = Arc::new(AtomicBool::new(false));
    let mut workers = Vec::new();
    let mut sessions = Vec::new();
    let mut loops = Vec::new();
    let devices = [DeviceKind::Cpu, DeviceKind::OpenCl];
    for device in devices {
        let s = session(daemon.socket(), &format!("restart-{}", device.name()));
        sessions.push(s.clone());
        let progress = Arc::new(Progress::default());
        loops.push(progress.clone());
        let stop = stop.clone();
        workers.push(std::thread::spawn(move || work(s, device, progress, stop)));
    }
    let gaps = restart_under(&mut daemon, &loops, 3);
    stop.store(true, Ordering::Relaxed);
    for w in workers {
        w.join().unwrap().expect("every round verified or reissued");
    }
    for s in &sessions {
        assert_eq!(s.resumes(), RESTARTS as u64, "each session resumed after every restart");
    }
    let status = daemon.status();
    assert_eq!(
        status.sessions.len(),
        2,
        "the resumed sessions are the daemon's only sessions"
    );
    for ((device, progress), gaps) in devices.iter().zip(&loops).zip(&gaps) {
        eprintln!(
            "restart (Rust, {} queue): {} verified rounds, {} rounds reissued after DaemonRestarted, gap restart→first verified round over {RESTARTS} restarts: {}",
            device.name(),
            progress.rounds.load(Ordering::Relaxed),
            progress.restarted.load(Ordering::Relaxed),
            spread(gaps)
        );
    }
}

#[test]
fn data_only_on_a_device_comes_back_lost_and_everything_else_carries_on() {
    let mut daemon = Daemon::start(AGORA, "restart-lost", &[]);
    let s = session(daemon.socket(), "restart-lost");
    agora_test_support::require_opencl(&s);
    let queue = s
        .queue_with(QueueOptions {
            name: "opencl".into(),
            preferred_device: Some(DeviceKind::OpenCl),
            ..Default::default()
        })
        .unwrap();
    let saxpy = s.kernel("saxpy").unwrap();
    let x = s.buffer_from(&vec![1.0f32; N]).unwrap();
    let y = s.buffer_from(&vec![2.0f32; N]).unwrap();
    let kept = s.buffer_from(&vec![7u8; 256]).unwrap();
    // y's newest contents (5.0) are on the device only.
    queue
        .launch(&saxpy, &[Arg::F32(3.0), (&x).into(), (&y).into()], N)
        .unwrap()
        .wait()
        .unwrap();
    assert!(y.needs_sync_from());
    let queue_handle = queue.handle();
    daemon.restart();

    // Reading y: its newest contents died with the daemon. (Issued before the session noticed
    // the daemon gone, the read is issued again on the new one.)
    match queue.sync_from(&y).unwrap().wait() {
        Err(Error::Task(TaskError::DataLost { .. })) => {}
        other => panic!("reading a buffer whose newest copy was on the dead daemon's device: {other:?}"),
    }
    // finish() reports what failed since the previous one: the lost read.
    match queue.finish() {
        Err(Error::Tasks(failures)) => assert!(failures
            .failures
            .iter()
            .any(|(_, e)| matches!(e, TaskError::DataLost { .. }))),
        other => panic!("finish after a lost read: {other:?}"),
    }
    assert_eq!(s.resumes(), 1);
    assert_eq!(queue.handle(), queue_handle, "the queue keeps its handle");
    // A buffer synced before the restart is intact, host copy and all.
    queue.sync_to(&kept).unwrap().wait().unwrap();
    queue.sync_from(&kept).unwrap().wait().unwrap();
    assert!(kept.read().iter().all(|b| *b == 7));
    // Writing y whole makes it usable again; the kernel looked up before the restart still runs.
    y.write_slice(&vec![2.0f32; N]).unwrap();
    queue.sync_to(&y).unwrap();
    queue
        .launch(&saxpy, &[Arg::F32(3.0), (&x).into(), (&y).into()], N)
        .unwrap();
    queue.sync_from(&y).unwrap().wait().unwrap();
    assert!(y.read_vec::<f32>().iter().all(|v| *v == 5.0));
    queue.finish().unwrap();
}

#[test]
fn with_reconnection_off_the_session_reports_disconnected() {
    let mut daemon = Daemon::start(AGORA, "restart-off", &[]);
    let s = Session::connect_with(SessionOptions {
        socket: Some(daemon.socket().to_path_buf()),
        reconnect_timeout: Some(Duration::ZERO),
        ..Default::default()
    })
    .unwrap();
    let queue = s.queue("q").unwrap();
    let buffer = s.buffer(64).unwrap();
    daemon.restart();
    let started = Instant::now();
    let outcome = queue.memset(&buffer, 0).and_then(|t| t.wait());
    assert!(matches!(outcome, Err(Error::Disconnected)), "{outcome:?}");
    assert!(started.elapsed() < Duration::from_secs(5));
}

#[test]
fn a_pending_completion_callback_is_told_once_when_its_daemon_dies_or_restarts() {
    let mut daemon = Daemon::start(AGORA, "restart-callbacks", &["--no-opencl"]);
    let resuming = session(daemon.socket(), "callbacks-resuming");
    let ending = daemon.session_without_resume("callbacks-ending");
    let (sender, told) = std::sync::mpsc::channel();
    let mut pending = 0;
    // Long sgemms (a few hundred ms each on a CPU lane): in flight when the daemon is killed.
    let keep: Vec<_> = [("resuming", &resuming), ("ending", &ending)]
        .into_iter()
        .map(|(which, s)| {
            let q = agora_test_support::queue_preferring(s, "long", DeviceKind::Cpu);
            let outputs: Vec<_> = (0..4)
                .map(|_| {
                    let (task, c) = agora_test_support::long_sgemm(s, &q, 768);
                    let sender = sender.clone();
                    task.on_complete(move |outcome| sender.send((which, outcome)).unwrap());
                    pending += 1;
                    c
                })
                .collect();
            (q, outputs)
        })
        .collect();
    daemon.restart();
    let mut outcomes = Vec::new();
    for _ in 0..pending {
        outcomes.push(
            told.recv_timeout(Duration::from_secs(30))
                .expect("every callback is told"),
        );
    }
    drop(sender);
    assert!(
        told.recv_timeout(Duration::from_millis(200)).is_err(),
        "a callback was told twice"
    );
    // Killed while running: the resumed session's tasks fail as restarted, the other's as
    // disconnected (any that finished before the kill are told so).
    for (which, outcome) in &outcomes {
        match (*which, outcome) {
            (_, Ok(())) => {}
            ("resuming", Err(Error::Task(TaskError::DaemonRestarted))) => {}
            ("ending", Err(Error::Disconnected)) => {}
            other => panic!("unexpected: {other:?}"),
        }
    }
    for which in ["resuming", "ending"] {
        assert!(
            outcomes.iter().any(|(w, o)| *w == which && o.is_err()),
            "none of the {which} session's callbacks was told of the kill: {outcomes:?}"
        );
    }
    drop(keep);
}

/// Tasks issued while the daemon was dead (the client had not noticed yet) sit in a ring nobody
/// reads: the daemon never took them, so the resumed session issues them again on the next one
/// and they complete as if nothing happened, releases of buffers and queues included. But once
/// a task the dead daemon took was lost, the later ones fail too (they might read what it
/// should have written), and a daemon that shut down cleanly is seen before a task is issued.
#[test]
fn tasks_the_dead_daemon_never_took_run_on_the_next_one() {
    let mut daemon = Daemon::start(AGORA, "restart-untaken", &["--no-opencl"]);
    let s = session(daemon.socket(), "untaken");
    let q = agora_test_support::queue_preferring(&s, "untaken", DeviceKind::Cpu);
    let other = agora_test_support::queue_preferring(&s, "dropped", DeviceKind::Cpu);
    let saxpy = s.kernel("saxpy").unwrap();
    let x = s.buffer_from(&vec![1.0f32; N]).unwrap();
    let y = s.buffer_from(&vec![2.0f32; N]).unwrap();
    let temporary = s.buffer_from(&vec![0u8; 4096]).unwrap();
    q.sync_to(&x).unwrap();
    q.sync_to(&y).unwrap();
    q.launch(&saxpy, &[Arg::F32(3.0), (&x).into(), (&y).into()], N).unwrap();
    q.sync_from(&y).unwrap().wait().unwrap();
    assert!(y.read_vec::<f32>().iter().all(|v| *v == 5.0));

    // Killed while the session is idle; it issues work before noticing.
    daemon.kill();
    let launch = q.launch(&saxpy, &[Arg::F32(1.0), (&x).into(), (&y).into()], N).unwrap();
    other.memset(&temporary, 7).unwrap();
    drop(temporary);
    drop(other);
    let read = q.sync_from(&y).unwrap();
    assert_eq!(s.resumes(), 0, "nothing noticed the kill yet");
    daemon.restart();
    read.wait()
        .expect("a task the dead daemon never took runs on the new one");
    launch.wait().unwrap();
    assert!(
        y.read_vec::<f32>().iter().all(|v| *v == 6.0),
        "y = 1·x + 5, exactly once"
    );
    q.finish().expect("no task failed");
    assert_eq!(s.resumes(), 1);
    // The launch, the memset, the buffer's release, the queue's release and the read.
    assert_eq!(s.tasks_reissued(), 5);
    let own = s.session_status(s.id()).unwrap();
    assert_eq!(
        own.buffers, 2,
        "the dropped buffer was released on the new daemon: {own:?}"
    );
    assert_eq!(
        own.queue_count, 1,
        "the dropped queue was released on the new daemon: {own:?}"
    );

    // A task the daemon took dies with it: the tasks after it fail too, none runs.
    let (long, _c) = agora_test_support::long_sgemm(&s, &q, 1536);
    std::thread::sleep(Duration::from_millis(100));
    assert!(!long.is_complete().unwrap(), "the sgemm runs longer than 100 ms");
    daemon.kill();
    let after = q.launch(&saxpy, &[Arg::F32(1.0), (&x).into(), (&y).into()], N).unwrap();
    daemon.restart();
    for task in [&long, &after] {
        match task.wait() {
            Err(Error::Task(TaskError::DaemonRestarted)) => {}
            other => panic!("a task behind a lost one: {other:?}"),
        }
    }
    assert_eq!(s.tasks_reissued(), 5, "nothing issued again behind a lost task");
    let _ = q.finish();
    q.sync_from(&y).unwrap().wait().unwrap();
    assert!(
        y.read_vec::<f32>().iter().all(|v| *v == 6.0),
        "the saxpy behind the lost task never ran"
    );

    // A daemon that shut down says so in the segment: the next task goes to the next daemon.
    daemon.stop();
    daemon.restart();
    q.launch(&saxpy, &[Arg::F32(1.0), (&x).into(), (&y).into()], N).unwrap();
    q.sync_from(&y).unwrap().wait().unwrap();
    assert!(y.read_vec::<f32>().iter().all(|v| *v == 7.0));
    assert_eq!(s.resumes(), 3);
    assert_eq!(s.tasks_reissued(), 5, "issued after the resume, not again");
}

/// The repository's Python virtualenv, made by `make setup`.
fn python() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../.venv/bin/python")
}

/// A client process (`program ARGS`, with `AGORA_SOCKET`) running verified rounds until its
/// stop file appears, printing one line per verified round (`ok`) and per reissued round
/// (`restarted`), and `done` at the end; the daemon is killed and restarted under it.
fn restart_under_process(tag: &str, mut command: Command) {
    let mut daemon = Daemon::start(AGORA, tag, &[]);
    let stop = daemon.dir().join("stop");
    let out = daemon.dir().join("out");
    let mut child = command
        .env("AGORA_SOCKET", daemon.socket())
        .env("AGORA_RECONNECT_TIMEOUT", "20")
        .env("RESTART_STOP_FILE", &stop)
        .stdout(std::fs::File::create(&out).unwrap())
        .spawn()
        .expect("the client process starts");
    let rounds = || {
        std::fs::read_to_string(&out)
            .unwrap_or_default()
            .lines()
            .filter(|l| *l == "ok")
            .count()
    };
    let mut ready_times = Vec::new();
    let mut seen_at = Vec::<(usize, Instant)>::new();
    let mut watch = |until: usize, seen_at: &mut Vec<(usize, Instant)>| {
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            let n = rounds();
            if seen_at.last().is_none_or(|(m, _)| *m != n) {
                seen_at.push((n, Instant::now()));
            }
            if n >= until {
                return;
            }
            if let Ok(Some(status)) = child.try_wait() {
                panic!(
                    "the {tag} client exited ({status}) after {n} rounds:\n{}",
                    std::fs::read_to_string(&out).unwrap_or_default()
                );
            }
            assert!(
                Instant::now() < deadline,
                "the {tag} client made no progress within 60 s ({n} rounds)"
            );
            std::thread::sleep(Duration::from_millis(1));
        }
    };
    for _ in 0..RESTARTS {
        let target = rounds() + 3;
        watch(target, &mut seen_at);
        daemon.restart();
        ready_times.push((rounds(), Instant::now()));
    }
    let target = rounds() + 3;
    watch(target, &mut seen_at);
    std::fs::write(&stop, b"").unwrap();
    let status = child.wait().unwrap();
    let text = std::fs::read_to_string(&out).unwrap();
    assert!(status.success(), "the {tag} client failed ({status}):\n{text}");
    assert_eq!(text.lines().last(), Some("done"), "{text}");
    // First time the count of verified rounds grew past its value at each restart.
    let gaps: Vec<Duration> = ready_times
        .iter()
        .map(|(n, ready)| {
            let (_, at) = seen_at
                .iter()
                .find(|(m, at)| m > n && at >= ready)
                .expect("progress after each restart");
            at.duration_since(*ready)
        })
        .collect();
    eprintln!(
        "restart ({tag}): {} verified rounds, {} reissued, gap restart→first verified round over {RESTARTS} restarts: {}",
        rounds(),
        text.lines().filter(|l| *l == "restarted").count(),
        spread(&gaps)
    );
}

#[test]
fn a_python_client_process_carries_on_across_ten_sigkill_restarts() {
    let python = python();
    assert!(python.exists(), "{} is missing: run `make setup`", python.display());
    let mut command = Command::new(python);
    command.arg(concat!(env!("CARGO_MANIFEST_DIR"), "/tests/restart_loop.py"));
    restart_under_process("python", command);
}

#[test]
fn a_c_client_process_carries_on_across_ten_sigkill_restarts() {
    // target/<profile>/deps/restart-… → target/<profile>, where libagora_capi.so is built.
    let exe = std::env::current_exe().unwrap();
    let build_dir = exe.parent().unwrap().parent().unwrap().to_path_buf();
    assert!(
        build_dir.join("libagora_capi.so").exists(),
        "libagora_capi.so is not built in {}: cargo build --workspace",
        build_dir.display()
    );
    let scratch = agora_test_support::temp_dir("restart-c");
    let program = scratch.path().join("restart_loop");
    let include = concat!(env!("CARGO_MANIFEST_DIR"), "/../capi/include");
    let cc = Command::new("cc")
        .arg(concat!(env!("CARGO_MANIFEST_DIR"), "/tests/restart_loop.c"))
        .arg(format!("-I{include}"))
        .arg(format!("-L{}", build_dir.display()))
        .args(["-lagora_capi", "-Wall", "-Werror", "-o"])
        .arg(&program)
        .output()
        .expect("a C compiler (cc) runs");
    assert!(
        cc.status.success(),
        "cc failed:\n{}",
        String::from_utf8_lossy(&cc.stderr)
    );
    let mut command = Command::new(&program);
    command.env("LD_LIBRARY_PATH", &build_dir);
    restart_under_process("c", command);
}

#[test]
fn a_tenant_program_is_built_again_and_its_kernels_keep_working() {
    let mut daemon = Daemon::start(AGORA, "restart-program", &[]);
    let s = session(daemon.socket(), "restart-program");
    agora_test_support::require_opencl(&s);
    // A program of the tenant's own, and a library kernel looked up beside it.
    let program = s
        .program_opencl(
            "__kernel void twice_plus(float a, __global const float *x, __global float *y) {\n\
             size_t i = get_global_id(0); y[i] = 2.0f * x[i] + a; }",
        )
        .expect("the program builds");
    let twice_plus = program.kernel("twice_plus").unwrap();
    let saxpy = s.kernel("saxpy").unwrap();
    let queue = s.queue("program").unwrap();
    let x = s.buffer_from(&vec![1.5f32; N]).unwrap();
    let y = s.buffer(N as u64 * 4).unwrap();
    let run = |a: f32| -> Result<Vec<f32>, Error> {
        queue.sync_to(&x)?;
        queue.launch(&twice_plus, &[Arg::F32(a), (&x).into(), (&y).into()], N)?;
        queue.launch(&saxpy, &[Arg::F32(1.0), (&x).into(), (&y).into()], N)?;
        queue.sync_from(&y)?.wait()?;
        Ok(y.read_vec::<f32>())
    };
    assert!(run(1.0).unwrap().iter().all(|v| *v == 2.0 * 1.5 + 1.0 + 1.5));
    daemon.restart();
    // The first try may have been issued to the daemon that died.
    let got = match run(2.0) {
        Err(Error::Task(TaskError::DaemonRestarted | TaskError::DependencyFailed { .. })) => {
            let _ = queue.finish();
            run(2.0)
        }
        other => other,
    }
    .expect("the rebuilt program's kernel runs on the new daemon");
    assert!(got.iter().all(|v| *v == 2.0 * 1.5 + 2.0 + 1.5), "{:?}", &got[..4]);
    assert_eq!(s.resumes(), 1);
}

#[test]
fn a_daemon_that_does_not_come_back_in_time_is_disconnected_after_the_reconnect_timeout() {
    let mut daemon = Daemon::start(AGORA, "restart-never", &["--no-opencl"]);
    let s = Session::connect_with(SessionOptions {
        socket: Some(daemon.socket().to_path_buf()),
        reconnect_timeout: Some(Duration::from_millis(300)),
        ..Default::default()
    })
    .unwrap();
    let queue = s.queue("q").unwrap();
    let buffer = s.buffer(64).unwrap();
    daemon.kill();
    let started = Instant::now();
    let outcome = queue.memset(&buffer, 0).and_then(|t| t.wait());
    let took = started.elapsed();
    assert!(matches!(outcome, Err(Error::Disconnected)), "{outcome:?}");
    assert!(
        took >= Duration::from_millis(250) && took < Duration::from_secs(5),
        "gave up after {took:?}"
    );
    // Given up for good: later calls fail at once.
    let started = Instant::now();
    assert!(matches!(s.queue("again"), Err(Error::Disconnected)));
    assert!(started.elapsed() < Duration::from_millis(200));
}

#[test]
fn objects_dropped_after_the_daemon_stopped_go_at_once_and_are_released_by_the_next_daemon() {
    let mut daemon = Daemon::start(AGORA, "restart-drops", &["--no-opencl"]);
    // The default reconnect timeout is 30 s: a drop that waited for a new daemon would show.
    let s = Session::connect_with(SessionOptions {
        socket: Some(daemon.socket().to_path_buf()),
        name: Some("drops".into()),
        ..Default::default()
    })
    .unwrap();
    let q = agora_test_support::queue_preferring(&s, "kept", DeviceKind::Cpu);
    let dropped_queue = s.queue("dropped").unwrap();
    let kept = s.buffer_from(&vec![3.0f32; N]).unwrap();
    let dropped: Vec<_> = (0..4).map(|_| s.buffer(4096).unwrap()).collect();
    q.sync_to(&kept).unwrap().wait().unwrap();

    daemon.stop();
    let started = Instant::now();
    drop(dropped);
    drop(dropped_queue);
    let took = started.elapsed();
    assert!(
        took < Duration::from_secs(5),
        "dropping four buffers and a queue after a clean stop took {took:?}"
    );

    // The releases wait in the ring; the next call resumes and the new daemon carries them out.
    daemon.restart();
    q.sync_from(&kept).unwrap().wait().unwrap();
    assert!(kept.read_vec::<f32>().iter().all(|v| *v == 3.0));
    assert_eq!(s.resumes(), 1);
    let own = s.session_status(s.id()).unwrap();
    assert_eq!(own.buffers, 1, "only the kept buffer is left: {own:?}");
    assert_eq!(own.queue_count, 1, "only the kept queue is left: {own:?}");

    // A daemon that is gone for good: the program's exit (every drop) is prompt too.
    daemon.stop();
    let started = Instant::now();
    drop(kept);
    drop(q);
    drop(s);
    assert!(
        started.elapsed() < Duration::from_secs(5),
        "dropping the session after a clean stop took {:?}",
        started.elapsed()
    );
}

#[test]
fn a_drop_with_the_rings_full_of_a_killed_daemon_s_tasks_does_not_wait_for_the_next() {
    // Two outstanding tasks fill the rings — the sgemm and the release of its input, which
    // waits for it — and the daemon dies with both taken.
    let mut daemon = Daemon::start(AGORA, "restart-full-drop", &["--no-opencl", "--ring-capacity", "2"]);
    let s = session(daemon.socket(), "full-drop");
    let q = agora_test_support::queue_preferring(&s, "full", DeviceKind::Cpu);
    let kept = s.buffer(4096).unwrap();
    let dropped = s.buffer(4096).unwrap();
    let (long, _c) = agora_test_support::long_sgemm(&s, &q, 1536);
    std::thread::sleep(Duration::from_millis(100));
    assert!(!long.is_complete().unwrap(), "the sgemm runs longer than 100 ms");
    daemon.kill();
    let started = Instant::now();
    drop(dropped);
    let took = started.elapsed();
    assert!(
        took < Duration::from_secs(5),
        "a drop with full rings waited {took:?} for a new daemon (the reconnect timeout is 20 s)"
    );
    // Not issued: the next daemon never learns of the dropped buffer; the lost tasks say so.
    daemon.restart();
    assert!(matches!(long.wait(), Err(Error::Task(TaskError::DaemonRestarted))));
    let own = s.session_status(s.id()).unwrap();
    assert_eq!(
        own.buffers, 2,
        "the kept buffer and the sgemm's, not the dropped one: {own:?}"
    );
    q.memset(&kept, 2).unwrap().wait().unwrap();
}

/// One `Request::Resume` sent raw, with `fds` attached; the daemon's reply (`None`: it closed
/// the connection).
fn raw_resume(
    socket: &Path,
    fds: &[std::os::fd::BorrowedFd<'_>],
    heap_len: u64,
    buffers: Vec<agora_protocol::control::ResumedBuffer>,
) -> Option<agora_protocol::control::Response> {
    use agora_protocol::control::{Request, Response};
    let stream = std::os::unix::net::UnixStream::connect(socket).unwrap();
    stream.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    let request = Request::Resume {
        version: agora_protocol::PROTOCOL_VERSION,
        client_name: "forger".into(),
        previous_session: 1,
        submission_capacity: 8,
        completion_capacity: 8,
        heap_len,
        buffers,
        queues: vec![],
        kernels: vec!["saxpy".into()],
        more: false,
    };
    agora_transport::socket::send_with_fds(&stream, &request, fds).unwrap();
    agora_transport::socket::recv_with_fds::<Response>(&stream)
        .ok()
        .map(|(r, _)| r)
}

#[test]
fn a_resume_is_checked_as_untrusted_input_and_refused_without_harm() {
    use agora_protocol::control::{ControlError, Response, ResumedBuffer};
    use agora_protocol::segment::Geometry;
    use std::os::fd::AsFd;
    // Its log kept, for the refusals it must show the operator.
    let dir = agora_test_support::temp_dir("restart-forged");
    let log = dir.path().join("daemon.log");
    let log_file = std::fs::File::create(&log).unwrap();
    let daemon = Daemon::start_in_with(AGORA, dir, &["--no-opencl"], |command| {
        command.env("AGORA_LOG", "warn").stderr(log_file);
    });
    let neighbour = daemon.session_named("neighbour");
    let heap = 1u64 << 16;
    let geometry = Geometry::new(8, 8, heap).unwrap();
    let buffer = |handle: u64, offset: u64, len: u64| ResumedBuffer {
        handle,
        offset,
        len,
        lost: false,
    };
    let refused = |reply: Option<Response>, what: &str| match reply {
        Some(Response::Error(ControlError::BadRequest(why))) => assert!(why.contains(what), "{why}"),
        // A part refused after the session opened ends the connection, after saying why.
        None => {}
        other => panic!("a forged resume ({what}) was answered {other:?}"),
    };

    // No descriptor.
    refused(raw_resume(daemon.socket(), &[], heap, vec![]), "exactly one descriptor");
    // A descriptor that is not a sealed memfd.
    let file = std::fs::File::open("/dev/null").unwrap();
    refused(raw_resume(daemon.socket(), &[file.as_fd()], heap, vec![]), "not usable");
    // A real segment whose size does not match the geometry the request states.
    let segment = agora_transport::shm::Segment::create("forged", geometry).unwrap();
    refused(
        raw_resume(daemon.socket(), &[segment.fd()], heap * 2, vec![]),
        "not usable",
    );
    // Buffers over each other, outside the heap, or with handles that were never handles.
    for buffers in [
        vec![buffer(1 << 32 | 1, 0, 256), buffer(1 << 32 | 2, 128, 256)],
        vec![buffer(1 << 32 | 1, heap - 64, 256)],
        vec![buffer(5, 0, 64)],
        vec![buffer(1 << 32 | 1, 0, 64), buffer(1 << 32 | 1, 64, 64)],
    ] {
        let segment = agora_transport::shm::Segment::create("forged", geometry).unwrap();
        let reply = raw_resume(daemon.socket(), &[segment.fd()], heap, buffers.clone());
        assert!(
            !matches!(reply, Some(Response::Resumed { .. })),
            "{buffers:?} was accepted"
        );
    }
    // A well-formed resume of a fresh segment is accepted (the checks above are not blanket).
    let segment = agora_transport::shm::Segment::create("forged", geometry).unwrap();
    match raw_resume(daemon.socket(), &[segment.fd()], heap, vec![buffer(1 << 32 | 1, 0, 64)]) {
        Some(Response::Resumed { kernels, .. }) => assert!(kernels[0].is_some(), "saxpy has an id"),
        other => panic!("a valid resume: {other:?}"),
    }
    // The neighbour never noticed.
    agora_test_support::saxpy_ok(&neighbour, 10_000);
    assert!(daemon.status().sessions.iter().any(|s| s.name == "neighbour"));
    // The operator saw the first refusal, naming the session, its uid and why; the others of
    // the same session (as a client retrying would send) were counted, not logged.
    let log = std::fs::read_to_string(&log).unwrap();
    let refusals: Vec<&str> = log
        .lines()
        .filter(|l| l.contains("WARN") && l.contains("refused a resume"))
        .collect();
    let uid = rustix::process::geteuid().as_raw();
    assert!(
        refusals.len() == 1
            && refusals[0].contains("name=\"forger\"")
            && refusals[0].contains(&format!("uid={uid}"))
            && refusals[0].contains("exactly one descriptor"),
        "the daemon's log of refused resumes:\n{log}"
    );
}
