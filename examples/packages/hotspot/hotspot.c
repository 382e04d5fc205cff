/* Rodinia HotSpot, CPU implementation of hotspot.step (see package.toml and hotspot.cl).
 *
 * Rows row_begin..row_end of the grid; a neighbour outside the grid counts as the cell itself.
 * The arithmetic is the OpenCL kernel's, in the same order, so both give the same floats. */
#include <agora_kernel.h>

AGORA_KERNEL int hotspot_step(const AgoraKernelArgs *a, uint64_t row_begin, uint64_t row_end) {
    const float *power = (const float *)a->args[0].data;
    const float *src = (const float *)a->args[1].data;
    float *dst = (float *)a->args[2].data;
    const int64_t rows = agora_i32(a, 3), cols = agora_i32(a, 4);
    const float step_div_cap = agora_f32(a, 5), rx_1 = agora_f32(a, 6), ry_1 = agora_f32(a, 7);
    const float rz_1 = agora_f32(a, 8), amb = agora_f32(a, 9);
    for (int64_t r = (int64_t)row_begin; r < (int64_t)row_end; r++) {
        for (int64_t c = 0; c < cols; c++) {
            const int64_t i = r * cols + c;
            const float t = src[i];
            const float n = r > 0 ? src[i - cols] : t;
            const float s = r + 1 < rows ? src[i + cols] : t;
            const float w = c > 0 ? src[i - 1] : t;
            const float e = c + 1 < cols ? src[i + 1] : t;
            dst[i] = t + step_div_cap * (power[i] + (s + n - 2.0f * t) * ry_1 + (e + w - 2.0f * t) * rx_1 +
                                         (amb - t) * rz_1);
        }
    }
    return 0;
}
