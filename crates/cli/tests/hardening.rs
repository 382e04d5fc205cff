//! Issue 20 against real `agora serve` processes: what one local user can take from the others
//! is bounded, and the daemon starts whatever its state directory holds.
//!
//! * out of file descriptors (a low `RLIMIT_NOFILE` set on the running daemon, then more
//!   connections than it allows): the daemon does not spin (its CPU time over a second of
//!   steady connection attempts stays low), logs one line, tells refused clients why, and
//!   serves again once the connections are gone;
//! * a connection that never says hello is closed after the hello timeout, with a typed reason;
//! * per-uid limits (connections, sessions, heap bytes, queues, buffers) and the per-connection
//!   rate of control requests refuse with `ControlError::LimitReached` naming the limit, the
//!   use and the setting; `agora status` and the metrics show the use and the refusals;
//! * `agora trace save` (and drain) need an admin (`[daemon] admin_uids` / `admin_gids`);
//! * a corrupt performance model, one from a newer version (left as it is), an unreadable or
//!   impossible state directory: the daemon warns and serves.

use std::io::{Read, Write};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::{Duration, Instant};

use agora::{Error, Session, SessionOptions};
use agora_protocol::control::{decode_body, encode_frame, ControlError, Request, Response};
use agora_test_support::{cpu_seconds, eventually, saxpy_ok, temp_dir, Daemon};

const AGORA: &str = env!("CARGO_BIN_EXE_agora");

/// A daemon whose stderr (its log, `AGORA_LOG=warn`) goes to `DIR/daemon.log`.
fn start_logged(tag: &str, args: &[&str]) -> (Daemon, PathBuf) {
    let dir = temp_dir(tag);
    let log = dir.path().join("daemon.log");
    let file = std::fs::File::create(&log).unwrap();
    let daemon = Daemon::start_in_with(AGORA, dir, args, |c| {
        c.stderr(Stdio::from(file));
    });
    (daemon, log)
}

fn session_with(socket: &Path, heap: Option<u64>) -> Result<Session, Error> {
    Session::connect_with(SessionOptions {
        socket: Some(socket.to_path_buf()),
        name: Some("hardening".into()),
        heap_bytes: heap,
        control_timeout: None,
        reconnect_timeout: None,
    })
}

/// The limit a refusal names, or a panic saying what came instead.
fn limit_of(result: Result<impl std::fmt::Debug, Error>) -> (String, u64, u64, String) {
    match result {
        Err(Error::Control(ControlError::LimitReached {
            limit,
            value,
            max,
            setting,
            ..
        })) => (limit, value, max, setting),
        other => panic!("expected a LimitReached refusal, got {other:?}"),
    }
}

fn open_fds(pid: u32) -> u64 {
    std::fs::read_dir(format!("/proc/{pid}/fd")).unwrap().count() as u64
}

/// Reads one reply frame within `wait`, if one comes.
fn read_reply(stream: &mut UnixStream, wait: Duration) -> Option<Response> {
    stream.set_read_timeout(Some(wait)).unwrap();
    let mut header = [0u8; 4];
    stream.read_exact(&mut header).ok()?;
    let mut body = vec![0u8; u32::from_le_bytes(header) as usize];
    stream.read_exact(&mut body).ok()?;
    decode_body(&body).ok()
}

