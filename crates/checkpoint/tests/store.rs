//! The checkpoint store against real files in temporary directories: round trips at every level,
//! differential checkpoints, retention and garbage collection, damage and fallback, erasure
//! coding, refusals, and random write histories.

use std::collections::HashSet;
use std::fs;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};

use agora_checkpoint::{AppKey, Capture, Entry, Level, Store, StoreConfig, StoreError};
use proptest::prelude::*;
use tempfile::TempDir;

/// Small blocks keep the tests fast while exercising many of them.
const BLOCK: usize = 4096;

/// A store with every level configured, in fresh temporary directories.
struct Fixture {
    _dir: TempDir,
    config: StoreConfig,
    store: Store,
}

impl Fixture {
    fn new(keep: usize) -> Fixture {
        let dir = tempfile::tempdir().expect("temporary directory");
        let mut config = StoreConfig::new(dir.path().join("local"));
        config.partner = Some(dir.path().join("partner"));
        config.shared = Some(dir.path().join("shared"));
        config.block_bytes = BLOCK as u64;
        config.keep = keep;
        let store = Store::open(config.clone()).expect("open store");
        Fixture {
            _dir: dir,
            config,
            store,
        }
    }

    /// `app`'s directory under `root`.
    fn app_dir(&self, root: &Path, app: &AppKey) -> PathBuf {
        root.join(app.uid.to_string()).join(&app.name)
    }

    fn local(&self, app: &AppKey, sub: &str) -> PathBuf {
        self.app_dir(&self.config.local, app).join(sub)
    }

    fn partner(&self, app: &AppKey, sub: &str) -> PathBuf {
        self.app_dir(self.config.partner.as_ref().expect("partner"), app)
            .join(sub)
    }
}

fn app(name: &str) -> AppKey {
    AppKey::new(1000, name).expect("valid name")
}

/// Deterministic bytes that differ from block to block (xorshift), so blocks do not deduplicate
/// by accident.
fn noise(seed: u64, len: usize) -> Vec<u8> {
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x as u8
        })
        .collect()
}

fn capture(sequence: u64, level: Level, entries: &[Entry]) -> Capture {
    Capture {
        sequence,
        level,
        entries: entries.to_vec(),
    }
}

/// Several entries: one not a multiple of the block size, an empty one, one exactly two blocks,
/// a small scalar.
fn sample_entries(seed: u64) -> Vec<Entry> {
    vec![
        Entry {
            id: 1,
            bytes: noise(seed, 10_000),
        },
        Entry {
            id: 2,
            bytes: Vec::new(),
        },
        Entry {
            id: 3,
            bytes: noise(seed + 1, 2 * BLOCK),
        },
        Entry {
            id: 40,
            bytes: 42u64.to_le_bytes().to_vec(),
        },
    ]
}

fn names(dir: &Path) -> HashSet<String> {
    match fs::read_dir(dir) {
        Ok(rd) => rd
            .map(|e| e.expect("dir entry").file_name().into_string().expect("utf-8"))
            .collect(),
        Err(_) => HashSet::new(),
    }
}

fn flip_byte(path: &Path, at: usize) {
    let mut b = fs::read(path).expect("read file to damage");
    b[at] ^= 0x5a;
    fs::write(path, b).expect("write damaged file");
}

fn manifest_path(f: &Fixture, app: &AppKey, seq: u64) -> PathBuf {
    f.local(app, "manifests").join(format!("{seq:020}.json"))
}

#[test]
fn round_trip_every_level() {
    let f = Fixture::new(2);
    for (i, level) in Level::ALL.into_iter().enumerate() {
        let a = app(&format!("app-{}", level.name()));
        let entries = sample_entries(i as u64);
        let report = f.store.write(&a, capture(7, level, &entries)).expect("write");
        assert_eq!(report.level, level);
        assert_eq!(report.bytes_total, (10_000 + 2 * BLOCK + 8) as u64);
        let got = f.store.latest(&a).expect("latest").expect("a checkpoint");
        assert_eq!((got.sequence, got.level), (7, level));
        assert_eq!(got.entries, entries, "level {level}");
        assert!(got.skipped.is_empty());
        let list = f.store.list(&a).expect("list");
        assert_eq!(list.len(), 1);
        assert_eq!((list[0].sequence, list[0].level, list[0].entries), (7, level, 4));
        assert_eq!(list[0].bytes_total, report.bytes_total);
        assert!(list[0].created_unix_ms > 0);
    }
    // Where each level put its copies.
    let l2 = app("app-l2");
    assert!(!names(&f.partner(&l2, "manifests")).is_empty());
    assert!(!names(&f.partner(&l2, "blocks")).is_empty());
    let l3 = app("app-l3");
    assert_eq!(names(&f.local(&l3, "erasure").join(format!("{:020}", 7))).len(), 6);
    assert!(names(&f.local(&l3, "blocks")).is_empty());
    let shared = f.config.shared.as_ref().expect("shared");
    assert!(!names(&f.app_dir(shared, &app("app-l4")).join("blocks")).is_empty());
    assert!(!f.app_dir(shared, &app("app-l1")).exists());
}

