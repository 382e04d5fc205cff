//! Native baselines: the same workloads with no Agora in the path.
//!
//! * [`run_cpu`]: calls each kernel's CPU implementation directly, in this process, on one thread
//!   (an Agora CPU lane also runs a task on one thread by default) — what an application linking
//!   the kernels would do.
//! * [`run_opencl`]: the same `.cl` sources through OpenCL directly (opencl3): one context and
//!   in-order queue on the first device, `clEnqueueWriteBuffer`/`ReadBuffer` for transfers.

use std::time::Instant;

use agora_kernels::{ArgValue, KernelCall, KernelRef};
use agora_protocol::MAX_ARGS;

use crate::workload::{AppReport, Step, WArg, Workload};

/// Host memory aligned like the daemon's heap (64 bytes), as the kernels expect.
#[derive(Clone, Copy)]
#[repr(C, align(64))]
struct Line([u8; 64]);

fn aligned(bytes: &[u8]) -> Vec<Line> {
    let mut v = vec![Line([0; 64]); bytes.len().div_ceil(64).max(1)];
    let dst: &mut [u8] = bytemuck_bytes(&mut v);
    dst[..bytes.len()].copy_from_slice(bytes);
    v
}

fn bytemuck_bytes(lines: &mut [Line]) -> &mut [u8] {
    // SAFETY: Line is 64 plain bytes with no padding; the slice covers exactly the lines.
    unsafe { std::slice::from_raw_parts_mut(lines.as_mut_ptr() as *mut u8, lines.len() * 64) }
}

fn scalar_bits(a: WArg) -> u64 {
    match a {
        WArg::F32(v) => u64::from(v.to_bits()),
        WArg::I32(v) => u64::from(v as u32),
        WArg::U32(v) => u64::from(v),
        WArg::U64(v) => v,
        WArg::Buffer(_) => 0,
    }
}

/// Runs `workload` by calling the kernels' CPU implementations directly.
pub fn run_cpu(workload: &Workload) -> Result<AppReport, String> {
    let mut out = workload.buffers.clone();
    run_cpu_with_buffers(workload, &mut out)
}

