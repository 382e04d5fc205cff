//! Starting `agora serve` on a socket path that cannot work (issue #19, item 7): the daemon
//! checks the path before any device starts, exits with status 1, and says what is wrong and
//! what to do. Each case runs a real `agora serve` process with `AGORA_LOG=info`, under which a
//! daemon that got as far as its devices logs "device ready" (the CPU device, before OpenCL
//! discovery): the failures must come before that line, and a good path must log it (the
//! control case). No assertion depends on timing.

use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use agora_test_support::{temp_dir, Daemon};

const AGORA: &str = env!("CARGO_BIN_EXE_agora");

/// Longest a refused start may take before the test gives up (it should take milliseconds; this
/// only keeps a daemon that wrongly started from hanging the test).
const EXIT_TIMEOUT: Duration = Duration::from_secs(60);

/// `agora serve --socket SOCKET ARGS` with its log on stderr at `info`, started and run until
/// it exits: its exit code and its stderr. Fails when it is still running after the timeout.
fn serve(scratch: &Path, socket: &Path, args: &[&str]) -> (Option<i32>, String) {
    let log = scratch.join(format!("serve-{}.log", rand_tag()));
    let mut child = Command::new(AGORA)
        .arg("serve")
        .arg("--socket")
        .arg(socket)
        .args(args)
        .env("AGORA_LOG", "info")
        .env("AGORA_STATE_DIR", scratch.join("state"))
        .env_remove("AGORA_SOCKET")
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(&log).unwrap())
        .spawn()
        .expect("agora serve starts");
    let deadline = Instant::now() + EXIT_TIMEOUT;
    let status = loop {
        if let Some(status) = child.try_wait().unwrap() {
            break status;
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            let _ = child.wait();
            panic!(
                "agora serve --socket {} was still running: {}",
                socket.display(),
                std::fs::read_to_string(&log).unwrap_or_default()
            );
        }
        std::thread::sleep(Duration::from_millis(10));
    };
    (status.code(), std::fs::read_to_string(&log).unwrap())
}

/// A name for one log file per call.
fn rand_tag() -> u64 {
    use std::sync::atomic::{AtomicU64, Ordering};
    static NEXT: AtomicU64 = AtomicU64::new(0);
    NEXT.fetch_add(1, Ordering::Relaxed)
}

/// A refused start: exit status 1, one error naming `what` and suggesting `--socket`, no panic,
/// and no device started before it.
fn refused_before_devices(outcome: (Option<i32>, String), what: &str) -> String {
    let (code, err) = outcome;
    assert_eq!(code, Some(1), "exit status; stderr: {err}");
    assert!(!err.contains("panicked"), "a panic: {err}");
    assert!(err.contains("error: the daemon cannot start"), "{err}");
    assert!(err.contains(what), "expected '{what}' in: {err}");
    assert!(err.contains("--socket"), "the fix is named: {err}");
    assert!(
        !err.contains("device ready") && !err.contains("listening"),
        "refused only after devices started: {err}"
    );
    err
}

