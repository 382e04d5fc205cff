//! `agora bench gpu`: NVIDIA GPUs through Agora beside the same work done natively with the
//! CUDA driver API in this process, measured side by side in one run.
//!
//! Rows: the empty kernel's launch + wait (a client process through Agora vs `cuLaunchKernel` +
//! `cuStreamSynchronize`), host→device and device→host copies (Agora's registered segment vs
//! native pinned copies), every Rodinia program (Agora vs the same CUDA code natively, pinned
//! host memory; and that code fenced vs unfenced, natively: the fence's cost), two tenants sharing the GPU vs one after the other, and latency-class empty
//! kernels beside a batch tenant on the GPU. Native and Agora runs alternate, as in
//! `bench overhead`. Without a GPU it reports `"gpus": 0` and times what runs
//! anywhere: NVRTC, the fencing pass and ptxas over the kernel library.

use std::collections::HashMap;
use std::ffi::{c_void, CString};
use std::path::PathBuf;
use std::time::Instant;

use agora_devices::cuda::{fence, launch_shape, programs};
use anyhow::{bail, Context, Result};
use clap::Args;
use cudarc::driver::result as driver;
use cudarc::driver::sys::{self, CUcontext, CUdeviceptr, CUfunction, CUresult, CUstream};
use serde::Serialize;

use super::client::{run_clients_with, ClientMode, StepClient};
use super::harness::{
    geomean, load_average_at_start, median, paired_ratios, spread, DaemonProcess, ScratchDir, Spread,
};

/// `agora bench gpu` options.
#[derive(Args, Debug)]
pub struct GpuArgs {
    /// Print JSON.
    #[arg(long)]
    json: bool,
    /// A short version for smoke checks (small sizes, one repetition).
    #[arg(long)]
    quick: bool,
    /// Interleaved repetitions per row (default 5; 1 with --quick).
    #[arg(long, alias = "reps")]
    repetitions: Option<usize>,
    /// Bytes for the copies (default 1G; 64M with --quick).
    #[arg(long, value_parser = crate::size::parse_bytes)]
    transfer_bytes: Option<u64>,
    /// Empty-kernel round trips per side (default 5000; 500 with --quick).
    #[arg(long)]
    launches: Option<u64>,
    /// Run the GPU in the daemon's process (`--no-cuda-device-host`) instead of a device host
    /// (the default), to measure what the host's hop costs.
    #[arg(long)]
    in_daemon: bool,
    #[command(flatten)]
    pub socket: crate::SocketArg,
}

/// How long NVRTC, the fencing pass and ptxas take over the kernel library.
#[derive(Serialize, Debug, Default)]
struct Pipeline {
    programs: usize,
    nvrtc_ms: f64,
    fence_ms: f64,
    fenced_accesses: usize,
    /// `None`: no ptxas found (`AGORA_PTXAS`, or `ptxas` on the PATH).
    ptxas_ms: Option<f64>,
    arch: u32,
}

fn find_ptxas() -> Option<PathBuf> {
    if let Some(p) = std::env::var_os("AGORA_PTXAS").filter(|p| !p.is_empty()) {
        return Some(PathBuf::from(p));
    }
    std::env::var_os("PATH").and_then(|paths| {
        std::env::split_paths(&paths)
            .map(|d| d.join("ptxas"))
            .find(|p| p.is_file())
    })
}

fn pipeline(arch: u32) -> Result<Pipeline> {
    let mut out = Pipeline {
        arch,
        ..Default::default()
    };
    let ptxas = find_ptxas();
    let mut ptxas_ms = 0.0;
    let dir = ScratchDir::new("bench-gpu")?;
    for imp in programs::library_programs() {
        out.programs += 1;
        let t = Instant::now();
        let ptx = programs::compile_ptx(&imp.program, &programs::cuda_source(&imp.source), arch)
            .map_err(|e| anyhow::anyhow!("{}: {e}", imp.program))?;
        out.nvrtc_ms += t.elapsed().as_secs_f64() * 1e3;
        let t = Instant::now();
        let fenced = fence::fence(&ptx).map_err(|e| anyhow::anyhow!("fencing {}: {e}", imp.program))?;
        out.fence_ms += t.elapsed().as_secs_f64() * 1e3;
        out.fenced_accesses += fenced.fenced_accesses;
        if let Some(ptxas) = &ptxas {
            let file = dir.path().join(format!("{}.ptx", imp.program));
            std::fs::write(&file, &fenced.ptx)?;
            let t = Instant::now();
            let status = std::process::Command::new(ptxas)
                .arg(format!("-arch=sm_{arch}"))
                .args(["-o", "/dev/null"])
                .arg(&file)
                .status()
                .with_context(|| format!("running {}", ptxas.display()))?;
            ptxas_ms += t.elapsed().as_secs_f64() * 1e3;
            if !status.success() {
                bail!("ptxas refused the fenced PTX of {}", imp.program);
            }
        }
    }
    out.ptxas_ms = ptxas.map(|_| ptxas_ms);
    Ok(out)
}

