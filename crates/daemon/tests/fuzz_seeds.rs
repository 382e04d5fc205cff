//! The fuzz targets' seed corpus (`fuzz/corpus/TARGET/seed-*`), generated from the real types so
//! that it follows the formats: valid descriptors for the validate stage's session, every
//! control request and response, configuration files, kernel manifests. This test checks that
//! every seed is accepted by its parser; with `AGORA_FUZZ_SEEDS=write` it also (re)writes them:
//!
//! ```text
//! AGORA_FUZZ_SEEDS=write cargo test --release -p agora-daemon --test fuzz_seeds
//! ```

use std::path::Path;

use agora_daemon::fuzzing::{Outcome, ValidateHarness, PROGRAM_MANIFEST};
use agora_daemon::{DaemonConfig, PolicyKind, SimDeviceConfig, SimKernelProfile};
use agora_protocol::control::{
    decode_body, encode_frame, ControlError, DeviceStatus, KernelListing, LaneStatus, PackageListing, QueueClass,
    QueueStatus, ReloadReport, Request, Response, SessionDetails, SessionStatus, StatusReport,
};
use agora_protocol::{
    Access, ArgTag, KernelSignature, Op, ParamKind, ParamSpec, RawArg, ScalarType, TaskDescriptor, TaskError,
};

type Seeds = Vec<(String, Vec<u8>)>;

fn descriptor(op: Op, queue: u64, args: &[RawArg]) -> TaskDescriptor {
    let mut d = TaskDescriptor::zeroed();
    d.task_id = 42;
    d.op = op as u32;
    d.queue = queue;
    d.arg_count = args.len() as u32;
    d.args[..args.len()].copy_from_slice(args);
    d
}

fn scalar(t: ScalarType, v: u64) -> RawArg {
    RawArg {
        tag: ArgTag::for_scalar(t) as u32,
        reserved: 0,
        value: match t {
            ScalarType::F32 => u64::from((v as f32).to_bits()),
            ScalarType::F64 => (v as f64).to_bits(),
            _ => v,
        },
    }
}

/// Descriptors for the harness's session: a launch of every kernel (distinct large buffers,
/// scalars 16, range 16 per dimension), each transfer, the releases, and a few wrong ones.
fn descriptors(h: &ValidateHarness) -> Vec<(String, TaskDescriptor)> {
    let q = h.queue;
    let big: Vec<u64> = h.buffers.iter().filter(|(_, l)| *l >= 4096).map(|(b, _)| *b).collect();
    let (small, tiny) = (h.buffers[2].0, h.buffers[0].0);
    let mut out = Vec::new();
    for (id, params, dims) in &h.kernels_ids {
        let mut next = big.iter();
        let args: Vec<RawArg> = params
            .iter()
            .map(|p| match p {
                ParamKind::Buffer { .. } => RawArg::buffer(*next.next().expect("enough buffers")),
                ParamKind::Scalar(t) => scalar(*t, 16),
            })
            .collect();
        let mut d = descriptor(Op::Launch, q, &args);
        d.kernel = *id;
        d.dims = *dims as u32;
        d.range[..*dims].fill(16);
        out.push((format!("launch-{id:x}"), d));
    }
    let u = RawArg::u64;
    out.extend([
        ("sync-to".into(), descriptor(Op::SyncTo, q, &[RawArg::buffer(big[0])])),
        (
            "sync-from-part".into(),
            descriptor(Op::SyncFrom, q, &[RawArg::buffer(big[1]), u(64), u(128)]),
        ),
        (
            "memset".into(),
            descriptor(Op::Memset, q, &[RawArg::buffer(small), u(0xab), u(8), u(16)]),
        ),
        (
            "copy".into(),
            descriptor(
                Op::Copy,
                q,
                &[RawArg::buffer(big[0]), RawArg::buffer(big[1]), u(0), u(512), u(1024)],
            ),
        ),
        (
            "copy-within".into(),
            descriptor(
                Op::Copy,
                q,
                &[RawArg::buffer(big[2]), RawArg::buffer(big[2]), u(0), u(8), u(8)],
            ),
        ),
        (
            "release-buffer".into(),
            descriptor(Op::ReleaseBuffer, q, &[RawArg::buffer(tiny)]),
        ),
        ("release-queue".into(), descriptor(Op::ReleaseQueue, q, &[])),
        (
            "stale-buffer".into(),
            descriptor(Op::SyncTo, q, &[RawArg::buffer(h.stale_buffer)]),
        ),
        (
            "stale-queue".into(),
            descriptor(Op::SyncTo, h.stale_queue, &[RawArg::buffer(big[0])]),
        ),
        (
            "out-of-bounds".into(),
            descriptor(Op::Memset, q, &[RawArg::buffer(small), u(1), u(60), u(8)]),
        ),
    ]);
    out
}

