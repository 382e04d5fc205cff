//! Rules for latency-class work (TReM, chapter 4 of the thesis): which policy decides, how many
//! devices latency work reserves, whether a batch task may start, and whether revoking a running
//! batch task is worth it.
//!
//! These are pure functions over counts and times, so the daemon and the discrete-event
//! simulator (`agora sim`) run the same decisions. The simulator applies all of them. The daemon
//! (`scheduler.rs`) applies `reserved_devices` over lanes and `should_revoke` when it hands a
//! latency task to a lane whose revocable batch launch would delay it; it evaluates them at each
//! placement rather than on timers, and does not yet use `first_predicted_miss` (tasks waiting in
//! a lane's queue are summed) or `reserved_for_arrivals`.
//!
//! What the caller keeps and passes in (state the scheduler observes): `l`, a running mean of
//! latency tasks' execution times (TReM's `l_e`); the recent rate of arriving latency work; per
//! device, what runs there and since when; the waiting latency tasks and their requests'
//! deadlines; per batch task, how often it was revoked. The caller evaluates the rules at every
//! arrival and completion, every 100 ms (TReM), and at the [`next_check_in`] timer.

use serde::{Deserialize, Serialize};

/// How latency-class work is protected.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum LatencyPolicy {
    /// Latency tasks are queued first, but nothing running is revoked.
    None,
    /// Latency tasks are queued first and revoke a running batch task when no device is free.
    Priority,
    /// TReM's Elastic: devices are reserved for latency work (TReM's `U = ceil(l · q / SLA)`, or
    /// more for the latency work arriving); batch work runs on the others and is revoked only
    /// when a waiting request is predicted to miss its SLA otherwise (see [`should_revoke`]).
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

/// Above this utilisation of its reserve by arriving latency work, the reserve grows by a device.
/// Measured in `agora sim` (W1, load 2.0: latency work ≈ 0.6 of a device): with one reserved
/// device the requests queue behind one another, and meeting the SLA took 3× the revocations
/// and 3× the wasted work of two reserved devices.
pub const RESERVE_MAX_UTILISATION: f64 = 0.5;

/// Below this arriving latency work (device-seconds per second) the reserve lapses, so batch
/// work is not held off every device for ever after the latency traffic has stopped.
pub const RESERVE_LAPSE_WORK_PER_S: f64 = 0.005;

/// Devices to reserve for the latency work *arriving*: `ceil(w / RESERVE_MAX_UTILISATION)`, with
/// `w` the recent rate of arriving latency work (device-seconds per second, `l` times the
/// latency tasks arriving per second); at least one while latency traffic lasts (`w` above
/// [`RESERVE_LAPSE_WORK_PER_S`]), at most `devices`.
///
/// TReM's `U = ceil(l · q / SLA)` ([`reserved_devices`]) counts only the tasks outstanding now:
/// between requests it drops to 0, batch work takes every device, and the next request must
/// revoke one. Elastic reserves the larger of the two.
pub fn reserved_for_arrivals(latency_work_per_s: f64, devices: usize) -> usize {
    if latency_work_per_s < RESERVE_LAPSE_WORK_PER_S {
        return 0;
    }
    let u = (latency_work_per_s / RESERVE_MAX_UTILISATION).ceil();
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

/// A revocation may waste at most this many SLAs of the victim's work (1 s at a 200 ms SLA).
/// Measured in `agora sim`: without the cap, the few revocations of batch tasks seconds into
/// their run made most of the wasted work (W1, load 1.0: 1.4% median, 5.2% worst of 10 seeds);
/// with it 0.7% / 1.0%, for 0.05 points of SLA.
pub const MAX_WASTE_SLAS: f64 = 5.0;

/// A batch task revoked this many times is not revoked again: it runs to completion, however
/// late latency work gets (TReM's starvation guard, Sec. 4.5; the thesis leaves the threshold
/// open, and its cluster-level rebalancing is out of a node daemon's reach).
pub const MAX_REVOCATIONS_PER_TASK: u32 = 2;

/// What a revocation decision looks at.
#[derive(Debug, Clone, Copy)]
pub struct RevokeContext {
    /// Latency tasks running now.
    pub latency_running: usize,
    /// Devices reserved for latency work.
    pub reserved: usize,
    /// The candidate victim's predicted remaining time.
    pub victim_remaining_s: f64,
    /// How long the candidate victim has run: the work a revocation wastes.
    pub victim_elapsed_s: f64,
    /// How many times the candidate victim has been revoked already.
    pub victim_revocations: u32,
    /// The latency requests' SLA.
    pub sla_s: f64,
    /// What a revocation costs (the device is unusable meanwhile).
    pub revoke_cost_s: f64,
    /// When the waiting latency task at risk gets a device without revoking anything: the
    /// earliest free device, or, with several tasks waiting, the start [`first_predicted_miss`]
    /// plays out.
    pub earliest_free_s: f64,
    /// The latest start that still meets that task's request's SLA (its slack).
    pub slack_s: f64,
}

/// Whether a waiting latency task should revoke a running batch task.
///
/// `priority` always does. `elastic` revokes only when all of these hold:
/// * waiting for the predicted free device would miss the SLA (`earliest_free_s > slack_s`:
///   the slack rule, Agora's addition to TReM; every revocation wastes the victim's work);
/// * the revocation itself is quick enough to save the request (`revoke_cost_s ≤ slack_s`):
///   revoking for a request that misses anyway only wastes work;
/// * the victim would not finish before the revocation takes effect (TReM's remaining-time
///   check, read as "spare a task that is about to finish");
/// * the victim has run at most [`MAX_WASTE_SLAS`] SLAs (the caller offers the batch task that
///   has run the least, TReM's victim; one that has run longer is let finish);
/// * the victim has been revoked fewer than [`MAX_REVOCATIONS_PER_TASK`] times.
///
/// TReM also revokes only while latency work holds fewer devices than its reserve `U`. Measured in
/// `agora sim` (10 seeds, 300 s) once the slack rule sees the whole queue, that condition halved
/// the small wasted work but turned predicted misses into real ones (median SLA met W1 load 1.0:
/// 99.39% with it, 99.59% without; W2 load 2.0: 99.35% / 99.56%), so it is dropped;
/// `latency_running` and `reserved` stay in the context for the daemon's trace.
pub fn should_revoke(policy: LatencyPolicy, c: &RevokeContext) -> bool {
    match policy {
        LatencyPolicy::None => false,
        LatencyPolicy::Priority => true,
        LatencyPolicy::Elastic => {
            c.earliest_free_s > c.slack_s
                && c.revoke_cost_s <= c.slack_s
                && c.victim_remaining_s > c.revoke_cost_s
                && c.victim_elapsed_s <= MAX_WASTE_SLAS * c.sla_s
                && c.victim_revocations < MAX_REVOCATIONS_PER_TASK
        }
    }
}

/// A latency task waiting for a device, as the rules predict it.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct WaitingTask {
    /// Its predicted execution time.
    pub predicted_s: f64,
    /// Time left until its request's SLA runs out.
    pub deadline_in_s: f64,
}

