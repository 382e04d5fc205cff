"""Your own kernels from Python (issue #13): OpenCL C source and a C shared object built into
programs that run in the session's sandbox, launched like built-in kernels with NumPy arrays; a
build error carries the compiler's log; a crashing kernel fails its task, not the session."""

import os
import subprocess
import sys

import numpy as np
import pytest

import agora
from conftest import REPO

SAXPY = """
__kernel void saxpy(const float a, __global const float *x, __global float *y) {
    const size_t i = get_global_id(0);
    y[i] = a * x[i] + y[i];
}
__kernel void crash(__global float *x) {
    __global float *far = x + ((ulong)1 << 38);
    far[0] = 1.0f;
}
"""


@pytest.fixture
def plain(fresh_daemon):
    """A daemon without strict coherence: tenant programs compute on the session's host memory."""
    return fresh_daemon("--program-timeout", "5000")


def test_own_kernel_example_runs_and_the_guide_shows_it(plain):
    run = subprocess.run(
        [sys.executable, str(REPO / "examples" / "own_kernel.py")],
        env={**os.environ, "AGORA_SOCKET": str(plain.socket)},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 0, run.stderr
    assert "blur verified" in run.stdout and "build error reported: True" in run.stdout, run.stdout
    example = (REPO / "examples" / "own_kernel.py").read_text()
    body = example[example.index("# docs example begins") : example.index("# docs example ends")]
    body = "\n".join(body.splitlines()[1:]).strip()
    guide = (REPO / "docs" / "write-your-own-kernel.md").read_text()
    assert body in guide, "docs/write-your-own-kernel.md must show examples/own_kernel.py's example verbatim"


def test_an_opencl_program_runs_like_a_built_in_kernel(plain):
    with agora.Session(socket=str(plain.socket)) as session:
        program = session.program(SAXPY)
        assert sorted(program.names) == ["crash", "saxpy"]
        assert program.saxpy.params == [("a", "f32"), ("x", "read f32 buffer"), ("y", "read-write f32 buffer")]
        x = session.buffer_from(np.arange(1000, dtype=np.float32))
        y = session.buffer_from(np.ones(1000, dtype=np.float32))
        with session.queue("mine") as queue:
            queue.sync_to(x)
            queue.sync_to(y)
            queue.launch(program["saxpy"], 2.0, x, y, range=1000)
            queue.sync_from(y)
        assert np.array_equal(y.numpy(), 2.0 * np.arange(1000, dtype=np.float32) + 1.0)
        with pytest.raises(AttributeError, match="saxpy"):
            program.nope
        # A mapping's missing key is a KeyError (audit K-D10: it was AttributeError).
        with pytest.raises(KeyError, match="no kernel 'nope'; it has: "):
            program["nope"]
        with pytest.raises(KeyError):
            program.kernel("nope")
        assert "saxpy" in program and "nope" not in program
        # A program's kernel by name alone: "crash" is installed nowhere but the program has
        # it, and the error says how to reach it (it read "unknown kernel 'crash'").
        with pytest.raises(agora.UnknownKernelError, match=r"launch it through its program \(Python program.crash"):
            session.kernel("crash")
        with session.queue("by name") as queue:
            with pytest.raises(agora.UnknownKernelError, match="one of this session's programs defines one"):
                queue.launch("crash", x, range=1)
        # A scalar mistake names the kernel and reads "an f32" (it read "a F32").
        with session.queue("mistakes") as queue:
            with pytest.raises(agora.ArgumentTypeError, match=r"argument 0 \('a'\) of saxpy is an f32 scalar; got a Buffer"):
                queue.launch(program["saxpy"], x, x, y, range=1000)


def test_a_program_kernel_of_another_session_is_refused_and_a_built_in_one_is_not(plain):
    socket = str(plain.socket)
    with agora.Session(socket=socket) as first, agora.Session(socket=socket) as second:
        # Both sessions' first program kernels have the same id.
        sevens = first.program("__kernel void seven(__global float *x) { x[get_global_id(0)] = 7.0f; }")
        second.program("__kernel void eight(__global float *x) { x[get_global_id(0)] = 8.0f; }")
        b = second.buffer_from(np.zeros(4, np.float32))
        x = second.buffer_from(np.ones(4, np.float32))
        with second.queue("q") as queue:
            queue.sync_to(b)
            queue.sync_to(x)
            with pytest.raises(agora.InvalidHandleError, match="belongs to a program built by another session"):
                queue.launch(sevens.seven, b, range=4)
            # A built-in kernel's id is the daemon's, the same in every session.
            queue.launch(first.kernel("saxpy"), 1.0, x, b, range=4)
            queue.sync_from(b)
        np.testing.assert_array_equal(b.numpy(), np.ones(4, np.float32))


def test_a_build_error_carries_the_compilers_log(plain):
    with agora.Session(socket=str(plain.socket)) as session:
        with pytest.raises(agora.ProgramBuildError) as error:
            session.program("__kernel void k(__global float *x) { x[0] = not_declared; }")
        assert "not_declared" in str(error.value)


def test_local_arrays_larger_than_the_device_fail_the_build_not_the_launch(plain):
    # 256 MiB of __local floats: PoCL asserted at the first launch and the task read as a
    # crash of the kernel's own making.
    source = """
__kernel void greedy(__global float *x) {
    __local float t[67108864];
    t[get_local_id(0)] = x[get_global_id(0)];
    barrier(CLK_LOCAL_MEM_FENCE);
    x[get_global_id(0)] = t[0];
}
"""
    with agora.Session(socket=str(plain.socket)) as s:
        with pytest.raises(agora.ProgramBuildError, match="__local memory takes 268435456 bytes"):
            s.program(source)


def test_a_c_library_program_computes(plain, tmp_path):
    source = tmp_path / "scale.c"
    source.write_text(
        "#include <agora_kernel.h>\n"
        "AGORA_KERNEL int scale(const AgoraKernelArgs *a, uint64_t b, uint64_t e) {\n"
        "  float *y = (float *)a->args[0].data;\n"
        "  for (uint64_t i = b; i < e; i++) y[i] *= agora_f32(a, 1);\n"
        "  return 0;\n"
        "}\n"
    )
    library = tmp_path / "libscale.so"
    subprocess.run(
        ["cc", "-O2", "-shared", "-fPIC", "-I", str(REPO / "crates" / "capi" / "include"), "-o", str(library), str(source)],
        check=True,
    )
    manifest = '[kernels.scale]\nparams = ["y: f32 readwrite", "factor: f32"]\nsizes = { y = "range0" }\nchunkable = true\n'
    with agora.Session(socket=str(plain.socket)) as session:
        program = session.program(library=str(library), manifest=manifest)
        y = session.buffer_from(np.full(100, 3.0, dtype=np.float32))
        with session.queue("c") as queue:
            queue.sync_to(y)
            queue.launch(program.scale, y, 2.0, range=100)
            queue.sync_from(y)
        assert (y.numpy() == 6.0).all()
        # The manifest's size rule is checked before the kernel runs.
        queue = session.queue("too far")
        with pytest.raises(agora.BufferTooSmallError, match="needs 404 bytes, has 400"):
            queue.launch(program.scale, y, 2.0, range=101).wait()
        with pytest.raises(agora.BufferTooSmallError):
            queue.finish()
        queue.close()


def test_a_crashing_kernel_fails_its_task_and_the_session_goes_on(plain):
    with agora.Session(socket=str(plain.socket)) as session:
        program = session.program(SAXPY)
        x = session.buffer_from(np.zeros(16, dtype=np.float32))
        y = session.buffer_from(np.ones(16, dtype=np.float32))
        queue = session.queue("crash")
        with pytest.raises(agora.KernelFaultError, match="signal 11"):
            queue.launch(program.crash, x, range=1).wait()
        with pytest.raises(agora.KernelFaultError):
            queue.finish()
        # The crashed kernel wrote x: rewrite it before reading it again (else DependencyFailed).
        queue.sync_to(x)
        queue.launch(program.saxpy, 1.0, x, y, range=16).wait()  # a restarted executor
        queue.sync_from(y).wait()
        assert (y.numpy() == 1.0).all()
        queue.close()


SCALE_CUDA = """
extern "C" __global__ void scale(float *y, float factor) {
    y[blockIdx.x * blockDim.x + threadIdx.x] *= factor;
}
"""


@pytest.mark.parametrize("language", ["cuda", "ptx"])
def test_cuda_and_ptx_programs_need_a_manifest(daemon, language):
    # Refused by the client before anything reaches the daemon.
    with agora.Session(socket=str(daemon.socket)) as session:
        with pytest.raises(ValueError, match=f"'{language}' program needs a manifest"):
            session.program(SCALE_CUDA, language=language)


def test_an_unknown_program_language_is_refused(daemon):
    with agora.Session(socket=str(daemon.socket)) as session:
        with pytest.raises(ValueError, match=r"language 'fortran'.*'opencl'.*'cuda'.*'ptx'"):
            session.program("program x; end", language="fortran", manifest="[kernels.x]\nparams = []\n")


TENANT_DATA = REPO / "crates" / "test-support" / "data"


def test_a_ptx_program_is_checked_when_built_and_without_a_gpu_fails_with_no_device(daemon):
    # PTX needs no compiler in the daemon: it is checked (entries against the manifest, the
    # fence) when built; without a GPU the build log says so and a launch has no device.
    ptx = (TENANT_DATA / "tenant.ptx").read_text()
    manifest = (TENANT_DATA / "tenant-ptx.toml").read_text()
    with agora.Session(socket=str(daemon.socket)) as session:
        program = session.program(ptx, language="ptx", manifest=manifest)
        assert "no device of this daemon can run it" in program.log
        y = session.buffer_from(np.zeros(64, dtype=np.float32))
        queue = session.queue("ptx")
        with pytest.raises(agora.NoDeviceError):
            queue.launch(program.fill, y, 1.0, range=64).wait()
        # A manifest that does not match the entry is the build's error, not a launch's.
        wrong = manifest.replace('params = ["y: f32 write", "v: f32"]', 'params = ["y: f32 write"]')
        assert wrong != manifest
        with pytest.raises(agora.AgoraError, match="takes 2 parameters; the manifest declares 1"):
            session.program(ptx, language="ptx", manifest=wrong)
        queue.close()


def test_a_strict_coherence_daemon_refuses_a_program_saying_why(daemon):
    # The suite's shared daemon runs with --strict-coherence: tenant OpenCL C and C run on the
    # session's own memory, which no device computes on there. Before, the build succeeded and
    # every launch failed with NoDevice naming a raw kernel id.
    with agora.Session(socket=str(daemon.socket)) as session:
        with pytest.raises(agora.BadRequestError, match="strict coherence"):
            session.program(SAXPY)


def test_a_dropped_program_gives_its_slot_back(plain):
    """`del program` gives the program back (audit K-D1): a service that builds a kernel per
    request kept failing with TooManyError after 64 builds (the limit counted every build of the
    session's life); the same source built again while held is the same program, cached."""
    with agora.Session(socket=str(plain.socket)) as session:
        x = session.buffer_from(np.zeros(16, dtype=np.float32))
        for i in range(66):
            source = f"__kernel void k{i}(__global float *x) {{ x[get_global_id(0)] = {i}.0f; }}"
            program = session.program(source)
            with session.queue("per request") as queue:
                queue.launch(program[f"k{i}"], x, range=16)
                queue.sync_from(x)
            assert np.all(x.numpy() == float(i)), i
            again = session.program(source)
            assert again.cached and again.names == [f"k{i}"]
            del program, again
