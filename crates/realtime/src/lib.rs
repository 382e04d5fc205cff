//! Periodic real-time task graphs for Agora: the pure logic behind EDF/APEDF admission and
//! placement of DAGs onto lanes (issue #16, after the AMPERE project's APEDF and RTDAG).
//!
//! Owns, in pipeline order, each stage with its own types and errors:
//! - [`model`]: a [`DagSpec`] as declared, validated into a [`ValidatedDag`] with a topological
//!   order, critical path and per-node release offsets and deadlines (deadline splitting);
//! - [`edf`]: the one-lane EDF test (density, then processor demand with QPA);
//! - [`admission`]: partitioning DAG nodes onto identical lanes, first-fit or worst-fit, with
//!   incremental admit/remove and refusals that say what would have fit;
//! - [`simulate`](mod@simulate): a deterministic discrete-event simulator of FIFO, global EDF and APEDF on
//!   those lanes, with chunked preemption and injected overruns;
//! - [`generate`](mod@generate), [`rtdag`], [`sweep`](mod@sweep): seeded synthetic sets, RTDAG's YAML files, and the
//!   utilisation sweep behind `agora bench rt`.
//!
//! It must not know about devices, sessions, sockets or the daemon: times are integer
//! microseconds, lanes are identical and abstract, and nothing here blocks or spawns. The
//! daemon turns lanes into device queues and launches into chunks; this crate tells it what fits
//! and what a policy would do.
//!
//! The guarantee tying the stages together, checked by a property test: every set that
//! [`Admission`] admits meets every deadline in the simulator under APEDF, fully preemptive,
//! whenever jobs run no longer than their WCET.

#![forbid(unsafe_code)]

pub mod admission;
pub mod edf;
pub mod generate;
mod graph;
pub mod model;
pub mod rtdag;
pub mod simulate;
mod split;
pub mod sweep;
mod units;

pub use admission::{
    best_effort_placement, first_fit_utilisation_bound, inflated_wcet, Admission, AdmissionConfig, AdmissionDecision,
    AdmissionError, AdmissionRefused, AdmittedDag, ConfigError, DagId, Packing,
};
pub use generate::{generate, GenerateError, GeneratedSet, GeneratorConfig};
pub use model::{CriticalPath, DagError, DagLimits, DagSpec, NodeSpec, NodeTiming, ValidatedDag};
pub use rtdag::RtdagError;
pub use simulate::{
    simulate, ExecutionTimeModel, OverrunInjection, Policy, SimulationConfig, SimulationError, SimulationReport,
    Workload,
};
pub use sweep::{sweep, BenchSummary, SweepConfig, SweepError, SweepReport};
