//! The client's error type.

use std::path::PathBuf;

use agora_protocol::control::ControlError;
use agora_protocol::TaskError;

/// Everything that can go wrong in a client call.
///
/// `Debug` prints the same message as `Display` (with `{:#?}`, the variant's name first), so
/// `fn main() -> Result<(), agora::Error>` shows what to do, not a struct dump.
#[derive(thiserror::Error)]
pub enum Error {
    /// No daemon answers on the socket.
    #[error("cannot reach the Agora daemon at {path}: {cause}; {}", connect_hint(cause))]
    Connect {
        /// Socket path tried.
        path: PathBuf,
        /// Why.
        cause: std::io::Error,
    },
    /// The daemon stopped or was killed; the session is gone.
    #[error("the Agora daemon went away (stopped or killed); this session is closed, open a new one once it is back")]
    Disconnected,
    /// The daemon runs on but ended this session itself: its Slurm job ended (the epilog ends
    /// every session of the job), or its ring was found corrupt. It is not resumed.
    #[error("the Agora daemon ended this session (its Slurm job ended, or it found the session's ring corrupt); open a new one if you may")]
    SessionEnded,
    /// This process could not map the session's shared memory: its address space is limited
    /// (`ulimit -v`) or memory is short. Nothing is left open.
    #[error("this process cannot map the session's shared memory ({bytes} bytes): {cause}; its address space is limited (`ulimit -v`, RLIMIT_AS, a container's or batch job's limit) or memory is short: ask for a smaller heap (AGORA_HEAP_BYTES=256M in the environment, SessionOptions::heap_bytes, Python agora.Session(heap_bytes=...), C AgoraSessionOptions.heap_bytes) or raise the limit")]
    MapSegment {
        /// The segment's size (rings and heap).
        bytes: u64,
        /// The operating system's error.
        cause: std::io::Error,
    },
    /// This program ended the session ([`Session::end`](crate::Session::end); Python's
    /// `session.close()`) while handles of it lived on.
    #[error("this session was ended by this program (Session::end, or Python's session.close()); open a new session to go on")]
    Ended,
    /// A task failed.
    #[error("task failed: {0}")]
    Task(#[from] TaskError),
    /// Tasks of a queue failed since its previous `finish` (reported by `Queue::finish`).
    #[error("{0}")]
    Tasks(TaskFailures),
    /// A control request failed.
    #[error("{0}")]
    Control(#[from] ControlError),
    /// Host-side access outside a buffer.
    #[error("{len} bytes at offset {offset} do not fit in a buffer of {capacity} bytes")]
    OutOfBounds {
        /// Offset of the access.
        offset: u64,
        /// Its length.
        len: u64,
        /// The buffer's length.
        capacity: u64,
    },
    /// A write to the host copy of a buffer attached read-only.
    #[error("the buffer is attached read-only: its host copy cannot be written (attach it writable if the export allows, or copy it into a buffer of your own)")]
    ReadOnly,
    /// The daemon answered something this client does not understand.
    #[error("protocol error: {0}; are the client and daemon the same Agora version?")]
    Protocol(String),
    /// The daemon did not answer a control call in time (it is overloaded or stuck). The
    /// session stays usable: a late answer is skipped by the next call.
    #[error("{}", timeout_message(request, *after))]
    Timeout {
        /// Which call (e.g. `status`, `buffer allocation`).
        request: String,
        /// The limit it ran into.
        after: std::time::Duration,
    },
    /// A call on a session (or its queues, buffers, tasks) made in a process forked from the one
    /// that opened it. The session's rings, control socket and bookkeeping belong to that
    /// process: a child that used them would corrupt the parent's session. The child must open
    /// its own session; its copies of the inherited objects can be dropped (they release
    /// nothing).
    #[error("this session was opened by process {owner_pid} before a fork(); a forked child must open its own session (multiprocessing: use the 'spawn' or 'forkserver' start method, or open the session in the worker)")]
    ForkedChild {
        /// The process that opened the session.
        owner_pid: u32,
    },
    /// A setting in the environment (`AGORA_HEAP_BYTES`, `AGORA_CONTROL_TIMEOUT`,
    /// `AGORA_RECONNECT_TIMEOUT`) has a value the client cannot use; the message names it and
    /// what it accepts. Nothing was asked of the daemon: it is refused rather than ignored, since
    /// a user who set it would otherwise get the default without knowing why.
    #[error("{message}")]
    Environment {
        /// The variable.
        variable: &'static str,
        /// What is wrong with its value and what it accepts.
        message: String,
    },
    /// A wait for room in the rings or for a daemon to come back was cut short by the
    /// interrupt check a binding installed (Python: a signal handler raised, e.g. Ctrl-C);
    /// nothing was issued. Only bindings see it.
    #[doc(hidden)]
    #[error("interrupted while waiting for room in the rings or for the daemon to come back; nothing was issued")]
    Interrupted,
}

impl std::fmt::Debug for Error {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        if f.alternate() {
            let kind = match self {
                Error::Connect { .. } => "Connect",
                Error::Disconnected => "Disconnected",
                Error::SessionEnded => "SessionEnded",
                Error::Ended => "Ended",
                Error::MapSegment { .. } => "MapSegment",
                Error::Task(_) => "Task",
                Error::Tasks(_) => "Tasks",
                Error::Control(_) => "Control",
                Error::OutOfBounds { .. } => "OutOfBounds",
                Error::ReadOnly => "ReadOnly",
                Error::Protocol(_) => "Protocol",
                Error::Timeout { .. } => "Timeout",
                Error::ForkedChild { .. } => "ForkedChild",
                Error::Environment { .. } => "Environment",
                Error::Interrupted => "Interrupted",
            };
            write!(f, "Error::{kind}: ")?;
        }
        std::fmt::Display::fmt(self, f)
    }
}

impl Error {
    /// The task error, if this is one (for [`Error::Tasks`], the earliest failed task's).
    pub fn task_error(&self) -> Option<&TaskError> {
        match self {
            Error::Task(e) => Some(e),
            Error::Tasks(failures) => failures.first().map(|(_, e)| e),
            _ => None,
        }
    }
}

/// The tasks of one queue that failed between two `finish` calls.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct TaskFailures {
    /// How many failed.
    pub count: u64,
    /// (task id, error) of each, in issue order; at most [`TaskFailures::KEPT`] of them (the
    /// earliest), `count` says how many there were in all.
    pub failures: Vec<(u64, TaskError)>,
}

