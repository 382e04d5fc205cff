//! `agora`: the command-line front end — run the daemon, inspect it, run bundled workloads and
//! benchmarks. Every subcommand that talks to a daemon takes `--socket` (or `AGORA_SOCKET`), as
//! does `model show`, which reads the model of the daemon on that socket; those that never
//! connect (plot, sim, demo) do not offer it.
//!
//! No subcommand may end in a Rust panic for any input: errors are printed once, as
//! `error: …`, and a closed standard output (`agora run --list | head -1`) ends the process
//! quietly, as it does for other Unix tools.

mod bench;
mod cmd;
mod log_filter;
mod model;
mod plot;
mod progress;
mod rt;
mod rt_daemon;
mod sim;
mod size;
mod top;

use std::path::PathBuf;

use anyhow::Result;
use clap::{Args, Parser, Subcommand};

/// Agora: share every accelerator of a node among many processes.
#[derive(Parser, Debug)]
#[command(
    name = "agora",
    version,
    about = "Agora: share every accelerator of a node among many processes",
    long_about = None,
    propagate_version = true
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

/// `--socket`, for the subcommands that talk to a running daemon.
#[derive(Args, Debug, Clone, Default)]
pub struct SocketArg {
    /// Control socket of the daemon (default: $AGORA_SOCKET, else $XDG_RUNTIME_DIR/agora/agora.sock,
    /// else /tmp/agora-$UID/agora.sock; where no daemon of yours listens there, a node-wide
    /// daemon's /run/agora/agora.sock).
    #[arg(long, env = "AGORA_SOCKET", value_name = "PATH")]
    pub socket: Option<PathBuf>,
}

impl SocketArg {
    /// The socket given, if any (the default path is resolved where it is used).
    pub fn path(&self) -> Option<PathBuf> {
        self.socket.clone()
    }
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
    Devices(SocketArg),
    /// Admin: stop placing work on a device; its queues migrate to other devices and its
    /// buffers move on demand (`agora status` shows it draining).
    Drain(cmd::DrainArgs),
    /// Admin: let the policy place work on a drained device again.
    Undrain(cmd::DeviceArgs),
    /// List the kernels the daemon offers (built-in and from kernel packages) with their
    /// signatures and implementations; `agora kernels reload` loads the packages again;
    /// `agora kernels check DIR` checks packages before they are installed.
    Kernels(cmd::KernelsArgs),
    /// List the exported buffers you may attach (yours, and those exported to your uid or
    /// group; an administrator sees all): name, exporter, size, mode and attachers.
    Exports(cmd::ExportsArgs),
    /// Periodic task graphs from an RTDAG YAML file: check them, have the daemon admit them onto
    /// its lanes (APEDF) and release them for real, or analyse and simulate them (`--simulate`),
    /// with RTDAG's response-time statistics per DAG.
    Rtdag(rt::RtdagArgs),
    /// Slurm integration: `agora slurm conf` prints the node's slurm.conf and gres.conf lines
    /// (features and a GRES of Agora shares) from what the running daemon sees.
    #[command(subcommand)]
    Slurm(cmd::SlurmCommand),
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
    /// The analytics side of `agora bench insitu` (started by it; not for direct use).
    #[command(hide = true, name = "insitu-analytics")]
    InsituAnalytics(bench::insitu::AnalyticsArgs),
    /// A session's sandboxed executor for tenant programs (started by the daemon; not for
    /// direct use).
    #[command(hide = true, name = "executor")]
    Executor(ExecutorArgs),
    /// The process that runs one OpenCL platform, or one GPU, for the daemon (started by it; not
    /// for direct use).
    #[command(hide = true, name = "device-host")]
    DeviceHost(DeviceHostArgs),
}

