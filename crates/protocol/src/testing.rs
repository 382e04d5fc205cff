//! Test support shared by the daemon and the tests that check it: the rule of the daemon's
//! test-only fault injection (`AGORA_INJECT_FAULTS=SEED:PER_MILLE`), so a test can predict
//! which tasks the daemon fails.

/// Whether the fault-injection rule with `seed` and `per_mille` picks task `task` to fail:
/// a SplitMix64 hash of the seed and the task id, below `per_mille` out of 1000.
pub fn injected_fault(seed: u64, per_mille: u64, task: u64) -> bool {
    let mut z = seed ^ task.wrapping_mul(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^= z >> 31;
    z % 1000 < per_mille
}
