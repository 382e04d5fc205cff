//! The program cache: OpenCL program binaries kept by the daemon under its state directory, so
//! that building a source again — in another session, or after a restart — costs a load
//! instead of a compilation.
//!
//! A binary is stored as `programs/KEY.bin`, where KEY is the SHA-256 of the device name, the
//! build options and the source; the file holds a magic, the SHA-256 of the binary and the
//! binary. It is never trusted blindly: a file whose magic, length or hash is wrong is removed
//! and ignored, and the executor that receives a binary builds from source when the binary
//! fails in any way. Only binaries from an executor that had run no tenant code are stored (see
//! `agora_executor::Build::clean`). The cache is bounded in bytes (`[programs] cache_bytes`)
//! and in files ([`MAX_FILES`]): the least recently used go first.
//!
//! Owns the files under `programs/`; knows nothing of sessions.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::SystemTime;

use sha2::{Digest, Sha256};

/// Most binaries kept.
pub(crate) const MAX_FILES: usize = 512;

const MAGIC: &[u8; 8] = b"AGORAPB1";
const HEADER: usize = 8 + 32;

/// The cache.
#[derive(Debug)]
pub(crate) struct ProgramCache {
    /// `None`: caching is off.
    dir: Option<PathBuf>,
    max_bytes: u64,
    max_files: usize,
}

impl ProgramCache {
    /// The cache in `state_dir/programs`, at most `max_bytes` (0: off).
    pub(crate) fn new(state_dir: &Path, max_bytes: u64) -> Self {
        ProgramCache {
            dir: (max_bytes > 0).then(|| state_dir.join("programs")),
            max_bytes,
            max_files: MAX_FILES,
        }
    }

    /// The key of `source` built with `options` for `device`.
    pub(crate) fn key(device: &str, options: &str, source: &str) -> String {
        let mut hash = Sha256::new();
        for part in [device, options, source] {
            hash.update(part.as_bytes());
            hash.update([0]);
        }
        hash.finalize().iter().map(|b| format!("{b:02x}")).collect()
    }

    fn path(&self, key: &str) -> Option<PathBuf> {
        let valid = key.len() == 64 && key.bytes().all(|b| b.is_ascii_hexdigit());
        Some(self.dir.as_ref()?.join(format!("{key}.bin"))).filter(|_| valid)
    }

    /// The binary stored under `key`, if there is a sound one (an unsound file is removed).
    pub(crate) fn load(&self, key: &str) -> Option<Vec<u8>> {
        let path = self.path(key)?;
        let len = std::fs::metadata(&path).ok()?.len();
        if len < HEADER as u64 || len > (HEADER + agora_executor::wire::MAX_BINARY) as u64 {
            let _ = std::fs::remove_file(&path);
            return None;
        }
        let bytes = std::fs::read(&path).ok()?;
        if bytes.len() >= 8 && bytes[..7] == MAGIC[..7] && bytes[7] > MAGIC[7] {
            // A newer Agora's format: not ours to judge or remove.
            tracing::debug!(file = %path.display(), "a program cache file of a newer format; building instead");
            return None;
        }
        let sound = bytes.len() >= HEADER
            && &bytes[..8] == MAGIC
            && Sha256::digest(&bytes[HEADER..]).as_slice() == &bytes[8..HEADER];
        if !sound {
            tracing::warn!(file = %path.display(), "removing a damaged program cache file");
            let _ = std::fs::remove_file(&path);
            return None;
        }
        // Recently used: evicted last.
        if let Ok(file) = std::fs::File::options().append(true).open(&path) {
            let _ = file.set_modified(SystemTime::now());
        }
        Some(bytes[HEADER..].to_vec())
    }

