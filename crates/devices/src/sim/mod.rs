//! `sim` devices: modeled accelerators for scale tests and scheduler experiments.
//!
//! A sim device has memory of its own (host RAM standing in for device memory, accounted against
//! its configured size) and lanes like any device. A kernel runs the library's CPU implementation
//! on the device's copies of the buffers, so results are exact, and the job then completes when
//! its **modeled** time has passed since it started: `launch_ns + ns_per_item × items` from the
//! device's per-kernel profile. A job whose real computation takes longer than the model says
//! completes when the computation is done, so keep modeled times above what the host needs (or
//! give the device few lanes). Transfers are timed the same way from a modeled bandwidth.
//!
//! Launch limits: none (the wire protocol bounds ranges), unless [`SimSpec::limits`] models a
//! device with some; the daemon then splits or places launches as for any device.
//!
//! Fault injection: with [`SimSpec::fail_after_jobs`] set to N, the device runs N jobs and then
//! fails for good, as a real device that falls off the bus would: [`Device::healthy`] turns false
//! and every later job (queued or new, transfers included) and every read completes with
//! [`TaskError::DeviceLost`] without touching memory. The daemon's failure path is tested with it.
//!
//! It is not a substitute for a real backend: it exists so the scheduler's policies can be
//! exercised with devices that differ in speed, memory and power (DESIGN.md, heterogeneous
//! scheduling), on a machine that has one CPU and PoCL.

use std::any::Any;
use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use agora_kernels::{ArgValue, CpuImpl, KernelCall, KernelDef};
use agora_protocol::{TaskError, MAX_ARGS};

use crate::lane::{run_synchronously, Executor, JobEnd, Lane, Lanes};
use crate::{Device, DeviceBuffer, DeviceInfo, DeviceKind, DeviceReport, Job, Transfer, Work};

/// How long one kernel takes on a sim device.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct KernelProfile {
    /// Fixed cost per launch, in nanoseconds.
    pub launch_ns: f64,
    /// Cost per work item (the product of the launch range), in nanoseconds.
    pub ns_per_item: f64,
}

/// What a sim device is.
#[derive(Debug, Clone)]
pub struct SimSpec {
    /// Name, e.g. `sim0`.
    pub name: String,
    /// Lanes.
    pub lanes: usize,
    /// Device memory in bytes.
    pub memory_bytes: u64,
    /// Speed relative to one CPU core: a kernel without a profile entry takes the library's cost
    /// estimate (per CPU core) divided by this.
    pub speed: f64,
    /// Fixed cost of every launch without a profile entry, in nanoseconds.
    pub launch_ns: f64,
    /// Per-kernel profiles (by kernel name); they override `speed`.
    pub profile: HashMap<String, KernelProfile>,
    /// Kernels it implements; `None`: every kernel with a CPU implementation.
    pub kernels: Option<Vec<String>>,
    /// Host link bandwidth in bytes per second.
    pub bandwidth: f64,
    /// Fault injection: the device fails for good after running this many jobs.
    pub fail_after_jobs: Option<u64>,
    /// Fault injection: the memory its runtime can really give, below `memory_bytes` (the
    /// daemon's books): allocations past it are refused, like a driver whose free memory is
    /// less than it reports (fragmentation, other processes).
    pub runtime_memory_bytes: Option<u64>,
    /// Fault injection: each allocation and each read of a buffer into host memory (a job's
    /// copy home, an eviction's write-back) is answered this late (a device whose answers are slow, as a
    /// device host busy with other tenants' transfers gives them).
    pub answer_delay: Option<std::time::Duration>,
    /// What one launch may ask of it (default: no limit), to model a device with launch limits.
    pub limits: crate::LaunchLimits,
    /// OS priority of its lane threads for batch jobs (default: normal, as latency jobs).
    pub priorities: crate::priority::LanePriorities,
}

impl Default for SimSpec {
    fn default() -> Self {
        SimSpec {
            name: "sim0".into(),
            lanes: 2,
            memory_bytes: 1 << 30,
            speed: 1.0,
            launch_ns: 5_000.0,
            profile: HashMap::new(),
            kernels: None,
            bandwidth: 10e9,
            fail_after_jobs: None,
            runtime_memory_bytes: None,
            answer_delay: None,
            limits: crate::LaunchLimits::NONE,
            priorities: crate::priority::LanePriorities::normal(),
        }
    }
}

