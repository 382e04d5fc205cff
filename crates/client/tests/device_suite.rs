//! The device suite: every kernel case of the library (`agora_kernels::cases::all()`, realistic
//! sizes and edge cases, expected values from host references) run through a real daemon on every
//! kind of device it has, each checked against the reference.
//!
//! Needs an OpenCL device (PoCL, installed by `make setup`): the test fails rather than skipping
//! when there is none.

use agora::testing::{ArgTag, RawArg};
use agora::{Arg, Buffer, DeviceKind, NdRange, QueueOptions, Session};

mod common;
use agora_kernels::cases::{self, KernelCase};

/// The client argument for a case's wire argument (buffer `i` is the case's `i`-th buffer).
fn arg<'a>(raw: &RawArg, buffers: &'a [Buffer]) -> Arg<'a> {
    match ArgTag::from_u32(raw.tag) {
        Some(ArgTag::Buffer) => Arg::Buffer(&buffers[raw.value as usize]),
        Some(ArgTag::I32) => Arg::I32(raw.value as u32 as i32),
        Some(ArgTag::U32) => Arg::U32(raw.value as u32),
        Some(ArgTag::I64) => Arg::I64(raw.value as i64),
        Some(ArgTag::U64) => Arg::U64(raw.value),
        Some(ArgTag::F32) => Arg::F32(f32::from_bits(raw.value as u32)),
        Some(ArgTag::F64) => Arg::F64(f64::from_bits(raw.value)),
        None => panic!("case with an invalid argument tag {}", raw.tag),
    }
}

fn run_case(session: &Session, queue: &agora::Queue, case: &KernelCase) -> Result<(), String> {
    let kernel = session.kernel(case.kernel).map_err(|e| e.to_string())?;
    let buffers = case
        .buffers()
        .iter()
        .map(|b| session.buffer_from(b))
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| e.to_string())?;
    let args: Vec<Arg<'_>> = case.raw_args().iter().map(|raw| arg(raw, &buffers)).collect();
    let range = match case.range.as_slice() {
        [x] => NdRange::d1(*x),
        [x, y] => NdRange::d2(*x, *y),
        [x, y, z] => NdRange::d3(*x, *y, *z),
        other => return Err(format!("bad range {other:?}")),
    };
    for b in &buffers {
        let _ = queue.sync_to(b).map_err(|e| e.to_string())?;
    }
    let _ = queue.launch(&kernel, &args, range).map_err(|e| e.to_string())?;
    for b in &buffers {
        let _ = queue.sync_from(b).map_err(|e| e.to_string())?;
    }
    queue.finish().map_err(|e| e.to_string())?;
    let results: Vec<&[u8]> = buffers.iter().map(|b| b.as_slice::<u8>()).collect();
    // Buffers may be longer than requested (never shorter): compare the requested bytes.
    let results: Vec<&[u8]> = results
        .iter()
        .zip(case.buffers())
        .map(|(r, init)| &r[..init.len()])
        .collect();
    case.check(&results)
}

#[test]
fn every_kernel_case_passes_on_every_device() {
    let (daemon, session) = common::daemon("device-suite");
    common::require_opencl(&session);
    let all = cases::all();
    let mut failures = Vec::new();
    for kind in [DeviceKind::Cpu, DeviceKind::OpenCl] {
        let queue = session
            .queue_with(QueueOptions {
                name: format!("{kind:?}"),
                preferred_device: Some(kind),
                sla: None,
                ..Default::default()
            })
            .unwrap();
        for case in &all {
            let started = std::time::Instant::now();
            if let Err(e) = run_case(&session, &queue, case) {
                failures.push(format!("{kind:?} {}: {e}", case.name));
            }
            eprintln!(
                "{kind:?} {:<60} {:>8.1} ms",
                case.name,
                started.elapsed().as_secs_f64() * 1e3
            );
        }
    }
    // The OpenCL preference was honoured: its lanes ran at least one job per case. (CPU cases
    // may run inline on the dispatcher, which no lane counts.)
    let status = session.status().unwrap();
    let completed: u64 = status
        .devices
        .iter()
        .filter(|d| d.kind == "opencl")
        .flat_map(|d| d.lanes.iter())
        .map(|l| l.completed)
        .sum();
    assert!(
        completed >= all.len() as u64,
        "OpenCL lanes ran {completed} jobs for {} cases",
        all.len()
    );
    assert!(
        failures.is_empty(),
        "{} of {} case runs failed:\n{}",
        failures.len(),
        2 * all.len(),
        failures.join("\n")
    );
    drop(session);
    daemon.stop().unwrap();
}
