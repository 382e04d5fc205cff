//! CUDA programs: the CUDA C of a kernel (its OpenCL C under the `opencl.cuh` prelude), compiled
//! by NVRTC to PTX for the device's architecture at first use, cached on disk per (source hash,
//! architecture), loaded once per device as a module, with its functions cached.
//!
//! Owns NVRTC and the on-disk PTX cache. It must not launch anything, nor decide where a kernel
//! runs.
//!
//! NVRTC is loaded at run time like the driver (cudarc's dynamic loading, as `libnvrtc.so` or
//! `libnvrtc.so.12`/`.13`). Where it is elsewhere, `AGORA_NVRTC` names the library file: it is
//! loaded first, so the dynamic loader finds it by its soname (the test suite points it at the
//! NVRTC of the project's virtual environment, from PyPI, which runs without a GPU).

use std::collections::HashMap;
use std::ffi::CString;
use std::hash::Hasher;
use std::path::PathBuf;
use std::sync::{Arc, Mutex, OnceLock};

use agora_kernels::{CudaCode, CudaImpl, KernelDef, OpenClImpl};
use cudarc::driver::sys::{CUfunction, CUmodule};
use cudarc::nvrtc::result as nvrtc;

/// The OpenCL-to-CUDA prelude every program is compiled under.
pub const PRELUDE: &str = include_str!("opencl.cuh");

/// What a GPU runs for a kernel: its CUDA implementation (CUDA C or PTX, a package's or a
/// tenant's) when it has one, else its OpenCL C under the prelude.
#[derive(Debug, Clone, Copy)]
pub enum KernelCode<'a> {
    /// CUDA C or PTX written for the GPU.
    Cuda(&'a CudaImpl),
    /// OpenCL C, compiled as CUDA C under [`PRELUDE`].
    OpenCl(&'a OpenClImpl),
}

impl<'a> KernelCode<'a> {
    /// The code a GPU runs for `kernel`, if it has any.
    pub fn of(kernel: &'a KernelDef) -> Option<Self> {
        match (&kernel.cuda, &kernel.opencl) {
            (Some(cuda), _) => Some(KernelCode::Cuda(cuda)),
            (None, Some(opencl)) => Some(KernelCode::OpenCl(opencl)),
            (None, None) => None,
        }
    }

    /// The program's name.
    pub fn program(&self) -> &'a str {
        match self {
            KernelCode::Cuda(c) => &c.program,
            KernelCode::OpenCl(o) => &o.program,
        }
    }

    /// The entry point.
    pub fn entry(&self) -> &'a str {
        match self {
            KernelCode::Cuda(c) => &c.entry,
            KernelCode::OpenCl(o) => &o.entry,
        }
    }

    /// The block shape the kernel requires (OpenCL's `local`), if any.
    pub fn local(&self) -> Option<[usize; 3]> {
        match self {
            KernelCode::Cuda(_) => None,
            KernelCode::OpenCl(o) => o.local,
        }
    }

    /// Its calling convention on a GPU (a tenant's code is always plain: it gets no revocation
    /// flag nor row offset). Scans an OpenCL source, so not for every launch.
    pub fn convention(&self) -> Convention {
        match self {
            _ if super::device::is_tenant_program(self.program()) => Convention::Plain,
            KernelCode::Cuda(c) if c.guarded => Convention::Guarded,
            KernelCode::Cuda(_) => Convention::Plain,
            KernelCode::OpenCl(o) => convention(&o.source, &o.entry),
        }
    }
}

/// What marks a guarded, revocable kernel's last declared parameter (the library's convention,
/// [`OpenClImpl`]); the backend appends the row offset after it.
const REVOKE_PARAMETER: &str = "uchar *revoke)";

/// A kernel's calling convention on CUDA.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Convention {
    /// Declared parameters, `range0..2`, the revocation flag, the row offset.
    Guarded,
    /// Declared parameters only (a package's plain kernel; never sliced).
    Plain,
}

