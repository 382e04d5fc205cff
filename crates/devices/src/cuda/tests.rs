//! Tests of the CUDA backend that need no GPU: every library kernel compiled by NVRTC and
//! assembled by ptxas (both from PyPI, installed into the project's virtual environment by
//! `scripts/setup.sh`), the calling convention, discovery without a driver.

use std::path::{Path, PathBuf};
use std::process::Command;

use super::programs::{self, Convention};

/// The project's virtual environment's `site-packages/nvidia` directory.
fn nvidia_dir() -> PathBuf {
    let venv = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../.venv/lib");
    let python = std::fs::read_dir(&venv)
        .ok()
        .and_then(|entries| {
            entries
                .flatten()
                .find(|e| e.file_name().to_string_lossy().starts_with("python"))
        })
        .unwrap_or_else(|| panic!("no Python in {}: run `bash scripts/setup.sh`", venv.display()));
    python.path().join("site-packages/nvidia")
}

/// Points NVRTC's loader at the environment's NVRTC, unless `AGORA_NVRTC` is set (never by
/// `set_var`: beside another test's ptxas spawn it can fail that spawn with EFAULT).
pub(crate) fn use_project_nvrtc() {
    // Set but empty counts as unset (a Makefile variable that found nothing).
    if std::env::var_os("AGORA_NVRTC").is_none_or(|v| v.is_empty()) {
        let lib = nvidia_dir().join("cuda_nvrtc/lib/libnvrtc.so.12");
        assert!(
            lib.exists(),
            "{} is missing: run `bash scripts/setup.sh` (it installs NVRTC from PyPI)",
            lib.display()
        );
        programs::use_nvrtc_at(lib);
    }
    assert!(programs::nvrtc_available(), "NVRTC does not load");
}

/// ptxas from the environment (`AGORA_PTXAS` overrides).
pub(crate) fn ptxas() -> PathBuf {
    if let Some(p) = std::env::var_os("AGORA_PTXAS").filter(|p| !p.is_empty()) {
        return PathBuf::from(p);
    }
    let p = nvidia_dir().join("cuda_nvcc/bin/ptxas");
    assert!(p.exists(), "{} is missing: run `bash scripts/setup.sh`", p.display());
    p
}

/// Assembles `ptx` for `sm_<arch>`; returns ptxas's error output on failure.
pub(crate) fn assemble(ptx: &str, arch: u32) -> Result<(), String> {
    // A file of its own per call: tests assemble in parallel, and nothing stays in $TMPDIR.
    static CALLS: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let call = CALLS.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let file = std::env::temp_dir().join(format!("agora-ptxas-{}-{call}-sm{arch}.ptx", std::process::id()));
    std::fs::write(&file, ptx).unwrap();
    let out = Command::new(ptxas())
        .arg(format!("-arch=sm_{arch}"))
        .arg("-o")
        .arg("/dev/null")
        .arg(&file)
        .output()
        .expect("ptxas runs");
    let _ = std::fs::remove_file(&file);
    if out.status.success() {
        Ok(())
    } else {
        Err(String::from_utf8_lossy(&out.stderr).into_owned())
    }
}

#[test]
fn every_library_program_compiles_with_nvrtc_and_assembles_for_sm80_and_sm90() {
    use_project_nvrtc();
    let library = programs::library_programs();
    assert!(library.len() >= 8, "{} programs", library.len());
    for imp in &library {
        for arch in [80, 90] {
            let ptx = programs::compile_ptx(&imp.program, &programs::cuda_source(&imp.source), arch)
                .unwrap_or_else(|e| panic!("{} for compute_{arch}: {e}", imp.program));
            // Every kernel of the program is an entry point of the PTX.
            for kernel in agora_kernels::library() {
                if let Some(k) = kernel.opencl.as_ref().filter(|k| k.program == imp.program) {
                    assert!(
                        ptx.contains(&format!(".entry {}(", k.entry)),
                        "{} has no entry {} for compute_{arch}",
                        imp.program,
                        k.entry
                    );
                }
            }
            assemble(&ptx, arch).unwrap_or_else(|e| panic!("{} for sm_{arch}: {e}", imp.program));
        }
    }
}

