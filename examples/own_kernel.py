#!/usr/bin/env python3
"""Your own kernel: OpenCL C source built by the daemon and run in this session's sandbox.

Start a daemon (`agora serve`), then: `python3 examples/own_kernel.py`. The code between the
markers is shown verbatim in docs/write-your-own-kernel.md; a test checks that and runs it.
"""

# docs example begins
import numpy as np

import agora

SOURCE = """
__kernel void blur(__global const float *image, __global float *out, const int width) {
    const int x = get_global_id(0), y = get_global_id(1), height = get_global_size(0);
    if (x == 0 || y == 0 || x == height - 1 || y == width - 1) { out[x * width + y] = image[x * width + y]; return; }
    out[x * width + y] = 0.2f * (image[x * width + y] + image[(x - 1) * width + y] + image[(x + 1) * width + y]
                                 + image[x * width + y - 1] + image[x * width + y + 1]);
}
"""

with agora.Session() as session:
    program = session.program(SOURCE)  # compiled by the daemon, runs in this session's sandbox
    print(program.blur)  # the signature the compiler reports: buffers, their access, scalars
    image = np.random.default_rng(1).random((256, 512), dtype=np.float32)
    src = session.buffer_from(image)
    dst = session.buffer_from(np.zeros_like(image))
    with session.queue("own kernel") as queue:
        queue.sync_to(src)
        queue.launch(program.blur, src, dst, 512, range=(256, 512))  # like a built-in kernel
        queue.sync_from(dst)
    expected = image.copy()
    expected[1:-1, 1:-1] = 0.2 * (image[1:-1, 1:-1] + image[:-2, 1:-1] + image[2:, 1:-1]
                                  + image[1:-1, :-2] + image[1:-1, 2:])
    assert np.allclose(dst.numpy(), expected, atol=1e-5)
    print("blur verified")

    try:
        session.program("__kernel void broken(__global float *x) { x[0] = undefined_name; }")
    except agora.ProgramBuildError as error:  # the compiler's log is in the message
        print("build error reported:", "undefined_name" in str(error))
# docs example ends
