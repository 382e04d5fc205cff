//! **For the fuzzer only** (`fuzz/fuzz_targets/validate.rs`): the validate stage driven with a
//! hand-made session, without sockets, devices or a dispatcher. Not an API; nothing else may use
//! it, and it may change with the stage it exposes.
//!
//! [`ValidateHarness`] builds one session the way the server does (a real sealed segment, the
//! real heap allocator and handle tables, buffers allocated with `Session::alloc_buffer`),
//! releases one buffer and one queue (their handles are stale), and adds kernels of a tenant
//! program whose manifest has size rules. [`ValidateHarness::validate`] then runs what the
//! dispatcher runs for each descriptor it takes from the ring — `TaskDescriptor::decode`, the
//! release checks of `admit` (without changing the tables, so every input sees the same
//! session) and `validate::resolve` — and summarises the `Ready` task, so that the fuzz target
//! can assert the stage's promises: only live handles resolve, every byte range lies in its
//! buffer and the session's heap, a buffer is never aliased by a writer, a launch fits its
//! kernel's signature and size rules.

use std::borrow::Cow;
use std::os::unix::net::UnixStream;
use std::sync::Arc;

use agora_kernels::{Cost, KernelDef, KernelRef};
use agora_protocol::control::QueueClass;
use agora_protocol::segment::Geometry;
use agora_protocol::{Op, TaskDescriptor, TaskError};
use agora_transport::shm::Segment;
use agora_transport::socket::FrameReader;
use agora_transport::wake::Doorbell;

use super::validate::{self, Action};
use crate::kernels::{KernelRegistry, KernelTable, SESSION_KERNEL_BIT};
use crate::session::{Credentials, QueueState, Session};

/// The buffers the harness's session allocates, in handle order.
pub const BUFFER_LENS: &[u64] = &[
    1, 3, 64, 256, 1000, 4096, 4096, 4096, 4096, 4096, 4096, 4096, 4096, 4096, 4096, 4096, 4096, 65536,
];

/// The tenant program's manifest (its kernels' ids have [`SESSION_KERNEL_BIT`] set).
pub const PROGRAM_MANIFEST: &str = r#"
[kernels.stencil]
params = ["input: f32 read", "output: f32 write", "rows: i32", "cols: i32"]
dims = 2
range = ["rows", "cols"]
require = ["rows >= 1", "cols >= 1"]
sizes = { input = "rows * cols", output = "rows * cols" }

[kernels.reduce]
params = ["input: f32 read", "output: f32 write", "n: i32"]
range = ["(n + 255) / 256"]
require = ["n >= 1"]
sizes = { input = "n", output = "(n + 255) / 256" }

[kernels.mix]
params = ["a: f64 readwrite", "x: f64", "k: u64", "b: u32 write"]
dims = 3
require = ["x >= 0.5 || k % 3 == 1"]
sizes = { a = "ceil(x * k) + range1", b = "max(range0, k) * range2" }
"#;

/// A session with buffers and queues, and the daemon's kernel table.
pub struct ValidateHarness {
    session: Session,
    kernels: Arc<KernelTable>,
    /// Live buffer handles with their lengths (as in [`BUFFER_LENS`]).
    pub buffers: Vec<(u64, u64)>,
    /// A released buffer's handle.
    pub stale_buffer: u64,
    /// The live queue's handle.
    pub queue: u64,
    /// A released queue's handle.
    pub stale_queue: u64,
    /// Kernel ids a launch may name: the library's, then the program's (with
    /// [`SESSION_KERNEL_BIT`]), each with its parameters.
    pub kernels_ids: Vec<(u32, Vec<agora_protocol::ParamKind>, usize)>,
}

/// How a resolved task uses one of its buffers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BufferUse {
    /// The argument slot it came from.
    pub slot: usize,
    /// The buffer's heap offset and length.
    pub heap_offset: u64,
    /// Its length.
    pub len: u64,
    /// The byte range of it the task reads or writes (`start`, `len`).
    pub range: (u64, u64),
    /// Whether the task may write it.
    pub writes: bool,
    /// Whether a launch overwrites it whole (its old contents need not reach the device).
    pub overwrites: bool,
    /// Whether the heap accepts the range (`heap_ptr`, what the later stages call).
    pub in_heap: bool,
}

/// What the validate stage made of a descriptor.
#[derive(Debug, Clone, PartialEq)]
pub enum Outcome {
    /// A release (`ReleaseBuffer`, `ReleaseQueue`, `ReleaseProgram`) that would be carried out.
    Released,
    /// A task ready for placement.
    Ready {
        /// Its operation.
        op: Op,
        /// The kernel id of a launch.
        kernel: Option<u32>,
        /// Work items (launches).
        items: u64,
        /// Range that runs, 1-padded (launches): a row window's rows in the first dimension.
        range: [u64; 3],
        /// Bytes the size rule says the launch uses.
        touched_bytes: u64,
        /// Its buffers.
        buffers: Vec<BufferUse>,
        /// The cost estimate.
        estimated_ns: f64,
    },
}

