//! Rodinia's HotSpot (`hotspot.step`): explicit time steps of a chip's thermal simulation.
//!
//! One launch is one time step over a `rows × cols` grid, reading the temperatures `src` and
//! writing `dst`; the host ping-pongs the two buffers for the next step. Each cell moves toward
//! its four neighbours, the ambient temperature and its power dissipation, with Rodinia's
//! coefficients ([`reference::Params::for_grid`]); a neighbour outside the grid counts as the
//! cell itself, as in Rodinia's OpenCL kernel.

use std::borrow::Cow;

use crate::{CpuImpl, SizeCheck};
use std::ops::Range;

use agora_protocol::{Access::*, ScalarType::*, TaskError};

use crate::checks::{count, exact_range, int_in};
use crate::{buffer, opencl, programs::HOTSPOT, scalar, Cost, KernelCall, KernelDef, LaunchShape};

fn step_check(s: &LaunchShape<'_>) -> Result<(), TaskError> {
    let rows = int_in(s, 3, 1, i32::MAX)?;
    let cols = int_in(s, 4, 1, i32::MAX)?;
    let n = count(s, 4, &[rows, cols])?;
    exact_range(s, [rows, cols, 1])?;
    s.need(0, n, 4)?;
    s.need(1, n, 4)?;
    s.need(2, n, 4)
}

fn step_cpu(call: &KernelCall<'_>, rows: Range<u64>) {
    let power = call.input::<f32>(0);
    let src = call.input::<f32>(1);
    let dst = call.output::<f32>(2);
    let nrows = call.i32(3) as usize;
    let cols = call.i32(4) as usize;
    let (step_div_cap, rx_1, ry_1, rz_1, amb) = (call.f32(5), call.f32(6), call.f32(7), call.f32(8), call.f32(9));
    for r in rows.start as usize..rows.end as usize {
        let base = r * cols;
        let row = &src[base..base + cols];
        // Rows outside the grid read the row itself (the clamped neighbour rule).
        let north = if r > 0 { &src[base - cols..base] } else { row };
        let south = if r + 1 < nrows {
            &src[base + cols..base + 2 * cols]
        } else {
            row
        };
        let pw = &power[base..base + cols];
        // SAFETY: row r of `dst` is written by this thread alone (rows are split disjointly among
        // threads), and `dst` shares no memory with `src` or `power` (the daemon refuses a written
        // buffer passed twice).
        let out = unsafe { dst.row_mut(base..base + cols) };
        for c in 0..cols {
            let t = row[c];
            let w = if c > 0 { row[c - 1] } else { t };
            let e = if c + 1 < cols { row[c + 1] } else { t };
            out[c] = t + step_div_cap
                * (pw[c] + (south[c] + north[c] - 2.0 * t) * ry_1 + (e + w - 2.0 * t) * rx_1 + (amb - t) * rz_1);
        }
    }
}

/// `hotspot.step(power, src, dst, rows, cols, step_div_cap, rx_1, ry_1, rz_1, amb_temp)`.
pub const STEP: KernelDef = KernelDef {
    name: Cow::Borrowed("hotspot.step"),
    doc: Cow::Borrowed(
        "one HotSpot time step: dst = src + step_div_cap*(power + (N+S-2T)*ry_1 + (E+W-2T)*rx_1 + \
          (amb_temp-T)*rz_1) per cell of a rows x cols grid (outside neighbours = the cell); range (rows, cols)",
    ),
    params: Cow::Borrowed(&[
        buffer("power", F32, Read),
        buffer("src", F32, Read),
        buffer("dst", F32, Write),
        scalar("rows", I32),
        scalar("cols", I32),
        scalar("step_div_cap", F32),
        scalar("rx_1", F32),
        scalar("ry_1", F32),
        scalar("rz_1", F32),
        scalar("amb_temp", F32),
    ]),
    cost: Cost::PerItemNs(2.0),
    chunkable: true,
    check: SizeCheck::Builtin(step_check),
    cpu: Some(CpuImpl::Builtin(step_cpu)),
    opencl: opencl("hotspot", HOTSPOT, "hotspot_step"),
};

/// Host reference and input generator.
pub mod reference {
    use crate::rng::Rng;

    /// The simulation's coefficients, as Rodinia computes them from the chip's dimensions.
    #[derive(Debug, Clone, Copy, PartialEq)]
    pub struct Params {
        /// Time step divided by the cell's heat capacity.
        pub step_div_cap: f32,
        /// 1 / thermal resistance along a row (x).
        pub rx_1: f32,
        /// 1 / thermal resistance along a column (y).
        pub ry_1: f32,
        /// 1 / thermal resistance to the ambient (z).
        pub rz_1: f32,
        /// Ambient temperature.
        pub amb_temp: f32,
    }

