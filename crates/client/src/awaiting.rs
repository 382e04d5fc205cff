//! Awaiting tasks from async code (`queue.launch(...)?.await?` in any executor: tokio, smol,
//! async-std, a hand-written one, the executor's thread never blocked) and completion callbacks
//! ([`Task::on_complete`], the C client's `agora_task_on_complete`: StarPU's `callback_func`,
//! OpenCL's `clSetEventCallback`).
//!
//! Owns, per session with awaited tasks or pending callbacks, one waiting thread: it blocks on
//! the session's completions (the futex every wait uses), wakes the [`Waker`] of each awaited
//! task that completed and calls each completed task's callbacks. So a thousand awaited tasks
//! cost one thread, not one each. The thread holds the session weakly (a session whose handles
//! are all dropped ends as ever; a pending callback holds its task, and so its session) and ends
//! when nothing has been waited for for [`LINGER`]. Must not: be polled into blocking (a
//! [`Completion`]'s `poll` only looks at what already arrived), hold the session while it
//! lingers, or hold its own lock while it calls a callback (a callback may issue and await
//! tasks).

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

/// A completion callback with the task it is for (which keeps the task's outcome, and its
/// session, until the callback has it).
type Callback = (Task, Box<dyn FnOnce(Result<(), Error>) + Send>);

/// Who is told when a task completes.
enum Waiter {
    /// An awaited [`Completion`].
    Future(Arc<Slot>),
    /// [`Task::on_complete`]'s callback.
    Callback(Callback),
}

impl std::fmt::Debug for Waiter {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Waiter::Future(slot) => f.debug_tuple("Future").field(slot).finish(),
            Waiter::Callback((task, _)) => f.debug_tuple("Callback").field(task).finish(),
        }
    }
}

/// A session's awaited tasks and pending callbacks, and whether its waiting thread runs. Shared
/// by the session and its thread, so the thread can linger without keeping the session alive.
#[derive(Debug, Default)]
pub(crate) struct Watch {
    state: Mutex<WatchState>,
    added: Condvar,
}

#[derive(Debug, Default)]
struct WatchState {
    /// (task id, who is told), not complete when last looked at.
    entries: Vec<(u64, Waiter)>,
    running: bool,
}

impl Watch {
    /// Has the waiting thread of `session` look after task `id`; starts the thread if none runs.
    fn add(self: &Arc<Self>, session: &Arc<Inner>, id: u64, waiter: Waiter) {
        let mut state = self.state.lock().unwrap_or_else(|e| e.into_inner());
        state.entries.push((id, waiter));
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
            // No thread: everyone waiting is told so at once (the executor polls again; a
            // callback runs on this thread, after the lock is let go).
            Err(e) => {
                let waiters: Vec<_> = state.entries.drain(..).collect();
                drop(state);
                let message = format!("no thread to wait for tasks: {e}");
                for (_, waiter) in waiters {
                    tell(waiter, Err(Error::Protocol(message.clone())));
                }
            }
        }
    }

    /// Forgets `slot` (its future was dropped before the task completed).
    fn remove(&self, slot: &Arc<Slot>) {
        let mut state = self.state.lock().unwrap_or_else(|e| e.into_inner());
        state
            .entries
            .retain(|(_, waiter)| !matches!(waiter, Waiter::Future(s) if Arc::ptr_eq(s, slot)));
    }

    /// The waiting thread.
    fn run(&self, session: Weak<Inner>) {
        loop {
            let ids: Vec<u64> = {
                let state = self.state.lock().unwrap_or_else(|e| e.into_inner());
                let (mut state, _) = self
                    .added
                    .wait_timeout_while(state, LINGER, |s| s.entries.is_empty())
                    .unwrap_or_else(|e| e.into_inner());
                if state.entries.is_empty() {
                    state.running = false;
                    return;
                }
                state.entries.iter().map(|(id, _)| *id).collect()
            };
            let Some(inner) = session.upgrade() else {
                // The session is gone (not reached: an awaited task or a callback holds it).
                let waiters: Vec<_> = {
                    let mut state = self.state.lock().unwrap_or_else(|e| e.into_inner());
                    state.running = false;
                    state.entries.drain(..).collect()
                };
                for (_, waiter) in waiters {
                    tell(waiter, Err(Error::Disconnected));
                }
                return;
            };
            let seen = inner.completions_seen();
            let mut complete: Vec<u64> = ids
                .into_iter()
                .filter(|id| !matches!(inner.poll(*id), Ok(false)))
                .collect();
            if complete.is_empty() {
                let _ = inner.wait_for_completions_until(seen, Instant::now() + WAIT);
                continue;
            }
            complete.sort_unstable();
            // Taken out under the lock, told after it (a callback may await or register more).
            let done: Vec<(u64, Waiter)> = {
                let mut state = self.state.lock().unwrap_or_else(|e| e.into_inner());
                let (done, pending) = std::mem::take(&mut state.entries)
                    .into_iter()
                    .partition(|(id, _)| complete.binary_search(id).is_ok());
                state.entries = pending;
                done
            };
            for (id, waiter) in done {
                tell(waiter, outcome(&inner, id));
            }
        }
    }
}

