//! The device layer: one small [`Device`] trait and its backends, one module (and cargo feature)
//! per backend.
//!
//! Contract, in the style of wgpu-hal: the daemon validates every task before it reaches a
//! device (handles resolved, signatures and sizes checked, byte ranges inside their buffers), so
//! devices do not re-validate. A defensive check that fires here is a daemon bug; devices turn it
//! into a [`TaskError::KernelFault`] for that task rather than crash.
//!
//! A device exposes *lanes*: independent execution contexts (a group of CPU threads, an OpenCL
//! command queue, a CUDA stream). Each lane runs its jobs in submission order, one at a time, so a
//! queue bound to a lane keeps its issue order for free. Several lanes give spatial sharing.
//!
//! This crate must not know about sessions, queues, policies or the wire protocol beyond kernel
//! signatures and task errors.

use std::any::Any;
use std::sync::atomic::AtomicBool;
use std::sync::Arc;

use agora_kernels::{ArgValue, KernelDef};
use agora_protocol::control::DeviceStatus;
use agora_protocol::{TaskError, MAX_ARGS};

#[cfg(feature = "cpu")]
pub mod cpu;
pub mod lane;
#[cfg(feature = "opencl")]
pub mod opencl;
#[cfg(feature = "sim")]
pub mod sim;

/// Kinds of device.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DeviceKind {
    /// Host CPU cores.
    Cpu,
    /// An OpenCL device (any platform: PoCL on the CPU, a GPU, an FPGA).
    OpenCl,
    /// A modeled device (`sim`): exact results, modeled time; for scale tests.
    Sim,
}

impl DeviceKind {
    /// Lower-case name.
    pub fn name(self) -> &'static str {
        match self {
            DeviceKind::Cpu => "cpu",
            DeviceKind::OpenCl => "opencl",
            DeviceKind::Sim => "sim",
        }
    }

    /// Parses a lower-case name.
    pub fn parse(name: &str) -> Option<DeviceKind> {
        match name {
            "cpu" => Some(DeviceKind::Cpu),
            "opencl" => Some(DeviceKind::OpenCl),
            "sim" => Some(DeviceKind::Sim),
            _ => None,
        }
    }
}

/// Memory a device allocated for one buffer. Freed when the last reference goes.
pub trait DeviceBuffer: Send + Sync + std::fmt::Debug {
    /// Length in bytes.
    fn len(&self) -> u64;
    /// Whether it is empty.
    fn is_empty(&self) -> bool {
        self.len() == 0
    }
    /// For the owning backend to get its concrete type back.
    fn as_any(&self) -> &dyn Any;
}

/// A data movement that runs, in order, before a job's work.
#[derive(Debug, Clone)]
pub enum Transfer {
    /// Host bytes into a buffer of the job's own device.
    ToDevice {
        /// Source (the buffer's host copy).
        host: *const u8,
        /// Bytes.
        len: usize,
        /// Destination.
        to: Arc<dyn DeviceBuffer>,
    },
    /// A buffer of `device` (any device) into host memory.
    ToHost {
        /// Source.
        from: Arc<dyn DeviceBuffer>,
        /// The device that owns `from`.
        device: Arc<dyn Device>,
        /// Destination (the buffer's host copy).
        host: *mut u8,
        /// Bytes.
        len: usize,
    },
}

// SAFETY: the host pointers refer to session memory kept mapped by the job until it completes.
unsafe impl Send for Transfer {}

/// Static facts about a device.
#[derive(Debug, Clone)]
pub struct DeviceInfo {
    /// Name, e.g. `cpu0`.
    pub name: String,
    /// Kind.
    pub kind: DeviceKind,
    /// Number of lanes.
    pub lanes: usize,
    /// Threads (or compute units) per lane.
    pub threads_per_lane: usize,
    /// Longer description (platform and device names).
    pub description: String,
    /// Device memory in bytes (0 when it shares host memory).
    pub memory_bytes: u64,
    /// Whether the device computes directly on host memory (the session segment), so host and
    /// device copies of a buffer are the same bytes and transfers are ordering points only.
    pub shares_host_memory: bool,
}

