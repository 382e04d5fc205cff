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
//! Under device-memory pressure ([`Residency::make_room`]) buffers that no planned-but-unfinished
//! task names are evicted from the device, least recently used first: a copy that is the only valid
//! one is first read back into the host segment (synchronously: nothing else uses it), then the
//! device allocation is dropped. On a device in a device host that read is only started
//! ([`WriteBack`]): the dispatcher does not wait for the host; the buffer is marked until the
//! answer, the task that needed the room and any task that names the buffer wait for it, and the
//! dispatcher finishes the eviction when it comes ([`Residency::finish_write_backs`]). A client
//! about to write a host copy over results it never read claims it first
//! ([`BufferRecord::claim_host`]), so no eviction writes those results over its data. So the
//! buffers of all sessions together may exceed a device's memory. The same mechanism enforces
//! per-session device quotas, evicting only that session's buffers. A task whose own buffers do not
//! fit fails with `DeviceOutOfMemory`.
//!
//! When a device fails ([`Residency::forget_device`]) its copies are dropped; a buffer whose only
//! valid copy was there falls back to its (older) host copy and is marked **lost**: the scheduler
//! fails tasks that read it with `DataLost` until it is written whole again (any recorded write
//! clears the mark), unless a replayed task's input was that very host copy.
//!
//! Coherence: a buffer released (or left at its session's end) whose newest contents are on a
//! device, never read back into the host copy, is counted ([`UnreadReleases`]; the session's
//! status and a metric): a device scratch buffer, or results nobody saw (a forgotten
//! `sync_from`). The
//! daemon's strict coherence mode (the CPU computing on private copies, see
//! `agora_devices::cpu::CpuDevice::with_private_copies`) makes that the case wherever a task ran.
//!
//! Must not launch kernels or know about queues.

mod heap;
pub(crate) mod pinned;

use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock, Weak};

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
    /// Whether the residency registry knows this buffer (it has had a device copy).
    registered: bool,
    /// Its only valid copy was on a device that failed: the host copy is older than what the
    /// client last wrote through tasks.
    pub lost: bool,
    /// The task whose output the valid copies claim to hold: the last one planned that writes
    /// the buffer (0: none). Should it not complete, no copy may go on claiming it
    /// ([`Placement::writer_failed`]).
    writer: u64,
}

/// Which of a buffer's copies were valid at some moment ([`Placement::validity`]).
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct Validity {
    host: bool,
    lost: bool,
    /// Bit `i`: the `i`th device copy (at most [`MAX_DEVICES`] of them).
    copies: u64,
}

/// Most devices a daemon drives (per-session device usage is a fixed array).
pub(crate) const MAX_DEVICES: usize = 64;

/// Bytes of device memory one session's buffers hold, per device, and whose they are.
#[derive(Debug)]
pub(crate) struct DeviceUsage {
    pub bytes: [AtomicU64; MAX_DEVICES],
    /// The session, as devices know their tenants (a GPU keeps each tenant's memory in a
    /// partition of its own, which its fenced kernels cannot leave).
    pub tenant: u64,
    /// Whose fair share of device memory the session's is part of: its user's, or its Slurm
    /// job's (the same groups as the lanes', [`agora_devices::Share`]).
    pub group: AtomicU64,
}

impl DeviceUsage {
    /// A tenant in a group of its own.
    pub(crate) fn new(tenant: u64) -> Self {
        DeviceUsage::in_group(tenant, tenant)
    }

    /// A tenant of `group`.
    pub(crate) fn in_group(tenant: u64, group: u64) -> Self {
        DeviceUsage {
            bytes: std::array::from_fn(|_| AtomicU64::new(0)),
            tenant,
            group: AtomicU64::new(group),
        }
    }
}

impl Default for DeviceUsage {
    fn default() -> Self {
        DeviceUsage::new(0)
    }
}

/// One session's count of buffers released with their newest contents on a device, never read
/// back to the host copy (see the module doc), and the daemon's counter of them.
#[derive(Debug, Default)]
pub(crate) struct UnreadReleases {
    /// The session, for the log line.
    pub session: u64,
    /// This session's count.
    pub count: AtomicU64,
    /// The daemon's counter (metrics), installed when the scheduler first takes a descriptor of
    /// the session (no buffer can hold device-only contents before that).
    pub daemon: OnceLock<prometheus_client::metrics::counter::Counter>,
}

impl UnreadReleases {
    /// A buffer of `len` bytes whose only current copy was on `device` was released.
    fn note(&self, len: u64, device: usize) {
        let before = self.count.fetch_add(1, Ordering::Relaxed);
        if let Some(counter) = self.daemon.get() {
            counter.inc();
        }
        // At debug level only: device scratch buffers are released this way on purpose (five of
        // the eight bundled Rodinia workloads do, e.g. gaussian's multipliers and hotspot's
        // second grid), so a warning put a false alarm in the operator's log for most programs,
        // and in `agora demo`'s output. The tenant sees the count (`unread_releases` in its
        // session's status, the metric) and Python's `ResourceWarning` at the release.
        tracing::debug!(
            session = self.session,
            bytes = len,
            device,
            first = before == 0,
            "a buffer was released with its newest contents on a device, never read back to the host copy"
        );
    }
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
    /// Tasks planned and not yet finished that name this buffer: while non-zero it is never
    /// evicted.
    pub in_use: AtomicU32,
    /// Its only valid copy is being written home by an eviction that did not wait
    /// ([`WriteBack`]): tasks that name it wait until that is done.
    pub writing_back: AtomicBool,
    /// When a task last named it (the residency clock), for least-recently-used eviction.
    pub last_used: AtomicU64,
    /// The owning session's device-memory usage.
    pub usage: Arc<DeviceUsage>,
    /// The owning session's host memory, to read an evicted copy back into.
    owner: Weak<dyn HostMemory>,
    /// Whether its contents are valid: a failed writer poisons them (see `outcome`).
    pub provenance: crate::outcome::Provenance,
    /// Where its release is counted when its newest contents were never read back.
    unread: Arc<UnreadReleases>,
    /// The devices that map `region` by its descriptor (devices in device hosts), by device
    /// index, each with what keeps it mapped there ([`BufferRecord::map_region_for`]): copies
    /// between such a device and the region then need no staging copy. Declared before
    /// `region`, so dropped (unmapped there) before the region is.
    region_maps: Mutex<Vec<(usize, Option<RegionMap>)>>,
    /// An exportable buffer's host copy: a region of its own instead of a range of the owner's
    /// heap (`offset` is then 0). Held here, so it stays mapped while any session or job holds
    /// the record, whichever session allocated it.
    pub region: Option<Arc<agora_transport::shm::Region>>,
}

/// What keeps an exportable buffer's region mapped by a device ([`agora_devices::Device::register_host_memory`]).
type RegionMap = Box<dyn std::any::Any + Send + Sync>;

