//! A CUDA device: discovery, the state its lanes and buffers share (one context per GPU, shared
//! by every tenant), and the [`Device`] implementation (allocation, synchronous reads for other
//! devices, host-memory registration, status).
//!
//! Owns the device's context, its reader and zeroing streams and its lanes. It must not enqueue a
//! job's commands (the lanes' executors do) nor finish jobs (the stream callbacks do).

use std::collections::HashMap;
use std::ffi::c_void;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use agora_kernels::KernelDef;
use agora_protocol::TaskError;
use cudarc::driver::result as driver;
use cudarc::driver::sys::{self, CUcontext, CUdevice, CUdevice_attribute, CUdeviceptr, CUresult, CUstream};

use super::buffer::{as_cuda, CudaBuffer, PinnedHost};
use super::completion::Completions;
use super::executor::{CudaExecutor, MappedFlag};
use super::partition::{Partition, Partitions};
use super::programs::{self, Programs};
use super::utilization::Utilization;
use crate::lane::{Lane, Lanes};
use crate::priority::{LaneClass, LanePriorities};
use crate::{Device, DeviceBuffer, DeviceInfo, DeviceKind, DeviceReport, Job, LaunchLimits, Work};

/// Most blocks of one launch in dimension 0 (CUDA's grid limit); dimensions 1 and 2 take 65 535.
pub const MAX_GRID_X: u64 = (1 << 31) - 1;
/// Most blocks in dimensions 1 and 2 of a launch.
pub const MAX_GRID_YZ: u64 = 65_535;
/// Most threads of one launch command: a larger launch is cut into row slices, so one command
/// holds its stream for a bounded time and latency-class work gets in between.
pub const MAX_ITEMS_PER_ENQUEUE: u64 = 1 << 32;

/// Driver errors after which the context is unusable for every stream in it (a kernel fault).
pub(super) fn is_sticky(code: CUresult) -> bool {
    matches!(
        code,
        CUresult::CUDA_ERROR_ILLEGAL_ADDRESS
            | CUresult::CUDA_ERROR_LAUNCH_FAILED
            | CUresult::CUDA_ERROR_MISALIGNED_ADDRESS
            | CUresult::CUDA_ERROR_ILLEGAL_INSTRUCTION
            | CUresult::CUDA_ERROR_HARDWARE_STACK_ERROR
            | CUresult::CUDA_ERROR_INVALID_ADDRESS_SPACE
            | CUresult::CUDA_ERROR_INVALID_PC
            | CUresult::CUDA_ERROR_ASSERT
            | CUresult::CUDA_ERROR_LAUNCH_TIMEOUT
            | CUresult::CUDA_ERROR_ECC_UNCORRECTABLE
            | CUresult::CUDA_ERROR_UNKNOWN
    )
}

/// State shared by a device's lanes and its buffers.
pub(super) struct Shared {
    pub(super) name: String,
    pub(super) context: CUcontext,
    /// Compute capability as `major * 10 + minor` (NVRTC's `compute_XX`).
    pub(super) arch: u32,
    /// Threads the whole GPU runs at once (multiprocessors × threads per multiprocessor).
    pub(super) resident_threads: u64,
    /// Stream for synchronous reads requested by other devices' lanes, and for zeroing fresh
    /// allocations.
    pub(super) reader: Mutex<CUstream>,
    pub(super) programs: Programs,
    pub(super) memory_used: AtomicU64,
    pub(super) memory_bytes: u64,
    pub(super) pinned_bytes: AtomicU64,
    /// One zero byte: the revocation flag of launches that cannot be revoked.
    pub(super) zero_flag: CUdeviceptr,
    /// A kernel faulted and left the context unusable: every job fails with `DeviceLost`.
    pub(super) failed: AtomicBool,
    /// Allocations dropped on a stream-callback thread, where CUDA calls are not allowed.
    deferred_frees: Mutex<Vec<Freed>>,
    /// Each tenant's memory in a partition of its own (absent where the GPU has no virtual
    /// memory management: then tenants' own kernels never run on it).
    pub(super) partitions: Option<Partitions>,
    /// How long a tenant's fenced kernel may run before it is stopped (`KernelTimeout`); `None`:
    /// no limit.
    pub(super) tenant_launch_limit: Option<Duration>,
    /// A partition no tenant's buffer lives in, for fenced launches without buffer arguments
    /// (their stray accesses land there), made at the first one.
    scratch: Mutex<Option<Arc<Partition>>>,
}

/// An allocation to free.
pub(super) enum Freed {
    /// A `cuMemAlloc` allocation.
    Whole(CUdeviceptr, u64),
    /// A sub-range of a tenant's partition (the partition itself goes with its last buffer).
    InPartition(Arc<Partition>, CUdeviceptr, u64),
}

// SAFETY: the context and stream handles are process-wide driver handles usable from any thread
// once the context is current there (`bind`); the mutable parts are atomics or behind mutexes.
unsafe impl Send for Shared {}
// SAFETY: as above.
unsafe impl Sync for Shared {}

