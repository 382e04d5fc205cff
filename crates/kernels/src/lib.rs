//! The kernel library.
//!
//! Each kernel is one [`KernelDef`]: a name, a declared signature (which arguments are buffers,
//! read or written, which are scalars), a size check that says how large each buffer must be for
//! a given range and scalars, and implementations per device kind: the CPU, as a Rust function
//! over a slice of the range's first dimension (so a lane can split it among threads), and
//! OpenCL, as a kernel in a `.cl` file under `src/opencl/`.
//!
//! Programs: elementwise basics (`noop`, `saxpy`, `vector_add`, `fill`), the Rodinia programs
//! [`gaussian`], [`nw`], [`lavamd`] and [`backprop`], [`sgemm`], [`stream`] and the CG building
//! blocks of [`hpccg`]. Rodinia's [`hotspot`] and [`pathfinder`] are kernel packages
//! (`examples/packages`, loaded by the daemon at run time); their modules here keep only the host
//! reference. Each program module has a `reference` module: plain-Rust whole-problem
//! implementations with the same arithmetic, and seeded input generators. [`cases`] is a
//! device-agnostic table of test launches with expected results, the packages' kernels included
//! ([`cases::PACKAGE_PROGRAMS`]).
//!
//! Kernels loaded at run time (packages, tenant programs) are [`KernelDef`]s too, with owned text,
//! size rules as data ([`SizeCheck::Rules`]) and CPU implementations in C ([`CpuImpl::Native`])
//! or in another process ([`CpuImpl::External`]); the daemon passes every kernel as a
//! [`KernelRef`].
//!
//! Dimension 0 of every range is an independent dimension: any split of its rows gives the same
//! results. Reductions write one partial sum per work item (a fixed block of elements) and leave
//! the final sum to the host or a second launch: no atomics, no dependence on the thread count.
//!
//! The daemon checks every launch against the signature and the size check *before* it calls an
//! implementation, so implementations may assume their buffers are large enough; they still
//! access buffers only through bounds-checked views or through slices whose bounds the check
//! established.
//!
//! This crate must not know about sessions, devices or scheduling.

use std::borrow::Cow;
use std::ops::Range;
use std::sync::Arc;

use agora_protocol::{Access, ArgTag, ParamKind, RawArg, ScalarType, TaskError};

pub mod backprop;
mod basic;
mod call;
pub mod cases;
mod checks;
pub mod gaussian;
pub mod hotspot;
pub mod hpccg;
pub mod lavamd;
pub mod native;
pub mod nw;
pub mod pathfinder;
pub mod rng;
pub mod sgemm;
pub mod stream;

pub use call::{run_on_host, ArgValue, KernelCall, LaunchShape, SharedMut};

