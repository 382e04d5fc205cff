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

/// `tests/rank_checks.c` built against this build's library, in a scratch directory (kept
/// alive by the returned guard): run it with [`rank_command`].
fn rank_checks() -> (agora_test_support::TempDir, PathBuf, PathBuf) {
    let scratch = agora_test_support::temp_dir("rank-checks");
    let prefix = scratch.path().join("prefix");
    install(&prefix);
    let program = scratch.path().join("rank_checks");
    compile(
        &prefix,
        concat!(env!("CARGO_MANIFEST_DIR"), "/tests/rank_checks.c"),
        &program,
    );
    (scratch, prefix, program)
}

/// The rank check program with `args`, against `socket`, as no rank of any parallel job (the
/// test itself may run inside one) unless `rank` says which (`PMI_RANK`).
fn rank_command(program: &Path, prefix: &Path, socket: &Path, args: &[&str], rank: Option<&str>) -> Command {
    let mut command = Command::new(program);
    command
        .args(args)
        .env("AGORA_SOCKET", socket)
        .env("LD_LIBRARY_PATH", prefix.join("lib"));
    for variable in agora::RANK_VARIABLES {
        command.env_remove(variable);
    }
    if let Some(rank) = rank {
        command.env("PMI_RANK", rank);
    }
    command
}

fn report(output: &std::process::Output) -> String {
    format!(
        "status {:?}\nstdout:\n{}\nstderr:\n{}",
        output.status,
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    )
}

/// The audit's MPI-style job: two ranks of one C program (so one program name) checkpoint side
/// by side, "crash" after iteration 7, and are started again. Each gets its own checkpoints by
/// default (its rank is in its default name), so each recovers its own iteration-6 state and
/// ends with its own result; they used to share one stream, refuse each other's ids, and
/// recover each other's data with AGORA_STATUS_OK.
#[test]
fn ranks_of_one_c_program_checkpoint_and_recover_their_own_data() {
    let (_scratch, prefix, program) = rank_checks();
    let daemon = agora_test_support::EmbeddedDaemon::start("capi-ranks", |_| {});
    let run_ranks = |stop: &str| -> Vec<std::process::Output> {
        let children: Vec<_> = ["0", "1"]
            .iter()
            .map(|rank| {
                let value = if *rank == "0" { "1" } else { "2" };
                rank_command(
                    &program,
                    &prefix,
                    daemon.socket(),
                    &["solver", value, "10", "2", stop],
                    Some(rank),
                )
                .stdout(std::process::Stdio::piped())
                .stderr(std::process::Stdio::piped())
                .spawn()
                .unwrap()
            })
            .collect();
        children.into_iter().map(|c| c.wait_with_output().unwrap()).collect()
    };
    for output in run_ranks("7") {
        assert_eq!(output.status.code(), Some(3), "{}", report(&output));
    }
    for output in run_ranks("0") {
        let text = report(&output);
        assert!(output.status.success(), "{text}");
        assert!(text.contains("recovered checkpoint 6"), "{text}");
        assert!(text.contains("rank checks: 0 failed"), "{text}");
    }
    daemon.stop().unwrap();
}

/// Two live processes of one program and user, no rank, one default name: the second one's
/// checkpoints are refused with the holder's pid and how to name each process, a session named
/// with `agora_session_open_with` checkpoints, and once the holder ends the name is free.
#[test]
fn a_second_live_process_of_a_c_program_is_refused_its_checkpoints_until_the_first_ends() {
    use std::io::{BufRead, BufReader, Write};
    use std::process::Stdio;
    let (_scratch, prefix, program) = rank_checks();
    let daemon = agora_test_support::EmbeddedDaemon::start("capi-collision", |_| {});
    let mut holder = rank_command(&program, &prefix, daemon.socket(), &["holder"], None)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let mut line = String::new();
    BufReader::new(holder.stdout.as_mut().unwrap())
        .read_line(&mut line)
        .unwrap();
    assert_eq!(line.trim(), "holding", "the holder did not checkpoint");
    let mut second = rank_command(
        &program,
        &prefix,
        daemon.socket(),
        &["second", &holder.id().to_string()],
        None,
    )
    .stdin(Stdio::piped())
    .stdout(Stdio::piped())
    .stderr(Stdio::piped())
    .spawn()
    .unwrap();
    let mut stdout = BufReader::new(second.stdout.take().unwrap());
    line.clear();
    stdout.read_line(&mut line).unwrap();
    assert_eq!(line.trim(), "refused while the holder lives");
    writeln!(holder.stdin.as_mut().unwrap()).unwrap();
    let held = holder.wait_with_output().unwrap();
    assert!(held.status.success(), "{}", report(&held));
    writeln!(second.stdin.as_mut().unwrap()).unwrap();
    let mut rest = String::new();
    std::io::Read::read_to_string(&mut stdout, &mut rest).unwrap();
    let output = second.wait_with_output().unwrap();
    assert!(
        output.status.success() && rest.contains("rank checks: 0 failed"),
        "{rest}\n{}",
        report(&output)
    );
    daemon.stop().unwrap();
}

/// Sessions reserve their whole heap: with a limit that admits one default session, the
/// second is refused saying what it asked for and how a C program asks for less
/// (`AgoraSessionOptions.heap_bytes`), and a session that asks for less gets in.
#[test]
fn a_c_session_refused_for_the_heap_limit_can_ask_for_a_smaller_heap() {
    let (_scratch, prefix, program) = rank_checks();
    let daemon = agora_test_support::EmbeddedDaemon::start("capi-heap", |config| {
        config.session_quota = 64 << 20;
        config.limits.heap_bytes_per_uid = 100 << 20;
        config.limits.exempt_uids.clear();
    });
    let output = rank_command(&program, &prefix, daemon.socket(), &["heap"], None)
        .output()
        .unwrap();
    let text = report(&output);
    assert!(
        output.status.success() && text.contains("rank checks: 0 failed"),
        "{text}"
    );
    daemon.stop().unwrap();
}
