//! Kernel packages: operator-installed directories of kernels the daemon loads at start and on
//! `agora kernels reload` (trusted code, like the built-in library).
//!
//! A package is a directory with a manifest, [`MANIFEST`], and the files it names: OpenCL C
//! sources, CUDA C or PTX files and a shared object with C-ABI CPU functions
//! (`agora_kernel.h`). Loading one yields [`KernelDef`]s the scheduler treats like the
//! library's: named `package.kernel`, checked against size rules before they run, placed only on
//! devices that have an implementation.
//! The manifest format is documented in `docs/KERNELS.md` ("Package manifest");
//! [`program_manifest`] reads the same `[kernels.NAME]` tables for tenant programs.
//!
//! Owns: parsing and checking manifests (errors name the file, line and key), size rules,
//! reading sources and loading shared objects. Must not: know about sessions, devices or the
//! daemon's kernel ids.

use std::borrow::Cow;
use std::collections::{BTreeSet, HashMap};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use agora_kernels::{Cost, CpuImpl, CudaCode, CudaImpl, KernelDef, NativeCpuFn, OpenClImpl, Param, SizeCheck};
use sha2::{Digest, Sha256};

mod expr;
mod library;
mod manifest;
mod rules;

use manifest::{Mode, Source};

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
    /// Its implementations, for listings: `opencl`, `cuda`, `cpu` (in this order).
    pub implementations: Vec<&'static str>,
}

/// Why a package could not be loaded.
#[derive(Debug, thiserror::Error)]
pub enum PackageError {
    /// The manifest (or a file or library it names) is wrong: where, and what.
    #[error("{file}:{line}: {key}: {message}")]
    Manifest {
        /// The manifest file (or a tenant program's name).
        file: String,
        /// The line (1-based) of the offending key or value.
        line: usize,
        /// The dotted key, e.g. `kernels.scale.sizes.x`.
        key: String,
        /// What is wrong.
        message: String,
    },
    /// A file could not be read.
    #[error("{}: {error}", .path.display())]
    Io {
        /// The file.
        path: PathBuf,
        /// Why.
        #[source]
        error: std::io::Error,
    },
    /// Something else (e.g. a package path that is not a directory).
    #[error("{0}")]
    Other(String),
}

/// A kernel described by a tenant program's manifest (the `[kernels.NAME]` tables of the
/// package format, without a `[package]` table or file paths): what the daemon needs besides
/// the program's code.
#[derive(Debug, Clone)]
pub struct KernelSpec {
    /// The kernel's name as in the manifest (`NAME` of `[kernels.NAME]`).
    pub name: String,
    /// Its `doc`.
    pub doc: String,
    /// Its parameters (names owned, not leaked).
    pub params: Vec<Param>,
    /// The dimensions its range may have (1 to 3).
    pub dims: u8,
    /// Its size rules and requirements.
    pub check: SizeCheck,
    /// Whether dimension 0 may be split.
    pub chunkable: bool,
    /// Its cost hint.
    pub cost: Cost,
    /// The C function of the program's shared object (`cpu = { symbol = ... }`; the kernel's name
    /// when the table gives none).
    pub cpu_symbol: Option<String>,
    /// The OpenCL entry point (`opencl = { entry = ... }`; the kernel's name when the table
    /// gives none).
    pub opencl_entry: Option<String>,
    /// The OpenCL work-group size the kernel requires (`opencl = { local = [...] }`).
    pub opencl_local: Option<[usize; 3]>,
    /// The CUDA entry point (`cuda = { entry = ... }`; the kernel's name when the table gives
    /// none).
    pub cuda_entry: Option<String>,
}