impl TaskFailures {
    /// Most failures kept one by one (a queue that fails millions of tasks between two
    /// `finish` calls must not keep millions of errors).
    pub const KEPT: usize = 1024;

    pub(crate) fn push(&mut self, task: u64, error: TaskError) {
        self.count += 1;
        if self.failures.len() < Self::KEPT {
            // Completions of one queue arrive in issue order; keep the list sorted regardless.
            let at = self.failures.partition_point(|(id, _)| *id < task);
            self.failures.insert(at, (task, error));
        }
    }

    /// The earliest failed task and its error.
    pub fn first(&self) -> Option<&(u64, TaskError)> {
        self.failures.first()
    }
}

impl std::fmt::Display for TaskFailures {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        const SHOWN: usize = 4;
        let s = if self.count == 1 { "" } else { "s" };
        write!(
            f,
            "{} task{s} of this queue failed since the previous finish()",
            self.count
        )?;
        for (i, (task, error)) in self.failures.iter().take(SHOWN).enumerate() {
            write!(f, "{} task {task}: {error}", if i == 0 { ":" } else { ";" })?;
        }
        let more = self.count.saturating_sub(SHOWN.min(self.failures.len()) as u64);
        if more > 0 {
            write!(f, "; and {more} more")?;
        }
        Ok(())
    }
}

impl From<agora_transport::TransportError> for Error {
    fn from(e: agora_transport::TransportError) -> Self {
        match e {
            agora_transport::TransportError::Closed => Error::Disconnected,
            agora_transport::TransportError::Os { cause, .. }
                if matches!(
                    cause.kind(),
                    std::io::ErrorKind::BrokenPipe | std::io::ErrorKind::ConnectionReset
                ) =>
            {
                Error::Disconnected
            }
            other => Error::Protocol(other.to_string()),
        }
    }
}

/// What to do about a connection that failed with `cause`.
fn connect_hint(cause: &std::io::Error) -> &'static str {
    match cause.kind() {
        std::io::ErrorKind::PermissionDenied => {
            "the daemon there does not admit your user (its socket's permissions): ask its operator \
             to serve it with `agora serve --socket-access all` (or `group:NAME`, a group you are in), \
             or start one of your own with `agora serve` and point AGORA_SOCKET at it"
        }
        _ => "start one with `agora serve`, or point AGORA_SOCKET at a running one",
    }
}

/// [`Error::Timeout`]'s message: what the limit was and which setting sets it (a program build
/// waits at least the daemon's own compile limit plus a margin, whatever the control timeout).
fn timeout_message(request: &str, after: std::time::Duration) -> String {
    use agora_protocol::control::{BUILD_REPLY_MARGIN_SECONDS, PROGRAM_BUILD_SECONDS};
    let limit = if request == "program build" {
        format!(
            "a build waits the daemon's {PROGRAM_BUILD_SECONDS} s compile limit plus {BUILD_REPLY_MARGIN_SECONDS} s, \
             or $AGORA_CONTROL_TIMEOUT / SessionOptions::control_timeout when that is longer"
        )
    } else {
        "the limit is $AGORA_CONTROL_TIMEOUT, in seconds, or SessionOptions::control_timeout".to_string()
    };
    format!(
        "the Agora daemon did not answer the {request} within {:.1} s; it may be overloaded or stuck ({limit})",
        after.as_secs_f64()
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn debug_carries_the_message_and_its_hint() {
        // What `fn main() -> Result<(), agora::Error>` prints on a connect failure.
        let error = Error::Connect {
            path: "/run/agora.sock".into(),
            cause: std::io::Error::from(std::io::ErrorKind::NotFound),
        };
        let debug = format!("{error:?}");
        assert_eq!(debug, error.to_string());
        assert!(
            debug.contains("agora serve") && debug.contains("/run/agora.sock"),
            "{debug}"
        );
        assert!(format!("{error:#?}").starts_with("Error::Connect: cannot reach"));
        let tasks = Error::Tasks(TaskFailures {
            count: 1,
            failures: vec![(7, TaskError::KernelFault)],
        });
        assert!(format!("{tasks:?}").contains("task 7:"), "{tasks:?}");
    }

    #[test]
    fn a_timeout_names_the_variable_and_the_option_that_set_its_limit() {
        // The Python binding puts its own spelling in place of this name: keep them in step.
        let error = Error::Timeout {
            request: "status".into(),
            after: std::time::Duration::from_millis(500),
        };
        assert!(error.to_string().contains("SessionOptions::control_timeout"), "{error}");
        // An operator running `agora status` can set only the environment variable.
        assert!(error.to_string().contains("$AGORA_CONTROL_TIMEOUT"), "{error}");
        // A build's wait is the daemon's compile limit and margin, not the control timeout.
        let build = Error::Timeout {
            request: "program build".into(),
            after: std::time::Duration::from_secs(90),
        };
        let message = build.to_string();
        assert!(
            message.contains("within 90.0 s") && message.contains("60 s compile limit plus 30 s"),
            "{message}"
        );
    }
}
