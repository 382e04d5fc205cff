//! The control thread: control-plane work that must not delay a task (Firecracker keeps its API
//! thread apart from the vCPU loop for the same reason).
//!
//! The dispatcher still reads every control frame (they are small) and answers the requests
//! that change its own state at once (hello, buffers, queues, drain). Everything slow that does
//! not need that state runs here: writing a trace file (500 000 spans serialise in about a
//! second), listing and looking up kernels (the "did you mean" search), and encoding and writing
//! large replies such as a status report, which the dispatcher only snapshots. Later, program
//! builds go here too.
//!
//! Owns: the jobs handed over and a duplicate of each requesting connection's socket, on which
//! it writes the reply. A client waits for each reply before its next request, so replies
//! written here cannot overtake others on the same connection; a client that pipelines
//! requests only reorders its own replies.
//!
//! Must not: touch sessions, queues, buffers, devices or the scheduler. A connection that does
//! not take its reply is shut down here; the dispatcher then sees it hang up and closes it.

use std::os::unix::net::UnixStream;
use std::sync::mpsc;
use std::sync::Arc;
use std::thread::JoinHandle;

use agora_protocol::control::{ControlError, Response};
use agora_transport::socket::send;

use crate::telemetry::Telemetry;

/// A request the control thread answers.
pub(crate) enum ControlJob {
    /// A reply prepared by the dispatcher, to encode and write.
    Reply(Response),
    /// `agora trace save`.
    SaveTrace,
    /// `agora kernels`.
    ListKernels,
    /// `Session::kernel(name)`.
    LookupKernel(String),
}

/// The control thread and its queue of jobs.
pub(crate) struct ControlPlane {
    jobs: Option<mpsc::Sender<(UnixStream, ControlJob)>>,
    thread: Option<JoinHandle<()>>,
}

impl ControlPlane {
    /// Starts the thread.
    pub(crate) fn start(telemetry: Arc<Telemetry>) -> std::io::Result<Self> {
        let (jobs, inbox) = mpsc::channel::<(UnixStream, ControlJob)>();
        let thread = std::thread::Builder::new()
            .name("agora-control".into())
            .spawn(move || {
                for (stream, job) in inbox {
                    let response = answer(&telemetry, job);
                    if let Err(error) = send(&stream, &response) {
                        tracing::warn!(%error, "closing a connection that does not read its replies");
                        let _ = stream.shutdown(std::net::Shutdown::Both);
                    }
                }
            })?;
        Ok(ControlPlane {
            jobs: Some(jobs),
            thread: Some(thread),
        })
    }

    /// Hands `job` over; its reply goes to `stream` (the requesting connection). `false` when
    /// the connection could not be duplicated (then nothing is sent; the caller answers).
    pub(crate) fn submit(&self, stream: &UnixStream, job: ControlJob) -> Result<(), ControlJob> {
        let (Some(jobs), Ok(stream)) = (&self.jobs, stream.try_clone()) else {
            return Err(job);
        };
        jobs.send((stream, job)).map_err(|mpsc::SendError((_, job))| job)
    }
}

impl Drop for ControlPlane {
    fn drop(&mut self) {
        // Closing the channel ends the thread once it has written what it was given.
        self.jobs.take();
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

/// The reply to `job`.
pub(crate) fn answer(telemetry: &Telemetry, job: ControlJob) -> Response {
    match job {
        ControlJob::Reply(response) => response,
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
        ControlJob::ListKernels => Response::Kernels(agora_kernels::library().iter().map(|k| k.signature()).collect()),
        ControlJob::LookupKernel(name) => match agora_kernels::find(&name) {
            Some((kernel_id, k)) => Response::Kernel {
                id: kernel_id,
                signature: k.signature(),
            },
            None => Response::Error(ControlError::UnknownKernel {
                suggestions: agora_kernels::suggestions(&name),
                name,
            }),
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::telemetry::Metrics;
    use agora_transport::socket::recv_with_fds;

    fn telemetry() -> Arc<Telemetry> {
        Arc::new(Telemetry {
            metrics: Metrics::new(),
            trace: None,
        })
    }

    #[test]
    fn jobs_are_answered_on_the_requesting_connection_in_order() {
        let control = ControlPlane::start(telemetry()).unwrap();
        let (daemon_side, client_side) = UnixStream::pair().unwrap();
        assert!(control
            .submit(&daemon_side, ControlJob::LookupKernel("saxpi".into()))
            .is_ok());
        assert!(control.submit(&daemon_side, ControlJob::SaveTrace).is_ok());
        assert!(control.submit(&daemon_side, ControlJob::ListKernels).is_ok());
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
    }
}