/// The CUDA driver in this process: the native side.
struct Native {
    context: CUcontext,
    stream: CUstream,
    arch: u32,
    zero_flag: CUdeviceptr,
    functions: HashMap<String, (CUfunction, programs::Convention, agora_kernels::KernelRef)>,
    modules: HashMap<String, sys::CUmodule>,
    /// Load kernels fenced (and launch them with the fence's arguments): the fence's cost.
    fenced: bool,
}

fn check(result: CUresult, what: &str) -> Result<()> {
    match result {
        CUresult::CUDA_SUCCESS => Ok(()),
        e => bail!("{what}: {e:?}"),
    }
}

impl Native {
    /// The first GPU, or `None` when there is none (no driver, no device).
    fn open() -> Result<Option<Native>> {
        // SAFETY: only tries to open the library.
        if !unsafe { sys::is_culib_present() } || driver::init().is_err() {
            return Ok(None);
        }
        if driver::device::get_count().unwrap_or(0) == 0 {
            return Ok(None);
        }
        let device = driver::device::get(0).map_err(|e| anyhow::anyhow!("cuDeviceGet: {e:?}"))?;
        // SAFETY: a valid device; the context is retained for the process's life.
        let context = unsafe { driver::primary_ctx::retain(device) }.map_err(|e| anyhow::anyhow!("{e:?}"))?;
        // SAFETY: the context just retained.
        unsafe { driver::ctx::set_current(context) }.map_err(|e| anyhow::anyhow!("{e:?}"))?;
        use sys::CUdevice_attribute as A;
        // SAFETY: valid device and attributes.
        let (major, minor) = unsafe {
            (
                driver::device::get_attribute(device, A::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR).unwrap_or(0),
                driver::device::get_attribute(device, A::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR).unwrap_or(0),
            )
        };
        let stream =
            driver::stream::create(driver::stream::StreamKind::NonBlocking).map_err(|e| anyhow::anyhow!("{e:?}"))?;
        // SAFETY: four bytes in the current context, zeroed (a revocation flag that is never
        // set, and a fenced kernel's stop word that never names its launch).
        let zero_flag = unsafe {
            let p = driver::malloc_sync(4).map_err(|e| anyhow::anyhow!("{e:?}"))?;
            driver::memset_d8_sync(p, 0, 4).map_err(|e| anyhow::anyhow!("{e:?}"))?;
            p
        };
        Ok(Some(Native {
            context,
            stream,
            arch: (major * 10 + minor) as u32,
            zero_flag,
            functions: HashMap::new(),
            modules: HashMap::new(),
            fenced: false,
        }))
    }

    fn bind(&self) -> Result<()> {
        // SAFETY: the retained context.
        unsafe { driver::ctx::set_current(self.context) }.map_err(|e| anyhow::anyhow!("{e:?}"))
    }

