//! GGUF metadata (llama.cpp's keys) to an `ArchConfig`.

use super::metadata::Metadata;
use super::{
    check_layer_count, Activation, ArchConfig, Architecture, BlockNorms, ExpertGlu, LayerConfig, MoeConfig, NormKind,
    QkNorm, RopeConfig, RopeScaling, Routing, SharedExpert,
};
use crate::backend::error::{CandleError, Result};

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
    // llama.cpp's `gemma-embedding` (EmbeddingGemma as its converter writes it) is Gemma 3 with
    // every token attending every other, a sliding layer's window symmetric about the token.
    let embedding_gemma = name == "gemma-embedding";
    let arch = match embedding_gemma {
        true => Architecture::Gemma3,
        false => Architecture::ALL
            .into_iter()
            .find(|a| a.gguf_name() == Some(name.as_str()))
            .ok_or_else(|| Architecture::unsupported(&name, true))?,
    };
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
    let context_length = md.opt_usize(&key("context_length"))?;
    let scaling = match scaling_type.as_deref() {
        None | Some("none") => RopeScaling::None,
        Some("linear") => RopeScaling::Linear { factor: md.opt_f64(&key("rope.scaling.factor"))?.unwrap_or(1.0) },
        Some("yarn") => yarn(md, &key, arch, context_length)?,
        Some(other) => return Err(CandleError::UnsupportedConfig { what: format!("GGUF rope scaling `{other}`") }),
    };
    if has_tensor("rope_factors_long.weight") {
        return Err(CandleError::UnsupportedConfig { what: "LongRoPE (rope_factors_long) scaling".into() });
    }
    let full = RopeConfig { theta, scaling };
    let gemma = matches!(arch, Architecture::Gemma2 | Architecture::Gemma3);
    // GPT-2 and GPT-NeoX: LayerNorm with biases and an ungated MLP, as llama.cpp builds them.
    let gpt = matches!(arch, Architecture::Gpt2 | Architecture::GptNeoX);
    let window = md.opt_usize(&key("attention.sliding_window"))?;
    // Phi-3's converter writes a window of 0 for "none" (llama.cpp's loader reads it so); for the
    // others 0 stays the invalid window it is, refused by `validate`.
    let window = if arch == Architecture::Phi3 { window.filter(|&w| w > 0) } else { window };
    // The file keeps the checkpoint's own window (the converter undoes transformers' halving);
    // llama.cpp's symmetric window sees `w / 2` either side, which is the decoder's bidirectional
    // window of `w / 2 + 1`, as `hf.rs` reads transformers' Gemma 3.
    let window = if embedding_gemma { window.map(|w| w / 2 + 1) } else { window };
    // llama.cpp's `rope_freq_base_train_swa`: Gemma 3's sliding layers keep base 10k; its
    // gemma-embedding reads `rope.freq_base_swa` (the global base where absent).
    let swa_theta = match embedding_gemma {
        true => md.opt_f64(&key("rope.freq_base_swa"))?.unwrap_or(theta),
        false => 10_000.0,
    };
    let sliding = sliding_layers(md, arch, n_layers, window.is_some(), &key("attention.sliding_window_pattern"))?;
    let layers: Vec<LayerConfig> = sliding
        .into_iter()
        .enumerate()
        .map(|(i, slides)| {
            let rope = match arch {
                Architecture::Gpt2 => None,
                // llama.cpp's `n_no_rope_layer_step = 4`: every fourth layer rotates nothing.
                Architecture::SmolLm3 if (i + 1) % 4 == 0 => None,
                Architecture::Gemma3 if slides => Some(RopeConfig { theta: swa_theta, scaling: RopeScaling::None }),
                _ => Some(full),
            };
            LayerConfig { sliding_window: if slides { window } else { None }, rope }
        })
        .collect();
    let has = |t: &str| has_tensor(&format!("blk.0.{t}.weight")) || has_tensor(&format!("blk.0.{t}.bias"));
    let eps = match gpt {
        true => md.f64(&key("attention.layer_norm_epsilon"))?,
        false => md.opt_f64(&key("attention.layer_norm_rms_epsilon"))?.unwrap_or(1e-6),
    };
    let granite = matches!(arch, Architecture::Granite | Architecture::GraniteMoe);
    // As llama.cpp's Granite loaders: the logit scale is required, the other three multipliers
    // optional, and 0 (its default) means none (an attention scale of 1/sqrt(head_dim)).
    let granite_scale = |k: &str| -> Result<Option<f64>> {
        match granite {
            true if k == "logit_scale" => md.f64(&key(k)).map(Some),
            true => Ok(md.opt_f64(&key(k))?.filter(|&s| s != 0.0)),
            false => Ok(None),
        }
    };
    let attn_multiplier = granite_scale("attention.scale")?;
    // llama.cpp scales Gemma 2/3 27B queries by 1/sqrt(hidden / heads) (their
    // query_pre_attn_scalar), recognising the model by its layer count; all others by 1/sqrt(head_dim).
    let big_gemma = matches!((arch, n_layers), (Architecture::Gemma2, 46) | (Architecture::Gemma3, 62));
    let attn_scale = match attn_multiplier {
        Some(s) => s,
        None if big_gemma => ((hidden / heads) as f64).powf(-0.5),
        None => (head_dim as f64).powf(-0.5),
    };
    let config = ArchConfig {
        architecture: arch,
        vocab_size,
        hidden_size: hidden,
        // A mixture whose every layer is sparse may say only its experts' width.
        intermediate_size: match md.opt_usize(&key("feed_forward_length"))? {
            Some(n) => n,
            None => md
                .opt_usize(&key("expert_feed_forward_length"))?
                .ok_or_else(|| CandleError::MissingMetadata { key: key("feed_forward_length") })?,
        },
        num_heads: heads,
        num_kv_heads: kv_heads,
        head_dim,
        layers,
        rms_norm_eps: eps,
        norm_kind: if gpt { NormKind::Layer } else { NormKind::Rms },
        block_norms: match arch {
            _ if gemma => BlockNorms::Sandwich,
            Architecture::Olmo2 => BlockNorms::Post,
            _ => BlockNorms::Pre,
        },
        parallel_residual: arch == Architecture::GptNeoX && md.opt_bool(&key("use_parallel_residual"))?.unwrap_or(true),
        learned_positions: arch == Architecture::Gpt2,
        max_position_embeddings: context_length.unwrap_or(4096),
        tie_word_embeddings: !has_tensor("output.weight"),
        partial_rotary_factor: rotary as f64 / head_dim as f64,
        rope_interleaved: converter_permutes_qk(arch),
        qkv_bias: has_tensor("blk.0.attn_q.bias") || has_tensor("blk.0.attn_qkv.bias"),
        o_bias: has_tensor("blk.0.attn_output.bias"),
        mlp_bias: has_tensor("blk.0.ffn_down.bias"),
        mlp_gated: !gpt,
        qk_norm: match arch {
            _ if !has("attn_q_norm") => QkNorm::None,
            Architecture::Olmo2 | Architecture::Olmoe => QkNorm::Whole,
            _ => QkNorm::PerHead,
        },
        // llama.cpp's converter stores Gemma norms with the 1 already added.
        norm_weight_offset: false,
        embed_scale: gemma.then(|| (hidden as f64).sqrt()),
        embed_multiplier: granite_scale("embedding_scale")?,
        residual_multiplier: granite_scale("residual_scale")?,
        logits_divisor: granite_scale("logit_scale")?,
        // GGUF records no activation: each architecture's own, as transformers computes it. (llama.cpp
        // computes GPT-NeoX's exact GELU with the tanh approximation; Pythia's config says `gelu`.)
        activation: match arch {
            _ if gemma => Activation::GeluTanh,
            Architecture::Gpt2 => Activation::GeluTanh,
            Architecture::GptNeoX => Activation::Gelu,
            _ => Activation::Silu,
        },
        attn_scale,
        attn_scale_by_layer: false,
        attn_softcap: md.opt_f64(&key("attn_logit_softcapping"))?,
        final_softcap: md.opt_f64(&key("final_logit_softcapping"))?,
        eos_token_ids: md.token_id("tokenizer.ggml.eos_token_id")?.into_iter().collect(),
        bos_token_id: md.token_id("tokenizer.ggml.bos_token_id")?,
        moe: None,
        attn_sinks: has_tensor("blk.0.attn_sinks.weight"),
        bidirectional: embedding_gemma,
        embedding_pooling: super::encoder::EncoderPooling::from_gguf(md.opt_usize(&key("pooling_type"))?, path, &name)?,
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
            "rms_norm_eps" if gpt => key("attention.layer_norm_epsilon"),
            "rms_norm_eps" => key("attention.layer_norm_rms_epsilon"),
            "query_pre_attn_scalar" if granite => key("attention.scale"),
            "query_pre_attn_scalar" => key("attention.key_length"),
            "embedding_multiplier" => key("embedding_scale"),
            "residual_multiplier" => key("residual_scale"),
            "logits_scaling" => key("logit_scale"),
            "attn_logit_softcapping" | "final_logit_softcapping" => key(name),
            "sliding_window" => key("attention.sliding_window"),
            "rope_theta" => key("rope.freq_base"),
            "rope_scaling.factor" => key("rope.scaling.factor"),
            "rope_scaling.original_max_position_embeddings" => key("rope.scaling.original_context_length"),
            "rope_scaling.beta_fast" => key("rope.scaling.yarn_beta_fast"),
            "rope_scaling.beta_slow" => key("rope.scaling.yarn_beta_slow"),
            "rope_scaling.attention_factor" => key("rope.scaling.yarn_attn_factor"),
            "eos_token_id" | "bos_token_id" => format!("tokenizer.ggml.{name}"),
            other => other.to_owned(),
        }
    };
    let config = with_experts(config, md, &key, has_tensor)?;
    config.validate(path, &|name| match name {
        "num_experts" => key("expert_count"),
        "num_experts_per_tok" => key("expert_used_count"),
        "moe_intermediate_size" => key("expert_feed_forward_length"),
        "swiglu_limit" => key("swiglu_clamp_exp"),
        other => field(other),
    })?;
    Ok(config)
}

