//! OpenCL programs in the executor: its own context on the first CPU device (PoCL on this
//! project's machines), builds from source or from a cached binary, signatures from the kernel
//! argument info, and launches over the session's segment with `CL_MEM_USE_HOST_PTR` buffers
//! (zero copy on PoCL).

use std::ffi::c_void;

use agora_protocol::{Access, ParamKind, ParamSpec, ScalarType};
use opencl3::command_queue::CommandQueue;
use opencl3::context::Context;
use opencl3::device::{Device, CL_DEVICE_TYPE_ALL, CL_DEVICE_TYPE_CPU};
use opencl3::kernel::Kernel;
use opencl3::memory::{Buffer, ClMem, CL_MEM_READ_ONLY, CL_MEM_READ_WRITE, CL_MEM_USE_HOST_PTR};
use opencl3::program::Program;
use opencl3::types::{cl_device_id, CL_BLOCKING};

use crate::wire::{Arg, BuiltKernel, MAX_KERNELS};

/// Options every tenant program is built with (part of the program cache's key).
pub const BUILD_OPTIONS: &str = "-cl-std=CL1.2 -cl-kernel-arg-info";

/// Most bytes of a tenant OpenCL kernel's name: fewer than the protocol's
/// [`MAX_NAME`](agora_protocol::control::MAX_NAME) because PoCL keeps each compiled kernel in a
/// file `NAME.so`, and a file name has at most 255 bytes; a longer name made PoCL abort the
/// executor when it compiled the kernel (at the first request for the program's binary).
pub const MAX_KERNEL_NAME: usize = 252;

const _: () = assert!(MAX_KERNEL_NAME <= agora_protocol::control::MAX_NAME);

/// The build error of a source without kernels.
pub const NO_KERNEL: &str = "the source defines no kernel: declare at least one function __kernel void NAME(...), \
                             which is what a launch runs";

/// The executor's OpenCL context.
pub struct OpenCl {
    context: Context,
    queue: CommandQueue,
    device: cl_device_id,
    /// The device's name (part of the program cache's key).
    pub name: String,
}

/// A built program: its kernel objects with their parameters, in name order.
pub struct ClProgram {
    _program: Program,
    kernels: Vec<(Kernel, Vec<ParamSpec>)>,
}

/// A successful build.
pub struct ClBuild {
    /// The program.
    pub program: ClProgram,
    /// Its kernels as reported to the daemon.
    pub kernels: Vec<BuiltKernel>,
    /// The compiler's log.
    pub log: String,
    /// Its binary.
    pub binary: Option<Vec<u8>>,
    /// Whether the given binary was used.
    pub from_binary: bool,
}

impl OpenCl {
    /// The first CPU device of any platform (else the first device); `None` without one.
    pub fn init() -> Option<OpenCl> {
        let platforms = opencl3::platform::get_platforms().ok()?;
        let mut any = None;
        for platform in &platforms {
            if let Some(id) = platform
                .get_devices(CL_DEVICE_TYPE_CPU)
                .ok()
                .and_then(|d| d.first().copied())
            {
                any = Some(id);
                break;
            }
            if any.is_none() {
                any = platform
                    .get_devices(CL_DEVICE_TYPE_ALL)
                    .ok()
                    .and_then(|d| d.first().copied());
            }
        }
        let id = any?;
        let device = Device::new(id);
        let name = device.name().unwrap_or_else(|_| "unknown".into());
        let context = Context::from_device(&device).ok()?;
        #[allow(deprecated)] // clCreateCommandQueue: the OpenCL 1.2 call every platform has.
        let queue = CommandQueue::create_default(&context, 0).ok()?;
        Some(OpenCl {
            context,
            queue,
            device: id,
            name,
        })
    }

    /// Builds `source`, trying `binary` first; `Err(log)` when it does not build.
    pub fn build(&self, source: &str, binary: Option<&[u8]>) -> Result<ClBuild, String> {
        if let Some(binary) = binary {
            // A cached binary that fails in any way is ignored: the source decides.
            if let Ok(build) = self.build_from_binary(binary) {
                return Ok(build);
            }
        }
        // An empty string reaches clCreateProgramWithSource with length 0, which means "NUL
        // terminated": the platform then reads from Rust's dangling empty-slice pointer and the
        // executor dies with SIGSEGV. The daemon refuses empty sources first; this keeps the
        // executor safe on its own.
        if source.trim().is_empty() {
            return Err(NO_KERNEL.into());
        }
        let mut program = Program::create_from_source(&self.context, source)
            .map_err(|e| format!("the OpenCL platform refused the source: {e}"))?;
        if let Err(e) = program.build(&[self.device], BUILD_OPTIONS) {
            let log = program.get_build_log(self.device).unwrap_or_default();
            return Err(if log.trim().is_empty() {
                format!("the OpenCL compiler failed ({e}) without a log")
            } else {
                log
            });
        }
        let log = program.get_build_log(self.device).unwrap_or_default();
        // Before the binary: asking for it compiles every kernel (see MAX_KERNEL_NAME).
        check_kernel_names(&program)?;
        let (kernels, built) = self.kernels(&program)?;
        let binary = program
            .get_binaries()
            .ok()
            .and_then(|mut b| b.pop())
            .filter(|b| !b.is_empty());
        Ok(ClBuild {
            program: ClProgram {
                _program: program,
                kernels,
            },
            kernels: built,
            log,
            binary,
            from_binary: false,
        })
    }

