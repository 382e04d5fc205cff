//! The atomics the segment header and the rings use: `std`'s normally, loom's under
//! `--cfg loom`, so the model tests in `tests/loom.rs` (`bash scripts/loom.sh`) run the real
//! ring code against loom's model of the C11 memory model. Nothing else changes between the
//! two builds.

#[cfg(not(loom))]
pub use std::sync::atomic::{fence, AtomicU32, AtomicU64, Ordering};

#[cfg(loom)]
pub use loom::sync::atomic::{fence, AtomicU32, AtomicU64, Ordering};
