//! Issue 15, export and attach (XEMEM's model): a real `agora serve` process; an exporting
//! session publishes a buffer by name, another session (in another process where the test is
//! about a process ending) attaches it and sees the same memory without a copy, uses it as a
//! kernel argument, and is refused what its attachment does not allow. Revoking the export, the
//! exporter's process being killed, and the attacher ending each have the behaviour the docs
//! promise: the attacher's tasks on it fail with a message, its mapping stays readable, nothing
//! dangles. Also the coherence rule with an OpenCL device, and `agora exports`.

use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};
use std::time::Duration;

use agora::{Arg, Error, ExportReaders, Session, TaskError};
use agora_test_support::{eventually, Daemon};

const AGORA: &str = env!("CARGO_BIN_EXE_agora");
const N: usize = 1 << 16;

/// The message of a failed `finish()`.
fn failure(result: Result<(), Error>) -> String {
    match result {
        Ok(()) => panic!("the task should have failed"),
        Err(e) => e.to_string(),
    }
}

fn attachment_reason(result: Result<(), Error>) -> u16 {
    match result {
        Err(Error::Tasks(failures)) => match failures.first() {
            Some((_, TaskError::Attachment { reason, .. })) => *reason,
            other => panic!("expected an attachment error, got {other:?}"),
        },
        Err(Error::Task(TaskError::Attachment { reason, .. })) => reason,
        other => panic!("expected an attachment error, got {other:?}"),
    }
}

#[test]
fn an_attached_buffer_is_the_exporters_memory_and_a_kernel_argument() {
    let mut daemon = Daemon::start(AGORA, "exports-basic", &["--no-opencl"]);
    let exporter = daemon.session_without_resume("simulation");
    let attacher = daemon.session_without_resume("analytics");

    let state = exporter.shared_buffer((N * 4) as u64).unwrap();
    assert!(state.is_shared() && state.is_writable());
    let xs: Vec<f32> = (0..N).map(|i| i as f32).collect();
    state.write_slice(&xs).unwrap();
    exporter
        .export(&state, "sim/state", &ExportReaders::default(), false)
        .unwrap();

    let view = attacher.attach("sim/state", false).unwrap();
    assert_eq!(view.len(), (N * 4) as u64);
    assert!(!view.is_writable());
    assert_eq!(
        view.as_slice::<f32>(),
        &xs[..],
        "the attacher sees the exporter's bytes"
    );
    // Zero-copy: a later host write by the exporter shows at once, with no call in between.
    state.write(0, &42f32.to_le_bytes()).unwrap();
    assert_eq!(view.as_slice::<f32>()[0], 42.0);
    // The attacher cannot write its read-only view, neither through the library...
    assert!(matches!(view.write(0, &[1, 2, 3, 4]), Err(Error::ReadOnly)));

    // ...nor through a task: reading it is fine, writing it is refused with the reason.
    let q = attacher.queue("analytics").unwrap();
    let saxpy = attacher.kernel("saxpy").unwrap();
    let own = attacher.buffer_from(&vec![1f32; N]).unwrap();
    q.launch(&saxpy, &[Arg::F32(2.0), (&view).into(), (&own).into()], N as u64)
        .unwrap();
    q.sync_from(&own).unwrap();
    q.finish().unwrap();
    let result = own.read_vec::<f32>();
    assert_eq!(result[0], 2.0 * 42.0 + 1.0);
    assert_eq!(result[N - 1], 2.0 * (N - 1) as f32 + 1.0);
    q.launch(&saxpy, &[Arg::F32(2.0), (&own).into(), (&view).into()], N as u64)
        .unwrap();
    let message = failure(q.finish());
    assert!(message.contains("attached read-only"), "{message}");
    q.memset(&view, 0).unwrap();
    assert_eq!(
        attachment_reason(q.finish()),
        agora_protocol::completion::ATTACHMENT_READ_ONLY
    );
    // Nor through a recovery: a read-only attachment cannot be protected.
    let message = attacher.protect(1, &view).unwrap_err().to_string();
    assert!(message.contains("attached read-only"), "{message}");

    // The listing names it, its size, its attacher.
    let listed = attacher.exports().unwrap();
    let entry = listed.iter().find(|e| e.name == "sim/state").expect("listed");
    assert_eq!(entry.len, (N * 4) as u64);
    assert!(!entry.writable);
    assert_eq!(entry.client, "simulation");
    assert_eq!(entry.attaches, 1);
    assert_eq!(entry.attachers.len(), 1);
    let cli = daemon.agora(&["exports", "--json"]);
    assert!(cli.status.success(), "{}", String::from_utf8_lossy(&cli.stderr));
    let json: serde_json::Value = serde_json::from_slice(&cli.stdout).unwrap();
    assert_eq!(json[0]["name"], "sim/state", "{json}");
    // A long name widens its column: every row's session number ends under the header's.
    let long_name = "simulation/checkpointed/state/of/step/1000";
    let long = exporter.shared_buffer(64).unwrap();
    exporter
        .export(&long, long_name, &ExportReaders::default(), false)
        .unwrap();
    let table = daemon.agora(&["exports"]);
    let table = String::from_utf8_lossy(&table.stdout);
    assert!(
        table.contains("sim/state") && table.contains("simulation") && table.contains(long_name),
        "{table}"
    );
    let mut lines = table.lines();
    let header = lines.next().unwrap();
    let column_end = header.find("session").unwrap() + "session".len();
    for row in lines {
        let end = row.find('#').unwrap() + row[row.find('#').unwrap()..].find(' ').unwrap();
        assert_eq!(end, column_end, "columns aligned:\n{table}");
    }
    exporter.revoke(long_name).unwrap();

    // The attacher ends: the export stays, with no attacher.
    drop(q);
    drop(own);
    drop(view);
    drop(attacher);
    assert!(eventually(Duration::from_secs(5), || {
        exporter
            .exports()
            .unwrap()
            .iter()
            .any(|e| e.name == "sim/state" && e.attachers.is_empty())
    }));
    daemon.assert_alive();
}

