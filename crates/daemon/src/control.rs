//! The control thread: control-plane work that must not delay a task (Firecracker keeps its API
//! thread apart from the vCPU loop for the same reason).
//!
//! The dispatcher still reads every control frame (they are small) and answers the requests
//! that change its own state at once (hello, buffers, queues, drain). Everything slow that does
//! not need that state runs here: writing a trace file (500 000 spans serialise in about a
//! second), listing and looking up kernels (the "did you mean" search), and encoding and writing
//! large replies such as a status report, which the dispatcher only snapshots, and tenant
//! program builds.
//!
//! A build takes 100 ms to a second (or, for a hostile source, up to the build limit), so it
//! does not run here either: this thread starts a builder thread for it, which sends the reply
//! back here when done. Meanwhile this thread goes on serving other connections; jobs of the
//! building connection wait, in order, until the build's reply is written (a connection has at
//! most one build at a time, and its replies keep their order).
//!
//! Owns: the jobs handed over and a duplicate of each requesting connection's socket, on which
//! it writes the reply. Replies leave in request order on each connection: while a
//! connection has replies owed here ([`Owed`]), the dispatcher hands its own replies for that
//! connection over too instead of writing them. A client whose call timed out can therefore
//! skip the late reply by counting.
//!
//! Every reply fits in a frame: one that would not (a bug, as requests and status pages are
//! bounded) is replaced by an error saying so, never dropped.
//!
//! Must not: touch sessions, queues, buffers, devices or the scheduler. A connection that does
//! not take its reply is shut down here; the dispatcher then sees it hang up and closes it.

use std::os::unix::net::UnixStream;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::mpsc;
use std::sync::Arc;
use std::thread::JoinHandle;

use agora_protocol::control::{ControlError, Response};
use agora_transport::socket::send_before;

use crate::kernels::KernelRegistry;
use crate::telemetry::Telemetry;

/// A request the control thread answers.
pub(crate) enum ControlJob {
    /// A reply prepared by the dispatcher, to encode and write.
    Reply(Response),
    /// A reply that carries a memory descriptor (an exportable or attached buffer's region),
    /// queued behind the replies owed on its connection.
    ReplyWithMemory(Response, std::os::fd::OwnedFd),
    /// `agora trace save`.
    SaveTrace,
    /// `agora kernels`.
    ListKernels,
    /// `Session::kernel(name)`; with it whether one of the asking session's programs defines a
    /// kernel of that name (said when no installed kernel has it).
    LookupKernel { name: String, in_own_program: bool },
    /// `agora kernels` (with packages and implementations).
    KernelCatalog,
    /// `agora kernels reload` (admin; the dispatcher checked the caller).
    ReloadKernels,
    /// `session.program(...)`: a build on a builder thread (the dispatcher checked the caller,
    /// and the size; the builder counts the session's programs).
    BuildProgram(Box<crate::programs::BuildJob>),
    /// `session.recover()`: a checkpoint read back into the protected buffers.
    Recover(Box<crate::checkpoint::RecoverJob>),
    /// `session.checkpoints()`.
    Checkpoints(Arc<crate::checkpoint::Checkpoints>, agora_checkpoint::AppKey),
}

/// What reaches the control thread.
enum Message {
    /// A job and the connection it answers.
    Job(Arc<UnixStream>, ControlJob, Owed),
    /// A builder thread's reply for the connection whose `Owed` has this address.
    Built(usize, Response),
    /// The daemon is stopping: end after the jobs before this one.
    Stop,
}

/// A connection waiting for its build: where the reply goes, and its later jobs in order.
struct Waiting {
    stream: Arc<UnixStream>,
    owed: Owed,
    later: std::collections::VecDeque<(Arc<UnixStream>, ControlJob, Owed)>,
}

/// The identity of a connection: the address of its `Owed` counter.
fn connection(owed: &Owed) -> usize {
    Arc::as_ptr(owed) as usize
}

/// What the control thread may read: the telemetry and the kernel registry.
pub(crate) struct ControlContext {
    pub(crate) telemetry: Arc<Telemetry>,
    pub(crate) kernels: Arc<KernelRegistry>,
}

/// Replies to one connection handed to the control thread and not yet written.
pub(crate) type Owed = Arc<AtomicUsize>;

/// The control thread and its queue of jobs.
pub(crate) struct ControlPlane {
    jobs: Option<mpsc::Sender<Message>>,
    thread: Option<JoinHandle<()>>,
}

/// How much the control thread lowers its OS priority (nice), below the dispatcher's.
const CONTROL_NICE: i32 = 19;

