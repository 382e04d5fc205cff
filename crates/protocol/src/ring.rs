//! The index protocol of the two rings.
//!
//! Both rings are single-producer/single-consumer with free-running `u32` indices (Lamport's
//! queue, as in crossbeam's `ArrayQueue` but with one producer and one consumer, so no per-slot
//! stamps are needed). The producer writes a slot, then publishes its tail with `Release`; the
//! consumer reads the tail with `Acquire`, copies slots out, then publishes its head.
//!
//! Each side keeps its own index privately and never reads it back from shared memory, so a
//! hostile peer can only lie about *its* index. The daemon checks every index a client
//! publishes: a submission tail more than `capacity` ahead of the daemon's head is
//! a [`RingError`], and a completion head outside `[tail - capacity, tail]` is clamped.

use crate::completion::Completion;
use crate::descriptor::TaskDescriptor;
use crate::segment::SegmentView;
use crate::sync::Ordering;

/// A ring index published by the peer is impossible.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("ring index corrupt: the peer published {published}, {distance} entries from our index, capacity {capacity}")]
pub struct RingError {
    /// The index found.
    pub published: u32,
    /// Its distance from our own index.
    pub distance: u32,
    /// Ring capacity.
    pub capacity: u32,
}

/// Client side of the submission ring.
#[derive(Debug)]
pub struct SubmissionProducer {
    view: SegmentView,
    tail: u32,
}

impl SubmissionProducer {
    /// Starts producing into a fresh segment.
    pub fn new(view: SegmentView) -> Self {
        SubmissionProducer {
            view,
            tail: view.header().submission_tail.load(Ordering::Relaxed),
        }
    }

    /// Number of free slots right now.
    pub fn free_slots(&self) -> u32 {
        let head = self.view.header().submission_head.load(Ordering::Acquire);
        let used = self.tail.wrapping_sub(head);
        self.view.geometry().submission_capacity.saturating_sub(used)
    }

    /// Writes `descriptor` into the ring without publishing it. Returns `false` when full.
    pub fn stage(&mut self, descriptor: &TaskDescriptor) -> bool {
        if self.free_slots() == 0 {
            return false;
        }
        self.view.write_submission(self.tail, descriptor);
        self.tail = self.tail.wrapping_add(1);
        true
    }

    /// Makes every staged descriptor visible to the daemon.
    pub fn publish(&self) {
        self.view.header().submission_tail.store(self.tail, Ordering::Release);
    }

    /// The descriptors published but not taken yet, oldest first (`None` when the consumer's
    /// head is not within the ring). Read after the daemon that consumed this ring died: these
    /// are the tasks it never saw, which a client may issue again on the next daemon.
    pub fn untaken(&self) -> Option<Vec<TaskDescriptor>> {
        let head = self.view.header().submission_head.load(Ordering::Acquire);
        let count = self.tail.wrapping_sub(head);
        if count > self.view.geometry().submission_capacity {
            return None;
        }
        Some(
            (0..count)
                .map(|i| self.view.read_submission(head.wrapping_add(i)))
                .collect(),
        )
    }

    /// Test hook: publishes an arbitrary tail (for corrupt-index tests).
    #[doc(hidden)]
    pub fn publish_raw_tail(&self, tail: u32) {
        self.view.header().submission_tail.store(tail, Ordering::Release);
    }
}

/// Daemon side of the submission ring.
#[derive(Debug)]
pub struct SubmissionConsumer {
    view: SegmentView,
    head: u32,
}

impl SubmissionConsumer {
    /// Starts consuming a fresh segment (indices at zero).
    pub fn new(view: SegmentView) -> Self {
        SubmissionConsumer { view, head: 0 }
    }

    /// Takes over the ring of a segment that a previous daemon served (a resumed session):
    /// whatever that daemon had not taken is dropped (its client issues those tasks again after
    /// the resume, or fails them itself), so consuming starts at the client's current tail,
    /// which is also handed back as the head.
    /// Returns the consumer and that index (a client that lies about it only loses its own
    /// tasks).
    pub fn resume(view: SegmentView) -> (Self, u32) {
        let tail = view.header().submission_tail.load(Ordering::Acquire);
        view.header().submission_head.store(tail, Ordering::Release);
        (SubmissionConsumer { view, head: tail }, tail)
    }

