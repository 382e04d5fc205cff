//! RAPL energy counters of the host's CPU packages (`/sys/class/powercap/intel-rapl:N`).
//!
//! Readable on bare-metal Intel and AMD Linux hosts (often root-only since CVE-2020-8694);
//! absent in most VMs and containers. Callers fall back to the configured power model and say so.

use std::path::PathBuf;

/// The package-level RAPL domains of this host.
#[derive(Debug, Clone)]
pub struct Rapl {
    domains: Vec<(PathBuf, u64)>,
}

/// Why RAPL cannot be used here.
pub fn unavailable_reason() -> Option<String> {
    Rapl::open().err()
}

impl Rapl {
    /// Finds the package domains and checks that their counters can be read.
    pub fn open() -> Result<Rapl, String> {
        let root = PathBuf::from("/sys/class/powercap");
        let entries = std::fs::read_dir(&root).map_err(|e| format!("{} cannot be read ({e})", root.display()))?;
        let mut domains = Vec::new();
        for entry in entries.flatten() {
            let name = entry.file_name().to_string_lossy().to_string();
            // Packages are `intel-rapl:N` (AMD exposes the same interface); sub-domains are
            // `intel-rapl:N:M` and are included in their package.
            if !name.starts_with("intel-rapl:") || name.matches(':').count() != 1 {
                continue;
            }
            let path = entry.path();
            let range = std::fs::read_to_string(path.join("max_energy_range_uj"))
                .ok()
                .and_then(|t| t.trim().parse::<u64>().ok())
                .unwrap_or(u64::MAX);
            std::fs::read_to_string(path.join("energy_uj")).map_err(|e| {
                format!(
                    "{}/energy_uj cannot be read ({e}); run as root or relax its mode",
                    path.display()
                )
            })?;
            domains.push((path, range));
        }
        if domains.is_empty() {
            return Err(format!("{} has no intel-rapl package domain", root.display()));
        }
        Ok(Rapl { domains })
    }

    /// The counters now, one per package, in microjoules.
    pub fn read(&self) -> Vec<u64> {
        self.domains
            .iter()
            .map(|(path, _)| {
                std::fs::read_to_string(path.join("energy_uj"))
                    .ok()
                    .and_then(|t| t.trim().parse().ok())
                    .unwrap_or(0)
            })
            .collect()
    }

    /// Joules between two readings, allowing for counter wrap-around.
    pub fn joules_between(&self, before: &[u64], after: &[u64]) -> f64 {
        let mut total = 0u64;
        for ((b, a), (_, range)) in before.iter().zip(after).zip(&self.domains) {
            total += if a >= b { a - b } else { range - b + a };
        }
        total as f64 / 1e6
    }
}
