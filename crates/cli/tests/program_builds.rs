//! Tenant programs that a build must refuse, or whose launch failure must say why, against real
//! `agora serve` processes (the user audit's D2–D6):
//!
//! * OpenCL kernel names PoCL cannot store (longer than 252 bytes: it aborted the executor) or
//!   that are not ASCII identifiers fail the build naming the kernel, and the session builds
//!   on.

use agora::{Error, Session};
use agora_protocol::control::ControlError;
use agora_test_support::Daemon;

const AGORA: &str = env!("CARGO_BIN_EXE_agora");

fn start(tag: &str) -> Daemon {
    Daemon::start(AGORA, tag, &["--no-opencl", "--cpu-lanes", "2"])
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
