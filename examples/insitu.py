"""In situ analytics beside a running simulation (XEMEM's workflow on Agora).

The simulation process advances a field through Agora and, every few steps, publishes a snapshot
of it in an exported buffer; a separate analytics process (this script again, started by the
simulation) attaches the snapshot by name (the same memory, no copy), computes statistics on it
in place, and tells the simulation it is done through a small writable export used as a mailbox.
`agora bench insitu` measures the same workflow at scale.

    python examples/insitu.py [--steps 40] [--every 4] [--size 1000000]

Prints "in situ verified" when every statistic the analytics computed matches the field the
simulation had at that point (exit status 1 otherwise).
"""

import argparse
import subprocess
import sys
import time

import numpy as np

import agora


def simulation(args):
    with agora.Session(name="insitu-simulation") as s:
        q = s.queue("simulation")
        n = args.size
        field = s.buffer_from(np.zeros(n, dtype=np.float32))
        step_size = s.buffer_from(np.linspace(0.0, 1.0, n, dtype=np.float32))
        # docs example begins
        snapshot = s.shared_buffer(dtype=np.float32, shape=(n,))
        s.export(snapshot, "insitu/field")  # attachable by this user's processes, read-only
        mailbox = s.shared_buffer(dtype=np.int64, shape=(2,))
        s.export(mailbox, "insitu/mailbox", writable=True)  # [point published, point analysed]
        box = mailbox.numpy()
        analytics = subprocess.Popen([sys.executable, __file__, "--role", "analytics", "--size", str(n)],
                                     stdout=subprocess.PIPE, text=True)
        for step in range(1, args.steps + 1):
            q.launch("saxpy", 1.0, step_size, field, range=n)  # one time step: field += step_size
            if step % args.every == 0:
                q.copy(field, snapshot)  # publish the field as of this step
                q.finish()
                box[0] = step
                while box[1] != step:  # wait until the analytics has seen it
                    time.sleep(0.0005)
        box[0] = -1  # done
        # docs example ends
        report = analytics.communicate(timeout=60)[0].splitlines()
        ramp = np.linspace(0.0, 1.0, n, dtype=np.float32)
        ok = analytics.returncode == 0 and len(report) == args.steps // args.every
        for line in report:
            step, mean = line.split()
            # The field after `step` steps is step × ramp (up to float32 rounding).
            expected = float((ramp.astype(np.float64) * int(step)).mean())
            ok = ok and abs(float(mean) - expected) < 1e-3
    print("in situ verified" if ok else "in situ WRONG")
    return 0 if ok else 1


def analytics(args):
    with agora.Session(name="insitu-analytics") as s:
        box = s.attach("insitu/mailbox", writable=True, dtype=np.int64, shape=(2,)).numpy()
        snapshot = s.attach("insitu/field", dtype=np.float32, shape=(args.size,)).numpy()  # read-only view
        seen = 0
        while True:
            point = int(box[0])
            if point == -1:
                return 0
            if point == seen:
                time.sleep(0.0005)
                continue
            print(point, float(snapshot.mean(dtype=np.float64)), flush=True)
            seen = point
            box[1] = point


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--role", choices=["simulation", "analytics"], default="simulation")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--every", type=int, default=4)
    parser.add_argument("--size", type=int, default=1_000_000)
    args = parser.parse_args()
    return simulation(args) if args.role == "simulation" else analytics(args)


if __name__ == "__main__":
    sys.exit(main())
