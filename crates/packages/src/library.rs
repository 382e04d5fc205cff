//! Loading a package's shared object: its ELF header checked before `dlopen` (a library built
//! for another machine is named as such, not as an obscure loader error), loaded with every
//! symbol bound at once (`RTLD_NOW`: an undefined function fails the load, not a launch), and
//! loaded from a private copy named by the daemon, so a library rebuilt in place and reloaded is
//! really loaded again (the dynamic loader hands back an already loaded object for a path it
//! has seen, however the file changed).

use std::path::Path;
use std::sync::{Arc, Mutex, Weak};

use libloading::Library;

/// Checks that `bytes` are an ELF shared object for the machine this process runs on.
pub(crate) fn check_elf(bytes: &[u8]) -> Result<(), String> {
    if bytes.len() < 20 || &bytes[..4] != b"\x7fELF" {
        return Err("is not an ELF shared object (build it with `cc -shared -fPIC`)".into());
    }
    let (class, data) = (bytes[4], bytes[5]);
    let half = |at: usize| {
        let b = [bytes[at], bytes[at + 1]];
        if data == 2 {
            u16::from_be_bytes(b)
        } else {
            u16::from_le_bytes(b)
        }
    };
    let (e_type, machine) = (half(16), half(18));
    let wide = class == 2;
    let arch: String = match machine {
        2 => "sparc".into(),
        3 => "x86".into(),
        8 if wide => "mips64".into(),
        8 => "mips".into(),
        20 => "powerpc".into(),
        21 => "powerpc64".into(),
        22 if wide => "s390x".into(),
        22 => "s390".into(),
        40 => "arm".into(),
        43 => "sparc64".into(),
        62 => "x86_64".into(),
        183 => "aarch64".into(),
        243 if wide => "riscv64".into(),
        243 => "riscv32".into(),
        258 => "loongarch64".into(),
        other => format!("ELF machine type {other}"),
    };
    let here = std::env::consts::ARCH;
    let big = data == 2;
    if arch != here {
        return Err(format!(
            "was built for {arch}, this daemon runs on {here}; build it on (or for) this machine"
        ));
    }
    if wide != (usize::BITS == 64) || big != cfg!(target_endian = "big") {
        let describe = |wide: bool, big: bool| {
            format!(
                "{}-bit {}-endian",
                if wide { 64 } else { 32 },
                if big { "big" } else { "little" }
            )
        };
        return Err(format!(
            "was built for {arch} {}, this daemon runs on {here} {}",
            describe(wide, big),
            describe(usize::BITS == 64, cfg!(target_endian = "big"))
        ));
    }
    match e_type {
        3 => Ok(()),
        1 => Err("is a relocatable object (.o), not a shared object (build it with `cc -shared -fPIC`)".into()),
        2 => Err("is an executable, not a shared object (build it with `cc -shared -fPIC`)".into()),
        other => Err(format!("is an ELF file of type {other}, not a shared object")),
    }
}

/// Libraries loaded by this process, by the hash of their bytes: a reload of an unchanged
/// library while its kernels are in use shares the loaded copy.
static LOADED: Mutex<Vec<([u8; 32], Weak<Library>)>> = Mutex::new(Vec::new());

/// Loads the shared object at `path`, whose contents are `bytes` with hash `hash`.
pub(crate) fn open(path: &Path, bytes: &[u8], hash: [u8; 32]) -> Result<Arc<Library>, String> {
    let mut loaded = LOADED.lock().unwrap_or_else(|e| e.into_inner());
    loaded.retain(|(_, lib)| lib.strong_count() > 0);
    if let Some(lib) = loaded
        .iter()
        .find(|(h, _)| *h == hash)
        .and_then(|(_, lib)| lib.upgrade())
    {
        return Ok(lib);
    }
    // A private copy first; where that cannot be loaded (a temporary directory mounted
    // noexec), the file itself (then a library rebuilt in place while its previous version is
    // still in use may not be loaded again before the daemon restarts).
    let lib = match open_copy(path, bytes) {
        Ok(lib) => lib,
        Err(_) => open_now(path)?,
    };
    let lib = Arc::new(lib);
    loaded.push((hash, Arc::downgrade(&lib)));
    Ok(lib)
}

