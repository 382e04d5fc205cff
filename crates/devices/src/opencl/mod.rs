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
//! completes; [`Device::polls_revocation`] is false there.
//!
//! Limits ([`LaunchLimits`]): each device reports its largest work-group (in all and per
//! dimension, from `CL_DEVICE_MAX_WORK_GROUP_SIZE` and `CL_DEVICE_MAX_WORK_ITEM_SIZES`), its
//! `size_t` (`CL_DEVICE_ADDRESS_BITS`, which bounds every dimension of a launch) and its largest
//! allocation (`CL_DEVICE_MAX_MEM_ALLOC_SIZE`). On top of those, bounds that keep a launch within
//! what the runtime survives and a lane from being held for long by one command
//! ([`MAX_GROUPS_PER_ENQUEUE`], [`MAX_ITEMS_PER_ENQUEUE`], [`MAX_ITEMS_PER_LAUNCH`]): PoCL aborts
//! the whole process on a command of 2^32 work-groups or more, so these are checked before a
//! launch is bound to the device, and larger launches are split into row slices.

use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Instant;

use agora_kernels::{KernelDef, OpenClImpl};
use agora_protocol::{ParamKind, ScalarType, TaskError};
use opencl3::command_queue::CommandQueue;
use opencl3::context::Context;
use opencl3::device::{Device as ClDeviceInfo, CL_DEVICE_TYPE_ALL, CL_DEVICE_TYPE_CPU};
use opencl3::event::{Event, CL_COMPLETE};
use opencl3::kernel::Kernel;
use opencl3::memory::{Buffer, ClMem, CL_MEM_COPY_HOST_PTR, CL_MEM_READ_ONLY, CL_MEM_READ_WRITE, CL_MEM_USE_HOST_PTR};
use opencl3::program::Program;
use opencl3::types::{cl_device_id, cl_event, cl_int, cl_mem, CL_BLOCKING, CL_NON_BLOCKING};
use std::ffi::c_void;

use crate::lane::{Executor, JobEnd, Lane, Lanes};
use crate::{Device, DeviceBuffer, DeviceInfo, DeviceKind, DeviceReport, Job, LaunchLimits, Transfer, Work};

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
struct Reported {
    /// `CL_DEVICE_ADDRESS_BITS`: the width of the device's `size_t`.
    address_bits: Option<u32>,
    /// `CL_DEVICE_MAX_WORK_ITEM_SIZES`.
    work_item_sizes: Option<Vec<usize>>,
    /// `CL_DEVICE_MAX_WORK_GROUP_SIZE`.
    work_group_size: Option<usize>,
    /// `CL_DEVICE_MAX_MEM_ALLOC_SIZE`.
    mem_alloc_size: Option<u64>,
}

