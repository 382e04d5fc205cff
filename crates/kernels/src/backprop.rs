//! Rodinia's Back Propagation: the input layer of a two-layer perceptron, on the device
//! (`backprop.layerforward`, `backprop.squash`, `backprop.adjust_weights`).
//!
//! Layout as in Rodinia: input units `x[0..=n_in]` (`x[0]` is the bias unit, 1.0), hidden units
//! `h[0..=n_hid]`, input weights `w[i][j]` at `w[i·(n_hid+1) + j]` (column 0 unused). A training
//! step runs `layerforward` (partial sums over blocks of [`BLOCK`] inputs), `squash` (sums the
//! partials, adds the bias weight, applies the sigmoid), the small output layer and error terms
//! on the host ([`reference::train_step`] shows the whole step), then `adjust_weights` on the
//! input weights with the hidden deltas.

use std::borrow::Cow;

use crate::{CpuImpl, SizeCheck};
use std::ops::Range;

use agora_protocol::{Access::*, ScalarType::*, TaskError};

use crate::checks::{count, exact_range, int_in};
use crate::{buffer, opencl, programs::BACKPROP, scalar, Cost, KernelCall, KernelDef, LaunchShape};

/// Inputs per partial sum of `backprop.layerforward` (Rodinia's `HEIGHT`; `BLOCK` in the `.cl`).
pub const BLOCK: usize = 16;

/// Checks `n_in` (argument `at`) and `n_hid` (`at + 1`); returns them with the number of blocks.
fn sizes(s: &LaunchShape<'_>, at: usize) -> Result<(u64, u64, u64), TaskError> {
    let n_in = int_in(s, at, 1, i32::MAX - 1)?;
    let n_hid = int_in(s, at + 1, 1, i32::MAX - 1)?;
    count(s, at + 1, &[n_in + 1, n_hid + 1])?;
    Ok((n_in, n_hid, n_in.div_ceil(BLOCK as u64)))
}

fn layerforward_check(s: &LaunchShape<'_>) -> Result<(), TaskError> {
    let (n_in, n_hid, blocks) = sizes(s, 3)?;
    exact_range(s, [blocks, n_hid, 1])?;
    s.need(0, n_in + 1, 4)?;
    s.need(1, (n_in + 1) * (n_hid + 1), 4)?;
    s.need(2, blocks * n_hid, 4)
}

fn layerforward_cpu(call: &KernelCall<'_>, rows: Range<u64>) {
    let x = call.input::<f32>(0);
    let w = call.input::<f32>(1);
    let n_in = call.i32(3) as usize;
    let n_hid = call.i32(4) as usize;
    let partial = call.output::<f32>(2);
    for b in rows.start as usize..rows.end as usize {
        // SAFETY: partial sums b·n_hid..(b+1)·n_hid belong to block b, one of this thread's rows;
        // `partial` shares no memory with `x` or `w` (a written buffer is never passed twice).
        let out = unsafe { partial.row_mut(b * n_hid..(b + 1) * n_hid) };
        let inputs = b * BLOCK + 1..((b + 1) * BLOCK + 1).min(n_in + 1);
        for (j, o) in out.iter_mut().enumerate() {
            let mut sum = 0f32;
            for i in inputs.clone() {
                sum += x[i] * w[i * (n_hid + 1) + j + 1];
            }
            *o = sum;
        }
    }
}

/// `backprop.layerforward(x, w, partial, n_in, n_hid)`.
pub const LAYERFORWARD: KernelDef = KernelDef {
    cuda: None,
    name: Cow::Borrowed("backprop.layerforward"),
    doc: Cow::Borrowed(
        "partial[b*n_hid+j] = sum of x[i]*w[i*(n_hid+1)+j+1] over the 16 inputs i of block b (inputs 1..=n_in); \
          range (ceil(n_in/16), n_hid)",
    ),
    params: Cow::Borrowed(&[
        buffer("x", F32, Read),
        buffer("w", F32, Read),
        buffer("partial", F32, Write),
        scalar("n_in", I32),
        scalar("n_hid", I32),
    ]),
    cost: Cost::PerItemNs(12.0),
    chunkable: true,
    check: SizeCheck::Builtin(layerforward_check),
    cpu: Some(CpuImpl::Builtin(layerforward_cpu)),
    opencl: opencl("backprop", BACKPROP, "layerforward"),
};

