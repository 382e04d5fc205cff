//! The store's typed errors.
//!
//! Owns the wording of every failure a caller can see: each message names the path, the
//! application or the check that failed and, where there is one, what to do about it. It must
//! not decide policy (what is retried, what is fatal): that is the daemon's.

use std::io;
use std::path::PathBuf;

use crate::config::Level;

/// Why a store operation failed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum StoreError {
    /// The configuration cannot work; `what` says which key and why.
    #[error("bad checkpoint store configuration: {what}")]
    BadConfig {
        /// The key and the rule it broke.
        what: String,
    },
    /// An application name that cannot be a single safe directory name.
    #[error(
        "bad checkpoint application name {name:?}: {why} (use 1 to 128 bytes of A-Z a-z 0-9 . _ -, not starting with '.')"
    )]
    BadName {
        /// The name as given.
        name: String,
        /// Which rule it broke.
        why: &'static str,
    },
    /// A level name that is none of `l1`..`l4`.
    #[error("unknown checkpoint level {given:?}: use one of l1, l2, l3, l4")]
    BadLevel {
        /// The name as given.
        given: String,
    },
    /// A level that needs a directory the configuration does not have.
    #[error("checkpoint level {level} needs the `{key}` directory, which is not configured: set `{key}` in the store configuration or use level l1")]
    LevelNotConfigured {
        /// The level asked for.
        level: Level,
        /// The configuration key it needs.
        key: &'static str,
    },
    /// A level whose directory is configured but unusable (see [`crate::Unusable`]).
    #[error("{message}")]
    LevelUnusable {
        /// [`crate::Unusable::message`]: the key, the directory, the reason and what to do.
        message: String,
    },
    /// A write whose sequence number does not exceed the newest existing checkpoint's.
    #[error("checkpoint {sequence} of {app} is stale: checkpoint {newest} already exists; number new checkpoints above {newest}")]
    StaleSequence {
        /// The application, as `uid/name`.
        app: String,
        /// The sequence number refused.
        sequence: u64,
        /// The newest sequence number present.
        newest: u64,
    },
    /// The write would take the user's checkpoints past their quota; nothing was written.
    #[error("checkpoint {sequence} would bring uid {uid}'s checkpoints to {would} bytes, over the quota of {quota} ([checkpoint] quota_per_user); nothing was written and the earlier checkpoints are intact: remove checkpoints of applications the user no longer needs, keep fewer (`keep`), or ask the operator to raise the quota")]
    QuotaExceeded {
        /// The user.
        uid: u32,
        /// The checkpoint refused.
        sequence: u64,
        /// Bytes the user's checkpoints would take with it.
        would: u64,
        /// The quota.
        quota: u64,
    },
    /// Two entries of one capture share an id, so recovery could not tell them apart.
    #[error("capture has two entries with id {id}: give each protected buffer its own id")]
    DuplicateEntry {
        /// The repeated id.
        id: u32,
    },
    /// A file system operation failed.
    #[error("checkpoint store could not {action} {}: {source}{}", path.display(), io_advice(source))]
    Io {
        /// What the store was doing ("create directory", "write block", …).
        action: &'static str,
        /// The path it was doing it to.
        path: PathBuf,
        /// The operating system's error.
        #[source]
        source: io::Error,
    },
    /// Encoding a checkpoint failed (erasure coding or manifest serialisation); a bug or a
    /// capture too large for the configured shards.
    #[error("could not encode checkpoint: {what}")]
    Encode {
        /// What went wrong.
        what: String,
    },
    /// Checkpoints exist but none verifies.
    #[error(
        "no intact checkpoint of {app}: {}; restart the application from the beginning or restore its checkpoint directories from a backup",
        problems.join("; ")
    )]
    NoIntactCheckpoint {
        /// The application, as `uid/name`.
        app: String,
        /// One message per checkpoint, newest first, saying what was wrong with it.
        problems: Vec<String>,
    },
}

/// What to do about an I/O error, where there is something.
fn io_advice(source: &io::Error) -> &'static str {
    match source.kind() {
        io::ErrorKind::StorageFull | io::ErrorKind::QuotaExceeded => {
            "; the file system is full: what this write had added was removed and the earlier checkpoints are \
             intact; free space there, keep fewer checkpoints ([checkpoint] keep), or set a quota below the \
             free space ([checkpoint] quota_per_user)"
        }
        io::ErrorKind::ReadOnlyFilesystem => {
            "; the file system is read-only: remount it writable or configure another directory"
        }
        io::ErrorKind::NotADirectory | io::ErrorKind::NotFound => {
            "; the directory is gone or replaced by a file: make it again (mode 0700, owned by the daemon's user) \
             or configure another one"
        }
        _ => "",
    }
}

impl StoreError {
    /// An [`StoreError::Io`] for `action` on `path`.
    pub(crate) fn io(action: &'static str, path: impl Into<PathBuf>, source: io::Error) -> Self {
        StoreError::Io {
            action,
            path: path.into(),
            source,
        }
    }
}
