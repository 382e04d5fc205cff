//! Packages in temporary directories: good ones load and compute, bad ones are refused with the
//! file, line and key, size rules refuse small buffers.

use std::cell::Cell;
use std::path::Path;
use std::process::Command;
use std::sync::OnceLock;

use agora_kernels::{run_on_host, LaunchShape};
use agora_protocol::{Access, ParamKind, RawArg, ScalarType, TaskError};

use super::*;

const INCLUDE: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/../capi/include");

/// The manifest of the good package. Line numbers matter: the error tests edit it.
const GOOD: &str = r#"[package]
name = "demo"
version = "1.0"
library = "libdemo.so"

[kernels.scale]
doc = "y[i] = a*x[i]; range n"
params = ["a: f32", "x: f32 read", "y: f32 write"]
sizes = { x = "range0", y = "range0" }
chunkable = true
cost_ns_per_item = 2.0
opencl = { file = "demo.cl", entry = "scale", local = [64] }
cpu = { symbol = "scale_cpu" }

# A C-only kernel whose function fails.
[kernels.fail]
params = ["x: f32 readwrite"]
sizes = { x = "range0" }
cpu = { symbol = "fail_cpu" }
"#;

const DEMO_CL: &str = r#"// demo.cl
__kernel void scale(const float a, __global const float *x, __global float *y,
                    const ulong range0, const ulong range1, const ulong range2,
                    __global const volatile uchar *revoke) {
    size_t i = get_global_id(0);
    if (i >= range0 || *revoke) return;
    y[i] = a * x[i];
}
"#;

const DEMO_C: &str = r#"#include <agora_kernel.h>

AGORA_KERNEL int scale_cpu(const AgoraKernelArgs *args, uint64_t row_begin, uint64_t row_end) {
    float a = agora_f32(args, 0);
    const float *x = (const float *)args->args[1].data;
    float *y = (float *)args->args[2].data;
    for (uint64_t i = row_begin; i < row_end; i++) y[i] = a * x[i] + OFFSET;
    return 0;
}

AGORA_KERNEL int fail_cpu(const AgoraKernelArgs *args, uint64_t row_begin, uint64_t row_end) {
    (void)args; (void)row_begin; (void)row_end;
    return 7;
}
"#;

/// Compiles `c` (with `-DOFFSET=offset`) into `out`.
fn cc(c: &str, offset: &str, out: &Path) {
    let src = out.with_extension("c");
    std::fs::write(&src, c).unwrap();
    let status = Command::new("cc")
        .args(["-O2", "-shared", "-fPIC", "-I", INCLUDE])
        .arg(format!("-DOFFSET={offset}"))
        .arg("-o")
        .arg(out)
        .arg(&src)
        .status()
        .expect("cc runs");
    assert!(status.success(), "cc compiled {}", src.display());
}

/// The good package's shared object, compiled once.
fn demo_library() -> &'static [u8] {
    static LIB: OnceLock<Vec<u8>> = OnceLock::new();
    LIB.get_or_init(|| {
        let dir = tempfile::tempdir().unwrap();
        let out = dir.path().join("libdemo.so");
        cc(DEMO_C, "0.0f", &out);
        std::fs::read(&out).unwrap()
    })
}

/// A package directory with `manifest`, demo.cl and libdemo.so.
fn package(manifest: &str) -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join(MANIFEST), manifest).unwrap();
    std::fs::write(dir.path().join("demo.cl"), DEMO_CL).unwrap();
    std::fs::write(dir.path().join("libdemo.so"), demo_library()).unwrap();
    dir
}

fn run_scale(def: &KernelDef, a: f32, x: &[f32], threads: u64) -> Vec<f32> {
    let mut x = x.to_vec();
    let mut y = vec![0f32; x.len()];
    let mut buffers: Vec<&mut [u8]> = vec![bytemuck::cast_slice_mut(&mut x), bytemuck::cast_slice_mut(&mut y)];
    run_on_host(
        def,
        &[x_len(&buffers)],
        &[RawArg::f32(a), RawArg::buffer(0), RawArg::buffer(1)],
        &mut buffers,
        threads,
    )
    .unwrap();
    y
}

fn x_len(buffers: &[&mut [u8]]) -> u64 {
    buffers[0].len() as u64 / 4
}

fn kernel<'a>(package: &'a Package, name: &str) -> &'a PackageKernel {
    package.kernels.iter().find(|k| k.def.name == name).unwrap_or_else(|| {
        panic!(
            "{name} in {:?}",
            package.kernels.iter().map(|k| &k.def.name).collect::<Vec<_>>()
        )
    })
}

#[test]
fn a_good_package_loads_with_both_implementations_and_computes() {
    let dir = package(GOOD);
    let p = load(dir.path()).unwrap();
    assert_eq!(p.name, "demo");
    assert_eq!(p.version.as_deref(), Some("1.0"));
    assert_eq!(p.dir, dir.path());
    assert_eq!(p.kernels.len(), 2);
    assert_eq!(p.kernels[0].def.name, "demo.scale", "file order");
    let scale = kernel(&p, "demo.scale");
    assert_eq!(scale.implementations, vec!["opencl", "cpu"]);
    let def = &scale.def;
    assert_eq!(def.label(), "demo.scale", "a static name labels metrics");
    assert_eq!(def.doc, "y[i] = a*x[i]; range n");
    assert!(def.chunkable);
    assert_eq!(def.cost, Cost::PerItemNs(2.0));
    let kinds: Vec<(&str, ParamKind)> = def.params.iter().map(|p| (&*p.name, p.kind)).collect();
    assert_eq!(
        kinds,
        vec![
            ("a", ParamKind::Scalar(ScalarType::F32)),
            (
                "x",
                ParamKind::Buffer {
                    element: ScalarType::F32,
                    access: Access::Read
                }
            ),
            (
                "y",
                ParamKind::Buffer {
                    element: ScalarType::F32,
                    access: Access::Write
                }
            ),
        ]
    );
    let cl = def.opencl.as_ref().unwrap();
    assert_eq!(cl.entry, "scale");
    assert_eq!(cl.source, DEMO_CL);
    assert_eq!(cl.local, Some([64, 1, 1]));
    let hash: [u8; 32] = Sha256::digest(DEMO_CL.as_bytes()).into();
    assert_eq!(cl.program, format!("demo/demo.cl@{}", hex(&hash[..8])));
    assert!(matches!(def.cpu, Some(CpuImpl::Native(_, Some(_)))));

    let x: Vec<f32> = (0..1000).map(|i| i as f32 * 0.5).collect();
    for threads in [1, 3] {
        let y = run_scale(def, 3.0, &x, threads);
        assert!(y.iter().zip(&x).all(|(y, x)| *y == 3.0 * x), "{threads} threads");
    }

    let fail = kernel(&p, "demo.fail");
    assert_eq!(fail.implementations, vec!["cpu"]);
    assert!(!fail.def.chunkable, "not chunkable by default");
    assert_eq!(fail.def.cost, Cost::PerItemNs(10.0));
    assert_eq!(fail.def.doc, "");
    let mut x = vec![1f32; 8];
    let mut buffers: Vec<&mut [u8]> = vec![bytemuck::cast_slice_mut(&mut x)];
    let err = run_on_host(&fail.def, &[8], &[RawArg::buffer(0)], &mut buffers, 1).unwrap_err();
    assert_eq!(err, TaskError::KernelFault, "a non-zero return fails the task");
}