impl Reported {
    fn query(cl: &ClDeviceInfo) -> Self {
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
    fn limits(&self) -> LaunchLimits {
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
    /// The revocation flag of launches that cannot be revoked: one always-zero byte, shared by
    /// every lane (kernels only read it), so such launches pay no allocation.
    zero_flag: Buffer<u8>,
    /// Whether a running kernel sees a store to a host flag wrapped in a `CL_MEM_USE_HOST_PTR`
    /// buffer (the device computes on host memory); otherwise the flag is copied in before the
    /// kernel starts. Atomic only so tests can force the fallback.
    host_flags: AtomicBool,
    /// What one launch may ask of the device (checked by the daemon; re-checked per command
    /// here, since a command beyond them can abort the whole process).
    limits: LaunchLimits,
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

/// How a kernel object takes the parameters after its signature's (see
/// [`agora_kernels::OpenClImpl`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Convention {
    /// None: the exact range is the global size.
    Plain,
    /// `range0, range1, range2`.
    Guarded,
    /// `range0, range1, range2, revoke`.
    Revocable,
}

struct ClExecutor {
    shared: Arc<Shared>,
    queue: CommandQueue,
    /// This lane's device copy of the revocation flag, for devices whose running kernels cannot
    /// see host memory: written from the job's flag just before each revocable kernel (the
    /// in-order queue never runs two of this lane's kernels at once, so one suffices).
    lane_flag: Buffer<u8>,
    /// Kernel objects of this lane, with their trailing parameters.
    kernels: HashMap<(&'static str, &'static str), (Kernel, Convention)>,
    /// Whether the job being started had to build a kernel object (its time is not typical).
    built: bool,
}

// SAFETY: the executor moves into its lane thread once and is used only there; Kernel is Send.
unsafe impl Send for ClExecutor {}

impl ClExecutor {
    fn kernel(&mut self, imp: &OpenClImpl, params: usize) -> Result<&(Kernel, Convention), TaskError> {
        let key = (imp.program, imp.entry);
        if !self.kernels.contains_key(&key) {
            self.built = true;
            let program = self.shared.program(imp)?;
            let kernel = Kernel::create(&program, imp.entry).map_err(|e| {
                tracing::error!(device = %self.shared.name, kernel = imp.entry, error = %e, "no such OpenCL kernel");
                cl_error(e.0)
            })?;
            let declared = kernel.num_args().map_err(|e| cl_error(e.0))? as usize;
            let convention = match declared.checked_sub(params) {
                Some(0) => Convention::Plain,
                Some(3) => Convention::Guarded,
                Some(4) => Convention::Revocable,
                _ => {
                    tracing::error!(device = %self.shared.name, kernel = imp.entry, declared, params, "OpenCL kernel does not match its signature");
                    return Err(TaskError::DeviceFailed(-51)); // CL_INVALID_KERNEL_ARGS
                }
            };
            self.kernels.insert(key, (kernel, convention));
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
    /// Whether the kernel read the job's revocation flag (and so may have stopped early).
    polled: bool,
    // Held until completion: the commands read and write the memory these point to.
    _flag: Option<Buffer<u8>>,
    _transfers: Vec<Transfer>,
    _work: Work,
}

impl Pending {
    /// The job's outcome once its last command ended with `status`: `Cancelled` when its kernel
    /// polled a revocation flag that is now set. The flag may have been set after the last
    /// work-group started, so the run may be complete; the daemon then replays it needlessly,
    /// but never keeps a partial result.
    fn outcome(&self, status: cl_int) -> Result<(), TaskError> {
        if status < 0 {
            Err(TaskError::DeviceFailed(i64::from(status)))
        } else if self.polled && self.end.revoke_flag().is_some_and(|f| f.load(Ordering::Acquire)) {
            Err(TaskError::Cancelled)
        } else {
            Ok(())
        }
    }

    /// Finishes the job with `result`, letting go of its device buffers first: the scheduler may
    /// evict and reuse their memory as soon as it sees the task done.
    fn finish(self, result: Result<(), TaskError>) {
        let Pending {
            end,
            event,
            polled: _,
            _flag,
            _transfers,
            _work,
        } = self;
        drop(_work);
        drop(_transfers);
        // Before the job's flag (held by `end`) can go: this buffer wraps its memory.
        drop(_flag);
        end.finish(result);
        drop(event);
    }
}

/// What starting a job enqueued.
struct Started {
    /// The job's last command.
    event: Event,
    /// Whether its kernel polls the job's revocation flag.
    polled: bool,
    /// The buffer that wraps the job's flag, when the kernel reads it in place.
    flag: Option<Buffer<u8>>,
}

impl Started {
    fn command(event: Event) -> Self {
        Started {
            event,
            polled: false,
            flag: None,
        }
    }
}

/// OpenCL's completion callback for a job's last command.
extern "C" fn on_complete(_event: cl_event, status: cl_int, user: *mut c_void) {
    // SAFETY: `user` is the `Box<Pending>` that `ClExecutor::run` leaked when it registered this
    // callback; OpenCL invokes a registered callback exactly once.
    let pending = unsafe { Box::from_raw(user as *mut Pending) };
    let result = pending.outcome(status);
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
    /// when the transfers are done; `revoke` is the job's revocation flag.
    fn start(
        &mut self,
        transfers: &[Transfer],
        work: &Work,
        transfers_marker: &Arc<OnceLock<Instant>>,
        revoke: Option<&Arc<AtomicBool>>,
    ) -> Result<Started, TaskError> {
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
            return self.launch(work, revoke);
        }
        self.marker().map(Started::command)
    }

    /// A marker: it completes after every earlier command of this queue, so a job with nothing
    /// left to run still finishes in order.
    fn marker(&self) -> Result<Event, TaskError> {
        // SAFETY: a marker with no wait list on a live queue.
        let event =
            unsafe { opencl3::command_queue::enqueue_marker_with_wait_list(self.queue.get(), 0, std::ptr::null()) }
                .map_err(cl_error)?;
        Ok(Event::new(event))
    }

    /// The revocation flag argument of a revocable launch: the shared zero flag when the job has
    /// no flag; else a buffer over the job's flag itself (returned, to be held until the kernel
    /// completes) when running kernels see host memory; else this lane's device flag, after a
    /// copy of the job's flag enqueued now, just before the kernel.
    fn flag_argument(&self, revoke: Option<&Arc<AtomicBool>>) -> Result<(cl_mem, Option<Buffer<u8>>), TaskError> {
        let Some(flag) = revoke else {
            return Ok((self.shared.zero_flag.get(), None));
        };
        let host = flag.as_ptr() as *mut c_void;
        if self.shared.host_flags.load(Ordering::Relaxed) {
            // SAFETY: `host` is the job's AtomicBool (one byte, 0 or 1), which the job's `JobEnd`
            // keeps alive until the kernel completes, after this buffer is released. Kernels only
            // read it (`const volatile`), and the host writes it only atomically; on a device that
            // computes on host memory the buffer is those same bytes.
            let buffer =
                unsafe { Buffer::<u8>::create(&self.shared.context, CL_MEM_READ_ONLY | CL_MEM_USE_HOST_PTR, 1, host) }
                    .map_err(|e| cl_error(e.0))?;
            let mem = buffer.get();
            return Ok((mem, Some(buffer)));
        }
        // SAFETY: reads one byte of the job's flag, alive until the job completes (after this
        // command); the copy runs when the previous command of this in-order queue is done, so the
        // kernel starts with the flag's value at that moment. A concurrent atomic store by the
        // daemon yields 0 or 1, either of which is a correct outcome.
        let event = unsafe {
            opencl3::command_queue::enqueue_write_buffer(
                self.queue.get(),
                self.lane_flag.get(),
                CL_NON_BLOCKING,
                0,
                1,
                host,
                0,
                std::ptr::null(),
            )
        }
        .map_err(cl_error)?;
        drop(Event::new(event));
        Ok((self.lane_flag.get(), None))
    }

    fn launch(&mut self, work: &Work, revoke: Option<&Arc<AtomicBool>>) -> Result<Started, TaskError> {
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
        let imp = kernel.opencl.ok_or(TaskError::KernelFault)?;
        // A row slice runs rows `first..end` of dimension 0, as one command whose global work
        // offset is `first`.
        let (first, end) = match rows {
            Some(rows) => (rows.start.min(range[0]), rows.end.min(range[0])),
            None => (0, range[0]),
        };
        if end <= first {
            // An empty slice (OpenCL 1.2 refuses a zero global size): nothing to run.
            return self.marker().map(Started::command);
        }
        let queue = self.queue.get();
        let device_name = self.shared.name.clone();
        let limits = self.shared.limits;
        let convention = self.kernel(&imp, kernel.params.len())?.1;
        let (flag, flag_buffer) = match convention {
            Convention::Revocable => {
                let (mem, buffer) = self.flag_argument(revoke)?;
                (Some(mem), buffer)
            }
            _ => (None, None),
        };
        let (cl_kernel, _) = self.kernel(&imp, kernel.params.len())?;
        let guarded = convention != Convention::Plain;
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
        global[0] = (end - first) as usize;
        let offset = [first as usize, 0, 0];
        let local = work_group(&global[..*dims], imp.local, guarded);
        if guarded {
            // range0 is the slice's end: the work items that rounding adds past it return, so a
            // slice never writes the next slice's rows.
            let bounds = [end, range[1], range[2]];
            for (d, extent) in bounds.iter().enumerate() {
                // SAFETY: the trailing parameters are `const ulong` (guarded convention).
                unsafe { cl_kernel.set_arg((kernel.params.len() + d) as u32, extent) }.map_err(|e| cl_error(e.0))?;
            }
            if let Some(flag) = flag {
                // SAFETY: the parameter after the guards is a `__global` pointer (revocable
                // convention); `flag` is a live buffer of this context, held until completion.
                unsafe { cl_kernel.set_arg((kernel.params.len() + 3) as u32, &flag) }.map_err(|e| cl_error(e.0))?;
            }
            // Round up to whole work-groups; the kernel returns for items beyond the range.
            for d in 0..*dims {
                global[d] = global[d].div_ceil(local[d]) * local[d];
            }
        }
        // The daemon split the launch so that every command is within the device's limits
        // (`Device::check_launch`); a command beyond them is a daemon bug, and PoCL aborts the
        // process on one, so it fails this task instead of reaching the runtime.
        let items = global[..*dims].iter().fold(1u64, |a, g| a.saturating_mul(*g as u64));
        let groups = (0..*dims).fold(1u64, |a, d| a.saturating_mul((global[d] / local[d].max(1)) as u64));
        if items > limits.max_items_per_enqueue || groups > limits.max_groups_per_enqueue {
            tracing::error!(device = %device_name, kernel = kernel.name, items, groups, "a command beyond the device's limits reached the device; refused");
            return Err(TaskError::KernelFault);
        }
        // SAFETY: the kernel's arguments are all set (above); `offset`, `global` and `local`
        // outlive the call; `dims` is 1..=3 (checked by the daemon's decoder). Kernel objects keep
        // their arguments, and this lane is the only user of this one.
        let event = unsafe {
            opencl3::command_queue::enqueue_nd_range_kernel(
                queue,
                cl_kernel.get(),
                *dims as u32,
                offset.as_ptr(),
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
        Ok(Started {
            event: Event::new(event),
            polled: flag.is_some() && revoke.is_some(),
            flag: flag_buffer,
        })
    }
}

impl Executor for ClExecutor {
    fn run(&mut self, transfers: Vec<Transfer>, work: Work, mut end: JobEnd) {
        let marker = end.transfers_marker();
        self.built = false;
        let started = self.start(&transfers, &work, &marker, end.revoke_flag());
        if self.built {
            end.mark_cold();
        }
        let Started { event, polled, flag } = match started {
            Ok(started) => started,
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
            polled,
            _flag: flag,
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

/// The work-group size of guarded kernels of `dims` dimensions (`declared` when given).
fn fixed_work_group(dims: usize, declared: Option<[usize; 3]>) -> [usize; 3] {
    match (declared, dims) {
        (Some(l), _) => l,
        (None, 1) => [64, 1, 1],
        (None, 2) => [8, 8, 1],
        (None, _) => [4, 4, 4],
    }
}

/// The work-group size for a launch of `global` (1 to 3 dimensions).
///
/// Guarded kernels get a fixed size (or the declared one), so the OpenCL compiler specialises
/// them once; others get the largest power of two up to the same size that divides each extent
/// (few distinct sizes, hence few specialisations).
fn work_group(global: &[usize], declared: Option<[usize; 3]>, guarded: bool) -> [usize; 3] {
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
            programs: Mutex::new(HashMap::new()),
            broken_programs: Mutex::new(HashSet::new()),
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
                limits,
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

    fn runs_row_slices(&self) -> bool {
        true
    }

    fn check_launch(&self, kernel: &KernelDef, range: &[u64], buffer_lens: &[u64]) -> Result<u64, TaskError> {
        // Guarded kernels (all of the library's) run in these work-groups; see `work_group`.
        let local = kernel
            .opencl
            .map_or([1; 3], |imp| fixed_work_group(range.len().clamp(1, 3), imp.local));
        let group = local.map(|l| l as u64);
        self.info.limits.check(range, group, buffer_lens, true)
    }

    fn row_alignment(&self, kernel: &KernelDef, dims: usize) -> u64 {
        // Slices whose boundaries are whole work-groups of dimension 0 waste no work items (a
        // slice's guard stops the rounded-up ones, so any boundary is correct).
        kernel
            .opencl
            .map_or(1, |imp| fixed_work_group(dims.clamp(1, 3), imp.local)[0].max(1) as u64)
    }

    fn polls_revocation(&self) -> bool {
        self.shared.host_flags.load(Ordering::Relaxed)
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

    fn status(&self) -> DeviceReport {
        DeviceReport {
            name: self.info.name.clone(),
            kind: self.info.kind,
            description: self.info.description.clone(),
            memory_bytes: self.info.memory_bytes,
            memory_used: self.shared.memory_used.load(Ordering::Relaxed),
            threads_per_lane: 1,
            lanes: self.lanes.statuses(),
            failed: false,
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

#[cfg(test)]
mod tests {
    use super::*;
    use agora_kernels::cases::{self, KernelCase};
    use agora_kernels::ArgValue;
    use agora_protocol::{ArgTag, MAX_ARGS};
    use std::ops::Range;
    use std::sync::mpsc;
    use std::time::Duration;

    /// The first OpenCL device (PoCL here). These tests fail, not skip, without one.
    fn device() -> OpenClDevice {
        let (mut devices, problems) = discover(1, 0);
        assert!(
            !devices.is_empty(),
            "these tests need an OpenCL device (PoCL): {problems:?}"
        );
        devices.swap_remove(0)
    }

    type Outcome = mpsc::Sender<(Result<(), TaskError>, Instant)>;

    fn job(transfers: Vec<Transfer>, work: Work, revoke: Option<Arc<AtomicBool>>, tx: &Outcome) -> Job {
        let tx = tx.clone();
        Job {
            transfers,
            work,
            keepalive: None,
            cancelled: None,
            revoke: revoke.map(|flag| crate::Revocation {
                flag,
                save: None,
                replay: false,
            }),
            urgent: false,
            done: Box::new(move |result, _| {
                let _ = tx.send((result, Instant::now()));
            }),
        }
    }

    /// A launch of `kernel` over `range` with wire arguments `raw` (buffer `i` is `buffers[i]`).
    fn launch(
        kernel: &'static KernelDef,
        range: &[u64],
        raw: &[agora_protocol::RawArg],
        buffers: &[Arc<dyn DeviceBuffer>],
        rows: Option<Range<u64>>,
    ) -> Work {
        let mut args = [ArgValue::None; MAX_ARGS];
        let mut device_args: [Option<Arc<dyn DeviceBuffer>>; MAX_ARGS] = Default::default();
        for (i, arg) in raw.iter().enumerate() {
            if arg.tag == ArgTag::Buffer as u32 {
                let buffer = &buffers[arg.value as usize];
                // OpenCL launches use `device_args`; the host pointer is not read.
                args[i] = ArgValue::Buffer {
                    ptr: std::ptr::null_mut(),
                    len: buffer.len(),
                };
                device_args[i] = Some(buffer.clone());
            } else {
                args[i] = ArgValue::Scalar(arg.value);
            }
        }
        let mut full = [1u64; 3];
        full[..range.len()].copy_from_slice(range);
        Work::Launch {
            kernel,
            range: full,
            dims: range.len(),
            args,
            arg_count: raw.len(),
            device_args,
            rows,
        }
    }

    fn upload(dev: &OpenClDevice, data: &[u8]) -> (Arc<dyn DeviceBuffer>, Transfer) {
        let buffer = dev.alloc(data.len() as u64).unwrap().unwrap();
        let transfer = Transfer::ToDevice {
            host: data.as_ptr(),
            len: data.len(),
            to: buffer.clone(),
        };
        (buffer, transfer)
    }

    fn download(dev: &OpenClDevice, buffer: &dyn DeviceBuffer, len: usize) -> Vec<u8> {
        let mut out = vec![0u8; len];
        // SAFETY: `out` holds `len` bytes.
        unsafe { dev.read(buffer, out.as_mut_ptr(), len) }.unwrap();
        out
    }

    /// Runs `case` as the given row ranges (`None`: one whole launch), one job each, in order on
    /// lane 0, and checks the results.
    fn run_sliced(dev: &OpenClDevice, case: &KernelCase, slices: &[Option<Range<u64>>]) -> Result<(), String> {
        let kernel = case.def()?;
        let initial = case.buffers();
        let (buffers, mut transfers): (Vec<_>, Vec<_>) = initial.iter().map(|b| upload(dev, b)).unzip();
        let (tx, rx) = mpsc::channel();
        let raw = case.raw_args();
        for rows in slices {
            let work = launch(kernel, &case.range, &raw, &buffers, rows.clone());
            dev.submit(0, job(std::mem::take(&mut transfers), work, None, &tx));
        }
        for _ in slices {
            rx.recv()
                .unwrap()
                .0
                .map_err(|e| format!("{}: launch failed: {e:?}", case.name))?;
        }
        let results: Vec<Vec<u8>> = buffers
            .iter()
            .zip(&initial)
            .map(|(b, init)| download(dev, b.as_ref(), init.len()))
            .collect();
        let views: Vec<&[u8]> = results.iter().map(|r| r.as_slice()).collect();
        case.check(&views)
    }

    /// `count` even row ranges of `rows` (the daemon's split before alignment: boundaries fall
    /// anywhere, not on work-group multiples).
    fn even(rows: u64, count: u64) -> Vec<Option<Range<u64>>> {
        (0..count)
            .map(|i| Some(rows * i / count..rows * (i + 1) / count))
            .collect()
    }

    #[test]
    fn every_case_is_exact_when_run_as_row_slices() {
        let dev = device();
        assert!(dev.runs_row_slices());
        let mut failures = Vec::new();
        let mut runs = 0;
        for program in cases::PROGRAMS {
            for case in cases::for_program(program) {
                let rows = case.range[0];
                let mut plans: Vec<(String, Vec<Option<Range<u64>>>)> = vec![
                    ("whole".into(), vec![None]),
                    ("1 slice".into(), even(rows, 1)),
                    ("3 slices".into(), even(rows, 3)),
                    ("7 slices".into(), even(rows, 7)),
                ];
                if case.large {
                    plans.push(("100 slices".into(), even(rows, 100)));
                } else {
                    // Very small slices: one row each, and an empty slice.
                    plans.push((format!("{rows} one-row slices"), even(rows, rows)));
                    let mut with_empty = even(rows, 2);
                    with_empty.insert(1, Some(rows / 2..rows / 2));
                    plans.push(("2 slices and an empty one".into(), with_empty));
                }
                // Slices that cut work-groups (64, 8, 4 or 16 rows) in the middle.
                if rows > 5 {
                    plans.push(("slices 0..5, 5..rows".into(), vec![Some(0..5), Some(5..rows)]));
                }
                for (plan, slices) in &plans {
                    runs += 1;
                    if let Err(e) = run_sliced(&dev, &case, slices) {
                        failures.push(format!("{plan}: {e}"));
                    }
                }
            }
        }
        assert!(runs > 100, "{runs} runs");
        assert!(
            failures.is_empty(),
            "{} of {runs} runs failed:\n{}",
            failures.len(),
            failures.join("\n")
        );
        dev.shutdown();
    }

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

    /// Every kernel's parameters (its signature's, the three guards and the flag pointer) fit in
    /// the least `CL_DEVICE_MAX_PARAMETER_SIZE` any OpenCL device may report (256 bytes, embedded
    /// profile), so no device refuses a library kernel for its arguments.
    #[test]
    fn every_kernel_takes_few_enough_parameter_bytes_for_any_device() {
        for k in agora_kernels::library() {
            let own: u64 = k
                .params
                .iter()
                .map(|p| match p.kind {
                    ParamKind::Buffer { .. } => 8, // a cl_mem (a pointer on a 64-bit device)
                    ParamKind::Scalar(t) => t.size(),
                })
                .sum();
            let bytes = own + 3 * 8 + 8;
            assert!(bytes <= 256, "{}: {bytes} parameter bytes", k.name);
        }
    }

    #[test]
    fn pocl_limits_split_or_refuse_huge_ranges() {
        let dev = device();
        let limits = dev.info().limits;
        assert_eq!(limits.max_groups_per_enqueue, MAX_GROUPS_PER_ENQUEUE);
        assert_eq!(limits.max_items_per_enqueue, MAX_ITEMS_PER_ENQUEUE);
        assert!(limits.max_group_items >= 64, "{limits:?}");
        let noop = agora_kernels::find("noop").unwrap().1;
        for range in [
            &[1u64 << 40][..],
            &[1 << 38],
            &[1 << 37],
            &[1 << 20, 1 << 20],
            &[1 << 14, 1 << 13, 1 << 13],
        ] {
            let items: u64 = range.iter().product();
            assert_eq!(
                dev.check_launch(noop, range, &[]),
                Err(TaskError::DeviceLimit {
                    limit: agora_protocol::LaunchLimit::Items,
                    value: items,
                    max: MAX_ITEMS_PER_LAUNCH
                }),
                "{range:?}"
            );
        }
        assert_eq!(dev.check_launch(noop, &[1 << 32], &[]), Ok(1));
        assert_eq!(dev.check_launch(noop, &[1 << 33], &[]), Ok(2));
        assert_eq!(dev.check_launch(noop, &[1 << 36], &[]), Ok(16));
        assert_eq!(dev.check_launch(noop, &[1 << 11, 1 << 11, 1 << 11], &[]), Ok(2));
        // Dimension 1 is never split: 8 rows of 2^33 are too many for one enqueue.
        assert_eq!(
            dev.check_launch(noop, &[1, 1 << 33], &[]),
            Err(TaskError::DeviceLimit {
                limit: agora_protocol::LaunchLimit::ItemsPerEnqueue,
                value: 1 << 36,
                max: MAX_ITEMS_PER_ENQUEUE
            })
        );
        dev.shutdown();
    }

    /// What used to kill the process (PoCL: SIGILL at 2^32 work-groups in one command, SIGABRT at
    /// 2^34) reaching the device anyway fails only its task.
    #[test]
    fn a_command_beyond_the_limits_fails_its_task_and_not_the_process() {
        let dev = device();
        let noop = agora_kernels::find("noop").unwrap().1;
        let (tx, rx) = mpsc::channel();
        for range in [&[1u64 << 38][..], &[1 << 40], &[1 << 20, 1 << 20]] {
            dev.submit(0, job(Vec::new(), launch(noop, range, &[], &[], None), None, &tx));
            assert_eq!(rx.recv().unwrap().0, Err(TaskError::KernelFault), "{range:?}");
        }
        // A row slice within the limits of the same launch runs, and so does the lane.
        let rows = Some((1 << 38) - (1 << 20)..1 << 38);
        dev.submit(0, job(Vec::new(), launch(noop, &[1 << 38], &[], &[], rows), None, &tx));
        assert_eq!(rx.recv().unwrap().0, Ok(()));
        dev.shutdown();
    }

    /// A range twice what one enqueue takes runs as the daemon splits it: two row slices.
    #[test]
    fn a_range_beyond_one_enqueue_runs_as_row_slices() {
        let dev = device();
        let noop = agora_kernels::find("noop").unwrap().1;
        let range = [1u64 << 33];
        assert_eq!(dev.check_launch(noop, &range, &[]), Ok(2));
        let (tx, rx) = mpsc::channel();
        for rows in [0..1 << 32, 1 << 32..1 << 33] {
            dev.submit(
                0,
                job(Vec::new(), launch(noop, &range, &[], &[], Some(rows)), None, &tx),
            );
        }
        assert_eq!(rx.recv().unwrap().0, Ok(()));
        assert_eq!(rx.recv().unwrap().0, Ok(()));
        dev.shutdown();
    }

    #[test]
    fn row_alignment_is_the_work_group_extent() {
        let dev = device();
        let sgemm = agora_kernels::find("sgemm").unwrap().1;
        let saxpy = agora_kernels::find("saxpy").unwrap().1;
        let hotspot = agora_kernels::find("hotspot.step").unwrap().1;
        assert_eq!(dev.row_alignment(sgemm, 2), 16);
        assert_eq!(dev.row_alignment(saxpy, 1), 64);
        assert_eq!(dev.row_alignment(hotspot, 2), 8);
        dev.shutdown();
    }

    /// A square all-ones sgemm of order `n`: C = A·A, every element `n`. C starts at -1.
    struct Sgemm {
        n: usize,
        c: Arc<dyn DeviceBuffer>,
        work: Box<dyn Fn() -> Work>,
        setup: Vec<Transfer>,
        _host: (Vec<u8>, Vec<u8>),
    }

    impl Sgemm {
        fn new(dev: &OpenClDevice, n: usize) -> Self {
            let ones: Vec<u8> = [1.0f32].repeat(n * n).iter().flat_map(|v| v.to_ne_bytes()).collect();
            let unset: Vec<u8> = [-1.0f32].repeat(n * n).iter().flat_map(|v| v.to_ne_bytes()).collect();
            let (a, to_a) = upload(dev, &ones);
            let (c, to_c) = upload(dev, &unset);
            let kernel = agora_kernels::find("sgemm").unwrap().1;
            let nn = n as u32 as u64;
            let raw = [
                agora_protocol::RawArg::i32(n as i32),
                agora_protocol::RawArg::i32(n as i32),
                agora_protocol::RawArg::i32(n as i32),
                agora_protocol::RawArg::f32(1.0),
                agora_protocol::RawArg::buffer(0),
                agora_protocol::RawArg::buffer(0),
                agora_protocol::RawArg::f32(0.0),
                agora_protocol::RawArg::buffer(1),
            ];
            let buffers = vec![a, c.clone()];
            let work = Box::new(move || launch(kernel, &[nn, nn], &raw, &buffers, None));
            Sgemm {
                n,
                c,
                work,
                setup: vec![to_a, to_c],
                _host: (ones, unset),
            }
        }

        /// Uploads A and resets C to -1 (synchronously).
        fn reset(&mut self, dev: &OpenClDevice) {
            let unset = &self._host.1;
            let (tx, rx) = mpsc::channel();
            let mut transfers = std::mem::take(&mut self.setup);
            if transfers.is_empty() {
                transfers.push(Transfer::ToDevice {
                    host: unset.as_ptr(),
                    len: unset.len(),
                    to: self.c.clone(),
                });
            }
            dev.submit(0, job(transfers, Work::Nothing, None, &tx));
            rx.recv().unwrap().0.unwrap();
        }

        /// How many elements of C were written (are `n`) and how many are still -1.
        fn written(&self, dev: &OpenClDevice) -> (usize, usize) {
            let bytes = download(dev, self.c.as_ref(), self.n * self.n * 4);
            let values: Vec<f32> = bytes
                .chunks_exact(4)
                .map(|b| f32::from_ne_bytes(b.try_into().unwrap()))
                .collect();
            let done = values.iter().filter(|v| **v == self.n as f32).count();
            let unset = values.iter().filter(|v| **v == -1.0).count();
            assert_eq!(
                done + unset,
                values.len(),
                "every element is either complete or unwritten"
            );
            (done, unset)
        }

        /// Runs it with `revoke` as its flag, setting the flag after `after` (when given); returns
        /// the outcome, the time from submission to completion and from the store to completion.
        fn run(
            &self,
            dev: &OpenClDevice,
            revoke: Option<Arc<AtomicBool>>,
            after: Option<Duration>,
        ) -> (Result<(), TaskError>, Duration, Option<Duration>) {
            let (tx, rx) = mpsc::channel();
            let started = Instant::now();
            dev.submit(0, job(Vec::new(), (self.work)(), revoke.clone(), &tx));
            let set = after.map(|after| {
                std::thread::sleep(after);
                revoke.as_ref().unwrap().store(true, Ordering::Release);
                Instant::now()
            });
            let (result, finished) = rx.recv().unwrap();
            (
                result,
                finished - started,
                set.map(|s| finished.saturating_duration_since(s)),
            )
        }
    }

    #[test]
    fn a_revoked_sgemm_stops_early_and_leaves_later_tiles_unwritten() {
        let dev = device();
        assert!(
            dev.polls_revocation(),
            "PoCL computes on host memory: kernels see the flag"
        );
        let mut s = Sgemm::new(&dev, 1024);
        s.reset(&dev);
        // Warm: builds the program and PoCL's specialisation, so the timed runs are typical.
        let (result, _, _) = s.run(&dev, None, None);
        result.unwrap();
        s.reset(&dev);
        // Not revoked: a flag that stays clear gives the exact result.
        let flag = Arc::new(AtomicBool::new(false));
        let (result, whole, _) = s.run(&dev, Some(flag), None);
        assert_eq!(result, Ok(()));
        assert_eq!(s.written(&dev), (s.n * s.n, 0), "an unrevoked run is complete");
        // Revoked a quarter of the way through: work-groups that start later return at once.
        s.reset(&dev);
        let flag = Arc::new(AtomicBool::new(false));
        let (result, took, after_set) = s.run(&dev, Some(flag), Some(whole / 4));
        let after_set = after_set.unwrap();
        let (done, unset) = s.written(&dev);
        eprintln!("whole {whole:?}; revoked run {took:?}, {after_set:?} after the store; {done} written, {unset} not");
        assert_eq!(result, Err(TaskError::Cancelled));
        assert!(
            done > 0,
            "the kernel was running when revoked (some tiles are complete)"
        );
        assert!(unset > 0, "later work-groups left their tiles unwritten");
        assert!(
            after_set < whole / 4,
            "the revoked kernel stopped {after_set:?} after the store (whole run {whole:?})"
        );
        dev.shutdown();
    }

    #[test]
    fn without_shared_host_memory_the_flag_is_copied_in_before_the_kernel() {
        let dev = device();
        dev.shared.host_flags.store(false, Ordering::Relaxed);
        assert!(!dev.polls_revocation());
        let mut s = Sgemm::new(&dev, 512);
        s.reset(&dev);
        let (result, _, _) = s.run(&dev, None, None);
        result.unwrap();
        // Not revoked: exact.
        s.reset(&dev);
        let (result, _, _) = s.run(&dev, Some(Arc::new(AtomicBool::new(false))), None);
        assert_eq!(result, Ok(()));
        assert_eq!(s.written(&dev), (s.n * s.n, 0));
        // Revoked while it waits behind another command of its queue: it starts, finds the
        // copied flag set, and every work-group returns.
        s.reset(&dev);
        let (tx, rx) = mpsc::channel();
        let flag = Arc::new(AtomicBool::new(false));
        let mut blocker = Sgemm::new(&dev, 768);
        blocker.reset(&dev);
        dev.submit(0, job(Vec::new(), (blocker.work)(), None, &tx));
        dev.submit(0, job(Vec::new(), (s.work)(), Some(flag.clone()), &tx));
        // Set the flag once the lane has enqueued the job (so the lane's own check before it
        // starts a job cannot be what cancels it), while the blocker still runs.
        while dev.status().lanes[0].queued > 0 {
            std::thread::yield_now();
        }
        assert!(rx.try_recv().is_err(), "the blocker still runs");
        flag.store(true, Ordering::Release);
        assert_eq!(rx.recv().unwrap().0, Ok(()), "the blocker completes");
        assert_eq!(rx.recv().unwrap().0, Err(TaskError::Cancelled));
        assert_eq!(
            s.written(&dev),
            (0, s.n * s.n),
            "no work-group of the revoked kernel ran"
        );
        dev.shutdown();
    }
}
