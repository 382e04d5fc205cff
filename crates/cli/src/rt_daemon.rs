//! Running RTDAG task sets on a real daemon (`agora rtdag FILE.yaml` without `--simulate`, and
//! the measured part of `agora bench rt`): each DAG is declared to the daemon, which admits it
//! or says why not, releases it every period by itself, and reports every release; nodes are
//! busy-work kernels of the file's WCETs, as RTDAG's own nodes are busy loops.
//!
//! The busy work is `sgemm` on 64 × 64 tiles with an inner dimension `k` chosen so that a node
//! runs for its WCET × `run_fraction` (nanoseconds per step of `k` measured first, on the
//! daemon's CPU lanes): compute-bound, a few kilobytes per node, and its time grows in steps of
//! about a microsecond.

use std::collections::HashMap;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use agora::{Arg, Buffer, DagRelease, Error, Kernel, Session, SessionOptions};
use agora_protocol::control::ControlError;
use agora_realtime::DagSpec;
use anyhow::{bail, Context, Result};
use serde::Serialize;

/// Rows and columns of the busy-work tile.
const TILE: u64 = 64;

/// Steps of `k` in the calibration launch.
const CALIBRATION_STEPS: u64 = 2048;

/// Most steps one node may take (a 256 MiB matrix): a WCET beyond it is refused.
const MAX_STEPS: u64 = 1 << 20;

/// One DAG's outcome on the daemon.
#[derive(Debug, Serialize)]
pub(crate) struct DaemonDagLine {
    pub name: String,
    pub admitted: bool,
    /// Each node's lane (admitted DAGs).
    pub lanes: Vec<String>,
    /// The daemon's refusal (refused DAGs).
    pub refusal: Option<String>,
    pub utilisation: f64,
    pub releases: u64,
    /// Releases that ended after their deadline or had a node fail.
    pub misses: u64,
    /// Misses of releases in which no node overran its WCET (admission's promise: zero).
    pub misses_without_overrun: u64,
    pub failed: u64,
    pub overruns: u64,
    pub response_p50_ms: f64,
    pub response_p99_ms: f64,
    pub response_max_ms: f64,
    pub jitter_p50_us: f64,
    pub jitter_p99_us: f64,
    /// From a release's due time to its first nodes' hand-off to a lane, p99.
    pub handoff_p99_us: f64,
}

/// What a run on the daemon measured.
#[derive(Debug, Serialize)]
pub(crate) struct DaemonRun {
    /// Nanoseconds per step of the busy-work kernel, as measured.
    pub busy_ns_per_step: f64,
    pub seconds: f64,
    pub dags: Vec<DaemonDagLine>,
    /// Release jitter of every release of every DAG, microseconds.
    pub jitter_p99_us: f64,
}

/// The busy-work kernel and its shared inputs.
struct BusyWork {
    sgemm: Kernel,
    a: Buffer,
    b: Buffer,
    ns_per_step: f64,
}

impl BusyWork {
    /// Measures the kernel's time per step (best of three) and sizes its inputs for `max_ns`.
    fn calibrate(session: &Session, lanes: usize, max_ns: u64, run_fraction: f64) -> Result<BusyWork> {
        let sgemm = session.kernel("sgemm")?;
        let queue = session.queue("rtdag-calibration")?;
        let matrix = |steps: u64| session.buffer(TILE * steps * 4);
        let (a, b, c) = (matrix(CALIBRATION_STEPS)?, matrix(CALIBRATION_STEPS)?, matrix(TILE)?);
        // Measured with every lane busy, as the lanes will be, medians of five: the nodes'
        // WCETs are upper bounds, so the busy work must not run longer than it was told.
        let lanes = lanes.max(1);
        let others: Vec<_> = (1..lanes)
            .map(|i| session.queue(&format!("rtdag-calibration-{i}")))
            .collect::<Result<_, _>>()?;
        // The slope between a short and a long launch: the round trip to the daemon and the
        // lane's fixed cost per job cancel out (the node's run on its lane has no round trip).
        let median_ns = |steps: u64| -> Result<f64> {
            let mut times = Vec::new();
            for _ in 0..5 {
                let load: Vec<_> = others
                    .iter()
                    .map(|q| q.launch(&sgemm, &busy_args(steps, &a, &b, &c), (TILE, TILE)))
                    .collect::<Result<_, _>>()?;
                let started = Instant::now();
                queue
                    .launch(&sgemm, &busy_args(steps, &a, &b, &c), (TILE, TILE))?
                    .wait()?;
                times.push(started.elapsed().as_nanos() as f64);
                for task in load {
                    task.wait()?;
                }
            }
            times.sort_by(f64::total_cmp);
            Ok(times[times.len() / 2])
        };
        // Three times, the slowest kept: a CPU whose speed varies (a shared VM) must not make the
        // nodes run past their WCETs.
        let short = CALIBRATION_STEPS / 8;
        let mut ns_per_step: f64 = 1.0;
        for _ in 0..3 {
            let (short_ns, long_ns) = (median_ns(short)?, median_ns(CALIBRATION_STEPS)?);
            ns_per_step = ns_per_step.max((long_ns - short_ns) / (CALIBRATION_STEPS - short) as f64);
        }
        let steps = ((max_ns as f64 * run_fraction) / ns_per_step).ceil() as u64 + 1;
        if steps > MAX_STEPS {
            bail!(
                "a WCET of {} ms needs {steps} busy-work steps of {ns_per_step:.0} ns, more than {MAX_STEPS}: shorten the node",
                max_ns as f64 / 1e6
            );
        }
        Ok(BusyWork {
            sgemm,
            a: matrix(steps.max(1))?,
            b: matrix(steps.max(1))?,
            ns_per_step,
        })
    }

