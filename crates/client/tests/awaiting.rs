//! `task.await` (`agora::Completion`): many awaited tasks on one executor thread, one waiting
//! thread per session, the executor never blocked, each failure its own, a dropped future
//! leaving its task running. The executor is a minimal one written here (any executor works:
//! the futures only use their `Waker`).

use std::future::{Future, IntoFuture};
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll, Wake, Waker};
use std::time::Duration;

use agora::{Arg, DeviceKind, Error, TaskError};

mod common;

/// The tests of this file one at a time: the first counts this process's waiting threads.
static ONE_AT_A_TIME: std::sync::Mutex<()> = std::sync::Mutex::new(());

fn alone() -> std::sync::MutexGuard<'static, ()> {
    ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner())
}

/// Wakes by unparking the thread that runs [`block_on`].
struct Unpark(std::thread::Thread);

impl Wake for Unpark {
    fn wake(self: Arc<Self>) {
        self.0.unpark();
    }
}

/// Runs `future` to its end on this thread, parking while it is pending.
fn block_on<F: Future>(future: F) -> F::Output {
    let mut future = std::pin::pin!(future);
    let waker = Waker::from(Arc::new(Unpark(std::thread::current())));
    let mut cx = Context::from_waker(&waker);
    loop {
        if let Poll::Ready(output) = future.as_mut().poll(&mut cx) {
            return output;
        }
        std::thread::park_timeout(Duration::from_secs(5));
    }
}

/// Every future of `futures`, polled together until all are ready (a `join_all`).
struct JoinAll<F: Future + Unpin> {
    futures: Vec<Option<F>>,
    outputs: Vec<Option<F::Output>>,
}

fn join_all<F: Future + Unpin>(futures: Vec<F>) -> JoinAll<F> {
    let outputs = futures.iter().map(|_| None).collect();
    JoinAll {
        futures: futures.into_iter().map(Some).collect(),
        outputs,
    }
}

impl<F: Future + Unpin> Future for JoinAll<F>
where
    F::Output: Unpin,
{
    type Output = Vec<F::Output>;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let this = &mut *self;
        for (slot, output) in this.futures.iter_mut().zip(this.outputs.iter_mut()) {
            if let Some(future) = slot {
                if let Poll::Ready(value) = Pin::new(future).poll(cx) {
                    *output = Some(value);
                    *slot = None;
                }
            }
        }
        if this.futures.iter().all(Option::is_none) {
            return Poll::Ready(this.outputs.iter_mut().map(|o| o.take().unwrap()).collect());
        }
        Poll::Pending
    }
}

/// Threads of this process named `agora-await`.
fn await_threads() -> usize {
    std::fs::read_dir("/proc/self/task")
        .unwrap()
        .filter_map(|t| std::fs::read_to_string(t.ok()?.path().join("comm")).ok())
        .filter(|name| name.trim() == "agora-await")
        .count()
}

fn cpu_queue(session: &agora::Session, name: &str) -> agora::Queue {
    agora_test_support::queue_preferring(session, name, DeviceKind::Cpu)
}

/// Side of the long task: an sgemm of 768² takes a few hundred milliseconds on a CPU lane.
const LONG_N: i32 = 768;

/// A long task on `q` and its output, whose every element will be `LONG_N`.
fn long_task(session: &agora::Session, q: &agora::Queue) -> (agora::Task, agora::Buffer) {
    agora_test_support::long_sgemm(session, q, LONG_N)
}

#[test]
fn many_awaited_tasks_share_one_thread_and_each_result_is_exact() {
    let _alone = alone();
    let (_daemon, session) = common::daemon("awaiting-many");
    let saxpy = session.kernel("saxpy").unwrap();
    let n = 4096;
    let queues: Vec<_> = (0..4).map(|i| cpu_queue(&session, &format!("await-{i}"))).collect();
    let x = session.buffer_from(&vec![1.0f32; n]).unwrap();
    let ys: Vec<_> = (0..4).map(|_| session.buffer_from(&vec![0.0f32; n]).unwrap()).collect();
    for (q, y) in queues.iter().zip(&ys) {
        q.sync_to(&x).unwrap();
        q.sync_to(y).unwrap();
    }
    let rounds = 50;
    let before = await_threads();
    for _ in 0..rounds {
        // One task per queue, all awaited together.
        let tasks: Vec<_> = queues
            .iter()
            .zip(&ys)
            .map(|(q, y)| {
                q.launch(&saxpy, &[Arg::F32(1.0), (&x).into(), y.into()], n)
                    .unwrap()
                    .into_future()
            })
            .collect();
        for outcome in block_on(join_all(tasks)) {
            outcome.unwrap();
        }
        // At most one more than before (another test's may still linger, for up to a second).
        let now = await_threads();
        assert!(
            now <= before + 1,
            "{now} waiting threads, {before} before this session's tasks"
        );
    }
    for (q, y) in queues.iter().zip(&ys) {
        block_on(q.sync_from(y).unwrap().into_future()).unwrap();
        assert!(y.as_slice::<f32>().iter().all(|v| *v == rounds as f32));
    }
}

