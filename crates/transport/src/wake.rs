//! Wake-ups: spin briefly, then block.
//!
//! Waiters spin ([`AdaptiveSpin`], cooperatively) while the expected event is likely to arrive
//! within about the time a blocking wake-up costs (tens of microseconds on these VMs), then block: clients on a futex in the shared
//! segment, the daemon in `epoll_wait` on per-session eventfd doorbells. Both sides announce that
//! they are about to block in a segment word, so the other side makes the wake-up system call
//! only when someone actually sleeps.

use std::os::fd::{AsFd, OwnedFd};
use std::sync::atomic::AtomicU32;
use std::time::Duration;

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

/// The spinning half of each wait (its own crate: lanes use it too).
pub use agora_wait::AdaptiveSpin;

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::Ordering;
    use std::sync::Arc;
    use std::time::Instant;

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