#[test]
fn a_good_socket_path_logs_its_devices_before_it_listens() {
    // The control case: the line whose absence the other tests check does appear.
    let scratch = temp_dir("startup-ok");
    let socket = scratch.path().join("agora.sock");
    let log = scratch.path().join("serve.log");
    let mut child = Command::new(AGORA)
        .args(["serve", "--no-opencl", "--socket"])
        .arg(&socket)
        .env("AGORA_LOG", "info")
        .env("AGORA_STATE_DIR", scratch.path().join("state"))
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(&log).unwrap())
        .spawn()
        .unwrap();
    let deadline = Instant::now() + EXIT_TIMEOUT;
    while std::os::unix::net::UnixStream::connect(&socket).is_err() {
        if Instant::now() > deadline || child.try_wait().unwrap().is_some() {
            let _ = child.kill();
            let _ = child.wait();
            panic!("did not listen: {}", std::fs::read_to_string(&log).unwrap());
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    let _ = Command::new("kill").arg("-TERM").arg(child.id().to_string()).status();
    let _ = child.wait();
    let text = std::fs::read_to_string(&log).unwrap();
    let ready = text
        .find("device ready")
        .unwrap_or_else(|| panic!("no device line: {text}"));
    let listening = text
        .find("listening")
        .unwrap_or_else(|| panic!("no listening line: {text}"));
    assert!(ready < listening, "{text}");
}

#[test]
fn an_overlong_socket_path_is_refused_with_its_length_and_the_limit() {
    let scratch = temp_dir("startup-long");
    let dir = scratch.path().join("d".repeat(120));
    let socket = dir.join("agora.sock");
    let length = socket.as_os_str().len();
    let err = refused_before_devices(serve(scratch.path(), &socket, &[]), "bytes long");
    assert!(err.contains(&format!("is {length} bytes long")), "{err}");
    assert!(err.contains("at most 107 bytes"), "{err}");
    assert!(err.contains("XDG_RUNTIME_DIR"), "{err}");
    assert!(!dir.exists(), "nothing was created for a path that cannot work");
}

#[test]
fn a_socket_under_a_file_or_an_uncreatable_directory_is_refused() {
    let scratch = temp_dir("startup-notdir");
    let file = scratch.path().join("plain-file");
    std::fs::write(&file, "not a directory").unwrap();
    refused_before_devices(
        serve(scratch.path(), &file.join("agora.sock"), &[]),
        "is not a directory",
    );
    refused_before_devices(
        serve(scratch.path(), &file.join("sub").join("agora.sock"), &[]),
        "cannot create the socket's directory",
    );
}

#[test]
fn a_socket_in_a_read_only_directory_is_refused() {
    use std::os::unix::fs::PermissionsExt;
    if rustix::process::geteuid().is_root() {
        // Root may write any directory: the daemon then starts there, which is right.
        eprintln!("running as root: a read-only directory is writable, nothing to check");
        return;
    }
    let scratch = temp_dir("startup-ro");
    let dir = scratch.path().join("read-only");
    std::fs::create_dir(&dir).unwrap();
    std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o555)).unwrap();
    let outcome = serve(scratch.path(), &dir.join("agora.sock"), &[]);
    std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o755)).unwrap();
    let err = refused_before_devices(outcome, "cannot create the socket in");
    assert!(err.contains("Permission denied"), "{err}");
}

#[test]
fn a_file_in_the_way_is_refused_and_left_alone() {
    let scratch = temp_dir("startup-file");
    let path = scratch.path().join("agora.sock");
    std::fs::write(&path, "precious").unwrap();
    refused_before_devices(serve(scratch.path(), &path, &[]), "exists and is not a socket");
    assert_eq!(std::fs::read_to_string(&path).unwrap(), "precious");
}

#[test]
fn a_second_daemon_on_the_same_socket_is_refused_and_the_first_keeps_serving() {
    let first = Daemon::start(AGORA, "startup-twice", &["--no-opencl"]);
    let (code, err) = serve(first.dir(), first.socket(), &["--no-opencl"]);
    assert_eq!(code, Some(1), "{err}");
    assert!(err.contains("a daemon is already running on"), "{err}");
    assert!(!err.contains("device ready"), "{err}");
    assert_eq!(first.status().pid, first.pid());
}

