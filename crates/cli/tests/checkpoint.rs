//! Issue 15, checkpoint/restart (FTI's model): a real `agora serve` process, a session that
//! protects buffers and checkpoints them as tasks in its queue, the daemon killed with SIGKILL and
//! started again, and a new session of the same application that recovers exactly what the last
//! checkpoint captured, then computes on it. Also: differential checkpoints write less than the
//! protected data when part of it did not change; a damaged newest checkpoint is passed over with
//! a message; refusals (an id not newer, a level without its directory, nothing protected) fail
//! the task with a message that says what to do.

use std::time::Duration;

use agora::{Arg, CheckpointLevel, Error, Session};
use agora_test_support::{eventually, temp_dir, Daemon};

const AGORA: &str = env!("CARGO_BIN_EXE_agora");
/// Elements of the state buffer: 1 MiB of f32, 16 blocks of the 64 KiB default.
const N: usize = 1 << 18;

/// Waits until the daemon has written every captured checkpoint of the session's application.
fn written(session: &Session) -> agora::CheckpointReport {
    let mut last = None;
    assert!(
        eventually(Duration::from_secs(20), || {
            let report = session.checkpoints().expect("checkpoint listing");
            let done = report.writing == 0;
            last = Some(report);
            done
        }),
        "checkpoints still being written: {last:?}"
    );
    last.expect("a report")
}

/// The message of the one failed task in `result` (a `finish()` error).
fn failure(result: Result<(), Error>) -> String {
    match result {
        Ok(()) => panic!("the task should have failed"),
        Err(e) => e.to_string(),
    }
}

#[test]
fn a_checkpointed_application_recovers_exactly_after_the_daemon_is_killed() {
    let dir = temp_dir("checkpoint");
    let partner = dir.path().join("partner");
    std::fs::write(
        dir.path().join("agora.toml"),
        format!("[checkpoint]\npartner = \"{}\"\nkeep = 2\n", partner.display()),
    )
    .unwrap();
    let mut daemon = Daemon::start_in(AGORA, dir, &["--config", "{dir}/agora.toml", "--no-opencl"]);

    let xs: Vec<f32> = (0..N).map(|i| (i % 1000) as f32).collect();
    let expected_after = |iterations: u64| -> Vec<f32> { xs.iter().map(|x| 2.0 * x * iterations as f32).collect() };
    {
        let s = daemon.session_without_resume("solver");
        let saxpy = s.kernel("saxpy").unwrap();
        let q = s.queue("main").unwrap();
        let x = s.buffer_from(&xs).unwrap();
        let y = s.buffer_from(&vec![0f32; N]).unwrap();
        let counter = s.buffer_from(&[0u64]).unwrap();

        // Nothing protected yet: refused, with what to do.
        q.checkpoint(1, CheckpointLevel::Local).unwrap();
        let message = failure(q.finish());
        assert!(message.contains("no buffer is protected"), "{message}");

        s.protect(1, &x).unwrap();
        s.protect(2, &y).unwrap();
        s.protect(3, &counter).unwrap();
        for iteration in 1..=3u64 {
            q.launch(&saxpy, &[Arg::F32(2.0), (&x).into(), (&y).into()], N as u64)
                .unwrap();
            counter.write_slice(&[iteration]).unwrap();
            q.sync_to(&counter).unwrap();
            // Level 2 for the last: also written to the partner directory.
            let level = if iteration == 3 {
                CheckpointLevel::Partner
            } else {
                CheckpointLevel::Local
            };
            q.checkpoint(iteration, level).unwrap();
        }
        // After the last checkpoint: not in it, so recovery must not see it.
        q.launch(&saxpy, &[Arg::F32(2.0), (&x).into(), (&y).into()], N as u64)
            .unwrap();
        q.finish().unwrap();

        let report = written(&s);
        eprintln!("checkpoint writes: {:?}", report.writes);
        let ids: Vec<u64> = report.checkpoints.iter().map(|c| c.checkpoint).collect();
        assert_eq!(ids, vec![2, 3], "the newest two are kept: {report:?}");
        assert_eq!(report.checkpoints[1].level, 2);
        let total = (2 * N * 4 + 8) as u64;
        let second = report
            .writes
            .iter()
            .find(|w| w.checkpoint == 2)
            .expect("checkpoint 2 written");
        assert_eq!(second.bytes_total, total);
        assert!(second.error.is_none(), "{second:?}");
        // x did not change after the first checkpoint: differential checkpoints skip its blocks.
        assert!(
            second.bytes_written <= total - (N * 4) as u64 + 4096,
            "checkpoint 2 wrote {} of {} bytes; x's unchanged blocks should not be written again",
            second.bytes_written,
            total
        );
        assert!(
            std::fs::read_dir(&partner).is_ok_and(|mut d| d.next().is_some()),
            "level 2 wrote nothing to the partner directory"
        );

        // Refusals: an id not newer; level 4 without a shared directory.
        q.checkpoint(3, CheckpointLevel::Local).unwrap();
        let message = failure(q.finish());
        assert!(
            message.contains("not larger than this application's newest"),
            "{message}"
        );
        q.checkpoint(10, CheckpointLevel::Shared).unwrap();
        let message = failure(q.finish());
        assert!(message.contains("level 4 is not available"), "{message}");
    }

    // The daemon dies without warning and comes back: the checkpoints are on disk.
    daemon.restart();
    let s = daemon.session_without_resume("solver");
    let x = s.buffer_from(&vec![0f32; N]).unwrap();
    let y = s.buffer_from(&vec![-1f32; N]).unwrap();
    let counter = s.buffer_from(&[0u64]).unwrap();
    s.protect(1, &x).unwrap();
    s.protect(2, &y).unwrap();
    s.protect(3, &counter).unwrap();
    let report = s.recover().expect("recovery");
    assert_eq!(report.checkpoint, 3);
    assert_eq!(report.restored, vec![1, 2, 3]);
    assert!(report.skipped.is_empty(), "{report:?}");
    assert_eq!(counter.as_slice::<u64>(), &[3]);
    assert_eq!(x.as_slice::<f32>(), &xs[..], "x recovered exactly");
    assert_eq!(
        y.as_slice::<f32>(),
        &expected_after(3)[..],
        "y as of checkpoint 3, exactly"
    );

    // It computes on what it recovered (the host copies are the current ones).
    let saxpy = s.kernel("saxpy").unwrap();
    let q = s.queue("main").unwrap();
    q.launch(&saxpy, &[Arg::F32(2.0), (&x).into(), (&y).into()], N as u64)
        .unwrap();
    q.sync_from(&y).unwrap();
    q.finish().unwrap();
    assert_eq!(
        y.as_slice::<f32>(),
        &expected_after(4)[..],
        "the next iteration is exact"
    );

    // A newer checkpoint whose manifest is damaged is passed over, with a message.
    q.checkpoint(4, CheckpointLevel::Local).unwrap();
    q.finish().unwrap();
    written(&s);
    let uid = rustix::process::getuid().as_raw();
    let manifests = daemon
        .state_dir()
        .join("checkpoints")
        .join(uid.to_string())
        .join("solver")
        .join("manifests");
    let newest = std::fs::read_dir(&manifests)
        .unwrap_or_else(|e| panic!("{}: {e}", manifests.display()))
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|e| e == "json"))
        .max()
        .expect("a manifest");
    let text = std::fs::read(&newest).unwrap();
    std::fs::write(&newest, &text[..text.len() / 2]).unwrap();
    drop(q);
    drop(s);
    let s = daemon.session_without_resume("solver");
    let y = s.buffer_from(&vec![0f32; N]).unwrap();
    let x = s.buffer_from(&vec![0f32; N]).unwrap();
    let counter = s.buffer_from(&[0u64]).unwrap();
    s.protect(1, &x).unwrap();
    s.protect(2, &y).unwrap();
    s.protect(3, &counter).unwrap();
    let report = s.recover().expect("recovery from the previous checkpoint");
    assert_eq!(report.checkpoint, 3, "{report:?}");
    assert!(
        report.skipped.iter().any(|m| m.contains("checkpoint 4")),
        "the damaged checkpoint is named: {report:?}"
    );
    assert_eq!(y.as_slice::<f32>(), &expected_after(3)[..]);

    // A buffer of another size under a protected id: nothing is restored, and the error says why.
    let small = s.buffer_from(&[0f32; 16]).unwrap();
    s.protect(2, &small).unwrap();
    match s.recover() {
        Err(e) => assert!(e.to_string().contains("protected id 2"), "{e}"),
        Ok(report) => panic!("recovered into a buffer of another size: {report:?}"),
    }
    daemon.assert_alive();
}

