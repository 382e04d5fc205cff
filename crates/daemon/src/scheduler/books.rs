//! The latency books: what the scheduler knows of latency-class work in flight, per lane and in
//! all, and of the revocable batch launch running on each lane (its victim).
//!
//! Owns: urgent (latency-class) work predicted per lane, TReM's `q` (latency tasks in flight)
//! and `l` (their smoothed execution time), and the victim slots. A [`LatencyCharge`] is taken
//! when a latency task goes to a lane and settled when it finishes.
//!
//! Must not: decide anything. Placement and the revocation choice read these books
//! (`place`); only lane completions and dispatch write them.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use agora_devices::Device;

use crate::revocation::{Victim, VictimSlot};

/// See the module documentation.
pub(super) struct LatencyBooks {
    /// Per device and lane: predicted nanoseconds of latency-class work queued or running.
    lane_urgent: Vec<Vec<Arc<AtomicU64>>>,
    /// Latency-class tasks in flight (TReM's `q`).
    outstanding: Arc<AtomicU64>,
    /// Smoothed execution time of latency-class tasks (TReM's `l`), nanoseconds as `f64` bits.
    exec_ns: Arc<AtomicU64>,
    /// Per device and lane: the revocable launch running there.
    victims: Vec<Vec<VictimSlot>>,
}

impl LatencyBooks {
    /// Empty books for `devices`.
    pub(super) fn new(devices: &[Arc<dyn Device>]) -> Self {
        LatencyBooks {
            lane_urgent: devices
                .iter()
                .map(|d| (0..d.info().lanes).map(|_| Arc::new(AtomicU64::new(0))).collect())
                .collect(),
            outstanding: Arc::new(AtomicU64::new(0)),
            exec_ns: Arc::new(AtomicU64::new(0f64.to_bits())),
            victims: devices
                .iter()
                .map(|d| (0..d.info().lanes).map(|_| VictimSlot::default()).collect())
                .collect(),
        }
    }

    /// Predicted nanoseconds of latency-class work queued or running on `lane` of `device`.
    pub(super) fn urgent_ns(&self, device: usize, lane: usize) -> u64 {
        self.lane_urgent[device][lane].load(Ordering::Relaxed)
    }

    /// Lanes with latency-class work queued or running.
    pub(super) fn lanes_with_urgent_work(&self) -> usize {
        self.lane_urgent
            .iter()
            .flatten()
            .filter(|u| u.load(Ordering::Relaxed) > 0)
            .count()
    }

    /// TReM's `q`: latency-class tasks in flight.
    pub(super) fn outstanding(&self) -> usize {
        self.outstanding.load(Ordering::Relaxed) as usize
    }

    /// TReM's `l`: the smoothed execution time of latency-class tasks, seconds.
    pub(super) fn execution_s(&self) -> f64 {
        f64::from_bits(self.exec_ns.load(Ordering::Relaxed)) / 1e9
    }

    /// The slot where the revocable launch running on `lane` of `device` is published.
    pub(super) fn victim_slot(&self, device: usize, lane: usize) -> &VictimSlot {
        &self.victims[device][lane]
    }

    /// The revocable launch running on `lane` of `device`, if any.
    pub(super) fn victim(&self, device: usize, lane: usize) -> Option<Victim> {
        self.victims[device][lane]
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }

    /// Books a latency task of `predicted_ns` handed to `lane` of `device`.
    pub(super) fn charge(&self, device: usize, lane: usize, predicted_ns: u64) -> LatencyCharge {
        let lane_urgent = self.lane_urgent[device][lane].clone();
        lane_urgent.fetch_add(predicted_ns, Ordering::Relaxed);
        self.outstanding.fetch_add(1, Ordering::Relaxed);
        LatencyCharge {
            lane_urgent,
            outstanding: self.outstanding.clone(),
            exec_ns: self.exec_ns.clone(),
            predicted_ns,
        }
    }
}

/// One latency task's entry in the books, settled when it finishes.
pub(super) struct LatencyCharge {
    lane_urgent: Arc<AtomicU64>,
    outstanding: Arc<AtomicU64>,
    exec_ns: Arc<AtomicU64>,
    predicted_ns: u64,
}

impl LatencyCharge {
    /// The task finished after executing for `execution`.
    pub(super) fn settle(self, execution: Duration) {
        self.lane_urgent.fetch_sub(self.predicted_ns, Ordering::Relaxed);
        self.outstanding.fetch_sub(1, Ordering::Relaxed);
        let ns = execution.as_nanos() as f64;
        // Smoothed like the performance model (4:1); racing updates lose one sample.
        let old = f64::from_bits(self.exec_ns.load(Ordering::Relaxed));
        let new = if old == 0.0 { ns } else { 0.8 * old + 0.2 * ns };
        self.exec_ns.store(new.to_bits(), Ordering::Relaxed);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use agora_devices::sim::{SimDevice, SimSpec};

    #[test]
    fn a_charge_books_the_lane_and_the_totals_until_it_settles() {
        let devices: Vec<Arc<dyn Device>> = vec![Arc::new(SimDevice::new(SimSpec::default()).unwrap())];
        let books = LatencyBooks::new(&devices);
        let charge = books.charge(0, 1, 5_000);
        assert_eq!(books.urgent_ns(0, 1), 5_000);
        assert_eq!(books.urgent_ns(0, 0), 0);
        assert_eq!(books.outstanding(), 1);
        assert_eq!(books.lanes_with_urgent_work(), 1);
        charge.settle(Duration::from_micros(10));
        assert_eq!(books.urgent_ns(0, 1), 0);
        assert_eq!(books.outstanding(), 0);
        assert!((books.execution_s() - 10e-6).abs() < 1e-12);
        books.charge(0, 0, 1).settle(Duration::from_micros(20));
        // 4:1 smoothing.
        assert!((books.execution_s() - 12e-6).abs() < 1e-12);
    }
}
