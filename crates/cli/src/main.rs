//! `agora`: the command-line front end — run the daemon, inspect it, run bundled workloads and
//! benchmarks. Every subcommand honours `--socket` and the `AGORA_SOCKET` environment variable.

mod bench;
mod cmd;
mod model;
mod plot;
mod sim;
mod size;
mod top;

use std::path::PathBuf;

use anyhow::Result;
use clap::{Parser, Subcommand};

/// Agora: share every accelerator of a node among many processes.
#[derive(Parser, Debug)]
#[command(name = "agora", version, about, long_about = None, propagate_version = true)]
struct Cli {
    /// Control socket of the daemon (default: $AGORA_SOCKET, else $XDG_RUNTIME_DIR/agora/agora.sock,
    /// else /tmp/agora-$UID/agora.sock).
    #[arg(long, global = true, env = "AGORA_SOCKET", value_name = "PATH")]
    socket: Option<PathBuf>,

    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand, Debug)]
enum Command {
    /// Run the daemon in the foreground (stops cleanly on Ctrl-C / SIGTERM).
    Serve(Box<cmd::ServeArgs>),
    /// Show devices, lanes and sessions of a running daemon.
    Status(cmd::StatusArgs),
    /// A live view of devices, lanes and tenants (`--once [--json]` for scripts).
    Top(top::TopArgs),
    /// List the devices the daemon found, with kind, lanes and memory.
    Devices,
    /// Admin: stop placing work on a device; its queues migrate to other devices and its
    /// buffers move on demand (`agora status` shows it draining).
    Drain(cmd::DrainArgs),
    /// Admin: let the policy place work on a drained device again.
    Undrain(cmd::DrainArgs),
    /// List the kernels the daemon offers, with their signatures.
    Kernels,
    /// Run a bundled workload as a client of a running daemon and verify its result.
    Run(cmd::RunArgs),
    /// Start an embedded daemon, run several client processes against it, print a summary.
    Demo(cmd::DemoArgs),
    /// Pictures: `agora plot trace FILE -o timeline.svg|png`.
    #[command(subcommand)]
    Plot(plot::PlotCommand),
    /// Task traces: `agora trace save` writes a running daemon's trace file now.
    #[command(subcommand)]
    Trace(TraceCommand),
    /// Simulate latency policies at scale (TReM's setup): `agora sim --workload w1 --load 1.0 ...`.
    Sim(sim::SimArgs),
    /// The learned performance model: `agora model show`.
    #[command(subcommand)]
    Model(model::ModelCommand),
    /// Benchmarks, measured side by side in one run.
    #[command(subcommand)]
    Bench(bench::BenchCommand),
    /// Client side of a benchmark (started by `agora bench`; not for direct use).
    #[command(hide = true, name = "bench-client")]
    BenchClient(bench::ClientArgs),
}

/// Trace subcommands.
#[derive(Subcommand, Debug)]
enum TraceCommand {
    /// Write the daemon's trace (started with `agora serve --trace FILE`) to its file now.
    Save,
}

fn main() {
    let cli = Cli::parse();
    let verbose = matches!(cli.command, Command::Serve(_));
    let filter = tracing_subscriber::EnvFilter::try_from_env("AGORA_LOG")
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new(if verbose { "info" } else { "warn" }));
    use std::io::IsTerminal;
    tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_ansi(std::io::stderr().is_terminal())
        .with_writer(std::io::stderr)
        .init();
    let result: Result<()> = match cli.command {
        Command::Serve(args) => cmd::serve(cli.socket, *args),
        Command::Status(args) => cmd::status(cli.socket, args),
        Command::Top(args) => top::run(cli.socket, args),
        Command::Devices => cmd::devices(cli.socket),
        Command::Drain(args) => cmd::drain(cli.socket, args, true),
        Command::Undrain(args) => cmd::drain(cli.socket, args, false),
        Command::Kernels => cmd::kernels(cli.socket),
        Command::Run(args) => cmd::run(cli.socket, args),
        Command::Demo(args) => cmd::demo(args),
        Command::Trace(TraceCommand::Save) => cmd::trace_save(cli.socket),
        Command::Plot(command) => plot::run(command),
        Command::Model(command) => model::run(command),
        Command::Sim(args) => sim::run(args),
        Command::Bench(command) => bench::run(cli.socket, command),
        Command::BenchClient(args) => bench::client(cli.socket, args),
    };
    if let Err(e) = result {
        eprintln!("error: {e:#}");
        std::process::exit(1);
    }
}
