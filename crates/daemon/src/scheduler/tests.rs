//! Decisions of the stages, tested with hand-made inputs: devices built in the test (the CPU
//! and modeled `sim` devices), a `Ready` made by hand, no daemon, no client (the release of held
//! tasks posts completions to a session whose segment the test reads).

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Instant;

use agora_devices::cpu::CpuDevice;
use agora_devices::priority::{BatchPriority, LanePriorities};
use agora_devices::sim::{SimDevice, SimSpec};
use agora_devices::{Device, DeviceKind, Work};
use agora_kernels::ArgValue;
use agora_protocol::control::QueueClass;
use agora_protocol::{TaskError, MAX_ARGS};

use super::validate::{Action, Ready};
use super::{DeviceFacts, Scheduler, SchedulerConfig};
use crate::memory::tests_support::FarDevice;
use crate::policy::latency::LatencyPolicy;
use crate::policy::{PerformanceModel, RoundRobin};
use crate::revocation::Victim;
use crate::session::{Binding, QueueState};
use crate::telemetry::{Metrics, Telemetry};

fn config() -> SchedulerConfig {
    SchedulerConfig {
        inline_max_ns: 5_000.0,
        device_quota: 0,
        preempt_target_ns: 1e6,
        latency_policy: LatencyPolicy::Elastic,
        default_sla_ns: 200e6,
        revoke_min_ns: 1e6,
        revoke_max_save_share: 0.05,
        faults: None,
        pinned_limit_per_user: 0,
        checkpoints: None,
        lane_priorities: LanePriorities::normal(),
    }
}

fn scheduler(devices: Vec<Arc<dyn Device>>, config: SchedulerConfig) -> Scheduler {
    let facts = devices
        .iter()
        .map(|_| DeviceFacts {
            lane_watts: 10.0,
            bandwidth: 10e9,
        })
        .collect();
    let telemetry = Arc::new(Telemetry {
        metrics: Metrics::new(),
        trace: None,
    });
    Scheduler::new(
        devices,
        facts,
        Box::new(RoundRobin::default()),
        Arc::new(Mutex::new(PerformanceModel::new(0.8))),
        config,
        telemetry,
        Arc::new(crate::kernels::KernelRegistry::library_only()),
    )
}

/// A scheduler under `perf` over `devices`, nothing run inline (every launch is placed).
fn perf_scheduler(devices: Vec<Arc<dyn Device>>) -> Scheduler {
    let mut s = scheduler(
        devices,
        SchedulerConfig {
            inline_max_ns: 0.0,
            ..config()
        },
    );
    s.policy = Box::new(crate::policy::Perf);
    s
}

fn cpu() -> Arc<dyn Device> {
    Arc::new(CpuDevice::new(2, 1).unwrap())
}

fn sim(name: &str, kernels: Option<&[&str]>) -> Arc<dyn Device> {
    Arc::new(
        SimDevice::new(SimSpec {
            name: name.into(),
            kernels: kernels.map(|k| k.iter().map(|s| s.to_string()).collect()),
            ..Default::default()
        })
        .unwrap(),
    )
}

fn queue(class: QueueClass, preferred: Option<DeviceKind>) -> Arc<QueueState> {
    QueueState::new("q", class, preferred, None)
}

/// A `noop` launch over `items` work items (no buffers).
fn noop(queue: &Arc<QueueState>, items: u64) -> Ready {
    let (_, kernel) = agora_kernels::find("noop").unwrap();
    Ready {
        queue: queue.clone(),
        action: Action::Launch {
            kernel: kernel.into(),
            id: 0,
            range: [items, 1, 1],
            dims: 1,
            args: [ArgValue::None; MAX_ARGS],
            arg_count: 0,
            window: None,
        },
        estimated_ns: kernel.estimated_ns(items),
        items,
        touched_bytes: 0,
        slots: 0,
        buffers: Default::default(),
    }
}

#[test]
fn a_tiny_task_of_an_idle_queue_runs_inline_on_the_host_device() {
    let mut s = scheduler(vec![sim("sim0", None), cpu()], config());
    let q = queue(QueueClass::Batch, None);
    // The first launch of its shape goes to a lane, which measures it...
    let placed = s.place(&noop(&q, 16)).unwrap();
    assert!(!placed.tiny_on_host && !placed.inline_allowed && placed.shape.is_some());
    s.inline_guard.measured_on_lane(placed.shape.unwrap(), 500.0);
    // ... short: from then on it runs inline.
    let placed = s.place(&noop(&q, 16)).unwrap();
    assert!(placed.tiny_on_host && placed.idle);
    assert_eq!(
        placed.binding,
        Binding::new(1, 0),
        "the CPU (device 1) shares host memory"
    );
    assert_eq!(placed.required_slices, 1);
    // Too long to run inline: it goes to a lane the policy picks.
    let placed = s.place(&noop(&q, 1 << 30)).unwrap();
    assert!(!placed.tiny_on_host);
}

#[test]
fn a_preferred_kind_is_honoured_and_a_busy_queue_stays_on_its_lane() {
    let mut s = scheduler(vec![cpu(), sim("sim0", None)], config());
    let q = queue(QueueClass::Batch, Some(DeviceKind::Sim));
    for _ in 0..4 {
        let placed = s.place(&noop(&q, 16)).unwrap();
        assert_eq!(placed.binding.device(), 1, "the queue prefers sim");
        assert!(!placed.tiny_on_host, "inline runs only on the host device");
    }
    // Busy on sim0/lane1: its next task goes there whatever the policy would say.
    q.binding.store(Binding::new(1, 1));
    q.in_flight.fetch_add(1, Ordering::AcqRel);
    let placed = s.place(&noop(&q, 1 << 30)).unwrap();
    assert_eq!(placed.binding, Binding::new(1, 1));
    assert!(!placed.idle);
}

