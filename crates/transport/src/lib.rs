//! Operating-system plumbing shared by the daemon and its clients.
//!
//! * [`shm`]: create, seal and map the per-client memfd segment;
//! * [`wake`]: futex waits and wakes on segment words, the eventfd doorbell, adaptive spinning;
//! * [`socket`]: control-socket paths, `SCM_RIGHTS` fd passing and length-prefixed framing.
//!
//! This crate knows the protocol's types but no policy: it must not know about sessions,
//! queues, devices or kernels.

pub mod shm;
pub mod socket;
pub mod wake;

/// Errors from the transport layer.
#[derive(Debug, thiserror::Error)]
pub enum TransportError {
    /// An operating-system call failed.
    #[error("{what}: {cause}")]
    Os {
        /// What was being done.
        what: &'static str,
        /// The OS error.
        cause: std::io::Error,
    },
    /// The peer closed the connection.
    #[error("the peer closed the connection")]
    Closed,
    /// The peer sent something that violates the protocol.
    #[error("protocol violation: {0}")]
    Protocol(String),
    /// A message too large for one frame; nothing was sent.
    #[error("a message of {0} bytes exceeds the {max}-byte frame limit", max = agora_protocol::control::MAX_FRAME)]
    TooLarge(usize),
    /// The deadline passed before a whole frame arrived (what did arrive is kept for the next
    /// read, so the stream stays in step).
    #[error("no reply before the deadline")]
    TimedOut,
}

impl TransportError {
    pub(crate) fn os(what: &'static str) -> impl FnOnce(std::io::Error) -> TransportError {
        move |cause| TransportError::Os { what, cause }
    }
}

impl From<rustix::io::Errno> for TransportError {
    fn from(e: rustix::io::Errno) -> Self {
        TransportError::Os {
            what: "system call",
            cause: e.into(),
        }
    }
}
