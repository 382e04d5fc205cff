"""Type stubs of agora._native (the Rust extension); import from `agora`, not from here."""

import builtins
from os import PathLike
from types import TracebackType
from typing import Any, Callable, Generator, Literal, Optional, Sequence, Tuple, Union

import numpy as np
import numpy.typing as npt

__version__: str

QueueClass = Literal["batch", "latency"]
DeviceKind = Literal["cpu", "opencl", "cuda", "sim"]
Range = Union[int, Tuple[int], Tuple[int, int], Tuple[int, int, int]]
Scalar = Union[int, float, np.integer[Any], np.floating[Any]]

class Session:
    """A connection to the Agora daemon."""

    def __init__(
        self,
        socket: Optional[Union[str, PathLike[str]]] = None,
        name: Optional[str] = None,
        heap_bytes: Optional[int] = None,
        control_timeout: Optional[float] = None,
        reconnect_timeout: Optional[float] = None,
    ) -> None:
        """Connects to `socket` (default: $AGORA_SOCKET, else the per-user default path).
        `control_timeout`: seconds a control call may wait for the daemon (default
        $AGORA_CONTROL_TIMEOUT, else 30) before it raises TimeoutError.
        `reconnect_timeout`: seconds the session keeps trying to reach a restarted daemon
        (default $AGORA_RECONNECT_TIMEOUT, else 30; 0 = off). Tasks in flight when the daemon
        died raise DaemonRestartedError (those it never took, behind only completed ones, are
        issued again: `tasks_reissued`); buffers, queues, kernels and programs carry on.

        Raises ConnectError when no daemon answers."""
    @property
    def id(self) -> int: ...
    @property
    def resumes(self) -> int:
        """How many times the session resumed on a restarted daemon."""
    @property
    def tasks_reissued(self) -> int:
        """Tasks issued again on a restarted daemon because the one that died never took them
        (they complete as if nothing happened instead of raising DaemonRestartedError)."""
    def queue(
        self,
        name: str = "",
        queue_class: QueueClass = "batch",
        device: Optional[DeviceKind] = None,
        sla_ms: Optional[float] = None,
    ) -> Queue:
        """Creates a queue; `device` is a preference the daemon may ignore; `sla_ms` is a latency queue's response-time target."""
    def buffer(self, nbytes: int) -> Buffer:
        """Allocates a zeroed buffer of `nbytes` bytes (QuotaExceededError past the quota)."""
    def buffer_from(self, array: npt.ArrayLike) -> Buffer:
        """Allocates a buffer holding a copy of `array`; `numpy()` then views it with the same dtype and shape."""
    def kernel(self, name: str) -> Kernel:
        """Looks a kernel up (UnknownKernelError, with suggestions, when there is none)."""
    def kernels(self) -> list[dict[str, Any]]:
        """Every kernel's signature: {"name", "doc", "params": [(name, kind), ...]}."""
    def program(
        self,
        source: Optional[str] = None,
        *,
        language: str = "opencl",
        library: Optional[Union[bytes, str, PathLike[str]]] = None,
        manifest: Optional[str] = None,
    ) -> Program:
        """Builds your own code into a program whose kernels are launched like the built-in ones:
        OpenCL C source (`language="opencl"`, manifest optional); CUDA C source with
        `extern "C" __global__` kernels (`language="cuda"`) or PTX text (`language="ptx"`),
        both with a manifest (required; ValueError without one), run only on NVIDIA GPUs,
        fenced into this session's memory, one thread per work item (without such a GPU a
        launch raises NoDeviceError); or a C shared object (`library=`, with a manifest) run in
        this session's sandbox. An unknown language raises ValueError; ProgramBuildError
        carries the compiler's log, or the line the fence refused and why."""
    def status(self) -> dict[str, Any]:
        """The daemon's status summary: counters, devices, lanes, and the busiest sessions
        (`live_sessions` counts them all) with their busiest queues (`queue_count` counts them all)."""
    def session_status(self, session_id: Optional[int] = None) -> dict[str, Any]:
        """One live session (default: this one) with all its queues."""
    def shared_buffer(
        self,
        nbytes: Optional[int] = None,
        *,
        dtype: Optional[npt.DTypeLike] = None,
        shape: Optional[Sequence[int]] = None,
    ) -> Buffer:
        """Allocates a zeroed exportable buffer (its memory is a region of its own that
        `export()` can hand to other processes); `nbytes`, or `dtype` and `shape`."""
    def export(
        self,
        buffer: Buffer,
        name: str,
        *,
        uids: Sequence[int] = (),
        gids: Sequence[int] = (),
        writable: bool = False,
    ) -> None:
        """Publishes an exportable buffer under `name` for this user and the `uids`/`gids`
        given (XEMEM's make); ExportError says why when refused."""
    def revoke(self, name: str) -> list[int]:
        """Withdraws the export `name`; returns the sessions that were attached (their tasks on
        it raise AttachmentError from now on; their views stay readable)."""
    def attach(
        self,
        name: str,
        *,
        writable: bool = False,
        dtype: Optional[npt.DTypeLike] = None,
        shape: Optional[Sequence[int]] = None,
    ) -> Buffer:
        """Attaches the export `name`: the exporter's memory, no copy; `numpy()` views it in
        place (read-only unless `writable`)."""
    def exports(self) -> list[dict[str, Any]]:
        """The exports this user may see: name, session, client, uid, len, writable, readers,
        attachers, attaches."""
    def protect(self, id: int, buffer: Buffer) -> None:
        """Protects `buffer` under `id` for checkpoints (FTI's protect); the checkpoints belong
        to the application named by the session's `name` and the user."""
    def recover(self) -> dict[str, Any]:
        """Restores every protected buffer from the application's newest intact checkpoint:
        `checkpoint`, `level`, `restored` (ids), `skipped` (damaged newer ones). Raises
        CheckpointError when there is none."""
    def checkpoints(self) -> dict[str, Any]:
        """The application's complete checkpoints (oldest first) and its last writes."""
    def dag(self, name: str, period: float) -> DagBuilder:
        """Starts a real-time DAG released every `period` seconds (its end-to-end deadline is
        the period unless `deadline()` says otherwise); add nodes and edges, then `declare()`."""
    def close(self) -> None:
        """Closes the session: the daemon reclaims it at once (heap quota, queues, device memory),
        every later call on it and on its queues, buffers and tasks raises ClosedError, and NumPy
        views made before stay readable (mapped until they are garbage collected)."""
    def __enter__(self) -> Session: ...
    def __exit__(self, *exc: Any) -> bool: ...

