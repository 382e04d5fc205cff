//! The daemon's side of an executor: start it, talk to it, bound it, restart it, end it.
//!
//! One [`Executor`] per session that builds programs. It starts its process lazily (at the
//! first build, and again at the first use after a crash), passing two descriptors — its end
//! of a `SOCK_SEQPACKET` socketpair and the session's segment memfd — as 3 and 4, with
//! `/dev/null` on 0–2, a cleared environment (but `PATH`, `LD_LIBRARY_PATH` and the `POCL_*`
//! and `OCL_ICD_*` settings) and a fresh private cache directory. It waits for the child's
//! [`FromChild::Ready`] and then replays every program built so far and not unloaded
//! ([`Executor::unload`]), so a restarted executor serves the same program numbers.
//!
//! The executor leads a process group of its own (`setsid` before `exec`; its seccomp filter
//! forbids leaving it), so anything it starts — PoCL runs the system linker — is killed with it.
//!
//! Every exchange has a deadline. A launch that overruns its limit, a reply that is too large
//! or malformed, or a child that answers out of turn gets the child killed with `SIGKILL`; a
//! child that disappears is reaped (`waitpid`), and a death by signal is reported as
//! [`ExecError::Crashed`] with the signal. Dropping an [`Executor`] (or [`Executor::stop`])
//! kills and reaps the child and removes its cache directory, so no zombie, descriptor or
//! directory outlives a session. A daemon that was killed (SIGKILL, a crash) could not remove
//! its executors' directories: the first executor a daemon starts removes those of daemons no
//! longer alive (`sweep_dead`).
//!
//! Processes are forked by one long-lived thread of this crate ([`spawn`]): the child's
//! parent-death signal fires when the *thread* that forked it exits, so forking from a lane or
//! a build thread would kill executors when those threads end.
//!
//! Replies are untrusted: sizes are bounded by the framing ([`MAX_FROM_CHILD`]) and
//! [`validate_built`] checks a build's kernel list before the daemon looks at it. A binary is
//! marked [`Build::clean`] only when the executor had run no tenant code yet (only compiled),
//! so that a tenant who took over its executor cannot plant binaries in the daemon's program
//! cache for other tenants.

use std::os::fd::{AsRawFd, OwnedFd};
use std::os::unix::process::{CommandExt, ExitStatusExt};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicI32, AtomicU64, Ordering};
use std::sync::{mpsc, Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

use agora_protocol::control::MAX_NAME;
use agora_protocol::MAX_ARGS;

use crate::wire::{
    self, Arg, BuiltKernel, Code, FromChild, ToChild, WireError, MAX_FROM_CHILD, MAX_KERNELS, MAX_LOG, PROTOCOL,
};

/// How an executor is started.
#[derive(Debug)]
pub struct ExecutorSpec {
    /// The program to run as `PROGRAM executor ...` (the `agora` binary).
    pub program: PathBuf,
    /// The session's segment memfd (a duplicate the executor owns).
    pub segment: OwnedFd,
    /// Where the executor's private cache directory is created.
    pub scratch: PathBuf,
    /// The uid and gid to run as (when the daemon runs as root and the tenant is not root).
    pub tenant: Option<(u32, u32)>,
    /// Longest the executor may take to start (and initialise OpenCL).
    pub start_timeout: Duration,
    /// Longest one build may take.
    pub build_timeout: Duration,
    /// Longest loading a C shared object may take (no compiler runs: only the dynamic linker
    /// and the library's own initialisers, tenant code).
    pub load_timeout: Duration,
}

/// Why a request to the executor failed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ExecError {
    /// The executor died by this signal (a tenant kernel crashed it); it restarts on next use.
    #[error("the executor crashed with signal {signal}")]
    Crashed {
        /// The signal number.
        signal: i32,
    },
    /// The request ran past its limit; the executor was killed.
    #[error("the executor did not answer within {0:?} and was killed")]
    TimedOut(Duration),
    /// A build ran past its limit (the compiler, or a C library's initialisers, did not
    /// finish); the executor was killed.
    #[error("the build did not finish within {0:?}; the executor was killed")]
    BuildTimedOut(Duration),
    /// The executor exited by itself (a tenant kernel called `exit`).
    #[error("the executor exited with status {0:?}")]
    Exited(Option<i32>),
    /// The executor could not be started.
    #[error("the executor could not start: {0}")]
    Start(String),
    /// The executor broke the protocol (untrusted input); it was killed.
    #[error("the executor misbehaved and was killed: {0}")]
    Protocol(String),
    /// The program did not build; the compiler's log.
    #[error("{0}")]
    BuildFailed(String),
    /// A C library's kernel returned `code`, not 0 (its own report that it failed).
    #[error("the kernel returned {code}")]
    Returned {
        /// What it returned.
        code: i32,
    },
    /// A launch failed without crashing the executor.
    #[error("the kernel failed with code {code}: {message}")]
    Failed {
        /// The kernel's return code or the OpenCL error.
        code: i32,
        /// What failed.
        message: String,
    },
    /// The executor was stopped for good (its session ended).
    #[error("the session's executor was stopped")]
    Stopped,
}

