//! Task traces in the Chrome/Perfetto JSON format (load the file in ui.perfetto.dev).
//!
//! One row per lane, plus row 0 for tasks run inline on the dispatcher. Each task contributes a
//! `wait` span (queued in the lane), a `transfer` span (its data movements, when it has any) and
//! an `exec` span. Spans go to a ring of bounded size: when it is full the oldest are dropped (and
//! counted), so tracing a long run cannot exhaust memory.

use std::collections::VecDeque;
use std::io::Write;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Instant;

/// One span.
#[derive(Debug, Clone)]
pub(crate) struct Span {
    /// `wait`, `transfer` or `exec`.
    pub category: &'static str,
    /// Kernel name or operation (`sync_to`, ...).
    pub name: &'static str,
    /// Row (0: inline on the dispatcher; then one per lane).
    pub row: u32,
    pub start: Instant,
    pub end: Instant,
    pub session: u64,
    pub tenant: Arc<str>,
    pub task: u64,
    pub queue: Arc<str>,
}

/// The recorder.
pub(crate) struct TraceRecorder {
    path: PathBuf,
    capacity: usize,
    spans: Mutex<VecDeque<Span>>,
    dropped: AtomicU64,
    epoch: Instant,
    rows: Vec<String>,
}

impl TraceRecorder {
    /// A recorder writing to `path`, keeping at most `capacity` spans; `rows` names the lanes
    /// (row 0 is the dispatcher).
    pub(crate) fn new(path: PathBuf, capacity: usize, rows: Vec<String>) -> Self {
        TraceRecorder {
            path,
            capacity: capacity.max(1),
            spans: Mutex::new(VecDeque::new()),
            dropped: AtomicU64::new(0),
            epoch: Instant::now(),
            rows,
        }
    }

    pub(crate) fn record(&self, span: Span) {
        let mut spans = self.spans.lock().unwrap_or_else(|e| e.into_inner());
        if spans.len() >= self.capacity {
            spans.pop_front();
            self.dropped.fetch_add(1, Ordering::Relaxed);
        }
        spans.push_back(span);
    }

    fn micros(&self, t: Instant) -> f64 {
        t.saturating_duration_since(self.epoch).as_nanos() as f64 / 1000.0
    }

    /// Writes the trace to its file; returns the path and the number of spans written.
    pub(crate) fn save(&self) -> std::io::Result<(PathBuf, u64)> {
        let spans: Vec<Span> = self
            .spans
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .iter()
            .cloned()
            .collect();
        let mut events = Vec::with_capacity(spans.len() + self.rows.len() + 1);
        events.push(serde_json::json!({"ph": "M", "name": "process_name", "pid": 1, "tid": 0, "args": {"name": "agora daemon"}}));
        for (row, name) in self.rows.iter().enumerate() {
            events.push(
                serde_json::json!({"ph": "M", "name": "thread_name", "pid": 1, "tid": row, "args": {"name": name}}),
            );
            events.push(serde_json::json!({"ph": "M", "name": "thread_sort_index", "pid": 1, "tid": row, "args": {"sort_index": row}}));
        }
        for s in &spans {
            let ts = self.micros(s.start);
            events.push(serde_json::json!({
                "ph": "X", "name": s.name, "cat": s.category, "ts": ts, "dur": (self.micros(s.end) - ts).max(0.0),
                "pid": 1, "tid": s.row,
                "args": {"session": s.session, "tenant": &*s.tenant, "task": s.task, "queue": &*s.queue},
            }));
        }
        let doc = serde_json::json!({
            "traceEvents": events,
            "displayTimeUnit": "ms",
            "otherData": {"dropped_spans": self.dropped.load(Ordering::Relaxed), "capacity": self.capacity},
        });
        let tmp = self.path.with_extension("tmp");
        let mut file = std::io::BufWriter::new(std::fs::File::create(&tmp)?);
        serde_json::to_writer(&mut file, &doc)?;
        file.flush()?;
        drop(file);
        std::fs::rename(&tmp, &self.path)?;
        Ok((self.path.clone(), spans.len() as u64))
    }
}
