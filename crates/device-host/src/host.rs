//! The device host's side: the `agora device-host` process that owns devices for the daemon:
//! one OpenCL platform's, one GPU's (`--platform cuda:N`), or, in tests of this very mechanism,
//! a `sim` device with an injected fault.
//!
//! It maps the segments the daemon sends (by memfd), keeps the buffers the daemon allocates by
//! id, and turns each [`Submit`] into a job on the real device's lane, whose
//! completion goes back as [`Reply::Done`]. It trusts the daemon (its parent, which started it on
//! a private socketpair) but still checks every segment range before it touches memory, so a
//! daemon bug cannot become a stray write here.
//!
//! A device that turns unhealthy (a GPU whose context a kernel fault made unusable for every
//! stream in it) ends the process: it says so ([`Reply::Exiting`], so the daemon takes the device as
//! failed before the next answer), the job that met the fault is answered with its error, then the
//! host exits with [`FAULT_EXIT_CODE`], so the daemon fails the host's other jobs as lost
//! (and replays them from their host copies) and starts a new host with a fresh context.
//!
//! Must not: schedule, reorder or retry anything (the daemon's lanes did); outlive the daemon
//! (the parent-death signal and the socket's end both stop it); answer anything after a fault.

use std::any::Any;
use std::collections::HashMap;
use std::os::fd::AsFd;
use std::os::unix::net::UnixStream;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use agora_devices::priority::LanePriorities;
use agora_devices::{Device, DeviceBuffer, Job, JobTimes, Revocation, Transfer, Work};
use agora_kernels::{
    ArgValue, Cost, CudaCode, CudaImpl, KernelDef, KernelRef, OpenClBinary, OpenClImpl, Param, SizeCheck,
};
use agora_protocol::{DeviceKind, TaskError, MAX_ARGS};
use agora_transport::socket::send;
use agora_transport::TransportError;
use memmap2::MmapRaw;

use crate::disposal::{Disposal, MIN_BUFFER_BYTES};
use crate::wire::{ArgWire, DeviceWire, HostRef, KernelWire, Reply, Request, Submit, TransferWire, WorkWire, PROTOCOL};

/// The exit code of a host whose device faulted (its context is unusable): the daemon says so
/// in its log and starts a new host.
pub const FAULT_EXIT_CODE: i32 = 70;

/// Places of [`TaskError::Internal`] for a request the host cannot follow because the daemon
/// named a device, lane, buffer, segment range or kernel it does not have. Each is a bug of the
/// daemon's side of the link, never of the task or its kernel: a `KernelFault` would send the
/// user looking for a bug in their kernel (and a GPU's is never replayed).
pub const LINK_NO_DEVICE: u16 = 40;
/// See [`LINK_NO_DEVICE`]: a lane the device does not have.
pub const LINK_NO_LANE: u16 = 41;
/// See [`LINK_NO_DEVICE`]: a buffer never allocated here (or freed).
pub const LINK_NO_BUFFER: u16 = 42;
/// See [`LINK_NO_DEVICE`]: a host range outside every mapped segment.
pub const LINK_OUTSIDE_SEGMENT: u16 = 43;
/// See [`LINK_NO_DEVICE`]: a kernel never defined on the link, or a launch of impossible shape.
pub const LINK_NO_KERNEL: u16 = 44;
/// On the daemon's side: the host answered a request with a reply of another kind.
pub const LINK_WRONG_REPLY: u16 = 45;
/// On the daemon's side: a device was handed a buffer of another device.
pub const LINK_FOREIGN_BUFFER: u16 = 46;

/// The error for a request naming what the host lacks ([`LINK_NO_DEVICE`] and the rest), with a
/// line for the daemon's log (the host logs to its standard error, the daemon's).
fn link_bug(place: u16, what: &str) -> TaskError {
    tracing::error!(
        place,
        what,
        "internal error: a request the device host cannot follow, a bug of the daemon's side of the link; please report it with this line"
    );
    TaskError::Internal(place)
}

/// The `--platform` of a host that serves GPU `N`: `cuda:N`.
pub const CUDA_PLATFORM_PREFIX: &str = "cuda:";

/// The `--platform` of a host that serves a `sim` device (tests of the host's fault path).
pub const SIM_PLATFORM: &str = "sim";

