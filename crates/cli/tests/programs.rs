//! Tenant programs (issue 13, part 2), against real `agora serve` processes: code a session
//! submits is built and run in its sandboxed executor process, never in the daemon.
//!
//! * an OpenCL program (saxpy and a 2-D stencil) builds and computes; a second session building
//!   the same source gets it from the program cache; a syntax error comes back with the
//!   compiler's log; a C shared object with a manifest computes too;
//! * while a second tenant runs verified built-in work, a kernel that writes far out of bounds
//!   or dereferences null fails with `KernelCrashed { signal: 11 }`, `abort()` with signal 6,
//!   an endless loop with `KernelTimeout` — and after each the same session's next launch
//!   works (a new executor), the neighbour's work all succeeds, and the daemon has as many
//!   open descriptors and child processes as before;
//! * limits: a 2 MB program, the 65th program a session holds at once, and a tenant the policy
//!   excludes are refused with messages naming the limit or setting; the same source built
//!   again is the program the session holds (same kernel ids, no new slot, no rebuild).

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use agora::{Arg, Error, Kernel, Queue, Session, TaskError};
use agora_protocol::control::{ControlError, MAX_PROGRAM_BYTES};
use agora_test_support::{eventually, temp_dir, Daemon};

const AGORA: &str = env!("CARGO_BIN_EXE_agora");

const GOOD: &str = r#"
__kernel void saxpy(const float a, __global const float *x, __global float *y) {
    size_t i = get_global_id(0);
    y[i] = a * x[i] + y[i];
}

// dst = src plus its four neighbours (clamped at the edges); range (h, w).
__kernel void stencil(const int h, const int w, __global const float *src, __global float *dst) {
    int r = get_global_id(0), c = get_global_id(1);
    float sum = src[r * w + c];
    sum += src[max(r - 1, 0) * w + c] + src[min(r + 1, h - 1) * w + c];
    sum += src[r * w + max(c - 1, 0)] + src[r * w + min(c + 1, w - 1)];
    dst[r * w + c] = sum;
}

__kernel void empty(__global float *y) {}
"#;

const BAD: &str = r#"
__kernel void scale2(__global float *y) { y[get_global_id(0)] *= 2.0f; }

// Writes 256 GiB past its buffer: nothing is mapped there.
__kernel void far_out_of_bounds(__global float *y) {
    size_t i = get_global_id(0);
    y[i + ((size_t)1 << 36)] = 1.0f;
}

// Never ends (a store per round, so it cannot be optimised away).
__kernel void endless(__global float *y) {
    size_t i = get_global_id(0);
    while (y[i] >= 0.0f) { y[i] += 1.0f; if (y[i] > 1.0e30f) y[i] = 0.0f; }
}
"#;

const C_SOURCE: &str = r#"
#include <signal.h>
#include <stdlib.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>
#include "agora_kernel.h"

// Tries what the sandbox forbids; returns which attempt succeeded (0: none did).
AGORA_KERNEL int c_escape(const AgoraKernelArgs *args, uint64_t begin, uint64_t end) {
    if (socket(AF_UNIX, SOCK_STREAM, 0) >= 0) return 1;
    if (socket(AF_INET, SOCK_STREAM, 0) >= 0) return 2;
    pid_t child = fork();
    if (child == 0) _exit(0);
    if (child > 0) return 3;
    if (kill(getppid(), 0) == 0) return 4;
    if (setsid() >= 0) return 5;
    return 0;
}

AGORA_KERNEL int c_scale(const AgoraKernelArgs *args, uint64_t begin, uint64_t end) {
    float a = agora_f32(args, 0);
    const float *x = args->args[1].data;
    float *y = args->args[2].data;
    for (uint64_t i = begin; i < end; i++) y[i] = a * x[i];
    return 0;
}

AGORA_KERNEL int c_null(const AgoraKernelArgs *args, uint64_t begin, uint64_t end) {
    volatile int *p = (volatile int *)0;
    *p = (int)(begin + end);
    return 0;
}

AGORA_KERNEL int c_abort(const AgoraKernelArgs *args, uint64_t begin, uint64_t end) {
    abort();
}

// Reports a failure of its own.
AGORA_KERNEL int c_fails(const AgoraKernelArgs *args, uint64_t begin, uint64_t end) {
    return 42;
}

// Runs for `ms` milliseconds of wall-clock time, then sets y[begin] to 1.
AGORA_KERNEL int c_spin(const AgoraKernelArgs *args, uint64_t begin, uint64_t end) {
    double ms = agora_f32(args, 0);
    struct timespec start, now;
    clock_gettime(CLOCK_MONOTONIC, &start);
    do {
        clock_gettime(CLOCK_MONOTONIC, &now);
    } while ((now.tv_sec - start.tv_sec) * 1e3 + (now.tv_nsec - start.tv_nsec) / 1e6 < ms);
    float *y = args->args[1].data;
    y[begin] = 1.0f;
    return 0;
}
"#;

const C_MANIFEST: &str = r#"
[kernels.scale]
doc = "y = a * x; range (n)"
params = ["a: f32", "x: f32 read", "y: f32 write"]
sizes = { x = "range0", y = "range0" }
cpu = { symbol = "c_scale" }

