//! The conjugate-gradient building blocks of the HPCCG mini-app, in single precision:
//! `hpccg.spmv` (CSR sparse matrix-vector product), `hpccg.dot` (dot product as blocked partial
//! sums, no atomics) and `hpccg.waxpby` (`w = alpha·x + beta·y`).
//!
//! A dot product over `n` elements launches `hpccg.dot` over `ceil(n / DOT_BLOCK)` work items and
//! adds the partial sums in order on the host ([`reference::dot`] is the same sum). The CSR index
//! arrays are data the size check cannot see, so both implementations sanitise them: row bounds
//! are clamped to `0..=nnz` and entries with a column outside `0..ncols` are skipped.

use std::borrow::Cow;

use crate::{CpuImpl, SizeCheck};
use std::ops::Range;

use agora_protocol::{Access::*, ScalarType::*, TaskError};

use crate::checks::{exact_range, int_in, range3, MAX_ELEMENTS};
use crate::{buffer, opencl, programs::HPCCG, scalar, Cost, KernelCall, KernelDef, LaunchShape};

/// Elements per partial sum of `hpccg.dot` (`DOT_BLOCK` in the `.cl`).
pub const DOT_BLOCK: usize = 1024;

fn spmv_check(s: &LaunchShape<'_>) -> Result<(), TaskError> {
    let ncols = int_in(s, 5, 0, i32::MAX)?;
    let nnz = int_in(s, 6, 0, i32::MAX)?;
    let rows = range3(s)[0].min(MAX_ELEMENTS);
    exact_range(s, [rows, 1, 1])?;
    s.need(0, rows + 1, 4)?;
    s.need(1, nnz, 4)?;
    s.need(2, nnz, 4)?;
    s.need(3, ncols, 4)?;
    s.need(4, rows, 4)
}

/// The sanitised entries of row `r`: `(value, column)` pairs.
fn row_entries<'a>(
    row_ptr: &[i32],
    cols: &'a [i32],
    vals: &'a [f32],
    ncols: i32,
    nnz: i32,
    r: usize,
) -> impl Iterator<Item = (f32, usize)> + 'a {
    let start = row_ptr[r].clamp(0, nnz);
    let end = row_ptr[r + 1].clamp(start, nnz);
    let (start, end) = (start as usize, end as usize);
    cols[start..end]
        .iter()
        .zip(&vals[start..end])
        .filter(move |(c, _)| (0..ncols).contains(*c))
        .map(|(c, v)| (*v, *c as usize))
}

fn spmv_cpu(call: &KernelCall<'_>, rows: Range<u64>) {
    let row_ptr = call.input::<i32>(0);
    let cols = call.input::<i32>(1);
    let vals = call.input::<f32>(2);
    let x = call.input::<f32>(3);
    let (ncols, nnz) = (call.i32(5), call.i32(6));
    let (start, end) = (rows.start as usize, rows.end as usize);
    // SAFETY: rows start..end of `y` belong to this thread alone, and `y` shares no memory with
    // the inputs (the daemon refuses a written buffer passed twice).
    let y = unsafe { call.output::<f32>(4).row_mut(start..end) };
    for (r, yr) in (start..end).zip(y) {
        let mut sum = 0f32;
        for (v, c) in row_entries(row_ptr, cols, vals, ncols, nnz, r) {
            sum += v * x[c];
        }
        *yr = sum;
    }
}

/// `hpccg.spmv(row_ptr, cols, vals, x, y, ncols, nnz)`.
pub const SPMV: KernelDef = KernelDef {
    cuda: None,
    name: Cow::Borrowed("hpccg.spmv"),
    doc: Cow::Borrowed(
        "CSR y = A*x: y[r] = sum of vals[k]*x[cols[k]] for k in row_ptr[r]..row_ptr[r+1] (bounds clamped to \
          0..=nnz, columns outside 0..ncols skipped); range rows",
    ),
    params: Cow::Borrowed(&[
        buffer("row_ptr", I32, Read),
        buffer("cols", I32, Read),
        buffer("vals", F32, Read),
        buffer("x", F32, Read),
        buffer("y", F32, Write),
        scalar("ncols", I32),
        scalar("nnz", I32),
    ]),
    // A 27-point stencil row: 27 multiply-adds with an indirect load each.
    cost: Cost::PerItemNs(35.0),
    chunkable: true,
    check: SizeCheck::Builtin(spmv_check),
    cpu: Some(CpuImpl::Builtin(spmv_cpu)),
    opencl: opencl("hpccg", HPCCG, "spmv"),
};

fn dot_check(s: &LaunchShape<'_>) -> Result<(), TaskError> {
    let n = int_in(s, 0, 1, i32::MAX)?;
    let blocks = n.div_ceil(DOT_BLOCK as u64);
    exact_range(s, [blocks, 1, 1])?;
    s.need(1, n, 4)?;
    s.need(2, n, 4)?;
    s.need(3, blocks, 4)
}

