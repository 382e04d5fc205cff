//! Level L3: the entries of a checkpoint serialised and Reed–Solomon coded into k data and m
//! parity shards, any k of which give the checkpoint back.
//!
//! Owns the serialised form (a small header, then the entries' bytes concatenated) and the
//! coding. It must not touch files or decide which shards are lost: the store hands it the
//! shards it found intact.

use reed_solomon_erasure::galois_8::ReedSolomon;

use crate::config::Entry;
use crate::error::StoreError;
use crate::manifest::{self, ManifestEntry};

/// First bytes of the serialised form, so a reconstruction that went wrong is recognised before
/// its lengths are trusted.
const MAGIC: &[u8; 8] = b"AGORACK1";

/// Header bytes per entry: id (u32) and length (u64), little endian.
const ENTRY_HEADER: usize = 4 + 8;

/// The entries as one byte string: magic, entry count (u32), per entry id and length, then
/// every entry's bytes in order.
pub(crate) fn serialize(entries: &[Entry]) -> Result<Vec<u8>, StoreError> {
    let count = u32::try_from(entries.len()).map_err(|_| StoreError::Encode {
        what: format!("{} entries is more than an L3 checkpoint holds", entries.len()),
    })?;
    let payload: usize = entries.iter().map(|e| e.bytes.len()).sum();
    let mut out = Vec::with_capacity(MAGIC.len() + 4 + entries.len() * ENTRY_HEADER + payload);
    out.extend_from_slice(MAGIC);
    out.extend_from_slice(&count.to_le_bytes());
    for e in entries {
        out.extend_from_slice(&e.id.to_le_bytes());
        out.extend_from_slice(&(e.bytes.len() as u64).to_le_bytes());
    }
    for e in entries {
        out.extend_from_slice(&e.bytes);
    }
    Ok(out)
}

/// The entries back from their serialised form, checked against the manifest's ids, lengths and
/// hashes; the error says what did not match.
pub(crate) fn deserialize(bytes: &[u8], expected: &[ManifestEntry]) -> Result<Vec<Entry>, String> {
    let header_len = MAGIC.len() + 4 + expected.len() * ENTRY_HEADER;
    if bytes.len() < header_len || &bytes[..MAGIC.len()] != MAGIC {
        return Err("the reconstructed data has no valid header".into());
    }
    let mut pos = MAGIC.len();
    let mut take = |n: usize| {
        let s = &bytes[pos..pos + n];
        pos += n;
        s
    };
    let count = u32::from_le_bytes(take(4).try_into().map_err(|_| "short header")?);
    if count as usize != expected.len() {
        return Err(format!(
            "the reconstructed data has {count} entries, the manifest {}",
            expected.len()
        ));
    }
    let mut lens = Vec::with_capacity(expected.len());
    for want in expected {
        let id = u32::from_le_bytes(take(4).try_into().map_err(|_| "short header")?);
        let len = u64::from_le_bytes(take(8).try_into().map_err(|_| "short header")?);
        if id != want.id || len != want.len {
            return Err(format!(
                "the reconstructed header has entry {id} of {len} bytes where the manifest has entry {} of {} bytes",
                want.id, want.len
            ));
        }
        lens.push(len);
    }
    let mut entries = Vec::with_capacity(expected.len());
    for (want, len) in expected.iter().zip(lens) {
        let end = usize::try_from(len)
            .ok()
            .and_then(|l| pos.checked_add(l))
            .filter(|&end| end <= bytes.len())
            .ok_or_else(|| format!("entry {} runs past the end of the reconstructed data", want.id))?;
        let data = &bytes[pos..end];
        pos = end;
        if manifest::hash_hex(data) != want.hash {
            return Err(format!(
                "entry {} does not match its hash after reconstruction",
                want.id
            ));
        }
        entries.push(Entry {
            id: want.id,
            bytes: data.to_vec(),
        });
    }
    Ok(entries)
}

