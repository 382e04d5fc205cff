//! Each task's outcome is its own: a failed task's `wait` reports its error every time, in any
//! order; `finish` reports every failure since the previous `finish`; a buffer whose last writer
//! failed is poisoned, so tasks that read it fail with `DependencyFailed` naming the task the
//! failure began with, until a task rewrites it whole.
//!
//! The property test drives random task sequences over shared buffers through a real daemon
//! whose test-only fault injection fails chosen tasks, and checks every reported outcome and
//! every value read back against a model that runs the same sequence on the host.

use agora::{Arg, DeviceKind, Error, QueueOptions, Session, Task, TaskError};
use agora_protocol::testing::injected_fault;

mod common;

fn queue(session: &Session, kind: DeviceKind) -> agora::Queue {
    session
        .queue_with(QueueOptions {
            name: kind.name().to_string(),
            preferred_device: Some(kind),
            ..Default::default()
        })
        .unwrap()
}

fn dependency(error: &Result<(), Error>) -> Option<(u16, u64, u16)> {
    match error {
        Err(Error::Task(TaskError::DependencyFailed { index, task, cause })) => Some((*index, *task, *cause)),
        _ => None,
    }
}

#[test]
fn a_failed_task_and_what_it_should_have_written_report_the_failure_every_time() {
    let (_daemon, session) = common::daemon_with("outcome-quota", |c| c.device_quota = 16 << 20);
    common::require_opencl(&session);
    let opencl = queue(&session, DeviceKind::OpenCl);
    let saxpy = session.kernel("saxpy").unwrap();
    let small = 1 << 10;
    let big = 8 << 20; // 32 MiB of f32: two of them never fit a 16 MiB quota
    let x = session.buffer_from(&vec![1.0f32; small]).unwrap();
    let y = session.buffer_from(&vec![2.0f32; small]).unwrap();
    let big_x = session.buffer_from(&vec![1.0f32; big]).unwrap();
    let big_y = session.buffer_from(&vec![1.0f32; big]).unwrap();
    let z = session.buffer_from(&vec![0.0f32; small]).unwrap();

    let ok = opencl
        .launch(&saxpy, &[Arg::F32(3.0), (&x).into(), (&y).into()], small)
        .unwrap();
    let too_big = opencl
        .launch(&saxpy, &[Arg::F32(1.0), (&big_x).into(), (&big_y).into()], big)
        .unwrap();
    // Reads what `too_big` should have written: must not run.
    let reader = opencl
        .launch(&saxpy, &[Arg::F32(1.0), (&big_y).into(), (&z).into()], small)
        .unwrap();
    let read_back = opencl.sync_from(&z).unwrap();
    let unrelated = opencl.sync_from(&y).unwrap();

    let failures = match opencl.finish() {
        Err(Error::Tasks(failures)) => failures,
        other => panic!("finish must report the failures: {other:?}"),
    };
    assert_eq!(failures.count, 3, "{failures}");
    let ids: Vec<u64> = failures.failures.iter().map(|(id, _)| *id).collect();
    assert_eq!(ids, vec![too_big.id(), reader.id(), read_back.id()]);
    assert!(matches!(failures.failures[0].1, TaskError::DeviceQuota { .. }));
    assert!(
        failures.to_string().contains("3 tasks of this queue failed"),
        "{failures}"
    );
    // Reported once per finish: the next finish has nothing new.
    opencl.finish().unwrap();

    // Every task, asked twice, in reverse order: the same outcome each time.
    let quota_code = failures.failures[0].1.code();
    for _ in 0..2 {
        assert!(unrelated.wait().is_ok());
        assert_eq!(dependency(&read_back.wait()), Some((0, too_big.id(), quota_code)));
        assert_eq!(dependency(&reader.wait()), Some((1, too_big.id(), quota_code)));
        assert!(matches!(
            too_big.wait(),
            Err(Error::Task(TaskError::DeviceQuota { .. }))
        ));
        assert!(ok.wait().is_ok());
    }
    assert_eq!(y.as_slice::<f32>()[0], 5.0);
    assert_eq!(z.as_slice::<f32>()[0], 0.0, "the reader must not have run");
    let message = reader.wait().unwrap_err().to_string();
    assert!(
        message.contains(&format!("task {}", too_big.id())) && message.contains("device_quota"),
        "{message}"
    );

    // A whole rewrite from the host clears the poison (on the CPU: the launch below, over the
    // buffer, never fits the OpenCL quota).
    let cpu = queue(&session, DeviceKind::Cpu);
    assert!(dependency(&cpu.sync_from(&big_y).unwrap().wait()).is_some());
    cpu.sync_to(&big_y).unwrap();
    // `z` is poisoned too (the failed reader read-wrote it), with the same origin.
    assert_eq!(
        dependency(&cpu.sync_from(&z).unwrap().wait()),
        Some((0, too_big.id(), quota_code))
    );
    cpu.sync_to(&z).unwrap();
    cpu.launch(&saxpy, &[Arg::F32(2.0), (&big_y).into(), (&z).into()], small)
        .unwrap()
        .wait()
        .unwrap();
    cpu.sync_from(&z).unwrap().wait().unwrap();
    assert_eq!(z.as_slice::<f32>()[0], 2.0);
    match cpu.finish() {
        Err(Error::Tasks(f)) => assert_eq!(f.count, 2, "{f}"),
        other => panic!("the two refused downloads: {other:?}"),
    }
}