/// The mixture of experts llama.cpp's keys describe (`{arch}.expert_count` and the rest), added to
/// a config read as the dense architecture: a `llama` file with experts is Mixtral. Each
/// architecture routes as llama.cpp's graph for it does.
/// Whether llama.cpp's converter permutes q and k rows of `arch` (the Llama family,
/// `LlamaModel.permute`) so that RoPE rotates adjacent pairs; the others keep Hugging Face's halves.
/// Its LoRA converter permutes `lora_B` of q and k likewise.
pub fn converter_permutes_qk(arch: Architecture) -> bool {
    matches!(
        arch,
        Architecture::Llama
            | Architecture::Mistral
            | Architecture::SmolLm3
            | Architecture::Granite
            | Architecture::GraniteMoe
    )
}

fn with_experts(
    mut config: ArchConfig,
    md: &Metadata<'_>,
    key: &dyn Fn(&str) -> String,
    has_tensor: &dyn Fn(&str) -> bool,
) -> Result<ArchConfig> {
    let arch = config.architecture;
    let experts = md.opt_usize(&key("expert_count"))?.unwrap_or(0);
    // As llama.cpp, which refuses these without experts.
    if experts == 0 && matches!(arch, Architecture::Olmoe | Architecture::GptOss | Architecture::Qwen2Moe) {
        return Err(CandleError::MissingMetadata { key: key("expert_count") });
    }
    // The always-on expert (`ffn_{gate,up,down}_shexp`): Qwen2-MoE's, scaled by the sigmoid of
    // `ffn_gate_inp_shexp`, and Granite MoE Shared's (written as `granitemoe`), added as it is.
    let shared_key = key("expert_shared_feed_forward_length");
    let shared_width = md.opt_usize(&shared_key)?.unwrap_or(0);
    let shared_expert = if shared_width > 0 || has_tensor("blk.0.ffn_up_shexp.weight") {
        if !matches!(arch, Architecture::Qwen2Moe | Architecture::GraniteMoe) || experts == 0 {
            return Err(CandleError::UnsupportedConfig {
                what: format!("shared experts (`{shared_key}`, `ffn_*_shexp`) in a GGUF `{}` file", arch.name()),
            });
        }
        if shared_width == 0 {
            return Err(CandleError::MissingMetadata { key: shared_key });
        }
        Some(SharedExpert { intermediate_size: shared_width, gated: has_tensor("blk.0.ffn_gate_inp_shexp.weight") })
    } else {
        None
    };
    let mut glu = ExpertGlu::Gated;
    let routing = match arch {
        _ if experts == 0 => return Ok(config),
        Architecture::Llama => {
            config.architecture = Architecture::Mixtral;
            Routing::SoftmaxTopK { renormalize: true }
        }
        // llama.cpp's Qwen3-MoE graph always renormalises the selected weights; Qwen2-MoE's and
        // OLMoE's never do.
        Architecture::Qwen3Moe => Routing::SoftmaxTopK { renormalize: true },
        Architecture::Qwen2Moe | Architecture::Olmoe => Routing::SoftmaxTopK { renormalize: false },
        // llama.cpp renormalises Granite MoE's softmax over its top k: the same weights as a softmax
        // over the top-k logits, which is how transformers (and the HF path here) computes them.
        Architecture::GraniteMoe => Routing::TopKSoftmax,
        Architecture::GptOss => {
            // llama.cpp's gpt-oss graph clamps at a constant 7.0 (`LLM_FFN_SWIGLU_OAI_MOE`), the
            // released models' `swiglu_limit`; a file may say otherwise in the per-layer key the
            // converter writes for DeepSeek's clamp, which must then agree across layers.
            let limit = match md.opt_f64_array(&key("swiglu_clamp_exp"))? {
                None => 7.0,
                Some(limits) => match limits.split_first() {
                    Some((&first, rest)) if rest.iter().all(|&l| l == first) => first,
                    _ => {
                        return Err(CandleError::UnsupportedConfig {
                            what: format!("`{}` {limits:?}: one clamp for every layer", key("swiglu_clamp_exp")),
                        })
                    }
                },
            };
            glu = ExpertGlu::ClampedSwiGlu { alpha: 1.702, limit };
            Routing::TopKSoftmax
        }
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
        router_bias: has_tensor("blk.0.ffn_gate_inp.bias"),
        expert_bias: has_tensor("blk.0.ffn_gate_exps.bias"),
        glu,
        sparse_layers: vec![true; n_layers],
        shared_expert,
    });
    Ok(config)
}

