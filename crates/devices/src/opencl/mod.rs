//! OpenCL devices: every device of every OpenCL platform found at start.
//!
//! On this project's machines that is PoCL on the CPU — a real OpenCL implementation with its own
//! buffers, compiler and command queues; elsewhere a GPU or FPGA platform. The ICD loader is
//! loaded at run time (opencl3's `dynamic` feature), so a daemon built with this backend still
//! starts, and serves the CPU, where OpenCL is missing.
//!
//! Each device has one context, one in-order command queue per lane (each lane is one thread that
//! blocks while its command completes, so tasks of several tenants run side by side on separate
//! queues), and one more queue for reads issued on behalf of other devices. Programs are built at
//! first use, once per device, and cached; kernel objects are cached per lane (they carry argument
//! state, so lanes must not share them). A program that fails to build is reported once, and the
//! device stops claiming its kernels.

use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Instant;

use agora_kernels::{KernelDef, OpenClImpl};
use agora_protocol::control::DeviceStatus;
use agora_protocol::{ParamKind, ScalarType, TaskError};
use opencl3::command_queue::CommandQueue;
use opencl3::context::Context;
use opencl3::device::{Device as ClDeviceInfo, CL_DEVICE_TYPE_ALL};
use opencl3::event::{Event, CL_COMPLETE};
use opencl3::kernel::Kernel;
use opencl3::memory::{Buffer, ClMem, CL_MEM_READ_WRITE};
use opencl3::program::Program;
use opencl3::types::{cl_device_id, cl_event, cl_int, CL_BLOCKING, CL_NON_BLOCKING};
use std::ffi::c_void;

use crate::lane::{Executor, JobEnd, Lane, Lanes};
use crate::{Device, DeviceBuffer, DeviceInfo, DeviceKind, Job, Transfer, Work};

/// State shared by a device's lanes and its buffers.
struct Shared {
    name: String,
    context: Context,
    /// Queue for synchronous reads requested by other devices' lanes.
    reader: Mutex<CommandQueue>,
    programs: Mutex<HashMap<&'static str, Arc<Program>>>,
    broken_programs: Mutex<HashSet<&'static str>>,
    memory_used: AtomicU64,
    memory_bytes: u64,
}

// SAFETY: Context and CommandQueue are Send + Sync in opencl3; Program is Send + Sync; the maps are
// behind mutexes. (Declared so `Arc<Shared>` can move into lane threads.)
unsafe impl Send for Shared {}
// SAFETY: as above.
unsafe impl Sync for Shared {}

impl Shared {
    fn program(&self, imp: &OpenClImpl) -> Result<Arc<Program>, TaskError> {
        if let Some(p) = self.programs.lock().unwrap_or_else(|e| e.into_inner()).get(imp.program) {
            return Ok(p.clone());
        }
        if self
            .broken_programs
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .contains(imp.program)
        {
            return Err(TaskError::DeviceFailed(-11));
        }
        // Built outside the lock: a build takes up to a second; other programs need not wait.
        match Program::create_and_build_from_source(&self.context, imp.source, "-cl-std=CL1.2") {
            Ok(program) => {
                let program = Arc::new(program);
                self.programs
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .insert(imp.program, program.clone());
                Ok(program)
            }
            Err(log) => {
                tracing::error!(device = %self.name, program = imp.program, %log, "OpenCL program failed to build; its kernels will run elsewhere");
                self.broken_programs
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .insert(imp.program);
                Err(TaskError::DeviceFailed(-11)) // CL_BUILD_PROGRAM_FAILURE
            }
        }
    }
}

/// A buffer in an OpenCL device's memory.
struct ClBuffer {
    buffer: Buffer<u8>,
    len: u64,
    shared: Arc<Shared>,
}

impl std::fmt::Debug for ClBuffer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ClBuffer")
            .field("device", &self.shared.name)
            .field("len", &self.len)
            .finish()
    }
}

impl DeviceBuffer for ClBuffer {
    fn len(&self) -> u64 {
        self.len
    }
    fn as_any(&self) -> &dyn std::any::Any {
        self
    }
}

impl Drop for ClBuffer {
    fn drop(&mut self) {
        self.shared.memory_used.fetch_sub(self.len, Ordering::Relaxed);
    }
}

fn cl_error(e: impl Into<i64>) -> TaskError {
    TaskError::DeviceFailed(e.into())
}

/// An OpenCL device.
pub struct OpenClDevice {
    info: DeviceInfo,
    shared: Arc<Shared>,
    lanes: Lanes,
}

