//! `agora rtdag FILE.yaml [--simulate]` and `agora bench rt`: periodic task graphs (issue #16).
//!
//! RTDAG's YAML files are read and checked. Without `--simulate` the DAGs run on a daemon
//! (`crate::rt_daemon`): it admits them or says why not, releases them itself, and the report
//! has RTDAG's end-to-end response-time statistics per DAG. With `--simulate`, admission (APEDF
//! first-fit or worst-fit over N lanes) and the discrete-event simulator of `agora-realtime`
//! judge the set instead, and every output says "simulated". `agora bench rt` sweeps synthetic
//! sets in the simulator and measures the daemon's release jitter on a daemon of its own.

use std::fmt::Write as _;
use std::path::PathBuf;

use agora_realtime::{
    simulate, sweep, Admission, AdmissionConfig, AdmissionError, DagLimits, Packing, Policy, SimulationConfig,
    SweepConfig, Workload,
};
use anyhow::{bail, Context, Result};
use clap::{Args, ValueEnum};
use serde::Serialize;

/// A scheduling policy on the command line.
#[derive(Clone, Copy, Debug, ValueEnum)]
pub enum PolicyArg {
    /// Release order, any free lane.
    Fifo,
    /// Global EDF.
    Gedf,
    /// APEDF, first-fit pushes.
    ApedfFf,
    /// APEDF, worst-fit pushes.
    ApedfWf,
}

impl PolicyArg {
    fn policy(self) -> Policy {
        match self {
            PolicyArg::Fifo => Policy::Fifo,
            PolicyArg::Gedf => Policy::GlobalEdf,
            PolicyArg::ApedfFf => Policy::ApedfFirstFit,
            PolicyArg::ApedfWf => Policy::ApedfWorstFit,
        }
    }
}

/// The exit of a run of `total` DAGs of which `admitted` were admitted: a failure when none
/// was, so that a script sees that nothing ran (the report above says why each was refused); a
/// partly admitted file is a success, its report says which were refused.
fn nothing_admitted(admitted: usize, total: usize) -> Result<()> {
    if admitted == 0 && total > 0 {
        bail!("none of the file's {total} DAG(s) was admitted, so nothing ran (the refusals above say why)");
    }
    Ok(())
}

/// `agora rtdag` options.
#[derive(Args, Debug)]
pub struct RtdagArgs {
    /// An RTDAG task-set file (one YAML document per DAG: dag_name, dag_period, dag_deadline,
    /// tasks_name, tasks_wcet, tasks_rel_deadline, adjacency matrix, ...).
    file: PathBuf,
    /// Analyse and simulate the set instead of running it on the daemon (`--lanes`,
    /// `--policy`, `--wcet-margin` and `--chunk-us` apply only here; the daemon uses its own
    /// lanes and `[realtime]` settings).
    #[arg(long)]
    simulate: bool,
    #[command(flatten)]
    socket: crate::SocketArg,
    /// On the daemon: each node busy-works for this share of its WCET.
    #[arg(long, default_value_t = 0.8)]
    run_fraction: f64,
    /// Lanes to place the DAGs on (simulation).
    #[arg(long, default_value_t = 4)]
    lanes: usize,
    /// Scheduling policy of the simulation.
    #[arg(long, value_enum, default_value = "apedf-ff")]
    policy: PolicyArg,
    /// Margin on every WCET (0.1 = +10 %).
    #[arg(long, default_value_t = 0.0)]
    wcet_margin: f64,
    /// Launches are preemptible only every this many microseconds (Agora's chunk length).
    #[arg(long, default_value_t = 0)]
    chunk_us: u64,
    /// Seconds of releases (simulated, or on the daemon).
    #[arg(long, default_value_t = 10.0)]
    seconds: f64,
    /// Print JSON.
    #[arg(long)]
    json: bool,
}

#[derive(Serialize)]
struct DagLine {
    name: String,
    admitted: bool,
    /// Lane of each node (admitted DAGs).
    lanes: Vec<usize>,
    /// Why not (refused DAGs): the admission's arithmetic.
    refusal: Option<String>,
    utilisation: f64,
}

#[derive(Serialize)]
struct RtdagReport {
    simulated: bool,
    file: String,
    lanes: usize,
    policy: &'static str,
    dags: Vec<DagLine>,
    lane_utilisation: Vec<f64>,
    simulation: Option<agora_realtime::SimulationReport>,
}

