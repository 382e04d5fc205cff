//! The client's error type.

use std::path::PathBuf;

use agora_protocol::control::ControlError;
use agora_protocol::TaskError;

/// Everything that can go wrong in a client call.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// No daemon answers on the socket.
    #[error("cannot reach the Agora daemon at {path}: {cause}; start one with `agora serve`, or point AGORA_SOCKET at a running one")]
    Connect {
        /// Socket path tried.
        path: PathBuf,
        /// Why.
        cause: std::io::Error,
    },
    /// The daemon stopped or was killed; the session is gone.
    #[error("the Agora daemon went away (stopped or killed); this session is closed, open a new one once it is back")]
    Disconnected,
    /// A task failed.
    #[error("task failed: {0}")]
    Task(#[from] TaskError),
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
    /// The daemon answered something this client does not understand.
    #[error("protocol error: {0}; are the client and daemon the same Agora version?")]
    Protocol(String),
}

impl Error {
    /// The task error, if this is one.
    pub fn task_error(&self) -> Option<&TaskError> {
        match self {
            Error::Task(e) => Some(e),
            _ => None,
        }
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
