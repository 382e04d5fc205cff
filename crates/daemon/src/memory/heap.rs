//! A first-fit allocator over one session's heap, with coalescing of neighbouring free blocks.
//!
//! Metadata lives in the daemon, never in the shared segment, so a client cannot corrupt it.

use std::collections::BTreeMap;

use agora_protocol::segment::HEAP_ALIGN;

/// The allocator.
#[derive(Debug)]
pub(crate) struct Heap {
    /// Free blocks: offset → length.
    free: BTreeMap<u64, u64>,
    capacity: u64,
    used: u64,
}

impl Heap {
    pub(crate) fn new(capacity: u64) -> Self {
        let mut free = BTreeMap::new();
        if capacity > 0 {
            free.insert(0, capacity);
        }
        Heap {
            free,
            capacity,
            used: 0,
        }
    }

    /// Rounded size actually reserved for a request of `len` bytes.
    fn reserved(len: u64) -> Option<u64> {
        len.checked_add(HEAP_ALIGN - 1).map(|v| v / HEAP_ALIGN * HEAP_ALIGN)
    }

    /// Allocates `len` bytes; returns the offset.
    pub(crate) fn alloc(&mut self, len: u64) -> Option<u64> {
        let size = Self::reserved(len)?;
        let (&offset, &block) = self.free.iter().find(|(_, &l)| l >= size)?;
        self.free.remove(&offset);
        if block > size {
            self.free.insert(offset + size, block - size);
        }
        self.used += size;
        Some(offset)
    }

    /// Allocates exactly `[offset, offset + len)` (rounded up like `alloc`), as an earlier heap
    /// of a resumed session gave it out. `false` when the range is misaligned or not wholly free.
    pub(crate) fn reserve(&mut self, offset: u64, len: u64) -> bool {
        let Some(size) = Self::reserved(len) else {
            return false;
        };
        if len == 0 || !offset.is_multiple_of(HEAP_ALIGN) {
            return false;
        }
        let Some(end) = offset.checked_add(size) else {
            return false;
        };
        let Some((&start, &block)) = self.free.range(..=offset).next_back() else {
            return false;
        };
        if start + block < end {
            return false;
        }
        self.free.remove(&start);
        if start < offset {
            self.free.insert(start, offset - start);
        }
        if end < start + block {
            self.free.insert(end, start + block - end);
        }
        self.used += size;
        true
    }

    /// Frees the block at `offset` of `len` bytes (as passed to `alloc`).
    pub(crate) fn free(&mut self, offset: u64, len: u64) {
        let Some(mut size) = Self::reserved(len) else {
            return;
        };
        self.used -= size;
        let mut start = offset;
        if let Some((&prev, &prev_len)) = self.free.range(..offset).next_back() {
            if prev + prev_len == offset {
                self.free.remove(&prev);
                start = prev;
                size += prev_len;
            }
        }
        if let Some(&next_len) = self.free.get(&(offset + Self::reserved(len).unwrap_or(0))) {
            self.free.remove(&(offset + Self::reserved(len).unwrap_or(0)));
            size += next_len;
        }
        self.free.insert(start, size);
    }

    pub(crate) fn used(&self) -> u64 {
        self.used
    }

    pub(crate) fn capacity(&self) -> u64 {
        self.capacity
    }

    pub(crate) fn largest_free(&self) -> u64 {
        self.free.values().copied().max().unwrap_or(0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn allocates_aligned_and_coalesces() {
        let mut h = Heap::new(1024);
        let a = h.alloc(10).unwrap();
        let b = h.alloc(100).unwrap();
        let c = h.alloc(64).unwrap();
        assert_eq!((a, b, c), (0, 64, 192));
        assert!(h.alloc(1024).is_none());
        h.free(b, 100);
        h.free(a, 10);
        h.free(c, 64);
        assert_eq!(h.used(), 0);
        assert_eq!(h.largest_free(), 1024, "all blocks merged back");
        assert_eq!(h.alloc(1024), Some(0));
    }

    #[test]
    fn reserved_ranges_are_exact_and_never_overlap() {
        let mut h = Heap::new(4096);
        assert!(h.reserve(128, 100));
        assert!(!h.reserve(192, 10), "overlaps the first");
        assert!(!h.reserve(65, 10), "misaligned");
        assert!(!h.reserve(4032, 128), "past the end");
        assert!(!h.reserve(u64::MAX - 63, 1), "overflow");
        assert!(h.reserve(0, 64));
        assert_eq!(h.used(), 64 + 128);
        assert_eq!(h.alloc(10), Some(64), "first fit: the gap between the reserved blocks");
        h.free(128, 100);
        assert_eq!(h.alloc(100), Some(128));
    }

    #[test]
    fn exhaustion_is_reported_not_a_panic() {
        let mut h = Heap::new(4096);
        let mut n = 0;
        while h.alloc(100).is_some() {
            n += 1;
        }
        assert_eq!(n, 4096 / 128);
        assert!(h.alloc(u64::MAX).is_none());
    }
}
