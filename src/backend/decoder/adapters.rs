//! LoRA adapters on the decoder (DESIGN §16): loading one fits its factors to this model's
//! linears (`blocks::lora::Adapter::prepare`) and keeps it in the registry every session shares.

use std::path::Path;
use std::sync::Arc;

use super::Decoder;
use crate::backend::blocks::attention::QkvProj;
use crate::backend::blocks::linear::Linear;
use crate::backend::blocks::lora::{Adapter, AdapterRegistry, QkRows, Site};
use crate::backend::config::gguf::converter_permutes_qk;
use crate::backend::error::AdapterError;
use crate::backend::weights::adapter::AdapterWeights;
use crate::backend::weights::names::Naming;

impl Decoder {
    /// The adapters loaded on this model.
    pub fn adapters(&self) -> &AdapterRegistry {
        &self.adapters
    }

    /// Where every linear an adapter can reach sits: attention and dense MLP projections and the
    /// output projection (MoE experts and routers have no site).
    pub fn linear_sites(&self) -> Vec<&Site> {
        self.adaptable().into_iter().filter_map(Linear::site).collect()
    }

    /// Where an adapter named as `naming` can reach: every linear's site and, for an adapter in
    /// Hugging Face naming (PEFT, mlx-lm), the token embedding. (llama.cpp's converter writes an
    /// embedding's factors in another orientation; a GGUF LoRA's `token_embd` stays unknown.)
    fn adapter_sites(&self, naming: Naming) -> Vec<&Site> {
        let mut sites = self.linear_sites();
        if naming == Naming::HuggingFace {
            sites.push(&self.embed_site);
        }
        sites
    }

    /// The linears an adapter can reach, in `linear_sites`' order.
    fn adaptable(&self) -> Vec<&Linear> {
        let mut linears: Vec<&Linear> = Vec::new();
        for b in &self.blocks {
            match &b.attn.qkv {
                QkvProj::Separate { q, k, v } => linears.extend([q, k, v]),
                QkvProj::Fused(qkv) => linears.push(qkv),
            }
            linears.push(&b.attn.o);
            linears.extend(b.mlp.linears());
        }
        linears.push(&self.lm_head);
        linears.into_iter().filter(|l| l.site().is_some()).collect()
    }

    /// `adaptable`, to change their weights.
    fn adaptable_mut(&mut self) -> Vec<&mut Linear> {
        let mut linears: Vec<&mut Linear> = Vec::new();
        for b in &mut self.blocks {
            match &mut b.attn.qkv {
                QkvProj::Separate { q, k, v } => linears.extend([q, k, v]),
                QkvProj::Fused(qkv) => linears.push(qkv),
            }
            linears.push(&mut b.attn.o);
            linears.extend(b.mlp.linears_mut());
        }
        linears.push(&mut self.lm_head);
        linears.into_iter().filter(|l| l.site().is_some()).collect()
    }

    /// How an adapter named as `naming` must reorder q's and k's `lora_B` rows to fit this model:
    /// a GGUF LoRA of the Llama family has them in adjacent pairs, as GGUF bases of that family
    /// do (`converter_permutes_qk`); a PEFT adapter and a Hugging Face base have halves.
    fn qk_rows(&self, naming: Naming) -> Option<QkRows> {
        let adapter_pairs = naming == Naming::Gguf && converter_permutes_qk(self.config.architecture);
        let base_pairs = self.config.rope_interleaved;
        (adapter_pairs != base_pairs).then_some(QkRows {
            heads: self.config.num_heads,
            kv_heads: self.config.num_kv_heads,
            to_pairs: base_pairs,
        })
    }

    /// The adapters merged into this model's weights, in merge order (descriptions only).
    pub fn merged_adapters(&self) -> &[Arc<Adapter>] {
        &self.merged
    }

    /// Reads the adapter at `path`, fits it to this model and folds `scale · B A` into the dense
    /// weights it reaches (`merge=True`): the model runs at the base model's speed from then on,
    /// and the adapter cannot be taken out again. Every weight it reaches is checked to be dense
    /// before any changes, so a refusal changes nothing.
    pub fn merge_adapter(&mut self, path: &Path, name: &str, scale: f32) -> Result<Arc<Adapter>, AdapterError> {
        if !scale.is_finite() {
            return Err(AdapterError::BadScale { name: name.to_owned(), scale });
        }
        if self.adapters.get(name).is_ok() || self.merged.iter().any(|a| a.name == name) {
            return Err(AdapterError::Duplicate { name: name.to_owned() });
        }
        let weights = AdapterWeights::read(path)?;
        let naming = weights.naming;
        let arch = self.config.architecture;
        let rows = self.qk_rows(naming);
        let adapter = Adapter::prepare(name, scale, weights, &self.adapter_sites(naming), arch, rows, &self.device)?;
        if adapter.reaches(&self.embed_site) {
            return Err(AdapterError::Unsupported {
                path: adapter.path.clone(),
                what: "merging an embedding LoRA (run it beside the weights without merge)".into(),
            });
        }
        let malformed =
            |e: candle_core::Error| AdapterError::Malformed { path: adapter.path.clone(), reason: e.to_string() };
        let mut deltas = Vec::new();
        for (i, linear) in self.adaptable().into_iter().enumerate() {
            let Some(site) = linear.site().filter(|s| adapter.reaches(s)) else { continue };
            if linear.is_quantized() {
                let part = site.parts[0];
                return Err(AdapterError::MergeQuantized {
                    path: adapter.path.clone(),
                    module: naming.stem(arch, part.slot, part.layer),
                    storage: linear.storage(),
                });
            }
            if let Some(delta) = adapter.delta(site, scale).map_err(malformed)? {
                deltas.push((i, delta));
            }
        }
        let mut linears = self.adaptable_mut();
        for (i, delta) in deltas {
            linears[i].add_to_weight(&delta).map_err(malformed)?;
        }
        // Snapshots and disk prefix blocks of the unmerged model must not be restored onto this one.
        self.fingerprint = format!(
            "{}-m{:08x}",
            self.fingerprint,
            crc32fast::hash(format!("{}|{}|{scale}", adapter.path, adapter.name).as_bytes())
        );
        let merged = Arc::new(adapter.into_description());
        self.merged.push(Arc::clone(&merged));
        Ok(merged)
    }

    /// Reads the adapter at `path`, fits it to this model and loads it as `name` (run with `scale`
    /// where chosen by name alone); nothing is
    /// loaded when it does not fit (another base's shapes, modules this model lacks).
    pub fn load_adapter(&self, path: &Path, name: &str, scale: f32) -> Result<Arc<Adapter>, AdapterError> {
        if !scale.is_finite() {
            return Err(AdapterError::BadScale { name: name.to_owned(), scale });
        }
        if self.adapters.get(name).is_ok() {
            return Err(AdapterError::Duplicate { name: name.to_owned() });
        }
        let weights = AdapterWeights::read(path)?;
        let (rows, naming) = (self.qk_rows(weights.naming), weights.naming);
        let arch = self.config.architecture;
        let adapter = Adapter::prepare(name, scale, weights, &self.adapter_sites(naming), arch, rows, &self.device)?;
        self.adapters.insert(adapter)
    }
}