impl ControlPlane {
    /// Starts the thread.
    pub(crate) fn start(context: ControlContext) -> std::io::Result<Self> {
        let (jobs, inbox) = mpsc::channel::<Message>();
        let builders = jobs.clone();
        let thread = std::thread::Builder::new()
            .name("agora-control".into())
            .spawn(move || {
                // Slow requests (a trace of 500 000 spans, a status of 1 000 sessions, a program
                // build) must not take a core from the dispatcher and the lanes either: measured
                // on 2 cores (scripts/measure-control-loop.sh), trace saves every 0.2 s at the
                // default priority raised the round-trip p50 of a neighbour ~7x. Lowering its own
                // priority needs no privilege; the build threads it starts inherit it.
                if let Err(error) = agora_devices::priority::renice_current_thread(CONTROL_NICE) {
                    tracing::debug!(%error, "the control thread keeps its priority");
                }
                serve(&context, &inbox, &builders)
            })?;
        Ok(ControlPlane {
            jobs: Some(jobs),
            thread: Some(thread),
        })
    }

    /// Hands `job` over; its reply goes to `stream` (the requesting connection), and `owed`
    /// (that connection's count) is one more until it is written. `Err` when the connection
    /// could not be duplicated (then nothing is sent and `owed` is unchanged; the caller
    /// answers).
    /// The connection is shared, not duplicated: a `dup` needs a descriptor, and a daemon out
    /// of descriptors could then not keep a reply in order behind one the control thread owes
    /// (it closed the connection instead, ending a tenant's session).
    pub(crate) fn submit(&self, stream: &Arc<UnixStream>, job: ControlJob, owed: &Owed) -> Result<(), ControlJob> {
        let Some(jobs) = &self.jobs else {
            return Err(job);
        };
        let stream = stream.clone();
        owed.fetch_add(1, Ordering::AcqRel);
        jobs.send(Message::Job(stream, job, owed.clone()))
            .map_err(|mpsc::SendError(message)| match message {
                Message::Job(_, job, owed) => {
                    owed.fetch_sub(1, Ordering::AcqRel);
                    job
                }
                _ => unreachable!("only jobs are sent here"),
            })
    }
}

