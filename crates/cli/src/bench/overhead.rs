//! `agora bench overhead`: each program natively and through Agora, per device kind, and the
//! transfer round trip.

use std::path::PathBuf;

use anyhow::{bail, Context, Result};
use clap::Args;
use serde::Serialize;

use super::client::repeat_client;
use super::harness::{median, minimum, DaemonProcess};

/// `agora bench overhead` options.
#[derive(Args, Debug)]
pub struct OverheadArgs {
    /// Print JSON.
    #[arg(long)]
    json: bool,
    /// A short version for smoke checks (small sizes, 2 repetitions).
    #[arg(long)]
    quick: bool,
    /// Repetitions per measurement (default 5), after one warm-up.
    #[arg(long)]
    reps: Option<usize>,
    /// Programs to run (default: all).
    #[arg(long, value_delimiter = ',')]
    programs: Option<Vec<String>>,
    /// Device kinds to run on (default: cpu,opencl).
    #[arg(long, value_delimiter = ',')]
    devices: Option<Vec<String>>,
    /// Bytes for the transfer round trip (default 1G; 64M with --quick).
    #[arg(long, value_parser = crate::size::parse_bytes)]
    transfer_bytes: Option<u64>,
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
    native_s: f64,
    agora_s: f64,
    ratio: f64,
    /// Best Agora run over best native run: robust to the noise of a shared 2-core VM.
    ratio_min: f64,
    native_runs_s: Vec<f64>,
    agora_runs_s: Vec<f64>,
    verified: bool,
}

pub fn overhead(socket: Option<PathBuf>, args: OverheadArgs) -> Result<()> {
    let reps = args.reps.unwrap_or(if args.quick { 2 } else { 5 }).max(1);
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
    let daemon = DaemonProcess::start(socket.as_deref(), &[])?;
    let mut rows = Vec::new();
    for program in &programs {
        let size = overhead_size(program, args.quick);
        let workload = agora_apps::build(program, size, None).with_context(|| format!("unknown program {program}"))?;
        for kind in &kinds {
            let mut native_runs = Vec::new();
            let mut verified = true;
            for rep in 0..=reps {
                let r = match kind.as_str() {
                    "cpu" => agora_apps::native::run_cpu(&workload).map_err(anyhow::Error::msg)?,
                    "opencl" => agora_apps::native::run_opencl(native_cl.as_mut().context("OpenCL")?, &workload)
                        .map_err(anyhow::Error::msg)?,
                    other => bail!("unknown device kind {other}: use cpu or opencl"),
                };
                verified &= r.verified;
                if rep > 0 {
                    native_runs.push(r.seconds);
                }
            }
            let extra = [
                "--iterations".to_string(),
                reps.to_string(),
                "--app".into(),
                program.clone(),
                "--size".into(),
                size.to_string(),
                "--device-kind".into(),
                kind.clone(),
            ];
            let agora = repeat_client(&daemon.socket, "workload", &extra)?;
            verified &= agora.verified;
            let row = OverheadRow {
                program: program.clone(),
                device: kind.clone(),
                size,
                launches: workload.launches(),
                native_s: median(&native_runs),
                agora_s: median(&agora.seconds),
                ratio: median(&agora.seconds) / median(&native_runs),
                ratio_min: minimum(&agora.seconds) / minimum(&native_runs),
                native_runs_s: native_runs,
                agora_runs_s: agora.seconds,
                verified,
            };
            if !args.json {
                eprintln!(
                    "  {:<12} {:<7} native {:>9.4}s  agora {:>9.4}s  ratio {:.3}{}",
                    row.program,
                    row.device,
                    row.native_s,
                    row.agora_s,
                    row.ratio,
                    if row.verified { "" } else { "  VERIFICATION FAILED" }
                );
            }
            rows.push(row);
        }
    }
    let geomean = (rows.iter().map(|r| r.ratio.ln()).sum::<f64>() / rows.len().max(1) as f64).exp();
    let geomean_min = (rows.iter().map(|r| r.ratio_min.ln()).sum::<f64>() / rows.len().max(1) as f64).exp();

    // Transfer round trip on the OpenCL device: write, fill on the device, read back.
    let transfer = if let Some(cl) = native_cl.as_mut() {
        let bytes = args
            .transfer_bytes
            .unwrap_or(if args.quick { 64 << 20 } else { 1 << 30 });
        let mut host = vec![0u8; bytes as usize];
        let mut device = cl.transfer_buffer(bytes as usize).map_err(anyhow::Error::msg)?;
        let mut native_runs = Vec::new();
        for rep in 0..=reps {
            let s = agora_apps::native::transfer_round_trip(cl, &mut device, &mut host).map_err(anyhow::Error::msg)?;
            if rep > 0 {
                native_runs.push(s);
            }
        }
        let extra = [
            "--iterations".to_string(),
            reps.to_string(),
            "--size".into(),
            bytes.to_string(),
            "--device-kind".into(),
            "opencl".into(),
        ];
        let agora = repeat_client(&daemon.socket, "transfer", &extra)?;
        Some((
            bytes,
            median(&native_runs),
            median(&agora.seconds),
            agora.verified,
            native_runs,
            agora.seconds,
        ))
    } else {
        None
    };
    drop(daemon);

    let all_verified = rows.iter().all(|r| r.verified) && transfer.as_ref().is_none_or(|t| t.3);
    if args.json {
        let out = serde_json::json!({
            "repetitions": reps,
            "programs": rows,
            "geomean_ratio": geomean,
            "geomean_ratio_min": geomean_min,
            "transfer_bytes": transfer.as_ref().map(|t| t.0),
            "transfer_native_s": transfer.as_ref().map(|t| t.1),
            "transfer_agora_s": transfer.as_ref().map(|t| t.2),
            "transfer_ratio": transfer.as_ref().map(|t| t.2 / t.1),
            "transfer_ratio_min": transfer.as_ref().map(|t| minimum(&t.5) / minimum(&t.4)),
            "transfer_native_runs_s": transfer.as_ref().map(|t| t.4.clone()),
            "transfer_agora_runs_s": transfer.as_ref().map(|t| t.5.clone()),
            "verified": all_verified,
        });
        println!("{}", serde_json::to_string_pretty(&out)?);
    } else {
        println!(
            "\n{:<12} {:<7} {:>8} {:>9} {:>11} {:>11} {:>7} {:>9}",
            "program", "device", "size", "launches", "native (s)", "agora (s)", "ratio", "best/best"
        );
        for r in &rows {
            println!(
                "{:<12} {:<7} {:>8} {:>9} {:>11.4} {:>11.4} {:>7.3} {:>9.3}",
                r.program, r.device, r.size, r.launches, r.native_s, r.agora_s, r.ratio, r.ratio_min
            );
        }
        println!(
            "geometric mean of ratios: {geomean:.3} (medians of {reps} runs each); of best-run ratios: {geomean_min:.3}"
        );
        if let Some((bytes, native, agora, _, _, _)) = &transfer {
            println!(
                "transfer round trip of {} MiB (write, fill on device, read): native {native:.3}s, agora {agora:.3}s, ratio {:.3}",
                bytes >> 20,
                agora / native
            );
        }
    }
    if !all_verified {
        bail!("a result did not match its host reference");
    }
    Ok(())
}