class Queue:
    """An ordered stream of tasks, bound to no device."""

    def launch(
        self,
        kernel: Union[Kernel, str],
        *args: Union[Buffer, Scalar],
        range: Range,
        rows: Optional[tuple[int, int]] = None,
    ) -> Task:
        """Launches `kernel` over `range`; scalars take the types of the kernel's signature.
        `rows=(first, end)`: only those rows of the first dimension run (chunkable kernels)."""
    def launch_checkpointed(
        self,
        kernel: Union[Kernel, str],
        *args: Union[Buffer, Scalar],
        range: Range,
        window_rows: int,
        first_checkpoint: int,
        level: int = 1,
        resume_after: Optional[int] = None,
    ) -> Optional[Task]:
        """A long launch issued as row windows with a checkpoint after each (ids from
        `first_checkpoint`); `resume_after` = the recovered checkpoint runs only later windows."""
    def sync_to(self, buffer: Buffer) -> Task:
        """Makes the devices see the host copy (after writing it)."""
    def sync_from(self, buffer: Buffer) -> Task:
        """Makes the host copy current (read it after this task completes)."""
    def checkpoint(self, id: int, level: int = 1) -> Task:
        """Checkpoints the session's protected buffers after this queue's earlier tasks (FTI's
        checkpoint); level 1 local, 2 also the partner directory, 3 erasure coded, 4 also the
        shared file system. `id` must grow from one checkpoint to the next."""
    def snapshot(self) -> Optional[Task]:
        """FTI's snapshot: call it every iteration; once the daemon's checkpoint interval has
        passed since the last one (or the first protect), it issues a level-1 checkpoint."""
    def memset(self, buffer: Buffer, value: int = 0) -> Task: ...
    def copy(self, src: Buffer, dst: Buffer, src_offset: int = 0, dst_offset: int = 0, nbytes: int = 0) -> Task: ...
    def finish(self) -> None:
        """Waits for every issued task; raises when any task issued since the previous finish()
        failed: the exception has the class of the earliest failure, `count` (how many failed)
        and `failures` (`[(task_id, exception), ...]`). Ctrl-C interrupts the wait at once."""
    def close(self) -> None: ...
    def __enter__(self) -> Queue: ...
    def __exit__(
        self,
        exc_type: Optional[type[BaseException]],
        exc_value: Optional[BaseException],
        traceback: Optional[TracebackType],
    ) -> bool:
        """Finishes the queue (unless an exception is propagating) and releases it."""

