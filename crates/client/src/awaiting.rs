//! Awaiting tasks from async code: `queue.launch(...)?.await?` in any executor (tokio, smol,
//! async-std, a hand-written one), the executor's thread never blocked.
//!
//! Owns, per session with awaited tasks, one waiting thread: it blocks on the session's
//! completions (the futex every wait uses) and wakes the [`Waker`] of each awaited task that
//! completed. So a thousand awaited tasks cost one thread, not one each. The thread holds the
//! session weakly (a session whose handles are all dropped ends as ever) and ends when nothing
//! has been awaited for [`LINGER`]. Must not: be polled into blocking (a [`Completion`]'s `poll`
//! only looks at what already arrived), or hold the session while it lingers.

use std::future::{Future, IntoFuture};
use std::pin::Pin;
use std::sync::{Arc, Condvar, Mutex, Weak};
use std::task::{Context, Poll, Waker};
use std::time::{Duration, Instant};

use crate::error::Error;
use crate::queue::Task;
use crate::session::Inner;

/// How long the waiting thread blocks at most before it looks again; a completion wakes it at
/// once. It also bounds how late it notices a task completed without a new completion in the
/// ring (a session resumed on a restarted daemon fails its old tasks that way).
const WAIT: Duration = Duration::from_millis(50);

/// How long the waiting thread stays with nothing to wait for: code awaiting one task after
/// another would otherwise start a thread for each.
const LINGER: Duration = Duration::from_secs(1);

/// One awaited task's meeting point with the waiting thread.
#[derive(Debug, Default)]
struct Slot {
    /// Set by the waiting thread: the task's outcome (or why it could not be known).
    outcome: Mutex<Option<Result<(), Error>>>,
    /// Who to wake when `outcome` is set.
    waker: Mutex<Option<Waker>>,
}

/// A session's awaited tasks and whether its waiting thread runs. Shared by the session and
/// its thread, so the thread can linger without keeping the session alive.
#[derive(Debug, Default)]
pub(crate) struct Watch {
    state: Mutex<WatchState>,
    added: Condvar,
}

#[derive(Debug, Default)]
struct WatchState {
    /// (task id, its slot), awaited and not complete when last looked at.
    entries: Vec<(u64, Arc<Slot>)>,
    running: bool,
}

impl Watch {
    /// Has the waiting thread of `session` look after task `id`; starts the thread if none runs.
    fn add(self: &Arc<Self>, session: &Arc<Inner>, id: u64, slot: Arc<Slot>) {
        let mut state = self.state.lock().unwrap_or_else(|e| e.into_inner());
        state.entries.push((id, slot));
        if state.running {
            self.added.notify_all();
            return;
        }
        let (watch, session) = (self.clone(), Arc::downgrade(session));
        let started = std::thread::Builder::new()
            .name("agora-await".into())
            .spawn(move || watch.run(session));
        match started {
            Ok(_) => state.running = true,
            // No thread: every awaited task is told so at once (the executor polls again).
            Err(e) => {
                for (_, slot) in state.entries.drain(..) {
                    slot.settle(Err(Error::Protocol(format!("no thread to wait for tasks: {e}"))));
                }
            }
        }
    }

    /// Forgets `slot` (its future was dropped before the task completed).
    fn remove(&self, slot: &Arc<Slot>) {
        let mut state = self.state.lock().unwrap_or_else(|e| e.into_inner());
        state.entries.retain(|(_, s)| !Arc::ptr_eq(s, slot));
    }

    /// The waiting thread.
    fn run(&self, session: Weak<Inner>) {
        loop {
            let entries = {
                let state = self.state.lock().unwrap_or_else(|e| e.into_inner());
                let (mut state, _) = self
                    .added
                    .wait_timeout_while(state, LINGER, |s| s.entries.is_empty())
                    .unwrap_or_else(|e| e.into_inner());
                if state.entries.is_empty() {
                    state.running = false;
                    return;
                }
                state.entries.clone()
            };
            let Some(inner) = session.upgrade() else {
                // The session is gone (not reached: an awaited task holds it).
                let mut state = self.state.lock().unwrap_or_else(|e| e.into_inner());
                for (_, slot) in state.entries.drain(..) {
                    slot.settle(Err(Error::Disconnected));
                }
                state.running = false;
                return;
            };
            let seen = inner.completions_seen();
            let mut settled = Vec::new();
            for (id, slot) in &entries {
                let outcome = match inner.poll(*id) {
                    Ok(false) => continue,
                    Ok(true) => match inner.task_error(*id) {
                        Some(error) => Err(Error::Task(error)),
                        None => Ok(()),
                    },
                    Err(error) => Err(error),
                };
                slot.settle(outcome);
                settled.push(slot.clone());
            }
            if settled.is_empty() {
                let _ = inner.wait_for_completions_until(seen, Instant::now() + WAIT);
                continue;
            }
            let mut state = self.state.lock().unwrap_or_else(|e| e.into_inner());
            state
                .entries
                .retain(|(_, s)| !settled.iter().any(|done| Arc::ptr_eq(s, done)));
        }
    }
}

impl Slot {
    fn settle(&self, outcome: Result<(), Error>) {
        *self.outcome.lock().unwrap_or_else(|e| e.into_inner()) = Some(outcome);
        if let Some(waker) = self.waker.lock().unwrap_or_else(|e| e.into_inner()).take() {
            waker.wake();
        }
    }

    fn take(&self) -> Option<Result<(), Error>> {
        self.outcome.lock().unwrap_or_else(|e| e.into_inner()).take()
    }
}

/// The future of a [`Task`] (`task.await`, or `task.into_future()`): its outcome, as
/// [`Task::wait`] would return it, without blocking the executor's thread. Dropping it before
/// the task completes leaves the task running.
#[derive(Debug)]
pub struct Completion {
    task: Task,
    /// Set once the session's waiting thread looks after it.
    slot: Option<Arc<Slot>>,
}

impl IntoFuture for Task {
    type Output = Result<(), Error>;
    type IntoFuture = Completion;

    fn into_future(self) -> Completion {
        Completion { task: self, slot: None }
    }
}

impl Completion {
    /// The task awaited.
    pub fn task(&self) -> &Task {
        &self.task
    }
}

impl Future for Completion {
    type Output = Result<(), Error>;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        if let Some(outcome) = self.slot.as_ref().and_then(|slot| slot.take()) {
            return Poll::Ready(outcome);
        }
        // Already complete: its outcome at once (`wait` does not block then).
        if self.task.completed_now() {
            return Poll::Ready(self.task.wait());
        }
        let slot = match &self.slot {
            Some(slot) => {
                *slot.waker.lock().unwrap_or_else(|e| e.into_inner()) = Some(cx.waker().clone());
                slot.clone()
            }
            None => {
                // First time pending: the session's waiting thread looks after it from now on.
                let slot = Arc::new(Slot::default());
                *slot.waker.lock().unwrap_or_else(|e| e.into_inner()) = Some(cx.waker().clone());
                let session = self.task.session().clone();
                session.watch.add(&session, self.task.id(), slot.clone());
                self.slot = Some(slot.clone());
                slot
            }
        };
        // It may have completed, or been settled, meanwhile: then no wake-up may come.
        if let Some(outcome) = slot.take() {
            return Poll::Ready(outcome);
        }
        if self.task.completed_now() {
            return Poll::Ready(self.task.wait());
        }
        Poll::Pending
    }
}

impl Drop for Completion {
    fn drop(&mut self) {
        if let Some(slot) = &self.slot {
            self.task.session().watch.remove(slot);
        }
    }
}
