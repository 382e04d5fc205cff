//! Layout of the per-client shared-memory segment.
//!
//! ```text
//! offset 0                      header (one page): magic, geometry, ring indices, wake flags
//! submission_offset             submission ring: capacity × TaskDescriptor (client writes)
//! completion_offset             completion ring: capacity × Completion (daemon writes)
//! heap_offset .. total_len      buffer heap: host copies of the client's buffers
//! ```
//!
//! The daemon creates the segment and writes the geometry once. After that the only header words
//! the daemon reads are the ring indices, wake flags and control count the client owns, and it
//! treats each of those as a hostile value (see [`crate::ring`]; the control count only makes
//! it look at the client's socket sooner). Geometry is never read back by the daemon: it
//! keeps its own copy.

use crossbeam_utils::CachePadded;

use crate::completion::Completion;
use crate::descriptor::TaskDescriptor;
use crate::sync::{AtomicU32, AtomicU64, Ordering};

/// `"AGORASG1"` little-endian.
pub const MAGIC: u64 = u64::from_le_bytes(*b"AGORASG1");
/// Size reserved for the header.
pub const HEADER_LEN: u64 = 4096;
/// Alignment of every buffer in the heap (a cache line, and enough for any scalar type).
pub const HEAP_ALIGN: u64 = 64;
/// Largest ring capacity accepted (entries). Capacities are powers of two.
pub const MAX_RING_CAPACITY: u32 = 1 << 16;

/// Header at offset 0 of every segment.
///
/// Ring indices are free-running `u32` counters (they wrap); the slot is `index % capacity`.
/// Each word that one side writes and the other polls sits on its own cache line.
#[repr(C)]
pub struct SegmentHeader {
    /// [`MAGIC`].
    pub magic: u64,
    /// [`crate::PROTOCOL_VERSION`].
    pub version: u32,
    /// Submission ring capacity in entries (power of two).
    pub submission_capacity: u32,
    /// Completion ring capacity in entries (power of two).
    pub completion_capacity: u32,
    /// Padding.
    pub reserved: u32,
    /// Byte offset of the submission ring.
    pub submission_offset: u64,
    /// Byte offset of the completion ring.
    pub completion_offset: u64,
    /// Byte offset of the heap.
    pub heap_offset: u64,
    /// Heap length in bytes (the session's quota).
    pub heap_len: u64,
    /// Total segment length.
    pub total_len: u64,
    /// Submission producer index, written by the client.
    pub submission_tail: CachePadded<AtomicU32>,
    /// Submission consumer index, written by the daemon.
    pub submission_head: CachePadded<AtomicU32>,
    /// Completion producer index, written by the daemon; clients futex-wait on it.
    pub completion_tail: CachePadded<AtomicU32>,
    /// Completion consumer index, written by the client.
    pub completion_head: CachePadded<AtomicU32>,
    /// Non-zero while the daemon is (about to be) blocked; a client that sees it rings the
    /// doorbell eventfd after publishing a submission.
    pub daemon_sleeping: CachePadded<AtomicU32>,
    /// Number of client threads blocked (or about to block) on `completion_tail`; the daemon
    /// issues a futex wake only when it is non-zero.
    pub client_waiters: CachePadded<AtomicU32>,
    /// Set by the daemon before it wakes every waiter: [`DAEMON_SHUT_DOWN`] when it shuts down
    /// (a client may resume its session on the next daemon), [`SESSION_ENDED`] when it ended
    /// this session while it runs on (a corrupt ring, a hostile client): not to be resumed.
    pub daemon_closed: CachePadded<AtomicU32>,
    /// Smallest task id a blocked client thread waits for (`u64::MAX` when none): the daemon
    /// wakes waiters only when it posts a completion for that id or a later one, so a client
    /// waiting for the last of many tasks is not woken for each of them.
    pub client_wait_for: CachePadded<AtomicU64>,
    /// Control requests the client has sent on its socket (a free-running counter, bumped after
    /// each request is written): a dispatcher spinning on the rings sees a change at once and
    /// reads the control socket, where otherwise only its periodic `epoll` peek would find the
    /// request. A hint only: the daemon reads the socket, never trusts the count.
    pub control_sent: CachePadded<AtomicU32>,
}

