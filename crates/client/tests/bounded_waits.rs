//! `Task::wait_timeout` and `Queue::finish_timeout`: a wait in slices gives up while the task
//! runs, then reports the same outcome `wait` and `finish` do. A wait for room in the rings
//! gives up when a binding's interrupt check says so.

use std::time::Duration;

use agora::{Arg, DeviceKind, Error, QueueOptions, TaskError};

mod common;

#[test]
fn bounded_waits_give_up_while_running_then_report_the_outcome() {
    let (daemon, session) = common::daemon("bounded-waits");
    let queue = session
        .queue_with(QueueOptions {
            name: "bounded".into(),
            preferred_device: Some(DeviceKind::Cpu),
            ..Default::default()
        })
        .unwrap();
    let n = 1024u32;
    let a = session.buffer_from(&vec![1.0f32; (n * n) as usize]).unwrap();
    let c = session.buffer((n * n * 4).into()).unwrap();
    let sgemm = session.kernel("sgemm").unwrap();
    let args = [
        Arg::I32(n as i32),
        Arg::I32(n as i32),
        Arg::I32(n as i32),
        Arg::F32(1.0),
        (&a).into(),
        (&a).into(),
        Arg::F32(0.0),
        (&c).into(),
    ];
    let task = queue.launch(&sgemm, &args, (u64::from(n), u64::from(n))).unwrap();
    // Two GFLOP cannot be done the moment they were issued.
    assert!(!task.wait_timeout(Duration::ZERO).unwrap());
    assert!(!queue.finish_timeout(Duration::ZERO).unwrap());
    let mut slices = 0;
    while !task.wait_timeout(Duration::from_millis(5)).unwrap() {
        slices += 1;
    }
    assert!(slices > 0);
    assert!(
        task.wait_timeout(Duration::ZERO).unwrap(),
        "asked again, the same outcome"
    );
    assert!(queue.finish_timeout(Duration::ZERO).unwrap());

    // A failed task: its error, every time; the queue's failures once, as `finish` reports them.
    let small = session.buffer(16).unwrap();
    let saxpy = session.kernel("saxpy").unwrap();
    let bad = queue
        .launch(&saxpy, &[Arg::F32(1.0), (&small).into(), (&c).into()], 1000u64)
        .unwrap();
    for _ in 0..2 {
        let mut outcome = bad.wait_timeout(Duration::from_millis(5));
        while matches!(outcome, Ok(false)) {
            outcome = bad.wait_timeout(Duration::from_millis(5));
        }
        assert!(
            matches!(outcome, Err(Error::Task(TaskError::BufferTooSmall { index: 1, .. }))),
            "{outcome:?}"
        );
    }
    match queue.finish_timeout(Duration::from_secs(60)) {
        Err(Error::Tasks(failures)) => assert_eq!(failures.count, 1),
        other => panic!("finish_timeout should report the failure: {other:?}"),
    }
    assert!(queue.finish_timeout(Duration::ZERO).unwrap(), "reported once");
    drop((task, bad, queue, a, c, small, session));
    daemon.stop().unwrap();
}

/// A latency tenant's waits never yield their core (a yield can lose it to batch work for a
/// time slice), except right after its thread woke a sleeping dispatcher: that dispatcher needs
/// a core to run on, perhaps the very one the wait would spin on. A batch tenant's waits yield
/// cooperatively whatever happened.
#[test]
fn a_latency_wait_yields_only_after_its_thread_woke_the_dispatcher() {
    let (daemon, batch) = common::daemon("wait-yielding");
    let latency = daemon.session();
    let q = latency
        .queue_with(QueueOptions {
            name: "requests".into(),
            class: agora::QueueClass::Latency,
            ..Default::default()
        })
        .unwrap();
    let noop = latency.kernel("noop").unwrap();
    let dispatcher_asleep = || {
        agora::testing::segment_view(&latency)
            .header()
            .daemon_sleeping
            .load(std::sync::atomic::Ordering::SeqCst)
            != 0
    };
    let (mut woke, mut found_awake) = (0, 0);
    for _ in 0..2000 {
        if woke > 0 && found_awake > 0 {
            break;
        }
        // Now and then let the dispatcher's spin run out, so the next launch finds it asleep.
        if woke == 0 {
            let _ = agora_test_support::eventually(Duration::from_secs(5), dispatcher_asleep);
        }
        let task = q.launch(&noop, &[], 1u64).unwrap();
        let yielding = agora::testing::wait_yielding(&latency);
        task.wait().unwrap();
        match yielding {
            "rarely" => woke += 1,
            "never" => found_awake += 1,
            other => panic!("a latency tenant's wait yields {other}"),
        }
    }
    assert!(woke > 0, "no launch found the dispatcher asleep");
    assert!(
        found_awake > 0,
        "no launch found the dispatcher awake (back to back, it spins)"
    );
    let bq = batch.queue("batch").unwrap();
    let batch_noop = batch.kernel("noop").unwrap();
    bq.launch(&batch_noop, &[], 1u64).unwrap().wait().unwrap();
    assert_eq!(agora::testing::wait_yielding(&batch), "cooperative");
}

/// A launch that waits for room in full rings (another thread took the room `wait_for_room`
/// found) ends as soon as the binding's interrupt check (Python: a pending Ctrl-C) says so,
/// with nothing issued; the session carries on.
#[test]
fn a_wait_for_ring_room_ends_when_the_interrupt_check_says_so() {
    let (_daemon, session) = common::daemon_with("room-interrupt", |c| c.ring_capacity = 2);
    let queue = session
        .queue_with(QueueOptions {
            name: "full".into(),
            preferred_device: Some(DeviceKind::Cpu),
            ..Default::default()
        })
        .unwrap();
    // A long task, and tasks behind it until rings of two slots are full.
    let (long, _c) = agora_test_support::long_sgemm(&session, &queue, 1536);
    let x = session.buffer(64).unwrap();
    while session.wait_for_room(Duration::ZERO).unwrap() {
        queue.memset(&x, 1).unwrap();
    }
    assert!(
        !long.is_complete().unwrap(),
        "the sgemm should run longer: make it larger"
    );
    let began = std::time::Instant::now();
    let outcome = agora::with_room_interrupt(|| true, || queue.memset(&x, 2));
    assert!(matches!(outcome, Err(Error::Interrupted)), "{outcome:?}");
    assert!(
        began.elapsed() < Duration::from_millis(200) && !long.is_complete().unwrap(),
        "{:?}",
        began.elapsed()
    );
    // Nothing was issued, and the session goes on.
    long.wait().unwrap();
    queue.memset(&x, 3).unwrap();
    queue.sync_from(&x).unwrap();
    queue.finish().unwrap();
    assert!(x.as_slice::<u8>().iter().all(|v| *v == 3));
}