    impl Params {
        /// Rodinia's coefficients for a 16 mm × 16 mm × 0.5 mm silicon chip on a `rows × cols` grid.
        pub fn for_grid(rows: usize, cols: usize) -> Params {
            const MAX_PD: f64 = 3.0e6;
            const PRECISION: f64 = 0.001;
            const SPEC_HEAT_SI: f64 = 1.75e6;
            const K_SI: f64 = 100.0;
            const FACTOR_CHIP: f64 = 0.5;
            let (t_chip, chip_height, chip_width) = (0.0005, 0.016, 0.016);
            let grid_height = chip_height / rows as f64;
            let grid_width = chip_width / cols as f64;
            let cap = FACTOR_CHIP * SPEC_HEAT_SI * t_chip * grid_width * grid_height;
            let rx = grid_width / (2.0 * K_SI * t_chip * grid_height);
            let ry = grid_height / (2.0 * K_SI * t_chip * grid_width);
            let rz = t_chip / (K_SI * grid_height * grid_width);
            let max_slope = MAX_PD / (FACTOR_CHIP * t_chip * SPEC_HEAT_SI);
            let step = PRECISION / max_slope;
            Params {
                step_div_cap: (step / cap) as f32,
                rx_1: (1.0 / rx) as f32,
                ry_1: (1.0 / ry) as f32,
                rz_1: (1.0 / rz) as f32,
                amb_temp: 80.0,
            }
        }
    }

    /// Initial temperatures (kelvin, 323 to 343) and power dissipation (0 to 0.01 per cell),
    /// row-major, like Rodinia's `temp_N` and `power_N` files.
    pub fn grids(rows: usize, cols: usize, seed: u64) -> (Vec<f32>, Vec<f32>) {
        let mut rng = Rng::new(seed);
        let temp = (0..rows * cols).map(|_| rng.range(323.0, 343.0)).collect();
        let power = (0..rows * cols).map(|_| rng.range(0.0, 0.01)).collect();
        (temp, power)
    }

    /// One time step: `dst` from `src` (the same arithmetic as `hotspot.step`).
    pub fn step(power: &[f32], src: &[f32], dst: &mut [f32], rows: usize, cols: usize, p: &Params) {
        for r in 0..rows {
            for c in 0..cols {
                let i = r * cols + c;
                let t = src[i];
                let n = if r > 0 { src[i - cols] } else { t };
                let s = if r + 1 < rows { src[i + cols] } else { t };
                let w = if c > 0 { src[i - 1] } else { t };
                let e = if c + 1 < cols { src[i + 1] } else { t };
                dst[i] = t + p.step_div_cap
                    * (power[i] + (s + n - 2.0 * t) * p.ry_1 + (e + w - 2.0 * t) * p.rx_1 + (p.amb_temp - t) * p.rz_1);
            }
        }
    }

    /// `iterations` time steps from `temp`; returns the final temperatures.
    pub fn simulate(temp: &[f32], power: &[f32], rows: usize, cols: usize, iterations: usize, p: &Params) -> Vec<f32> {
        let mut src = temp.to_vec();
        let mut dst = vec![0f32; temp.len()];
        for _ in 0..iterations {
            step(power, &src, &mut dst, rows, cols, p);
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
    fn ping_pong_steps_match_the_simulation() {
        let (rows, cols, steps) = (9usize, 11usize, 4);
        let (temp, mut power) = reference::grids(rows, cols, 1);
        let p = reference::Params::for_grid(rows, cols);
        let want = reference::simulate(&temp, &power, rows, cols, steps, &p);
        let (mut src, mut dst) = (temp.clone(), vec![0f32; temp.len()]);
        let (_, k) = find("hotspot.step").unwrap();
        for _ in 0..steps {
            run_on_host(
                k,
                &[rows as u64, cols as u64],
                &[
                    RawArg::buffer(0),
                    RawArg::buffer(1),
                    RawArg::buffer(2),
                    RawArg::i32(rows as i32),
                    RawArg::i32(cols as i32),
                    RawArg::f32(p.step_div_cap),
                    RawArg::f32(p.rx_1),
                    RawArg::f32(p.ry_1),
                    RawArg::f32(p.rz_1),
                    RawArg::f32(p.amb_temp),
                ],
                &mut [
                    bytemuck::cast_slice_mut(&mut power),
                    bytemuck::cast_slice_mut(&mut src),
                    bytemuck::cast_slice_mut(&mut dst),
                ],
                2,
            )
            .unwrap();
            std::mem::swap(&mut src, &mut dst);
        }
        assert_eq!(src, want);
        // Rodinia's coefficients for a square grid.
        let square = reference::Params::for_grid(512, 512);
        assert!((square.rx_1 - 0.1).abs() < 1e-6 && (square.ry_1 - 0.1).abs() < 1e-6);
        assert!((square.step_div_cap - 0.3413).abs() < 1e-3, "{}", square.step_div_cap);
    }
}
