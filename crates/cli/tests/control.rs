//! The control plane against a real `agora serve` process: malformed control frames close only
//! their own connection, and control requests answered by the control thread (status, kernel
//! listings and lookups, trace saves) arrive whole while tasks run beside them.

use std::io::{Read, Write};
use std::os::unix::net::UnixStream;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use agora::{Arg, Session, SessionOptions};
use agora_protocol::control::{encode_frame, Request, MAX_FRAME};

const AGORA: &str = env!("CARGO_BIN_EXE_agora");

/// An `agora serve` process on a private socket, killed (and its directory removed) on drop.
struct Daemon {
    child: Child,
    socket: PathBuf,
    dir: PathBuf,
}

impl Daemon {
    fn start(tag: &str, extra: &[&str]) -> Daemon {
        let dir = std::env::temp_dir().join(format!("agora-control-{tag}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let socket = dir.join("agora.sock");
        let child = Command::new(AGORA)
            .args(["serve", "--no-opencl", "--socket"])
            .arg(&socket)
            // `{dir}` in an argument is the daemon's own directory.
            .args(extra.iter().map(|a| a.replace("{dir}", &dir.display().to_string())))
            .env("AGORA_LOG", "warn")
            .env("AGORA_STATE_DIR", dir.join("state"))
            .stdout(Stdio::null())
            .spawn()
            .expect("agora serve starts");
        let deadline = Instant::now() + Duration::from_secs(20);
        while UnixStream::connect(&socket).is_err() {
            assert!(Instant::now() < deadline, "the daemon did not listen within 20 s");
            std::thread::sleep(Duration::from_millis(10));
        }
        Daemon { child, socket, dir }
    }

    fn session(&self) -> Session {
        Session::connect_with(SessionOptions {
            socket: Some(self.socket.clone()),
            ..Default::default()
        })
        .unwrap()
    }
}

impl Drop for Daemon {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// A verified saxpy on a small buffer.
fn saxpy_ok(session: &Session) {
    let q = session.queue("check").unwrap();
    let saxpy = session.kernel("saxpy").unwrap();
    let x = session.buffer_from(&vec![1.0f32; 4096]).unwrap();
    let y = session.buffer_from(&vec![2.0f32; 4096]).unwrap();
    q.launch(&saxpy, &[Arg::F32(3.0), (&x).into(), (&y).into()], 4096usize)
        .unwrap();
    q.sync_from(&y).unwrap().wait().unwrap();
    assert!(y.as_slice::<f32>().iter().all(|v| *v == 5.0));
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
    let daemon = Daemon::start("frames", &[]);
    let neighbour = daemon.session();
    // A length beyond the frame limit.
    let mut oversize = UnixStream::connect(&daemon.socket).unwrap();
    oversize.write_all(&(MAX_FRAME + 1).to_le_bytes()).unwrap();
    oversize.write_all(&[0u8; 64]).unwrap();
    assert!(closed_by_daemon(oversize), "an oversize frame closes the connection");
    // A frame whose body is not a request.
    let mut garbage = UnixStream::connect(&daemon.socket).unwrap();
    garbage.write_all(&8u32.to_le_bytes()).unwrap();
    garbage.write_all(&[0xff; 8]).unwrap();
    assert!(closed_by_daemon(garbage), "an undecodable frame closes the connection");
    // A client that asks for status and never reads the replies.
    let mut deaf = UnixStream::connect(&daemon.socket).unwrap();
    let frame = encode_frame(&Request::ListKernels).unwrap();
    for _ in 0..2000 {
        if deaf.write_all(&frame).is_err() {
            break;
        }
    }
    // The daemon and its other clients are unharmed.
    saxpy_ok(&neighbour);
    saxpy_ok(&daemon.session());
    drop(deaf);
}

#[test]
fn control_replies_arrive_whole_while_tasks_run() {
    let daemon = Daemon::start("replies", &["--trace", "{dir}/trace.json"]);
    let session = daemon.session();
    let socket = daemon.socket.clone();
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
        .arg(&daemon.socket)
        .output()
        .unwrap();
    assert!(saved.status.success(), "{}", String::from_utf8_lossy(&saved.stderr));
    let trace = std::fs::read_to_string(daemon.dir.join("trace.json")).expect("the trace file was written");
    assert!(trace.contains("saxpy"));
}
