//! GGUF metadata (llama.cpp's keys) to an `ArchConfig`.

use super::{
    check_layer_count, Activation, ArchConfig, Architecture, BlockNorms, ExpertGlu, LayerConfig, MoeConfig, NormKind,
    QkNorm, RopeConfig, RopeScaling, Routing,
};
use crate::backend::error::{CandleError, Result};
use crate::backend::weights::gguf::Metadata;

/// Reads the architecture; `has_tensor` tells which optional tensors the file carries,
/// `n_tokens` how many tokens its vocabulary holds (if it has one), `path` names the file in errors.
pub fn parse_config(
    md: &Metadata<'_>,
    has_tensor: &dyn Fn(&str) -> bool,
    vocab_size: usize,
    n_tokens: Option<usize>,
    path: &str,
) -> Result<ArchConfig> {
    let name = md.string("general.architecture")?;
    let arch = Architecture::ALL
        .into_iter()
        .find(|a| a.gguf_name() == Some(name.as_str()))
        .ok_or_else(|| CandleError::UnsupportedArchitecture { name: name.clone() })?;
    let key = |k: &str| format!("{name}.{k}");
    // As llama.cpp requires: an embedding row without a token would be generated and then
    // decode to nothing, silently dropping text.
    if let Some(n_tokens) = n_tokens {
        if n_tokens != vocab_size {
            return Err(super::invalid(
                path,
                "token_embd.weight",
                format!("has {vocab_size} rows but the vocabulary (`tokenizer.ggml.tokens`) has {n_tokens} tokens"),
            ));
        }
    }
    let hidden = md.usize(&key("embedding_length"))?;
    let n_layers = md.usize(&key("block_count"))?;
    // Before the per-layer table below is built: a count of 10^12 must not reach an allocation.
    check_layer_count(n_layers, path, &key("block_count"))?;
    let heads = md.usize(&key("attention.head_count"))?;
    let kv_heads = md.opt_usize(&key("attention.head_count_kv"))?.unwrap_or(heads);
    if heads == 0 || kv_heads == 0 || heads % kv_heads != 0 || hidden == 0 || n_layers == 0 {
        return Err(CandleError::UnsupportedConfig {
            what: format!("{heads} heads over {kv_heads} key/value heads, hidden {hidden}, {n_layers} layers"),
        });
    }
    let head_dim = md.opt_usize(&key("attention.key_length"))?.unwrap_or(hidden / heads);
    if head_dim == 0 {
        return Err(super::invalid(path, &key("attention.key_length"), "a head width of 0"));
    }
    let rotary = md.opt_usize(&key("rope.dimension_count"))?.unwrap_or(head_dim);
    let theta = md.opt_f64(&key("rope.freq_base"))?.unwrap_or(10_000.0);
    // A present key of the wrong type is an error, not "no scaling".
    let scaling_type =
        if md.has(&key("rope.scaling.type")) { Some(md.string(&key("rope.scaling.type"))?) } else { None };
    let scaling = match scaling_type.as_deref() {
        None | Some("none") => RopeScaling::None,
        Some("linear") => RopeScaling::Linear { factor: md.opt_f64(&key("rope.scaling.factor"))?.unwrap_or(1.0) },
        Some(other) => return Err(CandleError::UnsupportedConfig { what: format!("GGUF rope scaling `{other}`") }),
    };
    if has_tensor("rope_factors_long.weight") {
        return Err(CandleError::UnsupportedConfig { what: "LongRoPE (rope_factors_long) scaling".into() });
    }
    let full = RopeConfig { theta, scaling };
    let gemma = arch == Architecture::Gemma3;
    let window = md.opt_usize(&key("attention.sliding_window"))?;
    let layers: Vec<LayerConfig> = (0..n_layers)
        .map(|i| {
            if gemma {
                // llama.cpp: five sliding layers then one global, the sliding ones with base 10k.
                let sliding = (i + 1) % 6 != 0;
                match (sliding, window) {
                    (true, Some(w)) => LayerConfig {
                        sliding_window: Some(w),
                        rope: Some(RopeConfig { theta: 10_000.0, scaling: RopeScaling::None }),
                    },
                    _ => LayerConfig { sliding_window: None, rope: Some(full) },
                }
            } else {
                let w = if matches!(arch, Architecture::Mistral | Architecture::Phi3) { window } else { None };
                LayerConfig { sliding_window: w, rope: Some(full) }
            }
        })
        .collect();
    let has = |t: &str| has_tensor(&format!("blk.0.{t}.weight")) || has_tensor(&format!("blk.0.{t}.bias"));
    let config = ArchConfig {
        architecture: arch,
        vocab_size,
        hidden_size: hidden,
        intermediate_size: md.usize(&key("feed_forward_length"))?,
        num_heads: heads,
        num_kv_heads: kv_heads,
        head_dim,
        layers,
        rms_norm_eps: md.opt_f64(&key("attention.layer_norm_rms_epsilon"))?.unwrap_or(1e-6),
        norm_kind: NormKind::Rms,
        block_norms: if has("post_attention_norm") { BlockNorms::Sandwich } else { BlockNorms::Pre },
        parallel_residual: false,
        learned_positions: false,
        max_position_embeddings: md.opt_usize(&key("context_length"))?.unwrap_or(4096),
        tie_word_embeddings: !has_tensor("output.weight"),
        partial_rotary_factor: rotary as f64 / head_dim as f64,
        // llama.cpp permutes Llama/Mistral q and k rows so that RoPE rotates adjacent pairs.
        rope_interleaved: matches!(arch, Architecture::Llama | Architecture::Mistral),
        qkv_bias: has_tensor("blk.0.attn_q.bias") || has_tensor("blk.0.attn_qkv.bias"),
        o_bias: has_tensor("blk.0.attn_output.bias"),
        mlp_bias: has_tensor("blk.0.ffn_down.bias"),
        mlp_gated: true,
        qk_norm: if has("attn_q_norm") { QkNorm::PerHead } else { QkNorm::None },
        // llama.cpp's converter stores Gemma norms with the 1 already added.
        norm_weight_offset: false,
        embed_scale: gemma.then(|| (hidden as f64).sqrt()),
        embed_multiplier: None,
        residual_multiplier: None,
        logits_divisor: None,
        activation: if gemma { Activation::GeluTanh } else { Activation::Silu },
        attn_scale: (head_dim as f64).powf(-0.5),
        attn_scale_by_layer: false,
        attn_softcap: md.opt_f64(&key("attn_logit_softcapping"))?,
        final_softcap: md.opt_f64(&key("final_logit_softcapping"))?,
        eos_token_ids: md.token_id("tokenizer.ggml.eos_token_id")?.into_iter().collect(),
        bos_token_id: md.token_id("tokenizer.ggml.bos_token_id")?,
        moe: None,
        attn_sinks: false,
    };
    // Errors name llama.cpp's keys, not transformers' names of the same quantities.
    let field = |name: &str| -> String {
        match name {
            "hidden_size" => key("embedding_length"),
            "intermediate_size" => key("feed_forward_length"),
            "head_dim" => key("attention.key_length"),
            "num_attention_heads" => key("attention.head_count"),
            "num_key_value_heads" => key("attention.head_count_kv"),
            "num_hidden_layers" => key("block_count"),
            "vocab_size" => "token_embd.weight (rows)".to_owned(),
            "max_position_embeddings" => key("context_length"),
            "partial_rotary_factor" => key("rope.dimension_count"),
            "rms_norm_eps" => key("attention.layer_norm_rms_epsilon"),
            "query_pre_attn_scalar" => key("attention.key_length"),
            "attn_logit_softcapping" | "final_logit_softcapping" => key(name),
            "sliding_window" => key("attention.sliding_window"),
            "rope_theta" => key("rope.freq_base"),
            "rope_scaling.factor" => key("rope.scaling.factor"),
            "eos_token_id" | "bos_token_id" => format!("tokenizer.ggml.{name}"),
            other => other.to_owned(),
        }
    };
    let config = with_experts(config, md, &key)?;
    config.validate(path, &|name| match name {
        "num_experts" => key("expert_count"),
        "num_experts_per_tok" => key("expert_used_count"),
        "moe_intermediate_size" => key("expert_feed_forward_length"),
        other => field(other),
    })?;
    Ok(config)
}

