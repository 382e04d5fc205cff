//! Tenant programs: code a session submits at run time (`Request::BuildProgram`), built and run
//! in that session's sandboxed executor process (`agora-executor`), never in the daemon.
//!
//! Owns, per session, the programs built so far, their kernels (installed where the
//! scheduler's `validate` finds them, under ids with [`SESSION_KERNEL_BIT`] set) and the
//! session's [`Executor`]; and, daemon-wide, the program cache ([`cache`]) and who may build
//! ([`ProgramPolicy`]). Must not: run tenant code in the daemon, load a tenant's shared object,
//! or trust anything an executor says — its replies are bounded by the framing, their kernel
//! lists validated, and a binary goes into the cache only from an executor that had run no
//! tenant code yet.
//!
//! A program kernel is a [`KernelDef`] like any other, with `cpu: CpuImpl::External` (a
//! [`ProgramKernel`]) and no OpenCL implementation of the daemon's own: the scheduler places it
//! on the CPU device (which calls it on a lane thread, never inline on the dispatcher, and never
//! with private copies: the executor computes on the session's segment). Its name and doc are
//! owned text, so its metric label is `tenant_program` and tenant names never become labels.
//! Its size rules come from the program's manifest when it has one; without a manifest a
//! kernel has **no size check**: the daemon cannot know how much of each buffer it touches, and
//! does not need to — the executor maps only the tenant's own segment, so an out-of-bounds
//! access reads or writes the tenant's own memory or crashes the executor (`KernelCrashed`),
//! never anything of the daemon or another tenant.
//!
//! A launch ([`ProgramKernel::run`]) turns each buffer pointer into an offset within the
//! session's segment (refusing any pointer outside it), sends it to the executor and waits at
//! most the per-launch limit (`[programs] timeout_ms`): then the executor is killed and the task
//! fails with `KernelTimeout`; a crash fails it with `KernelCrashed`. Either way the next use
//! starts a new executor, which rebuilds the session's programs (from their binaries) under the
//! same numbers. One request at a time per executor: its lock is held for the exchange.
//!
//! Builds take 100 ms to a second, so they run on a builder thread that the control thread
//! starts (see `crate::control`), which replies in request order.
//!
//! `[programs] max_per_session` counts the programs a session holds at once ([`Held`]). The
//! same build asked for again (same language, name, code and manifest: everything the build
//! depends on, the daemon's settings aside, which do not change while it runs) is the program
//! the session holds already: the reply lists the same kernels under the same ids, marked
//! `cached`, and takes no slot; a service that builds its kernel per request therefore holds
//! it once.
//!
//! The client gives a program back (`Op::ReleaseProgram`, in its ring: after every task it
//! issued before) once per build reply it got, when it dropped the last handle to that program
//! or its kernels. When the session holds it no more, its slot is free at once and its kernel
//! ids leave the table: a later launch naming them fails with `UnknownKernel`, and they are
//! never given to another kernel (ids only grow). Its code stays loaded in the executor while
//! any task that resolved one of its kernels before the release may still run: each kernel's
//! definition holds an [`Unload`], and the last one to go asks the executor to unload the
//! program ([`ExecutorCell::lock`] carries it out before the next use; a restarted executor
//! never builds it again). So no task can reach an executor that no longer has its code, and
//! a session cannot keep more than its limit loaded for longer than its tasks in flight last.

mod cache;

use std::borrow::Cow;
use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use agora_executor::wire::{Arg, Code};
use agora_executor::{ExecError, Executor, ExecutorSpec, Killer};
use agora_kernels::{ArgValue, Cost, CpuImpl, ExternalKernel, KernelCall, KernelDef, KernelRef, Param, SizeCheck};
use agora_protocol::control::{ControlError, Response, MAX_PROGRAM_BYTES};
use agora_protocol::{Access, KernelSignature, ParamKind, TaskError};

pub(crate) use cache::ProgramCache;

use crate::config::{DaemonConfig, ProgramAccess};
use crate::kernels::SESSION_KERNEL_BIT;
use crate::session::Credentials;

/// Longest one build may take (a compiler that hangs on a tenant's source is killed).
pub(crate) const BUILD_TIMEOUT: Duration = Duration::from_secs(agora_protocol::control::PROGRAM_BUILD_SECONDS);

/// Longest a C program's loading may take: no compiler runs, only the dynamic linker and the
/// library's initialisers (tenant code), so a constructor that never returns fails the build
/// after this, well before the client stops waiting (the client's control timeout, 30 s by
/// default, or for a build at least `BUILD_TIMEOUT` plus a margin).
const LOAD_TIMEOUT: Duration = Duration::from_secs(10);

/// Longest an executor may take to start and initialise OpenCL.
const START_TIMEOUT: Duration = Duration::from_secs(20);

/// Most bytes of a program's manifest.
pub(crate) const MAX_MANIFEST_BYTES: usize = 64 << 10;

/// The kernels of a session's programs, by index (the id without [`SESSION_KERNEL_BIT`]):
/// written by the builder thread and by releases, read by the dispatcher's `validate`.
#[derive(Debug, Default)]
pub(crate) struct ProgramKernels(Mutex<KernelTable>);

#[derive(Debug, Default)]
struct KernelTable {
    kernels: HashMap<u32, KernelRef>,
    /// The next index: indexes only grow, so a released program's ids never name another
    /// kernel of the session.
    next: u32,
}

impl ProgramKernels {
    fn table(&self) -> std::sync::MutexGuard<'_, KernelTable> {
        self.0.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Kernel `index`.
    #[inline]
    pub(crate) fn get(&self, index: u32) -> Option<KernelRef> {
        self.table().kernels.get(&index).cloned()
    }

    /// Adds `kernels` under new indexes; returns the index of the first, or `None` when the
    /// session has used up its ids (2^31 kernels).
    pub(crate) fn install(&self, kernels: Vec<KernelRef>) -> Option<u32> {
        let mut table = self.table();
        let first = table.next;
        let next = first
            .checked_add(kernels.len() as u32)
            .filter(|&n| n <= SESSION_KERNEL_BIT)?;
        for (j, kernel) in kernels.into_iter().enumerate() {
            table.kernels.insert(first + j as u32, kernel);
        }
        table.next = next;
        Some(first)
    }

