//! A lane's executor on a CUDA device: turns each job into commands on the lane's stream
//! (transfers straight from and into the tenant's segment, host work after the stream drains, a
//! kernel launch) and finishes the job from the stream's callback, without a thread waiting per
//! command.
//!
//! Owns the lane's stream, its function cache and its device copy of the revocation flag. It must
//! not finish a job whose commands it enqueued before they are done (the stream callback does),
//! and must not let a launch beyond the device's grid limits reach the driver.

use std::collections::HashMap;
use std::ffi::c_void;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::Instant;

use agora_kernels::ArgValue;
use agora_protocol::{ParamKind, TaskError};
use cudarc::driver::sys::{self, CUdeviceptr, CUevent, CUfunction, CUresult, CUstream};

use super::buffer::as_cuda;
use super::completion::{Completions, Mirror, Pending, Watchdog};
use super::device::{launch_shape, Shared, IN_CALLBACK, MAX_GRID_X, MAX_GRID_YZ};
use super::programs::{Convention, KernelCode};
use crate::lane::{Executor, JobEnd};
use crate::{Transfer, Work};

/// A lane's executor: enqueues each job's commands on the lane's stream.
pub(super) struct CudaExecutor {
    pub(super) shared: Arc<Shared>,
    /// The stream of the job being started: one of `streams`.
    pub(super) stream: CUstream,
    /// The lane's two streams: batch work at the device's lowest stream priority, urgent work
    /// (latency-class, deadlines) at its highest, so the GPU's block scheduler starts an urgent
    /// kernel's blocks before pending blocks of other lanes' batch kernels. They are one lane:
    /// a job that changes stream first waits for the other stream's last command (`switch`), so
    /// the lane's jobs still run, and complete, in the order it started them.
    pub(super) streams: [CUstream; 2],
    /// Recorded on the stream a lane leaves, waited for on the one it takes.
    pub(super) switch: CUevent,
    /// This lane's device copy of a revocable launch's flag, written just before the kernel
    /// (where the lane has no mapped flag).
    pub(super) lane_flag: CUdeviceptr,
    /// This lane's revocation flag in mapped host memory, which a running kernel reads: the
    /// completion thread copies a revocable job's flag into it while the job runs, so the
    /// job's kernel stops at its next work-group. `None`: copy the flag in before the kernel.
    pub(super) mapped_flag: Option<MappedFlag>,
    /// Set by `launch` for the job being started: the job's flag and where the completion thread
    /// mirrors it.
    pub(super) mirror: Option<Mirror>,
    /// This lane's stop word for tenants' fenced kernels (a `u32` in mapped host memory; their
    /// loops poll it), made at the first such launch; `None` until then.
    pub(super) stop_word: Option<StopWord>,
    /// The number of the lane's last fenced launch (never 0, so a zeroed word stops nothing).
    pub(super) launches: u32,
    /// Set by `launch` for a fenced job being started: its per-launch limit.
    pub(super) watchdog: Option<Watchdog>,
    /// Functions by program and entry point (two levels: a lookup builds no key).
    /// By program and entry: the function, its convention, whether it is fenced.
    pub(super) functions: HashMap<String, HashMap<String, (CUfunction, Convention, bool)>>,
    /// Whether the context is current on the lane's thread.
    pub(super) bound: bool,
    /// This lane's index among the device's.
    pub(super) lane: usize,
    /// The device's completion thread's queues; `None`: jobs finish from stream callbacks.
    pub(super) completions: Option<Arc<Completions>>,
}

// SAFETY: the executor moves into its lane thread once and is used only there; the handles are
// process-wide driver handles.
unsafe impl Send for CudaExecutor {}

/// A lane's revocation flag in page-locked host memory mapped into the GPU's address space.
pub(super) struct MappedFlag {
    /// Where the host writes it.
    pub(super) host: *mut u8,
    /// Where kernels read it.
    pub(super) device: CUdeviceptr,
}

/// A lane's stop word: a `u32` the kernels read and the host writes while they run.
pub(super) struct StopWord {
    /// Where the host writes it (`None`: device memory the host never writes, where mapped host
    /// memory was refused; then no launch can be stopped).
    pub(super) host: Option<*mut u32>,
    /// Where kernels read it.
    pub(super) device: CUdeviceptr,
}