impl std::fmt::Debug for OpenClDevice {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("OpenClDevice")
            .field("info", &self.info)
            .finish_non_exhaustive()
    }
}

struct ClExecutor {
    shared: Arc<Shared>,
    queue: CommandQueue,
    /// Kernel objects of this lane, with whether each is guarded (takes the trailing range).
    kernels: HashMap<(&'static str, &'static str), (Kernel, bool)>,
    /// Whether the job being started had to build a kernel object (its time is not typical).
    built: bool,
}

// SAFETY: the executor moves into its lane thread once and is used only there; Kernel is Send.
unsafe impl Send for ClExecutor {}

impl ClExecutor {
    fn kernel(&mut self, imp: &OpenClImpl, params: usize) -> Result<&(Kernel, bool), TaskError> {
        let key = (imp.program, imp.entry);
        if !self.kernels.contains_key(&key) {
            self.built = true;
            let program = self.shared.program(imp)?;
            let kernel = Kernel::create(&program, imp.entry).map_err(|e| {
                tracing::error!(device = %self.shared.name, kernel = imp.entry, error = %e, "no such OpenCL kernel");
                cl_error(e.0)
            })?;
            let declared = kernel.num_args().map_err(|e| cl_error(e.0))? as usize;
            let guarded = declared == params + 3;
            if !guarded && declared != params {
                tracing::error!(device = %self.shared.name, kernel = imp.entry, declared, params, "OpenCL kernel does not match its signature");
                return Err(TaskError::DeviceFailed(-51)); // CL_INVALID_KERNEL_ARGS
            }
            self.kernels.insert(key, (kernel, guarded));
        }
        Ok(&self.kernels[&key])
    }
}

fn as_cl(buffer: &dyn DeviceBuffer) -> Result<&ClBuffer, TaskError> {
    buffer.as_any().downcast_ref::<ClBuffer>().ok_or(TaskError::KernelFault)
}

/// A started job waiting for its last command's completion callback.
struct Pending {
    end: JobEnd,
    event: Event,
    // Held until completion: the commands read and write the memory these point to.
    _transfers: Vec<Transfer>,
    _work: Work,
}

impl Pending {
    /// Finishes the job with `result`, letting go of its device buffers first: the scheduler may
    /// evict and reuse their memory as soon as it sees the task done.
    fn finish(self, result: Result<(), TaskError>) {
        let Pending {
            end,
            event,
            _transfers,
            _work,
        } = self;
        drop(_work);
        drop(_transfers);
        end.finish(result);
        drop(event);
    }
}

/// OpenCL's completion callback for a job's last command.
extern "C" fn on_complete(_event: cl_event, status: cl_int, user: *mut c_void) {
    // SAFETY: `user` is the `Box<Pending>` that `ClExecutor::run` leaked when it registered this
    // callback; OpenCL invokes a registered callback exactly once.
    let pending = unsafe { Box::from_raw(user as *mut Pending) };
    let result = if status < 0 {
        Err(TaskError::DeviceFailed(i64::from(status)))
    } else {
        Ok(())
    };
    // Never unwind into the OpenCL runtime.
    let _ = std::panic::catch_unwind(std::panic::AssertUnwindSafe(move || pending.finish(result)));
}

/// OpenCL's completion callback for a job's last transfer: records when transfers ended.
extern "C" fn on_transfers_done(_event: cl_event, _status: cl_int, user: *mut c_void) {
    // SAFETY: `user` is an `Arc<OnceLock<Instant>>` reference leaked for this callback, which
    // OpenCL invokes exactly once.
    let marker = unsafe { Arc::from_raw(user as *const OnceLock<Instant>) };
    let _ = marker.set(Instant::now());
}

