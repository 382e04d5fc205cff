//! `agora bench soak`: a mixed, verified workload from several client processes for minutes, with
//! clients killed (`kill -9`) and restarted at random, while the daemon's memory, descriptors and
//! throughput are sampled.
//!
//! Each client (`agora bench-client soak`) loops over rounds of sync_to, fill, saxpy, copy and
//! sync_from whose results it checks, and reports counts on stdout every 200 ms; some run on
//! latency-class queues, the others on batch queues, one prefers the OpenCL device when the
//! daemon has one. Any wrong result, any client that fails on its own, a daemon that dies or
//! sessions left behind after the run fail the benchmark (non-zero exit, after its report).

use std::io::{BufRead, BufReader, IsTerminal};
use std::process::{Child, ChildStdin, Command, Stdio};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use clap::Args;
use serde::Serialize;

use super::client::SoakReport;
use super::harness::{load_average_at_start, spread, DaemonProcess, Spread};

/// `agora bench soak` options.
#[derive(Args, Debug)]
pub struct SoakArgs {
    /// How long to run, in minutes (default 10; 0.5 with --quick).
    #[arg(long)]
    minutes: Option<f64>,
    /// Client processes running at once (default 6; 4 with --quick).
    #[arg(long)]
    clients: Option<usize>,
    /// Seconds between samples of the daemon (default 5; 2 with --quick).
    #[arg(long)]
    sample_s: Option<f64>,
    /// Mean seconds between two kills of a random client (default 3; 2 with --quick; 0: none).
    #[arg(long)]
    kill_every_s: Option<f64>,
    /// Seed of the random kills (default: from the clock; the report says which).
    #[arg(long)]
    seed: Option<u64>,
    /// Print JSON.
    #[arg(long)]
    json: bool,
    /// A 30-second version for smoke checks.
    #[arg(long)]
    quick: bool,
}

/// What a client runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Profile {
    /// Small rounds (4 KiB buffers) on a latency-class queue.
    Latency,
    /// 1 MiB rounds on a batch queue.
    Batch,
    /// 256 KiB rounds on a batch queue that prefers the OpenCL device.
    OpenCl,
}

impl Profile {
    const ALL: [Profile; 3] = [Profile::Latency, Profile::Batch, Profile::OpenCl];

    fn name(self) -> &'static str {
        match self {
            Profile::Latency => "latency",
            Profile::Batch => "batch",
            Profile::OpenCl => "opencl",
        }
    }

    fn index(self) -> usize {
        self as usize
    }

    /// `agora bench-client soak` options.
    fn options(self) -> Vec<&'static str> {
        match self {
            Profile::Latency => vec!["--latency-class", "--size", "1024"],
            Profile::Batch => vec!["--size", "262144"],
            Profile::OpenCl => vec!["--device-kind", "opencl", "--size", "65536"],
        }
    }

    /// The profile of client `i`: latency, batch, OpenCL (batch without one), batch, again.
    fn of_client(i: usize, opencl: bool) -> Profile {
        match i % 4 {
            0 => Profile::Latency,
            2 if opencl => Profile::OpenCl,
            _ => Profile::Batch,
        }
    }
}

/// Counts summed over every client process, killed ones included.
#[derive(Default)]
struct Totals {
    rounds: AtomicU64,
    tasks: AtomicU64,
    wrong: AtomicU64,
    rounds_by_profile: [AtomicU64; 3],
    max_round_ns: [AtomicU64; 3],
    wrong_details: Mutex<Vec<String>>,
}

/// One running client process and the thread that reads its reports.
struct SoakClient {
    profile: Profile,
    child: Child,
    stdin: Option<ChildStdin>,
    reader: Option<std::thread::JoinHandle<()>>,
}

