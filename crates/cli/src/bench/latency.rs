//! `agora bench latency`: per-task round trips and throughput of empty tasks from client
//! processes, beside the in-process floor.

use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::Result;
use clap::Args;
use serde::Serialize;

use super::client::{run_clients, run_clients_with, ClientMode};
use super::harness::{cpu_ticks, percentile, spread, DaemonProcess, Spread};

/// `agora bench latency` options.
#[derive(Args, Debug)]
pub struct LatencyArgs {
    /// Print JSON.
    #[arg(long)]
    json: bool,
    /// A short version for smoke checks (seconds).
    #[arg(long)]
    quick: bool,
    /// Round trips per run (default 100000; 5000 with --quick).
    #[arg(long)]
    iterations: Option<u64>,
    /// Repetitions (default 3; 1 with --quick). Each run starts a fresh daemon.
    #[arg(long)]
    runs: Option<usize>,
    #[command(flatten)]
    pub socket: crate::SocketArg,
}

#[derive(Serialize, Debug, Default, Clone)]
struct LatencyRun {
    p50_ns: u64,
    p99_ns: u64,
    max_ns: u64,
    mean_ns: f64,
    throughput_tasks_per_s: f64,
    multi_client_throughput_tasks_per_s: f64,
    lane_p50_ns: u64,
    lane_p99_ns: u64,
    /// A control round trip (a buffer's allocation) right after a task, p50 and p99.
    control_p50_ns: u64,
    control_p99_ns: u64,
    /// From a noop's launch to its completion callback running (`Task::on_complete`), p50 and
    /// p99: the waiting thread's wake-up beside the round trip's spin.
    callback_p50_ns: u64,
    callback_p99_ns: u64,
    /// The empty (`noop`) kernel on the OpenCL device through Agora, p50 (0 without one).
    opencl_p50_ns: u64,
    /// The same kernel enqueued natively on that device and waited for, p50.
    opencl_native_p50_ns: u64,
    /// The empty kernel through a daemon that runs OpenCL in a device-host process
    /// (`--opencl-device-host`), p50: the hop's cost is this over `opencl_p50_ns`.
    opencl_device_host_p50_ns: u64,
}

/// The in-process floor: the noop kernel called directly, timed the same way as a round trip.
fn floor_ns(iterations: u64) -> (u64, u64) {
    let (_, noop) = agora_kernels::find("noop").expect("noop kernel");
    let Some(agora_kernels::CpuImpl::Builtin(cpu)) = noop.cpu else {
        panic!("noop has a built-in CPU implementation");
    };
    // SAFETY: no arguments, so no memory is referenced.
    let call = unsafe { agora_kernels::KernelCall::new(&[1], &[]) };
    let mut samples = Vec::with_capacity(iterations as usize);
    for _ in 0..iterations {
        let t = Instant::now();
        cpu(std::hint::black_box(&call), std::hint::black_box(0..1));
        samples.push(t.elapsed().as_nanos() as u64);
    }
    samples.sort_unstable();
    (percentile(&samples, 0.5), percentile(&samples, 0.99))
}