/// The definition of kernel `name`: the library's, else the first kernel package under the
/// default package paths (`agora_packages::default_paths`), then under the `examples/packages`
/// of the source tree this crate was built from, that defines it (Rodinia's hotspot and
/// pathfinder are packages), so the native baselines run exactly the code the daemon runs.
pub fn kernel_def(name: &str) -> Result<KernelRef, String> {
    if let Some((_, k)) = agora_kernels::find(name) {
        return Ok(KernelRef::Static(k));
    }
    let mut paths = agora_packages::default_paths();
    paths.push(std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../examples/packages"));
    agora_packages::find_kernel(&paths, name)
        .map(|k| KernelRef::Shared(std::sync::Arc::new(k)))
        .ok_or_else(|| {
            format!("no kernel {name} in the library or in a kernel package (AGORA_KERNEL_PATH, examples/packages)")
        })
}

/// [`run_cpu`], leaving the final buffer contents in `out` (one entry per workload buffer).
pub fn run_cpu_with_buffers(workload: &Workload, out: &mut [Vec<u8>]) -> Result<AppReport, String> {
    let mut memory: Vec<Vec<Line>> = workload.buffers.iter().map(|b| aligned(b)).collect();
    let lens: Vec<usize> = workload.buffers.iter().map(Vec::len).collect();
    // Each kernel resolved once (a package's is loaded from disk), before timing starts.
    let mut by_name: std::collections::HashMap<&str, KernelRef> = std::collections::HashMap::new();
    let mut resolved = Vec::new();
    for step in &workload.steps {
        if let Step::Launch { kernel, .. } = step {
            if !by_name.contains_key(kernel) {
                let k = kernel_def(kernel)?;
                if k.cpu.is_none() {
                    return Err(format!("{kernel} has no CPU implementation"));
                }
                by_name.insert(kernel, k);
            }
            resolved.push(by_name[kernel].clone());
        }
    }
    let start = Instant::now();
    let mut next = resolved.iter();
    for step in &workload.steps {
        let Step::Launch { args, range, .. } = step else {
            continue;
        };
        let cpu = next.next().expect("one resolved kernel per launch");
        let mut values = [ArgValue::None; MAX_ARGS];
        for (i, a) in args.iter().enumerate() {
            values[i] = match *a {
                WArg::Buffer(b) => ArgValue::Buffer {
                    ptr: memory[b].as_mut_ptr() as *mut u8,
                    len: lens[b] as u64,
                },
                other => ArgValue::Scalar(scalar_bits(other)),
            };
        }
        // SAFETY: buffers are live, 64-byte aligned, at least `len` bytes; the workloads pass
        // each written buffer once (checked by the daemon for the Agora runs of the same steps).
        let call = unsafe { KernelCall::new(range, &values[..args.len()]) };
        cpu.run_cpu(&call, 0..range[0]).map_err(|e| e.to_string())?;
    }
    let seconds = start.elapsed().as_secs_f64();
    let views: Vec<&[u8]> = memory
        .iter_mut()
        .zip(&lens)
        .map(|(m, len)| &bytemuck_bytes(m)[..*len])
        .collect();
    for (o, v) in out.iter_mut().zip(&views) {
        *o = v.to_vec();
    }
    Ok(workload.report(seconds, &views))
}

#[cfg(feature = "opencl")]
pub use opencl::{run_opencl, transfer_round_trip, NativeArg, NativeOpenCl, TransferBuffer};

#[cfg(feature = "opencl")]
mod opencl {
    use std::collections::HashMap;

    use agora_kernels::KernelRef;
    use std::time::Instant;

    use opencl3::command_queue::CommandQueue;
    use opencl3::context::Context;
    use opencl3::device::{Device, CL_DEVICE_TYPE_ALL};
    use opencl3::kernel::Kernel;
    use opencl3::memory::{Buffer, ClMem, CL_MEM_READ_WRITE};
    use opencl3::program::Program;
    use opencl3::types::{CL_BLOCKING, CL_NON_BLOCKING};

    use super::{scalar_bits, AppReport, Step, WArg, Workload};
    use agora_protocol::{ParamKind, ScalarType};

    /// An OpenCL context and queue on the first device found, with a program cache.
    pub struct NativeOpenCl {
        context: Context,
        queue: CommandQueue,
        programs: HashMap<String, Program>,
        /// A one-byte zero: the revocation flag argument of revocable kernels (never set here).
        zero_flag: Buffer<u8>,
        /// Device description.
        pub device: String,
    }

    fn err(e: impl std::fmt::Display) -> String {
        e.to_string()
    }

    impl NativeOpenCl {
        /// Opens the first OpenCL device.
        pub fn open() -> Result<Self, String> {
            let platforms = opencl3::platform::get_platforms().map_err(err)?;
            let platform = platforms.first().ok_or("no OpenCL platform")?;
            let id = *platform
                .get_devices(CL_DEVICE_TYPE_ALL)
                .map_err(err)?
                .first()
                .ok_or("no OpenCL device")?;
            let device = Device::new(id);
            let name = device.name().map_err(err)?;
            let context = Context::from_device(&device).map_err(err)?;
            #[allow(deprecated)] // clCreateCommandQueue: the OpenCL 1.2 call every platform has.
            let queue = CommandQueue::create_default(&context, 0).map_err(err)?;
            let mut zero = [0u8];
            // SAFETY: a one-byte buffer initialised from `zero`, copied at creation.
            let zero_flag = unsafe {
                Buffer::<u8>::create(
                    &context,
                    CL_MEM_READ_WRITE | opencl3::memory::CL_MEM_COPY_HOST_PTR,
                    1,
                    zero.as_mut_ptr() as *mut std::ffi::c_void,
                )
            }
            .map_err(err)?;
            Ok(NativeOpenCl {
                context,
                queue,
                programs: HashMap::new(),
                zero_flag,
                device: name,
            })
        }

        fn kernel(&mut self, name: &str) -> Result<(Kernel, KernelRef, bool), String> {
            let def = super::kernel_def(name)?;
            let imp = def
                .opencl
                .as_ref()
                .ok_or_else(|| format!("{name} has no OpenCL implementation"))?;
            if !self.programs.contains_key(&*imp.program) {
                let p = Program::create_and_build_from_source(&self.context, &imp.source, "-cl-std=CL1.2")?;
                self.programs.insert(imp.program.to_string(), p);
            }
            let k = Kernel::create(&self.programs[&*imp.program], &imp.entry).map_err(err)?;
            // The library's calling conventions: the signature's parameters, then for guarded
            // kernels the three range extents, then for revocable ones the revocation flag.
            let trailing = (k.num_args().map_err(err)? as usize).saturating_sub(def.params.len());
            if trailing == 4 {
                // SAFETY: the parameter after the extents is a `__global` flag (revocable
                // convention); the zero flag lives as long as `self`, which outlives every launch.
                unsafe { k.set_arg((def.params.len() + 3) as u32, &self.zero_flag.get()) }.map_err(err)?;
            }
            Ok((k, def, trailing >= 3))
        }
    }

    /// Runs `workload` directly on OpenCL (kernels created before timing, as an application would).
    pub fn run_opencl(cl: &mut NativeOpenCl, workload: &Workload) -> Result<AppReport, String> {
        let mut kernels: HashMap<&'static str, (Kernel, KernelRef, bool)> = HashMap::new();
        for step in &workload.steps {
            if let Step::Launch { kernel, .. } = step {
                if !kernels.contains_key(kernel) {
                    kernels.insert(kernel, cl.kernel(kernel)?);
                }
            }
        }
        let mut host: Vec<Vec<u8>> = workload.buffers.clone();
        let mut device: Vec<Buffer<u8>> = Vec::new();
        for b in &host {
            // SAFETY: a plain device allocation without a host pointer.
            device.push(
                unsafe { Buffer::<u8>::create(&cl.context, CL_MEM_READ_WRITE, b.len().max(1), std::ptr::null_mut()) }
                    .map_err(err)?,
            );
        }
        let start = Instant::now();
        for step in &workload.steps {
            match step {
                Step::SyncTo(b) => {
                    // SAFETY: `host[b]` outlives the blocking write.
                    unsafe {
                        cl.queue
                            .enqueue_write_buffer(&mut device[*b], CL_NON_BLOCKING, 0, &host[*b], &[])
                    }
                    .map_err(err)?;
                }
                Step::SyncFrom(b) => {
                    // SAFETY: `host[b]` outlives the read; the queue is finished before it is used.
                    unsafe {
                        cl.queue
                            .enqueue_read_buffer(&device[*b], CL_NON_BLOCKING, 0, &mut host[*b], &[])
                    }
                    .map_err(err)?;
                }
                Step::Launch { kernel, args, range } => {
                    let (k, def, guarded) = &kernels[kernel];
                    for (i, (a, p)) in args.iter().zip(def.params.iter()).enumerate() {
                        // SAFETY: argument types follow the kernel's signature (see OpenClImpl).
                        unsafe {
                            match (*a, p.kind) {
                                (WArg::Buffer(b), _) => k.set_arg(i as u32, &device[b].get()),
                                (a, ParamKind::Scalar(ScalarType::F32)) => {
                                    k.set_arg(i as u32, &f32::from_bits(scalar_bits(a) as u32))
                                }
                                (a, ParamKind::Scalar(ScalarType::I32 | ScalarType::U32)) => {
                                    k.set_arg(i as u32, &(scalar_bits(a) as u32))
                                }
                                (a, _) => k.set_arg(i as u32, &scalar_bits(a)),
                            }
                        }
                        .map_err(err)?;
                    }
                    let dims = range.len();
                    let mut global = [1usize; 3];
                    for d in 0..dims {
                        global[d] = range[d] as usize;
                    }
                    let mut local = [1usize; 3];
                    if *guarded {
                        let fixed = match dims {
                            1 => [64, 1, 1],
                            2 => [8, 8, 1],
                            _ => [4, 4, 4],
                        };
                        let fixed = def.opencl.as_ref().and_then(|o| o.local).unwrap_or(fixed);
                        for d in 0..3 {
                            let extent = range.get(d).copied().unwrap_or(1);
                            // SAFETY: trailing `const ulong` range parameters (guarded convention).
                            unsafe { k.set_arg((def.params.len() + d) as u32, &extent) }.map_err(err)?;
                        }
                        for d in 0..dims {
                            local[d] = fixed[d];
                            global[d] = global[d].div_ceil(local[d]) * local[d];
                        }
                    } else {
                        for d in 0..dims {
                            let mut l = 64usize;
                            while l > 1 && global[d] % l != 0 {
                                l /= 2;
                            }
                            local[d] = l;
                        }
                    }
                    // SAFETY: all arguments set above; sizes outlive the call.
                    unsafe {
                        cl.queue.enqueue_nd_range_kernel(
                            k.get(),
                            dims as u32,
                            std::ptr::null(),
                            global.as_ptr(),
                            local.as_ptr(),
                            &[],
                        )
                    }
                    .map_err(err)?;
                }
            }
        }
        cl.queue.finish().map_err(err)?;
        let seconds = start.elapsed().as_secs_f64();
        let views: Vec<&[u8]> = host.iter().map(|b| b.as_slice()).collect();
        Ok(workload.report(seconds, &views))
    }

    /// A device buffer for repeated transfer round trips (allocated once, as an application
    /// would, so repetitions do not pay first-touch costs).
    pub struct TransferBuffer {
        buffer: Buffer<u8>,
        fill: Kernel,
    }

    impl NativeOpenCl {
        /// Allocates a device buffer of `bytes` for [`transfer_round_trip`].
        pub fn transfer_buffer(&mut self, bytes: usize) -> Result<TransferBuffer, String> {
            let (fill, _, _) = self.kernel("fill")?;
            // SAFETY: plain device allocation.
            let buffer = unsafe { Buffer::<u8>::create(&self.context, CL_MEM_READ_WRITE, bytes, std::ptr::null_mut()) }
                .map_err(err)?;
            Ok(TransferBuffer { buffer, fill })
        }
    }

    /// Native transfer round trip: write `host` to the device, fill it with a kernel, read it back.
    pub fn transfer_round_trip(
        cl: &mut NativeOpenCl,
        device: &mut TransferBuffer,
        host: &mut [u8],
    ) -> Result<f64, String> {
        let k = &device.fill;
        let n = (host.len() / 4) as u64;
        let start = Instant::now();
        // SAFETY: blocking transfers of a live host slice into a buffer at least as large;
        // kernel arguments match `fill` (guarded convention).
        unsafe {
            cl.queue
                .enqueue_write_buffer(&mut device.buffer, CL_BLOCKING, 0, host, &[])
                .map_err(err)?;
            k.set_arg(0, &1.5f32).map_err(err)?;
            k.set_arg(1, &device.buffer.get()).map_err(err)?;
            for d in 0..3u32 {
                k.set_arg(2 + d, &if d == 0 { n } else { 1u64 }).map_err(err)?;
            }
            let global = [n.div_ceil(64) as usize * 64];
            let local = [64usize];
            cl.queue
                .enqueue_nd_range_kernel(k.get(), 1, std::ptr::null(), global.as_ptr(), local.as_ptr(), &[])
                .map_err(err)?;
            cl.queue
                .enqueue_read_buffer(&device.buffer, CL_BLOCKING, 0, host, &[])
                .map_err(err)?;
        }
        Ok(start.elapsed().as_secs_f64())
    }

    /// An argument of [`NativeOpenCl::time_launches`].
    #[derive(Clone, Copy)]
    pub enum NativeArg<'a> {
        /// A device buffer.
        Buffer(&'a Buffer<u8>),
        /// A `float`.
        F32(f32),
        /// An `int`.
        I32(i32),
    }

    impl NativeOpenCl {
        /// Round trips of the library's `noop` kernel (range 1, enqueued and waited for one at a
        /// time, as Agora's OpenCL lanes enqueue it: 64 work items, the guards, the zero
        /// revocation flag), after 100 warm-ups: seconds each.
        pub fn noop_round_trips(&mut self, count: usize) -> Result<Vec<f64>, String> {
            let (kernel, _, _) = self.kernel("noop")?;
            for d in 0..3u32 {
                // SAFETY: noop's parameters are the three guards then the flag (set by `kernel`).
                unsafe { kernel.set_arg(d, &1u64) }.map_err(err)?;
            }
            let global = [64usize];
            let mut times = Vec::with_capacity(count);
            for i in 0..count + 100 {
                let start = Instant::now();
                // SAFETY: every argument is set; a 1-D range of one work-group.
                unsafe {
                    self.queue
                        .enqueue_nd_range_kernel(
                            kernel.get(),
                            1,
                            std::ptr::null(),
                            global.as_ptr(),
                            global.as_ptr(),
                            &[],
                        )
                        .map_err(err)?;
                }
                self.queue.finish().map_err(err)?;
                if i >= 100 {
                    times.push(start.elapsed().as_secs_f64());
                }
            }
            Ok(times)
        }

        /// Builds `source` as a PyOpenCL user would (`-cl-std=CL1.2`), the compiler's log on failure.
        pub fn build(&self, source: &str) -> Result<Program, String> {
            Program::create_and_build_from_source(&self.context, source, "-cl-std=CL1.2")
        }

        /// A device buffer holding `data`.
        pub fn buffer_from(&self, data: &[u8]) -> Result<Buffer<u8>, String> {
            let mut copy = data.to_vec();
            // SAFETY: the buffer is initialised from `copy`, which the call reads at creation.
            unsafe {
                Buffer::<u8>::create(
                    &self.context,
                    CL_MEM_READ_WRITE | opencl3::memory::CL_MEM_COPY_HOST_PTR,
                    copy.len().max(1),
                    copy.as_mut_ptr() as *mut std::ffi::c_void,
                )
            }
            .map_err(err)
        }

        /// Reads `buffer` into `out` (blocking).
        pub fn read(&self, buffer: &Buffer<u8>, out: &mut [u8]) -> Result<(), String> {
            // SAFETY: a blocking read into a live slice no longer than the buffer.
            unsafe { self.queue.enqueue_read_buffer(buffer, CL_BLOCKING, 0, out, &[]) }
                .map(|_| ())
                .map_err(err)
        }

        /// Launches kernel `entry` of `program` `launches` times with `args` over `global`
        /// (work-group size `local` when given), waiting for each launch as a synchronous caller
        /// does; the seconds each took, from enqueue to completion.
        pub fn time_launches(
            &self,
            program: &Program,
            entry: &str,
            args: &[NativeArg<'_>],
            global: &[usize],
            local: Option<&[usize]>,
            launches: usize,
        ) -> Result<Vec<f64>, String> {
            let kernel = Kernel::create(program, entry).map_err(err)?;
            for (index, arg) in args.iter().enumerate() {
                // SAFETY: the argument kinds follow the kernel's parameters (the caller's
                // contract: the same order and types the bench package's manifest declares).
                unsafe {
                    match arg {
                        NativeArg::Buffer(b) => kernel.set_arg(index as u32, &b.get()),
                        NativeArg::F32(v) => kernel.set_arg(index as u32, v),
                        NativeArg::I32(v) => kernel.set_arg(index as u32, v),
                    }
                }
                .map_err(err)?;
            }
            let mut times = Vec::with_capacity(launches);
            for _ in 0..launches {
                let start = Instant::now();
                // SAFETY: arguments set above; sizes are the caller's, checked by the runtime.
                unsafe {
                    self.queue
                        .enqueue_nd_range_kernel(
                            kernel.get(),
                            global.len() as u32,
                            std::ptr::null(),
                            global.as_ptr(),
                            local.map_or(std::ptr::null(), |l| l.as_ptr()),
                            &[],
                        )
                        .map_err(err)?;
                }
                self.queue.finish().map_err(err)?;
                times.push(start.elapsed().as_secs_f64());
            }
            Ok(times)
        }
    }
}
