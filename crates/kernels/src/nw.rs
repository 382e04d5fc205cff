//! Rodinia's Needleman-Wunsch global sequence alignment (`nw.diagonal`).
//!
//! The score matrix has `(n+1) × (n+1)` cells for two sequences of length `n`; row 0 and
//! column 0 hold the gap penalties `-i·penalty`, and `reference[i][j]` is the BLOSUM62 score of
//! the pair `(a[i], b[j])`. The interior is cut into `block × block` blocks (the last row and
//! column of blocks may be partial); one launch computes every block of one diagonal of blocks,
//! which depend only on earlier diagonals, so its work items are independent. The host launches
//! diagonals `0..2·blocks-1` in order and traces the alignment back on the host, as Rodinia does.
//! With `block = 1` one launch is one anti-diagonal of cells.

use std::borrow::Cow;

use crate::{CpuImpl, SizeCheck};
use std::ops::Range;

use agora_protocol::{Access::*, ScalarType::*, TaskError};

use crate::checks::{count, exact_range, int_in};
use crate::{buffer, opencl, programs::NW, scalar, Cost, KernelCall, KernelDef, LaunchShape};

/// Largest `n`: the matrix's `(n+1)²` cells must fit in an OpenCL `int`.
const MAX_N: i32 = 46_339;

fn diagonal_check(s: &LaunchShape<'_>) -> Result<(), TaskError> {
    let n = int_in(s, 2, 1, MAX_N)?;
    int_in(s, 3, 0, i32::MAX)?;
    let block = int_in(s, 5, 1, 1 << 16)?;
    let blocks = n.div_ceil(block);
    let diag = int_in(s, 4, 0, (2 * blocks - 2) as i32)?;
    let cells = count(s, 2, &[n + 1, n + 1])?;
    let span = reference::diagonal_blocks(n as usize, block as usize, diag as usize);
    exact_range(s, [span.len() as u64, 1, 1])?;
    s.need(0, cells, 4)?;
    s.need(1, cells, 4)
}

fn diagonal_cpu(call: &KernelCall<'_>, rows: Range<u64>) {
    let score = call.output::<i32>(0);
    let reference = call.input::<i32>(1);
    let n = call.i32(2) as usize;
    let penalty = call.i32(3);
    let diag = call.i32(4) as usize;
    let block = call.i32(5) as usize;
    let span = reference::diagonal_blocks(n, block, diag);
    let cols = n + 1;
    for x in rows {
        let bi = span.start + x as usize;
        if bi >= span.end {
            break;
        }
        let bj = diag - bi;
        // Each block writes only its own cells and reads cells of earlier diagonals (not written
        // by this launch) or of itself, so the bounds-checked element accesses never race.
        let (c0, c1) = (bj * block + 1, (bj * block + 1 + block).min(n + 1));
        for r in bi * block + 1..(bi * block + 1 + block).min(n + 1) {
            // Walk the row keeping the left and upper-left neighbours in registers.
            let mut left = score.get(r * cols + c0 - 1);
            let mut up_left = score.get((r - 1) * cols + c0 - 1);
            for c in c0..c1 {
                let i = r * cols + c;
                let up = score.get(i - cols);
                let value = up_left
                    .wrapping_add(reference[i])
                    .max(left.wrapping_sub(penalty))
                    .max(up.wrapping_sub(penalty));
                score.set(i, value);
                left = value;
                up_left = up;
            }
        }
    }
}

/// `nw.diagonal(score, reference, n, penalty, diagonal, block)`.
pub const DIAGONAL: KernelDef = KernelDef {
    cuda: None,
    name: Cow::Borrowed("nw.diagonal"),
    doc: Cow::Borrowed(
        "Needleman-Wunsch: fills the blocks (bi, diagonal-bi) of block x block cells of the (n+1)^2 score \
          matrix, score[i][j] = max(score[i-1][j-1] + reference[i][j], score[i][j-1] - penalty, \
          score[i-1][j] - penalty); range = number of blocks on the diagonal",
    ),
    params: Cow::Borrowed(&[
        buffer("score", I32, ReadWrite),
        buffer("reference", I32, Read),
        scalar("n", I32),
        scalar("penalty", I32),
        scalar("diagonal", I32),
        scalar("block", I32),
    ]),
    // Per block: about 12 ns per cell, measured with block = 16 (256 cells).
    cost: Cost::PerItemNs(3_000.0),
    chunkable: true,
    check: SizeCheck::Builtin(diagonal_check),
    cpu: Some(CpuImpl::Builtin(diagonal_cpu)),
    opencl: opencl("nw", NW, "diagonal"),
};

/// Host reference and input generator.
pub mod reference {
    use std::ops::Range;

    use crate::rng::Rng;