    /// Whether one of the kernels is called `name` (a session holds a few programs of a few
    /// kernels each: a scan).
    pub(crate) fn has_named(&self, name: &str) -> bool {
        self.table().kernels.values().any(|kernel| kernel.name == name)
    }

    /// Takes kernels `first .. first + count` out; the caller drops them (outside the lock).
    fn remove(&self, first: u32, count: u32) -> Vec<KernelRef> {
        let mut table = self.table();
        (first..first.saturating_add(count))
            .filter_map(|index| table.kernels.remove(&index))
            .collect()
    }
}

/// Who may build programs.
#[derive(Debug, Clone)]
pub(crate) struct ProgramPolicy {
    allow: ProgramAccess,
    uids: Vec<u32>,
    gids: Vec<u32>,
}

impl ProgramPolicy {
    pub(crate) fn of(config: &DaemonConfig) -> Self {
        ProgramPolicy {
            allow: config.programs_allow,
            uids: config.program_uids.clone(),
            gids: config.program_gids.clone(),
        }
    }

    /// `Err(NotPermitted)` naming the setting unless `credentials` may build programs.
    pub(crate) fn check(&self, credentials: &Credentials) -> Result<(), ControlError> {
        if self.allow == ProgramAccess::Everyone
            || self.uids.contains(&credentials.uid)
            || credentials.in_any_group(&self.gids)
        {
            return Ok(());
        }
        Err(ControlError::NotPermitted(format!(
            "uid {} (in groups {:?}) may not build programs: the daemon's [programs] allow = \"nobody\", and \
             [programs] uids / gids list neither it nor a group it is in; ask the operator",
            credentials.uid,
            credentials.all_groups()
        )))
    }
}

/// The checks of a build request that need no executor: its size, language and manifest size.
pub(crate) fn check_request(language: &str, code: &[u8], manifest: Option<&str>) -> Result<(), ControlError> {
    if code.len() > MAX_PROGRAM_BYTES {
        return Err(ControlError::BadRequest(format!(
            "the program's code is {} bytes; at most {MAX_PROGRAM_BYTES} bytes (MAX_PROGRAM_BYTES) are \
             accepted: larger code belongs in a kernel package the operator installs",
            code.len()
        )));
    }
    if manifest.is_some_and(|m| m.len() > MAX_MANIFEST_BYTES) {
        return Err(ControlError::BadRequest(format!(
            "the program's manifest is longer than {MAX_MANIFEST_BYTES} bytes"
        )));
    }
    match language {
        "opencl" => {}
        "c" if manifest.is_none() => {
            return Err(ControlError::BadRequest(
                "a C program needs a manifest ([kernels.NAME] tables with params and sizes) describing its kernels"
                    .into(),
            ))
        }
        "cuda" | "ptx" if manifest.is_none() => return Err(ControlError::BadRequest(format!(
            "a {} program needs a manifest ([kernels.NAME] tables with params and sizes, and cuda = {{ entry = \"...\" }} \
             where the function's name differs) describing its kernels",
            if language == "cuda" { "CUDA C" } else { "PTX" }
        ))),
        "c" | "cuda" | "ptx" => {}
        other => {
            return Err(ControlError::BadRequest(format!(
                "unknown program language '{}': use opencl (OpenCL C source), c (a shared object), cuda (CUDA C \
                 source) or ptx (PTX text)",
                other.chars().take(32).collect::<String>()
            )))
        }
    }
    // Nothing to build (and an empty OpenCL source once crashed the executor's platform).
    let blank = if language == "c" {
        code.is_empty()
    } else {
        code.iter().all(u8::is_ascii_whitespace)
    };
    if blank {
        Err(ControlError::BadRequest(match language {
            "c" => "the program's shared object is empty: pass the bytes (or path) of a library built with \
                    cc -shared -fPIC"
                .into(),
            _ => "the program's source is empty: pass source that defines at least one kernel (in OpenCL C, \
                  a __kernel void NAME(...) function)"
                .into(),
        }))
    } else {
        Ok(())
    }
}

/// The session's executor, shared by its program kernels.
#[derive(Debug)]
pub(crate) struct ExecutorCell {
    executor: Mutex<Executor>,
    killer: Killer,
    /// The daemon's mapping of the session's segment: pointers in launches are translated
    /// against it (never dereferenced here).
    segment_base: usize,
    segment_len: u64,
    timeout: Duration,
    closed: AtomicBool,
    /// Programs whose last kernel definition went ([`Unload`]), for the executor to unload at
    /// its next use: the definitions go on whatever thread drops them last (the dispatcher,
    /// a lane), which must not wait for the executor's lock.
    unloads: Mutex<Vec<u32>>,
}

impl ExecutorCell {
    /// The executor, once it has unloaded the programs no kernel definition names any more.
    fn lock(&self) -> std::sync::MutexGuard<'_, Executor> {
        let mut executor = self.executor.lock().unwrap_or_else(|e| e.into_inner());
        let unloads = std::mem::take(&mut *self.unloads.lock().unwrap_or_else(|e| e.into_inner()));
        for program in unloads {
            executor.unload(program);
        }
        executor
    }
}

/// Held by each kernel definition of an executor program: when the last goes (the session
/// released the program, and every task that resolved one of its kernels is done with it), the
/// executor unloads the program. A kernel definition cannot outlive its code this way, which a
/// release acting on the executor at once could not promise: a task resolved before the release
/// may still be queued.
#[derive(Debug)]
struct Unload {
    cell: Arc<ExecutorCell>,
    program: u32,
}

impl Drop for Unload {
    fn drop(&mut self) {
        self.cell
            .unloads
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .push(self.program);
    }
}

/// What identifies a build: a digest of its language, name, code and manifest.
type BuildKey = [u8; 32];