/// Polled again and again (it wakes itself at once) until told to stop: counts how often the
/// executor thread was free to run it.
struct Ticker {
    ticks: u64,
    stop: Arc<AtomicBool>,
}

impl Future for Ticker {
    type Output = u64;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<u64> {
        if self.stop.load(Ordering::Relaxed) {
            return Poll::Ready(self.ticks);
        }
        self.ticks += 1;
        cx.waker().wake_by_ref();
        std::thread::sleep(Duration::from_micros(100));
        Poll::Pending
    }
}

#[test]
fn the_executor_thread_runs_other_futures_while_a_task_runs() {
    let _alone = alone();
    let (_daemon, session) = common::daemon("awaiting-free");
    let n = LONG_N;
    let q = cpu_queue(&session, "long");
    let (long, c) = long_task(&session, &q);
    let long = long.into_future();
    let stop = Arc::new(AtomicBool::new(false));
    let ticker = Ticker {
        ticks: 0,
        stop: stop.clone(),
    };
    // The task's future first, then the ticker, polled together on this one thread.
    let (outcome, ticks) = block_on(async move {
        let mut long = std::pin::pin!(long);
        let mut ticker = std::pin::pin!(ticker);
        let mut outcome = None;
        std::future::poll_fn(|cx| {
            if outcome.is_none() {
                if let Poll::Ready(o) = long.as_mut().poll(cx) {
                    outcome = Some(o);
                    stop.store(true, Ordering::Relaxed);
                }
            }
            match ticker.as_mut().poll(cx) {
                Poll::Ready(ticks) => Poll::Ready((outcome.take().unwrap(), ticks)),
                Poll::Pending => Poll::Pending,
            }
        })
        .await
    });
    outcome.unwrap();
    // A future that blocked in `poll` until the task was done would leave the ticker one tick.
    assert!(
        ticks >= 20,
        "the executor ran other work {ticks} times while an sgemm of {n}² ran"
    );
    block_on(q.sync_from(&c).unwrap().into_future()).unwrap();
    assert_eq!(c.as_slice::<f32>()[0], n as f32);
}

#[test]
fn an_awaited_failure_is_its_own_and_a_dropped_future_leaves_its_task_running() {
    let _alone = alone();
    let (_daemon, session) = common::daemon("awaiting-failures");
    let saxpy = session.kernel("saxpy").unwrap();
    let q = cpu_queue(&session, "failures");
    let small = session.buffer_from(&[0.0f32; 4]).unwrap();
    let big = session.buffer_from(&vec![2.0f32; 100]).unwrap();
    let bad = q
        .launch(&saxpy, &[Arg::F32(1.0), (&big).into(), (&small).into()], 100u64)
        .unwrap();
    match block_on(bad.into_future()) {
        Err(Error::Task(TaskError::BufferTooSmall { .. })) => {}
        other => panic!("expected the task's own BufferTooSmall, got {other:?}"),
    }
    assert!(matches!(q.finish(), Err(Error::Tasks(f)) if f.count == 1));
    // A future polled once (pending) and dropped: its task runs on.
    let n = LONG_N;
    let (long, c) = long_task(&session, &q);
    let mut long = long.into_future();
    let waker = Waker::from(Arc::new(Unpark(std::thread::current())));
    let first = Pin::new(&mut long).poll(&mut Context::from_waker(&waker));
    assert!(first.is_pending(), "an sgemm of {n}² was done at once");
    drop(long);
    q.sync_from(&c).unwrap().wait().unwrap();
    assert_eq!(c.as_slice::<f32>()[0], n as f32);
}

