//! Tests of the OpenCL backend on a real device (PoCL here): row slices, limits, revocation.
//! They fail, not skip, without an OpenCL device.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Instant;

use agora_kernels::KernelDef;
use agora_protocol::TaskError;

use super::*;
use crate::{Device, DeviceBuffer, Job, Transfer, Work};
use agora_kernels::cases::{self, KernelCase};
use agora_kernels::ArgValue;
use agora_protocol::{ArgTag, MAX_ARGS};
use std::ops::Range;
use std::sync::mpsc;
use std::time::Duration;

/// The first OpenCL device (PoCL here). These tests fail, not skip, without one.
fn device() -> OpenClDevice {
    super::one_opencl_test_at_a_time();
    let (mut devices, problems) = discover(1, 0);
    assert!(
        !devices.is_empty(),
        "these tests need an OpenCL device (PoCL): {problems:?}"
    );
    devices.swap_remove(0)
}

type Outcome = mpsc::Sender<(Result<(), TaskError>, Instant)>;

fn job(transfers: Vec<Transfer>, work: Work, revoke: Option<Arc<AtomicBool>>, tx: &Outcome) -> Job {
    let tx = tx.clone();
    Job {
        transfers,
        work,
        keepalive: None,
        cancelled: None,
        revoke: revoke.map(|flag| crate::Revocation {
            flag,
            save: None,
            replay: false,
        }),
        urgent: false,
        exclusive: false,
        deadline: None,
        slices: None,
        share: crate::Share::default(),
        done: Box::new(move |result, _| {
            let _ = tx.send((result, Instant::now()));
        }),
    }
}

/// A launch of `kernel` over `range` with wire arguments `raw` (buffer `i` is `buffers[i]`).
fn launch(
    kernel: &'static KernelDef,
    range: &[u64],
    raw: &[agora_protocol::RawArg],
    buffers: &[Arc<dyn DeviceBuffer>],
    rows: Option<Range<u64>>,
) -> Work {
    let mut args = [ArgValue::None; MAX_ARGS];
    let mut device_args: [Option<Arc<dyn DeviceBuffer>>; MAX_ARGS] = Default::default();
    for (i, arg) in raw.iter().enumerate() {
        if arg.tag == ArgTag::Buffer as u32 {
            let buffer = &buffers[arg.value as usize];
            // OpenCL launches use `device_args`; the host pointer is not read.
            args[i] = ArgValue::Buffer {
                ptr: std::ptr::null_mut(),
                len: buffer.len(),
            };
            device_args[i] = Some(buffer.clone());
        } else {
            args[i] = ArgValue::Scalar(arg.value);
        }
    }
    let mut full = [1u64; 3];
    full[..range.len()].copy_from_slice(range);
    Work::Launch {
        kernel: kernel.into(),
        range: full,
        dims: range.len(),
        args,
        arg_count: raw.len(),
        device_args,
        rows,
    }
}

fn upload(dev: &OpenClDevice, data: &[u8]) -> (Arc<dyn DeviceBuffer>, Transfer) {
    let buffer = dev.alloc(1, data.len() as u64).unwrap().unwrap();
    let transfer = Transfer::ToDevice {
        host: data.as_ptr(),
        len: data.len(),
        to: buffer.clone(),
    };
    (buffer, transfer)
}

fn download(dev: &OpenClDevice, buffer: &dyn DeviceBuffer, len: usize) -> Vec<u8> {
    let mut out = vec![0u8; len];
    // SAFETY: `out` holds `len` bytes.
    unsafe { dev.read(buffer, out.as_mut_ptr(), len) }.unwrap();
    out
}

