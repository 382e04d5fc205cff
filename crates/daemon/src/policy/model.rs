//! The learned performance model: how long each kernel takes on each device, by problem size.
//!
//! XiTAO-style: one running average per (kernel, device, size bucket), where a bucket is a power
//! of two of the launch's work items, updated as `old × w + new × (1 − w)` with `w` = 0.8 (the
//! 4:1 weighting of old to new). Each entry also keeps the running average of its items, so an
//! estimate inside a bucket scales linearly from it. For a bucket never measured on a device, a
//! per-(kernel, device) regression `ln t = a + b ln items` over the measured buckets gives an
//! estimate (with one bucket measured: linear scaling from it); with none measured the device is
//! *untried* for the kernel, and policies try it before trusting anything else.
//!
//! The model is persisted as JSON in the daemon's state directory (`perf-model.json`), keyed by
//! kernel and device *names*, so it survives restarts; entries of devices this daemon does not
//! have are kept and written back. `agora model show` prints it.
//!
//! Must not decide anything: policies read it, the scheduler feeds it.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};

/// The model's name for a job's copies between host memory and a device: measured like a
/// kernel whose work items are the bytes copied (every job with copies, each direction and
/// buffer together), so each device's link is learned as a time per size bucket (StarPU
/// calibrates its bus and persists it the same way). The scheduler books a job's copies by the
/// bucket of their size once measured (never by the regression: small copies are mostly fixed
/// cost). Parentheses keep it apart from every kernel name.
pub const TRANSFERS: &str = "(transfers)";

/// How long a mark that a task went to measure a (kernel, device, bucket) for the first time
/// keeps other tasks from exploring it ([`PerformanceModel::is_exploring`]). A mark whose task
/// never ran there (placed again elsewhere: its device failed or its memory wait ended on
/// another, its session went) would otherwise keep that device unexplored for as long as the
/// daemon runs; a first run longer than this lets one more task explore meanwhile.
pub const EXPLORING_LAPSES_AFTER: Duration = Duration::from_secs(10);

/// File name of the persisted model inside the state directory.
pub const MODEL_FILE: &str = "perf-model.json";

/// Format version of the model file this build writes and the newest it reads.
pub const MODEL_VERSION: u32 = 1;

/// Why a saved model was not loaded. The daemon warns and starts with an empty model in each
/// case: state is an optimisation, never a reason not to start.
#[derive(Debug, thiserror::Error)]
pub enum ModelLoadError {
    /// The file (or its directory) cannot be read.
    #[error("cannot read {path}: {cause}")]
    Unreadable {
        /// The file.
        path: PathBuf,
        /// The OS error.
        cause: std::io::Error,
    },
    /// The file is not a model (damaged, or not ours); the next save replaces it.
    #[error("{path} is not a performance model ({cause}); a new one replaces it at the next save")]
    Corrupt {
        /// The file.
        path: PathBuf,
        /// What the parser said.
        cause: String,
    },
    /// Written by a newer Agora in a format this one does not know; it is left as it is.
    #[error(
        "{path} was written by a newer Agora (model format {found}; this one reads up to {supported}); \
         it is left as it is and this daemon keeps what it learns in memory only"
    )]
    Newer {
        /// The file.
        path: PathBuf,
        /// Its format version.
        found: u64,
        /// The newest this build reads ([`MODEL_VERSION`]).
        supported: u32,
    },
}

/// One measured (kernel, device, size bucket).
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct Entry {
    /// Running average of the execution time, nanoseconds.
    pub mean_ns: f64,
    /// Running average of the work items of the measured launches.
    pub mean_items: f64,
    /// Measurements folded in.
    pub samples: u64,
}

/// A row of the persisted file.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Row {
    /// Kernel name.
    pub kernel: String,
    /// Device name.
    pub device: String,
    /// Size bucket: launches of `2^bucket ..= 2^(bucket+1) − 1` work items.
    pub bucket: u32,
    /// The measurements.
    #[serde(flatten)]
    pub entry: Entry,
}

#[derive(Debug, Serialize, Deserialize)]
struct ModelFile {
    version: u32,
    history_weight: f64,
    rows: Vec<Row>,
}

/// The size bucket of a launch of `items` work items.
pub fn bucket(items: u64) -> u32 {
    63 - items.max(1).leading_zeros()
}