#[test]
fn a_checkpoint_takes_the_newest_copy_from_the_device_that_holds_it() {
    let mut daemon = Daemon::start(AGORA, "checkpoint-opencl", &[]);
    let s = daemon.session_without_resume("on-opencl");
    agora_test_support::require_opencl(&s);
    let q = s
        .queue_with(agora::QueueOptions {
            name: "gpu-like".into(),
            preferred_device: Some(agora::DeviceKind::OpenCl),
            ..Default::default()
        })
        .unwrap();
    let saxpy = s.kernel("saxpy").unwrap();
    let n = 1 << 16;
    let xs: Vec<f32> = (0..n).map(|i| (i % 100) as f32).collect();
    let x = s.buffer_from(&xs).unwrap();
    let y = s.buffer_from(&vec![1f32; n]).unwrap();
    s.protect(7, &y).unwrap();
    q.sync_to(&x).unwrap();
    q.sync_to(&y).unwrap();
    q.launch(&saxpy, &[Arg::F32(3.0), (&x).into(), (&y).into()], n as u64)
        .unwrap();
    // No sync_from: y's newest contents are on the OpenCL device; the checkpoint fetches them.
    q.checkpoint(1, CheckpointLevel::Erasure).unwrap();
    q.finish().unwrap();
    let device = agora_test_support::last_device(&s, "gpu-like").unwrap_or_default();
    assert!(device.starts_with("opencl"), "the queue ran on {device}");
    written(&s);
    drop(q);
    drop(s);

    let s = daemon.session_without_resume("on-opencl");
    let y = s.buffer_from(&vec![0f32; n]).unwrap();
    s.protect(7, &y).unwrap();
    let report = s.recover().unwrap();
    assert_eq!((report.checkpoint, report.level), (1, 3));
    let want: Vec<f32> = xs.iter().map(|x| 3.0 * x + 1.0).collect();
    assert_eq!(
        y.as_slice::<f32>(),
        &want[..],
        "the device's result, recovered from erasure-coded shards"
    );
    daemon.assert_alive();
}

#[test]
fn snapshots_checkpoint_once_the_configured_interval_has_passed() {
    let dir = temp_dir("checkpoint-snapshot");
    std::fs::write(dir.path().join("agora.toml"), "[checkpoint]\ninterval_s = 0.3\n").unwrap();
    let daemon = Daemon::start_in(AGORA, dir, &["--config", "{dir}/agora.toml", "--no-opencl"]);
    let s = daemon.session_without_resume("snapshots");
    let q = s.queue("main").unwrap();
    let state = s.buffer_from(&[0u64; 8]).unwrap();
    assert!(q.snapshot().unwrap().is_none(), "nothing protected: no clock");
    s.protect(1, &state).unwrap();
    assert!(q.snapshot().unwrap().is_none(), "the interval has not passed yet");
    std::thread::sleep(Duration::from_millis(350));
    let first = q.snapshot().unwrap().expect("a snapshot after the interval");
    assert!(q.snapshot().unwrap().is_none(), "the clock restarts at each snapshot");
    std::thread::sleep(Duration::from_millis(350));
    let second = q.snapshot().unwrap().expect("another after the next interval");
    first.wait().unwrap();
    second.wait().unwrap();
    q.finish().unwrap();
    let report = written(&s);
    assert_eq!(report.checkpoints.len(), 2, "{report:?}");
    assert!(report.checkpoints[0].checkpoint < report.checkpoints[1].checkpoint);
}

