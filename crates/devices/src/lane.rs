//! A lane: a queue of jobs and the thread that starts them, one at a time.
//!
//! Shared by every backend; what running a job means is the backend's [`Executor`]. An executor
//! may finish a job before it returns (the CPU) or later, from another thread, once the device
//! reports completion (OpenCL event callbacks) — so a lane can keep a device's command queue full
//! while earlier commands run. Either way it calls [`JobEnd::finish`] exactly once per job, and
//! finishes a lane's jobs in the order they started.
//!
//! Idle lane threads spin (for a budget learned from the gaps between their recent jobs, yielding
//! their core to others meanwhile: [`agora_wait::AdaptiveSpin`]), then sleep on a condition
//! variable that submitters signal only when the thread said it sleeps, so a lane fed one job at
//! a time by a round-trip client takes each without a wake-up system call, and a busy lane costs
//! none per job.
//!
//! A chunked launch ([`Job::slices`]) waits in the queue as one job with a cursor over its row
//! slices; the lane makes a slice's job (`Work::Launch::rows`) only as it starts it, and only
//! while fewer than [`SLICE_DEPTH`] jobs are in flight: on an asynchronous device the lane would
//! otherwise enqueue every slice at once, and a latency-class job arriving later would wait
//! behind all of them in the device's queue. Other jobs keep the device's queue as full as they
//! like. A launch cut into 4096 slices so costs one queued job, not 4096 (a flood of such
//! launches once queued over a million jobs and a gigabyte).
//!
//! Order: deadline-class jobs (nodes of admitted real-time DAGs, [`Job::deadline`]) start
//! first, earliest absolute deadline first (EDF; equal deadlines in push order), then
//! latency-class jobs in push order, then batch work: each tenant's in push order, tenants by
//! weight within their group (a user, a Slurm job), groups by weight ([`crate::Share`], module
//! `fair`). None of them interrupts a job already started: a
//! sliced batch launch yields at its next slice boundary, where another tenant's job may go
//! first.
//!
//! OS priority: a lane's threads run batch jobs at the lane's batch priority and latency-class
//! jobs at normal priority ([`crate::priority`]); the lane thread switches when it starts a job of
//! the other class, and a latency job pushed onto a lane raises it at once (it may wait behind a
//! batch slice, which then finishes at normal priority).

mod fair;

use std::any::Any;
use std::collections::{BinaryHeap, VecDeque};

/// Jobs a lane's queues keep room for when empty; beyond, the room goes back after a flood.
const SHRINK_ABOVE: usize = 1024;
use std::sync::atomic::{fence, AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, OnceLock};
use std::time::{Duration, Instant};

use agora_protocol::TaskError;
use agora_wait::AdaptiveSpin;

use crate::priority::{Class, LaneClass};
use crate::Share;
use crate::{Job, JobTimes, LaneReport, Slices, Transfer, Work};

/// Longest an idle lane thread polls for its next job before it sleeps (the budget adapts below
/// it, down to [`agora_wait::MIN_BUDGET`]): a little more than a round trip through a client, so
/// a client issuing one task at a time finds the lane still awake.
const IDLE_SPIN_MAX: Duration = Duration::from_micros(250);

/// Whether idle lane threads of this process spin before they sleep ([`set_idle_spin`]).
static IDLE_SPIN: AtomicBool = AtomicBool::new(true);

/// Makes the lanes that [`Lane::start`] starts from now on in this process sleep at once when
/// idle instead of spinning for their next job (see [`Lane::start_with`]).
pub fn set_idle_spin(spin: bool) {
    IDLE_SPIN.store(spin, Ordering::Relaxed);
}

/// Whether [`Lanes::submit`] in this process starts a job on the calling thread when its lane is
/// idle ([`set_start_on_caller`]).
static START_ON_CALLER: AtomicBool = AtomicBool::new(false);

/// Makes [`Lanes::submit`] start a job on the calling thread, not the lane's, when the lane has
/// nothing queued or being started and the job needs no waiting (not revocable, exclusive,
/// sliced or with a deadline; an urgent job may): one thread hand-off less per job. For a device
/// host only, whose single message loop submits every job and whose daemon-side lanes already
/// order them (docs/PERFORMANCE.md, "Device hosts: the hop"). A job whose start would block (host
/// work, a first program build) must not hold that loop: the executors say so
/// ([`Executor::starts_at_once`]) and such a job goes through the lane's thread.
pub fn set_start_on_caller(on: bool) {
    START_ON_CALLER.store(on, Ordering::Relaxed);
}

/// Most jobs in flight when a lane starts a slice of a chunked launch: one running and one queued
/// behind it keep the device busy, and an urgent job waits for at most these two.
pub const SLICE_DEPTH: usize = 2;

/// How a backend runs the jobs of one lane (started on the lane's thread).
pub trait Executor: Send + 'static {
    /// Starts `transfers` then `work`; calls `end.finish` when they are done (now or later).
    fn run(&mut self, transfers: Vec<Transfer>, work: Work, end: JobEnd);
    /// Whether [`Executor::run`] would start this job without waiting for anything (earlier
    /// jobs, another device), so a caller may run it on its own thread ([`Lane::set_starts_on_caller`]).
    /// The default: yes (the CPU and sim executors; OpenCL and CUDA say no for a first launch, host
    /// work or a read from another device, which would hold a device host's message loop).
    fn starts_at_once(&self, _transfers: &[Transfer], _work: &Work) -> bool {
        true
    }
    /// Called once when the lane stops.
    fn stop(&mut self) {}
}

/// The end of one job: posts its outcome and updates the lane's counters.
pub struct JobEnd {
    lane: Arc<Lane>,
    done: Box<dyn FnOnce(Result<(), TaskError>, JobTimes) + Send>,
    keepalive: Option<Arc<dyn Any + Send + Sync>>,
    queued: Instant,
    started: Instant,
    transfers_done: Arc<OnceLock<Instant>>,
    cold: bool,
    revoke: Option<Arc<AtomicBool>>,
    urgent: bool,
    /// A batch job's tenant and what starting it charged there, settled to the time it took
    /// when it finishes ([`fair::FairQueue::settle`]).
    charged: Option<(Share, u64)>,
}

impl JobEnd {
    /// Whether the job is latency-class or has a deadline: work a device with hardware
    /// priorities (a GPU's stream priorities) runs ahead of batch work.
    pub fn urgent(&self) -> bool {
        self.urgent
    }

    /// The job's revocation flag ([`Job::revoke`]), for executors that poll it while the work
    /// runs.
    pub fn revoke_flag(&self) -> Option<&Arc<AtomicBool>> {
        self.revoke.as_ref()
    }

