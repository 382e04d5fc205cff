//! The scheduler's benchmarks: `agora bench hetero` (placement policies side by side on a mixed
//! workload over cpu + opencl + sim devices) and `agora bench sharing` (four applications sharing
//! the node vs the same four one after another).
//!
//! Both start their own daemon process per configuration (as `agora bench latency` does) and
//! verify every job's result: a policy that is fast but wrong would fail the benchmark.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Instant;

use agora::{Session, SessionOptions};
use agora_daemon::telemetry::rapl::Rapl;
use anyhow::{bail, Context, Result};
use clap::Args;
use serde::Serialize;

use super::harness::{load_average_at_start, paired_ratios, spread, DaemonProcess, ScratchDir, Spread};

/// `agora bench hetero` options.
#[derive(Args, Debug)]
pub struct HeteroArgs {
    /// Policies to compare, in order.
    #[arg(long, value_delimiter = ',', default_value = "rr,perf,energy", value_parser = agora_daemon::PolicyKind::parse)]
    policy: Vec<agora_daemon::PolicyKind>,
    /// Concurrent tenants (sessions), each running its share of the jobs one after another.
    #[arg(long, default_value_t = 4)]
    tenants: usize,
    /// Jobs per tenant (default 12; 3 with --quick).
    #[arg(long)]
    jobs: Option<usize>,
    /// Timed repetitions per policy, after the learning passes (default 3; 1 with --quick).
    #[arg(long)]
    reps: Option<usize>,
    /// Untimed passes of the workload before the timed ones, in which the performance model
    /// (fed under every policy) measures each kernel on each device.
    #[arg(long, default_value_t = 2)]
    learn: usize,
    /// Print JSON: one object per policy.
    #[arg(long)]
    json: bool,
    /// A short version for smoke checks.
    #[arg(long)]
    quick: bool,
}

/// The jobs of the mixed workload: Rodinia programs and a saxpy stream at sizes that take a few
/// to a few tens of milliseconds on this project's 2-core machine.
const JOB_MIX: &[(&str, u64, Option<usize>)] = &[
    ("hotspot", 256, Some(10)),
    ("pathfinder", 50_000, Some(50)),
    ("lavamd", 3, None),
    ("saxpy", 262_144, Some(30)),
    ("nw", 512, None),
    ("backprop", 16_384, None),
];

/// The devices of the benchmark and their power models. PoCL runs on the host's cores, whose
/// idle power the CPU device already counts, so its idle power is 0 here. The sim devices are a
/// slow accelerator (a tenth of a core per lane, power-hungry) and a frugal one (70% of a core at
/// a fifth of a core's power).
const HETERO_CONFIG: &str = r#"
[cpu]
lanes = 2
idle_watts = 4.0
active_watts = 24.0

[opencl]
lanes = 2
idle_watts = 0.0
active_watts = 24.0

[[sim]]
name = "slow"
lanes = 2
speed = 0.1
launch_ns = 20000
idle_watts = 5.0
active_watts = 25.0

[[sim]]
name = "frugal"
lanes = 2
speed = 0.7
launch_ns = 20000
idle_watts = 1.0
active_watts = 5.0
"#;

/// Power models of the benchmark's devices by kind/name: (idle watts, extra watts per busy lane).
fn power_of(device: &agora_protocol::control::DeviceStatus) -> (f64, f64) {
    let lanes = device.lanes.len().max(1) as f64;
    match (device.kind.name(), device.name.as_str()) {
        ("cpu", _) => (4.0, 20.0 / lanes),
        ("opencl", _) => (0.0, 24.0 / lanes),
        (_, "slow") => (5.0, 20.0 / lanes),
        (_, "frugal") => (1.0, 4.0 / lanes),
        _ => (0.0, 0.0),
    }
}

#[derive(Serialize, Debug)]
struct HeteroResult {
    policy: String,
    /// Median makespan over the timed repetitions.
    makespan_s: f64,
    makespan: Spread,
    /// Energy of the median-makespan repetition.
    energy_j: f64,
    /// `measured` (RAPL for the host, model for sim devices) or `model`.
    energy_source: String,
    /// Busy fraction of each device's lanes over the makespan (median repetition).
    utilisation: Vec<(String, f64)>,
    /// Jobs per repetition, all verified against host references.
    jobs: usize,
    /// Wall time of the first learning pass, which starts from an empty performance model (the
    /// workload's first run on a new node: explorations of untried devices included); `None`
    /// with `--learn 0`.
    first_pass_s: Option<f64>,
}

