//! Stage 1, **validate**: a decoded descriptor becomes a [`Ready`] task, or fails with the
//! `TaskError` that names what is wrong.
//!
//! Owns: resolving handles against the session's own tables (queue, buffers), checking a launch
//! against its kernel's signature and size rule, checking byte ranges of transfers, and saying
//! how the task uses each buffer (`data_roles`, for the outcome rules).
//!
//! Must not: choose a device, touch placement or device memory, or keep any state — a `Ready`
//! is everything the later stages need, so each can be tested with a hand-made one.

use std::sync::Arc;

use agora_kernels::{ArgValue, KernelRef, LaunchShape};
use agora_protocol::descriptor::Decoded;
use agora_protocol::{Access, ArgTag, Op, ParamKind, TaskError, MAX_ARGS};

use crate::kernels::{KernelTable, SESSION_KERNEL_BIT};
use crate::memory::BufferRecord;
use crate::outcome::Role;
use crate::session::{QueueState, Session};

/// Name of an operation in metrics and traces.
pub(super) fn operation_name(action: &Action) -> &'static str {
    match action {
        Action::Launch { kernel, .. } => kernel.label(),
        Action::SyncTo => "sync_to",
        Action::SyncFrom => "sync_from",
        Action::Fill { .. } => "memset",
        Action::Copy { .. } => "copy",
        Action::Checkpoint { .. } => "checkpoint",
    }
}

/// What a resolved task does.
// `Launch` is the common case; boxing it would cost an allocation per task.
// Clone: a task's action is kept for replay when a device loses it.
#[allow(clippy::large_enum_variant)]
#[derive(Clone)]
pub(super) enum Action {
    Launch {
        kernel: KernelRef,
        /// The id the descriptor named (for messages).
        id: u32,
        range: [u64; 3],
        dims: usize,
        args: [ArgValue; MAX_ARGS],
        arg_count: usize,
        /// Rows of dimension 0 to run, `(first, end)` (a row window); `None`: all.
        window: Option<(u64, u64)>,
    },
    SyncTo,
    SyncFrom,
    Fill {
        offset: u64,
        len: u64,
        value: u8,
    },
    Copy {
        src_offset: u64,
        dst_offset: u64,
        len: u64,
    },
    /// Capture the session's protected buffers (in `buffers`, in id order) for checkpoint
    /// `checkpoint` at `level` (1–4, judged when it is planned).
    Checkpoint {
        checkpoint: u64,
        level: u32,
        /// A `snapshot()`: the daemon numbers it (after the application's newest id) and
        /// `checkpoint` is ignored.
        snapshot: bool,
        /// The protected id of each buffer slot.
        ids: [u32; MAX_ARGS],
    },
}

impl Action {
    /// Whether the task makes copies of its buffers on a device with memory of its own
    /// (`Placement::prepare` in `plan`): launches and `sync_to` do; `sync_from`, memset, copy and
    /// checkpoints work on the host copies wherever they are bound (a busy queue's host-side
    /// work keeps the queue's lane, for order), so they need no device memory.
    pub(super) fn makes_device_copies(&self) -> bool {
        matches!(self, Action::Launch { .. } | Action::SyncTo)
    }
}

/// A task whose arguments are resolved and checked. Clone: kept, for a task that allocates
/// device memory, until its device runtime took the allocation (a refusal makes it wait).
#[derive(Clone)]
pub(super) struct Ready {
    pub(super) queue: Arc<QueueState>,
    pub(super) action: Action,
    pub(super) estimated_ns: f64,
    /// Work items of a launch (the product of its range); 0 otherwise.
    pub(super) items: u64,
    /// Bytes of its buffers a launch uses by its kernel's size rule (an upper bound on what it
    /// touches, from the arguments alone); 0 otherwise.
    pub(super) touched_bytes: u64,
    /// How many leading entries of `buffers` may hold a buffer (the hot path skips the rest).
    pub(super) slots: usize,
    /// Buffer arguments with their access (transfers name buffers by argument index).
    pub(super) buffers: [Option<(Arc<BufferRecord>, Access, bool)>; MAX_ARGS],
}

impl Ready {
    /// The kernel, for a launch.
    pub(super) fn kernel(&self) -> Option<&KernelRef> {
        match &self.action {
            Action::Launch { kernel, .. } => Some(kernel),
            _ => None,
        }
    }

    /// The kernel id the descriptor named, for `NoDevice` (0 for transfers).
    pub(super) fn kernel_id(&self) -> u32 {
        match &self.action {
            Action::Launch { id, .. } => *id,
            _ => 0,
        }
    }
}