/// A started job waiting for its stream callback (`AGORA_CUDA_COMPLETIONS=callbacks`).
struct Called {
    pending: Pending,
    shared: Arc<Shared>,
}

impl CudaExecutor {
    fn function(
        &mut self,
        code: KernelCode<'_>,
        declared: usize,
        built: &mut bool,
    ) -> Result<(CUfunction, Convention, bool), TaskError> {
        if let Some(found) = self.functions.get(code.program()).and_then(|m| m.get(code.entry())) {
            return Ok(*found);
        }
        let found = self
            .shared
            .programs
            .function(&self.shared.name, self.shared.arch, code, declared)
            .map_err(|message| {
                tracing::error!(device = %self.shared.name, "{message}");
                TaskError::DeviceFailed(i64::from(CUresult::CUDA_ERROR_INVALID_PTX as u32))
            })?;
        *built |= found.built;
        self.functions.entry(code.program().to_string()).or_default().insert(
            code.entry().to_string(),
            (found.function, found.convention, found.fenced),
        );
        Ok((found.function, found.convention, found.fenced))
    }

    /// The stop word's device address and the number of the fenced launch being started, with
    /// its watchdog set up for `run` (where the per-launch limit is on and the word is mapped).
    fn next_fenced_launch(&mut self) -> Result<(u64, u32), TaskError> {
        if self.stop_word.is_none() {
            self.stop_word = Some(match super::device::mapped_word() {
                Some(mapped) => StopWord {
                    host: Some(mapped.host.cast::<u32>()),
                    device: mapped.device,
                },
                None => {
                    tracing::warn!(device = %self.shared.name, lane = self.lane, "no mapped host memory for the lane's stop word: tenants' kernels here run past the per-launch limit");
                    // SAFETY: a 4-byte allocation in the current context, zeroed, freed by `stop`.
                    let device = unsafe {
                        let p = cudarc::driver::result::malloc_sync(4).map_err(|e| self.shared.error(e.0))?;
                        cudarc::driver::result::memset_d8_sync(p, 0, 4).map_err(|e| self.shared.error(e.0))?;
                        p
                    };
                    StopWord { host: None, device }
                }
            });
        }
        let word = self.stop_word.as_ref().expect("made above");
        self.launches = self.launches.wrapping_add(1).max(1);
        self.watchdog = match (word.host, self.shared.tenant_launch_limit) {
            (Some(stop), Some(limit)) => Some(Watchdog {
                stop,
                launch: self.launches,
                limit,
                running_since: None,
                fired: false,
            }),
            _ => None,
        };
        Ok((word.device, self.launches))
    }

    fn check(&self, result: CUresult) -> Result<(), TaskError> {
        match result {
            CUresult::CUDA_SUCCESS => Ok(()),
            code => Err(self.shared.error(code)),
        }
    }

    /// Makes `streams[urgent]` the lane's stream, ordered after everything the lane enqueued on
    /// the other one.
    fn take_stream(&mut self, urgent: bool) -> Result<(), TaskError> {
        let next = self.streams[usize::from(urgent)];
        if next == self.stream {
            return Ok(());
        }
        // SAFETY: a live event and two live streams of the current context; the wait captures
        // the event as recorded now, so reusing the event for the next switch is safe.
        self.check(unsafe { sys::cuEventRecord(self.switch, self.stream) })?;
        // SAFETY: as above.
        self.check(unsafe { sys::cuStreamWaitEvent(next, self.switch, 0) })?;
        self.stream = next;
        Ok(())
    }

