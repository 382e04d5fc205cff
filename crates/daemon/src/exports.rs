//! Export and attach (XEMEM's model): named buffers that other sessions map, zero-copy.
//!
//! An *exportable* buffer's host copy is a memory region of its own (a sealed memfd of exactly
//! its length, `agora_transport::shm::Region`), not a range of its session's heap: the segment
//! also holds the session's rings and other buffers, so it is never handed to another process.
//! [`Exports`] is the daemon's name server: `Export` publishes a buffer under a name with an
//! access list, `Attach` gives the attaching session a handle to **the same buffer record**
//! (one placement: where its newest contents are, its device copies, and the device memory it
//! holds, charged to the exporter) and the region's memfd, read-only unless the export allows
//! writers. `Revoke`, the exporter releasing the buffer, and the exporter's session ending all
//! withdraw the name and mark every attachment revoked: the attachers' tasks on it then fail
//! with `TaskError::Attachment`, while the memory they mapped stays valid until they drop it
//! (the region lives while anyone maps it), so no process is ever left with a dangling mapping.
//!
//! Read-only attachments hold against a hostile attacher: the daemon seals the region against
//! new writable mappings (`F_SEAL_FUTURE_WRITE`) before a read-only export is published, and
//! refuses tasks of a read-only attacher that write the buffer ([`SessionSharing::check`]).
//!
//! Runs on the dispatcher thread (the server calls it); must not launch work or touch devices.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Weak};

use agora_protocol::completion::{ATTACHMENT_READ_ONLY, ATTACHMENT_REVOKED};
use agora_protocol::control::{ControlError, ExportReaders, ExportStatus, MAX_EXPORT_READERS, MAX_NAME};
use agora_protocol::TaskError;
use agora_transport::shm::Region;

use crate::memory::BufferRecord;
use crate::session::{Credentials, Session};

/// Most names one session exports at a time.
pub(crate) const MAX_EXPORTS_PER_SESSION: usize = 64;
/// Most names the daemon holds at a time.
pub(crate) const MAX_EXPORTS: usize = 4096;

/// One attachment of a session to an export.
#[derive(Debug)]
pub(crate) struct Attachment {
    writable: bool,
    /// The export's flag: set when it is revoked or its exporter ends.
    revoked: Arc<AtomicBool>,
}

/// What one session's exportable buffers and attachments hold.
#[derive(Debug)]
pub(crate) struct SessionSharing {
    /// Bytes of regions this session may hold (its own exportable buffers plus attachments):
    /// its heap quota again, so a session holds at most twice its quota in host memory.
    limit: u64,
    used: u64,
    /// Its buffers exported now: handle → (name, the export's revoked flag).
    exported: HashMap<u64, (String, Arc<AtomicBool>)>,
    /// Its attachments: handle → attachment.
    attached: HashMap<u64, Arc<Attachment>>,
}

impl SessionSharing {
    pub(crate) fn new(limit: u64) -> Self {
        SessionSharing {
            limit,
            used: 0,
            exported: HashMap::new(),
            attached: HashMap::new(),
        }
    }

    /// Counts `len` more bytes against the limit, or says why not.
    pub(crate) fn reserve(&mut self, len: u64) -> Result<(), ControlError> {
        let available = self.limit.saturating_sub(self.used);
        if len > available {
            return Err(ControlError::Export(format!(
                "this session's exportable and attached buffers would hold {} bytes; its limit is {} (its heap quota): release some first",
                self.used.saturating_add(len),
                self.limit
            )));
        }
        self.used += len;
        Ok(())
    }

    pub(crate) fn give_back(&mut self, len: u64) {
        self.used = self.used.saturating_sub(len);
    }

    /// Buffer `handle` (an exportable one or an attachment) was released: its bytes come back,
    /// its export ends, its attachment goes.
    pub(crate) fn released(&mut self, handle: u64, len: u64) {
        self.give_back(len);
        if let Some((_, revoked)) = self.exported.remove(&handle) {
            revoked.store(true, Ordering::Release);
        }
        self.attached.remove(&handle);
    }

    /// Whether buffer `handle` is attached read-only (recovering a checkpoint into it would
    /// write the exporter's memory, so it cannot be protected).
    pub(crate) fn is_read_only_attachment(&self, handle: u64) -> bool {
        self.attached.get(&handle).is_some_and(|a| !a.writable)
    }