/// The CUDA C of an OpenCL C program: the prelude, then the source with the row offset appended
/// to every guarded kernel's parameters (after its `uchar *revoke`, however it is spaced; helper
/// functions keep theirs).
pub fn cuda_source(opencl: &str) -> String {
    let body = without_attributes(opencl);
    let mut out = String::with_capacity(body.len() + 256);
    let mut copied = 0;
    for (at, _) in body.match_indices("revoke") {
        let after = &body[at + "revoke".len()..];
        let before = body[..at].trim_end();
        // The declaration this parameter list belongs to: back to the previous `;` or `}`.
        let declaration = before.rfind([';', '}']).map_or(0, |i| i + 1);
        let is_last_parameter = after.trim_start().starts_with(')')
            && before.ends_with('*')
            && before[..before.len() - 1].trim_end().ends_with("uchar")
            && before[declaration..].contains("__kernel");
        if is_last_parameter {
            let end = at + "revoke".len();
            out.push_str(&body[copied..end]);
            out.push_str(", const ulong agora_row_offset");
            copied = end;
        }
    }
    out.push_str(&body[copied..]);
    format!("{PRELUDE}\n#line 1 \"kernel\"\n{out}")
}

/// The CUDA C of a plain OpenCL C program (a tenant's): the prelude, then the source as written
/// (no parameter is appended).
pub fn plain_cuda_source(opencl: &str) -> String {
    format!("{PRELUDE}\n#line 1 \"kernel\"\n{}", without_attributes(opencl))
}

/// `source` without its `__attribute__((...))`s (OpenCL's kernel attributes, which CUDA does not
/// allow where OpenCL puts them; `local` carries the one that matters).
fn without_attributes(source: &str) -> String {
    const ATTRIBUTE: &str = "__attribute__";
    let mut out = String::with_capacity(source.len());
    let mut rest = source;
    while let Some(at) = rest.find(ATTRIBUTE) {
        out.push_str(&rest[..at]);
        let after = &rest[at + ATTRIBUTE.len()..];
        let mut depth = 0usize;
        let mut end = None;
        for (i, c) in after.char_indices() {
            match c {
                '(' => depth += 1,
                ')' => {
                    depth = depth.saturating_sub(1);
                    if depth == 0 {
                        end = Some(i + 1);
                        break;
                    }
                }
                c if depth == 0 && !c.is_whitespace() => break,
                _ => {}
            }
        }
        match end {
            Some(end) => rest = &after[end..],
            None => {
                // Not an attribute we can parse: keep it, NVRTC will say what is wrong.
                out.push_str(ATTRIBUTE);
                rest = after;
            }
        }
    }
    out.push_str(rest);
    out
}

/// The convention of `entry` in an OpenCL source: guarded when its parameter list ends with the
/// revocation flag.
pub fn convention(opencl: &str, entry: &str) -> Convention {
    let declaration = opencl
        .match_indices(entry)
        .filter(|(at, _)| {
            let after = &opencl[at + entry.len()..];
            let before = opencl[..*at].trim_end();
            before.ends_with("void") && after.trim_start().starts_with('(')
        })
        .map(|(at, _)| at)
        .next();
    let Some(at) = declaration else {
        return Convention::Plain;
    };
    let parameters = &opencl[at..];
    let close = parameters.find(')').map_or(parameters.len(), |c| c + 1);
    if parameters[..close]
        .replace(char::is_whitespace, "")
        .ends_with(&REVOKE_PARAMETER.replace(' ', ""))
    {
        Convention::Guarded
    } else {
        Convention::Plain
    }
}

