//! What a running daemon claims on the file system: its socket path and its state directory.
//!
//! Owns: the lock files that make each claim exclusive for the daemon's life (`flock`, which the
//! kernel releases when the process dies, so a killed daemon never blocks the next one), and the
//! identity (device, inode, change time) of the socket file the daemon put in place, so that it
//! removes that file and never one that another daemon put at the same path since.
//!
//! Why both: a socket path that answers tells a starting daemon that another one runs there, but
//! two daemons starting at the same instant both found it free and both moved their socket into
//! place (the first one left listening on a file nobody can reach), and a daemon whose socket a
//! `/tmp` cleaner removed looked gone — a second one started, and the first one's shutdown then
//! removed the second one's socket. Two daemons given one state directory overwrote each other's
//! performance model, job records and checkpoints.
//!
//! Must not: decide what goes into the state directory, or remove a lock file (removing it
//! while another daemon waits to take it would let two daemons hold "the" lock).

use std::fs::File;
use std::io::{Read, Seek, Write};
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};

use crate::DaemonError;

/// An exclusive claim, held while this value lives (its lock file stays behind, unlocked).
#[derive(Debug)]
pub(crate) struct Claim {
    _file: File,
}

/// What the running daemon holds: its claims, and the socket file it put in place.
#[derive(Debug)]
pub(crate) struct Ownership {
    pub socket_file: SocketFile,
    pub _claims: Vec<Option<Claim>>,
}

/// Why a claim could not be taken.
enum Refused {
    /// Another live process holds it; its pid, as it wrote it (when readable).
    Held(Option<u32>),
    /// The lock file cannot be created or locked.
    Io(std::io::Error),
}

/// Takes the lock at `path` (created if missing) without waiting, and writes this process's pid
/// into it for whoever is refused next.
fn lock(path: &Path) -> Result<Claim, Refused> {
    let mut file = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(false)
        .open(path)
        .map_err(Refused::Io)?;
    match rustix::fs::flock(&file, rustix::fs::FlockOperation::NonBlockingLockExclusive) {
        Ok(()) => {}
        Err(rustix::io::Errno::WOULDBLOCK) => {
            let mut text = String::new();
            let _ = file.read_to_string(&mut text);
            return Err(Refused::Held(text.trim().parse().ok()));
        }
        Err(e) => return Err(Refused::Io(e.into())),
    }
    // Only the holder writes: the pid is for messages, never trusted for anything else.
    let _ = file.set_len(0);
    let _ = file.rewind();
    let _ = writeln!(file, "{}", std::process::id());
    Ok(Claim { _file: file })
}

fn holder(pid: Option<u32>) -> String {
    pid.map_or_else(
        || "another daemon".to_string(),
        |pid| format!("another daemon (pid {pid})"),
    )
}

/// The lock file that guards the socket at `socket`: beside it, hidden (`.NAME.lock`).
fn socket_lock_path(socket: &Path) -> PathBuf {
    let name = socket.file_name().map(|n| n.to_string_lossy()).unwrap_or_default();
    socket.with_file_name(format!(".{name}.lock"))
}

/// Claims the socket path `socket` (whose directory exists) for this daemon.
pub(crate) fn claim_socket(socket: &Path) -> Result<Claim, DaemonError> {
    let lock_path = socket_lock_path(socket);
    lock(&lock_path).map_err(|refused| match refused {
        Refused::Held(pid) => DaemonError::Socket(format!(
            "{} serves {}{}; stop it first, or pick another path with --socket / AGORA_SOCKET",
            holder(pid),
            socket.display(),
            if socket.exists() {
                String::new()
            } else {
                format!(
                    " although the socket file is gone (removed by a clean-up of its directory?): it cannot be \
                     reached until it restarts (its lock is {})",
                    lock_path.display()
                )
            },
        )),
        Refused::Io(e) => DaemonError::io(format!("locking {}", lock_path.display()), e),
    })
}

