//! A disk cache of the merges generated from a GGUF vocabulary that states none (Gemma 3's
//! 262k tokens: a fifth of a load's time), keyed on the tokens and scores they are generated
//! from and checked before use: a file that is truncated, corrupted or names a token the
//! vocabulary lacks is ignored, and the merges are generated again.
//!
//! Where: `$CANDLEWICK_CACHE_DIR/merges`, else `$XDG_CACHE_HOME/candlewick/merges`, else
//! `~/.cache/candlewick/merges`; `CANDLEWICK_CACHE_DIR=` (empty) turns the cache off. Reading
//! and writing are best effort: a cache that cannot be written only costs the time it would
//! have saved.
//!
//! A file: 8 bytes of magic (which also versions the generation), the merge count (u64), the
//! merges as pairs of token ids (u32 each, little-endian), and a CRC-32 of all that.

use std::hash::{BuildHasher, Hash, Hasher};
use std::path::{Path, PathBuf};

const MAGIC: &[u8; 8] = b"CWMRG001";
const HEADER: usize = 16;
const TRAILER: usize = 4;

/// The cache directory, if the environment allows one.
pub(crate) fn dir() -> Option<PathBuf> {
    let base = match std::env::var_os("CANDLEWICK_CACHE_DIR") {
        Some(d) if d.is_empty() => return None,
        Some(d) => PathBuf::from(d),
        None => match std::env::var_os("XDG_CACHE_HOME").filter(|d| !d.is_empty()) {
            Some(d) => PathBuf::from(d).join("candlewick"),
            None => PathBuf::from(std::env::var_os("HOME")?).join(".cache").join("candlewick"),
        },
    };
    Some(base.join("merges"))
}

/// A 128-bit key over everything the generated merges depend on: each token as spelled for
/// the BPE, in order, and each score.
pub(crate) fn key(tokens: &[String], scores: &[f64]) -> String {
    let digest = |seed: u64| {
        let mut h = ahash::RandomState::with_seeds(seed, 0x9e37_79b9, 0x85eb_ca6b, 0xc2b2_ae35).build_hasher();
        MAGIC.hash(&mut h);
        tokens.hash(&mut h);
        scores.len().hash(&mut h);
        scores.iter().for_each(|s| s.to_bits().hash(&mut h));
        h.finish()
    };
    format!("{:016x}{:016x}", digest(1), digest(2))
}

/// The merges stored under `key` in `dir`, as ids of `tokens` tokens whose spellings total
/// `token_bytes` (a token of `b` bytes has at most `b - 1` splits: a larger file is not ours).
pub(crate) fn read(dir: &Path, key: &str, tokens: usize, token_bytes: usize) -> Option<Vec<(u32, u32)>> {
    let path = dir.join(key);
    let most = HEADER + TRAILER + 8 * token_bytes;
    if std::fs::metadata(&path).ok()?.len() > most as u64 {
        return None;
    }
    let bytes = std::fs::read(&path).ok()?;
    let (body, crc) = bytes.split_at(bytes.len().checked_sub(TRAILER)?);
    if body.len() < HEADER || &body[..8] != MAGIC || crc32fast::hash(body).to_le_bytes() != crc {
        return None;
    }
    let count = usize::try_from(u64::from_le_bytes(body[8..16].try_into().ok()?)).ok()?;
    let pairs = &body[HEADER..];
    if count.checked_mul(8)? != pairs.len() {
        return None;
    }
    let id = |b: &[u8]| u32::from_le_bytes(b.try_into().expect("4 bytes"));
    pairs
        .chunks_exact(8)
        .map(|p| {
            let (l, r) = (id(&p[..4]), id(&p[4..]));
            ((l as usize) < tokens && (r as usize) < tokens).then_some((l, r))
        })
        .collect()
}

/// Stores `merges` under `key` in `dir`: written to a temporary file, then renamed into place,
/// so that a reader never sees half a file. Errors are dropped (the cache is an optimisation).
pub(crate) fn write(dir: &Path, key: &str, merges: &[(u32, u32)]) {
    let mut bytes = Vec::with_capacity(HEADER + 8 * merges.len() + TRAILER);
    bytes.extend_from_slice(MAGIC);
    bytes.extend_from_slice(&(merges.len() as u64).to_le_bytes());
    for &(l, r) in merges {
        bytes.extend_from_slice(&l.to_le_bytes());
        bytes.extend_from_slice(&r.to_le_bytes());
    }
    let crc = crc32fast::hash(&bytes);
    bytes.extend_from_slice(&crc.to_le_bytes());
    let temp = dir.join(format!("{key}.{}.tmp", std::process::id()));
    let written = std::fs::create_dir_all(dir)
        .and_then(|_| std::fs::write(&temp, &bytes))
        .and_then(|_| std::fs::rename(&temp, dir.join(key)));
    if written.is_err() {
        let _ = std::fs::remove_file(&temp);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn scratch(name: &str) -> PathBuf {
        let d = std::env::temp_dir().join(format!("candlewick-merge-cache-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        d
    }

    #[test]
    fn stored_merges_read_back_and_damaged_files_are_ignored() {
        let dir = scratch("roundtrip");
        let merges = vec![(0u32, 1u32), (2, 3), (4, 0)];
        assert_eq!(read(&dir, "k", 5, 20), None);
        write(&dir, "k", &merges);
        assert_eq!(read(&dir, "k", 5, 20), Some(merges.clone()));
        // A vocabulary without token 4, or too short to have this many splits: not ours.
        assert_eq!(read(&dir, "k", 4, 20), None);
        assert_eq!(read(&dir, "k", 5, 2), None);
        let path = dir.join("k");
        let good = std::fs::read(&path).unwrap();
        for damaged in [good[..good.len() - 1].to_vec(), good[..3].to_vec(), Vec::new(), {
            let mut b = good.clone();
            b[HEADER + 2] ^= 1;
            b
        }] {
            std::fs::write(&path, &damaged).unwrap();
            assert_eq!(read(&dir, "k", 5, 20), None);
        }
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn the_key_follows_every_token_and_score() {
        let tokens: Vec<String> = ["a", "b", "ab"].iter().map(|s| s.to_string()).collect();
        let k = key(&tokens, &[0.0, -1.0, -2.0]);
        assert_eq!(k.len(), 32);
        assert_eq!(k, key(&tokens, &[0.0, -1.0, -2.0]));
        assert_ne!(k, key(&tokens, &[0.0, -1.0, -3.0]));
        let respelled: Vec<String> = ["a", "b", "ba"].iter().map(|s| s.to_string()).collect();
        assert_ne!(k, key(&respelled, &[0.0, -1.0, -2.0]));
    }
}
