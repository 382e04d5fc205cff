//! The store: writing checkpoints at each level, listing them, recovering the newest intact
//! one, retention and garbage collection.
//!
//! Owns the directory layout, per level root (`local`, `partner`, `shared`):
//!
//! ```text
//! <root>/<uid>/<name>/blocks/<blake3 hex>            content-addressed blocks (L1, L2, L4)
//! <root>/<uid>/<name>/manifests/<sequence:020>.json  one per complete checkpoint
//! <root>/<uid>/<name>/erasure/<sequence:020>/shard-<i>   L3 shards (local root only)
//! ```
//!
//! and the order of operations that keeps it crash consistent: data (blocks, shards) durable
//! first, then the manifest, then retention. It must not know what the bytes are, nor anything
//! of sessions, devices or the protocol.
//!
//! Locking: one reader–writer lock per application. Writes (and their garbage collection) and
//! removal are exclusive; `list` and `latest` share, so a reader never sees blocks vanish under a
//! manifest it is verifying. Different applications never contend.

use std::collections::{BTreeSet, HashMap, HashSet};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, PoisonError, RwLock};
use std::time::{Instant, SystemTime, UNIX_EPOCH};

use crate::config::{AppKey, Capture, CheckpointInfo, Entry, Level, Recovered, StoreConfig, WriteReport};
use crate::erasure;
use crate::error::StoreError;
use crate::fsio::{self, TEMP_PREFIX};
use crate::manifest::{self, ErasureInfo, Manifest, ManifestEntry};

/// Creates `root` if need be and checks that a file can be written in it (a read-only mount
/// passes creation); its canonical path, or the system's reason.
fn usable_dir(root: &Path) -> Result<PathBuf, String> {
    let reason = |e: StoreError| match e {
        StoreError::Io { source, .. } => plain(&source),
        other => other.to_string(),
    };
    fsio::ensure_dir(root).map_err(reason)?;
    let probe = root.join(format!("{TEMP_PREFIX}probe-{}", std::process::id()));
    std::fs::write(&probe, b"").map_err(|e| plain(&e))?;
    let _ = std::fs::remove_file(&probe);
    root.canonicalize().map_err(|e| plain(&e))
}

/// An I/O error's message without its " (os error N)" suffix.
fn plain(e: &std::io::Error) -> String {
    let text = e.to_string();
    match text.find(" (os error") {
        Some(at) => text[..at].to_string(),
        None => text,
    }
}

/// Subdirectory of content-addressed blocks.
const BLOCKS: &str = "blocks";
/// Subdirectory of manifests.
const MANIFESTS: &str = "manifests";
/// Subdirectory of L3 shard directories.
const ERASURE: &str = "erasure";
/// Subdirectory of the manifests of damaged checkpoints [`Store::resume`] set aside: kept for
/// inspection, no longer taking their ids.
const DAMAGED: &str = "damaged";

/// The checkpoint store of one node. See the crate documentation.
#[derive(Debug)]
pub struct Store {
    /// The validated configuration.
    config: StoreConfig,
    /// One lock per application that has been touched; never shrinks (an entry is a few bytes,
    /// and removing one while another thread holds it would let two writers in).
    locks: Mutex<HashMap<AppKey, Arc<RwLock<()>>>>,
    /// The configured `partner`/`shared` directories that could not be used, and why: their
    /// levels are refused naming them, the others work.
    unusable: Vec<Unusable>,
}

/// A configured level directory ([`StoreConfig::partner`] or [`StoreConfig::shared`]) that
/// [`Store::open`] could not use.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Unusable {
    /// The level that needs it (L2 or L4).
    pub level: Level,
    /// Its configuration key (`partner`, `shared`).
    pub key: &'static str,
    /// The directory.
    pub directory: PathBuf,
    /// Why it is unusable (the system's message, e.g. "Not a directory").
    pub reason: String,
}

impl Unusable {
    /// The refusal of a checkpoint at its level, naming the key, the directory and the reason.
    pub fn message(&self) -> String {
        format!(
            "checkpoint.{} = {} is unusable: {}; fix it and restart the daemon",
            self.key,
            self.directory.display(),
            self.reason
        )
    }
}

/// What writing the data of one checkpoint did.
struct DataWritten {
    entries: Vec<ManifestEntry>,
    erasure: Option<ErasureInfo>,
    blocks_total: u64,
    blocks_written: u64,
    bytes_written: u64,
}

