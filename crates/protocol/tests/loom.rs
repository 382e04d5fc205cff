//! Loom models of the protocols between a client and the daemon that meet in the shared
//! segment: the two rings, the daemon-sleeping/doorbell handshake and the futex waiter
//! protocol; and the sleep/wake of a device lane's thread (`agora-devices`). Loom runs each model under every interleaving (up to `LOOM_MAX_PREEMPTIONS`
//! preemptions) and every outcome of the C11 memory model its atomics allow.
//!
//! Run with `bash scripts/loom.sh` (`RUSTFLAGS="--cfg loom"`; the file is empty otherwise).
//!
//! The rings are the real `agora_protocol::ring` code over a real `SegmentView`: under
//! `--cfg loom` its header atomics are loom's (`agora_protocol::sync`). Two things are modelled
//! instead of run:
//!
//! * Slot contents. `SegmentView` copies slots with volatile reads and writes, which loom does
//!   not track, so each model keeps a shadow `loom::cell::UnsafeCell` per slot, written where
//!   the producer writes the slot (after it saw room, before it publishes) and read where the
//!   consumer reads it (after it saw the tail, before it releases). Loom reports any shadow
//!   access not ordered by the indices' release/acquire pairs as a causality violation: a slot
//!   read before it was written, or overwritten before it was consumed.
//! * The code of the other crates (the client's doorbell and futex waits, the dispatcher's
//!   sleep, `post_releasing`, the lane's `push`/`next`/`JobEnd::finish`), which cannot be built under loom cheaply: each model restates it
//!   with the same header fields and the same orderings, citing file and line (as of commit
//!   3915288). The eventfd doorbell and the futex are modelled with a loom mutex and condvar
//!   (a system call is ordered by the kernel's locks the same way); a wait that nobody ends is
//!   a deadlock loom reports, so "no lost wake-up" is checked as "the model always finishes".
//!
//! Each model was shown able to fail; how is written above it.

#![cfg(loom)]

use std::alloc::{alloc_zeroed, dealloc, Layout};
use std::sync::atomic::AtomicBool as StdAtomicBool;

use loom::cell::UnsafeCell;
use loom::sync::{Arc, Condvar, Mutex};
use loom::thread;

use agora_protocol::ring::{CompletionConsumer, CompletionProducer, SubmissionConsumer, SubmissionProducer};
use agora_protocol::segment::{Geometry, SegmentHeader, SegmentView};
use agora_protocol::sync::{fence, AtomicU32, Ordering};
use agora_protocol::{Completion, TaskDescriptor};

/// A segment with no heap, in memory this model owns: a heap allocation of the geometry's
/// length, page-aligned, with a loom-built header written at its start.
struct Segment {
    base: *mut u8,
    layout: Layout,
    view: SegmentView,
}

impl Segment {
    fn new(capacity: u32) -> Self {
        let geometry = Geometry::new(capacity, capacity, 0).unwrap();
        let layout = Layout::from_size_align(geometry.total_len as usize, 4096).unwrap();
        // SAFETY: the layout has a non-zero size (at least the header page).
        let base = unsafe { alloc_zeroed(layout) };
        assert!(!base.is_null(), "allocating a model segment");
        // SAFETY: `base` is page-aligned (enough for the header's alignment) and at least
        // HEADER_LEN bytes long; nothing else refers to it yet.
        unsafe {
            base.cast::<SegmentHeader>()
                .write(SegmentHeader::new_for_model(&geometry))
        };
        // SAFETY: `base` covers `total_len` bytes, is page-aligned, and stays allocated until
        // `drop`, after every thread holding a copy of the view has been joined.
        let view = unsafe { SegmentView::from_raw(base, geometry) };
        view.verify().unwrap();
        Segment { base, layout, view }
    }

    fn header(&self) -> &SegmentHeader {
        self.view.header()
    }
}

impl Drop for Segment {
    fn drop(&mut self) {
        // SAFETY: the header was written by `new` and is dropped once, here; the memory was
        // allocated with `self.layout` and no view of it is used any more.
        unsafe {
            std::ptr::drop_in_place(self.base.cast::<SegmentHeader>());
            dealloc(self.base, self.layout);
        }
    }
}

