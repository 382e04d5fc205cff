//! Rodinia's PathFinder (`pathfinder.row`): the cheapest path from the top row of a grid of
//! weights ("the wall") to the bottom, moving down, down-left or down-right.
//!
//! The host starts with `src = wall[0]`, launches one row `1..rows` at a time over the columns,
//! and ping-pongs `src` and `dst`; after the last row `src` holds the cheapest cost to reach each
//! column of the bottom row.
//!
//! The kernel itself (`pathfinder.row`) is a kernel package now, `examples/packages/pathfinder` (OpenCL C
//! and C), loaded by the daemon at run time; this module keeps the host reference and the input
//! generator the bundled workload and the tests check it against.

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