/// Runs `case` as the given row ranges (`None`: one whole launch), one job each, in order on
/// lane 0, and checks the results.
fn run_sliced(dev: &OpenClDevice, case: &KernelCase, slices: &[Option<Range<u64>>]) -> Result<(), String> {
    let kernel = case.def()?;
    let initial = case.buffers();
    let (buffers, mut transfers): (Vec<_>, Vec<_>) = initial.iter().map(|b| upload(dev, b)).unzip();
    let (tx, rx) = mpsc::channel();
    let raw = case.raw_args();
    for rows in slices {
        let work = launch(kernel, &case.range, &raw, &buffers, rows.clone());
        dev.submit(0, job(std::mem::take(&mut transfers), work, None, &tx));
    }
    for _ in slices {
        rx.recv()
            .unwrap()
            .0
            .map_err(|e| format!("{}: launch failed: {e:?}", case.name))?;
    }
    let results: Vec<Vec<u8>> = buffers
        .iter()
        .zip(&initial)
        .map(|(b, init)| download(dev, b.as_ref(), init.len()))
        .collect();
    let views: Vec<&[u8]> = results.iter().map(|r| r.as_slice()).collect();
    case.check(&views)
}

/// `count` even row ranges of `rows` (the daemon's split before alignment: boundaries fall
/// anywhere, not on work-group multiples).
fn even(rows: u64, count: u64) -> Vec<Option<Range<u64>>> {
    (0..count)
        .map(|i| Some(rows * i / count..rows * (i + 1) / count))
        .collect()
}

#[test]
fn every_case_is_exact_when_run_as_row_slices() {
    let dev = device();
    assert!(dev.runs_row_slices());
    let mut failures = Vec::new();
    let mut runs = 0;
    for program in cases::PROGRAMS {
        for case in cases::for_program(program) {
            let rows = case.range[0];
            let mut plans: Vec<(String, Vec<Option<Range<u64>>>)> = vec![
                ("whole".into(), vec![None]),
                ("1 slice".into(), even(rows, 1)),
                ("3 slices".into(), even(rows, 3)),
                ("7 slices".into(), even(rows, 7)),
            ];
            if case.large {
                plans.push(("100 slices".into(), even(rows, 100)));
            } else {
                // Very small slices: one row each, and an empty slice.
                plans.push((format!("{rows} one-row slices"), even(rows, rows)));
                let mut with_empty = even(rows, 2);
                with_empty.insert(1, Some(rows / 2..rows / 2));
                plans.push(("2 slices and an empty one".into(), with_empty));
            }
            // Slices that cut work-groups (64, 8, 4 or 16 rows) in the middle.
            if rows > 5 {
                plans.push(("slices 0..5, 5..rows".into(), vec![Some(0..5), Some(5..rows)]));
            }
            for (plan, slices) in &plans {
                runs += 1;
                if let Err(e) = run_sliced(&dev, &case, slices) {
                    failures.push(format!("{plan}: {e}"));
                }
            }
        }
    }
    assert!(runs > 100, "{runs} runs");
    assert!(
        failures.is_empty(),
        "{} of {runs} runs failed:\n{}",
        failures.len(),
        failures.join("\n")
    );
    dev.shutdown();
}

#[test]
fn pocl_limits_split_or_refuse_huge_ranges() {
    let dev = device();
    let limits = dev.info().limits;
    assert_eq!(limits.max_groups_per_enqueue, MAX_GROUPS_PER_ENQUEUE);
    assert_eq!(limits.max_items_per_enqueue, MAX_ITEMS_PER_ENQUEUE);
    assert!(limits.max_group_items >= 64, "{limits:?}");
    let noop = agora_kernels::find("noop").unwrap().1;
    for range in [
        &[1u64 << 40][..],
        &[1 << 38],
        &[1 << 37],
        &[1 << 20, 1 << 20],
        &[1 << 14, 1 << 13, 1 << 13],
    ] {
        let items: u64 = range.iter().product();
        assert_eq!(
            dev.check_launch(noop, range, &[]),
            Err(TaskError::DeviceLimit {
                limit: agora_protocol::LaunchLimit::Items,
                value: items,
                max: MAX_ITEMS_PER_LAUNCH
            }),
            "{range:?}"
        );
    }
    assert_eq!(dev.check_launch(noop, &[1 << 32], &[]), Ok(1));
    assert_eq!(dev.check_launch(noop, &[1 << 33], &[]), Ok(2));
    assert_eq!(dev.check_launch(noop, &[1 << 36], &[]), Ok(16));
    assert_eq!(dev.check_launch(noop, &[1 << 11, 1 << 11, 1 << 11], &[]), Ok(2));
    // Dimension 1 is never split: 8 rows of 2^33 are too many for one enqueue.
    assert_eq!(
        dev.check_launch(noop, &[1, 1 << 33], &[]),
        Err(TaskError::DeviceLimit {
            limit: agora_protocol::LaunchLimit::ItemsPerEnqueue,
            value: 1 << 36,
            max: MAX_ITEMS_PER_ENQUEUE
        })
    );
    dev.shutdown();
}

