// OpenCL implementations of the imaging package (see package.toml). Both kernels follow the
// guarded, revocable convention of docs/KERNELS.md: the declared parameters, then the range
// guards and the revocation flag.

__kernel void imaging_scale(const float a, __global const float *x, __global float *y,
                            const ulong range0, const ulong range1, const ulong range2,
                            __global const volatile uchar *revoke) {
    size_t i = get_global_id(0);
    if (i >= range0 || *revoke) return;
    y[i] = a * x[i];
}

// Row r, column c: dimension 0 is the row, so a row slice of the launch is a band of rows.
__kernel void imaging_blur(const int w, const int h, __global const float *src, __global float *dst,
                           const ulong range0, const ulong range1, const ulong range2,
                           __global const volatile uchar *revoke) {
    size_t r = get_global_id(0);
    size_t c = get_global_id(1);
    if (r >= range0 || c >= range1 || *revoke) return;
    int up = r > 0 ? (int)r - 1 : 0;
    int down = (int)r + 1 < h ? (int)r + 1 : h - 1;
    int left = c > 0 ? (int)c - 1 : 0;
    int right = (int)c + 1 < w ? (int)c + 1 : w - 1;
    int row = (int)r * w;
    float sum = src[row + (int)c] + src[up * w + (int)c] + src[down * w + (int)c] + src[row + left] + src[row + right];
    dst[row + (int)c] = sum / 5.0f;
}
