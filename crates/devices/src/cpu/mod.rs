//! The CPU device: worker threads partitioned into lanes.
//!
//! Each lane is a *gang* of `threads_per_lane` threads. The lane's thread takes the next job; a
//! kernel launch is split by rows of its first dimension into one stripe per thread (the lane
//! thread runs stripe 0, helpers the rest) and the job completes when every stripe is done. So
//! one lane runs one job at a time, in order, using all its threads. The CPU device computes on
//! host memory (the session segments) in place: it has no memory of its own.
//!
//! With private copies ([`CpuDevice::with_private_copies`], the daemon's strict coherence mode)
//! it behaves like a device with memory of its own instead: it allocates a private host
//! allocation per buffer ([`PrivateCopy`]), computes on those, and data moves between them and
//! the session segments only by the transfers the daemon plans, exactly as on OpenCL. So a
//! program that forgets a `sync_to` or `sync_from` sees stale data on the CPU too.

mod gang;

use std::alloc::Layout;
use std::borrow::Cow;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;

use agora_kernels::{ArgValue, CpuImpl, KernelCall, KernelDef};
use agora_protocol::TaskError;

use crate::lane::{run_synchronously, Executor, JobEnd, Lane, Lanes};
use crate::priority::{LaneClass, LanePriorities};
use crate::{Device, DeviceBuffer, DeviceInfo, DeviceKind, DeviceReport, Job, Transfer, Work};
use gang::Gang;

/// The CPU device.
#[derive(Debug)]
pub struct CpuDevice {
    info: DeviceInfo,
    lanes: Lanes,
    /// Bytes of private copies allocated now (with private copies).
    private_bytes: Arc<AtomicU64>,
}

/// A private host allocation standing in for device memory of the CPU (strict coherence): 64-byte
/// aligned like the session heap, zeroed, freed with its last reference.
#[derive(Debug)]
pub struct PrivateCopy {
    ptr: std::ptr::NonNull<u8>,
    layout: Layout,
    len: u64,
    accounted: Arc<AtomicU64>,
}

// SAFETY: the allocation is owned by this value; the daemon orders every access to it (transfers
// and launches of one buffer run in plan order), as it does for session memory.
unsafe impl Send for PrivateCopy {}
// SAFETY: as above.
unsafe impl Sync for PrivateCopy {}

impl PrivateCopy {
    fn new(len: u64, accounted: Arc<AtomicU64>) -> Option<Self> {
        let layout = Layout::from_size_align(usize::try_from(len.max(1)).ok()?, 64).ok()?;
        // SAFETY: the layout has a non-zero size.
        let ptr = std::ptr::NonNull::new(unsafe { std::alloc::alloc_zeroed(layout) })?;
        accounted.fetch_add(len, Ordering::Relaxed);
        Some(PrivateCopy {
            ptr,
            layout,
            len,
            accounted,
        })
    }

    /// Its first byte.
    fn ptr(&self) -> *mut u8 {
        self.ptr.as_ptr()
    }
}

impl Drop for PrivateCopy {
    fn drop(&mut self) {
        self.accounted.fetch_sub(self.len, Ordering::Relaxed);
        // SAFETY: allocated in `new` with this layout, freed once.
        unsafe { std::alloc::dealloc(self.ptr.as_ptr(), self.layout) };
    }
}

impl DeviceBuffer for PrivateCopy {
    fn len(&self) -> u64 {
        self.len
    }

    fn as_any(&self) -> &dyn std::any::Any {
        self
    }
}

/// The private copy `buffer` is, if it is one (a scheduler bug otherwise: a task error).
fn private(buffer: &dyn DeviceBuffer) -> Result<&PrivateCopy, TaskError> {
    buffer
        .as_any()
        .downcast_ref::<PrivateCopy>()
        .ok_or(TaskError::KernelFault)
}

