//! Wake-ups: spin briefly, then block.
//!
//! Waiters spin while the expected event is likely to arrive within about the time a blocking
//! wake-up costs (tens of microseconds on these VMs), then block: clients on a futex in the shared
//! segment, the daemon in `epoll_wait` on per-session eventfd doorbells. Both sides announce that
//! they are about to block in a segment word, so the other side makes the wake-up system call
//! only when someone actually sleeps.

use std::os::fd::{AsFd, OwnedFd};
use std::sync::atomic::AtomicU32;
use std::time::{Duration, Instant};

use rustix::event::EventfdFlags;
use rustix::thread::futex;

use crate::TransportError;

/// Blocks while `word` equals `expected`, at most `timeout`. Returns on a wake, a timeout, a
/// signal or a changed value; callers re-check their condition.
pub fn futex_wait(word: &AtomicU32, expected: u32, timeout: Duration) {
    let ts = rustix::time::Timespec {
        tv_sec: timeout.as_secs() as i64,
        tv_nsec: i64::from(timeout.subsec_nanos()),
    };
    // Shared (not PRIVATE) futex: the word lives in memory mapped by two processes.
    let _ = futex::wait(word, futex::Flags::empty(), expected, Some(&ts));
}

/// Wakes every waiter blocked on `word`.
pub fn futex_wake_all(word: &AtomicU32) {
    let _ = futex::wake(word, futex::Flags::empty(), i32::MAX as u32);
}

/// An eventfd used as a doorbell: clients ring it, the daemon's epoll sees it.
#[derive(Debug)]
pub struct Doorbell(OwnedFd);

impl Doorbell {
    /// Creates a non-blocking doorbell.
    pub fn new() -> Result<Self, TransportError> {
        let fd = rustix::event::eventfd(0, EventfdFlags::CLOEXEC | EventfdFlags::NONBLOCK)?;
        Ok(Doorbell(fd))
    }

    /// Wraps a received eventfd.
    pub fn from_fd(fd: OwnedFd) -> Self {
        Doorbell(fd)
    }

    /// Rings it.
    pub fn ring(&self) {
        let _ = rustix::io::write(&self.0, &1u64.to_ne_bytes());
    }

    /// Clears it (daemon side).
    pub fn drain(&self) {
        let mut buf = [0u8; 8];
        let _ = rustix::io::read(&self.0, &mut buf);
    }

    /// The descriptor.
    pub fn fd(&self) -> std::os::fd::BorrowedFd<'_> {
        self.0.as_fd()
    }
}

impl AsFd for Doorbell {
    fn as_fd(&self) -> std::os::fd::BorrowedFd<'_> {
        self.0.as_fd()
    }
}

/// Spin budget that adapts to how long recent waits took.
///
/// After a wait that was satisfied while spinning, the budget becomes four times that wait (but
/// falls by at most half per wait); a spin that runs out halves it; a wait that then had to
/// block only briefly doubles it (spinning a little longer would have saved the syscall). Always
/// within its bounds. So a client in a tight request loop
/// spins through its waits, and one whose requests take milliseconds stops burning a core.
#[derive(Debug, Clone)]
pub struct AdaptiveSpin {
    budget_ns: u64,
    min_ns: u64,
    max_ns: u64,
}

impl AdaptiveSpin {
    /// A spinner with a budget between `min` and `max`.
    pub fn new(min: Duration, max: Duration) -> Self {
        let min_ns = min.as_nanos() as u64;
        let max_ns = max.as_nanos() as u64;
        AdaptiveSpin {
            budget_ns: max_ns,
            min_ns,
            max_ns,
        }
    }

    /// Current budget.
    pub fn budget(&self) -> Duration {
        Duration::from_nanos(self.budget_ns)
    }

    /// Spins until `ready()` is true or the budget is spent; returns whether it became ready.
    pub fn spin(&mut self, mut ready: impl FnMut() -> bool) -> bool {
        let start = Instant::now();
        let mut iterations = 0u32;
        loop {
            if ready() {
                let waited = start.elapsed().as_nanos() as u64;
                self.budget_ns = (waited.saturating_mul(4))
                    .clamp(self.min_ns, self.max_ns)
                    .max(self.budget_ns / 2);
                return true;
            }
            iterations = iterations.wrapping_add(1);
            // Check the clock only every 64 polls: it costs ~20 ns.
            if iterations.is_multiple_of(64) && start.elapsed().as_nanos() as u64 >= self.budget_ns {
                self.budget_ns = (self.budget_ns / 2).max(self.min_ns);
                return false;
            }
            std::hint::spin_loop();
        }
    }

    /// Records that the awaited event arrived after blocking for `waited` (grows the budget
    /// when blocking was short, i.e. spinning a little longer would have avoided the syscall).
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
    use std::sync::atomic::Ordering;
    use std::sync::Arc;

    #[test]
    fn futex_wait_returns_on_wake() {
        let word = Arc::new(AtomicU32::new(0));
        let w2 = word.clone();
        let t = std::thread::spawn(move || {
            let start = Instant::now();
            while w2.load(Ordering::Acquire) == 0 {
                futex_wait(&w2, 0, Duration::from_secs(5));
            }
            start.elapsed()
        });
        std::thread::sleep(Duration::from_millis(20));
        word.store(1, Ordering::Release);
        futex_wake_all(&word);
        assert!(t.join().unwrap() < Duration::from_secs(4));
    }

    #[test]
    fn spin_budget_shrinks_when_nothing_comes() {
        let mut s = AdaptiveSpin::new(Duration::from_micros(1), Duration::from_micros(100));
        for _ in 0..10 {
            assert!(!s.spin(|| false));
        }
        assert_eq!(s.budget(), Duration::from_micros(1));
        assert!(s.spin(|| true));
    }

    #[test]
    fn doorbell_rings_and_drains() {
        let d = Doorbell::new().unwrap();
        d.ring();
        let mut fds = [rustix::event::PollFd::new(&d, rustix::event::PollFlags::IN)];
        assert_eq!(rustix::event::poll(&mut fds, None).unwrap(), 1);
        d.drain();
        let mut fds = [rustix::event::PollFd::new(&d, rustix::event::PollFlags::IN)];
        let zero = rustix::time::Timespec { tv_sec: 0, tv_nsec: 0 };
        assert_eq!(rustix::event::poll(&mut fds, Some(&zero)).unwrap(), 0);
    }
}