/// Splits `data` into `data_shards` equal, zero-padded shards and appends `parity_shards`
/// parity shards; returns every shard, data first.
pub(crate) fn encode(data: &[u8], data_shards: usize, parity_shards: usize) -> Result<Vec<Vec<u8>>, StoreError> {
    let rs = codec(data_shards, parity_shards)?;
    // At least one byte per shard: the codec refuses empty shards (the header makes this moot).
    let shard_len = data.len().div_ceil(data_shards).max(1);
    let mut shards: Vec<Vec<u8>> = (0..data_shards + parity_shards)
        .map(|i| {
            let start = (i * shard_len).min(data.len());
            let end = ((i + 1) * shard_len).min(data.len());
            let mut s = if i < data_shards {
                data[start..end].to_vec()
            } else {
                Vec::new()
            };
            s.resize(shard_len, 0);
            s
        })
        .collect();
    rs.encode(&mut shards).map_err(|e| StoreError::Encode {
        what: format!("Reed–Solomon encoding failed: {e:?}"),
    })?;
    Ok(shards)
}

/// The serialised data back from the shards found intact (`None` for a lost one), given at
/// least `data_shards` of them; `serialized_len` strips the padding.
pub(crate) fn reconstruct(
    mut shards: Vec<Option<Vec<u8>>>,
    data_shards: usize,
    parity_shards: usize,
    serialized_len: u64,
) -> Result<Vec<u8>, String> {
    let rs = codec(data_shards, parity_shards).map_err(|e| e.to_string())?;
    rs.reconstruct_data(&mut shards)
        .map_err(|e| format!("Reed–Solomon reconstruction failed: {e:?}"))?;
    let mut out = Vec::new();
    for (i, s) in shards.into_iter().take(data_shards).enumerate() {
        out.extend_from_slice(&s.ok_or_else(|| format!("data shard {i} was not reconstructed"))?);
    }
    let len = usize::try_from(serialized_len).map_err(|_| "serialised length does not fit in memory".to_string())?;
    if out.len() < len {
        return Err("the shards hold less than the serialised length".into());
    }
    out.truncate(len);
    Ok(out)
}

/// The Reed–Solomon codec for k+m.
fn codec(data_shards: usize, parity_shards: usize) -> Result<ReedSolomon, StoreError> {
    ReedSolomon::new(data_shards, parity_shards).map_err(|e| StoreError::Encode {
        what: format!(
            "cannot build a Reed–Solomon code with {data_shards} data and {parity_shards} parity shards: {e:?}"
        ),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn entries() -> Vec<Entry> {
        vec![
            Entry {
                id: 9,
                bytes: (0..=255).collect(),
            },
            Entry {
                id: 2,
                bytes: Vec::new(),
            },
        ]
    }

    fn manifest_entries(entries: &[Entry]) -> Vec<ManifestEntry> {
        entries.iter().map(|e| ManifestEntry::of(e, Vec::new())).collect()
    }

    #[test]
    fn encode_lose_reconstruct() {
        let data = serialize(&entries()).expect("serialize");
        let shards = encode(&data, 3, 2).expect("encode");
        assert_eq!(shards.len(), 5);
        assert!(shards.iter().all(|s| s.len() == data.len().div_ceil(3)));
        let mut partial: Vec<Option<Vec<u8>>> = shards.into_iter().map(Some).collect();
        partial[0] = None;
        partial[4] = None;
        let back = reconstruct(partial, 3, 2, data.len() as u64).expect("reconstruct");
        assert_eq!(back, data);
        assert_eq!(
            deserialize(&back, &manifest_entries(&entries())).expect("deserialize"),
            entries()
        );
    }

    #[test]
    fn mismatches_are_errors() {
        let data = serialize(&entries()).expect("serialize");
        let want = manifest_entries(&entries());
        assert!(deserialize(&data[..10], &want).is_err());
        let mut bad = data.clone();
        let last = bad.len() - 1;
        bad[last] ^= 1;
        assert!(deserialize(&bad, &want).expect_err("hash").contains("entry 9"));
        assert!(deserialize(&data, &want[..1]).expect_err("count").contains("2 entries"));
        let lost: Vec<Option<Vec<u8>>> = vec![None, None, None, Some(vec![0; 4]), Some(vec![0; 4])];
        assert!(reconstruct(lost, 3, 2, 12).is_err());
    }
}