#[cfg(loom)]
impl SegmentHeader {
    /// The header of a fresh segment, built as a value (loom builds only): loom's atomics are
    /// registered with the running model when created, so a model test cannot take them from
    /// zeroed memory as [`SegmentView::initialize`] does; it writes this value at the start of
    /// a segment-sized buffer instead. Same contents as `initialize` leaves.
    pub fn new_for_model(geometry: &Geometry) -> Self {
        let g = geometry;
        SegmentHeader {
            magic: MAGIC,
            version: crate::PROTOCOL_VERSION,
            submission_capacity: g.submission_capacity,
            completion_capacity: g.completion_capacity,
            reserved: 0,
            submission_offset: g.submission_offset,
            completion_offset: g.completion_offset,
            heap_offset: g.heap_offset,
            heap_len: g.heap_len,
            total_len: g.total_len,
            submission_tail: CachePadded::new(AtomicU32::new(0)),
            submission_head: CachePadded::new(AtomicU32::new(0)),
            completion_tail: CachePadded::new(AtomicU32::new(0)),
            completion_head: CachePadded::new(AtomicU32::new(0)),
            daemon_sleeping: CachePadded::new(AtomicU32::new(0)),
            client_waiters: CachePadded::new(AtomicU32::new(0)),
            daemon_closed: CachePadded::new(AtomicU32::new(0)),
            client_wait_for: CachePadded::new(AtomicU64::new(u64::MAX)),
            control_sent: CachePadded::new(AtomicU32::new(0)),
        }
    }
}

/// [`SegmentHeader::daemon_closed`]: the daemon shut down (its clients may resume on the next one).
pub const DAEMON_SHUT_DOWN: u32 = 1;
/// [`SegmentHeader::daemon_closed`]: the daemon ended this session and runs on; the client must not
/// resume it.
pub const SESSION_ENDED: u32 = 2;

const _: () = assert!(std::mem::size_of::<SegmentHeader>() as u64 <= HEADER_LEN);

/// Geometry of a segment, computed identically by both sides.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Geometry {
    /// Submission ring capacity (entries).
    pub submission_capacity: u32,
    /// Completion ring capacity (entries).
    pub completion_capacity: u32,
    /// Offset of the submission ring.
    pub submission_offset: u64,
    /// Offset of the completion ring.
    pub completion_offset: u64,
    /// Offset of the heap.
    pub heap_offset: u64,
    /// Heap length.
    pub heap_len: u64,
    /// Total length of the segment.
    pub total_len: u64,
}

/// Why a geometry is not acceptable.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum GeometryError {
    /// A ring capacity is zero, not a power of two, or too large.
    #[error("ring capacity {0} must be a power of two between 2 and {MAX_RING_CAPACITY}")]
    Capacity(u32),
    /// The total size overflows.
    #[error("segment size overflows")]
    Overflow,
    /// The header in a mapped segment does not match what was announced.
    #[error("segment header does not match the announced geometry (wrong magic, version or sizes)")]
    Mismatch,
}

fn round_up(value: u64, align: u64) -> Option<u64> {
    value.checked_add(align - 1).map(|v| v / align * align)
}

impl Geometry {
    /// Computes the layout for the given capacities and heap size.
    pub fn new(submission_capacity: u32, completion_capacity: u32, heap_len: u64) -> Result<Self, GeometryError> {
        for cap in [submission_capacity, completion_capacity] {
            if cap < 2 || !cap.is_power_of_two() || cap > MAX_RING_CAPACITY {
                return Err(GeometryError::Capacity(cap));
            }
        }
        let desc = std::mem::size_of::<TaskDescriptor>() as u64;
        let comp = std::mem::size_of::<Completion>() as u64;
        let submission_offset = HEADER_LEN;
        let completion_offset =
            round_up(submission_offset + desc * u64::from(submission_capacity), 4096).ok_or(GeometryError::Overflow)?;
        let heap_offset =
            round_up(completion_offset + comp * u64::from(completion_capacity), 4096).ok_or(GeometryError::Overflow)?;
        let heap_len = round_up(heap_len, 4096).ok_or(GeometryError::Overflow)?;
        let total_len = heap_offset.checked_add(heap_len).ok_or(GeometryError::Overflow)?;
        Ok(Geometry {
            submission_capacity,
            completion_capacity,
            submission_offset,
            completion_offset,
            heap_offset,
            heap_len,
            total_len,
        })
    }
}

