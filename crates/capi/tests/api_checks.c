/* Checks of the C API's behaviour against a daemon: queue options, kernel listing, memset/copy,
 * task polling and bounded waits, argument checks at launch, the error message of the last call
 * only, completion callbacks, real-time DAGs (declared, released, refused), and objects refusing every call once their
 * session is closed.
 * Built and run by tests/c_example.rs; exit status 0 when every check passed. */
#include <pthread.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <unistd.h>

#include "checks.h"

/* What the completion callbacks were told (they run one after another on the session's waiting
   thread; the main thread reads the rest once `count` says all ran). */
struct Told {
    atomic_int count, ok, failed, on_caller, other;
    uint64_t failed_id;
    char message[256];
};
static pthread_t main_thread;

static void on_complete(uint64_t id, AgoraStatus status, void *user_data) {
    struct Told *told = user_data;
    if (pthread_equal(pthread_self(), main_thread)) atomic_fetch_add(&told->on_caller, 1);
    if (status == AGORA_STATUS_OK) {
        atomic_fetch_add(&told->ok, 1);
    } else if (status == AGORA_STATUS_TASK) {
        told->failed_id = id;
        snprintf(told->message, sizeof told->message, "%s", agora_last_error_message());
        atomic_fetch_add(&told->failed, 1);
    } else {
        atomic_fetch_add(&told->other, 1);
    }
    atomic_fetch_add(&told->count, 1); /* last: the main thread reads the rest after it */
}

/* Waits up to 30 s for `count` callbacks. */
static bool told_within(struct Told *told, int count) {
    for (int waited = 0; atomic_load(&told->count) < count && waited < 30000; waited++) usleep(1000);
    return atomic_load(&told->count) == count;
}