/// Runs `agora rtdag`.
pub fn rtdag(args: RtdagArgs) -> Result<()> {
    let specs = agora_realtime::rtdag::read_file(&args.file)?;
    if !args.simulate {
        // Structural errors (a cycle, a deadline shorter than the critical path) end the run
        // before the calibration, as with --simulate; the daemon would only refuse them one by one.
        for spec in &specs {
            spec.validate(&DagLimits::default())
                .with_context(|| format!("DAG {}", spec.name))?;
        }
        let run = crate::rt_daemon::run(args.socket.path(), &specs, args.seconds, args.run_fraction)?;
        if args.json {
            println!("{}", serde_json::to_string_pretty(&run)?);
        } else {
            crate::rt_daemon::print(&args.file.display().to_string(), &run);
        }
        return nothing_admitted(run.dags.iter().filter(|d| d.refusal.is_none()).count(), run.dags.len());
    }
    let config = AdmissionConfig {
        lanes: args.lanes,
        packing: match args.policy {
            PolicyArg::ApedfWf => Packing::WorstFit,
            _ => Packing::FirstFit,
        },
        wcet_margin: args.wcet_margin,
        preemption_granularity_us: args.chunk_us,
    };
    let mut admission = Admission::new(config).context("admission settings")?;
    let limits = DagLimits::default();
    let mut lines = Vec::new();
    let (mut admitted, mut homes) = (Vec::new(), Vec::new());
    for spec in specs {
        let name = spec.name.clone();
        let dag = spec.validate(&limits).with_context(|| format!("DAG {name}"))?;
        let utilisation = dag.utilisation();
        match admission.admit(dag.clone()) {
            Ok(decision) => {
                lines.push(DagLine {
                    name,
                    admitted: true,
                    lanes: decision.lanes.clone(),
                    refusal: None,
                    utilisation,
                });
                homes.push(decision.lanes);
                admitted.push(dag);
            }
            Err(AdmissionError::Refused(refusal)) => lines.push(DagLine {
                name,
                admitted: false,
                lanes: Vec::new(),
                refusal: Some(refusal.to_string()),
                utilisation,
            }),
            Err(e) => bail!("admission of {name}: {e}"),
        }
    }
    let simulation = if admitted.is_empty() {
        None
    } else {
        let mut sim = SimulationConfig::new(args.lanes, args.policy.policy());
        sim.duration_us = (args.seconds * 1e6) as u64;
        sim.preemption_granularity_us = args.chunk_us;
        sim.wcet_margin = args.wcet_margin;
        Some(simulate(
            &Workload {
                dags: admitted,
                home_lanes: Some(homes),
            },
            &sim,
        )?)
    };
    let report = RtdagReport {
        simulated: true,
        file: args.file.display().to_string(),
        lanes: args.lanes,
        policy: args.policy.policy().name(),
        lane_utilisation: admission.lane_utilisation(),
        dags: lines,
        simulation,
    };
    let admitted = report.dags.iter().filter(|d| d.admitted).count();
    if args.json {
        println!("{}", serde_json::to_string_pretty(&report)?);
        return nothing_admitted(admitted, report.dags.len());
    }
    println!(
        "{} (simulated: {} lanes, {}; without --simulate the DAGs run on the daemon)",
        report.file, report.lanes, report.policy
    );
    for line in &report.dags {
        if line.admitted {
            println!(
                "  {:<20} admitted, utilisation {:.3}, nodes on lanes {:?}",
                line.name, line.utilisation, line.lanes
            );
        } else {
            println!(
                "  {:<20} REFUSED, utilisation {:.3}: {}",
                line.name,
                line.utilisation,
                line.refusal.as_deref().unwrap_or("")
            );
        }
    }
    let lanes: Vec<String> = report.lane_utilisation.iter().map(|u| format!("{u:.3}")).collect();
    println!("  lane utilisation: {}", lanes.join(" "));
    if let Some(sim) = &report.simulation {
        println!(
            "  {:<20} {:>9} {:>7} {:>11} {:>11} {:>11} {:>10}",
            "dag", "releases", "misses", "resp p50 ms", "resp p99 ms", "resp max ms", "migrations"
        );
        for dag in &sim.dags {
            println!(
                "  {:<20} {:>9} {:>7} {:>11.3} {:>11.3} {:>11.3} {:>10}",
                dag.name,
                dag.releases,
                dag.deadline_misses,
                dag.response_time.p50_us as f64 / 1e3,
                dag.response_time.p99_us as f64 / 1e3,
                dag.response_time.max_us as f64 / 1e3,
                dag.migrations
            );
        }
    }
    nothing_admitted(admitted, report.dags.len())
}

