//! Task outcomes and the data they leave behind: a failed task's outputs are **poisoned**.
//!
//! A buffer whose last writer failed (its own error, cancelled, revoked for good, or itself fed
//! by a failed task) holds no valid contents, so no task may compute on it and no `sync_from`
//! may report it as current. Each buffer carries its [`Provenance`]:
//!
//! * when a task **settles** (its outcome is judged, in issue order within its queue: each
//!   queue's [`Sequencer`] holds back a job an asynchronous device reports early), a task that
//!   read a poisoned buffer is reported `DependencyFailed` naming the task the failure began
//!   with and its error; a failed task poisons what it writes (a whole rewrite replaces an older
//!   poison, a partial write keeps it); a successful whole rewrite (`sync_to`, a full memset or
//!   copy, a launch that writes all of it) clears it. Settling in order makes the outcome of a
//!   sequence exactly that of running it one task at a time.
//! * at **dispatch**, a task that reads a buffer that will still be poisoned when it settles
//!   (no whole rewrite was issued since the failure) fails at once without running; it still
//!   settles in order. Each whole rewrite is recorded at dispatch for this check.
//!
//! Task ids are issued in order within a session and buffers belong to one session, so "earlier"
//! and "later" compare task ids. Across queues that use one buffer without waiting for each
//! other the order is the client's race, as for the contents themselves.
//!
//! This module also holds the test-only fault injection ([`FaultInjection`]) that makes chosen
//! tasks fail, so the tests can check every reported outcome against the real one.
//!
//! Must not plan transfers or touch device memory: it only judges outcomes.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use agora_protocol::{Access, TaskError};

use crate::memory::BufferRecord;

/// Why a buffer holds no valid contents.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Poison {
    /// The failed task that wrote (or should have written) it.
    pub writer: u64,
    /// The task the failure began with, and its error code.
    pub origin: (u64, u16),
}

/// The outcome history of one buffer's contents.
#[derive(Debug, Default)]
pub(crate) struct Provenance {
    /// The latest task, in issue order, that rewrites the whole buffer (0: none yet); recorded
    /// at dispatch.
    rewritten_by: AtomicU64,
    /// Fast check for the common case: nothing is poisoned.
    poisoned: AtomicBool,
    /// Updated as tasks settle, in issue order within a queue.
    poison: Mutex<Option<Poison>>,
}

impl Provenance {
    /// The poison, as of the tasks settled so far.
    pub(crate) fn poison(&self) -> Option<Poison> {
        if !self.poisoned.load(Ordering::Acquire) {
            return None;
        }
        *self.poison.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The poison a task dispatched now will find when it settles: the current one, unless a
    /// task dispatched after its writer rewrites the buffer whole.
    fn poison_at_dispatch(&self) -> Option<Poison> {
        self.poison()
            .filter(|p| self.rewritten_by.load(Ordering::Acquire) <= p.writer)
    }

    /// `task` rewrites the whole buffer (recorded at dispatch).
    fn rewritten(&self, task: u64) {
        self.rewritten_by.fetch_max(task, Ordering::AcqRel);
    }

    /// The whole buffer was written outside any task, none using it (a checkpoint's recovery
    /// wrote its host copy): whatever a failed task left behind is gone, as after a `sync_to`.
    pub(crate) fn restored(&self) {
        let mut poison = self.poison.lock().unwrap_or_else(|e| e.into_inner());
        *poison = None;
        self.poisoned.store(false, Ordering::Release);
    }

    /// A task that wrote the buffer settled: `whole` if it rewrote all of it, `failure` the
    /// origin of its failure if it failed.
    fn settled_write(&self, writer: u64, whole: bool, failure: Option<(u64, u16)>) {
        if failure.is_none() && (!whole || !self.poisoned.load(Ordering::Acquire)) {
            // A success that leaves the poison as it is (partial write) or has none to clear.
            return;
        }
        let mut poison = self.poison.lock().unwrap_or_else(|e| e.into_inner());
        match failure {
            // A whole rewrite replaces what was there, including an older failure.
            Some(origin) if whole || poison.is_none() => *poison = Some(Poison { writer, origin }),
            Some(_) => {}
            None => *poison = None,
        }
        self.poisoned.store(poison.is_some(), Ordering::Release);
    }
}

/// How a task uses one of its buffer arguments.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(crate) struct Role {
    /// Its result depends on the buffer's contents.
    pub reads: bool,
    /// It changes the buffer's contents.
    pub writes: bool,
    /// It replaces every byte of it (so earlier contents, poisoned or not, are gone).
    pub whole: bool,
}

