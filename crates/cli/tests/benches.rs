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
