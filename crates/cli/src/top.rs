//! `agora top`: a live view of the node — devices and lanes, tenants and their queues, rates.
//!
//! Read-only: each refresh is one status request on the control socket (an observer connection
//! that opens no session), answered by the dispatcher between polls; rates come from the
//! difference between two snapshots. The status summarises: it lists the busiest sessions (the
//! header says how many there are in all) and each one's busiest queues (with the count of all).

use std::io::IsTerminal;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use agora::StatusReport;
use agora_protocol::control::shown;
use anyhow::{bail, Result};
use clap::Args;
use ratatui::crossterm::event::{self, Event, KeyCode, KeyEventKind};
use ratatui::layout::{Constraint, Layout};
use ratatui::style::{Modifier, Style};
use ratatui::text::Line;
use ratatui::widgets::{Block, Paragraph, Row, Table, TableState};
use serde::Serialize;

/// `agora top` options.
#[derive(Args, Debug)]
pub struct TopArgs {
    /// Print one snapshot (two status samples 0.5 s apart, for rates) and exit.
    #[arg(long)]
    once: bool,
    /// With --once: print JSON — {policy, uptime_s, tasks_completed, tasks_failed, devices: [{name,
    /// kind, description, memory_used, memory_bytes, lanes: [{busy, queued, completed, busy_ns}]}],
    /// tenants: [{id, pid, uid, name, classes, queue_count, queues: [{name, class, in_flight,
    /// bound_to}] (the busiest), in_flight, tasks_per_s, bytes_moved, bytes_per_s}],
    /// live_sessions, evictions, memory_waits, allocation_retries, dispatcher_longest_ms,
    /// dispatcher_stalls, recent_stalls, batch_lanes, private}. `tenants` lists the busiest
    /// sessions; `live_sessions` counts them all; `batch_lanes` is the OS priority batch work runs
    /// at now (under `auto`, `idle` while latency-class work is live); `private` is null, or
    /// {uid, sessions} when the daemon shows you your own sessions only (`--private-status`).
    #[arg(long, requires = "once")]
    json: bool,
    /// Seconds between refreshes (0.1 to 60).
    #[arg(long, default_value_t = 1.0, value_parser = refresh_interval)]
    interval: f64,
    #[command(flatten)]
    pub socket: crate::SocketArg,
}

/// One tenant, with rates.
#[derive(Serialize, Debug, Clone)]
struct Tenant {
    id: u64,
    pid: i32,
    uid: u32,
    name: String,
    classes: Vec<String>,
    /// All its queues.
    queue_count: u64,
    /// The busiest of them.
    queues: Vec<agora_protocol::control::QueueStatus>,
    in_flight: u64,
    tasks_per_s: f64,
    bytes_moved: u64,
    bytes_per_s: f64,
}

/// What the screen shows.
#[derive(Serialize, Debug, Clone)]
struct View {
    policy: String,
    uptime_s: f64,
    tasks_completed: u64,
    tasks_failed: u64,
    devices: Vec<agora_protocol::control::DeviceStatus>,
    tenants: Vec<Tenant>,
    /// Live sessions, all of them (`tenants` lists the busiest).
    live_sessions: u64,
    /// Device memory pressure since start: buffers evicted, tasks that waited for room,
    /// allocations retried after eviction.
    evictions: u64,
    memory_waits: u64,
    allocation_retries: u64,
    /// The dispatcher's longest stretch of work since start, ms.
    dispatcher_longest_ms: f64,
    /// Its stretches over 1 ms since start (every tenant's new task waited meanwhile), and since
    /// the previous sample.
    dispatcher_stalls: u64,
    recent_stalls: u64,
    /// The OS priority lanes run batch work at now (`batch`, `idle`, ...).
    batch_lanes: String,
    /// Whether that is `auto`'s choice (batch lanes `idle` only while latency work is live).
    #[serde(skip)]
    batch_lanes_auto: bool,
    /// Real-time DAGs admitted now.
    dags: Vec<agora_protocol::control::DagStatus>,
    /// Set when the daemon shows this user its own sessions only.
    private: Option<agora_protocol::control::PrivateView>,
}