fn squash_check(s: &LaunchShape<'_>) -> Result<(), TaskError> {
    let (n_in, n_hid, blocks) = sizes(s, 3)?;
    exact_range(s, [n_hid, 1, 1])?;
    s.need(0, blocks * n_hid, 4)?;
    s.need(1, (n_in + 1) * (n_hid + 1), 4)?;
    s.need(2, n_hid + 1, 4)
}

fn squash_cpu(call: &KernelCall<'_>, rows: Range<u64>) {
    let partial = call.input::<f32>(0);
    let w = call.input::<f32>(1);
    let h = call.output::<f32>(2);
    let n_in = call.i32(3) as usize;
    let n_hid = call.i32(4) as usize;
    let blocks = n_in.div_ceil(BLOCK);
    for j in rows.start as usize..rows.end as usize {
        let mut sum = 0f32;
        for b in 0..blocks {
            sum += partial[b * n_hid + j];
        }
        sum += w[j + 1];
        h.set(j + 1, 1.0 / (1.0 + (-sum).exp()));
    }
}

/// `backprop.squash(partial, w, h, n_in, n_hid)`.
pub const SQUASH: KernelDef = KernelDef {
    cuda: None,
    name: Cow::Borrowed("backprop.squash"),
    doc: Cow::Borrowed(
        "h[j+1] = sigmoid(sum over blocks b of partial[b*n_hid+j] + w[j+1]) (h[0] untouched); range n_hid",
    ),
    params: Cow::Borrowed(&[
        buffer("partial", F32, Read),
        buffer("w", F32, Read),
        buffer("h", F32, ReadWrite),
        scalar("n_in", I32),
        scalar("n_hid", I32),
    ]),
    // About 1 ns per block of 16 inputs (65,536 inputs: 4,096 blocks).
    cost: Cost::PerItemNs(4_500.0),
    chunkable: true,
    check: SizeCheck::Builtin(squash_check),
    cpu: Some(CpuImpl::Builtin(squash_cpu)),
    opencl: opencl("backprop", BACKPROP, "squash"),
};

fn adjust_check(s: &LaunchShape<'_>) -> Result<(), TaskError> {
    let (n_in, n_hid, _) = sizes(s, 4)?;
    exact_range(s, [n_in + 1, n_hid, 1])?;
    s.need(0, n_hid + 1, 4)?;
    s.need(1, n_in + 1, 4)?;
    s.need(2, (n_in + 1) * (n_hid + 1), 4)?;
    s.need(3, (n_in + 1) * (n_hid + 1), 4)
}

fn adjust_cpu(call: &KernelCall<'_>, rows: Range<u64>) {
    let delta = call.input::<f32>(0);
    let ly = call.input::<f32>(1);
    let n_hid = call.i32(5) as usize;
    let (eta, momentum) = (call.f32(6), call.f32(7));
    let (w, oldw) = (call.output::<f32>(2), call.output::<f32>(3));
    let (start, end) = (rows.start as usize, rows.end as usize);
    for (i, ly_i) in ly[start..end].iter().enumerate().map(|(k, v)| (start + k, *v)) {
        let cells = i * (n_hid + 1) + 1..(i + 1) * (n_hid + 1);
        // SAFETY: row i of the weights (columns 1..=n_hid) belongs to this thread alone (rows are
        // split disjointly), and `w` and `oldw` are distinct buffers (the daemon refuses a
        // written buffer passed twice).
        let (w_row, old_row) = unsafe { (w.row_mut(cells.clone()), oldw.row_mut(cells)) };
        for (k, (wk, ok)) in w_row.iter_mut().zip(old_row.iter_mut()).enumerate() {
            let dw = eta * delta[k + 1] * ly_i + momentum * *ok;
            *wk += dw;
            *ok = dw;
        }
    }
}