/// What keeps a buffer's host copy mapped while a copy into it is in flight.
#[derive(Debug)]
enum HostHold {
    Owner(#[allow(dead_code)] Arc<dyn HostMemory>),
    Region(#[allow(dead_code)] Arc<agora_transport::shm::Region>),
}

/// An eviction from a device whose reads another process answers (a device in a device host):
/// the buffer's only valid copy is being copied home without the dispatcher waiting. The
/// dispatcher finishes it ([`Residency::finish_write_backs`]) once the answer came: the host copy
/// becomes the valid one and the device copy is dropped. Meanwhile the buffer is marked
/// (`writing_back`), never chosen again, and tasks that name it wait.
#[derive(Debug)]
struct WriteBack {
    record: Arc<BufferRecord>,
    device: usize,
    /// The task whose output the copy held when the write-back started.
    writer: u64,
    /// Keeps the host copy mapped until the answer.
    _host: HostHold,
    answer: Mutex<Option<Result<(), TaskError>>>,
}

/// Wakes the dispatcher (when a write-back is answered).
#[derive(Clone)]
pub(crate) struct Waker(pub Arc<dyn Fn() + Send + Sync>);

impl std::fmt::Debug for Waker {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Waker")
    }
}

/// Host memory that buffers live in (a session's heap in its segment).
pub(crate) trait HostMemory: Send + Sync + std::fmt::Debug {
    /// The address of `[offset, offset+len)` of the heap, if it lies inside it.
    fn host_range(&self, offset: u64, len: u64) -> Option<*mut u8>;
}

impl BufferRecord {
    pub(crate) fn new(
        offset: u64,
        len: u64,
        usage: Arc<DeviceUsage>,
        owner: Weak<dyn HostMemory>,
        unread: Arc<UnreadReleases>,
    ) -> Self {
        BufferRecord {
            offset,
            len,
            placement: Mutex::new(Placement {
                host_valid: true,
                copies: Vec::new(),
                registered: false,
                lost: false,
                writer: 0,
            }),
            in_use: AtomicU32::new(0),
            writing_back: AtomicBool::new(false),
            last_used: AtomicU64::new(0),
            usage,
            owner,
            provenance: Default::default(),
            unread,
            region_maps: Mutex::new(Vec::new()),
            region: None,
        }
    }

    /// Lets `device` (index `index`) map this buffer's region by its descriptor, once, so that
    /// its copies go straight between the device's host process and the region (a device in a
    /// device host otherwise stages them through a segment of their own: 64 MiB took 5× as long,
    /// docs/PERFORMANCE.md). Nothing to do for a heap buffer (its session's segment is mapped
    /// already, `SessionShared::pin_for`) or a device that computes on memory it was not given.
    /// A region sealed against writers (a read-only export) is mapped read-only there: copies
    /// into it are still staged. Called on the dispatcher when a task is planned on `device`.
    pub(crate) fn map_region_for(&self, index: usize, device: &dyn agora_devices::Device) {
        let Some(region) = &self.region else {
            return;
        };
        if !device.maps_host_memory() {
            return;
        }
        let mut maps = self.region_maps.lock().unwrap_or_else(|e| e.into_inner());
        if maps.iter().any(|(mapped, _)| *mapped == index) {
            return;
        }
        let Some(base) = region.range(0, region.len()) else {
            return;
        };
        // Never page-locked: the user's page-locked memory limit counts session segments only.
        let map = match device.register_host_memory(base, region.len() as usize, region.fd(), false) {
            Some(Ok(map)) => Some(map),
            Some(Err(why)) => {
                tracing::debug!(device = %device.info().name, %why, "an exportable buffer's region is not mapped there; its copies are staged");
                None
            }
            None => None,
        };
        maps.push((index, map));
    }

    /// A record whose host copy is `region` (an exportable buffer), owned for device-memory
    /// accounting by the session whose `usage` and `unread` these are.
    pub(crate) fn in_region(
        region: Arc<agora_transport::shm::Region>,
        usage: Arc<DeviceUsage>,
        owner: Weak<dyn HostMemory>,
        unread: Arc<UnreadReleases>,
    ) -> Self {
        let mut record = BufferRecord::new(0, region.len(), usage, owner, unread);
        record.region = Some(region);
        record
    }

    /// The client is about to write the host copy (`Request::ClaimHost`). Granted at once, with
    /// nothing changed, when the host copy is already current: no device holds newer results,
    /// so no eviction has anything to write over it (a shared buffer's writers ask on every
    /// write, beside readers whose tasks may use it all the time). Otherwise, unless a task
    /// planned and unfinished names the buffer, or an eviction is writing a device's copy into
    /// the host copy (`false`: the client asks again), the host copy becomes the current
    /// contents ([`Placement::host_claimed`]), so no eviction writes older results over the
    /// client's. Called on the dispatcher, which alone starts evictions and plans tasks.
    pub(crate) fn claim_host(&self) -> bool {
        if self.writing_back.load(Ordering::Acquire) {
            return false;
        }
        let mut placement = self.placement();
        if placement.host_valid {
            return true;
        }
        if self.in_use.load(Ordering::Acquire) != 0 {
            return false;
        }
        placement.host_claimed();
        true
    }

    /// Runs `f` with the address of `[offset, offset+len)` of the host copy, the memory kept
    /// mapped meanwhile; `None` when the owner's memory is gone or the range lies outside it.
    pub(crate) fn with_host<R>(&self, offset: u64, len: u64, f: impl FnOnce(*mut u8) -> R) -> Option<R> {
        if offset.checked_add(len)? > self.len {
            return None;
        }
        if let Some(region) = &self.region {
            // The record holds the region, so it stays mapped while `f` runs.
            return region.range(offset, len).map(f);
        }
        // Holding the owner keeps its segment mapped while `f` runs.
        let owner = self.owner.upgrade()?;
        let ptr = owner.host_range(self.offset + offset, len)?;
        Some(f(ptr))
    }

    /// The address of the whole host copy, with what keeps it mapped for as long as the hold
    /// lives (for a copy into it that outlives this call); `None` when the memory is gone.
    fn hold_host(&self) -> Option<(HostHold, *mut u8)> {
        if let Some(region) = &self.region {
            let ptr = region.range(0, self.len)?;
            return Some((HostHold::Region(region.clone()), ptr));
        }
        let owner = self.owner.upgrade()?;
        let ptr = owner.host_range(self.offset, self.len)?;
        Some((HostHold::Owner(owner), ptr))
    }

    pub(crate) fn placement(&self) -> std::sync::MutexGuard<'_, Placement> {
        self.placement.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// A copy of the host copy's bytes (`None` when the owning session's memory is gone).
    /// The caller makes sure the host copy is the current one.
    pub(crate) fn read_host(&self) -> Option<Vec<u8>> {
        let mut bytes = vec![0u8; self.len as usize];
        self.with_host(0, self.len, |ptr| {
            // SAFETY: `with_host` checked that `len` bytes at `ptr` lie in the mapped host copy and
            // keeps it mapped until the copy is done. The client may write them meanwhile (its
            // own race): bytes are copied, never interpreted.
            unsafe { std::ptr::copy_nonoverlapping(ptr, bytes.as_mut_ptr(), bytes.len()) };
        })?;
        Some(bytes)
    }

    /// Writes `bytes` (exactly the buffer's length) into the host copy and makes it the only
    /// valid one (device copies are stale now). `false` when the session's memory is gone or the
    /// length differs.
    pub(crate) fn write_host(&self, bytes: &[u8]) -> bool {
        if bytes.len() as u64 != self.len {
            return false;
        }
        let written = self.with_host(0, self.len, |ptr| {
            // SAFETY: as in `read_host`, the other way.
            unsafe { std::ptr::copy_nonoverlapping(bytes.as_ptr(), ptr, bytes.len()) };
        });
        if written.is_none() {
            return false;
        }
        self.placement().host_written();
        true
    }
}

impl Placement {
    /// The host copy was rewritten by the client (`sync_to`): it is now the only valid copy.
    pub(crate) fn host_written(&mut self) {
        self.host_valid = true;
        self.lost = false;
        for c in &mut self.copies {
            c.valid = false;
        }
    }

