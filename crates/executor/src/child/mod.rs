//! The executor process: runs one session's tenant programs, outside the daemon.
//!
//! Started by the daemon's [`supervisor`](crate::supervisor) as the hidden subcommand `agora
//! executor --control-fd 3 --segment-fd 4 ...`. It inherits exactly two descriptors besides
//! `/dev/null` on 0–2: a `SOCK_SEQPACKET` socket to the daemon and the session's segment memfd,
//! which it maps (`MAP_SHARED`) whole — the only memory of the tenant it can reach, and no
//! memory of the daemon or of any other tenant.
//!
//! Before it touches tenant code it confines itself (see [`sandbox`] for each step and why):
//! parent-death signal, no new privileges, other descriptors closed, resource limits, the
//! tenant's uid and gid when the daemon runs as root, a private PoCL cache directory, Landlock,
//! then (after OpenCL is initialised) a seccomp filter on every thread. Then it says
//! [`FromChild::Ready`] and serves requests one at a time until the daemon sends
//! [`ToChild::Shutdown`] or closes the socket:
//!
//! * [`ToChild::Build`] builds an OpenCL C program with its own OpenCL context (or loads a C
//!   shared object) and answers [`FromChild::Built`] with the kernels and their signatures, or
//!   [`FromChild::BuildFailed`] with the compiler's log;
//! * [`ToChild::Unload`] forgets a program the daemon will launch no more (its code goes);
//! * [`ToChild::Run`] runs rows of one kernel over buffers given as offsets into the segment
//!   and answers [`FromChild::Done`] or [`FromChild::Failed`]. A kernel that faults kills this
//!   process (the daemon reports the signal and starts a new executor); one that runs too long
//!   is killed by the daemon.
//!
//! Its replies are not trusted by the daemon: once tenant code has run here, everything this
//! process says may be the tenant's.

pub mod native;
pub mod opencl;
pub mod sandbox;

use std::os::fd::{FromRawFd, OwnedFd};
use std::path::PathBuf;

use crate::wire::{self, Code, FromChild, ToChild, MAX_LOG, MAX_TO_CHILD, PROTOCOL};

/// The executor's command line, as the supervisor writes it.
#[derive(Debug, Clone)]
pub struct Args {
    /// The socket to the daemon.
    pub control_fd: i32,
    /// The session's segment memfd.
    pub segment_fd: i32,
    /// The private cache directory (`POCL_CACHE_DIR`), the only writable place.
    pub cache_dir: PathBuf,
    /// The daemon's pid: the executor exits if its parent is another process.
    pub daemon_pid: i32,
    /// The tenant's uid and gid, to become (when the daemon runs as root).
    pub tenant: Option<(u32, u32)>,
}

/// The session's segment as this process maps it.
pub struct Mapping {
    base: *mut u8,
    len: u64,
}

impl Mapping {
    /// Wraps a mapping.
    ///
    /// # Safety
    /// `base` must point to `len` bytes mapped readable and writable for the rest of the
    /// process's life.
    pub unsafe fn new(base: *mut u8, len: u64) -> Self {
        Mapping { base, len }
    }

    /// The first byte of `len` bytes at `offset`, when they lie within the mapping.
    pub fn range(&self, offset: u64, len: u64) -> Option<*mut u8> {
        if offset.checked_add(len)? > self.len {
            return None;
        }
        // SAFETY: within the mapping (checked above), so the offset fits in the allocation.
        Some(unsafe { self.base.add(offset as usize) })
    }
}

/// Exit status when the executor could not set itself up.
pub const SETUP_FAILED: i32 = 70;

/// Runs the executor; returns its exit status.
pub fn main(args: Args) -> i32 {
    match serve(args) {
        Ok(()) => 0,
        // Standard error is /dev/null: the daemon sees the exit status and the closed socket.
        Err(_) => SETUP_FAILED,
    }
}

/// A built program.
enum Built {
    OpenCl(opencl::ClProgram),
    Library(native::Library),
}

