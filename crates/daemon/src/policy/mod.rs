//! Scheduling policies: given a ready task that is not bound to a lane, pick a device and lane.
//!
//! A policy sees only what the scheduler shows it ([`Candidate`]s: devices that implement the
//! kernel, with per-lane load), so everything it decides on is observable and testable.

mod round_robin;

pub use round_robin::RoundRobin;

/// One lane a task could go to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Candidate {
    /// Device index in the daemon's device list.
    pub device: usize,
    /// Lane index on that device.
    pub lane: usize,
    /// Jobs queued or running on the lane.
    pub load: usize,
}

/// A placement policy.
pub trait Policy: Send {
    /// Name shown by `agora status`.
    fn name(&self) -> &'static str;
    /// Picks one of `candidates` (never empty) for a task of kernel `kernel`.
    fn choose(&mut self, kernel: &str, candidates: &[Candidate]) -> Candidate;
}
