/* Rodinia PathFinder, CPU implementation of pathfinder.row (see package.toml and pathfinder.cl).
 *
 * Columns row_begin..row_end of dst; sums wrap (through uint32_t), as in the OpenCL kernel, so
 * hostile data cannot cause undefined behaviour. */
#include <agora_kernel.h>

AGORA_KERNEL int pathfinder_row(const AgoraKernelArgs *a, uint64_t row_begin, uint64_t row_end) {
    const int32_t *wall = (const int32_t *)a->args[0].data;
    const int32_t *src = (const int32_t *)a->args[1].data;
    int32_t *dst = (int32_t *)a->args[2].data;
    const uint64_t cols = (uint64_t)agora_i32(a, 3), row = (uint64_t)agora_i32(a, 4);
    for (uint64_t c = row_begin; c < row_end; c++) {
        int32_t best = src[c];
        if (c > 0 && src[c - 1] < best) best = src[c - 1];
        if (c + 1 < cols && src[c + 1] < best) best = src[c + 1];
        dst[c] = (int32_t)((uint32_t)wall[row * cols + c] + (uint32_t)best);
    }
    return 0;
}
