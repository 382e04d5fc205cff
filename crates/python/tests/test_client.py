"""The Python client against a real daemon: results against NumPy, zero-copy views, errors."""

import gc
import os
import signal
import subprocess
import sys
import threading
import time
import traceback
import warnings

import numpy as np
import pytest

import agora
from conftest import long_sgemm

DEVICES = ["cpu", "opencl"]


def has_opencl(session) -> bool:
    return any(d["kind"] == "opencl" for d in session.status()["devices"])


@pytest.fixture(params=DEVICES)
def device(request, session):
    if request.param == "opencl" and not has_opencl(session):
        pytest.fail("no OpenCL device: the project's setup installs PoCL (scripts/setup.sh)")
    return request.param


def test_saxpy_matches_numpy(session, device):
    rng = np.random.default_rng(1)
    x = rng.standard_normal(100_003).astype(np.float32)
    y = rng.standard_normal(100_003).astype(np.float32)
    expected = np.float32(2.5) * x + y
    with session.queue("saxpy", device=device) as queue:
        bx, by = session.buffer_from(x), session.buffer_from(y)
        queue.sync_to(bx)
        queue.sync_to(by)
        queue.launch("saxpy", 2.5, bx, by, range=x.size)
        queue.sync_from(by)
    # OpenCL may fuse a*x+y into one FMA, so compare with an absolute floor too.
    np.testing.assert_allclose(by.numpy(), expected, rtol=1e-6, atol=1e-6)
    assert by.numpy().shape == (100_003,) and by.numpy().dtype == np.float32


def test_sgemm_and_vector_add_match_numpy(session, device):
    rng = np.random.default_rng(2)
    m, n, k = 64, 48, 80
    a = rng.standard_normal((m, k)).astype(np.float32)
    b = rng.standard_normal((k, n)).astype(np.float32)
    bias = rng.standard_normal((m, n)).astype(np.float32)
    sgemm = session.kernel("sgemm")
    with session.queue("layers", device=device) as queue:
        ba, bb, bbias = session.buffer_from(a), session.buffer_from(b), session.buffer_from(bias)
        c = session.buffer(m * n * 4)
        out = session.buffer(m * n * 4)
        for buf in (ba, bb, bbias):
            queue.sync_to(buf)
        queue.launch(sgemm, m, n, k, 1.0, ba, bb, 0.0, c, range=(m, n))
        queue.launch("vector_add", c, bbias, out, range=m * n)
        queue.sync_from(out)
    np.testing.assert_allclose(out.numpy(np.float32, (m, n)), a @ b + bias, rtol=1e-4, atol=1e-4)


def test_the_same_buffer_twice_in_one_launch(session):
    # sgemm(a, a): both arguments borrow one buffer (this once deadlocked the client).
    a = np.arange(16, dtype=np.float32).reshape(4, 4)
    ba, c = session.buffer_from(a), session.buffer(64)
    with session.queue() as queue:
        queue.sync_to(ba)
        queue.launch("sgemm", 4, 4, 4, 1.0, ba, ba, 0.0, c, range=(4, 4))
        queue.sync_from(c)
    np.testing.assert_allclose(c.numpy(np.float32, (4, 4)), a @ a)


def test_numpy_view_is_zero_copy_and_feeds_kernels(session):
    buf = session.buffer(4096 * 4)
    view = buf.numpy(np.float32)
    again = buf.numpy(np.float32, (64, 64))
    # Both views point at the same bytes: the buffer's host copy in the shared segment.
    assert view.__array_interface__["data"][0] == again.__array_interface__["data"][0]
    assert view.flags.writeable and not view.flags.owndata
    view[:] = np.arange(4096, dtype=np.float32)  # written in place, no copy
    assert again[1, 0] == 64.0
    with session.queue() as queue:
        queue.sync_to(buf)
        queue.launch("saxpy", 1.0, session.buffer_from(np.ones(4096, np.float32)), buf, range=4096)
        queue.sync_from(buf)
    np.testing.assert_array_equal(view, np.arange(4096, dtype=np.float32) + 1)