/// A successful build.
#[derive(Debug, Clone)]
pub struct Build {
    /// The program's number (larger than every earlier build's; never used again).
    pub program: u32,
    /// Its kernels (validated).
    pub kernels: Vec<BuiltKernel>,
    /// The compiler's log (at most [`MAX_LOG`] bytes).
    pub log: String,
    /// Its binary (OpenCL).
    pub binary: Option<Vec<u8>>,
    /// Whether the executor built it from the binary it was given.
    pub from_binary: bool,
    /// Whether the executor had run no tenant code when it built this (only then may the binary
    /// be shared with other tenants through the program cache).
    pub clean: bool,
}

/// A program built by this executor, kept to replay after a restart.
#[derive(Debug)]
struct Recorded {
    code: Code,
    kernels: Vec<BuiltKernel>,
}

#[derive(Debug)]
struct Running {
    child: Child,
    socket: OwnedFd,
    cache_dir: PathBuf,
}

/// One session's executor.
#[derive(Debug)]
pub struct Executor {
    spec: ExecutorSpec,
    running: Option<Running>,
    /// The programs built and not unloaded, by number.
    programs: std::collections::BTreeMap<u32, Recorded>,
    /// The next build's number.
    next_program: u32,
    /// Tenant code has run in the current process.
    tainted: bool,
    stopped: bool,
    device: Option<String>,
    sandbox: Vec<String>,
    /// The child's pid while it runs (0 otherwise), for [`Executor::killer`].
    pid: Arc<AtomicI32>,
    starts: u64,
}

/// Kills an executor's process from another thread without waiting for the executor's lock
/// (the session ended while a launch runs); the executor's owner reaps it.
#[derive(Debug, Clone)]
pub struct Killer(Arc<AtomicI32>);

impl Killer {
    /// Sends `SIGKILL` to the process, if one runs.
    pub fn kill(&self) {
        let pid = self.0.load(Ordering::Acquire);
        if pid > 0 {
            // SAFETY: kill takes integers. The pid is our unreaped child's (the owner clears it
            // before reaping), the leader of its own process group (it called setsid), so
            // neither names another process.
            unsafe {
                libc::kill(-pid, libc::SIGKILL);
                libc::kill(pid, libc::SIGKILL);
            }
        }
    }
}

impl Executor {
    /// An executor that starts its process when first used.
    pub fn new(spec: ExecutorSpec) -> Executor {
        Executor {
            spec,
            running: None,
            programs: std::collections::BTreeMap::new(),
            next_program: 0,
            tainted: false,
            stopped: false,
            device: None,
            sandbox: Vec::new(),
            pid: Arc::new(AtomicI32::new(0)),
            starts: 0,
        }
    }

    /// A handle that kills the process from another thread.
    pub fn killer(&self) -> Killer {
        Killer(self.pid.clone())
    }