#[test]
fn the_library_stays_loaded_while_a_definition_lives() {
    let dir = package(GOOD);
    let def = {
        let p = load(dir.path()).unwrap();
        kernel(&p, "demo.scale").def.clone()
    };
    drop(dir);
    let y = run_scale(&def, 2.0, &[1.0, 2.0, 3.0], 1);
    assert_eq!(y, vec![2.0, 4.0, 6.0]);
}

#[test]
fn a_rebuilt_library_is_loaded_again() {
    let dir = package(GOOD);
    let old = load(dir.path()).unwrap();
    // Rebuilt in place (same path, same inode) while the old version is in use.
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("libdemo.so");
    cc(DEMO_C, "1.0f", &out);
    std::fs::write(dir.path().join("libdemo.so"), std::fs::read(&out).unwrap()).unwrap();
    let new = load(dir.path()).unwrap();
    let (old_scale, new_scale) = (kernel(&old, "demo.scale"), kernel(&new, "demo.scale"));
    assert_ne!(old_scale.fingerprint, new_scale.fingerprint);
    assert_eq!(run_scale(&new_scale.def, 2.0, &[1.0, 2.0], 1), vec![3.0, 5.0]);
    assert_eq!(run_scale(&old_scale.def, 2.0, &[1.0, 2.0], 1), vec![2.0, 4.0]);
    // The unchanged library loaded twice is shared.
    let again = load(dir.path()).unwrap();
    assert_eq!(kernel(&again, "demo.scale").fingerprint, new_scale.fingerprint);
}

#[test]
fn the_fingerprint_changes_with_the_source_and_not_otherwise() {
    let dir = package(GOOD);
    let first = load(dir.path()).unwrap();
    let again = load(dir.path()).unwrap();
    for (a, b) in first.kernels.iter().zip(&again.kernels) {
        assert_eq!(a.fingerprint, b.fingerprint, "{}: nothing changed", a.def.name);
    }
    std::fs::write(dir.path().join("demo.cl"), format!("{DEMO_CL}\n// edited\n")).unwrap();
    let edited = load(dir.path()).unwrap();
    assert_ne!(
        kernel(&first, "demo.scale").fingerprint,
        kernel(&edited, "demo.scale").fingerprint,
        "the .cl changed"
    );
    assert_ne!(
        kernel(&first, "demo.scale").def.opencl.as_ref().unwrap().program,
        kernel(&edited, "demo.scale").def.opencl.as_ref().unwrap().program,
        "a changed source gets a new program key"
    );
    assert_eq!(
        kernel(&first, "demo.fail").fingerprint,
        kernel(&edited, "demo.fail").fingerprint,
        "a kernel without OpenCL is unaffected"
    );
    // Comments and layout of the manifest do not matter; what it says does.
    std::fs::write(dir.path().join("demo.cl"), DEMO_CL).unwrap();
    std::fs::write(
        dir.path().join(MANIFEST),
        GOOD.replace("# A C-only", "\n\n# Still a C-only"),
    )
    .unwrap();
    let reformatted = load(dir.path()).unwrap();
    for (a, b) in first.kernels.iter().zip(&reformatted.kernels) {
        assert_eq!(a.fingerprint, b.fingerprint, "{}: only comments changed", a.def.name);
    }
    std::fs::write(
        dir.path().join(MANIFEST),
        GOOD.replace("\"range0\" }\ncpu", "\"range0 + 1\" }\ncpu"),
    )
    .unwrap();
    let resized = load(dir.path()).unwrap();
    assert_ne!(
        kernel(&first, "demo.fail").fingerprint,
        kernel(&resized, "demo.fail").fingerprint
    );
    assert_eq!(
        kernel(&first, "demo.scale").fingerprint,
        kernel(&resized, "demo.scale").fingerprint
    );
}

/// Loads `manifest` (with demo.cl and libdemo.so beside it) and returns the error's message,
/// checking that it names the manifest file, `line` and `key`.
fn refused(manifest: &str, line: usize, key: &str, fragment: &str) {
    let dir = package(manifest);
    refused_in(dir.path(), line, key, fragment);
}

fn refused_in(dir: &Path, line: usize, key: &str, fragment: &str) {
    let err = load(dir).unwrap_err();
    let message = err.to_string();
    let file = dir.join(MANIFEST).display().to_string();
    match &err {
        PackageError::Manifest {
            file: f,
            line: l,
            key: k,
            message: m,
        } => {
            assert_eq!((f.as_str(), *l, k.as_str()), (file.as_str(), line, key), "{message}");
            assert!(m.contains(fragment), "`{fragment}` in: {message}");
        }
        other => panic!("a manifest error, not {other:?}"),
    }
    assert!(
        message.starts_with(&format!("{file}:{line}: {key}: ")),
        "file, line and key first: {message}"
    );
}