def test_views_keep_their_buffer_alive_and_block_release(session):
    buf = session.buffer_from(np.arange(1000, dtype=np.float64))
    view = buf.numpy()
    assert buf.views == 1
    with pytest.raises(agora.BufferInUseError, match="del"):
        buf.release()
    del buf
    gc.collect()
    # The view still holds the buffer (and the session mapping): reading is safe.
    assert view[999] == 999.0
    owner = view.base
    del view, owner
    gc.collect()
    other = session.buffer(8)
    other.release()
    assert "released" in repr(other)
    with pytest.raises(agora.ClosedError):
        other.numpy()
    with pytest.raises(agora.ClosedError):
        len(other)


def test_memset_copy_and_task_handles(session):
    a = session.buffer_from(np.arange(256, dtype=np.uint8))
    b = session.buffer(256)
    with session.queue() as queue:
        t1 = queue.copy(a, b, src_offset=16, dst_offset=0, nbytes=32)
        t2 = queue.memset(a, 7)
        t2.wait()
        t2.wait()  # waiting twice is fine
        assert t1.done() and t2.done()
    assert (a.numpy() == 7).all()
    np.testing.assert_array_equal(b.numpy()[:32], np.arange(16, 48, dtype=np.uint8))
    with session.queue() as queue:
        for value in (-1, 256):
            with pytest.raises(ValueError, match=f"memset value={value}: give a byte value, 0 to 255"):
                queue.memset(a, value)


def test_objects_of_another_session_are_refused_not_taken_for_this_ones(daemon):
    # Handles are numbers in their own session: the other session's first buffer and first
    # program kernel have the numbers of this session's own.
    mine, theirs = agora.Session(name="mine"), agora.Session(name="theirs")
    x = mine.buffer_from(np.full(4, 10.0, np.float32))
    y = mine.buffer_from(np.zeros(4, np.float32))
    other = theirs.buffer_from(np.full(4, 1000.0, np.float32))
    with mine.queue("q") as queue:
        queue.sync_to(x)
        queue.sync_to(y)
        with pytest.raises(agora.InvalidHandleError, match="argument 1: .* belongs to another session"):
            queue.launch("saxpy", 1.0, other, y, range=4)
        with pytest.raises(agora.InvalidHandleError, match="belongs to another session"):
            queue.launch("fill", 7.0, other, range=4)
        with pytest.raises(agora.InvalidHandleError, match="belongs to another session"):
            queue.sync_from(other)
        queue.sync_from(x)
    np.testing.assert_array_equal(x.numpy(), np.full(4, 10.0, np.float32))
    mine.close()
    theirs.close()


def test_wait_releases_the_gil(session):
    long, _ = long_sgemm(session)
    with session.queue(device="cpu") as queue:
        tasks = [long(queue) for _ in range(4)]
        counter = 0
        stop = threading.Event()

        def waiter():
            for task in tasks:
                task.wait()
            stop.set()

        thread = threading.Thread(target=waiter)
        started = time.monotonic()
        thread.start()
        while not stop.is_set():
            counter += 1
        thread.join()
        elapsed = time.monotonic() - started
    # While the other thread waited, this one kept running Python code.
    assert elapsed > 0.01 and counter > 1000, (elapsed, counter)


def test_latency_queue_and_status(session):
    with session.queue("frontend", queue_class="latency", sla_ms=50) as queue:
        queue.launch("noop", range=1).wait()
        queues = {q["name"]: q for q in session.session_status()["queues"]}
        assert "frontend" in queues
        assert queues["frontend"]["sla_ms"] == pytest.approx(50.0)
    with pytest.raises(ValueError, match="positive number of milliseconds"):
        session.queue(queue_class="latency", sla_ms=-1)


