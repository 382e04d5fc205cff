//! The store's vocabulary: levels, configuration, application keys, and the values that go in
//! and come out.
//!
//! Owns the validation of what callers hand in (a configuration that cannot work, an application
//! name that is not one safe directory name). It must not touch the file system.

use std::fmt;
use std::path::PathBuf;
use std::str::FromStr;

use serde::{Deserialize, Serialize};

use crate::error::StoreError;

/// How a checkpoint is made durable, after FTI's four levels.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Level {
    /// Node-local fast directory only: survives the process, not the disk.
    L1,
    /// Local plus a partner directory: survives losing either copy.
    L2,
    /// Reed–Solomon erasure coded shards under the local directory: survives losing any
    /// `parity_shards` of the shard files.
    L3,
    /// Local plus a shared (parallel) file system: survives losing the node.
    L4,
}

impl Level {
    /// Every level, in order.
    pub const ALL: [Level; 4] = [Level::L1, Level::L2, Level::L3, Level::L4];

    /// The level named `name` (`"l1"`..`"l4"`, case-insensitive).
    pub fn parse(name: &str) -> Result<Level, StoreError> {
        match name.to_ascii_lowercase().as_str() {
            "l1" => Ok(Level::L1),
            "l2" => Ok(Level::L2),
            "l3" => Ok(Level::L3),
            "l4" => Ok(Level::L4),
            _ => Err(StoreError::BadLevel { given: name.to_owned() }),
        }
    }

    /// The level's name as in manifests and messages: `"l1"`..`"l4"`.
    pub fn name(self) -> &'static str {
        match self {
            Level::L1 => "l1",
            Level::L2 => "l2",
            Level::L3 => "l3",
            Level::L4 => "l4",
        }
    }
}

impl fmt::Display for Level {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for Level {
    type Err = StoreError;

    fn from_str(s: &str) -> Result<Level, StoreError> {
        Level::parse(s)
    }
}

/// Where and how the store keeps checkpoints.
///
/// There is deliberately no `Default`: the local directory has no sensible default (a
/// placeholder would scatter tenants' data somewhere nobody chose). Use [`StoreConfig::new`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct StoreConfig {
    /// L1: the node-local fast directory; every level writes (at least) here.
    pub local: PathBuf,
    /// L2: a second directory holding a full copy (later: a partner node's mount).
    pub partner: Option<PathBuf>,
    /// L4: a parallel/shared file system path holding a full copy.
    pub shared: Option<PathBuf>,
    /// Block size of differential checkpoints, 4 KiB..=64 MiB: smaller finds more unchanged
    /// data, larger means fewer files.
    pub block_bytes: u64,
    /// L3 Reed–Solomon data shards (k), at least 1.
    pub data_shards: usize,
    /// L3 Reed–Solomon parity shards (m), at least 1: L3 survives the loss of any m of the k+m
    /// shard files.
    pub parity_shards: usize,
    /// Complete checkpoints kept per application, at least 1; older ones are deleted after each
    /// successful write.
    pub keep: usize,
    /// Most bytes one user's checkpoints may take in all the store's directories together
    /// (`None`: no limit). A write that would pass it fails before writing anything, so the
    /// user's earlier checkpoints stay intact.
    pub quota_per_user: Option<u64>,
    /// Test-only: sleep this long after a checkpoint's data is durable and before its manifest
    /// is written, so that a test can kill the writer in the middle of a checkpoint.
    pub test_pause_before_manifest: Option<std::time::Duration>,
}

/// Smallest allowed [`StoreConfig::block_bytes`].
pub const MIN_BLOCK_BYTES: u64 = 4 << 10;
/// Largest allowed [`StoreConfig::block_bytes`].
pub const MAX_BLOCK_BYTES: u64 = 64 << 20;
/// Most [`StoreConfig::data_shards`] and [`StoreConfig::parity_shards`] together: GF(2^8)
/// Reed–Solomon has at most 256 shards in all.
pub const MAX_SHARDS: usize = 256;

impl StoreConfig {
    /// A configuration with only the local directory, 64 KiB blocks, 4+2 erasure shards and the
    /// newest 2 checkpoints kept.
    pub fn new(local: PathBuf) -> StoreConfig {
        StoreConfig {
            local,
            partner: None,
            shared: None,
            block_bytes: 64 << 10,
            data_shards: 4,
            parity_shards: 2,
            keep: 2,
            quota_per_user: None,
            test_pause_before_manifest: None,
        }
    }

