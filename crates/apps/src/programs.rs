//! The bundled programs as workloads.

use agora_kernels::gaussian::reference as gauss;
use agora_kernels::{backprop, hotspot, lavamd, nw, pathfinder};

use crate::workload::{Step, WArg, Workload};
use crate::{bytes_of, floats, max_relative_error};

/// Programs `build` knows, with what `size` means for each.
pub const PROGRAMS: &[(&str, &str)] = &[
    ("gaussian", "matrix order (Rodinia gaussian: fan1 + fan2 per column)"),
    ("saxpy", "elements (100 saxpy launches on one queue)"),
    ("vector-add", "elements (fill + vector_add)"),
    (
        "hotspot",
        "grid side (Rodinia hotspot: one hotspot.step per time step, 20 steps by default; above 979 \
         the time step shrinks with the cells, as the explicit scheme's stability requires)",
    ),
    (
        "nw",
        "sequence length (Rodinia nw: one nw.diagonal launch per diagonal of 16x16 blocks)",
    ),
    (
        "pathfinder",
        "columns (Rodinia pathfinder: one pathfinder.row launch per row, 100 rows by default)",
    ),
    (
        "lavamd",
        "boxes per side (Rodinia lavaMD: 100 particles per box, one lavamd.boxes launch)",
    ),
    (
        "backprop",
        "input units (Rodinia backprop: one training step, 16 hidden units; layerforward, squash, adjust_weights)",
    ),
];

/// The most launches one run may issue (the steps are built in memory before the run).
pub const MAX_LAUNCHES: u64 = 1_000_000;

/// The most elements one buffer may hold: the kernels index with an OpenCL `int`.
const MAX_ELEMENTS: u64 = i32::MAX as u64;

/// The smallest size `program` accepts.
pub fn min_size(program: &str) -> u64 {
    match program {
        "gaussian" | "hotspot" => 2,
        _ => 1,
    }
}

/// Bytes of buffers `program` allocates at `size` (and `iterations`), computed with checked
/// arithmetic before anything is allocated; an error names the limit a size breaks (below the
/// program's minimum, a buffer beyond what the kernels index, too many launches) or an unknown
/// program.
pub fn footprint(program: &str, size: u64, iterations: Option<usize>) -> Result<u64, String> {
    let min = min_size(program);
    if !PROGRAMS.iter().any(|(name, _)| *name == program) && program != "vector_add" {
        return Err(unknown_program(program));
    }
    if size < min {
        return Err(format!("{program} --size {size}: the size must be at least {min}"));
    }
    let too_big = || {
        format!("{program} --size {size}: too large (a buffer would exceed {MAX_ELEMENTS} elements, the most the kernels index)")
    };
    let mul = |a: u64, b: u64| a.checked_mul(b).ok_or_else(too_big);
    let add = |a: u64, b: u64| a.checked_add(b).ok_or_else(too_big);
    let iterations = iterations.map(|i| i as u64);
    // (elements of the largest buffer, elements of all buffers (4 bytes each), launches)
    let (largest, total, launches) = match program {
        "gaussian" => {
            let nn = mul(size, size)?;
            (nn, add(mul(nn, 2)?, size)?, mul(size - 1, 2)?)
        }
        "saxpy" => (size, mul(size, 2)?, iterations.unwrap_or(100)),
        "vector-add" | "vector_add" => (size, mul(size, 3)?, 2),
        "hotspot" => {
            let cells = mul(size, size)?;
            (cells, mul(cells, 3)?, iterations.unwrap_or(20))
        }
        "nw" => {
            let side = add(size, 1)?;
            let cells = mul(side, side)?;
            (cells, mul(cells, 2)?, mul(size.div_ceil(16), 2)? - 1)
        }
        "pathfinder" => {
            let rows = iterations.unwrap_or(100).max(2);
            let wall = mul(rows, size)?;
            (wall, add(wall, mul(size, 2)?)?, rows - 1)
        }
        "lavamd" => {
            let particles = mul(mul(mul(size, size)?, size)?, lavamd::reference::PAR_PER_BOX as u64)?;
            let rv = mul(particles, 4)?;
            (rv, add(mul(rv, 2)?, particles)?, 1)
        }
        "backprop" => {
            let hid = backprop::reference::HIDDEN as u64 + 1;
            let weights = mul(add(size, 1)?, hid)?;
            let partial = mul(size.div_ceil(backprop::BLOCK as u64), hid - 1)?;
            (
                weights,
                add(add(mul(weights, 2)?, partial)?, add(size + 1, mul(hid, 2)?)?)?,
                3,
            )
        }
        _ => return Err(unknown_program(program)),
    };
    if largest > MAX_ELEMENTS {
        return Err(too_big());
    }
    if launches > MAX_LAUNCHES {
        return Err(format!(
            "{program} --size {size}: {launches} launches, more than the {MAX_LAUNCHES} one run may issue; use fewer --iterations"
        ));
    }
    mul(total, 4)
}

