"""`task.add_done_callback(fn)` (agora._aio): each callback runs once, on the session's waiting
thread, with a task whose outcome is its own; a callback may issue more work; one that raises is
logged and stops no other."""

import logging
import queue as queue_module
import threading

import numpy as np

import agora
from conftest import long_sgemm


def test_each_callback_runs_once_on_the_waiting_thread_with_its_own_outcome(session):
    n = 1024
    x = session.buffer_from(np.ones(n, np.float32))
    y = session.buffer_from(np.zeros(n, np.float32))
    small = session.buffer_from(np.zeros(4, np.float32))
    told = queue_module.Queue()
    expected = {}

    def callback(task):
        try:
            task.wait()
            outcome = "ok"
        except agora.BufferTooSmallError:
            outcome = "too small"
        told.put((task.id, outcome, threading.current_thread().name))

    with session.queue(device="cpu") as q:
        q.sync_to(x)
        q.sync_to(y)
        for i in range(200):
            fails = i % 9 == 4
            task = q.launch("saxpy", 1.0, x, small if fails else y, range=n)
            expected[task.id] = "too small" if fails else "ok"
            task.add_done_callback(callback)
        outcomes = {}
        for _ in expected:
            task_id, outcome, thread = told.get(timeout=30)
            assert thread == "agora-await"
            assert task_id not in outcomes, f"task {task_id}'s callback ran twice"
            outcomes[task_id] = outcome
        assert outcomes == expected
        assert told.empty()
        try:
            q.finish()
        except agora.BufferTooSmallError:
            pass  # the failures are still the queue's to report, as without callbacks
        q.sync_from(y).wait()
    runs = sum(1 for outcome in expected.values() if outcome == "ok")
    np.testing.assert_array_equal(y.numpy().view(np.float32), np.full(n, float(runs), np.float32))


def test_a_callback_may_issue_work_and_one_that_raises_is_logged_and_stops_no_other(session, caplog):
    n = 256
    x = session.buffer_from(np.ones(n, np.float32))
    y = session.buffer_from(np.zeros(n, np.float32))
    chain_done = threading.Event()
    others = queue_module.Queue()
    with session.queue(device="cpu") as q:
        q.sync_to(x)
        q.sync_to(y).wait()

        def step(left):
            def callback(task):
                task.wait()
                if left == 1:
                    chain_done.set()
                else:
                    step(left - 1)

            q.launch("saxpy", 1.0, x, y, range=n).add_done_callback(callback)

        def raises(task):
            raise ValueError("a callback that raises (this test's)")

        with caplog.at_level(logging.ERROR, logger="agora"):
            step(30)
            q.launch("noop", range=1).add_done_callback(raises)
            for _ in range(5):
                q.launch("noop", range=1).add_done_callback(lambda task: others.put(task.done()))
            for _ in range(5):
                assert others.get(timeout=30) is True
            assert chain_done.wait(60), "the chain of callbacks ended"
        assert any("completion callback" in r.getMessage() and r.exc_info for r in caplog.records)
        q.sync_from(y).wait()
    np.testing.assert_array_equal(y.numpy().view(np.float32), np.full(n, 30.0, np.float32))


def test_a_callback_must_be_callable(session):
    with session.queue() as q:
        task = q.launch("noop", range=1)
        try:
            task.add_done_callback(42)
        except TypeError as error:
            assert "callable" in str(error)
        else:
            raise AssertionError("a non-callable callback was taken")
        task.wait()



def test_a_callback_pending_when_its_session_closes_runs_and_sees_closed_error(daemon):
    s = agora.Session(name="closing-callbacks")
    long, _ = long_sgemm(s)
    told = queue_module.Queue()

    def callback(task):
        try:
            task.wait()
            told.put("ok")
        except agora.ClosedError:
            told.put("closed")

    task = long(s.queue(device="cpu"))
    task.add_done_callback(callback)
    s.close()
    assert told.get(timeout=30) == "closed"  # a 768² sgemm is not done a moment after launch
    assert told.empty()
    # Registered after the close: refused at once, never called.
    try:
        task.add_done_callback(callback)
    except agora.ClosedError:
        pass
    else:
        raise AssertionError("a callback was taken for a task of a closed session")
    assert told.empty()