/// What a job does.
// `Launch` is the common case and much larger than the others; boxing it would add an
// allocation per task on the hot path for no gain.
#[allow(clippy::large_enum_variant)]
#[derive(Debug, Clone)]
pub enum Work {
    /// Run a kernel.
    Launch {
        /// The kernel.
        kernel: &'static KernelDef,
        /// Range (dims entries meaningful).
        range: [u64; 3],
        /// Number of dimensions.
        dims: usize,
        /// Resolved arguments.
        args: [ArgValue; MAX_ARGS],
        /// Number of arguments.
        arg_count: usize,
        /// Device buffers for buffer arguments, on devices with memory of their own.
        device_args: [Option<Arc<dyn DeviceBuffer>>; MAX_ARGS],
        /// Only these rows of the first dimension (a slice of a chunked launch); `None`: all.
        /// Only devices whose [`Device::runs_row_slices`] is true get slices.
        rows: Option<std::ops::Range<u64>>,
    },
    /// Fill `len` bytes at `ptr` with `value`.
    Fill {
        /// Destination.
        ptr: *mut u8,
        /// Length.
        len: usize,
        /// Byte value.
        value: u8,
    },
    /// Copy `len` bytes from `src` to `dst` (ranges may overlap).
    Copy {
        /// Source.
        src: *const u8,
        /// Destination.
        dst: *mut u8,
        /// Length.
        len: usize,
    },
    /// An ordering point with nothing to do (e.g. a transfer on a host-memory device).
    Nothing,
}

// SAFETY: the pointers in `Work` refer to session memory that the job's `keepalive` keeps mapped
// until the job completes; the daemon hands each job to exactly one lane.
unsafe impl Send for Work {}

/// Runs work that touches only host memory (fills, copies, ordering points) on the calling
/// thread; `None` for kernel launches. Every backend's lanes can run these.
pub fn run_host_work(work: &Work) -> Option<Result<(), TaskError>> {
    match work {
        Work::Nothing => Some(Ok(())),
        Work::Fill { ptr, len, value } => {
            // SAFETY: the daemon checked that [ptr, ptr+len) lies in a live buffer's host copy,
            // kept mapped by the job; this lane is the only writer.
            unsafe { std::ptr::write_bytes(*ptr, *value, *len) };
            Some(Ok(()))
        }
        Work::Copy { src, dst, len } => {
            // SAFETY: both ranges were bounds-checked against live buffers; `copy` allows overlap.
            unsafe { std::ptr::copy(*src, *dst, *len) };
            Some(Ok(()))
        }
        Work::Launch { .. } => None,
    }
}

/// A unit of work for a lane.
pub struct Job {
    /// Data movements to perform first, in order.
    pub transfers: Vec<Transfer>,
    /// What to do.
    pub work: Work,
    /// Keeps the memory the work points into alive until the job is done.
    pub keepalive: Option<Arc<dyn Any + Send + Sync>>,
    /// When set before the job starts, the job is skipped and completes with `Cancelled`.
    pub cancelled: Option<Arc<AtomicBool>>,
    /// Makes the job revocable (see [`Revocation`]); `None` for ordinary jobs.
    pub revoke: Option<Revocation>,
    /// A latency-class job: the lane starts it before any queued non-urgent job (so a sliced
    /// batch launch yields the lane at its next slice boundary).
    pub urgent: bool,
    /// Called exactly once with the outcome and the job's times (on the lane's thread, or on a
    /// device runtime thread for asynchronous devices).
    pub done: Box<dyn FnOnce(Result<(), TaskError>, JobTimes) + Send>,
}