pub fn latency(socket: Option<PathBuf>, args: LatencyArgs) -> Result<()> {
    let iterations = args.iterations.unwrap_or(if args.quick { 5_000 } else { 100_000 });
    let runs = args.runs.unwrap_or(if args.quick { 1 } else { 3 }).max(1);
    let pipelined = if args.quick { 100_000 } else { 1_000_000 };
    let per_client = pipelined / 4;
    if !args.json {
        eprintln!(
            "agora bench latency: {runs} run(s); {iterations} noop round trips, {pipelined} pipelined, 4 × {per_client} from 4 processes"
        );
    }
    let mut results = Vec::new();
    for run in 0..runs {
        let daemon = DaemonProcess::start(socket.as_deref(), &[])?;
        let lat = run_clients(&daemon.socket, ClientMode::Latency, iterations, 1)?.remove(0);
        let single = run_clients(&daemon.socket, ClientMode::Throughput, pipelined, 1)?.remove(0);
        let multi = run_clients(&daemon.socket, ClientMode::Throughput, per_client, 4)?;
        let control = run_clients(&daemon.socket, ClientMode::Control, (iterations / 10).max(200), 1)?.remove(0);
        let callback = run_clients(&daemon.socket, ClientMode::Callback, (iterations / 10).max(200), 1)?.remove(0);
        drop(daemon);
        let start = multi.iter().map(|r| r.start_ns).min().unwrap_or(0);
        let end = multi.iter().map(|r| r.end_ns).max().unwrap_or(0);
        let multi_tasks: u64 = multi.iter().map(|r| r.tasks).sum();
        // The same round trip with inline runs disabled, on a queue that prefers the CPU device:
        // every noop is handed to a CPU lane (without the preference the round-robin policy
        // would send every other one to the OpenCL device, whose round trip is measured below).
        let (lane_p50_ns, lane_p99_ns) = if socket.is_none() {
            let daemon = DaemonProcess::start(None, &["--inline-max-ns", "0"])?;
            let r = run_clients_with(
                &daemon.socket,
                ClientMode::Latency,
                iterations / 2,
                1,
                &["--device-kind", "cpu"],
            )?
            .remove(0);
            (r.p50_ns, r.p99_ns)
        } else {
            (0, 0)
        };
        // The empty kernel on the OpenCL device: through Agora, then natively (issue #14 item 5).
        let (opencl_p50_ns, opencl_native_p50_ns, opencl_device_host_p50_ns) = if socket.is_none() {
            let daemon = DaemonProcess::start(None, &["--no-opencl-device-host"])?;
            let has_opencl = agora::daemon_status(Some(daemon.socket.clone()))?
                .devices
                .iter()
                .any(|d| d.kind == "opencl");
            if has_opencl {
                let count = (iterations / 20).max(200);
                let r = run_clients(&daemon.socket, ClientMode::OpenclLatency, count, 1)?.remove(0);
                drop(daemon);
                let mut native = agora_apps::native::NativeOpenCl::open().map_err(anyhow::Error::msg)?;
                let mut times: Vec<u64> = native
                    .noop_round_trips(count as usize)
                    .map_err(anyhow::Error::msg)?
                    .into_iter()
                    .map(|t| (t * 1e9) as u64)
                    .collect();
                times.sort_unstable();
                // The same through a device-host process: the hop's cost.
                let daemon = DaemonProcess::start(None, &["--opencl-device-host"])?;
                let hosted = run_clients(&daemon.socket, ClientMode::OpenclLatency, count, 1)?.remove(0);
                drop(daemon);
                (r.p50_ns, percentile(&times, 0.5), hosted.p50_ns)
            } else {
                (0, 0, 0)
            }
        } else {
            (0, 0, 0)
        };
        let r = LatencyRun {
            opencl_p50_ns,
            opencl_native_p50_ns,
            opencl_device_host_p50_ns,
            p50_ns: lat.p50_ns,
            p99_ns: lat.p99_ns,
            max_ns: lat.max_ns,
            mean_ns: lat.mean_ns,
            throughput_tasks_per_s: single.tasks as f64 / ((single.end_ns - single.start_ns) as f64 / 1e9),
            multi_client_throughput_tasks_per_s: multi_tasks as f64 / ((end - start) as f64 / 1e9),
            lane_p50_ns,
            lane_p99_ns,
            control_p50_ns: control.p50_ns,
            control_p99_ns: control.p99_ns,
            callback_p50_ns: callback.p50_ns,
            callback_p99_ns: callback.p99_ns,
        };
        if !args.json {
            eprintln!(
                "  run {}: p50 {} ns, p99 {} ns, max {} ns, pipelined {:.2} M/s, 4 clients {:.2} M/s, via lane p50 {} ns",
                run + 1,
                r.p50_ns,
                r.p99_ns,
                r.max_ns,
                r.throughput_tasks_per_s / 1e6,
                r.multi_client_throughput_tasks_per_s / 1e6,
                r.lane_p50_ns
            );
        }
        results.push(r);
    }
    let (floor_p50, floor_p99) = floor_ns(iterations);

    // Idle CPU: a daemon with one connected, idle client, over a few seconds.
    let idle_ms: u64 = if args.quick { 1_000 } else { 3_000 };
    let (idle_daemon_pct, idle_client_pct) = {
        let daemon = DaemonProcess::start(socket.as_deref(), &[])?;
        let mut client = Command::new(std::env::current_exe()?)
            .args(["bench-client", "idle", "--iterations", &(idle_ms + 1_500).to_string()])
            .arg("--socket")
            .arg(&daemon.socket)
            .stdout(Stdio::null())
            .spawn()?;
        std::thread::sleep(Duration::from_millis(700)); // connected, warmed up, now idle
        let daemon_pid = daemon.pid();
        let d0 = daemon_pid.map(cpu_ticks).transpose()?;
        let c0 = cpu_ticks(client.id())?;
        std::thread::sleep(Duration::from_millis(idle_ms));
        let d1 = daemon_pid.map(cpu_ticks).transpose()?;
        let c1 = cpu_ticks(client.id())?;
        let _ = client.wait();
        let seconds = idle_ms as f64 / 1000.0;
        let pct = |a: u64, b: u64| (b - a) as f64 / 100.0 / seconds * 100.0;
        (d0.zip(d1).map(|(a, b)| pct(a, b)), pct(c0, c1))
    };

    let col = |f: fn(&LatencyRun) -> f64| spread(&results.iter().map(f).collect::<Vec<_>>());
    let p50 = col(|r| r.p50_ns as f64);
    let p99 = col(|r| r.p99_ns as f64);
    let max = col(|r| r.max_ns as f64);
    let thr = col(|r| r.throughput_tasks_per_s);
    let multi = col(|r| r.multi_client_throughput_tasks_per_s);
    let lane50 = col(|r| r.lane_p50_ns as f64);
    let lane99 = col(|r| r.lane_p99_ns as f64);
    let control50 = col(|r| r.control_p50_ns as f64);
    let control99 = col(|r| r.control_p99_ns as f64);
    let callback50 = col(|r| r.callback_p50_ns as f64);
    let callback99 = col(|r| r.callback_p99_ns as f64);
    let cl = col(|r| r.opencl_p50_ns as f64);
    let cl_native = col(|r| r.opencl_native_p50_ns as f64);
    // Ratio of medians; 0 without an OpenCL device.
    let cl_ratio = if cl_native.median > 0.0 {
        cl.median / cl_native.median
    } else {
        0.0
    };
    let cl_hosted = col(|r| r.opencl_device_host_p50_ns as f64);
    // The device host's hop: through a device host over OpenCL in the daemon (0 without one).
    let hop_ratio = if cl.median > 0.0 {
        cl_hosted.median / cl.median
    } else {
        0.0
    };
    let hosted_ratio = if cl_native.median > 0.0 {
        cl_hosted.median / cl_native.median
    } else {
        0.0
    };
    let ratio = p50.median / (floor_p50.max(1) as f64);

    if args.json {
        let out = serde_json::json!({
            "iterations": iterations,
            "runs": results,
            "p50_ns": p50.median,
            "p99_ns": p99.median,
            "max_ns": max.median,
            "throughput_tasks_per_s": thr.median,
            "multi_client_throughput_tasks_per_s": multi.median,
            "lane_p50_ns": lane50.median,
            "lane_p99_ns": lane99.median,
            "control_p50_ns": control50.median,
            "control_p99_ns": control99.median,
            "callback_p50_ns": callback50.median,
            "callback_p99_ns": callback99.median,
            "opencl_empty_p50_ns": cl.median,
            "opencl_native_empty_p50_ns": cl_native.median,
            "opencl_empty_ratio": cl_ratio,
            "opencl_device_host_empty_p50_ns": cl_hosted.median,
            "opencl_device_host_empty_ratio": hosted_ratio,
            "opencl_device_host_hop_ratio": hop_ratio,
            "floor_p50_ns": floor_p50,
            "floor_p99_ns": floor_p99,
            "p50_over_floor": ratio,
            "idle_daemon_cpu_percent": idle_daemon_pct,
            "idle_client_cpu_percent": idle_client_pct,
            "spread": {
                "p50_ns": p50, "p99_ns": p99, "max_ns": max,
                "throughput_tasks_per_s": thr, "multi_client_throughput_tasks_per_s": multi,
                "lane_p50_ns": lane50, "lane_p99_ns": lane99,
                "control_p50_ns": control50, "control_p99_ns": control99,
                "callback_p50_ns": callback50, "callback_p99_ns": callback99,
                "opencl_empty_p50_ns": cl, "opencl_native_empty_p50_ns": cl_native,
                "opencl_device_host_empty_p50_ns": cl_hosted,
            },
        });
        println!("{}", serde_json::to_string_pretty(&out)?);
        return Ok(());
    }
    println!(
        "\n{:<40} {:>12} {:>12} {:>12}",
        "metric (over runs)", "min", "median", "max"
    );
    let row = |name: &str, s: &Spread, scale: f64| {
        println!(
            "{name:<40} {:>12.0} {:>12.0} {:>12.0}",
            s.min / scale,
            s.median / scale,
            s.max / scale
        );
    };
    row("round trip p50 (ns)", &p50, 1.0);
    row("round trip p99 (ns)", &p99, 1.0);
    row("round trip max (ns)", &max, 1.0);
    row("pipelined, 1 client (k tasks/s)", &thr, 1e3);
    row("pipelined, 4 clients (k tasks/s)", &multi, 1e3);
    row("control call after a task, p50 (ns)", &control50, 1.0);
    row("control call after a task, p99 (ns)", &control99, 1.0);
    row("launch to its callback, p50 (ns)", &callback50, 1.0);
    row("launch to its callback, p99 (ns)", &callback99, 1.0);
    if socket.is_none() {
        row("round trip via a lane, p50 (ns)", &lane50, 1.0);
        row("round trip via a lane, p99 (ns)", &lane99, 1.0);
        if cl_native.median > 0.0 {
            row("empty kernel on OpenCL via Agora, p50 (ns)", &cl, 1.0);
            row("the same enqueued natively, p50 (ns)", &cl_native, 1.0);
            println!("{:<40} {:>12.2}", "OpenCL empty kernel, Agora / native", cl_ratio);
            row("the same via a device host, p50 (ns)", &cl_hosted, 1.0);
            println!("{:<40} {:>12.2}", "via a device host / native", hosted_ratio);
            println!("{:<40} {:>12.2}", "device host hop (host / in daemon)", hop_ratio);
        }
    }
    println!(
        "{:<40} {:>12} {:>12}",
        "in-process noop call (floor), p50/p99", floor_p50, floor_p99
    );
    println!("{:<40} {:>12.1}", "round trip p50 / floor", ratio);
    match idle_daemon_pct {
        Some(d) => println!(
            "idle for {:.1} s: daemon {d:.1}% of a core, connected client {idle_client_pct:.1}%",
            idle_ms as f64 / 1e3
        ),
        None => println!("idle client {idle_client_pct:.1}% of a core (daemon not ours, not measured)"),
    }
    Ok(())
}
