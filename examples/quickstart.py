#!/usr/bin/env python3
"""Quick start: y <- 3x + y on a million elements, on whatever device the daemon picks.

Start a daemon (`agora serve`), then: `python3 examples/quickstart.py`. The code between the
markers is shown verbatim in docs/getting-started-python.md; a test checks that and runs it.
"""

# docs example begins
import numpy as np

import agora

with agora.Session() as session:  # $AGORA_SOCKET, else the default socket
    x = session.buffer_from(np.ones(1 << 20, np.float32))  # host copy in shared memory
    y = session.buffer_from(np.full(1 << 20, 2.0, np.float32))
    with session.queue("quickstart") as queue:  # leaving the block waits for the queue
        queue.sync_to(x)
        queue.sync_to(y)
        queue.launch("saxpy", 3.0, x, y, range=1 << 20)  # y <- 3x + y
        queue.sync_from(y)
    result = y.numpy()  # a view of the buffer, not a copy
    assert (result == 5.0).all()
    print("saxpy verified")
# docs example ends
