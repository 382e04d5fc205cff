//! Programs and kernel objects of one OpenCL device: each program built at most once, at first
//! use, and cached; a program that fails to build reported once and refused from then on; kernel
//! objects created with the calling convention their parameters declare.
//!
//! A build that failed for lack of a resource (the daemon out of file descriptors or memory: the
//! compiler could not open its temporary files) says nothing about the program, so it is not
//! cached as broken: the task fails with `CL_OUT_OF_RESOURCES` or `CL_OUT_OF_HOST_MEMORY`, the
//! device keeps claiming the program's kernels, and a later use builds it again. Not at once:
//! a program whose last build failed that way is retried at the first use [`RETRY_AFTER`] or more
//! after it (doubling with each further such failure, up to [`RETRY_AFTER_MAX`]), and uses
//! before then fail at once, so a storm of launches is not a storm of compiler runs.
//!
//! PoCL compiles once more at a kernel's first launch, and aborts the process when it runs out of
//! descriptors there; so a kernel's first launch on a lane fails the same transient way when few
//! are left ([`Programs::room_to_compile`]).
//!
//! Owns compilation only; it must not enqueue commands or cache kernel objects (they carry
//! argument state, so each lane keeps its own: see the executor).

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use agora_kernels::OpenClImpl;
use agora_protocol::{Resource, TaskError};
use opencl3::context::Context;
use opencl3::error_codes::{
    CL_BUILD_PROGRAM_FAILURE, CL_INVALID_KERNEL_ARGS, CL_OUT_OF_HOST_MEMORY, CL_OUT_OF_RESOURCES,
};
use opencl3::kernel::Kernel;
use opencl3::program::Program;

use super::cl_error;

/// Least time between two builds of a program whose build failed for a transient reason.
pub(super) const RETRY_AFTER: Duration = Duration::from_millis(100);

/// Most time between two such builds, however often they failed.
pub(super) const RETRY_AFTER_MAX: Duration = Duration::from_secs(2);

/// The programs built for one device, those that failed to build, and those whose last build
/// failed for a transient reason.
#[derive(Default)]
pub(super) struct Programs {
    built: Mutex<HashMap<String, Arc<Program>>>,
    broken: Mutex<HashSet<String>>,
    /// Programs whose last build failed for lack of a resource: not before `.not_before`.
    retry: Mutex<HashMap<String, Retry>>,
    /// When [`Programs::room_to_compile`] last warned (it warns at most once a second).
    starved_warning: Mutex<Option<Instant>>,
}

/// When a program whose build failed for a transient reason is built again.
#[derive(Debug, Clone, Copy)]
struct Retry {
    /// No build before this.
    not_before: Instant,
    /// Transient failures in a row (the backoff doubles with each).
    failures: u32,
    /// The OpenCL error the failure is reported as (until the next build).
    code: i32,
}

impl Programs {
    /// The program of `imp` for `context` (the device named `device`), built now if it was not.
    pub(super) fn get(&self, context: &Context, device: &str, imp: &OpenClImpl) -> Result<Arc<Program>, TaskError> {
        self.get_or_build(device, &imp.program, || {
            build(context, device, imp).map_err(|mut failure| {
                failure.log = with_source_named(&failure.log, imp);
                failure
            })
        })
    }