    fn build_from_binary(&self, binary: &[u8]) -> Result<ClBuild, String> {
        // SAFETY: `self.device` belongs to `self.context`.
        let mut program = unsafe { Program::create_from_binary(&self.context, &[self.device], &[binary]) }
            .map_err(|e| e.to_string())?;
        program
            .build(&[self.device], BUILD_OPTIONS)
            .map_err(|e| e.to_string())?;
        check_kernel_names(&program)?;
        let (kernels, built) = self.kernels(&program)?;
        Ok(ClBuild {
            program: ClProgram {
                _program: program,
                kernels,
            },
            kernels: built,
            log: String::new(),
            binary: Some(binary.to_vec()),
            from_binary: true,
        })
    }

    /// The program's kernel objects with their parameters, in name order, and the same as
    /// reported to the daemon. Creating kernel objects compiles nothing on PoCL.
    #[allow(clippy::type_complexity)]
    fn kernels(&self, program: &Program) -> Result<(Vec<(Kernel, Vec<ParamSpec>)>, Vec<BuiltKernel>), String> {
        // clCreateKernelsInProgram fails with CL_INVALID_VALUE (not an empty list) when the
        // program has no kernel, so ask first.
        if program.get_num_kernels().is_ok_and(|n| n == 0) {
            return Err(NO_KERNEL.into());
        }
        let objects = opencl3::kernel::create_program_kernels(program)
            .map_err(|e| format!("creating the program's kernels: {e}"))?;
        if objects.is_empty() {
            return Err(NO_KERNEL.into());
        }
        if objects.len() > MAX_KERNELS {
            return Err(format!(
                "the program defines {} kernels; at most {MAX_KERNELS} are allowed",
                objects.len()
            ));
        }
        let mut kernels = Vec::new();
        for kernel in objects {
            let name = kernel.function_name().map_err(|e| format!("a kernel's name: {e}"))?;
            check_kernel_name(&name)?;
            let params = signature(&kernel, &name)?;
            self.check_local_memory(&kernel, &name)?;
            kernels.push((name, kernel, params));
        }
        kernels.sort_by(|a, b| a.0.cmp(&b.0));
        let built = kernels
            .iter()
            .map(|(name, _, params)| BuiltKernel {
                name: name.clone(),
                params: params.clone(),
            })
            .collect();
        Ok((kernels.into_iter().map(|(_, k, p)| (k, p)).collect(), built))
    }

    /// `Err` naming `name` when its `__local` arrays need more memory than a work-group of the
    /// device has: no launch of it could run, and PoCL asserts on the first one (the executor
    /// died with SIGABRT and the task read as a crash of the kernel's own making).
    fn check_local_memory(&self, kernel: &Kernel, name: &str) -> Result<(), String> {
        let Ok(available) = Device::new(self.device).local_mem_size() else {
            return Ok(());
        };
        match kernel.get_local_mem_size(self.device) {
            Ok(used) if used > available => Err(format!(
                "kernel {name}: its __local memory takes {used} bytes, and a work-group of the device ({}) has \
                 {available}: make its __local arrays smaller (tile the work)",
                self.name
            )),
            _ => Ok(()),
        }
    }

