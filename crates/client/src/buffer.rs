//! Buffers: opaque handles whose host copy lives in the session's shared segment.

use std::sync::Arc;

use agora_protocol::{Op, RawArg, TaskDescriptor};

use crate::resume::Whereabouts;
use crate::session::Inner;
use crate::Error;

/// A buffer. Its host copy is shared memory: [`Buffer::as_mut_slice`] and [`Buffer::write`] put
/// data where the daemon reads it, with no extra copy.
///
/// # The host copy and running tasks
/// Between issuing a task that uses a buffer and that task's completion, the daemon may read or
/// write the host copy. Write the host copy before `sync_to`, read it after the `sync_from` task
/// (or `queue.finish()`) has completed; touching it in between gives unspecified values (never
/// memory unsafety for other tenants — each session has its own segment).
///
/// # Writing over results you did not read
/// While a kernel's results are on a device and were never read back
/// ([`Buffer::needs_sync_from`]), the daemon may write them into the host copy at any moment,
/// to make room on that device (an eviction). [`Buffer::write`], [`Buffer::write_slice`] and
/// [`Buffer::as_mut_slice`] first claim the host copy ([`Buffer::claim_host`]): those results
/// are discarded and nothing the daemon does afterwards overwrites what you write. Writing
/// through another view of the memory (a pointer kept from an earlier `as_mut_slice`), call
/// `claim_host` yourself first. On a shared buffer (exported or attached) another session's
/// launches may have left results on a device that this process cannot know of, so every
/// claim of a shared buffer asks the daemon (one round trip per write; granted at once when the
/// host copy is already current).
///
/// Dropping a `Buffer` releases it; the daemon reclaims the memory once no issued task uses it.
///
/// # Coherence
/// A kernel computes on the device's copy of a buffer: the host copy shows its results only
/// after a `sync_from` of the buffer has completed, and devices see host writes only after a
/// `sync_to`. (On a device that computes on host memory the results may appear earlier; the
/// daemon's strict coherence mode, `agora serve --strict-coherence`, makes every device behave
/// the same, so a forgotten sync shows wherever the task runs.)
/// [`Buffer::needs_sync_from`] says whether a launch wrote the buffer since its last sync.
pub struct Buffer {
    session: Arc<Inner>,
    handle: u64,
    ptr: *mut u8,
    len: u64,
    /// Where its newest contents are; shared with the session's resume registry, which reports
    /// a buffer whose newest contents were on a device as lost after a daemon restart.
    whereabouts: Arc<Whereabouts>,
    /// An exportable or attached buffer's own memory (not the segment's heap), kept mapped
    /// while the buffer lives; `None` for an ordinary buffer.
    region: Option<Arc<agora_transport::shm::Region>>,
    /// For an exportable or attached buffer: whether it is attached, and how many times the
    /// session had resumed on a restarted daemon when it was made. A restarted daemon does not
    /// know such buffers (only heap buffers are resumed), so once the session resumed again
    /// they are refused here, saying so, instead of as an unknown handle by the daemon.
    made_in: Option<(bool, u64)>,
}

// SAFETY: the pointer refers to the session's mapping, which `session` keeps alive; the type
// hands out `&[T]` only through `&self` and `&mut [T]` only through `&mut self`.
unsafe impl Send for Buffer {}
// SAFETY: as above; shared access is read-only.
unsafe impl Sync for Buffer {}

impl std::fmt::Debug for Buffer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Buffer")
            .field("handle", &format_args!("{:#x}", self.handle))
            .field("len", &self.len)
            .finish()
    }
}

impl Buffer {
    pub(crate) fn new(session: Arc<Inner>, handle: u64, offset: u64, len: u64) -> Result<Self, Error> {
        let ptr =
            session.segment().view().heap_range(offset, len).ok_or_else(|| {
                Error::Protocol(format!("the daemon placed a buffer outside the heap ({offset}+{len})"))
            })?;
        let whereabouts = Arc::new(Whereabouts::default());
        session.resume.buffer_created(handle, offset, len, whereabouts.clone());
        Ok(Buffer {
            session,
            handle,
            ptr,
            len,
            whereabouts,
            region: None,
            made_in: None,
        })
    }

