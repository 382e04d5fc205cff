//! Rodinia's HotSpot (`hotspot.step`): explicit time steps of a chip's thermal simulation.
//!
//! One launch is one time step over a `rows × cols` grid, reading the temperatures `src` and
//! writing `dst`; the host ping-pongs the two buffers for the next step. Each cell moves toward
//! its four neighbours, the ambient temperature and its power dissipation, with Rodinia's
//! coefficients ([`reference::Params::for_grid`]); a neighbour outside the grid counts as the
//! cell itself, as in Rodinia's OpenCL kernel.
//!
//! The kernel itself (`hotspot.step`) is a kernel package now, `examples/packages/hotspot` (OpenCL C
//! and C), loaded by the daemon at run time; this module keeps the host reference and the input
//! generator the bundled workload and the tests check it against.

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
