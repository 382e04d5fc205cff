//! Workloads that run as Agora clients and check their results against a host reference.
//!
//! Used by `agora run`, `agora demo` and the benchmarks. Each returns an [`AppReport`].

use std::time::Instant;

use agora::{Arg, DeviceKind, Error, NdRange, Queue, QueueOptions, Session};
use serde::{Deserialize, Serialize};

/// What a workload did.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct AppReport {
    /// Workload name.
    pub app: String,
    /// Problem size.
    pub size: u64,
    /// Tasks issued.
    pub tasks: u64,
    /// Wall time of the work (excluding session setup), seconds.
    pub seconds: f64,
    /// Largest error against the host reference.
    pub max_error: f64,
    /// Whether the result matched the reference.
    pub verified: bool,
}

/// A queue for workload `name`, preferring `device` when given.
pub fn queue(session: &Session, name: &str, device: Option<DeviceKind>) -> Result<Queue, Error> {
    session.queue_with(QueueOptions {
        name: name.to_string(),
        preferred_device: device,
        ..Default::default()
    })
}

/// Rodinia Gaussian elimination of a `size`×`size` system: forward elimination on Agora
/// (`gaussian.fan1` + `gaussian.fan2` per column), back substitution on the host; compared with
/// the same elimination done on the host.
pub fn gaussian(session: &Session, size: usize, device: Option<DeviceKind>) -> Result<AppReport, Error> {
    assert!(size >= 2, "size must be at least 2");
    let (a_host, b_host) = agora_kernels::gaussian::reference::matrix(size);
    let queue = queue(session, "gaussian", device)?;
    let fan1 = session.kernel("gaussian.fan1")?;
    let fan2 = session.kernel("gaussian.fan2")?;
    let a = session.buffer_from(&a_host)?;
    let b = session.buffer_from(&b_host)?;
    let m = session.buffer((size * size * 4) as u64)?;
    let start = Instant::now();
    let mut tasks = 0u64;
    for buffer in [&a, &b, &m] {
        let _ = queue.sync_to(buffer)?;
        tasks += 1;
    }
    let s = size as i32;
    for t in 0..size - 1 {
        let rows = (size - 1 - t) as u64;
        let _ = queue.launch(
            &fan1,
            &[(&m).into(), (&a).into(), Arg::I32(s), Arg::I32(t as i32)],
            rows,
        )?;
        let _ = queue.launch(
            &fan2,
            &[(&m).into(), (&a).into(), (&b).into(), Arg::I32(s), Arg::I32(t as i32)],
            NdRange::d2(rows, (size - t) as u64),
        )?;
        tasks += 2;
    }
    for buffer in [&a, &b] {
        let _ = queue.sync_from(buffer)?;
        tasks += 1;
    }
    queue.finish()?;
    let seconds = start.elapsed().as_secs_f64();
    let x = agora_kernels::gaussian::reference::back_substitute(a.as_slice::<f32>(), b.as_slice::<f32>(), size);

    // Host reference: the same elimination, then compare solutions.
    let (mut ra, mut rb) = (a_host.clone(), b_host.clone());
    let mut rm = vec![0f32; size * size];
    agora_kernels::gaussian::reference::forward(&mut ra, &mut rb, &mut rm, size);
    let rx = agora_kernels::gaussian::reference::back_substitute(&ra, &rb, size);
    let max_error = x
        .iter()
        .zip(&rx)
        .map(|(v, r)| f64::from((v - r).abs()) / f64::from(r.abs()).max(1.0))
        .fold(0.0, f64::max);
    Ok(AppReport {
        app: "gaussian".into(),
        size: size as u64,
        tasks,
        seconds,
        max_error,
        verified: max_error <= 1e-4,
    })
}

/// A stream of `iterations` saxpy launches over `n` elements on one queue, y ← 2·x + y each time,
/// checked against the closed form.
pub fn saxpy_stream(
    session: &Session,
    n: usize,
    iterations: usize,
    device: Option<DeviceKind>,
) -> Result<AppReport, Error> {
    let queue = queue(session, "saxpy", device)?;
    let saxpy = session.kernel("saxpy")?;
    let x_host: Vec<f32> = (0..n).map(|i| (i % 1000) as f32 * 0.001).collect();
    let x = session.buffer_from(&x_host)?;
    let y = session.buffer_from(&vec![1.0f32; n])?;
    let start = Instant::now();
    let _ = queue.sync_to(&x)?;
    let _ = queue.sync_to(&y)?;
    for _ in 0..iterations {
        let _ = queue.launch(&saxpy, &[Arg::F32(2.0), (&x).into(), (&y).into()], n)?;
    }
    let _ = queue.sync_from(&y)?;
    queue.finish()?;
    let seconds = start.elapsed().as_secs_f64();
    let mut max_error = 0f64;
    for (i, v) in y.as_slice::<f32>().iter().enumerate() {
        let mut expected = 1.0f32;
        for _ in 0..iterations {
            expected += 2.0 * x_host[i];
        }
        max_error = max_error.max(f64::from((v - expected).abs()) / f64::from(expected.abs()).max(1.0));
    }
    Ok(AppReport {
        app: "saxpy".into(),
        size: n as u64,
        tasks: iterations as u64 + 3,
        seconds,
        max_error,
        verified: max_error <= 1e-5,
    })
}

/// `vector_add` and `fill` over `n` elements, checked exactly.
pub fn vector_add(session: &Session, n: usize, device: Option<DeviceKind>) -> Result<AppReport, Error> {
    let queue = queue(session, "vector_add", device)?;
    let add = session.kernel("vector_add")?;
    let fill = session.kernel("fill")?;
    let a = session.buffer((n * 4) as u64)?;
    let b = session.buffer_from(&(0..n).map(|i| i as f32).collect::<Vec<_>>())?;
    let c = session.buffer((n * 4) as u64)?;
    let start = Instant::now();
    let _ = queue.launch(&fill, &[Arg::F32(0.5), (&a).into()], n)?;
    let _ = queue.sync_to(&b)?;
    let _ = queue.launch(&add, &[(&a).into(), (&b).into(), (&c).into()], n)?;
    let _ = queue.sync_from(&c)?;
    queue.finish()?;
    let seconds = start.elapsed().as_secs_f64();
    let wrong = c
        .as_slice::<f32>()
        .iter()
        .enumerate()
        .filter(|(i, v)| **v != *i as f32 + 0.5)
        .count();
    Ok(AppReport {
        app: "vector_add".into(),
        size: n as u64,
        tasks: 4,
        seconds,
        max_error: wrong as f64,
        verified: wrong == 0,
    })
}