/// What the model knows of one kernel on one device.
#[derive(Debug, Clone, Default)]
struct Pair {
    /// Measured buckets.
    buckets: BTreeMap<u32, Entry>,
    /// Buckets sent to the device to be measured for the first time and not yet measured, and
    /// since when: others are not sent to explore the same thing (for
    /// [`EXPLORING_LAPSES_AFTER`]).
    exploring: BTreeMap<u32, Instant>,
}

/// The performance model.
///
/// Keyed kernel → device in two levels, so a lookup by `&str` names allocates nothing (the
/// dispatcher looks it up for placements and every lane completion records into it, under the
/// model's lock).
#[derive(Debug, Clone)]
pub struct PerformanceModel {
    history_weight: f64,
    entries: BTreeMap<String, BTreeMap<String, Pair>>,
    dirty: bool,
    /// Never written: the file belongs to a newer version ([`ModelLoadError::Newer`]).
    leave_file_alone: bool,
}

/// How an estimate was made.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Estimate {
    /// From a measured entry of the task's size bucket.
    Measured(f64),
    /// From the regression over other buckets of the same kernel and device.
    Regressed(f64),
    /// Nothing measured for this kernel on this device.
    Untried,
}

impl Estimate {
    /// Nanoseconds, if any estimate exists.
    pub fn ns(self) -> Option<f64> {
        match self {
            Estimate::Measured(ns) | Estimate::Regressed(ns) => Some(ns),
            Estimate::Untried => None,
        }
    }
}

impl PerformanceModel {
    /// An empty model; `history_weight` is the weight of the old average (0.8: XiTAO's 4:1).
    pub fn new(history_weight: f64) -> Self {
        PerformanceModel {
            history_weight,
            entries: BTreeMap::new(),
            dirty: false,
            leave_file_alone: false,
        }
    }

    fn pair(&self, kernel: &str, device: &str) -> Option<&Pair> {
        self.entries.get(kernel)?.get(device)
    }

    /// The pair's entry, created when absent (names are copied only then).
    fn pair_mut(&mut self, kernel: &str, device: &str) -> &mut Pair {
        if !self.entries.contains_key(kernel) {
            self.entries.insert(kernel.to_string(), BTreeMap::new());
        }
        let devices = self.entries.get_mut(kernel).expect("inserted above");
        if !devices.contains_key(device) {
            devices.insert(device.to_string(), Pair::default());
        }
        devices.get_mut(device).expect("inserted above")
    }

    /// Folds in one measured execution.
    pub fn record(&mut self, kernel: &str, device: &str, items: u64, ns: f64) {
        let b = bucket(items);
        let w = self.history_weight;
        let pair = self.pair_mut(kernel, device);
        pair.exploring.remove(&b);
        pair.buckets
            .entry(b)
            .and_modify(|e| {
                e.mean_ns = w * e.mean_ns + (1.0 - w) * ns;
                e.mean_items = w * e.mean_items + (1.0 - w) * items as f64;
                e.samples += 1;
            })
            .or_insert(Entry {
                mean_ns: ns,
                mean_items: items.max(1) as f64,
                samples: 1,
            });
        self.dirty = true;
    }

    /// Expected execution time of `kernel` over `items` on `device`.
    pub fn estimate(&self, kernel: &str, device: &str, items: u64) -> Estimate {
        let Some(buckets) = self.pair(kernel, device).map(|p| &p.buckets) else {
            return Estimate::Untried;
        };
        let items_f = items.max(1) as f64;
        if let Some(e) = buckets.get(&bucket(items)) {
            return Estimate::Measured(e.mean_ns * items_f / e.mean_items.max(1.0));
        }
        match fit(buckets) {
            Some((a, b)) => Estimate::Regressed((a + b * items_f.ln()).exp()),
            None => match buckets.values().next() {
                Some(e) => Estimate::Regressed(e.mean_ns * items_f / e.mean_items.max(1.0)),
                None => Estimate::Untried,
            },
        }
    }

    /// Whether a first measurement of this (kernel, device, bucket) is on its way.
    pub fn is_exploring(&self, kernel: &str, device: &str, items: u64) -> bool {
        self.pair(kernel, device)
            .and_then(|p| p.exploring.get(&bucket(items)))
            .is_some_and(|since| since.elapsed() < EXPLORING_LAPSES_AFTER)
    }

