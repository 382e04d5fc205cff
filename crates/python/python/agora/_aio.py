"""asyncio support (``await task`` suspends the coroutine, not the event loop) and completion
callbacks (``task.add_done_callback(fn)``).

Owns, per session with awaited tasks or pending callbacks, one waiting thread: it blocks on the
session's completions without the GIL, hands each finished task's outcome to the loop that awaits
it (``call_soon_threadsafe``) and calls each finished task's callbacks. So a thousand coroutines
awaiting tasks cost one thread per session, not a thread each (``run_in_executor(None,
task.wait)`` would take a worker of the loop's default pool per wait, a handful on a small
machine). The thread ends when the session has had nothing to wait for for a second. Must not:
hold the GIL while it waits, call into an event loop from its own thread other than through
``call_soon_threadsafe``, or hold ``_lock`` while it calls a callback (a callback may add more).
"""

import asyncio
import logging
import threading
import time

_log = logging.getLogger("agora")

# How long the waiting thread blocks at most before it looks again; a completion wakes it
# at once. It also bounds how late it notices a task completed without a new completion in the
# ring (a session resumed on a restarted daemon fails its old tasks that way).
_WAIT_S = 0.05
# How long the waiting thread stays with nothing to wait for: a coroutine awaiting one task
# after another would otherwise start a thread for each (~100 µs each, measured).
_LINGER_S = 1.0

_lock = threading.Lock()
_work = threading.Condition(_lock)  # an entry was added
_waiters = {}  # session key -> _Waiter


def await_task(task):
    """What ``Task.__await__`` returns: an iterator over a future of the running loop that the
    session's waiting thread resolves with the task's outcome."""
    loop = asyncio.get_running_loop()
    future = loop.create_future()
    if task.done():
        _settle(task, future)
    else:
        _watch(task, loop, future)
    return future.__await__()


def add_done_callback(task, callback):
    """What ``Task.add_done_callback`` does: the session's waiting thread calls ``callback(task)``
    once the task completes (at once on that thread when it already has)."""
    if not callable(callback):
        raise TypeError(f"add_done_callback takes a callable, not {type(callback).__name__}")
    _watch(task, None, callback)


def _watch(task, loop, future):
    """Has the waiting thread of ``task``'s session look after it: with ``loop`` a future of that
    loop, without one a callback."""
    key = task._session_key()
    with _lock:
        waiter = _waiters.get(key)
        if waiter is None:
            waiter = _waiters[key] = _Waiter(key)
            start = True
        else:
            start = False
        waiter.entries.append((task, loop, future))
        _work.notify_all()
    if start:
        waiter.start()


def _call(task, callback):
    """Runs on the waiting thread: a callback's exception is logged, as ``concurrent.futures``
    does, and the other callbacks still run."""
    try:
        callback(task)
    except Exception:  # noqa: BLE001  (the caller's code: reported, not allowed to stop the thread)
        _log.exception("exception calling the completion callback of %r", task)


def _settle(task, future):
    """Runs on the loop's thread: the future takes the task's outcome (its error, every time)."""
    if future.done():  # cancelled by its awaiter meanwhile: the task ran on regardless
        return
    try:
        task.wait()  # complete: returns or raises at once
    except Exception as error:  # noqa: BLE001  (the task's own error, handed on as it is)
        future.set_exception(error)
    else:
        future.set_result(None)


class _Waiter(threading.Thread):
    """The waiting thread of one session."""

    def __init__(self, key):
        super().__init__(name="agora-await", daemon=True)
        self.key = key
        self.entries = []  # (task, loop, future) or (task, None, callback), under _lock

    def run(self):
        while True:
            with _lock:
                if not self.entries:
                    _work.wait_for(lambda: self.entries, timeout=_LINGER_S)
                if not self.entries:
                    del _waiters[self.key]
                    return
                entries = list(self.entries)
            probe = entries[0][0]
            try:
                seen = probe._completions_seen()
            except Exception:  # noqa: BLE001  (the session was closed: done() says how below)
                seen = None
            finished = []
            for entry in entries:
                task, loop, future = entry
                try:
                    complete = (loop is not None and future.done()) or task.done()
                except Exception:  # noqa: BLE001  (closed session: task.wait() raises the same)
                    complete = True
                if complete:
                    finished.append(entry)
            if finished:
                # Taken out first: a callback may await or add more.
                with _lock:
                    self.entries = [e for e in self.entries if not any(e is f for f in finished)]
                for task, loop, future in finished:
                    if loop is None:
                        _call(task, future)
                        continue
                    try:
                        loop.call_soon_threadsafe(_settle, task, future)
                    except RuntimeError:  # its loop is closed: nobody awaits it any more
                        pass
                continue
            if seen is not None:
                try:
                    probe._wait_for_completions(seen, _WAIT_S)
                except Exception:  # noqa: BLE001  (the next pass settles the tasks with the error)
                    time.sleep(_WAIT_S)
            else:
                time.sleep(_WAIT_S)
