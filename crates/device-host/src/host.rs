//! The device host's side: the `agora device-host` process that owns one OpenCL platform's
//! devices for the daemon.
//!
//! It maps the segments the daemon sends (by memfd), keeps the buffers the daemon allocates by
//! id, and turns each [`Submit`](crate::wire::Submit) into a job on the real device's lane, whose
//! completion goes back as [`Reply::Done`]. It trusts the daemon (its parent, which started it on
//! a private socketpair) but still checks every segment range before it touches memory, so a
//! daemon bug cannot become a stray write here.
//!
//! Must not: schedule, reorder or retry anything (the daemon's lanes did); outlive the daemon
//! (the parent-death signal and the socket's end both stop it).

use std::collections::HashMap;
use std::os::unix::net::UnixStream;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

use agora_devices::opencl::OpenClDevice;
use agora_devices::priority::LanePriorities;
use agora_devices::{Device, DeviceBuffer, Job, JobTimes, Revocation, Transfer, Work};
use agora_kernels::{ArgValue, Cost, KernelDef, KernelRef, OpenClBinary, OpenClImpl, Param, SizeCheck};
use agora_protocol::{TaskError, MAX_ARGS};
use agora_transport::socket::send;
use agora_transport::TransportError;
use memmap2::MmapRaw;

use crate::wire::{ArgWire, DeviceWire, HostRef, KernelWire, Reply, Request, Submit, TransferWire, WorkWire, PROTOCOL};

/// What the daemon asks the host to serve.
#[derive(Debug, Clone)]
pub struct HostArgs {
    /// The OpenCL platform's name (`CL_PLATFORM_NAME`).
    pub platform: String,
    /// Lanes (command queues) per device.
    pub lanes: usize,
    /// Device memory limit in bytes (0: the device's own size).
    pub memory_limit: u64,
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
    let (found, problems) =
        agora_devices::opencl::discover_except(args.lanes, args.memory_limit, &LanePriorities::normal(), &|platform| {
            platform != args.platform
        });
    let devices: Vec<Arc<OpenClDevice>> = found.into_iter().map(Arc::new).collect();
    writer.send(&Reply::Ready {
        protocol: PROTOCOL,
        devices: devices.iter().map(|d| describe(d.as_ref())).collect(),
        problems: problems.into_iter().filter(|p| !p.contains("left out")).collect(),
    });
    let mut host = Host {
        devices,
        buffers: HashMap::new(),
        segments: HashMap::new(),
        kernels: HashMap::new(),
        revocations: Arc::default(),
        writer,
    };
    let mut frames = crate::FrameReader::new();
    let outcome = loop {
        match frames.next::<Request>(&socket) {
            Ok(request) => {
                let fd = matches!(request, Request::MapSegment { .. })
                    .then(|| frames.take_fd())
                    .flatten();
                host.handle(request, fd)
            }
            Err(TransportError::Closed) => break Ok(()),
            Err(e) => break Err(format!("reading from the daemon: {e}")),
        }
    };
    for device in &host.devices {
        device.shutdown();
    }
    outcome
}

