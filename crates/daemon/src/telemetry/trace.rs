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

    /// Whether the trace's file can be written: a scratch file beside it is created and
    /// removed (at start, so that a path that cannot work is refused then, not found out when
    /// the trace is lost at shutdown).
    pub(crate) fn check_writable(path: &std::path::Path) -> std::io::Result<()> {
        let scratch = path.with_extension("tmp");
        std::fs::File::create(&scratch)?;
        std::fs::remove_file(&scratch)
    }

    /// Writes the trace to its file; returns the path and the number of spans written. An
    /// error names the file.
    pub(crate) fn save(&self) -> std::io::Result<(PathBuf, u64)> {
        self.save_spans()
            .map_err(|e| std::io::Error::new(e.kind(), format!("{}: {e}", self.path.display())))
    }

    fn save_spans(&self) -> std::io::Result<(PathBuf, u64)> {
        // Copied without holding the lock that `record` takes on the dispatcher and the lanes
        // for every task: copying 500 000 spans under it stalled every tenant for 8-18 ms
        // (scripts/measure-control-loop.sh). The spans are taken out (O(1)), copied, and put
        // back in front of those recorded meanwhile.
        let mut kept = std::mem::take(&mut *self.spans.lock().unwrap_or_else(|e| e.into_inner()));
        let spans: Vec<Span> = kept.iter().cloned().collect();
        {
            let mut current = self.spans.lock().unwrap_or_else(|e| e.into_inner());
            let meanwhile = std::mem::take(&mut *current);
            kept.extend(meanwhile);
            let excess = kept.len().saturating_sub(self.capacity);
            kept.drain(..excess);
            self.dropped.fetch_add(excess as u64, Ordering::Relaxed);
            *current = kept;
        }
        crate::state_files::write_replacing(&self.path, |file| self.write_document(file, &spans))?;
        Ok((self.path.clone(), spans.len() as u64))
    }
}

impl TraceRecorder {
    /// The trace document, streamed: one small struct serialised per span. Building it as a
    /// `serde_json::Value` first (a map per span) took about 7 s for a full trace of 500 000
    /// spans at shutdown, longer than the daemon's shutdown timeout.
    fn write_document(&self, out: &mut impl Write, spans: &[Span]) -> std::io::Result<()> {
        out.write_all(b"{\"traceEvents\":[")?;
        serde_json::to_writer(
            &mut *out,
            &serde_json::json!({"ph": "M", "name": "process_name", "pid": 1, "tid": 0, "args": {"name": "agora daemon"}}),
        )?;
        for (row, name) in self.rows.iter().enumerate() {
            for event in [
                serde_json::json!({"ph": "M", "name": "thread_name", "pid": 1, "tid": row, "args": {"name": name}}),
                serde_json::json!({"ph": "M", "name": "thread_sort_index", "pid": 1, "tid": row, "args": {"sort_index": row}}),
            ] {
                out.write_all(b",")?;
                serde_json::to_writer(&mut *out, &event)?;
            }
        }
        for s in spans {
            let ts = self.micros(s.start);
            out.write_all(b",")?;
            serde_json::to_writer(
                &mut *out,
                &SpanEvent {
                    ph: "X",
                    name: s.name,
                    cat: s.category,
                    ts,
                    dur: (self.micros(s.end) - ts).max(0.0),
                    pid: 1,
                    tid: s.row,
                    args: SpanArgs {
                        session: s.session,
                        tenant: &s.tenant,
                        task: s.task,
                        queue: &s.queue,
                    },
                },
            )?;
        }
        out.write_all(b"],\"displayTimeUnit\":\"ms\",\"otherData\":")?;
        serde_json::to_writer(
            &mut *out,
            &serde_json::json!({"dropped_spans": self.dropped.load(Ordering::Relaxed), "capacity": self.capacity}),
        )?;
        out.write_all(b"}")
    }
}

/// One span as a Chrome trace event (`"ph": "X"`, a complete event).
#[derive(serde::Serialize)]
struct SpanEvent<'a> {
    ph: &'static str,
    name: &'static str,
    cat: &'static str,
    ts: f64,
    dur: f64,
    pid: u32,
    tid: u32,
    args: SpanArgs<'a>,
}

#[derive(serde::Serialize)]
struct SpanArgs<'a> {
    session: u64,
    tenant: &'a str,
    task: u64,
    queue: &'a str,
}

#[cfg(test)]
mod tests {
    use super::*;

    fn span(task: u64) -> Span {
        let now = Instant::now();
        Span {
            category: "exec",
            name: "noop",
            row: 1,
            start: now,
            end: now,
            session: 1,
            tenant: Arc::from("t"),
            task,
            queue: Arc::from("q"),
        }
    }

    fn tasks(recorder: &TraceRecorder) -> Vec<u64> {
        let spans = recorder.spans.lock().unwrap();
        spans.iter().map(|s| s.task).collect()
    }

    #[test]
    fn saving_keeps_every_span_and_those_recorded_meanwhile_in_order() {
        let dir = tempfile::tempdir().unwrap();
        let recorder = Arc::new(TraceRecorder::new(
            dir.path().join("t.json"),
            1000,
            vec!["inline".into()],
        ));
        for task in 0..600 {
            recorder.record(span(task));
        }
        // Spans recorded while a save copies: they follow the kept ones; the oldest go past
        // the capacity, counted as dropped.
        let recording = {
            let recorder = recorder.clone();
            std::thread::spawn(move || {
                for task in 600..1200 {
                    recorder.record(span(task));
                }
            })
        };
        let (_, written) = recorder.save().unwrap();
        recording.join().unwrap();
        assert!((600..=1000).contains(&written), "{written}");
        let kept = tasks(&recorder);
        assert_eq!(kept, (200..1200).collect::<Vec<_>>(), "the newest 1000, in order");
        assert_eq!(recorder.dropped.load(Ordering::Relaxed), 200);
        let text = std::fs::read_to_string(dir.path().join("t.json")).unwrap();
        let doc: serde_json::Value = serde_json::from_str(&text).unwrap();
        assert!(doc["traceEvents"].as_array().unwrap().len() as u64 >= written);
    }

    #[test]
    fn the_streamed_document_is_the_chrome_trace_format() {
        let dir = tempfile::tempdir().unwrap();
        let recorder = TraceRecorder::new(
            dir.path().join("t.json"),
            10,
            vec!["inline".into(), "cpu0/lane0".into()],
        );
        recorder.record(span(7));
        recorder.record(span(8));
        let (path, written) = recorder.save().unwrap();
        assert_eq!(written, 2);
        let doc: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
        let events = doc["traceEvents"].as_array().unwrap();
        // The process name, two metadata events per row, then the spans.
        assert_eq!(events.len(), 1 + 2 * 2 + 2);
        assert_eq!(events[1]["args"]["name"], "inline");
        assert_eq!(events[3]["args"]["name"], "cpu0/lane0");
        let last = &events[6];
        assert_eq!(last["ph"], "X");
        assert_eq!(last["name"], "noop");
        assert_eq!(last["cat"], "exec");
        assert_eq!(last["tid"], 1);
        assert_eq!(last["args"]["task"], 8);
        assert_eq!(last["args"]["tenant"], "t");
        assert_eq!(last["args"]["queue"], "q");
        assert!(last["ts"].as_f64().is_some() && last["dur"].as_f64().unwrap() >= 0.0);
        assert_eq!(doc["displayTimeUnit"], "ms");
        assert_eq!(doc["otherData"]["capacity"], 10);
        assert_eq!(doc["otherData"]["dropped_spans"], 0);
    }
}