thread_local! {
    /// Set while a stream callback runs on this thread: CUDA calls are not allowed there.
    pub(super) static IN_CALLBACK: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

impl Shared {
    /// Makes the device's context current on the calling thread.
    pub(super) fn bind(&self) -> Result<(), TaskError> {
        // SAFETY: a live context (released only when the device is dropped).
        unsafe { driver::ctx::set_current(self.context) }.map_err(|e| self.error(e.0))
    }

    /// The task error for a driver error, marking the device failed when the context is gone.
    pub(super) fn error(&self, code: CUresult) -> TaskError {
        if is_sticky(code) {
            if !self.failed.swap(true, Ordering::AcqRel) {
                tracing::error!(device = %self.name, ?code, "a kernel fault left the CUDA context unusable; the device fails its jobs from now on");
            }
            return TaskError::KernelFault;
        }
        TaskError::DeviceFailed(code as i64)
    }

    /// Frees an allocation now, or later when called from a stream callback.
    pub(super) fn free(&self, freed: Freed) {
        if IN_CALLBACK.with(|c| c.get()) {
            self.deferred_frees
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .push(freed);
            return;
        }
        let bound = self.bind().is_ok();
        let len = match freed {
            Freed::Whole(ptr, len) => {
                if bound {
                    // SAFETY: an allocation of this context that no queued command uses any more
                    // (the job that used it last has completed).
                    let _ = unsafe { driver::free_sync(ptr) };
                }
                len
            }
            Freed::InPartition(partition, ptr, len) => {
                // (Unbound, it would unmap nothing: the range is still returned.)
                partition.free(ptr, len);
                // The partition is unmapped here if this was its last buffer (the context is
                // current: this is not a callback thread).
                drop(partition);
                len
            }
        };
        self.memory_used.fetch_sub(len, Ordering::Relaxed);
    }

    /// Frees what stream callbacks dropped (on a thread where CUDA calls are allowed).
    pub(super) fn free_deferred(&self) {
        let frees = std::mem::take(&mut *self.deferred_frees.lock().unwrap_or_else(|e| e.into_inner()));
        for freed in frees {
            self.free(freed);
        }
    }

    /// The partition and fence arguments (base, mask) for a fenced launch with these buffers:
    /// their tenant's partition, which must hold them all, or the scratch partition when there
    /// are none. The context must be current.
    pub(super) fn fence_for(&self, buffers: &[&CudaBuffer]) -> Result<(u64, u64), TaskError> {
        let partition = match buffers.first() {
            Some(first) => {
                let partition = first.partition.clone().filter(|partition| {
                    buffers.iter().all(|b| {
                        b.partition.as_ref().is_some_and(|p| Arc::ptr_eq(p, partition)) && partition.holds(b.ptr, b.len)
                    })
                });
                // A buffer outside a partition (its tenant got none) or in another one.
                partition.ok_or_else(|| {
                    tracing::error!(device = %self.name, "a fenced launch's buffers are not all in one tenant partition; refused");
                    TaskError::KernelFault
                })?
            }
            None => {
                let mut scratch = self.scratch.lock().unwrap_or_else(|e| e.into_inner());
                match &*scratch {
                    Some(p) => p.clone(),
                    None => {
                        let partitions = self.partitions.as_ref().ok_or(TaskError::KernelFault)?;
                        let p = partitions.of(u64::MAX).map_err(|e| {
                            tracing::error!(device = %self.name, error = %e, "no scratch partition for a fenced launch");
                            TaskError::KernelFault
                        })?;
                        // Maps its first granule (the sub-range itself is never used or freed).
                        p.alloc(1).map_err(|e| {
                            tracing::error!(device = %self.name, error = %e, "no scratch partition for a fenced launch");
                            TaskError::KernelFault
                        })?;
                        *scratch = Some(p.clone());
                        p
                    }
                }
            }
        };
        partition.mark_fenced();
        partition.fence_arguments().ok_or(TaskError::KernelFault)
    }
}

/// An NVIDIA GPU.
pub struct CudaDevice {
    info: DeviceInfo,
    pub(super) shared: Arc<Shared>,
    lanes: Lanes,
    ordinal: CUdevice,
    /// The completion thread (absent when jobs finish from stream callbacks).
    completer: Option<(Arc<Completions>, std::thread::JoinHandle<()>)>,
    /// Every lane has a mapped revocation flag that the completion thread keeps current, so a
    /// running kernel stops when its job is revoked.
    polls: bool,
    /// How busy the GPU is, from NVML where it is readable.
    utilization: Utilization,
}

/// The GPU's PCI bus id (`0000:17:00.0`), how NVML finds the same GPU whatever the CUDA
/// ordinals are (`CUDA_VISIBLE_DEVICES` renumbers them, NVML does not).
fn pci_bus_id(device: CUdevice) -> String {
    let mut text = [0 as std::ffi::c_char; 32];
    // SAFETY: a valid device and a buffer of the length passed.
    let code = unsafe { sys::cuDeviceGetPCIBusId(text.as_mut_ptr(), text.len() as i32, device) };
    if code != CUresult::CUDA_SUCCESS {
        return String::new();
    }
    // SAFETY: the driver wrote a NUL-terminated string into the buffer (zeroed beyond it).
    unsafe { std::ffi::CStr::from_ptr(text.as_ptr()) }
        .to_string_lossy()
        .into_owned()
}

/// One byte of page-locked host memory mapped into the GPU's address space, zeroed (`None` when
/// the driver refuses: the lane then copies flags in before kernels).
fn mapped_flag() -> Option<MappedFlag> {
    mapped_bytes(1)
}

/// Four bytes (a lane's stop word, see `fence`) of page-locked host memory mapped into the GPU's
/// address space, zeroed; `None` when the driver refuses.
pub(super) fn mapped_word() -> Option<MappedFlag> {
    mapped_bytes(4)
}

/// `len` bytes of page-locked host memory mapped into the GPU's address space, zeroed.
fn mapped_bytes(len: usize) -> Option<MappedFlag> {
    let mut host = std::ptr::null_mut();
    let flags = sys::CU_MEMHOSTALLOC_DEVICEMAP | sys::CU_MEMHOSTALLOC_PORTABLE;
    // SAFETY: a `len`-byte page-locked allocation in the current context, freed by the lane.
    if unsafe { sys::cuMemHostAlloc(&mut host, len, flags) } != CUresult::CUDA_SUCCESS {
        return None;
    }
    let mut device = 0;
    // SAFETY: `host` was allocated with DEVICEMAP just above.
    if unsafe { sys::cuMemHostGetDevicePointer_v2(&mut device, host, 0) } != CUresult::CUDA_SUCCESS {
        // SAFETY: allocated above, used by nothing.
        let _ = unsafe { sys::cuMemFreeHost(host) };
        return None;
    }
    // SAFETY: `len` bytes, ours.
    unsafe { std::ptr::write_bytes(host as *mut u8, 0, len) };
    Some(MappedFlag {
        host: host as *mut u8,
        device,
    })
}

impl std::fmt::Debug for CudaDevice {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CudaDevice")
            .field("info", &self.info)
            .finish_non_exhaustive()
    }
}

