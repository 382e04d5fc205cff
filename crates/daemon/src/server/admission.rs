//! Who may connect and how much they may ask: accepting connections (with the descriptor-exhaustion
//! back-off), the peer's credentials, per-connection token buckets, per-uid limits, and closing
//! connections that never said hello.
//!
//! The dispatcher's (`Server`'s) methods for admission; the limits themselves are
//! `crate::limits`. It must not answer requests beyond refusing them.

use std::os::fd::AsRawFd;
use std::sync::atomic::AtomicBool;

use super::*;

/// The peer's supplementary groups, or none (only its primary gid then counts for group
/// permissions) where the kernel cannot say; that is logged once, at debug: it is the same for
/// every connection.
fn supplementary_groups(stream: &UnixStream) -> Arc<[u32]> {
    static UNSUPPORTED_LOGGED: AtomicBool = AtomicBool::new(false);
    // Most users are in a few groups; the kernel says how many bytes it needs when they do not
    // fit, at most NGROUPS_MAX (65536) gids.
    match peer_groups(stream, 32) {
        Ok(groups) => groups.into(),
        Err(e) => {
            if !UNSUPPORTED_LOGGED.swap(true, Ordering::Relaxed) {
                tracing::debug!(
                    error = %e,
                    "SO_PEERGROUPS is unavailable (Linux before 4.13?): group permissions count each peer's primary gid only"
                );
            }
            Arc::from([])
        }
    }
}

/// `getsockopt(SOL_SOCKET, SO_PEERGROUPS)`: the supplementary groups the kernel recorded when
/// the peer connected, read from the socket rather than from `/proc/PID/status`, which a peer
/// could exit and have its pid reused in between. rustix has no wrapper for it. Room for
/// `guess` groups first, then as many as the kernel says it needs (ERANGE).
fn peer_groups(stream: &UnixStream, guess: usize) -> std::io::Result<Vec<u32>> {
    const GID_BYTES: usize = std::mem::size_of::<libc::gid_t>();
    let mut groups: Vec<libc::gid_t> = vec![0; guess];
    loop {
        let mut len = (groups.len() * GID_BYTES) as libc::socklen_t;
        // SAFETY: the descriptor is the stream's, open for the whole call; `groups` is `len`
        // writable bytes of gid_t, the type SO_PEERGROUPS writes, and the kernel writes at most
        // `len` bytes there and stores in `len` the bytes it wrote (or needs, with ERANGE).
        let rc = unsafe {
            libc::getsockopt(
                stream.as_raw_fd(),
                libc::SOL_SOCKET,
                libc::SO_PEERGROUPS,
                groups.as_mut_ptr().cast(),
                &mut len,
            )
        };
        let needed = len as usize / GID_BYTES;
        if rc == 0 {
            groups.truncate(needed);
            return Ok(groups);
        }
        let error = std::io::Error::last_os_error();
        if error.raw_os_error() == Some(libc::ERANGE) && needed > groups.len() {
            groups.resize(needed, 0);
            continue;
        }
        return Err(error);
    }
}

impl Server {
    /// Closes connections that sent no request within the hello timeout, telling them why.
    pub(super) fn expire_hellos(&mut self) {
        let now = Instant::now();
        while let Some(&(deadline, id)) = self.hello_deadlines.front() {
            if deadline > now {
                break;
            }
            self.hello_deadlines.pop_front();
            let Some(Conn::Pending {
                stream, credentials, ..
            }) = self.conns.get(&id)
            else {
                continue;
            };
            let ms = self.books.settings().hello_timeout.as_millis() as u64;
            let refusal = self.books.refuse(Limit::HelloTimeout, credentials.uid, ms, ms);
            let _ = send_whole(stream, &Response::Error(refusal), Duration::ZERO);
            tracing::debug!(
                connection = id,
                pid = credentials.pid,
                "closing a connection that said nothing"
            );
            self.close(id);
        }
    }

    pub(super) fn accept(&mut self) {
        loop {
            match self.listener.accept() {
                Ok((stream, _)) => {
                    let credentials = match rustix::net::sockopt::socket_peercred(&stream) {
                        Ok(c) => Credentials {
                            pid: c.pid.as_raw_nonzero().get(),
                            uid: c.uid.as_raw(),
                            gid: c.gid.as_raw(),
                            groups: supplementary_groups(&stream),
                        },
                        Err(e) => {
                            tracing::warn!(error = %e, "refusing a connection without peer credentials");
                            continue;
                        }
                    };
                    if let Err(e) = stream.set_nonblocking(true) {
                        tracing::warn!(error = %e, "refusing a connection");
                        continue;
                    }
                    let id = self.next_id;
                    self.next_id += 1;
                    if let Err(refusal) = self.books.connect(credentials.uid, id) {
                        tracing::debug!(
                            pid = credentials.pid,
                            uid = credentials.uid,
                            "refusing a connection: {refusal}"
                        );
                        let _ = send_whole(&stream, &Response::Error(refusal), Duration::ZERO);
                        continue;
                    }
                    let flags = epoll::EventFlags::IN | epoll::EventFlags::RDHUP;
                    if let Err(e) = epoll::add(
                        &self.epoll,
                        &stream,
                        epoll::EventData::new_u64(Token::Socket(id).encode()),
                        flags,
                    ) {
                        tracing::warn!(error = %e, "refusing a connection");
                        self.books.disconnect(credentials.uid, id);
                        continue;
                    }
                    let now = Instant::now();
                    self.hello_deadlines
                        .push_back((now + self.books.settings().hello_timeout, id));
                    self.buckets
                        .insert(id, TokenBucket::new(self.books.settings().control_burst, now));
                    self.conns.insert(
                        id,
                        Conn::Pending {
                            stream: Arc::new(stream),
                            reader: FrameReader::default(),
                            credentials,
                        },
                    );
                }
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => return,
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
                Err(e)
                    if [rustix::io::Errno::MFILE, rustix::io::Errno::NFILE]
                        .iter()
                        .any(|n| e.raw_os_error() == Some(n.raw_os_error())) =>
                {
                    return self.out_of_descriptors(&e);
                }
                Err(e) => {
                    if let Some(suppressed) = self.accept_log.allow(Instant::now()) {
                        tracing::warn!(error = %e, suppressed, "accept failed");
                    }
                    return;
                }
            }
        }
    }