/// Runs `jobs` jobs on each of `tenants` sessions at once; returns the wall time.
fn run_jobs(socket: &Path, tenants: usize, jobs: usize) -> Result<f64> {
    let start = Instant::now();
    let outcomes: Vec<Result<()>> = std::thread::scope(|scope| {
        let handles: Vec<_> = (0..tenants)
            .map(|tenant| {
                scope.spawn(move || -> Result<()> {
                    let session = Session::connect_with(SessionOptions {
                        socket: Some(socket.to_path_buf()),
                        name: Some(format!("hetero-tenant{tenant}")),
                        heap_bytes: None,
                        control_timeout: None,
                        reconnect_timeout: None,
                    })?;
                    for job in 0..jobs {
                        let (program, size, iterations) = JOB_MIX[(tenant + job) % JOB_MIX.len()];
                        let workload = agora_apps::build(program, size, iterations).context("job mix")?;
                        let report = agora_apps::run_on_agora(&session, &workload, None)?;
                        if !report.verified {
                            bail!(
                                "{program} (tenant {tenant}, job {job}) gave a wrong result: max error {}",
                                report.max_error
                            );
                        }
                    }
                    Ok(())
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|h| {
                h.join()
                    .unwrap_or_else(|_| Err(anyhow::anyhow!("a tenant thread panicked")))
            })
            .collect()
    });
    for outcome in outcomes {
        outcome?;
    }
    Ok(start.elapsed().as_secs_f64())
}

fn busy_ns(report: &agora_protocol::control::StatusReport) -> Vec<Vec<u64>> {
    report
        .devices
        .iter()
        .map(|d| d.lanes.iter().map(|l| l.busy_ns).collect())
        .collect()
}

pub fn hetero(args: HeteroArgs) -> Result<()> {
    let jobs = args.jobs.unwrap_or(if args.quick { 3 } else { 12 });
    let reps = args.reps.unwrap_or(if args.quick { 1 } else { 3 }).max(1);
    let rapl = Rapl::open();
    if !args.json {
        if let Err(reason) = &rapl {
            println!("energy: RAPL not readable ({reason}); energy comes from the power models");
        }
        println!(
            "agora bench hetero: {} tenants × {jobs} jobs (hotspot, pathfinder, lavaMD, saxpy, nw, backprop), \
             cpu + opencl + sim devices 'slow' and 'frugal'; {} learning + {reps} timed passes per policy",
            args.tenants, args.learn
        );
    }
    let mut results = Vec::new();
    let mut perf_model_dir: Option<PathBuf> = None;
    let scratch = ScratchDir::new("bench-hetero")?;
    for policy in &args.policy {
        let dir = scratch.path().join(policy.name());
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir)?;
        let config = dir.join("agora.toml");
        std::fs::write(
            &config,
            format!(
                "{HETERO_CONFIG}\n[scheduler]\npolicy = \"{}\"\n\n[daemon]\nstate_dir = \"{}\"\n",
                policy.name(),
                dir.join("state").display()
            ),
        )?;
        let daemon = DaemonProcess::start(None, &["--config", config.to_str().context("path")?])?;
        let status = || agora::daemon_status(Some(daemon.socket.clone())).context("daemon status");
        let devices = status()?.devices;
        if !devices.iter().any(|d| d.kind == "opencl") {
            bail!("no OpenCL device: run `make setup` (installs PoCL)");
        }
        // Learning passes: every policy gets the same ones, so the model (which every policy
        // feeds) has tried each (kernel, device) before the timed runs: exploring a slow device
        // costs time, and belongs to learning, not to the steady state being measured.
        let mut first_pass_s = None;
        for _ in 0..args.learn {
            let took = run_jobs(&daemon.socket, args.tenants, jobs)?;
            first_pass_s.get_or_insert(took);
        }
        let mut runs = Vec::new();
        for _ in 0..reps {
            let before = busy_ns(&status()?);
            let energy_before = rapl.as_ref().ok().map(|r| r.read());
            let makespan = run_jobs(&daemon.socket, args.tenants, jobs)?;
            let energy_after = rapl.as_ref().ok().map(|r| r.read());
            let after = busy_ns(&status()?);
            let mut model_j = 0.0;
            let mut host_model_j = 0.0;
            let mut utilisation = Vec::new();
            for (index, device) in devices.iter().enumerate() {
                let (idle_w, lane_w) = power_of(device);
                let busy_s: f64 = after[index]
                    .iter()
                    .zip(&before[index])
                    .map(|(a, b)| a.saturating_sub(*b) as f64 / 1e9)
                    .sum();
                let joules = idle_w * makespan + lane_w * busy_s;
                model_j += joules;
                if device.kind != "sim" {
                    host_model_j += joules;
                }
                utilisation.push((device.name.clone(), busy_s / (makespan * device.lanes.len() as f64)));
            }
            let (energy_j, source) = match (&rapl, energy_before, energy_after) {
                (Ok(r), Some(b), Some(a)) => (model_j - host_model_j + r.joules_between(&b, &a), "measured"),
                _ => (model_j, "model"),
            };
            runs.push((makespan, energy_j, source, utilisation));
        }
        runs.sort_by(|a, b| a.0.total_cmp(&b.0));
        let makespans: Vec<f64> = runs.iter().map(|r| r.0).collect();
        let (makespan_s, energy_j, source, utilisation) = runs.swap_remove(runs.len() / 2);
        if *policy == agora_daemon::PolicyKind::Perf {
            perf_model_dir = Some(dir.join("state"));
        }
        drop(daemon);
        results.push(HeteroResult {
            policy: policy.name().to_string(),
            makespan_s,
            makespan: spread(&makespans),
            energy_j,
            energy_source: source.to_string(),
            utilisation,
            jobs: jobs * args.tenants,
            first_pass_s,
        });
    }
    if args.json {
        println!("{}", serde_json::to_string_pretty(&results)?);
    } else {
        println!(
            "\n{:<8} {:>28} {:>10} {:>9} {:>14}  utilisation per device",
            "policy", "makespan min/median/max (s)", "energy J", "source", "first pass (s)"
        );
        for r in &results {
            let util: Vec<String> = r
                .utilisation
                .iter()
                .map(|(d, u)| format!("{d} {:.0}%", u * 100.0))
                .collect();
            println!(
                "{:<8} {:>8.3} {:>8.3} {:>8.3}   {:>10.1} {:>9} {:>14}  {}",
                r.policy,
                r.makespan.min,
                r.makespan.median,
                r.makespan.max,
                r.energy_j,
                r.energy_source,
                r.first_pass_s.map_or("-".to_string(), |s| format!("{s:.3}")),
                util.join(", ")
            );
        }
        let base = results.iter().find(|r| r.policy == "rr");
        for r in results.iter().filter(|r| r.policy != "rr") {
            if let Some(base) = base {
                println!(
                    "{} vs rr: makespan {:.2}x, energy {:.2}x",
                    r.policy,
                    r.makespan_s / base.makespan_s,
                    r.energy_j / base.energy_j
                );
            }
        }
        if let Some(dir) = &perf_model_dir {
            print_model_summary(dir)?;
        }
    }
    Ok(())
}

/// The learned table behind `perf`: mean execution time per kernel and device (largest size
/// bucket measured), so a reader sees why it placed what where.
fn print_model_summary(state_dir: &Path) -> Result<()> {
    let model = agora_daemon::policy::PerformanceModel::load(state_dir, 0.8).map_err(anyhow::Error::msg)?;
    let mut table: std::collections::BTreeMap<String, std::collections::BTreeMap<String, (u32, f64)>> =
        Default::default();
    let mut devices = std::collections::BTreeSet::new();
    for row in model.rows() {
        devices.insert(row.device.clone());
        let cell = table
            .entry(row.kernel)
            .or_default()
            .entry(row.device)
            .or_insert((0, 0.0));
        if row.bucket >= cell.0 {
            *cell = (row.bucket, row.entry.mean_ns);
        }
    }
    println!("\nthe perf policy's learned table (mean ms per launch, largest size measured):");
    print!("{:<18}", "kernel");
    for d in &devices {
        print!(" {d:>9}");
    }
    println!();
    for (kernel, cells) in &table {
        print!("{kernel:<18}");
        for d in &devices {
            match cells.get(d) {
                Some((_, ns)) => print!(" {:>9.3}", ns / 1e6),
                None => print!(" {:>9}", "-"),
            }
        }
        println!();
    }
    Ok(())
}

/// `agora bench sharing` options.
#[derive(Args, Debug)]
pub struct SharingArgs {
    /// The four (or more) applications, as `program[:size]` (see `agora run --list`).
    #[arg(
        long,
        value_delimiter = ',',
        default_value = "gaussian:1024,hotspot:1024,nw:4096,lavamd:6"
    )]
    apps: Vec<String>,
    /// Interleaved repetitions: each runs both arrangements, shared first in even repetitions
    /// and sequential first in odd ones (default 3; 1 with --quick).
    #[arg(long, alias = "reps")]
    repetitions: Option<usize>,
    /// Placement policy of the daemon.
    #[arg(long, default_value = "rr", value_parser = agora_daemon::PolicyKind::parse)]
    policy: agora_daemon::PolicyKind,
    /// Identical ranks of the fairness part (at least 2).
    #[arg(long, default_value_t = 4)]
    ranks: usize,
    /// Print JSON: `shared_s`, `sequential_s`, `ratio` (ratio of medians), `ratio_min`,
    /// `ratio_median`, `ratio_max` (over the repetitions' own ratios), `repetitions`,
    /// `load_average_at_start`, the spreads of both arrangements, `fairness_rates` (launches
    /// per second of each rank, per repetition) and `fairness_max_over_min` (its spread).
    #[arg(long)]
    json: bool,
    /// A short version for smoke checks (smaller sizes, one repetition).
    #[arg(long)]
    quick: bool,
    #[command(flatten)]
    pub socket: crate::SocketArg,
}

