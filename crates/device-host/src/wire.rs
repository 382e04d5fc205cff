//! The messages between the daemon and a device host (an OpenCL platform's, a GPU's, or a test's
//! `sim` device), over a Unix stream socketpair with the
//! control protocol's framing (a little-endian length, then postcard; `SCM_RIGHTS` for segment
//! memfds). Frames are at most `agora_protocol::control::MAX_FRAME` bytes.
//!
//! Host memory is named by segment and offset, never by address: the host maps each session's
//! segment itself. Buffers are named by ids the daemon assigns. Task errors travel as the
//! completion record's fields ([`Outcome`]), the same encoding clients decode.

use agora_protocol::{Completion, DeviceKind, ParamKind, TaskError};
use serde::{Deserialize, Serialize};

/// Bumped when a message changes: a daemon and a host of different versions refuse each other.
pub const PROTOCOL: u32 = 5;

/// Daemon → host.
#[derive(Debug, Serialize, Deserialize)]
pub enum Request {
    /// Map a session's segment (its memfd is attached) under `segment`.
    MapSegment {
        /// The daemon's id for it.
        segment: u64,
        /// Its length in bytes.
        len: u64,
        /// Page-lock it for the host's devices that want it (a GPU's DMA), within the user's
        /// limit the daemon keeps; staging segments are never page-locked.
        page_lock: bool,
        /// Map it writable. False for memory sealed against new writable mappings (a read-only
        /// export's region): the host maps it read-only, and the daemon never names it as a
        /// destination.
        writable: bool,
    },
    /// Unmap a segment: no job that names it is left.
    UnmapSegment {
        /// The daemon's id.
        segment: u64,
    },
    /// Remember a kernel under `kernel` (sent before the first launch that names it).
    DefineKernel {
        /// The link's id for it.
        kernel: u32,
        /// What it is.
        def: KernelWire,
    },
    /// Allocate device memory; answered with [`Reply::Allocated`].
    Alloc {
        /// Echoed in the reply.
        request: u64,
        /// Index of the device in the host.
        device: u16,
        /// The daemon's id for the new buffer.
        buffer: u64,
        /// Owner (the daemon's session id).
        tenant: u64,
        /// Bytes.
        len: u64,
    },
    /// Free a buffer (jobs that still use it keep it until they finish).
    Free {
        /// Index of the device.
        device: u16,
        /// The buffer.
        buffer: u64,
    },
    /// Read a buffer into host memory now; answered with [`Reply::ReadDone`].
    Read {
        /// Echoed in the reply.
        request: u64,
        /// Index of the device.
        device: u16,
        /// The buffer.
        buffer: u64,
        /// Where to.
        host: HostRef,
        /// Bytes.
        len: u64,
    },
    /// Run a job on a lane; answered with [`Reply::Done`] when it is done.
    Submit(Submit),
    /// Stop a revocable job that runs now (its kernel polls the flag).
    Revoke {
        /// The job.
        job: u64,
    },
    /// Ready a kernel now (`Device::prepare`: a GPU compiles, fences and loads a tenant's
    /// program when it is built); answered with [`Reply::Prepared`].
    Prepare {
        /// Echoed in the reply.
        request: u64,
        /// Index of the device.
        device: u16,
        /// The kernel (a build's, not yet launched, so not defined on the link).
        def: KernelWire,
    },
    /// A session ended (`Device::tenant_ended`): its devices give back what they kept for it.
    TenantEnded {
        /// The daemon's session id.
        tenant: u64,
    },
}

/// A job, as the host runs it.
#[derive(Debug, Serialize, Deserialize)]
pub struct Submit {
    /// The daemon's id for it.
    pub job: u64,
    /// Index of the device in the host.
    pub device: u16,
    /// Its lane.
    pub lane: u32,
    /// Data movements, in order.
    pub transfers: Vec<TransferWire>,
    /// The work.
    pub work: WorkWire,
    /// Whether the daemon may revoke it ([`Request::Revoke`]).
    pub revocable: bool,
    /// Latency-class or deadline work, for a GPU, which runs it on its lane's high-priority
    /// stream (other devices are told `false`: the daemon's lane ordered the job already).
    pub urgent: bool,
}

/// Host memory as the host sees it: a range of a mapped segment (a session's, or a staging
/// segment the daemon made for memory outside every session segment).
#[derive(Debug, Clone, Copy, Serialize, Deserialize, PartialEq, Eq)]
pub struct HostRef {
    /// The segment.
    pub segment: u64,
    /// Offset from its start.
    pub offset: u64,
}

