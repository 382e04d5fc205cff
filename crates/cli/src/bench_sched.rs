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

use crate::bench::{spread, DaemonProcess, Spread};

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
    match (device.kind.as_str(), device.name.as_str()) {
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
    let scratch = std::env::temp_dir().join(format!("agora-bench-hetero-{}", std::process::id()));
    for policy in &args.policy {
        let dir = scratch.join(policy.name());
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
        for _ in 0..args.learn {
            run_jobs(&daemon.socket, args.tenants, jobs)?;
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
        });
    }
    if args.json {
        println!("{}", serde_json::to_string_pretty(&results)?);
    } else {
        println!(
            "\n{:<8} {:>28} {:>10} {:>9}  utilisation per device",
            "policy", "makespan min/median/max (s)", "energy J", "source"
        );
        for r in &results {
            let util: Vec<String> = r
                .utilisation
                .iter()
                .map(|(d, u)| format!("{d} {:.0}%", u * 100.0))
                .collect();
            println!(
                "{:<8} {:>8.3} {:>8.3} {:>8.3}   {:>10.1} {:>9}  {}",
                r.policy,
                r.makespan.min,
                r.makespan.median,
                r.makespan.max,
                r.energy_j,
                r.energy_source,
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
    let _ = std::fs::remove_dir_all(&scratch);
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
    /// Repetitions of each arrangement (default 3; 1 with --quick).
    #[arg(long)]
    reps: Option<usize>,
    /// Placement policy of the daemon.
    #[arg(long, default_value = "rr", value_parser = agora_daemon::PolicyKind::parse)]
    policy: agora_daemon::PolicyKind,
    /// Print JSON: `shared_s`, `sequential_s`, `ratio` (medians) and the spreads.
    #[arg(long)]
    json: bool,
    /// A short version for smoke checks (smaller sizes, one repetition).
    #[arg(long)]
    quick: bool,
}

#[derive(Serialize, Debug)]
struct SharingResult {
    apps: Vec<String>,
    /// Median wall time of the applications run at once.
    shared_s: f64,
    /// Median of the summed wall times of the applications run one after another.
    sequential_s: f64,
    /// `shared_s / sequential_s`: below 1, sharing finishes sooner.
    ratio: f64,
    shared: Spread,
    sequential: Spread,
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
    let reps = args.reps.unwrap_or(if args.quick { 1 } else { 3 }).max(1);
    let daemon = DaemonProcess::start(socket.as_deref(), &["--policy", args.policy.name()])?;
    if !args.json {
        println!(
            "agora bench sharing: {} applications ({}) sharing the node vs one after another (policy {}), {reps} reps",
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
    let result = SharingResult {
        apps: args.apps.clone(),
        shared_s: spread(&shared).median,
        sequential_s: spread(&sequential).median,
        ratio: spread(&shared).median / spread(&sequential).median,
        shared: spread(&shared),
        sequential: spread(&sequential),
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
            "ratio shared/sequential: {:.3} (sharing {:.0}% faster)",
            result.ratio,
            (1.0 / result.ratio - 1.0) * 100.0
        );
    }
    Ok(())
}