int main(void) {
    AgoraSession *session;
    if (agora_session_open(NULL, &session) != AGORA_STATUS_OK) {
        fprintf(stderr, "no daemon: %s\n", agora_last_error_message());
        return 2;
    }

    /* Queue options: class, device hint, SLA; a zeroed struct (or NULL) gives the defaults. */
    AgoraQueueOptions options;
    memset(&options, 0, sizeof options);
    options.name = "c-latency";
    options.queue_class = AGORA_QUEUE_CLASS_LATENCY;
    options.preferred_device = AGORA_DEVICE_KIND_CPU;
    options.sla_ms = 25.0;
    AgoraQueue *latency = NULL, *batch = NULL, *refused = NULL;
    OK(agora_queue_create_with(session, &options, &latency));
    options.sla_ms = -1.0;
    EXPECT(agora_queue_create_with(session, &options, &refused) == AGORA_STATUS_INVALID_ARGUMENT);
    EXPECT(MESSAGE_HAS("sla_ms") && refused == NULL);
    /* A batch queue has no SLA: its sla_ms is ignored, whatever it holds (as documented). */
    AgoraQueue *ignored = NULL;
    options.queue_class = AGORA_QUEUE_CLASS_BATCH;
    OK(agora_queue_create_with(session, &options, &ignored));
    agora_queue_destroy(ignored);
    options.queue_class = AGORA_QUEUE_CLASS_LATENCY;

    /* Session options: a zeroed struct (or NULL) gives the defaults; a value out of its field's
     * range is refused naming the field. */
    {
        AgoraSessionOptions session_options;
        memset(&session_options, 0, sizeof session_options);
        AgoraSession *other = NULL;
        OK(agora_session_open_with(&session_options, &other));
        agora_session_close(other);
        OK(agora_session_open_with(NULL, &other));
        agora_session_close(other);
        session_options.name = "c-api-checks.other";
        session_options.heap_bytes = 1 << 20;
        session_options.control_timeout_ms = 5000;
        session_options.reconnect_timeout_ms = AGORA_RECONNECT_OFF;
        OK(agora_session_open_with(&session_options, &other));
        agora_session_close(other);
        other = NULL;
        session_options.control_timeout_ms = 86400001;
        EXPECT(agora_session_open_with(&session_options, &other) == AGORA_STATUS_INVALID_ARGUMENT);
        EXPECT(MESSAGE_HAS("control_timeout_ms=86400001") && other == NULL);
        session_options.control_timeout_ms = 0;
        session_options.reconnect_timeout_ms = -5;
        EXPECT(agora_session_open_with(&session_options, &other) == AGORA_STATUS_INVALID_ARGUMENT);
        EXPECT(MESSAGE_HAS("reconnect_timeout_ms=-5") && MESSAGE_HAS("AGORA_RECONNECT_OFF") && other == NULL);
        session_options.reconnect_timeout_ms = 0;
        session_options.name = "";
        EXPECT(agora_session_open_with(&session_options, &other) == AGORA_STATUS_INVALID_ARGUMENT);
        EXPECT(MESSAGE_HAS("name is empty") && other == NULL);
        session_options.name = "two\nlines";
        EXPECT(agora_session_open_with(&session_options, &other) == AGORA_STATUS_INVALID_ARGUMENT);
        EXPECT(MESSAGE_HAS("name: ") && other == NULL);
        EXPECT(agora_session_open_with(NULL, NULL) == AGORA_STATUS_INVALID_ARGUMENT && MESSAGE_HAS("out is null"));
    }
    OK(agora_queue_create_with(session, NULL, &batch));
    EXPECT(strcmp(agora_last_error_message(), "") == 0); /* cleared by the successful call */
    /* An enum field holding no value of its enum is refused, not taken for some class. */
    AgoraQueueOptions bad_options;
    memset(&bad_options, 0, sizeof bad_options);
    bad_options.queue_class = (AgoraQueueClass)7;
    EXPECT(agora_queue_create_with(session, &bad_options, &refused) == AGORA_STATUS_INVALID_ARGUMENT);
    EXPECT(MESSAGE_HAS("queue_class=7") && MESSAGE_HAS("AGORA_QUEUE_CLASS_LATENCY") && refused == NULL);
    bad_options.queue_class = AGORA_QUEUE_CLASS_BATCH;
    bad_options.preferred_device = (AgoraDeviceKind)9;
    EXPECT(agora_queue_create_with(session, &bad_options, &refused) == AGORA_STATUS_INVALID_ARGUMENT);
    EXPECT(MESSAGE_HAS("preferred_device=9") && refused == NULL);

    /* Kernel listing. */
    AgoraKernelList *list;
    OK(agora_kernel_list(session, &list));
    size_t count = agora_kernel_list_len(list);
    bool saw_saxpy = false;
    for (size_t i = 0; i < count; i++) {
        if (strcmp(agora_kernel_list_name(list, i), "saxpy") == 0) {
            saw_saxpy = true;
            EXPECT(strncmp(agora_kernel_list_signature(list, i), "saxpy(", 6) == 0);
            EXPECT(strlen(agora_kernel_list_doc(list, i)) > 0);
        }
    }
    EXPECT(count > 1 && saw_saxpy);
    EXPECT(agora_kernel_list_name(list, count) == NULL);
    agora_kernel_list_destroy(list);

    /* memset and copy, then polling and a bounded wait. */
    AgoraBuffer *bytes, *copy;
    OK(agora_buffer_create(session, 64, &bytes));
    OK(agora_buffer_create(session, 64, &copy));
    AgoraTask *task = NULL;
    OK(agora_memset(batch, bytes, 7, NULL));
    OK(agora_copy(batch, bytes, 8, copy, 16, 32, NULL));
    OK(agora_sync_from(batch, copy, &task));
    bool done = false;
    while (!done && agora_task_wait_timeout(task, 10, &done) == AGORA_STATUS_OK) continue;
    EXPECT(done);
    OK(agora_task_done(task, &done));
    EXPECT(done);
    const unsigned char *copied = agora_buffer_data(copy);
    int right = 1;
    for (int i = 0; i < 64; i++) right &= copied[i] == ((i >= 16 && i < 48) ? 7 : 0);
    EXPECT(right);
    agora_task_destroy(task);

    /* saxpy on the latency queue. */
    AgoraKernel *saxpy, *fan1;
    OK(agora_kernel_lookup(session, "saxpy", &saxpy));
    OK(agora_kernel_lookup(session, "gaussian.fan1", &fan1));
    AgoraBuffer *x, *y;
    OK(agora_buffer_create(session, 16 * sizeof(float), &x));
    OK(agora_buffer_create(session, 16 * sizeof(float), &y));
    float *hx = agora_buffer_data(x), *hy = agora_buffer_data(y);
    for (int i = 0; i < 16; i++) { hx[i] = (float)i; hy[i] = 1.0f; }
    OK(agora_sync_to(latency, x, NULL));
    OK(agora_sync_to(latency, y, NULL));
    uint64_t n = 16;
    AgoraArg args[3] = {{AGORA_ARG_KIND_F32, NULL, 0, 2.0}, {AGORA_ARG_KIND_BUFFER, x}, {AGORA_ARG_KIND_BUFFER, y}};
    OK(agora_launch(latency, saxpy, args, 3, &n, 1, NULL));
    OK(agora_sync_from(latency, y, NULL));
    done = false;
    while (!done && agora_queue_finish_timeout(latency, 10, &done) == AGORA_STATUS_OK) continue;
    EXPECT(done);
    EXPECT(hy[3] == 7.0f && hy[15] == 31.0f);

    /* Writing over a kernel's results never read back: claim the host copy first, so no
       eviction writes them over the new data. */
    OK(agora_launch(latency, saxpy, args, 3, &n, 1, NULL));
    done = false;
    while (!done && agora_queue_finish_timeout(latency, 10, &done) == AGORA_STATUS_OK) continue;
    OK(agora_buffer_claim_host(y));
    for (int i = 0; i < 16; i++) hy[i] = 1.0f;
    OK(agora_sync_to(latency, y, NULL));
    OK(agora_launch(latency, saxpy, args, 3, &n, 1, NULL));
    OK(agora_sync_from(latency, y, NULL));
    done = false;
    while (!done && agora_queue_finish_timeout(latency, 10, &done) == AGORA_STATUS_OK) continue;
    EXPECT(hy[3] == 7.0f && hy[15] == 31.0f);
    OK(agora_buffer_claim_host(y)); /* nothing to claim: returns at once */
    EXPECT(agora_buffer_claim_host(NULL) == AGORA_STATUS_INVALID_ARGUMENT);

    /* Arguments are checked against the signature at launch, not at finish. */
    AgoraArg wrong_kind[3] = {{AGORA_ARG_KIND_I32, NULL, 2}, {AGORA_ARG_KIND_BUFFER, x}, {AGORA_ARG_KIND_BUFFER, y}};
    task = NULL;
    EXPECT(agora_launch(batch, saxpy, wrong_kind, 3, &n, 1, &task) == AGORA_STATUS_INVALID_ARGUMENT);
    EXPECT(MESSAGE_HAS("argument 0 ('a') of saxpy is a f32 scalar") && MESSAGE_HAS("AGORA_ARG_KIND_F32"));
    EXPECT(task == NULL);
    AgoraArg scalar_for_buffer[3] = {{AGORA_ARG_KIND_F32, NULL, 0, 2.0}, {AGORA_ARG_KIND_F32}, {AGORA_ARG_KIND_BUFFER, y}};
    EXPECT(agora_launch(batch, saxpy, scalar_for_buffer, 3, &n, 1, NULL) == AGORA_STATUS_INVALID_ARGUMENT);
    EXPECT(MESSAGE_HAS("argument 1 ('x') of saxpy is a buffer"));
    EXPECT(agora_launch(batch, saxpy, args, 2, &n, 1, NULL) == AGORA_STATUS_INVALID_ARGUMENT);
    EXPECT(MESSAGE_HAS("wrong argument count: saxpy takes 3 arguments (a, x, y), the launch passed 2"));
    AgoraArg too_big[4] = {{AGORA_ARG_KIND_BUFFER, x}, {AGORA_ARG_KIND_BUFFER, y}, {AGORA_ARG_KIND_I32, NULL, 1LL << 40},
                           {AGORA_ARG_KIND_I32, NULL, 0}};
    EXPECT(agora_launch(batch, fan1, too_big, 4, &n, 1, NULL) == AGORA_STATUS_INVALID_ARGUMENT);
    EXPECT(MESSAGE_HAS("argument 2 ('size')") && MESSAGE_HAS("1099511627776 does not fit"));
    /* A kind that is no AgoraArgKind (a zeroed AgoraArg's 0, or garbage) is refused, naming the
       argument. */
    const int bad_kinds[3] = {0, 8, 42};
    for (int i = 0; i < 3; i++) {
        AgoraArg no_kind[3] = {{AGORA_ARG_KIND_F32, NULL, 0, 2.0}, {AGORA_ARG_KIND_BUFFER, x}, {AGORA_ARG_KIND_BUFFER, y}};
        no_kind[1].kind = (AgoraArgKind)bad_kinds[i];
        task = NULL;
        EXPECT(agora_launch(batch, saxpy, no_kind, 3, &n, 1, &task) == AGORA_STATUS_INVALID_ARGUMENT);
        EXPECT(MESSAGE_HAS("argument 1 ('x') of saxpy has kind") && MESSAGE_HAS("no AgoraArgKind") && task == NULL);
    }
    OK(agora_queue_finish(batch)); /* nothing refused was issued */
    EXPECT(strcmp(agora_last_error_message(), "") == 0);

    /* The message and the failed tasks describe the last call alone. */
    uint64_t wide = 1000;
    AgoraTask *bad;
    OK(agora_launch(batch, saxpy, args, 3, &wide, 1, &bad));
    EXPECT(agora_queue_finish(batch) == AGORA_STATUS_TASK);
    uint64_t id = 0;
    EXPECT(agora_last_failed_tasks(&id, 1) == 1 && id == agora_task_id(bad));
    EXPECT(agora_launch(batch, saxpy, args, 1, &n, 1, NULL) == AGORA_STATUS_INVALID_ARGUMENT);
    EXPECT(MESSAGE_HAS("wrong argument count") && !MESSAGE_HAS("too small"));
    EXPECT(agora_last_failed_tasks(NULL, 0) == 0);
    EXPECT(agora_task_check(bad) == AGORA_STATUS_TASK && MESSAGE_HAS("too small"));
    OK(agora_queue_finish(batch));
    /* What the refused launch would have written is poisoned: a reader fails naming it, until
       the host copy is declared current again. */
    OK(agora_sync_from(batch, y, &task));
    EXPECT(agora_task_wait(task) == AGORA_STATUS_TASK && MESSAGE_HAS("should have come from task"));
    EXPECT(agora_queue_finish(batch) == AGORA_STATUS_TASK);
    OK(agora_sync_to(batch, y, NULL));
    EXPECT(strcmp(agora_last_error_message(), "") == 0);
    EXPECT(agora_last_failed_tasks(NULL, 0) == 0);

    /* Completion callbacks: each runs once, on the session's waiting thread, with its own task's
       outcome and message; registering one releases the handle. */
    main_thread = pthread_self();
    static struct Told told;
    for (int i = 0; i < 40; i++) {
        OK(agora_memset(batch, bytes, (unsigned char)i, &task));
        OK(agora_task_on_complete(task, on_complete, &told));
    }
    AgoraTask *failing_task;
    OK(agora_launch(batch, saxpy, args, 3, &wide, 1, &failing_task));
    uint64_t failing = agora_task_id(failing_task);
    OK(agora_task_on_complete(failing_task, on_complete, &told));
    EXPECT(told_within(&told, 41));
    EXPECT(atomic_load(&told.ok) == 40 && atomic_load(&told.failed) == 1 && atomic_load(&told.other) == 0);
    EXPECT(atomic_load(&told.on_caller) == 0);
    EXPECT(told.failed_id == failing && strstr(told.message, "too small") != NULL);
    EXPECT(agora_queue_finish(batch) == AGORA_STATUS_TASK); /* the failure is still the queue's */
    OK(agora_sync_to(batch, y, NULL)); /* and its output poisoned: declared current again */
    OK(agora_memset(batch, bytes, 0, &task));
    EXPECT(agora_task_on_complete(task, NULL, NULL) == AGORA_STATUS_INVALID_ARGUMENT && MESSAGE_HAS("callback is null"));
    EXPECT(agora_task_on_complete(NULL, on_complete, &told) == AGORA_STATUS_INVALID_ARGUMENT);
    OK(agora_queue_finish(batch));

    /* Checkpoint/restart: protect y, checkpoint it as a task, spoil the host copy, recover it. */
    uint64_t used = 0;
    EXPECT(agora_recover(session, &used) != AGORA_STATUS_OK && MESSAGE_HAS("nothing is protected"));
    OK(agora_protect(session, 1, y));
    EXPECT(agora_checkpoint(batch, 1, 9, NULL) == AGORA_STATUS_INVALID_ARGUMENT && MESSAGE_HAS("levels are 1"));
    /* Ids start at 1: 0 is what agora_checkpoint_status reports for "none". */
    AgoraTask *zero = NULL;
    EXPECT(agora_checkpoint(batch, 0, 1, &zero) == AGORA_STATUS_INVALID_ARGUMENT && zero == NULL);
    EXPECT(MESSAGE_HAS("ids start at 1") && !MESSAGE_HAS("task failed"));
    OK(agora_queue_finish(latency));
    float saved[16];
    memcpy(saved, hy, sizeof saved);
    OK(agora_checkpoint(batch, 1, 1, NULL));
    OK(agora_queue_finish(batch));
    /* FTI_Snapshot: the daemon's interval (60 s) has not passed, so nothing is issued. */
    bool snapped = true;
    OK(agora_snapshot(batch, &snapped, NULL));
    EXPECT(!snapped);
    /* FTI_Status: the newest complete checkpoint once written. */
    uint64_t newest = 0;
    uint32_t writing = 1;
    for (int tries = 0; tries < 500 && (newest != 1 || writing != 0); tries++) {
        OK(agora_checkpoint_status(session, &newest, &writing));
        if (newest != 1 || writing != 0) usleep(10000);
    }
    EXPECT(newest == 1 && writing == 0);
    for (int i = 0; i < 16; i++) hy[i] = -5.0f;
    /* Written in the background: recovery finds it once the daemon has written it. */
    AgoraStatus recovered = AGORA_STATUS_TASK;
    for (int tries = 0; tries < 500 && recovered != AGORA_STATUS_OK; tries++) {
        recovered = agora_recover(session, &used);
        if (recovered != AGORA_STATUS_OK) usleep(10000);
    }
    EXPECT(recovered == AGORA_STATUS_OK && used == 1);
    EXPECT(memcmp(saved, hy, sizeof saved) == 0);
    EXPECT(agora_checkpoint(batch, 1, 1, NULL) == AGORA_STATUS_OK);
    EXPECT(agora_queue_finish(batch) == AGORA_STATUS_TASK && MESSAGE_HAS("not larger than"));

    /* Export and attach: a second session attaches an exportable buffer, sees its bytes in
     * place, computes on it, and is refused a write; a heap buffer cannot be exported. */
    EXPECT(agora_export(session, x, "c/heap", NULL, 0, NULL, 0, false) == AGORA_STATUS_CONTROL
           && MESSAGE_HAS("agora_shared_buffer_create("));
    AgoraBuffer *shared;
    OK(agora_shared_buffer_create(session, 16 * sizeof(float), &shared));
    float *hs = agora_buffer_data(shared);
    for (int i = 0; i < 16; i++) hs[i] = (float)i;
    OK(agora_export(session, shared, "c/state", NULL, 0, NULL, 0, false));
    AgoraSession *reader;
    OK(agora_session_open(NULL, &reader));
    AgoraBuffer *attached;
    EXPECT(agora_attach(reader, "c/state", true, &attached) == AGORA_STATUS_CONTROL && MESSAGE_HAS("read-only"));
    OK(agora_attach(reader, "c/state", false, &attached));
    EXPECT(agora_buffer_len(attached) == 16 * sizeof(float));
    EXPECT(((const float *)agora_buffer_data(attached))[15] == 15.0f);
    hs[15] = 99.0f; /* zero-copy: visible at once */
    EXPECT(((const float *)agora_buffer_data(attached))[15] == 99.0f);
    AgoraQueue *rq;
    OK(agora_queue_create(reader, "reader", &rq));
    /* Handles are numbers in their own session: another session's buffer (whose number this
       session's own buffers also have) or program kernel is refused, never taken for this
       session's object of that number. */
    AgoraBuffer *theirs;
    OK(agora_buffer_create(reader, 16 * sizeof(float), &theirs));
    AgoraArg foreign[3] = {{AGORA_ARG_KIND_F32, NULL, 0, 2.0}, {AGORA_ARG_KIND_BUFFER, theirs}, {AGORA_ARG_KIND_BUFFER, y}};
    EXPECT(agora_launch(batch, saxpy, foreign, 3, &n, 1, NULL) == AGORA_STATUS_INVALID_ARGUMENT);
    EXPECT(MESSAGE_HAS("argument 1") && MESSAGE_HAS("belongs to another session") && !MESSAGE_HAS("task failed"));
    EXPECT(agora_sync_to(batch, theirs, NULL) == AGORA_STATUS_INVALID_ARGUMENT && MESSAGE_HAS("another session"));
    EXPECT(agora_memset(batch, theirs, 0, NULL) == AGORA_STATUS_INVALID_ARGUMENT && MESSAGE_HAS("another session"));
    OK(agora_queue_finish(batch));
    agora_buffer_destroy(theirs);
    OK(agora_memset(rq, attached, 0, NULL));
    EXPECT(agora_queue_finish(rq) == AGORA_STATUS_TASK && MESSAGE_HAS("attached read-only"));
    OK(agora_revoke(session, "c/state"));
    EXPECT(agora_attach(reader, "c/state", false, &attached) == AGORA_STATUS_CONTROL && MESSAGE_HAS("no export named"));
    agora_queue_destroy(rq);
    agora_buffer_destroy(attached);
    agora_session_close(reader);
    agora_buffer_destroy(shared);

    /* Real-time DAGs: fill(1, dx) -> saxpy(2, dx, dy), sporadic with a 20 ms period, released
     * twice (the period apart): each release adds 2 to dy; then a release too soon and a cycle,
     * refused with the reason. */
    {
        enum { DN = 4096 };
        const uint64_t period_ns = 20000000, wcet_ns = 2000000;
        AgoraKernel *fill;
        OK(agora_kernel_lookup(session, "fill", &fill));
        AgoraBuffer *dx, *dy;
        OK(agora_buffer_create(session, DN * sizeof(float), &dx));
        OK(agora_buffer_create(session, DN * sizeof(float), &dy));
        uint64_t dn = DN;
        AgoraArg fill_args[2] = {{AGORA_ARG_KIND_F32, NULL, 0, 1.0}, {AGORA_ARG_KIND_BUFFER, dx}};
        AgoraArg saxpy_args[3] = {
            {AGORA_ARG_KIND_F32, NULL, 0, 2.0}, {AGORA_ARG_KIND_BUFFER, dx}, {AGORA_ARG_KIND_BUFFER, dy}};
        AgoraDagBuilder *builder = NULL;
        OK(agora_dag_create(session, "c-pipeline", period_ns, &builder));
        size_t a = 99, b = 99;
        OK(agora_dag_node(builder, "fill", fill, fill_args, 2, &dn, 1, &a));
        OK(agora_dag_node(builder, "saxpy", saxpy, saxpy_args, 3, &dn, 1, &b));
        EXPECT(a == 0 && b == 1);
        /* The arguments are checked as agora_launch checks them; node indices by the builder. */
        EXPECT(agora_dag_node(builder, "bad", saxpy, fill_args, 2, &dn, 1, NULL) == AGORA_STATUS_INVALID_ARGUMENT
               && MESSAGE_HAS("wrong argument count"));
        EXPECT(agora_dag_edge(builder, a, 7) == AGORA_STATUS_INVALID_ARGUMENT && MESSAGE_HAS("no node 7"));
        OK(agora_dag_edge(builder, a, b));
        OK(agora_dag_wcet(builder, a, wcet_ns));
        OK(agora_dag_wcet(builder, b, wcet_ns));
        OK(agora_dag_sporadic(builder));
        AgoraDag *dag = NULL;
        OK(agora_dag_declare(builder, &dag));
        EXPECT(dag != NULL);
        double utilisation = 0.0;
        size_t nodes = 0;
        OK(agora_dag_admission(dag, &utilisation, &nodes));
        EXPECT(nodes == 2 && utilisation > 0.19 && utilisation < 0.3);
        AgoraDagRelease releases[4];
        size_t got = 0, total = 0;
        bool all_met = true;
        for (uint64_t i = 0; i < 2; i++) {
            uint64_t number = 99;
            OK(agora_dag_release(dag, &number));
            EXPECT(number == i);
            OK(agora_dag_wait_results(dag, 1, 5000, releases, 4, &got));
            EXPECT(got == 1 && releases[0].release == i);
            for (size_t r = 0; r < got; r++) {
                all_met &= releases[r].met && releases[r].failed_node == -1 && releases[r].failed_message == NULL
                           && releases[r].response_ns > 0 && releases[r].response_ns < period_ns
                           && releases[r].handoff_ns >= releases[r].jitter_ns;
            }
            total += got;
            usleep(21000); /* the period is the least time between releases */
        }
        EXPECT(total == 2 && all_met);
        const float *hdy = agora_buffer_data(dy);
        int fours = 1;
        for (int i = 0; i < DN; i++) fours &= hdy[i] == 4.0f;
        EXPECT(fours); /* saxpy ran once per release, after fill: 2 x 2 */
        OK(agora_dag_results(dag, releases, 4, &got));
        EXPECT(got == 0 && agora_dag_stopped(dag) == NULL);
        /* Too soon after the previous release: refused, with the period. */
        OK(agora_dag_release(dag, NULL));
        EXPECT(agora_dag_release(dag, NULL) == AGORA_STATUS_CONTROL && MESSAGE_HAS("least time between releases"));
        OK(agora_dag_withdraw(dag));

        /* A cycle: refused, the builder released all the same, no DAG. */
        OK(agora_dag_create(session, "c-cycle", period_ns, &builder));
        OK(agora_dag_node(builder, "fill", fill, fill_args, 2, &dn, 1, &a));
        OK(agora_dag_node(builder, "saxpy", saxpy, saxpy_args, 3, &dn, 1, &b));
        OK(agora_dag_edge(builder, a, b));
        OK(agora_dag_edge(builder, b, a));
        OK(agora_dag_wcet(builder, a, wcet_ns));
        OK(agora_dag_wcet(builder, b, wcet_ns));
        dag = (AgoraDag *)&got; /* overwritten with NULL */
        EXPECT(agora_dag_declare(builder, &dag) == AGORA_STATUS_CONTROL && MESSAGE_HAS("cycle") && dag == NULL);
        /* A builder never declared. */
        OK(agora_dag_create(session, "c-unused", period_ns, &builder));
        agora_dag_builder_destroy(builder);
        agora_buffer_destroy(dx);
        agora_buffer_destroy(dy);
        agora_kernel_destroy(fill);
    }

    /* After close, every call on the session's objects fails with CLOSED. */
    AgoraTask *pending, *callback_after_close, *callback_before_close, *waited_after_close;
    OK(agora_sync_to(batch, x, &pending));
    OK(agora_sync_to(batch, x, &waited_after_close));
    OK(agora_sync_to(batch, y, &callback_after_close));
    OK(agora_memset(batch, bytes, 3, &callback_before_close));
    static struct Told told_at_close;
    OK(agora_task_on_complete(callback_before_close, on_complete, &told_at_close));
    agora_session_close(session);
    /* A callback registered before the close runs, with the task's real outcome; one registered
       after it is refused and never called. */
    EXPECT(agora_task_on_complete(callback_after_close, on_complete, &told_at_close) == AGORA_STATUS_CLOSED);
    /* The call released the handle: the message must not say to destroy it (that freed it twice). */
    EXPECT(MESSAGE_HAS("released the task handle") && !MESSAGE_HAS("destroy the task"));
    EXPECT(told_within(&told_at_close, 1) && atomic_load(&told_at_close.ok) == 1);
    usleep(50000);
    EXPECT(atomic_load(&told_at_close.count) == 1);
    EXPECT(agora_launch(batch, saxpy, args, 3, &n, 1, NULL) == AGORA_STATUS_CLOSED && MESSAGE_HAS("closed"));
    EXPECT(agora_sync_to(batch, x, NULL) == AGORA_STATUS_CLOSED);
    EXPECT(agora_sync_from(latency, y, NULL) == AGORA_STATUS_CLOSED);
    EXPECT(agora_memset(batch, bytes, 0, NULL) == AGORA_STATUS_CLOSED);
    EXPECT(agora_copy(batch, bytes, 0, copy, 0, 0, NULL) == AGORA_STATUS_CLOSED);
    EXPECT(agora_queue_finish(batch) == AGORA_STATUS_CLOSED);
    EXPECT(agora_task_check(pending) == AGORA_STATUS_CLOSED);
    EXPECT(agora_task_done(pending, &done) == AGORA_STATUS_CLOSED);
    EXPECT(MESSAGE_HAS("destroy the task")); /* these keep the handle */
    /* agora_task_wait releases the handle, CLOSED or not: its message says so, and doing as it
       says (not destroying the task; a new session) goes on safely. */
    EXPECT(agora_task_wait(waited_after_close) == AGORA_STATUS_CLOSED);
    EXPECT(MESSAGE_HAS("released the task handle") && !MESSAGE_HAS("destroy the task"));
    AgoraSession *again;
    OK(agora_session_open(NULL, &again));
    AgoraQueue *again_queue;
    AgoraBuffer *again_buffer;
    OK(agora_queue_create(again, "again", &again_queue));
    OK(agora_buffer_create(again, 64, &again_buffer));
    OK(agora_memset(again_queue, again_buffer, 5, NULL));
    OK(agora_sync_from(again_queue, again_buffer, &task));
    OK(agora_task_wait(task));
    EXPECT(((const unsigned char *)agora_buffer_data(again_buffer))[63] == 5);
    agora_buffer_destroy(again_buffer);
    agora_queue_destroy(again_queue);
    agora_session_close(again);
    EXPECT(agora_buffer_data(x) == NULL && MESSAGE_HAS("closed"));
    EXPECT(agora_buffer_len(x) == 0);
    agora_task_destroy(pending);
    agora_task_destroy(bad);
    agora_buffer_destroy(bytes); agora_buffer_destroy(copy); agora_buffer_destroy(x); agora_buffer_destroy(y);
    agora_kernel_destroy(saxpy); agora_kernel_destroy(fan1);
    agora_queue_destroy(batch); agora_queue_destroy(latency);

    printf("C API checks: %d failed\n", failed);
    return failed == 0 ? 0 : 1;
}