/// A stable 64-bit hash (FNV-1a) of the compiled text, for the disk cache's file names: stable
/// across Rust versions, unlike `DefaultHasher`. Collisions only cost a wrong cache hit, which
/// the module load or the kernel lookup then reports; the full text is short.
fn source_hash(text: &str) -> u64 {
    struct Fnv(u64);
    impl Hasher for Fnv {
        fn finish(&self) -> u64 {
            self.0
        }
        fn write(&mut self, bytes: &[u8]) {
            for b in bytes {
                self.0 ^= u64::from(*b);
                self.0 = self.0.wrapping_mul(0x100_0000_01b3);
            }
        }
    }
    let mut h = Fnv(0xcbf2_9ce4_8422_2325);
    h.write(text.as_bytes());
    h.finish()
}

/// The NVRTC library a test names ([`use_nvrtc_at`]), before `AGORA_NVRTC`.
static NVRTC_AT: OnceLock<std::path::PathBuf> = OnceLock::new();

/// Names the NVRTC library to load, as `AGORA_NVRTC` does, without touching the environment
/// (tests: `set_var` beside another thread's process spawn can fail that spawn). Takes effect
/// only before NVRTC was first looked for.
#[doc(hidden)]
pub fn use_nvrtc_at(path: std::path::PathBuf) {
    let _ = NVRTC_AT.set(path);
}

/// Loads the NVRTC named by `AGORA_NVRTC`, once, so cudarc finds it by soname. Returns whether
/// NVRTC can be loaded at all.
pub fn nvrtc_available() -> bool {
    static AVAILABLE: OnceLock<bool> = OnceLock::new();
    *AVAILABLE.get_or_init(|| {
        let named = NVRTC_AT
            .get()
            .map(|p| p.as_os_str().to_owned())
            .or_else(|| std::env::var_os("AGORA_NVRTC"));
        if let Some(path) = named.filter(|p| !p.is_empty()) {
            if let Ok(c) = CString::new(path.as_encoded_bytes()) {
                // SAFETY: dlopen of a library file; the handle is kept for the process's life.
                let handle = unsafe { libc::dlopen(c.as_ptr(), libc::RTLD_NOW | libc::RTLD_GLOBAL) };
                if handle.is_null() {
                    tracing::warn!(path = ?path, "AGORA_NVRTC names a library that does not load");
                }
            }
        }
        // SAFETY: only tries to open the library.
        unsafe { cudarc::nvrtc::sys::is_culib_present() }
    })
}

/// Why a program did not compile.
#[derive(Debug, Clone)]
pub struct CompileError {
    /// NVRTC's log (or why NVRTC is missing).
    pub log: String,
}

impl std::fmt::Display for CompileError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.log)
    }
}

/// Compiles CUDA C `source` to PTX for `compute_<arch>` (e.g. 90) with NVRTC.
pub fn compile_ptx(name: &str, source: &str, arch: u32) -> Result<String, CompileError> {
    if !nvrtc_available() {
        return Err(CompileError {
            log:
                "NVRTC (libnvrtc.so) is not installed: install the CUDA toolkit's NVRTC, or set AGORA_NVRTC to its path"
                    .into(),
        });
    }
    let c_source = CString::new(source).map_err(|_| CompileError {
        log: "the source contains a NUL byte".into(),
    })?;
    let c_name = CString::new(name.replace('\0', "")).unwrap_or_default();
    let program = nvrtc::create_program(&c_source, Some(&c_name)).map_err(|e| CompileError {
        log: format!("nvrtcCreateProgram: {e:?}"),
    })?;
    let options = [
        format!("--gpu-architecture=compute_{arch}"),
        "-default-device".to_string(),
        "--std=c++17".to_string(),
    ];
    // SAFETY: `program` is live until destroyed below.
    let compiled = unsafe { nvrtc::compile_program(program, &options) };
    let log = || {
        // SAFETY: as above.
        unsafe { nvrtc::get_program_log(program) }
            .map(|chars| {
                let bytes: Vec<u8> = chars.iter().map(|c| *c as u8).take_while(|b| *b != 0).collect();
                String::from_utf8_lossy(&bytes).into_owned()
            })
            .unwrap_or_default()
    };
    let result = match compiled {
        Ok(()) => {
            // SAFETY: as above; the program compiled.
            unsafe { nvrtc::get_ptx(program) }
                .map(|chars| {
                    let bytes: Vec<u8> = chars.iter().map(|c| *c as u8).take_while(|b| *b != 0).collect();
                    String::from_utf8_lossy(&bytes).into_owned()
                })
                .map_err(|e| CompileError {
                    log: format!("nvrtcGetPTX: {e:?}"),
                })
        }
        Err(e) => Err(CompileError {
            log: format!("{e:?}:\n{}", log()),
        }),
    };
    // SAFETY: destroyed once, after its last use.
    let _ = unsafe { nvrtc::destroy_program(program) };
    result
}