/// A `sync_to` only pushes a buffer ahead to where its queue's tasks run: one that can never be
/// there (larger than the session's device quota) succeeds and leaves the host copy current; the
/// launch that needs it on that device is the task that fails, naming the quota.
#[test]
fn a_sync_to_of_a_buffer_that_never_fits_the_device_keeps_it_on_the_host() {
    let (_daemon, session) = common::daemon_with("outcome-sync-to-over-quota", |c| c.device_quota = 16 << 20);
    common::require_opencl(&session);
    let opencl = queue(&session, DeviceKind::OpenCl);
    let big = 8 << 20; // 32 MiB of f32, twice the quota
    let x = session.buffer_from(&vec![1.0f32; big]).unwrap();
    let y = session.buffer_from(&vec![0.0f32; big]).unwrap();
    y.write_slice(&vec![7.0f32; big]).unwrap();
    opencl.sync_to(&y).unwrap().wait().unwrap();
    opencl.sync_from(&y).unwrap().wait().unwrap();
    assert!(y.as_slice::<f32>().iter().all(|v| *v == 7.0));
    let saxpy = session.kernel("saxpy").unwrap();
    let launch = opencl
        .launch(&saxpy, &[Arg::F32(1.0), (&x).into(), (&y).into()], big)
        .unwrap();
    match launch.wait() {
        Err(Error::Task(TaskError::DeviceQuota { needed, quota, .. })) => {
            assert_eq!((needed, quota), (64 << 20, 16 << 20))
        }
        other => panic!("the launch over 64 MiB must fail on the 16 MiB quota: {other:?}"),
    }
    // The host copy still holds what the sync_to made current.
    let cpu = queue(&session, DeviceKind::Cpu);
    assert!(
        dependency(&cpu.sync_from(&y).unwrap().wait()).is_some(),
        "the failed launch poisons y"
    );
    assert!(y.as_slice::<f32>().iter().all(|v| *v == 7.0));
}

