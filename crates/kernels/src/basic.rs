//! Elementwise kernels: `noop`, `saxpy`, `vector_add`, `fill`.

use std::borrow::Cow;

use crate::{CpuImpl, SizeCheck};
use std::ops::Range;

use agora_protocol::{Access::*, ScalarType::*, TaskError};

use crate::{buffer, opencl, programs::BASIC, scalar, Cost, KernelCall, KernelDef, LaunchShape};

fn no_check(_: &LaunchShape<'_>) -> Result<(), TaskError> {
    Ok(())
}

fn noop_cpu(_: &KernelCall<'_>, _: Range<u64>) {}

/// `noop()`: does nothing; measures the per-task path.
///
/// Not free: a device still walks the range (PoCL spends about 0.27 s on 2^32 work items with
/// both cores of this machine, so 0.125 ns per item and core), so the estimate grows with it and a
/// huge range is sliced like any long launch.
pub const NOOP: KernelDef = KernelDef {
    cuda: None,
    name: Cow::Borrowed("noop"),
    doc: Cow::Borrowed("does nothing; any range"),
    params: Cow::Borrowed(&[]),
    cost: Cost::PerItemNs(0.125),
    chunkable: true,
    check: SizeCheck::Builtin(no_check),
    cpu: Some(CpuImpl::Builtin(noop_cpu)),
    opencl: opencl("basic", BASIC, "noop"),
};

fn saxpy_check(s: &LaunchShape<'_>) -> Result<(), TaskError> {
    s.need(1, s.items(), 4)?;
    s.need(2, s.items(), 4)
}

fn saxpy_cpu(call: &KernelCall<'_>, rows: Range<u64>) {
    let a = call.f32(0);
    let items = call.items(rows);
    let x = &call.input::<f32>(1)[items.clone()];
    // SAFETY: this thread owns `items` (its rows); no other thread touches them.
    let y = unsafe { call.output::<f32>(2).row_mut(items) };
    for (yi, xi) in y.iter_mut().zip(x) {
        *yi += a * xi;
    }
}

/// `saxpy(a, x, y)`: y ← a·x + y over `n` items.
pub const SAXPY: KernelDef = KernelDef {
    cuda: None,
    name: Cow::Borrowed("saxpy"),
    doc: Cow::Borrowed("y[i] = a*x[i] + y[i] for i < n; range n"),
    params: Cow::Borrowed(&[scalar("a", F32), buffer("x", F32, Read), buffer("y", F32, ReadWrite)]),
    cost: Cost::PerItemNs(0.5),
    chunkable: true,
    check: SizeCheck::Builtin(saxpy_check),
    cpu: Some(CpuImpl::Builtin(saxpy_cpu)),
    opencl: opencl("basic", BASIC, "saxpy"),
};

fn vector_add_check(s: &LaunchShape<'_>) -> Result<(), TaskError> {
    for i in 0..3 {
        s.need(i, s.items(), 4)?;
    }
    Ok(())
}

fn vector_add_cpu(call: &KernelCall<'_>, rows: Range<u64>) {
    let items = call.items(rows);
    let a = &call.input::<f32>(0)[items.clone()];
    let b = &call.input::<f32>(1)[items.clone()];
    // SAFETY: this thread owns `items`.
    let c = unsafe { call.output::<f32>(2).row_mut(items) };
    for ((ci, ai), bi) in c.iter_mut().zip(a).zip(b) {
        *ci = ai + bi;
    }
}

/// `vector_add(a, b, c)`: c ← a + b.
pub const VECTOR_ADD: KernelDef = KernelDef {
    cuda: None,
    name: Cow::Borrowed("vector_add"),
    doc: Cow::Borrowed("c[i] = a[i] + b[i] for i < n; range n"),
    params: Cow::Borrowed(&[buffer("a", F32, Read), buffer("b", F32, Read), buffer("c", F32, Write)]),
    cost: Cost::PerItemNs(0.5),
    chunkable: true,
    check: SizeCheck::Builtin(vector_add_check),
    cpu: Some(CpuImpl::Builtin(vector_add_cpu)),
    opencl: opencl("basic", BASIC, "vector_add"),
};

fn fill_check(s: &LaunchShape<'_>) -> Result<(), TaskError> {
    s.need(1, s.items(), 4)
}

fn fill_cpu(call: &KernelCall<'_>, rows: Range<u64>) {
    let value = call.f32(0);
    let items = call.items(rows);
    // SAFETY: this thread owns `items`.
    unsafe { call.output::<f32>(1).row_mut(items) }.fill(value);
}

/// `fill(value, y)`: y ← value.
pub const FILL: KernelDef = KernelDef {
    cuda: None,
    name: Cow::Borrowed("fill"),
    doc: Cow::Borrowed("y[i] = value for i < n; range n"),
    params: Cow::Borrowed(&[scalar("value", F32), buffer("y", F32, Write)]),
    cost: Cost::PerItemNs(0.25),
    chunkable: true,
    check: SizeCheck::Builtin(fill_check),
    cpu: Some(CpuImpl::Builtin(fill_cpu)),
    opencl: opencl("basic", BASIC, "fill"),
};

#[cfg(test)]
mod tests {
    use agora_protocol::RawArg;

    use crate::call::run_on_host;
    use crate::find;

    fn bytes(v: &mut [f32]) -> &mut [u8] {
        bytemuck::cast_slice_mut(v)
    }

    #[test]
    fn saxpy_matches_reference_for_every_split() {
        let n = 10_007usize;
        let x: Vec<f32> = (0..n).map(|i| i as f32 * 0.5).collect();
        let y0: Vec<f32> = (0..n).map(|i| 1.0 - i as f32).collect();
        for threads in [1, 2, 3, 8] {
            let mut xs = x.clone();
            let mut ys = y0.clone();
            let (_, k) = find("saxpy").unwrap();
            run_on_host(
                k,
                &[n as u64],
                &[RawArg::f32(3.0), RawArg::buffer(0), RawArg::buffer(1)],
                &mut [bytes(&mut xs), bytes(&mut ys)],
                threads,
            )
            .unwrap();
            for i in 0..n {
                assert_eq!(ys[i], 3.0 * x[i] + y0[i]);
            }
        }
    }

    #[test]
    fn vector_add_and_fill_match_reference() {
        let n = 4099usize;
        let mut a: Vec<f32> = (0..n).map(|i| i as f32).collect();
        let mut b: Vec<f32> = (0..n).map(|i| 2.0 * i as f32).collect();
        let mut c = vec![0f32; n];
        let (_, k) = find("vector_add").unwrap();
        run_on_host(
            k,
            &[n as u64],
            &[RawArg::buffer(0), RawArg::buffer(1), RawArg::buffer(2)],
            &mut [bytes(&mut a), bytes(&mut b), bytes(&mut c)],
            2,
        )
        .unwrap();
        assert!(c.iter().enumerate().all(|(i, v)| *v == 3.0 * i as f32));
        let (_, k) = find("fill").unwrap();
        run_on_host(
            k,
            &[n as u64],
            &[RawArg::f32(7.5), RawArg::buffer(0)],
            &mut [bytes(&mut c)],
            3,
        )
        .unwrap();
        assert!(c.iter().all(|v| *v == 7.5));
    }

    #[test]
    fn too_small_buffers_are_refused_before_running() {
        let mut x = vec![0f32; 10];
        let mut y = vec![0f32; 20];
        let (_, k) = find("saxpy").unwrap();
        let err = run_on_host(
            k,
            &[20],
            &[RawArg::f32(1.0), RawArg::buffer(0), RawArg::buffer(1)],
            &mut [bytes(&mut x), bytes(&mut y)],
            1,
        )
        .unwrap_err();
        assert_eq!(
            err,
            agora_protocol::TaskError::BufferTooSmall {
                index: 1,
                needed: 80,
                len: 40
            }
        );
    }
}
