/* Checkpoints of the processes of one C program (the ranks of an MPI-style code), built and run
 * by tests/c_example.rs. Modes:
 *
 *   solver VALUE ITERATIONS EVERY STOP   a rank of an iterative solver (docs/checkpoint.md's
 *       example: y += 2x with x = VALUE, a checkpoint every EVERY iterations, id = iterations
 *       done), opened with agora_session_open's default name. It recovers its newest checkpoint
 *       first; after iteration STOP (0: none) it "crashes" (exit 3). Exit 0 when every
 *       checkpoint was taken, what it recovered is its own data, and y ends right.
 *   holder                               checkpoints once under the default name, prints
 *       "holding", and keeps its session until a line arrives on stdin.
 *   second HOLDER_PID                    under the same default name while the holder lives:
 *       its checkpoint is refused, saying why and how to name each process; a session named
 *       with agora_session_open_with checkpoints; once a line arrives on stdin (the holder has
 *       ended), the default-named session checkpoints too.
 *   heap                                 against a daemon whose heap limit admits one default
 *       session: a second one is refused with what it asked for and the C way to ask for less,
 *       which then gets in.
 *
 * Every mode ends with "rank checks: N failed" and exits non-zero when N > 0 (solver: see
 * above). */
#include <stdint.h>
#include <stdlib.h>
#include <unistd.h>

#include "checks.h"

enum { N = 1 << 14 };

static int done(void) {
    printf("rank checks: %d failed\n", failed);
    return failed != 0;
}

/* Protects one small buffer and issues checkpoint `id` on `queue`; returns finish()'s status. */
static AgoraStatus checkpoint_once(AgoraSession *session, AgoraQueue *queue, AgoraBuffer **buffer, uint64_t id) {
    if (*buffer == NULL) {
        OK(agora_buffer_create(session, 64, buffer));
        OK(agora_protect(session, 1, *buffer));
    }
    OK(agora_checkpoint(queue, id, 1, NULL));
    return agora_queue_finish(queue);
}

static int solver(float value, uint64_t iterations, uint64_t every, uint64_t stop) {
    AgoraSession *session;
    if (agora_session_open(NULL, &session) != AGORA_STATUS_OK) {
        fprintf(stderr, "no daemon: %s\n", agora_last_error_message());
        return 2;
    }
    AgoraQueue *queue;
    AgoraKernel *saxpy;
    AgoraBuffer *x, *y;
    OK(agora_queue_create(session, "solver", &queue));
    OK(agora_kernel_lookup(session, "saxpy", &saxpy));
    OK(agora_buffer_create(session, N * sizeof(float), &x));
    OK(agora_buffer_create(session, N * sizeof(float), &y));
    float *hx = agora_buffer_data(x), *hy = agora_buffer_data(y);
    for (int i = 0; i < N; i++) {
        hx[i] = value;
        hy[i] = 0.0f;
    }
    OK(agora_protect(session, 1, x));
    OK(agora_protect(session, 2, y));
    uint64_t start = 0;
    if (agora_recover(session, &start) == AGORA_STATUS_OK) {
        printf("recovered checkpoint %llu: x[0]=%g y[0]=%g\n", (unsigned long long)start, hx[0], hy[0]);
        /* Its own data: x is this rank's, y what `start` iterations give. */
        EXPECT(hx[0] == value && hy[0] == 2.0f * value * (float)start);
    } else {
        EXPECT(MESSAGE_HAS("no checkpoint to recover from"));
        start = 0;
    }
    OK(agora_sync_to(queue, x, NULL));
    OK(agora_sync_to(queue, y, NULL));
    AgoraArg args[3] = {{AGORA_ARG_KIND_F32, NULL, 0, 2.0}, {AGORA_ARG_KIND_BUFFER, x}, {AGORA_ARG_KIND_BUFFER, y}};
    uint64_t range = N;
    for (uint64_t i = start; i < iterations; i++) {
        OK(agora_launch(queue, saxpy, args, 3, &range, 1, NULL));
        if ((i + 1) % every == 0) OK(agora_checkpoint(queue, i + 1, 1, NULL));
        if (i + 1 == stop) {
            OK(agora_queue_finish(queue)); /* every checkpoint taken */
            /* Written before the "crash", so the next run finds them. */
            uint32_t writing = 1;
            for (int tries = 0; tries < 1000 && writing != 0; tries++) {
                OK(agora_checkpoint_status(session, NULL, &writing));
                if (writing != 0) usleep(10000);
            }
            printf("stopping after %llu: %d failed\n", (unsigned long long)stop, failed);
            fflush(stdout);
            _exit(failed ? 1 : 3);
        }
        usleep(5000); /* lets the other ranks' checkpoints interleave with this one's */
    }
    OK(agora_sync_from(queue, y, NULL));
    OK(agora_queue_finish(queue));
    int wrong = 0;
    for (int i = 0; i < N; i++) wrong += hy[i] != 2.0f * value * (float)iterations;
    EXPECT(wrong == 0);
    printf("y[0]=%g want %g\n", hy[0], 2.0 * value * (double)iterations);
    agora_session_close(session);
    return done();
}