#[test]
fn files_and_directories_are_private() {
    let f = Fixture::new(2);
    let a = app("private");
    f.store
        .write(&a, capture(1, Level::L1, &sample_entries(3)))
        .expect("write");
    let mode = |p: &Path| fs::metadata(p).expect("metadata").permissions().mode() & 0o777;
    assert_eq!(mode(&f.local(&a, "")), 0o700);
    assert_eq!(mode(&f.local(&a, "blocks")), 0o700);
    for name in names(&f.local(&a, "blocks")) {
        assert_eq!(mode(&f.local(&a, "blocks").join(name)), 0o600);
    }
    assert_eq!(mode(&manifest_path(&f, &a, 1)), 0o600);
}

#[test]
fn differential_checkpoint_writes_only_the_changed_block() {
    let f = Fixture::new(2);
    let a = app("iterative");
    let first = vec![Entry {
        id: 0,
        bytes: noise(99, 100 * BLOCK),
    }];
    let r1 = f.store.write(&a, capture(1, Level::L1, &first)).expect("first write");
    assert_eq!((r1.blocks_total, r1.blocks_written), (100, 100));
    assert_eq!(r1.bytes_written, (100 * BLOCK) as u64);

    let mut second = first.clone();
    second[0].bytes[37 * BLOCK + 5] ^= 1;
    let r2 = f.store.write(&a, capture(2, Level::L1, &second)).expect("second write");
    assert_eq!((r2.blocks_total, r2.blocks_written), (100, 1));
    assert_eq!(r2.bytes_written, BLOCK as u64, "about 1 % of the data");
    assert_eq!(names(&f.local(&a, "blocks")).len(), 101);

    assert_eq!(f.store.latest(&a).expect("latest").expect("some").entries, second);
    // Without the second manifest the first checkpoint is the newest complete one, intact.
    fs::remove_file(manifest_path(&f, &a, 2)).expect("remove manifest");
    let got = f.store.latest(&a).expect("latest").expect("some");
    assert_eq!(got.sequence, 1);
    assert_eq!(got.entries, first);
    assert!(
        got.skipped.is_empty(),
        "a missing manifest is no checkpoint, not a damaged one"
    );
}

#[test]
fn retention_keeps_the_newest_and_collects_their_blocks() {
    let f = Fixture::new(2);
    let a = app("retained");
    let mut bytes = noise(5, 3 * BLOCK);
    let mut history = Vec::new();
    for seq in 1..=5u64 {
        bytes[((seq as usize) % 3) * BLOCK] = seq as u8 + 100;
        let entries = vec![Entry {
            id: 9,
            bytes: bytes.clone(),
        }];
        // Two L3 checkpoints first: their shard directories must go with them.
        let level = if seq <= 2 { Level::L3 } else { Level::L1 };
        f.store.write(&a, capture(seq, level, &entries)).expect("write");
        history.push(entries);
    }
    let list = f.store.list(&a).expect("list");
    assert_eq!(list.iter().map(|c| c.sequence).collect::<Vec<_>>(), vec![4, 5]);
    assert_eq!(names(&f.local(&a, "manifests")).len(), 2);
    assert!(
        names(&f.local(&a, "erasure")).is_empty(),
        "shards of dropped checkpoints are deleted"
    );
    // Exactly the distinct blocks of checkpoints 4 and 5 remain.
    let kept: HashSet<&[u8]> = history[3..].iter().flat_map(|e| e[0].bytes.chunks(BLOCK)).collect();
    assert_eq!(kept.len(), 4, "3 blocks each, 2 shared");
    assert_eq!(names(&f.local(&a, "blocks")).len(), kept.len());
    assert_eq!(f.store.latest(&a).expect("latest").expect("some").entries, history[4]);

    f.store.remove(&a).expect("remove");
    assert!(f.store.list(&a).expect("list").is_empty());
    assert!(f.store.latest(&a).expect("latest").is_none());
    assert!(!f.local(&a, "").exists());
    // Sequence numbers start over after removal.
    f.store
        .write(&a, capture(1, Level::L1, &history[0]))
        .expect("write after remove");
}