    /// The function of kernel `name` (the library's or a package's), compiled as the daemon does.
    /// With `fenced`, the module's PTX goes through the fence pass first (as a tenant's would).
    fn function(&mut self, name: &str) -> Result<(CUfunction, programs::Convention, agora_kernels::KernelRef)> {
        let key = format!("{}{name}", if self.fenced { "fenced:" } else { "" });
        if let Some((f, c, def)) = self.functions.get(&key) {
            return Ok((*f, *c, def.clone()));
        }
        let def = agora_apps::native::kernel_def(name).map_err(anyhow::Error::msg)?;
        let imp = def
            .opencl
            .as_ref()
            .with_context(|| format!("{name} has no OpenCL C source"))?;
        let module_key = format!("{}{}", if self.fenced { "fenced:" } else { "" }, imp.program);
        let module = match self.modules.get(&module_key) {
            Some(m) => *m,
            None => {
                let (mut ptx, _) = programs::ptx_for(&imp.program, &programs::cuda_source(&imp.source), self.arch)
                    .map_err(|e| anyhow::anyhow!("{}: {e}", imp.program))?;
                if self.fenced {
                    ptx = fence::fence(&ptx)
                        .map_err(|e| anyhow::anyhow!("fencing {}: {e}", imp.program))?
                        .ptx;
                }
                let ptx = CString::new(ptx)?;
                // SAFETY: NUL-terminated PTX.
                let m =
                    unsafe { driver::module::load_data(ptx.as_ptr().cast()) }.map_err(|e| anyhow::anyhow!("{e:?}"))?;
                self.modules.insert(module_key, m);
                m
            }
        };
        // SAFETY: a live module.
        let f = unsafe { driver::module::get_function(module, CString::new(imp.entry.as_bytes())?) }
            .map_err(|e| anyhow::anyhow!("{name}: {e:?}"))?;
        let c = programs::convention(&imp.source, &imp.entry);
        self.functions.insert(key, (f, c, def.clone()));
        Ok((f, c, def.clone()))
    }

