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
//! Limits: every backend reports what one launch may ask of its device ([`LaunchLimits`], in
//! [`DeviceInfo::limits`]), and the daemon checks each launch against them with
//! [`Device::check_launch`] before it binds the launch to the device. A launch too large for one
//! enqueue is split into row slices; one that no split fits goes to another device or fails with
//! [`TaskError::DeviceLimit`], so a device runtime never sees a launch it cannot take.
//!
//! This crate must not know about sessions, queues, policies or the wire protocol beyond kernel
//! signatures, task errors and device kinds: a device describes itself with its own types
//! ([`DeviceInfo`], [`DeviceReport`]), and the daemon turns those into control-plane replies.

use std::any::Any;
use std::sync::atomic::AtomicBool;
use std::sync::Arc;

use agora_kernels::{ArgValue, KernelDef, KernelRef};
pub use agora_protocol::DeviceKind;
use agora_protocol::{LaunchLimit, TaskError, MAX_ARGS};

#[cfg(feature = "cpu")]
pub mod cpu;
#[cfg(feature = "cuda")]
pub mod cuda;
pub mod lane;
#[cfg(feature = "opencl")]
pub mod opencl;
pub mod priority;
#[cfg(feature = "sim")]
pub mod sim;

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

// SAFETY: the host pointers refer to session memory kept mapped until the job completes (as for
// `Work`: the job's completion callback holds the session and the buffers).
unsafe impl Send for Transfer {}

impl Transfer {
    /// Bytes it moves.
    pub fn len(&self) -> usize {
        match self {
            Transfer::ToDevice { len, .. } | Transfer::ToHost { len, .. } => *len,
        }
    }

    /// Whether it moves nothing.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

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
    /// What one launch may ask of it.
    pub limits: LaunchLimits,
    /// Host cores one of its lanes keeps busy while it runs a kernel: a CPU lane's threads, an
    /// OpenCL device on the CPU (PoCL) its compute units (a kernel fans out over all of them); 0
    /// for a device with processors of its own (a GPU; a sim, whose time is modelled). The
    /// dispatcher does not spin while such work holds every core but its own.
    pub host_cores_per_lane: usize,
}

/// What a device says about itself now: its [`Device::status`]. The daemon adds what only it
/// knows (whether it drains the device) and turns the whole into the control protocol's reply.
#[derive(Debug, Clone, PartialEq)]
pub struct DeviceReport {
    /// Name, e.g. `cpu0`.
    pub name: String,
    /// Kind.
    pub kind: DeviceKind,
    /// What it is (e.g. the OpenCL platform and device name).
    pub description: String,
    /// Device memory in bytes (0 for devices that compute on host memory).
    pub memory_bytes: u64,
    /// Device memory allocated for buffers now.
    pub memory_used: u64,
    /// Device memory kept for tenants beyond their buffers: a GPU keeps each tenant's partition
    /// mapped between its allocations, and gives it back under pressure and when the tenant ends.
    pub memory_cached: u64,
    /// Percent of the last sample period in which the device ran a kernel (anyone's), where the
    /// device measures it (a GPU through NVML); `None` elsewhere.
    pub utilization_percent: Option<u32>,
    /// Threads per lane.
    pub threads_per_lane: usize,
    /// Each lane's counters, by lane index.
    pub lanes: Vec<LaneReport>,
    /// The device failed: [`Device::healthy`] is false, and its jobs fail with `DeviceLost`.
    pub failed: bool,
    /// A device in a device host: bytes its host moved through staging segments since start
    /// (host memory it had no mapping of, or only a read-only one for a write), all the host's
    /// devices together; 0 elsewhere.
    pub staged_bytes: u64,
}

/// What a lane says about itself now (see [`lane::Lane::status`]).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct LaneReport {
    /// Whether a job is running.
    pub busy: bool,
    /// Jobs waiting in the lane.
    pub queued: u64,
    /// Jobs run to the end.
    pub completed: u64,
    /// Nanoseconds spent running jobs.
    pub busy_ns: u64,
}

