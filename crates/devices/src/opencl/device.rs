//! An OpenCL device: discovery, the state its lanes and buffers share, and the
//! [`Device`] implementation (allocation, synchronous reads for other devices, status).
//!
//! Owns the device's context, its reader queue and its lanes. It must not enqueue a job's
//! commands (the lanes' executors do) nor finish jobs (the completion callbacks do).

use std::collections::HashMap;
use std::ffi::c_void;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use agora_kernels::KernelDef;
use agora_protocol::TaskError;
use opencl3::command_queue::CommandQueue;
use opencl3::context::Context;
use opencl3::device::{Device as ClDeviceInfo, CL_DEVICE_TYPE_ALL, CL_DEVICE_TYPE_CPU};
use opencl3::memory::{Buffer, ClMem, CL_MEM_COPY_HOST_PTR, CL_MEM_READ_ONLY, CL_MEM_READ_WRITE};
use opencl3::types::{cl_device_id, CL_BLOCKING};

use super::buffer::{as_cl, ClBuffer};
use super::cl_error;
use super::executor::ClExecutor;
use super::limits::{self, Reported};
use super::programs::Programs;
use crate::lane::{Lane, Lanes};
use crate::priority::{LaneClass, LanePriorities};
use crate::{Device, DeviceBuffer, DeviceInfo, DeviceKind, DeviceReport, Job, LaunchLimits, Work};

/// State shared by a device's lanes and its buffers.
pub(super) struct Shared {
    pub(super) name: String,
    pub(super) context: Context,
    /// Queue for synchronous reads requested by other devices' lanes.
    pub(super) reader: Mutex<CommandQueue>,
    /// Programs built for the device (and those that failed to build).
    pub(super) programs: Programs,
    pub(super) memory_used: AtomicU64,
    pub(super) memory_bytes: u64,
    /// The revocation flag of launches that cannot be revoked: one always-zero byte, shared by
    /// every lane (kernels only read it), so such launches pay no allocation.
    pub(super) zero_flag: Buffer<u8>,
    /// Whether a running kernel sees a store to a host flag wrapped in a `CL_MEM_USE_HOST_PTR`
    /// buffer (the device computes on host memory); otherwise the flag is copied in before the
    /// kernel starts. Atomic only so tests can force the fallback.
    pub(super) host_flags: AtomicBool,
    /// What one launch may ask of the device (checked by the daemon; re-checked per command
    /// here, since a command beyond them can abort the whole process).
    pub(super) limits: LaunchLimits,
}

// SAFETY: Context and CommandQueue are Send + Sync in opencl3; Program is Send + Sync; the
// program maps are behind mutexes. (Declared so `Arc<Shared>` can move into lane threads.)
unsafe impl Send for Shared {}
// SAFETY: as above.
unsafe impl Sync for Shared {}

/// An OpenCL device.
pub struct OpenClDevice {
    info: DeviceInfo,
    pub(super) shared: Arc<Shared>,
    lanes: Lanes,
}

impl std::fmt::Debug for OpenClDevice {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("OpenClDevice")
            .field("info", &self.info)
            .finish_non_exhaustive()
    }
}