fn dot_cpu(call: &KernelCall<'_>, rows: Range<u64>) {
    let n = call.i32(0) as usize;
    let x = call.input::<f32>(1);
    let y = call.input::<f32>(2);
    let (start, end) = (rows.start as usize, rows.end as usize);
    // SAFETY: partial sums start..end belong to this thread alone, and `partial` shares no
    // memory with `x` or `y`.
    let partial = unsafe { call.output::<f32>(3).row_mut(start..end) };
    for (b, p) in (start..end).zip(partial) {
        let block = b * DOT_BLOCK..((b + 1) * DOT_BLOCK).min(n);
        let mut sum = 0f32;
        for (xi, yi) in x[block.clone()].iter().zip(&y[block]) {
            sum += xi * yi;
        }
        *p = sum;
    }
}

/// `hpccg.dot(n, x, y, partial)`.
pub const DOT: KernelDef = KernelDef {
    cuda: None,
    name: Cow::Borrowed("hpccg.dot"),
    doc: Cow::Borrowed(
        "partial[b] = sum of x[i]*y[i] over i in b*1024..min(n, (b+1)*1024), in order (the host adds the \
          partials in order); range ceil(n/1024)",
    ),
    params: Cow::Borrowed(&[
        scalar("n", I32),
        buffer("x", F32, Read),
        buffer("y", F32, Read),
        buffer("partial", F32, Write),
    ]),
    cost: Cost::PerItemNs(1_000.0),
    chunkable: true,
    check: SizeCheck::Builtin(dot_check),
    cpu: Some(CpuImpl::Builtin(dot_cpu)),
    opencl: opencl("hpccg", HPCCG, "dot_partials"),
};

fn waxpby_check(s: &LaunchShape<'_>) -> Result<(), TaskError> {
    s.need(1, s.items(), 4)?;
    s.need(3, s.items(), 4)?;
    s.need(4, s.items(), 4)
}

fn waxpby_cpu(call: &KernelCall<'_>, rows: Range<u64>) {
    let (alpha, beta) = (call.f32(0), call.f32(2));
    let items = call.items(rows);
    let x = &call.input::<f32>(1)[items.clone()];
    let y = &call.input::<f32>(3)[items.clone()];
    // SAFETY: this thread alone writes `items`, and `w` shares no memory with `x` or `y`.
    let w = unsafe { call.output::<f32>(4).row_mut(items) };
    for ((wi, xi), yi) in w.iter_mut().zip(x).zip(y) {
        *wi = alpha * xi + beta * yi;
    }
}

/// `hpccg.waxpby(alpha, x, beta, y, w)`.
pub const WAXPBY: KernelDef = KernelDef {
    cuda: None,
    name: Cow::Borrowed("hpccg.waxpby"),
    doc: Cow::Borrowed("w[i] = alpha*x[i] + beta*y[i] (w must not be x or y); range n"),
    params: Cow::Borrowed(&[
        scalar("alpha", F32),
        buffer("x", F32, Read),
        scalar("beta", F32),
        buffer("y", F32, Read),
        buffer("w", F32, Write),
    ]),
    cost: Cost::PerItemNs(0.4),
    chunkable: true,
    check: SizeCheck::Builtin(waxpby_check),
    cpu: Some(CpuImpl::Builtin(waxpby_cpu)),
    opencl: opencl("hpccg", HPCCG, "waxpby"),
};

/// Host reference, HPCCG's problem generator and its conjugate-gradient solver.
pub mod reference {
    use super::DOT_BLOCK;

    /// A sparse matrix in compressed sparse row form.
    #[derive(Debug, Clone, PartialEq)]
    pub struct Csr {
        /// Rows (and columns: the matrix is square).
        pub rows: usize,
        /// `rows + 1` offsets into `cols` and `vals`.
        pub row_ptr: Vec<i32>,
        /// Column of each stored entry.
        pub cols: Vec<i32>,
        /// Value of each stored entry.
        pub vals: Vec<f32>,
    }

    /// HPCCG's problem on an `nx × ny × nz` grid: the 27-point stencil matrix (27 on the
    /// diagonal, -1 for each neighbour inside the grid), the right-hand side `b` for which the
    /// exact solution is all ones, and that solution.
    pub fn problem(nx: usize, ny: usize, nz: usize) -> (Csr, Vec<f32>, Vec<f32>) {
        let rows = nx * ny * nz;
        let mut row_ptr = Vec::with_capacity(rows + 1);
        let mut cols = Vec::with_capacity(rows * 27);
        let mut vals = Vec::with_capacity(rows * 27);
        let mut b = Vec::with_capacity(rows);
        row_ptr.push(0);
        for iz in 0..nz as i64 {
            for iy in 0..ny as i64 {
                for ix in 0..nx as i64 {
                    let row = (iz * ny as i64 + iy) * nx as i64 + ix;
                    let mut in_row = 0;
                    for sz in -1..=1i64 {
                        for sy in -1..=1i64 {
                            for sx in -1..=1i64 {
                                let (x, y, z) = (ix + sx, iy + sy, iz + sz);
                                if x < 0 || y < 0 || z < 0 || x >= nx as i64 || y >= ny as i64 || z >= nz as i64 {
                                    continue;
                                }
                                let col = (z * ny as i64 + y) * nx as i64 + x;
                                cols.push(col as i32);
                                vals.push(if col == row { 27.0 } else { -1.0 });
                                in_row += 1;
                            }
                        }
                    }
                    row_ptr.push(cols.len() as i32);
                    b.push(27.0 - (in_row - 1) as f32);
                }
            }
        }
        (
            Csr {
                rows,
                row_ptr,
                cols,
                vals,
            },
            b,
            vec![1.0; rows],
        )
    }