/// Where compiled PTX is kept between runs: `AGORA_CUDA_CACHE`, else
/// `$XDG_CACHE_HOME/agora/cuda`, else `~/.cache/agora/cuda`.
fn cache_dir() -> Option<PathBuf> {
    if let Some(dir) = std::env::var_os("AGORA_CUDA_CACHE") {
        return Some(PathBuf::from(dir));
    }
    let base = std::env::var_os("XDG_CACHE_HOME")
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache")))?;
    Some(base.join("agora").join("cuda"))
}

/// PTX for `source` on `compute_<arch>`, from the disk cache or NVRTC (then cached). Returns the
/// PTX and whether it was compiled now.
pub fn ptx_for(program: &str, source: &str, arch: u32) -> Result<(String, bool), CompileError> {
    let hash = source_hash(source);
    let safe_name: String = program
        .chars()
        .map(|c| if c.is_ascii_alphanumeric() { c } else { '_' })
        .collect();
    let path = cache_dir().map(|d| d.join(format!("{safe_name}-{hash:016x}-sm{arch}.ptx")));
    if let Some(path) = &path {
        if let Ok(ptx) = std::fs::read_to_string(path) {
            if ptx.contains(".entry") || ptx.contains(".version") {
                return Ok((ptx, false));
            }
        }
    }
    let ptx = compile_ptx(program, source, arch)?;
    if let Some(path) = &path {
        // A cache that cannot be written costs a compile per daemon start, nothing more.
        let written = path.parent().map_or(Ok(()), std::fs::create_dir_all).and_then(|()| {
            let partial = path.with_extension(format!("ptx.{}", std::process::id()));
            std::fs::write(&partial, &ptx)?;
            std::fs::rename(&partial, path)
        });
        if let Err(e) = written {
            tracing::debug!(path = %path.display(), error = %e, "PTX cache not written");
        }
    }
    Ok((ptx, true))
}

/// Loads PTX as a module of the current context (the driver compiles it for the GPU); on failure,
/// the driver's code and the JIT compiler's error log (what a PTX author needs to fix it).
fn load_module(ptx: &CString) -> Result<CUmodule, String> {
    use cudarc::driver::sys::{self, CUjit_option};
    const LOG_BYTES: usize = 16 << 10;
    let mut log = vec![0u8; LOG_BYTES];
    let mut options = [
        CUjit_option::CU_JIT_ERROR_LOG_BUFFER,
        CUjit_option::CU_JIT_ERROR_LOG_BUFFER_SIZE_BYTES,
    ];
    // The driver reads a size option's value from the pointer's bits.
    let mut values = [
        log.as_mut_ptr().cast::<std::ffi::c_void>(),
        LOG_BYTES as *mut std::ffi::c_void,
    ];
    let mut module: CUmodule = std::ptr::null_mut();
    // SAFETY: NUL-terminated PTX; two options with their values (a buffer of LOG_BYTES bytes that
    // outlives the call, and its size); the module is kept until the device goes.
    let result = unsafe {
        sys::cuModuleLoadDataEx(
            &mut module,
            ptx.as_ptr().cast(),
            options.len() as u32,
            options.as_mut_ptr(),
            values.as_mut_ptr(),
        )
    };
    if result == sys::CUresult::CUDA_SUCCESS {
        return Ok(module);
    }
    let end = log.iter().position(|b| *b == 0).unwrap_or(log.len());
    let log = String::from_utf8_lossy(&log[..end]);
    Err(if log.trim().is_empty() {
        format!("{result:?}")
    } else {
        format!("{result:?}: {}", log.trim())
    })
}