/// `agora device-host`: what the daemon passes (see `agora_device_host`).
#[derive(Args, Debug)]
struct DeviceHostArgs {
    /// Print the installed OpenCL platforms, one per line, and exit.
    #[arg(long)]
    list: bool,
    /// Print the GPUs, one `cuda:N` per line (nothing, and why on standard error, where there
    /// are none), and exit.
    #[arg(long)]
    list_gpus: bool,
    /// The inherited socket to the daemon.
    #[arg(long, required_unless_present_any = ["list", "list_gpus"])]
    fd: Option<i32>,
    /// What to serve: an OpenCL platform's name, `cuda:N` (the GPU of driver ordinal N), or
    /// `sim` (tests of the device-host mechanism).
    #[arg(long, required_unless_present_any = ["list", "list_gpus"])]
    platform: Option<String>,
    /// How long a tenant's fenced GPU kernel may run before it is stopped (0: no limit).
    #[arg(long, default_value_t = 0)]
    tenant_launch_limit_ms: u64,
    /// For `sim`: the device's name.
    #[arg(long, default_value = "sim0")]
    sim_name: String,
    /// For `sim`: the device fails for good after this many jobs (an injected fault).
    #[arg(long)]
    sim_fail_after_jobs: Option<u64>,
    /// For `sim`: each allocation and read is answered this many milliseconds late (an injected
    /// slowness).
    #[arg(long)]
    sim_answer_delay_ms: Option<u64>,
    /// Lanes (command queues) per device.
    #[arg(long, default_value_t = 2)]
    lanes: usize,
    /// Device memory limit in bytes (0: all the device reports).
    #[arg(long, default_value_t = 0)]
    memory_limit: u64,
    /// Run the message loop under SCHED_FIFO (the daemon passes it with --dispatcher-realtime).
    #[arg(long)]
    loop_realtime: bool,
}

/// Runs `agora device-host`; returns the exit code.
fn device_host(args: DeviceHostArgs) -> i32 {
    use std::os::fd::FromRawFd;
    if args.list {
        return agora_device_host::print_platforms();
    }
    if args.list_gpus {
        return agora_device_host::host::list_gpus();
    }
    let (Some(fd), Some(platform)) = (args.fd, args.platform) else {
        eprintln!("agora device-host: --fd and --platform are required");
        return 2;
    };
    if fd < 3 {
        eprintln!("agora device-host: --fd must name an inherited socket (3 or above)");
        return 2;
    }
    log_to_the_daemons_log(&platform);
    // SAFETY: the daemon started this process with its end of a socketpair at `fd` (checked to
    // be beyond the standard streams); nothing else in this process owns that descriptor.
    let socket = unsafe { std::os::unix::net::UnixStream::from_raw_fd(fd) };
    let host = agora_device_host::HostArgs {
        platform,
        lanes: args.lanes.max(1),
        memory_limit: args.memory_limit,
        tenant_launch_limit: (args.tenant_launch_limit_ms > 0)
            .then(|| std::time::Duration::from_millis(args.tenant_launch_limit_ms)),
        sim_name: args.sim_name,
        sim_fail_after_jobs: args.sim_fail_after_jobs,
        sim_answer_delay: args.sim_answer_delay_ms.map(std::time::Duration::from_millis),
        loop_realtime: args.loop_realtime,
    };
    match agora_device_host::serve(socket, &host) {
        Ok(()) => 0,
        Err(e) => {
            eprintln!("agora device-host ({}): {e}", host.platform);
            1
        }
    }
}

