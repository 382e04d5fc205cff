//! Measures OpenCL preemption on the first OpenCL device (PoCL here): the cost of running an
//! sgemm of order 768 as row slices, and the time from setting a running launch's revocation flag
//! to the job's completion.
//!
//! `cargo run --release -p agora-devices --features opencl,cpu --example opencl_preemption`

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{mpsc, Arc};
use std::time::{Duration, Instant};

use agora_devices::opencl::discover;
use agora_devices::{Device, DeviceBuffer, Job, Transfer, Work};
use agora_kernels::ArgValue;
use agora_protocol::{TaskError, MAX_ARGS};

type Outcome = mpsc::Sender<(Result<(), TaskError>, Instant)>;

fn job(transfers: Vec<Transfer>, work: Work, revoke: Option<Arc<AtomicBool>>, tx: &Outcome) -> Job {
    let tx = tx.clone();
    Job {
        transfers,
        work,
        keepalive: None,
        cancelled: None,
        revoke: revoke.map(|flag| agora_devices::Revocation {
            flag,
            save: None,
            replay: false,
        }),
        urgent: false,
        exclusive: false,
        deadline: None,
        slices: None,
        share: agora_devices::Share::default(),
        done: Box::new(move |result, _| {
            let _ = tx.send((result, Instant::now()));
        }),
    }
}

/// C = A·A for an all-ones A of order `n`, over `rows` of C.
fn sgemm(n: u64, a: &Arc<dyn DeviceBuffer>, c: &Arc<dyn DeviceBuffer>, rows: Option<std::ops::Range<u64>>) -> Work {
    let kernel = agora_kernels::find("sgemm").unwrap().1;
    let mut args = [ArgValue::None; MAX_ARGS];
    let mut device_args: [Option<Arc<dyn DeviceBuffer>>; MAX_ARGS] = Default::default();
    for (i, s) in [n, n, n, u64::from(1.0f32.to_bits())].into_iter().enumerate() {
        args[i] = ArgValue::Scalar(s);
    }
    args[6] = ArgValue::Scalar(u64::from(0.0f32.to_bits()));
    for (i, b) in [(4, a), (5, a), (7, c)] {
        args[i] = ArgValue::Buffer {
            ptr: std::ptr::null_mut(),
            len: b.len(),
        };
        device_args[i] = Some(b.clone());
    }
    Work::Launch {
        kernel: kernel.into(),
        range: [n, n, 1],
        dims: 2,
        args,
        arg_count: 8,
        device_args,
        rows,
    }
}

fn stats(mut v: Vec<f64>) -> String {
    v.sort_by(f64::total_cmp);
    let q = |p: f64| v[((v.len() - 1) as f64 * p).round() as usize];
    format!(
        "min {:.2} p50 {:.2} p99 {:.2} max {:.2} ms (n={})",
        v[0],
        q(0.5),
        q(0.99),
        v[v.len() - 1],
        v.len()
    )
}

fn main() {
    let (mut devices, problems) = discover(1, 0);
    assert!(!devices.is_empty(), "no OpenCL device: {problems:?}");
    let dev = devices.swap_remove(0);
    println!("{}", dev.info().description);
    let n = 768u64;
    let ones: Vec<u8> = (0..n * n).flat_map(|_| 1.0f32.to_ne_bytes()).collect();
    let a = dev.alloc(1, n * n * 4).unwrap().unwrap();
    let c = dev.alloc(1, n * n * 4).unwrap().unwrap();
    let (tx, rx) = mpsc::channel();
    let upload = Transfer::ToDevice {
        host: ones.as_ptr(),
        len: ones.len(),
        to: a.clone(),
    };
    dev.submit(0, job(vec![upload], Work::Nothing, None, &tx));
    rx.recv().unwrap().0.unwrap();
    let kernel = agora_kernels::find("sgemm").unwrap().1;
    let align = dev.row_alignment(kernel, 2);
    let runs = 9;

    // Slicing overhead: whole launches, and N slices with boundaries on work-group rows (as the
    // daemon's submit_sliced makes them).
    let run = |slices: u64, revoke: Option<Arc<AtomicBool>>| -> f64 {
        let units = n.div_ceil(align);
        let slices = slices.clamp(1, units);
        let started = Instant::now();
        for s in 0..slices {
            let rows = if slices == 1 {
                None
            } else {
                Some((align * (units * s / slices)).min(n)..(align * (units * (s + 1) / slices)).min(n))
            };
            dev.submit(0, job(Vec::new(), sgemm(n, &a, &c, rows), revoke.clone(), &tx));
        }
        let mut last = started;
        for _ in 0..slices {
            let (result, at) = rx.recv().unwrap();
            result.unwrap();
            last = at;
        }
        (last - started).as_secs_f64() * 1e3
    };
    for slices in [1, 4, 16, 48] {
        run(slices, None); // warm: builds the program and its specialisations
        let times: Vec<f64> = (0..runs).map(|_| run(slices, None)).collect();
        println!("sgemm {n} in {slices:>2} slices: {}", stats(times));
    }
    let times: Vec<f64> = (0..runs)
        .map(|_| run(1, Some(Arc::new(AtomicBool::new(false)))))
        .collect();
    println!("sgemm {n} whole, with a clear revocation flag: {}", stats(times));

    // Revocation: set the flag 5 to 30 ms into a whole launch; time from the store to completion.
    let mut latencies = Vec::new();
    for trial in 0..50u64 {
        let flag = Arc::new(AtomicBool::new(false));
        dev.submit(0, job(Vec::new(), sgemm(n, &a, &c, None), Some(flag.clone()), &tx));
        std::thread::sleep(Duration::from_millis(5 + (trial * 7) % 26));
        flag.store(true, Ordering::Release);
        let set = Instant::now();
        let (result, at) = rx.recv().unwrap();
        assert_eq!(result, Err(TaskError::Cancelled));
        latencies.push(at.saturating_duration_since(set).as_secs_f64() * 1e3);
    }
    println!("revocation, store to completion: {}", stats(latencies));
    dev.shutdown();
}
