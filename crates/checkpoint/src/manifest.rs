//! Manifests: what a checkpoint consists of, with their own integrity hash.
//!
//! Owns the manifest's JSON format, its file names (`<sequence:020>.json`) and the checks that
//! make a truncated, garbled or tampered manifest read as *damaged* rather than as a different
//! checkpoint (or a panic). It must not read blocks or shards: it only describes them.
//!
//! Format: a JSON object `{"format":1, …, "manifest_hash": "<blake3 hex>"}` where the hash is
//! taken over the canonical JSON of the object without that field (serde_json's map sorts keys,
//! and the serialisation is compact, so writer and reader compute the same bytes whatever the
//! file's own whitespace or key order).

use serde::{Deserialize, Serialize};
use serde_json::Value;

use crate::config::{Level, MAX_BLOCK_BYTES, MIN_BLOCK_BYTES};
use crate::error::StoreError;

/// The only manifest format this crate writes and reads.
pub(crate) const FORMAT: u32 = 1;

/// The field holding the manifest's own hash.
const HASH_FIELD: &str = "manifest_hash";

/// One checkpoint's description.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct Manifest {
    /// Always [`FORMAT`].
    pub format: u32,
    /// The checkpoint's sequence number (also its file name, checked against it).
    pub sequence: u64,
    /// How it was written.
    pub level: Level,
    /// Milliseconds since the Unix epoch when it was written.
    pub created_unix_ms: u64,
    /// Sum of the entries' lengths.
    pub bytes_total: u64,
    /// Block size the entries were cut with (the configuration may change between runs).
    pub block_bytes: u64,
    /// The entries, in capture order.
    pub entries: Vec<ManifestEntry>,
    /// L3 only: how the entries were erasure coded.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub erasure: Option<ErasureInfo>,
}

/// One entry of a manifest.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct ManifestEntry {
    /// The caller's id of the buffer.
    pub id: u32,
    /// Its length in bytes.
    pub len: u64,
    /// blake3 hex of its whole bytes.
    pub hash: String,
    /// blake3 hex of each `block_bytes` block, in order (empty for L3).
    pub blocks: Vec<String>,
}

impl ManifestEntry {
    /// The entry of `entry`'s bytes, with these block hashes (none for L3).
    pub(crate) fn of(entry: &crate::config::Entry, blocks: Vec<String>) -> ManifestEntry {
        ManifestEntry {
            id: entry.id,
            len: entry.bytes.len() as u64,
            hash: hash_hex(&entry.bytes),
            blocks,
        }
    }
}

/// How an L3 checkpoint was erasure coded.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct ErasureInfo {
    /// Length of the serialised entries before zero padding.
    pub serialized_len: u64,
    /// Length of every shard file.
    pub shard_len: u64,
    /// Reed–Solomon k used for this checkpoint.
    pub data_shards: usize,
    /// Reed–Solomon m used for this checkpoint.
    pub parity_shards: usize,
    /// blake3 hex of each shard, data shards first.
    pub shard_hashes: Vec<String>,
}

/// The manifest file name of checkpoint `sequence`.
pub(crate) fn file_name(sequence: u64) -> String {
    format!("{sequence:020}.json")
}

/// The sequence number of a manifest file name, or `None` for anything else (temporaries).
pub(crate) fn parse_file_name(name: &str) -> Option<u64> {
    let digits = name.strip_suffix(".json")?;
    if digits.len() != 20 || !digits.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    digits.parse().ok()
}

/// Whether `s` is a blake3 hash as this crate writes it: 64 lowercase hex digits. Checked before
/// a hash from a manifest becomes a file name, so a crafted manifest cannot name `../x`.
pub(crate) fn is_hash_hex(s: &str) -> bool {
    s.len() == 64 && s.bytes().all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
}

/// blake3 hex of `bytes`.
pub(crate) fn hash_hex(bytes: &[u8]) -> String {
    blake3::hash(bytes).to_hex().to_string()
}

