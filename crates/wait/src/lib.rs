//! How Agora's threads wait for an event that is probably near: spin for a learned budget, then
//! let the caller block.
//!
//! Owns the spinning half of every wait on the task path (a client waiting for its completion, the
//! dispatcher waiting for submissions, a lane waiting for its next job). It knows nothing of what
//! is awaited nor how to block: callers pass a readiness check and block on their own futex,
//! eventfd or condition variable when [`AdaptiveSpin::spin`] gives up.
//!
//! Why spin at all: a blocking wake-up across cores costs tens of microseconds on the VMs this
//! runs on (a futex ping-pong ≈ 50 µs), a hundred times an inline task. Why spin *cooperatively*:
//! the three threads of a round trip (client, dispatcher, lane) often share two cores, so a
//! spinner that kept its core could be the very thing the awaited thread waits for. After a short
//! pure spin the spinner yields its core every few polls; alone on its core, a yield is a cheap
//! system call, and beside the awaited thread it hands over at once instead of after a time
//! slice. But a yield can also hand the core to a stranger (another program's busy thread, or
//! one of our own batch lanes) that keeps it for a whole time slice: so each spinner watches what
//! its yields bring. A yield that let another thread run and was followed at once by the event
//! was *productive* (the next spins yield after every poll); one that lost the core for a whole
//! time slice went to a stranger, and the spinner stops yielding for a while (tens of spins,
//! doubling while strangers stay: who shares the core changes). A caller that knows its own
//! long work occupies the cores says so ([`AdaptiveSpin::spin_with`]).
//!
//! Also owns the other end of waiting, for an event that may never come: [`Deadline`], a limit
//! that leaves out the time this process did not run (a paused VM), so a peer that was paused
//! too is not taken for stuck.

use std::time::{Duration, Instant};

mod deadline;
pub use deadline::{Deadline, LATE_WAKE, WAIT_SLICE};

/// Polls between clock reads (and, past [`PURE_SPIN`], yields): a clock read costs ~20 ns.
const POLLS_PER_CHECK: u32 = 64;

/// How long a spin polls before it starts yielding its core: the awaited event of an inline task
/// (~1 µs) arrives within it, undisturbed by system calls. Skipped while yielding is known to
/// help (see [`AdaptiveSpin::spin`]).
const PURE_SPIN: Duration = Duration::from_micros(2);

/// How a spin may give its core away ([`AdaptiveSpin::spin_with`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Yielding {
    /// After a short pure spin, every few polls; after every poll while yields bring the event.
    Cooperative,
    /// Once per `RARE_YIELD` (10 µs) of spinning: enough for a thread sharing the core to make
    /// progress, too little for two spinners to settle on one core handing it back and forth
    /// (the OS spreads threads that keep their core busy, not ones that keep yielding).
    Rarely,
    /// Never: the core would go to long work of the caller's own for a time slice.
    Never,
}

/// The spacing of yields of [`Yielding::Rarely`].
const RARE_YIELD: Duration = Duration::from_micros(10);

/// A yield that took at least this long let another thread run on our core.
const YIELD_SWITCHED: Duration = Duration::from_nanos(1_500);

/// A yield that took at least this long handed the core to a thread that kept it for a time
/// slice: not a partner of the round trip (they run a step of microseconds), a stranger.
const STRANGER_SLICE: Duration = Duration::from_micros(50);

/// The shortest budget worth having: about what blocking and being woken costs here (ski rental —
/// spinning as long as a block would cost is never worse than twice the better choice).
pub const MIN_BUDGET: Duration = Duration::from_micros(30);

/// A spin budget that adapts to how long recent waits took.
///
/// After a wait that was satisfied while spinning, the budget becomes four times that wait (but
/// falls by at most half per wait); a spin that runs out halves it; a wait that then had to block
/// only briefly doubles it (spinning a little longer would have saved the block). Always within
/// its bounds. So a thread in a tight request loop spins through its waits, and one whose events
/// come milliseconds apart spins only the minimum before it blocks.
#[derive(Debug, Clone)]
pub struct AdaptiveSpin {
    budget_ns: u64,
    min_ns: u64,
    max_ns: u64,
    yields: u64,
    /// The last wait ended right after a productive yield: the awaited thread probably shares
    /// our core, so the next spin yields from its start instead of after [`PURE_SPIN`].
    eager: bool,
    /// Spins left before this spinner yields again, after a yield handed its core to a stranger
    /// ([`STRANGER_SLICE`]); 0: it yields.
    quiet_spins: u32,
    /// How many spins the next stranger makes it stay without yielding: doubles with each
    /// stranger from [`RETRY_YIELDING`] to [`RETRY_YIELDING_MAX`], back to the start after a
    /// productive yield.
    quiet_next: u32,
}

