//! The per-client shared segment: a sealed memfd mapped by the daemon and by one client.

use std::fs::File;
use std::os::fd::{AsFd, OwnedFd};

use agora_protocol::segment::{Geometry, SegmentView};
use memmap2::MmapRaw;
use rustix::fs::{MemfdFlags, SealFlags};

use crate::TransportError;

/// A mapped segment. Unmapped on drop.
#[derive(Debug)]
pub struct Segment {
    map: MmapRaw,
    file: File,
    view: SegmentView,
}

impl Segment {
    /// Creates a zero-filled segment with `geometry` and writes its header (daemon side).
    ///
    /// The memfd is sealed against shrinking and growing before it is shared, so a client can
    /// never truncate it under the daemon (which would turn the daemon's next access into a
    /// SIGBUS).
    pub fn create(name: &str, geometry: Geometry) -> Result<Self, TransportError> {
        let fd = rustix::fs::memfd_create(name, MemfdFlags::CLOEXEC | MemfdFlags::ALLOW_SEALING).map_err(|e| {
            TransportError::Os {
                what: "memfd_create",
                cause: e.into(),
            }
        })?;
        rustix::fs::ftruncate(&fd, geometry.total_len).map_err(|e| TransportError::Os {
            what: "sizing the segment",
            cause: e.into(),
        })?;
        rustix::fs::fcntl_add_seals(&fd, SealFlags::SHRINK | SealFlags::GROW | SealFlags::SEAL).map_err(|e| {
            TransportError::Os {
                what: "sealing the segment",
                cause: e.into(),
            }
        })?;
        let segment = Self::map_file(File::from(fd), geometry)?;
        segment.view.initialize();
        Ok(segment)
    }

    /// Maps a segment received from the daemon and checks its header (client side).
    pub fn open(fd: OwnedFd, geometry: Geometry) -> Result<Self, TransportError> {
        let file = File::from(fd);
        let len = file
            .metadata()
            .map_err(TransportError::os("inspecting the segment"))?
            .len();
        if len < geometry.total_len {
            return Err(TransportError::Protocol(format!(
                "segment is {len} bytes, the daemon announced {}",
                geometry.total_len
            )));
        }
        let segment = Self::map_file(file, geometry)?;
        segment
            .view
            .verify()
            .map_err(|e| TransportError::Protocol(e.to_string()))?;
        Ok(segment)
    }

    /// Maps a segment a resuming client hands back (daemon side): a segment an earlier daemon
    /// created for it, which the client kept mapped across that daemon's death. Everything is
    /// checked as untrusted: it must be a memfd sealed against shrinking, growing and further
    /// sealing (so the client cannot truncate it under us), exactly as long as `geometry`
    /// says, with a matching header.
    pub fn adopt(fd: OwnedFd, geometry: Geometry) -> Result<Self, TransportError> {
        let refuse = |why: String| TransportError::Protocol(format!("the segment handed back is not usable: {why}"));
        let seals = rustix::fs::fcntl_get_seals(&fd).map_err(|_| refuse("it is not a sealable memfd".into()))?;
        let needed = SealFlags::SHRINK | SealFlags::GROW | SealFlags::SEAL;
        if !seals.contains(needed) {
            return Err(refuse(format!("it is not sealed against resizing (seals {seals:?})")));
        }
        if seals.intersects(SealFlags::WRITE | SealFlags::FUTURE_WRITE) {
            return Err(refuse("it is sealed against writing".into()));
        }
        let file = File::from(fd);
        let len = file
            .metadata()
            .map_err(TransportError::os("inspecting the segment"))?
            .len();
        if len != geometry.total_len {
            return Err(refuse(format!(
                "it is {len} bytes, its geometry needs {}",
                geometry.total_len
            )));
        }
        let segment = Self::map_file(file, geometry)?;
        segment.view.verify().map_err(|e| refuse(e.to_string()))?;
        Ok(segment)
    }

    fn map_file(file: File, geometry: Geometry) -> Result<Self, TransportError> {
        let map = memmap2::MmapOptions::new()
            .len(geometry.total_len as usize)
            .map_raw(&file)
            .map_err(TransportError::os("mapping the segment"))?;
        // SAFETY: `map` is a shared, page-aligned read-write mapping of total_len bytes owned by
        // the returned Segment, which outlives every use of the view it hands out by reference
        // (users that need the view longer hold an Arc<Segment>).
        let view = unsafe { SegmentView::from_raw(map.as_mut_ptr(), geometry) };
        Ok(Segment { map, file, view })
    }

    /// The view over the mapping.
    pub fn view(&self) -> &SegmentView {
        &self.view
    }

