//! Sessions come and go: `Hello` opens one (its segment, rings and doorbell, checked against the
//! uid's limits), `Resume`/`ResumeMore` take over a segment an earlier daemon served (every part
//! of it checked as untrusted input), and `close` ends a connection and hands its session to the
//! reclaim thread.
//!
//! These are the dispatcher's (`Server`'s) methods for a session's beginning and end; the only
//! state of its own is how often refused resumes were logged ([`ResumeRefusals`]). It must not
//! poll rings or schedule tasks.

use super::*;

impl Server {
    pub(super) fn hello(
        &mut self,
        id: u64,
        version: u32,
        client_name: String,
        heap_bytes: Option<u64>,
    ) -> Option<Response> {
        if version != PROTOCOL_VERSION {
            return Some(Response::Error(ControlError::VersionMismatch {
                daemon: PROTOCOL_VERSION,
                client: version,
            }));
        }
        let who = self.credentials(id)?;
        let job_quota = match self.session_job(&who) {
            Ok(job) => job.and_then(|job| job.heap_quota),
            Err(refusal) => return Some(Response::Error(refusal)),
        };
        let heap = heap_bytes
            .unwrap_or(self.config.session_quota)
            .min(self.config.session_quota)
            .min(job_quota.unwrap_or(u64::MAX));
        let uid = who.uid;
        if let Err(refusal) = self.books.may_open_session(uid, heap) {
            return Some(Response::Error(refusal));
        }
        let capacity = self.config.ring_capacity;
        // The error, and the OS's error number when a system call failed.
        let opened = (|| -> Result<(Segment, Doorbell, Geometry), (String, Option<i32>)> {
            let os = |e: agora_transport::TransportError| {
                let code = match &e {
                    agora_transport::TransportError::Os { cause, .. } => cause.raw_os_error(),
                    _ => None,
                };
                (e.to_string(), code)
            };
            let geometry = Geometry::new(capacity, capacity, heap).map_err(|e| (e.to_string(), None))?;
            let segment = Segment::create(&format!("agora-session-{id}"), geometry).map_err(os)?;
            let doorbell = Doorbell::new().map_err(os)?;
            Ok((segment, doorbell, geometry))
        })();
        let (segment, doorbell, geometry) = match opened {
            Ok(v) => v,
            Err((e, Some(code)))
                if code == rustix::io::Errno::MFILE.raw_os_error()
                    || code == rustix::io::Errno::NFILE.raw_os_error() =>
            {
                // Out of descriptors: the refusal the accept path gives, naming the limit and
                // how to raise it (it read "bad request: ... Too many open files").
                tracing::error!(error = %e, "could not create a session segment: out of file descriptors");
                let limit = rustix::process::getrlimit(rustix::process::Resource::Nofile)
                    .current
                    .unwrap_or(u64::MAX);
                return Some(Response::Error(self.books.refuse(
                    Limit::DaemonFiles,
                    uid,
                    limit,
                    limit,
                )));
            }
            Err((e, _)) => {
                tracing::error!(error = %e, "could not create a session segment");
                return Some(Response::Error(ControlError::BadRequest(format!(
                    "the daemon could not create the session: {e}"
                ))));
            }
        };
        let Some(Conn::Pending {
            stream,
            reader,
            credentials,
        }) = self.conns.remove(&id)
        else {
            return None;
        };
        let welcome = Response::Welcome {
            session: id,
            submission_capacity: geometry.submission_capacity,
            completion_capacity: geometry.completion_capacity,
            heap_len: geometry.heap_len,
        };
        if let Err(e) = send_with_fds(&stream, &welcome, &[segment.fd(), doorbell.fd()]) {
            tracing::warn!(error = %e, "client left during hello");
            let _ = epoll::delete(&self.epoll, &stream);
            self.books.disconnect(credentials.uid, id);
            self.buckets.remove(&id);
            self.owed.remove(&id);
            return None;
        }
        Self::watch_doorbell(&self.epoll, id, &doorbell);
        let session = self.new_session(id, credentials, client_name, stream, reader, doorbell, segment);
        tracing::info!(session = id, pid = session.credentials.pid, uid = session.credentials.uid, name = %session.name, heap, "session opened");
        self.admit_session(session);
        None
    }