/// The package directories under `path`: `path` itself when it holds a [`MANIFEST`], else each
/// subdirectory that does (sorted by name).
pub fn discover(path: &Path) -> Result<Vec<PathBuf>, PackageError> {
    if path.join(MANIFEST).is_file() {
        return Ok(vec![path.to_path_buf()]);
    }
    let entries = std::fs::read_dir(path).map_err(|e| {
        PackageError::Other(format!(
            "cannot list the directory ({e}); give a package directory (with {MANIFEST}) or a directory of packages"
        ))
    })?;
    let mut dirs = Vec::new();
    for entry in entries {
        let entry = entry.map_err(|e| PackageError::Other(format!("cannot list the directory ({e})")))?;
        let dir = entry.path();
        if dir.join(MANIFEST).is_file() {
            dirs.push(dir);
        }
    }
    dirs.sort();
    Ok(dirs)
}

/// The kernel package directories the daemon loads by default (a configuration file's `[kernels]
/// paths` replaces them, `--kernels DIR` adds to them): `$AGORA_KERNEL_PATH` (colon-separated;
/// empty: none) when set, else those of these that exist:
/// `PREFIX/share/agora/packages` for an installed `PREFIX/bin/agora`, and `examples/packages`
/// of the source checkout a `target/{release,debug}/agora` was built in.
pub fn default_paths() -> Vec<PathBuf> {
    if let Some(list) = std::env::var_os("AGORA_KERNEL_PATH") {
        return std::env::split_paths(&list)
            .filter(|p| !p.as_os_str().is_empty())
            .collect();
    }
    let Some(bin) = std::env::current_exe()
        .ok()
        .and_then(|e| e.parent().map(Path::to_path_buf))
    else {
        return Vec::new();
    };
    [bin.join("../share/agora/packages"), bin.join("../../examples/packages")]
        .into_iter()
        .filter(|p| p.is_dir())
        .filter_map(|p| p.canonicalize().ok())
        .collect()
}

/// The kernel named `name` (`package.kernel`) of the first package under `paths` that defines it,
/// for tools that run a package's kernel without a daemon (the native baselines of the
/// benchmarks). Packages that do not load are skipped.
pub fn find_kernel(paths: &[PathBuf], name: &str) -> Option<KernelDef> {
    for path in paths {
        for dir in discover(path).unwrap_or_default() {
            let Ok(loaded) = load(&dir) else { continue };
            if let Some(kernel) = loaded.kernels.into_iter().find(|k| k.def.name == name) {
                return Some(kernel.def);
            }
        }
    }
    None
}