/// How a task uses each of its buffer arguments (what it reads, writes, rewrites whole).
pub(super) fn data_roles(ready: &Ready) -> [Role; MAX_ARGS] {
    let mut roles = [Role::default(); MAX_ARGS];
    for (slot, entry) in ready.buffers[..ready.slots].iter().enumerate() {
        let Some((record, access, overwrites)) = entry else {
            continue;
        };
        roles[slot] = match &ready.action {
            Action::Launch { .. } => Role::launch(*access, *overwrites),
            // Rewrites the host copy whole (the placement treats any sync_to so).
            Action::SyncTo => Role::write(0, record.len, record.len),
            Action::SyncFrom | Action::Checkpoint { .. } => Role::READ,
            Action::Fill { offset, len, .. } => Role::write(*offset, *len, record.len),
            Action::Copy { dst_offset, len, .. } => {
                let same = matches!(&ready.buffers[1 - slot], Some((other, _, _)) if Arc::ptr_eq(other, record));
                match (slot, same) {
                    (0, _) => Role::READ,
                    (_, false) => Role::write(*dst_offset, *len, record.len),
                    // Copying within one buffer keeps the rest of it.
                    (_, true) => Role {
                        reads: true,
                        writes: true,
                        whole: false,
                    },
                }
            }
        };
    }
    roles
}

/// Looks up buffer argument `index` (handle in `handle`) in the session.
fn buffer(session: &Session, index: usize, handle: u64) -> Result<&Arc<BufferRecord>, TaskError> {
    session.buffers.get(handle).ok_or(TaskError::InvalidHandle {
        index: index as u16,
        handle,
    })
}

/// Checks that `[offset, offset+len)` (len 0 = to the end) lies in `record`; returns the range.
fn byte_range(record: &BufferRecord, index: usize, offset: u64, len: u64) -> Result<(u64, u64), TaskError> {
    let len = if len == 0 {
        record.len.saturating_sub(offset)
    } else {
        len
    };
    let end = offset.saturating_add(len);
    if end > record.len {
        return Err(TaskError::OutOfBounds {
            index: index as u16,
            end,
            len: record.len,
        });
    }
    Ok((offset, len))
}

pub(super) fn heap_ptr(session: &Session, record: &BufferRecord, offset: u64, len: u64) -> Result<*mut u8, TaskError> {
    if let Some(region) = &record.region {
        // An exportable buffer's own region, which the job keeps mapped by holding the record.
        return region
            .range(offset, len)
            .ok_or_else(|| crate::internal_error(1, "a range outside an exportable buffer's region"));
    }
    // The heap allocator only hands out in-heap ranges, so this cannot fail unless the daemon
    // is wrong; fail this task with an internal error rather than trusting it.
    session
        .shared
        .segment
        .view()
        .heap_range(record.offset + offset, len)
        .ok_or_else(|| crate::internal_error(1, "a buffer's heap range lies outside the session's heap"))
}

/// For a task that [`resolve`] refused: the buffers it would have written, as a `Ready` whose
/// failure the dispatcher settles in its queue's order, poisoning them — so a later task that
/// reads one fails `DependencyFailed`, naming the refused task, instead of computing on contents
/// that task should have produced (a `saxpy` refused for a buffer too small left `y` as it was,
/// and the pipeline went on as if that step had never been issued). Only what can be trusted:
/// `None` without a known queue, a known kernel (for a launch) or a valid handle written. Every
/// role is a write that reads nothing, so the refusal is reported as itself.
pub(super) fn written_by_refused(session: &Session, kernels: &KernelTable, d: &Decoded<'_>) -> Option<Ready> {
    let queue = session.queues.get(d.queue)?.clone();
    let mut buffers: [Option<(Arc<BufferRecord>, Access, bool)>; MAX_ARGS] = Default::default();
    let mut written = |index: usize, handle: u64| {
        let record = session.buffers.get(handle)?;
        let seen = buffers.iter().flatten().any(|(other, _, _)| Arc::ptr_eq(other, record));
        if !seen && index < MAX_ARGS {
            buffers[index] = Some((record.clone(), Access::Write, false));
        }
        Some(())
    };
    let action = match d.op {
        Op::Launch => {
            let kernel = if d.kernel & SESSION_KERNEL_BIT == 0 {
                kernels.get(d.kernel).cloned()
            } else {
                session.program_kernel(d.kernel & !SESSION_KERNEL_BIT)
            }?;
            for (index, (arg, param)) in d.args.iter().zip(kernel.params.iter()).enumerate() {
                if let (true, ParamKind::Buffer { access, .. }) = (arg.tag == ArgTag::Buffer as u32, &param.kind) {
                    if access.writes() {
                        written(index, arg.value);
                    }
                }
            }
            Action::Launch {
                kernel,
                id: d.kernel,
                range: [1; 3],
                dims: 1,
                args: [ArgValue::None; MAX_ARGS],
                arg_count: d.args.len().min(MAX_ARGS),
                window: None,
            }
        }
        Op::Memset => {
            written(0, d.buffer_arg(0).ok()?);
            Action::Fill {
                offset: 0,
                len: 0,
                value: 0,
            }
        }
        Op::Copy => {
            written(1, d.buffer_arg(1).ok()?);
            Action::Copy {
                src_offset: 0,
                dst_offset: 0,
                len: 0,
            }
        }
        _ => return None,
    };
    if buffers.iter().all(Option::is_none) {
        return None;
    }
    Some(Ready {
        queue,
        action,
        estimated_ns: 0.0,
        items: 0,
        touched_bytes: 0,
        slots: d.args.len().min(MAX_ARGS),
        buffers,
    })
}