    /// Enqueues a job's commands on the lane's stream.
    fn start(
        &mut self,
        transfers: &[Transfer],
        work: &Work,
        transfers_marker: &Arc<OnceLock<Instant>>,
        revoke: Option<&Arc<AtomicBool>>,
        built: &mut bool,
    ) -> Result<(), TaskError> {
        for transfer in transfers {
            match transfer {
                Transfer::ToDevice { host, len, to } => {
                    let to = as_cuda(to.as_ref())?;
                    if *len as u64 > to.len {
                        return Err(TaskError::KernelFault);
                    }
                    if *len as u64 == to.len {
                        to.written_whole();
                    } else {
                        self.check(to.zero_if_unwritten(self.stream))?;
                    }
                    // SAFETY: `host` is valid for `len` bytes until the job finishes (after this
                    // copy); the device buffer holds at least `len` bytes (checked). From a
                    // registered segment this is DMA with no staging copy.
                    self.check(unsafe {
                        sys::cuMemcpyHtoDAsync_v2(to.ptr, *host as *const c_void, *len, self.stream)
                    })?;
                }
                Transfer::ToHost {
                    from,
                    device,
                    host,
                    len,
                } => match as_cuda(from.as_ref()) {
                    Ok(own) if Arc::ptr_eq(&own.shared, &self.shared) => {
                        if *len as u64 > own.len {
                            return Err(TaskError::KernelFault);
                        }
                        // SAFETY: as above, in the other direction; ordered after this lane's
                        // earlier commands by the stream.
                        self.check(unsafe {
                            sys::cuMemcpyDtoHAsync_v2(*host as *mut c_void, own.ptr, *len, self.stream)
                        })?;
                    }
                    // Another device's buffer: read it synchronously through that device.
                    // SAFETY: `host` is valid for `len` bytes until the job finishes.
                    _ => unsafe { device.read(from.as_ref(), *host, *len)? },
                },
            }
        }
        if !transfers.is_empty() {
            let marker = Arc::into_raw(transfers_marker.clone()) as *mut c_void;
            // SAFETY: the callback takes back the reference leaked here, exactly once.
            let added = unsafe { sys::cuStreamAddCallback(self.stream, Some(on_transfers_done), marker, 0) };
            if added != CUresult::CUDA_SUCCESS {
                // SAFETY: not registered, so the reference is still ours.
                drop(unsafe { Arc::from_raw(marker as *const OnceLock<Instant>) });
                return Err(self.shared.error(added));
            }
        }
        match work {
            Work::Fill { .. } | Work::Copy { .. } => {
                // Host-memory work of a queue bound to this lane: it may read what earlier
                // commands wrote to the host, so wait for them first.
                // SAFETY: a live stream.
                self.check(unsafe { sys::cuStreamSynchronize(self.stream) })?;
                crate::run_host_work(work).unwrap_or(Err(TaskError::KernelFault))
            }
            Work::Launch { .. } => self.launch(work, revoke, built),
            Work::Nothing => Ok(()),
        }
    }

