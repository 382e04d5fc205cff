//! Each tenant's GPU memory in a partition of its own, Guardian's layout: what lets a fenced
//! kernel (see [`fence`](super::fence)) be confined to its tenant's memory by masking addresses.
//!
//! A partition is a range of the GPU's virtual addresses reserved for one tenant (a session),
//! aligned to its reserved size `2^k`. Physical memory is mapped into it from its start in
//! power-of-two steps: the mapped prefix is always `2^j` bytes (from one allocation granule, 2 MiB,
//! up), grown by doubling when a buffer does not fit in what is free, so a fenced launch masks
//! addresses with `(a & (2^j - 1)) | base` and every masked address is mapped. The tenant's
//! buffers are sub-ranges of the mapped prefix ([`RangeAllocator`]): a mapped prefix costs at most
//! twice the tenant's peak use.
//!
//! A partition is kept, mapped, for as long as its tenant lives, like a caching allocator: a
//! program that allocates and frees its buffers run after run would otherwise pay the reserve,
//! the mapping and the zeroing of its whole working set in every run (50–630 µs per growth on an
//! H200, against Rodinia runs of under a millisecond). Its memory is given back when the tenant
//! ends ([`Partitions::end`]) and, under pressure, by [`Partitions::trim`]: the free upper halves
//! of every partition no fenced kernel ran in are unmapped, and the allocation that found no
//! memory tries again.
//!
//! Owns the driver's virtual-memory calls (reserve, create, map, set access, unmap, release,
//! free). It must not launch, copy or zero anything (the device zeroes what it newly maps, and
//! buffers before their first use) and must
//! not decide who is a tenant (the daemon names the owner of each allocation).

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex};

use cudarc::driver::sys::{self, CUdevice, CUdeviceptr, CUmemGenericAllocationHandle, CUresult};

/// Alignment of a buffer inside a partition: what `cuMemAlloc` guarantees (and more than any
/// vector access needs).
pub const BUFFER_ALIGNMENT: u64 = 256;

/// A first-fit allocator of ranges inside `[0, end)`, which may grow. Pure bookkeeping (tested
/// without a GPU).
#[derive(Debug, Default)]
pub struct RangeAllocator {
    /// Free ranges, by offset: offset → length. Adjacent free ranges are always merged.
    free: BTreeMap<u64, u64>,
    end: u64,
}

impl RangeAllocator {
    /// An allocator of `[0, end)`, all free.
    #[cfg(test)]
    pub fn new(end: u64) -> Self {
        let mut allocator = RangeAllocator::default();
        allocator.grow(end);
        allocator
    }

    /// The end of the managed range.
    pub fn end(&self) -> u64 {
        self.end
    }

    /// The first free offset, aligned to `align` (a power of two), with `len` bytes after it.
    pub fn alloc(&mut self, len: u64, align: u64) -> Option<u64> {
        let len = len.max(1);
        let (start, free_len, at) = self.first_fit(len, align)?;
        self.free.remove(&start);
        if at > start {
            self.free.insert(start, at - start);
        }
        if at + len < start + free_len {
            self.free.insert(at + len, start + free_len - (at + len));
        }
        Some(at)
    }

    /// The first free range with `len` bytes from an offset aligned to `align`: (its start, its
    /// length, that offset).
    fn first_fit(&self, len: u64, align: u64) -> Option<(u64, u64, u64)> {
        self.free.iter().find_map(|(start, free_len)| {
            let at = start.checked_add(align - 1)? & !(align - 1);
            (at.checked_add(len.max(1))? <= start + free_len).then_some((*start, *free_len, at))
        })
    }

    /// Free bytes at the end of the range.
    fn free_tail(&self) -> u64 {
        self.free
            .iter()
            .next_back()
            .map_or(0, |(s, l)| if s + l == self.end { *l } else { 0 })
    }