#[test]
fn bad_manifests_are_refused_naming_file_line_and_key() {
    let edit = |from: &str, to: &str| {
        assert!(GOOD.contains(from), "{from}");
        GOOD.replacen(from, to, 1)
    };
    refused(
        &edit("chunkable = true", "chunkable = true\ncolour = 1"),
        11,
        "kernels.scale.colour",
        "unknown key `colour`",
    );
    refused(
        &edit("version = \"1.0\"", "author = \"me\""),
        3,
        "package.author",
        "unknown key",
    );
    refused(&edit("[package]", "[pakage]"), 1, "pakage", "unknown key");
    refused(
        &edit("chunkable = true", "chunkable = \"yes\""),
        10,
        "kernels.scale.chunkable",
        "must be true or false, not the string",
    );
    refused(
        &edit("chunkable = true", "dims = \"2\""),
        10,
        "kernels.scale.dims",
        "must be an integer",
    );
    refused(
        &edit("chunkable = true", "dims = 4"),
        10,
        "kernels.scale.dims",
        "must be 1, 2 or 3",
    );
    refused(
        &edit("cost_ns_per_item = 2.0", "cost_ns_per_item = -1"),
        11,
        "kernels.scale.cost_ns_per_item",
        "positive",
    );
    refused(
        &edit("\"a: f32\"", "\"a: f16\""),
        8,
        "kernels.scale.params[0]",
        "unknown scalar type `f16`",
    );
    refused(
        &edit("\"x: f32 read\"", "\"x: f32 sideways\""),
        8,
        "kernels.scale.params[1]",
        "unknown access `sideways`",
    );
    refused(
        &edit("\"a: f32\"", "\"a f32\""),
        8,
        "kernels.scale.params[0]",
        "is not a parameter",
    );
    refused(
        &edit("\"a: f32\"", "\"x: f32\""),
        8,
        "kernels.scale.params[1]",
        "declared twice",
    );
    refused(
        &edit("\"a: f32\"", "\"len_a: f32\""),
        8,
        "kernels.scale.params[0]",
        "reserved",
    );
    refused(
        &edit("\"a: f32\"", "\"2a: f32\""),
        8,
        "kernels.scale.params[0]",
        "not an identifier",
    );
    refused(
        &edit("params = [", "params = 3\n#["),
        8,
        "kernels.scale.params",
        "must be an array",
    );
    refused(
        &edit("x = \"range0\"", "x = \"range0 +\""),
        9,
        "kernels.scale.sizes.x",
        "does not parse",
    );
    refused(
        &edit("x = \"range0\"", "x = \"n\""),
        9,
        "kernels.scale.sizes.x",
        "`n`, which is not a variable here (variables: range0, a, len_x, len_y)",
    );
    refused(
        &edit("x = \"range0\"", "x = \"range1\""),
        9,
        "kernels.scale.sizes.x",
        "`range1`, which is not a variable",
    );
    refused(
        &edit("x = \"range0\"", "x = \"range0 > 1\""),
        9,
        "kernels.scale.sizes.x",
        "a number is needed",
    );
    refused(
        &edit("x = \"range0\"", "x = \"str::trim(a)\""),
        9,
        "kernels.scale.sizes.x",
        "not a known function",
    );
    refused(
        &edit("x = \"range0\"", "x = 5"),
        9,
        "kernels.scale.sizes.x",
        "must be a string",
    );
    refused(
        &edit("y = \"range0\" }", "y = \"range0\", z = \"1\" }"),
        9,
        "kernels.scale.sizes.z",
        "`z`, which is not a parameter",
    );
    refused(
        &edit("y = \"range0\" }", "y = \"range0\", a = \"1\" }"),
        9,
        "kernels.scale.sizes.a",
        "`a` is a scalar",
    );
    refused(
        &edit(", y = \"range0\" }", " }"),
        9,
        "kernels.scale.sizes",
        "buffer `y` has no size rule",
    );
    refused(
        &edit("sizes = { x = \"range0\", y = \"range0\" }\n", ""),
        6,
        "kernels.scale.sizes",
        "buffer `x` has no size rule",
    );
    refused(
        &edit("chunkable = true", "require = [\"a\"]"),
        10,
        "kernels.scale.require[0]",
        "a condition (true or false) is needed",
    );
    refused(
        &edit("chunkable = true", "range = [\"1\", \"2\"]"),
        10,
        "kernels.scale.range",
        "2 extents for a kernel of 1 dimension",
    );
    refused(
        &edit(
            "opencl = { file = \"demo.cl\", entry = \"scale\", local = [64] }\ncpu = { symbol = \"scale_cpu\" }\n",
            "",
        ),
        6,
        "kernels.scale",
        "has no implementation",
    );
    refused(
        &edit("file = \"demo.cl\"", "file = \"nope.cl\""),
        12,
        "kernels.scale.opencl.file",
        "cannot read",
    );
    refused(
        &edit("entry = \"scale\"", "entry = \"scal\""),
        12,
        "kernels.scale.opencl.entry",
        "has no `__kernel void scal(`",
    );
    refused(
        &edit("scale\", local", "scaled\", local").replace("[kernels.scale]", "[kernels.scaled]"),
        12,
        "kernels.scaled.opencl.entry",
        "has no `__kernel void scaled(`",
    );
    refused(
        &edit("local = [64]", "local = [0]"),
        12,
        "kernels.scale.opencl.local[0]",
        "1 to 1024",
    );
    refused(
        &edit("local = [64]", "locale = [64]"),
        12,
        "kernels.scale.opencl.locale",
        "unknown key",
    );
    refused(
        &edit("library = \"libdemo.so\"\n", ""),
        12,
        "kernels.scale.cpu",
        "add `library = ",
    );
    refused(
        &edit("library = \"libdemo.so\"", "library = \"libnope.so\""),
        4,
        "package.library",
        "cannot read",
    );
    refused(
        &edit("symbol = \"scale_cpu\"", "symbol = \"nope\""),
        13,
        "kernels.scale.cpu.symbol",
        "has no symbol `nope`",
    );
    refused(
        &edit("name = \"demo\"", "name = \"Demo\""),
        2,
        "package.name",
        "a-z, 0-9 and _",
    );
    refused(&edit("name = \"demo\"\n", ""), 1, "package.name", "`name` is missing");
    refused(
        &GOOD.replace(
            "[package]\nname = \"demo\"\nversion = \"1.0\"\nlibrary = \"libdemo.so\"\n",
            "",
        ),
        1,
        "package",
        "[package] table is missing",
    );
    refused(&edit("chunkable = true", "chunkable = "), 10, "chunkable", "");
    refused(
        &format!("{GOOD}\n[kernels.scale]\ndoc = \"again\"\n"),
        21,
        "kernels.scale",
        "defined twice",
    );
    refused("[package]\nname = \"demo\"\n", 1, "kernels", "defines no kernel");
    let many: Vec<String> = (0..17).map(|i| format!("\"s{i}: i32\"")).collect();
    refused(
        &edit(
            "[\"a: f32\", \"x: f32 read\", \"y: f32 write\"]",
            &format!("[{}]", many.join(", ")),
        ),
        8,
        "kernels.scale.params",
        "17 parameters; a kernel takes at most 16",
    );
    let long = "k".repeat(300);
    refused(
        &edit("[kernels.scale]", &format!("[kernels.{long}]")),
        6,
        &format!("kernels.{long}"),
        "300 bytes long; at most 256",
    );
    refused(
        &edit("\"a: f32\"", &format!("\"{long}: f32\"")),
        8,
        "kernels.scale.params[0]",
        "at most 256",
    );
    refused(
        &edit(
            "doc = \"y[i] = a*x[i]; range n\"",
            &format!("doc = \"{}\"", "d".repeat(5000)),
        ),
        7,
        "kernels.scale.doc",
        "5000 bytes long; at most 4096",
    );
}

