//! NVIDIA GPU cases: every library kernel case on a GPU, checked against its host reference;
//! two tenants at once; launches beyond the GPU's grid limits (sliced, or run elsewhere when no
//! slicing fits); a buffer larger than the memory the GPU may use; a tenant's own kernel that
//! writes all over the GPU's address space, fenced into its partition while its neighbour's data
//! stays exact; a tenant's kept GPU memory given back under pressure and when it ends; a
//! package's CUDA C kernel (guarded, so it may be sliced) and a tenant's CUDA C and PTX programs; a
//! tenant's endless kernel stopped at the per-launch limit while a neighbour goes on; a kernel
//! fault that ends the GPU's context, recovered from by the GPU's device host.
//!
//! These need an NVIDIA GPU and its driver, which CI and the development machines lack: they
//! are `#[ignore]`d (listed as ignored, never passed) and run by `scripts/gpu-check.sh` with
//! `--ignored` on a GPU machine, where a daemon without a GPU fails them.

use std::time::Duration;

use agora::{Arg, DeviceKind, QueueOptions, Session};
use agora_kernels::cases;

mod common;
use common::run_case;

/// A daemon with its GPUs and CPU (no OpenCL: a GPU machine's OpenCL may be the same GPU), and a
/// session; fails when the daemon found no GPU.
fn gpu_daemon(tag: &str) -> (common::EmbeddedDaemon, Session) {
    gpu_daemon_with(tag, |_| {})
}

fn gpu_daemon_with(
    tag: &str,
    tweak: impl FnOnce(&mut agora_daemon::DaemonConfig),
) -> (common::EmbeddedDaemon, Session) {
    let (daemon, session) = common::daemon_with(tag, |c| {
        c.strict_coherence = true;
        c.opencl = false;
        tweak(c);
    });
    let status = session.status().unwrap();
    assert!(
        status.devices.iter().any(|d| d.kind == "cuda"),
        "no GPU in the daemon (devices: {:?}): these tests need an NVIDIA GPU and its driver",
        status.devices.iter().map(|d| &d.name).collect::<Vec<_>>()
    );
    (daemon, session)
}

fn gpu_queue(session: &Session, name: &str) -> agora::Queue {
    session
        .queue_with(QueueOptions {
            name: name.into(),
            preferred_device: Some(DeviceKind::Cuda),
            ..Default::default()
        })
        .unwrap()
}

fn gpu_jobs(session: &Session) -> u64 {
    agora_test_support::jobs_on(session, "cuda")
}

#[test]
#[ignore = "needs an NVIDIA GPU: run scripts/gpu-check.sh on a GPU machine"]
fn every_kernel_case_passes_on_the_gpu() {
    let (daemon, session) = gpu_daemon("gpu-suite");
    let queue = gpu_queue(&session, "gpu");
    let all = cases::all();
    let mut failures = Vec::new();
    for case in &all {
        let before = gpu_jobs(&session);
        let started = std::time::Instant::now();
        match run_case(&session, &queue, case) {
            Err(e) => failures.push(format!("{}: {e}", case.name)),
            // It ran on the GPU, not on a device the daemon fell back to.
            Ok(()) if gpu_jobs(&session) == before => failures.push(format!("{}: did not run on the GPU", case.name)),
            Ok(()) => {}
        }
        eprintln!(
            "cuda {:<60} {:>8.1} ms",
            case.name,
            started.elapsed().as_secs_f64() * 1e3
        );
    }
    assert!(
        failures.is_empty(),
        "{} of {} cases failed on the GPU:\n{}",
        failures.len(),
        all.len(),
        failures.join("\n")
    );
    drop(session);
    daemon.stop().unwrap();
}