    /// Descriptors available, after checking the client's tail.
    pub fn available(&self) -> Result<u32, RingError> {
        let tail = self.view.header().submission_tail.load(Ordering::Acquire);
        let distance = tail.wrapping_sub(self.head);
        let capacity = self.view.geometry().submission_capacity;
        if distance > capacity {
            return Err(RingError {
                published: tail,
                distance,
                capacity,
            });
        }
        Ok(distance)
    }

    /// Copies the next descriptor out without taking it (the client may not change a published
    /// slot, but one that does only changes what the copy says). Call only when
    /// [`Self::available`] said one exists.
    pub fn peek(&self) -> TaskDescriptor {
        self.view.read_submission(self.head)
    }

    /// Copies the next descriptor out. Call only when [`Self::available`] said one exists.
    pub fn take(&mut self) -> TaskDescriptor {
        let d = self.view.read_submission(self.head);
        self.head = self.head.wrapping_add(1);
        d
    }

    /// Returns consumed slots to the client.
    pub fn release(&self) {
        self.view.header().submission_head.store(self.head, Ordering::Release);
    }
}

/// Daemon side of the completion ring.
#[derive(Debug)]
pub struct CompletionProducer {
    view: SegmentView,
    tail: u32,
}

impl CompletionProducer {
    /// Starts producing into a fresh segment.
    pub fn new(view: SegmentView) -> Self {
        CompletionProducer { view, tail: 0 }
    }

    /// Takes over the ring of a segment that a previous daemon served (a resumed session):
    /// producing continues at `tail`, the submission ring's tail (see
    /// [`SubmissionConsumer::resume`]), so every submission keeps exactly one completion slot;
    /// the client completes the tasks the previous daemon did not, and moves its head past
    /// their slots.
    pub fn resume(view: SegmentView, tail: u32) -> Self {
        view.header().completion_tail.store(tail, Ordering::Release);
        CompletionProducer { view, tail }
    }

    /// How many completions the client has consumed in all (wrapping), clamped to what is
    /// possible, so a lying client cannot make us believe more or fewer than that.
    pub fn consumed(&self) -> u32 {
        let head = self.view.header().completion_head.load(Ordering::Acquire);
        let capacity = self.view.geometry().completion_capacity;
        if self.tail.wrapping_sub(head) <= capacity {
            head
        } else {
            // Impossible for an honest client: treat the ring as full.
            self.tail.wrapping_sub(capacity)
        }
    }

    /// Completions posted in all (wrapping).
    pub fn posted(&self) -> u32 {
        self.tail
    }

    /// Writes and publishes one completion. The caller's admission control guarantees space
    /// for honest clients; for a client that lies about its head this overwrites its own
    /// unconsumed entries, which harms nobody else.
    pub fn push(&mut self, completion: &Completion) {
        self.view.write_completion(self.tail, completion);
        self.tail = self.tail.wrapping_add(1);
        self.view.header().completion_tail.store(self.tail, Ordering::Release);
    }
}

/// Client side of the completion ring.
#[derive(Debug)]
pub struct CompletionConsumer {
    view: SegmentView,
    head: u32,
}

impl CompletionConsumer {
    /// Starts consuming a fresh segment.
    pub fn new(view: SegmentView) -> Self {
        CompletionConsumer {
            view,
            head: view.header().completion_head.load(Ordering::Relaxed),
        }
    }

    /// Whether the daemon has published completions we have not taken.
    pub fn has_pending(&self) -> bool {
        self.view.header().completion_tail.load(Ordering::Acquire) != self.head
    }

    /// The daemon's current tail (for futex waits).
    pub fn published_tail(&self) -> u32 {
        self.view.header().completion_tail.load(Ordering::Acquire)
    }

    /// Takes the next completion, if any, without returning its slot yet.
    pub fn take(&mut self) -> Option<Completion> {
        let tail = self.view.header().completion_tail.load(Ordering::Acquire);
        if tail == self.head {
            return None;
        }
        let c = self.view.read_completion(self.head);
        self.head = self.head.wrapping_add(1);
        Some(c)
    }

    /// Returns taken slots to the daemon.
    pub fn release(&self) {
        self.view.header().completion_head.store(self.head, Ordering::Release);
    }

