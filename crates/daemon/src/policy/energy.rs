//! `energy`: the least predicted energy among the lanes that finish in time.
//!
//! A task's energy on a lane is its predicted execution time times the extra watts a busy lane of
//! that device draws (idle power is paid whatever the choice, so it does not decide). "In time"
//! means a predicted finish (queue wait + transfers + execution) within `slack` times the
//! earliest predicted finish among the candidates: the task's slack. (Deadlines per queue come
//! with latency classes; until then the slack is the one bound.) Untried devices are tried first,
//! as in `perf`, so the model learns every device (but not with a task a measured device runs
//! within [`super::EXPLORE_WORTH_NS`]).

use super::{measured, untried, Candidate, Policy};

/// Least energy within the slack.
#[derive(Debug)]
pub struct Energy {
    /// A lane qualifies when its predicted finish is at most this times the earliest one.
    pub slack: f64,
}

impl Policy for Energy {
    fn name(&self) -> &'static str {
        "energy"
    }

    fn wants_predictions(&self) -> bool {
        true
    }

    fn choose(&mut self, _kernel: &str, candidates: &[Candidate]) -> Candidate {
        if let Some(c) = untried(candidates) {
            return c;
        }
        let earliest = measured(candidates)
            .map(|c| c.finish_ns(0.0))
            .fold(f64::INFINITY, f64::min);
        // A small absolute allowance keeps tiny tasks from being pinned by timer noise.
        let bound = earliest * self.slack + 20_000.0;
        *measured(candidates)
            .filter(|c| c.finish_ns(0.0) <= bound)
            .min_by(|a, b| {
                let ea = a.exec_ns.unwrap_or(0.0) * a.lane_watts;
                let eb = b.exec_ns.unwrap_or(0.0) * b.lane_watts;
                ea.total_cmp(&eb).then(a.finish_ns(0.0).total_cmp(&b.finish_ns(0.0)))
            })
            .expect("the earliest candidate always qualifies")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn c(device: usize, queue_ns: f64, exec_ns: f64, lane_watts: f64) -> Candidate {
        Candidate {
            queue_ns,
            exec_ns: Some(exec_ns),
            lane_watts,
            ..Candidate::with_load(device, 0, 0)
        }
    }

    #[test]
    fn picks_the_frugal_device_when_it_finishes_in_time() {
        let mut p = Energy { slack: 1.5 };
        // Device 0: 1 ms at 50 W = 50 mJ. Device 1: 1.4 ms at 10 W = 14 mJ, within 1.5x.
        let picked = p.choose("k", &[c(0, 0.0, 1e6, 50.0), c(1, 0.0, 1.4e6, 10.0)]);
        assert_eq!(picked.device, 1);
        // Device 1 busy for 1 ms more: it would finish at 2.4 ms > 1.5 ms, so device 0.
        let picked = p.choose("k", &[c(0, 0.0, 1e6, 50.0), c(1, 1e6, 1.4e6, 10.0)]);
        assert_eq!(picked.device, 0);
    }
}
