//! The executor's sandbox: what it does to itself before it touches tenant code.
//!
//! In order, each step before the next can be undone by the code it guards against:
//!
//! 1. **Parent death** (`PR_SET_PDEATHSIG` = `SIGKILL`, set again after a uid change, which
//!    clears it): when the daemon dies, so does its executor; an executor whose daemon is
//!    already gone exits at once.
//! 2. **No new privileges** (`PR_SET_NO_NEW_PRIVS`): no set-uid binary or file capability can
//!    raise them again; also the precondition for the seccomp filter and Landlock.
//! 3. **Descriptors**: every descriptor but 0–2 (`/dev/null`, so a stray write cannot land in
//!    a file opened later), the control socket and the segment is closed: whatever the daemon
//!    had open is out of reach.
//! 4. **Limits** (`setrlimit`): `RLIMIT_CORE` 0 (no core files with tenant data),
//!    `RLIMIT_NOFILE` [`MAX_FILES`] (PoCL needs a few dozen for its cache and libraries),
//!    `RLIMIT_FSIZE` [`MAX_FILE_BYTES`] (only the private cache directory is writable anyway),
//!    `RLIMIT_CPU` [`CPU_SECONDS`] as a backstop should supervision fail (the daemon's
//!    per-launch limit is what normally stops a kernel). `RLIMIT_NPROC` [`MAX_TASKS`] only when
//!    the executor runs as a tenant's own non-root uid: the limit counts every process and
//!    thread of the real uid, so under the daemon's uid it would count the daemon's threads too
//!    (and root ignores it).
//! 5. **Identity**: when the daemon runs as root, the executor drops to the tenant's uid and gid
//!    (from the session's peer credentials) and no supplementary groups; otherwise it keeps the
//!    daemon's user, and steps 6–7 are what protect the daemon's files and processes.
//! 6. **Landlock** (best effort: kernels without it or with it disabled skip this step, and the
//!    daemon logs that): the whole file system readable but not executable (PoCL reads its
//!    headers, bitcode libraries and LLVM; libraries are mapped, which Landlock does not
//!    govern), writable only beneath the executor's private cache directory (`POCL_CACHE_DIR`,
//!    a fresh directory the daemon removes when the executor ends), executable only for the
//!    system linker and its ELF interpreter (see below), and, where the kernel scopes them, no
//!    signals to and no abstract sockets of processes outside the sandbox.
//! 7. **seccomp** (after OpenCL is initialised, on every thread at once with `TSYNC`): the
//!    default is *allow*, and these calls fail with `EPERM`:
//!    * networking and new channels: `socket`, `socketpair`, `connect`, `bind`, `listen`,
//!      `accept`, `accept4` — the executor talks only over the socket it was given;
//!    * other processes: `ptrace`, `process_vm_readv`, `process_vm_writev`, `pidfd_open`,
//!      `pidfd_getfd`, `pidfd_send_signal`, `tkill`, `rt_sigqueueinfo`, `rt_tgsigqueueinfo`,
//!      `kcmp`; `kill` and `tgkill` are allowed only with the executor's own pid (`abort()` and
//!      `raise()` signal the process itself);
//!    * leaving the process group: `setsid`, `setpgid` — every process the executor starts
//!      stays in its group, which the daemon kills whole;
//!    * copies of the process: `fork`, `vfork`, and `clone` with neither `CLONE_THREAD` nor
//!      `CLONE_VFORK`; `clone3` fails with `ENOSYS` instead, because its flags cannot be
//!      inspected, and the C library then falls back to `clone`;
//!    * the system: `mount`, `umount2`, `pivot_root`, `chroot`, `unshare`, `setns`, `kexec_load`,
//!      `kexec_file_load`, `init_module`, `finit_module`, `delete_module`, `bpf`,
//!      `perf_event_open`, `userfaultfd`, `io_uring_setup`, `keyctl`, `add_key`, `request_key`,
//!      `reboot`, `swapon`, `swapoff`, `acct`, `quotactl`, `settimeofday`, `clock_settime`,
//!      `clock_adjtime`, `adjtimex`, `personality`, `name_to_handle_at`, `open_by_handle_at`,
//!      `mknod`, `mknodat`, `iopl`, `ioperm`, `syslog`, `sethostname`, `setdomainname`;
//!    * identity: `setuid`, `setgid`, `setreuid`, `setregid`, `setresuid`, `setresgid`,
//!      `setgroups`, `setfsuid`, `setfsgid`, `capset` (the identity was settled in step 5).
//!
//! **Why `execve` and `posix_spawn` stay allowed.** PoCL 3 (Debian 12's) compiles in-process,
//! but its Clang driver links every kernel into a shared object by running the system linker
//! `ld` (strace of a build: `clone(CLONE_VM|CLONE_VFORK)` then `execve("/usr/bin/ld", ...)`),
//! at build time and again when a launch needs a new work-group specialisation. Without it no
//! OpenCL kernel runs. So `execve` and vfork-style `clone` are allowed, and contained:
//! Landlock lets only the linker and its interpreter be executed (where Landlock is available),
//! every new process inherits the seccomp filter, Landlock domain, no-new-privileges and limits,
//! none can leave the executor's process group, and the daemon kills that whole group whenever
//! it ends an executor — so nothing a tenant starts outlives its executor. (The interpreter can
//! load other programs; they run under the same confinement.)
//!
//! Everything else stays allowed because PoCL needs it to compile and run kernels in this
//! process: files (it writes the compiled kernel into its cache directory and `dlopen`s it),
//! `mmap`/`mprotect` with execute permission (loading that code), threads, futexes, `madvise`,
//! `sched_*` (its thread pool), `memfd_create` (loading a C program), and reading `/proc` and
//! `/sys` (hardware topology).
//!
//! What remains possible for tenant code: reading files the executor's user may read (with the
//! daemon running as root: the tenant's own files, no more than the tenant can read anyway),
//! using CPU and memory within the limits and the per-launch time limit, and reading and
//! writing the tenant's own segment — which holds only that tenant's data.