#[test]
fn a_shared_object_for_another_machine_is_named_as_such() {
    let dir = package(GOOD);
    let mut bytes = demo_library().to_vec();
    let (other, name) = if std::env::consts::ARCH == "aarch64" {
        (62u16, "x86_64")
    } else {
        (183u16, "aarch64")
    };
    bytes[18..20].copy_from_slice(&other.to_le_bytes());
    std::fs::write(dir.path().join("libdemo.so"), &bytes).unwrap();
    refused_in(
        dir.path(),
        4,
        "package.library",
        &format!("was built for {name}, this daemon runs on {}", std::env::consts::ARCH),
    );
    std::fs::write(dir.path().join("libdemo.so"), "not a library").unwrap();
    refused_in(dir.path(), 4, "package.library", "is not an ELF shared object");
}

/// A spec of `kernel` from a program manifest.
fn spec(manifest: &str) -> KernelSpec {
    program_manifest(manifest, "test.toml").unwrap().remove(0)
}

/// Runs `spec`'s check; returns its result and the bytes it recorded per argument.
fn check(spec: &KernelSpec, range: &[u64], scalars: &[u64], lens: &[u64]) -> (Result<(), TaskError>, Vec<u64>) {
    let needed = vec![Cell::new(0u64); lens.len()];
    let shape = LaunchShape {
        range,
        scalars,
        buffer_lens: lens,
        needed: &needed,
        overwritten: &[],
    };
    let SizeCheck::Rules(rules) = &spec.check else {
        panic!("rules")
    };
    let result = rules.check(&shape);
    (result, needed.iter().map(Cell::get).collect())
}

#[test]
fn size_rules_refuse_small_buffers_with_byte_counts() {
    let scale = spec(
        r#"[kernels.scale]
params = ["a: f32", "x: f32 read", "y: f64 write"]
sizes = { x = "range0", y = "range0 + 1" }
"#,
    );
    let a = u64::from(2f32.to_bits());
    assert_eq!(
        check(&scale, &[100], &[a, 0, 0], &[0, 400, 808]),
        (Ok(()), vec![0, 400, 808])
    );
    assert_eq!(
        check(&scale, &[100], &[a, 0, 0], &[0, 399, 808]).0,
        Err(TaskError::BufferTooSmall {
            index: 1,
            needed: 400,
            len: 399
        })
    );
    assert_eq!(
        check(&scale, &[100], &[a, 0, 0], &[0, 400, 807]),
        (
            Err(TaskError::BufferTooSmall {
                index: 2,
                needed: 808,
                len: 807
            }),
            vec![0, 400, 808]
        )
    );
    // A 1-D kernel refuses a second dimension, naming the range it must have.
    assert_eq!(
        check(&scale, &[100, 2], &[a, 0, 0], &[0, 800, 1608]).0,
        Err(TaskError::RangeMismatch {
            expected_x: 100,
            expected_y: 1,
            got_x: 100,
            got_y: 2,
            got_z: 1
        })
    );
    check(&scale, &[100, 1, 1], &[a, 0, 0], &[0, 400, 808]).0.unwrap();
}

#[test]
fn requirements_and_ranges_give_typed_errors() {
    let blur = spec(
        r#"[kernels.blur]
params = ["w: i32", "h: i32", "src: f32 read", "dst: f32 write"]
dims = 2
range = ["h", "w"]
require = ["w > 0", "h > 0"]
sizes = { src = "w * h", dst = "len_src" }
"#,
    );
    assert_eq!(blur.dims, 2);
    let i = |v: i32| u64::from(v as u32);
    assert_eq!(
        check(&blur, &[4, 5], &[i(5), i(4), 0, 0], &[0, 0, 80, 80]),
        (Ok(()), vec![0, 0, 80, 80])
    );
    assert_eq!(
        check(&blur, &[4, 5], &[i(5), i(4), 0, 0], &[0, 0, 84, 80]),
        (
            Err(TaskError::BufferTooSmall {
                index: 3,
                needed: 84,
                len: 80
            }),
            vec![0, 0, 80, 84]
        ),
        "dst is as long as src (len_src)"
    );
    assert_eq!(
        check(&blur, &[5, 4], &[i(5), i(4), 0, 0], &[0, 0, 80, 80]).0,
        Err(TaskError::RangeMismatch {
            expected_x: 4,
            expected_y: 5,
            got_x: 5,
            got_y: 4,
            got_z: 1
        })
    );
    assert_eq!(
        check(&blur, &[4, 5], &[i(-1), i(4), 0, 0], &[0, 0, 80, 80]).0,
        Err(TaskError::InvalidScalar { index: 0, value: -1 })
    );
    assert_eq!(
        check(&blur, &[4, 5], &[i(5), i(0), 0, 0], &[0, 0, 80, 80]).0,
        Err(TaskError::InvalidScalar { index: 1, value: 0 })
    );

    // Overflow, negative counts, fractions and huge u64 scalars are errors, never panics.
    let odd = spec(
        r#"[kernels.odd]
params = ["n: i64", "m: u64", "f: f64", "x: f32 read"]
sizes = { x = "if(f > 0.0, n * n * n * n, n - 10) + m * 0 + f * 0" }
"#,
    );
    let f = |v: f64| v.to_bits();
    assert_eq!(
        check(&odd, &[1], &[1 << 20, 0, f(1.0), 0], &[0, 0, 0, 4]).0,
        Err(TaskError::InvalidScalar {
            index: 0,
            value: 1 << 20
        }),
        "overflow blames the first scalar"
    );
    assert_eq!(
        check(&odd, &[1], &[3, 0, f(-1.0), 0], &[0, 0, 0, 4]).0,
        Err(TaskError::InvalidScalar { index: 0, value: 3 }),
        "negative"
    );
    assert_eq!(
        check(&odd, &[1], &[3, u64::MAX, f(1.0), 0], &[0, 0, 0, 400]).0,
        Err(TaskError::InvalidScalar { index: 1, value: -1 }),
        "a u64 beyond i64"
    );
    let frac = spec(
        r#"[kernels.frac]
params = ["f: f32", "x: f32 read"]
sizes = { x = "f * range0" }
"#,
    );
    assert_eq!(
        check(&frac, &[3], &[u64::from(0.5f32.to_bits()), 0], &[0, 400]).0,
        Err(TaskError::InvalidScalar { index: 0, value: 0 }),
        "1.5 elements"
    );
    check(&frac, &[4], &[u64::from(0.5f32.to_bits()), 0], &[0, 8])
        .0
        .unwrap();
    // A requirement on the range alone blames the range.
    let aligned = spec(
        r#"[kernels.aligned]
params = ["x: f32 read"]
require = ["range0 % 4 == 0", "len_x >= range0"]
sizes = { x = "range0" }
"#,
    );
    check(&aligned, &[8], &[0], &[32]).0.unwrap();
    assert_eq!(
        check(&aligned, &[6], &[0], &[32]).0,
        Err(TaskError::InvalidRange {
            items: 6,
            max: u64::MAX
        })
    );
}

