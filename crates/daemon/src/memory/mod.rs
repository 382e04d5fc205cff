//! Memory: where each buffer's valid copies are.
//!
//! Every buffer has a host copy in its session's heap (the segment) and, lazily, one allocation
//! on each device with memory of its own that a task has needed it on. [`Placement`] records
//! which of these copies hold the current contents. Planning a task on a device
//! ([`Placement::prepare`]) yields the transfers that make the copies the task reads current there
//! (device → host segment → device when the only valid copy is on another device) and applies the
//! one-writer rule for the copies it writes: after a write only the writer's copy is valid.
//! Transfers become steps of the task's job, so they run in order on the task's lane.
//!
//! Placement is updated when a task is planned (in issue order), not when it runs: within a queue
//! that is exact; across queues that use one buffer at the same time without waiting for each
//! other, the contents are unspecified (as with CUDA streams) but every access stays inside the
//! buffer's memory.
//!
//! Not yet: eviction under device-memory pressure (an allocation that does not fit fails the task
//! with `DeviceOutOfMemory`) and per-session device quotas.
//!
//! Must not launch kernels or know about queues.

mod heap;

use std::sync::{Arc, Mutex};

use agora_devices::{Device, DeviceBuffer, Transfer};
use agora_protocol::{Access, TaskError};

pub(crate) use heap::Heap;

/// One device's copy of a buffer.
#[derive(Debug)]
struct DeviceCopy {
    device: usize,
    buffer: Arc<dyn DeviceBuffer>,
    valid: bool,
}

/// Where a buffer's current contents are.
#[derive(Debug)]
pub(crate) struct Placement {
    host_valid: bool,
    copies: Vec<DeviceCopy>,
}

/// A live buffer: a range of its session's heap plus its device copies. Jobs hold an `Arc` to it
/// while they run, so a released buffer's memory is reused only after the last task that names
/// it has finished.
#[derive(Debug)]
pub(crate) struct BufferRecord {
    /// Heap-relative offset.
    pub offset: u64,
    /// Length in bytes.
    pub len: u64,
    pub placement: Mutex<Placement>,
}

impl BufferRecord {
    pub(crate) fn new(offset: u64, len: u64) -> Self {
        BufferRecord {
            offset,
            len,
            placement: Mutex::new(Placement {
                host_valid: true,
                copies: Vec::new(),
            }),
        }
    }

    pub(crate) fn placement(&self) -> std::sync::MutexGuard<'_, Placement> {
        self.placement.lock().unwrap_or_else(|e| e.into_inner())
    }
}

impl Placement {
    /// The host copy was rewritten by the client (`sync_to`): it is now the only valid copy.
    pub(crate) fn host_written(&mut self) {
        self.host_valid = true;
        for c in &mut self.copies {
            c.valid = false;
        }
    }

    /// Makes the host copy current, adding the transfer that does it if needed (`sync_from`, and
    /// before host-side work). Returns the device whose copy is read, if any.
    pub(crate) fn fetch_to_host(
        &mut self,
        devices: &[Arc<dyn Device>],
        host: *mut u8,
        len: u64,
        transfers: &mut Vec<Transfer>,
    ) -> Option<usize> {
        if self.host_valid {
            return None;
        }
        let source = self.copies.iter().find(|c| c.valid)?;
        transfers.push(Transfer::ToHost {
            from: source.buffer.clone(),
            device: devices[source.device].clone(),
            host,
            len: len as usize,
        });
        self.host_valid = true;
        Some(source.device)
    }

    /// The device that holds the only valid copy, when the host copy is stale.
    pub(crate) fn owner(&self) -> Option<usize> {
        if self.host_valid {
            None
        } else {
            self.copies.iter().find(|c| c.valid).map(|c| c.device)
        }
    }

    /// Plans access `access` to this buffer by a task on `device`: appends the transfers the task
    /// needs and returns the device buffer to pass (None on devices that share host memory).
    /// `overwrites`: the task writes every byte, so stale contents need not be copied in.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn prepare(
        &mut self,
        devices: &[Arc<dyn Device>],
        device: usize,
        access: Access,
        overwrites: bool,
        host: *mut u8,
        len: u64,
        transfers: &mut Vec<Transfer>,
    ) -> Result<Option<Arc<dyn DeviceBuffer>>, TaskError> {
        if devices[device].info().shares_host_memory {
            if !overwrites {
                self.fetch_to_host(devices, host, len, transfers);
            }
            if access.writes() {
                self.host_written();
            }
            return Ok(None);
        }
        let position = match self.copies.iter().position(|c| c.device == device) {
            Some(p) => p,
            None => {
                let buffer = devices[device].alloc(len).ok_or(TaskError::KernelFault)??;
                self.copies.push(DeviceCopy {
                    device,
                    buffer,
                    valid: false,
                });
                self.copies.len() - 1
            }
        };
        if !self.copies[position].valid && !overwrites {
            // Partial writes need the old contents too, so only a full overwrite skips this.
            self.fetch_to_host(devices, host, len, transfers);
            transfers.push(Transfer::ToDevice {
                host,
                len: len as usize,
                to: self.copies[position].buffer.clone(),
            });
            self.copies[position].valid = true;
        }
        if access.writes() {
            self.host_valid = false;
            for (i, c) in self.copies.iter_mut().enumerate() {
                c.valid = i == position;
            }
        }
        Ok(Some(self.copies[position].buffer.clone()))
    }
}