/// The digest of a build request ([`BuildKey`]); each part is length-prefixed, so no two
/// requests share one by moving bytes between parts.
fn build_key(language: &str, name: &str, code: &[u8], manifest: Option<&str>) -> BuildKey {
    use sha2::Digest;
    let mut hash = sha2::Sha256::new();
    for part in [language.as_bytes(), name.as_bytes(), code] {
        hash.update((part.len() as u64).to_le_bytes());
        hash.update(part);
    }
    match manifest {
        Some(m) => {
            hash.update([1]);
            hash.update((m.len() as u64).to_le_bytes());
            hash.update(m.as_bytes());
        }
        None => hash.update([0]),
    }
    hash.finalize().into()
}

/// A program the session holds.
#[derive(Debug)]
struct HeldProgram {
    key: BuildKey,
    /// Build replies that gave it to the client, less its releases.
    holds: u64,
    /// The reply its build got (ids and signatures, log), given again when it is reused.
    kernels: Vec<(u32, KernelSignature)>,
    log: String,
}

/// The programs a session holds, by the index of their first kernel (ids without
/// [`SESSION_KERNEL_BIT`]), and which build each is.
#[derive(Debug, Default)]
struct Held {
    programs: BTreeMap<u32, HeldProgram>,
    by_key: HashMap<BuildKey, u32>,
}

impl Held {
    /// The reply for a build the session holds already, if it does.
    fn reuse(&mut self, key: &BuildKey) -> Option<Response> {
        let first = *self.by_key.get(key)?;
        let program = self.programs.get_mut(&first)?;
        program.holds += 1;
        Some(Response::Program {
            kernels: program.kernels.clone(),
            log: program.log.clone(),
            cached: true,
        })
    }

    /// The first kernel index of the held program whose kernel has id `kernel`.
    fn program_of(&self, kernel: u32) -> Option<u32> {
        if kernel & SESSION_KERNEL_BIT == 0 {
            return None;
        }
        let index = kernel & !SESSION_KERNEL_BIT;
        let (&first, program) = self.programs.range(..=index).next_back()?;
        (index - first < program.kernels.len() as u32).then_some(first)
    }
}

/// A session's programs.
#[derive(Debug)]
pub(crate) struct SessionPrograms {
    kernels: Arc<ProgramKernels>,
    cell: Arc<ExecutorCell>,
    /// The programs it holds (the limit counts them; a build of one of them reuses it).
    held: Mutex<Held>,
    session: u64,
    /// Whether the daemon has an executor program (`[programs] executor`): OpenCL and C programs
    /// run in one.
    has_executor: bool,
}

impl SessionPrograms {
    /// The programs of a session whose segment is `segment` (the daemon's mapping) and whose
    /// client has `credentials`; `kernels` is the table the session's `validate` reads.
    pub(crate) fn new(
        config: &DaemonConfig,
        session: u64,
        segment: &agora_transport::shm::Segment,
        credentials: Credentials,
        kernels: Arc<ProgramKernels>,
    ) -> Result<Self, ControlError> {
        // CUDA C and PTX programs need no executor, so a daemon without one still builds them;
        // OpenCL and C builds are refused (`build_inner`) with what to set.
        let has_executor = config.program_executor.is_some();
        let program = config.program_executor.clone().unwrap_or_default();
        let fd = segment
            .fd()
            .try_clone_to_owned()
            .map_err(|e| ControlError::BadRequest(format!("the daemon could not share the segment: {e}")))?;
        // Root drops the executor to the tenant's own user; anyone else runs it as itself.
        let tenant = (rustix::process::geteuid().is_root() && credentials.uid != 0)
            .then_some((credentials.uid, credentials.gid));
        let executor = Executor::new(ExecutorSpec {
            program,
            segment: fd,
            scratch: std::env::temp_dir(),
            tenant,
            start_timeout: START_TIMEOUT,
            build_timeout: BUILD_TIMEOUT,
            load_timeout: LOAD_TIMEOUT,
        });
        Ok(SessionPrograms {
            kernels,
            cell: Arc::new(ExecutorCell {
                killer: executor.killer(),
                executor: Mutex::new(executor),
                segment_base: segment.view().base() as usize,
                segment_len: segment.len() as u64,
                timeout: config.program_timeout,
                closed: AtomicBool::new(false),
                unloads: Mutex::default(),
            }),
            held: Mutex::default(),
            session,
            has_executor,
        })
    }

    fn held(&self) -> std::sync::MutexGuard<'_, Held> {
        self.held.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The client gave back the program whose kernel has id `kernel` (`Op::ReleaseProgram`);
    /// `false` when the session holds no such program. When this was its last hold, the
    /// program is forgotten: its slot is free, its ids are refused from now on, and its code is
    /// unloaded once the tasks that resolved its kernels are done (see the module doc).
    pub(crate) fn release(&self, kernel: u32) -> bool {
        let mut held = self.held();
        let Some(first) = held.program_of(kernel) else {
            return false;
        };
        let Some(program) = held.programs.get_mut(&first) else {
            return false;
        };
        program.holds -= 1;
        if program.holds > 0 {
            return true;
        }
        let Some(program) = held.programs.remove(&first) else {
            return false;
        };
        if held.by_key.get(&program.key) == Some(&first) {
            held.by_key.remove(&program.key);
        }
        drop(held);
        // Dropped here, on the dispatcher: the last definitions only queue an unload.
        drop(self.kernels.remove(first, program.kernels.len() as u32));
        true
    }

    /// Whether the session holds the program whose kernel has id `kernel`.
    pub(crate) fn holds(&self, kernel: u32) -> bool {
        self.held().program_of(kernel).is_some()
    }

    /// `Err(TooMany)` when the session holds `max` programs.
    fn check_room(&self, max: usize) -> Result<(), ControlError> {
        if self.held().programs.len() >= max {
            return Err(ControlError::TooMany {
                what: "programs".into(),
                limit: max as u64,
            });
        }
        Ok(())
    }
}

impl SessionPrograms {
    /// The session's client is gone: its executor is killed now, so a tenant kernel running
    /// there fails at once instead of holding its lane until the program timeout (a lane job
    /// holds these programs, so their drop would wait for that very job).
    pub(crate) fn end(&self) {
        self.cell.closed.store(true, Ordering::Release);
        self.cell.killer.kill();
    }
}

