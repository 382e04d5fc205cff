//! The messages between the daemon's supervisor and an executor, and how they travel.
//!
//! The two ends share a `SOCK_SEQPACKET` socketpair. A message is postcard-encoded and sent as
//! one or more records of at most [`RECORD`] bytes: a flag byte (`1`: last record of the
//! message, `0`: more follow) and up to [`CHUNK`] bytes of the encoding. Records keep their
//! boundaries on a seqpacket socket, so a reader never needs to resynchronise; a message is
//! chunked only because one record must fit in the socket's send buffer (about 200 KiB by
//! default), while a build request may carry a program of up to
//! [`agora_protocol::control::MAX_PROGRAM_BYTES`] and a cached binary.
//!
//! Every reader bounds what it accepts: [`MAX_TO_CHILD`] in the executor, [`MAX_FROM_CHILD`]
//! in the daemon, where an executor's replies are untrusted input (the executor runs tenant
//! code). The daemon's reads and writes also have deadlines, so a stuck executor cannot stall
//! the thread that talks to it.
//!
//! Owns the message types and the framing; no policy.

use std::os::fd::AsFd;
use std::time::Instant;

use agora_protocol::ParamSpec;
use serde::{Deserialize, Serialize};

/// Version of this protocol; an executor announces it in [`FromChild::Ready`], and the daemon
/// refuses an executor that speaks another (an `agora` binary of another build).
/// 2: [`ToChild::Unload`]; program numbers only grow (an unloaded one leaves a gap).
pub const PROTOCOL: u32 = 2;

/// Most bytes of encoding per record.
pub const CHUNK: usize = 32 * 1024;

/// Most bytes of one record: the flag byte and a chunk.
pub const RECORD: usize = CHUNK + 1;

/// Most bytes of one message to an executor (a program, its manifest's symbols, a binary).
pub const MAX_TO_CHILD: usize = 16 << 20;

/// Most bytes of one message from an executor (a build's kernels, log and binary).
pub const MAX_FROM_CHILD: usize = MAX_BINARY + MAX_LOG + (1 << 20);

/// Largest program binary an executor may return (larger ones are not cached).
pub const MAX_BINARY: usize = 12 << 20;

/// Most bytes of a build log kept (longer logs are cut, saying so).
pub const MAX_LOG: usize = 64 << 10;

/// Most kernels one program may define.
pub const MAX_KERNELS: usize = 64;

/// A program's code, as the executor builds it.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub enum Code {
    /// OpenCL C source, built with the executor's own OpenCL context; `binary`, when given, is
    /// a binary of the same source built earlier for the same device (from the daemon's
    /// program cache): the executor tries it first and builds from source when it fails.
    OpenCl {
        /// The source.
        source: String,
        /// A binary of it, to try first.
        binary: Option<Vec<u8>>,
    },
    /// A shared object with C-ABI kernels (`agora_kernel.h`): the executor loads it and
    /// resolves `symbols`, in order.
    Library {
        /// The shared object's bytes.
        bytes: Vec<u8>,
        /// The functions to resolve (one per kernel).
        symbols: Vec<String>,
    },
}

/// One argument of a launch, as the executor sees it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum Arg {
    /// A buffer: `len` bytes at `offset` from the start of the session's segment.
    Buffer {
        /// Offset in the segment.
        offset: u64,
        /// Length in bytes.
        len: u64,
    },
    /// A scalar's bits (32-bit scalars in the low half).
    Scalar(u64),
}

/// A message from the daemon to an executor.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub enum ToChild {
    /// Build program number `program` (programs are numbered from 0 in build order; a number
    /// is never used again, so after unloads the numbers have gaps).
    Build {
        /// Its number: larger than every number built before.
        program: u32,
        /// Its code.
        code: Code,
    },
    /// Run rows `rows[0]..rows[1]` of kernel `kernel` of program `program` over `range`.
    Run {
        /// The program's number.
        program: u32,
        /// The kernel's index in the program's [`FromChild::Built`] list.
        kernel: u32,
        /// The launch's range (unused dimensions 1).
        range: [u64; 3],
        /// How many dimensions the launch has (1 to 3).
        dims: u8,
        /// The rows of dimension 0 to run.
        rows: [u64; 2],
        /// Arguments in signature order.
        args: Vec<Arg>,
    },
    /// Forget program `program` (its session released it and no launch of it is left): its
    /// code is unloaded. Answered with [`FromChild::Done`], also when there is no such program.
    Unload {
        /// The program's number.
        program: u32,
    },
    /// Exit now.
    Shutdown,
}

/// One kernel of a built program.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct BuiltKernel {
    /// Its name (the OpenCL function, or the C symbol).
    pub name: String,
    /// Its parameters, as the OpenCL compiler reports them; empty for a C library (its
    /// manifest declares them).
    pub params: Vec<ParamSpec>,
}

