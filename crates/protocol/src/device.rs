//! Kinds of device, as clients, the daemon and its device layer name them.
//!
//! Owns the one [`DeviceKind`] enum and its lower-case names (`cpu`, `opencl`, `cuda`, `sim`): the names
//! a client puts in a queue's device preference, `agora status` shows, and configuration files
//! and command lines use. Must not describe devices beyond their kind (that is the daemon's).

use serde::{Deserialize, Serialize};

/// Kinds of device. A queue's preference for a kind is a hint: the daemon honours it when a
/// device of that kind implements the kernel, and otherwise runs the task elsewhere.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum DeviceKind {
    /// Host CPU cores.
    Cpu,
    /// An OpenCL device (any platform: PoCL on the CPU, a GPU, an FPGA).
    OpenCl,
    /// An NVIDIA GPU, through the CUDA driver (loaded at run time).
    Cuda,
    /// A modeled device (`sim`) declared in the daemon's configuration: exact results, modeled
    /// time; for scale tests.
    Sim,
}

impl DeviceKind {
    /// Every kind, in the order `agora devices` lists them.
    pub const ALL: [DeviceKind; 4] = [DeviceKind::Cpu, DeviceKind::OpenCl, DeviceKind::Cuda, DeviceKind::Sim];

    /// The lower-case name (`cpu`, `opencl`, `cuda`, `sim`).
    pub fn name(self) -> &'static str {
        match self {
            DeviceKind::Cpu => "cpu",
            DeviceKind::OpenCl => "opencl",
            DeviceKind::Cuda => "cuda",
            DeviceKind::Sim => "sim",
        }
    }

    /// The kind named `name` (as [`DeviceKind::name`] spells it).
    pub fn parse(name: &str) -> Option<DeviceKind> {
        DeviceKind::ALL.into_iter().find(|k| k.name() == name)
    }
}

impl std::fmt::Display for DeviceKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // `pad`, so widths and alignment apply (`{:<8}` in tables).
        f.pad(self.name())
    }
}

/// A kind equals its name (`kind == "cuda"`), as reports and tests compare it.
impl PartialEq<&str> for DeviceKind {
    fn eq(&self, name: &&str) -> bool {
        self.name() == *name
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_parse_back() {
        for kind in DeviceKind::ALL {
            assert_eq!(DeviceKind::parse(kind.name()), Some(kind));
            assert_eq!(kind.to_string(), kind.name());
        }
        assert_eq!(format!("{:<8}|", DeviceKind::Cuda), "cuda    |");
        assert!(DeviceKind::OpenCl == "opencl" && DeviceKind::Cpu != "opencl");
        assert_eq!(DeviceKind::parse("any"), None);
        assert_eq!(DeviceKind::parse("OpenCL"), None);
    }
}