impl Drop for SessionPrograms {
    /// The session ended: its executor is killed now (without waiting for a launch that holds
    /// its lock, which then fails) and reaped by whoever holds it last.
    fn drop(&mut self) {
        self.end();
        // Reaping waits for the process to finish dying: not on the dispatcher.
        let cell = self.cell.clone();
        let reaper = std::thread::Builder::new()
            .name("agora-reap".into())
            .spawn(move || cell.lock().stop());
        if reaper.is_err() {
            if let Ok(mut executor) = self.cell.executor.try_lock() {
                executor.stop();
            }
        }
    }
}

/// A build to run off the dispatcher.
pub(crate) struct BuildJob {
    pub(crate) programs: Arc<SessionPrograms>,
    pub(crate) cache: Arc<ProgramCache>,
    pub(crate) language: String,
    pub(crate) code: Vec<u8>,
    pub(crate) manifest: Option<String>,
    pub(crate) name: String,
    pub(crate) max_programs: usize,
    /// `[programs] in_daemon`: an OpenCL program's kernels may also run on the daemon's own
    /// OpenCL devices.
    pub(crate) in_daemon: bool,
    /// `[programs] on_gpus`: ... and on its GPUs, fenced.
    pub(crate) on_gpus: bool,
    /// The daemon's devices, to tell a CUDA program's author when none can run it (weak: the
    /// devices go with the scheduler).
    pub(crate) devices: Vec<std::sync::Weak<dyn agora_devices::Device>>,
}

/// Runs a build (on a builder thread) and returns the reply.
pub(crate) fn build(job: BuildJob) -> Response {
    let started = Instant::now();
    let session = job.programs.session;
    let name = job.name.clone();
    let result = build_inner(job);
    match &result {
        Ok(Response::Program { kernels, cached, .. }) => tracing::info!(
            session,
            kernels = kernels.len(),
            cached,
            ms = started.elapsed().as_secs_f64() * 1e3,
            "tenant program built"
        ),
        _ => tracing::info!(session, "tenant program did not build"),
    }
    result.unwrap_or_else(|e| {
        Response::Error(match e {
            ControlError::ProgramBuild { log, .. } => ControlError::ProgramBuild { name, log },
            other => other,
        })
    })
}

fn build_inner(job: BuildJob) -> Result<Response, ControlError> {
    let BuildJob {
        programs,
        cache,
        language,
        code,
        manifest,
        name,
        max_programs,
        in_daemon,
        on_gpus,
        devices,
    } = job;
    check_request(&language, &code, manifest.as_deref())?;
    // The same build again is the program the session holds (a connection builds one program
    // at a time, so no build of the same key runs meanwhile).
    let key = build_key(&language, &name, &code, manifest.as_deref());
    if let Some(reply) = programs.held().reuse(&key) {
        return Ok(reply);
    }
    let specs = match manifest.as_deref() {
        None => None,
        Some(text) => Some(
            agora_packages::program_manifest(text, &format!("the manifest of program '{name}'"))
                .map_err(|e| ControlError::BadRequest(e.to_string()))?,
        ),
    };
    if let Some(spec) = specs.iter().flatten().find(|s| s.opencl_local.is_some()) {
        return Err(ControlError::BadRequest(format!(
            "kernel {}: tenant programs run with the exact range and no required work-group size; remove opencl.local",
            spec.name
        )));
    }
    let failed = |log: String| ControlError::ProgramBuild {
        name: name.clone(),
        log,
    };
    if language == "cuda" || language == "ptx" {
        if !on_gpus {
            return Err(ControlError::BadRequest(
                "this daemon runs no tenant code on its GPUs ([programs] on_gpus = false), and CUDA C and PTX \
                 programs run only there; ask the operator, or write the program in OpenCL C"
                    .into(),
            ));
        }
        programs.check_room(max_programs)?;
        let specs = specs.unwrap_or_default();
        let (defs, log) = cuda_definitions(&language, code, &specs, &name).map_err(|e| match e {
            CudaBuildError::Refused(message) => ControlError::BadRequest(message),
            CudaBuildError::Build(log) => failed(log),
        })?;
        // Each GPU that runs it compiles (for its own architecture), fences and loads it now: what
        // its driver rejects (e.g. PTX for a newer GPU) is the build's error, with the JIT's log.
        let devices: Vec<_> = devices.iter().filter_map(std::sync::Weak::upgrade).collect();
        for def in &defs {
            for device in &devices {
                if let Some(Err(why)) = device.prepare(def) {
                    return Err(failed(format!("{}: {why}", device.info().name)));
                }
            }
        }
        let runnable = defs.iter().all(|def| devices.iter().any(|d| d.implements(def)));
        drop(devices);
        let log = if runnable {
            log
        } else {
            format!(
                "{log}{}note: no device of this daemon can run it now (CUDA C and PTX programs run only on NVIDIA \
                 GPUs with virtual memory management, fenced); its launches fail with NoDevice until one is present\n",
                if log.is_empty() || log.ends_with('\n') {
                    ""
                } else {
                    "\n"
                }
            )
        };
        return install(&programs, key, defs, log, false);
    }
    if !programs.has_executor {
        return Err(ControlError::BadRequest(
            "this daemon cannot run OpenCL or C tenant programs: it has no executor program (it does not run \
             inside the agora binary); set [programs] executor or AGORA_EXECUTOR to the agora binary"
                .into(),
        ));
    }
    let cell = &programs.cell;
    if cell.closed.load(Ordering::Acquire) {
        return Err(ControlError::BadRequest("the session ended".into()));
    }
    programs.check_room(max_programs)?;
    let mut executor = cell.lock();
    let started = |e: ExecError| match e {
        ExecError::BuildFailed(log) => failed(log),
        // The tenant's code did not finish building: a build error, not a daemon failure.
        ExecError::BuildTimedOut(limit) if language == "c" => failed(format!(
            "the shared object's loading and initialisation did not finish within {} s (a constructor, \
             __attribute__((constructor)) or C++ static initialiser, that does not return?); it was stopped",
            limit.as_secs()
        )),
        ExecError::BuildTimedOut(limit) => failed(format!(
            "the OpenCL compiler did not finish within {} s; it was stopped: simplify the program",
            limit.as_secs()
        )),
        other => {
            tracing::warn!(session = programs.session, error = %other, "a tenant program's executor failed during a build");
            ControlError::BadRequest(format!("the program's executor failed: {other}"))
        }
    };
    let mut daemon_source = None;
    let (code, cache_key) = match language.as_str() {
        "opencl" => {
            let source = String::from_utf8(code)
                .map_err(|_| ControlError::BadRequest("OpenCL C source must be UTF-8 text".into()))?;
            if in_daemon || on_gpus {
                daemon_source = Some(source.clone());
            }
            let device = executor.device().map_err(started)?;
            let key = device.map(|d| ProgramCache::key(&d, agora_executor::BUILD_OPTIONS, &source));
            let binary = key.as_ref().and_then(|k| cache.load(k));
            (Code::OpenCl { source, binary }, key)
        }
        _ => {
            let specs = specs.as_deref().unwrap_or_default();
            let symbols = specs
                .iter()
                .map(|s| s.cpu_symbol.clone().unwrap_or_else(|| s.name.clone()))
                .collect();
            (Code::Library { bytes: code, symbols }, None)
        }
    };
    let built = executor.build(code).map_err(started)?;
    drop(executor);
    if let (Some(cache_key), Some(binary), false, true) = (&cache_key, &built.binary, built.from_binary, built.clean) {
        cache.store(cache_key, binary);
    }
    let library = language == "c";
    let unload = Arc::new(Unload {
        cell: cell.clone(),
        program: built.program,
    });
    let mut defs = definitions(&built.kernels, specs.as_deref(), library, &unload, &name).map_err(failed)?;
    if let Some(source) = daemon_source {
        // In-daemon placement allowed: the same source as an OpenCL implementation the daemon's
        // devices build and run like a package's (plain convention: exact range, no revocation).
        // Its name says where: on OpenCL devices and GPUs (`in_daemon`), or fenced on GPUs only.
        use sha2::Digest;
        let hash: [u8; 32] = sha2::Sha256::digest(source.as_bytes()).into();
        let program: String = hash[..8].iter().map(|b| format!("{b:02x}")).collect();
        let prefix = if in_daemon {
            agora_kernels::TENANT_PROGRAM_PREFIX
        } else {
            agora_kernels::FENCED_TENANT_PROGRAM_PREFIX
        };
        for (def, kernel) in defs.iter_mut().zip(&built.kernels) {
            def.opencl = Some(agora_kernels::OpenClImpl {
                program: Cow::Owned(format!("{prefix}{program}")),
                source: Cow::Owned(source.clone()),
                entry: Cow::Owned(kernel.name.clone()),
                local: None,
                binaries: Cow::Borrowed(&[]),
            });
        }
    }
    install(&programs, key, defs, built.log, built.from_binary)
}

