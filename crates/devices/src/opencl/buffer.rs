//! Device memory of one buffer on an OpenCL device, and the device's count of memory in use.
//!
//! Owns the allocation's lifetime only: it must not move data (transfers are the executor's,
//! synchronous reads the device's).

use std::sync::atomic::Ordering;
use std::sync::Arc;

use agora_protocol::TaskError;
use opencl3::memory::Buffer;

use super::device::Shared;
use crate::DeviceBuffer;

/// A buffer in an OpenCL device's memory.
pub(super) struct ClBuffer {
    pub(super) buffer: Buffer<u8>,
    pub(super) len: u64,
    pub(super) shared: Arc<Shared>,
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