#[test]
fn each_callback_runs_once_on_the_waiting_thread_with_its_own_outcome() {
    let _alone = alone();
    let (_daemon, session) = common::daemon("callbacks-outcomes");
    let saxpy = session.kernel("saxpy").unwrap();
    let queues: Vec<_> = (0..4).map(|i| cpu_queue(&session, &format!("callbacks-{i}"))).collect();
    let n = 1024;
    let x = session.buffer_from(&vec![1.0f32; n]).unwrap();
    let y = session.buffer_from(&vec![0.0f32; n]).unwrap();
    let small = session.buffer_from(&[0.0f32; 4]).unwrap();
    let scratch: Vec<_> = (0..4).map(|_| session.buffer(1 << 16).unwrap()).collect();
    let (sender, receiver) = std::sync::mpsc::channel();
    let mut expected = std::collections::BTreeMap::new();
    let caller = std::thread::current().id();
    for i in 0..400 {
        let q = &queues[i % queues.len()];
        // Queue 0 adds x to y, but every seventh of its launches names an output too small: it
        // fails on its own. The other queues fill buffers of their own.
        let (task, fails) = if i % 4 == 0 {
            let fails = (i / 4) % 7 == 3;
            let output = if fails { &small } else { &y };
            (
                q.launch(&saxpy, &[Arg::F32(1.0), (&x).into(), output.into()], n as u64),
                fails,
            )
        } else {
            (q.memset(&scratch[i % 4], i as u8), false)
        };
        let task = task.unwrap();
        expected.insert(task.id(), fails);
        let sender = sender.clone();
        let id = task.id();
        task.on_complete(move |outcome| {
            let thread = std::thread::current();
            sender
                .send((id, outcome, thread.name().map(String::from), thread.id()))
                .unwrap()
        });
    }
    drop(sender);
    let mut told = std::collections::BTreeMap::new();
    for (id, outcome, name, thread) in receiver.iter() {
        assert_ne!(thread, caller, "task {id}'s callback ran on the caller's thread");
        assert_eq!(name.as_deref(), Some("agora-await"));
        assert!(told.insert(id, outcome).is_none(), "task {id}'s callback ran twice");
    }
    assert_eq!(
        told.len(),
        expected.len(),
        "every callback ran (the channel closed once all were dropped)"
    );
    for (id, fails) in &expected {
        match (&told[id], fails) {
            (Ok(()), false) => {}
            (Err(Error::Task(TaskError::BufferTooSmall { .. })), true) => {}
            (other, _) => panic!("task {id} (fails: {fails}) was told {other:?}"),
        }
    }
    // The failures were each told to their own callback; finish still reports them.
    let failed = expected.values().filter(|f| **f).count();
    assert!(failed > 10);
    assert!(matches!(queues[0].finish(), Err(Error::Tasks(f)) if f.count == failed as u64));
    queues[0].sync_from(&y).unwrap().wait().unwrap();
    let runs = expected.len() / 4 - failed;
    assert!(y.as_slice::<f32>().iter().all(|v| *v == runs as f32));
}

#[test]
fn a_callback_may_issue_more_work_and_one_that_panics_stops_no_other() {
    let _alone = alone();
    let (_daemon, session) = common::daemon("callbacks-chain");
    let q = Arc::new(cpu_queue(&session, "chain"));
    let saxpy = Arc::new(session.kernel("saxpy").unwrap());
    let n = 256;
    let x = Arc::new(session.buffer_from(&vec![1.0f32; n]).unwrap());
    let y = Arc::new(session.buffer_from(&vec![0.0f32; n]).unwrap());
    q.sync_to(&x).unwrap();
    q.sync_to(&y).unwrap();
    // A chain: each callback launches the next step and hands it its own callback.
    fn step(
        left: u32,
        q: Arc<agora::Queue>,
        saxpy: Arc<agora::Kernel>,
        x: Arc<agora::Buffer>,
        y: Arc<agora::Buffer>,
        done: std::sync::mpsc::Sender<Result<(), Error>>,
    ) {
        let task = q
            .launch(&saxpy, &[Arg::F32(1.0), (&*x).into(), (&*y).into()], y.len() / 4)
            .unwrap();
        task.on_complete(move |outcome| {
            if outcome.is_err() || left == 1 {
                done.send(outcome).unwrap();
            } else {
                step(left - 1, q, saxpy, x, y, done);
            }
        });
    }
    let (done, chain_end) = std::sync::mpsc::channel();
    step(50, q.clone(), saxpy.clone(), x.clone(), y.clone(), done);
    // Meanwhile: a callback that panics, then others on the same thread.
    let scratch = session.buffer(4096).unwrap();
    let (sender, others) = std::sync::mpsc::channel();
    q.memset(&scratch, 0)
        .unwrap()
        .on_complete(|_| panic!("a callback that panics (this test's)"));
    for _ in 0..5 {
        let sender = sender.clone();
        q.sync_to(&scratch)
            .unwrap()
            .on_complete(move |outcome| sender.send(outcome.is_ok()).unwrap());
    }
    drop(sender);
    for _ in 0..5 {
        let told = others.recv_timeout(Duration::from_secs(60));
        assert_eq!(
            told,
            Ok(true),
            "a callback after the one that panicked ran, told of its success"
        );
    }
    chain_end
        .recv_timeout(Duration::from_secs(60))
        .expect("the chain of callbacks ended")
        .unwrap();
    q.sync_from(&y).unwrap().wait().unwrap();
    // 50 steps of y += x, each issued by the previous one's callback.
    assert!(y.as_slice::<f32>().iter().all(|v| *v == 50.0));
}
