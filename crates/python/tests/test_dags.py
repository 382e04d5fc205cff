"""Real-time DAGs from Python (issue 16): a sporadic `fill(1, x)` -> `saxpy(2, x, y)` pipeline
admitted on the daemon's deadline lanes, released on demand and reported release by release;
declarations and releases the daemon refuses raise DagError with the reason."""

import time

import numpy as np
import pytest

import agora

N = 4096
PERIOD = 0.02


def pipeline(session, x, y, period=PERIOD):
    """`fill(1, x)` then `saxpy(2, x, y)`: each release adds 2 to every element of `y`."""
    builder = session.dag("pipeline", period)
    a = builder.node("fill", session.kernel("fill"), [1.0, x], N)
    b = builder.node("saxpy", "saxpy", [2.0, x, y], N)
    builder.edge(a, b).wcet(a, 0.002).wcet(b, 0.002)
    return builder


@pytest.fixture
def dag_session(fresh_daemon):
    # CPU lanes compute on the buffers' host copies (no strict coherence): a release's writes
    # are visible once its result arrived.
    daemon = fresh_daemon("--no-opencl", "--cpu-lanes", "2")
    with agora.Session(name="pytest-dags", socket=str(daemon.socket)) as s:
        yield s


def test_a_sporadic_dag_runs_its_nodes_in_order_once_per_release(dag_session):
    s = dag_session
    x = s.buffer(N * 4)
    y = s.buffer_from(np.zeros(N, dtype=np.float32))
    builder = pipeline(s, x, y).sporadic()
    assert len(builder) == 2
    with builder.declare() as dag:
        assert isinstance(dag.id, int)
        admission = dag.admission
        assert len(admission["lanes"]) == 2, admission
        assert all(lane.startswith("cpu0/lane") for lane in admission["lanes"]), admission
        assert admission["wcet_source"] == ["declared", "declared"]
        assert 0.19 < admission["utilisation"] < 0.3, admission

        releases = []
        for expected in range(3):
            assert dag.release() == expected
            releases += dag.wait_results(1, timeout_s=5)
            # The period is the least time between releases: wait it out before the next.
            time.sleep(PERIOD + 0.005)
        assert [r["release"] for r in releases] == [0, 1, 2], releases
        for r in releases:
            assert r["met"] and r["failed"] is None, r
            assert 0 < r["response_s"] < PERIOD, r
            assert r["overruns"] == [] and r["handoff_s"] >= r["jitter_s"] >= 0, r
        # saxpy ran once per release, after fill: y = 2 x 3.
        np.testing.assert_array_equal(y.numpy(np.float32), np.full(N, 6.0, dtype=np.float32))

        results = dag.results()
        assert results["released"] == 3 and results["stopped"] is None, results
        assert results["releases"] == [] and results["dropped"] == 0, results
    # The `with` block withdrew it: a second withdraw does nothing, a release is refused.
    dag.withdraw()
    with pytest.raises(agora.ClosedError):
        dag.release()


def test_a_cycle_is_refused_with_the_reason(dag_session):
    s = dag_session
    x, y = s.buffer(N * 4), s.buffer(N * 4)
    builder = pipeline(s, x, y)
    builder.edge(1, 0)
    with pytest.raises(agora.DagError, match="cycle"):
        builder.declare()
    # Mistakes the builder sees itself raise at once.
    with pytest.raises(IndexError):
        builder.wcet(5, 0.001)
    with pytest.raises(ValueError, match="more than 0 seconds"):
        builder.wcet(0, 0.0)
    with pytest.raises(agora.ArgumentCountError):
        builder.node("short", "saxpy", [2.0, x], N)
    with pytest.raises(ValueError, match="seconds"):
        s.dag("negative", -1.0)


def test_a_release_sooner_than_the_period_is_refused(dag_session):
    s = dag_session
    x, y = s.buffer(N * 4), s.buffer(N * 4)
    dag = pipeline(s, x, y).sporadic().declare()
    assert dag.release() == 0
    with pytest.raises(agora.DagError, match="least time between releases"):
        dag.release()
    assert len(dag.wait_results(1, timeout_s=5)) == 1
    dag.withdraw()
