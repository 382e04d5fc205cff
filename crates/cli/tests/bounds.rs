//! Issue 22, against real `agora serve` processes: work per request and replies are bounded
//! whatever a tenant sends or creates, and no control call waits forever.
//!
//! * names beyond `MAX_NAME` are refused at once, without the "did you mean" search and
//!   without echoing them (before: twelve 1 MiB kernel names froze the control loop 7.9 s and
//!   the reply was too large to arrive);
//! * `agora status` works with 4 sessions × 4096 queues of the longest names (before: a 1.18 MB
//!   reply, over the 1 MiB frame limit, failed for everyone); `--session ID` pages through one
//!   session's queues;
//! * a control call to a daemon that does not answer fails with `Error::Timeout` naming the
//!   call, and the session works again once the daemon does.

use std::io::{Read, Write};
use std::os::unix::net::UnixStream;
use std::path::PathBuf;
use std::process::Command;
use std::time::{Duration, Instant};

use agora::{Error, Session, SessionOptions};
use agora_protocol::control::{
    decode_body, encode_frame, ControlError, Request, Response, MAX_FRAME, MAX_NAME, STATUS_QUEUES, STATUS_SESSIONS,
};

const AGORA: &str = env!("CARGO_BIN_EXE_agora");

/// An `agora serve` process on a private socket (the test-support harness: killed, and its
/// directory removed, on drop — SIGKILL ends it even while it is stopped).
struct Daemon(agora_test_support::Daemon);

impl Daemon {
    fn start(tag: &str) -> Daemon {
        Daemon(agora_test_support::Daemon::start(
            AGORA,
            &format!("bounds-{tag}"),
            // 148 sessions and 4 × 4096 queues of one uid: beyond the default per-uid limits,
            // which these tests are not about.
            &[
                "--no-opencl",
                "--cpu-lanes",
                "1",
                "--session-quota",
                "1M",
                "--limit-sessions-per-uid",
                "1000",
                "--limit-queues-per-uid",
                "100000",
            ],
        ))
    }

    fn socket(&self) -> PathBuf {
        self.0.socket().to_path_buf()
    }

    fn session(&self, name: &str, control_timeout: Option<Duration>) -> Session {
        Session::connect_with(SessionOptions {
            socket: Some(self.socket()),
            name: Some(name.into()),
            heap_bytes: Some(1 << 16),
            control_timeout,
            reconnect_timeout: None,
        })
        .unwrap()
    }

    fn agora(&self, args: &[&str]) -> (bool, String, String) {
        let out = self.0.agora(args);
        (
            out.status.success(),
            String::from_utf8_lossy(&out.stdout).into_owned(),
            String::from_utf8_lossy(&out.stderr).into_owned(),
        )
    }

    fn signal(&self, signal: &str) {
        let ok = Command::new("kill")
            .arg(signal)
            .arg(self.0.pid().to_string())
            .status()
            .unwrap();
        assert!(ok.success());
    }
}

/// Writes `request` as one frame.
fn write_request(stream: &mut UnixStream, request: &Request) {
    stream.write_all(&encode_frame(request).unwrap()).unwrap();
}

/// Reads one frame: its length and the decoded reply.
fn read_reply(stream: &mut UnixStream) -> (usize, Response) {
    let mut header = [0u8; 4];
    stream.read_exact(&mut header).unwrap();
    let len = u32::from_le_bytes(header) as usize;
    assert!(
        len <= MAX_FRAME as usize,
        "a reply of {len} bytes exceeds the frame limit"
    );
    let mut body = vec![0u8; len];
    stream.read_exact(&mut body).unwrap();
    (len, decode_body(&body).unwrap())
}

/// A raw connection with a session open (the hello's descriptors are dropped).
fn raw_session(daemon: &Daemon) -> UnixStream {
    let mut stream = UnixStream::connect(daemon.socket()).unwrap();
    stream.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
    write_request(
        &mut stream,
        &Request::Hello {
            version: agora_protocol::PROTOCOL_VERSION,
            client_name: "raw".into(),
            heap_bytes: Some(1 << 16),
        },
    );
    assert!(matches!(read_reply(&mut stream).1, Response::Welcome { .. }));
    stream
}