fn signature() -> KernelSignature {
    KernelSignature {
        name: "saxpy".into(),
        params: vec![
            ParamSpec {
                name: "a".into(),
                kind: ParamKind::Scalar(ScalarType::F32),
            },
            ParamSpec {
                name: "x".into(),
                kind: ParamKind::Buffer {
                    element: ScalarType::F32,
                    access: Access::Read,
                },
            },
            ParamSpec {
                name: "y".into(),
                kind: ParamKind::Buffer {
                    element: ScalarType::F32,
                    access: Access::ReadWrite,
                },
            },
        ],
        doc: "y = a*x + y".into(),
    }
}

fn requests() -> Vec<Request> {
    vec![
        Request::Hello {
            version: agora_protocol::PROTOCOL_VERSION,
            client_name: "fuzz".into(),
            heap_bytes: Some(1 << 20),
        },
        Request::AllocBuffer { len: 4096 },
        Request::CreateQueue {
            name: "q".into(),
            class: QueueClass::Latency,
            preferred_device: Some("cpu".into()),
            sla_ms: Some(2.5),
        },
        Request::LookupKernel { name: "saxpy".into() },
        Request::ListKernels,
        Request::KernelCatalog,
        Request::ReloadKernels,
        Request::BuildProgram {
            language: "opencl".into(),
            code: b"__kernel void k(__global float *x) { x[get_global_id(0)] = 1.0f; }".to_vec(),
            manifest: Some("[kernels.k]\nparams = [\"x: f32 write\"]\n".into()),
            name: "k.cl".into(),
        },
        Request::Status,
        Request::SessionStatus {
            session: 3,
            first_queue: 8,
        },
        Request::SaveTrace,
        Request::Drain {
            device: "cpu0".into(),
            drain: true,
            evacuate: true,
        },
        Request::Resume {
            version: agora_protocol::PROTOCOL_VERSION,
            client_name: "resumed".into(),
            previous_session: 7,
            submission_capacity: 1024,
            completion_capacity: 1024,
            heap_len: 1 << 20,
            buffers: vec![agora_protocol::control::ResumedBuffer {
                handle: 1 << 32 | 3,
                offset: 128,
                len: 4096,
                lost: true,
            }],
            queues: vec![agora_protocol::control::ResumedQueue {
                handle: 1 << 32,
                name: "q".into(),
                class: QueueClass::Latency,
                preferred_device: Some("opencl".into()),
                sla_ms: Some(2.0),
            }],
            kernels: vec!["saxpy".into()],
            more: true,
        },
        Request::ResumeMore {
            buffers: vec![],
            queues: vec![],
            more: false,
        },
    ]
}

fn session_status() -> SessionStatus {
    SessionStatus {
        id: 3,
        pid: 1234,
        uid: 1000,
        gid: 1000,
        name: "fuzz".into(),
        queues: vec![QueueStatus {
            name: "q".into(),
            class: QueueClass::Latency,
            in_flight: 2,
            bound_to: Some("cpu0/1".into()),
            preferred: Some(agora_protocol::DeviceKind::Cpu),
            sla_ms: Some(5.0),
            last_device: Some("cpu0".into()),
            moving: false,
        }],
        queue_count: 1,
        heap_used: 4096,
        heap_quota: 1 << 20,
        ..Default::default()
    }
}