/// YaRN as llama.cpp reads it: `rope.scaling.factor`, the ramp computed for
/// `rope.scaling.original_context_length` (else the training context), its bounds β (32 and 1
/// where the file gives none, llama.cpp's defaults) and cos/sin multiplied by 0.1·ln(factor) + 1
/// (or the converter's `yarn_attn_factor`, transformers' `attention_factor`), times
/// `rope.scaling.attn_factor`.
fn yarn(
    md: &Metadata<'_>,
    key: &dyn Fn(&str) -> String,
    arch: Architecture,
    context_length: Option<usize>,
) -> Result<RopeScaling> {
    if md.opt_f64(&key("rope.scaling.yarn_log_multiplier"))?.is_some_and(|m| m != 0.0) {
        return Err(CandleError::UnsupportedConfig {
            what: format!("YaRN with `{}` (DeepSeek's mscale_all_dim)", key("rope.scaling.yarn_log_multiplier")),
        });
    }
    let factor = md.opt_f64(&key("rope.scaling.factor"))?.unwrap_or(1.0);
    let original = md.opt_usize(&key("rope.scaling.original_context_length"))?.or(context_length);
    let original =
        original.ok_or_else(|| CandleError::MissingMetadata { key: key("rope.scaling.original_context_length") })?;
    let mscale = if factor <= 1.0 { 1.0 } else { 0.1 * factor.ln() + 1.0 };
    let attention = md.opt_f64(&key("rope.scaling.yarn_attn_factor"))?.unwrap_or(mscale);
    Ok(RopeScaling::Yarn {
        factor,
        original_max_position_embeddings: original as f64,
        beta_fast: md.opt_f64(&key("rope.scaling.yarn_beta_fast"))?.unwrap_or(32.0),
        beta_slow: md.opt_f64(&key("rope.scaling.yarn_beta_slow"))?.unwrap_or(1.0),
        // Whether the ramp's bounds are rounded to whole dimensions: transformers' default, and what
        // llama.cpp always does (`ggml_rope_yarn_corr_dims`). gpt-oss's config says
        // `truncate: false`, which no GGUF key carries; its ramp is left unrounded as the model
        // defines it (on the tiny fixture the rounded ramp moves one frequency pair and the logits
        // by far more than DESIGN §7's bound).
        truncate: arch != Architecture::GptOss,
        attention_factor: attention * md.opt_f64(&key("rope.scaling.attn_factor"))?.unwrap_or(1.0),
    })
}

