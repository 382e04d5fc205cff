//! Memory comes back (#22 item 4), against a real `agora serve` process: after a tenant floods
//! the lanes with a thousand sliced launches (over 100 000 lane jobs) and leaves, the daemon's resident size returns
//! to within 64 MiB of what it was before (it kept its peak for good: queues never shrank and
//! the allocator kept what was freed).

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

#[test]
fn resident_memory_returns_after_a_flood_of_sliced_launches() {
    // Short slices: each launch becomes many lane jobs.
    let daemon = Daemon::start(
        env!("CARGO_BIN_EXE_agora"),
        "rss",
        &["--no-opencl", "--preempt-target-us", "100"],
    );
    let before = rss_kib(daemon.pid());
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
        for _ in 0..1000 {
            q.launch(&sgemm, &args, (n as u64, n as u64)).unwrap();
        }
        std::thread::sleep(Duration::from_secs(2));
        let during = rss_kib(daemon.pid());
        assert!(
            during > before + 32 * 1024,
            "the flood must cost memory to prove anything: {before} -> {during} KiB"
        );
        // The tenant leaves with work queued: the daemon cancels it.
    }
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let now = rss_kib(daemon.pid());
        if now <= before + 64 * 1024 {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "20 s after the tenant left the daemon still holds {now} KiB (before the flood: {before} KiB)"
        );
        std::thread::sleep(Duration::from_millis(200));
    }
}