/// A view of a mapped segment. It does not own the mapping.
///
/// All access to ring slots goes through this type, which bounds every index by the geometry
/// fixed at construction: no value read from shared memory can move an access outside the map.
#[derive(Clone, Copy, Debug)]
pub struct SegmentView {
    base: *mut u8,
    geometry: Geometry,
}

// SAFETY: the view is a pointer into a shared mapping whose lifetime the owner guarantees
// (see `from_raw`); all cross-thread access to it goes through atomics or through the ring
// protocol, which hands each slot to one side at a time.
unsafe impl Send for SegmentView {}
// SAFETY: as above; `&SegmentView` only exposes atomics and copy-in/copy-out of slots.
unsafe impl Sync for SegmentView {}

impl SegmentView {
    /// Wraps a mapping.
    ///
    /// # Safety
    /// `base` must point to a readable and writable mapping of at least `geometry.total_len`
    /// bytes, aligned to a page, that stays mapped for as long as the view (or any copy of it)
    /// is used.
    pub unsafe fn from_raw(base: *mut u8, geometry: Geometry) -> Self {
        SegmentView { base, geometry }
    }

    /// Geometry of this segment.
    pub fn geometry(&self) -> &Geometry {
        &self.geometry
    }

    /// Base address of the mapping.
    pub fn base(&self) -> *mut u8 {
        self.base
    }

    /// The header.
    pub fn header(&self) -> &SegmentHeader {
        // SAFETY: the mapping is at least HEADER_LEN long and page-aligned (from_raw contract);
        // every field is either plain data written once before sharing or an atomic.
        unsafe { &*(self.base as *const SegmentHeader) }
    }

    /// Writes the header of a fresh segment (daemon side, before the client maps it).
    pub fn initialize(&self) {
        let g = self.geometry;
        let header = self.base as *mut SegmentHeader;
        // SAFETY: the segment is fresh (zero-filled memfd) and not yet shared with the client,
        // so nobody else accesses these plain fields; the pointer is in bounds and aligned.
        unsafe {
            (*header).magic = MAGIC;
            (*header).version = crate::PROTOCOL_VERSION;
            (*header).submission_capacity = g.submission_capacity;
            (*header).completion_capacity = g.completion_capacity;
            (*header).submission_offset = g.submission_offset;
            (*header).completion_offset = g.completion_offset;
            (*header).heap_offset = g.heap_offset;
            (*header).heap_len = g.heap_len;
            (*header).total_len = g.total_len;
        }
        self.header().client_wait_for.store(u64::MAX, Ordering::Relaxed);
    }

    /// Checks that the header matches the announced geometry (client side, after mapping).
    pub fn verify(&self) -> Result<(), GeometryError> {
        let h = self.header();
        let g = &self.geometry;
        let ok = h.magic == MAGIC
            && h.version == crate::PROTOCOL_VERSION
            && h.submission_capacity == g.submission_capacity
            && h.completion_capacity == g.completion_capacity
            && h.submission_offset == g.submission_offset
            && h.completion_offset == g.completion_offset
            && h.heap_offset == g.heap_offset
            && h.heap_len == g.heap_len
            && h.total_len == g.total_len;
        if ok {
            Ok(())
        } else {
            Err(GeometryError::Mismatch)
        }
    }

