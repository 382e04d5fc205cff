/* Tenant programs from C: OpenCL C source built by the daemon and run in the session's sandbox,
 * launched like a built-in kernel; a build error's message carries the compiler's log; a kernel
 * that crashes fails its own task (and poisons what it writes) and the session goes on.
 * Built and run by tests/c_example.rs; exit status 0 when every check passed. */
#include <stdbool.h>

#include "checks.h"

static const char *SOURCE =
    "__kernel void twice(__global const float *x, __global float *y) {\n"
    "    size_t i = get_global_id(0);\n"
    "    y[i] = 2.0f * x[i];\n"
    "}\n"
    "__kernel void crash(__global float *x) { x[(ulong)1 << 38] = 1.0f; }\n";

int main(void) {
    AgoraSession *session;
    if (agora_session_open(NULL, &session) != AGORA_STATUS_OK) {
        fprintf(stderr, "no daemon: %s\n", agora_last_error_message());
        return 2;
    }
    AgoraProgram *program = NULL;
    OK(agora_program_opencl(session, SOURCE, NULL, &program));
    EXPECT(program != NULL && agora_program_log(program) != NULL);
    AgoraKernel *twice = NULL, *crash = NULL, *missing = NULL;
    OK(agora_program_kernel(program, "twice", &twice));
    OK(agora_program_kernel(program, "crash", &crash));
    EXPECT(agora_program_kernel(program, "thrice", &missing) == AGORA_STATUS_INVALID_ARGUMENT);
    EXPECT(MESSAGE_HAS("no kernel 'thrice'; it has: "));

    AgoraQueue *queue;
    OK(agora_queue_create(session, "c program", &queue));
    AgoraBuffer *x, *y;
    OK(agora_buffer_create(session, 1024 * sizeof(float), &x));
    OK(agora_buffer_create(session, 1024 * sizeof(float), &y));
    float *xs = (float *)agora_buffer_data(x);
    for (int i = 0; i < 1024; i++) xs[i] = (float)i;
    OK(agora_sync_to(queue, x, NULL));
    AgoraArg args[2] = {{AGORA_ARG_KIND_BUFFER, x}, {AGORA_ARG_KIND_BUFFER, y}};
    uint64_t n = 1024;
    OK(agora_launch(queue, twice, args, 2, &n, 1, NULL));
    OK(agora_sync_from(queue, y, NULL));
    OK(agora_queue_finish(queue));
    const float *ys = (const float *)agora_buffer_data(y);
    int right = 1;
    for (int i = 0; i < 1024; i++) right &= ys[i] == 2.0f * (float)i;
    EXPECT(right);

    /* A crash in the sandbox fails that task with the signal; the next launch runs. */
    AgoraTask *task = NULL;
    AgoraArg crash_args[1] = {{AGORA_ARG_KIND_BUFFER, x}};
    uint64_t one = 1;
    OK(agora_launch(queue, crash, crash_args, 1, &one, 1, &task));
    EXPECT(agora_task_wait(task) == AGORA_STATUS_TASK && MESSAGE_HAS("signal 11")); /* releases it */
    EXPECT(agora_queue_finish(queue) == AGORA_STATUS_TASK);
    /* The crashed kernel wrote x: x is poisoned until rewritten (its readers would fail with
     * DependencyFailed); after a sync_to the restarted executor runs the next launch. */
    OK(agora_sync_to(queue, x, NULL));
    OK(agora_launch(queue, twice, args, 2, &n, 1, NULL));
    OK(agora_queue_finish(queue));

    /* CUDA C and PTX programs need their code and a manifest: refused here, before the daemon. */
    static const char *CUDA = "extern \"C\" __global__ void twice(const float *x, float *y) {\n"
                              "    unsigned i = blockIdx.x * blockDim.x + threadIdx.x;\n"
                              "    y[i] = 2.0f * x[i];\n"
                              "}\n";
    static const char *MANIFEST = "[kernels.twice]\n"
                                  "params = [\"x: f32 read\", \"y: f32 write\"]\n"
                                  "sizes = { x = \"range0\", y = \"range0\" }\n";
    AgoraProgram *gpu = NULL;
    EXPECT(agora_program_cuda(session, CUDA, NULL, &gpu) == AGORA_STATUS_INVALID_ARGUMENT);
    EXPECT(gpu == NULL && MESSAGE_HAS("manifest is null"));
    EXPECT(agora_program_cuda(session, NULL, MANIFEST, &gpu) == AGORA_STATUS_INVALID_ARGUMENT);
    EXPECT(gpu == NULL && MESSAGE_HAS("source is null"));
    EXPECT(agora_program_cuda(session, CUDA, MANIFEST, NULL) == AGORA_STATUS_INVALID_ARGUMENT);
    EXPECT(MESSAGE_HAS("out is null"));
    EXPECT(agora_program_cuda(NULL, CUDA, MANIFEST, &gpu) == AGORA_STATUS_INVALID_ARGUMENT);
    EXPECT(gpu == NULL && MESSAGE_HAS("session is null"));
    EXPECT(agora_program_ptx(session, ".version 7.0\n", NULL, &gpu) == AGORA_STATUS_INVALID_ARGUMENT);
    EXPECT(gpu == NULL && MESSAGE_HAS("manifest is null"));
    EXPECT(agora_program_ptx(session, NULL, MANIFEST, &gpu) == AGORA_STATUS_INVALID_ARGUMENT);
    EXPECT(gpu == NULL && MESSAGE_HAS("source is null"));
    EXPECT(agora_program_ptx(session, ".version 7.0\n", MANIFEST, NULL) == AGORA_STATUS_INVALID_ARGUMENT);

    /* A build error: the compiler's log is in the message. */
    AgoraProgram *broken = NULL;
    EXPECT(agora_program_opencl(session, "__kernel void k(__global float *x) { x[0] = undeclared_thing; }",
                                NULL, &broken) == AGORA_STATUS_CONTROL);
    EXPECT(broken == NULL && MESSAGE_HAS("undeclared_thing"));

    agora_kernel_destroy(twice);
    agora_kernel_destroy(crash);
    agora_program_destroy(program);
    agora_buffer_destroy(x);
    agora_buffer_destroy(y);
    agora_queue_destroy(queue);
    agora_session_close(session);
    printf("C program checks: %d failed\n", failed);
    return failed == 0 ? 0 : 1;
}