/// A waiting latency task predicted to miss its SLA unless a device is freed for it.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct PredictedMiss {
    /// Its position in the waiting queue.
    pub index: usize,
    /// When it would start without revoking anything, from now.
    pub start_in_s: f64,
    /// The latest start that meets its SLA, from now.
    pub latest_start_in_s: f64,
}

/// Plays the waiting latency tasks, in queue order, onto the devices as they free up
/// (`free_in_s`: per device available to latency work, when it is free from now; 0 when idle)
/// and returns the first task that would start too late to meet its SLA but could still meet it
/// if a device were free at `rescue_in_s` (a revocation's cost). Requests that miss even then
/// are played out (they hold their device) but not returned: no revocation saves them.
///
/// This is TReM's `L = l · q` seen per task: `q` is the whole queue and each task's own deadline
/// counts, so a request behind a burst is seen before its slack is gone, and a device that frees
/// up in time is waited for instead of revoking one.
pub fn first_predicted_miss(free_in_s: &[f64], waiting: &[WaitingTask], rescue_in_s: f64) -> Option<PredictedMiss> {
    if free_in_s.is_empty() {
        return None;
    }
    let mut free: Vec<f64> = free_in_s.iter().map(|t| t.max(0.0)).collect();
    for (index, task) in waiting.iter().enumerate() {
        let (device, start) = free
            .iter()
            .copied()
            .enumerate()
            .min_by(|a, b| a.1.total_cmp(&b.1))
            .unwrap_or((0, 0.0));
        let latest = task.deadline_in_s - task.predicted_s;
        if start > latest && rescue_in_s <= latest {
            return Some(PredictedMiss {
                index,
                start_in_s: start,
                latest_start_in_s: latest,
            });
        }
        free[device] = start + task.predicted_s;
    }
    None
}

/// Timers closer than this are not set (a microsecond: far below any task or revocation time).
pub const CHECK_RESOLUTION_S: f64 = 1e-6;

/// When the rules must look again although nothing else happens: the first moment (from now) at
/// which a revocation would be just in time for a waiting task, if a device still is not free
/// for it by then. `None` when no waiting task can still be saved by a revocation.
///
/// Latency tasks' durations are predictions (a mean); one that runs past its prediction keeps
/// its device longer than the play-out assumed, and no completion comes to trigger a new
/// decision, so the daemon (and the simulator) sets a timer for this moment.
pub fn next_check_in(waiting: &[WaitingTask], rescue_in_s: f64) -> Option<f64> {
    waiting
        .iter()
        .map(|t| t.deadline_in_s - t.predicted_s - rescue_in_s)
        // A moment already here is the current decision's; a timer for it would fire at once
        // and decide the same again.
        .filter(|t| *t > CHECK_RESOLUTION_S)
        .min_by(f64::total_cmp)
}

