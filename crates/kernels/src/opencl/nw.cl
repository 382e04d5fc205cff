// Rodinia Needleman-Wunsch (nw.diagonal): one diagonal of blocks of the score matrix per launch.
//
// The score matrix has (n+1) x (n+1) cells; row 0 and column 0 hold the gap penalties. The
// interior is cut into blocks of `block` x `block` cells (the last row and column of blocks may
// be partial); the blocks (bi, bj) with bi + bj = diagonal depend only on blocks of earlier
// diagonals, so they are independent. Work item x computes block bi = first + x, row by row, with
// Rodinia's recurrence
//     score[i][j] = max(score[i-1][j-1] + reference[i][j], score[i][j-1] - penalty,
//                       score[i-1][j] - penalty).
// block = 1 makes one launch one anti-diagonal of cells. Rodinia's OpenCL kernels run one
// 16 x 16 block per work-group, in local memory; here one work item runs one block, so the
// kernel works with any work-group size.
//
// Arithmetic wraps (through uint) so hostile scores cannot cause undefined behaviour.
// Range: the number of blocks on the diagonal. Guarded (see OpenClImpl in ../lib.rs).

int wrap_add(int a, int b) { return as_int(as_uint(a) + as_uint(b)); }
int wrap_sub(int a, int b) { return as_int(as_uint(a) - as_uint(b)); }

__kernel void diagonal(__global int *score, __global const int *reference, const int n, const int penalty,
                       const int diag, const int block,
                       const ulong range0, const ulong range1, const ulong range2,
                       __global const volatile uchar *revoke) {
    if (*revoke) return; // revoked: this work-group stops (see OpenClImpl in ../lib.rs)
    size_t x = get_global_id(0);
    if (x >= range0) return;
    int blocks = (n + block - 1) / block;
    int first = max(0, diag - blocks + 1);
    int last = min(diag, blocks - 1);
    if (x > (size_t)(last - first)) return;
    int bi = first + (int)x;
    int bj = diag - bi;
    size_t cols = (size_t)n + 1;
    int r0 = bi * block + 1, r1 = min(r0 + block, n + 1);
    int c0 = bj * block + 1, c1 = min(c0 + block, n + 1);
    for (int r = r0; r < r1; r++) {
        for (int c = c0; c < c1; c++) {
            size_t i = (size_t)r * cols + (size_t)c;
            int nw = wrap_add(score[i - cols - 1], reference[i]);
            int w = wrap_sub(score[i - 1], penalty);
            int up = wrap_sub(score[i - cols], penalty);
            score[i] = max(nw, max(w, up));
        }
    }
}
