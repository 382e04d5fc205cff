//! `agora bench kernels`: kernels written by hand outside Agora's library (the example package
//! `examples/packages/bench`: a 2-D 5-point stencil, a blocked matrix multiply, a reduction),
//! measured side by side in one run:
//!
//! - **OpenCL**: natively on the OpenCL device (PoCL here; what a PyOpenCL user compares
//!   against), through Agora as an installed package (the same `.cl` file), and through Agora as
//!   a tenant program (the same source sent by the client, built and run in the session's
//!   sandboxed executor);
//! - **CPU**: the package's C functions called natively vs the same functions as the package's
//!   CPU implementation through Agora;
//! - the round trip of an empty tenant-program task, and the first vs the cached build of a
//!   tenant program.
//!
//! Every launch through Agora is issued and waited for from this process (a client of a daemon
//! it starts), as a synchronous caller would; every result is checked against the native C
//! result.

use std::path::{Path, PathBuf};
use std::time::Instant;

use agora::{Arg, DeviceKind, Kernel, QueueClass, QueueOptions, Session, SessionOptions};
use anyhow::{bail, ensure, Context, Result};
use clap::Args;
use serde::Serialize;

use super::harness::{spread, DaemonProcess, Spread};

/// `agora bench kernels` options.
#[derive(Args, Debug)]
pub struct KernelsArgs {
    /// Print JSON.
    #[arg(long)]
    json: bool,
    /// A short version for smoke checks: small sizes, 2 repetitions.
    #[arg(long)]
    quick: bool,
    /// Timed launches per kernel and path, after one warm-up (default 9; 2 with --quick).
    #[arg(long)]
    repetitions: Option<usize>,
}

/// One kernel of the bench package with its problem size.
#[derive(Debug, Clone, Copy)]
enum Case {
    /// `rows × cols` grid.
    Stencil { rows: usize, cols: usize },
    /// `n × n` matrices.
    Matmul { n: usize },
    /// `n` elements.
    Reduce { n: usize },
}

impl Case {
    fn kernel(&self) -> &'static str {
        match self {
            Case::Stencil { .. } => "stencil",
            Case::Matmul { .. } => "matmul",
            Case::Reduce { .. } => "reduce",
        }
    }

    fn size(&self) -> String {
        match self {
            Case::Stencil { rows, cols } => format!("{rows}x{cols}"),
            Case::Matmul { n } => format!("{n}x{n}"),
            Case::Reduce { n } => format!("{n}"),
        }
    }

    /// Input buffers (seeded), the output's element count, scalars, range and local size.
    fn inputs(&self) -> Launch {
        let values = |n: usize, seed: u32| -> Vec<f32> {
            (0..n)
                .map(|i| ((i as u32).wrapping_mul(2_654_435_761).wrapping_add(seed) >> 8) as f32 / (1 << 24) as f32)
                .collect()
        };
        match *self {
            Case::Stencil { rows, cols } => (
                vec![values(rows * cols, 1)],
                rows * cols,
                vec![rows as i32, cols as i32],
                vec![rows, cols],
                None,
            ),
            Case::Matmul { n } => (
                vec![values(n * n, 2), values(n * n, 3)],
                n * n,
                vec![n as i32],
                vec![n, n],
                Some(vec![16, 16]),
            ),
            Case::Reduce { n } => (
                vec![values(n, 4)],
                n.div_ceil(256),
                vec![n as i32],
                vec![n.div_ceil(256)],
                None,
            ),
        }
    }
}

/// A case's launch: input buffers, the output's element count, scalars, range, local size.
type Launch = (Vec<Vec<f32>>, usize, Vec<i32>, Vec<usize>, Option<Vec<usize>>);