#[test]
fn program_manifests_have_no_package_and_no_files() {
    let specs = program_manifest(
        r#"# a tenant's program
[kernels.saxpy]
doc = "y = a*x + y; range n"
params = ["a: f32", "x: f32 read", "y: f32 readwrite"]
sizes = { x = "range0", y = "range0" }
chunkable = true
cost_ns_per_item = 1
cpu = { symbol = "my_saxpy" }

[kernels.tile]
params = ["n: u32", "m: f32 write"]
dims = 2
sizes = { m = "n * n" }
opencl = { local = [8, 8] }
cpu = {}

[kernels.plain]
params = ["x: i32 read"]
sizes = { x = "range0" }
"#,
        "tenant.so",
    )
    .unwrap();
    let names: Vec<&str> = specs.iter().map(|s| s.name.as_str()).collect();
    assert_eq!(names, vec!["saxpy", "tile", "plain"]);
    let saxpy = &specs[0];
    assert_eq!(saxpy.doc, "y = a*x + y; range n");
    assert!(saxpy.chunkable);
    assert_eq!(saxpy.cost, Cost::PerItemNs(1.0));
    assert_eq!(saxpy.cpu_symbol.as_deref(), Some("my_saxpy"));
    assert_eq!(saxpy.opencl_entry, None);
    assert!(
        matches!(saxpy.params[1].name, Cow::Owned(_)),
        "tenant names are not leaked"
    );
    assert_eq!(saxpy.dims, 1);
    let tile = &specs[1];
    assert_eq!(
        tile.opencl_entry.as_deref(),
        Some("tile"),
        "the entry defaults to the kernel's name"
    );
    assert_eq!(tile.opencl_local, Some([8, 8, 1]));
    assert_eq!(
        tile.cpu_symbol.as_deref(),
        Some("tile"),
        "the symbol defaults to the kernel's name"
    );
    assert!(!tile.chunkable);
    assert_eq!(
        (specs[2].cpu_symbol.as_ref(), specs[2].opencl_entry.as_ref()),
        (None, None)
    );

    let err = program_manifest("[package]\nname = \"x\"\n", "tenant.so").unwrap_err();
    assert!(err.to_string().starts_with("tenant.so:1: package: "), "{err}");
    let err = program_manifest(
        "[kernels.k]\nparams = [\"x: f32 read\"]\nsizes = { x = \"range0\" }\nopencl = { file = \"k.cl\" }\n",
        "tenant.so",
    )
    .unwrap_err();
    assert!(
        err.to_string()
            .starts_with("tenant.so:4: kernels.k.opencl.file: unknown key"),
        "{err}"
    );
    let err = program_manifest("[kernels.k]\nparams = [\"x: f32 read\"]\n", "tenant.so").unwrap_err();
    assert!(
        err.to_string()
            .starts_with("tenant.so:1: kernels.k.sizes: buffer `x` has no size rule"),
        "{err}"
    );
}

#[test]
fn discover_finds_packages_in_a_directory_sorted() {
    let root = tempfile::tempdir().unwrap();
    for name in ["zeta", "alpha", "middle"] {
        std::fs::create_dir(root.path().join(name)).unwrap();
        if name != "middle" {
            std::fs::write(root.path().join(name).join(MANIFEST), "").unwrap();
        }
    }
    std::fs::write(root.path().join("README"), "not a package").unwrap();
    assert_eq!(
        discover(root.path()).unwrap(),
        vec![root.path().join("alpha"), root.path().join("zeta")]
    );
    assert_eq!(
        discover(&root.path().join("zeta")).unwrap(),
        vec![root.path().join("zeta")]
    );
    assert!(discover(&root.path().join("middle")).unwrap().is_empty());
    let err = discover(&root.path().join("missing")).unwrap_err();
    assert!(err.to_string().contains("cannot list the directory"), "{err}");
}

#[test]
fn entry_points_are_found_in_code_not_comments() {
    let source = "// __kernel void ghost(\n/* __kernel void ghost2( */\n__kernel\n  __attribute__((reqd_work_group_size(64, 1, 1)))\n  void real (int x) {}\nkernel void other(int y) {}";
    assert!(declares_kernel(source, "real"));
    assert!(declares_kernel(source, "other"));
    assert!(!declares_kernel(source, "ghost"));
    assert!(!declares_kernel(source, "ghost2"));
    assert!(!declares_kernel(source, "rea"));
}

/// `opencl.binaries` names a precompiled program per device: loaded with the package (its bytes
/// in the definition and in the fingerprint), a missing file refused naming file, line and key.
#[test]
fn precompiled_binaries_are_loaded_and_a_missing_one_is_named() {
    let manifest = GOOD.replace(
        r#"opencl = { file = "demo.cl", entry = "scale", local = [64] }"#,
        r#"opencl = { file = "demo.cl", entry = "scale", local = [64], binaries = { "some device" = "demo.bin" } }"#,
    );
    let dir = package(&manifest);
    std::fs::write(dir.path().join("demo.bin"), b"binary bytes").unwrap();
    let loaded = load(dir.path()).unwrap();
    let imp = kernel(&loaded, "demo.scale").def.opencl.clone().unwrap();
    assert_eq!(imp.binaries.len(), 1);
    assert_eq!(imp.binaries[0].device, "some device");
    assert_eq!(&*imp.binaries[0].bytes, b"binary bytes");
    let before = kernel(&loaded, "demo.scale").fingerprint;
    std::fs::write(dir.path().join("demo.bin"), b"other bytes").unwrap();
    let again = load(dir.path()).unwrap();
    assert_ne!(
        kernel(&again, "demo.scale").fingerprint,
        before,
        "a new binary is a new version"
    );
    std::fs::remove_file(dir.path().join("demo.bin")).unwrap();
    refused_in(
        dir.path(),
        12,
        "kernels.scale.opencl.binaries.some device",
        "cannot read the binary",
    );
}

/// CUDA C of the CUDA test package: a guarded kernel (with `__launch_bounds__` and a
/// parameter list over several lines), a plain one and one without C linkage.
const DEMO_CU: &str = r#"// demo.cu: the demo package's CUDA C.
// extern "C" __global__ void ghost(float *x) {}

