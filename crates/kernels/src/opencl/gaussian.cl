// Rodinia Gaussian elimination (gaussian.fan1, gaussian.fan2); index arithmetic as in Rodinia's
// OpenCL version. Guarded (see OpenClImpl in ../lib.rs): work items outside the live rows and
// columns, or beyond the launch range, return.

__kernel void fan1(__global float *m, __global const float *a, const int size, const int t,
                   const ulong range0, const ulong range1, const ulong range2,
                   __global const volatile uchar *revoke) {
    if (*revoke) return; // revoked: this work-group stops (see OpenClImpl in ../lib.rs)
    int i = get_global_id(0);
    if (i >= range0) return;
    if (i < size - 1 - t) {
        m[size * (i + t + 1) + t] = a[size * (i + t + 1) + t] / a[size * t + t];
    }
}

__kernel void fan2(__global const float *m, __global float *a, __global float *b, const int size, const int t,
                   const ulong range0, const ulong range1, const ulong range2,
                   __global const volatile uchar *revoke) {
    if (*revoke) return; // revoked: this work-group stops (see OpenClImpl in ../lib.rs)
    int x = get_global_id(0);
    int y = get_global_id(1);
    if (x >= range0 || y >= range1) return;
    if (x < size - 1 - t && y < size - t) {
        a[size * (x + 1 + t) + (y + t)] -= m[size * (x + 1 + t) + t] * a[size * t + (y + t)];
        if (y == 0) {
            b[x + 1 + t] -= m[size * (x + 1 + t) + (y + t)] * b[t];
        }
    }
}
