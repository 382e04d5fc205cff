// Rodinia HotSpot: one explicit time step of the thermal simulation per launch.
//
// Rodinia's OpenCL kernel runs several steps per launch on a pyramid of shrinking tiles in local
// memory; here one launch is one step over the whole grid (the host ping-pongs `src` and `dst`),
// with the same per-cell arithmetic and the same boundary rule: a neighbour outside the grid is
// replaced by the cell itself.
//
// Range (rows, cols): dimension 0 is the grid row, dimension 1 the column. Guarded and revocable:
// the three range guards and the revocation flag follow the parameters (docs/KERNELS.md).

__kernel void hotspot_step(__global const float *power, __global const float *src, __global float *dst,
                   const int rows, const int cols, const float step_div_cap, const float rx_1,
                   const float ry_1, const float rz_1, const float amb_temp,
                   const ulong range0, const ulong range1, const ulong range2,
                   __global const volatile uchar *revoke) {
    if (*revoke) return; // revoked: this work-group stops (docs/KERNELS.md)
    size_t r = get_global_id(0);
    size_t c = get_global_id(1);
    if (r >= range0 || c >= range1 || r >= (size_t)rows || c >= (size_t)cols) return;
    size_t i = r * (size_t)cols + c;
    float t = src[i];
    float n = r > 0 ? src[i - cols] : t;
    float s = r + 1 < (size_t)rows ? src[i + cols] : t;
    float w = c > 0 ? src[i - 1] : t;
    float e = c + 1 < (size_t)cols ? src[i + 1] : t;
    dst[i] = t + step_div_cap * (power[i] + (s + n - 2.0f * t) * ry_1 + (e + w - 2.0f * t) * rx_1 +
                                 (amb_temp - t) * rz_1);
}