#[test]
fn an_idle_queue_returns_to_its_previous_lane_while_it_is_idle() {
    let mut s = scheduler(vec![cpu(), sim("sim0", None)], config());
    let q = queue(QueueClass::Batch, Some(DeviceKind::Sim));
    // Never bound: the round-robin policy rotates over the device's idle lanes.
    let lanes: std::collections::HashSet<usize> = (0..4)
        .map(|_| s.place(&noop(&q, 1 << 30)).unwrap().binding.lane())
        .collect();
    assert_eq!(lanes, [0, 1].into());
    // Its last task ran on sim0/lane 1 and finished: every later task goes back there (its
    // thread is still spinning), whichever lane the policy's rotation would give.
    q.binding.store(Binding::new(1, 1));
    for _ in 0..4 {
        assert_eq!(s.place(&noop(&q, 1 << 30)).unwrap().binding, Binding::new(1, 1));
    }
    // The previous lane is on a device the policy did not choose: the policy's choice stands.
    q.binding.store(Binding::new(0, 1));
    for _ in 0..4 {
        assert_eq!(s.place(&noop(&q, 1 << 30)).unwrap().binding.device(), 1);
    }
}

/// The client sees its task's completion a moment before the lane counts the job done, so an
/// idle queue often finds its own lane at load 1: a tie with a lane that holds another tenant's
/// long work must not go to the rotation.
#[test]
fn an_idle_queue_stays_on_its_lane_rather_than_join_a_neighbour_with_as_many_jobs_and_more_work() {
    let device = Tweaked {
        inner: sim("sim0", None),
        slice_floor: None,
        loads: Some(vec![1, 1]),
    };
    let mut s = scheduler(vec![cpu(), Arc::new(device)], config());
    let q = queue(QueueClass::Batch, Some(DeviceKind::Sim));
    // Lane 0: the queue's own last job, about done. Lane 1: a neighbour's long transfer.
    q.binding.store(Binding::new(1, 0));
    s.lane_pending[1][0].store(1_000, Ordering::Relaxed);
    s.lane_pending[1][1].store(50_000_000, Ordering::Relaxed);
    for _ in 0..4 {
        assert_eq!(s.place(&noop(&q, 1 << 30)).unwrap().binding, Binding::new(1, 0));
    }
    // The queue's lane holds more predicted work than the other: the rotation decides again.
    s.lane_pending[1][0].store(100_000_000, Ordering::Relaxed);
    let lanes: std::collections::HashSet<usize> = (0..4)
        .map(|_| s.place(&noop(&q, 1 << 30)).unwrap().binding.lane())
        .collect();
    assert_eq!(lanes, [0, 1].into());
}

#[test]
fn devices_that_lack_the_kernel_or_are_draining_get_no_work() {
    let mut s = scheduler(
        vec![cpu(), sim("saxpy-only", Some(&["saxpy"])), sim("all", None)],
        config(),
    );
    let q = queue(QueueClass::Batch, Some(DeviceKind::Sim));
    let mut used = std::collections::HashSet::new();
    for _ in 0..8 {
        used.insert(s.place(&noop(&q, 1 << 30)).unwrap().binding.device());
    }
    assert_eq!(used, [2].into(), "noop runs only on the sim that implements it");
    s.set_draining(2, true).unwrap();
    for _ in 0..8 {
        let device = s.place(&noop(&q, 1 << 30)).unwrap().binding.device();
        assert_eq!(device, 0, "the preferred kind is drained or lacks noop: anywhere else");
    }
}

#[test]
fn a_kernel_no_device_implements_fails_with_no_device() {
    let mut s = scheduler(vec![sim("saxpy-only", Some(&["saxpy"]))], config());
    let q = queue(QueueClass::Batch, None);
    assert!(matches!(s.place(&noop(&q, 1 << 30)), Err(TaskError::NoDevice(_))));
}

#[test]
fn latency_work_goes_where_it_starts_soonest() {
    let mut s = scheduler(vec![sim("a", None), sim("b", None)], config());
    let q = queue(QueueClass::Latency, None);
    // Latency work already queued on every lane but b/lane1.
    let charges = [(0, 0), (0, 1), (1, 0)].map(|(d, l)| s.books.charge(d, l, 5_000_000));
    for _ in 0..4 {
        assert_eq!(s.place(&noop(&q, 1 << 30)).unwrap().binding, Binding::new(1, 1));
    }
    drop(charges);
}

#[test]
fn a_latency_task_revokes_the_batch_launch_on_its_lane_only_when_the_policy_says_so() {
    let victim = |s: &Scheduler| {
        let flag = Arc::new(AtomicBool::new(false));
        *s.books.victim_slot(0, 0).lock().unwrap() = Some(Victim {
            flag: flag.clone(),
            started: Some(Instant::now()),
            // Ten seconds left: a 200 ms SLA is missed without revoking.
            predicted_ns: 10e9,
            revocations: 0,
            cost_ns: 1e5,
        });
        flag
    };
    let q = queue(QueueClass::Latency, None);
    for (policy, revokes) in [
        (LatencyPolicy::None, false),
        (LatencyPolicy::Priority, true),
        (LatencyPolicy::Elastic, true),
    ] {
        let s = scheduler(
            vec![cpu()],
            SchedulerConfig {
                latency_policy: policy,
                ..config()
            },
        );
        let flag = victim(&s);
        let placement = super::place::Placement {
            binding: Binding::new(0, 0),
            idle: true,
            tiny_on_host: false,
            required_slices: 1,
            inline_allowed: false,
            shape: None,
        };
        s.revoke_for(&noop(&q, 1 << 20), &placement);
        assert_eq!(flag.load(Ordering::Acquire), revokes, "{policy:?}");
    }
}