/// What used to kill the process (PoCL: SIGILL at 2^32 work-groups in one command, SIGABRT at
/// 2^34) reaching the device anyway fails only its task.
#[test]
fn a_command_beyond_the_limits_fails_its_task_and_not_the_process() {
    let dev = device();
    let noop = agora_kernels::find("noop").unwrap().1;
    let (tx, rx) = mpsc::channel();
    for range in [&[1u64 << 38][..], &[1 << 40], &[1 << 20, 1 << 20]] {
        dev.submit(0, job(Vec::new(), launch(noop, range, &[], &[], None), None, &tx));
        assert_eq!(rx.recv().unwrap().0, Err(TaskError::KernelFault), "{range:?}");
    }
    // A row slice within the limits of the same launch runs, and so does the lane.
    let rows = Some((1 << 38) - (1 << 20)..1 << 38);
    dev.submit(0, job(Vec::new(), launch(noop, &[1 << 38], &[], &[], rows), None, &tx));
    assert_eq!(rx.recv().unwrap().0, Ok(()));
    dev.shutdown();
}

/// A range twice what one enqueue takes runs as the daemon splits it: two row slices.
#[test]
fn a_range_beyond_one_enqueue_runs_as_row_slices() {
    let dev = device();
    let noop = agora_kernels::find("noop").unwrap().1;
    let range = [1u64 << 33];
    assert_eq!(dev.check_launch(noop, &range, &[]), Ok(2));
    let (tx, rx) = mpsc::channel();
    for rows in [0..1 << 32, 1 << 32..1 << 33] {
        dev.submit(
            0,
            job(Vec::new(), launch(noop, &range, &[], &[], Some(rows)), None, &tx),
        );
    }
    assert_eq!(rx.recv().unwrap().0, Ok(()));
    assert_eq!(rx.recv().unwrap().0, Ok(()));
    dev.shutdown();
}

#[test]
fn row_alignment_is_the_work_group_extent() {
    let dev = device();
    let sgemm = agora_kernels::find("sgemm").unwrap().1;
    let saxpy = agora_kernels::find("saxpy").unwrap().1;
    let fan2 = agora_kernels::find("gaussian.fan2").unwrap().1;
    assert_eq!(dev.row_alignment(sgemm, 2), 16);
    assert_eq!(dev.row_alignment(saxpy, 1), 64);
    assert_eq!(dev.row_alignment(fan2, 2), 8);
    dev.shutdown();
}

/// sgemm's arguments for C = 1·A·B (beta 0) of sizes (m, n, k), with A, B and C the buffers
/// of indices (a, b, c).
fn sgemm_args((m, n, k): (usize, usize, usize), (a, b, c): (u64, u64, u64)) -> [agora_protocol::RawArg; 8] {
    use agora_protocol::RawArg;
    [
        RawArg::i32(m as i32),
        RawArg::i32(n as i32),
        RawArg::i32(k as i32),
        RawArg::f32(1.0),
        RawArg::buffer(a),
        RawArg::buffer(b),
        RawArg::f32(0.0),
        RawArg::buffer(c),
    ]
}

