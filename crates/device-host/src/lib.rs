//! Device hosts: each OpenCL platform, and each GPU, runs in a child process of the daemon
//! (issue #22 item 3b and #24 item 5; the design of Chromium's GPU process, beside DESIGN.md's
//! executors), so a driver that asserts, segfaults or hangs, or a kernel fault that leaves a
//! GPU's context unusable for everyone in it, ends that process, not the daemon and every
//! tenant's work with it: the daemon replays the host's tasks and starts a new host. On by
//! default (`[opencl] device_host`, `[cuda] device_host`); the socket hop costs a small task tens
//! of microseconds (docs/PERFORMANCE.md, "Device hosts: the hop").
//!
//! * [`remote`] — the daemon's side: [`RemoteDevice`], a [`Device`](agora_devices::Device)
//!   whose lanes forward their jobs to the host; failure detection, restart, segment sharing;
//! * [`host`] — the host's side (`agora device-host`): the real devices (an OpenCL platform's,
//!   one GPU, or a test's `sim`), serving the daemon's requests;
//! * [`wire`] — the messages between them;
//! * `disposal` — the host's thread that lets go of segments and big buffers off its loop.
//!
//! Must not: know about sessions, queues or scheduling (the daemon's lanes and scheduler stay
//! the same for a device in a host); load OpenCL or CUDA in the daemon (the platform and GPU
//! lists come from the host program too).

mod disposal;
pub mod host;
pub mod remote;
pub mod wire;

pub use host::{list_platforms as print_platforms, serve, HostArgs};
pub use remote::{list_gpus, list_platforms, start_platform, HostSpec, RemoteDevice};

/// Reads frames from a socket in chunks: one system call brings every frame that has arrived,
/// where reading frame by frame costs two per frame (header, body). On machines with cores to
/// spare ([`SPIN_MIN_CORES`]) it waits the way every wait on Agora's task path does: a
/// cooperative spin of non-blocking reads for a learned budget ([`agora_wait::AdaptiveSpin`]),
/// then a blocking read. On smaller ones it blocks at once (see [`SPIN_MIN_CORES`]).
///
/// Descriptors (`SCM_RIGHTS`) arrive with the first byte of the frame they were sent with, so
/// they are kept in arrival order and taken by the frames that carry one, in order.
pub(crate) struct FrameReader {
    /// Read bytes are `buffer[start..end]`; the rest is room (never cleared again: a spin polls
    /// often, and zeroing the room each time cost more than the read).
    buffer: Vec<u8>,
    /// Start of the bytes not yet decoded.
    start: usize,
    /// End of the bytes read.
    end: usize,
    fds: std::collections::VecDeque<std::os::fd::OwnedFd>,
    spin: agora_wait::AdaptiveSpin,
    /// Whether to spin before blocking ([`SPIN_MIN_CORES`]).
    spins: bool,
}

/// The fewest cores on which the readers of the device-host link spin before they block. A job
/// through a device host keeps up to seven threads busy at once (client, dispatcher, daemon
/// lane, the daemon's reader, the host's reader, the host's lane, the OpenCL runtime's worker),
/// so a reader that spins takes a core one of them needs unless cores are plenty (`perf sched`
/// showed woken threads waiting 50–100 µs for a core two spinners held). Measured on a 2-core
/// VM, min / median / max of 3 runs: the empty OpenCL kernel through a host (`agora bench
/// latency`) 304 / 306 / 315 µs with spinning readers, 182 / 218 / 223 µs blocking; gaussian's
/// 2046 launches (`agora bench overhead --opencl-device-host`) 1.75× native → 1.10×. Idle lanes
/// on both sides of the link sleep at once by the same rule (`Lane::start_with`): then 46–78 µs.
const SPIN_MIN_CORES: usize = 8;

/// Whether this machine has cores enough for the readers to spin ([`SPIN_MIN_CORES`]).
fn readers_spin() -> bool {
    static SPINS: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *SPINS.get_or_init(|| std::thread::available_parallelism().map_or(1, |n| n.get()) >= SPIN_MIN_CORES)
}

/// Bytes asked of one read.
const READ_CHUNK: usize = 64 << 10;

