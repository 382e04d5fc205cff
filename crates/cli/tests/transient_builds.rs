//! Issue 22, item 3b, against real `agora serve` processes: an OpenCL build that fails for a
//! transient reason (the daemon out of file descriptors) is retried later, never cached as
//! broken, and does not abort the daemon.
//!
//! Each daemon (OpenCL on; PoCL with a private, empty kernel cache, so a build really compiles)
//! runs a saxpy on its OpenCL device, then has its open-file limit lowered and is filled with
//! idle connections until it refuses more. A kernel is launched on a queue that prefers OpenCL:
//! * one of a program the daemon never built (`stream.triad`): its build finds no descriptor;
//! * one of a program already built (`stream.copy` ran) but never launched itself: PoCL would
//!   compile, link and `dlopen` it at this first launch, and aborted the daemon (SIGABRT, "Final
//!   linking of kernel stream_triad failed") when it could not.
//!
//! The launch fails (or succeeds, if the compiler found its descriptors; then its result is
//! exact). The connections go and the limit is restored; the same kernel then runs on the OpenCL
//! device, not moved to the CPU, with an exact result. The daemon lives throughout.

use std::os::unix::net::UnixStream;
use std::path::PathBuf;
use std::process::Stdio;
use std::time::{Duration, Instant};

use agora::{Arg, Buffer, DeviceKind, Error, Queue, QueueClass, QueueOptions, Session};
use agora_test_support::{eventually, last_device, require_opencl, temp_dir, Daemon};
use rustix::process::{getrlimit, prlimit, Pid, Resource, Rlimit};

const AGORA: &str = env!("CARGO_BIN_EXE_agora");

/// Elements of every buffer.
const N: usize = 4096;

/// A daemon whose log (`AGORA_LOG=warn`) goes to `DIR/daemon.log`, with PoCL's kernel cache in
/// `DIR/pocl`.
fn start_logged(tag: &str) -> (Daemon, PathBuf) {
    let dir = temp_dir(tag);
    let log = dir.path().join("daemon.log");
    let pocl = dir.path().join("pocl");
    std::fs::create_dir_all(&pocl).unwrap();
    let file = std::fs::File::create(&log).unwrap();
    let args = [
        "--cpu-lanes",
        "1",
        "--opencl-lanes",
        "1",
        "--hello-timeout-ms",
        "120000",
    ];
    let daemon = Daemon::start_in_with(AGORA, dir, &args, |c| {
        c.stderr(Stdio::from(file)).env("POCL_CACHE_DIR", &pocl);
    });
    (daemon, log)
}

fn open_fds(pid: u32) -> u64 {
    std::fs::read_dir(format!("/proc/{pid}/fd")).unwrap().count() as u64
}

/// A buffer of `N` copies of `value`, on the queue's device.
fn filled(s: &Session, q: &Queue, value: f32) -> Buffer {
    let b = s.buffer_from(&vec![value; N]).unwrap();
    q.sync_to(&b).unwrap();
    q.finish().unwrap();
    b
}

/// `stream.triad` into `a` (3 × 2 + 1 = 7 everywhere), read back.
fn triad(s: &Session, q: &Queue, b: &Buffer, c: &Buffer, a: &Buffer) -> Result<(), Error> {
    let triad = s.kernel("stream.triad").unwrap();
    q.launch(&triad, &[Arg::F32(3.0), b.into(), c.into(), a.into()], N as u64)?;
    q.sync_from(a)?;
    q.finish()
}