use std::path::{Path, PathBuf};

/// `RLIMIT_NOFILE` of an executor.
pub const MAX_FILES: u64 = 128;

/// `RLIMIT_FSIZE` of an executor: its largest file (a compiled kernel in its cache).
pub const MAX_FILE_BYTES: u64 = 256 << 20;

/// `RLIMIT_CPU` of an executor, seconds of CPU time over its life (soft; the hard limit is ten
/// seconds more). A backstop only: a kernel that exceeds its per-launch limit is killed by the
/// daemon long before, and an executor that reaches this one is restarted like a crashed one.
pub const CPU_SECONDS: u64 = 3600;

fn os(what: &str) -> impl FnOnce(std::io::Error) -> String + '_ {
    move |e| format!("{what}: {e}")
}

fn check(what: &str, result: libc::c_int) -> Result<(), String> {
    if result == -1 {
        Err(os(what)(std::io::Error::last_os_error()))
    } else {
        Ok(())
    }
}

/// Step 1: dies with the daemon `daemon_pid`; exits at once when it is already gone.
pub fn die_with_parent(daemon_pid: i32) -> Result<(), String> {
    // SAFETY: prctl with PR_SET_PDEATHSIG takes a signal number; no pointers.
    check("PR_SET_PDEATHSIG", unsafe {
        libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL as libc::c_ulong, 0, 0, 0)
    })?;
    // SAFETY: getppid has no preconditions.
    if unsafe { libc::getppid() } != daemon_pid {
        // The daemon died before the death signal was armed.
        std::process::exit(0);
    }
    Ok(())
}

/// Step 2.
pub fn no_new_privileges() -> Result<(), String> {
    // SAFETY: prctl with PR_SET_NO_NEW_PRIVS takes integers only.
    check("PR_SET_NO_NEW_PRIVS", unsafe {
        libc::prctl(libc::PR_SET_NO_NEW_PRIVS, 1 as libc::c_ulong, 0, 0, 0)
    })
}