    /// Runs rows `rows` of kernel `index` of `program` over `range` with `args`, whose buffers
    /// lie in `segment`.
    #[allow(clippy::too_many_arguments)]
    pub fn run(
        &self,
        program: &ClProgram,
        index: u32,
        range: [u64; 3],
        dims: u8,
        rows: [u64; 2],
        args: &[Arg],
        segment: &super::Mapping,
    ) -> Result<(), (i32, String)> {
        let (kernel, params) = program
            .kernels
            .get(index as usize)
            .ok_or((-1, format!("no kernel {index}")))?;
        if args.len() != params.len() {
            return Err((-1, format!("{} arguments for {} parameters", args.len(), params.len())));
        }
        let mut buffers: Vec<(Buffer<u8>, u64, bool)> = Vec::new();
        for (slot, (arg, param)) in args.iter().zip(params).enumerate() {
            let slot = slot as u32;
            let set = match (*arg, param.kind) {
                (Arg::Buffer { offset, len }, ParamKind::Buffer { access, .. }) => {
                    let host = segment.range(offset, len).filter(|_| len > 0).ok_or_else(|| {
                        (
                            -1,
                            format!("argument {slot}: {len} bytes at {offset} lie outside the segment"),
                        )
                    })?;
                    let flags = CL_MEM_USE_HOST_PTR
                        | if access == Access::Read {
                            CL_MEM_READ_ONLY
                        } else {
                            CL_MEM_READ_WRITE
                        };
                    // SAFETY: `host` is `len` bytes of the segment mapping, which stays mapped
                    // for the executor's life; the buffer is released before this call returns.
                    let buffer =
                        unsafe { Buffer::<u8>::create(&self.context, flags, len as usize, host as *mut c_void) }
                            .map_err(|e| (e.0, format!("argument {slot}: creating a buffer: {e}")))?;
                    // SAFETY: a cl_mem for a __global pointer parameter.
                    let set = unsafe { kernel.set_arg(slot, &buffer.get()) };
                    buffers.push((buffer, len, access.writes()));
                    set
                }
                (Arg::Scalar(bits), ParamKind::Scalar(t)) => {
                    if t.size() == 4 {
                        // SAFETY: a 4-byte scalar for a 4-byte parameter.
                        unsafe { kernel.set_arg(slot, &(bits as u32)) }
                    } else {
                        // SAFETY: an 8-byte scalar for an 8-byte parameter.
                        unsafe { kernel.set_arg(slot, &bits) }
                    }
                }
                _ => return Err((-1, format!("argument {slot} does not match its parameter"))),
            };
            set.map_err(|e| (e.0, format!("argument {slot}: {e}")))?;
        }
        let dims = usize::from(dims.clamp(1, 3));
        if rows[1] <= rows[0] {
            return Ok(());
        }
        let offsets = [rows[0] as usize, 0, 0];
        let sizes = [(rows[1] - rows[0]) as usize, range[1] as usize, range[2] as usize];
        // A kernel that declares reqd_work_group_size (tiled kernels size their `__local` arrays
        // with it) gets exactly that local size (PoCL does not pick it by itself when given
        // none); any other gets the runtime's choice. Every dimension of the range must then be
        // a multiple of it, else OpenCL refuses the launch: checked here to say so in the log;
        // the task's message names CL_INVALID_WORK_GROUP_SIZE.
        let required = kernel
            .get_compile_work_group_size(self.device)
            .ok()
            .filter(|l| l.len() >= dims && l[..dims].iter().all(|&x| x > 0));
        if let Some(local) = &required {
            if let Some(dim) = (0..dims).find(|&d| !sizes[d].is_multiple_of(local[d])) {
                const CL_INVALID_WORK_GROUP_SIZE: i32 = -54;
                return Err((
                    CL_INVALID_WORK_GROUP_SIZE,
                    format!(
                        "the kernel requires work-groups of {:?} (reqd_work_group_size) but dimension {dim} of this \
                         launch is {}: launch a range whose dimensions are multiples of it",
                        &local[..dims],
                        sizes[dim]
                    ),
                ));
            }
        }
        // SAFETY: the kernel's arguments are set; offsets, sizes and the local size (when given)
        // hold at least `dims` entries.
        let event = unsafe {
            self.queue.enqueue_nd_range_kernel(
                kernel.get(),
                dims as u32,
                offsets.as_ptr(),
                sizes.as_ptr(),
                required.as_ref().map_or(std::ptr::null(), |l| l.as_ptr()),
                &[],
            )
        }
        .map_err(|e| (e.0, format!("launching the kernel: {e}")))?;
        event.wait().map_err(|e| (e.0, format!("running the kernel: {e}")))?;
        // Written buffers: a map makes the results visible in host memory even where the
        // platform kept a copy of its own (a no-op on PoCL's zero-copy buffers).
        for (buffer, len, written) in &buffers {
            if !written {
                continue;
            }
            let mut mapped: opencl3::types::cl_mem = std::ptr::null_mut();
            // SAFETY: a blocking map of the whole buffer, unmapped at once below.
            unsafe {
                self.queue.enqueue_map_buffer(
                    buffer,
                    CL_BLOCKING,
                    opencl3::memory::CL_MAP_READ,
                    0,
                    *len as usize,
                    &mut mapped,
                    &[],
                )
            }
            .map_err(|e| (e.0, format!("reading the results back: {e}")))?;
            // SAFETY: `mapped` was returned by the map of this buffer.
            unsafe { self.queue.enqueue_unmap_mem_object(buffer.get(), mapped, &[]) }
                .map_err(|e| (e.0, format!("reading the results back: {e}")))?;
        }
        self.queue
            .finish()
            .map_err(|e| (e.0, format!("finishing the launch: {e}")))?;
        Ok(())
    }
}