#[test]
fn bad_exports_and_attaches_are_refused_with_what_to_do() {
    let mut daemon = Daemon::start(AGORA, "exports-refusals", &["--no-opencl"]);
    let a = daemon.session_without_resume("a");
    let b = daemon.session_without_resume("b");
    let readers = ExportReaders::default();

    let refused = |result: Result<agora::Buffer, Error>| match result {
        Ok(_) => panic!("the attach should have been refused"),
        Err(e) => e.to_string(),
    };
    let message = refused(b.attach("nobody/exports/this", false));
    assert!(message.contains("no export named 'nobody/exports/this'"), "{message}");

    // A heap buffer cannot be exported: the message says how to allocate one that can.
    let heap = a.buffer(64).unwrap();
    let message = a.export(&heap, "heap", &readers, false).unwrap_err().to_string();
    assert!(message.contains("shared_buffer"), "{message}");

    let one = a.shared_buffer(64).unwrap();
    let two = a.shared_buffer(64).unwrap();
    a.export(&one, "taken", &readers, false).unwrap();
    let message = a.export(&two, "taken", &readers, false).unwrap_err().to_string();
    assert!(message.contains("the name 'taken' is taken"), "{message}");
    let message = a.export(&one, "again", &readers, false).unwrap_err().to_string();
    assert!(message.contains("already exported as 'taken'"), "{message}");
    let message = a.export(&two, "bad name", &readers, false).unwrap_err().to_string();
    assert!(message.contains("whitespace"), "{message}");

    // Read-only exports cannot be attached writable, and stay read-only for good.
    let message = refused(b.attach("taken", true));
    assert!(message.contains("exported read-only"), "{message}");
    a.revoke("taken").unwrap();
    let message = a.export(&one, "now-writable", &readers, true).unwrap_err().to_string();
    assert!(message.contains("sealed against new writers"), "{message}");

    // An attachment cannot be exported again by the attacher.
    a.export(&two, "writable", &readers, true).unwrap();
    let attached = b.attach("writable", true).unwrap();
    assert!(attached.is_writable());
    let message = b
        .export(&attached, "laundered", &readers, true)
        .unwrap_err()
        .to_string();
    assert!(message.contains("only its exporter"), "{message}");
    // A writable attachment writes the exporter's memory.
    attached.write(0, b"hi").unwrap();
    assert_eq!(&two.read()[..2], b"hi");

    // Revoking a name nobody exported.
    let message = b.revoke("never").unwrap_err().to_string();
    assert!(message.contains("no export named 'never'"), "{message}");

    // The shared-memory limit (the heap quota again) refuses with the numbers.
    let message = match a.shared_buffer(1 << 40) {
        Ok(_) => panic!("a 1 TiB exportable buffer was granted"),
        Err(e) => e.to_string(),
    };
    assert!(message.contains("its limit is"), "{message}");
    daemon.assert_alive();
}