/// One tenant's saxpy loop on the GPU, checked exactly.
fn tenant(session: Session, n: usize, rounds: usize, a: f32) -> Result<(), String> {
    let queue = gpu_queue(&session, "tenant");
    let saxpy = session.kernel("saxpy").map_err(|e| e.to_string())?;
    let mut x = session.buffer((n * 4) as u64).map_err(|e| e.to_string())?;
    let mut y = session.buffer((n * 4) as u64).map_err(|e| e.to_string())?;
    for (i, v) in x.as_mut_slice::<f32>().iter_mut().enumerate() {
        *v = (i % 1000) as f32;
    }
    y.as_mut_slice::<f32>().fill(1.0);
    let _ = queue.sync_to(&x).map_err(|e| e.to_string())?;
    let _ = queue.sync_to(&y).map_err(|e| e.to_string())?;
    for _ in 0..rounds {
        let _ = queue
            .launch(&saxpy, &[Arg::F32(a), (&x).into(), (&y).into()], n as u64)
            .map_err(|e| e.to_string())?;
    }
    let _ = queue.sync_from(&y).map_err(|e| e.to_string())?;
    queue.finish().map_err(|e| e.to_string())?;
    for (i, v) in y.as_slice::<f32>().iter().enumerate() {
        let mut expected = 1.0f32;
        for _ in 0..rounds {
            expected += a * (i % 1000) as f32;
        }
        if *v != expected {
            return Err(format!("y[{i}] = {v}, expected {expected}"));
        }
    }
    Ok(())
}

#[test]
#[ignore = "needs an NVIDIA GPU: run scripts/gpu-check.sh on a GPU machine"]
fn two_tenants_share_the_gpu_and_both_get_exact_results() {
    let (daemon, session) = gpu_daemon("gpu-tenants");
    let before = gpu_jobs(&session);
    let (one, two) = (daemon.session(), daemon.session());
    let a = std::thread::spawn(move || tenant(one, 1 << 22, 50, 0.5));
    let b = std::thread::spawn(move || tenant(two, 1 << 20, 200, 0.25));
    a.join().unwrap().unwrap();
    b.join().unwrap().unwrap();
    assert!(
        gpu_jobs(&session) >= before + 250,
        "the tenants' launches did not run on the GPU"
    );
    // The driver's own figure of how busy the GPU was (NVML comes with every NVIDIA driver).
    let status = session.status().unwrap();
    let gpu = status.devices.iter().find(|d| d.kind == "cuda").unwrap();
    println!("GPU utilisation after the tenants ran: {:?} %", gpu.utilization_percent);
    assert!(
        gpu.utilization_percent.is_some_and(|p| p <= 100),
        "no utilisation figure from NVML for {}",
        gpu.name
    );
    drop(session);
    daemon.stop().unwrap();
}

#[test]
#[ignore = "needs an NVIDIA GPU: run scripts/gpu-check.sh on a GPU machine"]
fn a_launch_beyond_one_grid_is_sliced_and_completes() {
    let (daemon, session) = gpu_daemon("gpu-limits");
    let queue = gpu_queue(&session, "big");
    let noop = session.kernel("noop").unwrap();
    let before = gpu_jobs(&session);
    // 2^33 threads: more than one command takes (2^32), so at least two slices.
    let task = queue.launch(&noop, &[], 1u64 << 33).unwrap();
    task.wait().unwrap();
    assert!(gpu_jobs(&session) > before, "did not run on the GPU");
    // The daemon and the GPU still work.
    agora_test_support::saxpy_ok(&session, 1 << 16);
    assert!(agora_test_support::eventually(Duration::from_secs(5), || session
        .status()
        .is_ok()));
    drop(session);
    daemon.stop().unwrap();
}

