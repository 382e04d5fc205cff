//! Device memory of one buffer on a CUDA device, and the host memory a device has registered.
//!
//! A buffer is a sub-range of its tenant's partition (see `partition`), or one `cuMemAlloc`
//! allocation on a GPU without partitions, zeroed before the allocation returns (so no tenant
//! reads what another left there). It must not be freed from a stream callback (the driver forbids
//! CUDA calls there): a buffer dropped on such a thread is queued and freed by the device's next
//! allocation or lane job.

use std::any::Any;
use std::sync::atomic::Ordering;
use std::sync::Arc;

use agora_protocol::TaskError;
use cudarc::driver::sys::CUdeviceptr;

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