    /// Program `name` of device `device`: the cached one, or the one `build` makes now (unless
    /// the program is broken, or failed for a transient reason less than its backoff ago).
    fn get_or_build(
        &self,
        device: &str,
        name: &str,
        build: impl FnOnce() -> Result<Program, BuildFailure>,
    ) -> Result<Arc<Program>, TaskError> {
        if let Some(p) = self.built.lock().unwrap_or_else(|e| e.into_inner()).get(name) {
            return Ok(p.clone());
        }
        if self.is_broken(name) {
            return Err(TaskError::DeviceFailed(CL_BUILD_PROGRAM_FAILURE.into()));
        }
        if let Some(retry) = self.retry.lock().unwrap_or_else(|e| e.into_inner()).get(name) {
            let now = Instant::now();
            if now < retry.not_before {
                return Err(exhausted(retry.code, retry.not_before - now));
            }
        }
        // Built outside the locks: a build takes up to a second; other programs need not wait.
        let failure = match build() {
            Ok(program) => return Ok(self.keep(name, program)),
            Err(failure) => failure,
        };
        match failure.transient() {
            Some(code) => {
                let mut retries = self.retry.lock().unwrap_or_else(|e| e.into_inner());
                let failures = retries.get(name).map_or(0, |r| r.failures) + 1;
                let wait = backoff(failures);
                retries.insert(
                    name.to_string(),
                    Retry {
                        not_before: Instant::now() + wait,
                        failures,
                        code,
                    },
                );
                tracing::warn!(device = %device, program = %name, code, errno = failure.errno, log = %failure.log, retry_in = ?wait, "OpenCL program failed to build for lack of a resource (file descriptors or memory); transient: not cached as broken, the build is retried at a later use");
                Err(exhausted(code, wait))
            }
            None => {
                tracing::error!(device = %device, program = %name, log = %failure.log, "OpenCL program failed to build; its kernels will run elsewhere");
                self.retry.lock().unwrap_or_else(|e| e.into_inner()).remove(name);
                self.broken
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .insert(name.to_string());
                Err(TaskError::DeviceFailed(CL_BUILD_PROGRAM_FAILURE.into()))
            }
        }
    }

    /// Caches `program`, built for `name`, and returns it.
    fn keep(&self, name: &str, program: Program) -> Arc<Program> {
        let program = Arc::new(program);
        self.retry.lock().unwrap_or_else(|e| e.into_inner()).remove(name);
        self.built
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .insert(name.to_string(), program.clone());
        program
    }

    /// Whether `program` failed to build (its kernels run elsewhere). A build that failed for a
    /// transient reason does not count.
    pub(super) fn is_broken(&self, program: &str) -> bool {
        self.broken.lock().unwrap_or_else(|e| e.into_inner()).contains(program)
    }

    /// Whether the process has the descriptors to compile a kernel at its first launch: PoCL
    /// compiles, links and loads (`dlopen`) a kernel's work-group function when the kernel is
    /// first enqueued, and aborts the whole process when that fails. A first launch without
    /// [`COMPILE_DESCRIPTORS`] to spare fails with `CL_OUT_OF_RESOURCES` instead, and a later
    /// one checks again. Best effort: another thread may take the descriptors after the check,
    /// and a kernel compiled again for another work-group shape or a row slice's offset is not
    /// checked.
    pub(super) fn room_to_compile(&self, device: &str, imp: &OpenClImpl) -> Result<(), TaskError> {
        let left = descriptors_left();
        if left >= COMPILE_DESCRIPTORS {
            return Ok(());
        }
        let mut warned = self.starved_warning.lock().unwrap_or_else(|e| e.into_inner());
        if warned.is_none_or(|at| at.elapsed() >= Duration::from_secs(1)) {
            *warned = Some(Instant::now());
            tracing::warn!(device = %device, program = %imp.program, kernel = %imp.entry, left, "too few file descriptors left to compile a kernel at its first launch (the OpenCL runtime would abort the daemon); transient: the launch fails, a later one tries again (this line repeats at most every second)");
        }
        Err(exhausted(CL_OUT_OF_RESOURCES, Duration::ZERO))
    }
}

/// The task error of a transient failure reported as OpenCL error `code`
/// (`CL_OUT_OF_RESOURCES`: descriptors; else memory), tried again after `retry`.
fn exhausted(code: i32, retry: Duration) -> TaskError {
    let resource = if code == CL_OUT_OF_RESOURCES {
        Resource::FileDescriptors
    } else {
        Resource::Memory
    };
    TaskError::ResourceExhausted {
        resource: resource.code(),
        retry_ms: retry.as_millis().try_into().unwrap_or(u64::MAX),
    }
}

