//! Multimodal checkpoints nest the language model under a prefix (`model.language_model.` in
//! transformers 5, `language_model.model.` before) and the vision tower beside it. Renaming them
//! to the names a text checkpoint uses lets the one decoder (and the one vision encoder) load
//! them, rather than a copy of either per layout.

use std::collections::HashMap;

use candle_core::{DType, Device, Tensor};

use super::embedding::Embedding;
use super::WeightSource;
use crate::backend::error::Result;
use crate::backend::kernels::Weight;

/// Stored prefix → the prefix the decoder and the vision encoder name, the first that matches.
/// The vision tower is named `vision_tower.vision_model.` on the Hub and `vision_tower.` by
/// transformers 5's `save_pretrained`; Idefics3 and SmolVLM name theirs `model.text_model.`,
/// `model.vision_model.` and `model.connector.` in both.
const RENAMES: [(&str, &str); 12] = [
    ("model.language_model.", "model."),
    ("model.text_model.", "model."),
    ("model.vision_model.", "vision_tower.vision_model."),
    ("model.connector.", "connector."),
    ("language_model.model.", "model."),
    ("language_model.lm_head.", "lm_head."),
    ("model.vision_tower.vision_model.", "vision_tower.vision_model."),
    ("vision_tower.vision_model.", "vision_tower.vision_model."),
    ("model.vision_tower.", "vision_tower.vision_model."),
    ("vision_tower.", "vision_tower.vision_model."),
    ("model.multi_modal_projector.", "multi_modal_projector."),
    ("model.lm_head.", "lm_head."),
];

/// A checkpoint whose tensors are read under their renamed names.
struct Prefixed {
    inner: Box<dyn WeightSource>,
    /// Renamed name → stored name.
    stored: HashMap<String, String>,
}

/// `source` with multimodal prefixes renamed, or `source` itself where none occurs.
pub fn renamed(source: Box<dyn WeightSource>) -> Box<dyn WeightSource> {
    let names = source.names();
    if !names.iter().any(|n| RENAMES.iter().any(|(from, _)| n.starts_with(from))) {
        return source;
    }
    let stored = names
        .into_iter()
        .map(|n| {
            let renamed = RENAMES
                .iter()
                .find_map(|(from, to)| n.strip_prefix(from).map(|rest| format!("{to}{rest}")))
                .unwrap_or_else(|| n.clone());
            (renamed, n)
        })
        .collect();
    Box::new(Prefixed { inner: source, stored })
}

impl Prefixed {
    fn name<'a>(&'a self, name: &'a str) -> &'a str {
        self.stored.get(name).map_or(name, String::as_str)
    }
}

impl WeightSource for Prefixed {
    fn names(&self) -> Vec<String> {
        self.stored.keys().cloned().collect()
    }
    fn shape(&self, name: &str) -> Option<Vec<usize>> {
        self.stored.get(name).and_then(|s| self.inner.shape(s))
    }
    fn dense(&self, name: &str, dtype: DType, device: &Device) -> Result<Tensor> {
        self.inner.dense(self.name(name), dtype, device)
    }
    fn matmul(&self, name: &str, dtype: DType, device: &Device) -> Result<Weight> {
        self.inner.matmul(self.name(name), dtype, device)
    }
    fn expert_matmul(&self, name: &str, expert: usize, dtype: DType, device: &Device) -> Result<Weight> {
        self.inner.expert_matmul(self.name(name), expert, dtype, device)
    }
    fn expert_dense(&self, name: &str, expert: usize, dtype: DType, device: &Device) -> Result<Tensor> {
        self.inner.expert_dense(self.name(name), expert, dtype, device)
    }
    fn embedding(&self, name: &str, dtype: DType, device: &Device) -> Result<Embedding> {
        self.inner.embedding(self.name(name), dtype, device)
    }
}