    /// Returns `[offset, offset + len)` (allocated by [`alloc`](Self::alloc) with this `len`).
    pub fn free(&mut self, offset: u64, len: u64) {
        let (mut start, mut len) = (offset, len.max(1));
        if let Some((&before, &before_len)) = self.free.range(..start).next_back() {
            if before + before_len == start {
                self.free.remove(&before);
                start = before;
                len += before_len;
            }
        }
        if let Some(after_len) = self.free.remove(&(start + len)) {
            len += after_len;
        }
        self.free.insert(start, len);
    }

    /// Shrinks the managed range to `[0, end)` when everything from `end` on is free; returns
    /// whether it did.
    pub fn shrink(&mut self, end: u64) -> bool {
        if end >= self.end {
            return false;
        }
        let Some((&start, &len)) = self.free.iter().next_back() else {
            return false;
        };
        if start + len != self.end || start > end {
            return false;
        }
        self.free.remove(&start);
        if start < end {
            self.free.insert(start, end - start);
        }
        self.end = end;
        true
    }

    /// Extends the managed range to `[0, end)`; the new part is free.
    pub fn grow(&mut self, end: u64) {
        if end > self.end {
            let old = self.end;
            self.end = end;
            self.free(old, end - old);
        }
    }

    /// Whether nothing is allocated.
    #[cfg(test)]
    pub fn is_empty(&self) -> bool {
        self.end == 0 || self.free.get(&0) == Some(&self.end)
    }
}

/// The mapped size needed for `len` more bytes when `end_free` bytes at the end of a mapped prefix
/// of `mapped` bytes are free: the smallest power of two (at least `granule`) that fits them
/// (after aligning the free tail's start).
pub fn grown_size(mapped: u64, end_free: u64, len: u64, granule: u64) -> Option<u64> {
    let needed = (mapped - end_free)
        .checked_next_multiple_of(BUFFER_ALIGNMENT)?
        .checked_add(len.max(1).checked_next_multiple_of(BUFFER_ALIGNMENT)?)?;
    needed.max(granule).max(mapped).checked_next_power_of_two()
}

struct Mapped {
    /// Physical allocations and where they are mapped (offset in the partition, size).
    chunks: Vec<(u64, u64, CUmemGenericAllocationHandle)>,
    ranges: RangeAllocator,
}

/// One tenant's partition.
pub struct Partition {
    /// The tenant (the daemon's session id).
    pub tenant: u64,
    /// Start of the reserved range, aligned to `reserved`.
    pub base: CUdeviceptr,
    reserved: u64,
    granule: u64,
    device: CUdevice,
    mapped: Mutex<Mapped>,
    /// A fenced kernel was launched with this partition's mask: from then on the mapped prefix
    /// never shrinks (a fenced launch still in flight may send a stray access anywhere in it,
    /// and an unmapped address would fault the context for every tenant).
    fenced: std::sync::atomic::AtomicBool,
}

// SAFETY: the addresses and handles are process-wide driver values; the rest is behind a mutex.
unsafe impl Send for Partition {}
// SAFETY: as above.
unsafe impl Sync for Partition {}

impl std::fmt::Debug for Partition {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Partition")
            .field("tenant", &self.tenant)
            .field("base", &format_args!("{:#x}", self.base))
            .field("mapped", &self.mapped_bytes())
            .finish()
    }
}

fn check(what: &str, code: CUresult) -> Result<(), String> {
    if code == CUresult::CUDA_SUCCESS {
        Ok(())
    } else {
        Err(format!("{what}: {code:?}"))
    }
}

fn allocation_properties(device: CUdevice) -> sys::CUmemAllocationProp {
    // SAFETY: a plain C struct for which all-zero is a valid value (no handle types, no flags).
    let mut prop: sys::CUmemAllocationProp = unsafe { std::mem::zeroed() };
    prop.type_ = sys::CUmemAllocationType::CU_MEM_ALLOCATION_TYPE_PINNED;
    prop.location.type_ = sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE;
    prop.location.id = device;
    prop
}