class Buffer:
    """A buffer whose host copy lives in shared memory; supports the buffer protocol."""

    @property
    def nbytes(self) -> int: ...
    @property
    def views(self) -> int:
        """NumPy arrays and memoryviews currently viewing this buffer."""
    @property
    def writable(self) -> bool:
        """False only for a buffer attached read-only."""
    @property
    def shared(self) -> bool:
        """Whether its memory is exportable or attached (`shared_buffer`, `attach`)."""
    def __len__(self) -> int: ...
    def numpy(self, dtype: Optional[npt.DTypeLike] = None, shape: Optional[Sequence[int]] = None) -> npt.NDArray[Any]:
        """A zero-copy NumPy view of the host copy; it keeps the buffer alive. `dtype` defaults to
        the dtype the buffer was made from, also when only `shape` is given."""
    def write(self, array: npt.ArrayLike, offset: int = 0) -> None:
        """Copies `array`'s bytes into the host copy at byte `offset` (claiming it first); a buffer
        made by `buffer_from` takes only arrays of its dtype (ArgumentTypeError)."""
    def claim_host(self) -> None:
        """Before writing through a NumPy view over a kernel's results never read back: discards
        them, so no eviction writes them over what you write (`write()` claims by itself)."""
    def release(self) -> None:
        """Releases the buffer now; BufferInUseError while views exist."""
    def __buffer__(self, flags: int) -> memoryview: ...

class Kernel:
    """A kernel: of the daemon (session.kernel(name)) or of a program (program.name)."""

    @property
    def name(self) -> str: ...
    @property
    def doc(self) -> str: ...
    @property
    def params(self) -> list[Tuple[str, str]]: ...

class Program:
    """A program built from the session's own code; its kernels are attributes and items
    (a missing one raises AttributeError, KeyError as an item or from `kernel`).

    The session holds it while this object or one of its kernels lives; `del` of the last gives
    it back (its slot under `[programs] max_per_session`, which counts programs held at once, is
    free). The same source built again while held is this program (`cached` is True)."""

    @property
    def names(self) -> list[str]: ...
    @property
    def log(self) -> str: ...
    @property
    def cached(self) -> bool: ...
    def kernel(self, name: str) -> Kernel: ...
    def __getattr__(self, name: str) -> Kernel: ...
    def __getitem__(self, name: str) -> Kernel: ...
    def __contains__(self, name: object) -> bool: ...

class Task:
    """An issued task."""

    @property
    def id(self) -> int: ...
    def wait(self) -> None:
        """Blocks (GIL released) until the task completes; raises its error, every time. Ctrl-C
        interrupts the wait at once (the task keeps running)."""
    def done(self) -> bool: ...
    def __await__(self) -> Generator[Any, None, None]:
        """`await task` in a coroutine suspends it, not the event loop, until the task completes;
        raises the task's error if it failed. One thread per session waits for all the session's
        awaited tasks. Cancelling the coroutine leaves the task running."""
    def add_done_callback(self, callback: Callable[["Task"], Any]) -> None:
        """Calls `callback(task)` once the task completes, on the session's waiting thread (never
        the caller's, even when the task is already complete); inside, `task.wait()` returns or
        raises its outcome at once. Callbacks of one session run one after another; an
        exception in one is logged (logger `agora`) and the others still run. A callback pending
        when its session is closed runs then, and `task.wait()` inside raises `ClosedError`."""

class DagBuilder:
    """A real-time DAG being declared (`Session.dag`); the chaining methods return the builder."""

    def node(
        self,
        name: str,
        kernel: Union[Kernel, str],
        args: Sequence[Union[Buffer, Scalar]],
        range: Range,
    ) -> int:
        """Adds a node launching `kernel` with `args` over `range` (checked against the kernel's
        signature now); returns its index."""
    def wcet(self, node: int, seconds: float) -> DagBuilder:
        """Declares node `node`'s worst-case execution time, more than 0 seconds (else the daemon's model estimates it)."""
    def node_deadline(self, node: int, seconds: float) -> DagBuilder:
        """Fixes node `node`'s relative deadline."""
    def edge(self, a: int, b: int) -> DagBuilder:
        """Node `b` starts after node `a` finished, in each release."""
    def deadline(self, seconds: float) -> DagBuilder:
        """The end-to-end deadline of each release (default: the period)."""
    def sporadic(self) -> DagBuilder:
        """Released only by `Dag.release()`; the period is then the least time between releases."""
    def declare(self) -> Dag:
        """Sends the DAG for admission; DagError says why it does not fit (or that it has a cycle)."""
    def __len__(self) -> int: ...