    /// Programs built and not unloaded.
    pub fn programs(&self) -> usize {
        self.programs.len()
    }

    /// How many times a process was started.
    pub fn starts(&self) -> u64 {
        self.starts
    }

    /// The child's pid, while one runs.
    pub fn pid(&self) -> Option<u32> {
        self.running.as_ref().map(|r| r.child.id())
    }

    /// What the executor's sandbox enforces (as it reported at its last start).
    pub fn sandbox(&self) -> &[String] {
        &self.sandbox
    }

    /// The OpenCL device the executor builds for (starting it if needed).
    pub fn device(&mut self) -> Result<Option<String>, ExecError> {
        self.ensure_running()?;
        Ok(self.device.clone())
    }

    /// Builds `code` as the next program.
    pub fn build(&mut self, code: Code) -> Result<Build, ExecError> {
        self.ensure_running()?;
        let program = self.next_program;
        let symbols = match &code {
            Code::Library { symbols, .. } => Some(symbols.clone()),
            Code::OpenCl { .. } => None,
        };
        let limit = self.build_limit(&code);
        let reply = self
            .exchange(
                &ToChild::Build {
                    program,
                    code: code.clone(),
                },
                limit,
            )
            .map_err(|e| match e {
                ExecError::TimedOut(limit) => ExecError::BuildTimedOut(limit),
                other => other,
            })?;
        match reply {
            FromChild::Built {
                kernels,
                log,
                binary,
                from_binary,
            } => {
                if let Err(problem) = validate_built(&kernels, symbols.as_deref()) {
                    return Err(self.kill_for(problem));
                }
                let binary = binary.filter(|b| b.len() <= wire::MAX_BINARY);
                let replay = match code {
                    // Replays use the binary: a restart then costs no compilation.
                    Code::OpenCl { source, .. } => Code::OpenCl {
                        source,
                        binary: binary.clone(),
                    },
                    library => library,
                };
                self.programs.insert(
                    program,
                    Recorded {
                        code: replay,
                        kernels: kernels.clone(),
                    },
                );
                self.next_program += 1;
                Ok(Build {
                    program,
                    kernels,
                    log: bounded(log),
                    binary,
                    from_binary,
                    clean: !self.tainted,
                })
            }
            FromChild::BuildFailed { log } => Err(ExecError::BuildFailed(bounded(log))),
            other => Err(self.kill_for(format!("a {} in reply to a build", reply_name(&other)))),
        }
    }

    /// How long building `code` may take.
    fn build_limit(&self, code: &Code) -> Duration {
        match code {
            Code::OpenCl { .. } => self.spec.build_timeout,
            Code::Library { .. } => self.spec.load_timeout,
        }
    }

    /// Runs rows `rows` of kernel `kernel` of program `program`, waiting at most `limit`.
    #[allow(clippy::too_many_arguments)]
    pub fn run(
        &mut self,
        program: u32,
        kernel: u32,
        range: [u64; 3],
        dims: u8,
        rows: [u64; 2],
        args: Vec<Arg>,
        limit: Duration,
    ) -> Result<(), ExecError> {
        if !self.programs.contains_key(&program) {
            return Err(ExecError::Protocol(format!("no program {program}")));
        }
        self.ensure_running()?;
        self.tainted = true;
        let reply = self.exchange(
            &ToChild::Run {
                program,
                kernel,
                range,
                dims,
                rows,
                args,
            },
            limit,
        )?;
        match reply {
            FromChild::Done => Ok(()),
            FromChild::Returned { code } => Err(ExecError::Returned { code }),
            FromChild::Failed { code, message } => Err(ExecError::Failed {
                code,
                message: bounded(message),
            }),
            other => Err(self.kill_for(format!("a {} in reply to a launch", reply_name(&other)))),
        }
    }

