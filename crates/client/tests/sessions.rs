//! Handles are numbers in their own session's tables: a buffer or a program kernel of one
//! session, passed to a call of another, would make the daemon use that other session's object
//! of the same number (a wrong result, silently). The client refuses them before issuing.

use agora::{Arg, Error, TaskError};

mod common;

/// The [`TaskError`] of a call refused before it was issued.
fn refused<T: std::fmt::Debug>(result: Result<T, Error>) -> TaskError {
    match result {
        Err(Error::Task(e)) => e,
        other => panic!("expected a refusal, got {other:?}"),
    }
}

#[test]
fn a_buffer_of_another_session_is_refused_by_every_call_that_names_it() {
    let (daemon, mine) = common::daemon("foreign-buffer");
    let theirs = daemon.session();
    // Each session's first buffers: the same handles in both tables.
    let x = mine.buffer_from(&[10.0f32; 4]).unwrap();
    let y = mine.buffer_from(&[0.0f32; 4]).unwrap();
    let other = theirs.buffer_from(&[1000.0f32; 4]).unwrap();
    let queue = mine.queue("mine").unwrap();
    queue.sync_to(&x).unwrap();
    queue.sync_to(&y).unwrap();
    let saxpy = mine.kernel("saxpy").unwrap();

    let e = refused(queue.launch(&saxpy, &[Arg::F32(1.0), (&other).into(), (&y).into()], 4u64));
    assert!(matches!(e, TaskError::ForeignBuffer { index: 1, .. }), "{e:?}");
    assert_eq!(e.kind(), "invalid_handle");
    let message = e.to_string();
    assert!(
        message.contains("belongs to another session") && message.contains("queue's own session"),
        "{message}"
    );
    assert!(matches!(
        refused(queue.sync_to(&other)),
        TaskError::ForeignBuffer { index: 0, .. }
    ));
    assert!(matches!(
        refused(queue.sync_from(&other)),
        TaskError::ForeignBuffer { index: 0, .. }
    ));
    assert!(matches!(
        refused(queue.memset(&other, 7)),
        TaskError::ForeignBuffer { index: 0, .. }
    ));
    assert!(matches!(
        refused(queue.copy(&x, 0, &other, 0, 0)),
        TaskError::ForeignBuffer { index: 1, .. }
    ));
    assert!(matches!(
        refused(queue.copy(&other, 0, &y, 0, 0)),
        TaskError::ForeignBuffer { index: 0, .. }
    ));
    assert!(matches!(
        refused(mine.protect(1, &other)),
        TaskError::ForeignBuffer { index: 0, .. }
    ));

    // Nothing of this session was touched in the other's stead, and it goes on.
    queue
        .launch(&saxpy, &[Arg::F32(1.0), (&x).into(), (&y).into()], 4u64)
        .unwrap();
    queue.sync_from(&y).unwrap();
    queue.sync_from(&x).unwrap();
    queue.finish().unwrap();
    assert_eq!(y.read_vec::<f32>(), vec![10.0; 4]);
    assert_eq!(x.read_vec::<f32>(), vec![10.0; 4]);
}

#[test]
fn a_program_kernel_runs_only_in_its_session_and_a_library_kernel_in_any() {
    let (daemon, first) = common::daemon("foreign-kernel");
    let second = daemon.session();
    // PTX programs build without a GPU (their launches then fail with NoDevice): enough for the
    // ids, which both sessions number alike.
    let (ptx, manifest) = agora_test_support::TENANT_PTX;
    let fill_first = first.program_ptx(ptx, manifest).unwrap().kernel("fill").unwrap();
    let fill_second = second.program_ptx(ptx, manifest).unwrap().kernel("fill").unwrap();
    assert_eq!(fill_first.id(), fill_second.id(), "the test needs colliding ids");
    let queue = second.queue("second").unwrap();
    let y = second.buffer_from(&[0.0f32; 4]).unwrap();

    let e = refused(queue.launch(&fill_first, &[(&y).into(), Arg::F32(7.0)], 4u64));
    assert_eq!(
        e,
        TaskError::ForeignKernel {
            kernel: fill_first.id()
        }
    );
    assert_eq!(e.kind(), "invalid_handle");
    assert!(e.to_string().contains("another session"), "{e}");

    // A library kernel's id is the daemon's, the same in every session.
    let saxpy = first.kernel("saxpy").unwrap();
    let x = second.buffer_from(&[1.0f32; 4]).unwrap();
    queue.sync_to(&x).unwrap();
    queue.sync_to(&y).unwrap();
    queue
        .launch(&saxpy, &[Arg::F32(2.0), (&x).into(), (&y).into()], 4u64)
        .unwrap();
    queue.sync_from(&y).unwrap();
    queue.finish().unwrap();
    assert_eq!(y.read_vec::<f32>(), vec![2.0; 4]);
}
