//! Rodinia's Gaussian elimination kernels (`gaussian.fan1`, `gaussian.fan2`).
//!
//! The host loop runs, for `t` in `0..size-1`: `fan1` over `size-1-t` rows, computing the
//! multipliers of column `t`, then `fan2` over `(size-1-t) × (size-t)` items, eliminating column
//! `t` below the pivot and updating the right-hand side. Back substitution stays on the host, as
//! in Rodinia. Index arithmetic follows Rodinia's OpenCL kernels.

use std::borrow::Cow;

use crate::{CpuImpl, SizeCheck};
use std::ops::Range;

use agora_protocol::{Access::*, ScalarType::*, TaskError};

use crate::{buffer, opencl, programs::GAUSSIAN, scalar, Cost, KernelCall, KernelDef, LaunchShape};

/// Checks `size` (argument `size_index`) and `t` (the next argument): `size ≥ 1`, `0 ≤ t < size-1`.
fn check_size_and_step(s: &LaunchShape<'_>, size_index: usize) -> Result<u64, TaskError> {
    let size = s.i32(size_index);
    let t = s.i32(size_index + 1);
    if !(2..=(1 << 20)).contains(&size) {
        return Err(TaskError::InvalidScalar {
            index: size_index as u16,
            value: i64::from(size),
        });
    }
    if t < 0 || t >= size - 1 {
        return Err(TaskError::InvalidScalar {
            index: size_index as u16 + 1,
            value: i64::from(t),
        });
    }
    Ok(size as u64)
}

fn fan1_check(s: &LaunchShape<'_>) -> Result<(), TaskError> {
    let size = check_size_and_step(s, 2)?;
    s.need(0, size * size, 4)?;
    s.need(1, size * size, 4)
}

fn fan1_cpu(call: &KernelCall<'_>, rows: Range<u64>) {
    let m = call.output::<f32>(0);
    let a = call.input::<f32>(1);
    let size = call.i32(2) as usize;
    let t = call.i32(3) as usize;
    let pivot = a[size * t + t];
    let live = (size - 1 - t) as u64;
    for x in rows.start.min(live)..rows.end.min(live) {
        let r = x as usize + t + 1;
        m.set(size * r + t, a[size * r + t] / pivot);
    }
}

/// `gaussian.fan1(m, a, size, t)`: multipliers of column `t`.
pub const FAN1: KernelDef = KernelDef {
    cuda: None,
    name: Cow::Borrowed("gaussian.fan1"),
    doc: Cow::Borrowed("m[(t+1+i)*size+t] = a[(t+1+i)*size+t] / a[t*size+t] for i < size-1-t; range size-1-t"),
    params: Cow::Borrowed(&[
        buffer("m", F32, ReadWrite),
        buffer("a", F32, Read),
        scalar("size", I32),
        scalar("t", I32),
    ]),
    // Strided: one cache miss per row.
    cost: Cost::PerItemNs(10.0),
    chunkable: true,
    check: SizeCheck::Builtin(fan1_check),
    cpu: Some(CpuImpl::Builtin(fan1_cpu)),
    opencl: opencl("gaussian", GAUSSIAN, "fan1"),
};

fn fan2_check(s: &LaunchShape<'_>) -> Result<(), TaskError> {
    let size = check_size_and_step(s, 3)?;
    s.need(0, size * size, 4)?;
    s.need(1, size * size, 4)?;
    s.need(2, size, 4)
}

fn fan2_cpu(call: &KernelCall<'_>, rows: Range<u64>) {
    let m = call.input::<f32>(0);
    let a = call.output::<f32>(1);
    let b = call.output::<f32>(2);
    let size = call.i32(3) as usize;
    let t = call.i32(4) as usize;
    let live_rows = (size - 1 - t) as u64;
    let cols = (size - t).min(call.range()[1] as usize);
    // SAFETY: row t of `a` is read by every thread and written by none (rows written are > t).
    let pivot_row = unsafe { a.row(size * t + t..size * t + t + cols) };
    let b_t = b.get(t);
    for x in rows.start.min(live_rows)..rows.end.min(live_rows) {
        let r = x as usize + 1 + t;
        let multiplier = m[size * r + t];
        // SAFETY: row r belongs to this thread alone (rows are split disjointly) and r > t, so it
        // does not overlap `pivot_row`.
        let row = unsafe { a.row_mut(size * r + t..size * r + t + cols) };
        for (value, pivot) in row.iter_mut().zip(pivot_row) {
            *value -= multiplier * pivot;
        }
        if cols > 0 {
            b.set(r, b.get(r) - multiplier * b_t);
        }
    }
}

/// `gaussian.fan2(m, a, b, size, t)`: eliminate column `t` below the pivot.
pub const FAN2: KernelDef = KernelDef {
    cuda: None,
    name: Cow::Borrowed("gaussian.fan2"),
    doc: Cow::Borrowed(
        "a[(t+1+i)*size+t+j] -= m[(t+1+i)*size+t]*a[t*size+t+j], b[t+1+i] -= m[..]*b[t]; range (size-1-t, size-t)",
    ),
    params: Cow::Borrowed(&[
        buffer("m", F32, Read),
        buffer("a", F32, ReadWrite),
        buffer("b", F32, ReadWrite),
        scalar("size", I32),
        scalar("t", I32),
    ]),
    cost: Cost::PerItemNs(0.5),
    chunkable: true,
    check: SizeCheck::Builtin(fan2_check),
    cpu: Some(CpuImpl::Builtin(fan2_cpu)),
    opencl: opencl("gaussian", GAUSSIAN, "fan2"),
};

