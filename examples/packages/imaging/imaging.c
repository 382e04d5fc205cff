/*
 * C implementations of the imaging package (see package.toml), built into libimaging.so by
 * scripts/build-packages.sh:
 *
 *     cc -O2 -shared -fPIC -I crates/capi/include -o libimaging.so imaging.c
 *
 * Each function runs rows row_begin..row_end of dimension 0; the daemon checked the size rules,
 * so the buffers are large enough.
 */
#include <agora_kernel.h>

AGORA_KERNEL int imaging_scale(const AgoraKernelArgs *args, uint64_t row_begin, uint64_t row_end) {
    float a = agora_f32(args, 0);
    const float *x = (const float *)args->args[1].data;
    float *y = (float *)args->args[2].data;
    for (uint64_t i = row_begin; i < row_end; i++) y[i] = a * x[i];
    return 0;
}

AGORA_KERNEL int imaging_blur(const AgoraKernelArgs *args, uint64_t row_begin, uint64_t row_end) {
    int64_t w = agora_i32(args, 0);
    int64_t h = agora_i32(args, 1);
    const float *src = (const float *)args->args[2].data;
    float *dst = (float *)args->args[3].data;
    for (int64_t r = (int64_t)row_begin; r < (int64_t)row_end; r++) {
        int64_t up = r > 0 ? r - 1 : 0;
        int64_t down = r + 1 < h ? r + 1 : h - 1;
        for (int64_t c = 0; c < w; c++) {
            int64_t left = c > 0 ? c - 1 : 0;
            int64_t right = c + 1 < w ? c + 1 : w - 1;
            float sum = src[r * w + c] + src[up * w + c] + src[down * w + c] + src[r * w + left] + src[r * w + right];
            dst[r * w + c] = sum / 5.0f;
        }
    }
    return 0;
}
