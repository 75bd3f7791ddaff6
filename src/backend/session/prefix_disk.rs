//! The prefix cache's disk tier: each block of the memory cache (`prefix_cache.rs`) is also
//! written to a directory, so a process started later (a restarted server) restores a long prompt
//! prefix from disk instead of computing it again (docs/engine.md, "The prefix cache on disk").
//!
//! One file a block, `{name}.cwkv`, a safetensors file: `tokens` (u32 `[end]`: the whole token
//! prefix the block ends, so a file is matched by its exact tokens, never by a hash alone) and
//! `layers.{i}.k` / `layers.{i}.v` (`[1, kv_heads, block_tokens, row]` in the KV cache's storage:
//! float16 / float32 rows, or q8_0 blocks as bytes, as the model's `kv_cache_type` stores them),
//! with metadata `format` = `candlewick.prefix-block`, `version` = `1`, `fingerprint` (the
//! model's, as snapshots carry it), `kv_cache_type`, `block_tokens`, `end`, `layers`, `present`
//! (the layers held, comma-separated: a sliding-window layer's block may be absent) and `checksum`
//! (CRC-32 of every tensor's bytes in name order). The name is a hash of the model's identity
//! (fingerprint, KV cache type, block size) and the token prefix; it only says where to look.
//!
//! A file is checked when read: one that does not parse, is truncated, has another format or
//! version, another model's fingerprint, another KV cache type or block size, other tokens, a
//! checksum that does not match or tensors of the wrong shape or type is skipped, counted
//! (`skipped`) and deleted, never loaded. Files are written whole under a temporary name and
//! renamed, so a crash leaves no half file under a block's name.
//!
//! The directory holds at most `cap_bytes`: past it the least recently used files go first (the
//! order of use in this process, after the files' modification times at start; a file read is
//! touched, so the order survives a restart).

use std::collections::HashMap;
use std::fs;
use std::path::{Path, PathBuf};
use std::time::SystemTime;

use candle_core::safetensors::Load;
use candle_core::{DType, Device, Tensor};

use crate::backend::error::{CandleContext, CandleError, Result};
use crate::backend::kv_cache::KvType;

use super::snapshot::{file_checksum, tensors_checksum};

const FORMAT: &str = "candlewick.prefix-block";
const VERSION: &str = "1";
const EXT: &str = "cwkv";

/// What a block file must match to be loaded: the model and how its cache stores keys.
#[derive(Debug, Clone, PartialEq)]
pub struct BlockIdentity {
    /// The model's fingerprint (`Decoder::fingerprint`).
    pub fingerprint: String,
    /// How keys and values are stored.
    pub kv_cache_type: KvType,
    /// Positions per block.
    pub block_tokens: usize,
    /// Layers of the model.
    pub layers: usize,
    /// Each stored layer's shape, `[1, kv_heads, block_tokens, row]`.
    pub shape: [usize; 4],
    /// The stored dtype.
    pub dtype: DType,
}

/// Counters of the disk tier.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct PrefixDiskStats {
    /// Block files in the directory now.
    pub files: usize,
    /// Their bytes.
    pub bytes: u64,
    /// Blocks written.
    pub written: usize,
    /// Blocks loaded into memory from disk.
    pub loaded: usize,
    /// Files skipped (and deleted) when read: damaged, truncated or another model's.
    pub skipped: usize,
    /// Files deleted to stay within the cap.
    pub evictions: usize,
    /// Writes that failed (a full disk, a directory gone): the block stays in memory only.
    pub write_errors: usize,
}

#[derive(Debug)]
struct DiskFile {
    bytes: u64,
    last_used: u64,
}

/// A directory of prefix blocks under a byte cap (see the module's notes).
#[derive(Debug)]
pub struct PrefixDisk {
    dir: PathBuf,
    cap_bytes: u64,
    files: HashMap<String, DiskFile>,
    clock: u64,
    /// The last modification time this process gave a file: each stamp is later than the one
    /// before, because the kernel's file times are coarse (a few ms) and blocks written in one
    /// step would otherwise tie, losing their order of use for the next process.
    last_stamp: SystemTime,
    stats: PrefixDiskStats,
}