/// D3 of the checkpoint audit: snapshot ids were the wall clock in milliseconds, so after one
/// `snapshot()` every later `checkpoint(iteration)` was refused until the snapshot left the store,
/// and the refusal gave neither the newest id nor where it came from.
#[test]
fn snapshots_and_explicit_checkpoint_ids_interleave() {
    let dir = temp_dir("checkpoint-snapmix");
    std::fs::write(dir.path().join("agora.toml"), "[checkpoint]\ninterval_s = 0.05\n").unwrap();
    let daemon = Daemon::start_in(AGORA, dir, &["--config", "{dir}/agora.toml", "--no-opencl"]);
    let s = daemon.session_without_resume("snapmix");
    let q = s.queue("main").unwrap();
    let state = s.buffer_from(&[7u64; 8]).unwrap();
    s.protect(1, &state).unwrap();
    q.checkpoint(1, CheckpointLevel::Local).unwrap();
    let mut snapshot = None;
    assert!(
        eventually(Duration::from_secs(10), || {
            snapshot = q.snapshot().unwrap();
            snapshot.is_some()
        }),
        "no snapshot after the interval"
    );
    q.finish().expect("checkpoint 1 and the snapshot");
    // The snapshot took the id after the newest: 2.
    let report = written(&s);
    let ids: Vec<u64> = report.checkpoints.iter().map(|c| c.checkpoint).collect();
    assert_eq!(ids, vec![1, 2], "{report:?}");
    // An explicit id it took is refused, saying which id is the newest and where it came from.
    q.checkpoint(2, CheckpointLevel::Local).unwrap();
    let message = failure(q.finish());
    assert!(
        message.contains("newest checkpoint, 2, taken by snapshot()"),
        "{message}"
    );
    // The next iteration's explicit checkpoint goes on after the snapshot.
    q.checkpoint(3, CheckpointLevel::Local).unwrap();
    q.finish().expect("an explicit checkpoint after a snapshot");
    let report = written(&s);
    let ids: Vec<u64> = report.checkpoints.iter().map(|c| c.checkpoint).collect();
    assert_eq!(ids, vec![2, 3], "{report:?}");
    assert_eq!(s.recover().unwrap().checkpoint, 3);
}

#[test]
fn a_session_resumed_on_a_restarted_daemon_keeps_its_buffers_protected() {
    let mut daemon = Daemon::start(AGORA, "checkpoint-resume", &["--no-opencl"]);
    let s = daemon.session_named("resumer");
    let q = s.queue("main").unwrap();
    let state = s.buffer_from(&[1u32; 1024]).unwrap();
    s.protect(5, &state).unwrap();
    q.checkpoint(1, CheckpointLevel::Local).unwrap();
    q.finish().unwrap();
    written(&s);
    daemon.restart();
    // The session resumes by itself on its next call (tasks it had issued meanwhile would fail
    // with DaemonRestarted); its protection is sent again.
    let listing = s.checkpoints().expect("the session resumes");
    assert_eq!(listing.checkpoints.len(), 1, "{listing:?}");
    state.write_slice(&[2u32; 1024]).unwrap();
    q.sync_to(&state).unwrap();
    q.checkpoint(2, CheckpointLevel::Local).unwrap();
    q.finish()
        .unwrap_or_else(|e| panic!("the checkpoint after the resume failed: {e}"));
    written(&s);
    drop(q);
    drop(s);
    let fresh = daemon.session_without_resume("resumer");
    let into = fresh.buffer_from(&[0u32; 1024]).unwrap();
    fresh.protect(5, &into).unwrap();
    assert_eq!(fresh.recover().unwrap().checkpoint, 2);
    assert_eq!(into.as_slice::<u32>(), &[2u32; 1024][..]);
}

/// `recover()` writes every protected buffer whole, so it clears what a failed task left behind
/// (audit C-D1): a buffer whose writer failed, and a resumed session's buffers after a daemon
/// restart (their contents were lost with the daemon), are usable at once after it, without a
/// `sync_to`. Before, every later task reading them failed with DependencyFailed, for ever.
#[test]
fn recover_makes_poisoned_buffers_usable_again() {
    let mut daemon = Daemon::start(AGORA, "checkpoint-poison", &["--no-opencl"]);
    let s = daemon.session_named("poisoned");
    let q = s.queue("main").unwrap();
    let saxpy = s.kernel("saxpy").unwrap();
    let x = s.buffer_from(&[1.0f32; 256]).unwrap();
    let state = s.buffer_from(&[3.0f32; 256]).unwrap();
    q.sync_to(&x).unwrap();
    q.sync_to(&state).unwrap();
    s.protect(1, &state).unwrap();
    q.checkpoint(1, CheckpointLevel::Local).unwrap();
    q.finish().unwrap();
    written(&s);
    // A launch over more elements than the buffers hold fails and poisons what it writes.
    q.launch(&saxpy, &[Arg::F32(2.0), (&x).into(), (&state).into()], 1024u64)
        .unwrap();
    assert!(failure(q.finish()).contains("too small"));
    let compute = |q: &agora::Queue| -> Result<Vec<f32>, Error> {
        q.launch(&saxpy, &[Arg::F32(2.0), (&x).into(), (&state).into()], 256u64)?;
        q.sync_from(&state)?;
        q.finish()?;
        Ok(state.read_vec::<f32>())
    };
    assert!(compute(&q).is_err(), "the buffer is poisoned before the recovery");
    assert_eq!(s.recover().unwrap().checkpoint, 1);
    assert_eq!(
        compute(&q).unwrap_or_else(|e| panic!("after recover(): {e}")),
        vec![5.0f32; 256]
    );

    // After a daemon restart the resumed session recovers and computes, no sync_to.
    q.checkpoint(2, CheckpointLevel::Local).unwrap();
    q.finish().unwrap();
    written(&s);
    daemon.restart();
    assert_eq!(s.recover().expect("the session resumes and recovers").checkpoint, 2);
    assert_eq!(
        compute(&q).unwrap_or_else(|e| panic!("after a restart and recover(): {e}")),
        vec![7.0f32; 256]
    );
}