impl Partition {
    /// Bytes mapped (the fence's mask is this minus one).
    pub fn mapped_bytes(&self) -> u64 {
        self.mapped.lock().unwrap_or_else(|e| e.into_inner()).ranges.end()
    }

    /// The fence's launch arguments for this partition: base and mask.
    pub fn fence_arguments(&self) -> Option<(u64, u64)> {
        super::fence::fence_arguments(self.base, self.mapped_bytes())
    }

    /// A sub-range of `len` bytes, mapping more of the partition when nothing free fits. The
    /// context must be current. Returns its device address, and the range (address, bytes) newly
    /// mapped for it, if any: physical memory that may hold what another tenant left there, which
    /// the caller zeroes before any kernel of this tenant can run (a fenced kernel may read
    /// anywhere in the mapped prefix, free ranges included).
    pub fn alloc(&self, len: u64) -> Result<(CUdeviceptr, Option<(CUdeviceptr, u64)>), String> {
        let mut mapped = self.mapped.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(offset) = mapped.ranges.alloc(len, BUFFER_ALIGNMENT) {
            return Ok((self.base + offset, None));
        }
        let end = mapped.ranges.end();
        let target = self.grown_end(&mapped.ranges, len).ok_or_else(|| {
            format!(
                "the partition of tenant {} cannot grow to hold {len} more bytes",
                self.tenant
            )
        })?;
        let size = target - end;
        let prop = allocation_properties(self.device);
        let mut handle: CUmemGenericAllocationHandle = 0;
        // SAFETY: `size` is a multiple of the granule (both powers of two, size ≥ granule); the
        // handle is released below on failure or with the partition.
        check("cuMemCreate", unsafe {
            sys::cuMemCreate(&mut handle, size as usize, &prop, 0)
        })?;
        let at = self.base + end;
        // SAFETY: `[at, at + size)` lies inside this partition's reservation and is not mapped
        // (the mapped prefix ends at `at`).
        let mapped_now = check("cuMemMap", unsafe { sys::cuMemMap(at, size as usize, 0, handle, 0) }).and_then(|()| {
            let access = sys::CUmemAccessDesc {
                location: prop.location,
                flags: sys::CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_READWRITE,
            };
            // SAFETY: the range just mapped.
            check("cuMemSetAccess", unsafe {
                sys::cuMemSetAccess(at, size as usize, &access, 1)
            })
            .inspect_err(|_| {
                // SAFETY: as above.
                let _ = unsafe { sys::cuMemUnmap(at, size as usize) };
            })
        });
        if let Err(e) = mapped_now {
            // SAFETY: created above, mapped nowhere.
            let _ = unsafe { sys::cuMemRelease(handle) };
            return Err(e);
        }
        mapped.chunks.push((end, size, handle));
        mapped.ranges.grow(target);
        let offset = mapped
            .ranges
            .alloc(len, BUFFER_ALIGNMENT)
            .ok_or_else(|| "a grown partition has no room (a bug)".to_string())?;
        Ok((self.base + offset, Some((at, size))))
    }

    /// Returns a sub-range (no queued command may use it any more). Its memory stays mapped for
    /// the tenant's next buffers ([`trim`](Self::trim) gives it back).
    pub fn free(&self, ptr: CUdeviceptr, len: u64) {
        let mut mapped = self.mapped.lock().unwrap_or_else(|e| e.into_inner());
        mapped.ranges.free(ptr - self.base, len);
    }