#[test]
fn a_guarded_kernel_takes_the_row_offset_after_its_revocation_flag() {
    use_project_nvrtc();
    let source = "__kernel void k(__global float *y, const ulong range0, const ulong range1, const ulong range2,\n \
                  __global const volatile uchar *revoke) { size_t i = get_global_id(0); if (i < range0) y[i] = 1.0f; }\n\
                  __kernel void plain(__global float *y) { y[get_global_id(0)] = 2.0f; }";
    assert_eq!(programs::convention(source, "k"), Convention::Guarded);
    assert_eq!(programs::convention(source, "plain"), Convention::Plain);
    let ptx = programs::compile_ptx("t", &programs::cuda_source(source), 80).unwrap();
    // y, range0..2, revoke, the row offset: six parameters; the plain kernel keeps its one.
    assert!(ptx.contains("k_param_5"), "{ptx}");
    assert!(!ptx.contains("k_param_6"), "{ptx}");
    assert!(ptx.contains("plain_param_0") && !ptx.contains("plain_param_1"), "{ptx}");
}

#[test]
fn a_program_that_does_not_compile_reports_nvrtc_s_log() {
    use_project_nvrtc();
    let e = programs::compile_ptx(
        "broken",
        &programs::cuda_source("__kernel void k() { undefined_thing(); }"),
        80,
    )
    .unwrap_err();
    assert!(e.log.contains("undefined_thing"), "{e}");
}

#[test]
fn discovery_without_a_gpu_reports_why_and_finds_nothing_or_finds_working_gpus() {
    let (devices, problems) = super::discover(2, 0, &crate::priority::LanePriorities::normal(), None);
    if devices.is_empty() {
        assert!(!problems.is_empty(), "no GPU and no reason given");
        assert!(problems.iter().any(|p| p.contains("GPU")), "{problems:?}");
    }
}

#[test]
fn tenant_programs_are_told_from_packages_and_the_library() {
    assert!(super::device::is_tenant_program("tenant/0123456789abcdef"));
    assert!(super::device::is_tenant_program("tenant-fenced/0123456789abcdef"));
    assert!(agora_kernels::runs_only_fenced("tenant-fenced/0123456789abcdef"));
    assert!(!agora_kernels::runs_only_fenced("tenant/0123456789abcdef"));
    assert!(!super::device::is_tenant_program("basic"));
    assert!(!super::device::is_tenant_program("imaging/blur.cl"));
}

#[test]
fn opencl_attributes_are_removed_and_everything_else_is_kept() {
    let source = "__attribute__((reqd_work_group_size(16, 16, 1)))\n__kernel void k(__global float *y,\n \
                  const ulong range0, const ulong range1, const ulong range2, __global const volatile uchar *revoke) {}";
    let cuda = programs::cuda_source(source);
    let body = &cuda[cuda.find("#line 1").unwrap()..];
    assert!(!body.contains("__attribute__"), "{body}");
    assert!(body.contains("__kernel void k(__global float *y"), "{body}");
    assert!(body.contains("uchar *revoke, const ulong agora_row_offset)"), "{body}");
    // An attribute it cannot parse is left for NVRTC to report, not silently dropped.
    assert!(programs::cuda_source("__attribute__ broken").contains("__attribute__ broken"));
}

