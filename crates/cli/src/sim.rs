//! `agora sim`: the discrete-event simulator of latency policies (crate `agora-sim`), one point
//! or a sweep over load, device count or revocation latency, as a table, JSON and an SVG plot.

use std::fmt::Write as _;
use std::path::PathBuf;

use agora_daemon::policy::latency::LatencyPolicy;
use agora_sim::{simulate, Mix, SimConfig, SimReport};
use anyhow::{Context, Result};
use clap::{Args, ValueEnum};

/// What a sweep varies.
#[derive(ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub enum Sweep {
    /// Offered load 0.25 … 2.0.
    Load,
    /// Devices 1 … 16.
    Devices,
    /// Revocation latency 0.1 … 50 ms.
    Preempt,
}

/// `agora sim` options.
#[derive(Args, Debug)]
pub struct SimArgs {
    /// Workload mix: w1 (80:20 latency:batch tasks) or w2 (50:50).
    #[arg(long, default_value = "w1", value_parser = Mix::parse)]
    workload: Mix,
    /// Offered load (1.0: arriving work equals the devices' capacity).
    #[arg(long, default_value_t = 1.0)]
    load: f64,
    /// Devices.
    #[arg(long, default_value_t = 4)]
    devices: usize,
    /// Revocation (preemption) latency in milliseconds.
    #[arg(long, default_value_t = 22.0)]
    preempt_ms: f64,
    /// Latency policy: none, priority or elastic.
    #[arg(long, default_value = "elastic", value_parser = LatencyPolicy::parse)]
    policy: LatencyPolicy,
    /// Random seed (the same seed gives the same result).
    #[arg(long, default_value_t = 1)]
    seed: u64,
    /// Response-time target of a latency request, in milliseconds.
    #[arg(long, default_value_t = 200.0)]
    sla_ms: f64,
    /// Simulated seconds of arrivals.
    #[arg(long, default_value_t = 600.0)]
    seconds: f64,
    /// Instead of one point: every policy over a range of this parameter.
    #[arg(long, value_enum)]
    sweep: Option<Sweep>,
    /// With --sweep: write the SLA-met curve per policy to this SVG file.
    #[arg(long, value_name = "FILE.svg")]
    plot: Option<PathBuf>,
    /// Print JSON (one object, or an array for a sweep).
    #[arg(long)]
    json: bool,
}

pub fn run(args: SimArgs) -> Result<()> {
    let base = SimConfig {
        workload: args.workload,
        load: args.load,
        devices: args.devices.max(1),
        preempt_ms: args.preempt_ms,
        policy: args.policy,
        seed: args.seed,
        sla_ms: args.sla_ms,
        seconds: args.seconds,
    };
    if args.sweep.is_none() {
        if let Some(path) = &args.plot {
            anyhow::bail!(
                "--plot {} draws a sweep: add --sweep load|devices|preempt (one point has no curve to plot)",
                path.display()
            );
        }
    }
    let Some(sweep) = args.sweep else {
        let report = simulate(&base);
        if args.json {
            println!("{}", serde_json::to_string_pretty(&report)?);
        } else {
            print_header();
            print_row(&report);
        }
        return Ok(());
    };
    let xs: Vec<f64> = match sweep {
        Sweep::Load => vec![0.25, 0.5, 0.75, 1.0, 1.25, 1.5, 1.75, 2.0],
        Sweep::Devices => vec![1.0, 2.0, 4.0, 8.0, 16.0],
        Sweep::Preempt => vec![0.1, 1.0, 5.0, 22.0, 50.0],
    };
    let policies = [LatencyPolicy::None, LatencyPolicy::Priority, LatencyPolicy::Elastic];
    let mut reports = Vec::new();
    for policy in policies {
        for &x in &xs {
            let mut config = SimConfig { policy, ..base.clone() };
            match sweep {
                Sweep::Load => config.load = x,
                Sweep::Devices => config.devices = x as usize,
                Sweep::Preempt => config.preempt_ms = x,
            }
            reports.push(simulate(&config));
        }
    }
    if args.json {
        println!("{}", serde_json::to_string_pretty(&reports)?);
    } else {
        print_header();
        for r in &reports {
            print_row(r);
        }
    }
    if let Some(path) = &args.plot {
        let svg = plot(sweep, &xs, &policies, &reports, &base);
        std::fs::write(path, svg).with_context(|| format!("writing {}", path.display()))?;
        if !args.json {
            println!("plot written to {}", path.display());
        }
    }
    Ok(())
}

fn print_header() {
    println!(
        "{:<9} {:>4} {:>5} {:>7} {:>8} {:>9} {:>9} {:>8} {:>7} {:>10} {:>10} {:>8}",
        "policy",
        "mix",
        "load",
        "devices",
        "preempt",
        "SLA met",
        "(at most)",
        "util",
        "wasted",
        "batch p50",
        "batch p99",
        "revokes"
    );
    println!("(batch p50/p99: completion time over the same run with revocation off)");
}