/// Which layers slide: a per-layer `attention.sliding_window_pattern` where the file has one, else
/// a period there (`n`: n - 1 sliding layers, then a global one), else the layout llama.cpp assumes
/// for the architecture (`load_swa_pattern`: Gemma 3 five sliding layers then one global, OLMo 2
/// three then one, Gemma 2 and gpt-oss every other layer from the first; Mistral and Phi-3 every
/// layer).
fn sliding_layers(
    md: &Metadata<'_>,
    arch: Architecture,
    n_layers: usize,
    has_window: bool,
    pattern_key: &str,
) -> Result<Vec<bool>> {
    if !has_window {
        return Ok(vec![false; n_layers]);
    }
    if md.array_len(pattern_key).is_some() {
        let pattern = md.opt_bool_array(pattern_key)?.unwrap_or_default();
        if pattern.len() != n_layers {
            return Err(CandleError::UnsupportedConfig {
                what: format!("GGUF metadata `{pattern_key}` has {} entries for {n_layers} layers", pattern.len()),
            });
        }
        return Ok(pattern);
    }
    // llama.cpp's `set_swa_pattern(n)`: n - 1 sliding layers, then a global one (0: all slide).
    let every = |n: usize| -> Vec<bool> { (0..n_layers).map(|i| n == 0 || i % n < n - 1).collect() };
    if let Some(n) = md.opt_usize(pattern_key)? {
        return Ok(every(n));
    }
    Ok(match arch {
        Architecture::Gemma3 => every(6),
        Architecture::Olmo2 => every(4),
        Architecture::Gemma2 | Architecture::GptOss => every(2),
        Architecture::Mistral | Architecture::Phi3 => vec![true; n_layers],
        _ => vec![false; n_layers],
    })
}

