//! `agora bench overhead`: each program natively and through Agora, per device kind, and the
//! transfer round trip.
//!
//! Native and Agora runs are interleaved: after one warm-up each, every repetition runs both
//! sides (native first in even repetitions, Agora first in odd ones), the Agora side in one client
//! process driven step by step, so drift in the machine's speed reaches both sides alike. Each
//! row reports the ratio of medians and the min / median / max of the per-repetition ratios.

use std::path::PathBuf;

use anyhow::{bail, Context, Result};
use clap::Args;
use serde::Serialize;

use super::client::StepClient;
use super::harness::{load_average_at_start, median, minimum, paired_ratios, spread, DaemonProcess, Spread};

/// `agora bench overhead` options.
#[derive(Args, Debug)]
pub struct OverheadArgs {
    /// Print JSON.
    #[arg(long)]
    json: bool,
    /// A short version for smoke checks (small sizes, one repetition).
    #[arg(long)]
    quick: bool,
    /// Interleaved repetitions (native and Agora alternating) per measurement, after one
    /// warm-up of each (default 5; 1 with --quick).
    #[arg(long, alias = "reps")]
    repetitions: Option<usize>,
    /// Programs to run (default: all).
    #[arg(long, value_delimiter = ',')]
    programs: Option<Vec<String>>,
    /// Device kinds to run on (default: cpu,opencl).
    #[arg(long, value_delimiter = ',')]
    devices: Option<Vec<String>>,
    /// Bytes for the transfer round trip (default 1G; 64M with --quick).
    #[arg(long, value_parser = crate::size::parse_bytes)]
    transfer_bytes: Option<u64>,
    /// Start the daemon with a device-host process per OpenCL platform (`agora serve
    /// --opencl-device-host`; the daemon's default, unless its configuration says otherwise).
    #[arg(long, conflicts_with = "no_opencl_device_host")]
    opencl_device_host: bool,
    /// Start the daemon with OpenCL in its own process (`agora serve --no-opencl-device-host`),
    /// to compare against a device host.
    #[arg(long)]
    no_opencl_device_host: bool,
    #[command(flatten)]
    pub socket: crate::SocketArg,
}

/// Sizes for the overhead benchmark: a few hundred milliseconds natively per run.
fn overhead_size(program: &str, quick: bool) -> u64 {
    match (program, quick) {
        ("gaussian", false) => 1024,
        ("gaussian", true) => 256,
        ("hotspot", false) => 512,
        ("hotspot", true) => 64,
        ("nw", false) => 2048,
        ("nw", true) => 256,
        ("pathfinder", false) => 100_000,
        ("pathfinder", true) => 10_000,
        ("lavamd", false) => 6,
        ("lavamd", true) => 2,
        ("backprop", false) => 1 << 20,
        ("backprop", true) => 1 << 14,
        (_, false) => 4 << 20,
        (_, true) => 1 << 18,
    }
}

#[derive(Serialize, Debug)]
struct OverheadRow {
    program: String,
    device: String,
    size: u64,
    launches: usize,
    /// Median native run.
    native_s: f64,
    /// Median Agora run.
    agora_s: f64,
    /// `agora_s / native_s`: the ratio of medians.
    ratio: f64,
    /// Min / median / max over the repetitions of Agora's run over the native run of the same
    /// repetition.
    ratio_min: f64,
    ratio_median: f64,
    ratio_max: f64,
    /// Best Agora run over best native run.
    ratio_best: f64,
    native: Spread,
    agora: Spread,
    native_runs_s: Vec<f64>,
    agora_runs_s: Vec<f64>,
    verified: bool,
}

/// Runs `native` and `agora` `reps` times each, alternating which goes first; returns their
/// seconds by repetition and whether every result was right.
fn interleaved(
    reps: usize,
    mut native: impl FnMut() -> Result<(f64, bool)>,
    agora: &mut StepClient,
) -> Result<(Vec<f64>, Vec<f64>, bool)> {
    let (mut native_runs, mut agora_runs, mut verified) = (Vec::new(), Vec::new(), true);
    for rep in 0..reps {
        for side in if rep % 2 == 0 { [0, 1] } else { [1, 0] } {
            let (seconds, ok) = if side == 0 { native()? } else { agora.step()? };
            verified &= ok;
            if side == 0 {
                native_runs.push(seconds);
            } else {
                agora_runs.push(seconds);
            }
        }
    }
    Ok((native_runs, agora_runs, verified))
}

/// The geometric mean (1 for no values, as a ratio of nothing).
fn geomean(values: impl Iterator<Item = f64>) -> f64 {
    super::harness::geomean(values).unwrap_or(1.0)
}