/// Host-side work (memset, copy, sync_from) issued on a queue that is busy on OpenCL stays on
/// the queue's lane for order but never needs device memory: over buffers larger than the
/// session's device quota it runs, where it used to fail with `DeviceQuota`.
#[test]
fn host_side_work_on_a_busy_device_queue_needs_no_device_memory() {
    let (_daemon, session) = common::daemon_with("outcome-host-work-over-quota", |c| c.device_quota = 16 << 20);
    common::require_opencl(&session);
    let opencl = queue(&session, DeviceKind::OpenCl);
    let saxpy = session.kernel("saxpy").unwrap();
    let small = 1 << 20;
    let x = session.buffer_from(&vec![1.0f32; small]).unwrap();
    let y = session.buffer_from(&vec![0.0f32; small]).unwrap();
    let big = 8 << 20; // 32 MiB of f32, twice the quota
    let a = session.buffer_from(&vec![1.0f32; big]).unwrap();
    let b = session.buffer_from(&vec![2.0f32; big]).unwrap();
    let busy = |opencl: &agora::Queue| {
        for _ in 0..4 {
            opencl
                .launch(&saxpy, &[Arg::F32(1.0), (&x).into(), (&y).into()], small)
                .unwrap();
        }
    };
    busy(&opencl);
    let memset = opencl.memset(&a, 0).unwrap();
    busy(&opencl);
    let copy = opencl.copy(&a, 0, &b, 0, (big * 4) as u64).unwrap();
    busy(&opencl);
    let sync_from = opencl.sync_from(&b).unwrap();
    for (name, task) in [("memset", memset), ("copy", copy), ("sync_from", sync_from)] {
        task.wait()
            .unwrap_or_else(|e| panic!("{name} over a buffer beyond the device quota failed: {e}"));
    }
    opencl.finish().unwrap();
    assert!(
        b.as_slice::<f32>().iter().all(|v| *v == 0.0),
        "the copy of the memset buffer"
    );
}

/// Buffers of the property test: f32 elements each.
const ELEMENTS: usize = 256;
const BUFFERS: usize = 6;
/// Tasks picked to fail by the daemon's injection, per mille.
const FAULTS_PER_MILLE: u64 = 40;
const SEED: u64 = 0x5eed_a60a;

/// SplitMix64: a deterministic, seedable generator (the test's sequences are reproducible from
/// the seed it prints; no crate needed for this much).
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }
    fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }
}

/// What the model knows of a buffer: its contents, or the failure that poisoned them.
#[derive(Clone)]
struct ModelBuffer {
    values: Vec<f32>,
    poison: Option<(u64, u16)>,
}

#[derive(Clone, Copy, Debug)]
enum Step {
    /// Host writes then `sync_to`.
    Upload {
        buffer: usize,
        base: i32,
    },
    MemsetWhole {
        buffer: usize,
    },
    /// Copies elements `[first, first + count)` of `src` over the same elements of `dst`.
    CopyPart {
        src: usize,
        dst: usize,
        first: usize,
        count: usize,
    },
    Copy {
        src: usize,
        dst: usize,
    },
    Saxpy {
        a: f32,
        x: usize,
        y: usize,
    },
    Download {
        buffer: usize,
    },
}

/// The model's outcome of `step` as task `task`, applied to `buffers`.
fn model(step: Step, task: u64, buffers: &mut [ModelBuffer], injected: bool) -> Result<(), TaskError> {
    // (slot, buffer) read, in argument order; (buffer, whole) written.
    type Reads = Vec<(u16, usize)>;
    type Writes = Vec<(usize, bool)>;
    let (reads, writes): (Reads, Writes) = match step {
        Step::Upload { buffer, .. } | Step::MemsetWhole { buffer } => (vec![], vec![(buffer, true)]),
        Step::CopyPart { src, dst, first, count } => (vec![(0, src)], vec![(dst, first == 0 && count == ELEMENTS)]),
        Step::Copy { src, dst } => (vec![(0, src)], vec![(dst, true)]),
        Step::Saxpy { x, y, .. } => (vec![(1, x), (2, y)], vec![(y, false)]),
        Step::Download { buffer } => (vec![(0, buffer)], vec![]),
    };
    let failure = reads
        .iter()
        .find_map(|&(slot, b)| buffers[b].poison.map(|root| (slot, root)))
        .map(|(index, (task, cause))| TaskError::DependencyFailed { index, task, cause })
        .or(injected.then_some(TaskError::KernelFault));
    if let Some(error) = failure {
        let root = error.origin(task);
        for (b, whole) in writes {
            if whole || buffers[b].poison.is_none() {
                buffers[b].poison = Some(root);
            }
        }
        return Err(error);
    }
    match step {
        Step::Upload { buffer, base } => {
            buffers[buffer].values = (0..ELEMENTS).map(|i| (base + (i % 7) as i32) as f32).collect();
        }
        Step::MemsetWhole { buffer } => buffers[buffer].values = vec![0.0; ELEMENTS],
        Step::CopyPart { src, dst, first, count } => {
            let part = buffers[src].values[first..first + count].to_vec();
            buffers[dst].values[first..first + count].copy_from_slice(&part);
        }
        Step::Copy { src, dst } => buffers[dst].values = buffers[src].values.clone(),
        Step::Saxpy { a, x, y } => {
            let xs = buffers[x].values.clone();
            for (v, x) in buffers[y].values.iter_mut().zip(xs) {
                *v += a * x;
            }
        }
        Step::Download { .. } => {}
    }
    for (b, whole) in writes {
        if whole {
            buffers[b].poison = None;
        }
    }
    Ok(())
}

