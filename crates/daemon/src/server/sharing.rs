//! The dispatcher's side of export and attach (see [`crate::exports`]): allocating exportable
//! buffers, publishing, revoking and attaching names, and sending the memory descriptors that
//! go with the replies.
//!
//! It must not decide permissions itself: [`crate::exports::Exports`] does.

use super::*;

impl Server {
    /// Sends `response` with `fd` as ancillary data; behind the replies still owed on the
    /// connection (the control thread writes those), through the control thread too, so that
    /// replies keep the order of their requests.
    fn reply_with_memory(&mut self, id: u64, response: Response, fd: std::os::fd::BorrowedFd<'_>) -> Option<Response> {
        if self.owed.get(&id).is_some_and(|o| o.load(Ordering::Acquire) > 0) {
            let owned = match fd.try_clone_to_owned() {
                Ok(owned) => owned,
                Err(e) => {
                    return Some(Response::Error(ControlError::Export(format!(
                        "could not duplicate a memory descriptor for the reply: {e}"
                    ))))
                }
            };
            if self.offload(id, ControlJob::ReplyWithMemory(response, owned)).is_some() {
                tracing::warn!(connection = id, "closing a connection whose reply could not be ordered");
                self.close(id);
            }
            return None;
        }
        let Some(Conn::Session(session)) = self.conns.get(&id) else {
            return None;
        };
        if let Err(e) = send_with_fds(&session.stream, &response, &[fd]) {
            tracing::warn!(connection = id, error = %e, "closing a connection that does not take its reply");
            self.close(id);
        }
        None
    }

    fn is_admin(&self, id: u64) -> bool {
        self.require_admin(id, "").is_ok()
    }

    /// `Request::AllocShared`.
    pub(super) fn alloc_shared(&mut self, id: u64, len: u64) -> Option<Response> {
        if let Err(refusal) = self.check_uid(id, Limit::Buffers) {
            return Some(Response::Error(refusal));
        }
        let allocated = match self.conns.get_mut(&id)? {
            Conn::Session(session) => session.alloc_shared(len),
            _ => {
                return Some(Response::Error(ControlError::BadRequest(
                    "open a session with Hello first".into(),
                )))
            }
        };
        match allocated {
            Ok((handle, region)) => self.reply_with_memory(id, Response::SharedBuffer { handle, len }, region.fd()),
            Err(e) => Some(Response::Error(e)),
        }
    }

    /// `Request::Export`.
    pub(super) fn export(
        &mut self,
        id: u64,
        buffer: u64,
        name: String,
        readers: agora_protocol::control::ExportReaders,
        writable: bool,
    ) -> Option<Response> {
        let exports = &mut self.exports;
        match self.conns.get_mut(&id)? {
            Conn::Session(session) => Some(match exports.export(session, buffer, name.clone(), readers, writable) {
                Ok(()) => Response::Exported {
                    name,
                    attachers: Vec::new(),
                },
                Err(e) => Response::Error(e),
            }),
            _ => Some(Response::Error(ControlError::BadRequest(
                "open a session with Hello first".into(),
            ))),
        }
    }

    /// `Request::Revoke`.
    pub(super) fn revoke(&mut self, id: u64, name: String) -> Option<Response> {
        let admin = self.is_admin(id);
        let credentials = self.credentials(id)?;
        Some(match self.exports.revoke(id, &credentials, admin, &name) {
            Ok(attachers) => Response::Exported { name, attachers },
            Err(e) => Response::Error(e),
        })
    }

    /// `Request::Attach`.
    pub(super) fn attach(&mut self, id: u64, name: String, writable: bool) -> Option<Response> {
        if let Err(refusal) = self.check_uid(id, Limit::Buffers) {
            return Some(Response::Error(refusal));
        }
        let admin = self.is_admin(id);
        let exports = &mut self.exports;
        let attached = match self.conns.get_mut(&id)? {
            Conn::Session(session) => exports.attach(session, &name, writable, admin),
            _ => {
                return Some(Response::Error(ControlError::BadRequest(
                    "open a session with Hello first".into(),
                )))
            }
        };
        match attached {
            Ok(attached) => {
                let reply = Response::Attached {
                    handle: attached.handle,
                    len: attached.len,
                    writable: attached.writable,
                    exporter: attached.exporter,
                };
                self.reply_with_memory(id, reply, attached.fd.as_fd())
            }
            Err(e) => Some(Response::Error(e)),
        }
    }

    /// `Request::Exports`: any connection may ask; it sees its user's.
    pub(super) fn list_exports(&mut self, id: u64) -> Option<Response> {
        self.observe(id);
        let admin = self.is_admin(id);
        let credentials = self.credentials(id)?;
        Some(Response::Exports(self.exports.list(&credentials, admin)))
    }
}