impl Drop for ControlPlane {
    fn drop(&mut self) {
        // Ends the thread once it has written what it was given (builds still running are
        // abandoned: their connections are closing with the daemon).
        if let Some(jobs) = self.jobs.take() {
            let _ = jobs.send(Message::Stop);
        }
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

/// The control thread's loop.
fn serve(context: &ControlContext, inbox: &mpsc::Receiver<Message>, builders: &mpsc::Sender<Message>) {
    let mut waiting: std::collections::HashMap<usize, Waiting> = std::collections::HashMap::new();
    for message in inbox {
        match message {
            Message::Stop => return,
            Message::Job(stream, job, owed) => {
                if let Some(w) = waiting.get_mut(&connection(&owed)) {
                    w.later.push_back((stream, job, owed));
                    continue;
                }
                if let Some(w) = run(context, stream, job, owed, builders) {
                    waiting.insert(connection(&w.owed), w);
                }
            }
            Message::Built(key, response) => {
                let Some(mut w) = waiting.remove(&key) else { continue };
                write(&w.stream, &response, &w.owed);
                // The connection's jobs that waited, in order, until one starts a build again.
                while let Some((stream, job, owed)) = w.later.pop_front() {
                    if let Some(mut again) = run(context, stream, job, owed, builders) {
                        again.later = std::mem::take(&mut w.later);
                        waiting.insert(key, again);
                        break;
                    }
                }
            }
        }
    }
}

/// Answers `job` on `stream`, or starts its build and returns what waits for it.
fn run(
    context: &ControlContext,
    stream: Arc<UnixStream>,
    job: ControlJob,
    owed: Owed,
    builders: &mpsc::Sender<Message>,
) -> Option<Waiting> {
    let build = match job {
        ControlJob::BuildProgram(build) => build,
        ControlJob::ReplyWithMemory(response, fd) => {
            use std::os::fd::AsFd;
            // Small, and the client waits for it: sent whole or the connection is shut down.
            if let Err(error) = agora_transport::socket::send_with_fds(&stream, &response, &[fd.as_fd()]) {
                tracing::warn!(%error, "closing a connection that does not take a reply carrying memory");
                let _ = stream.shutdown(std::net::Shutdown::Both);
            }
            owed.fetch_sub(1, Ordering::AcqRel);
            return None;
        }
        job => {
            let response = answer(context, job);
            write(&stream, &response, &owed);
            return None;
        }
    };
    let key = connection(&owed);
    let reply = builders.clone();
    let started = std::thread::Builder::new().name("agora-build".into()).spawn(move || {
        let response = crate::programs::build(*build);
        let _ = reply.send(Message::Built(key, response));
    });
    match started {
        Ok(_) => Some(Waiting {
            stream,
            owed,
            later: Default::default(),
        }),
        Err(e) => {
            let response = Response::Error(ControlError::BadRequest(format!(
                "the daemon could not start a build: {e}"
            )));
            write(&stream, &response, &owed);
            None
        }
    }
}

/// Writes a reply and counts it paid; a connection that does not take it is shut down.
fn write(stream: &UnixStream, response: &Response, owed: &Owed) {
    if let Err(error) = send_whole(stream, response, REPLY_WAIT) {
        tracing::warn!(%error, "closing a connection that does not read its replies");
        let _ = stream.shutdown(std::net::Shutdown::Both);
    }
    owed.fetch_sub(1, Ordering::AcqRel);
}

/// Longest a reply written here may wait for its client to take it (a reply larger than the
/// socket's buffer is written as the client reads); a client that takes longer is disconnected.
pub(crate) const REPLY_WAIT: std::time::Duration = std::time::Duration::from_secs(2);

/// Sends `response`, waiting at most `wait` for the client to take it (the dispatcher, which
/// must not block, gives zero); or, should it not fit in a frame, an error that says so (the
/// client then learns what happened instead of waiting for a reply that never comes).
pub(crate) fn send_whole(
    stream: &UnixStream,
    response: &Response,
    wait: std::time::Duration,
) -> Result<(), agora_transport::TransportError> {
    let send = |response: &Response| send_before(stream, response, std::time::Instant::now() + wait);
    match send(response) {
        Err(agora_transport::TransportError::TooLarge(len)) => {
            tracing::error!(
                len,
                "a reply did not fit in a frame; sending an error instead (a bug: replies are bounded)"
            );
            send(&Response::Error(ControlError::BadRequest(format!(
                "the reply ({len} bytes) exceeds the control frame limit; please report this as a bug"
            ))))
        }
        other => other,
    }
}

/// The reply to `job`.
pub(crate) fn answer(context: &ControlContext, job: ControlJob) -> Response {
    let telemetry = &context.telemetry;
    match job {
        ControlJob::Reply(response) => response,
        // Sent by `run` with its descriptor; never answered here.
        ControlJob::ReplyWithMemory(response, _) => response,
        ControlJob::SaveTrace => match &telemetry.trace {
            None => Response::Error(ControlError::BadRequest(
                "tracing is off: start the daemon with --trace FILE".into(),
            )),
            Some(trace) => match trace.save() {
                Ok((path, spans)) => Response::TraceSaved {
                    path: path.display().to_string(),
                    spans,
                },
                Err(e) => Response::Error(ControlError::BadRequest(format!("could not write the trace: {e}"))),
            },
        },
        ControlJob::Recover(job) => job.run(),
        ControlJob::Checkpoints(service, app) => Response::Checkpoints(service.report(&app)),
        ControlJob::ListKernels => {
            let table = context.kernels.snapshot();
            Response::Kernels(table.current().into_iter().map(|(_, k)| k.signature()).collect())
        }
        ControlJob::LookupKernel { name, in_own_program } => {
            let table = context.kernels.snapshot();
            match table.find(&name) {
                Some((kernel_id, k)) => Response::Kernel {
                    id: kernel_id,
                    signature: k.signature(),
                },
                None if in_own_program => Response::Error(ControlError::ProgramKernelByName { name }),
                None => Response::Error(ControlError::UnknownKernel {
                    suggestions: table.suggestions(&name),
                    name,
                }),
            }
        }
        ControlJob::KernelCatalog => {
            let (kernels, packages) = context.kernels.snapshot().listing();
            Response::KernelCatalog { kernels, packages }
        }
        ControlJob::ReloadKernels => {
            let report = context.kernels.reload();
            for error in &report.errors {
                tracing::warn!(%error, "kernel package reload");
            }
            tracing::info!(
                packages = report.packages.len(),
                changed = report.changed.len(),
                kernels = report.kernels,
                "kernel packages reloaded"
            );
            Response::KernelsReloaded(report)
        }
        // Builds run on builder threads (see `run`); reaching here means none could start.
        ControlJob::BuildProgram(_) => {
            Response::Error(ControlError::BadRequest("the daemon could not start the build".into()))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::telemetry::Metrics;
    use agora_transport::socket::recv_with_fds;

    fn telemetry() -> ControlContext {
        ControlContext {
            telemetry: Arc::new(Telemetry {
                metrics: Metrics::new(),
                trace: None,
            }),
            kernels: Arc::new(KernelRegistry::library_only()),
        }
    }

    #[test]
    fn jobs_are_answered_on_the_requesting_connection_in_order() {
        let control = ControlPlane::start(telemetry()).unwrap();
        let (daemon_side, client_side) = UnixStream::pair().unwrap();
        let daemon_side = Arc::new(daemon_side);
        let owed = Owed::default();
        assert!(control
            .submit(
                &daemon_side,
                ControlJob::LookupKernel {
                    name: "saxpi".into(),
                    in_own_program: false
                },
                &owed
            )
            .is_ok());
        assert!(control.submit(&daemon_side, ControlJob::SaveTrace, &owed).is_ok());
        assert!(control.submit(&daemon_side, ControlJob::ListKernels, &owed).is_ok());
        let (first, _) = recv_with_fds::<Response>(&client_side).unwrap();
        match first {
            Response::Error(ControlError::UnknownKernel { name, suggestions }) => {
                assert_eq!(name, "saxpi");
                assert!(suggestions.iter().any(|s| s == "saxpy"));
            }
            other => panic!("{other:?}"),
        }
        let (second, _) = recv_with_fds::<Response>(&client_side).unwrap();
        assert!(matches!(second, Response::Error(ControlError::BadRequest(m)) if m.contains("--trace")));
        let (third, _) = recv_with_fds::<Response>(&client_side).unwrap();
        assert!(matches!(third, Response::Kernels(k) if k.iter().any(|s| s.name == "saxpy")));
        drop(control); // joins the thread: every job is written
        assert_eq!(owed.load(Ordering::Acquire), 0);
    }

    /// A build runs on a builder thread; the connection's later job is answered after it, in
    /// request order.
    #[test]
    fn a_build_and_the_jobs_after_it_are_answered_in_order() {
        let control = ControlPlane::start(telemetry()).unwrap();
        let (daemon_side, client_side) = UnixStream::pair().unwrap();
        let daemon_side = Arc::new(daemon_side);
        let owed = Owed::default();
        let geometry = agora_protocol::segment::Geometry::new(2, 2, 4096).unwrap();
        let segment = agora_transport::shm::Segment::create("control-test", geometry).unwrap();
        let config = crate::DaemonConfig {
            program_executor: Some("/nonexistent/agora".into()),
            ..Default::default()
        };
        let programs = crate::programs::SessionPrograms::new(
            &config,
            1,
            &segment,
            crate::session::Credentials::default(),
            Default::default(),
        )
        .unwrap();
        let job = crate::programs::BuildJob {
            programs: Arc::new(programs),
            cache: Arc::new(crate::programs::ProgramCache::new(
                std::path::Path::new("/nonexistent"),
                0,
            )),
            language: "opencl".into(),
            code: b"__kernel void k(__global float *y) {}".to_vec(),
            manifest: None,
            name: "p".into(),
            max_programs: 64,
            in_daemon: false,
            on_gpus: false,
            devices: Vec::new(),
        };
        assert!(control
            .submit(&daemon_side, ControlJob::BuildProgram(Box::new(job)), &owed)
            .is_ok());
        assert!(control.submit(&daemon_side, ControlJob::ListKernels, &owed).is_ok());
        let (first, _) = recv_with_fds::<Response>(&client_side).unwrap();
        assert!(
            matches!(&first, Response::Error(ControlError::BadRequest(m)) if m.contains("/nonexistent/agora")),
            "{first:?}"
        );
        let (second, _) = recv_with_fds::<Response>(&client_side).unwrap();
        assert!(matches!(second, Response::Kernels(_)), "{second:?}");
        drop(control);
        assert_eq!(owed.load(Ordering::Acquire), 0);
    }

    #[test]
    fn a_reply_too_large_for_a_frame_becomes_an_error() {
        let control = ControlPlane::start(telemetry()).unwrap();
        let (daemon_side, client_side) = UnixStream::pair().unwrap();
        let daemon_side = Arc::new(daemon_side);
        let huge = Response::Error(ControlError::BadRequest(
            "x".repeat(agora_protocol::control::MAX_FRAME as usize),
        ));
        assert!(control
            .submit(&daemon_side, ControlJob::Reply(huge), &Owed::default())
            .is_ok());
        let (reply, _) = recv_with_fds::<Response>(&client_side).unwrap();
        assert!(
            matches!(&reply, Response::Error(ControlError::BadRequest(m)) if m.contains("frame limit")),
            "{reply:?}"
        );
    }
}
