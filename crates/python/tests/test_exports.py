"""Export and attach from Python (issue 15, XEMEM's model), across real processes: a producer
process exports a NumPy-shaped buffer, a consumer attaches it, sees the producer's writes in
place (no copy), computes on it, cannot write it, and is told when the export is revoked."""

import subprocess
import sys
import textwrap

import numpy as np
import pytest

import agora

PRODUCER = textwrap.dedent(
    """
    import sys, numpy as np, agora
    s = agora.Session(name="producer", socket=sys.argv[1])
    state = s.shared_buffer(dtype=np.float32, shape=(256, 256))
    view = state.numpy()
    view[:] = np.arange(256 * 256, dtype=np.float32).reshape(256, 256)
    s.export(state, "py/state")
    print("exported", flush=True)
    for line in sys.stdin:
        command = line.strip()
        if command == "bump":
            view += 1
            print("bumped", flush=True)
        elif command == "revoke":
            print("revoked", s.revoke("py/state"), flush=True)
        elif command == "quit":
            break
    """
)


def test_a_consumer_process_attaches_a_producers_buffer_zero_copy(daemon):
    producer = subprocess.Popen(
        [sys.executable, "-c", PRODUCER, str(daemon.socket)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert producer.stdout.readline().strip() == "exported"
        with agora.Session(name="consumer", socket=str(daemon.socket)) as s:
            listed = [e for e in s.exports() if e["name"] == "py/state"]
            assert listed and listed[0]["client"] == "producer" and not listed[0]["writable"]

            state = s.attach("py/state", dtype=np.float32, shape=(256, 256))
            assert state.shared and not state.writable
            view = state.numpy()
            assert view.shape == (256, 256) and view[255, 255] == 256 * 256 - 1
            assert not view.flags.writeable
            with pytest.raises(ValueError):
                view[0, 0] = 1.0
            with pytest.raises(PermissionError, match="read-only"):
                state.write(np.zeros(4, dtype=np.float32))

            # The producer writes in place; the consumer sees it with no call in between.
            producer.stdin.write("bump\n")
            producer.stdin.flush()
            assert producer.stdout.readline().strip() == "bumped"
            assert view[0, 0] == 1.0

            # A kernel reads the attached buffer; writing it is refused with the reason.
            q = s.queue("analytics")
            total = s.buffer_from(np.zeros(256 * 256, dtype=np.float32))
            q.launch("saxpy", 1.0, state, total, range=256 * 256)
            q.sync_from(total)
            q.finish()
            np.testing.assert_array_equal(total.numpy(), view.reshape(-1))
            q.launch("saxpy", 1.0, total, state, range=256 * 256)
            with pytest.raises(agora.AttachmentError, match="attached read-only"):
                q.finish()

            # Revoked: the consumer's tasks on it fail, its view stays readable.
            producer.stdin.write("revoke\n")
            producer.stdin.flush()
            assert producer.stdout.readline().startswith("revoked")
            q.launch("saxpy", 1.0, state, total, range=256 * 256)
            with pytest.raises(agora.AttachmentError, match="revoked"):
                q.finish()
            assert view[0, 0] == 1.0
            with pytest.raises(agora.ExportError, match="no export named 'py/state'"):
                s.attach("py/state")
    finally:
        if producer.poll() is None:
            producer.stdin.write("quit\n")
            producer.stdin.flush()
        producer.wait(timeout=10)


def test_export_refusals_raise_export_error(session):
    heap = session.buffer(64)
    with pytest.raises(agora.ExportError, match="shared_buffer"):
        session.export(heap, "from-the-heap")
    shared = session.shared_buffer(64)
    session.export(shared, "py/refusals", writable=True)
    with pytest.raises(agora.ExportError, match="is taken"):
        session.export(session.shared_buffer(64), "py/refusals")
    with pytest.raises(ValueError, match="nbytes"):
        session.shared_buffer()
    attached = session.attach("py/refusals", writable=True)
    attached.numpy()[:2] = [7, 9]
    assert list(shared.numpy()[:2]) == [7, 9]
    assert session.revoke("py/refusals") == [session.session_status()["id"]]
