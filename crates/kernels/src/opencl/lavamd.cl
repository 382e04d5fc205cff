// Rodinia lavaMD (lavamd.boxes): particle potentials and forces in a 3-D grid of boxes.
//
// The space is boxes1d^3 boxes (box number = (z*boxes1d + y)*boxes1d + x), each holding
// par_per_box particles; particle p (of box p / par_per_box) has rv[4p..4p+3] = (v, x, y, z)
// and charge qv[p]. Work item p sums, over the particles j of its home box and then of the
// neighbouring boxes in Rodinia's order (dz, dy, dx from -1 to 1, skipping the home box and
// boxes outside the grid):
//     r2 = v_p + v_j - (x_p*x_j + y_p*y_j + z_p*z_j); vij = exp(-a2*r2), a2 = 2*alpha^2
//     fv[p].v += q_j*vij;  fv[p].{x,y,z} += q_j * 2*vij * (pos_p - pos_j)
// Rodinia's OpenCL kernel runs one box per work-group with the home and neighbour particles in
// local memory; here one work item is one particle (any work-group size), with the same
// arithmetic and summation order.
//
// Range: boxes1d^3 * par_per_box. Guarded (see OpenClImpl in ../lib.rs).

__kernel void boxes(__global const float *rv, __global const float *qv, __global float *fv, const int boxes1d,
                    const int par_per_box, const float alpha,
                    const ulong range0, const ulong range1, const ulong range2,
                    __global const volatile uchar *revoke) {
    if (*revoke) return; // revoked: this work-group stops (see OpenClImpl in ../lib.rs)
    size_t p = get_global_id(0);
    size_t nb = (size_t)boxes1d;
    if (p >= range0 || p >= nb * nb * nb * (size_t)par_per_box) return;
    float a2 = 2.0f * alpha * alpha;
    int home = (int)(p / (size_t)par_per_box);
    int bx = home % boxes1d, by = (home / boxes1d) % boxes1d, bz = home / (boxes1d * boxes1d);
    float pv = rv[4 * p], px = rv[4 * p + 1], py = rv[4 * p + 2], pz = rv[4 * p + 3];
    float fv_v = 0.0f, fv_x = 0.0f, fv_y = 0.0f, fv_z = 0.0f;
    // k = 0 is the home box; k = 1..27 walk the neighbours (dz, dy, dx) in order.
    for (int k = 0; k < 28; k++) {
        int box;
        if (k == 0) {
            box = home;
        } else {
            int dz = (k - 1) / 9 - 1, dy = ((k - 1) / 3) % 3 - 1, dx = (k - 1) % 3 - 1;
            int x = bx + dx, y = by + dy, z = bz + dz;
            if ((dx == 0 && dy == 0 && dz == 0) || x < 0 || y < 0 || z < 0 || x >= boxes1d || y >= boxes1d ||
                z >= boxes1d)
                continue;
            box = (z * boxes1d + y) * boxes1d + x;
        }
        size_t first = (size_t)box * (size_t)par_per_box;
        for (int j = 0; j < par_per_box; j++) {
            size_t q = first + (size_t)j;
            float qv_ = rv[4 * q], qx = rv[4 * q + 1], qy = rv[4 * q + 2], qz = rv[4 * q + 3];
            float r2 = pv + qv_ - (px * qx + py * qy + pz * qz);
            float u2 = a2 * r2;
            float vij = exp(-u2);
            float fs = 2.0f * vij;
            float charge = qv[q];
            fv_v += charge * vij;
            fv_x += charge * (fs * (px - qx));
            fv_y += charge * (fs * (py - qy));
            fv_z += charge * (fs * (pz - qz));
        }
    }
    fv[4 * p] = fv_v;
    fv[4 * p + 1] = fv_x;
    fv[4 * p + 2] = fv_y;
    fv[4 * p + 3] = fv_z;
}