fn view(previous: Option<(&StatusReport, Instant)>, now: &StatusReport, at: Instant) -> View {
    let tenants = now
        .sessions
        .iter()
        .map(|s| {
            let tasks = s.tasks_completed + s.tasks_failed;
            let bytes = s.bytes_to_device + s.bytes_to_host;
            let (tasks_per_s, bytes_per_s) = match previous {
                Some((p, then)) => {
                    let dt = at.saturating_duration_since(then).as_secs_f64().max(1e-3);
                    match p.sessions.iter().find(|o| o.id == s.id) {
                        Some(o) => (
                            tasks.saturating_sub(o.tasks_completed + o.tasks_failed) as f64 / dt,
                            bytes.saturating_sub(o.bytes_to_device + o.bytes_to_host) as f64 / dt,
                        ),
                        None => (0.0, 0.0),
                    }
                }
                None => (0.0, 0.0),
            };
            let mut classes = Vec::new();
            if s.queue_count > s.latency_queues {
                classes.push("batch".to_string());
            }
            if s.latency_queues > 0 {
                classes.push("latency".to_string());
            }
            Tenant {
                id: s.id,
                pid: s.pid,
                uid: s.uid,
                name: shown(&s.name).into_owned(),
                classes,
                queue_count: s.queue_count,
                queues: s
                    .queues
                    .iter()
                    .map(|q| agora_protocol::control::QueueStatus {
                        name: shown(&q.name).into_owned(),
                        ..q.clone()
                    })
                    .collect(),
                in_flight: s.in_flight,
                tasks_per_s,
                bytes_moved: bytes,
                bytes_per_s,
            }
        })
        .collect();
    View {
        policy: now.policy.clone(),
        uptime_s: now.uptime_s,
        tasks_completed: now.tasks_completed,
        tasks_failed: now.tasks_failed,
        devices: now.devices.clone(),
        tenants,
        live_sessions: now.live_sessions,
        evictions: now.evictions,
        memory_waits: now.memory_waits,
        allocation_retries: now.allocation_retries,
        dispatcher_longest_ms: now.dispatcher_longest_iteration_ms,
        dispatcher_stalls: now.dispatcher_stalls,
        recent_stalls: previous.map_or(0, |(p, _)| now.dispatcher_stalls.saturating_sub(p.dispatcher_stalls)),
        batch_lanes: now.batch_priority_now.clone(),
        batch_lanes_auto: now.batch_priority == "auto",
        dags: now
            .dags
            .iter()
            .map(|d| agora_protocol::control::DagStatus {
                name: shown(&d.name).into_owned(),
                stopped: d.stopped.as_deref().map(|s| shown(s).into_owned()),
                ..d.clone()
            })
            .collect(),
        private: now.private,
    }
}

/// The memory-pressure and dispatcher-stall parts of the header ("" while there were none).
fn pressure(v: &View) -> String {
    let mut text = String::new();
    if v.evictions + v.memory_waits + v.allocation_retries > 0 {
        text += &format!(
            " · memory pressure: {} evicted, {} waited, {} retried",
            v.evictions, v.memory_waits, v.allocation_retries
        );
    }
    if v.dispatcher_stalls > 0 {
        text += &format!(
            " · dispatcher stalls over 1 ms: {} ({} since the last refresh; longest {:.1} ms)",
            v.dispatcher_stalls, v.recent_stalls, v.dispatcher_longest_ms
        );
    }
    if v.batch_lanes_auto && v.batch_lanes == "idle" {
        text += " · batch lanes idle: latency work is live";
    }
    text
}

fn human_bytes(b: f64) -> String {
    if b >= 1e9 {
        format!("{:.1} GB", b / 1e9)
    } else if b >= 1e6 {
        format!("{:.1} MB", b / 1e6)
    } else if b >= 1e3 {
        format!("{:.1} kB", b / 1e3)
    } else {
        format!("{b:.0} B")
    }
}

