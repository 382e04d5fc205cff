#!/usr/bin/env python3
"""The Python client on a GPU: saxpy and sgemm on a `device="cuda"` queue through a running
daemon ($AGORA_SOCKET), checked against numpy, and checked to have run on the GPU.

Run by scripts/gpu-check.sh with the wheel from `make gpu-dist` (one abi3 wheel for CPython 3.11
and later); exits non-zero on any mismatch.
"""
import sys

import numpy as np

import agora


def gpu_jobs(session):
    return sum(
        lane["completed"]
        for device in session.status()["devices"]
        if device["kind"] == "cuda"
        for lane in device["lanes"]
    )


with agora.Session() as session:
    before = gpu_jobs(session)
    n = 1 << 22
    x = session.buffer_from(np.arange(n, dtype=np.float32) % 1000)
    y = session.buffer_from(np.ones(n, np.float32))
    m = k = p = 256
    rng = np.random.default_rng(7)
    a_host = rng.standard_normal((m, k), dtype=np.float32)
    b_host = rng.standard_normal((k, p), dtype=np.float32)
    a, b = session.buffer_from(a_host), session.buffer_from(b_host)
    c = session.buffer_from(np.zeros((m, p), np.float32))
    with session.queue("python-gpu", device="cuda") as queue:
        for buf in (x, y, a, b, c):
            queue.sync_to(buf)
        for _ in range(10):
            queue.launch("saxpy", 0.5, x, y, range=n)
        queue.launch("sgemm", m, p, k, 1.0, a, b, 0.0, c, range=(m, p))
        queue.sync_from(y)
        queue.sync_from(c)
    expected = 1.0 + 10 * 0.5 * (np.arange(n, dtype=np.float32) % 1000)
    ok_saxpy = np.array_equal(y.numpy(np.float32), expected)
    ok_sgemm = np.allclose(c.numpy(np.float32).reshape(m, p), a_host @ b_host, rtol=1e-4, atol=1e-3)
    ran = gpu_jobs(session) - before
    print(f"python on the GPU: saxpy {'ok' if ok_saxpy else 'WRONG'}, sgemm {'ok' if ok_sgemm else 'WRONG'}, {ran} GPU jobs")
    sys.exit(0 if ok_saxpy and ok_sgemm and ran >= 11 else 1)
