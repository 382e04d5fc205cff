//! The C calling convention of CPU kernels that are not compiled into the daemon: a package's
//! shared object and a tenant program's shared object both export functions
//! `int f(const AgoraKernelArgs *args, uint64_t row_begin, uint64_t row_end)`, declared in
//! `crates/capi/include/agora_kernel.h` (installed by `make c`).
//!
//! The layout here and in the header must agree: `tests::header_matches` checks the header's
//! constants and field order against this file.
//!
//! Owns the layout only; it must not load libraries or run anything.

use std::ffi::c_void;

use agora_protocol::MAX_ARGS;

use crate::{ArgValue, KernelCall};

/// Version of the layout, in `AgoraKernelArgs::abi_version` (`AGORA_KERNEL_ABI_VERSION`).
pub const ABI_VERSION: u32 = 1;

/// One argument: a buffer's memory and byte length, or a scalar's bits.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct AgoraKernelArg {
    /// A buffer's first byte (64-byte aligned); null for scalars.
    pub data: *mut c_void,
    /// A buffer's length in bytes; 0 for scalars.
    pub len: u64,
    /// A scalar's bits (32-bit scalars in the low half); 0 for buffers.
    pub scalar: u64,
}

/// Everything a C kernel receives besides its rows.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct AgoraKernelArgs {
    /// [`ABI_VERSION`].
    pub abi_version: u32,
    /// Arguments in signature order.
    pub arg_count: u32,
    /// The launch's range per dimension (unused dimensions are 1).
    pub range: [u64; 3],
    /// `arg_count` entries are meaningful.
    pub args: [AgoraKernelArg; MAX_ARGS],
}

impl AgoraKernelArgs {
    /// The C view of `call`, whose kernel has `arg_count` parameters.
    pub fn of(call: &KernelCall<'_>, arg_count: usize) -> Self {
        let mut args = [AgoraKernelArg {
            data: std::ptr::null_mut(),
            len: 0,
            scalar: 0,
        }; MAX_ARGS];
        for (index, slot) in args.iter_mut().enumerate().take(arg_count.min(MAX_ARGS)) {
            match call.arg(index) {
                ArgValue::Buffer { ptr, len } => {
                    slot.data = ptr as *mut c_void;
                    slot.len = len;
                }
                ArgValue::Scalar(bits) => slot.scalar = bits,
                ArgValue::None => {}
            }
        }
        AgoraKernelArgs {
            abi_version: ABI_VERSION,
            arg_count: arg_count.min(MAX_ARGS) as u32,
            range: call.range(),
            args,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The header shipped with `make c` declares the same constants and fields in the same order.
    #[test]
    fn header_matches() {
        let header = include_str!("../../capi/include/agora_kernel.h");
        assert!(header.contains(&format!("#define AGORA_KERNEL_ABI_VERSION {ABI_VERSION}")));
        assert!(header.contains(&format!("#define AGORA_KERNEL_MAX_ARGS {MAX_ARGS}")));
        let args = header
            .find("typedef struct AgoraKernelArg {")
            .expect("AgoraKernelArg in the header");
        let body = &header[args..];
        let order = ["void *data;", "uint64_t len;", "uint64_t scalar;"];
        let mut at = 0;
        for field in order {
            at += body[at..]
                .find(field)
                .unwrap_or_else(|| panic!("{field} in AgoraKernelArg, in order"));
        }
        let kargs = header
            .find("typedef struct AgoraKernelArgs {")
            .expect("AgoraKernelArgs");
        let body = &header[kargs..];
        let order = [
            "uint32_t abi_version;",
            "uint32_t arg_count;",
            "uint64_t range[3];",
            "AgoraKernelArg args[AGORA_KERNEL_MAX_ARGS];",
        ];
        let mut at = 0;
        for field in order {
            at += body[at..]
                .find(field)
                .unwrap_or_else(|| panic!("{field} in AgoraKernelArgs, in order"));
        }
        assert_eq!(std::mem::size_of::<AgoraKernelArg>(), 24);
        assert_eq!(std::mem::size_of::<AgoraKernelArgs>(), 8 + 24 + 24 * MAX_ARGS);
    }
}