#[test]
fn a_daemon_whose_checkpoint_directory_is_unusable_refuses_checkpoints_and_serves_the_rest() {
    let dir = temp_dir("checkpoint-nostore");
    // Nothing can be created under /proc: the daemon starts without a store.
    std::fs::write(
        dir.path().join("agora.toml"),
        "[checkpoint]\nlocal = \"/proc/agora-checkpoints\"\n",
    )
    .unwrap();
    let mut daemon = Daemon::start_in(AGORA, dir, &["--config", "{dir}/agora.toml", "--no-opencl"]);
    let s = daemon.session_without_resume("nostore");
    let q = s.queue("main").unwrap();
    let b = s.buffer_from(&[1f32; 16]).unwrap();
    s.protect(1, &b).unwrap();
    q.checkpoint(1, CheckpointLevel::Local).unwrap();
    let message = failure(q.finish());
    assert!(message.contains("no checkpoint store"), "{message}");
    let refusal = s.recover().expect_err("no store, nothing to recover");
    assert!(refusal.to_string().contains("no checkpoint store"), "{refusal}");
    // Everything else works.
    agora_test_support::saxpy_ok(&s, 1024);
    daemon.assert_alive();
}

/// D2 of the checkpoint audit: a `shared` directory below a regular file (unusable) used to
/// leave the daemon with no store at all, so level-1 checkpoints were refused too, and the log
/// named the local directory beside an error about `shared`.
#[test]
fn an_unusable_shared_directory_refuses_level_4_naming_it_and_level_1_still_works() {
    let dir = temp_dir("checkpoint-badshared");
    std::fs::write(dir.path().join("afile"), b"not a directory").unwrap();
    let shared = dir.path().join("afile").join("shared");
    std::fs::write(
        dir.path().join("agora.toml"),
        format!("[checkpoint]\nshared = \"{}\"\n", shared.display()),
    )
    .unwrap();
    let log = dir.path().join("daemon.log");
    let log_file = std::fs::File::create(&log).unwrap();
    let mut daemon = Daemon::start_in_with(
        AGORA,
        dir,
        &["--config", "{dir}/agora.toml", "--no-opencl"],
        |command| {
            command.env("AGORA_LOG", "warn").stderr(log_file);
        },
    );
    let s = daemon.session_without_resume("badshared");
    let q = s.queue("main").unwrap();
    let b = s.buffer_from(&[1f32; 16]).unwrap();
    s.protect(1, &b).unwrap();
    // Level 1 works: the store opened without the unusable directory.
    q.checkpoint(1, CheckpointLevel::Local).unwrap();
    q.finish()
        .expect("a level-1 checkpoint despite the unusable shared directory");
    let report = written(&s);
    assert_eq!(
        report.checkpoints.iter().map(|c| c.checkpoint).collect::<Vec<_>>(),
        vec![1],
        "{report:?}"
    );
    // Level 4 is refused naming the key, the directory and why.
    let refusal = q
        .checkpoint(2, CheckpointLevel::Shared)
        .expect_err("level 4 needs the unusable directory")
        .to_string();
    let expected = format!(
        "checkpoint.shared = {} is unusable: Not a directory; fix it and restart the daemon",
        shared.display()
    );
    assert!(refusal.contains(&expected), "{refusal}");
    // The start-up error names the key and the directory it is about.
    let logged = std::fs::read_to_string(&log).unwrap();
    let line = logged
        .lines()
        .find(|l| l.contains("ERROR"))
        .unwrap_or_else(|| panic!("no ERROR line in the log:\n{logged}"));
    assert!(
        line.contains("checkpoint.shared") && line.contains(&shared.display().to_string()),
        "{line}"
    );
    assert!(!line.contains("no checkpoint store"), "{line}");
    daemon.assert_alive();
}

#[test]
fn protecting_more_buffers_than_a_checkpoint_carries_is_refused_with_the_limit() {
    let daemon = Daemon::start(AGORA, "checkpoint-many", &["--no-opencl"]);
    let s = daemon.session_without_resume("many");
    let buffers: Vec<_> = (0..17).map(|_| s.buffer_from(&[0u8; 8]).unwrap()).collect();
    for (id, b) in buffers.iter().take(16).enumerate() {
        s.protect(id as u32, b).unwrap();
    }
    // Protecting an id again replaces its buffer: allowed at the limit.
    s.protect(3, &buffers[16]).unwrap();
    let refusal = s.protect(99, &buffers[16]).expect_err("a 17th id");
    assert!(refusal.to_string().contains("at most 16 buffers"), "{refusal}");
}

