//! Hugging Face safetensors checkpoints, single-file or sharded.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use candle_core::safetensors::MmapedSafetensors;
use candle_core::{DType, Device, Tensor};

use super::{convert, finite, WeightSource};
use crate::backend::error::{CandleContext, CandleError, Result};

/// Memory-mapped safetensors files with their tensors' shapes indexed up front.
pub struct SafetensorsWeights {
    files: MmapedSafetensors,
    index: HashMap<String, (Vec<usize>, String)>,
    /// Whether tensors are checked for non-finite values as they load (`finite::check`).
    check_tensors: bool,
    /// The stored name of each tensor indexed under another (`prefix_bare_names`).
    stored: HashMap<String, String>,
}

impl SafetensorsWeights {
    /// Opens `model.safetensors`, or every shard listed in `model.safetensors.index.json`, in `dir`.
    pub fn open_dir(dir: &Path) -> Result<Self> {
        let single = dir.join("model.safetensors");
        let index = dir.join("model.safetensors.index.json");
        let paths = if single.is_file() {
            vec![single]
        } else if index.is_file() {
            shard_paths(&index)?
        } else {
            return Err(CandleError::MissingFile {
                what: "model.safetensors or model.safetensors.index.json",
                path: dir.display().to_string(),
            });
        };
        Self::open(&paths)
    }

    /// Opens and validates the given files.
    pub fn open(paths: &[PathBuf]) -> Result<Self> {
        for p in paths {
            if !p.is_file() {
                return Err(CandleError::MissingFile { what: "safetensors shard", path: p.display().to_string() });
            }
        }
        // SAFETY: the files are mapped read-only; candlewick never writes to them, and a file
        // changed underneath a running model is outside what any mmap-based loader can guard.
        let files = unsafe { MmapedSafetensors::multi(paths) }.map_err(|e| CandleError::Malformed {
            what: "safetensors file",
            path: paths.iter().map(|p| p.display().to_string()).collect::<Vec<_>>().join(", "),
            reason: e.to_string(),
        })?;
        let index = files
            .tensors()
            .into_iter()
            .map(|(name, view)| (name, (view.shape().to_vec(), format!("{:?}", view.dtype()))))
            .collect();
        Ok(Self { files, index, check_tensors: true, stored: HashMap::new() })
    }

    /// Indexes the tensors of a checkpoint saved from the base model without its `prefix`
    /// (sentence-transformers saves Qwen3-Embedding and EmbeddingGemma as `embed_tokens.weight`,
    /// `layers.0...`, `norm.weight`) under `prefix`, so the usual names find them. Does nothing
    /// where any name already starts with `prefix` or `{prefix}embed_tokens.weight` would not
    /// exist; returns whether it renamed.
    pub fn prefix_bare_names(&mut self, prefix: &str) -> bool {
        if self.index.keys().any(|n| n.starts_with(prefix)) || !self.index.contains_key("embed_tokens.weight") {
            return false;
        }
        let old = std::mem::take(&mut self.index);
        for (name, entry) in old {
            // The output projection keeps its name: it never had the prefix.
            let public = if name.starts_with("lm_head.") { name.clone() } else { format!("{prefix}{name}") };
            self.stored.insert(public.clone(), name);
            self.index.insert(public, entry);
        }
        true
    }

    /// The name `name` is stored under.
    fn stored_name<'a>(&'a self, name: &'a str) -> &'a str {
        self.stored.get(name).map_or(name, String::as_str)
    }

    /// Turns the check for NaN and infinite values off (`false`) or on; on by default.
    pub fn set_check_tensors(&mut self, check: bool) {
        self.check_tensors = check;
    }

    /// The element type most tensors are stored in, if any are floating point.
    pub fn dominant_dtype(&self) -> Option<DType> {
        let mut counts: HashMap<DType, usize> = HashMap::new();
        for (_, dt) in self.index.values() {
            if let Some(d) = float_dtype(dt) {
                *counts.entry(d).or_default() += 1;
            }
        }
        counts.into_iter().max_by_key(|(_, n)| *n).map(|(d, _)| d)
    }
}