static void wait_for_line(void) {
    char line[64];
    if (fgets(line, sizeof line, stdin) == NULL) { /* the test ended: go */
    }
}

static int holder(void) {
    AgoraSession *session;
    AgoraQueue *queue;
    AgoraBuffer *buffer = NULL;
    OK(agora_session_open(NULL, &session));
    OK(agora_queue_create(session, "holder", &queue));
    OK(checkpoint_once(session, queue, &buffer, 1));
    printf("holding\n");
    fflush(stdout);
    wait_for_line();
    agora_session_close(session);
    return done();
}

static int second(const char *holder_pid) {
    AgoraSession *session;
    AgoraQueue *queue;
    AgoraBuffer *buffer = NULL;
    OK(agora_session_open(NULL, &session));
    OK(agora_queue_create(session, "second", &queue));
    /* Ids that grow, from 2 on: refused all the same, for the live holder's sake. */
    EXPECT(checkpoint_once(session, queue, &buffer, 2) == AGORA_STATUS_TASK);
    char pid[64];
    snprintf(pid, sizeof pid, "another live session (pid %s)", holder_pid);
    EXPECT(MESSAGE_HAS(pid));
    EXPECT(MESSAGE_HAS("AgoraSessionOptions.name") && MESSAGE_HAS("agora_session_open_with"));
    EXPECT(!MESSAGE_HAS("increasing ids"));

    /* Its own name: its own checkpoints. */
    AgoraSessionOptions options = {0};
    options.name = "rank-checks.second";
    AgoraSession *named;
    AgoraQueue *named_queue;
    AgoraBuffer *named_buffer = NULL;
    OK(agora_session_open_with(&options, &named));
    OK(agora_queue_create(named, "named", &named_queue));
    OK(checkpoint_once(named, named_queue, &named_buffer, 1));
    agora_session_close(named);

    printf("refused while the holder lives\n");
    fflush(stdout);
    wait_for_line(); /* the holder has ended */
    AgoraStatus status = AGORA_STATUS_TASK;
    for (uint64_t id = 3; id < 400 && status != AGORA_STATUS_OK; id++) {
        status = checkpoint_once(session, queue, &buffer, id);
        if (status != AGORA_STATUS_OK) usleep(20000);
    }
    EXPECT(status == AGORA_STATUS_OK);
    agora_session_close(session);
    return done();
}

static int heap(void) {
    AgoraSession *first, *refused = NULL, *small;
    OK(agora_session_open(NULL, &first));
    EXPECT(agora_session_open(NULL, &refused) == AGORA_STATUS_CONTROL && refused == NULL);
    /* What it asked for (the daemon's 64 MiB session quota), and the C way to ask for less. */
    EXPECT(MESSAGE_HAS("asked for a heap of 67108864 bytes (64.0 MiB)"));
    EXPECT(MESSAGE_HAS("AgoraSessionOptions.heap_bytes") && MESSAGE_HAS("agora_session_open_with"));
    AgoraSessionOptions options = {0};
    options.heap_bytes = 1 << 20;
    OK(agora_session_open_with(&options, &small));
    AgoraBuffer *buffer;
    OK(agora_buffer_create(small, 512 << 10, &buffer));
    agora_buffer_destroy(buffer);
    agora_session_close(small);
    agora_session_close(first);
    return done();
}

int main(int argc, char **argv) {
    if (argc == 6 && strcmp(argv[1], "solver") == 0) {
        return solver((float)atof(argv[2]), strtoull(argv[3], NULL, 10), strtoull(argv[4], NULL, 10),
                      strtoull(argv[5], NULL, 10));
    }
    if (argc == 2 && strcmp(argv[1], "holder") == 0) return holder();
    if (argc == 3 && strcmp(argv[1], "second") == 0) return second(argv[2]);
    if (argc == 2 && strcmp(argv[1], "heap") == 0) return heap();
    fprintf(stderr, "usage: rank_checks solver VALUE ITERATIONS EVERY STOP | holder | second HOLDER_PID | heap\n");
    return 2;
}