    /// Checks the rules documented on each field.
    pub(crate) fn validate(&self) -> Result<(), StoreError> {
        let bad = |what: String| Err(StoreError::BadConfig { what });
        if self.keep < 1 {
            return bad("`keep` must be at least 1 (the checkpoint just written)".into());
        }
        if !(MIN_BLOCK_BYTES..=MAX_BLOCK_BYTES).contains(&self.block_bytes) {
            return bad(format!(
                "`block_bytes` is {}, must be between {MIN_BLOCK_BYTES} (4 KiB) and {MAX_BLOCK_BYTES} (64 MiB)",
                self.block_bytes
            ));
        }
        if self.data_shards < 1 || self.parity_shards < 1 {
            return bad(format!(
                "`data_shards` ({}) and `parity_shards` ({}) must each be at least 1",
                self.data_shards, self.parity_shards
            ));
        }
        if self.data_shards.saturating_add(self.parity_shards) > MAX_SHARDS {
            return bad(format!(
                "`data_shards` + `parity_shards` is {}, at most {MAX_SHARDS}",
                self.data_shards.saturating_add(self.parity_shards)
            ));
        }
        if self.local.as_os_str().is_empty() {
            return bad("`local` is empty: name the node-local checkpoint directory".into());
        }
        Ok(())
    }
}

/// Which application a checkpoint belongs to: its owner's uid and its name.
///
/// The name becomes a directory name, so it is restricted to 1..=128 bytes of
/// `[A-Za-z0-9._-]`, not starting with `.` (no `..`, no hidden files, no separators). The store
/// checks this again on every call, since the fields are public.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct AppKey {
    /// The owning user's id: each user's checkpoints live in their own directory.
    pub uid: u32,
    /// The application's name.
    pub name: String,
}

impl AppKey {
    /// The key for `uid`'s application `name`, or [`StoreError::BadName`].
    pub fn new(uid: u32, name: impl Into<String>) -> Result<AppKey, StoreError> {
        let key = AppKey { uid, name: name.into() };
        key.check()?;
        Ok(key)
    }

    /// Checks the name rules.
    pub(crate) fn check(&self) -> Result<(), StoreError> {
        let bad = |why| {
            Err(StoreError::BadName {
                name: self.name.clone(),
                why,
            })
        };
        let n = self.name.as_bytes();
        if n.is_empty() {
            return bad("it is empty");
        }
        if n.len() > 128 {
            return bad("it is longer than 128 bytes");
        }
        if n[0] == b'.' {
            return bad("it starts with '.'");
        }
        if !n
            .iter()
            .all(|&b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'-'))
        {
            return bad("it has a character other than A-Z a-z 0-9 . _ -");
        }
        Ok(())
    }
}

impl fmt::Display for AppKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}", self.uid, self.name)
    }
}

/// One protected buffer (or small scalar) of a checkpoint, by its FTI-style id.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Entry {
    /// The application's id for this buffer; unique within a capture.
    pub id: u32,
    /// The buffer's bytes.
    pub bytes: Vec<u8>,
}

/// What the daemon captured for one checkpoint.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Capture {
    /// The caller's sequence number; must exceed every existing checkpoint's of the application.
    pub sequence: u64,
    /// How to make it durable.
    pub level: Level,
    /// The protected buffers, in the order recovery returns them.
    pub entries: Vec<Entry>,
}

/// What one [`Store::write`](crate::Store::write) did.
#[derive(Clone, Debug, PartialEq)]
pub struct WriteReport {
    /// The checkpoint's sequence number.
    pub sequence: u64,
    /// Its level.
    pub level: Level,
    /// Bytes of all entries together.
    pub bytes_total: u64,
    /// Payload bytes actually written, summed over every directory written to (a block new to
    /// both the local and the partner directory counts twice). Blocks already present are not
    /// rewritten (differential checkpoint); L3 counts every shard byte.
    pub bytes_written: u64,
    /// Distinct blocks of the checkpoint (L3: shards, data and parity).
    pub blocks_total: u64,
    /// Block (L3: shard) files actually written, summed over every directory written to.
    pub blocks_written: u64,
    /// Wall-clock seconds the write took, fsyncs and garbage collection included.
    pub seconds: f64,
}

/// A complete checkpoint as [`Store::list`](crate::Store::list) sees it (from its manifest,
/// without reading its data).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CheckpointInfo {
    /// Its sequence number.
    pub sequence: u64,
    /// Its level.
    pub level: Level,
    /// Bytes of all entries together.
    pub bytes_total: u64,
    /// Number of entries.
    pub entries: usize,
    /// When it was written, milliseconds since the Unix epoch.
    pub created_unix_ms: u64,
}

/// The newest checkpoint that verified, as [`Store::latest`](crate::Store::latest) returns it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Recovered {
    /// Its sequence number.
    pub sequence: u64,
    /// Its level.
    pub level: Level,
    /// Its entries, in the order they were captured, every byte verified.
    pub entries: Vec<Entry>,
    /// One message per newer checkpoint that was damaged and passed over, saying which and why.
    pub skipped: Vec<String>,
}