    /// Finishes the job with `result`. Memory the job used is released after the outcome is
    /// posted.
    pub fn finish(self, result: Result<(), TaskError>) {
        let JobEnd {
            lane,
            done,
            keepalive,
            queued,
            started,
            transfers_done,
            cold,
            revoke: _,
            urgent: _,
            charged,
        } = self;
        lane.completed.fetch_add(1, Ordering::Relaxed);
        let times = JobTimes {
            queued,
            started,
            transfers_done: transfers_done.get().copied(),
            finished: Instant::now(),
            cold,
        };
        if let Some((share, charged_ns)) = charged {
            let ran_ns =
                u64::try_from(times.finished.saturating_duration_since(started).as_nanos()).unwrap_or(u64::MAX);
            lane.queue
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .jobs
                .settle(&share, charged_ns, ran_ns);
        }
        done(result, times);
        if lane.in_flight.fetch_sub(1, Ordering::SeqCst) == 1 {
            // The lane goes idle: count the wall time it had work in flight (jobs overlap on
            // asynchronous devices, so per-job times would add up to more than the wall time).
            let since = lane.busy_since.load(Ordering::Relaxed);
            lane.busy_ns
                .fetch_add(lane.epoch.elapsed().as_nanos() as u64 - since, Ordering::Relaxed);
        }
        // SeqCst with the lane's store before it re-checks `in_flight`: either it sees this
        // decrement or this sees it waiting, so it is never left asleep with room to start. The
        // fences (here and in `next`) state that pairing in the terms loom checks (it treats
        // SeqCst accesses as acquire/release: crates/protocol/tests/loom.rs, the lane room
        // model); on x86 the locked read-modify-write above is a full barrier already.
        fence(Ordering::SeqCst);
        if lane.awaiting_room.load(Ordering::SeqCst) {
            let _queue = lane.queue.lock().unwrap_or_else(|e| e.into_inner());
            lane.wake.notify_one();
        }
        drop(keepalive);
    }

    /// Marks the job as having paid a one-time cost (see [`JobTimes::cold`]).
    pub fn mark_cold(&mut self) {
        self.cold = true;
    }

    /// The device could not have started this job before `at` (its predecessor on an in-order
    /// stream finished then): its times start no earlier. Without it, a job queued behind
    /// others on a GPU stream counts their time as its own, and the performance model learns
    /// that a 100 µs kernel takes as long as the whole queue ahead of it (which then made nw's
    /// diagonals look long enough to run revocable, each saving its 64 MiB first).
    pub fn started_no_earlier_than(&mut self, at: Instant) {
        self.started = self.started.max(at);
    }

    /// Records that the job's transfers are done (now). Executors call it, or hand the
    /// [`JobEnd::transfers_marker`] to whoever learns it later.
    pub fn transfers_done(&self) {
        let _ = self.transfers_done.set(Instant::now());
    }

    /// A handle that records the end of the job's transfers when set (from any thread).
    pub fn transfers_marker(&self) -> Arc<OnceLock<Instant>> {
        self.transfers_done.clone()
    }
}

#[derive(Default)]
struct Queue {
    /// Deadline-class jobs, earliest deadline first, started before any other.
    deadline: BinaryHeap<ByDeadline>,
    /// Pushes so far, to keep jobs with equal deadlines in push order.
    deadline_pushes: u64,
    /// Latency-class jobs, started before any of `jobs`.
    urgent: VecDeque<Queued>,
    /// Batch jobs, each tenant's in order, tenants by weight.
    jobs: fair::FairQueue<Queued>,
    sleeping: bool,
    stopping: bool,
    /// The lane thread took a job and has not finished starting it (a caller must not start a
    /// later one before it: [`Lane::start_here`]).
    starting: bool,
}

/// A deadline job in the lane's heap: the earliest deadline (then the earliest push) on top.
struct ByDeadline {
    deadline: Instant,
    push: u64,
    queued: Queued,
}

impl PartialEq for ByDeadline {
    fn eq(&self, other: &Self) -> bool {
        (self.deadline, self.push) == (other.deadline, other.push)
    }
}

impl Eq for ByDeadline {}

impl PartialOrd for ByDeadline {
    fn partial_cmp(&self, other: &Self) -> Option<std::cmp::Ordering> {
        Some(self.cmp(other))
    }
}

impl Ord for ByDeadline {
    /// Reversed: `BinaryHeap` is a max-heap, and the earliest deadline must come out first.
    fn cmp(&self, other: &Self) -> std::cmp::Ordering {
        (other.deadline, other.push).cmp(&(self.deadline, self.push))
    }
}

/// A job in a lane's queue: when queued, and for a sliced launch, where its next slice starts.
struct Queued {
    job: Job,
    at: Instant,
    cursor: Option<Box<Cursor>>,
}

impl Queued {
    fn new(mut job: Job) -> Queued {
        let cursor = match (job.slices.take(), &job.work) {
            (Some(slices), Work::Launch { range, rows: None, .. }) if slices.count > 1 => {
                let done = std::mem::replace(&mut job.done, Box::new(|_, _| {}));
                Some(Box::new(Cursor::new(range[0], slices, done)))
            }
            _ => None,
        };
        Queued {
            job,
            at: Instant::now(),
            cursor,
        }
    }

    /// What starting it (or its next slice) charges its tenant: the job's predicted time, a
    /// slice's share of it.
    fn charge_ns(&self) -> u64 {
        let slices = self.cursor.as_ref().map_or(1, |c| c.count.max(1));
        self.job.share.cost_ns / slices
    }

    /// Puts it back at the front of its tenant's batch jobs.
    fn requeue_front(self, jobs: &mut fair::FairQueue<Queued>) {
        let share = self.job.share;
        jobs.push_front(&share, self);
    }

    /// Whether this is (a slice of) a chunked launch, started only under [`SLICE_DEPTH`].
    fn is_slice(&self) -> bool {
        self.cursor.is_some() || is_slice(&self.job)
    }

    /// Completes the job, or the slices of it not yet started, with `Cancelled`.
    fn cancel(self) {
        match self.cursor {
            Some(cursor) => cursor.group.cancel_rest(),
            None => {
                let now = Instant::now();
                (self.job.done)(
                    Err(TaskError::Cancelled),
                    JobTimes {
                        queued: self.at,
                        started: now,
                        transfers_done: None,
                        finished: now,
                        cold: false,
                    },
                );
            }
        }
    }
}

/// Where a sliced launch is: its next slice, and what its slices share.
struct Cursor {
    rows: u64,
    align: u64,
    units: u64,
    count: u64,
    next: u64,
    group: Arc<Group>,
}

impl Cursor {
    fn new(rows: u64, slices: Slices, done: Done) -> Cursor {
        let align = slices.align.max(1);
        let units = rows.div_ceil(align).max(1);
        Cursor {
            rows,
            align,
            units,
            count: slices.count.clamp(1, units),
            next: 0,
            group: Arc::new(Group {
                state: Mutex::new(GroupState {
                    outstanding: 0,
                    exhausted: false,
                    first_error: None,
                    first_times: None,
                    cold: false,
                    done: Some(done),
                }),
            }),
        }
    }

    /// The first row of slice `slice`.
    fn boundary(&self, slice: u64) -> u64 {
        let unit = (u128::from(self.units) * u128::from(slice) / u128::from(self.count)) as u64;
        self.align.saturating_mul(unit).min(self.rows)
    }