    /// The client claimed the host copy to write it (`Request::ClaimHost`): it is the current
    /// copy from now on and the device copies are stale, so an eviction drops them without
    /// writing them home. Unlike [`Placement::host_written`] (a `sync_to`, whose data the client
    /// wrote whole) a loss stays marked: the claim says nothing about what the client writes.
    pub(crate) fn host_claimed(&mut self) {
        self.host_valid = true;
        for c in &mut self.copies {
            c.valid = false;
        }
    }

    /// The buffer's newest contents are gone (a resumed session's buffer whose last write ran
    /// under a daemon that died): tasks that read it fail with `DataLost` until it is written
    /// whole again. Its host copy is all there is.
    pub(crate) fn mark_lost(&mut self) {
        self.lost = true;
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
        usage: &DeviceUsage,
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
                let buffer = devices[device]
                    .alloc(usage.tenant, len)
                    .ok_or_else(|| crate::internal_error(4, "a device without memory of its own asked for a copy"))??;
                usage.bytes[device].fetch_add(len, Ordering::Relaxed);
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
            self.lost = false;
            for (i, c) in self.copies.iter_mut().enumerate() {
                c.valid = i == position;
            }
        }
        Ok(Some(self.copies[position].buffer.clone()))
    }

    /// Which copies are valid now, to [`restore`](Placement::restore) if what is planned next
    /// is abandoned.
    pub(crate) fn validity(&self) -> Validity {
        let copies = self
            .copies
            .iter()
            .enumerate()
            .fold(0u64, |bits, (i, c)| bits | (u64::from(c.valid) << i.min(63)));
        Validity {
            host: self.host_valid,
            lost: self.lost,
            copies,
        }
    }

    /// Undoes what planning claimed since `before` was taken (a task abandoned before any of its
    /// transfers ran): the same copies are valid as then. Copies allocated since stay, invalid.
    pub(crate) fn restore(&mut self, before: Validity) {
        self.host_valid = before.host;
        self.lost = before.lost;
        for (i, c) in self.copies.iter_mut().enumerate() {
            c.valid = i < 64 && before.copies & (1 << i) != 0;
        }
    }

    /// Task `task` was planned writing this buffer: the valid copies claim its output from now.
    pub(crate) fn written_by(&mut self, task: u64) {
        self.writer = task;
    }

    /// Task `task`, which wrote this buffer, did not complete (failed, cancelled, or fed by a
    /// failed task; its outcome poisons the buffer). When the device copy its planning made the
    /// only valid one still claims its output (no later task was planned writing the buffer),
    /// that copy holds no one's complete result — for a write-only launch, only what the
    /// allocation held before — so it stops claiming it: the buffer falls back to its host copy,
    /// the tenant's own older contents, and nothing (a `sync_from`, an eviction, host work that
    /// brings the buffer home) copies the device's bytes out.
    pub(crate) fn writer_failed(&mut self, task: u64) {
        if self.writer != task || self.host_valid {
            return;
        }
        for c in &mut self.copies {
            c.valid = false;
        }
        self.host_valid = true;
    }

    /// Whether the host copy is current (no transfer needed to read it there).
    pub(crate) fn host_valid(&self) -> bool {
        self.host_valid
    }

    /// Drops the copy on `device`, which failed (its memory cannot be read). When that was the
    /// only valid copy the buffer falls back to its host copy and is marked lost. Returns whether
    /// there was a copy.
    fn forget(&mut self, device: usize, len: u64, usage: &DeviceUsage) -> bool {
        let Some(position) = self.copies.iter().position(|c| c.device == device) else {
            return false;
        };
        let copy = self.copies.remove(position);
        usage.bytes[device].fetch_sub(len, Ordering::Relaxed);
        if copy.valid && !self.host_valid && !self.copies.iter().any(|c| c.valid) {
            self.host_valid = true;
            self.lost = true;
        }
        true
    }

    /// Whether the copy on `device` is current.
    pub(crate) fn valid_on(&self, device: usize) -> bool {
        self.copies.iter().any(|c| c.device == device && c.valid)
    }

    /// A job planned on `device` that named this buffer was lost before it ran (its device, or
    /// the device it read from, failed): undoes what planning it claimed. Copies its transfers
    /// were to make current (the host copy unless it was current before, `device`'s copy unless
    /// it was current before) are not; a copy current before still holds what the task read. If
    /// no copy is left current the buffer falls back to its host copy, marked lost.
    pub(crate) fn job_lost(&mut self, device: usize, host_before: bool, device_before: bool) {
        self.host_valid = host_before;
        if !device_before {
            for c in self.copies.iter_mut().filter(|c| c.device == device) {
                c.valid = false;
            }
        }
        if !self.host_valid && !self.copies.iter().any(|c| c.valid) {
            self.host_valid = true;
            self.lost = true;
        }
    }

    /// Takes `buffer`, allocated on `device` ahead of the task that needs it (an allocation a
    /// device host answered later), as this buffer's copy there: not valid yet (the task's
    /// planning copies the contents in). `false`, and `buffer` is dropped, when the buffer got a
    /// copy there meanwhile. The caller counted its bytes in the session's usage and, on
    /// `false`, takes them back.
    pub(crate) fn adopt(&mut self, device: usize, buffer: Arc<dyn DeviceBuffer>) -> bool {
        if self.is_on(device) {
            return false;
        }
        self.copies.push(DeviceCopy {
            device,
            buffer,
            valid: false,
        });
        true
    }

    /// Whether `device` has an allocation for this buffer.
    pub(crate) fn is_on(&self, device: usize) -> bool {
        self.copies.iter().any(|c| c.device == device)
    }

    /// Bytes a task on `device` would have to move to read this buffer there (a rough figure
    /// for policies: `len` per copy step).
    pub(crate) fn missing_bytes(&self, device: usize, shares_host_memory: bool, len: u64) -> u64 {
        let device_valid = self.copies.iter().any(|c| c.device == device && c.valid);
        match (shares_host_memory, self.host_valid, device_valid) {
            (true, true, _) | (false, _, true) => 0,
            (true, false, _) | (false, true, false) => len,
            (false, false, false) => 2 * len,
        }
    }

    /// Drops this buffer's copy on `device`, first reading it back into `host` when it is the
    /// only valid copy. The caller guarantees no task uses the buffer (`in_use` is zero).
    fn evict(
        &mut self,
        devices: &[Arc<dyn Device>],
        device: usize,
        host: *mut u8,
        len: u64,
        usage: &DeviceUsage,
    ) -> Result<bool, TaskError> {
        let Some(position) = self.copies.iter().position(|c| c.device == device) else {
            return Ok(false);
        };
        let only_valid =
            !self.host_valid && self.copies[position].valid && self.copies.iter().filter(|c| c.valid).count() == 1;
        if only_valid {
            // SAFETY: `host` is this buffer's live host range of `len` bytes; no task uses the
            // buffer, so nothing else reads or writes either copy meanwhile.
            unsafe { devices[device].read(self.copies[position].buffer.as_ref(), host, len as usize)? };
            self.host_valid = true;
        }
        self.copies.remove(position);
        usage.bytes[device].fetch_sub(len, Ordering::Relaxed);
        Ok(true)
    }
}

impl Drop for BufferRecord {
    /// The buffer was released and no job names it any more (or its session ended).
    fn drop(&mut self) {
        let placement = self.placement.get_mut().unwrap_or_else(|e| e.into_inner());
        if let Some(device) = placement.owner() {
            self.unread.note(self.len, device);
        }
        for copy in &placement.copies {
            self.usage.bytes[copy.device].fetch_sub(self.len, Ordering::Relaxed);
        }
    }
}