/// Copies `len` host bytes at `host` into the private copy `to`.
fn copy_in(host: *const u8, len: usize, to: &dyn DeviceBuffer) -> Result<(), TaskError> {
    let to = private(to)?;
    if len as u64 > to.len {
        return Err(TaskError::KernelFault);
    }
    // SAFETY: the daemon built the transfer from a live buffer's host range of `len` bytes, kept
    // mapped by the job; `to` holds at least `len` bytes (checked) and is a distinct allocation.
    unsafe { std::ptr::copy_nonoverlapping(host, to.ptr(), len) };
    Ok(())
}

/// `work` with each buffer argument that has a private copy pointed at that copy: the kernel
/// computes on the device's own memory, never on the session segment.
fn on_private_copies(work: &Work) -> Result<Cow<'_, Work>, TaskError> {
    let Work::Launch { device_args, .. } = work else {
        return Ok(Cow::Borrowed(work));
    };
    if device_args.iter().all(Option::is_none) {
        return Ok(Cow::Borrowed(work));
    }
    let mut work = work.clone();
    if let Work::Launch { args, device_args, .. } = &mut work {
        for (arg, copy) in args.iter_mut().zip(device_args.iter()) {
            let (Some(copy), ArgValue::Buffer { len, .. }) = (copy, &*arg) else {
                continue;
            };
            let copy = private(copy.as_ref())?;
            if *len > copy.len {
                return Err(TaskError::KernelFault);
            }
            *arg = ArgValue::Buffer {
                ptr: copy.ptr(),
                len: *len,
            };
        }
    }
    Ok(Cow::Owned(work))
}

struct CpuExecutor {
    gang: Gang,
}

impl Executor for CpuExecutor {
    fn run(&mut self, transfers: Vec<Transfer>, work: Work, end: JobEnd) {
        let result = run_synchronously(
            &transfers,
            &work,
            // Only private copies are device buffers of the CPU (anything else is a scheduler
            // bug, refused as a task error).
            copy_in,
            |work| {
                if !transfers.is_empty() {
                    end.transfers_done();
                }
                let work = on_private_copies(work)?;
                let work = work.as_ref();
                match end.revoke_flag() {
                    Some(flag) => execute_revocable(work, &self.gang, flag),
                    None => execute(work, Some(&self.gang)),
                }
            },
        );
        // The job's private copies are let go of before its completion is posted, so that
        // their memory is free when the dispatcher plans the next task (ARCHITECTURE.md,
        // "Eviction and quotas"); dropped after `finish`, they were still counted a moment later.
        drop((transfers, work));
        end.finish(result);
    }

    fn stop(&mut self) {
        self.gang.stop();
    }
}

impl CpuDevice {
    /// Starts `lanes` lanes of `threads_per_lane` threads each, every job at normal OS priority.
    pub fn new(lanes: usize, threads_per_lane: usize) -> std::io::Result<Self> {
        Self::with_priorities(lanes, threads_per_lane, &LanePriorities::normal())
    }