/// Installs a built program's kernels for its session, which now holds it; the reply.
fn install(
    programs: &SessionPrograms,
    key: BuildKey,
    defs: Vec<KernelDef>,
    log: String,
    cached: bool,
) -> Result<Response, ControlError> {
    let signatures: Vec<KernelSignature> = defs.iter().map(|d| d.signature()).collect();
    let first = programs
        .kernels
        .install(defs.into_iter().map(|d| KernelRef::Shared(Arc::new(d))).collect())
        .ok_or_else(|| {
            ControlError::BadRequest(
                "this session has used up its 2^31 program kernel ids (ids are never reused): open a new session"
                    .into(),
            )
        })?;
    let kernels: Vec<(u32, KernelSignature)> = signatures
        .into_iter()
        .enumerate()
        .map(|(j, s)| (SESSION_KERNEL_BIT | (first + j as u32), s))
        .collect();
    let mut held = programs.held();
    held.by_key.insert(key, first);
    held.programs.insert(
        first,
        HeldProgram {
            key,
            holds: 1,
            kernels: kernels.clone(),
            log: log.clone(),
        },
    );
    Ok(Response::Program { kernels, log, cached })
}

/// Why a CUDA C or PTX program was not built.
enum CudaBuildError {
    /// The request cannot be served here (no CUDA backend, no NVRTC, not UTF-8).
    Refused(String),
    /// The code did not compile, does not match its manifest, or cannot be fenced: the log.
    Build(String),
}