#[cfg(test)]
mod tests {
    use std::collections::HashMap;

    use candle_core::quantized::gguf_file::Value;

    use super::*;

    /// The keys llama.cpp's converter writes for a 4-layer model of `arch`, plus `extra`.
    fn metadata(arch: &str, extra: Vec<(&str, Value)>) -> HashMap<String, Value> {
        let mut md: HashMap<String, Value> = [
            ("general.architecture".to_owned(), Value::String(arch.into())),
            (format!("{arch}.embedding_length"), Value::U32(64)),
            (format!("{arch}.block_count"), Value::U32(4)),
            (format!("{arch}.feed_forward_length"), Value::U32(128)),
            (format!("{arch}.attention.head_count"), Value::U32(4)),
            (format!("{arch}.context_length"), Value::U32(512)),
        ]
        .into_iter()
        .collect();
        for (k, v) in extra {
            md.insert(format!("{arch}.{k}"), v);
        }
        md
    }

    fn parse(md: &HashMap<String, Value>, tensors: &[&str]) -> Result<ArchConfig> {
        parse_config(&Metadata::new(md), &|t| tensors.contains(&t), 10, None, "x.gguf")
    }

    #[test]
    fn gemma2_slides_on_even_layers_and_gemma3_follows_a_pattern_array() {
        let md = metadata("gemma2", vec![("attention.sliding_window", Value::U32(6))]);
        let cfg = parse(&md, &[]).unwrap();
        let windows: Vec<_> = cfg.layers.iter().map(|l| l.sliding_window).collect();
        assert_eq!(windows, [Some(6), None, Some(6), None]);
        assert_eq!((cfg.block_norms, cfg.activation), (BlockNorms::Sandwich, Activation::GeluTanh));
        assert_eq!(cfg.attn_scale, 0.25, "1/sqrt(head_dim)");
        // Gemma 2 27B (46 layers): llama.cpp's 1/sqrt(hidden / heads).
        let mut md = metadata("gemma2", vec![("attention.key_length", Value::U32(8))]);
        md.insert("gemma2.block_count".into(), Value::U32(46));
        assert_eq!(parse(&md, &[]).unwrap().attn_scale, 0.25);
        md.insert("gemma2.block_count".into(), Value::U32(4));
        assert!((parse(&md, &[]).unwrap().attn_scale - 8f64.powf(-0.5)).abs() < 1e-12);
        let pattern = Value::Array([true, true, true, false].map(Value::Bool).to_vec());
        let md = metadata(
            "gemma3",
            vec![("attention.sliding_window", Value::U32(6)), ("attention.sliding_window_pattern", pattern)],
        );
        let cfg = parse(&md, &[]).unwrap();
        assert_eq!(cfg.layers[3].sliding_window, None);
        assert_eq!(cfg.layers[2].rope.unwrap().theta, 10_000.0);
        let short = Value::Array(vec![Value::Bool(true)]);
        let md = metadata(
            "gemma3",
            vec![("attention.sliding_window", Value::U32(6)), ("attention.sliding_window_pattern", short)],
        );
        assert!(parse(&md, &[]).unwrap_err().to_string().contains("sliding_window_pattern"));
    }

