//! The kernels the daemon runs and their ids: the built-in library first (ids in library
//! order), then the kernels of the operator's packages (`agora serve --kernels DIR`, `[kernels]
//! paths`), loaded at start and again on `agora kernels reload`.
//!
//! Ids are stable for the daemon's lifetime: a reload appends the kernels it adds or changes and
//! points their names at the new ids, and keeps every earlier id working (a client that looked
//! a kernel up before the reload, and the tasks it queued, run the version it looked up). A
//! package that no longer loads keeps its previous version and the reload reports why. Kernels
//! of tenant programs are not here: they belong to their session (see `crate::programs`) and
//! have ids with [`SESSION_KERNEL_BIT`] set.
//!
//! Owns the table and reloading it. Must not: run kernels or know about sessions. The
//! dispatcher reads a snapshot ([`KernelTable`]) and refreshes it only when the registry's
//! generation changed, so the hot path pays one relaxed atomic load per task.

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use agora_kernels::KernelRef;
use agora_protocol::control::{KernelListing, PackageListing, ReloadReport};

/// Kernel ids with this bit set name a kernel of the session's own programs.
pub const SESSION_KERNEL_BIT: u32 = agora_protocol::completion::SESSION_KERNEL_BIT;

/// One package as loaded.
#[derive(Debug, Clone)]
struct PackageState {
    name: String,
    version: Option<String>,
    dir: PathBuf,
    /// Kernel name → (id, fingerprint, implementations).
    kernels: Vec<(String, u32, [u8; 32], Vec<&'static str>)>,
}

/// A snapshot of every kernel: what the dispatcher validates launches against.
#[derive(Debug, Default)]
pub struct KernelTable {
    /// Every kernel ever loaded, by id (earlier versions stay for their ids).
    by_id: Vec<KernelRef>,
    /// Current name → id.
    by_name: HashMap<String, u32>,
    packages: Vec<PackageState>,
}

impl KernelTable {
    /// The built-in library alone.
    fn library() -> Self {
        let mut table = KernelTable::default();
        for (id, kernel) in agora_kernels::library().iter().enumerate() {
            table.by_id.push(KernelRef::Static(kernel));
            table.by_name.insert(kernel.name.to_string(), id as u32);
        }
        table
    }

    /// The kernel with id `id` (of the library or a package).
    #[inline]
    pub fn get(&self, id: u32) -> Option<&KernelRef> {
        self.by_id.get(id as usize)
    }

    /// The current kernel named `name` and its id.
    pub fn find(&self, name: &str) -> Option<(u32, &KernelRef)> {
        let id = *self.by_name.get(name)?;
        Some((id, &self.by_id[id as usize]))
    }

    /// Current names close to `name`, for "did you mean".
    pub fn suggestions(&self, name: &str) -> Vec<String> {
        let mut names: Vec<&str> = self.by_name.keys().map(String::as_str).collect();
        names.sort_unstable();
        agora_kernels::suggestions_among(name, names.into_iter())
    }

    /// The current kernels in id order.
    pub fn current(&self) -> Vec<(u32, &KernelRef)> {
        let mut ids: Vec<u32> = self.by_name.values().copied().collect();
        ids.sort_unstable();
        ids.into_iter().map(|id| (id, &self.by_id[id as usize])).collect()
    }

