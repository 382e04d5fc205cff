//! The control socket: where it lives, how frames and file descriptors cross it.

use std::io::{IoSlice, IoSliceMut, Read, Write};
use std::mem::MaybeUninit;
use std::os::fd::{BorrowedFd, OwnedFd};
use std::os::unix::net::UnixStream;
use std::path::PathBuf;

use agora_protocol::control::{decode_body, encode_frame, MAX_FRAME};
use rustix::net::{
    RecvAncillaryBuffer, RecvAncillaryMessage, RecvFlags, SendAncillaryBuffer, SendAncillaryMessage, SendFlags,
};
use serde::de::DeserializeOwned;
use serde::Serialize;

use crate::TransportError;

/// Environment variable that overrides the socket path everywhere.
pub const SOCKET_ENV: &str = "AGORA_SOCKET";

/// The socket path to use: `explicit`, else `$AGORA_SOCKET`, else
/// `$XDG_RUNTIME_DIR/agora/agora.sock`, else `/tmp/agora-$UID/agora.sock`.
pub fn socket_path(explicit: Option<PathBuf>) -> PathBuf {
    if let Some(p) = explicit {
        return p;
    }
    if let Some(p) = std::env::var_os(SOCKET_ENV).filter(|p| !p.is_empty()) {
        return PathBuf::from(p);
    }
    if let Some(dir) = std::env::var_os("XDG_RUNTIME_DIR").filter(|p| !p.is_empty()) {
        return PathBuf::from(dir).join("agora").join("agora.sock");
    }
    let uid = rustix::process::getuid().as_raw();
    PathBuf::from(format!("/tmp/agora-{uid}")).join("agora.sock")
}