/// What one launch may ask of a device: reported by its backend, checked by the daemon before it
/// binds a launch to the device ([`Device::check_launch`]).
///
/// An *enqueue* is one device command: the whole launch, or one row slice of it (a contiguous
/// range of dimension 0; dimensions 1 and 2 are never split). A launch whose enqueue would be too
/// large is split into as many row slices as it takes, on devices that run row slices.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LaunchLimits {
    /// Most work items of one launch in all, however it is split.
    pub max_items: u64,
    /// Most work items in each dimension of the range, after rounding up to whole work-groups.
    pub max_extent: [u64; 3],
    /// Most work items of one enqueue (after rounding up to whole work-groups).
    pub max_items_per_enqueue: u64,
    /// Most work-groups of one enqueue.
    pub max_groups_per_enqueue: u64,
    /// Largest work-group in each dimension.
    pub max_group: [u64; 3],
    /// Most work items of one work-group.
    pub max_group_items: u64,
    /// Largest buffer argument in bytes (one device allocation), on devices with memory of their
    /// own.
    pub max_buffer_bytes: u64,
}

impl LaunchLimits {
    /// No limit but what a `u64` holds (the wire protocol bounds ranges further).
    pub const NONE: LaunchLimits = LaunchLimits {
        max_items: u64::MAX,
        max_extent: [u64::MAX; 3],
        max_items_per_enqueue: u64::MAX,
        max_groups_per_enqueue: u64::MAX,
        max_group: [u64::MAX; 3],
        max_group_items: u64::MAX,
        max_buffer_bytes: u64::MAX,
    };

