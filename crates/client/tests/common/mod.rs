//! Shared by the client's integration tests: an in-process daemon on a private socket.

#![allow(dead_code)] // each test file uses a different part

use agora::{Session, SessionOptions};

/// Starts a daemon (CPU with two lanes, plus OpenCL devices when found) on a private socket and
/// opens a session with it.
pub fn daemon(tag: &str) -> (agora_daemon::DaemonHandle, Session) {
    let dir = std::env::temp_dir().join(format!("agora-client-test-{tag}-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let socket = dir.join("agora.sock");
    let config = agora_daemon::DaemonConfig {
        socket: socket.clone(),
        cpu_lanes: 2,
        state_dir: dir.join("state"),
        ..Default::default()
    };
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