/// Step 3: closes every descriptor above 2 except `keep` (sorted, distinct).
pub fn close_other_descriptors(keep: &[i32]) -> Result<(), String> {
    let mut from = 3u32;
    for &fd in keep {
        let fd = fd as u32;
        if fd > from {
            close_range(from, fd - 1)?;
        }
        from = from.max(fd + 1);
    }
    close_range(from, u32::MAX)
}

fn close_range(first: u32, last: u32) -> Result<(), String> {
    // SAFETY: close_range takes integers; closing descriptors this process owns and does not
    // use any more (the caller keeps the ones it needs).
    let result = unsafe { libc::syscall(libc::SYS_close_range, first, last, 0u32) };
    if result == 0 {
        return Ok(());
    }
    // Kernels before 5.9: close what /proc lists.
    let entries = std::fs::read_dir("/proc/self/fd").map_err(os("listing /proc/self/fd"))?;
    let fds: Vec<u32> = entries
        .filter_map(|e| e.ok()?.file_name().to_str()?.parse().ok())
        .filter(|fd| (first..=last).contains(fd))
        .collect();
    for fd in fds {
        // SAFETY: as above; a descriptor that was the directory listing's is already closed.
        unsafe { libc::close(fd as i32) };
    }
    Ok(())
}

/// Step 4.
pub fn limit_resources() -> Result<(), String> {
    let set = |what: &str, resource, soft: u64, hard: u64| {
        let limit = libc::rlimit {
            rlim_cur: soft as libc::rlim_t,
            rlim_max: hard as libc::rlim_t,
        };
        // SAFETY: `limit` is a valid rlimit for the call's duration.
        check(what, unsafe { libc::setrlimit(resource, &limit) })
    };
    set("RLIMIT_CORE", libc::RLIMIT_CORE, 0, 0)?;
    set("RLIMIT_NOFILE", libc::RLIMIT_NOFILE, MAX_FILES, MAX_FILES)?;
    set("RLIMIT_FSIZE", libc::RLIMIT_FSIZE, MAX_FILE_BYTES, MAX_FILE_BYTES)?;
    set("RLIMIT_CPU", libc::RLIMIT_CPU, CPU_SECONDS, CPU_SECONDS + 10)
}

/// `RLIMIT_NPROC` of an executor running as a tenant's (non-root) uid.
pub const MAX_TASKS: u64 = 4096;

/// Step 5: becomes `uid`/`gid` with no supplementary groups (when running as root), then arms
/// the parent-death signal again (a uid change clears it).
pub fn become_tenant(uid: u32, gid: u32, daemon_pid: i32) -> Result<(), String> {
    // SAFETY: setgroups with a zero count reads no memory.
    check("setgroups", unsafe { libc::setgroups(0, std::ptr::null()) })?;
    // SAFETY: integer arguments only.
    check("setresgid", unsafe { libc::setresgid(gid, gid, gid) })?;
    // SAFETY: integer arguments only.
    check("setresuid", unsafe { libc::setresuid(uid, uid, uid) })?;
    if uid != 0 {
        let limit = libc::rlimit {
            rlim_cur: MAX_TASKS as libc::rlim_t,
            rlim_max: MAX_TASKS as libc::rlim_t,
        };
        // SAFETY: `limit` is a valid rlimit for the call's duration.
        check("RLIMIT_NPROC", unsafe { libc::setrlimit(libc::RLIMIT_NPROC, &limit) })?;
    }
    die_with_parent(daemon_pid)
}

/// The programs PoCL must be able to start: the linker `ld` found on `PATH` (its real file) and
/// its ELF interpreter.
pub fn linker_files() -> Vec<PathBuf> {
    let path = std::env::var_os("PATH").unwrap_or_default();
    let Some(ld) = std::env::split_paths(&path)
        .map(|dir| dir.join("ld"))
        .find(|candidate| candidate.is_file())
        .and_then(|ld| std::fs::canonicalize(ld).ok())
    else {
        return Vec::new();
    };
    let mut files = vec![ld.clone()];
    if let Some(interpreter) = std::fs::read(&ld).ok().and_then(|bytes| interpreter(&bytes)) {
        if let Ok(real) = std::fs::canonicalize(&interpreter) {
            files.push(real);
        }
    }
    files
}

