/*
 * agora_kernel.h: the C calling convention of CPU kernels you write for Agora.
 *
 * A kernel package (installed by the operator, see docs/KERNELS.md) or a tenant program
 * (session.program(library=...)) is a shared object exporting one function per kernel:
 *
 *     #include <agora_kernel.h>
 *
 *     AGORA_KERNEL int my_saxpy(const AgoraKernelArgs *args, uint64_t row_begin, uint64_t row_end) {
 *         float a = agora_f32(args, 0);
 *         const float *x = (const float *)args->args[1].data;
 *         float *y = (float *)args->args[2].data;
 *         for (uint64_t i = row_begin; i < row_end; i++) y[i] = a * x[i] + y[i];
 *         return 0;   // non-zero fails the task with that code logged
 *     }
 *
 * The function runs rows row_begin..row_end of dimension 0 of the launch's range; when the
 * manifest says the kernel is chunkable, several threads may call it at once for disjoint rows,
 * and a launch may be run as several calls (slices). Arguments come in the manifest's order.
 * Buffers are at least as large as the manifest's size rules say (the daemon checked them
 * before the call); their `len` is the whole buffer.
 */
#ifndef AGORA_KERNEL_H
#define AGORA_KERNEL_H

#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* Layout version: args->abi_version. */
#define AGORA_KERNEL_ABI_VERSION 1
/* Most arguments a kernel may declare. */
#define AGORA_KERNEL_MAX_ARGS 16

/* Marks an exported kernel function. */
#define AGORA_KERNEL __attribute__((visibility("default")))

/* One argument: a buffer (data, len) or a scalar's bits (32-bit scalars in the low half). */
typedef struct AgoraKernelArg {
    void *data;      /* buffer's first byte, 64-byte aligned; NULL for scalars */
    uint64_t len;    /* buffer's length in bytes; 0 for scalars */
    uint64_t scalar; /* scalar's bits; 0 for buffers */
} AgoraKernelArg;

typedef struct AgoraKernelArgs {
    uint32_t abi_version;                 /* AGORA_KERNEL_ABI_VERSION */
    uint32_t arg_count;                   /* arguments in signature order */
    uint64_t range[3];                    /* the launch's range; unused dimensions are 1 */
    AgoraKernelArg args[AGORA_KERNEL_MAX_ARGS]; /* arg_count entries are meaningful */
} AgoraKernelArgs;

/* The signature of every kernel function. */
typedef int (*AgoraKernelFn)(const AgoraKernelArgs *args, uint64_t row_begin, uint64_t row_end);

static inline float agora_f32(const AgoraKernelArgs *a, unsigned i) {
    union { uint32_t u; float f; } v; v.u = (uint32_t)a->args[i].scalar; return v.f;
}
static inline double agora_f64(const AgoraKernelArgs *a, unsigned i) {
    union { uint64_t u; double f; } v; v.u = a->args[i].scalar; return v.f;
}
static inline int32_t agora_i32(const AgoraKernelArgs *a, unsigned i) { return (int32_t)(uint32_t)a->args[i].scalar; }
static inline uint32_t agora_u32(const AgoraKernelArgs *a, unsigned i) { return (uint32_t)a->args[i].scalar; }
static inline int64_t agora_i64(const AgoraKernelArgs *a, unsigned i) { return (int64_t)a->args[i].scalar; }
static inline uint64_t agora_u64(const AgoraKernelArgs *a, unsigned i) { return a->args[i].scalar; }

#ifdef __cplusplus
}
#endif

#endif /* AGORA_KERNEL_H */