/// Descriptors kept free for compiling a kernel at its first launch (PoCL opens the compiler's
/// temporary files, the linker's output and the shared object it loads).
pub(super) const COMPILE_DESCRIPTORS: u64 = 32;

/// File descriptors this process may still open: 0 when it can open none (not even the
/// directory that lists them), unbounded where it cannot tell.
fn descriptors_left() -> u64 {
    let mut limit = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: `limit` is a valid `rlimit` for the call to fill.
    if unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut limit) } != 0 || limit.rlim_cur == libc::RLIM_INFINITY {
        return u64::MAX;
    }
    match std::fs::read_dir("/proc/self/fd") {
        // The count includes the directory's own descriptor, open while it is read.
        Ok(open) => limit.rlim_cur.saturating_sub(open.count() as u64),
        Err(e) if matches!(e.raw_os_error(), Some(libc::EMFILE | libc::ENFILE)) => 0,
        Err(_) => u64::MAX,
    }
}

/// How long after its `failures`-th transient failure in a row a program is built again.
fn backoff(failures: u32) -> Duration {
    RETRY_AFTER
        .saturating_mul(1 << failures.saturating_sub(1).min(16))
        .min(RETRY_AFTER_MAX)
}

/// Why a build from source failed.
#[derive(Debug)]
struct BuildFailure {
    /// The OpenCL error of the call that failed.
    code: i32,
    /// `errno` just after it, where the call set one (PoCL's compiler reports a file it could
    /// not open in its log, and leaves the reason there).
    errno: Option<i32>,
    /// The build log (or the error's name, when there is none).
    log: String,
}

/// What a compiler's log says when a resource ran out (`strerror` of `EMFILE`, `ENFILE` and
/// `ENOMEM`, and LLVM's words), lowercase, and the OpenCL error such a failure is reported as.
const TRANSIENT_LOG: &[(&str, i32)] = &[
    ("too many open files", CL_OUT_OF_RESOURCES), // and ENFILE's "... in system"
    ("cannot allocate memory", CL_OUT_OF_HOST_MEMORY),
    ("out of memory", CL_OUT_OF_HOST_MEMORY),
];

impl BuildFailure {
    /// The OpenCL error to report when the failure is transient (a resource ran out: descriptors
    /// or memory), `None` when it is the program's own.
    fn transient(&self) -> Option<i32> {
        if self.code == CL_OUT_OF_RESOURCES || self.code == CL_OUT_OF_HOST_MEMORY {
            return Some(self.code);
        }
        match self.errno {
            Some(libc::EMFILE | libc::ENFILE) => return Some(CL_OUT_OF_RESOURCES),
            Some(libc::ENOMEM) => return Some(CL_OUT_OF_HOST_MEMORY),
            _ => {}
        }
        let log = self.log.to_lowercase();
        TRANSIENT_LOG
            .iter()
            .find(|(words, _)| log.contains(words))
            .map(|(_, code)| *code)
    }
}

/// Clears this thread's `errno`, so that one read after a failed call is that call's.
fn clear_errno() {
    // SAFETY: `__errno_location` returns this thread's `errno`, valid while the thread lives.
    #[cfg(target_os = "linux")]
    unsafe {
        *libc::__errno_location() = 0;
    }
}

/// `errno` of this thread, if one is set.
fn errno() -> Option<i32> {
    std::io::Error::last_os_error().raw_os_error().filter(|e| *e != 0)
}