fn attribute(device: CUdevice, attribute: CUdevice_attribute) -> i64 {
    // SAFETY: a valid device and attribute.
    unsafe { driver::device::get_attribute(device, attribute) }.map_or(0, i64::from)
}

impl CudaDevice {
    fn new(
        index: usize,
        ordinal: i32,
        lanes: usize,
        memory_limit: u64,
        priorities: &LanePriorities,
        tenant_launch_limit: Option<Duration>,
    ) -> Result<Self, String> {
        let device = driver::device::get(ordinal).map_err(|e| format!("cuDeviceGet: {e:?}"))?;
        let device_name = driver::device::get_name(device).map_err(|e| format!("cuDeviceGetName: {e:?}"))?;
        // SAFETY: a valid device.
        let total = unsafe { driver::device::total_mem(device) }.map_err(|e| format!("cuDeviceTotalMem: {e:?}"))?;
        let mut memory_bytes = total as u64;
        if memory_limit > 0 {
            memory_bytes = memory_bytes.min(memory_limit);
        }
        use CUdevice_attribute as A;
        let major = attribute(device, A::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR);
        let minor = attribute(device, A::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR);
        let multiprocessors = attribute(device, A::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT);
        let threads_per_multiprocessor = attribute(device, A::CU_DEVICE_ATTRIBUTE_MAX_THREADS_PER_MULTIPROCESSOR);
        let max_block = attribute(device, A::CU_DEVICE_ATTRIBUTE_MAX_THREADS_PER_BLOCK).max(1) as u64;
        let max_block_dims = [
            attribute(device, A::CU_DEVICE_ATTRIBUTE_MAX_BLOCK_DIM_X).max(1) as u64,
            attribute(device, A::CU_DEVICE_ATTRIBUTE_MAX_BLOCK_DIM_Y).max(1) as u64,
            attribute(device, A::CU_DEVICE_ATTRIBUTE_MAX_BLOCK_DIM_Z).max(1) as u64,
        ];
        // The primary context: one per GPU in the process, shared by all tenants' streams.
        // SAFETY: a valid device; released in Drop.
        let context =
            unsafe { driver::primary_ctx::retain(device) }.map_err(|e| format!("cuDevicePrimaryCtxRetain: {e:?}"))?;
        // SAFETY: the context just retained.
        unsafe { driver::ctx::set_current(context) }.map_err(|e| format!("cuCtxSetCurrent: {e:?}"))?;
        let new_stream = || {
            driver::stream::create(driver::stream::StreamKind::NonBlocking)
                .map_err(|e| format!("cuStreamCreate: {e:?}"))
        };
        let reader = new_stream()?;
        // SAFETY: a one-byte allocation in the current context, zeroed synchronously.
        let zero_flag = unsafe {
            let ptr = driver::malloc_sync(1).map_err(|e| format!("cuMemAlloc: {e:?}"))?;
            driver::memset_d8_sync(ptr, 0, 1).map_err(|e| format!("cuMemsetD8: {e:?}"))?;
            ptr
        };
        // Tenant partitions need the driver's virtual memory management (every GPU since Pascal).
        let partitions = match attribute(device, A::CU_DEVICE_ATTRIBUTE_VIRTUAL_ADDRESS_MANAGEMENT_SUPPORTED) {
            0 => Err("the GPU has no virtual memory management".to_string()),
            _ => Partitions::new(device, memory_bytes),
        }
        .inspect_err(|e| {
            tracing::warn!(device = %device_name, "no tenant partitions ({e}): tenants' own kernels will not run on this GPU")
        })
        .ok();
        let limits = LaunchLimits {
            max_items: 1 << 40,
            max_extent: [MAX_GRID_X * max_block_dims[0], u64::MAX, u64::MAX],
            max_items_per_enqueue: MAX_ITEMS_PER_ENQUEUE,
            max_groups_per_enqueue: MAX_GRID_X,
            max_group: max_block_dims,
            max_group_items: max_block,
            max_buffer_bytes: memory_bytes,
        };
        let name = format!("cuda{index}");
        let shared = Arc::new(Shared {
            name: name.clone(),
            context,
            arch: (major * 10 + minor) as u32,
            resident_threads: (multiprocessors.max(1) * threads_per_multiprocessor.max(1)) as u64,
            reader: Mutex::new(reader),
            programs: Programs::default(),
            memory_used: AtomicU64::new(0),
            memory_bytes,
            pinned_bytes: AtomicU64::new(0),
            zero_flag,
            failed: AtomicBool::new(false),
            tenant_launch_limit,
            deferred_frees: Mutex::new(Vec::new()),
            partitions,
            scratch: Mutex::new(None),
        });
        let lanes = lanes.max(1);
        // Jobs finish from polled events on a completion thread, unless the operator asks for the
        // driver's stream callbacks (see `completion`).
        let callbacks = std::env::var("AGORA_CUDA_COMPLETIONS").is_ok_and(|v| v == "callbacks");
        let completer = if callbacks {
            None
        } else {
            let completions = Arc::new(Completions::new(lanes));
            let (c, s) = (completions.clone(), shared.clone());
            let thread = std::thread::Builder::new()
                .name(format!("agora-{name}-done"))
                .spawn(move || c.run(s))
                .map_err(|e| format!("starting the completion thread: {e}"))?;
            Some((completions, thread))
        };
        let mut lane_list = Vec::new();
        let mut threads = Vec::new();
        // By default no launch here is revocable (`polls_revocation()` false: latency work gets
        // in at slice boundaries), and a kernel's flag is a copy made just before it.
        // `AGORA_CUDA_REVOCATION=mapped` makes running kernels revocable, through a mapped flag
        // the completion thread mirrors; not the default: on an H100, nw through Agora took 4.9 s
        // with it against 1.2 s with the copy (the same run and results, `scripts/gpu-diagnose.sh`).
        let mirrored = completer.is_some() && std::env::var("AGORA_CUDA_REVOCATION").is_ok_and(|v| v == "mapped");
        let mut polls = mirrored;
        // Each lane has a batch stream at the lowest priority and an urgent one at the highest
        // (see `CudaExecutor::streams`); on a GPU without priorities both are 0.
        let (mut lowest, mut highest) = (0, 0);
        // `AGORA_CUDA_STREAM_PRIORITIES=off`: both at the default priority, for comparison.
        let wanted = !std::env::var("AGORA_CUDA_STREAM_PRIORITIES").is_ok_and(|v| v == "off");
        // SAFETY: two out-pointers; the context is current.
        if !wanted || unsafe { sys::cuCtxGetStreamPriorityRange(&mut lowest, &mut highest) } != CUresult::CUDA_SUCCESS {
            (lowest, highest) = (0, 0);
        }
        let prioritized = |priority: i32| -> Result<CUstream, String> {
            let mut stream = std::ptr::null_mut();
            let flags = sys::CUstream_flags::CU_STREAM_NON_BLOCKING as u32;
            // SAFETY: an out-pointer; the context is current; destroyed when the lane stops.
            match unsafe { sys::cuStreamCreateWithPriority(&mut stream, flags, priority) } {
                CUresult::CUDA_SUCCESS => Ok(stream),
                code => Err(format!("cuStreamCreateWithPriority: {code:?}")),
            }
        };
        tracing::debug!(device = %name, lowest, highest, "stream priorities: batch at the lowest, urgent at the highest");
        for l in 0..lanes {
            let mapped_flag = if mirrored { mapped_flag() } else { None };
            polls &= mapped_flag.is_some();
            let stream = prioritized(lowest)?;
            let urgent_stream = prioritized(highest)?;
            let mut switch = std::ptr::null_mut();
            // SAFETY: an out-pointer; the context is current; destroyed when the lane stops.
            match unsafe { sys::cuEventCreate(&mut switch, sys::CUevent_flags::CU_EVENT_DISABLE_TIMING as u32) } {
                CUresult::CUDA_SUCCESS => {}
                code => return Err(format!("cuEventCreate: {code:?}")),
            }
            // SAFETY: a one-byte allocation in the current context.
            let lane_flag = unsafe { driver::malloc_sync(1) }.map_err(|e| format!("cuMemAlloc: {e:?}"))?;
            let executor = CudaExecutor {
                shared: shared.clone(),
                stream,
                streams: [stream, urgent_stream],
                switch,
                lane_flag,
                functions: HashMap::new(),
                bound: false,
                lane: l,
                completions: completer.as_ref().map(|(c, _)| c.clone()),
                mapped_flag,
                mirror: None,
                stop_word: None,
                launches: 0,
                watchdog: None,
            };
            let (lane, thread) = Lane::start(
                format!("agora-{name}-lane{l}"),
                Box::new(executor),
                LaneClass::new(priorities),
            )
            .map_err(|e| e.to_string())?;
            lane_list.push(lane);
            threads.push(thread);
        }
        Ok(CudaDevice {
            info: DeviceInfo {
                name,
                kind: DeviceKind::Cuda,
                description: format!(
                    "{device_name} (sm_{major}{minor}, {multiprocessors} multiprocessors, {} GiB)",
                    total >> 30
                ),
                lanes: lane_list.len(),
                threads_per_lane: 1,
                memory_bytes,
                shares_host_memory: false,
                limits,
                host_cores_per_lane: 0,
            },
            shared,
            lanes: Lanes::new(lane_list, threads),
            ordinal: device,
            completer,
            polls,
            utilization: Utilization::new(pci_bus_id(device)),
        })
    }