impl PrefixDisk {
    /// Opens (creating) `dir` with at most `cap_bytes` of block files; the files already there
    /// count, in the order of their modification times.
    pub fn open(dir: &Path, cap_bytes: u64) -> Result<Self> {
        let p = dir.display().to_string();
        fs::create_dir_all(dir).map_err(|source| CandleError::Io { path: p.clone(), source })?;
        let mut found = Vec::new();
        for entry in fs::read_dir(dir).map_err(|source| CandleError::Io { path: p.clone(), source })? {
            let Ok(entry) = entry else { continue };
            let name = entry.file_name().to_string_lossy().into_owned();
            if !name.ends_with(&format!(".{EXT}")) {
                continue;
            }
            let Ok(meta) = entry.metadata() else { continue };
            found.push((meta.modified().unwrap_or(SystemTime::UNIX_EPOCH), name, meta.len()));
        }
        found.sort();
        let last_stamp = found.last().map_or(SystemTime::UNIX_EPOCH, |f| f.0);
        let mut disk = Self {
            dir: dir.to_path_buf(),
            cap_bytes,
            files: HashMap::new(),
            clock: 0,
            last_stamp,
            stats: PrefixDiskStats::default(),
        };
        for (_, name, bytes) in found {
            disk.clock += 1;
            disk.stats.bytes += bytes;
            disk.files.insert(name, DiskFile { bytes, last_used: disk.clock });
        }
        disk.evict(None);
        Ok(disk)
    }

    /// The counters, with the files and bytes held now.
    pub fn stats(&self) -> PrefixDiskStats {
        PrefixDiskStats { files: self.files.len(), ..self.stats }
    }

    /// The file name of the block ending `prefix` for `id`: FNV-1a (64 bits) and CRC-32 of the
    /// identity and the tokens, as hex.
    pub fn file_name(id: &BlockIdentity, prefix: &[u32]) -> String {
        let mut bytes = Vec::with_capacity(prefix.len() * 4 + 64);
        bytes.extend_from_slice(id.fingerprint.as_bytes());
        bytes.push(0);
        bytes.extend_from_slice(id.kv_cache_type.name().as_bytes());
        bytes.push(0);
        bytes.extend_from_slice(&(id.block_tokens as u64).to_le_bytes());
        for t in prefix {
            bytes.extend_from_slice(&t.to_le_bytes());
        }
        let mut fnv: u64 = 0xcbf2_9ce4_8422_2325;
        for b in &bytes {
            fnv = (fnv ^ u64::from(*b)).wrapping_mul(0x0100_0000_01b3);
        }
        format!("{fnv:016x}{:08x}.{EXT}", crc32fast::hash(&bytes))
    }

    /// Whether a file for the block ending `prefix` is in the directory (not checked).
    pub fn has(&self, id: &BlockIdentity, prefix: &[u32]) -> bool {
        self.files.contains_key(&Self::file_name(id, prefix))
    }

    /// Marks the block ending `prefix` as just used (this process's order only).
    pub fn touch(&mut self, id: &BlockIdentity, prefix: &[u32]) {
        self.clock += 1;
        if let Some(f) = self.files.get_mut(&Self::file_name(id, prefix)) {
            f.last_used = self.clock;
        }
    }

    /// Writes the block ending `prefix` (its layers, `None` where not held), replacing an older
    /// file of it, then deletes least recently used files beyond the cap. A block larger than
    /// the cap is not written. A failed write is counted, not an error: the block is still in
    /// memory.
    pub fn write(&mut self, id: &BlockIdentity, prefix: &[u32], layers: &[Option<(Tensor, Tensor)>]) {
        let name = Self::file_name(id, prefix);
        match self.try_write(&name, id, prefix, layers) {
            Ok(Some(bytes)) => {
                let path = self.dir.join(&name);
                self.stamp(&path);
                self.clock += 1;
                if let Some(old) = self.files.insert(name.clone(), DiskFile { bytes, last_used: self.clock }) {
                    self.stats.bytes -= old.bytes;
                }
                self.stats.bytes += bytes;
                self.stats.written += 1;
                self.evict(Some(&name));
            }
            Ok(None) => {}
            Err(_) => self.stats.write_errors += 1,
        }
    }

