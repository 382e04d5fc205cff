/* Verified saxpy rounds through the C API until $RESTART_STOP_FILE exists, while the test kills
 * and restarts the daemon under it (crates/cli/tests/restart.rs). Prints "ok" per verified
 * round, "restarted" per round issued again after AGORA_STATUS_DAEMON_RESTARTED (or a read of data
 * that died with the daemon), "done" at the
 * end; any other failure exits 1 with the message. */
#include <stdio.h>
#include <stdlib.h>
#include <unistd.h>
#include <agora.h>

#define N 4096

static void die(const char *what, AgoraStatus s) {
  printf("FAILED %s: status %d: %s\n", what, (int)s, agora_last_error_message());
  fflush(stdout);
  exit(1);
}

/* 1: verified; 0: a task failed with DAEMON_RESTARTED, or read data that died with the daemon
 * (a sync_from the dead daemon never took, issued again on the new one): issue the round again. */
static int round_once(AgoraSession *session, AgoraQueue *q, AgoraKernel *saxpy, AgoraBuffer *x, AgoraBuffer *y,
                      unsigned r) {
  uint64_t resumes_before = 0, resumes_after = 0;
  agora_session_resumes(session, &resumes_before, NULL);
  float *xs = agora_buffer_data(x), *ys = agora_buffer_data(y);
  for (int i = 0; i < N; i++) { xs[i] = (float)((i + r) % 1000); ys[i] = (float)(r % 7); }
  AgoraTask *t[4] = {0};
  AgoraArg args[3] = {{.kind = AGORA_ARG_KIND_F32, .f = 3.0},
                      {.kind = AGORA_ARG_KIND_BUFFER, .buffer = x},
                      {.kind = AGORA_ARG_KIND_BUFFER, .buffer = y}};
  uint64_t range = N;
  AgoraStatus s[4];
  s[0] = agora_sync_to(q, x, &t[0]);
  s[1] = agora_sync_to(q, y, &t[1]);
  s[2] = agora_launch(q, saxpy, args, 3, &range, 1, &t[2]);
  s[3] = agora_sync_from(q, y, &t[3]);
  int restarted = 0;
  for (int i = 0; i < 4; i++) {
    if (s[i] == AGORA_STATUS_OK) s[i] = agora_task_wait(t[i]);
    if (s[i] == AGORA_STATUS_TASK && !restarted) {
      agora_session_resumes(session, &resumes_after, NULL);
      if (resumes_after > resumes_before) restarted = 1; /* data lost with the daemon */
      else die("task", s[i]);
    }
    if (s[i] == AGORA_STATUS_DAEMON_RESTARTED) restarted = 1;
    /* A task after one the restart lost may read what that one should have written. */
    else if (s[i] != AGORA_STATUS_OK && !restarted) die("task", s[i]);
  }
  agora_queue_finish(q); /* clears the queue's failures, reported above */
  if (restarted) return 0;
  for (int i = 0; i < N; i++) {
    float want = 3.0f * (float)((i + r) % 1000) + (float)(r % 7);
    if (ys[i] != want) {
      printf("FAILED round %u: y[%d] = %f, expected %f\n", r, i, ys[i], want);
      exit(1);
    }
  }
  return 1;
}

int main(void) {
  const char *stop = getenv("RESTART_STOP_FILE");
  AgoraSession *session;
  AgoraQueue *q;
  AgoraKernel *saxpy;
  AgoraBuffer *x, *y;
  AgoraStatus s;
  if ((s = agora_session_open(NULL, &session))) die("session", s);
  if ((s = agora_queue_create(session, "c-loop", &q))) die("queue", s);
  if ((s = agora_kernel_lookup(session, "saxpy", &saxpy))) die("kernel", s);
  if ((s = agora_buffer_create(session, N * 4, &x))) die("buffer", s);
  if ((s = agora_buffer_create(session, N * 4, &y))) die("buffer", s);
  unsigned r = 0;
  while (!stop || access(stop, F_OK) != 0) {
    if (round_once(session, q, saxpy, x, y, r)) { puts("ok"); r++; } else puts("restarted");
    fflush(stdout);
  }
  agora_buffer_destroy(x);
  agora_buffer_destroy(y);
  agora_kernel_destroy(saxpy);
  agora_queue_destroy(q);
  agora_session_close(session);
  puts("done");
  return 0;
}