fn random_step(rng: &mut Rng) -> Step {
    let buffer = rng.below(BUFFERS);
    let other = (buffer + 1 + rng.below(BUFFERS - 1)) % BUFFERS;
    match rng.below(10) {
        0 => Step::MemsetWhole { buffer },
        1 => {
            let first = rng.below(ELEMENTS);
            Step::CopyPart {
                src: buffer,
                dst: other,
                first,
                count: 1 + rng.below(ELEMENTS - first),
            }
        }
        2 | 3 => Step::Copy {
            src: buffer,
            dst: other,
        },
        4..=7 => Step::Saxpy {
            a: [1.0, -1.0, 2.0, 0.5][rng.below(4)],
            x: buffer,
            y: other,
        },
        _ => Step::Download { buffer },
    }
}

/// Runs `tasks` random tasks on one queue of `kind`; checks every outcome and value.
fn run_sequence(session: &Session, kind: DeviceKind, seed: u64, tasks: usize) -> (u64, u64) {
    let q = queue(session, kind);
    let saxpy = session.kernel("saxpy").unwrap();
    let mut rng = Rng(seed);
    let mut buffers: Vec<agora::Buffer> = (0..BUFFERS)
        .map(|_| session.buffer_from(&vec![0.0f32; ELEMENTS]).unwrap())
        .collect();
    let mut models = vec![
        ModelBuffer {
            values: vec![0.0; ELEMENTS],
            poison: None,
        };
        BUFFERS
    ];
    let (mut issued, mut failed, mut verified) = (0u64, 0u64, 0u64);
    let mut batch_number = 0u64;
    // Every task's step and modelled outcome, printed when a check fails.
    let mut history: Vec<(u64, Step, Result<(), TaskError>)> = Vec::new();
    while (issued as usize) < tasks {
        batch_number += 1;
        let mut batch: Vec<(Task, Result<(), TaskError>, Step)> = Vec::new();
        let mut steps: Vec<Step> = Vec::new();
        // Poisoned buffers are written again (as a program that handles its errors would), so
        // failures stay local to their batch; a few more are, at random.
        for (buffer, model) in models.iter().enumerate() {
            if model.poison.is_some() || rng.below(4) == 0 {
                steps.push(Step::Upload {
                    buffer,
                    base: rng.below(17) as i32 - 8,
                });
            }
        }
        steps.extend((0..8 + rng.below(48)).map(|_| random_step(&mut rng)));
        steps.extend((0..BUFFERS).map(|buffer| Step::Download { buffer }));
        for step in steps {
            let task = match step {
                Step::Upload { buffer, base } => {
                    for (i, v) in buffers[buffer].as_mut_slice::<f32>().iter_mut().enumerate() {
                        *v = (base + (i % 7) as i32) as f32;
                    }
                    q.sync_to(&buffers[buffer])
                }
                Step::MemsetWhole { buffer } => q.memset(&buffers[buffer], 0),
                Step::CopyPart { src, dst, first, count } => {
                    let (offset, len) = ((first * 4) as u64, (count * 4) as u64);
                    q.copy(&buffers[src], offset, &buffers[dst], offset, len)
                }
                Step::Copy { src, dst } => q.copy(&buffers[src], 0, &buffers[dst], 0, 0),
                Step::Saxpy { a, x, y } => q.launch(
                    &saxpy,
                    &[Arg::F32(a), (&buffers[x]).into(), (&buffers[y]).into()],
                    ELEMENTS,
                ),
                Step::Download { buffer } => q.sync_from(&buffers[buffer]),
            }
            .unwrap();
            let expected = model(
                step,
                task.id(),
                &mut models,
                injected_fault(SEED, FAULTS_PER_MILLE, task.id()),
            );
            history.push((task.id(), step, expected));
            if history.len() > 4096 {
                history.drain(..2048);
            }
            batch.push((task, expected, step));
        }
        issued += batch.len() as u64;
        // Every task, twice, in a shuffled order: each reports exactly its modelled outcome.
        let mut order: Vec<usize> = (0..batch.len()).collect();
        for round in 0..2 {
            for i in (1..order.len()).rev() {
                order.swap(i, rng.below(i + 1));
            }
            for &i in &order {
                let (task, expected, step) = &batch[i];
                let got = task.wait().map_err(|e| match e {
                    Error::Task(e) => e,
                    other => panic!("task {}: not a task error: {other}", task.id()),
                });
                if &got != expected {
                    for (id, step, outcome) in &history {
                        eprintln!("{id:>8} {step:?} -> {outcome:?}");
                    }
                    for (t, e, _) in &batch {
                        eprintln!("batch task {} modelled {e:?} reported {:?}", t.id(), t.wait());
                    }
                }
                assert_eq!(
                    &got,
                    expected,
                    "seed {seed:#x} batch {batch_number} round {round}: task {} ({step:?})",
                    task.id()
                );
            }
        }
        // `finish` lists exactly the batch's failures.
        let expected_failures: Vec<u64> = batch
            .iter()
            .filter(|(_, e, _)| e.is_err())
            .map(|(t, _, _)| t.id())
            .collect();
        failed += expected_failures.len() as u64;
        match q.finish() {
            Ok(()) => assert!(expected_failures.is_empty(), "finish missed {expected_failures:?}"),
            Err(Error::Tasks(f)) => {
                assert_eq!(f.count, expected_failures.len() as u64);
                assert_eq!(
                    f.failures.iter().map(|(id, _)| *id).collect::<Vec<_>>(),
                    expected_failures
                );
            }
            Err(other) => panic!("finish: {other}"),
        }
        // What the successful downloads at the end of the batch brought home is the model's.
        for (task, expected, step) in batch.iter().rev().take(BUFFERS) {
            let Step::Download { buffer } = *step else {
                unreachable!()
            };
            if expected.is_err() {
                continue;
            }
            let model = &models[buffer];
            assert!(model.poison.is_none(), "a download of poisoned data succeeded");
            verified += 1;
            for (i, (got, want)) in buffers[buffer].as_slice::<f32>().iter().zip(&model.values).enumerate() {
                assert!(
                    (got - want).abs() <= 1e-5 * want.abs().max(1.0),
                    "seed {seed:#x} batch {batch_number}: buffer {buffer} element {i} is {got}, the model says {want} (after task {})",
                    task.id()
                );
            }
        }
    }
    // Most batches end with values to compare.
    assert!(
        verified > batch_number,
        "{verified} downloads verified in {batch_number} batches"
    );
    (issued, failed)
}