#[test]
fn damaged_newest_falls_back_to_the_previous() {
    let f = Fixture::new(3);
    let a = app("damaged");
    assert!(f.store.latest(&a).expect("latest").is_none(), "no checkpoint yet");
    let first = vec![Entry {
        id: 3,
        bytes: noise(1, 20 * BLOCK),
    }];
    f.store.write(&a, capture(1, Level::L1, &first)).expect("write 1");
    let before = names(&f.local(&a, "blocks"));
    let mut second = first.clone();
    second[0].bytes[12 * BLOCK] ^= 0xff;
    f.store.write(&a, capture(2, Level::L1, &second)).expect("write 2");
    let only_second: Vec<String> = names(&f.local(&a, "blocks")).difference(&before).cloned().collect();
    assert_eq!(only_second.len(), 1);

    // A flipped byte in a block only checkpoint 2 has.
    flip_byte(&f.local(&a, "blocks").join(&only_second[0]), 100);
    let got = f.store.latest(&a).expect("latest").expect("some");
    assert_eq!((got.sequence, &got.entries), (1, &first));
    assert_eq!(got.skipped.len(), 1);
    let msg = &got.skipped[0];
    assert!(
        msg.starts_with("checkpoint 2 (l1): entry 3 block 12 is damaged in"),
        "{msg}"
    );
    assert!(msg.contains(&only_second[0]) && msg.contains("hash mismatch"), "{msg}");
    assert!(msg.ends_with("using checkpoint 1"), "{msg}");

    // A truncated manifest instead (on a third checkpoint): passed over, never a panic.
    f.store.write(&a, capture(3, Level::L1, &first)).expect("write 3");
    let m3 = manifest_path(&f, &a, 3);
    let len = fs::metadata(&m3).expect("manifest").len();
    fs::OpenOptions::new()
        .write(true)
        .open(&m3)
        .expect("open")
        .set_len(len / 2)
        .expect("truncate");
    let got = f.store.latest(&a).expect("latest").expect("some");
    assert_eq!(got.sequence, 1);
    assert_eq!(got.skipped.len(), 2);
    assert!(
        got.skipped[0].starts_with("checkpoint 3: manifest is damaged"),
        "{}",
        got.skipped[0]
    );
    assert!(got.skipped[1].starts_with("checkpoint 2 (l1)"), "{}", got.skipped[1]);
    // list reads manifests only: the truncated one is left out, the damaged-block one is not.
    let seqs: Vec<u64> = f.store.list(&a).expect("list").iter().map(|c| c.sequence).collect();
    assert_eq!(seqs, vec![1, 2]);

    // A manifest whose content was altered but is still valid JSON: its own hash catches it.
    let m1 = manifest_path(&f, &a, 1);
    let text = fs::read_to_string(&m1).expect("manifest");
    fs::write(&m1, text.replacen("\"id\":3", "\"id\":4", 1)).expect("write");
    match f.store.latest(&a) {
        Err(StoreError::NoIntactCheckpoint { problems, .. }) => {
            assert_eq!(problems.len(), 3);
            assert!(
                problems[2].contains("checkpoint 1") && problems[2].contains("manifest hash mismatch"),
                "{problems:?}"
            );
        }
        other => panic!("expected NoIntactCheckpoint, got {other:?}"),
    }
    let err = f.store.latest(&a).expect_err("all damaged").to_string();
    assert!(
        err.contains("checkpoint 3") && err.contains("checkpoint 2") && err.contains("checkpoint 1"),
        "{err}"
    );
    // A new checkpoint must still be numbered above the damaged ones.
    assert!(matches!(
        f.store.write(&a, capture(3, Level::L1, &first)),
        Err(StoreError::StaleSequence { newest: 3, .. })
    ));
}