/// The candle dtype of a safetensors element type name, for the float types candlewick runs.
fn float_dtype(stored: &str) -> Option<DType> {
    match stored {
        "F32" => Some(DType::F32),
        "F16" => Some(DType::F16),
        "BF16" => Some(DType::BF16),
        _ => None,
    }
}

fn shard_paths(index: &Path) -> Result<Vec<PathBuf>> {
    let text = std::fs::read_to_string(index)
        .map_err(|source| CandleError::Io { path: index.display().to_string(), source })?;
    let malformed = |reason: String| CandleError::Malformed {
        what: "safetensors index",
        path: index.display().to_string(),
        reason,
    };
    let json: serde_json::Value = serde_json::from_str(&text).map_err(|e| malformed(e.to_string()))?;
    let map =
        json.get("weight_map").and_then(|m| m.as_object()).ok_or_else(|| malformed("no `weight_map` object".into()))?;
    let dir = index.parent().unwrap_or(Path::new("."));
    let mut files: Vec<PathBuf> = Vec::new();
    for (tensor, v) in map {
        let f = v.as_str().ok_or_else(|| malformed(format!("`weight_map[\"{tensor}\"]` is not a file name")))?;
        let p = shard_inside(dir, f).map_err(|why| malformed(format!("`weight_map[\"{tensor}\"]` = {f:?} {why}")))?;
        if !files.contains(&p) {
            files.push(p);
        }
    }
    Ok(files)
}

/// A shard path from an index, refused unless it names a plain file inside `dir`: an index is
/// data from the checkpoint's author, and must not make us read files elsewhere on the machine.
fn shard_inside(dir: &Path, name: &str) -> std::result::Result<PathBuf, String> {
    use std::path::Component;
    let relative = Path::new(name);
    if name.is_empty() || !relative.components().all(|c| matches!(c, Component::Normal(_))) {
        return Err("is not a file name inside the model directory (absolute, `..` or empty)".into());
    }
    // Checked lexically, not by resolving links: the Hugging Face cache keeps every file of a
    // snapshot as a link into a shared blob folder, so a resolved path is outside by design.
    Ok(dir.join(relative))
}

impl WeightSource for SafetensorsWeights {
    fn names(&self) -> Vec<String> {
        self.index.keys().cloned().collect()
    }

    fn shape(&self, name: &str) -> Option<Vec<usize>> {
        self.index.get(name).map(|(s, _)| s.clone())
    }

    fn dense(&self, name: &str, dtype: DType, device: &Device) -> Result<Tensor> {
        let (_, stored) = self.index.get(name).ok_or_else(|| CandleError::MissingTensor { name: name.to_owned() })?;
        let Some(float) = float_dtype(stored) else {
            return Err(CandleError::UnsupportedTensorType { tensor: name.to_owned(), dtype: stored.clone() });
        };
        if let (true, Some(ggml)) = (self.check_tensors, finite::of_float(float)) {
            let view = self.files.get(self.stored_name(name)).ctx(|| format!("reading tensor `{name}`"))?;
            finite::check(ggml, view.data(), 0).map_err(|reason| CandleError::Malformed {
                what: "safetensors tensor",
                path: format!("`{name}`"),
                reason: format!("{reason}; load with check_tensors=False to skip this check"),
            })?;
        }
        let t = self.files.load(self.stored_name(name), device).ctx(|| format!("loading tensor `{name}`"))?;
        convert(t, name, dtype)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shards_must_stay_inside_the_directory() {
        let dir = Path::new("/models/m");
        assert_eq!(shard_inside(dir, "a.safetensors").unwrap(), dir.join("a.safetensors"));
        assert_eq!(shard_inside(dir, "sub/a.safetensors").unwrap(), dir.join("sub/a.safetensors"));
        for bad in ["../a.safetensors", "/etc/passwd", "sub/../../a", "", "./../a", "."] {
            assert!(shard_inside(dir, bad).is_err(), "{bad:?} was accepted");
        }
    }
}
