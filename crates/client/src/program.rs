//! Tenant programs: kernels a session builds from its own code, run by the daemon in the
//! session's sandboxed executor process (never inside the daemon).

use std::sync::{Arc, Weak};

use agora_protocol::control::{ControlError, Request, Response, MAX_PROGRAM_BYTES};
use agora_protocol::{KernelSignature, Op, TaskDescriptor};

use crate::session::{Inner, Kernel, Session};
use crate::Error;

/// A program built for this session: its kernels, callable like the library's with
/// [`crate::Queue::launch`], from this session only.
///
/// The session holds the program while this value, a clone of it or one of its [`Kernel`]s
/// lives: dropping the last gives it back to the daemon, which frees its slot
/// (`[programs] max_per_session` counts the programs a session holds at once) and unloads its
/// code once the tasks issued before are done. Building the same code again while the session
/// holds it returns the same program (same kernels and ids, [`Program::cached`]) and takes no
/// new slot.
#[derive(Debug, Clone)]
pub struct Program {
    kernels: Vec<Kernel>,
    log: String,
    cached: bool,
}

impl Program {
    /// The kernel named `name` (its `__kernel` function, or its manifest name).
    pub fn kernel(&self, name: &str) -> Option<Kernel> {
        self.kernels.iter().find(|k| k.name() == name).cloned()
    }

    /// Every kernel of the program.
    pub fn kernels(&self) -> &[Kernel] {
        &self.kernels
    }

    /// The compiler's log (warnings); empty when it had nothing to say.
    pub fn build_log(&self) -> &str {
        &self.log
    }

    /// Whether the daemon had built this source before (its program cache), so the build cost
    /// almost nothing.
    pub fn cached(&self) -> bool {
        self.cached
    }
}

/// One build reply's hold on a program, shared by the [`Kernel`]s of that [`Program`]: when the
/// last goes, the program is released (`Op::ReleaseProgram`, through the ring: after every task
/// issued before it, which therefore still finds its kernels).
pub(crate) struct ProgramLease {
    /// Weak: a program does not keep its session open (it never did); once the session is
    /// gone, so is the program.
    session: Weak<Inner>,
    /// The application's id of the program's first kernel.
    kernel: u32,
    /// The program's entry in the resume registry.
    record: u64,
}

impl std::fmt::Debug for ProgramLease {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ProgramLease").field("kernel", &self.kernel).finish()
    }
}

impl Drop for ProgramLease {
    fn drop(&mut self) {
        let Some(session) = self.session.upgrade() else {
            return;
        };
        if session.in_forked_child() {
            // The parent's program: this copy just goes.
            return;
        }
        let mut d = TaskDescriptor::zeroed();
        d.op = Op::ReleaseProgram as u32;
        d.kernel = session.resume.kernel_ids.real(self.kernel);
        // Never waits for a daemon to come back (`submit_release`); a daemon of before this
        // operation fails it and keeps the program, as it always did.
        let release = session.submit_release(0, d);
        session
            .resume
            .program_released(self.record, release, |id| session.is_done(id));
    }
}

impl Session {
    /// Builds OpenCL C `source` (OpenCL 1.2; every `__kernel` function becomes a kernel, its
    /// signature taken from its parameters: `__global` pointers to `int`, `uint`, `long`,
    /// `ulong`, `float` or `double` are buffers, read-only when `const`; scalars of those types
    /// are scalars). A launch runs over exactly its range, with the slice's first row as global
    /// offset. A source that does not compile fails with the compiler's log
    /// ([`ControlError::ProgramBuild`]).
    ///
    /// Without a manifest the daemon checks no buffer sizes: a kernel that reads or writes out
    /// of bounds touches only this session's memory, or crashes its executor
    /// ([`crate::TaskError::KernelCrashed`]); the next launch starts a new one.
    pub fn program_opencl(&self, source: &str) -> Result<Program, Error> {
        self.build_program("opencl", source.as_bytes(), None, "opencl program")
    }

    /// Like [`Session::program_opencl`], with a manifest (`[kernels.NAME]` tables of the kernel
    /// package format, see docs/KERNELS.md) adding size rules and chunkability.
    pub fn program_opencl_with_manifest(&self, source: &str, manifest: &str) -> Result<Program, Error> {
        self.build_program("opencl", source.as_bytes(), Some(manifest), "opencl program")
    }