/// What the daemon asks the host to serve.
#[derive(Debug, Clone)]
pub struct HostArgs {
    /// An OpenCL platform's name (`CL_PLATFORM_NAME`), `cuda:N` for the GPU of driver ordinal
    /// `N`, or `sim`.
    pub platform: String,
    /// Lanes (command queues, streams) per device.
    pub lanes: usize,
    /// Device memory limit in bytes (0: the device's own size).
    pub memory_limit: u64,
    /// How long a tenant's fenced GPU kernel may run (`None`: no limit).
    pub tenant_launch_limit: Option<Duration>,
    /// For `sim`: its name.
    pub sim_name: String,
    /// For `sim`: it fails for good after this many jobs (its fault, injected).
    pub sim_fail_after_jobs: Option<u64>,
    /// For `sim`: each allocation and read is answered this late (an injected slowness).
    pub sim_answer_delay: Option<Duration>,
    /// Run the message loop under `SCHED_FIFO` (the daemon's `dispatcher_realtime`): the loop
    /// answers the dispatcher's synchronous requests (an allocation), which must not wait for a
    /// core behind tenants' threads.
    pub loop_realtime: bool,
}

impl Default for HostArgs {
    fn default() -> Self {
        HostArgs {
            platform: String::new(),
            lanes: 2,
            memory_limit: 0,
            tenant_launch_limit: None,
            sim_name: "sim0".into(),
            sim_fail_after_jobs: None,
            sim_answer_delay: None,
            loop_realtime: false,
        }
    }
}

/// Prints the GPUs, one `cuda:N` per line (`agora device-host --list-gpus`): the daemon starts
/// one host for each without loading the CUDA driver itself. Where there are none, prints why
/// on standard error and nothing on standard output.
pub fn list_gpus() -> i32 {
    #[cfg(feature = "cuda")]
    match agora_devices::cuda::gpu_count() {
        Ok(count) => {
            for ordinal in 0..count {
                println!("{CUDA_PLATFORM_PREFIX}{ordinal}");
            }
        }
        Err(why) => eprintln!("{why}"),
    }
    #[cfg(not(feature = "cuda"))]
    eprintln!("this agora was built without the cuda feature: no GPU devices");
    0
}

/// Prints the installed OpenCL platforms, one name per line (`agora device-host --list`): the
/// daemon starts one host for each without loading OpenCL itself.
pub fn list_platforms() -> i32 {
    match agora_devices::opencl::platform_names() {
        Ok(names) => {
            for name in names {
                println!("{name}");
            }
            0
        }
        Err(e) => {
            eprintln!("{e}");
            2
        }
    }
}

/// Serves the daemon on `socket` until it closes it. Errors are for the process's exit message.
pub fn serve(socket: UnixStream, args: &HostArgs) -> Result<(), String> {
    let writer = Arc::new(Writer(Mutex::new(
        socket.try_clone().map_err(|e| format!("cloning the socket: {e}"))?,
    )));
    if args.loop_realtime {
        // Before any thread starts: threads this one starts do not inherit it.
        match agora_devices::priority::make_current_thread_realtime() {
            Ok(()) => tracing::info!("the message loop runs under SCHED_FIFO"),
            Err(why) => tracing::warn!("loop_realtime not applied ({why}); the message loop runs at normal priority"),
        }
    }
    if !crate::readers_spin() {
        // The lanes here are fed by the message loop, which blocks on the socket: a lane that
        // spins for its next job catches it no sooner and holds a core the loop needs.
        agora_devices::lane::set_idle_spin(false);
    }
    // Every job comes from the message loop below, in the order the daemon's lanes chose: an idle
    // lane's job starts on the loop's thread, one wake-up less per job (an enqueue; a job that
    // must wait, and one behind another, still goes through the lane's thread).
    // `AGORA_DEVICE_HOST_START_ON_CALLER=0` turns it off, for comparison.
    agora_devices::lane::set_start_on_caller(
        std::env::var_os("AGORA_DEVICE_HOST_START_ON_CALLER").is_none_or(|v| v != "0"),
    );
    let (started, problems) = start_devices(args)?;
    let (devices, wires): (Vec<_>, Vec<_>) = started.into_iter().unzip();
    writer.send(&Reply::Ready {
        protocol: PROTOCOL,
        devices: wires,
        problems,
    });
    start_load_reports(&devices, &writer);
    let mut host = Host {
        devices,
        buffers: HashMap::new(),
        segments: HashMap::new(),
        kernels: HashMap::new(),
        revocations: Arc::default(),
        writer,
        disposal: Disposal::start(),
    };
    let mut frames = crate::FrameReader::new();
    let outcome = loop {
        match frames.next::<Request>(&socket) {
            Ok(request) => {
                let fd = matches!(request, Request::MapSegment { .. })
                    .then(|| frames.take_fd())
                    .flatten();
                host.handle(request, fd);
            }
            Err(TransportError::Closed) => break Ok(()),
            Err(e) => break Err(format!("reading from the daemon: {e}")),
        }
    };
    host.disposal.flush();
    for device in &host.devices {
        device.shutdown();
    }
    outcome
}

/// Starts the devices `args` names, each with what the daemon needs to know of it.
type Started = Vec<(Arc<dyn Device>, DeviceWire)>;