/// A daemon whose socket file a clean-up of its directory removed still runs: a second daemon on
/// that path is refused, naming the first and why it cannot be reached (before, it started, and
/// the first one's shutdown then removed the second one's socket).
#[test]
fn a_daemon_whose_socket_file_was_removed_still_holds_its_path() {
    let mut first = Daemon::start(AGORA, "startup-removed", &["--no-opencl"]);
    std::fs::remove_file(first.socket()).unwrap();
    let scratch = temp_dir("startup-removed-second");
    let (code, err) = serve(scratch.path(), first.socket(), &["--no-opencl"]);
    assert_eq!(code, Some(1), "{err}");
    assert!(
        err.contains(&format!("pid {}", first.pid())) && err.contains("the socket file is gone"),
        "{err}"
    );
    first.assert_alive();
    // The first puts a new socket in place (it looks every 5 s) and clients reach it again.
    assert!(
        agora_test_support::eventually(Duration::from_secs(15), || first.socket().exists()),
        "the socket file was not put back"
    );
    assert_eq!(first.status().pid, first.pid());
    let session = first.session();
    agora_test_support::saxpy_ok(&session, 1024);
    // Another file on the path is not the daemon's to remove: it stays (past a check), and once
    // it is gone the socket comes back.
    std::fs::remove_file(first.socket()).unwrap();
    std::fs::write(first.socket(), b"not a socket").unwrap();
    std::thread::sleep(Duration::from_secs(6));
    assert_eq!(std::fs::read(first.socket()).unwrap(), b"not a socket");
    std::fs::remove_file(first.socket()).unwrap();
    assert!(
        agora_test_support::eventually(Duration::from_secs(15), || first.socket().exists()),
        "the socket file was not put back after the other file went"
    );
    agora_test_support::saxpy_ok(&session, 1024);
    assert_eq!(first.status().pid, first.pid());
}

/// A state directory is one daemon's: a second daemon given the same one is refused before its
/// devices start (before, the two overwrote each other's performance model and job records).
/// One that is a file is served without, with one warning saying what is lost (issue 20: broken
/// state never stops a daemon).
#[test]
fn a_state_directory_another_daemon_uses_is_refused() {
    let first = Daemon::start(AGORA, "startup-state", &["--no-opencl"]);
    let scratch = temp_dir("startup-state-second");
    let state = first.state_dir();
    let (code, err) = serve(
        scratch.path(),
        &scratch.path().join("second.sock"),
        &["--no-opencl", "--state-dir", state.to_str().unwrap()],
    );
    assert_eq!(code, Some(1), "{err}");
    assert!(
        err.contains(&format!("another daemon (pid {}) uses it", first.pid())) && err.contains("--state-dir"),
        "{err}"
    );
    assert!(!err.contains("device ready"), "{err}");
    assert_eq!(first.status().pid, first.pid());
}

/// SIGHUP reloads the kernel packages and the daemon goes on serving (before, it ended the
/// daemon at once: running work, the trace and the model lost, the socket file left behind).
#[test]
fn sighup_reloads_the_kernel_packages_and_the_daemon_goes_on() {
    let scratch = temp_dir("startup-hup");
    let log = scratch.path().join("serve.log");
    let socket = scratch.path().join("hup.sock");
    let packages = agora_test_support::example_packages();
    let mut child = Command::new(AGORA)
        .args(["serve", "--no-opencl", "--kernels"])
        .arg(&packages)
        .arg("--socket")
        .arg(&socket)
        .env("AGORA_LOG", "info")
        .env("AGORA_STATE_DIR", scratch.path().join("state"))
        .env_remove("AGORA_SOCKET")
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(&log).unwrap())
        .spawn()
        .unwrap();
    let listening = agora_test_support::eventually(EXIT_TIMEOUT, || {
        std::os::unix::net::UnixStream::connect(&socket).is_ok()
    });
    assert!(listening, "{}", std::fs::read_to_string(&log).unwrap_or_default());
    for _ in 0..2 {
        assert!(Command::new("kill")
            .args(["-HUP", &child.id().to_string()])
            .status()
            .unwrap()
            .success());
    }
    let reloaded = agora_test_support::eventually(EXIT_TIMEOUT, || {
        std::fs::read_to_string(&log)
            .unwrap_or_default()
            .matches("SIGHUP: kernel packages reloaded")
            .count()
            == 2
    });
    let text = std::fs::read_to_string(&log).unwrap();
    assert!(reloaded, "{text}");
    assert!(child.try_wait().unwrap().is_none(), "the daemon still runs: {text}");
    let session = agora_test_support::connect(&socket, None);
    agora_test_support::saxpy_ok(&session, 1 << 12);
    assert!(session.kernel("imaging.blur").is_ok(), "the packages are loaded");
    drop(session);
    let _ = Command::new("kill").args(["-TERM", &child.id().to_string()]).status();
    assert!(child.wait().unwrap().success());
    assert!(!socket.exists(), "a clean stop removes its socket");
}