impl SoakClient {
    fn start(socket: &std::path::Path, profile: Profile, totals: &Arc<Totals>) -> Result<Self> {
        let mut child = Command::new(std::env::current_exe()?)
            .args(["bench-client", "soak", "--iterations", "0"])
            .args(profile.options())
            .arg("--socket")
            .arg(socket)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .context("starting a soak client")?;
        let stdin = child.stdin.take();
        let stdout = child.stdout.take().context("client stdout")?;
        let totals = totals.clone();
        let reader = std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines() {
                let Ok(line) = line else { break };
                let Ok(r) = serde_json::from_str::<SoakReport>(line.trim()) else {
                    // A line cut short by a kill: the rounds it would have counted are lost,
                    // never miscounted.
                    continue;
                };
                totals.rounds.fetch_add(r.rounds, Ordering::Relaxed);
                totals.tasks.fetch_add(r.tasks, Ordering::Relaxed);
                totals.wrong.fetch_add(r.wrong, Ordering::Relaxed);
                totals.rounds_by_profile[profile.index()].fetch_add(r.rounds, Ordering::Relaxed);
                totals.max_round_ns[profile.index()].fetch_max(r.max_round_ns, Ordering::Relaxed);
                if !r.detail.is_empty() {
                    if let Ok(mut d) = totals.wrong_details.lock() {
                        d.push(format!("{} client: {}", profile.name(), r.detail));
                    }
                }
            }
        });
        Ok(SoakClient {
            profile,
            child,
            stdin,
            reader: Some(reader),
        })
    }

    /// `kill -9`, then waits for the process and its reader.
    fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        if let Some(reader) = self.reader.take() {
            let _ = reader.join();
        }
    }

    /// Ends the client cleanly (closes its stdin: it finishes its round, reports, exits); whether
    /// it exited successfully within `timeout`.
    fn stop(mut self, timeout: Duration) -> bool {
        drop(self.stdin.take());
        let deadline = Instant::now() + timeout;
        let ok = loop {
            match self.child.try_wait() {
                Ok(Some(status)) => break status.success(),
                Ok(None) if Instant::now() < deadline => std::thread::sleep(Duration::from_millis(10)),
                _ => {
                    let _ = self.child.kill();
                    let _ = self.child.wait();
                    break false;
                }
            }
        };
        if let Some(reader) = self.reader.take() {
            let _ = reader.join();
        }
        ok
    }
}

/// One sample of the daemon process.
#[derive(Serialize, Debug, Clone, Copy)]
struct Sample {
    /// Seconds since the start.
    t_s: f64,
    /// Resident memory (VmRSS: anonymous + file + shared, the sessions' segments it touched
    /// included), KiB.
    rss_kib: u64,
    /// Anonymous resident memory (RssAnon: the daemon's own heap), KiB.
    rss_anon_kib: u64,
    /// Open file descriptors.
    fds: u64,
    /// Threads.
    threads: u64,
    /// Verified rounds per second since the previous sample.
    rounds_per_s: f64,
    /// Tasks per second since the previous sample.
    tasks_per_s: f64,
    /// Client processes killed so far.
    kills: u64,
}

/// `(VmRSS, RssAnon, Threads)` of a process, KiB and count.
fn proc_status(pid: u32) -> Result<(u64, u64, u64)> {
    let text = std::fs::read_to_string(format!("/proc/{pid}/status")).context("reading the daemon's status")?;
    let field = |name: &str| -> u64 {
        text.lines()
            .find_map(|l| l.strip_prefix(name))
            .and_then(|rest| rest.split_whitespace().next())
            .and_then(|v| v.parse().ok())
            .unwrap_or(0)
    };
    Ok((field("VmRSS:"), field("RssAnon:"), field("Threads:")))
}

fn open_fds(pid: u32) -> Result<u64> {
    Ok(std::fs::read_dir(format!("/proc/{pid}/fd"))
        .context("listing the daemon's descriptors")?
        .count() as u64)
}