/// What makes a job revocable.
///
/// When `flag` is set while the job's launch runs, a device whose [`Device::polls_revocation`] is
/// true stops the launch early (the CPU checks it between blocks of rows, OpenCL kernels per
/// work-group) and completes the job with `Cancelled`; its writes are then partial, and the
/// daemon restores what `save` kept before it replays the task. Set before the job starts, the
/// job is skipped, as with [`Job::cancelled`].
///
/// Lanes run a revocable job alone: they let every earlier job finish before it starts (so `save`
/// sees the buffers as the job will) and start nothing after it until it has finished (so a
/// replay still runs before its queue's later jobs).
pub struct Revocation {
    /// The revocation request.
    pub flag: Arc<AtomicBool>,
    /// Run on the lane's thread just before the job starts (after earlier jobs finished): saves
    /// what a replay needs. An error fails the job without running it.
    pub save: Option<Box<dyn FnOnce() -> Result<(), TaskError> + Send>>,
    /// This job replays a revoked one: it goes to the front of the lane's non-urgent FIFO, ahead
    /// of later jobs of its queue.
    pub replay: bool,
}

impl std::fmt::Debug for Revocation {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Revocation")
            .field("flag", &self.flag)
            .field("replay", &self.replay)
            .finish_non_exhaustive()
    }
}

/// When a job went through a lane.
#[derive(Debug, Clone, Copy)]
pub struct JobTimes {
    /// Appended to the lane's queue.
    pub queued: std::time::Instant,
    /// Started by the lane.
    pub started: std::time::Instant,
    /// Its transfers were done (when it had any).
    pub transfers_done: Option<std::time::Instant>,
    /// Finished.
    pub finished: std::time::Instant,
    /// The job paid a one-time cost (e.g. building a device program): its time says little
    /// about the next run, so performance models skip it.
    pub cold: bool,
}

impl std::fmt::Debug for Job {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Job").field("work", &self.work).finish_non_exhaustive()
    }
}

/// A device: lanes that run jobs in order.
pub trait Device: Send + Sync + std::fmt::Debug {
    /// Static facts.
    fn info(&self) -> &DeviceInfo;
    /// Whether the device has an implementation of `kernel`.
    fn implements(&self, kernel: &KernelDef) -> bool;
    /// Appends `job` to `lane`'s queue.
    fn submit(&self, lane: usize, job: Job);
    /// Jobs queued or running on `lane` (a load estimate for policies).
    fn lane_load(&self, lane: usize) -> usize;
    /// Runs `work` on the calling thread, now. Only for devices that share host memory, and only
    /// for work the caller has judged tiny; used to skip a thread hand-off for such tasks.
    fn run_inline(&self, work: &Work) -> Result<(), TaskError>;
    /// Allocates device memory for a buffer of `len` bytes. Devices that share host memory have
    /// no memory of their own and return `None`.
    fn alloc(&self, len: u64) -> Option<Result<Arc<dyn DeviceBuffer>, TaskError>>;
    /// Copies `len` bytes of `from` (a buffer of this device) into `host`, synchronously.
    ///
    /// # Safety
    /// `host` must be valid for `len` bytes of writes.
    unsafe fn read(&self, from: &dyn DeviceBuffer, host: *mut u8, len: usize) -> Result<(), TaskError>;
    /// Whether launches may be split into row slices (`Work::Launch::rows`) on this device.
    fn runs_row_slices(&self) -> bool {
        false
    }
    /// A multiple of rows that slice boundaries of `kernel` launched in `dims` dimensions should
    /// keep to (a work-group's extent in dimension 0 on OpenCL), so no slice runs idle work items
    /// at its edges. Any boundary gives correct results; this is about efficiency only.
    fn row_alignment(&self, _kernel: &KernelDef, _dims: usize) -> u64 {
        1
    }
    /// Whether a running launch stops early when its job's [`Job::revoke`] flag is set.
    fn polls_revocation(&self) -> bool {
        false
    }
    /// Bytes of device memory allocated now (0 for devices that share host memory).
    fn memory_used(&self) -> u64 {
        0
    }
    /// Whether the device still works. A backend that detects its device is gone (or, for
    /// `sim`, whose injected fault fired) returns false from then on and fails every job with
    /// [`TaskError::DeviceLost`], transfers included; the daemon then drains it and replays or
    /// fails its lost tasks elsewhere. Never true again once false.
    fn healthy(&self) -> bool {
        true
    }
    /// A status snapshot.
    fn status(&self) -> DeviceStatus;
    /// Stops the lanes after their queued jobs are cancelled.
    fn shutdown(&self);
}