fn print_text(v: &View) {
    println!(
        "agora top · policy {} · up {:.0}s · {} tasks done, {} failed{}",
        v.policy,
        v.uptime_s,
        v.tasks_completed,
        v.tasks_failed,
        pressure(v)
    );
    for d in &v.devices {
        let memory = if d.memory_bytes == 0 {
            "host".into()
        } else {
            format!("{} / {} MiB", d.memory_used >> 20, d.memory_bytes >> 20)
        } + &d
            .utilization_percent
            .map(|p| format!(" · device busy {p} %"))
            .unwrap_or_default();
        let busy = d.lanes.iter().filter(|l| l.busy).count();
        println!(
            "{:<8} {:<6} lanes {busy}/{} busy · memory {memory}",
            d.name,
            d.kind,
            d.lanes.len()
        );
    }
    println!(
        "{:>5} {:>8} {:>6} {:<20} {:>7} {:>10} {:>12}  classes",
        "id", "pid", "uid", "tenant", "queues", "tasks/s", "bytes/s"
    );
    for t in &v.tenants {
        println!(
            "{:>5} {:>8} {:>6} {:<20} {:>7} {:>10.0} {:>12}  {}",
            t.id,
            t.pid,
            t.uid,
            t.name,
            t.queue_count,
            t.tasks_per_s,
            human_bytes(t.bytes_per_s),
            t.classes.join(",")
        );
    }
    let listable = v.private.map_or(v.live_sessions, |view| view.sessions);
    let hidden = listable.saturating_sub(v.tenants.len() as u64);
    if hidden > 0 {
        println!("… and {hidden} more session(s) (the busiest are shown)");
    }
    if let Some(view) = v.private {
        println!(
            "(uid {}'s sessions only: this daemon keeps each user's private; {} of other users not shown)",
            view.uid,
            v.live_sessions.saturating_sub(view.sessions)
        );
    }
    crate::cmd::print_dags(&v.dags);
}

/// One line per admitted DAG, for the live view.
fn dag_lines(v: &View) -> Vec<Line<'static>> {
    v.dags
        .iter()
        .map(|d| {
            Line::from(format!(
                "#{} {} (session {}) every {:.1} ms: {} releases, {} met, {} missed, {} overruns, p99 {:.2} ms{}",
                d.id,
                d.name,
                d.session,
                d.period_us as f64 / 1e3,
                d.releases,
                d.met,
                d.missed,
                d.overruns,
                d.response_p99_us as f64 / 1e3,
                if d.stopped.is_some() { " · stopped" } else { "" }
            ))
        })
        .collect()
}

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum SortBy {
    TasksPerSecond,
    InFlight,
    Bytes,
    Id,
}

impl SortBy {
    fn next(self) -> SortBy {
        match self {
            SortBy::TasksPerSecond => SortBy::InFlight,
            SortBy::InFlight => SortBy::Bytes,
            SortBy::Bytes => SortBy::Id,
            SortBy::Id => SortBy::TasksPerSecond,
        }
    }

    fn sort(self, tenants: &mut [Tenant]) {
        match self {
            SortBy::TasksPerSecond => tenants.sort_by(|a, b| b.tasks_per_s.total_cmp(&a.tasks_per_s)),
            SortBy::InFlight => tenants.sort_by_key(|t| std::cmp::Reverse(t.in_flight)),
            SortBy::Bytes => tenants.sort_by(|a, b| b.bytes_per_s.total_cmp(&a.bytes_per_s)),
            SortBy::Id => tenants.sort_by_key(|t| t.id),
        }
    }
}

/// Runs `agora top`.
pub fn run(socket: Option<PathBuf>, args: TopArgs) -> Result<()> {
    if args.once {
        let first = agora::daemon_status(socket.clone())?;
        let t0 = Instant::now();
        std::thread::sleep(Duration::from_millis(500));
        let second = agora::daemon_status(socket)?;
        let v = view(Some((&first, t0)), &second, Instant::now());
        if args.json {
            println!("{}", serde_json::to_string_pretty(&v)?);
        } else {
            print_text(&v);
        }
        return Ok(());
    }
    if !std::io::stdout().is_terminal() {
        bail!("agora top needs a terminal; for scripts use `agora top --once` (or `--once --json`)");
    }
    let interval = Duration::from_secs_f64(args.interval);
    let mut terminal = ratatui::init(); // raw mode, alternate screen, and a panic hook that restores
    let result = live(&mut terminal, socket, interval);
    ratatui::restore();
    result
}