    /// An exportable or attached buffer, whose host copy is `region` (not resumed after a
    /// daemon restart: the new daemon does not know the region).
    pub(crate) fn in_region(
        session: Arc<Inner>,
        handle: u64,
        region: agora_transport::shm::Region,
        attached: bool,
    ) -> Result<Self, Error> {
        let len = region.len();
        let ptr = region
            .range(0, len)
            .ok_or_else(|| Error::Protocol("an empty region for a buffer".into()))?;
        let epoch = session.resume.epoch.load(std::sync::atomic::Ordering::Relaxed);
        Ok(Buffer {
            session,
            handle,
            ptr,
            len,
            whereabouts: Arc::new(Whereabouts::default()),
            region: Some(Arc::new(region)),
            made_in: Some((attached, epoch)),
        })
    }

    /// Whether this process may write the host copy: false only for a buffer attached
    /// read-only (its memory is mapped read-only, so a write through it would fault).
    pub fn is_writable(&self) -> bool {
        self.region.as_ref().is_none_or(|region| region.writable())
    }

    /// Whether the buffer's memory is a region of its own that other sessions can map: an
    /// exportable buffer ([`crate::Session::shared_buffer`]) or an attached one.
    pub fn is_shared(&self) -> bool {
        self.region.is_some()
    }

    fn check_writable(&self) -> Result<(), Error> {
        if self.is_writable() {
            Ok(())
        } else {
            Err(Error::ReadOnly)
        }
    }

    /// Whether a launch that writes this buffer was issued after its last `sync_from` (or
    /// `sync_to`, `memset` or `copy`, which leave the newest contents in the host copy): its
    /// results are then on a device, and the host copy does not show them until a `sync_from`.
    /// Tracked here from the kernels' signatures, so the answer does not depend on where the
    /// daemon ran the launch. Releasing such a buffer throws those results away (the daemon
    /// counts it in the session's `unread_releases`; Python warns with a `ResourceWarning`).
    pub fn needs_sync_from(&self) -> bool {
        self.whereabouts.unread()
    }

    /// What the session knows of where the newest contents are (updated as tasks are issued).
    pub(crate) fn whereabouts(&self) -> &Whereabouts {
        &self.whereabouts
    }

    pub(crate) fn handle(&self) -> u64 {
        self.handle
    }

    /// Refused unless the buffer is `session`'s: its handle is a number in its own session's
    /// table, where another session's call would find a buffer of its own (or none). Named
    /// `index` in the error (the argument's place). One pointer comparison: it is on the
    /// launch path.
    #[inline]
    pub(crate) fn check_session(&self, session: &Inner, index: usize) -> Result<(), Error> {
        if std::ptr::eq(Arc::as_ptr(&self.session), session) {
            match self.made_in {
                Some((attached, epoch)) if epoch != session.resume.epoch.load(std::sync::atomic::Ordering::Relaxed) => {
                    let what = if attached {
                        "attach the export again once its exporter has exported a new buffer"
                    } else {
                        "allocate a new shared buffer (shared_buffer) and export it again; attachers attach it again"
                    };
                    Err(Error::Control(agora_protocol::control::ControlError::BadRequest(format!(
                        "buffer {:#x} is {} from before the daemon restarted: exportable and attached buffers are not kept across a daemon restart (its memory stays mapped and readable here, but the new daemon does not know it); {what}",
                        self.handle,
                        if attached { "an attached buffer" } else { "an exportable buffer" },
                    ))))
                }
                _ => Ok(()),
            }
        } else {
            Err(Error::Task(agora_protocol::TaskError::ForeignBuffer {
                index: index as u16,
                handle: self.handle,
            }))
        }
    }

    /// Length in bytes.
    pub fn len(&self) -> u64 {
        self.len
    }

    /// Whether the buffer is empty (never: buffers are at least one byte).
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    pub(crate) fn zero(&self) {
        // SAFETY: ptr..ptr+len is this buffer's range of the live mapping; a fresh buffer is not
        // used by any task yet.
        unsafe { std::ptr::write_bytes(self.ptr, 0, self.len as usize) };
    }

    /// Makes the host copy this process's to write when a kernel's results on a device were
    /// never read back ([`Buffer::needs_sync_from`], or on a shared buffer, whose other
    /// sessions' launches are not tracked here; otherwise there is nothing to do): those
    /// results are discarded, the host copy becomes the buffer's current contents (as after a
    /// `sync_to`), and no eviction writes a device's copy over it afterwards. Waits while a
    /// task the daemon has started names the buffer, or an eviction is writing it home (at
    /// most the session's control timeout, then [`Error::Timeout`]). One round trip to the
    /// daemon; [`Buffer::write`] and [`Buffer::as_mut_slice`] call it.
    pub fn claim_host(&self) -> Result<(), Error> {
        let mut wait = ClaimWait::new(self.session.control_timeout);
        while !self.try_claim_host()? {
            let pause = wait.next_pause()?;
            let began = std::time::Instant::now();
            std::thread::sleep(pause);
            wait.paused(began, pause);
        }
        Ok(())
    }