/* Guarded: the declared parameters, then the guards, the flag and the row offset. */
extern "C" __global__ void __launch_bounds__(256)
scale_cuda(float a,
           const float *x,  // read, (commas in comments do not count)
           float *y,
           unsigned long long range0, unsigned long long range1, unsigned long long range2,
           const volatile unsigned char *revoke,
           unsigned long long row_offset) {
    unsigned long long i = row_offset + (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= range0 || *revoke) return;
    y[i] = a * x[i];
}

// Plain: its declared parameter only; the entry defaults to the kernel's name.
extern "C" __global__ void only(float *x) {
    x[blockIdx.x * blockDim.x + threadIdx.x] *= 2.0f;
}

// A C++ name: mangled, so not an entry a manifest can name.
__global__ void mangled(float *x) { x[0] = 1.0f; }
"#;

/// PTX of the CUDA test package, as NVRTC writes it: a plain kernel.
const DEMO_PTX: &str = "//
// Generated by NVIDIA NVVM Compiler
//
// Compiler Build ID: CL-36037853
// Cuda compilation tools, release 12.9, V12.9.86
// Based on NVVM 7.0.1
//

.version 8.8
.target sm_70
.address_size 64

\t// .globl\tplain_scale

.visible .entry plain_scale(
\t.param .f32 plain_scale_param_0,
\t.param .u64 plain_scale_param_1,
\t.param .u64 plain_scale_param_2
)
{
\t.reg .f32 \t%f<4>;
\t.reg .b32 \t%r<5>;
\t.reg .b64 \t%rd<8>;


\tld.param.f32 \t%f1, [plain_scale_param_0];
\tld.param.u64 \t%rd1, [plain_scale_param_1];
\tld.param.u64 \t%rd2, [plain_scale_param_2];
\tcvta.to.global.u64 \t%rd3, %rd2;
\tcvta.to.global.u64 \t%rd4, %rd1;
\tmov.u32 \t%r1, %ctaid.x;
\tmov.u32 \t%r2, %ntid.x;
\tmov.u32 \t%r3, %tid.x;
\tmad.lo.s32 \t%r4, %r1, %r2, %r3;
\tmul.wide.u32 \t%rd5, %r4, 4;
\tadd.s64 \t%rd6, %rd4, %rd5;
\tld.global.f32 \t%f2, [%rd6];
\tmul.f32 \t%f3, %f2, %f1;
\tadd.s64 \t%rd7, %rd3, %rd5;
\tst.global.f32 \t[%rd7], %f3;
\tret;

}
";

/// A package with CUDA implementations. Line numbers matter: the error tests edit it.
const CUDA_GOOD: &str = r#"[package]
name = "demo"

[kernels.scale]
params = ["a: f32", "x: f32 read", "y: f32 write"]
sizes = { x = "range0", y = "range0" }
opencl = { file = "demo.cl", entry = "scale" }
cuda = { file = "demo.cu", entry = "scale_cuda" }

[kernels.plain]
params = ["a: f32", "x: f32 read", "y: f32 write"]
sizes = { x = "range0", y = "range0" }
cuda = { file = "demo.ptx", entry = "plain_scale" }

[kernels.only]
params = ["x: f32 readwrite"]
sizes = { x = "range0" }
cuda = { file = "demo.cu" }
"#;

/// A package directory with `manifest`, demo.cl, demo.cu, demo.ptx and libdemo.so.
fn cuda_package(manifest: &str) -> tempfile::TempDir {
    let dir = package(manifest);
    std::fs::write(dir.path().join("demo.cu"), DEMO_CU).unwrap();
    std::fs::write(dir.path().join("demo.ptx"), DEMO_PTX).unwrap();
    dir
}

#[test]
fn cuda_c_and_ptx_implementations_load_with_their_convention() {
    let dir = cuda_package(CUDA_GOOD);
    let p = load(dir.path()).unwrap();
    let names: Vec<&str> = p.kernels.iter().map(|k| &*k.def.name).collect();
    assert_eq!(names, vec!["demo.scale", "demo.plain", "demo.only"]);

    let scale = kernel(&p, "demo.scale");
    assert_eq!(scale.implementations, vec!["opencl", "cuda"]);
    assert!(scale.def.opencl.is_some() && scale.def.cpu.is_none());
    let cuda = scale.def.cuda.as_ref().unwrap();
    assert!(matches!(&cuda.code, CudaCode::Source(text) if text == DEMO_CU));
    assert_eq!(cuda.code.language(), "cuda");
    assert_eq!(
        (&*cuda.program, &*cuda.entry, cuda.guarded),
        ("demo/demo.cu", "scale_cuda", true)
    );

    let plain = kernel(&p, "demo.plain");
    assert_eq!(plain.implementations, vec!["cuda"]);
    let cuda = plain.def.cuda.as_ref().unwrap();
    assert!(matches!(&cuda.code, CudaCode::Ptx(text) if text == DEMO_PTX));
    assert_eq!(cuda.code.language(), "ptx");
    assert_eq!(
        (&*cuda.program, &*cuda.entry, cuda.guarded),
        ("demo/demo.ptx", "plain_scale", false)
    );

    // A kernel with only a CUDA implementation; its entry defaults to its name.
    let only = kernel(&p, "demo.only");
    assert_eq!(only.implementations, vec!["cuda"]);
    assert!(only.def.opencl.is_none() && only.def.cpu.is_none());
    let cuda = only.def.cuda.as_ref().unwrap();
    assert_eq!(
        (&*cuda.program, &*cuda.entry, cuda.guarded),
        ("demo/demo.cu", "only", false)
    );
    assert!(matches!(cuda.code, CudaCode::Source(_)));

    // The CUDA file is part of the fingerprint of the kernels that use it, and only of those.
    std::fs::write(dir.path().join("demo.cu"), format!("{DEMO_CU}\n// edited\n")).unwrap();
    let edited = load(dir.path()).unwrap();
    for (name, changed) in [("demo.scale", true), ("demo.plain", false), ("demo.only", true)] {
        assert_eq!(
            kernel(&p, name).fingerprint != kernel(&edited, name).fingerprint,
            changed,
            "{name}"
        );
    }
    // So is the `cuda` table.
    std::fs::write(dir.path().join("demo.cu"), DEMO_CU).unwrap();
    std::fs::write(
        dir.path().join(MANIFEST),
        CUDA_GOOD.replace(
            "cuda = { file = \"demo.cu\" }",
            "cuda = { file = \"demo.cu\", entry = \"only\" }",
        ),
    )
    .unwrap();
    let same = load(dir.path()).unwrap();
    assert_eq!(
        kernel(&p, "demo.only").fingerprint,
        kernel(&same, "demo.only").fingerprint,
        "the default entry written out"
    );
    std::fs::write(dir.path().join("demo.scale.ptx"), DEMO_PTX).unwrap();
    std::fs::write(
        dir.path().join(MANIFEST),
        CUDA_GOOD.replace(
            "cuda = { file = \"demo.ptx\", entry = \"plain_scale\" }",
            "cuda = { file = \"demo.scale.ptx\", entry = \"plain_scale\" }",
        ),
    )
    .unwrap();
    let renamed = load(dir.path()).unwrap();
    assert_ne!(
        kernel(&p, "demo.plain").fingerprint,
        kernel(&renamed, "demo.plain").fingerprint
    );
    assert_eq!(
        kernel(&renamed, "demo.plain").def.cuda.as_ref().unwrap().program,
        "demo/demo.scale.ptx"
    );
}