    /// `accept` failed for want of descriptors: refuse the waiting connections with a message
    /// (using the reserve descriptor), take the listener out of the epoll set for
    /// [`ACCEPT_BACKOFF`], and say so at most once per [`ACCEPT_LOG_EVERY`].
    pub(super) fn out_of_descriptors(&mut self, error: &std::io::Error) {
        let mut shed = 0;
        if let Some(reserve) = self.reserve_fd.take() {
            drop(reserve);
            let limit = rustix::process::getrlimit(rustix::process::Resource::Nofile)
                .current
                .unwrap_or(u64::MAX);
            while shed < SHED_PER_BACKOFF {
                let Ok((stream, _)) = self.listener.accept() else { break };
                let uid = rustix::net::sockopt::socket_peercred(&stream).map_or(u32::MAX, |c| c.uid.as_raw());
                let refusal = self.books.refuse(Limit::DaemonFiles, uid, limit, limit);
                let _ = stream.set_nonblocking(true);
                let _ = send_whole(&stream, &Response::Error(refusal), Duration::ZERO);
                shed += 1;
            }
            self.reserve_fd = std::fs::File::open("/dev/null").ok();
        }
        if self.listener_paused_until.is_none() {
            let _ = epoll::delete(&self.epoll, &self.listener);
        }
        self.listener_paused_until = Some(Instant::now() + ACCEPT_BACKOFF);
        if let Some(suppressed) = self.accept_log.allow(Instant::now()) {
            tracing::warn!(
                error = %error,
                refused = shed,
                suppressed,
                connections = self.conns.len(),
                "out of file descriptors: refusing new connections (raise the daemon's RLIMIT_NOFILE, or see \
                 `agora status` for who holds them); this line repeats at most every 10 s"
            );
        }
    }

    /// The identity of connection `id`.
    pub(super) fn credentials(&self, id: u64) -> Option<Credentials> {
        match self.conns.get(&id)? {
            Conn::Pending { credentials, .. } | Conn::Observer { credentials, .. } => Some(credentials.clone()),
            Conn::Session(s) => Some(s.credentials.clone()),
        }
    }

    /// Takes a token from connection `id`'s bucket; the refusal when it is empty.
    pub(super) fn take_token(&mut self, id: u64) -> Result<(), ControlError> {
        let Some(uid) = self.credentials(id).map(|c| c.uid) else {
            return Ok(());
        };
        if self.books.exempt(uid) {
            return Ok(());
        }
        let settings = self.books.settings();
        let (rate, burst) = (settings.control_rate, settings.control_burst);
        let bucket = self
            .buckets
            .entry(id)
            .or_insert_with(|| TokenBucket::new(burst, Instant::now()));
        if bucket.take(Instant::now(), rate, burst) {
            return Ok(());
        }
        Err(self.books.refuse(Limit::ControlRate, uid, rate, rate))
    }

    /// `Ok` when connection `id`'s uid may have one more of `limit` (queues, buffers or
    /// outstanding control requests), counted over all its sessions and connections.
    pub(super) fn check_uid(&mut self, id: u64, limit: Limit) -> Result<(), ControlError> {
        let Some(uid) = self.credentials(id).map(|c| c.uid) else {
            return Ok(());
        };
        if self.books.exempt(uid) {
            return Ok(());
        }
        let used = match limit {
            Limit::Queues => self.uid_sessions(uid).map(|s| s.queues.len() as u64).sum(),
            Limit::Buffers => self.uid_sessions(uid).map(|s| s.buffers.len() as u64).sum(),
            Limit::ControlRequests => self.uid_control_requests(uid),
            _ => 0,
        };
        self.books.check(limit, uid, used, 1)
    }

    /// The live sessions of `uid`.
    pub(super) fn uid_sessions(&self, uid: u32) -> impl Iterator<Item = &Session> + '_ {
        self.books
            .sessions(uid)
            .iter()
            .filter_map(|id| match self.conns.get(id) {
                Some(Conn::Session(s)) => Some(&**s),
                _ => None,
            })
    }

    /// Control requests of `uid` handed to the control thread and not answered yet.
    pub(super) fn uid_control_requests(&self, uid: u32) -> u64 {
        self.books
            .connections(uid)
            .iter()
            .filter_map(|id| self.owed.get(id))
            .map(|o| o.load(Ordering::Acquire) as u64)
            .sum()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_peer_groups_are_the_connecting_processs_however_small_the_first_guess() {
        let (stream, _peer) = UnixStream::pair().unwrap();
        let mut own: Vec<u32> = rustix::process::getgroups()
            .unwrap()
            .iter()
            .map(|g| g.as_raw())
            .collect();
        own.sort_unstable();
        for guess in [0, 1, 32] {
            let mut seen = peer_groups(&stream, guess).expect("SO_PEERGROUPS (Linux 4.13)");
            seen.sort_unstable();
            assert_eq!(seen, own, "first guess {guess}");
        }
    }
}