#[test]
fn long_batch_launches_are_sliced_to_the_preemption_target() {
    let s = scheduler(vec![cpu()], config());
    let work = |rows: u64| Work::Launch {
        kernel: agora_kernels::find("noop").unwrap().1.into(),
        range: [rows, 1, 1],
        dims: 1,
        args: [ArgValue::None; MAX_ARGS],
        arg_count: 0,
        device_args: Default::default(),
        rows: None,
    };
    // 10 ms predicted, 1 ms target: ten slices.
    assert_eq!(s.slices_for(0, &work(1 << 20), QueueClass::Batch, 10e6), 10);
    // Short ones, latency work and non-launches are never sliced.
    assert_eq!(s.slices_for(0, &work(1 << 20), QueueClass::Batch, 1.5e6), 1);
    assert_eq!(s.slices_for(0, &work(1 << 20), QueueClass::Latency, 10e6), 1);
    assert_eq!(s.slices_for(0, &Work::Nothing, QueueClass::Batch, 10e6), 1);
    // Never more slices than rows, nor than the cap.
    assert_eq!(s.slices_for(0, &work(3), QueueClass::Batch, 10e6), 3);
    assert_eq!(
        s.slices_for(0, &work(1 << 30), QueueClass::Batch, 1e12),
        super::MAX_SLICES
    );
    // A long batch launch on the CPU (which polls the flag) is revocable unless the latency
    // policy is none; latency work never is.
    assert!(s.revocable(0, &work(1 << 20), QueueClass::Batch, 10e6, || 0));
    assert!(!s.revocable(0, &work(1 << 20), QueueClass::Latency, 10e6, || 0));
    assert!(!s.revocable(0, &work(1 << 20), QueueClass::Batch, 0.5e6, || 0));
    // Nor is one whose read-write buffers take longer than 5 % of it to save (at 10 GB/s: 5 MB
    // is 0.5 ms, 5 % of 10 ms; nw's 64 MiB score matrix before each 100 µs diagonal on a GPU).
    assert!(s.revocable(0, &work(1 << 20), QueueClass::Batch, 10e6, || 5_000_000));
    assert!(!s.revocable(0, &work(1 << 20), QueueClass::Batch, 10e6, || 5_000_001));
    assert!(!s.revocable(0, &work(1 << 20), QueueClass::Batch, 100e3, || 64 << 20));
}

#[test]
fn a_busy_queue_on_a_draining_device_is_held_and_an_idle_one_goes_on() {
    let mut s = scheduler(vec![cpu(), sim("a", None)], config());
    let q = queue(QueueClass::Batch, Some(DeviceKind::Sim));
    // Busy on sim a (device 1).
    q.binding.store(Binding::new(1, 0));
    q.in_flight.fetch_add(1, Ordering::AcqRel);
    assert_eq!(
        s.must_hold(7, &noop(&q, 1 << 30)),
        Ok(false),
        "its device works: it stays"
    );
    s.set_draining(1, true).unwrap();
    assert_eq!(
        s.must_hold(7, &noop(&q, 1 << 30)),
        Ok(true),
        "busy on a draining device: held"
    );
    assert!(s.migration.holding());
    // Held: every later task of the queue waits behind it, in order.
    assert_eq!(s.must_hold(7, &noop(&q, 16)), Ok(true));
    // Another session's idle queue goes on (to another device).
    let other = queue(QueueClass::Batch, Some(DeviceKind::Sim));
    assert_eq!(s.must_hold(8, &noop(&other, 16)), Ok(false));
    let placed = s.place(&noop(&other, 1 << 30)).unwrap();
    assert_eq!(placed.binding.device(), 0, "not on the draining device");
    q.in_flight.fetch_sub(1, Ordering::AcqRel);
}

#[test]
fn a_queue_whose_device_lacks_the_next_kernel_moves() {
    let mut s = scheduler(vec![cpu(), sim("saxpy-only", Some(&["saxpy"]))], config());
    let q = queue(QueueClass::Batch, None);
    q.binding.store(Binding::new(1, 0));
    q.in_flight.fetch_add(1, Ordering::AcqRel);
    assert_eq!(s.must_hold(3, &noop(&q, 16)), Ok(true), "noop is missing on its device");
    q.in_flight.fetch_sub(1, Ordering::AcqRel);
}

/// A session without a client (a real sealed segment, a socketpair that nobody reads): where
/// dispatched tasks post their completions.
fn session() -> crate::session::Session {
    use agora_protocol::segment::Geometry;
    let geometry = Geometry::new(8, 8, 1 << 16).unwrap();
    let segment = agora_transport::shm::Segment::create("agora-test", geometry).unwrap();
    let (stream, _peer) = std::os::unix::net::UnixStream::pair().unwrap();
    crate::session::Session::new(
        7,
        crate::session::Credentials::default(),
        "test".into(),
        std::sync::Arc::new(stream),
        agora_transport::socket::FrameReader::default(),
        agora_transport::wake::Doorbell::new().unwrap(),
        segment,
        16,
        64,
        u64::MAX,
    )
}

