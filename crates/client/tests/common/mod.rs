//! Shared by the client's integration tests: an in-process daemon on a private socket in a
//! temporary directory (see `agora-test-support`), with the client suite's settings.

#![allow(dead_code, unused_imports)] // each test file uses a different part

use agora::Session;
pub use agora_test_support::{require_opencl, EmbeddedDaemon};

/// Starts a daemon (CPU with two lanes, plus OpenCL devices when found) on a private socket and
/// opens a session with it. Strict coherence is on (every device computes on its own copies), so
/// a test that forgets a sync fails wherever its tasks run; tests that check placement details
/// (bytes moved, inline runs) use [`daemon_with`], which leaves it off.
pub fn daemon(tag: &str) -> (EmbeddedDaemon, Session) {
    daemon_with(tag, |c| c.strict_coherence = true)
}

/// Like [`daemon`], with settings changed by `tweak` first; the directory starts empty.
pub fn daemon_with(tag: &str, tweak: impl FnOnce(&mut agora_daemon::DaemonConfig)) -> (EmbeddedDaemon, Session) {
    let daemon = EmbeddedDaemon::start(&format!("client-{tag}"), |config| {
        config.cpu_lanes = 2;
        tweak(config);
    });
    let session = daemon.session();
    (daemon, session)
}