/// The message for a program `build` does not know, listing those it does.
pub fn unknown_program(program: &str) -> String {
    let names: Vec<&str> = PROGRAMS.iter().map(|(n, _)| *n).collect();
    format!("unknown workload '{program}'; choose one of: {}", names.join(", "))
}

/// A sensible default size for `program`.
pub fn default_size(program: &str) -> u64 {
    match program {
        "gaussian" => 512,
        "hotspot" => 512,
        "nw" => 2048,
        "pathfinder" => 100_000,
        "lavamd" => 6,
        "backprop" => 65_536,
        _ => 1 << 20,
    }
}

/// Builds `program` at `size` (`iterations` for iterative programs, default per program);
/// `None` for an unknown program.
pub fn build(program: &str, size: u64, iterations: Option<usize>) -> Option<Workload> {
    Some(match program {
        "gaussian" => gaussian(size.max(2) as usize),
        "saxpy" => saxpy(size.max(1) as usize, iterations.unwrap_or(100)),
        "vector-add" | "vector_add" => vector_add(size.max(1) as usize),
        "hotspot" => hotspot(size.max(2) as usize, iterations.unwrap_or(20)),
        "nw" => nw(size.max(1) as usize),
        "pathfinder" => pathfinder(size.max(1) as usize, iterations.unwrap_or(100).max(2)),
        "lavamd" => lavamd(size.max(1) as usize),
        "backprop" => backprop(size.max(1) as usize),
        _ => return None,
    })
}

/// Rodinia Gaussian elimination: forward elimination as launches, checked against the same
/// elimination on the host (back substitution is host-side in Rodinia, and in the check here).
pub fn gaussian(size: usize) -> Workload {
    let (a, b) = gauss::matrix(size);
    let mut steps = vec![Step::SyncTo(0), Step::SyncTo(1), Step::SyncTo(2)];
    let s = size as i32;
    for t in 0..size - 1 {
        let rows = (size - 1 - t) as u64;
        let ti = t as i32;
        steps.push(Step::Launch {
            kernel: "gaussian.fan1",
            args: vec![WArg::Buffer(2), WArg::Buffer(0), WArg::I32(s), WArg::I32(ti)],
            range: vec![rows],
        });
        steps.push(Step::Launch {
            kernel: "gaussian.fan2",
            args: vec![
                WArg::Buffer(2),
                WArg::Buffer(0),
                WArg::Buffer(1),
                WArg::I32(s),
                WArg::I32(ti),
            ],
            range: vec![rows, (size - t) as u64],
        });
    }
    steps.push(Step::SyncFrom(0));
    steps.push(Step::SyncFrom(1));
    let (mut ra, mut rb) = (a.clone(), b.clone());
    let mut rm = vec![0f32; size * size];
    gauss::forward(&mut ra, &mut rb, &mut rm, size);
    let want = gauss::back_substitute(&ra, &rb, size);
    Workload {
        name: "gaussian",
        size: size as u64,
        buffers: vec![bytes_of(&a), bytes_of(&b), vec![0u8; size * size * 4]],
        steps,
        verify: Box::new(move |bufs| {
            let x = gauss::back_substitute(&floats(bufs[0]), &floats(bufs[1]), size);
            let e = max_relative_error(&x, &want);
            (e, e <= 1e-3)
        }),
    }
}

