"""Python client for Agora: share every accelerator of a server with other processes.

Open a :class:`Session` with the local daemon, create :class:`Queue` objects (ordered streams of
tasks, bound to no device) and :class:`Buffer` objects (whose host copy lives in memory shared
with the daemon), and launch kernels by name. The daemon picks the device for each task as late
as possible.

>>> import numpy as np, agora
>>> with agora.Session() as session, session.queue("example") as queue:  # doctest: +SKIP
...     x = session.buffer_from(np.ones(1024, dtype=np.float32))
...     y = session.buffer_from(np.full(1024, 2.0, dtype=np.float32))
...     queue.sync_to(x); queue.sync_to(y)
...     queue.launch("saxpy", 3.0, x, y, range=1024)
...     queue.sync_from(y)
>>> y.numpy()[:3]  # doctest: +SKIP
array([5., 5., 5.], dtype=float32)

Errors are exceptions, one class per kind, all subclasses of :class:`AgoraError`; the errors a
task completes with derive from :class:`TaskFailedError`.
"""

from ._native import (  # noqa: F401  (re-exported API)
    __version__,
    Session,
    Queue,
    Buffer,
    Kernel,
    Program,
    Task,
    DagBuilder,
    Dag,
    AgoraError,
    ConnectError,
    DisconnectedError,
    ClosedError,
    ForkedChildError,
    EnvironmentSettingError,
    BufferInUseError,
    ProtocolError,
    TimeoutError,
    OutOfBoundsError,
    TaskFailedError,
    MalformedTaskError,
    UnknownQueueError,
    UnknownKernelError,
    ArgumentCountError,
    ArgumentTypeError,
    InvalidHandleError,
    BufferTooSmallError,
    InvalidScalarError,
    InvalidRangeError,
    AliasedBuffersError,
    NoDeviceError,
    KernelFaultError,
    KernelTimeoutError,
    ResourceExhaustedError,
    ExportError,
    DagError,
    AttachmentError,
    CheckpointError,
    DaemonRestartedError,
    ProgramBuildError,
    CancelledError,
    DeviceOutOfMemoryError,
    DeviceFailedError,
    DependencyFailedError,
    QuotaExceededError,
    VersionMismatchError,
    TooManyError,
    LimitReachedError,
    BadRequestError,
    NotPermittedError,
)

__all__ = [name for name in dir() if not name.startswith("_")] + ["__version__"]
