//! The device suite: every kernel case of the library (`agora_kernels::cases::all()`, realistic
//! sizes and edge cases, expected values from host references) run through a real daemon on every
//! kind of device it has, each checked against the reference.
//!
//! Needs an OpenCL device (PoCL, installed by `make setup`): the test fails rather than skipping
//! when there is none.

use agora::{DeviceKind, QueueOptions};

mod common;
use agora_kernels::cases;
use common::run_case;

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
    let completed = agora_test_support::jobs_on(&session, "opencl");
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