/// The program of `imp` for `context`: from the binary the package ships for this device, or else
/// compiled from source.
fn build(context: &Context, device: &str, imp: &OpenClImpl) -> Result<Program, BuildFailure> {
    // A binary loaded instead of compiled (a package built ahead of time pays no compiler at
    // all); one that does not load is reported and the source is compiled instead.
    if !imp.binaries.is_empty() {
        let cl_name = context
            .devices()
            .first()
            .and_then(|id| opencl3::device::Device::new(*id).name().ok())
            .unwrap_or_default();
        if let Some(binary) = imp.binaries.iter().find(|b| b.device == cl_name) {
            match from_binary(context, &binary.bytes) {
                Ok(program) => {
                    tracing::debug!(device = %device, program = %imp.program, "OpenCL program loaded from its binary");
                    return Ok(program);
                }
                Err(log) => {
                    tracing::warn!(device = %device, program = %imp.program, %log, "the package's OpenCL binary for this device does not load; compiling its source instead");
                }
            }
        }
    }
    from_source(context, &imp.source)
}

/// Why a kernel cannot serve on a device, from [`check_build`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum BuildProblem {
    /// The compiler refused its program: the compiler's log.
    DoesNotCompile(String),
    /// It compiled, but no launch of it could run there (or the device could not be used):
    /// why.
    CannotRun(String),
}

/// A device's name (`platform: device`) and whether a kernel built on it, from [`check_build`].
pub type DeviceBuild = (String, Result<(), BuildProblem>);

/// Compiles `imp` for every OpenCL device of this node (its shipped binary where one matches the
/// device, else its source), as the daemon does at a kernel's first use, and looks its entry
/// point up: `agora kernels check` reports a package's OpenCL C that does not compile before
/// the package is installed (the daemon learns it only at a first launch). Each device's name
/// with `Ok`, or what stops it. The driver's compiler runs in the calling process: a tool's,
/// never the daemon's, so a compiler that crashes ends only the check.
pub fn check_build(imp: &OpenClImpl) -> Result<Vec<DeviceBuild>, String> {
    use opencl3::device::{Device, CL_DEVICE_TYPE_ALL};
    let mut results = Vec::new();
    for platform in super::device::installed_platforms()? {
        let platform_name = platform.name().unwrap_or_else(|_| "unknown platform".into());
        let ids = platform
            .get_devices(CL_DEVICE_TYPE_ALL)
            .map_err(|e| format!("OpenCL platform {platform_name}: cannot list devices: {e}"))?;
        for id in ids {
            let device = Device::new(id);
            let name = format!("{platform_name}: {}", device.name().unwrap_or_default());
            let outcome = Context::from_device(&device)
                .map_err(|e| BuildProblem::CannotRun(format!("cannot create a context: {e}")))
                .and_then(|context| {
                    let program = build(&context, &name, imp)
                        .map_err(|failure| BuildProblem::DoesNotCompile(with_source_named(&failure.log, imp)))?;
                    let kernel = Kernel::create(&program, &imp.entry).map_err(|e| {
                        BuildProblem::CannotRun(format!("no kernel `{}` in the program: {e}", imp.entry))
                    })?;
                    // No launch of a kernel whose `__local` arrays exceed a work-group's local
                    // memory can run, and PoCL asserts on the first one (ending the device host).
                    match (kernel.get_local_mem_size(id), device.local_mem_size()) {
                        (Ok(used), Ok(available)) if used > available => Err(BuildProblem::CannotRun(format!(
                            "kernel `{}`: its __local memory takes {used} bytes, and a work-group of this device has \
                             {available}: make its __local arrays smaller (tile the work)",
                            imp.entry
                        ))),
                        _ => Ok(()),
                    }
                });
            results.push((name, outcome));
        }
    }
    Ok(results)
}

/// `log` with the compiler's temporary file (PoCL compiles a copy, `…/tempfile_XXXX.cl`) named
/// as the operator knows it: the file part of the program's name (`package/file.cl@hash`).
fn with_source_named(log: &str, imp: &OpenClImpl) -> String {
    let file = imp.program.split('@').next().unwrap_or(&imp.program);
    let file = file.rsplit('/').next().unwrap_or(file);
    log.split_inclusive(|c: char| c.is_whitespace())
        .map(|word| match word.find("tempfile_") {
            Some(at) if word[at..].contains(".cl") => {
                let start = word[..at].rfind(|c: char| c.is_whitespace()).map_or(0, |i| i + 1);
                let end = at + word[at..].find(".cl").unwrap_or(0) + 3;
                format!("{}{file}{}", &word[..start], &word[end..])
            }
            _ => word.to_string(),
        })
        .collect()
}