#[derive(Serialize, Debug)]
struct KernelRow {
    kernel: String,
    size: String,
    /// Milliseconds per launch, waited for.
    native_opencl_ms: Spread,
    package_opencl_ms: Spread,
    sandbox_ms: Spread,
    native_c_ms: Spread,
    package_cpu_ms: Spread,
    /// Ratios of medians.
    package_ratio: f64,
    sandbox_ratio: f64,
    cpu_ratio: f64,
}

/// The bench package's directory.
fn bench_package() -> Result<PathBuf> {
    let mut paths = agora_packages::default_paths();
    paths.push(Path::new(env!("CARGO_MANIFEST_DIR")).join("../../examples/packages"));
    paths
        .iter()
        .map(|p| p.join("bench"))
        .find(|p| p.join("package.toml").exists())
        .context("the bench package (examples/packages/bench) was not found: set AGORA_KERNEL_PATH")
}

fn ms(times: &[f64]) -> Spread {
    let v: Vec<f64> = times.iter().map(|t| t * 1e3).collect();
    spread(&v)
}

/// The geometric mean (1 for no values, as a ratio of nothing).
fn geomean(values: impl Iterator<Item = f64>) -> f64 {
    super::harness::geomean(values).unwrap_or(1.0)
}

/// Whether `got` matches `want` within single-precision rounding of sums of up to a few
/// thousand terms.
fn check(what: &str, got: &[f32], want: &[f32]) -> Result<()> {
    ensure!(
        got.len() >= want.len(),
        "{what}: {} elements, expected {}",
        got.len(),
        want.len()
    );
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        if (g - w).abs() > 1e-3 * w.abs().max(1.0) {
            bail!("{what}: element {i} is {g}, expected {w}");
        }
    }
    Ok(())
}

/// Times `launches` launches of `kernel` (with one warm-up) on `queue`, each waited for, and
/// returns the times and the output read back.
#[allow(clippy::too_many_arguments)]
fn through_agora(
    session: &Session,
    kind: DeviceKind,
    kernel: &Kernel,
    inputs: &[Vec<f32>],
    out_len: usize,
    scalars: &[i32],
    range: &[usize],
    launches: usize,
) -> Result<(Vec<f64>, Vec<f32>)> {
    launches_through_agora(session, kind, kernel, inputs, out_len, scalars, range, launches).with_context(|| {
        let what = if kernel.id() & (1 << 31) != 0 {
            "tenant program"
        } else {
            "package"
        };
        format!("{} ({what}) on a queue preferring {}", kernel.name(), kind.name())
    })
}

#[allow(clippy::too_many_arguments)]
fn launches_through_agora(
    session: &Session,
    kind: DeviceKind,
    kernel: &Kernel,
    inputs: &[Vec<f32>],
    out_len: usize,
    scalars: &[i32],
    range: &[usize],
    launches: usize,
) -> Result<(Vec<f64>, Vec<f32>)> {
    let queue = session.queue_with(QueueOptions {
        name: format!("bench kernels {} on {}", kernel.name(), kind.name()),
        class: QueueClass::Batch,
        preferred_device: Some(kind),
        sla: None,
    })?;
    let buffers: Vec<agora::Buffer> = inputs
        .iter()
        .map(|v| session.buffer_from(v))
        .collect::<Result<_, _>>()?;
    let out = session.buffer((out_len * 4) as u64)?;
    for b in &buffers {
        queue.sync_to(b)?;
    }
    let mut args: Vec<Arg<'_>> = buffers.iter().map(Arg::from).collect();
    args.push((&out).into());
    args.extend(scalars.iter().map(|s| Arg::I32(*s)));
    let nd = match *range {
        [x] => agora::NdRange::d1(x as u64),
        [x, y] => agora::NdRange::d2(x as u64, y as u64),
        [x, y, z, ..] => agora::NdRange::d3(x as u64, y as u64, z as u64),
        [] => bail!("an empty range"),
    };
    queue.launch(kernel, &args, nd)?.wait()?;
    let mut times = Vec::with_capacity(launches);
    for _ in 0..launches {
        let start = Instant::now();
        queue.launch(kernel, &args, nd)?.wait()?;
        times.push(start.elapsed().as_secs_f64());
    }
    queue.sync_from(&out)?;
    queue.finish()?;
    Ok((times, out.read_vec()))
}