/// Which buffers have device copies, for eviction. Owned by the dispatcher thread.
#[derive(Debug, Default)]
pub(crate) struct Residency {
    buffers: Vec<Weak<BufferRecord>>,
    clock: u64,
    /// Buffers evicted since start (for status and tests).
    pub evictions: u64,
    /// Evictions whose write-back is in flight.
    write_backs: Vec<Arc<WriteBack>>,
    /// Wakes the dispatcher when a write-back is answered (none: it notices at its next loop).
    waker: Option<Waker>,
}

impl Residency {
    /// Notes that `record` is named by a task being planned now.
    pub(crate) fn touch(&mut self, record: &Arc<BufferRecord>) {
        self.clock += 1;
        record.last_used.store(self.clock, Ordering::Relaxed);
    }

    /// Notes that `record` may have device copies from now on.
    pub(crate) fn register(&mut self, record: &Arc<BufferRecord>) {
        let mut placement = record.placement();
        if !placement.registered && !placement.copies.is_empty() {
            placement.registered = true;
            self.buffers.push(Arc::downgrade(record));
        }
    }

    /// Drops every idle buffer's copy on `device` (drain with evacuation), reading a copy that
    /// is the only valid one back into host memory first. Buffers in use are left (they move on
    /// demand). Returns (buffers, bytes) freed on the device.
    pub(crate) fn evacuate(&mut self, devices: &[Arc<dyn Device>], device: usize) -> (u64, u64) {
        self.buffers.retain(|w| w.strong_count() > 0);
        let (mut count, mut bytes) = (0, 0);
        for record in self.buffers.iter().filter_map(Weak::upgrade) {
            if record.in_use.load(Ordering::Acquire) != 0 || record.writing_back.load(Ordering::Acquire) {
                continue;
            }
            // The host copy stays mapped while the copy is read back.
            let evicted = record.with_host(0, record.len, |host| {
                record
                    .placement()
                    .evict(devices, device, host, record.len, &record.usage)
            });
            let Some(evicted) = evicted else { continue };
            match evicted {
                Ok(true) => {
                    count += 1;
                    bytes += record.len;
                }
                Ok(false) => {}
                Err(error) => {
                    tracing::warn!(device = %devices[device].info().name, %error, "could not evacuate a buffer; it stays");
                }
            }
        }
        (count, bytes)
    }

    /// Forgets every copy on `device`, which failed. Returns (buffers that had a copy there,
    /// buffers whose only valid copy it was and that are now lost).
    pub(crate) fn forget_device(&mut self, device: usize) -> (u64, u64) {
        self.buffers.retain(|w| w.strong_count() > 0);
        let (mut had, mut lost) = (0, 0);
        for record in self.buffers.iter().filter_map(Weak::upgrade) {
            let mut placement = record.placement();
            let was_lost = placement.lost;
            if placement.forget(device, record.len, &record.usage) {
                had += 1;
                lost += u64::from(placement.lost && !was_lost);
            }
        }
        (had, lost)
    }

    /// Evicts idle buffers from `device` until `needed` more bytes fit in its memory and, when
    /// `quota` is set, in the session's share of it. Returns whether it fits now.
    ///
    /// Fair to the other tenants (issue 22): each tenant with data on the device has a fair share
    /// of its memory ([`FairShares`]: the device divided among the users and Slurm jobs with
    /// data on it, each one's part among its sessions). Buffers of tenants over their share go
    /// first, each group least recently used first; a session that already holds more than its
    /// share when it asks may evict only its own buffers and those of other tenants over their
    /// share, so it waits (the caller's `Room::Later`) rather than pushing out a tenant within
    /// its share. For the quota only the session's own buffers are evicted.
    pub(crate) fn make_room(
        &mut self,
        devices: &[Arc<dyn Device>],
        device: usize,
        needed: u64,
        session: &Arc<DeviceUsage>,
        quota: u64,
    ) -> bool {
        let capacity = devices[device].info().memory_bytes;
        let fits = |s: &Arc<DeviceUsage>| {
            devices[device].memory_used() + needed <= capacity
                && (quota == 0 || s.bytes[device].load(Ordering::Relaxed) + needed <= quota)
        };
        if fits(session) {
            return true;
        }
        let (victims, shares) = self.idle_on(devices, device, session);
        let asker_over_share = session.bytes[device].load(Ordering::Relaxed) > shares.of(session);
        for victim in victims {
            // Bytes of write-backs in flight are as good as free here: once they are answered
            // the task that waits for them finds the room.
            let (freeing, freeing_own) = self.freeing(device, session);
            let device_full = devices[device].memory_used().saturating_sub(freeing) + needed > capacity;
            let own = Arc::ptr_eq(&victim.usage, session);
            let quota_full = quota > 0
                && session.bytes[device]
                    .load(Ordering::Relaxed)
                    .saturating_sub(freeing_own)
                    + needed
                    > quota;
            if !device_full && !quota_full {
                break;
            }
            // Over the quota but not the device: only this session's buffers may go.
            if !device_full && !own {
                continue;
            }
            // A session over its share does not push out a tenant within its share.
            if asker_over_share
                && !own
                && victim.usage.bytes[device].load(Ordering::Relaxed) <= shares.of(&victim.usage)
            {
                continue;
            }
            self.evict(devices, device, &victim);
            if fits(session) {
                return true;
            }
        }
        fits(session)
    }

    /// Bytes that write-backs in flight will free on `device`: all of them, and `session`'s.
    fn freeing(&self, device: usize, session: &Arc<DeviceUsage>) -> (u64, u64) {
        self.write_backs
            .iter()
            .filter(|w| w.device == device)
            .fold((0, 0), |(all, own), w| {
                let len = w.record.len;
                (
                    all + len,
                    own + if Arc::ptr_eq(&w.record.usage, session) { len } else { 0 },
                )
            })
    }

    /// When `needed` bytes do not fit `device` (and `session`'s `quota`) now but will once the
    /// write-backs in flight there are answered: the buffers they write back, for the task to
    /// wait on. `None`: they will not fit even then (the task waits for room another way).
    pub(crate) fn room_after_write_backs(
        &self,
        devices: &[Arc<dyn Device>],
        device: usize,
        needed: u64,
        session: &Arc<DeviceUsage>,
        quota: u64,
    ) -> Option<Vec<Arc<BufferRecord>>> {
        let (freeing, freeing_own) = self.freeing(device, session);
        if freeing == 0 {
            return None;
        }
        let capacity = devices[device].info().memory_bytes;
        let fits = devices[device].memory_used().saturating_sub(freeing) + needed <= capacity
            && (quota == 0
                || session.bytes[device]
                    .load(Ordering::Relaxed)
                    .saturating_sub(freeing_own)
                    + needed
                    <= quota);
        fits.then(|| {
            self.write_backs
                .iter()
                .filter(|w| w.device == device)
                .map(|w| w.record.clone())
                .collect()
        })
    }

    /// Whether write-backs are in flight (the dispatcher must finish them).
    pub(crate) fn writing_back(&self) -> bool {
        !self.write_backs.is_empty()
    }

    /// The dispatcher's doorbell, rung when a write-back is answered.
    pub(crate) fn set_waker(&mut self, waker: Waker) {
        self.waker = Some(waker);
    }