    fn launch(&mut self, work: &Work, revoke: Option<&Arc<AtomicBool>>, built: &mut bool) -> Result<(), TaskError> {
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
        let code = KernelCode::of(kernel).ok_or(TaskError::KernelFault)?;
        let std::ops::Range { start: first, end } = crate::rows_to_run(range[0], rows.as_ref());
        if end <= first {
            return Ok(()); // An empty slice: nothing to run.
        }
        let (function, convention, fenced) = self.function(code, kernel.params.len(), built)?;
        // Argument values, then pointers to them (cuLaunchKernel copies each parameter's size
        // from its pointer: 4-byte scalars are the low bytes of their u64, little-endian).
        let params = kernel.params.len();
        let mut values = [0u64; agora_protocol::MAX_ARGS + 5];
        for (index, param) in kernel.params.iter().enumerate() {
            values[index] = match (param.kind, &args[index]) {
                (ParamKind::Buffer { .. }, _) => {
                    let buffer = as_cuda(device_args[index].as_deref().ok_or(TaskError::KernelFault)?)?;
                    // A kernel may read what it was given, even a buffer it only writes (or a
                    // fenced one anywhere in its partition): never bytes left by another buffer.
                    self.check(buffer.zero_if_unwritten(self.stream))?;
                    buffer.ptr
                }
                (ParamKind::Scalar(_), ArgValue::Scalar(bits)) => *bits,
                _ => return Err(TaskError::KernelFault),
            };
        }
        let mut count = params;
        let mut extent = [1u64; 3];
        extent[..*dims].copy_from_slice(&range[..*dims]);
        extent[0] = end - first;
        if convention == Convention::Guarded {
            values[count] = end; // range0: the slice's end, so rounded-up threads stop there.
            values[count + 1] = range[1];
            values[count + 2] = range[2];
            values[count + 3] = match (revoke, &self.mapped_flag) {
                (Some(flag), Some(mapped)) => {
                    // SAFETY: the lane's mapped byte, which only this lane thread and the
                    // completion thread write (the latter only while this job is in flight: a
                    // revocable job runs alone on its lane).
                    unsafe { std::ptr::write_volatile(mapped.host, u8::from(flag.load(Ordering::Acquire))) };
                    self.mirror = Some(Mirror {
                        flag: flag.clone(),
                        host: mapped.host,
                    });
                    mapped.device
                }
                (Some(flag), None) => {
                    // The flag as it is now, copied just before the kernel (the stream runs it
                    // after the previous command): a launch revoked while it waits stops at once.
                    // SAFETY: one byte of the job's flag, alive until the job completes.
                    self.check(unsafe {
                        sys::cuMemcpyHtoDAsync_v2(self.lane_flag, flag.as_ptr() as *const c_void, 1, self.stream)
                    })?;
                    self.lane_flag
                }
                (None, _) => self.shared.zero_flag,
            };
            values[count + 4] = first;
            count += 5;
        }
        if fenced {
            // A tenant's fenced kernel: its partition's base and mask, after its own parameters.
            let buffers = kernel
                .params
                .iter()
                .enumerate()
                .filter(|(_, p)| matches!(p.kind, ParamKind::Buffer { .. }))
                .map(|(index, _)| as_cuda(device_args[index].as_deref().ok_or(TaskError::KernelFault)?))
                .collect::<Result<Vec<_>, _>>()?;
            let (base, mask) = self.shared.fence_for(&buffers)?;
            let (stop, launch) = self.next_fenced_launch()?;
            values[count] = base;
            values[count + 1] = mask;
            values[count + 2] = stop;
            values[count + 3] = u64::from(launch);
            count += 4;
        }
        let (grid, block) = launch_shape(extent, *dims, code.local(), convention);
        if grid[0] > MAX_GRID_X || grid[1] > MAX_GRID_YZ || grid[2] > MAX_GRID_YZ {
            tracing::error!(device = %self.shared.name, kernel = %kernel.name, ?grid, "a launch beyond the grid limits reached the device; refused");
            return Err(TaskError::KernelFault);
        }
        let mut pointers = [std::ptr::null_mut::<c_void>(); agora_protocol::MAX_ARGS + 5];
        for (pointer, value) in pointers.iter_mut().zip(values.iter_mut()).take(count) {
            *pointer = value as *mut u64 as *mut c_void;
        }
        // SAFETY: `function` is a live function of this context whose parameters are the
        // kernel's declared ones (checked by the daemon) plus the convention's trailing ones, in
        // that order; `pointers` points into `values`, alive during the call (the driver copies
        // the parameters before returning); the grid is within the device's limits (checked).
        let launched = unsafe {
            sys::cuLaunchKernel(
                function,
                grid[0] as u32,
                grid[1] as u32,
                grid[2] as u32,
                block[0] as u32,
                block[1] as u32,
                block[2] as u32,
                0,
                self.stream,
                pointers.as_mut_ptr(),
                std::ptr::null_mut(),
            )
        };
        if launched != CUresult::CUDA_SUCCESS {
            tracing::error!(device = %self.shared.name, kernel = %kernel.name, ?launched, "CUDA launch failed");
        }
        self.check(launched)
    }
}

impl Executor for CudaExecutor {
    /// Only a job that enqueues and returns (see the OpenCL executor's): not before the lane's
    /// first bind, not host work (it synchronises the stream), not a read from another device,
    /// not the first launch of a function on this lane (a module load, perhaps an NVRTC build).
    fn starts_at_once(&self, transfers: &[Transfer], work: &Work) -> bool {
        let from_elsewhere = transfers.iter().any(|t| match t {
            Transfer::ToHost { from, .. } => {
                !matches!(as_cuda(from.as_ref()), Ok(own) if Arc::ptr_eq(&own.shared, &self.shared))
            }
            Transfer::ToDevice { .. } => false,
        });
        self.bound
            && !from_elsewhere
            && match work {
                Work::Fill { .. } | Work::Copy { .. } => false,
                Work::Launch { kernel, .. } => KernelCode::of(kernel).is_some_and(|code| {
                    self.functions
                        .get(code.program())
                        .is_some_and(|entries| entries.contains_key(code.entry()))
                }),
                Work::Nothing => true,
            }
    }

