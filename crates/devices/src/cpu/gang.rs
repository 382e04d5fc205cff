//! A gang: the helper threads of one lane, which run stripes of the leader's current job.
//!
//! Helpers are members of their lane's [`LaneClass`], so they run each stripe at the OS priority
//! of the class of the job it belongs to, as the lane thread does.

use std::ops::Range;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex};

use agora_protocol::TaskError;

use crate::priority::LaneClass;

/// The stripe function of the current job, with its lifetime erased (see `Gang::run`).
type StripeFn = *const (dyn Fn(Range<u64>) + Sync);

#[derive(Debug)]
struct Shared {
    state: Mutex<State>,
    start: Condvar,
    finished: Condvar,
    remaining: AtomicUsize,
    faulted: AtomicBool,
}

#[derive(Debug)]
struct State {
    generation: u64,
    work: Option<(SendPtr, u64)>,
    stopping: bool,
}

#[derive(Debug, Clone, Copy)]
struct SendPtr(StripeFn);
// SAFETY: the pointee is `Sync` and outlives every use (the leader waits for all helpers).
unsafe impl Send for SendPtr {}

/// Helpers of one lane. With one thread per lane it has no helpers and `run` is never used.
#[derive(Debug)]
pub(crate) struct Gang {
    shared: Arc<Shared>,
    threads: usize,
}

impl Gang {
    /// Starts the `threads - 1` helpers of lane `lane`, members of the lane's `class`.
    pub(crate) fn start(
        lane: usize,
        threads: usize,
        class: &Arc<LaneClass>,
    ) -> std::io::Result<(Gang, Vec<std::thread::JoinHandle<()>>)> {
        let shared = Arc::new(Shared {
            state: Mutex::new(State {
                generation: 0,
                work: None,
                stopping: false,
            }),
            start: Condvar::new(),
            finished: Condvar::new(),
            remaining: AtomicUsize::new(0),
            faulted: AtomicBool::new(false),
        });
        let mut handles = Vec::new();
        for stripe in 1..threads {
            let s = shared.clone();
            let class = class.clone();
            handles.push(
                std::thread::Builder::new()
                    .name(format!("agora-cpu-lane{lane}-{stripe}"))
                    .spawn(move || {
                        let _member = class.join();
                        helper(&s, stripe, threads)
                    })?,
            );
        }
        Ok((Gang { shared, threads }, handles))
    }

    pub(crate) fn threads(&self) -> usize {
        self.threads
    }

    /// Runs `f` over `0..rows` split into one stripe per thread; returns when all are done.
    pub(crate) fn run(&self, rows: u64, f: &(dyn Fn(Range<u64>) + Sync)) -> Result<(), TaskError> {
        let s = &self.shared;
        s.faulted.store(false, Ordering::Relaxed);
        s.remaining.store(self.threads - 1, Ordering::Release);
        // Lifetime erasure, so helpers on other threads can hold the pointer.
        // SAFETY: helpers dereference the pointer only between this publish and their decrement
        // of `remaining`, and we do not return before `remaining` is zero, so `f` outlives every
        // use; the fat pointer's layout is unchanged.
        let erased: StripeFn = unsafe { std::mem::transmute::<&(dyn Fn(Range<u64>) + Sync), StripeFn>(f) };
        {
            let mut st = s.state.lock().unwrap_or_else(|e| e.into_inner());
            st.generation += 1;
            st.work = Some((SendPtr(erased), rows));
        }
        s.start.notify_all();
        let own = super::run_guarded(&|| f(stripe(rows, 0, self.threads)));
        let mut st = s.state.lock().unwrap_or_else(|e| e.into_inner());
        while s.remaining.load(Ordering::Acquire) > 0 {
            st = s.finished.wait(st).unwrap_or_else(|e| e.into_inner());
        }
        st.work = None;
        drop(st);
        own?;
        if s.faulted.load(Ordering::Relaxed) {
            return Err(TaskError::KernelFault);
        }
        Ok(())
    }

    pub(crate) fn stop(&self) {
        self.shared.state.lock().unwrap_or_else(|e| e.into_inner()).stopping = true;
        self.shared.start.notify_all();
    }
}

fn stripe(rows: u64, index: usize, threads: usize) -> Range<u64> {
    let per = rows.div_ceil(threads as u64);
    let start = (per * index as u64).min(rows);
    start..(start + per).min(rows)
}

fn helper(s: &Shared, index: usize, threads: usize) {
    let mut seen = 0u64;
    loop {
        let (ptr, rows) = {
            let mut st = s.state.lock().unwrap_or_else(|e| e.into_inner());
            loop {
                if st.stopping {
                    return;
                }
                if st.generation != seen {
                    if let Some(w) = st.work {
                        seen = st.generation;
                        break w;
                    }
                }
                st = s.start.wait(st).unwrap_or_else(|e| e.into_inner());
            }
        };
        // SAFETY: see `Gang::run`: the leader keeps the function alive until we decrement.
        let f = unsafe { &*ptr.0 };
        if super::run_guarded(&|| f(stripe(rows, index, threads))).is_err() {
            s.faulted.store(true, Ordering::Relaxed);
        }
        if s.remaining.fetch_sub(1, Ordering::AcqRel) == 1 {
            let _guard = s.state.lock().unwrap_or_else(|e| e.into_inner());
            s.finished.notify_all();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stripes_cover_rows_exactly_once() {
        for rows in [1u64, 2, 7, 100, 101] {
            for threads in 1..5 {
                let mut covered = vec![0; rows as usize];
                for i in 0..threads {
                    for r in stripe(rows, i, threads) {
                        covered[r as usize] += 1;
                    }
                }
                assert!(covered.iter().all(|c| *c == 1), "rows {rows} threads {threads}");
            }
        }
    }
}

#[cfg(test)]
mod class_tests {
    use super::*;
    use crate::priority::{current_thread_priority, BatchPriority, Class, LanePriorities, SCHED_BATCH, SCHED_OTHER};

    #[test]
    fn helpers_run_stripes_at_the_priority_of_the_lanes_class() {
        let priorities = LanePriorities::resolve(BatchPriority::Batch);
        let class = LaneClass::new(&priorities);
        let (gang, helpers) = Gang::start(0, 3, &class).unwrap();
        let _leader = class.join();
        let seen = Mutex::new(Vec::new());
        let record = |_: Range<u64>| seen.lock().unwrap().push(current_thread_priority().unwrap().0);
        for (class_now, policy) in [
            (Class::Batch, SCHED_BATCH),
            (Class::Latency, SCHED_OTHER),
            (Class::Batch, SCHED_BATCH),
        ] {
            class.set(class_now);
            gang.run(3, &record).unwrap();
            let seen = std::mem::take(&mut *seen.lock().unwrap());
            assert_eq!(seen, [policy; 3], "{class_now:?}: the leader and both helpers");
        }
        class.set(Class::Latency);
        gang.stop();
        for h in helpers {
            h.join().unwrap();
        }
    }
}
