//! OpenCL devices: every device of every OpenCL platform found at start.
//!
//! On this project's machines that is PoCL on the CPU — a real OpenCL implementation with its own
//! buffers, compiler and command queues; elsewhere a GPU or FPGA platform. The ICD loader is
//! loaded at run time (opencl3's `dynamic` feature), so a daemon built with this backend still
//! starts, and serves the CPU, where OpenCL is missing.
//!
//! Each device has one context, one in-order command queue per lane, and one more queue for reads
//! issued on behalf of other devices. A lane's thread only *enqueues*: it starts a job's commands
//! (transfers, then the kernel) without waiting for them, and the job finishes later, on an
//! OpenCL runtime thread, from the completion callback of its last command. So a lane keeps its
//! command queue full while earlier commands run, and tasks of several tenants run side by side
//! on separate queues. Programs are built at first use, once per device, and cached; kernel
//! objects are cached per lane (they carry argument state, so lanes must not share them). A
//! program that fails to build is reported once, and the device stops claiming its kernels;
//! one whose build failed for lack of a resource (file descriptors, memory) is built again at a
//! later use instead (see `programs`).
//!
//! Preemption (DESIGN.md §3): lanes run *row slices* of a launch (`Work::Launch::rows`) as one
//! command each, with a global work offset, and *revocable* launches poll their job's revocation
//! flag per work-group (calling convention in [`agora_kernels::OpenClImpl`]). A running kernel
//! sees the flag only where the device computes on host memory (a CPU device such as PoCL): there
//! the kernel's flag argument is a `CL_MEM_USE_HOST_PTR` buffer over the job's own
//! `AtomicBool`, the same bytes, so the host's store reaches work-groups that start afterwards.
//! A discrete GPU would copy such a buffer at launch; it would need the flag in fine-grained SVM
//! (`clSVMAlloc` with `CL_MEM_SVM_FINE_GRAIN_BUFFER`) or host-mapped zero-copy memory
//! (`CL_MEM_ALLOC_HOST_PTR`, mapped) that the daemon's store reaches directly. Until then such
//! devices use the fallback: a non-blocking write copies the flag into a lane's device flag just
//! before the kernel starts (the in-order queue runs it after the previous command), so a launch
//! revoked while it waits behind other commands stops at once, and one revoked while it runs
//! completes; [`Device::polls_revocation`](crate::Device::polls_revocation) is false there.
//!
//! Limits ([`LaunchLimits`](crate::LaunchLimits)): each device reports its largest work-group (in
//! all and per dimension, from `CL_DEVICE_MAX_WORK_GROUP_SIZE` and
//! `CL_DEVICE_MAX_WORK_ITEM_SIZES`), its `size_t` (`CL_DEVICE_ADDRESS_BITS`, which bounds every
//! dimension of a launch) and its largest allocation (`CL_DEVICE_MAX_MEM_ALLOC_SIZE`). On top of
//! those, bounds that keep a launch within what the runtime survives and a lane from being held
//! for long by one command ([`MAX_GROUPS_PER_ENQUEUE`], [`MAX_ITEMS_PER_ENQUEUE`],
//! [`MAX_ITEMS_PER_LAUNCH`]): PoCL aborts the whole process on a command of 2^32 work-groups or
//! more, so these are checked before a launch is bound to the device, and larger launches are
//! split into row slices.
//!
//! One file per mechanism:
//! * `device`: the device, its shared state, discovery, and the [`Device`](crate::Device)
//!   implementation (allocation, synchronous reads, status);
//! * `executor`: a lane's executor, which turns a job into enqueued commands;
//! * `completion`: the completion callbacks that finish jobs, and what a job holds until then;
//! * `programs`: building and caching programs, kernel objects and their calling conventions;
//! * `buffer`: device memory of one buffer;
//! * `limits`: what a device reports about its limits, and the work-group shapes of launches.

mod buffer;
mod completion;
mod device;
mod executor;
mod limits;
mod programs;
#[cfg(test)]
mod tests;

/// Keeps this thread's test the only one using OpenCL until it ends. The daemon drives each
/// platform from one process and its own threads, but the test harness runs tests on several
/// threads with a context each, and PoCL then crashes the process now and then (its kernel
/// cache's `pocl_release_dlhandle_cache` assertion: 4 of 15 runs of this crate's tests with 12
/// test threads). The lock is held in a thread-local, released as the test's thread ends (the
/// harness runs each test on a thread of its own; on one thread, it is simply kept).
#[cfg(test)]
pub(crate) fn one_opencl_test_at_a_time() {
    use std::sync::{Mutex, MutexGuard};
    static LOCK: Mutex<()> = Mutex::new(());
    thread_local! {
        static HELD: std::cell::RefCell<Option<MutexGuard<'static, ()>>> = const { std::cell::RefCell::new(None) };
    }
    HELD.with(|held| {
        let mut held = held.borrow_mut();
        if held.is_none() {
            *held = Some(LOCK.lock().unwrap_or_else(|e| e.into_inner()));
        }
    });
}

use agora_protocol::TaskError;

pub use device::{discover, discover_except, discover_with, platform_names, OpenClDevice};
pub use limits::fixed_work_group;
pub use programs::{check_build, BuildProblem, DeviceBuild};

/// NVIDIA's OpenCL platform: the same GPUs the CUDA backend serves.
pub const NVIDIA_PLATFORM: &str = "NVIDIA CUDA";
pub use limits::{MAX_GROUPS_PER_ENQUEUE, MAX_ITEMS_PER_ENQUEUE, MAX_ITEMS_PER_LAUNCH};

/// An OpenCL error code as the task error a job fails with.
fn cl_error(e: impl Into<i64>) -> TaskError {
    TaskError::DeviceFailed(e.into())
}