/// Loads the package in `dir`.
pub fn load(dir: &Path) -> Result<Package, PackageError> {
    let manifest_path = dir.join(MANIFEST);
    let text = std::fs::read_to_string(&manifest_path).map_err(|error| PackageError::Io {
        path: manifest_path.clone(),
        error,
    })?;
    let file = manifest_path.display().to_string();
    let src = Source {
        file: &file,
        text: &text,
    };
    let manifest = manifest::parse(&file, &text, Mode::Package)?;
    let package = manifest
        .package
        .ok_or_else(|| PackageError::Other("a package manifest without [package]".into()))?;
    let library = match &package.library {
        None => None,
        Some(lib) => {
            let path = dir.join(&lib.value);
            let bytes = std::fs::read(&path)
                .map_err(|e| src.error(&lib.span, &lib.key, format!("cannot read {}: {e}", path.display())))?;
            library::check_elf(&bytes)
                .map_err(|m| src.error(&lib.span, &lib.key, format!("{} {m}", path.display())))?;
            let hash: [u8; 32] = Sha256::digest(&bytes).into();
            let loaded = library::open(&path, &bytes, hash)
                .map_err(|m| src.error(&lib.span, &lib.key, format!("cannot load {}: {m}", path.display())))?;
            Some((loaded, hash, path))
        }
    };
    // OpenCL, CUDA C and PTX sources by file name: (text, hash).
    let mut sources: HashMap<String, (Arc<str>, [u8; 32])> = HashMap::new();
    let mut kernels = Vec::new();
    for mut entry in manifest.kernels {
        let name = format!("{}.{}", package.name, entry.name);
        entry.rules.set_kernel(name.clone());
        let mut hasher = Sha256::new();
        hasher.update(package.name.as_bytes());
        hasher.update([0]);
        hasher.update(entry.canonical.as_bytes());
        let mut implementations = Vec::new();
        let opencl = match &entry.opencl {
            None => None,
            Some(cl) => {
                let Some(file) = &cl.file else {
                    return Err(PackageError::Other("an OpenCL implementation without a file".into()));
                };
                let (source, hash) = package_source(&mut sources, dir, &src, file)?;
                if !declares_kernel(&source, &cl.entry.value) {
                    return Err(src.error(
                        &cl.entry.span,
                        &cl.entry.key,
                        format!(
                            "{} has no `__kernel void {}(`: no such OpenCL kernel",
                            dir.join(&file.value).display(),
                            cl.entry.value
                        ),
                    ));
                }
                hasher.update(b"\0opencl\0");
                hasher.update(hash);
                implementations.push("opencl");
                let mut binaries = Vec::new();
                let mut program_hash = Sha256::new();
                program_hash.update(hash);
                for (device, file) in &cl.binaries {
                    let path = dir.join(&file.value);
                    let bytes = std::fs::read(&path).map_err(|e| {
                        src.error(
                            &file.span,
                            &file.key,
                            format!("cannot read the binary {}: {e}", path.display()),
                        )
                    })?;
                    let digest: [u8; 32] = Sha256::digest(&bytes).into();
                    hasher.update(b"\0binary\0");
                    hasher.update(digest);
                    program_hash.update(device.as_bytes());
                    program_hash.update(digest);
                    binaries.push(agora_kernels::OpenClBinary {
                        device: Cow::Owned(device.clone()),
                        bytes: bytes.into(),
                    });
                }
                // The program's cache key changes with the source and with the binaries.
                let program_hash: [u8; 32] = if binaries.is_empty() {
                    hash
                } else {
                    program_hash.finalize().into()
                };
                Some(OpenClImpl {
                    program: Cow::Owned(format!("{}/{}@{}", package.name, file.value, hex(&program_hash[..8]))),
                    source: Cow::Owned(source.to_string()),
                    entry: Cow::Owned(cl.entry.value.clone()),
                    local: cl.local,
                    binaries: binaries.into(),
                })
            }
        };
        let cuda = match &entry.cuda {
            None => None,
            Some(cu) => {
                let Some(file) = &cu.file else {
                    return Err(PackageError::Other("a CUDA implementation without a file".into()));
                };
                let path = dir.join(&file.value);
                let (source, hash) = package_source(&mut sources, dir, &src, file)?;
                let text = Cow::Owned(source.to_string());
                let code = if file.value.ends_with(".ptx") {
                    CudaCode::Ptx(text)
                } else {
                    CudaCode::Source(text)
                };
                let count = cuda_entry_parameters(&code, &cu.entry.value)
                    .map_err(|m| src.error(&cu.entry.span, &cu.entry.key, format!("{} {m}", path.display())))?;
                let guarded = convention(&cu.entry.value, count, entry.params.len())
                    .map_err(|m| src.error(&cu.span, &cu.key, format!("{}: {m}", path.display())))?;
                hasher.update(b"\0cuda\0");
                hasher.update(hash);
                implementations.push("cuda");
                Some(CudaImpl {
                    program: Cow::Owned(format!("{}/{}", package.name, file.value)),
                    code,
                    entry: Cow::Owned(cu.entry.value.clone()),
                    guarded,
                })
            }
        };
        let cpu = match &entry.cpu {
            None => None,
            Some(symbol) => {
                let Some((lib, hash, path)) = &library else {
                    return Err(src.error(
                        &symbol.span,
                        &symbol.key,
                        "a C implementation without [package] library",
                    ));
                };
                // SAFETY: the symbol is declared (agora_kernel.h, docs/KERNELS.md) to be an
                // `AgoraKernelFn`; packages are operator-installed, trusted code. The pointer
                // stays valid while `lib` is loaded, which the keep-alive below guarantees for as
                // long as the definition exists.
                let f: NativeCpuFn = unsafe { lib.get::<NativeCpuFn>(symbol.value.as_bytes()) }
                    .map(|s| *s)
                    .map_err(|e| {
                        src.error(
                            &symbol.span,
                            &symbol.key,
                            format!(
                                "{} has no symbol `{}` ({e}); define it with AGORA_KERNEL (agora_kernel.h), not static",
                                path.display(),
                                symbol.value
                            ),
                        )
                    })?;
                hasher.update(b"\0cpu\0");
                hasher.update(hash);
                implementations.push("cpu");
                let keep: Arc<dyn std::any::Any + Send + Sync> = lib.clone();
                Some(CpuImpl::Native(f, Some(keep)))
            }
        };
        let params: Vec<Param> = entry
            .params
            .iter()
            .map(|(n, kind)| Param {
                name: Cow::Borrowed(intern(n)),
                kind: *kind,
            })
            .collect();
        let def = KernelDef {
            cuda,
            name: Cow::Borrowed(intern(&name)),
            doc: Cow::Borrowed(intern(&entry.doc)),
            params: Cow::Owned(params),
            cost: Cost::PerItemNs(entry.cost_ns),
            chunkable: entry.chunkable,
            check: SizeCheck::Rules(Arc::new(entry.rules)),
            cpu,
            opencl,
        };
        kernels.push(PackageKernel {
            def,
            fingerprint: hasher.finalize().into(),
            implementations,
        });
    }
    Ok(Package {
        name: package.name,
        version: package.version,
        dir: dir.to_path_buf(),
        kernels,
    })
}

