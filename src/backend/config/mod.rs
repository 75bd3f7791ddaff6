//! The architecture description the one decoder is parameterised by.

pub mod encoder;
pub mod gguf;
pub mod hf;
pub mod metadata;
pub mod vision;

use crate::backend::error::{CandleError, Result};

/// The most decoder layers a model may declare (the largest published models have under 200);
/// checked before the per-layer table is built, so a file claiming 10^12 cannot exhaust memory.
pub const MAX_LAYERS: usize = 4096;
/// The widest residual stream, MLP or head a model may declare (about 16 million).
pub const MAX_WIDTH: usize = 1 << 24;
/// The most attention heads a model may declare.
pub const MAX_HEADS: usize = 1 << 16;
/// The largest soft cap accepted: the cap runs in float32, where a larger one (1e308 becomes
/// infinity) turns every capped score into NaN.
pub const MAX_SOFTCAP: f64 = 1e6;

/// The architecture families the decoder implements.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Architecture {
    /// Llama 2 / 3 / 3.x (and SmolLM, TinyLlama).
    Llama,
    /// Mistral: Llama with an optional sliding window.
    Mistral,
    /// Qwen2: biases on q, k, v.
    Qwen2,
    /// Qwen3: RMS norm on q and k per head.
    Qwen3,
    /// Gemma 3 text: scaled embeddings, (1+w) norms, sandwich norms, sliding and global layers.
    Gemma3,
    /// Phi-3: fused qkv and gate_up projections.
    Phi3,
    /// Gemma 2: Gemma 3's layout without q/k norms, with soft-capped scores and logits.
    Gemma2,
    /// OLMo 2: norms after each branch only, q/k RMS-normalised over the whole projection.
    Olmo2,
    /// SmolLM3: Llama with some layers left without RoPE (`no_rope_layers`).
    SmolLm3,
    /// Granite: Llama with embedding, residual, attention and logit multipliers.
    Granite,
    /// GPT-NeoX (Pythia): LayerNorm, fused per-head qkv, partial RoPE, usually a parallel residual.
    GptNeoX,
    /// GPT-2: learned absolute positions, LayerNorm, fused qkv, ungated MLP.
    Gpt2,
    /// Qwen3-MoE: Qwen3's attention, mixtures of experts (softmax, top-k, optional renormalisation).
    Qwen3Moe,
    /// Mixtral: Mistral's attention, mixtures of experts renormalised over the top-k.
    Mixtral,
    /// OLMoE: q/k RMS-normalised over the whole projection, mixtures of experts.
    Olmoe,
    /// Granite MoE: Granite's multipliers, experts mixed by a softmax over the top-k logits.
    GraniteMoe,
    /// gpt-oss: attention sinks and biases, alternating sliding windows, YaRN, clamped SwiGLU experts.
    GptOss,
    /// Qwen2-MoE (Qwen1.5-MoE, Qwen2-57B-A14B): Qwen2's attention, mixtures of experts beside an
    /// always-on shared expert scaled by a sigmoid gate.
    Qwen2Moe,
}

