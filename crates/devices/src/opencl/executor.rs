//! A lane's executor on an OpenCL device: turns each job into commands on the lane's in-order
//! queue (transfers, host work after a queue drain, a kernel launch or a marker) and hands the job
//! to the completion callbacks, without waiting for the device.
//!
//! Owns the lane's queue, its kernel objects and its device copy of the revocation flag. It must
//! not finish a job whose commands it enqueued (the completion callback does, once they are
//! done), and must not let a command beyond the device's limits reach the runtime.

use std::collections::HashMap;
use std::ffi::c_void;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::Instant;

use agora_kernels::OpenClImpl;
use agora_protocol::{ParamKind, ScalarType, TaskError};
use opencl3::command_queue::CommandQueue;
use opencl3::event::Event;
use opencl3::kernel::Kernel;
use opencl3::memory::{Buffer, ClMem, CL_MEM_READ_ONLY, CL_MEM_USE_HOST_PTR};
use opencl3::types::{cl_event, cl_mem, CL_NON_BLOCKING};

use super::buffer::{self, as_cl, ClBuffer};
use super::completion::{self, Pending};
use super::device::Shared;
use super::programs::{self, Convention};
use super::{cl_error, limits};
use crate::lane::{Executor, JobEnd};
use crate::{Transfer, Work};

/// A lane's executor: enqueues each job's commands on the lane's in-order queue.
pub(super) struct ClExecutor {
    pub(super) shared: Arc<Shared>,
    pub(super) queue: CommandQueue,
    /// This lane's device copy of the revocation flag, for devices whose running kernels cannot
    /// see host memory: written from the job's flag just before each revocable kernel (the
    /// in-order queue never runs two of this lane's kernels at once, so one suffices).
    pub(super) lane_flag: Buffer<u8>,
    /// Kernel objects of this lane, with their trailing parameters, by program and entry point
    /// (two levels, so a launch looks its kernel up without building a key).
    pub(super) kernels: HashMap<String, HashMap<String, (Kernel, Convention)>>,
    /// Whether the job being started had to build a kernel object (its time is not typical).
    pub(super) built: bool,
    /// When this lane's last job finished (see `completion::Pending::lane_finished`).
    pub(super) lane_finished: Arc<std::sync::Mutex<Option<std::time::Instant>>>,
}

// SAFETY: the executor moves into its lane thread once and is used only there; Kernel is Send.
unsafe impl Send for ClExecutor {}