fn serve(args: Args) -> Result<(), String> {
    sandbox::die_with_parent(args.daemon_pid)?;
    sandbox::no_new_privileges()?;
    let mut keep = [args.control_fd, args.segment_fd];
    keep.sort_unstable();
    if keep[0] < 3 || keep[0] == keep[1] {
        return Err("the control and segment descriptors must be distinct and above 2".into());
    }
    sandbox::close_other_descriptors(&keep)?;
    sandbox::limit_resources()?;
    if let Some((uid, gid)) = args.tenant {
        sandbox::become_tenant(uid, gid, args.daemon_pid)?;
    }
    // SAFETY: both descriptors were inherited for this process alone (the supervisor's
    // contract) and nothing else in it owns them.
    let (control, segment) = unsafe {
        (
            OwnedFd::from_raw_fd(args.control_fd),
            OwnedFd::from_raw_fd(args.segment_fd),
        )
    };
    let mapping = map_segment(&segment)?;
    drop(segment);
    // Still one thread: the environment may change.
    std::env::set_var("POCL_CACHE_DIR", &args.cache_dir);
    let mut report = vec![sandbox::restrict_files(&args.cache_dir, &sandbox::linker_files())];
    let opencl = opencl::OpenCl::init();
    sandbox::filter_system_calls()?;
    report.push(
        "seccomp: networking, other processes, fork, leaving the process group, mounts, modules, bpf, ptrace denied"
            .into(),
    );
    report.push(format!(
        "limits: no core files, {} open files, {} CPU seconds",
        sandbox::MAX_FILES,
        sandbox::CPU_SECONDS
    ));
    wire::send(
        &control,
        &FromChild::Ready {
            protocol: PROTOCOL,
            device: opencl.as_ref().map(|cl| cl.name.clone()),
            sandbox: report,
        },
        None,
    )
    .map_err(|e| e.to_string())?;
    // By number: unloads leave gaps, and numbers only grow.
    let mut programs: std::collections::BTreeMap<u32, Built> = std::collections::BTreeMap::new();
    loop {
        let request: ToChild = match wire::recv(&control, MAX_TO_CHILD, None) {
            Ok(request) => request,
            Err(wire::WireError::Closed) => return Ok(()),
            Err(e) => return Err(e.to_string()),
        };
        let reply = match request {
            ToChild::Shutdown => return Ok(()),
            ToChild::Build { program, code } => match programs.last_key_value() {
                Some((&last, _)) if program <= last => FromChild::BuildFailed {
                    log: format!("program {program} out of order: program {last} was built already"),
                },
                _ => match build(opencl.as_ref(), code) {
                    Ok((built, reply)) => {
                        programs.insert(program, built);
                        reply
                    }
                    Err(reply) => reply,
                },
            },
            ToChild::Unload { program } => {
                // Drops its OpenCL program and kernels, or closes its library.
                programs.remove(&program);
                FromChild::Done
            }
            ToChild::Run {
                program,
                kernel,
                range,
                dims,
                rows,
                args,
            } => {
                let outcome = match programs.get(&program) {
                    None => Err((-1, format!("no program {program}"))),
                    Some(Built::OpenCl(p)) => match opencl.as_ref() {
                        Some(cl) => cl
                            .run(p, kernel, range, dims, rows, &args, &mapping)
                            .map(|()| FromChild::Done),
                        None => Err((-1, "no OpenCL device".into())),
                    },
                    Some(Built::Library(l)) => l.run(kernel, range, rows, &args, &mapping).map(|returned| {
                        returned.map_or_else(|code| FromChild::Returned { code }, |()| FromChild::Done)
                    }),
                };
                outcome.unwrap_or_else(|(code, message)| FromChild::Failed { code, message })
            }
        };
        wire::send(&control, &reply, None).map_err(|e| e.to_string())?;
    }
}

/// Builds `code`: the program and the reply, or the failure's reply.
fn build(opencl: Option<&opencl::OpenCl>, code: Code) -> Result<(Built, FromChild), FromChild> {
    match code {
        Code::OpenCl { source, binary } => {
            let Some(cl) = opencl else {
                return Err(FromChild::BuildFailed {
                    log:
                        "no OpenCL device is available to the executor (is an OpenCL platform such as PoCL installed?)"
                            .into(),
                });
            };
            match cl.build(&source, binary.as_deref()) {
                Ok(built) => Ok((
                    Built::OpenCl(built.program),
                    FromChild::Built {
                        kernels: built.kernels,
                        log: cut(built.log),
                        binary: built.binary.filter(|b| b.len() <= wire::MAX_BINARY),
                        from_binary: built.from_binary,
                    },
                )),
                Err(log) => Err(FromChild::BuildFailed { log: cut(log) }),
            }
        }
        Code::Library { bytes, symbols } => match native::Library::load(&bytes, &symbols) {
            Ok(library) => {
                let kernels = symbols
                    .iter()
                    .map(|name| wire::BuiltKernel {
                        name: name.clone(),
                        params: Vec::new(),
                    })
                    .collect();
                Ok((
                    Built::Library(library),
                    FromChild::Built {
                        kernels,
                        log: String::new(),
                        binary: None,
                        from_binary: false,
                    },
                ))
            }
            Err(log) => Err(FromChild::BuildFailed { log }),
        },
    }
}

/// `log`, cut to [`MAX_LOG`] bytes.
fn cut(mut log: String) -> String {
    if log.len() > MAX_LOG {
        let mut end = MAX_LOG - 64;
        while !log.is_char_boundary(end) {
            end -= 1;
        }
        log.truncate(end);
        log.push_str("\n[log cut]");
    }
    log
}

/// Maps the whole segment shared and read-write.
fn map_segment(segment: &OwnedFd) -> Result<Mapping, String> {
    let len = rustix::fs::fstat(segment)
        .map_err(|e| format!("fstat on the segment: {e}"))?
        .st_size as u64;
    if len == 0 {
        return Err("the segment is empty".into());
    }
    // SAFETY: a new shared mapping of the memfd, never unmapped (the process ends with it);
    // the daemon sealed the memfd against shrinking, so every byte stays backed.
    let base = unsafe {
        rustix::mm::mmap(
            std::ptr::null_mut(),
            len as usize,
            rustix::mm::ProtFlags::READ | rustix::mm::ProtFlags::WRITE,
            rustix::mm::MapFlags::SHARED,
            segment,
            0,
        )
    }
    .map_err(|e| format!("mapping the segment: {e}"))?;
    // SAFETY: just mapped, `len` bytes, read-write, never unmapped.
    Ok(unsafe { Mapping::new(base as *mut u8, len) })
}