/// Host reference and helpers shared by applications and tests.
pub mod reference {
    /// Rodinia's test matrix: `a[i][j] = 10·exp(-0.01·|i-j|)`-like banded values, `b = 1`.
    pub fn matrix(size: usize) -> (Vec<f32>, Vec<f32>) {
        let lambda = -0.01f64;
        let coe: Vec<f64> = (0..2 * size - 1)
            .map(|i| 10.0 * (lambda * (i as f64 - (size as f64 - 1.0)).abs()).exp())
            .collect();
        let mut a = vec![0f32; size * size];
        for i in 0..size {
            for j in 0..size {
                a[i * size + j] = coe[size - 1 - i + j] as f32;
            }
        }
        (a, vec![1.0; size])
    }

    /// What one `gaussian.fan1` launch computes: the multipliers of column `t`.
    pub fn fan1(a: &[f32], m: &mut [f32], size: usize, t: usize) {
        for r in t + 1..size {
            m[size * r + t] = a[size * r + t] / a[size * t + t];
        }
    }

    /// What one `gaussian.fan2` launch computes: eliminates column `t` below the pivot.
    pub fn fan2(a: &mut [f32], b: &mut [f32], m: &[f32], size: usize, t: usize) {
        for r in t + 1..size {
            let mult = m[size * r + t];
            for c in t..size {
                a[size * r + c] -= mult * a[size * t + c];
            }
            b[r] -= mult * b[t];
        }
    }

    /// Forward elimination on the host, the same arithmetic as fan1 + fan2.
    pub fn forward(a: &mut [f32], b: &mut [f32], m: &mut [f32], size: usize) {
        for t in 0..size - 1 {
            fan1(a, m, size, t);
            fan2(a, b, m, size, t);
        }
    }

    /// Back substitution (host side in Rodinia too).
    pub fn back_substitute(a: &[f32], b: &[f32], size: usize) -> Vec<f32> {
        let mut x = vec![0f32; size];
        for i in (0..size).rev() {
            let mut sum = b[i];
            for j in i + 1..size {
                sum -= a[size * i + j] * x[j];
            }
            x[i] = sum / a[size * i + i];
        }
        x
    }
}

#[cfg(test)]
mod tests {
    use agora_protocol::{RawArg, TaskError};

    use super::reference;
    use crate::call::run_on_host;
    use crate::find;

    #[test]
    fn fan1_fan2_match_host_reference() {
        let size = 67usize;
        let (mut a, mut b) = reference::matrix(size);
        let mut m = vec![0f32; size * size];
        let (mut ra, mut rb, mut rm) = (a.clone(), b.clone(), m.clone());
        reference::forward(&mut ra, &mut rb, &mut rm, size);
        let (_, fan1) = find("gaussian.fan1").unwrap();
        let (_, fan2) = find("gaussian.fan2").unwrap();
        for t in 0..size - 1 {
            let s = size as i32;
            let rows = (size - 1 - t) as u64;
            run_on_host(
                fan1,
                &[rows],
                &[
                    RawArg::buffer(0),
                    RawArg::buffer(1),
                    RawArg::i32(s),
                    RawArg::i32(t as i32),
                ],
                &mut [bytemuck::cast_slice_mut(&mut m), bytemuck::cast_slice_mut(&mut a)],
                2,
            )
            .unwrap();
            run_on_host(
                fan2,
                &[rows, (size - t) as u64],
                &[
                    RawArg::buffer(0),
                    RawArg::buffer(1),
                    RawArg::buffer(2),
                    RawArg::i32(s),
                    RawArg::i32(t as i32),
                ],
                &mut [
                    bytemuck::cast_slice_mut(&mut m),
                    bytemuck::cast_slice_mut(&mut a),
                    bytemuck::cast_slice_mut(&mut b),
                ],
                3,
            )
            .unwrap();
        }
        assert_eq!(a, ra);
        assert_eq!(b, rb);
        let x = reference::back_substitute(&a, &b, size);
        // A x = b for the original system.
        let (a0, b0) = reference::matrix(size);
        for i in 0..size {
            let lhs: f64 = (0..size).map(|j| f64::from(a0[i * size + j]) * f64::from(x[j])).sum();
            assert!((lhs - f64::from(b0[i])).abs() < 1e-3, "row {i}: {lhs}");
        }
    }

    #[test]
    fn bad_scalars_and_sizes_are_named() {
        let (_, fan1) = find("gaussian.fan1").unwrap();
        let mut m = vec![0f32; 16];
        let mut a = vec![0f32; 16];
        let err = run_on_host(
            fan1,
            &[3],
            &[RawArg::buffer(0), RawArg::buffer(1), RawArg::i32(4), RawArg::i32(3)],
            &mut [bytemuck::cast_slice_mut(&mut m), bytemuck::cast_slice_mut(&mut a)],
            1,
        )
        .unwrap_err();
        assert_eq!(err, TaskError::InvalidScalar { index: 3, value: 3 });
        let err = run_on_host(
            fan1,
            &[3],
            &[RawArg::buffer(0), RawArg::buffer(1), RawArg::i32(5), RawArg::i32(0)],
            &mut [bytemuck::cast_slice_mut(&mut m), bytemuck::cast_slice_mut(&mut a)],
            1,
        )
        .unwrap_err();
        assert_eq!(
            err,
            TaskError::BufferTooSmall {
                index: 0,
                needed: 100,
                len: 64
            }
        );
    }
}
