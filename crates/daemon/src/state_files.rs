//! Writing the daemon's own files — the performance model, Slurm job records, the trace — so
//! that a write that fails (a full disk, a quota, a directory made read-only) leaves the file
//! as it was, never truncated, and no temporary file behind.
//!
//! Must not: decide where files go or what they hold (their owners do), or sync to disk: these
//! are records a crash may lose, not checkpoints (the checkpoint store has its own fsyncing
//! writer).

use std::io::Write;
use std::path::{Path, PathBuf};

/// Writes `path` with what `write` produces: into a temporary file beside it, then renamed over
/// it. On any error the temporary file is removed and `path` is untouched; the error names the
/// file and, for a full disk or a quota, says so.
pub(crate) fn write_replacing(
    path: &Path,
    write: impl FnOnce(&mut std::io::BufWriter<std::fs::File>) -> std::io::Result<()>,
) -> std::io::Result<()> {
    let temporary = temporary_beside(path);
    let result = (|| {
        let mut file = std::io::BufWriter::with_capacity(1 << 20, std::fs::File::create(&temporary)?);
        write(&mut file)?;
        file.flush()?;
        drop(file);
        std::fs::rename(&temporary, path)
    })();
    if let Err(e) = result {
        let _ = std::fs::remove_file(&temporary);
        return Err(std::io::Error::new(e.kind(), explained(&e)));
    }
    Ok(())
}

/// [`write_replacing`] with bytes.
pub(crate) fn write_bytes_replacing(path: &Path, bytes: &[u8]) -> std::io::Result<()> {
    write_replacing(path, |file| file.write_all(bytes))
}

/// `NAME.tmp` beside `path` (`.tmp` added, not the extension replaced: `model.json` and
/// `model.toml` in one directory must not share one).
fn temporary_beside(path: &Path) -> PathBuf {
    let mut name = path.file_name().unwrap_or_default().to_os_string();
    name.push(".tmp");
    path.with_file_name(name)
}

/// The error's text, with what to do about the usual causes.
fn explained(e: &std::io::Error) -> String {
    use rustix::io::Errno;
    match Errno::from_io_error(e) {
        Some(Errno::NOSPC) => format!("{e}: free space on its file system"),
        Some(Errno::DQUOT) => format!("{e}: the daemon's user is over its disk quota"),
        Some(Errno::ACCESS | Errno::PERM | Errno::ROFS) => format!("{e}: the daemon's user cannot write there"),
        _ => e.to_string(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_failed_write_leaves_the_file_as_it_was_and_no_temporary() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("model.json");
        write_bytes_replacing(&path, b"first").unwrap();
        let failed = write_replacing(&path, |file| {
            file.write_all(b"half")?;
            Err(rustix::io::Errno::NOSPC.into())
        })
        .unwrap_err();
        assert!(failed.to_string().contains("free space"), "{failed}");
        assert_eq!(std::fs::read(&path).unwrap(), b"first");
        let names: Vec<_> = std::fs::read_dir(dir.path())
            .unwrap()
            .map(|e| e.unwrap().file_name())
            .collect();
        assert_eq!(names, vec![std::ffi::OsString::from("model.json")]);
        write_bytes_replacing(&path, b"second").unwrap();
        assert_eq!(std::fs::read(&path).unwrap(), b"second");
    }
}
