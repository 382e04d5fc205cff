// A tenant's CUDA C program, as `session.program_cuda` sends it: plain `extern "C"` kernels, one
// thread per work item (the grid covers the range exactly). Used by the test suite (with
// tenant-cuda.toml) on machines with and without a GPU.

// y = a * x + y; range (n).
extern "C" __global__ void saxpy(float a, const float *x, float *y) {
    unsigned long long i = blockIdx.x * (unsigned long long)blockDim.x + threadIdx.x;
    y[i] = a * x[i] + y[i];
}

// hits[0] += 1 per work item; range (n).
extern "C" __global__ void __launch_bounds__(1024) count(int *hits) { atomicAdd(hits, 1); }
