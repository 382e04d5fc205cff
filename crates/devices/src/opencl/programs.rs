//! Programs and kernel objects of one OpenCL device: each program built at most once, at first
//! use, and cached; a program that fails to build reported once and refused from then on; kernel
//! objects created with the calling convention their parameters declare.
//!
//! Owns compilation only; it must not enqueue commands or cache kernel objects (they carry
//! argument state, so each lane keeps its own: see the executor).

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex};

use agora_kernels::OpenClImpl;
use agora_protocol::TaskError;
use opencl3::context::Context;
use opencl3::kernel::Kernel;
use opencl3::program::Program;

use super::cl_error;

/// The programs built for one device, and those that failed to build.
#[derive(Default)]
pub(super) struct Programs {
    built: Mutex<HashMap<String, Arc<Program>>>,
    broken: Mutex<HashSet<String>>,
}

impl Programs {
    /// The program of `imp` for `context` (the device named `device`), built now if it was not.
    pub(super) fn get(&self, context: &Context, device: &str, imp: &OpenClImpl) -> Result<Arc<Program>, TaskError> {
        if let Some(p) = self.built.lock().unwrap_or_else(|e| e.into_inner()).get(&*imp.program) {
            return Ok(p.clone());
        }
        if self.is_broken(&imp.program) {
            return Err(TaskError::DeviceFailed(-11));
        }
        // A binary the package ships for this device: loaded instead of compiled (a package
        // built ahead of time pays no compiler at all); one that does not load is reported once
        // and the source is compiled instead.
        let binary = if imp.binaries.is_empty() {
            None
        } else {
            let cl_name = context
                .devices()
                .first()
                .and_then(|id| opencl3::device::Device::new(*id).name().ok())
                .unwrap_or_default();
            imp.binaries.iter().find(|b| b.device == cl_name)
        };
        if let Some(binary) = binary {
            match from_binary(context, &binary.bytes) {
                Ok(program) => {
                    tracing::debug!(device = %device, program = %imp.program, "OpenCL program loaded from its binary");
                    let program = Arc::new(program);
                    self.built
                        .lock()
                        .unwrap_or_else(|e| e.into_inner())
                        .insert(imp.program.to_string(), program.clone());
                    return Ok(program);
                }
                Err(log) => {
                    tracing::warn!(device = %device, program = %imp.program, %log, "the package's OpenCL binary for this device does not load; compiling its source instead");
                }
            }
        }
        // Built outside the lock: a build takes up to a second; other programs need not wait.
        match Program::create_and_build_from_source(context, &imp.source, "-cl-std=CL1.2") {
            Ok(program) => {
                let program = Arc::new(program);
                self.built
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .insert(imp.program.to_string(), program.clone());
                Ok(program)
            }
            Err(log) => {
                tracing::error!(device = %device, program = %imp.program, %log, "OpenCL program failed to build; its kernels will run elsewhere");
                self.broken
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .insert(imp.program.to_string());
                Err(TaskError::DeviceFailed(-11)) // CL_BUILD_PROGRAM_FAILURE
            }
        }
    }

    /// Whether `program` failed to build (its kernels run elsewhere).
    pub(super) fn is_broken(&self, program: &str) -> bool {
        self.broken.lock().unwrap_or_else(|e| e.into_inner()).contains(program)
    }
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
            return Err(TaskError::DeviceFailed(-51)); // CL_INVALID_KERNEL_ARGS
        }
    };
    Ok((kernel, convention))
}

#[cfg(test)]
mod tests {
    use agora_protocol::ParamKind;

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