#[test]
fn every_reported_outcome_equals_the_real_one_under_injected_faults() {
    let (daemon, session) = common::daemon_with("outcome-property", |c| {
        c.inject_faults = Some((SEED, FAULTS_PER_MILLE));
    });
    common::require_opencl(&session);
    // The CPU queue runs tiny tasks inline and the rest on lanes; the OpenCL queue goes through
    // lanes and transfers, so readers are often dispatched before an earlier writer's failure is
    // known. Two sessions at once, as two tenants.
    let other = Session::connect_with(agora::SessionOptions {
        socket: Some(daemon.socket().to_path_buf()),
        ..Default::default()
    })
    .unwrap();
    let opencl = std::thread::spawn(move || run_sequence(&other, DeviceKind::OpenCl, 0x0c1, 20_000));
    let (cpu_tasks, cpu_failed) = run_sequence(&session, DeviceKind::Cpu, 0xc0, 85_000);
    let (cl_tasks, cl_failed) = opencl.join().unwrap();
    let (tasks, failed) = (cpu_tasks + cl_tasks, cpu_failed + cl_failed);
    eprintln!("{tasks} tasks checked, {failed} failed (injected or dependent)");
    assert!(tasks >= 100_000);
    // The injection and its consequences made a real share of the tasks fail.
    assert!(failed > tasks / 50 && failed < tasks / 2, "{failed} of {tasks}");
}