fn open_now(path: &Path) -> Result<Library, String> {
    use libloading::os::unix::{Library as UnixLibrary, RTLD_LOCAL, RTLD_NOW};
    // SAFETY: loading runs the library's initialisers: packages are installed by the operator
    // and trusted like the daemon itself (documented in docs/KERNELS.md).
    unsafe { UnixLibrary::open(Some(path), RTLD_NOW | RTLD_LOCAL) }
        .map(Library::from)
        .map_err(|e| e.to_string())
}

/// Loads `bytes` from a fresh file in a new directory only this process can write, then removes
/// both (the loaded object stays mapped).
fn open_copy(path: &Path, bytes: &[u8]) -> Result<Library, String> {
    use std::io::Write;
    use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt};
    use std::sync::atomic::{AtomicU64, Ordering};
    static NEXT: AtomicU64 = AtomicU64::new(0);
    let dir = loop {
        let dir = std::env::temp_dir().join(format!(
            "agora-package-{}-{}",
            std::process::id(),
            NEXT.fetch_add(1, Ordering::Relaxed)
        ));
        // `create` (not `create_all`) fails on anything already there, a symbolic link
        // included: the directory is new and ours.
        match std::fs::DirBuilder::new().mode(0o700).create(&dir) {
            Ok(()) => break dir,
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => continue,
            Err(e) => return Err(e.to_string()),
        }
    };
    let file = dir.join(path.file_name().unwrap_or_else(|| "library.so".as_ref()));
    let result = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(&file)
        .and_then(|mut f| f.write_all(bytes))
        .map_err(|e| e.to_string())
        .and_then(|()| open_now(&file));
    let _ = std::fs::remove_file(&file);
    let _ = std::fs::remove_dir(&dir);
    result
}

#[cfg(test)]
mod tests {
    use super::*;

    fn header(class: u8, data: u8, e_type: u16, machine: u16) -> Vec<u8> {
        let mut b = vec![0u8; 64];
        b[..4].copy_from_slice(b"\x7fELF");
        b[4] = class;
        b[5] = data;
        let (t, m) = if data == 2 {
            (e_type.to_be_bytes(), machine.to_be_bytes())
        } else {
            (e_type.to_le_bytes(), machine.to_le_bytes())
        };
        b[16..18].copy_from_slice(&t);
        b[18..20].copy_from_slice(&m);
        b
    }

    #[test]
    fn names_the_architecture() {
        let native = match std::env::consts::ARCH {
            "x86_64" => 62,
            "aarch64" => 183,
            _ => return, // the checks below are written for the two common hosts
        };
        check_elf(&header(2, 1, 3, native)).unwrap();
        let other = if native == 62 { (183, "aarch64") } else { (62, "x86_64") };
        let err = check_elf(&header(2, 1, 3, other.0)).unwrap_err();
        assert!(
            err.contains(&format!(
                "built for {}, this daemon runs on {}",
                other.1,
                std::env::consts::ARCH
            )),
            "{err}"
        );
        let err = check_elf(&header(2, 1, 3, 9999)).unwrap_err();
        assert!(err.contains("ELF machine type 9999"), "{err}");
        let err = check_elf(&header(2, 1, 1, native)).unwrap_err();
        assert!(err.contains("relocatable object"), "{err}");
        let err = check_elf(&header(2, 1, 2, native)).unwrap_err();
        assert!(err.contains("executable"), "{err}");
        let err = check_elf(&header(2, 2, 3, native)).unwrap_err();
        assert!(err.contains("big-endian"), "{err}");
        let err = check_elf(b"#!/bin/sh\necho hello\n").unwrap_err();
        assert!(err.contains("not an ELF shared object"), "{err}");
    }
}
