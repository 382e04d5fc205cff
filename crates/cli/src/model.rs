//! `agora model show`: the learned performance model the `perf` and `energy` policies use.
//!
//! Reads the file the daemon on `--socket` (or the default socket) keeps in its state directory
//! (written every few seconds while it learns, and at shutdown), so it works with or without a
//! running daemon. A running daemon says which state directory it uses (whatever it was
//! started with); for one that is not running, each socket has its own state directory unless
//! one is set, so the socket picks the model; `--state-dir` / `$AGORA_STATE_DIR` name a
//! directory outright, as they do for `agora serve`.

use std::path::PathBuf;

use agora_daemon::policy::model::{bucket, PerformanceModel};
use anyhow::{Context, Result};
use clap::{Args, Subcommand};

use crate::SocketArg;

/// Model subcommands.
#[derive(Subcommand, Debug)]
pub enum ModelCommand {
    /// Print the performance table: per kernel, device and size bucket, the running average of
    /// the execution time, and the fitted scaling exponent per kernel and device. Rows of
    /// `(transfers)` are each device's link: a job's copies, with the bytes as the size.
    Show(ShowArgs),
}

/// `agora model show` options.
#[derive(Args, Debug)]
pub struct ShowArgs {
    /// The daemon's state directory, when it was started with one (default: $AGORA_STATE_DIR,
    /// else the directory of the daemon on --socket, under $XDG_STATE_HOME/agora/daemons or
    /// ~/.local/state/agora/daemons).
    #[arg(long, value_name = "DIR")]
    state_dir: Option<PathBuf>,
    /// The socket of the daemon whose model to read (it need not be running).
    #[command(flatten)]
    socket: SocketArg,
    /// Only this kernel.
    #[arg(long)]
    kernel: Option<String>,
    /// Print JSON (one object per row) instead of a table.
    #[arg(long)]
    json: bool,
}

pub fn run(command: ModelCommand) -> Result<()> {
    match command {
        ModelCommand::Show(args) => show(args),
    }
}

fn show(args: ShowArgs) -> Result<()> {
    let socket = agora_transport::socket::socket_path(args.socket.path());
    let (dir, whose) = match args.state_dir {
        Some(dir) => (dir, "the state directory given".to_string()),
        // A running daemon says where it keeps its model (it may have been given --state-dir or
        // `[daemon] state_dir`); one that is not running left it where its socket puts it,
        // unless $AGORA_STATE_DIR says otherwise.
        None => match agora::daemon_status(Some(socket.clone()))
            .ok()
            .and_then(|status| status.state_dir)
        {
            Some(dir) => (
                PathBuf::from(dir),
                format!("the daemon running on {}", socket.display()),
            ),
            None => (
                agora_daemon::default_state_dir(&socket),
                format!("the daemon on {}, not running", socket.display()),
            ),
        },
    };
    let path = PerformanceModel::path(&dir);
    let model = PerformanceModel::load(&dir, 0.8).map_err(anyhow::Error::msg)?;
    let rows: Vec<_> = model
        .rows()
        .into_iter()
        .filter(|r| args.kernel.as_ref().is_none_or(|k| *k == r.kernel))
        .collect();
    if args.json {
        println!("{}", serde_json::to_string_pretty(&rows).context("encoding the model")?);
        return Ok(());
    }
    if rows.is_empty() {
        if let Some(kernel) = &args.kernel {
            anyhow::bail!(
                "no measurements of kernel '{kernel}' in {} ({whose}); `agora model show` lists what it has",
                path.display()
            );
        }
        println!(
            "no measurements in {} ({whose}) yet: run work through that daemon (any policy learns)",
            path.display()
        );
        return Ok(());
    }
    let modified = std::fs::metadata(&path)
        .and_then(|m| m.modified())
        .ok()
        .and_then(|t| t.elapsed().ok())
        .map(|age| format!(", saved {:.0} s ago", age.as_secs_f64()))
        .unwrap_or_default();
    println!("performance model {} ({whose}){modified}", path.display());
    // Columns as wide as their longest entry, so long kernel names do not push the rest.
    let kw = rows
        .iter()
        .map(|r| r.kernel.chars().count())
        .max()
        .unwrap_or(0)
        .max("kernel".len());
    let dw = rows
        .iter()
        .map(|r| r.device.chars().count())
        .max()
        .unwrap_or(0)
        .max("device".len());
    let widths = (kw, dw);
    println!(
        "{:<kw$} {:<dw$} {:>21} {:>12} {:>12} {:>8}",
        "kernel", "device", "size bucket (items)", "mean", "per item", "samples"
    );
    let mut last: Option<(String, String)> = None;
    for row in &rows {
        let key = (row.kernel.clone(), row.device.clone());
        if last.as_ref().is_some_and(|l| *l != key) {
            print_fit(&model, last.as_ref().unwrap(), widths);
        }
        let low = 1u64 << row.bucket;
        let high = (1u128 << (row.bucket + 1)) - 1;
        let e = &row.entry;
        println!(
            "{:<kw$} {:<dw$} {:>21} {:>12} {:>12} {:>8}",
            row.kernel,
            row.device,
            format!("{low}..{high}"),
            duration(e.mean_ns),
            duration(e.mean_ns / e.mean_items.max(1.0)),
            e.samples
        );
        debug_assert_eq!(bucket(low), row.bucket);
        last = Some(key);
    }
    if let Some(l) = &last {
        print_fit(&model, l, widths);
    }
    Ok(())
}

fn print_fit(model: &PerformanceModel, (kernel, device): &(String, String), (kw, dw): (usize, usize)) {
    if let Some((a, b)) = model.regression(kernel, device) {
        println!("{:<kw$} {:<dw$} fit: t ≈ {:.3e} ns × items^{b:.2}", "", "", a.exp());
    }
}

/// Nanoseconds as a short human figure.
fn duration(ns: f64) -> String {
    if ns >= 1e9 {
        format!("{:.2} s", ns / 1e9)
    } else if ns >= 1e6 {
        format!("{:.2} ms", ns / 1e6)
    } else if ns >= 1e3 {
        format!("{:.2} µs", ns / 1e3)
    } else {
        format!("{ns:.1} ns")
    }
}