impl SimSpec {
    /// Modeled nanoseconds of `kernel` over `items` work items.
    pub fn modeled_ns(&self, kernel: &KernelDef, items: u64) -> f64 {
        match self.profile.get(&*kernel.name) {
            Some(p) => p.launch_ns + p.ns_per_item * items as f64,
            None => self.launch_ns + kernel.estimated_ns(items) / self.speed.max(1e-9),
        }
    }
}

/// Device memory of a sim device: a host allocation, accounted against the device's size.
#[derive(Debug)]
struct SimBuffer {
    /// 64-byte aligned storage (kernels may read it as any scalar type).
    data: Box<[Aligned]>,
    len: u64,
    used: Arc<AtomicU64>,
}

#[derive(Debug, Clone, Copy)]
#[repr(C, align(64))]
struct Aligned([u8; 64]);

impl SimBuffer {
    fn ptr(&self) -> *mut u8 {
        // Kernels and transfers write through this pointer from lane threads while the buffer
        // is shared (`Arc`); the scheduler orders every access (one writer at a time), which is
        // the same contract a real device's memory has.
        self.data.as_ptr() as *mut u8
    }
}

impl Drop for SimBuffer {
    fn drop(&mut self) {
        self.used.fetch_sub(self.len, Ordering::Relaxed);
    }
}

impl DeviceBuffer for SimBuffer {
    fn len(&self) -> u64 {
        self.len
    }
    fn as_any(&self) -> &dyn Any {
        self
    }
}

/// A modeled device.
#[derive(Debug)]
pub struct SimDevice {
    info: DeviceInfo,
    spec: Arc<SimSpec>,
    lanes: Lanes,
    used: Arc<AtomicU64>,
    fault: Arc<Fault>,
}

/// The injected fault's state, shared by the device and its lanes.
#[derive(Debug, Default)]
struct Fault {
    /// Jobs started so far.
    jobs: AtomicU64,
    /// Set once the device has failed; never cleared.
    failed: AtomicBool,
}

impl Fault {
    /// Counts a job about to start; true when the device has failed (the job must not run).
    fn job_fails(&self, after: Option<u64>) -> bool {
        if self.failed.load(Ordering::Acquire) {
            return true;
        }
        let Some(after) = after else { return false };
        if self.jobs.fetch_add(1, Ordering::AcqRel) >= after {
            // Fail for good before reporting it, so whoever sees a `DeviceLost` also sees
            // `healthy() == false`.
            self.failed.store(true, Ordering::Release);
            return true;
        }
        false
    }
}

struct SimExecutor {
    spec: Arc<SimSpec>,
    fault: Arc<Fault>,
}

fn sim_buffer(buffer: &dyn DeviceBuffer) -> Result<&SimBuffer, TaskError> {
    // A buffer of another device here is a scheduler bug: fail the task, do not crash.
    buffer
        .as_any()
        .downcast_ref::<SimBuffer>()
        .ok_or(TaskError::KernelFault)
}

impl SimExecutor {
    /// Modeled nanoseconds of a job's transfers over the device's link.
    fn transfer_ns(&self, transfers: &[Transfer]) -> f64 {
        let bytes: usize = transfers.iter().map(Transfer::len).sum();
        bytes as f64 / self.spec.bandwidth.max(1.0) * 1e9
    }