/// The definitions of a tenant's CUDA C (`language` `cuda`) or PTX (`ptx`) program, checked here
/// as far as no GPU is needed, and NVRTC's log.
///
/// A GPU runs such a program only fenced (`tenant-fenced/<hash>`), so it is refused now if the
/// pass would refuse it: CUDA C is compiled by NVRTC (for `compute_80`, as a check; each GPU
/// compiles it again for its own architecture), each kernel's entry must take exactly its
/// declared parameters (tenant kernels get no revocation flag nor row offset: each launch runs
/// whole, over its exact range), and the PTX is fenced and the result checked.
#[cfg(feature = "cuda")]
fn cuda_definitions(
    language: &str,
    code: Vec<u8>,
    specs: &[agora_packages::KernelSpec],
    name: &str,
) -> Result<(Vec<KernelDef>, String), CudaBuildError> {
    use agora_devices::cuda::{fence, programs as cuda};
    use agora_kernels::{CudaCode, CudaImpl};
    /// The architecture tenant CUDA C is checked for: the oldest with the features fencing relies on
    /// (Ampere); PTX for it JIT-compiles on every later GPU.
    const CHECK_ARCH: u32 = 80;
    let text = String::from_utf8(code)
        .map_err(|_| CudaBuildError::Refused(format!("{} must be UTF-8 text", language_name(language))))?;
    if specs.is_empty() {
        return Err(CudaBuildError::Refused(
            "the manifest describes no kernel: add a [kernels.NAME] table per kernel".into(),
        ));
    }
    let (ptx, log) = if language == "cuda" {
        if !cuda::nvrtc_available() {
            return Err(CudaBuildError::Refused(
                "this daemon cannot compile CUDA C: NVRTC (libnvrtc.so) is not installed here; send PTX \
                 (language ptx), or ask the operator to install NVRTC or set AGORA_NVRTC"
                    .into(),
            ));
        }
        let ptx = cuda::compile_ptx(name, &text, CHECK_ARCH).map_err(|e| CudaBuildError::Build(e.log))?;
        (ptx, String::new())
    } else {
        (text.clone(), String::new())
    };
    for spec in specs {
        let entry = spec.cuda_entry.as_deref().unwrap_or(&spec.name);
        match fence::entry_parameter_count(&ptx, entry) {
            Ok(Some(count)) if count == spec.params.len() => {}
            Ok(Some(count)) => {
                return Err(CudaBuildError::Build(format!(
                    "kernel {}: entry {entry} takes {count} parameters; the manifest declares {}. A tenant's CUDA \
                     kernel takes exactly its declared parameters (no range guards, revocation flag nor row offset)",
                    spec.name,
                    spec.params.len()
                )))
            }
            Ok(None) => {
                return Err(CudaBuildError::Build(format!(
                    "kernel {}: the {} has no kernel entry {entry}{}",
                    spec.name,
                    language_name(language),
                    if language == "cuda" {
                        " (declare it extern \"C\" __global__, so its name is not mangled)"
                    } else {
                        " (.entry)"
                    }
                )))
            }
            Err(e) => return Err(CudaBuildError::Build(format!("the PTX: {e}"))),
        }
    }
    fence::fence(&ptx)
        .and_then(|fenced| fence::check_fenced(&fenced.ptx))
        .map_err(|e| {
            CudaBuildError::Build(format!(
                "the program cannot be fenced into the tenant's GPU memory, so no GPU will run it: {e}"
            ))
        })?;
    use sha2::Digest;
    let hash: [u8; 32] = sha2::Sha256::digest(text.as_bytes()).into();
    let program: String = hash[..8].iter().map(|b| format!("{b:02x}")).collect();
    let program = format!("{}{program}", agora_kernels::FENCED_TENANT_PROGRAM_PREFIX);
    let code = if language == "cuda" {
        CudaCode::Source(Cow::Owned(text))
    } else {
        CudaCode::Ptx(Cow::Owned(text))
    };
    let defs = specs
        .iter()
        .map(|spec| KernelDef {
            name: Cow::Owned(spec.name.clone()),
            doc: Cow::Owned(if spec.doc.is_empty() {
                format!(
                    "kernel {} of the session's {} program '{name}'",
                    spec.name,
                    language_name(language)
                )
            } else {
                spec.doc.clone()
            }),
            params: Cow::Owned(spec.params.clone()),
            cost: spec.cost,
            // It runs whole: a plain kernel cannot start at a row on a GPU.
            chunkable: false,
            check: spec.check.clone(),
            cpu: None,
            opencl: None,
            cuda: Some(CudaImpl {
                program: Cow::Owned(program.clone()),
                code: code.clone(),
                entry: Cow::Owned(spec.cuda_entry.clone().unwrap_or_else(|| spec.name.clone())),
                guarded: false,
            }),
        })
        .collect();
    Ok((defs, log))
}

#[cfg(not(feature = "cuda"))]
fn cuda_definitions(
    language: &str,
    _code: Vec<u8>,
    _specs: &[agora_packages::KernelSpec],
    _name: &str,
) -> Result<(Vec<KernelDef>, String), CudaBuildError> {
    Err(CudaBuildError::Refused(format!(
        "this daemon was built without the CUDA backend, so it runs no {} programs",
        language_name(language)
    )))
}

fn language_name(language: &str) -> &'static str {
    if language == "cuda" {
        "CUDA C source"
    } else {
        "PTX"
    }
}

/// The definitions of a built program's kernels: parameters from the compiler (OpenCL) or the
/// manifest (C, and OpenCL kernels the manifest describes), size rules and chunkability from
/// the manifest.
fn definitions(
    kernels: &[agora_executor::wire::BuiltKernel],
    specs: Option<&[agora_packages::KernelSpec]>,
    library: bool,
    unload: &Arc<Unload>,
    name: &str,
) -> Result<Vec<KernelDef>, String> {
    let mut defs = Vec::new();
    for (index, kernel) in kernels.iter().enumerate() {
        let spec = specs.and_then(|specs| {
            if library {
                specs.get(index)
            } else {
                specs
                    .iter()
                    .find(|s| s.opencl_entry.as_deref().unwrap_or(&s.name) == kernel.name)
            }
        });
        let params: Vec<Param> = match spec {
            Some(spec) => {
                if !library {
                    matches_compiler(&kernel.params, &spec.params, &kernel.name)?;
                }
                spec.params.clone()
            }
            None => kernel
                .params
                .iter()
                .map(|p| Param {
                    name: Cow::Owned(p.name.clone()),
                    kind: p.kind,
                })
                .collect(),
        };
        let kernel_name = spec.map_or_else(|| kernel.name.clone(), |s| s.name.clone());
        let doc = match spec.map(|s| s.doc.as_str()).filter(|d| !d.is_empty()) {
            Some(doc) => doc.to_string(),
            None => format!("kernel {} of the session's program '{name}'", kernel.name),
        };
        defs.push(KernelDef {
            cuda: None,
            name: Cow::Owned(kernel_name),
            doc: Cow::Owned(doc),
            cost: spec.map_or(Cost::PerItemNs(2.0), |s| s.cost),
            chunkable: spec.is_some_and(|s| s.chunkable),
            check: spec.map_or(SizeCheck::Builtin(no_size_check), |s| s.check.clone()),
            cpu: Some(CpuImpl::External(Arc::new(ProgramKernel {
                program: unload.clone(),
                kernel: index as u32,
                arity: params.len(),
            }))),
            opencl: None,
            params: Cow::Owned(params),
        });
    }
    if let Some(spec) = specs.filter(|_| !library).and_then(|specs| {
        specs.iter().find(|s| {
            !kernels
                .iter()
                .any(|k| k.name == s.opencl_entry.as_deref().unwrap_or(&s.name))
        })
    }) {
        return Err(format!(
            "the manifest describes kernel {}, which the program does not define",
            spec.name
        ));
    }
    Ok(defs)
}

