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

/// Where a node-wide daemon listens (`examples/systemd/agora.service`, `agora serve
/// --socket-access all`): clients use it when they were given no path and no daemon of their own
/// user listens at the personal default.
pub const SYSTEM_SOCKET: &str = "/run/agora/agora.sock";

/// The socket a client connects to: `explicit`, else `$AGORA_SOCKET`, else the personal default
/// of [`socket_path`] when a socket is there, else [`SYSTEM_SOCKET`] when a socket is there (a
/// node-wide daemon), else the personal default (which a failed connection then names). The
/// daemon itself listens at [`socket_path`]: it never takes the node's path unless told to.
pub fn client_socket_path(explicit: Option<PathBuf>) -> PathBuf {
    if explicit.is_some() || std::env::var_os(SOCKET_ENV).is_some_and(|p| !p.is_empty()) {
        return socket_path(explicit);
    }
    default_client_socket(socket_path(None), std::path::Path::new(SYSTEM_SOCKET))
}

/// `personal` unless only `system` has a socket.
fn default_client_socket(personal: PathBuf, system: &std::path::Path) -> PathBuf {
    let is_socket = |path: &std::path::Path| {
        use std::os::unix::fs::FileTypeExt;
        std::fs::symlink_metadata(path).is_ok_and(|meta| meta.file_type().is_socket())
    };
    if !is_socket(&personal) && is_socket(system) {
        system.to_path_buf()
    } else {
        personal
    }
}