#[test]
fn a_client_of_another_protocol_version_is_refused_at_hello_naming_both() {
    let daemon = Daemon::start("versions");
    for (client, side) in [
        (agora_protocol::PROTOCOL_VERSION - 1, "older"),
        (agora_protocol::PROTOCOL_VERSION + 1, "newer"),
    ] {
        let mut stream = UnixStream::connect(daemon.socket()).unwrap();
        stream.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
        write_request(
            &mut stream,
            &Request::Hello {
                version: client,
                client_name: "old".into(),
                heap_bytes: Some(1 << 16),
            },
        );
        let error = match read_reply(&mut stream).1 {
            Response::Error(error) => error,
            other => panic!("a version-{client} client was let in: {other:?}"),
        };
        assert_eq!(
            error,
            ControlError::VersionMismatch {
                daemon: agora_protocol::PROTOCOL_VERSION,
                client
            }
        );
        let message = error.to_string();
        assert!(
            message.contains(&format!("version {}", agora_protocol::PROTOCOL_VERSION))
                && message.contains(&format!("this client {client}"))
                && message.contains(side)
                && message.contains("the client of the daemon's Agora build"),
            "{message}"
        );
    }
    // The daemon serves a matching client afterwards.
    drop(raw_session(&daemon));
}

#[test]
fn long_names_are_refused_at_once_without_stalling_the_daemon() {
    let daemon = Daemon::start("names");
    let mut raw = raw_session(&daemon);
    // Twelve lookups of (almost) 1 MiB names, pipelined.
    let name = "k".repeat(MAX_FRAME as usize - 64);
    let started = Instant::now();
    for _ in 0..12 {
        write_request(&mut raw, &Request::LookupKernel { name: name.clone() });
    }
    // Another client is answered promptly meanwhile.
    let status = agora::daemon_status(Some(daemon.socket())).expect("status answers");
    assert!(status.pid > 0);
    // Every lookup gets its reply: a short error naming the length, not the name.
    for _ in 0..12 {
        let (len, reply) = read_reply(&mut raw);
        assert!(len < 256, "a {len}-byte reply");
        match reply {
            Response::Error(ControlError::NameTooLong { what, len, limit }) => {
                assert_eq!(
                    (what.as_str(), len, limit),
                    ("kernel", name.len() as u64, MAX_NAME as u64)
                );
            }
            other => panic!("{other:?}"),
        }
    }
    let took = started.elapsed();
    eprintln!("12 lookups of {} KiB names answered in {took:?}", name.len() >> 10);
    assert!(took < Duration::from_secs(3), "answered after {took:?}");
    // Queue and client names too, refused by the client before sending and by the daemon.
    write_request(
        &mut raw,
        &Request::CreateQueue {
            name: "q".repeat(MAX_NAME + 1),
            class: Default::default(),
            preferred_device: None,
            sla_ms: None,
        },
    );
    assert!(matches!(
        read_reply(&mut raw).1,
        Response::Error(ControlError::NameTooLong { what, .. }) if what == "queue"
    ));
    let mut hello = UnixStream::connect(daemon.socket()).unwrap();
    hello.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
    write_request(
        &mut hello,
        &Request::Hello {
            version: agora_protocol::PROTOCOL_VERSION,
            client_name: "c".repeat(MAX_NAME + 1),
            heap_bytes: None,
        },
    );
    assert!(matches!(
        read_reply(&mut hello).1,
        Response::Error(ControlError::NameTooLong { what, .. }) if what == "client"
    ));
    let session = daemon.session("names", None);
    let e = session.kernel(&"s".repeat(MAX_NAME + 1)).unwrap_err();
    assert!(e.to_string().contains("too long"), "{e}");
    let e = session.queue(&"q".repeat(MAX_NAME + 1)).unwrap_err();
    assert!(matches!(e, Error::Control(ControlError::NameTooLong { .. })), "{e:?}");
    // A name at the limit is fine.
    assert!(session.queue(&"q".repeat(MAX_NAME)).is_ok());
    assert!(session.kernel("saxpy").is_ok());
}