/// The text and hash of the package's source `file` (OpenCL C, CUDA C or PTX), read once per
/// load: kernels that name the same file share it.
fn package_source(
    sources: &mut HashMap<String, (Arc<str>, [u8; 32])>,
    dir: &Path,
    src: &Source<'_>,
    file: &manifest::Located<String>,
) -> Result<(Arc<str>, [u8; 32]), PackageError> {
    if let Some((text, hash)) = sources.get(&file.value) {
        return Ok((text.clone(), *hash));
    }
    let path = dir.join(&file.value);
    let text = std::fs::read_to_string(&path)
        .map_err(|e| src.error(&file.span, &file.key, format!("cannot read {}: {e}", path.display())))?;
    let hash: [u8; 32] = Sha256::digest(text.as_bytes()).into();
    let text: Arc<str> = text.into();
    sources.insert(file.value.clone(), (text.clone(), hash));
    Ok((text, hash))
}

/// Reads a tenant program's manifest: `[kernels.NAME]` tables in the package format, without a
/// `[package]` table or file paths (`opencl` takes `entry` and `local`, `cuda` takes `entry`,
/// `cpu` takes `symbol`), and where no implementation is required (the program's code says which
/// it has). `origin` names the manifest in errors (e.g. the program's name).
pub fn program_manifest(text: &str, origin: &str) -> Result<Vec<KernelSpec>, PackageError> {
    let manifest = manifest::parse(origin, text, Mode::Program)?;
    Ok(manifest.kernels.into_iter().map(spec).collect())
}

/// **For the fuzzer only** (`fuzz/`, target `manifest`): parses a package manifest (`package.toml`
/// text) as [`load`] does, without reading the files it names or loading its library, and
/// returns the package's name and its kernels as [`program_manifest`] would. Not an API.
#[doc(hidden)]
pub fn parse_package_manifest(text: &str, file: &str) -> Result<(String, Vec<KernelSpec>), PackageError> {
    let manifest = manifest::parse(file, text, Mode::Package)?;
    let package = manifest
        .package
        .ok_or_else(|| PackageError::Other("a package manifest without [package]".into()))?;
    Ok((package.name, manifest.kernels.into_iter().map(spec).collect()))
}