/// A message from an executor to the daemon. Untrusted: the daemon bounds and validates it.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub enum FromChild {
    /// Sent once, when the executor is ready for requests.
    Ready {
        /// [`PROTOCOL`].
        protocol: u32,
        /// The OpenCL device it builds for (`None`: no OpenCL device, OpenCL programs fail).
        device: Option<String>,
        /// What the sandbox enforces, one line each (for the daemon's log).
        sandbox: Vec<String>,
    },
    /// A build succeeded.
    Built {
        /// The program's kernels.
        kernels: Vec<BuiltKernel>,
        /// The compiler's log (warnings).
        log: String,
        /// The program's binary (OpenCL), for the daemon's program cache.
        binary: Option<Vec<u8>>,
        /// Whether the given binary was used (no compilation).
        from_binary: bool,
    },
    /// A build failed; the log says why.
    BuildFailed {
        /// The compiler's log, or the loader's reason.
        log: String,
    },
    /// A launch finished (or an unload did).
    Done,
    /// A C library's kernel returned `code`, not 0: the tenant's own failure report, which the
    /// tenant sees in its task's error (it cannot read the daemon's log).
    Returned {
        /// What the kernel returned.
        code: i32,
    },
    /// A launch failed without crashing the executor.
    Failed {
        /// The OpenCL error code, or -1.
        code: i32,
        /// What failed.
        message: String,
    },
}

