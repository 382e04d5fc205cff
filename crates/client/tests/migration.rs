//! Live migration against a real daemon (in-process, real sockets and segments): a queue moved
//! mid-stream with many tasks in flight keeps exact results and issue order; only the buffers
//! its pending tasks use move; drain and undrain; a busy queue whose next kernel its device lacks
//! moves instead of failing; a `sim` device that fails (injected fault) loses no task whose
//! inputs survive, reports `DataLost` for the ones whose inputs did not, and the daemon keeps
//! serving on the other devices. PoCL's OpenCL device is one end of a move (the test fails
//! without it, as the other device tests do).

use agora::{Arg, DeviceKind, QueueOptions, Session, TaskError};
use agora_daemon::{DaemonConfig, SimDeviceConfig, SimKernelProfile};

mod common;

fn start(tag: &str, tweak: impl FnOnce(&mut DaemonConfig)) -> (common::EmbeddedDaemon, Session) {
    common::daemon_with(&format!("mig-{tag}"), tweak)
}

/// A sim device whose every launch takes `launch_ns` (so tasks pile up in flight).
fn slow_sim(name: &str, launch_ns: f64) -> SimDeviceConfig {
    let mut sim = SimDeviceConfig {
        lanes: 1,
        launch_ns,
        ..SimDeviceConfig::named(name)
    };
    for kernel in ["saxpy", "fill", "stream.scale", "vector_add"] {
        sim.profile.insert(
            kernel.into(),
            SimKernelProfile {
                launch_ns,
                ns_per_item: 0.0,
            },
        );
    }
    sim
}

fn sim_queue(session: &Session, name: &str) -> agora::Queue {
    session
        .queue_with(QueueOptions {
            name: name.into(),
            preferred_device: Some(DeviceKind::Sim),
            ..Default::default()
        })
        .unwrap()
}

fn drain(daemon: &common::EmbeddedDaemon, device: &str, on: bool) -> agora::DrainOutcome {
    agora::drain_device(Some(daemon.socket().to_path_buf()), device, on, false).unwrap()
}

fn queue_status(session: &Session, name: &str) -> agora_protocol::control::QueueStatus {
    session.status().unwrap().sessions[0]
        .queues
        .iter()
        .find(|q| q.name == name)
        .unwrap()
        .clone()
}

fn bytes(session: &Session) -> (u64, u64) {
    let s = &session.status().unwrap().sessions[0];
    (s.bytes_to_device, s.bytes_to_host)
}

/// The order-sensitive chain both sides compute: acc ← 0.5·acc + i, through a scratch buffer
/// (scale into the other buffer, fill the scratch with i, add it): any reordering changes it.
fn expected_chain(n: usize, iterations: usize) -> Vec<f32> {
    let mut acc: Vec<f32> = (0..n).map(|i| (i % 7) as f32).collect();
    for it in 0..iterations {
        for v in acc.iter_mut() {
            let scaled = 0.5f32 * *v;
            *v = 1.0f32 * it as f32 + scaled;
        }
    }
    acc
}

