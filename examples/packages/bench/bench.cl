// Kernels written by hand outside Agora's library for `agora bench kernels`: plain OpenCL C with
// no Agora calling convention (no range guards, no revocation flag), so the same source runs
// natively, as this package's kernels and as a tenant program, unchanged.

// 2-D 5-point stencil (one Jacobi step): interior cells average with their four neighbours,
// border cells are copied. Range (rows, cols).
__kernel void stencil(__global const float *in, __global float *out, const int rows, const int cols) {
    const int r = get_global_id(0);
    const int c = get_global_id(1);
    const int i = r * cols + c;
    if (r == 0 || c == 0 || r == rows - 1 || c == cols - 1) {
        out[i] = in[i];
    } else {
        out[i] = 0.5f * in[i] + 0.125f * (in[i - cols] + in[i + cols] + in[i - 1] + in[i + 1]);
    }
}

// Blocked matrix multiply c = a * b of n x n matrices (n a multiple of 16), 16 x 16 tiles in
// local memory. Range (n, n); the kernel requires work-groups of 16 x 16 (reqd_work_group_size, so
// a caller that passes no local size, e.g. a tenant program, gets them too).
__kernel __attribute__((reqd_work_group_size(16, 16, 1)))
void matmul(__global const float *a, __global const float *b, __global float *c, const int n) {
    __local float ta[16][16];
    __local float tb[16][16];
    const int row = get_global_id(0);
    const int col = get_global_id(1);
    const int lr = get_local_id(0);
    const int lc = get_local_id(1);
    float sum = 0.0f;
    for (int t = 0; t < n; t += 16) {
        ta[lr][lc] = a[row * n + t + lc];
        tb[lr][lc] = b[(t + lr) * n + col];
        barrier(CLK_LOCAL_MEM_FENCE);
        for (int k = 0; k < 16; k++) sum += ta[lr][k] * tb[k][lc];
        barrier(CLK_LOCAL_MEM_FENCE);
    }
    c[row * n + col] = sum;
}

// Reduction, first level: out[g] = the sum of in[g*256 .. g*256+255] (elements past n count 0).
// Range ceil(n / 256).
__kernel void reduce(__global const float *in, __global float *out, const int n) {
    const int g = get_global_id(0);
    float sum = 0.0f;
    for (int k = 0; k < 256; k++) {
        const int i = g * 256 + k;
        if (i < n) sum += in[i];
    }
    out[g] = sum;
}

// Nothing: the round trip of a launch.
__kernel void empty(__global int *unused) {}