    /// The BLOSUM62 substitution matrix (order `ARNDCQEGHILKMFPSTWYVBZX*`), as in Rodinia.
    #[rustfmt::skip]
    pub const BLOSUM62: [[i32; 24]; 24] = [
        [ 4, -1, -2, -2,  0, -1, -1,  0, -2, -1, -1, -1, -1, -2, -1,  1,  0, -3, -2,  0, -2, -1,  0, -4],
        [-1,  5,  0, -2, -3,  1,  0, -2,  0, -3, -2,  2, -1, -3, -2, -1, -1, -3, -2, -3, -1,  0, -1, -4],
        [-2,  0,  6,  1, -3,  0,  0,  0,  1, -3, -3,  0, -2, -3, -2,  1,  0, -4, -2, -3,  3,  0, -1, -4],
        [-2, -2,  1,  6, -3,  0,  2, -1, -1, -3, -4, -1, -3, -3, -1,  0, -1, -4, -3, -3,  4,  1, -1, -4],
        [ 0, -3, -3, -3,  9, -3, -4, -3, -3, -1, -1, -3, -1, -2, -3, -1, -1, -2, -2, -1, -3, -3, -2, -4],
        [-1,  1,  0,  0, -3,  5,  2, -2,  0, -3, -2,  1,  0, -3, -1,  0, -1, -2, -1, -2,  0,  3, -1, -4],
        [-1,  0,  0,  2, -4,  2,  5, -2,  0, -3, -3,  1, -2, -3, -1,  0, -1, -3, -2, -2,  1,  4, -1, -4],
        [ 0, -2,  0, -1, -3, -2, -2,  6, -2, -4, -4, -2, -3, -3, -2,  0, -2, -2, -3, -3, -1, -2, -1, -4],
        [-2,  0,  1, -1, -3,  0,  0, -2,  8, -3, -3, -1, -2, -1, -2, -1, -2, -2,  2, -3,  0,  0, -1, -4],
        [-1, -3, -3, -3, -1, -3, -3, -4, -3,  4,  2, -3,  1,  0, -3, -2, -1, -3, -1,  3, -3, -3, -1, -4],
        [-1, -2, -3, -4, -1, -2, -3, -4, -3,  2,  4, -2,  2,  0, -3, -2, -1, -2, -1,  1, -4, -3, -1, -4],
        [-1,  2,  0, -1, -3,  1,  1, -2, -1, -3, -2,  5, -1, -3, -1,  0, -1, -3, -2, -2,  0,  1, -1, -4],
        [-1, -1, -2, -3, -1,  0, -2, -3, -2,  1,  2, -1,  5,  0, -2, -1, -1, -1, -1,  1, -3, -1, -1, -4],
        [-2, -3, -3, -3, -2, -3, -3, -3, -1,  0,  0, -3,  0,  6, -4, -2, -2,  1,  3, -1, -3, -3, -1, -4],
        [-1, -2, -2, -1, -3, -1, -1, -2, -2, -3, -3, -1, -2, -4,  7, -1, -1, -4, -3, -2, -2, -1, -2, -4],
        [ 1, -1,  1,  0, -1,  0,  0,  0, -1, -2, -2,  0, -1, -2, -1,  4,  1, -3, -2, -2,  0,  0,  0, -4],
        [ 0, -1,  0, -1, -1, -1, -1, -2, -2, -1, -1, -1, -1, -2, -1,  1,  5, -2, -2,  0, -1, -1,  0, -4],
        [-3, -3, -4, -4, -2, -2, -3, -2, -2, -3, -2, -3, -1,  1, -4, -3, -2, 11,  2, -3, -4, -3, -2, -4],
        [-2, -2, -2, -3, -2, -1, -2, -3,  2, -1, -1, -2, -1,  3, -3, -2, -2,  2,  7, -1, -3, -2, -1, -4],
        [ 0, -3, -3, -3, -1, -2, -2, -3, -3,  3,  1, -2,  1, -1, -2, -2,  0, -3, -1,  4, -3, -2, -1, -4],
        [-2, -1,  3,  4, -3,  0,  1, -1,  0, -3, -4,  0, -3, -3, -2,  0, -1, -4, -3, -3,  4,  1, -1, -4],
        [-1,  0,  0,  1, -3,  3,  4, -2,  0, -3, -3,  1, -1, -3, -1,  0, -1, -3, -2, -2,  1,  4, -1, -4],
        [ 0, -1, -1, -1, -2, -1, -1, -1, -1, -1, -1, -1, -1, -1, -2,  0,  0, -2, -1, -1, -1, -1, -1, -4],
        [-4, -4, -4, -4, -4, -4, -4, -4, -4, -4, -4, -4, -4, -4, -4, -4, -4, -4, -4, -4, -4, -4, -4,  1],
    ];

    /// Rodinia's gap penalty.
    pub const PENALTY: i32 = 10;