#[test]
fn a_revoked_export_fails_the_attachers_tasks_and_leaves_its_memory_readable() {
    let mut daemon = Daemon::start(AGORA, "exports-revoke", &["--no-opencl"]);
    let exporter = daemon.session_without_resume("exporter");
    let attacher = daemon.session_without_resume("attacher");
    let state = exporter.shared_buffer(4 * 1024).unwrap();
    state.write_slice(&[7u32; 1024]).unwrap();
    exporter
        .export(&state, "revoke-me", &ExportReaders::default(), false)
        .unwrap();
    let view = attacher.attach("revoke-me", false).unwrap();
    let copy = attacher.buffer(4 * 1024).unwrap();
    let q = attacher.queue("q").unwrap();
    q.copy(&view, 0, &copy, 0, 0).unwrap();
    q.finish().unwrap();

    let attachers = exporter.revoke("revoke-me").unwrap();
    assert_eq!(attachers.len(), 1, "the revoke reports the attached session");
    q.copy(&view, 0, &copy, 0, 0).unwrap();
    assert_eq!(
        attachment_reason(q.finish()),
        agora_protocol::completion::ATTACHMENT_REVOKED
    );
    // The mapping stays valid: no dangling memory in the attacher.
    assert_eq!(view.read_vec::<u32>(), vec![7u32; 1024]);
    let message = match attacher.attach("revoke-me", false) {
        Ok(_) => panic!("attached a revoked name"),
        Err(e) => e.to_string(),
    };
    assert!(message.contains("no export named"), "{message}");
    // The exporter's buffer is still its own to use.
    let eq = exporter.queue("e").unwrap();
    eq.memset(&state, 1).unwrap();
    eq.finish().unwrap();

    // Releasing an exported buffer ends its export too.
    let other = exporter.shared_buffer(64).unwrap();
    exporter
        .export(&other, "released", &ExportReaders::default(), false)
        .unwrap();
    let view2 = attacher.attach("released", false).unwrap();
    drop(other);
    assert!(eventually(Duration::from_secs(5), || {
        attacher.exports().unwrap().iter().all(|e| e.name != "released")
    }));
    q.sync_from(&view2).unwrap();
    assert_eq!(
        attachment_reason(q.finish()),
        agora_protocol::completion::ATTACHMENT_REVOKED
    );
    daemon.assert_alive();
}

/// Run as a child process by the next test: exports a buffer, prints `ready`, and waits to be
/// killed.
#[test]
#[ignore = "a helper process of exporter_killed_..., not a test by itself"]
fn exporter_process() {
    let Ok(socket) = std::env::var("AGORA_TEST_EXPORTER_SOCKET") else {
        return;
    };
    let session = Session::connect_with(agora::SessionOptions {
        socket: Some(socket.into()),
        name: Some("doomed-exporter".into()),
        ..Default::default()
    })
    .unwrap();
    let state = session.shared_buffer(4 * N as u64).unwrap();
    state.write_slice(&vec![3.5f32; N]).unwrap();
    session
        .export(&state, "doomed", &ExportReaders::default(), false)
        .unwrap();
    println!("exporter-ready");
    std::thread::sleep(Duration::from_secs(120));
}

