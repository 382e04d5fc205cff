/* Rodinia's Gaussian elimination, ported from CUDA-style calls to Agora:
 *   cudaMalloc            -> agora_buffer_create
 *   cudaMemcpy H->D       -> write agora_buffer_data, then agora_sync_to
 *   kernel<<<grid,block>>> -> agora_launch (the daemon picks the device)
 *   cudaDeviceSynchronize -> agora_queue_finish / agora_task_wait
 *   cudaMemcpy D->H       -> agora_sync_from, then read agora_buffer_data
 * Build: cc gaussian.c $(pkg-config --cflags --libs agora) -lm -o gaussian
 * Run:   AGORA_SOCKET=... ./gaussian [size]      (exit status 0 when the result verifies) */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "agora.h"

#define CHECK(call)                                                                      \
    do {                                                                                 \
        AgoraStatus status_ = (call);                                                    \
        if (status_ != AGORA_STATUS_OK) {                                                \
            fprintf(stderr, "%s failed (%d): %s\n", #call, (int)status_, agora_last_error_message()); \
            return 2;                                                                    \
        }                                                                                \
    } while (0)

/* Rodinia's test matrix: a[i][j] = 10 exp(-0.01 |i-j|), b = 1. */
static void create_matrix(float *a, float *b, int size) {
    for (int i = 0; i < size; i++) {
        for (int j = 0; j < size; j++) a[i * size + j] = (float)(10.0 * exp(-0.01 * fabs((double)(i - j))));
        b[i] = 1.0f;
    }
}

/* Host reference: the same forward elimination, then back substitution. */
static void reference(float *a, float *b, float *x, int size) {
    for (int t = 0; t < size - 1; t++)
        for (int r = t + 1; r < size; r++) {
            float m = a[r * size + t] / a[t * size + t];
            for (int c = t; c < size; c++) a[r * size + c] -= m * a[t * size + c];
            b[r] -= m * b[t];
        }
    for (int i = size - 1; i >= 0; i--) {
        float sum = b[i];
        for (int j = i + 1; j < size; j++) sum -= a[i * size + j] * x[j];
        x[i] = sum / a[i * size + i];
    }
}

int main(int argc, char **argv) {
    int size = argc > 1 ? atoi(argv[1]) : 256;
    if (size < 2) { fprintf(stderr, "size must be at least 2\n"); return 1; }
    size_t n2 = (size_t)size * size;

    AgoraSession *session; AgoraQueue *queue; AgoraKernel *fan1, *fan2;
    AgoraBuffer *a, *b, *m;
    CHECK(agora_session_open(NULL, &session)); /* $AGORA_SOCKET or the default socket */
    CHECK(agora_queue_create(session, "gaussian.c", &queue));
    CHECK(agora_kernel_lookup(session, "gaussian.fan1", &fan1));
    CHECK(agora_kernel_lookup(session, "gaussian.fan2", &fan2));
    CHECK(agora_buffer_create(session, n2 * sizeof(float), &a));   /* cudaMalloc */
    CHECK(agora_buffer_create(session, size * sizeof(float), &b));
    CHECK(agora_buffer_create(session, n2 * sizeof(float), &m));

    float *ha = malloc(n2 * sizeof(float)), *hb = malloc(size * sizeof(float)), *x = malloc(size * sizeof(float));
    create_matrix(ha, hb, size);
    memcpy(agora_buffer_data(a), ha, n2 * sizeof(float));         /* cudaMemcpy H->D ... */
    memcpy(agora_buffer_data(b), hb, size * sizeof(float));
    CHECK(agora_sync_to(queue, a, NULL));                          /* ... done by the runtime */
    CHECK(agora_sync_to(queue, b, NULL));
    CHECK(agora_sync_to(queue, m, NULL));

    for (int t = 0; t < size - 1; t++) {
        AgoraArg args1[4] = {{AGORA_ARG_KIND_BUFFER, m}, {AGORA_ARG_KIND_BUFFER, a}, {AGORA_ARG_KIND_I32, NULL, size}, {AGORA_ARG_KIND_I32, NULL, t}};
        uint64_t range1[1] = {(uint64_t)(size - 1 - t)};
        CHECK(agora_launch(queue, fan1, args1, 4, range1, 1, NULL)); /* Fan1<<<...>>> */
        AgoraArg args2[5] = {{AGORA_ARG_KIND_BUFFER, m}, {AGORA_ARG_KIND_BUFFER, a}, {AGORA_ARG_KIND_BUFFER, b},
                             {AGORA_ARG_KIND_I32, NULL, size}, {AGORA_ARG_KIND_I32, NULL, t}};
        uint64_t range2[2] = {(uint64_t)(size - 1 - t), (uint64_t)(size - t)};
        CHECK(agora_launch(queue, fan2, args2, 5, range2, 2, NULL)); /* Fan2<<<...>>> */
    }
    AgoraTask *last;
    CHECK(agora_sync_from(queue, a, NULL));                        /* cudaMemcpy D->H */
    CHECK(agora_sync_from(queue, b, &last));
    CHECK(agora_task_wait(last));                                  /* synchronous */
    CHECK(agora_queue_finish(queue));

    /* Back substitution on the host, as in Rodinia, then compare with the host reference. */
    const float *ra = agora_buffer_data(a), *rb = agora_buffer_data(b);
    float *xa = malloc(size * sizeof(float));
    for (int i = size - 1; i >= 0; i--) {
        float sum = rb[i];
        for (int j = i + 1; j < size; j++) sum -= ra[i * size + j] * xa[j];
        xa[i] = sum / ra[i * size + i];
    }
    create_matrix(ha, hb, size);
    reference(ha, hb, x, size);
    double max_error = 0;
    for (int i = 0; i < size; i++) {
        double e = fabs(xa[i] - x[i]) / fmax(fabs(x[i]), 1.0);
        if (e > max_error) max_error = e;
    }

    /* Errors look like this. A launch that does not match the kernel's signature is refused at
     * once, with a message naming the problem: */
    AgoraStatus status = agora_launch(queue, fan1, NULL, 0, (uint64_t[]){1}, 1, NULL);
    printf("a launch without arguments: status %d, \"%s\"\n", (int)status, agora_last_error_message());
    int refused = status == AGORA_STATUS_INVALID_ARGUMENT;
    /* A problem the daemon finds (step t out of range) fails the task. Asked again, a task gives
     * the same outcome; the queue's finish reports it too, by task id. */
    AgoraTask *bad;
    AgoraArg bad_args[4] = {{AGORA_ARG_KIND_BUFFER, m}, {AGORA_ARG_KIND_BUFFER, a}, {AGORA_ARG_KIND_I32, NULL, size},
                            {AGORA_ARG_KIND_I32, NULL, size}};
    CHECK(agora_launch(queue, fan1, bad_args, 4, (uint64_t[]){1}, 1, &bad));
    status = agora_task_check(bad);
    printf("a step out of range: status %d, \"%s\"\n", (int)status, agora_last_error_message());
    int same_again = agora_task_check(bad) == status;
    uint64_t failed_id = 0;
    int finish_reports_it = agora_queue_finish(queue) == AGORA_STATUS_TASK &&
                            agora_last_failed_tasks(&failed_id, 1) == 1 && failed_id == agora_task_id(bad);
    printf("finish: \"%s\"\n", agora_last_error_message());
    agora_task_destroy(bad);
    if (!refused || !same_again || !finish_reports_it) {
        fprintf(stderr, "a bad launch must be refused at once, and a failed task must report its failure every time "
                        "it is asked, and at finish\n");
        status = AGORA_STATUS_OK;
    }

    agora_buffer_destroy(a); agora_buffer_destroy(b); agora_buffer_destroy(m);
    agora_kernel_destroy(fan1); agora_kernel_destroy(fan2);
    agora_queue_destroy(queue); agora_session_close(session);
    free(ha); free(hb); free(x); free(xa);
    printf("gaussian %d: max error %.2e, %s\n", size, max_error, max_error <= 1e-3 ? "verified OK" : "VERIFICATION FAILED");
    return max_error <= 1e-3 && status == AGORA_STATUS_TASK ? 0 : 1;
}