#[test]
fn bad_cuda_tables_are_refused_naming_file_line_and_key() {
    let refused = |manifest: &str, line: usize, key: &str, fragment: &str| {
        let dir = cuda_package(manifest);
        refused_in(dir.path(), line, key, fragment);
    };
    let edit = |from: &str, to: &str| {
        assert!(CUDA_GOOD.contains(from), "{from}");
        CUDA_GOOD.replacen(from, to, 1)
    };
    refused(
        &edit("file = \"demo.cu\", entry", "file = \"nope.cu\", entry"),
        8,
        "kernels.scale.cuda.file",
        "cannot read",
    );
    refused(
        &edit("file = \"demo.ptx\", ", ""),
        13,
        "kernels.plain.cuda.file",
        "`file` is missing",
    );
    refused(
        &edit("entry = \"scale_cuda\"", "entry = \"scale_cud\""),
        8,
        "kernels.scale.cuda.entry",
        "demo.cu has no `extern \"C\" __global__ void scale_cud(`: declare the kernel `extern \"C\" __global__ void scale_cud(...)`",
    );
    refused(
        &edit("entry = \"scale_cuda\"", "entry = \"ghost\""),
        8,
        "kernels.scale.cuda.entry",
        "has no `extern \"C\" __global__ void ghost(`",
    );
    refused(
        &edit("entry = \"scale_cuda\"", "entry = \"mangled\""),
        8,
        "kernels.scale.cuda.entry",
        "declares `__global__ void mangled(` without `extern \"C\"`, so its name is mangled",
    );
    refused(
        &edit("[kernels.only]", "[kernels.lonely]"),
        18,
        "kernels.lonely.cuda",
        "has no `extern \"C\" __global__ void lonely(`",
    );
    refused(
        &edit("entry = \"plain_scale\"", "entry = \"plain_scal\""),
        13,
        "kernels.plain.cuda.entry",
        "demo.ptx has no `.entry plain_scal` (its entries: plain_scale)",
    );
    refused(
        &edit("[\"a: f32\", \"x", "[\"a: f32\", \"b: f32\", \"x"),
        8,
        "kernels.scale.cuda",
        "kernel entry scale_cuda takes 8 parameters; the manifest declares 4: a plain kernel takes exactly its 4 declared parameters, a guarded one 4 + 5 = 9 (range0, range1, range2, the revocation flag, the row offset)",
    );
    refused(
        &edit("[\"x: f32 readwrite\"]", "[\"x: f32 readwrite\", \"n: u32\"]"),
        18,
        "kernels.only.cuda",
        "kernel entry only takes 1 parameter; the manifest declares 2",
    );
    refused(
        &edit("entry = \"scale_cuda\" }", "entry = \"scale_cuda\", local = [64] }"),
        8,
        "kernels.scale.cuda.local",
        "unknown key `local` (this table takes: file, entry)",
    );
    refused(
        &edit("entry = \"scale_cuda\"", "entry = \"2cuda\""),
        8,
        "kernels.scale.cuda.entry",
        "the CUDA entry point `2cuda` is not an identifier",
    );
    refused(
        &edit(
            "cuda = { file = \"demo.ptx\", entry = \"plain_scale\" }",
            "cuda = \"demo.ptx\"",
        ),
        13,
        "kernels.plain.cuda",
        "must be a table",
    );
    refused(
        &edit("cuda = { file = \"demo.cu\" }", "cuda = { file = \"\" }"),
        18,
        "kernels.only.cuda.file",
        "the file name is empty",
    );
    refused(
        &edit("cuda = { file = \"demo.cu\" }\n", ""),
        15,
        "kernels.only",
        "has no implementation: give `opencl = { file = \"...\", entry = \"...\" }`, `cuda = { file = \"...\", entry = \"...\" }`, `cpu = { symbol = \"...\" }`, or several",
    );
}

#[test]
fn cuda_c_entries_are_found_in_code_and_their_parameters_counted() {
    let source = r#"// extern "C" __global__ void ghost(int a) {}
/* extern "C" __global__ void ghost2(int a, int b) {} */
#include "helpers.h"
#define N 4

extern "C" {
__global__ void in_block(float *x, int n) {}
}

extern "C" __global__ void __launch_bounds__(256, 2) bounded(const float *x,
        float *y,   // the output, (with a comma)
        unsigned long long range0, unsigned long long range1, unsigned long long range2,
        const volatile unsigned char *revoke, unsigned long long row_offset) {
    if (threadIdx.x == 0) printf("extern \"C\" __global__ void fake(%d, %d)\n", 1, 2);
}

extern "C" __launch_bounds__(128) __global__ void bounds_first(void) {}
extern "C" __global__ void empty() {}
extern "C"
__global__ void
    spaced (
        float (*rows)[N], // a pointer to arrays: its parentheses hold no parameter
        int n
    ) {}
__global__ void mangled(float *x) {}
template <typename T> __global__ void templated(T *x) {}
void host(float *x) { empty(); }
"#;
    let code = CudaCode::Source(Cow::Borrowed(source));
    let count = |entry: &str| cuda_entry_parameters(&code, entry);
    assert_eq!(count("in_block"), Ok(2));
    assert_eq!(count("bounded"), Ok(7));
    assert_eq!(count("bounds_first"), Ok(0));
    assert_eq!(count("empty"), Ok(0));
    assert_eq!(count("spaced"), Ok(2));
    for missing in ["ghost", "ghost2", "fake", "host", "N", "bounde"] {
        let err = count(missing).unwrap_err();
        assert_eq!(
            err,
            format!("has no `extern \"C\" __global__ void {missing}(`: declare the kernel `extern \"C\" __global__ void {missing}(...)`")
        );
    }
    for mangled in ["mangled", "templated"] {
        let err = count(mangled).unwrap_err();
        assert!(err.contains("without `extern \"C\"`"), "{err}");
    }

    // The convention by the count.
    assert_eq!(cuda_convention(&code, "in_block", 2), Ok(false));
    assert_eq!(cuda_convention(&code, "bounded", 2), Ok(true));
    assert_eq!(cuda_convention(&code, "empty", 0), Ok(false));
    let err = cuda_convention(&code, "bounded", 3).unwrap_err();
    assert_eq!(
        err,
        "kernel entry bounded takes 7 parameters; the manifest declares 3: a plain kernel takes exactly its 3 declared parameters, a guarded one 3 + 5 = 8 (range0, range1, range2, the revocation flag, the row offset)"
    );
    let err = cuda_convention(&code, "ghost", 1).unwrap_err();
    assert!(
        err.starts_with("the CUDA C source has no `extern \"C\" __global__ void ghost(`"),
        "{err}"
    );
    // An unterminated list is an error, never a panic.
    let cut = CudaCode::Source(Cow::Borrowed(
        "extern \"C\" __global__ void cut(float *x, \"unterminated",
    ));
    assert!(cuda_convention(&cut, "cut", 1).unwrap_err().contains("without closing"));
}

