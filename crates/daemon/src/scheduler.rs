//! The scheduler: turns descriptors from session rings into device jobs.
//!
//! For each descriptor, in ring order: copy it out (done by the ring), decode it, resolve its
//! handles against the session's own tables, check it against the kernel's signature and size
//! check, then either
//!
//! * run it **inline** on this thread, when its queue has nothing in flight, the device computes
//!   on host memory and the kernel's estimated time is under `inline_max_ns` (a `noop`, a sync
//!   on a host-memory device, a small kernel) — this skips a thread hand-off that would cost more
//!   than the task; or
//! * hand it to a **lane**: the lane its queue is bound to while the queue has work in flight
//!   (so issue order holds), else the lane the [`Policy`] picks (late binding).
//!
//! A descriptor that fails any check completes with a [`TaskError`] naming the problem; nothing
//! a client writes can stop the loop. Inline completions are batched and flushed before anything
//! is handed to a lane, so a queue's completions reach its ring in issue order.
//!
//! Must not contain vendor code: devices are reached only through the `Device` trait.

use std::sync::atomic::Ordering;
use std::sync::Arc;

use agora_devices::{Device, Job, Work};
use agora_kernels::{ArgValue, KernelDef, LaunchShape};
use agora_protocol::descriptor::Decoded;
use agora_protocol::ring::RingError;
use agora_protocol::{ArgTag, Completion, Op, ParamKind, TaskError, MAX_ARGS};

use crate::memory::BufferRecord;
use crate::policy::{Candidate, Policy};
use crate::session::{QueueState, Session, SessionShared};

/// Most descriptors taken from one session before the scheduler looks at the next session.
const BATCH: u32 = 256;

/// Scheduler state owned by the dispatcher thread.
pub(crate) struct Scheduler {
    pub devices: Vec<Arc<dyn Device>>,
    policy: Box<dyn Policy>,
    inline_max_ns: f64,
    inline_done: Vec<Completion>,
    candidates: Vec<Candidate>,
}

/// A task ready to run.
struct Ready {
    queue: Arc<QueueState>,
    work: Work,
    estimated_ns: f64,
    kernel: Option<&'static KernelDef>,
    buffers: [Option<Arc<BufferRecord>>; MAX_ARGS],
}

impl Scheduler {
    pub(crate) fn new(devices: Vec<Arc<dyn Device>>, policy: Box<dyn Policy>, inline_max_ns: u64) -> Self {
        Scheduler {
            devices,
            policy,
            inline_max_ns: inline_max_ns as f64,
            inline_done: Vec::new(),
            candidates: Vec::new(),
        }
    }

