/* CPU implementations of the bench package's kernels (see bench.cl for what each computes), with
 * the C calling convention of agora_kernel.h. `agora bench kernels` also calls these functions
 * directly, as the native baseline. */
#include <agora_kernel.h>

AGORA_KERNEL int bench_stencil(const AgoraKernelArgs *a, uint64_t row_begin, uint64_t row_end) {
    const float *in = (const float *)a->args[0].data;
    float *out = (float *)a->args[1].data;
    const int64_t rows = agora_i32(a, 2), cols = agora_i32(a, 3);
    for (int64_t r = (int64_t)row_begin; r < (int64_t)row_end; r++) {
        for (int64_t c = 0; c < cols; c++) {
            const int64_t i = r * cols + c;
            if (r == 0 || c == 0 || r == rows - 1 || c == cols - 1) {
                out[i] = in[i];
            } else {
                out[i] = 0.5f * in[i] + 0.125f * (in[i - cols] + in[i + cols] + in[i - 1] + in[i + 1]);
            }
        }
    }
    return 0;
}

AGORA_KERNEL int bench_matmul(const AgoraKernelArgs *a, uint64_t row_begin, uint64_t row_end) {
    const float *x = (const float *)a->args[0].data;
    const float *y = (const float *)a->args[1].data;
    float *z = (float *)a->args[2].data;
    const int64_t n = agora_i32(a, 3);
    for (int64_t i = (int64_t)row_begin; i < (int64_t)row_end; i++) {
        float *zr = z + i * n;
        for (int64_t j = 0; j < n; j++) zr[j] = 0.0f;
        for (int64_t k = 0; k < n; k++) {
            const float xik = x[i * n + k];
            const float *yr = y + k * n;
            for (int64_t j = 0; j < n; j++) zr[j] += xik * yr[j];
        }
    }
    return 0;
}

AGORA_KERNEL int bench_reduce(const AgoraKernelArgs *a, uint64_t row_begin, uint64_t row_end) {
    const float *in = (const float *)a->args[0].data;
    float *out = (float *)a->args[1].data;
    const int64_t n = agora_i32(a, 2);
    for (int64_t g = (int64_t)row_begin; g < (int64_t)row_end; g++) {
        float sum = 0.0f;
        for (int64_t k = 0; k < 256; k++) {
            const int64_t i = g * 256 + k;
            if (i < n) sum += in[i];
        }
        out[g] = sum;
    }
    return 0;
}

AGORA_KERNEL int bench_empty(const AgoraKernelArgs *a, uint64_t row_begin, uint64_t row_end) {
    (void)a;
    (void)row_begin;
    (void)row_end;
    return 0;
}