#[test]
#[ignore = "needs an NVIDIA GPU: run scripts/gpu-check.sh on a GPU machine"]
fn a_launch_no_grid_takes_runs_elsewhere_with_the_right_result() {
    let (daemon, session) = gpu_daemon("gpu-grid");
    let queue = gpu_queue(&session, "wide");
    let sgemm = session.kernel("sgemm").unwrap();
    // 1 x 2 000 000 x 1: 125 000 blocks of 16 columns in dimension 1, beyond the 65 535 a grid
    // takes there (dimension 1 is never sliced): the GPU refuses it before the driver sees it.
    let n = 2_000_000u64;
    let a = session.buffer_from(&[3.0f32]).unwrap();
    let mut b = session.buffer(n * 4).unwrap();
    for (j, v) in b.as_mut_slice::<f32>().iter_mut().enumerate() {
        *v = (j % 977) as f32;
    }
    let c = session.buffer(n * 4).unwrap();
    let args = [
        Arg::I32(1),
        Arg::I32(n as i32),
        Arg::I32(1),
        Arg::F32(1.0),
        (&a).into(),
        (&b).into(),
        Arg::F32(0.0),
        (&c).into(),
    ];
    let _ = queue.sync_to(&a).unwrap();
    let _ = queue.sync_to(&b).unwrap();
    let task = queue.launch(&sgemm, &args, agora::NdRange::d2(1, n)).unwrap();
    let _ = queue.sync_from(&c).unwrap();
    queue.finish().unwrap();
    task.wait().unwrap();
    let ran_on = agora_test_support::last_device(&session, "wide");
    for (j, v) in c.as_slice::<f32>().iter().enumerate().step_by(4999) {
        assert_eq!(*v, 3.0 * (j % 977) as f32, "c[{j}] (ran on {ran_on:?})");
    }
    assert_ne!(
        ran_on.as_deref(),
        Some("cuda0"),
        "a launch beyond the grid reached the GPU"
    );
    agora_test_support::saxpy_ok(&session, 1 << 16);
    drop(session);
    daemon.stop().unwrap();
}

#[test]
#[ignore = "needs an NVIDIA GPU: run scripts/gpu-check.sh on a GPU machine"]
fn a_buffer_larger_than_the_gpu_may_use_runs_elsewhere_or_fails_saying_so() {
    let (daemon, session) = gpu_daemon_with("gpu-too-big", |c| c.cuda_memory_limit = 64 << 20);
    let queue = gpu_queue(&session, "big");
    let fill = session.kernel("fill").unwrap();
    let n = (128u64 << 20) / 4;
    let y = session.buffer(n * 4).unwrap();
    let task = queue.launch(&fill, &[Arg::F32(2.5), (&y).into()], n).unwrap();
    let _ = queue.sync_from(&y);
    let finished = queue.finish();
    match task.wait() {
        Ok(()) => {
            finished.unwrap();
            assert!(y.as_slice::<f32>().iter().step_by(4096).all(|v| *v == 2.5));
            let ran_on = agora_test_support::last_device(&session, "big");
            assert_ne!(
                ran_on.as_deref(),
                Some("cuda0"),
                "128 MiB placed on a GPU limited to 64 MiB"
            );
        }
        Err(e) => {
            let text = e.to_string();
            assert!(
                text.contains("device") || text.contains("memory"),
                "unclear error: {text}"
            );
        }
    }
    agora_test_support::saxpy_ok(&session, 1 << 16);
    drop(session);
    daemon.stop().unwrap();
}