    /// Forgets program `program` (its session will launch it no more): a restart does not build
    /// it again, and a running process unloads its code. A process that fails to answer is
    /// killed (the next use starts one without it); the program is forgotten either way.
    pub fn unload(&mut self, program: u32) {
        if self.programs.remove(&program).is_none() || self.running.is_none() {
            return;
        }
        match self.exchange(&ToChild::Unload { program }, self.spec.start_timeout) {
            Ok(FromChild::Done) | Err(_) => {}
            Ok(other) => {
                let _ = self.kill_for(format!("a {} in reply to an unload", reply_name(&other)));
            }
        }
    }

    /// Kills and reaps the process for good: later requests fail with [`ExecError::Stopped`].
    pub fn stop(&mut self) {
        self.stopped = true;
        if let Some(running) = self.running.take() {
            // A polite request first costs nothing; the kill makes sure.
            let _ = wire::send(
                &running.socket,
                &ToChild::Shutdown,
                Some(Instant::now() + Duration::from_millis(10)),
            );
            self.end(running, true);
        }
    }

    /// Sends `request` and waits for one reply, both within `limit`; on any failure the
    /// process is gone (killed or found dead) and reaped when this returns.
    fn exchange(&mut self, request: &ToChild, limit: Duration) -> Result<FromChild, ExecError> {
        let deadline = Instant::now() + limit;
        let Some(running) = self.running.as_ref() else {
            return Err(ExecError::Stopped);
        };
        let result = wire::send(&running.socket, request, Some(deadline))
            .and_then(|()| wire::recv::<FromChild>(&running.socket, MAX_FROM_CHILD, Some(deadline)));
        result.map_err(|error| self.fail(error, limit))
    }

    /// The process failed `error`: kill it if it may still run, reap it, say why.
    fn fail(&mut self, error: WireError, limit: Duration) -> ExecError {
        let Some(running) = self.running.take() else {
            return ExecError::Stopped;
        };
        match error {
            WireError::TimedOut => {
                self.end(running, true);
                ExecError::TimedOut(limit)
            }
            WireError::Closed | WireError::Os(_) => match self.end(running, false) {
                Some(status) => match status.signal() {
                    Some(signal) => ExecError::Crashed { signal },
                    None => ExecError::Exited(status.code()),
                },
                None => ExecError::Exited(None),
            },
            WireError::TooLarge(_) | WireError::Malformed(_) => {
                self.end(running, true);
                ExecError::Protocol(error.to_string())
            }
        }
    }

    fn kill_for(&mut self, problem: String) -> ExecError {
        if let Some(running) = self.running.take() {
            self.end(running, true);
        }
        ExecError::Protocol(problem)
    }

    /// Ends `running`: kills its process group (the executor and anything it started, such as
    /// a linker), reaps it and removes its cache directory. Returns its exit status. `kill`:
    /// the process may still be running; otherwise it closed its socket, so it is exiting (its
    /// status is settled by then, and a late `SIGKILL` does not change it).
    fn end(&mut self, mut running: Running, kill: bool) -> Option<std::process::ExitStatus> {
        let pid = running.child.id() as i32;
        // SAFETY: kill takes integers; `pid` is our unreaped child, leader of its own group
        // (setsid before exec, and the seccomp filter forbids leaving it), so the group id
        // cannot have been reused.
        unsafe { libc::kill(-pid, libc::SIGKILL) };
        // Before the reap frees the pid: a `Killer` must never signal a reused one.
        self.pid.store(0, Ordering::Release);
        if kill {
            let _ = running.child.kill();
        }
        let status = running.child.wait().ok();
        drop(running.socket);
        let _ = std::fs::remove_dir_all(&running.cache_dir);
        status
    }