impl Role {
    /// A launch argument: `overwrites` when a write-only argument's checked range is the whole
    /// buffer.
    pub(crate) fn launch(access: Access, overwrites: bool) -> Role {
        Role {
            reads: access != Access::Write,
            writes: access.writes(),
            whole: access == Access::Write && overwrites,
        }
    }

    /// Reads the buffer only (`sync_from`, a copy's source).
    pub(crate) const READ: Role = Role {
        reads: true,
        writes: false,
        whole: false,
    };

    /// Writes `[offset, offset + len)` of a buffer of `buffer_len` bytes without reading it.
    pub(crate) fn write(offset: u64, len: u64, buffer_len: u64) -> Role {
        Role {
            reads: false,
            writes: true,
            whole: offset == 0 && len >= buffer_len,
        }
    }
}

/// A task's buffer arguments with their roles, as the outcome rules see them.
pub(crate) struct Uses<'a> {
    pub buffers: &'a [Option<(Arc<BufferRecord>, Access, bool)>],
    pub roles: &'a [Role],
}

impl Uses<'_> {
    fn each(&self) -> impl Iterator<Item = (usize, &Arc<BufferRecord>, Role)> {
        self.buffers
            .iter()
            .zip(self.roles)
            .enumerate()
            .filter_map(|(slot, (entry, role))| entry.as_ref().map(|(record, _, _)| (slot, record, *role)))
    }

    /// Dispatch rule: records the buffers `task` rewrites whole, and fails it at once when it
    /// reads a buffer that will still be poisoned when it settles (it then runs nowhere; its
    /// failure must still be settled, in order, with [`Uses::settle`]).
    pub(crate) fn admit(&self, task: u64) -> Result<(), TaskError> {
        for (_, record, role) in self.each() {
            if role.whole {
                record.provenance.rewritten(task);
            }
        }
        match self
            .each()
            .filter(|(_, _, role)| role.reads)
            .find_map(|(slot, record, _)| {
                record
                    .provenance
                    .poison_at_dispatch()
                    .map(|p| dependency_failed(slot, p))
            }) {
            Some(error) => Err(error),
            None => Ok(()),
        }
    }

    /// Completion rule, applied in issue order within the task's queue: the outcome to report
    /// for `task`, which ended with `result`, and what it leaves on the buffers it writes (a
    /// failure poisons them, a successful whole rewrite clears them). A task that read a
    /// poisoned buffer is reported `DependencyFailed`, whatever its own result (bad inputs
    /// explain whatever happened to it), except `Cancelled` and `DataLost`, which name their cause
    /// more precisely.
    pub(crate) fn settle(&self, task: u64, result: Result<(), TaskError>) -> Result<(), TaskError> {
        let result = match result {
            // It did not run for a reason of its own (its session or queue went away), or its
            // data was lost with a failed device: that says more than its inputs.
            Err(own @ (TaskError::Cancelled | TaskError::DataLost { .. })) => Err(own),
            other => self.inputs_were_valid().and(other),
        };
        let failure = result.as_ref().err().map(|e| e.origin(task));
        for (_, record, role) in self.each() {
            if role.writes {
                record.provenance.settled_write(task, role.whole, failure);
            }
        }
        result
    }

    /// Whether every buffer the task reads holds valid contents (as of the tasks settled).
    fn inputs_were_valid(&self) -> Result<(), TaskError> {
        for (slot, record, role) in self.each() {
            if role.reads {
                if let Some(poison) = record.provenance.poison() {
                    return Err(dependency_failed(slot, poison));
                }
            }
        }
        Ok(())
    }
}

/// Makes the lane jobs of one queue settle (judge their outcome, post their completion) in
/// issue order, whatever order their devices report them in: an asynchronous device's
/// completion callbacks may run on several threads at once, and a reader must not be judged
/// before the writer it depends on.
#[derive(Default)]
pub(crate) struct Sequencer {
    /// Tickets handed out (by the dispatcher thread, in issue order).
    issued: AtomicU64,
    state: Mutex<SequencerState>,
}

#[derive(Default)]
struct SequencerState {
    /// Tickets settled so far (they settle in order: 1, 2, ...).
    settled: u64,
    /// Jobs that finished before their predecessors, by ticket.
    parked: std::collections::BTreeMap<u64, Box<dyn FnOnce() + Send>>,
}

impl std::fmt::Debug for Sequencer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Sequencer")
            .field("issued", &self.issued.load(Ordering::Relaxed))
            .finish_non_exhaustive()
    }
}

impl Sequencer {
    /// The ticket of the next job handed to a lane.
    pub(crate) fn ticket(&self) -> u64 {
        self.issued.fetch_add(1, Ordering::Relaxed) + 1
    }