/// CPU implementation compiled into the daemon: runs the rows `rows` (a sub-range of the
/// launch's first dimension).
pub type CpuFn = fn(call: &KernelCall<'_>, rows: Range<u64>);

/// Size check compiled into the daemon: given the launch's shape, says whether every buffer is
/// large enough.
pub type CheckFn = fn(shape: &LaunchShape<'_>) -> Result<(), TaskError>;

/// A CPU implementation with the C calling convention of `agora_kernel.h`: runs rows
/// `row_begin..row_end` and returns 0, or a non-zero code that fails the task.
pub type NativeCpuFn = unsafe extern "C" fn(args: *const native::AgoraKernelArgs, row_begin: u64, row_end: u64) -> i32;

/// Text of a definition: static for the built-in library, owned for loaded packages and tenant
/// programs.
pub type Text = Cow<'static, str>;

/// One declared parameter.
#[derive(Debug, Clone)]
pub struct Param {
    /// Name, for messages and listings.
    pub name: Text,
    /// Kind.
    pub kind: ParamKind,
}

/// An OpenCL implementation: the program (one `.cl` file under `src/opencl/`, or a package's
/// `.cl` file, compiled once per device and cached) and the kernel's entry point in it.
///
/// Calling convention: arguments are passed in signature order (buffers as `__global T*`, scalars
/// by value with the matching OpenCL type: `int`, `uint`, `long`, `ulong`, `float`, `double`).
///
/// *Guarded* kernels (every kernel of the library) declare three more trailing parameters, `const
/// ulong range0, const ulong range1, const ulong range2`, and return early for work items at or
/// beyond them. For them the backend uses a fixed work-group size (64, 8×8 or 4×4×4, or `local`
/// when given) and rounds the global size up, so an OpenCL compiler that specialises per
/// work-group size (PoCL does) compiles the kernel once. Kernels without the trailing parameters
/// (*plain* kernels, allowed in packages) get the exact range as global size and a power-of-two
/// work-group size that divides it; they are never sliced or revoked.
///
/// *Row slices* (chunked launch): a slice `a..b` of dimension 0 is one command with global work
/// offset `a` and global size `b - a` (rounded up for guarded kernels), and `range0 = b`, the
/// slice's end, so the rounded-up work items of one slice never touch the next slice's rows.
/// Kernels must therefore compute positions from `get_global_id` (which includes the offset),
/// never from `get_group_id` alone, and use `range0` only as the guard, never as the problem size.
///
/// *Revocation*: after the guard parameters, every guarded kernel takes `__global const volatile
/// uchar *revoke`, a one-byte flag, and returns at once when it reads it non-zero; each work-group
/// polls it as it starts (kernels without barriers read it in every work item; kernels with
/// barriers read it in one work item into local memory before a barrier, so the group returns
/// together). When the launch is not revocable the flag is a shared, always-zero device buffer;
/// when it is, the backend points it at the job's revocation flag in host memory (on devices that
/// compute on host memory) or copies that flag in just before the kernel starts (elsewhere). A
/// revoked launch leaves the outputs of work-groups that had not started unwritten.
#[derive(Debug, Clone)]
pub struct OpenClImpl {
    /// Program name, used with the source's hash as the cache key (e.g. `basic`, or
    /// `imaging/blur.cl` for a package).
    pub program: Text,
    /// Program source.
    pub source: Text,
    /// Kernel function name in the program.
    pub entry: Text,
    /// Required local work size, when the kernel depends on one (e.g. tiled sgemm). Such a
    /// kernel uses barriers, so single work items never return early: work items outside the
    /// range take part in the barriers and skip only their stores (a revoked work-group returns
    /// as a whole).
    pub local: Option<[usize; 3]>,
    /// Precompiled programs by device (a package's `opencl.binaries`): on a device whose name
    /// matches, the backend loads the binary (`clCreateProgramWithBinary`) instead of compiling
    /// `source`, and compiles `source` when the binary does not load.
    pub binaries: Cow<'static, [OpenClBinary]>,
}

/// A program compiled ahead of time for one OpenCL device.
#[derive(Debug, Clone)]
pub struct OpenClBinary {
    /// The device's name (`CL_DEVICE_NAME`), as `agora devices` shows it after the platform.
    pub device: Text,
    /// The program binary (`CL_PROGRAM_BINARIES` of a build for that device).
    pub bytes: Arc<[u8]>,
}

/// A kernel's CUDA implementation: CUDA C (compiled by NVRTC for the GPU's architecture at first
/// use) or PTX (loaded as it is, JIT-compiled by the driver).
#[derive(Debug, Clone)]
pub struct CudaImpl {
    /// Program name, used with the code's hash as the cache key (e.g. `imaging/imaging.cu`, or
    /// `tenant-fenced/<hash>` for a tenant's program, which a GPU runs only fenced).
    pub program: Text,
    /// The code.
    pub code: CudaCode,
    /// The entry point: an `extern "C" __global__` function (CUDA C) or a `.entry` (PTX).
    pub entry: Text,
    /// The calling convention: `true` when the entry takes, after its declared parameters,
    /// `range0, range1, range2` (`unsigned long long`), the revocation flag (`const volatile
    /// unsigned char *`) and the row offset (`unsigned long long`), like the library's guarded
    /// OpenCL kernels, so a launch may be sliced and revoked; `false` when it takes its declared
    /// parameters only and runs as one launch whose grid covers the range exactly.
    pub guarded: bool,
}

/// The code of a [`CudaImpl`].
#[derive(Debug, Clone)]
pub enum CudaCode {
    /// CUDA C source.
    Source(Text),
    /// PTX text.
    Ptx(Text),
}

impl CudaCode {
    /// The text.
    pub fn text(&self) -> &str {
        match self {
            CudaCode::Source(t) | CudaCode::Ptx(t) => t,
        }
    }

    /// `cuda` or `ptx`, for messages and listings.
    pub fn language(&self) -> &'static str {
        match self {
            CudaCode::Source(_) => "cuda",
            CudaCode::Ptx(_) => "ptx",
        }
    }
}

/// How the daemon names a tenant's own OpenCL program in [`OpenClImpl::program`]: untrusted code.
/// `tenant/<hash>` may run on the daemon's OpenCL devices (`[programs] in_daemon`) and, fenced, on
/// its GPUs; `tenant-fenced/<hash>` only fenced, on GPUs.
pub const TENANT_PROGRAM_PREFIX: &str = "tenant/";
/// See [`TENANT_PROGRAM_PREFIX`].
pub const FENCED_TENANT_PROGRAM_PREFIX: &str = "tenant-fenced/";

/// Whether `program` is a tenant's own (untrusted) program.
pub fn is_tenant_program(program: &str) -> bool {
    program.starts_with(TENANT_PROGRAM_PREFIX) || program.starts_with(FENCED_TENANT_PROGRAM_PREFIX)
}

/// Whether `program` may run only where its memory accesses are fenced (a GPU).
pub fn runs_only_fenced(program: &str) -> bool {
    program.starts_with(FENCED_TENANT_PROGRAM_PREFIX)
}

/// How expensive a kernel is: the daemon's estimate before it has measured the kernel, for the
/// decisions to run a task inline on the dispatcher thread, to split a launch into slices and to
/// make it revocable.
///
/// No kernel is free: every estimate grows with the range (a free kernel of 2^40 work items
/// would run inline, unsliced, for as long as the device takes to walk its range).
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Cost {
    /// About this many nanoseconds per work item on one CPU core (positive).
    PerItemNs(f64),
}

/// A kernel whose CPU implementation runs somewhere the daemon does not execute code itself (a
/// tenant's sandboxed executor process). Called once per launch or slice, never split among a
/// lane's threads.
pub trait ExternalKernel: Send + Sync + std::fmt::Debug {
    /// Runs rows `rows` of `call`; the error fails the task.
    fn run(&self, call: &KernelCall<'_>, rows: Range<u64>) -> Result<(), TaskError>;
}

/// A size check that is data rather than code (a package's size rules).
pub trait ShapeCheck: Send + Sync + std::fmt::Debug {
    /// Like [`CheckFn`].
    fn check(&self, shape: &LaunchShape<'_>) -> Result<(), TaskError>;
}

/// A CPU implementation.
#[derive(Clone)]
pub enum CpuImpl {
    /// Rust, compiled into the daemon (the built-in library).
    Builtin(CpuFn),
    /// A C function from an operator-installed package's shared object, run in the daemon
    /// (trusted code, like the built-ins), and what keeps that shared object loaded while the
    /// definition (or a clone of it) exists: the function pointer is valid only as long as it.
    Native(NativeCpuFn, Option<Arc<dyn std::any::Any + Send + Sync>>),
    /// Runs outside the daemon (a tenant program in its executor).
    External(Arc<dyn ExternalKernel>),
}

impl std::fmt::Debug for CpuImpl {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            CpuImpl::Builtin(_) => f.write_str("Builtin"),
            CpuImpl::Native(..) => f.write_str("Native"),
            CpuImpl::External(e) => write!(f, "External({e:?})"),
        }
    }
}

/// The size check of a kernel.
#[derive(Clone)]
pub enum SizeCheck {
    /// Rust, compiled into the daemon.
    Builtin(CheckFn),
    /// Rules loaded with a package (or a tenant program's manifest).
    Rules(Arc<dyn ShapeCheck>),
}

impl std::fmt::Debug for SizeCheck {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            SizeCheck::Builtin(_) => f.write_str("Builtin"),
            SizeCheck::Rules(r) => write!(f, "Rules({r:?})"),
        }
    }
}