#[test]
fn exporter_killed_withdraws_its_export_and_the_attacher_keeps_a_readable_copy() {
    let mut daemon = Daemon::start(AGORA, "exports-killed", &["--no-opencl"]);
    let mut child = Command::new(std::env::current_exe().unwrap())
        .args([
            "--exact",
            "exporter_process",
            "--ignored",
            "--nocapture",
            "--test-threads=1",
        ])
        .env("AGORA_TEST_EXPORTER_SOCKET", daemon.socket())
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
    assert!(
        lines.any(|l| l.is_ok_and(|l| l.trim_end().ends_with("exporter-ready"))),
        "the exporter process did not start"
    );
    let attacher = daemon.session_without_resume("survivor");
    let view = attacher.attach("doomed", false).unwrap();
    assert_eq!(view.as_slice::<f32>()[N - 1], 3.5);

    child.kill().unwrap();
    child.wait().unwrap();
    assert!(
        eventually(Duration::from_secs(10), || attacher.exports().unwrap().is_empty()),
        "the export outlived its exporter"
    );
    let q = attacher.queue("q").unwrap();
    let own = attacher.buffer(4 * N as u64).unwrap();
    q.copy(&view, 0, &own, 0, 0).unwrap();
    assert_eq!(
        attachment_reason(q.finish()),
        agora_protocol::completion::ATTACHMENT_REVOKED
    );
    // The memory outlives the exporter's process for as long as the attacher maps it.
    assert!(view.as_slice::<f32>().iter().all(|&v| v == 3.5));
    drop(view);
    daemon.assert_alive();
}

#[test]
fn an_attacher_reads_device_results_through_the_shared_placement() {
    let mut daemon = Daemon::start(AGORA, "exports-opencl", &[]);
    let exporter = daemon.session_without_resume("producer");
    agora_test_support::require_opencl(&exporter);
    let attacher = daemon.session_without_resume("consumer");
    let device_queue = exporter
        .queue_with(agora::QueueOptions {
            name: "on-opencl".into(),
            preferred_device: Some(agora::DeviceKind::OpenCl),
            ..Default::default()
        })
        .unwrap();
    let saxpy = exporter.kernel("saxpy").unwrap();
    let x = exporter.buffer_from(&vec![1f32; N]).unwrap();
    let y = exporter.shared_buffer((N * 4) as u64).unwrap();
    exporter
        .export(&y, "device-results", &ExportReaders::default(), false)
        .unwrap();
    device_queue.sync_to(&x).unwrap();
    device_queue.sync_to(&y).unwrap();
    device_queue
        .launch(&saxpy, &[Arg::F32(5.0), (&x).into(), (&y).into()], N as u64)
        .unwrap();
    device_queue.finish().unwrap();
    let device = agora_test_support::last_device(&exporter, "on-opencl").unwrap_or_default();
    assert!(device.starts_with("opencl"), "the producer ran on {device}");

    let view = attacher.attach("device-results", false).unwrap();
    // The rule: the host copy shows a device's results after a sync_from (before it, it may
    // hold older bytes), which the attacher may do itself: it moves data, it does not write
    // the contents, so a read-only attachment may...
    let q = attacher.queue("consumer").unwrap();
    q.sync_from(&view).unwrap();
    q.finish().unwrap();
    assert!(view.as_slice::<f32>().iter().all(|&v| v == 5.0));
    // ...and a task of the attacher that reads it gets the newest contents wherever it runs.
    let own = attacher.buffer(4 * N as u64).unwrap();
    q.copy(&view, 0, &own, 0, 0).unwrap();
    q.sync_from(&own).unwrap();
    q.finish().unwrap();
    assert!(own.read_vec::<f32>().iter().all(|&v| v == 5.0));
    daemon.assert_alive();
}