#[test]
fn out_of_descriptors_the_daemon_does_not_spin_and_recovers() {
    let (mut daemon, log) = start_logged(
        "hardening-emfile",
        &["--no-opencl", "--cpu-lanes", "1", "--hello-timeout-ms", "120000"],
    );
    let pid = daemon.pid();
    // A few descriptors beyond what it holds now.
    let limit = open_fds(pid) + 16;
    rustix::process::prlimit(
        rustix::process::Pid::from_raw(pid as i32),
        rustix::process::Resource::Nofile,
        rustix::process::Rlimit {
            current: Some(limit),
            maximum: Some(limit),
        },
    )
    .expect("the test may lower the daemon's open-file limit");
    // More idle connections than it can take.
    let mut held: Vec<UnixStream> = (0..48).map(|_| UnixStream::connect(daemon.socket()).unwrap()).collect();
    let read_log = || std::fs::read_to_string(&log).unwrap_or_default();
    assert!(
        eventually(Duration::from_secs(10), || read_log()
            .contains("out of file descriptors")),
        "the daemon did not say it ran out of descriptors:\n{}",
        read_log()
    );
    // Those beyond the limit were accepted with the reserve descriptor and told why.
    let refused = held
        .iter_mut()
        .rev()
        .take(16)
        .map(|s| {
            matches!(
                read_reply(s, Duration::from_secs(2)),
                Some(Response::Error(ControlError::LimitReached { ref limit, .. })) if limit == "open files of the daemon"
            )
        })
        .filter(|told| *told)
        .count();
    assert!(refused > 0, "no connection beyond the limit was told why");
    // A second of steady connection attempts while out of descriptors: the loop must not spin
    // (before: 100 % of a core, a log line per iteration).
    let log_before = read_log().len();
    let cpu_before = cpu_seconds(pid);
    let started = Instant::now();
    let mut attempts = Vec::new();
    while started.elapsed() < Duration::from_secs(1) {
        if let Ok(s) = UnixStream::connect(daemon.socket()) {
            attempts.push(s);
        }
        std::thread::sleep(Duration::from_millis(5));
    }
    let cpu = (cpu_seconds(pid) - cpu_before) / started.elapsed().as_secs_f64();
    let grown = read_log().len() - log_before;
    eprintln!(
        "out of descriptors: daemon CPU {:.1} % of a core over {:?}, {} connection attempts, log grew {grown} bytes",
        cpu * 100.0,
        started.elapsed(),
        attempts.len()
    );
    assert!(
        cpu < 0.2,
        "the daemon used {:.0} % of a core while out of descriptors",
        cpu * 100.0
    );
    assert!(grown < 2048, "the log grew {grown} bytes in a second:\n{}", read_log());
    let lines = read_log().matches("out of file descriptors").count();
    assert!(lines <= 2, "{lines} log lines about it");
    // The connections go; the daemon serves a new client again.
    drop(held);
    drop(attempts);
    assert!(
        eventually(Duration::from_secs(10), || open_fds(pid) + 8 < limit),
        "the daemon did not close the connections: {} descriptors open",
        open_fds(pid)
    );
    let mut session = None;
    assert!(eventually(Duration::from_secs(10), || {
        session = session_with(daemon.socket(), Some(1 << 20)).ok();
        session.is_some()
    }));
    saxpy_ok(session.as_ref().unwrap(), 4096);
    daemon.assert_alive();
}

#[test]
fn a_connection_that_never_says_hello_is_closed_with_a_reason() {
    let daemon = Daemon::start(AGORA, "hardening-hello", &["--no-opencl", "--hello-timeout-ms", "300"]);
    let started = Instant::now();
    let mut silent = UnixStream::connect(daemon.socket()).unwrap();
    // Half a frame does not count as a request either.
    silent.write_all(&[200, 0]).unwrap();
    let session = daemon.session();
    let reply = read_reply(&mut silent, Duration::from_secs(10));
    let after = started.elapsed();
    match reply {
        Some(Response::Error(ControlError::LimitReached {
            limit, max, setting, ..
        })) => {
            assert_eq!(limit, "milliseconds before the first request");
            assert_eq!(max, 300);
            assert!(setting.contains("--hello-timeout-ms"), "{setting}");
        }
        other => panic!("expected the hello timeout, got {other:?}"),
    }
    assert!(after >= Duration::from_millis(300), "closed after {after:?}");
    let mut byte = [0u8; 1];
    assert_eq!(silent.read(&mut byte).unwrap_or(0), 0, "then closed");
    // A session that said hello in time is not affected.
    std::thread::sleep(Duration::from_millis(400));
    saxpy_ok(&session, 4096);
    let status = daemon.status();
    let refusals: u64 = status
        .limit_refusals
        .iter()
        .filter(|(l, _)| l == "milliseconds before the first request")
        .map(|(_, n)| *n)
        .sum();
    assert_eq!(refusals, 1);
}