/// A kernel: of the library, of a package or of a tenant program.
#[derive(Debug, Clone)]
pub struct KernelDef {
    /// Name, e.g. `gaussian.fan1` (a package's kernels are `package.kernel`).
    pub name: Text,
    /// What it computes and the range it expects.
    pub doc: Text,
    /// Parameters in call order.
    pub params: Cow<'static, [Param]>,
    /// Cost estimate.
    pub cost: Cost,
    /// Whether any split of dimension 0's rows gives the same results, so a launch may be
    /// sliced (chunked preemption), revoked between row blocks and split among a lane's
    /// threads. Every kernel of the library is; a package declares it per kernel.
    pub chunkable: bool,
    /// Buffer-size and scalar check.
    pub check: SizeCheck,
    /// CPU implementation.
    pub cpu: Option<CpuImpl>,
    /// OpenCL implementation (on GPUs, also compiled as CUDA C under the backend's prelude).
    pub opencl: Option<OpenClImpl>,
    /// CUDA implementation: CUDA C or PTX written for NVIDIA GPUs (a package's or a tenant
    /// program's). A GPU prefers it to the OpenCL one.
    pub cuda: Option<CudaImpl>,
}

/// A kernel as the daemon passes it along a task's path: the library's are static, loaded ones
/// are shared (a package reload or a session's end frees them once no task uses them). Cloning
/// is a pointer copy for the library's kernels and a reference count for the others.
#[derive(Debug, Clone)]
pub enum KernelRef {
    /// A kernel of the built-in library.
    Static(&'static KernelDef),
    /// A loaded kernel.
    Shared(Arc<KernelDef>),
}

impl std::ops::Deref for KernelRef {
    type Target = KernelDef;
    #[inline]
    fn deref(&self) -> &KernelDef {
        match self {
            KernelRef::Static(k) => k,
            KernelRef::Shared(k) => k,
        }
    }
}

impl From<&'static KernelDef> for KernelRef {
    fn from(k: &'static KernelDef) -> Self {
        KernelRef::Static(k)
    }
}