#[test]
fn l2_and_l4_fall_back_to_their_second_copy() {
    let f = Fixture::new(2);
    for level in [Level::L2, Level::L4] {
        let a = app(&format!("replicated-{}", level.name()));
        let entries = sample_entries(11);
        let report = f.store.write(&a, capture(1, level, &entries)).expect("write");
        assert_eq!(
            report.blocks_written,
            2 * report.blocks_total,
            "every block in both directories"
        );
        let blocks: Vec<String> = {
            let mut v: Vec<String> = names(&f.local(&a, "blocks")).into_iter().collect();
            v.sort();
            v
        };
        assert!(blocks.len() >= 3);
        // One local block corrupted, another deleted, and the local manifest gone.
        flip_byte(&f.local(&a, "blocks").join(&blocks[0]), 0);
        fs::remove_file(f.local(&a, "blocks").join(&blocks[1])).expect("remove block");
        fs::remove_file(manifest_path(&f, &a, 1)).expect("remove manifest");
        let got = f.store.latest(&a).expect("latest").expect("some");
        assert_eq!((got.sequence, got.level), (1, level));
        assert_eq!(got.entries, entries);
        assert!(got.skipped.is_empty());
        // Damaged in both copies: nothing left to recover from, and the message names both.
        let second = if level == Level::L2 {
            f.partner(&a, "blocks")
        } else {
            f.app_dir(f.config.shared.as_ref().expect("shared"), &a).join("blocks")
        };
        fs::remove_file(second.join(&blocks[0])).expect("remove second copy");
        let err = f.store.latest(&a).expect_err("both copies lost").to_string();
        assert!(err.contains("hash mismatch") && err.contains("missing from"), "{err}");
    }
}

#[test]
fn l3_loses_too_many_shards() {
    let f = Fixture::new(2);
    let a = app("erasure");
    let old = sample_entries(21);
    let new = sample_entries(22);
    f.store.write(&a, capture(1, Level::L3, &old)).expect("write 1");
    let r = f.store.write(&a, capture(2, Level::L3, &new)).expect("write 2");
    assert_eq!((r.blocks_total, r.blocks_written), (6, 6));
    let dir = f.local(&a, "erasure").join(format!("{:020}", 2));
    for i in [0, 3, 5] {
        fs::remove_file(dir.join(format!("shard-{i}"))).expect("remove shard");
    }
    let got = f.store.latest(&a).expect("latest").expect("some");
    assert_eq!((got.sequence, &got.entries), (1, &old));
    assert!(
        got.skipped[0].starts_with("checkpoint 2 (l3): only 3 of 6 shards are intact, 4 needed"),
        "{:?}",
        got.skipped
    );
}

#[test]
fn refusals() {
    let f = Fixture::new(2);
    let a = app("refused");
    f.store
        .write(&a, capture(5, Level::L1, &sample_entries(1)))
        .expect("write");
    for seq in [5, 4, 0] {
        match f.store.write(&a, capture(seq, Level::L1, &sample_entries(1))) {
            Err(StoreError::StaleSequence {
                sequence, newest: 5, ..
            }) => assert_eq!(sequence, seq),
            other => panic!("expected StaleSequence, got {other:?}"),
        }
    }
    let dup = vec![Entry { id: 1, bytes: vec![1] }, Entry { id: 1, bytes: vec![2] }];
    assert!(matches!(
        f.store.write(&a, capture(6, Level::L1, &dup)),
        Err(StoreError::DuplicateEntry { id: 1 })
    ));

    let long = "a".repeat(129);
    for bad in ["", ".hidden", "..", "a/b", "a b", "é", long.as_str()] {
        assert!(
            matches!(AppKey::new(1, bad), Err(StoreError::BadName { .. })),
            "{bad:?}"
        );
    }
    assert!(AppKey::new(1, "a".repeat(128)).is_ok());
    assert!(AppKey::new(1, "Solver_2.v-1").is_ok());
    // The fields are public: the store checks them again.
    let forged = AppKey {
        uid: 1,
        name: "../escape".into(),
    };
    assert!(matches!(f.store.latest(&forged), Err(StoreError::BadName { .. })));

    assert_eq!(Level::parse("L3").expect("level"), Level::L3);
    assert!(matches!(Level::parse("l5"), Err(StoreError::BadLevel { .. })));

    let dir = tempfile::tempdir().expect("temporary directory");
    let local_only = Store::open(StoreConfig::new(dir.path().join("l"))).expect("open");
    for (level, key) in [(Level::L2, "partner"), (Level::L4, "shared")] {
        let err = local_only
            .write(&a, capture(1, level, &[]))
            .expect_err("not configured");
        assert!(matches!(err, StoreError::LevelNotConfigured { level: l, key: k } if l == level && k == key));
        assert!(err.to_string().contains(key));
    }
    local_only
        .write(&a, capture(1, Level::L3, &[]))
        .expect("L3 needs only local");
    assert_eq!(
        local_only.latest(&a).expect("latest").expect("some").entries,
        Vec::new()
    );

    let bad_configs: [fn(&mut StoreConfig); 6] = [
        |c| c.keep = 0,
        |c| c.block_bytes = 4095,
        |c| c.block_bytes = (64 << 20) + 1,
        |c| c.data_shards = 0,
        |c| c.parity_shards = 0,
        |c| c.partner = Some(c.local.clone()),
    ];
    for tweak in bad_configs {
        let mut c = StoreConfig::new(dir.path().join("c"));
        tweak(&mut c);
        assert!(matches!(Store::open(c), Err(StoreError::BadConfig { .. })));
    }
}