    /// Compute capability as `major * 10 + minor`.
    pub fn arch(&self) -> u32 {
        self.shared.arch
    }

    /// Whether tenants' own programs run here (fenced into partitions, which need the GPU's
    /// virtual memory management).
    pub fn runs_tenant_programs(&self) -> bool {
        self.shared.partitions.is_some()
    }
}

/// Finds every NVIDIA GPU. Returns the devices that work and one message per problem (to be
/// reported once by the caller): no driver, no device, a device that failed to start.
/// `tenant_launch_limit`: how long a tenant's fenced kernel may run before it is stopped and its
/// task fails with `KernelTimeout` (`None`: no limit).
pub fn discover(
    lanes_per_device: usize,
    memory_limit: u64,
    priorities: &LanePriorities,
    tenant_launch_limit: Option<Duration>,
) -> (Vec<CudaDevice>, Vec<String>) {
    discover_ordinals(None, lanes_per_device, memory_limit, priorities, tenant_launch_limit)
}

/// Like [`discover`], for the GPU of driver ordinal `ordinal` only (a device-host process serves
/// one GPU, so a fault that ends its context ends no other GPU's work).
pub fn discover_one(
    ordinal: usize,
    lanes_per_device: usize,
    memory_limit: u64,
    priorities: &LanePriorities,
    tenant_launch_limit: Option<Duration>,
) -> (Vec<CudaDevice>, Vec<String>) {
    discover_ordinals(
        Some(ordinal),
        lanes_per_device,
        memory_limit,
        priorities,
        tenant_launch_limit,
    )
}