/// Spins without yielding after a yield went to a stranger (each costs a time slice: try again
/// only now and then, less often while strangers stay).
const RETRY_YIELDING: u32 = 64;
/// The most spins a spinner stays without yielding while strangers keep taking its core.
const RETRY_YIELDING_MAX: u32 = 8192;

impl AdaptiveSpin {
    /// A spinner with a budget between `min` and `max` (starting at `max`).
    pub fn new(min: Duration, max: Duration) -> Self {
        let min_ns = min.as_nanos() as u64;
        let max_ns = (max.as_nanos() as u64).max(min_ns);
        AdaptiveSpin {
            budget_ns: max_ns,
            min_ns,
            max_ns,
            yields: 0,
            eager: false,
            quiet_spins: 0,
            quiet_next: RETRY_YIELDING,
        }
    }

    /// Current budget.
    pub fn budget(&self) -> Duration {
        Duration::from_nanos(self.budget_ns)
    }

    /// How many times this spinner yielded its core (for tests and diagnostics).
    pub fn yields(&self) -> u64 {
        self.yields
    }

    /// Spins until `ready()` is true or the budget is spent; returns whether it became ready.
    ///
    /// Past `PURE_SPIN` (2 µs; from the start when the last wait was ended by a productive yield) it
    /// yields its core every few polls, unless a recent yield went to a stranger (see the module
    /// documentation).
    pub fn spin(&mut self, ready: impl FnMut() -> bool) -> bool {
        self.spin_with(ready, Yielding::Cooperative)
    }

    /// [`AdaptiveSpin::spin`], yielding as `yielding` says: callers that know long work of
    /// their own occupies the cores (a daemon whose lanes run batch kernels) pass
    /// [`Yielding::Never`], since a yield would hand a core to that work for a whole time slice.
    pub fn spin_with(&mut self, mut ready: impl FnMut() -> bool, yielding: Yielding) -> bool {
        let start = Instant::now();
        let rarely = yielding == Yielding::Rarely;
        let pure_ns = if rarely {
            RARE_YIELD.as_nanos() as u64
        } else if self.eager {
            0
        } else {
            PURE_SPIN.as_nanos() as u64
        };
        let mut next_yield_ns = pure_ns;
        let mut may_yield = yielding != Yielding::Never && self.quiet_spins == 0;
        self.quiet_spins = self.quiet_spins.saturating_sub(1);
        let mut iterations = 0u32;
        loop {
            if ready() {
                self.eager = false;
                self.settle(start);
                return true;
            }
            iterations = iterations.wrapping_add(1);
            // Eager: the thread we wait for shares our core and needs it now; yield after
            // every poll.
            if (self.eager && may_yield && !rarely) || iterations.is_multiple_of(POLLS_PER_CHECK) {
                let spent = start.elapsed().as_nanos() as u64;
                if spent >= self.budget_ns {
                    self.budget_ns = (self.budget_ns / 2).max(self.min_ns);
                    return false;
                }
                if may_yield && spent >= next_yield_ns {
                    if rarely {
                        next_yield_ns = spent + RARE_YIELD.as_nanos() as u64;
                    }
                    // Hand the core to whoever else is runnable on it (perhaps the thread we
                    // wait for); returns at once when nobody is.
                    let before = Instant::now();
                    std::thread::yield_now();
                    self.yields += 1;
                    let away = before.elapsed();
                    if away >= YIELD_SWITCHED && ready() {
                        self.eager = !rarely;
                        self.quiet_next = RETRY_YIELDING;
                        self.settle(start);
                        return true;
                    }
                    // A partner thread that ran a step of the round trip gives the core back
                    // within microseconds; a stranger keeps it for a time slice.
                    if away >= STRANGER_SLICE {
                        self.eager = false;
                        may_yield = false;
                        self.quiet_spins = self.quiet_next;
                        self.quiet_next = (self.quiet_next * 2).min(RETRY_YIELDING_MAX);
                    }
                }
            }
            std::hint::spin_loop();
        }
    }

    /// Adapts the budget to a wait that ended, satisfied, after spinning since `start`.
    fn settle(&mut self, start: Instant) {
        let waited = start.elapsed().as_nanos() as u64;
        self.budget_ns = (waited.saturating_mul(4))
            .clamp(self.min_ns, self.max_ns)
            .max(self.budget_ns / 2);
    }