#[derive(Serialize, Debug)]
struct SharingResult {
    apps: Vec<String>,
    /// Median wall time of the applications run at once.
    shared_s: f64,
    /// Median of the summed wall times of the applications run one after another.
    sequential_s: f64,
    /// `shared_s / sequential_s` (ratio of medians): below 1, sharing finishes sooner.
    ratio: f64,
    /// Min / median / max over the repetitions of the shared time over the sequential time of
    /// the same repetition.
    ratio_min: f64,
    ratio_median: f64,
    ratio_max: f64,
    /// Interleaved repetitions (each runs both arrangements).
    repetitions: usize,
    /// The machine's 1-minute load average when the benchmark started.
    load_average_at_start: Option<f64>,
    shared: Spread,
    sequential: Spread,
    /// Fairness: identical MPI-style ranks pipelining `sgemm` bursts at once on a daemon with
    /// the default `perf` policy — each repetition's launches per second per rank.
    fairness_rates: Vec<Vec<f64>>,
    /// Per repetition, the fastest rank's rate over the slowest's (1 is perfectly fair).
    fairness_max_over_min: Spread,
}

/// The fairness part of `agora bench sharing`: `ranks` identical client processes started
/// together, each pipelining bursts of `sgemm` 256 on a queue that prefers no device, against
/// a daemon with the default placement policy; per repetition, each rank's launches per second.
/// (Costed by their lanes' whole backlogs, two of four such ranks once went to an idle device
/// seven times slower and ran 20× below the others.)
fn fairness(socket: Option<&Path>, ranks: usize, reps: usize, quick: bool) -> Result<Vec<Vec<f64>>> {
    let daemon = DaemonProcess::start(socket, &["--policy", "perf"])?;
    let bursts = if quick { 2 } else { 12 };
    (0..reps)
        .map(|_| {
            let results = super::client::run_clients_with(
                &daemon.socket,
                super::client::ClientMode::Pipeline,
                bursts,
                ranks.max(2),
                &["--size", "256"],
            )?;
            Ok(results
                .iter()
                .map(|r| r.tasks as f64 / (r.end_ns.saturating_sub(r.start_ns).max(1) as f64 / 1e9))
                .collect())
        })
        .collect()
}