    /// Whether a task may use buffer `handle` as argument `index` (`writes`: it writes it).
    pub(crate) fn check(&self, index: usize, handle: u64, writes: bool) -> Result<(), TaskError> {
        if self.attached.is_empty() {
            return Ok(());
        }
        let Some(attachment) = self.attached.get(&handle) else {
            return Ok(());
        };
        let reason = if attachment.revoked.load(Ordering::Acquire) {
            ATTACHMENT_REVOKED
        } else if writes && !attachment.writable {
            ATTACHMENT_READ_ONLY
        } else {
            return Ok(());
        };
        Err(TaskError::Attachment {
            index: index as u16,
            handle,
            reason,
        })
    }
}

/// One published name.
#[derive(Debug)]
struct Export {
    session: u64,
    client: String,
    uid: u32,
    record: Arc<BufferRecord>,
    region: Arc<Region>,
    readers: ExportReaders,
    writable: bool,
    revoked: Arc<AtomicBool>,
    attachments: Vec<(u64, Weak<Attachment>)>,
    attaches: u64,
}

impl Export {
    /// Whether `who` may attach it: an administrator, the exporter's own uid, a listed uid, or
    /// a member (by primary gid or a supplementary group) of a listed group.
    fn may_attach(&self, who: &Credentials, admin: bool) -> bool {
        admin || who.uid == self.uid || self.readers.uids.contains(&who.uid) || who.in_any_group(&self.readers.gids)
    }

    fn live_attachers(&self) -> Vec<u64> {
        self.attachments
            .iter()
            .filter(|(_, a)| a.strong_count() > 0)
            .map(|(session, _)| *session)
            .collect()
    }
}

/// What an attach hands the attaching session.
pub(crate) struct Attached {
    pub handle: u64,
    pub len: u64,
    pub writable: bool,
    pub exporter: u64,
    /// The region's memfd for the client: read-only unless `writable`.
    pub fd: std::os::fd::OwnedFd,
}

/// The daemon's export names.
#[derive(Debug, Default)]
pub(crate) struct Exports {
    by_name: HashMap<String, Export>,
}

impl Exports {
    /// Forgets exports that ended by a release of their buffer (flag set by the session).
    fn purge(&mut self) {
        self.by_name.retain(|_, export| !export.revoked.load(Ordering::Acquire));
    }

    /// Publishes `session`'s buffer `handle` as `name`.
    pub(crate) fn export(
        &mut self,
        session: &mut Session,
        handle: u64,
        name: String,
        readers: ExportReaders,
        writable: bool,
    ) -> Result<(), ControlError> {
        let refuse = |message: String| Err(ControlError::Export(message));
        self.purge();
        check_export_name(&name)?;
        if readers.uids.len() + readers.gids.len() > MAX_EXPORT_READERS {
            return refuse(format!(
                "an export lists at most {MAX_EXPORT_READERS} readers (uids and gids together); allow a group instead of many users"
            ));
        }
        let Some(record) = session.buffers.get(handle).cloned() else {
            return refuse(format!("no buffer with handle {handle:#x} in this session"));
        };
        let Some(region) = record.region.clone() else {
            return refuse(format!(
                "buffer {handle:#x} lives in the session's heap and cannot be exported: allocate it exportable (Rust session.shared_buffer(len), Python session.shared_buffer(n, dtype), C agora_shared_buffer_create(session, len, &buffer))"
            ));
        };
        if session.shared_memory.attached.contains_key(&handle) {
            return refuse(format!(
                "buffer {handle:#x} is attached from another session's export; only its exporter can export it"
            ));
        }
        session
            .shared_memory
            .exported
            .retain(|_, (_, revoked)| !revoked.load(Ordering::Acquire));
        if let Some((existing, _)) = session.shared_memory.exported.get(&handle) {
            return refuse(format!(
                "buffer {handle:#x} is already exported as '{existing}'; revoke that name first to export it under another"
            ));
        }
        if let Some(other) = self.by_name.get(&name) {
            return refuse(format!(
                "the name '{name}' is taken (exported by session #{} of uid {}); pick another name, or revoke it first if it is yours",
                other.session, other.uid
            ));
        }
        if session.shared_memory.exported.len() >= MAX_EXPORTS_PER_SESSION {
            return refuse(format!(
                "a session exports at most {MAX_EXPORTS_PER_SESSION} names at a time; revoke some first"
            ));
        }
        if self.by_name.len() >= MAX_EXPORTS {
            return refuse(format!(
                "the daemon holds {MAX_EXPORTS} exports, its limit; try again once some are revoked"
            ));
        }
        if writable && region.writes_sealed() {
            return refuse(format!(
                "buffer {handle:#x} was exported read-only before, so its memory is sealed against new writers: export it read-only, or copy it into a new exportable buffer"
            ));
        }
        if !writable {
            // Before any attacher can get a descriptor: from now on no new mapping of it can
            // be writable, whatever an attacher does with its read-only descriptor.
            region
                .seal_writes()
                .map_err(|e| ControlError::Export(format!("could not seal buffer {handle:#x} against writers: {e}")))?;
        }
        let revoked = Arc::new(AtomicBool::new(false));
        session
            .shared_memory
            .exported
            .insert(handle, (name.clone(), revoked.clone()));
        tracing::debug!(session = session.id, %name, bytes = record.len, writable, "buffer exported");
        self.by_name.insert(
            name,
            Export {
                session: session.id,
                client: session.name.clone(),
                uid: session.credentials.uid,
                record,
                region,
                readers,
                writable,
                revoked,
                attachments: Vec::new(),
                attaches: 0,
            },
        );
        Ok(())
    }