/// The predicted remaining time of a running task predicted to take `predicted_s` that has run
/// `elapsed_s`. Past its prediction it is expected to run as long again as it has run so far,
/// not to end at once: with heavy-tailed durations a task that overran is likely a long one
/// (for Pareto durations of shape α the mean remaining time is `elapsed / (α − 1)`), and
/// assuming it frees its device now would hide the miss it causes.
pub fn predicted_remaining(predicted_s: f64, elapsed_s: f64) -> f64 {
    if elapsed_s < predicted_s {
        predicted_s - elapsed_s
    } else {
        elapsed_s
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
        // A request predicted to start at 150 ms, too late for its latest start at 100 ms.
        let c = RevokeContext {
            latency_running: 0,
            reserved: 1,
            victim_remaining_s: 0.5,
            victim_elapsed_s: 0.3,
            victim_revocations: 0,
            revoke_cost_s: 0.022,
            earliest_free_s: 0.15,
            slack_s: 0.1,
            sla_s: 0.2,
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

    #[test]
    fn elastic_does_not_waste_work_it_cannot_use() {
        let c = RevokeContext {
            latency_running: 1,
            reserved: 1,
            victim_remaining_s: 2.0,
            victim_elapsed_s: 0.3,
            victim_revocations: 0,
            revoke_cost_s: 0.022,
            earliest_free_s: 0.15,
            slack_s: 0.1,
            sla_s: 0.2,
        };
        assert!(
            should_revoke(LatencyPolicy::Elastic, &c),
            "the reserve being in use no longer blocks a revocation that saves a request"
        );
        let too_late = RevokeContext { slack_s: 0.01, ..c };
        assert!(
            !should_revoke(LatencyPolicy::Elastic, &too_late),
            "the revocation takes longer than the slack: the request misses anyway"
        );
        let long_run = RevokeContext {
            victim_elapsed_s: MAX_WASTE_SLAS * 0.2 + 0.01,
            ..c
        };
        assert!(!should_revoke(LatencyPolicy::Elastic, &long_run), "too much work lost");
        let starved = RevokeContext {
            victim_revocations: MAX_REVOCATIONS_PER_TASK,
            ..c
        };
        assert!(!should_revoke(LatencyPolicy::Elastic, &starved), "starvation guard");
        assert!(should_revoke(LatencyPolicy::Priority, &starved));
    }

    #[test]
    fn the_play_out_finds_the_request_behind_a_burst() {
        let task = |deadline_in_s| WaitingTask {
            predicted_s: 0.05,
            deadline_in_s,
        };
        // One device free in 10 ms, the other busy for 2 s: four 50 ms tasks run one after the
        // other; the fourth would start at 160 ms and end at 210 ms, past its 200 ms deadline.
        let burst = [task(0.2), task(0.2), task(0.2), task(0.2)];
        let miss = first_predicted_miss(&[0.01, 2.0], &burst, 0.022).unwrap();
        assert_eq!(miss.index, 3);
        assert!((miss.start_in_s - 0.16).abs() < 1e-9 && (miss.latest_start_in_s - 0.15).abs() < 1e-9);
        assert_eq!(first_predicted_miss(&[0.01, 2.0], &burst[..3], 0.022), None);
        // Two devices free: nobody waits long.
        assert_eq!(first_predicted_miss(&[0.0, 0.01], &burst, 0.022), None);
        // A task that misses even if a device were free after the revocation is not returned.
        let hopeless = [task(0.2), task(0.2), task(0.2), task(0.06)];
        assert_eq!(first_predicted_miss(&[0.01, 2.0], &hopeless, 0.022), None);
        assert_eq!(first_predicted_miss(&[], &burst, 0.022), None);
    }

    #[test]
    fn timers_and_predictions_for_tasks_that_overrun() {
        let waiting = [
            WaitingTask {
                predicted_s: 0.02,
                deadline_in_s: 0.2,
            },
            WaitingTask {
                predicted_s: 0.02,
                deadline_in_s: 0.1,
            },
        ];
        let at = next_check_in(&waiting, 0.022).unwrap();
        assert!((at - 0.058).abs() < 1e-9, "{at}");
        let past = [WaitingTask {
            predicted_s: 0.02,
            deadline_in_s: 0.03,
        }];
        assert_eq!(next_check_in(&past, 0.022), None, "no timer for a moment already here");
        assert!((predicted_remaining(0.02, 0.005) - 0.015).abs() < 1e-12);
        assert_eq!(
            predicted_remaining(0.02, 0.1),
            0.1,
            "an overrun task runs as long again"
        );
    }

    #[test]
    fn the_reserve_follows_arriving_latency_work_and_lapses() {
        assert_eq!(reserved_for_arrivals(0.0, 4), 0);
        assert_eq!(reserved_for_arrivals(RESERVE_LAPSE_WORK_PER_S / 2.0, 4), 0);
        assert_eq!(reserved_for_arrivals(0.01, 4), 1, "any traffic keeps one device");
        assert_eq!(reserved_for_arrivals(0.3, 4), 1);
        assert_eq!(reserved_for_arrivals(0.6, 4), 2, "0.6 devices of work at most 50% busy");
        assert_eq!(reserved_for_arrivals(10.0, 4), 4);
    }
}