    /// Builds a C program: `library` is an ELF shared object for this machine exporting
    /// functions with the C ABI of `agora_kernel.h`, `manifest` its `[kernels.NAME]` tables
    /// (parameters, size rules, `cpu = { symbol = ... }`).
    pub fn program_library(&self, library: &[u8], manifest: &str) -> Result<Program, Error> {
        self.build_program("c", library, Some(manifest), "c program")
    }

    /// Builds CUDA C `source` (UTF-8 text, compiled by the daemon with NVRTC): each kernel is an
    /// `extern "C" __global__` function, described by `manifest` (required: its
    /// `[kernels.NAME]` tables give the parameters, size rules, and `cuda = { entry = "..." }`
    /// when the function's name differs from `NAME`). A kernel takes its declared parameters
    /// only (buffers as device pointers, scalars by value), and its grid covers the launch
    /// range exactly: one thread per work item, `blockIdx.x * blockDim.x + threadIdx.x` being
    /// the row (dimension 0 is x), block sizes chosen by the daemon.
    ///
    /// The program runs only on NVIDIA GPUs, fenced: every global memory access is masked into
    /// this session's own memory. A daemon without such a GPU still builds and checks it where
    /// NVRTC is installed (elsewhere the build is refused, [`ControlError::BadRequest`], saying
    /// so: send PTX), and a launch then fails with [`crate::TaskError::NoDevice`]. Source that
    /// does not compile fails with NVRTC's log ([`ControlError::ProgramBuild`]); code the fence
    /// pass refuses (`printf`, `cp.async`, textures, ...) fails the build likewise, naming the
    /// line and why.
    pub fn program_cuda(&self, source: &str, manifest: &str) -> Result<Program, Error> {
        self.build_program("cuda", source.as_bytes(), Some(manifest), "cuda program")
    }

    /// Builds a PTX program: `ptx` is PTX text whose `.entry` functions are the kernels,
    /// described by `manifest` (required, as for [`Session::program_cuda`], with
    /// `cuda = { entry = "..." }` when an entry's name differs from its `[kernels.NAME]`).
    /// Same conventions as [`Session::program_cuda`]: declared parameters only, a grid covering
    /// the launch range exactly (one thread per work item, dimension 0 is x).
    ///
    /// Runs only on NVIDIA GPUs, fenced into this session's memory; a daemon without one builds
    /// and checks it, and a launch fails with [`crate::TaskError::NoDevice`]. PTX the fence pass
    /// refuses fails the build ([`ControlError::ProgramBuild`]) naming the line and why.
    pub fn program_ptx(&self, ptx: &str, manifest: &str) -> Result<Program, Error> {
        self.build_program("ptx", ptx.as_bytes(), Some(manifest), "ptx program")
    }

    fn build_program(&self, language: &str, code: &[u8], manifest: Option<&str>, name: &str) -> Result<Program, Error> {
        if code.len() > MAX_PROGRAM_BYTES {
            return Err(Error::Control(ControlError::BadRequest(format!(
                "the program's code is {} bytes; at most {MAX_PROGRAM_BYTES} bytes (MAX_PROGRAM_BYTES) can be \
                 built by a session: larger code belongs in a kernel package the operator installs",
                code.len()
            ))));
        }
        let request = Request::BuildProgram {
            language: language.to_string(),
            code: code.to_vec(),
            manifest: manifest.map(str::to_string),
            name: name.to_string(),
        };
        match self.inner.request(&request)? {
            Response::Program { kernels, log, cached } => {
                // Recorded, so that a session resumed on a restarted daemon builds it again.
                let real: Vec<u32> = kernels.iter().map(|(id, _)| *id).collect();
                let (ids, record) = self.inner.resume.program_built(request, &real);
                let lease = ids.first().map(|&kernel| {
                    Arc::new(ProgramLease {
                        session: Arc::downgrade(&self.inner),
                        kernel,
                        record,
                    })
                });
                let Some(lease) = lease else {
                    return Err(Error::Protocol("the daemon built a program without kernels".into()));
                };
                Ok(Program {
                    kernels: ids
                        .into_iter()
                        .zip(kernels)
                        .map(|(id, (_, signature)): (u32, (u32, KernelSignature))| {
                            Kernel::of_program(id, signature, &self.inner, lease.clone())
                        })
                        .collect(),
                    log,
                    cached,
                })
            }
            Response::Error(e) => Err(Error::Control(e)),
            other => Err(Error::Protocol(format!(
                "unexpected reply to a program build: {other:?}"
            ))),
        }
    }
}
