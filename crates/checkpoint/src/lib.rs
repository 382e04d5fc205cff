//! The on-disk store of Agora's checkpoint/restart service: data that outlives its process.
//!
//! Owns everything between "here are the bytes of a tenant's protected buffers" and "these bytes
//! are durable, verifiable and recoverable": the directory layout, content-addressed blocks and
//! differential checkpoints (FTI's dCP), replication to a partner or shared directory (levels
//! L2 and L4), Reed–Solomon erasure coding (level L3), manifests with their own integrity hash,
//! retention and garbage collection, and recovery of the newest checkpoint that verifies.
//!
//! It must not know about sessions, devices, sockets or the protocol: the daemon captures the
//! buffers (copy-on-checkpoint into memory it owns) and hands a [`Capture`] to [`Store::write`]
//! on a background thread; at restart it asks [`Store::resume`] ([`Store::latest`], with the
//! damaged checkpoints passed over set aside so that their ids are free again). Everything here
//! is plain file I/O, so it is tested with temporary directories.
//!
//! Crash consistency rests on one rule: a checkpoint is complete exactly when its manifest file
//! exists, and the manifest is renamed into place only after every block or shard it names is
//! durable. A crash therefore leaves the previous complete checkpoints, or the new one, never a
//! half one that looks complete; and anything that was damaged afterwards is caught by hashes at
//! recovery and passed over in favour of an older checkpoint.
//!
//! The store assumes it is the only process writing under its roots (the daemon); within that
//! process it is [`Send`] + [`Sync`] and serialises the work on each application.

#![forbid(unsafe_code)]

mod config;
mod erasure;
mod error;
mod fsio;
mod manifest;
mod store;

pub use config::{
    AppKey, Capture, CheckpointInfo, Entry, Level, Recovered, StoreConfig, WriteReport, MAX_BLOCK_BYTES, MAX_SHARDS,
    MIN_BLOCK_BYTES,
};
pub use error::StoreError;
pub use store::{Store, Unusable};

// The daemon shares one store between its checkpoint writer thread and its control thread: keep
// that a compile-time guarantee rather than a test that could be forgotten.
const _: fn() = || {
    fn assert_send_sync<T: Send + Sync>() {}
    assert_send_sync::<Store>();
};