fn spec(k: manifest::KernelEntry) -> KernelSpec {
    KernelSpec {
        params: k
            .params
            .into_iter()
            .map(|(name, kind)| Param {
                name: Cow::Owned(name),
                kind,
            })
            .collect(),
        dims: k.dims as u8,
        check: SizeCheck::Rules(Arc::new(k.rules)),
        chunkable: k.chunkable,
        cost: Cost::PerItemNs(k.cost_ns),
        cpu_symbol: k.cpu.map(|s| s.value),
        opencl_entry: k.opencl.as_ref().map(|c| c.entry.value.clone()),
        opencl_local: k.opencl.as_ref().and_then(|c| c.local),
        cuda_entry: k.cuda.as_ref().map(|c| c.entry.value.clone()),
        name: k.name,
        doc: k.doc,
    }
}

/// `name` as a `&'static str`, leaked once per distinct text. Kernel definitions of packages
/// use static names: the daemon labels metrics and traces with them (`KernelDef::label`), which
/// it does only for static names. Packages are installed by the operator, so the text leaked is
/// bounded by what the operator installs (a reload of unchanged packages leaks nothing more);
/// tenant programs never come here.
fn intern(name: &str) -> &'static str {
    static NAMES: Mutex<BTreeSet<&'static str>> = Mutex::new(BTreeSet::new());
    let mut names = NAMES.lock().unwrap_or_else(|e| e.into_inner());
    if let Some(known) = names.get(name) {
        return known;
    }
    let leaked: &'static str = Box::leak(name.to_string().into_boxed_str());
    names.insert(leaked);
    leaked
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// Whether the OpenCL C `source` declares `__kernel void entry(` (or `kernel void`, with any
/// spacing and `__attribute__((...))` before `void`), outside comments.
fn declares_kernel(source: &str, entry: &str) -> bool {
    let tokens = tokens(source);
    for (i, t) in tokens.iter().enumerate() {
        if *t != "__kernel" && *t != "kernel" {
            continue;
        }
        let mut j = i + 1;
        // Skip `__attribute__((...))` groups.
        while tokens.get(j) == Some(&"__attribute__") {
            j += 1;
            let mut depth = 0usize;
            while let Some(t) = tokens.get(j) {
                j += 1;
                match *t {
                    "(" => depth += 1,
                    ")" => {
                        depth = depth.saturating_sub(1);
                        if depth == 0 {
                            break;
                        }
                    }
                    _ => {}
                }
            }
        }
        if tokens.get(j) == Some(&"void") && tokens.get(j + 1) == Some(&entry) && tokens.get(j + 2) == Some(&"(") {
            return true;
        }
    }
    false
}

/// The parameters a CUDA kernel entry takes after its declared ones in the guarded convention:
/// `range0, range1, range2`, the revocation flag and the row offset.
const GUARD_PARAMETERS: usize = 5;

/// Whether `entry` of `code` takes the guarded convention (declared + 5) or the plain one
/// (declared only), read from its parameter list; an error says what was found and what each
/// convention expects.
///
/// In CUDA C the entry must be declared `__global__ void ENTRY(` with C linkage (`extern "C"`
/// among its specifiers, or inside an `extern "C" { ... }` block: a C++ name is mangled and the
/// driver would not find it), outside comments; other specifiers (`__launch_bounds__(...)` and
/// the like) may come before `void` or between `void` and the name. In PTX it is a `.entry ENTRY`, whose
/// `.param` declarations are counted. `declared` is the number of parameters the manifest
/// declares.
pub fn cuda_convention(code: &CudaCode, entry: &str, declared: usize) -> Result<bool, String> {
    let what = match code {
        CudaCode::Source(_) => "the CUDA C source",
        CudaCode::Ptx(_) => "the PTX",
    };
    let count = cuda_entry_parameters(code, entry).map_err(|m| format!("{what} {m}"))?;
    convention(entry, count, declared)
}

/// The number of parameters `entry` of `code` takes; the error (which follows the code's name)
/// says the entry is missing or not callable.
fn cuda_entry_parameters(code: &CudaCode, entry: &str) -> Result<usize, String> {
    match code {
        CudaCode::Source(source) => cuda_c_parameters(source, entry),
        CudaCode::Ptx(ptx) => ptx_parameters(ptx, entry),
    }
}

