// The four STREAM kernels (McCalpin), single precision, one element per work item.
// Range: n. Guarded (see OpenClImpl in ../lib.rs).

__kernel void stream_copy(__global const float *a, __global float *c,
                   const ulong range0, const ulong range1, const ulong range2,
                   __global const volatile uchar *revoke) {
    if (*revoke) return; // revoked: this work-group stops (see OpenClImpl in ../lib.rs)
    size_t i = get_global_id(0);
    if (i >= range0) return;
    c[i] = a[i];
}

__kernel void stream_scale(const float scalar, __global const float *c, __global float *b,
                    const ulong range0, const ulong range1, const ulong range2,
                    __global const volatile uchar *revoke) {
    if (*revoke) return; // revoked: this work-group stops (see OpenClImpl in ../lib.rs)
    size_t i = get_global_id(0);
    if (i >= range0) return;
    b[i] = scalar * c[i];
}

__kernel void stream_add(__global const float *a, __global const float *b, __global float *c,
                  const ulong range0, const ulong range1, const ulong range2,
                  __global const volatile uchar *revoke) {
    if (*revoke) return; // revoked: this work-group stops (see OpenClImpl in ../lib.rs)
    size_t i = get_global_id(0);
    if (i >= range0) return;
    c[i] = a[i] + b[i];
}

__kernel void stream_triad(const float scalar, __global const float *b, __global const float *c, __global float *a,
                    const ulong range0, const ulong range1, const ulong range2,
                    __global const volatile uchar *revoke) {
    if (*revoke) return; // revoked: this work-group stops (see OpenClImpl in ../lib.rs)
    size_t i = get_global_id(0);
    if (i >= range0) return;
    a[i] = b[i] + scalar * c[i];
}
