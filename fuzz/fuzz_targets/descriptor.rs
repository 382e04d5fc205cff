//! `TaskDescriptor::decode`: the 320 bytes a client writes into its submission ring.
//!
//! Properties: every byte pattern is a descriptor (POD, bytes round trip); `decode` either
//! returns fields that satisfy what it promises (known op, `arg_count` valid tags, 1 to 3
//! non-zero extents whose product is at most `MAX_RANGE_ITEMS`), or a stateless error whose
//! stated reason is true of the descriptor and which the completion record carries back to the
//! client unchanged. The argument accessors never panic and agree with the tags.
#![no_main]

use agora_protocol::completion::{Completion, Malformed};
use agora_protocol::descriptor::{ArgTag, Op, TaskDescriptor, MAX_ARGS, MAX_RANGE_ITEMS};
use agora_protocol::TaskError;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let mut bytes = [0u8; 320];
    let n = data.len().min(bytes.len());
    bytes[..n].copy_from_slice(&data[..n]);
    let d: TaskDescriptor = bytemuck::pod_read_unaligned(&bytes);
    assert_eq!(bytemuck::bytes_of(&d), &bytes[..]);
    match d.decode() {
        Ok(dec) => {
            let op = Op::from_u32(d.op).expect("decoded an unknown op");
            assert_eq!(dec.op, op);
            assert_eq!((dec.task_id, dec.queue, dec.kernel), (d.task_id, d.queue, d.kernel));
            assert_eq!(dec.args.len(), d.arg_count as usize);
            assert!(dec.args.len() <= MAX_ARGS);
            assert_eq!(dec.args, &d.args[..dec.args.len()]);
            for a in dec.args {
                assert!(ArgTag::from_u32(a.tag).is_some(), "a bad tag passed: {a:?}");
            }
            // A row window: only on launches, non-empty, inside the first dimension.
            match dec.window {
                None => assert!(d.window_first == 0 && d.window_rows == 0),
                Some((first, end)) => {
                    assert_eq!(op, Op::Launch);
                    assert!(first < end && end <= dec.range[0], "{first}..{end} of {:?}", dec.range);
                    assert_eq!(
                        (first, end - first),
                        (u64::from(d.window_first), u64::from(d.window_rows))
                    );
                }
            }
            if op == Op::Launch {
                assert_eq!(dec.range.len(), d.dims as usize);
                assert!((1..=3).contains(&dec.range.len()));
                assert_eq!(dec.range, &d.range[..dec.range.len()]);
                let items = dec.range.iter().try_fold(1u64, |a, &b| a.checked_mul(b));
                assert!(
                    matches!(items, Some(i) if (1..=MAX_RANGE_ITEMS).contains(&i)),
                    "{:?}",
                    dec.range
                );
            } else {
                assert!(dec.range.is_empty());
            }
            for index in 0..=MAX_ARGS {
                let tag = dec.args.get(index).map(|a| a.tag);
                match dec.buffer_arg(index) {
                    Ok(h) => {
                        assert_eq!(tag, Some(ArgTag::Buffer as u32));
                        assert_eq!(h, dec.args[index].value);
                    }
                    Err(TaskError::ArgumentType { index: i, got, .. }) => {
                        assert_eq!((usize::from(i), Some(got)), (index, tag));
                    }
                    Err(TaskError::ArgumentCount { .. }) => assert_eq!(tag, None),
                    Err(e) => panic!("buffer_arg({index}): {e:?}"),
                }
                match dec.u64_arg_or(index, 7) {
                    Ok(v) if tag.is_none() => assert_eq!(v, 7),
                    Ok(v) => {
                        assert!(tag == Some(ArgTag::U64 as u32) || tag == Some(ArgTag::U32 as u32));
                        assert_eq!(v, dec.args[index].value);
                    }
                    Err(TaskError::ArgumentType { got, .. }) => assert_eq!(Some(got), tag),
                    Err(e) => panic!("u64_arg_or({index}): {e:?}"),
                }
            }
        }
        Err(e) => {
            // The client reads the error back from its completion record.
            assert_eq!(Completion::failed(d.task_id, e).result(), Err(e));
            match e {
                TaskError::Malformed(Malformed::UnknownOp(op)) => {
                    assert!(op == d.op && Op::from_u32(op).is_none());
                }
                TaskError::Malformed(Malformed::TooManyArguments(n)) => {
                    assert!(n == d.arg_count && n as usize > MAX_ARGS);
                }
                TaskError::Malformed(Malformed::BadArgumentTag { index, tag }) => {
                    let index = usize::from(index);
                    assert!(index < d.arg_count as usize && d.args[index].tag == tag);
                    assert!(ArgTag::from_u32(tag).is_none());
                }
                TaskError::Malformed(Malformed::BadDimensions(dims)) => {
                    assert!(d.op == Op::Launch as u32 && dims == d.dims && !(1..=3).contains(&dims));
                }
                TaskError::InvalidRange { items, max } => {
                    assert_eq!(d.op, Op::Launch as u32);
                    assert_eq!(max, MAX_RANGE_ITEMS);
                    let range = &d.range[..d.dims as usize];
                    assert!(range.contains(&0) || items > MAX_RANGE_ITEMS, "{range:?} {items}");
                }
                TaskError::BadWindow { reason, first, end } => {
                    assert_eq!(reason, agora_protocol::completion::WINDOW_OUTSIDE);
                    assert_eq!(
                        (first, end),
                        (
                            u64::from(d.window_first),
                            u64::from(d.window_first) + u64::from(d.window_rows)
                        )
                    );
                    let extent = if d.op == Op::Launch as u32 { d.range[0] } else { 0 };
                    assert!(d.op != Op::Launch as u32 || d.window_rows == 0 || end > extent);
                }
                other => panic!("decode returned a stateful error: {other:?}"),
            }
        }
    }
});