    /// Finishes the write-backs that were answered: each buffer's host copy becomes the valid
    /// one and its device copy is dropped (an eviction). One that failed keeps its copy.
    /// Returns how many finished.
    pub(crate) fn finish_write_backs(&mut self, devices: &[Arc<dyn Device>]) -> usize {
        if self.write_backs.is_empty() {
            return 0;
        }
        let mut finished = 0;
        let mut evicted = 0;
        self.write_backs.retain(|w| {
            let Some(answer) = w.answer.lock().unwrap_or_else(|e| e.into_inner()).take() else {
                return true;
            };
            finished += 1;
            let record = &w.record;
            {
                let mut placement = record.placement();
                match answer {
                    Ok(()) => {
                        // Nothing named the buffer meanwhile (such tasks wait), so its copy there
                        // is still the only valid one unless the device failed and forgot it.
                        let position = placement.copies.iter().position(|c| c.device == w.device);
                        match position {
                            Some(p) if placement.copies[p].valid && !placement.host_valid && placement.writer == w.writer => {
                                placement.host_valid = true;
                                placement.copies.remove(p);
                                record.usage.bytes[w.device].fetch_sub(record.len, Ordering::Relaxed);
                                evicted += 1;
                                tracing::debug!(device = %devices[w.device].info().name, bytes = record.len, "evicted a buffer to host memory (written back without waiting)");
                            }
                            _ => tracing::debug!("a buffer written back changed meanwhile; nothing to drop"),
                        }
                    }
                    Err(error) => {
                        tracing::warn!(device = %devices[w.device].info().name, %error, "could not evict a buffer; keeping it");
                    }
                }
            }
            record.writing_back.store(false, Ordering::Release);
            false
        });
        self.evictions += evicted;
        finished
    }

    /// Evicts idle buffers from `device` (over-share tenants' first, least recently used first)
    /// until at least `bytes` were freed or none is left: for a device runtime that refused an
    /// allocation the books said would fit (its real free memory is lower: fragmentation, other
    /// processes, a driver's own use). Returns the bytes freed.
    pub(crate) fn evict_at_least(&mut self, devices: &[Arc<dyn Device>], device: usize, bytes: u64) -> u64 {
        let before = devices[device].memory_used();
        let target = before.saturating_sub(bytes);
        let (victims, _) = self.idle_on(devices, device, &Arc::new(DeviceUsage::default()));
        for victim in victims {
            if devices[device].memory_used() <= target {
                break;
            }
            // Now: the allocation is retried right after.
            self.evict_now(devices, device, &victim);
        }
        before.saturating_sub(devices[device].memory_used())
    }

    /// The idle buffers with a copy on `device`, in eviction order — those of tenants over
    /// their fair share first, each group least recently used first — and the shares (`asker`
    /// counted as a tenant).
    fn idle_on(
        &mut self,
        devices: &[Arc<dyn Device>],
        device: usize,
        asker: &Arc<DeviceUsage>,
    ) -> (Vec<Arc<BufferRecord>>, FairShares) {
        self.buffers.retain(|w| w.strong_count() > 0);
        let live: Vec<Arc<BufferRecord>> = self.buffers.iter().filter_map(Weak::upgrade).collect();
        let shares = FairShares::new(
            devices[device].info().memory_bytes,
            device,
            asker,
            live.iter().map(|r| &r.usage),
        );
        let mut victims: Vec<Arc<BufferRecord>> = live
            .into_iter()
            .filter(|r| {
                r.in_use.load(Ordering::Acquire) == 0
                    && !r.writing_back.load(Ordering::Acquire)
                    && r.placement().is_on(device)
            })
            .collect();
        // Over their share first (false sorts first), then least recently used.
        victims.sort_by_key(|r| {
            (
                r.usage.bytes[device].load(Ordering::Relaxed) <= shares.of(&r.usage),
                r.last_used.load(Ordering::Relaxed),
            )
        });
        (victims, shares)
    }

    /// Starts writing `victim`'s copy on `device` home without waiting, where that copy is the
    /// only valid one and the device reads far (a device host). Returns whether it started.
    fn start_write_back(&mut self, devices: &[Arc<dyn Device>], device: usize, victim: &Arc<BufferRecord>) -> bool {
        if !devices[device].allocates_far() {
            return false;
        }
        let placement = victim.placement();
        let only_valid = !placement.host_valid
            && placement.copies.iter().filter(|c| c.valid).count() == 1
            && placement.copies.iter().any(|c| c.device == device && c.valid);
        if !only_valid {
            return false;
        }
        let Some(buffer) = placement
            .copies
            .iter()
            .find(|c| c.device == device)
            .map(|c| c.buffer.clone())
        else {
            return false;
        };
        let Some((hold, host)) = victim.hold_host() else {
            return false;
        };
        let write_back = Arc::new(WriteBack {
            record: victim.clone(),
            device,
            writer: placement.writer,
            _host: hold,
            answer: Mutex::new(None),
        });
        drop(placement);
        victim.writing_back.store(true, Ordering::Release);
        let answered = write_back.clone();
        let waker = self.waker.clone();
        // The record in `write_back` holds the device copy (its placement drops it only when the
        // write-back is finished) and `hold` keeps the host copy mapped.
        // SAFETY: `host` is the buffer's whole host copy, `victim.len` bytes, kept mapped by
        // `hold` until the answer; no task uses the buffer (it was idle) and tasks that name it
        // wait while `writing_back` is set, so nothing else reads or writes those bytes.
        let started = unsafe {
            devices[device].read_later(
                buffer.as_ref(),
                host,
                victim.len as usize,
                Box::new(move |result| {
                    *answered.answer.lock().unwrap_or_else(|e| e.into_inner()) = Some(result);
                    if let Some(waker) = waker {
                        (waker.0)();
                    }
                }),
            )
        };
        if started {
            self.write_backs.push(write_back);
        } else {
            victim.writing_back.store(false, Ordering::Release);
        }
        started
    }

    /// Evicts `victim`'s copy on `device` (reading it home first if it is the only valid one;
    /// on a device in a device host that read is only started, see [`WriteBack`]).
    fn evict(&mut self, devices: &[Arc<dyn Device>], device: usize, victim: &Arc<BufferRecord>) {
        if !self.start_write_back(devices, device, victim) {
            self.evict_now(devices, device, victim);
        }
    }

    /// Evicts `victim`'s copy on `device` now, reading it home first if it is the only valid one.
    fn evict_now(&mut self, devices: &[Arc<dyn Device>], device: usize, victim: &BufferRecord) {
        // The host copy stays mapped while the copy is read back.
        let evicted = victim.with_host(0, victim.len, |host| {
            victim
                .placement()
                .evict(devices, device, host, victim.len, &victim.usage)
        });
        let Some(evicted) = evicted else { return };
        match evicted {
            Ok(true) => {
                self.evictions += 1;
                tracing::debug!(device = %devices[device].info().name, bytes = victim.len, "evicted a buffer to host memory");
            }
            Ok(false) => {}
            Err(error) => {
                tracing::warn!(device = %devices[device].info().name, %error, "could not evict a buffer; keeping it");
            }
        }
    }
}

/// Each tenant's fair share of a device's memory: the device divided among the groups (users,
/// Slurm jobs) with data on it, each group's part divided among its sessions with data on it,
/// the asking session counted even before it has any. Two levels, as on the lanes: a user who
/// opens more sessions gets no more of the device, only more, smaller, parts of its own share.
pub(crate) struct FairShares {
    capacity: u64,
    /// `(group, sessions of it with data on the device)`.
    groups: Vec<(u64, u64)>,
}

