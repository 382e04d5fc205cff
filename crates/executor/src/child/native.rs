//! C programs in the executor: a shared object with the C ABI of `agora_kernel.h`, written to a
//! memfd and loaded from `/proc/self/fd/N` (it never touches the file system), after a check
//! that it is a shared object for this machine.

use std::io::Write;

use agora_kernels::native::{AgoraKernelArg, AgoraKernelArgs, ABI_VERSION};
use agora_kernels::NativeCpuFn;
use agora_protocol::MAX_ARGS;

use crate::wire::Arg;

/// A loaded shared object and its kernels' functions, in the order asked for.
pub struct Library {
    functions: Vec<NativeCpuFn>,
    // Last: the functions point into it.
    _library: libloading::Library,
}

/// The ELF machine number of this build's architecture and its name.
fn this_machine() -> (u16, &'static str) {
    match std::env::consts::ARCH {
        "x86_64" => (62, "x86-64"),
        "aarch64" => (183, "AArch64"),
        "riscv64" => (243, "RISC-V"),
        "powerpc64" => (21, "PowerPC64"),
        other => (0, other),
    }
}

fn machine_name(machine: u16) -> String {
    match machine {
        3 => "x86 (32-bit)".into(),
        40 => "ARM (32-bit)".into(),
        62 => "x86-64".into(),
        183 => "AArch64".into(),
        243 => "RISC-V".into(),
        21 => "PowerPC64".into(),
        other => format!("machine {other}"),
    }
}

/// Checks that `bytes` are a 64-bit little-endian ELF shared object for this machine; the
/// error says what they are instead.
pub fn check_elf(bytes: &[u8]) -> Result<(), String> {
    if bytes.len() < 64 || &bytes[..4] != b"\x7fELF" {
        return Err("the code is not an ELF shared object (no ELF header): build it with `cc -shared -fPIC`".into());
    }
    if bytes[4] != 2 {
        return Err("the shared object is 32-bit; this node runs 64-bit code: build it for 64 bits".into());
    }
    if bytes[5] != 1 {
        return Err("the shared object is big-endian; this node is little-endian".into());
    }
    let e_type = u16::from_le_bytes([bytes[16], bytes[17]]);
    let machine = u16::from_le_bytes([bytes[18], bytes[19]]);
    let (ours, our_name) = this_machine();
    if machine != ours {
        return Err(format!(
            "the shared object is built for {}, but this node runs {our_name}: build it for {our_name}",
            machine_name(machine)
        ));
    }
    if e_type != 3 {
        let what = match e_type {
            1 => "a relocatable object (.o)",
            2 => "an executable",
            4 => "a core file",
            _ => "not a shared object",
        };
        return Err(format!(
            "the code is {what}, not a shared object: build it with `cc -shared -fPIC`"
        ));
    }
    Ok(())
}

/// The build error for a shared object the dynamic linker refused (`dlerror`'s text, which
/// starts with the memfd's path `path`, meaningless to the tenant).
fn load_error(reason: &str, path: &str) -> String {
    let reason = reason.replace(&format!("{path}: "), "");
    if reason.contains("undefined symbol") {
        format!(
            "the shared object could not be loaded: {reason}. Every symbol is bound when it loads: define the \
             function in the library, or link it (-l) with a library this node has"
        )
    } else {
        format!("the shared object could not be loaded: {reason}")
    }
}

impl Library {
    /// Loads `bytes`, binding every symbol now, and resolves `symbols`.
    pub fn load(bytes: &[u8], symbols: &[String]) -> Result<Library, String> {
        check_elf(bytes)?;
        let fd = rustix::fs::memfd_create("agora-program", rustix::fs::MemfdFlags::CLOEXEC)
            .map_err(|e| format!("memfd_create: {e}"))?;
        let mut file = std::fs::File::from(fd);
        file.write_all(bytes).map_err(|e| format!("writing the program: {e}"))?;
        let path = format!("/proc/self/fd/{}", std::os::fd::AsRawFd::as_raw_fd(&file));
        // RTLD_NOW binds every symbol here, so a function that nothing defines fails the build
        // naming it; with lazy binding (libloading's default) the build succeeded and the
        // dynamic linker ended the process (status 127) at the kernel's first call.
        // SAFETY: loading runs the object's initialisers: tenant code, which is why this runs in
        // the sandboxed executor and nowhere else.
        let library = unsafe {
            libloading::os::unix::Library::open(
                Some(&path),
                libloading::os::unix::RTLD_NOW | libloading::os::unix::RTLD_LOCAL,
            )
        }
        .map_err(|e| load_error(&e.to_string(), &path))?;
        let library = libloading::Library::from(library);
        drop(file);
        let mut functions = Vec::new();
        for symbol in symbols {
            // SAFETY: the manifest declares the symbol a kernel with the documented signature;
            // a tenant who lies about it crashes only this executor.
            let function = unsafe { library.get::<NativeCpuFn>(symbol.as_bytes()) }.map_err(|_| {
                format!(
                    "the shared object has no function `{symbol}` (named in the manifest); export it with C linkage"
                )
            })?;
            functions.push(*function);
        }
        Ok(Library {
            functions,
            _library: library,
        })
    }

