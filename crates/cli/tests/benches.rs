//! `agora bench overhead --quick --json` runs and verifies every program natively and through
//! Agora (it failed on main with CL_INVALID_KERNEL_ARGS: the native OpenCL baseline did not pass
//! the revocable kernels' trailing flag, and no test ran it).

use std::process::Command;

const AGORA: &str = env!("CARGO_BIN_EXE_agora");

#[test]
fn bench_overhead_quick_verifies_every_program_and_reports_its_fields() {
    let dir = agora_test_support::temp_dir("bench-overhead");
    let out = Command::new(AGORA)
        .args(["bench", "overhead", "--quick", "--json"])
        .env("AGORA_STATE_DIR", dir.path().join("state"))
        .env("AGORA_LOG", "warn")
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let report: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let programs = report["programs"].as_array().expect("programs");
    assert!(!programs.is_empty());
    for p in programs {
        for field in ["program", "device", "size", "launches", "agora_s", "native_s", "ratio"] {
            assert!(!p[field].is_null(), "{field} missing in {p}");
        }
        assert_eq!(p["verified"], true, "{p}");
    }
    assert!(
        programs.iter().any(|p| p["device"] == "opencl"),
        "the native OpenCL baseline ran"
    );
    assert!(report["geomean_ratio"].as_f64().is_some_and(|r| r > 0.0));
}

/// `agora bench stall` refuses an attack on OpenCL against a daemon that has no OpenCL device
/// (a queue only prefers a kind: the attack would run on the CPU and the figures would say
/// nothing of OpenCL), with a message that says what to do. The daemon the bench starts is made
/// one without OpenCL by `AGORA_BENCH_DAEMON`, a wrapper that adds `--no-opencl`.
#[test]
fn bench_stall_refuses_an_opencl_attack_without_an_opencl_device() {
    use std::os::unix::fs::PermissionsExt;
    let dir = agora_test_support::temp_dir("bench-stall-no-opencl");
    let wrapper = dir.path().join("agora-without-opencl");
    std::fs::write(&wrapper, format!("#!/bin/sh\nexec '{AGORA}' \"$@\" --no-opencl\n")).unwrap();
    std::fs::set_permissions(&wrapper, std::fs::Permissions::from_mode(0o755)).unwrap();
    for attack in [
        &["--attack", "departures"][..],
        &["--attack", "evictions"][..],
        &["--attack", "tiny-launches", "--attack-device", "opencl"][..],
    ] {
        let out = Command::new(AGORA)
            .args(["bench", "stall", "--quick", "--json"])
            .args(attack)
            .env("AGORA_STATE_DIR", dir.path().join("state"))
            .env("AGORA_LOG", "warn")
            .env("AGORA_BENCH_DAEMON", &wrapper)
            .output()
            .unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{attack:?} ran without OpenCL: {stderr}");
        assert!(
            stderr.contains("the daemon has no OpenCL device") && stderr.contains("scripts/setup.sh"),
            "{attack:?}: {stderr}"
        );
    }
}

/// `agora bench stall`'s sizes and places belong to one attack each: given to another, the bench
/// says which attack they size instead of ignoring them.
#[test]
fn bench_stall_refuses_options_of_another_attack() {
    for (args, says) in [
        (&["--departure-mib", "8"][..], "add --attack departures"),
        (&["--eviction-mib", "8"][..], "add --attack evictions"),
        (
            &["--attack", "evictions", "--attack-device", "opencl"][..],
            "the evictions attack always runs on OpenCL",
        ),
    ] {
        let out = Command::new(AGORA)
            .args(["bench", "stall", "--quick", "--json"])
            .args(args)
            .output()
            .unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success() && stderr.contains(says), "{args:?}: {stderr}");
    }
}