fn start_devices(args: &HostArgs) -> Result<(Started, Vec<String>), String> {
    if let Some(ordinal) = args.platform.strip_prefix(CUDA_PLATFORM_PREFIX) {
        let ordinal: usize = ordinal
            .parse()
            .map_err(|_| format!("--platform {}: not a GPU ordinal", args.platform))?;
        return Ok(start_gpu(ordinal, args));
    }
    if args.platform == SIM_PLATFORM {
        let spec = agora_devices::sim::SimSpec {
            name: args.sim_name.clone(),
            lanes: args.lanes,
            memory_bytes: if args.memory_limit == 0 {
                1 << 30
            } else {
                args.memory_limit
            },
            fail_after_jobs: args.sim_fail_after_jobs,
            answer_delay: args.sim_answer_delay,
            ..Default::default()
        };
        let device = agora_devices::sim::SimDevice::new(spec).map_err(|e| format!("starting the sim device: {e}"))?;
        let wire = describe(&device, false);
        return Ok((vec![(Arc::new(device) as Arc<dyn Device>, wire)], Vec::new()));
    }
    let (found, problems) =
        agora_devices::opencl::discover_except(args.lanes, args.memory_limit, &LanePriorities::normal(), &|platform| {
            platform != args.platform
        });
    let started = found
        .into_iter()
        .map(|device| {
            let wire = describe(&device, false);
            (Arc::new(device) as Arc<dyn Device>, wire)
        })
        .collect();
    Ok((
        started,
        problems.into_iter().filter(|p| !p.contains("left out")).collect(),
    ))
}

#[cfg(feature = "cuda")]
fn start_gpu(ordinal: usize, args: &HostArgs) -> (Started, Vec<String>) {
    let (found, problems) = agora_devices::cuda::discover_one(
        ordinal,
        args.lanes,
        args.memory_limit,
        &LanePriorities::normal(),
        args.tenant_launch_limit,
    );
    let started = found
        .into_iter()
        .map(|device| {
            let wire = describe(&device, device.runs_tenant_programs());
            (Arc::new(device) as Arc<dyn Device>, wire)
        })
        .collect();
    (started, problems)
}

#[cfg(not(feature = "cuda"))]
fn start_gpu(_ordinal: usize, _args: &HostArgs) -> (Started, Vec<String>) {
    (
        Vec::new(),
        vec!["this agora was built without the cuda feature: no GPU devices".into()],
    )
}

fn describe(device: &dyn Device, runs_tenant_programs: bool) -> DeviceWire {
    let info = device.info();
    let l = info.limits;
    DeviceWire {
        kind: info.kind,
        description: info.description.clone(),
        memory_bytes: info.memory_bytes,
        lanes: info.lanes as u32,
        polls_revocation: device.polls_revocation(),
        runs_tenant_programs,
        wants_page_locked: device.wants_pinned_host_memory(),
        min_items_per_slice: device.min_items_per_slice(),
        limits: [
            l.max_items,
            l.max_extent[0],
            l.max_extent[1],
            l.max_extent[2],
            l.max_items_per_enqueue,
            l.max_groups_per_enqueue,
            l.max_group[0],
            l.max_group[1],
            l.max_group[2],
            l.max_group_items,
            l.max_buffer_bytes,
        ],
        host_cores_per_lane: info.host_cores_per_lane as u32,
    }
}

/// Set by the first answer after a fault (a job's, or a read's or allocation's): nothing is
/// answered after it, and whoever set it ends the process once its answer went. So the job that
/// met the fault is answered with its own error (a GPU: `KernelFault`, never replayed), not
/// failed as lost with the others (which the daemon replays).
static FAULTED: AtomicBool = AtomicBool::new(false);

/// Ends the host after `device` faulted (see the module's doc). `_exit`: the driver's exit
/// handlers may wait on a context that will never answer again.
fn exit_after_fault(device: &dyn Device) -> ! {
    FAULTED.store(true, Ordering::Release);
    eprintln!(
        "agora device-host: {} faulted and is unusable; exiting so that the daemon starts a fresh host",
        device.info().description
    );
    // SAFETY: ends the process at once; nothing runs after it.
    unsafe { libc::_exit(FAULT_EXIT_CODE) }
}

/// Sends the answer to a request on `device` (a job's end, a read, an allocation) unless a fault
/// was already answered; returns whether it went. An answer that `failed` on a device the failure
/// left unhealthy is the fault's: the last one the host sends before it exits.
fn send_answer(writer: &Writer, device: &dyn Device, failed: bool, reply: &Reply) -> bool {
    let faulted = failed && !device.healthy();
    if (faulted && FAULTED.swap(true, Ordering::AcqRel)) || (!faulted && FAULTED.load(Ordering::Acquire)) {
        return false;
    }
    if faulted {
        writer.send(&Reply::Exiting);
    }
    writer.send(reply);
    if faulted {
        exit_after_fault(device);
    }
    true
}