    fn execute(&self, work: &Work) -> Result<f64, TaskError> {
        if let Some(result) = crate::run_host_work(work) {
            return result.map(|()| 0.0);
        }
        let Work::Launch {
            kernel,
            range,
            dims,
            args,
            arg_count,
            device_args,
            rows,
        } = work
        else {
            return Err(TaskError::KernelFault);
        };
        if kernel.cpu.is_none() {
            return Err(TaskError::KernelFault);
        }
        // Point buffer arguments at this device's copies.
        let mut local = [ArgValue::None; MAX_ARGS];
        for (index, arg) in args[..*arg_count].iter().enumerate() {
            local[index] = match (arg, &device_args[index]) {
                (ArgValue::Buffer { len, .. }, Some(buffer)) => {
                    let buffer = sim_buffer(buffer.as_ref())?;
                    ArgValue::Buffer {
                        ptr: buffer.ptr(),
                        len: (*len).min(buffer.len),
                    }
                }
                (ArgValue::Buffer { .. }, None) => return Err(TaskError::KernelFault),
                (other, _) => *other,
            };
        }
        // SAFETY: the daemon checked the launch against the kernel's signature and size check;
        // every buffer argument now points at a live, 64-byte aligned allocation of this device
        // at least as long as the host buffer it mirrors, ordered by the scheduler.
        let call = unsafe { KernelCall::new(&range[..*dims], &local[..*arg_count]) };
        let rows = rows.clone().unwrap_or(0..range[0]);
        let rows = rows.start..rows.end.min(range[0]);
        crate::cpu::run_guarded_result(&|| kernel.run_cpu(&call, rows.clone()))?;
        // A slice is modeled as its share of the launch's items.
        let items: u64 = range[1..*dims].iter().product::<u64>() * (rows.end - rows.start);
        Ok(self.spec.modeled_ns(kernel, items))
    }
}

impl Executor for SimExecutor {
    fn run(&mut self, transfers: Vec<Transfer>, work: Work, end: JobEnd) {
        if self.fault.job_fails(self.spec.fail_after_jobs) {
            drop(work);
            drop(transfers);
            end.finish(Err(TaskError::DeviceLost));
            return;
        }
        let started = Instant::now();
        let result = run_synchronously(
            &transfers,
            &work,
            |host, len, to| {
                let to = sim_buffer(to)?;
                // SAFETY: the scheduler built this transfer from a live buffer's host range of
                // `len` bytes kept mapped by the job; `to` holds at least the bytes copied.
                unsafe { std::ptr::copy_nonoverlapping(host, to.ptr(), len.min(to.len as usize)) };
                Ok(())
            },
            |work| {
                if !transfers.is_empty() {
                    wait_until(started + Duration::from_nanos(self.transfer_ns(&transfers) as u64));
                    end.transfers_done();
                }
                let work_started = Instant::now();
                let work_ns = self.execute(work)?;
                wait_until(work_started + Duration::from_nanos(work_ns as u64));
                Ok(())
            },
        );
        drop(work);
        drop(transfers);
        end.finish(result);
    }
}

/// Sleeps until `deadline` (the modeled end of a step).
fn wait_until(deadline: Instant) {
    let now = Instant::now();
    if deadline > now {
        std::thread::sleep(deadline - now);
    }
}

impl SimDevice {
    /// Starts a sim device as `spec` says.
    pub fn new(spec: SimSpec) -> std::io::Result<Self> {
        let spec = Arc::new(spec);
        let fault = Arc::new(Fault::default());
        let lanes = spec.lanes.max(1);
        let mut lane_list = Vec::new();
        let mut handles = Vec::new();
        for index in 0..lanes {
            let (lane, thread) = Lane::start(
                format!("agora-{}-lane{index}", spec.name),
                Box::new(SimExecutor {
                    spec: spec.clone(),
                    fault: fault.clone(),
                }),
                crate::priority::LaneClass::new(&spec.priorities),
            )?;
            lane_list.push(lane);
            handles.push(thread);
        }
        let kernels = match &spec.kernels {
            Some(list) => format!("{} kernels", list.len()),
            None => "every kernel".to_string(),
        };
        Ok(SimDevice {
            info: DeviceInfo {
                name: spec.name.clone(),
                kind: DeviceKind::Sim,
                lanes,
                threads_per_lane: 1,
                description: format!(
                    "simulated device, {:.1}x a CPU core, {kernels}, {} MiB",
                    spec.speed,
                    spec.memory_bytes >> 20
                ),
                memory_bytes: spec.memory_bytes,
                shares_host_memory: false,
                limits: spec.limits,
                host_cores_per_lane: 0,
            },
            spec,
            lanes: Lanes::new(lane_list, handles),
            used: Arc::new(AtomicU64::new(0)),
            fault,
        })
    }

    /// Its specification.
    pub fn spec(&self) -> &SimSpec {
        &self.spec
    }
}

impl Device for SimDevice {
    fn info(&self) -> &DeviceInfo {
        &self.info
    }

