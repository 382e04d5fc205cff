//! Issue 22, item 2, across tenants, against a real `agora serve` process: a tenant that asks
//! for more OpenCL memory than the device has (pipelined fills of 8 MiB buffers into a 48 MiB
//! device) must not make a neighbour within its fair share fail or stall. Before: the
//! neighbour's 64 KiB task failed with `DeviceOutOfMemory` within 3 s. Also: a task that waits
//! for room counts once in the status, however long it waits.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use agora::{Arg, DeviceKind};
use agora_test_support::{queue_preferring, Daemon};

const AGORA: &str = env!("CARGO_BIN_EXE_agora");

#[test]
fn a_tenant_over_its_share_of_device_memory_never_fails_a_neighbour() {
    let daemon = Daemon::start(AGORA, "pressure", &["--opencl-memory-limit", "48M"]);
    let hog = daemon.session_named("hog");
    agora_test_support::require_opencl(&hog);
    let neighbour = daemon.session_named("neighbour");
    let stop = Arc::new(AtomicBool::new(false));

    // The neighbour: small verified tasks on OpenCL, all the time.
    let neighbour_errors = Arc::new(Mutex::new(Vec::<String>::new()));
    let neighbour_rounds = Arc::new(AtomicU64::new(0));
    let longest = Arc::new(Mutex::new(Duration::ZERO));
    // Kept open here, so its counters are still in the status after the worker ends.
    let _neighbour_open = neighbour.clone();
    let worker = {
        let (stop, errors, rounds, longest) = (
            stop.clone(),
            neighbour_errors.clone(),
            neighbour_rounds.clone(),
            longest.clone(),
        );
        std::thread::spawn(move || {
            let q = queue_preferring(&neighbour, "small", DeviceKind::OpenCl);
            let saxpy = neighbour.kernel("saxpy").unwrap();
            let n = 8 << 10; // 2 x 32 KiB
            let x = neighbour.buffer_from(&vec![1.0f32; n]).unwrap();
            let y = neighbour.buffer_from(&vec![0.0f32; n]).unwrap();
            while !stop.load(Ordering::Relaxed) {
                let started = Instant::now();
                let outcome = (|| -> Result<(), agora::Error> {
                    y.write_slice(&vec![2.0f32; n])?;
                    q.sync_to(&y)?;
                    q.launch(&saxpy, &[Arg::F32(3.0), (&x).into(), (&y).into()], n)?;
                    q.sync_from(&y)?.wait()
                })();
                let took = started.elapsed();
                let mut l = longest.lock().unwrap();
                *l = (*l).max(took);
                drop(l);
                match outcome {
                    Ok(()) if y.as_slice::<f32>().iter().all(|v| *v == 5.0) => {
                        rounds.fetch_add(1, Ordering::Relaxed);
                    }
                    Ok(()) => errors.lock().unwrap().push("wrong result".into()),
                    Err(e) => {
                        errors.lock().unwrap().push(e.to_string());
                        let _ = q.finish();
                    }
                }
            }
        })
    };

    // The hog: 8 buffers of 8 MiB filled on the OpenCL device, again and again (64 MiB of
    // outputs into 48 MiB).
    let q = queue_preferring(&hog, "hog", DeviceKind::OpenCl);
    let fill = hog.kernel("fill").unwrap();
    let n = 2 << 20; // 8 MiB of f32
    let buffers: Vec<agora::Buffer> = (0..8).map(|_| hog.buffer(n as u64 * 4).unwrap()).collect();
    let mut hog_failures = Vec::new();
    let deadline = Instant::now() + Duration::from_secs(4);
    let mut hog_rounds = 0;
    while Instant::now() < deadline {
        for (i, b) in buffers.iter().enumerate() {
            q.launch(&fill, &[Arg::F32(i as f32), b.into()], n).unwrap();
        }
        if let Err(e) = q.finish() {
            hog_failures.push(e.to_string());
        }
        hog_rounds += 1;
    }
    stop.store(true, Ordering::Relaxed);
    worker.join().unwrap();
    let errors = neighbour_errors.lock().unwrap();
    let status = daemon.status();
    let rounds = neighbour_rounds.load(Ordering::Relaxed);
    let moved = status
        .sessions
        .iter()
        .find(|s| s.name == "neighbour")
        .map(|s| s.bytes_to_device)
        .unwrap();
    // Each round uploads y (32 KiB, sync_to); x (32 KiB, read only) stays on the device unless
    // it is evicted: the hog is over its fair share, so its buffers go first.
    let x_uploads = moved.saturating_sub(rounds * 32 * 1024) / (32 * 1024);
    eprintln!(
        "pressure: hog rounds {hog_rounds} (failed finishes {}), neighbour rounds {rounds}, neighbour errors {}, neighbour's longest round {:?}, x uploaded {x_uploads} times; daemon: {} evictions, {} memory waits, {} allocation retries",
        hog_failures.len(),
        errors.len(),
        longest.lock().unwrap(),
        status.evictions,
        status.memory_waits,
        status.allocation_retries
    );
    assert!(status.evictions > 0, "the hog's 64 MiB into 48 MiB evicts");
    assert!(
        x_uploads <= 2,
        "the neighbour's resident input was evicted {x_uploads} times for a tenant over its share"
    );
    assert!(
        errors.is_empty(),
        "the neighbour failed: {:?}",
        &errors[..errors.len().min(5)]
    );
    assert!(
        hog_failures.is_empty(),
        "the hog's tasks fit one at a time: {:?}",
        hog_failures.first()
    );
    assert!(neighbour_rounds.load(Ordering::Relaxed) > 0);
}

