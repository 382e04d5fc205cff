// CUDA implementations of the imaging package (see package.toml), for NVIDIA GPUs: the same
// kernels as imaging.cl. Both follow the guarded convention of docs/KERNELS.md: the declared
// parameters, then the range guards, the revocation flag and the row offset.
//
// A launch (or a row slice of it) runs rows row_offset..range0 of dimension 0: range0 is the end
// row of the slice, not the problem size, and the grid's first block starts at row_offset. Work
// items at or beyond the guards, and all of them once *revoke is non-zero, return at once.

extern "C" __global__ void imaging_scale_cuda(float a, const float *x, float *y,
                                              unsigned long long range0, unsigned long long range1,
                                              unsigned long long range2,
                                              const volatile unsigned char *revoke,
                                              unsigned long long row_offset) {
    unsigned long long i = row_offset + (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= range0 || *revoke) return;
    y[i] = a * x[i];
}

// Row r, column c: dimension 0 (x) is the row, so a row slice of the launch is a band of rows;
// dimension 1 (y) is the column.
extern "C" __global__ void imaging_blur_cuda(int w, int h, const float *src, float *dst,
                                             unsigned long long range0, unsigned long long range1,
                                             unsigned long long range2,
                                             const volatile unsigned char *revoke,
                                             unsigned long long row_offset) {
    unsigned long long r = row_offset + (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x;
    unsigned long long c = (unsigned long long)blockIdx.y * blockDim.y + threadIdx.y;
    if (r >= range0 || c >= range1 || *revoke) return;
    int up = r > 0 ? (int)r - 1 : 0;
    int down = (int)r + 1 < h ? (int)r + 1 : h - 1;
    int left = c > 0 ? (int)c - 1 : 0;
    int right = (int)c + 1 < w ? (int)c + 1 : w - 1;
    int row = (int)r * w;
    float sum = src[row + (int)c] + src[up * w + (int)c] + src[down * w + (int)c] + src[row + left] + src[row + right];
    dst[row + (int)c] = sum / 5.0f;
}
