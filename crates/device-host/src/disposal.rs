//! Disposal: the device host lets go of big things (a session's mapped segment, a large device
//! buffer the daemon freed) on a thread of its own, not on its message loop.
//!
//! Why: unmapping a segment of a GiB, or releasing a GiB OpenCL buffer, frees its pages in the
//! kernel — about 200 ms for 1.5 GiB on the 2-core VM (`perf` of the host's loop while tenants
//! came and went). On the loop, every other tenant's allocation, read and job waited behind it,
//! and the daemon's dispatcher with them, since it waits for an allocation's answer: 390–530 ms
//! stalls of the whole daemon whenever a tenant with 1.5 GiB on PoCL left.
//!
//! Memory given to the disposal thread is not yet free. An allocation that the device refuses
//! for want of memory therefore waits for the disposals in flight ([`Disposal::flush`]) and
//! tries once more (`Host::alloc`), so freeing later never fails anything that freeing at once
//! would have let through.
//!
//! A big buffer freed while a job still holds it ([`Disposal::dispose_when_last`]) is watched
//! until the job lets go, then dropped here too: otherwise the job's own thread (a lane's, or a
//! completion's) did the free and the lane's next job, perhaps another tenant's, waited for it.
//! Such buffers are not waited for by [`Disposal::flush`]: their memory was not free before
//! either, until the job ended.
//!
//! Must not: take anything whose release must be visible before the next request is handled
//! (a segment id can be mapped again at once: the new mapping is a new object).

use std::sync::mpsc::{channel, RecvTimeoutError, Sender};
use std::sync::{Arc, Condvar, Mutex};
use std::time::Duration;

/// What the disposal thread drops: anything that may be dropped on another thread.
type Item = Box<dyn Send>;

/// A shared item held elsewhere too: called now and then, it drops its item and returns true
/// once it is the last holder.
type Watched = Box<dyn FnMut() -> bool + Send>;

/// How often the disposal thread looks at the items it watches.
const WATCH_EVERY: Duration = Duration::from_millis(5);

enum Message {
    Drop(Item),
    WhenLast(Watched),
}

/// Smallest device buffer worth a hand-over: below it the drop is quicker than the wake-up of
/// the disposal thread (on 2 cores a wake-up also costs the loop its core for a while).
pub(crate) const MIN_BUFFER_BYTES: u64 = 4 << 20;

/// Items handed over and not yet dropped, and the signal that they all are.
#[derive(Default)]
struct Pending {
    count: Mutex<u64>,
    none_left: Condvar,
}

impl Pending {
    /// One item handed over is dropped.
    fn done_one(&self) {
        let mut count = self.count.lock().unwrap_or_else(|e| e.into_inner());
        *count -= 1;
        if *count == 0 {
            self.none_left.notify_all();
        }
    }
}

/// Hands items to a thread that drops them ([`Disposal::dispose`]).
pub(crate) struct Disposal {
    /// None when the thread could not start: items are then dropped at once, as before.
    sender: Option<Mutex<Sender<Message>>>,
    pending: Arc<Pending>,
}

impl Disposal {
    /// Starts the disposal thread.
    pub(crate) fn start() -> Self {
        let (sender, receiver) = channel::<Message>();
        let pending = Arc::new(Pending::default());
        let on_thread = pending.clone();
        let started = std::thread::Builder::new()
            .name("agora-host-dispose".into())
            .spawn(move || {
                let mut watched: Vec<Watched> = Vec::new();
                loop {
                    let message = if watched.is_empty() {
                        receiver.recv().map_err(|_| RecvTimeoutError::Disconnected)
                    } else {
                        receiver.recv_timeout(WATCH_EVERY)
                    };
                    match message {
                        Ok(Message::Drop(item)) => {
                            drop(item);
                            on_thread.done_one();
                        }
                        Ok(Message::WhenLast(item)) => watched.push(item),
                        Err(RecvTimeoutError::Timeout) => {}
                        // The host is ending: what is still watched goes with this thread.
                        Err(RecvTimeoutError::Disconnected) => return,
                    }
                    watched.retain_mut(|dropped_if_last| !dropped_if_last());
                }
            });
        if let Err(e) = &started {
            tracing::warn!(error = %e, "no disposal thread: segments and buffers are released on the message loop");
        }
        Disposal {
            sender: started.ok().map(|_| Mutex::new(sender)),
            pending,
        }
    }

    /// Drops `item` on the disposal thread (at once, here, when there is none).
    pub(crate) fn dispose(&self, item: Item) {
        let Some(sender) = &self.sender else {
            drop(item);
            return;
        };
        *self.pending.count.lock().unwrap_or_else(|e| e.into_inner()) += 1;
        let sent = sender
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .send(Message::Drop(item));
        if let Err(unsent) = sent {
            // The thread is gone (it panicked dropping something): drop here.
            drop(unsent.0);
            self.pending.done_one();
        }
    }