def test_errors_are_typed_and_say_what_to_do(session, daemon):
    with pytest.raises(agora.UnknownKernelError, match="did you mean saxpy"):
        session.kernel("saxpi")
    with pytest.raises(ValueError, match="'batch'"):
        session.queue(queue_class="urgent")
    with pytest.raises(ValueError, match="'cpu'"):
        session.queue(device="tpu")
    with pytest.raises(ValueError, match="at least 1 byte"):
        session.buffer(0)
    x = session.buffer(16)
    y = session.buffer(16)
    with session.queue() as queue:
        with pytest.raises(agora.ArgumentCountError, match="takes 3 arguments"):
            queue.launch("saxpy", 1.0, x, range=4)
        with pytest.raises(agora.ArgumentTypeError, match="is a buffer"):
            queue.launch("saxpy", 1.0, 2.0, y, range=4)
        with pytest.raises(agora.ArgumentTypeError, match="of saxpy is an f32 scalar"):
            queue.launch("saxpy", x, x, y, range=4)
        with pytest.raises(agora.ArgumentTypeError, match="not an i32"):
            queue.launch("gaussian.fan1", x, y, 2**40, 0, range=1)
        with pytest.raises(agora.ArgumentTypeError, match="holds float64 elements but the kernel reads float32"):
            queue.launch("saxpy", 1.0, session.buffer_from(np.zeros(4)), y, range=4)
        with pytest.raises(TypeError, match="range must be"):
            queue.launch("saxpy", 1.0, x, y, range="all")
        # Errors found by the daemon arrive when the task is waited for.
        with pytest.raises(agora.BufferTooSmallError, match="needs 400 bytes, has 16") as caught:
            queue.launch("saxpy", 1.0, x, y, range=100).wait()
        assert isinstance(caught.value, agora.TaskFailedError)
        assert isinstance(caught.value, agora.AgoraError)
        with pytest.raises(agora.AliasedBuffersError, match="distinct"):
            queue.launch("saxpy", 1.0, y, y, range=4).wait()
        with pytest.raises(agora.InvalidRangeError):
            queue.launch("saxpy", 1.0, x, y, range=0).wait()
        # A kernel whose size rule fixes the range says which range it must be (issue #19).
        with pytest.raises(agora.InvalidRangeError, match=r"invalid range \(4, 4\): the range must be exactly \(100000, 8\)"):
            queue.launch("sgemm", 100000, 8, 8, 1.0, x, x, 0.0, y, range=(4, 4)).wait()
        # An unreported failure surfaces at finish().
        queue.launch("saxpy", 1.0, x, y, range=1000)
        with pytest.raises(agora.BufferTooSmallError):
            queue.finish()
    with pytest.raises(agora.OutOfBoundsError, match="do not fit"):
        x.write(np.zeros(8, np.float32), offset=0)
    with pytest.raises(agora.QuotaExceededError, match="session-quota"):
        session.buffer(64 << 30)
    with pytest.raises(agora.ConnectError, match="agora serve"):
        agora.Session(socket="/nonexistent/agora.sock")
    queue = session.queue()
    queue.close()
    with pytest.raises(agora.ClosedError, match="closed"):
        queue.sync_to(x)


def test_each_failed_task_reports_its_own_error_every_time(fresh_daemon):
    # A device quota that two 32 MiB buffers can never fit: the launch over them fails on the
    # OpenCL device, and what it should have written is poisoned.
    daemon = fresh_daemon("--device-quota", "16M")
    with agora.Session(socket=str(daemon.socket)) as session:
        if not has_opencl(session):
            pytest.fail("no OpenCL device: the project's setup installs PoCL (scripts/setup.sh)")
        queue = session.queue("pressure", device="opencl")
        small = [session.buffer_from(np.full(1024, i, np.float32)) for i in range(4)]
        big_x = session.buffer_from(np.ones(8 << 20, np.float32))
        big_y = session.buffer_from(np.ones(8 << 20, np.float32))
        tasks = [queue.launch("saxpy", 1.0, small[0], small[1], range=1024)]
        tasks.append(queue.launch("saxpy", 1.0, big_x, big_y, range=8 << 20))
        tasks.append(queue.launch("saxpy", 2.0, small[2], small[3], range=1024))
        tasks.append(queue.launch("saxpy", 1.0, big_y, small[3], range=1024))  # reads the failure
        tasks.append(queue.sync_from(small[1]))
        with pytest.raises(agora.DeviceOutOfMemoryError) as caught:
            queue.finish()
        assert caught.value.count == 2
        assert [t for t, _ in caught.value.failures] == [tasks[1].id, tasks[3].id]
        assert isinstance(caught.value.failures[1][1], agora.DependencyFailedError)
        assert "2 tasks of this queue failed" in str(caught.value)
        queue.finish()  # nothing new since
        # Each task, asked twice and in any order, says the same.
        for _ in range(2):
            for task in reversed(tasks):
                if task is tasks[1]:
                    with pytest.raises(agora.DeviceOutOfMemoryError, match="device quota"):
                        task.wait()
                elif task is tasks[3]:
                    with pytest.raises(agora.DependencyFailedError, match=f"task {tasks[1].id}, which failed"):
                        task.wait()
                else:
                    task.wait()
        assert small[1].numpy()[0] == 1.0
        # The poisoned buffer cannot be read back until it is written again.
        with pytest.raises(agora.DependencyFailedError):
            queue.sync_from(big_y).wait()
        with pytest.raises(agora.DependencyFailedError) as caught:
            queue.finish()
        assert caught.value.count == 1
        cpu = session.queue("repair", device="cpu")
        cpu.sync_to(big_y).wait()
        cpu.sync_from(big_y).wait()
        cpu.finish()


