//! Issue 22, item 2: a device runtime that refuses an allocation the daemon's books said would
//! fit (its real free memory is lower) does not fail the task: the daemon evicts idle buffers
//! and retries. A sim device's `runtime_memory` models such a runtime.

use agora::{Arg, DeviceKind, QueueOptions};
use agora_daemon::SimDeviceConfig;

mod common;

#[test]
fn an_allocation_the_runtime_refuses_is_retried_after_eviction_not_surfaced() {
    const MIB: u64 = 1 << 20;
    let (_daemon, session) = common::daemon_with("alloc-retry", |c| {
        c.sims.push(SimDeviceConfig {
            memory: 16 * MIB,
            runtime_memory: Some(6 * MIB),
            ..SimDeviceConfig::named("liar")
        });
    });
    let q = session
        .queue_with(QueueOptions {
            name: "sim".into(),
            preferred_device: Some(DeviceKind::Sim),
            ..Default::default()
        })
        .unwrap();
    let fill = session.kernel("fill").unwrap();
    let n = (2 * MIB / 4) as usize;
    // 6 buffers of 2 MiB: 12 MiB fit the books (16 MiB), not the runtime (6 MiB).
    let buffers: Vec<agora::Buffer> = (0..6).map(|_| session.buffer(2 * MIB).unwrap()).collect();
    for round in 0..3 {
        for (i, b) in buffers.iter().enumerate() {
            q.launch(&fill, &[Arg::F32((round * 10 + i) as f32), b.into()], n)
                .unwrap();
            q.sync_from(b).unwrap();
        }
        q.finish().expect("no task fails for the runtime's refusals");
        for (i, b) in buffers.iter().enumerate() {
            let want = (round * 10 + i) as f32;
            assert!(
                b.as_slice::<f32>().iter().all(|v| *v == want),
                "buffer {i} round {round}"
            );
        }
    }
    let status = session.status().unwrap();
    assert!(
        status.allocation_retries > 0,
        "the runtime refused and the daemon retried"
    );
    assert!(status.evictions > 0);
}