/// Starts `agora run` for one `program[:size]` against `socket`.
fn start_app(socket: &Path, app: &str, quick: bool) -> Result<std::process::Child> {
    let (program, size) = match app.split_once(':') {
        Some((p, s)) => (p, Some(s.parse::<u64>().with_context(|| format!("size in '{app}'"))?)),
        None => (app, None),
    };
    let mut command = Command::new(std::env::current_exe()?);
    command.args(["run", program]).arg("--socket").arg(socket);
    if let Some(size) = size {
        let size = if quick { (size / 2).max(2) } else { size };
        command.args(["--size", &size.to_string()]);
    }
    command
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .with_context(|| format!("starting `agora run {program}`"))
}

fn finish_app(app: &str, child: std::process::Child) -> Result<()> {
    let out = child.wait_with_output()?;
    let text = String::from_utf8_lossy(&out.stdout);
    if !out.status.success() || !text.contains("verified OK") {
        bail!(
            "`agora run {app}` failed: {}{}",
            text.trim(),
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    Ok(())
}

pub fn sharing(socket: Option<PathBuf>, args: SharingArgs) -> Result<()> {
    let reps = args.repetitions.unwrap_or(if args.quick { 1 } else { 3 }).max(1);
    let load = load_average_at_start();
    let daemon = DaemonProcess::start(socket.as_deref(), &["--policy", args.policy.name()])?;
    if !args.json {
        println!(
            "agora bench sharing: {} applications ({}) sharing the node vs one after another (policy {}), \
             {reps} interleaved repetitions (shared first, then sequential first, alternating)",
            args.apps.len(),
            args.apps.join(", "),
            args.policy.name()
        );
    }
    // Warm-up: compile OpenCL programs and fault in pages once, outside the timings.
    for app in &args.apps {
        finish_app(app, start_app(&daemon.socket, app, true)?)?;
    }
    let mut shared = Vec::new();
    let mut sequential = Vec::new();
    for rep in 0..reps {
        // Alternate which arrangement goes first, so drift in the machine's speed evens out.
        for arrangement in if rep % 2 == 0 { [0, 1] } else { [1, 0] } {
            if arrangement == 0 {
                let start = Instant::now();
                let children = args
                    .apps
                    .iter()
                    .map(|app| start_app(&daemon.socket, app, args.quick))
                    .collect::<Result<Vec<_>>>()?;
                for (app, child) in args.apps.iter().zip(children) {
                    finish_app(app, child)?;
                }
                shared.push(start.elapsed().as_secs_f64());
            } else {
                let mut total = 0.0;
                for app in &args.apps {
                    let start = Instant::now();
                    finish_app(app, start_app(&daemon.socket, app, args.quick)?)?;
                    total += start.elapsed().as_secs_f64();
                }
                sequential.push(total);
            }
        }
    }
    let pairs = paired_ratios(&shared, &sequential);
    drop(daemon);
    let fairness_rates = fairness(socket.as_deref(), args.ranks, reps, args.quick)?;
    let max_over_min: Vec<f64> = fairness_rates
        .iter()
        .map(|rates| {
            let max = rates.iter().copied().fold(0.0, f64::max);
            let min = rates.iter().copied().fold(f64::INFINITY, f64::min);
            max / min
        })
        .collect();
    let result = SharingResult {
        apps: args.apps.clone(),
        shared_s: spread(&shared).median,
        sequential_s: spread(&sequential).median,
        ratio: spread(&shared).median / spread(&sequential).median,
        ratio_min: pairs.min,
        ratio_median: pairs.median,
        ratio_max: pairs.max,
        repetitions: reps,
        load_average_at_start: load,
        shared: spread(&shared),
        sequential: spread(&sequential),
        fairness_max_over_min: spread(&max_over_min),
        fairness_rates,
    };
    if args.json {
        println!("{}", serde_json::to_string_pretty(&result)?);
    } else {
        println!(
            "shared (all at once):     min {:.3} s  median {:.3} s  max {:.3} s",
            result.shared.min, result.shared.median, result.shared.max
        );
        println!(
            "sequential (one by one):  min {:.3} s  median {:.3} s  max {:.3} s",
            result.sequential.min, result.sequential.median, result.sequential.max
        );
        println!(
            "ratio shared/sequential: {:.3} (ratio of medians; sharing {:.0}% faster); per repetition \
             min {:.3}  median {:.3}  max {:.3} over {reps} interleaved repetitions",
            result.ratio,
            (1.0 / result.ratio - 1.0) * 100.0,
            result.ratio_min,
            result.ratio_median,
            result.ratio_max
        );
        println!(
            "fairness: {} identical ranks pipelining {} sgemm 256 per burst (policy perf): fastest/slowest rank \
             min {:.2}  median {:.2}  max {:.2}; launches/s per rank {}",
            args.ranks,
            super::client::PIPELINE_DEPTH,
            result.fairness_max_over_min.min,
            result.fairness_max_over_min.median,
            result.fairness_max_over_min.max,
            result
                .fairness_rates
                .iter()
                .map(|rates| rates.iter().map(|r| format!("{r:.0}")).collect::<Vec<_>>().join("/"))
                .collect::<Vec<_>>()
                .join(", ")
        );
        if let Some(load) = load {
            println!("load average at start: {load:.2}");
        }
    }
    Ok(())
}

/// `agora bench sla` options.
#[derive(Args, Debug)]
pub struct SlaArgs {
    /// Latency requests per arrangement (default 200; 40 with --quick).
    #[arg(long)]
    requests: Option<usize>,
    /// The response-time target of one request, in milliseconds (scaled down from TReM's 200 ms
    /// to this machine's kernels).
    #[arg(long, default_value_t = 10.0)]
    sla_ms: f64,
    /// Mean time between requests (exponential inter-arrivals), in milliseconds.
    #[arg(long, default_value_t = 5.0)]
    interval_ms: f64,
    /// Order of the batch tenants' sgemm (each a long kernel).
    #[arg(long, default_value_t = 768)]
    batch_matrix: u32,
    /// The daemons' `--batch-priority` (OS priority of lane threads running batch jobs: idle,
    /// batch, normal or nice:N) [default: the daemon's].
    #[arg(long, value_name = "PRIORITY", value_parser = agora_daemon::BatchPriority::parse)]
    batch_priority: Option<agora_daemon::BatchPriority>,
    /// Print JSON.
    #[arg(long)]
    json: bool,
    /// A short version for smoke checks.
    #[arg(long)]
    quick: bool,
}

#[derive(Serialize, Debug, Clone, Copy)]
struct SlaFigures {
    p50_ms: f64,
    p99_ms: f64,
    max_ms: f64,
    sla_met_fraction: f64,
}

#[derive(Serialize, Debug)]
struct SlaResult {
    sla_ms: f64,
    requests: usize,
    /// The daemons' batch priority as asked (`default`: the daemon's default).
    batch_priority: String,
    /// The machine's 1-minute load average when the benchmark started.
    load_average_at_start: Option<f64>,
    /// Requests with the node to themselves.
    alone: SlaFigures,
    /// Beside batch tenants, batch kernels not sliced.
    unsliced: SlaFigures,
    /// Beside batch tenants, batch kernels sliced to the 1 ms preemption target.
    chunked: SlaFigures,
    /// Beside batch tenants, batch kernels not sliced but revocable (`--latency-policy
    /// priority`): a request revokes the launch on its lane, which is replayed afterwards.
    revoked: SlaFigures,
    /// As `revoked`, under `--latency-policy elastic`: a request revokes only when it would miss
    /// the SLA otherwise and the victim has not run long (TReM's rules, as in `agora sim`).
    revoked_elastic: SlaFigures,
    /// Response time beyond the alone median: how long a request waited for a lane.
    preempt_none_p50_ms: f64,
    preempt_none_p99_ms: f64,
    preempt_chunked_p50_ms: f64,
    preempt_chunked_p99_ms: f64,
    preempt_revoke_p50_ms: f64,
    preempt_revoke_p99_ms: f64,
    /// With chunking (the default).
    sla_met_fraction: f64,
    /// Batch sgemms finished per second during the unsliced and the chunked runs (what slicing
    /// costs the batch tenants).
    batch_per_s_unsliced: f64,
    batch_per_s_chunked: f64,
    batch_per_s_revoked: f64,
    batch_per_s_revoked_elastic: f64,
}

fn sgemm_args<'a>(n: u32, a: &'a agora::Buffer, c: &'a agora::Buffer) -> Vec<agora::Arg<'a>> {
    use agora::Arg;
    let n = n as i32;
    vec![
        Arg::I32(n),
        Arg::I32(n),
        Arg::I32(n),
        Arg::F32(1.0),
        a.into(),
        a.into(),
        Arg::F32(0.0),
        c.into(),
    ]
}

/// Latency requests (a 32×32 sgemm each, on a latency-class queue) at exponential intervals,
/// beside `batch` tenants looping long sgemms on batch queues. Returns response times in ms and
/// the batch kernels finished per second.
fn sla_run(socket: &Path, args: &SlaArgs, requests: usize, batch: usize) -> Result<(Vec<f64>, f64)> {
    use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
    let stop = AtomicBool::new(false);
    let finished = AtomicU64::new(0);
    let connect = |name: &str| {
        Session::connect_with(SessionOptions {
            socket: Some(socket.to_path_buf()),
            name: Some(name.to_string()),
            heap_bytes: None,
            control_timeout: None,
            reconnect_timeout: None,
        })
    };
    let began = Instant::now();
    std::thread::scope(|scope| -> Result<(Vec<f64>, f64)> {
        let mut tenants = Vec::new();
        for t in 0..batch {
            let (stop, finished) = (&stop, &finished);
            let session = connect(&format!("batch{t}"))?;
            tenants.push(scope.spawn(move || -> Result<()> {
                let n = args.batch_matrix;
                let sgemm = session.kernel("sgemm")?;
                let a = session.buffer_from(&vec![1.0f32; (n * n) as usize])?;
                let c = session.buffer(u64::from(n * n) * 4)?;
                let queue = session.queue_with(agora::QueueOptions {
                    name: "batch".into(),
                    class: agora::QueueClass::Batch,
                    preferred_device: Some(agora::DeviceKind::Cpu),
                    sla: None,
                })?;
                while !stop.load(Ordering::Relaxed) {
                    queue
                        .launch(&sgemm, &sgemm_args(n, &a, &c), agora::NdRange::d2(n.into(), n.into()))?
                        .wait()?;
                    finished.fetch_add(1, Ordering::Relaxed);
                }
                Ok(())
            }));
        }
        let session = connect("latency")?;
        let sgemm = session.kernel("sgemm")?;
        let a = session.buffer_from(&vec![1.0f32; 32 * 32])?;
        let c = session.buffer(32 * 32 * 4)?;
        let queue = session.queue_with(agora::QueueOptions {
            name: "requests".into(),
            class: agora::QueueClass::Latency,
            preferred_device: Some(agora::DeviceKind::Cpu),
            sla: None,
        })?;
        let mut rng = 0x9E37_79B9_7F4A_7C15u64; // fixed seed: the same arrivals every run
        let mut next_exponential = || {
            rng ^= rng << 13;
            rng ^= rng >> 7;
            rng ^= rng << 17;
            let u = (rng >> 11) as f64 / (1u64 << 53) as f64;
            -(1.0 - u).ln() * args.interval_ms
        };
        if batch > 0 {
            // Steady state: the daemon's model learns a kernel from its first run, so each
            // tenant's first sgemm runs unsliced (tens of ms); requests measured behind it would
            // say nothing about preemption. Wait until as many sgemms as tenants finished, then
            // let the next ones start.
            let deadline = Instant::now() + std::time::Duration::from_secs(30);
            while finished.load(Ordering::Relaxed) < batch as u64 && Instant::now() < deadline {
                std::thread::sleep(std::time::Duration::from_millis(1));
            }
            std::thread::sleep(std::time::Duration::from_millis(50)); // batch kernels running
        }
        let mut times = Vec::with_capacity(requests);
        for i in 0..requests + 5 {
            std::thread::sleep(std::time::Duration::from_secs_f64(next_exponential() / 1e3));
            let issued = Instant::now();
            queue
                .launch(&sgemm, &sgemm_args(32, &a, &c), agora::NdRange::d2(32, 32))?
                .wait()?;
            if i >= 5 {
                times.push(issued.elapsed().as_secs_f64() * 1e3);
            }
        }
        if !c.as_slice::<f32>().iter().all(|v| *v == 32.0) {
            bail!("a latency request computed a wrong result");
        }
        stop.store(true, Ordering::Relaxed);
        for t in tenants {
            t.join().map_err(|_| anyhow::anyhow!("a batch tenant panicked"))??;
        }
        Ok((
            times,
            finished.load(Ordering::Relaxed) as f64 / began.elapsed().as_secs_f64(),
        ))
    })
}

fn sla_figures(times: &[f64], sla_ms: f64) -> SlaFigures {
    let mut v = times.to_vec();
    v.sort_by(f64::total_cmp);
    let at = |p: f64| v[((v.len() as f64 - 1.0) * p).round() as usize];
    SlaFigures {
        p50_ms: at(0.5),
        p99_ms: at(0.99),
        max_ms: v[v.len() - 1],
        sla_met_fraction: v.iter().filter(|t| **t <= sla_ms).count() as f64 / v.len() as f64,
    }
}

pub fn sla(args: SlaArgs) -> Result<()> {
    let requests = args.requests.unwrap_or(if args.quick { 40 } else { 200 }).max(1);
    let load = load_average_at_start();
    let cores = std::thread::available_parallelism().map(|n| n.get()).unwrap_or(2);
    if !args.json {
        println!(
            "agora bench sla: {requests} latency requests (sgemm 32, latency queue, mean interval {} ms, SLA {} ms) \
             beside {cores} batch tenants looping sgemm {} on the CPU lanes; unsliced vs chunked (1 ms target) vs revoked; \
             batch priority {}",
            args.interval_ms,
            args.sla_ms,
            args.batch_matrix,
            args.batch_priority.map_or("default".into(), |p| p.name())
        );
    }
    let sla = args.sla_ms.to_string();
    let priority = args.batch_priority.map(|p| p.name());
    let run = |extra: &[&str], batch: usize| -> Result<(Vec<f64>, f64)> {
        // Every daemon judges requests by the bench's SLA.
        let mut extra = extra.to_vec();
        extra.extend(["--latency-sla-ms", sla.as_str()]);
        if let Some(priority) = &priority {
            extra.extend(["--batch-priority", priority.as_str()]);
        }
        let daemon = DaemonProcess::start(None, &extra)?;
        sla_run(&daemon.socket, &args, requests, batch)
    };
    let (alone, _) = run(&["--preempt-target-us", "1000"], 0)?;
    let (unsliced, batch_unsliced) = run(&["--preempt-target-us", "0", "--latency-policy", "none"], cores)?;
    let (chunked, batch_chunked) = run(&["--preempt-target-us", "1000"], cores)?;
    let (revoked, batch_revoked) = run(&["--preempt-target-us", "0", "--latency-policy", "priority"], cores)?;
    let (revoked_elastic, batch_revoked_elastic) =
        run(&["--preempt-target-us", "0", "--latency-policy", "elastic"], cores)?;
    let alone = sla_figures(&alone, args.sla_ms);
    let waited = |times: &[f64]| -> Vec<f64> { times.iter().map(|t| (t - alone.p50_ms).max(0.0)).collect() };
    let (wait_unsliced, wait_chunked, wait_revoked) = (
        sla_figures(&waited(&unsliced), f64::MAX),
        sla_figures(&waited(&chunked), f64::MAX),
        sla_figures(&waited(&revoked), f64::MAX),
    );
    let result = SlaResult {
        sla_ms: args.sla_ms,
        requests,
        batch_priority: priority.clone().unwrap_or_else(|| "default".into()),
        load_average_at_start: load,
        alone,
        unsliced: sla_figures(&unsliced, args.sla_ms),
        chunked: sla_figures(&chunked, args.sla_ms),
        revoked: sla_figures(&revoked, args.sla_ms),
        revoked_elastic: sla_figures(&revoked_elastic, args.sla_ms),
        preempt_none_p50_ms: wait_unsliced.p50_ms,
        preempt_none_p99_ms: wait_unsliced.p99_ms,
        preempt_chunked_p50_ms: wait_chunked.p50_ms,
        preempt_chunked_p99_ms: wait_chunked.p99_ms,
        preempt_revoke_p50_ms: wait_revoked.p50_ms,
        preempt_revoke_p99_ms: wait_revoked.p99_ms,
        sla_met_fraction: sla_figures(&chunked, args.sla_ms).sla_met_fraction,
        batch_per_s_unsliced: batch_unsliced,
        batch_per_s_chunked: batch_chunked,
        batch_per_s_revoked: batch_revoked,
        batch_per_s_revoked_elastic: batch_revoked_elastic,
    };
    if args.json {
        println!("{}", serde_json::to_string_pretty(&result)?);
        return Ok(());
    }
    println!(
        "\n{:<28} {:>9} {:>9} {:>9} {:>10}",
        "response time (ms)", "p50", "p99", "max", "within SLA"
    );
    for (name, f) in [
        ("alone", result.alone),
        ("beside batch, unsliced", result.unsliced),
        ("beside batch, chunked", result.chunked),
        ("beside batch, revoked", result.revoked),
        ("revoked, elastic rules", result.revoked_elastic),
    ] {
        println!(
            "{name:<28} {:>9.3} {:>9.3} {:>9.3} {:>9.1}%",
            f.p50_ms,
            f.p99_ms,
            f.max_ms,
            f.sla_met_fraction * 100.0
        );
    }
    println!(
        "preemption latency (response beyond the alone median): unsliced p50 {:.3} / p99 {:.3} ms, chunked p50 {:.3} / p99 {:.3} ms, revoked p50 {:.3} / p99 {:.3} ms",
        result.preempt_none_p50_ms,
        result.preempt_none_p99_ms,
        result.preempt_chunked_p50_ms,
        result.preempt_chunked_p99_ms,
        result.preempt_revoke_p50_ms,
        result.preempt_revoke_p99_ms
    );
    println!(
        "batch throughput meanwhile: unsliced {:.2} sgemm/s, chunked {:.2} sgemm/s ({:.2}x), revoked {:.2} sgemm/s ({:.2}x), elastic {:.2} sgemm/s ({:.2}x)",
        result.batch_per_s_unsliced,
        result.batch_per_s_chunked,
        result.batch_per_s_chunked / result.batch_per_s_unsliced,
        result.batch_per_s_revoked,
        result.batch_per_s_revoked / result.batch_per_s_unsliced,
        result.batch_per_s_revoked_elastic,
        result.batch_per_s_revoked_elastic / result.batch_per_s_unsliced
    );
    Ok(())
}