impl FairShares {
    fn new<'a>(
        capacity: u64,
        device: usize,
        asker: &'a Arc<DeviceUsage>,
        usages: impl Iterator<Item = &'a Arc<DeviceUsage>>,
    ) -> FairShares {
        let mut sessions: Vec<(u64, *const DeviceUsage)> = usages
            .filter(|u| u.bytes[device].load(Ordering::Relaxed) > 0)
            .chain(std::iter::once(asker))
            .map(|u| (u.group.load(Ordering::Relaxed), Arc::as_ptr(u)))
            .collect();
        sessions.sort_unstable();
        sessions.dedup();
        let mut groups: Vec<(u64, u64)> = Vec::new();
        for (group, _) in sessions {
            match groups.last_mut() {
                Some((last, count)) if *last == group => *count += 1,
                _ => groups.push((group, 1)),
            }
        }
        FairShares { capacity, groups }
    }

    /// The share of the session whose usage is `usage`.
    pub(crate) fn of(&self, usage: &DeviceUsage) -> u64 {
        let group = usage.group.load(Ordering::Relaxed);
        match self.groups.iter().find(|(g, _)| *g == group) {
            Some((_, sessions)) => self.capacity / self.groups.len() as u64 / sessions,
            // Not counted (no data there): as a group of its own arriving.
            None => self.capacity / (self.groups.len() as u64 + 1),
        }
    }
}

/// Returns the allocator's free memory to the operating system. glibc keeps memory freed after
/// a burst (a flood of queued jobs, large replies) in its arenas indefinitely, so an idle daemon
/// would keep its peak resident size; the daemon calls this when its last tenant has left.
pub(crate) fn return_free_memory() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    {
        unsafe extern "C" {
            fn malloc_trim(pad: usize) -> std::ffi::c_int;
        }
        // SAFETY: malloc_trim only gives free pages of the allocator's arenas back to the
        // kernel; it takes the arenas' locks itself and has no preconditions.
        unsafe {
            malloc_trim(0);
        }
    }
}

/// Buffers and devices for unit tests of the modules that use them (no session, no device host).
#[cfg(test)]
pub(crate) mod tests_support {
    use super::*;

    #[derive(Debug)]
    struct NoHost;

    impl HostMemory for NoHost {
        fn host_range(&self, _offset: u64, _len: u64) -> Option<*mut u8> {
            None
        }
    }

    /// A buffer of `len` bytes whose host memory is gone (it is never read back).
    pub(crate) fn record(len: u64) -> Arc<BufferRecord> {
        let owner: Weak<dyn HostMemory> = Weak::<NoHost>::new();
        Arc::new(BufferRecord::new(
            0,
            len,
            Arc::new(DeviceUsage::default()),
            owner,
            Arc::default(),
        ))
    }

    /// A device whose allocations and reads are answered by the test, as a device in a device
    /// host answers them late (`Device::allocates_far`): `alloc_later` records the request
    /// (`answer_allocations` answers it); `read_later` copies at once and records the answer
    /// (`answer_reads` gives it); synchronous allocations are counted. The rest is `inner`'s.
    pub(crate) struct FarDevice {
        pub inner: Arc<dyn Device>,
        pub allocations: Mutex<Vec<(u64, agora_devices::AllocationDone)>>,
        pub reads: Mutex<Vec<agora_devices::ReadDone>>,
        pub synchronous_allocations: std::sync::atomic::AtomicUsize,
    }

