//! Deadlines that tell a stuck peer from a paused self.
//!
//! Owns the rule by which a thread that waits for another process (a client for its daemon's
//! answer, the daemon for a sandboxed executor's) decides the other is stuck. It does not wait
//! itself: callers block their own way (poll, sleep) for at most [`Deadline::next_wait`] and
//! report each wait with [`Deadline::waited`].
//!
//! Why not a plain `Instant`: a limit exists to catch a peer that does not work, but wall-clock
//! time also passes while *this* process does not run — a virtual machine paused by its
//! hypervisor (seen on the CI machines: 31–53 s, `BUG: workqueue lockup` in `dmesg`), a process
//! stopped with SIGSTOP or by a debugger, a thread starved for seconds. On resuming, every limit
//! that covered the pause would have passed at once and the peer, which was paused too, be taken
//! for stuck. So waits are sliced ([`WAIT_SLICE`] at most), and a wait that returns well after
//! it was due ([`LATE_WAKE`]) shows time this process could not have been waiting for anything:
//! the deadline moves by that much. A peer that is really stuck still meets the limit: while
//! this process runs, its waits end on time and nothing is forgiven.

use std::time::{Duration, Instant};

/// The longest one wait may block before its caller reports it, so a pause is noticed within
/// about this much of running time.
pub const WAIT_SLICE: Duration = Duration::from_secs(1);

/// A wait that ended at least this much after it was due shows that this process did not run
/// for that time: no timer on a running Linux machine fires a second late.
pub const LATE_WAKE: Duration = Duration::from_secs(1);

/// A point in time by which a peer must have answered, leaving out the time this process did not
/// run (see the module documentation).
#[derive(Debug, Clone, Copy)]
pub struct Deadline {
    at: Instant,
    forgiven: Duration,
}

impl Deadline {
    /// A deadline `limit` from now.
    pub fn after(limit: Duration) -> Deadline {
        Deadline::at(Instant::now() + limit)
    }

    /// A deadline at `at`.
    pub fn at(at: Instant) -> Deadline {
        Deadline {
            at,
            forgiven: Duration::ZERO,
        }
    }

    /// How long the next wait may block: what is left, at most [`WAIT_SLICE`]; `None` once the
    /// deadline has passed.
    pub fn next_wait(&self) -> Option<Duration> {
        let left = self.at.saturating_duration_since(Instant::now());
        (!left.is_zero()).then(|| left.min(WAIT_SLICE))
    }

    /// What is left until the deadline (zero once it has passed), for a caller that hands the
    /// rest of the limit on to a wait that is patient itself.
    pub fn left(&self) -> Duration {
        self.at.saturating_duration_since(Instant::now())
    }

    /// Whether the deadline has passed.
    pub fn passed(&self) -> bool {
        self.next_wait().is_none()
    }

    /// Reports a wait that began at `began` and was to block at most `asked`: when it returned
    /// [`LATE_WAKE`] or more after it was due, that lateness is time this process did not run,
    /// and the deadline moves by it. Returns the lateness forgiven (zero for a wait on time).
    pub fn waited(&mut self, began: Instant, asked: Duration) -> Duration {
        let late = began.elapsed().saturating_sub(asked);
        if late < LATE_WAKE {
            return Duration::ZERO;
        }
        self.at += late;
        self.forgiven += late;
        late
    }

    /// All the time forgiven so far (for messages and tests).
    pub fn forgiven(&self) -> Duration {
        self.forgiven
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn waits_are_sliced_and_end_at_the_deadline() {
        let long = Deadline::after(Duration::from_secs(30));
        assert_eq!(long.next_wait(), Some(WAIT_SLICE));
        let short = Deadline::after(Duration::from_millis(50));
        assert!(short.next_wait().is_some_and(|w| w <= Duration::from_millis(50)));
        let past = Deadline::at(Instant::now() - Duration::from_millis(1));
        assert!(past.passed());
        assert_eq!(past.next_wait(), None);
    }

    #[test]
    fn a_wait_on_time_forgives_nothing() {
        let mut deadline = Deadline::after(Duration::from_millis(20));
        let began = Instant::now();
        let asked = deadline.next_wait().unwrap();
        std::thread::sleep(asked);
        assert_eq!(deadline.waited(began, asked), Duration::ZERO);
        assert!(
            deadline.passed(),
            "the limit still holds for a peer that does not answer"
        );
        assert_eq!(deadline.forgiven(), Duration::ZERO);
    }

    #[test]
    fn a_wait_that_returned_seconds_late_moves_the_deadline_by_its_lateness() {
        // As after a pause: a wait of at most 1 s that began 4 s ago and has just returned.
        let mut deadline = Deadline::after(Duration::from_secs(2));
        let began = Instant::now() - Duration::from_secs(4);
        let forgiven = deadline.waited(began, Duration::from_secs(1));
        assert!(forgiven >= Duration::from_secs(3), "{forgiven:?}");
        assert!(forgiven < Duration::from_secs(4), "{forgiven:?}");
        assert_eq!(deadline.forgiven(), forgiven);
        // The 3 s forgiven are added to the 2 s limit: the wait does not end at once.
        let left = deadline.left();
        assert!(
            left > Duration::from_millis(4_500) && left <= Duration::from_secs(5),
            "{left:?}"
        );
        // A second late wait adds up.
        let again = deadline.waited(Instant::now() - Duration::from_secs(3), Duration::from_millis(500));
        assert!(deadline.forgiven() >= forgiven + again && again >= Duration::from_millis(2_500));
    }

    #[test]
    fn lateness_under_a_second_is_not_forgiven() {
        let mut deadline = Deadline::after(Duration::from_secs(2));
        let began = Instant::now() - Duration::from_millis(1_500);
        assert_eq!(deadline.waited(began, Duration::from_millis(600)), Duration::ZERO);
    }
}