fn print_row(r: &SimReport) {
    let c = &r.config;
    println!(
        "{:<9} {:>4} {:>5.2} {:>7} {:>6.1}ms {:>8.2}% {:>8.2}% {:>7.1}% {:>6.2}% {:>9.2}x {:>9.2}x {:>8}",
        c.policy.name(),
        format!("{:?}", c.workload).to_lowercase(),
        c.load,
        c.devices,
        c.preempt_ms,
        r.sla_met_fraction * 100.0,
        r.sla_attainable_fraction * 100.0,
        r.utilisation * 100.0,
        r.wasted_fraction * 100.0,
        r.batch_median_slowdown,
        r.batch_p99_slowdown,
        r.revocations
    );
}

/// A small line chart: % of latency requests within the SLA against the swept parameter.
fn plot(sweep: Sweep, xs: &[f64], policies: &[LatencyPolicy], reports: &[SimReport], base: &SimConfig) -> String {
    let (w, h, left, right, top, bottom) = (640.0, 400.0, 60.0, 20.0, 40.0, 50.0);
    let (x_label, log_x) = match sweep {
        Sweep::Load => ("offered load", false),
        Sweep::Devices => ("devices", true),
        Sweep::Preempt => ("revocation latency (ms)", true),
    };
    let tx = |x: f64| {
        let (lo, hi) = (xs[0], xs[xs.len() - 1]);
        let f = if log_x {
            (x.ln() - lo.ln()) / (hi.ln() - lo.ln())
        } else {
            (x - lo) / (hi - lo)
        };
        left + f * (w - left - right)
    };
    let y_min = reports
        .iter()
        .map(|r| r.sla_met_fraction)
        .fold(1.0, f64::min)
        .clamp(0.0, 0.9);
    let ty = |y: f64| top + (1.0 - (y - y_min) / (1.0 - y_min)) * (h - top - bottom);
    let mut svg = String::new();
    // The title names the fixed parameters, not the swept one.
    let mut fixed = vec![format!("{:?}", base.workload)];
    if sweep != Sweep::Devices {
        fixed.push(format!("{} devices", base.devices));
    }
    if sweep != Sweep::Preempt {
        fixed.push(format!("{} ms revocation", base.preempt_ms));
    }
    if sweep != Sweep::Load {
        fixed.push(format!("load {}", base.load));
    }
    let _ = write!(
        svg,
        r#"<svg xmlns="http://www.w3.org/2000/svg" width="{w}" height="{h}" font-family="sans-serif" font-size="12">
<rect width="100%" height="100%" fill="white"/>
<text x="{}" y="20" text-anchor="middle" font-size="14">Latency requests within {} ms SLA ({})</text>
"#,
        w / 2.0,
        base.sla_ms,
        fixed.join(", ")
    );
    let _ = writeln!(
        svg,
        r#"<line x1="{left}" y1="{}" x2="{}" y2="{}" stroke="black"/><line x1="{left}" y1="{top}" x2="{left}" y2="{}" stroke="black"/>"#,
        h - bottom,
        w - right,
        h - bottom,
        h - bottom
    );
    for &x in xs {
        let _ = writeln!(
            svg,
            r#"<text x="{}" y="{}" text-anchor="middle">{x}</text>"#,
            tx(x),
            h - bottom + 16.0
        );
    }
    for i in 0..=4 {
        let y = y_min + (1.0 - y_min) * i as f64 / 4.0;
        let _ = writeln!(
            svg,
            r##"<text x="{}" y="{}" text-anchor="end">{:.0}%</text><line x1="{left}" y1="{}" x2="{}" y2="{}" stroke="#ddd"/>"##,
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
        r#"<text x="{}" y="{}" text-anchor="middle">{x_label}</text>"#,
        w / 2.0,
        h - 12.0
    );
    let colours = ["#d62728", "#1f77b4", "#2ca02c"];
    for (index, policy) in policies.iter().enumerate() {
        let points: Vec<String> = reports
            .iter()
            .filter(|r| r.config.policy == *policy)
            .zip(xs)
            .map(|(r, &x)| format!("{:.1},{:.1}", tx(x), ty(r.sla_met_fraction)))
            .collect();
        let colour = colours[index % colours.len()];
        let _ = writeln!(
            svg,
            r#"<polyline points="{}" fill="none" stroke="{colour}" stroke-width="2"/><text x="{}" y="{}" fill="{colour}">{}</text>"#,
            points.join(" "),
            w - right - 90.0,
            top + 16.0 * (index as f64 + 1.0),
            policy.name()
        );
    }
    svg.push_str("</svg>\n");
    svg
}