    #[test]
    fn smollm3_leaves_every_fourth_layer_unrotated_and_gpt2_every_layer() {
        let cfg = parse(&metadata("smollm3", vec![]), &[]).unwrap();
        let rotating: Vec<bool> = cfg.layers.iter().map(|l| l.rope.is_some()).collect();
        assert_eq!(rotating, [true, true, true, false]);
        assert!(cfg.rope_interleaved);
        let md = metadata("gpt2", vec![("attention.layer_norm_epsilon", Value::F32(1e-5))]);
        let cfg = parse(&md, &["position_embd.weight"]).unwrap();
        assert!(cfg.layers.iter().all(|l| l.rope.is_none()) && cfg.learned_positions && !cfg.mlp_gated);
        assert_eq!(cfg.norm_kind, NormKind::Layer);
    }

    #[test]
    fn neox_reads_parallel_residual_and_rejects_a_wrong_type() {
        let base = vec![("attention.layer_norm_epsilon", Value::F32(1e-5)), ("rope.dimension_count", Value::U32(4))];
        let mut serial = base.clone();
        serial.push(("use_parallel_residual", Value::Bool(false)));
        let cfg = parse(&metadata("gptneox", serial), &[]).unwrap();
        assert!(!cfg.parallel_residual);
        assert_eq!((cfg.rotary_dim(), cfg.activation), (4, Activation::Gelu));
        let mut wrong = base.clone();
        wrong.push(("use_parallel_residual", Value::U32(1)));
        let err = parse(&metadata("gptneox", wrong), &[]).unwrap_err().to_string();
        assert!(err.contains("use_parallel_residual"), "{err}");
        let err = parse(&metadata("gptneox", vec![]), &[]).unwrap_err().to_string();
        assert!(err.contains("layer_norm_epsilon"), "{err}");
    }