/// A `[[sim]]` device named like a real one would leave one of the two unreachable by name
/// (drain, the model, the metrics): refused at start.
#[test]
fn a_sim_device_named_like_another_device_is_refused() {
    let scratch = temp_dir("startup-sim-name");
    let config = scratch.path().join("agora.toml");
    std::fs::write(&config, "[[sim]]\nname = \"cpu0\"\nlanes = 1\n").unwrap();
    let (code, err) = serve(
        scratch.path(),
        &scratch.path().join("s.sock"),
        &["--no-opencl", "--config", config.to_str().unwrap()],
    );
    assert_eq!(code, Some(1), "{err}");
    assert!(err.contains("two devices are named cpu0"), "{err}");
}

/// A trace file that cannot be written is refused at start, naming it (before, the daemon
/// started and the trace was lost at shutdown, with an error that did not say which file).
#[test]
fn a_trace_file_that_cannot_be_written_is_refused_at_start() {
    let scratch = temp_dir("startup-trace");
    let (code, err) = serve(
        scratch.path(),
        &scratch.path().join("t.sock"),
        &["--no-opencl", "--trace", "/nonexistent-dir/trace.json"],
    );
    assert_eq!(code, Some(1), "{err}");
    assert!(
        err.contains("/nonexistent-dir/trace.json") && err.contains("writable directory"),
        "{err}"
    );
}

/// An empty `AGORA_SOCKET` means "not set", as the clients read it (before, every command
/// answered "a value is required for '--socket <PATH>'" though no flag was given).
#[test]
fn an_empty_agora_socket_is_no_socket() {
    let scratch = temp_dir("startup-empty-env");
    let out = Command::new(AGORA)
        .arg("status")
        .env("AGORA_SOCKET", "")
        .env("XDG_RUNTIME_DIR", scratch.path())
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(
        !err.contains("a value is required")
            && err.contains(&scratch.path().join("agora/agora.sock").display().to_string()),
        "{err}"
    );
}

/// A misspelt or empty `AGORA_LOG` (audit A3) is not used as a filter: before, `wran` was taken
/// for a target name and an empty value for an empty filter, and the daemon logged nothing at
/// all, errors included. Now it logs at the default level, and its first line says why.
#[test]
fn a_misspelt_or_empty_agora_log_falls_back_to_info_with_a_warning() {
    for (tag, value) in [("wran", "wran"), ("empty", "")] {
        let scratch = temp_dir(&format!("startup-log-{tag}"));
        let socket = scratch.path().join("agora.sock");
        let log = scratch.path().join("serve.log");
        let mut child = Command::new(AGORA)
            .args(["serve", "--no-opencl", "--socket"])
            .arg(&socket)
            .env("AGORA_LOG", value)
            .env("AGORA_STATE_DIR", scratch.path().join("state"))
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(&log).unwrap())
            .spawn()
            .unwrap();
        let deadline = Instant::now() + EXIT_TIMEOUT;
        // The log, not the socket, is what is checked: wait for its "listening" line.
        while !std::fs::read_to_string(&log).unwrap().contains("listening") {
            if Instant::now() > deadline || child.try_wait().unwrap().is_some() {
                let _ = child.kill();
                let _ = child.wait();
                panic!(
                    "AGORA_LOG='{value}': no listening line: {}",
                    std::fs::read_to_string(&log).unwrap()
                );
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        let _ = Command::new("kill").arg("-TERM").arg(child.id().to_string()).status();
        let _ = child.wait();
        let text = std::fs::read_to_string(&log).unwrap();
        let warning = text
            .lines()
            .find(|line| line.contains("WARN") && line.contains(&format!("AGORA_LOG='{value}' is not used")))
            .unwrap_or_else(|| panic!("AGORA_LOG='{value}': no warning: {text}"));
        assert!(warning.contains("info"), "the fallback level is named: {warning}");
        assert!(text.contains("INFO") && text.contains("device ready"), "{text}");
    }
}