/// No transfer is free: a job's transfers are booked on its lane's predicted work (so policies,
/// and tasks that would queue behind it, see it), and given back when it is done.
#[test]
fn a_transfer_books_its_predicted_time_on_its_lane_until_it_is_done() {
    // A link of 50 kB/s: the sim takes 1.3 s over 64 KiB (time enough to look at the books
    // however slow the machine is); the scheduler predicts 10 GB/s.
    let slow = SimDevice::new(SimSpec {
        name: "slow-link".into(),
        bandwidth: 5e4,
        ..Default::default()
    })
    .unwrap();
    let mut s = scheduler(vec![cpu(), Arc::new(slow)], config());
    let mut session = session();
    let len = 64 << 10;
    let (handle, _) = session.alloc_buffer(len).unwrap();
    let record = session.buffers.get(handle).unwrap().clone();
    let q = queue(QueueClass::Batch, Some(DeviceKind::Sim));
    let mut buffers: [Option<(Arc<crate::memory::BufferRecord>, agora_protocol::Access, bool)>; MAX_ARGS] =
        Default::default();
    buffers[0] = Some((record, agora_protocol::Access::Read, false));
    let ready = Ready {
        queue: q.clone(),
        action: Action::SyncTo,
        estimated_ns: 0.0,
        items: 0,
        touched_bytes: len,
        slots: 1,
        buffers,
    };
    let roles = super::data_roles(&ready);
    s.place_and_submit(&session, 1, ready, roles).unwrap();
    let booked = |s: &Scheduler| -> u64 { s.lane_pending[1].iter().map(|p| p.load(Ordering::Relaxed)).sum() };
    // 65 536 bytes at 10 GB/s.
    assert_eq!(booked(&s), 6_553, "booked while the transfer runs");
    let deadline = Instant::now() + std::time::Duration::from_secs(10);
    while q.in_flight.load(Ordering::Acquire) > 0 {
        assert!(Instant::now() < deadline, "the sync_to never completed");
        std::thread::sleep(std::time::Duration::from_millis(1));
    }
    assert_eq!(booked(&s), 0, "given back when done");
}

/// A device's link is learned like a kernel over bytes (`policy::model::TRANSFERS`): once a
/// transfer of some size was measured there, the next one of that size is booked at the measured
/// time, not at the configured bandwidth (10 GB/s here, for a sim that moves 1 MB/s).
#[test]
fn a_transfer_is_booked_at_what_the_device_s_link_was_measured_to_take() {
    let slow = SimDevice::new(SimSpec {
        name: "slow-link".into(),
        bandwidth: 1e6,
        ..Default::default()
    })
    .unwrap();
    let mut s = scheduler(vec![cpu(), Arc::new(slow)], config());
    let mut session = session();
    let q = queue(QueueClass::Batch, Some(DeviceKind::Sim));
    let booked = |s: &Scheduler| -> u64 { s.lane_pending[1].iter().map(|p| p.load(Ordering::Relaxed)).sum() };
    let len = 16 << 10;
    let mut bookings = Vec::new();
    for task in [1, 2] {
        let (ready, _record) = sync_to(&mut session, &q, len);
        let roles = super::data_roles(&ready);
        s.place_and_submit(&session, task, ready, roles).unwrap();
        bookings.push(booked(&s));
        let deadline = Instant::now() + std::time::Duration::from_secs(10);
        while q.in_flight.load(Ordering::Acquire) > 0 {
            assert!(Instant::now() < deadline, "the sync_to never completed");
            std::thread::sleep(std::time::Duration::from_millis(1));
        }
    }
    // 16 384 bytes at the configured 10 GB/s, then at the 1 MB/s measured (16 ms).
    assert_eq!(bookings[0], 1_638, "nothing measured yet: the configured bandwidth");
    let measured = s
        .model
        .lock()
        .unwrap()
        .estimate(crate::policy::model::TRANSFERS, "slow-link", len)
        .ns()
        .expect("the first transfer was measured");
    assert!(measured > 10e6, "the sim took 16 ms, the model says {measured} ns");
    assert!(
        // (The model has folded in the second transfer since: within a tenth.)
        (bookings[1] as f64 - measured).abs() < 0.1 * measured && bookings[1] > 1_000 * bookings[0],
        "booked {} ns, measured {measured} ns",
        bookings[1]
    );
}

#[test]
fn held_tasks_are_released_in_order_once_their_queue_has_nothing_in_flight() {
    let mut s = scheduler(vec![cpu(), sim("a", None)], config());
    let session = session();
    let q = queue(QueueClass::Batch, None);
    // Busy on sim a (device 1), which starts draining: its next tasks are held, in order.
    q.binding.store(Binding::new(1, 0));
    q.in_flight.fetch_add(1, Ordering::AcqRel);
    s.set_draining(1, true).unwrap();
    for task in [21, 22, 23] {
        let ready = noop(&q, 16);
        assert_eq!(s.must_hold(session.id, &ready), Ok(true));
        s.hold(&session, task, ready);
    }
    // Still busy: a release changes nothing.
    s.release_held(&session);
    assert!(s.migration.holding());
    let view = *session.shared.segment.view();
    let mut completions = agora_protocol::ring::CompletionConsumer::new(view);
    assert!(completions.take().is_none(), "nothing ran while its queue was busy");
    // Its last task on a finishes: the held ones go, in order, to a device that is not draining.
    q.in_flight.fetch_sub(1, Ordering::AcqRel);
    s.release_held(&session);
    assert!(!s.migration.holding());
    assert!(!q.moving.load(Ordering::Acquire));
    assert_eq!(
        completed(&mut completions, 3),
        [21, 22, 23],
        "in the order they were held"
    );
}

/// A device with some answers of another overridden: `slice_floor`, work items each slice must
/// fill (as a GPU's resident threads, `Device::min_items_per_slice`); `loads`, the lanes' job
/// counts (`Device::lane_load`), as if jobs were queued there.
#[derive(Debug)]
struct Tweaked {
    inner: Arc<dyn Device>,
    slice_floor: Option<u64>,
    loads: Option<Vec<usize>>,
}