    fn implements(&self, kernel: &KernelDef) -> bool {
        // A kernel that runs outside the daemon computes on host memory, not on this model.
        matches!(kernel.cpu, Some(CpuImpl::Builtin(_) | CpuImpl::Native(..)))
            && self
                .spec
                .kernels
                .as_ref()
                .is_none_or(|list| list.iter().any(|k| *k == kernel.name))
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

    fn memory_used(&self) -> u64 {
        self.used.load(Ordering::Relaxed)
    }

    fn run_inline(&self, _work: &Work) -> Result<(), TaskError> {
        // Only devices that share host memory run work inline.
        Err(TaskError::KernelFault)
    }

    fn alloc(&self, _tenant: u64, len: u64) -> Option<Result<Arc<dyn DeviceBuffer>, TaskError>> {
        if let Some(delay) = self.spec.answer_delay {
            std::thread::sleep(delay);
        }
        if !self.healthy() {
            return Some(Err(TaskError::DeviceLost));
        }
        let used = self.used.fetch_add(len, Ordering::Relaxed) + len;
        if used
            > self
                .spec
                .memory_bytes
                .min(self.spec.runtime_memory_bytes.unwrap_or(u64::MAX))
        {
            self.used.fetch_sub(len, Ordering::Relaxed);
            return Some(Err(TaskError::DeviceOutOfMemory { index: 0, needed: len }));
        }
        let blocks = (len as usize).div_ceil(64).max(1);
        let buffer = SimBuffer {
            data: vec![Aligned([0; 64]); blocks].into_boxed_slice(),
            len,
            used: self.used.clone(),
        };
        Some(Ok(Arc::new(buffer)))
    }

    unsafe fn read(&self, from: &dyn DeviceBuffer, host: *mut u8, len: usize) -> Result<(), TaskError> {
        if let Some(delay) = self.spec.answer_delay {
            std::thread::sleep(delay);
        }
        if !self.healthy() {
            // Its memory is gone with it.
            return Err(TaskError::DeviceLost);
        }
        let from = sim_buffer(from)?;
        let len = len.min(from.len as usize);
        // SAFETY: the caller guarantees `host` is valid for `len` bytes; `from` holds them.
        unsafe { std::ptr::copy_nonoverlapping(from.ptr(), host, len) };
        Ok(())
    }

    fn status(&self) -> DeviceReport {
        DeviceReport {
            name: self.info.name.clone(),
            kind: self.info.kind,
            description: self.info.description.clone(),
            memory_bytes: self.info.memory_bytes,
            memory_used: self.used.load(Ordering::Relaxed),
            memory_cached: 0,
            utilization_percent: None,
            threads_per_lane: 1,
            lanes: self.lanes.statuses(),
            failed: !self.healthy(),
            staged_bytes: 0,
        }
    }

    fn healthy(&self) -> bool {
        !self.fault.failed.load(Ordering::Acquire)
    }

    fn shutdown(&self) {
        self.lanes.shutdown();
    }
}

impl Drop for SimDevice {
    fn drop(&mut self) {
        self.shutdown();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::mpsc;

    fn submit_saxpy(dev: &SimDevice, x: &Arc<dyn DeviceBuffer>, y: &Arc<dyn DeviceBuffer>, n: u64) -> Duration {
        let (_, k) = agora_kernels::find("saxpy").unwrap();
        let mut args = [ArgValue::None; MAX_ARGS];
        args[0] = ArgValue::Scalar(u64::from(2.0f32.to_bits()));
        args[1] = ArgValue::Buffer {
            ptr: std::ptr::null_mut(),
            len: n * 4,
        };
        args[2] = ArgValue::Buffer {
            ptr: std::ptr::null_mut(),
            len: n * 4,
        };
        let mut device_args: [Option<Arc<dyn DeviceBuffer>>; MAX_ARGS] = Default::default();
        device_args[1] = Some(x.clone());
        device_args[2] = Some(y.clone());
        let (tx, rx) = mpsc::channel();
        let started = Instant::now();
        dev.submit(
            0,
            Job {
                transfers: Vec::new(),
                work: Work::Launch {
                    kernel: k.into(),
                    range: [n, 1, 1],
                    dims: 1,
                    args,
                    arg_count: 3,
                    device_args,
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
            },
        );
        rx.recv().unwrap().unwrap();
        started.elapsed()
    }

    #[test]
    fn computes_exactly_on_its_own_memory_and_takes_the_modeled_time() {
        let mut spec = SimSpec {
            memory_bytes: 1 << 20,
            ..SimSpec::default()
        };
        spec.profile.insert(
            "saxpy".into(),
            KernelProfile {
                launch_ns: 1e6,
                ns_per_item: 10_000.0,
            },
        );
        let dev = SimDevice::new(spec).unwrap();
        let n = 1000u64;
        let x = dev.alloc(1, n * 4).unwrap().unwrap();
        let y = dev.alloc(1, n * 4).unwrap().unwrap();
        let host_x: Vec<f32> = (0..n).map(|i| i as f32).collect();
        let host_y = vec![1.0f32; n as usize];
        for (host, buffer) in [(&host_x, &x), (&host_y, &y)] {
            let b = sim_buffer(buffer.as_ref()).unwrap();
            // SAFETY: both sides hold n*4 bytes.
            unsafe { std::ptr::copy_nonoverlapping(host.as_ptr() as *const u8, b.ptr(), (n * 4) as usize) };
        }
        let took = submit_saxpy(&dev, &x, &y, n);
        // Modeled: 1 ms + 1000 × 10 µs = 11 ms.
        assert!(took >= Duration::from_millis(11), "{took:?}");
        let mut out = vec![0f32; n as usize];
        // SAFETY: out holds n*4 bytes.
        unsafe {
            dev.read(y.as_ref(), out.as_mut_ptr() as *mut u8, (n * 4) as usize)
                .unwrap()
        };
        assert!(out.iter().enumerate().all(|(i, v)| *v == 2.0 * i as f32 + 1.0));
        dev.shutdown();
    }

    #[test]
    fn memory_is_accounted_and_limited() {
        let dev = SimDevice::new(SimSpec {
            memory_bytes: 1000,
            ..SimSpec::default()
        })
        .unwrap();
        let a = dev.alloc(1, 600).unwrap().unwrap();
        assert_eq!(dev.status().memory_used, 600);
        assert_eq!(
            dev.alloc(1, 600).unwrap().unwrap_err(),
            TaskError::DeviceOutOfMemory { index: 0, needed: 600 }
        );
        drop(a);
        assert_eq!(dev.status().memory_used, 0);
        assert!(dev.alloc(1, 600).unwrap().is_ok());
    }

    #[test]
    fn an_injected_fault_fails_every_later_job_and_read() {
        let dev = SimDevice::new(SimSpec {
            fail_after_jobs: Some(1),
            ..SimSpec::default()
        })
        .unwrap();
        let x = dev.alloc(1, 4000).unwrap().unwrap();
        let y = dev.alloc(1, 4000).unwrap().unwrap();
        submit_saxpy(&dev, &x, &y, 1000);
        assert!(dev.healthy());
        let (tx, rx) = mpsc::channel();
        dev.submit(
            1,
            Job {
                transfers: Vec::new(),
                work: Work::Nothing,
                keepalive: None,
                cancelled: None,
                revoke: None,
                urgent: false,
                exclusive: false,
                deadline: None,
                slices: None,
                share: crate::Share::default(),
                done: Box::new(move |r, _| tx.send(r).unwrap()),
            },
        );
        assert_eq!(rx.recv().unwrap(), Err(TaskError::DeviceLost));
        assert!(!dev.healthy() && dev.status().failed);
        let mut out = [0u8; 16];
        // SAFETY: out holds 16 bytes.
        let read = unsafe { dev.read(x.as_ref(), out.as_mut_ptr(), 16) };
        assert_eq!(read, Err(TaskError::DeviceLost));
        assert!(matches!(dev.alloc(1, 16), Some(Err(TaskError::DeviceLost))));
    }

    #[test]
    fn implements_only_the_kernels_it_lists() {
        let dev = SimDevice::new(SimSpec {
            kernels: Some(vec!["saxpy".into()]),
            ..SimSpec::default()
        })
        .unwrap();
        assert!(dev.implements(agora_kernels::find("saxpy").unwrap().1));
        assert!(!dev.implements(agora_kernels::find("sgemm").unwrap().1));
    }
}