/// The GPU memory the daemon keeps for tenants beyond their buffers, once no buffer is left
/// (releases reach the daemon asynchronously: polled for up to 5 s).
fn kept_when_idle(session: &Session) -> u64 {
    let deadline = std::time::Instant::now() + Duration::from_secs(5);
    loop {
        let status = session.status().unwrap();
        let gpu = status.devices.iter().find(|d| d.kind == "cuda").unwrap();
        if gpu.memory_used == 0 || std::time::Instant::now() > deadline {
            assert_eq!(gpu.memory_used, 0, "a released buffer still holds GPU memory");
            return gpu.memory_cached;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// One run of a program that allocates a 40 MiB buffer, fills it on the GPU, checks it and
/// releases it.
fn forty_mebibytes_on_the_gpu(session: &Session, value: f32) {
    let queue = gpu_queue(session, "kept");
    let fill = session.kernel("fill").unwrap();
    let n = (40u64 << 20) / 4;
    let y = session.buffer(n * 4).unwrap();
    queue.launch(&fill, &[Arg::F32(value), (&y).into()], n).unwrap();
    queue.sync_from(&y).unwrap();
    queue.finish().unwrap();
    assert!(y.as_slice::<f32>().iter().step_by(1024).all(|v| *v == value));
    assert_eq!(
        agora_test_support::last_device(session, "kept").as_deref(),
        Some("cuda0"),
        "the fill did not run on the GPU"
    );
}

#[test]
#[ignore = "needs an NVIDIA GPU: run scripts/gpu-check.sh on a GPU machine"]
fn a_tenant_s_kept_gpu_memory_goes_to_its_neighbour_under_pressure_and_with_its_end() {
    // 64 MiB may be used: a 40 MiB buffer maps a 64 MiB partition, so two tenants' kept
    // partitions cannot both stay.
    let (daemon, observer) = gpu_daemon_with("gpu-kept", |c| c.cuda_memory_limit = 64 << 20);
    let (one, two) = (daemon.session(), daemon.session());
    forty_mebibytes_on_the_gpu(&one, 1.5);
    assert_eq!(
        kept_when_idle(&observer),
        64 << 20,
        "the first tenant's partition is kept for its next buffers"
    );
    forty_mebibytes_on_the_gpu(&one, 2.5);
    assert_eq!(
        kept_when_idle(&observer),
        64 << 20,
        "its second run reused what it kept"
    );
    forty_mebibytes_on_the_gpu(&two, 3.5);
    assert_eq!(
        kept_when_idle(&observer),
        64 << 20,
        "the neighbour's growth past the limit took back the first tenant's kept memory"
    );
    drop(two);
    let deadline = std::time::Instant::now() + Duration::from_secs(5);
    while kept_when_idle(&observer) > 0 && std::time::Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(20));
    }
    assert_eq!(
        kept_when_idle(&observer),
        0,
        "an ended tenant's partition is given back"
    );
    forty_mebibytes_on_the_gpu(&one, 4.5);
    agora_test_support::saxpy_ok(&one, 1 << 16);
    drop((one, observer));
    daemon.stop().unwrap();
}

/// A tenant's own kernel that writes and atomically updates addresses it computes from scalars,
/// far outside its buffer: unfenced, it would write other tenants' memory or fault the context.
const STRAY_WRITER: &str = "__kernel void stray(__global float *out, const long delta, const long stride) {\n\
    size_t i = get_global_id(0);\n\
    __global float *p = out + delta + (long)i * stride;\n\
    *p = 13.0f;\n\
    atomic_add((__global int *)(p + 1), 7);\n\
}";

#[test]
#[ignore = "needs an NVIDIA GPU: run scripts/gpu-check.sh on a GPU machine"]
fn a_tenant_kernel_writing_out_of_bounds_is_fenced_and_its_neighbour_stays_exact() {
    let (daemon, session) = gpu_daemon_with("gpu-fence", |c| {
        if c.program_executor.is_none() {
            // The agora binary runs tenant programs' executors (gpu-check.sh sets AGORA_EXECUTOR).
            c.program_executor = std::env::var_os("AGORA_EXECUTOR").map(Into::into);
        }
        assert!(
            c.program_executor.is_some(),
            "set AGORA_EXECUTOR to the agora binary: tenant programs need their executor"
        );
        assert!(c.programs_on_gpus, "tenant programs run on GPUs by default");
    });
    // The neighbour: 64 MiB with a pattern, left on the GPU while the stray kernel runs.
    let neighbour = daemon.session();
    let queue = gpu_queue(&neighbour, "neighbour");
    let floats = 16usize << 20;
    let mut data = neighbour.buffer((floats * 4) as u64).unwrap();
    for (i, v) in data.as_mut_slice::<f32>().iter_mut().enumerate() {
        *v = (i % 4093) as f32;
    }
    let scale = neighbour.kernel("stream.scale").unwrap();
    let scratch = neighbour.buffer((floats * 4) as u64).unwrap();
    let _ = queue.sync_to(&data).unwrap();
    // On the GPU: scratch = 1 * data (the data is resident there from now on).
    let _ = queue
        .launch(
            &scale,
            &[Arg::F32(1.0), (&data).into(), (&scratch).into()],
            floats as u64,
        )
        .unwrap();
    queue.finish().unwrap();

    // The attacker's own program, fenced on the GPU.
    let attacker = daemon.session();
    let program = attacker.program_opencl(STRAY_WRITER).unwrap();
    let stray = program.kernel("stray").unwrap();
    let attack = gpu_queue(&attacker, "attack");
    let mine = attacker.buffer(1 << 20).unwrap();
    let before = gpu_jobs(&session);
    // 2^20 threads 2^16 floats (256 KiB) apart, from 4 GiB below to 4 GiB above its buffer, and
    // beyond: 256 GiB of addresses, every other tenant's memory included.
    for delta in [-(1i64 << 30), -(1 << 20), 1 << 18, 1 << 30, 1 << 36] {
        let task = attack
            .launch(
                &stray,
                &[(&mine).into(), Arg::I64(delta), Arg::I64(1 << 16)],
                1u64 << 20,
            )
            .unwrap();
        task.wait()
            .unwrap_or_else(|e| panic!("the fenced stray launch (delta {delta}) failed: {e}"));
    }
    attack.finish().unwrap();
    assert!(
        gpu_jobs(&session) >= before + 5,
        "the tenant's kernel did not run on the GPU (jobs {before} -> {})",
        gpu_jobs(&session)
    );

    // The neighbour's data, on the GPU and read back, is exact; the GPU still works for both.
    let _ = queue
        .launch(
            &scale,
            &[Arg::F32(2.0), (&data).into(), (&scratch).into()],
            floats as u64,
        )
        .unwrap();
    let _ = queue.sync_from(&data).unwrap();
    let _ = queue.sync_from(&scratch).unwrap();
    queue.finish().unwrap();
    let wrong = data
        .as_slice::<f32>()
        .iter()
        .zip(scratch.as_slice::<f32>())
        .enumerate()
        .filter(|(i, (d, s))| **d != (i % 4093) as f32 || **s != 2.0 * (i % 4093) as f32)
        .count();
    assert_eq!(wrong, 0, "{wrong} of the neighbour's values changed");
    agora_test_support::saxpy_ok(&attacker, 1 << 16);
    let status = session.status().unwrap();
    assert!(
        status.devices.iter().any(|d| d.kind == "cuda" && !d.failed),
        "the GPU failed: {:?}",
        status.devices
    );
    drop((attacker, neighbour, session));
    daemon.stop().unwrap();
}

/// The example imaging package's CUDA C (`examples/packages/imaging/imaging.cu`), as a package of
/// its own with no C library, so only a GPU implements its kernel.
const IMAGING_CUDA: &str = include_str!("../../../examples/packages/imaging/imaging.cu");

#[test]
#[ignore = "needs an NVIDIA GPU: run scripts/gpu-check.sh on a GPU machine"]
fn a_package_s_cuda_c_kernel_runs_on_the_gpu_and_exact_however_it_is_sliced() {
    let dir = agora_test_support::temp_dir("gpu-cuda-package");
    let package = dir.path().join("gpuimaging");
    std::fs::create_dir_all(&package).unwrap();
    std::fs::write(package.join("imaging.cu"), IMAGING_CUDA).unwrap();
    std::fs::write(
        package.join("package.toml"),
        r#"[package]
name = "gpuimaging"

[kernels.scale]
params = ["a: f32", "x: f32 read", "y: f32 write"]
sizes = { x = "range0", y = "range0" }
chunkable = true
cost_ns_per_item = 0.5
cuda = { file = "imaging.cu", entry = "imaging_scale_cuda" }
"#,
    )
    .unwrap();
    let (daemon, session) = gpu_daemon_with("gpu-cuda-package", |c| {
        c.kernel_paths = vec![package.clone()];
        // Slices of about 50 us: a 2^26-item launch is cut into several.
        c.preempt_target = Duration::from_micros(50);
    });
    let scale = session.kernel("gpuimaging.scale").unwrap();
    let queue = gpu_queue(&session, "package");
    let n = 1usize << 26;
    let x: Vec<f32> = (0..n).map(|i| (i % 1021) as f32).collect();
    let bx = session.buffer_from(&x).unwrap();
    let by = session.buffer_from(&vec![-1f32; n]).unwrap();
    let before = gpu_jobs(&session);
    let _ = queue.sync_to(&bx).unwrap();
    for _ in 0..3 {
        let _ = queue
            .launch(&scale, &[Arg::F32(1.5), (&bx).into(), (&by).into()], n as u64)
            .unwrap();
    }
    let _ = queue.sync_from(&by).unwrap();
    queue.finish().unwrap();
    let jobs = gpu_jobs(&session) - before;
    println!("3 launches of the package's CUDA C kernel ran as {jobs} GPU jobs");
    assert!(jobs >= 3, "the package's kernel did not run on the GPU");
    let wrong = by
        .as_slice::<f32>()
        .iter()
        .enumerate()
        .filter(|(i, v)| **v != 1.5 * (i % 1021) as f32)
        .count();
    assert_eq!(wrong, 0, "{wrong} of {n} values wrong");
    drop(session);
    daemon.stop().unwrap();
}

#[test]
#[ignore = "needs an NVIDIA GPU: run scripts/gpu-check.sh on a GPU machine"]
fn a_tenant_s_cuda_c_and_ptx_programs_run_fenced_on_the_gpu_and_exact() {
    let (daemon, session) = gpu_daemon("gpu-cuda-programs");
    let (source, manifest) = agora_test_support::TENANT_CUDA;
    let program = session.program_cuda(source, manifest).unwrap();
    assert!(
        !program.build_log().contains("no device"),
        "the daemon says no device runs it: {}",
        program.build_log()
    );
    let (ptx, ptx_manifest) = agora_test_support::TENANT_PTX;
    let filled = session.program_ptx(ptx, ptx_manifest).unwrap();
    let (saxpy, count, fill) = (
        program.kernel("saxpy").unwrap(),
        program.kernel("count").unwrap(),
        filled.kernel("fill").unwrap(),
    );
    let queue = gpu_queue(&session, "programs");
    // A range that is no multiple of 256 (the plain convention's grid covers it exactly).
    let n = (1usize << 20) + 3;
    let x: Vec<f32> = (0..n).map(|i| (i % 977) as f32).collect();
    let bx = session.buffer_from(&x).unwrap();
    let by = session.buffer_from(&vec![0f32; n]).unwrap();
    let hits = session.buffer_from(&[0i32]).unwrap();
    let before = gpu_jobs(&session);
    let _ = queue.sync_to(&bx).unwrap();
    let _ = queue.launch(&fill, &[(&by).into(), Arg::F32(2.0)], n as u64).unwrap();
    let _ = queue
        .launch(&saxpy, &[Arg::F32(3.0), (&bx).into(), (&by).into()], n as u64)
        .unwrap();
    let _ = queue.sync_to(&hits).unwrap();
    let _ = queue.launch(&count, &[(&hits).into()], 4099u64).unwrap();
    let _ = queue.sync_from(&by).unwrap();
    let _ = queue.sync_from(&hits).unwrap();
    queue.finish().unwrap();
    assert!(gpu_jobs(&session) >= before + 3, "the programs did not run on the GPU");
    let wrong = by
        .as_slice::<f32>()
        .iter()
        .enumerate()
        .filter(|(i, v)| **v != 3.0 * (i % 977) as f32 + 2.0)
        .count();
    assert_eq!(wrong, 0, "{wrong} of {n} values wrong");
    assert_eq!(hits.as_slice::<i32>()[0], 4099, "one atomic add per work item");
    // PTX the fence accepts but the driver's JIT does not (an undeclared register): the build
    // fails with the JIT's log, not the first launch.
    let broken = ptx.replace("mov.u32 \t%r1, %ctaid.x;", "mov.u32 \t%r99, %ctaid.x;");
    assert_ne!(broken, ptx, "the test's edit applies");
    match session.program_ptx(&broken, ptx_manifest) {
        Err(agora::Error::Control(agora_protocol::control::ControlError::ProgramBuild { log, .. })) => {
            println!("the JIT's refusal: {log}");
            assert!(log.contains("r99"), "the build error lacks the JIT's log: {log}");
        }
        other => panic!("PTX that does not JIT-compile built: {other:?}"),
    }
    agora_test_support::saxpy_ok(&session, 1 << 16);
    drop(session);
    daemon.stop().unwrap();
}

#[test]
#[ignore = "needs an NVIDIA GPU: run scripts/gpu-check.sh on a GPU machine"]
fn a_tenant_kernel_that_loops_forever_is_stopped_at_the_limit_and_the_gpu_goes_on() {
    let limit = Duration::from_millis(500);
    let (daemon, session) = gpu_daemon_with("gpu-endless", |c| c.program_timeout = limit);
    let endless = r#"extern "C" __global__ void endless(float *y) {
    unsigned long long i = blockIdx.x * (unsigned long long)blockDim.x + threadIdx.x;
    while (y[i] >= 0.0f) { y[i] += 1.0f; if (y[i] > 1.0e30f) y[i] = 0.0f; }
}"#;
    let manifest = "[kernels.endless]\nparams = [\"y: f32 readwrite\"]\nsizes = { y = \"range0\" }\n";
    let program = session.program_cuda(endless, manifest).unwrap();
    let queue = gpu_queue(&session, "endless");
    let y = session.buffer_from(&vec![0f32; 1 << 16]).unwrap();
    let _ = queue.sync_to(&y).unwrap();
    // A neighbour keeps the GPU busy meanwhile, and must not notice.
    let neighbour = daemon.session();
    let busy = std::thread::spawn(move || tenant(neighbour, 1 << 20, 40, 0.5));
    let started = std::time::Instant::now();
    let task = queue
        .launch(&program.kernel("endless").unwrap(), &[(&y).into()], 1u64 << 16)
        .unwrap();
    let outcome = task.wait();
    let took = started.elapsed();
    println!("the endless kernel ended after {took:?}: {outcome:?}");
    match outcome {
        Err(agora::Error::Task(agora::TaskError::KernelTimeout { limit_ms })) => {
            assert_eq!(limit_ms, limit.as_millis() as u64)
        }
        other => panic!("an endless kernel did not time out: {other:?}"),
    }
    assert!(took < limit * 10, "stopped only after {took:?} (limit {limit:?})");
    let _ = queue.finish();
    busy.join().unwrap().unwrap();
    // The GPU and the session go on.
    agora_test_support::saxpy_ok(&session, 1 << 16);
    let status = session.status().unwrap();
    assert!(
        status.devices.iter().any(|d| d.kind == "cuda" && !d.failed),
        "the GPU failed: {:?}",
        status.devices
    );
    drop(session);
    daemon.stop().unwrap();
}