impl Architecture {
    /// The lower-case name used in `model_info`.
    pub fn name(self) -> &'static str {
        match self {
            Self::Llama => "llama",
            Self::Mistral => "mistral",
            Self::Qwen2 => "qwen2",
            Self::Qwen3 => "qwen3",
            Self::Gemma3 => "gemma3",
            Self::Phi3 => "phi3",
            Self::Gemma2 => "gemma2",
            Self::Olmo2 => "olmo2",
            Self::SmolLm3 => "smollm3",
            Self::Granite => "granite",
            Self::GptNeoX => "gpt_neox",
            Self::Gpt2 => "gpt2",
            Self::Qwen3Moe => "qwen3_moe",
            Self::Mixtral => "mixtral",
            Self::Olmoe => "olmoe",
            Self::GraniteMoe => "granitemoe",
            Self::GptOss => "gpt_oss",
            Self::Qwen2Moe => "qwen2_moe",
        }
    }

    /// The `general.architecture` llama.cpp's converter writes for it, where candlewick reads
    /// that architecture's GGUF files (`None` where it does not yet). The converter writes Mistral
    /// checkpoints as `llama`; `mistral` is what other writers use.
    pub fn gguf_name(self) -> Option<&'static str> {
        match self {
            Self::Llama => Some("llama"),
            Self::Mistral => Some("mistral"),
            Self::Qwen2 => Some("qwen2"),
            Self::Qwen3 => Some("qwen3"),
            Self::Gemma3 => Some("gemma3"),
            Self::Phi3 => Some("phi3"),
            Self::Gemma2 => Some("gemma2"),
            Self::Olmo2 => Some("olmo2"),
            Self::SmolLm3 => Some("smollm3"),
            Self::Granite => Some("granite"),
            Self::GptNeoX => Some("gptneox"),
            Self::Gpt2 => Some("gpt2"),
            Self::Qwen3Moe => Some("qwen3moe"),
            // llama.cpp's converter writes Mixtral as `llama` with `llama.expert_count`.
            Self::Mixtral => Some("llama"),
            Self::Olmoe => Some("olmoe"),
            Self::GraniteMoe => Some("granitemoe"),
            Self::GptOss => Some("gpt-oss"),
            Self::Qwen2Moe => Some("qwen2moe"),
        }
    }

    /// The error for an artifact naming `name`, an architecture no decoder here implements,
    /// with the names that do load from its format (`gguf`: `general.architecture`; else
    /// config.json's `model_type`).
    pub fn unsupported(name: &str, gguf: bool) -> CandleError {
        let mut names: Vec<&str> = Vec::new();
        for n in Self::ALL.into_iter().filter_map(|a| if gguf { a.gguf_name() } else { Some(a.name()) }) {
            // Mixtral's GGUF files are `llama`'s.
            if !names.contains(&n) {
                names.push(n);
            }
        }
        CandleError::UnsupportedArchitecture {
            name: name.to_owned(),
            format: if gguf { "GGUF" } else { "config.json" },
            supported: names.join(", "),
        }
    }

    /// Every architecture the decoder loads, in the order they were added.
    pub const ALL: [Architecture; 18] = [
        Self::Llama,
        Self::Mistral,
        Self::Qwen2,
        Self::Qwen3,
        Self::Gemma3,
        Self::Phi3,
        Self::Gemma2,
        Self::Olmo2,
        Self::SmolLm3,
        Self::Granite,
        Self::GptNeoX,
        Self::Gpt2,
        Self::Qwen3Moe,
        Self::Mixtral,
        Self::Olmoe,
        Self::GraniteMoe,
        Self::GptOss,
        Self::Qwen2Moe,
    ];
}

/// Which norms surround a block's attention and MLP branches.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BlockNorms {
    /// A norm before each branch (Llama and most others).
    Pre,
    /// A norm before and after each branch (Gemma 2 and 3).
    Sandwich,
    /// A norm after each branch only, on its output (OLMo 2).
    Post,
}

impl BlockNorms {
    /// Whether each branch's input is normalised.
    pub fn pre(self) -> bool {
        matches!(self, Self::Pre | Self::Sandwich)
    }

    /// Whether each branch's output is normalised before it joins the residual.
    pub fn post(self) -> bool {
        matches!(self, Self::Sandwich | Self::Post)
    }
}

/// The normalisation every norm of the model computes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum NormKind {
    /// Root-mean-square norm with a scale.
    Rms,
    /// LayerNorm: mean removed, then a scale and a bias (GPT-2, GPT-NeoX).
    Layer,
}

/// Where q and k are RMS-normalised before RoPE.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum QkNorm {
    /// Not at all.
    None,
    /// Each head on its own, one `[head_dim]` scale shared by the heads (Qwen3, Gemma 3).
    PerHead,
    /// The whole projection at once, one `[heads · head_dim]` scale (OLMo 2).
    Whole,
}

/// The MLP's gate activation.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Activation {
    /// SiLU (swish).
    Silu,
    /// GELU with the tanh approximation (`gelu_pytorch_tanh`).
    GeluTanh,
    /// GELU with erf.
    Gelu,
    /// max(x, 0).
    Relu,
}