    /// Starts `lanes` lanes of `threads_per_lane` threads each, whose threads (gang helpers
    /// included) run batch jobs at the OS priority `priorities` say.
    pub fn with_priorities(
        lanes: usize,
        threads_per_lane: usize,
        priorities: &LanePriorities,
    ) -> std::io::Result<Self> {
        let lanes = lanes.max(1);
        let threads_per_lane = threads_per_lane.max(1);
        let mut handles = Vec::new();
        let mut lane_list = Vec::new();
        for index in 0..lanes {
            let class = LaneClass::new(priorities);
            let (gang, helpers) = Gang::start(index, threads_per_lane, &class)?;
            handles.extend(helpers);
            let (lane, thread) = Lane::start(format!("agora-cpu-lane{index}"), Box::new(CpuExecutor { gang }), class)?;
            lane_list.push(lane);
            handles.push(thread);
        }
        let cores = std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1);
        Ok(CpuDevice {
            info: DeviceInfo {
                name: "cpu0".to_string(),
                kind: DeviceKind::Cpu,
                description: format!("host CPU, {cores} cores"),
                memory_bytes: 0,
                lanes,
                threads_per_lane,
                shares_host_memory: true,
                // Kernels run over any row range on host memory: the wire protocol's bound on a
                // range is the only one.
                limits: crate::LaunchLimits::NONE,
                host_cores_per_lane: threads_per_lane,
            },
            lanes: Lanes::new(lane_list, handles),
            private_bytes: Arc::new(AtomicU64::new(0)),
        })
    }

    /// Makes the device compute on private copies of buffers instead of host memory (the
    /// daemon's strict coherence mode): it reports memory of its own (as much as the machine's
    /// RAM), allocates a [`PrivateCopy`] per buffer, and the daemon plans transfers to and from
    /// them as for any device with memory of its own.
    pub fn with_private_copies(mut self) -> Self {
        self.info.shares_host_memory = false;
        self.info.memory_bytes = physical_memory().unwrap_or(u64::MAX >> 1);
        self.info.description.push_str(", private copies (strict coherence)");
        self
    }

    /// A default partition of this machine's cores: one thread per lane, one lane per core.
    pub fn default_partition() -> (usize, usize) {
        let cores = std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1);
        (cores, 1)
    }
}

impl Device for CpuDevice {
    fn info(&self) -> &DeviceInfo {
        &self.info
    }

    fn implements(&self, kernel: &KernelDef) -> bool {
        match kernel.cpu {
            None => false,
            // Tenant programs run in their executor on the session's host memory: with private
            // copies the buffers are not there.
            Some(CpuImpl::External(_)) => self.info.shares_host_memory,
            Some(_) => true,
        }
    }

    fn submit(&self, lane: usize, job: Job) {
        self.lanes.submit(lane, job);
    }

    fn lane_load(&self, lane: usize) -> usize {
        self.lanes.load(lane)
    }

    fn runs_row_slices(&self) -> bool {
        true
    }

    fn polls_revocation(&self) -> bool {
        true
    }

    fn run_inline(&self, work: &Work) -> Result<(), TaskError> {
        execute(on_private_copies(work)?.as_ref(), None)
    }

    fn alloc(&self, _tenant: u64, len: u64) -> Option<Result<Arc<dyn DeviceBuffer>, TaskError>> {
        if self.info.shares_host_memory {
            return None;
        }
        Some(match PrivateCopy::new(len, self.private_bytes.clone()) {
            Some(copy) => Ok(Arc::new(copy)),
            None => Err(TaskError::DeviceOutOfMemory { index: 0, needed: len }),
        })
    }

    unsafe fn read(&self, from: &dyn DeviceBuffer, host: *mut u8, len: usize) -> Result<(), TaskError> {
        let from = private(from)?;
        if len as u64 > from.len {
            return Err(TaskError::KernelFault);
        }
        // SAFETY: the caller guarantees `host` is valid for `len` bytes of writes; `from` holds at
        // least `len` bytes (checked) in a distinct allocation.
        unsafe { std::ptr::copy_nonoverlapping(from.ptr(), host, len) };
        Ok(())
    }

    fn memory_used(&self) -> u64 {
        self.private_bytes.load(Ordering::Relaxed)
    }

    fn status(&self) -> DeviceReport {
        DeviceReport {
            name: self.info.name.clone(),
            kind: self.info.kind,
            description: self.info.description.clone(),
            memory_bytes: self.info.memory_bytes,
            memory_used: self.memory_used(),
            memory_cached: 0,
            utilization_percent: None,
            threads_per_lane: self.info.threads_per_lane,
            lanes: self.lanes.statuses(),
            failed: false,
            staged_bytes: 0,
        }
    }

    fn shutdown(&self) {
        self.lanes.shutdown();
    }
}