/// The outcome of task `id` of `session`, known complete.
fn outcome(session: &Inner, id: u64) -> Result<(), Error> {
    match session.poll(id) {
        Ok(_) => match session.task_error(id) {
            Some(error) => Err(Error::Task(error)),
            None => Ok(()),
        },
        Err(error) => Err(error),
    }
}

/// Tells `waiter` its task's `outcome`. A callback that panics is reported on stderr (by the
/// panic hook) and the waiting thread goes on: the other tasks' waiters must still be told.
fn tell(waiter: Waiter, outcome: Result<(), Error>) {
    match waiter {
        Waiter::Future(slot) => slot.settle(outcome),
        Waiter::Callback((task, callback)) => {
            let _ = std::panic::catch_unwind(std::panic::AssertUnwindSafe(move || callback(outcome)));
            // Only now: until the callback had the outcome, the task kept it.
            drop(task);
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

impl Task {
    /// Calls `callback` with the task's outcome (what [`Task::wait`] would return) once it
    /// completes, on the session's waiting thread (the one `.await` uses; never on the caller's,
    /// even when the task is already complete, so the callback never runs inside a lock the
    /// caller holds). The task is handed over: a callback that wants its id takes it first.
    ///
    /// The callback runs once, whatever happens: a task that fails gives its error; one in
    /// flight when its daemon dies gives [`crate::TaskError::DaemonRestarted`] once the session
    /// reconnected, or [`Error::Disconnected`] when it did not; where the process has no thread
    /// left to spare, an error saying so, on the caller's thread. Callbacks of one session run
    /// one after another: one that blocks delays the others (and awaited tasks), so hand long
    /// work to a thread of your own. A callback may issue tasks, wait for them and register
    /// callbacks; one that panics is reported on stderr and the others still run.
    ///
    /// ```no_run
    /// # fn main() -> Result<(), agora::Error> {
    /// # let session = agora::Session::connect()?;
    /// # let queue = session.queue("callbacks")?;
    /// # let buffer = session.buffer(1 << 20)?;
    /// let (sender, receiver) = std::sync::mpsc::channel();
    /// let task = queue.memset(&buffer, 0)?;
    /// let id = task.id();
    /// task.on_complete(move |outcome| sender.send((id, outcome)).unwrap());
    /// let (done, outcome) = receiver.recv().unwrap();
    /// assert_eq!(done, id);
    /// outcome?;
    /// # Ok(()) }
    /// ```
    pub fn on_complete<F>(self, callback: F)
    where
        F: FnOnce(Result<(), Error>) + Send + 'static,
    {
        let session = self.session().clone();
        if let Err(e) = session.check_process() {
            // A forked child: the session's waiting thread is the parent's (and its state a
            // copy, perhaps locked at the fork).
            callback(Err(e));
            return;
        }
        let id = self.id();
        session
            .watch
            .add(&session, id, Waiter::Callback((self, Box::new(callback))));
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
        if let Err(e) = self.task.session().check_process() {
            return Poll::Ready(Err(e));
        }
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
                session
                    .watch
                    .add(&session, self.task.id(), Waiter::Future(slot.clone()));
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
            if self.task.session().in_forked_child() {
                return;
            }
            self.task.session().watch.remove(slot);
        }
    }
}