#[test]
fn connections_per_uid_are_limited_and_freed() {
    let daemon = Daemon::start(
        AGORA,
        "hardening-conns",
        &["--no-opencl", "--limit-connections-per-uid", "3"],
    );
    let a = UnixStream::connect(daemon.socket()).unwrap();
    let b = UnixStream::connect(daemon.socket()).unwrap();
    // The status connection is the third (once the daemon saw the harness's probe connections
    // go).
    let mut status = None;
    assert!(eventually(Duration::from_secs(5), || {
        status = agora::daemon_status(Some(daemon.socket().to_path_buf())).ok();
        status.is_some()
    }));
    let status = status.unwrap();
    let me = rustix::process::getuid().as_raw();
    let usage = status.uids.iter().find(|u| u.uid == me).expect("this uid is listed");
    assert_eq!((usage.connections.used, usage.connections.max), (3, 3));
    // The third again, once the daemon has seen the status connection go (it notices a closed
    // connection when it next polls it: under load that came after this connect, which was
    // then refused, and the status below took its place). A refused connection is answered at
    // once and closed; an accepted one hears nothing until it says hello.
    let mut c = None;
    assert!(eventually(Duration::from_secs(5), || {
        let stream = UnixStream::connect(daemon.socket()).unwrap();
        stream.set_read_timeout(Some(Duration::from_millis(100))).unwrap();
        let refused = std::io::Read::read(&mut &stream, &mut [0u8; 1]).is_ok();
        if !refused {
            c = Some(stream);
        }
        !refused
    }));
    let c = c.unwrap();
    // A fourth: refused at connect, typed, naming the setting.
    let (limit, value, max, setting) = limit_of(session_with(daemon.socket(), Some(1 << 20)));
    assert_eq!((limit.as_str(), value, max), ("connections per uid", 3, 3));
    assert!(setting.contains("connections_per_uid") && setting.contains("--limit-connections-per-uid"));
    // `agora status` says so too, with the message.
    let out = daemon.agora(&["status"]);
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("connections per uid is 3"), "{err}");
    drop((a, b, c));
    let mut session = None;
    assert!(eventually(Duration::from_secs(5), || {
        session = session_with(daemon.socket(), Some(1 << 20)).ok();
        session.is_some()
    }));
    saxpy_ok(session.as_ref().unwrap(), 4096);
}

#[test]
fn sessions_and_heap_per_uid_are_limited_shown_and_counted() {
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let daemon = Daemon::start(
        AGORA,
        "hardening-sessions",
        &[
            "--no-opencl",
            "--limit-sessions-per-uid",
            "2",
            "--limit-heap-per-uid",
            "3M",
            "--metrics",
            &port.to_string(),
        ],
    );
    let one = session_with(daemon.socket(), Some(1 << 20)).unwrap();
    let two = session_with(daemon.socket(), Some(1 << 20)).unwrap();
    let (limit, value, max, setting) = limit_of(session_with(daemon.socket(), Some(1 << 20)));
    assert_eq!((limit.as_str(), value, max), ("sessions per uid", 2, 2));
    assert!(setting.contains("--limit-sessions-per-uid"), "{setting}");
    // The Rust client's error says it all in words too.
    let text = session_with(daemon.socket(), Some(1 << 20)).unwrap_err().to_string();
    assert!(
        text.contains("sessions per uid is 2") && text.contains("sessions_per_uid"),
        "{text}"
    );
    drop(two);
    let me = rustix::process::getuid().as_raw();
    let mine = || daemon.status().uids.into_iter().find(|u| u.uid == me).unwrap();
    assert!(eventually(Duration::from_secs(5), || mine().heap_bytes.used == 1 << 20));
    // One session left, 1 MiB of 3 MiB granted: a 4 MiB heap does not fit.
    let (limit, value, max, _) = limit_of(session_with(daemon.socket(), Some(4 << 20)));
    assert_eq!((limit.as_str(), value, max), ("heap bytes per uid", 1 << 20, 3 << 20));
    let two = session_with(daemon.socket(), Some(2 << 20)).unwrap();
    saxpy_ok(&two, 4096);
    let _held = (two.queue("held").unwrap(), two.buffer(64).unwrap());
    let usage = mine();
    assert_eq!((usage.sessions.used, usage.sessions.max), (2, 2));
    assert_eq!((usage.heap_bytes.used, usage.heap_bytes.max), (3 << 20, 3 << 20));
    assert!(usage.queues.used >= 1 && usage.buffers.used >= 1, "{usage:?}");
    let status = daemon.status();
    let count = |name: &str| {
        status
            .limit_refusals
            .iter()
            .find(|(l, _)| l == name)
            .map_or(0, |(_, n)| *n)
    };
    assert_eq!((count("sessions per uid"), count("heap bytes per uid")), (2, 1));
    let out = daemon.agora(&["status"]);
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        text.contains(&format!("uid {me}")) && text.contains("sessions 2/2"),
        "{text}"
    );
    assert!(
        text.contains("refused by limits since start: sessions per uid: 2"),
        "{text}"
    );
    // The metrics count refusals per limit.
    let metrics = agora_test_support::scrape_metrics(port);
    assert!(
        metrics.contains("agora_limit_refusals_total{limit=\"sessions per uid\"} 2"),
        "{metrics}"
    );
    assert!(metrics.contains("agora_limit_refusals_total{limit=\"heap bytes per uid\"} 1"));
    drop(one);
}