    /// Steps that run for `ns`.
    fn steps_for(&self, ns: f64) -> u64 {
        ((ns / self.ns_per_step).round() as u64).max(1)
    }
}

fn busy_args<'a>(steps: u64, a: &'a Buffer, b: &'a Buffer, c: &'a Buffer) -> Vec<Arg<'a>> {
    vec![
        Arg::I32(TILE as i32),
        Arg::I32(TILE as i32),
        Arg::I32(steps as i32),
        Arg::F32(1.0),
        Arg::Buffer(a),
        Arg::Buffer(b),
        Arg::F32(0.0),
        Arg::Buffer(c),
    ]
}

/// Declares every DAG of `specs` to the daemon on `socket`, lets them run `seconds`, and
/// reports each.
pub(crate) fn run(socket: Option<PathBuf>, specs: &[DagSpec], seconds: f64, run_fraction: f64) -> Result<DaemonRun> {
    if !(run_fraction > 0.0 && run_fraction <= 2.0) {
        bail!("--run-fraction {run_fraction}: give the share of each WCET a node runs, e.g. 0.8");
    }
    let session = Session::connect_with(SessionOptions {
        socket: socket.clone(),
        name: Some("agora-rtdag".into()),
        ..Default::default()
    })
    .context("connecting to the daemon (start one with `agora serve`)")?;
    let max_ns = specs
        .iter()
        .flat_map(|s| s.nodes.iter().map(|n| n.wcet_us * 1000))
        .max()
        .unwrap_or(1000);
    let lanes = agora::daemon_status(socket.clone())?
        .devices
        .iter()
        .filter(|d| d.kind == agora::DeviceKind::Cpu)
        .map(|d| d.lanes.len())
        .max()
        .unwrap_or(1);
    let busy = BusyWork::calibrate(&session, lanes, max_ns, run_fraction)?;
    let mut outputs = Vec::new();
    let mut declared = Vec::new();
    let mut lines = Vec::new();
    for spec in specs {
        let mut builder = session.dag(&spec.name, Duration::from_micros(spec.period_us));
        if let Some(deadline) = spec.deadline_us {
            builder.deadline(Duration::from_micros(deadline));
        }
        for node in &spec.nodes {
            let c = session.buffer(TILE * TILE * 4)?;
            let steps = busy.steps_for(node.wcet_us as f64 * 1000.0 * run_fraction);
            let index = builder.node(
                &node.name,
                &busy.sgemm,
                &busy_args(steps, &busy.a, &busy.b, &c),
                (TILE, TILE),
            )?;
            builder.wcet(index, Duration::from_micros(node.wcet_us));
            if let Some(deadline) = node.relative_deadline_us {
                builder.node_deadline(index, Duration::from_micros(deadline));
            }
            outputs.push(c);
        }
        for &(from, to) in &spec.edges {
            builder.edge(from, to);
        }
        let utilisation = spec.nodes.iter().map(|n| n.wcet_us as f64).sum::<f64>() / spec.period_us as f64;
        match builder.declare() {
            Ok(dag) => {
                lines.push(DaemonDagLine::admitted(
                    &spec.name,
                    dag.admission().lanes.clone(),
                    dag.admission().utilisation,
                ));
                declared.push((lines.len() - 1, dag));
            }
            Err(Error::Control(ControlError::Dag(refusal))) => {
                lines.push(DaemonDagLine::refused(&spec.name, refusal, utilisation))
            }
            Err(e) => return Err(e).with_context(|| format!("declaring DAG {}", spec.name)),
        }
    }
    // Collected every 100 ms: the daemon keeps 4096 unread releases per DAG.
    let mut releases: HashMap<usize, Vec<DagRelease>> = HashMap::new();
    let until = Instant::now() + Duration::from_secs_f64(seconds);
    while Instant::now() < until {
        std::thread::sleep(Duration::from_millis(100).min(until.saturating_duration_since(Instant::now())));
        for (line, dag) in &declared {
            releases.entry(*line).or_default().extend(dag.results()?.releases);
        }
    }
    let mut all_jitter = Vec::new();
    for (line, dag) in declared {
        // Releases in flight finish; the last of them are read after the DAG stops.
        let results = dag.results()?;
        let mut got = releases.remove(&line).unwrap_or_default();
        got.extend(results.releases);
        dag.withdraw()?;
        all_jitter.extend(got.iter().map(|r| r.jitter_ns));
        lines[line].fill(&got);
    }
    all_jitter.sort_unstable();
    Ok(DaemonRun {
        busy_ns_per_step: busy.ns_per_step,
        seconds,
        dags: lines,
        jitter_p99_us: percentile(&all_jitter, 0.99) as f64 / 1e3,
    })
}