    /// Starts the process if none runs, and replays the programs built so far.
    fn ensure_running(&mut self) -> Result<(), ExecError> {
        if self.stopped {
            return Err(ExecError::Stopped);
        }
        if self.running.is_some() {
            return Ok(());
        }
        let started = self.start()?;
        self.running = Some(started);
        self.tainted = false;
        let deadline = Instant::now() + self.spec.start_timeout;
        let ready = self
            .running
            .as_ref()
            .map(|r| wire::recv::<FromChild>(&r.socket, MAX_FROM_CHILD, Some(deadline)));
        match ready {
            Some(Ok(FromChild::Ready {
                protocol,
                device,
                sandbox,
            })) => {
                if protocol != PROTOCOL {
                    return Err(self.kill_for(format!(
                        "it speaks executor protocol {protocol}, this daemon {PROTOCOL}: {} is another build of agora",
                        self.spec.program.display()
                    )));
                }
                self.device = device.filter(|d| d.len() <= MAX_NAME);
                self.sandbox = sandbox.into_iter().take(16).map(bounded).collect();
            }
            Some(Ok(other)) => return Err(self.kill_for(format!("a {} instead of ready", reply_name(&other)))),
            Some(Err(error)) => {
                return Err(match self.fail(error, self.spec.start_timeout) {
                    ExecError::Exited(code) => ExecError::Start(format!(
                        "{} executor exited with status {code:?} while setting up its sandbox",
                        self.spec.program.display()
                    )),
                    other => other,
                })
            }
            None => return Err(ExecError::Stopped),
        }
        // The same programs again, under the same numbers.
        let numbers: Vec<u32> = self.programs.keys().copied().collect();
        for index in numbers {
            let request = ToChild::Build {
                program: index,
                code: self.programs[&index].code.clone(),
            };
            let limit = self.build_limit(&self.programs[&index].code);
            match self.exchange(&request, limit)? {
                FromChild::Built { kernels, .. } if kernels == self.programs[&index].kernels => {}
                other => {
                    return Err(self.kill_for(format!(
                        "program {index} did not build again the same way after a restart ({})",
                        reply_name(&other)
                    )))
                }
            }
        }
        Ok(())
    }

    fn start(&mut self) -> Result<Running, ExecError> {
        let program = &self.spec.program;
        if !program.is_file() {
            return Err(ExecError::Start(format!(
                "the executor program {} does not exist; point [programs] executor or AGORA_EXECUTOR at the agora binary",
                program.display()
            )));
        }
        let cache_dir = private_dir(&self.spec.scratch, self.spec.tenant)
            .map_err(|e| ExecError::Start(format!("creating its cache directory: {e}")))?;
        let (ours, theirs) = rustix::net::socketpair(
            rustix::net::AddressFamily::UNIX,
            rustix::net::SocketType::SEQPACKET,
            rustix::net::SocketFlags::CLOEXEC,
            None,
        )
        .map_err(|e| ExecError::Start(format!("socketpair: {e}")))?;
        let mut command = Command::new(program);
        command
            // What `ps` shows whatever the path (the daemon's own image is `/proc/self/exe`).
            .arg0("agora")
            .arg("executor")
            .args(["--control-fd", "3", "--segment-fd", "4", "--daemon-pid"])
            .arg(std::process::id().to_string())
            .arg("--cache-dir")
            .arg(&cache_dir)
            .env_clear()
            .envs(passed_environment())
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null());
        if let Some((uid, gid)) = self.spec.tenant {
            command.args(["--uid", &uid.to_string(), "--gid", &gid.to_string()]);
        }
        let (control, segment) = (theirs.as_raw_fd(), self.spec.segment.as_raw_fd());
        // SAFETY: the closure runs in the forked child before exec and calls only
        // async-signal-safe functions (fcntl, dup2, setsid, prctl) on descriptors that are open
        // in the child (`theirs` and the segment live until spawn returns).
        unsafe {
            command.pre_exec(move || {
                // Above any target first, so neither dup2 below clobbers the other source.
                let control = libc::fcntl(control, libc::F_DUPFD_CLOEXEC, 10);
                let segment = libc::fcntl(segment, libc::F_DUPFD_CLOEXEC, 10);
                if control < 0
                    || segment < 0
                    || libc::dup2(control, 3) < 0
                    || libc::dup2(segment, 4) < 0
                    || libc::setsid() < 0
                    || libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL as libc::c_ulong, 0, 0, 0) < 0
                {
                    return Err(std::io::Error::last_os_error());
                }
                Ok(())
            })
        };
        let child = spawn(command).map_err(|e| {
            let _ = std::fs::remove_dir_all(&cache_dir);
            ExecError::Start(format!("starting {}: {e}", program.display()))
        })?;
        drop(theirs);
        self.pid.store(child.id() as i32, Ordering::Release);
        self.starts += 1;
        Ok(Running {
            child,
            socket: ours,
            cache_dir,
        })
    }
}

