// Rodinia Back Propagation: the input layer's forward pass and weight adjustment.
//
// Layout as in Rodinia: input units x[0..n_in] (x[0] is the bias unit, 1.0), hidden units
// h[0..n_hid], weights w[i][j] at w[i*(n_hid+1) + j] for input i and hidden unit j (column 0
// unused). The input layer is cut into blocks of BLOCK = 16 inputs (Rodinia's HEIGHT).
//
// Rodinia's forward kernel multiplies a 16 x 16 tile in local memory and tree-reduces it; here
// work item (b, j) sums its block sequentially, so it works with any work-group size and the CPU
// and OpenCL implementations add in the same order. Guarded (see OpenClImpl in ../lib.rs).

#define BLOCK 16

// layerforward: range (ceil(n_in / BLOCK), n_hid).
// partial[b*n_hid + j] = sum over inputs i in 1+b*BLOCK ..= min((b+1)*BLOCK, n_in) of x[i]*w[i][j+1].
__kernel void layerforward(__global const float *x, __global const float *w, __global float *partial,
                           const int n_in, const int n_hid,
                           const ulong range0, const ulong range1, const ulong range2,
                           __global const volatile uchar *revoke) {
    if (*revoke) return; // revoked: this work-group stops (see OpenClImpl in ../lib.rs)
    size_t b = get_global_id(0);
    size_t j = get_global_id(1);
    size_t blocks = ((size_t)n_in + BLOCK - 1) / BLOCK;
    if (b >= range0 || j >= range1 || b >= blocks || j >= (size_t)n_hid) return;
    size_t stride = (size_t)n_hid + 1;
    size_t first = b * BLOCK + 1;
    size_t end = min(first + BLOCK, (size_t)n_in + 1);
    float sum = 0.0f;
    for (size_t i = first; i < end; i++) {
        sum += x[i] * w[i * stride + j + 1];
    }
    partial[b * (size_t)n_hid + j] = sum;
}

// squash: range n_hid. h[j+1] = 1 / (1 + exp(-(sum over blocks b of partial[b*n_hid + j] + w[0][j+1]))),
// the part Rodinia's host does after the forward kernel.
__kernel void squash(__global const float *partial, __global const float *w, __global float *h, const int n_in,
                     const int n_hid, const ulong range0, const ulong range1, const ulong range2,
                     __global const volatile uchar *revoke) {
    if (*revoke) return; // revoked: this work-group stops (see OpenClImpl in ../lib.rs)
    size_t j = get_global_id(0);
    if (j >= range0 || j >= (size_t)n_hid) return;
    size_t blocks = ((size_t)n_in + BLOCK - 1) / BLOCK;
    float sum = 0.0f;
    for (size_t b = 0; b < blocks; b++) {
        sum += partial[b * (size_t)n_hid + j];
    }
    sum += w[j + 1];
    h[j + 1] = 1.0f / (1.0f + exp(-sum));
}

// adjust_weights: range (n_in + 1, n_hid). For input i and hidden unit k = j + 1:
//     dw = eta * delta[k] * ly[i] + momentum * oldw[i][k];  w[i][k] += dw;  oldw[i][k] = dw.
__kernel void adjust_weights(__global const float *delta, __global const float *ly, __global float *w,
                             __global float *oldw, const int n_in, const int n_hid, const float eta,
                             const float momentum, const ulong range0, const ulong range1, const ulong range2,
                             __global const volatile uchar *revoke) {
    if (*revoke) return; // revoked: this work-group stops (see OpenClImpl in ../lib.rs)
    size_t i = get_global_id(0);
    size_t j = get_global_id(1);
    if (i >= range0 || j >= range1 || i > (size_t)n_in || j >= (size_t)n_hid) return;
    size_t k = j + 1;
    size_t index = i * ((size_t)n_hid + 1) + k;
    float dw = eta * delta[k] * ly[i] + momentum * oldw[index];
    w[index] += dw;
    oldw[index] = dw;
}
