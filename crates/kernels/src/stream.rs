//! The four STREAM kernels (`stream.copy`, `stream.scale`, `stream.add`, `stream.triad`), in
//! single precision, with STREAM's argument names: `c = a`, `b = s·c`, `c = a + b`,
//! `a = b + s·c`. Range `n`, one element per work item.

use std::borrow::Cow;

use crate::{CpuImpl, SizeCheck};
use std::ops::Range;

use agora_protocol::{Access::*, ScalarType::*, TaskError};

use crate::{buffer, opencl, programs::STREAM, scalar, Cost, KernelCall, KernelDef, LaunchShape};

/// Buffers `indices` must each hold the range's items.
fn need_items(s: &LaunchShape<'_>, indices: &[usize]) -> Result<(), TaskError> {
    indices.iter().try_for_each(|i| s.need(*i, s.items(), 4))
}

fn copy_check(s: &LaunchShape<'_>) -> Result<(), TaskError> {
    need_items(s, &[0, 1])
}

fn scale_check(s: &LaunchShape<'_>) -> Result<(), TaskError> {
    need_items(s, &[1, 2])
}

fn add_check(s: &LaunchShape<'_>) -> Result<(), TaskError> {
    need_items(s, &[0, 1, 2])
}

fn triad_check(s: &LaunchShape<'_>) -> Result<(), TaskError> {
    need_items(s, &[1, 2, 3])
}

fn copy_cpu(call: &KernelCall<'_>, rows: Range<u64>) {
    let items = call.items(rows);
    let a = &call.input::<f32>(0)[items.clone()];
    // SAFETY: this thread alone writes `items` (its rows), and `c` shares no memory with `a`.
    let c = unsafe { call.output::<f32>(1).row_mut(items) };
    c.copy_from_slice(a);
}

/// `stream.copy(a, c)`: c ← a.
pub const COPY: KernelDef = KernelDef {
    cuda: None,
    name: Cow::Borrowed("stream.copy"),
    doc: Cow::Borrowed("STREAM copy: c[i] = a[i]; range n"),
    params: Cow::Borrowed(&[buffer("a", F32, Read), buffer("c", F32, Write)]),
    cost: Cost::PerItemNs(0.2),
    chunkable: true,
    check: SizeCheck::Builtin(copy_check),
    cpu: Some(CpuImpl::Builtin(copy_cpu)),
    opencl: opencl("stream", STREAM, "stream_copy"),
};

fn scale_cpu(call: &KernelCall<'_>, rows: Range<u64>) {
    let s = call.f32(0);
    let items = call.items(rows);
    let c = &call.input::<f32>(1)[items.clone()];
    // SAFETY: this thread alone writes `items`, and `b` shares no memory with `c`.
    let b = unsafe { call.output::<f32>(2).row_mut(items) };
    for (bi, ci) in b.iter_mut().zip(c) {
        *bi = s * ci;
    }
}

/// `stream.scale(scalar, c, b)`: b ← scalar·c.
pub const SCALE: KernelDef = KernelDef {
    cuda: None,
    name: Cow::Borrowed("stream.scale"),
    doc: Cow::Borrowed("STREAM scale: b[i] = scalar*c[i]; range n"),
    params: Cow::Borrowed(&[scalar("scalar", F32), buffer("c", F32, Read), buffer("b", F32, Write)]),
    cost: Cost::PerItemNs(0.3),
    chunkable: true,
    check: SizeCheck::Builtin(scale_check),
    cpu: Some(CpuImpl::Builtin(scale_cpu)),
    opencl: opencl("stream", STREAM, "stream_scale"),
};

fn add_cpu(call: &KernelCall<'_>, rows: Range<u64>) {
    let items = call.items(rows);
    let a = &call.input::<f32>(0)[items.clone()];
    let b = &call.input::<f32>(1)[items.clone()];
    // SAFETY: this thread alone writes `items`, and `c` shares no memory with `a` or `b`.
    let c = unsafe { call.output::<f32>(2).row_mut(items) };
    for ((ci, ai), bi) in c.iter_mut().zip(a).zip(b) {
        *ci = ai + bi;
    }
}

/// `stream.add(a, b, c)`: c ← a + b.
pub const ADD: KernelDef = KernelDef {
    cuda: None,
    name: Cow::Borrowed("stream.add"),
    doc: Cow::Borrowed("STREAM add: c[i] = a[i] + b[i]; range n"),
    params: Cow::Borrowed(&[buffer("a", F32, Read), buffer("b", F32, Read), buffer("c", F32, Write)]),
    cost: Cost::PerItemNs(0.4),
    chunkable: true,
    check: SizeCheck::Builtin(add_check),
    cpu: Some(CpuImpl::Builtin(add_cpu)),
    opencl: opencl("stream", STREAM, "stream_add"),
};

fn triad_cpu(call: &KernelCall<'_>, rows: Range<u64>) {
    let s = call.f32(0);
    let items = call.items(rows);
    let b = &call.input::<f32>(1)[items.clone()];
    let c = &call.input::<f32>(2)[items.clone()];
    // SAFETY: this thread alone writes `items`, and `a` shares no memory with `b` or `c`.
    let a = unsafe { call.output::<f32>(3).row_mut(items) };
    for ((ai, bi), ci) in a.iter_mut().zip(b).zip(c) {
        *ai = bi + s * ci;
    }
}

/// `stream.triad(scalar, b, c, a)`: a ← b + scalar·c.
pub const TRIAD: KernelDef = KernelDef {
    cuda: None,
    name: Cow::Borrowed("stream.triad"),
    doc: Cow::Borrowed("STREAM triad: a[i] = b[i] + scalar*c[i]; range n"),
    params: Cow::Borrowed(&[
        scalar("scalar", F32),
        buffer("b", F32, Read),
        buffer("c", F32, Read),
        buffer("a", F32, Write),
    ]),
    cost: Cost::PerItemNs(0.4),
    chunkable: true,
    check: SizeCheck::Builtin(triad_check),
    cpu: Some(CpuImpl::Builtin(triad_cpu)),
    opencl: opencl("stream", STREAM, "stream_triad"),
};

/// Host reference and input generator.
pub mod reference {
    use crate::rng::Rng;

    /// STREAM's initial arrays scaled by a random perturbation: `a ≈ 1`, `b ≈ 2`, `c ≈ 0`,
    /// each element `value + [0, 0.5)`.
    pub fn arrays(n: usize, seed: u64) -> (Vec<f32>, Vec<f32>, Vec<f32>) {
        let mut rng = Rng::new(seed);
        let mut array = |base: f32| (0..n).map(|_| base + rng.range(0.0, 0.5)).collect::<Vec<f32>>();
        (array(1.0), array(2.0), array(0.0))
    }

    /// `c = a`.
    pub fn copy(a: &[f32], c: &mut [f32]) {
        c.copy_from_slice(a);
    }

    /// `b = scalar·c`.
    pub fn scale(scalar: f32, c: &[f32], b: &mut [f32]) {
        for (bi, ci) in b.iter_mut().zip(c) {
            *bi = scalar * ci;
        }
    }

    /// `c = a + b`.
    pub fn add(a: &[f32], b: &[f32], c: &mut [f32]) {
        for ((ci, ai), bi) in c.iter_mut().zip(a).zip(b) {
            *ci = ai + bi;
        }
    }

    /// `a = b + scalar·c`.
    pub fn triad(scalar: f32, b: &[f32], c: &[f32], a: &mut [f32]) {
        for ((ai, bi), ci) in a.iter_mut().zip(b).zip(c) {
            *ai = bi + scalar * ci;
        }
    }
}