impl Drop for Executor {
    fn drop(&mut self) {
        self.stop();
    }
}

/// Checks a build's kernel list: 1 to [`MAX_KERNELS`] kernels with distinct names of C
/// identifier characters (at most [`MAX_NAME`] bytes), at most [`MAX_ARGS`] parameters with
/// names of at most [`MAX_NAME`] bytes; for a C library (`symbols`), exactly the symbols asked
/// for, in order, without parameters (the manifest declares those).
pub fn validate_built(kernels: &[BuiltKernel], symbols: Option<&[String]>) -> Result<(), String> {
    if kernels.is_empty() || kernels.len() > MAX_KERNELS {
        return Err(format!("{} kernels (1 to {MAX_KERNELS} allowed)", kernels.len()));
    }
    for (index, kernel) in kernels.iter().enumerate() {
        let name = &kernel.name;
        let identifier = !name.is_empty()
            && name.len() <= MAX_NAME
            && !name.starts_with(|c: char| c.is_ascii_digit())
            && name.chars().all(|c| c.is_ascii_alphanumeric() || c == '_');
        if !identifier {
            return Err(format!("kernel {index} has an invalid name"));
        }
        if kernels[..index].iter().any(|k| k.name == *name) {
            return Err(format!("kernel name {name} appears twice"));
        }
        if kernel.params.len() > MAX_ARGS {
            return Err(format!("kernel {name} has {} parameters", kernel.params.len()));
        }
        if kernel.params.iter().any(|p| p.name.len() > MAX_NAME) {
            return Err(format!(
                "kernel {name} has a parameter name longer than {MAX_NAME} bytes"
            ));
        }
    }
    if let Some(symbols) = symbols {
        let names: Vec<&str> = kernels.iter().map(|k| k.name.as_str()).collect();
        if names != symbols.iter().map(String::as_str).collect::<Vec<_>>()
            || kernels.iter().any(|k| !k.params.is_empty())
        {
            return Err("a C library's kernels are not the symbols asked for".into());
        }
    }
    Ok(())
}

fn reply_name(reply: &FromChild) -> &'static str {
    match reply {
        FromChild::Ready { .. } => "ready",
        FromChild::Built { .. } => "build result",
        FromChild::BuildFailed { .. } => "build failure",
        FromChild::Done => "launch result",
        FromChild::Returned { .. } | FromChild::Failed { .. } => "launch failure",
    }
}

/// `text`, cut to [`MAX_LOG`] bytes at a character boundary.
fn bounded(mut text: String) -> String {
    if text.len() > MAX_LOG {
        let mut end = MAX_LOG;
        while !text.is_char_boundary(end) {
            end -= 1;
        }
        text.truncate(end);
    }
    text
}

/// The daemon's environment variables an executor keeps.
fn passed_environment() -> Vec<(String, String)> {
    let mut vars: Vec<(String, String)> = std::env::vars()
        .filter(|(k, _)| {
            k == "PATH"
                || k == "LD_LIBRARY_PATH"
                || k.starts_with("OCL_ICD_")
                || (k.starts_with("POCL_") && k != "POCL_CACHE_DIR")
        })
        .collect();
    // PoCL's compiler finds the linker on PATH.
    if !vars.iter().any(|(k, _)| k == "PATH") {
        vars.push(("PATH".into(), "/usr/local/bin:/usr/bin:/bin".into()));
    }
    vars
}