    pub(crate) fn policy_name(&self) -> &'static str {
        self.policy.name()
    }

    /// Takes what the session's ring holds (up to admission control and one batch).
    /// Returns how many descriptors were taken, or the ring's corruption.
    pub(crate) fn ingest(&mut self, session: &mut Session) -> Result<u32, RingError> {
        let available = session.submissions.available()?;
        let n = available.min(session.admission_room()).min(BATCH);
        for _ in 0..n {
            let descriptor = session.submissions.take();
            session.ingested = session.ingested.wrapping_add(1);
            session.submitted += 1;
            let task_id = descriptor.task_id;
            let outcome = descriptor.decode().and_then(|d| self.admit(session, &d));
            if let Err(error) = outcome {
                self.inline_done.push(Completion::failed(task_id, error));
            }
        }
        if n > 0 {
            session.submissions.release();
            self.flush(&session.shared);
        }
        Ok(n)
    }

    fn flush(&mut self, shared: &SessionShared) {
        shared.post(&self.inline_done);
        self.inline_done.clear();
    }

    /// Resolves and dispatches one decoded descriptor; `Err` completes it with that error.
    fn admit(&mut self, session: &mut Session, d: &Decoded<'_>) -> Result<(), TaskError> {
        match d.op {
            Op::ReleaseBuffer => {
                let handle = d.buffer_arg(0)?;
                if !session.release_buffer(handle) {
                    return Err(TaskError::InvalidHandle { index: 0, handle });
                }
                self.inline_done.push(Completion::ok(d.task_id));
                Ok(())
            }
            Op::ReleaseQueue => {
                session.queues.remove(d.queue).ok_or(TaskError::UnknownQueue(d.queue))?;
                self.inline_done.push(Completion::ok(d.task_id));
                Ok(())
            }
            _ => {
                let ready = resolve(session, d)?;
                self.dispatch(session, d.task_id, ready);
                Ok(())
            }
        }
    }

    fn dispatch(&mut self, session: &Session, task_id: u64, ready: Ready) {
        let queue = &ready.queue;
        let idle = queue.in_flight.load(Ordering::Acquire) == 0;
        let (device_index, lane) = if idle {
            self.candidates.clear();
            for (index, device) in self.devices.iter().enumerate() {
                if ready.kernel.is_some_and(|k| !device.implements(k)) {
                    continue;
                }
                for lane in 0..device.info().lanes {
                    self.candidates.push(Candidate {
                        device: index,
                        lane,
                        load: device.lane_load(lane),
                    });
                }
            }
            if self.candidates.is_empty() {
                let id = ready
                    .kernel
                    .map(|k| agora_kernels::find(k.name).map_or(0, |(i, _)| i))
                    .unwrap_or(0);
                self.inline_done
                    .push(Completion::failed(task_id, TaskError::NoDevice(id)));
                return;
            }
            let name = ready.kernel.map_or("transfer", |k| k.name);
            let c = self.policy.choose(name, &self.candidates);
            // A tiny task on an idle queue runs here and now, on a device that computes on host
            // memory: handing it to a lane would cost more than running it.
            let device = &self.devices[c.device];
            if self.inline_max_ns > 0.0 && device.info().shares_host_memory && ready.estimated_ns <= self.inline_max_ns
            {
                let result = device.run_inline(&ready.work);
                self.inline_done.push(match result {
                    Ok(()) => Completion::ok(task_id),
                    Err(e) => Completion::failed(task_id, e),
                });
                return;
            }
            queue
                .binding
                .store(((c.device as u32) << 16) | c.lane as u32, Ordering::Relaxed);
            (c.device, c.lane)
        } else {
            let binding = queue.binding.load(Ordering::Relaxed);
            ((binding >> 16) as usize, (binding & 0xffff) as usize)
        };
        // Completions of earlier inline tasks must reach the ring before this job's.
        self.flush(&session.shared);
        queue.in_flight.fetch_add(1, Ordering::AcqRel);
        session.shared.in_flight.fetch_add(1, Ordering::Relaxed);
        let shared = session.shared.clone();
        let queue = ready.queue.clone();
        let buffers = ready.buffers;
        let job = Job {
            work: ready.work,
            keepalive: None,
            cancelled: Some(session.shared.cancelled.clone()),
            done: Box::new(move |result| {
                let completion = match result {
                    Ok(()) => Completion::ok(task_id),
                    Err(e) => Completion::failed(task_id, e),
                };
                shared.post(&[completion]);
                // Post first, then unbind: the dispatcher may run this queue's next task inline
                // as soon as it sees zero, and that completion must come after ours.
                queue.in_flight.fetch_sub(1, Ordering::AcqRel);
                shared.in_flight.fetch_sub(1, Ordering::Relaxed);
                drop(buffers);
                drop(shared);
            }),
        };
        self.devices[device_index].submit(lane, job);
    }
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

fn heap_ptr(session: &Session, record: &BufferRecord, offset: u64, len: u64) -> Result<*mut u8, TaskError> {
    // The heap allocator only hands out in-heap ranges, so this cannot fail unless the daemon
    // is wrong; report it as a fault of this task rather than trusting it.
    session
        .shared
        .segment
        .view()
        .heap_range(record.offset + offset, len)
        .ok_or(TaskError::KernelFault)
}

