//! Tenant programs that a build must refuse, or whose launch failure must say why, against real
//! `agora serve` processes (the user audit's D2–D6):
//!
//! * OpenCL kernel names PoCL cannot store (longer than 252 bytes: it aborted the executor) or
//!   that are not ASCII identifiers fail the build naming the kernel, and the session builds
//!   on;
//! * a kernel declaring `reqd_work_group_size` runs over multiples of it, and another launch's
//!   task names CL_INVALID_WORK_GROUP_SIZE (it read "the daemon logged the details"; protocol
//!   unit tests cover how another OpenCL error of a launch reads);
//! * a C library calling a function nothing defines fails the build naming the symbol (lazy
//!   binding let it build, then ended the executor with status 127 at every launch), and an
//!   executor that exits during a launch gives its status;
//! * a C library whose constructor never returns fails the build within the load limit, before
//!   the client stops waiting (even with a short control timeout), and the session's next build
//!   works.

use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

use agora::{Arg, Error, Session, SessionOptions, TaskError};
use agora_protocol::control::ControlError;
use agora_test_support::{temp_dir, Daemon};

const AGORA: &str = env!("CARGO_BIN_EXE_agora");

fn start(tag: &str) -> Daemon {
    Daemon::start(AGORA, tag, &["--no-opencl", "--cpu-lanes", "2"])
}

/// Compiles C `source` into a shared object in `dir`; its bytes.
fn c_library(dir: &Path, name: &str, source: &str) -> Vec<u8> {
    let include = Path::new(env!("CARGO_MANIFEST_DIR")).join("../capi/include");
    let file = dir.join(format!("{name}.c"));
    let library = dir.join(format!("lib{name}.so"));
    std::fs::write(&file, source).unwrap();
    let status = Command::new("cc")
        .args(["-shared", "-fPIC", "-O1", "-o"])
        .arg(&library)
        .arg("-I")
        .arg(&include)
        .arg(&file)
        .status()
        .expect("a C compiler (cc) builds the test's shared object");
    assert!(status.success(), "cc failed on {name}.c");
    std::fs::read(library).unwrap()
}

/// The build log of a build that must fail.
fn build_log(result: Result<agora::Program, Error>) -> String {
    match result {
        Err(Error::Control(ControlError::ProgramBuild { log, .. })) => log,
        Err(other) => panic!("expected a build error, got {other:?}: {other}"),
        Ok(_) => panic!("expected a build error, got a program"),
    }
}

/// Builds and runs a one-kernel OpenCL program that stores 3 in `y[0]`: the session's
/// executor still works.
fn opencl_runs(session: &Session, name: &str) {
    let source = format!("__kernel void {name}(__global float *y) {{ y[0] = 3.0f; }}");
    let program = session.program_opencl(&source).expect("a healthy program builds");
    let kernel = program.kernel(name).unwrap();
    let queue = session.queue("check").unwrap();
    let y = session.buffer_from(&[0f32; 4]).unwrap();
    queue.sync_to(&y).unwrap();
    queue.launch(&kernel, &[(&y).into()], 1u64).unwrap();
    queue.sync_from(&y).unwrap();
    queue.finish().expect("the healthy kernel runs");
    assert_eq!(y.read_vec::<f32>()[0], 3.0);
}

const MANIFEST: &str = r#"
[kernels.k]
params = ["y: f32 readwrite"]
sizes = { y = "range0" }
"#;

#[test]
fn opencl_kernel_names_too_long_for_the_platform_or_not_ascii_fail_the_build_naming_the_kernel() {
    let daemon = start("program-builds-names");
    let session = daemon.session();
    for len in [253, 256, 300] {
        let name = "k".repeat(len);
        let log =
            build_log(session.program_opencl(&format!("__kernel void {name}(__global float *y) {{ y[0] = 3.0f; }}")));
        assert!(
            log.contains(&"k".repeat(40)) && !log.contains(&name) && log.contains(&format!("({len} bytes)")),
            "{len}: the kernel is named, cut: {log}"
        );
        assert!(log.contains("at most 252 bytes"), "{len}: the limit is named: {log}");
    }
    let log = build_log(session.program_opencl("__kernel void café(__global float *y) { y[0] = 5.0f; }"));
    assert!(
        log.contains("kernel café") && log.contains("must be ASCII identifiers"),
        "{log}"
    );
    // The longest name builds and runs, in the same session's (uncrashed) executor.
    opencl_runs(&session, &"k".repeat(252));
}