/// A shared buffer's memory outlives its daemon (the region stays mapped), and writing it asks
/// the daemon for the host copy in case another session's results are on a device. With the
/// daemon killed (a session that does not resume) or restarted (a resumed session: the new
/// daemon does not know shared buffers) there is nothing left to claim from: the write lands,
/// at once, as it did before claims existed.
#[test]
fn a_shared_buffer_is_still_written_after_its_daemon_died_or_restarted() {
    let mut daemon = Daemon::start(AGORA, "exports-daemon-gone", &["--no-opencl"]);
    let resumed = daemon.session_named("resumed");
    let alone = daemon.session_without_resume("alone");
    let a = resumed.shared_buffer(64).unwrap();
    let b = alone.shared_buffer(64).unwrap();
    a.write_slice(&[1u32; 16]).unwrap();
    b.write_slice(&[2u32; 16]).unwrap();
    daemon.restart();
    let began = std::time::Instant::now();
    b.write_slice(&[9u32; 16])
        .expect("a write to a shared buffer of a session whose daemon died");
    assert!(
        began.elapsed() < Duration::from_secs(2),
        "the write waited {:?}",
        began.elapsed()
    );
    assert_eq!(b.read_vec::<u32>(), vec![9u32; 16]);
    a.write_slice(&[7u32; 16])
        .expect("a write to a shared buffer the restarted daemon does not know");
    assert_eq!(a.read_vec::<u32>(), vec![7u32; 16]);
    agora_test_support::saxpy_ok(&resumed, 64);
}

/// D8 of the export audit: after a daemon restart an exportable buffer's handle in the resumed
/// session gave "invalid buffer handle … (released, never allocated, or from another session)"
/// and its export again "no buffer with handle …", saying neither what happened nor what to
/// do; the attacher's buffer likewise.
#[test]
fn exportable_and_attached_buffers_after_a_daemon_restart_say_they_are_not_kept_and_what_to_do() {
    let mut daemon = Daemon::start(AGORA, "exports-restart-lost", &["--no-opencl"]);
    let exporter = daemon.session_named("exporter");
    let attacher = daemon.session_named("attacher");
    let state = exporter.shared_buffer(64).unwrap();
    exporter
        .export(&state, "restart/state", &ExportReaders::default(), false)
        .unwrap();
    let view = attacher.attach("restart/state", false).unwrap();
    daemon.restart();
    // Both sessions resume on the new daemon (their next tasks run there).
    agora_test_support::saxpy_ok(&exporter, 64);
    agora_test_support::saxpy_ok(&attacher, 64);
    assert!(exporter.resumes() >= 1 && attacher.resumes() >= 1);

    let q = exporter.queue("after").unwrap();
    let message = q
        .memset(&state, 1)
        .expect_err("a buffer the new daemon does not know")
        .to_string();
    assert!(
        message.contains("not kept across a daemon restart") && message.contains("export it again"),
        "{message}"
    );
    let message = exporter
        .export(&state, "restart/again", &ExportReaders::default(), false)
        .expect_err("exporting a buffer the new daemon does not know")
        .to_string();
    assert!(
        message.contains("not kept across a daemon restart") && message.contains("shared buffer"),
        "{message}"
    );
    let q = attacher.queue("after").unwrap();
    let message = q
        .sync_from(&view)
        .expect_err("an attachment the new daemon does not know")
        .to_string();
    assert!(
        message.contains("not kept across a daemon restart") && message.contains("attach"),
        "{message}"
    );
    // The memory stays mapped and readable.
    assert_eq!(view.len(), 64);
    assert_eq!(view.as_slice::<u8>().len(), 64);
}