/// Shadow of a ring's slots (see the file's doc): each holds the task id last written there.
#[derive(Clone)]
struct Shadow(Arc<Vec<UnsafeCell<u64>>>);

impl Shadow {
    fn new(capacity: u32) -> Self {
        Shadow(Arc::new((0..capacity).map(|_| UnsafeCell::new(0)).collect()))
    }

    fn slot(&self, index: u32) -> &UnsafeCell<u64> {
        &self.0[index as usize % self.0.len()]
    }

    /// The producer writes slot `index` (task `id`).
    fn write(&self, index: u32, id: u64) {
        // SAFETY: loom checks that no other access to this cell is concurrent with this one.
        self.slot(index).with_mut(|p| unsafe { *p = id });
    }

    /// The consumer reads slot `index`: what the producer wrote there.
    fn read(&self, index: u32) -> u64 {
        // SAFETY: as in `write`.
        self.slot(index).with(|p| unsafe { *p })
    }
}

/// An eventfd doorbell (`agora_transport::wake::Doorbell`) and the daemon's `epoll_wait` on it.
#[derive(Default)]
struct Doorbell {
    count: Mutex<u64>,
    rung: Condvar,
}

impl Doorbell {
    /// `Doorbell::ring`: adds one to the counter, which readies the daemon's epoll.
    fn ring(&self) {
        *self.count.lock().unwrap() += 1;
        self.rung.notify_all();
    }

    /// `poll_events` with no timeout, then `Doorbell::drain`: blocks until the counter is
    /// non-zero, then clears it.
    fn wait_and_drain(&self) {
        let mut count = self.count.lock().unwrap();
        while *count == 0 {
            count = self.rung.wait(count).unwrap();
        }
        *count = 0;
    }
}

/// A futex on a segment word (`agora_transport::wake::futex_wait` / `futex_wake_all`). The
/// kernel compares the word under its hash-bucket lock and the waker takes that lock after
/// storing the word, so a wake either finds the waiter queued or the waiter sees the new
/// value: the mutex plays that lock. The models ignore the wait's timeout (a wake-up that only
/// the 20 ms liveness timeout would deliver counts as lost).
#[derive(Default)]
struct Futex {
    wakes: Mutex<u64>,
    woken: Condvar,
}

impl Futex {
    /// Blocks while `word` holds `expected`, until a wake.
    fn wait(&self, word: &AtomicU32, expected: u32) {
        let mut wakes = self.wakes.lock().unwrap();
        if word.load(Ordering::Relaxed) != expected {
            return;
        }
        let seen = *wakes;
        while *wakes == seen {
            wakes = self.woken.wait(wakes).unwrap();
        }
    }

    /// Wakes every waiter.
    fn wake_all(&self) {
        *self.wakes.lock().unwrap() += 1;
        self.woken.notify_all();
    }
}

fn descriptor(id: u64) -> TaskDescriptor {
    let mut d = TaskDescriptor::zeroed();
    d.task_id = id;
    d.range[0] = id * 3;
    d
}

/// Set when some execution of the submission model found the ring full (so the model does
/// cover the producer's refusal, not only runs where the consumer kept up).
static SUBMISSION_RING_WAS_FULL: StdAtomicBool = StdAtomicBool::new(false);
/// The same for the completion model's admission check.
static COMPLETION_RING_WAS_FULL: StdAtomicBool = StdAtomicBool::new(false);