/// Run as a child process by the next test: a long sgemm issued as checkpointed row windows.
#[test]
#[ignore = "a helper process of a_long_launch_killed_mid_run_resumes_from_its_last_window, not a test by itself"]
fn checkpointed_sgemm_process() {
    let Ok(socket) = std::env::var("AGORA_TEST_SGEMM_SOCKET") else {
        return;
    };
    let s = Session::connect_with(agora::SessionOptions {
        socket: Some(socket.into()),
        name: Some("partial-sgemm".into()),
        ..Default::default()
    })
    .unwrap();
    let (a, b, c) = sgemm_buffers(&s);
    s.protect(1, &c).unwrap();
    let q = s.queue("sgemm").unwrap();
    let sgemm = s.kernel("sgemm").unwrap();
    println!("sgemm-started");
    q.launch_checkpointed(
        &sgemm,
        &sgemm_args(&a, &b, &c),
        (SGEMM as u64, SGEMM as u64),
        &partial_plan(None),
    )
    .unwrap();
    q.finish().unwrap();
    println!("sgemm-finished");
}

/// The sgemm of the partial-checkpoint test: C = A·B, 1536 × 1536 (about 7 GFLOP: seconds on a
/// CPU lane, so that the process can be killed mid-launch), windows of 16 rows.
const SGEMM: usize = 1536;
const WINDOW: u64 = 16;

fn sgemm_buffers(s: &Session) -> (agora::Buffer, agora::Buffer, agora::Buffer) {
    let a: Vec<f32> = (0..SGEMM * SGEMM).map(|i| ((i * 7) % 13) as f32 * 0.25).collect();
    let b: Vec<f32> = (0..SGEMM * SGEMM).map(|i| ((i * 5) % 11) as f32 * 0.5).collect();
    (
        s.buffer_from(&a).unwrap(),
        s.buffer_from(&b).unwrap(),
        s.buffer_from(&vec![0f32; SGEMM * SGEMM]).unwrap(),
    )
}

fn sgemm_args<'a>(a: &'a agora::Buffer, b: &'a agora::Buffer, c: &'a agora::Buffer) -> [Arg<'a>; 8] {
    let n = SGEMM as i32;
    [
        Arg::I32(n),
        Arg::I32(n),
        Arg::I32(n),
        Arg::F32(1.0),
        a.into(),
        b.into(),
        Arg::F32(0.0),
        c.into(),
    ]
}

fn partial_plan(resume_after: Option<u64>) -> agora::CheckpointedLaunch {
    agora::CheckpointedLaunch {
        window_rows: WINDOW,
        first_checkpoint: 1,
        level: CheckpointLevel::Local,
        resume_after,
    }
}