def test_a_killed_daemon_is_a_disconnected_error(fresh_daemon):
    daemon = fresh_daemon("--no-opencl")
    session = agora.Session(socket=str(daemon.socket), reconnect_timeout=0)
    queue = session.queue()
    queue.launch("noop", range=1).wait()
    daemon.kill()
    with pytest.raises(agora.DisconnectedError, match="new one"):
        for _ in range(100):
            queue.launch("noop", range=1).wait()
            time.sleep(0.01)


DROP_DURING_RESUME = """
import sys, threading, time
import agora

session = agora.Session(socket=sys.argv[1], name="drop-during-resume", reconnect_timeout=30)
queue = session.queue()
queue.launch("noop", range=1).wait()
spare = session.buffer(64)
print("ready", flush=True)
sys.stdin.readline()  # the daemon is dead now
outcome = []

def resume():
    try:
        queue.launch("noop", range=1).wait()
        outcome.append("ok")
    except Exception as error:
        outcome.append(repr(error))

resuming = threading.Thread(target=resume)
resuming.start()
time.sleep(0.5)  # in its reconnection loop by now
started = time.monotonic()
del spare
print(f"dropped {time.monotonic() - started:.3f}", flush=True)
resuming.join(60)
print(f"resumed {outcome} {session.resumes}", flush=True)
session.close()
"""