#[test]
fn a_queue_moved_mid_stream_keeps_exact_results_and_issue_order() {
    let (daemon, session) = start("midstream", |c| {
        c.sims.push(slow_sim("a", 1_000_000.0));
        c.sims.push(slow_sim("b", 20_000.0));
    });
    // Start on `a`: keep `b` out of the policy's reach until the move.
    drain(&daemon, "b", true);
    let q = sim_queue(&session, "chain");
    let n = 4096usize;
    let init: Vec<f32> = (0..n).map(|i| (i % 7) as f32).collect();
    let bufs = [
        session.buffer_from(&init).unwrap(),
        session.buffer_from(&vec![0f32; n]).unwrap(),
    ];
    let scratch = session.buffer(n as u64 * 4).unwrap();
    let scale = session.kernel("stream.scale").unwrap();
    let fill = session.kernel("fill").unwrap();
    let saxpy = session.kernel("saxpy").unwrap();
    q.sync_to(&bufs[0]).unwrap();
    let iterations = 120;
    let mut tasks = Vec::new();
    let mut drained_with_in_flight = 0;
    for it in 0..iterations {
        let (from, to) = (&bufs[it % 2], &bufs[(it + 1) % 2]);
        tasks.push(q.launch(&scale, &[Arg::F32(0.5), from.into(), to.into()], n).unwrap());
        tasks.push(q.launch(&fill, &[Arg::F32(it as f32), (&scratch).into()], n).unwrap());
        tasks.push(
            q.launch(&saxpy, &[Arg::F32(1.0), (&scratch).into(), to.into()], n)
                .unwrap(),
        );
        if it == iterations / 2 {
            // The daemon may answer this control request before it took the tasks off the ring.
            let mut status = queue_status(&session, "chain");
            for _ in 0..2000 {
                if status.in_flight >= 20 {
                    break;
                }
                std::thread::sleep(std::time::Duration::from_millis(1));
                status = queue_status(&session, "chain");
            }
            assert_eq!(
                status.bound_to.as_deref().map(|b| b.starts_with("a/")),
                Some(true),
                "{status:?}"
            );
            drained_with_in_flight = status.in_flight;
            drain(&daemon, "b", false);
            let outcome = drain(&daemon, "a", true);
            assert!(outcome.draining);
        }
    }
    assert!(
        drained_with_in_flight >= 20,
        "the move must happen with many tasks in flight, had {drained_with_in_flight}"
    );
    // Its newer tasks wait while the ones in flight on `a` (20 ms of them at least) finish.
    let moving = (0..200).any(|_| {
        let moving = queue_status(&session, "chain").moving;
        std::thread::sleep(std::time::Duration::from_micros(100));
        moving
    });
    assert!(moving, "the queue must show as moving while its tasks drain from a");
    for task in tasks {
        task.wait().unwrap();
    }
    let last = &bufs[iterations % 2];
    q.sync_from(last).unwrap().wait().unwrap();
    assert_eq!(last.as_slice::<f32>(), &expected_chain(n, iterations)[..]);
    let status = session.status().unwrap();
    assert!(status.migrations >= 1, "{status:?}");
    assert_eq!(queue_status(&session, "chain").last_device.as_deref(), Some("b"));
    assert!(status.devices.iter().any(|d| d.name == "a" && d.draining));
    drop(session);
    daemon.stop().unwrap();
}

#[test]
fn a_queue_moved_off_opencl_mid_stream_keeps_exact_results() {
    let (daemon, session) = start("opencl", |c| {
        c.sims.push(slow_sim("a", 20_000.0));
    });
    common::require_opencl(&session);
    let q = session
        .queue_with(QueueOptions {
            name: "chain".into(),
            preferred_device: Some(DeviceKind::OpenCl),
            ..Default::default()
        })
        .unwrap();
    // Only PoCL and then only the sim device: the move is device memory → host → device memory.
    drain(&daemon, "a", true);
    drain(&daemon, "cpu0", true);
    let n = 1 << 16;
    let init: Vec<f32> = (0..n).map(|i| (i % 7) as f32).collect();
    let bufs = [
        session.buffer_from(&init).unwrap(),
        session.buffer_from(&vec![0f32; n]).unwrap(),
    ];
    let scratch = session.buffer(n as u64 * 4).unwrap();
    let scale = session.kernel("stream.scale").unwrap();
    let fill = session.kernel("fill").unwrap();
    let saxpy = session.kernel("saxpy").unwrap();
    let iterations = 60;
    let mut tasks = Vec::new();
    let mut saw_opencl = false;
    for it in 0..iterations {
        let (from, to) = (&bufs[it % 2], &bufs[(it + 1) % 2]);
        tasks.push(q.launch(&scale, &[Arg::F32(0.5), from.into(), to.into()], n).unwrap());
        tasks.push(q.launch(&fill, &[Arg::F32(it as f32), (&scratch).into()], n).unwrap());
        tasks.push(
            q.launch(&saxpy, &[Arg::F32(1.0), (&scratch).into(), to.into()], n)
                .unwrap(),
        );
        if it == iterations / 2 {
            saw_opencl = (0..2000).any(|_| {
                std::thread::sleep(std::time::Duration::from_millis(1));
                queue_status(&session, "chain").last_device.as_deref() == Some("opencl0")
            });
            drain(&daemon, "a", false);
            drain(&daemon, "opencl0", true);
        }
    }
    assert!(saw_opencl, "the chain must start on PoCL");
    for task in tasks {
        task.wait().unwrap();
    }
    let last = &bufs[iterations % 2];
    q.sync_from(last).unwrap().wait().unwrap();
    assert_eq!(last.as_slice::<f32>(), &expected_chain(n, iterations)[..]);
    assert_eq!(queue_status(&session, "chain").last_device.as_deref(), Some("a"));
    drop(session);
    daemon.stop().unwrap();
}