    /// Records that the awaited event arrived after blocking for `waited` (grows the budget when
    /// blocking was short, i.e. spinning a little longer would have avoided the block).
    pub fn blocked_for(&mut self, waited: Duration) {
        let waited = waited.as_nanos() as u64;
        if waited < self.max_ns {
            self.budget_ns = (self.budget_ns * 2).clamp(self.min_ns, self.max_ns);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::sync::Arc;

    #[test]
    fn the_budget_shrinks_to_its_floor_when_nothing_comes() {
        let mut s = AdaptiveSpin::new(Duration::from_micros(1), Duration::from_micros(100));
        for _ in 0..10 {
            assert!(!s.spin(|| false));
        }
        assert_eq!(s.budget(), Duration::from_micros(1));
        assert!(s.spin(|| true));
    }

    #[test]
    fn a_satisfied_wait_sets_the_budget_to_four_times_it_within_the_bounds() {
        let mut s = AdaptiveSpin::new(Duration::from_micros(30), Duration::from_micros(200));
        // Ready at once: four times ~0 is below the floor, and the budget halves at most.
        assert!(s.spin(|| true));
        assert_eq!(s.budget(), Duration::from_micros(100));
        assert!(s.spin(|| true));
        assert_eq!(s.budget(), Duration::from_micros(50));
        assert!(s.spin(|| true));
        assert_eq!(s.budget(), Duration::from_micros(30), "never below the floor");
        // With room to spare (a budget of 500 µs), a wait of 200 µs sets four times it: at least
        // 4 × 199 µs (the spin's clock starts a little after the test's).
        let mut t = AdaptiveSpin::new(Duration::from_micros(30), Duration::from_millis(1));
        assert!(t.spin(|| true));
        assert_eq!(t.budget(), Duration::from_micros(500));
        let start = Instant::now();
        assert!(t.spin(|| start.elapsed() >= Duration::from_micros(200)));
        assert!(t.budget() >= Duration::from_micros(796), "{:?}", t.budget());
        // A wait four times of which passes the ceiling: the budget is the ceiling.
        let start = Instant::now();
        assert!(t.spin(|| start.elapsed() >= Duration::from_micros(300)));
        assert_eq!(t.budget(), Duration::from_millis(1));
    }

    #[test]
    fn a_short_block_doubles_the_budget_a_long_one_does_not() {
        let mut s = AdaptiveSpin::new(Duration::from_micros(10), Duration::from_micros(160));
        for _ in 0..5 {
            assert!(!s.spin(|| false));
        }
        assert_eq!(s.budget(), Duration::from_micros(10));
        s.blocked_for(Duration::from_micros(50));
        assert_eq!(s.budget(), Duration::from_micros(20));
        s.blocked_for(Duration::from_millis(5));
        assert_eq!(s.budget(), Duration::from_micros(20));
    }

    /// Pins the calling thread to CPU 0.
    fn pin_to_cpu0() {
        let mut set = rustix::thread::CpuSet::new();
        set.set(0);
        rustix::thread::sched_setaffinity(None, &set).unwrap();
    }

    #[test]
    fn a_yield_to_a_stranger_stops_yielding_for_a_while() {
        pin_to_cpu0();
        let stop = Arc::new(AtomicBool::new(false));
        let hog = {
            let stop = stop.clone();
            std::thread::spawn(move || {
                pin_to_cpu0();
                // A stranger: busy for whole time slices, never the event we wait for.
                while !stop.load(Ordering::Relaxed) {
                    std::hint::spin_loop();
                }
            })
        };
        let mut s = AdaptiveSpin::new(Duration::from_millis(2), Duration::from_millis(2));
        assert!(!s.spin(|| false));
        let first = s.yields();
        assert!(first >= 1, "the spin yielded");
        // The stranger kept the core: the next spins do not yield at all.
        for _ in 0..10 {
            assert!(!s.spin(|| false));
        }
        stop.store(true, Ordering::Relaxed);
        hog.join().unwrap();
        assert_eq!(s.yields(), first, "no yields while the stranger is likely still there");
        // A caller that says its own long work runs never yields.
        let mut t = AdaptiveSpin::new(Duration::from_micros(100), Duration::from_micros(100));
        assert!(!t.spin_with(|| false, Yielding::Never));
        assert_eq!(t.yields(), 0);
    }

    #[test]
    fn a_rare_spinner_yields_at_most_once_per_interval() {
        let mut s = AdaptiveSpin::new(Duration::from_micros(500), Duration::from_micros(500));
        assert!(!s.spin_with(|| false, Yielding::Rarely));
        // 500 µs at one yield per RARE_YIELD (10 µs), the first after 10 µs.
        assert!(s.yields() <= 50, "{} yields in 500 µs", s.yields());
    }

    #[test]
    fn a_spin_past_the_pure_phase_yields_and_still_sees_the_event() {
        let flag = Arc::new(AtomicBool::new(false));
        let setter = {
            let flag = flag.clone();
            std::thread::spawn(move || {
                std::thread::sleep(Duration::from_millis(2));
                flag.store(true, Ordering::Release);
            })
        };
        let mut s = AdaptiveSpin::new(Duration::from_secs(5), Duration::from_secs(5));
        assert!(s.spin(|| flag.load(Ordering::Acquire)));
        setter.join().unwrap();
        assert!(s.yields() > 0, "a spin of milliseconds yields its core");
    }
}
