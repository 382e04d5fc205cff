//! `rr`: Arax's default. Rotate over the lanes that implement the kernel, preferring idle ones.

use super::{Candidate, Policy};

/// Round-robin over the least-loaded candidates.
#[derive(Debug, Default)]
pub struct RoundRobin {
    next: usize,
}

impl Policy for RoundRobin {
    fn name(&self) -> &'static str {
        "rr"
    }

    fn choose(&mut self, _kernel: &str, candidates: &[Candidate]) -> Candidate {
        let least = candidates.iter().map(|c| c.load).min().unwrap_or(0);
        let n = candidates.len();
        for step in 0..n {
            let c = candidates[(self.next + step) % n];
            if c.load == least {
                self.next = (self.next + step + 1) % n;
                return c;
            }
        }
        candidates[0]
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn c(lane: usize, load: usize) -> Candidate {
        Candidate::with_load(0, lane, load)
    }

    #[test]
    fn rotates_over_idle_lanes_and_avoids_busy_ones() {
        let mut p = RoundRobin::default();
        let all_idle = [c(0, 0), c(1, 0), c(2, 0)];
        let picks: Vec<usize> = (0..6).map(|_| p.choose("k", &all_idle).lane).collect();
        assert_eq!(picks, vec![0, 1, 2, 0, 1, 2]);
        let busy = [c(0, 3), c(1, 0), c(2, 5)];
        for _ in 0..4 {
            assert_eq!(p.choose("k", &busy).lane, 1);
        }
    }
}
