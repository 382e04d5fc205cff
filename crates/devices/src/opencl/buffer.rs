//! Device memory of one buffer on an OpenCL device, and the device's count of memory in use.
//!
//! Owns the allocation's lifetime and its zeroing: it must not move data (transfers are the
//! executor's, synchronous reads the device's).
//!
//! **Zeroing.** OpenCL does not clear what `clCreateBuffer` returns: a runtime (PoCL's included)
//! hands out memory another tenant's buffer freed, with its bytes. A device copy can be read
//! before anything the tenant issued wrote it all — a write-only launch skips the copy-in, and
//! a kernel that declares whole coverage may write less, or fail, or be cancelled — so every
//! allocation is zeroed before any command can use it. The zeroing is lazy and asynchronous:
//! the first queue to use the buffer (a lane's, for the job that needed the copy, or the reader
//! queue) enqueues a `clEnqueueFillBuffer` of zeros ahead of its own commands, so neither the
//! dispatcher nor the lane's thread waits; a command on another queue that uses the buffer
//! before the fill is known complete waits for its event. Cost: one device-memory write of the
//! allocation's size, once per allocation — a buffer's device copy lives as long as the buffer
//! stays resident, so this is per buffer and device, not per task, and it is no more than the
//! copy-in a task reading the buffer pays anyway. Tracking uninitialised ranges (as wgpu does)
//! would save that write for buffers first filled by a full copy-in, at the price of range
//! bookkeeping on every command; not worth it here.

use std::ffi::c_void;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

use agora_protocol::TaskError;
use opencl3::event::{Event, CL_COMPLETE};
use opencl3::memory::{Buffer, ClMem};
use opencl3::types::{cl_command_queue, cl_event};

use super::cl_error;
use super::device::Shared;
use crate::DeviceBuffer;

/// A buffer in an OpenCL device's memory.
pub(super) struct ClBuffer {
    pub(super) buffer: Buffer<u8>,
    pub(super) len: u64,
    pub(super) shared: Arc<Shared>,
    /// Its zeroing, until it is known complete (see the module documentation).
    zeroing: Mutex<Zeroing>,
    /// Whether the zeroing is known complete: no command needs to wait for it any more.
    zeroed: AtomicBool,
}

/// Where a buffer's zeroing stands.
enum Zeroing {
    /// Not enqueued: no command has used the buffer yet.
    Pending,
    /// Enqueued on the queue whose address is `queue` (only compared), finishing with `event`.
    /// Never replaced (only `zeroed` is set), so the event lives as long as the buffer.
    Enqueued { queue: usize, event: Event },
}

impl ClBuffer {
    /// A new allocation of `len` bytes (`buffer`), not zeroed yet.
    pub(super) fn new(buffer: Buffer<u8>, len: u64, shared: Arc<Shared>) -> Self {
        ClBuffer {
            buffer,
            len,
            shared,
            zeroing: Mutex::new(Zeroing::Pending),
            zeroed: AtomicBool::new(false),
        }
    }

    /// Whether no command has used the buffer yet: its first command makes the runtime allocate
    /// its memory (PoCL does so in the thread that enqueues) and enqueues its zeroing.
    pub(super) fn unused(&self) -> bool {
        !self.zeroed.load(Ordering::Acquire)
            && matches!(
                *self.zeroing.lock().unwrap_or_else(|e| e.into_inner()),
                Zeroing::Pending
            )
    }

    /// Makes commands enqueued on `queue` from now on see this buffer zeroed (or written since):
    /// enqueues its zeroing on `queue` if no queue has yet, else adds the zeroing's event to
    /// `waits` when it ran on another queue and may not be complete (the caller makes its
    /// commands wait for those events).
    pub(super) fn zeroed_before(&self, queue: cl_command_queue, waits: &mut Vec<cl_event>) -> Result<(), TaskError> {
        if self.zeroed.load(Ordering::Acquire) {
            return Ok(());
        }
        let mut zeroing = self.zeroing.lock().unwrap_or_else(|e| e.into_inner());
        match &*zeroing {
            Zeroing::Pending => {
                // The allocation is at least one byte (see `OpenClDevice::alloc`); the largest
                // pattern that divides it lets the runtime write wide words.
                let size = self.len.max(1) as usize;
                let pattern = [0u8; 128];
                let pattern_size = (0..=7)
                    .rev()
                    .map(|p| 1usize << p)
                    .find(|p| size.is_multiple_of(*p))
                    .unwrap_or(1);
                // SAFETY: `pattern` holds `pattern_size` (at most 128) bytes and is read during
                // the call (OpenCL copies it); offset 0 and `size`, a multiple of the pattern
                // size, lie within the allocation; the queue and buffer are live and of one
                // context.
                let event = unsafe {
                    opencl3::command_queue::enqueue_fill_buffer(
                        queue,
                        self.buffer.get(),
                        pattern.as_ptr() as *const c_void,
                        pattern_size,
                        0,
                        size,
                        0,
                        std::ptr::null(),
                    )
                }
                .map_err(cl_error)?;
                *zeroing = Zeroing::Enqueued {
                    queue: queue as usize,
                    event: Event::new(event),
                };
            }
            // The same in-order queue runs it before anything enqueued after it.
            Zeroing::Enqueued { queue: on, .. } if *on == queue as usize => {}
            Zeroing::Enqueued { event, .. } => {
                if event.command_execution_status().is_ok_and(|s| s.0 == CL_COMPLETE) {
                    self.zeroed.store(true, Ordering::Release);
                } else {
                    // Valid while the buffer lives: the event is never replaced.
                    waits.push(event.get());
                }
            }
        }
        Ok(())
    }
}

/// Enqueues on `queue` a barrier that makes its later commands wait for `waits` (zeroings on
/// other queues), when there are any.
pub(super) fn wait_for(queue: cl_command_queue, waits: &[cl_event]) -> Result<(), TaskError> {
    if waits.is_empty() {
        return Ok(());
    }
    // SAFETY: `waits` are live events (held by their buffers, which the caller holds) of this
    // queue's context; the list outlives the call.
    let event =
        unsafe { opencl3::command_queue::enqueue_barrier_with_wait_list(queue, waits.len() as u32, waits.as_ptr()) }
            .map_err(cl_error)?;
    drop(Event::new(event));
    Ok(())
}

impl std::fmt::Debug for ClBuffer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ClBuffer")
            .field("device", &self.shared.name)
            .field("len", &self.len)
            .finish()
    }
}

impl DeviceBuffer for ClBuffer {
    fn len(&self) -> u64 {
        self.len
    }
    fn as_any(&self) -> &dyn std::any::Any {
        self
    }
}

impl Drop for ClBuffer {
    fn drop(&mut self) {
        self.shared.memory_used.fetch_sub(self.len, Ordering::Relaxed);
    }
}

/// `buffer` as this backend's own, or a fault when it belongs to another backend.
pub(super) fn as_cl(buffer: &dyn DeviceBuffer) -> Result<&ClBuffer, TaskError> {
    buffer.as_any().downcast_ref::<ClBuffer>().ok_or(TaskError::KernelFault)
}
