//! How an OpenCL job finishes: the completion callbacks of its commands, and what the job holds
//! until then.
//!
//! A lane's executor enqueues a job's commands and hands the job to OpenCL here; the job then
//! finishes on an OpenCL runtime thread, in the callback of its last command, exactly once. The
//! unsafe hand-over of leaked boxes and `Arc`s to the runtime is all in this module. It must not
//! enqueue commands, and its callbacks must not block or unwind into the runtime.

use std::ffi::c_void;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Instant;

use agora_protocol::TaskError;
use opencl3::event::{Event, CL_COMPLETE};
use opencl3::memory::Buffer;
use opencl3::types::{cl_event, cl_int};

use super::cl_error;
use crate::lane::JobEnd;
use crate::{Transfer, Work};

/// A started job waiting for its last command's completion callback.
pub(super) struct Pending {
    pub(super) end: JobEnd,
    pub(super) event: Event,
    /// Whether the kernel read the job's revocation flag (and so may have stopped early).
    pub(super) polled: bool,
    // Held until completion: the commands read and write the memory these point to.
    pub(super) _flag: Option<Buffer<u8>>,
    pub(super) _transfers: Vec<Transfer>,
    pub(super) _work: Work,
    /// When the lane's previous job finished: this one's kernel could not start before (the
    /// lane's queue is in order), so its time starts no earlier. Timed from when the lane
    /// enqueued it, a pipelined job would count the queue ahead of it as its own.
    pub(super) lane_finished: Arc<Mutex<Option<Instant>>>,
}

impl Pending {
    /// The job's outcome once its last command ended with `status`: `Cancelled` when its kernel
    /// polled a revocation flag that is now set. The flag may have been set after the last
    /// work-group started, so the run may be complete; the daemon then replays it needlessly,
    /// but never keeps a partial result.
    fn outcome(&self, status: cl_int) -> Result<(), TaskError> {
        if status < 0 {
            Err(TaskError::DeviceFailed(i64::from(status)))
        } else if self.polled && self.end.revoke_flag().is_some_and(|f| f.load(Ordering::Acquire)) {
            Err(TaskError::Cancelled)
        } else {
            Ok(())
        }
    }

    /// Finishes the job with `result`, letting go of its device buffers first: the scheduler may
    /// evict and reuse their memory as soon as it sees the task done.
    pub(super) fn finish(self, result: Result<(), TaskError>) {
        let Pending {
            mut end,
            event,
            polled: _,
            _flag,
            _transfers,
            _work,
            lane_finished,
        } = self;
        {
            let mut last = lane_finished.lock().unwrap_or_else(|e| e.into_inner());
            if let Some(previous) = *last {
                end.started_no_earlier_than(previous);
            }
            *last = Some(Instant::now());
        }
        drop(_work);
        drop(_transfers);
        // Before the job's flag (held by `end`) can go: this buffer wraps its memory.
        drop(_flag);
        end.finish(result);
        drop(event);
    }
}

/// OpenCL's completion callback for a job's last command.
extern "C" fn on_complete(_event: cl_event, status: cl_int, user: *mut c_void) {
    // SAFETY: `user` is the `Box<Pending>` that `finish_on_completion` leaked when it registered
    // this callback; OpenCL invokes a registered callback exactly once.
    let pending = unsafe { Box::from_raw(user as *mut Pending) };
    let result = pending.outcome(status);
    // Never unwind into the OpenCL runtime.
    let _ = std::panic::catch_unwind(std::panic::AssertUnwindSafe(move || pending.finish(result)));
}

/// OpenCL's completion callback for a job's last transfer: records when transfers ended.
extern "C" fn on_transfers_done(_event: cl_event, _status: cl_int, user: *mut c_void) {
    // SAFETY: `user` is an `Arc<OnceLock<Instant>>` reference that `mark_when_complete` leaked for
    // this callback, which OpenCL invokes exactly once.
    let marker = unsafe { Arc::from_raw(user as *const OnceLock<Instant>) };
    let _ = marker.set(Instant::now());
}

/// Finishes `pending` when its event completes, from OpenCL's callback. Returns false when the
/// callback could not be registered; the job has then been finished here, after its event.
pub(super) fn finish_on_completion(pending: Pending) -> bool {
    let raw = pending.event.get();
    let pending = Box::into_raw(Box::new(pending));
    match opencl3::event::set_event_callback(raw, CL_COMPLETE, on_complete, pending as *mut c_void) {
        Ok(()) => true,
        Err(e) => {
            // SAFETY: the callback was not registered, so the box is still ours alone.
            let pending = unsafe { Box::from_raw(pending) };
            let _ = pending.event.wait();
            pending.finish(Err(cl_error(e)));
            false
        }
    }
}

/// Sets `marker` to the time `event` (a job's last transfer) completes.
pub(super) fn mark_when_complete(event: &Event, marker: &Arc<OnceLock<Instant>>) {
    let user = Arc::into_raw(marker.clone()) as *mut c_void;
    if opencl3::event::set_event_callback(event.get(), CL_COMPLETE, on_transfers_done, user).is_err() {
        // SAFETY: not registered, so the reference is still ours to release.
        drop(unsafe { Arc::from_raw(user as *const OnceLock<Instant>) });
    }
}
