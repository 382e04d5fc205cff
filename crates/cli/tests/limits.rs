//! Device limits with real processes (issue #22, item 3a): the daemon runs as `agora serve` in
//! its own process, and a client launches `noop` over ranges far beyond what one OpenCL command
//! takes (PoCL killed the whole daemon on 2^38 and 2^40 work items).
//!
//! What each range must do, on this node (the CPU device, PoCL's OpenCL device):
//! * beyond the OpenCL device's limit per launch (2^36 work items): run on the CPU, which has no
//!   such limit, even on a queue that prefers OpenCL (a preference the policy may ignore), and
//!   also when that queue is busy on the OpenCL device (it moves);
//! * beyond one OpenCL enqueue (2^32 work items) but within the limit per launch: run on the
//!   OpenCL device as several enqueues (row slices);
//! * anything else that a device refuses and no other takes: fail with `TaskError::DeviceLimit`
//!   naming the limit (not reachable here, where the CPU takes every range the protocol allows;
//!   the device crate's unit tests cover the refusals).
//!
//! Afterwards the daemon still runs and another session's ordinary work is exact.

use agora::{Arg, DeviceKind, Error, NdRange, QueueClass, QueueOptions, Session};
use agora_test_support::Daemon;

const AGORA: &str = env!("CARGO_BIN_EXE_agora");

/// `agora serve --socket S EXTRA` on a private socket, killed when dropped.
fn start(tag: &str, extra: &[&str]) -> Daemon {
    Daemon::start(AGORA, &format!("limits-{tag}"), extra)
}

/// Jobs the lanes of device `name` have run to the end.
fn completed_on(daemon: &Daemon, name: &str) -> u64 {
    let status = daemon.status();
    let device = status.devices.iter().find(|d| d.name == name).expect("device listed");
    device.lanes.iter().map(|l| l.completed).sum()
}

fn queue(s: &Session, name: &str, class: QueueClass, kind: DeviceKind) -> agora::Queue {
    s.queue_with(QueueOptions {
        name: name.into(),
        class,
        preferred_device: Some(kind),
        sla: None,
    })
    .unwrap()
}

/// The device the queue's last task handed to a lane ran on.
fn last_device(s: &Session, queue: &str) -> String {
    agora_test_support::last_device(s, queue).unwrap_or_else(|| panic!("queue {queue} has run nothing on a lane"))
}

/// Checks that a task completed. Here the CPU takes every range the protocol allows, so even the
/// typed refusal (`DeviceLimit`, which the unit tests cover) is a failure.
fn finished(what: &str, result: Result<(), Error>) {
    match result {
        Ok(()) => {}
        Err(Error::Task(agora::TaskError::DeviceLimit { limit, value, max })) => {
            panic!("{what}: refused ({limit:?}: {value} > {max}) although the CPU takes any range")
        }
        Err(other) => panic!("{what}: {other}"),
    }
}

/// A verified saxpy on a new queue of `s` that prefers `kind`; returns the queue (dropping it
/// releases it).
fn saxpy_ok(s: &Session, name: &str, kind: DeviceKind) -> agora::Queue {
    let q = queue(s, name, QueueClass::Batch, kind);
    let saxpy = s.kernel("saxpy").unwrap();
    let n = 100_000usize;
    let x = s.buffer_from(&vec![1.0f32; n]).unwrap();
    let y = s.buffer_from(&vec![2.0f32; n]).unwrap();
    q.sync_to(&x).unwrap();
    q.sync_to(&y).unwrap();
    q.launch(&saxpy, &[Arg::F32(3.0), (&x).into(), (&y).into()], n as u64)
        .unwrap();
    q.sync_from(&y).unwrap();
    q.finish().unwrap();
    assert!(y.as_slice::<f32>().iter().all(|v| *v == 5.0), "{name}: saxpy is exact");
    q
}