    fn try_write(
        &self,
        name: &str,
        id: &BlockIdentity,
        prefix: &[u32],
        layers: &[Option<(Tensor, Tensor)>],
    ) -> Result<Option<u64>> {
        let path = self.dir.join(name);
        let p = path.display().to_string();
        let ctx = || format!("writing the prefix block {p}");
        let mut tensors: Vec<(String, Tensor)> = vec![("tokens".into(), Tensor::new(prefix, &Device::Cpu).ctx(ctx)?)];
        let mut present = Vec::new();
        for (i, kv) in layers.iter().enumerate() {
            if let Some((k, v)) = kv {
                present.push(i.to_string());
                tensors.push((format!("layers.{i}.k"), k.to_device(&Device::Cpu).ctx(ctx)?.contiguous().ctx(ctx)?));
                tensors.push((format!("layers.{i}.v"), v.to_device(&Device::Cpu).ctx(ctx)?.contiguous().ctx(ctx)?));
            }
        }
        let size: usize = tensors.iter().map(|(_, t)| t.elem_count() * t.dtype().size_in_bytes()).sum();
        if size as u64 > self.cap_bytes {
            return Ok(None);
        }
        tensors.sort_by(|a, b| a.0.cmp(&b.0));
        let checksum = tensors_checksum(&tensors).ctx(ctx)?;
        let metadata = HashMap::from([
            ("format".to_owned(), FORMAT.to_owned()),
            ("version".to_owned(), VERSION.to_owned()),
            ("fingerprint".to_owned(), id.fingerprint.clone()),
            ("kv_cache_type".to_owned(), id.kv_cache_type.name().to_owned()),
            ("block_tokens".to_owned(), id.block_tokens.to_string()),
            ("end".to_owned(), prefix.len().to_string()),
            ("layers".to_owned(), layers.len().to_string()),
            ("present".to_owned(), present.join(",")),
            ("checksum".to_owned(), checksum),
        ]);
        // Written whole under a name of this process's own, then renamed: a reader (this process
        // after a crash, or another sharing the directory) never sees half a block.
        let tmp = self.dir.join(format!("{name}.tmp-{}", std::process::id()));
        let bad = |reason: String| CandleError::Malformed { what: "prefix block", path: p.clone(), reason };
        safetensors::serialize_to_file(tensors, Some(metadata), &tmp).map_err(|e| bad(e.to_string()))?;
        fs::rename(&tmp, &path).map_err(|source| {
            let _ = fs::remove_file(&tmp);
            CandleError::Io { path: p.clone(), source }
        })?;
        let bytes = fs::metadata(&path).map_err(|source| CandleError::Io { path: p.clone(), source })?.len();
        Ok(Some(bytes))
    }

    /// The layers of the block ending `prefix`, from its file on `device`: `None` when there is
    /// no file, or when the file fails a check (then it is counted in `skipped` and deleted).
    pub fn read(
        &mut self,
        id: &BlockIdentity,
        prefix: &[u32],
        device: &Device,
    ) -> Option<Vec<Option<(Tensor, Tensor)>>> {
        let name = Self::file_name(id, prefix);
        if !self.files.contains_key(&name) {
            return None;
        }
        let path = self.dir.join(&name);
        match read_block(&path, id, prefix, device) {
            Ok(layers) => {
                self.clock += 1;
                if let Some(f) = self.files.get_mut(&name) {
                    f.last_used = self.clock;
                }
                // The file's time carries the order of use to the next process.
                self.stamp(&path);
                self.stats.loaded += 1;
                Some(layers)
            }
            Err(_) => {
                self.stats.skipped += 1;
                self.forget(&name);
                None
            }
        }
    }

    fn forget(&mut self, name: &str) {
        if let Some(f) = self.files.remove(name) {
            self.stats.bytes -= f.bytes;
        }
        let _ = fs::remove_file(self.dir.join(name));
    }

    /// Deletes least recently used files (never `keep`) until the cap holds.
    /// Sets `path`'s modification time to now, or just after the last stamp where the coarse
    /// clock has not moved on, so that the next process reads the order of use back.
    fn stamp(&mut self, path: &Path) {
        let now = SystemTime::now().max(self.last_stamp + std::time::Duration::from_micros(1));
        if let Ok(f) = fs::File::options().write(true).open(path) {
            if f.set_modified(now).is_ok() {
                self.last_stamp = now;
            }
        }
    }

    fn evict(&mut self, keep: Option<&str>) {
        while self.stats.bytes > self.cap_bytes {
            let victim = self
                .files
                .iter()
                .filter(|(n, _)| Some(n.as_str()) != keep)
                .min_by_key(|(_, f)| f.last_used)
                .map(|(n, _)| n.clone());
            let Some(name) = victim else { break };
            self.forget(&name);
            self.stats.evictions += 1;
        }
    }
}