    /// The job of the next slice of `launch` (which keeps the launch's work, and its transfers
    /// until the first slice takes them); `true` with it when it is the last. A cancelled launch
    /// is finished as one slice over the rows left (it is skipped anyway).
    fn take(&mut self, launch: &mut Job) -> (Job, bool) {
        let cancelled = launch.cancelled.as_ref().is_some_and(|c| c.load(Ordering::Acquire));
        let start = self.boundary(self.next);
        self.next = if cancelled { self.count } else { self.next + 1 };
        let end = self.boundary(self.next);
        let last = self.next >= self.count;
        {
            let mut state = self.group.state.lock().unwrap_or_else(|e| e.into_inner());
            state.outstanding += 1;
            state.exhausted = last;
        }
        let mut work = launch.work.clone();
        if let Work::Launch { rows, .. } = &mut work {
            *rows = Some(start..end);
        }
        let group = self.group.clone();
        let job = Job {
            transfers: std::mem::take(&mut launch.transfers),
            work,
            keepalive: launch.keepalive.clone(),
            cancelled: launch.cancelled.clone(),
            revoke: None,
            urgent: false,
            exclusive: false,
            deadline: None,
            slices: None,
            share: launch.share,
            done: Box::new(move |result, times| group.slice_done(result, times)),
        };
        (job, last)
    }
}

type Done = Box<dyn FnOnce(Result<(), TaskError>, JobTimes) + Send>;

/// What the slices of one launch share: the launch completes once, when its last slice has.
struct Group {
    state: Mutex<GroupState>,
}

struct GroupState {
    /// Slices made and not finished.
    outstanding: u64,
    /// Every slice was made (or the rest cancelled).
    exhausted: bool,
    first_error: Option<TaskError>,
    first_times: Option<JobTimes>,
    cold: bool,
    done: Option<Done>,
}

impl Group {
    fn slice_done(&self, result: Result<(), TaskError>, times: JobTimes) {
        let finished = {
            let mut state = self.state.lock().unwrap_or_else(|e| e.into_inner());
            if let Err(e) = result {
                state.first_error.get_or_insert(e);
            }
            state.first_times.get_or_insert(times);
            state.cold |= times.cold;
            state.outstanding -= 1;
            Self::finished(&mut state, times)
        };
        if let Some((done, outcome, times)) = finished {
            done(outcome, times);
        }
    }

    /// The slices not yet made will not be: the launch is cancelled.
    fn cancel_rest(&self) {
        let finished = {
            let mut state = self.state.lock().unwrap_or_else(|e| e.into_inner());
            state.first_error.get_or_insert(TaskError::Cancelled);
            state.exhausted = true;
            let now = Instant::now();
            let times = JobTimes {
                queued: now,
                started: now,
                transfers_done: None,
                finished: now,
                cold: false,
            };
            Self::finished(&mut state, times)
        };
        if let Some((done, outcome, times)) = finished {
            done(outcome, times);
        }
    }

    /// When the last slice is done: the launch's `done`, outcome and times (`last`: the times of
    /// the slice that finished last).
    fn finished(state: &mut GroupState, last: JobTimes) -> Option<(Done, Result<(), TaskError>, JobTimes)> {
        if !state.exhausted || state.outstanding > 0 {
            return None;
        }
        let first = state.first_times.unwrap_or(last);
        let outcome = state.first_error.take().map_or(Ok(()), Err);
        let times = JobTimes {
            finished: last.finished,
            cold: state.cold,
            ..first
        };
        state.done.take().map(|done| (done, outcome, times))
    }
}

/// A lane.
pub struct Lane {
    queue: Mutex<Queue>,
    wake: Condvar,
    pending: AtomicUsize,
    in_flight: AtomicUsize,
    /// The lane thread waits for `in_flight` to drop below [`SLICE_DEPTH`] (finishing jobs wake it).
    awaiting_room: AtomicBool,
    completed: AtomicU64,
    busy_ns: AtomicU64,
    /// Nanoseconds after `epoch` when the lane last went from idle to busy.
    busy_since: AtomicU64,
    epoch: Instant,
    /// The OS priority of the lane's threads.
    class: Arc<LaneClass>,
    /// The lane's executor: the lane thread holds it while it starts a job, a caller of
    /// [`Lane::start_here`] while it starts one on its own thread.
    executor: Mutex<Box<dyn Executor>>,
    /// Whether [`Lanes::submit`] starts this lane's jobs on the caller when it is idle (see
    /// [`Lane::set_starts_on_caller`]), besides the whole process's [`set_start_on_caller`].
    starts_on_caller: AtomicBool,
}

impl std::fmt::Debug for Lane {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Lane").field("status", &self.status()).finish()
    }
}

impl Lane {
    /// Starts the lane's thread, named `name`, running jobs with `executor`, its threads' OS
    /// priority switched by `class` (the executor's own threads, such as a CPU gang's helpers,
    /// join `class` themselves).
    pub fn start(
        name: String,
        executor: Box<dyn Executor>,
        class: Arc<LaneClass>,
    ) -> std::io::Result<(Arc<Lane>, std::thread::JoinHandle<()>)> {
        Self::start_with(name, executor, class, IDLE_SPIN.load(Ordering::Relaxed))
    }

    /// [`Lane::start`], saying whether the idle lane spins for its next job before it sleeps.
    /// Lanes fed by a thread that itself blocks (over a device host's socket) should not: the
    /// spin catches a job no sooner than that thread's wake-up, and on a small machine it holds
    /// a core that thread needs (docs/PERFORMANCE.md, "Device hosts: the hop").
    pub fn start_with(
        name: String,
        executor: Box<dyn Executor>,
        class: Arc<LaneClass>,
        idle_spin: bool,
    ) -> std::io::Result<(Arc<Lane>, std::thread::JoinHandle<()>)> {
        let lane = Arc::new(Lane {
            queue: Mutex::new(Queue::default()),
            wake: Condvar::new(),
            pending: AtomicUsize::new(0),
            in_flight: AtomicUsize::new(0),
            awaiting_room: AtomicBool::new(false),
            completed: AtomicU64::new(0),
            busy_ns: AtomicU64::new(0),
            busy_since: AtomicU64::new(0),
            epoch: Instant::now(),
            class,
            executor: Mutex::new(executor),
            starts_on_caller: AtomicBool::new(false),
        });
        let runner = lane.clone();
        let handle = std::thread::Builder::new()
            .name(name)
            .spawn(move || runner.run(idle_spin))?;
        Ok((lane, handle))
    }

    /// Makes [`Lanes::submit`] start this lane's jobs on the calling thread when the lane is idle
    /// and its executor says the job starts at once ([`Executor::starts_at_once`]), as
    /// [`set_start_on_caller`] does for every lane of a process: for a lane whose start is a
    /// message to another process (a device host's daemon-side lanes), which the dispatcher sends
    /// itself instead of waking the lane's thread to send it.
    pub fn set_starts_on_caller(&self, on: bool) {
        self.starts_on_caller.store(on, Ordering::Relaxed);
    }

