"""The Python examples run against a real daemon, and the Python guide shows the quick start verbatim."""

import json
import os
import subprocess
import sys
import textwrap

from conftest import REPO


def test_quickstart_runs(daemon):
    run = subprocess.run(
        [sys.executable, str(REPO / "examples" / "quickstart.py")],
        env={**os.environ, "AGORA_SOCKET": str(daemon.socket)},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip() == "saxpy verified"


def test_python_guide_shows_the_quickstart_verbatim():
    example = (REPO / "examples" / "quickstart.py").read_text()
    body = example[example.index("# docs example begins") : example.index("# docs example ends")]
    body = "\n".join(body.splitlines()[1:]).strip()
    guide = (REPO / "docs" / "getting-started-python.md").read_text()
    assert body in guide, "docs/getting-started-python.md must show examples/quickstart.py's example verbatim"


def test_python_guide_shows_real_error_messages(session):
    """The messages quoted under "How errors look" are the ones the package raises."""
    import agora
    import numpy as np

    guide = (REPO / "docs" / "getting-started-python.md").read_text()
    queue = session.queue()
    caught = []
    for attempt in (
        lambda: session.kernel("saxpi"),
        lambda: queue.launch("saxpy", 1.0, session.buffer_from(np.zeros(4)), session.buffer(16), range=4),
        lambda: queue.launch("saxpy", 1.0, session.buffer(16), session.buffer(16), range=100).wait(),
        # finish() reports the queue's failures since the previous finish(), waited for or not.
        queue.finish,
    ):
        try:
            attempt()
        except agora.AgoraError as error:
            caught.append(f"{type(error).__module__}.{type(error).__name__}: {error}")
    queue.close()
    assert len(caught) == 4
    for line in caught:
        assert line in guide, line


def test_inference_example_runs_beside_a_batch_job(daemon):
    """examples/inference.py: checks its first answer against NumPy itself and exits 1 if wrong."""
    run = subprocess.run(
        [sys.executable, str(REPO / "examples" / "inference.py"), "--requests", "20", "--batch-matrix", "256", "--json"],
        env={**os.environ, "AGORA_SOCKET": str(daemon.socket)},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stderr
    figures = json.loads(run.stdout)
    assert figures["requests"] == 20 and figures["batch_job"] is True
    assert figures["max_abs_error"] < 1e-3
    assert 0 < figures["latency_p50_ms"] <= figures["latency_p99_ms"] <= figures["latency_max_ms"]
    assert "batch job:" in run.stderr


def test_checkpoint_example_resumes_after_a_crash(fresh_daemon):
    daemon = fresh_daemon()
    env = {**os.environ, "AGORA_SOCKET": str(daemon.socket)}
    script = str(REPO / "examples" / "checkpoint.py")

    def run(*extra):
        return subprocess.run([sys.executable, script, "--iterations", "20", *extra], env=env, capture_output=True, text=True, timeout=120)

    crashed = run("--stop-after", "7")
    assert crashed.returncode == 3, crashed.stderr
    assert "starting at iteration 0" in crashed.stdout
    # The checkpoint of iteration 6 is written in the background: wait for it, then "restart".
    import time

    import agora

    with agora.Session(name="checkpoint-example", socket=str(daemon.socket)) as s:
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and [c["checkpoint"] for c in s.checkpoints()["checkpoints"]][-1:] != [6]:
            time.sleep(0.01)
    resumed = run()
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    assert "starting at iteration 6" in resumed.stdout
    assert "final value verified" in resumed.stdout


def test_checkpoint_guide_shows_the_example_verbatim():
    example = (REPO / "examples" / "checkpoint.py").read_text()
    body = example[example.index("# docs example begins") : example.index("# docs example ends")]
    body = "\n".join(body.splitlines()[1:]).rstrip()
    guide = (REPO / "docs" / "checkpoint.md").read_text()
    assert body in guide, "docs/checkpoint.md must show examples/checkpoint.py's example verbatim"


def test_insitu_example_attaches_the_simulations_snapshots(daemon):
    """examples/insitu.py: two processes share snapshots through an export; it checks them."""
    run = subprocess.run(
        [sys.executable, str(REPO / "examples" / "insitu.py"), "--steps", "20", "--every", "4", "--size", "100000"],
        env={**os.environ, "AGORA_SOCKET": str(daemon.socket)},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 0, run.stdout + run.stderr
    assert run.stdout.strip() == "in situ verified"


def test_exports_guide_shows_the_insitu_example_verbatim():
    example = (REPO / "examples" / "insitu.py").read_text()
    body = example[example.index("# docs example begins") : example.index("# docs example ends")]
    body = textwrap.dedent("\n".join(body.splitlines()[1:])).strip()
    guide = (REPO / "docs" / "exports.md").read_text()
    assert body in guide, "docs/exports.md must show examples/insitu.py's example verbatim"


def test_the_asyncio_server_example_serves_verified_results(daemon):
    run = subprocess.run(
        [sys.executable, str(REPO / "examples" / "asyncio_server.py"), "--requests", "40", "--concurrency", "8", "--json"],
        env={**os.environ, "AGORA_SOCKET": str(daemon.socket)},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 0, run.stderr
    report = json.loads(run.stdout)
    assert report["verified"] and report["requests"] == 40 and report["concurrent_requests_per_s"] > 0
    for key in ("blocking_one_at_a_time", "awaited_one_at_a_time", "awaited_concurrently"):
        assert 0 < report[key]["p50_us"] <= report[key]["p99_us"], report