#[test]
fn the_convention_is_read_from_the_entry_s_own_declaration() {
    use_project_nvrtc();
    let source = "void helper(uchar *revoke) {}\n\
                  __kernel void a(__global float *y) { helper(0); }\n\
                  __kernel void b(__global float *y, const ulong range0, const ulong range1, const ulong range2,\n\
                  __global const volatile uchar * revoke ) {}";
    assert_eq!(programs::convention(source, "a"), Convention::Plain);
    assert_eq!(programs::convention(source, "b"), Convention::Guarded);
    assert_eq!(programs::convention(source, "missing"), Convention::Plain);
    // The rewrite agrees with the convention: `b` gets the row offset however it is spaced; the
    // helper and `a` keep their parameters.
    let cuda = programs::cuda_source(source);
    assert!(
        cuda.contains("uchar * revoke, const ulong agora_row_offset )"),
        "{cuda}"
    );
    assert!(cuda.contains("void helper(uchar *revoke) {}"), "{cuda}");
    assert!(cuda.contains("void a(__global float *y)"), "{cuda}");
    programs::compile_ptx("spacing", &cuda, 80).unwrap();
}

#[test]
fn guarded_launches_round_up_to_whole_blocks_and_plain_ones_get_blocks_that_divide_them() {
    use super::launch_shape;
    // Guarded: 1000 rows in blocks of 256, the last block's extra threads stopped by the guard.
    assert_eq!(
        launch_shape([1000, 1, 1], 1, None, Convention::Guarded),
        ([4, 1, 1], [256, 1, 1])
    );
    // A kernel's required block shape (sgemm's 16 x 16).
    assert_eq!(
        launch_shape([33, 40, 1], 2, Some([16, 16, 1]), Convention::Guarded),
        ([3, 3, 1], [16, 16, 1])
    );
    // Plain: no guard, so blocks divide the extent exactly (1000 = 8 x 125).
    assert_eq!(
        launch_shape([1000, 1, 1], 1, None, Convention::Plain),
        ([125, 1, 1], [8, 1, 1])
    );
    assert_eq!(
        launch_shape([7, 48, 1], 2, None, Convention::Plain),
        ([7, 3, 1], [1, 16, 1])
    );
}

/// A hostile tenant kernel: stores, atomics and loads at addresses it computes from a scalar.
const HOSTILE_TENANT_KERNEL: &str = "__kernel void stray(__global float *out, const long delta, const long stride) {\n\
     size_t i = get_global_id(0);\n\
     __global float *p = out + delta + (long)i * stride;\n\
     *p = 13.0f;\n\
     atomic_add((__global int *)(p + 1), 7);\n\
     out[i] = p[2];\n\
 }\n\
 __kernel void named_revoke(__global float *y, __global const volatile uchar *revoke) { y[get_global_id(0)] = 1.0f; }";

#[test]
fn a_tenant_program_is_compiled_plain_then_fenced_and_assembles() {
    use_project_nvrtc();
    // Plain: a tenant parameter named like the library's revocation flag gets no row offset.
    let source = programs::plain_cuda_source(HOSTILE_TENANT_KERNEL);
    assert!(!source.contains("agora_row_offset,") && !source.contains(", const ulong agora_row_offset"));
    for arch in [80, 90] {
        let ptx = programs::compile_ptx("tenant-fenced/test", &source, arch).unwrap_or_else(|e| panic!("{e}"));
        assert!(
            ptx.contains("named_revoke_param_1") && !ptx.contains("named_revoke_param_2"),
            "{ptx}"
        );
        let fenced = super::fence::fence(&ptx).unwrap_or_else(|e| panic!("fencing a tenant kernel: {e}"));
        assert_eq!(fenced.entries, ["stray", "named_revoke"]);
        // The store, the atomic and the loads of `stray`, the store of `named_revoke`.
        assert!(
            fenced.fenced_accesses >= 4,
            "{} accesses fenced",
            fenced.fenced_accesses
        );
        super::fence::check_fenced(&fenced.ptx).unwrap_or_else(|e| panic!("the check refused the pass's output: {e}"));
        // The unfenced PTX does not pass the check: the loader relies on it.
        assert!(super::fence::check_fenced(&ptx).is_err());
        assemble(&fenced.ptx, arch).unwrap_or_else(|e| panic!("fenced tenant PTX for sm_{arch}: {e}"));
    }
}