/// `agora bench rt` options.
#[derive(Args, Debug)]
pub struct BenchRtArgs {
    /// Lanes.
    #[arg(long, default_value_t = 4)]
    lanes: usize,
    /// Task sets per utilisation point (default 10; 2 with --quick).
    #[arg(long)]
    sets: Option<usize>,
    /// Simulated seconds per set (default 1; 0.2 with --quick).
    #[arg(long)]
    seconds: Option<f64>,
    /// Launches are preemptible only every this many microseconds (Agora's chunk length).
    #[arg(long, default_value_t = 0)]
    chunk_us: u64,
    /// Seed of the task-set generator.
    #[arg(long, default_value_t = 1)]
    seed: u64,
    /// Write the miss ratio against utilisation per policy as an SVG plot.
    #[arg(long, value_name = "FILE.svg")]
    plot: Option<PathBuf>,
    /// Seconds of the measured part: a periodic DAG released by a daemon started for it on an
    /// otherwise idle node (default 5; 0.5 with --quick; 0 skips it).
    #[arg(long)]
    daemon_seconds: Option<f64>,
    /// Print JSON.
    #[arg(long)]
    json: bool,
    /// A short version for smoke checks.
    #[arg(long)]
    quick: bool,
}

#[derive(Serialize)]
struct BenchRtReport {
    /// The sweep's figures come from the simulator (`daemon`, `daemon_sweep` and
    /// `release_jitter_p99_us` from a daemon).
    simulated: bool,
    lanes: usize,
    admitted_misses: u64,
    apedf_admitted_utilisation: f64,
    gedf_miss_ratio_at_full: f64,
    fifo_miss_ratio_at_full: f64,
    /// Release jitter of the daemon's timer (from a release's due time to its first nodes'
    /// hand-off to a lane), p99 over every release of the measured part; `None` when skipped.
    release_jitter_p99_us: Option<f64>,
    /// The measured part: a 2-node DAG released every 2 ms by a daemon started for it.
    daemon: Option<crate::rt_daemon::DaemonRun>,
    /// Synthetic sets run on that daemon's CPU lanes (APEDF, its only policy) at rising offered
    /// utilisation: what it admitted and what missed.
    daemon_sweep: Vec<DaemonSweepPoint>,
    /// Misses on the daemon of releases in which no node overran its WCET, over the sweep.
    daemon_admitted_misses: Option<u64>,
    first_fit_bound: f64,
    points: Vec<agora_realtime::sweep::SweepPoint>,
}

/// One utilisation point of the sweep on the daemon.
#[derive(Serialize)]
struct DaemonSweepPoint {
    target_utilisation: f64,
    admitted_utilisation: f64,
    dags_admitted: usize,
    dags_offered: usize,
    releases: u64,
    misses: u64,
    misses_without_overrun: u64,
    overruns: u64,
}

