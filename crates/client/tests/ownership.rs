//! What a session's objects may do outside the ordinary: in a process forked from the one that
//! opened the session (nothing: every call fails with `Error::ForkedChild`, and dropping them
//! releases nothing of the parent's), and how the heap room a released buffer leaves is there
//! for the next allocation although the release travels through the task ring.

use std::time::{Duration, Instant};

use agora::{Arg, Error, Session, SessionOptions};
use agora_protocol::control::ControlError;

mod common;

/// Runs `child` in a forked child process and returns its exit status (`child`'s value; 100 if
/// it panicked). The child ends with `_exit`: no destructor of the parent's runs there.
fn in_forked_child(child: impl FnOnce() -> i32) -> i32 {
    // SAFETY: the child only runs `child` (the client's calls and drops, which take no lock in a
    // forked child) and `_exit`s.
    let pid = unsafe { libc::fork() };
    assert!(pid >= 0, "fork failed");
    if pid == 0 {
        let code = std::panic::catch_unwind(std::panic::AssertUnwindSafe(child)).unwrap_or(100);
        // SAFETY: ends the child at once.
        unsafe { libc::_exit(code) };
    }
    let mut status = 0;
    // SAFETY: waits for the child just forked.
    assert_eq!(unsafe { libc::waitpid(pid, &mut status, 0) }, pid);
    assert!(libc::WIFEXITED(status), "the child did not exit: status {status:#x}");
    libc::WEXITSTATUS(status)
}

/// Drops the forked child's copy of `value`, as its exit would (the child's memory is its own
/// after the fork; the parent's `value` lives on, and the child never touches this one again).
fn drop_in_child<T>(value: &T) {
    // SAFETY: called in the child only, once per value, which it never uses afterwards.
    drop(unsafe { std::ptr::read(value) });
}

/// Whether `result` is the forked-child refusal naming `parent`.
fn refused_in_child<T>(result: Result<T, Error>, parent: u32) -> bool {
    match result {
        Err(e @ Error::ForkedChild { owner_pid }) => {
            owner_pid == parent
                && e.to_string()
                    .contains(&format!("opened by process {parent} before a fork()"))
        }
        _ => false,
    }
}

#[test]
fn a_forked_child_cannot_use_the_parent_s_session_and_the_parent_carries_on() {
    let (_daemon, session) = common::daemon("fork");
    let parent = std::process::id();
    let queue = session.queue("parent").unwrap();
    let buffer = session.buffer_from(&[1.0f32; 256]).unwrap();
    let kernel = session.kernel("saxpy").unwrap();
    let y = session.buffer_from(&[0.0f32; 256]).unwrap();
    queue.sync_to(&buffer).unwrap();
    queue.sync_to(&y).unwrap();
    let done = queue.memset(&y, 0).unwrap();
    done.wait().unwrap();

    // Every kind of call fails at once with the typed error; then the child drops all it
    // inherited (as an exiting interpreter would).
    let status = in_forked_child(|| {
        let mut wrong = 0;
        let checks: [(i32, bool); 10] = [
            (1, refused_in_child(session.buffer(64), parent)),
            (2, refused_in_child(session.queue("child"), parent)),
            (3, refused_in_child(session.status(), parent)),
            (4, refused_in_child(session.kernel("saxpy"), parent)),
            (5, refused_in_child(queue.memset(&buffer, 7), parent)),
            (
                6,
                refused_in_child(
                    queue.launch(&kernel, &[Arg::F32(1.0), (&buffer).into(), (&y).into()], 256u64),
                    parent,
                ),
            ),
            (7, refused_in_child(queue.finish(), parent)),
            (8, refused_in_child(done.wait(), parent)),
            (9, refused_in_child(buffer.write(0, &[0u8; 4]), parent)),
            (
                10,
                refused_in_child(session.wait_for_room(Duration::from_millis(1)), parent),
            ),
        ];
        for (bit, ok) in checks {
            if !ok {
                wrong |= 1 << (bit - 1);
            }
        }
        // Exit statuses are 8 bits: fold the ten checks.
        let wrong = (wrong & 0xff) | (wrong >> 8);
        drop_in_child(&done);
        drop_in_child(&y);
        drop_in_child(&buffer);
        drop_in_child(&queue);
        drop_in_child(&session);
        wrong
    });
    assert_eq!(status, 0, "calls the child could make (bit i-1: check i)");
}

