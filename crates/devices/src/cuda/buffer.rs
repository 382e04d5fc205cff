//! Device memory of one buffer on a CUDA device, and the host memory a device has registered.
//!
//! A buffer is a sub-range of its tenant's partition (see `partition`), or one `cuMemAlloc`
//! allocation on a GPU without partitions. A fresh buffer is *unwritten*: no command has written
//! it yet, and the first command that would read it zeroes it first, on its own stream (so no
//! tenant reads what another, or its own earlier buffer, left there). A copy from the host that
//! writes every byte makes the zeroing needless, and that is how most buffers start: zeroing at
//! allocation cost a synchronous memset on the dispatcher thread per buffer. It must not be freed from a stream callback (the driver forbids
//! CUDA calls there): a buffer dropped on such a thread is queued and freed by the device's next
//! allocation or lane job.

use std::any::Any;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use agora_protocol::TaskError;
use cudarc::driver::sys::{self, CUdeviceptr, CUresult, CUstream};

use super::device::{Freed, Shared};
use super::partition::Partition;
use crate::DeviceBuffer;

/// Device memory of one buffer.
pub(super) struct CudaBuffer {
    pub(super) ptr: CUdeviceptr,
    pub(super) len: u64,
    pub(super) shared: Arc<Shared>,
    /// The tenant's partition it lies in (`None`: a plain allocation).
    pub(super) partition: Option<Arc<Partition>>,
    /// No command has written it yet (see the module documentation).
    pub(super) unwritten: AtomicBool,
}

impl CudaBuffer {
    /// Before a command that reads the buffer (or writes only part of it) on `stream`: zeroes it
    /// there first if nothing has written it yet. Two lanes using a fresh buffer at once (a
    /// tenant's own race between its queues) may both zero it; each lane's stream still sees
    /// zeros before its own command.
    pub(super) fn zero_if_unwritten(&self, stream: CUstream) -> CUresult {
        if !self.unwritten.swap(false, Ordering::AcqRel) {
            return CUresult::CUDA_SUCCESS;
        }
        // SAFETY: `len` bytes at `ptr`, this buffer's, on a stream of its device's context.
        let result = unsafe { sys::cuMemsetD8Async(self.ptr, 0, self.len as usize, stream) };
        if result != CUresult::CUDA_SUCCESS {
            self.unwritten.store(true, Ordering::Release);
        }
        result
    }

    /// A command queued on a stream writes every byte (a copy from the host): the buffer needs
    /// no zeroing.
    pub(super) fn written_whole(&self) {
        self.unwritten.store(false, Ordering::Release);
    }
}

impl std::fmt::Debug for CudaBuffer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CudaBuffer")
            .field("device", &self.shared.name)
            .field("len", &self.len)
            .finish()
    }
}

impl DeviceBuffer for CudaBuffer {
    fn len(&self) -> u64 {
        self.len
    }
    fn as_any(&self) -> &dyn Any {
        self
    }
}

impl Drop for CudaBuffer {
    fn drop(&mut self) {
        self.shared.free(match self.partition.take() {
            Some(partition) => Freed::InPartition(partition, self.ptr, self.len),
            None => Freed::Whole(self.ptr, self.len),
        });
    }
}

/// `buffer` as this backend's type (a daemon bug otherwise: the task fails).
pub(super) fn as_cuda(buffer: &dyn DeviceBuffer) -> Result<&CudaBuffer, TaskError> {
    buffer
        .as_any()
        .downcast_ref::<CudaBuffer>()
        .ok_or(TaskError::KernelFault)
}

/// A range of host memory (a session's segment) registered with the driver: copies from and to
/// it are DMA without a staging copy. Unregistered when dropped, before the memory is unmapped
/// (the session holds it in a field dropped before its segment).
pub(super) struct PinnedHost {
    pub(super) base: usize,
    pub(super) len: usize,
    pub(super) shared: Arc<Shared>,
}

impl Drop for PinnedHost {
    fn drop(&mut self) {
        if self.shared.bind().is_ok() {
            // SAFETY: `base` was registered by `Shared::pin` and is still mapped (see above).
            let _ = unsafe { cudarc::driver::sys::cuMemHostUnregister(self.base as *mut std::ffi::c_void) };
        }
        self.shared.pinned_bytes.fetch_sub(self.len as u64, Ordering::Relaxed);
    }
}