/// A data movement.
#[derive(Debug, Serialize, Deserialize)]
pub enum TransferWire {
    /// Host into a buffer of the job's device.
    ToDevice {
        /// From.
        host: HostRef,
        /// Bytes.
        len: u64,
        /// Into.
        buffer: u64,
    },
    /// A buffer of the job's device into host memory.
    ToHost {
        /// From.
        buffer: u64,
        /// Into.
        host: HostRef,
        /// Bytes.
        len: u64,
    },
}

/// What a job does.
#[derive(Debug, Serialize, Deserialize)]
pub enum WorkWire {
    /// A kernel launch.
    Launch {
        /// The link's kernel id ([`Request::DefineKernel`]).
        kernel: u32,
        /// Range.
        range: [u64; 3],
        /// Dimensions.
        dims: u8,
        /// Arguments by index.
        args: Vec<ArgWire>,
        /// Only these rows of dimension 0.
        rows: Option<(u64, u64)>,
    },
    /// Fill host memory.
    Fill {
        /// Where.
        host: HostRef,
        /// Bytes.
        len: u64,
        /// With.
        value: u8,
    },
    /// Copy within host memory.
    Copy {
        /// From.
        src: HostRef,
        /// To.
        dst: HostRef,
        /// Bytes.
        len: u64,
    },
    /// An ordering point.
    Nothing,
}

/// One launch argument.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub enum ArgWire {
    /// Not present.
    None,
    /// A scalar's bits.
    Scalar(u64),
    /// A buffer of the job's device.
    Buffer {
        /// The buffer.
        buffer: u64,
        /// Its length.
        len: u64,
    },
}

/// What the host needs of a kernel to launch it.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct KernelWire {
    /// Its name.
    pub name: String,
    /// Parameters, in call order.
    pub params: Vec<(String, ParamKind)>,
    /// Whether its rows may be split.
    pub chunkable: bool,
    /// The library's kernel of this name (the host is the same `agora` binary, so it uses its
    /// own definition, CPU implementation included, and the fields below only as a check).
    pub library: bool,
    /// Its OpenCL C.
    pub opencl: Option<OpenClWire>,
    /// Its CUDA C or PTX.
    pub cuda: Option<CudaWire>,
}

/// A kernel's OpenCL implementation.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct OpenClWire {
    /// OpenCL program name.
    pub program: String,
    /// OpenCL source.
    pub source: String,
    /// Entry point.
    pub entry: String,
    /// Required work-group size.
    pub local: Option<[usize; 3]>,
    /// Precompiled binaries by device name.
    pub binaries: Vec<(String, Vec<u8>)>,
}

/// A kernel's CUDA implementation (`agora_kernels::CudaImpl`).
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct CudaWire {
    /// Program name.
    pub program: String,
    /// Whether `code` is PTX (else CUDA C).
    pub ptx: bool,
    /// The code.
    pub code: String,
    /// Entry point.
    pub entry: String,
    /// Calling convention: guarded (sliceable, revocable) or plain.
    pub guarded: bool,
}

/// Host → daemon.
#[derive(Debug, Serialize, Deserialize)]
pub enum Reply {
    /// The host is up: its devices (possibly none) and what it could not start.
    Ready {
        /// [`PROTOCOL`] of the host.
        protocol: u32,
        /// Its devices, by index.
        devices: Vec<DeviceWire>,
        /// One line per device that failed to start.
        problems: Vec<String>,
    },
    /// Answer to [`Request::Alloc`].
    Allocated {
        /// The request.
        request: u64,
        /// Whether it worked.
        outcome: Outcome,
    },
    /// Answer to [`Request::Read`].
    ReadDone {
        /// The request.
        request: u64,
        /// Whether it worked.
        outcome: Outcome,
    },
    /// A job finished.
    Done {
        /// The job.
        job: u64,
        /// How.
        outcome: Outcome,
        /// It paid a one-time cost (a program build).
        cold: bool,
        /// From its arrival in the host to its start (it waited behind earlier jobs), ns.
        started_after_ns: u64,
        /// From its arrival to the end of its transfers, ns (when it had any).
        transfers_after_ns: Option<u64>,
    },
    /// Answer to [`Request::Prepare`]: `None` when the device has nothing to prepare, else
    /// whether the kernel is ready or why not (a compiler's or the driver's log).
    Prepared {
        /// The request.
        request: u64,
        /// The outcome.
        outcome: Option<Result<(), String>>,
    },
    /// What `agora status` shows of a device that only the host knows, sent every second while
    /// it changes.
    Load {
        /// Index of the device.
        device: u16,
        /// How busy it is (NVML on a GPU), where the host can tell.
        utilization_percent: Option<u32>,
        /// Device memory kept for reuse (a GPU's tenant partitions).
        memory_cached: u64,
    },
    /// A program failed to build for good: the device no longer claims its kernels.
    Broken {
        /// Index of the device.
        device: u16,
        /// The program's name.
        program: String,
    },
    /// Its device faulted and is unusable: the host sends the answer that met the fault next,
    /// then exits. The daemon takes the device as failed from here, so a job that answer fails
    /// as lost (`DeviceLost`) is replayed elsewhere like the jobs the exit fails.
    Exiting,
}