/// How many GPUs the driver sees, without creating a context on any (for the daemon, which
/// starts one device host per GPU), or why none can be used.
pub fn gpu_count() -> Result<usize, String> {
    // SAFETY: only tries to open the library.
    if !unsafe { sys::is_culib_present() } {
        return Err("no CUDA driver (libcuda.so.1 not found): no GPU devices".into());
    }
    driver::init().map_err(|e| format!("the CUDA driver did not initialise ({e:?}): no GPU devices"))?;
    let count = driver::device::get_count().map_err(|e| format!("cannot count CUDA devices: {e:?}"))?;
    if count == 0 {
        return Err("the CUDA driver sees no GPU".into());
    }
    Ok(count as usize)
}

fn discover_ordinals(
    only: Option<usize>,
    lanes_per_device: usize,
    memory_limit: u64,
    priorities: &LanePriorities,
    tenant_launch_limit: Option<Duration>,
) -> (Vec<CudaDevice>, Vec<String>) {
    let mut devices = Vec::new();
    let mut problems = Vec::new();
    let count = match gpu_count() {
        Ok(count) => count,
        Err(problem) => {
            problems.push(problem);
            return (devices, problems);
        }
    };
    if only.is_some_and(|ordinal| ordinal >= count) {
        problems.push(format!(
            "the CUDA driver sees {count} GPU(s), no GPU {}",
            only.unwrap_or(0)
        ));
    }
    for ordinal in (0..count).filter(|o| only.is_none_or(|only| only == *o)) {
        match CudaDevice::new(
            devices.len(),
            ordinal as i32,
            lanes_per_device,
            memory_limit,
            priorities,
            tenant_launch_limit,
        ) {
            Ok(d) => devices.push(d),
            Err(e) => problems.push(format!("CUDA device {ordinal} failed to start: {e}")),
        }
    }
    if !programs::nvrtc_available() && !devices.is_empty() {
        problems.push("NVRTC (libnvrtc.so) not found: GPUs run only kernels whose PTX is in the cache".into());
    }
    (devices, problems)
}

