//! Preemption. Chunked launch: batch kernels split into row slices give exactly the results of
//! unsplit launches, and a latency-class task issued while a long batch kernel runs on the only
//! lane starts at the next slice boundary instead of after the whole kernel — on the CPU and on
//! OpenCL (PoCL here; the OpenCL tests fail, not skip, without it). Revocation: with slicing off,
//! the latency task revokes the running kernel, which is replayed from its saved inputs and still
//! gives exact results, for every bundled program.

use std::time::{Duration, Instant};

use agora::{Arg, DeviceKind, QueueClass, QueueOptions, Session, SessionOptions};
use agora_daemon::policy::latency::LatencyPolicy;
use agora_daemon::DaemonConfig;
use agora_test_support::EmbeddedDaemon;

fn start(tag: &str, tweak: impl FnOnce(&mut DaemonConfig)) -> (EmbeddedDaemon, Session) {
    let daemon = EmbeddedDaemon::start(&format!("preempt-{tag}"), |config| {
        config.opencl = false;
        tweak(config);
    });
    let session = daemon.session();
    (daemon, session)
}

/// Runs every bundled program on `kind` with preemption target `target` (2 µs splits nearly every
/// launch into many slices: up to one per row on the CPU, one per work-group row on OpenCL);
/// returns how many jobs the lanes of `kind` ran.
fn every_program_verifies(kind: DeviceKind, tag: &str, target: Duration) -> u64 {
    let (daemon, session) = start(tag, |c| {
        c.preempt_target = target;
        c.inline_max_ns = 0;
        c.opencl = kind == DeviceKind::OpenCl;
        c.opencl_lanes = 1;
    });
    for (program, _) in agora_apps::PROGRAMS {
        let size = match *program {
            "gaussian" => 64,
            "hotspot" => 64,
            "nw" => 256,
            "pathfinder" => 2000,
            "lavamd" => 2,
            "backprop" => 1024,
            _ => 4096,
        };
        let workload = agora_apps::build(program, size, None).unwrap();
        let report = agora_apps::run_on_agora(&session, &workload, Some(kind)).unwrap();
        assert!(report.verified, "{kind:?} {program}: max error {}", report.max_error);
    }
    let jobs = agora_test_support::jobs_on(&session, kind.name());
    drop(session);
    daemon.stop().unwrap();
    jobs
}

#[test]
fn every_program_verifies_with_its_kernels_cut_into_tiny_slices() {
    every_program_verifies(DeviceKind::Cpu, "slices", Duration::from_micros(2));
}

#[test]
fn every_program_verifies_on_opencl_with_its_kernels_cut_into_tiny_slices() {
    let whole = every_program_verifies(DeviceKind::OpenCl, "ocl-whole", Duration::ZERO);
    let sliced = every_program_verifies(DeviceKind::OpenCl, "ocl-slices", Duration::from_micros(2));
    // The launches ran on OpenCL, and as slices: more jobs than tasks.
    assert!(
        whole > 0 && sliced > whole,
        "OpenCL lanes ran {sliced} jobs sliced, {whole} whole"
    );
}