/// Reads and checks one block file (see the module's notes).
fn read_block(
    path: &Path,
    id: &BlockIdentity,
    prefix: &[u32],
    device: &Device,
) -> Result<Vec<Option<(Tensor, Tensor)>>> {
    let p = path.display().to_string();
    let bad = |reason: String| CandleError::Malformed { what: "prefix block", path: p.clone(), reason };
    let bytes = fs::read(path).map_err(|source| CandleError::Io { path: p.clone(), source })?;
    let (_, header) = safetensors::SafeTensors::read_metadata(&bytes).map_err(|e| bad(e.to_string()))?;
    let meta = header.metadata().clone().unwrap_or_default();
    let field = |k: &str| meta.get(k).cloned().ok_or_else(|| bad(format!("metadata `{k}` is missing")));
    if field("format")? != FORMAT || field("version")? != VERSION {
        return Err(bad("not a candlewick prefix block of this version".into()));
    }
    if field("fingerprint")? != id.fingerprint {
        return Err(bad("another model's block".into()));
    }
    if field("kv_cache_type")? != id.kv_cache_type.name() || field("block_tokens")? != id.block_tokens.to_string() {
        return Err(bad("another KV cache type or block size".into()));
    }
    if field("end")? != prefix.len().to_string() || field("layers")? != id.layers.to_string() {
        return Err(bad("another prefix length or layer count".into()));
    }
    let st = safetensors::SafeTensors::deserialize(&bytes).map_err(|e| bad(e.to_string()))?;
    if file_checksum(&st).map_err(|e| bad(e.to_string()))? != field("checksum")? {
        return Err(bad("checksum mismatch: the file is damaged".into()));
    }
    let load = |name: &str| -> Result<Tensor> {
        let view = st.tensor(name).map_err(|e| bad(format!("`{name}`: {e}")))?;
        view.load(device).map_err(|e| bad(format!("`{name}`: {e}")))
    };
    let tokens = load("tokens")?;
    if tokens.dtype() != DType::U32 || tokens.to_vec1::<u32>().ctx(|| p.clone())? != prefix {
        return Err(bad("the block's tokens are another prefix's".into()));
    }
    let present: Vec<usize> = match field("present")?.as_str() {
        "" => Vec::new(),
        list => list
            .split(',')
            .map(|n| n.parse::<usize>().map_err(|_| bad("bad `present` list".into())))
            .collect::<Result<_>>()?,
    };
    let mut layers: Vec<Option<(Tensor, Tensor)>> = vec![None; id.layers];
    for i in present {
        if i >= id.layers {
            return Err(bad(format!("layer {i} of {}", id.layers)));
        }
        let (k, v) = (load(&format!("layers.{i}.k"))?, load(&format!("layers.{i}.v"))?);
        if k.dims() != id.shape || v.dims() != id.shape || k.dtype() != id.dtype || v.dtype() != id.dtype {
            return Err(bad(format!("layer {i}'s keys and values are not {:?} {:?}", id.shape, id.dtype)));
        }
        layers[i] = Some((k, v));
    }
    if st.len() != 1 + 2 * layers.iter().filter(|l| l.is_some()).count() {
        return Err(bad("tensors beyond the ones listed".into()));
    }
    Ok(layers)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn identity(fingerprint: &str) -> BlockIdentity {
        BlockIdentity {
            fingerprint: fingerprint.into(),
            kv_cache_type: KvType::Dense(DType::F32),
            block_tokens: 4,
            layers: 2,
            shape: [1, 1, 4, 2],
            dtype: DType::F32,
        }
    }

    fn layers(x: f32) -> Vec<Option<(Tensor, Tensor)>> {
        let t = Tensor::full(x, (1, 1, 4, 2), &Device::Cpu).unwrap();
        vec![Some((t.clone(), t)), None]
    }

    #[test]
    fn a_block_comes_back_and_another_models_file_is_skipped() {
        let dir = std::env::temp_dir().join(format!("candlewick-prefix-disk-{}", std::process::id()));
        let _ = fs::remove_dir_all(&dir);
        let mut disk = PrefixDisk::open(&dir, 1 << 20).unwrap();
        let (a, b, prefix) = (identity("aaaa"), identity("bbbb"), [1u32, 2, 3, 4]);
        assert_ne!(PrefixDisk::file_name(&a, &prefix), PrefixDisk::file_name(&b, &prefix));
        assert_ne!(PrefixDisk::file_name(&a, &prefix), PrefixDisk::file_name(&a, &[1, 2, 3, 5]));
        disk.write(&a, &prefix, &layers(1.5));
        let back = disk.read(&a, &prefix, &Device::Cpu).unwrap();
        assert!(back[1].is_none());
        assert_eq!(back[0].as_ref().unwrap().1.flatten_all().unwrap().to_vec1::<f32>().unwrap(), vec![1.5; 8]);
        assert!(disk.read(&a, &[1, 2, 3, 5], &Device::Cpu).is_none(), "no file: nothing, nothing skipped");
        assert_eq!(disk.stats().skipped, 0);

        // Another model's block under this model's name: skipped, counted and deleted.
        disk.write(&b, &prefix, &layers(2.0));
        let name = PrefixDisk::file_name(&a, &prefix);
        fs::copy(dir.join(PrefixDisk::file_name(&b, &prefix)), dir.join(&name)).unwrap();
        assert!(disk.read(&a, &prefix, &Device::Cpu).is_none());
        assert_eq!(disk.stats().skipped, 1);
        assert!(!dir.join(&name).exists());

        // A reopened directory with a cap of one file keeps the most recently used.
        drop(disk);
        let disk =
            PrefixDisk::open(&dir, fs::metadata(dir.join(PrefixDisk::file_name(&b, &prefix))).unwrap().len()).unwrap();
        assert_eq!(disk.stats().files, 1);
        let _ = fs::remove_dir_all(&dir);
    }
}