/// How rotary frequencies are rescaled for long contexts.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum RopeScaling {
    /// Plain RoPE.
    None,
    /// Positions divided by `factor`.
    Linear {
        /// The divisor.
        factor: f64,
    },
    /// Llama 3.1's frequency-dependent scaling.
    Llama3 {
        /// Scale for low frequencies.
        factor: f64,
        /// Wavelength bound below which frequencies are scaled.
        low_freq_factor: f64,
        /// Wavelength bound above which frequencies are kept.
        high_freq_factor: f64,
        /// The context length the model was trained at.
        original_max_position_embeddings: f64,
    },
    /// YaRN (gpt-oss): frequencies blended between interpolated and original along a ramp over
    /// the dimensions, cos and sin multiplied by an attention factor.
    Yarn {
        /// Interpolation factor.
        factor: f64,
        /// The context the ramp's bounds are computed for.
        original_max_position_embeddings: f64,
        /// Rotations above which a dimension keeps its frequency.
        beta_fast: f64,
        /// Rotations below which a dimension is fully interpolated.
        beta_slow: f64,
        /// Whether the ramp's bounds are rounded to whole dimensions.
        truncate: bool,
        /// Multiplier of cos and sin (so q·k scales by its square).
        attention_factor: f64,
    },
}

/// One rotary embedding: base and scaling.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct RopeConfig {
    /// The base (`rope_theta`).
    pub theta: f64,
    /// Long-context scaling.
    pub scaling: RopeScaling,
}

impl RopeConfig {
    /// Checks that the base and scaling give finite, positive frequencies; on failure, the
    /// generic field name and the reason.
    pub fn validate(&self) -> std::result::Result<(), (&'static str, String)> {
        let positive = |name: &'static str, v: f64| {
            if v.is_finite() && v > 0.0 {
                Ok(())
            } else {
                Err((name, format!("{v} is not a finite positive number")))
            }
        };
        positive("rope_theta", self.theta)?;
        match self.scaling {
            RopeScaling::None => Ok(()),
            RopeScaling::Linear { factor } => positive("rope_scaling.factor", factor),
            RopeScaling::Llama3 { factor, low_freq_factor, high_freq_factor, original_max_position_embeddings } => {
                positive("rope_scaling.factor", factor)?;
                positive("rope_scaling.low_freq_factor", low_freq_factor)?;
                positive("rope_scaling.high_freq_factor", high_freq_factor)?;
                positive("rope_scaling.original_max_position_embeddings", original_max_position_embeddings)?;
                // The smoothing between the two bounds divides by their difference.
                if high_freq_factor <= low_freq_factor {
                    return Err((
                        "rope_scaling.high_freq_factor",
                        format!("{high_freq_factor} must exceed low_freq_factor {low_freq_factor}"),
                    ));
                }
                Ok(())
            }
            RopeScaling::Yarn {
                factor,
                original_max_position_embeddings,
                beta_fast,
                beta_slow,
                truncate: _,
                attention_factor,
            } => {
                positive("rope_scaling.factor", factor)?;
                positive("rope_scaling.original_max_position_embeddings", original_max_position_embeddings)?;
                positive("rope_scaling.beta_fast", beta_fast)?;
                positive("rope_scaling.beta_slow", beta_slow)?;
                positive("rope_scaling.attention_factor", attention_factor)
            }
        }
    }
}

/// How a router turns its logits into the weights of the experts it selects.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Routing {
    /// Softmax over all experts, then the top k; renormalised to sum to 1 when `renormalize`
    /// (Qwen3-MoE and OLMoE with `norm_topk_prob`; Mixtral always).
    SoftmaxTopK {
        /// Whether the k selected probabilities are divided by their sum.
        renormalize: bool,
    },
    /// The top k logits, then a softmax over those k (gpt-oss, Granite MoE).
    TopKSoftmax,
}

/// What an expert computes between its up and down projections.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum ExpertGlu {
    /// `act(gate) · up`, with the model's activation.
    Gated,
    /// gpt-oss: `gate` clamped above at `limit`, `up` to ±`limit`, then `(up + 1) · gate · σ(alpha · gate)`.
    ClampedSwiGlu {
        /// The sigmoid's slope.
        alpha: f64,
        /// The clamp.
        limit: f64,
    },
}