/// Guarded (`true`) or plain (`false`) by the parameter count.
fn convention(entry: &str, count: usize, declared: usize) -> Result<bool, String> {
    if count == declared {
        Ok(false)
    } else if count == declared + GUARD_PARAMETERS {
        Ok(true)
    } else {
        let s = |n: usize| if n == 1 { "" } else { "s" };
        Err(format!(
            "kernel entry {entry} takes {count} parameter{}; the manifest declares {declared}: a plain kernel takes exactly its {declared} declared parameter{}, a guarded one {declared} + {GUARD_PARAMETERS} = {} (range0, range1, range2, the revocation flag, the row offset)",
            s(count),
            s(declared),
            declared + GUARD_PARAMETERS
        ))
    }
}

/// The parameter count of the first `__global__ void entry(` of CUDA C `source` with C linkage.
fn cuda_c_parameters(source: &str, entry: &str) -> Result<usize, String> {
    let tokens = tokens(source);
    // Whether each token is inside an `extern "C" { ... }` block.
    let mut in_extern_c = Vec::with_capacity(tokens.len());
    let mut blocks: Vec<bool> = Vec::new();
    for (i, t) in tokens.iter().enumerate() {
        in_extern_c.push(blocks.iter().any(|b| *b));
        match *t {
            "{" => blocks.push(i >= 2 && tokens[i - 2] == "extern" && tokens[i - 1] == "\"C\""),
            "}" => {
                blocks.pop();
            }
            _ => {}
        }
    }
    let mut mangled = false;
    for (i, t) in tokens.iter().enumerate() {
        if *t != entry || tokens.get(i + 1) != Some(&"(") {
            continue;
        }
        // Back over `__launch_bounds__(...)`-like groups between `void` and the name.
        let mut j = i;
        while j >= 2 && tokens[j - 1] == ")" {
            match group_start(&tokens, j - 1) {
                Some(open) if open >= 1 && is_word(tokens[open - 1]) && tokens[open - 1] != "void" => j = open - 1,
                _ => break,
            }
        }
        if j == 0 || tokens[j - 1] != "void" {
            continue;
        }
        // The declaration specifiers before `void`: words, string literals (`"C"`) and
        // parenthesised groups after a word.
        let mut k = j - 1;
        while k > 0 {
            let t = tokens[k - 1];
            if is_word(t) || t.starts_with('"') {
                k -= 1;
            } else if t == ")" {
                match group_start(&tokens, k - 1) {
                    Some(open) => k = open,
                    None => break,
                }
            } else {
                break;
            }
        }
        let specifiers = &tokens[k..j - 1];
        if !specifiers.contains(&"__global__") {
            continue;
        }
        let c_linkage = in_extern_c[i] || specifiers.windows(2).any(|w| w == ["extern", "\"C\""]);
        if !c_linkage {
            mangled = true;
            continue;
        }
        return count_parameters(&tokens, i + 1, entry);
    }
    Err(if mangled {
        format!(
            "declares `__global__ void {entry}(` without `extern \"C\"`, so its name is mangled: declare it `extern \"C\" __global__ void {entry}(...)`"
        )
    } else {
        format!("has no `extern \"C\" __global__ void {entry}(`: declare the kernel `extern \"C\" __global__ void {entry}(...)`")
    })
}

/// Whether `token` is an identifier or a number (a word of [`tokens`]).
fn is_word(token: &str) -> bool {
    token.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'_')
}

/// The index of the `(` that the `)` at `close` closes.
fn group_start(tokens: &[&str], close: usize) -> Option<usize> {
    let mut depth = 0usize;
    for k in (0..=close).rev() {
        match tokens[k] {
            ")" => depth += 1,
            "(" => {
                depth -= 1;
                if depth == 0 {
                    return Some(k);
                }
            }
            _ => {}
        }
    }
    None
}