/// sgemm's range is (m, n), so with n = 1 a client may say just (m): the kernel still needs its
/// 16 × 16 work-groups, which OpenCL refuses in a 1-D enqueue (CL_INVALID_WORK_GROUP_SIZE, once
/// the error a Python client got for `range=m`).
#[test]
fn a_tiled_kernel_launched_with_fewer_dimensions_than_its_work_group_runs_and_is_exact() {
    let dev = device();
    let (m, k) = (37usize, 8usize);
    let bytes = |v: Vec<f32>| -> Vec<u8> { v.iter().flat_map(|x| x.to_ne_bytes()).collect() };
    let (a_host, b_host, c_host) = (bytes(vec![1.0; m * k]), bytes(vec![2.0; k]), bytes(vec![-1.0; m]));
    let (a, to_a) = upload(&dev, &a_host);
    let (b, to_b) = upload(&dev, &b_host);
    let (c, to_c) = upload(&dev, &c_host);
    let kernel = agora_kernels::find("sgemm").unwrap().1;
    let raw = sgemm_args((m, 1, k), (0, 1, 2));
    let work = launch(kernel, &[m as u64], &raw, &[a, b, c.clone()], None);
    let (tx, rx) = mpsc::channel();
    dev.submit(0, job(vec![to_a, to_b, to_c], work, None, &tx));
    assert_eq!(rx.recv().unwrap().0, Ok(()));
    let out = download(&dev, c.as_ref(), c_host.len());
    let values: Vec<f32> = out
        .chunks(4)
        .map(|b| f32::from_ne_bytes(b.try_into().unwrap()))
        .collect();
    assert_eq!(values, vec![2.0 * k as f32; m], "every C[i] = Σ 1 · 2 over k");
}

/// A square all-ones sgemm of order `n`: C = A·A, every element `n`. C starts at -1.
struct Sgemm {
    n: usize,
    c: Arc<dyn DeviceBuffer>,
    work: Box<dyn Fn() -> Work>,
    setup: Vec<Transfer>,
    _host: (Vec<u8>, Vec<u8>),
}

impl Sgemm {
    fn new(dev: &OpenClDevice, n: usize) -> Self {
        let ones: Vec<u8> = [1.0f32].repeat(n * n).iter().flat_map(|v| v.to_ne_bytes()).collect();
        let unset: Vec<u8> = [-1.0f32].repeat(n * n).iter().flat_map(|v| v.to_ne_bytes()).collect();
        let (a, to_a) = upload(dev, &ones);
        let (c, to_c) = upload(dev, &unset);
        let kernel = agora_kernels::find("sgemm").unwrap().1;
        let nn = n as u32 as u64;
        let raw = sgemm_args((n, n, n), (0, 0, 1));
        let buffers = vec![a, c.clone()];
        let work = Box::new(move || launch(kernel, &[nn, nn], &raw, &buffers, None));
        Sgemm {
            n,
            c,
            work,
            setup: vec![to_a, to_c],
            _host: (ones, unset),
        }
    }

    /// Uploads A and resets C to -1 (synchronously).
    fn reset(&mut self, dev: &OpenClDevice) {
        let unset = &self._host.1;
        let (tx, rx) = mpsc::channel();
        let mut transfers = std::mem::take(&mut self.setup);
        if transfers.is_empty() {
            transfers.push(Transfer::ToDevice {
                host: unset.as_ptr(),
                len: unset.len(),
                to: self.c.clone(),
            });
        }
        dev.submit(0, job(transfers, Work::Nothing, None, &tx));
        rx.recv().unwrap().0.unwrap();
    }

    /// How many elements of C were written (are `n`) and how many are still -1.
    fn written(&self, dev: &OpenClDevice) -> (usize, usize) {
        let bytes = download(dev, self.c.as_ref(), self.n * self.n * 4);
        let values: Vec<f32> = bytes
            .chunks_exact(4)
            .map(|b| f32::from_ne_bytes(b.try_into().unwrap()))
            .collect();
        let done = values.iter().filter(|v| **v == self.n as f32).count();
        let unset = values.iter().filter(|v| **v == -1.0).count();
        assert_eq!(
            done + unset,
            values.len(),
            "every element is either complete or unwritten"
        );
        (done, unset)
    }