/// The mixture of experts llama.cpp's keys describe (`{arch}.expert_count` and the rest), added to
/// a config read as the dense architecture: a `llama` file with experts is Mixtral.
fn with_experts(mut config: ArchConfig, md: &Metadata<'_>, key: &dyn Fn(&str) -> String) -> Result<ArchConfig> {
    let experts = md.opt_usize(&key("expert_count"))?.unwrap_or(0);
    let routing = match config.architecture {
        _ if experts == 0 => return Ok(config),
        Architecture::Llama => {
            config.architecture = Architecture::Mixtral;
            Routing::SoftmaxTopK { renormalize: true }
        }
        // llama.cpp's Qwen3-MoE graph always renormalises the selected weights.
        Architecture::Qwen3Moe => Routing::SoftmaxTopK { renormalize: true },
        other => {
            return Err(CandleError::UnsupportedConfig {
                what: format!("experts (`{}`) in a GGUF `{}` file", key("expert_count"), other.name()),
            })
        }
    };
    let n_layers = config.num_layers();
    config.moe = Some(MoeConfig {
        num_experts: experts,
        experts_per_token: md.usize(&key("expert_used_count"))?,
        expert_intermediate_size: md.opt_usize(&key("expert_feed_forward_length"))?.unwrap_or(config.intermediate_size),
        routing,
        router_bias: false,
        expert_bias: false,
        glu: ExpertGlu::Gated,
        sparse_layers: vec![true; n_layers],
    });
    Ok(config)
}