#[test]
fn queues_and_buffers_per_uid_count_every_session() {
    let daemon = Daemon::start(
        AGORA,
        "hardening-tables",
        &[
            "--no-opencl",
            "--limit-queues-per-uid",
            "3",
            "--limit-buffers-per-uid",
            "5",
        ],
    );
    let one = session_with(daemon.socket(), Some(1 << 20)).unwrap();
    let two = session_with(daemon.socket(), Some(1 << 20)).unwrap();
    let _q1 = one.queue("a").unwrap();
    let _q2 = one.queue("b").unwrap();
    let q3 = two.queue("c").unwrap();
    let (limit, value, max, setting) = limit_of(two.queue("d"));
    assert_eq!((limit.as_str(), value, max), ("queues per uid", 3, 3));
    assert!(setting.contains("--limit-queues-per-uid"));
    let mut buffers: Vec<agora::Buffer> = (0..3).map(|_| one.buffer(64).unwrap()).collect();
    buffers.push(two.buffer(64).unwrap());
    buffers.push(two.buffer(64).unwrap());
    let (limit, value, max, _) = limit_of(two.buffer(64));
    assert_eq!((limit.as_str(), value, max), ("buffers per uid", 5, 5));
    // The session goes on: its queue runs work, and a released buffer makes room.
    q3.memset(&buffers[4], 7).unwrap();
    q3.finish().unwrap();
    drop(buffers.remove(0));
    let mut extra = None;
    assert!(eventually(Duration::from_secs(5), || {
        extra = two.buffer(64).ok();
        extra.is_some()
    }));
    let extra = extra.unwrap();
    q3.memset(&extra, 9).unwrap();
    q3.sync_from(&extra).unwrap();
    q3.finish().unwrap();
    assert!(extra.as_slice::<u8>().iter().all(|b| *b == 9));
}

#[test]
fn control_requests_are_rate_limited_per_connection_without_closing_it() {
    let daemon = Daemon::start(
        AGORA,
        "hardening-rate",
        &[
            "--no-opencl",
            "--limit-control-rate",
            "20",
            "--limit-control-burst",
            "10",
        ],
    );
    let mut raw = UnixStream::connect(daemon.socket()).unwrap();
    raw.write_all(
        &encode_frame(&Request::Hello {
            version: agora_protocol::PROTOCOL_VERSION,
            client_name: "flood".into(),
            heap_bytes: Some(1 << 20),
        })
        .unwrap(),
    )
    .unwrap();
    assert!(matches!(
        read_reply(&mut raw, Duration::from_secs(10)),
        Some(Response::Welcome { .. })
    ));
    // 40 allocations at once: the burst (9 left after the hello) and what 20/s adds meanwhile.
    let started = Instant::now();
    let mut flood = Vec::new();
    for _ in 0..40 {
        flood.extend(encode_frame(&Request::AllocBuffer { len: 64 }).unwrap());
    }
    raw.write_all(&flood).unwrap();
    let (mut granted, mut refused) = (0, 0);
    for _ in 0..40 {
        match read_reply(&mut raw, Duration::from_secs(10)) {
            Some(Response::Buffer { .. }) => granted += 1,
            Some(Response::Error(ControlError::LimitReached { limit, max, .. })) => {
                assert_eq!(
                    (limit.as_str(), max),
                    ("control requests per second per connection", 20)
                );
                refused += 1;
            }
            other => panic!("{other:?}"),
        }
    }
    let allowed = 9 + (started.elapsed().as_secs_f64() * 20.0).ceil() as u64;
    assert!(
        granted <= allowed && granted >= 9,
        "{granted} granted, {refused} refused"
    );
    assert_eq!(granted + refused, 40);
    // The connection stays open, and once tokens came back it is served again.
    std::thread::sleep(Duration::from_millis(200));
    raw.write_all(&encode_frame(&Request::AllocBuffer { len: 64 }).unwrap())
        .unwrap();
    assert!(matches!(
        read_reply(&mut raw, Duration::from_secs(10)),
        Some(Response::Buffer { .. })
    ));
    // Other connections have buckets of their own.
    saxpy_ok(&daemon.session(), 4096);
}

