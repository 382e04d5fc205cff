//! Heterogeneous scheduling against a real daemon: eviction under device-memory pressure,
//! migration of a buffer's valid copy between devices, per-session device quotas, persistence
//! of the performance model across a restart, and policies that never pick a device lacking the
//! kernel. Devices: the CPU, PoCL's OpenCL device (a real backend; the test fails without it)
//! and `sim` devices from the configuration.

use agora::{Arg, DeviceKind, QueueOptions, Session};
use agora_daemon::{DaemonConfig, PolicyKind, SimDeviceConfig};

mod common;

/// A daemon of the test's own, in a new temporary directory named after `tag` (with its state
/// directory, unless `tweak` sets one).
fn start(tag: &str, tweak: impl FnOnce(&mut DaemonConfig)) -> (common::EmbeddedDaemon, Session) {
    common::daemon_with(&format!("sched-{tag}"), tweak)
}

fn queue(session: &Session, kind: DeviceKind) -> agora::Queue {
    session
        .queue_with(QueueOptions {
            name: kind.name().to_string(),
            preferred_device: Some(kind),
            sla: None,
            ..Default::default()
        })
        .unwrap()
}

fn has(session: &Session, kind: &str) -> bool {
    session.status().unwrap().devices.iter().any(|d| d.kind == kind)
}

/// Sixteen 256 KiB buffer pairs through a device that holds far fewer: every saxpy exact.
fn eviction_round(session: &Session, kind: DeviceKind) -> u64 {
    let q = queue(session, kind);
    let saxpy = session.kernel("saxpy").unwrap();
    let n = 64 * 1024usize; // 256 KiB per buffer
    let xs: Vec<_> = (0..16)
        .map(|b| {
            session
                .buffer_from(&(0..n).map(|i| (i % 1000) as f32 + b as f32).collect::<Vec<_>>())
                .unwrap()
        })
        .collect();
    let ys: Vec<_> = (0..16)
        .map(|_| session.buffer_from(&vec![1.0f32; n]).unwrap())
        .collect();
    // Two passes: the second needs buffers the first pass's later tasks evicted.
    for pass in 0..2 {
        for (x, y) in xs.iter().zip(&ys) {
            q.sync_to(x).unwrap();
            if pass == 0 {
                q.sync_to(y).unwrap();
            }
            q.launch(&saxpy, &[Arg::F32(2.0), x.into(), y.into()], n).unwrap();
            q.finish().unwrap();
        }
    }
    for (b, y) in ys.iter().enumerate() {
        q.sync_from(y).unwrap().wait().unwrap();
        for (i, v) in y.as_slice::<f32>().iter().enumerate() {
            let x = (i % 1000) as f32 + b as f32;
            assert_eq!(*v, 1.0 + 2.0 * x + 2.0 * x, "{kind:?} buffer {b} element {i}");
        }
    }
    session.status().unwrap().evictions
}

#[test]
fn buffers_beyond_device_memory_are_evicted_and_results_stay_exact() {
    let (daemon, session) = start("evict", |c| {
        // 8 MiB of buffers through 2 MiB devices.
        c.opencl_memory_limit = 2 << 20;
        c.sims.push(SimDeviceConfig {
            memory: 2 << 20,
            ..SimDeviceConfig::named("small")
        });
    });
    assert!(
        has(&session, "opencl"),
        "no OpenCL device: run `make setup` (installs PoCL)"
    );
    let after_sim = eviction_round(&session, DeviceKind::Sim);
    assert!(
        after_sim >= 16,
        "the sim device must have evicted buffers, evicted {after_sim}"
    );
    let after_opencl = eviction_round(&session, DeviceKind::OpenCl);
    assert!(after_opencl >= after_sim + 16, "OpenCL must have evicted too");
    for device in session.status().unwrap().devices {
        assert!(
            device.memory_bytes == 0 || device.memory_used <= device.memory_bytes,
            "{} over its memory",
            device.name
        );
    }
    drop(session);
    daemon.stop().unwrap();
}