#[test]
fn huge_ranges_are_split_or_moved_and_the_daemon_lives() {
    let mut daemon = start("huge", &["--opencl-lanes", "2"]);
    let s = daemon.session_named("huge");
    let status = daemon.status();
    let opencl = status
        .devices
        .iter()
        .find(|d| d.kind == "opencl")
        .unwrap_or_else(|| panic!("no OpenCL device: run `make setup` (installs PoCL)"))
        .name
        .clone();
    let noop = s.kernel("noop").unwrap();
    let queues = [
        ("opencl-batch", QueueClass::Batch, DeviceKind::OpenCl),
        ("opencl-latency", QueueClass::Latency, DeviceKind::OpenCl),
        ("cpu-batch", QueueClass::Batch, DeviceKind::Cpu),
        ("cpu-latency", QueueClass::Latency, DeviceKind::Cpu),
    ];
    let queues: Vec<(&str, agora::Queue)> = queues
        .iter()
        .map(|(name, class, kind)| (*name, queue(&s, name, *class, *kind)))
        .collect();

    // Beyond the OpenCL device's limit per launch (2^36): on the CPU, from every queue.
    let huge: [(&str, NdRange); 6] = [
        ("2^40", NdRange::d1(1 << 40)),
        ("2^38", NdRange::d1(1 << 38)),
        ("2^37", NdRange::d1(1 << 37)),
        ("2^20 x 2^20", NdRange::d2(1 << 20, 1 << 20)),
        ("2^14 x 2^13 x 2^13", NdRange::d3(1 << 14, 1 << 13, 1 << 13)),
        ("1 x 2^40", NdRange::d2(1, 1 << 40)),
    ];
    for (name, q) in &queues {
        for (label, range) in &huge {
            let what = format!("noop over {label} on {name}");
            finished(&what, q.launch(&noop, &[], *range).unwrap().wait());
            assert_eq!(last_device(&s, name), "cpu0", "{what}");
            daemon.assert_alive();
        }
    }

    // Beyond one OpenCL enqueue (2^32) but within its limit per launch: on the OpenCL device, as
    // row slices. A latency queue's launches are never sliced for preemption, so the slices
    // counted here are the ones the device's limits call for: two each.
    let (_, latency) = &queues[1];
    for (label, range) in [
        ("2^33", NdRange::d1(1 << 33)),
        ("2^11 x 2^11 x 2^11", NdRange::d3(1 << 11, 1 << 11, 1 << 11)),
    ] {
        let what = format!("noop over {label} on opencl-latency");
        let before = completed_on(&daemon, &opencl);
        finished(&what, latency.launch(&noop, &[], range).unwrap().wait());
        assert_eq!(last_device(&s, "opencl-latency"), opencl, "{what}");
        assert_eq!(completed_on(&daemon, &opencl) - before, 2, "{what}: two enqueues");
    }
    // A batch queue's launch is sliced for preemption too (noop is not free): at least as many.
    let (_, batch) = &queues[0];
    let before = completed_on(&daemon, &opencl);
    finished(
        "noop over 2^33 on opencl-batch",
        batch.launch(&noop, &[], 1u64 << 33).unwrap().wait(),
    );
    assert_eq!(last_device(&s, "opencl-batch"), opencl);
    assert!(completed_on(&daemon, &opencl) - before >= 2, "sliced");

    // A queue busy on the OpenCL device whose next launch is beyond that device moves to the
    // CPU once its earlier task is done; both complete, in order.
    let first = latency.launch(&noop, &[], 1u64 << 33).unwrap();
    let second = latency.launch(&noop, &[], 1u64 << 40).unwrap();
    finished("the earlier task of a moved queue", first.wait());
    finished("noop over 2^40 on a busy opencl-latency", second.wait());
    assert_eq!(last_device(&s, "opencl-latency"), "cpu0");

    // The daemon lives, and another session's ordinary tasks are exact, on both devices.
    daemon.assert_alive();
    let bystander = daemon.session_named("bystander");
    let _on_opencl = saxpy_ok(&bystander, "on-opencl", DeviceKind::OpenCl);
    assert_eq!(last_device(&bystander, "on-opencl"), opencl);
    saxpy_ok(&bystander, "on-cpu", DeviceKind::Cpu);
    saxpy_ok(&s, "huge-session-too", DeviceKind::OpenCl);
    daemon.assert_alive();
    let status = daemon.status();
    assert_eq!(status.tasks_failed, 0, "no task failed");
}
