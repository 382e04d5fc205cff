//! Workloads that run as Agora clients and check their results against a host reference, and
//! the native baselines that run the same workloads without Agora.
//!
//! Each program is a [`Workload`] builder; [`run_on_agora`] replays it through a session,
//! [`native::run_cpu`] and [`native::run_opencl`] replay it directly. Used by `agora run`,
//! `agora demo` and `agora bench`.

pub mod native;
mod programs;
mod workload;

use agora::{DeviceKind, Error, Queue, QueueOptions, Session};

pub use programs::{build, default_size, footprint, hotspot_params, min_size, unknown_program, MAX_LAUNCHES, PROGRAMS};
pub use workload::{prepare_on_agora, run_on_agora, AppReport, PreparedRun, Step, Verdict, WArg, Workload};

/// A queue for workload `name`, preferring `device` when given.
pub fn queue(session: &Session, name: &str, device: Option<DeviceKind>) -> Result<Queue, Error> {
    session.queue_with(QueueOptions {
        name: name.to_string(),
        preferred_device: device,
        sla: None,
        ..Default::default()
    })
}

/// Largest relative error between `got` and `want` (relative to max(|want|, 1)).
pub fn max_relative_error(got: &[f32], want: &[f32]) -> f64 {
    if got.len() != want.len() {
        return f64::INFINITY;
    }
    got.iter()
        .zip(want)
        .map(|(g, w)| f64::from((g - w).abs()) / f64::from(w.abs()).max(1.0))
        .fold(0.0, |a, b| if b.is_nan() { f64::INFINITY } else { a.max(b) })
}

/// Reinterprets bytes as `f32`s (copying, so alignment does not matter).
pub fn floats(bytes: &[u8]) -> Vec<f32> {
    bytes
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect()
}

/// `f32`s as bytes.
pub fn bytes_of(values: &[f32]) -> Vec<u8> {
    bytemuck::cast_slice(values).to_vec()
}