/// Run as another user by the next test: tries to attach the names in `AGORA_TEST_PROBE_NAMES`
/// and prints each refusal.
#[test]
#[ignore = "a helper process of an_export_a_caller_may_not_attach_is_answered_as_an_unknown_name, not a test by itself"]
fn attach_probe_process() {
    let Ok(socket) = std::env::var("AGORA_TEST_PROBE_SOCKET") else {
        return;
    };
    let session = agora_test_support::connect(std::path::Path::new(&socket), Some("probe"));
    for name in std::env::var("AGORA_TEST_PROBE_NAMES").unwrap().split(',') {
        match session.attach(name, false) {
            Ok(_) => println!("probe {name}: attached"),
            Err(e) => println!("probe {name}: {e}"),
        }
        match session.revoke(name) {
            Ok(_) => println!("revoke {name}: revoked"),
            Err(e) => println!("revoke {name}: {e}"),
        }
    }
}

/// D7 of the export audit: `attach()` of an export the caller may not attach answered "uid …
/// may not attach 'NAME': its exporter (uid 0) allows uids [1001] …", while an unknown name got
/// "no export named …": anyone could learn which names exist, their exporters and their ACLs.
/// Needs root, to run the probe as another user (tenant2, uid 1002, not in the ACL).
#[test]
fn an_export_a_caller_may_not_attach_is_answered_as_an_unknown_name() {
    use std::os::unix::fs::PermissionsExt;
    use std::os::unix::process::CommandExt;
    let dir = agora_test_support::temp_dir("exports-probe");
    std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o755)).unwrap();
    let probe = dir.path().join("probe");
    std::fs::copy(std::env::current_exe().unwrap(), &probe).unwrap();
    std::fs::set_permissions(&probe, std::fs::Permissions::from_mode(0o755)).unwrap();
    let daemon = Daemon::start_in(AGORA, dir, &["--no-opencl", "--socket-access", "all"]);
    let exporter = daemon.session_without_resume("secret-exporter");
    let state = exporter.shared_buffer(64).unwrap();
    let readers = ExportReaders {
        uids: vec![1001],
        gids: vec![],
    };
    exporter.export(&state, "secret/run42", &readers, false).unwrap();
    let output = Command::new(&probe)
        .env_clear()
        .env("AGORA_TEST_PROBE_SOCKET", daemon.socket())
        .env("AGORA_TEST_PROBE_NAMES", "secret/run42,secret/none")
        .args(["--ignored", "--exact", "attach_probe_process", "--nocapture"])
        .uid(1002)
        .gid(1002)
        .output()
        .expect("the probe starts (the tests run as root)");
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert!(
        output.status.success(),
        "{stdout}\n{}",
        String::from_utf8_lossy(&output.stderr)
    );
    // Anywhere in a line: a test harness that runs one test at a time (on one CPU) prints
    // "test attach_probe_process ... " before the test's own output, on the same line.
    let answer_to = |what: &str, name: &str| {
        let marker = format!("{what} {name}: ");
        stdout
            .lines()
            .find_map(|l| l.find(&marker).map(|at| &l[at + marker.len()..]))
            .unwrap_or_else(|| panic!("no answer for {name}: {stdout}"))
            .replace(name, "NAME")
    };
    let answer = |name: &str| answer_to("probe", name);
    let hidden = answer("secret/run42");
    assert_eq!(hidden, answer("secret/none"), "{stdout}");
    assert!(hidden.contains("no export named"), "{hidden}");
    // So is a revoke of it (it said "'NAME' is exported by uid 0; only its exporter's user ...").
    let hidden = answer_to("revoke", "secret/run42");
    assert_eq!(hidden, answer_to("revoke", "secret/none"), "{stdout}");
    assert!(hidden.contains("no export named"), "{hidden}");
    assert!(
        exporter.exports().unwrap().iter().any(|e| e.name == "secret/run42"),
        "still exported"
    );
    assert!(!stdout.contains("uid 0") && !stdout.contains("1001"), "{stdout}");
    // Its exporter's user still gets the real refusal (here: a writable attach of a read-only
    // export).
    let own = exporter
        .attach("secret/run42", true)
        .expect_err("read-only")
        .to_string();
    assert!(own.contains("read-only"), "{own}");
}