    /// Notes that a task was sent to measure this (kernel, device, bucket) for the first time.
    pub fn start_exploring(&mut self, kernel: &str, device: &str, items: u64) {
        self.pair_mut(kernel, device)
            .exploring
            .insert(bucket(items), Instant::now());
    }

    /// Forgets an exploration whose task failed (so another task may try).
    pub fn abandon_exploring(&mut self, kernel: &str, device: &str, items: u64) {
        if let Some(pair) = self.entries.get_mut(kernel).and_then(|d| d.get_mut(device)) {
            pair.exploring.remove(&bucket(items));
        }
    }

    /// The regression of a kernel on a device: `(a, b)` in `ln t = a + b ln items`, when two or
    /// more buckets are measured.
    pub fn regression(&self, kernel: &str, device: &str) -> Option<(f64, f64)> {
        self.pair(kernel, device).and_then(|p| fit(&p.buckets))
    }

    /// Every entry, sorted by kernel, device, bucket.
    pub fn rows(&self) -> Vec<Row> {
        self.entries
            .iter()
            .flat_map(|(kernel, devices)| {
                devices.iter().flat_map(move |(device, pair)| {
                    pair.buckets.iter().map(move |(b, e)| Row {
                        kernel: kernel.clone(),
                        device: device.clone(),
                        bucket: *b,
                        entry: *e,
                    })
                })
            })
            .collect()
    }

    /// Whether it changed since it was last saved or loaded.
    pub fn is_dirty(&self) -> bool {
        self.dirty
    }

    /// Marks the model saved (the caller writes a snapshot of it outside the lock).
    pub fn mark_saved(&mut self) {
        self.dirty = false;
    }

    /// A save of it failed: it is saved again at the next chance (the periodic save, shutdown).
    pub fn mark_unsaved(&mut self) {
        self.dirty = true;
    }

    /// The model file in `state_dir`.
    pub fn path(state_dir: &Path) -> PathBuf {
        state_dir.join(MODEL_FILE)
    }

    /// Makes [`PerformanceModel::save`] a no-op: the file there is not this version's to
    /// replace.
    pub fn leave_file_alone(&mut self) {
        self.leave_file_alone = true;
    }

    /// Loads the model saved in `state_dir`; an absent file is an empty model.
    pub fn load(state_dir: &Path, history_weight: f64) -> Result<Self, ModelLoadError> {
        let path = Self::path(state_dir);
        let mut model = PerformanceModel::new(history_weight);
        let text = match std::fs::read_to_string(&path) {
            Ok(t) => t,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(model),
            Err(cause) => return Err(ModelLoadError::Unreadable { path, cause }),
        };
        let corrupt = |cause: String| ModelLoadError::Corrupt {
            path: path.clone(),
            cause,
        };
        // The version first: a newer format may not parse as this one.
        let value: serde_json::Value = serde_json::from_str(&text).map_err(|e| corrupt(e.to_string()))?;
        let found = value
            .get("version")
            .and_then(serde_json::Value::as_u64)
            .ok_or_else(|| corrupt("no format version".into()))?;
        if found > u64::from(MODEL_VERSION) {
            return Err(ModelLoadError::Newer {
                path,
                found,
                supported: MODEL_VERSION,
            });
        }
        let file: ModelFile = serde_json::from_value(value).map_err(|e| corrupt(e.to_string()))?;
        for row in file.rows {
            // The file is ours but may have been edited: keep only sensible numbers.
            if row.entry.mean_ns.is_finite()
                && row.entry.mean_ns >= 0.0
                && row.entry.mean_items >= 1.0
                && row.bucket < 64
            {
                model
                    .pair_mut(&row.kernel, &row.device)
                    .buckets
                    .insert(row.bucket, row.entry);
            }
        }
        Ok(model)
    }

    /// Writes the model to `state_dir` (atomically: a temporary file renamed over the old one).
    pub fn save(&mut self, state_dir: &Path) -> Result<(), String> {
        if self.leave_file_alone {
            self.dirty = false;
            return Ok(());
        }
        std::fs::create_dir_all(state_dir).map_err(|e| format!("cannot create {}: {e}", state_dir.display()))?;
        let file = ModelFile {
            version: MODEL_VERSION,
            history_weight: self.history_weight,
            rows: self.rows(),
        };
        let text = serde_json::to_string_pretty(&file).map_err(|e| e.to_string())?;
        let path = Self::path(state_dir);
        crate::state_files::write_bytes_replacing(&path, text.as_bytes())
            .map_err(|e| format!("cannot write {}: {e}", path.display()))?;
        self.dirty = false;
        Ok(())
    }
}