/// (a) The submission ring: the client stages and publishes three descriptors through a
/// 2-slot ring while the daemon takes them. The daemon sees exactly the descriptors published,
/// in order, and never a slot before it was written (shadow read, and the copied descriptor);
/// the client never overwrites a slot the daemon has not released (shadow write): a full ring
/// is refused by `stage`, and the client waits.
///
/// Shown able to fail: with `SubmissionProducer::publish` storing the tail `Relaxed` instead
/// of `Release`, loom reports a causality violation on the shadow slot (the daemon's read is
/// not ordered after the client's write); with `SubmissionConsumer::release` storing the head
/// `Relaxed`, the same on the client's reuse of slot 0.
#[test]
fn submission_ring_passes_descriptors_in_order_and_never_overwrites() {
    const TASKS: u64 = 3;
    const CAPACITY: u32 = 2;
    loom::model(|| {
        let segment = Segment::new(CAPACITY);
        let view = segment.view;
        let shadow = Shadow::new(CAPACITY);
        let daemon_shadow = shadow.clone();
        let daemon = thread::spawn(move || {
            let mut consumer = SubmissionConsumer::new(view);
            let mut head = 0u32;
            while u64::from(head) < TASKS {
                let n = consumer.available().expect("an honest client's tail is never corrupt");
                if n == 0 {
                    thread::yield_now();
                    continue;
                }
                for _ in 0..n {
                    let d = consumer.take();
                    let written = daemon_shadow.read(head);
                    assert_eq!(d.task_id, u64::from(head) + 1, "descriptors arrive in order");
                    assert_eq!(d.task_id, written, "the slot holds what the client wrote");
                    assert_eq!(d.range[0], d.task_id * 3, "descriptors arrive intact");
                    head += 1;
                }
                consumer.release();
            }
            assert_eq!(consumer.available(), Ok(0), "nothing beyond what was published");
        });
        let mut producer = SubmissionProducer::new(view);
        for tail in 0..TASKS as u32 {
            let id = u64::from(tail) + 1;
            while !producer.stage(&descriptor(id)) {
                // Full: the daemon still holds slot `tail - CAPACITY`.
                assert!(tail >= CAPACITY, "a ring with free slots refused a descriptor");
                SUBMISSION_RING_WAS_FULL.store(true, std::sync::atomic::Ordering::Relaxed);
                thread::yield_now();
            }
            shadow.write(tail, id);
            producer.publish();
        }
        daemon.join().unwrap();
        drop(segment);
    });
    assert!(SUBMISSION_RING_WAS_FULL.load(std::sync::atomic::Ordering::Relaxed));
}

/// (b) The completion ring: the daemon posts three completions through a 2-slot ring, with
/// the admission check the dispatcher makes (never more outstanding than the ring holds);
/// the client takes them as its `drain` does (all that are there, then one release). Same
/// properties as (a).
///
/// Shown able to fail: with `CompletionProducer::push` storing the tail `Relaxed`, loom
/// reports a causality violation on the client's shadow read; with
/// `CompletionConsumer::release` storing the head `Relaxed`, one on the daemon's reuse.
#[test]
fn completion_ring_passes_completions_in_order_and_never_overwrites() {
    const TASKS: u64 = 3;
    const CAPACITY: u32 = 2;
    loom::model(|| {
        let segment = Segment::new(CAPACITY);
        let view = segment.view;
        let shadow = Shadow::new(CAPACITY);
        let daemon_shadow = shadow.clone();
        let daemon = thread::spawn(move || {
            let mut producer = CompletionProducer::new(view);
            for id in 1..=TASKS {
                while producer.posted().wrapping_sub(producer.consumed()) >= CAPACITY {
                    COMPLETION_RING_WAS_FULL.store(true, std::sync::atomic::Ordering::Relaxed);
                    thread::yield_now();
                }
                // `push` writes the slot and publishes; the shadow write goes where the slot
                // write does, between the admission check and the publication.
                daemon_shadow.write(producer.posted(), id);
                producer.push(&Completion::ok(id));
            }
        });
        let mut consumer = CompletionConsumer::new(view);
        let mut head = 0u32;
        while u64::from(head) < TASKS {
            let mut taken = 0;
            while let Some(c) = consumer.take() {
                let written = shadow.read(head);
                assert_eq!(c.task_id, u64::from(head) + 1, "completions arrive in order");
                assert_eq!(c.task_id, written, "the slot holds what the daemon wrote");
                assert_eq!(c.result(), Ok(()), "completions arrive intact");
                head += 1;
                taken += 1;
            }
            if taken > 0 {
                consumer.release();
            } else {
                thread::yield_now();
            }
        }
        daemon.join().unwrap();
        assert!(!consumer.has_pending(), "nothing beyond what was posted");
        drop(segment);
    });
    assert!(COMPLETION_RING_WAS_FULL.load(std::sync::atomic::Ordering::Relaxed));
}

