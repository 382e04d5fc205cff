//! One tenant never sees another's old device data (issue #20, item 3), with real processes: the
//! daemon runs as `agora serve` in its own process, the tenants are sessions of this process.
//!
//! Tenant A writes a secret pattern into buffers in an OpenCL device's memory and frees them;
//! tenant B allocates buffers of the same size and does what could leave a device copy holding
//! someone else's bytes — a write-only launch that fails, one that is cancelled, a kernel that
//! declares it writes a whole buffer but writes part of it — then reads back, both through
//! `sync_from` and through work that brings the device copy home (a partial copy into the
//! buffer). Not one word of A's pattern may reach B: B gets an error (its buffer is poisoned) or
//! zeros. The daemon zeroes device allocations before anything can read them, and after a task
//! that did not complete no device copy claims its output.
//!
//! These tests need OpenCL (PoCL, installed by `make setup`): they fail, never skip, without it.

use std::time::{Duration, Instant};

use agora::{Arg, Buffer, DeviceKind, Error, QueueOptions, Session, TaskError};
use agora_protocol::testing::injected_fault;
use agora_test_support::{connect, require_opencl, temp_dir, Daemon};

const AGORA: &str = env!("CARGO_BIN_EXE_agora");

/// Tenant A's secret: every word of its buffers.
const SECRET: u32 = 0x5EC2_E7A5;
/// What the `leak.half` kernel writes (to even elements only).
const HALF: u32 = 0x0000_0001;
/// Buffers per tenant and their size: small enough that the OpenCL runtime's allocator hands
/// freed memory out again (as a device's allocator would), many so one reuse is enough.
const BUFFERS: usize = 8;
const BYTES: u64 = 64 << 10;
const WORDS: usize = (BYTES / 4) as usize;

/// The fault injection of the daemons that fail tasks on purpose: (seed, per mille).
const FAULTS: (u64, u64) = (11, 500);

const CL: &str = r#"
__kernel void leak_secret(__global uint *y) {
    y[get_global_id(0)] = 0x5EC2E7A5u;
}
/* Declared to write all of y, but writes only its even elements. */
__kernel void leak_half(__global uint *y) {
    size_t i = get_global_id(0);
    if (i % 2 == 0) y[i] = 1u;
}
/* Runs for a while (about n * n steps per item), writing y: work to queue other tasks behind. */
__kernel void leak_spin(__global uint *y, const uint n) {
    size_t i = get_global_id(0);
    uint acc = (uint)i;
    for (uint k = 0; k < n * n; k++) acc = acc * 1664525u + 1013904223u;
    y[i] = acc;
}
"#;

const MANIFEST: &str = r#"[package]
name = "leak"

[kernels.secret]
doc = "y[i] = 0x5EC2E7A5; range (len y in elements)"
params = ["y: u32 write"]
sizes = { y = "range0" }
opencl = { file = "leak.cl", entry = "leak_secret" }

[kernels.half]
doc = "y[i] = 1 for even i only, although y is declared write-only over the range"
params = ["y: u32 write"]
sizes = { y = "range0" }
opencl = { file = "leak.cl", entry = "leak_half" }

[kernels.spin]
doc = "busy work writing y; range (len y)"
params = ["y: u32 write", "n: u32"]
sizes = { y = "range0" }
# Predicted long, so batch launches are split into row slices that wait in the lane (where a
# session's end cancels them and everything queued behind them).
chunkable = true
cost_ns_per_item = 200000.0
opencl = { file = "leak.cl", entry = "leak_spin" }
"#;

