//! What a loaded model is: architecture, sizes, weight types, where it came from.

use std::collections::BTreeMap;
use std::path::Path;

use crate::backend::weights::quantize::QuantizeReport;
use crate::backend::ArtifactFormat;
use crate::core::{BackendProvider, BackendSession};
use crate::model::Runtime;

/// A typed description of a loaded model.
#[derive(Debug, Clone, PartialEq)]
pub struct ModelInfo {
    /// The architecture's name (`llama`, `gemma3`, ...).
    pub architecture: String,
    /// Decoder layers.
    pub num_layers: usize,
    /// Width of the residual stream.
    pub hidden_size: usize,
    /// Width of the MLP's hidden activation.
    pub intermediate_size: usize,
    /// Query heads.
    pub num_heads: usize,
    /// Key/value heads.
    pub num_kv_heads: usize,
    /// Width of a head.
    pub head_dim: usize,
    /// Tokens in the model's vocabulary (rows of the embedding).
    pub vocab_size: usize,
    /// The element type activations run in (`f32`, `f16`, `bf16`).
    pub dtype: String,
    /// The context the model was trained for.
    pub context_length: usize,
    /// The context this session was given.
    pub max_context: usize,
    /// The sliding window of the layers that have one.
    pub sliding_window: Option<usize>,
    /// How the KV cache holds keys and values (`f16`, `q8_0`, `f32`, `bf16`).
    pub kv_cache_type: String,
    /// Whether the output projection is the embedding table.
    pub tie_word_embeddings: bool,
    /// Experts per mixture-of-experts layer (`None` for a dense model).
    pub num_experts: Option<usize>,
    /// Experts each token is routed to (`None` for a dense model).
    pub experts_per_token: Option<usize>,
    /// Width of one expert's hidden activation (`None` for a dense model).
    pub expert_intermediate_size: Option<usize>,
    /// Width of the shared expert every token runs beside the routed ones (Qwen2-MoE, Granite
    /// MoE Shared; `None` where there is none).
    pub shared_expert_intermediate_size: Option<usize>,
    /// Layers that mix experts (0 for a dense model; the others run a dense MLP).
    pub moe_layers: usize,
    /// Parameters by storage type (`q4_k`, `q6_k`, `f32`, ...).
    pub weight_types: BTreeMap<String, usize>,
    /// All parameters.
    pub parameters: usize,
    /// Bytes of the artifact on disk (all files of a directory).
    pub file_size: u64,
    /// `gguf` or `huggingface`.
    pub format: &'static str,
    /// The artifact's path as given.
    pub path: String,
    /// The device the model runs on (`cpu`, `cuda:0`, ...).
    pub device: String,
    /// CPU threads computing (process-wide).
    pub threads: usize,
    /// What quantization at load did (`None` when it was not asked for).
    pub quantized_at_load: Option<QuantizeReport>,
    /// The draft model's path, when speculative decoding has one.
    pub draft_model: Option<String>,
}

impl ModelInfo {
    /// Describes the model `rt` runs, loaded from `path` in `format`.
    pub(crate) fn describe(rt: &Runtime, path: &Path, format: ArtifactFormat, threads: usize) -> Self {
        let session = rt.session();
        let decoder = session.decoder();
        let c = decoder.config();
        let weight_types = decoder.weight_summary();
        let encoder = decoder.encoder().map(|e| e.config());
        Self {
            // An encoder's decoder description only stands in: its family and layers are the encoder's.
            architecture: encoder.map_or(c.architecture.name(), |e| e.family.name()).to_owned(),
            num_layers: encoder.map_or(c.num_layers(), |e| e.num_layers),
            hidden_size: c.hidden_size,
            intermediate_size: c.intermediate_size,
            num_heads: c.num_heads,
            num_kv_heads: c.num_kv_heads,
            head_dim: c.head_dim,
            vocab_size: c.vocab_size,
            dtype: crate::backend::weights::embedding::dtype_name(decoder.dtype()),
            context_length: c.max_position_embeddings,
            max_context: session.max_context(),
            sliding_window: c.layers.iter().find_map(|l| l.sliding_window),
            kv_cache_type: decoder.cache_type().name().to_owned(),
            tie_word_embeddings: c.tie_word_embeddings,
            num_experts: c.moe.as_ref().map(|m| m.num_experts),
            experts_per_token: c.moe.as_ref().map(|m| m.experts_per_token),
            expert_intermediate_size: c.moe.as_ref().map(|m| m.expert_intermediate_size),
            shared_expert_intermediate_size: c.moe.as_ref().and_then(|m| m.shared_expert).map(|s| s.intermediate_size),
            moe_layers: (0..c.num_layers()).filter(|&i| c.is_sparse(i)).count(),
            parameters: weight_types.values().sum(),
            weight_types,
            file_size: size_on_disk(path),
            format: format.name(),
            path: path.display().to_string(),
            device: rt.backend().descriptor().device.to_string(),
            threads,
            quantized_at_load: decoder.quantized_at_load().cloned(),
            draft_model: None,
        }
    }

    /// Each weight type's share of the parameters, largest first.
    pub fn weight_shares(&self) -> Vec<(String, f64)> {
        let total = self.parameters.max(1) as f64;
        let mut v: Vec<_> = self.weight_types.iter().map(|(k, &n)| (k.clone(), n as f64 / total)).collect();
        v.sort_by(|a, b| b.1.total_cmp(&a.1));
        v
    }
}

fn size_on_disk(path: &Path) -> u64 {
    if path.is_dir() {
        std::fs::read_dir(path)
            .map(|entries| {
                entries.flatten().filter_map(|e| e.metadata().ok()).filter(|m| m.is_file()).map(|m| m.len()).sum()
            })
            .unwrap_or(0)
    } else {
        std::fs::metadata(path).map(|m| m.len()).unwrap_or(0)
    }
}
