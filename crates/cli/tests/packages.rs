//! Kernel packages with real processes (issue #13): `agora serve --kernels DIR` loads them, `agora
//! kernels` lists them with their implementations, clients launch their kernels like the
//! library's on the CPU (the package's C code) and on OpenCL (its `.cl` file), `agora kernels
//! reload` picks up a change without disturbing a session that uses the old version, keeps the
//! old version when the new one is broken, and two packages defining one kernel are refused.

use std::path::Path;
use std::process::Command;

use agora::{Arg, DeviceKind, QueueClass, QueueOptions};
use agora_test_support::{temp_dir, Daemon};

const AGORA: &str = env!("CARGO_BIN_EXE_agora");

const CL: &str = r#"
__kernel void scale(__global const float *x, __global float *y, const float a, const int n,
                    const ulong range0, const ulong range1, const ulong range2) {
    size_t i = get_global_id(0);
    if (i >= range0 || i >= (size_t)n) return;
    y[i] = a * x[i];
}
"#;

const C: &str = r#"
#include <agora_kernel.h>
AGORA_KERNEL int demo_scale(const AgoraKernelArgs *a, uint64_t begin, uint64_t end) {
    const float *x = (const float *)a->args[0].data;
    float *y = (float *)a->args[1].data;
    for (uint64_t i = begin; i < end; i++) y[i] = agora_f32(a, 2) * x[i];
    return 0;
}
"#;

fn manifest(doc: &str) -> String {
    format!(
        r#"[package]
name = "demo"
version = "1.0"
library = "libdemo.so"

[kernels.scale]
doc = "{doc}; range n"
params = ["x: f32 read", "y: f32 write", "a: f32", "n: i32"]
range = ["n"]
sizes = {{ x = "n", y = "n" }}
chunkable = true
opencl = {{ file = "demo.cl", entry = "scale" }}
cpu = {{ symbol = "demo_scale" }}
"#
    )
}

/// Writes the demo package (and builds its C library) into `dir`.
fn write_package(dir: &Path, doc: &str) {
    std::fs::create_dir_all(dir).unwrap();
    std::fs::write(dir.join("package.toml"), manifest(doc)).unwrap();
    std::fs::write(dir.join("demo.cl"), CL).unwrap();
    std::fs::write(dir.join("demo.c"), C).unwrap();
    let include = Path::new(env!("CARGO_MANIFEST_DIR")).join("../capi/include");
    let status = Command::new("cc")
        .args(["-O2", "-shared", "-fPIC", "-I"])
        .arg(&include)
        .arg("-o")
        .arg(dir.join("libdemo.so"))
        .arg(dir.join("demo.c"))
        .status()
        .expect("cc runs");
    assert!(status.success(), "the demo package's C file compiles");
}

/// y = 2.5 x over 1000 elements on a queue that prefers `kind`, checked.
fn scale_on(daemon: &Daemon, kind: DeviceKind) {
    let session = daemon.session();
    let kernel = session.kernel("demo.scale").expect("the package's kernel is found");
    let queue = session
        .queue_with(QueueOptions {
            name: format!("demo on {}", kind.name()),
            class: QueueClass::Batch,
            preferred_device: Some(kind),
            sla: None,
        })
        .unwrap();
    let input: Vec<f32> = (0..1000).map(|i| i as f32).collect();
    let x = session.buffer_from(&input).unwrap();
    let y = session.buffer(4000).unwrap();
    queue.sync_to(&x).unwrap();
    queue
        .launch(
            &kernel,
            &[(&x).into(), (&y).into(), Arg::F32(2.5), Arg::I32(1000)],
            1000u64,
        )
        .unwrap();
    queue.sync_from(&y).unwrap();
    queue.finish().unwrap();
    let got: Vec<f32> = y.read_vec();
    assert!(
        got.iter().zip(&input).all(|(g, x)| *g == 2.5 * x),
        "demo.scale on {}: {:?}",
        kind.name(),
        &got[..4]
    );
}