/// `agora serve` with the `leak` package loaded, and `AGORA_INJECT_FAULTS` set when `faults`.
fn start(tag: &str, faults: Option<(u64, u64)>) -> Daemon {
    let dir = temp_dir(&format!("device-data-{tag}"));
    let package = dir.path().join("packages/leak");
    std::fs::create_dir_all(&package).unwrap();
    std::fs::write(package.join("package.toml"), MANIFEST).unwrap();
    std::fs::write(package.join("leak.cl"), CL).unwrap();
    Daemon::start_in_with(AGORA, dir, &["--kernels", "{dir}/packages"], |command| {
        match faults {
            Some((seed, per_mille)) => command.env("AGORA_INJECT_FAULTS", format!("{seed}:{per_mille}")),
            None => command.env_remove("AGORA_INJECT_FAULTS"),
        };
    })
}

fn opencl_queue(session: &Session, name: &str) -> agora::Queue {
    session
        .queue_with(QueueOptions {
            name: name.into(),
            preferred_device: Some(DeviceKind::OpenCl),
            ..Default::default()
        })
        .unwrap()
}

/// Bytes of OpenCL device memory in use.
fn opencl_memory_used(session: &Session) -> u64 {
    let status = session.status().unwrap();
    status
        .devices
        .iter()
        .filter(|d| d.kind == "opencl")
        .map(|d| d.memory_used)
        .sum()
}

