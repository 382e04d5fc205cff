//! Single-precision matrix multiply (`sgemm`): `C = alpha·A·B + beta·C`, row-major.
//!
//! The OpenCL implementation is tiled (16 × 16 tiles in local memory) and requires the
//! work-group size (16, 16, 1); the CPU implementation works on rows of C. Both sum each element
//! over `p = 0..k` in order.

use std::borrow::Cow;

use crate::{CpuImpl, SizeCheck};
use std::ops::Range;

use agora_protocol::{Access::*, ScalarType::*, TaskError};

use crate::checks::{count, exact_range, int_in};
use crate::{buffer, programs, scalar, Cost, KernelCall, KernelDef, LaunchShape, OpenClImpl};

/// Tile edge of the OpenCL implementation (`TILE` in the `.cl`).
pub const TILE: usize = 16;

fn sgemm_check(s: &LaunchShape<'_>) -> Result<(), TaskError> {
    // Each dimension at most 2^30, so the OpenCL tile loop (`t + 16`) cannot overflow an int.
    let m = int_in(s, 0, 1, 1 << 30)?;
    let n = int_in(s, 1, 1, 1 << 30)?;
    let k = int_in(s, 2, 0, 1 << 30)?;
    let mn = count(s, 1, &[m, n])?;
    let mk = count(s, 2, &[m, k])?;
    let kn = count(s, 2, &[k, n])?;
    exact_range(s, [m, n, 1])?;
    s.need(4, mk, 4)?;
    s.need(5, kn, 4)?;
    s.need(7, mn, 4)?;
    // With beta = 0 no implementation reads C (BLAS's rule): C = alpha·A·B replaces it.
    if s.f32(6) == 0.0 {
        s.overwrite(7);
    }
    Ok(())
}

fn sgemm_cpu(call: &KernelCall<'_>, rows: Range<u64>) {
    let n = call.i32(1) as usize;
    let k = call.i32(2) as usize;
    let alpha = call.f32(3);
    let a = call.input::<f32>(4);
    let b = call.input::<f32>(5);
    let beta = call.f32(6);
    let c = call.output::<f32>(7);
    let mut acc = vec![0f32; n];
    for i in rows.start as usize..rows.end as usize {
        acc.fill(0.0);
        for (p, aip) in a[i * k..(i + 1) * k].iter().enumerate() {
            for (s, bpj) in acc.iter_mut().zip(&b[p * n..(p + 1) * n]) {
                *s += aip * bpj;
            }
        }
        // SAFETY: row i of C belongs to this thread alone (rows are split disjointly), and C
        // shares no memory with A or B (the daemon refuses a written buffer passed twice).
        let out = unsafe { c.row_mut(i * n..(i + 1) * n) };
        for (cij, s) in out.iter_mut().zip(&acc) {
            *cij = if beta == 0.0 {
                alpha * s
            } else {
                alpha * s + beta * *cij
            };
        }
    }
}

/// `sgemm(m, n, k, alpha, a, b, beta, c)`.
pub const SGEMM: KernelDef = KernelDef {
    cuda: None,
    name: Cow::Borrowed("sgemm"),
    doc: Cow::Borrowed(
        "C = alpha*A*B + beta*C (C not read when beta = 0), row-major, A m x k, B k x n, C m x n; range (m, n); \
          OpenCL: 16x16 tiles, work-group (16, 16)",
    ),
    params: Cow::Borrowed(&[
        scalar("m", I32),
        scalar("n", I32),
        scalar("k", I32),
        scalar("alpha", F32),
        buffer("a", F32, Read),
        buffer("b", F32, Read),
        scalar("beta", F32),
        buffer("c", F32, ReadWrite),
    ]),
    // Per element of C: k multiply-adds, about 0.12 ns each (measured with k = 1024).
    cost: Cost::PerItemNs(120.0),
    chunkable: true,
    check: SizeCheck::Builtin(sgemm_check),
    cpu: Some(CpuImpl::Builtin(sgemm_cpu)),
    opencl: Some(OpenClImpl {
        program: Cow::Borrowed("sgemm"),
        source: Cow::Borrowed(programs::SGEMM),
        entry: Cow::Borrowed("sgemm"),
        local: Some([TILE, TILE, 1]),
        binaries: Cow::Borrowed(&[]),
    }),
};

/// Host reference and input generator.
pub mod reference {
    use crate::rng::Rng;

    /// A random `rows × cols` matrix with entries in `[-1, 1)`.
    pub fn matrix(rows: usize, cols: usize, seed: u64) -> Vec<f32> {
        let mut rng = Rng::new(seed);
        (0..rows * cols).map(|_| rng.range(-1.0, 1.0)).collect()
    }

    /// `C = alpha·A·B + beta·C` (`C` not read when `beta = 0`), each element summed over `p` in order.
    #[allow(clippy::too_many_arguments)]
    pub fn sgemm(m: usize, n: usize, k: usize, alpha: f32, a: &[f32], b: &[f32], beta: f32, c: &mut [f32]) {
        let mut acc = vec![0f32; n];
        for i in 0..m {
            acc.fill(0.0);
            for p in 0..k {
                let aip = a[i * k + p];
                for j in 0..n {
                    acc[j] += aip * b[p * n + j];
                }
            }
            for j in 0..n {
                let cij = &mut c[i * n + j];
                *cij = if beta == 0.0 {
                    alpha * acc[j]
                } else {
                    alpha * acc[j] + beta * *cij
                };
            }
        }
    }
}