/// `iterations` saxpy launches, y ← 2·x + y each time, checked against the same sums on the host.
pub fn saxpy(n: usize, iterations: usize) -> Workload {
    let x: Vec<f32> = (0..n).map(|i| (i % 1000) as f32 * 0.001).collect();
    let mut steps = vec![Step::SyncTo(0), Step::SyncTo(1)];
    for _ in 0..iterations {
        steps.push(Step::Launch {
            kernel: "saxpy",
            args: vec![WArg::F32(2.0), WArg::Buffer(0), WArg::Buffer(1)],
            range: vec![n as u64],
        });
    }
    steps.push(Step::SyncFrom(1));
    // x takes 1000 distinct values: accumulate each once (the same additions, in the same order,
    // as the kernel), not once per element.
    let distinct: Vec<f32> = (0..1000)
        .map(|v| {
            let xi = v as f32 * 0.001;
            let mut y = 1.0f32;
            for _ in 0..iterations {
                y += 2.0 * xi;
            }
            y
        })
        .collect();
    let want: Vec<f32> = (0..n).map(|i| distinct[i % 1000]).collect();
    Workload {
        name: "saxpy",
        size: n as u64,
        buffers: vec![bytes_of(&x), bytes_of(&vec![1.0f32; n])],
        steps,
        verify: Box::new(move |bufs| {
            let e = max_relative_error(&floats(bufs[1]), &want);
            (e, e <= 1e-5)
        }),
    }
}

/// `fill` then `vector_add`, checked exactly.
pub fn vector_add(n: usize) -> Workload {
    let b: Vec<f32> = (0..n).map(|i| i as f32).collect();
    let want: Vec<f32> = b.iter().map(|v| v + 0.5).collect();
    Workload {
        name: "vector-add",
        size: n as u64,
        buffers: vec![vec![0u8; n * 4], bytes_of(&b), vec![0u8; n * 4]],
        steps: vec![
            Step::Launch {
                kernel: "fill",
                args: vec![WArg::F32(0.5), WArg::Buffer(0)],
                range: vec![n as u64],
            },
            Step::SyncTo(1),
            Step::Launch {
                kernel: "vector_add",
                args: vec![WArg::Buffer(0), WArg::Buffer(1), WArg::Buffer(2)],
                range: vec![n as u64],
            },
            Step::SyncFrom(2),
        ],
        verify: Box::new(move |bufs| {
            let e = max_relative_error(&floats(bufs[2]), &want);
            (e, e == 0.0)
        }),
    }
}

