"""Checkpoint and restart (docs/checkpoint.md): an iterative solver that protects its state,
checkpoints it every few iterations as a task in its queue, and resumes from the newest
checkpoint when it is started again (after a crash of itself or of the daemon).

    python examples/checkpoint.py --iterations 20 --stop-after 7   # "crashes" after 7
    python examples/checkpoint.py --iterations 20                  # resumes at 6, finishes

It prints where it started and the final value, checked against the closed form.
"""

import argparse
import sys

import numpy as np

import agora

parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
parser.add_argument("--iterations", type=int, default=20)
parser.add_argument("--stop-after", type=int, default=None, help="exit (as a crash would) after this many iterations")
parser.add_argument("--every", type=int, default=3, help="checkpoint every N iterations")
parser.add_argument("--name", default="checkpoint-example", help="the application name checkpoints belong to")
args = parser.parse_args()

n = 1 << 16
x0 = (np.arange(n) % 100).astype(np.float32)
# docs example begins
with agora.Session(name=args.name) as session:
    queue = session.queue("solver")
    x = session.buffer_from(x0)
    y = session.buffer_from(np.zeros(n, dtype=np.float32))
    session.protect(1, x)
    session.protect(2, y)
    try:
        start = session.recover()["checkpoint"]  # the iteration the newest checkpoint ended
    except agora.CheckpointError:
        start = 0  # no checkpoint yet
    print(f"starting at iteration {start}")
    for i in range(start, args.iterations):
        queue.launch("saxpy", 2.0, x, y, range=n)  # y += 2x: one iteration
        if (i + 1) % args.every == 0:
            queue.checkpoint(i + 1)  # ordered after the iteration's tasks
        if args.stop_after is not None and i + 1 == args.stop_after:
            queue.finish()
            sys.exit(3)
    queue.sync_from(y)
    queue.finish()
    ok = np.array_equal(y.numpy(dtype=np.float32), 2.0 * args.iterations * x0)
# docs example ends
    print(f"final value {'verified' if ok else 'WRONG'}")
    sys.exit(0 if ok else 1)