    /// A session of connection `id` (named `pid…` when the client gave no name), with this
    /// daemon's per-session limits.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn new_session(
        &self,
        id: u64,
        credentials: Credentials,
        client_name: String,
        stream: Arc<UnixStream>,
        reader: FrameReader,
        doorbell: Doorbell,
        segment: Segment,
    ) -> Session {
        let name = session_name(&client_name, credentials.pid);
        Session::new(
            id,
            credentials,
            name,
            stream,
            reader,
            doorbell,
            segment,
            self.config.max_queues,
            self.config.max_buffers,
            self.config.session_lane_work.as_nanos().min(u128::from(u64::MAX)) as u64,
        )
    }

    /// Counts a new (or resumed) session against its uid and in the metrics, and serves it.
    pub(super) fn admit_session(&mut self, mut session: Session) {
        if let Ok(Some(job)) = self.session_job(&session.credentials) {
            session.job = Some(job.job);
            session.job_latency = job.latency;
            if let Some(quota) = job.device_quota.filter(|q| *q > 0) {
                // The daemon's quota, when it has one, still bounds the job's.
                let quota = match self.config.device_quota {
                    0 => quota,
                    daemon => quota.min(daemon),
                };
                session
                    .shared
                    .device_quota
                    .store(quota, std::sync::atomic::Ordering::Relaxed);
            }
            // All the job's sessions are one group of the lanes' tenants, weighted by its shares,
            // and share one fair share of each device's memory.
            session
                .shared
                .join_group(crate::session::JOB_GROUP | job.job, job.shares);
            let job = job.job;
            self.job_session_opened(job);
            tracing::info!(session = session.id, job, "session joins its Slurm job");
        }
        let geometry = *session.shared.segment.view().geometry();
        self.books
            .session_opened(session.credentials.uid, session.id, geometry.heap_len);
        self.sessions_opened += 1;
        self.telemetry.metrics.sessions_opened.inc();
        self.telemetry.metrics.sessions.inc();
        self.conns.insert(session.id, Conn::Session(Box::new(session)));
    }

    /// Wakes the loop when session `id`'s client rings its doorbell.
    pub(super) fn watch_doorbell(epoll: &OwnedFd, id: u64, doorbell: &Doorbell) {
        if let Err(e) = epoll::add(
            epoll,
            doorbell.fd(),
            epoll::EventData::new_u64(Token::Doorbell(id).encode()),
            epoll::EventFlags::IN,
        ) {
            tracing::warn!(error = %e, "could not watch a doorbell");
        }
    }

    /// `Request::Resume`: a client whose previous daemon died hands back its segment and names
    /// its buffers, queues and kernels. Everything is checked as untrusted input (the segment's
    /// seals and size, every heap range, every handle, every queue as `CreateQueue` would); a
    /// refusal leaves the connection pending, as a refused hello does, and is logged
    /// ([`ResumeRefusals`]). The session is opened at once but answered (and its doorbell
    /// watched) only after the last part.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn resume(
        &mut self,
        id: u64,
        version: u32,
        client_name: String,
        previous_session: u64,
        geometry: Result<Geometry, agora_protocol::segment::GeometryError>,
        kernels: Vec<String>,
        first_part: (Vec<ResumedBuffer>, Vec<ResumedQueue>, bool),
    ) -> Option<Response> {
        let who = self.credentials(id)?;
        let name = session_name(&client_name, who.pid);
        match self.open_resumed(id, version, client_name, previous_session, geometry, kernels)? {
            Ok(()) => {
                let (buffers, queues, more) = first_part;
                self.resume_more(id, buffers, queues, more)
            }
            Err(refusal) => {
                self.resume_refusals.log(id, who.uid, &name, &refusal);
                Some(Response::Error(refusal))
            }
        }
    }

    /// The checks of a resume before its first part, and the session they open: `Err` with the
    /// refusal, `None` when the connection is gone.
    fn open_resumed(
        &mut self,
        id: u64,
        version: u32,
        client_name: String,
        previous_session: u64,
        geometry: Result<Geometry, agora_protocol::segment::GeometryError>,
        kernels: Vec<String>,
    ) -> Option<Result<(), ControlError>> {
        let refuse = |why: String| {
            Some(Err(ControlError::BadRequest(format!(
                "cannot resume the session: {why}"
            ))))
        };
        if version != PROTOCOL_VERSION {
            return Some(Err(ControlError::VersionMismatch {
                daemon: PROTOCOL_VERSION,
                client: version,
            }));
        }
        if let Err(refusal) = self.session_job(&self.credentials(id)?) {
            return Some(Err(refusal));
        }
        let fds = match self.conns.get_mut(&id)? {
            Conn::Pending { reader, .. } => reader.take_fds(),
            _ => return None,
        };
        let geometry = match geometry {
            Ok(g) => g,
            Err(e) => return refuse(e.to_string()),
        };
        if geometry.heap_len > self.config.session_quota {
            return refuse(format!(
                "its heap is {} bytes, more than this daemon's session quota of {} bytes (agora serve --session-quota)",
                geometry.heap_len, self.config.session_quota
            ));
        }
        if kernels.len() > MAX_RESUMED_KERNELS || kernels.iter().any(|k| k.len() > MAX_NAME) {
            return refuse(format!(
                "at most {MAX_RESUMED_KERNELS} kernel names of at most {MAX_NAME} bytes"
            ));
        }
        let mut fds = fds.into_iter();
        let (Some(segment_fd), None) = (fds.next(), fds.next()) else {
            return refuse("send exactly one descriptor, the segment's memfd, with the request".into());
        };
        let credentials = self.credentials(id)?;
        if let Err(refusal) = self.books.may_open_session(credentials.uid, geometry.heap_len) {
            return Some(Err(refusal));
        }
        let identity = crate::session::segment_identity(segment_fd.as_fd());
        let holder = self
            .every_session()
            .find(|s| s.segment_identity == identity)
            .map(|s| s.id);
        if let Some(session) = holder {
            return Some(Err(ControlError::SegmentInUse { session }));
        }
        let segment = match Segment::adopt(segment_fd, geometry) {
            Ok(s) => s,
            Err(e) => return refuse(e.to_string()),
        };
        let doorbell = match Doorbell::new() {
            Ok(d) => d,
            Err(e) => return refuse(format!("the daemon could not create a doorbell: {e}")),
        };
        let table = self.scheduler.kernels.snapshot();
        let kernel_ids: Vec<Option<u32>> = kernels.iter().map(|name| table.find(name).map(|(k, _)| k)).collect();
        drop(table);
        let Some(Conn::Pending { stream, reader, .. }) = self.conns.remove(&id) else {
            return None;
        };
        let mut session = self.new_session(id, credentials, client_name, stream, reader, doorbell, segment);
        session.take_over_rings();
        session.resuming = Some(kernel_ids);
        tracing::info!(
            session = id,
            previous_session,
            pid = session.credentials.pid,
            uid = session.credentials.uid,
            name = %session.name,
            "session resuming after a daemon restart"
        );
        self.admit_session(session);
        Some(Ok(()))
    }

    /// One part of a resume (the first comes with `Request::Resume`): registers its buffers and
    /// queues; after the last, answers with the new doorbell. A part that fails a check ends the
    /// connection with the reason: a half-resumed session is no use to anyone.
    pub(super) fn resume_more(
        &mut self,
        id: u64,
        buffers: Vec<ResumedBuffer>,
        queues: Vec<ResumedQueue>,
        more: bool,
    ) -> Option<Response> {
        let config = self.config.clone();
        let Some(Conn::Session(session)) = self.conns.get_mut(&id) else {
            return Some(Response::Error(ControlError::BadRequest(
                "ResumeMore continues a Resume; send Resume first".into(),
            )));
        };
        if session.resuming.is_none() {
            return Some(Response::Error(ControlError::BadRequest(
                "this session is not resuming".into(),
            )));
        }
        let mut failure = None;
        let any_lost = buffers.iter().any(|b| b.lost);
        for b in &buffers {
            if let Err(why) = session.resume_buffer(b.handle, b.offset, b.len, b.lost) {
                failure = Some(why);
                break;
            }
        }
        if failure.is_none() {
            for q in queues {
                let handle = q.handle;
                match create_queue(
                    &config,
                    session,
                    q.name,
                    q.class,
                    q.preferred_device,
                    q.sla_ms,
                    Some(handle),
                ) {
                    Response::Queue { .. } => {}
                    Response::Error(e) => {
                        failure = Some(format!("queue {handle:#x}: {e}"));
                        break;
                    }
                    other => {
                        failure = Some(format!("queue {handle:#x}: {other:?}"));
                        break;
                    }
                }
            }
        }
        if any_lost {
            self.scheduler.buffers_lost_elsewhere();
        }
        if let Some(why) = failure {
            let refusal = ControlError::BadRequest(format!("cannot resume the session: {why}"));
            self.resume_refusals
                .log(id, session.credentials.uid, &session.name, &refusal);
            let _ = send_whole(&session.stream, &Response::Error(refusal), Duration::ZERO);
            self.close(id);
            return None;
        }
        if more {
            return None;
        }
        let kernels = session.resuming.take().unwrap_or_default();
        let reply = Response::Resumed { session: id, kernels };
        if let Err(e) = send_with_fds(&session.stream, &reply, &[session.doorbell.fd()]) {
            tracing::warn!(error = %e, "client left during its resume");
            self.close(id);
            return None;
        }
        Self::watch_doorbell(&self.epoll, id, &session.doorbell);
        tracing::info!(
            session = id,
            buffers = session.buffers.len(),
            queues = session.queues.len(),
            "session resumed"
        );
        None
    }

    /// Ends a connection; a session's running jobs finish (queued ones are cancelled) before its
    /// memory is reclaimed.
    pub(super) fn close(&mut self, id: u64) {
        self.owed.remove(&id);
        self.buckets.remove(&id);
        let Some(conn) = self.conns.remove(&id) else {
            return;
        };
        let uid = match &conn {
            Conn::Pending { credentials, .. } | Conn::Observer { credentials, .. } => credentials.uid,
            Conn::Session(s) => s.credentials.uid,
        };
        self.books.disconnect(uid, id);
        let _ = epoll::delete(&self.epoll, conn.stream());
        if let Conn::Session(session) = conn {
            // Before its connection closes: a client that is still there (a session ended for
            // a corrupt ring) learns it must not resume the session.
            session.shared.end();
            let _ = epoll::delete(&self.epoll, session.doorbell.fd());
            self.scheduler.migration.forget_session(id);
            self.exports.session_ended(id);
            self.job_session_ended(&session);
            if let Some((service, _)) = &self.realtime {
                let withdrawn = service.session_ended(id);
                if withdrawn > 0 {
                    tracing::info!(session = id, dags = withdrawn, "DAGs withdrawn with their session");
                }
            }
            session.shared.cancelled.store(true, Ordering::Release);
            if let Some(programs) = &session.programs {
                programs.end();
            }
            self.sessions_closed += 1;
            self.telemetry.metrics.sessions.dec();
            tracing::info!(session = id, pid = session.credentials.pid, "session ended");
            if session.shared.in_flight.load(Ordering::Acquire) == 0 {
                self.retire(session);
            } else {
                self.closing.push(session);
            }
        }
    }
}