/// A loaded module and its functions by entry point.
struct Loaded {
    module: CUmodule,
    functions: HashMap<String, CUfunction>,
}

/// The programs of one device (its context must be current on the calling thread).
#[derive(Default)]
pub struct Programs {
    /// By program name and source hash.
    loaded: Mutex<HashMap<(String, u64), Loaded>>,
    /// Programs that failed to compile or load, with the message logged.
    broken: Mutex<HashMap<String, String>>,
}

// SAFETY: CUmodule and CUfunction are driver handles valid on any thread of the process with
// the module's context current; the maps are behind mutexes.
unsafe impl Send for Programs {}
// SAFETY: as above.
unsafe impl Sync for Programs {}

/// A function handle, with whether finding it built a program.
pub struct Found {
    /// The function.
    pub function: CUfunction,
    /// Its calling convention.
    pub convention: Convention,
    /// Whether its program was compiled now (the job that waited for it is not typical).
    pub built: bool,
    /// Whether it is fenced: it takes the partition's base and mask after its own parameters.
    pub fenced: bool,
}

impl Programs {
    /// Whether `program` failed to compile or load (the device then stops claiming it).
    pub fn is_broken(&self, program: &str) -> bool {
        self.broken
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .contains_key(program)
    }

    /// Forgets that `program` failed: a tenant's program whose build was refused is never
    /// installed, so remembering it would only let a tenant grow this table build by build.
    pub fn forget_broken(&self, program: &str) {
        self.broken.lock().unwrap_or_else(|e| e.into_inner()).remove(program);
    }

    /// Logs `message` and remembers `program` as broken (the device stops claiming it); returns
    /// the message.
    fn mark_broken(&self, device: &str, program: &str, message: String) -> String {
        tracing::error!(device, "{message}");
        self.broken
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .insert(program.to_string(), message.clone());
        message
    }