fn describe(device: &OpenClDevice) -> DeviceWire {
    let info = device.info();
    let l = info.limits;
    DeviceWire {
        description: info.description.clone(),
        memory_bytes: info.memory_bytes,
        lanes: info.lanes as u32,
        polls_revocation: device.polls_revocation(),
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
    }
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

struct Host {
    devices: Vec<Arc<OpenClDevice>>,
    /// Buffers by (device, id).
    buffers: HashMap<(u16, u64), Arc<dyn DeviceBuffer>>,
    segments: HashMap<u64, Arc<MmapRaw>>,
    kernels: HashMap<u32, KernelRef>,
    /// Flags of revocable jobs that have not finished, by job.
    revocations: Arc<Mutex<HashMap<u64, Arc<AtomicBool>>>>,
    writer: Arc<Writer>,
}

impl Host {
    fn handle(&mut self, request: Request, fd: Option<std::os::fd::OwnedFd>) {
        match request {
            Request::MapSegment { segment, len } => {
                let Some(fd) = fd else {
                    eprintln!("agora device-host: segment {segment} came without its descriptor");
                    return;
                };
                let file = std::fs::File::from(fd);
                match memmap2::MmapOptions::new().len(len as usize).map_raw(&file) {
                    Ok(map) => {
                        self.segments.insert(segment, Arc::new(map));
                    }
                    Err(e) => eprintln!("agora device-host: mapping segment {segment}: {e}"),
                }
            }
            Request::UnmapSegment { segment } => {
                self.segments.remove(&segment);
            }
            Request::DefineKernel { kernel, def } => {
                self.kernels
                    .insert(kernel, KernelRef::Shared(Arc::new(kernel_def(def))));
            }
            Request::Alloc {
                request,
                device,
                buffer,
                tenant,
                len,
            } => {
                let outcome = match self.devices.get(device as usize).map(|d| d.alloc(tenant, len)) {
                    Some(Some(Ok(allocated))) => {
                        self.buffers.insert((device, buffer), allocated);
                        Ok(())
                    }
                    Some(Some(Err(e))) => Err(e),
                    _ => Err(TaskError::KernelFault),
                };
                self.writer.send(&Reply::Allocated {
                    request,
                    outcome: outcome.into(),
                });
            }
            Request::Free { device, buffer } => {
                self.buffers.remove(&(device, buffer));
            }
            Request::Read {
                request,
                device,
                buffer,
                host,
                len,
            } => {
                let outcome = self.read(device, buffer, host, len);
                self.writer.send(&Reply::ReadDone {
                    request,
                    outcome: outcome.into(),
                });
            }
            Request::Submit(submit) => self.submit(submit),
            Request::Revoke { job } => {
                if let Some(flag) = self.revocations.lock().unwrap_or_else(|e| e.into_inner()).get(&job) {
                    flag.store(true, Ordering::Release);
                }
            }
        }
    }

    fn read(&self, device: u16, buffer: u64, host: HostRef, len: u64) -> Result<(), TaskError> {
        let d = self.devices.get(device as usize).ok_or(TaskError::KernelFault)?;
        let b = self.buffers.get(&(device, buffer)).ok_or(TaskError::KernelFault)?;
        let mut held = Vec::new();
        let ptr = self.host_ptr(host, len, &mut held)?;
        // SAFETY: `ptr` is valid for `len` bytes: a range checked inside a mapped segment, held
        // until the read returns.
        unsafe { d.read(b.as_ref(), ptr, len as usize) }
    }

    /// The address of `len` bytes at `host`: a range of a mapped segment, checked; `held` keeps
    /// the mapping until the job is done.
    fn host_ptr(&self, host: HostRef, len: u64, held: &mut Vec<Arc<MmapRaw>>) -> Result<*mut u8, TaskError> {
        let map = self.segments.get(&host.segment).ok_or(TaskError::KernelFault)?;
        let end = host.offset.checked_add(len).ok_or(TaskError::KernelFault)?;
        if end > map.len() as u64 {
            return Err(TaskError::KernelFault);
        }
        // SAFETY: `offset + len` is within the mapping (checked above).
        let ptr = unsafe { map.as_mut_ptr().add(host.offset as usize) };
        held.push(map.clone());
        Ok(ptr)
    }

    fn buffer(&self, device: u16, id: u64) -> Result<Arc<dyn DeviceBuffer>, TaskError> {
        self.buffers.get(&(device, id)).cloned().ok_or(TaskError::KernelFault)
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

    fn job(&mut self, submit: Submit) -> Result<(usize, Arc<OpenClDevice>, Job), TaskError> {
        let Submit {
            job,
            device: index,
            lane,
            transfers,
            work,
            revocable,
        } = submit;
        let device = self
            .devices
            .get(index as usize)
            .cloned()
            .ok_or(TaskError::KernelFault)?;
        if lane as usize >= device.info().lanes {
            return Err(TaskError::KernelFault);
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
                    device: device.clone() as Arc<dyn Device>,
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
                let kernel = self.kernels.get(&kernel).cloned().ok_or(TaskError::KernelFault)?;
                if wire_args.len() > MAX_ARGS || !(1..=3).contains(&dims) {
                    return Err(TaskError::KernelFault);
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
            writer.send(&Reply::Done {
                job,
                outcome: result.into(),
                cold: times.cold,
                started_after_ns: times.started.saturating_duration_since(times.queued).as_nanos() as u64,
                transfers_after_ns: times
                    .transfers_done
                    .map(|t| t.saturating_duration_since(times.queued).as_nanos() as u64),
            });
            // A program that failed to build for good: the daemon stops sending its kernels here.
            if let (Err(_), Some(kernel)) = (result, kernel_of_job) {
                if !device_for_check.implements(&kernel) {
                    if let Some(imp) = &kernel.opencl {
                        writer.send(&Reply::Broken {
                            device: index,
                            program: imp.program.to_string(),
                        });
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
                urgent: false,
                exclusive: false,
                deadline: None,
                slices: None,
                share: agora_devices::Share::default(),
                done: Box::new(done),
            },
        ))
    }
}

fn kernel_def(def: KernelWire) -> KernelDef {
    fn any_shape(_: &agora_kernels::LaunchShape<'_>) -> Result<(), TaskError> {
        // The daemon checked the launch before it bound it to this device.
        Ok(())
    }
    KernelDef {
        cuda: None,
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
        opencl: Some(OpenClImpl {
            program: def.program.into(),
            source: def.source.into(),
            entry: def.entry.into(),
            local: def.local,
            binaries: def
                .binaries
                .into_iter()
                .map(|(device, bytes)| OpenClBinary {
                    device: device.into(),
                    bytes: bytes.into(),
                })
                .collect::<Vec<_>>()
                .into(),
        }),
    }
}