/// The name of a session whose client named it `client_name` (none: `pid<PID>`).
fn session_name(client_name: &str, pid: i32) -> String {
    if client_name.is_empty() {
        format!("pid{pid}")
    } else {
        client_name.to_string()
    }
}

/// How often a refused resume of one session (uid and name) is logged at WARN at most.
const RESUME_REFUSAL_LOG_EVERY: Duration = Duration::from_secs(60);

/// The most sessions whose refused resumes are remembered for [`RESUME_REFUSAL_LOG_EVERY`].
const RESUME_REFUSAL_KEYS: usize = 1024;

/// Refused resumes, logged at WARN: an operator who restarted the daemon (an upgrade, a smaller
/// `--session-quota`) otherwise never learns that it cut clients off, since only the clients see
/// the refusal. A client refused for a reason that may pass (the uid's session limit, its
/// segment still held) retries with backoff of at most 100 ms until its reconnect timeout (30 s
/// by default): up to some 300 refusals per session and restart, for every session of the node.
/// So each (uid, session name) logs its first refusal and then at most one line per minute,
/// which counts the refusals left out since (each of those is logged at debug).
#[derive(Debug)]
pub(super) struct ResumeRefusals(KeyedLogGate<(u32, String)>);

impl Default for ResumeRefusals {
    fn default() -> Self {
        ResumeRefusals(KeyedLogGate::new(RESUME_REFUSAL_LOG_EVERY, RESUME_REFUSAL_KEYS))
    }
}

impl ResumeRefusals {
    /// Connection `connection` of `uid` was refused resuming session `name` with `refusal`.
    pub(super) fn log(&mut self, connection: u64, uid: u32, name: &str, refusal: &ControlError) {
        match self.0.allow((uid, name.to_string()), Instant::now()) {
            Some(suppressed) => tracing::warn!(
                connection,
                uid,
                name,
                reason = %refusal,
                repeats_not_logged = suppressed,
                "refused a resume"
            ),
            None => tracing::debug!(connection, uid, name, reason = %refusal, "refused a resume again"),
        }
    }
}