#[test]
fn a_session_over_its_device_quota_evicts_its_own_buffers_only() {
    let (daemon, session) = start("quota", |c| {
        c.device_quota = 1 << 20;
        c.sims.push(SimDeviceConfig {
            memory: 64 << 20,
            ..SimDeviceConfig::named("big")
        });
    });
    let evictions = eviction_round(&session, DeviceKind::Sim);
    assert!(evictions > 0);
    let sim = session
        .status()
        .unwrap()
        .devices
        .into_iter()
        .find(|d| d.kind == "sim")
        .unwrap();
    assert!(
        sim.memory_used <= 1 << 20,
        "the session holds {} bytes on the sim device",
        sim.memory_used
    );
    // A single task that needs more than the quota fails with a clear error instead.
    let q = queue(&session, DeviceKind::Sim);
    let big_x = session.buffer(1 << 20).unwrap();
    let big_y = session.buffer(1 << 20).unwrap();
    let saxpy = session.kernel("saxpy").unwrap();
    let error = q
        .launch(&saxpy, &[Arg::F32(1.0), (&big_x).into(), (&big_y).into()], 1 << 18)
        .unwrap()
        .wait()
        .unwrap_err();
    assert!(error.to_string().contains("device quota is 1048576 bytes"), "{error}");
    drop(session);
    daemon.stop().unwrap();
}

#[test]
fn a_valid_copy_migrates_between_opencl_sim_and_cpu_exactly() {
    let (daemon, session) = start("migrate", |c| c.sims.push(SimDeviceConfig::named("sim0")));
    assert!(
        has(&session, "opencl"),
        "no OpenCL device: run `make setup` (installs PoCL)"
    );
    let saxpy = session.kernel("saxpy").unwrap();
    let n = 10_007usize;
    let x = session.buffer_from(&vec![1.0f32; n]).unwrap();
    let y = session
        .buffer_from(&(0..n).map(|i| i as f32).collect::<Vec<_>>())
        .unwrap();
    let order = [
        DeviceKind::OpenCl,
        DeviceKind::Sim,
        DeviceKind::Cpu,
        DeviceKind::Sim,
        DeviceKind::OpenCl,
    ];
    for (step, kind) in order.iter().enumerate() {
        let q = queue(&session, *kind);
        q.launch(&saxpy, &[Arg::F32(1.0), (&x).into(), (&y).into()], n).unwrap();
        q.finish().unwrap();
        let status = session.status().unwrap();
        let chosen = status.sessions[0]
            .queues
            .iter()
            .find(|s| s.name == kind.name())
            .unwrap();
        let ran_on = chosen.last_device.clone().unwrap();
        assert!(
            ran_on.starts_with(kind.name()),
            "step {step}: ran on {ran_on}, wanted {kind:?}"
        );
        assert_eq!(chosen.preferred, Some(*kind));
    }
    let q = queue(&session, DeviceKind::Cpu);
    q.sync_from(&y).unwrap().wait().unwrap();
    for (i, v) in y.as_slice::<f32>().iter().enumerate() {
        assert_eq!(*v, i as f32 + order.len() as f32, "y[{i}]");
    }
    drop(session);
    daemon.stop().unwrap();
}

#[test]
fn the_performance_model_survives_a_restart() {
    let scratch = agora_test_support::temp_dir("sched-persist-state");
    let state = scratch.path().join("state");
    let run = |kernel: &str| {
        let (daemon, session) = start("persist", |c| {
            c.opencl = false;
            // Inline runs (tiny tasks on the dispatcher) are not measured: use lanes.
            c.inline_max_ns = 0;
            c.state_dir = Some(state.clone());
        });
        let k = session.kernel(kernel).unwrap();
        let q = session.queue("p").unwrap();
        let n = 4096usize;
        let a = session.buffer_from(&vec![1.0f32; n]).unwrap();
        let b = session.buffer_from(&vec![1.0f32; n]).unwrap();
        let c = session.buffer((n * 4) as u64).unwrap();
        for _ in 0..3 {
            q.launch(&k, &[(&a).into(), (&b).into(), (&c).into()], n).unwrap();
            q.finish().unwrap();
        }
        drop(session);
        daemon.stop().unwrap();
    };
    let kernels = |path: &std::path::Path| {
        let model = agora_daemon::policy::PerformanceModel::load(path, 0.8).unwrap();
        let mut names: Vec<String> = model.rows().into_iter().map(|r| r.kernel).collect();
        names.dedup();
        names
    };
    run("vector_add");
    let first = kernels(&state);
    assert!(first.contains(&"vector_add".to_string()), "{first:?}");
    // The second daemon loads the model, learns another kernel and saves both.
    run("stream.add");
    let second = kernels(&state);
    assert!(
        second.contains(&"vector_add".to_string()) && second.contains(&"stream.add".to_string()),
        "{second:?}"
    );
}