fn responses() -> Vec<Response> {
    let status = StatusReport {
        pid: 1,
        version: "0.1.0".into(),
        uptime_s: 1.5,
        policy: "rr".into(),
        devices: vec![DeviceStatus {
            name: "cpu0".into(),
            kind: agora_protocol::DeviceKind::Cpu,
            description: "host CPU".into(),
            memory_bytes: 0,
            memory_used: 0,
            memory_cached: 0,
            utilization_percent: None,
            threads_per_lane: 2,
            lanes: vec![LaneStatus {
                busy: true,
                queued: 1,
                completed: 10,
                busy_ns: 1000,
            }],
            draining: false,
            failed: false,
        }],
        sessions: vec![session_status()],
        live_sessions: 1,
        latency_policy: "elastic".into(),
        ..Default::default()
    };
    vec![
        Response::Welcome {
            session: 1,
            submission_capacity: 256,
            completion_capacity: 256,
            heap_len: 1 << 20,
        },
        Response::Buffer {
            handle: 1 << 32,
            offset: 0,
            len: 4096,
        },
        Response::Queue { handle: 1 << 32 },
        Response::Kernel {
            id: 1,
            signature: signature(),
        },
        Response::Kernels(vec![signature()]),
        Response::KernelCatalog {
            kernels: vec![KernelListing {
                id: 1,
                signature: signature(),
                package: Some("bench".into()),
                implementations: vec!["cpu".into(), "opencl".into()],
                chunkable: true,
            }],
            packages: vec![PackageListing {
                name: "bench".into(),
                version: Some("1.0".into()),
                dir: "/opt/agora/bench".into(),
                kernels: 4,
            }],
        },
        Response::KernelsReloaded(ReloadReport {
            packages: vec!["bench".into()],
            changed: vec!["bench.reduce".into()],
            removed: vec![],
            errors: vec!["x: broken".into()],
            kernels: 20,
        }),
        Response::Program {
            kernels: vec![(1 << 31, signature())],
            log: "warning".into(),
            cached: false,
        },
        Response::Status(Box::new(status)),
        Response::SessionDetails(Box::new(SessionDetails {
            session: session_status(),
            first_queue: 0,
            next_queue: Some(8),
        })),
        Response::TraceSaved {
            path: "agora.trace.json".into(),
            spans: 10,
        },
        Response::Drained {
            device: "cpu0".into(),
            draining: true,
            queues_bound: 1,
            evacuated_buffers: 2,
            evacuated_bytes: 8192,
            migrations: 1,
        },
        Response::Resumed {
            session: 9,
            kernels: vec![Some(4), None],
        },
        Response::Error(ControlError::SegmentInUse { session: 3 }),
        Response::Error(ControlError::QuotaExceeded {
            requested: 1,
            available: 0,
            largest_free: 0,
            quota: 1,
        }),
        Response::Error(ControlError::UnknownKernel {
            name: "saxp".into(),
            suggestions: vec!["saxpy".into()],
        }),
        Response::Error(ControlError::NameTooLong {
            what: "queue".into(),
            len: 300,
            limit: 256,
        }),
    ]
}

fn configs() -> Vec<(String, String)> {
    let mut rich = DaemonConfig {
        policy: PolicyKind::Perf,
        metrics: Some(([127, 0, 0, 1], 9464).into()),
        trace: Some("agora.trace.json".into()),
        device_quota: 3 << 20,
        ..Default::default()
    };
    rich.sims.push(SimDeviceConfig {
        kernels: Some(vec!["sgemm".into()]),
        ..SimDeviceConfig::named("fast")
    });
    rich.sims[0].profile.insert(
        "sgemm".into(),
        SimKernelProfile {
            launch_ns: 1.0,
            ns_per_item: 2.0,
        },
    );
    vec![
        ("default".into(), DaemonConfig::default().to_toml()),
        ("rich".into(), rich.to_toml()),
        (
            "partial".into(),
            "[scheduler]\npolicy = \"energy\"\n[sessions]\nquota = \"512M\"\n[opencl]\nmemory_limit = 1048576\n\
             [[sim]]\nname = \"s\"\nmemory = \"64M\"\n"
                .into(),
        ),
    ]
}