    /// Runs it with `revoke` as its flag, setting the flag after `after` (when given); returns
    /// the outcome, the time from submission to completion and from the store to completion.
    fn run(
        &self,
        dev: &OpenClDevice,
        revoke: Option<Arc<AtomicBool>>,
        after: Option<Duration>,
    ) -> (Result<(), TaskError>, Duration, Option<Duration>) {
        let (tx, rx) = mpsc::channel();
        let started = Instant::now();
        dev.submit(0, job(Vec::new(), (self.work)(), revoke.clone(), &tx));
        let set = after.map(|after| {
            std::thread::sleep(after);
            revoke.as_ref().unwrap().store(true, Ordering::Release);
            Instant::now()
        });
        let (result, finished) = rx.recv().unwrap();
        (
            result,
            finished - started,
            set.map(|s| finished.saturating_duration_since(s)),
        )
    }
}

#[test]
fn a_revoked_sgemm_stops_early_and_leaves_later_tiles_unwritten() {
    let dev = device();
    assert!(
        dev.polls_revocation(),
        "PoCL computes on host memory: kernels see the flag"
    );
    let mut s = Sgemm::new(&dev, 1024);
    s.reset(&dev);
    // Warm: builds the program and PoCL's specialisation, so the timed runs are typical.
    let (result, _, _) = s.run(&dev, None, None);
    result.unwrap();
    s.reset(&dev);
    // Not revoked: a flag that stays clear gives the exact result.
    let flag = Arc::new(AtomicBool::new(false));
    let (result, whole, _) = s.run(&dev, Some(flag), None);
    assert_eq!(result, Ok(()));
    assert_eq!(s.written(&dev), (s.n * s.n, 0), "an unrevoked run is complete");
    // Revoked a quarter of the way through: work-groups that start later return at once.
    s.reset(&dev);
    let flag = Arc::new(AtomicBool::new(false));
    let (result, took, after_set) = s.run(&dev, Some(flag), Some(whole / 4));
    let after_set = after_set.unwrap();
    let (done, unset) = s.written(&dev);
    eprintln!("whole {whole:?}; revoked run {took:?}, {after_set:?} after the store; {done} written, {unset} not");
    assert_eq!(result, Err(TaskError::Cancelled));
    assert!(
        done > 0,
        "the kernel was running when revoked (some tiles are complete)"
    );
    assert!(unset > 0, "later work-groups left their tiles unwritten");
    assert!(
        after_set < whole / 4,
        "the revoked kernel stopped {after_set:?} after the store (whole run {whole:?})"
    );
    dev.shutdown();
}

#[test]
fn without_shared_host_memory_the_flag_is_copied_in_before_the_kernel() {
    let dev = device();
    dev.shared.host_flags.store(false, Ordering::Relaxed);
    assert!(!dev.polls_revocation());
    let mut s = Sgemm::new(&dev, 512);
    s.reset(&dev);
    let (result, _, _) = s.run(&dev, None, None);
    result.unwrap();
    // Not revoked: exact.
    s.reset(&dev);
    let (result, _, _) = s.run(&dev, Some(Arc::new(AtomicBool::new(false))), None);
    assert_eq!(result, Ok(()));
    assert_eq!(s.written(&dev), (s.n * s.n, 0));
    // Revoked while it waits behind another command of its queue: it starts, finds the
    // copied flag set, and every work-group returns.
    s.reset(&dev);
    let (tx, rx) = mpsc::channel();
    let flag = Arc::new(AtomicBool::new(false));
    let mut blocker = Sgemm::new(&dev, 768);
    blocker.reset(&dev);
    dev.submit(0, job(Vec::new(), (blocker.work)(), None, &tx));
    dev.submit(0, job(Vec::new(), (s.work)(), Some(flag.clone()), &tx));
    // Set the flag once the lane has enqueued the job (so the lane's own check before it
    // starts a job cannot be what cancels it), while the blocker still runs.
    while dev.status().lanes[0].queued > 0 {
        std::thread::yield_now();
    }
    assert!(rx.try_recv().is_err(), "the blocker still runs");
    flag.store(true, Ordering::Release);
    assert_eq!(rx.recv().unwrap().0, Ok(()), "the blocker completes");
    assert_eq!(rx.recv().unwrap().0, Err(TaskError::Cancelled));
    assert_eq!(
        s.written(&dev),
        (0, s.n * s.n),
        "no work-group of the revoked kernel ran"
    );
    dev.shutdown();
}