/// Memory pressure waits (#22 item 2): a queue that pipelines more buffers than its device quota
/// holds, each task within the quota, runs every task — later ones wait for earlier ones to
/// free memory — and only a task that can never fit fails, saying why.
#[test]
fn tasks_within_the_quota_wait_for_room_instead_of_failing() {
    let (_daemon, session) = common::daemon_with("outcome-pressure", |c| c.device_quota = 16 << 20);
    common::require_opencl(&session);
    let q = queue(&session, DeviceKind::OpenCl);
    let fill = session.kernel("fill").unwrap();
    let n = 1 << 20; // 4 MiB of f32 each: four fit the quota at once, eight do not
    let buffers: Vec<_> = (0..8).map(|_| session.buffer(n as u64 * 4).unwrap()).collect();
    let tasks: Vec<Task> = buffers
        .iter()
        .enumerate()
        .map(|(i, b)| q.launch(&fill, &[Arg::F32(i as f32 + 1.0), b.into()], n).unwrap())
        .collect();
    for b in &buffers {
        q.sync_from(b).unwrap();
    }
    q.finish().expect("every task fits the quota: none may fail");
    for (i, (t, b)) in tasks.iter().zip(&buffers).enumerate() {
        t.wait().unwrap();
        assert!(b.as_slice::<f32>().iter().all(|v| *v == i as f32 + 1.0), "buffer {i}");
    }
    // Its buffers together exceed the quota: it can never run on the device.
    let big_x = session.buffer(12 << 20).unwrap();
    let big_y = session.buffer(12 << 20).unwrap();
    let saxpy = session.kernel("saxpy").unwrap();
    let e = q
        .launch(&saxpy, &[Arg::F32(1.0), (&big_x).into(), (&big_y).into()], 3usize << 20)
        .unwrap()
        .wait()
        .unwrap_err();
    assert!(
        matches!(
            e.task_error(),
            Some(TaskError::DeviceQuota {
                needed,
                quota,
                device_mib,
            }) if *needed == 24 << 20 && *quota == 16 << 20 && *device_mib > 0
        ),
        "{e}"
    );
    // The message names the working set, the quota and the device's size.
    let message = e.to_string();
    assert!(
        message.contains("25165824 bytes") && message.contains("16777216 bytes") && message.contains("the device has"),
        "{message}"
    );
}