/// A kernel that requires a work-group size (`reqd_work_group_size`, which tiled kernels with
/// `__local` arrays need: `agora bench kernels`' matmul) builds and runs over ranges that are
/// multiples of it; over another range its task fails naming CL_INVALID_WORK_GROUP_SIZE (it
/// read "the kernel faulted while running; the daemon logged the details").
#[test]
fn a_required_work_group_size_runs_over_multiples_and_names_the_error_otherwise() {
    let daemon = start("program-builds-wg");
    let session = daemon.session();
    let program = session
        .program_opencl(
            "__attribute__((reqd_work_group_size(64, 1, 1))) __kernel void r(__global float *y) { y[get_global_id(0)] = 1; }",
        )
        .expect("a kernel with a required work-group size builds");
    let kernel = program.kernel("r").unwrap();
    let queue = session.queue("wg").unwrap();
    let y = session.buffer(128 * 4).unwrap();
    queue.launch(&kernel, &[(&y).into()], 128u64).unwrap();
    queue.sync_from(&y).unwrap();
    queue
        .finish()
        .expect("a range that is a multiple of the work-group size runs");
    assert_eq!(y.read_vec::<f32>(), vec![1.0f32; 128]);
    queue.launch(&kernel, &[(&y).into()], 100u64).unwrap();
    let error = queue.finish().expect_err("100 is no multiple of 64").to_string();
    assert!(error.contains("CL_INVALID_WORK_GROUP_SIZE"), "{error}");
    opencl_runs(&session, "after");
}

#[test]
fn a_c_library_with_an_unresolved_symbol_fails_the_build_and_an_exit_status_reaches_the_task() {
    let daemon = start("program-builds-symbols");
    let session = daemon.session();
    let dir = temp_dir("program-builds-symbols-c");
    let undefined = c_library(
        dir.path(),
        "undef",
        r#"#include "agora_kernel.h"
extern int not_defined_anywhere(int);
AGORA_KERNEL int k(const AgoraKernelArgs *a, uint64_t b, uint64_t e) { return not_defined_anywhere(1); }
"#,
    );
    let log = build_log(session.program_library(&undefined, MANIFEST));
    assert!(
        log.contains("undefined symbol: not_defined_anywhere") && !log.contains("/proc/self/fd"),
        "{log}"
    );
    // A kernel that exits: its status, and for 127 what the dynamic linker means by it.
    let exits = c_library(
        dir.path(),
        "exits",
        r#"#include <unistd.h>
#include "agora_kernel.h"
AGORA_KERNEL int k(const AgoraKernelArgs *a, uint64_t b, uint64_t e) { _exit(agora_i32(a, 0)); }
"#,
    );
    let manifest = r#"
[kernels.k]
params = ["status: i32", "y: f32 readwrite"]
sizes = { y = "range0" }
"#;
    let program = session.program_library(&exits, manifest).expect("it builds");
    let kernel = program.kernel("k").unwrap();
    let queue = session.queue("exits").unwrap();
    for (status, says) in [(3, "called exit()"), (127, "a symbol could not be resolved")] {
        // A fresh buffer each time: a failed task's output is not valid input.
        let y = session.buffer_from(&[0f32; 4]).unwrap();
        queue.sync_to(&y).unwrap();
        let err = queue
            .launch(&kernel, &[Arg::I32(status), (&y).into()], 1u64)
            .unwrap()
            .wait()
            .unwrap_err();
        assert_eq!(err.task_error(), Some(&TaskError::KernelExited { status }), "{err}");
        let message = err.to_string();
        assert!(
            message.contains(&format!("exit status {status}")) && message.contains(says) && !message.contains("logged"),
            "{message}"
        );
    }
    opencl_runs(&session, "after");
}

#[test]
fn a_c_library_whose_constructor_never_returns_fails_its_build_in_time_and_the_session_builds_on() {
    let daemon = start("program-builds-ctor");
    // A control timeout shorter than the load limit: a build's reply is waited for longer.
    let session = Session::connect_with(SessionOptions {
        socket: Some(daemon.socket().to_path_buf()),
        control_timeout: Some(Duration::from_secs(5)),
        ..Default::default()
    })
    .unwrap();
    let dir = temp_dir("program-builds-ctor-c");
    let spin = c_library(
        dir.path(),
        "spin",
        r#"#include "agora_kernel.h"
__attribute__((constructor)) static void init(void) { for (;;) {} }
AGORA_KERNEL int k(const AgoraKernelArgs *a, uint64_t b, uint64_t e) { return 0; }
"#,
    );
    let started = Instant::now();
    let log = build_log(session.program_library(&spin, MANIFEST));
    let took = started.elapsed();
    assert!(
        log.contains("initialisation did not finish within 10 s") && log.contains("constructor"),
        "{log}"
    );
    // Well before the 30-s default control timeout, and far from the 60-s compiler limit.
    assert!(took < Duration::from_secs(25), "the build failed after {took:?}");
    // The session's next builds work at once.
    let healthy = c_library(
        dir.path(),
        "healthy",
        r#"#include "agora_kernel.h"
AGORA_KERNEL int k(const AgoraKernelArgs *a, uint64_t b, uint64_t e) {
    float *y = a->args[0].data;
    for (uint64_t i = b; i < e; i++) y[i] = 5.0f;
    return 0;
}
"#,
    );
    let program = session
        .program_library(&healthy, MANIFEST)
        .expect("the next build works");
    let queue = session.queue("after").unwrap();
    let y = session.buffer_from(&[0f32; 4]).unwrap();
    queue.sync_to(&y).unwrap();
    queue
        .launch(&program.kernel("k").unwrap(), &[(&y).into()], 4u64)
        .unwrap();
    queue.sync_from(&y).unwrap();
    queue.finish().unwrap();
    assert_eq!(y.read_vec::<f32>(), vec![5.0; 4]);
    opencl_runs(&session, "after");
}
