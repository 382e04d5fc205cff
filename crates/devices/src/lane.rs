//! A lane: a FIFO of jobs and the thread that runs them one at a time, in order.
//!
//! Shared by every backend; what running a job means is the backend's [`Executor`]. Idle lane
//! threads spin briefly, then sleep on a condition variable that submitters signal only when the
//! thread said it sleeps, so a busy lane costs no system call per job.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use agora_protocol::control::LaneStatus;
use agora_protocol::TaskError;

use crate::{Job, Transfer, Work};

/// How long an idle leader polls before it sleeps. Short: lanes matter for throughput, not for
/// the latency of tiny tasks (those run inline on the dispatcher).
const IDLE_SPIN: Duration = Duration::from_micros(20);

#[derive(Debug, Default)]
struct Queue {
    jobs: VecDeque<Job>,
    sleeping: bool,
    stopping: bool,
}

/// How a backend runs the jobs of one lane (on the lane's thread).
pub trait Executor: Send + 'static {
    /// Copies host bytes into one of this device's buffers.
    fn to_device(&mut self, host: *const u8, len: usize, to: &dyn crate::DeviceBuffer) -> Result<(), TaskError>;
    /// Runs the work (after the job's transfers).
    fn execute(&mut self, work: &Work) -> Result<(), TaskError>;
    /// Called once when the lane stops.
    fn stop(&mut self) {}
}

/// Runs a job's transfers, then its work.
fn run_job(executor: &mut dyn Executor, job: &Job) -> Result<(), TaskError> {
    for transfer in &job.transfers {
        match transfer {
            Transfer::ToDevice { host, len, to } => executor.to_device(*host, *len, to.as_ref())?,
            Transfer::ToHost {
                from,
                device,
                host,
                len,
            } => {
                // SAFETY: the scheduler built this transfer from a live buffer's host range of
                // `len` bytes, kept mapped by the job until it completes.
                unsafe { device.read(from.as_ref(), *host, *len)? }
            }
        }
    }
    executor.execute(&job.work)
}

/// A lane.
#[derive(Debug)]
pub struct Lane {
    queue: Mutex<Queue>,
    wake: Condvar,
    pending: AtomicUsize,
    busy: AtomicBool,
    completed: AtomicU64,
    busy_ns: AtomicU64,
}

impl Lane {
    /// Starts the lane's leader and helpers.
    /// Starts the lane's thread, named `name`, running jobs with `executor`.
    pub fn start(
        name: String,
        executor: Box<dyn Executor>,
    ) -> std::io::Result<(Arc<Lane>, std::thread::JoinHandle<()>)> {
        let lane = Arc::new(Lane {
            queue: Mutex::new(Queue::default()),
            wake: Condvar::new(),
            pending: AtomicUsize::new(0),
            busy: AtomicBool::new(false),
            completed: AtomicU64::new(0),
            busy_ns: AtomicU64::new(0),
        });
        let runner = lane.clone();
        let handle = std::thread::Builder::new()
            .name(name)
            .spawn(move || runner.run(executor))?;
        Ok((lane, handle))
    }

    /// Appends a job.
    pub fn push(&self, job: Job) {
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

    /// Jobs queued or running.
    pub fn load(&self) -> usize {
        self.pending.load(Ordering::Relaxed) + usize::from(self.busy.load(Ordering::Relaxed))
    }

    /// Cancels queued jobs and stops the thread after the running one.
    pub fn stop(&self) {
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

    /// A status snapshot.
    pub fn status(&self) -> LaneStatus {
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

    fn run(&self, mut executor: Box<dyn Executor>) {
        while let Some(job) = self.next() {
            let start = Instant::now();
            let cancelled = job.cancelled.as_ref().is_some_and(|c| c.load(Ordering::Acquire));
            let result = if cancelled {
                Err(TaskError::Cancelled)
            } else {
                run_job(executor.as_mut(), &job)
            };
            self.busy_ns
                .fetch_add(start.elapsed().as_nanos() as u64, Ordering::Relaxed);
            self.completed.fetch_add(1, Ordering::Relaxed);
            self.busy.store(false, Ordering::Relaxed);
            let Job {
                done,
                keepalive,
                transfers,
                work,
                ..
            } = job;
            done(result);
            // Release the memory only after the completion is posted.
            drop((keepalive, transfers, work));
        }
        executor.stop();
    }
}
