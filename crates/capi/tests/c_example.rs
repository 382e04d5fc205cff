//! The C example (Rodinia Gaussian ported from CUDA-style calls) built with the system C compiler
//! through the pkg-config file, and run against a daemon.

use std::path::{Path, PathBuf};
use std::process::Command;

/// Lays out an install prefix (lib/libagora.so, include/agora.h, lib/pkgconfig/agora.pc) from
/// this build, as `make c` does.
fn install(prefix: &Path) {
    let exe = std::env::current_exe().unwrap();
    let build_dir = exe.parent().unwrap().parent().unwrap(); // target/<profile>/deps/.. = target/<profile>
    let lib = build_dir.join("libagora_capi.so");
    assert!(lib.exists(), "{} was not built", lib.display());
    let crate_dir = PathBuf::from(env!("CARGO_MANIFEST_DIR"));
    std::fs::create_dir_all(prefix.join("lib/pkgconfig")).unwrap();
    std::fs::create_dir_all(prefix.join("include")).unwrap();
    std::fs::copy(&lib, prefix.join("lib/libagora.so")).unwrap();
    std::fs::copy(crate_dir.join("include/agora.h"), prefix.join("include/agora.h")).unwrap();
    // As `make c` installs it: the header of kernels written for Agora, beside the client's.
    std::fs::copy(
        crate_dir.join("include/agora_kernel.h"),
        prefix.join("include/agora_kernel.h"),
    )
    .unwrap();
    let pc = std::fs::read_to_string(crate_dir.join("agora.pc.in"))
        .unwrap()
        .replace("@PREFIX@", prefix.to_str().unwrap())
        .replace("@VERSION@", env!("CARGO_PKG_VERSION"));
    std::fs::write(prefix.join("lib/pkgconfig/agora.pc"), pc).unwrap();
}

/// Compiles `source` against the library installed under `prefix`, found through pkg-config.
fn compile(prefix: &Path, source: &str, program: &Path) {
    let pkg = Command::new("pkg-config")
        .args(["--cflags", "--libs", "agora"])
        .env("PKG_CONFIG_PATH", prefix.join("lib/pkgconfig"))
        .output()
        .expect("pkg-config runs");
    assert!(pkg.status.success(), "{}", String::from_utf8_lossy(&pkg.stderr));
    let flags: Vec<String> = String::from_utf8(pkg.stdout)
        .unwrap()
        .split_whitespace()
        .map(String::from)
        .collect();
    let cc = Command::new("cc")
        .arg(source)
        .args(&flags)
        .args(["-lm", "-Wall", "-Werror", "-o"])
        .arg(program)
        .output()
        .expect("a C compiler (cc) runs");
    assert!(
        cc.status.success(),
        "cc {source} failed:\n{}",
        String::from_utf8_lossy(&cc.stderr)
    );
}

#[test]
fn the_c_gaussian_example_builds_with_pkg_config_and_verifies() {
    let scratch = agora_test_support::temp_dir("capi");
    let dir = scratch.path();
    let prefix = dir.join("prefix");
    install(&prefix);
    let program = dir.join("gaussian");
    compile(
        &prefix,
        concat!(env!("CARGO_MANIFEST_DIR"), "/examples/gaussian.c"),
        &program,
    );

    let daemon = agora_test_support::EmbeddedDaemon::start("capi-daemon", |_| {});
    let socket = daemon.socket();
    let run = Command::new(&program)
        .arg("200")
        .env("AGORA_SOCKET", socket)
        .env("LD_LIBRARY_PATH", prefix.join("lib"))
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&run.stdout);
    assert!(
        run.status.success(),
        "stdout:\n{stdout}\nstderr:\n{}",
        String::from_utf8_lossy(&run.stderr)
    );
    assert!(stdout.contains("verified OK"), "{stdout}");
    assert!(
        stdout.contains("wrong argument count: gaussian.fan1 takes 4 arguments"),
        "a launch that does not match the signature is refused at once, with a message: {stdout}"
    );
    assert!(
        stdout.contains("out of the kernel's accepted range"),
        "the daemon's error reaches C: {stdout}"
    );

    // Without a daemon: a connect error with a message, not a crash.
    let run = Command::new(&program)
        .env("AGORA_SOCKET", dir.join("nobody.sock"))
        .env("LD_LIBRARY_PATH", prefix.join("lib"))
        .output()
        .unwrap();
    assert_eq!(run.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&run.stderr).contains("agora serve"));
    daemon.stop().unwrap();
}

/// Installs the library as `make c` does, builds the check program `tests/NAME.c` against it,
/// runs it against the daemon on `socket`, and checks it reports `summary` (no check failed).
fn run_checks(name: &str, socket: &Path, summary: &str) {
    let scratch = agora_test_support::temp_dir(name);
    let dir = scratch.path();
    let prefix = dir.join("prefix");
    install(&prefix);
    let program = dir.join(name);
    compile(
        &prefix,
        &format!("{}/tests/{name}.c", env!("CARGO_MANIFEST_DIR")),
        &program,
    );
    let run = Command::new(&program)
        .env("AGORA_SOCKET", socket)
        .env("LD_LIBRARY_PATH", prefix.join("lib"))
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&run.stdout);
    assert!(
        run.status.success(),
        "stdout:\n{stdout}\nstderr:\n{}",
        String::from_utf8_lossy(&run.stderr)
    );
    assert!(stdout.contains(summary), "{stdout}");
}

#[test]
fn the_c_api_checks_pass_against_a_daemon() {
    let daemon = agora_test_support::EmbeddedDaemon::start("capi-daemon", |_| {});
    run_checks("api_checks", daemon.socket(), "C API checks: 0 failed");
    daemon.stop().unwrap();
}

#[test]
fn the_committed_header_is_the_generated_one() {
    // build.rs regenerates include/agora.h on every build; a stale committed copy would show up
    // as a diff in review. Here: the header declares every exported function.
    let header = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/include/agora.h")).unwrap();
    let source = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/src/lib.rs")).unwrap();
    for line in source.lines() {
        if let Some(rest) = line.split("extern \"C\" fn ").nth(1) {
            let name = rest.split('(').next().unwrap();
            assert!(header.contains(&format!("{name}(")), "agora.h lacks {name}");
        }
    }
}

/// Tenant programs from C, against a daemon process (its sandboxed executor is the `agora`
/// binary's `executor` subcommand, so the daemon must be that binary, built by the workspace).
#[test]
fn the_c_program_checks_pass_against_a_daemon() {
    let agora = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../target/release/agora");
    assert!(
        agora.exists(),
        "{} is missing: `cargo build --release --workspace` first (make test does)",
        agora.display()
    );
    let daemon = agora_test_support::Daemon::start(&agora, "capi-programs", &["--no-opencl"]);
    run_checks("program_checks", daemon.socket(), "C program checks: 0 failed");
}