    /// Appends a job.
    pub fn push(&self, job: Job) {
        let mut q = self.queue.lock().unwrap_or_else(|e| e.into_inner());
        let queued = Queued::new(job);
        if q.stopping {
            drop(q);
            queued.cancel();
            return;
        }
        if let Some(deadline) = queued.job.deadline {
            // Deadline work runs at the latency class's OS priority, for the same reason.
            self.class.set(Class::Latency);
            q.deadline_pushes += 1;
            let push = q.deadline_pushes;
            q.deadline.push(ByDeadline { deadline, push, queued });
        } else if queued.job.urgent {
            // The lane runs latency work from now on: raised at once, so a batch job it waits
            // behind does not run at batch priority meanwhile (one system call, on a change).
            self.class.set(Class::Latency);
            q.urgent.push_back(queued);
        } else if queued.job.revoke.as_ref().is_some_and(|r| r.replay) {
            queued.requeue_front(&mut q.jobs);
        } else {
            let share = queued.job.share;
            q.jobs.push_back(&share, queued);
        }
        self.pending.fetch_add(1, Ordering::Release);
        let notify = q.sleeping;
        drop(q);
        if notify {
            self.wake.notify_one();
        }
    }

    /// Jobs queued, started or running.
    pub fn load(&self) -> usize {
        self.pending.load(Ordering::Relaxed) + self.in_flight.load(Ordering::Relaxed)
    }

    /// Cancels queued jobs and stops the thread; waits (briefly) for started jobs to finish.
    pub fn stop(&self) {
        let jobs = {
            let mut q = self.queue.lock().unwrap_or_else(|e| e.into_inner());
            q.stopping = true;
            let mut all: VecDeque<Queued> = std::mem::take(&mut q.deadline).into_iter().map(|d| d.queued).collect();
            all.extend(std::mem::take(&mut q.urgent));
            all.extend(q.jobs.drain());
            all
        };
        self.wake.notify_all();
        for queued in jobs {
            self.pending.fetch_sub(1, Ordering::Relaxed);
            queued.cancel();
        }
    }

    /// A status snapshot.
    pub fn status(&self) -> LaneReport {
        LaneReport {
            busy: self.in_flight.load(Ordering::Relaxed) > 0,
            queued: self.pending.load(Ordering::Relaxed) as u64,
            completed: self.completed.load(Ordering::Relaxed),
            busy_ns: self.busy_ns.load(Ordering::Relaxed),
        }
    }

    /// The next job to start, after an idle spin with `spin` (`None`: sleep at once).
    /// With it, what starting it charged its tenant when it is batch work.
    fn next(&self, mut spin: Option<&mut AdaptiveSpin>) -> Option<(Job, Instant, Option<u64>)> {
        if self.pending.load(Ordering::Acquire) == 0 {
            if let Some(spin) = spin.as_deref_mut() {
                spin.spin(|| self.pending.load(Ordering::Acquire) > 0);
            }
        }
        let mut q = self.queue.lock().unwrap_or_else(|e| e.into_inner());
        loop {
            // The job to start, and whether it left the queue (a sliced launch stays until its
            // last slice is made).
            // Deadline jobs first (EDF), then latency-class jobs, then batch work.
            let mut job = match q.deadline.pop() {
                Some(d) => Some(Self::to_start(d.queued, &mut q.jobs)),
                None => q.urgent.pop_front().map(|u| Self::to_start(u, &mut q.jobs)),
            };
            let mut held_back = false;
            let mut charged = None;
            let mut charge = |queued: &Queued| {
                let ns = queued.charge_ns();
                charged = Some(ns);
                ns
            };
            if job.is_none() {
                match q.jobs.front() {
                    Some(front) if front.is_slice() => {
                        self.awaiting_room.store(true, Ordering::SeqCst);
                        // Pairs with the fence in `JobEnd::finish` (see there).
                        fence(Ordering::SeqCst);
                        if q.stopping || self.in_flight.load(Ordering::SeqCst) < SLICE_DEPTH {
                            job = q.jobs.pop_front(&mut charge).map(|f| Self::to_start(f, &mut q.jobs));
                        } else {
                            held_back = true;
                        }
                    }
                    _ => job = q.jobs.pop_front(&mut charge).map(|f| Self::to_start(f, &mut q.jobs)),
                }
            }
            if let Some((job, left_queue)) = job {
                // Under the queue lock, so a latency job pushed meanwhile is seen here or raises
                // the lane after this.
                let class =
                    if job.0.urgent || job.0.deadline.is_some() || !q.urgent.is_empty() || !q.deadline.is_empty() {
                        Class::Latency
                    } else {
                        Class::Batch
                    };
                self.class.set(class);
                self.awaiting_room.store(false, Ordering::Relaxed);
                if left_queue {
                    self.pending.fetch_sub(1, Ordering::Relaxed);
                }
                if self.in_flight.fetch_add(1, Ordering::AcqRel) == 0 {
                    self.busy_since
                        .store(self.epoch.elapsed().as_nanos() as u64, Ordering::Relaxed);
                }
                q.starting = true;
                return Some((job.0, job.1, charged));
            }
            if q.stopping && !held_back {
                return None;
            }
            // Empty after a flood: give the queues' memory back (a peak of queued jobs must
            // not stay reserved for the life of the daemon).
            if q.jobs.is_empty() {
                q.jobs.shrink(SHRINK_ABOVE);
            }
            if q.urgent.is_empty() && q.urgent.capacity() > SHRINK_ABOVE {
                q.urgent.shrink_to(SHRINK_ABOVE);
            }
            // Asleep until a job is pushed or, when a slice is held back, one in flight finishes.
            q.sleeping = true;
            let slept = Instant::now();
            q = self.wake.wait(q).unwrap_or_else(|e| e.into_inner());
            q.sleeping = false;
            if let Some(spin) = spin.as_deref_mut() {
                spin.blocked_for(slept.elapsed());
            }
        }
    }

    /// The job to start for `queued`, just taken from `jobs` (or from the urgent queue): the
    /// job itself, or the next slice of a sliced launch, which goes back to the front of its
    /// tenant's batch jobs until its last slice is made. `true` with it when `queued` left the
    /// queue.
    fn to_start(mut queued: Queued, jobs: &mut fair::FairQueue<Queued>) -> ((Job, Instant), bool) {
        let Some(cursor) = queued.cursor.as_mut() else {
            return ((queued.job, queued.at), true);
        };
        let (slice, last) = cursor.take(&mut queued.job);
        let at = queued.at;
        if !last {
            queued.requeue_front(jobs);
        }
        ((slice, at), last)
    }

    /// Waits until at most `jobs` jobs are in flight (this lane's started, unfinished jobs).
    fn wait_idle(&self, jobs: usize) {
        let mut spins = 0u32;
        while self.in_flight.load(Ordering::Acquire) > jobs {
            if spins < 1000 {
                spins += 1;
                std::hint::spin_loop();
            } else {
                std::thread::sleep(Duration::from_micros(20));
            }
        }
    }