    fn submission_slot(&self, index: u32) -> *mut TaskDescriptor {
        let slot = u64::from(index & (self.geometry.submission_capacity - 1));
        let offset = self.geometry.submission_offset + slot * std::mem::size_of::<TaskDescriptor>() as u64;
        // Offsets are bounded by the geometry; `as usize` is lossless on 64-bit targets.
        self.base.wrapping_add(offset as usize) as *mut TaskDescriptor
    }

    fn completion_slot(&self, index: u32) -> *mut Completion {
        let slot = u64::from(index & (self.geometry.completion_capacity - 1));
        let offset = self.geometry.completion_offset + slot * std::mem::size_of::<Completion>() as u64;
        self.base.wrapping_add(offset as usize) as *mut Completion
    }

    /// Copies the descriptor at `index` out of shared memory, once.
    ///
    /// The daemon validates only the copy, so a client rewriting the slot concurrently cannot
    /// change what was validated (no time-of-check/time-of-use gap).
    pub fn read_submission(&self, index: u32) -> TaskDescriptor {
        // SAFETY: the slot lies inside the mapping (index masked by the capacity, offsets from
        // the geometry). A volatile read copies it exactly once; every bit pattern is a valid
        // TaskDescriptor (it is Pod), so a concurrent writer can only make the copy garbage,
        // which decoding rejects.
        unsafe { std::ptr::read_volatile(self.submission_slot(index)) }
    }

    /// Writes a descriptor into the slot at `index` (client side).
    pub fn write_submission(&self, index: u32, descriptor: &TaskDescriptor) {
        // SAFETY: in bounds as above; the ring protocol gives this slot to the producer until it
        // publishes the tail.
        unsafe { std::ptr::write_volatile(self.submission_slot(index), *descriptor) }
    }

    /// Copies the completion at `index` out of shared memory (client side).
    pub fn read_completion(&self, index: u32) -> Completion {
        // SAFETY: in bounds as above; Completion is Pod.
        unsafe { std::ptr::read_volatile(self.completion_slot(index)) }
    }

    /// Writes a completion into the slot at `index` (daemon side).
    pub fn write_completion(&self, index: u32, completion: &Completion) {
        // SAFETY: in bounds as above; the slot belongs to the producer until it publishes.
        unsafe { std::ptr::write_volatile(self.completion_slot(index), *completion) }
    }

    /// Pointer to `len` heap bytes at heap-relative `offset`, if the range lies in the heap.
    pub fn heap_range(&self, offset: u64, len: u64) -> Option<*mut u8> {
        let end = offset.checked_add(len)?;
        if end > self.geometry.heap_len {
            return None;
        }
        Some(self.base.wrapping_add((self.geometry.heap_offset + offset) as usize))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn geometry_is_page_aligned_and_ordered() {
        let g = Geometry::new(1024, 1024, 1 << 20).unwrap();
        assert_eq!(g.submission_offset, HEADER_LEN);
        assert!(g.completion_offset >= g.submission_offset + 1024 * 320);
        assert_eq!(g.heap_offset % 4096, 0);
        assert_eq!(g.total_len, g.heap_offset + (1 << 20));
    }

    #[test]
    fn geometry_rejects_bad_capacity() {
        assert_eq!(Geometry::new(3, 4, 0), Err(GeometryError::Capacity(3)));
        assert_eq!(Geometry::new(4, 0, 0), Err(GeometryError::Capacity(0)));
        assert!(Geometry::new(4, 4, u64::MAX).is_err());
    }

    #[test]
    fn heap_range_is_bounded() {
        let g = Geometry::new(4, 4, 8192).unwrap();
        let mut mem = vec![0u8; g.total_len as usize + 4096];
        let base = mem.as_mut_ptr().wrapping_add(mem.as_ptr().align_offset(4096));
        // SAFETY: `mem` outlives the view and covers total_len bytes after aligning.
        let view = unsafe { SegmentView::from_raw(base, g) };
        assert!(view.heap_range(0, 8192).is_some());
        assert!(view.heap_range(1, 8192).is_none());
        assert!(view.heap_range(u64::MAX, 2).is_none());
    }
}