/// A new directory `agora-executor-PID-N` under `scratch`, mode 0700, owned by `tenant` when
/// given.
fn private_dir(scratch: &Path, tenant: Option<(u32, u32)>) -> std::io::Result<PathBuf> {
    use std::os::unix::fs::DirBuilderExt;
    static NEXT: AtomicU64 = AtomicU64::new(0);
    static SWEPT: std::sync::Once = std::sync::Once::new();
    std::fs::create_dir_all(scratch)?;
    SWEPT.call_once(|| {
        let removed = sweep_dead(scratch, std::process::id());
        if removed > 0 {
            tracing::info!(removed, dir = %scratch.display(), "removed executor directories of daemons no longer running");
        }
    });
    loop {
        let n = NEXT.fetch_add(1, Ordering::Relaxed);
        let dir = scratch.join(format!("agora-executor-{}-{n}", std::process::id()));
        match std::fs::DirBuilder::new().mode(0o700).create(&dir) {
            Ok(()) => {
                if let Some((uid, gid)) = tenant {
                    std::os::unix::fs::chown(&dir, Some(uid), Some(gid))?;
                }
                return Ok(dir);
            }
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => continue,
            Err(e) => return Err(e),
        }
    }
}

/// Removes the `agora-executor-PID-N` directories under `scratch` of processes that no longer
/// exist (a daemon killed before it could remove its executors' directories: each holds a PoCL
/// cache of some hundred kilobytes, so a node whose daemon restarts often would fill `/tmp`).
/// `own`: this process's id, never swept. A directory whose PID belongs to a live process (this
/// daemon's peer, or an unrelated process that reused the PID) is left alone; one that cannot be
/// removed (another user's, for a daemon that is not root) too. Returns how many were removed.
fn sweep_dead(scratch: &Path, own: u32) -> usize {
    let Ok(entries) = std::fs::read_dir(scratch) else {
        return 0;
    };
    let mut removed = 0;
    for entry in entries.flatten() {
        let name = entry.file_name();
        let Some(pid) = name
            .to_str()
            .and_then(|n| n.strip_prefix("agora-executor-"))
            .and_then(|rest| rest.split_once('-'))
            .filter(|(_, n)| !n.is_empty() && n.bytes().all(|b| b.is_ascii_digit()))
            .and_then(|(pid, _)| pid.parse::<u32>().ok())
        else {
            continue;
        };
        if pid == own || pid == 0 || Path::new(&format!("/proc/{pid}")).exists() {
            continue;
        }
        // Not a link followed out of `scratch`: a directory of that name, as this crate makes.
        if entry.file_type().is_ok_and(|t| t.is_dir()) && std::fs::remove_dir_all(entry.path()).is_ok() {
            removed += 1;
        }
    }
    removed
}

type SpawnRequest = (Command, mpsc::Sender<std::io::Result<Child>>);

