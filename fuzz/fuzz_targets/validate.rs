//! The daemon's validate stage: `TaskDescriptor::decode`, then the descriptor resolved against a
//! session's own tables (queues, buffers with generations, the kernel table and the session's
//! program kernels), as the dispatcher does for each descriptor it takes from a ring
//! (`agora_daemon::fuzzing`, a session built without sockets).
//!
//! Properties: only the live queue and live buffer handles resolve (never a released or forged
//! one); every byte range a task touches lies inside its buffer and the session's heap; no buffer
//! is passed twice when either use writes it; a launch names a known kernel with exactly its
//! parameters, and its range is non-empty and bounded; a failure is never an internal error, its
//! stated reason is true, and the completion record carries it back unchanged.
#![no_main]

use agora_daemon::fuzzing::{Outcome, ValidateHarness};
use agora_protocol::completion::Completion;
use agora_protocol::descriptor::{Op, TaskDescriptor, MAX_RANGE_ITEMS};
use agora_protocol::TaskError;
use libfuzzer_sys::fuzz_target;

thread_local! {
    static HARNESS: ValidateHarness = ValidateHarness::new();
}

fuzz_target!(|data: &[u8]| {
    let mut bytes = [0u8; 320];
    let n = data.len().min(bytes.len());
    bytes[..n].copy_from_slice(&data[..n]);
    let d: TaskDescriptor = bytemuck::pod_read_unaligned(&bytes);
    HARNESS.with(|h| check(h, &d));
});

fn live_len(h: &ValidateHarness, handle: u64) -> Option<u64> {
    h.buffers.iter().find(|(b, _)| *b == handle).map(|(_, len)| *len)
}

fn check(h: &ValidateHarness, d: &TaskDescriptor) {
    let outcome = h.validate(d);
    let again = h.validate(d);
    assert_eq!(
        format!("{outcome:?}"),
        format!("{again:?}"),
        "validation is not deterministic"
    );
    match outcome {
        Ok(Outcome::Released) => match Op::from_u32(d.op) {
            Some(Op::ReleaseBuffer) => assert!(live_len(h, d.args[0].value).is_some()),
            Some(Op::ReleaseQueue) => assert_eq!(d.queue, h.queue),
            other => panic!("{other:?} released something"),
        },
        Ok(Outcome::Ready {
            op,
            kernel,
            items,
            range,
            touched_bytes,
            buffers,
            estimated_ns,
        }) => {
            assert_eq!(d.queue, h.queue, "a task on a queue that is not live");
            assert!(estimated_ns >= 0.0 && !estimated_ns.is_nan(), "{estimated_ns}");
            let mut total = 0u64;
            for u in &buffers {
                let handle = d.args[u.slot].value;
                assert_eq!(
                    live_len(h, handle),
                    Some(u.len),
                    "slot {} resolved handle {handle:#x}",
                    u.slot
                );
                let end = u.range.0.checked_add(u.range.1).expect("range overflows");
                assert!(end <= u.len, "{u:?} leaves its buffer");
                assert!(u.in_heap, "{u:?} leaves the heap");
                assert!(!u.overwrites || u.writes);
                for other in &buffers {
                    if other.slot != u.slot && other.heap_offset == u.heap_offset {
                        assert!(
                            !(u.writes || other.writes) || op == Op::Copy,
                            "a written buffer is aliased: {buffers:?}"
                        );
                    }
                }
                total += u.len;
            }
            match op {
                Op::Launch => {
                    let id = kernel.expect("a launch without a kernel");
                    assert_eq!(id, d.kernel);
                    let (_, params, _) = h
                        .kernels_ids
                        .iter()
                        .find(|(k, ..)| *k == id)
                        .expect("a launch of an unknown kernel");
                    assert_eq!(params.len(), d.arg_count as usize);
                    let product = range.iter().try_fold(1u64, |a, &b| a.checked_mul(b));
                    assert_eq!(product, Some(items));
                    assert!((1..=MAX_RANGE_ITEMS).contains(&items));
                    assert!(touched_bytes <= total, "{touched_bytes} > {total}");
                }
                Op::SyncTo | Op::SyncFrom | Op::Memset => assert_eq!(buffers.len(), 1),
                Op::Copy => assert_eq!(buffers.len(), 2),
                other => panic!("{other:?} became a task"),
            }
        }
        Err(e) => {
            assert!(!matches!(e, TaskError::Internal(_)), "internal error: {e:?} for {d:?}");
            assert_eq!(Completion::failed(d.task_id, e).result(), Err(e));
            match e {
                TaskError::UnknownQueue(q) => assert_ne!(q, h.queue),
                TaskError::InvalidHandle { handle, .. } => assert!(live_len(h, handle).is_none()),
                // The harness installs program kernels without a program a release could give back.
                TaskError::UnknownKernel(_) if d.op == Op::ReleaseProgram as u32 => {}
                TaskError::UnknownKernel(k) => assert!(h.kernels_ids.iter().all(|(id, ..)| *id != k)),
                TaskError::OutOfBounds { end, len, .. } => assert!(end > len),
                TaskError::BufferTooSmall { needed, len, .. } => assert!(needed > len),
                _ => {}
            }
        }
    }
}