/// Issues a long batch sgemm on the only lane of `kind`, then a small latency-class task; returns
/// how long the latency task took and whether it finished before the batch task.
fn latency_beside_batch(session: &Session, kind: DeviceKind) -> (Duration, bool) {
    let sgemm = session.kernel("sgemm").unwrap();
    let n = 768usize;
    let a = session.buffer_from(&vec![1.0f32; n * n]).unwrap();
    let c = session.buffer((n * n * 4) as u64).unwrap();
    let batch = session
        .queue_with(QueueOptions {
            name: "batch".into(),
            class: QueueClass::Batch,
            preferred_device: Some(kind),
            sla: None,
        })
        .unwrap();
    let latency = session
        .queue_with(QueueOptions {
            name: "latency".into(),
            class: QueueClass::Latency,
            preferred_device: Some(kind),
            sla: None,
        })
        .unwrap();
    let small_a = session.buffer_from(&vec![1.0f32; 32 * 32]).unwrap();
    let small_c = session.buffer((32 * 32 * 4) as u64).unwrap();
    let nn = n as u32;
    let big = batch
        .launch(
            &sgemm,
            &[
                Arg::I32(nn as i32),
                Arg::I32(nn as i32),
                Arg::I32(nn as i32),
                Arg::F32(1.0),
                (&a).into(),
                (&a).into(),
                Arg::F32(0.0),
                (&c).into(),
            ],
            agora::NdRange::d2(n as u64, n as u64),
        )
        .unwrap();
    // Wait until the batch kernel is running on a lane of `kind` (a fixed sleep was not enough on
    // a loaded machine: the latency task then reached the lane first, ahead of the queued batch
    // job, and overtook it without any slicing).
    let running = agora_test_support::eventually(Duration::from_secs(10), || {
        session
            .status()
            .unwrap()
            .devices
            .iter()
            .filter(|d| d.kind == kind.name())
            .any(|d| d.lanes.iter().any(|l| l.busy))
    });
    assert!(running, "the batch kernel never started on a {kind:?} lane");
    std::thread::sleep(Duration::from_millis(2));
    let issued = Instant::now();
    let small = latency
        .launch(
            &sgemm,
            &[
                Arg::I32(32),
                Arg::I32(32),
                Arg::I32(32),
                Arg::F32(1.0),
                (&small_a).into(),
                (&small_a).into(),
                Arg::F32(0.0),
                (&small_c).into(),
            ],
            agora::NdRange::d2(32, 32),
        )
        .unwrap();
    small.wait().unwrap();
    let took = issued.elapsed();
    let batch_still_running = !big.is_complete().unwrap();
    big.wait().unwrap();
    // Results on a device with memory of its own come back to the host copies.
    batch.sync_from(&c).unwrap().wait().unwrap();
    latency.sync_from(&small_c).unwrap().wait().unwrap();
    assert!(
        c.as_slice::<f32>().iter().all(|v| *v == n as f32),
        "the batch result is exact"
    );
    assert!(
        small_c.as_slice::<f32>().iter().all(|v| *v == 32.0),
        "the latency result is exact"
    );
    (took, batch_still_running)
}

#[test]
fn a_latency_task_overtakes_a_running_batch_kernel_at_a_slice_boundary() {
    let one_lane = |c: &mut DaemonConfig| {
        c.cpu_lanes = 1;
        c.cpu_threads_per_lane = 1;
        c.inline_max_ns = 0;
    };
    let (daemon, session) = start("overtake", one_lane);
    let (took, overtook) = latency_beside_batch(&session, DeviceKind::Cpu);
    assert!(
        overtook,
        "the latency task (took {took:?}) should finish while the batch kernel still runs"
    );
    drop(session);
    daemon.stop().unwrap();
    // Without slicing the same latency task waits for the whole batch kernel.
    let (daemon, session) = start("no-slices", |c| {
        one_lane(c);
        c.preempt_target = Duration::ZERO;
        c.latency_policy = LatencyPolicy::None;
    });
    let (_, overtook) = latency_beside_batch(&session, DeviceKind::Cpu);
    assert!(
        !overtook,
        "without slicing the latency task cannot start before the batch kernel ends"
    );
    drop(session);
    daemon.stop().unwrap();
}

#[test]
fn a_latency_task_overtakes_a_running_batch_kernel_on_opencl() {
    let one_lane = |c: &mut DaemonConfig| {
        c.opencl = true;
        c.opencl_lanes = 1;
        c.inline_max_ns = 0;
    };
    let (daemon, session) = start("ocl-overtake", one_lane);
    // The first run builds the program and PoCL's specialisations (with and without a global
    // offset); the lane thread, blocked in those builds, would let the latency task in anyway.
    let _ = latency_beside_batch(&session, DeviceKind::OpenCl);
    let (took, overtook) = latency_beside_batch(&session, DeviceKind::OpenCl);
    eprintln!("latency task beside a sliced batch sgemm on OpenCL: {took:?}, overtook: {overtook}");
    assert!(
        overtook,
        "the latency task (took {took:?}) should finish while the batch kernel still runs"
    );
    drop(session);
    daemon.stop().unwrap();
    // Without slicing the same latency task waits for the whole batch kernel.
    let (daemon, session) = start("ocl-no-slices", |c| {
        one_lane(c);
        c.preempt_target = Duration::ZERO;
    });
    let (_, overtook) = latency_beside_batch(&session, DeviceKind::OpenCl);
    assert!(
        !overtook,
        "without slicing the latency task cannot start before the batch kernel ends"
    );
    drop(session);
    daemon.stop().unwrap();
}

#[test]
fn a_latency_task_revokes_a_running_batch_kernel_which_is_replayed_exactly() {
    let (daemon, session) = start("revoke", |c| {
        c.cpu_lanes = 1;
        c.cpu_threads_per_lane = 1;
        c.inline_max_ns = 0;
        c.preempt_target = Duration::ZERO;
        c.latency_policy = LatencyPolicy::Priority;
    });
    let (took, overtook) = latency_beside_batch(&session, DeviceKind::Cpu);
    assert!(
        overtook,
        "the latency task (took {took:?}) should finish while the revoked batch kernel is replayed"
    );
    let status = session.status().unwrap();
    assert!(status.revocations >= 1, "the batch kernel was revoked: {status:?}");
    assert!(status.revoked_work_s > 0.0);
    drop(session);
    daemon.stop().unwrap();
}