#[test]
fn trace_save_and_drain_need_an_admin() {
    let dir = temp_dir("hardening-admin");
    std::fs::write(dir.path().join("agora.toml"), "[daemon]\nadmin_uids = [4242]\n").unwrap();
    let daemon = Daemon::start_in(
        AGORA,
        dir,
        &[
            "--no-opencl",
            "--config",
            "{dir}/agora.toml",
            "--trace",
            "{dir}/trace.json",
        ],
    );
    saxpy_ok(&daemon.session(), 4096);
    let out = daemon.agora(&["trace", "save"]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "a non-admin saved the trace");
    assert!(
        err.contains("may not save the trace") && err.contains("admin_uids"),
        "{err}"
    );
    assert!(
        !daemon.dir().join("trace.json").exists(),
        "the trace was written anyway"
    );
    let out = daemon.agora(&["drain", "cpu0"]);
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("may not drain devices"));
    // A member of an admin group may.
    let gid = rustix::process::getgid().as_raw();
    let dir = temp_dir("hardening-admin-group");
    std::fs::write(
        dir.path().join("agora.toml"),
        format!("[daemon]\nadmin_uids = [4242]\nadmin_gids = [{gid}]\n"),
    )
    .unwrap();
    let daemon = Daemon::start_in(
        AGORA,
        dir,
        &[
            "--no-opencl",
            "--config",
            "{dir}/agora.toml",
            "--trace",
            "{dir}/trace.json",
        ],
    );
    saxpy_ok(&daemon.session(), 4096);
    let out = daemon.agora(&["trace", "save"]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    assert!(daemon.dir().join("trace.json").exists());
}

/// Starts a daemon on the state directory `state` (prepared by the test), checks it serves and
/// stops with SIGTERM (which saves the model); returns its log.
fn serve_with_state(tag: &str, state: impl FnOnce(&Path) -> PathBuf) -> (String, PathBuf) {
    let dir = temp_dir(tag);
    let state_dir = state(dir.path());
    let log = dir.path().join("daemon.log");
    let file = std::fs::File::create(&log).unwrap();
    // No inline runs: every launch goes to a lane, which feeds the model.
    let daemon_args = ["--no-opencl", "--policy", "perf", "--inline-max-ns", "0"];
    let mut daemon = Daemon::start_in_with(AGORA, dir, &daemon_args, |c| {
        c.env("AGORA_STATE_DIR", &state_dir).stderr(Stdio::from(file));
    });
    let session = daemon.session();
    saxpy_ok(&session, 4096);
    drop(session);
    daemon.assert_alive();
    daemon.stop();
    (std::fs::read_to_string(&log).unwrap(), state_dir)
}

#[test]
fn a_corrupt_performance_model_is_reported_and_replaced() {
    let keep = temp_dir("hardening-state-corrupt-keep");
    let state = keep.path().join("state");
    std::fs::create_dir_all(&state).unwrap();
    std::fs::write(state.join("perf-model.json"), b"{\"version\": 1, \"rows\": [tru").unwrap();
    let (log, state) = serve_with_state("hardening-state-corrupt", |_| state.clone());
    assert!(log.contains("not a performance model"), "{log}");
    // The daemon learned from the saxpy and saved a sound model over the corrupt one.
    let text = std::fs::read_to_string(state.join("perf-model.json")).unwrap();
    let saved: serde_json::Value = serde_json::from_str(&text).expect("a sound model replaced it");
    assert_eq!(saved["version"], 1);
}