    /// The memfd, for passing to the client.
    pub fn fd(&self) -> std::os::fd::BorrowedFd<'_> {
        self.file.as_fd()
    }

    /// Mapped length.
    pub fn len(&self) -> usize {
        self.map.len()
    }

    /// Whether the mapping is empty (never, for a valid geometry).
    pub fn is_empty(&self) -> bool {
        self.map.len() == 0
    }
}

/// An exportable buffer's memory (`Request::AllocShared`, attached by other sessions): a sealed
/// memfd of exactly one buffer's length, mapped by the daemon and by every process that holds
/// the buffer, so that handing it to another process exposes that buffer and nothing else (a
/// session's segment also holds its rings and its other buffers, and so is never handed on).
///
/// The memory lives while any process maps it or holds its fd: a revoked export or an ended
/// exporter never leaves an attacher with a dangling mapping.
#[derive(Debug)]
pub struct Region {
    map: MmapRaw,
    file: File,
    writable: bool,
}

impl Region {
    /// Creates a zero-filled region of `len` bytes, sealed against resizing (daemon side).
    pub fn create(name: &str, len: u64) -> Result<Self, TransportError> {
        if len == 0 {
            return Err(TransportError::Protocol("a region holds at least one byte".into()));
        }
        let fd = rustix::fs::memfd_create(name, MemfdFlags::CLOEXEC | MemfdFlags::ALLOW_SEALING).map_err(|e| {
            TransportError::Os {
                what: "memfd_create",
                cause: e.into(),
            }
        })?;
        rustix::fs::ftruncate(&fd, len).map_err(|e| TransportError::Os {
            what: "sizing the region",
            cause: e.into(),
        })?;
        // Not `SEAL` yet: a read-only export adds `FUTURE_WRITE` later ([`Region::seal_writes`]).
        // What a holder of the fd could add meanwhile harms no one else: `WRITE` fails while the
        // daemon maps it writable, and `FUTURE_WRITE` only stops new writable mappings.
        rustix::fs::fcntl_add_seals(&fd, SealFlags::SHRINK | SealFlags::GROW).map_err(|e| TransportError::Os {
            what: "sealing the region",
            cause: e.into(),
        })?;
        Self::map_file(File::from(fd), len, true)
    }

    /// Maps a region received from the daemon (client side): read-write, or read-only when the
    /// daemon handed a read-only descriptor (an attachment without write permission: the kernel
    /// then refuses a writable mapping, so the permission does not rest on this process).
    pub fn open(fd: OwnedFd, len: u64, writable: bool) -> Result<Self, TransportError> {
        let file = File::from(fd);
        let actual = file
            .metadata()
            .map_err(TransportError::os("inspecting the region"))?
            .len();
        if actual != len || len == 0 {
            return Err(TransportError::Protocol(format!(
                "the region is {actual} bytes, the daemon announced {len}"
            )));
        }
        Self::map_file(file, len, writable)
    }

    fn map_file(file: File, len: u64, writable: bool) -> Result<Self, TransportError> {
        let len_usize =
            usize::try_from(len).map_err(|_| TransportError::Protocol(format!("a region of {len} bytes")))?;
        let mut options = memmap2::MmapOptions::new();
        options.len(len_usize);
        // No MAP_POPULATE: attaching maps the pages lazily, so an attach costs the same for 4 KiB
        // and for 512 MiB (the pages are faulted in as they are first touched).
        let map = if writable {
            options.map_raw(&file)
        } else {
            options.map_raw_read_only(&file)
        }
        .map_err(TransportError::os("mapping the region"))?;
        Ok(Region { map, file, writable })
    }

    /// Forbids every *new* writable mapping and `write(2)` of the memory, for good
    /// (`F_SEAL_FUTURE_WRITE`); the mappings that exist (the daemon's, the exporter's) stay
    /// writable. A process that receives a descriptor afterwards can only read, even if it
    /// reopens the descriptor read-write through `/proc` (which a read-only descriptor alone
    /// would not prevent: a memfd's inode is mode 0777).
    pub fn seal_writes(&self) -> Result<(), TransportError> {
        rustix::fs::fcntl_add_seals(&self.file, SealFlags::FUTURE_WRITE).map_err(|e| TransportError::Os {
            what: "sealing the region against new writers",
            cause: e.into(),
        })
    }

    /// Whether [`Region::seal_writes`] was applied.
    pub fn writes_sealed(&self) -> bool {
        rustix::fs::fcntl_get_seals(&self.file).is_ok_and(|seals| seals.contains(SealFlags::FUTURE_WRITE))
    }