    /// Checks a launch over `range` (1 to 3 dimensions) that runs in work-groups of `group`
    /// (1s where the device has none), whose buffer arguments are `buffer_lens` bytes long (by
    /// argument index; 0 for scalars). Returns the fewest row slices (enqueues) it needs: 1 when
    /// one enqueue takes the whole launch. `row_slices` says whether the device runs row slices;
    /// where it does not, a launch that needs more than one enqueue is refused.
    ///
    /// Slices are whole work-groups of dimension 0 (the daemon's slice boundaries keep to
    /// [`Device::row_alignment`], which is `group[0]`), so an even split into the returned number
    /// of slices keeps every slice within the per-enqueue limits.
    pub fn check(
        &self,
        range: &[u64],
        group: [u64; 3],
        buffer_lens: &[u64],
        row_slices: bool,
    ) -> Result<u64, TaskError> {
        let refuse = |limit, value, max| Err(TaskError::DeviceLimit { limit, value, max });
        let dims = range.len().clamp(1, 3);
        let mut extent = [1u64; 3];
        extent[..dims].copy_from_slice(&range[..dims]);
        let mut group = group.map(|g| g.max(1));
        group[dims..].fill(1);
        for (index, &len) in buffer_lens.iter().enumerate() {
            if len > self.max_buffer_bytes {
                return refuse(LaunchLimit::BufferBytes(index as u8), len, self.max_buffer_bytes);
            }
        }
        let items = extent.iter().fold(1u64, |a, b| a.saturating_mul(*b));
        if items > self.max_items {
            return refuse(LaunchLimit::Items, items, self.max_items);
        }
        let group_items = group.iter().fold(1u64, |a, b| a.saturating_mul(*b));
        if group_items > self.max_group_items {
            return refuse(LaunchLimit::WorkGroupSize, group_items, self.max_group_items);
        }
        if let Some(d) = (0..3).find(|&d| group[d] > self.max_group[d]) {
            return refuse(LaunchLimit::WorkGroupSize, group[d], self.max_group[d]);
        }
        // Each dimension is enqueued rounded up to whole work-groups.
        let mut groups = [1u64; 3];
        for d in 0..3 {
            groups[d] = extent[d].div_ceil(group[d]);
            if groups[d].saturating_mul(group[d]) > self.max_extent[d] {
                let max = self.max_extent[d] / group[d] * group[d];
                return refuse(LaunchLimit::Extent(d as u8), extent[d], max);
            }
        }
        // The smallest slice: one work-group of rows across dimensions 1 and 2.
        let row_groups = groups[1].saturating_mul(groups[2]);
        let row_items = row_groups.saturating_mul(group_items);
        let by_items = self.max_items_per_enqueue / row_items;
        if by_items == 0 {
            return refuse(LaunchLimit::ItemsPerEnqueue, row_items, self.max_items_per_enqueue);
        }
        let by_groups = self.max_groups_per_enqueue / row_groups;
        if by_groups == 0 {
            return refuse(LaunchLimit::GroupsPerEnqueue, row_groups, self.max_groups_per_enqueue);
        }
        let enqueues = groups[0].div_ceil(by_items.min(by_groups));
        if enqueues > 1 && !row_slices {
            return if by_items <= by_groups {
                let value = groups[0].saturating_mul(row_items);
                refuse(LaunchLimit::ItemsPerEnqueue, value, self.max_items_per_enqueue)
            } else {
                let value = groups[0].saturating_mul(row_groups);
                refuse(LaunchLimit::GroupsPerEnqueue, value, self.max_groups_per_enqueue)
            };
        }
        Ok(enqueues)
    }
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
        kernel: KernelRef,
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

// SAFETY: the pointers in `Work` refer to session memory that stays mapped, and is not reused,
// until the job completes: the job's completion callback (its `done`) holds the session's shared
// state, which owns the mapping, and the records of the buffers it names, which keep their heap
// ranges allocated (the daemon's `LaneCompletion`); `keepalive` is for callers with other
// memory. The daemon hands each job to exactly one lane.
unsafe impl Send for Work {}

/// The rows of dimension 0 a launch over `rows0` rows runs: the slice `rows` (clamped to the
/// range) or all of them. Empty when the slice is.
pub fn rows_to_run(rows0: u64, rows: Option<&std::ops::Range<u64>>) -> std::ops::Range<u64> {
    match rows {
        Some(rows) => rows.start.min(rows0)..rows.end.min(rows0),
        None => 0..rows0,
    }
}

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
    /// The job runs alone on its lane: the lane's earlier jobs finish before it starts, and
    /// nothing starts after it until its `done` returned (a checkpoint captures its buffers'
    /// host copies there, which a later job on an asynchronous device could change meanwhile).
    pub exclusive: bool,
    /// A deadline-class job (a node of an admitted real-time DAG) and its absolute deadline:
    /// the lane starts deadline jobs before latency and batch work, earliest deadline first
    /// (EDF). Such a job is never sliced: a batch launch it waits behind yields at its next
    /// slice boundary.
    pub deadline: Option<std::time::Instant>,
    /// Cuts a launch into row slices that the lane makes one at a time, as it starts them
    /// ([`Slices`]); `None`: the job runs whole.
    pub slices: Option<Slices>,
    /// Whose lane time the job is and what it costs: a lane shares its batch work among tenants
    /// by weight ([`Share`]).
    pub share: Share,
    /// Called exactly once with the outcome and the job's times (on the lane's thread, or on a
    /// device runtime thread for asynchronous devices). For a sliced job: once, after its last
    /// slice, with the first error if any, the first slice's start and the last one's end.
    pub done: Box<dyn FnOnce(Result<(), TaskError>, JobTimes) + Send>,
}