/// The grid and block of a launch over `extent` threads per dimension (dimension 0: the slice's
/// rows): blocks of [`block_shape`], a plain kernel's halved in each dimension until they divide
/// its extent (it has no guard that stops rounded-up threads).
pub fn launch_shape(
    extent: [u64; 3],
    dims: usize,
    local: Option<[usize; 3]>,
    convention: super::programs::Convention,
) -> ([u64; 3], [u64; 3]) {
    let mut block = block_shape(dims, local);
    if convention == super::programs::Convention::Plain {
        for d in 0..3 {
            while block[d] > 1 && !extent[d].is_multiple_of(block[d]) {
                block[d] /= 2;
            }
        }
    }
    ([0, 1, 2].map(|d| extent[d].div_ceil(block[d])), block)
}

/// Whether `program` is a tenant's own program, which a GPU must not run unfenced.
pub use agora_kernels::is_tenant_program;

/// The block shape of a launch in `dims` dimensions (for guarded kernels; a plain kernel's is
/// halved until it divides the range): the kernel's required one, else 256 threads
/// (1-D), 16×16 or 8×8×4.
pub fn block_shape(dims: usize, local: Option<[usize; 3]>) -> [u64; 3] {
    if let Some(local) = local {
        return local.map(|l| l.max(1) as u64);
    }
    match dims {
        0 | 1 => [256, 1, 1],
        2 => [16, 16, 1],
        _ => [8, 8, 4],
    }
}

/// [`Device::check_launch`] for a GPU whose launch limits are `limits`: blocks of
/// [`block_shape`], grid limits per dimension. A free function so that a GPU served by a
/// device-host process is checked by the daemon exactly as one in the daemon.
pub fn check_launch(
    limits: &LaunchLimits,
    kernel: &KernelDef,
    range: &[u64],
    buffer_lens: &[u64],
) -> Result<u64, TaskError> {
    let local = super::programs::KernelCode::of(kernel).and_then(|code| code.local());
    let block = block_shape(range.len(), local);
    let mut limits = *limits;
    // Grid limits per dimension, in threads for this block shape.
    limits.max_extent[1] = MAX_GRID_YZ * block[1];
    limits.max_extent[2] = MAX_GRID_YZ * block[2];
    limits.check(range, block, buffer_lens, slices(kernel))
}

/// [`Device::slices`] on a GPU: a plain kernel (a tenant's, or a package's without the
/// revocation flag and row offset) has no way to start at a row on CUDA, which has no global
/// work offset: it runs whole.
pub fn slices(kernel: &KernelDef) -> bool {
    kernel.chunkable
        && super::programs::KernelCode::of(kernel)
            .is_some_and(|code| code.convention() == super::programs::Convention::Guarded)
}

/// [`Device::row_alignment`] on a GPU: a block's extent in dimension 0.
pub fn row_alignment(kernel: &KernelDef, dims: usize) -> u64 {
    block_shape(
        dims,
        super::programs::KernelCode::of(kernel).and_then(|code| code.local()),
    )[0]
}

impl Device for CudaDevice {
    fn info(&self) -> &DeviceInfo {
        &self.info
    }

    fn implements(&self, kernel: &KernelDef) -> bool {
        match super::programs::KernelCode::of(kernel) {
            // A tenant's own program (`tenant/…`) is untrusted code: it runs here fenced into
            // its tenant's partition, so only on a GPU that has partitions (see `programs`).
            Some(code) => {
                (!is_tenant_program(code.program()) || self.shared.partitions.is_some())
                    && !self.shared.programs.is_broken(code.program())
            }
            None => false,
        }
    }

    fn submit(&self, lane: usize, job: Job) {
        self.lanes.submit(lane, job);
    }

