//! `Task::wait_timeout` and `Queue::finish_timeout`: a wait in slices gives up while the task
//! runs, then reports the same outcome `wait` and `finish` do.

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