#[test]
fn no_policy_sends_a_kernel_to_a_device_that_lacks_it() {
    for policy in [PolicyKind::Rr, PolicyKind::Perf, PolicyKind::Energy] {
        let (daemon, session) = start(policy.name(), |c| {
            c.policy = policy;
            c.opencl = false;
            c.inline_max_ns = 0;
            // The sim device is fast and idle but implements only saxpy.
            c.sims.push(SimDeviceConfig {
                speed: 100.0,
                kernels: Some(vec!["saxpy".into()]),
                ..SimDeviceConfig::named("saxpy-only")
            });
        });
        let vector_add = session.kernel("vector_add").unwrap();
        let n = 1000usize;
        let a = session.buffer_from(&vec![1.0f32; n]).unwrap();
        let b = session.buffer_from(&vec![2.0f32; n]).unwrap();
        let c = session.buffer((n * 4) as u64).unwrap();
        for round in 0..20 {
            // Even a queue that prefers sim devices: the hint yields to the kernel's availability.
            let q = if round % 2 == 0 {
                queue(&session, DeviceKind::Sim)
            } else {
                session.queue("any").unwrap()
            };
            q.launch(&vector_add, &[(&a).into(), (&b).into(), (&c).into()], n)
                .unwrap();
            q.sync_from(&c).unwrap();
            q.finish().unwrap();
            assert!(c.as_slice::<f32>().iter().all(|v| *v == 3.0));
        }
        let status = session.status().unwrap();
        let sim = status.devices.iter().find(|d| d.kind == "sim").unwrap();
        let completed: u64 = sim.lanes.iter().map(|l| l.completed).sum();
        assert_eq!(
            completed,
            0,
            "{}: the sim device ran {completed} tasks it has no kernel for",
            policy.name()
        );
        assert_eq!(status.policy, policy.name());
        drop(session);
        daemon.stop().unwrap();
    }
}

#[test]
fn only_permitted_users_open_latency_queues() {
    let me = own_uid();
    let (daemon, session) = start("latency-permission", |c| {
        c.opencl = false;
        c.latency_uids = vec![me.wrapping_add(1)];
        c.latency_gids = vec![u32::MAX - 1];
    });
    let refused = session
        .queue_with(QueueOptions {
            name: "frontend".into(),
            class: agora::QueueClass::Latency,
            preferred_device: None,
            sla: None,
        })
        .unwrap_err();
    assert!(
        refused.to_string().contains("may not open latency-class queues"),
        "{refused}"
    );
    // Batch queues stay open to everyone.
    session.queue("batch").unwrap();
    drop(session);
    daemon.stop().unwrap();
}

#[test]
fn a_latency_queue_sla_is_checked_and_shown_in_status() {
    let (daemon, session) = start("latency-sla", |c| c.opencl = false);
    let options = |sla| QueueOptions {
        name: "frontend".into(),
        class: agora::QueueClass::Latency,
        preferred_device: None,
        sla,
    };
    let refused = session
        .queue_with(options(Some(std::time::Duration::ZERO)))
        .unwrap_err();
    assert!(refused.to_string().contains("response-time target"), "{refused}");
    let _queue = session
        .queue_with(options(Some(std::time::Duration::from_millis(25))))
        .unwrap();
    let status = session.status().unwrap();
    let queue = status
        .sessions
        .iter()
        .flat_map(|s| &s.queues)
        .find(|q| q.name == "frontend")
        .expect("the queue is listed");
    assert_eq!(queue.sla_ms, Some(25.0));
    drop(session);
    daemon.stop().unwrap();
}

fn own_uid() -> u32 {
    // The test's own uid, as the daemon sees it through SO_PEERCRED.
    std::fs::metadata("/proc/self")
        .map(|m| std::os::unix::fs::MetadataExt::uid(&m))
        .unwrap()
}
