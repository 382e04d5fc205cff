//! Durable, private file operations: create directories 0700, write files 0600 atomically
//! (temporary name, fsync, rename, fsync the directory), list and remove.
//!
//! Owns the crash-safety primitives every other module relies on. It must not know the store's
//! layout or what the files mean.

use std::fs::{self, DirBuilder, File, OpenOptions};
use std::io::{self, Write};
use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt};
use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};

use crate::error::StoreError;

/// Prefix of files being written; never a valid block, shard or manifest name, so a crash leaves
/// only files that the garbage collector recognises as debris.
pub(crate) const TEMP_PREFIX: &str = ".tmp-";

/// Makes temporary names unique within the process (the pid makes them unique across).
static TEMP_COUNTER: AtomicU64 = AtomicU64::new(0);

/// Creates `dir` and any missing parents with mode 0700, fsyncing each new directory's parent so
/// that the new entry survives a crash (files renamed into it later would otherwise be lost with
/// it).
pub(crate) fn ensure_dir(dir: &Path) -> Result<(), StoreError> {
    let mut missing = Vec::new();
    let mut cur = Some(dir);
    while let Some(d) = cur {
        match fs::metadata(d) {
            Ok(m) if m.is_dir() => break,
            Ok(_) => {
                return Err(StoreError::io(
                    "create directory",
                    d,
                    io::Error::new(
                        io::ErrorKind::AlreadyExists,
                        "a file that is not a directory is in the way",
                    ),
                ))
            }
            Err(e) if e.kind() == io::ErrorKind::NotFound => missing.push(d),
            Err(e) => return Err(StoreError::io("inspect directory", d, e)),
        }
        cur = d.parent().filter(|p| !p.as_os_str().is_empty());
    }
    for d in missing.into_iter().rev() {
        match DirBuilder::new().mode(0o700).create(d) {
            Ok(()) => {}
            // Another thread (another application's writer) created it first: fine.
            Err(e) if e.kind() == io::ErrorKind::AlreadyExists => {}
            Err(e) => return Err(StoreError::io("create directory", d, e)),
        }
        if let Some(parent) = d.parent().filter(|p| !p.as_os_str().is_empty()) {
            sync_dir(parent)?;
        }
    }
    Ok(())
}

/// Fsyncs a directory, making the entries created, renamed or removed in it durable.
pub(crate) fn sync_dir(dir: &Path) -> Result<(), StoreError> {
    File::open(dir)
        .and_then(|f| f.sync_all())
        .map_err(|e| StoreError::io("fsync directory", dir, e))
}

/// Writes `bytes` to `dir/name` atomically with mode 0600: a temporary file in the same
/// directory, fsynced, then renamed over the name. The caller fsyncs `dir` (once for many files).
pub(crate) fn write_atomic(dir: &Path, name: &str, bytes: &[u8]) -> Result<(), StoreError> {
    let n = TEMP_COUNTER.fetch_add(1, Ordering::Relaxed);
    let tmp = dir.join(format!("{TEMP_PREFIX}{name}-{}-{n}", std::process::id()));
    let dest = dir.join(name);
    let result = (|| {
        let mut f = OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(0o600)
            .open(&tmp)
            .map_err(|e| StoreError::io("create file", &tmp, e))?;
        f.write_all(bytes).map_err(|e| StoreError::io("write file", &tmp, e))?;
        f.sync_all().map_err(|e| StoreError::io("fsync file", &tmp, e))?;
        fs::rename(&tmp, &dest).map_err(|e| StoreError::io("rename into place", &dest, e))
    })();
    if result.is_err() {
        // Best effort: the garbage collector removes temporaries left by crashes anyway.
        let _ = fs::remove_file(&tmp);
    }
    result
}

/// The file's bytes, or `None` when it does not exist.
pub(crate) fn read_opt(path: &Path) -> Result<Option<Vec<u8>>, io::Error> {
    match fs::read(path) {
        Ok(b) => Ok(Some(b)),
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(None),
        Err(e) => Err(e),
    }
}

/// The names in `dir` (empty when it does not exist), as UTF-8 strings; other names are not
/// ours and are ignored.
pub(crate) fn list_names(dir: &Path) -> Result<Vec<String>, StoreError> {
    let rd = match fs::read_dir(dir) {
        Ok(rd) => rd,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(e) => return Err(StoreError::io("list directory", dir, e)),
    };
    let mut names = Vec::new();
    for ent in rd {
        let ent = ent.map_err(|e| StoreError::io("list directory", dir, e))?;
        if let Ok(name) = ent.file_name().into_string() {
            names.push(name);
        }
    }
    Ok(names)
}

/// Removes a file; a file already gone is not an error.
pub(crate) fn remove_file(path: &Path) -> Result<(), StoreError> {
    match fs::remove_file(path) {
        Ok(()) => Ok(()),
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(()),
        Err(e) => Err(StoreError::io("remove file", path, e)),
    }
}

/// Removes a directory tree; one already gone is not an error.
pub(crate) fn remove_tree(path: &Path) -> Result<(), StoreError> {
    match fs::remove_dir_all(path) {
        Ok(()) => Ok(()),
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(()),
        Err(e) => Err(StoreError::io("remove directory", path, e)),
    }
}

/// Whether `path` exists, as a file of exactly `len` bytes.
pub(crate) fn file_has_len(path: &Path, len: u64) -> Result<bool, StoreError> {
    match fs::metadata(path) {
        Ok(m) => Ok(m.is_file() && m.len() == len),
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(false),
        Err(e) => Err(StoreError::io("inspect file", path, e)),
    }
}

/// Bytes of the regular files under `dir`, recursively (0 when it does not exist; unreadable
/// entries count 0: the figure is for a quota, which errs on the side of the writes it allows).
pub(crate) fn tree_bytes(dir: &Path) -> u64 {
    let Ok(entries) = fs::read_dir(dir) else {
        return 0;
    };
    let mut total = 0;
    for entry in entries.flatten() {
        match entry.file_type() {
            Ok(t) if t.is_dir() => total += tree_bytes(&entry.path()),
            Ok(t) if t.is_file() => total += entry.metadata().map_or(0, |m| m.len()),
            _ => {}
        }
    }
    total
}
