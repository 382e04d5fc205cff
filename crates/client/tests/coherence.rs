//! Coherence (issue #19): a program that forgets `sync_from` must fail deterministically in the
//! daemon's strict coherence mode, where the CPU computes on its own copies as OpenCL does, and
//! releasing results nobody read back is counted.

mod common;

use std::time::{Duration, Instant};

use agora::{Arg, DeviceKind, QueueOptions, Session};

fn cpu_only(tag: &str, strict: bool) -> (common::EmbeddedDaemon, Session) {
    common::daemon_with(tag, |c| {
        c.strict_coherence = strict;
        // Only the CPU: where a forgotten sync used to go unnoticed.
        c.opencl = false;
    })
}

fn cpu_queue(session: &Session) -> agora::Queue {
    session
        .queue_with(QueueOptions {
            name: "cpu".into(),
            preferred_device: Some(DeviceKind::Cpu),
            ..Default::default()
        })
        .unwrap()
}

/// y = 2x + y over `n` elements, x = 0, 1, 2, ..., y = 1; with or without the `sync_from`.
/// Returns what the host copy of y holds afterwards.
fn saxpy(session: &Session, n: usize, sync_from: bool) -> Vec<f32> {
    let q = cpu_queue(session);
    let saxpy = session.kernel("saxpy").unwrap();
    let x = session
        .buffer_from(&(0..n).map(|i| i as f32).collect::<Vec<_>>())
        .unwrap();
    let y = session.buffer_from(&vec![1.0f32; n]).unwrap();
    q.sync_to(&x).unwrap();
    q.sync_to(&y).unwrap();
    q.launch(&saxpy, &[Arg::F32(2.0), (&x).into(), (&y).into()], n).unwrap();
    assert!(y.needs_sync_from() && !x.needs_sync_from());
    if sync_from {
        q.sync_from(&y).unwrap();
        assert!(!y.needs_sync_from());
    }
    q.finish().unwrap();
    y.read_vec::<f32>()
}

fn expected(n: usize) -> Vec<f32> {
    (0..n).map(|i| 2.0 * i as f32 + 1.0).collect()
}

#[test]
fn a_forgotten_sync_from_reads_stale_data_on_the_cpu_in_strict_mode_only() {
    // Tiny launches (which used to run inline on the host copy) and lane-sized ones, repeated:
    // the outcome must not depend on timing.
    let sizes = [16usize, 100_003];
    {
        let (daemon, session) = cpu_only("coherence-strict", true);
        for _ in 0..10 {
            for n in sizes {
                assert_eq!(
                    saxpy(&session, n, false),
                    vec![1.0; n],
                    "n = {n}: the host copy must stay stale"
                );
                assert_eq!(
                    saxpy(&session, n, true),
                    expected(n),
                    "n = {n}: a correct program is exact"
                );
            }
        }
        // Device copies change only at sync_to: a host write without one is not seen.
        let q = cpu_queue(&session);
        let saxpy_kernel = session.kernel("saxpy").unwrap();
        let n = 1000;
        let x = session.buffer_from(&vec![1.0f32; n]).unwrap();
        let y = session.buffer_from(&vec![0.0f32; n]).unwrap();
        q.sync_to(&x).unwrap();
        q.sync_to(&y).unwrap();
        q.launch(&saxpy_kernel, &[Arg::F32(1.0), (&x).into(), (&y).into()], n)
            .unwrap();
        q.finish().unwrap();
        x.write_slice(&vec![100.0f32; n]).unwrap(); // and no sync_to
        q.launch(&saxpy_kernel, &[Arg::F32(1.0), (&x).into(), (&y).into()], n)
            .unwrap();
        q.sync_from(&y).unwrap();
        q.finish().unwrap();
        assert_eq!(y.read_vec::<f32>(), vec![2.0; n], "the device used its own copy of x");
        drop(session);
        daemon.stop().unwrap();
    }
    // Without strict coherence the CPU computes on the host copy: the same buggy program
    // "works" there, which is the bug this mode exposes.
    let (daemon, session) = cpu_only("coherence-lax", false);
    for n in sizes {
        assert_eq!(saxpy(&session, n, false), expected(n));
    }
    drop(session);
    daemon.stop().unwrap();
}

/// This session's `unread_releases` once it reaches `at_least` (or the timeout).
fn unread_releases(session: &Session, at_least: u64) -> u64 {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let status = session.status().unwrap();
        let me = status.sessions.iter().find(|s| s.id == session.id()).unwrap();
        if me.unread_releases >= at_least || Instant::now() > deadline {
            return me.unread_releases;
        }
        std::thread::sleep(Duration::from_millis(5));
    }
}

#[test]
fn releasing_results_never_read_back_is_counted() {
    let (daemon, session) = cpu_only("coherence-release", true);
    let q = cpu_queue(&session);
    let saxpy = session.kernel("saxpy").unwrap();
    let n = 4096;
    let x = session.buffer_from(&vec![1.0f32; n]).unwrap();
    let read_back = session.buffer_from(&vec![0.0f32; n]).unwrap();
    let forgotten = session.buffer_from(&vec![0.0f32; n]).unwrap();
    for y in [&read_back, &forgotten] {
        q.sync_to(y).unwrap();
        q.launch(&saxpy, &[Arg::F32(2.0), (&x).into(), y.into()], n).unwrap();
    }
    q.sync_to(&x).unwrap();
    q.sync_from(&read_back).unwrap();
    q.finish().unwrap();
    assert_eq!(read_back.read_vec::<f32>(), vec![2.0; n]);
    assert!(!read_back.needs_sync_from() && forgotten.needs_sync_from() && !x.needs_sync_from());
    assert_eq!(unread_releases(&session, 0), 0);
    // Released in ring order: the buffers read back (or only read) first, then the forgotten
    // one; once that one is counted the others were judged, and did not count.
    drop(read_back);
    drop(x);
    drop(forgotten);
    assert_eq!(unread_releases(&session, 1), 1);
    std::thread::sleep(Duration::from_millis(50));
    assert_eq!(unread_releases(&session, 0), 1);
    drop(session);
    daemon.stop().unwrap();
}