#[test]
fn ptx_entries_are_found_and_their_params_counted() {
    let ptx = "//\n// Generated by NVIDIA NVVM Compiler\n//\n.version 8.8\n.target sm_80\n.address_size 64\n\n\t// .globl\tk\n// .visible .entry ghost(\n\n.visible .entry k(\n\t.param .u64 k_param_0,\n\t.param .u32 k_param_1\n)\n{\n\t.reg .b64 \t%rd<2>;\n\tret;\n}\n\n.weak .entry guarded_k(\n\t.param .u64 .ptr .global .align 4 guarded_k_param_0,\n\t.param .u64 guarded_k_param_1,\n\t.param .u64 guarded_k_param_2,\n\t.param .u64 guarded_k_param_3,\n\t.param .u64 guarded_k_param_4,\n\t.param .u64 guarded_k_param_5\n)\n{\n\tret;\n}\n\n.entry bare\n{\n\tret;\n}\n\n.visible .entry empty()\n{\n\tret;\n}\n\n.visible .func helper(\n\t.param .b32 helper_param_0\n)\n{\n\tret;\n}\n";
    let code = CudaCode::Ptx(Cow::Borrowed(ptx));
    assert_eq!(cuda_entry_parameters(&code, "k"), Ok(2));
    assert_eq!(cuda_entry_parameters(&code, "guarded_k"), Ok(6));
    assert_eq!(cuda_entry_parameters(&code, "bare"), Ok(0));
    assert_eq!(cuda_entry_parameters(&code, "empty"), Ok(0));
    assert_eq!(cuda_convention(&code, "k", 2), Ok(false));
    assert_eq!(cuda_convention(&code, "guarded_k", 1), Ok(true));
    assert_eq!(cuda_convention(&code, "bare", 0), Ok(false));
    let err = cuda_convention(&code, "k", 1).unwrap_err();
    assert!(err.starts_with("kernel entry k takes 2 parameters; the manifest declares 1: a plain kernel takes exactly its 1 declared parameter, a guarded one 1 + 5 = 6"), "{err}");
    for missing in ["ghost", "helper", "K"] {
        assert_eq!(
            cuda_convention(&code, missing, 1).unwrap_err(),
            format!("the PTX has no `.entry {missing}` (its entries: k, guarded_k, bare, empty)")
        );
    }
    // The entries found are listed, at most 8 of them.
    let many: String = (0..10)
        .map(|i| format!(".visible .entry e{i}(\n\t.param .u32 e{i}_param_0\n)\n{{\n\tret;\n}}\n"))
        .collect();
    assert_eq!(
        cuda_convention(&CudaCode::Ptx(Cow::Owned(many)), "f", 1).unwrap_err(),
        "the PTX has no `.entry f` (its entries: e0, e1, e2, e3, e4, e5, e6, e7, and 2 more)"
    );
    assert_eq!(
        cuda_convention(&CudaCode::Ptx(Cow::Borrowed(".version 8.8\n")), "f", 1).unwrap_err(),
        "the PTX has no `.entry f` (it has no .entry)"
    );
}

#[test]
fn program_manifests_take_a_cuda_entry_and_no_file() {
    let specs = program_manifest(
        "[kernels.k]\nparams = [\"x: f32 read\"]\nsizes = { x = \"range0\" }\ncuda = { entry = \"x\" }\n\n[kernels.d]\ncuda = {}\n\n[kernels.none]\n",
        "tenant.ptx",
    )
    .unwrap();
    assert_eq!(specs[0].cuda_entry.as_deref(), Some("x"));
    assert_eq!(
        specs[1].cuda_entry.as_deref(),
        Some("d"),
        "the entry defaults to the kernel's name"
    );
    assert_eq!(specs[2].cuda_entry, None);
    assert_eq!(
        (specs[0].opencl_entry.as_ref(), specs[0].cpu_symbol.as_ref()),
        (None, None)
    );
    let err = program_manifest(
        "[kernels.k]\nparams = [\"x: f32 read\"]\nsizes = { x = \"range0\" }\ncuda = { file = \"k.cu\", entry = \"k\" }\n",
        "tenant.ptx",
    )
    .unwrap_err();
    assert!(
        err.to_string()
            .starts_with("tenant.ptx:4: kernels.k.cuda.file: unknown key `file` (this table takes: entry)"),
        "{err}"
    );
    let err = program_manifest("[kernels.k]\ncuda = { entry = \"not an entry\" }\n", "tenant.ptx").unwrap_err();
    assert!(
        err.to_string()
            .starts_with("tenant.ptx:2: kernels.k.cuda.entry: the CUDA entry point"),
        "{err}"
    );
    // The fuzzer's path reads a package's `cuda` tables like `load` (without reading the files).
    let (name, kernels) = parse_package_manifest(CUDA_GOOD, "package.toml").unwrap();
    assert_eq!(name, "demo");
    let entries: Vec<Option<&str>> = kernels.iter().map(|k| k.cuda_entry.as_deref()).collect();
    assert_eq!(entries, vec![Some("scale_cuda"), Some("plain_scale"), Some("only")]);
}

/// Every prefix of real CUDA C and PTX (cut lists, literals, comments and characters), read as
/// either language, gives a count or an error, never a panic.
#[test]
fn cut_cuda_code_is_an_error_not_a_panic() {
    let texts = [DEMO_CU, DEMO_PTX, "extern \"C\" __global__ void é(\"é\\é\", 'x\\"];
    for text in texts {
        for end in (0..=text.len()).filter(|e| text.is_char_boundary(*e)) {
            let cut = Cow::Borrowed(&text[..end]);
            for code in [CudaCode::Source(cut.clone()), CudaCode::Ptx(cut)] {
                for entry in ["scale_cuda", "plain_scale", "only", "mangled", "é"] {
                    let _ = cuda_convention(&code, entry, 3);
                }
            }
        }
    }
}