[kernels.escape]
params = ["y: f32 readwrite"]
sizes = { y = "range0" }
cpu = { symbol = "c_escape" }

[kernels.null_write]
params = ["y: f32 readwrite"]
sizes = { y = "range0" }
cpu = { symbol = "c_null" }

[kernels.abort]
params = ["y: f32 readwrite"]
sizes = { y = "range0" }
cpu = { symbol = "c_abort" }

[kernels.fails]
params = ["y: f32 readwrite"]
sizes = { y = "range0" }
cpu = { symbol = "c_fails" }

[kernels.spin]
params = ["ms: f32", "y: f32 readwrite"]
sizes = { y = "range0" }
cpu = { symbol = "c_spin" }
"#;

fn start(tag: &str, extra: &[&str]) -> Daemon {
    let mut args = vec!["--no-opencl", "--cpu-lanes", "2"];
    args.extend_from_slice(extra);
    Daemon::start(AGORA, tag, &args)
}

/// Builds `C_SOURCE` into a shared object in `dir`.
fn c_library(dir: &Path) -> Vec<u8> {
    let include = Path::new(env!("CARGO_MANIFEST_DIR")).join("../capi/include");
    let source = dir.join("kernels.c");
    let library = dir.join("libkernels.so");
    std::fs::write(&source, C_SOURCE).unwrap();
    let status = Command::new("cc")
        .args(["-shared", "-fPIC", "-O1", "-o"])
        .arg(&library)
        .arg("-I")
        .arg(&include)
        .arg(&source)
        .status()
        .expect("a C compiler (cc) builds the test's shared object");
    assert!(status.success(), "cc failed");
    std::fs::read(library).unwrap()
}

/// Runs `saxpy` (a program's, or the library's) over `n` items and checks the result.
fn saxpy_checked(session: &Session, queue: &Queue, saxpy: &Kernel, n: usize, seed: f32) -> Result<(), Error> {
    let x: Vec<f32> = (0..n).map(|i| i as f32 * 0.5 + seed).collect();
    let y: Vec<f32> = (0..n).map(|i| (i % 7) as f32).collect();
    let bx = session.buffer_from(&x)?;
    let by = session.buffer_from(&y)?;
    queue.sync_to(&bx)?;
    queue.sync_to(&by)?;
    queue.launch(saxpy, &[Arg::F32(3.0), (&bx).into(), (&by).into()], n)?;
    queue.sync_from(&by)?;
    queue.finish()?;
    let got = by.read_vec::<f32>();
    for i in 0..n {
        let want = 3.0 * x[i] + y[i];
        assert_eq!(got[i], want, "saxpy element {i}");
    }
    Ok(())
}

/// Open descriptors of process `pid`.
fn open_fds(pid: u32) -> usize {
    std::fs::read_dir(format!("/proc/{pid}/fd")).unwrap().count()
}

/// Processes whose parent is `pid` (zombies included).
fn children(pid: u32) -> usize {
    child_pids(pid).len()
}

/// The process ids of `pid`'s children (zombies included).
fn child_pids(pid: u32) -> Vec<u32> {
    std::fs::read_dir("/proc")
        .unwrap()
        .filter_map(|e| {
            let entry = e.ok()?;
            let child = entry.file_name().to_str()?.parse::<u32>().ok()?;
            let status = std::fs::read_to_string(entry.path().join("status")).ok()?;
            let ppid = status
                .lines()
                .find_map(|l| l.strip_prefix("PPid:"))?
                .trim()
                .parse::<u32>()
                .ok()?;
            (ppid == pid).then_some(child)
        })
        .collect()
}