/// Checks the names of `program`'s kernels (from its metadata: nothing is compiled).
fn check_kernel_names(program: &Program) -> Result<(), String> {
    // A program without kernels: `kernels` says so (PoCL's list of no names is not empty, but
    // garbage).
    if program.get_num_kernels().map_or(true, |n| n == 0) {
        return Ok(());
    }
    let names = program.get_kernel_names().unwrap_or_default();
    names
        .split(';')
        .filter(|n| !n.is_empty())
        .try_for_each(check_kernel_name)
}

/// `Err` naming `name` (cut) unless it is an ASCII identifier of at most [`MAX_KERNEL_NAME`]
/// bytes: clang accepts identifiers with other Unicode letters, which Agora's kernel names
/// (C identifiers everywhere else) do not allow.
pub fn check_kernel_name(name: &str) -> Result<(), String> {
    const SHOWN: usize = 48;
    let shown = if name.chars().count() > SHOWN {
        format!(
            "{}… ({} bytes)",
            name.chars().take(SHOWN).collect::<String>(),
            name.len()
        )
    } else {
        name.to_string()
    };
    let identifier =
        name.chars().all(|c| c.is_ascii_alphanumeric() || c == '_') && !name.starts_with(|c: char| c.is_ascii_digit());
    if !identifier {
        return Err(format!(
            "kernel {shown}: kernel names must be ASCII identifiers (letters a-z and A-Z, digits, _); rename it"
        ));
    }
    if name.len() > MAX_KERNEL_NAME {
        return Err(format!(
            "kernel {shown}: a kernel's name may be at most {MAX_KERNEL_NAME} bytes (the OpenCL platform keeps each \
             compiled kernel in a file named after it); use a shorter name"
        ));
    }
    Ok(())
}

/// A kernel's parameters from its argument info.
fn signature(kernel: &Kernel, name: &str) -> Result<Vec<ParamSpec>, String> {
    use opencl3::kernel::{
        CL_KERNEL_ARG_ADDRESS_CONSTANT, CL_KERNEL_ARG_ADDRESS_GLOBAL, CL_KERNEL_ARG_ADDRESS_LOCAL,
        CL_KERNEL_ARG_ADDRESS_PRIVATE, CL_KERNEL_ARG_TYPE_CONST,
    };
    let count = kernel.num_args().map_err(|e| format!("kernel {name}: {e}"))?;
    if count as usize > agora_protocol::MAX_ARGS {
        return Err(format!(
            "kernel {name} takes {count} arguments; at most {} are allowed",
            agora_protocol::MAX_ARGS
        ));
    }
    let mut params = Vec::new();
    for index in 0..count {
        let info = |e: opencl3::error_codes::ClError| {
            format!("kernel {name}: argument {index} has no argument info ({e}); build with -cl-kernel-arg-info")
        };
        let address = kernel.get_arg_address_qualifier(index).map_err(info)?;
        let type_name = kernel.get_arg_type_name(index).map_err(info)?;
        let qualifier = kernel.get_arg_type_qualifier(index).map_err(info)?;
        let arg_name = kernel.get_arg_name(index).unwrap_or_else(|_| format!("arg{index}"));
        let unsupported = || {
            format!(
                "kernel {name}: argument {index} ({arg_name}) has type {type_name}, which Agora cannot pass: \
                 use int, uint, long, ulong, float or double scalars, and __global (or __constant) \
                 pointers to them"
            )
        };
        if address == CL_KERNEL_ARG_ADDRESS_LOCAL {
            // A launch passes buffers and scalars only: there is no way to give a __local
            // argument its size.
            return Err(format!(
                "kernel {name}: argument {index} ({arg_name}) is a __local pointer, and Agora does not pass \
                 local-memory arguments (a launch cannot size them): declare a fixed-size __local array inside \
                 the kernel instead (e.g. __local float {arg_name}[256];), or pass a __global buffer"
            ));
        }
        let kind = match address {
            CL_KERNEL_ARG_ADDRESS_GLOBAL | CL_KERNEL_ARG_ADDRESS_CONSTANT => {
                let element = type_name.trim().strip_suffix('*').ok_or_else(unsupported)?;
                let element = scalar_type(element).ok_or_else(unsupported)?;
                let read_only =
                    address == CL_KERNEL_ARG_ADDRESS_CONSTANT || qualifier & u64::from(CL_KERNEL_ARG_TYPE_CONST) != 0;
                ParamKind::Buffer {
                    element,
                    access: if read_only { Access::Read } else { Access::ReadWrite },
                }
            }
            CL_KERNEL_ARG_ADDRESS_PRIVATE => ParamKind::Scalar(scalar_type(&type_name).ok_or_else(unsupported)?),
            _ => return Err(unsupported()),
        };
        params.push(ParamSpec { name: arg_name, kind });
    }
    Ok(params)
}

