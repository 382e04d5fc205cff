//! NVIDIA GPUs, through the CUDA driver API (cudarc, loaded at run time: a daemon built with this
//! backend starts, and serves its other devices, where no CUDA driver is installed; it logs one
//! line saying why there is no GPU).
//!
//! Sharing: each GPU has one context (the primary context) shared by every tenant, and each lane
//! is a stream in it (two: batch work at the GPU's lowest stream priority, urgent work at its
//! highest, kept in the lane's order; see `executor`), so tenants' kernels run side by side on
//! the GPU (spatial sharing, as MPS gives, without an MPS server). A lane's thread only *enqueues*: transfers, then the kernel,
//! then an event; the device's completion thread polls the events and finishes each job when
//! its event has happened (see `completion`), so no thread waits per command and a lane keeps
//! its stream full.
//!
//! Transfers: the daemon registers a session's segment with the driver (page-locked, through
//! [`Device::register_host_memory`](crate::Device::register_host_memory)) the first time one of its tasks
//! moves data to or from a GPU, so host↔device copies are DMA straight from and into the
//! tenant's shared memory, with no staging copy. Fresh allocations are zeroed before use.
//!
//! Kernels: the library's kernels have one source, OpenCL C; on CUDA it compiles under a prelude
//! (`opencl.cuh`) that maps OpenCL C's qualifiers and work-item functions onto CUDA's, with NVRTC
//! for the device's architecture at first use, cached on disk per (source hash, architecture)
//! (see `programs`). Calling convention: as [`agora_kernels::OpenClImpl`] describes, plus one
//! trailing `ulong` row offset (CUDA has no global work offset): a row slice `a..b` is a grid over
//! `b - a` rows with offset `a`, and `range0 = b`.
//!
//! Preemption: long batch launches are cut into row slices (never smaller than the GPU fills at
//! once), so latency-class work gets in at slice boundaries, as on OpenCL. A revocable launch's
//! kernel polls its lane's flag in mapped host memory, which the completion thread keeps equal to
//! the job's flag while it runs: a revoked kernel stops at its next work-group
//! ([`Device::polls_revocation`](crate::Device::polls_revocation) is true). Where the driver
//! refuses mapped memory (or in the callback mode) the flag is copied in just before the kernel
//! instead: a launch revoked while it waits stops at once, one revoked while it runs completes.
//!
//! Faults: an illegal address or a trap leaves a CUDA context unusable for every stream in it.
//! The guilty job fails with `KernelFault`; the device then reports itself failed
//! ([`Device::healthy`](crate::Device::healthy)). By default each GPU runs in a device-host
//! process of its own (`agora-device-host`), which then exits: the daemon replays the GPU's
//! other tasks from their host copies and starts a new host, so the GPU comes back with a fresh
//! context. A GPU in the daemon (`[cuda] device_host = false`) stays failed instead, and the
//! daemon drains it. [`fence`] keeps a fenced tenant's stray accesses inside its own partition
//! instead of faulting.
//!
//! One file per mechanism:
//! * `device`: discovery, the shared state, the [`Device`](crate::Device) implementation;
//! * `executor`: a lane's executor (and the stream callbacks of the callback mode);
//! * `completion`: the completion thread that finishes jobs from polled events;
//! * `programs`: OpenCL C as CUDA C, NVRTC, the PTX cache, modules and functions;
//! * `buffer`: device memory of one buffer and registered host memory;
//! * `fence`: rewriting tenant PTX so its global accesses stay in its partition (Guardian);
//! * `partition`: each tenant's memory in an aligned range of its own, kept between its buffers;
//! * `utilization`: how busy the GPU is, from NVML.

mod buffer;
mod completion;
mod device;
mod executor;
pub mod fence;
mod partition;
pub mod programs;
#[cfg(test)]
mod tests;
mod utilization;

pub use device::{
    block_shape, check_launch, discover, discover_one, gpu_count, launch_shape, row_alignment, slices, CudaDevice,
    MAX_GRID_X, MAX_GRID_YZ, MAX_ITEMS_PER_ENQUEUE,
};