/// `(open fds, children)` of `pid` once they equal `want`, or as they are after 5 s.
fn settled(pid: u32, want: (usize, usize)) -> (usize, usize) {
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        let now = (open_fds(pid), children(pid));
        if now == want || Instant::now() > deadline {
            return now;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// A second tenant running verified built-in saxpy until told to stop; returns how many runs
/// succeeded (any failure panics the thread).
fn neighbour(socket: PathBuf, stop: Arc<AtomicBool>) -> std::thread::JoinHandle<u64> {
    std::thread::spawn(move || {
        let session = agora_test_support::connect(&socket, Some("neighbour"));
        let queue = session.queue("neighbour").unwrap();
        let saxpy = session.kernel("saxpy").unwrap();
        let mut runs = 0u64;
        while !stop.load(Ordering::Relaxed) {
            saxpy_checked(&session, &queue, &saxpy, 4096, runs as f32).expect("the neighbour's work succeeds");
            runs += 1;
        }
        runs
    })
}

#[test]
fn opencl_and_c_programs_build_and_compute_and_builds_are_cached() {
    let daemon = start("programs-build", &[]);
    let session = daemon.session();
    let queue = session.queue("programs").unwrap();

    let started = Instant::now();
    let program = session.program_opencl(GOOD).expect("the program builds");
    let first_ms = started.elapsed().as_secs_f64() * 1e3;
    assert!(!program.cached());
    let names: Vec<&str> = program.kernels().iter().map(|k| k.name()).collect();
    assert_eq!(names, ["empty", "saxpy", "stencil"]);
    let saxpy = program.kernel("saxpy").unwrap();
    assert_eq!(
        saxpy.signature().to_string(),
        "saxpy(a: f32, x: read f32 buffer, y: read-write f32 buffer)"
    );
    saxpy_checked(&session, &queue, &saxpy, 10_000, 1.0).unwrap();

    // The 2-D stencil over a 37 x 53 image.
    let (h, w) = (37usize, 53usize);
    let src: Vec<f32> = (0..h * w).map(|i| ((i * 7919) % 101) as f32).collect();
    let bsrc = session.buffer_from(&src).unwrap();
    let bdst = session.buffer_from(&vec![0f32; h * w]).unwrap();
    let stencil = program.kernel("stencil").unwrap();
    queue.sync_to(&bsrc).unwrap();
    queue
        .launch(
            &stencil,
            &[Arg::I32(h as i32), Arg::I32(w as i32), (&bsrc).into(), (&bdst).into()],
            (h as u64, w as u64),
        )
        .unwrap();
    queue.sync_from(&bdst).unwrap();
    queue.finish().unwrap();
    let got = bdst.read_vec::<f32>();
    for r in 0..h {
        for c in 0..w {
            let at = |r: usize, c: usize| src[r * w + c];
            let want = at(r, c)
                + at(r.saturating_sub(1), c)
                + at((r + 1).min(h - 1), c)
                + at(r, c.saturating_sub(1))
                + at(r, (c + 1).min(w - 1));
            assert_eq!(got[r * w + c], want, "stencil at ({r}, {c})");
        }
    }

    // An empty kernel's round trip: daemon -> executor -> daemon -> client.
    let empty = program.kernel("empty").unwrap();
    let b = session.buffer_from(&[0f32; 16]).unwrap();
    queue.launch(&empty, &[(&b).into()], 1u64).unwrap().wait().unwrap();
    let rounds = 200;
    let started = Instant::now();
    for _ in 0..rounds {
        queue.launch(&empty, &[(&b).into()], 1u64).unwrap().wait().unwrap();
    }
    let round_trip_us = started.elapsed().as_secs_f64() * 1e6 / rounds as f64;
    // For comparison: the library's noop, which the daemon may run inline.
    let noop = session.kernel("noop").unwrap();
    let started = Instant::now();
    for _ in 0..rounds {
        queue.launch(&noop, &[], 1u64).unwrap().wait().unwrap();
    }
    let noop_us = started.elapsed().as_secs_f64() * 1e6 / rounds as f64;

    // The compiler's log comes back with a build error.
    let err = session
        .program_opencl("__kernel void broken(__global float *y) { y[0] = undefined_name; }")
        .unwrap_err();
    match &err {
        Error::Control(ControlError::ProgramBuild { log, .. }) => {
            assert!(log.contains("undefined_name") && log.contains("error"), "{log}")
        }
        other => panic!("{other:?}"),
    }
    // Nothing to build is refused before the executor sees it (an empty source crashed it).
    for blank in ["", "  \n\t"] {
        match session.program_opencl(blank) {
            Err(Error::Control(ControlError::BadRequest(m))) => {
                assert!(m.contains("empty") && m.contains("__kernel"), "{blank:?}: {m}")
            }
            other => panic!("an empty source {blank:?}: {other:?}"),
        }
    }
    // Source without kernels, and a __local argument, say so (not CL_INVALID_VALUE, nor a
    // type that Agora does pass).
    let build_log = |source: &str| match session.program_opencl(source) {
        Err(Error::Control(ControlError::ProgramBuild { log, .. })) => log,
        other => panic!("{source}: {other:?}"),
    };
    let log = build_log("int f(int x) { return x; }");
    assert!(log.contains("defines no kernel") && log.contains("__kernel"), "{log}");
    let log = build_log("__kernel void k(__global float *x, __local float *t) {}");
    assert!(
        log.contains("kernel k: argument 1 (t) is a __local pointer") && !log.contains("float*"),
        "{log}"
    );

    // A C program with a manifest.
    let dir = temp_dir("programs-c");
    let library = c_library(dir.path());
    let c = session
        .program_library(&library, C_MANIFEST)
        .expect("the C program loads");
    let scale = c.kernel("scale").unwrap();
    let x: Vec<f32> = (0..1000).map(|i| i as f32).collect();
    let bx = session.buffer_from(&x).unwrap();
    let by = session.buffer_from(&vec![0f32; 1000]).unwrap();
    queue.sync_to(&bx).unwrap();
    queue
        .launch(&scale, &[Arg::F32(-2.0), (&bx).into(), (&by).into()], 1000u64)
        .unwrap();
    queue.sync_from(&by).unwrap();
    queue.finish().unwrap();
    assert!(by
        .read_vec::<f32>()
        .iter()
        .enumerate()
        .all(|(i, v)| *v == -2.0 * i as f32));
    // The manifest's size rule is enforced by the daemon.
    let err = queue
        .launch(&scale, &[Arg::F32(1.0), (&bx).into(), (&by).into()], 1001u64)
        .unwrap()
        .wait()
        .unwrap_err();
    assert!(
        matches!(err.task_error(), Some(TaskError::BufferTooSmall { .. })),
        "{err:?}"
    );
    // A kernel's own non-zero return reaches the tenant, who cannot read the daemon's log.
    let bf = session.buffer_from(&[0f32; 4]).unwrap();
    let err = queue
        .launch(&c.kernel("fails").unwrap(), &[(&bf).into()], 4u64)
        .unwrap()
        .wait()
        .unwrap_err();
    assert_eq!(err.task_error(), Some(&TaskError::KernelReturned { code: 42 }), "{err}");
    assert!(err.to_string().contains("returned 42"), "{err}");
    let _ = queue.finish();
    // Not an ELF shared object for this machine: refused with the reason.
    let err = session
        .program_library(b"#!/bin/sh\necho hi\n", C_MANIFEST)
        .unwrap_err();
    assert!(err.to_string().contains("not an ELF"), "{err}");
    // A symbol the object lacks is named.
    let missing = C_MANIFEST.replace("c_abort", "c_nowhere");
    let err = session.program_library(&library, &missing).unwrap_err();
    assert!(err.to_string().contains("c_nowhere"), "{err}");

    // Another session building the same source gets it from the daemon's program cache.
    let other = daemon.session();
    let started = Instant::now();
    let again = other.program_opencl(GOOD).unwrap();
    let cached_ms = started.elapsed().as_secs_f64() * 1e3;
    assert!(again.cached(), "the second build comes from the cache");
    let q2 = other.queue("other").unwrap();
    saxpy_checked(&other, &q2, &again.kernel("saxpy").unwrap(), 1000, 2.0).unwrap();
    // Its kernel ids are its own: the first session's ids mean nothing there.
    assert!(daemon.state_dir().join("programs").read_dir().unwrap().count() >= 1);

    // Limits: the size, and the 65th program held at once (distinct sources: the same source
    // again would be the program the session holds).
    let huge = " ".repeat(2 << 20);
    let err = other.program_opencl(&huge).unwrap_err().to_string();
    assert!(err.contains(&MAX_PROGRAM_BYTES.to_string()), "{err}");
    let started = Instant::now();
    let mut held = vec![again];
    for built in 1..64 {
        held.push(
            other
                .program_opencl(&format!("{GOOD}\n// variant {built}\n"))
                .unwrap_or_else(|e| panic!("program {} of 64: {e}", built + 1)),
        );
    }
    let loop_ms = started.elapsed().as_secs_f64() * 1e3 / 63.0;
    let err = other.program_opencl(&format!("{GOOD}\n// variant 64\n")).unwrap_err();
    assert!(
        matches!(&err, Error::Control(ControlError::TooMany { what, limit: 64 }) if what == "programs"),
        "{err:?}"
    );
    // The message says what frees a slot.
    let message = err.to_string();
    for what in [
        "at most 64 programs at once",
        "agora_program_destroy",
        "reuses it",
        "[programs] max_per_session",
    ] {
        assert!(message.contains(what), "{what}: {message}");
    }
    drop(held);
    other
        .program_opencl(&format!("{GOOD}\n// variant 64\n"))
        .expect("dropped programs freed their slots");
    eprintln!(
        "first build {first_ms:.0} ms, cached build in a new session {cached_ms:.1} ms, cached build in a running \
         executor {loop_ms:.1} ms, empty-kernel round trip {round_trip_us:.0} us (library noop {noop_us:.0} us)"
    );
}

/// A service that builds its kernel per request: the same source built again (OpenCL, and a C
/// library with its manifest) is the program the session holds — the same kernels under the
/// same ids, no rebuild, no new slot — so 100 builds pass a limit of 64 and every launch computes.
#[test]
fn the_same_program_built_again_is_the_one_the_session_holds() {
    let daemon = start("programs-reuse", &[]);
    let session = daemon.session();
    let queue = session.queue("reuse").unwrap();
    let first = session.program_opencl(GOOD).expect("the program builds");
    let ids: Vec<u32> = first.kernels().iter().map(Kernel::id).collect();
    let dir = temp_dir("programs-reuse-c");
    let library = c_library(dir.path());
    let c_first = session
        .program_library(&library, C_MANIFEST)
        .expect("the C program loads");
    let c_ids: Vec<u32> = c_first.kernels().iter().map(Kernel::id).collect();
    for round in 0..100 {
        let again = session
            .program_opencl(GOOD)
            .unwrap_or_else(|e| panic!("build {} of the same source: {e}", round + 2));
        assert!(again.cached(), "build {}: reused, not rebuilt", round + 2);
        assert_eq!(again.kernels().iter().map(Kernel::id).collect::<Vec<_>>(), ids);
        saxpy_checked(&session, &queue, &again.kernel("saxpy").unwrap(), 1000, round as f32).unwrap();
        let c = session
            .program_library(&library, C_MANIFEST)
            .unwrap_or_else(|e| panic!("build {} of the same library: {e}", round + 2));
        assert_eq!(c.kernels().iter().map(Kernel::id).collect::<Vec<_>>(), c_ids);
    }
    // The C program computes under its reused ids.
    let scale = session
        .program_library(&library, C_MANIFEST)
        .unwrap()
        .kernel("scale")
        .unwrap();
    let x: Vec<f32> = (0..256).map(|i| i as f32).collect();
    let bx = session.buffer_from(&x).unwrap();
    let by = session.buffer_from(&vec![0f32; 256]).unwrap();
    queue.sync_to(&bx).unwrap();
    queue
        .launch(&scale, &[Arg::F32(4.0), (&bx).into(), (&by).into()], 256u64)
        .unwrap();
    queue.sync_from(&by).unwrap();
    queue.finish().unwrap();
    assert!(by
        .read_vec::<f32>()
        .iter()
        .enumerate()
        .all(|(i, v)| *v == 4.0 * i as f32));
    // Another manifest is another build: a program of its own, with new ids.
    let described = session
        .program_opencl_with_manifest(
            GOOD,
            "[kernels.saxpy]\nparams = [\"a: f32\", \"x: f32 read\", \"y: f32 readwrite\"]\nsizes = { x = \"range0\", y = \"range0\" }\n",
        )
        .unwrap();
    assert!(described.kernels().iter().all(|k| !ids.contains(&k.id())));
    saxpy_checked(&session, &queue, &described.kernel("saxpy").unwrap(), 500, 9.0).unwrap();
}

/// A program the client drops is given back: its slot is free again (200 distinct programs,
/// OpenCL and C, built one after another with a limit of 64, each dropped after a verified
/// launch), kernel ids are never given twice, a kernel handle keeps its program, and a launch
/// naming a released program's kernel id fails with `UnknownKernel` saying it was released.
#[test]
fn dropped_programs_free_their_slots_and_their_kernel_ids_are_refused() {
    use agora_protocol::{Op, RawArg, TaskDescriptor};
    let daemon = start("programs-release", &[]);
    let session = daemon.session();
    let queue = session.queue("release").unwrap();
    let dir = temp_dir("programs-release-c");
    let library = c_library(dir.path());
    let mut seen = std::collections::HashSet::new();
    let mut fresh = |program: &agora::Program| {
        for k in program.kernels() {
            assert!(seen.insert(k.id()), "kernel id {} given twice", k.id());
        }
    };
    for round in 0..200 {
        let program = session
            .program_opencl(&format!("{GOOD}\n// variant {round}\n"))
            .unwrap_or_else(|e| panic!("program {} of 200: {e}", round + 1));
        fresh(&program);
        saxpy_checked(&session, &queue, &program.kernel("saxpy").unwrap(), 256, round as f32).unwrap();
        drop(program);
        if round % 20 == 0 {
            // A C library, loaded and unloaded again and again.
            let c = session.program_library(&library, C_MANIFEST).unwrap();
            fresh(&c);
            let x: Vec<f32> = (0..64).map(|i| i as f32).collect();
            let bx = session.buffer_from(&x).unwrap();
            let by = session.buffer_from(&[0f32; 64]).unwrap();
            queue.sync_to(&bx).unwrap();
            queue
                .launch(
                    &c.kernel("scale").unwrap(),
                    &[Arg::F32(0.5), (&bx).into(), (&by).into()],
                    64u64,
                )
                .unwrap();
            queue.sync_from(&by).unwrap();
            queue.finish().unwrap();
            assert!(by
                .read_vec::<f32>()
                .iter()
                .enumerate()
                .all(|(i, v)| *v == 0.5 * i as f32));
        }
    }
    // A kernel handle keeps its program: it still computes once the Program is gone.
    let program = session.program_opencl(GOOD).unwrap();
    fresh(&program);
    let saxpy = program.kernel("saxpy").unwrap();
    let id = saxpy.id();
    drop(program);
    saxpy_checked(&session, &queue, &saxpy, 512, 1.0).unwrap();
    drop(saxpy);
    // Now released: a launch naming its id (only a raw descriptor can) is refused, saying why.
    let x = session.buffer_from(&[1f32; 16]).unwrap();
    let y = session.buffer_from(&[1f32; 16]).unwrap();
    let mut d = TaskDescriptor::zeroed();
    d.op = Op::Launch as u32;
    d.kernel = id;
    d.dims = 1;
    d.range = [16, 1, 1];
    d.arg_count = 3;
    d.args[0] = RawArg::f32(2.0);
    d.args[1] = RawArg::buffer(agora::testing::buffer_handle(&x));
    d.args[2] = RawArg::buffer(agora::testing::buffer_handle(&y));
    let err = agora::testing::submit_raw(&session, queue.handle(), d)
        .unwrap()
        .wait()
        .unwrap_err();
    assert_eq!(err.task_error(), Some(&TaskError::UnknownKernel(id)), "{err}");
    assert!(err.to_string().contains("was released"), "{err}");
    let _ = queue.finish();
    // Built again, it is a new program under new ids, and computes.
    let again = session.program_opencl(GOOD).unwrap();
    fresh(&again);
    saxpy_checked(&session, &queue, &again.kernel("saxpy").unwrap(), 512, 2.0).unwrap();
}

#[test]
fn faulting_and_endless_tenant_kernels_end_their_task_not_the_daemon_or_a_neighbour() {
    // Not tighter: PoCL compiles a kernel for its work-group size at its first launch in a new
    // executor, inside the launch's time (the good kernel's first launch after each restart),
    // which took over 500 ms beside this file's other tests on 2 cores.
    let daemon = start("programs-faults", &["--program-timeout", "1500"]);
    let pid = daemon.pid();
    let stop = Arc::new(AtomicBool::new(false));
    let runner = neighbour(daemon.socket().to_path_buf(), stop.clone());
    // The neighbour is connected and working before the baseline.
    std::thread::sleep(Duration::from_millis(200));
    let baseline = (open_fds(pid), children(pid));

    let session = daemon.session();
    let queue = session.queue("faults").unwrap();
    let program = session.program_opencl(BAD).unwrap();
    let dir = temp_dir("programs-faults-c");
    let c = session.program_library(&c_library(dir.path()), C_MANIFEST).unwrap();
    let good = program.kernel("scale2").unwrap();
    let check = || {
        let data: Vec<f32> = (0..512).map(|i| i as f32).collect();
        let b = session.buffer_from(&data).unwrap();
        queue.sync_to(&b).unwrap();
        queue.launch(&good, &[(&b).into()], 512u64).unwrap();
        queue.sync_from(&b).unwrap();
        queue.finish().expect("a good kernel runs in the (restarted) executor");
        assert!(b
            .read_vec::<f32>()
            .iter()
            .enumerate()
            .all(|(i, v)| *v == 2.0 * i as f32));
    };
    check();
    // The sandbox refuses sockets, fork, signals to the daemon and a new session.
    {
        let b = session.buffer_from(&[0f32; 4]).unwrap();
        queue
            .launch(&c.kernel("escape").unwrap(), &[(&b).into()], 1u64)
            .unwrap()
            .wait()
            .expect("every escape attempt fails inside the sandbox");
    }
    let before = (open_fds(pid), children(pid));
    assert_eq!(before.1, baseline.1 + 1, "one executor runs");
    let cases = [
        (
            program.kernel("far_out_of_bounds").unwrap(),
            TaskError::KernelCrashed { signal: 11 },
        ),
        (c.kernel("null_write").unwrap(), TaskError::KernelCrashed { signal: 11 }),
        (c.kernel("abort").unwrap(), TaskError::KernelCrashed { signal: 6 }),
        (
            program.kernel("endless").unwrap(),
            TaskError::KernelTimeout { limit_ms: 1500 },
        ),
    ];
    for (kernel, expected) in cases {
        let b = session.buffer_from(&[0f32; 256]).unwrap();
        queue.sync_to(&b).unwrap();
        let started = Instant::now();
        let err = queue
            .launch(&kernel, &[(&b).into()], 256u64)
            .unwrap()
            .wait()
            .unwrap_err();
        let took = started.elapsed();
        assert_eq!(err.task_error(), Some(&expected), "{}: {err}", kernel.name());
        let _ = queue.finish();
        check();
        let after = settled(pid, before);
        assert_eq!(
            after,
            before,
            "{}: the daemon's (open fds, child processes) were {before:?} before and {after:?} after \
             (failed in {took:?})",
            kernel.name()
        );
        daemon_alive(&daemon);
    }
    drop(queue);
    drop(session);
    let after = settled(pid, baseline);
    assert_eq!(
        after, baseline,
        "once the session ended the daemon's (open fds, child processes) were {after:?}, {baseline:?} before it began"
    );
    stop.store(true, Ordering::Relaxed);
    let runs = runner.join().expect("the neighbour's work all succeeded");
    assert!(runs > 0, "the neighbour ran");
}

/// A machine that was paused in the middle of a launch (a VM its hypervisor stopped; here
/// SIGSTOP to the daemon and the executor) does not make the launch look endless: the launch
/// completes, and one that really overruns still meets the limit. A guard of the behaviour, not
/// of `agora_wait::Deadline` alone: Linux restarts a `ppoll` that a stop interrupted with the
/// time it had left, so SIGSTOP leaves the daemon's wait on time; only a pause the kernel does
/// not see (a hypervisor's) makes the wait return late, which the deadline's unit tests cover.
#[test]
fn a_launch_paused_with_the_whole_machine_is_not_taken_for_endless() {
    let daemon = start("programs-paused", &["--program-timeout", "2000"]);
    let session = daemon.session();
    let queue = session.queue("paused").unwrap();
    let dir = temp_dir("programs-paused-c");
    let c = session.program_library(&c_library(dir.path()), C_MANIFEST).unwrap();
    let spin = c.kernel("spin").unwrap();
    let b = session.buffer_from(&[0f32; 1]).unwrap();
    // The first launch starts the executor.
    queue
        .launch(&spin, &[Arg::F32(1.0), (&b).into()], 1u64)
        .unwrap()
        .wait()
        .unwrap();
    let executors = child_pids(daemon.pid());
    assert_eq!(executors.len(), 1, "one executor runs: {executors:?}");
    let signal = |pid: u32, signal: &str| {
        let status = Command::new("kill").args([signal, &pid.to_string()]).status().unwrap();
        assert!(status.success(), "kill {signal} {pid}");
    };
    // A launch of 1 s, paused for 3 s after 0.3 s: 4 s of wall-clock time against a limit of
    // 2 s, about 1 s of it running.
    let task = queue.launch(&spin, &[Arg::F32(1000.0), (&b).into()], 1u64).unwrap();
    std::thread::sleep(Duration::from_millis(300));
    signal(executors[0], "-STOP");
    signal(daemon.pid(), "-STOP");
    std::thread::sleep(Duration::from_secs(3));
    // The daemon wakes first, as it may after a VM's pause, and finds the launch still running.
    signal(daemon.pid(), "-CONT");
    std::thread::sleep(Duration::from_millis(300));
    signal(executors[0], "-CONT");
    task.wait()
        .expect("a launch paused with the machine is not taken for endless");
    assert_eq!(child_pids(daemon.pid()), executors, "the executor was kept");
    // A launch that really runs past the limit still fails with the limit.
    let err = queue
        .launch(&spin, &[Arg::F32(2500.0), (&b).into()], 1u64)
        .unwrap()
        .wait()
        .unwrap_err();
    assert_eq!(
        err.task_error(),
        Some(&TaskError::KernelTimeout { limit_ms: 2000 }),
        "{err}"
    );
}

fn daemon_alive(daemon: &Daemon) {
    assert!(
        Path::new(&format!("/proc/{}", daemon.pid())).exists(),
        "the daemon runs"
    );
    daemon.status();
}

#[test]
fn the_operator_decides_who_may_build_programs() {
    let dir = temp_dir("programs-policy");
    std::fs::write(
        dir.path().join("agora.toml"),
        "[programs]\nallow = \"nobody\"\nuids = [4242]\n",
    )
    .unwrap();
    let config = dir.path().join("agora.toml").display().to_string();
    let daemon = Daemon::start_in(AGORA, dir, &["--no-opencl", "--config", &config]);
    let session = daemon.session();
    let err = session.program_opencl(GOOD).unwrap_err();
    assert!(
        matches!(&err, Error::Control(ControlError::NotPermitted(m)) if m.contains("[programs] allow")),
        "{err:?}"
    );
}

/// `[programs] in_daemon = true`: an OpenCL program's kernels may also run on the daemon's own
/// OpenCL devices (for trusted tenants, faster); a queue that prefers OpenCL gets them there and
/// the results are the same. Off by default: without it the program has no OpenCL
/// implementation and runs in the executor only.
#[test]
fn tenant_opencl_programs_run_in_the_daemon_only_when_the_operator_allows_it() {
    for in_daemon in [true, false] {
        let dir = temp_dir("programs-in-daemon");
        std::fs::write(
            dir.path().join("agora.toml"),
            format!("[programs]\nin_daemon = {in_daemon}\n"),
        )
        .unwrap();
        let config = dir.path().join("agora.toml").display().to_string();
        let daemon = Daemon::start_in(AGORA, dir, &["--config", &config]);
        let opencl_jobs = |daemon: &Daemon| -> u64 {
            daemon
                .status()
                .devices
                .iter()
                .filter(|d| d.kind == "opencl")
                .flat_map(|d| d.lanes.iter())
                .map(|l| l.completed)
                .sum()
        };
        assert!(
            daemon.status().devices.iter().any(|d| d.kind == "opencl"),
            "this test needs the OpenCL device (PoCL)"
        );
        let session = daemon.session();
        let program = session.program_opencl(GOOD).unwrap();
        let saxpy = program.kernel("saxpy").unwrap();
        let queue = session
            .queue_with(agora::QueueOptions {
                name: "prefers opencl".into(),
                class: agora::QueueClass::Batch,
                preferred_device: Some(agora::DeviceKind::OpenCl),
                sla: None,
            })
            .unwrap();
        let before = opencl_jobs(&daemon);
        saxpy_checked(&session, &queue, &saxpy, 4096, 1.0).unwrap();
        let ran_there = opencl_jobs(&daemon) - before;
        // sync_to x, sync_to y, the launch, sync_from y: all four on OpenCL when it may run there;
        // else the launch (and the transfers around it) happen on the CPU device.
        assert_eq!(
            ran_there >= 3,
            in_daemon,
            "{ran_there} jobs on OpenCL, in_daemon = {in_daemon}"
        );
    }
}

/// CUDA C and PTX programs on a daemon without a GPU (a GPU machine runs them in
/// `crates/client/tests/gpu.rs`): the daemon checks everything it can without one when the program
/// is built — NVRTC compiles the CUDA C, each entry must take exactly its declared parameters,
/// and the code must pass the fence — and says that no device can run it; a launch then fails
/// with `NoDevice`, and the session goes on.
#[test]
fn cuda_and_ptx_programs_are_checked_when_built_and_fail_with_no_device_without_a_gpu() {
    use agora_test_support::{TENANT_CUDA, TENANT_PTX};
    agora_test_support::use_project_nvrtc();
    let daemon = start("programs-cuda", &[]);
    let session = daemon.session();
    let queue = session.queue("cuda").unwrap();

    let (source, manifest) = TENANT_CUDA;
    let program = session
        .program_cuda(source, manifest)
        .expect("the CUDA C program builds");
    let saxpy = program.kernel("saxpy").unwrap();
    assert_eq!(
        saxpy.signature().to_string(),
        "saxpy(a: f32, x: read f32 buffer, y: read-write f32 buffer)"
    );
    assert!(program.kernel("count").is_some());
    assert!(
        program.build_log().contains("no device of this daemon can run it"),
        "{}",
        program.build_log()
    );
    let (ptx, ptx_manifest) = TENANT_PTX;
    let filled = session.program_ptx(ptx, ptx_manifest).expect("the PTX program builds");
    let fill = filled.kernel("fill").unwrap();
    assert_eq!(fill.signature().to_string(), "fill(y: write f32 buffer, v: f32)");

    // Without a GPU a launch has no device; the session and its queue go on.
    let y = session.buffer_from(&[0f32; 64]).unwrap();
    let task = queue.launch(&fill, &[(&y).into(), Arg::F32(1.0)], 64u64).unwrap();
    match task.wait() {
        Err(Error::Task(e @ TaskError::NoDevice(_))) => {
            let m = e.to_string();
            assert!(
                m.contains("of the programs this session built") && m.contains("no GPU on this node runs them"),
                "{m}"
            );
        }
        other => panic!("a CUDA-only kernel without a GPU: {other:?}"),
    }
    let _ = queue.finish();
    saxpy_checked(&session, &queue, &session.kernel("saxpy").unwrap(), 1000, 2.0).unwrap();

    let build_error = |result: Result<agora::Program, Error>| match result {
        Err(Error::Control(ControlError::ProgramBuild { log, .. })) => log,
        other => panic!("expected a build error, got {other:?}"),
    };
    // NVRTC's log.
    let log = build_error(session.program_cuda("extern \"C\" __global__ void saxpy(float a) { a = ; }", manifest));
    assert!(log.contains("error"), "{log}");
    // A mangled name: the entry the manifest names is not in the PTX.
    let mangled = source.replace("extern \"C\" __global__ void saxpy", "__global__ void saxpy");
    let log = build_error(session.program_cuda(&mangled, manifest));
    assert!(
        log.contains("no kernel entry saxpy") && log.contains("extern \"C\""),
        "{log}"
    );
    // The manifest declares one parameter more than the kernel takes.
    let wrong = manifest.replace("params = [\"a: f32\",", "params = [\"b: f32\", \"a: f32\",");
    let log = build_error(session.program_cuda(source, &wrong));
    assert!(log.contains("takes 3 parameters; the manifest declares 4"), "{log}");
    // What the fence cannot confine is refused when built, not when launched.
    let talk = source.replace("y[i] = a * x[i] + y[i];", "printf(\"%f\\n\", x[i]);");
    assert_ne!(talk, source, "the test's edit applies");
    let log = build_error(session.program_cuda(&talk, manifest));
    assert!(log.contains("cannot be fenced"), "{log}");
    let unfenceable = ptx.replace("st.global.f32 \t[%rd4], %f1;", "prefetch.global.L2 [%rd4];");
    assert_ne!(unfenceable, ptx, "the test's edit applies");
    let log = build_error(session.program_ptx(&unfenceable, ptx_manifest));
    assert!(log.contains("cannot be fenced") && log.contains("prefetch"), "{log}");
    // A manifest is required: the daemon cannot read parameters' access from PTX.
    match session.program_ptx(ptx, "") {
        Err(Error::Control(ControlError::BadRequest(m) | ControlError::ProgramBuild { log: m, .. })) => {
            assert!(m.contains("kernel"), "{m}")
        }
        other => panic!("a PTX program without kernels in its manifest: {other:?}"),
    }
    daemon_alive(&daemon);
}

/// A session that ends while its tenant kernel runs (its client killed, or gone) has its
/// executor killed at once: the lane is free again within moments, not after the program timeout
/// (before, a killed client's endless kernel held a CPU lane for the whole timeout and its
/// session stayed "closing").
#[test]
fn a_session_that_ends_while_its_kernel_runs_frees_the_lane_at_once() {
    let daemon = start("programs-end", &["--program-timeout", "60000"]);
    let session = daemon.session();
    let queue = session.queue("endless").unwrap();
    let program = session.program_opencl(BAD).unwrap();
    let b = session.buffer_from(&[0f32; 256]).unwrap();
    queue.sync_to(&b).unwrap();
    let _running = queue
        .launch(&program.kernel("endless").unwrap(), &[(&b).into()], 256u64)
        .unwrap();
    // Running: some lane is busy.
    assert!(eventually(Duration::from_secs(10), || daemon
        .status()
        .devices
        .iter()
        .any(|d| d.lanes.iter().any(|l| l.busy))));
    let ended = Instant::now();
    drop((_running, b, queue, program, session));
    let freed = eventually(Duration::from_secs(20), || {
        let status = daemon.status();
        status.closing_sessions == 0 && status.live_sessions == 0
    });
    assert!(
        freed,
        "the session was still closing 20 s after it ended (program timeout 60 s)"
    );
    assert!(ended.elapsed() < Duration::from_secs(20));
    // And the lanes serve the next session.
    let next = daemon.session();
    saxpy_checked(
        &next,
        &next.queue("next").unwrap(),
        &next.program_opencl(GOOD).unwrap().kernel("saxpy").unwrap(),
        1024,
        2.0,
    )
    .unwrap();
}