/// Who a job belongs to for a lane's weighted fair order of batch work, and what it costs.
///
/// A lane keeps each tenant's batch jobs in push order and starts, among the groups with jobs
/// waiting, the one that has received the least lane time for its weight, and within it the
/// tenant that has (two-level start-time fair queueing over device time: a job is charged its
/// predicted time when it starts, and the time it took once it finished): two
/// backlogged groups of weights 3 and 1 get the lane three quarters and one quarter of the time,
/// whatever their job sizes, however many jobs each queues and however many tenants each has. A
/// group or tenant that was idle comes back at the others' level, with no credit saved up.
/// Deadline- and latency-class jobs go before batch work as before; they are not weighed.
///
/// Tenants come in groups, weighed first: the lane goes to the group that received the least
/// for its weight, and within it to the tenant that did. The daemon makes each session a tenant
/// of weight 1 in the group of its user (weight 1), or of its Slurm job, whose weight is the
/// job's `agora` shares (issue #17): so a user or job gets its part of a lane however many
/// sessions it opens, and its sessions share that part.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Share {
    /// The group (0: the daemon's own work and tests).
    pub group: u64,
    /// The group's weight, at least 1.
    pub group_weight: u32,
    /// The tenant, within its group (0: the daemon's own work and tests).
    pub tenant: u64,
    /// Its weight within the group, at least 1.
    pub weight: u32,
    /// The job's predicted device time, nanoseconds: what starting it charges (a sliced
    /// launch's slices each a part of it) until it finished and the time it took replaces it.
    pub cost_ns: u64,
}

impl Default for Share {
    /// Tenant 0 of group 0, weights 1, charged a microsecond.
    fn default() -> Self {
        Share {
            group: 0,
            group_weight: 1,
            tenant: 0,
            weight: 1,
            cost_ns: 1_000,
        }
    }
}

/// How a lane cuts a launch (`Work::Launch` with `rows: None`) into consecutive row slices.
///
/// The lane keeps the launch as one queued job with a cursor over its rows and makes the next
/// slice's job only when it starts it (under [`lane::SLICE_DEPTH`]), so a launch cut into
/// thousands of slices costs one job's memory while it waits, not thousands. Between slices the
/// lane may start urgent (latency-class) jobs; the job's transfers go with its first slice.
///
/// Slice `i` covers rows `[b(i), b(i+1))` with `b(i) = align × ⌊units × i / count⌋` (capped at
/// the last row), `units = ⌈rows / align⌉`: even slices of whole multiples of `align` rows (so
/// there may be fewer than `count`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Slices {
    /// How many slices (at most).
    pub count: u64,
    /// Slice boundaries are multiples of this many rows ([`Device::row_alignment`]).
    pub align: u64,
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

/// Receives the outcome of an allocation started with [`Device::alloc_later`].
pub type AllocationDone = Box<dyn FnOnce(Result<Arc<dyn DeviceBuffer>, TaskError>) + Send>;

/// Receives the outcome of a copy started with [`Device::read_later`].
pub type ReadDone = Box<dyn FnOnce(Result<(), TaskError>) + Send>;