def test_a_buffer_dropped_while_another_thread_resumes_the_session_goes_at_once(fresh_daemon):
    # ML-serving audit, defect 1: a thread waiting for a daemon to come back holds the session's
    # producer and checks for Ctrl-C under the GIL; a buffer dropped meanwhile (a finished
    # request's, on the event loop thread) held the GIL while it waited for the producer, and the
    # process hung for good. In a process of its own, so that a hang fails the test, not the run.
    daemon = fresh_daemon("--no-opencl")
    child = subprocess.Popen(
        [sys.executable, "-c", DROP_DURING_RESUME, str(daemon.socket)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        assert child.stdout.readline().strip() == "ready"
        daemon.kill()
        child.stdin.write("go\n")
        child.stdin.flush()
        lines = []
        reader = threading.Thread(target=lambda: lines.extend(child.stdout))
        reader.start()
        deadline = time.monotonic() + 20
        while not any(line.startswith("dropped") for line in lines) and time.monotonic() < deadline:
            time.sleep(0.05)
        dropped = [line for line in lines if line.startswith("dropped")]
        assert dropped, f"dropping a buffer during the reconnection hung: {lines}"
        took = float(dropped[0].split()[1])
        assert took < 1, f"dropping a buffer waited {took:.1f} s for the reconnection"
        fresh_daemon("--no-opencl")
        assert child.wait(60) == 0, lines
        reader.join(10)
        assert any(line.strip() == "resumed ['ok'] 1" for line in lines), lines
    finally:
        child.kill()
        child.wait()


def test_ctrl_c_interrupts_a_call_waiting_for_a_stopped_daemon_to_come_back(fresh_daemon):
    daemon = fresh_daemon("--no-opencl")
    session = agora.Session(socket=str(daemon.socket), name="ctrl-c-reconnect", reconnect_timeout=30)
    queue = session.queue()
    queue.launch("noop", range=1).wait()
    daemon.stop()

    class Interrupted(Exception):
        pass

    def handler(signum, frame):
        raise Interrupted()

    # A handler of the test's own stands in for Ctrl-C's KeyboardInterrupt (which would end
    # pytest); the client runs whichever handler is installed.
    previous = signal.signal(signal.SIGINT, handler)
    timer = threading.Timer(0.3, os.kill, (os.getpid(), signal.SIGINT))
    try:
        timer.start()
        started = time.monotonic()
        with pytest.raises(Interrupted):
            queue.launch("noop", range=1)
        took = time.monotonic() - started
    finally:
        timer.cancel()
        signal.signal(signal.SIGINT, previous)
    assert took < 5, f"the launch waited {took:.1f} s for the daemon, past Ctrl-C"
    # The session was not given up: a daemon that comes back takes it over at the next call.
    fresh_daemon("--no-opencl")
    queue.launch("noop", range=1).wait()
    assert session.resumes == 1
    session.close()


def test_a_per_uid_limit_is_a_limit_reached_error_naming_the_setting(fresh_daemon):
    daemon = fresh_daemon("--no-opencl", "--limit-sessions-per-uid", "1")
    with agora.Session(socket=str(daemon.socket), heap_bytes=1 << 20) as first:
        with pytest.raises(agora.LimitReachedError, match="sessions per uid is 1") as caught:
            agora.Session(socket=str(daemon.socket), heap_bytes=1 << 20)
        assert "--limit-sessions-per-uid" in str(caught.value)
        # The first session is unaffected, and the status shows the use against the limit.
        queue = first.queue()
        queue.launch("noop", range=1).wait()
        mine = [u for u in first.status()["uids"] if u["uid"] == os.getuid()]
        assert mine and mine[0]["sessions"] == {"used": 1, "max": 1}


def test_module_exports_every_error_class():
    for name in agora.__all__:
        if name.endswith("Error"):
            assert issubclass(getattr(agora, name), agora.AgoraError)
    assert agora.__version__
    assert os.path.exists(os.path.join(os.path.dirname(agora.__file__), "py.typed"))


def test_exceptions_print_as_agora_classes(session):
    for name in agora.__all__:
        if name.endswith("Error"):
            cls = getattr(agora, name)
            assert cls.__module__ == "agora", (name, cls.__module__)
            assert repr(cls) == f"<class 'agora.{name}'>"
    queue = session.queue()
    queue.close()
    with pytest.raises(agora.ClosedError) as caught:
        queue.finish()
    assert traceback.format_exception_only(caught.type, caught.value)[0].startswith("agora.ClosedError: ")


def test_numpy_shape_keeps_the_remembered_dtype(session):
    buf = session.buffer_from(np.arange(16, dtype=np.float32))
    view = buf.numpy(shape=(2, 8))
    assert view.dtype == np.float32 and view.shape == (2, 8)
    assert view[1, 0] == 8.0
    assert buf.numpy(np.uint8).shape == (64,)  # an explicit dtype drops the remembered shape


def test_close_ends_the_daemons_session_at_once_while_views_of_its_buffers_live(daemon):
    # SRE audit, defect 4: close() left the daemon's session (its heap quota, its place among
    # the user's sessions) alive for as long as any NumPy view or buffer object of it was
    # referenced, which in a long-running service is for ever.
    with agora.Session(name="observer") as observer:
        before = observer.status()["live_sessions"]
        session = agora.Session(name="closing-with-views")
        x = session.buffer_from(np.arange(1024, dtype=np.float32))
        queue = session.queue("q")
        view = x.numpy()
        assert observer.status()["live_sessions"] == before + 1
        session.close()
        deadline = time.monotonic() + 10
        while observer.status()["live_sessions"] > before and time.monotonic() < deadline:
            time.sleep(0.02)
        assert observer.status()["live_sessions"] == before, "the daemon still holds the closed session"
        assert view[1023] == 1023.0  # the view stays readable: the memory is still mapped here
        with pytest.raises(agora.ClosedError, match="session was closed"):
            queue.launch("noop", range=1)
        del x, queue  # releases after the end are not issued, and raise nothing
        assert view.sum() == sum(range(1024))


def test_after_close_every_call_on_the_sessions_objects_raises_closed(daemon):
    session = agora.Session(name="closing")
    queue = session.queue("q")
    x = session.buffer_from(np.arange(16, dtype=np.float32))
    y = session.buffer(64)
    task = queue.launch("noop", range=1)
    task.wait()
    view = x.numpy()
    session.close()
    calls = {
        "session.queue": lambda: session.queue(),
        "session.buffer": lambda: session.buffer(8),
        "session.kernel": lambda: session.kernel("saxpy"),
        "session.status": lambda: session.status(),
        "queue.launch": lambda: queue.launch("saxpy", 1.0, x, y, range=16),
        "queue.sync_to": lambda: queue.sync_to(x),
        "queue.sync_from": lambda: queue.sync_from(x),
        "queue.memset": lambda: queue.memset(y, 1),
        "queue.copy": lambda: queue.copy(x, y),
        "queue.finish": lambda: queue.finish(),
        "task.wait": lambda: task.wait(),
        "task.done": lambda: task.done(),
        "buffer.numpy": lambda: x.numpy(),
        "buffer.nbytes": lambda: x.nbytes,
        "buffer.write": lambda: x.write(np.zeros(4, np.float32)),
        "memoryview": lambda: memoryview(y),
    }
    for name, call in calls.items():
        with pytest.raises(agora.ClosedError, match="session was closed") as caught:
            call()
            pytest.fail(f"{name} worked after session.close()")
        assert "session's session" not in str(caught.value), caught.value
    assert "closed" in repr(queue) and "closed" in repr(x)
    assert view[15] == 15.0  # views made before stay readable
    queue.close()  # clean-up after close is allowed
    y.release()
    session.close()


CTRL_C_SCRIPT = """
import signal
import numpy as np, agora
# Ctrl-C raises KeyboardInterrupt even when this runs under a shell that ignores SIGINT (a
# background job inherits SIG_IGN, and Python then installs no handler of its own).
signal.signal(signal.SIGINT, signal.default_int_handler)
session = agora.Session(name="ctrl-c")
n = 1024
a = session.buffer_from(np.ones((n, n), np.float32))
c = session.buffer(n * n * 4)
queue = session.queue("long", device="cpu")
tasks = [queue.launch("sgemm", n, n, n, 1.0, a, a, 0.0, c, range=(n, n)) for _ in range(COUNT)]
last = tasks[-1]
for what, wait in (("wait", last.wait), ("finish", queue.finish)):
    print("waiting in", what, flush=True)
    try:
        wait()
        print(what, "returned", flush=True)
    except KeyboardInterrupt:
        print(what, "interrupted, task done:", last.done(), flush=True)
other = session.queue("other", queue_class="latency")
other.launch("noop", range=1).wait()
print("session usable", flush=True)
"""


def test_ctrl_c_interrupts_wait_and_finish(daemon):
    # Enough sgemms (2 GFLOP each) on the CPU that the last one is far from done when Ctrl-C comes.
    script = CTRL_C_SCRIPT.replace("COUNT", "40")
    child = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    lines = []
    try:
        for line in child.stdout:
            lines.append(line.strip())
            if line.startswith("waiting in"):
                time.sleep(0.3)  # let it block in the wait, then press Ctrl-C
                child.send_signal(signal.SIGINT)
        assert child.wait(60) == 0, lines
    finally:
        if child.poll() is None:
            child.kill()
    assert "wait interrupted, task done: False" in lines, lines
    assert "finish interrupted, task done: False" in lines, lines
    assert lines[-1] == "session usable", lines


def test_status_summarises_and_session_status_lists_every_queue(session):
    queues = [session.queue(f"many-{i}") for i in range(20)]
    status = session.status()
    assert status["live_sessions"] >= 1
    mine = next(s for s in status["sessions"] if s["id"] == session.id)
    assert mine["queue_count"] >= 20
    assert len(mine["queues"]) <= 8  # the busiest only: the summary stays small
    details = session.session_status()
    assert details["id"] == session.id and details["queue_count"] == mine["queue_count"]
    names = {q["name"] for q in details["queues"]}
    assert {f"many-{i}" for i in range(20)} <= names
    with pytest.raises(agora.BadRequestError, match="no live session"):
        session.session_status(10**9)
    with pytest.raises(agora.BadRequestError, match="too long"):
        session.queue("q" * 257)
    # Names other users' terminals print: no escape sequences, newlines or direction overrides.
    with pytest.raises(agora.BadRequestError, match=r"queue name holds U\+001B \(a control character\) at byte 0"):
        session.queue("\x1b[2Jfake")
    with pytest.raises(agora.BadRequestError, match=r"U\+202E"):
        session.queue("report\u202efdp.exe")
    with pytest.raises(agora.BadRequestError, match=r"client name holds U\+000A"):
        agora.Session(name="job\n  #1 sshd")
    queues.append(session.queue("données"))  # printable, in any script: fine
    for q in queues:
        q.close()


def counting_while(call):
    """Runs `call` in a thread; counts how often this thread runs Python meanwhile."""
    outcome = {}

    def run():
        try:
            outcome["value"] = call()
        except Exception as e:  # noqa: BLE001 - handed to the caller
            outcome["error"] = e

    thread = threading.Thread(target=run)
    counter = 0
    started = time.monotonic()
    thread.start()
    while thread.is_alive():
        counter += 1
    thread.join()
    return outcome, counter, time.monotonic() - started


def test_a_daemon_that_does_not_answer_raises_timeout_error_without_holding_the_gil(fresh_daemon):
    daemon = fresh_daemon("--no-opencl")
    session = agora.Session(socket=str(daemon.socket), control_timeout=0.5)
    assert issubclass(agora.TimeoutError, agora.AgoraError)
    daemon.process.send_signal(signal.SIGSTOP)
    try:
        outcome, counter, elapsed = counting_while(lambda: session.buffer(64))
        # SRE audit, defect 7: opening a session waited a fixed 10 s whatever the timeout, then
        # said to start a daemon with `agora serve` (one was there, stopped).
        started = time.monotonic()
        with pytest.raises(agora.TimeoutError, match=r"did not answer the hello \(opening the session\) within 0.5 s"):
            agora.Session(socket=str(daemon.socket), control_timeout=0.5)
        assert time.monotonic() - started < 5
    finally:
        daemon.process.send_signal(signal.SIGCONT)
    assert isinstance(outcome.get("error"), agora.TimeoutError), outcome
    # ML-serving audit, defect 4: `except TimeoutError` missed it.
    assert isinstance(outcome["error"], TimeoutError) and isinstance(outcome["error"], agora.AgoraError)
    assert type(outcome["error"]).__module__ == "agora" and type(outcome["error"]).__name__ == "TimeoutError"
    assert "buffer allocation" in str(outcome["error"])
    # The limit as Python sets it, not the Rust client's option.
    assert "Session(control_timeout=...)" in str(outcome["error"]), outcome["error"]
    assert "SessionOptions" not in str(outcome["error"]), outcome["error"]
    assert 0.4 < elapsed < 10, elapsed
    assert counter > 1000, counter  # this thread ran while the other waited
    # The late reply is skipped; the session works.
    buf = session.buffer(64)
    assert buf.nbytes == 64
    assert session.status()["pid"] == daemon.process.pid
    with pytest.raises(ValueError, match="control_timeout"):
        agora.Session(socket=str(daemon.socket), control_timeout=-1)


def test_a_launch_waiting_for_ring_room_releases_the_gil(fresh_daemon, tmp_path):
    config = tmp_path / "sim.toml"
    config.write_text('[[sim]]\nname = "slow"\nlanes = 1\nlaunch_ns = 300000000\n')
    daemon = fresh_daemon("--no-opencl", "--ring-capacity", "2", "--preempt-target-us", "0", "--config", str(config))
    session = agora.Session(socket=str(daemon.socket))
    x = session.buffer_from(np.ones(1024, np.float32))
    out = session.buffer(4096)
    queue = session.queue("slow", device="sim")
    first = [queue.launch("vector_add", x, x, out, range=1024) for _ in range(2)]
    # The rings hold two tasks: this launch waits for the first to complete (~0.3 s).
    outcome, counter, elapsed = counting_while(lambda: queue.launch("vector_add", x, x, out, range=1024))
    assert "value" in outcome, outcome
    assert elapsed > 0.1 and counter > 1000, (elapsed, counter)
    for task in first + [outcome["value"]]:
        task.wait()


def test_releasing_results_never_read_back_warns(session):
    # Issue #19: a kernel's results that no sync_from brought home are lost when the buffer goes.
    queue = session.queue()
    x = session.buffer_from(np.ones(64, np.float32))
    forgotten = session.buffer_from(np.zeros(64, np.float32))
    read_back = session.buffer_from(np.zeros(64, np.float32))
    for y in (forgotten, read_back):
        queue.sync_to(y)
        queue.launch("saxpy", 2.0, x, y, range=64)
    queue.sync_to(x)
    queue.sync_from(read_back)
    queue.finish()
    # The daemon runs this module in strict coherence: the host copy is stale without sync_from.
    assert (forgotten.numpy() == 0).all()
    assert (read_back.numpy() == 2).all()
    with pytest.warns(ResourceWarning, match="never read back"):
        forgotten.release()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        read_back.release()
        x.release()
    # Garbage collected without release(): the same warning.
    lost = session.buffer_from(np.zeros(64, np.float32))
    queue.launch("saxpy", 2.0, session.buffer_from(np.ones(64, np.float32)), lost, range=64)
    queue.finish()
    with pytest.warns(ResourceWarning, match="sync_from"):
        del lost
        gc.collect()


def test_writes_over_unread_results_survive_evictions_once_claimed(fresh_daemon, tmp_path):
    # A 4 MiB device in a device host whose write-backs take 150 ms: results never read back are
    # evicted while the client writes new data over them. Through a NumPy view after
    # claim_host(), or through write(), the client's data is what the next round computes on.
    config = tmp_path / "sim.toml"
    config.write_text(
        '[[sim]]\nname = "sim0"\nlanes = 1\nmemory = "4M"\nanswer_delay_ms = 150\ndevice_host = true\n'
    )
    daemon = fresh_daemon("--no-opencl", "--config", str(config))
    with agora.Session(socket=str(daemon.socket)) as session:
        queue = session.queue("over-the-device", device="sim")
        n = 1 << 18  # 1 MiB of float32: x and three results fit the device
        x = session.buffer_from(np.ones(n, np.float32))
        ys = [session.buffer_from(np.full(n, i, np.float32)) for i in range(8)]
        for y in ys:
            queue.sync_to(y)
            queue.launch("saxpy", 3.0, x, y, range=n)
        queue.finish()
        for i, y in enumerate(ys):
            if i % 2:
                y.write(np.full(n, 100 + i, np.float32))
            else:
                y.claim_host()
                y.numpy(np.float32)[:] = 100 + i
        for y in ys:
            queue.sync_to(y)
            queue.launch("saxpy", 3.0, x, y, range=n)
        queue.finish()
        for i, y in enumerate(ys):
            queue.sync_from(y).wait()
            assert (y.numpy(np.float32) == 103 + i).all(), (i, y.numpy(np.float32)[0])
        evictions = session.status()["evictions"]
        assert evictions >= 4, f"only {evictions} evictions: the device did not run out of memory"


def test_arrays_in_another_byte_order_are_refused_with_the_conversion(session):
    # Kernels read native numbers: a big-endian array (FITS, HDF5, network data) would be read
    # as garbage, so every way in refuses it and says how to convert it.
    swapped = np.ones(4, np.float32).astype(np.dtype(np.float32).newbyteorder("S"))
    native = np.dtype(np.float32).str
    with pytest.raises(agora.ArgumentTypeError, match=f"astype\\('{native}'\\)") as caught:
        session.buffer_from(swapped)
    assert "newbyteorder('=')" in str(caught.value)
    y = session.buffer_from(np.zeros(4, np.float32))
    with pytest.raises(agora.ArgumentTypeError, match="byte order"):
        y.write(swapped)
    with pytest.raises(agora.ArgumentTypeError, match="byte order"):
        session.shared_buffer(dtype=swapped.dtype, shape=(4,))
    # Converted as the message says, it works.
    x = session.buffer_from(swapped.astype(native))
    with session.queue() as queue:
        queue.sync_to(x)
        queue.sync_to(y)
        queue.launch("saxpy", 1.0, x, y, range=4)
        queue.sync_from(y)
    assert np.all(y.numpy() == 1.0)
    # Bytes without numbers in them have no byte order: accepted as before (into a buffer of
    # raw bytes: one made from float32 takes float32 only).
    session.buffer(16).write(np.zeros(16, np.uint8))
    # ML-serving audit, defect 5: float64 data (a list, a default NumPy array) was written into a
    # float32 buffer as its bytes, and saxpy then computed on garbage.
    for wrong in (np.arange(4, dtype=np.float64), [1.0, 2.0, 3.0, 4.0], np.zeros(16, np.uint8)):
        with pytest.raises(agora.ArgumentTypeError, match=r"holds float32 elements .*astype\(numpy.float32\)"):
            y.write(wrong)
    assert np.all(y.numpy() == 1.0), "a refused write changes nothing"
    y.write(np.arange(4, dtype=np.float32))


def test_each_kind_of_object_says_how_it_ended(session):
    buffer = session.buffer(16)
    buffer.release()
    for use in (lambda: buffer.numpy(), lambda: buffer.write(np.zeros(4, np.uint8)), lambda: len(buffer)):
        with pytest.raises(agora.ClosedError, match=r"this buffer was released \(buf\.release\(\)\)") as caught:
            use()
        assert "`with`" not in str(caught.value)
    queue = session.queue()
    queue.close()
    with pytest.raises(agora.ClosedError, match=r"this queue was closed \(queue\.close\(\), or the end of its `with` block\)"):
        queue.memset(session.buffer(4), 0)