impl Store {
    /// Opens (creating, mode 0700) the configured directories after checking the configuration:
    /// `keep` >= 1, shards >= 1 each and at most 256 together, `block_bytes` in 4 KiB..=64 MiB,
    /// and no two level directories the same (a copy in the same place protects nothing).
    ///
    /// An unusable `local` directory is an error. An unusable `partner` or `shared` one (it
    /// cannot be created, or a file cannot be written in it) is not: the store opens without
    /// it, so levels 1 and 3 (and the other level) keep working, and writes at its level are
    /// refused with [`StoreError::LevelUnusable`]; [`Store::unusable`] lists them.
    pub fn open(mut config: StoreConfig) -> Result<Store, StoreError> {
        config.validate()?;
        let mut seen: Vec<(PathBuf, &'static str)> = Vec::new();
        let mut unusable = Vec::new();
        for (level, key) in [(Level::L1, "local"), (Level::L2, "partner"), (Level::L4, "shared")] {
            let root = match level {
                Level::L1 => Some(config.local.clone()),
                Level::L2 => config.partner.clone(),
                _ => config.shared.clone(),
            };
            let Some(root) = root else { continue };
            let canonical = match usable_dir(&root) {
                Ok(canonical) => canonical,
                Err(_) if level == Level::L1 => {
                    fsio::ensure_dir(&root)?;
                    root.canonicalize()
                        .map_err(|e| StoreError::io("resolve directory", &root, e))?
                }
                Err(reason) => {
                    match level {
                        Level::L2 => config.partner = None,
                        _ => config.shared = None,
                    }
                    unusable.push(Unusable {
                        level,
                        key,
                        directory: root,
                        reason,
                    });
                    continue;
                }
            };
            if let Some((_, other)) = seen.iter().find(|(p, _)| *p == canonical) {
                return Err(StoreError::BadConfig {
                    what: format!(
                        "`{key}` and `{other}` are the same directory {}: give each level its own",
                        root.display()
                    ),
                });
            }
            seen.push((canonical, key));
        }
        Ok(Store {
            config,
            locks: Mutex::new(HashMap::new()),
            unusable,
        })
    }

    /// The configured `partner`/`shared` directories [`Store::open`] could not use.
    pub fn unusable(&self) -> &[Unusable] {
        &self.unusable
    }

    /// Writes one checkpoint durably and applies retention.
    ///
    /// Refuses a sequence number not above the newest existing checkpoint's
    /// ([`StoreError::StaleSequence`]), a level whose directory is not configured
    /// ([`StoreError::LevelNotConfigured`]) and duplicate entry ids. When this returns `Ok` the
    /// checkpoint is complete and durable. Retention (deleting checkpoints beyond `keep` and
    /// blocks nothing kept references) is best effort: a failure there leaves extra files that
    /// the next write reclaims, and does not fail this write.
    pub fn write(&self, app: &AppKey, capture: Capture) -> Result<WriteReport, StoreError> {
        app.check()?;
        let started = Instant::now();
        let roots = self.write_roots(capture.level)?;
        let mut ids = HashSet::new();
        if let Some(dup) = capture.entries.iter().find(|e| !ids.insert(e.id)) {
            return Err(StoreError::DuplicateEntry { id: dup.id });
        }
        let lock = self.app_lock(app);
        let _guard = lock.write().unwrap_or_else(PoisonError::into_inner);

        if let Some(&newest) = self.sequences(app)?.last() {
            if capture.sequence <= newest {
                return Err(StoreError::StaleSequence {
                    app: app.to_string(),
                    sequence: capture.sequence,
                    newest,
                });
            }
        }
        let bytes_total: u64 = capture.entries.iter().map(|e| e.bytes.len() as u64).sum();
        if let Some(quota) = self.config.quota_per_user {
            self.check_quota(app, &roots, &capture, quota)?;
        }
        let written = self.write_data_and_manifests(app, &roots, &capture, bytes_total);
        if written.is_err() {
            // What a failed write left (blocks no manifest names, shards, temporaries) goes at
            // once: on a full disk, they kept every later checkpoint from fitting, for good.
            let _ = self.retain(app);
        }
        let data = written?;
        // Best effort, see above: the checkpoint is already complete.
        let _ = self.retain(app);
        Ok(WriteReport {
            sequence: capture.sequence,
            level: capture.level,
            bytes_total,
            bytes_written: data.bytes_written,
            blocks_total: data.blocks_total,
            blocks_written: data.blocks_written,
            seconds: started.elapsed().as_secs_f64(),
        })
    }

    /// [`Store::write`]'s data (blocks or shards) and then its manifest in every root. The
    /// caller holds the application's lock.
    fn write_data_and_manifests(
        &self,
        app: &AppKey,
        roots: &[&Path],
        capture: &Capture,
        bytes_total: u64,
    ) -> Result<DataWritten, StoreError> {
        let data = if capture.level == Level::L3 {
            self.write_erasure(app, capture)?
        } else {
            self.write_blocks(app, roots, &capture.entries)?
        };
        let DataWritten {
            entries,
            erasure,
            blocks_total,
            blocks_written,
            bytes_written,
        } = data;
        let manifest = Manifest {
            format: manifest::FORMAT,
            sequence: capture.sequence,
            level: capture.level,
            created_unix_ms: SystemTime::now()
                .duration_since(UNIX_EPOCH)
                .map_or(0, |d| d.as_millis() as u64),
            bytes_total,
            block_bytes: self.config.block_bytes,
            entries,
            erasure,
        };
        let encoded = manifest::encode(&manifest)?;
        if let Some(pause) = self.config.test_pause_before_manifest {
            std::thread::sleep(pause);
        }
        // The manifest goes last and makes the checkpoint complete; every copy names data that is
        // already durable in its own root.
        for root in roots {
            let dir = app_dir(root, app).join(MANIFESTS);
            fsio::ensure_dir(&dir)?;
            fsio::write_atomic(&dir, &manifest::file_name(capture.sequence), &encoded)?;
            fsio::sync_dir(&dir)?;
        }
        // The manifest has the entries now; the caller reports the counts.
        Ok(DataWritten {
            entries: Vec::new(),
            erasure: None,
            blocks_total,
            blocks_written,
            bytes_written,
        })
    }

    /// The complete checkpoints of `app`, oldest first, from their manifests alone (block
    /// contents are not read: cheap). A checkpoint whose manifest is damaged in every copy is
    /// left out, since nothing about it can be trusted; [`Store::latest`] reports it.
    pub fn list(&self, app: &AppKey) -> Result<Vec<CheckpointInfo>, StoreError> {
        app.check()?;
        // Without the application's lock: a write holds it for as long as it takes (seconds for
        // a large checkpoint), and listings come from the daemon's control and dispatcher
        // threads, which must not wait that long. Manifests appear by rename, whole, so a
        // listing sees each complete or not at all; one that retention deletes meanwhile is
        // left out (its manifest no longer loads).
        let mut out = Vec::new();
        for seq in self.sequences(app)? {
            if let Ok(m) = self.load_manifest(app, seq) {
                out.push(CheckpointInfo {
                    sequence: m.sequence,
                    level: m.level,
                    bytes_total: m.bytes_total,
                    entries: m.entries.len(),
                    created_unix_ms: m.created_unix_ms,
                });
            }
        }
        Ok(out)
    }

    /// The newest checkpoint of `app` that verifies completely (every block, shard, entry length
    /// and entry hash), falling back to older ones and saying in
    /// [`Recovered::skipped`] which newer ones were passed over and why.
    ///
    /// `Ok(None)` when the application has no checkpoint;
    /// [`StoreError::NoIntactCheckpoint`] when it has some but none verifies.
    pub fn latest(&self, app: &AppKey) -> Result<Option<Recovered>, StoreError> {
        app.check()?;
        let lock = self.app_lock(app);
        let _guard = lock.read().unwrap_or_else(PoisonError::into_inner);
        self.find_latest(app).map(|(recovered, _)| recovered)
    }

    /// [`Store::latest`] for an application that goes on from what it returns: the damaged
    /// checkpoints passed over (every one, when none verifies) are set aside, their manifests
    /// moved to `damaged/` in each directory, so that the application's next checkpoints may
    /// take their ids (those after the one recovered). Their blocks go with the next write's
    /// retention. [`Recovered::skipped`] says which were set aside.
    pub fn resume(&self, app: &AppKey) -> Result<Option<Recovered>, StoreError> {
        app.check()?;
        let lock = self.app_lock(app);
        let _guard = lock.write().unwrap_or_else(PoisonError::into_inner);
        let (mut outcome, damaged) = match self.find_latest(app) {
            Ok((recovered, damaged)) => (Ok(recovered), damaged),
            Err(e @ StoreError::NoIntactCheckpoint { .. }) => (Err(e), self.sequences(app)?),
            Err(e) => return Err(e),
        };
        for &seq in &damaged {
            self.set_aside(app, seq)?;
        }
        let note = |message: &mut String| message.push_str(" (set aside in damaged/: its id is free again)");
        match &mut outcome {
            Ok(Some(recovered)) => recovered.skipped.iter_mut().for_each(note),
            Err(StoreError::NoIntactCheckpoint { problems, .. }) => problems.iter_mut().for_each(note),
            _ => {}
        }
        outcome
    }

    /// The newest id `app`'s checkpoints took, damaged ones included: a new checkpoint must be
    /// numbered above it ([`Store::write`] refuses it otherwise). Cheap (a directory listing).
    pub fn newest_sequence(&self, app: &AppKey) -> Result<Option<u64>, StoreError> {
        app.check()?;
        Ok(self.sequences(app)?.last().copied())
    }

    /// The newest checkpoint that verifies, and the ids of the newer ones that did not. The
    /// caller holds the application's lock.
    fn find_latest(&self, app: &AppKey) -> Result<(Option<Recovered>, Vec<u64>), StoreError> {
        let sequences = self.sequences(app)?;
        if sequences.is_empty() {
            return Ok((None, Vec::new()));
        }
        let mut problems = Vec::new();
        let mut damaged = Vec::new();
        for &seq in sequences.iter().rev() {
            match self.recover(app, seq) {
                Ok((level, entries)) => {
                    let skipped = problems
                        .into_iter()
                        .map(|p| format!("{p}; using checkpoint {seq}"))
                        .collect();
                    let recovered = Recovered {
                        sequence: seq,
                        level,
                        entries,
                        skipped,
                    };
                    return Ok((Some(recovered), damaged));
                }
                Err(why) => {
                    problems.push(why);
                    damaged.push(seq);
                }
            }
        }
        Err(StoreError::NoIntactCheckpoint {
            app: app.to_string(),
            problems,
        })
    }

    /// Moves checkpoint `seq`'s manifest, in every directory that has one, to `damaged/`.
    fn set_aside(&self, app: &AppKey, seq: u64) -> Result<(), StoreError> {
        let name = manifest::file_name(seq);
        for root in self.all_roots() {
            let dir = app_dir(root, app);
            let from = dir.join(MANIFESTS).join(&name);
            if !from.exists() {
                continue;
            }
            let aside = dir.join(DAMAGED);
            fsio::ensure_dir(&aside)?;
            std::fs::rename(&from, aside.join(&name)).map_err(|e| StoreError::io("set aside", &from, e))?;
            fsio::sync_dir(&aside)?;
            fsio::sync_dir(&dir.join(MANIFESTS))?;
        }
        Ok(())
    }

    /// Removes every checkpoint of `app`, at every level. Manifests go first, so a crash midway
    /// leaves no checkpoint that looks complete but has lost its data.
    pub fn remove(&self, app: &AppKey) -> Result<(), StoreError> {
        app.check()?;
        let lock = self.app_lock(app);
        let _guard = lock.write().unwrap_or_else(PoisonError::into_inner);
        for root in self.all_roots() {
            let dir = app_dir(root, app);
            let manifests = dir.join(MANIFESTS);
            let names = fsio::list_names(&manifests)?;
            for name in &names {
                fsio::remove_file(&manifests.join(name))?;
            }
            if !names.is_empty() {
                fsio::sync_dir(&manifests)?;
            }
            fsio::remove_tree(&dir)?;
            if let Some(parent) = dir.parent().filter(|p| p.exists()) {
                fsio::sync_dir(parent)?;
            }
        }
        Ok(())
    }

    /// The lock of `app`.
    fn app_lock(&self, app: &AppKey) -> Arc<RwLock<()>> {
        // The map is only ever inserted into, so a panic elsewhere cannot leave it inconsistent.
        let mut locks = self.locks.lock().unwrap_or_else(PoisonError::into_inner);
        Arc::clone(locks.entry(app.clone()).or_default())
    }

    /// Every configured root: local first (fastest, tried first on recovery).
    fn all_roots(&self) -> Vec<&Path> {
        let mut roots = vec![self.config.local.as_path()];
        roots.extend(self.config.partner.as_deref());
        roots.extend(self.config.shared.as_deref());
        roots
    }

    /// The roots a checkpoint at `level` is written to.
    fn write_roots(&self, level: Level) -> Result<Vec<&Path>, StoreError> {
        let local = self.config.local.as_path();
        let (second, key) = match level {
            Level::L1 | Level::L3 => return Ok(vec![local]),
            Level::L2 => (self.config.partner.as_deref(), "partner"),
            Level::L4 => (self.config.shared.as_deref(), "shared"),
        };
        if let Some(bad) = self.unusable.iter().find(|u| u.level == level) {
            return Err(StoreError::LevelUnusable { message: bad.message() });
        }
        match second {
            Some(dir) => Ok(vec![local, dir]),
            None => Err(StoreError::LevelNotConfigured { level, key }),
        }
    }

    /// The roots to read a checkpoint at `level` from: those it was written to that are still
    /// configured, local first.
    fn read_roots(&self, level: Level) -> Vec<&Path> {
        let mut roots = vec![self.config.local.as_path()];
        match level {
            Level::L1 | Level::L3 => {}
            Level::L2 => roots.extend(self.config.partner.as_deref()),
            Level::L4 => roots.extend(self.config.shared.as_deref()),
        }
        roots
    }

    /// Sequence numbers with a manifest file in any root, ascending. Damaged manifests count:
    /// their sequence numbers are taken. A partner or shared directory that cannot be listed
    /// (gone, replaced by a file, an NFS error) is passed over: level 2 is there to survive
    /// losing either copy, and an unreachable second copy stopped every level's writes and
    /// every recovery. The local directory's error is the caller's.
    fn sequences(&self, app: &AppKey) -> Result<Vec<u64>, StoreError> {
        let mut seqs = BTreeSet::new();
        for (index, root) in self.all_roots().into_iter().enumerate() {
            let names = match fsio::list_names(&app_dir(root, app).join(MANIFESTS)) {
                Ok(names) => names,
                Err(_) if index > 0 => continue,
                Err(e) => return Err(e),
            };
            seqs.extend(names.iter().filter_map(|n| manifest::parse_file_name(n)));
        }
        Ok(seqs.into_iter().collect())
    }

    /// Writes the entries' blocks that are not already present (differential checkpoint) to
    /// every root, each durable before this returns.
    fn write_blocks(&self, app: &AppKey, roots: &[&Path], entries: &[Entry]) -> Result<DataWritten, StoreError> {
        let block = usize::try_from(self.config.block_bytes).unwrap_or(usize::MAX);
        let mut manifest_entries = Vec::with_capacity(entries.len());
        // Distinct blocks in first-seen order: a block repeated (zeroes, say) is written once.
        let mut unique: Vec<(String, &[u8])> = Vec::new();
        let mut seen = HashSet::new();
        for e in entries {
            let mut hashes = Vec::new();
            for chunk in e.bytes.chunks(block) {
                let h = manifest::hash_hex(chunk);
                if seen.insert(h.clone()) {
                    unique.push((h.clone(), chunk));
                }
                hashes.push(h);
            }
            manifest_entries.push(ManifestEntry::of(e, hashes));
        }
        let (mut blocks_written, mut bytes_written) = (0, 0);
        for root in roots {
            let dir = app_dir(root, app).join(BLOCKS);
            fsio::ensure_dir(&dir)?;
            let mut wrote = false;
            for (h, bytes) in &unique {
                // A present block of the right length is trusted, not re-read: reading every
                // block back would cost what dCP saves. Bit rot in it is caught at recovery.
                if fsio::file_has_len(&dir.join(h), bytes.len() as u64)? {
                    continue;
                }
                fsio::write_atomic(&dir, h, bytes)?;
                wrote = true;
                blocks_written += 1;
                bytes_written += bytes.len() as u64;
            }
            if wrote {
                fsio::sync_dir(&dir)?;
            }
        }
        Ok(DataWritten {
            entries: manifest_entries,
            erasure: None,
            blocks_total: unique.len() as u64,
            blocks_written,
            bytes_written,
        })
    }

    /// Refuses `capture` when what it would add to the user's checkpoints (the blocks not yet
    /// present in each root it is written to, or level 3's shards, plus a manifest per root)
    /// would take them past `quota`. Counted over every root's directory of the user, before
    /// anything is written; the retention that follows a write may then free some.
    fn check_quota(&self, app: &AppKey, roots: &[&Path], capture: &Capture, quota: u64) -> Result<(), StoreError> {
        // A manifest: its fixed part and about 80 bytes per block hash (generous).
        let block = self.config.block_bytes.max(1);
        let blocks: u64 = capture
            .entries
            .iter()
            .map(|e| (e.bytes.len() as u64).div_ceil(block))
            .sum();
        let manifest_bytes = 4096 + 80 * blocks;
        let mut adding = manifest_bytes * roots.len() as u64;
        let mut capture_blocks = HashSet::new();
        if capture.level == Level::L3 {
            let (k, m) = (self.config.data_shards as u64, self.config.parity_shards as u64);
            let bytes: u64 = capture.entries.iter().map(|e| e.bytes.len() as u64 + 64).sum();
            adding += bytes.div_ceil(k) * (k + m);
        } else {
            let mut seen = HashSet::new();
            let mut unique = Vec::new();
            for e in &capture.entries {
                for chunk in e.bytes.chunks(usize::try_from(block).unwrap_or(usize::MAX)) {
                    let h = manifest::hash_hex(chunk);
                    if seen.insert(h.clone()) {
                        unique.push((h, chunk.len() as u64));
                    }
                }
            }
            for root in roots {
                let dir = app_dir(root, app).join(BLOCKS);
                for (h, len) in &unique {
                    if !fsio::file_has_len(&dir.join(h), *len)? {
                        adding += len;
                    }
                }
            }
            capture_blocks.extend(unique.into_iter().map(|(h, _)| h));
        }
        let mut used = 0u64;
        for root in [
            Some(&self.config.local),
            self.config.partner.as_ref(),
            self.config.shared.as_ref(),
        ]
        .into_iter()
        .flatten()
        {
            used += fsio::tree_bytes(&root.join(app.uid.to_string()));
        }
        // What the retention after this write deletes counts as gone: the quota then holds
        // `keep` checkpoints, not `keep` + 1 (the write itself briefly needs the room of one
        // more, until retention runs).
        let freed = self.freed_by_retention(app, &capture_blocks);
        let would = used.saturating_add(adding).saturating_sub(freed);
        if would > quota {
            return Err(StoreError::QuotaExceeded {
                uid: app.uid,
                sequence: capture.sequence,
                would,
                quota,
            });
        }
        Ok(())
    }

    /// Bytes [`Store::retain`] deletes after a write of a new newest checkpoint whose blocks
    /// are `capture_blocks`: the manifests and shards of the checkpoints it drops, and the
    /// blocks that neither the new checkpoint nor a kept one names. 0 for the blocks when a
    /// kept manifest cannot be read (retention then deletes none). The caller holds the
    /// application's lock.
    fn freed_by_retention(&self, app: &AppKey, capture_blocks: &HashSet<String>) -> u64 {
        let Ok(existing) = self.sequences(app) else {
            return 0;
        };
        // The new checkpoint is the newest of existing.len() + 1; `keep` of them stay.
        let cut = (existing.len() + 1)
            .saturating_sub(self.config.keep)
            .min(existing.len());
        let (dropped, kept) = existing.split_at(cut);
        if dropped.is_empty() {
            return 0;
        }
        let size = |path: &Path| std::fs::metadata(path).map_or(0, |m| m.len());
        let roots = self.all_roots();
        let mut freed = 0u64;
        for root in &roots {
            let dir = app_dir(root, app);
            for &seq in dropped {
                freed += size(&dir.join(MANIFESTS).join(manifest::file_name(seq)));
                freed += fsio::tree_bytes(&dir.join(ERASURE).join(format!("{seq:020}")));
            }
        }
        let mut referenced = capture_blocks.clone();
        for &seq in kept {
            match self.load_manifest(app, seq) {
                Ok(m) => referenced.extend(m.entries.into_iter().flat_map(|e| e.blocks)),
                Err(_) => return freed,
            }
        }
        for root in &roots {
            let dir = app_dir(root, app).join(BLOCKS);
            for name in fsio::list_names(&dir).unwrap_or_default() {
                if !referenced.contains(&name) {
                    freed += size(&dir.join(&name));
                }
            }
        }
        freed
    }

    /// Writes an L3 checkpoint's shards under the local root, durable before this returns.
    fn write_erasure(&self, app: &AppKey, capture: &Capture) -> Result<DataWritten, StoreError> {
        let (k, m) = (self.config.data_shards, self.config.parity_shards);
        let data = erasure::serialize(&capture.entries)?;
        let shards = erasure::encode(&data, k, m)?;
        let shard_len = shards.first().map_or(0, |s| s.len() as u64);
        let dir = app_dir(&self.config.local, app)
            .join(ERASURE)
            .join(format!("{:020}", capture.sequence));
        fsio::ensure_dir(&dir)?;
        let mut shard_hashes = Vec::with_capacity(shards.len());
        for (i, s) in shards.iter().enumerate() {
            fsio::write_atomic(&dir, &format!("shard-{i}"), s)?;
            shard_hashes.push(manifest::hash_hex(s));
        }
        fsio::sync_dir(&dir)?;
        let entries = capture
            .entries
            .iter()
            .map(|e| ManifestEntry::of(e, Vec::new()))
            .collect();
        Ok(DataWritten {
            entries,
            erasure: Some(ErasureInfo {
                serialized_len: data.len() as u64,
                shard_len,
                data_shards: k,
                parity_shards: m,
                shard_hashes,
            }),
            blocks_total: shards.len() as u64,
            blocks_written: shards.len() as u64,
            bytes_written: shard_len * shards.len() as u64,
        })
    }

    /// The first copy of checkpoint `seq`'s manifest that verifies, trying local first; the
    /// error says what was wrong with each copy.
    fn load_manifest(&self, app: &AppKey, seq: u64) -> Result<Manifest, String> {
        let mut faults = Vec::new();
        for root in self.all_roots() {
            let path = app_dir(root, app).join(MANIFESTS).join(manifest::file_name(seq));
            match fsio::read_opt(&path) {
                Ok(Some(bytes)) => match manifest::decode(&bytes, seq) {
                    Ok(m) => return Ok(m),
                    Err(why) => faults.push(format!("damaged in {}: {why}", path.display())),
                },
                // Absent from a root it was never written to: not worth a word.
                Ok(None) => {}
                Err(e) => faults.push(format!("unreadable in {}: {e}", path.display())),
            }
        }
        if faults.is_empty() {
            faults.push("missing from every directory".into());
        }
        Err(format!("checkpoint {seq}: manifest is {}", faults.join(", and ")))
    }

    /// Checkpoint `seq`'s level and entries, every byte verified; the error says which
    /// checkpoint and what was wrong with it.
    fn recover(&self, app: &AppKey, seq: u64) -> Result<(Level, Vec<Entry>), String> {
        let m = self.load_manifest(app, seq)?;
        let result = match &m.erasure {
            Some(er) => self.recover_erasure(app, &m, er),
            None => self.recover_blocks(app, &m),
        };
        result
            .map(|entries| (m.level, entries))
            .map_err(|why| format!("checkpoint {seq} ({}): {why}", m.level))
    }

    /// The entries of a block-based checkpoint, each block taken from the first root whose copy
    /// verifies.
    fn recover_blocks(&self, app: &AppKey, m: &Manifest) -> Result<Vec<Entry>, String> {
        let dirs: Vec<PathBuf> = self
            .read_roots(m.level)
            .iter()
            .map(|r| app_dir(r, app).join(BLOCKS))
            .collect();
        let mut entries = Vec::with_capacity(m.entries.len());
        for e in &m.entries {
            let len = usize::try_from(e.len).map_err(|_| format!("entry {} does not fit in memory", e.id))?;
            let mut bytes = Vec::with_capacity(len);
            for (j, h) in e.blocks.iter().enumerate() {
                let want = (e.len - j as u64 * m.block_bytes).min(m.block_bytes);
                let block = fetch_block(&dirs, h, want).map_err(|why| format!("entry {} block {j} is {why}", e.id))?;
                bytes.extend_from_slice(&block);
            }
            // Blocks verified one by one can still be the wrong blocks (a manifest bug): check
            // the whole entry too.
            if bytes.len() as u64 != e.len || manifest::hash_hex(&bytes) != e.hash {
                return Err(format!("entry {} does not match its length and hash", e.id));
            }
            entries.push(Entry { id: e.id, bytes });
        }
        Ok(entries)
    }

    /// The entries of an L3 checkpoint, reconstructed from the shards that verify when at least
    /// `data_shards` do.
    fn recover_erasure(&self, app: &AppKey, m: &Manifest, er: &ErasureInfo) -> Result<Vec<Entry>, String> {
        let dir = app_dir(&self.config.local, app)
            .join(ERASURE)
            .join(format!("{:020}", m.sequence));
        let mut shards = Vec::with_capacity(er.shard_hashes.len());
        let mut lost = Vec::new();
        for (i, want) in er.shard_hashes.iter().enumerate() {
            let path = dir.join(format!("shard-{i}"));
            match fsio::read_opt(&path) {
                Ok(Some(b)) if b.len() as u64 == er.shard_len && manifest::hash_hex(&b) == *want => {
                    shards.push(Some(b));
                    continue;
                }
                Ok(Some(_)) => lost.push(format!("shard {i} damaged in {}: hash mismatch", path.display())),
                Ok(None) => lost.push(format!("shard {i} missing from {}", path.display())),
                Err(e) => lost.push(format!("shard {i} unreadable in {}: {e}", path.display())),
            }
            shards.push(None);
        }
        let intact = shards.iter().filter(|s| s.is_some()).count();
        if intact < er.data_shards {
            return Err(format!(
                "only {intact} of {} shards are intact, {} needed ({})",
                er.shard_hashes.len(),
                er.data_shards,
                lost.join(", ")
            ));
        }
        let data = erasure::reconstruct(shards, er.data_shards, er.parity_shards, er.serialized_len)?;
        erasure::deserialize(&data, &m.entries)
    }

    /// Retention and garbage collection after a write: keep the newest `keep` checkpoints, then
    /// delete blocks no kept manifest references, shard directories without a manifest and
    /// temporaries left by crashes, in every root the application has.
    fn retain(&self, app: &AppKey) -> Result<(), StoreError> {
        let sequences = self.sequences(app)?;
        let cut = sequences.len().saturating_sub(self.config.keep);
        let (dropped, kept) = sequences.split_at(cut);
        // A partner or shared directory that cannot be listed is left as it is (see
        // `sequences`); the others are still cleaned.
        let roots: Vec<&Path> = self
            .all_roots()
            .into_iter()
            .enumerate()
            .filter(|(index, root)| *index == 0 || fsio::list_names(&app_dir(root, app).join(MANIFESTS)).is_ok())
            .map(|(_, root)| root)
            .collect();
        for root in &roots {
            let dir = app_dir(root, app).join(MANIFESTS);
            let mut removed = false;
            for name in fsio::list_names(&dir)? {
                let drop = match manifest::parse_file_name(&name) {
                    Some(seq) => dropped.contains(&seq),
                    None => name.starts_with(TEMP_PREFIX),
                };
                if drop {
                    fsio::remove_file(&dir.join(&name))?;
                    removed = true;
                }
            }
            if removed {
                // Manifests must be gone for good before the blocks they name.
                fsio::sync_dir(&dir)?;
            }
            // Damaged manifests set aside before the oldest kept checkpoint: nothing to inspect
            // there any more, and they count against the user's quota.
            let damaged = app_dir(root, app).join(DAMAGED);
            for name in fsio::list_names(&damaged)? {
                if manifest::parse_file_name(&name).is_none_or(|seq| kept.first().is_some_and(|&k| seq < k)) {
                    fsio::remove_file(&damaged.join(&name))?;
                }
            }
            // Shard directories of dropped checkpoints, and of writes that crashed before their
            // manifest: neither is anything's data.
            let erasure = app_dir(root, app).join(ERASURE);
            for name in fsio::list_names(&erasure)? {
                let keep = name.parse::<u64>().is_ok_and(|seq| kept.contains(&seq));
                if !keep {
                    fsio::remove_tree(&erasure.join(&name))?;
                }
            }
        }
        // Blocks referenced by any kept checkpoint, from every copy of its manifest that reads.
        // If some kept manifest cannot be read anywhere, its blocks are unknown: delete none.
        let mut referenced = HashSet::new();
        for &seq in kept {
            let mut found = false;
            for root in &roots {
                let path = app_dir(root, app).join(MANIFESTS).join(manifest::file_name(seq));
                let bytes = match fsio::read_opt(&path) {
                    Ok(Some(b)) => b,
                    Ok(None) => continue,
                    Err(e) => return Err(StoreError::io("read manifest", path, e)),
                };
                if let Ok(m) = manifest::decode(&bytes, seq) {
                    found = true;
                    referenced.extend(m.entries.into_iter().flat_map(|e| e.blocks));
                }
            }
            if !found {
                return Ok(());
            }
        }
        for root in &roots {
            let dir = app_dir(root, app).join(BLOCKS);
            let mut removed = false;
            for name in fsio::list_names(&dir)? {
                if !referenced.contains(&name) {
                    fsio::remove_file(&dir.join(&name))?;
                    removed = true;
                }
            }
            if removed {
                fsio::sync_dir(&dir)?;
            }
        }
        Ok(())
    }
}

/// The directory of `app` under a level root.
fn app_dir(root: &Path, app: &AppKey) -> PathBuf {
    root.join(app.uid.to_string()).join(&app.name)
}

/// Block `hash` of `want` bytes from the first of `dirs` whose copy verifies; the error says
/// what was wrong with each copy.
fn fetch_block(dirs: &[PathBuf], hash: &str, want: u64) -> Result<Vec<u8>, String> {
    let mut faults = Vec::new();
    for dir in dirs {
        let path = dir.join(hash);
        match fsio::read_opt(&path) {
            Ok(Some(b)) if b.len() as u64 == want && manifest::hash_hex(&b) == hash => return Ok(b),
            Ok(Some(b)) if b.len() as u64 != want => faults.push(format!(
                "damaged in {}: {} bytes, expected {want}",
                path.display(),
                b.len()
            )),
            Ok(Some(_)) => faults.push(format!("damaged in {}: hash mismatch", path.display())),
            Ok(None) => faults.push(format!("missing from {}", path.display())),
            Err(e) => faults.push(format!("unreadable in {}: {e}", path.display())),
        }
    }
    Err(faults.join(", and "))
}
