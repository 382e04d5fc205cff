//! `perf`: least expected completion time, like StarPU's `dmda`.
//!
//! For each candidate lane: the work already queued on it, plus the time to move the data the
//! task lacks on that device, plus the task's predicted execution time there (learned, see
//! [`model`](super::model)). A device never measured for the kernel is tried first, once per
//! size bucket (the scheduler withholds the "untried" mark while a first measurement is on its
//! way, so one exploring task does not drag every other one along; the exploring task's queue
//! holds its later launches until the measurement comes, so a stream does not follow it) —
//! unless a measured device finishes the task within [`super::EXPLORE_WORTH_NS`]: no device is
//! explored for a task that short.

use super::{measured, untried, Candidate, Policy};

/// Least expected completion time.
#[derive(Debug, Default)]
pub struct Perf;

impl Policy for Perf {
    fn name(&self) -> &'static str {
        "perf"
    }

    fn wants_predictions(&self) -> bool {
        true
    }

    fn choose(&mut self, _kernel: &str, candidates: &[Candidate]) -> Candidate {
        if let Some(c) = untried(candidates) {
            return c;
        }
        *measured(candidates)
            .min_by(|a, b| a.finish_ns(0.0).total_cmp(&b.finish_ns(0.0)).then(a.load.cmp(&b.load)))
            .expect("without an untried device to explore, some candidate is measured")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn c(device: usize, lane: usize, queue_ns: f64, transfer_ns: f64, exec_ns: Option<f64>) -> Candidate {
        Candidate {
            queue_ns,
            transfer_ns,
            exec_ns,
            ..Candidate::with_load(device, lane, 0)
        }
    }

    #[test]
    fn picks_the_earliest_finish_counting_wait_and_transfers() {
        let mut p = Perf;
        // Device 1 computes 4x faster but its lane is busy for longer than that saves.
        let picked = p.choose("k", &[c(0, 0, 0.0, 0.0, Some(100.0)), c(1, 0, 200.0, 0.0, Some(25.0))]);
        assert_eq!(picked.device, 0);
        // Idle: the fast device wins even with a transfer.
        let picked = p.choose("k", &[c(0, 0, 0.0, 0.0, Some(100.0)), c(1, 0, 0.0, 50.0, Some(25.0))]);
        assert_eq!(picked.device, 1);
    }

    #[test]
    fn tries_an_unmeasured_device_first_unless_a_measured_one_is_quick() {
        let mut p = Perf;
        let picked = p.choose("k", &[c(0, 0, 0.0, 0.0, Some(200_000.0)), c(1, 0, 1e9, 0.0, None)]);
        assert_eq!(picked.device, 1, "a task of 200 µs is worth exploring with");
        // 1 µs where it was measured: no device is explored for it (its queue would stay there
        // while busy), and the untried one is never picked as if it cost nothing.
        let picked = p.choose("k", &[c(0, 0, 0.0, 0.0, Some(1_000.0)), c(1, 0, 0.0, 0.0, None)]);
        assert_eq!(picked.device, 0);
        // Nothing measured: explore.
        let picked = p.choose("k", &[c(0, 0, 5.0, 0.0, None), c(1, 0, 0.0, 0.0, None)]);
        assert_eq!(
            picked.device, 0,
            "the least loaded untried lane (both at load 0: the first)"
        );
    }
}