#[test]
fn a_model_from_a_newer_version_is_left_alone() {
    let keep = temp_dir("hardening-state-newer-keep");
    let state = keep.path().join("state");
    std::fs::create_dir_all(&state).unwrap();
    let newer = "{\"version\": 99, \"format\": \"something this build does not know\", \"rows\": {}}";
    std::fs::write(state.join("perf-model.json"), newer).unwrap();
    let (log, state) = serve_with_state("hardening-state-newer", |_| state.clone());
    assert!(log.contains("newer Agora") && log.contains("model format 99"), "{log}");
    assert_eq!(
        std::fs::read_to_string(state.join("perf-model.json")).unwrap(),
        newer,
        "the newer version's file was overwritten"
    );
}

#[test]
fn a_state_directory_that_cannot_be_used_does_not_stop_the_daemon() {
    // A file where the directory should be: nothing can be read or written under it (this
    // denies also to root, which chmod does not).
    let keep = temp_dir("hardening-state-file-keep");
    let file = keep.path().join("state");
    std::fs::write(&file, b"not a directory").unwrap();
    let (log, _) = serve_with_state("hardening-state-file", |_| file.clone());
    assert!(log.contains("cannot read") && log.contains("perf-model.json"), "{log}");
    // Said once, with what is lost and what to do.
    assert!(
        log.contains("it is a file, not a directory")
            && log.contains("Slurm job records")
            && log.contains("--state-dir"),
        "{log}"
    );
    assert_eq!(std::fs::read(&file).unwrap(), b"not a directory");
    // A directory without permissions (denied unless the tests run as root; served either way).
    use std::os::unix::fs::PermissionsExt;
    let keep = temp_dir("hardening-state-mode-keep");
    let state = keep.path().join("state");
    std::fs::create_dir_all(&state).unwrap();
    std::fs::write(state.join("perf-model.json"), b"{}").unwrap();
    std::fs::set_permissions(&state, std::fs::Permissions::from_mode(0o000)).unwrap();
    let (log, _) = serve_with_state("hardening-state-mode", |_| state.clone());
    std::fs::set_permissions(&state, std::fs::Permissions::from_mode(0o700)).unwrap();
    let root = rustix::process::geteuid().is_root();
    assert!(
        root || log.contains("Permission denied"),
        "an unreadable directory was not reported:\n{log}"
    );
}

/// SRE audit, defect 6: out of descriptors while it makes a session's segment, the daemon
/// answered "bad request: the daemon could not create the session: system call: Too many open
/// files" with no advice; now the refusal the accept path gives, naming the limit and how to
/// raise it. Raising it lets sessions in again.
#[test]
fn out_of_descriptors_while_opening_a_session_names_the_limit() {
    let (daemon, _log) = start_logged("hardening-emfile-session", &["--no-opencl", "--cpu-lanes", "1"]);
    let pid = rustix::process::Pid::from_raw(daemon.pid() as i32);
    let set_limit = |limit: u64| {
        rustix::process::prlimit(
            pid,
            rustix::process::Resource::Nofile,
            rustix::process::Rlimit {
                current: Some(limit),
                maximum: Some(4096),
            },
        )
        .expect("the test may change the daemon's open-file limit");
    };
    // Room for the connection's own descriptor, none for the session's memory and doorbell:
    // the limit caps descriptor numbers, and a new descriptor takes the lowest free one.
    let open_numbers: std::collections::HashSet<u64> = std::fs::read_dir(format!("/proc/{}/fd", daemon.pid()))
        .unwrap()
        .filter_map(|e| e.ok()?.file_name().to_str()?.parse().ok())
        .collect();
    let lowest_free = (0..).find(|n| !open_numbers.contains(n)).unwrap();
    set_limit(lowest_free + 1);
    let open = || {
        Session::connect_with(SessionOptions {
            socket: Some(daemon.socket().to_path_buf()),
            heap_bytes: Some(1 << 20),
            ..Default::default()
        })
    };
    match open() {
        Err(Error::Control(ControlError::LimitReached {
            ref limit, ref setting, ..
        })) => {
            assert_eq!(limit, "open files of the daemon");
            assert!(setting.contains("ulimit -n"), "{setting}");
        }
        other => panic!("a session without descriptors: {other:?}"),
    }
    set_limit(4096);
    saxpy_ok(&open().expect("a session once the limit is raised"), 1024);
}