/// Runs `agora bench rt`.
pub fn bench_rt(args: BenchRtArgs) -> Result<()> {
    let mut config = SweepConfig::new(args.lanes);
    config.sets_per_point = args.sets.unwrap_or(if args.quick { 2 } else { 10 }).max(1);
    config.duration_us = (args.seconds.unwrap_or(if args.quick { 0.2 } else { 1.0 }) * 1e6) as u64;
    config.preemption_granularity_us = args.chunk_us;
    config.seed = args.seed;
    let report = sweep(&config)?;
    let daemon_seconds = args.daemon_seconds.unwrap_or(if args.quick { 0.5 } else { 5.0 });
    let daemon = if daemon_seconds > 0.0 {
        let process = crate::bench::harness::DaemonProcess::start(None, &["--no-opencl"])?;
        let mut spec = agora_realtime::DagSpec::new("jitter-probe", 2_000);
        spec.nodes = vec![
            agora_realtime::NodeSpec::new("first", 200),
            agora_realtime::NodeSpec::new("second", 200),
        ];
        spec.edges = vec![(0, 1)];
        let probe = crate::rt_daemon::run(Some(process.socket.clone()), &[spec], daemon_seconds, 0.8)?;
        Some((probe, process))
    } else {
        None
    };
    // Synthetic sets on the same daemon's lanes, offered utilisation 0.5 to its lane count.
    let mut daemon_sweep = Vec::new();
    if let Some((_, process)) = &daemon {
        let lanes = agora::daemon_status(Some(process.socket.clone()))?
            .devices
            .iter()
            .filter(|d| d.kind == agora::DeviceKind::Cpu)
            .map(|d| d.lanes.len())
            .max()
            .unwrap_or(1);
        let seconds = if args.quick { 0.3 } else { daemon_seconds.min(2.0) };
        let mut target = 0.5;
        while target <= lanes as f64 + 1e-9 {
            let generated = agora_realtime::generate(
                &agora_realtime::GeneratorConfig {
                    dag_count: 4,
                    total_utilisation: target,
                    ..Default::default()
                },
                args.seed,
            )?;
            let specs: Vec<_> = generated.dags.iter().map(|d| d.spec().clone()).collect();
            let run = crate::rt_daemon::run(Some(process.socket.clone()), &specs, seconds, 0.8)?;
            let admitted: Vec<_> = run.dags.iter().filter(|d| d.admitted).collect();
            daemon_sweep.push(DaemonSweepPoint {
                target_utilisation: target,
                admitted_utilisation: admitted.iter().map(|d| d.utilisation).sum(),
                dags_admitted: admitted.len(),
                dags_offered: run.dags.len(),
                releases: admitted.iter().map(|d| d.releases).sum(),
                misses: admitted.iter().map(|d| d.misses).sum(),
                misses_without_overrun: admitted.iter().map(|d| d.misses_without_overrun).sum(),
                overruns: admitted.iter().map(|d| d.overruns).sum(),
            });
            target += 0.5;
        }
    }
    let daemon_admitted_misses =
        (!daemon_sweep.is_empty()).then(|| daemon_sweep.iter().map(|p| p.misses_without_overrun).sum());
    let daemon = daemon.map(|(probe, _)| probe);
    let out = BenchRtReport {
        simulated: true,
        lanes: report.summary.lanes,
        admitted_misses: report.summary.admitted_misses,
        apedf_admitted_utilisation: report.summary.apedf_admitted_utilisation,
        gedf_miss_ratio_at_full: report.summary.gedf_miss_ratio_at_full,
        fifo_miss_ratio_at_full: report.summary.fifo_miss_ratio_at_full,
        release_jitter_p99_us: daemon.as_ref().map(|run| run.jitter_p99_us),
        daemon,
        daemon_sweep,
        daemon_admitted_misses,
        first_fit_bound: agora_realtime::first_fit_utilisation_bound(args.lanes, 1.0),
        points: report.points,
    };
    if let Some(path) = &args.plot {
        std::fs::write(path, plot(&out)).with_context(|| format!("writing {}", path.display()))?;
    }
    if args.json {
        println!("{}", serde_json::to_string_pretty(&out)?);
        return Ok(());
    }
    println!(
        "simulated, {} lanes, {} sets per point:",
        out.lanes, config.sets_per_point
    );
    println!(
        "  {:>11}  {:>8} {:>8} {:>10} {:>10}  apedf-ff admitted",
        "utilisation", "fifo", "gedf", "apedf-ff", "apedf-wf"
    );
    for point in &out.points {
        let ratio = |p: Policy| {
            point
                .policies
                .iter()
                .find(|x| x.policy == p)
                .map_or(f64::NAN, |x| x.miss_ratio)
        };
        let admitted = point
            .policies
            .iter()
            .find(|x| x.policy == Policy::ApedfFirstFit)
            .and_then(|x| x.admitted_utilisation)
            .unwrap_or(f64::NAN);
        println!(
            "  {:>11.2}  {:>7.1}% {:>7.1}% {:>9.1}% {:>9.1}%  {:.2}",
            point.target_utilisation,
            100.0 * ratio(Policy::Fifo),
            100.0 * ratio(Policy::GlobalEdf),
            100.0 * ratio(Policy::ApedfFirstFit),
            100.0 * ratio(Policy::ApedfWorstFit),
            admitted
        );
    }
    println!(
        "admitted sets: {} misses; APEDF-FF admitted {:.2} of {} offered at full load (first-fit bound {:.2}); miss ratio at full load: FIFO {:.1}%, GEDF {:.1}% (every DAG running)",
        out.admitted_misses,
        out.apedf_admitted_utilisation,
        out.lanes,
        out.first_fit_bound,
        100.0 * out.fifo_miss_ratio_at_full,
        100.0 * out.gedf_miss_ratio_at_full
    );
    if let Some(run) = &out.daemon {
        crate::rt_daemon::print("measured on a daemon (idle node, 2-node DAG every 2 ms)", run);
    }
    if !out.daemon_sweep.is_empty() {
        println!("synthetic sets on the daemon's CPU lanes (APEDF, the daemon's [realtime] packing):");
        println!(
            "  {:>7} {:>9} {:>13} {:>9} {:>7} {:>11} {:>9}",
            "offered", "admitted", "DAGs admitted", "releases", "misses", "no overrun", "overruns"
        );
        for p in &out.daemon_sweep {
            println!(
                "  {:>7.2} {:>9.2} {:>10}/{:<2} {:>9} {:>7} {:>11} {:>9}",
                p.target_utilisation,
                p.admitted_utilisation,
                p.dags_admitted,
                p.dags_offered,
                p.releases,
                p.misses,
                p.misses_without_overrun,
                p.overruns
            );
        }
    }
    Ok(())
}

