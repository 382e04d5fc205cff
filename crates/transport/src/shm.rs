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
}