pub fn kernels(args: KernelsArgs) -> Result<()> {
    let quick = args.quick;
    let launches = args.repetitions.unwrap_or(if quick { 2 } else { 9 }).max(1);
    let cases = if quick {
        vec![
            Case::Stencil { rows: 128, cols: 128 },
            Case::Matmul { n: 64 },
            Case::Reduce { n: 1 << 16 },
        ]
    } else {
        vec![
            Case::Stencil { rows: 1024, cols: 2048 },
            Case::Matmul { n: 256 },
            Case::Reduce { n: 1 << 23 },
        ]
    };
    let dir = bench_package()?;
    let source = std::fs::read_to_string(dir.join("bench.cl")).context("reading bench.cl")?;
    let library = std::fs::read(dir.join("libbench.so"))
        .context("reading libbench.so (built by scripts/build-packages.sh, run by make setup)")?;
    let daemon = DaemonProcess::start(None, &["--kernels", &dir.display().to_string()])?;
    let connect = |name: &str| {
        Session::connect_with(SessionOptions {
            socket: Some(daemon.socket.clone()),
            name: Some(name.into()),
            heap_bytes: Some(512 << 20),
            control_timeout: None,
            reconnect_timeout: None,
        })
    };
    let session = connect("agora bench kernels")?;
    let has_opencl = agora::daemon_status(Some(daemon.socket.clone()))?
        .devices
        .iter()
        .any(|d| d.kind == "opencl");
    ensure!(
        has_opencl,
        "no OpenCL device: this benchmark compares against native OpenCL (run scripts/setup.sh for PoCL)"
    );

    // First build of the tenant program vs the same source from a second session (cached).
    let start = Instant::now();
    // matmul's 16 x 16 work-groups come from its reqd_work_group_size attribute.
    let program = session.program_opencl(&source)?;
    let first_build_ms = start.elapsed().as_secs_f64() * 1e3;
    let second = connect("agora bench kernels (second build)")?;
    let start = Instant::now();
    let again = second.program_opencl(&source)?;
    let cached_build_ms = start.elapsed().as_secs_f64() * 1e3;
    let cache_hit = again.cached();
    drop(again);
    drop(second);

    let native = agora_apps::native::NativeOpenCl::open().map_err(anyhow::Error::msg)?;
    let native_program = native.build(&source).map_err(anyhow::Error::msg)?;
    let mut rows = Vec::new();
    for case in &cases {
        let name = case.kernel();
        let (inputs, out_len, scalars, range, local) = case.inputs();
        if !args.json {
            eprintln!("  {name} {}: ", case.size());
        }
        // The C function called natively: the reference result and the CPU anchor.
        let def = agora_apps::native::kernel_def(&format!("bench.{name}")).map_err(anyhow::Error::msg)?;
        let mut host_inputs = inputs.clone();
        let mut reference = vec![0f32; out_len];
        let mut native_c = Vec::new();
        for _ in 0..=launches {
            let mut values: Vec<agora_kernels::ArgValue> = host_inputs
                .iter_mut()
                .map(|v| agora_kernels::ArgValue::Buffer {
                    ptr: v.as_mut_ptr() as *mut u8,
                    len: (v.len() * 4) as u64,
                })
                .collect();
            values.push(agora_kernels::ArgValue::Buffer {
                ptr: reference.as_mut_ptr() as *mut u8,
                len: (out_len * 4) as u64,
            });
            values.extend(
                scalars
                    .iter()
                    .map(|s| agora_kernels::ArgValue::Scalar(*s as u32 as u64)),
            );
            let nd: Vec<u64> = range.iter().map(|r| *r as u64).collect();
            // SAFETY: every buffer argument points to a live Vec of the length given, which the
            // bench package's size rules require for these scalars; the output is not an input.
            let call = unsafe { agora_kernels::KernelCall::new(&nd, &values) };
            let start = Instant::now();
            def.run_cpu(&call, 0..nd[0])
                .map_err(|e| anyhow::anyhow!("native C {name}: {e}"))?;
            native_c.push(start.elapsed().as_secs_f64());
        }
        native_c.remove(0);

        // Native OpenCL.
        let device_inputs: Vec<_> = inputs
            .iter()
            .map(|v| native.buffer_from(bytemuck::cast_slice(v)))
            .collect::<Result<_, _>>()
            .map_err(anyhow::Error::msg)?;
        let device_out = native
            .buffer_from(&vec![0u8; out_len * 4])
            .map_err(anyhow::Error::msg)?;
        let mut native_args: Vec<agora_apps::native::NativeArg<'_>> = device_inputs
            .iter()
            .map(agora_apps::native::NativeArg::Buffer)
            .collect();
        native_args.push(agora_apps::native::NativeArg::Buffer(&device_out));
        native_args.extend(scalars.iter().map(|s| agora_apps::native::NativeArg::I32(*s)));
        let mut native_cl = native
            .time_launches(
                &native_program,
                name,
                &native_args,
                &range,
                local.as_deref(),
                launches + 1,
            )
            .map_err(anyhow::Error::msg)?;
        native_cl.remove(0);
        let mut back = vec![0f32; out_len];
        native
            .read(&device_out, bytemuck::cast_slice_mut(&mut back))
            .map_err(anyhow::Error::msg)?;
        check(&format!("{name} natively on OpenCL"), &back, &reference)?;

        let package = session.kernel(&format!("bench.{name}"))?;
        let tenant = program
            .kernel(name)
            .with_context(|| format!("the tenant program has no kernel {name}"))?;
        // The same launch three ways through Agora, each result checked against native C.
        let mut agora_times = Vec::new();
        for (kind, kernel, what) in [
            (DeviceKind::OpenCl, &package, "as a package on OpenCL"),
            (DeviceKind::Cpu, &package, "as a package on the CPU"),
            (DeviceKind::Cpu, &tenant, "as a tenant program"),
        ] {
            let (times, out) = through_agora(&session, kind, kernel, &inputs, out_len, &scalars, &range, launches)?;
            check(&format!("{name} {what}"), &out, &reference)?;
            agora_times.push(times);
        }
        let [package_cl, package_cpu, sandbox] = <[Vec<f64>; 3]>::try_from(agora_times).expect("three paths");

        let med = |t: &[f64]| ms(t).median;
        let row = KernelRow {
            kernel: name.to_string(),
            size: case.size(),
            native_opencl_ms: ms(&native_cl),
            package_opencl_ms: ms(&package_cl),
            sandbox_ms: ms(&sandbox),
            native_c_ms: ms(&native_c),
            package_cpu_ms: ms(&package_cpu),
            package_ratio: med(&package_cl) / med(&native_cl),
            sandbox_ratio: med(&sandbox) / med(&native_cl),
            cpu_ratio: med(&package_cpu) / med(&native_c),
        };
        if !args.json {
            eprintln!(
                "    OpenCL native {:.3} ms, package {:.3} ms ({:.3}x), sandbox {:.3} ms ({:.3}x); C native {:.3} ms, package {:.3} ms ({:.3}x)",
                row.native_opencl_ms.median,
                row.package_opencl_ms.median,
                row.package_ratio,
                row.sandbox_ms.median,
                row.sandbox_ratio,
                row.native_c_ms.median,
                row.package_cpu_ms.median,
                row.cpu_ratio
            );
        }
        rows.push(row);
    }

    // The round trip of an empty tenant-program task (a C function that returns at once).
    let manifest = "[kernels.empty]\nparams = [\"unused: i32 readwrite\"]\nsizes = { unused = \"1\" }\ncpu = { symbol = \"bench_empty\" }\n";
    let empty_program = session.program_library(&library, manifest)?;
    let empty = empty_program
        .kernel("empty")
        .context("the empty program has its kernel")?;
    let queue = session.queue_with(QueueOptions {
        name: "bench kernels empty".into(),
        class: QueueClass::Batch,
        preferred_device: Some(DeviceKind::Cpu),
        sla: None,
    })?;
    let unused = session.buffer(4)?;
    let round_trips = if quick { 200 } else { 5000 };
    let mut samples = Vec::with_capacity(round_trips);
    for _ in 0..round_trips + 50 {
        let start = Instant::now();
        queue.launch(&empty, &[(&unused).into()], 1u64)?.wait()?;
        samples.push(start.elapsed().as_nanos() as u64);
    }
    samples.drain(..50);
    samples.sort_unstable();
    let sandbox_empty_p50_ns = super::harness::percentile(&samples, 0.5);
    let sandbox_empty_p99_ns = super::harness::percentile(&samples, 0.99);
    queue.finish()?;

    let package_ratio_geomean = geomean(rows.iter().map(|r| r.package_ratio));
    let sandbox_ratio_geomean = geomean(rows.iter().map(|r| r.sandbox_ratio));
    let cpu_ratio_geomean = geomean(rows.iter().map(|r| r.cpu_ratio));
    if args.json {
        println!(
            "{}",
            serde_json::to_string_pretty(&serde_json::json!({
                "benchmark": "kernels",
                "device": native.device,
                "repetitions": launches,
                "verified": true,
                "kernels": rows,
                "package_ratio_geomean": package_ratio_geomean,
                "sandbox_ratio_geomean": sandbox_ratio_geomean,
                "cpu_ratio_geomean": cpu_ratio_geomean,
                "sandbox_empty_p50_ns": sandbox_empty_p50_ns,
                "sandbox_empty_p99_ns": sandbox_empty_p99_ns,
                "first_build_ms": first_build_ms,
                "cached_build_ms": cached_build_ms,
                "cache_hit": cache_hit,
            }))?
        );
    } else {
        println!(
            "agora bench kernels on {} ({launches} timed launches each, waited for; medians):",
            native.device
        );
        println!(
            "{:<9} {:>10} {:>12} {:>12} {:>8} {:>12} {:>8} {:>10} {:>11} {:>8}",
            "kernel", "size", "native CL", "package", "ratio", "sandbox", "ratio", "native C", "package C", "ratio"
        );
        for r in &rows {
            println!(
                "{:<9} {:>10} {:>9.3} ms {:>9.3} ms {:>8.3} {:>9.3} ms {:>8.3} {:>7.3} ms {:>8.3} ms {:>8.3}",
                r.kernel,
                r.size,
                r.native_opencl_ms.median,
                r.package_opencl_ms.median,
                r.package_ratio,
                r.sandbox_ms.median,
                r.sandbox_ratio,
                r.native_c_ms.median,
                r.package_cpu_ms.median,
                r.cpu_ratio
            );
        }
        println!(
            "geometric means: package {package_ratio_geomean:.3}x native OpenCL, sandboxed tenant program {sandbox_ratio_geomean:.3}x, package C {cpu_ratio_geomean:.3}x native C"
        );
        println!(
            "empty tenant-program task, round trip: p50 {:.1} us, p99 {:.1} us ({round_trips} tasks)",
            sandbox_empty_p50_ns as f64 / 1e3,
            sandbox_empty_p99_ns as f64 / 1e3
        );
        println!(
            "tenant program build: first {first_build_ms:.1} ms, same source from another session {cached_build_ms:.1} ms ({})",
            if cache_hit { "from the program cache" } else { "not cached" }
        );
    }
    Ok(())
}
