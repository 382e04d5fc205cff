//! The control plane against a real `agora serve` process: malformed control frames close only
//! their own connection, and control requests answered by the control thread (status, kernel
//! listings and lookups, trace saves) arrive whole while tasks run beside them.

use std::io::{Read, Write};
use std::os::unix::net::UnixStream;
use std::process::Command;
use std::time::Duration;

use agora::Arg;
use agora_protocol::control::{encode_frame, Request, MAX_FRAME};
use agora_test_support::{saxpy_ok, Daemon};

const AGORA: &str = env!("CARGO_BIN_EXE_agora");

/// `agora serve --no-opencl --socket S EXTRA` on a private socket, killed when dropped; `{dir}`
/// in an argument is the daemon's own directory.
fn start(tag: &str, extra: &[&str]) -> Daemon {
    let mut args = vec!["--no-opencl"];
    args.extend_from_slice(extra);
    Daemon::start(AGORA, &format!("control-{tag}"), &args)
}

/// Whether the daemon closed `stream` (reads end-of-file within a few seconds).
fn closed_by_daemon(mut stream: UnixStream) -> bool {
    stream.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    let mut byte = [0u8; 64];
    loop {
        match stream.read(&mut byte) {
            Ok(0) => return true,
            Ok(_) => continue,
            Err(e) if e.kind() == std::io::ErrorKind::ConnectionReset => return true,
            Err(_) => return false,
        }
    }
}

#[test]
fn malformed_control_frames_close_only_their_connection() {
    let daemon = start("frames", &[]);
    let neighbour = daemon.session();
    // A length beyond the frame limit.
    let mut oversize = UnixStream::connect(daemon.socket()).unwrap();
    oversize.write_all(&(MAX_FRAME + 1).to_le_bytes()).unwrap();
    // The daemon may close as soon as it read the length: this write may fail (EPIPE).
    let _ = oversize.write_all(&[0u8; 64]);
    assert!(closed_by_daemon(oversize), "an oversize frame closes the connection");
    // A frame whose body is not a request.
    let mut garbage = UnixStream::connect(daemon.socket()).unwrap();
    garbage.write_all(&8u32.to_le_bytes()).unwrap();
    garbage.write_all(&[0xff; 8]).unwrap();
    assert!(closed_by_daemon(garbage), "an undecodable frame closes the connection");
    // A client that asks for status and never reads the replies.
    let mut deaf = UnixStream::connect(daemon.socket()).unwrap();
    let frame = encode_frame(&Request::ListKernels).unwrap();
    for _ in 0..2000 {
        if deaf.write_all(&frame).is_err() {
            break;
        }
    }
    // The daemon and its other clients are unharmed.
    saxpy_ok(&neighbour, 4096);
    saxpy_ok(&daemon.session(), 4096);
    drop(deaf);
}

#[test]
fn control_replies_arrive_whole_while_tasks_run() {
    let daemon = start("replies", &["--trace", "{dir}/trace.json"]);
    let session = daemon.session();
    let socket = daemon.socket().to_path_buf();
    let asking = std::thread::spawn(move || {
        for i in 0..200 {
            let status = agora::daemon_status(Some(socket.clone())).expect("status answers");
            assert!(!status.devices.is_empty() && status.pid > 0, "reply {i} is whole");
        }
    });
    let q = session.queue("busy").unwrap();
    let saxpy = session.kernel("saxpy").unwrap();
    let x = session.buffer_from(&vec![1.0f32; 1024]).unwrap();
    let y = session.buffer_from(&vec![0.0f32; 1024]).unwrap();
    for _ in 0..2000 {
        q.launch(&saxpy, &[Arg::F32(1.0), (&x).into(), (&y).into()], 1024usize)
            .unwrap();
    }
    q.sync_from(&y).unwrap().wait().unwrap();
    assert!(y.as_slice::<f32>().iter().all(|v| *v == 2000.0));
    asking.join().unwrap();
    // Lookups (with their suggestions), listings and a trace save, answered off the dispatcher.
    let e = session.kernel("saxpi").unwrap_err().to_string();
    assert!(e.contains("did you mean saxpy"), "{e}");
    assert!(session.kernels().unwrap().iter().any(|k| k.name == "saxpy"));
    let saved = Command::new(AGORA)
        .args(["trace", "save", "--socket"])
        .arg(daemon.socket())
        .output()
        .unwrap();
    assert!(saved.status.success(), "{}", String::from_utf8_lossy(&saved.stderr));
    let trace = std::fs::read_to_string(daemon.dir().join("trace.json")).expect("the trace file was written");
    assert!(trace.contains("saxpy"));
}

/// An operator can bound how long `agora status` waits for a stuck daemon with
/// `AGORA_CONTROL_TIMEOUT` (audit A13), and the error names that variable; before, the wait was
/// 30 s and the error named only a Rust option. The "daemon" here accepts and never answers.
#[test]
fn agora_control_timeout_bounds_a_command_against_a_stuck_daemon() {
    let scratch = agora_test_support::temp_dir("control-timeout");
    let socket = scratch.path().join("stuck.sock");
    let _listener = std::os::unix::net::UnixListener::bind(&socket).unwrap();
    let started = std::time::Instant::now();
    let out = Command::new(AGORA)
        .args(["status", "--socket"])
        .arg(&socket)
        .env("AGORA_CONTROL_TIMEOUT", "0.5")
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{err}");
    assert!(
        started.elapsed() < Duration::from_secs(20),
        "waited {:?}",
        started.elapsed()
    );
    assert!(
        err.contains("within 0.5 s") && err.contains("$AGORA_CONTROL_TIMEOUT"),
        "{err}"
    );
    let out = Command::new(AGORA)
        .args(["status", "--socket"])
        .arg(&socket)
        .env("AGORA_CONTROL_TIMEOUT", "soon")
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success() && err.contains("AGORA_CONTROL_TIMEOUT=\"soon\"") && !err.contains("bad request"),
        "{err}"
    );
}