/// The manifest's file contents: canonical JSON plus its own hash, and a newline.
pub(crate) fn encode(manifest: &Manifest) -> Result<Vec<u8>, StoreError> {
    let value = serde_json::to_value(manifest).map_err(|e| StoreError::Encode {
        what: format!("manifest: {e}"),
    })?;
    let Value::Object(mut map) = value else {
        return Err(StoreError::Encode {
            what: "manifest did not serialise to a JSON object".into(),
        });
    };
    let canonical = canonical_bytes(&map)?;
    map.insert(HASH_FIELD.into(), Value::String(hash_hex(&canonical)));
    let mut out = serde_json::to_vec(&Value::Object(map)).map_err(|e| StoreError::Encode {
        what: format!("manifest: {e}"),
    })?;
    out.push(b'\n');
    Ok(out)
}

/// The bytes the manifest hash covers.
fn canonical_bytes(map: &serde_json::Map<String, Value>) -> Result<Vec<u8>, StoreError> {
    serde_json::to_vec(map).map_err(|e| StoreError::Encode {
        what: format!("manifest: {e}"),
    })
}

/// Parses and checks a manifest read from the file of checkpoint `sequence`; the error says
/// why it is damaged.
pub(crate) fn decode(bytes: &[u8], sequence: u64) -> Result<Manifest, String> {
    let value: Value =
        serde_json::from_slice(bytes).map_err(|e| format!("not valid JSON ({e}), probably truncated"))?;
    let Value::Object(mut map) = value else {
        return Err("not a JSON object".into());
    };
    let stored = match map.remove(HASH_FIELD) {
        Some(Value::String(h)) => h,
        Some(_) => return Err(format!("`{HASH_FIELD}` is not a string")),
        None => return Err(format!("`{HASH_FIELD}` is missing")),
    };
    let canonical = canonical_bytes(&map).map_err(|e| e.to_string())?;
    if hash_hex(&canonical) != stored {
        return Err("manifest hash mismatch (the manifest was altered or corrupted)".into());
    }
    match map.get("format") {
        Some(Value::Number(n)) if n.as_u64() == Some(u64::from(FORMAT)) => {}
        other => {
            return Err(format!(
                "format {} is not supported (this build reads format {FORMAT})",
                other.map_or_else(|| "missing".to_string(), Value::to_string)
            ))
        }
    }
    let m: Manifest =
        serde_json::from_value(Value::Object(map)).map_err(|e| format!("fields are not as expected ({e})"))?;
    check(&m, sequence)?;
    Ok(m)
}