/// A queue that prefers no device kind leaves the choice to the daemon, which places a launch
/// whose buffers can never be on a device at once (here over the session's device quota) on
/// another, however its queue was bound: every task runs and every result is exact. Before, the
/// policy could pick the OpenCL device for it (as it explores where a kernel runs fastest) —
/// then the launch failed with the quota's error, its result was poisoned, and each later task
/// over it failed.
#[test]
fn a_queue_with_no_preference_runs_what_can_never_fit_a_device_elsewhere() {
    let (_daemon, session) = common::daemon_with("outcome-no-preference-over-quota", |c| c.device_quota = 16 << 20);
    common::require_opencl(&session);
    let q = session.queue("anywhere").unwrap();
    let saxpy = session.kernel("saxpy").unwrap();
    let (small, big) = (1usize << 10, 3usize << 20); // 4 KiB and 12 MiB of f32
    let x = session.buffer_from(&vec![1.0f32; small]).unwrap();
    let y = session.buffer_from(&vec![0.0f32; small]).unwrap();
    let big_x = session.buffer_from(&vec![1.0f32; big]).unwrap();
    let big_y = session.buffer_from(&vec![0.0f32; big]).unwrap();
    let rounds = 20;
    // One at a time: each finds the queue idle, free to go anywhere.
    for _ in 0..rounds {
        q.launch(&saxpy, &[Arg::F32(2.0), (&big_x).into(), (&big_y).into()], big)
            .unwrap()
            .wait()
            .unwrap();
    }
    // Pipelined: each big launch may find the queue busy on the device its small one went to.
    for _ in 0..rounds {
        q.launch(&saxpy, &[Arg::F32(1.0), (&x).into(), (&y).into()], small)
            .unwrap();
        q.launch(&saxpy, &[Arg::F32(2.0), (&big_x).into(), (&big_y).into()], big)
            .unwrap();
    }
    q.sync_from(&y).unwrap();
    q.sync_from(&big_y).unwrap();
    q.finish().expect("no task needed a device it could never fit");
    assert!(y.as_slice::<f32>().iter().all(|v| *v == rounds as f32));
    assert!(big_y.as_slice::<f32>().iter().all(|v| *v == 4.0 * rounds as f32));
}

/// A task whose buffers together exceed the device it must run on can never run there: it
/// fails at once with both sizes (it does not wait for room that will never come), and the
/// queue goes on.
#[test]
fn a_task_larger_than_its_device_fails_saying_both_sizes() {
    let (_daemon, session) = common::daemon_with("outcome-too-small", |c| c.opencl_memory_limit = 4 << 20);
    common::require_opencl(&session);
    let q = queue(&session, DeviceKind::OpenCl);
    let fill = session.kernel("fill").unwrap();
    let n = 2usize << 20; // 8 MiB of f32 on a device limited to 4 MiB
    let big = session.buffer(n as u64 * 4).unwrap();
    let e = q
        .launch(&fill, &[Arg::F32(1.0), (&big).into()], n)
        .unwrap()
        .wait()
        .unwrap_err();
    assert!(
        matches!(
            e.task_error(),
            Some(TaskError::DeviceTooSmall { needed, capacity }) if *needed == 8 << 20 && *capacity == 4 << 20
        ),
        "{e}"
    );
    assert!(
        e.to_string().contains("8388608") && e.to_string().contains("4194304"),
        "{e}"
    );
    // The queue goes on with work that fits.
    let small = session.buffer(4096).unwrap();
    q.launch(&fill, &[Arg::F32(2.0), (&small).into()], 1024usize)
        .unwrap()
        .wait()
        .unwrap();
    q.sync_from(&small).unwrap().wait().unwrap();
    assert!(small.as_slice::<f32>().iter().all(|v| *v == 2.0));
}