/// A device host's log: its standard error is the daemon's, so the backends' own lines (an
/// OpenCL launch refused and why, a program's build log, a GPU fault) land in the daemon's log,
/// where a task's error message sends the operator ("the daemon logged the details"). Each line
/// starts with `device-host[PLATFORM]`. The level follows `AGORA_LOG` (inherited), else `warn`.
fn log_to_the_daemons_log(platform: &str) {
    use std::io::Write;
    /// Writes each formatted event (one `write` per event) to standard error after the prefix.
    struct Prefixed(std::sync::Arc<str>);
    impl Write for Prefixed {
        fn write(&mut self, line: &[u8]) -> std::io::Result<usize> {
            let mut stderr = std::io::stderr().lock();
            stderr.write_all(self.0.as_bytes())?;
            stderr.write_all(line)?;
            Ok(line.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            std::io::stderr().flush()
        }
    }
    let prefix: std::sync::Arc<str> = format!("device-host[{platform}] ").into();
    // The daemon has already warned about an unusable AGORA_LOG; a host only falls back.
    let (filter, _refused) = log_filter::from_env("warn");
    tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_ansi(false)
        .with_writer(move || Prefixed(prefix.clone()))
        .init();
}

/// `agora executor`: what the daemon's supervisor passes (see `agora_executor::child`).
#[derive(Args, Debug)]
struct ExecutorArgs {
    /// The inherited socket to the daemon.
    #[arg(long)]
    control_fd: i32,
    /// The inherited segment memfd of the session.
    #[arg(long)]
    segment_fd: i32,
    /// The private cache directory (the only writable place).
    #[arg(long)]
    cache_dir: PathBuf,
    /// The daemon's pid.
    #[arg(long)]
    daemon_pid: i32,
    /// The tenant's uid to run as (with --gid).
    #[arg(long, requires = "gid")]
    uid: Option<u32>,
    /// The tenant's gid to run as.
    #[arg(long, requires = "uid")]
    gid: Option<u32>,
}

/// Trace subcommands.
#[derive(Subcommand, Debug)]
enum TraceCommand {
    /// Write the daemon's trace (started with `agora serve --trace FILE`) to its file now.
    Save(SocketArg),
}

fn main() {
    // An empty $AGORA_SOCKET means "not set", as the clients read it (`socket_path`); clap would
    // take it for a `--socket` given no value. Removed before any thread exists.
    if std::env::var_os(agora_transport::socket::SOCKET_ENV).is_some_and(|v| v.is_empty()) {
        std::env::remove_var(agora_transport::socket::SOCKET_ENV);
    }
    progress::quiet_on_closed_stdout();
    let cli = Cli::parse();
    let cli = match cli.command {
        Command::DeviceHost(args) => std::process::exit(device_host(args)),
        _ => cli,
    };
    if let Command::Executor(args) = cli.command {
        // Before anything else (no logging, no threads): the executor confines itself first.
        std::process::exit(agora_executor::child::main(agora_executor::child::Args {
            control_fd: args.control_fd,
            segment_fd: args.segment_fd,
            cache_dir: args.cache_dir,
            daemon_pid: args.daemon_pid,
            tenant: args.uid.zip(args.gid),
        }));
    }
    let verbose = matches!(cli.command, Command::Serve(_));
    let (filter, refused) = log_filter::from_env(if verbose { "info" } else { "warn" });
    use std::io::IsTerminal;
    tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_ansi(std::io::stderr().is_terminal())
        .with_writer(std::io::stderr)
        .init();
    if let Some(warning) = refused {
        tracing::warn!("{warning}");
    }
    let result: Result<()> = match cli.command {
        Command::Serve(args) => cmd::serve(*args),
        Command::Status(args) => cmd::status(args),
        Command::Top(args) => top::run(args.socket.path(), args),
        Command::Devices(socket) => cmd::devices(socket.path()),
        Command::Drain(args) => cmd::drain(args),
        Command::Undrain(args) => cmd::undrain(args),
        Command::Kernels(args) => cmd::kernels(args),
        Command::Exports(args) => cmd::exports(args),
        Command::Rtdag(args) => rt::rtdag(args),
        Command::Slurm(command) => cmd::slurm(command),
        Command::Run(args) => cmd::run(args),
        Command::Demo(args) => cmd::demo(args),
        Command::Trace(TraceCommand::Save(socket)) => cmd::trace_save(socket.path()),
        Command::Plot(command) => plot::run(command),
        Command::Model(command) => model::run(command),
        Command::Sim(args) => sim::run(args),
        Command::Bench(command) => bench::run(command),
        Command::BenchClient(args) => bench::client(args),
        Command::InsituAnalytics(args) => bench::insitu::analytics(args),
        Command::Executor(_) | Command::DeviceHost(_) => unreachable!("handled before logging starts"),
    };
    if let Err(e) = result {
        eprintln!("error: {}", progress::render_error(&e));
        std::process::exit(1);
    }
}

#[cfg(test)]
mod tests {
    use clap::CommandFactory;

    use super::*;

    /// `agora --help` names every subcommand (the Cargo description listed only some).
    #[test]
    fn top_level_help_lists_every_subcommand() {
        let mut cli = Cli::command();
        let help = cli.render_help().to_string();
        for sub in cli.get_subcommands().filter(|c| !c.is_hide_set()) {
            assert!(
                help.contains(sub.get_name()),
                "{} missing from:\n{help}",
                sub.get_name()
            );
        }
        assert!(!help.contains("--socket"), "no global --socket:\n{help}");
        assert!(!help.contains("executor"), "the executor is hidden:\n{help}");
    }

    /// Every benchmark has its `--quick` smoke run in `make test` (issue #14: no benchmark can rot).
    #[test]
    fn make_test_smoke_runs_every_benchmark() {
        let makefile = include_str!("../../../Makefile");
        let test = &makefile[makefile.find("\ntest:").expect("a test target")..];
        let test = &test[..test[1..].find("\n\n").map_or(test.len(), |end| end + 1)];
        let cli = Cli::command();
        let bench = cli.find_subcommand("bench").expect("agora bench");
        for b in bench.get_subcommands() {
            let line = format!("agora bench {} --quick --json", b.get_name());
            assert!(test.contains(&line), "make test lacks `{line}`");
        }
    }

    /// `agora undrain` does not offer drain's `--evacuate`, which it would refuse (audit B3),
    /// and `agora kernels --help` names who may reload: the admins of `[daemon] admin_uids` /
    /// `admin_gids` (audit B2).
    #[test]
    fn help_offers_only_what_each_command_takes() {
        let mut cli = Cli::command();
        let has = |cli: &clap::Command, sub: &str, arg: &str| {
            cli.find_subcommand(sub)
                .unwrap()
                .get_arguments()
                .any(|a| a.get_id() == arg)
        };
        assert!(has(&cli, "drain", "evacuate"));
        assert!(!has(&cli, "undrain", "evacuate"));
        let kernels = cli
            .find_subcommand_mut("kernels")
            .unwrap()
            .render_long_help()
            .to_string();
        assert!(
            kernels.contains("admin_uids") && kernels.contains("admin_gids"),
            "{kernels}"
        );
    }

    /// `--socket` only where the command connects to a daemon or reads one's model.
    #[test]
    fn socket_only_on_commands_that_connect() {
        let cli = Cli::command();
        let has_socket = |c: &clap::Command| c.get_arguments().any(|a| a.get_id() == "socket");
        for c in cli.get_subcommands() {
            let leaves: Vec<&clap::Command> = if c.has_subcommands() {
                c.get_subcommands().collect()
            } else {
                vec![c]
            };
            for leaf in leaves {
                let name = format!("{} {}", c.get_name(), leaf.get_name());
                // `executor` is started by the daemon with its descriptors, not a socket.
                // `bench rt` simulates and starts a daemon of its own for its measured part;
                // `bench stall` starts fresh daemons (its runs compare a quiet and an attacked one).
                let connects = !matches!(c.get_name(), "plot" | "sim" | "model" | "demo" | "executor" | "device-host")
                    && !matches!(leaf.get_name(), "hetero" | "sla" | "migrate" | "soak" | "rt" | "stall")
                    // `bench kernels` measures first vs cached builds: a daemon of its own.
                    && name != "bench kernels";
                // `model show` reads the model of the daemon on the socket, running or not.
                let names_a_daemon = name == "model show";
                assert_eq!(has_socket(leaf), connects || names_a_daemon, "{name}");
            }
        }
    }
}