impl ClExecutor {
    /// Enqueues a job's commands; returns the event of the last one. `transfers_marker` learns
    /// when the transfers are done.
    fn start(
        &mut self,
        transfers: &[Transfer],
        work: &Work,
        transfers_marker: &Arc<OnceLock<Instant>>,
    ) -> Result<Event, TaskError> {
        let queue = self.queue.get();
        let mut last_transfer: Option<cl_event> = None;
        for transfer in transfers {
            match transfer {
                Transfer::ToDevice { host, len, to } => {
                    let to = as_cl(to.as_ref())?;
                    if *len as u64 > to.len {
                        return Err(TaskError::KernelFault);
                    }
                    // SAFETY: `host` is valid for `len` bytes (a live buffer's host range) until
                    // the job finishes, which is after this command completes; the device buffer
                    // holds at least `len` bytes (checked).
                    let event = unsafe {
                        opencl3::command_queue::enqueue_write_buffer(
                            queue,
                            to.buffer.get(),
                            CL_NON_BLOCKING,
                            0,
                            *len,
                            *host as *mut c_void,
                            0,
                            std::ptr::null(),
                        )
                    }
                    .map_err(cl_error)?;
                    drop(Event::new(event));
                }
                Transfer::ToHost {
                    from,
                    device,
                    host,
                    len,
                } => {
                    let own = as_cl(from.as_ref()).is_ok_and(|b| Arc::ptr_eq(&b.shared, &self.shared));
                    if own {
                        let from = as_cl(from.as_ref())?;
                        if *len as u64 > from.len {
                            return Err(TaskError::KernelFault);
                        }
                        // SAFETY: as above, in the other direction; ordered after this lane's
                        // earlier commands by the in-order queue.
                        let event = unsafe {
                            opencl3::command_queue::enqueue_read_buffer(
                                queue,
                                from.buffer.get(),
                                CL_NON_BLOCKING,
                                0,
                                *len,
                                *host as *mut c_void,
                                0,
                                std::ptr::null(),
                            )
                        }
                        .map_err(cl_error)?;
                        if let Some(previous) = last_transfer.replace(event) {
                            drop(Event::new(previous));
                        }
                    } else {
                        // Another device's buffer: read it synchronously through that device.
                        // SAFETY: `host` is valid for `len` bytes until the job finishes.
                        unsafe { device.read(from.as_ref(), *host, *len)? };
                    }
                }
            }
        }
        match last_transfer {
            Some(event) => {
                let event = Event::new(event);
                let marker = Arc::into_raw(transfers_marker.clone()) as *mut c_void;
                if opencl3::event::set_event_callback(event.get(), CL_COMPLETE, on_transfers_done, marker).is_err() {
                    // SAFETY: not registered, so the reference is still ours to release.
                    drop(unsafe { Arc::from_raw(marker as *const OnceLock<Instant>) });
                }
            }
            None if !transfers.is_empty() => {
                let _ = transfers_marker.set(Instant::now());
            }
            None => {}
        }
        if matches!(work, Work::Fill { .. } | Work::Copy { .. }) {
            // Host-memory work of a queue bound to this lane: it may read what earlier commands
            // wrote to the host, so wait for them first.
            self.queue.finish().map_err(|e| cl_error(e.0))?;
            crate::run_host_work(work).unwrap_or(Err(TaskError::KernelFault))?;
        }
        if let Work::Launch { .. } = work {
            return self.launch(work);
        }
        // Nothing left to run: a marker completes after every earlier command of this queue, so
        // the job finishes in order.
        // SAFETY: a marker with no wait list on a live queue.
        let event = unsafe { opencl3::command_queue::enqueue_marker_with_wait_list(queue, 0, std::ptr::null()) }
            .map_err(cl_error)?;
        Ok(Event::new(event))
    }