#[test]
fn store_is_send_and_sync() {
    fn assert_send_sync<T: Send + Sync>() {}
    assert_send_sync::<Store>();
    // And it is used that way: two threads writing two applications at once.
    let f = Fixture::new(2);
    std::thread::scope(|s| {
        for t in 0..2u64 {
            let store = &f.store;
            s.spawn(move || {
                let a = app(&format!("thread-{t}"));
                for seq in 1..=3 {
                    store
                        .write(&a, capture(seq, Level::L2, &sample_entries(t * 10 + seq)))
                        .expect("write");
                }
                assert_eq!(
                    store.latest(&a).expect("latest").expect("some").entries,
                    sample_entries(t * 10 + 3)
                );
            });
        }
    });
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(24))]

    /// Any `parity_shards` shards lost (deleted or corrupted) are reconstructed exactly.
    #[test]
    fn l3_survives_losing_any_parity_shards(
        sizes in prop::collection::vec(0usize..6000, 1..5),
        lost in prop::sample::subsequence((0..6usize).collect::<Vec<_>>(), 2),
        corrupt in any::<bool>(),
        seed in any::<u64>(),
    ) {
        let f = Fixture::new(2);
        let a = app("l3prop");
        let entries: Vec<Entry> = sizes.iter().enumerate()
            .map(|(i, &n)| Entry { id: i as u32, bytes: noise(seed ^ i as u64, n) })
            .collect();
        f.store.write(&a, capture(1, Level::L3, &entries)).expect("write");
        let dir = f.local(&a, "erasure").join(format!("{:020}", 1));
        for i in &lost {
            let shard = dir.join(format!("shard-{i}"));
            if corrupt { flip_byte(&shard, 0) } else { fs::remove_file(&shard).expect("remove shard") }
        }
        let got = f.store.latest(&a).expect("latest").expect("some");
        prop_assert_eq!(got.entries, entries);
        prop_assert!(got.skipped.is_empty());
    }

    /// Random histories of writes at random levels with small mutations in between: the newest
    /// checkpoint recovers exactly what was last written.
    #[test]
    fn latest_is_the_last_write(
        initial in prop::collection::vec(0usize..(3 * BLOCK + 100), 0..4),
        steps in prop::collection::vec(
            (0usize..4, prop::collection::vec((any::<prop::sample::Index>(), any::<u8>()), 0..4), 0usize..8),
            1..6,
        ),
        seed in any::<u64>(),
    ) {
        let f = Fixture::new(2);
        let a = app("history");
        let mut entries: Vec<Entry> = initial.iter().enumerate()
            .map(|(i, &n)| Entry { id: i as u32, bytes: noise(seed ^ i as u64, n) })
            .collect();
        let mut sequence = 0u64;
        // Ids never reused: a new entry gets one above every earlier one.
        for (next_id, (level, flips, shape)) in (entries.len() as u32..).zip(steps) {
            for (at, value) in flips {
                if let Some(e) = entries.iter_mut().find(|e| !e.bytes.is_empty()) {
                    let i = at.index(e.bytes.len());
                    e.bytes[i] = value;
                }
            }
            // Now and then the shape changes too: an entry grows, shrinks, appears or goes.
            match shape {
                0 => entries.push(Entry { id: next_id, bytes: noise(seed ^ u64::from(next_id), 777) }),
                1 if !entries.is_empty() => { entries.remove(0); }
                2 if !entries.is_empty() => entries[0].bytes.extend_from_slice(&[7; 1000]),
                3 if !entries.is_empty() => { let n = entries[0].bytes.len() / 2; entries[0].bytes.truncate(n) }
                _ => {}
            }
            sequence += 1 + shape as u64;
            f.store.write(&a, capture(sequence, Level::ALL[level], &entries)).expect("write");
        }
        let got = f.store.latest(&a).expect("latest").expect("some");
        prop_assert_eq!(got.sequence, sequence);
        prop_assert_eq!(got.entries, entries);
        prop_assert!(f.store.list(&a).expect("list").len() <= 2);
    }
}