impl KernelRef {
    /// Whether both refer to the same definition.
    pub fn same(&self, other: &KernelRef) -> bool {
        std::ptr::eq::<KernelDef>(&**self, &**other)
    }
}

impl KernelDef {
    /// The wire form of the signature.
    pub fn signature(&self) -> agora_protocol::KernelSignature {
        agora_protocol::KernelSignature {
            name: self.name.to_string(),
            params: self
                .params
                .iter()
                .map(|p| agora_protocol::ParamSpec {
                    name: p.name.to_string(),
                    kind: p.kind,
                })
                .collect(),
            doc: self.doc.to_string(),
        }
    }

    /// Checks that `args` match the declared parameter kinds (count and tags).
    pub fn check_arguments(&self, args: &[RawArg]) -> Result<(), TaskError> {
        if args.len() != self.params.len() {
            return Err(TaskError::ArgumentCount {
                expected: self.params.len() as u32,
                got: args.len() as u32,
            });
        }
        for (index, (param, arg)) in self.params.iter().zip(args).enumerate() {
            let expected = match param.kind {
                ParamKind::Buffer { .. } => ArgTag::Buffer,
                ParamKind::Scalar(t) => ArgTag::for_scalar(t),
            };
            if arg.tag != expected as u32 {
                return Err(TaskError::ArgumentType {
                    index: index as u16,
                    expected: expected as u32,
                    got: arg.tag,
                });
            }
        }
        Ok(())
    }

    /// Runs the size check.
    #[inline]
    pub fn check_shape(&self, shape: &LaunchShape<'_>) -> Result<(), TaskError> {
        match &self.check {
            SizeCheck::Builtin(f) => f(shape),
            SizeCheck::Rules(r) => r.check(shape),
        }
    }

    /// Whether the CPU implementation may be called for parts of the rows on several threads at
    /// once (chunkable, and run in this process).
    pub fn splits_among_threads(&self) -> bool {
        self.chunkable && !matches!(self.cpu, Some(CpuImpl::External(_)))
    }

    /// Whether a tiny launch may run inline on the dispatcher thread: not when the kernel runs in
    /// another process (the dispatcher would wait for it).
    pub fn may_run_inline(&self) -> bool {
        !matches!(self.cpu, Some(CpuImpl::External(_)))
    }

    /// Runs rows `rows` of `call` with the CPU implementation. A Rust kernel's panic propagates
    /// (the lane catches it); a C kernel's non-zero return and an external kernel's error fail
    /// the task.
    pub fn run_cpu(&self, call: &KernelCall<'_>, rows: Range<u64>) -> Result<(), TaskError> {
        match &self.cpu {
            None => Err(TaskError::NoDevice(0)),
            Some(CpuImpl::Builtin(f)) => {
                f(call, rows);
                Ok(())
            }
            Some(CpuImpl::Native(f, _)) => {
                let args = native::AgoraKernelArgs::of(call, self.params.len());
                // SAFETY: `f` comes from an operator-installed package (trusted code) with the
                // documented signature; `args` points to the call's buffers, which the size check
                // established and the caller keeps mapped (KernelCall's contract), and lives
                // across the call.
                let code = unsafe { f(&args, rows.start, rows.end) };
                if code == 0 {
                    Ok(())
                } else {
                    tracing_free_log(&self.name, code);
                    Err(TaskError::KernelFault)
                }
            }
            Some(CpuImpl::External(e)) => e.run(call, rows),
        }
    }