/// How the handshake models are run: as the code is, or with one step removed (to show the
/// model can fail).
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Variant {
    AsWritten,
    /// The client's `fence(SeqCst)` (doorbell), or the daemon's (futex), left out.
    NoFence,
    /// The dispatcher's last look at the rings after announcing sleep left out (doorbell).
    NoRecheck,
    /// The client announces the task it waits for (`client_wait_for`) after its last look at
    /// the tail instead of before (futex).
    LateTarget,
}

/// (c) The daemon-sleeping/doorbell handshake: the client publishes two descriptors, each
/// followed by `ring_doorbell_if_asleep`; the dispatcher takes what it finds and otherwise
/// goes to sleep as its loop does. No lost wake-up: the dispatcher always takes both
/// descriptors (a published descriptor is seen by its last look or its doorbell is rung;
/// otherwise it blocks for good and loom reports a deadlock).
fn doorbell_model(variant: Variant) {
    const TASKS: u32 = 2;
    loom::model(move || {
        let segment = Segment::new(2);
        let view = segment.view;
        let doorbell = Arc::new(Doorbell::default());
        let client_doorbell = doorbell.clone();
        let client = thread::spawn(move || {
            let header = view.header();
            let mut producer = SubmissionProducer::new(view);
            for id in 1..=u64::from(TASKS) {
                assert!(producer.stage(&descriptor(id)));
                producer.publish();
                // crates/client/src/session.rs:736-742, `ring_doorbell_if_asleep`.
                if variant != Variant::NoFence {
                    fence(Ordering::SeqCst);
                }
                if header.daemon_sleeping.load(Ordering::Relaxed) != 0 {
                    client_doorbell.ring();
                }
            }
        });
        // The dispatcher's loop, crates/daemon/src/server.rs:310-347, with its spin reduced
        // to one look (`any_pending`, :350-358: `available() > 0`).
        let header = segment.header();
        let mut consumer = SubmissionConsumer::new(view);
        let mut taken = 0;
        while taken < TASKS {
            let n = consumer.available().unwrap();
            if n > 0 {
                for _ in 0..n {
                    assert_eq!(consumer.take().task_id, u64::from(taken) + 1);
                    taken += 1;
                }
                consumer.release();
                continue;
            }
            // server.rs:313-319: announce sleep (`set_sleeping`, :360-370, a SeqCst store),
            // fence, look once more.
            header.daemon_sleeping.store(1, Ordering::SeqCst);
            fence(Ordering::SeqCst);
            if variant != Variant::NoRecheck && consumer.available().unwrap() > 0 {
                header.daemon_sleeping.store(0, Ordering::SeqCst);
                continue;
            }
            // server.rs:340-341: epoll_wait without a timeout (no housekeeping pending), the
            // doorbell drained (:399), then `set_sleeping(0)`.
            doorbell.wait_and_drain();
            header.daemon_sleeping.store(0, Ordering::SeqCst);
        }
        client.join().unwrap();
        drop(segment);
    });
}

/// Shown able to fail by the two tests after this one: without the client's fence, or
/// without the dispatcher's re-check, loom finds the lost wake-up (a deadlock).
#[test]
fn doorbell_handshake_loses_no_wake_up() {
    doorbell_model(Variant::AsWritten);
}

#[test]
#[should_panic(expected = "deadlock")]
fn doorbell_handshake_without_the_client_fence_loses_a_wake_up() {
    doorbell_model(Variant::NoFence);
}

#[test]
#[should_panic(expected = "deadlock")]
fn doorbell_handshake_without_the_daemon_recheck_loses_a_wake_up() {
    doorbell_model(Variant::NoRecheck);
}