    #[test]
    fn granite_multipliers_are_required_and_checked() {
        let scales = |residual: f32| {
            vec![
                ("attention.scale", Value::F32(0.0625)),
                ("embedding_scale", Value::F32(12.0)),
                ("residual_scale", Value::F32(residual)),
                ("logit_scale", Value::F32(2.0)),
            ]
        };
        let cfg = parse(&metadata("granite", scales(0.25)), &[]).unwrap();
        assert_eq!((cfg.attn_scale, cfg.embed_multiplier, cfg.logits_divisor), (0.0625, Some(12.0), Some(2.0)));
        let err = parse(&metadata("granite", scales(-1.0)), &[]).unwrap_err().to_string();
        assert!(err.contains("granite.residual_scale"), "{err}");
        let mut missing = scales(0.25);
        missing.pop();
        let err = parse(&metadata("granite", missing), &[]).unwrap_err().to_string();
        assert!(err.contains("granite.logit_scale"), "{err}");
    }

    #[test]
    fn gpt_oss_reads_sinks_biases_windows_yarn_and_its_clamp() {
        let yarn = |extra: Vec<(&'static str, Value)>| {
            let mut md = vec![
                ("expert_count", Value::U32(4)),
                ("expert_used_count", Value::U32(2)),
                ("expert_feed_forward_length", Value::U32(48)),
                ("attention.sliding_window", Value::U32(6)),
                ("rope.scaling.type", Value::String("yarn".into())),
                ("rope.scaling.factor", Value::F32(4.0)),
                ("rope.scaling.original_context_length", Value::U32(64)),
            ];
            md.extend(extra);
            metadata("gpt-oss", md)
        };
        let tensors = ["blk.0.attn_sinks.weight", "blk.0.ffn_gate_inp.bias", "blk.0.ffn_gate_exps.bias"];
        let clamp = Value::Array(vec![Value::F32(1.0); 4]);
        let cfg = parse(&yarn(vec![("swiglu_clamp_exp", clamp)]), &tensors).unwrap();
        assert_eq!(cfg.architecture, Architecture::GptOss);
        let windows: Vec<_> = cfg.layers.iter().map(|l| l.sliding_window).collect();
        assert_eq!(windows, [Some(6), None, Some(6), None], "llama.cpp's pattern 2");
        assert!(cfg.attn_sinks && !cfg.rope_interleaved);
        let moe = cfg.moe.as_ref().unwrap();
        assert_eq!(
            (moe.routing, moe.glu),
            (Routing::TopKSoftmax, ExpertGlu::ClampedSwiGlu { alpha: 1.702, limit: 1.0 })
        );
        assert!(moe.router_bias && moe.expert_bias && moe.expert_intermediate_size == 48);
        match cfg.layers[1].rope.unwrap().scaling {
            RopeScaling::Yarn { factor, original_max_position_embeddings, truncate, attention_factor, .. } => {
                assert_eq!((factor, original_max_position_embeddings, truncate), (4.0, 64.0, false));
                assert!((attention_factor - (0.1 * 4f64.ln() + 1.0)).abs() < 1e-12);
            }
            other => panic!("{other:?}"),
        }
        // No key: llama.cpp's constant; clamps that differ by layer are refused by name.
        let cfg = parse(&yarn(vec![]), &tensors).unwrap();
        assert_eq!(cfg.moe.unwrap().glu, ExpertGlu::ClampedSwiGlu { alpha: 1.702, limit: 7.0 });
        let uneven = Value::Array(vec![Value::F32(1.0), Value::F32(2.0)]);
        let err = parse(&yarn(vec![("swiglu_clamp_exp", uneven)]), &tensors).unwrap_err().to_string();
        assert!(err.contains("gpt-oss.swiglu_clamp_exp"), "{err}");
        let err = parse(&metadata("gpt-oss", vec![]), &[]).unwrap_err().to_string();
        assert!(err.contains("gpt-oss.expert_count"), "{err}");
    }