/// `backprop.adjust_weights(delta, ly, w, oldw, n_in, n_hid, eta, momentum)`.
pub const ADJUST_WEIGHTS: KernelDef = KernelDef {
    cuda: None,
    name: Cow::Borrowed("backprop.adjust_weights"),
    doc: Cow::Borrowed(
        "for input i and hidden k=j+1: dw = eta*delta[k]*ly[i] + momentum*oldw[i][k]; w[i][k] += dw; \
          oldw[i][k] = dw (rows of n_hid+1); range (n_in+1, n_hid)",
    ),
    params: Cow::Borrowed(&[
        buffer("delta", F32, Read),
        buffer("ly", F32, Read),
        buffer("w", F32, ReadWrite),
        buffer("oldw", F32, ReadWrite),
        scalar("n_in", I32),
        scalar("n_hid", I32),
        scalar("eta", F32),
        scalar("momentum", F32),
    ]),
    cost: Cost::PerItemNs(1.0),
    chunkable: true,
    check: SizeCheck::Builtin(adjust_check),
    cpu: Some(CpuImpl::Builtin(adjust_cpu)),
    opencl: opencl("backprop", BACKPROP, "adjust_weights"),
};

/// Host reference, input generator and the host side of a training step.
pub mod reference {
    use super::BLOCK;
    use crate::rng::Rng;

    /// Rodinia's learning rate.
    pub const ETA: f32 = 0.3;
    /// Rodinia's momentum.
    pub const MOMENTUM: f32 = 0.3;
    /// Rodinia's hidden layer size.
    pub const HIDDEN: usize = 16;

    /// A network as Rodinia's `backprop` sets it up (one output unit).
    #[derive(Debug, Clone, PartialEq)]
    pub struct Net {
        /// Input units.
        pub n_in: usize,
        /// Hidden units.
        pub n_hid: usize,
        /// Output units.
        pub n_out: usize,
        /// `n_in + 1` input values (`[0]` = 1.0, the bias unit), random in `[0, 1)`.
        pub input: Vec<f32>,
        /// `(n_in+1) × (n_hid+1)` input weights, random in `[0, 1)`.
        pub input_weights: Vec<f32>,
        /// Previous input weight changes (zero).
        pub input_prev: Vec<f32>,
        /// `(n_hid+1) × (n_out+1)` hidden weights, random in `[0, 1)`.
        pub hidden_weights: Vec<f32>,
        /// Previous hidden weight changes (zero).
        pub hidden_prev: Vec<f32>,
        /// `n_out + 1` targets (0.1, as in Rodinia).
        pub target: Vec<f32>,
    }

    /// A random network with `n_in` inputs and `n_hid` hidden units.
    pub fn net(n_in: usize, n_hid: usize, seed: u64) -> Net {
        let mut rng = Rng::new(seed);
        let n_out = 1;
        let mut input: Vec<f32> = (0..=n_in).map(|_| rng.unit()).collect();
        input[0] = 1.0;
        let input_weights = (0..(n_in + 1) * (n_hid + 1)).map(|_| rng.unit()).collect();
        let hidden_weights = (0..(n_hid + 1) * (n_out + 1)).map(|_| rng.unit()).collect();
        Net {
            n_in,
            n_hid,
            n_out,
            input,
            input_weights,
            input_prev: vec![0.0; (n_in + 1) * (n_hid + 1)],
            hidden_weights,
            hidden_prev: vec![0.0; (n_hid + 1) * (n_out + 1)],
            target: vec![0.1; n_out + 1],
        }
    }

    /// What `backprop.layerforward` computes: `ceil(n_in/16) × n_hid` partial sums.
    pub fn layer_partials(x: &[f32], w: &[f32], n_in: usize, n_hid: usize) -> Vec<f32> {
        let blocks = n_in.div_ceil(BLOCK);
        let mut partial = vec![0f32; blocks * n_hid];
        for b in 0..blocks {
            for j in 0..n_hid {
                let mut sum = 0f32;
                for i in b * BLOCK + 1..=((b + 1) * BLOCK).min(n_in) {
                    sum += x[i] * w[i * (n_hid + 1) + j + 1];
                }
                partial[b * n_hid + j] = sum;
            }
        }
        partial
    }

    fn sigmoid(x: f32) -> f32 {
        1.0 / (1.0 + (-x).exp())
    }

    /// What `backprop.squash` computes: hidden units `h[1..=n_hid]` from the partial sums.
    pub fn squash(partial: &[f32], w: &[f32], h: &mut [f32], n_in: usize, n_hid: usize) {
        for j in 0..n_hid {
            let mut sum = 0f32;
            for b in 0..n_in.div_ceil(BLOCK) {
                sum += partial[b * n_hid + j];
            }
            sum += w[j + 1];
            h[j + 1] = sigmoid(sum);
        }
    }