/// Least-squares slope of `(x, y)` points; 0 for fewer than two distinct x.
fn slope(points: &[(f64, f64)]) -> f64 {
    let n = points.len() as f64;
    if points.len() < 2 {
        return 0.0;
    }
    let mx = points.iter().map(|p| p.0).sum::<f64>() / n;
    let my = points.iter().map(|p| p.1).sum::<f64>() / n;
    let sxx: f64 = points.iter().map(|p| (p.0 - mx) * (p.0 - mx)).sum();
    let sxy: f64 = points.iter().map(|p| (p.0 - mx) * (p.1 - my)).sum();
    if sxx == 0.0 {
        0.0
    } else {
        sxy / sxx
    }
}

/// A small, seeded generator for the kills (xorshift64*).
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }

    /// Uniform in [0, 1).
    fn unit(&mut self) -> f64 {
        (self.next() >> 11) as f64 / (1u64 << 53) as f64
    }
}

#[derive(Serialize, Debug)]
struct ProfileReport {
    profile: &'static str,
    clients: usize,
    rounds: u64,
    max_round_ms: f64,
}

#[derive(Serialize, Debug)]
struct SoakReportJson {
    seconds: f64,
    clients: usize,
    opencl: bool,
    seed: u64,
    sample_s: f64,
    warm_up_s: f64,
    rounds: u64,
    tasks: u64,
    wrong_results: u64,
    wrong_details: Vec<String>,
    client_failures: u64,
    kills: u64,
    restarts: u64,
    daemon_alive: bool,
    sessions_left: u64,
    profiles: Vec<ProfileReport>,
    throughput_rounds_per_s: Spread,
    throughput_tasks_per_s: Spread,
    /// Sample intervals in which no client completed a round (the daemon, or the machine,
    /// stalled for at least a whole interval).
    stalled_intervals: usize,
    rss_mib_start: f64,
    rss_mib_end: f64,
    rss_mib_max: f64,
    rss_slope_mib_per_min: f64,
    rss_anon_slope_mib_per_min: f64,
    fds_start: u64,
    fds_end: u64,
    fds_max: u64,
    fd_slope_per_min: f64,
    threads_max: u64,
    samples: Vec<Sample>,
    load_average_at_start: Option<f64>,
    verified: bool,
}

