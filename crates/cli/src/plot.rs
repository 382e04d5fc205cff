//! `agora plot trace`: a timeline picture of a task trace (`agora serve --trace FILE`).
//!
//! Lanes are rows, tasks are bars coloured by tenant: solid for execution, lighter for transfers;
//! queue waits are not drawn (they would cover the row). SVG is written directly; PNG is that SVG
//! rendered with resvg (text needs a system font, e.g. DejaVu from Debian's fonts-dejavu-core).

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};
use clap::{Args, Subcommand};

/// `agora plot` subcommands.
#[derive(Subcommand, Debug)]
pub enum PlotCommand {
    /// Draw a trace file as a timeline (lanes as rows, tasks coloured by tenant).
    Trace(TraceArgs),
}

/// `agora plot trace` options.
#[derive(Args, Debug)]
pub struct TraceArgs {
    /// Trace file written by `agora serve --trace FILE`.
    file: PathBuf,
    /// Output picture: .svg or .png.
    #[arg(short, long)]
    output: PathBuf,
    /// Width in pixels.
    #[arg(long, default_value_t = 1400)]
    width: u32,
}

struct Span {
    row: u64,
    start_us: f64,
    dur_us: f64,
    tenant: String,
    transfer: bool,
}

const PALETTE: [&str; 10] = [
    "#4e79a7", "#f28e2b", "#e15759", "#76b7b2", "#59a14f", "#edc948", "#b07aa1", "#ff9da7", "#9c755f", "#bab0ac",
];

fn escape(text: &str) -> String {
    text.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
        .replace('"', "&quot;")
}

/// Spans of a trace by kind, as `(name, count)` in a fixed order: the daemon records a wait
/// (queued until started), an execution and, when data moved, a transfer per task.
pub fn span_kinds(json: &serde_json::Value) -> Vec<(&'static str, usize)> {
    let events = json["traceEvents"].as_array().map(Vec::as_slice).unwrap_or(&[]);
    let count = |cat: &str| events.iter().filter(|e| e["ph"] == "X" && e["cat"] == cat).count();
    [("waits", "wait"), ("executions", "exec"), ("transfers", "transfer")]
        .into_iter()
        .map(|(name, cat)| (name, count(cat)))
        .filter(|(_, n)| *n > 0)
        .collect()
}