/// Runs saxpy (`y = 2x + y` over 1000 floats) as `kernel` on lane 0 and returns `y`.
fn run_saxpy(dev: &OpenClDevice, kernel: &'static KernelDef) -> Result<Vec<f32>, TaskError> {
    let x: Vec<f32> = (0..1000).map(|i| i as f32).collect();
    let y = vec![1.0f32; 1000];
    let (bx, tx) = upload(dev, bytemuck::cast_slice(&x));
    let (by, ty) = upload(dev, bytemuck::cast_slice(&y));
    let raw = [
        agora_protocol::RawArg::f32(2.0),
        agora_protocol::RawArg::buffer(0),
        agora_protocol::RawArg::buffer(1),
    ];
    let work = launch(kernel, &[1000], &raw, &[bx, by.clone()], None);
    let (sender, outcome) = mpsc::channel();
    dev.submit(0, job(vec![tx, ty], work, None, &sender));
    outcome.recv_timeout(Duration::from_secs(60)).unwrap().0?;
    Ok(bytemuck::cast_slice(&download(dev, by.as_ref(), 4000)).to_vec())
}

/// A package's precompiled binary for this device is loaded instead of its source (here a source
/// that does not even compile), and a binary that does not load falls back to the source.
#[test]
fn a_precompiled_binary_is_used_and_a_bad_one_falls_back_to_the_source() {
    use opencl3::context::Context;
    use opencl3::device::{Device as ClDevice, CL_DEVICE_TYPE_ALL};
    use std::borrow::Cow;

    let dev = device();
    let saxpy = agora_kernels::find("saxpy").unwrap().1;
    let imp = saxpy.opencl.clone().unwrap();
    // The binary as a packager makes it: the source built for this device, CL_PROGRAM_BINARIES.
    let platforms = opencl3::platform::get_platforms().unwrap();
    let id = platforms[0].get_devices(CL_DEVICE_TYPE_ALL).unwrap()[0];
    let cl_device = ClDevice::new(id);
    let context = Context::from_device(&cl_device).unwrap();
    let program =
        opencl3::program::Program::create_and_build_from_source(&context, &imp.source, "-cl-std=CL1.2").unwrap();
    let bytes = program.get_binaries().unwrap().remove(0);
    let name = cl_device.name().unwrap();
    let expected: Vec<f32> = (0..1000).map(|i| 2.0 * i as f32 + 1.0).collect();

    let binary_only: &'static KernelDef = Box::leak(Box::new(KernelDef {
        opencl: Some(agora_kernels::OpenClImpl {
            program: Cow::Borrowed("test/binary-only"),
            source: Cow::Borrowed("this is not OpenCL C"),
            binaries: vec![agora_kernels::OpenClBinary {
                device: Cow::Owned(name.clone()),
                bytes: bytes.into(),
            }]
            .into(),
            ..imp.clone()
        }),
        ..saxpy.clone()
    }));
    assert_eq!(run_saxpy(&dev, binary_only).unwrap(), expected, "ran from the binary");

    let bad_binary: &'static KernelDef = Box::leak(Box::new(KernelDef {
        opencl: Some(agora_kernels::OpenClImpl {
            program: Cow::Borrowed("test/bad-binary"),
            binaries: vec![agora_kernels::OpenClBinary {
                device: Cow::Owned(name),
                bytes: vec![0u8; 64].into(),
            }]
            .into(),
            ..imp
        }),
        ..saxpy.clone()
    }));
    assert_eq!(
        run_saxpy(&dev, bad_binary).unwrap(),
        expected,
        "compiled from the source"
    );
    dev.shutdown();
}