/// The scalar type an OpenCL C type name denotes.
pub fn scalar_type(name: &str) -> Option<ScalarType> {
    Some(match name.trim() {
        "int" => ScalarType::I32,
        "uint" | "unsigned int" => ScalarType::U32,
        "long" => ScalarType::I64,
        "ulong" | "unsigned long" => ScalarType::U64,
        "float" => ScalarType::F32,
        "double" => ScalarType::F64,
        _ => return None,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Held while a test uses OpenCL. An executor builds from one thread, but the test harness
    /// runs tests on several: PoCL then built programs in several contexts of one process at
    /// once and crashed it (SIGSEGV, 22 of 40 runs of this binary with 12 test threads; CI saw
    /// one).
    static ONE_AT_A_TIME: std::sync::Mutex<()> = std::sync::Mutex::new(());

    /// The executor's OpenCL context with the lock that keeps other tests off OpenCL meanwhile,
    /// or `None` (the test is skipped) on a machine without an OpenCL platform.
    fn opencl() -> Option<(std::sync::MutexGuard<'static, ()>, OpenCl)> {
        let serial = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
        let Some(cl) = OpenCl::init() else {
            eprintln!("no OpenCL platform here: skipped");
            return None;
        };
        Some((serial, cl))
    }

    #[test]
    fn an_empty_source_or_one_without_kernels_says_it_defines_none() {
        let Some((_serial, cl)) = opencl() else { return };
        // An empty String (what the executor receives), unlike a literal "", has a dangling
        // pointer: it once reached the platform and crashed the process.
        for source in ["", " \n\t", "int f(int x) { return x; }"] {
            let err = cl
                .build(&String::from(source), None)
                .err()
                .expect("no kernel, no program");
            assert_eq!(err, NO_KERNEL, "{source:?}");
        }
    }

    #[test]
    fn kernel_names_are_ascii_identifiers_short_enough_for_a_file_name() {
        check_kernel_name("saxpy_2").unwrap();
        check_kernel_name(&"k".repeat(MAX_KERNEL_NAME)).unwrap();
        let err = check_kernel_name(&"k".repeat(MAX_KERNEL_NAME + 1)).unwrap_err();
        assert!(
            err.contains("at most 252 bytes") && err.contains("(253 bytes)"),
            "{err}"
        );
        let err = check_kernel_name("café").unwrap_err();
        assert!(
            err.contains("kernel café") && err.contains("ASCII identifiers"),
            "{err}"
        );
    }

    #[test]
    fn a_kernel_whose_local_arrays_exceed_the_device_fails_its_build() {
        let Some((_serial, cl)) = opencl() else { return };
        let available = Device::new(cl.device).local_mem_size().unwrap();
        let source = |floats: u64| {
            format!(
                "__kernel void big(__global float *x) {{ __local float t[{floats}]; t[get_local_id(0)] = x[0]; \
                 barrier(CLK_LOCAL_MEM_FENCE); x[get_global_id(0)] = t[0]; }}"
            )
        };
        let err = cl
            .build(&source(available / 4 * 2), None)
            .err()
            .expect("twice the device's local memory is refused");
        assert!(
            err.starts_with("kernel big: its __local memory takes") && err.contains(&available.to_string()),
            "{err}"
        );
        assert!(cl.build(&source(256), None).is_ok(), "a kilobyte fits");
    }

    #[test]
    fn a_local_memory_argument_is_named_as_such() {
        let Some((_serial, cl)) = opencl() else { return };
        let err = cl
            .build("__kernel void k(__global float *x, __local float *t) {}", None)
            .err()
            .expect("a __local argument is refused");
        assert!(
            err.starts_with("kernel k: argument 1 (t) is a __local pointer") && err.contains("inside the kernel"),
            "{err}"
        );
    }
}
