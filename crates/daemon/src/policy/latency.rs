//! Rules for latency-class work (TReM, chapter 4 of the thesis): which policy decides, how many
//! devices latency work reserves, whether a batch task may start, and whether revoking a running
//! batch task is worth it.
//!
//! These are pure functions over counts and times, so the daemon and the discrete-event
//! simulator (`agora sim`) run the same decisions. Today the simulator applies all of them; the
//! daemon applies latency-first lane order and chunked launch, and does not revoke yet.

use serde::{Deserialize, Serialize};

/// How latency-class work is protected.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum LatencyPolicy {
    /// Latency tasks are queued first, but nothing running is revoked.
    None,
    /// Latency tasks are queued first and revoke a running batch task when no device is free.
    Priority,
    /// TReM's Elastic: `U = ceil(l · q / SLA)` devices are reserved for latency work; batch work
    /// runs on the others and is revoked when latency work needs its reserve, unless the victim
    /// would finish sooner than the revocation takes or a device frees up within the slack.
    Elastic,
}

impl LatencyPolicy {
    /// Parses `none`, `priority` or `elastic`.
    pub fn parse(text: &str) -> Result<Self, String> {
        match text {
            "none" => Ok(LatencyPolicy::None),
            "priority" => Ok(LatencyPolicy::Priority),
            "elastic" => Ok(LatencyPolicy::Elastic),
            _ => Err(format!(
                "unknown latency policy '{text}': choose none, priority or elastic"
            )),
        }
    }

    /// The name used on the command line.
    pub fn name(self) -> &'static str {
        match self {
            LatencyPolicy::None => "none",
            LatencyPolicy::Priority => "priority",
            LatencyPolicy::Elastic => "elastic",
        }
    }
}

/// Devices to reserve for latency work: `ceil(l · q / SLA)`, with `l` the mean execution time of
/// a latency task, `q` the latency tasks outstanding (queued or running); at most `devices`.
pub fn reserved_devices(mean_latency_exec_s: f64, outstanding: usize, sla_s: f64, devices: usize) -> usize {
    if outstanding == 0 || sla_s <= 0.0 {
        return 0;
    }
    let u = (mean_latency_exec_s * outstanding as f64 / sla_s).ceil();
    (u.max(1.0) as usize).min(devices)
}

/// Whether a batch task may start on a free device, with `batch_running` batch tasks running.
/// Under `elastic`, batch work stays off the reserved devices; with no reserve (no recent latency
/// traffic) it takes every device. Letting batch work grow onto an idle reserve between requests
/// was measured in `agora sim` and rejected: revoking it when the next request came wasted 30–48%
/// of the devices' work with heavy-tailed batch tasks (Pareto α 1.5).
pub fn may_start_batch(policy: LatencyPolicy, batch_running: usize, devices: usize, reserved: usize) -> bool {
    match policy {
        LatencyPolicy::Elastic => batch_running < devices.saturating_sub(reserved),
        LatencyPolicy::None | LatencyPolicy::Priority => true,
    }
}

/// What a revocation decision looks at.
#[derive(Debug, Clone, Copy)]
pub struct RevokeContext {
    /// Latency tasks running now.
    pub latency_running: usize,
    /// Devices reserved for latency work.
    pub reserved: usize,
    /// The candidate victim's predicted remaining time.
    pub victim_remaining_s: f64,
    /// What a revocation costs (the device is unusable meanwhile).
    pub revoke_cost_s: f64,
    /// When some device will be free without revoking anything (the earliest predicted finish).
    pub earliest_free_s: f64,
    /// How long the waiting latency task can wait and still meet its request's SLA.
    pub slack_s: f64,
}

/// Whether a waiting latency task should revoke a running batch task.
///
/// `priority` always does. `elastic` (TReM) does only while latency work holds fewer devices than
/// its reserve and the victim would not finish before the revocation takes effect; and, since
/// every revocation wastes the victim's work, only when waiting for the earliest free device would
/// miss the SLA (the slack rule: Agora's addition to TReM).
pub fn should_revoke(policy: LatencyPolicy, c: &RevokeContext) -> bool {
    match policy {
        LatencyPolicy::None => false,
        LatencyPolicy::Priority => true,
        LatencyPolicy::Elastic => {
            c.latency_running < c.reserved && c.victim_remaining_s > c.revoke_cost_s && c.earliest_free_s > c.slack_s
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reservation_follows_trems_formula() {
        // 10 ms tasks, 30 outstanding, 200 ms SLA: ceil(0.01 * 30 / 0.2) = 2.
        assert_eq!(reserved_devices(0.010, 30, 0.2, 4), 2);
        assert_eq!(reserved_devices(0.010, 0, 0.2, 4), 0);
        assert_eq!(reserved_devices(0.010, 1, 0.2, 4), 1);
        assert_eq!(reserved_devices(1.0, 1000, 0.2, 4), 4);
    }

    #[test]
    fn elastic_shrinks_batch_and_spares_nearly_finished_victims() {
        assert!(may_start_batch(LatencyPolicy::Elastic, 1, 4, 2));
        assert!(!may_start_batch(LatencyPolicy::Elastic, 2, 4, 2));
        assert!(
            may_start_batch(LatencyPolicy::Elastic, 3, 4, 0),
            "no reserve: batch takes every device"
        );
        let c = RevokeContext {
            latency_running: 0,
            reserved: 1,
            victim_remaining_s: 0.5,
            revoke_cost_s: 0.022,
            earliest_free_s: 0.5,
            slack_s: 0.1,
        };
        assert!(should_revoke(LatencyPolicy::Elastic, &c));
        let nearly_done = RevokeContext {
            victim_remaining_s: 0.010,
            ..c
        };
        assert!(
            !should_revoke(LatencyPolicy::Elastic, &nearly_done),
            "it finishes before a revocation"
        );
        let reserve_in_use = RevokeContext {
            latency_running: 1,
            ..c
        };
        assert!(
            !should_revoke(LatencyPolicy::Elastic, &reserve_in_use),
            "its reserve is in use"
        );
        let can_wait = RevokeContext {
            earliest_free_s: 0.05,
            ..c
        };
        assert!(
            !should_revoke(LatencyPolicy::Elastic, &can_wait),
            "a device frees up in time"
        );
        assert!(!should_revoke(LatencyPolicy::None, &c));
        assert!(should_revoke(LatencyPolicy::Priority, &can_wait));
    }
}