/// Device memory never comes with a freed buffer's bytes (issue #20, item 3): fresh
/// allocations of the size of buffers that held a secret read as zeros, through the reader
/// queue (synchronous reads) and through a lane's queue (a job's transfer to the host).
#[test]
fn fresh_allocations_read_as_zeros_never_as_freed_contents() {
    let dev = Arc::new(device());
    let len = 64 << 10;
    let secret = vec![0xA5u8; len];
    let (tx, rx) = mpsc::channel();
    let mut old = Vec::new();
    for _ in 0..8 {
        let (buffer, transfer) = upload(&dev, &secret);
        dev.submit(0, job(vec![transfer], Work::Nothing, None, &tx));
        assert_eq!(rx.recv().unwrap().0, Ok(()));
        assert_eq!(download(&dev, buffer.as_ref(), len), secret);
        old.push(buffer);
    }
    drop(old);
    let mut fresh = Vec::new();
    for n in 0..4 {
        let buffer = dev.alloc(1, len as u64).unwrap().unwrap();
        assert!(
            download(&dev, buffer.as_ref(), len).iter().all(|b| *b == 0),
            "buffer {n} (reader queue)"
        );
        fresh.push(buffer);
    }
    for n in 0..4 {
        let buffer = dev.alloc(1, len as u64).unwrap().unwrap();
        let mut host = vec![0xFFu8; len];
        let transfer = Transfer::ToHost {
            from: buffer.clone(),
            device: dev.clone(),
            host: host.as_mut_ptr(),
            len,
        };
        dev.submit(0, job(vec![transfer], Work::Nothing, None, &tx));
        assert_eq!(rx.recv().unwrap().0, Ok(()));
        assert!(host.iter().all(|b| *b == 0), "buffer {n} (lane queue)");
        // Zeroed on the lane's queue: the reader queue waits for it and sees zeros too.
        assert!(
            download(&dev, buffer.as_ref(), len).iter().all(|b| *b == 0),
            "buffer {n} (reader queue)"
        );
        fresh.push(buffer);
    }
}

/// A job's copies are done when its last copy completes, whichever way it goes: the daemon times
/// the device's link and its kernels by that moment (`JobTimes::transfers_done`). A job that only
/// wrote to the device once marked them done when they were enqueued, so the 64 MiB copy below
/// counted as no time and the rest of the job as all of it.
#[test]
fn a_job_that_only_writes_to_the_device_marks_its_copies_done_when_they_complete() {
    let dev = device();
    let len = 64 << 20;
    let data = vec![7u8; len];
    let (_buffer, transfer) = upload(&dev, &data);
    let (tx, rx) = mpsc::channel();
    let mut job = job(vec![transfer], Work::Nothing, None, &mpsc::channel().0);
    job.done = Box::new(move |result, times| {
        let _ = tx.send((result, times));
    });
    dev.submit(0, job);
    let (result, times) = rx.recv().unwrap();
    assert_eq!(result, Ok(()));
    let done = times
        .transfers_done
        .expect("a job with copies marks when they are done");
    let copying = done.saturating_duration_since(times.started);
    let whole = times.finished.saturating_duration_since(times.started);
    // Nothing but the copy runs in this job: it is most of the job's time.
    assert!(
        copying * 2 >= whole,
        "copies done {copying:?} after the start, the job {whole:?}"
    );
}

#[test]
fn a_platform_left_out_creates_no_device_and_says_why() {
    let priorities = crate::priority::LanePriorities::normal();
    let (kept, _) = super::discover_except(1, 0, &priorities, &|_| false);
    assert!(!kept.is_empty(), "PoCL is installed by make setup");
    let (left, problems) = super::discover_except(1, 0, &priorities, &|_| true);
    assert!(left.is_empty());
    assert!(
        problems
            .iter()
            .any(|p| p.contains("left out") && p.contains("CUDA backend")),
        "{problems:?}"
    );
}