    /// One attempt of [`Buffer::claim_host`]: `Ok(false)` while a task the daemon started uses
    /// the buffer or an eviction is writing it home (for bindings that wait their own way,
    /// checking for signals between attempts).
    #[doc(hidden)]
    pub fn try_claim_host(&self) -> Result<bool, Error> {
        self.session.check_process()?;
        let unread = self.whereabouts.unread();
        if !unread && !self.is_shared() {
            return Ok(true);
        }
        self.check_writable()?;
        // A shared buffer with nothing unread by this process is claimed in case another
        // session left results on a device. Should the daemon be gone, or not know the buffer
        // (shared buffers are not resumed on a restarted daemon), nothing can be written over
        // the host copy any more: write as before claims existed, without waiting to resume.
        let speculative = !unread;
        if speculative && self.session.daemon_gone() {
            return Ok(true);
        }
        let request = agora_protocol::control::Request::ClaimHost { buffer: self.handle };
        let response = match self.session.request(&request) {
            Ok(response) => response,
            Err(Error::Disconnected | Error::SessionEnded | Error::Control(_)) if speculative => return Ok(true),
            Err(e) => return Err(e),
        };
        match response {
            agora_protocol::control::Response::HostClaim { granted: true } => {
                self.whereabouts.host_written();
                Ok(true)
            }
            agora_protocol::control::Response::HostClaim { granted: false } => Ok(false),
            // Only "no such buffer" (a restarted daemon): a refusal by a limit still says so.
            agora_protocol::control::Response::Error(agora_protocol::control::ControlError::BadRequest(_))
                if speculative =>
            {
                Ok(true)
            }
            other => Err(crate::session::unexpected(other)),
        }
    }

    /// How [`Buffer::claim_host`] spaces its attempts and when it gives up, for a binding that
    /// waits between attempts its own way (checking for signals).
    #[doc(hidden)]
    pub fn claim_wait(&self) -> ClaimWait {
        ClaimWait::new(self.session.control_timeout)
    }

    /// Copies `data` into the host copy at byte `offset`, after claiming it
    /// ([`Buffer::claim_host`]) when a kernel's results on a device were never read back.
    pub fn write(&self, offset: u64, data: &[u8]) -> Result<(), Error> {
        // Refused before the claim, which would discard results for nothing.
        self.check_write(offset, data.len() as u64)?;
        self.claim_host()?;
        self.write_claimed(offset, data)
    }

    /// Whether `len` bytes at `offset` may be written: the buffer is writable and the range
    /// lies in it (for bindings, to refuse before they claim).
    #[doc(hidden)]
    pub fn check_write(&self, offset: u64, len: u64) -> Result<(), Error> {
        self.check_writable()?;
        if offset.saturating_add(len) > self.len {
            return Err(Error::OutOfBounds {
                offset,
                len,
                capacity: self.len,
            });
        }
        Ok(())
    }

    /// [`Buffer::write`] for a caller that claimed the host copy itself (a binding that waits
    /// for the claim its own way): copies without asking the daemon again.
    #[doc(hidden)]
    pub fn write_claimed(&self, offset: u64, data: &[u8]) -> Result<(), Error> {
        // The host copy is shared with the parent that opened the session.
        self.session.check_process()?;
        self.check_write(offset, data.len() as u64)?;
        // SAFETY: bounds checked above against this buffer's range of the live mapping.
        unsafe { std::ptr::copy_nonoverlapping(data.as_ptr(), self.ptr.add(offset as usize), data.len()) };
        Ok(())
    }

    /// Copies `data` (any plain-old-data element type) into the host copy from the start.
    pub fn write_slice<T: bytemuck::Pod>(&self, data: &[T]) -> Result<(), Error> {
        self.write(0, bytemuck::cast_slice(data))
    }

    /// A copy of the host copy's bytes.
    pub fn read(&self) -> Vec<u8> {
        self.as_slice::<u8>().to_vec()
    }

    /// A copy of the host copy as elements of `T` (trailing bytes that do not fill a `T` are
    /// left out).
    pub fn read_vec<T: bytemuck::Pod>(&self) -> Vec<T> {
        self.as_slice::<T>().to_vec()
    }