/// Starts a daemon, warms its OpenCL device with a saxpy (and, with `built`, builds the stream
/// program by running `stream.copy`), starves it of descriptors, launches `stream.triad`, gives
/// the descriptors back and requires `stream.triad` to run on the OpenCL device.
/// `logged` is what the daemon's log must say when the starved launch fails.
fn starve_then_recover(tag: &str, built: bool, logged: &str) {
    let (mut daemon, log) = start_logged(tag);
    let read_log = || std::fs::read_to_string(&log).unwrap_or_default();
    let pid = daemon.pid();
    let s = daemon.session_named(tag);
    require_opencl(&s);
    let status = s.status().unwrap();
    let opencl = &status.devices.iter().find(|d| d.kind == "opencl").unwrap().name;
    let q = s
        .queue_with(QueueOptions {
            name: "on-opencl".into(),
            class: QueueClass::Batch,
            preferred_device: Some(DeviceKind::OpenCl),
            sla: None,
        })
        .unwrap();
    let on_opencl = || last_device(&s, "on-opencl").as_ref() == Some(opencl);

    // Everything the launches need, made while descriptors are plentiful; a saxpy warms the
    // device (PoCL's compiler and a first kernel), as in a daemon in service.
    let saxpy = s.kernel("saxpy").unwrap();
    let x = filled(&s, &q, 1.0);
    let y = filled(&s, &q, 2.0);
    q.launch(&saxpy, &[Arg::F32(3.0), (&x).into(), (&y).into()], N as u64)
        .unwrap();
    q.sync_from(&y).unwrap();
    q.finish().unwrap();
    assert!(
        y.as_slice::<f32>().iter().all(|v| *v == 5.0),
        "saxpy on OpenCL is exact"
    );
    assert!(on_opencl(), "saxpy ran on {opencl}");
    let b = filled(&s, &q, 1.0);
    let c = filled(&s, &q, 2.0);
    let a = filled(&s, &q, 0.0);
    if built {
        let copy = s.kernel("stream.copy").unwrap();
        q.launch(&copy, &[(&c).into(), (&x).into()], N as u64).unwrap();
        q.sync_from(&x).unwrap();
        q.finish().unwrap();
        assert!(x.as_slice::<f32>().iter().all(|v| *v == 2.0), "stream.copy is exact");
        assert!(on_opencl(), "stream.copy ran on {opencl}");
    }

    // Out of descriptors: a soft limit a few above what the daemon holds, then idle connections
    // until it refuses more. (The daemon inherited this process's hard limit.)
    let limit = open_fds(pid) + 8;
    let original = prlimit(
        Pid::from_raw(pid as i32),
        Resource::Nofile,
        Rlimit {
            current: Some(limit),
            maximum: getrlimit(Resource::Nofile).maximum,
        },
    )
    .expect("the test may lower the daemon's open-file limit");
    let held: Vec<UnixStream> = (0..32)
        .filter_map(|_| UnixStream::connect(daemon.socket()).ok())
        .collect();
    assert!(
        eventually(Duration::from_secs(10), || read_log()
            .contains("out of file descriptors")),
        "the daemon did not run out of descriptors:\n{}",
        read_log()
    );
    let started = Instant::now();
    let starved = triad(&s, &q, &b, &c, &a);
    eprintln!(
        "{tag}: stream.triad with {} of {limit} descriptors open: {starved:?} after {:?}",
        open_fds(pid),
        started.elapsed()
    );
    daemon.assert_alive();
    match &starved {
        Ok(()) => assert!(a.as_slice::<f32>().iter().all(|v| *v == 7.0), "stream.triad is exact"),
        Err(e) => {
            assert!(
                read_log().contains(logged),
                "the log does not say {logged:?}:\n{}",
                read_log()
            );
            // The client is told what ran out and that it is transient (a typed error), not an
            // OpenCL error code.
            let message = e.to_string();
            assert!(
                message.contains("ran out of file descriptors") && message.contains("transient"),
                "the client's error does not say what ran out and that it is transient: {message}"
            );
        }
    }

    // Descriptors again; past the retry backoff (100 ms after one failure), the next launch
    // builds and runs the kernel.
    drop(held);
    prlimit(Pid::from_raw(pid as i32), Resource::Nofile, original).expect("the limit is restored");
    assert!(
        eventually(Duration::from_secs(10), || open_fds(pid) + 4 < limit),
        "the daemon did not close the connections: {} descriptors open",
        open_fds(pid)
    );
    std::thread::sleep(Duration::from_millis(200));
    let a = filled(&s, &q, 0.0);
    triad(&s, &q, &b, &c, &a).unwrap_or_else(|e| {
        panic!(
            "stream.triad failed after the descriptors came back: {e}\n{}",
            read_log()
        )
    });
    assert!(a.as_slice::<f32>().iter().all(|v| *v == 7.0), "stream.triad is exact");
    assert!(
        on_opencl(),
        "stream.triad ran elsewhere than {opencl} (its program cached as broken?):\n{}",
        read_log()
    );
    daemon.assert_alive();
}

#[test]
fn a_build_that_ran_out_of_descriptors_is_retried_and_runs_on_opencl() {
    starve_then_recover(
        "transient-build",
        false,
        "OpenCL program failed to build for lack of a resource",
    );
}

#[test]
fn a_first_launch_out_of_descriptors_fails_without_aborting_the_daemon() {
    starve_then_recover(
        "transient-first-launch",
        true,
        "too few file descriptors left to compile a kernel at its first launch",
    );
}