fn resolve(session: &Session, d: &Decoded<'_>) -> Result<Ready, TaskError> {
    let queue = session
        .queues
        .get(d.queue)
        .ok_or(TaskError::UnknownQueue(d.queue))?
        .clone();
    let mut buffers: [Option<Arc<BufferRecord>>; MAX_ARGS] = Default::default();
    let (work, estimated_ns, kernel) = match d.op {
        Op::Launch => {
            let kernel = agora_kernels::library()
                .get(d.kernel as usize)
                .ok_or(TaskError::UnknownKernel(d.kernel))?;
            kernel.check_arguments(d.args)?;
            let mut args = [ArgValue::None; MAX_ARGS];
            let mut scalars = [0u64; MAX_ARGS];
            let mut lens = [0u64; MAX_ARGS];
            for (index, (arg, param)) in d.args.iter().zip(kernel.params).enumerate() {
                if arg.tag == ArgTag::Buffer as u32 {
                    let record = buffer(session, index, arg.value)?;
                    // One buffer twice is fine only when neither use writes it.
                    for earlier in 0..index {
                        if d.args[earlier].tag == ArgTag::Buffer as u32 && d.args[earlier].value == arg.value {
                            let writes = |p: &agora_kernels::Param| matches!(p.kind, ParamKind::Buffer { access, .. } if access.writes());
                            if writes(param) || writes(&kernel.params[earlier]) {
                                return Err(TaskError::Aliased {
                                    index: earlier as u16,
                                    other: index as u64,
                                });
                            }
                        }
                    }
                    lens[index] = record.len;
                    args[index] = ArgValue::Buffer {
                        ptr: heap_ptr(session, record, 0, record.len)?,
                        len: record.len,
                    };
                    buffers[index] = Some(record.clone());
                } else {
                    scalars[index] = arg.value;
                    args[index] = ArgValue::Scalar(arg.value);
                }
            }
            let shape = LaunchShape {
                range: d.range,
                scalars: &scalars[..d.args.len()],
                buffer_lens: &lens[..d.args.len()],
            };
            (kernel.check)(&shape)?;
            let mut range = [1u64; 3];
            range[..d.range.len()].copy_from_slice(d.range);
            let estimated = kernel.estimated_ns(shape.items());
            (
                Work::Launch {
                    kernel,
                    range,
                    dims: d.range.len(),
                    args,
                    arg_count: d.args.len(),
                },
                estimated,
                Some(kernel),
            )
        }
        Op::SyncTo | Op::SyncFrom => {
            let handle = d.buffer_arg(0)?;
            let record = buffer(session, 0, handle)?;
            byte_range(record, 0, d.u64_arg_or(1, 0)?, d.u64_arg_or(2, 0)?)?;
            buffers[0] = Some(record.clone());
            // Every device today computes on the host copy: a transfer is an ordering point.
            (Work::Nothing, 0.0, None)
        }
        Op::Memset => {
            let handle = d.buffer_arg(0)?;
            let record = buffer(session, 0, handle)?;
            let value = d.u64_arg_or(1, 0)?;
            if value > 255 {
                return Err(TaskError::InvalidScalar {
                    index: 1,
                    value: value as i64,
                });
            }
            let (offset, len) = byte_range(record, 0, d.u64_arg_or(2, 0)?, d.u64_arg_or(3, 0)?)?;
            let ptr = heap_ptr(session, record, offset, len)?;
            buffers[0] = Some(record.clone());
            (
                Work::Fill {
                    ptr,
                    len: len as usize,
                    value: value as u8,
                },
                len as f64 * 0.05,
                None,
            )
        }
        Op::Copy => {
            let src = buffer(session, 0, d.buffer_arg(0)?)?;
            let dst = buffer(session, 1, d.buffer_arg(1)?)?;
            let src_offset = d.u64_arg_or(2, 0)?;
            let dst_offset = d.u64_arg_or(3, 0)?;
            let (src_offset, len) = byte_range(src, 0, src_offset, d.u64_arg_or(4, 0)?)?;
            byte_range(dst, 1, dst_offset, len)?;
            let src_ptr = heap_ptr(session, src, src_offset, len)?;
            let dst_ptr = heap_ptr(session, dst, dst_offset, len)?;
            buffers[0] = Some(src.clone());
            buffers[1] = Some(dst.clone());
            (
                Work::Copy {
                    src: src_ptr,
                    dst: dst_ptr,
                    len: len as usize,
                },
                len as f64 * 0.1,
                None,
            )
        }
        Op::ReleaseBuffer | Op::ReleaseQueue => unreachable!("handled by admit"),
    };
    Ok(Ready {
        queue,
        work,
        estimated_ns,
        kernel,
        buffers,
    })
}