pub fn overhead(socket: Option<PathBuf>, args: OverheadArgs) -> Result<()> {
    let reps = args.repetitions.unwrap_or(if args.quick { 1 } else { 5 }).max(1);
    let load = load_average_at_start();
    let programs: Vec<String> = args
        .programs
        .clone()
        .unwrap_or_else(|| agora_apps::PROGRAMS.iter().map(|(n, _)| n.to_string()).collect());
    let kinds = args
        .devices
        .clone()
        .unwrap_or_else(|| vec!["cpu".into(), "opencl".into()]);
    let mut native_cl = if kinds.iter().any(|k| k == "opencl") {
        match agora_apps::native::NativeOpenCl::open() {
            Ok(cl) => Some(cl),
            Err(e) => bail!("the OpenCL baseline needs an OpenCL device ({e}); run `make setup` or pass --devices cpu"),
        }
    } else {
        None
    };
    if !args.json {
        eprintln!("agora bench overhead: {reps} interleaved repetitions per row (native and Agora alternating), after one warm-up each");
    }
    let daemon_args: &[&str] = if args.opencl_device_host {
        &["--opencl-device-host"]
    } else if args.no_opencl_device_host {
        &["--no-opencl-device-host"]
    } else {
        &[]
    };
    let daemon = DaemonProcess::start(socket.as_deref(), daemon_args)?;
    let mut rows = Vec::new();
    for program in &programs {
        let size = overhead_size(program, args.quick);
        let workload = agora_apps::build(program, size, None).with_context(|| format!("unknown program {program}"))?;
        for kind in &kinds {
            let mut native = || -> Result<(f64, bool)> {
                let r = match kind.as_str() {
                    "cpu" => agora_apps::native::run_cpu(&workload).map_err(anyhow::Error::msg)?,
                    "opencl" => agora_apps::native::run_opencl(native_cl.as_mut().context("OpenCL")?, &workload)
                        .map_err(anyhow::Error::msg)?,
                    other => bail!("unknown device kind {other}: use cpu or opencl"),
                };
                Ok((r.seconds, r.verified))
            };
            let (_, warm_ok) = native()?; // warm-up
            let extra = [
                "--app".to_string(),
                program.clone(),
                "--size".into(),
                size.to_string(),
                "--device-kind".into(),
                kind.clone(),
            ];
            let mut client = StepClient::start(&daemon.socket, "workload", &extra)?;
            let (native_runs, agora_runs, ok) = interleaved(reps, native, &mut client)?;
            client.finish()?;
            let pairs = paired_ratios(&agora_runs, &native_runs);
            let row = OverheadRow {
                program: program.clone(),
                device: kind.clone(),
                size,
                launches: workload.launches(),
                native_s: median(&native_runs),
                agora_s: median(&agora_runs),
                ratio: median(&agora_runs) / median(&native_runs),
                ratio_min: pairs.min,
                ratio_median: pairs.median,
                ratio_max: pairs.max,
                ratio_best: minimum(&agora_runs) / minimum(&native_runs),
                native: spread(&native_runs),
                agora: spread(&agora_runs),
                native_runs_s: native_runs,
                agora_runs_s: agora_runs,
                verified: warm_ok && ok,
            };
            if !args.json {
                eprintln!(
                    "  {:<12} {:<7} native {:>9.4}s  agora {:>9.4}s  ratio {:.3} (per repetition {:.3} / {:.3} / {:.3}){}",
                    row.program,
                    row.device,
                    row.native_s,
                    row.agora_s,
                    row.ratio,
                    row.ratio_min,
                    row.ratio_median,
                    row.ratio_max,
                    if row.verified { "" } else { "  VERIFICATION FAILED" }
                );
            }
            rows.push(row);
        }
    }
    let geomean_ratio = geomean(rows.iter().map(|r| r.ratio));
    let geomean_best = geomean(rows.iter().map(|r| r.ratio_best));
    // The geometric mean of each repetition's ratios, and their spread.
    let per_repetition: Vec<f64> = (0..reps)
        .map(|i| geomean(rows.iter().map(|r| r.agora_runs_s[i] / r.native_runs_s[i])))
        .collect();
    let geomean_spread = if rows.is_empty() {
        paired_ratios(&[], &[])
    } else {
        spread(&per_repetition)
    };

    // Transfer round trip on the OpenCL device: write, fill on the device, read back.
    let transfer = if let Some(cl) = native_cl.as_mut() {
        let bytes = args
            .transfer_bytes
            .unwrap_or(if args.quick { 64 << 20 } else { 1 << 30 });
        let mut host = vec![0u8; bytes as usize];
        let mut device = cl.transfer_buffer(bytes as usize).map_err(anyhow::Error::msg)?;
        let mut native = || -> Result<(f64, bool)> {
            let s = agora_apps::native::transfer_round_trip(cl, &mut device, &mut host).map_err(anyhow::Error::msg)?;
            Ok((s, true))
        };
        native()?; // warm-up
        let extra = [
            "--size".to_string(),
            bytes.to_string(),
            "--device-kind".into(),
            "opencl".into(),
        ];
        let mut client = StepClient::start(&daemon.socket, "transfer", &extra)?;
        let (native_runs, agora_runs, verified) = interleaved(reps, &mut native, &mut client)?;
        client.finish()?;
        // The same with an exportable buffer, whose host copy is a region outside the segment:
        // through a device host it used to be staged (copied) on every transfer.
        let mut shared_extra = extra.to_vec();
        shared_extra.push("--shared".into());
        let mut client = StepClient::start(&daemon.socket, "transfer", &shared_extra)?;
        let (shared_native_runs, shared_runs, shared_verified) = interleaved(reps, &mut native, &mut client)?;
        client.finish()?;
        Some((
            bytes,
            native_runs,
            agora_runs,
            verified && shared_verified,
            shared_native_runs,
            shared_runs,
        ))
    } else {
        None
    };
    drop(daemon);

    let all_verified = rows.iter().all(|r| r.verified) && transfer.as_ref().is_none_or(|t| t.3);
    let transfer_ratio = transfer.as_ref().map(|t| median(&t.2) / median(&t.1));
    let transfer_pairs = transfer.as_ref().map(|t| paired_ratios(&t.2, &t.1));
    let shared_ratio = transfer.as_ref().map(|t| median(&t.5) / median(&t.4));
    let shared_pairs = transfer.as_ref().map(|t| paired_ratios(&t.5, &t.4));
    if args.json {
        let out = serde_json::json!({
            "repetitions": reps,
            "interleaved": true,
            "load_average_at_start": load,
            "programs": rows,
            "geomean_ratio": geomean_ratio,
            "geomean_ratio_min": geomean_spread.min,
            "geomean_ratio_median": geomean_spread.median,
            "geomean_ratio_max": geomean_spread.max,
            "geomean_ratio_best": geomean_best,
            "transfer_bytes": transfer.as_ref().map(|t| t.0),
            "transfer_native_s": transfer.as_ref().map(|t| median(&t.1)),
            "transfer_agora_s": transfer.as_ref().map(|t| median(&t.2)),
            "transfer_ratio": transfer_ratio,
            "transfer_ratio_min": transfer_pairs.map(|p| p.min),
            "transfer_ratio_median": transfer_pairs.map(|p| p.median),
            "transfer_ratio_max": transfer_pairs.map(|p| p.max),
            "transfer_ratio_best": transfer.as_ref().map(|t| minimum(&t.2) / minimum(&t.1)),
            "transfer_native": transfer.as_ref().map(|t| spread(&t.1)),
            "transfer_agora": transfer.as_ref().map(|t| spread(&t.2)),
            "transfer_native_runs_s": transfer.as_ref().map(|t| t.1.clone()),
            "transfer_agora_runs_s": transfer.as_ref().map(|t| t.2.clone()),
            "transfer_shared_agora_s": transfer.as_ref().map(|t| median(&t.5)),
            "transfer_shared_ratio": shared_ratio,
            "transfer_shared_ratio_min": shared_pairs.map(|p| p.min),
            "transfer_shared_ratio_median": shared_pairs.map(|p| p.median),
            "transfer_shared_ratio_max": shared_pairs.map(|p| p.max),
            "verified": all_verified,
        });
        println!("{}", serde_json::to_string_pretty(&out)?);
    } else {
        println!(
            "\n{:<12} {:<7} {:>8} {:>9} {:>11} {:>11} {:>7} {:>23} {:>9}",
            "program",
            "device",
            "size",
            "launches",
            "native (s)",
            "agora (s)",
            "ratio",
            "min / median / max",
            "best/best"
        );
        for r in &rows {
            println!(
                "{:<12} {:<7} {:>8} {:>9} {:>11.4} {:>11.4} {:>7.3} {:>23} {:>9.3}",
                r.program,
                r.device,
                r.size,
                r.launches,
                r.native_s,
                r.agora_s,
                r.ratio,
                format!("{:.3} / {:.3} / {:.3}", r.ratio_min, r.ratio_median, r.ratio_max),
                r.ratio_best
            );
        }
        println!(
            "geometric mean of ratios: {geomean_ratio:.3} (ratios of medians of {reps} interleaved repetitions); \
             per repetition min / median / max {:.3} / {:.3} / {:.3}; of best-run ratios: {geomean_best:.3}",
            geomean_spread.min, geomean_spread.median, geomean_spread.max
        );
        if let (Some((bytes, native, agora, _, shared_native, shared)), Some(pairs), Some(shared_pairs)) =
            (&transfer, transfer_pairs, shared_pairs)
        {
            println!(
                "transfer round trip of {} MiB (write, fill on device, read): native {:.3}s, agora {:.3}s, \
                 ratio {:.3} (per repetition {:.3} / {:.3} / {:.3})",
                bytes >> 20,
                median(native),
                median(agora),
                median(agora) / median(native),
                pairs.min,
                pairs.median,
                pairs.max
            );
            println!(
                "the same with an exportable buffer (shared_buffer): native {:.3}s, agora {:.3}s, ratio {:.3} \
                 (per repetition {:.3} / {:.3} / {:.3})",
                median(shared_native),
                median(shared),
                median(shared) / median(shared_native),
                shared_pairs.min,
                shared_pairs.median,
                shared_pairs.max
            );
        }
        if let Some(load) = load {
            println!("load average at start: {load:.2}");
        }
    }
    if !all_verified {
        bail!("a result did not match its host reference");
    }
    Ok(())
}
