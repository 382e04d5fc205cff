//! Rodinia's PathFinder (`pathfinder.row`): the cheapest path from the top row of a grid of
//! weights ("the wall") to the bottom, moving down, down-left or down-right.
//!
//! The host starts with `src = wall[0]`, launches one row `1..rows` at a time over the columns,
//! and ping-pongs `src` and `dst`; after the last row `src` holds the cheapest cost to reach each
//! column of the bottom row.

use std::borrow::Cow;

use crate::{CpuImpl, SizeCheck};
use std::ops::Range;

use agora_protocol::{Access::*, ScalarType::*, TaskError};

use crate::checks::{count, exact_range, int_in};
use crate::{buffer, opencl, programs::PATHFINDER, scalar, Cost, KernelCall, KernelDef, LaunchShape};

fn row_check(s: &LaunchShape<'_>) -> Result<(), TaskError> {
    let cols = int_in(s, 3, 1, i32::MAX)?;
    let row = int_in(s, 4, 0, i32::MAX - 1)?;
    let cells = count(s, 4, &[row + 1, cols])?;
    exact_range(s, [cols, 1, 1])?;
    s.need(0, cells, 4)?;
    s.need(1, cols, 4)?;
    s.need(2, cols, 4)
}

fn row_cpu(call: &KernelCall<'_>, rows: Range<u64>) {
    let wall = call.input::<i32>(0);
    let src = call.input::<i32>(1);
    let cols = call.i32(3) as usize;
    let row = call.i32(4) as usize;
    let (start, end) = (rows.start as usize, rows.end as usize);
    let weights = &wall[row * cols + start..row * cols + end];
    // SAFETY: this thread alone writes columns start..end of `dst` (its rows of the range), and
    // `dst` shares no memory with `src` or `wall` (the daemon refuses a written buffer passed twice).
    let out = unsafe { call.output::<i32>(2).row_mut(start..end) };
    for (k, (o, w)) in out.iter_mut().zip(weights).enumerate() {
        let c = start + k;
        let mut best = src[c];
        if c > 0 {
            best = best.min(src[c - 1]);
        }
        if c + 1 < cols {
            best = best.min(src[c + 1]);
        }
        *o = w.wrapping_add(best);
    }
}

/// `pathfinder.row(wall, src, dst, cols, row)`.
pub const ROW: KernelDef = KernelDef {
    name: Cow::Borrowed("pathfinder.row"),
    doc: Cow::Borrowed(
        "PathFinder step: dst[c] = wall[row*cols+c] + min(src[c-1], src[c], src[c+1]) (neighbours outside \
          0..cols ignored); range cols",
    ),
    params: Cow::Borrowed(&[
        buffer("wall", I32, Read),
        buffer("src", I32, Read),
        buffer("dst", I32, Write),
        scalar("cols", I32),
        scalar("row", I32),
    ]),
    cost: Cost::PerItemNs(1.5),
    chunkable: true,
    check: SizeCheck::Builtin(row_check),
    cpu: Some(CpuImpl::Builtin(row_cpu)),
    opencl: opencl("pathfinder", PATHFINDER, "row"),
};

/// Host reference and input generator.
pub mod reference {
    use crate::rng::Rng;

    /// Rodinia's wall: `rows × cols` random weights 0 to 9, row-major.
    pub fn wall(rows: usize, cols: usize, seed: u64) -> Vec<i32> {
        let mut rng = Rng::new(seed);
        (0..rows * cols).map(|_| rng.below(10) as i32).collect()
    }

    /// What one `pathfinder.row` launch computes.
    pub fn row(wall: &[i32], src: &[i32], dst: &mut [i32], cols: usize, row: usize) {
        for c in 0..cols {
            let left = if c > 0 { src[c - 1] } else { src[c] };
            let right = if c + 1 < cols { src[c + 1] } else { src[c] };
            dst[c] = wall[row * cols + c].wrapping_add(left.min(src[c]).min(right));
        }
    }

    /// The costs after rows `1..rows_done` (start: `wall[0]`).
    pub fn run(wall: &[i32], cols: usize, rows_done: usize) -> Vec<i32> {
        let mut src = wall[..cols].to_vec();
        let mut dst = vec![0; cols];
        for r in 1..rows_done {
            row(wall, &src, &mut dst, cols, r);
            std::mem::swap(&mut src, &mut dst);
        }
        src
    }
}

#[cfg(test)]
mod tests {
    use agora_protocol::RawArg;

    use super::reference;
    use crate::{find, run_on_host};

    #[test]
    fn row_launches_find_the_cheapest_paths() {
        let (rows, cols) = (10usize, 33usize);
        let mut wall = reference::wall(rows, cols, 3);
        let mut src = wall[..cols].to_vec();
        let mut dst = vec![0i32; cols];
        let (_, k) = find("pathfinder.row").unwrap();
        for row in 1..rows {
            run_on_host(
                k,
                &[cols as u64],
                &[
                    RawArg::buffer(0),
                    RawArg::buffer(1),
                    RawArg::buffer(2),
                    RawArg::i32(cols as i32),
                    RawArg::i32(row as i32),
                ],
                &mut [
                    bytemuck::cast_slice_mut(&mut wall),
                    bytemuck::cast_slice_mut(&mut src),
                    bytemuck::cast_slice_mut(&mut dst),
                ],
                3,
            )
            .unwrap();
            std::mem::swap(&mut src, &mut dst);
        }
        assert_eq!(src, reference::run(&wall, cols, rows));
        // Bounds on each column's cheapest cost: at least the sum of the rows' minima, at most
        // the straight path down.
        let floor: i32 = (0..rows)
            .map(|r| *wall[r * cols..(r + 1) * cols].iter().min().unwrap())
            .sum();
        for (c, cost) in src.iter().enumerate() {
            let straight: i32 = (0..rows).map(|r| wall[r * cols + c]).sum();
            assert!((floor..=straight).contains(cost), "column {c}: {cost}");
        }
    }
}