    fn run(&mut self, transfers: Vec<Transfer>, work: Work, mut end: JobEnd) {
        if self.shared.failed.load(Ordering::Acquire) {
            end.finish(Err(TaskError::DeviceLost));
            return;
        }
        if !self.bound {
            if let Err(e) = self.shared.bind() {
                end.finish(Err(e));
                return;
            }
            self.bound = true;
        }
        self.shared.free_deferred();
        let marker = end.transfers_marker();
        self.mirror = None;
        self.watchdog = None;
        let mut built = false;
        let started = self
            .take_stream(end.urgent())
            .and_then(|()| self.start(&transfers, &work, &marker, end.revoke_flag(), &mut built));
        if built {
            end.mark_cold();
        }
        if let Err(e) = started {
            // Commands enqueued before the failure may still use the job's memory.
            // SAFETY: a live stream.
            let _ = unsafe { sys::cuStreamSynchronize(self.stream) };
            drop(work);
            drop(transfers);
            end.finish(Err(e));
            return;
        }
        let pending = Pending {
            end,
            transfers,
            work,
            mirror: self.mirror.take(),
            watchdog: self.watchdog.take(),
        };
        if let Some(completions) = &self.completions {
            if let Err(failed) = completions.track(&self.shared, self.lane, self.stream, pending) {
                let (pending, error) = *failed;
                // SAFETY: a live stream.
                let _ = unsafe { sys::cuStreamSynchronize(self.stream) };
                pending.finish(Err(error));
            }
            return;
        }
        let called = Box::into_raw(Box::new(Called {
            pending,
            shared: self.shared.clone(),
        }));
        // SAFETY: the callback takes back the box leaked here, exactly once.
        let added = unsafe { sys::cuStreamAddCallback(self.stream, Some(on_complete), called as *mut c_void, 0) };
        if added != CUresult::CUDA_SUCCESS {
            // SAFETY: not registered, so the box is still ours alone.
            let called = unsafe { Box::from_raw(called) };
            // SAFETY: a live stream.
            let _ = unsafe { sys::cuStreamSynchronize(self.stream) };
            let error = self.shared.error(added);
            called.pending.finish(Err(error));
        }
    }

    fn stop(&mut self) {
        // SAFETY: the lane stops: nothing more is enqueued on its streams (the current one last:
        // it waits for the other), and nothing waits for the event any more.
        unsafe {
            for stream in self.streams {
                let _ = sys::cuStreamSynchronize(stream);
                let _ = sys::cuStreamDestroy_v2(stream);
            }
            let _ = sys::cuEventDestroy_v2(self.switch);
            let _ = sys::cuMemFree_v2(self.lane_flag);
            if let Some(mapped) = self.mapped_flag.take() {
                let _ = sys::cuMemFreeHost(mapped.host as *mut c_void);
            }
            match self.stop_word.take() {
                Some(StopWord { host: Some(host), .. }) => {
                    let _ = sys::cuMemFreeHost(host as *mut c_void);
                }
                Some(StopWord { host: None, device }) => {
                    let _ = sys::cuMemFree_v2(device);
                }
                None => {}
            }
        }
    }
}

/// The stream callback after a job's last command (`AGORA_CUDA_COMPLETIONS=callbacks`): finishes
/// the job. CUDA calls are not allowed
/// here, so buffers the job lets go are freed later (`Shared::free`).
unsafe extern "C" fn on_complete(_stream: CUstream, status: CUresult, user: *mut c_void) {
    // SAFETY: `user` is the `Box<Called>` leaked by `run`; the driver calls this once.
    let called = unsafe { Box::from_raw(user as *mut Called) };
    let _ = std::panic::catch_unwind(std::panic::AssertUnwindSafe(move || {
        IN_CALLBACK.with(|c| c.set(true));
        let Called { pending, shared } = *called;
        let result = match status {
            CUresult::CUDA_SUCCESS => Ok(()),
            code => Err(shared.error(code)),
        };
        pending.finish(result);
        IN_CALLBACK.with(|c| c.set(false));
    }));
}

/// The stream callback after a job's transfers: records when they ended.
unsafe extern "C" fn on_transfers_done(_stream: CUstream, _status: CUresult, user: *mut c_void) {
    // SAFETY: `user` is an `Arc<OnceLock<Instant>>` reference leaked for this callback.
    let marker = unsafe { Arc::from_raw(user as *const OnceLock<Instant>) };
    let _ = marker.set(Instant::now());
}
