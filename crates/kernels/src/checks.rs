//! Helpers for the size checks: ranges, scalar limits and overflow-free element counts.
//!
//! Every count a check accepts fits in an OpenCL `int` (at most `i32::MAX` elements), so the
//! OpenCL kernels may index with `int` and the CPU implementations with `usize` without
//! overflowing.

use agora_protocol::TaskError;

use crate::LaunchShape;

/// The most elements any buffer or index space of a kernel may have.
pub(crate) const MAX_ELEMENTS: u64 = i32::MAX as u64;

/// The launch's range padded with 1s to three dimensions.
pub(crate) fn range3(s: &LaunchShape<'_>) -> [u64; 3] {
    let mut r = [1u64; 3];
    for (d, extent) in s.range.iter().take(3).enumerate() {
        r[d] = *extent;
    }
    r
}

/// Refuses a launch whose range (padded with 1s) is not `expected` (at most two dimensions,
/// each at most [`MAX_ELEMENTS`]) with `RangeMismatch`, which states the range it must have.
pub(crate) fn exact_range(s: &LaunchShape<'_>, expected: [u64; 3]) -> Result<(), TaskError> {
    debug_assert!(expected[2] == 1 && expected[..2].iter().all(|e| *e <= MAX_ELEMENTS));
    let got = range3(s);
    if got == expected {
        return Ok(());
    }
    let narrow = |v: u64| u32::try_from(v).unwrap_or(u32::MAX);
    Err(TaskError::RangeMismatch {
        expected_x: narrow(expected[0]),
        expected_y: narrow(expected[1]),
        got_x: narrow(got[0]),
        got_y: narrow(got[1]),
        got_z: u16::try_from(got[2]).unwrap_or(u16::MAX),
    })
}

/// Scalar `index` as an `i32` that must lie in `lo..=hi` (with `lo ≥ 0`), returned as `u64`.
pub(crate) fn int_in(s: &LaunchShape<'_>, index: usize, lo: i32, hi: i32) -> Result<u64, TaskError> {
    let v = s.i32(index);
    if v < lo || v > hi {
        return Err(TaskError::InvalidScalar {
            index: index as u16,
            value: i64::from(v),
        });
    }
    Ok(v as u64)
}

/// The product of `factors` if it is at most [`MAX_ELEMENTS`]; otherwise blames scalar `index`.
pub(crate) fn count(s: &LaunchShape<'_>, index: usize, factors: &[u64]) -> Result<u64, TaskError> {
    factors
        .iter()
        .try_fold(1u64, |a, b| a.checked_mul(*b))
        .filter(|n| *n <= MAX_ELEMENTS)
        .ok_or(TaskError::InvalidScalar {
            index: index as u16,
            value: i64::from(s.i32(index)),
        })
}