    /// The function of `code` (a kernel with `declared` parameters) on the current context,
    /// compiled and loaded at first use.
    ///
    /// A tenant's own program (`tenant/…`, `tenant-fenced/…`) is untrusted: it is compiled with
    /// the plain convention (the daemon gives tenant kernels no revocation flag nor row offset),
    /// and its PTX is fenced ([`fence`](super::fence)) and the result checked before it is
    /// loaded; a program the pass refuses is never loaded here (it is marked broken, with the
    /// pass's reason, and runs on the other devices). A CUDA implementation's entry is checked
    /// against the kernel's declared parameters and its convention before it is loaded.
    pub fn function(&self, device: &str, arch: u32, code: KernelCode<'_>, declared: usize) -> Result<Found, String> {
        let program = code.program();
        let fenced = super::device::is_tenant_program(program);
        // (CUDA C to compile, or PTX as it is), and the convention.
        let (text, is_ptx, convention) = match code {
            KernelCode::OpenCl(imp) if fenced => (plain_cuda_source(&imp.source), false, Convention::Plain),
            KernelCode::OpenCl(imp) => (cuda_source(&imp.source), false, convention(&imp.source, &imp.entry)),
            KernelCode::Cuda(imp) => {
                let convention = if imp.guarded && !fenced {
                    Convention::Guarded
                } else {
                    Convention::Plain
                };
                match &imp.code {
                    CudaCode::Source(source) => (source.to_string(), false, convention),
                    CudaCode::Ptx(ptx) => (ptx.to_string(), true, convention),
                }
            }
        };
        let key = (program.to_string(), source_hash(&text));
        let mut loaded = self.loaded.lock().unwrap_or_else(|e| e.into_inner());
        let mut built = false;
        if !loaded.contains_key(&key) {
            let ptx = if is_ptx {
                text
            } else {
                let (ptx, compiled) = ptx_for(program, &text, arch).map_err(|e| {
                    self.mark_broken(
                        device,
                        program,
                        format!("CUDA program {program} did not compile for sm_{arch}: {e}"),
                    )
                })?;
                built = compiled;
                ptx
            };
            if let KernelCode::Cuda(imp) = code {
                let wanted = declared + if convention == Convention::Guarded { 5 } else { 0 };
                match super::fence::entry_parameter_count(&ptx, &imp.entry) {
                    Ok(Some(found)) if found == wanted => {}
                    Ok(Some(found)) => {
                        return Err(self.mark_broken(
                            device,
                            program,
                            format!(
                                "CUDA program {program}: entry {} takes {found} parameters; its kernel declares \
                                 {declared}{}",
                                imp.entry,
                                if convention == Convention::Guarded {
                                    " and the guarded convention adds 5"
                                } else {
                                    ""
                                }
                            ),
                        ))
                    }
                    Ok(None) => {
                        return Err(self.mark_broken(
                            device,
                            program,
                            format!(
                                "CUDA program {program} has no entry {} (declare it extern \"C\" __global__)",
                                imp.entry
                            ),
                        ))
                    }
                    Err(e) => return Err(self.mark_broken(device, program, format!("CUDA program {program}: {e}"))),
                }
            }
            let ptx = if fenced {
                let rewritten =
                    super::fence::fence(&ptx).and_then(|f| super::fence::check_fenced(&f.ptx).map(|_| f.ptx));
                rewritten.map_err(|e| {
                    self.mark_broken(
                        device,
                        program,
                        format!("tenant program {program} cannot be fenced, so it does not run on this GPU: {e}"),
                    )
                })?
            } else {
                ptx
            };
            let c_ptx = CString::new(ptx).map_err(|_| "PTX with a NUL byte".to_string())?;
            let module = load_module(&c_ptx)
                .map_err(|e| self.mark_broken(device, program, format!("CUDA program {program} did not load: {e}")))?;
            loaded.insert(
                key.clone(),
                Loaded {
                    module,
                    functions: HashMap::new(),
                },
            );
        }
        let entry = loaded.get_mut(&key).expect("inserted above");
        let name = code.entry();
        if let Some(function) = entry.functions.get(name) {
            return Ok(Found {
                function: *function,
                convention,
                built,
                fenced,
            });
        }
        let c_name = CString::new(name.as_bytes()).map_err(|_| "an entry point with a NUL byte".to_string())?;
        // SAFETY: a live module of the current context and a NUL-terminated name.
        let function = unsafe { cudarc::driver::result::module::get_function(entry.module, c_name) }
            .map_err(|e| format!("kernel {name} not found in CUDA program {program}: {e:?}"))?;
        entry.functions.insert(name.to_string(), function);
        Ok(Found {
            function,
            convention,
            built,
            fenced,
        })
    }

    /// Unloads every module (the device's context must be current).
    pub fn unload_all(&self) {
        for (_, loaded) in self.loaded.lock().unwrap_or_else(|e| e.into_inner()).drain() {
            // SAFETY: no launch uses the module any more (the lanes stopped).
            let _ = unsafe { cudarc::driver::result::module::unload(loaded.module) };
        }
    }
}

/// The whole OpenCL library's sources, for tests and `agora bench gpu --quick`.
pub fn library_programs() -> Vec<Arc<OpenClImpl>> {
    let mut seen = HashMap::new();
    for kernel in agora_kernels::library() {
        if let Some(imp) = &kernel.opencl {
            seen.entry(imp.program.to_string())
                .or_insert_with(|| Arc::new(imp.clone()));
        }
    }
    let mut programs: Vec<_> = seen.into_values().collect();
    programs.sort_by(|a, b| a.program.cmp(&b.program));
    programs
}