class Dag:
    """An admitted real-time DAG; withdrawn by `withdraw()`, the end of a `with` block, or garbage collection."""

    @property
    def id(self) -> int: ...
    @property
    def admission(self) -> dict[str, Any]:
        """`dag`, `lanes`, `wcet_ns`, `wcet_source`, `utilisation`, `lane_utilisation`, `decided_by_bound`."""
    def release(self) -> int:
        """Releases one instance now (sporadic); returns its number. DagError when too soon or stopped."""
    def results(self) -> dict[str, Any]:
        """Releases finished since the previous call: `releases` (dicts: `release`, `response_s`,
        `response_ns`, `met`, `jitter_s`, `jitter_ns`, `handoff_s`, `handoff_ns`, `failed` (None
        or (node, message)),
        `overruns`), `dropped`, `released`, `stopped` (None or why it stopped)."""
    def wait_results(self, count: int, timeout_s: float = 10.0) -> list[dict[str, Any]]:
        """Collects finished releases until `count` arrived or `timeout_s` passed."""
    def withdraw(self) -> None:
        """Withdraws the DAG (its reservations are freed); twice does nothing."""
    def __enter__(self) -> Dag: ...
    def __exit__(
        self,
        exc_type: Optional[type[BaseException]],
        exc_value: Optional[BaseException],
        traceback: Optional[TracebackType],
    ) -> bool: ...

class AgoraError(Exception): ...
class ConnectError(AgoraError): ...
class DisconnectedError(AgoraError): ...
class ClosedError(AgoraError): ...
class ForkedChildError(AgoraError):
    """A session (or its queues, buffers, tasks) used in a process forked after it was
    opened: a forked child must open its own session (multiprocessing: the 'spawn' or
    'forkserver' start method, or a session opened in the worker). The parent's session is
    not disturbed, and the child may drop its copies of the inherited objects."""
class EnvironmentSettingError(AgoraError):
    """A setting in the environment (AGORA_HEAP_BYTES, AGORA_CONTROL_TIMEOUT,
    AGORA_RECONNECT_TIMEOUT) has a value the client cannot use; the message names it and
    what it accepts. Nothing was asked of the daemon."""
class BufferInUseError(AgoraError): ...
class ProtocolError(AgoraError): ...
class TimeoutError(AgoraError, builtins.TimeoutError):
    """The daemon did not answer in time; also a built-in TimeoutError."""
class OutOfBoundsError(AgoraError): ...
class UnknownKernelError(AgoraError): ...
class QuotaExceededError(AgoraError): ...
class VersionMismatchError(AgoraError): ...
class TooManyError(AgoraError): ...
class LimitReachedError(AgoraError): ...
class BadRequestError(AgoraError): ...
class NotPermittedError(AgoraError): ...
class TaskFailedError(AgoraError): ...
class MalformedTaskError(TaskFailedError): ...
class UnknownQueueError(TaskFailedError): ...
class ArgumentCountError(TaskFailedError): ...
class ArgumentTypeError(TaskFailedError): ...
class InvalidHandleError(TaskFailedError): ...
class BufferTooSmallError(TaskFailedError): ...
class InvalidScalarError(TaskFailedError): ...
class InvalidRangeError(TaskFailedError): ...
class AliasedBuffersError(TaskFailedError): ...
class NoDeviceError(TaskFailedError): ...
class KernelFaultError(TaskFailedError): ...
class KernelTimeoutError(TaskFailedError): ...
class ResourceExhaustedError(TaskFailedError): ...
class ExportError(AgoraError): ...
class DagError(AgoraError): ...
class AttachmentError(TaskFailedError): ...
class CheckpointError(AgoraError): ...
class DaemonRestartedError(TaskFailedError): ...
class ProgramBuildError(AgoraError): ...
class CancelledError(TaskFailedError): ...
class DeviceOutOfMemoryError(TaskFailedError): ...
class DeviceFailedError(TaskFailedError): ...
class DependencyFailedError(TaskFailedError):
    """A buffer the task reads should have been written by a task that failed."""