impl Device for Tweaked {
    fn info(&self) -> &agora_devices::DeviceInfo {
        self.inner.info()
    }
    fn implements(&self, kernel: &agora_kernels::KernelDef) -> bool {
        self.inner.implements(kernel)
    }
    fn submit(&self, lane: usize, job: agora_devices::Job) {
        self.inner.submit(lane, job)
    }
    fn lane_load(&self, lane: usize) -> usize {
        match &self.loads {
            Some(loads) => loads[lane],
            None => self.inner.lane_load(lane),
        }
    }
    fn run_inline(&self, work: &Work) -> Result<(), TaskError> {
        self.inner.run_inline(work)
    }
    fn alloc(&self, tenant: u64, len: u64) -> Option<Result<Arc<dyn agora_devices::DeviceBuffer>, TaskError>> {
        self.inner.alloc(tenant, len)
    }
    unsafe fn read(&self, from: &dyn agora_devices::DeviceBuffer, host: *mut u8, len: usize) -> Result<(), TaskError> {
        // SAFETY: the caller's contract, passed on.
        unsafe { self.inner.read(from, host, len) }
    }
    fn runs_row_slices(&self) -> bool {
        self.inner.runs_row_slices()
    }
    fn slices(&self, kernel: &agora_kernels::KernelDef) -> bool {
        self.inner.slices(kernel)
    }
    fn min_items_per_slice(&self) -> u64 {
        self.slice_floor.unwrap_or_else(|| self.inner.min_items_per_slice())
    }
    fn status(&self) -> agora_devices::DeviceReport {
        self.inner.status()
    }
    fn shutdown(&self) {
        self.inner.shutdown()
    }
}

#[test]
fn no_slice_is_smaller_than_the_device_fills_at_once() {
    // 270 336 threads: an H200's 132 multiprocessors × 2048.
    let floor = 132 * 2048;
    let device = Tweaked {
        inner: cpu(),
        slice_floor: Some(floor),
        loads: None,
    };
    let s = scheduler(vec![Arc::new(device)], config());
    let work = |range: [u64; 3], dims: usize| Work::Launch {
        kernel: agora_kernels::find("noop").unwrap().1.into(),
        range,
        dims,
        args: [ArgValue::None; MAX_ARGS],
        arg_count: 0,
        device_args: Default::default(),
        rows: None,
    };
    // lavaMD's launch (409 600 work items) predicted at a second by the CPU-based estimate:
    // one slice, not a thousand.
    assert_eq!(s.slices_for(0, &work([409_600, 1, 1], 1), QueueClass::Batch, 1e9), 1);
    // Ten full GPUs' worth of items: at most ten slices, however long the prediction.
    assert_eq!(
        s.slices_for(0, &work([10 * floor, 1, 1], 1), QueueClass::Batch, 1e12),
        10
    );
    // Dimensions 1 and 2 count: 2048 x 2048 items fill the GPU 15 times.
    assert_eq!(s.slices_for(0, &work([2048, 2048, 1], 2), QueueClass::Batch, 1e12), 15);
    // Within the floor, the preemption target still decides.
    assert_eq!(
        s.slices_for(0, &work([100 * floor, 1, 1], 1), QueueClass::Batch, 5e6),
        5
    );
}

/// The dispatcher spins only while a core is left for clients: it counts the host cores our
/// own long work holds, which only CPU lanes (with all their threads) do.
#[test]
fn only_cpu_lanes_with_long_work_hold_host_cores() {
    let s = scheduler(
        vec![Arc::new(CpuDevice::new(2, 3).unwrap()), sim("gpu", None)],
        config(),
    );
    assert_eq!(s.cores_held_by_long_work(), 0, "idle lanes hold nothing");
    // Short work on a CPU lane and long work on the sim's lanes: still no core held.
    s.lane_pending[0][0].store(super::LONG_WORK_NS - 1, Ordering::Relaxed);
    s.lane_pending[1][0].store(100 * super::LONG_WORK_NS, Ordering::Relaxed);
    s.lane_pending[1][1].store(100 * super::LONG_WORK_NS, Ordering::Relaxed);
    assert_eq!(s.cores_held_by_long_work(), 0);
    // Long work on one CPU lane holds its three threads' cores; on both, six.
    s.lane_pending[0][0].store(super::LONG_WORK_NS, Ordering::Relaxed);
    assert_eq!(s.cores_held_by_long_work(), 3);
    s.lane_pending[0][1].store(super::LONG_WORK_NS, Ordering::Relaxed);
    assert_eq!(s.cores_held_by_long_work(), 6);
    // Batch lanes at SCHED_IDLE hold no core against anyone.
    let idle = scheduler(
        vec![Arc::new(CpuDevice::new(2, 3).unwrap())],
        SchedulerConfig {
            lane_priorities: LanePriorities::assumed(BatchPriority::Idle),
            ..config()
        },
    );
    idle.lane_pending[0][0].store(super::LONG_WORK_NS, Ordering::Relaxed);
    assert_eq!(idle.cores_held_by_long_work(), 0);
}

