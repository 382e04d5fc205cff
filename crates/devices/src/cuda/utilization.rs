//! How busy a GPU is, as the driver's management library (NVML) measures it: the percentage of
//! the last sample period (1/6 s to 1 s, by GPU) in which one or more kernels ran, whoever's they
//! were — Agora's tenants and any process outside Agora.
//!
//! NVML is loaded at run time (nvml-wrapper), once per process, from the driver's
//! `libnvidia-ml.so.1` (what the driver package installs; the unversioned name comes only with
//! development packages). Where it cannot be loaded or the GPU does not report utilisation (some
//! virtualised GPUs, MIG instances), there is no figure: status shows none, and one line says why.
//!
//! Owns only reading the figure; it must not change any GPU setting (NVML can, with privilege).

use std::sync::OnceLock;

use nvml_wrapper::Nvml;

/// The library, loaded at the first question (`None`: not loadable here; said once).
fn library() -> Option<&'static Nvml> {
    static NVML: OnceLock<Option<Nvml>> = OnceLock::new();
    NVML.get_or_init(|| {
        let loaded = Nvml::builder()
            .lib_path(std::ffi::OsStr::new("libnvidia-ml.so.1"))
            .init()
            .or_else(|_| Nvml::init());
        loaded
            .inspect_err(|e| tracing::info!(error = %e, "no GPU utilisation figures: NVML did not load"))
            .ok()
    })
    .as_ref()
}

/// The GPU at `pci_bus_id` (as `cuDeviceGetPCIBusId` spells it), as NVML knows it.
#[derive(Debug)]
pub(super) struct Utilization {
    pci_bus_id: String,
    /// A failure was logged already (every later one is the same).
    said: std::sync::atomic::AtomicBool,
}

impl Utilization {
    pub(super) fn new(pci_bus_id: String) -> Self {
        Utilization {
            pci_bus_id,
            said: std::sync::atomic::AtomicBool::new(false),
        }
    }

    /// Percent of the last sample period in which a kernel ran on the GPU, or `None` where NVML
    /// has no figure.
    pub(super) fn percent(&self) -> Option<u32> {
        let nvml = library()?;
        nvml.device_by_pci_bus_id(self.pci_bus_id.as_str())
            .and_then(|device| device.utilization_rates())
            .map(|rates| rates.gpu)
            .inspect_err(|e| {
                if !self.said.swap(true, std::sync::atomic::Ordering::Relaxed) {
                    tracing::info!(pci_bus_id = %self.pci_bus_id, error = %e, "no utilisation figure from NVML for this GPU");
                }
            })
            .ok()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Without NVML (this machine, CI) or with a bus id no GPU has, there is no figure, and no
    /// panic: the daemon's status still works.
    #[test]
    fn an_unknown_gpu_has_no_figure() {
        let gpu = Utilization::new("0000:ff:1f.7".into());
        assert_eq!(gpu.percent(), None);
        assert_eq!(gpu.percent(), None, "asked again (the failure was said once)");
    }
}