/// (d) The futex waiter protocol: the daemon posts completions 1 and 2, each followed by the
/// wake check of `post_releasing`; a client thread waits for task 2 as `Inner::wait` does:
/// it drains what is there, and otherwise blocks on the completion tail. No lost wake-up: the
/// client always gets both completions (or blocks for good: a deadlock loom reports). Task 1
/// alone must not be needed to wake it (`client_wait_for` is 2), which the model also covers.
fn futex_model(variant: Variant) {
    const TASKS: u64 = 2;
    loom::model(move || {
        let segment = Segment::new(2);
        let view = segment.view;
        let futex = Arc::new(Futex::default());
        let daemon_futex = futex.clone();
        let daemon = thread::spawn(move || {
            let header = view.header();
            let mut producer = CompletionProducer::new(view);
            for id in 1..=TASKS {
                // crates/daemon/src/session.rs:99-132, `post_releasing` (one completion; the
                // producer's lock is uncontended here).
                producer.push(&Completion::ok(id));
                let newest = id;
                if variant != Variant::NoFence {
                    fence(Ordering::SeqCst);
                }
                if header.client_waiters.load(Ordering::Relaxed) != 0
                    && newest >= header.client_wait_for.load(Ordering::Relaxed)
                {
                    daemon_futex.wake_all();
                }
            }
        });
        let header = segment.header();
        let mut consumer = CompletionConsumer::new(view);
        let target = TASKS;
        let mut done = 0;
        // crates/client/src/session.rs:827-849 (`wait`, its spin reduced to one look).
        while done < TASKS {
            let mut taken = 0;
            while let Some(c) = consumer.take() {
                done += 1;
                assert_eq!(c.task_id, done);
                taken += 1;
            }
            if taken > 0 {
                consumer.release();
                continue;
            }
            // session.rs `Inner::block(target, ..)` (its `satisfied()` is about other client
            // threads' progress: false with one thread and nothing pending).
            header.client_waiters.fetch_add(1, Ordering::SeqCst);
            if variant != Variant::LateTarget {
                header.client_wait_for.fetch_min(target, Ordering::SeqCst);
            }
            // As `block` has it: an explicit fence pairs with the daemon's. (Loom treats SeqCst
            // accesses as AcqRel, so without it loom reported a lost wake-up; the code now has
            // the fence, and this model checks exactly that code.)
            fence(Ordering::SeqCst);
            let tail = header.completion_tail.load(Ordering::SeqCst);
            if variant == Variant::LateTarget {
                header.client_wait_for.fetch_min(target, Ordering::SeqCst);
            }
            if tail == header.completion_head.load(Ordering::Relaxed) {
                futex.wait(&header.completion_tail, tail);
            }
            if header.client_waiters.fetch_sub(1, Ordering::SeqCst) == 1 {
                header.client_wait_for.store(u64::MAX, Ordering::SeqCst);
            }
        }
        daemon.join().unwrap();
        drop(segment);
    });
}

/// Shown able to fail by the two tests after this one: without the daemon's fence, or with the
/// client announcing its target after its last look at the tail, loom finds the lost wake-up
/// (the futex's own comparison of the tail does not save it: the client's look and the
/// futex's may both miss a completion the daemon posted without seeing the client's target).
#[test]
fn futex_waiter_loses_no_wake_up() {
    futex_model(Variant::AsWritten);
}

#[test]
#[should_panic(expected = "deadlock")]
fn futex_waiter_without_the_daemon_fence_loses_a_wake_up() {
    futex_model(Variant::NoFence);
}

#[test]
#[should_panic(expected = "deadlock")]
fn futex_waiter_announcing_its_target_late_loses_a_wake_up() {
    futex_model(Variant::LateTarget);
}

/// A device lane (`crates/devices/src/lane.rs`, `Lane`) reduced to what its sleep/wake uses:
/// `queue` (a `Mutex<Queue>` whose `sleeping` flag the lane thread sets, under the lock, before
/// it waits on `wake`), `pending` (jobs queued: what the idle lane thread spins on before it
/// takes the lock), `in_flight` (jobs started, unfinished) and `awaiting_room` (a slice is held
/// back until `in_flight` drops below `SLICE_DEPTH`). A job is its id, and whether it is a
/// slice of a chunked launch. The urgent queue, the OS priority class, the busy-time counters
/// and `stopping` are left out (the first two change under the same lock and notify nobody;
/// `stop` wakes the lane with `notify_all`, which would hide a lost wake-up, so the model's
/// lane thread ends after the jobs it expects instead). Lines cited as of commit 120559a. The
/// models share it through a `std::sync::Arc` (loom's `Arc`, dropped while loom unwinds from a
/// deadlock it found, aborts the test process instead of failing the test).
#[derive(Default)]
struct LaneModel {
    queue: Mutex<LaneQueue>,
    wake: Condvar,
    pending: loom::sync::atomic::AtomicUsize,
    in_flight: loom::sync::atomic::AtomicUsize,
    awaiting_room: loom::sync::atomic::AtomicBool,
}