/// `batch_priority = "auto"`: a latency-class task puts batch lanes at `idle` (then their long
/// work holds no core, so the dispatcher may spin for the latency tenant); they stay there while
/// latency tasks keep coming and go back to `batch` once none came for a second. Batch tasks
/// change nothing.
#[test]
fn a_latency_task_puts_auto_batch_lanes_at_idle_until_latency_work_has_been_quiet_a_second() {
    let priorities = LanePriorities::assumed(BatchPriority::Auto);
    let mut s = scheduler(
        vec![Arc::new(CpuDevice::new(2, 1).unwrap())],
        SchedulerConfig {
            lane_priorities: priorities.clone(),
            ..config()
        },
    );
    s.lane_pending[0][0].store(super::LONG_WORK_NS, Ordering::Relaxed);
    let session = session();
    let submit = |s: &mut Scheduler, class: QueueClass, task: u64| {
        let ready = noop(&queue(class, None), 1);
        let roles = super::data_roles(&ready);
        s.place_and_submit(&session, task, ready, roles).unwrap();
    };
    let start = Instant::now();
    let second = std::time::Duration::from_secs(1);
    s.tick(start);
    submit(&mut s, QueueClass::Batch, 1);
    assert_eq!(priorities.batch_now(), BatchPriority::Batch, "batch work alone");
    assert_eq!(s.cores_held_by_long_work(), 1);
    assert_eq!(s.next_tick(), None);
    submit(&mut s, QueueClass::Latency, 2);
    assert_eq!(priorities.batch_now(), BatchPriority::Idle, "latency work is live");
    assert_eq!(s.cores_held_by_long_work(), 0, "idle lanes hold no core");
    assert_eq!(s.next_tick(), Some(start + second));
    // Another latency task 0.8 s later holds it 1 s from then.
    s.tick(start + second * 8 / 10);
    submit(&mut s, QueueClass::Latency, 3);
    s.tick(start + second * 17 / 10);
    assert_eq!(priorities.batch_now(), BatchPriority::Idle);
    submit(&mut s, QueueClass::Batch, 4);
    s.tick(start + second * 18 / 10);
    assert_eq!(priorities.batch_now(), BatchPriority::Batch, "quiet for a second");
    assert_eq!(s.next_tick(), None);
    assert_eq!(s.batch_priority_switches, 2);
    // Under any other setting nothing switches.
    let batch = LanePriorities::assumed(BatchPriority::Batch);
    let mut s = scheduler(
        vec![Arc::new(CpuDevice::new(1, 1).unwrap())],
        SchedulerConfig {
            lane_priorities: batch.clone(),
            ..config()
        },
    );
    s.tick(Instant::now());
    submit(&mut s, QueueClass::Latency, 5);
    assert_eq!(
        (batch.batch_now(), s.next_tick(), s.batch_priority_switches),
        (BatchPriority::Batch, None, 0)
    );
}

/// A `sync_to` of a fresh buffer of `len` bytes, on `q`.
fn sync_to(
    session: &mut crate::session::Session,
    q: &Arc<QueueState>,
    len: u64,
) -> (Ready, Arc<crate::memory::BufferRecord>) {
    let (handle, _) = session.alloc_buffer(len).unwrap();
    let record = session.buffers.get(handle).unwrap().clone();
    let mut buffers: [Option<(Arc<crate::memory::BufferRecord>, agora_protocol::Access, bool)>; MAX_ARGS] =
        Default::default();
    buffers[0] = Some((record.clone(), agora_protocol::Access::Read, false));
    let ready = Ready {
        queue: q.clone(),
        action: Action::SyncTo,
        estimated_ns: 0.0,
        items: 0,
        touched_bytes: len,
        slots: 1,
        buffers,
    };
    (ready, record)
}

/// Issue 22, 3c: on a device whose allocations another process answers, the dispatcher asks and
/// goes on; the task (and its queue's later tasks, in order) waits for the answer. A refused
/// answer leaves the task to allocate the usual way (synchronously, where a refusal evicts and
/// retries or waits for room); it waits for allocations asked ahead only once.
#[test]
fn a_far_allocation_is_awaited_by_its_task_not_by_the_dispatcher() {
    let far = Arc::new(FarDevice::new(sim("far", None)));
    let mut s = scheduler(vec![cpu(), far.clone()], config());
    let mut session = session();
    let q = queue(QueueClass::Batch, Some(DeviceKind::Sim));
    let view = *session.shared.segment.view();
    let mut completions = agora_protocol::ring::CompletionConsumer::new(view);
    let len = 4096;
    let (first, record) = sync_to(&mut session, &q, len);
    let roles = super::data_roles(&first);
    s.place_and_submit(&session, 1, first, roles).unwrap();
    let (second, second_record) = sync_to(&mut session, &q, len);
    let roles = super::data_roles(&second);
    s.place_and_submit(&session, 2, second, roles).unwrap();
    assert_eq!(
        far.synchronous_allocations.load(Ordering::Relaxed),
        0,
        "the dispatcher did not wait for an allocation"
    );
    assert!(s.migration.holding(), "the task waits in its queue");
    assert_eq!(
        session.shared.device_usage.bytes[1].load(Ordering::Relaxed),
        len,
        "the bytes asked count as the session's"
    );
    s.release_held(&session);
    assert!(completions.take().is_none(), "nothing ran before the answer");
    assert!(!record.placement().is_on(1));
    // Answered: the first task is dispatched with its buffer there; the second, behind it, asks
    // for its own.
    assert_eq!(far.answer_allocations(false), 1);
    s.release_held(&session);
    assert!(
        record.placement().is_on(1),
        "the allocation is the buffer's copy on the device"
    );
    assert_eq!(far.synchronous_allocations.load(Ordering::Relaxed), 0);
    assert!(s.migration.holding(), "the second task waits for its own allocation");
    // Refused: the second task allocates synchronously (the sim takes it) and runs.
    assert_eq!(far.answer_allocations(true), 1);
    s.release_held(&session);
    assert!(!s.migration.holding());
    assert_eq!(
        far.synchronous_allocations.load(Ordering::Relaxed),
        1,
        "after a refusal the task allocates as it plans"
    );
    assert!(second_record.placement().is_on(1));
    assert_eq!(
        session.shared.device_usage.bytes[1].load(Ordering::Relaxed),
        2 * len,
        "the refused bytes stopped counting; each buffer's copy counts once"
    );
    assert_eq!(completed(&mut completions, 2), [1, 2], "in issue order");
}