/// Sends each device's utilisation and cached memory when they change (checked every second),
/// for `agora status` in the daemon.
fn start_load_reports(devices: &[Arc<dyn Device>], writer: &Arc<Writer>) {
    let devices: Vec<std::sync::Weak<dyn Device>> = devices.iter().map(Arc::downgrade).collect();
    let writer = Arc::downgrade(writer);
    let _ = std::thread::Builder::new()
        .name("agora-host-load".into())
        .spawn(move || {
            let mut last = vec![(None, 0); devices.len()];
            loop {
                std::thread::sleep(Duration::from_secs(1));
                let Some(writer) = writer.upgrade() else { return };
                for (index, device) in devices.iter().enumerate() {
                    let Some(device) = device.upgrade() else { return };
                    let report = device.status();
                    let now = (report.utilization_percent, report.memory_cached);
                    if now != last[index] && !FAULTED.load(Ordering::Acquire) {
                        last[index] = now;
                        writer.send(&Reply::Load {
                            device: index as u16,
                            utilization_percent: now.0,
                            memory_cached: now.1,
                        });
                    }
                }
            }
        });
}

/// The socket's sending side, shared by the message loop and the devices' completion threads.
struct Writer(Mutex<UnixStream>);

impl Writer {
    fn send(&self, reply: &Reply) {
        let stream = self.0.lock().unwrap_or_else(|e| e.into_inner());
        // A daemon that went away is noticed by the message loop (end of stream).
        let _ = send(&stream, reply);
    }
}

/// A mapped segment, page-locked for the devices that wanted it.
struct Segment {
    /// The devices' registrations: dropped (unregistered) before the memory is unmapped.
    _locks: Vec<Box<dyn Any + Send + Sync>>,
    map: MmapRaw,
}

struct Host {
    devices: Vec<Arc<dyn Device>>,
    /// Buffers by (device, id).
    buffers: HashMap<(u16, u64), Arc<dyn DeviceBuffer>>,
    segments: HashMap<u64, Arc<Segment>>,
    kernels: HashMap<u32, KernelRef>,
    /// Flags of revocable jobs that have not finished, by job.
    revocations: Arc<Mutex<HashMap<u64, Arc<AtomicBool>>>>,
    writer: Arc<Writer>,
    /// Where segments and big buffers are let go of, off this loop ([`crate::disposal`]).
    disposal: Disposal,
}

impl Host {
    fn handle(&mut self, request: Request, fd: Option<std::os::fd::OwnedFd>) {
        match request {
            Request::MapSegment {
                segment,
                len,
                page_lock,
                writable,
            } => {
                let Some(fd) = fd else {
                    eprintln!("agora device-host: segment {segment} came without its descriptor");
                    return;
                };
                let file = std::fs::File::from(fd);
                let mut options = memmap2::MmapOptions::new();
                options.len(len as usize);
                let mapped = if writable {
                    options.map_raw(&file)
                } else {
                    options.map_raw_read_only(&file)
                };
                match mapped {
                    Ok(map) => {
                        let mut locks = Vec::new();
                        for device in self
                            .devices
                            .iter()
                            .filter(|d| page_lock && d.wants_pinned_host_memory())
                        {
                            match device.register_host_memory(map.as_mut_ptr(), map.len(), file.as_fd(), true) {
                                Some(Ok(lock)) => locks.push(lock),
                                Some(Err(why)) => eprintln!("agora device-host: {why}"),
                                None => {}
                            }
                        }
                        self.segments.insert(segment, Arc::new(Segment { _locks: locks, map }));
                    }
                    Err(e) => eprintln!("agora device-host: mapping segment {segment}: {e}"),
                }
            }
            Request::UnmapSegment { segment } => {
                if let Some(segment) = self.segments.remove(&segment) {
                    self.disposal.dispose(Box::new(segment));
                }
            }
            Request::DefineKernel { kernel, def } => {
                self.kernels.insert(kernel, kernel_def(def));
            }
            Request::Alloc {
                request,
                device,
                buffer,
                tenant,
                len,
            } => {
                let outcome = self.alloc(device, buffer, tenant, len);
                self.answer(
                    device,
                    outcome.is_err(),
                    Reply::Allocated {
                        request,
                        outcome: outcome.into(),
                    },
                );
            }
            Request::Free { device, buffer } => {
                if let Some(freed) = self.buffers.remove(&(device, buffer)) {
                    // A big one is let go of elsewhere, also when a job still holds it (its Done
                    // can reach the daemon, and this Free come back, before the job's thread
                    // drops its reference).
                    if freed.len() >= MIN_BUFFER_BYTES {
                        self.disposal.dispose_when_last(freed);
                    }
                }
            }
            Request::Read {
                request,
                device,
                buffer,
                host,
                len,
            } => {
                let outcome = self.read(device, buffer, host, len);
                self.answer(
                    device,
                    outcome.is_err(),
                    Reply::ReadDone {
                        request,
                        outcome: outcome.into(),
                    },
                );
            }
            Request::Submit(submit) => self.submit(submit),
            Request::Revoke { job } => {
                if let Some(flag) = self.revocations.lock().unwrap_or_else(|e| e.into_inner()).get(&job) {
                    flag.store(true, Ordering::Release);
                }
            }
            Request::Prepare { request, device, def } => {
                let Some(device) = self.devices.get(device as usize) else {
                    self.writer.send(&Reply::Prepared {
                        request,
                        outcome: Some(Err("the device host has no such device".into())),
                    });
                    return;
                };
                // A GPU compiles here (NVRTC, the driver's JIT): seconds, during which the other
                // tenants' jobs must not wait behind the message loop.
                let (device, kernel, writer) = (device.clone(), kernel_def(def), self.writer.clone());
                let spawned = std::thread::Builder::new()
                    .name("agora-host-prepare".into())
                    .spawn(move || {
                        let outcome = device.prepare(&kernel);
                        writer.send(&Reply::Prepared { request, outcome });
                    });
                if spawned.is_err() {
                    self.writer.send(&Reply::Prepared {
                        request,
                        outcome: Some(Err(
                            "the device host could not start a thread to prepare the kernel".into()
                        )),
                    });
                }
            }
            Request::TenantEnded { tenant } => {
                for device in &self.devices {
                    device.tenant_ended(tenant);
                }
            }
        }
    }