impl FrameReader {
    pub(crate) fn new() -> Self {
        FrameReader {
            buffer: vec![0; READ_CHUNK],
            start: 0,
            end: 0,
            fds: std::collections::VecDeque::new(),
            spin: agora_wait::AdaptiveSpin::new(agora_wait::MIN_BUDGET, std::time::Duration::from_micros(250)),
            spins: readers_spin(),
        }
    }

    /// The next descriptor that arrived (for a frame that carries one).
    pub(crate) fn take_fd(&mut self) -> Option<std::os::fd::OwnedFd> {
        self.fds.pop_front()
    }

    /// The next frame, waiting for it.
    pub(crate) fn next<T: serde::de::DeserializeOwned>(
        &mut self,
        stream: &std::os::unix::net::UnixStream,
    ) -> Result<T, agora_transport::TransportError> {
        use agora_transport::TransportError;
        loop {
            let pending = &self.buffer[self.start..self.end];
            if pending.len() >= 4 {
                let len = u32::from_le_bytes(pending[..4].try_into().expect("4 bytes"));
                if len > agora_protocol::control::MAX_FRAME {
                    return Err(TransportError::Protocol(format!("frame of {len} bytes")));
                }
                let end = 4 + len as usize;
                if pending.len() >= end {
                    let message = agora_protocol::control::decode_body(&pending[4..end])
                        .map_err(|e| TransportError::Protocol(format!("undecodable message: {e}")))?;
                    self.start += end;
                    return Ok(message);
                }
            }
            // Keep the undecoded tail at the front, with room for a whole frame, then read more.
            self.buffer.copy_within(self.start..self.end, 0);
            self.end -= self.start;
            self.start = 0;
            let want = if self.end >= 4 {
                4 + u32::from_le_bytes(self.buffer[..4].try_into().expect("4 bytes")) as usize
            } else {
                0
            };
            if self.buffer.len() < want.max(self.end + READ_CHUNK / 4) {
                self.buffer.resize(want.max(self.end + READ_CHUNK), 0);
            }
            let mut closed = false;
            let mut error = None;
            let FrameReader {
                buffer,
                end,
                fds,
                spin,
                spins,
                ..
            } = self;
            let mut read = |blocking: bool| -> bool {
                match read_some(stream, buffer, end, fds, blocking) {
                    Ok(0) => {
                        closed = true;
                        true
                    }
                    Ok(_) => true,
                    Err(rustix::io::Errno::AGAIN | rustix::io::Errno::INTR) => false,
                    Err(e) => {
                        error = Some(e);
                        true
                    }
                }
            };
            if !*spins || !spin.spin(|| read(false)) {
                let started = std::time::Instant::now();
                while !read(true) {}
                spin.blocked_for(started.elapsed());
            }
            if let Some(e) = error {
                return Err(e.into());
            }
            if closed {
                return Err(TransportError::Closed);
            }
        }
    }
}

/// One read into `buffer[end..]` (descriptors into `fds`); the bytes read (0: the peer closed).
fn read_some(
    stream: &std::os::unix::net::UnixStream,
    buffer: &mut [u8],
    end: &mut usize,
    fds: &mut std::collections::VecDeque<std::os::fd::OwnedFd>,
    blocking: bool,
) -> rustix::io::Result<usize> {
    use rustix::net::{RecvAncillaryBuffer, RecvAncillaryMessage, RecvFlags};
    use std::mem::MaybeUninit;
    let mut space = [MaybeUninit::uninit(); rustix::cmsg_space!(ScmRights(8))];
    let mut control = RecvAncillaryBuffer::new(&mut space);
    let flags = if blocking {
        RecvFlags::CMSG_CLOEXEC
    } else {
        RecvFlags::CMSG_CLOEXEC | RecvFlags::DONTWAIT
    };
    let result = rustix::net::recvmsg(
        stream,
        &mut [std::io::IoSliceMut::new(&mut buffer[*end..])],
        &mut control,
        flags,
    );
    for message in control.drain() {
        if let RecvAncillaryMessage::ScmRights(received) = message {
            fds.extend(received);
        }
    }
    let got = result.as_ref().map_or(0, |r| r.bytes);
    *end += got;
    result.map(|r| r.bytes)
}