/// Only tasks that plan copies on the device (launches, `sync_to`) have allocations asked ahead:
/// a `sync_from` of a buffer the device does not hold works on the host copy, and an allocation
/// for it would sit unused.
#[test]
fn a_task_that_makes_no_device_copy_has_nothing_allocated_ahead() {
    let far = Arc::new(FarDevice::new(sim("far", None)));
    let mut s = scheduler(vec![cpu(), far.clone()], config());
    let mut session = session();
    let q = queue(QueueClass::Batch, Some(DeviceKind::Sim));
    // Busy on the far device (device 1): the task follows its queue there.
    q.binding.store(Binding::new(1, 0));
    q.in_flight.fetch_add(1, Ordering::AcqRel);
    let (mut ready, record) = sync_to(&mut session, &q, 4096);
    ready.action = Action::SyncFrom;
    let roles = super::data_roles(&ready);
    assert_eq!(s.place(&ready).unwrap().binding, Binding::new(1, 0));
    s.place_and_submit(&session, 1, ready, roles).unwrap();
    q.in_flight.fetch_sub(1, Ordering::AcqRel);
    assert!(far.allocations.lock().unwrap().is_empty(), "nothing asked ahead");
    assert!(!s.migration.holding(), "nothing to wait for");
    assert_eq!(
        far.synchronous_allocations.load(Ordering::Relaxed),
        0,
        "nor allocated as it planned"
    );
    assert!(!record.placement().is_on(1));
    assert_eq!(session.shared.device_usage.bytes[1].load(Ordering::Relaxed), 0);
}

#[test]
fn perf_sends_a_tiny_task_to_the_host_and_explores_with_a_long_one() {
    let mut s = perf_scheduler(vec![sim("sim0", None), cpu()]);
    // Nothing measured anywhere. The host's prior is the library's estimate: far below
    // EXPLORE_WORTH_NS for 16 items, so the untried sim device (listed first) is not explored.
    let tiny = noop(&queue(QueueClass::Batch, None), 16);
    assert!(tiny.estimated_ns < crate::policy::EXPLORE_WORTH_NS);
    assert_eq!(s.place(&tiny).unwrap().binding.device(), 1, "the CPU, device 1");
    // A launch estimated long is worth trying the untried device with.
    let long = noop(&queue(QueueClass::Batch, None), 1 << 30);
    assert!(long.estimated_ns >= crate::policy::EXPLORE_WORTH_NS);
    assert_eq!(s.place(&long).unwrap().binding.device(), 0, "sim0, explored");
}

/// A `fill` launch over a new buffer of `len` bytes, estimated at `estimated_ns` on a host core.
fn fill(
    session: &mut crate::session::Session,
    q: &Arc<QueueState>,
    len: u64,
    estimated_ns: f64,
) -> (Ready, Arc<crate::memory::BufferRecord>) {
    let (_, kernel) = agora_kernels::find("fill").unwrap();
    let (mut ready, record) = sync_to(session, q, len);
    let mut args = [ArgValue::None; MAX_ARGS];
    args[0] = ArgValue::Scalar(u64::from(1.0f32.to_bits()));
    ready.buffers.swap(0, 1);
    ready.buffers[1] = Some((record.clone(), agora_protocol::Access::Write, true));
    ready.slots = 2;
    ready.items = len / 4;
    ready.estimated_ns = estimated_ns;
    ready.action = Action::Launch {
        kernel: kernel.into(),
        id: 0,
        range: [len / 4, 1, 1],
        dims: 1,
        args,
        arg_count: 2,
        window: None,
    };
    (ready, record)
}

/// Completions posted to `session` until `count` came (10 s at most), each checked successful.
fn completed(completions: &mut agora_protocol::ring::CompletionConsumer, count: usize) -> Vec<u64> {
    let deadline = Instant::now() + std::time::Duration::from_secs(10);
    let mut done = Vec::new();
    while done.len() < count {
        assert!(Instant::now() < deadline, "tasks completed: {done:?}");
        match completions.take() {
            Some(c) => {
                assert!(c.result().is_ok(), "task {}: {:?}", c.task_id, c.result());
                done.push(c.task_id);
            }
            None => std::thread::yield_now(),
        }
    }
    done
}

/// `perf` explores a device in a device host (its allocations answered late) with a long launch
/// of a queue that prefers no device: once the allocations came, the launch goes there, not
/// wherever a second placement would send it. Before, it was placed again and (the device now
/// marked as being explored, assumed as slow as a host core and paying the transfer) went to the
/// CPU: no device in a device host — OpenCL, GPUs — was ever measured for any kernel, and the
/// mark stayed.
#[test]
fn a_launch_that_waited_for_its_allocations_runs_where_they_were_made() {
    let far = Arc::new(FarDevice::new(sim("far", None)));
    let mut s = perf_scheduler(vec![cpu(), far.clone()]);
    let mut session = session();
    let view = *session.shared.segment.view();
    let mut completions = agora_protocol::ring::CompletionConsumer::new(view);
    let q = queue(QueueClass::Batch, None);
    // 1 ms on a host core by the library's estimate: worth exploring the untried device with.
    let (first, record) = fill(&mut session, &q, 1 << 12, 1e6);
    let roles = super::data_roles(&first);
    s.place_and_submit(&session, 1, first, roles).unwrap();
    assert!(s.migration.holding(), "it waits for its allocation on the far device");
    assert_eq!(far.answer_allocations(false), 1);
    s.release_held(&session);
    assert!(!s.migration.holding());
    assert!(record.placement().is_on(1));
    assert_eq!(q.binding.load().device(), 1, "it ran where its allocation was made");
    assert_eq!(completed(&mut completions, 1), [1]);
    let model = s.model.lock().unwrap();
    assert!(
        model.estimate("fill", "far", 1 << 10).ns().is_some(),
        "the far device was measured"
    );
}