fn live(terminal: &mut ratatui::DefaultTerminal, socket: Option<PathBuf>, interval: Duration) -> Result<()> {
    let mut previous: Option<(StatusReport, Instant)> = None;
    let mut current: Option<View> = None;
    let mut problem: Option<String> = None;
    let mut sort = SortBy::TasksPerSecond;
    let mut selected = TableState::default();
    let mut details = false;
    let mut next_refresh = Instant::now();
    loop {
        if Instant::now() >= next_refresh {
            next_refresh = Instant::now() + interval;
            match agora::daemon_status(socket.clone()) {
                Ok(now) => {
                    let at = Instant::now();
                    current = Some(view(previous.as_ref().map(|(p, t)| (p, *t)), &now, at));
                    previous = Some((now, at));
                    problem = None;
                }
                Err(e) => problem = Some(format!("{e} — retrying every {:.1}s", interval.as_secs_f64())),
            }
        }
        let mut tenants = current.as_ref().map(|v| v.tenants.clone()).unwrap_or_default();
        sort.sort(&mut tenants);
        if selected.selected().is_none() && !tenants.is_empty() {
            selected.select(Some(0));
        }
        terminal.draw(|frame| {
            let areas = Layout::vertical([
                Constraint::Length(2),
                Constraint::Length(current.as_ref().map_or(3, |v| v.devices.len() as u16 + 3)),
                Constraint::Min(5),
                Constraint::Length(current.as_ref().map_or(0, |v| if v.dags.is_empty() { 0 } else { v.dags.len().min(6) as u16 + 2 })),
                Constraint::Length(if details { 8 } else { 0 }),
            ])
            .split(frame.area());
            if let Some(v) = current.as_ref().filter(|v| !v.dags.is_empty()) {
                frame.render_widget(
                    Paragraph::new(dag_lines(v)).block(Block::bordered().title("real-time DAGs")),
                    areas[3],
                );
            }
            let header = match (&current, &problem) {
                (_, Some(p)) => format!("agora top · daemon unreachable: {p}"),
                (Some(v), None) => format!(
                    "agora top · policy {} · up {:.0}s · {} done, {} failed{} · {} sessions ({} busiest shown{}) · sort: {:?} · q quit, s sort, ↑↓ select, Enter queues",
                    v.policy,
                    v.uptime_s,
                    v.tasks_completed,
                    v.tasks_failed,
                    pressure(v),
                    v.live_sessions,
                    v.tenants.len(),
                    v.private
                        .map(|view| format!(", uid {}'s only: the daemon keeps other users' private", view.uid))
                        .unwrap_or_default(),
                    sort
                ),
                (None, None) => "agora top · connecting…".into(),
            };
            frame.render_widget(Paragraph::new(Line::from(header)), areas[0]);
            if let Some(v) = &current {
                let rows = v.devices.iter().map(|d| {
                    let busy = d.lanes.iter().filter(|l| l.busy).count();
                    let queued: u64 = d.lanes.iter().map(|l| l.queued).sum();
                    let done: u64 = d.lanes.iter().map(|l| l.completed).sum();
                    let lanes: String = d.lanes.iter().map(|l| if l.busy { '█' } else { '·' }).collect();
                    let memory = if d.memory_bytes == 0 {
                        "host".into()
                    } else {
                        format!("{} / {} MiB", d.memory_used >> 20, d.memory_bytes >> 20)
                    } + &d.utilization_percent.map(|p| format!(" · {p} %")).unwrap_or_default();
                    Row::new(vec![
                        d.name.clone(),
                        d.kind.to_string(),
                        format!("{lanes} {busy}/{}", d.lanes.len()),
                        queued.to_string(),
                        done.to_string(),
                        memory,
                    ])
                });
                let table = Table::new(
                    rows,
                    [Constraint::Length(9), Constraint::Length(7), Constraint::Length(16), Constraint::Length(8), Constraint::Length(12), Constraint::Min(14)],
                )
                .header(Row::new(vec!["device", "kind", "lanes busy", "queued", "completed", "memory"]).style(Style::new().add_modifier(Modifier::BOLD)))
                .block(Block::bordered().title("devices"));
                frame.render_widget(table, areas[1]);
            }
            let rows = tenants.iter().map(|t| {
                Row::new(vec![
                    t.id.to_string(),
                    t.pid.to_string(),
                    t.uid.to_string(),
                    t.name.clone(),
                    t.queue_count.to_string(),
                    t.in_flight.to_string(),
                    format!("{:.0}", t.tasks_per_s),
                    human_bytes(t.bytes_per_s),
                    t.classes.join(","),
                ])
            });
            let table = Table::new(
                rows,
                [
                    Constraint::Length(5),
                    Constraint::Length(8),
                    Constraint::Length(6),
                    Constraint::Length(22),
                    Constraint::Length(7),
                    Constraint::Length(9),
                    Constraint::Length(10),
                    Constraint::Length(11),
                    Constraint::Min(8),
                ],
            )
            .header(
                Row::new(vec!["id", "pid", "uid", "tenant", "queues", "in flight", "tasks/s", "bytes/s", "classes"])
                    .style(Style::new().add_modifier(Modifier::BOLD)),
            )
            .row_highlight_style(Style::new().add_modifier(Modifier::REVERSED))
            .block(Block::bordered().title("tenants"));
            frame.render_stateful_widget(table, areas[2], &mut selected);
            if details {
                let chosen = selected.selected().and_then(|i| tenants.get(i));
                let rows = chosen.into_iter().flat_map(|t| t.queues.iter()).map(|q| {
                    Row::new(vec![
                        q.name.clone(),
                        format!("{:?}", q.class).to_lowercase(),
                        q.in_flight.to_string(),
                        q.bound_to
                            .clone()
                            .or_else(|| q.last_device.as_ref().map(|d| format!("unbound (last {d})")))
                            .unwrap_or_else(|| "unbound".into()),
                    ])
                });
                let title = chosen.map_or("queues".to_string(), |t| {
                    format!(
                        "busiest {} of {} queues of {} (#{}; `agora status --session {}` lists all)",
                        t.queues.len(),
                        t.queue_count,
                        t.name,
                        t.id,
                        t.id
                    )
                });
                let table = Table::new(rows, [Constraint::Length(20), Constraint::Length(8), Constraint::Length(10), Constraint::Min(10)])
                    .header(Row::new(vec!["queue", "class", "in flight", "bound to"]).style(Style::new().add_modifier(Modifier::BOLD)))
                    .block(Block::bordered().title(title));
                frame.render_widget(table, areas[4]);
            }
        })?;
        let wait = next_refresh.saturating_duration_since(Instant::now());
        if event::poll(wait)? {
            if let Event::Key(key) = event::read()? {
                if key.kind != KeyEventKind::Press {
                    continue;
                }
                match key.code {
                    KeyCode::Char('q') | KeyCode::Esc => return Ok(()),
                    KeyCode::Char('s') => sort = sort.next(),
                    KeyCode::Down => {
                        let i = selected
                            .selected()
                            .map_or(0, |i| (i + 1).min(tenants.len().saturating_sub(1)));
                        selected.select(Some(i));
                    }
                    KeyCode::Up => selected.select(Some(selected.selected().map_or(0, |i| i.saturating_sub(1)))),
                    KeyCode::Enter => details = !details,
                    _ => {}
                }
            }
        }
    }
}

/// `--interval`: a number of seconds from 0.1 to 60 (a NaN once made the refresh loop panic, and
/// 0 was quietly taken as 0.1).
fn refresh_interval(value: &str) -> std::result::Result<f64, String> {
    let seconds: f64 = value
        .trim()
        .parse()
        .map_err(|_| format!("'{value}' is not a number of seconds"))?;
    if (0.1..=60.0).contains(&seconds) {
        Ok(seconds)
    } else {
        Err(format!("{value} s: refresh between 0.1 and 60 seconds"))
    }
}