    /// Launches `f` over `range` with `values` (buffer addresses or scalar bits in signature
    /// order), with the daemon's block shapes and calling convention.
    fn launch(
        &self,
        f: CUfunction,
        convention: programs::Convention,
        local: Option<[usize; 3]>,
        values: &[u64],
        range: &[u64],
    ) -> Result<()> {
        let dims = range.len().clamp(1, 3);
        let mut extent = [1u64; 3];
        extent[..dims].copy_from_slice(&range[..dims]);
        let mut all: Vec<u64> = values.to_vec();
        if convention == programs::Convention::Guarded {
            all.extend([extent[0], extent[1], extent[2], self.zero_flag, 0]);
        }
        if self.fenced {
            // Base 0, mask all ones: every address maps to itself (these buffers are plain
            // allocations, in no partition), and the kernel runs exactly the instructions a
            // fenced tenant kernel runs: what the fence costs. Its stop word (zero) never names
            // launch 1, so its loops poll and go on, as a tenant's within its limit.
            all.extend([0, u64::MAX, self.zero_flag, 1]);
        }
        let (grid, block) = launch_shape(extent, dims, local, convention);
        let mut pointers: Vec<*mut c_void> = all.iter_mut().map(|v| v as *mut u64 as *mut c_void).collect();
        // SAFETY: parameters follow the kernel's signature and convention; `all` outlives the
        // call (the driver copies parameters before returning).
        check(
            unsafe {
                sys::cuLaunchKernel(
                    f,
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
            },
            "cuLaunchKernel",
        )
    }

    fn synchronize(&self) -> Result<()> {
        // SAFETY: a live stream.
        check(unsafe { sys::cuStreamSynchronize(self.stream) }, "cuStreamSynchronize")
    }

    /// Empty-kernel launch + wait round trips, in nanoseconds.
    fn empty_kernel(&mut self, count: u64) -> Result<Vec<u64>> {
        let (f, c, _) = self.function("noop")?;
        for _ in 0..100 {
            self.launch(f, c, None, &[], &[1])?;
            self.synchronize()?;
        }
        let mut samples = Vec::with_capacity(count as usize);
        for _ in 0..count {
            let t = Instant::now();
            self.launch(f, c, None, &[], &[1])?;
            self.synchronize()?;
            samples.push(t.elapsed().as_nanos() as u64);
        }
        samples.sort_unstable();
        Ok(samples)
    }
}

/// Pinned host memory of the native side.
struct Pinned {
    ptr: *mut u8,
    len: usize,
}

impl Pinned {
    fn new(len: usize) -> Result<Pinned> {
        // SAFETY: a page-locked allocation, freed in Drop.
        let ptr =
            unsafe { driver::malloc_host(len.max(1), 0) }.map_err(|e| anyhow::anyhow!("cuMemHostAlloc: {e:?}"))?;
        Ok(Pinned {
            ptr: ptr as *mut u8,
            len,
        })
    }
    fn bytes(&mut self) -> &mut [u8] {
        // SAFETY: `len` bytes allocated above, owned by self.
        unsafe { std::slice::from_raw_parts_mut(self.ptr, self.len) }
    }
}

impl Drop for Pinned {
    fn drop(&mut self) {
        // SAFETY: allocated by cuMemHostAlloc; no copy uses it any more (streams synchronised).
        let _ = unsafe { driver::free_host(self.ptr as *mut c_void) };
    }
}

struct DeviceMemory(CUdeviceptr);

impl DeviceMemory {
    fn new(len: usize) -> Result<Self> {
        // SAFETY: an allocation in the current context, freed in Drop.
        Ok(DeviceMemory(
            unsafe { driver::malloc_sync(len.max(1)) }.map_err(|e| anyhow::anyhow!("cuMemAlloc {len}: {e:?}"))?,
        ))
    }
}

impl Drop for DeviceMemory {
    fn drop(&mut self) {
        // SAFETY: no queued command uses it (streams synchronised).
        let _ = unsafe { driver::free_sync(self.0) };
    }
}

/// Runs a workload natively on the GPU: pinned host copies, the daemon's kernels and shapes.
fn run_native_workload(native: &mut Native, workload: &agora_apps::Workload) -> Result<(f64, bool)> {
    use agora_apps::{Step, WArg};
    native.bind()?;
    let mut host: Vec<Pinned> = Vec::new();
    let mut device: Vec<DeviceMemory> = Vec::new();
    for b in &workload.buffers {
        let mut p = Pinned::new(b.len())?;
        p.bytes().copy_from_slice(b);
        host.push(p);
        device.push(DeviceMemory::new(b.len())?);
    }
    let mut resolved = Vec::new();
    for step in &workload.steps {
        if let Step::Launch { kernel, .. } = step {
            resolved.push(native.function(kernel)?);
        }
    }
    let start = Instant::now();
    let mut next = resolved.iter();
    for step in &workload.steps {
        match step {
            Step::SyncTo(b) => check(
                // SAFETY: pinned host memory and a device allocation of the same length.
                unsafe {
                    sys::cuMemcpyHtoDAsync_v2(device[*b].0, host[*b].ptr as *const c_void, host[*b].len, native.stream)
                },
                "cuMemcpyHtoDAsync",
            )?,
            Step::SyncFrom(b) => check(
                // SAFETY: as above, the other way.
                unsafe {
                    sys::cuMemcpyDtoHAsync_v2(host[*b].ptr as *mut c_void, device[*b].0, host[*b].len, native.stream)
                },
                "cuMemcpyDtoHAsync",
            )?,
            Step::Launch { args, range, .. } => {
                let (f, c, def) = next.next().context("one function per launch")?;
                let values: Vec<u64> = args
                    .iter()
                    .map(|a| match *a {
                        WArg::Buffer(b) => device[b].0,
                        WArg::F32(v) => u64::from(v.to_bits()),
                        WArg::I32(v) => u64::from(v as u32),
                        WArg::U32(v) => u64::from(v),
                        WArg::U64(v) => v,
                    })
                    .collect();
                let local = def.opencl.as_ref().and_then(|o| o.local);
                native.launch(*f, *c, local, &values, range)?;
            }
        }
    }
    native.synchronize()?;
    let seconds = start.elapsed().as_secs_f64();
    let views: Vec<&[u8]> = host
        .iter()
        .map(|p| {
            // SAFETY: `len` bytes of pinned memory, not written any more.
            unsafe { std::slice::from_raw_parts(p.ptr as *const u8, p.len) }
        })
        .collect();
    let report = workload.report(seconds, &views);
    Ok((seconds, report.verified))
}

#[derive(Serialize, Debug)]
struct ProgramRow {
    program: String,
    size: u64,
    native_s: f64,
    agora_s: f64,
    ratio: f64,
    ratio_spread: Spread,
    /// The same kernels natively, fenced (as a tenant's program would run): the fence's cost.
    native_fenced_s: f64,
    fence_ratio: f64,
    fence_ratio_spread: Spread,
    verified: bool,
}

/// GPU sizes: a few milliseconds to a second natively on an H100-class GPU.
fn gpu_size(program: &str, quick: bool) -> u64 {
    match (program, quick) {
        ("gaussian", false) => 2048,
        ("gaussian", true) => 256,
        ("hotspot", false) => 1024,
        ("hotspot", true) => 64,
        ("nw", false) => 4096,
        ("nw", true) => 256,
        ("pathfinder", false) => 1_000_000,
        ("pathfinder", true) => 10_000,
        ("lavamd", false) => 16,
        ("lavamd", true) => 2,
        ("backprop", false) => 1 << 22,
        ("backprop", true) => 1 << 14,
        (_, false) => 64 << 20,
        (_, true) => 1 << 18,
    }
}

/// Copies through Agora (one client: this process) vs native pinned copies, alternating.
/// Returns (native h2d, agora h2d, native d2h, agora d2h) seconds per repetition, and whether
/// every round trip was right.
#[allow(clippy::type_complexity)]
fn copies(native: &mut Native, socket: &std::path::Path, bytes: u64, reps: usize) -> Result<([Vec<f64>; 4], bool)> {
    native.bind()?;
    let (copy, conv, _) = native.function("stream.copy")?;
    let (fill, _, _) = native.function("fill")?;
    let mut pinned = Pinned::new(bytes as usize)?;
    let a = DeviceMemory::new(bytes as usize)?;
    let c = DeviceMemory::new(64)?;
    let session = agora::Session::connect_with(agora::SessionOptions {
        socket: Some(socket.to_path_buf()),
        name: Some("bench-gpu-copies".into()),
        heap_bytes: Some(bytes + (64 << 20)),
        control_timeout: None,
        reconnect_timeout: None,
    })?;
    let queue = agora_apps::queue(&session, "copies", Some(agora::DeviceKind::Cuda))?;
    let agora_copy = session.kernel("stream.copy")?;
    let agora_fill = session.kernel("fill")?;
    let mut buffer = session.buffer(bytes)?;
    let small = session.buffer(64)?;
    let mut runs: [Vec<f64>; 4] = Default::default();
    let mut verified = true;
    let floats = (bytes / 4) as usize;
    let probe = [1usize, floats / 2, floats - 1];
    for rep in 0..=reps {
        let marker = 2.0 + rep as f32;
        for side in if rep % 2 == 0 { [0, 1] } else { [1, 0] } {
            if side == 0 {
                {
                    let host: &mut [f32] = bytemuck::cast_slice_mut(&mut pinned.bytes()[..floats * 4]);
                    probe.iter().for_each(|i| host[*i] = marker);
                }
                let t = Instant::now();
                // SAFETY: pinned memory and a device allocation of `bytes`.
                let result = unsafe {
                    sys::cuMemcpyHtoDAsync_v2(a.0, pinned.ptr as *const c_void, bytes as usize, native.stream)
                };
                check(result, "h2d")?;
                native.launch(copy, conv, None, &[a.0, c.0], &[1])?;
                native.synchronize()?;
                let h2d = t.elapsed().as_secs_f64();
                bytemuck::cast_slice_mut::<u8, f32>(&mut pinned.bytes()[..4])[0] = 0.0;
                let t = Instant::now();
                native.launch(fill, conv, None, &[u64::from(1.5f32.to_bits()), a.0], &[1])?;
                // SAFETY: as above, the other way.
                let result =
                    unsafe { sys::cuMemcpyDtoHAsync_v2(pinned.ptr as *mut c_void, a.0, bytes as usize, native.stream) };
                check(result, "d2h")?;
                native.synchronize()?;
                let d2h = t.elapsed().as_secs_f64();
                let host: &[f32] = bytemuck::cast_slice(&pinned.bytes()[..floats * 4]);
                verified &= host[0] == 1.5 && probe.iter().all(|i| host[*i] == marker);
                if rep > 0 {
                    runs[0].push(h2d);
                    runs[2].push(d2h);
                }
            } else {
                let host = buffer.as_mut_slice::<f32>();
                probe.iter().for_each(|i| host[*i] = marker);
                let t = Instant::now();
                let _ = queue.sync_to(&buffer)?;
                let _ = queue.launch(&agora_copy, &[(&buffer).into(), (&small).into()], 1u64)?;
                queue.finish()?;
                let h2d = t.elapsed().as_secs_f64();
                buffer.as_mut_slice::<f32>()[0] = 0.0;
                let t = Instant::now();
                let _ = queue.launch(&agora_fill, &[agora::Arg::F32(1.5), (&buffer).into()], 1u64)?;
                let _ = queue.sync_from(&buffer)?;
                queue.finish()?;
                let d2h = t.elapsed().as_secs_f64();
                let host = buffer.as_slice::<f32>();
                verified &= host[0] == 1.5 && probe.iter().all(|i| host[*i] == marker);
                if rep > 0 {
                    runs[1].push(h2d);
                    runs[3].push(d2h);
                }
            }
        }
    }
    Ok((runs, verified))
}

pub fn gpu(socket: Option<PathBuf>, args: GpuArgs) -> Result<()> {
    let reps = args.repetitions.unwrap_or(if args.quick { 1 } else { 5 }).max(1);
    let load = load_average_at_start();
    let native = Native::open()?;
    let arch = native.as_ref().map_or(80, |n| n.arch);
    let pipeline = pipeline(arch).context("the NVRTC / fencing / ptxas pipeline")?;
    let Some(mut native) = native else {
        let out = serde_json::json!({
            "gpus": 0,
            "device_host": !args.in_daemon,
            "pipeline": pipeline,
            "empty_kernel_p50_ns": null,
            "native_empty_kernel_p50_ns": null,
            "h2d_ratio": null,
            "d2h_ratio": null,
            "rodinia_ratio_geomean": null,
            "fence_ratio_geomean": null,
            "sharing_ratio": null,
            "latency_under_batch_p99_ns": null,
            "load_average_at_start": load,
            "verified": true,
        });
        if args.json {
            println!("{}", serde_json::to_string_pretty(&out)?);
        } else {
            println!(
                "no GPU (no CUDA driver or device): timed the pipeline only: {} programs, NVRTC {:.1} ms, fencing {:.2} ms ({} accesses), ptxas {}",
                pipeline.programs,
                pipeline.nvrtc_ms,
                pipeline.fence_ms,
                pipeline.fenced_accesses,
                pipeline.ptxas_ms.map_or("not found".to_string(), |ms| format!("{ms:.1} ms"))
            );
        }
        return Ok(());
    };
    // Progress on stderr, in JSON mode too (stdout holds only the JSON).
    let say = |line: String| eprintln!("{line}");
    // No OpenCL: a GPU machine's OpenCL platform may be the same GPU, a second context on it.
    let daemon = if args.in_daemon {
        DaemonProcess::start(socket.as_deref(), &["--no-opencl", "--no-cuda-device-host"])?
    } else {
        DaemonProcess::start(socket.as_deref(), &["--no-opencl"])?
    };

    // The empty kernel: one client process through Agora vs the driver in this process.
    let launches = args.launches.unwrap_or(if args.quick { 500 } else { 5000 });
    let native_samples = native.empty_kernel(launches)?;
    let agora = run_clients_with(
        &daemon.socket,
        ClientMode::Latency,
        launches,
        1,
        &["--device-kind", "cuda"],
    )?;
    let native_p50 = super::harness::percentile(&native_samples, 0.5);
    let native_p99 = super::harness::percentile(&native_samples, 0.99);
    say(format!(
        "empty kernel launch + wait: agora p50 {} ns p99 {} ns; native p50 {native_p50} ns p99 {native_p99} ns",
        agora[0].p50_ns, agora[0].p99_ns
    ));

    // Copies.
    let bytes = args
        .transfer_bytes
        .unwrap_or(if args.quick { 64 << 20 } else { 1 << 30 });
    let (copy_runs, copies_ok) = copies(&mut native, &daemon.socket, bytes, reps)?;
    let h2d_ratio = median(&copy_runs[1]) / median(&copy_runs[0]);
    let d2h_ratio = median(&copy_runs[3]) / median(&copy_runs[2]);
    let gib_s = |runs: &[f64]| bytes as f64 / median(runs) / f64::from(1u32 << 30);
    say(format!(
        "copies of {} MiB: h2d agora {:.1} GiB/s native {:.1} GiB/s (ratio {h2d_ratio:.3}); d2h agora {:.1} GiB/s native {:.1} GiB/s (ratio {d2h_ratio:.3})",
        bytes >> 20,
        gib_s(&copy_runs[1]),
        gib_s(&copy_runs[0]),
        gib_s(&copy_runs[3]),
        gib_s(&copy_runs[2])
    ));

    // Rodinia (and the rest of the program set).
    let mut rows = Vec::new();
    for (program, _) in agora_apps::PROGRAMS {
        let size = gpu_size(program, args.quick);
        let workload = agora_apps::build(program, size, None).with_context(|| format!("unknown program {program}"))?;
        let (_, warm_ok) = run_native_workload(&mut native, &workload)?;
        let extra = [
            "--app".to_string(),
            program.to_string(),
            "--size".into(),
            size.to_string(),
            "--device-kind".into(),
            "cuda".into(),
        ];
        let mut client = StepClient::start(&daemon.socket, "workload", &extra)?;
        // The fenced native side, warmed too (its modules load at first use).
        native.fenced = true;
        let fenced_warm = run_native_workload(&mut native, &workload);
        native.fenced = false;
        let (_, fenced_warm_ok) = fenced_warm?;
        let (mut native_runs, mut agora_runs, mut fenced_runs, mut ok) =
            (Vec::new(), Vec::new(), Vec::new(), warm_ok && fenced_warm_ok);
        for rep in 0..reps {
            let order = if rep % 2 == 0 { [0, 1, 2] } else { [2, 1, 0] };
            for side in order {
                let (s, v) = match side {
                    0 => run_native_workload(&mut native, &workload)?,
                    1 => client.step()?,
                    _ => {
                        native.fenced = true;
                        let run = run_native_workload(&mut native, &workload);
                        native.fenced = false;
                        run?
                    }
                };
                ok &= v;
                match side {
                    0 => native_runs.push(s),
                    1 => agora_runs.push(s),
                    _ => fenced_runs.push(s),
                }
            }
        }
        client.finish()?;
        let row = ProgramRow {
            program: program.to_string(),
            size,
            native_s: median(&native_runs),
            agora_s: median(&agora_runs),
            ratio: median(&agora_runs) / median(&native_runs),
            ratio_spread: paired_ratios(&agora_runs, &native_runs),
            native_fenced_s: median(&fenced_runs),
            fence_ratio: median(&fenced_runs) / median(&native_runs),
            fence_ratio_spread: paired_ratios(&fenced_runs, &native_runs),
            verified: ok,
        };
        say(format!(
            "  {:<12} native {:>9.5}s agora {:>9.5}s ratio {:.3} (per repetition {:.3} / {:.3} / {:.3}); fenced {:.3}x{}",
            row.program,
            row.native_s,
            row.agora_s,
            row.ratio,
            row.ratio_spread.min,
            row.ratio_spread.median,
            row.ratio_spread.max,
            row.fence_ratio,
            if row.verified { "" } else { "  VERIFICATION FAILED" }
        ));
        rows.push(row);
    }
    let rodinia = ["gaussian", "hotspot", "nw", "pathfinder", "lavamd", "backprop"];
    let rodinia_geomean = geomean(
        rows.iter()
            .filter(|r| rodinia.contains(&r.program.as_str()))
            .map(|r| r.ratio),
    );
    let fence_geomean = geomean(
        rows.iter()
            .filter(|r| rodinia.contains(&r.program.as_str()))
            .map(|r| r.fence_ratio),
    );
    say(format!(
        "Rodinia geomean: agora/native {:.3}, fenced/unfenced (native) {:.3}",
        rodinia_geomean.unwrap_or(f64::NAN),
        fence_geomean.unwrap_or(f64::NAN)
    ));

    // Two tenants sharing the GPU vs one after the other. Each client prepares its next run's
    // buffers after a run, so a run's time is its steps alone. One after the other: the sum of
    // the two runs' times. Together: both asked at once, from the first start to the last end (on
    // the system's monotonic clock the clients report). Ratios are per pair and repetition; the
    // figure is the geometric mean of the pairs' medians.
    let mix = [("gaussian", "lavamd"), ("nw", "backprop")];
    let mut pairs = Vec::new();
    let mut pair_medians = Vec::new();
    let mut sharing_ok = true;
    for (a, b) in mix {
        let start = |p: &str| {
            StepClient::start(
                &daemon.socket,
                "workload",
                &[
                    "--app".into(),
                    p.to_string(),
                    "--size".into(),
                    gpu_size(p, args.quick).to_string(),
                    "--device-kind".into(),
                    "cuda".into(),
                ],
            )
        };
        let (mut first, mut second) = (start(a)?, start(b)?);
        let (mut sequential, mut together, mut ratios) = (Vec::new(), Vec::new(), Vec::new());
        for _ in 0..reps {
            let (x, y) = (first.timed_step()?, second.timed_step()?);
            sharing_ok &= x.verified && y.verified;
            let one_after_the_other = x.seconds + y.seconds;
            first.ask()?;
            second.ask()?;
            let (x, y) = (first.answer()?, second.answer()?);
            sharing_ok &= x.verified && y.verified;
            let span_ns = x.ended_ns().max(y.ended_ns()) - x.started_ns.min(y.started_ns);
            let at_once = span_ns as f64 / 1e9;
            sequential.push(one_after_the_other);
            together.push(at_once);
            ratios.push(one_after_the_other / at_once);
        }
        first.finish()?;
        second.finish()?;
        let ratio = median(&ratios);
        say(format!(
            "two tenants ({a} + {b}): one after the other {:.4}s, sharing the GPU {:.4}s: {ratio:.2}x (per repetition {})",
            median(&sequential),
            median(&together),
            ratios.iter().map(|r| format!("{r:.2}")).collect::<Vec<_>>().join(" / ")
        ));
        pair_medians.push(ratio);
        pairs.push(serde_json::json!({
            "programs": [a, b],
            "sequential_s": spread(&sequential),
            "together_s": spread(&together),
            "ratio": ratio,
            "ratio_spread": spread(&ratios),
        }));
    }
    let sharing_ratio = geomean(pair_medians.iter().copied()).unwrap_or(f64::NAN);
    say(format!(
        "two tenants sharing the GPU vs one after the other: {sharing_ratio:.2}x faster (geomean of the pairs)"
    ));
    // Latency-class empty kernels on the GPU while another tenant loops a batch program there.
    let batch_app = "nw";
    let mut batch = StepClient::start(
        &daemon.socket,
        "workload",
        &[
            "--app".into(),
            batch_app.into(),
            "--size".into(),
            gpu_size(batch_app, args.quick).to_string(),
            "--device-kind".into(),
            "cuda".into(),
        ],
    )?;
    let stop = std::sync::atomic::AtomicBool::new(false);
    let (under_batch, batch_ok) = std::thread::scope(|scope| {
        let looping = scope.spawn(|| -> Result<bool> {
            let mut ok = true;
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                ok &= batch.step()?.1;
            }
            Ok(ok)
        });
        let measured = run_clients_with(
            &daemon.socket,
            ClientMode::Latency,
            launches / 5,
            1,
            &["--device-kind", "cuda", "--latency-class"],
        );
        stop.store(true, std::sync::atomic::Ordering::Relaxed);
        (measured, looping.join().expect("batch tenant thread"))
    });
    let under_batch = under_batch?;
    let batch_ok = batch_ok?;
    batch.finish()?;
    say(format!(
        "latency-class empty kernel beside a batch tenant ({batch_app}): p50 {} ns p99 {} ns",
        under_batch[0].p50_ns, under_batch[0].p99_ns
    ));
    drop(daemon);

