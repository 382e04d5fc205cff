//! Memory comes back (#22 item 4), against a real `agora serve` process: a tenant floods the
//! lanes with a thousand launches that the model cuts into hundreds of row slices each (over
//! 500 000 slices). The daemon's resident size stays bounded during the flood (slices are
//! generated lazily, one lane job per launch with a cursor over its rows, and a session's
//! outstanding lane work is bounded), and 10 s after the tenant leaves it is back within 64 MiB
//! of what it was before (queues shrink after peaks, the allocator's free memory goes back to
//! the operating system).
//!
//! Before lazy slices, each slice was a lane job of its own queued at once: the daemon grew by
//! hundreds of MiB during such a flood.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use agora::Arg;
use agora_test_support::Daemon;

fn rss_kib(pid: u32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.split_whitespace().next())
        .and_then(|v| v.parse().ok())
        .expect("VmRSS in /proc/PID/status")
}

/// Samples a process's resident size every 20 ms until dropped; remembers the largest.
struct PeakRss {
    peak: Arc<AtomicU64>,
    stop: Arc<AtomicBool>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl PeakRss {
    fn watch(pid: u32) -> PeakRss {
        let peak = Arc::new(AtomicU64::new(rss_kib(pid)));
        let stop = Arc::new(AtomicBool::new(false));
        let thread = std::thread::spawn({
            let (peak, stop) = (peak.clone(), stop.clone());
            move || {
                while !stop.load(Ordering::Relaxed) {
                    peak.fetch_max(rss_kib(pid), Ordering::Relaxed);
                    std::thread::sleep(Duration::from_millis(20));
                }
            }
        });
        PeakRss {
            peak,
            stop,
            thread: Some(thread),
        }
    }

    fn peak(&self) -> u64 {
        self.peak.load(Ordering::Relaxed)
    }
}

impl Drop for PeakRss {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

#[test]
fn resident_memory_stays_bounded_during_a_flood_of_sliced_launches_and_returns_after() {
    // Short slices: the model cuts each 512×512 sgemm into up to 512 row slices.
    let daemon = Daemon::start(
        env!("CARGO_BIN_EXE_agora"),
        "rss",
        &["--no-opencl", "--preempt-target-us", "100"],
    );
    let pid = daemon.pid();
    // A first small launch so that what every session costs once (kernel tables, the model,
    // the lanes' first jobs) is in the baseline.
    {
        let session = daemon.session();
        let q = session.queue("warm").unwrap();
        let saxpy = session.kernel("saxpy").unwrap();
        let x = session.buffer_from(&[1.0f32; 64]).unwrap();
        let y = session.buffer_from(&[1.0f32; 64]).unwrap();
        q.launch(&saxpy, &[Arg::F32(2.0), (&x).into(), (&y).into()], 64u64)
            .unwrap()
            .wait()
            .unwrap();
    }
    std::thread::sleep(Duration::from_millis(500));
    let before = rss_kib(pid);
    let watch = PeakRss::watch(pid);
    let launches = 1000;
    {
        let session = daemon.session();
        let q = session.queue("flood").unwrap();
        let sgemm = session.kernel("sgemm").unwrap();
        let n = 512usize;
        let a = session.buffer_from(&vec![1.0f32; n * n]).unwrap();
        let b = session.buffer_from(&vec![1.0f32; n * n]).unwrap();
        let c = session.buffer(n as u64 * n as u64 * 4).unwrap();
        let args = [
            Arg::I32(n as i32),
            Arg::I32(n as i32),
            Arg::I32(n as i32),
            Arg::F32(1.0),
            (&a).into(),
            (&b).into(),
            Arg::F32(0.0),
            (&c).into(),
        ];
        // The first launch teaches the model how long a launch runs, so the rest are sliced.
        q.launch(&sgemm, &args, (n as u64, n as u64)).unwrap().wait().unwrap();
        let flood = Instant::now();
        for _ in 1..launches {
            q.launch(&sgemm, &args, (n as u64, n as u64)).unwrap();
        }
        let issued = flood.elapsed();
        std::thread::sleep(Duration::from_secs(3));
        let status = daemon.status();
        let queued: u64 = status
            .devices
            .iter()
            .flat_map(|d| d.lanes.iter())
            .map(|l| l.queued)
            .sum();
        eprintln!(
            "flood: {launches} sliced sgemm launches issued in {:.2} s; 3 s later lanes hold {queued} queued jobs, \
             daemon RSS {before} KiB before, peak so far {} KiB",
            issued.as_secs_f64(),
            watch.peak()
        );
        // Back-pressure: about 2 s of predicted batch work (`sessions.lane_work_ms`) is taken
        // onto lanes, the rest waits in the session's ring (each launch runs for milliseconds).
        // Before: every slice of every launch was a queued lane job (285 417 here).
        assert!(
            queued <= 600,
            "{queued} jobs queued on lanes: a session's lane work is not bounded"
        );
        // The tenant leaves with work queued: the daemon cancels it.
    }
    let left = Instant::now();
    let peak = watch.peak();
    drop(watch);
    // 10 s to come back (sampled, so the figure says how soon it did).
    let mut after;
    loop {
        after = rss_kib(pid);
        if (after <= before + 64 * 1024 && left.elapsed() >= Duration::from_secs(1))
            || left.elapsed() >= Duration::from_secs(10)
        {
            break;
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    eprintln!(
        "daemon RSS: before {before} KiB, peak {peak} KiB (+{} MiB), {:.1} s after the tenant left {after} KiB \
         ({:+} MiB from before)",
        (peak - before) / 1024,
        left.elapsed().as_secs_f64(),
        (after as i64 - before as i64) / 1024
    );
    // Old code: one lane job per slice, ~1 KiB each, half a million queued: hundreds of MiB.
    assert!(
        peak <= before + 128 * 1024,
        "the flood grew the daemon from {before} KiB to {peak} KiB: lane work is not bounded"
    );
    assert!(
        after <= before + 64 * 1024,
        "10 s after the tenant left the daemon still holds {after} KiB (before the flood: {before} KiB, \
         peak {peak} KiB)"
    );
}

#[test]
fn a_session_held_back_by_its_lane_work_limit_gets_every_task_done() {
    // A limit of 1 ms of predicted batch work: after each launch the session is over it, and
    // each lane job that ends must wake the dispatcher to take the next (else the client would
    // wait for ever: it sends nothing more, its ring is full).
    let daemon = Daemon::start(
        env!("CARGO_BIN_EXE_agora"),
        "backpressure",
        &[
            "--no-opencl",
            "--preempt-target-us",
            "100",
            "--session-lane-work-ms",
            "1",
        ],
    );
    let session = daemon.session();
    let q = session.queue("held").unwrap();
    let sgemm = session.kernel("sgemm").unwrap();
    // About a millisecond each here: at most one or two on lanes at a time.
    let n = 192usize;
    let a = session.buffer_from(&vec![1.0f32; n * n]).unwrap();
    let c = session.buffer(n as u64 * n as u64 * 4).unwrap();
    let args = [
        Arg::I32(n as i32),
        Arg::I32(n as i32),
        Arg::I32(n as i32),
        Arg::F32(1.0),
        (&a).into(),
        (&a).into(),
        Arg::F32(0.0),
        (&c).into(),
    ];
    let started = Instant::now();
    // More than the ring holds (1024): the client waits for room too.
    let tasks: Vec<_> = (0..1500)
        .map(|_| q.launch(&sgemm, &args, (n as u64, n as u64)).unwrap())
        .collect();
    for t in &tasks {
        t.wait().unwrap();
    }
    eprintln!(
        "1500 launches held back to 1 ms of lane work each: done in {:.2} s",
        started.elapsed().as_secs_f64()
    );
    assert!(c.as_slice::<f32>().iter().all(|v| *v == n as f32));
}