/// Sends `message` as one frame with `fds` attached as `SCM_RIGHTS`.
pub fn send_with_fds<T: Serialize>(
    stream: &UnixStream,
    message: &T,
    fds: &[BorrowedFd<'_>],
) -> Result<(), TransportError> {
    let frame = encode_frame(message).map_err(|e| TransportError::Protocol(e.to_string()))?;
    let mut space = [MaybeUninit::uninit(); rustix::cmsg_space!(ScmRights(4))];
    let mut control = SendAncillaryBuffer::new(&mut space);
    if !fds.is_empty() && !control.push(SendAncillaryMessage::ScmRights(fds)) {
        return Err(TransportError::Protocol("too many descriptors for one message".into()));
    }
    let sent = rustix::net::sendmsg(stream, &[IoSlice::new(&frame)], &mut control, SendFlags::NOSIGNAL)?;
    if sent != frame.len() {
        // The rest goes without descriptors; frames are small, so this is rare.
        let mut s = stream;
        s.write_all(&frame[sent..])
            .map_err(TransportError::os("sending a frame"))?;
    }
    Ok(())
}

/// Sends `message` as one frame (blocking).
pub fn send<T: Serialize>(stream: &UnixStream, message: &T) -> Result<(), TransportError> {
    send_with_fds(stream, message, &[])
}

/// Receives one frame and any descriptors attached to its first bytes (blocking).
pub fn recv_with_fds<T: DeserializeOwned>(stream: &UnixStream) -> Result<(T, Vec<OwnedFd>), TransportError> {
    let mut header = [0u8; 4];
    let mut space = [MaybeUninit::uninit(); rustix::cmsg_space!(ScmRights(4))];
    let mut control = RecvAncillaryBuffer::new(&mut space);
    let got = rustix::net::recvmsg(
        stream,
        &mut [IoSliceMut::new(&mut header)],
        &mut control,
        RecvFlags::CMSG_CLOEXEC,
    )?;
    let mut fds = Vec::new();
    for message in control.drain() {
        if let RecvAncillaryMessage::ScmRights(received) = message {
            fds.extend(received);
        }
    }
    if got.bytes == 0 {
        return Err(TransportError::Closed);
    }
    let mut s = stream;
    if got.bytes < 4 {
        s.read_exact(&mut header[got.bytes..])
            .map_err(closed_or("reading a frame header"))?;
    }
    let len = u32::from_le_bytes(header);
    if len > MAX_FRAME {
        return Err(TransportError::Protocol(format!(
            "frame of {len} bytes exceeds {MAX_FRAME}"
        )));
    }
    let mut body = vec![0u8; len as usize];
    s.read_exact(&mut body).map_err(closed_or("reading a frame"))?;
    let message = decode_body(&body).map_err(|e| TransportError::Protocol(format!("undecodable message: {e}")))?;
    Ok((message, fds))
}

/// Receives one frame (blocking).
pub fn recv<T: DeserializeOwned>(stream: &UnixStream) -> Result<T, TransportError> {
    recv_with_fds(stream).map(|(m, _)| m)
}

fn closed_or(what: &'static str) -> impl FnOnce(std::io::Error) -> TransportError {
    move |e| {
        if e.kind() == std::io::ErrorKind::UnexpectedEof {
            TransportError::Closed
        } else {
            TransportError::Os { what, cause: e }
        }
    }
}

/// Reassembles frames from a non-blocking stream without ever blocking (daemon side), so a
/// client that sends half a frame and stops cannot stall the daemon.
#[derive(Debug, Default)]
pub struct FrameReader {
    buffer: Vec<u8>,
}

impl FrameReader {
    /// Reads what is available and returns the complete frame bodies found.
    /// `Err(Closed)` when the peer has closed; `Err(Protocol)` on an oversize frame.
    pub fn read_frames(&mut self, stream: &UnixStream) -> Result<Vec<Vec<u8>>, TransportError> {
        let mut chunk = [0u8; 4096];
        let mut closed = false;
        loop {
            let mut s = stream;
            match s.read(&mut chunk) {
                Ok(0) => {
                    closed = true;
                    break;
                }
                Ok(n) => {
                    self.buffer.extend_from_slice(&chunk[..n]);
                    if self.buffer.len() > MAX_FRAME as usize + 4 + chunk.len() {
                        break; // parse what we have before reading more
                    }
                }
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => break,
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
                Err(e) if e.kind() == std::io::ErrorKind::ConnectionReset => {
                    closed = true;
                    break;
                }
                Err(e) => {
                    return Err(TransportError::Os {
                        what: "reading the control socket",
                        cause: e,
                    })
                }
            }
        }
        let mut frames = Vec::new();
        let mut at = 0;
        while self.buffer.len() - at >= 4 {
            let len = u32::from_le_bytes(self.buffer[at..at + 4].try_into().expect("4 bytes"));
            if len > MAX_FRAME {
                return Err(TransportError::Protocol(format!(
                    "frame of {len} bytes exceeds {MAX_FRAME}"
                )));
            }
            let end = at + 4 + len as usize;
            if self.buffer.len() < end {
                break;
            }
            frames.push(self.buffer[at + 4..end].to_vec());
            at = end;
        }
        self.buffer.drain(..at);
        if closed && frames.is_empty() {
            return Err(TransportError::Closed);
        }
        Ok(frames)
    }
}

/// Whether the peer of `stream` has hung up (non-blocking check).
pub fn peer_hung_up(stream: &UnixStream) -> bool {
    use rustix::event::{PollFd, PollFlags};
    let mut fds = [PollFd::new(stream, PollFlags::RDHUP | PollFlags::HUP)];
    let zero = rustix::time::Timespec { tv_sec: 0, tv_nsec: 0 };
    match rustix::event::poll(&mut fds, Some(&zero)) {
        Ok(0) => false,
        Ok(_) => fds[0]
            .revents()
            .intersects(PollFlags::RDHUP | PollFlags::HUP | PollFlags::ERR),
        Err(_) => true,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::fd::AsFd;

    #[test]
    fn frames_and_fds_cross_a_socketpair() {
        let (a, b) = UnixStream::pair().unwrap();
        let d = crate::wake::Doorbell::new().unwrap();
        send_with_fds(&a, &"hello".to_string(), &[d.fd()]).unwrap();
        let (msg, fds): (String, _) = recv_with_fds(&b).unwrap();
        assert_eq!(msg, "hello");
        assert_eq!(fds.len(), 1);
        // The received eventfd is the same object: ringing it makes ours readable.
        crate::wake::Doorbell::from_fd(fds.into_iter().next().unwrap()).ring();
        let mut p = [rustix::event::PollFd::new(&d, rustix::event::PollFlags::IN)];
        assert_eq!(rustix::event::poll(&mut p, None).unwrap(), 1);
        let _ = d.fd().as_fd();
    }

    #[test]
    fn frame_reader_handles_partial_and_oversize_frames() {
        let (a, b) = UnixStream::pair().unwrap();
        b.set_nonblocking(true).unwrap();
        let frame = encode_frame(&"abc".to_string()).unwrap();
        let mut r = FrameReader::default();
        (&a).write_all(&frame[..2]).unwrap();
        assert!(r.read_frames(&b).unwrap().is_empty());
        (&a).write_all(&frame[2..]).unwrap();
        (&a).write_all(&frame).unwrap();
        let frames = r.read_frames(&b).unwrap();
        assert_eq!(frames.len(), 2);
        (&a).write_all(&(MAX_FRAME + 1).to_le_bytes()).unwrap();
        assert!(matches!(r.read_frames(&b), Err(TransportError::Protocol(_))));
        drop(a);
        let mut r = FrameReader::default();
        assert!(matches!(r.read_frames(&b), Err(TransportError::Closed)));
    }

    #[test]
    fn socket_path_prefers_explicit_then_env() {
        assert_eq!(socket_path(Some("/x/y".into())), PathBuf::from("/x/y"));
        let p = socket_path(None);
        assert!(p.ends_with("agora.sock") || std::env::var_os(SOCKET_ENV).is_some());
    }
}