/// A device of the host.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct DeviceWire {
    /// What it is: `OpenCl`, `Cuda`, or `Sim` (tests of the host's fault path).
    pub kind: DeviceKind,
    /// Its description (platform and device names).
    pub description: String,
    /// Device memory.
    pub memory_bytes: u64,
    /// Lanes.
    pub lanes: u32,
    /// Whether running kernels see revocation flags.
    pub polls_revocation: bool,
    /// Whether it runs tenants' own programs (a GPU with tenant partitions runs them fenced).
    pub runs_tenant_programs: bool,
    /// Whether it page-locks host memory for its copies (`Device::wants_pinned_host_memory`).
    pub wants_page_locked: bool,
    /// `Device::min_items_per_slice`.
    pub min_items_per_slice: u64,
    /// `LaunchLimits`, field by field: items, extent ×3, items per enqueue, groups per enqueue,
    /// group ×3, group items, buffer bytes.
    pub limits: [u64; 11],
    /// `DeviceInfo::host_cores_per_lane`.
    pub host_cores_per_lane: u32,
}

/// A task outcome: the completion record's fields.
#[derive(Debug, Clone, Copy, Default, Serialize, Deserialize, PartialEq, Eq)]
pub struct Outcome {
    code: u16,
    arg: u16,
    reserved: u32,
    a: u64,
    b: u64,
}

impl From<Result<(), TaskError>> for Outcome {
    fn from(result: Result<(), TaskError>) -> Self {
        let c = match result {
            Ok(()) => Completion::ok(0),
            Err(e) => Completion::failed(0, e),
        };
        Outcome {
            code: c.code,
            arg: c.arg,
            reserved: c.reserved,
            a: c.a,
            b: c.b,
        }
    }
}

impl Outcome {
    /// The result it carries.
    pub fn result(self) -> Result<(), TaskError> {
        Completion {
            task_id: 0,
            code: self.code,
            arg: self.arg,
            reserved: self.reserved,
            a: self.a,
            b: self.b,
        }
        .result()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn outcomes_keep_the_error() {
        for result in [
            Ok(()),
            Err(TaskError::DeviceLost),
            Err(TaskError::DeviceOutOfMemory { index: 2, needed: 4096 }),
            Err(TaskError::KernelFault),
        ] {
            assert_eq!(Outcome::from(result).result(), result);
        }
    }

    fn round_trip<T: Serialize + serde::de::DeserializeOwned>(value: &T) -> T {
        let frame = agora_protocol::control::encode_frame(value).unwrap();
        agora_protocol::control::decode_body(&frame[4..]).unwrap()
    }

    #[test]
    fn a_gpu_kernel_and_its_preparation_cross_the_link_whole() {
        let def = KernelWire {
            name: "tenant_scale".into(),
            params: vec![
                (
                    "x".into(),
                    ParamKind::Buffer {
                        element: agora_protocol::ScalarType::F32,
                        access: agora_protocol::Access::ReadWrite,
                    },
                ),
                ("a".into(), ParamKind::Scalar(agora_protocol::ScalarType::F32)),
            ],
            chunkable: false,
            library: false,
            opencl: None,
            cuda: Some(CudaWire {
                program: "tenant-fenced/abc".into(),
                ptx: true,
                code: ".version 8.0\n.target sm_80\n".into(),
                entry: "scale".into(),
                guarded: false,
            }),
        };
        let Request::Prepare {
            request,
            device,
            def: back,
        } = round_trip(&Request::Prepare {
            request: 7,
            device: 0,
            def: def.clone(),
        })
        else {
            panic!("not a Prepare");
        };
        assert_eq!((request, device), (7, 0));
        let cuda = back.cuda.unwrap();
        assert!(cuda.ptx && !cuda.guarded && back.opencl.is_none());
        assert_eq!(
            (cuda.program.as_str(), cuda.entry.as_str()),
            ("tenant-fenced/abc", "scale")
        );
        assert_eq!(cuda.code, def.cuda.unwrap().code);
        assert_eq!(back.params, def.params);
        // A JIT log comes back as the build's error.
        let Reply::Prepared { outcome, .. } = round_trip(&Reply::Prepared {
            request: 7,
            outcome: Some(Err("ptxas error: %r99 undefined".into())),
        }) else {
            panic!("not Prepared");
        };
        assert_eq!(outcome, Some(Err("ptxas error: %r99 undefined".into())));
    }
}