/// The number of parameters in the C parameter list that opens at `tokens[open]` (`(`): its
/// commas outside nested parentheses, brackets and braces, plus one; `()` and `(void)` have none.
/// Commas inside template arguments (`Pair<int, int> p`) would be counted too: kernels with C
/// linkage rarely take such parameters, and a wrong count is refused, never guessed around.
fn count_parameters(tokens: &[&str], open: usize, entry: &str) -> Result<usize, String> {
    let mut depth = 0usize;
    let mut commas = 0;
    for (k, t) in tokens.iter().enumerate().skip(open) {
        match *t {
            "(" | "[" | "{" => depth += 1,
            ")" | "]" | "}" => {
                depth -= 1;
                if depth == 0 {
                    let inner = &tokens[open + 1..k];
                    return Ok(if inner.is_empty() || inner == ["void"] {
                        0
                    } else {
                        commas + 1
                    });
                }
            }
            "," if depth == 1 => commas += 1,
            _ => {}
        }
    }
    Err(format!("declares `{entry}(` without closing its parameter list"))
}

/// The number of `.param`s of `.entry entry` in `ptx`.
fn ptx_parameters(ptx: &str, entry: &str) -> Result<usize, String> {
    const LISTED: usize = 8;
    let tokens = tokens(ptx);
    let mut names = Vec::new();
    for i in 0..tokens.len() {
        if tokens[i] != "." || tokens.get(i + 1) != Some(&"entry") {
            continue;
        }
        let Some(name) = tokens.get(i + 2) else { continue };
        if *name != entry {
            names.push(*name);
            continue;
        }
        // A PTX entry without parameters may omit the list.
        if tokens.get(i + 3) != Some(&"(") {
            return Ok(0);
        }
        let mut depth = 0usize;
        let mut count = 0;
        for (k, t) in tokens.iter().enumerate().skip(i + 3) {
            match *t {
                "(" => depth += 1,
                ")" => {
                    depth -= 1;
                    if depth == 0 {
                        return Ok(count);
                    }
                }
                "." if depth == 1 && tokens.get(k + 1) == Some(&"param") => count += 1,
                _ => {}
            }
        }
        return Err(format!("declares `.entry {entry}(` without closing its parameter list"));
    }
    let found = if names.is_empty() {
        "it has no .entry".to_string()
    } else {
        let mut list = names[..names.len().min(LISTED)].join(", ");
        if names.len() > LISTED {
            list.push_str(&format!(", and {} more", names.len() - LISTED));
        }
        format!("its entries: {list}")
    };
    Err(format!("has no `.entry {entry}` ({found})"))
}

/// Identifiers, numbers, string and character literals and single punctuation characters of C
/// (or PTX) `source`, comments removed.
fn tokens(source: &str) -> Vec<&str> {
    let bytes = source.as_bytes();
    let mut out = Vec::new();
    let mut i = 0;
    while i < bytes.len() {
        let c = bytes[i];
        if c.is_ascii_whitespace() {
            i += 1;
        } else if source[i..].starts_with("//") {
            i += source[i..].find('\n').unwrap_or(source.len() - i);
        } else if source[i..].starts_with("/*") {
            i += source[i + 2..].find("*/").map_or(source.len() - i, |e| e + 4);
        } else if c.is_ascii_alphanumeric() || c == b'_' {
            let start = i;
            while i < bytes.len() && (bytes[i].is_ascii_alphanumeric() || bytes[i] == b'_') {
                i += 1;
            }
            out.push(&source[start..i]);
        } else if c == b'"' || c == b'\'' {
            // A literal, to its closing quote (a backslash escapes the next byte) or the line's end.
            let start = i;
            i += 1;
            while i < bytes.len() && bytes[i] != c && bytes[i] != b'\n' {
                i += if bytes[i] == b'\\' { 2 } else { 1 };
            }
            i = (i + 1).min(bytes.len());
            out.push(&source[start..i]);
        } else {
            let len = source[i..].chars().next().map_or(1, char::len_utf8);
            out.push(&source[i..i + len]);
            i += len;
        }
    }
    out
}

#[cfg(test)]
mod tests;