    /// Sends the answer to a synchronous request on `device`; one that `failed` on a device the
    /// failure left unhealthy is the last answer (see [`exit_after_fault`]).
    fn answer(&self, device: u16, failed: bool, reply: Reply) {
        match self.devices.get(device as usize) {
            Some(device) => {
                send_answer(&self.writer, device.as_ref(), failed, &reply);
            }
            // No such device (a daemon bug): answered all the same, so the call does not wait.
            None if !FAULTED.load(Ordering::Acquire) => self.writer.send(&reply),
            None => {}
        }
    }

    /// Allocates buffer `buffer` of `len` bytes on `device`. A device that refuses for want of
    /// memory while buffers or segments are still being let go of ([`Disposal`]) is asked once
    /// more when they are.
    fn alloc(&mut self, device: u16, buffer: u64, tenant: u64, len: u64) -> Result<(), TaskError> {
        let target = self
            .devices
            .get(device as usize)
            .ok_or_else(|| link_bug(LINK_NO_DEVICE, "an allocation on a device the host does not have"))?;
        let mut allocated = target.alloc(tenant, len);
        if matches!(allocated, Some(Err(TaskError::DeviceOutOfMemory { .. }))) && self.disposal.pending() {
            self.disposal.flush();
            allocated = target.alloc(tenant, len);
        }
        match allocated {
            Some(Ok(allocated)) => {
                self.buffers.insert((device, buffer), allocated);
                Ok(())
            }
            Some(Err(e)) => Err(e),
            None => Err(link_bug(
                LINK_NO_DEVICE,
                "an allocation on a device without memory of its own",
            )),
        }
    }

    fn read(&self, device: u16, buffer: u64, host: HostRef, len: u64) -> Result<(), TaskError> {
        let d = self
            .devices
            .get(device as usize)
            .ok_or_else(|| link_bug(LINK_NO_DEVICE, "a read from a device the host does not have"))?;
        let b = self
            .buffers
            .get(&(device, buffer))
            .ok_or_else(|| link_bug(LINK_NO_BUFFER, "a read of a buffer the host does not have"))?;
        let mut held = Vec::new();
        let ptr = self.host_ptr(host, len, &mut held)?;
        // SAFETY: `ptr` is valid for `len` bytes: a range checked inside a mapped segment, held
        // until the read returns.
        unsafe { d.read(b.as_ref(), ptr, len as usize) }
    }

    /// The address of `len` bytes at `host`: a range of a mapped segment, checked; `held` keeps
    /// the mapping until the job is done.
    fn host_ptr(&self, host: HostRef, len: u64, held: &mut Vec<Arc<Segment>>) -> Result<*mut u8, TaskError> {
        let outside = || link_bug(LINK_OUTSIDE_SEGMENT, "a host range outside its segment");
        let segment = self
            .segments
            .get(&host.segment)
            .ok_or_else(|| link_bug(LINK_OUTSIDE_SEGMENT, "a segment the host has not mapped"))?;
        let end = host.offset.checked_add(len).ok_or_else(outside)?;
        if end > segment.map.len() as u64 {
            return Err(outside());
        }
        // SAFETY: `offset + len` is within the mapping (checked above).
        let ptr = unsafe { segment.map.as_mut_ptr().add(host.offset as usize) };
        held.push(segment.clone());
        Ok(ptr)
    }