    /// Stores `binary` under `key` (atomically: a reader sees the old file or the new one),
    /// then evicts the least recently used files beyond the bounds.
    pub(crate) fn store(&self, key: &str, binary: &[u8]) {
        let (Some(dir), Some(path)) = (&self.dir, self.path(key)) else {
            return;
        };
        if binary.is_empty() || (HEADER + binary.len()) as u64 > self.max_bytes {
            return;
        }
        static NEXT: AtomicU64 = AtomicU64::new(0);
        let temporary = dir.join(format!(
            ".{key}.{}.{}.tmp",
            std::process::id(),
            NEXT.fetch_add(1, Ordering::Relaxed)
        ));
        let written = (|| -> std::io::Result<()> {
            use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt};
            std::fs::DirBuilder::new().recursive(true).mode(0o700).create(dir)?;
            let mut file = std::fs::File::options()
                .write(true)
                .create_new(true)
                .mode(0o600)
                .open(&temporary)?;
            file.write_all(MAGIC)?;
            file.write_all(&Sha256::digest(binary))?;
            file.write_all(binary)?;
            std::fs::rename(&temporary, &path)
        })();
        if let Err(error) = written {
            tracing::warn!(%error, dir = %dir.display(), "could not store a program binary in the cache");
            let _ = std::fs::remove_file(&temporary);
            return;
        }
        self.bound(dir);
    }

    /// Removes the least recently used binaries until the cache is within its bounds.
    fn bound(&self, dir: &Path) {
        let Ok(entries) = std::fs::read_dir(dir) else {
            return;
        };
        let mut files: Vec<(SystemTime, u64, PathBuf)> = entries
            .filter_map(|e| {
                let e = e.ok()?;
                let path = e.path();
                if path.extension()? != "bin" {
                    return None;
                }
                let meta = e.metadata().ok()?;
                Some((meta.modified().ok()?, meta.len(), path))
            })
            .collect();
        files.sort();
        let mut bytes: u64 = files.iter().map(|f| f.1).sum();
        let mut count = files.len();
        for (_, len, path) in files {
            if bytes <= self.max_bytes && count <= self.max_files {
                break;
            }
            if std::fs::remove_file(&path).is_ok() {
                bytes -= len;
                count -= 1;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn temp() -> PathBuf {
        let dir = std::env::temp_dir().join(format!(
            "agora-cache-test-{}-{}",
            std::process::id(),
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .unwrap()
                .as_nanos()
        ));
        std::fs::create_dir_all(&dir).unwrap();
        dir
    }

    #[test]
    fn binaries_come_back_and_damaged_files_are_dropped() {
        let state = temp();
        let cache = ProgramCache::new(&state, 1 << 20);
        let key = ProgramCache::key("dev", "-O", "__kernel void k() {}");
        assert_ne!(key, ProgramCache::key("other dev", "-O", "__kernel void k() {}"));
        assert_eq!(cache.load(&key), None);
        cache.store(&key, b"binary bytes");
        assert_eq!(cache.load(&key).as_deref(), Some(&b"binary bytes"[..]));
        // A flipped byte: removed, not returned.
        let path = state.join("programs").join(format!("{key}.bin"));
        let mut bytes = std::fs::read(&path).unwrap();
        *bytes.last_mut().unwrap() ^= 1;
        std::fs::write(&path, bytes).unwrap();
        assert_eq!(cache.load(&key), None);
        assert!(!path.exists());
        // Keys that are not hashes never name a file.
        assert_eq!(cache.load("../../etc/passwd"), None);
        cache.store("../escape", b"x");
        assert!(!state.join("escape.bin").exists());
        // Off: nothing stored.
        let off = ProgramCache::new(&state, 0);
        off.store(&key, b"x");
        assert_eq!(off.load(&key), None);
        std::fs::remove_dir_all(&state).unwrap();
    }

    #[test]
    fn the_cache_stays_within_its_bounds() {
        let state = temp();
        let mut cache = ProgramCache::new(&state, 3 * (HEADER as u64 + 100));
        cache.max_files = 3;
        let keys: Vec<String> = (0..5).map(|i| ProgramCache::key("d", "", &i.to_string())).collect();
        for key in &keys {
            cache.store(key, &[7u8; 100]);
            // Distinct modification times.
            std::thread::sleep(std::time::Duration::from_millis(20));
        }
        let kept: Vec<bool> = keys.iter().map(|k| cache.load(k).is_some()).collect();
        assert_eq!(kept, vec![false, false, true, true, true]);
        cache.store(&ProgramCache::key("d", "", "big"), &vec![0u8; 4 * 100 + 4 * HEADER]);
        assert!(
            cache.load(&ProgramCache::key("d", "", "big")).is_none(),
            "larger than the whole cache"
        );
        std::fs::remove_dir_all(&state).unwrap();
    }
}
