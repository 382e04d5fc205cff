// The conjugate-gradient building blocks of the HPCCG mini-app (single precision):
// hpccg.spmv (CSR sparse matrix-vector product), hpccg.dot (blocked partial dot products) and
// hpccg.waxpby (w = alpha*x + beta*y). Guarded (see OpenClImpl in ../lib.rs).

// Elements per partial sum of hpccg.dot (DOT_BLOCK in ../hpccg.rs).
#define DOT_BLOCK 1024

// Range: rows. y[r] = sum of vals[k] * x[cols[k]] for k in row_ptr[r] .. row_ptr[r+1]-1, in order.
// The index arrays are data, so they are sanitised: row bounds are clamped to 0..nnz and entries
// whose column lies outside 0..ncols-1 are skipped (the CPU implementation does the same).
__kernel void spmv(__global const int *row_ptr, __global const int *cols, __global const float *vals,
                   __global const float *x, __global float *y, const int ncols, const int nnz,
                   const ulong range0, const ulong range1, const ulong range2,
                   __global const volatile uchar *revoke) {
    if (*revoke) return; // revoked: this work-group stops (see OpenClImpl in ../lib.rs)
    size_t r = get_global_id(0);
    if (r >= range0) return;
    int start = clamp(row_ptr[r], 0, nnz);
    int end = clamp(row_ptr[r + 1], start, nnz);
    float sum = 0.0f;
    for (int k = start; k < end; k++) {
        int c = cols[k];
        if (c >= 0 && c < ncols) sum += vals[k] * x[c];
    }
    y[r] = sum;
}

// Range: ceil(n / DOT_BLOCK). partial[b] = sum of x[i]*y[i] over i in b*DOT_BLOCK .. min(n, (b+1)*DOT_BLOCK)-1,
// in order; the host adds the partial sums in order.
__kernel void dot_partials(const int n, __global const float *x, __global const float *y, __global float *partial,
                  const ulong range0, const ulong range1, const ulong range2,
                  __global const volatile uchar *revoke) {
    if (*revoke) return; // revoked: this work-group stops (see OpenClImpl in ../lib.rs)
    size_t b = get_global_id(0);
    if (b >= range0) return;
    size_t first = b * DOT_BLOCK;
    size_t end = min(first + DOT_BLOCK, (size_t)n);
    float sum = 0.0f;
    for (size_t i = first; i < end; i++) {
        sum += x[i] * y[i];
    }
    partial[b] = sum;
}

// Range: n. w[i] = alpha*x[i] + beta*y[i].
__kernel void waxpby(const float alpha, __global const float *x, const float beta, __global const float *y,
                     __global float *w, const ulong range0, const ulong range1, const ulong range2,
                     __global const volatile uchar *revoke) {
    if (*revoke) return; // revoked: this work-group stops (see OpenClImpl in ../lib.rs)
    size_t i = get_global_id(0);
    if (i >= range0) return;
    w[i] = alpha * x[i] + beta * y[i];
}