/// A task that waits for room is counted once in `memory_waits` (`agora status`'s "tasks waited
/// for room", `agora_memory_waits`), however often it is placed again before the room comes:
/// here one task waits about a second behind a launch that holds 3 of a sim's 4 MiB, and the
/// daemon places it again every millisecond or so (it counted about a thousand before).
#[test]
fn a_task_that_waits_for_room_is_counted_once() {
    // One job per launch (no slicing): the sim's launch then takes its launch_ns once.
    let daemon = Daemon::start_with_config(
        AGORA,
        "pressure-waits-counted",
        "[[sim]]\nname = \"sim0\"\nlanes = 2\nmemory = \"4M\"\nlaunch_ns = 1000000000\n",
        &["--no-opencl", "--preempt-target-us", "0"],
    );
    let n = 1 << 18; // 1 MiB of f32
    let holder = daemon.session_named("holder");
    let waiter = daemon.session_named("waiter");
    let held: Vec<_> = (0..3).map(|_| holder.buffer_from(&vec![1.0f32; n]).unwrap()).collect();
    let q = queue_preferring(&holder, "holder", DeviceKind::Sim);
    let vector_add = holder.kernel("vector_add").unwrap();
    q.launch(
        &vector_add,
        &[(&held[0]).into(), (&held[1]).into(), (&held[2]).into()],
        n,
    )
    .unwrap();
    // Let the long launch start (its 3 MiB in use), then ask for 2 MiB more.
    std::thread::sleep(Duration::from_millis(200));
    let before = waiter.status().unwrap().memory_waits;
    let x = waiter.buffer_from(&vec![1.0f32; n]).unwrap();
    let y = waiter.buffer_from(&vec![0.0f32; n]).unwrap();
    let w = queue_preferring(&waiter, "waiter", DeviceKind::Sim);
    let vector_add = waiter.kernel("vector_add").unwrap();
    w.launch(&vector_add, &[(&x).into(), (&x).into(), (&y).into()], n)
        .unwrap();
    w.sync_from(&y).unwrap();
    w.finish().unwrap();
    q.finish().unwrap();
    assert!(y.as_slice::<f32>().iter().all(|v| *v == 2.0), "the waiter's result");
    let waits = waiter.status().unwrap().memory_waits - before;
    assert_eq!(waits, 1, "one task waited for room, counted {waits} times");
}