/// The `agora` binary whose `device-host` subcommand serves the GPU in the fault test (the other
/// GPU tests run the GPU in the daemon, as an embedded daemon without an executor binary does):
/// `$AGORA_EXECUTOR`, else dist/gpu/agora (gpu-check.sh runs from the repository's root), else
/// the workspace's release build.
fn agora_binary() -> std::path::PathBuf {
    std::env::var_os("AGORA_EXECUTOR")
        .map(std::path::PathBuf::from)
        .into_iter()
        .chain(["dist/gpu/agora", "../../dist/gpu/agora", "../../target/release/agora"].map(Into::into))
        .find(|p| p.is_file())
        .expect("no agora binary for the device host: set AGORA_EXECUTOR")
}

/// Issue 24 item 5: a trusted package's kernel that writes to an illegal address ends the GPU's
/// CUDA context, which no stream in it survives. With the GPU in a device host (the default),
/// the faulting task fails with `KernelFault`, a neighbour's tasks on the GPU are replayed or
/// fail honestly (never a wrong result), and the GPU comes back with a fresh context and takes
/// new work. Prints the recovery time: from the fault's report to the GPU back in service.
#[test]
#[ignore = "needs an NVIDIA GPU: run scripts/gpu-check.sh on a GPU machine"]
fn a_kernel_fault_fails_its_task_and_the_gpu_comes_back_with_a_fresh_context() {
    let dir = agora_test_support::temp_dir("gpu-fault");
    let package = dir.path().join("gpufault");
    std::fs::create_dir_all(&package).unwrap();
    std::fs::write(
        package.join("fault.cu"),
        r#"extern "C" __global__ void fault_when(float a, float *y) {
    unsigned long long i = blockIdx.x * (unsigned long long)blockDim.x + threadIdx.x;
    if (a > 0.0f) {
        *(volatile int *)(0x10ULL + i) = 1;  /* an illegal address: the context is lost */
    } else {
        y[i] = 1.0f;
    }
}
"#,
    )
    .unwrap();
    std::fs::write(
        package.join("package.toml"),
        r#"[package]
name = "gpufault"

[kernels.fault_when]
params = ["a: f32", "y: f32 write"]
sizes = { y = "range0" }
cost_ns_per_item = 0.5
cuda = { file = "fault.cu", entry = "fault_when" }
"#,
    )
    .unwrap();
    let agora = agora_binary();
    let (daemon, session) = gpu_daemon_with("gpu-fault", |c| {
        c.kernel_paths = vec![package.clone()];
        c.program_executor = Some(agora.clone());
        c.cuda_device_host = true;
    });
    let gpu = |session: &Session| {
        session
            .status()
            .unwrap()
            .devices
            .into_iter()
            .find(|d| d.kind == "cuda")
            .unwrap()
    };
    assert!(
        gpu(&session).description.contains("device host"),
        "{}",
        gpu(&session).description
    );
    // The kernel works when it does not fault: the GPU runs it.
    let fault_when = session.kernel("gpufault.fault_when").unwrap();
    let queue = gpu_queue(&session, "faulting");
    let n = 1usize << 20;
    let y = session.buffer_from(&vec![0f32; n]).unwrap();
    let _ = queue
        .launch(&fault_when, &[Arg::F32(0.0), (&y).into()], n as u64)
        .unwrap();
    let _ = queue.sync_from(&y).unwrap();
    queue.finish().unwrap();
    assert!(y.as_slice::<f32>().iter().all(|v| *v == 1.0));

    // A neighbour keeps the GPU busy with verified saxpy rounds meanwhile.
    let neighbour = daemon.session();
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let neighbour_stop = stop.clone();
    let worker = std::thread::spawn(move || {
        let mut outcomes = Vec::new();
        while !neighbour_stop.load(std::sync::atomic::Ordering::Relaxed) {
            outcomes.push(tenant(neighbour.clone(), 1 << 20, 4, 2.0));
        }
        outcomes
    });
    std::thread::sleep(Duration::from_millis(500));

    let task = queue
        .launch(&fault_when, &[Arg::F32(1.0), (&y).into()], n as u64)
        .unwrap();
    let outcome = task.wait();
    let failed_at = std::time::Instant::now();
    assert!(
        matches!(outcome, Err(agora::Error::Task(agora::TaskError::KernelFault))),
        "the faulting task: {outcome:?}"
    );
    // The GPU comes back: a new host, a fresh context.
    let mut back = false;
    for _ in 0..300 {
        let report = gpu(&session);
        if !report.failed && report.description.contains("restarted 1 time") {
            back = true;
            break;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    let recovery = failed_at.elapsed();
    assert!(back, "the GPU did not come back: {}", gpu(&session).description);
    let described = gpu(&session).description;
    assert!(
        described.contains("a kernel fault made its device unusable"),
        "agora status says why the host was replaced: {described}"
    );
    println!("the GPU was back in service {recovery:?} after the fault was reported");
    std::thread::sleep(Duration::from_millis(500));
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    let outcomes = worker.join().unwrap();
    let failed: Vec<&String> = outcomes.iter().filter_map(|o| o.as_ref().err()).collect();
    println!(
        "neighbour: {} rounds, {} failed: {failed:?}",
        outcomes.len(),
        failed.len()
    );
    assert!(
        failed.iter().all(|e| !e.contains("expected")),
        "a neighbour's round reported a wrong result: {failed:?}"
    );
    assert!(
        failed.len() <= 2,
        "the fault cost the neighbour more than its rounds in flight"
    );
    // New work reaches the GPU and is exact.
    let before = gpu_jobs(&session);
    tenant(session.clone(), 1 << 20, 2, 3.0).unwrap();
    assert!(gpu_jobs(&session) > before, "no new work on the restarted GPU");
    drop(session);
    daemon.stop().unwrap();
}
