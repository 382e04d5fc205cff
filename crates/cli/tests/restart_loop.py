"""Verified saxpy rounds through the Python client until $RESTART_STOP_FILE exists, while the
test kills and restarts the daemon under it (crates/cli/tests/restart.rs). Prints "ok" per
verified round, "restarted" per round issued again after DaemonRestartedError (or a read of data
that died with the daemon), "done" at the
end; any other failure raises (exit status 1)."""

import os
import sys

import numpy as np

import agora

N = 4096


def round_once(session, q, saxpy, x, y, r):
    resumes = session.resumes
    xs = ((np.arange(N) + r) % 1000).astype(np.float32)
    ys = np.full(N, r % 7, dtype=np.float32)
    x.numpy(np.float32)[:] = xs
    y.numpy(np.float32)[:] = ys
    tasks = []
    try:
        tasks.append(q.sync_to(x))
        tasks.append(q.sync_to(y))
        tasks.append(q.launch(saxpy, 3.0, x, y, range=N))
        tasks.append(q.sync_from(y))
    except agora.DaemonRestartedError:
        return False
    restarted = False
    for t in tasks:
        try:
            t.wait()
        except agora.DaemonRestartedError:
            restarted = True
        except agora.DeviceFailedError:
            # Data lost: the launch completed on the dead daemon, the read was issued again on
            # the new one.
            if session.resumes == resumes and not restarted:
                raise
            restarted = True
        except agora.DependencyFailedError:
            # A task after one the restart lost may read what that one should have written.
            if not restarted:
                raise
    try:
        q.finish()  # clears the queue's failures, reported above
    except agora.TaskFailedError:
        pass
    if restarted:
        return False
    got = y.numpy(np.float32)
    want = 3.0 * xs + ys
    if not np.array_equal(got, want):
        bad = int(np.argmax(got != want))
        raise SystemExit(f"round {r}: y[{bad}] = {got[bad]}, expected {want[bad]}")
    return True


def main():
    stop = os.environ.get("RESTART_STOP_FILE")
    session = agora.Session(name="restart-python")
    q = session.queue("python-loop")
    saxpy = session.kernel("saxpy")
    x = session.buffer(N * 4)
    y = session.buffer(N * 4)
    r = 0
    while not (stop and os.path.exists(stop)):
        if round_once(session, q, saxpy, x, y, r):
            print("ok", flush=True)
            r += 1
        else:
            print("restarted", flush=True)
    print("done", flush=True)
    session.close()


if __name__ == "__main__":
    sys.exit(main())
