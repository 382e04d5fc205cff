//! Kernel packages: operator-installed directories of kernels the daemon loads at start and on
//! `agora kernels reload` (trusted code, like the built-in library).
//!
//! A package is a directory with a manifest, [`MANIFEST`], and the files it names: OpenCL C
//! sources and a shared object with C-ABI CPU functions (`agora_kernel.h`). Loading one yields
//! [`KernelDef`]s the scheduler treats like the library's: named `package.kernel`, checked
//! against size rules before they run, placed only on devices that have an implementation.
//!
//! Owns: parsing and checking manifests (errors name the file, line and key), size rules,
//! reading sources and loading shared objects. Must not: know about sessions, devices or the
//! daemon's kernel ids.

use std::path::{Path, PathBuf};

use agora_kernels::KernelDef;

/// The manifest's file name in a package directory.
pub const MANIFEST: &str = "package.toml";

/// A loaded package.
#[derive(Debug)]
pub struct Package {
    /// Its name (the manifest's `[package] name`), the prefix of its kernels' names.
    pub name: String,
    /// Its version, when the manifest gives one.
    pub version: Option<String>,
    /// The directory it was loaded from.
    pub dir: PathBuf,
    /// Its kernels.
    pub kernels: Vec<PackageKernel>,
}

/// One kernel of a package.
#[derive(Debug)]
pub struct PackageKernel {
    /// The definition (name `package.kernel`).
    pub def: KernelDef,
    /// A hash of everything that defines the kernel (its manifest entry, the sources and shared
    /// object it uses): equal fingerprints mean a reload changed nothing for it.
    pub fingerprint: [u8; 32],
    /// Its implementations, for listings: `opencl`, `cpu`.
    pub implementations: Vec<&'static str>,
}

/// Why a package could not be loaded.
#[derive(Debug, thiserror::Error)]
pub enum PackageError {
    /// Not written yet.
    #[error("{0}")]
    Other(String),
}

/// The package directories under `path`: `path` itself when it holds a [`MANIFEST`], else each
/// subdirectory that does (sorted by name).
pub fn discover(path: &Path) -> Result<Vec<PathBuf>, PackageError> {
    let _ = path;
    Err(PackageError::Other("kernel packages are not implemented yet".into()))
}

/// Loads the package in `dir`.
pub fn load(dir: &Path) -> Result<Package, PackageError> {
    let _ = dir;
    Err(PackageError::Other("kernel packages are not implemented yet".into()))
}