/// The mixture of experts that replaces the MLP of some layers.
#[derive(Debug, Clone, PartialEq)]
pub struct MoeConfig {
    /// Experts per MoE layer.
    pub num_experts: usize,
    /// Experts each token is routed to.
    pub experts_per_token: usize,
    /// Width of one expert's hidden activation.
    pub expert_intermediate_size: usize,
    /// How router logits become mixing weights.
    pub routing: Routing,
    /// Whether the router carries a bias (gpt-oss).
    pub router_bias: bool,
    /// Whether the experts' projections carry biases (gpt-oss).
    pub expert_bias: bool,
    /// The experts' activation.
    pub glu: ExpertGlu,
    /// Which layers are mixtures (the others keep a dense MLP of `intermediate_size`);
    /// its length is the layer count.
    pub sparse_layers: Vec<bool>,
    /// The expert every token runs beside the routed ones, where the architecture has one.
    pub shared_expert: Option<SharedExpert>,
}

/// An always-on expert added to a mixture's output (Qwen2-MoE, Granite MoE Shared): a gated
/// MLP with the experts' activation, over every token, outside the routing.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SharedExpert {
    /// Width of its hidden activation.
    pub intermediate_size: usize,
    /// Whether its output is scaled per token by `σ(g·x)`, a learned `[hidden]` gate (Qwen2-MoE).
    pub gated: bool,
}

/// What differs between layers: attention span and rotary embedding.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct LayerConfig {
    /// Keys further back than this many positions (counting the query's own) are masked.
    pub sliding_window: Option<usize>,
    /// The layer's rotary embedding; `None` for a layer that rotates nothing (SmolLM3's
    /// `no_rope_layers`, and every layer of a model with learned positions).
    pub rope: Option<RopeConfig>,
}

/// Everything the generic decoder needs to know about a model.
#[derive(Debug, Clone, PartialEq)]
pub struct ArchConfig {
    /// The family.
    pub architecture: Architecture,
    /// Vocabulary size (rows of the embedding).
    pub vocab_size: usize,
    /// Residual width.
    pub hidden_size: usize,
    /// MLP width.
    pub intermediate_size: usize,
    /// Query heads.
    pub num_heads: usize,
    /// Key/value heads (grouped-query attention when fewer than `num_heads`).
    pub num_kv_heads: usize,
    /// Width of one head.
    pub head_dim: usize,
    /// Per-layer attention span and RoPE; its length is the layer count.
    pub layers: Vec<LayerConfig>,
    /// Epsilon of every norm, RMS or LayerNorm (`layer_norm_eps` where the model has those).
    pub rms_norm_eps: f64,
    /// What every norm computes.
    pub norm_kind: NormKind,
    /// Which norms surround each branch.
    pub block_norms: BlockNorms,
    /// Whether attention and MLP both read the layer's input and add to it together (GPT-NeoX,
    /// `use_parallel_residual`) rather than the MLP reading the stream after attention's add.
    pub parallel_residual: bool,
    /// Whether a learned table of absolute positions is added after the embedding (GPT-2).
    pub learned_positions: bool,
    /// The longest context the model was trained for.
    pub max_position_embeddings: usize,
    /// Whether the output projection is the embedding matrix.
    pub tie_word_embeddings: bool,
    /// Fraction of each head's dimensions that are rotated.
    pub partial_rotary_factor: f64,
    /// Whether RoPE rotates adjacent pairs (GGUF `llama` files, whose q/k rows are permuted) rather than halves.
    pub rope_interleaved: bool,
    /// Whether q, k, v projections carry biases.
    pub qkv_bias: bool,
    /// Whether the output projection of attention carries a bias.
    pub o_bias: bool,
    /// Whether the MLP projections carry biases.
    pub mlp_bias: bool,
    /// Whether the MLP is gated (`down(act(gate) · up)`) rather than `down(act(up))` (GPT-2, GPT-NeoX).
    pub mlp_gated: bool,
    /// Where q and k are RMS-normalised before RoPE.
    pub qk_norm: QkNorm,
    /// Whether norms scale by (1 + w) rather than w (Gemma).
    pub norm_weight_offset: bool,
    /// Multiplier of the embeddings, inside `model.embed_tokens` (Gemma: sqrt(hidden_size)).
    pub embed_scale: Option<f64>,
    /// Multiplier of the embeddings after `model.embed_tokens` (Granite's `embedding_multiplier`,
    /// which transformers applies outside the embedding module).
    pub embed_multiplier: Option<f64>,
    /// Multiplier of each branch's output as it joins the residual, after its observation point
    /// (Granite's `residual_multiplier`).
    pub residual_multiplier: Option<f64>,
    /// Divisor of the logits before any soft cap (Granite's `logits_scaling`).
    pub logits_divisor: Option<f64>,
    /// The MLP's activation (of the gate where the MLP is gated).
    pub activation: Activation,
    /// Multiplier of q·k.
    pub attn_scale: f64,
    /// Whether layer i's q·k is further divided by i + 1 (GPT-2's `scale_attn_by_inverse_layer_idx`).
    pub attn_scale_by_layer: bool,
    /// Soft cap of attention scores.
    pub attn_softcap: Option<f64>,
    /// Soft cap of the final logits.
    pub final_softcap: Option<f64>,
    /// Token ids that end generation, from the config.
    pub eos_token_ids: Vec<u32>,
    /// The beginning-of-sequence token id, from the config.
    pub bos_token_id: Option<u32>,
    /// The mixture of experts of the sparse layers, where the model has one.
    pub moe: Option<MoeConfig>,
    /// Whether each head has a learned sink logit that joins its softmax and takes probability
    /// from the keys (gpt-oss).
    pub attn_sinks: bool,
    /// Whether every position attends every other (within a sliding layer's window, both ways):
    /// embedding models such as EmbeddingGemma (`use_bidirectional_attention`).
    pub bidirectional: bool,
    /// The embedding pooling a GGUF declares (`{arch}.pooling_type`); a directory's is in its
    /// sentence-transformers files.
    pub embedding_pooling: Option<encoder::EncoderPooling>,
}

