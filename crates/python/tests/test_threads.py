"""Python threads issuing tasks on the same queues and buffers at once: a call that waits for
the daemon without the GIL holds no lock that a thread holding the GIL could need (such a lock
deadlocked both threads: the buffer's, and the queue's cache of kernels launched by name)."""

import subprocess
import sys

# Two threads issuing tasks on the same buffers, one of them (or a callback) holding the GIL
# while the other waits for the daemon without it. Run in a process of its own: a deadlock there
# is a failed test here, not a hung suite.
THREADS_SHARING_BUFFERS = """
import sys, threading
import numpy as np
import agora

n = 4096


# Runs target(*args) for each args on a thread of its own, all at once; returns when all end.
def together(target, each_args):
    threads = [threading.Thread(target=target, args=args) for args in each_args]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


with agora.Session(name="threads-sharing-buffers") as session:
    x = session.buffer_from(np.ones(n, np.float32))
    y = session.buffer_from(np.zeros(n, np.float32))
    saxpy = session.kernel("saxpy")
    rounds = int(sys.argv[1])
    queues = [session.queue(f"sharing-{i}", device="cpu") for i in range(2)]
    for q in queues:
        q.sync_to(x)
    queues[0].sync_to(y).wait()

    def work(q, by_name):
        for _ in range(rounds):
            q.memset(x, 0)
            q.launch("saxpy" if by_name else saxpy, 0.0, x, y, range=n)
            q.sync_to(x)

    together(work, [(q, i == 1) for i, q in enumerate(queues)])
    for q in queues:
        q.finish()

    # Both threads on one fresh queue, launching by name at once: the first launch of a name
    # looks the kernel up with the daemon (without the GIL) and fills the queue's cache.
    barrier = threading.Barrier(2)

    def first_launches(shared):
        for q in shared:
            barrier.wait()
            q.launch("saxpy", 0.0, x, y, range=n)

    shared = [session.queue(f"shared-{i}", device="cpu") for i in range(rounds // 20)]
    together(first_launches, [(shared,), (shared,)])
    for q in shared:
        q.finish()
print("done")
"""


def test_threads_issuing_tasks_on_the_same_buffers_never_deadlock(daemon):
    run = subprocess.run(
        [sys.executable, "-c", THREADS_SHARING_BUFFERS, "3000"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert run.returncode == 0 and "done" in run.stdout, run.stderr