#[test]
fn a_write_past_the_users_quota_is_refused_before_anything_is_written() {
    let dir = tempfile::tempdir().expect("temporary directory");
    let mut config = StoreConfig::new(dir.path().join("local"));
    config.block_bytes = BLOCK as u64;
    config.keep = 4;
    // Room for one 64 KiB state and a few changed blocks, not for a second application's state.
    config.quota_per_user = Some(100 << 10);
    let store = Store::open(config).expect("open store");
    let solver = app("solver");
    let state = noise(1, 64 << 10);
    store
        .write(
            &solver,
            capture(
                1,
                Level::L1,
                &[Entry {
                    id: 1,
                    bytes: state.clone(),
                }],
            ),
        )
        .expect("the first checkpoint fits");
    // Differential: one changed block of 4 KiB fits.
    let mut changed = state.clone();
    changed[..BLOCK].copy_from_slice(&noise(2, BLOCK));
    store
        .write(
            &solver,
            capture(
                2,
                Level::L1,
                &[Entry {
                    id: 1,
                    bytes: changed.clone(),
                }],
            ),
        )
        .expect("a small differential checkpoint fits");
    // Another application of the same user with a 64 KiB state does not.
    let other = app("other");
    match store.write(
        &other,
        capture(
            1,
            Level::L1,
            &[Entry {
                id: 1,
                bytes: noise(3, 64 << 10),
            }],
        ),
    ) {
        Err(StoreError::QuotaExceeded {
            uid: 1000,
            quota,
            would,
            ..
        }) => {
            assert_eq!(quota, 100 << 10);
            assert!(would > quota);
        }
        other => panic!("expected a quota refusal, got {other:?}"),
    }
    assert!(
        store.latest(&other).expect("listing").is_none(),
        "nothing of the refused one"
    );
    assert!(
        !dir.path().join("local/1000/other/blocks").exists()
            || fs::read_dir(dir.path().join("local/1000/other/blocks"))
                .unwrap()
                .next()
                .is_none()
    );
    // Level 3 counts its shards too.
    assert!(matches!(
        store.write(
            &solver,
            capture(
                3,
                Level::L3,
                &[Entry {
                    id: 1,
                    bytes: changed.clone()
                }]
            )
        ),
        Err(StoreError::QuotaExceeded { .. })
    ));
    // The user's earlier checkpoint is intact.
    let latest = store.latest(&solver).expect("recovery").expect("a checkpoint");
    assert_eq!(latest.sequence, 2);
    assert_eq!(latest.entries[0].bytes, changed);
    // Another user is not affected by this one's use.
    let stranger = AppKey::new(1001, "solver").expect("valid name");
    store
        .write(&stranger, capture(1, Level::L1, &[Entry { id: 1, bytes: state }]))
        .expect("another user's quota is its own");
}