#[derive(Default)]
struct LaneQueue {
    /// (job id, is a slice).
    jobs: std::collections::VecDeque<(u64, bool)>,
    sleeping: bool,
}

/// `lane::SLICE_DEPTH`.
const SLICE_DEPTH: usize = 2;

/// How the lane models are run: as the code is, or weakened the way a plausible bug would.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum LaneVariant {
    AsWritten,
    /// `push` reads `sleeping` in its own critical section before it queues the job.
    SleepingReadEarly,
    /// `next` announces sleep (`sleeping = true`) and waits in two critical sections, so it
    /// waits without looking at the queue after announcing.
    SleepAnnouncedApart,
    /// No `fence(SeqCst)` between the store and the load on either side of the room wait.
    NoRoomFence,
}

impl LaneModel {
    /// `Lane::push` (lane.rs:389-413): queue the job and count it under the lock, read
    /// `sleeping` there, unlock, then `notify_one` if the lane thread said it sleeps.
    fn push(&self, id: u64, slice: bool, variant: LaneVariant) {
        let early = (variant == LaneVariant::SleepingReadEarly).then(|| self.queue.lock().unwrap().sleeping);
        let mut q = self.queue.lock().unwrap();
        q.jobs.push_back((id, slice));
        self.pending.fetch_add(1, Ordering::Release);
        let notify = early.unwrap_or(q.sleeping);
        drop(q);
        if notify {
            self.wake.notify_one();
        }
    }

    /// `Lane::next` (lane.rs:446-506): spin on `pending` (the `AdaptiveSpin`, one look here: its
    /// outcome only decides how soon the lock is taken), then under the lock take the front job
    /// (a slice only while fewer than `SLICE_DEPTH` are in flight, after announcing
    /// `awaiting_room`), or set `sleeping` and wait on `wake`, and look again when woken.
    fn next(&self, variant: LaneVariant) -> u64 {
        if self.pending.load(Ordering::Acquire) == 0 {
            let _ = self.pending.load(Ordering::Acquire) > 0;
        }
        let mut q = self.queue.lock().unwrap();
        loop {
            let job = match q.jobs.front() {
                Some(&(_, true)) => {
                    self.awaiting_room.store(true, Ordering::SeqCst);
                    if variant != LaneVariant::NoRoomFence {
                        fence(Ordering::SeqCst);
                    }
                    if self.in_flight.load(Ordering::SeqCst) < SLICE_DEPTH {
                        q.jobs.pop_front()
                    } else {
                        None
                    }
                }
                _ => q.jobs.pop_front(),
            };
            if let Some((id, _)) = job {
                self.awaiting_room.store(false, Ordering::Relaxed);
                self.pending.fetch_sub(1, Ordering::Relaxed);
                self.in_flight.fetch_add(1, Ordering::AcqRel);
                return id;
            }
            q.sleeping = true;
            if variant == LaneVariant::SleepAnnouncedApart {
                drop(q);
                q = self.queue.lock().unwrap();
            }
            q = self.wake.wait(q).unwrap();
            q.sleeping = false;
        }
    }

    /// `JobEnd::finish` (lane.rs:81-115), its outcome and counters left out: drop `in_flight`,
    /// then, if the lane thread waits for room, `notify_one` under the queue lock.
    fn finish(&self, variant: LaneVariant) {
        self.in_flight.fetch_sub(1, Ordering::SeqCst);
        if variant != LaneVariant::NoRoomFence {
            fence(Ordering::SeqCst);
        }
        if self.awaiting_room.load(Ordering::SeqCst) {
            let _q = self.queue.lock().unwrap();
            self.wake.notify_one();
        }
    }
}