/// Manifests with a launch shape after a NUL (range and scalars 16, buffers of 4096 elements).
fn manifests() -> Vec<(String, Vec<u8>)> {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../examples/packages");
    let mut texts = vec![("program".to_string(), PROGRAM_MANIFEST.to_string())];
    let mut dirs: Vec<_> = std::fs::read_dir(&root).unwrap().map(|e| e.unwrap().path()).collect();
    dirs.sort();
    for dir in dirs {
        let name = dir.file_name().unwrap().to_string_lossy().to_string();
        texts.push((name, std::fs::read_to_string(dir.join("package.toml")).unwrap()));
    }
    texts
        .into_iter()
        .map(|(name, text)| {
            let mut bytes = text.into_bytes();
            bytes.push(0);
            for v in [16u64, 16, 16, 16, 4096, 16, 4096, 16, 16, 16, 16] {
                bytes.extend_from_slice(&v.to_le_bytes());
            }
            (name, bytes)
        })
        .collect()
}

fn seeds() -> Vec<(&'static str, Seeds)> {
    let h = ValidateHarness::new();
    let mut descriptor_seeds = Seeds::new();
    let mut ready = 0;
    for (name, d) in descriptors(&h) {
        match h.validate(&d) {
            Ok(Outcome::Ready { .. } | Outcome::Released) => ready += 1,
            Err(TaskError::Internal(place)) => panic!("{name}: internal error {place}"),
            Err(_) => {}
        }
        descriptor_seeds.push((name, bytemuck::bytes_of(&d).to_vec()));
    }
    assert!(ready >= 15, "only {ready} seed descriptors are valid");
    let request_seeds: Seeds = requests()
        .iter()
        .enumerate()
        .map(|(i, r)| {
            let body = postcard::to_stdvec(r).unwrap();
            assert_eq!(&decode_body::<Request>(&body).unwrap(), r);
            (format!("{i:02}"), body)
        })
        .collect();
    let response_seeds: Seeds = responses()
        .iter()
        .enumerate()
        .map(|(i, r)| {
            let body = postcard::to_stdvec(r).unwrap();
            assert_eq!(&decode_body::<Response>(&body).unwrap(), r);
            (format!("{i:02}"), body)
        })
        .collect();
    // Frames: a byte choosing the chunk sizes, then a few requests framed back to back.
    let mut frame_seeds = Seeds::new();
    for (i, group) in requests().chunks(3).enumerate() {
        let mut bytes = vec![i as u8 * 37];
        for r in group {
            bytes.extend(encode_frame(r).unwrap());
        }
        frame_seeds.push((format!("{i:02}"), bytes));
    }
    let config_seeds: Seeds = configs()
        .into_iter()
        .map(|(name, text)| {
            DaemonConfig::from_toml(&text).unwrap_or_else(|e| panic!("{name}: {e}"));
            (name, text.into_bytes())
        })
        .collect();
    let manifest_seeds: Seeds = manifests()
        .into_iter()
        .map(|(name, bytes)| {
            let text = std::str::from_utf8(&bytes[..bytes.iter().position(|b| *b == 0).unwrap()]).unwrap();
            let parsed = if name == "program" {
                agora_packages::program_manifest(text, &name).map(|k| k.len())
            } else {
                agora_packages::parse_package_manifest(text, &name).map(|(_, k)| k.len())
            };
            assert!(parsed.unwrap_or_else(|e| panic!("{name}: {e}")) > 0);
            (name, bytes)
        })
        .collect();
    vec![
        ("descriptor", descriptor_seeds.clone()),
        ("validate", descriptor_seeds),
        ("frames", frame_seeds),
        ("request", request_seeds),
        ("response", response_seeds),
        ("config", config_seeds),
        ("manifest", manifest_seeds),
    ]
}

#[test]
fn fuzz_seeds_are_valid_inputs() {
    let all = seeds();
    let total: usize = all.iter().flat_map(|(_, s)| s).map(|(_, b)| b.len()).sum();
    assert!(total < 256 << 10, "seeds take {total} bytes");
    if std::env::var("AGORA_FUZZ_SEEDS").as_deref() == Ok("write") {
        let corpus = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../fuzz/corpus");
        for (target, seeds) in all {
            let dir = corpus.join(target);
            std::fs::create_dir_all(&dir).unwrap();
            for (name, bytes) in seeds {
                std::fs::write(dir.join(format!("seed-{name}")), bytes).unwrap();
            }
        }
    }
}