#[test]
fn a_tenant_program_the_fence_cannot_cover_is_refused_saying_why() {
    use_project_nvrtc();
    let source = programs::plain_cuda_source("__kernel void talk(__global float *y) { printf(\"%f\\n\", y[0]); }");
    let ptx = programs::compile_ptx("tenant-fenced/printf", &source, 80).unwrap_or_else(|e| panic!("{e}"));
    let e = super::fence::fence(&ptx).unwrap_err().to_string();
    assert!(
        e.contains("printf") || e.contains("outside the module") || e.contains("body is not in the module"),
        "{e}"
    );
}

/// A tenant's CUDA C and PTX, as the clients' `program_cuda` / `program_ptx` send them (the
/// integration tests use the same files).
const TENANT_CUDA: &str = include_str!("../../../test-support/data/tenant.cu");
const TENANT_PTX: &str = include_str!("../../../test-support/data/tenant.ptx");

#[test]
fn tenant_cuda_c_compiles_plain_and_its_entries_take_exactly_their_declared_parameters() {
    use_project_nvrtc();
    for arch in [80, 90] {
        let ptx = programs::compile_ptx("tenant-fenced/cuda", TENANT_CUDA, arch).unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(super::fence::entry_parameter_count(&ptx, "saxpy"), Ok(Some(3)));
        assert_eq!(super::fence::entry_parameter_count(&ptx, "count"), Ok(Some(1)));
        assert_eq!(super::fence::entry_parameter_count(&ptx, "missing"), Ok(None));
        let fenced = super::fence::fence(&ptx).unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(fenced.entries, ["saxpy", "count"]);
        // After fencing, each entry takes the fence's four parameters too (base, mask, stop word, launch).
        assert_eq!(super::fence::entry_parameter_count(&fenced.ptx, "saxpy"), Ok(Some(7)));
        super::fence::check_fenced(&fenced.ptx).unwrap_or_else(|e| panic!("{e}"));
        assemble(&fenced.ptx, arch).unwrap_or_else(|e| panic!("fenced tenant CUDA C for sm_{arch}: {e}"));
    }
    // Without extern "C" the name is mangled: the entry the manifest names is not there.
    let mangled = programs::compile_ptx(
        "tenant-fenced/mangled",
        "__global__ void saxpy(float *y) { y[0] = 1.0f; }",
        80,
    )
    .unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(super::fence::entry_parameter_count(&mangled, "saxpy"), Ok(None));
}

#[test]
fn the_example_package_s_cuda_c_is_guarded_and_assembles() {
    use_project_nvrtc();
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../examples/packages/imaging");
    let source = std::fs::read_to_string(dir.join("imaging.cu")).expect("examples/packages/imaging/imaging.cu");
    for arch in [80, 90] {
        let ptx = programs::compile_ptx("imaging/imaging.cu", &source, arch).unwrap_or_else(|e| panic!("{e}"));
        // scale(a, x, y) and blur(w, h, src, dst), each + range0..2, the flag and the row offset.
        assert_eq!(
            super::fence::entry_parameter_count(&ptx, "imaging_scale_cuda"),
            Ok(Some(3 + 5))
        );
        assert_eq!(
            super::fence::entry_parameter_count(&ptx, "imaging_blur_cuda"),
            Ok(Some(4 + 5))
        );
        assemble(&ptx, arch).unwrap_or_else(|e| panic!("imaging.cu for sm_{arch}: {e}"));
    }
}