/// Starts `command` from this crate's spawner thread, which lives as long as the process (see
/// the module doc), and waits for the result.
pub fn spawn(command: Command) -> std::io::Result<Child> {
    static SPAWNER: OnceLock<Mutex<mpsc::Sender<SpawnRequest>>> = OnceLock::new();
    let spawner = SPAWNER.get_or_init(|| {
        let (requests, inbox) = mpsc::channel::<SpawnRequest>();
        let started = std::thread::Builder::new().name("agora-spawner".into()).spawn(move || {
            for (mut command, reply) in inbox {
                let _ = reply.send(command.spawn());
            }
        });
        if let Err(e) = started {
            // Requests then fail below with this thread's absence.
            eprintln!("agora: cannot start the executor spawner thread: {e}");
        }
        Mutex::new(requests)
    });
    let (reply, answer) = mpsc::channel();
    spawner
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .send((command, reply))
        .map_err(|_| std::io::Error::other("the spawner thread is gone"))?;
    answer
        .recv()
        .map_err(|_| std::io::Error::other("the spawner thread is gone"))?
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn directories_of_dead_daemons_are_swept_and_no_other() {
        let scratch = tempfile::tempdir().unwrap();
        // A PID that no process has now.
        let dead = (100_000..4_000_000u32)
            .find(|pid| !Path::new(&format!("/proc/{pid}")).exists())
            .unwrap();
        let own = std::process::id();
        let make = |name: &str| {
            let dir = scratch.path().join(name);
            std::fs::create_dir_all(dir.join("NC/cache")).unwrap();
            std::fs::write(dir.join("NC/cache/kernel.so"), b"x").unwrap();
            dir
        };
        let swept = [
            make(&format!("agora-executor-{dead}-0")),
            make(&format!("agora-executor-{dead}-12")),
        ];
        let kept = [
            make(&format!("agora-executor-{own}-0")),  // this daemon's
            make("agora-executor-1-3"),                // a live process's (init)
            make(&format!("agora-executor-{dead}-x")), // not a name this crate makes
            make(&format!("agora-cache-{dead}-0")),
        ];
        // A file of the name is not a directory this crate made.
        std::fs::write(scratch.path().join(format!("agora-executor-{dead}-7")), b"").unwrap();
        assert_eq!(sweep_dead(scratch.path(), own), 2);
        assert!(swept.iter().all(|d| !d.exists()));
        assert!(kept.iter().all(|d| d.exists()));
        assert!(scratch.path().join(format!("agora-executor-{dead}-7")).exists());
        assert_eq!(sweep_dead(scratch.path(), own), 0, "nothing left to sweep");
    }
    use agora_protocol::{Access, ParamKind, ParamSpec, ScalarType};

    fn kernel(name: &str, params: usize) -> BuiltKernel {
        BuiltKernel {
            name: name.into(),
            params: (0..params)
                .map(|i| ParamSpec {
                    name: format!("p{i}"),
                    kind: ParamKind::Buffer {
                        element: ScalarType::F32,
                        access: Access::Read,
                    },
                })
                .collect(),
        }
    }

    #[test]
    fn build_replies_are_validated() {
        validate_built(&[kernel("saxpy", 3), kernel("stencil_2d", 2)], None).unwrap();
        assert!(validate_built(&[], None).unwrap_err().contains("0 kernels"));
        let many: Vec<_> = (0..=MAX_KERNELS).map(|i| kernel(&format!("k{i}"), 0)).collect();
        assert!(validate_built(&many, None).is_err());
        assert!(validate_built(&[kernel("a", 1), kernel("a", 1)], None)
            .unwrap_err()
            .contains("twice"));
        for bad in ["", "1abc", "a-b", "a b", "é", &"x".repeat(MAX_NAME + 1)] {
            assert!(validate_built(&[kernel(bad, 0)], None).is_err(), "{bad:?}");
        }
        assert!(validate_built(&[kernel("wide", MAX_ARGS + 1)], None).is_err());
        let mut long = kernel("k", 1);
        long.params[0].name = "p".repeat(MAX_NAME + 1);
        assert!(validate_built(&[long], None).is_err());
        let symbols = vec!["f".to_string(), "g".to_string()];
        validate_built(&[kernel("f", 0), kernel("g", 0)], Some(&symbols)).unwrap();
        assert!(validate_built(&[kernel("g", 0), kernel("f", 0)], Some(&symbols)).is_err());
        assert!(validate_built(&[kernel("f", 0)], Some(&symbols)).is_err());
        assert!(validate_built(&[kernel("f", 1), kernel("g", 0)], Some(&symbols)).is_err());
    }

    #[test]
    fn a_missing_program_is_a_clear_start_error() {
        let fd = rustix::fs::memfd_create("t", rustix::fs::MemfdFlags::CLOEXEC).unwrap();
        let scratch = std::env::temp_dir();
        let mut executor = Executor::new(ExecutorSpec {
            program: "/nonexistent/agora".into(),
            segment: fd,
            scratch,
            tenant: None,
            start_timeout: Duration::from_secs(1),
            build_timeout: Duration::from_secs(1),
            load_timeout: Duration::from_secs(1),
        });
        match executor.device() {
            Err(ExecError::Start(message)) => {
                assert!(
                    message.contains("/nonexistent/agora") && message.contains("AGORA_EXECUTOR"),
                    "{message}"
                )
            }
            other => panic!("{other:?}"),
        }
    }
}