    fn buffer(&self, device: u16, id: u64) -> Result<Arc<dyn DeviceBuffer>, TaskError> {
        self.buffers
            .get(&(device, id))
            .cloned()
            .ok_or_else(|| link_bug(LINK_NO_BUFFER, "a job naming a buffer the host does not have"))
    }

    fn submit(&mut self, submit: Submit) {
        let job = submit.job;
        match self.job(submit) {
            Ok((lane, device, built)) => device.submit(lane, built),
            Err(e) => self.writer.send(&Reply::Done {
                job,
                outcome: Err(e).into(),
                cold: false,
                started_after_ns: 0,
                transfers_after_ns: None,
            }),
        }
    }

    fn job(&mut self, submit: Submit) -> Result<(usize, Arc<dyn Device>, Job), TaskError> {
        let Submit {
            job,
            device: index,
            lane,
            transfers,
            work,
            revocable,
            urgent,
        } = submit;
        let device = self
            .devices
            .get(index as usize)
            .cloned()
            .ok_or_else(|| link_bug(LINK_NO_DEVICE, "a job for a device the host does not have"))?;
        if lane as usize >= device.info().lanes {
            return Err(link_bug(LINK_NO_LANE, "a job for a lane the device does not have"));
        }
        let mut held = Vec::new();
        let mut moves = Vec::with_capacity(transfers.len());
        for transfer in transfers {
            moves.push(match transfer {
                TransferWire::ToDevice { host, len, buffer } => Transfer::ToDevice {
                    host: self.host_ptr(host, len, &mut held)?,
                    len: len as usize,
                    to: self.buffer(index, buffer)?,
                },
                TransferWire::ToHost { buffer, host, len } => Transfer::ToHost {
                    from: self.buffer(index, buffer)?,
                    device: device.clone(),
                    host: self.host_ptr(host, len, &mut held)?,
                    len: len as usize,
                },
            });
        }
        let mut kernel_of_job = None;
        let work = match work {
            WorkWire::Nothing => Work::Nothing,
            WorkWire::Fill { host, len, value } => Work::Fill {
                ptr: self.host_ptr(host, len, &mut held)?,
                len: len as usize,
                value,
            },
            WorkWire::Copy { src, dst, len } => Work::Copy {
                src: self.host_ptr(src, len, &mut held)?,
                dst: self.host_ptr(dst, len, &mut held)?,
                len: len as usize,
            },
            WorkWire::Launch {
                kernel,
                range,
                dims,
                args: wire_args,
                rows,
            } => {
                let kernel = self
                    .kernels
                    .get(&kernel)
                    .cloned()
                    .ok_or_else(|| link_bug(LINK_NO_KERNEL, "a launch of a kernel never defined on the link"))?;
                if wire_args.len() > MAX_ARGS || !(1..=3).contains(&dims) {
                    return Err(link_bug(
                        LINK_NO_KERNEL,
                        "a launch with too many arguments or dimensions",
                    ));
                }
                let mut args = [ArgValue::None; MAX_ARGS];
                let mut device_args: [Option<Arc<dyn DeviceBuffer>>; MAX_ARGS] = std::array::from_fn(|_| None);
                for (i, arg) in wire_args.iter().enumerate() {
                    match *arg {
                        ArgWire::None => {}
                        ArgWire::Scalar(bits) => args[i] = ArgValue::Scalar(bits),
                        ArgWire::Buffer { buffer, len } => {
                            // The device reads its own buffer; no host address is involved.
                            args[i] = ArgValue::Buffer {
                                ptr: std::ptr::null_mut(),
                                len,
                            };
                            device_args[i] = Some(self.buffer(index, buffer)?);
                        }
                    }
                }
                kernel_of_job = Some(kernel.clone());
                Work::Launch {
                    kernel,
                    range,
                    dims: dims as usize,
                    args,
                    arg_count: wire_args.len(),
                    device_args,
                    rows: rows.map(|(start, end)| start..end),
                }
            }
        };
        let revoke = revocable.then(|| {
            let flag = Arc::new(AtomicBool::new(false));
            self.revocations
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .insert(job, flag.clone());
            Revocation {
                flag,
                save: None,
                replay: false,
            }
        });
        let writer = self.writer.clone();
        let revocations = self.revocations.clone();
        let device_for_check = device.clone();
        let done = move |result: Result<(), TaskError>, times: JobTimes| {
            drop(held);
            if revocable {
                revocations.lock().unwrap_or_else(|e| e.into_inner()).remove(&job);
            }
            // After a fault only the job that met it is answered (by whoever saw it first);
            // the daemon fails the rest as lost when the host has gone.
            let done = Reply::Done {
                job,
                outcome: result.into(),
                cold: times.cold,
                started_after_ns: times.started.saturating_duration_since(times.queued).as_nanos() as u64,
                transfers_after_ns: times
                    .transfers_done
                    .map(|t| t.saturating_duration_since(times.queued).as_nanos() as u64),
            };
            if !send_answer(&writer, device_for_check.as_ref(), result.is_err(), &done) {
                return;
            }
            // A program that failed to build for good: the daemon stops sending its kernels here.
            if let (Err(_), Some(kernel)) = (result, kernel_of_job) {
                if !device_for_check.implements(&kernel) {
                    if let Some(program) = program_of(device_for_check.info().kind, &kernel) {
                        writer.send(&Reply::Broken { device: index, program });
                    }
                }
            }
        };
        Ok((
            lane as usize,
            device,
            Job {
                transfers: moves,
                work,
                keepalive: None,
                cancelled: None,
                revoke,
                // The daemon's lane ordered it already; a GPU still puts it on its lane's
                // high-priority stream, ahead of other lanes' batch blocks.
                urgent,
                exclusive: false,
                deadline: None,
                slices: None,
                share: agora_devices::Share::default(),
                done: Box::new(done),
            },
        ))
    }
}