    #[test]
    fn olmoe_and_granitemoe_route_as_llama_cpp_does() {
        let experts = || vec![("expert_count", Value::U32(8)), ("expert_used_count", Value::U32(2))];
        let cfg = parse(&metadata("olmoe", experts()), &["blk.0.attn_q_norm.weight"]).unwrap();
        assert_eq!((cfg.qk_norm, cfg.rope_interleaved), (QkNorm::Whole, false));
        assert_eq!(cfg.moe.unwrap().routing, Routing::SoftmaxTopK { renormalize: false });
        let mut md = experts();
        md.push(("logit_scale", Value::F32(2.0)));
        md.push(("residual_scale", Value::F32(0.25)));
        let cfg = parse(&metadata("granitemoe", md.clone()), &[]).unwrap();
        assert!(cfg.rope_interleaved);
        assert_eq!((cfg.logits_divisor, cfg.residual_multiplier, cfg.embed_multiplier), (Some(2.0), Some(0.25), None));
        assert_eq!(cfg.moe.unwrap().routing, Routing::TopKSoftmax);
        // Granite MoE Shared: the same architecture with an ungated shared expert.
        md.push(("expert_shared_feed_forward_length", Value::U32(32)));
        let shared = parse(&metadata("granitemoe", md), &["blk.0.ffn_up_shexp.weight"]).unwrap().moe.unwrap();
        assert_eq!(shared.shared_expert, Some(SharedExpert { intermediate_size: 32, gated: false }));
    }

    #[test]
    fn shared_experts_load_where_llama_cpp_has_them_and_are_refused_elsewhere() {
        let experts = |shared: u32| {
            vec![
                ("expert_count", Value::U32(4)),
                ("expert_used_count", Value::U32(2)),
                ("expert_shared_feed_forward_length", Value::U32(shared)),
            ]
        };
        let gated = ["blk.0.ffn_up_shexp.weight", "blk.0.ffn_gate_inp_shexp.weight"];
        let moe = parse(&metadata("qwen2moe", experts(96)), &gated).unwrap().moe.unwrap();
        assert_eq!(moe.routing, Routing::SoftmaxTopK { renormalize: false });
        assert_eq!(moe.shared_expert, Some(SharedExpert { intermediate_size: 96, gated: true }));
        // Tensors without their width, and a shared expert where the decoder has none.
        let err = parse(&metadata("qwen2moe", experts(0)), &gated).unwrap_err().to_string();
        assert!(err.contains("qwen2moe.expert_shared_feed_forward_length"), "{err}");
        let err = parse(&metadata("qwen3moe", experts(96)), &gated).unwrap_err().to_string();
        assert!(err.contains("shared experts") && err.contains("qwen3_moe"), "{err}");
    }

    #[test]
    fn an_integer_window_pattern_is_a_period() {
        let md = metadata(
            "gemma3",
            vec![("attention.sliding_window", Value::U32(6)), ("attention.sliding_window_pattern", Value::U32(2))],
        );
        let windows: Vec<_> = parse(&md, &[]).unwrap().layers.iter().map(|l| l.sliding_window).collect();
        assert_eq!(windows, [Some(6), None, Some(6), None]);
    }

    #[test]
    fn olmo2_norms_come_after_each_branch_and_cover_the_whole_projection() {
        let cfg = parse(&metadata("olmo2", vec![]), &["blk.0.attn_q_norm.weight"]).unwrap();
        assert_eq!((cfg.block_norms, cfg.qk_norm), (BlockNorms::Post, QkNorm::Whole));
        assert!(!cfg.rope_interleaved);
    }
}
