//! Shared by the client's integration tests: an in-process daemon on a private socket.

#![allow(dead_code)] // each test file uses a different part

use agora::{Session, SessionOptions};

/// Starts a daemon (CPU with two lanes, plus OpenCL devices when found) on a private socket and
/// opens a session with it. Strict coherence is on (every device computes on its own copies), so
/// a test that forgets a sync fails wherever its tasks run; tests that check placement details
/// (bytes moved, inline runs) use [`daemon_with`], which leaves it off.
pub fn daemon(tag: &str) -> (agora_daemon::DaemonHandle, Session) {
    daemon_with(tag, |c| c.strict_coherence = true)
}

/// The socket of the daemon [`daemon_with`] starts for `tag`.
pub fn socket_path(tag: &str) -> std::path::PathBuf {
    directory(tag).join("agora.sock")
}

fn directory(tag: &str) -> std::path::PathBuf {
    std::env::temp_dir().join(format!("agora-client-test-{tag}-{}", std::process::id()))
}

/// Like [`daemon`], with settings changed by `tweak` first; the directory starts empty.
pub fn daemon_with(
    tag: &str,
    tweak: impl FnOnce(&mut agora_daemon::DaemonConfig),
) -> (agora_daemon::DaemonHandle, Session) {
    let dir = directory(tag);
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let mut config = agora_daemon::DaemonConfig {
        socket: dir.join("agora.sock"),
        cpu_lanes: 2,
        state_dir: dir.join("state"),
        ..Default::default()
    };
    tweak(&mut config);
    let socket = config.socket.clone();
    let handle = agora_daemon::spawn(config).expect("daemon starts");
    let session = Session::connect_with(SessionOptions {
        socket: Some(socket),
        ..Default::default()
    })
    .unwrap();
    (handle, session)
}

/// Fails (never skips) when the daemon has no OpenCL device.
pub fn require_opencl(session: &Session) {
    let status = session.status().unwrap();
    assert!(
        status.devices.iter().any(|d| d.kind == "opencl"),
        "no OpenCL device found: run `make setup` (installs PoCL); devices: {:?}",
        status.devices.iter().map(|d| &d.name).collect::<Vec<_>>()
    );
}
