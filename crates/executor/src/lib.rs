//! Executors: tenant programs run outside the daemon's address space, one sandboxed process
//! per session (DESIGN.md §3, "executors"; §5).
//!
//! A tenant may submit code at run time — OpenCL C source, or a shared object with C-ABI
//! kernels — that the daemon must never run itself. Each session that builds programs gets an
//! executor: a child process of the daemon (the hidden `agora executor` subcommand) that maps
//! only that tenant's segment, runs as the tenant's user when the daemon is root, and confines
//! itself before touching tenant code. The daemon treats everything it says as untrusted.
//!
//! * [`child`] — the executor process: sandbox, builds, launches;
//! * [`supervisor`] — the daemon's side: start, deadlines, kill, reap, restart with the
//!   programs replayed, stop at the end of the session;
//! * [`wire`] — the messages between them and their bounded, chunked framing over a
//!   `SOCK_SEQPACKET` socketpair.
//!
//! Must not: know about sessions, queues, scheduling or the daemon's kernel ids; the daemon's
//! `programs` module maps its sessions onto executors.

pub mod child;
pub mod supervisor;
pub mod wire;

pub use child::opencl::BUILD_OPTIONS;
pub use supervisor::{Build, ExecError, Executor, ExecutorSpec, Killer};
