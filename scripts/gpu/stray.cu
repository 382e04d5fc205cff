// The fencing test's hostile tenant kernel (`STRAY_WRITER` in crates/client/tests/gpu.rs), in CUDA
// C and launched natively, **unfenced**: what the kernel does to a GPU without Agora's fence.
// scripts/gpu-check.sh builds it with nvcc and runs it under compute-sanitizer, which must report
// its out-of-bounds writes; run alone, the launch leaves the context unusable (an illegal address
// is a sticky error), which is why the fence masks addresses instead of trapping.
//
//   nvcc -o stray scripts/gpu/stray.cu && compute-sanitizer --tool memcheck ./stray
#include <cstdio>
#include <cuda_runtime.h>

__global__ void stray(float *out, long long delta, long long stride) {
    unsigned long long i = blockIdx.x * (unsigned long long)blockDim.x + threadIdx.x;
    float *p = out + delta + (long long)i * stride;
    *p = 13.0f;
    atomicAdd((int *)(p + 1), 7);
}

int main() {
    float *mine = nullptr;
    if (cudaMalloc(&mine, 1 << 20) != cudaSuccess) {
        fprintf(stderr, "stray: cudaMalloc failed\n");
        return 2;
    }
    // As in the fencing test: threads 2^16 floats (256 KiB) apart, from 4 GiB below the buffer.
    stray<<<(1 << 20) / 256, 256>>>(mine, -(1LL << 30), 1LL << 16);
    cudaError_t launched = cudaGetLastError();
    cudaError_t finished = cudaDeviceSynchronize();
    printf("stray: launch %s, then %s\n", cudaGetErrorName(launched), cudaGetErrorName(finished));
    // The writes stray outside every allocation: the context is lost (exit 1), or, under a tool
    // that stops them, the tool reports them.
    return finished == cudaSuccess ? 0 : 1;
}