/// A task the daemon refuses when it checks it (here a buffer too small for the launch) poisons
/// what it would have written, like a task that failed later: the next task reading it and the
/// `sync_from` fail `DependencyFailed` naming the refused task, which itself reports its own
/// error; a whole rewrite clears it. Before, the refused step simply did not happen and the
/// pipeline went on with `y` as it was. Behind earlier work of its queue, it settles in order.
#[test]
fn a_task_refused_at_its_check_poisons_what_it_would_have_written() {
    let (_daemon, session) = common::daemon_with("outcome-refused", |_| {});
    let q = session.queue("refused").unwrap();
    let saxpy = session.kernel("saxpy").unwrap();
    let n = 1usize << 10;
    let x = session.buffer_from(&vec![1.0f32; n]).unwrap();
    let y = session.buffer_from(&vec![2.0f32; n / 2]).unwrap();
    let z = session.buffer_from(&vec![0.0f32; n / 2]).unwrap();
    q.sync_to(&y).unwrap();
    // Behind a long launch of the same queue, so the refusal must wait for its turn.
    let (long, _) = agora_test_support::long_sgemm(&session, &q, 256);
    let refused = q.launch(&saxpy, &[Arg::F32(3.0), (&x).into(), (&y).into()], n).unwrap();
    let reader = q
        .launch(&saxpy, &[Arg::F32(1.0), (&y).into(), (&z).into()], n / 2)
        .unwrap();
    let read_back = q.sync_from(&y).unwrap();
    long.wait().unwrap();
    let own = refused.wait().unwrap_err();
    assert!(
        matches!(own.task_error(), Some(TaskError::BufferTooSmall { .. })),
        "the refused task reports its own error: {own}"
    );
    for task in [&reader, &read_back] {
        match task.wait() {
            Err(Error::Task(TaskError::DependencyFailed { task: origin, .. })) => assert_eq!(origin, refused.id()),
            other => panic!("reads what the refused task should have written: {other:?}"),
        }
    }
    assert_eq!(z.as_slice::<f32>()[0], 0.0, "the reader did not run");
    assert!(q.finish().is_err());
    // A whole rewrite from the host clears it (and `z`, which the failed reader poisoned).
    q.sync_to(&y).unwrap();
    q.sync_to(&z).unwrap();
    q.launch(&saxpy, &[Arg::F32(1.0), (&y).into(), (&z).into()], n / 2)
        .unwrap();
    q.sync_from(&z).unwrap().wait().unwrap();
    assert!(z.as_slice::<f32>().iter().all(|v| *v == 2.0));
}

/// ML-serving audit, defect 2: an sgemm with beta = 0 replaces all of C (no implementation reads
/// it), yet C, read-write in the signature, stayed poisoned by one bad request before it, and
/// every later request on that output buffer failed with `DependencyFailed`. With beta = 0 the
/// launch is write-only for C; with beta ≠ 0 it still reads (and is refused).
#[test]
fn an_sgemm_with_beta_zero_rewrites_c_whole_and_clears_its_poison() {
    let (_daemon, session) = common::daemon_with("outcome-sgemm-beta", |_| {});
    let q = session.queue("serving").unwrap();
    let sgemm = session.kernel("sgemm").unwrap();
    let n = 64usize;
    let x = session.buffer_from(&vec![1.0f32; n * n]).unwrap();
    let w = session.buffer_from(&vec![0.5f32; n * n]).unwrap();
    let y = session.buffer_from(&vec![0.0f32; n * n]).unwrap();
    q.sync_to(&x).unwrap();
    q.sync_to(&w).unwrap();
    let dims = [
        Arg::I32(n as i32),
        Arg::I32(n as i32),
        Arg::I32(n as i32),
        Arg::F32(1.0),
    ];
    let gemm = |beta: f32, rows: u64| {
        let mut args = dims.to_vec();
        args.extend([(&x).into(), (&w).into(), Arg::F32(beta), (&y).into()]);
        q.launch(&sgemm, &args, (rows, n as u64)).unwrap()
    };
    // One bad request (a range the kernel refuses) poisons y.
    let bad = gemm(0.0, n as u64 + 1);
    assert!(matches!(
        bad.wait().unwrap_err().task_error(),
        Some(TaskError::RangeMismatch { .. })
    ));
    // beta ≠ 0 reads y: refused, naming the bad request.
    match gemm(1.0, n as u64).wait() {
        Err(Error::Task(TaskError::DependencyFailed { task, .. })) => assert_eq!(task, bad.id()),
        other => panic!("an sgemm reading a poisoned C must not run: {other:?}"),
    }
    // beta = 0 replaces y whole: it runs, and y is good again.
    gemm(0.0, n as u64).wait().unwrap();
    q.sync_from(&y).unwrap().wait().unwrap();
    assert!(
        y.as_slice::<f32>().iter().all(|v| *v == 32.0),
        "C = 1·(1 × 0.5 summed over 64)"
    );
    let _ = q.finish();
    gemm(1.0, n as u64).wait().unwrap();
    q.sync_from(&y).unwrap().wait().unwrap();
    assert!(y.as_slice::<f32>().iter().all(|v| *v == 64.0), "C = A·B + C");
}