    /// The listing `agora kernels` prints: every current kernel with where it comes from and
    /// its implementations, and every package.
    pub fn listing(&self) -> (Vec<KernelListing>, Vec<PackageListing>) {
        let mut origin: HashMap<u32, (&str, &Vec<&'static str>)> = HashMap::new();
        for package in &self.packages {
            for (_, id, _, implementations) in &package.kernels {
                origin.insert(*id, (&package.name, implementations));
            }
        }
        let kernels = self
            .current()
            .into_iter()
            .map(|(id, kernel)| {
                let (package, implementations) = match origin.get(&id) {
                    Some((package, implementations)) => (
                        Some(package.to_string()),
                        implementations.iter().map(|s| s.to_string()).collect(),
                    ),
                    None => {
                        let mut implementations = Vec::new();
                        if kernel.cpu.is_some() {
                            implementations.push("cpu".to_string());
                        }
                        match &kernel.opencl {
                            // A tenant program outside `[programs] in_daemon`: GPUs only, fenced.
                            Some(imp) if agora_kernels::runs_only_fenced(&imp.program) => {
                                implementations.push("cuda (fenced)".to_string())
                            }
                            Some(_) => implementations.push("opencl".to_string()),
                            None => {}
                        }
                        (None, implementations)
                    }
                };
                KernelListing {
                    id,
                    signature: kernel.signature(),
                    package,
                    implementations,
                    chunkable: kernel.chunkable,
                }
            })
            .collect();
        let packages = self
            .packages
            .iter()
            .map(|p| PackageListing {
                name: p.name.clone(),
                version: p.version.clone(),
                dir: p.dir.display().to_string(),
                kernels: p.kernels.len() as u32,
            })
            .collect();
        (kernels, packages)
    }
}

/// The registry: the current table, the package paths, and a generation that changes with
/// every reload that changed something.
#[derive(Debug)]
pub struct KernelRegistry {
    paths: Vec<PathBuf>,
    current: Mutex<Arc<KernelTable>>,
    generation: AtomicU64,
    /// Serialises reloads (the control thread runs them; a test may too).
    reloading: Mutex<()>,
}

/// Why the daemon could not start with its packages.
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
pub struct PackagesError(pub String);

impl KernelRegistry {
    /// The library and the packages found under `paths`. Fails when a package does not load
    /// or two define the same kernel: an operator who asked for a package gets it or an error,
    /// never a daemon quietly without it.
    pub fn load(paths: Vec<PathBuf>) -> Result<Self, PackagesError> {
        let registry = KernelRegistry {
            paths,
            current: Mutex::new(Arc::new(KernelTable::library())),
            generation: AtomicU64::new(0),
            reloading: Mutex::new(()),
        };
        let report = registry.reload();
        if let Some(problem) = report.errors.first() {
            return Err(PackagesError(problem.clone()));
        }
        Ok(registry)
    }

    /// The library alone (no packages).
    pub fn library_only() -> Self {
        KernelRegistry {
            paths: Vec::new(),
            current: Mutex::new(Arc::new(KernelTable::library())),
            generation: AtomicU64::new(0),
            reloading: Mutex::new(()),
        }
    }

    /// The current table.
    pub fn snapshot(&self) -> Arc<KernelTable> {
        self.current.lock().unwrap_or_else(|e| e.into_inner()).clone()
    }

    /// Changes whenever the table does.
    #[inline]
    pub fn generation(&self) -> u64 {
        self.generation.load(Ordering::Acquire)
    }