    /// Runs `settle` for job `ticket` once every earlier ticket has settled: now, if they have,
    /// else when the last of them does (on that job's thread).
    pub(crate) fn in_order(&self, ticket: u64, settle: impl FnOnce() + Send + 'static) {
        let mut state = self.state.lock().unwrap_or_else(|e| e.into_inner());
        if ticket != state.settled + 1 {
            state.parked.insert(ticket, Box::new(settle));
            return;
        }
        settle();
        state.settled = ticket;
        loop {
            let following = state.settled + 1;
            let Some(next) = state.parked.remove(&following) else {
                break;
            };
            next();
            state.settled = following;
        }
    }
}

fn dependency_failed(slot: usize, poison: Poison) -> TaskError {
    TaskError::DependencyFailed {
        index: slot as u16,
        task: poison.origin.0,
        cause: poison.origin.1,
    }
}

/// Test-only: fails the tasks a seeded rule picks, so tests can predict every outcome.
///
/// Set by `DaemonConfig::inject_faults`, whose default comes from
/// `AGORA_INJECT_FAULTS=SEED:PER_MILLE` in the daemon's environment (the daemon logs a warning
/// when it is on). A picked task keeps its transfers but its work does not run, and it
/// completes with `KernelFault`: exactly what a kernel that crashed before writing leaves behind.
#[derive(Debug, Clone, Copy)]
pub(crate) struct FaultInjection {
    seed: u64,
    per_mille: u64,
}

impl FaultInjection {
    /// `AGORA_INJECT_FAULTS=SEED:PER_MILLE` as `(seed, per mille)`, if set (a malformed value is
    /// reported and ignored).
    pub(crate) fn setting_from_env() -> Option<(u64, u64)> {
        let value = std::env::var("AGORA_INJECT_FAULTS").ok()?;
        let parsed = value
            .split_once(':')
            .and_then(|(seed, rate)| Some((seed.trim().parse().ok()?, rate.trim().parse().ok()?)));
        match parsed {
            Some((seed, per_mille)) if per_mille <= 1000 => Some((seed, per_mille)),
            _ => {
                tracing::error!(%value, "AGORA_INJECT_FAULTS must be SEED:PER_MILLE (0 to 1000); ignored");
                None
            }
        }
    }

    /// The injection a `(seed, per mille)` setting asks for (logged: it is never for production).
    pub(crate) fn new(setting: Option<(u64, u64)>) -> Option<FaultInjection> {
        let (seed, per_mille) = setting?;
        tracing::warn!(
            seed,
            per_mille,
            "test-only fault injection is on: chosen tasks will fail with KernelFault"
        );
        Some(FaultInjection { seed, per_mille })
    }