#[test]
fn what_a_forked_child_drops_stays_the_parent_s() {
    let (_daemon, session) = common::daemon("fork-drops");
    let queue = session.queue("parent").unwrap();
    let x = session.buffer_from(&[1.0f32; 1024]).unwrap();
    let y = session.buffer_from(&[2.0f32; 1024]).unwrap();
    queue.sync_to(&x).unwrap();
    queue.sync_to(&y).unwrap();
    queue.finish().unwrap();
    let saxpy = session.kernel("saxpy").unwrap();

    // The child only drops what it inherited (a Python child's exit does this), and so do its
    // own children.
    let status = in_forked_child(|| {
        let grandchild = in_forked_child(|| {
            drop_in_child(&x);
            0
        });
        drop_in_child(&x);
        drop_in_child(&y);
        drop_in_child(&queue);
        drop_in_child(&session);
        grandchild
    });
    assert_eq!(status, 0);

    // The parent's queue and buffers are whole: many tasks go through the ring (a child that
    // had published into it would have left the parent waiting for completions that never
    // come), and the buffers were not released.
    for _ in 0..3 {
        queue
            .launch(&saxpy, &[Arg::F32(1.0), (&x).into(), (&y).into()], 1024u64)
            .unwrap();
    }
    let read = queue.sync_from(&y).unwrap();
    assert!(
        read.wait_timeout(Duration::from_secs(20)).unwrap(),
        "the parent's tasks never completed"
    );
    queue.finish().unwrap();
    assert!(y.as_slice::<f32>().iter().all(|v| *v == 5.0));
    // And it can allocate and issue as before.
    let z = session.buffer_from(&[3.0f32; 16]).unwrap();
    queue.sync_to(&z).unwrap();
    queue.finish().unwrap();
}

/// A long sgemm on `queue` whose output is `c`: `c` is in use until the task finishes. Returns
/// the task and its input.
fn long_task_using(session: &Session, queue: &agora::Queue, c: &agora::Buffer, n: i32) -> (agora::Task, agora::Buffer) {
    let a = session.buffer_from(&vec![1.0f32; (n * n) as usize]).unwrap();
    queue.sync_to(&a).unwrap();
    let sgemm = session.kernel("sgemm").unwrap();
    let args = [
        Arg::I32(n),
        Arg::I32(n),
        Arg::I32(n),
        Arg::F32(1.0),
        (&a).into(),
        (&a).into(),
        Arg::F32(0.0),
        c.into(),
    ];
    (queue.launch(&sgemm, &args, (n as u64, n as u64)).unwrap(), a)
}

const QUOTA: u64 = 64 << 20;
const BIG: u64 = 40 << 20;

#[test]
fn the_room_a_released_buffer_leaves_is_there_for_the_next_allocation() {
    let (_daemon, session) = common::daemon_with("release-then-allocate", |c| c.session_quota = QUOTA);
    let queue = session.queue("q").unwrap();
    // A release goes through the ring, and frees the range only once the tasks using the buffer
    // finished; the allocation is a control request: it must wait for both, not fail.
    for round in 0..3 {
        let big = session.buffer(BIG).unwrap();
        let (task, _input) = long_task_using(&session, &queue, &big, 768);
        drop(big);
        let again = session.buffer(BIG);
        assert!(again.is_ok(), "round {round}: {again:?}");
        task.wait().unwrap();
    }
    // Released without any task using it: the next allocation finds the room at once.
    for round in 0..20 {
        let big = session.buffer(BIG).unwrap();
        drop(big);
        let again = session.buffer(BIG);
        assert!(again.is_ok(), "round {round}: {again:?}");
    }
}

#[test]
fn an_allocation_waits_for_releases_at_most_the_control_timeout_and_says_the_truth() {
    let (daemon, _) = common::daemon_with("release-then-allocate-bounded", |c| c.session_quota = QUOTA);
    let session = Session::connect_with(SessionOptions {
        socket: Some(daemon.socket().to_path_buf()),
        control_timeout: Some(Duration::from_millis(300)),
        ..SessionOptions::default()
    })
    .unwrap();
    let queue = session.queue("q").unwrap();
    let big = session.buffer(BIG).unwrap();
    // Seconds on a CPU lane: far past the control timeout.
    let (task, _input) = long_task_using(&session, &queue, &big, 1280);
    drop(big);

    // More than the release could ever make room for: refused at once.
    let began = Instant::now();
    let e = session.buffer(QUOTA).unwrap_err();
    assert!(matches!(e, Error::Control(ControlError::QuotaExceeded { .. })), "{e}");
    assert!(began.elapsed() < Duration::from_millis(250), "{:?}", began.elapsed());

    // What the release would make room for, but the task holds it past the control timeout:
    // refused after about that long, with the daemon's numbers.
    let began = Instant::now();
    let e = session.buffer(BIG).unwrap_err();
    let waited = began.elapsed();
    assert!(
        matches!(e, Error::Control(ControlError::QuotaExceeded { requested, .. }) if requested == BIG),
        "{e}"
    );
    assert!(
        waited >= Duration::from_millis(250) && waited < Duration::from_secs(3),
        "{waited:?}"
    );
    assert!(
        !task.is_complete().unwrap(),
        "the task should outlast the wait: make it longer"
    );
    task.wait().unwrap();
    // Now it is free.
    session.buffer(BIG).unwrap();
}