/// A device: lanes that run jobs in order.
pub trait Device: Send + Sync + std::fmt::Debug {
    /// Static facts.
    fn info(&self) -> &DeviceInfo;
    /// Whether the device has an implementation of `kernel`.
    fn implements(&self, kernel: &KernelDef) -> bool;
    /// Readies `kernel` to run here now rather than at its first launch (a GPU compiles and
    /// loads its code), so that a tenant program's author hears of code the device rejects when
    /// the program is built: `None` when the device does not run it or has nothing to prepare,
    /// else whether it is ready, or why not (e.g. the driver's JIT log).
    fn prepare(&self, _kernel: &KernelDef) -> Option<Result<(), String>> {
        None
    }
    /// Appends `job` to `lane`'s queue.
    fn submit(&self, lane: usize, job: Job);
    /// Jobs queued or running on `lane` (a load estimate for policies).
    fn lane_load(&self, lane: usize) -> usize;
    /// Runs `work` on the calling thread, now. Only for devices that share host memory, and only
    /// for work the caller has judged tiny; used to skip a thread hand-off for such tasks.
    fn run_inline(&self, work: &Work) -> Result<(), TaskError>;
    /// Allocates device memory for a buffer of `len` bytes owned by `tenant` (the daemon's
    /// session id: a device that fences tenants' kernels keeps each tenant's memory in a
    /// partition of its own). Devices that share host memory have no memory of their own and
    /// return `None`.
    fn alloc(&self, tenant: u64, len: u64) -> Option<Result<Arc<dyn DeviceBuffer>, TaskError>>;
    /// Whether [`Device::alloc`] waits for another process to answer (a device in a device host:
    /// a round trip that takes milliseconds when that process is busy). The dispatcher then
    /// allocates with [`Device::alloc_later`] and lets the task wait for the answer, not itself.
    fn allocates_far(&self) -> bool {
        false
    }
    /// Starts the allocation [`Device::alloc`] makes without waiting for it: `done` receives its
    /// outcome exactly once, later and perhaps on another thread (`DeviceLost` when the device
    /// goes first). The bytes count in [`Device::memory_used`] from this call on, so the
    /// memory books stay right while the answer travels. The default allocates now, on the
    /// calling thread.
    fn alloc_later(&self, tenant: u64, len: u64, done: AllocationDone) {
        done(self.alloc(tenant, len).unwrap_or(Err(TaskError::KernelFault)));
    }
    /// Copies `len` bytes of `from` (a buffer of this device) into `host`, synchronously.
    ///
    /// # Safety
    /// `host` must be valid for `len` bytes of writes.
    unsafe fn read(&self, from: &dyn DeviceBuffer, host: *mut u8, len: usize) -> Result<(), TaskError>;
    /// Starts the copy [`Device::read`] makes without waiting for it (an eviction's write-back
    /// from a device in a device host): `done` receives its outcome exactly once, later and
    /// perhaps on another thread. Returns `false`, and never calls `done`, where the device
    /// cannot (the default; a device host that could not stage memory outside the segments it
    /// maps): the caller reads synchronously.
    ///
    /// # Safety
    /// `host` must stay valid for `len` bytes of writes until `done` is called, nothing else may
    /// read or write them meanwhile, and `from` must stay allocated until then.
    unsafe fn read_later(&self, _from: &dyn DeviceBuffer, _host: *mut u8, _len: usize, _done: ReadDone) -> bool {
        false
    }
    /// Whether launches may be split into row slices (`Work::Launch::rows`) on this device.
    fn runs_row_slices(&self) -> bool {
        false
    }
    /// Whether launches of `kernel` may be split into row slices here: the kernel is chunkable,
    /// the device [runs row slices](Device::runs_row_slices), and the form in which the device
    /// runs this kernel can start at a row (a GPU's plain kernels cannot).
    fn slices(&self, kernel: &KernelDef) -> bool {
        self.runs_row_slices() && kernel.chunkable
    }
    /// Checks a launch of `kernel` over `range` (1 to 3 dimensions), whose buffer arguments are
    /// `buffer_lens` bytes long (by argument index, 0 for scalars), against this device's
    /// [`LaunchLimits`]; returns the fewest row slices (enqueues) it must be split into, or the
    /// [`TaskError::DeviceLimit`] that no split fixes. The daemon calls it before it binds a
    /// launch to the device, and runs the launch as at least that many slices.
    ///
    /// The default uses [`DeviceInfo::limits`] with work-groups of [`Device::row_alignment`]
    /// rows; backends whose work-groups span more dimensions override it.
    fn check_launch(&self, kernel: &KernelDef, range: &[u64], buffer_lens: &[u64]) -> Result<u64, TaskError> {
        let group = [self.row_alignment(kernel, range.len()), 1, 1];
        self.info().limits.check(range, group, buffer_lens, self.slices(kernel))
    }
    /// A multiple of rows that slice boundaries of `kernel` launched in `dims` dimensions should
    /// keep to (a work-group's extent in dimension 0 on OpenCL), so no slice runs idle work items
    /// at its edges. Any boundary gives correct results; this is about efficiency only.
    fn row_alignment(&self, _kernel: &KernelDef, _dims: usize) -> u64 {
        1
    }
    /// The fewest work items a row slice should have on this device: a smaller slice leaves the
    /// device partly idle while its fixed cost (a command, a completion) stays, so the daemon
    /// cuts a launch into no more slices than this allows (the device's limits may still require
    /// more). 1, the default: no floor (a CPU lane is busy with any slice).
    fn min_items_per_slice(&self) -> u64 {
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
    /// fails its lost tasks elsewhere. Never true again once false, unless [`Device::revive`]
    /// said it came back.
    fn healthy(&self) -> bool {
        true
    }
    /// Whether the device page-locks host memory for copies ([`Device::register_host_memory`]); the
    /// daemon counts such memory against a per-user limit only for devices that do.
    fn wants_pinned_host_memory(&self) -> bool {
        false
    }
    /// Whether the device must see host memory through its file descriptor: a device served by
    /// a device-host process maps each session's segment there, and cannot touch host memory it
    /// was not given ([`Device::register_host_memory`] is then how it gets it).
    fn maps_host_memory(&self) -> bool {
        false
    }
    /// Registers host memory `[base, base + len)` (a session's segment, whose memfd is `fd`) with
    /// the device: a device that [maps host memory](Device::maps_host_memory) maps it through
    /// `fd`; with `page_lock` (only asked of devices that [want it](Device::wants_pinned_host_memory),
    /// within the user's limit) the memory is also page-locked for the device, so its transfers
    /// from and to it are DMA without a staging copy. The returned guard undoes both when
    /// dropped, which the caller does before the memory is unmapped. `None`: the device has
    /// nothing to do (the default); an error says why it could not (transfers still work,
    /// through a staging copy).
    fn register_host_memory(
        &self,
        _base: *mut u8,
        _len: usize,
        _fd: std::os::fd::BorrowedFd<'_>,
        _page_lock: bool,
    ) -> Option<Result<Box<dyn Any + Send + Sync>, String>> {
        None
    }
    /// `tenant` (a session id given to [`Device::alloc`]) is gone and its buffers with it: a
    /// device that keeps memory for a tenant between its allocations gives it back now. Called
    /// off the dispatcher, after the session's buffers are dropped; buffers still held by work in
    /// flight keep what they use. The default keeps nothing, so does nothing.
    fn tenant_ended(&self, _tenant: u64) {}
    /// Tries to bring back a device that failed ([`Device::healthy`] turned false), after the
    /// daemon has forgotten every copy it held: a device served by a device-host process starts a
    /// new host. Called by the dispatcher now and then while the device is failed; must not block
    /// (start the work elsewhere and answer `false` until it is done). `true`: the device works
    /// again, with no buffer of before; `false` (the default): not (yet).
    fn revive(&self) -> bool {
        false
    }
    /// A status snapshot.
    fn status(&self) -> DeviceReport;
    /// Stops the lanes after their queued jobs are cancelled.
    fn shutdown(&self);
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Limits shaped like an OpenCL device on PoCL here (see the OpenCL backend).
    fn pocl_like() -> LaunchLimits {
        LaunchLimits {
            max_items: 1 << 36,
            max_extent: [u64::MAX; 3],
            max_items_per_enqueue: 1 << 32,
            max_groups_per_enqueue: 1 << 31,
            max_group: [4096; 3],
            max_group_items: 4096,
            max_buffer_bytes: 2 << 30,
        }
    }

    fn limit(result: Result<u64, TaskError>) -> (LaunchLimit, u64, u64) {
        match result {
            Err(TaskError::DeviceLimit { limit, value, max }) => (limit, value, max),
            other => panic!("expected a device limit, got {other:?}"),
        }
    }

    /// The daemon's even split (`submit_sliced`): `slices` slices of whole groups of `align` rows;
    /// returns the largest slice in groups.
    fn largest_slice(rows: u64, align: u64, slices: u64) -> u64 {
        let units = rows.div_ceil(align).max(1);
        let slices = slices.clamp(1, units);
        (0..slices)
            .map(|i| units * (i + 1) / slices - units * i / slices)
            .max()
            .unwrap()
    }

    #[test]
    fn no_limits_take_anything_in_one_enqueue() {
        let none = LaunchLimits::NONE;
        assert_eq!(none.check(&[1 << 40], [1, 1, 1], &[], false), Ok(1));
        assert_eq!(none.check(&[1 << 20, 1 << 20], [1, 1, 1], &[u64::MAX], true), Ok(1));
        assert_eq!(none.check(&[1 << 40, 1 << 10, 1 << 10], [64, 4, 4], &[], false), Ok(1));
    }

    #[test]
    fn a_range_too_large_for_one_enqueue_needs_row_slices() {
        let l = pocl_like();
        // Up to 2^32 items in groups of 64: one enqueue.
        assert_eq!(l.check(&[1], [64, 1, 1], &[], true), Ok(1));
        assert_eq!(l.check(&[1 << 32], [64, 1, 1], &[], true), Ok(1));
        // One more work-group of rows: two.
        assert_eq!(l.check(&[(1 << 32) + 1], [64, 1, 1], &[], true), Ok(2));
        assert_eq!(l.check(&[1 << 33], [64, 1, 1], &[], true), Ok(2));
        assert_eq!(l.check(&[1 << 36], [64, 1, 1], &[], true), Ok(16));
        // 2-D and 3-D: whole work-groups of rows across the other dimensions.
        assert_eq!(l.check(&[1 << 17, 1 << 16], [8, 8, 1], &[], true), Ok(2));
        assert_eq!(l.check(&[1 << 11, 1 << 11, 1 << 11], [4, 4, 4], &[], true), Ok(2));
        // Groups of one work item: the work-group bound (2^31) binds before the item bound.
        assert_eq!(l.check(&[1 << 32], [1, 1, 1], &[], true), Ok(2));
        // Rounding up to whole groups counts: 2^32 - 1 items in groups of 64 are 2^32 items.
        assert_eq!(l.check(&[(1 << 32) - 1], [64, 1, 1], &[], true), Ok(1));
        assert_eq!(l.check(&[1 << 32, 3], [8, 8, 1], &[], true), Ok(8));
    }

    #[test]
    fn an_even_split_into_the_required_slices_keeps_every_slice_within_the_limits() {
        let l = pocl_like();
        let cases: &[(&[u64], [u64; 3])] = &[
            (&[(1 << 33) + 12345], [64, 1, 1]),
            (&[1 << 36], [64, 1, 1]),
            (&[(1 << 32) + 1], [1, 1, 1]),
            (&[(1 << 24) + 7, 1000], [8, 8, 1]),
            (&[(1 << 20) + 3, 100, 77], [4, 4, 4]),
            (&[999_999_999, 33], [16, 16, 1]),
        ];
        for (range, group) in cases {
            let slices = l.check(range, *group, &[], true).unwrap();
            let mut padded = [1u64; 3];
            for (d, extent) in range.iter().enumerate() {
                padded[d] = extent.div_ceil(group[d]) * group[d];
            }
            let row_items = group[0] * padded[1] * padded[2];
            let row_groups = padded[1] / group[1] * (padded[2] / group[2]);
            let largest = largest_slice(range[0], group[0], slices);
            assert!(
                largest * row_items <= l.max_items_per_enqueue,
                "{range:?}: {slices} slices"
            );
            assert!(
                largest * row_groups <= l.max_groups_per_enqueue,
                "{range:?}: {slices} slices"
            );
            if slices > 1 {
                // And no fewer slices would do.
                let fewer = largest_slice(range[0], group[0], slices - 1);
                assert!(
                    fewer * row_items > l.max_items_per_enqueue || fewer * row_groups > l.max_groups_per_enqueue,
                    "{range:?}: {} slices would do",
                    slices - 1
                );
            }
        }
    }

    #[test]
    fn what_no_split_fixes_is_refused_naming_the_limit() {
        let l = pocl_like();
        // The whole launch.
        assert_eq!(
            limit(l.check(&[1 << 40], [64, 1, 1], &[], true)),
            (LaunchLimit::Items, 1 << 40, 1 << 36)
        );
        assert_eq!(
            limit(l.check(&[1 << 20, 1 << 20], [8, 8, 1], &[], true)),
            (LaunchLimit::Items, 1 << 40, 1 << 36)
        );
        // One row of work-groups across dimensions 1 and 2 is already too large for an enqueue.
        let l = LaunchLimits {
            max_items: u64::MAX,
            ..pocl_like()
        };
        assert_eq!(
            limit(l.check(&[8, 1 << 30], [8, 8, 1], &[], true)),
            (LaunchLimit::ItemsPerEnqueue, 1 << 33, 1 << 32)
        );
        assert_eq!(
            limit(l.check(&[1, 1 << 31, 2], [1, 1, 1], &[], true)),
            (LaunchLimit::GroupsPerEnqueue, 1 << 32, 1 << 31)
        );
        // A device that does not run row slices takes one enqueue only.
        assert_eq!(l.check(&[1 << 32], [64, 1, 1], &[], false), Ok(1));
        assert_eq!(
            limit(l.check(&[1 << 33], [64, 1, 1], &[], false)),
            (LaunchLimit::ItemsPerEnqueue, 1 << 33, 1 << 32)
        );
        assert_eq!(
            limit(l.check(&[1 << 32], [1, 1, 1], &[], false)),
            (LaunchLimit::GroupsPerEnqueue, 1 << 32, 1 << 31)
        );
    }

    #[test]
    fn work_groups_extents_and_buffers_are_checked() {
        let l = LaunchLimits {
            max_group: [256, 256, 64],
            max_group_items: 256,
            max_extent: [u32::MAX as u64; 3],
            ..pocl_like()
        };
        assert_eq!(l.check(&[100, 100], [16, 16, 1], &[], true), Ok(1));
        assert_eq!(
            limit(l.check(&[100, 100], [32, 16, 1], &[], true)),
            (LaunchLimit::WorkGroupSize, 512, 256)
        );
        assert_eq!(
            limit(l.check(&[100, 100, 100], [1, 1, 128], &[], true)),
            (LaunchLimit::WorkGroupSize, 128, 64)
        );
        // Group extents beyond the launch's dimensions do not count.
        assert_eq!(l.check(&[100], [64, 8, 128], &[], true), Ok(1));
        // A 32-bit size_t bounds every dimension, rounded up to whole work-groups.
        assert_eq!(
            limit(l.check(&[1, 1 << 32], [1, 1, 1], &[], true)),
            (LaunchLimit::Extent(1), 1 << 32, u32::MAX as u64)
        );
        assert_eq!(
            limit(l.check(&[u32::MAX as u64], [64, 1, 1], &[], true)),
            (LaunchLimit::Extent(0), u32::MAX as u64, (u32::MAX as u64) / 64 * 64)
        );
        // Buffers larger than one allocation, by argument index.
        assert_eq!(l.check(&[10], [64, 1, 1], &[0, 2 << 30, 5], true), Ok(1));
        assert_eq!(
            limit(l.check(&[10], [64, 1, 1], &[0, 5, (2 << 30) + 1], true)),
            (LaunchLimit::BufferBytes(2), (2 << 30) + 1, 2 << 30)
        );
    }
}