    let verified = batch_ok && copies_ok && sharing_ok && rows.iter().all(|r| r.verified);
    let out = serde_json::json!({
        "gpus": 1,
        "device_host": !args.in_daemon,
        "arch": native.arch,
        "repetitions": reps,
        "load_average_at_start": load,
        "pipeline": pipeline,
        "empty_kernel_p50_ns": agora[0].p50_ns,
        "empty_kernel_p99_ns": agora[0].p99_ns,
        "native_empty_kernel_p50_ns": native_p50,
        "native_empty_kernel_p99_ns": native_p99,
        "empty_kernel_native_samples": native_samples.len(),
        "transfer_bytes": bytes,
        "h2d_native": spread(&copy_runs[0]),
        "h2d_agora": spread(&copy_runs[1]),
        "d2h_native": spread(&copy_runs[2]),
        "d2h_agora": spread(&copy_runs[3]),
        "h2d_ratio": h2d_ratio,
        "d2h_ratio": d2h_ratio,
        "programs": rows,
        "rodinia_ratio_geomean": rodinia_geomean,
        "fence_ratio_geomean": fence_geomean,
        "latency_under_batch_p50_ns": under_batch[0].p50_ns,
        "latency_under_batch_p99_ns": under_batch[0].p99_ns,
        "latency_under_batch_with": batch_app,
        "sharing_pairs": pairs,
        "sharing_ratio": sharing_ratio,
        "verified": verified,
    });
    if args.json {
        println!("{}", serde_json::to_string_pretty(&out)?);
    }
    if !verified {
        bail!("a result did not match its host reference");
    }
    Ok(())
}