/// The program a device of `kind` runs for `kernel` (the one that is broken when it fails).
fn program_of(kind: DeviceKind, kernel: &KernelDef) -> Option<String> {
    match (kind, &kernel.cuda, &kernel.opencl) {
        (DeviceKind::Cuda, Some(cuda), _) => Some(cuda.program.to_string()),
        (_, _, Some(opencl)) => Some(opencl.program.to_string()),
        _ => None,
    }
}

fn kernel_def(def: KernelWire) -> KernelRef {
    fn any_shape(_: &agora_kernels::LaunchShape<'_>) -> Result<(), TaskError> {
        // The daemon checked the launch before it bound it to this device.
        Ok(())
    }
    if def.library {
        if let Some((_, library)) = agora_kernels::find(&def.name) {
            if library.params.len() == def.params.len() {
                return KernelRef::Static(library);
            }
        }
    }
    KernelRef::Shared(Arc::new(KernelDef {
        name: def.name.into(),
        doc: "".into(),
        params: def
            .params
            .into_iter()
            .map(|(name, kind)| Param {
                name: name.into(),
                kind,
            })
            .collect::<Vec<_>>()
            .into(),
        cost: Cost::PerItemNs(1.0),
        chunkable: def.chunkable,
        check: SizeCheck::Builtin(any_shape),
        cpu: None,
        opencl: def.opencl.map(|imp| OpenClImpl {
            program: imp.program.into(),
            source: imp.source.into(),
            entry: imp.entry.into(),
            local: imp.local,
            binaries: imp
                .binaries
                .into_iter()
                .map(|(device, bytes)| OpenClBinary {
                    device: device.into(),
                    bytes: bytes.into(),
                })
                .collect::<Vec<_>>()
                .into(),
        }),
        cuda: def.cuda.map(|imp| CudaImpl {
            program: imp.program.into(),
            code: if imp.ptx {
                CudaCode::Ptx(imp.code.into())
            } else {
                CudaCode::Source(imp.code.into())
            },
            entry: imp.entry.into(),
            guarded: imp.guarded,
        }),
    }))
}

#[cfg(test)]
mod tests {
    //! The host's message loop in this process, over a socketpair, with a `sim` device.
    use super::*;
    use crate::FrameReader;

    /// The next reply that is not a load report (those come each second, whenever they like).
    fn reply(frames: &mut FrameReader, daemon: &UnixStream) -> Reply {
        loop {
            match frames.next::<Reply>(daemon).expect("a reply") {
                Reply::Load { .. } => {}
                reply => return reply,
            }
        }
    }

    fn internal(outcome: crate::wire::Outcome) -> Option<u16> {
        match outcome.result() {
            Err(TaskError::Internal(place)) => Some(place),
            _ => None,
        }
    }