    /// Drops `item` on the disposal thread once every other holder has let go of it (a job
    /// that still runs with it): at once when none is left already.
    pub(crate) fn dispose_when_last<T: ?Sized + Send + Sync + 'static>(&self, item: Arc<T>) {
        if Arc::strong_count(&item) == 1 {
            self.dispose(Box::new(item));
            return;
        }
        let Some(sender) = &self.sender else {
            drop(item);
            return;
        };
        let mut held = Some(item);
        let watched: Watched = Box::new(move || {
            // Nothing can clone it any more (the host forgot it), so a count of one stays one.
            if held.as_ref().is_some_and(|item| Arc::strong_count(item) == 1) {
                held = None;
            }
            held.is_none()
        });
        // A thread that is gone drops it here, with the message.
        let _ = sender
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .send(Message::WhenLast(watched));
    }

    /// Whether anything handed over is not yet dropped.
    pub(crate) fn pending(&self) -> bool {
        *self.pending.count.lock().unwrap_or_else(|e| e.into_inner()) > 0
    }

    /// Waits until everything handed over so far is dropped (its memory given back).
    pub(crate) fn flush(&self) {
        let mut count = self.pending.count.lock().unwrap_or_else(|e| e.into_inner());
        while *count > 0 {
            count = self.pending.none_left.wait(count).unwrap_or_else(|e| e.into_inner());
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::time::Duration;

    /// A gate the test opens; an item's drop waits for it (up to 10 s).
    #[derive(Default)]
    struct Gate {
        open: Mutex<bool>,
        opened: Condvar,
    }

    /// Counts the drops that happened after the gate opened.
    struct WaitsForGate {
        gate: Arc<Gate>,
        dropped_after_opening: Arc<AtomicUsize>,
    }

    impl Drop for WaitsForGate {
        fn drop(&mut self) {
            let open = self.gate.open.lock().unwrap();
            let (open, _) = self
                .gate
                .opened
                .wait_timeout_while(open, Duration::from_secs(10), |open| !*open)
                .unwrap();
            if *open {
                self.dropped_after_opening.fetch_add(1, Ordering::SeqCst);
            }
        }
    }

    #[test]
    fn items_are_dropped_on_another_thread_and_flush_waits_for_all_of_them() {
        let disposal = Disposal::start();
        let gate = Arc::new(Gate::default());
        let dropped = Arc::new(AtomicUsize::new(0));
        for _ in 0..3 {
            disposal.dispose(Box::new(WaitsForGate {
                gate: gate.clone(),
                dropped_after_opening: dropped.clone(),
            }));
        }
        // Had `dispose` dropped here, each drop would have waited out its 10 s and not counted.
        assert!(disposal.pending());
        assert_eq!(dropped.load(Ordering::SeqCst), 0);
        *gate.open.lock().unwrap() = true;
        gate.opened.notify_all();
        disposal.flush();
        assert_eq!(dropped.load(Ordering::SeqCst), 3);
        assert!(!disposal.pending());
    }

    /// Records the name of the thread that drops it.
    struct NotesItsDropper(Arc<Mutex<Option<String>>>);

    impl Drop for NotesItsDropper {
        fn drop(&mut self) {
            *self.0.lock().unwrap() = std::thread::current().name().map(str::to_string);
        }
    }

    #[test]
    fn an_item_a_job_still_holds_is_dropped_here_once_the_job_lets_go() {
        let disposal = Disposal::start();
        let dropper = Arc::new(Mutex::new(None));
        let item = Arc::new(NotesItsDropper(dropper.clone()));
        let job = item.clone();
        disposal.dispose_when_last(item);
        // Not waited for by a flush: its memory is the job's until the job ends.
        disposal.flush();
        assert!(dropper.lock().unwrap().is_none(), "dropped while the job held it");
        // The job ends on a thread of its own and lets go: not the last holder, it frees nothing.
        std::thread::Builder::new()
            .name("lane".into())
            .spawn(move || drop(job))
            .unwrap()
            .join()
            .unwrap();
        let deadline = std::time::Instant::now() + Duration::from_secs(10);
        while dropper.lock().unwrap().is_none() {
            assert!(std::time::Instant::now() < deadline, "never dropped");
            std::thread::sleep(Duration::from_millis(1));
        }
        assert_eq!(dropper.lock().unwrap().as_deref(), Some("agora-host-dispose"));
    }

    #[test]
    fn a_flush_with_nothing_handed_over_returns_at_once() {
        let disposal = Disposal::start();
        disposal.flush();
        assert!(!disposal.pending());
    }
}
