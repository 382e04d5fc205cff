//! Scheduling policies: given a ready task that is not bound to a lane, pick a device and lane.
//!
//! A policy sees only what the scheduler shows it ([`Candidate`]s: lanes of devices that implement
//! the kernel, with their load and, for policies that ask, the predicted queue wait, transfer and
//! execution times and the lane's power), so everything it decides on is observable and testable.
//! Like StarPU's schedulers, policies are interchangeable behind [`Policy`]; the daemon's
//! configuration picks one (`scheduler.policy = "rr" | "perf" | "energy"`).
//!
//! Must not touch devices, memory or sessions.

mod energy;
pub mod latency;
pub mod model;
mod perf;
mod round_robin;

pub use energy::Energy;
pub use model::{ModelLoadError, PerformanceModel};
pub use perf::Perf;
pub use round_robin::RoundRobin;

/// One lane a task could go to.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Candidate {
    /// Device index in the daemon's device list.
    pub device: usize,
    /// Lane index on that device.
    pub lane: usize,
    /// Jobs queued or running on the lane.
    pub load: usize,
    /// Predicted nanoseconds before the task would start on the lane: its session's own work
    /// queued or running there, plus about one job of each other tenant's (lanes serve tenants
    /// fairly; `scheduler::tenants`), never more than all the lane holds.
    pub queue_ns: f64,
    /// Predicted nanoseconds to move the data this task lacks on the device.
    pub transfer_ns: f64,
    /// Predicted execution nanoseconds on the device; `None`: never measured there (untried).
    pub exec_ns: Option<f64>,
    /// Extra watts the device draws while this lane is busy.
    pub lane_watts: f64,
}

impl Candidate {
    /// A candidate with only a load (for policies that need nothing else, and tests).
    pub fn with_load(device: usize, lane: usize, load: usize) -> Self {
        Candidate {
            device,
            lane,
            load,
            queue_ns: 0.0,
            transfer_ns: 0.0,
            exec_ns: None,
            lane_watts: 0.0,
        }
    }

    /// Predicted finish from now, nanoseconds, using `fallback_ns` for an untried device.
    pub fn finish_ns(&self, fallback_ns: f64) -> f64 {
        self.queue_ns + self.transfer_ns + self.exec_ns.unwrap_or(fallback_ns)
    }
}

/// A placement policy.
pub trait Policy: Send {
    /// Name shown by `agora status`.
    fn name(&self) -> &'static str;
    /// Whether the scheduler should fill in the predictions of each [`Candidate`] (costs a model
    /// lookup per candidate).
    fn wants_predictions(&self) -> bool {
        false
    }
    /// Picks one of `candidates` (never empty; each implements the kernel) for a task of kernel
    /// `kernel` (`"transfer"` for data movements).
    fn choose(&mut self, kernel: &str, candidates: &[Candidate]) -> Candidate;
}

/// Below this predicted finish on a device already measured, no untried device is explored:
/// an accelerator behind a device host takes 40–55 µs for an empty kernel here (`agora bench
/// latency`), so it cannot win back a task this short, and the queue that explores it stays
/// there while it is busy (a pipelined stream of tiny kernels ran 20–30× slower, all on the
/// explored device). Twice that hand-off.
pub const EXPLORE_WORTH_NS: f64 = 100_000.0;

/// The first untried device among `candidates` (tried-first exploration), least loaded lane —
/// unless exploring is not worth it: a measured candidate would finish within
/// [`EXPLORE_WORTH_NS`]. `None` leaves the choice among the measured candidates ([`measured`]).
fn untried(candidates: &[Candidate]) -> Option<Candidate> {
    let best_known = measured(candidates)
        .map(|c| c.finish_ns(0.0))
        .fold(f64::INFINITY, f64::min);
    if best_known < EXPLORE_WORTH_NS {
        return None;
    }
    candidates
        .iter()
        .filter(|c| c.exec_ns.is_none())
        .min_by_key(|c| c.load)
        .copied()
}

/// The candidates with a predicted execution time: all of them once [`untried`] said `None`
/// (then either every candidate is measured or some measured one is short).
fn measured(candidates: &[Candidate]) -> impl Iterator<Item = &Candidate> {
    candidates.iter().filter(|c| c.exec_ns.is_some())
}

/// The policy named `kind`, with the configuration's parameters.
pub fn build(kind: crate::config::PolicyKind, config: &crate::config::DaemonConfig) -> Box<dyn Policy> {
    match kind {
        crate::config::PolicyKind::Rr => Box::new(RoundRobin::default()),
        crate::config::PolicyKind::Perf => Box::new(Perf),
        crate::config::PolicyKind::Energy => Box::new(Energy {
            slack: config.energy_slack,
        }),
    }
}