    /// Memory handed to the disposal thread is not free yet: an allocation the device refuses
    /// meanwhile waits for the disposals and is tried again, so it succeeds where freeing on the
    /// loop would have let it.
    #[test]
    fn an_allocation_refused_while_memory_is_being_given_back_waits_for_it() {
        let device = agora_devices::sim::SimDevice::new(agora_devices::sim::SimSpec {
            name: "small".into(),
            memory_bytes: 8 << 20,
            ..Default::default()
        })
        .unwrap();
        let (_daemon, host_end) = UnixStream::pair().unwrap();
        let mut host = Host {
            devices: vec![Arc::new(device) as Arc<dyn Device>],
            buffers: HashMap::new(),
            segments: HashMap::new(),
            kernels: HashMap::new(),
            revocations: Arc::default(),
            writer: Arc::new(Writer(Mutex::new(host_end))),
            disposal: Disposal::start(),
        };
        host.alloc(0, 1, 1, 8 << 20).expect("the whole device, once");
        assert!(
            matches!(host.alloc(0, 9, 1, 1 << 20), Err(TaskError::DeviceOutOfMemory { .. })),
            "full"
        );
        // Buffer 1 freed, its release slow (as PoCL's or the kernel's for a GiB): the disposal
        // thread holds it until the gate opens, 100 ms from now.
        struct SlowRelease {
            opens: std::sync::mpsc::Receiver<()>,
            _buffer: Arc<dyn DeviceBuffer>,
        }
        impl Drop for SlowRelease {
            fn drop(&mut self) {
                let _ = self.opens.recv_timeout(Duration::from_secs(10));
            }
        }
        let (open, opens) = std::sync::mpsc::channel();
        let buffer = host.buffers.remove(&(0, 1)).unwrap();
        host.disposal.dispose(Box::new(SlowRelease { opens, _buffer: buffer }));
        let opener = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(100));
            let _ = open.send(());
        });
        host.alloc(0, 2, 1, 8 << 20)
            .expect("allowed once the freed buffer is really released");
        assert!(host.buffers.contains_key(&(0, 2)));
        assert!(!host.disposal.pending());
        opener.join().unwrap();
    }

    /// A request naming what the host lacks is a bug of the daemon's side: it is answered at
    /// once (the daemon's call would otherwise wait out its timeout) with `Internal` and the
    /// place, never with `KernelFault`, which would blame the task's kernel.
    #[test]
    fn requests_naming_what_the_host_lacks_are_answered_at_once_as_internal_errors() {
        let (daemon, host_end) = UnixStream::pair().unwrap();
        let host = std::thread::spawn(move || {
            let args = HostArgs {
                platform: SIM_PLATFORM.into(),
                ..Default::default()
            };
            serve(host_end, &args)
        });
        let mut frames = FrameReader::new();
        let Reply::Ready { devices, .. } = reply(&mut frames, &daemon) else {
            panic!("the host did not start with Ready");
        };
        assert_eq!(devices.len(), 1, "one sim device");
        let request = |r: &Request| send(&daemon, r).unwrap();

        request(&Request::Alloc {
            request: 1,
            device: 7,
            buffer: 1,
            tenant: 1,
            len: 64,
        });
        match reply(&mut frames, &daemon) {
            Reply::Allocated { request: 1, outcome } => assert_eq!(internal(outcome), Some(LINK_NO_DEVICE)),
            other => panic!("{other:?}"),
        }
        request(&Request::Read {
            request: 2,
            device: 0,
            buffer: 99,
            host: HostRef { segment: 1, offset: 0 },
            len: 64,
        });
        match reply(&mut frames, &daemon) {
            Reply::ReadDone { request: 2, outcome } => assert_eq!(internal(outcome), Some(LINK_NO_BUFFER)),
            other => panic!("{other:?}"),
        }
        let submit = |job: u64, device: u16, lane: u32, work: WorkWire| {
            Request::Submit(Submit {
                job,
                device,
                lane,
                transfers: Vec::new(),
                work,
                revocable: false,
                urgent: false,
            })
        };
        let fill = WorkWire::Fill {
            host: HostRef { segment: 5, offset: 0 },
            len: 16,
            value: 0,
        };
        let launch = WorkWire::Launch {
            kernel: 3,
            range: [1, 1, 1],
            dims: 1,
            args: Vec::new(),
            rows: None,
        };
        for (job, request_, place) in [
            (10, submit(10, 9, 0, WorkWire::Nothing), LINK_NO_DEVICE),
            (11, submit(11, 0, 99, WorkWire::Nothing), LINK_NO_LANE),
            (12, submit(12, 0, 0, fill), LINK_OUTSIDE_SEGMENT),
            (13, submit(13, 0, 0, launch), LINK_NO_KERNEL),
        ] {
            request(&request_);
            match reply(&mut frames, &daemon) {
                Reply::Done { job: done, outcome, .. } => {
                    assert_eq!((done, internal(outcome)), (job, Some(place)))
                }
                other => panic!("{other:?}"),
            }
        }
        // Preparing a kernel for a device the host lacks says so.
        let (_, saxpy) = agora_kernels::find("saxpy").unwrap();
        request(&Request::Prepare {
            request: 20,
            device: 4,
            def: crate::remote::kernel_wire(saxpy),
        });
        match reply(&mut frames, &daemon) {
            Reply::Prepared {
                request: 20,
                outcome: Some(Err(why)),
            } => assert!(why.contains("no such device"), "{why}"),
            other => panic!("{other:?}"),
        }
        // The host still serves: a job on its device runs. Then the daemon's end closes it.
        request(&submit(30, 0, 0, WorkWire::Nothing));
        match reply(&mut frames, &daemon) {
            Reply::Done { job: 30, outcome, .. } => assert_eq!(outcome.result(), Ok(())),
            other => panic!("{other:?}"),
        }
        drop(daemon);
        assert_eq!(host.join().unwrap(), Ok(()));
    }
}
