// Single-precision matrix multiply (sgemm): C = alpha*A*B + beta*C, row-major, A m x k, B k x n,
// C m x n (with beta = 0, C is not read, as in BLAS).
//
// Tiled: each 16 x 16 work-group computes one 16 x 16 tile of C, staging 16 x 16 tiles of A and B
// in local memory. It REQUIRES the work-group size (16, 16, 1) (OpenClImpl::local). The
// work-group whose first work item has global id (r0, c0) covers rows r0.. and columns c0..;
// inside it, work item (l0, l1) computes C[r0 + l1][c0 + l0] so that neighbouring work items (l0
// varies fastest) read and write neighbouring addresses. The tile's origin comes from
// get_global_id, not get_group_id, so a row slice launched with a global work offset (chunked
// launch) computes its own rows; the origin need not be a multiple of 16. Each element sums a[i][p]*b[p][j] for p = 0..k-1 in order,
// like the CPU implementation.
//
// Range (m, n), rounded up to whole tiles by the backend; work items outside the matrix (or beyond
// range0, the end of a row slice) load zeros and take part in the barriers but store nothing.
// Guarded (see OpenClImpl in ../lib.rs). Revocation is decided once per work-group (one work item
// reads the flag into local memory before a barrier), so the whole group returns together and no
// barrier is left waiting.

#define TILE 16

__attribute__((reqd_work_group_size(TILE, TILE, 1)))
__kernel void sgemm(const int m, const int n, const int k, const float alpha, __global const float *a,
                    __global const float *b, const float beta, __global float *c,
                    const ulong range0, const ulong range1, const ulong range2,
                    __global const volatile uchar *revoke) {
    __local float a_tile[TILE][TILE + 1];
    __local float b_tile[TILE][TILE + 1];
    __local uchar revoked;
    int l0 = get_local_id(0);
    int l1 = get_local_id(1);
    if (l0 == 0 && l1 == 0) revoked = *revoke;
    barrier(CLK_LOCAL_MEM_FENCE);
    if (revoked) return;
    int row = (int)(get_global_id(0) - l0) + l1;
    int col = (int)(get_global_id(1) - l1) + l0;
    float acc = 0.0f;
    for (int t = 0; t < k; t += TILE) {
        a_tile[l1][l0] = (row < m && t + l0 < k) ? a[(size_t)row * k + t + l0] : 0.0f;
        b_tile[l1][l0] = (t + l1 < k && col < n) ? b[(size_t)(t + l1) * n + col] : 0.0f;
        barrier(CLK_LOCAL_MEM_FENCE);
        for (int p = 0; p < TILE; p++) {
            acc += a_tile[l1][p] * b_tile[p][l0];
        }
        barrier(CLK_LOCAL_MEM_FENCE);
    }
    if (row < m && col < n && (ulong)row < range0 && (ulong)col < range1) {
        size_t i = (size_t)row * n + col;
        c[i] = beta == 0.0f ? alpha * acc : alpha * acc + beta * c[i];
    }
}
