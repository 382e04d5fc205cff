//! One CPU lane: a FIFO of jobs and the gang of threads that runs them.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use agora_protocol::control::LaneStatus;
use agora_protocol::TaskError;

use super::gang::Gang;
use crate::Job;

/// How long an idle leader polls before it sleeps. Short: lanes matter for throughput, not for
/// the latency of tiny tasks (those run inline on the dispatcher).
const IDLE_SPIN: Duration = Duration::from_micros(20);

#[derive(Debug, Default)]
struct Queue {
    jobs: VecDeque<Job>,
    sleeping: bool,
    stopping: bool,
}

/// A lane.
#[derive(Debug)]
pub(crate) struct Lane {
    queue: Mutex<Queue>,
    wake: Condvar,
    pending: AtomicUsize,
    busy: AtomicBool,
    completed: AtomicU64,
    busy_ns: AtomicU64,
}

impl Lane {
    /// Starts the lane's leader and helpers.
    pub(crate) fn start(
        index: usize,
        threads: usize,
    ) -> std::io::Result<(Arc<Lane>, Vec<std::thread::JoinHandle<()>>)> {
        let lane = Arc::new(Lane {
            queue: Mutex::new(Queue::default()),
            wake: Condvar::new(),
            pending: AtomicUsize::new(0),
            busy: AtomicBool::new(false),
            completed: AtomicU64::new(0),
            busy_ns: AtomicU64::new(0),
        });
        let (gang, mut handles) = Gang::start(index, threads)?;
        let leader_lane = lane.clone();
        handles.push(
            std::thread::Builder::new()
                .name(format!("agora-cpu-lane{index}"))
                .spawn(move || leader_lane.run(gang))?,
        );
        Ok((lane, handles))
    }

    pub(crate) fn push(&self, job: Job) {
        let mut q = self.queue.lock().unwrap_or_else(|e| e.into_inner());
        if q.stopping {
            drop(q);
            (job.done)(Err(TaskError::Cancelled));
            return;
        }
        q.jobs.push_back(job);
        self.pending.fetch_add(1, Ordering::Release);
        let notify = q.sleeping;
        drop(q);
        if notify {
            self.wake.notify_one();
        }
    }

    pub(crate) fn load(&self) -> usize {
        self.pending.load(Ordering::Relaxed) + usize::from(self.busy.load(Ordering::Relaxed))
    }

    pub(crate) fn stop(&self) {
        let jobs = {
            let mut q = self.queue.lock().unwrap_or_else(|e| e.into_inner());
            q.stopping = true;
            std::mem::take(&mut q.jobs)
        };
        self.wake.notify_all();
        for job in jobs {
            self.pending.fetch_sub(1, Ordering::Relaxed);
            (job.done)(Err(TaskError::Cancelled));
        }
    }

    pub(crate) fn status(&self) -> LaneStatus {
        LaneStatus {
            busy: self.busy.load(Ordering::Relaxed),
            queued: self.pending.load(Ordering::Relaxed) as u64,
            completed: self.completed.load(Ordering::Relaxed),
            busy_ns: self.busy_ns.load(Ordering::Relaxed),
        }
    }

    fn next(&self) -> Option<Job> {
        let spin_until = Instant::now() + IDLE_SPIN;
        loop {
            if self.pending.load(Ordering::Acquire) > 0 || Instant::now() >= spin_until {
                break;
            }
            std::hint::spin_loop();
        }
        let mut q = self.queue.lock().unwrap_or_else(|e| e.into_inner());
        loop {
            if let Some(job) = q.jobs.pop_front() {
                self.pending.fetch_sub(1, Ordering::Relaxed);
                self.busy.store(true, Ordering::Relaxed);
                return Some(job);
            }
            if q.stopping {
                return None;
            }
            q.sleeping = true;
            q = self.wake.wait(q).unwrap_or_else(|e| e.into_inner());
            q.sleeping = false;
        }
    }

    fn run(&self, gang: Gang) {
        while let Some(job) = self.next() {
            let start = Instant::now();
            let cancelled = job.cancelled.as_ref().is_some_and(|c| c.load(Ordering::Acquire));
            let result = if cancelled {
                Err(TaskError::Cancelled)
            } else {
                super::execute(&job.work, Some(&gang))
            };
            self.busy_ns
                .fetch_add(start.elapsed().as_nanos() as u64, Ordering::Relaxed);
            self.completed.fetch_add(1, Ordering::Relaxed);
            self.busy.store(false, Ordering::Relaxed);
            let Job { done, keepalive, .. } = job;
            done(result);
            // Release the memory only after the completion is posted.
            drop(keepalive);
        }
        gang.stop();
    }
}