/// Refuses a layer count outside `1..=MAX_LAYERS` before anything per layer is allocated.
pub(crate) fn check_layer_count(n_layers: usize, source: &str, key: &str) -> Result<()> {
    if n_layers == 0 || n_layers > MAX_LAYERS {
        return Err(invalid(source, key, format!("{n_layers} layers is outside 1..={MAX_LAYERS}")));
    }
    Ok(())
}

/// An invalid value in a model's configuration: an artifact error naming the file and the field.
pub(crate) fn invalid(source: &str, field: &str, reason: impl std::fmt::Display) -> CandleError {
    CandleError::Malformed {
        what: "model configuration",
        path: source.to_owned(),
        reason: format!("`{field}`: {reason}"),
    }
}

impl ArchConfig {
    /// Checks every hyperparameter against what the decoder can compute with, so that a bad
    /// value is a load error naming its field instead of a panic or NaN logits later.
    ///
    /// `source` names the file; `field` maps a generic name (`rope_theta`) to the file's key.
    pub fn validate(&self, source: &str, field: &dyn Fn(&str) -> String) -> Result<()> {
        let bad = |name: &str, reason: String| Err(invalid(source, &field(name), reason));
        let sizes = [
            ("hidden_size", self.hidden_size, MAX_WIDTH),
            ("intermediate_size", self.intermediate_size, MAX_WIDTH),
            ("head_dim", self.head_dim, MAX_WIDTH),
            ("num_attention_heads", self.num_heads, MAX_HEADS),
            ("num_key_value_heads", self.num_kv_heads, MAX_HEADS),
            ("vocab_size", self.vocab_size, u32::MAX as usize),
            ("num_hidden_layers", self.layers.len(), MAX_LAYERS),
        ];
        for (name, value, max) in sizes {
            if value == 0 || value > max {
                return bad(name, format!("{value} is outside 1..={max}"));
            }
        }
        if !self.num_heads.is_multiple_of(self.num_kv_heads) {
            return bad(
                "num_key_value_heads",
                format!("{} query heads cannot be grouped over {} key/value heads", self.num_heads, self.num_kv_heads),
            );
        }
        if self.max_position_embeddings == 0 {
            return bad("max_position_embeddings", "must be positive".into());
        }
        let f = self.partial_rotary_factor;
        if !(f.is_finite() && f > 0.0 && f <= 1.0) {
            return bad("partial_rotary_factor", format!("{f} is outside (0, 1]"));
        }
        // RoPE rotates pairs: fewer than two rotated dimensions leaves nothing to rotate, and
        // the decoder's kernels would be handed empty tables.
        let rotary = self.rotary_dim();
        if rotary < 2 && self.layers.iter().any(|l| l.rope.is_some()) {
            return bad(
                "partial_rotary_factor",
                format!("rotates {rotary} of {} head dimensions; at least 2 are needed", self.head_dim),
            );
        }
        if !(self.rms_norm_eps.is_finite() && self.rms_norm_eps >= 0.0) {
            return bad("rms_norm_eps", format!("{} is not a finite number ≥ 0", self.rms_norm_eps));
        }
        if !(self.attn_scale.is_finite() && self.attn_scale > 0.0) {
            return bad("query_pre_attn_scalar", format!("gives an attention scale of {}", self.attn_scale));
        }
        if let Some(s) = self.embed_scale {
            if !(s.is_finite() && s > 0.0) {
                return bad("hidden_size", format!("gives an embedding scale of {s}"));
            }
        }
        for (name, m) in [
            ("embedding_multiplier", self.embed_multiplier),
            ("residual_multiplier", self.residual_multiplier),
            ("logits_scaling", self.logits_divisor),
        ] {
            if let Some(m) = m {
                if !(m.is_finite() && m > 0.0) {
                    return bad(name, format!("{m} is not a finite positive number"));
                }
            }
        }
        for (name, cap) in
            [("attn_logit_softcapping", self.attn_softcap), ("final_logit_softcapping", self.final_softcap)]
        {
            if let Some(c) = cap {
                if !(c.is_finite() && c > 0.0 && c <= MAX_SOFTCAP) {
                    return bad(name, format!("{c} is outside (0, {MAX_SOFTCAP}]"));
                }
            }
        }
        for (i, layer) in self.layers.iter().enumerate() {
            if layer.sliding_window == Some(0) {
                return bad("sliding_window", format!("layer {i} has a window of 0 positions"));
            }
            if let Some(rope) = &layer.rope {
                rope.validate()
                    .map_err(|(name, reason)| invalid(source, &field(name), format!("layer {i}: {reason}")))?;
            }
        }
        if let Some(m) = &self.moe {
            if m.num_experts == 0 || m.num_experts > MAX_HEADS {
                return bad("num_experts", format!("{} is outside 1..={MAX_HEADS}", m.num_experts));
            }
            if m.experts_per_token == 0 || m.experts_per_token > m.num_experts {
                return bad(
                    "num_experts_per_tok",
                    format!("{} is outside 1..={} (the experts per layer)", m.experts_per_token, m.num_experts),
                );
            }
            if m.expert_intermediate_size == 0 || m.expert_intermediate_size > MAX_WIDTH {
                return bad(
                    "moe_intermediate_size",
                    format!("{} is outside 1..={MAX_WIDTH}", m.expert_intermediate_size),
                );
            }
            if let Some(shared) = m.shared_expert {
                if shared.intermediate_size == 0 || shared.intermediate_size > MAX_WIDTH {
                    return bad(
                        "shared_expert_intermediate_size",
                        format!("{} is outside 1..={MAX_WIDTH}", shared.intermediate_size),
                    );
                }
            }
            if m.sparse_layers.len() != self.layers.len() {
                return bad(
                    "mlp_only_layers",
                    format!("{} layer flags for {} layers", m.sparse_layers.len(), self.layers.len()),
                );
            }
            if let ExpertGlu::ClampedSwiGlu { alpha, limit } = m.glu {
                if !(alpha.is_finite() && limit.is_finite() && limit > 0.0) {
                    return bad("swiglu_limit", format!("alpha {alpha} and limit {limit} must be finite, limit > 0"));
                }
            }
        }
        // eos/bos ids past the vocabulary are the tokenizer's to report (it does, when used): the
        // model still runs on ids, and such an id is never generated, so it cannot stop anything.
        Ok(())
    }

    /// Number of decoder layers.
    pub fn num_layers(&self) -> usize {
        self.layers.len()
    }

    /// Whether layer `i` mixes experts rather than running the dense MLP.
    pub fn is_sparse(&self, i: usize) -> bool {
        self.moe.as_ref().is_some_and(|m| m.sparse_layers.get(i).copied().unwrap_or(false))
    }

    /// Number of rotated dimensions per head (even).
    pub fn rotary_dim(&self) -> usize {
        let d = (self.head_dim as f64 * self.partial_rotary_factor) as usize;
        d - d % 2
    }
}
