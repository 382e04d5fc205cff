//! What every benchmark shares: a daemon process started for a measurement, and the statistics
//! of repeated measurements (spread, median, percentiles). Knows no benchmark.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use serde::Serialize;

/// A daemon process started for one measurement.
pub(crate) struct DaemonProcess {
    child: Option<Child>,
    pub(crate) socket: PathBuf,
    dir: Option<PathBuf>,
}

impl DaemonProcess {
    /// Starts `agora serve` on a private socket, or reuses `existing`.
    pub(crate) fn start(existing: Option<&Path>, extra: &[&str]) -> Result<Self> {
        if let Some(socket) = existing {
            return Ok(DaemonProcess {
                child: None,
                socket: socket.to_path_buf(),
                dir: None,
            });
        }
        static COUNTER: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
        let n = COUNTER.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let dir = std::env::temp_dir().join(format!("agora-bench-{}-{n}", std::process::id()));
        std::fs::create_dir_all(&dir)?;
        let socket = dir.join("agora.sock");
        // `AGORA_BENCH_DAEMON`: another build's `agora` serves instead (an A/B of a change with
        // this build's benchmark and clients: `agora bench stall` against the daemon before it).
        let program = match std::env::var_os("AGORA_BENCH_DAEMON") {
            Some(other) => std::path::PathBuf::from(other),
            None => std::env::current_exe()?,
        };
        let child = Command::new(&program)
            .arg("serve")
            .arg("--socket")
            .arg(&socket)
            .args(extra)
            .env(
                "AGORA_LOG",
                std::env::var("AGORA_LOG").unwrap_or_else(|_| "warn".into()),
            )
            // A throwaway daemon keeps its model in its own directory (removed with it), unless
            // the benchmark's configuration file names another.
            .env("AGORA_STATE_DIR", dir.join("state"))
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .spawn()
            .with_context(|| format!("starting the daemon ({})", program.display()))?;
        let deadline = Instant::now() + Duration::from_secs(10);
        while std::os::unix::net::UnixStream::connect(&socket).is_err() {
            if Instant::now() > deadline {
                bail!("the daemon did not open {} within 10 s", socket.display());
            }
            std::thread::sleep(Duration::from_millis(5));
        }
        Ok(DaemonProcess {
            child: Some(child),
            socket,
            dir: Some(dir),
        })
    }

    pub(crate) fn pid(&self) -> Option<u32> {
        self.child.as_ref().map(|c| c.id())
    }

    /// Whether the daemon started here has exited (never, for one reused).
    pub(crate) fn has_exited(&mut self) -> bool {
        self.child.as_mut().is_some_and(|c| !matches!(c.try_wait(), Ok(None)))
    }
}

impl Drop for DaemonProcess {
    fn drop(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = Command::new("kill").arg("-TERM").arg(child.id().to_string()).status();
            let deadline = Instant::now() + Duration::from_secs(5);
            while Instant::now() < deadline {
                if let Ok(Some(_)) = child.try_wait() {
                    break;
                }
                std::thread::sleep(Duration::from_millis(10));
            }
            let _ = child.kill();
            let _ = child.wait();
        }
        if let Some(dir) = self.dir.take() {
            let _ = std::fs::remove_dir_all(dir);
        }
    }
}

/// A scratch directory, `$TMPDIR/agora-NAME-PID` (a benchmark's, `agora run --check`'s private
/// daemon's), removed when it is dropped, so a run that fails halfway leaves nothing behind
/// either.
pub(crate) struct ScratchDir(PathBuf);

impl ScratchDir {
    /// Makes it empty (a directory of a previous process of the same id is removed first).
    pub(crate) fn new(name: &str) -> Result<Self> {
        let dir = std::env::temp_dir().join(format!("agora-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir)?;
        Ok(ScratchDir(dir))
    }

    pub(crate) fn path(&self) -> &Path {
        &self.0
    }
}

impl Drop for ScratchDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// CPU time (user + system) of a process, in clock ticks (1/100 s).
pub(crate) fn cpu_ticks(pid: u32) -> Result<u64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat"))?;
    // Fields after the command name, which is in parentheses and may contain spaces.
    let rest = stat.rsplit_once(')').map(|(_, r)| r).context("parsing /proc stat")?;
    let fields: Vec<&str> = rest.split_whitespace().collect();
    // utime and stime are fields 14 and 15 of the full line, 12 and 13 after the name.
    Ok(fields[11].parse::<u64>()? + fields[12].parse::<u64>()?)
}

#[derive(Serialize, Debug, Clone, Copy)]
pub(crate) struct Spread {
    pub(crate) min: f64,
    pub(crate) median: f64,
    pub(crate) max: f64,
}

pub(crate) fn spread(values: &[f64]) -> Spread {
    let mut v = values.to_vec();
    v.sort_by(f64::total_cmp);
    Spread {
        min: v[0],
        median: v[v.len() / 2],
        max: v[v.len() - 1],
    }
}

pub(crate) fn monotonic_ns() -> u64 {
    let t = rustix::time::clock_gettime(rustix::time::ClockId::Monotonic);
    t.tv_sec as u64 * 1_000_000_000 + t.tv_nsec as u64
}

pub(crate) fn percentile(sorted: &[u64], p: f64) -> u64 {
    if sorted.is_empty() {
        return 0;
    }
    let index = ((sorted.len() - 1) as f64 * p).round() as usize;
    sorted[index]
}

/// The geometric mean of `values`; `None` when there are none.
pub(crate) fn geomean(values: impl Iterator<Item = f64>) -> Option<f64> {
    let (sum, n) = values.fold((0.0, 0usize), |(s, n), v| (s + v.ln(), n + 1));
    (n > 0).then(|| (sum / n as f64).exp())
}

pub(crate) fn minimum(values: &[f64]) -> f64 {
    values.iter().copied().fold(f64::INFINITY, f64::min)
}

pub(crate) fn median(values: &[f64]) -> f64 {
    let mut v = values.to_vec();
    v.sort_by(f64::total_cmp);
    if v.is_empty() {
        return f64::NAN;
    }
    v[v.len() / 2]
}

/// Min / median / max of `a[i] / b[i]`: the ratios of runs paired in the same repetition (for
/// interleaved measurements, where both sides of a pair saw the same state of the machine).
pub(crate) fn paired_ratios(a: &[f64], b: &[f64]) -> Spread {
    let ratios: Vec<f64> = a.iter().zip(b).map(|(x, y)| x / y).collect();
    if ratios.is_empty() {
        return Spread {
            min: f64::NAN,
            median: f64::NAN,
            max: f64::NAN,
        };
    }
    spread(&ratios)
}

/// The machine's 1-minute load average now (from `/proc/loadavg`), for a benchmark's report.
/// Above half the cores, other work competes with the measurement: says so on stderr.
pub(crate) fn load_average_at_start() -> Option<f64> {
    let text = std::fs::read_to_string("/proc/loadavg").ok()?;
    let load: f64 = text.split_whitespace().next()?.parse().ok()?;
    let cores = std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1);
    if load > cores as f64 / 2.0 {
        eprintln!(
            "warning: the 1-minute load average is {load:.2} on {cores} cores: other work is running, \
             so these timings will be noisy; compare the min / median / max of several repetitions, \
             or run again on a quiet machine"
        );
    }
    Some(load)
}
