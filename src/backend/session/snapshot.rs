//! Session snapshots, in memory and on disk.
//!
//! The file is a safetensors file (docs/snapshots.md): tensors `tokens` (u32 `[position]`) and
//! `layers.{i}.k` / `layers.{i}.v` (`[1, kv_heads, held, row]` in the cache's storage: `head_dim`
//! floats, or q8_0 blocks as bytes), and metadata `format` = `candlewick.session`, `version` =
//! `2`, `fingerprint` (the model's), `position`, `layers`, `kv_cache_type`, `first_positions`
//! (each layer's first position held, comma-separated: above 0 where a sliding-window layer keeps
//! only its window, so `held = position - first`), `clean_prefix` (leading positions computed with
//! no edit) and `checksum`: CRC-32 of every tensor's bytes in name order, so a flipped byte
//! anywhere in the data is caught, not only in the header. Version 1 files (every layer from
//! position 0, the cache's dtype named by the tensors) still load.

use std::collections::HashMap;
use std::path::Path;

use candle_core::safetensors::Load;
use candle_core::{DType, Device, Tensor};

use crate::backend::error::{CandleContext, CandleError, Result};
use crate::backend::kv_cache::{HeldKv, KvType};

const FORMAT: &str = "candlewick.session";
const VERSION: &str = "2";

/// A session's tokens and KV cache, copied out of it; restoring copies it back in.
#[derive(Debug)]
pub struct SessionSnapshot {
    pub(crate) tokens: Vec<u32>,
    /// Each layer's held positions, copied out (`None` for an empty one).
    pub(crate) layers: Vec<Option<HeldKv>>,
    /// How the keys and values are stored.
    pub(crate) kv_cache_type: KvType,
    pub(crate) fingerprint: String,
    /// How many leading positions were computed with no edit (reusable for a new prompt).
    pub(crate) clean_prefix: usize,
}

impl SessionSnapshot {
    /// The token ids it holds.
    pub fn tokens(&self) -> &[u32] {
        &self.tokens
    }

    /// The fingerprint of the model it was taken from.
    pub fn fingerprint(&self) -> &str {
        &self.fingerprint
    }

    /// Writes the snapshot to `path` (see the module's documentation for the format).
    pub fn save(&self, path: &Path) -> Result<()> {
        let p = path.display().to_string();
        let ctx = || format!("saving the session snapshot {p}");
        let mut tensors: Vec<(String, Tensor)> = Vec::new();
        if !self.tokens.is_empty() {
            tensors.push(("tokens".into(), Tensor::new(self.tokens.as_slice(), &Device::Cpu).ctx(ctx)?));
        }
        let mut firsts = Vec::with_capacity(self.layers.len());
        for (i, kv) in self.layers.iter().enumerate() {
            firsts.push(kv.as_ref().map_or(0, |h| h.first).to_string());
            if let Some(h) = kv {
                tensors.push((format!("layers.{i}.k"), h.k.contiguous().ctx(ctx)?));
                tensors.push((format!("layers.{i}.v"), h.v.contiguous().ctx(ctx)?));
            }
        }
        tensors.sort_by(|a, b| a.0.cmp(&b.0));
        let checksum = tensors_checksum(&tensors).ctx(ctx)?;
        let metadata = HashMap::from([
            ("format".to_owned(), FORMAT.to_owned()),
            ("version".to_owned(), VERSION.to_owned()),
            ("fingerprint".to_owned(), self.fingerprint.clone()),
            ("position".to_owned(), self.tokens.len().to_string()),
            ("layers".to_owned(), self.layers.len().to_string()),
            ("kv_cache_type".to_owned(), self.kv_cache_type.name().to_owned()),
            ("first_positions".to_owned(), firsts.join(",")),
            ("checksum".to_owned(), checksum),
            ("clean_prefix".to_owned(), self.clean_prefix.to_string()),
        ]);
        safetensors::serialize_to_file(tensors, Some(metadata), path).map_err(|e| CandleError::Malformed {
            what: "session snapshot",
            path: p.clone(),
            reason: e.to_string(),
        })
    }