/// A program compiled from `source` for the context's devices.
fn from_source(context: &Context, source: &str) -> Result<Program, BuildFailure> {
    clear_errno();
    let failed = |code: i32, log: String| BuildFailure {
        code,
        errno: errno(),
        log,
    };
    let mut program = Program::create_from_source(context, source).map_err(|e| failed(e.0, e.to_string()))?;
    if let Err(e) = program.build(context.devices(), "-cl-std=CL1.2") {
        let mut failure = failed(e.0, e.to_string());
        if let Some(device) = context.devices().first() {
            if let Ok(log) = program.get_build_log(*device) {
                failure.log = format!("{e}, build log: {log}");
            }
        }
        return Err(failure);
    }
    Ok(program)
}

/// A program from a binary built for the context's (first) device.
fn from_binary(context: &Context, bytes: &[u8]) -> Result<Program, String> {
    let device = *context.devices().first().ok_or("the context has no device")?;
    // SAFETY: `device` belongs to `context`; the binary is only data to the runtime, which
    // validates it (CL_INVALID_BINARY) before use.
    let mut program =
        unsafe { Program::create_from_binary(context, &[device], &[bytes]) }.map_err(|e| e.to_string())?;
    program
        .build(&[device], "-cl-std=CL1.2")
        .map_err(|e| format!("{e}: {}", program.get_build_log(device).unwrap_or_default()))?;
    Ok(program)
}

/// How a kernel object takes the parameters after its signature's (see
/// [`agora_kernels::OpenClImpl`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Convention {
    /// None: the exact range is the global size.
    Plain,
    /// `range0, range1, range2`.
    Guarded,
    /// `range0, range1, range2, revoke`.
    Revocable,
}

/// A kernel object for `imp` from `program`, whose signature has `params` parameters, and the
/// calling convention its declared parameters follow.
pub(super) fn kernel_object(
    program: &Program,
    device: &str,
    imp: &OpenClImpl,
    params: usize,
) -> Result<(Kernel, Convention), TaskError> {
    let kernel = Kernel::create(program, &imp.entry).map_err(|e| {
        tracing::error!(device = %device, kernel = %imp.entry, error = %e, "no such OpenCL kernel");
        cl_error(e.0)
    })?;
    let declared = kernel.num_args().map_err(|e| cl_error(e.0))? as usize;
    let convention = match declared.checked_sub(params) {
        Some(0) => Convention::Plain,
        Some(3) => Convention::Guarded,
        Some(4) => Convention::Revocable,
        _ => {
            tracing::error!(device = %device, kernel = %imp.entry, declared, params, "OpenCL kernel does not match its signature");
            return Err(TaskError::DeviceFailed(CL_INVALID_KERNEL_ARGS.into()));
        }
    };
    Ok((kernel, convention))
}

#[cfg(test)]
mod tests {
    use std::cell::Cell;

    use agora_protocol::{ParamKind, Resource, TaskError};
    use opencl3::context::Context;
    use opencl3::error_codes::{CL_BUILD_PROGRAM_FAILURE, CL_OUT_OF_HOST_MEMORY, CL_OUT_OF_RESOURCES};
    use opencl3::program::Program;

    use super::super::{discover, OpenClDevice};
    use super::{backoff, from_source, with_source_named, BuildFailure, Programs, RETRY_AFTER, RETRY_AFTER_MAX};
    use agora_kernels::OpenClImpl;

    fn failure(code: i32, errno: Option<i32>, log: &str) -> BuildFailure {
        BuildFailure {
            code,
            errno,
            log: log.into(),
        }
    }

    /// What PoCL 3.1 logged when the daemon ran out of descriptors during a build.
    const POCL_EMFILE: &str = "CL_BUILD_PROGRAM_FAILURE, build log: error: <invalid loc>: unable to open output file '/tmp/pocl/tempfile_HHeiOM.preproc.cl': 'Too many open files'\nDevice pthread-skylake-avx512 failed to build the program";