    impl std::fmt::Debug for FarDevice {
        fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            f.debug_struct("FarDevice")
                .field("inner", &self.inner)
                .finish_non_exhaustive()
        }
    }

    impl FarDevice {
        pub(crate) fn new(inner: Arc<dyn Device>) -> Self {
            FarDevice {
                inner,
                allocations: Mutex::default(),
                reads: Mutex::default(),
                synchronous_allocations: Default::default(),
            }
        }

        /// Answers every allocation asked so far: refused, or the inner device's own. Returns
        /// how many.
        pub(crate) fn answer_allocations(&self, refuse: bool) -> usize {
            let asked = std::mem::take(&mut *self.allocations.lock().unwrap_or_else(|e| e.into_inner()));
            let count = asked.len();
            for (len, done) in asked {
                done(if refuse {
                    Err(TaskError::DeviceOutOfMemory { index: 0, needed: len })
                } else {
                    self.inner.alloc(7, len).unwrap_or(Err(TaskError::KernelFault))
                });
            }
            count
        }

        /// Answers every read started so far with `result`.
        pub(crate) fn answer_reads(&self, result: Result<(), TaskError>) {
            for done in std::mem::take(&mut *self.reads.lock().unwrap_or_else(|e| e.into_inner())) {
                done(result);
            }
        }
    }

    impl Device for FarDevice {
        fn info(&self) -> &agora_devices::DeviceInfo {
            self.inner.info()
        }
        fn implements(&self, kernel: &agora_kernels::KernelDef) -> bool {
            self.inner.implements(kernel)
        }
        fn submit(&self, lane: usize, job: agora_devices::Job) {
            self.inner.submit(lane, job)
        }
        fn lane_load(&self, lane: usize) -> usize {
            self.inner.lane_load(lane)
        }
        fn run_inline(&self, work: &agora_devices::Work) -> Result<(), TaskError> {
            self.inner.run_inline(work)
        }
        fn alloc(&self, tenant: u64, len: u64) -> Option<Result<Arc<dyn DeviceBuffer>, TaskError>> {
            self.synchronous_allocations.fetch_add(1, Ordering::Relaxed);
            self.inner.alloc(tenant, len)
        }
        fn allocates_far(&self) -> bool {
            true
        }
        fn alloc_later(&self, _tenant: u64, len: u64, done: agora_devices::AllocationDone) {
            self.allocations
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .push((len, done));
        }
        unsafe fn read(&self, from: &dyn DeviceBuffer, host: *mut u8, len: usize) -> Result<(), TaskError> {
            // SAFETY: the caller's contract, passed on.
            unsafe { self.inner.read(from, host, len) }
        }
        unsafe fn read_later(
            &self,
            from: &dyn DeviceBuffer,
            host: *mut u8,
            len: usize,
            done: agora_devices::ReadDone,
        ) -> bool {
            // SAFETY: the caller's contract (valid until `done`, which comes later), passed on.
            if unsafe { self.inner.read(from, host, len) }.is_err() {
                return false;
            }
            self.reads.lock().unwrap_or_else(|e| e.into_inner()).push(done);
            true
        }
        fn memory_used(&self) -> u64 {
            self.inner.memory_used()
        }
        fn status(&self) -> agora_devices::DeviceReport {
            self.inner.status()
        }
        fn shutdown(&self) {
            self.inner.shutdown()
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use agora_devices::sim::{SimDevice, SimSpec};

    /// Host memory for test buffers: one allocation, handed out in ranges.
    #[derive(Debug)]
    struct TestHeap(Mutex<Vec<u8>>);

    impl HostMemory for TestHeap {
        fn host_range(&self, offset: u64, len: u64) -> Option<*mut u8> {
            let mut heap = self.0.lock().unwrap();
            let end = offset.checked_add(len)?;
            (end <= heap.len() as u64).then(|| heap[offset as usize..].as_mut_ptr())
        }
    }

    const MIB: u64 = 1 << 20;

    /// A 3 MiB sim device and three 1 MiB buffers with a valid copy on it, used in the order
    /// a, b, c (a least recently).
    /// Devices, the host memory, the books, and `N` buffers.
    type Resident<const N: usize> = (Vec<Arc<dyn Device>>, Arc<TestHeap>, Residency, [Arc<BufferRecord>; N]);
    type Setup = Resident<3>;

    fn setup() -> Setup {
        setup_on(Arc::new(
            SimDevice::new(SimSpec {
                memory_bytes: 3 * MIB,
                ..Default::default()
            })
            .unwrap(),
        ))
    }

    /// [`setup`] on `device` (a 3 MiB one).
    fn setup_on(device: Arc<dyn Device>) -> Setup {
        let devices: Vec<Arc<dyn Device>> = vec![device];
        let heap = Arc::new(TestHeap(Mutex::new(vec![0u8; 3 * MIB as usize])));
        let owner: Weak<dyn HostMemory> = Arc::downgrade(&(heap.clone() as Arc<dyn HostMemory>));
        let usage = Arc::new(DeviceUsage::default());
        let mut residency = Residency::default();
        let unread = Arc::new(UnreadReleases::default());
        let records = [0, 1, 2].map(|i| {
            Arc::new(BufferRecord::new(
                i * MIB,
                MIB,
                usage.clone(),
                owner.clone(),
                unread.clone(),
            ))
        });
        for record in &records {
            let host = heap.host_range(record.offset, record.len).unwrap();
            let mut transfers = Vec::new();
            record
                .placement()
                .prepare(
                    &devices,
                    0,
                    Access::ReadWrite,
                    false,
                    host,
                    record.len,
                    &usage,
                    &mut transfers,
                )
                .unwrap();
            residency.register(record);
            residency.touch(record);
        }
        (devices, heap, residency, records)
    }

    #[test]
    fn eviction_takes_the_least_recently_used_idle_buffer_first() {
        let (devices, _heap, mut residency, [a, b, c]) = setup();
        assert!(a.placement().is_on(0) && b.placement().is_on(0) && c.placement().is_on(0));
        let usage = a.usage.clone();
        // 1 MiB more: one buffer must go, the least recently used.
        assert!(residency.make_room(&devices, 0, MIB, &usage, 0));
        assert!(!a.placement().is_on(0), "a was used least recently");
        assert!(b.placement().is_on(0) && c.placement().is_on(0));
        assert_eq!(residency.evictions, 1);
        // b is in use by a planned task: it stays, c goes instead.
        b.in_use.fetch_add(1, Ordering::AcqRel);
        residency.touch(&c);
        // 2 MiB more with b pinned: only c can go (then b's 1 MiB + 2 MiB fit the 3 MiB device).
        assert!(residency.make_room(&devices, 0, 2 * MIB, &usage, 0));
        assert!(b.placement().is_on(0), "a buffer in use is never evicted");
        assert!(!c.placement().is_on(0));
        b.in_use.fetch_sub(1, Ordering::AcqRel);
    }

    #[test]
    fn a_failed_writer_leaves_no_copy_claiming_its_output() {
        let (devices, heap, _residency, [a, b, _c]) = setup();
        let usage = a.usage.clone();
        // Task 7, a write-only launch over all of `a` (nothing copied in), claims the device copy.
        let host = heap.host_range(a.offset, a.len).unwrap();
        let mut placement = a.placement();
        placement.host_written();
        let mut transfers = Vec::new();
        placement
            .prepare(&devices, 0, Access::Write, true, host, a.len, &usage, &mut transfers)
            .unwrap();
        assert!(transfers.is_empty(), "a whole overwrite copies nothing in");
        placement.written_by(7);
        assert!(!placement.host_valid() && placement.valid_on(0));
        placement.writer_failed(6);
        assert!(!placement.host_valid(), "only the last writer's failure counts");
        placement.writer_failed(7);
        assert!(placement.host_valid() && !placement.valid_on(0));
        assert_eq!(
            placement.fetch_to_host(&devices, host, a.len, &mut transfers),
            None,
            "nothing is copied out of the device"
        );
        assert!(transfers.is_empty());
        drop(placement);

        // Planning abandoned: the copies are valid as before it.
        let host = heap.host_range(b.offset, b.len).unwrap();
        let mut placement = b.placement();
        placement.host_written();
        let before = placement.validity();
        placement
            .prepare(&devices, 0, Access::Write, true, host, b.len, &usage, &mut transfers)
            .unwrap();
        assert!(!placement.host_valid() && placement.valid_on(0));
        placement.restore(before);
        assert!(placement.host_valid() && !placement.valid_on(0));
    }

    /// A sim device of `N` MiB full of `N` 1 MiB buffers, the `i`th of `owners[i]`, made and
    /// used in that order (the first least recently used).
    fn resident<const N: usize>(owners: [&Arc<DeviceUsage>; N]) -> Resident<N> {
        let devices: Vec<Arc<dyn Device>> = vec![Arc::new(
            SimDevice::new(SimSpec {
                memory_bytes: N as u64 * MIB,
                ..Default::default()
            })
            .unwrap(),
        )];
        let heap = Arc::new(TestHeap(Mutex::new(vec![0u8; N * MIB as usize])));
        let owner: Weak<dyn HostMemory> = Arc::downgrade(&(heap.clone() as Arc<dyn HostMemory>));
        let unread = Arc::new(UnreadReleases::default());
        let mut residency = Residency::default();
        let mut index = 0;
        let records = owners.map(|usage| {
            let record = Arc::new(BufferRecord::new(
                index * MIB,
                MIB,
                usage.clone(),
                owner.clone(),
                unread.clone(),
            ));
            index += 1;
            let host = heap.host_range(record.offset, record.len).unwrap();
            record
                .placement()
                .prepare(&devices, 0, Access::ReadWrite, false, host, MIB, usage, &mut Vec::new())
                .unwrap();
            residency.register(&record);
            residency.touch(&record);
            record
        });
        (devices, heap, residency, records)
    }

    /// A 3 MiB sim device holding three 1 MiB buffers: `b` of a tenant within its fair share
    /// (used least recently), then `a1`, `a2` of a tenant over it (2 MiB of a 1.5 MiB share).
    fn two_tenants() -> Setup {
        let (within, over) = (Arc::new(DeviceUsage::default()), Arc::new(DeviceUsage::default()));
        resident([&within, &over, &over])
    }

    #[test]
    fn eviction_takes_from_the_tenant_over_its_fair_share_first() {
        let (devices, _heap, mut residency, [b, a1, a2]) = two_tenants();
        let within = b.usage.clone();
        // The tenant within its share needs 1 MiB: the over-share tenant's least recently used
        // buffer goes, although `b` is the least recently used of all.
        assert!(residency.make_room(&devices, 0, MIB, &within, 0));
        assert!(b.placement().is_on(0), "the tenant within its share keeps its buffer");
        assert!(!a1.placement().is_on(0) && a2.placement().is_on(0));
    }

    #[test]
    fn a_tenant_over_its_fair_share_waits_rather_than_push_out_one_within_it() {
        let (devices, _heap, mut residency, [b, a1, a2]) = two_tenants();
        let over = a1.usage.clone();
        // Its own buffers are busy: it may not take `b`'s place, so it waits (false).
        a1.in_use.fetch_add(1, Ordering::AcqRel);
        a2.in_use.fetch_add(1, Ordering::AcqRel);
        assert!(!residency.make_room(&devices, 0, MIB, &over, 0));
        assert!(b.placement().is_on(0));
        assert_eq!(residency.evictions, 0);
        // Once one of its own is idle, it evicts that one.
        a2.in_use.fetch_sub(1, Ordering::AcqRel);
        assert!(residency.make_room(&devices, 0, MIB, &over, 0));
        assert!(b.placement().is_on(0) && !a2.placement().is_on(0));
        a1.in_use.fetch_sub(1, Ordering::AcqRel);
    }

    #[test]
    fn a_user_with_more_sessions_gets_no_more_of_a_device_s_memory() {
        // A 4 MiB device: user A's two sessions hold 1 MiB each, user B's one session 2 MiB.
        let (a1, a2) = (
            Arc::new(DeviceUsage::in_group(1, 10)),
            Arc::new(DeviceUsage::in_group(2, 10)),
        );
        let b = Arc::new(DeviceUsage::in_group(3, 20));
        let (devices, _heap, mut residency, records) = resident([&a1, &a2, &b, &b]);
        // Each user's half, split among its sessions: B's one session 2 MiB, A's 1 MiB each
        // (one level, a third each: B would be over its share).
        let shares = FairShares::new(4 * MIB, 0, &b, [&a1, &a2, &b].into_iter());
        assert_eq!((shares.of(&a1), shares.of(&a2), shares.of(&b)), (MIB, MIB, 2 * MIB));
        // B needs 1 MiB more while its own buffers are busy: within its share, it may take the
        // place of A's least recently used buffer (one level: over a third, it would wait).
        records[2].in_use.fetch_add(1, Ordering::AcqRel);
        records[3].in_use.fetch_add(1, Ordering::AcqRel);
        assert!(residency.make_room(&devices, 0, MIB, &b, 0));
        assert!(!records[0].placement().is_on(0) && records[1].placement().is_on(0));
        assert!(records[2].placement().is_on(0) && records[3].placement().is_on(0));
        records[2].in_use.fetch_sub(1, Ordering::AcqRel);
        records[3].in_use.fetch_sub(1, Ordering::AcqRel);
    }

    #[test]
    fn a_refused_allocation_frees_at_least_its_size_over_share_first() {
        let (devices, _heap, mut residency, [b, a1, a2]) = two_tenants();
        // The books say 1 MiB is free; the runtime refused 1.5 MiB: 1.5 MiB more is freed.
        let freed = residency.evict_at_least(&devices, 0, 3 * MIB / 2);
        assert_eq!(freed, 2 * MIB);
        assert!(b.placement().is_on(0), "the over-share tenant's buffers went");
        assert!(!a1.placement().is_on(0) && !a2.placement().is_on(0));
    }

    #[test]
    fn an_evicted_only_copy_is_written_home_first() {
        let (devices, heap, mut residency, [a, _b, _c]) = setup();
        // The device copy of `a` is the only valid one (a kernel wrote it there).
        a.placement().host_valid = false;
        let usage = a.usage.clone();
        assert!(residency.make_room(&devices, 0, MIB, &usage, 0));
        assert!(!a.placement().is_on(0));
        assert!(a.placement().host_valid, "read back before the device copy was dropped");
        drop(heap);
    }

    /// A sim of `memory_bytes` behind a device host whose answers the test gives.
    fn far_sim(memory_bytes: u64) -> Arc<tests_support::FarDevice> {
        Arc::new(tests_support::FarDevice::new(Arc::new(
            SimDevice::new(SimSpec {
                memory_bytes,
                ..Default::default()
            })
            .unwrap(),
        )))
    }

    /// Issue 22, 3c: on a device in a device host an eviction's write-back is started, not
    /// waited for: the room comes when it is answered and finished, the buffer is never chosen
    /// twice meanwhile, and a failed write-back keeps the copy.
    #[test]
    fn a_far_eviction_writes_back_without_waiting_and_frees_the_room_once_answered() {
        let far = far_sim(3 * MIB);
        let (devices, _heap, mut residency, [a, b, c]) = setup_on(far.clone());
        let answer = |result: Result<(), TaskError>| far.answer_reads(result);
        let usage = a.usage.clone();
        // 1 MiB more: a (least recently used, only valid on the device) is written back.
        assert!(
            !residency.make_room(&devices, 0, MIB, &usage, 0),
            "not free before the answer"
        );
        assert!(a.writing_back.load(Ordering::Acquire) && a.placement().is_on(0));
        assert!(residency.writing_back());
        let waits_for = residency.room_after_write_backs(&devices, 0, MIB, &usage, 0).unwrap();
        assert!(waits_for.len() == 1 && Arc::ptr_eq(&waits_for[0], &a));
        assert!(residency
            .room_after_write_backs(&devices, 0, 2 * MIB, &usage, 0)
            .is_none());
        // Asked again before the answer: nothing more is evicted (a's bytes count as freed).
        assert!(!residency.make_room(&devices, 0, MIB, &usage, 0));
        assert_eq!(far.reads.lock().unwrap().len(), 1, "one write-back, not two");
        assert_eq!(residency.finish_write_backs(&devices), 0, "nothing answered yet");
        answer(Ok(()));
        assert_eq!(residency.finish_write_backs(&devices), 1);
        assert!(!a.writing_back.load(Ordering::Acquire) && !residency.writing_back());
        assert!(
            !a.placement().is_on(0) && a.placement().host_valid,
            "evicted, its host copy current"
        );
        assert_eq!(residency.evictions, 1);
        assert_eq!(usage.bytes[0].load(Ordering::Relaxed), 2 * MIB);
        assert!(
            residency.make_room(&devices, 0, MIB, &usage, 0),
            "the room is there now"
        );
        // A write-back that fails keeps the copy, the only valid one.
        residency.touch(&c);
        assert!(!residency.make_room(&devices, 0, 2 * MIB, &usage, 0));
        assert!(b.writing_back.load(Ordering::Acquire));
        answer(Err(TaskError::DeviceLost));
        assert_eq!(residency.finish_write_backs(&devices), 1);
        assert!(!b.writing_back.load(Ordering::Acquire));
        assert!(
            b.placement().is_on(0) && !b.placement().host_valid,
            "kept where it was valid"
        );
        assert_eq!(residency.evictions, 1);
    }

    /// A client about to write a host copy over results on a device claims it: refused while a
    /// task uses the buffer or an eviction is writing it home; once granted, the device copy is
    /// stale and its eviction writes nothing home (nothing lands over the client's writes).
    #[test]
    fn a_claimed_host_copy_is_never_written_over_by_an_eviction() {
        let far = far_sim(3 * MIB);
        let (devices, _heap, mut residency, [a, b, _c]) = setup_on(far.clone());
        let usage = a.usage.clone();
        a.in_use.fetch_add(1, Ordering::AcqRel);
        assert!(!a.claim_host(), "a task uses it");
        a.in_use.fetch_sub(1, Ordering::AcqRel);
        // a (least recently used, only valid on the device) is being written home.
        assert!(!residency.make_room(&devices, 0, MIB, &usage, 0));
        assert!(!a.claim_host(), "its write-back is in flight");
        far.answer_reads(Ok(()));
        assert_eq!(residency.finish_write_backs(&devices), 1);
        assert!(a.claim_host());
        // Home, a's host copy is current: a claim beside a task that reads it (a shared buffer's
        // reader) is granted at once, as nothing newer is anywhere to discard.
        a.in_use.fetch_add(1, Ordering::AcqRel);
        assert!(a.claim_host(), "the host copy is current");
        a.in_use.fetch_sub(1, Ordering::AcqRel);
        // b's only valid copy is on the device; claimed, it is evicted without a write-back.
        assert!(!b.placement().host_valid);
        assert!(b.claim_host());
        assert!(b.placement().host_valid && b.placement().owner().is_none());
        assert!(b.placement().is_on(0), "its (stale) allocation stays until evicted");
        let reads = far.reads.lock().unwrap().len();
        assert!(residency.make_room(&devices, 0, 2 * MIB, &usage, 0));
        assert_eq!(far.reads.lock().unwrap().len(), reads, "nothing written home");
        assert!(b.placement().host_valid && !b.placement().is_on(0), "evicted");
    }
}