    fn run(self: Arc<Self>, idle_spin: bool) {
        let _member = self.class.join();
        let mut spin = AdaptiveSpin::new(agora_wait::MIN_BUDGET, IDLE_SPIN_MAX);
        while let Some((job, queued, charged)) = self.next(idle_spin.then_some(&mut spin)) {
            {
                let mut executor = self.executor.lock().unwrap_or_else(|e| e.into_inner());
                self.start_job(executor.as_mut(), job, queued, charged);
            }
            // After the executor is let go, so a caller that sees `starting` clear finds it free.
            self.queue.lock().unwrap_or_else(|e| e.into_inner()).starting = false;
        }
        self.executor.lock().unwrap_or_else(|e| e.into_inner()).stop();
        // Started jobs finish on the device's own threads; give them a moment before the
        // device (and the memory their completions refer to) goes away.
        let deadline = Instant::now() + Duration::from_secs(5);
        while self.in_flight.load(Ordering::Acquire) > 0 && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(1));
        }
    }

    /// Starts `job` (counted in flight already) with `executor`, on the calling thread; a batch
    /// job with what starting it `charged` its tenant.
    fn start_job(self: &Arc<Self>, executor: &mut dyn Executor, job: Job, queued: Instant, charged: Option<u64>) {
        let Job {
            transfers,
            work,
            keepalive,
            cancelled,
            revoke,
            done,
            exclusive,
            urgent,
            deadline,
            share,
            ..
        } = job;
        let revocable = revoke.is_some();
        let (revoke, save) = match revoke {
            Some(r) => (Some(r.flag), r.save),
            None => (None, None),
        };
        let mut end = JobEnd {
            lane: self.clone(),
            done,
            keepalive,
            queued,
            started: Instant::now(),
            transfers_done: Arc::new(OnceLock::new()),
            cold: false,
            revoke,
            urgent: urgent || deadline.is_some(),
            charged: charged.map(|ns| (share, ns)),
        };
        let set = |flag: Option<&Arc<AtomicBool>>| flag.is_some_and(|c| c.load(Ordering::Acquire));
        if set(cancelled.as_ref()) || set(end.revoke_flag()) {
            end.finish(Err(TaskError::Cancelled));
            return;
        }
        if exclusive && save.is_none() {
            // Runs alone: what the lane started before it finishes first.
            self.wait_idle(1);
        }
        if let Some(save) = save {
            // A revocable job runs alone: earlier jobs finish first, so what it saves is what
            // it will read.
            self.wait_idle(1);
            if let Err(e) = save() {
                end.finish(Err(e));
                return;
            }
            // The job's time starts after its save: the performance model learns the launch,
            // not the save (counted in, a save longer than the launch made the next launch
            // look long enough to be revocable again, and so on).
            end.started = Instant::now();
        }
        executor.run(transfers, work, end);
        if revocable || exclusive {
            // ... and nothing starts after it until it finished: a replay must run before its
            // queue's later jobs.
            self.wait_idle(0);
        }
    }

    /// Starts `job` on the calling thread when nothing is queued or being started on this lane
    /// and the job needs no waiting (see [`set_start_on_caller`]); else hands it back.
    fn start_here(self: &Arc<Self>, job: Job) -> Option<Job> {
        // An urgent job may: on an idle lane there is nothing for it to overtake, and the OS
        // priority its class asks for is the caller's already (the lane's threads do not run it).
        if job.revoke.is_some()
            || job.exclusive
            || job.deadline.is_some()
            || job.slices.is_some()
            || job.cancelled.as_ref().is_some_and(|c| c.load(Ordering::Acquire))
        {
            return Some(job);
        }
        let q = self.queue.lock().unwrap_or_else(|e| e.into_inner());
        if q.stopping || q.starting || self.pending.load(Ordering::Acquire) > 0 {
            return Some(job);
        }
        // Taken under the queue lock: the lane thread takes the executor only for a job it took
        // from the queue with `starting` set, so none taken before this one can start after it.
        let Ok(mut executor) = self.executor.try_lock() else {
            return Some(job);
        };
        if !executor.starts_at_once(&job.transfers, &job.work) {
            return Some(job);
        }
        drop(q);
        if self.in_flight.fetch_add(1, Ordering::AcqRel) == 0 {
            self.busy_since
                .store(self.epoch.elapsed().as_nanos() as u64, Ordering::Relaxed);
        }
        self.start_job(executor.as_mut(), job, Instant::now(), None);
        None
    }
}

/// Whether `job` is a slice of a chunked launch.
fn is_slice(job: &Job) -> bool {
    matches!(job.work, Work::Launch { rows: Some(_), .. })
}