#[test]
fn every_program_verifies_while_latency_tasks_keep_revoking_its_kernels() {
    revoke_every_program(DeviceKind::Cpu);
}

#[test]
fn every_program_verifies_on_opencl_while_latency_tasks_keep_revoking_its_kernels() {
    // On a device with memory of its own the saved copies come from device memory and are
    // written back by the replay's transfers.
    revoke_every_program(DeviceKind::OpenCl);
}

#[test]
#[ignore = "needs an NVIDIA GPU: run scripts/gpu-check.sh on a GPU machine"]
fn every_program_verifies_on_a_gpu_while_latency_tasks_keep_revoking_its_kernels() {
    // The running kernel polls its lane's flag in mapped host memory, which the completion
    // thread keeps equal to the job's flag.
    revoke_every_program(DeviceKind::Cuda);
}

fn revoke_every_program(kind: DeviceKind) {
    // Every launch is revocable (no slicing, no minimum length) and a second client issues a
    // latency task every few hundred microseconds, so kernels are revoked at arbitrary points;
    // the replays must restore read-write buffers exactly (gaussian, hotspot, nw, backprop and
    // saxpy-style kernels update in place).
    let (daemon, session) = start(&format!("revoke-all-{}", kind.name()), |c| {
        c.cpu_lanes = 1;
        c.cpu_threads_per_lane = 2;
        c.opencl = kind == DeviceKind::OpenCl;
        c.opencl_lanes = 1;
        c.cuda_lanes = 1;
        c.inline_max_ns = 0;
        c.preempt_target = Duration::ZERO;
        c.revoke_min = Duration::ZERO;
        // However much there is to save: the replays of in-place kernels are what is tested.
        c.revoke_max_save_share = f64::INFINITY;
        c.latency_policy = LatencyPolicy::Priority;
    });
    let socket = daemon.socket().to_path_buf();
    let stop = std::sync::atomic::AtomicBool::new(false);
    /// Stops the pinger however the scope ends (a failed assertion must not leave it running,
    /// which would hang the scope).
    struct StopOnDrop<'a>(&'a std::sync::atomic::AtomicBool);
    impl Drop for StopOnDrop<'_> {
        fn drop(&mut self) {
            self.0.store(true, std::sync::atomic::Ordering::Relaxed);
        }
    }
    std::thread::scope(|scope| {
        let _stop = StopOnDrop(&stop);
        let pinger = scope.spawn(|| {
            let s = Session::connect_with(SessionOptions {
                socket: Some(socket),
                ..Default::default()
            })
            .unwrap();
            let noop = s.kernel("noop").unwrap();
            let q = s
                .queue_with(QueueOptions {
                    name: "pings".into(),
                    class: QueueClass::Latency,
                    preferred_device: Some(kind),
                    sla: Some(Duration::from_millis(1)),
                })
                .unwrap();
            let mut sent = 0u64;
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                q.launch(&noop, &[], agora::NdRange::d1(1)).unwrap().wait().unwrap();
                sent += 1;
                std::thread::sleep(Duration::from_micros(300));
            }
            sent
        });
        for (program, _) in agora_apps::PROGRAMS {
            let size = match *program {
                "gaussian" => 256,
                "hotspot" => 512,
                "nw" => 2048,
                "pathfinder" => 20000,
                "lavamd" => 4,
                "backprop" => 65536,
                _ => 1 << 20,
            };
            let workload = agora_apps::build(program, size, None).unwrap();
            let report = agora_apps::run_on_agora(&session, &workload, Some(kind)).unwrap();
            assert!(report.verified, "{program} on {kind:?}: max error {}", report.max_error);
        }
        stop.store(true, std::sync::atomic::Ordering::Relaxed);
        assert!(pinger.join().unwrap() > 0);
    });
    let status = session.status().unwrap();
    assert!(
        status.revocations >= 5,
        "kernels were revoked and replayed: {} revocations",
        status.revocations
    );
    // The programs ran on that kind of device (a preference is a hint: without one they run
    // elsewhere, which must not pass for this kind).
    let jobs = agora_test_support::jobs_on(&session, kind.name());
    assert!(jobs > 0, "no job ran on a {kind:?} device");
    drop(session);
    daemon.stop().unwrap();
}