impl Drop for CpuDevice {
    fn drop(&mut self) {
        self.shutdown();
    }
}

/// The machine's RAM in bytes (`MemTotal` of `/proc/meminfo`).
fn physical_memory() -> Option<u64> {
    let text = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = text.lines().find(|l| l.starts_with("MemTotal:"))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    kib.checked_mul(1024)
}

/// Runs `work` on the calling thread, or split over `gang` when given.
pub(crate) fn execute(work: &Work, gang: Option<&Gang>) -> Result<(), TaskError> {
    if let Some(result) = crate::run_host_work(work) {
        return result;
    }
    match work {
        Work::Launch {
            kernel,
            range,
            dims,
            args,
            arg_count,
            rows,
            ..
        } => {
            if kernel.cpu.is_none() {
                return Err(TaskError::KernelFault);
            }
            // SAFETY: the daemon resolved every buffer argument to a live, 64-byte-aligned range
            // of the session heap kept mapped by the job, checked the launch against the kernel's
            // signature and size check, and refused written buffers passed twice.
            let call = unsafe { KernelCall::new(&range[..*dims], &args[..*arg_count]) };
            // A slice of a chunked launch runs only its rows (the kernels compute any row range:
            // gangs already split launches that way).
            let rows = rows.clone().unwrap_or(0..range[0]);
            let (first, count) = (rows.start, rows.end.saturating_sub(rows.start).min(range[0]));
            match gang {
                Some(g) if g.threads() > 1 && count > 1 && kernel.splits_among_threads() => g.run(count, &|r| {
                    if let Err(error) = kernel.run_cpu(&call, r.start + first..r.end + first) {
                        // The gang reports a panicking stripe as a kernel fault.
                        panic!("stripe failed: {error}");
                    }
                }),
                _ => run_guarded_result(&|| kernel.run_cpu(&call, first..first + count)),
            }
        }
        _ => unreachable!("host work handled above"),
    }
}

/// Blocks a revocable launch's rows are run in: the revocation flag is checked between blocks, so
/// a revocation waits for at most one block (about 1/`REVOCATION_BLOCKS` of the launch).
const REVOCATION_BLOCKS: u64 = 256;

/// Runs a launch over `gang` in blocks of rows, checking `revoke` before each block; `Cancelled`
/// when it stopped early (the rows run so far have written their outputs: the caller restores
/// what the launch may have changed before it replays it).
fn execute_revocable(work: &Work, gang: &Gang, revoke: &AtomicBool) -> Result<(), TaskError> {
    let Work::Launch { range, rows, .. } = work else {
        return execute(work, Some(gang));
    };
    let rows = rows.clone().unwrap_or(0..range[0]);
    let count = rows.end.saturating_sub(rows.start);
    let block = count.div_ceil(REVOCATION_BLOCKS).max(1);
    let mut start = rows.start;
    while start < rows.end {
        if revoke.load(Ordering::Acquire) {
            return Err(TaskError::Cancelled);
        }
        let end = (start + block).min(rows.end);
        let part = with_rows(work, start..end);
        execute(&part, Some(gang))?;
        start = end;
    }
    Ok(())
}

/// A copy of launch `work` restricted to `rows` (the same buffers: only pointers are copied).
fn with_rows(work: &Work, rows: std::ops::Range<u64>) -> Work {
    let mut part = work.clone();
    if let Work::Launch { rows: r, .. } = &mut part {
        *r = Some(rows);
    }
    part
}

/// Runs `f`, turning a panic (a kernel bug) into a task error.
pub(crate) fn run_guarded_result(f: &(dyn Fn() -> Result<(), TaskError> + Sync)) -> Result<(), TaskError> {
    let outcome = std::sync::Mutex::new(Ok(()));
    run_guarded(&|| *outcome.lock().unwrap_or_else(|e| e.into_inner()) = f())?;
    outcome.into_inner().unwrap_or_else(|e| e.into_inner())
}