/// (e) The lane sleep/wake: two submitters push one job each (`Lane::push`, as the daemon's
/// dispatcher and another lane's completion path may at once) while the lane thread takes
/// jobs as `Lane::run` does: `next`, then the CPU's executor runs the job and calls
/// `JobEnd::finish` on the lane thread. No lost wake-up: the lane thread always runs both jobs
/// (or sleeps for good: a deadlock loom reports); none runs twice.
fn lane_model(variant: LaneVariant) {
    const TASKS: u64 = 2;
    loom::model(move || {
        let lane = std::sync::Arc::new(LaneModel::default());
        let submitters: Vec<_> = (1..=TASKS)
            .map(|id| {
                let lane = lane.clone();
                thread::spawn(move || lane.push(id, false, variant))
            })
            .collect();
        // The lane thread (`Lane::run`), here the model's main thread.
        let mut ran = Vec::new();
        while (ran.len() as u64) < TASKS {
            let id = lane.next(variant);
            assert!(!ran.contains(&id), "job {id} ran twice");
            ran.push(id);
            lane.finish(variant);
        }
        for submitter in submitters {
            submitter.join().unwrap();
        }
        ran.sort_unstable();
        assert_eq!(ran, [1, 2], "every job pushed ran once");
        assert_eq!(lane.pending.load(Ordering::Relaxed), 0);
        assert_eq!(lane.in_flight.load(Ordering::Relaxed), 0);
        assert!(lane.queue.lock().unwrap().jobs.is_empty());
    });
}

/// Shown able to fail by the two tests after this one: with `push` reading `sleeping` before
/// it queues the job, or `next` waiting in a critical section other than the one that found the
/// queue empty and announced sleep, loom finds the lost wake-up (a deadlock).
#[test]
fn lane_sleep_loses_no_wake_up() {
    lane_model(LaneVariant::AsWritten);
}

#[test]
#[should_panic(expected = "deadlock")]
fn lane_sleep_with_sleeping_read_before_the_push_loses_a_wake_up() {
    lane_model(LaneVariant::SleepingReadEarly);
}

#[test]
#[should_panic(expected = "deadlock")]
fn lane_sleep_announced_apart_from_the_wait_loses_a_wake_up() {
    lane_model(LaneVariant::SleepAnnouncedApart);
}

/// (f) The lane's wait for room: `SLICE_DEPTH` jobs are in flight on an asynchronous device and
/// a slice of a chunked launch is next; the device finishes one job from its own thread (an
/// OpenCL event callback calling `JobEnd::finish`) while the lane thread holds the slice back
/// and sleeps. No lost wake-up: the lane thread always starts the slice. (On the CPU the
/// executor calls `finish` on the lane thread before its next `next`, so this wait never
/// happens there.)
///
/// `next` stores `awaiting_room` then loads `in_flight`; `finish` decrements `in_flight` then
/// loads `awaiting_room`: one of the two loads must see the other thread's write. With only
/// `SeqCst` accesses loom (which treats them as `AcqRel`) let both loads read the old values and
/// reported a lost wake-up; the code now has a `fence(SeqCst)` between the two accesses on each
/// side (in `Lane::next` and `JobEnd::finish`), as this model does. Shown able to fail by the
/// next test: without the fences, a deadlock.
fn lane_room_model(variant: LaneVariant) {
    loom::model(move || {
        let lane = std::sync::Arc::new(LaneModel::default());
        // Two jobs started as `next` starts them, then the slice queued.
        for _ in 0..SLICE_DEPTH {
            lane.awaiting_room.store(false, Ordering::Relaxed);
            lane.in_flight.fetch_add(1, Ordering::AcqRel);
        }
        lane.push(3, true, variant);
        let device = lane.clone();
        let callback = thread::spawn(move || device.finish(variant));
        assert_eq!(lane.next(variant), 3, "the slice starts once there is room");
        callback.join().unwrap();
        assert_eq!(lane.in_flight.load(Ordering::Relaxed), SLICE_DEPTH);
    });
}

#[test]
fn lane_room_wait_loses_no_wake_up() {
    lane_room_model(LaneVariant::AsWritten);
}

#[test]
#[should_panic(expected = "deadlock")]
fn lane_room_wait_without_the_fences_loses_a_wake_up() {
    lane_room_model(LaneVariant::NoRoomFence);
}