    fn prepare(&self, kernel: &KernelDef) -> Option<Result<(), String>> {
        if !self.implements(kernel) {
            return None;
        }
        let code = super::programs::KernelCode::of(kernel)?;
        let prepared = self
            .shared
            .bind()
            .map_err(|e| format!("the GPU's context: {e}"))
            .and_then(|()| {
                self.shared
                    .programs
                    .function(&self.shared.name, self.shared.arch, code, kernel.params.len())
                    .map(|_| ())
            });
        if prepared.is_err() && is_tenant_program(code.program()) {
            // The build that asked is refused, so the program is never installed.
            self.shared.programs.forget_broken(code.program());
        }
        Some(prepared)
    }

    fn lane_load(&self, lane: usize) -> usize {
        self.lanes.load(lane)
    }

    fn memory_used(&self) -> u64 {
        self.shared.memory_used.load(Ordering::Relaxed)
    }

    fn runs_row_slices(&self) -> bool {
        true
    }

    fn check_launch(&self, kernel: &KernelDef, range: &[u64], buffer_lens: &[u64]) -> Result<u64, TaskError> {
        check_launch(&self.info.limits, kernel, range, buffer_lens)
    }

    fn slices(&self, kernel: &KernelDef) -> bool {
        slices(kernel)
    }

    fn min_items_per_slice(&self) -> u64 {
        // A slice that does not fill the GPU once costs a launch and a completion for a fraction
        // of it (cutting lavaMD's one launch by a CPU-based estimate made it 100x slower).
        self.shared.resident_threads
    }

    fn row_alignment(&self, kernel: &KernelDef, dims: usize) -> u64 {
        row_alignment(kernel, dims)
    }

    fn polls_revocation(&self) -> bool {
        self.polls
    }

    fn run_inline(&self, _work: &Work) -> Result<(), TaskError> {
        // Never called: this device does not share host memory.
        Err(TaskError::KernelFault)
    }

    fn alloc(&self, tenant: u64, len: u64) -> Option<Result<Arc<dyn DeviceBuffer>, TaskError>> {
        let shared = &self.shared;
        if shared.failed.load(Ordering::Acquire) {
            return Some(Err(TaskError::DeviceLost));
        }
        shared.free_deferred();
        let used = shared.memory_used.fetch_add(len, Ordering::Relaxed) + len;
        if used > shared.memory_bytes {
            shared.memory_used.fetch_sub(len, Ordering::Relaxed);
            return Some(Err(TaskError::DeviceOutOfMemory { index: 0, needed: len }));
        }
        let placed = shared.bind().and_then(|()| match &shared.partitions {
            // In the tenant's partition where the GPU has them, else a plain allocation.
            Some(partitions) => match partitions.of(tenant) {
                Ok(partition) => {
                    let asked = std::time::Instant::now();
                    partitions
                    .alloc(&partition, len)
                    .map_err(|e| {
                        tracing::warn!(device = %shared.name, tenant, len, error = %e, "no room in the tenant's partition");
                        TaskError::DeviceOutOfMemory { index: 0, needed: len }
                    })
                    .and_then(|(ptr, grown)| {
                        if let Some((at, bytes)) = grown {
                            // Newly mapped memory may hold another tenant's bytes, and a fenced
                            // kernel may read anywhere in the mapped prefix: zeroed now, before
                            // the allocation returns (growth doubles the prefix, so this costs at
                            // most twice the tenant's peak, not once per buffer).
                            // SAFETY: `bytes` bytes just mapped at `at`, no command uses them.
                            unsafe {
                                let stream = *shared.reader.lock().unwrap_or_else(|e| e.into_inner());
                                driver::memset_d8_async(at, 0, bytes as usize, stream)
                                    .and_then(|()| driver::stream::synchronize(stream))
                            }
                            .map_err(|e| shared.error(e.0))?;
                            tracing::debug!(device = %shared.name, tenant, len, grown_by = bytes, mapped = partition.mapped_bytes(), micros = asked.elapsed().as_micros() as u64, "partition grown (mapped and zeroed)");
                        }
                        Ok((ptr, Some(partition)))
                    })
                }
                Err(e) => {
                    // No address range left to reserve: a plain allocation, with which the
                    // tenant's fenced launches are refused (`fence_for`).
                    tracing::warn!(device = %shared.name, tenant, error = %e, "no partition for the tenant; a plain allocation instead");
                    // SAFETY: an allocation in the current context, freed with the buffer.
                    unsafe { driver::malloc_sync(len.max(1) as usize) }
                        .map(|ptr| (ptr, None))
                        .map_err(|e| shared.error(e.0))
                }
            },
            // SAFETY: an allocation in the current context, freed with the buffer.
            None => unsafe { driver::malloc_sync(len.max(1) as usize) }
                .map(|ptr| (ptr, None))
                .map_err(|e| shared.error(e.0)),
        });
        // Not zeroed here: the first command that reads it does, on its own stream (see
        // `buffer`); most buffers start with a copy that writes every byte.
        let allocated = placed
            .inspect_err(|_| {
                shared.memory_used.fetch_sub(len, Ordering::Relaxed);
            })
            .map(|(ptr, partition)| CudaBuffer {
                ptr,
                len,
                shared: shared.clone(),
                partition,
                unwritten: AtomicBool::new(true),
            });
        Some(match allocated {
            Ok(buffer) => Ok(Arc::new(buffer) as Arc<dyn DeviceBuffer>),
            Err(e) => {
                tracing::warn!(device = %self.info.name, len, error = %e, "device allocation failed");
                Err(match e {
                    TaskError::DeviceFailed(_) => TaskError::DeviceOutOfMemory { index: 0, needed: len },
                    other => other,
                })
            }
        })
    }