/// Checks a manifest's parameters against what the OpenCL compiler reports: the same count and
/// kinds, and no writing to a `const` buffer.
fn matches_compiler(compiled: &[agora_protocol::ParamSpec], declared: &[Param], kernel: &str) -> Result<(), String> {
    if compiled.len() != declared.len() {
        return Err(format!(
            "kernel {kernel}: the manifest declares {} parameters, the source {}",
            declared.len(),
            compiled.len()
        ));
    }
    for (index, (c, d)) in compiled.iter().zip(declared).enumerate() {
        let same = match (c.kind, d.kind) {
            (ParamKind::Scalar(a), ParamKind::Scalar(b)) => a == b,
            (ParamKind::Buffer { element: a, access: ca }, ParamKind::Buffer { element: b, access: da }) => {
                a == b && (ca != Access::Read || da == Access::Read)
            }
            _ => false,
        };
        if !same {
            return Err(format!(
                "kernel {kernel}: parameter {index} is {} in the manifest but {} in the source",
                d.kind, c.kind
            ));
        }
    }
    Ok(())
}

/// The size check of a kernel without a manifest: none (see the module doc).
fn no_size_check(_: &agora_kernels::LaunchShape<'_>) -> Result<(), TaskError> {
    Ok(())
}

/// A kernel of a tenant program: a launch is a request to the session's executor.
#[derive(Debug)]
pub(crate) struct ProgramKernel {
    /// Its program, in its session's executor: loaded while this lives.
    program: Arc<Unload>,
    kernel: u32,
    arity: usize,
}

impl ExternalKernel for ProgramKernel {
    fn run(&self, call: &KernelCall<'_>, rows: std::ops::Range<u64>) -> Result<(), TaskError> {
        let cell = &self.program.cell;
        let args = translate(call, self.arity, cell.segment_base, cell.segment_len)?;
        let range = call.range();
        // The launch's dimensions as OpenCL sees them (trailing extents of 1 do not count).
        let dims = if range[2] > 1 {
            3
        } else if range[1] > 1 {
            2
        } else {
            1
        };
        if cell.closed.load(Ordering::Acquire) {
            return Err(TaskError::Cancelled);
        }
        let mut executor = cell.lock();
        let outcome = executor.run(
            self.program.program,
            self.kernel,
            range,
            dims,
            [rows.start, rows.end],
            args,
            cell.timeout,
        );
        if cell.closed.load(Ordering::Acquire) {
            // The session ended meanwhile: the process is killed already; reap it here.
            executor.stop();
        }
        drop(executor);
        outcome.map_err(|error| match error {
            ExecError::TimedOut(limit) => TaskError::KernelTimeout {
                limit_ms: limit.as_millis() as u64,
            },
            ExecError::Crashed { signal } => TaskError::KernelCrashed {
                signal: u16::try_from(signal).unwrap_or(u16::MAX),
            },
            ExecError::Stopped => TaskError::Cancelled,
            // The tenant's own failure report: the code goes to the tenant, who cannot read
            // the daemon's log.
            ExecError::Returned { code } => TaskError::KernelReturned { code },
            ExecError::Failed { code, message } => {
                // The tenant's text: escaped, so that it cannot write to the operator's terminal.
                tracing::info!(code, message = %agora_protocol::control::shown(&message), "a tenant kernel failed");
                // An OpenCL error of the launch goes to the tenant, who cannot read this log;
                // -1 is the executor's own refusal of a request (a daemon bug).
                if code < -1 {
                    TaskError::KernelOpenCl { code }
                } else {
                    TaskError::KernelFault
                }
            }
            // The tenant's code called exit (or the dynamic linker did, status 127): the status
            // goes to the tenant.
            ExecError::Exited(Some(status)) => {
                tracing::info!(status, "a tenant kernel ended its executor with an exit status");
                TaskError::KernelExited { status }
            }
            other => {
                tracing::warn!(error = %other, "a tenant program's executor failed during a launch");
                TaskError::KernelFault
            }
        })
    }
}

