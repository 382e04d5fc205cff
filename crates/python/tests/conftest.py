"""Fixtures: a real Agora daemon (the release binary) on a private socket, started per test module."""

import os
import pathlib
import subprocess
import time

import pytest

REPO = pathlib.Path(__file__).resolve().parents[3]

# Side of the long task: an sgemm of 768² takes a few hundred milliseconds on a CPU lane.
LONG_N = 768


def long_sgemm(session):
    """Operands of a long task: ``(launch, c)``, where ``launch(queue)`` issues an sgemm of
    ``LONG_N``² with all-ones inputs, and every element of ``c`` becomes ``LONG_N`` once read
    back."""
    import numpy as np

    n = LONG_N
    a = session.buffer_from(np.ones((n, n), np.float32))
    c = session.buffer(n * n * 4)

    def launch(queue):
        return queue.launch("sgemm", n, n, n, 1.0, a, a, 0.0, c, range=(n, n))

    return launch, c


def agora_binary() -> pathlib.Path:
    """The `agora` CLI: $AGORA_BIN, else the workspace's release build."""
    path = pathlib.Path(os.environ.get("AGORA_BIN", REPO / "target" / "release" / "agora"))
    if not path.exists():
        pytest.fail(f"{path} not found: build it first (`cargo build --release`, or `make setup`)")
    return path


class Daemon:
    """One `agora serve` process; `stop()` or `kill()` it, or let the fixture do it."""

    def __init__(self, directory: pathlib.Path, *extra: str):
        self.socket = directory / "agora.sock"
        self.log = open(directory / "daemon.log", "w+")
        self.process = subprocess.Popen(
            [str(agora_binary()), "serve", "--socket", str(self.socket), *extra],
            env={**os.environ, "AGORA_STATE_DIR": str(directory / "state")},
            stdout=self.log,
            stderr=subprocess.STDOUT,
        )
        deadline = time.monotonic() + 30
        while not self.socket.exists():
            if self.process.poll() is not None or time.monotonic() > deadline:
                self.log.seek(0)
                pytest.fail(f"agora serve did not start:\n{self.log.read()}")
            time.sleep(0.02)

    def kill(self) -> None:
        self.process.kill()
        self.process.wait()

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(10)
            except subprocess.TimeoutExpired:
                self.kill()
        self.log.close()


@pytest.fixture(scope="module")
def daemon(tmp_path_factory):
    # Strict coherence: every device, the CPU included, computes on its own copies, so a test
    # that forgets a sync_to/sync_from fails wherever the daemon runs its tasks.
    d = Daemon(tmp_path_factory.mktemp("agora"), "--strict-coherence")
    old = os.environ.get("AGORA_SOCKET")
    os.environ["AGORA_SOCKET"] = str(d.socket)
    yield d
    d.stop()
    if old is None:
        os.environ.pop("AGORA_SOCKET", None)
    else:
        os.environ["AGORA_SOCKET"] = old


@pytest.fixture
def fresh_daemon(tmp_path):
    """A daemon of the test's own (for tests that kill it or need special settings)."""
    started = []

    def start(*extra: str) -> Daemon:
        d = Daemon(tmp_path, *extra)
        started.append(d)
        return d

    yield start
    for d in started:
        d.stop()


@pytest.fixture
def session(daemon):
    import agora

    with agora.Session(name="pytest") as s:
        yield s