#[test]
fn a_gpu_runs_a_kernel_s_cuda_code_before_its_opencl_and_slices_only_guarded_kernels() {
    use agora_kernels::{CudaCode, CudaImpl};
    use std::borrow::Cow;
    let mut kernel = agora_kernels::find("saxpy").unwrap().1.clone();
    let code = programs::KernelCode::of(&kernel).unwrap();
    assert!(matches!(code, programs::KernelCode::OpenCl(_)));
    assert_eq!(
        code.convention(),
        Convention::Guarded,
        "the library's kernels are guarded"
    );
    let cuda = |program: &str, guarded: bool| CudaImpl {
        program: Cow::Owned(program.into()),
        code: CudaCode::Source(Cow::Borrowed(TENANT_CUDA)),
        entry: Cow::Borrowed("saxpy"),
        guarded,
    };
    kernel.cuda = Some(cuda("pkg/k.cu", true));
    let code = programs::KernelCode::of(&kernel).unwrap();
    assert!(matches!(code, programs::KernelCode::Cuda(_)));
    assert_eq!(
        (code.program(), code.entry(), code.local()),
        ("pkg/k.cu", "saxpy", None)
    );
    assert_eq!(code.convention(), Convention::Guarded);
    kernel.cuda = Some(cuda("pkg/k.cu", false));
    assert_eq!(
        programs::KernelCode::of(&kernel).unwrap().convention(),
        Convention::Plain
    );
    // A tenant's code is plain whatever it claims: it gets no flag nor row offset.
    kernel.cuda = Some(cuda("tenant-fenced/0011", true));
    assert_eq!(
        programs::KernelCode::of(&kernel).unwrap().convention(),
        Convention::Plain
    );
    // A tenant's chunkable OpenCL kernel compiled for a GPU is plain too.
    kernel.cuda = None;
    if let Some(opencl) = kernel.opencl.as_mut() {
        opencl.program = Cow::Borrowed("tenant/0011");
    }
    assert_eq!(
        programs::KernelCode::of(&kernel).unwrap().convention(),
        Convention::Plain
    );
}

#[test]
fn tenant_ptx_is_fenced_checked_and_assembles() {
    assert_eq!(
        super::fence::entry_parameter_count(TENANT_PTX, "fill_value"),
        Ok(Some(2))
    );
    let fenced = super::fence::fence(TENANT_PTX).unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(
        (fenced.entries.as_slice(), fenced.fenced_accesses),
        (&["fill_value".to_string()][..], 1)
    );
    super::fence::check_fenced(&fenced.ptx).unwrap_or_else(|e| panic!("{e}"));
    for arch in [80, 90] {
        assemble(TENANT_PTX, arch).unwrap_or_else(|e| panic!("tenant PTX for sm_{arch}: {e}"));
        assemble(&fenced.ptx, arch).unwrap_or_else(|e| panic!("fenced tenant PTX for sm_{arch}: {e}"));
    }
}

#[test]
fn an_endless_tenant_kernel_is_fenced_stoppable_and_assembles() {
    use_project_nvrtc();
    // Loops forever (a store per round, so it is not optimised away), as a hostile tenant's would.
    let endless = r#"extern "C" __global__ void endless(float *y) {
    unsigned long long i = blockIdx.x * (unsigned long long)blockDim.x + threadIdx.x;
    while (y[i] >= 0.0f) { y[i] += 1.0f; if (y[i] > 1.0e30f) y[i] = 0.0f; }
}"#;
    for arch in [80, 90] {
        let ptx = programs::compile_ptx("tenant-fenced/endless", endless, arch).unwrap_or_else(|e| panic!("{e}"));
        let fenced = super::fence::fence(&ptx).unwrap_or_else(|e| panic!("{e}"));
        assert!(
            fenced.ptx.contains("@%agora_fq exit;"),
            "no stop poll in {}",
            fenced.ptx
        );
        // y, then base, mask, the stop word's address and the launch's number.
        assert_eq!(super::fence::entry_parameter_count(&fenced.ptx, "endless"), Ok(Some(5)));
        super::fence::check_fenced(&fenced.ptx).unwrap_or_else(|e| panic!("{e}"));
        assemble(&fenced.ptx, arch).unwrap_or_else(|e| panic!("fenced endless kernel for sm_{arch}: {e}"));
    }
}