/// The executor's view of `call`'s first `arity` arguments: each buffer as an offset into the
/// session's segment (the daemon maps it at `base`, `len` bytes long). A pointer outside the
/// segment is a daemon bug, refused rather than passed on.
pub(crate) fn translate(call: &KernelCall<'_>, arity: usize, base: usize, len: u64) -> Result<Vec<Arg>, TaskError> {
    (0..arity)
        .map(|index| match call.arg(index) {
            ArgValue::Buffer { ptr, len: bytes } => {
                let offset = (ptr as usize).checked_sub(base).map(|o| o as u64);
                match offset {
                    Some(offset) if offset.checked_add(bytes).is_some_and(|end| end <= len) => {
                        Ok(Arg::Buffer { offset, len: bytes })
                    }
                    _ => Err(crate::internal_error(
                        30,
                        "a tenant kernel's buffer lies outside its session's segment",
                    )),
                }
            }
            ArgValue::Scalar(bits) => Ok(Arg::Scalar(bits)),
            ArgValue::None => Err(crate::internal_error(31, "a tenant kernel's argument is missing")),
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn call_with(args: &[ArgValue]) -> KernelCall<'static> {
        // SAFETY: the pointers are never dereferenced (translate only computes offsets).
        unsafe { KernelCall::new(&[16], args) }
    }

    #[test]
    fn pointers_become_offsets_within_the_segment_and_others_are_refused() {
        let base = 0x10_0000usize;
        let inside = call_with(&[
            ArgValue::Scalar(7),
            ArgValue::Buffer {
                ptr: (base + 4096) as *mut u8,
                len: 64,
            },
            ArgValue::Buffer {
                ptr: (base + 8192 - 64) as *mut u8,
                len: 64,
            },
        ]);
        assert_eq!(
            translate(&inside, 3, base, 8192).unwrap(),
            vec![
                Arg::Scalar(7),
                Arg::Buffer { offset: 4096, len: 64 },
                Arg::Buffer {
                    offset: 8192 - 64,
                    len: 64
                }
            ]
        );
        for (ptr, len) in [
            (base - 64, 64u64),     // before the segment
            (base + 8192 - 32, 64), // runs past its end
            (base + 8192, 1),       // just past it
            (base + 64, u64::MAX),  // overflowing length
            (usize::MAX - 8, 16),   // far away
        ] {
            let call = call_with(&[ArgValue::Buffer {
                ptr: ptr as *mut u8,
                len,
            }]);
            assert!(
                matches!(translate(&call, 1, base, 8192), Err(TaskError::Internal(30))),
                "{ptr:#x} + {len}"
            );
        }
        assert!(matches!(
            translate(&call_with(&[]), 1, base, 8192),
            Err(TaskError::Internal(31))
        ));
    }

    #[test]
    fn requests_are_checked_before_any_executor_starts() {
        check_request("opencl", b"__kernel void k() {}", None).unwrap();
        let big = vec![b' '; MAX_PROGRAM_BYTES + 1];
        let err = check_request("opencl", &big, None).unwrap_err().to_string();
        assert!(err.contains(&MAX_PROGRAM_BYTES.to_string()), "{err}");
        // Nothing to build is refused before any executor sees it (an empty OpenCL source once
        // crashed the executor with SIGSEGV).
        for (language, code) in [("opencl", &b""[..]), ("opencl", b"  \n\t"), ("ptx", b""), ("c", b"")] {
            let err = check_request(language, code, Some("")).unwrap_err().to_string();
            assert!(err.contains("empty"), "{language} {code:?}: {err}");
        }
        assert!(check_request("fortran", b"x", None)
            .unwrap_err()
            .to_string()
            .contains("opencl"));
        assert!(check_request("c", b"x", None)
            .unwrap_err()
            .to_string()
            .contains("manifest"));
    }

    #[test]
    fn the_policy_names_its_setting() {
        let tenant = Credentials {
            pid: 1,
            uid: 1000,
            gid: 100,
            groups: Arc::from([100, 300]),
        };
        let mut policy = ProgramPolicy {
            allow: ProgramAccess::Everyone,
            uids: vec![],
            gids: vec![],
        };
        policy.check(&tenant).unwrap();
        policy.allow = ProgramAccess::Nobody;
        let err = policy.check(&tenant).unwrap_err().to_string();
        assert!(err.contains("[programs] allow") && err.contains("1000"), "{err}");
        policy.gids = vec![100];
        policy.check(&tenant).unwrap();
        policy.gids = vec![300];
        policy.check(&tenant).expect("a member by a supplementary group");
        policy.gids.clear();
        policy.uids = vec![1000];
        policy.check(&tenant).unwrap();
    }

    #[test]
    fn manifests_must_agree_with_the_compiler() {
        use agora_protocol::ScalarType;
        let compiled = vec![
            agora_protocol::ParamSpec {
                name: "a".into(),
                kind: ParamKind::Scalar(ScalarType::F32),
            },
            agora_protocol::ParamSpec {
                name: "x".into(),
                kind: ParamKind::Buffer {
                    element: ScalarType::F32,
                    access: Access::Read,
                },
            },
            agora_protocol::ParamSpec {
                name: "y".into(),
                kind: ParamKind::Buffer {
                    element: ScalarType::F32,
                    access: Access::ReadWrite,
                },
            },
        ];
        let declared = |x: Access, y: Access| {
            vec![
                Param {
                    name: "a".into(),
                    kind: ParamKind::Scalar(ScalarType::F32),
                },
                Param {
                    name: "x".into(),
                    kind: ParamKind::Buffer {
                        element: ScalarType::F32,
                        access: x,
                    },
                },
                Param {
                    name: "y".into(),
                    kind: ParamKind::Buffer {
                        element: ScalarType::F32,
                        access: y,
                    },
                },
            ]
        };
        matches_compiler(&compiled, &declared(Access::Read, Access::Write), "k").unwrap();
        assert!(matches_compiler(&compiled, &declared(Access::Write, Access::Write), "k").is_err());
        assert!(matches_compiler(&compiled[..2], &declared(Access::Read, Access::Write), "k").is_err());
    }

    /// A build job for a session of a daemon without an executor program and without devices.
    fn job_without_executor(language: &str, code: &str, manifest: Option<&str>) -> BuildJob {
        let geometry = agora_protocol::segment::Geometry::new(2, 2, 4096).unwrap();
        let segment = agora_transport::shm::Segment::create("programs-test", geometry).unwrap();
        let config = DaemonConfig {
            program_executor: None,
            ..Default::default()
        };
        let programs = SessionPrograms::new(&config, 1, &segment, Credentials::default(), Default::default()).unwrap();
        BuildJob {
            programs: Arc::new(programs),
            cache: Arc::new(ProgramCache::new(std::path::Path::new("/nonexistent"), 0)),
            language: language.into(),
            code: code.as_bytes().to_vec(),
            manifest: manifest.map(str::to_string),
            name: "p".into(),
            max_programs: 64,
            in_daemon: false,
            on_gpus: true,
            devices: Vec::new(),
        }
    }

    #[test]
    fn ptx_builds_without_an_executor_and_is_refused_with_gpus_off_and_opencl_is_refused_saying_what_to_set() {
        let (ptx, manifest) = (
            include_str!("../../test-support/data/tenant.ptx"),
            include_str!("../../test-support/data/tenant-ptx.toml"),
        );
        match build(job_without_executor("ptx", ptx, Some(manifest))) {
            Response::Program { kernels, log, .. } => {
                assert_eq!(kernels.len(), 1);
                assert!(log.contains("no device of this daemon can run it"), "{log}");
            }
            other => panic!("a PTX program without an executor: {other:?}"),
        }
        // An operator who keeps tenant code off the GPUs refuses CUDA and PTX, saying so.
        let mut off = job_without_executor("ptx", ptx, Some(manifest));
        off.on_gpus = false;
        match build(off) {
            Response::Error(ControlError::BadRequest(m)) => assert!(m.contains("on_gpus = false"), "{m}"),
            other => panic!("a PTX program with [programs] on_gpus = false: {other:?}"),
        }
        match build(job_without_executor(
            "opencl",
            "__kernel void k(__global float *y) {}",
            None,
        )) {
            Response::Error(ControlError::BadRequest(m)) => assert!(m.contains("AGORA_EXECUTOR"), "{m}"),
            other => panic!("an OpenCL program without an executor: {other:?}"),
        }
    }
}