    /// Loads every package under the registry's paths again: new packages and changed kernels
    /// get new ids, unchanged kernels keep theirs, a package that fails to load keeps its
    /// previous version (the report says why), and a kernel name defined by two packages is
    /// refused (the package loaded first keeps it).
    pub fn reload(&self) -> ReloadReport {
        let _serial = self.reloading.lock().unwrap_or_else(|e| e.into_inner());
        let old = self.snapshot();
        let mut report = ReloadReport::default();
        let mut by_id = old.by_id.clone();
        let mut by_name: HashMap<String, u32> = agora_kernels::library()
            .iter()
            .enumerate()
            .map(|(id, k)| (k.name.to_string(), id as u32))
            .collect();
        let mut packages: Vec<PackageState> = Vec::new();
        let mut dirs = Vec::new();
        for path in &self.paths {
            match agora_packages::discover(path) {
                Ok(found) => dirs.extend(found),
                Err(error) => {
                    // A path that cannot be read now (an NFS mount briefly away, a directory
                    // being replaced) unloads nothing: its packages keep their previous version,
                    // as the report says, and are loaded again from there.
                    let mut kept = Vec::new();
                    for p in old.packages.iter().filter(|p| p.dir.starts_with(path)) {
                        if claim(&mut by_name, p, &mut report) {
                            packages.push(p.clone());
                            kept.push(p.name.clone());
                        }
                    }
                    report.errors.push(if kept.is_empty() {
                        format!("{}: {error}", path.display())
                    } else {
                        format!(
                            "{}: {error} (its packages {} keep their previous version)",
                            path.display(),
                            kept.join(", ")
                        )
                    });
                }
            }
        }
        // One package reached through two paths (the default and --kernels) is one package.
        let mut seen = std::collections::HashSet::new();
        dirs.retain(|dir| seen.insert(dir.canonicalize().unwrap_or_else(|_| dir.clone())));
        for dir in dirs {
            let previous = old.packages.iter().find(|p| p.dir == dir);
            let loaded = match agora_packages::load(&dir) {
                Ok(package) => package,
                Err(error) => {
                    report.errors.push(match previous {
                        Some(p) => format!("{error} (package {} keeps its previous version)", p.name),
                        None => error.to_string(),
                    });
                    if let Some(p) = previous {
                        if claim(&mut by_name, p, &mut report) {
                            packages.push(p.clone());
                        }
                    }
                    continue;
                }
            };
            let mut state = PackageState {
                name: loaded.name.clone(),
                version: loaded.version.clone(),
                dir: dir.clone(),
                kernels: Vec::new(),
            };
            for kernel in loaded.kernels {
                let name = kernel.def.name.to_string();
                let unchanged = previous
                    .and_then(|p| p.kernels.iter().find(|(n, ..)| *n == name))
                    .filter(|(_, _, fingerprint, _)| *fingerprint == kernel.fingerprint);
                let id = match unchanged {
                    Some((_, id, ..)) => *id,
                    None => {
                        by_id.push(KernelRef::Shared(Arc::new(kernel.def)));
                        report.changed.push(name.clone());
                        (by_id.len() - 1) as u32
                    }
                };
                state
                    .kernels
                    .push((name, id, kernel.fingerprint, kernel.implementations));
            }
            if claim(&mut by_name, &state, &mut report) {
                report.packages.push(state.name.clone());
                packages.push(state);
            }
        }
        for p in &old.packages {
            if !packages.iter().any(|q| q.dir == p.dir) && !report.errors.iter().any(|e| e.contains(&p.name)) {
                report.removed.push(p.name.clone());
            }
        }
        let changed = by_id.len() != old.by_id.len() || by_name != old.by_name;
        let table = Arc::new(KernelTable {
            by_id,
            by_name,
            packages,
        });
        report.kernels = table.by_name.len() as u32;
        *self.current.lock().unwrap_or_else(|e| e.into_inner()) = table;
        if changed {
            self.generation.fetch_add(1, Ordering::AcqRel);
        }
        report
    }
}

/// Points the names of `package`'s kernels at their ids, unless one is taken (by the library or
/// a package claimed before): then the whole package is refused and `false` returned.
fn claim(by_name: &mut HashMap<String, u32>, package: &PackageState, report: &mut ReloadReport) -> bool {
    if let Some((name, ..)) = package.kernels.iter().find(|(name, ..)| by_name.contains_key(name)) {
        report.errors.push(format!(
            "package {} at {} defines kernel {name}, which another package (or the built-in library) already defines; rename it",
            package.name,
            package.dir.display()
        ));
        return false;
    }
    for (name, id, ..) in &package.kernels {
        by_name.insert(name.clone(), *id);
    }
    true
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_library_keeps_its_ids() {
        let registry = KernelRegistry::library_only();
        let table = registry.snapshot();
        for (id, kernel) in agora_kernels::library().iter().enumerate() {
            assert_eq!(table.find(&kernel.name).map(|(i, _)| i), Some(id as u32));
            assert!(table.get(id as u32).unwrap().same(&KernelRef::Static(kernel)));
        }
        assert!(table.get(agora_kernels::library().len() as u32).is_none());
        assert_eq!(table.suggestions("saxp"), vec!["saxpy".to_string()]);
    }

    /// A copy of the example package examples/packages/imaging (its library built by
    /// scripts/build-packages.sh) in a directory of packages.
    fn imaging_copy() -> tempfile::TempDir {
        let repository = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
        let status = std::process::Command::new("bash")
            .arg(repository.join("scripts/build-packages.sh"))
            .status()
            .unwrap();
        assert!(status.success());
        let root = tempfile::tempdir().unwrap();
        let dir = root.path().join("imaging");
        std::fs::create_dir(&dir).unwrap();
        for file in ["package.toml", "imaging.cl", "imaging.cu", "libimaging.so"] {
            std::fs::copy(repository.join("examples/packages/imaging").join(file), dir.join(file)).unwrap();
        }
        root
    }

    #[test]
    fn packages_load_and_reload_keeping_unchanged_ids() {
        let root = imaging_copy();
        let registry = KernelRegistry::load(vec![root.path().to_path_buf()]).unwrap();
        let table = registry.snapshot();
        let (blur, kernel) = table.find("imaging.blur").unwrap();
        assert_eq!(kernel.label(), "imaging.blur");
        let (scale, _) = table.find("imaging.scale").unwrap();
        let (kernels, packages) = table.listing();
        assert_eq!(packages.len(), 1);
        assert_eq!((packages[0].name.as_str(), packages[0].kernels), ("imaging", 2));
        let listed = kernels.iter().find(|k| k.id == blur).unwrap();
        assert_eq!(listed.package.as_deref(), Some("imaging"));
        assert_eq!(
            listed.implementations,
            vec!["opencl".to_string(), "cuda".to_string(), "cpu".to_string()]
        );

        // Nothing changed: same ids, same generation.
        let generation = registry.generation();
        let report = registry.reload();
        assert!(report.errors.is_empty() && report.changed.is_empty(), "{report:?}");
        assert_eq!(registry.generation(), generation);
        assert_eq!(registry.snapshot().find("imaging.blur").unwrap().0, blur);

        // An edited OpenCL source changes both kernels that use it; the old ids keep working.
        let cl = root.path().join("imaging/imaging.cl");
        let source = std::fs::read_to_string(&cl).unwrap();
        std::fs::write(&cl, format!("{source}\n// edited\n")).unwrap();
        let report = registry.reload();
        assert!(report.errors.is_empty(), "{report:?}");
        let mut changed = report.changed.clone();
        changed.sort();
        assert_eq!(changed, vec!["imaging.blur".to_string(), "imaging.scale".to_string()]);
        assert!(registry.generation() > generation);
        let table = registry.snapshot();
        let (new_blur, _) = table.find("imaging.blur").unwrap();
        assert_ne!(new_blur, blur);
        assert!(table.get(blur).is_some() && table.get(scale).is_some());

        // A broken manifest keeps the previous version and says where the problem is.
        let manifest = root.path().join("imaging/package.toml");
        let text = std::fs::read_to_string(&manifest).unwrap();
        std::fs::write(
            &manifest,
            text.replace("sizes = { src = \"w * h\"", "sizes = { src = \"w * hh\""),
        )
        .unwrap();
        let report = registry.reload();
        assert_eq!(report.errors.len(), 1, "{report:?}");
        assert!(
            report.errors[0].contains("package.toml:26: kernels.blur.sizes.src: `w * hh` names `hh`"),
            "{report:?}"
        );
        assert!(report.errors[0].contains("keeps its previous version"), "{report:?}");
        assert_eq!(registry.snapshot().find("imaging.blur").unwrap().0, new_blur);
    }

    /// A package path that cannot be read at a reload (a mount briefly away) unloads nothing:
    /// its packages keep their previous version, as the report says, and come back from it.
    #[test]
    fn a_package_path_gone_at_a_reload_keeps_its_packages() {
        let root = imaging_copy();
        let registry = KernelRegistry::load(vec![root.path().to_path_buf()]).unwrap();
        let (blur, _) = registry.snapshot().find("imaging.blur").unwrap();
        let moved = root.path().with_extension("moved");
        std::fs::rename(root.path(), &moved).unwrap();
        let report = registry.reload();
        std::fs::rename(&moved, root.path()).unwrap();
        assert!(report.removed.is_empty(), "{report:?}");
        assert_eq!(report.errors.len(), 1, "{report:?}");
        assert!(
            report.errors[0].contains("its packages imaging keep their previous version"),
            "{report:?}"
        );
        assert_eq!(registry.snapshot().find("imaging.blur").unwrap().0, blur);
        let report = registry.reload();
        assert!(report.errors.is_empty() && report.removed.is_empty(), "{report:?}");
    }
}