    /// The host copy's address, for foreign-function bindings (the C client's
    /// `agora_buffer_data`): unlike [`Buffer::as_mut_slice`] it claims nothing, since the caller
    /// may as well only read through it. Valid while the buffer lives.
    #[doc(hidden)]
    pub fn host_ptr(&self) -> *mut u8 {
        self.ptr
    }

    /// The host copy viewed as elements of `T`, in place (zero-copy).
    pub fn as_slice<T: bytemuck::Pod>(&self) -> &[T] {
        let n = self.len as usize / std::mem::size_of::<T>();
        // SAFETY: the heap hands out 64-byte aligned ranges (enough for any Pod scalar) inside the
        // mapping that `session` keeps alive; every bit pattern is a valid T.
        unsafe { std::slice::from_raw_parts(self.ptr as *const T, n) }
    }

    /// The host copy viewed as elements of `T`, mutably, in place (zero-copy), claimed first
    /// ([`Buffer::claim_host`]) when a kernel's results on a device were never read back. Should
    /// the claim fail (the daemon is gone, or a task kept the buffer past the control timeout),
    /// the view is returned all the same: call `claim_host` first to handle its error.
    ///
    /// # Panics
    /// On a buffer attached read-only ([`Buffer::is_writable`] is false): its memory is mapped
    /// read-only. [`Buffer::write`] returns an error instead.
    pub fn as_mut_slice<T: bytemuck::Pod>(&mut self) -> &mut [T] {
        assert!(
            self.is_writable(),
            "buffer {:#x} is attached read-only: its host copy cannot be written",
            self.handle
        );
        // A failed claim (see the doc) leaves the view as before claims existed.
        let _ = self.claim_host();
        let n = self.len as usize / std::mem::size_of::<T>();
        // SAFETY: as for `as_slice`; `&mut self` makes this the only view from this process.
        unsafe { std::slice::from_raw_parts_mut(self.ptr as *mut T, n) }
    }
}

impl Drop for Buffer {
    fn drop(&mut self) {
        if self.session.in_forked_child() {
            // The buffer is the parent's (and so are the ring and the bookkeeping): this copy
            // just goes.
            return;
        }
        let mut d = TaskDescriptor::zeroed();
        d.op = Op::ReleaseBuffer as u32;
        d.arg_count = 1;
        d.args[0] = RawArg::buffer(self.handle);
        // Goes through the ring, so it is ordered after every task issued before it. Never
        // waits for a daemon to come back (`submit_release`). The registry forgets the buffer
        // only once the release completed: a resume before then issues the release again.
        let release = self.session.submit_release(0, d);
        let session = &self.session;
        if let (Some(id), None) = (release, &self.region) {
            // An allocation that finds no room waits for it (`Inner::alloc_buffer`).
            session.buffer_freeing(id, self.len);
        }
        session
            .resume
            .buffer_released(self.handle, release, |id| session.is_done(id));
    }
}

/// The pauses between attempts of [`Buffer::claim_host`] (growing from 100 µs to 5 ms: a task
/// using the buffer usually ends soon) and its limit, the session's control timeout, which
/// leaves out time this process did not run ([`agora_wait::Deadline`]).
#[doc(hidden)]
#[derive(Debug)]
pub struct ClaimWait {
    deadline: agora_wait::Deadline,
    limit: std::time::Duration,
    pause: std::time::Duration,
}

impl ClaimWait {
    fn new(limit: std::time::Duration) -> ClaimWait {
        ClaimWait {
            deadline: agora_wait::Deadline::after(limit),
            limit,
            pause: std::time::Duration::from_micros(100),
        }
    }

    /// How long to pause before the next attempt, or [`Error::Timeout`] once the limit passed.
    pub fn next_pause(&mut self) -> Result<std::time::Duration, Error> {
        let Some(wait) = self.deadline.next_wait() else {
            return Err(Error::Timeout {
                request: "host copy claim (a task uses the buffer)".into(),
                after: self.limit,
            });
        };
        let pause = self.pause.min(wait);
        self.pause = (self.pause * 2).min(std::time::Duration::from_millis(5));
        Ok(pause)
    }

    /// Reports a pause of `asked` that began at `began` (a late one is forgiven).
    pub fn paused(&mut self, began: std::time::Instant, asked: std::time::Duration) {
        self.deadline.waited(began, asked);
    }
}