    /// Whether task `task` is picked to fail.
    pub(crate) fn picks(&self, task: u64) -> bool {
        agora_protocol::testing::injected_fault(self.seed, self.per_mille, task)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn record(len: u64) -> Arc<BufferRecord> {
        crate::memory::tests_support::record(len)
    }

    fn uses<'a>(buffers: &'a [Option<(Arc<BufferRecord>, Access, bool)>], roles: &'a [Role]) -> Uses<'a> {
        Uses { buffers, roles }
    }

    #[test]
    fn a_failed_writer_poisons_and_a_reader_fails_without_running() {
        let x = record(64);
        let y = record(64);
        let writer = [Some((x.clone(), Access::Write, true))];
        let w = [Role::launch(Access::Write, true)];
        assert_eq!(uses(&writer, &w).admit(3), Ok(()));
        assert_eq!(
            uses(&writer, &w).settle(3, Err(TaskError::KernelFault)),
            Err(TaskError::KernelFault)
        );
        let reader = [
            Some((x.clone(), Access::Read, false)),
            Some((y.clone(), Access::Write, true)),
        ];
        let r = [Role::launch(Access::Read, false), Role::launch(Access::Write, true)];
        let expected = TaskError::DependencyFailed {
            index: 0,
            task: 3,
            cause: TaskError::KernelFault.code(),
        };
        assert_eq!(uses(&reader, &r).admit(4), Err(expected));
        assert_eq!(uses(&reader, &r).settle(4, Err(expected)), Err(expected));
        // The reader's output inherits the original failure.
        let later = [Some((y.clone(), Access::Read, false))];
        let l = [Role::READ];
        assert_eq!(uses(&later, &l).admit(5), Err(expected));
    }

    #[test]
    fn a_reader_dispatched_before_the_failure_is_reported_failed_when_it_settles() {
        let x = record(64);
        let writer = [Some((x.clone(), Access::ReadWrite, false))];
        let w = [Role::launch(Access::ReadWrite, false)];
        let reader = [Some((x.clone(), Access::Read, false))];
        let r = [Role::READ];
        assert_eq!(uses(&writer, &w).admit(1), Ok(()));
        assert_eq!(uses(&reader, &r).admit(2), Ok(()));
        assert!(uses(&writer, &w).settle(1, Err(TaskError::Cancelled)).is_err());
        assert_eq!(
            uses(&reader, &r).settle(2, Ok(())),
            Err(TaskError::DependencyFailed {
                index: 0,
                task: 1,
                cause: TaskError::Cancelled.code()
            })
        );
    }

    #[test]
    fn a_whole_rewrite_clears_and_a_partial_one_does_not() {
        let x = record(64);
        let writer = [Some((x.clone(), Access::Write, true))];
        let w = [Role::launch(Access::Write, true)];
        let reader = [Some((x.clone(), Access::Read, false))];
        let r = [Role::READ];
        let _ = uses(&writer, &w).settle(1, Err(TaskError::KernelFault));
        let partial = [Role::write(8, 8, 64)];
        assert_eq!(uses(&writer, &partial).admit(2), Ok(()));
        assert_eq!(uses(&writer, &partial).settle(2, Ok(())), Ok(()));
        assert!(x.provenance.poison().is_some(), "a partial write keeps the poison");
        let whole = [Role::write(0, 64, 64)];
        assert_eq!(uses(&writer, &whole).admit(3), Ok(()));
        // Dispatched after the rewrite: it will read the rewrite's result, so it may run.
        assert_eq!(uses(&reader, &r).admit(4), Ok(()));
        assert_eq!(uses(&writer, &whole).settle(3, Ok(())), Ok(()));
        assert!(x.provenance.poison().is_none());
        assert_eq!(uses(&reader, &r).settle(4, Ok(())), Ok(()));
        // The rewrite itself failing poisons it, replacing an older failure.
        let _ = uses(&writer, &partial).settle(5, Err(TaskError::Cancelled));
        let _ = uses(&writer, &whole).settle(6, Err(TaskError::KernelFault));
        assert_eq!(x.provenance.poison().map(|p| p.origin), Some((6, 16)));
    }

    #[test]
    fn readers_between_a_failure_and_a_rewrite_fail_and_later_ones_do_not() {
        let x = record(64);
        let failed = [Some((x.clone(), Access::Write, true))];
        let w = [Role::launch(Access::Write, true)];
        let reader = [Some((x.clone(), Access::Read, false))];
        let r = [Role::READ];
        // All dispatched before anything settles (a pipelined asynchronous device).
        assert_eq!(uses(&failed, &w).admit(1), Ok(()));
        assert_eq!(uses(&reader, &r).admit(2), Ok(()));
        assert_eq!(uses(&failed, &w).admit(3), Ok(()));
        assert_eq!(uses(&reader, &r).admit(4), Ok(()));
        assert!(uses(&failed, &w).settle(1, Err(TaskError::KernelFault)).is_err());
        assert!(uses(&reader, &r).settle(2, Ok(())).is_err());
        assert_eq!(uses(&failed, &w).settle(3, Ok(())), Ok(()));
        assert_eq!(uses(&reader, &r).settle(4, Ok(())), Ok(()));
    }

    #[test]
    fn jobs_settle_in_ticket_order_whatever_order_they_finish_in() {
        let sequencer = Sequencer::default();
        let log = Arc::new(Mutex::new(Vec::new()));
        let tickets: Vec<u64> = (0..5).map(|_| sequencer.ticket()).collect();
        for &ticket in &[3u64, 5, 1, 4, 2] {
            let entries = log.clone();
            sequencer.in_order(tickets[ticket as usize - 1], move || {
                entries.lock().unwrap().push(ticket)
            });
            if ticket == 1 {
                assert_eq!(*log.lock().unwrap(), vec![1], "2 has not finished: 3 and 5 wait");
            }
        }
        assert_eq!(*log.lock().unwrap(), vec![1, 2, 3, 4, 5]);
    }

    #[test]
    fn injection_picks_about_the_asked_share() {
        let f = FaultInjection {
            seed: 7,
            per_mille: 100,
        };
        let picked = (1..=100_000).filter(|t| f.picks(*t)).count();
        assert!((8_000..12_000).contains(&picked), "{picked}");
        let none = FaultInjection { seed: 7, per_mille: 0 };
        assert!(!(1..=10_000).any(|t| none.picks(t)));
    }
}