fn wait_until(what: &str, timeout: Duration, mut ok: impl FnMut() -> bool) {
    let deadline = Instant::now() + timeout;
    while !ok() {
        assert!(Instant::now() < deadline, "timed out waiting for: {what}");
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// A session's task ids, in order: with fault injection on, which of its next tasks fail.
struct Ids {
    next: u64,
    faults: Option<(u64, u64)>,
}

impl Ids {
    fn new(faults: Option<(u64, u64)>) -> Ids {
        Ids { next: 1, faults }
    }

    fn picked(&self) -> bool {
        self.faults
            .is_some_and(|(seed, per_mille)| injected_fault(seed, per_mille, self.next))
    }

    /// Issues harmless tasks on `queue` until the next task is (`fail`) or is not picked to fail.
    fn until(&mut self, queue: &agora::Queue, scratch: &Buffer, fail: bool) {
        while self.picked() != fail {
            let task = queue.memset(scratch, 0).unwrap();
            self.issued(task.id());
            let _ = task.wait();
        }
    }

    fn issued(&mut self, id: u64) {
        assert_eq!(id, self.next, "task ids are issued in order within a session");
        self.next += 1;
    }
}

/// Tenant A: writes the secret into `BUFFERS` buffers on the OpenCL device (checks that it is
/// there), then frees them and leaves; returns once the device memory is free again.
fn tenant_a_writes_a_secret_and_leaves(daemon: &Daemon, faults: Option<(u64, u64)>) {
    let a = connect(daemon.socket(), Some("tenant-a"));
    require_opencl(&a);
    let queue = opencl_queue(&a, "secret");
    let secret = a.kernel("leak.secret").unwrap();
    let scratch = a.buffer(64).unwrap();
    let mut ids = Ids::new(faults);
    let buffers: Vec<Buffer> = (0..BUFFERS).map(|_| a.buffer(BYTES).unwrap()).collect();
    for buffer in &buffers {
        ids.until(&queue, &scratch, false);
        let task = queue.launch(&secret, &[buffer.into()], WORDS).unwrap();
        ids.issued(task.id());
        task.wait().unwrap();
    }
    ids.until(&queue, &scratch, false);
    let read = queue.sync_from(&buffers[0]).unwrap();
    ids.issued(read.id());
    read.wait().unwrap();
    assert!(
        buffers[0].as_slice::<u32>().iter().all(|w| *w == SECRET),
        "tenant A's secret is on the device"
    );
    assert!(opencl_memory_used(&a) >= BUFFERS as u64 * BYTES);
    drop(buffers);
    drop(scratch);
    drop(queue);
    drop(a);
    let observer = connect(daemon.socket(), Some("observer"));
    wait_until("tenant A's device memory is freed", Duration::from_secs(20), || {
        opencl_memory_used(&observer) == 0
    });
}

/// Every word of `buffer` (tenant B's view of its host copy) is one of `allowed`: never A's.
fn assert_clean(buffer: &Buffer, allowed: &[u32], what: &str) {
    let words = buffer.as_slice::<u32>();
    let leaked = words.iter().filter(|w| **w == SECRET).count();
    assert_eq!(
        leaked, 0,
        "{what}: {leaked} words of tenant A's secret reached tenant B"
    );
    if let Some((i, w)) = words.iter().enumerate().find(|(_, w)| !allowed.contains(w)) {
        panic!("{what}: word {i} is {w:#010x}, which tenant B never wrote (allowed: {allowed:x?})");
    }
}

fn poisoned(result: Result<(), Error>) -> bool {
    matches!(result, Err(Error::Task(TaskError::DependencyFailed { .. })))
}

/// B's write-only launches fail (fault injection: the work does not run, exactly what a kernel
/// that crashed before writing leaves). Reading back gives a poisoned-data error and B's host
/// copy stays zero; a partial copy into the buffer, which brings the buffer's current contents
/// home first, brings zeros, not A's secret.
#[test]
fn a_failed_write_only_launch_never_hands_out_another_tenants_device_data() {
    let daemon = start("failed", Some(FAULTS));
    tenant_a_writes_a_secret_and_leaves(&daemon, Some(FAULTS));

    let b = connect(daemon.socket(), Some("tenant-b"));
    let queue = opencl_queue(&b, "victim");
    let secret = b.kernel("leak.secret").unwrap();
    let scratch = b.buffer(64).unwrap();
    let source = b.buffer_from(&[7u32]).unwrap();
    let mut ids = Ids::new(Some(FAULTS));
    let buffers: Vec<Buffer> = (0..BUFFERS).map(|_| b.buffer(BYTES).unwrap()).collect();
    for (n, buffer) in buffers.iter().enumerate() {
        // A write-only launch over the whole buffer (no copy-in), picked to fail.
        ids.until(&queue, &scratch, true);
        let launch = queue.launch(&secret, &[buffer.into()], WORDS).unwrap();
        ids.issued(launch.id());
        let outcome = launch.wait();
        assert!(
            matches!(outcome, Err(Error::Task(TaskError::KernelFault))),
            "buffer {n}: the injected fault, not {outcome:?}"
        );
        assert!(opencl_memory_used(&b) > 0, "the launch had a device copy allocated");
        if n % 2 == 0 {
            // Read back: the buffer's last writer failed, so its contents are poisoned.
            ids.until(&queue, &scratch, false);
            let read = queue.sync_from(buffer).unwrap();
            ids.issued(read.id());
            assert!(poisoned(read.wait()), "buffer {n}: sync_from reports poisoned data");
            assert_clean(buffer, &[0], &format!("buffer {n} after sync_from"));
        } else {
            // A partial write that does not read it: host work, which brings the buffer's
            // current contents home before it writes its 4 bytes.
            ids.until(&queue, &scratch, false);
            let copy = queue.copy(&source, 0, buffer, 0, 4).unwrap();
            ids.issued(copy.id());
            copy.wait().unwrap();
            assert_clean(buffer, &[0, 7], &format!("buffer {n} after a partial copy"));
            ids.until(&queue, &scratch, false);
            let read = queue.sync_from(buffer).unwrap();
            ids.issued(read.id());
            assert!(
                poisoned(read.wait()),
                "buffer {n}: still poisoned after a partial write"
            );
            assert_clean(buffer, &[0, 7], &format!("buffer {n} after sync_from"));
        }
    }
    // The buffers still work: a whole rewrite clears the poison.
    ids.until(&queue, &scratch, false);
    let rewrite = queue.launch(&secret, &[(&buffers[0]).into()], WORDS).unwrap();
    ids.issued(rewrite.id());
    rewrite.wait().unwrap();
    ids.until(&queue, &scratch, false);
    let read = queue.sync_from(&buffers[0]).unwrap();
    ids.issued(read.id());
    read.wait().unwrap();
    assert!(buffers[0].as_slice::<u32>().iter().all(|w| *w == SECRET));
}

/// A kernel that declares it writes the whole buffer (so nothing is copied in) but writes only
/// every other element: the elements it skipped read as zeros, never as A's secret.
#[test]
fn a_kernel_that_writes_less_than_it_declares_shows_zeros_in_the_rest() {
    let daemon = start("partial", None);
    tenant_a_writes_a_secret_and_leaves(&daemon, None);

    let b = connect(daemon.socket(), Some("tenant-b"));
    let queue = opencl_queue(&b, "victim");
    let half = b.kernel("leak.half").unwrap();
    let buffers: Vec<Buffer> = (0..BUFFERS).map(|_| b.buffer(BYTES).unwrap()).collect();
    for buffer in &buffers {
        queue.launch(&half, &[buffer.into()], WORDS).unwrap();
        queue.sync_from(buffer).unwrap();
    }
    queue.finish().unwrap();
    for (n, buffer) in buffers.iter().enumerate() {
        assert_clean(buffer, &[0, HALF], &format!("buffer {n}"));
        let words = buffer.as_slice::<u32>();
        assert!(
            words.iter().step_by(2).all(|w| *w == HALF),
            "buffer {n}: the kernel ran"
        );
        assert!(
            words.iter().skip(1).step_by(2).all(|w| *w == 0),
            "buffer {n}: zeros elsewhere"
        );
    }
}

/// Tenant B's write-only launches are cancelled: they wait in the lane behind the row slices of
/// long launches when B's session ends (cancelled tasks only arise so: a session's queued work
/// goes with it). Tenant C then allocates the same size and runs the under-writing kernel: the
/// elements it skipped are zeros, neither A's secret nor anything of B's.
#[test]
fn cancelled_write_only_launches_leave_nothing_for_the_next_tenant() {
    let daemon = start("cancelled", None);
    tenant_a_writes_a_secret_and_leaves(&daemon, None);

    {
        let b = connect(daemon.socket(), Some("tenant-b"));
        let queue = opencl_queue(&b, "cancelled");
        let spin = b.kernel("leak.spin").unwrap();
        let secret = b.kernel("leak.secret").unwrap();
        let busy = b.buffer(BYTES).unwrap();
        // Long work first (sliced; about a second on this machine's PoCL), then the write-only
        // launches.
        let long: Vec<_> = (0..4)
            .map(|_| queue.launch(&spin, &[(&busy).into(), Arg::U32(100)], WORDS).unwrap())
            .collect();
        let buffers: Vec<Buffer> = (0..BUFFERS).map(|_| b.buffer(BYTES).unwrap()).collect();
        let launches: Vec<_> = buffers
            .iter()
            .map(|buffer| queue.launch(&secret, &[buffer.into()], WORDS).unwrap())
            .collect();
        assert!(
            !launches.last().unwrap().wait_timeout(Duration::from_millis(1)).unwrap(),
            "the write-only launches wait behind the long work"
        );
        drop(long);
        drop(launches);
        // B's session ends here, its queued launches cancelled and its buffers freed.
    }
    let observer = connect(daemon.socket(), Some("observer"));
    wait_until("tenant B's device memory is freed", Duration::from_secs(60), || {
        opencl_memory_used(&observer) == 0
    });

    let c = connect(daemon.socket(), Some("tenant-c"));
    let queue = opencl_queue(&c, "next");
    let half = c.kernel("leak.half").unwrap();
    let buffers: Vec<Buffer> = (0..BUFFERS + 1).map(|_| c.buffer(BYTES).unwrap()).collect();
    for buffer in &buffers {
        queue.launch(&half, &[buffer.into()], WORDS).unwrap();
        queue.sync_from(buffer).unwrap();
    }
    queue.finish().unwrap();
    for (n, buffer) in buffers.iter().enumerate() {
        // Not A's secret, not B's secret (B never finished writing), and not B's busy work.
        assert_clean(buffer, &[0, HALF], &format!("tenant C's buffer {n}"));
    }
}