    /// Gives back what the tenant does not use, where no fenced kernel ever ran with this
    /// partition: a free upper half of the mapped prefix is unmapped and its memory released,
    /// halving until the tenant's buffers fill more than half of it (all of it when the tenant
    /// has no buffer). The context must be current. Returns the bytes given back.
    pub fn trim(&self) -> u64 {
        if self.fenced.load(std::sync::atomic::Ordering::Acquire) {
            return 0;
        }
        let mut mapped = self.mapped.lock().unwrap_or_else(|e| e.into_inner());
        let mut given_back = 0;
        while let Some(&(offset, size, handle)) = mapped.chunks.last() {
            if !mapped.ranges.shrink(offset) {
                break;
            }
            mapped.chunks.pop();
            // SAFETY: mapped by `alloc` at this offset with this size; every sub-range in it is
            // free (no buffer, so no command of this tenant's, uses it) and no fenced launch ever
            // had a mask that covers it.
            unsafe {
                let _ = sys::cuMemUnmap(self.base + offset, size as usize);
                let _ = sys::cuMemRelease(handle);
            }
            given_back += size;
        }
        given_back
    }

    /// Records that a fenced kernel is launched with this partition (see `fenced`).
    pub fn mark_fenced(&self) {
        self.fenced.store(true, std::sync::atomic::Ordering::Release);
    }

    /// The mapped size after growing to hold `len` more bytes (doubling at least), or `None`
    /// past the reservation.
    fn grown_end(&self, ranges: &RangeAllocator, len: u64) -> Option<u64> {
        let end = ranges.end();
        grown_size(end, ranges.free_tail(), len, self.granule)
            .map(|t| if t > end { t } else { end * 2 })
            .filter(|t| *t <= self.reserved)
    }

    /// The bytes `alloc(len)` would newly map: 0 when a free range fits (or it cannot grow).
    fn growth_for(&self, len: u64) -> u64 {
        let mapped = self.mapped.lock().unwrap_or_else(|e| e.into_inner());
        if mapped.ranges.first_fit(len, BUFFER_ALIGNMENT).is_some() {
            return 0;
        }
        self.grown_end(&mapped.ranges, len)
            .map_or(0, |target| target - mapped.ranges.end())
    }

    /// Bytes mapped but in no buffer.
    fn unused_bytes(&self) -> u64 {
        let mapped = self.mapped.lock().unwrap_or_else(|e| e.into_inner());
        mapped.ranges.free.values().sum()
    }

    /// Whether `[ptr, ptr + len)` lies in this partition's mapped prefix.
    pub fn holds(&self, ptr: CUdeviceptr, len: u64) -> bool {
        ptr >= self.base && ptr.saturating_sub(self.base).saturating_add(len) <= self.mapped_bytes()
    }
}

impl Drop for Partition {
    /// Unmaps and releases everything (the device's context must be current: the device drops
    /// partitions only from threads where it is).
    fn drop(&mut self) {
        let mapped = self.mapped.get_mut().unwrap_or_else(|e| e.into_inner());
        for (offset, size, handle) in mapped.chunks.drain(..) {
            // SAFETY: mapped by `alloc` at this offset with this size; nothing uses it any more
            // (every buffer of the partition is gone).
            unsafe {
                let _ = sys::cuMemUnmap(self.base + offset, size as usize);
                let _ = sys::cuMemRelease(handle);
            }
        }
        // SAFETY: reserved by `Partitions::reserve` with this size; nothing is mapped in it now.
        let _ = unsafe { sys::cuMemAddressFree(self.base, self.reserved as usize) };
    }
}

/// The partitions of one GPU, by tenant.
pub struct Partitions {
    device: CUdevice,
    granule: u64,
    /// Virtual bytes reserved per tenant: the GPU's memory rounded up to a power of two (a tenant
    /// can grow to the whole GPU).
    reserved: u64,
    /// The most memory Agora may use on the GPU: before a partition grows past it (all
    /// partitions' mapped bytes together), the others give back what they keep unused.
    limit: u64,
    /// Kept until the tenant ends (its buffers hold theirs too, so a partition outlives its
    /// tenant while work in flight still uses one).
    by_tenant: Mutex<HashMap<u64, Arc<Partition>>>,
}