pub fn soak(args: SoakArgs) -> Result<()> {
    let minutes = args.minutes.unwrap_or(if args.quick { 0.5 } else { 10.0 });
    if minutes.is_nan() || minutes <= 0.0 {
        bail!("--minutes must be above 0");
    }
    let duration = Duration::from_secs_f64(minutes * 60.0);
    let count = args.clients.unwrap_or(if args.quick { 4 } else { 6 }).max(1);
    let sample_s = args.sample_s.unwrap_or(if args.quick { 2.0 } else { 5.0 }).max(0.1);
    let kill_every_s = args.kill_every_s.unwrap_or(if args.quick { 2.0 } else { 3.0 });
    // Slopes are taken after the warm-up: the first third of a quick run, else the first fifth
    // (at least 10 s, at most 2 min), while allocators and caches grow to their working size.
    let warm_up_s = if args.quick {
        duration.as_secs_f64() / 3.0
    } else {
        (duration.as_secs_f64() / 5.0).clamp(10.0, 120.0)
    };
    let seed = args.seed.unwrap_or_else(|| super::harness::monotonic_ns() | 1);
    let mut rng = Rng(seed.max(1));
    let load = load_average_at_start();

    let mut daemon = DaemonProcess::start(None, &[])?;
    let pid = daemon.pid().context("the daemon's pid")?;
    let opencl = agora::daemon_status(Some(daemon.socket.clone()))?
        .devices
        .iter()
        .any(|d| d.kind == "opencl");
    let profiles: Vec<Profile> = (0..count).map(|i| Profile::of_client(i, opencl)).collect();
    let totals = Arc::new(Totals::default());
    eprintln!(
        "agora bench soak: {:.1} min, {count} clients ({}), a kill -9 every ~{kill_every_s} s, a sample every {sample_s} s, seed {seed}",
        minutes,
        Profile::ALL
            .iter()
            .map(|p| format!("{} {}", profiles.iter().filter(|q| *q == p).count(), p.name()))
            .collect::<Vec<_>>()
            .join(", ")
    );

    let mut clients = profiles
        .iter()
        .map(|p| SoakClient::start(&daemon.socket, *p, &totals))
        .collect::<Result<Vec<_>>>()?;
    let start = Instant::now();
    let next_kill_in = |rng: &mut Rng| Duration::from_secs_f64(kill_every_s * (0.5 + rng.unit()));
    let mut next_kill = (kill_every_s > 0.0).then(|| start + next_kill_in(&mut rng));
    let mut next_sample = start + Duration::from_secs_f64(sample_s);
    let (mut kills, mut restarts, mut failures) = (0u64, 0u64, 0u64);
    let mut samples = Vec::new();
    let mut last = (start, 0u64, 0u64);
    let tty = std::io::stderr().is_terminal();
    let (rss0, anon0, threads0) = proc_status(pid)?;
    samples.push(Sample {
        t_s: 0.0,
        rss_kib: rss0,
        rss_anon_kib: anon0,
        fds: open_fds(pid)?,
        threads: threads0,
        rounds_per_s: 0.0,
        tasks_per_s: 0.0,
        kills: 0,
    });
    let mut daemon_alive = true;
    while start.elapsed() < duration {
        std::thread::sleep(Duration::from_millis(20));
        let now = Instant::now();
        if daemon.has_exited() {
            daemon_alive = false;
            eprintln!("agora bench soak: the daemon died");
            break;
        }
        // Clients that ended on their own failed (they run until told to stop): count, restart.
        for slot in clients.iter_mut() {
            if let Ok(Some(status)) = slot.child.try_wait() {
                failures += 1;
                eprintln!(
                    "agora bench soak: a {} client failed ({status}); restarting it",
                    slot.profile.name()
                );
                slot.kill(); // reaps it, joins its reader
                *slot = SoakClient::start(&daemon.socket, slot.profile, &totals)?;
            }
        }
        if let Some(at) = next_kill {
            if now >= at {
                // At a random moment of its round: tasks in flight, completions unread.
                let i = (rng.next() % clients.len() as u64) as usize;
                let victim = &mut clients[i];
                victim.kill();
                kills += 1;
                std::thread::sleep(Duration::from_millis(rng.next() % 200));
                *victim = SoakClient::start(&daemon.socket, victim.profile, &totals)?;
                restarts += 1;
                next_kill = Some(Instant::now() + next_kill_in(&mut rng));
            }
        }
        if now >= next_sample {
            next_sample += Duration::from_secs_f64(sample_s);
            let (rss, anon, threads) = proc_status(pid)?;
            let fds = open_fds(pid)?;
            let rounds = totals.rounds.load(Ordering::Relaxed);
            let tasks = totals.tasks.load(Ordering::Relaxed);
            let dt = now.duration_since(last.0).as_secs_f64();
            let sample = Sample {
                t_s: now.duration_since(start).as_secs_f64(),
                rss_kib: rss,
                rss_anon_kib: anon,
                fds,
                threads,
                rounds_per_s: (rounds - last.1) as f64 / dt,
                tasks_per_s: (tasks - last.2) as f64 / dt,
                kills,
            };
            if rounds == last.1 {
                eprintln!("agora bench soak: no client completed a round in the last {dt:.1} s (daemon pid {pid})");
            }
            last = (now, rounds, tasks);
            samples.push(sample);
            let line = format!(
                "soak {:>5.0}/{:.0} s  rounds {rounds} ({:.0}/s)  wrong {}  kills {kills}  failures {failures}  rss {:.1} MiB  fds {fds}",
                sample.t_s,
                duration.as_secs_f64(),
                sample.rounds_per_s,
                totals.wrong.load(Ordering::Relaxed),
                rss as f64 / 1024.0,
            );
            if tty {
                eprint!("\r{line}\x1b[K");
            } else {
                eprintln!("{line}");
            }
        }
    }
    if tty {
        eprintln!();
    }
    let seconds = start.elapsed().as_secs_f64();
    for client in clients {
        let profile = client.profile;
        if !client.stop(Duration::from_secs(10)) {
            failures += 1;
            eprintln!(
                "agora bench soak: a {} client did not end cleanly within 10 s of being told to (killed)",
                profile.name()
            );
        }
    }
    // Every session of the run must be gone: killed ones reclaimed, stopped ones closed.
    let mut sessions_left = u64::MAX;
    if daemon_alive && !daemon.has_exited() {
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            let status = agora::daemon_status(Some(daemon.socket.clone()))?;
            sessions_left = status.live_sessions + status.closing_sessions;
            if sessions_left == 0 {
                break;
            }
            if Instant::now() > deadline {
                eprintln!(
                    "agora bench soak: {} live and {} closing sessions 10 s after the end:",
                    status.live_sessions, status.closing_sessions
                );
                for s in &status.sessions {
                    eprintln!(
                        "  session {} pid {} {}: {} in flight, {} submitted, {} completed, {} failed",
                        s.id, s.pid, s.name, s.in_flight, s.tasks_submitted, s.tasks_completed, s.tasks_failed
                    );
                }
                break;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    } else {
        daemon_alive = false;
    }
    let (rss_end, anon_end, threads_end) = if daemon_alive { proc_status(pid)? } else { (0, 0, 0) };
    let fds_end = if daemon_alive { open_fds(pid)? } else { 0 };
    drop(daemon);

    let after: Vec<&Sample> = samples.iter().filter(|s| s.t_s >= warm_up_s).collect();
    let per_min = |f: fn(&Sample) -> f64| slope(&after.iter().map(|s| (s.t_s / 60.0, f(s))).collect::<Vec<_>>());
    let intervals: Vec<&Sample> = samples.iter().skip(1).collect();
    let nonempty = |v: Vec<f64>| if v.is_empty() { vec![0.0] } else { v };
    let wrong = totals.wrong.load(Ordering::Relaxed);
    let report = SoakReportJson {
        seconds,
        clients: count,
        opencl,
        seed,
        sample_s,
        warm_up_s,
        rounds: totals.rounds.load(Ordering::Relaxed),
        tasks: totals.tasks.load(Ordering::Relaxed),
        wrong_results: wrong,
        wrong_details: totals.wrong_details.lock().map(|d| d.clone()).unwrap_or_default(),
        client_failures: failures,
        kills,
        restarts,
        daemon_alive,
        sessions_left,
        profiles: Profile::ALL
            .iter()
            .map(|p| ProfileReport {
                profile: p.name(),
                clients: profiles.iter().filter(|q| *q == p).count(),
                rounds: totals.rounds_by_profile[p.index()].load(Ordering::Relaxed),
                max_round_ms: totals.max_round_ns[p.index()].load(Ordering::Relaxed) as f64 / 1e6,
            })
            .collect(),
        throughput_rounds_per_s: spread(&nonempty(intervals.iter().map(|s| s.rounds_per_s).collect())),
        throughput_tasks_per_s: spread(&nonempty(intervals.iter().map(|s| s.tasks_per_s).collect())),
        stalled_intervals: intervals.iter().filter(|s| s.rounds_per_s == 0.0).count(),
        rss_mib_start: rss0 as f64 / 1024.0,
        rss_mib_end: rss_end as f64 / 1024.0,
        rss_mib_max: samples.iter().map(|s| s.rss_kib).max().unwrap_or(0).max(rss_end) as f64 / 1024.0,
        rss_slope_mib_per_min: per_min(|s| s.rss_kib as f64 / 1024.0),
        rss_anon_slope_mib_per_min: per_min(|s| s.rss_anon_kib as f64 / 1024.0),
        fds_start: samples[0].fds,
        fds_end,
        fds_max: samples.iter().map(|s| s.fds).max().unwrap_or(0),
        fd_slope_per_min: per_min(|s| s.fds as f64),
        threads_max: samples.iter().map(|s| s.threads).max().unwrap_or(0).max(threads_end),
        samples,
        load_average_at_start: load,
        verified: wrong == 0,
    };
    let _ = anon_end;

    if args.json {
        println!("{}", serde_json::to_string_pretty(&report)?);
    } else {
        let t = &report.throughput_rounds_per_s;
        println!(
            "\n{:.0} s, {} clients, {} kills and restarts, seed {}",
            report.seconds, report.clients, report.kills, report.seed
        );
        println!(
            "verified rounds {} ({} tasks), wrong results {}, client failures {}, sessions left {}, daemon alive {}",
            report.rounds,
            report.tasks,
            report.wrong_results,
            report.client_failures,
            report.sessions_left,
            report.daemon_alive
        );
        for p in &report.profiles {
            if p.clients > 0 {
                println!(
                    "  {:<8} {} client(s): {} rounds, longest {:.1} ms",
                    p.profile, p.clients, p.rounds, p.max_round_ms
                );
            }
        }
        println!(
            "throughput per {:.0} s interval (rounds/s): min {:.0}, median {:.0}, max {:.0}; {} interval(s) without any round",
            report.sample_s, t.min, t.median, t.max, report.stalled_intervals
        );
        println!(
            "daemon RSS {:.1} → {:.1} MiB (max {:.1}); after the {:.0} s warm-up: {:+.3} MiB/min (anonymous {:+.3})",
            report.rss_mib_start,
            report.rss_mib_end,
            report.rss_mib_max,
            report.warm_up_s,
            report.rss_slope_mib_per_min,
            report.rss_anon_slope_mib_per_min
        );
        println!(
            "daemon fds {} → {} (max {}); after the warm-up: {:+.2} per min",
            report.fds_start, report.fds_end, report.fds_max, report.fd_slope_per_min
        );
    }
    let mut problems = Vec::new();
    if report.wrong_results > 0 {
        problems.push(format!(
            "{} wrong results (first: {})",
            report.wrong_results,
            report.wrong_details.first().map_or("?", String::as_str)
        ));
    }
    if report.client_failures > 0 {
        problems.push(format!("{} client failures", report.client_failures));
    }
    if !report.daemon_alive {
        problems.push("the daemon died".into());
    }
    if report.daemon_alive && report.sessions_left > 0 {
        problems.push(format!(
            "{} sessions left 10 s after every client ended",
            report.sessions_left
        ));
    }
    if !problems.is_empty() {
        bail!("soak failed: {}", problems.join("; "));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn slope_is_least_squares() {
        assert_eq!(slope(&[]), 0.0);
        assert_eq!(slope(&[(1.0, 5.0)]), 0.0);
        assert!((slope(&[(0.0, 1.0), (1.0, 3.0), (2.0, 5.0)]) - 2.0).abs() < 1e-12);
        // Noise around a flat line: slope near 0.
        assert!(slope(&[(0.0, 1.0), (1.0, -1.0), (2.0, 1.0), (3.0, -1.0)]).abs() < 0.5);
    }

    #[test]
    fn profiles_mix_latency_batch_and_opencl() {
        let with: Vec<Profile> = (0..6).map(|i| Profile::of_client(i, true)).collect();
        assert!(with.contains(&Profile::Latency) && with.contains(&Profile::Batch) && with.contains(&Profile::OpenCl));
        assert!(!(0..6).any(|i| Profile::of_client(i, false) == Profile::OpenCl));
    }
}
