//! LoRA adapters on the decoder (DESIGN §16): loading one fits its factors to this model's
//! linears (`blocks::lora::Adapter::prepare`) and keeps it in the registry every session shares.

use std::path::Path;
use std::sync::Arc;

use super::Decoder;
use crate::backend::blocks::attention::QkvProj;
use crate::backend::blocks::linear::Linear;
use crate::backend::blocks::lora::{Adapter, AdapterRegistry, Site};
use crate::backend::error::AdapterError;
use crate::backend::weights::adapter::AdapterWeights;

impl Decoder {
    /// The adapters loaded on this model.
    pub fn adapters(&self) -> &AdapterRegistry {
        &self.adapters
    }

    /// Where every linear an adapter can reach sits: attention and dense MLP projections and the
    /// output projection (MoE experts and routers have no site).
    pub fn linear_sites(&self) -> Vec<&Site> {
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
        linears.into_iter().filter_map(Linear::site).collect()
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
        let adapter =
            Adapter::prepare(name, scale, weights, &self.linear_sites(), self.config.architecture, &self.device)?;
        self.adapters.insert(adapter)
    }
}
