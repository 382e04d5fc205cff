//! Who has work on each lane: per session, its jobs and their predicted nanoseconds, so that
//! placement can predict how long a newcomer waits there.
//!
//! A lane serves its batch tenants fairly (start-time fair queueing, `agora_devices::Share`):
//! a session's next job waits for about one job of each other tenant with work there, not for
//! their whole backlog. Placement that costed a lane by everything queued on it sent a queue
//! whose neighbours had pipelined deep backlogs onto an idle device predicted seven times
//! slower, and a pipelined queue then followed its first task there whole (four identical ranks
//! measured 190 / 100 / 7.7 / 7.5 sgemm launches per second).
//!
//! Owns: the per-lane books ([`LaneTenants`]); a job is booked when it goes to a lane
//! (`submit`) and settled when it finishes (`complete`). Must not: decide anything; `place`
//! reads [`LaneTenants::wait_ns`].

use std::collections::HashMap;
use std::sync::Mutex;

/// One lane's tenants. The lock is taken by the dispatcher when it books a job or places a
/// queue, and by the lane's thread when a job finishes: never held across anything else.
#[derive(Debug, Default)]
pub(super) struct LaneTenants(Mutex<TenantBook>);

#[derive(Debug, Default)]
struct TenantBook {
    /// Session → (jobs, predicted nanoseconds) it has queued or running on the lane.
    sessions: HashMap<u64, (u64, u64)>,
    jobs: u64,
    ns: u64,
}

impl LaneTenants {
    fn book(&self) -> std::sync::MutexGuard<'_, TenantBook> {
        self.0.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// A job of `session` predicted `ns` went to the lane.
    pub(super) fn started(&self, session: u64, ns: u64) {
        let mut book = self.book();
        let entry = book.sessions.entry(session).or_default();
        entry.0 += 1;
        entry.1 = entry.1.saturating_add(ns);
        book.jobs += 1;
        book.ns = book.ns.saturating_add(ns);
    }

    /// That job finished.
    pub(super) fn finished(&self, session: u64, ns: u64) {
        let mut book = self.book();
        if let Some(entry) = book.sessions.get_mut(&session) {
            entry.0 = entry.0.saturating_sub(1);
            entry.1 = entry.1.saturating_sub(ns);
            if entry.0 == 0 {
                book.sessions.remove(&session);
            }
        }
        book.jobs = book.jobs.saturating_sub(1);
        book.ns = book.ns.saturating_sub(ns);
    }

    /// Predicted nanoseconds before a new job of `session` would start on the lane: its own
    /// work there (a tenant's jobs run in order), plus about one job of each other tenant
    /// (their average, never more than all they have queued). `None` when nothing is booked:
    /// the caller then uses the lane's total, which covers work booked before these books.
    pub(super) fn wait_ns(&self, session: u64) -> Option<f64> {
        let book = self.book();
        if book.jobs == 0 {
            return None;
        }
        let (own_jobs, own_ns) = book.sessions.get(&session).copied().unwrap_or_default();
        let others = book.sessions.len() as u64 - u64::from(own_jobs > 0);
        let other_jobs = book.jobs.saturating_sub(own_jobs);
        let other_ns = book.ns.saturating_sub(own_ns) as f64;
        let heads = if other_jobs == 0 {
            0.0
        } else {
            (others as f64 * other_ns / other_jobs as f64).min(other_ns)
        };
        Some(own_ns as f64 + heads)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_newcomer_waits_for_one_job_of_each_other_tenant_and_all_of_its_own() {
        let lane = LaneTenants::default();
        assert_eq!(
            lane.wait_ns(1),
            None,
            "nothing booked: the caller uses the lane's total"
        );
        // Session 2 pipelined 30 jobs of 5 ms, session 3 one job of 20 ms.
        for _ in 0..30 {
            lane.started(2, 5_000_000);
        }
        lane.started(3, 20_000_000);
        // A newcomer: two other tenants, an average job of 170 ms / 31.
        let newcomer = lane.wait_ns(1).unwrap();
        assert!((newcomer - 2.0 * 170e6 / 31.0).abs() < 1.0, "{newcomer}");
        assert!(newcomer < 20e6, "far less than the 170 ms queued");
        // Session 3 itself: its own 20 ms plus one of session 2's jobs.
        assert_eq!(lane.wait_ns(3).unwrap(), 20e6 + 5e6);
        // A lone tenant waits for all of its own work.
        lane.finished(3, 20_000_000);
        assert_eq!(lane.wait_ns(2).unwrap(), 150e6);
        assert_eq!(lane.wait_ns(1).unwrap(), 5e6);
        for _ in 0..30 {
            lane.finished(2, 5_000_000);
        }
        assert_eq!(lane.wait_ns(1), None);
    }
}