    /// Reads a snapshot written by `save`; a damaged, truncated or foreign file is an error.
    pub fn load(path: &Path, device: &Device) -> Result<Self> {
        let p = path.display().to_string();
        let bad = |reason: String| CandleError::Malformed { what: "session snapshot", path: p.clone(), reason };
        let bytes = std::fs::read(path).map_err(|source| CandleError::Io { path: p.clone(), source })?;
        let (_, header) = safetensors::SafeTensors::read_metadata(&bytes).map_err(|e| bad(e.to_string()))?;
        let meta = header.metadata().clone().unwrap_or_default();
        let field = |k: &str| meta.get(k).cloned().ok_or_else(|| bad(format!("metadata `{k}` is missing")));
        if field("format")? != FORMAT {
            return Err(bad("not a candlewick session snapshot".into()));
        }
        let version = field("version")?;
        if version != VERSION && version != "1" {
            return Err(bad(format!("version {version} is not one this build reads (1, {VERSION})")));
        }
        let number = |k: &str| field(k)?.parse::<usize>().map_err(|_| bad(format!("metadata `{k}` is not a number")));
        let (position, layers) = (number("position")?, number("layers")?);
        let st = safetensors::SafeTensors::deserialize(&bytes).map_err(|e| bad(e.to_string()))?;
        if file_checksum(&st).map_err(|e| bad(e.to_string()))? != field("checksum")? {
            return Err(bad("checksum mismatch: the file is damaged".into()));
        }
        let get = |name: &str| -> Result<Option<Tensor>> {
            match st.tensor(name) {
                Ok(view) => Ok(Some(view.load(device).map_err(|e| bad(format!("`{name}`: {e}")))?)),
                Err(safetensors::SafeTensorError::TensorNotFound(_)) => Ok(None),
                Err(e) => Err(bad(e.to_string())),
            }
        };
        let tokens = match get("tokens")? {
            Some(t) if t.dtype() == DType::U32 && t.dims() == [position] => t.to_vec1::<u32>().ctx(|| p.clone())?,
            None if position == 0 => Vec::new(),
            _ => return Err(bad(format!("`tokens` is not {position} u32 ids"))),
        };
        // Version 1 held every position of every layer; version 2 says where each layer starts.
        let firsts: Vec<usize> = match meta.get("first_positions") {
            Some(list) if !list.is_empty() => list
                .split(',')
                .map(|n| {
                    n.parse::<usize>().map_err(|_| bad("metadata `first_positions` is not a list of numbers".into()))
                })
                .collect::<Result<_>>()?,
            _ => vec![0; layers],
        };
        if firsts.len() != layers {
            return Err(bad(format!("metadata `first_positions` lists {} layers of {layers}", firsts.len())));
        }
        let mut held = Vec::with_capacity(layers);
        let mut dtype = None;
        for (i, &first) in firsts.iter().enumerate() {
            let kv = match (get(&format!("layers.{i}.k"))?, get(&format!("layers.{i}.v"))?) {
                (Some(k), Some(v))
                    if k.dims() == v.dims()
                        && k.dtype() == v.dtype()
                        && k.rank() == 4
                        && first < position
                        && k.dim(2).ok() == Some(position - first) =>
                {
                    dtype = Some(k.dtype());
                    Some(HeldKv { first, k, v })
                }
                (None, None) if position == 0 || first >= position => None,
                _ => return Err(bad(format!("layer {i}'s keys and values do not hold positions {first}..{position}"))),
            };
            held.push(kv);
        }
        let kv_cache_type = match meta.get("kv_cache_type") {
            Some(name) => KvType::parse(name).ok_or_else(|| bad(format!("unknown kv_cache_type `{name}`")))?,
            None => KvType::of_storage(dtype.unwrap_or(DType::F32)),
        };
        // A file without the key (or with a value past its tokens) offers no reuse: safe either way.
        let clean_prefix = number("clean_prefix").unwrap_or(0).min(position);
        Ok(Self { tokens, layers: held, kv_cache_type, fingerprint: field("fingerprint")?, clean_prefix })
    }
}

/// CRC-32 (hex) of the tensors' bytes, in the order given (name order, as written): the
/// `checksum` of snapshot and prefix-block files.
pub(super) fn tensors_checksum(tensors: &[(String, Tensor)]) -> candle_core::Result<String> {
    use safetensors::View;
    let mut crc = crc32fast::Hasher::new();
    for (_, t) in tensors {
        crc.update(&t.data());
    }
    Ok(format!("{:08x}", crc.finalize()))
}

/// The `checksum` a read file's tensors give (`tensors_checksum` of the same names and bytes).
pub(super) fn file_checksum(
    st: &safetensors::SafeTensors<'_>,
) -> std::result::Result<String, safetensors::SafeTensorError> {
    let mut names: Vec<String> = st.names().into_iter().map(str::to_owned).collect();
    names.sort();
    let mut crc = crc32fast::Hasher::new();
    for n in &names {
        crc.update(st.tensor(n)?.data());
    }
    Ok(format!("{:08x}", crc.finalize()))
}
