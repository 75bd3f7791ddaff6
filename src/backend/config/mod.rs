//! The architecture description the one decoder is parameterised by.

pub mod gguf;
pub mod hf;

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
        }
    }
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
}

/// One rotary embedding: base and scaling.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct RopeConfig {
    /// The base (`rope_theta`).
    pub theta: f64,
    /// Long-context scaling.
    pub scaling: RopeScaling,
}

/// What differs between layers: attention span and rotary embedding.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct LayerConfig {
    /// Keys further back than this many positions (counting the query's own) are masked.
    pub sliding_window: Option<usize>,
    /// The layer's rotary embedding.
    pub rope: RopeConfig,
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
    /// Epsilon of every RMS norm.
    pub rms_norm_eps: f64,
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
    /// Whether q and k are RMS-normalised per head before RoPE.
    pub qk_norm: bool,
    /// Whether norms scale by (1 + w) rather than w (Gemma).
    pub norm_weight_offset: bool,
    /// Whether attention and MLP outputs are normalised before joining the residual (Gemma 3).
    pub sandwich_norms: bool,
    /// Multiplier of the embeddings (Gemma: sqrt(hidden_size)).
    pub embed_scale: Option<f64>,
    /// The MLP's gate activation.
    pub activation: Activation,
    /// Multiplier of q·k.
    pub attn_scale: f64,
    /// Soft cap of attention scores.
    pub attn_softcap: Option<f64>,
    /// Soft cap of the final logits.
    pub final_softcap: Option<f64>,
    /// Token ids that end generation, from the config.
    pub eos_token_ids: Vec<u32>,
    /// The beginning-of-sequence token id, from the config.
    pub bos_token_id: Option<u32>,
}

impl ArchConfig {
    /// Number of decoder layers.
    pub fn num_layers(&self) -> usize {
        self.layers.len()
    }

    /// Number of rotated dimensions per head (even).
    pub fn rotary_dim(&self) -> usize {
        let d = (self.head_dim as f64 * self.partial_rotary_factor) as usize;
        d - d % 2
    }
}