#[test]
fn a_package_is_listed_and_runs_on_the_cpu_and_on_opencl() {
    let dir = temp_dir("packages-run");
    write_package(&dir.path().join("pkgs/demo"), "y = a*x");
    let daemon = Daemon::start(
        AGORA,
        "packages-run",
        &["--kernels", &format!("{}/pkgs", dir.path().display())],
    );
    let out = daemon.agora(&["kernels", "--json"]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let listing: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let demo = listing["kernels"]
        .as_array()
        .unwrap()
        .iter()
        .find(|k| k["signature"]["name"] == "demo.scale")
        .expect("agora kernels lists demo.scale");
    assert_eq!(demo["package"], "demo");
    assert_eq!(demo["implementations"], serde_json::json!(["opencl", "cpu"]));
    assert_eq!(demo["chunkable"], true);
    assert!(listing["packages"]
        .as_array()
        .unwrap()
        .iter()
        .any(|p| p["name"] == "demo" && p["kernels"] == 1));
    let text = daemon.agora(&["kernels"]);
    assert!(String::from_utf8_lossy(&text.stdout).contains("[package demo; opencl, cpu, chunkable]"));

    // `agora kernels check` passes it, without a daemon: it loads, its symbol is bound and its
    // OpenCL C compiles; `--json` says the same.
    let out = Command::new(AGORA)
        .args(["kernels", "check", "--json"])
        .arg(dir.path().join("pkgs"))
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let checked: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(checked["problems"], 0);
    let checks = checked["packages"][0]["kernels"][0]["checks"]
        .as_array()
        .unwrap()
        .clone();
    assert!(checks.iter().all(|c| c["ok"] == true), "{checks:?}");
    assert!(
        checks
            .iter()
            .any(|c| c["what"].as_str().unwrap().starts_with("opencl on") && c["said"] == "compiles"),
        "{checks:?}"
    );

    scale_on(&daemon, DeviceKind::Cpu);
    if daemon.status().devices.iter().any(|d| d.kind == "opencl") {
        scale_on(&daemon, DeviceKind::OpenCl);
    }
}

#[test]
fn a_reload_picks_up_a_change_and_keeps_a_working_version_when_the_new_one_is_broken() {
    let dir = temp_dir("packages-reload");
    let package = dir.path().join("pkgs/demo");
    write_package(&package, "y = a*x");
    let daemon = Daemon::start(
        AGORA,
        "packages-reload",
        &["--kernels", &format!("{}/pkgs", dir.path().display())],
    );
    let session = daemon.session();
    let before = session.kernel("demo.scale").unwrap();

    // A changed doc (and with it the manifest entry) is a new version with a new id.
    std::fs::write(package.join("package.toml"), manifest("y = a*x, version two")).unwrap();
    let out = daemon.agora(&["kernels", "reload"]);
    let said = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{said}{}", String::from_utf8_lossy(&out.stderr));
    assert!(said.contains("new or changed: demo.scale"), "{said}");
    let after = session.kernel("demo.scale").unwrap();
    assert!(after.signature().doc.contains("version two"));
    assert_ne!(before.id(), after.id(), "a changed kernel gets a new id");
    // The session that looked the old version up still runs it.
    let queue = session.queue("old version").unwrap();
    let x = session.buffer_from(&[1.0f32, 2.0]).unwrap();
    let y = session.buffer(8).unwrap();
    queue.sync_to(&x).unwrap();
    queue
        .launch(&before, &[(&x).into(), (&y).into(), Arg::F32(3.0), Arg::I32(2)], 2u64)
        .unwrap();
    queue.sync_from(&y).unwrap();
    queue.finish().unwrap();
    assert_eq!(y.read_vec::<f32>(), vec![3.0, 6.0]);

    // A broken manifest: refused with file, line and key; the previous version keeps serving.
    std::fs::write(
        package.join("package.toml"),
        manifest("y = a*x").replace("sizes = { x = \"n\", y = \"n\" }", "sizes = { x = \"n +\", y = \"n\" }"),
    )
    .unwrap();
    let out = daemon.agora(&["kernels", "reload"]);
    let said = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(out.status.code(), Some(1), "{said}");
    assert!(said.contains("package.toml:") && said.contains("sizes"), "{said}");
    assert!(said.contains("keeps its previous version"), "{said}");
    let still = session.kernel("demo.scale").unwrap();
    assert_eq!(still.id(), after.id(), "the previous version stays");
    scale_on(&daemon, DeviceKind::Cpu);
}

#[test]
fn two_packages_defining_one_kernel_are_refused_at_start() {
    let dir = temp_dir("packages-twice");
    write_package(&dir.path().join("a/demo"), "first");
    write_package(&dir.path().join("b/demo"), "second");
    let out = Command::new(AGORA)
        .args(["serve", "--no-opencl", "--socket"])
        .arg(dir.path().join("agora.sock"))
        .arg("--kernels")
        .arg(dir.path().join("a"))
        .arg("--kernels")
        .arg(dir.path().join("b"))
        .env("AGORA_STATE_DIR", dir.path().join("state"))
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(err.contains("demo.scale") && err.contains("already defines"), "{err}");
    assert!(err.contains("the daemon cannot start"), "{err}");
    assert!(!dir.path().join("agora.sock").exists(), "no socket left behind");

    // A --kernels directory that does not exist: refused at start, saying what to give.
    let out = Command::new(AGORA)
        .args(["serve", "--no-opencl", "--socket"])
        .arg(dir.path().join("agora.sock"))
        .arg("--kernels")
        .arg(dir.path().join("no-such-dir"))
        .env("AGORA_STATE_DIR", dir.path().join("state"))
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(err.contains("no-such-dir") && err.contains("package.toml"), "{err}");
    assert!(!dir.path().join("agora.sock").exists(), "no socket left behind");
}

/// A package kernel whose `__local` arrays exceed a work-group's local memory compiles, and its
/// first launch made PoCL assert in the device host: `agora kernels check` says it cannot run.
#[test]
fn kernels_check_finds_a_kernel_whose_local_memory_exceeds_the_device() {
    let dir = temp_dir("packages-local-memory");
    let package = dir.path().join("greedy");
    std::fs::create_dir_all(&package).unwrap();
    std::fs::write(
        package.join("package.toml"),
        r#"[package]
name = "greedy"

[kernels.k]
doc = "y = y[0]; range n"
params = ["y: f32 readwrite", "n: i32"]
range = ["n"]
sizes = { y = "n" }
opencl = { file = "greedy.cl", entry = "k" }
"#,
    )
    .unwrap();
    // 256 MiB of __local floats: more than any device's local memory.
    std::fs::write(
        package.join("greedy.cl"),
        "__kernel void k(__global float *y, const int n, const ulong r0, const ulong r1, const ulong r2) {\n    \
         __local float t[67108864];\n    t[get_local_id(0)] = y[get_global_id(0)];\n    \
         barrier(CLK_LOCAL_MEM_FENCE);\n    y[get_global_id(0)] = t[0];\n}\n",
    )
    .unwrap();
    let out = Command::new(AGORA)
        .args(["kernels", "check", "--json"])
        .arg(&package)
        .output()
        .unwrap();
    let said = String::from_utf8_lossy(&out.stdout);
    assert_eq!(
        out.status.code(),
        Some(1),
        "{said}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let report: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let checks = report.to_string();
    assert!(
        checks.contains("CANNOT RUN") && checks.contains("its __local memory takes 268435456 bytes"),
        "{said}"
    );
}

/// A package whose OpenCL C does not compile (audit K-D7): its first launch fails with a message
/// that says the kernel's source did not compile and the device is fine (it read "the device
/// failed to run the task (OpenCL error -11)"), later ones with NoDevice saying why a device
/// may not run a kernel (it read "no usable device on this node runs kernel id 19" and pointed
/// at `agora undrain`), and the device goes on running other kernels.
#[test]
fn a_package_whose_opencl_does_not_compile_says_so_and_leaves_the_device_working() {
    let dir = temp_dir("packages-broken-cl");
    let package = dir.path().join("pkgs/broken");
    std::fs::create_dir_all(&package).unwrap();
    std::fs::write(
        package.join("package.toml"),
        r#"[package]
name = "broken"

[kernels.k]
doc = "y = 1; range n"
params = ["y: f32 write", "n: i32"]
range = ["n"]
sizes = { y = "n" }
opencl = { file = "broken.cl", entry = "k" }
"#,
    )
    .unwrap();
    std::fs::write(
        package.join("broken.cl"),
        "__kernel void k(__global float *y, const int n, const ulong r0, const ulong r1, const ulong r2) {\n    y[get_global_id(0)] = undeclared_identifier;\n}\n",
    )
    .unwrap();
    // `agora kernels check` finds it before any daemon runs it, with the compiler's log naming
    // the package's file (not the compiler's temporary copy).
    let out = Command::new(AGORA)
        .args(["kernels", "check"])
        .arg(dir.path().join("pkgs"))
        .output()
        .unwrap();
    let said = String::from_utf8_lossy(&out.stdout);
    assert_eq!(
        out.status.code(),
        Some(1),
        "{said}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        said.contains("broken.k: opencl on") && said.contains("DOES NOT COMPILE") && said.contains("broken.cl:2:"),
        "{said}"
    );
    assert!(!said.contains("tempfile_"), "{said}");
    assert!(String::from_utf8_lossy(&out.stderr).contains("1 problem(s) found"));
    // A package that does not load at all is a problem too, named with its manifest's error.
    let unloadable = dir.path().join("unloadable");
    std::fs::create_dir_all(&unloadable).unwrap();
    std::fs::write(
        unloadable.join("package.toml"),
        "[package]\nname = \"unloadable\"\nbogus = 1\n",
    )
    .unwrap();
    let out = Command::new(AGORA)
        .args(["kernels", "check"])
        .arg(&unloadable)
        .output()
        .unwrap();
    let said = String::from_utf8_lossy(&out.stdout);
    assert_eq!(
        out.status.code(),
        Some(1),
        "{said}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        said.contains("does not load") && said.contains("package.toml"),
        "{said}"
    );
    let daemon = Daemon::start(
        AGORA,
        "packages-broken-cl",
        &["--kernels", &format!("{}/pkgs", dir.path().display())],
    );
    assert!(
        daemon.status().devices.iter().any(|d| d.kind == "opencl"),
        "this test needs the OpenCL device (PoCL, installed by scripts/setup.sh)"
    );
    let session = daemon.session();
    let kernel = session.kernel("broken.k").unwrap();
    let queue = session.queue("broken").unwrap();
    let y = session.buffer(64).unwrap();
    let launch = || {
        queue
            .launch(&kernel, &[(&y).into(), Arg::I32(16)], 16u64)
            .unwrap()
            .wait()
            .expect_err("a kernel whose source does not compile cannot run")
            .to_string()
    };
    let first = launch();
    assert!(
        first.contains("did not compile") && first.contains("the device is fine") && !first.contains("-11)"),
        "{first}"
    );
    // Later launches (the device no longer offers the kernel: NoDevice, or the same refusal
    // while the queue's binding lasts), from this session and from a new one, say why too.
    let second = launch();
    assert!(
        second.contains("did not compile") && !second.contains("kernel id"),
        "{second}"
    );
    let other = daemon.session();
    let (queue, y) = (other.queue("broken too").unwrap(), other.buffer(64).unwrap());
    let third = queue
        .launch(&other.kernel("broken.k").unwrap(), &[(&y).into(), Arg::I32(16)], 16u64)
        .unwrap()
        .wait()
        .expect_err("a kernel whose source does not compile cannot run")
        .to_string();
    assert!(
        third.contains("did not compile") && !third.contains("kernel id"),
        "{third}"
    );
    // The device runs the library's kernels as before.
    let opencl = session
        .queue_with(QueueOptions {
            name: "after".into(),
            class: QueueClass::Batch,
            preferred_device: Some(DeviceKind::OpenCl),
            sla: None,
        })
        .unwrap();
    let x = session.buffer_from(&[1.0f32; 16]).unwrap();
    let z = session.buffer_from(&[1.0f32; 16]).unwrap();
    opencl.sync_to(&x).unwrap();
    opencl.sync_to(&z).unwrap();
    let saxpy = session.kernel("saxpy").unwrap();
    opencl
        .launch(&saxpy, &[Arg::F32(2.0), (&x).into(), (&z).into()], 16u64)
        .unwrap();
    opencl.sync_from(&z).unwrap();
    opencl.finish().unwrap();
    assert_eq!(z.read_vec::<f32>(), vec![3.0f32; 16]);
    assert!(
        daemon
            .status()
            .devices
            .iter()
            .any(|d| d.kind == DeviceKind::OpenCl && !d.failed && !d.draining),
        "{:?}",
        daemon.status().devices
    );
}