/// The consistency rules a hash cannot catch (a manifest written by a buggy or foreign writer).
fn check(m: &Manifest, sequence: u64) -> Result<(), String> {
    if m.sequence != sequence {
        return Err(format!(
            "it says sequence {} but is the file of sequence {sequence}",
            m.sequence
        ));
    }
    if !(MIN_BLOCK_BYTES..=MAX_BLOCK_BYTES).contains(&m.block_bytes) {
        return Err(format!("block size {} is out of range", m.block_bytes));
    }
    let mut total: u64 = 0;
    let mut ids = std::collections::HashSet::new();
    for e in &m.entries {
        if !ids.insert(e.id) {
            return Err(format!("entry id {} appears twice", e.id));
        }
        if !is_hash_hex(&e.hash) || !e.blocks.iter().all(|h| is_hash_hex(h)) {
            return Err(format!("entry {} has a malformed hash", e.id));
        }
        total = total.checked_add(e.len).ok_or("entry lengths overflow")?;
        let want_blocks = if m.erasure.is_some() {
            0
        } else {
            e.len.div_ceil(m.block_bytes)
        };
        if e.blocks.len() as u64 != want_blocks {
            return Err(format!(
                "entry {} lists {} blocks, its length needs {want_blocks}",
                e.id,
                e.blocks.len()
            ));
        }
    }
    if total != m.bytes_total {
        return Err(format!(
            "entries add up to {total} bytes, the manifest says {}",
            m.bytes_total
        ));
    }
    match (&m.erasure, m.level) {
        (Some(er), Level::L3) => {
            let n = er.data_shards + er.parity_shards;
            if er.data_shards < 1 || er.parity_shards < 1 || n > 256 || er.shard_hashes.len() != n {
                return Err("erasure shard counts are inconsistent".into());
            }
            if !er.shard_hashes.iter().all(|h| is_hash_hex(h)) {
                return Err("a shard hash is malformed".into());
            }
            let capacity_short = match er.shard_len.checked_mul(er.data_shards as u64) {
                Some(capacity) => capacity < er.serialized_len,
                None => true,
            };
            if capacity_short || er.serialized_len < m.bytes_total {
                return Err("erasure lengths are inconsistent".into());
            }
        }
        (None, Level::L3) => return Err("level l3 without erasure coding information".into()),
        (Some(_), _) => return Err(format!("level {} with erasure coding information", m.level)),
        (None, _) => {}
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample() -> Manifest {
        let data = b"hello";
        Manifest {
            format: FORMAT,
            sequence: 7,
            level: Level::L2,
            created_unix_ms: 1_700_000_000_000,
            bytes_total: 5,
            block_bytes: 4096,
            entries: vec![
                ManifestEntry {
                    id: 3,
                    len: 5,
                    hash: hash_hex(data),
                    blocks: vec![hash_hex(data)],
                },
                ManifestEntry {
                    id: 4,
                    len: 0,
                    hash: hash_hex(b""),
                    blocks: Vec::new(),
                },
            ],
            erasure: None,
        }
    }

    #[test]
    fn round_trip_and_canonical_hash() {
        let bytes = encode(&sample()).expect("encode");
        assert_eq!(decode(&bytes, 7).expect("decode"), sample());
        // Other whitespace, same content: still verifies (the hash covers the canonical form).
        let value: Value = serde_json::from_slice(&bytes).expect("json");
        let pretty = serde_json::to_vec_pretty(&value).expect("pretty");
        assert_ne!(pretty, bytes);
        assert_eq!(decode(&pretty, 7).expect("decode pretty"), sample());
    }

    #[test]
    fn damage_is_reported_not_panicked() {
        let bytes = encode(&sample()).expect("encode");
        assert!(decode(&bytes, 8).expect_err("wrong file").contains("sequence 7"));
        let tampered = String::from_utf8(bytes.clone())
            .expect("utf-8")
            .replace("\"len\":5", "\"len\":6");
        assert!(decode(tampered.as_bytes(), 7)
            .expect_err("tampered")
            .contains("hash mismatch"));
        for cut in 0..bytes.len() - 1 {
            assert!(decode(&bytes[..cut], 7).is_err(), "truncated at {cut}");
        }
        for at in 0..bytes.len() - 1 {
            let mut b = bytes.clone();
            b[at] ^= 0x01;
            assert!(decode(&b, 7).is_err(), "bit flipped at {at}");
        }
    }

    #[test]
    fn inconsistent_manifests_are_refused_even_with_a_valid_hash() {
        let mut m = sample();
        m.entries[0].blocks.clear();
        assert!(decode(&encode(&m).expect("encode"), 7)
            .expect_err("blocks")
            .contains("lists 0 blocks"));
        let mut m = sample();
        m.entries[0].blocks[0] = "../../etc/passwd".into();
        assert!(decode(&encode(&m).expect("encode"), 7)
            .expect_err("path")
            .contains("malformed"));
        let mut m = sample();
        m.bytes_total = 6;
        assert!(decode(&encode(&m).expect("encode"), 7).is_err());
        let mut m = sample();
        m.level = Level::L3;
        assert!(decode(&encode(&m).expect("encode"), 7)
            .expect_err("l3")
            .contains("erasure"));
        let mut m = sample();
        m.format = 2;
        assert!(decode(&encode(&m).expect("encode"), 7)
            .expect_err("format")
            .contains("not supported"));
    }

    #[test]
    fn file_names() {
        assert_eq!(file_name(42), "00000000000000000042.json");
        assert_eq!(parse_file_name(&file_name(u64::MAX)), Some(u64::MAX));
        assert_eq!(parse_file_name("42.json"), None);
        assert_eq!(parse_file_name(".tmp-00000000000000000042.json-1-0"), None);
        assert_eq!(parse_file_name("0000000000000000004x.json"), None);
        assert!(is_hash_hex(&hash_hex(b"x")));
        assert!(!is_hash_hex(&hash_hex(b"x").to_uppercase()));
    }
}