/// Runs `f`, turning a panic into a kernel fault.
pub(crate) fn run_guarded(f: &(dyn Fn() + Sync)) -> Result<(), TaskError> {
    std::panic::catch_unwind(std::panic::AssertUnwindSafe(f)).map_err(|panic| {
        let message = panic
            .downcast_ref::<&str>()
            .map(|s| s.to_string())
            .or_else(|| panic.downcast_ref::<String>().cloned())
            .unwrap_or_default();
        tracing::error!(%message, "kernel panicked; failing the task");
        TaskError::KernelFault
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use agora_kernels::ArgValue;
    use agora_protocol::MAX_ARGS;
    use std::sync::mpsc;

    fn saxpy_job(x: &mut [f32], y: &mut [f32], tx: mpsc::Sender<Result<(), TaskError>>) -> Job {
        let (_, k) = agora_kernels::find("saxpy").unwrap();
        let mut args = [ArgValue::None; MAX_ARGS];
        args[0] = ArgValue::Scalar(u64::from(2.0f32.to_bits()));
        args[1] = ArgValue::Buffer {
            ptr: x.as_mut_ptr() as *mut u8,
            len: (x.len() * 4) as u64,
        };
        args[2] = ArgValue::Buffer {
            ptr: y.as_mut_ptr() as *mut u8,
            len: (y.len() * 4) as u64,
        };
        Job {
            transfers: Vec::new(),
            work: Work::Launch {
                kernel: k.into(),
                range: [y.len() as u64, 1, 1],
                dims: 1,
                args,
                arg_count: 3,
                device_args: Default::default(),
                rows: None,
            },
            keepalive: None,
            cancelled: None,
            revoke: None,
            urgent: false,
            exclusive: false,
            deadline: None,
            slices: None,
            share: crate::Share::default(),
            done: Box::new(move |r, _| tx.send(r).unwrap()),
        }
    }

    #[test]
    fn lanes_run_jobs_in_order_with_gangs() {
        for threads in [1, 3] {
            let dev = CpuDevice::new(2, threads).unwrap();
            let mut x = vec![1.0f32; 100_003];
            let mut y = vec![0.0f32; 100_003];
            let (tx, rx) = mpsc::channel();
            for _ in 0..10 {
                dev.submit(1, saxpy_job(&mut x, &mut y, tx.clone()));
            }
            for _ in 0..10 {
                rx.recv().unwrap().unwrap();
            }
            assert!(
                y.iter().all(|v| *v == 20.0),
                "10 ordered saxpy steps on {threads} threads"
            );
            assert_eq!(dev.status().lanes[1].completed, 10);
            dev.shutdown();
        }
    }

    #[test]
    fn cancelled_jobs_do_not_run() {
        let dev = CpuDevice::new(1, 1).unwrap();
        let mut x = vec![1.0f32; 8];
        let mut y = vec![0.0f32; 8];
        let (tx, rx) = mpsc::channel();
        let mut job = saxpy_job(&mut x, &mut y, tx);
        job.cancelled = Some(Arc::new(std::sync::atomic::AtomicBool::new(true)));
        dev.submit(0, job);
        assert_eq!(rx.recv().unwrap(), Err(TaskError::Cancelled));
        assert!(y.iter().all(|v| *v == 0.0));
    }

    #[test]
    fn a_revoked_launch_stops_early_and_an_unrevoked_one_completes() {
        for threads in [1, 2] {
            let dev = CpuDevice::new(1, threads).unwrap();
            assert!(dev.polls_revocation());
            let n = 16 << 20;
            let mut x = vec![1.0f32; n];
            let mut y = vec![0.0f32; n];
            // Not revoked: the flag is there but never set; the result is complete.
            let (tx, rx) = mpsc::channel();
            let mut job = saxpy_job(&mut x, &mut y, tx.clone());
            job.revoke = Some(crate::Revocation {
                flag: Arc::new(std::sync::atomic::AtomicBool::new(false)),
                save: None,
                replay: false,
            });
            dev.submit(0, job);
            assert_eq!(rx.recv().unwrap(), Ok(()));
            assert!(y.iter().all(|v| *v == 2.0));
            // Revoked while it runs: it stops at a block boundary, leaving later rows unwritten.
            // A launch that finishes before this thread sees it running cannot be revoked: try
            // again (before, the test spun forever then).
            let mut revoked = false;
            for _attempt in 0..20 {
                let last_before = y[n - 1];
                let flag = Arc::new(std::sync::atomic::AtomicBool::new(false));
                let mut job = saxpy_job(&mut x, &mut y, tx.clone());
                job.revoke = Some(crate::Revocation {
                    flag: flag.clone(),
                    save: None,
                    replay: false,
                });
                dev.submit(0, job);
                let mut finished_early = false;
                while !dev.status().lanes[0].busy {
                    if rx.try_recv().is_ok() {
                        finished_early = true;
                        break;
                    }
                    std::hint::spin_loop();
                }
                if finished_early {
                    continue;
                }
                flag.store(true, std::sync::atomic::Ordering::Release);
                assert_eq!(rx.recv().unwrap(), Err(TaskError::Cancelled));
                assert_eq!(y[n - 1], last_before, "rows after the revocation stay unwritten");
                revoked = true;
                break;
            }
            assert!(revoked, "the launch was never seen running");
            dev.shutdown();
        }
    }

    #[test]
    fn with_private_copies_kernels_compute_on_the_copies_not_on_host_memory() {
        let dev = CpuDevice::new(1, 2).unwrap().with_private_copies();
        assert!(!dev.info().shares_host_memory && dev.info().memory_bytes > 0);
        let n = 1000;
        let mut x = vec![1.0f32; n];
        let mut y = vec![5.0f32; n];
        let bytes = (n * 4) as u64;
        let x_copy = dev.alloc(1, bytes).unwrap().unwrap();
        let y_copy = dev.alloc(1, bytes).unwrap().unwrap();
        assert_eq!(dev.memory_used(), 2 * bytes);
        let (tx, rx) = mpsc::channel();
        let mut job = saxpy_job(&mut x, &mut y, tx.clone());
        job.transfers = vec![
            Transfer::ToDevice {
                host: x.as_ptr() as *const u8,
                len: bytes as usize,
                to: x_copy.clone(),
            },
            Transfer::ToDevice {
                host: y.as_ptr() as *const u8,
                len: bytes as usize,
                to: y_copy.clone(),
            },
        ];
        if let Work::Launch { device_args, .. } = &mut job.work {
            device_args[1] = Some(x_copy.clone());
            device_args[2] = Some(y_copy.clone());
        }
        dev.submit(0, job);
        assert_eq!(rx.recv().unwrap(), Ok(()));
        assert!(y.iter().all(|v| *v == 5.0), "host memory is not written by the kernel");
        // Reading the copy back is what makes the result visible.
        // SAFETY: y holds `bytes` bytes; no job uses the copy any more.
        unsafe { dev.read(y_copy.as_ref(), y.as_mut_ptr() as *mut u8, bytes as usize) }.unwrap();
        assert!(y.iter().all(|v| *v == 7.0));
        // A buffer that is not a private copy is refused, not dereferenced.
        let mut plain = CpuDevice::new(1, 1).unwrap();
        assert!(plain.alloc(1, 8).is_none());
        plain = plain.with_private_copies();
        drop((x_copy, y_copy));
        assert_eq!(dev.memory_used(), 0);
        plain.shutdown();
        dev.shutdown();
    }

    #[test]
    fn a_panicking_kernel_is_a_task_error_not_a_crash() {
        let r = run_guarded(&|| panic!("boom"));
        assert_eq!(r, Err(TaskError::KernelFault));
    }
}
