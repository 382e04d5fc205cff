//! The bundled programs as workloads.

use agora_kernels::gaussian::reference as gauss;

use crate::workload::{Step, WArg, Workload};
use crate::{bytes_of, floats, max_relative_error};

/// Programs `build` knows, with what `size` means for each.
pub const PROGRAMS: &[(&str, &str)] = &[
    ("gaussian", "matrix order (Rodinia gaussian: fan1 + fan2 per column)"),
    ("saxpy", "elements (100 saxpy launches on one queue)"),
    ("vector-add", "elements (fill + vector_add)"),
];

/// A sensible default size for `program`.
pub fn default_size(program: &str) -> u64 {
    match program {
        "gaussian" => 512,
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::native;

    #[test]
    fn every_program_verifies_natively_on_the_cpu() {
        for (name, _) in PROGRAMS {
            let w = build(name, if *name == "gaussian" { 64 } else { 10_001 }, None).unwrap();
            let r = native::run_cpu(&w).unwrap();
            assert!(r.verified, "{name}: error {}", r.max_error);
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