/// Runs transfers and work synchronously on the calling thread, through `to_device` for
/// host-to-device copies (for executors that have no asynchronous path).
pub fn run_synchronously(
    transfers: &[Transfer],
    work: &Work,
    mut to_device: impl FnMut(*const u8, usize, &dyn crate::DeviceBuffer) -> Result<(), TaskError>,
    execute: impl FnOnce(&Work) -> Result<(), TaskError>,
) -> Result<(), TaskError> {
    for transfer in transfers {
        match transfer {
            Transfer::ToDevice { host, len, to } => to_device(*host, *len, to.as_ref())?,
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
    execute(work)
}

/// The lanes of one device and all the threads behind them.
#[derive(Debug)]
pub struct Lanes {
    lanes: Vec<Arc<Lane>>,
    threads: Mutex<Vec<std::thread::JoinHandle<()>>>,
}

impl Lanes {
    /// Owns `lanes` and `threads` (lane threads and any helper threads).
    pub fn new(lanes: Vec<Arc<Lane>>, threads: Vec<std::thread::JoinHandle<()>>) -> Self {
        Lanes {
            lanes,
            threads: Mutex::new(threads),
        }
    }

    /// Number of lanes.
    pub fn len(&self) -> usize {
        self.lanes.len()
    }

    /// Whether there are none.
    pub fn is_empty(&self) -> bool {
        self.lanes.is_empty()
    }

    /// Appends `job` to lane `lane`.
    pub fn submit(&self, lane: usize, job: Job) {
        let lane = &self.lanes[lane % self.lanes.len()];
        if START_ON_CALLER.load(Ordering::Relaxed) || lane.starts_on_caller.load(Ordering::Relaxed) {
            if let Some(job) = lane.start_here(job) {
                lane.push(job);
            }
        } else {
            lane.push(job);
        }
    }

    /// Jobs queued, started or running on lane `lane`.
    pub fn load(&self, lane: usize) -> usize {
        self.lanes[lane % self.lanes.len()].load()
    }

    /// Status of every lane.
    pub fn statuses(&self) -> Vec<LaneReport> {
        self.lanes.iter().map(|l| l.status()).collect()
    }

    /// Stops every lane and joins the threads (idempotent).
    pub fn shutdown(&self) {
        for lane in &self.lanes {
            lane.stop();
        }
        let handles = std::mem::take(&mut *self.threads.lock().unwrap_or_else(|e| e.into_inner()));
        for h in handles {
            let _ = h.join();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::priority::{self, current_thread_priority, BatchPriority, LanePriorities};
    use std::sync::mpsc;

    /// Reports the lane thread's scheduling policy at the start of each job, and holds a job
    /// until told to go on when `hold` has a receiver, then runs it for `run_for`.
    struct Recorder {
        seen: mpsc::Sender<i32>,
        hold: Option<mpsc::Receiver<()>>,
        run_for: Duration,
    }

    impl Executor for Recorder {
        fn run(&mut self, _transfers: Vec<Transfer>, _work: Work, end: JobEnd) {
            self.seen.send(current_thread_priority().unwrap().0).unwrap();
            if let Some(hold) = &self.hold {
                // Held: report again once released (an urgent job may have been pushed meanwhile).
                hold.recv().unwrap();
                self.seen.send(current_thread_priority().unwrap().0).unwrap();
            }
            std::thread::sleep(self.run_for);
            end.finish(Ok(()));
        }
    }

    /// A lane running [`Recorder`] that holds each job until released: what it saw, the sender
    /// that releases held jobs, the lane, its thread.
    #[allow(clippy::type_complexity)]
    fn held_lane(
        name: &str,
        priorities: &LanePriorities,
    ) -> (
        mpsc::Receiver<i32>,
        mpsc::Sender<()>,
        Arc<Lane>,
        std::thread::JoinHandle<()>,
    ) {
        held_lane_running_for(name, priorities, Duration::ZERO)
    }

    /// [`held_lane`] whose jobs take `run_for` each once released.
    #[allow(clippy::type_complexity)]
    fn held_lane_running_for(
        name: &str,
        priorities: &LanePriorities,
        run_for: Duration,
    ) -> (
        mpsc::Receiver<i32>,
        mpsc::Sender<()>,
        Arc<Lane>,
        std::thread::JoinHandle<()>,
    ) {
        let (seen_tx, seen) = mpsc::channel();
        let (release, hold) = mpsc::channel();
        let executor = Recorder {
            seen: seen_tx,
            hold: Some(hold),
            run_for,
        };
        let (lane, thread) = Lane::start(name.into(), Box::new(executor), LaneClass::new(priorities)).unwrap();
        (seen, release, lane, thread)
    }

    fn job(urgent: bool, done: mpsc::Sender<()>) -> Job {
        Job {
            transfers: Vec::new(),
            work: Work::Nothing,
            keepalive: None,
            cancelled: None,
            revoke: None,
            urgent,
            exclusive: false,
            deadline: None,
            slices: None,
            share: crate::Share::default(),
            done: Box::new(move |r, _| {
                r.unwrap();
                done.send(()).unwrap();
            }),
        }
    }

    /// Records which thread started each job (by the job's tag, its fill value) and holds the
    /// job tagged 1 until released.
    struct Starts {
        seen: mpsc::Sender<(u8, std::thread::ThreadId)>,
        hold: mpsc::Receiver<()>,
    }

    impl Executor for Starts {
        fn run(&mut self, _transfers: Vec<Transfer>, work: Work, end: JobEnd) {
            let Work::Fill { value, .. } = work else { unreachable!() };
            self.seen.send((value, std::thread::current().id())).unwrap();
            if value == 1 {
                self.hold.recv().unwrap();
            }
            end.finish(Ok(()));
        }
    }

    #[test]
    fn with_start_on_caller_an_idle_lane_starts_the_job_on_the_caller_and_order_holds() {
        let (seen_tx, seen) = mpsc::channel();
        let (release, hold) = mpsc::channel();
        let (lane, thread) = Lane::start(
            "caller-lane".into(),
            Box::new(Starts { seen: seen_tx, hold }),
            LaneClass::new(&LanePriorities::normal()),
        )
        .unwrap();
        let (done_tx, done) = mpsc::channel();
        let tagged = |tag: u8, revocable: bool| {
            let mut j = job(false, done_tx.clone());
            j.work = Work::Fill {
                ptr: std::ptr::null_mut(),
                len: 0,
                value: tag,
            };
            if revocable {
                j.revoke = Some(crate::Revocation {
                    flag: Arc::default(),
                    save: None,
                    replay: false,
                });
            }
            j
        };
        let here = std::thread::current().id();
        // Idle: job 0 starts on this thread.
        assert!(lane.start_here(tagged(0, false)).is_none());
        assert_eq!(seen.recv().unwrap(), (0, here));
        done.recv().unwrap();
        // So does an urgent (latency-class) job: nothing to overtake on an idle lane.
        let mut urgent = tagged(3, false);
        urgent.urgent = true;
        assert!(
            lane.start_here(urgent).is_none(),
            "an urgent job on an idle lane waited"
        );
        assert_eq!(seen.recv().unwrap(), (3, here));
        done.recv().unwrap();
        // Job 1 goes to the lane thread and is held there (a revocable job is never started by
        // the caller); while it is being started, job 2 is handed back and queued behind it.
        let Some(first) = lane.start_here(tagged(1, true)) else {
            panic!("a revocable job started on the caller")
        };
        lane.push(first);
        let (one, on) = seen.recv().unwrap();
        assert_eq!(one, 1);
        assert_ne!(on, here, "job 1 runs on the lane's thread");
        let Some(second) = lane.start_here(tagged(2, false)) else {
            panic!("a job started on the caller while an earlier one was being started")
        };
        lane.push(second);
        release.send(()).unwrap();
        done.recv().unwrap();
        let (two, _) = seen.recv().unwrap();
        assert_eq!(two, 2, "job 2 after job 1");
        done.recv().unwrap();
        lane.stop();
        thread.join().unwrap();
    }

    /// Starts only fills of value 0 at once (as a device host's daemon-side executor starts only
    /// jobs whose memory the host maps).
    struct Picky(Starts);

    impl Executor for Picky {
        fn run(&mut self, transfers: Vec<Transfer>, work: Work, end: JobEnd) {
            self.0.run(transfers, work, end)
        }
        fn starts_at_once(&self, _transfers: &[Transfer], work: &Work) -> bool {
            matches!(work, Work::Fill { value: 0, .. })
        }
    }

    #[test]
    fn a_lane_set_to_start_on_its_caller_does_so_only_for_jobs_its_executor_starts_at_once() {
        let (seen_tx, seen) = mpsc::channel();
        let (_release, hold) = mpsc::channel();
        let (lane, thread) = Lane::start(
            "picky-lane".into(),
            Box::new(Picky(Starts { seen: seen_tx, hold })),
            LaneClass::new(&LanePriorities::normal()),
        )
        .unwrap();
        lane.set_starts_on_caller(true);
        let lanes = Lanes::new(vec![lane], vec![thread]);
        let (done_tx, done) = mpsc::channel();
        let fill = |value: u8| {
            let mut j = job(false, done_tx.clone());
            j.work = Work::Fill {
                ptr: std::ptr::null_mut(),
                len: 0,
                value,
            };
            j
        };
        let here = std::thread::current().id();
        lanes.submit(0, fill(0));
        assert_eq!(seen.recv().unwrap(), (0, here), "started on the caller");
        done.recv().unwrap();
        lanes.submit(0, fill(2));
        let (two, on) = seen.recv().unwrap();
        assert_eq!(two, 2);
        assert_ne!(on, here, "a job that would wait goes through the lane's thread");
        done.recv().unwrap();
        lanes.shutdown();
    }

    /// Runs batch, urgent, batch, batch, urgent jobs one at a time on a lane with `priorities`;
    /// returns the policy each ran under.
    fn policies_seen(priorities: &LanePriorities) -> Vec<i32> {
        let (seen_tx, seen) = mpsc::channel();
        let executor = Recorder {
            seen: seen_tx,
            hold: None,
            run_for: Duration::ZERO,
        };
        let (lane, thread) = Lane::start("test-lane".into(), Box::new(executor), LaneClass::new(priorities)).unwrap();
        let (done_tx, done) = mpsc::channel();
        let mut policies = Vec::new();
        for urgent in [false, true, false, false, true] {
            lane.push(job(urgent, done_tx.clone()));
            done.recv().unwrap();
            policies.push(seen.recv().unwrap());
        }
        lane.stop();
        thread.join().unwrap();
        policies
    }

    #[test]
    fn batch_jobs_run_at_the_batch_priority_and_urgent_ones_at_normal() {
        use priority::{SCHED_BATCH as B, SCHED_IDLE as I, SCHED_OTHER as O};
        assert_eq!(policies_seen(&LanePriorities::normal()), [O, O, O, O, O]);
        let batch = LanePriorities::resolve(BatchPriority::Batch);
        assert_eq!(batch.batch(), BatchPriority::Batch, "SCHED_BATCH needs no privilege");
        assert_eq!(policies_seen(&batch), [B, O, B, B, O]);
        let idle = LanePriorities::resolve(BatchPriority::Idle);
        match idle.batch() {
            BatchPriority::Idle => assert_eq!(policies_seen(&idle), [I, O, I, I, O]),
            // Without CAP_SYS_NICE: the fallback, never a latency job at idle priority.
            other => {
                assert_eq!(other, BatchPriority::Batch, "{idle:?}");
                assert_eq!(policies_seen(&idle), [B, O, B, B, O]);
            }
        }
    }

    #[test]
    fn without_privilege_idle_falls_back_and_latency_jobs_still_run_at_normal() {
        std::thread::spawn(|| {
            if !priority::tests::drop_cap_sys_nice() {
                eprintln!("cannot drop CAP_SYS_NICE here (or RLIMIT_NICE allows the way back): skipped");
                return;
            }
            // Lanes started by this thread inherit its capabilities, as a daemon's would.
            let idle = LanePriorities::resolve(BatchPriority::Idle);
            assert_eq!(idle.batch(), BatchPriority::Batch);
            assert!(idle.fallback().unwrap().contains("CAP_SYS_NICE"));
            use priority::{SCHED_BATCH as B, SCHED_OTHER as O};
            assert_eq!(policies_seen(&idle), [B, O, B, B, O]);
        })
        .join()
        .unwrap();
    }

    #[test]
    fn an_urgent_job_raises_a_lane_that_runs_batch_work() {
        let priorities = LanePriorities::resolve(BatchPriority::Idle);
        let (seen, release, lane, thread) = held_lane("test-lane", &priorities);
        let (done_tx, done) = mpsc::channel();
        lane.push(job(false, done_tx.clone()));
        let batch = seen.recv().unwrap();
        assert_ne!(batch, priority::SCHED_OTHER, "{priorities:?}");
        // The batch job runs; an urgent job arrives behind it: the lane is raised at once.
        lane.push(job(true, done_tx.clone()));
        release.send(()).unwrap();
        assert_eq!(seen.recv().unwrap(), priority::SCHED_OTHER, "the rest of the batch job");
        done.recv().unwrap();
        assert_eq!(seen.recv().unwrap(), priority::SCHED_OTHER, "the urgent job");
        release.send(()).unwrap();
        assert_eq!(seen.recv().unwrap(), priority::SCHED_OTHER);
        done.recv().unwrap();
        // Back to batch work: back to the batch priority.
        lane.push(job(false, done_tx));
        assert_eq!(seen.recv().unwrap(), batch);
        release.send(()).unwrap();
        assert_eq!(seen.recv().unwrap(), batch);
        done.recv().unwrap();
        lane.stop();
        thread.join().unwrap();
    }

    #[test]
    fn deadline_jobs_start_first_earliest_deadline_first_then_latency_then_batch() {
        let priorities = LanePriorities::resolve(BatchPriority::Normal);
        let (seen, release, lane, thread) = held_lane("edf-lane", &priorities);
        let (order_tx, order) = mpsc::channel();
        let tagged = |tag: &'static str, urgent: bool, deadline: Option<Instant>| {
            let order_tx = order_tx.clone();
            Job {
                deadline,
                done: Box::new(move |r: Result<(), TaskError>, _| {
                    r.unwrap();
                    order_tx.send(tag).unwrap();
                }),
                ..job(urgent, mpsc::channel().0)
            }
        };
        // A batch job holds the lane while the others queue behind it.
        lane.push(tagged("running", false, None));
        seen.recv().unwrap();
        let now = Instant::now();
        lane.push(tagged("batch", false, None));
        lane.push(tagged("latency", true, None));
        lane.push(tagged("late deadline", false, Some(now + Duration::from_millis(30))));
        lane.push(tagged("early deadline", true, Some(now + Duration::from_millis(10))));
        lane.push(tagged(
            "same deadline, pushed later",
            false,
            Some(now + Duration::from_millis(10)),
        ));
        for _ in 0..6 {
            release.send(()).unwrap();
        }
        let ran: Vec<&str> = (0..6).map(|_| order.recv().unwrap()).collect();
        assert_eq!(
            ran,
            [
                "running",
                "early deadline",
                "same deadline, pushed later",
                "late deadline",
                "latency",
                "batch"
            ]
        );
        lane.stop();
        thread.join().unwrap();
    }

    #[test]
    fn batch_jobs_of_tenants_share_the_lane_by_weight_each_in_its_order() {
        let priorities = LanePriorities::resolve(BatchPriority::Normal);
        // Jobs that take the time they are predicted to take (the lane charges a job what it
        // took once it finished).
        let (seen, release, lane, thread) = held_lane_running_for("fair-lane", &priorities, Duration::from_millis(10));
        let (order_tx, order) = mpsc::channel();
        let tagged = |tenant: u64, weight: u32, sequence: u32| {
            let order_tx = order_tx.clone();
            Job {
                share: crate::Share {
                    group: tenant,
                    group_weight: weight,
                    tenant,
                    weight: 1,
                    cost_ns: 10_000_000,
                },
                done: Box::new(move |r: Result<(), TaskError>, _| {
                    r.unwrap();
                    order_tx.send((tenant, sequence)).unwrap();
                }),
                ..job(false, mpsc::channel().0)
            }
        };
        // One job holds the lane while tenant 7 (weight 3) queues 12 and tenant 8 (weight 1)
        // queues 12; pushed in this order, a FIFO would run all of 7's first.
        lane.push(tagged(1, 1, 0));
        seen.recv().unwrap();
        for sequence in 0..12 {
            lane.push(tagged(7, 3, sequence));
        }
        for sequence in 0..12 {
            lane.push(tagged(8, 1, sequence));
        }
        for _ in 0..25 {
            release.send(()).unwrap();
        }
        let ran: Vec<(u64, u32)> = (0..25).map(|_| order.recv().unwrap()).collect();
        let first_twelve = &ran[1..13];
        let heavy = first_twelve.iter().filter(|(tenant, _)| *tenant == 7).count();
        assert!(
            (8..=10).contains(&heavy),
            "weight 3 against 1 gets about 9 of 12: {ran:?}"
        );
        for tenant in [7, 8] {
            let sequence: Vec<u32> = ran.iter().filter(|(t, _)| *t == tenant).map(|(_, s)| *s).collect();
            assert_eq!(sequence, (0..12).collect::<Vec<_>>(), "tenant {tenant} in push order");
        }
        lane.stop();
        thread.join().unwrap();
    }

    /// Records the rows of each launch it runs (`None`: a job that is not a slice); holds each
    /// until released when `hold` has a receiver.
    struct Rows {
        seen: mpsc::Sender<Option<std::ops::Range<u64>>>,
        hold: Option<mpsc::Receiver<()>>,
    }

    /// A lane running [`Rows`]: what it saw, the sender that releases held jobs, the lane, its
    /// thread.
    #[allow(clippy::type_complexity)]
    fn rows_lane() -> (
        mpsc::Receiver<Option<std::ops::Range<u64>>>,
        mpsc::Sender<()>,
        Arc<Lane>,
        std::thread::JoinHandle<()>,
    ) {
        let (seen_tx, seen) = mpsc::channel();
        let (release, hold) = mpsc::channel();
        let executor = Rows {
            seen: seen_tx,
            hold: Some(hold),
        };
        let class = LaneClass::new(&LanePriorities::normal());
        let (lane, thread) = Lane::start("test-lane".into(), Box::new(executor), class).unwrap();
        (seen, release, lane, thread)
    }

    impl Executor for Rows {
        fn run(&mut self, _transfers: Vec<Transfer>, work: Work, end: JobEnd) {
            let rows = match work {
                Work::Launch { rows, .. } => rows,
                _ => None,
            };
            self.seen.send(rows).unwrap();
            if let Some(hold) = &self.hold {
                hold.recv().unwrap();
            }
            end.finish(Ok(()));
        }
    }

    fn launch(rows: u64, slices: Option<Slices>, done: mpsc::Sender<u32>, tag: u32) -> Job {
        let (_, k) = agora_kernels::find("saxpy").unwrap();
        Job {
            transfers: Vec::new(),
            work: Work::Launch {
                kernel: k.into(),
                range: [rows, 1, 1],
                dims: 1,
                args: [agora_kernels::ArgValue::None; agora_protocol::MAX_ARGS],
                arg_count: 0,
                device_args: Default::default(),
                rows: None,
            },
            keepalive: None,
            cancelled: None,
            revoke: None,
            urgent: false,
            exclusive: false,
            deadline: None,
            slices,
            share: crate::Share::default(),
            done: Box::new(move |r, _| {
                r.unwrap();
                done.send(tag).unwrap();
            }),
        }
    }

    #[test]
    fn a_sliced_launch_waits_as_one_job_and_its_slices_are_made_as_they_start() {
        let (seen, release, lane, thread) = rows_lane();
        let (done_tx, done) = mpsc::channel();
        // 1000 rows in 4096 asked slices of 3-row units: 334 slices, the last one short.
        let slices = Some(Slices { count: 4096, align: 3 });
        lane.push(launch(1000, slices, done_tx.clone(), 1));
        lane.push(launch(10, slices, done_tx.clone(), 2));
        assert_eq!(seen.recv().unwrap(), Some(0..3));
        // Two launches of hundreds of slices: one slice started, two jobs queued.
        assert!(lane.load() <= 3, "{:?}", lane.status());
        // An urgent job overtakes the launch at its next slice boundary.
        let mut urgent = job(true, mpsc::channel().0);
        urgent.done = Box::new({
            let done_tx = done_tx.clone();
            move |r, _| {
                r.unwrap();
                done_tx.send(0).unwrap();
            }
        });
        lane.push(urgent);
        let mut next = 0;
        let mut rows = Vec::new();
        let mut urgent_at = None;
        loop {
            release.send(()).unwrap();
            match seen.recv_timeout(Duration::from_secs(5)).unwrap() {
                Some(r) => {
                    if r.start == 0 && !rows.is_empty() {
                        break; // the second launch
                    }
                    rows.push(r)
                }
                None => urgent_at = Some(rows.len()),
            }
            next += 1;
            assert!(next < 1000);
        }
        assert!(urgent_at.is_some_and(|at| at <= SLICE_DEPTH + 1), "{urgent_at:?}");
        assert_eq!(rows.len(), 333, "the first launch's slices but its first");
        let mut expected = 3;
        for r in &rows {
            assert_eq!(r.start, expected);
            assert!(r.end - r.start <= 3 && r.end > r.start);
            expected = r.end;
        }
        assert_eq!(expected, 1000);
        // The urgent job, then the first launch once, then (after its 4 slices) the second.
        for _ in 0..4 {
            release.send(()).unwrap();
        }
        let order: Vec<u32> = (0..3)
            .map(|_| done.recv_timeout(Duration::from_secs(5)).unwrap())
            .collect();
        assert_eq!(order, [0, 1, 2]);
        assert!(done.try_recv().is_err(), "each launch completes once");
        lane.stop();
        drop(release);
        thread.join().unwrap();
    }

    #[test]
    fn stopping_cancels_the_slices_not_made_and_completes_the_launch_once() {
        let (seen, release, lane, thread) = rows_lane();
        let (tx, rx) = mpsc::channel();
        let mut job = launch(100, Some(Slices { count: 100, align: 1 }), mpsc::channel().0, 0);
        job.done = Box::new(move |r, _| tx.send(r).unwrap());
        lane.push(job);
        assert_eq!(seen.recv().unwrap(), Some(0..1));
        let stopper = std::thread::spawn({
            let lane = lane.clone();
            move || lane.stop()
        });
        std::thread::sleep(Duration::from_millis(50));
        for _ in 0..3 {
            let _ = release.send(());
        }
        stopper.join().unwrap();
        thread.join().unwrap();
        assert!(matches!(rx.recv().unwrap(), Err(TaskError::Cancelled)));
        assert!(rx.try_recv().is_err());
    }
}