    /// The kernel's name as a metric and trace label: its name when static (the library's and
    /// packages' kernels), `tenant_program` for kernels a tenant named (whose names must not
    /// become metric labels: a tenant could mint any number of them).
    pub fn label(&self) -> &'static str {
        match &self.name {
            Cow::Borrowed(name) => name,
            Cow::Owned(_) => "tenant_program",
        }
    }

    /// Estimated nanoseconds on one core for `items` work items: proportional to `items`.
    pub fn estimated_ns(&self, items: u64) -> f64 {
        match self.cost {
            Cost::PerItemNs(ns) => ns * items as f64,
        }
    }
}

/// A C kernel's failure, on standard error (this crate does not depend on a logging framework;
/// the daemon logs the task's failure as well).
fn tracing_free_log(kernel: &str, code: i32) {
    eprintln!("agora: package kernel {kernel} returned error code {code}; its task failed");
}

/// Shorthand for a buffer parameter.
pub(crate) const fn buffer(name: &'static str, element: ScalarType, access: Access) -> Param {
    Param {
        name: Cow::Borrowed(name),
        kind: ParamKind::Buffer { element, access },
    }
}

/// Sources of the OpenCL programs.
pub(crate) mod programs {
    pub const BASIC: &str = include_str!("opencl/basic.cl");
    pub const GAUSSIAN: &str = include_str!("opencl/gaussian.cl");
    pub const NW: &str = include_str!("opencl/nw.cl");
    pub const LAVAMD: &str = include_str!("opencl/lavamd.cl");
    pub const BACKPROP: &str = include_str!("opencl/backprop.cl");
    pub const SGEMM: &str = include_str!("opencl/sgemm.cl");
    pub const STREAM: &str = include_str!("opencl/stream.cl");
    pub const HPCCG: &str = include_str!("opencl/hpccg.cl");

    /// Every program, by name (the `program` of its kernels' [`crate::OpenClImpl`]).
    pub const ALL: &[(&str, &str)] = &[
        ("basic", BASIC),
        ("gaussian", GAUSSIAN),
        ("nw", NW),
        ("lavamd", LAVAMD),
        ("backprop", BACKPROP),
        ("sgemm", SGEMM),
        ("stream", STREAM),
        ("hpccg", HPCCG),
    ];
}

/// Shorthand for an OpenCL implementation without a required local size.
pub(crate) const fn opencl(program: &'static str, source: &'static str, entry: &'static str) -> Option<OpenClImpl> {
    Some(OpenClImpl {
        program: Cow::Borrowed(program),
        source: Cow::Borrowed(source),
        entry: Cow::Borrowed(entry),
        local: None,
        binaries: Cow::Borrowed(&[]),
    })
}

/// Shorthand for a scalar parameter.
pub(crate) const fn scalar(name: &'static str, t: ScalarType) -> Param {
    Param {
        name: Cow::Borrowed(name),
        kind: ParamKind::Scalar(t),
    }
}

static LIBRARY: &[KernelDef] = &[
    basic::NOOP,
    basic::SAXPY,
    basic::VECTOR_ADD,
    basic::FILL,
    gaussian::FAN1,
    gaussian::FAN2,
    nw::DIAGONAL,
    lavamd::BOXES,
    backprop::LAYERFORWARD,
    backprop::SQUASH,
    backprop::ADJUST_WEIGHTS,
    sgemm::SGEMM,
    stream::COPY,
    stream::SCALE,
    stream::ADD,
    stream::TRIAD,
    hpccg::SPMV,
    hpccg::DOT,
    hpccg::WAXPBY,
];

/// Every OpenCL program of the library as `(program, source)`: the `program` and `source` of the
/// kernels' [`OpenClImpl`]s (e.g. to build them all when a device starts).
pub fn opencl_programs() -> &'static [(&'static str, &'static str)] {
    programs::ALL
}

