//! Shared by the client's integration tests: an in-process daemon on a private socket in a
//! temporary directory (see `agora-test-support`), with the client suite's settings.

#![allow(dead_code, unused_imports)] // each test file uses a different part

use agora::testing::{ArgTag, RawArg};
use agora::{Arg, Buffer, NdRange, Session};
use agora_kernels::cases::KernelCase;
pub use agora_test_support::{require_opencl, EmbeddedDaemon};

/// Starts a daemon (CPU with two lanes, plus OpenCL devices when found) on a private socket and
/// opens a session with it. Strict coherence is on (every device computes on its own copies), so
/// a test that forgets a sync fails wherever its tasks run; tests that check placement details
/// (bytes moved, inline runs) use [`daemon_with`], which leaves it off.
pub fn daemon(tag: &str) -> (EmbeddedDaemon, Session) {
    daemon_with(tag, |c| c.strict_coherence = true)
}

/// Like [`daemon`], with settings changed by `tweak` first; the directory starts empty.
pub fn daemon_with(tag: &str, tweak: impl FnOnce(&mut agora_daemon::DaemonConfig)) -> (EmbeddedDaemon, Session) {
    let daemon = EmbeddedDaemon::start(&format!("client-{tag}"), |config| {
        config.cpu_lanes = 2;
        tweak(config);
    });
    let session = daemon.session();
    (daemon, session)
}

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

/// Runs one kernel case of the library on `queue` (buffers synced to it, launched, synced
/// back) and checks the results against the case's host reference.
pub fn run_case(session: &Session, queue: &agora::Queue, case: &KernelCase) -> Result<(), String> {
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