    #[test]
    fn resource_exhaustion_is_transient_and_compile_errors_are_not() {
        let failed = CL_BUILD_PROGRAM_FAILURE;
        let transient = [
            (
                failure(CL_OUT_OF_RESOURCES, None, "CL_OUT_OF_RESOURCES"),
                CL_OUT_OF_RESOURCES,
            ),
            (failure(CL_OUT_OF_HOST_MEMORY, None, ""), CL_OUT_OF_HOST_MEMORY),
            (failure(failed, Some(libc::EMFILE), ""), CL_OUT_OF_RESOURCES),
            (failure(failed, Some(libc::ENFILE), ""), CL_OUT_OF_RESOURCES),
            (failure(failed, Some(libc::ENOMEM), ""), CL_OUT_OF_HOST_MEMORY),
            (failure(failed, None, POCL_EMFILE), CL_OUT_OF_RESOURCES),
            (
                failure(failed, None, "open: Too many open files in system"),
                CL_OUT_OF_RESOURCES,
            ),
            (
                failure(failed, None, "mmap: Cannot allocate memory"),
                CL_OUT_OF_HOST_MEMORY,
            ),
            (
                failure(failed, None, "LLVM ERROR: out of memory"),
                CL_OUT_OF_HOST_MEMORY,
            ),
        ];
        for (f, code) in transient {
            assert_eq!(f.transient(), Some(code), "{f:?}");
        }
        let own = [
            failure(failed, None, "error: use of undeclared identifier 'x'"),
            failure(failed, Some(libc::ENOENT), "error: expected ';' after expression"),
            failure(-46, None, "CL_INVALID_KERNEL_NAME"),
            failure(-30, Some(libc::EINVAL), ""),
        ];
        for f in own {
            assert_eq!(f.transient(), None, "{f:?}");
        }
    }

    #[test]
    fn a_build_log_names_the_packages_file_not_the_compilers_copy() {
        let imp = OpenClImpl {
            program: "badcl/broken.cl@7a9754d6".into(),
            source: "".into(),
            entry: "k".into(),
            local: None,
            binaries: Default::default(),
        };
        let log = "CL_BUILD_PROGRAM_FAILURE, build log: error: /root/.cache/pocl/kcache/tempfile_hsqZZB.cl:2:27: use of undeclared identifier 'x'\nerror: tempfile_a1.cl:3:1: more";
        assert_eq!(
            with_source_named(log, &imp),
            "CL_BUILD_PROGRAM_FAILURE, build log: error: broken.cl:2:27: use of undeclared identifier 'x'\nerror: broken.cl:3:1: more"
        );
    }

    #[test]
    fn the_backoff_doubles_from_100_ms_up_to_2_s() {
        assert_eq!(backoff(1), RETRY_AFTER);
        assert_eq!(backoff(2), 2 * RETRY_AFTER);
        assert_eq!(backoff(5), 16 * RETRY_AFTER);
        assert_eq!(backoff(6), RETRY_AFTER_MAX);
        assert_eq!(backoff(u32::MAX), RETRY_AFTER_MAX);
    }

    /// The first OpenCL device (PoCL here), for its context; fails, not skips, without one.
    fn device() -> OpenClDevice {
        super::super::one_opencl_test_at_a_time();
        let (mut devices, problems) = discover(1, 0);
        assert!(
            !devices.is_empty(),
            "these tests need an OpenCL device (PoCL): {problems:?}"
        );
        devices.swap_remove(0)
    }

    const SOURCE: &str = "__kernel void k(__global int *x) { x[get_global_id(0)] = 1; }";