    /// Withdraws `name` (asked by session `session` of the user `who`); returns the sessions
    /// that were attached.
    pub(crate) fn revoke(
        &mut self,
        session: u64,
        who: &Credentials,
        admin: bool,
        name: &str,
    ) -> Result<Vec<u64>, ControlError> {
        self.purge();
        let unknown = || {
            Err(ControlError::Export(format!(
                "no export named '{name}' (`agora exports` lists the names you may see)"
            )))
        };
        let Some(export) = self.by_name.get(name) else {
            return unknown();
        };
        // As for an attach: a caller who may not even attach it learns nothing of it (that it
        // exists, or its exporter's uid) from the refusal.
        if !export.may_attach(who, admin) {
            return unknown();
        }
        if export.session != session && export.uid != who.uid && !admin {
            return Err(ControlError::Export(format!(
                "'{name}' is exported by uid {}; only its exporter's user or an administrator may revoke it",
                export.uid
            )));
        }
        let export = self.by_name.remove(name).expect("looked up above");
        export.revoked.store(true, Ordering::Release);
        tracing::debug!(%name, "export revoked");
        Ok(export.live_attachers())
    }

    /// Attaches `name` to `session` (`admin` when its user is an administrator).
    pub(crate) fn attach(
        &mut self,
        session: &mut Session,
        name: &str,
        writable: bool,
        admin: bool,
    ) -> Result<Attached, ControlError> {
        let refuse = |message: String| Err(ControlError::Export(message));
        let unknown = || {
            refuse(format!(
                "no export named '{name}': it was never exported, or was revoked, or its exporter ended (`agora exports` lists the names you may attach)"
            ))
        };
        self.purge();
        let Some(export) = self.by_name.get_mut(name) else {
            return unknown();
        };
        // A caller who may not attach it is answered as for a name that does not exist (as
        // `agora exports` does not list it): telling it apart would let anyone probe which
        // names exist, who exports them and whom they allow. Administrators and the
        // exporter's uid may always attach, so they never get here. The reason goes to the
        // daemon's log for the operator.
        if !export.may_attach(&session.credentials, admin) {
            tracing::info!(
                uid = session.credentials.uid,
                groups = ?session.credentials.all_groups(),
                %name,
                exporter_uid = export.uid,
                allowed_uids = ?export.readers.uids,
                allowed_gids = ?export.readers.gids,
                "attach refused (answered as an unknown name): the caller is not among the export's readers"
            );
            return unknown();
        }
        if writable && !export.writable {
            return refuse(format!("'{name}' is exported read-only; attach it read-only"));
        }
        let fd = if writable {
            export.region.fd().try_clone_to_owned().map_err(|e| {
                ControlError::Export(format!("could not duplicate the memory descriptor of '{name}': {e}"))
            })?
        } else {
            export
                .region
                .read_only_fd()
                .map_err(|e| ControlError::Export(format!("could not open '{name}' read-only: {e}")))?
        };
        let len = export.record.len;
        session.shared_memory.reserve(len)?;
        let handle = session.insert_shared(export.record.clone(), len)?;
        let attachment = Arc::new(Attachment {
            writable,
            revoked: export.revoked.clone(),
        });
        export.attachments.retain(|(_, a)| a.strong_count() > 0);
        export.attachments.push((session.id, Arc::downgrade(&attachment)));
        export.attaches += 1;
        session.shared_memory.attached.insert(handle, attachment);
        tracing::debug!(session = session.id, %name, exporter = export.session, writable, "export attached");
        Ok(Attached {
            handle,
            len,
            writable,
            exporter: export.session,
            fd,
        })
    }

    /// Session `session` ended: its exports are withdrawn (its attachments went with it).
    pub(crate) fn session_ended(&mut self, session: u64) {
        self.by_name.retain(|name, export| {
            if export.session == session {
                export.revoked.store(true, Ordering::Release);
                tracing::debug!(%name, session, "export withdrawn: its exporter ended");
                false
            } else {
                true
            }
        });
    }