#[test]
fn names_that_would_rewrite_an_operators_terminal_are_refused_and_nothing_is_lost() {
    let daemon = Daemon::start("terminal-names");
    // A client name with an escape sequence and a forged status line: refused, the name not
    // echoed; the same connection then opens a session under a printable name.
    let mut hello = UnixStream::connect(daemon.socket()).unwrap();
    hello.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
    let hostile = "\u{1b}[2J\u{1b}[H  #1    sshd             pid 1       uid 0";
    let hello_as = |stream: &mut UnixStream, name: &str| {
        write_request(
            stream,
            &Request::Hello {
                version: agora_protocol::PROTOCOL_VERSION,
                client_name: name.into(),
                heap_bytes: Some(1 << 16),
            },
        );
        read_reply(stream).1
    };
    match hello_as(&mut hello, hostile) {
        Response::Error(ControlError::BadRequest(message)) => {
            assert!(
                message.contains("client name holds U+001B") && !message.contains('\u{1b}'),
                "{message}"
            )
        }
        other => panic!("a client name with an escape sequence: {other:?}"),
    }
    assert!(matches!(hello_as(&mut hello, "printable"), Response::Welcome { .. }));
    // Queue names: a newline and a text-direction override, refused; the session carries on.
    for (name, code) in [("q\n  #2    root", "U+000A"), ("report\u{202e}fdp.exe", "U+202E")] {
        write_request(
            &mut hello,
            &Request::CreateQueue {
                name: name.into(),
                class: Default::default(),
                preferred_device: None,
                sla_ms: None,
            },
        );
        match read_reply(&mut hello).1 {
            Response::Error(ControlError::BadRequest(message)) => {
                assert!(message.contains(&format!("queue name holds {code}")), "{message}")
            }
            other => panic!("queue {name:?}: {other:?}"),
        }
    }
    write_request(
        &mut hello,
        &Request::CreateQueue {
            name: "données".into(),
            class: Default::default(),
            preferred_device: None,
            sla_ms: None,
        },
    );
    assert!(matches!(read_reply(&mut hello).1, Response::Queue { .. }));
    // The client library refuses such a name before sending it.
    let refused = Session::connect_with(SessionOptions {
        socket: Some(daemon.socket()),
        name: Some("tab\there".into()),
        ..Default::default()
    });
    assert!(
        matches!(&refused, Err(Error::Control(ControlError::BadRequest(m))) if m.contains("U+0009")),
        "{:?}",
        refused.err()
    );
    // What the operator sees: the printable session and queue, and no escape byte at all.
    let (ok, out, err) = daemon.agora(&["status"]);
    assert!(ok, "{err}");
    assert!(out.contains("printable") && out.contains("données"), "{out}");
    assert!(!out.contains('\u{1b}') && !out.contains("sshd"), "{out}");
}

#[test]
fn status_stays_within_the_frame_limit_whatever_tenants_create() {
    let daemon = Daemon::start("status");
    // 4 sessions × 4096 queues, each named with the longest name allowed.
    let sessions: Vec<Session> = (0..4).map(|i| daemon.session(&format!("tenant{i}"), None)).collect();
    let mut queues = Vec::new();
    for (i, s) in sessions.iter().enumerate() {
        for q in 0..4096 {
            let name = format!("s{i}q{q:04}-");
            queues.push(
                s.queue(&format!("{name}{}", "x".repeat(MAX_NAME - name.len())))
                    .unwrap(),
            );
        }
    }
    // The summary is one small frame.
    let mut raw = UnixStream::connect(daemon.socket()).unwrap();
    raw.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
    write_request(&mut raw, &Request::Status);
    let (len, reply) = read_reply(&mut raw);
    eprintln!("status with 4 sessions x 4096 queues of {MAX_NAME}-byte names: a {len}-byte reply");
    assert!(len < MAX_FRAME as usize / 2, "{len} bytes");
    let Response::Status(report) = reply else {
        panic!("{reply:?}")
    };
    assert_eq!(report.live_sessions, 4);
    assert_eq!(report.sessions.len(), 4);
    for s in &report.sessions {
        assert_eq!(s.queue_count, 4096);
        assert_eq!(s.queues.len(), STATUS_QUEUES);
    }
    // `agora status` works, and says where the rest is.
    let (ok, out, err) = daemon.agora(&["status"]);
    assert!(ok, "{err}");
    assert!(out.contains("sessions: 4 live"), "{out}");
    assert!(
        out.contains("4088 more queue(s)") && out.contains("agora status --session"),
        "{out}"
    );
    // One session's details list every queue, in pages.
    let id = sessions[2].id();
    let (ok, out, err) = daemon.agora(&["status", "--session", &id.to_string(), "--json"]);
    assert!(ok, "{err}");
    let details: serde_json::Value = serde_json::from_str(&out).unwrap();
    let listed = details["queues"].as_array().unwrap();
    assert_eq!(listed.len(), 4096);
    assert_eq!(details["queue_count"], 4096);
    assert!(listed.iter().all(|q| q["name"].as_str().unwrap().starts_with("s2q")));
    let mut names: Vec<&str> = listed.iter().map(|q| q["name"].as_str().unwrap()).collect();
    names.dedup();
    assert_eq!(names.len(), 4096, "no queue listed twice");
    let own = sessions[0].session_status(sessions[0].id()).unwrap();
    assert_eq!(own.queues.len(), 4096);
    // A session that does not exist: a clear error.
    let (ok, _, err) = daemon.agora(&["status", "--session", "999999"]);
    assert!(!ok && err.contains("no live session #999999"), "{err}");
    // Top works too.
    let (ok, out, err) = daemon.agora(&["top", "--once", "--json"]);
    assert!(ok, "{err}");
    let top: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert_eq!(top["live_sessions"], 4);
    assert!(top["tenants"]
        .as_array()
        .unwrap()
        .iter()
        .all(|t| t["queue_count"] == 4096));
}