/// Why a message could not be sent or received.
#[derive(Debug, thiserror::Error)]
pub enum WireError {
    /// The other end closed the socket (the process exited or was killed).
    #[error("the other end closed the connection")]
    Closed,
    /// The deadline passed.
    #[error("timed out")]
    TimedOut,
    /// A message longer than the reader accepts.
    #[error("a message of more than {0} bytes")]
    TooLarge(usize),
    /// Bytes that are not a message.
    #[error("malformed message: {0}")]
    Malformed(String),
    /// A system call failed.
    #[error("{0}")]
    Os(#[from] std::io::Error),
}

/// Encodes `message` and sends it, waiting until `deadline` (`None`: as long as it takes).
pub fn send<T: Serialize>(fd: impl AsFd, message: &T, deadline: Option<Instant>) -> Result<(), WireError> {
    let bytes = postcard::to_allocvec(message).map_err(|e| WireError::Malformed(e.to_string()))?;
    send_bytes(fd.as_fd(), &bytes, deadline)
}

/// Receives one message of at most `max` encoded bytes and decodes it, waiting until
/// `deadline` (`None`: as long as it takes).
pub fn recv<T: serde::de::DeserializeOwned>(
    fd: impl AsFd,
    max: usize,
    deadline: Option<Instant>,
) -> Result<T, WireError> {
    let bytes = recv_bytes(fd.as_fd(), max, deadline)?;
    postcard::from_bytes(&bytes).map_err(|e| WireError::Malformed(e.to_string()))
}

fn send_bytes(fd: std::os::fd::BorrowedFd<'_>, bytes: &[u8], deadline: Option<Instant>) -> Result<(), WireError> {
    let mut deadline = deadline.map(agora_wait::Deadline::at);
    let deadline = &mut deadline;
    let mut record = Vec::with_capacity(RECORD);
    let mut chunks = bytes.chunks(CHUNK).peekable();
    if chunks.peek().is_none() {
        return send_record(fd, &[1], deadline);
    }
    while let Some(chunk) = chunks.next() {
        record.clear();
        record.push(u8::from(chunks.peek().is_none()));
        record.extend_from_slice(chunk);
        send_record(fd, &record, deadline)?;
    }
    Ok(())
}

fn send_record(
    fd: std::os::fd::BorrowedFd<'_>,
    record: &[u8],
    deadline: &mut Option<agora_wait::Deadline>,
) -> Result<(), WireError> {
    use rustix::net::SendFlags;
    loop {
        wait_for(fd, rustix::event::PollFlags::OUT, deadline)?;
        match rustix::net::send(fd, record, SendFlags::DONTWAIT | SendFlags::NOSIGNAL) {
            Ok(_) => return Ok(()),
            Err(rustix::io::Errno::AGAIN | rustix::io::Errno::INTR) => continue,
            Err(rustix::io::Errno::PIPE | rustix::io::Errno::CONNRESET) => return Err(WireError::Closed),
            Err(e) => return Err(WireError::Os(e.into())),
        }
    }
}

fn recv_bytes(fd: std::os::fd::BorrowedFd<'_>, max: usize, deadline: Option<Instant>) -> Result<Vec<u8>, WireError> {
    use rustix::net::RecvFlags;
    let mut deadline = deadline.map(agora_wait::Deadline::at);
    let deadline = &mut deadline;
    let mut message = Vec::new();
    let mut record = vec![0u8; RECORD];
    loop {
        wait_for(fd, rustix::event::PollFlags::IN, deadline)?;
        let (len, full) = match rustix::net::recv(fd, &mut record[..], RecvFlags::DONTWAIT | RecvFlags::TRUNC) {
            Ok(n) => n,
            Err(rustix::io::Errno::AGAIN | rustix::io::Errno::INTR) => continue,
            Err(rustix::io::Errno::CONNRESET) => return Err(WireError::Closed),
            Err(e) => return Err(WireError::Os(e.into())),
        };
        if full == 0 {
            return Err(WireError::Closed);
        }
        if full > RECORD || len != full {
            return Err(WireError::Malformed(format!("a record of {full} bytes")));
        }
        let (flag, chunk) = (record[0], &record[1..len]);
        if message.len() + chunk.len() > max {
            return Err(WireError::TooLarge(max));
        }
        message.extend_from_slice(chunk);
        match flag {
            1 => return Ok(message),
            0 => continue,
            other => return Err(WireError::Malformed(format!("record flag {other}"))),
        }
    }
}

/// Waits until `fd` is ready for `flags` (or hung up), or `deadline` passes. Time this process
/// did not run (a paused VM, a stopped daemon) is left out ([`agora_wait::Deadline`]): the
/// executor was paused too, and a launch must not be taken for endless for it.
fn wait_for(
    fd: std::os::fd::BorrowedFd<'_>,
    flags: rustix::event::PollFlags,
    deadline: &mut Option<agora_wait::Deadline>,
) -> Result<(), WireError> {
    loop {
        let wait = match deadline {
            None => None,
            Some(deadline) => match deadline.next_wait() {
                None => return Err(WireError::TimedOut),
                Some(wait) => Some(wait),
            },
        };
        let timeout = wait.map(|wait| rustix::event::Timespec {
            tv_sec: wait.as_secs() as i64,
            tv_nsec: i64::from(wait.subsec_nanos()),
        });
        let mut fds = [rustix::event::PollFd::new(&fd, flags)];
        let began = Instant::now();
        let polled = rustix::event::poll(&mut fds, timeout.as_ref());
        if let (Some(deadline), Some(wait)) = (deadline.as_mut(), wait) {
            deadline.waited(began, wait);
        }
        match polled {
            Ok(0) => continue,
            // Ready, or hung up / in error: the send or receive says which.
            Ok(_) => return Ok(()),
            Err(rustix::io::Errno::INTR) => continue,
            Err(e) => return Err(WireError::Os(e.into())),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rustix::net::{AddressFamily, SocketFlags, SocketType};
    use std::time::Duration;

    fn pair() -> (std::os::fd::OwnedFd, std::os::fd::OwnedFd) {
        rustix::net::socketpair(AddressFamily::UNIX, SocketType::SEQPACKET, SocketFlags::CLOEXEC, None).unwrap()
    }

    #[test]
    fn large_messages_travel_in_records_and_come_back_whole() {
        let (a, b) = pair();
        let message = ToChild::Build {
            program: 3,
            code: Code::OpenCl {
                source: "x".repeat(300_000),
                binary: Some(vec![7u8; 100_000]),
            },
        };
        let sender = {
            let message = message.clone();
            std::thread::spawn(move || send(&a, &message, Some(Instant::now() + Duration::from_secs(5))).unwrap())
        };
        let back: ToChild = recv(&b, MAX_TO_CHILD, Some(Instant::now() + Duration::from_secs(5))).unwrap();
        sender.join().unwrap();
        assert_eq!(back, message);
    }

    #[test]
    fn readers_bound_sizes_and_time_and_see_a_closed_peer() {
        let (a, b) = pair();
        let big = FromChild::BuildFailed { log: "y".repeat(5000) };
        send(&a, &big, None).unwrap();
        assert!(matches!(
            recv::<FromChild>(&b, 1000, Some(Instant::now() + Duration::from_secs(1))),
            Err(WireError::TooLarge(1000))
        ));
        let started = Instant::now();
        assert!(matches!(
            recv::<FromChild>(&b, 1000, Some(Instant::now() + Duration::from_millis(50))),
            Err(WireError::TimedOut)
        ));
        assert!(started.elapsed() < Duration::from_secs(1));
        rustix::net::send(&a, &[1, 0xff, 0xff, 0xff], rustix::net::SendFlags::empty()).unwrap();
        assert!(matches!(
            recv::<FromChild>(&b, 1000, None),
            Err(WireError::Malformed(_))
        ));
        drop(a);
        assert!(matches!(recv::<FromChild>(&b, 1000, None), Err(WireError::Closed)));
    }
}