    /// The exports `who` may see: its own and those it may attach (all for `admin`).
    pub(crate) fn list(&mut self, who: &Credentials, admin: bool) -> Vec<ExportStatus> {
        self.purge();
        let mut list: Vec<ExportStatus> = self
            .by_name
            .iter()
            .filter(|(_, e)| e.may_attach(who, admin))
            .map(|(name, e)| ExportStatus {
                name: name.clone(),
                session: e.session,
                client: e.client.clone(),
                uid: e.uid,
                len: e.record.len,
                writable: e.writable,
                readers: e.readers.clone(),
                attachers: e.live_attachers(),
                attaches: e.attaches,
            })
            .collect();
        list.sort_by(|a, b| a.name.cmp(&b.name));
        list
    }
}

/// Export names: 1..=[`MAX_NAME`] bytes, printable, no whitespace (they appear in listings and
/// messages, quoted).
fn check_export_name(name: &str) -> Result<(), ControlError> {
    if name.is_empty() || name.len() > MAX_NAME {
        return Err(ControlError::Export(format!(
            "an export name is 1 to {MAX_NAME} bytes; this one is {}",
            name.len()
        )));
    }
    if name.chars().any(|c| c.is_control() || c.is_whitespace()) {
        return Err(ControlError::Export(format!(
            "the export name {name:?} holds whitespace or control characters; use letters, digits and punctuation"
        )));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_are_checked() {
        assert!(check_export_name("sim/state.0").is_ok());
        assert!(check_export_name("").is_err());
        assert!(check_export_name("a b").is_err());
        assert!(check_export_name("a\u{7}").is_err());
        assert!(check_export_name(&"x".repeat(MAX_NAME + 1)).is_err());
    }

    #[test]
    fn who_may_attach_is_the_exporters_uid_the_listed_uids_and_gids_and_admins() {
        let readers = ExportReaders {
            uids: vec![2001],
            gids: vec![300],
        };
        let export = |readers: ExportReaders| Export {
            session: 1,
            client: "sim".into(),
            uid: 1000,
            record: crate::memory::tests_support::record(64),
            region: Arc::new(Region::create("agora-test-export", 64).unwrap()),
            readers,
            writable: false,
            revoked: Arc::default(),
            attachments: Vec::new(),
            attaches: 0,
        };
        let who = |uid: u32, gid: u32, groups: &[u32]| Credentials {
            pid: 1,
            uid,
            gid,
            groups: groups.into(),
        };
        let open = export(readers);
        assert!(open.may_attach(&who(1000, 1000, &[]), false), "the exporter's own uid");
        assert!(open.may_attach(&who(2001, 5, &[]), false), "a listed uid");
        assert!(open.may_attach(&who(3000, 300, &[]), false), "a listed primary gid");
        assert!(
            open.may_attach(&who(3000, 3000, &[3000, 300]), false),
            "a member of a listed group by a supplementary group"
        );
        assert!(!open.may_attach(&who(3000, 301, &[302]), false), "anyone else");
        assert!(open.may_attach(&who(3000, 301, &[]), true), "an administrator");
        let private = export(ExportReaders::default());
        assert!(
            !private.may_attach(&who(2001, 300, &[]), false),
            "by default the exporter's uid only"
        );
    }

    #[test]
    fn the_session_limit_counts_regions_and_gives_them_back() {
        let mut sharing = SessionSharing::new(100);
        sharing.reserve(60).unwrap();
        let refusal = sharing.reserve(41).unwrap_err().to_string();
        assert!(
            refusal.contains("101 bytes") && refusal.contains("limit is 100"),
            "{refusal}"
        );
        sharing.released(7, 60);
        sharing.reserve(100).unwrap();
    }

    #[test]
    fn attachments_refuse_writes_when_read_only_and_everything_once_revoked() {
        let mut sharing = SessionSharing::new(100);
        let revoked = Arc::new(AtomicBool::new(false));
        sharing.attached.insert(
            5,
            Arc::new(Attachment {
                writable: false,
                revoked: revoked.clone(),
            }),
        );
        assert!(sharing.check(0, 5, false).is_ok());
        assert!(sharing.check(0, 6, true).is_ok(), "not an attachment");
        assert!(matches!(
            sharing.check(1, 5, true),
            Err(TaskError::Attachment {
                index: 1,
                handle: 5,
                reason: ATTACHMENT_READ_ONLY
            })
        ));
        revoked.store(true, Ordering::Release);
        assert!(matches!(
            sharing.check(0, 5, false),
            Err(TaskError::Attachment {
                reason: ATTACHMENT_REVOKED,
                ..
            })
        ));
    }
}