/// Builds the SVG for the trace in `json`.
fn svg(json: &serde_json::Value, width: u32) -> Result<String> {
    let events = json["traceEvents"]
        .as_array()
        .context("not a trace: no \"traceEvents\" array")?;
    let mut rows: BTreeMap<u64, String> = BTreeMap::new();
    let mut spans = Vec::new();
    for e in events {
        match e["ph"].as_str() {
            Some("M") if e["name"] == "thread_name" => {
                if let (Some(tid), Some(name)) = (e["tid"].as_u64(), e["args"]["name"].as_str()) {
                    rows.insert(tid, name.to_string());
                }
            }
            Some("X") if e["cat"] == "exec" || e["cat"] == "transfer" => {
                let (Some(row), Some(ts), Some(dur)) = (e["tid"].as_u64(), e["ts"].as_f64(), e["dur"].as_f64()) else {
                    continue;
                };
                spans.push(Span {
                    row,
                    start_us: ts,
                    dur_us: dur,
                    tenant: e["args"]["tenant"].as_str().unwrap_or("?").to_string(),
                    transfer: e["cat"] == "transfer",
                });
            }
            _ => {}
        }
    }
    if spans.is_empty() {
        bail!("the trace has no task spans (was the daemon idle, or is this not an Agora trace?)");
    }
    for s in &spans {
        rows.entry(s.row).or_insert_with(|| format!("row {}", s.row));
    }
    let mut tenants: Vec<String> = spans.iter().map(|s| s.tenant.clone()).collect();
    tenants.sort();
    tenants.dedup();
    let color = |t: &str| PALETTE[tenants.iter().position(|x| x == t).unwrap_or(0) % PALETTE.len()];
    let t0 = spans.iter().map(|s| s.start_us).fold(f64::INFINITY, f64::min);
    let t1 = spans
        .iter()
        .map(|s| s.start_us + s.dur_us)
        .fold(f64::NEG_INFINITY, f64::max);
    let span_us = (t1 - t0).max(1.0);
    let (left, top, row_h, legend_h) = (170.0, 30.0, 28.0, 24.0 * tenants.len().div_ceil(4) as f64 + 10.0);
    let plot_w = f64::from(width) - left - 50.0;
    let row_index: BTreeMap<u64, usize> = rows.keys().enumerate().map(|(i, k)| (*k, i)).collect();
    let height = top + row_h * rows.len() as f64 + 40.0 + legend_h;
    let x = |us: f64| left + (us - t0) / span_us * plot_w;
    let mut out = String::new();
    writeln!(
        out,
        r#"<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height:.0}" font-family="DejaVu Sans, sans-serif" font-size="12">"#
    )?;
    writeln!(out, r#"<rect width="100%" height="100%" fill="white"/>"#)?;
    let transfers = spans.iter().filter(|s| s.transfer).count();
    writeln!(
        out,
        r#"<text x="{left}" y="18" font-size="14">Agora task trace · {:.2} ms · {} executions, {transfers} transfers (waits not drawn)</text>"#,
        span_us / 1e3,
        spans.len() - transfers
    )?;
    for (tid, name) in &rows {
        let y = top + row_h * row_index[tid] as f64;
        writeln!(
            out,
            r##"<rect x="{left}" y="{y:.1}" width="{plot_w:.1}" height="{:.1}" fill="#f4f4f4"/>"##,
            row_h - 4.0
        )?;
        writeln!(
            out,
            r#"<text x="8" y="{:.1}">{}</text>"#,
            y + row_h / 2.0 + 2.0,
            escape(name)
        )?;
    }
    for s in &spans {
        let y = top + row_h * row_index[&s.row] as f64;
        let w = (s.dur_us / span_us * plot_w).max(0.5);
        let opacity = if s.transfer { 0.45 } else { 1.0 };
        writeln!(
            out,
            r#"<rect class="{}" x="{:.2}" y="{:.1}" width="{w:.2}" height="{:.1}" fill="{}" fill-opacity="{opacity}"/>"#,
            if s.transfer { "transfer" } else { "exec" },
            x(s.start_us),
            y + 2.0,
            row_h - 8.0,
            color(&s.tenant)
        )?;
    }
    let axis_y = top + row_h * rows.len() as f64 + 4.0;
    writeln!(
        out,
        r#"<line x1="{left}" y1="{axis_y:.1}" x2="{:.1}" y2="{axis_y:.1}" stroke="black"/>"#,
        left + plot_w
    )?;
    for i in 0..=5 {
        let us = t0 + span_us * f64::from(i) / 5.0;
        writeln!(
            out,
            r#"<text x="{:.1}" y="{:.1}" text-anchor="middle">{:.2} ms</text>"#,
            x(us),
            axis_y + 16.0,
            (us - t0) / 1e3
        )?;
    }
    for (i, t) in tenants.iter().enumerate() {
        let lx = left + (i % 4) as f64 * 300.0;
        let ly = axis_y + 34.0 + (i / 4) as f64 * 24.0;
        writeln!(
            out,
            r#"<rect class="legend" x="{lx:.1}" y="{:.1}" width="14" height="14" fill="{}"/>"#,
            ly - 11.0,
            color(t)
        )?;
        writeln!(out, r#"<text x="{:.1}" y="{ly:.1}">{}</text>"#, lx + 20.0, escape(t))?;
    }
    writeln!(out, "</svg>")?;
    Ok(out)
}

fn render_png(svg: &str, path: &Path) -> Result<()> {
    let mut options = resvg::usvg::Options::default();
    options.fontdb_mut().load_system_fonts();
    if options.fontdb.is_empty() {
        eprintln!("warning: no system font found; the PNG will have no text (install fonts-dejavu-core)");
    }
    let tree = resvg::usvg::Tree::from_str(svg, &options).context("rendering the timeline")?;
    let size = tree.size().to_int_size();
    let mut pixmap = resvg::tiny_skia::Pixmap::new(size.width(), size.height()).context("picture too large")?;
    resvg::render(&tree, resvg::tiny_skia::Transform::identity(), &mut pixmap.as_mut());
    pixmap
        .save_png(path)
        .with_context(|| format!("writing {}", path.display()))
}

/// Runs `agora plot`.
pub fn run(command: PlotCommand) -> Result<()> {
    let PlotCommand::Trace(args) = command;
    let text = std::fs::read_to_string(&args.file).with_context(|| format!("reading {}", args.file.display()))?;
    let json: serde_json::Value =
        serde_json::from_str(&text).with_context(|| format!("{} is not JSON", args.file.display()))?;
    let picture = svg(&json, args.width.clamp(400, 10_000))?;
    match args.output.extension().and_then(|e| e.to_str()) {
        Some("svg") => {
            std::fs::write(&args.output, picture).with_context(|| format!("writing {}", args.output.display()))?
        }
        Some("png") => render_png(&picture, &args.output)?,
        _ => bail!("the output must end in .svg or .png"),
    }
    println!("wrote {}", args.output.display());
    Ok(())
}