/// The `PT_INTERP` path of a 64-bit little-endian ELF executable.
fn interpreter(elf: &[u8]) -> Option<PathBuf> {
    let u16_at = |at: usize| Some(u16::from_le_bytes(elf.get(at..at + 2)?.try_into().ok()?));
    let u64_at = |at: usize| Some(u64::from_le_bytes(elf.get(at..at + 8)?.try_into().ok()?));
    if elf.get(..4)? != b"\x7fELF" || *elf.get(4)? != 2 || *elf.get(5)? != 1 {
        return None;
    }
    let (table, size, count) = (u64_at(32)? as usize, u16_at(54)? as usize, u16_at(56)? as usize);
    for index in 0..count.min(64) {
        let header = table.checked_add(index.checked_mul(size)?)?;
        if u32::from_le_bytes(elf.get(header..header + 4)?.try_into().ok()?) == 3 {
            let (offset, len) = (u64_at(header + 8)? as usize, u64_at(header + 32)? as usize);
            let text = elf.get(offset..offset.checked_add(len)?)?;
            let text = text.split(|b| *b == 0).next()?;
            return Some(PathBuf::from(std::str::from_utf8(text).ok()?));
        }
    }
    None
}

/// Step 6; returns what it enforced, for the daemon's log.
pub fn restrict_files(writable: &Path, executables: &[PathBuf]) -> String {
    use landlock::{
        path_beneath_rules, Access, AccessFs, Ruleset, RulesetAttr, RulesetCreatedAttr, RulesetStatus, Scope, ABI,
    };
    let abi = ABI::V6;
    let result = (|| -> Result<RulesetStatus, landlock::RulesetError> {
        let status = Ruleset::default()
            .handle_access(AccessFs::from_all(abi))?
            .scope(Scope::from_all(abi))?
            .create()?
            .add_rules(path_beneath_rules(["/"], AccessFs::ReadFile | AccessFs::ReadDir))?
            .add_rules(path_beneath_rules(executables, AccessFs::ReadFile | AccessFs::Execute))?
            .add_rules(path_beneath_rules(
                [writable],
                AccessFs::from_all(abi) & !AccessFs::Execute,
            ))?
            .restrict_self()?;
        Ok(status.ruleset)
    })();
    match result {
        Ok(RulesetStatus::FullyEnforced) => format!(
            "landlock: file system read-only but the cache directory, only {} executable; signals and abstract sockets scoped",
            executables.iter().map(|p| p.display().to_string()).collect::<Vec<_>>().join(" and ")
        ),
        Ok(RulesetStatus::PartiallyEnforced) => "landlock: partially enforced (an older kernel): file system read-only but the cache directory".into(),
        Ok(RulesetStatus::NotEnforced) => "landlock: not available in this kernel (file system protected by user only)".into(),
        Err(e) => format!("landlock: not applied ({e})"),
    }
}