#[test]
fn only_the_buffers_a_moved_queue_uses_move() {
    let (daemon, session) = start("bytes", |c| {
        c.sims.push(slow_sim("a", 20_000.0));
        c.sims.push(slow_sim("b", 20_000.0));
    });
    drain(&daemon, "b", true);
    let q = sim_queue(&session, "q");
    let fill = session.kernel("fill").unwrap();
    let saxpy = session.kernel("saxpy").unwrap();
    let mib = 1usize << 20;
    let x = session.buffer(mib as u64).unwrap();
    let y = session.buffer(mib as u64).unwrap();
    let z = session.buffer(4 * mib as u64).unwrap();
    // Written on `a` (whole-buffer writes: nothing copied in); `a` holds their only copies.
    q.launch(&fill, &[Arg::F32(1.5), (&x).into()], mib / 4).unwrap();
    q.launch(&fill, &[Arg::F32(2.0), (&y).into()], mib / 4).unwrap();
    q.launch(&fill, &[Arg::F32(7.0), (&z).into()], mib).unwrap();
    q.finish().unwrap();
    assert_eq!(queue_status(&session, "q").last_device.as_deref(), Some("a"));
    let before = bytes(&session);
    drain(&daemon, "a", true);
    drain(&daemon, "b", false);
    assert_eq!(bytes(&session), before, "draining copies nothing by itself");
    q.launch(&saxpy, &[Arg::F32(2.0), (&x).into(), (&y).into()], mib / 4)
        .unwrap();
    q.finish().unwrap();
    assert_eq!(queue_status(&session, "q").last_device.as_deref(), Some("b"));
    let after = bytes(&session);
    // x and y: a → host → b, once each; z (4 MiB, unused) stays on a.
    assert_eq!(after.0 - before.0, 2 * mib as u64, "bytes to device");
    assert_eq!(after.1 - before.1, 2 * mib as u64, "bytes to host");
    let a = session
        .status()
        .unwrap()
        .devices
        .into_iter()
        .find(|d| d.name == "a")
        .unwrap();
    assert!(a.memory_used >= 4 * mib as u64, "z still lives on a: {}", a.memory_used);
    q.sync_from(&y).unwrap().wait().unwrap();
    assert!(y.as_slice::<f32>().iter().all(|v| *v == 5.0));
    // Moved on demand when a task needs it, still exact.
    q.sync_from(&z).unwrap().wait().unwrap();
    assert!(z.as_slice::<f32>().iter().all(|v| *v == 7.0));
    drop(session);
    daemon.stop().unwrap();
}

#[test]
fn drain_with_evacuate_writes_idle_buffers_home_and_frees_the_device() {
    let (daemon, session) = start("evacuate", |c| {
        c.sims.push(slow_sim("a", 20_000.0));
    });
    let q = sim_queue(&session, "q");
    let fill = session.kernel("fill").unwrap();
    let mib = 1usize << 20;
    let z = session.buffer(4 * mib as u64).unwrap();
    q.launch(&fill, &[Arg::F32(7.0), (&z).into()], mib).unwrap();
    q.finish().unwrap();
    let device = |s: &Session| s.status().unwrap().devices.into_iter().find(|d| d.name == "a").unwrap();
    assert_eq!(device(&session).memory_used, 4 * mib as u64);
    let socket = Some(daemon.socket().to_path_buf());
    let err = agora::drain_device(socket.clone(), "a", false, true).unwrap_err();
    assert!(err.to_string().contains("evacuate goes with drain"), "{err}");
    let outcome = agora::drain_device(socket, "a", true, true).unwrap();
    assert_eq!(
        (outcome.evacuated_buffers, outcome.evacuated_bytes),
        (1, 4 * mib as u64)
    );
    assert_eq!(device(&session).memory_used, 0);
    // Its contents are home: reading them moves nothing more.
    let before = bytes(&session);
    q.sync_from(&z).unwrap().wait().unwrap();
    assert_eq!(bytes(&session), before);
    assert!(z.as_slice::<f32>().iter().all(|v| *v == 7.0));
    drop(session);
    daemon.stop().unwrap();
}

