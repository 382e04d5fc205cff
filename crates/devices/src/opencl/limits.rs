//! What one launch may ask of an OpenCL device: the limits a device reports, the bounds Agora adds
//! on every platform, and the work-group shapes launches run in.
//!
//! Owns the numbers only; it must not enqueue anything. The executor re-checks each command
//! against these limits, and `Device::check_launch` uses the same work-group shapes, so what the
//! daemon checks is what runs.

use opencl3::device::Device as ClDeviceInfo;

use crate::LaunchLimits;

/// Most work-groups of one enqueue, on every platform. PoCL's CPU driver (3.1, as installed here)
/// counts a command's work-groups in a 32-bit `unsigned`: a `noop` of 2^32 work-groups (global
/// 2^38 in groups of 64, or 2^32 in groups of 1, or 2^19 x 2^19 in groups of 8 x 8) kills the
/// process with SIGILL, and 2^34 of them (global 2^40) trips its `assert (max_wgs > 0)` (SIGABRT);
/// 2^28 work-groups (2^40 in groups of 4096) run. Measured with a throwaway program, one process
/// per try. Half the counter's range leaves a margin; no platform loses by the finer split.
pub const MAX_GROUPS_PER_ENQUEUE: u64 = 1 << 31;

/// Most work items of one enqueue (one command, which nothing but revocation preempts): a 32-bit
/// index space, 0.27 s of `noop` (0.44 s of a guarded kernel that only returns) on PoCL here.
pub const MAX_ITEMS_PER_ENQUEUE: u64 = 1 << 32;

/// Most work items of one launch: 16 enqueues of the largest size, about 4.5 s of `noop` on PoCL
/// here. It bounds how long one launch holds an OpenCL lane; a larger range goes to a device
/// without this bound (the CPU) or is refused with `TaskError::DeviceLimit`. (The library's
/// kernels other than `noop` take at most `i32::MAX` items, far below it.)
pub const MAX_ITEMS_PER_LAUNCH: u64 = 1 << 36;

/// What an OpenCL device reports about its limits (`None`: the query failed).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(super) struct Reported {
    /// `CL_DEVICE_ADDRESS_BITS`: the width of the device's `size_t`.
    pub(super) address_bits: Option<u32>,
    /// `CL_DEVICE_MAX_WORK_ITEM_SIZES`.
    pub(super) work_item_sizes: Option<Vec<usize>>,
    /// `CL_DEVICE_MAX_WORK_GROUP_SIZE`.
    pub(super) work_group_size: Option<usize>,
    /// `CL_DEVICE_MAX_MEM_ALLOC_SIZE`.
    pub(super) mem_alloc_size: Option<u64>,
}

impl Reported {
    pub(super) fn query(cl: &ClDeviceInfo) -> Self {
        Reported {
            address_bits: cl.address_bits().ok(),
            work_item_sizes: cl.max_work_item_sizes().ok(),
            work_group_size: cl.max_work_group_size().ok(),
            mem_alloc_size: cl.max_mem_alloc_size().ok(),
        }
    }

    /// The launch limits of a device that reports this. What a device does not report is taken
    /// at the least the OpenCL specification allows (a 32-bit `size_t`, work-groups of one work
    /// item, and allocations of 128 MiB), so the device refuses what it might not run.
    pub(super) fn limits(&self) -> LaunchLimits {
        let bits = self.address_bits.unwrap_or(32).clamp(32, 64);
        let size_t_max = if bits >= 64 { u64::MAX } else { (1u64 << bits) - 1 };
        let mut max_group = [1u64; 3];
        for (d, size) in self.work_item_sizes.iter().flatten().take(3).enumerate() {
            max_group[d] = (*size as u64).max(1);
        }
        LaunchLimits {
            max_items: MAX_ITEMS_PER_LAUNCH,
            max_extent: [size_t_max; 3],
            max_items_per_enqueue: MAX_ITEMS_PER_ENQUEUE.min(size_t_max),
            max_groups_per_enqueue: MAX_GROUPS_PER_ENQUEUE,
            max_group,
            max_group_items: self.work_group_size.map_or(1, |s| (s as u64).max(1)),
            max_buffer_bytes: self.mem_alloc_size.unwrap_or(128 << 20),
        }
    }
}

/// The work-group size of guarded kernels of `dims` dimensions (`declared` when given).
pub fn fixed_work_group(dims: usize, declared: Option<[usize; 3]>) -> [usize; 3] {
    match (declared, dims) {
        (Some(l), _) => l,
        (None, 1) => [64, 1, 1],
        (None, 2) => [8, 8, 1],
        (None, _) => [4, 4, 4],
    }
}

/// The fewest dimensions a kernel whose work-group size is `declared` can be enqueued in: as
/// many as its required size has extents beyond 1.
pub fn required_dims(declared: Option<[usize; 3]>) -> usize {
    match declared {
        Some([_, _, z]) if z > 1 => 3,
        Some([_, y, _]) if y > 1 => 2,
        _ => 1,
    }
}

/// The work-group size for a launch of `global` (1 to 3 dimensions).
///
/// Guarded kernels get a fixed size (or the declared one), so the OpenCL compiler specialises
/// them once; others get the largest power of two up to the same size that divides each extent
/// (few distinct sizes, hence few specialisations).
pub(super) fn work_group(global: &[usize], declared: Option<[usize; 3]>, guarded: bool) -> [usize; 3] {
    let fixed = fixed_work_group(global.len(), declared);
    let mut local = [1usize; 3];
    for (d, &extent) in global.iter().enumerate() {
        local[d] = if guarded || declared.is_some() {
            fixed[d].max(1)
        } else {
            let mut l = fixed[d].max(1).next_power_of_two();
            while l > 1 && extent % l != 0 {
                l /= 2;
            }
            l
        };
    }
    local
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reported_limits_become_launch_limits() {
        let pocl = Reported {
            address_bits: Some(64),
            work_item_sizes: Some(vec![4096, 4096, 4096]),
            work_group_size: Some(4096),
            mem_alloc_size: Some(2 << 30),
        };
        assert_eq!(
            pocl.limits(),
            LaunchLimits {
                max_items: 1 << 36,
                max_extent: [u64::MAX; 3],
                max_items_per_enqueue: 1 << 32,
                max_groups_per_enqueue: 1 << 31,
                max_group: [4096; 3],
                max_group_items: 4096,
                max_buffer_bytes: 2 << 30,
            }
        );
        // A 32-bit device: its size_t bounds every dimension and an enqueue.
        let small = Reported {
            address_bits: Some(32),
            work_item_sizes: Some(vec![256, 256, 64]),
            work_group_size: Some(256),
            mem_alloc_size: Some(512 << 20),
        }
        .limits();
        assert_eq!(small.max_extent, [u32::MAX as u64; 3]);
        assert_eq!(small.max_items_per_enqueue, u32::MAX as u64);
        assert_eq!(small.max_group, [256, 256, 64]);
        // Nothing reported: the least the specification allows.
        let unknown = Reported::default().limits();
        assert_eq!(unknown.max_extent, [u32::MAX as u64; 3]);
        assert_eq!((unknown.max_group, unknown.max_group_items), ([1; 3], 1));
        assert_eq!(unknown.max_buffer_bytes, 128 << 20);
    }
}