impl ClExecutor {
    pub(super) fn kernel(&mut self, imp: &OpenClImpl, params: usize) -> Result<&(Kernel, Convention), TaskError> {
        let known = self
            .kernels
            .get(&*imp.program)
            .is_some_and(|entries| entries.contains_key(&*imp.entry));
        if !known {
            self.built = true;
            let shared = &self.shared;
            let program = shared.programs.get(&shared.context, &shared.name, imp)?;
            // The kernel's first launch on this lane (most often its first on the device): the
            // runtime may compile it now, which needs descriptors (see `room_to_compile`).
            shared.programs.room_to_compile(&shared.name, imp)?;
            let object = programs::kernel_object(&program, &shared.name, imp, params)?;
            self.kernels
                .entry(imp.program.to_string())
                .or_default()
                .insert(imp.entry.to_string(), object);
        }
        Ok(&self.kernels[&*imp.program][&*imp.entry])
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
        self.zero_fresh_buffers(transfers, work)?;
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
                    // The in-order queue completes it before any later command: the job's last
                    // copy marks when its copies are done (a write kept no event here once, so
                    // a job that only wrote to the device counted its copies as done when
                    // enqueued, and its kernel's time included them).
                    if let Some(previous) = last_transfer.replace(event) {
                        drop(Event::new(previous));
                    }
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
            Some(event) => completion::mark_when_complete(&Event::new(event), transfers_marker),
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

    /// Makes the job's commands see each of this device's buffers it names zeroed, never the
    /// bytes of a previous allocation of that memory (see `buffer`): zeroings are enqueued here
    /// ahead of the job's commands, and a barrier waits for those other queues enqueued.
    fn zero_fresh_buffers(&self, transfers: &[Transfer], work: &Work) -> Result<(), TaskError> {
        let queue = self.queue.get();
        let mut waits = Vec::new();
        fn own<'a>(buffer: &'a dyn crate::DeviceBuffer, shared: &Arc<Shared>) -> Option<&'a ClBuffer> {
            as_cl(buffer).ok().filter(|b| Arc::ptr_eq(&b.shared, shared))
        }
        for transfer in transfers {
            let buffer = match transfer {
                Transfer::ToDevice { to, .. } => to,
                Transfer::ToHost { from, .. } => from,
            };
            if let Some(buffer) = own(buffer.as_ref(), &self.shared) {
                buffer.zeroed_before(queue, &mut waits)?;
            }
        }
        if let Work::Launch { device_args, .. } = work {
            for buffer in device_args.iter().flatten() {
                if let Some(buffer) = own(buffer.as_ref(), &self.shared) {
                    buffer.zeroed_before(queue, &mut waits)?;
                }
            }
        }
        buffer::wait_for(queue, &waits)
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
        let imp = kernel.opencl.as_ref().ok_or(TaskError::KernelFault)?;
        // A kernel that requires a work-group of several dimensions (sgemm's 16 × 16 tiles) is
        // enqueued in as many, whatever the launch says: a range (m) is the range (m, 1), but
        // OpenCL refuses a 1-D enqueue of such a kernel (CL_INVALID_WORK_GROUP_SIZE).
        let dims = &(*dims).max(limits::required_dims(imp.local));
        // A row slice runs rows `first..end` of dimension 0, as one command whose global work
        // offset is `first`.
        let std::ops::Range { start: first, end } = crate::rows_to_run(range[0], rows.as_ref());
        if end <= first {
            // An empty slice (OpenCL 1.2 refuses a zero global size): nothing to run.
            return self.marker().map(Started::command);
        }
        let queue = self.queue.get();
        let device_name = self.shared.name.clone();
        let limits = self.shared.limits;
        let convention = self.kernel(imp, kernel.params.len())?.1;
        let (flag, flag_buffer) = match convention {
            Convention::Revocable => {
                let (mem, buffer) = self.flag_argument(revoke)?;
                (Some(mem), buffer)
            }
            _ => (None, None),
        };
        let (cl_kernel, _) = self.kernel(imp, kernel.params.len())?;
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
                tracing::error!(device = %device_name, kernel = %kernel.name, arg = index, error = %e, "setting a kernel argument failed");
                cl_error(e.0)
            })?;
        }
        let mut global = [1usize; 3];
        for d in 0..*dims {
            global[d] = range[d] as usize;
        }
        global[0] = (end - first) as usize;
        let offset = [first as usize, 0, 0];
        let local = limits::work_group(&global[..*dims], imp.local, guarded);
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
            tracing::error!(device = %device_name, kernel = %kernel.name, items, groups, "a command beyond the device's limits reached the device; refused");
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
            tracing::error!(device = %device_name, kernel = %kernel.name, error = e, "OpenCL launch failed");
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
    /// Only a job that enqueues and returns: not host work (it waits for the queue to drain),
    /// not a read from another device, not the first use of a buffer (its allocation), not the
    /// first launch of a kernel on this lane (it creates the kernel object, perhaps after a
    /// program build of up to a second). Any of these, started on a device host's message loop,
    /// held every request behind it, among them the daemon dispatcher's synchronous allocations
    /// (measured: a 35–47 ms dispatcher stall in `agora bench stall --attack-device opencl`).
    fn starts_at_once(&self, transfers: &[Transfer], work: &Work) -> bool {
        // A read from another device's buffer is synchronous (see `start`).
        let from_elsewhere = transfers.iter().any(|t| match t {
            Transfer::ToHost { from, .. } => !as_cl(from.as_ref()).is_ok_and(|b| Arc::ptr_eq(&b.shared, &self.shared)),
            Transfer::ToDevice { .. } => false,
        });
        // A buffer's first command allocates its memory in the enqueuing thread (PoCL): for a
        // large buffer, milliseconds of page faults.
        let unused = |buffer: &Arc<dyn crate::DeviceBuffer>| as_cl(buffer.as_ref()).is_ok_and(|b| b.unused());
        let first_use = transfers.iter().any(|t| match t {
            Transfer::ToDevice { to, .. } => unused(to),
            Transfer::ToHost { .. } => false,
        }) || matches!(work, Work::Launch { device_args, .. } if device_args.iter().flatten().any(unused));
        !from_elsewhere
            && !first_use
            && match work {
                Work::Fill { .. } | Work::Copy { .. } => false,
                Work::Launch { kernel, .. } => kernel.opencl.as_ref().is_some_and(|imp| {
                    self.kernels
                        .get(&*imp.program)
                        .is_some_and(|entries| entries.contains_key(&*imp.entry))
                }),
                Work::Nothing => true,
            }
    }

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
        let pending = Pending {
            end,
            event,
            polled,
            _flag: flag,
            _transfers: transfers,
            _work: work,
            lane_finished: self.lane_finished.clone(),
        };
        if completion::finish_on_completion(pending) {
            // Start the commands now rather than at the next flush.
            let _ = self.queue.flush();
        }
    }
}