impl OpenClDevice {
    fn new(
        index: usize,
        id: cl_device_id,
        platform: &str,
        lanes: usize,
        memory_limit: u64,
        priorities: &LanePriorities,
    ) -> Result<Self, String> {
        let cl = ClDeviceInfo::new(id);
        let device_name = cl.name().map_err(|e| e.to_string())?;
        let mut memory_bytes = cl.global_mem_size().map_err(|e| e.to_string())?;
        if memory_limit > 0 {
            // The operator keeps part of the device for others (or tests eviction).
            memory_bytes = memory_bytes.min(memory_limit);
        }
        let compute_units = cl.max_compute_units().unwrap_or(1);
        let reported = Reported::query(&cl);
        let limits = reported.limits();
        tracing::debug!(device = %device_name, ?reported, ?limits, "OpenCL launch limits");
        let context = Context::from_device(&cl).map_err(|e| format!("creating a context: {e}"))?;
        #[allow(deprecated)] // clCreateCommandQueue: the OpenCL 1.2 call every platform has.
        let new_queue =
            || CommandQueue::create_default(&context, 0).map_err(|e| format!("creating a command queue: {e}"));
        let reader = new_queue()?;
        let mut queues = Vec::new();
        for _ in 0..lanes.max(1) {
            queues.push(new_queue()?);
        }
        let name = format!("opencl{index}");
        let zero = [0u8; 1];
        // SAFETY: copies one byte from `zero`, alive during the call.
        let zero_flag = unsafe {
            Buffer::<u8>::create(
                &context,
                CL_MEM_READ_ONLY | CL_MEM_COPY_HOST_PTR,
                1,
                zero.as_ptr() as *mut c_void,
            )
        }
        .map_err(|e| format!("creating the zero flag: {e}"))?;
        // A CPU device computes on host memory: kernels read a USE_HOST_PTR buffer in place.
        let host_flags = cl.dev_type().is_ok_and(|t| t & CL_DEVICE_TYPE_CPU != 0);
        let shared = Arc::new(Shared {
            name: name.clone(),
            context,
            reader: Mutex::new(reader),
            programs: Programs::default(),
            memory_used: AtomicU64::new(0),
            memory_bytes,
            zero_flag,
            host_flags: AtomicBool::new(host_flags),
            limits,
        });
        let mut lane_list = Vec::new();
        let mut threads = Vec::new();
        for (l, queue) in queues.into_iter().enumerate() {
            // SAFETY: a plain one-byte device allocation with no host pointer.
            let lane_flag =
                unsafe { Buffer::<u8>::create(&shared.context, CL_MEM_READ_WRITE, 1, std::ptr::null_mut()) }
                    .map_err(|e| format!("creating a lane's revocation flag: {e}"))?;
            let executor = ClExecutor {
                shared: shared.clone(),
                queue,
                lane_flag,
                kernels: HashMap::new(),
                built: false,
                lane_finished: Arc::default(),
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
        let queues_started = lane_list.len();
        Ok(OpenClDevice {
            info: DeviceInfo {
                name,
                kind: DeviceKind::OpenCl,
                description: format!("{platform} / {device_name} ({compute_units} compute units)"),
                memory_bytes,
                lanes: queues_started,
                threads_per_lane: 1,
                shares_host_memory: false,
                limits,
                // PoCL's pthread device runs a kernel's work-groups on every core.
                host_cores_per_lane: if host_flags { compute_units as usize } else { 0 },
            },
            shared,
            lanes: Lanes::new(lane_list, threads),
        })
    }
}

/// The OpenCL platforms installed (loading the ICD loader), or why there are none: opencl3
/// panics when no loader is installed, which is caught here.
pub(super) fn installed_platforms() -> Result<Vec<opencl3::platform::Platform>, String> {
    match std::panic::catch_unwind(opencl3::platform::get_platforms) {
        Ok(Ok(platforms)) => Ok(platforms),
        Ok(Err(e)) => Err(format!(
            "no OpenCL platform: {e} (install an ICD, e.g. pocl-opencl-icd)"
        )),
        Err(_) => Err("OpenCL is not available (no ICD loader libOpenCL.so.1 found)".into()),
    }
}

/// The names of the OpenCL platforms installed (loading the ICD loader): what a daemon that
/// serves each platform from a device-host process of its own starts one host for.
pub fn platform_names() -> Result<Vec<String>, String> {
    static DISCOVERY: Mutex<()> = Mutex::new(());
    let _one_at_a_time = DISCOVERY.lock().unwrap_or_else(|e| e.into_inner());
    Ok(installed_platforms()?
        .iter()
        .map(|p| p.name().unwrap_or_else(|_| "unknown platform".into()))
        .collect())
}

/// Finds every OpenCL device. Returns the devices that work and one message per platform or
/// device that does not (to be reported once by the caller).
pub fn discover(lanes_per_device: usize, memory_limit: u64) -> (Vec<OpenClDevice>, Vec<String>) {
    discover_with(lanes_per_device, memory_limit, &LanePriorities::normal())
}

/// [`discover`], with lane threads that enqueue batch jobs at the OS priority `priorities` say
/// (the device runtime's own threads, such as PoCL's workers, keep theirs).
pub fn discover_with(
    lanes_per_device: usize,
    memory_limit: u64,
    priorities: &LanePriorities,
) -> (Vec<OpenClDevice>, Vec<String>) {
    discover_except(lanes_per_device, memory_limit, priorities, &|_| false)
}

/// [`discover_with`], leaving out the platforms `skip` names (by platform name): the daemon
/// leaves out NVIDIA's OpenCL platform when its CUDA backend serves the same GPUs, so a GPU has
/// one context in the daemon, not two (and no tenant OpenCL program reaches it unfenced).
pub fn discover_except(
    lanes_per_device: usize,
    memory_limit: u64,
    priorities: &LanePriorities,
    skip: &dyn Fn(&str) -> bool,
) -> (Vec<OpenClDevice>, Vec<String>) {
    // Loading the ICD and enumerating platforms from two threads at once (two daemons in one
    // process, as in tests) made one of them see no platform: discover one at a time.
    static DISCOVERY: Mutex<()> = Mutex::new(());
    let _one_at_a_time = DISCOVERY.lock().unwrap_or_else(|e| e.into_inner());
    let mut devices = Vec::new();
    let mut problems = Vec::new();
    let platforms = match installed_platforms() {
        Ok(platforms) => platforms,
        Err(why) => {
            problems.push(why);
            return (devices, problems);
        }
    };
    for platform in platforms {
        let platform_name = platform.name().unwrap_or_else(|_| "unknown platform".into());
        if skip(&platform_name) {
            problems.push(format!(
                "OpenCL platform {platform_name} left out: its GPUs are served by the CUDA backend"
            ));
            continue;
        }
        let ids = match platform.get_devices(CL_DEVICE_TYPE_ALL) {
            Ok(ids) => ids,
            Err(e) => {
                problems.push(format!("OpenCL platform {platform_name}: cannot list devices: {e}"));
                continue;
            }
        };
        for id in ids {
            match OpenClDevice::new(
                devices.len(),
                id,
                &platform_name,
                lanes_per_device,
                memory_limit,
                priorities,
            ) {
                Ok(d) => devices.push(d),
                Err(e) => problems.push(format!(
                    "OpenCL platform {platform_name}: a device failed to start: {e}"
                )),
            }
        }
    }
    (devices, problems)
}

impl Device for OpenClDevice {
    fn info(&self) -> &DeviceInfo {
        &self.info
    }

    fn implements(&self, kernel: &KernelDef) -> bool {
        match &kernel.opencl {
            // A tenant program the operator did not allow in the daemon reaches only GPUs,
            // where it is fenced; never an OpenCL device, where a stray access or a PoCL crash
            // would reach the daemon.
            Some(imp) => {
                !agora_kernels::runs_only_fenced(&imp.program) && !self.shared.programs.is_broken(&imp.program)
            }
            None => false,
        }
    }

    fn submit(&self, lane: usize, job: Job) {
        self.lanes.submit(lane, job);
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
        // Guarded kernels (all of the library's) run in these work-groups; see `work_group`.
        let local = kernel.opencl.as_ref().map_or([1; 3], |imp| {
            limits::fixed_work_group(range.len().clamp(1, 3), imp.local)
        });
        let group = local.map(|l| l as u64);
        self.info.limits.check(range, group, buffer_lens, kernel.chunkable)
    }

    fn row_alignment(&self, kernel: &KernelDef, dims: usize) -> u64 {
        // Slices whose boundaries are whole work-groups of dimension 0 waste no work items (a
        // slice's guard stops the rounded-up ones, so any boundary is correct).
        kernel.opencl.as_ref().map_or(1, |imp| {
            limits::fixed_work_group(dims.clamp(1, 3), imp.local)[0].max(1) as u64
        })
    }

    fn polls_revocation(&self) -> bool {
        self.shared.host_flags.load(Ordering::Relaxed)
    }

    fn run_inline(&self, _work: &Work) -> Result<(), TaskError> {
        // Never called: this device does not share host memory.
        Err(TaskError::KernelFault)
    }

    fn alloc(&self, _tenant: u64, len: u64) -> Option<Result<Arc<dyn DeviceBuffer>, TaskError>> {
        let used = self.shared.memory_used.fetch_add(len, Ordering::Relaxed) + len;
        if used > self.shared.memory_bytes {
            self.shared.memory_used.fetch_sub(len, Ordering::Relaxed);
            return Some(Err(TaskError::DeviceOutOfMemory { index: 0, needed: len }));
        }
        // SAFETY: a plain device allocation with no host pointer.
        let created = unsafe {
            Buffer::<u8>::create(
                &self.shared.context,
                CL_MEM_READ_WRITE,
                len.max(1) as usize,
                std::ptr::null_mut(),
            )
        };
        Some(match created {
            // Zeroed by the first queue that uses it, before anything reads it (see `buffer`).
            Ok(buffer) => Ok(Arc::new(ClBuffer::new(buffer, len, self.shared.clone())) as Arc<dyn DeviceBuffer>),
            Err(e) => {
                self.shared.memory_used.fetch_sub(len, Ordering::Relaxed);
                tracing::warn!(device = %self.info.name, len, error = %e, "device allocation failed");
                Err(TaskError::DeviceOutOfMemory { index: 0, needed: len })
            }
        })
    }

    unsafe fn read(&self, from: &dyn DeviceBuffer, host: *mut u8, len: usize) -> Result<(), TaskError> {
        let from = as_cl(from)?;
        if len as u64 > from.len {
            return Err(TaskError::KernelFault);
        }
        let queue = self.shared.reader.lock().unwrap_or_else(|e| e.into_inner());
        // Never the bytes of whoever had this memory before: zeroed first, or after a zeroing
        // another queue enqueued.
        let mut waits = Vec::new();
        from.zeroed_before(queue.get(), &mut waits)?;
        // SAFETY: `host` is valid for `len` bytes (caller's contract), the buffer holds at least
        // `len` bytes (checked); the read is blocking; `waits` are live events (held by `from`).
        let event = unsafe {
            opencl3::command_queue::enqueue_read_buffer(
                queue.get(),
                from.buffer.get(),
                CL_BLOCKING,
                0,
                len,
                host as *mut std::ffi::c_void,
                waits.len() as u32,
                if waits.is_empty() {
                    std::ptr::null()
                } else {
                    waits.as_ptr()
                },
            )
        }
        .map_err(cl_error)?;
        drop(opencl3::event::Event::new(event));
        Ok(())
    }

    fn status(&self) -> DeviceReport {
        DeviceReport {
            name: self.info.name.clone(),
            kind: self.info.kind,
            description: self.info.description.clone(),
            memory_bytes: self.info.memory_bytes,
            memory_used: self.shared.memory_used.load(Ordering::Relaxed),
            memory_cached: 0,
            utilization_percent: None,
            threads_per_lane: 1,
            lanes: self.lanes.statuses(),
            failed: false,
            staged_bytes: 0,
        }
    }

    fn shutdown(&self) {
        self.lanes.shutdown();
    }
}

impl Drop for OpenClDevice {
    fn drop(&mut self) {
        self.shutdown();
    }
}