/// Least squares of `ln mean_ns` on `ln mean_items` over the buckets; the exponent is kept in
/// [0, 3] (no kernel here gets faster with size or grows faster than cubically).
fn fit(buckets: &BTreeMap<u32, Entry>) -> Option<(f64, f64)> {
    if buckets.len() < 2 {
        return None;
    }
    let points: Vec<(f64, f64)> = buckets
        .values()
        .map(|e| (e.mean_items.max(1.0).ln(), e.mean_ns.max(1.0).ln()))
        .collect();
    let n = points.len() as f64;
    let mx = points.iter().map(|p| p.0).sum::<f64>() / n;
    let my = points.iter().map(|p| p.1).sum::<f64>() / n;
    let sxx: f64 = points.iter().map(|p| (p.0 - mx).powi(2)).sum();
    if sxx < 1e-12 {
        return None;
    }
    let sxy: f64 = points.iter().map(|p| (p.0 - mx) * (p.1 - my)).sum();
    let b = (sxy / sxx).clamp(0.0, 3.0);
    Some((my - b * mx, b))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn running_average_weighs_old_to_new_four_to_one() {
        let mut m = PerformanceModel::new(0.8);
        m.record("k", "d", 1000, 100.0);
        m.record("k", "d", 1000, 200.0);
        assert_eq!(
            m.estimate("k", "d", 1000),
            Estimate::Measured(100.0 * 0.8 + 200.0 * 0.2)
        );
        assert_eq!(m.rows()[0].entry.samples, 2);
    }

    #[test]
    fn unseen_sizes_are_regressed_and_unseen_devices_untried() {
        let mut m = PerformanceModel::new(0.8);
        // t = 2 * items^1.5
        for items in [1u64 << 10, 1 << 14, 1 << 18] {
            m.record("k", "d", items, 2.0 * (items as f64).powf(1.5));
        }
        let (_, b) = m.regression("k", "d").unwrap();
        assert!((b - 1.5).abs() < 1e-9, "{b}");
        let Estimate::Regressed(ns) = m.estimate("k", "d", 1 << 22) else {
            panic!()
        };
        let expected = 2.0 * ((1u64 << 22) as f64).powf(1.5);
        assert!((ns / expected - 1.0).abs() < 1e-6);
        assert_eq!(m.estimate("k", "other", 1 << 10), Estimate::Untried);
        assert_eq!(m.estimate("other", "d", 1 << 10), Estimate::Untried);
    }

    #[test]
    fn exploration_is_marked_until_measured() {
        let mut m = PerformanceModel::new(0.8);
        m.start_exploring("k", "d", 100);
        assert!(m.is_exploring("k", "d", 120));
        m.record("k", "d", 100, 5.0);
        assert!(!m.is_exploring("k", "d", 100));
        // A mark whose task never reported lapses.
        m.start_exploring("k", "e", 100);
        let mark = m
            .entries
            .get_mut("k")
            .unwrap()
            .get_mut("e")
            .unwrap()
            .exploring
            .get_mut(&bucket(100))
            .unwrap();
        *mark -= EXPLORING_LAPSES_AFTER;
        assert!(!m.is_exploring("k", "e", 100));
    }

    #[test]
    fn saves_and_loads() {
        let dir = std::env::temp_dir().join(format!("agora-model-test-{}", std::process::id()));
        let mut m = PerformanceModel::new(0.8);
        m.record("sgemm", "cpu0", 4096, 1e6);
        m.record("saxpy", "sim0", 1 << 20, 2e5);
        m.save(&dir).unwrap();
        assert!(!m.is_dirty());
        let back = PerformanceModel::load(&dir, 0.8).unwrap();
        assert_eq!(back.rows(), m.rows());
        std::fs::write(PerformanceModel::path(&dir), "not json").unwrap();
        assert!(PerformanceModel::load(&dir, 0.8)
            .unwrap_err()
            .to_string()
            .contains("not a performance model"));
        std::fs::remove_dir_all(&dir).unwrap();
        assert!(PerformanceModel::load(&dir, 0.8).unwrap().rows().is_empty());
    }
}