    /// What `backprop.adjust_weights` computes, over all `(n_ly+1) × n_delta` weights.
    #[allow(clippy::too_many_arguments, clippy::needless_range_loop)]
    pub fn adjust_weights(
        delta: &[f32],
        ly: &[f32],
        w: &mut [f32],
        oldw: &mut [f32],
        n_ly: usize,
        n_delta: usize,
        eta: f32,
        momentum: f32,
    ) {
        for i in 0..=n_ly {
            for k in 1..=n_delta {
                let index = i * (n_delta + 1) + k;
                let dw = eta * delta[k] * ly[i] + momentum * oldw[index];
                w[index] += dw;
                oldw[index] = dw;
            }
        }
    }

    /// A fully connected layer on the host: `out[j] = sigmoid(Σ_k w[k][j]·l[k])` with `l[0] = 1`.
    pub fn layer(l: &[f32], w: &[f32], n_l: usize, n_out: usize) -> Vec<f32> {
        let mut out = vec![1f32; n_out + 1];
        for (j, o) in out.iter_mut().enumerate().skip(1) {
            let mut sum = w[j];
            for k in 1..=n_l {
                sum += w[k * (n_out + 1) + j] * l[k];
            }
            *o = sigmoid(sum);
        }
        out
    }

    /// The error terms of the output layer, and their summed magnitude.
    pub fn output_error(output: &[f32], target: &[f32]) -> (Vec<f32>, f32) {
        let mut delta = vec![0f32; output.len()];
        let mut err = 0f32;
        for j in 1..output.len() {
            let (o, t) = (output[j], target[j]);
            delta[j] = o * (1.0 - o) * (t - o);
            err += delta[j].abs();
        }
        (delta, err)
    }

    /// The error terms of the hidden layer, and their summed magnitude.
    pub fn hidden_error(hidden: &[f32], out_delta: &[f32], who: &[f32]) -> (Vec<f32>, f32) {
        let n_out = out_delta.len() - 1;
        let mut delta = vec![0f32; hidden.len()];
        let mut err = 0f32;
        for j in 1..hidden.len() {
            let h = hidden[j];
            let sum: f32 = (1..=n_out).map(|k| out_delta[k] * who[j * (n_out + 1) + k]).sum();
            delta[j] = h * (1.0 - h) * sum;
            err += delta[j].abs();
        }
        (delta, err)
    }

    /// One training step (Rodinia's `bpnn_train_kernel`), with the input layer computed as the
    /// three kernels do; updates the weights and returns (output error, hidden error).
    pub fn train_step(net: &mut Net) -> (f32, f32) {
        let (n_in, n_hid, n_out) = (net.n_in, net.n_hid, net.n_out);
        let partial = layer_partials(&net.input, &net.input_weights, n_in, n_hid);
        let mut hidden = vec![1f32; n_hid + 1];
        squash(&partial, &net.input_weights, &mut hidden, n_in, n_hid);
        let output = layer(&hidden, &net.hidden_weights, n_hid, n_out);
        let (out_delta, out_err) = output_error(&output, &net.target);
        let (hid_delta, hid_err) = hidden_error(&hidden, &out_delta, &net.hidden_weights);
        adjust_weights(
            &out_delta,
            &hidden,
            &mut net.hidden_weights,
            &mut net.hidden_prev,
            n_hid,
            n_out,
            ETA,
            MOMENTUM,
        );
        adjust_weights(
            &hid_delta,
            &net.input,
            &mut net.input_weights,
            &mut net.input_prev,
            n_in,
            n_hid,
            ETA,
            MOMENTUM,
        );
        (out_err, hid_err)
    }
}

#[cfg(test)]
mod tests {
    use super::reference;

    #[test]
    fn training_steps_run_and_change_the_weights() {
        // Few inputs, so the hidden units do not saturate (with Rodinia's 65,536 they do).
        let mut net = reference::net(3, 4, 2);
        let before = net.input_weights.clone();
        let (out_err, hid_err) = reference::train_step(&mut net);
        assert!(out_err.is_finite() && hid_err.is_finite() && out_err > 0.0 && hid_err > 0.0);
        assert!(net.input_weights != before, "the input weights changed");
        // The previous changes now hold this step's changes.
        let changed = net.input_weights.iter().zip(&before).map(|(a, b)| a - b);
        assert!(changed
            .zip(&net.input_prev)
            .all(|(d, p)| (d - p).abs() <= 1e-6 * (1.0 + p.abs()) + 1e-6));
    }
}