impl ValidateHarness {
    /// Builds the session (a memfd segment with a 1 MiB heap).
    pub fn new() -> Self {
        let geometry = Geometry::new(8, 8, 1 << 20).expect("geometry");
        let segment = Segment::create("agora-fuzz", geometry).expect("segment");
        let (stream, _peer) = UnixStream::pair().expect("socketpair");
        let doorbell = Doorbell::new().expect("eventfd");
        let mut session = Session::new(
            1,
            Credentials::default(),
            "fuzz".into(),
            std::sync::Arc::new(stream),
            FrameReader::default(),
            doorbell,
            segment,
            16,
            64,
            u64::MAX,
        );
        let mut buffers = Vec::new();
        for &len in BUFFER_LENS {
            let (handle, _) = session.alloc_buffer(len).expect("buffer");
            buffers.push((handle, len));
        }
        let (stale_buffer, _) = session.alloc_buffer(128).expect("buffer");
        assert!(session.release_buffer(stale_buffer));
        let queue_state = || QueueState::new("q", QueueClass::Batch, None, None);
        let queue = session.queues.insert(queue_state()).expect("queue");
        let stale_queue = session.queues.insert(queue_state()).expect("queue");
        session.queues.remove(stale_queue).expect("queue");
        let kernels = KernelRegistry::library_only().snapshot();
        let mut kernels_ids: Vec<_> = kernels
            .current()
            .into_iter()
            .map(|(id, k)| (id, k.params.iter().map(|p| p.kind).collect(), 1))
            .collect();
        let specs = agora_packages::program_manifest(PROGRAM_MANIFEST, "the fuzz program").expect("manifest");
        let defs: Vec<KernelRef> = specs
            .into_iter()
            .map(|s| {
                KernelRef::Shared(Arc::new(KernelDef {
                    cuda: None,
                    name: Cow::Owned(s.name),
                    doc: Cow::Owned(s.doc),
                    params: Cow::Owned(s.params),
                    cost: Cost::PerItemNs(1.0),
                    chunkable: s.chunkable,
                    check: s.check,
                    cpu: None,
                    opencl: None,
                }))
            })
            .collect();
        for (index, def) in defs.iter().enumerate() {
            let dims = match def.name.as_ref() {
                "stencil" => 2,
                "mix" => 3,
                _ => 1,
            };
            kernels_ids.push((
                index as u32 | SESSION_KERNEL_BIT,
                def.params.iter().map(|p| p.kind).collect(),
                dims,
            ));
        }
        session.program_kernels.install(defs);
        ValidateHarness {
            session,
            kernels,
            buffers,
            stale_buffer,
            queue,
            stale_queue,
            kernels_ids,
        }
    }

    /// Decodes and resolves `descriptor` as the dispatcher does, leaving the session unchanged.
    pub fn validate(&self, descriptor: &TaskDescriptor) -> Result<Outcome, TaskError> {
        let session = &self.session;
        let d = descriptor.decode()?;
        match d.op {
            Op::ReleaseBuffer => {
                let handle = d.buffer_arg(0)?;
                return match session.buffers.get(handle) {
                    Some(_) => Ok(Outcome::Released),
                    None => Err(TaskError::InvalidHandle { index: 0, handle }),
                };
            }
            Op::ReleaseQueue => {
                return match session.queues.get(d.queue) {
                    Some(_) => Ok(Outcome::Released),
                    None => Err(TaskError::UnknownQueue(d.queue)),
                }
            }
            Op::ReleaseProgram => {
                return match session.programs.as_ref().is_some_and(|p| p.holds(d.kernel)) {
                    true => Ok(Outcome::Released),
                    false => Err(TaskError::UnknownKernel(d.kernel)),
                }
            }
            _ => {}
        }
        let ready = validate::resolve(session, &self.kernels, &d)?;
        let mut buffers = Vec::new();
        for (slot, entry) in ready.buffers.iter().enumerate() {
            let Some((record, access, overwrites)) = entry else {
                continue;
            };
            let range = match &ready.action {
                Action::Fill { offset, len, .. } => (*offset, *len),
                Action::Copy {
                    src_offset,
                    dst_offset,
                    len,
                } => (if slot == 0 { *src_offset } else { *dst_offset }, *len),
                _ => (0, record.len),
            };
            buffers.push(BufferUse {
                slot,
                heap_offset: record.offset,
                len: record.len,
                range,
                writes: access.writes(),
                overwrites: *overwrites,
                in_heap: validate::heap_ptr(session, record, range.0, range.1).is_ok(),
            });
        }
        let (kernel, range) = match &ready.action {
            Action::Launch { id, range, window, .. } => {
                // What runs: a row window's rows in the first dimension.
                let mut runs = *range;
                if let Some((first, end)) = window {
                    runs[0] = end - first;
                }
                (Some(*id), runs)
            }
            _ => (None, [0; 3]),
        };
        Ok(Outcome::Ready {
            op: d.op,
            kernel,
            items: ready.items,
            range,
            touched_bytes: ready.touched_bytes,
            buffers,
            estimated_ns: ready.estimated_ns,
        })
    }
}

impl Default for ValidateHarness {
    fn default() -> Self {
        Self::new()
    }
}