    fn launch(&mut self, work: &Work) -> Result<Event, TaskError> {
        let Work::Launch {
            kernel,
            range,
            dims,
            args,
            device_args,
            rows,
            ..
        } = work
        else {
            return Err(TaskError::KernelFault);
        };
        if rows.is_some() {
            // This backend does not take row slices (`runs_row_slices` is false): a daemon bug.
            return Err(TaskError::KernelFault);
        }
        let imp = kernel.opencl.ok_or(TaskError::KernelFault)?;
        let queue = self.queue.get();
        let device_name = self.shared.name.clone();
        let (cl_kernel, guarded) = self.kernel(&imp, kernel.params.len())?;
        let guarded = *guarded;
        for (index, param) in kernel.params.iter().enumerate() {
            let index_u32 = index as u32;
            let result = match param.kind {
                ParamKind::Buffer { .. } => {
                    let buffer = device_args[index].as_deref().ok_or(TaskError::KernelFault)?;
                    let mem = as_cl(buffer)?.buffer.get();
                    // SAFETY: a live cl_mem of this context for a buffer parameter.
                    unsafe { cl_kernel.set_arg(index_u32, &mem) }
                }
                ParamKind::Scalar(t) => {
                    let bits = match args[index] {
                        agora_kernels::ArgValue::Scalar(b) => b,
                        _ => return Err(TaskError::KernelFault),
                    };
                    // SAFETY: the value's type is the parameter's declared type, which the OpenCL
                    // source follows (calling convention in agora_kernels::OpenClImpl).
                    unsafe {
                        match t {
                            ScalarType::I32 => cl_kernel.set_arg(index_u32, &(bits as u32 as i32)),
                            ScalarType::U32 => cl_kernel.set_arg(index_u32, &(bits as u32)),
                            ScalarType::F32 => cl_kernel.set_arg(index_u32, &f32::from_bits(bits as u32)),
                            ScalarType::I64 => cl_kernel.set_arg(index_u32, &(bits as i64)),
                            ScalarType::U64 => cl_kernel.set_arg(index_u32, &bits),
                            ScalarType::F64 => cl_kernel.set_arg(index_u32, &f64::from_bits(bits)),
                        }
                    }
                }
            };
            result.map_err(|e| {
                tracing::error!(device = %device_name, kernel = kernel.name, arg = index, error = %e, "setting a kernel argument failed");
                cl_error(e.0)
            })?;
        }
        let mut global = [1usize; 3];
        for d in 0..*dims {
            global[d] = range[d] as usize;
        }
        let local = work_group(&global[..*dims], imp.local, guarded);
        if guarded {
            for (d, extent) in range.iter().enumerate() {
                // SAFETY: the trailing parameters are `const ulong` (guarded convention).
                unsafe { cl_kernel.set_arg((kernel.params.len() + d) as u32, extent) }.map_err(|e| cl_error(e.0))?;
            }
            // Round up to whole work-groups; the kernel returns for items beyond the range.
            for d in 0..*dims {
                global[d] = global[d].div_ceil(local[d]) * local[d];
            }
        }
        // SAFETY: the kernel's arguments are all set (above); `global` and `local` outlive the
        // call; `dims` is 1..=3 (checked by the daemon's decoder). Kernel objects keep their
        // arguments, and this lane is the only user of this one.
        let event = unsafe {
            opencl3::command_queue::enqueue_nd_range_kernel(
                queue,
                cl_kernel.get(),
                *dims as u32,
                std::ptr::null(),
                global.as_ptr(),
                local.as_ptr(),
                0,
                std::ptr::null(),
            )
        }
        .map_err(|e| {
            tracing::error!(device = %device_name, kernel = kernel.name, error = e, "OpenCL launch failed");
            cl_error(e)
        })?;
        Ok(Event::new(event))
    }
}

impl Executor for ClExecutor {
    fn run(&mut self, transfers: Vec<Transfer>, work: Work, mut end: JobEnd) {
        let marker = end.transfers_marker();
        self.built = false;
        let started = self.start(&transfers, &work, &marker);
        if self.built {
            end.mark_cold();
        }
        let event = match started {
            Ok(event) => event,
            Err(e) => {
                // Commands enqueued before the failure may still use the job's memory.
                let _ = self.queue.finish();
                drop(work);
                drop(transfers);
                end.finish(Err(e));
                return;
            }
        };
        let raw = event.get();
        let pending = Box::into_raw(Box::new(Pending {
            end,
            event,
            _transfers: transfers,
            _work: work,
        }));
        match opencl3::event::set_event_callback(raw, CL_COMPLETE, on_complete, pending as *mut c_void) {
            Ok(()) => {
                // Start the commands now rather than at the next flush.
                let _ = self.queue.flush();
            }
            Err(e) => {
                // SAFETY: the callback was not registered, so the box is still ours alone.
                let pending = unsafe { Box::from_raw(pending) };
                let _ = pending.event.wait();
                pending.finish(Err(cl_error(e)));
            }
        }
    }
}

