// OpenCL C as CUDA C: what lets the kernel library's OpenCL sources (crates/kernels/src/opencl)
// compile with NVRTC unchanged, so every built-in kernel has one source for both backends.
//
// Calling convention on CUDA (see the `cuda` module of agora-devices): a guarded kernel's
// parameters are its declared ones, then `range0, range1, range2` (ulong), then the revocation
// flag (a device pointer to one byte), then `agora_row_offset` (ulong): the first row of the
// slice this launch runs, which OpenCL passes as the global work offset and CUDA has no notion
// of. The backend appends that last parameter to every kernel that takes `revoke` before it
// compiles; kernels without it (plain kernels) are never sliced and see the offset 0 below.
// Helper functions without an execution space compile as __device__ (NVRTC's -default-device).

typedef unsigned char uchar;
typedef unsigned short ushort;
typedef unsigned int uint;
typedef unsigned long long ulong;

#define __kernel extern "C" __global__
#define __global
#define __local __shared__
#define __private
#define __constant const
#define CLK_LOCAL_MEM_FENCE 1
#define CLK_GLOBAL_MEM_FENCE 2
#define barrier(flags) __syncthreads()
#define mem_fence(flags) __threadfence_block()
// OpenCL attributes (the library uses only reqd_work_group_size, whose shape the backend
// launches as blocks: OpenClImpl::local) are removed from the source before it compiles: CUDA
// allows none before a kernel's `extern "C"`.

// The row offset of plain kernels (a guarded kernel's parameter of the same name hides it).
__constant__ ulong agora_row_offset = 0;

__device__ inline size_t agora_component(uint3 v, uint d) { return d == 0 ? v.x : d == 1 ? v.y : v.z; }
__device__ inline size_t agora_component(dim3 v, uint d) { return d == 0 ? v.x : d == 1 ? v.y : v.z; }

#define get_local_id(d) agora_component(threadIdx, (d))
#define get_group_id(d) agora_component(blockIdx, (d))
#define get_local_size(d) agora_component(blockDim, (d))
#define get_num_groups(d) agora_component(gridDim, (d))
#define get_global_offset(d) ((d) == 0 ? agora_row_offset : (ulong)0)
#define get_global_id(d) (get_global_offset(d) + get_group_id(d) * get_local_size(d) + get_local_id(d))
#define get_global_size(d) (get_num_groups(d) * get_local_size(d))
#define get_work_dim() 3

__device__ inline int as_int(uint x) { return (int)x; }
__device__ inline int as_int(float x) { return __float_as_int(x); }
__device__ inline uint as_uint(int x) { return (uint)x; }
__device__ inline uint as_uint(float x) { return __float_as_uint(x); }
__device__ inline float as_float(uint x) { return __uint_as_float(x); }
__device__ inline float as_float(int x) { return __int_as_float(x); }
__device__ inline int clamp(int x, int lo, int hi) { return min(max(x, lo), hi); }
__device__ inline uint clamp(uint x, uint lo, uint hi) { return min(max(x, lo), hi); }
__device__ inline float clamp(float x, float lo, float hi) { return fminf(fmaxf(x, lo), hi); }
__device__ inline size_t min(size_t a, size_t b) { return a < b ? a : b; }
__device__ inline size_t max(size_t a, size_t b) { return a > b ? a : b; }
__device__ inline float mad(float a, float b, float c) { return a * b + c; }

// OpenCL's 32-bit integer atomics on global or local memory (tenant programs use them).
#define atomic_add(p, v) atomicAdd((p), (v))
#define atomic_sub(p, v) atomicSub((p), (v))
#define atomic_xchg(p, v) atomicExch((p), (v))
#define atomic_min(p, v) atomicMin((p), (v))
#define atomic_max(p, v) atomicMax((p), (v))
#define atomic_and(p, v) atomicAnd((p), (v))
#define atomic_or(p, v) atomicOr((p), (v))
#define atomic_xor(p, v) atomicXor((p), (v))
#define atomic_inc(p) atomicAdd((p), 1)
#define atomic_dec(p) atomicSub((p), 1)
#define atomic_cmpxchg(p, cmp, v) atomicCAS((p), (cmp), (v))