    /// Moves the head `count` entries on without reading them, and releases: for completions
    /// that will never be written (tasks a daemon that died had not completed, which the client
    /// completes itself before resuming the session on a new daemon).
    pub fn skip(&mut self, count: u32) {
        self.head = self.head.wrapping_add(count);
        self.release();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::segment::Geometry;

    struct Mem {
        _buf: Vec<u8>,
        view: SegmentView,
    }

    fn segment(cap: u32) -> Mem {
        let g = Geometry::new(cap, cap, 4096).unwrap();
        let mut buf = vec![0u8; g.total_len as usize + 4096];
        let base = buf.as_mut_ptr().wrapping_add(buf.as_ptr().align_offset(4096));
        // SAFETY: `buf` lives as long as `Mem` and covers the geometry after alignment.
        let view = unsafe { SegmentView::from_raw(base, g) };
        view.initialize();
        Mem { _buf: buf, view }
    }

    #[test]
    fn submissions_flow_in_order_and_wrap() {
        let m = segment(4);
        let mut p = SubmissionProducer::new(m.view);
        let mut c = SubmissionConsumer::new(m.view);
        for round in 0..10u64 {
            for i in 0..4u64 {
                let mut d = TaskDescriptor::zeroed();
                d.task_id = round * 4 + i;
                assert!(p.stage(&d));
            }
            let mut d = TaskDescriptor::zeroed();
            assert!(!p.stage(&d), "a full ring refuses");
            p.publish();
            assert_eq!(c.available().unwrap(), 4);
            for i in 0..4u64 {
                d = c.take();
                assert_eq!(d.task_id, round * 4 + i);
            }
            c.release();
        }
    }

    /// Two threads, as the client and the daemon are: every descriptor written into a slot
    /// reaches the consumer intact and in order through a ring smaller than the stream, and
    /// every completion comes back. Under Miri (scripts/miri.sh) this also checks that the
    /// slots' plain reads and writes are ordered by the indices' release/acquire pairs: a
    /// missing edge is a data race Miri reports.
    #[test]
    fn a_producer_and_a_consumer_thread_pass_everything_in_order() {
        const TASKS: u64 = if cfg!(miri) { 40 } else { 20_000 };
        let m = segment(4);
        let view = m.view;
        let daemon = std::thread::spawn(move || {
            let mut submissions = SubmissionConsumer::new(view);
            let mut completions = CompletionProducer::new(view);
            let mut next = 0u64;
            while next < TASKS {
                let n = submissions.available().unwrap();
                for _ in 0..n {
                    let d = submissions.take();
                    assert_eq!(d.task_id, next, "descriptors arrive in order, intact");
                    assert_eq!(d.range[0], next * 3);
                    // Admission control: never more completions outstanding than the ring holds.
                    while completions.posted().wrapping_sub(completions.consumed()) >= 4 {
                        std::thread::yield_now();
                    }
                    completions.push(&Completion::ok(d.task_id));
                    next += 1;
                }
                submissions.release();
                if n == 0 {
                    std::thread::yield_now();
                }
            }
        });
        let mut producer = SubmissionProducer::new(view);
        let mut consumer = CompletionConsumer::new(view);
        let (mut issued, mut done) = (0u64, 0u64);
        while done < TASKS {
            while issued < TASKS && issued - done < 4 {
                let mut d = TaskDescriptor::zeroed();
                d.task_id = issued;
                d.range[0] = issued * 3;
                if !producer.stage(&d) {
                    break;
                }
                issued += 1;
            }
            producer.publish();
            while let Some(c) = consumer.take() {
                assert_eq!(c.task_id, done, "completions arrive in order");
                done += 1;
            }
            consumer.release();
            std::thread::yield_now();
        }
        daemon.join().unwrap();
    }

    #[test]
    fn a_tail_too_far_ahead_is_corrupt() {
        let m = segment(4);
        let p = SubmissionProducer::new(m.view);
        let c = SubmissionConsumer::new(m.view);
        p.publish_raw_tail(5);
        assert!(c.available().is_err());
        p.publish_raw_tail(u32::MAX);
        assert!(c.available().is_err());
        p.publish_raw_tail(4);
        assert_eq!(c.available().unwrap(), 4);
    }

    #[test]
    fn completion_head_lies_are_clamped() {
        let m = segment(4);
        let mut p = CompletionProducer::new(m.view);
        let mut c = CompletionConsumer::new(m.view);
        p.push(&Completion::ok(1));
        p.push(&Completion::ok(2));
        assert_eq!(p.consumed(), 0);
        assert_eq!(c.take().unwrap().task_id, 1);
        c.release();
        assert_eq!(p.consumed(), 1);
        // A head beyond the tail is impossible: the ring counts as full.
        m.view.header().completion_head.store(100, Ordering::Release);
        assert_eq!(p.posted().wrapping_sub(p.consumed()), 4);
    }
}