/// A pipelined stream whose first launch went to measure a device does not follow it there
/// before the measurement: its later launches wait for it and are placed by it. Before, the whole
/// stream ran on the explored device (40 `sgemm`s of 512 on a fresh daemon: all on PoCL, 3.1 s,
/// instead of 0.5 s on the CPU).
#[test]
fn a_stream_waits_for_the_measurement_its_first_launch_went_to_take() {
    let mut s = perf_scheduler(vec![sim("sim0", None), cpu()]);
    let mut session = session();
    let view = *session.shared.segment.view();
    let mut completions = agora_protocol::ring::CompletionConsumer::new(view);
    let q = queue(QueueClass::Batch, None);
    let (first, _) = fill(&mut session, &q, 1 << 12, 1e6);
    let again = first.clone();
    let roles = super::data_roles(&first);
    s.place_and_submit(&session, 1, first, roles).unwrap();
    assert_eq!(q.binding.load().device(), 0, "sim0 explored");
    assert!(q.exploring.load(Ordering::Relaxed));
    // The next launches (over the same buffer) find the queue busy there (kept busy, should
    // the sim finish first at once): held, in order.
    q.in_flight.fetch_add(1, Ordering::AcqRel);
    for task in [2, 3] {
        let next = again.clone();
        assert_eq!(s.must_hold(session.id, &next), Ok(true), "task {task}");
        s.hold(&session, task, next);
    }
    assert_eq!(
        s.migration.stats.migrations, 0,
        "waiting for a measurement is no migration"
    );
    assert_eq!(completed(&mut completions, 1), [1]);
    q.in_flight.fetch_sub(1, Ordering::AcqRel);
    while q.in_flight.load(Ordering::Acquire) > 0 {
        std::thread::yield_now();
    }
    s.release_held(&session);
    assert!(!s.migration.holding());
    assert!(
        !q.exploring.load(Ordering::Relaxed),
        "placed by the measurement: nothing is explored any more"
    );
    let mut done = completed(&mut completions, 2);
    done.sort();
    assert_eq!(done, [2, 3]);
}

/// Lanes serve their tenants fairly, so a queue placed afresh waits on a busy lane for about one
/// job of each neighbour, not for their whole backlog. Costed by the backlog, four identical
/// pipelining ranks split 190 / 100 / 7.7 / 7.5 launches per second: two were sent to a device
/// measured seven times slower, because it was idle, and their bursts followed them there.
#[test]
fn a_queue_placed_afresh_waits_for_its_neighbours_share_of_a_busy_lane_not_their_backlog() {
    let mut s = perf_scheduler(vec![cpu(), sim("sim0", None)]);
    let items = 1 << 20;
    let label = agora_kernels::find("noop").unwrap().1.label();
    {
        let mut model = s.model.lock().unwrap();
        let cpu_name = s.devices[0].info().name.clone();
        model.record(label, &cpu_name, items, 5e6);
        model.record(label, "sim0", items, 40e6);
    }
    // Session 7 pipelined 30 jobs of 5 ms onto each CPU lane; sim0 is idle.
    for lane in 0..2 {
        for _ in 0..30 {
            s.lane_pending[0][lane].fetch_add(5_000_000, Ordering::Relaxed);
            s.lane_tenants[0][lane].started(7, 5_000_000);
        }
    }
    // Another session's queue: about 5 ms behind session 7's next job, then 5 ms, on a CPU
    // lane, against 40 ms on the idle sim device.
    s.dispatch_session = 9;
    let q = queue(QueueClass::Batch, None);
    assert_eq!(s.place(&noop(&q, items)).unwrap().binding.device(), 0, "the CPU");
    // Session 7 itself waits for all of its own work there: the idle device is sooner.
    s.dispatch_session = 7;
    let q = queue(QueueClass::Batch, None);
    assert_eq!(s.place(&noop(&q, items)).unwrap().binding.device(), 1, "sim0");
}

/// A checkpoint descriptor is untrusted input: id 0 (which status calls report for "no
/// checkpoint") is refused with its own reason, before anything else about it is judged, and
/// so is one without an id argument (which reads as 0).
#[test]
fn a_checkpoint_with_id_zero_is_refused_by_the_daemon_as_well() {
    use agora_protocol::completion::{CHECKPOINT_ID_ZERO, CHECKPOINT_NOTHING_PROTECTED};
    use agora_protocol::{Op, RawArg, TaskDescriptor};
    let harness = super::fuzzing::ValidateHarness::new();
    let checkpoint = |args: &[RawArg]| {
        let mut d = TaskDescriptor::zeroed();
        d.task_id = 1;
        d.op = Op::Checkpoint as u32;
        d.queue = harness.queue;
        d.arg_count = args.len() as u32;
        d.args[..args.len()].copy_from_slice(args);
        harness.validate(&d).map(|_| ())
    };
    for args in [&[RawArg::u64(0), RawArg::u32(1)][..], &[]] {
        let error = checkpoint(args).unwrap_err();
        assert!(
            matches!(
                error,
                TaskError::CheckpointRefused {
                    reason: CHECKPOINT_ID_ZERO,
                    checkpoint: 0,
                    ..
                }
            ),
            "{error:?}"
        );
        assert!(error.to_string().contains("ids start at 1"), "{error}");
    }
    // Id 1 passes that check (and meets the next: the harness's session protected nothing).
    let error = checkpoint(&[RawArg::u64(1), RawArg::u32(1)]).unwrap_err();
    assert!(
        matches!(
            error,
            TaskError::CheckpointRefused {
                reason: CHECKPOINT_NOTHING_PROTECTED,
                ..
            }
        ),
        "{error:?}"
    );
}

/// SRE audit, defect 5: one failed save (a full disk) marked the model saved, and it was never
/// written, not even at shutdown, once the disk had room again.
#[test]
fn a_model_that_failed_to_save_is_saved_at_the_next_try() {
    let dir = tempfile::tempdir().unwrap();
    let model = Mutex::new(PerformanceModel::new(0.8));
    model.lock().unwrap().record("saxpy", "cpu0", 1024, 5_000.0);
    // A file where the state directory goes: the save fails.
    let state = dir.path().join("state");
    std::fs::write(&state, "not a directory").unwrap();
    super::save_model(&model, &state);
    assert!(model.lock().unwrap().is_dirty(), "still unsaved after the failure");
    std::fs::remove_file(&state).unwrap();
    super::save_model(&model, &state);
    assert!(!model.lock().unwrap().is_dirty());
    assert!(PerformanceModel::path(&state).exists(), "written at the next try");
}