    /// What `hpccg.spmv` computes: `y = A·x` (with the same sanitising of the index arrays).
    pub fn spmv(a: &Csr, x: &[f32], y: &mut [f32]) {
        let (ncols, nnz) = (x.len() as i32, a.cols.len() as i32);
        for (r, yr) in y.iter_mut().enumerate().take(a.rows) {
            let start = a.row_ptr[r].clamp(0, nnz);
            let end = a.row_ptr[r + 1].clamp(start, nnz);
            let mut sum = 0f32;
            for k in start as usize..end as usize {
                let c = a.cols[k];
                if (0..ncols).contains(&c) {
                    sum += a.vals[k] * x[c as usize];
                }
            }
            *yr = sum;
        }
    }

    /// What `hpccg.dot` computes: the partial sums over blocks of [`DOT_BLOCK`] elements.
    pub fn dot_partials(x: &[f32], y: &[f32]) -> Vec<f32> {
        x.chunks(DOT_BLOCK)
            .zip(y.chunks(DOT_BLOCK))
            .map(|(xs, ys)| {
                let mut sum = 0f32;
                for (a, b) in xs.iter().zip(ys) {
                    sum += a * b;
                }
                sum
            })
            .collect()
    }

    /// The dot product as the device computes it: partial sums added in order.
    pub fn dot(x: &[f32], y: &[f32]) -> f32 {
        let mut sum = 0f32;
        for p in dot_partials(x, y) {
            sum += p;
        }
        sum
    }

    /// What `hpccg.waxpby` computes: `w = alpha·x + beta·y`.
    pub fn waxpby(alpha: f32, x: &[f32], beta: f32, y: &[f32], w: &mut [f32]) {
        for ((wi, xi), yi) in w.iter_mut().zip(x).zip(y) {
            *wi = alpha * xi + beta * yi;
        }
    }

    /// HPCCG's conjugate-gradient solver from `x`, built from the three kernels' arithmetic:
    /// iterations `1..max_iter` (as HPCCG counts them), stopping once the residual norm is at
    /// most `tolerance`.
    /// Returns the iterations run and the final residual norm.
    pub fn cg(a: &Csr, b: &[f32], x: &mut [f32], max_iter: usize, tolerance: f32) -> (usize, f32) {
        let n = a.rows;
        let (mut r, mut p, mut ap, mut tmp) = (vec![0f32; n], vec![0f32; n], vec![0f32; n], vec![0f32; n]);
        waxpby(1.0, x, 0.0, x, &mut p);
        spmv(a, &p, &mut ap);
        waxpby(1.0, b, -1.0, &ap, &mut r);
        let mut rtrans = dot(&r, &r);
        let mut normr = rtrans.sqrt();
        let mut k = 1;
        while k < max_iter && normr > tolerance {
            if k == 1 {
                waxpby(1.0, &r, 0.0, &r, &mut p);
            } else {
                let old = rtrans;
                rtrans = dot(&r, &r);
                let beta = rtrans / old;
                waxpby(1.0, &r, beta, &p, &mut tmp);
                std::mem::swap(&mut p, &mut tmp);
            }
            normr = rtrans.sqrt();
            spmv(a, &p, &mut ap);
            let alpha = rtrans / dot(&p, &ap);
            waxpby(1.0, x, alpha, &p, &mut tmp);
            x.copy_from_slice(&tmp);
            waxpby(1.0, &r, -alpha, &ap, &mut tmp);
            std::mem::swap(&mut r, &mut tmp);
            k += 1;
        }
        (k - 1, normr)
    }
}

#[cfg(test)]
mod tests {
    use super::reference;

    #[test]
    fn the_problem_is_consistent_and_cg_solves_it() {
        let (a, b, exact) = reference::problem(6, 5, 4);
        assert_eq!(a.rows, 120);
        assert_eq!(*a.row_ptr.last().unwrap() as usize, a.cols.len());
        // Interior rows have 27 entries: (x, y, z) = (1, 1, 1) is row (1·5 + 1)·6 + 1 = 37.
        assert_eq!(a.row_ptr[38] - a.row_ptr[37], 27);
        assert_eq!(a.row_ptr[1] - a.row_ptr[0], 8, "a corner has 8");
        let mut ax = vec![0f32; a.rows];
        reference::spmv(&a, &exact, &mut ax);
        assert_eq!(ax, b, "b = A * ones");
        let mut x = vec![0f32; a.rows];
        let (iterations, normr) = reference::cg(&a, &b, &mut x, 150, 1e-5);
        assert!(
            iterations < 150 && normr <= 1e-5,
            "{iterations} iterations, residual {normr}"
        );
        assert!(x.iter().all(|v| (v - 1.0).abs() < 1e-4));
    }
}
