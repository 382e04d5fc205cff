//! Memory: where buffers live.
//!
//! Today every device of the node shares host memory (the CPU device computes on the session
//! segment in place), so a buffer's only copy is its host copy in the session heap and this
//! module owns the heap allocator. Device copies, valid-copy tracking and eviction arrive with
//! the first device that has memory of its own.
//!
//! Must not launch kernels or know about queues.

mod heap;

pub(crate) use heap::Heap;

/// A live buffer: a range of its session's heap. Jobs hold an `Arc` to it while they run, so a
/// released buffer's range is reused only after the last task that names it has finished.
#[derive(Debug)]
pub(crate) struct BufferRecord {
    /// Heap-relative offset.
    pub offset: u64,
    /// Length in bytes.
    pub len: u64,
}
