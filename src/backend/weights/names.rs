//! Tensor names of each checkpoint format for the decoder's weight slots.

use crate::backend::config::Architecture;

/// A weight of the decoder, independent of how a format names it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Slot {
    /// Token embedding table.
    Embed,
    /// Learned absolute position table (GPT-2).
    PosEmbed,
    /// Norm before attention.
    AttnInNorm,
    /// Query projection.
    Q,
    /// Key projection.
    K,
    /// Value projection.
    V,
    /// Fused query/key/value projection.
    Qkv,
    /// Attention output projection.
    O,
    /// Per-head query norm.
    QNorm,
    /// Per-head key norm.
    KNorm,
    /// Norm of the attention output before the residual add (Gemma 3).
    AttnOutNorm,
    /// Norm before the MLP.
    MlpInNorm,
    /// Norm of the MLP output before the residual add (Gemma 3).
    MlpOutNorm,
    /// MLP gate projection.
    Gate,
    /// MLP up projection.
    Up,
    /// Fused gate/up projection.
    GateUp,
    /// MLP down projection.
    Down,
    /// Final norm.
    FinalNorm,
    /// Output projection (untied).
    LmHead,
}

/// How a checkpoint format names tensors.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Naming {
    /// Hugging Face `model.layers.{i}.self_attn.q_proj.weight` style.
    HuggingFace,
    /// GGUF `blk.{i}.attn_q.weight` style.
    Gguf,
}

impl Naming {
    /// What every tensor name of layer `i` starts with (`model.layers.{i}.` and the like).
    pub fn layer_prefix(self, arch: Architecture) -> &'static str {
        match (self, arch) {
            (Self::Gguf, _) => "blk.",
            (Self::HuggingFace, Architecture::Gpt2) => "transformer.h.",
            (Self::HuggingFace, Architecture::GptNeoX) => "gpt_neox.layers.",
            (Self::HuggingFace, _) => "model.layers.",
        }
    }

    /// The stem of a slot's tensor name (without `.weight` / `.bias`).
    pub fn stem(self, arch: Architecture, slot: Slot, layer: usize) -> String {
        match self {
            Self::HuggingFace if arch == Architecture::Gpt2 => {
                let s = match slot {
                    Slot::Embed => return "transformer.wte".into(),
                    Slot::PosEmbed => return "transformer.wpe".into(),
                    Slot::FinalNorm => return "transformer.ln_f".into(),
                    Slot::LmHead => return "lm_head".into(),
                    Slot::AttnInNorm => "ln_1",
                    Slot::Qkv => "attn.c_attn",
                    Slot::O => "attn.c_proj",
                    Slot::MlpInNorm => "ln_2",
                    Slot::Up => "mlp.c_fc",
                    Slot::Down => "mlp.c_proj",
                    // GPT-2 has no such tensor; a name no checkpoint holds makes the loader say so.
                    other => return format!("transformer.h.{layer}.<no {other:?}>"),
                };
                format!("transformer.h.{layer}.{s}")
            }
            Self::HuggingFace if arch == Architecture::GptNeoX => {
                let s = match slot {
                    Slot::Embed => return "gpt_neox.embed_in".into(),
                    Slot::FinalNorm => return "gpt_neox.final_layer_norm".into(),
                    Slot::LmHead => return "embed_out".into(),
                    Slot::AttnInNorm => "input_layernorm",
                    Slot::Qkv => "attention.query_key_value",
                    Slot::O => "attention.dense",
                    Slot::MlpInNorm => "post_attention_layernorm",
                    Slot::Up => "mlp.dense_h_to_4h",
                    Slot::Down => "mlp.dense_4h_to_h",
                    other => return format!("gpt_neox.layers.{layer}.<no {other:?}>"),
                };
                format!("gpt_neox.layers.{layer}.{s}")
            }
            Self::HuggingFace => {
                let gemma = matches!(arch, Architecture::Gemma2 | Architecture::Gemma3);
                let s = match slot {
                    Slot::Embed => return "model.embed_tokens".into(),
                    Slot::PosEmbed => return "model.embed_positions".into(),
                    Slot::FinalNorm => return "model.norm".into(),
                    Slot::LmHead => return "lm_head".into(),
                    Slot::AttnInNorm => "input_layernorm",
                    Slot::Q => "self_attn.q_proj",
                    Slot::K => "self_attn.k_proj",
                    Slot::V => "self_attn.v_proj",
                    Slot::Qkv => "self_attn.qkv_proj",
                    Slot::O => "self_attn.o_proj",
                    Slot::QNorm => "self_attn.q_norm",
                    Slot::KNorm => "self_attn.k_norm",
                    // Gemma calls its attention-output norm "post_attention"; elsewhere that name is the MLP's input norm.
                    Slot::AttnOutNorm => "post_attention_layernorm",
                    Slot::MlpInNorm if gemma => "pre_feedforward_layernorm",
                    Slot::MlpInNorm => "post_attention_layernorm",
                    Slot::MlpOutNorm => "post_feedforward_layernorm",
                    Slot::Gate => "mlp.gate_proj",
                    Slot::Up => "mlp.up_proj",
                    Slot::GateUp => "mlp.gate_up_proj",
                    Slot::Down => "mlp.down_proj",
                };
                format!("model.layers.{layer}.{s}")
            }
            Self::Gguf => {
                let s = match slot {
                    Slot::Embed => return "token_embd".into(),
                    Slot::PosEmbed => return "position_embd".into(),
                    Slot::FinalNorm => return "output_norm".into(),
                    Slot::LmHead => return "output".into(),
                    Slot::AttnInNorm => "attn_norm",
                    Slot::Q => "attn_q",
                    Slot::K => "attn_k",
                    Slot::V => "attn_v",
                    Slot::Qkv => "attn_qkv",
                    Slot::O => "attn_output",
                    Slot::QNorm => "attn_q_norm",
                    Slot::KNorm => "attn_k_norm",
                    Slot::AttnOutNorm => "post_attention_norm",
                    // gpt-oss's converter maps `post_attention_layernorm`, its MLP's input norm, to
                    // the name other architectures give the attention-output norm.
                    Slot::MlpInNorm if arch == Architecture::GptOss => "post_attention_norm",
                    Slot::MlpInNorm => "ffn_norm",
                    Slot::MlpOutNorm => "post_ffw_norm",
                    Slot::Gate => "ffn_gate",
                    Slot::Up => "ffn_up",
                    // llama.cpp stores Phi-3's fused gate/up as ffn_up with twice the rows.
                    Slot::GateUp => "ffn_up",
                    Slot::Down => "ffn_down",
                };
                format!("blk.{layer}.{s}")
            }
        }
    }
}