impl Partitions {
    /// The partitions of `device` (its context current), or why the GPU has none (no virtual
    /// memory management).
    pub fn new(device: CUdevice, memory_bytes: u64) -> Result<Self, String> {
        let prop = allocation_properties(device);
        let mut granule = 0usize;
        // SAFETY: valid properties and an out-pointer.
        check("cuMemGetAllocationGranularity", unsafe {
            sys::cuMemGetAllocationGranularity(
                &mut granule,
                &prop,
                sys::CUmemAllocationGranularity_flags::CU_MEM_ALLOC_GRANULARITY_MINIMUM,
            )
        })?;
        let granule = (granule as u64)
            .max(super::fence::MIN_PARTITION_BYTES)
            .next_power_of_two();
        Ok(Partitions {
            device,
            granule,
            reserved: memory_bytes.max(granule).next_power_of_two(),
            limit: memory_bytes,
            by_tenant: Mutex::new(HashMap::new()),
        })
    }

    /// `tenant`'s partition, reserved at its first allocation (the context must be current).
    pub fn of(&self, tenant: u64) -> Result<Arc<Partition>, String> {
        let mut by_tenant = self.by_tenant.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(partition) = by_tenant.get(&tenant) {
            return Ok(partition.clone());
        }
        let mut base: CUdeviceptr = 0;
        // Aligned to its size, so that `base | (a & mask)` stays inside it for every mask.
        // SAFETY: an out-pointer; freed with the partition.
        check("cuMemAddressReserve", unsafe {
            sys::cuMemAddressReserve(&mut base, self.reserved as usize, self.reserved as usize, 0, 0)
        })?;
        let partition = Arc::new(Partition {
            tenant,
            base,
            reserved: self.reserved,
            granule: self.granule,
            device: self.device,
            mapped: Mutex::new(Mapped {
                chunks: Vec::new(),
                ranges: RangeAllocator::default(),
            }),
            fenced: std::sync::atomic::AtomicBool::new(false),
        });
        by_tenant.insert(tenant, partition.clone());
        Ok(partition)
    }

    /// `tenant` ended: its partition goes with its last buffer (now, when none is left). The
    /// context must be current.
    pub fn end(&self, tenant: u64) {
        let partition = self.by_tenant.lock().unwrap_or_else(|e| e.into_inner()).remove(&tenant);
        // Unmapped here (outside the lock) when no buffer holds it any more.
        drop(partition);
    }

    /// Every tenant ended (the device is going): partitions no buffer holds are unmapped now.
    /// The context must be current.
    pub fn end_all(&self) {
        let partitions = std::mem::take(&mut *self.by_tenant.lock().unwrap_or_else(|e| e.into_inner()));
        drop(partitions);
    }

    /// A sub-range of `len` bytes in `partition` (one of these), as [`Partition::alloc`] gives
    /// it. Kept memory is given back first when the growth would take the GPU past its limit,
    /// and when the driver has no memory for it (then the allocation is tried once more).
    pub fn alloc(&self, partition: &Partition, len: u64) -> Result<(CUdeviceptr, Option<(CUdeviceptr, u64)>), String> {
        let growth = partition.growth_for(len);
        if growth > 0 && self.mapped_bytes().saturating_add(growth) > self.limit {
            let given_back = self.trim();
            tracing::debug!(
                tenant = partition.tenant,
                len,
                growth,
                given_back,
                "partitions trimmed: a growth would pass the GPU's limit"
            );
        }
        partition.alloc(len).or_else(|e| {
            let given_back = self.trim();
            tracing::debug!(tenant = partition.tenant, len, given_back, error = %e, "partitions trimmed: the driver had no memory");
            if given_back == 0 {
                return Err(e);
            }
            partition.alloc(len)
        })
    }

    /// Bytes mapped in all partitions.
    fn mapped_bytes(&self) -> u64 {
        self.all().iter().map(|p| p.mapped_bytes()).sum()
    }

    /// Bytes mapped in partitions but in no buffer: what [`trim`](Self::trim) could give back
    /// (partitions where a fenced kernel ran keep theirs until their tenant ends).
    pub fn cached_bytes(&self) -> u64 {
        self.all().iter().map(|p| p.unused_bytes()).sum()
    }