/// Every kernel, indexed by kernel id.
pub fn library() -> &'static [KernelDef] {
    LIBRARY
}

/// Finds a kernel by name; returns its id and definition.
pub fn find(name: &str) -> Option<(u32, &'static KernelDef)> {
    LIBRARY
        .iter()
        .enumerate()
        .find(|(_, k)| k.name == name)
        .map(|(i, k)| (i as u32, k))
}

/// Names close to `name` (same prefix or small edit distance), for "did you mean" messages.
pub fn suggestions(name: &str) -> Vec<String> {
    suggestions_among(name, LIBRARY.iter().map(|k| &*k.name))
}

/// Names among `names` close to `name` (same prefix or small edit distance), at most three.
pub fn suggestions_among<'a>(name: &str, names: impl Iterator<Item = &'a str>) -> Vec<String> {
    let mut out: Vec<String> = names
        .filter(|k| strsim::levenshtein(k, name) <= 2 || (name.len() >= 3 && k.starts_with(name)))
        .map(|k| k.to_string())
        .collect();
    out.truncate(3);
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_are_unique_and_found() {
        for (i, k) in library().iter().enumerate() {
            assert_eq!(find(&k.name).unwrap().0, i as u32);
            assert!(k.cpu.is_some(), "{} has a CPU implementation", k.name);
        }
        assert!(find("nope").is_none());
    }

    #[test]
    fn every_kernel_has_both_implementations() {
        for k in library() {
            assert!(k.cpu.is_some(), "{} has a CPU implementation", k.name);
            let imp = k
                .opencl
                .as_ref()
                .unwrap_or_else(|| panic!("{} has an OpenCL implementation", k.name));
            assert!(
                opencl_programs()
                    .iter()
                    .any(|(p, src)| *p == imp.program && *src == imp.source),
                "{}: program {} is listed in programs::ALL",
                k.name,
                imp.program
            );
            assert!(
                !k.doc.is_empty() && k.doc.contains("range"),
                "{}: the doc names the range",
                k.name
            );
        }
    }

    /// The parameter list of `__kernel void entry(...)` in `source`, split at commas.
    fn cl_params(source: &str, entry: &str) -> Option<Vec<String>> {
        let start = source.find(&format!("__kernel void {entry}("))? + "__kernel void (".len() + entry.len();
        let end = start + source[start..].find(')')?;
        let list = &source[start..end];
        if list.trim().is_empty() {
            return Some(Vec::new());
        }
        Some(
            list.split(',')
                .map(|p| p.split_whitespace().collect::<Vec<_>>().join(" "))
                .collect(),
        )
    }

    fn cl_type(t: ScalarType) -> &'static str {
        match t {
            ScalarType::I32 => "int",
            ScalarType::U32 => "uint",
            ScalarType::I64 => "long",
            ScalarType::U64 => "ulong",
            ScalarType::F32 => "float",
            ScalarType::F64 => "double",
        }
    }

    /// Without an OpenCL compiler here, check the `.cl` sources against the signatures: every
    /// entry point exists, takes the declared parameters in order with matching types (read-only
    /// buffers `const`) plus the three guard parameters and the revocation flag, polls the flag,
    /// ignores no global offset, and uses no extension.
    #[test]
    fn opencl_sources_match_the_signatures() {
        // OpenCL C built-in functions: a kernel with one of these names fails to be created (PoCL
        // reports CL_INVALID_KERNEL_NAME for `step` and `dot`).
        const BUILTINS: &[&str] = &[
            "dot",
            "step",
            "min",
            "max",
            "clamp",
            "mix",
            "sign",
            "cross",
            "length",
            "distance",
            "normalize",
            "exp",
            "log",
            "sqrt",
            "select",
            "smoothstep",
            "degrees",
            "radians",
            "abs",
            "mad",
            "fma",
            "rotate",
        ];
        for (name, source) in opencl_programs() {
            assert!(
                !source.contains("#pragma OPENCL EXTENSION"),
                "{name}.cl uses no extension"
            );
            assert!(!source.contains("double"), "{name}.cl needs no double precision");
            assert!(!source.contains("atomic"), "{name}.cl needs no atomics");
        }
        for k in library() {
            let imp = k.opencl.as_ref().unwrap();
            assert!(
                !BUILTINS.contains(&&*imp.entry),
                "{}: entry {} is an OpenCL built-in",
                k.name,
                imp.entry
            );
            let params = cl_params(&imp.source, &imp.entry)
                .unwrap_or_else(|| panic!("{}: no `__kernel void {}(` in {}.cl", k.name, imp.entry, imp.program));
            assert_eq!(params.len(), k.params.len() + 4, "{}: parameters {params:?}", k.name);
            for (p, cl) in k.params.iter().zip(&params) {
                match p.kind {
                    ParamKind::Buffer { element, access } => {
                        assert!(cl.starts_with("__global"), "{}: {} is __global: {cl}", k.name, p.name);
                        assert!(cl.contains(&format!(" {} *", cl_type(element))), "{}: {cl}", k.name);
                        assert_eq!(
                            cl.contains("const"),
                            access == Access::Read,
                            "{}: const iff read: {cl}",
                            k.name
                        );
                    }
                    ParamKind::Scalar(t) => {
                        assert!(!cl.contains('*'), "{}: {} is by value: {cl}", k.name, p.name);
                        assert!(
                            cl.split(' ').any(|w| w == cl_type(t)),
                            "{}: {cl} is {}",
                            k.name,
                            cl_type(t)
                        );
                    }
                }
            }
            for (d, cl) in params[k.params.len()..k.params.len() + 3].iter().enumerate() {
                assert_eq!(cl, &format!("const ulong range{d}"), "{}: guard parameter", k.name);
            }
            assert_eq!(
                params[k.params.len() + 3],
                "__global const volatile uchar *revoke",
                "{}: revocation flag parameter",
                k.name
            );
            // Chunked launch: positions come from get_global_id, which includes the slice's
            // global work offset (get_group_id does not).
            let code: String = imp.source.lines().map(|l| l.split("//").next().unwrap_or("")).collect();
            assert!(
                !code.contains("get_group_id"),
                "{}.cl: get_group_id ignores a row slice's global offset",
                imp.program
            );
            // Every kernel that does anything polls the flag.
            if k.name != "noop" {
                let body = &imp.source[imp.source.find(&format!("__kernel void {}(", imp.entry)).unwrap()..];
                let body = &body[..body.find("\n}").unwrap_or(body.len())];
                assert!(
                    body.contains("*revoke"),
                    "{}: the kernel polls its revocation flag",
                    k.name
                );
            }
        }
    }

    /// No kernel is free: every estimate is positive and grows with the range, so the daemon
    /// slices, and never runs inline, a launch with a huge range of any kernel.
    #[test]
    fn every_estimate_grows_with_the_range() {
        for k in library() {
            let Cost::PerItemNs(ns) = k.cost;
            assert!(ns > 0.0 && ns.is_finite(), "{}: cost {ns} ns per item", k.name);
            let (one, many) = (k.estimated_ns(1), k.estimated_ns(1 << 40));
            assert!(one > 0.0, "{}: one item is estimated at {one} ns", k.name);
            assert!(
                many >= one * (1u64 << 40) as f64 * 0.99,
                "{}: {many} ns for 2^40 items",
                k.name
            );
            assert!(many > 1e9, "{}: 2^40 items are estimated at {many} ns", k.name);
        }
    }

    #[test]
    fn suggests_close_names() {
        assert_eq!(suggestions("saxp"), vec!["saxpy".to_string()]);
        assert!(suggestions("gaussian").iter().any(|s| s == "gaussian.fan1"));
        assert!(suggestions("zzzzzzzz").is_empty());
    }

    #[test]
    fn argument_checks_name_the_problem() {
        let (_, saxpy) = find("saxpy").unwrap();
        let err = saxpy
            .check_arguments(&[RawArg::f32(1.0), RawArg::buffer(1)])
            .unwrap_err();
        assert_eq!(err, TaskError::ArgumentCount { expected: 3, got: 2 });
        let err = saxpy
            .check_arguments(&[RawArg::f32(1.0), RawArg::f32(2.0), RawArg::buffer(1)])
            .unwrap_err();
        assert_eq!(
            err,
            TaskError::ArgumentType {
                index: 1,
                expected: ArgTag::Buffer as u32,
                got: ArgTag::F32 as u32
            }
        );
        saxpy
            .check_arguments(&[RawArg::f32(1.0), RawArg::buffer(2), RawArg::buffer(1)])
            .unwrap();
    }
}
