// Elementwise kernels: noop, saxpy, vector_add, fill.
// Calling convention: see OpenClImpl in ../lib.rs. Every kernel is guarded: the trailing
// range0..range2 bound the rows and columns to run (range0 is the end of a row slice); work items
// beyond them return, and so does every work item that finds the revocation flag set.

__kernel void noop(const ulong range0, const ulong range1, const ulong range2,
                   __global const volatile uchar *revoke) {}

__kernel void saxpy(const float a, __global const float *x, __global float *y,
                    const ulong range0, const ulong range1, const ulong range2,
                    __global const volatile uchar *revoke) {
    if (*revoke) return; // revoked: this work-group stops (see OpenClImpl in ../lib.rs)
    size_t i = get_global_id(0);
    if (i >= range0) return;
    y[i] = a * x[i] + y[i];
}

__kernel void vector_add(__global const float *a, __global const float *b, __global float *c,
                         const ulong range0, const ulong range1, const ulong range2,
                         __global const volatile uchar *revoke) {
    if (*revoke) return; // revoked: this work-group stops (see OpenClImpl in ../lib.rs)
    size_t i = get_global_id(0);
    if (i >= range0) return;
    c[i] = a[i] + b[i];
}

__kernel void fill(const float value, __global float *y,
                   const ulong range0, const ulong range1, const ulong range2,
                   __global const volatile uchar *revoke) {
    if (*revoke) return; // revoked: this work-group stops (see OpenClImpl in ../lib.rs)
    size_t i = get_global_id(0);
    if (i >= range0) return;
    y[i] = value;
}