    fn all(&self) -> Vec<Arc<Partition>> {
        self.by_tenant
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .values()
            .cloned()
            .collect()
    }

    /// Gives back every partition's unused upper halves (see [`Partition::trim`]), for an
    /// allocation that found no device memory. The context must be current. Returns the bytes
    /// given back.
    pub fn trim(&self) -> u64 {
        self.all().iter().map(|p| p.trim()).sum()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn first_fit_aligned_and_free_ranges_merge() {
        let mut a = RangeAllocator::new(4096);
        assert_eq!(a.alloc(10, 256), Some(0));
        assert_eq!(a.alloc(300, 256), Some(256));
        assert_eq!(a.alloc(1, 256), Some(768));
        assert_eq!(a.alloc(4096, 256), None, "only what is free");
        a.free(256, 300);
        assert_eq!(a.alloc(256, 256), Some(256), "first fit: the hole");
        a.free(0, 10);
        a.free(256, 256);
        a.free(768, 1);
        assert!(a.is_empty(), "every range merged back: {a:?}");
        assert_eq!(a.alloc(4096, 256), Some(0));
    }

    #[test]
    fn growth_extends_the_free_tail() {
        let mut a = RangeAllocator::new(1024);
        assert_eq!(a.alloc(1000, 256), Some(0));
        assert_eq!(a.alloc(1000, 256), None);
        a.grow(2048);
        assert_eq!(a.alloc(1000, 256), Some(1024));
        a.free(0, 1000);
        a.free(1024, 1000);
        assert!(a.is_empty());
    }

    #[test]
    fn the_range_shrinks_only_over_a_free_tail() {
        let mut a = RangeAllocator::new(4096);
        assert_eq!(a.alloc(100, 256), Some(0));
        assert_eq!(a.alloc(100, 256), Some(256));
        assert!(!a.shrink(256), "a buffer lies above");
        assert!(a.shrink(1024));
        assert_eq!(a.end(), 1024);
        assert_eq!(a.alloc(1024, 256), None, "the tail is gone");
        a.free(256, 100);
        assert!(a.shrink(256));
        assert_eq!(a.alloc(1, 256), None);
        a.free(0, 100);
        assert!(a.is_empty());
        assert!(a.shrink(0), "a partition with no buffer gives back all of it");
        assert_eq!(a.end(), 0);
        a.grow(512);
        assert_eq!(a.alloc(100, 256), Some(0), "and grows again from its start");
    }

    #[test]
    fn the_mapped_prefix_grows_to_a_power_of_two_that_fits() {
        const MIB: u64 = 1 << 20;
        // Empty partition: at least one granule.
        assert_eq!(grown_size(0, 0, 10, 2 * MIB), Some(2 * MIB));
        assert_eq!(grown_size(0, 0, 3 * MIB, 2 * MIB), Some(4 * MIB));
        // 2 MiB mapped, 1 MiB free at the end, 2 MiB more wanted: 3 MiB (and an alignment) → 4 MiB.
        assert_eq!(grown_size(2 * MIB, MIB, 2 * MIB, 2 * MIB), Some(4 * MIB));
        // Exactly a power of two fits in it; an unaligned free tail costs its alignment.
        assert_eq!(grown_size(0, 0, 2 * MIB, 2 * MIB), Some(2 * MIB));
        assert_eq!(grown_size(2 * MIB, MIB - 1, MIB, 2 * MIB), Some(4 * MIB));
        assert_eq!(grown_size(2 * MIB, MIB, MIB, 2 * MIB), Some(2 * MIB));
        // Nothing free at the end: 4 MiB + 5 MiB → 16 MiB.
        assert_eq!(grown_size(4 * MIB, 0, 5 * MIB, 2 * MIB), Some(16 * MIB));
        assert_eq!(grown_size(4 * MIB, 0, u64::MAX - 10, 2 * MIB), None);
    }
}
