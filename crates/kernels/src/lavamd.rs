//! Rodinia's lavaMD (`lavamd.boxes`): potentials and forces between particles in a 3-D grid of
//! boxes, each particle interacting with the particles of its own box and the (up to 26)
//! neighbouring boxes.
//!
//! Layout: `boxes1d³` boxes numbered `(z·boxes1d + y)·boxes1d + x`, each holding `par_per_box`
//! consecutive particles; particle `p` has `rv[4p..4p+4] = (v, x, y, z)` and charge `qv[p]`, and
//! the launch writes `fv[4p..4p+4]` = (potential, force x, y, z). One work item is one particle.

use std::borrow::Cow;

use crate::{CpuImpl, SizeCheck};
use std::ops::Range;

use agora_protocol::{Access::*, ScalarType::*, TaskError};

use crate::checks::{count, exact_range, int_in};
use crate::{buffer, opencl, programs::LAVAMD, scalar, Cost, KernelCall, KernelDef, LaunchShape};

fn boxes_check(s: &LaunchShape<'_>) -> Result<(), TaskError> {
    let boxes1d = int_in(s, 3, 1, 1290)?;
    let per_box = int_in(s, 4, 1, i32::MAX)?;
    // Four floats per particle must fit in an OpenCL int as well.
    count(s, 4, &[boxes1d, boxes1d, boxes1d, per_box, 4])?;
    let particles = boxes1d * boxes1d * boxes1d * per_box;
    exact_range(s, [particles, 1, 1])?;
    s.need(0, particles * 4, 4)?;
    s.need(1, particles, 4)?;
    s.need(2, particles * 4, 4)
}

fn boxes_cpu(call: &KernelCall<'_>, rows: Range<u64>) {
    let rv = call.input::<f32>(0);
    let qv = call.input::<f32>(1);
    let boxes1d = call.i32(3) as usize;
    let per_box = call.i32(4) as usize;
    let alpha = call.f32(5);
    let (start, end) = (rows.start as usize, rows.end as usize);
    // SAFETY: particles start..end (elements 4·start..4·end of `fv`) belong to this thread alone,
    // and `fv` shares no memory with `rv` or `qv` (the daemon refuses a written buffer passed
    // twice).
    let out = unsafe { call.output::<f32>(2).row_mut(4 * start..4 * end) };
    let mut neighbours = Vec::with_capacity(27);
    for (p, f) in (start..end).zip(out.chunks_exact_mut(4)) {
        let home = p / per_box;
        reference::neighbours(boxes1d, home, &mut neighbours);
        f.copy_from_slice(&reference::particle(rv, qv, per_box, alpha, p, &neighbours));
    }
}

/// `lavamd.boxes(rv, qv, fv, boxes1d, par_per_box, alpha)`.
pub const BOXES: KernelDef = KernelDef {
    cuda: None,
    name: Cow::Borrowed("lavamd.boxes"),
    doc: Cow::Borrowed(
        "lavaMD: fv[p] = sum over particles j of p's box and its neighbour boxes of q_j*(vij, 2*vij*(r_p - r_j)), \
          vij = exp(-2*alpha^2*(v_p + v_j - r_p.r_j)); rv/fv are (v,x,y,z) per particle, boxes1d^3 boxes of \
          par_per_box particles; range boxes1d^3*par_per_box",
    ),
    params: Cow::Borrowed(&[
        buffer("rv", F32, Read),
        buffer("qv", F32, Read),
        buffer("fv", F32, Write),
        scalar("boxes1d", I32),
        scalar("par_per_box", I32),
        scalar("alpha", F32),
    ]),
    // Up to 2,700 interactions (an exp each) per particle with Rodinia's 100 particles per box.
    cost: Cost::PerItemNs(13_000.0),
    chunkable: true,
    check: SizeCheck::Builtin(boxes_check),
    cpu: Some(CpuImpl::Builtin(boxes_cpu)),
    opencl: opencl("lavamd", LAVAMD, "boxes"),
};

/// Host reference and input generator.
pub mod reference {
    use crate::rng::Rng;

    /// Rodinia's particles per box.
    pub const PAR_PER_BOX: usize = 100;
    /// Rodinia's `alpha`.
    pub const ALPHA: f32 = 0.5;

    /// Rodinia's inputs: positions `rv` (4 per particle: v, x, y, z) and charges `qv`, each a
    /// random multiple of 0.1 from 0.1 to 1.0.
    pub fn inputs(boxes1d: usize, per_box: usize, seed: u64) -> (Vec<f32>, Vec<f32>) {
        let mut rng = Rng::new(seed);
        let particles = boxes1d * boxes1d * boxes1d * per_box;
        let mut draw = || (rng.below(10) + 1) as f32 / 10.0;
        let rv = (0..4 * particles).map(|_| draw()).collect();
        let qv = (0..particles).map(|_| draw()).collect();
        (rv, qv)
    }

    /// The boxes `home` interacts with, in Rodinia's order: itself, then its neighbours by
    /// (dz, dy, dx) from -1 to 1.
    pub fn neighbours(boxes1d: usize, home: usize, out: &mut Vec<usize>) {
        out.clear();
        out.push(home);
        let (x, y, z) = (home % boxes1d, (home / boxes1d) % boxes1d, home / (boxes1d * boxes1d));
        for dz in -1i64..=1 {
            for dy in -1i64..=1 {
                for dx in -1i64..=1 {
                    let (nx, ny, nz) = (x as i64 + dx, y as i64 + dy, z as i64 + dz);
                    let inside = [nx, ny, nz].iter().all(|c| (0..boxes1d as i64).contains(c));
                    if inside && (dx, dy, dz) != (0, 0, 0) {
                        out.push(((nz as usize * boxes1d) + ny as usize) * boxes1d + nx as usize);
                    }
                }
            }
        }
    }

    /// Potential and force on particle `p` from the particles of `boxes`.
    pub fn particle(rv: &[f32], qv: &[f32], per_box: usize, alpha: f32, p: usize, boxes: &[usize]) -> [f32; 4] {
        let a2 = 2.0 * alpha * alpha;
        let (pv, px, py, pz) = (rv[4 * p], rv[4 * p + 1], rv[4 * p + 2], rv[4 * p + 3]);
        let mut f = [0f32; 4];
        for &b in boxes {
            for q in b * per_box..(b + 1) * per_box {
                let (qv_, qx, qy, qz) = (rv[4 * q], rv[4 * q + 1], rv[4 * q + 2], rv[4 * q + 3]);
                let r2 = pv + qv_ - (px * qx + py * qy + pz * qz);
                let u2 = a2 * r2;
                let vij = (-u2).exp();
                let fs = 2.0 * vij;
                let charge = qv[q];
                f[0] += charge * vij;
                f[1] += charge * (fs * (px - qx));
                f[2] += charge * (fs * (py - qy));
                f[3] += charge * (fs * (pz - qz));
            }
        }
        f
    }

    /// What a whole `lavamd.boxes` launch computes: `fv` for every particle.
    pub fn boxes(rv: &[f32], qv: &[f32], boxes1d: usize, per_box: usize, alpha: f32) -> Vec<f32> {
        let particles = boxes1d * boxes1d * boxes1d * per_box;
        let mut fv = vec![0f32; 4 * particles];
        let mut nbrs = Vec::new();
        for p in 0..particles {
            neighbours(boxes1d, p / per_box, &mut nbrs);
            fv[4 * p..4 * p + 4].copy_from_slice(&particle(rv, qv, per_box, alpha, p, &nbrs));
        }
        fv
    }
}