fn percentile(sorted: &[u64], p: f64) -> u64 {
    if sorted.is_empty() {
        return 0;
    }
    sorted[((sorted.len() - 1) as f64 * p).round() as usize]
}

impl DaemonDagLine {
    fn admitted(name: &str, lanes: Vec<String>, utilisation: f64) -> Self {
        DaemonDagLine {
            name: name.to_string(),
            admitted: true,
            lanes,
            refusal: None,
            utilisation,
            releases: 0,
            misses: 0,
            misses_without_overrun: 0,
            failed: 0,
            overruns: 0,
            response_p50_ms: 0.0,
            response_p99_ms: 0.0,
            response_max_ms: 0.0,
            jitter_p50_us: 0.0,
            jitter_p99_us: 0.0,
            handoff_p99_us: 0.0,
        }
    }

    fn refused(name: &str, refusal: String, utilisation: f64) -> Self {
        DaemonDagLine {
            admitted: false,
            refusal: Some(refusal),
            ..DaemonDagLine::admitted(name, Vec::new(), utilisation)
        }
    }

    fn fill(&mut self, releases: &[DagRelease]) {
        let mut response: Vec<u64> = releases.iter().map(|r| r.response_ns).collect();
        let mut jitter: Vec<u64> = releases.iter().map(|r| r.jitter_ns).collect();
        response.sort_unstable();
        jitter.sort_unstable();
        self.releases = releases.len() as u64;
        self.misses = releases.iter().filter(|r| !r.met).count() as u64;
        self.misses_without_overrun = releases.iter().filter(|r| !r.met && r.overruns.is_empty()).count() as u64;
        self.failed = releases.iter().filter(|r| r.failed.is_some()).count() as u64;
        self.overruns = releases.iter().map(|r| r.overruns.len() as u64).sum();
        self.response_p50_ms = percentile(&response, 0.5) as f64 / 1e6;
        self.response_p99_ms = percentile(&response, 0.99) as f64 / 1e6;
        self.response_max_ms = response.last().copied().unwrap_or(0) as f64 / 1e6;
        self.jitter_p50_us = percentile(&jitter, 0.5) as f64 / 1e3;
        self.jitter_p99_us = percentile(&jitter, 0.99) as f64 / 1e3;
        let mut handoff: Vec<u64> = releases.iter().map(|r| r.handoff_ns).collect();
        handoff.sort_unstable();
        self.handoff_p99_us = percentile(&handoff, 0.99) as f64 / 1e3;
    }
}

/// Prints a run as RTDAG's per-DAG end-to-end statistics.
pub(crate) fn print(file: &str, run: &DaemonRun) {
    println!(
        "{file} (on the daemon: {:.1} s, busy work {:.0} ns per step)",
        run.seconds, run.busy_ns_per_step
    );
    for line in &run.dags {
        if line.admitted {
            println!(
                "  {:<20} admitted, utilisation {:.3}, nodes on {}",
                line.name,
                line.utilisation,
                line.lanes.join(", ")
            );
        } else {
            println!("  {:<20} REFUSED: {}", line.name, line.refusal.as_deref().unwrap_or(""));
        }
    }
    println!(
        "  {:<20} {:>9} {:>7} {:>10} {:>9} {:>11} {:>11} {:>11} {:>14} {:>15}",
        "dag",
        "releases",
        "misses",
        "no overrun",
        "overruns",
        "resp p50 ms",
        "resp p99 ms",
        "resp max ms",
        "jitter p99 µs",
        "hand-off p99 µs"
    );
    for line in run.dags.iter().filter(|l| l.admitted) {
        println!(
            "  {:<20} {:>9} {:>7} {:>10} {:>9} {:>11.3} {:>11.3} {:>11.3} {:>14.1} {:>15.1}",
            line.name,
            line.releases,
            line.misses,
            line.misses_without_overrun,
            line.overruns,
            line.response_p50_ms,
            line.response_p99_ms,
            line.response_max_ms,
            line.jitter_p99_us,
            line.handoff_p99_us
        );
    }
}
