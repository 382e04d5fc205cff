"""Checkpoint/restart from Python (issue 15): protect, checkpoint as a queue task, the daemon
killed with SIGKILL and started again, and a new session of the same application recovering
exactly; the refusals raise with a message that says what to do."""

import time

import numpy as np
import pytest

import agora


def test_a_python_application_recovers_its_protected_buffers_after_the_daemon_dies(fresh_daemon):
    daemon = fresh_daemon()
    n = 1 << 16
    x0 = (np.arange(n) % 1000).astype(np.float32)
    with agora.Session(name="py-solver", socket=str(daemon.socket)) as s:
        x = s.buffer_from(x0)
        y = s.buffer_from(np.zeros(n, dtype=np.float32))
        q = s.queue("main")
        q.checkpoint(1)
        with pytest.raises(agora.TaskFailedError, match="no buffer is protected"):
            q.finish()
        s.protect(1, x)
        s.protect(2, y)
        assert q.snapshot() is None  # the daemon's interval (60 s) has not passed
        for step in (1, 2):
            q.launch("saxpy", 2.0, x, y, range=n)
            q.checkpoint(step)
        q.launch("saxpy", 2.0, x, y, range=n)  # after the last checkpoint: not in it
        q.finish()
        q.checkpoint(3, level=4)
        with pytest.raises(agora.TaskFailedError, match="level 4 is not available"):
            q.finish()
        with pytest.raises(ValueError, match="levels are 1"):
            q.checkpoint(3, level=7)
        # Written in the background: wait for the writer before the daemon dies.
        deadline = time.monotonic() + 20
        while s.checkpoints()["writing"] and time.monotonic() < deadline:
            time.sleep(0.01)
        listing = s.checkpoints()
        assert [c["checkpoint"] for c in listing["checkpoints"]] == [1, 2], listing
    daemon.kill()
    daemon.socket.unlink(missing_ok=True)
    daemon = fresh_daemon()
    with agora.Session(name="py-solver", socket=str(daemon.socket)) as s:
        x = s.buffer_from(np.zeros(n, dtype=np.float32))
        y = s.buffer_from(np.full(n, -1.0, dtype=np.float32))
        s.protect(1, x)
        s.protect(2, y)
        report = s.recover()
        assert report["checkpoint"] == 2, report
        assert sorted(report["restored"]) == [1, 2]
        np.testing.assert_array_equal(x.numpy(dtype=np.float32), x0)
        np.testing.assert_array_equal(y.numpy(dtype=np.float32), 4.0 * x0)


def test_recover_without_a_checkpoint_raises_checkpoint_error(fresh_daemon):
    daemon = fresh_daemon()
    with agora.Session(name="never-saved", socket=str(daemon.socket)) as s:
        b = s.buffer_from(np.zeros(4, dtype=np.float32))
        with pytest.raises(agora.CheckpointError, match="nothing is protected"):
            s.recover()
        s.protect(7, b)
        with pytest.raises(agora.CheckpointError, match="no checkpoint to recover from"):
            s.recover()


def test_a_checkpointed_launch_runs_in_windows_and_resumes_after_the_recovered_one(fresh_daemon):
    daemon = fresh_daemon()
    n = 8192
    x0 = np.arange(n, dtype=np.float32)
    with agora.Session(name="py-partial", socket=str(daemon.socket)) as s:
        x = s.buffer_from(x0)
        y = s.buffer_from(np.ones(n, dtype=np.float32))
        q = s.queue("windows")
        # One window by hand: only its rows change.
        q.launch("saxpy", 2.0, x, y, range=n, rows=(1024, 2048))
        q.sync_from(y)
        q.finish()
        expected = np.ones(n, dtype=np.float32)
        expected[1024:2048] += 2.0 * x0[1024:2048]
        np.testing.assert_array_equal(y.numpy(), expected)
        with pytest.raises(agora.TaskFailedError, match="row window"):
            q.launch("saxpy", 2.0, x, y, range=n, rows=(8000, 9000))
        # The whole range in 8 windows, a checkpoint after each.
        s.protect(1, y)
        last = q.launch_checkpointed("saxpy", 2.0, x, y, range=n, window_rows=1024, first_checkpoint=1)
        assert last is not None
        q.sync_from(y)
        q.finish()
        expected += 2.0 * x0
        np.testing.assert_array_equal(y.numpy(), expected)
        deadline = time.monotonic() + 20
        while s.checkpoints()["writing"] and time.monotonic() < deadline:
            time.sleep(0.01)
        assert s.checkpoints()["checkpoints"][-1]["checkpoint"] == 8
    with agora.Session(name="py-partial", socket=str(daemon.socket)) as s:
        y = s.buffer(n * 4)
        s.protect(1, y)
        assert s.recover()["checkpoint"] == 8
        np.testing.assert_array_equal(y.numpy(dtype=np.float32), expected)
        x = s.buffer_from(x0)
        q = s.queue("resumed")
        # Resumed after the last window: nothing is left to run.
        assert q.launch_checkpointed("saxpy", 2.0, x, y, range=n, window_rows=1024, first_checkpoint=1, resume_after=8) is None


def test_bad_checkpoint_arguments_raise_value_errors_naming_them(fresh_daemon):
    """D10 of the checkpoint audit: checkpoint(0) raised TaskFailedError ("task failed: ...")
    though nothing was issued, and negative ids and levels a bare OverflowError."""
    daemon = fresh_daemon()
    with agora.Session(name="py-bad-args", socket=str(daemon.socket)) as s:
        q = s.queue("main")
        b = s.buffer(64)
        s.protect(1, b)
        with pytest.raises(ValueError, match=r"checkpoint id 0 is out of range \(1 to .*ids start at 1"):
            q.checkpoint(0)
        with pytest.raises(ValueError, match=r"checkpoint id -5 is out of range"):
            q.checkpoint(-5)
        with pytest.raises(ValueError, match=r"checkpoint level -1 is out of range \(1 to 4\)"):
            q.checkpoint(1, -1)
        with pytest.raises(ValueError, match=r"protected id -1 is out of range \(0 to 4294967295\)"):
            s.protect(-1, b)
        q.checkpoint(1)
        q.finish()