/// Step 7: the seccomp filter, on every thread of the process.
pub fn filter_system_calls() -> Result<(), String> {
    use seccompiler::{
        BpfProgram, SeccompAction, SeccompCmpArgLen, SeccompCmpOp, SeccompCondition, SeccompFilter, SeccompRule,
    };
    use std::collections::BTreeMap;
    let arch: seccompiler::TargetArch = std::env::consts::ARCH
        .try_into()
        .map_err(|e| format!("seccomp: {e:?}"))?;
    // SAFETY: getpid has no preconditions.
    let pid = unsafe { libc::getpid() } as u64;
    let mut deny: BTreeMap<i64, Vec<SeccompRule>> = BTreeMap::new();
    for call in denied_calls() {
        deny.insert(call, Vec::new());
    }
    let rule = |conditions: Vec<SeccompCondition>| SeccompRule::new(conditions).map_err(|e| format!("seccomp: {e}"));
    let other_pid = SeccompCondition::new(0, SeccompCmpArgLen::Dword, SeccompCmpOp::Ne, pid)
        .map_err(|e| format!("seccomp: {e}"))?;
    deny.insert(libc::SYS_kill, vec![rule(vec![other_pid.clone()])?]);
    deny.insert(libc::SYS_tgkill, vec![rule(vec![other_pid])?]);
    // A copy of the process: neither a thread nor a vfork child about to exec (posix_spawn).
    let a_copy = SeccompCondition::new(
        0,
        SeccompCmpArgLen::Qword,
        SeccompCmpOp::MaskedEq((libc::CLONE_THREAD | libc::CLONE_VFORK) as u64),
        0,
    )
    .map_err(|e| format!("seccomp: {e}"))?;
    deny.insert(libc::SYS_clone, vec![rule(vec![a_copy])?]);
    let eperm = SeccompFilter::new(
        deny,
        SeccompAction::Allow,
        SeccompAction::Errno(libc::EPERM as u32),
        arch,
    )
    .map_err(|e| format!("seccomp: {e}"))?;
    let enosys = SeccompFilter::new(
        [(libc::SYS_clone3, Vec::new())].into_iter().collect(),
        SeccompAction::Allow,
        SeccompAction::Errno(libc::ENOSYS as u32),
        arch,
    )
    .map_err(|e| format!("seccomp: {e}"))?;
    for filter in [eperm, enosys] {
        let program: BpfProgram = filter.try_into().map_err(|e| format!("seccomp: {e:?}"))?;
        seccompiler::apply_filter_all_threads(&program).map_err(|e| format!("seccomp: {e}"))?;
    }
    Ok(())
}

/// The calls the filter refuses outright (see the module doc).
fn denied_calls() -> Vec<i64> {
    let mut calls = vec![
        libc::SYS_socket,
        libc::SYS_socketpair,
        libc::SYS_connect,
        libc::SYS_bind,
        libc::SYS_listen,
        libc::SYS_accept,
        libc::SYS_accept4,
        libc::SYS_ptrace,
        libc::SYS_process_vm_readv,
        libc::SYS_process_vm_writev,
        libc::SYS_pidfd_open,
        libc::SYS_pidfd_getfd,
        libc::SYS_pidfd_send_signal,
        libc::SYS_tkill,
        libc::SYS_rt_sigqueueinfo,
        libc::SYS_rt_tgsigqueueinfo,
        libc::SYS_kcmp,
        libc::SYS_setsid,
        libc::SYS_setpgid,
        libc::SYS_mount,
        libc::SYS_umount2,
        libc::SYS_pivot_root,
        libc::SYS_chroot,
        libc::SYS_unshare,
        libc::SYS_setns,
        libc::SYS_kexec_load,
        libc::SYS_kexec_file_load,
        libc::SYS_init_module,
        libc::SYS_finit_module,
        libc::SYS_delete_module,
        libc::SYS_bpf,
        libc::SYS_perf_event_open,
        libc::SYS_userfaultfd,
        libc::SYS_io_uring_setup,
        libc::SYS_keyctl,
        libc::SYS_add_key,
        libc::SYS_request_key,
        libc::SYS_reboot,
        libc::SYS_swapon,
        libc::SYS_swapoff,
        libc::SYS_acct,
        libc::SYS_quotactl,
        libc::SYS_settimeofday,
        libc::SYS_clock_settime,
        libc::SYS_clock_adjtime,
        libc::SYS_adjtimex,
        libc::SYS_personality,
        libc::SYS_name_to_handle_at,
        libc::SYS_open_by_handle_at,
        libc::SYS_mknodat,
        libc::SYS_syslog,
        libc::SYS_sethostname,
        libc::SYS_setdomainname,
        libc::SYS_setuid,
        libc::SYS_setgid,
        libc::SYS_setreuid,
        libc::SYS_setregid,
        libc::SYS_setresuid,
        libc::SYS_setresgid,
        libc::SYS_setgroups,
        libc::SYS_setfsuid,
        libc::SYS_setfsgid,
        libc::SYS_capset,
    ];
    #[cfg(target_arch = "x86_64")]
    calls.extend([
        libc::SYS_fork,
        libc::SYS_vfork,
        libc::SYS_mknod,
        libc::SYS_iopl,
        libc::SYS_ioperm,
    ]);
    calls
}