    /// How many kernels it has.
    pub fn len(&self) -> usize {
        self.functions.len()
    }

    /// Whether it has none.
    pub fn is_empty(&self) -> bool {
        self.functions.is_empty()
    }

    /// Runs rows `rows` of kernel `index` over `range` with `args`, whose buffers lie in
    /// `segment`. `Ok(Err(code))`: the kernel ran and returned `code`, not 0.
    pub fn run(
        &self,
        index: u32,
        range: [u64; 3],
        rows: [u64; 2],
        args: &[Arg],
        segment: &super::Mapping,
    ) -> Result<Result<(), i32>, (i32, String)> {
        let function = self
            .functions
            .get(index as usize)
            .ok_or((-1, format!("no kernel {index}")))?;
        if args.len() > MAX_ARGS {
            return Err((-1, format!("{} arguments", args.len())));
        }
        let mut c_args = [AgoraKernelArg {
            data: std::ptr::null_mut(),
            len: 0,
            scalar: 0,
        }; MAX_ARGS];
        for (slot, arg) in c_args.iter_mut().zip(args) {
            match *arg {
                Arg::Buffer { offset, len } => {
                    let data = segment
                        .range(offset, len)
                        .ok_or_else(|| (-1, format!("{len} bytes at {offset} lie outside the segment")))?;
                    slot.data = data as *mut std::ffi::c_void;
                    slot.len = len;
                }
                Arg::Scalar(bits) => slot.scalar = bits,
            }
        }
        let call = AgoraKernelArgs {
            abi_version: ABI_VERSION,
            arg_count: args.len() as u32,
            range,
            args: c_args,
        };
        // SAFETY: tenant code with the C ABI of agora_kernel.h, in the sandbox; `call` lives
        // across the call and its buffers lie in the segment mapping.
        let code = unsafe { function(&call, rows[0], rows[1]) };
        Ok(if code == 0 { Ok(()) } else { Err(code) })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn header(class: u8, data: u8, e_type: u16, machine: u16) -> Vec<u8> {
        let mut bytes = vec![0u8; 64];
        bytes[..4].copy_from_slice(b"\x7fELF");
        bytes[4] = class;
        bytes[5] = data;
        bytes[16..18].copy_from_slice(&e_type.to_le_bytes());
        bytes[18..20].copy_from_slice(&machine.to_le_bytes());
        bytes
    }

    #[test]
    fn elf_headers_are_checked_and_refusals_say_why() {
        let (ours, name) = this_machine();
        check_elf(&header(2, 1, 3, ours)).unwrap();
        assert!(check_elf(b"#!/bin/sh\necho hi\n").unwrap_err().contains("not an ELF"));
        assert!(check_elf(&header(1, 1, 3, ours)).unwrap_err().contains("32-bit"));
        assert!(check_elf(&header(2, 2, 3, ours)).unwrap_err().contains("big-endian"));
        let other = if ours == 183 { 62 } else { 183 };
        let err = check_elf(&header(2, 1, 3, other)).unwrap_err();
        assert!(err.contains(&machine_name(other)) && err.contains(name), "{err}");
        assert!(check_elf(&header(2, 1, 1, ours)).unwrap_err().contains("relocatable"));
        assert!(check_elf(&header(2, 1, 2, ours)).unwrap_err().contains("executable"));
    }

    #[test]
    fn a_load_error_names_the_symbol_not_the_memfd() {
        let err = load_error(
            "/proc/self/fd/7: undefined symbol: not_defined_anywhere",
            "/proc/self/fd/7",
        );
        assert!(err.contains("undefined symbol: not_defined_anywhere"), "{err}");
        assert!(!err.contains("/proc/self/fd"), "{err}");
    }

    #[test]
    fn this_test_binary_is_not_a_shared_object_but_its_machine_matches() {
        let bytes = std::fs::read(std::env::current_exe().unwrap()).unwrap();
        // A PIE executable is ET_DYN too; either way the machine check passes.
        if let Err(e) = check_elf(&bytes) {
            assert!(!e.contains("built for"), "{e}");
        }
    }
}
