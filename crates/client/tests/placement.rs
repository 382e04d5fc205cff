//! Data placement across devices: a buffer's valid copy follows the tasks that write it, and
//! every reader — another device, the host — sees exact results.
//!
//! Needs an OpenCL device (PoCL, installed by `make setup`); the test fails, rather than skipping,
//! when there is none.

mod common;

use agora::{Arg, DeviceKind, QueueOptions, Session};

fn daemon(tag: &str) -> (common::EmbeddedDaemon, Session) {
    let (handle, session) = common::daemon(tag);
    common::require_opencl(&session);
    (handle, session)
}

fn queue(session: &Session, kind: DeviceKind) -> agora::Queue {
    session
        .queue_with(QueueOptions {
            name: format!("{kind:?}"),
            preferred_device: Some(kind),
            sla: None,
            ..Default::default()
        })
        .unwrap()
}

#[test]
fn a_buffer_written_on_opencl_is_exact_on_the_cpu_and_the_host() {
    let (daemon, session) = daemon("move");
    let gpu = queue(&session, DeviceKind::OpenCl);
    let cpu = queue(&session, DeviceKind::Cpu);
    let fill = session.kernel("fill").unwrap();
    let saxpy = session.kernel("saxpy").unwrap();
    let n = 100_003usize;
    let x = session.buffer((n * 4) as u64).unwrap();
    let y = session
        .buffer_from(&(0..n).map(|i| i as f32).collect::<Vec<_>>())
        .unwrap();

    // x is written on the OpenCL device only; its host copy is stale (zeros) until fetched.
    gpu.launch(&fill, &[Arg::F32(2.5), (&x).into()], n)
        .unwrap()
        .wait()
        .unwrap();
    assert!(
        x.as_slice::<f32>().iter().all(|v| *v == 0.0),
        "no transfer before anyone asks"
    );

    // A CPU kernel reading x gets the device's contents (device -> host segment).
    cpu.launch(&saxpy, &[Arg::F32(2.0), (&x).into(), (&y).into()], n)
        .unwrap()
        .wait()
        .unwrap();
    cpu.sync_from(&y).unwrap().wait().unwrap();
    for (i, v) in y.as_slice::<f32>().iter().enumerate() {
        assert_eq!(*v, i as f32 + 5.0, "y[{i}]");
    }

    // y, now valid on the host only, goes back to the device for an OpenCL saxpy.
    gpu.launch(&saxpy, &[Arg::F32(1.0), (&x).into(), (&y).into()], n)
        .unwrap();
    gpu.sync_from(&y).unwrap();
    gpu.finish().unwrap();
    for (i, v) in y.as_slice::<f32>().iter().enumerate() {
        assert_eq!(*v, i as f32 + 7.5, "y[{i}] after the device update");
    }
    drop((x, y, gpu, cpu, session));
    daemon.stop().unwrap();
}

#[test]
fn partial_host_operations_keep_device_results() {
    let (daemon, session) = daemon("partial");
    let gpu = queue(&session, DeviceKind::OpenCl);
    let fill = session.kernel("fill").unwrap();
    let n = 4096usize;
    let b = session.buffer((n * 4) as u64).unwrap();
    let c = session.buffer((n * 4) as u64).unwrap();
    gpu.launch(&fill, &[Arg::F32(1.0), (&b).into()], n).unwrap();
    // memset runs on host memory: the device's values come home first, then all bytes are zeroed.
    gpu.memset(&b, 0).unwrap();
    // A fill of only the first half must not lose the zeroed second half: a partial write copies
    // the current contents to the device first.
    gpu.launch(&fill, &[Arg::F32(3.0), (&b).into()], n / 2).unwrap();
    // copy runs on host memory too: b's device values are fetched before it reads them.
    gpu.copy(&b, 0, &c, 0, 0).unwrap();
    gpu.sync_from(&b).unwrap();
    gpu.finish().unwrap();
    let bv = b.as_slice::<f32>();
    assert!(bv[..n / 2].iter().all(|v| *v == 3.0), "device fill of the first half");
    assert!(
        bv[n / 2..].iter().all(|v| *v == 0.0),
        "memset survives in the second half"
    );
    assert_eq!(c.as_slice::<f32>(), bv, "copy saw the device's values");
    drop((b, c, gpu, session));
    daemon.stop().unwrap();
}
