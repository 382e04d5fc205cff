"""`await task` (agora._aio): a coroutine waits for its task without blocking the event loop;
many coroutines awaiting many tasks cost one waiting thread per session; a failed task raises
its own error; a cancelled await leaves the task running and everything usable."""

import asyncio
import threading
import time

import numpy as np
import pytest

import agora
from conftest import LONG_N, long_sgemm


def await_threads():
    return [t for t in threading.enumerate() if t.name == "agora-await"]


def no_await_threads_within(seconds):
    deadline = time.monotonic() + seconds
    while await_threads() and time.monotonic() < deadline:
        time.sleep(0.01)
    return not await_threads()


def test_many_coroutines_await_their_tasks_with_one_thread_and_exact_results(session):
    coroutines, rounds, n = 8, 25, 4096
    most_threads = 0
    # Another session's thread (an earlier test's) lingers a second after its last task.
    assert no_await_threads_within(5)

    async def worker(index, queue):
        nonlocal most_threads
        x = session.buffer_from(np.full(n, float(index), np.float32))
        y = session.buffer_from(np.zeros(n, np.float32))
        await queue.sync_to(x)
        await queue.sync_to(y)
        for _ in range(rounds):
            await queue.launch("saxpy", 1.0, x, y, range=n)  # y += x
            most_threads = max(most_threads, len(await_threads()))
        await queue.sync_from(y)
        return y.numpy().copy()

    async def main():
        queues = [session.queue(f"aio-{i}", device="cpu") for i in range(coroutines)]
        try:
            return await asyncio.gather(*(worker(i, q) for i, q in enumerate(queues)))
        finally:
            for q in queues:
                q.close()

    results = asyncio.run(main())
    for index, y in enumerate(results):
        np.testing.assert_array_equal(y, np.full(n, float(index * rounds), np.float32))
    assert most_threads == 1, f"{most_threads} waiting threads for one session"
    # The thread ends once nothing is awaited.
    assert no_await_threads_within(5)


def test_the_event_loop_runs_while_a_task_runs(session):
    n = LONG_N
    long, c = long_sgemm(session)

    async def main():
        ticks = 0
        done_at_first_tick = None
        stop = asyncio.Event()

        async def ticker():
            nonlocal ticks, done_at_first_tick
            while not stop.is_set():
                await asyncio.sleep(0.001)
                ticks += 1

        with session.queue(device="cpu") as queue:
            tasks = [long(queue) for _ in range(3)]
            ticking = asyncio.create_task(ticker())
            await asyncio.sleep(0)  # the ticker starts
            started = time.monotonic()
            done_at_first_tick = tasks[-1].done()
            for task in tasks:
                await task
            elapsed = time.monotonic() - started
            stop.set()
            await ticking
            queue.sync_from(c).wait()
        return ticks, done_at_first_tick, elapsed

    ticks, done_at_first_tick, elapsed = asyncio.run(main())
    assert not done_at_first_tick, "the tasks were done before the ticker ran: nothing measured"
    # A blocking wait would have held the loop for the whole time: no tick at all.
    assert ticks >= 5, (ticks, elapsed)
    np.testing.assert_allclose(c.numpy().view(np.float32).reshape(n, n)[:2, :2], np.full((2, 2), float(n)))


def test_an_awaited_failure_raises_its_own_error_every_time(session):
    x = session.buffer_from(np.ones(4, np.float32))
    y = session.buffer_from(np.zeros(4, np.float32))

    async def main():
        with session.queue() as queue:
            bad = queue.launch("saxpy", 1.0, x, y, range=100)
            for _ in range(2):
                with pytest.raises(agora.BufferTooSmallError, match="needs 400 bytes, has 16"):
                    await bad
            # What the refused launch would have written is poisoned until rewritten whole.
            with pytest.raises(agora.DependencyFailedError):
                await queue.launch("saxpy", 2.0, x, y, range=4)
            queue.sync_to(y)
            good = queue.launch("saxpy", 2.0, x, y, range=4)
            await good
            assert good.done()
            with pytest.raises(agora.BufferTooSmallError):
                queue.finish()  # the failure is reported once more here, as without asyncio

    asyncio.run(main())


def test_a_cancelled_await_leaves_the_task_running_and_the_session_usable(session):
    long, c = long_sgemm(session)

    async def main():
        with session.queue(device="cpu") as queue:
            task = long(queue)
            waiting = asyncio.create_task(asyncio.wait_for(_await(task), 0.001))
            with pytest.raises(asyncio.TimeoutError):
                await waiting
            await task  # the task ran on; awaiting it again works
            await queue.sync_from(c)
            assert c.numpy().view(np.float32)[0] == float(LONG_N)

    async def _await(task):
        await task

    asyncio.run(main())


def test_awaiting_outside_an_event_loop_says_so(session):
    with session.queue() as queue:
        task = queue.launch("noop", range=1)
        with pytest.raises(RuntimeError, match="no running event loop"):
            task.__await__()
        task.wait()


def test_a_session_closed_while_a_task_is_awaited_raises_closed_error(daemon):
    s = agora.Session(name="closing")
    long, _ = long_sgemm(s)
    task = long(s.queue(device="cpu"))

    async def main():
        async def waiter():
            await task

        waiting = asyncio.create_task(waiter())
        await asyncio.sleep(0.01)
        s.close()
        with pytest.raises(agora.ClosedError):
            await asyncio.wait_for(waiting, 10)

    asyncio.run(main())