    unsafe fn read(&self, from: &dyn DeviceBuffer, host: *mut u8, len: usize) -> Result<(), TaskError> {
        let from = as_cuda(from)?;
        if len as u64 > from.len {
            return Err(TaskError::KernelFault);
        }
        if self.shared.failed.load(Ordering::Acquire) {
            return Err(TaskError::DeviceLost);
        }
        self.shared.bind()?;
        let stream = *self.shared.reader.lock().unwrap_or_else(|e| e.into_inner());
        // SAFETY: `host` is valid for `len` bytes (caller's contract); the buffer holds at least
        // `len` bytes (checked); the copy is complete when the stream synchronisation returns.
        unsafe {
            from.zero_if_unwritten(stream)
                .result()
                .and_then(|()| sys::cuMemcpyDtoHAsync_v2(host as *mut c_void, from.ptr, len, stream).result())
                .and_then(|()| driver::stream::synchronize(stream))
        }
        .map_err(|e| self.shared.error(e.0))
    }

    fn wants_pinned_host_memory(&self) -> bool {
        true
    }

    fn tenant_ended(&self, tenant: u64) {
        if let Some(partitions) = &self.shared.partitions {
            // Unmapping needs the context; without it (the device failed) the memory goes with it.
            if self.shared.bind().is_ok() {
                self.shared.free_deferred();
                partitions.end(tenant);
            }
        }
    }

    fn register_host_memory(
        &self,
        base: *mut u8,
        len: usize,
        _fd: std::os::fd::BorrowedFd<'_>,
        page_lock: bool,
    ) -> Option<Result<Box<dyn std::any::Any + Send + Sync>, String>> {
        if !page_lock {
            // The daemon's own memory, seen as it is: nothing to map.
            return None;
        }
        let shared = &self.shared;
        if let Err(e) = shared.bind() {
            return Some(Err(format!("cannot use {}: {e}", shared.name)));
        }
        // SAFETY: `base..base+len` is mapped host memory (a session's segment) that the caller
        // keeps mapped until the returned guard is dropped.
        let registered =
            unsafe { sys::cuMemHostRegister_v2(base as *mut c_void, len, sys::CU_MEMHOSTREGISTER_PORTABLE).result() };
        Some(match registered {
            Ok(()) => {
                shared.pinned_bytes.fetch_add(len as u64, Ordering::Relaxed);
                Ok(Box::new(PinnedHost {
                    base: base as usize,
                    len,
                    shared: shared.clone(),
                }))
            }
            Err(e) => Err(format!(
                "registering {len} bytes of host memory with {} failed ({e:?}); copies go through the driver's staging buffer",
                shared.name
            )),
        })
    }

    fn healthy(&self) -> bool {
        !self.shared.failed.load(Ordering::Acquire)
    }

    fn status(&self) -> DeviceReport {
        DeviceReport {
            name: self.info.name.clone(),
            kind: self.info.kind,
            description: self.info.description.clone(),
            memory_bytes: self.info.memory_bytes,
            memory_used: self.shared.memory_used.load(Ordering::Relaxed),
            memory_cached: self.shared.partitions.as_ref().map_or(0, |p| p.cached_bytes()),
            utilization_percent: self.utilization.percent(),
            threads_per_lane: 1,
            lanes: self.lanes.statuses(),
            failed: self.shared.failed.load(Ordering::Acquire),
            staged_bytes: 0,
        }
    }

    fn shutdown(&self) {
        self.lanes.shutdown();
    }
}

impl Drop for CudaDevice {
    fn drop(&mut self) {
        self.shutdown();
        if let Some((completions, thread)) = self.completer.take() {
            completions.stop();
            let _ = thread.join();
            if self.shared.bind().is_ok() {
                completions.destroy_events();
            }
        }
        if self.shared.bind().is_ok() {
            self.shared.free_deferred();
            self.shared.scratch.lock().unwrap_or_else(|e| e.into_inner()).take();
            if let Some(partitions) = &self.shared.partitions {
                partitions.end_all();
            }
            self.shared.programs.unload_all();
            // SAFETY: the lanes have stopped; these handles are not used any more.
            unsafe {
                let _ = driver::free_sync(self.shared.zero_flag);
                let _ = driver::stream::destroy(*self.shared.reader.lock().unwrap_or_else(|e| e.into_inner()));
                let _ = driver::primary_ctx::release(self.ordinal);
            }
        }
    }
}