/// A device host starts an idle lane's job on its message loop (`lane::set_start_on_caller`),
/// so only a job that merely enqueues may start there: a first launch of a kernel on the lane
/// (a kernel object, perhaps a program build), a buffer's first use (its allocation) or host
/// work (a queue drain) would hold every request behind it, the daemon dispatcher's synchronous
/// allocations among them.
#[test]
fn only_a_job_that_merely_enqueues_may_start_on_its_caller() {
    use crate::lane::Executor;
    let dev = device();
    let shared = dev.shared.clone();
    let queue = opencl3::command_queue::CommandQueue::create_default(&shared.context, 0).unwrap();
    // SAFETY: a plain one-byte device allocation with no host pointer.
    let lane_flag = unsafe {
        opencl3::memory::Buffer::<u8>::create(
            &shared.context,
            opencl3::memory::CL_MEM_READ_WRITE,
            1,
            std::ptr::null_mut(),
        )
    }
    .unwrap();
    let mut executor = super::executor::ClExecutor {
        shared,
        queue,
        lane_flag,
        kernels: std::collections::HashMap::new(),
        built: false,
        lane_finished: Arc::default(),
    };
    let saxpy = agora_kernels::find("saxpy").unwrap().1;
    let x = dev.alloc(1, 64).unwrap().unwrap();
    let y = dev.alloc(1, 64).unwrap().unwrap();
    let raw = [
        agora_protocol::RawArg::f32(2.0),
        agora_protocol::RawArg::buffer(0),
        agora_protocol::RawArg::buffer(1),
    ];
    let work = launch(saxpy, &[16], &raw, &[x.clone(), y.clone()], None);
    assert!(executor.starts_at_once(&[], &Work::Nothing));
    assert!(
        !executor.starts_at_once(&[], &work),
        "its buffers' first use allocates them (PoCL, in the enqueuing thread)"
    );
    for buffer in [&x, &y] {
        let buffer = super::buffer::as_cl(buffer.as_ref()).unwrap();
        buffer.zeroed_before(executor.queue.get(), &mut Vec::new()).unwrap();
    }
    assert!(
        !executor.starts_at_once(&[], &work),
        "its first launch on the lane builds"
    );
    executor
        .kernel(saxpy.opencl.as_ref().unwrap(), saxpy.params.len())
        .unwrap();
    assert!(executor.starts_at_once(&[], &work), "then it only enqueues");
    let fresh = dev.alloc(1, 64).unwrap().unwrap();
    let upload = [0u8; 64];
    let to_fresh = Transfer::ToDevice {
        host: upload.as_ptr(),
        len: upload.len(),
        to: fresh,
    };
    assert!(
        !executor.starts_at_once(&[to_fresh], &work),
        "a transfer into a buffer never used allocates it"
    );
    let mut host = [0u8; 16];
    let fill = Work::Fill {
        ptr: host.as_mut_ptr(),
        len: host.len(),
        value: 1,
    };
    assert!(!executor.starts_at_once(&[], &fill), "host work drains the queue first");
}

/// PoCL runs a kernel's work-groups on the host's cores: a busy lane of it holds them, as a CPU
/// lane holds its threads' (the dispatcher then does not spin for the core a client needs).
#[test]
fn an_opencl_device_on_the_cpu_says_its_lanes_hold_host_cores() {
    let dev = device();
    let cpu = dev.shared.host_flags.load(Ordering::Relaxed);
    assert!(cpu, "PoCL's device is the CPU: {}", dev.info().description);
    assert!(dev.info().host_cores_per_lane >= 1, "{:?}", dev.info());
    assert!(dev
        .info()
        .description
        .contains(&format!("({} compute units)", dev.info().host_cores_per_lane)));
}