#[test]
fn a_long_launch_killed_mid_run_resumes_from_its_last_window() {
    use std::io::{BufRead, BufReader};
    let mut daemon = Daemon::start(AGORA, "checkpoint-partial", &["--no-opencl"]);
    let windows = SGEMM as u64 / WINDOW;
    // The reference: the same sgemm launched whole.
    let reference = {
        let s = daemon.session_without_resume("reference");
        let (a, b, c) = sgemm_buffers(&s);
        let q = s.queue("whole").unwrap();
        let sgemm = s.kernel("sgemm").unwrap();
        q.launch(&sgemm, &sgemm_args(&a, &b, &c), (SGEMM as u64, SGEMM as u64))
            .unwrap();
        q.sync_from(&c).unwrap();
        q.finish().unwrap();
        c.read_vec::<f32>()
    };

    let mut child = std::process::Command::new(std::env::current_exe().unwrap())
        .args([
            "--exact",
            "checkpointed_sgemm_process",
            "--ignored",
            "--nocapture",
            "--test-threads=1",
        ])
        .env("AGORA_TEST_SGEMM_SOCKET", daemon.socket())
        .stdout(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
    assert!(lines.any(|l| l.is_ok_and(|l| l.trim_end().ends_with("sgemm-started"))));
    // An observer of the same application sees its checkpoints as they are written.
    let observer = daemon.session_without_resume("partial-sgemm");
    assert!(
        eventually(Duration::from_secs(60), || observer.checkpoints().unwrap().writes.len()
            >= 3),
        "the checkpointed launch wrote no checkpoints"
    );
    child.kill().unwrap();
    child.wait().unwrap();
    drop(observer);

    // A new process of the application: the same inputs, its output protected, recovered.
    let s = daemon.session_without_resume("partial-sgemm");
    let (a, b, c) = sgemm_buffers(&s);
    s.protect(1, &c).unwrap();
    let report = s.recover().unwrap();
    let done = report.checkpoint;
    eprintln!("killed after window {done} of {windows}; resuming from there");
    assert!(
        (1..windows).contains(&done),
        "the launch was not interrupted mid-run (recovered checkpoint {done} of {windows}); the test needs a slower launch"
    );
    // The recovered rows are exactly the finished windows' rows of the result.
    let recovered = c.read_vec::<f32>();
    let finished = done as usize * WINDOW as usize * SGEMM;
    assert_eq!(&recovered[..finished], &reference[..finished]);
    let q = s.queue("resume").unwrap();
    q.sync_to(&c).unwrap();
    let sgemm = s.kernel("sgemm").unwrap();
    q.launch_checkpointed(
        &sgemm,
        &sgemm_args(&a, &b, &c),
        (SGEMM as u64, SGEMM as u64),
        &partial_plan(Some(done)),
    )
    .unwrap();
    q.sync_from(&c).unwrap();
    q.finish().unwrap();
    assert_eq!(c.read_vec::<f32>(), reference, "the resumed launch's result differs");
    // The resumed launch ran only the windows after the recovered one: its checkpoints are
    // done + 1 ..= windows, the last one being the last window's.
    let newest = written(&s).checkpoints.last().map(|c| c.checkpoint);
    assert_eq!(newest, Some(windows));

    // Windows the daemon refuses, with the reason.
    let bad = |rows: std::ops::Range<u64>| match q.launch_rows(
        &sgemm,
        &sgemm_args(&a, &b, &c),
        (SGEMM as u64, SGEMM as u64),
        rows,
    ) {
        Err(e) => e.to_string(),
        Ok(_) => failure(q.finish()),
    };
    let message = bad(1500..1600);
    assert!(message.contains("inside the launch's first dimension"), "{message}");
    daemon.assert_alive();
}

#[test]
fn the_daemon_killed_in_the_middle_of_a_write_leaves_the_previous_checkpoint_valid() {
    let uid = rustix::process::getuid().as_raw();
    let dir = temp_dir("checkpoint-midwrite");
    // Every write pauses 3 s between its data and its manifest: long enough to kill it there.
    let mut daemon = Daemon::start_in_with(AGORA, dir, &["--no-opencl"], |command| {
        command.env("AGORA_TEST_CHECKPOINT_PAUSE_MS", "3000");
    });
    let first: Vec<f32> = (0..N).map(|i| i as f32).collect();
    let app_dir = daemon
        .state_dir()
        .join("checkpoints")
        .join(uid.to_string())
        .join("midwrite");
    let block_count = || std::fs::read_dir(app_dir.join("blocks")).map_or(0, |d| d.count());
    let blocks_before;
    {
        let s = daemon.session_without_resume("midwrite");
        let q = s.queue("q").unwrap();
        let state = s.buffer_from(&first).unwrap();
        s.protect(1, &state).unwrap();
        q.checkpoint(1, CheckpointLevel::Local).unwrap();
        q.finish().unwrap();
        written(&s);
        blocks_before = block_count();
        // The second checkpoint's blocks reach the disk, its manifest never does.
        state.write_slice(&vec![-1f32; N]).unwrap();
        q.sync_to(&state).unwrap();
        q.checkpoint(2, CheckpointLevel::Local).unwrap();
        q.finish().unwrap();
    }
    // Killed while checkpoint 2's blocks are on disk and its manifest is not (the listing
    // would wait for the write, so the files tell).
    assert!(
        eventually(Duration::from_secs(2), || block_count() > blocks_before),
        "checkpoint 2's data never reached {}",
        app_dir.display()
    );
    let manifests = std::fs::read_dir(app_dir.join("manifests")).unwrap().count();
    assert_eq!(manifests, 1, "only checkpoint 1 is complete when the daemon dies");
    daemon.restart(); // SIGKILL, then a daemon without the pause
    let s = daemon.session_without_resume("midwrite");
    let state = s.buffer(N as u64 * 4).unwrap();
    s.protect(1, &state).unwrap();
    let report = s.recover().unwrap();
    assert_eq!(report.checkpoint, 1, "the half-written checkpoint does not exist");
    assert_eq!(
        state.read_vec::<f32>(),
        first,
        "the previous checkpoint recovers exactly"
    );
    // And the application continues its ids after the one it recovered.
    let q = s.queue("q").unwrap();
    q.checkpoint(2, CheckpointLevel::Local).unwrap();
    q.finish().unwrap();
    let report = written(&s);
    assert!(report.writes.iter().all(|w| w.error.is_none()), "{report:?}");
    assert_eq!(report.checkpoints.last().map(|c| c.checkpoint), Some(2));
    daemon.assert_alive();
}

#[test]
fn a_users_checkpoints_past_the_quota_are_refused_and_the_earlier_ones_kept() {
    let dir = temp_dir("checkpoint-quota");
    std::fs::write(
        dir.path().join("agora.toml"),
        "[checkpoint]\nquota_per_user = \"1536K\"\nkeep = 4\n",
    )
    .unwrap();
    let mut daemon = Daemon::start_in(AGORA, dir, &["--config", "{dir}/agora.toml", "--no-opencl"]);
    let s = daemon.session_without_resume("quota");
    let q = s.queue("q").unwrap();
    // 1 MiB fits the 1.5 MiB quota; a second, different 1 MiB does not.
    let state = s.buffer_from(&(0..N).map(|i| i as f32).collect::<Vec<_>>()).unwrap();
    s.protect(1, &state).unwrap();
    q.checkpoint(1, CheckpointLevel::Local).unwrap();
    q.finish().unwrap();
    state
        .write_slice(&(0..N).map(|i| -(i as f32)).collect::<Vec<_>>())
        .unwrap();
    q.sync_to(&state).unwrap();
    q.checkpoint(2, CheckpointLevel::Local).unwrap();
    q.finish().unwrap();
    let report = written(&s);
    let refused = report
        .writes
        .iter()
        .find(|w| w.checkpoint == 2)
        .expect("the second write");
    let message = refused.error.clone().expect("refused");
    assert!(
        message.contains("over the quota")
            && message.contains("quota_per_user")
            && message.contains("earlier checkpoints are intact"),
        "{message}"
    );
    assert_eq!(report.checkpoints.last().map(|c| c.checkpoint), Some(1));
    let fresh = daemon.session_without_resume("quota");
    let back = fresh.buffer(N as u64 * 4).unwrap();
    fresh.protect(1, &back).unwrap();
    assert_eq!(fresh.recover().unwrap().checkpoint, 1);
    assert_eq!(back.read_vec::<f32>(), (0..N).map(|i| i as f32).collect::<Vec<_>>());
    daemon.assert_alive();
}

/// D9 of the checkpoint audit: the quota had to hold `keep` + 1 checkpoints: with `keep` 2 and
/// 1 MiB of state changing every time, a 3 MiB quota refused checkpoint 3 and every later one,
/// though retention would have brought the total back to 2 MiB.
#[test]
fn the_quota_counts_what_retention_deletes_after_the_write() {
    let dir = temp_dir("checkpoint-quota-keep");
    std::fs::write(
        dir.path().join("agora.toml"),
        "[checkpoint]\nquota_per_user = \"3M\"\nkeep = 2\n",
    )
    .unwrap();
    let daemon = Daemon::start_in(AGORA, dir, &["--config", "{dir}/agora.toml", "--no-opencl"]);
    let s = daemon.session_without_resume("quota-keep");
    let q = s.queue("q").unwrap();
    let state = s.buffer(N as u64 * 4).unwrap();
    s.protect(1, &state).unwrap();
    for id in 1..=4u64 {
        state
            .write_slice(&(0..N).map(|i| (i as u64 * id) as f32).collect::<Vec<_>>())
            .unwrap();
        q.sync_to(&state).unwrap();
        q.checkpoint(id, CheckpointLevel::Local).unwrap();
        q.finish().unwrap();
        written(&s);
    }
    let report = written(&s);
    let failed: Vec<_> = report.writes.iter().filter(|w| w.error.is_some()).collect();
    assert!(failed.is_empty(), "{failed:?}");
    let ids: Vec<u64> = report.checkpoints.iter().map(|c| c.checkpoint).collect();
    assert_eq!(ids, vec![3, 4], "{report:?}");
}

#[test]
fn after_recovery_passes_over_a_damaged_checkpoint_its_id_is_free_and_a_taken_id_fails_the_task() {
    let mut daemon = Daemon::start(AGORA, "checkpoint-damaged-id", &["--no-opencl"]);
    let manifest6 = daemon.state_dir().join(format!(
        "checkpoints/{}/damaged-id/manifests/{:020}.json",
        rustix::process::getuid().as_raw(),
        6
    ));
    let data: Vec<f32> = (0..N).map(|i| i as f32).collect();
    {
        let s = daemon.session_without_resume("damaged-id");
        let q = s.queue("main").unwrap();
        let x = s.buffer_from(&data).unwrap();
        s.protect(1, &x).unwrap();
        for id in [3, 6] {
            q.checkpoint(id, CheckpointLevel::Local).unwrap();
        }
        q.finish().unwrap();
        written(&s);
    }
    // The newest checkpoint damaged (its manifest truncated), as in the operators' audit.
    std::fs::OpenOptions::new()
        .write(true)
        .open(&manifest6)
        .unwrap()
        .set_len(20)
        .unwrap();
    // A new daemon knows the application's ids from its files only.
    daemon.restart();

    // Without a recovery, id 6 is still taken: the checkpoint task fails, and says why (it used
    // to be accepted, then refused by the writer, in the daemon's log only).
    {
        let s = daemon.session_without_resume("damaged-id");
        let q = s.queue("main").unwrap();
        let x = s.buffer_from(&data).unwrap();
        s.protect(1, &x).unwrap();
        q.checkpoint(6, CheckpointLevel::Local).unwrap();
        let message = failure(q.finish());
        assert!(message.contains("not larger"), "{message}");
    }

    // A recovery passes over 6 and uses 3; the run goes on with 6, which is written.
    let s = daemon.session_without_resume("damaged-id");
    let q = s.queue("main").unwrap();
    let x = s.buffer_from(&vec![0f32; N]).unwrap();
    s.protect(1, &x).unwrap();
    let recovered = s.recover().unwrap();
    assert_eq!(recovered.checkpoint, 3, "{recovered:?}");
    assert!(
        recovered
            .skipped
            .iter()
            .any(|m| m.contains("checkpoint 6") && m.contains("set aside")),
        "{recovered:?}"
    );
    q.checkpoint(6, CheckpointLevel::Local).unwrap();
    q.finish().unwrap();
    let report = written(&s);
    let write = report
        .writes
        .iter()
        .find(|w| w.checkpoint == 6)
        .expect("the write of 6");
    assert_eq!(write.error, None, "{report:?}");
    assert!(report.checkpoints.iter().any(|c| c.checkpoint == 6), "{report:?}");
}

/// Two live sessions of one user under one name (the ranks of an MPI program, two jobs of one
/// program) would share one checkpoint stream, and a restarted one would recover the other's
/// data. The second writer's checkpoint is refused, saying so and how to name each process
/// (not "use increasing ids": its ids do increase); a session of another name, and the second
/// session once the first has ended, checkpoint as usual.
#[test]
fn a_second_live_session_of_one_application_is_refused_its_checkpoints_with_the_reason() {
    let daemon = Daemon::start(AGORA, "checkpoint-collision", &["--no-opencl"]);
    let data: Vec<f32> = (0..N).map(|i| i as f32).collect();
    let first = daemon.session_without_resume("collide");
    let first_queue = first.queue("main").unwrap();
    let first_x = first.buffer_from(&data).unwrap();
    first.protect(1, &first_x).unwrap();
    first_queue.checkpoint(2, CheckpointLevel::Local).unwrap();
    first_queue.finish().unwrap();

    let second = daemon.session_without_resume("collide");
    let q = second.queue("main").unwrap();
    let x = second.buffer_from(&data).unwrap();
    second.protect(1, &x).unwrap();
    q.checkpoint(4, CheckpointLevel::Local).unwrap();
    let message = failure(q.finish());
    let pid = std::process::id();
    for needed in [
        format!("another live session (pid {pid})"),
        "SessionOptions::name".into(),
        "agora.Session(name=...)".into(),
        "AgoraSessionOptions.name".into(),
    ] {
        assert!(message.contains(&needed), "{needed}: {message}");
    }
    assert!(!message.contains("increasing ids"), "{message}");
    // The first one's stream goes on.
    first_queue.checkpoint(6, CheckpointLevel::Local).unwrap();
    first_queue.finish().unwrap();

    // A name of its own: its own stream.
    let other = daemon.session_without_resume("collide.rank1");
    let oq = other.queue("main").unwrap();
    let ox = other.buffer_from(&data).unwrap();
    other.protect(1, &ox).unwrap();
    oq.checkpoint(1, CheckpointLevel::Local).unwrap();
    oq.finish().unwrap();

    // The first ends: the name is free for the second.
    written(&first);
    drop((first_queue, first_x, first));
    let mut last = String::new();
    let mut id = 7;
    assert!(
        eventually(Duration::from_secs(10), || {
            id += 1;
            q.checkpoint(id, CheckpointLevel::Local).unwrap();
            match q.finish() {
                Ok(()) => true,
                Err(e) => {
                    last = e.to_string();
                    false
                }
            }
        }),
        "the second session still refused once the first ended: {last}"
    );
    assert_eq!(written(&second).checkpoints.last().map(|c| c.checkpoint), Some(id));
}

/// Checkpoint ids start at 1 (status calls report 0 for "none"): 0 is refused when it is
/// issued, with what to use instead, and nothing is issued.
#[test]
fn a_checkpoint_with_id_zero_is_refused_when_issued() {
    let daemon = Daemon::start(AGORA, "checkpoint-zero", &["--no-opencl"]);
    let s = daemon.session_without_resume("zero");
    let q = s.queue("main").unwrap();
    let x = s.buffer_from(&[1f32; 16]).unwrap();
    s.protect(1, &x).unwrap();
    let error = q.checkpoint(0, CheckpointLevel::Local).unwrap_err();
    assert!(
        matches!(
            error,
            Error::Task(agora::TaskError::CheckpointRefused {
                reason: agora_protocol::completion::CHECKPOINT_ID_ZERO,
                ..
            })
        ),
        "{error:?}"
    );
    assert!(error.to_string().contains("ids start at 1"), "{error}");
    let plan = agora::CheckpointedLaunch {
        window_rows: 4,
        first_checkpoint: 0,
        level: CheckpointLevel::Local,
        resume_after: None,
    };
    let fill = s.kernel("saxpy").unwrap();
    let error = q
        .launch_checkpointed(&fill, &[Arg::F32(1.0), (&x).into(), (&x).into()], 16u64, &plan)
        .unwrap_err();
    assert!(error.to_string().contains("ids start at 1"), "{error}");
    q.finish().unwrap();
    assert!(written(&s).checkpoints.is_empty(), "nothing was issued");
    q.checkpoint(1, CheckpointLevel::Local).unwrap();
    q.finish().unwrap();
    assert_eq!(written(&s).checkpoints.last().map(|c| c.checkpoint), Some(1));
}

/// SRE audit, defect 3: four checkpoints of 128 MiB got a daemon in a 384 MiB cgroup
/// OOM-killed: each capture holds a copy of its buffers until the writer is done, and only the
/// captures of one application were bounded (four at once), not all of them together. Now
/// `[checkpoint] capture_memory` bounds them all: with room for one 1 MiB capture, two
/// applications' four checkpoints are held one at a time while the (slowed) writer works, each
/// is written whole, and a third tenant's work meanwhile is not held up.
#[test]
fn captures_of_all_applications_together_stay_within_the_capture_memory() {
    let dir = temp_dir("checkpoint-capture-memory");
    std::fs::write(
        dir.path().join("agora.toml"),
        "[checkpoint]\ncapture_memory = \"1536K\"\nkeep = 4\n",
    )
    .unwrap();
    let mut daemon = Daemon::start_in_with(
        AGORA,
        dir,
        &["--config", "{dir}/agora.toml", "--no-opencl"],
        |command| {
            command.env("AGORA_TEST_CHECKPOINT_PAUSE_MS", "700");
        },
    );
    let sessions: Vec<Session> = ["capture-a", "capture-b"]
        .into_iter()
        .map(|name| daemon.session_without_resume(name))
        .collect();
    let mut queues = Vec::new();
    let mut states = Vec::new();
    for (k, s) in sessions.iter().enumerate() {
        let q = s.queue("q").unwrap();
        let state = s.buffer_from(&vec![k as f32; N]).unwrap();
        s.protect(1, &state).unwrap();
        q.checkpoint(1, CheckpointLevel::Local).unwrap();
        q.checkpoint(2, CheckpointLevel::Local).unwrap();
        queues.push(q);
        states.push(state);
    }
    // Another tenant computes meanwhile: checkpoints waiting for capture memory hold up their own
    // queues, not the dispatcher.
    let other = daemon.session_without_resume("capture-other");
    let oq = other.queue("work").unwrap();
    let x = other.buffer_from(&vec![1f32; 1024]).unwrap();
    let y = other.buffer_from(&vec![0f32; 1024]).unwrap();
    let saxpy = other.kernel("saxpy").unwrap();
    let started = std::time::Instant::now();
    oq.launch(&saxpy, &[Arg::F32(2.0), (&x).into(), (&y).into()], 1024u64)
        .unwrap();
    oq.finish().unwrap();
    let other_took = started.elapsed();
    // Sampled while the four captures go through: never more than one held at a time.
    let mut most_held = 0;
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    loop {
        let reports: Vec<_> = sessions.iter().map(|s| s.checkpoints().unwrap()).collect();
        most_held = most_held.max(reports.iter().map(|r| r.writing).sum::<u32>());
        let done = reports
            .iter()
            .all(|r| r.writing == 0 && r.checkpoints.iter().any(|c| c.checkpoint == 2));
        if done || std::time::Instant::now() > deadline {
            break;
        }
        std::thread::sleep(Duration::from_millis(40));
    }
    assert_eq!(
        most_held, 1,
        "captures held at once, all applications together (1 MiB each, 1.5 MiB allowed)"
    );
    for (q, s) in queues.iter().zip(&sessions) {
        q.finish().unwrap();
        let report = written(s);
        assert!(report.writes.iter().all(|w| w.error.is_none()), "{report:?}");
        let ids: Vec<u64> = report.checkpoints.iter().map(|c| c.checkpoint).collect();
        assert_eq!(ids, vec![1, 2], "both checkpoints written: {report:?}");
    }
    assert!(
        other_took < Duration::from_millis(1500),
        "another tenant's task waited {other_took:?} behind the checkpoints"
    );
    daemon.assert_alive();
}
