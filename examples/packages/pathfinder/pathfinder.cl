// Rodinia PathFinder (pathfinder.row): one row of the dynamic programme per launch.
//
// dst[c] = wall[row][c] + min(src[c-1], src[c], src[c+1]), neighbours outside the row ignored;
// the host starts with src = wall[0] and ping-pongs src and dst for rows 1..rows-1. Rodinia's
// OpenCL kernel advances several rows per launch on a pyramid in local memory; one row per
// launch keeps the work items independent. Sums wrap (through uint) so hostile data cannot cause
// undefined behaviour.
//
// Range: cols. Guarded and revocable: the three range guards and the revocation flag follow the parameters (docs/KERNELS.md).

__kernel void row(__global const int *wall, __global const int *src, __global int *dst, const int cols,
                  const int row, const ulong range0, const ulong range1, const ulong range2,
                  __global const volatile uchar *revoke) {
    if (*revoke) return; // revoked: this work-group stops (docs/KERNELS.md)
    size_t c = get_global_id(0);
    if (c >= range0 || c >= (size_t)cols) return;
    int best = src[c];
    if (c > 0) best = min(best, src[c - 1]);
    if (c + 1 < (size_t)cols) best = min(best, src[c + 1]);
    dst[c] = as_int(as_uint(wall[(size_t)row * (size_t)cols + c]) + as_uint(best));
}
