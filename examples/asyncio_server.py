"""An asyncio service on Agora: each request awaits its kernels, so one event loop serves many
requests at once and never blocks on the device (`await task`, docs/getting-started-python.md).

Each request multiplies its own input by a weight matrix (`sgemm`) and returns the result,
checked against NumPy. The run first serves requests one at a time, then with many in flight,
and reports the response time of each, beside the same work done with blocking `wait()` calls:

    python examples/asyncio_server.py [--requests 400] [--concurrency 16] [--size 96] [--json]

`AGORA_SOCKET` names the daemon (else the default socket).
"""

import argparse
import asyncio
import json
import time

import numpy as np

import agora


class Model:
    """A weight matrix on the daemon and, per request slot, an input and an output buffer."""

    def __init__(self, session, n, slots):
        self.session, self.n = session, n
        rng = np.random.default_rng(7)
        self.weights_host = rng.standard_normal((n, n)).astype(np.float32)
        self.weights = session.buffer_from(self.weights_host)
        self.slots = asyncio.Queue()
        for i in range(slots):
            self.slots.put_nowait(
                (
                    session.queue(f"request-{i}", queue_class="latency"),
                    session.buffer(n * n * 4),
                    session.buffer(n * n * 4),
                )
            )

    async def infer(self, features):
        """One request: features (n × n) times the weights, computed by the daemon."""
        n = self.n
        queue, x, y = await self.slots.get()
        try:
            x.write(features)
            # A queue runs its tasks in order: awaiting the last one covers the others (and
            # raises if any of them failed, as its inputs would be poisoned).
            queue.sync_to(x)
            queue.launch("sgemm", n, n, n, 1.0, x, self.weights, 0.0, y, range=(n, n))
            await queue.sync_from(y)
            return y.numpy(dtype=np.float32, shape=(n, n)).copy()
        finally:
            self.slots.put_nowait((queue, x, y))

    def infer_blocking(self, queue, x, y, features):
        n = self.n
        x.write(features)
        queue.sync_to(x)
        queue.launch("sgemm", n, n, n, 1.0, x, self.weights, 0.0, y, range=(n, n))
        queue.sync_from(y).wait()
        return y.numpy(dtype=np.float32, shape=(n, n)).copy()


def percentiles(seconds):
    ordered = sorted(seconds)
    pick = lambda f: ordered[min(len(ordered) - 1, int(len(ordered) * f))] * 1e6
    return {"p50_us": round(pick(0.5), 1), "p99_us": round(pick(0.99), 1)}


async def serve(model, inputs, concurrency):
    """Serves every input with at most `concurrency` in flight: response times and results."""
    gate = asyncio.Semaphore(concurrency)
    times = []

    async def request(features):
        async with gate:
            started = time.perf_counter()
            result = await model.infer(features)
            times.append(time.perf_counter() - started)
            return result

    started = time.perf_counter()
    results = await asyncio.gather(*(request(f) for f in inputs))
    return times, results, time.perf_counter() - started


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=400)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--size", type=int, default=96, help="n of each n × n request")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    n = args.size
    rng = np.random.default_rng(11)
    inputs = [rng.standard_normal((n, n)).astype(np.float32) for _ in range(args.requests)]

    with agora.Session(name="asyncio-server") as session:

        async def run():
            model = Model(session, n, args.concurrency)
            one, results_one, _ = await serve(model, inputs, 1)
            many, results_many, elapsed = await serve(model, inputs, args.concurrency)
            return model, one, results_one, many, results_many, elapsed

        model, one, results_one, many, results_many, elapsed = asyncio.run(run())
        # The same requests with blocking waits, one at a time, for comparison.
        queue, x, y = session.queue("blocking", queue_class="latency"), session.buffer(n * n * 4), session.buffer(n * n * 4)
        blocking = []
        results_blocking = []
        for features in inputs:
            started = time.perf_counter()
            results_blocking.append(model.infer_blocking(queue, x, y, features))
            blocking.append(time.perf_counter() - started)

    expected = [f @ model.weights_host for f in inputs]
    verified = all(
        np.allclose(got, want, rtol=1e-4, atol=1e-3)
        for results in (results_one, results_many, results_blocking)
        for got, want in zip(results, expected)
    )
    report = {
        "requests": args.requests,
        "size": n,
        "concurrency": args.concurrency,
        "blocking_one_at_a_time": percentiles(blocking),
        "awaited_one_at_a_time": percentiles(one),
        "awaited_concurrently": percentiles(many),
        "concurrent_requests_per_s": round(args.requests / elapsed, 1),
        "verified": verified,
    }
    if args.json:
        print(json.dumps(report))
    else:
        for key in ("blocking_one_at_a_time", "awaited_one_at_a_time", "awaited_concurrently"):
            print(f"{key.replace('_', ' '):<24} p50 {report[key]['p50_us']:>9.1f} µs   p99 {report[key]['p99_us']:>9.1f} µs")
        print(f"{args.concurrency} in flight: {report['concurrent_requests_per_s']} requests/s; results verified: {verified}")
    if not verified:
        raise SystemExit("a result did not match NumPy")


if __name__ == "__main__":
    main()