/// Miss ratio (every DAG running) against offered utilisation, one line per policy.
fn plot(report: &BenchRtReport) -> String {
    let (w, h, left, right, top, bottom) = (640.0, 400.0, 60.0, 20.0, 40.0, 50.0);
    let xs: Vec<f64> = report.points.iter().map(|p| p.target_utilisation).collect();
    let (lo, hi) = (xs.first().copied().unwrap_or(0.0), xs.last().copied().unwrap_or(1.0));
    let y_max = report
        .points
        .iter()
        .flat_map(|p| p.policies.iter().map(|x| x.miss_ratio))
        .fold(0.01, f64::max);
    let tx = |x: f64| left + (x - lo) / (hi - lo).max(1e-9) * (w - left - right);
    let ty = |y: f64| top + (1.0 - y / y_max) * (h - top - bottom);
    let mut svg = String::new();
    let _ = write!(
        svg,
        r#"<svg xmlns="http://www.w3.org/2000/svg" width="{w}" height="{h}" font-family="sans-serif" font-size="12">
<rect width="100%" height="100%" fill="white"/>
<text x="{}" y="20" text-anchor="middle" font-size="14">Deadline-miss ratio vs utilisation, {} lanes (simulated)</text>
<line x1="{left}" y1="{}" x2="{}" y2="{}" stroke="black"/><line x1="{left}" y1="{top}" x2="{left}" y2="{}" stroke="black"/>
"#,
        w / 2.0,
        report.lanes,
        h - bottom,
        w - right,
        h - bottom,
        h - bottom
    );
    for &x in &xs {
        let _ = writeln!(
            svg,
            r#"<text x="{}" y="{}" text-anchor="middle">{x}</text>"#,
            tx(x),
            h - bottom + 16.0
        );
    }
    for i in 0..=4 {
        let y = y_max * i as f64 / 4.0;
        let _ = writeln!(
            svg,
            r##"<text x="{}" y="{}" text-anchor="end">{:.1}%</text><line x1="{left}" y1="{}" x2="{}" y2="{}" stroke="#ddd"/>"##,
            left - 6.0,
            ty(y) + 4.0,
            y * 100.0,
            ty(y),
            w - right,
            ty(y)
        );
    }
    let _ = writeln!(
        svg,
        r#"<text x="{}" y="{}" text-anchor="middle">offered utilisation (sum over DAGs)</text>"#,
        w / 2.0,
        h - 12.0
    );
    let colours = ["#d62728", "#1f77b4", "#2ca02c", "#9467bd"];
    for (index, policy) in Policy::ALL.iter().enumerate() {
        let points: Vec<String> = report
            .points
            .iter()
            .filter_map(|p| {
                p.policies
                    .iter()
                    .find(|x| x.policy == *policy)
                    .map(|x| format!("{:.1},{:.1}", tx(p.target_utilisation), ty(x.miss_ratio)))
            })
            .collect();
        let colour = colours[index % colours.len()];
        let _ = writeln!(
            svg,
            r#"<polyline points="{}" fill="none" stroke="{colour}" stroke-width="2"/><text x="{}" y="{}" fill="{colour}">{}</text>"#,
            points.join(" "),
            left + 10.0,
            top + 16.0 * (index as f64 + 1.0),
            policy.name()
        );
    }
    svg.push_str("</svg>\n");
    svg
}