/// Claims the state directory `dir` (created if missing) for this daemon. Another running
/// daemon's directory is refused: the two would overwrite each other's performance model, job
/// records and checkpoints. A directory that cannot be used at all (a file, not writable) is not
/// (issue 20: stale or broken state never stops a daemon from serving): the daemon warns, once,
/// that nothing it would keep there survives it, and runs without the claim.
pub(crate) fn claim_state_dir(dir: &Path) -> Result<Option<Claim>, DaemonError> {
    let fix = "give it a writable directory of its own with --state-dir, AGORA_STATE_DIR or [daemon] state_dir";
    let unusable = |why: String| {
        tracing::warn!(
            "state directory {}: {why}; the daemon serves, but keeps nothing there — its learned performance \
             model, Slurm job records and checkpoints will be lost; {fix}",
            dir.display()
        );
        Ok(None)
    };
    if let Err(e) = std::fs::create_dir_all(dir) {
        return unusable(if dir.is_file() {
            "it is a file, not a directory".to_string()
        } else {
            format!("cannot be created: {e}")
        });
    }
    let lock_path = dir.join("daemon.lock");
    match lock(&lock_path) {
        Ok(claim) => Ok(Some(claim)),
        Err(Refused::Held(pid)) => Err(DaemonError::StateDirectory(format!(
            "state directory {}: {} uses it (two daemons would overwrite each other's performance model, \
             job records and checkpoints); {fix}",
            dir.display(),
            holder(pid)
        ))),
        Err(Refused::Io(e)) => unusable(format!("cannot write in it ({}: {e})", lock_path.display())),
    }
}

/// The socket file this daemon put in place: removed on shutdown only while it is still that
/// file.
#[derive(Debug, Clone)]
pub(crate) struct SocketFile {
    path: PathBuf,
    identity: Option<Identity>,
}

/// What is at a daemon's socket path while it runs ([`SocketFile::state`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum SocketState {
    /// The socket this daemon put there.
    Ours,
    /// Nothing: removed (a `/tmp` cleaner, a careless `rm`); clients cannot reach the daemon.
    Missing,
    /// Another file (not another daemon's: the socket's claim keeps them out).
    Replaced,
}

/// What tells one file at a path from another put there later: its device and inode — which a
/// file system reuses at once for the next file created — and its change time.
type Identity = (u64, u64, i64, i64);

fn identity(path: &Path) -> Option<Identity> {
    std::fs::symlink_metadata(path)
        .ok()
        .map(|m| (m.dev(), m.ino(), m.ctime(), m.ctime_nsec()))
}

impl SocketFile {
    /// The socket now at `path` (just moved there by this daemon).
    pub(crate) fn placed(path: &Path) -> SocketFile {
        SocketFile {
            path: path.to_path_buf(),
            identity: identity(path),
        }
    }

    /// What is at the socket's path now.
    pub(crate) fn state(&self) -> SocketState {
        match identity(&self.path) {
            None => SocketState::Missing,
            now if now == self.identity => SocketState::Ours,
            Some(_) => SocketState::Replaced,
        }
    }

    /// The socket's path.
    pub(crate) fn path(&self) -> &Path {
        &self.path
    }

    /// Removes the socket file, unless another daemon's is there now (or it is gone).
    pub(crate) fn remove(&self) {
        let now = identity(&self.path);
        if now.is_some() && now == self.identity {
            let _ = std::fs::remove_file(&self.path);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_claim_is_exclusive_and_names_its_holder() {
        let dir = tempfile::tempdir().unwrap();
        let state = dir.path().join("state");
        let first = claim_state_dir(&state).unwrap();
        let refused = claim_state_dir(&state).unwrap_err().to_string();
        assert!(
            refused.contains(&format!("pid {}", std::process::id())) && refused.contains("--state-dir"),
            "{refused}"
        );
        drop(first);
        claim_state_dir(&state).expect("free again once its holder is gone");
    }

    #[test]
    fn a_state_directory_that_is_a_file_is_served_without() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("state");
        std::fs::write(&file, "").unwrap();
        assert!(claim_state_dir(&file).unwrap().is_none());
    }

    #[test]
    fn a_socket_file_knows_whether_it_is_still_at_its_path() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("s.sock");
        let _listener = std::os::unix::net::UnixListener::bind(&path).unwrap();
        let placed = SocketFile::placed(&path);
        assert_eq!(placed.state(), SocketState::Ours);
        std::fs::remove_file(&path).unwrap();
        assert_eq!(placed.state(), SocketState::Missing);
        std::fs::write(&path, b"").unwrap();
        assert_eq!(placed.state(), SocketState::Replaced);
    }

    #[test]
    fn a_socket_file_replaced_by_another_is_left_alone() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("a.sock");
        std::fs::write(&path, "mine").unwrap();
        let mine = SocketFile::placed(&path);
        // Another daemon's, moved into place as a daemon does (after a clean-up removed ours).
        std::thread::sleep(std::time::Duration::from_millis(20));
        let staging = dir.path().join(".a.sock.2");
        std::fs::write(&staging, "another daemon's").unwrap();
        std::fs::remove_file(&path).unwrap();
        std::fs::rename(&staging, &path).unwrap();
        mine.remove();
        assert!(path.exists(), "another daemon's socket stays");
        let theirs = SocketFile::placed(&path);
        theirs.remove();
        assert!(!path.exists());
    }
}
