//! The contract between Agora clients and the daemon.
//!
//! This crate owns everything both sides must agree on, byte for byte:
//!
//! * [`segment`]: the layout of the per-client shared-memory segment (header, rings, heap);
//! * [`ring`]: the single-producer/single-consumer index protocol of the submission and
//!   completion rings;
//! * [`descriptor`]: the fixed-size task descriptor a client writes into the submission ring and
//!   its decoding, which treats every byte as hostile;
//! * [`completion`]: the fixed-size completion record and the typed [`TaskError`] it carries;
//! * [`control`]: the messages of the control socket (hello, allocate, create queue, look up
//!   kernel, status);
//! * [`device`]: the kinds of device ([`DeviceKind`]) and their names;
//! * [`signature`]: kernel signatures (which arguments are buffers, how they are accessed);
//! * [`sync`]: the atomics of the header and rings (`std`'s, or loom's for the model tests).
//!
//! It must not do I/O (sockets, mapping, futexes live in `agora-transport`) and must not
//! allocate on the hot path: descriptor decoding and ring operations work on caller-owned memory.

pub mod completion;
pub mod control;
pub mod descriptor;
pub mod device;
pub mod ring;
pub mod segment;
pub mod signature;
pub mod sync;
pub mod testing;

pub use completion::{Completion, LaunchLimit, Resource, TaskError};
pub use descriptor::{ArgTag, Op, RawArg, TaskDescriptor, MAX_ARGS};
pub use device::DeviceKind;
pub use signature::{Access, KernelSignature, ParamKind, ParamSpec, ScalarType};

/// Version of the wire protocol; the hello exchange rejects a mismatch.
/// 2: `Request::Drain`, `TaskError::DeviceLost`/`DataLost`, drain, failure and migration fields
/// in the status; queue SLAs (`CreateQueue::sla_ms`), revocation fields in the status.
/// 3: `TaskError::DeviceLimit` (a launch beyond every capable device's limits).
/// 4: bounded replies: `Request::SessionStatus` / `Response::SessionDetails` (a session's queues,
/// paged), a summarised status (`live_sessions`, `queue_count`, `latency_queues`),
/// `ControlError::NameTooLong` / `UnknownSession`, `migrations` in `Response::Drained`.
///    also `TaskError::RangeMismatch` (code 26: a range the kernel's size rule fixes exactly),
/// `SessionStatus::unread_releases`.
/// 6: per-uid limits (issue 20): `ControlError::LimitReached`, `StatusReport::uids` /
/// `limit_refusals`.
/// 7: sessions survive a daemon restart (issue 20): `Request::Resume` / `ResumeMore`,
/// `Response::Resumed`, `ControlError::SegmentInUse`, `TaskError::DaemonRestarted` (code 30),
/// `segment::SESSION_ENDED` in `Header::daemon_closed`; `StatusReport::memory_waits` /
/// `allocation_retries` / `dispatcher_longest_iteration_ms` (issue 22).
/// 9: `Request::ClaimHost` / `Response::HostClaim` (a host write over unread device results).
/// 10: what was added to 9 in place, gathered under a version of its own because a client of
/// the newer build could not decode an older daemon's replies (postcard has no missing trailing
/// fields) and mismatched builds must fail at `Hello` with [`control::ControlError::VersionMismatch`],
/// not at their first checkpoint: `SegmentHeader::control_sent` (a hint in the header page's
/// spare room); `StatusReport::private`; `Response::JobStarted`'s and `JobEnded`'s `again` /
/// `not_recorded`; `Request::PowerSave` / `Response::PowerSaved`; `Op::ReleaseProgram`;
/// `Response::Protected`'s `unusable`; `TaskError::CheckpointRefused`'s `detail`;
/// `TaskError::KernelExited` (code 38) and `KernelOpenCl` (39); and new in 10,
/// `ControlError::ProgramKernelByName`.
pub const PROTOCOL_VERSION: u32 = 11;