/// The work-group size for a launch of `global` (1 to 3 dimensions).
///
/// Guarded kernels get a fixed size (or the declared one), so the OpenCL compiler specialises
/// them once; others get the largest power of two up to the same size that divides each extent
/// (few distinct sizes, hence few specialisations).
fn work_group(global: &[usize], declared: Option<[usize; 3]>, guarded: bool) -> [usize; 3] {
    let fixed: [usize; 3] = match (declared, global.len()) {
        (Some(l), _) => l,
        (None, 1) => [64, 1, 1],
        (None, 2) => [8, 8, 1],
        (None, _) => [4, 4, 4],
    };
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

impl OpenClDevice {
    fn new(index: usize, id: cl_device_id, platform: &str, lanes: usize, memory_limit: u64) -> Result<Self, String> {
        let cl = ClDeviceInfo::new(id);
        let device_name = cl.name().map_err(|e| e.to_string())?;
        let mut memory_bytes = cl.global_mem_size().map_err(|e| e.to_string())?;
        if memory_limit > 0 {
            // The operator keeps part of the device for others (or tests eviction).
            memory_bytes = memory_bytes.min(memory_limit);
        }
        let compute_units = cl.max_compute_units().unwrap_or(1);
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
        let shared = Arc::new(Shared {
            name: name.clone(),
            context,
            reader: Mutex::new(reader),
            programs: Mutex::new(HashMap::new()),
            broken_programs: Mutex::new(HashSet::new()),
            memory_used: AtomicU64::new(0),
            memory_bytes,
        });
        let mut lane_list = Vec::new();
        let mut threads = Vec::new();
        for (l, queue) in queues.into_iter().enumerate() {
            let executor = ClExecutor {
                shared: shared.clone(),
                queue,
                kernels: HashMap::new(),
                built: false,
            };
            let (lane, thread) =
                Lane::start(format!("agora-{name}-lane{l}"), Box::new(executor)).map_err(|e| e.to_string())?;
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
            },
            shared,
            lanes: Lanes::new(lane_list, threads),
        })
    }
}

/// Finds every OpenCL device. Returns the devices that work and one message per platform or
/// device that does not (to be reported once by the caller).
pub fn discover(lanes_per_device: usize, memory_limit: u64) -> (Vec<OpenClDevice>, Vec<String>) {
    // Loading the ICD and enumerating platforms from two threads at once (two daemons in one
    // process, as in tests) made one of them see no platform: discover one at a time.
    static DISCOVERY: Mutex<()> = Mutex::new(());
    let _one_at_a_time = DISCOVERY.lock().unwrap_or_else(|e| e.into_inner());
    let mut devices = Vec::new();
    let mut problems = Vec::new();
    let platforms = match std::panic::catch_unwind(opencl3::platform::get_platforms) {
        Ok(Ok(p)) => p,
        Ok(Err(e)) => {
            problems.push(format!(
                "no OpenCL platform: {e} (install an ICD, e.g. pocl-opencl-icd)"
            ));
            return (devices, problems);
        }
        Err(_) => {
            problems.push("OpenCL is not available (no ICD loader libOpenCL.so.1 found)".into());
            return (devices, problems);
        }
    };
    for platform in platforms {
        let platform_name = platform.name().unwrap_or_else(|_| "unknown platform".into());
        let ids = match platform.get_devices(CL_DEVICE_TYPE_ALL) {
            Ok(ids) => ids,
            Err(e) => {
                problems.push(format!("OpenCL platform {platform_name}: cannot list devices: {e}"));
                continue;
            }
        };
        for id in ids {
            match OpenClDevice::new(devices.len(), id, &platform_name, lanes_per_device, memory_limit) {
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
        match kernel.opencl {
            Some(imp) => !self
                .shared
                .broken_programs
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .contains(imp.program),
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

    fn run_inline(&self, _work: &Work) -> Result<(), TaskError> {
        // Never called: this device does not share host memory.
        Err(TaskError::KernelFault)
    }

    fn alloc(&self, len: u64) -> Option<Result<Arc<dyn DeviceBuffer>, TaskError>> {
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
            Ok(buffer) => Ok(Arc::new(ClBuffer {
                buffer,
                len,
                shared: self.shared.clone(),
            }) as Arc<dyn DeviceBuffer>),
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
        // SAFETY: `host` is valid for `len` bytes (caller's contract), the buffer holds at least
        // `len` bytes (checked); the read is blocking.
        let event = unsafe {
            opencl3::command_queue::enqueue_read_buffer(
                queue.get(),
                from.buffer.get(),
                CL_BLOCKING,
                0,
                len,
                host as *mut std::ffi::c_void,
                0,
                std::ptr::null(),
            )
        }
        .map_err(cl_error)?;
        drop(opencl3::event::Event::new(event));
        Ok(())
    }

    fn status(&self) -> DeviceStatus {
        DeviceStatus {
            name: self.info.name.clone(),
            kind: self.info.kind.name().to_string(),
            description: self.info.description.clone(),
            memory_bytes: self.info.memory_bytes,
            memory_used: self.shared.memory_used.load(Ordering::Relaxed),
            threads_per_lane: 1,
            lanes: self.lanes.statuses(),
            ..Default::default()
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