    /// Rodinia's inputs for two random sequences of length `n` (residues 1 to 10): the initial
    /// score matrix (`(n+1)²` cells, row 0 and column 0 set to `-i·penalty`, the rest 0) and the
    /// reference matrix (`reference[i][j] = BLOSUM62[a[i]][b[j]]`, row 0 and column 0 unused).
    pub fn inputs(n: usize, penalty: i32, seed: u64) -> (Vec<i32>, Vec<i32>) {
        let mut rng = Rng::new(seed);
        let cols = n + 1;
        let a: Vec<usize> = (0..n).map(|_| rng.below(10) as usize + 1).collect();
        let b: Vec<usize> = (0..n).map(|_| rng.below(10) as usize + 1).collect();
        let mut reference = vec![0i32; cols * cols];
        for i in 1..cols {
            for j in 1..cols {
                reference[i * cols + j] = BLOSUM62[a[i - 1]][b[j - 1]];
            }
        }
        let mut score = vec![0i32; cols * cols];
        for i in 1..cols {
            score[i * cols] = -(i as i32) * penalty;
            score[i] = -(i as i32) * penalty;
        }
        (score, reference)
    }

    /// Blocks of `block × block` cells per side of the interior.
    pub fn blocks_per_side(n: usize, block: usize) -> usize {
        n.div_ceil(block)
    }

    /// The block rows `bi` on diagonal `diag` (whose blocks are `(bi, diag - bi)`); its length
    /// is the range of an `nw.diagonal` launch.
    pub fn diagonal_blocks(n: usize, block: usize, diag: usize) -> Range<usize> {
        let blocks = blocks_per_side(n, block);
        let first = (diag + 1).saturating_sub(blocks);
        let last = diag.min(blocks - 1);
        first..(last + 1).max(first)
    }

    fn cell(score: &mut [i32], reference: &[i32], cols: usize, penalty: i32, r: usize, c: usize) {
        let i = r * cols + c;
        let nw = score[i - cols - 1].wrapping_add(reference[i]);
        let w = score[i - 1].wrapping_sub(penalty);
        let up = score[i - cols].wrapping_sub(penalty);
        score[i] = nw.max(w).max(up);
    }

    /// What one `nw.diagonal` launch computes.
    pub fn diagonal(score: &mut [i32], reference: &[i32], n: usize, penalty: i32, diag: usize, block: usize) {
        let cols = n + 1;
        for bi in diagonal_blocks(n, block, diag) {
            let bj = diag - bi;
            for r in bi * block + 1..(bi * block + 1 + block).min(cols) {
                for c in bj * block + 1..(bj * block + 1 + block).min(cols) {
                    cell(score, reference, cols, penalty, r, c);
                }
            }
        }
    }

    /// The whole matrix, row by row (the same values as every diagonal in order).
    pub fn fill(score: &mut [i32], reference: &[i32], n: usize, penalty: i32) {
        let cols = n + 1;
        for r in 1..cols {
            for c in 1..cols {
                cell(score, reference, cols, penalty, r, c);
            }
        }
    }

    /// The alignment path from cell `(n, n)` back to `(0, 0)` through a filled matrix: at each
    /// cell the predecessor whose move produced its score (diagonal first, then left, then up).
    pub fn traceback(score: &[i32], reference: &[i32], n: usize, penalty: i32) -> Vec<(usize, usize)> {
        let cols = n + 1;
        let (mut i, mut j) = (n, n);
        let mut path = vec![(i, j)];
        while i > 0 || j > 0 {
            let here = score[i * cols + j];
            if i > 0 && j > 0 && here == score[(i - 1) * cols + j - 1].wrapping_add(reference[i * cols + j]) {
                i -= 1;
                j -= 1;
            } else if j > 0 && (i == 0 || here == score[i * cols + j - 1].wrapping_sub(penalty)) {
                j -= 1;
            } else {
                i -= 1;
            }
            path.push((i, j));
        }
        path
    }
}

#[cfg(test)]
mod tests {
    use agora_protocol::RawArg;

    use super::reference;
    use crate::{find, run_on_host};

    #[test]
    fn diagonal_launches_fill_the_whole_matrix() {
        for (n, block) in [(50usize, 7usize), (33, 1), (16, 16)] {
            let (mut score, reference) = reference::inputs(n, reference::PENALTY, 9);
            let mut want = score.clone();
            reference::fill(&mut want, &reference, n, reference::PENALTY);
            let mut refs = reference.clone();
            let (_, k) = find("nw.diagonal").unwrap();
            for diag in 0..2 * reference::blocks_per_side(n, block) - 1 {
                let count = reference::diagonal_blocks(n, block, diag).len() as u64;
                run_on_host(
                    k,
                    &[count],
                    &[
                        RawArg::buffer(0),
                        RawArg::buffer(1),
                        RawArg::i32(n as i32),
                        RawArg::i32(reference::PENALTY),
                        RawArg::i32(diag as i32),
                        RawArg::i32(block as i32),
                    ],
                    &mut [
                        bytemuck::cast_slice_mut(&mut score),
                        bytemuck::cast_slice_mut(&mut refs),
                    ],
                    2,
                )
                .unwrap();
            }
            assert_eq!(score, want, "n={n} block={block}");
            let path = reference::traceback(&score, &reference, n, reference::PENALTY);
            assert_eq!(path.first(), Some(&(n, n)));
            assert_eq!(path.last(), Some(&(0, 0)));
        }
    }
}