#[test]
fn drain_and_undrain_steer_the_policy_and_bad_names_are_refused() {
    let (daemon, session) = start("undrain", |c| {
        c.sims.push(slow_sim("a", 20_000.0));
        c.sims.push(slow_sim("b", 20_000.0));
    });
    let err = agora::drain_device(Some(daemon.socket().to_path_buf()), "nosuch", true, false).unwrap_err();
    let message = err.to_string();
    assert!(
        message.contains("unknown device 'nosuch'") && message.contains("a, b"),
        "{message}"
    );
    let saxpy = session.kernel("saxpy").unwrap();
    let x = session.buffer_from(&vec![1f32; 256]).unwrap();
    let y = session.buffer_from(&vec![0f32; 256]).unwrap();
    let run_on = |name: &str| {
        let q = sim_queue(&session, name);
        q.launch(&saxpy, &[Arg::F32(1.0), (&x).into(), (&y).into()], 256)
            .unwrap();
        q.finish().unwrap();
        queue_status(&session, name).last_device.unwrap()
    };
    drain(&daemon, "a", true);
    for i in 0..4 {
        assert_eq!(run_on(&format!("q{i}")), "b");
    }
    drain(&daemon, "a", false);
    drain(&daemon, "b", true);
    let status = session.status().unwrap();
    assert!(status.devices.iter().any(|d| d.name == "b" && d.draining));
    assert!(status.devices.iter().any(|d| d.name == "a" && !d.draining));
    for i in 4..8 {
        assert_eq!(run_on(&format!("q{i}")), "a");
    }
    drain(&daemon, "b", false);
    assert!(session.status().unwrap().devices.iter().all(|d| !d.draining));
    q_exact(&session, &y, 8.0);
    drop(session);
    daemon.stop().unwrap();
}

fn q_exact(session: &Session, y: &agora::Buffer, value: f32) {
    let q = session.queue("check").unwrap();
    q.sync_from(y).unwrap().wait().unwrap();
    assert!(y.as_slice::<f32>().iter().all(|v| *v == value));
}

#[test]
fn a_busy_queue_whose_next_kernel_its_device_lacks_moves_instead_of_failing() {
    let (daemon, session) = start("kernel", |c| {
        let mut sim = slow_sim("a", 2_000_000.0);
        sim.kernels = Some(vec!["saxpy".into()]);
        c.sims.push(sim);
    });
    let q = sim_queue(&session, "q");
    let saxpy = session.kernel("saxpy").unwrap();
    let scale = session.kernel("stream.scale").unwrap();
    let n = 1024usize;
    let x = session.buffer_from(&vec![1f32; n]).unwrap();
    let y = session.buffer_from(&vec![0f32; n]).unwrap();
    let z = session.buffer(n as u64 * 4).unwrap();
    let mut tasks = Vec::new();
    for _ in 0..10 {
        tasks.push(q.launch(&saxpy, &[Arg::F32(1.0), (&x).into(), (&y).into()], n).unwrap());
    }
    // (The daemon may answer a control request before it took the tasks off the ring.)
    let busy = (0..2000).any(|_| {
        std::thread::sleep(std::time::Duration::from_millis(1));
        queue_status(&session, "q").in_flight > 0
    });
    assert!(busy, "the saxpys must be in flight on a");
    // `a` lacks stream.scale: the queue moves (after the saxpys) instead of failing NoDevice.
    tasks.push(q.launch(&scale, &[Arg::F32(3.0), (&y).into(), (&z).into()], n).unwrap());
    tasks.push(q.launch(&saxpy, &[Arg::F32(1.0), (&x).into(), (&z).into()], n).unwrap());
    for task in tasks {
        task.wait().unwrap();
    }
    q.sync_from(&z).unwrap().wait().unwrap();
    assert!(z.as_slice::<f32>().iter().all(|v| *v == 31.0));
    assert!(session.status().unwrap().migrations >= 1);
    drop(session);
    daemon.stop().unwrap();
}

