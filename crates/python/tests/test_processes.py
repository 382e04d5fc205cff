"""Processes and sessions: two Python processes share one daemon at the same time; a forked
child cannot use the session it inherited (and leaves it to the parent); the heap room a released
buffer leaves is there for the next allocation; a rank of an MPI or Slurm job gets a default name
of its own."""

import multiprocessing as mp
import os

import numpy as np
import pytest
from conftest import LONG_N


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



def test_a_forked_child_cannot_use_the_inherited_session_and_the_parent_carries_on(session):
    import gc

    import agora

    queue = session.queue("parent")
    x = session.buffer_from(np.ones(1024, np.float32))
    y = session.buffer_from(np.full(1024, 2.0, np.float32))
    queue.sync_to(x)
    queue.sync_to(y)
    queue.finish()
    parent = os.getpid()
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: every call raises ForkedChildError, then it drops all it inherited
        code = 1
        try:
            calls = {
                "buffer": lambda: session.buffer(64),
                "queue": lambda: session.queue("child"),
                "status": lambda: session.status(),
                "launch": lambda: queue.launch("saxpy", 1.0, x, y, range=1024),
                "finish": lambda: queue.finish(),
                "write": lambda: x.write(np.zeros(4, np.float32)),
            }
            outcomes = []
            for name, call in calls.items():
                try:
                    call()
                    outcomes.append(f"{name}: no error")
                except agora.ForkedChildError as e:
                    if f"opened by process {parent} before a fork()" not in str(e) or "spawn" not in str(e):
                        outcomes.append(f"{name}: {e}")
                except BaseException as e:  # noqa: BLE001
                    outcomes.append(f"{name}: {e!r}")
            os.write(write_end, "\n".join(outcomes).encode())
            code = 0
        finally:
            # As an exiting interpreter would: the inherited objects are dropped.
            del queue, x, y
            gc.collect()
            session.close()
            os._exit(code)
    os.close(write_end)
    with os.fdopen(read_end) as pipe:
        wrong = pipe.read()
    _, status = os.waitpid(pid, 0)
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0
    assert wrong == "", wrong
    # The parent's queue and buffers are whole, and its tasks go through.
    for _ in range(3):
        queue.launch("saxpy", 1.0, x, y, range=1024)
    queue.sync_from(y)
    queue.finish()
    assert np.all(y.numpy() == 5.0)
    session.buffer(64)


def forked_worker(session, results) -> None:
    import agora

    try:
        session.buffer(4096)
        results.put("no error")
    except agora.ForkedChildError as e:
        results.put(str(e))


def test_a_multiprocessing_fork_worker_is_told_to_open_its_own_session(session):
    context = mp.get_context("fork")
    results = context.Queue()
    worker = context.Process(target=forked_worker, args=(session, results))
    worker.start()
    message = results.get(timeout=60)
    worker.join(60)
    assert worker.exitcode == 0
    assert "a forked child must open its own session" in message and "'spawn'" in message, message
    # The parent goes on.
    with session.queue("after") as queue:
        b = session.buffer_from(np.ones(16, np.float32))
        queue.sync_to(b)


def test_a_released_buffer_s_room_is_there_for_the_next_allocation(fresh_daemon):
    import agora

    daemon = fresh_daemon("--session-quota", "64M")
    with agora.Session(socket=str(daemon.socket)) as session:
        big = 40 << 20
        for _ in range(20):
            b = session.buffer(big)
            b.release()
            session.buffer(big).release()
        for _ in range(20):
            b = session.buffer(big)
            del b
            c = session.buffer(big)
            del c
        # Released while a long task still writes it: the allocation waits for the task.
        n = LONG_N
        a = session.buffer_from(np.ones((n, n), np.float32))
        with session.queue("long") as queue:
            queue.sync_to(a)
            c = session.buffer(big)
            task = queue.launch("sgemm", n, n, n, 1.0, a, a, 0.0, c, range=(n, n))
            c.release()
            session.buffer(big).release()
            task.wait()
        # Beyond what any release frees: the daemon's refusal, at once.
        with pytest.raises(agora.QuotaExceededError, match="free buffers"):
            session.buffer(65 << 20)


def test_a_rank_of_an_mpi_or_slurm_job_gets_a_default_name_of_its_own(daemon):
    """Each rank writes checkpoints of its own: its default session name carries its rank."""
    import subprocess
    import sys

    script = "import agora; s = agora.Session(); print(s.session_status()['name'])"
    names = []
    for env in ({"PMI_RANK": "3"}, {"SLURM_PROCID": "12"}, {}):
        rank_variables = ("PMI_RANK", "PMIX_RANK", "OMPI_COMM_WORLD_RANK", "MV2_COMM_WORLD_RANK", "SLURM_PROCID")
        clean = {k: v for k, v in os.environ.items() if k not in rank_variables}
        out = subprocess.run(
            [sys.executable, "-c", script],
            env={**clean, **env, "AGORA_SOCKET": str(daemon.socket)},
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert out.returncode == 0, out.stderr
        names.append(out.stdout.strip())
    assert names == ["python:-c.rank3", "python:-c.rank12", "python:-c"], names


def test_agora_heap_bytes_in_the_environment_sets_the_default_heap(daemon):
    """An MPI-style job can ask for smaller heaps without changing its program; a value that is no
    size is refused, naming the variable."""
    import subprocess
    import sys

    script = "import agora; s = agora.Session(); print(s.session_status()['heap_quota'])"
    run = lambda value: subprocess.run(  # noqa: E731
        [sys.executable, "-c", script],
        env={**os.environ, "AGORA_SOCKET": str(daemon.socket), "AGORA_HEAP_BYTES": value},
        capture_output=True,
        text=True,
        timeout=60,
    )
    out = run("64M")
    assert out.returncode == 0, out.stderr
    assert int(out.stdout) == 64 << 20
    out = run("lots")
    assert out.returncode != 0
    assert "AGORA_HEAP_BYTES" in out.stderr and "256M" in out.stderr, out.stderr
    # Its own class, not the daemon's refusal of a request: nothing was asked of the daemon.
    assert "agora.EnvironmentSettingError" in out.stderr and "bad request" not in out.stderr, out.stderr