/// A weight of the vision encoder or its projector, independent of how a format names it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum VisionSlot {
    /// The patch embedding (a convolution with stride = kernel = patch size).
    PatchEmbed,
    /// The learned position table.
    PosEmbed,
    /// CLIP's class embedding (`[hidden]`).
    ClassEmbed,
    /// CLIP's LayerNorm before the layers.
    PreNorm,
    /// The LayerNorm after the last layer.
    PostNorm,
    /// A layer's norm before attention.
    AttnNorm,
    /// A layer's query projection.
    Q,
    /// A layer's key projection.
    K,
    /// A layer's value projection.
    V,
    /// A layer's attention output projection.
    O,
    /// A layer's norm before the MLP.
    MlpNorm,
    /// A layer's MLP up projection (`fc1`).
    Up,
    /// A layer's MLP down projection (`fc2`).
    Down,
    /// Gemma 3's projector matrix (`[vision hidden, text hidden]` in both formats' logical order).
    ProjInput,
    /// Gemma 3's soft-embedding RMS norm.
    ProjNorm,
    /// LLaVA's first projector layer.
    ProjFirst,
    /// LLaVA's second projector layer.
    ProjSecond,
    /// Idefics3's projection after the pixel shuffle (`modality_projection.proj`, no bias).
    ProjShuffle,
}

impl Naming {
    /// The stem of a vision slot's tensor name (without `.weight` / `.bias`): Hugging Face
    /// `vision_tower.vision_model.…` / `multi_modal_projector.…` / `connector.…` (after `weights::prefixed`'s
    /// renaming), or llama.cpp's mmproj `v.…` / `mm.…`.
    pub fn vision_stem(self, slot: VisionSlot, layer: usize) -> String {
        use VisionSlot as V;
        match self {
            Self::HuggingFace => {
                let s = match slot {
                    V::PatchEmbed => "embeddings.patch_embedding",
                    V::PosEmbed => "embeddings.position_embedding",
                    V::ClassEmbed => "embeddings.class_embedding",
                    // CLIP's own spelling.
                    V::PreNorm => "pre_layrnorm",
                    V::PostNorm => "post_layernorm",
                    V::ProjInput => return "multi_modal_projector.mm_input_projection_weight".into(),
                    V::ProjNorm => return "multi_modal_projector.mm_soft_emb_norm".into(),
                    V::ProjFirst => return "multi_modal_projector.linear_1".into(),
                    V::ProjSecond => return "multi_modal_projector.linear_2".into(),
                    V::ProjShuffle => return "connector.modality_projection.proj".into(),
                    layer_slot => {
                        let s = match layer_slot {
                            V::AttnNorm => "layer_norm1",
                            V::Q => "self_attn.q_proj",
                            V::K => "self_attn.k_proj",
                            V::V => "self_attn.v_proj",
                            V::O => "self_attn.out_proj",
                            V::MlpNorm => "layer_norm2",
                            V::Up => "mlp.fc1",
                            _ => "mlp.fc2",
                        };
                        return format!("vision_tower.vision_model.encoder.layers.{layer}.{s}");
                    }
                };
                format!("vision_tower.vision_model.{s}")
            }
            Self::Gguf => {
                let s = match slot {
                    V::PatchEmbed => "v.patch_embd",
                    V::PosEmbed => "v.position_embd",
                    V::ClassEmbed => "v.class_embd",
                    V::PreNorm => "v.pre_ln",
                    V::PostNorm => "v.post_ln",
                    V::ProjInput => "mm.input_projection",
                    V::ProjNorm => "mm.soft_emb_norm",
                    V::ProjFirst => "mm.0",
                    V::ProjSecond => "mm.2",
                    V::ProjShuffle => "mm.model.fc",
                    layer_slot => {
                        let s = match layer_slot {
                            V::AttnNorm => "ln1",
                            V::Q => "attn_q",
                            V::K => "attn_k",
                            V::V => "attn_v",
                            V::O => "attn_out",
                            V::MlpNorm => "ln2",
                            V::Up => "ffn_up",
                            _ => "ffn_down",
                        };
                        return format!("v.blk.{layer}.{s}");
                    }
                };
                s.into()
            }
        }
    }
}