#[test]
fn a_failed_sim_device_replays_tasks_whose_inputs_survive_and_serving_goes_on() {
    let (daemon, session) = start("fail-replay", |c| {
        let mut sim = slow_sim("a", 200_000.0);
        sim.fail_after_jobs = Some(4);
        c.sims.push(sim);
    });
    let q = sim_queue(&session, "q");
    let other = session.queue("bystander").unwrap();
    let add = session.kernel("vector_add").unwrap();
    let n = 2048usize;
    let x = session
        .buffer_from(&(0..n).map(|i| i as f32).collect::<Vec<_>>())
        .unwrap();
    let ws: Vec<_> = (0..24)
        .map(|k| session.buffer_from(&vec![k as f32; n]).unwrap())
        .collect();
    let outs: Vec<_> = (0..24).map(|_| session.buffer(n as u64 * 4).unwrap()).collect();
    // Inputs current on the host, outputs overwritten whole and read back by the queue: every
    // lost task can be replayed, and what finished before the failure is home already.
    let mut tasks = Vec::new();
    for (w, out) in ws.iter().zip(&outs) {
        tasks.push(q.launch(&add, &[(&x).into(), w.into(), out.into()], n).unwrap());
        tasks.push(q.sync_from(out).unwrap());
    }
    for (i, task) in tasks.into_iter().enumerate() {
        let r = task.wait();
        assert!(r.is_ok(), "task {i}: {r:?} {:?}", session.status().unwrap());
    }
    for (k, out) in outs.iter().enumerate() {
        q.sync_from(out).unwrap().wait().unwrap();
        for (i, v) in out.as_slice::<f32>().iter().enumerate() {
            assert_eq!(*v, i as f32 + k as f32, "output {k} element {i}");
        }
    }
    let status = session.status().unwrap();
    let a = status.devices.iter().find(|d| d.name == "a").unwrap();
    assert!(a.failed && a.draining, "{a:?}");
    assert!(status.tasks_replayed >= 1, "{status:?}");
    assert_eq!(status.tasks_lost, 0);
    // Undraining a failed device is refused with a reason.
    let err = agora::drain_device(Some(daemon.socket().to_path_buf()), "a", false, false).unwrap_err();
    assert!(err.to_string().contains("failed"), "{err}");
    // Other queues were never affected.
    let y = session.buffer_from(&vec![1f32; n]).unwrap();
    let saxpy = session.kernel("saxpy").unwrap();
    other
        .launch(&saxpy, &[Arg::F32(2.0), (&x).into(), (&y).into()], n)
        .unwrap();
    other.sync_from(&y).unwrap().wait().unwrap();
    assert_eq!(y.as_slice::<f32>()[10], 21.0);
    drop(session);
    daemon.stop().unwrap();
}

#[test]
fn data_whose_only_copy_a_failed_device_held_is_reported_lost_until_rewritten() {
    let (daemon, session) = start("fail-lost", |c| {
        let mut sim = slow_sim("a", 50_000.0);
        sim.fail_after_jobs = Some(3);
        c.sims.push(sim);
    });
    let q = sim_queue(&session, "q");
    let saxpy = session.kernel("saxpy").unwrap();
    let n = 1024usize;
    let x = session.buffer_from(&vec![1f32; n]).unwrap();
    let y = session.buffer_from(&vec![0f32; n]).unwrap();
    // y accumulates on `a`: after the first task its only current copy is there.
    let tasks: Vec<_> = (0..12)
        .map(|_| q.launch(&saxpy, &[Arg::F32(1.0), (&x).into(), (&y).into()], n).unwrap())
        .collect();
    let results: Vec<_> = tasks.into_iter().map(|t| t.wait()).collect();
    let first_failure = results.iter().position(|r| r.is_err()).expect("the device fails");
    assert!(first_failure >= 1, "{results:?}");
    for r in &results[first_failure..] {
        let e = r.as_ref().unwrap_err();
        assert_eq!(e.task_error(), Some(&TaskError::DataLost { index: 2 }), "{e}");
    }
    assert!(session.status().unwrap().tasks_lost >= 1);
    // Reading it back says why it cannot.
    let e = q.sync_from(&y).unwrap().wait().unwrap_err();
    assert_eq!(e.task_error(), Some(&TaskError::DataLost { index: 0 }));
    // Rewriting it whole repairs it; the queue goes on on another device.
    let mut y = y;
    y.as_mut_slice::<f32>().fill(10.0);
    q.sync_to(&y).unwrap();
    q.launch(&saxpy, &[Arg::F32(1.0), (&x).into(), (&y).into()], n).unwrap();
    q.sync_from(&y).unwrap().wait().unwrap();
    assert!(y.as_slice::<f32>().iter().all(|v| *v == 11.0));
    drop(session);
    daemon.stop().unwrap();
}

