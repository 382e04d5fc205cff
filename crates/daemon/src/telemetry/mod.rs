//! Telemetry: Prometheus metrics, task traces and RAPL energy counters.
//!
//! Components count for themselves and publish here: the scheduler counts tasks, transfers and
//! time spans as jobs complete; device gauges (lane busy time, memory) are read from the devices
//! when `/metrics` is scraped, so an unscraped daemon pays nothing for them. Tracing is off unless
//! `--trace FILE` is given; spans then go to a bounded ring, so a long run cannot exhaust memory.
//!
//! Must not block the dispatcher: counters are atomics and handles are cached by the scheduler;
//! the HTTP server runs on its own thread.

mod metrics;
pub mod rapl;
mod trace;

pub(crate) use metrics::{serve as serve_metrics, DagMetrics, Metrics, TaskCounters, STALL_NS};
pub(crate) use trace::{Span, TraceRecorder};

/// Everything telemetry, shared by the dispatcher, lane callbacks and the metrics thread.
pub(crate) struct Telemetry {
    pub metrics: Metrics,
    pub trace: Option<TraceRecorder>,
}
