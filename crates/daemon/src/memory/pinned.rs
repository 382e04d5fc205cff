//! Host memory the daemon has registered (page-locked) with devices for its tenants, counted per
//! user against a limit: page-locked memory is the host's to give, and one user's sessions must
//! not lock it all away from the others.
//!
//! Owns the per-user counts. It must not register anything itself (the session does, through
//! its device, when [`PinnedBooks::take`] allows it).

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

/// Bytes registered per user, and the limit.
#[derive(Debug)]
pub(crate) struct PinnedBooks {
    limit: u64,
    by_uid: Mutex<HashMap<u32, u64>>,
}

/// What `uid` holds, while it is held: dropping it gives the bytes back.
#[derive(Debug)]
pub(crate) struct PinnedTicket {
    books: Arc<PinnedBooks>,
    uid: u32,
    bytes: u64,
}

impl PinnedBooks {
    /// Books with `limit` bytes per user; 0: half the host's memory (`MemTotal`), or no limit
    /// where that cannot be read.
    pub(crate) fn new(limit: u64) -> Arc<Self> {
        let limit = if limit > 0 {
            limit
        } else {
            host_memory().map_or(u64::MAX, |total| total / 2)
        };
        Arc::new(PinnedBooks {
            limit,
            by_uid: Mutex::new(HashMap::new()),
        })
    }

    /// The limit per user, in bytes.
    pub(crate) fn limit(&self) -> u64 {
        self.limit
    }

    /// Takes `bytes` for `uid`, or returns what it already holds when that much more would pass
    /// the limit.
    pub(crate) fn take(self: &Arc<Self>, uid: u32, bytes: u64) -> Result<PinnedTicket, u64> {
        let mut by_uid = self.by_uid.lock().unwrap_or_else(|e| e.into_inner());
        let held = by_uid.entry(uid).or_insert(0);
        if held.saturating_add(bytes) > self.limit {
            return Err(*held);
        }
        *held += bytes;
        Ok(PinnedTicket {
            books: self.clone(),
            uid,
            bytes,
        })
    }

    /// Bytes `uid` holds now.
    #[cfg(test)]
    fn held(&self, uid: u32) -> u64 {
        self.by_uid
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .get(&uid)
            .copied()
            .unwrap_or(0)
    }
}

impl Drop for PinnedTicket {
    fn drop(&mut self) {
        let mut by_uid = self.books.by_uid.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(held) = by_uid.get_mut(&self.uid) {
            *held = held.saturating_sub(self.bytes);
            if *held == 0 {
                by_uid.remove(&self.uid);
            }
        }
    }
}

/// The host's memory in bytes (`MemTotal` of `/proc/meminfo`).
fn host_memory() -> Option<u64> {
    let text = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = text.lines().find(|l| l.starts_with("MemTotal:"))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib * 1024)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_user_is_held_to_the_limit_and_gets_bytes_back_when_a_ticket_goes() {
        let books = PinnedBooks::new(100);
        let a = books.take(1000, 60).unwrap();
        // Another user has a limit of their own.
        let other = books.take(2000, 100).unwrap();
        // 60 + 50 > 100: refused, saying what the user holds.
        assert_eq!(books.take(1000, 50).unwrap_err(), 60);
        let b = books.take(1000, 40).unwrap();
        assert_eq!(books.held(1000), 100);
        drop(a);
        assert_eq!(books.held(1000), 40);
        let _c = books.take(1000, 60).unwrap();
        drop(b);
        drop(other);
        assert_eq!(books.held(2000), 0);
        assert_eq!(books.held(1000), 60);
    }

    #[test]
    fn the_default_limit_is_half_the_host_memory() {
        let books = PinnedBooks::new(0);
        let total = host_memory().expect("/proc/meminfo on Linux");
        assert_eq!(books.limit(), total / 2);
    }
}