    /// A descriptor of the same memory opened read-only (through `/proc/self/fd`), for a
    /// process allowed only to read; pair it with [`Region::seal_writes`], which is what makes
    /// the permission hold against a process that reopens it.
    pub fn read_only_fd(&self) -> Result<OwnedFd, TransportError> {
        let path = format!("/proc/self/fd/{}", std::os::fd::AsRawFd::as_raw_fd(&self.file));
        let file = std::fs::OpenOptions::new()
            .read(true)
            .open(&path)
            .map_err(TransportError::os("opening a read-only descriptor of the region"))?;
        Ok(OwnedFd::from(file))
    }

    /// The memfd (read-write), for passing to a process allowed to write.
    pub fn fd(&self) -> std::os::fd::BorrowedFd<'_> {
        self.file.as_fd()
    }

    /// Whether this mapping may be written.
    pub fn writable(&self) -> bool {
        self.writable
    }

    /// Length in bytes.
    pub fn len(&self) -> u64 {
        self.map.len() as u64
    }

    /// Whether the region is empty (never: regions hold at least one byte).
    pub fn is_empty(&self) -> bool {
        self.map.len() == 0
    }

    /// The address of `[offset, offset+len)`, if it lies inside the region.
    pub fn range(&self, offset: u64, len: u64) -> Option<*mut u8> {
        let end = offset.checked_add(len)?;
        if end > self.len() {
            return None;
        }
        // SAFETY: offset + len <= the mapping's length, so the pointer stays inside it.
        Some(unsafe { self.map.as_mut_ptr().add(offset as usize) })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn create_then_open_shares_memory_and_refuses_truncation() {
        let g = Geometry::new(8, 8, 1 << 16).unwrap();
        let daemon = Segment::create("agora-test", g).unwrap();
        let fd = daemon.fd().try_clone_to_owned().unwrap();
        // A client cannot shrink the sealed memfd.
        assert!(rustix::fs::ftruncate(&fd, 4096).is_err());
        let client = Segment::open(fd, g).unwrap();
        let p = daemon.view().heap_range(100, 4).unwrap();
        // SAFETY: in-bounds heap bytes of a live mapping.
        unsafe { p.write(42) };
        let q = client.view().heap_range(100, 4).unwrap();
        // SAFETY: as above, through the client's mapping of the same memfd.
        assert_eq!(unsafe { q.read() }, 42);
    }

    #[test]
    fn open_rejects_a_mismatched_geometry() {
        let g = Geometry::new(8, 8, 1 << 16).unwrap();
        let daemon = Segment::create("agora-test", g).unwrap();
        let other = Geometry::new(16, 8, 1 << 16).unwrap();
        let fd = daemon.fd().try_clone_to_owned().unwrap();
        assert!(Segment::open(fd, other).is_err());
    }
    #[test]
    fn a_region_is_shared_and_its_read_only_descriptor_cannot_be_mapped_writable() {
        let daemon = Region::create("agora-test-region", 3 * 4096 + 5).unwrap();
        let writer = Region::open(daemon.fd().try_clone_to_owned().unwrap(), daemon.len(), true).unwrap();
        let reader_fd = daemon.read_only_fd().unwrap();
        // The receiver of a read-only descriptor cannot get a writable mapping, even by asking.
        assert!(Region::open(reader_fd.try_clone().unwrap(), daemon.len(), true).is_err());
        let reader = Region::open(reader_fd, daemon.len(), false).unwrap();
        // SAFETY: in-bounds bytes of live mappings of the same memfd.
        unsafe { writer.range(12_000, 1).unwrap().write(7) };
        // SAFETY: as above.
        assert_eq!(unsafe { reader.range(12_000, 1).unwrap().read() }, 7);
        assert!(daemon.range(12_000, 2000).is_none());
        // Until the region is sealed, a receiver can reopen a read-only descriptor read-write
        // through /proc; once sealed, no new writable mapping can be made at all, while the
        // mappings made before keep writing.
        daemon.seal_writes().unwrap();
        assert!(daemon.writes_sealed());
        let read_only = daemon.read_only_fd().unwrap();
        let reopened = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .open(format!("/proc/self/fd/{}", std::os::fd::AsRawFd::as_raw_fd(&read_only)))
            .unwrap();
        assert!(Region::open(OwnedFd::from(reopened), daemon.len(), true).is_err());
        // SAFETY: in-bounds bytes of live mappings of the same memfd.
        unsafe { writer.range(0, 1).unwrap().write(9) };
        // SAFETY: as above.
        assert_eq!(unsafe { daemon.range(0, 1).unwrap().read() }, 9);
        // Nobody can resize it.
        assert!(rustix::fs::ftruncate(writer.fd(), 4096).is_err());
        assert!(Region::open(daemon.fd().try_clone_to_owned().unwrap(), 4096, true).is_err());
    }
}