fn ints(bytes: &[u8]) -> Vec<i32> {
    bytes
        .chunks_exact(4)
        .map(|c| i32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect()
}

fn bytes_of_ints(values: &[i32]) -> Vec<u8> {
    bytemuck::cast_slice(values).to_vec()
}

/// Rodinia's hotspot coefficients for a `side × side` grid, with the time step shortened where
/// Rodinia's fixed step would make the explicit scheme unstable.
///
/// Rodinia keeps the time step fixed while the cells shrink, so `step/cap · (4/R_x + 4/R_y + 1/R_z)`
/// grows with `side²`. Past 2 (about 1386²) the fastest mode, a checkerboard, grows at every step;
/// close to 2 it barely decays, so rounding differences between devices (an OpenCL compiler's
/// fused multiply-adds) grow into the result and only a bit-identical CPU still matches the host.
/// Here the step is capped so that this factor is at most 1: every mode then decays without
/// changing sign, and a difference in the input or rounding never grows. Grids up to 979² keep
/// Rodinia's coefficients exactly.
pub fn hotspot_params(side: usize) -> hotspot::reference::Params {
    let mut p = hotspot::reference::Params::for_grid(side, side);
    let factor = f64::from(p.step_div_cap) * f64::from(4.0 * p.rx_1 + 4.0 * p.ry_1 + p.rz_1);
    if factor > 1.0 {
        p.step_div_cap = (f64::from(p.step_div_cap) / factor) as f32;
    }
    p
}

/// Rodinia hotspot: `iterations` time steps on a `side × side` grid, ping-ponging two buffers.
pub fn hotspot(side: usize, iterations: usize) -> Workload {
    let (temp, power) = hotspot::reference::grids(side, side, 7);
    let p = hotspot_params(side);
    let mut steps = vec![Step::SyncTo(0), Step::SyncTo(1)];
    for i in 0..iterations {
        let (src, dst) = if i.is_multiple_of(2) { (1, 2) } else { (2, 1) };
        steps.push(Step::Launch {
            kernel: "hotspot.step",
            args: vec![
                WArg::Buffer(0),
                WArg::Buffer(src),
                WArg::Buffer(dst),
                WArg::I32(side as i32),
                WArg::I32(side as i32),
                WArg::F32(p.step_div_cap),
                WArg::F32(p.rx_1),
                WArg::F32(p.ry_1),
                WArg::F32(p.rz_1),
                WArg::F32(p.amb_temp),
            ],
            range: vec![side as u64, side as u64],
        });
    }
    let result = if iterations.is_multiple_of(2) { 1 } else { 2 };
    steps.push(Step::SyncFrom(result));
    let want = hotspot::reference::simulate(&temp, &power, side, side, iterations, &p);
    Workload {
        name: "hotspot",
        size: side as u64,
        buffers: vec![bytes_of(&power), bytes_of(&temp), vec![0u8; side * side * 4]],
        steps,
        verify: Box::new(move |bufs| {
            let e = max_relative_error(&floats(bufs[result]), &want);
            (e, e <= 1e-5)
        }),
    }
}

/// Rodinia Needleman-Wunsch: the score matrix of two sequences of length `n`, one launch per
/// diagonal of 16×16 blocks, checked exactly against the host's row-by-row fill.
pub fn nw(n: usize) -> Workload {
    const BLOCK: usize = 16;
    let (score, reference) = nw::reference::inputs(n, nw::reference::PENALTY, 11);
    let blocks = nw::reference::blocks_per_side(n, BLOCK);
    let mut steps = vec![Step::SyncTo(0), Step::SyncTo(1)];
    for diag in 0..2 * blocks - 1 {
        let span = nw::reference::diagonal_blocks(n, BLOCK, diag);
        steps.push(Step::Launch {
            kernel: "nw.diagonal",
            args: vec![
                WArg::Buffer(0),
                WArg::Buffer(1),
                WArg::I32(n as i32),
                WArg::I32(nw::reference::PENALTY),
                WArg::I32(diag as i32),
                WArg::I32(BLOCK as i32),
            ],
            range: vec![span.len() as u64],
        });
    }
    steps.push(Step::SyncFrom(0));
    let mut want = score.clone();
    nw::reference::fill(&mut want, &reference, n, nw::reference::PENALTY);
    Workload {
        name: "nw",
        size: n as u64,
        buffers: vec![bytes_of_ints(&score), bytes_of_ints(&reference)],
        steps,
        verify: Box::new(move |bufs| {
            let got = ints(bufs[0]);
            let wrong = got.iter().zip(&want).filter(|(g, w)| g != w).count();
            (wrong as f64, wrong == 0 && got.len() == want.len())
        }),
    }
}

/// Rodinia pathfinder: `rows` rows of a `cols`-wide wall, one launch per row, checked exactly.
pub fn pathfinder(cols: usize, rows: usize) -> Workload {
    let wall = pathfinder::reference::wall(rows, cols, 5);
    let mut steps = vec![Step::SyncTo(0), Step::SyncTo(1)];
    for r in 1..rows {
        let (src, dst) = if r % 2 == 1 { (1, 2) } else { (2, 1) };
        steps.push(Step::Launch {
            kernel: "pathfinder.row",
            args: vec![
                WArg::Buffer(0),
                WArg::Buffer(src),
                WArg::Buffer(dst),
                WArg::I32(cols as i32),
                WArg::I32(r as i32),
            ],
            range: vec![cols as u64],
        });
    }
    let result = if rows.is_multiple_of(2) { 2 } else { 1 };
    steps.push(Step::SyncFrom(result));
    let want = pathfinder::reference::run(&wall, cols, rows);
    Workload {
        name: "pathfinder",
        size: cols as u64,
        buffers: vec![bytes_of_ints(&wall), bytes_of_ints(&wall[..cols]), vec![0u8; cols * 4]],
        steps,
        verify: Box::new(move |bufs| {
            let got = ints(bufs[result]);
            let wrong = got.iter().zip(&want).filter(|(g, w)| g != w).count();
            (wrong as f64, wrong == 0 && got.len() == want.len())
        }),
    }
}

/// Rodinia lavaMD: forces on `boxes1d³` boxes of 100 particles, one launch.
pub fn lavamd(boxes1d: usize) -> Workload {
    let per_box = lavamd::reference::PAR_PER_BOX;
    let (rv, qv) = lavamd::reference::inputs(boxes1d, per_box, 3);
    let particles = boxes1d * boxes1d * boxes1d * per_box;
    let want = lavamd::reference::boxes(&rv, &qv, boxes1d, per_box, lavamd::reference::ALPHA);
    Workload {
        name: "lavamd",
        size: boxes1d as u64,
        buffers: vec![bytes_of(&rv), bytes_of(&qv), vec![0u8; particles * 16]],
        steps: vec![
            Step::SyncTo(0),
            Step::SyncTo(1),
            Step::Launch {
                kernel: "lavamd.boxes",
                args: vec![
                    WArg::Buffer(0),
                    WArg::Buffer(1),
                    WArg::Buffer(2),
                    WArg::I32(boxes1d as i32),
                    WArg::I32(per_box as i32),
                    WArg::F32(lavamd::reference::ALPHA),
                ],
                range: vec![particles as u64],
            },
            Step::SyncFrom(2),
        ],
        verify: Box::new(move |bufs| {
            let e = max_relative_error(&floats(bufs[2]), &want);
            (e, e <= 1e-4)
        }),
    }
}

/// Rodinia backprop, one training step as Rodinia's GPU version splits it: the input layer's
/// forward pass (`backprop.layerforward` + `backprop.squash`) and the input-weight update
/// (`backprop.adjust_weights`) on the device. The small output layer and the error terms run on
/// the host in Rodinia; here they come from the host reference, computed before the run (so they
/// are not timed), and the hidden-unit deltas are an input of the update.
pub fn backprop(n_in: usize) -> Workload {
    use backprop::reference as r;
    let net = r::net(n_in, r::HIDDEN, 13);
    let n_hid = net.n_hid;
    let blocks = n_in.div_ceil(backprop::BLOCK);
    // The host part of the step: hidden units, output layer, error terms.
    let partial = r::layer_partials(&net.input, &net.input_weights, n_in, n_hid);
    let mut hidden = vec![1f32; n_hid + 1];
    r::squash(&partial, &net.input_weights, &mut hidden, n_in, n_hid);
    let output = r::layer(&hidden, &net.hidden_weights, n_hid, net.n_out);
    let (out_delta, _) = r::output_error(&output, &net.target);
    let (hid_delta, _) = r::hidden_error(&hidden, &out_delta, &net.hidden_weights);
    let mut want_w = net.input_weights.clone();
    let mut want_old = net.input_prev.clone();
    r::adjust_weights(
        &hid_delta,
        &net.input,
        &mut want_w,
        &mut want_old,
        n_in,
        n_hid,
        r::ETA,
        r::MOMENTUM,
    );
    let (ni, nh) = (n_in as i32, n_hid as i32);
    // Buffers: 0 input, 1 weights, 2 partial sums, 3 hidden, 4 hidden deltas, 5 previous changes.
    Workload {
        name: "backprop",
        size: n_in as u64,
        buffers: vec![
            bytes_of(&net.input),
            bytes_of(&net.input_weights),
            vec![0u8; blocks * n_hid * 4],
            bytes_of(&vec![1f32; n_hid + 1]),
            bytes_of(&hid_delta),
            bytes_of(&net.input_prev),
        ],
        steps: vec![
            Step::SyncTo(0),
            Step::SyncTo(1),
            Step::SyncTo(3),
            Step::SyncTo(4),
            Step::SyncTo(5),
            Step::Launch {
                kernel: "backprop.layerforward",
                args: vec![
                    WArg::Buffer(0),
                    WArg::Buffer(1),
                    WArg::Buffer(2),
                    WArg::I32(ni),
                    WArg::I32(nh),
                ],
                range: vec![blocks as u64, n_hid as u64],
            },
            Step::Launch {
                kernel: "backprop.squash",
                args: vec![
                    WArg::Buffer(2),
                    WArg::Buffer(1),
                    WArg::Buffer(3),
                    WArg::I32(ni),
                    WArg::I32(nh),
                ],
                range: vec![n_hid as u64],
            },
            Step::SyncFrom(3),
            Step::Launch {
                kernel: "backprop.adjust_weights",
                args: vec![
                    WArg::Buffer(4),
                    WArg::Buffer(0),
                    WArg::Buffer(1),
                    WArg::Buffer(5),
                    WArg::I32(ni),
                    WArg::I32(nh),
                    WArg::F32(r::ETA),
                    WArg::F32(r::MOMENTUM),
                ],
                range: vec![n_in as u64 + 1, n_hid as u64],
            },
            Step::SyncFrom(1),
            Step::SyncFrom(5),
        ],
        verify: Box::new(move |bufs| {
            let e = max_relative_error(&floats(bufs[3]), &hidden)
                .max(max_relative_error(&floats(bufs[1]), &want_w))
                .max(max_relative_error(&floats(bufs[5]), &want_old));
            (e, e <= 1e-4)
        }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::native;

    #[test]
    fn every_program_verifies_natively_on_the_cpu() {
        // hotspot and pathfinder are example packages: their shared objects must be built.
        agora_test_support::example_packages();
        for (name, _) in PROGRAMS {
            let size = match *name {
                "gaussian" | "hotspot" => 64,
                "nw" => 100,
                "lavamd" => 2,
                "backprop" => 1000,
                _ => 10_001,
            };
            let w = build(name, size, None).unwrap();
            let r = native::run_cpu(&w).unwrap();
            assert!(r.verified, "{name}: error {}", r.max_error);
        }
    }

    #[test]
    fn corrupted_results_fail_verification() {
        agora_test_support::example_packages();
        for (name, _) in PROGRAMS {
            let w = build(name, if *name == "lavamd" { 1 } else { 20 }, Some(3)).unwrap();
            let mut bufs = w.buffers.clone();
            native_cpu_into(&w, &mut bufs);
            let (_, ok) = (w.verify)(&bufs.iter().map(Vec::as_slice).collect::<Vec<_>>());
            assert!(ok, "{name} verifies when computed");
            // Flip a high bit of the middle element of every buffer: a checked value changes a lot.
            for b in bufs.iter_mut() {
                let mid = b.len() / 2 / 4 * 4;
                b[mid + 3] ^= 0x40;
            }
            let (_, ok) = (w.verify)(&bufs.iter().map(Vec::as_slice).collect::<Vec<_>>());
            assert!(!ok, "{name} must reject a corrupted result");
        }
    }

    /// Runs the workload's launches on the CPU into `bufs` (test helper).
    fn native_cpu_into(w: &Workload, bufs: &mut [Vec<u8>]) {
        let report = native::run_cpu_with_buffers(w, bufs).unwrap();
        assert!(report.verified, "{} {}", w.name, report.max_error);
    }

    #[test]
    fn footprint_is_what_build_allocates() {
        for (name, _) in PROGRAMS {
            for size in [min_size(name), 3, 17, 100] {
                let size = if *name == "lavamd" { size.min(3) } else { size };
                for iterations in [None, Some(3)] {
                    let w = build(name, size, iterations).unwrap();
                    let bytes: usize = w.buffers.iter().map(Vec::len).sum();
                    assert_eq!(footprint(name, size, iterations), Ok(bytes as u64), "{name} {size}");
                    assert!(w.launches() as u64 <= MAX_LAUNCHES);
                }
            }
        }
    }

    #[test]
    fn impossible_sizes_are_refused_before_anything_is_allocated() {
        for (name, _) in PROGRAMS {
            let zero = footprint(name, 0, None).unwrap_err();
            assert!(zero.contains("at least"), "{name}: {zero}");
            for huge in [99_999_999_999_999, u64::MAX] {
                let e = footprint(name, huge, None).unwrap_err();
                assert!(e.contains("too large"), "{name} {huge}: {e}");
            }
        }
        assert!(footprint("saxpy", 10, Some(usize::MAX))
            .unwrap_err()
            .contains("launches"));
        assert!(footprint("nope", 10, None).unwrap_err().contains("backprop"));
        assert!(unknown_program("x").contains("backprop"), "every program is listed");
    }

    /// Rodinia's fixed time step makes the explicit scheme unstable above about 1386², where a
    /// rounding difference (an OpenCL compiler's fused multiply-add) grows at every step. A
    /// perturbation of the input must not grow, at any grid size.
    #[test]
    fn hotspot_is_stable_on_large_grids() {
        assert_eq!(
            hotspot_params(512).step_div_cap,
            hotspot::reference::Params::for_grid(512, 512).step_div_cap,
            "small grids keep Rodinia's coefficients"
        );
        for side in [512, 1100, 1536, 2048] {
            let p = hotspot_params(side);
            let (temp, power) = hotspot::reference::grids(side, side, 7);
            // A checkerboard of ±0.01 K: the fastest mode, where instability shows first.
            let bumped: Vec<f32> = temp
                .iter()
                .enumerate()
                .map(|(i, t)| t + if (i / side + i % side) % 2 == 0 { 0.01 } else { -0.01 })
                .collect();
            let a = hotspot::reference::simulate(&temp, &power, side, side, 20, &p);
            let b = hotspot::reference::simulate(&bumped, &power, side, side, 20, &p);
            let grown = a.iter().zip(&b).map(|(x, y)| (x - y).abs()).fold(0f32, f32::max);
            assert!(grown <= 0.0101, "{side}²: a 0.01 K perturbation grew to {grown} K");
        }
    }

    #[test]
    fn a_wrong_result_fails_verification() {
        let w = build("vector-add", 100, None).unwrap();
        let zeros = vec![0u8; 400];
        let (_, ok) = (w.verify)(&[&zeros, &zeros, &zeros]);
        assert!(!ok);
    }
}