#[test]
fn a_task_elsewhere_reading_from_the_failed_device_fails_in_order_naming_the_buffer() {
    let (daemon, session) = start("fail-source", |c| {
        let mut sim = slow_sim("a", 20_000.0);
        sim.fail_after_jobs = Some(2);
        c.sims.push(sim);
    });
    let on_a = sim_queue(&session, "on-a");
    let on_cpu = session
        .queue_with(QueueOptions {
            name: "on-cpu".into(),
            preferred_device: Some(DeviceKind::Cpu),
            ..Default::default()
        })
        .unwrap();
    let fill = session.kernel("fill").unwrap();
    let saxpy = session.kernel("saxpy").unwrap();
    let n = 1024usize;
    let y = session.buffer(n as u64 * 4).unwrap();
    on_a.launch(&fill, &[Arg::F32(3.0), (&y).into()], n).unwrap(); // job 1: y lives only on a
    on_a.finish().unwrap();
    // A long task on the CPU, then one that reads y from a, queued behind it on the same lane.
    let big = 1usize << 23;
    let bx = session.buffer_from(&vec![1f32; big]).unwrap();
    let by = session.buffer_from(&vec![0f32; big]).unwrap();
    let out = session.buffer_from(&vec![0f32; n]).unwrap();
    let long = on_cpu
        .launch(&saxpy, &[Arg::F32(1.0), (&bx).into(), (&by).into()], big)
        .unwrap();
    let read = on_cpu
        .launch(&saxpy, &[Arg::F32(1.0), (&y).into(), (&out).into()], n)
        .unwrap();
    let after = on_cpu.launch(&fill, &[Arg::F32(5.0), (&out).into()], n).unwrap();
    // Meanwhile a dies (its third job fails), before the CPU lane reaches the read.
    on_a.launch(&fill, &[Arg::F32(1.0), (&out).into()], n).unwrap(); // job 2
    let dies = on_a.launch(&fill, &[Arg::F32(1.0), (&out).into()], n).unwrap(); // job 3: fails
    long.wait().unwrap();
    let e = read.wait().unwrap_err();
    assert_eq!(e.task_error(), Some(&TaskError::DataLost { index: 1 }), "{e}");
    after.wait().unwrap();
    let _ = dies.wait();
    // y's contents died with a: reading it says so.
    let e = on_cpu.sync_from(&y).unwrap().wait().unwrap_err();
    assert_eq!(e.task_error(), Some(&TaskError::DataLost { index: 0 }), "{e}");
    assert!(session
        .status()
        .unwrap()
        .devices
        .iter()
        .any(|d| d.name == "a" && d.failed));
    drop(session);
    daemon.stop().unwrap();
}

#[test]
fn each_session_sees_the_device_memory_its_own_buffers_hold() {
    let (daemon, session) = start("device-memory", |c| {
        c.opencl = false;
        c.sims.push(slow_sim("a", 1_000.0));
    });
    let other = daemon.session();
    let queue = sim_queue(&session, "q");
    let fill = session.kernel("fill").unwrap();
    let buffer = session.buffer(1 << 20).unwrap();
    queue
        .launch(&fill, &[Arg::F32(1.0), (&buffer).into()], 1u64 << 18)
        .unwrap()
        .wait()
        .unwrap();
    let held = |s: &Session, id: u64| {
        let status = s.status().unwrap();
        let sim = status.devices.iter().position(|d| d.kind == "sim").unwrap();
        let entry = status.sessions.iter().find(|e| e.id == id).unwrap().clone();
        (entry.device_memory.get(sim).copied().unwrap_or(0), entry.device_memory)
    };
    let (mine, _) = held(&session, session.id());
    assert_eq!(mine, 1 << 20, "the buffer's device copy on the sim device");
    let (_, theirs) = held(&session, other.id());
    assert!(
        theirs.iter().all(|b| *b == 0),
        "another session holds nothing: {theirs:?}"
    );
    drop(buffer);
    assert!(
        agora_test_support::eventually(std::time::Duration::from_secs(5), || held(&session, session.id()).0
            == 0),
        "the released buffer's device copy is counted out"
    );
    drop((other, session));
    daemon.stop().unwrap();
}
