"""Two Python processes share one daemon at the same time."""

import multiprocessing as mp
import os

import numpy as np


def tenant(socket: str, seed: int, barrier, results) -> None:
    import agora

    with agora.Session(socket=socket, name=f"tenant{seed}") as session:
        barrier.wait(30)  # both connected before either works
        rng = np.random.default_rng(seed)
        x = rng.standard_normal(50_000).astype(np.float32)
        y = rng.standard_normal(50_000).astype(np.float32)
        bx, by = session.buffer_from(x), session.buffer_from(y)
        with session.queue(f"q{seed}") as queue:
            queue.sync_to(bx)
            queue.sync_to(by)
            for _ in range(200):
                queue.launch("saxpy", 0.5, bx, by, range=x.size)
            queue.sync_from(by)
            sessions = len(session.status()["sessions"])
        expected = y.astype(np.float64) + 200 * 0.5 * x.astype(np.float64)
        ok = bool(np.allclose(by.numpy(), expected, rtol=1e-3, atol=1e-3))
        barrier.wait(30)  # both still connected when the other looked at the status
        results.put((seed, ok, sessions))


def test_two_python_processes_share_the_daemon(daemon):
    context = mp.get_context("spawn")
    barrier = context.Barrier(2)
    results = context.Queue()
    processes = [
        context.Process(target=tenant, args=(str(daemon.socket), seed, barrier, results)) for seed in (1, 2)
    ]
    for p in processes:
        p.start()
    outcomes = sorted(results.get(timeout=120) for _ in processes)
    for p in processes:
        p.join(30)
        assert p.exitcode == 0
    assert [seed for seed, _, _ in outcomes] == [1, 2]
    assert all(ok for _, ok, _ in outcomes), outcomes
    # Each saw at least both tenants connected (the pytest session may add one more).
    assert all(sessions >= 2 for _, _, sessions in outcomes), outcomes
    assert os.path.exists(daemon.socket)