    /// A build that failed for lack of descriptors is not cached: uses within the backoff fail
    /// at once without building, the first use after it builds, and the program is then cached.
    #[test]
    fn a_transient_build_failure_is_retried_after_the_backoff_and_not_cached() {
        let device = device();
        let context: &Context = &device.shared.context;
        let programs = Programs::default();
        let builds = Cell::new(0);
        let starved = || {
            builds.set(builds.get() + 1);
            Err(failure(CL_BUILD_PROGRAM_FAILURE, None, POCL_EMFILE))
        };
        let fine = || {
            builds.set(builds.get() + 1);
            from_source(context, SOURCE)
        };
        // The resource that ran out, and when the daemon tries again (ms).
        let code = |r: Result<_, TaskError>| match r {
            Err(TaskError::ResourceExhausted { resource, retry_ms }) => (Resource::from_code(resource), retry_ms),
            other => panic!("expected a transient resource failure, got {:?}", other.map(|_| ())),
        };
        let first = code(programs.get_or_build("test", "p", starved));
        assert_eq!(first.0, Resource::FileDescriptors);
        assert!(
            first.1 > 0 && first.1 <= RETRY_AFTER.as_millis() as u64,
            "retried within the backoff: {first:?}"
        );
        assert!(
            !programs.is_broken("p"),
            "a transient failure does not make the program broken"
        );
        // Within the backoff: refused without a compiler run, whatever the build would do.
        assert_eq!(
            code(programs.get_or_build("test", "p", fine)).0,
            Resource::FileDescriptors
        );
        assert_eq!(builds.get(), 1, "no build within the backoff");
        std::thread::sleep(RETRY_AFTER + RETRY_AFTER / 2);
        // Failed again: the backoff doubles.
        code(programs.get_or_build("test", "p", starved));
        assert_eq!(builds.get(), 2);
        std::thread::sleep(RETRY_AFTER + RETRY_AFTER / 2);
        code(programs.get_or_build("test", "p", fine));
        assert_eq!(builds.get(), 2, "the second backoff is twice the first");
        std::thread::sleep(RETRY_AFTER);
        programs
            .get_or_build("test", "p", fine)
            .expect("built once descriptors are back");
        assert_eq!(builds.get(), 3);
        programs.get_or_build("test", "p", starved).expect("cached");
        assert_eq!(builds.get(), 3, "a built program is not built again");
    }

    /// A genuine compile error (PoCL's own log) is not transient: cached as broken, never built
    /// again.
    #[test]
    fn a_compile_error_is_cached_as_broken() {
        let device = device();
        let context: &Context = &device.shared.context;
        let programs = Programs::default();
        let builds = Cell::new(0);
        let broken = || {
            builds.set(builds.get() + 1);
            from_source(context, "__kernel void k(__global int *x) { x[0] = undeclared; }")
        };
        let error = programs
            .get_or_build("test", "q", broken)
            .map(|_: std::sync::Arc<Program>| ());
        assert_eq!(error, Err(TaskError::DeviceFailed(CL_BUILD_PROGRAM_FAILURE.into())));
        assert!(programs.is_broken("q"));
        std::thread::sleep(RETRY_AFTER_MAX / 10);
        assert!(programs.get_or_build("test", "q", broken).is_err());
        assert_eq!(builds.get(), 1, "a broken program is not built again");
    }

    /// Every kernel's parameters (its signature's, the three guards and the flag pointer) fit in
    /// the least `CL_DEVICE_MAX_PARAMETER_SIZE` any OpenCL device may report (256 bytes, embedded
    /// profile), so no device refuses a library kernel for its arguments.
    #[test]
    fn every_kernel_takes_few_enough_parameter_bytes_for_any_device() {
        for k in agora_kernels::library() {
            let own: u64 = k
                .params
                .iter()
                .map(|p| match p.kind {
                    ParamKind::Buffer { .. } => 8, // a cl_mem (a pointer on a 64-bit device)
                    ParamKind::Scalar(t) => t.size(),
                })
                .sum();
            let bytes = own + 3 * 8 + 8;
            assert!(bytes <= 256, "{}: {bytes} parameter bytes", k.name);
        }
    }
}