#[test]
fn resume_sets_damaged_checkpoints_aside_and_frees_their_ids() {
    let f = Fixture::new(3);
    let a = app("resumed");
    let data = vec![Entry {
        id: 1,
        bytes: noise(7, 3 * BLOCK),
    }];
    for seq in [4, 5, 6] {
        f.store.write(&a, capture(seq, Level::L1, &data)).expect("write");
    }
    // The newest manifest truncated (a crash of the disk, say): recovery uses 5.
    let m6 = manifest_path(&f, &a, 6);
    fs::OpenOptions::new()
        .write(true)
        .open(&m6)
        .expect("open")
        .set_len(20)
        .expect("truncate");
    assert_eq!(
        f.store.newest_sequence(&a).expect("newest"),
        Some(6),
        "a damaged id is taken"
    );
    let got = f.store.resume(&a).expect("resume").expect("some");
    assert_eq!(got.sequence, 5);
    assert_eq!(got.skipped.len(), 1);
    assert!(
        got.skipped[0].starts_with("checkpoint 6: manifest is damaged") && got.skipped[0].contains("set aside"),
        "{}",
        got.skipped[0]
    );
    assert!(!m6.exists(), "the damaged manifest is no longer among the checkpoints");
    assert!(
        f.app_dir(&f.config.local, &a)
            .join("damaged")
            .join(m6.file_name().unwrap())
            .exists(),
        "it is kept aside for inspection"
    );
    // The application goes on after the checkpoint it recovered.
    assert_eq!(f.store.newest_sequence(&a).expect("newest"), Some(5));
    f.store.write(&a, capture(6, Level::L1, &data)).expect("write 6 again");
    let got = f.store.latest(&a).expect("latest").expect("some");
    assert_eq!((got.sequence, got.skipped.len()), (6, 0));

    // Nothing intact at all: everything is set aside, and the application starts over.
    for seq in [4, 5, 6] {
        let path = manifest_path(&f, &a, seq);
        if path.exists() {
            fs::write(&path, "{").expect("damage");
        }
    }
    match f.store.resume(&a) {
        Err(StoreError::NoIntactCheckpoint { problems, .. }) => {
            assert!(problems.iter().all(|p| p.contains("set aside")), "{problems:?}")
        }
        other => panic!("expected NoIntactCheckpoint, got {other:?}"),
    }
    assert_eq!(f.store.newest_sequence(&a).expect("newest"), None);
    f.store
        .write(&a, capture(1, Level::L1, &data))
        .expect("a fresh start at 1");
}

/// SRE audit, defects 1 and 2: the partner directory replaced by a file (NFS gone, a mistaken
/// clean-up). A level-2 write fails, and what it had written locally before it failed goes with
/// it (on a full disk those orphan blocks kept every later checkpoint from fitting, for good);
/// level 1 goes on and recovery uses the local copies (every level's writes and every recovery
/// failed listing the partner's manifests).
#[test]
fn an_unreachable_partner_fails_only_level_2_and_a_failed_write_leaves_nothing() {
    let f = Fixture::new(3);
    let a = app("partner-gone");
    let first = sample_entries(1);
    f.store
        .write(&a, capture(1, Level::L2, &first))
        .expect("level 2 while the partner is there");
    let blocks_of_first = names(&f.local(&a, "blocks"));
    let partner_root = f.config.partner.clone().expect("partner");
    fs::remove_dir_all(&partner_root).expect("remove the partner");
    fs::write(&partner_root, b"not a directory").expect("a file in its place");

    let error = f
        .store
        .write(&a, capture(2, Level::L2, &sample_entries(2)))
        .expect_err("level 2 needs the partner");
    let message = error.to_string();
    assert!(
        message.contains("gone or replaced by a file"),
        "the error says what to do: {message}"
    );
    assert_eq!(
        names(&f.local(&a, "blocks")),
        blocks_of_first,
        "the failed write's local blocks were removed"
    );

    f.store
        .write(&a, capture(3, Level::L1, &sample_entries(3)))
        .expect("level 1 does not need the partner");
    let listed: Vec<u64> = f.store.list(&a).expect("list").iter().map(|c| c.sequence).collect();
    assert_eq!(listed, [1, 3]);
    let recovered = f.store.latest(&a).expect("recovery").expect("a checkpoint");
    assert_eq!(recovered.sequence, 3);
    assert_eq!(recovered.entries, sample_entries(3));
    // Checkpoint 1 (level 2) recovers from its local copy alone.
    fs::remove_file(manifest_path(&f, &a, 3)).expect("drop checkpoint 3");
    let recovered = f.store.latest(&a).expect("recovery").expect("a checkpoint");
    assert_eq!((recovered.sequence, recovered.entries), (1, first));
}
