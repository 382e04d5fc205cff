#!/usr/bin/env python3
"""An inference-style loop on Agora, with a batch job sharing the node beside it.

The "model" is a small multilayer perceptron: each layer is `sgemm` (activations x weights)
followed by `vector_add` (bias). Each request is one forward pass issued on a **latency-class**
queue; its response time is measured from issue to the output being back in host memory.
A second process runs a **batch** job at the same time (large `sgemm`s on a batch queue), so
the latency numbers show what a tenant sees when the node is shared.

    python3 examples/inference.py                  # 200 requests, batch job beside them
    python3 examples/inference.py --no-batch       # the same, node to itself
    python3 examples/inference.py --json           # figures for scripts

It needs a running daemon (`agora serve`, or $AGORA_SOCKET naming one).
"""

import argparse
import json
import multiprocessing as mp
import sys
import time

import numpy as np

import agora


def batch_job(socket, stop, started, size: int) -> None:
    """Large sgemms on a batch queue until told to stop; reports how many it finished."""
    with agora.Session(socket=socket, name="batch-job") as session:
        a = session.buffer_from(np.ones((size, size), np.float32))
        c = session.buffer(size * size * 4)
        done = 0
        with session.queue("batch", queue_class="batch") as queue:
            queue.sync_to(a)
            started.set()
            while not stop.is_set():
                queue.launch("sgemm", size, size, size, 1.0, a, a, 0.0, c, range=(size, size)).wait()
                done += 1
        print(f"batch job: {done} sgemm {size}x{size} finished beside the requests", file=sys.stderr)


class Model:
    """Weights and biases of an MLP, living in Agora buffers (uploaded once)."""

    def __init__(self, session: agora.Session, widths: list[int], batch: int, seed: int = 0):
        rng = np.random.default_rng(seed)
        self.batch = batch
        self.widths = widths
        self.weights = [(rng.standard_normal((i, o)) / np.sqrt(i)).astype(np.float32) for i, o in zip(widths, widths[1:])]
        self.biases = [rng.standard_normal((batch, o)).astype(np.float32) for o in widths[1:]]
        self.w = [session.buffer_from(w) for w in self.weights]
        self.b = [session.buffer_from(b) for b in self.biases]
        # Activations: input, then per layer a product and an output.
        self.input = session.buffer(batch * widths[0] * 4)
        self.products = [session.buffer(batch * o * 4) for o in widths[1:]]
        self.outputs = [session.buffer(batch * o * 4) for o in widths[1:]]

    def upload(self, queue: agora.Queue) -> None:
        for buf in self.w + self.b:
            queue.sync_to(buf)
        queue.finish()

    def infer(self, queue: agora.Queue, x: np.ndarray) -> np.ndarray:
        """One request: write the input in place (zero-copy view), run the layers, read the output."""
        self.input.numpy(np.float32, x.shape)[:] = x
        queue.sync_to(self.input)
        activations = self.input
        for i, (w, b) in enumerate(zip(self.w, self.b)):
            m, k, n = self.batch, self.widths[i], self.widths[i + 1]
            queue.launch("sgemm", m, n, k, 1.0, activations, w, 0.0, self.products[i], range=(m, n))
            queue.launch("vector_add", self.products[i], b, self.outputs[i], range=m * n)
            activations = self.outputs[i]
        queue.sync_from(activations)
        queue.finish()
        return activations.numpy(np.float32, (self.batch, self.widths[-1]))

    def reference(self, x: np.ndarray) -> np.ndarray:
        for w, b in zip(self.weights, self.biases):
            x = x @ w + b
        return x


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--socket", help="daemon socket (default: $AGORA_SOCKET, else the default path)")
    parser.add_argument("--requests", type=int, default=200, help="forward passes to time (default 200)")
    parser.add_argument("--batch-size", type=int, default=8, help="rows per request (default 8)")
    parser.add_argument("--widths", default="256,512,512,64", help="layer widths, comma-separated")
    parser.add_argument("--no-batch", action="store_true", help="do not run the batch job beside the requests")
    parser.add_argument("--batch-matrix", type=int, default=512, help="size of the batch job's sgemm (default 512)")
    parser.add_argument("--json", action="store_true", help="print the figures as one JSON object")
    args = parser.parse_args()
    widths = [int(w) for w in args.widths.split(",")]

    context = mp.get_context("spawn")
    stop, started = context.Event(), context.Event()
    batch = None
    if not args.no_batch:
        batch = context.Process(target=batch_job, args=(args.socket, stop, started, args.batch_matrix))
        batch.start()
        if not started.wait(60):
            print("the batch job did not start", file=sys.stderr)
            return 1

    try:
        with agora.Session(socket=args.socket, name="inference") as session:
            model = Model(session, widths, args.batch_size)
            rng = np.random.default_rng(1)
            with session.queue("inference", queue_class="latency") as queue:
                model.upload(queue)
                # Check the first answer against NumPy before timing anything.
                x = rng.standard_normal((args.batch_size, widths[0])).astype(np.float32)
                got = model.infer(queue, x)
                max_error = float(np.max(np.abs(got - model.reference(x))))
                if not np.allclose(got, model.reference(x), rtol=1e-3, atol=1e-3):
                    print(f"wrong result: max abs error {max_error}", file=sys.stderr)
                    return 1
                latencies = []
                for _ in range(args.requests):
                    x = rng.standard_normal((args.batch_size, widths[0])).astype(np.float32)
                    began = time.perf_counter()
                    model.infer(queue, x)
                    latencies.append(time.perf_counter() - began)
    finally:
        stop.set()
        if batch is not None:
            batch.join(120)

    ms = np.array(latencies) * 1e3
    figures = {
        "requests": args.requests,
        "batch_job": not args.no_batch,
        "latency_p50_ms": float(np.percentile(ms, 50)),
        "latency_p99_ms": float(np.percentile(ms, 99)),
        "latency_max_ms": float(ms.max()),
        "max_abs_error": max_error,
    }
    if args.json:
        print(json.dumps(figures))
    else:
        beside = "with a batch job beside it" if figures["batch_job"] else "node to itself"
        print(
            f"{args.requests} requests ({beside}): p50 {figures['latency_p50_ms']:.2f} ms, "
            f"p99 {figures['latency_p99_ms']:.2f} ms, max {figures['latency_max_ms']:.2f} ms; "
            f"first result matches NumPy (max abs error {max_error:.1e})"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