/// Sends `message` as one frame with `fds` attached as `SCM_RIGHTS`.
pub fn send_with_fds<T: Serialize>(
    stream: &UnixStream,
    message: &T,
    fds: &[BorrowedFd<'_>],
) -> Result<(), TransportError> {
    let frame = encode_frame(message).map_err(|e| TransportError::Protocol(e.to_string()))?;
    if frame.len() - 4 > MAX_FRAME as usize {
        return Err(TransportError::TooLarge(frame.len() - 4));
    }
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

/// Sends `message` as one frame, waiting for room in the socket at most until `deadline`
/// (blocking or not, the stream is written without blocking past it; time this process did not
/// run is left out, [`agora_wait::Deadline`]). `Err(TimedOut)` when the
/// peer did not take the whole frame in time: part of it may have gone, so the connection is
/// out of step and must be closed.
pub fn send_before<T: Serialize>(
    stream: &UnixStream,
    message: &T,
    deadline: std::time::Instant,
) -> Result<(), TransportError> {
    use rustix::event::{PollFd, PollFlags};
    let frame = encode_frame(message).map_err(|e| TransportError::Protocol(e.to_string()))?;
    if frame.len() - 4 > MAX_FRAME as usize {
        return Err(TransportError::TooLarge(frame.len() - 4));
    }
    // Time this process did not run (a paused VM) does not count against the peer.
    let mut patient = agora_wait::Deadline::at(deadline);
    let mut sent = 0;
    while sent < frame.len() {
        match rustix::net::send(stream, &frame[sent..], SendFlags::NOSIGNAL | SendFlags::DONTWAIT) {
            Ok(n) => sent += n,
            Err(rustix::io::Errno::INTR) => {}
            Err(rustix::io::Errno::AGAIN) => {
                let Some(wait) = patient.next_wait() else {
                    return Err(TransportError::TimedOut);
                };
                let timeout = rustix::time::Timespec {
                    tv_sec: wait.as_secs() as i64,
                    tv_nsec: i64::from(wait.subsec_nanos()),
                };
                let mut fds = [PollFd::new(stream, PollFlags::OUT)];
                let began = std::time::Instant::now();
                let polled = rustix::event::poll(&mut fds, Some(&timeout));
                patient.waited(began, wait);
                match polled {
                    Ok(_) | Err(rustix::io::Errno::INTR) => {}
                    Err(e) => return Err(e.into()),
                }
            }
            Err(e) => return Err(e.into()),
        }
    }
    Ok(())
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

/// Receives one frame before `deadline` (blocking at most until then, leaving out time this
/// process did not run, [`agora_wait::Deadline`]). Bytes of a frame that
/// has not fully arrived stay in `pending` for the next call on the same stream, so a timeout
/// never leaves the stream in the middle of a frame. Descriptors that arrive are closed (see
/// [`recv_before_with_fds`]).
pub fn recv_before<T: DeserializeOwned>(
    stream: &UnixStream,
    pending: &mut Vec<u8>,
    deadline: std::time::Instant,
) -> Result<T, TransportError> {
    let mut fds = Vec::new();
    recv_before_with_fds(stream, pending, &mut fds, deadline)
}

/// [`recv_before`], keeping the descriptors that arrive in `fds` (at most 4 per read; the
/// caller, which sends one request at a time, knows which reply they came with).
pub fn recv_before_with_fds<T: DeserializeOwned>(
    stream: &UnixStream,
    pending: &mut Vec<u8>,
    fds: &mut Vec<OwnedFd>,
    deadline: std::time::Instant,
) -> Result<T, TransportError> {
    use rustix::event::{PollFd, PollFlags};
    // Time this process did not run (a paused VM) does not count against the peer.
    let mut patient = agora_wait::Deadline::at(deadline);
    loop {
        if pending.len() >= 4 {
            let len = u32::from_le_bytes(pending[..4].try_into().expect("4 bytes"));
            if len > MAX_FRAME {
                return Err(TransportError::Protocol(format!(
                    "frame of {len} bytes exceeds {MAX_FRAME}"
                )));
            }
            let end = 4 + len as usize;
            if pending.len() >= end {
                let message = decode_body(&pending[4..end])
                    .map_err(|e| TransportError::Protocol(format!("undecodable message: {e}")));
                pending.drain(..end);
                return message;
            }
        }
        let Some(wait) = patient.next_wait() else {
            return Err(TransportError::TimedOut);
        };
        let timeout = rustix::time::Timespec {
            tv_sec: wait.as_secs() as i64,
            tv_nsec: i64::from(wait.subsec_nanos()),
        };
        let mut polled = [PollFd::new(stream, PollFlags::IN)];
        let began = std::time::Instant::now();
        let polled = rustix::event::poll(&mut polled, Some(&timeout));
        patient.waited(began, wait);
        match polled {
            Ok(0) => continue,
            Ok(_) => {}
            Err(rustix::io::Errno::INTR) => continue,
            Err(e) => return Err(e.into()),
        }
        let mut chunk = [0u8; 16 * 1024];
        let mut space = [MaybeUninit::uninit(); rustix::cmsg_space!(ScmRights(4))];
        let mut control = RecvAncillaryBuffer::new(&mut space);
        let received = rustix::net::recvmsg(
            stream,
            &mut [IoSliceMut::new(&mut chunk)],
            &mut control,
            RecvFlags::DONTWAIT | RecvFlags::CMSG_CLOEXEC,
        )
        .map(|got| (got.bytes, ()));
        for message in control.drain() {
            if let RecvAncillaryMessage::ScmRights(received) = message {
                fds.extend(received);
            }
        }
        match received {
            Ok((0, _)) => return Err(TransportError::Closed),
            Ok((n, _)) => pending.extend_from_slice(&chunk[..n]),
            Err(rustix::io::Errno::AGAIN | rustix::io::Errno::INTR) => {}
            Err(rustix::io::Errno::CONNRESET) => return Err(TransportError::Closed),
            Err(e) => return Err(e.into()),
        }
    }
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
///
/// Descriptors a peer attaches (a resuming client's segment) are kept, at most
/// [`FrameReader::MAX_HELD_FDS`]; more are closed at once, so a peer cannot make the daemon
/// hold descriptors.
#[derive(Debug, Default)]
pub struct FrameReader {
    buffer: Vec<u8>,
    fds: Vec<OwnedFd>,
}

impl FrameReader {
    /// Most received descriptors held until [`FrameReader::take_fds`].
    pub const MAX_HELD_FDS: usize = 2;

    /// The descriptors received so far (and forgets them).
    pub fn take_fds(&mut self) -> Vec<OwnedFd> {
        std::mem::take(&mut self.fds)
    }

    /// Reads what is available and returns the complete frame bodies found.
    /// `Err(Closed)` when the peer has closed; `Err(Protocol)` on an oversize frame.
    pub fn read_frames(&mut self, stream: &UnixStream) -> Result<Vec<Vec<u8>>, TransportError> {
        let mut chunk = [0u8; 4096];
        let mut closed = false;
        loop {
            let mut space = [MaybeUninit::uninit(); rustix::cmsg_space!(ScmRights(4))];
            let mut control = RecvAncillaryBuffer::new(&mut space);
            let got = rustix::net::recvmsg(
                stream,
                &mut [IoSliceMut::new(&mut chunk)],
                &mut control,
                RecvFlags::CMSG_CLOEXEC | RecvFlags::DONTWAIT,
            )
            .map(|r| r.bytes)
            .map_err(std::io::Error::from);
            for message in control.drain() {
                if let RecvAncillaryMessage::ScmRights(received) = message {
                    for fd in received {
                        if self.fds.len() < Self::MAX_HELD_FDS {
                            self.fds.push(fd);
                        }
                    }
                }
            }
            match got {
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

    #[test]
    fn a_client_falls_back_to_the_nodes_socket_only_when_no_personal_one_listens() {
        let dir = tempfile_dir();
        let personal = dir.join("personal.sock");
        let system = dir.join("system.sock");
        // Neither: the personal path, which the connection error then names.
        assert_eq!(default_client_socket(personal.clone(), &system), personal);
        // Only the node's.
        let _node = std::os::unix::net::UnixListener::bind(&system).unwrap();
        assert_eq!(default_client_socket(personal.clone(), &system), system);
        // A personal daemon wins.
        let _mine = std::os::unix::net::UnixListener::bind(&personal).unwrap();
        assert_eq!(default_client_socket(personal.clone(), &system), personal);
        // A file that is not a socket is no daemon.
        let file = dir.join("file");
        std::fs::write(&file, b"").unwrap();
        assert_eq!(
            default_client_socket(dir.join("absent.sock"), &file),
            dir.join("absent.sock")
        );
        let _ = std::fs::remove_dir_all(dir);
    }

    fn tempfile_dir() -> PathBuf {
        let dir = std::env::temp_dir().join(format!(
            "agora-transport-{}-{:?}",
            std::process::id(),
            std::thread::current().id()
        ));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        dir
    }
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
    fn oversize_messages_are_not_sent() {
        let (a, b) = UnixStream::pair().unwrap();
        let big = "x".repeat(MAX_FRAME as usize + 1);
        assert!(matches!(send(&a, &big), Err(TransportError::TooLarge(n)) if n > MAX_FRAME as usize));
        // Nothing went out: the next message is the first the peer sees.
        send(&a, &"small".to_string()).unwrap();
        assert_eq!(recv::<String>(&b).unwrap(), "small");
    }

    #[test]
    fn send_before_waits_for_a_slow_reader_but_not_for_one_that_never_reads() {
        use std::time::{Duration, Instant};
        let (a, b) = UnixStream::pair().unwrap();
        a.set_nonblocking(true).unwrap();
        // Larger than the socket's buffer: written in parts as the reader takes them.
        let big = "y".repeat(900 * 1024);
        let reader = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(50));
            let got = recv::<String>(&b).unwrap();
            (got.len(), b)
        });
        send_before(&a, &big, Instant::now() + Duration::from_secs(10)).unwrap();
        let (len, b) = reader.join().unwrap();
        assert_eq!(len, big.len());
        let started = Instant::now();
        let r = send_before(&a, &big, Instant::now() + Duration::from_millis(100));
        assert!(matches!(r, Err(TransportError::TimedOut)), "{r:?}");
        assert!(started.elapsed() < Duration::from_secs(5));
        drop(b);
    }

    #[test]
    fn recv_before_times_out_and_keeps_a_partial_frame() {
        use std::time::{Duration, Instant};
        let (a, b) = UnixStream::pair().unwrap();
        let mut pending = Vec::new();
        let started = Instant::now();
        let r = recv_before::<String>(&b, &mut pending, started + Duration::from_millis(50));
        assert!(matches!(r, Err(TransportError::TimedOut)));
        assert!(started.elapsed() >= Duration::from_millis(50));
        let frame = encode_frame(&"hello".to_string()).unwrap();
        (&a).write_all(&frame[..3]).unwrap();
        let r = recv_before::<String>(&b, &mut pending, Instant::now() + Duration::from_millis(20));
        assert!(matches!(r, Err(TransportError::TimedOut)));
        (&a).write_all(&frame[3..]).unwrap();
        (&a).write_all(&encode_frame(&"again".to_string()).unwrap()).unwrap();
        let deadline = Instant::now() + Duration::from_secs(5);
        assert_eq!(recv_before::<String>(&b, &mut pending, deadline).unwrap(), "hello");
        assert_eq!(recv_before::<String>(&b, &mut pending, deadline).unwrap(), "again");
        drop(a);
        assert!(matches!(
            recv_before::<String>(&b, &mut pending, deadline),
            Err(TransportError::Closed)
        ));
    }

    #[test]
    fn socket_path_prefers_explicit_then_env() {
        assert_eq!(socket_path(Some("/x/y".into())), PathBuf::from("/x/y"));
        let p = socket_path(None);
        assert!(p.ends_with("agora.sock") || std::env::var_os(SOCKET_ENV).is_some());
    }
}