#[test]
fn status_lists_the_busiest_sessions_when_there_are_many() {
    let daemon = Daemon::start("many");
    let n = STATUS_SESSIONS + 20;
    let sessions: Vec<Session> = (0..n).map(|i| daemon.session(&format!("t{i}"), None)).collect();
    // One session with work in flight must be among those listed.
    let busy = &sessions[n - 1];
    let q = busy.queue("busy").unwrap();
    let saxpy = busy.kernel("saxpy").unwrap();
    let x = busy.buffer(4 << 10).unwrap();
    let y = busy.buffer(4 << 10).unwrap();
    for _ in 0..2000 {
        let _ = q.launch(&saxpy, &[agora::Arg::F32(1.0), (&x).into(), (&y).into()], 1024usize);
    }
    let report = agora::daemon_status(Some(daemon.socket())).unwrap();
    assert_eq!(report.live_sessions, n as u64);
    assert_eq!(report.sessions.len(), STATUS_SESSIONS);
    assert!(report.sessions.windows(2).all(|w| w[0].id < w[1].id), "listed by id");
    assert!(report
        .sessions
        .iter()
        .any(|s| s.id == busy.id() && s.tasks_submitted > 0));
    let (ok, out, err) = daemon.agora(&["status"]);
    assert!(ok, "{err}");
    assert!(out.contains("and 20 more session(s)"), "{out}");
    q.finish().unwrap();
}

#[test]
fn control_calls_time_out_and_the_session_recovers() {
    let daemon = Daemon::start("timeout");
    let session = daemon.session("patient", Some(Duration::from_millis(300)));
    let before = session.buffer(64).unwrap();
    before.write(0, &[7u8; 64]).unwrap();
    // A daemon that does not answer (stopped).
    daemon.signal("-STOP");
    let started = Instant::now();
    let e = session.buffer(128).unwrap_err();
    let took = started.elapsed();
    assert!(
        matches!(&e, Error::Timeout { request, .. } if request == "buffer allocation"),
        "{e:?}"
    );
    assert!(e.to_string().contains("control_timeout"), "{e}");
    assert!(
        took >= Duration::from_millis(300) && took < Duration::from_secs(5),
        "{took:?}"
    );
    daemon.signal("-CONT");
    // The late reply is skipped: the next calls get their own replies.
    let after = session.buffer(256).unwrap();
    assert_eq!(after.len(), 256);
    let q = session.queue("after").unwrap();
    q.memset(&after, 3).unwrap();
    q.sync_from(&after).unwrap();
    q.finish().unwrap();
    assert!(after.as_slice::<u8>().iter().all(|b| *b == 3));
    assert!(before.as_slice::<u8>().iter().all(|b| *b == 7));
    assert!(session.kernel("saxpy").is_ok());
}