pub(super) fn resolve(session: &Session, kernels: &KernelTable, d: &Decoded<'_>) -> Result<Ready, TaskError> {
    let queue = session
        .queues
        .get(d.queue)
        .ok_or(TaskError::UnknownQueue(d.queue))?
        .clone();
    let mut buffers: [Option<(Arc<BufferRecord>, Access, bool)>; MAX_ARGS] = Default::default();
    let mut touched_bytes = 0u64;
    let (action, estimated_ns) = match d.op {
        Op::Launch => {
            let kernel = if d.kernel & SESSION_KERNEL_BIT == 0 {
                kernels.get(d.kernel).cloned()
            } else {
                session.program_kernel(d.kernel & !SESSION_KERNEL_BIT)
            }
            .ok_or(TaskError::UnknownKernel(d.kernel))?;
            kernel.check_arguments(d.args)?;
            let mut args = [ArgValue::None; MAX_ARGS];
            let mut scalars = [0u64; MAX_ARGS];
            let mut lens = [0u64; MAX_ARGS];
            for (index, (arg, param)) in d.args.iter().zip(kernel.params.iter()).enumerate() {
                if arg.tag == ArgTag::Buffer as u32 {
                    let record = buffer(session, index, arg.value)?;
                    let access = match param.kind {
                        ParamKind::Buffer { access, .. } => access,
                        ParamKind::Scalar(_) => {
                            return Err(crate::internal_error(
                                2,
                                "a buffer passed the signature check for a scalar",
                            ))
                        }
                    };
                    session.shared_memory.check(index, arg.value, access.writes())?;
                    // One buffer twice is fine only when neither use writes it.
                    for (earlier, entry) in buffers.iter().enumerate().take(index) {
                        if let Some((other, other_access, _)) = entry {
                            if Arc::ptr_eq(other, record) && (access.writes() || other_access.writes()) {
                                return Err(TaskError::Aliased {
                                    index: earlier as u16,
                                    other: index as u64,
                                });
                            }
                        }
                    }
                    lens[index] = record.len;
                    buffers[index] = Some((record.clone(), access, false));
                } else {
                    scalars[index] = arg.value;
                    args[index] = ArgValue::Scalar(arg.value);
                }
            }
            let needed: [std::cell::Cell<u64>; MAX_ARGS] = Default::default();
            let overwritten: [std::cell::Cell<bool>; MAX_ARGS] = Default::default();
            let shape = LaunchShape {
                range: d.range,
                scalars: &scalars[..d.args.len()],
                buffer_lens: &lens[..d.args.len()],
                needed: &needed,
                overwritten: &overwritten,
            };
            kernel.check_shape(&shape)?;
            // A read-write argument this launch writes without reading is write-only here.
            for (entry, overwritten) in buffers.iter_mut().zip(&overwritten) {
                if let Some((_, access, _)) = entry {
                    if overwritten.get() && *access == Access::ReadWrite {
                        *access = Access::Write;
                    }
                }
            }
            if let Some((first, end)) = d.window {
                if !kernel.chunkable {
                    return Err(TaskError::BadWindow {
                        reason: agora_protocol::completion::WINDOW_NOT_CHUNKABLE,
                        first,
                        end,
                    });
                }
            }
            // A write-only argument whose checked range is the whole buffer is overwritten
            // entirely: its old contents need not reach the device. Not by a row window, which
            // writes only its rows: the others keep what earlier windows wrote.
            for (index, entry) in buffers.iter_mut().enumerate() {
                if let Some((record, access, overwrites)) = entry {
                    *overwrites = d.window.is_none() && *access == Access::Write && needed[index].get() >= record.len;
                    // What the size rule says the launch uses (all of it when the rule is silent).
                    touched_bytes += match needed[index].get() {
                        0 => record.len,
                        n => n.min(record.len),
                    };
                }
            }
            let mut range = [1u64; 3];
            range[..d.range.len()].copy_from_slice(d.range);
            let items = match d.window {
                Some((first, end)) => shape.items() / range[0].max(1) * (end - first),
                None => shape.items(),
            };
            let estimated = kernel.estimated_ns(items);
            (
                Action::Launch {
                    kernel,
                    id: d.kernel,
                    range,
                    dims: d.range.len(),
                    args,
                    arg_count: d.args.len(),
                    window: d.window,
                },
                estimated,
            )
        }
        Op::SyncTo | Op::SyncFrom => {
            let handle = d.buffer_arg(0)?;
            let record = buffer(session, 0, handle)?;
            // `sync_to` declares the host copy the newest contents: a write.
            session.shared_memory.check(0, handle, d.op == Op::SyncTo)?;
            byte_range(record, 0, d.u64_arg_or(1, 0)?, d.u64_arg_or(2, 0)?)?;
            buffers[0] = Some((record.clone(), Access::Read, false));
            (
                if d.op == Op::SyncTo {
                    Action::SyncTo
                } else {
                    Action::SyncFrom
                },
                0.0,
            )
        }
        Op::Memset => {
            let handle = d.buffer_arg(0)?;
            let record = buffer(session, 0, handle)?;
            session.shared_memory.check(0, handle, true)?;
            let value = d.u64_arg_or(1, 0)?;
            if value > 255 {
                return Err(TaskError::InvalidScalar {
                    index: 1,
                    value: value as i64,
                });
            }
            let (offset, len) = byte_range(record, 0, d.u64_arg_or(2, 0)?, d.u64_arg_or(3, 0)?)?;
            buffers[0] = Some((record.clone(), Access::Write, false));
            (
                Action::Fill {
                    offset,
                    len,
                    value: value as u8,
                },
                len as f64 * 0.05,
            )
        }
        Op::Copy => {
            let src = buffer(session, 0, d.buffer_arg(0)?)?;
            let dst = buffer(session, 1, d.buffer_arg(1)?)?;
            session.shared_memory.check(0, d.buffer_arg(0)?, false)?;
            session.shared_memory.check(1, d.buffer_arg(1)?, true)?;
            let (src_offset, len) = byte_range(src, 0, d.u64_arg_or(2, 0)?, d.u64_arg_or(4, 0)?)?;
            let dst_offset = d.u64_arg_or(3, 0)?;
            byte_range(dst, 1, dst_offset, len)?;
            buffers[0] = Some((src.clone(), Access::Read, false));
            buffers[1] = Some((dst.clone(), Access::Write, false));
            (
                Action::Copy {
                    src_offset,
                    dst_offset,
                    len,
                },
                len as f64 * 0.1,
            )
        }
        Op::Checkpoint => {
            let checkpoint = d.u64_arg_or(0, 0)?;
            let level = d.u64_arg_or(1, 1)?;
            let snapshot = d.u64_arg_or(2, 0)? != 0;
            // Ids start at 1: 0 is what status reports for "no checkpoint" (the clients refuse
            // it before issuing; a descriptor is untrusted input all the same).
            if checkpoint == 0 {
                return Err(TaskError::CheckpointRefused {
                    reason: agora_protocol::completion::CHECKPOINT_ID_ZERO,
                    level: level.min(255) as u8,
                    checkpoint,
                    detail: 0,
                });
            }
            if session.protected.is_empty() {
                return Err(TaskError::CheckpointRefused {
                    reason: agora_protocol::completion::CHECKPOINT_NOTHING_PROTECTED,
                    level: level.min(255) as u8,
                    checkpoint,
                    detail: 0,
                });
            }
            let mut ids = [0u32; MAX_ARGS];
            for (slot, (id, handle)) in session.protected.iter().enumerate().take(MAX_ARGS) {
                let record = buffer(session, slot, *handle)?;
                session.shared_memory.check(slot, *handle, false)?;
                buffers[slot] = Some((record.clone(), Access::Read, false));
                ids[slot] = *id;
            }
            let bytes: u64 = buffers.iter().flatten().map(|(r, _, _)| r.len).sum();
            (
                Action::Checkpoint {
                    checkpoint,
                    level: level.min(u64::from(u32::MAX)) as u32,
                    snapshot,
                    ids,
                },
                bytes as f64 * 0.1,
            )
        }
        Op::ReleaseBuffer | Op::ReleaseQueue | Op::ReleaseProgram => unreachable!("handled by admit"),
    };
    let items = match &action {
        Action::Launch {
            range,
            dims,
            window: Some((first, end)),
            ..
        } => range[1..*dims].iter().product::<u64>() * (end - first),
        Action::Launch { range, dims, .. } => range[..*dims].iter().product(),
        _ => 0,
    };
    let slots = match d.op {
        Op::Launch => d.args.len(),
        Op::Copy => 2,
        Op::Checkpoint => session.protected.len().min(MAX_ARGS),
        _ => 1,
    };
    Ok(Ready {
        queue,
        action,
        estimated_ns,
        items,
        touched_bytes,
        slots,
        buffers,
    })
}
