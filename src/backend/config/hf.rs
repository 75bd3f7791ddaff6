//! `config.json` of a Hugging Face checkpoint to an `ArchConfig`.
//!
//! The file is read into a serde struct: a present value of the wrong type or range is an error
//! naming its field; only an absent (or `null`) optional field takes its default.

use serde::Deserialize;
use serde_json::{Map, Value};

use super::{
    check_layer_count, invalid, Activation, ArchConfig, Architecture, BlockNorms, ExpertGlu, LayerConfig, MoeConfig,
    NormKind, QkNorm, RopeConfig, RopeScaling, Routing, SharedExpert,
};
use crate::backend::error::{CandleError, Result};

type Json = Map<String, Value>;

/// A token id or a list of them (`eos_token_id` is either).
#[derive(Debug, Clone, Deserialize)]
#[serde(untagged, expecting = "a token id (an integer in 0..2^32) or a list of token ids")]
enum TokenIds {
    One(u32),
    Many(Vec<u32>),
}

impl TokenIds {
    fn into_vec(self) -> Vec<u32> {
        match self {
            Self::One(id) => vec![id],
            Self::Many(ids) => ids,
        }
    }
}

/// One rope description (`rope_scaling`, `rope_parameters` or one of its per-layer-type entries).
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(default)]
struct RopeParams {
    rope_theta: Option<f64>,
    rope_type: Option<String>,
    #[serde(rename = "type")]
    kind: Option<String>,
    factor: Option<f64>,
    low_freq_factor: Option<f64>,
    high_freq_factor: Option<f64>,
    original_max_position_embeddings: Option<f64>,
    partial_rotary_factor: Option<f64>,
    beta_fast: Option<f64>,
    beta_slow: Option<f64>,
    truncate: Option<bool>,
    attention_factor: Option<f64>,
    mscale: Option<f64>,
    mscale_all_dim: Option<f64>,
}

/// `layer_types` entries.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "snake_case")]
enum LayerType {
    SlidingAttention,
    FullAttention,
}

/// The keys of `config.json` candlewick reads; every one optional at this level. The aliases
/// are GPT-2's and GPT-NeoX's older names of the same quantities.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(default)]
struct HfConfig {
    model_type: Option<String>,
    #[serde(alias = "n_embd")]
    hidden_size: Option<usize>,
    #[serde(alias = "n_head")]
    num_attention_heads: Option<usize>,
    #[serde(alias = "n_layer")]
    num_hidden_layers: Option<usize>,
    num_key_value_heads: Option<usize>,
    #[serde(alias = "n_inner")]
    intermediate_size: Option<usize>,
    vocab_size: Option<usize>,
    head_dim: Option<usize>,
    #[serde(alias = "rotary_emb_base")]
    rope_theta: Option<f64>,
    rope_local_base_freq: Option<f64>,
    rope_scaling: Option<RopeParams>,
    rope_parameters: Option<Json>,
    layer_types: Option<Vec<LayerType>>,
    sliding_window: Option<usize>,
    sliding_window_pattern: Option<usize>,
    #[serde(rename = "_sliding_window_pattern")]
    sliding_window_pattern_legacy: Option<usize>,
    use_sliding_window: Option<bool>,
    max_window_layers: Option<usize>,
    #[serde(alias = "rotary_pct")]
    partial_rotary_factor: Option<f64>,
    hidden_activation: Option<String>,
    #[serde(alias = "activation_function")]
    hidden_act: Option<String>,
    attention_bias: Option<bool>,
    /// Qwen2-MoE's switch for the q, k, v biases.
    qkv_bias: Option<bool>,
    mlp_bias: Option<bool>,
    query_pre_attn_scalar: Option<f64>,
    rms_norm_eps: Option<f64>,
    #[serde(alias = "layer_norm_epsilon")]
    layer_norm_eps: Option<f64>,
    #[serde(alias = "n_positions")]
    max_position_embeddings: Option<usize>,
    tie_word_embeddings: Option<bool>,
    attn_logit_softcapping: Option<f64>,
    final_logit_softcapping: Option<f64>,
    eos_token_id: Option<TokenIds>,
    bos_token_id: Option<TokenIds>,
    /// SmolLM3: 1 where a layer uses RoPE, 0 where it does not.
    no_rope_layers: Option<Vec<u8>>,
    no_rope_layer_interval: Option<usize>,
    embedding_multiplier: Option<f64>,
    residual_multiplier: Option<f64>,
    attention_multiplier: Option<f64>,
    logits_scaling: Option<f64>,
    use_parallel_residual: Option<bool>,
    scale_attn_weights: Option<bool>,
    scale_attn_by_inverse_layer_idx: Option<bool>,
    /// Experts per MoE layer (`num_experts` in Qwen3-MoE and OLMoE, `num_local_experts` elsewhere).
    num_experts: Option<usize>,
    num_local_experts: Option<usize>,
    num_experts_per_tok: Option<usize>,
    moe_intermediate_size: Option<usize>,
    norm_topk_prob: Option<bool>,
    decoder_sparse_step: Option<usize>,
    mlp_only_layers: Option<Vec<usize>>,
    /// Qwen2-MoE's shared expert width.
    shared_expert_intermediate_size: Option<usize>,
    /// Granite MoE Shared's shared expert width.
    shared_intermediate_size: Option<usize>,
    swiglu_limit: Option<f64>,
    swiglu_alpha: Option<f64>,
    clip_qkv: Option<f64>,
    /// EmbeddingGemma: attention in both directions (DESIGN §17).
    use_bidirectional_attention: Option<bool>,
}

/// Deserializes `map` as `T`; on failure, finds the key whose value is at fault so the error
/// names it (serde_json's own message gives only a line and column).
fn typed<T: for<'de> Deserialize<'de>>(map: &Json, source: &str, prefix: &str) -> Result<T> {
    match T::deserialize(Value::Object(map.clone())) {
        Ok(v) => Ok(v),
        Err(whole) => {
            for (key, value) in map {
                let one = Json::from_iter([(key.clone(), value.clone())]);
                if let Err(e) = T::deserialize(Value::Object(one)) {
                    return Err(invalid(source, &format!("{prefix}{key}"), e));
                }
            }
            Err(invalid(source, prefix.trim_end_matches('.'), whole))
        }
    }
}

fn required(v: Option<usize>, source: &str, key: &str) -> Result<usize> {
    v.ok_or_else(|| CandleError::Malformed {
        what: "config.json",
        path: source.to_owned(),
        reason: format!("no `{key}` (a positive integer)"),
    })
}

/// Reads one rope description: `rope_theta` plus a `rope_type`/`type` and its factors.
fn parse_rope(
    params: &RopeParams,
    default_theta: f64,
    max_positions: Option<usize>,
    source: &str,
    at: &str,
) -> Result<RopeConfig> {
    let theta = params.rope_theta.unwrap_or(default_theta);
    let kind = params.rope_type.as_deref().or(params.kind.as_deref()).unwrap_or("default");
    let factor = || {
        params.factor.ok_or_else(|| invalid(source, &format!("{at}.factor"), format!("rope scaling `{kind}` needs it")))
    };
    let scaling = match kind {
        "default" => RopeScaling::None,
        "linear" => RopeScaling::Linear { factor: factor()? },
        "llama3" => RopeScaling::Llama3 {
            factor: factor()?,
            low_freq_factor: params.low_freq_factor.unwrap_or(1.0),
            high_freq_factor: params.high_freq_factor.unwrap_or(4.0),
            original_max_position_embeddings: params.original_max_position_embeddings.unwrap_or(8192.0),
        },
        "yarn" => {
            let factor = factor()?;
            // transformers' `get_mscale`: 0.1·ln(s) + 1 above a scale of 1.
            let mscale = |scale: f64, m: f64| if scale <= 1.0 { 1.0 } else { 0.1 * m * scale.ln() + 1.0 };
            let attention_factor = match (params.attention_factor, params.mscale, params.mscale_all_dim) {
                (Some(a), _, _) => a,
                (None, Some(m), Some(all)) if m != 0.0 && all != 0.0 => mscale(factor, m) / mscale(factor, all),
                _ => mscale(factor, 1.0),
            };
            let original = params.original_max_position_embeddings.or(max_positions.map(|m| m as f64));
            RopeScaling::Yarn {
                factor,
                original_max_position_embeddings: original.ok_or_else(|| {
                    invalid(source, &format!("{at}.original_max_position_embeddings"), "YaRN needs it")
                })?,
                beta_fast: params.beta_fast.unwrap_or(32.0),
                beta_slow: params.beta_slow.unwrap_or(1.0),
                truncate: params.truncate.unwrap_or(true),
                attention_factor,
            }
        }
        other => return Err(CandleError::UnsupportedConfig { what: format!("rope scaling type `{other}` ({at})") }),
    };
    let rope = RopeConfig { theta, scaling };
    rope.validate().map_err(|(name, reason)| {
        let name = name.strip_prefix("rope_scaling.").unwrap_or(name);
        // A theta the description does not state came from the top-level `rope_theta`.
        let field = if name == "rope_theta" && params.rope_theta.is_none() {
            "rope_theta".to_owned()
        } else {
            format!("{at}.{name}")
        };
        invalid(source, &field, reason)
    })?;
    Ok(rope)
}

/// The rope of each layer type (`full_attention`, `sliding_attention`), from either config style.
fn rope_by_layer_type(cfg: &HfConfig, arch: Architecture, source: &str) -> Result<(RopeConfig, RopeConfig)> {
    let theta = cfg.rope_theta.unwrap_or(10_000.0);
    let max_pos = cfg.max_position_embeddings;
    if let Some(params) = &cfg.rope_parameters {
        // transformers 5: either one flat description or one per layer type.
        if let Some(full) = params.get("full_attention") {
            let object = |v: &Value, at: &str| match v {
                Value::Object(m) => typed::<RopeParams>(m, source, &format!("{at}.")),
                other => Err(invalid(source, at, format!("expected an object, got {other}"))),
            };
            let full = parse_rope(
                &object(full, "rope_parameters.full_attention")?,
                theta,
                max_pos,
                source,
                "rope_parameters.full_attention",
            )?;
            let sliding = match params.get("sliding_attention") {
                Some(s) => {
                    let at = "rope_parameters.sliding_attention";
                    parse_rope(&object(s, at)?, theta, max_pos, source, at)?
                }
                None => full,
            };
            return Ok((full, sliding));
        }
        let flat = typed::<RopeParams>(params, source, "rope_parameters.")?;
        let rope = parse_rope(&flat, theta, max_pos, source, "rope_parameters")?;
        return Ok((rope, rope));
    }
    let full = match &cfg.rope_scaling {
        Some(s) => parse_rope(s, theta, max_pos, source, "rope_scaling")?,
        None => parse_rope(&RopeParams::default(), theta, max_pos, source, "rope_scaling")?,
    };
    let sliding = if arch == Architecture::Gemma3 {
        let local = RopeConfig { theta: cfg.rope_local_base_freq.unwrap_or(10_000.0), scaling: RopeScaling::None };
        local.validate().map_err(|(_, reason)| invalid(source, "rope_local_base_freq", reason))?;
        local
    } else {
        full
    };
    Ok((full, sliding))
}

/// Which layers use sliding-window attention, from `layer_types` or the older per-family keys.
fn sliding_layers(cfg: &HfConfig, arch: Architecture, n_layers: usize, source: &str) -> Result<Vec<bool>> {
    if let Some(types) = &cfg.layer_types {
        if types.len() != n_layers {
            return Err(invalid(
                source,
                "layer_types",
                format!("has {} entries for {n_layers} layers (`num_hidden_layers`)", types.len()),
            ));
        }
        return Ok(types.iter().map(|t| *t == LayerType::SlidingAttention).collect());
    }
    let has_window = cfg.sliding_window.is_some();
    Ok(match arch {
        Architecture::Gemma3 => {
            let (key, pattern) = match (cfg.sliding_window_pattern, cfg.sliding_window_pattern_legacy) {
                (Some(p), _) => ("sliding_window_pattern", p),
                (None, Some(p)) => ("_sliding_window_pattern", p),
                (None, None) => ("sliding_window_pattern", 6),
            };
            if pattern == 0 {
                return Err(invalid(source, key, "a pattern of 0 layers (every n-th layer is global, n ≥ 1)"));
            }
            (0..n_layers).map(|i| (i + 1) % pattern != 0).collect()
        }
        Architecture::Qwen2 | Architecture::Qwen3 | Architecture::Qwen3Moe | Architecture::Qwen2Moe => {
            let on = has_window && cfg.use_sliding_window.unwrap_or(false);
            let from = cfg.max_window_layers.unwrap_or(n_layers);
            (0..n_layers).map(|i| on && i >= from).collect()
        }
        // transformers' default for Gemma 2 and gpt-oss without `layer_types`: even layers slide.
        Architecture::Gemma2 | Architecture::GptOss => (0..n_layers).map(|i| has_window && i % 2 == 0).collect(),
        Architecture::Mistral | Architecture::Phi3 | Architecture::Mixtral => vec![has_window; n_layers],
        Architecture::SmolLm3 => vec![has_window && cfg.use_sliding_window.unwrap_or(false); n_layers],
        Architecture::Llama
        | Architecture::Olmo2
        | Architecture::Granite
        | Architecture::GptNeoX
        | Architecture::Gpt2
        | Architecture::Olmoe
        | Architecture::GraniteMoe => {
            vec![false; n_layers]
        }
    })
}

/// Picks the architecture from `model_type`.
fn architecture(model_type: &str) -> Result<Architecture> {
    Ok(match model_type {
        "llama" => Architecture::Llama,
        "mistral" => Architecture::Mistral,
        "qwen2" => Architecture::Qwen2,
        "qwen3" => Architecture::Qwen3,
        "gemma3_text" | "gemma3" => Architecture::Gemma3,
        "phi3" => Architecture::Phi3,
        "gemma2" => Architecture::Gemma2,
        "olmo2" => Architecture::Olmo2,
        "smollm3" => Architecture::SmolLm3,
        "granite" => Architecture::Granite,
        "gpt_neox" => Architecture::GptNeoX,
        "gpt2" => Architecture::Gpt2,
        "qwen3_moe" => Architecture::Qwen3Moe,
        "mixtral" => Architecture::Mixtral,
        "olmoe" => Architecture::Olmoe,
        // Granite MoE with a shared expert (`shared_intermediate_size`): the same decoder.
        "granitemoe" | "granitemoeshared" => Architecture::GraniteMoe,
        "gpt_oss" => Architecture::GptOss,
        "qwen2_moe" => Architecture::Qwen2Moe,
        other => return Err(Architecture::unsupported(other, false)),
    })
}

/// Which layers rotate q and k: all, except SmolLM3's `no_rope_layers` (or every
/// `no_rope_layer_interval`-th layer, transformers' default when the list is absent) and GPT-2's.
fn rope_layers(cfg: &HfConfig, arch: Architecture, n_layers: usize, source: &str) -> Result<Vec<bool>> {
    match arch {
        Architecture::Gpt2 => Ok(vec![false; n_layers]),
        Architecture::SmolLm3 => match &cfg.no_rope_layers {
            Some(flags) if flags.len() != n_layers => Err(invalid(
                source,
                "no_rope_layers",
                format!("has {} entries for {n_layers} layers (`num_hidden_layers`)", flags.len()),
            )),
            Some(flags) => Ok(flags.iter().map(|&f| f != 0).collect()),
            None => {
                let every = cfg.no_rope_layer_interval.unwrap_or(4);
                if every == 0 {
                    return Err(invalid(source, "no_rope_layer_interval", "an interval of 0 layers"));
                }
                Ok((0..n_layers).map(|i| (i + 1) % every != 0).collect())
            }
        },
        _ => Ok(vec![true; n_layers]),
    }
}

/// The mixture of experts of a MoE architecture (`None` for the dense ones).
fn moe_config(
    cfg: &HfConfig,
    arch: Architecture,
    n_layers: usize,
    intermediate: Option<usize>,
    source: &str,
) -> Result<Option<MoeConfig>> {
    // transformers' defaults where a key is absent.
    let (experts_key, default_k) = match arch {
        Architecture::Qwen3Moe => ("num_experts", 8),
        Architecture::Qwen2Moe => ("num_experts", 4),
        Architecture::Olmoe => ("num_experts", 8),
        Architecture::Mixtral | Architecture::GraniteMoe => ("num_local_experts", 2),
        Architecture::GptOss => ("num_local_experts", 4),
        _ => return Ok(None),
    };
    let shared_expert = match (arch, cfg.shared_expert_intermediate_size, cfg.shared_intermediate_size) {
        (Architecture::Qwen2Moe, n, _) => Some(SharedExpert {
            intermediate_size: required(n, source, "shared_expert_intermediate_size")?,
            gated: true,
        }),
        // `granitemoeshared`; a width of 0 is transformers' "no shared expert".
        (Architecture::GraniteMoe, _, Some(n)) if n > 0 => Some(SharedExpert { intermediate_size: n, gated: false }),
        (_, Some(n), _) | (_, _, Some(n)) if n > 0 => {
            return Err(CandleError::UnsupportedConfig {
                what: format!("shared experts in a `{}` checkpoint", arch.name()),
            })
        }
        _ => None,
    };
    let num_experts = required(cfg.num_experts.or(cfg.num_local_experts), source, experts_key)?;
    let expert_intermediate_size = match arch {
        Architecture::Qwen3Moe | Architecture::Qwen2Moe => {
            required(cfg.moe_intermediate_size, source, "moe_intermediate_size")?
        }
        _ => required(intermediate, source, "intermediate_size")?,
    };
    let sparse_layers = match arch {
        // Qwen2/3-MoE: every `decoder_sparse_step`-th layer, except `mlp_only_layers`.
        Architecture::Qwen3Moe | Architecture::Qwen2Moe => {
            let step = cfg.decoder_sparse_step.unwrap_or(1);
            if step == 0 {
                return Err(invalid(source, "decoder_sparse_step", "a step of 0 layers"));
            }
            let dense = cfg.mlp_only_layers.clone().unwrap_or_default();
            if let Some(&bad) = dense.iter().find(|&&i| i >= n_layers) {
                return Err(invalid(source, "mlp_only_layers", format!("layer {bad} of {n_layers}")));
            }
            (0..n_layers).map(|i| !dense.contains(&i) && (i + 1) % step == 0).collect()
        }
        _ => vec![true; n_layers],
    };
    Ok(Some(MoeConfig {
        num_experts,
        experts_per_token: cfg.num_experts_per_tok.unwrap_or(default_k),
        expert_intermediate_size,
        routing: match arch {
            Architecture::Mixtral => Routing::SoftmaxTopK { renormalize: true },
            Architecture::GraniteMoe | Architecture::GptOss => Routing::TopKSoftmax,
            _ => Routing::SoftmaxTopK { renormalize: cfg.norm_topk_prob.unwrap_or(false) },
        },
        router_bias: arch == Architecture::GptOss,
        expert_bias: arch == Architecture::GptOss,
        glu: if arch == Architecture::GptOss {
            ExpertGlu::ClampedSwiGlu {
                alpha: cfg.swiglu_alpha.unwrap_or(1.702),
                limit: cfg.swiglu_limit.unwrap_or(7.0),
            }
        } else {
            ExpertGlu::Gated
        },
        sparse_layers,
        shared_expert,
    }))
}

/// Parses a `config.json` document.
pub fn parse_config(text: &str, path: &str) -> Result<ArchConfig> {
    let malformed = |reason: String| CandleError::Malformed { what: "config.json", path: path.to_owned(), reason };
    let root: Value = serde_json::from_str(text).map_err(|e| malformed(e.to_string()))?;
    let Value::Object(mut map) = root else {
        return Err(malformed("not an object".into()));
    };
    let model_type = match map.get("model_type") {
        Some(Value::String(s)) => s.clone(),
        Some(other) => return Err(invalid(path, "model_type", format!("expected a string, got {other}"))),
        None => return Err(malformed("no `model_type`".into())),
    };
    // LLaVA, Idefics3 and SmolVLM wrap a language model of another family: their text_config
    // names it (Llama by default).
    let model_type = match model_type.as_str() {
        "llava" | "idefics3" | "smolvlm" => map
            .get("text_config")
            .and_then(|t| t.get("model_type"))
            .and_then(Value::as_str)
            .unwrap_or("llama")
            .to_owned(),
        _ => model_type,
    };
    let arch = architecture(&model_type)?;
    // Multimodal Gemma 3 checkpoints nest the language model's config.
    match map.get("text_config").cloned() {
        Some(Value::Object(text_cfg)) => map.extend(text_cfg),
        Some(Value::Null) | None => {}
        Some(other) => return Err(invalid(path, "text_config", format!("expected an object, got {other}"))),
    }
    let cfg: HfConfig = typed(&map, path, "")?;
    let hidden = required(cfg.hidden_size, path, "hidden_size")?;
    let heads = required(cfg.num_attention_heads, path, "num_attention_heads")?;
    let n_layers = required(cfg.num_hidden_layers, path, "num_hidden_layers")?;
    check_layer_count(n_layers, path, "num_hidden_layers")?;
    if heads == 0 {
        return Err(invalid(path, "num_attention_heads", "must be positive"));
    }
    let kv_heads = cfg.num_key_value_heads.unwrap_or(heads);
    let head_dim = cfg.head_dim.unwrap_or(hidden / heads);
    let gemma = matches!(arch, Architecture::Gemma2 | Architecture::Gemma3);
    // GPT-2 and GPT-NeoX: LayerNorm, biases on every projection, an ungated MLP.
    let gpt = matches!(arch, Architecture::Gpt2 | Architecture::GptNeoX);
    let (full_rope, sliding_rope) = rope_by_layer_type(&cfg, arch, path)?;
    let rotates = rope_layers(&cfg, arch, n_layers, path)?;
    let bidirectional = cfg.use_bidirectional_attention.unwrap_or(false);
    let layers = sliding_layers(&cfg, arch, n_layers, path)?
        .into_iter()
        .zip(rotates)
        .map(|(sliding, rotates)| {
            Ok(if sliding {
                let w = cfg.sliding_window.ok_or_else(|| invalid(path, "sliding_window", "sliding layers need one"))?;
                // Transformers' Gemma 3 halves a bidirectional window (each side sees w / 2).
                let w = if bidirectional { w / 2 + 1 } else { w };
                LayerConfig { sliding_window: Some(w), rope: rotates.then_some(sliding_rope) }
            } else {
                LayerConfig { sliding_window: None, rope: rotates.then_some(full_rope) }
            })
        })
        .collect::<Result<Vec<_>>>()?;
    let partial_rotary_factor = cfg
        .partial_rotary_factor
        .or_else(|| match &cfg.rope_parameters {
            Some(p) if !p.contains_key("full_attention") => {
                typed::<RopeParams>(p, path, "rope_parameters.").ok().and_then(|r| r.partial_rotary_factor)
            }
            _ => None,
        })
        .unwrap_or(1.0);
    let (act_key, act_name) = match (&cfg.hidden_activation, &cfg.hidden_act) {
        (Some(a), _) => ("hidden_activation", a.as_str()),
        (None, Some(a)) => ("hidden_act", a.as_str()),
        (None, None) => (
            "hidden_act",
            match arch {
                _ if gemma => "gelu_pytorch_tanh",
                Architecture::Gpt2 => "gelu_new",
                Architecture::GptNeoX => "gelu",
                _ => "silu",
            },
        ),
    };
    let activation = match act_name {
        "silu" | "swish" => Activation::Silu,
        "gelu_pytorch_tanh" | "gelu_new" | "gelu_fast" => Activation::GeluTanh,
        "gelu" => Activation::Gelu,
        "relu" => Activation::Relu,
        other => return Err(CandleError::UnsupportedConfig { what: format!("activation `{other}` (`{act_key}`)") }),
    };
    // GPT-NeoX's query_key_value and dense carry biases unless `attention_bias` says otherwise.
    let attention_bias = cfg.attention_bias.unwrap_or(gpt);
    let attn_scale = match arch {
        _ if gemma => cfg.query_pre_attn_scalar.unwrap_or(head_dim as f64).powf(-0.5),
        Architecture::Granite | Architecture::GraniteMoe => {
            cfg.attention_multiplier.unwrap_or((head_dim as f64).powf(-0.5))
        }
        Architecture::Gpt2 if !cfg.scale_attn_weights.unwrap_or(true) => 1.0,
        _ => (head_dim as f64).powf(-0.5),
    };
    let granite = matches!(arch, Architecture::Granite | Architecture::GraniteMoe);
    // Qwen2's and Qwen2-MoE's attention: biases on q, k and v (unless Qwen2-MoE's `qkv_bias` says
    // otherwise), none on the output.
    let qwen2 = matches!(arch, Architecture::Qwen2 | Architecture::Qwen2Moe);
    let qwen2_qkv_bias = qwen2 && cfg.qkv_bias.unwrap_or(true);
    let moe = moe_config(&cfg, arch, n_layers, cfg.intermediate_size, path)?;
    if let Some(c) = cfg.clip_qkv {
        return Err(CandleError::UnsupportedConfig { what: format!("`clip_qkv` {c} (q, k, v clipping)") });
    }
    let intermediate_size = match (cfg.intermediate_size, arch) {
        (Some(n), _) => n,
        // GPT-2's `n_inner: null` means four times the width.
        (None, Architecture::Gpt2) => 4 * hidden,
        (None, _) => required(None, path, "intermediate_size")?,
    };
    let config = ArchConfig {
        architecture: arch,
        vocab_size: required(cfg.vocab_size, path, "vocab_size")?,
        hidden_size: hidden,
        intermediate_size,
        num_heads: heads,
        num_kv_heads: kv_heads,
        head_dim,
        layers,
        rms_norm_eps: match gpt {
            true => cfg.layer_norm_eps.unwrap_or(1e-5),
            false => cfg.rms_norm_eps.unwrap_or(1e-6),
        },
        norm_kind: if gpt { NormKind::Layer } else { NormKind::Rms },
        block_norms: match arch {
            _ if gemma => BlockNorms::Sandwich,
            Architecture::Olmo2 => BlockNorms::Post,
            _ => BlockNorms::Pre,
        },
        parallel_residual: arch == Architecture::GptNeoX && cfg.use_parallel_residual.unwrap_or(true),
        learned_positions: arch == Architecture::Gpt2,
        max_position_embeddings: cfg.max_position_embeddings.unwrap_or(4096),
        tie_word_embeddings: cfg.tie_word_embeddings.unwrap_or(gemma || arch == Architecture::Gpt2),
        partial_rotary_factor,
        rope_interleaved: false,
        qkv_bias: qwen2_qkv_bias || attention_bias,
        o_bias: attention_bias && !qwen2,
        mlp_bias: cfg.mlp_bias.unwrap_or(gpt),
        mlp_gated: !gpt,
        qk_norm: match arch {
            Architecture::Qwen3 | Architecture::Gemma3 | Architecture::Qwen3Moe => QkNorm::PerHead,
            Architecture::Olmo2 | Architecture::Olmoe => QkNorm::Whole,
            _ => QkNorm::None,
        },
        norm_weight_offset: gemma,
        embed_scale: gemma.then(|| (hidden as f64).sqrt()),
        embed_multiplier: cfg.embedding_multiplier.filter(|_| granite),
        residual_multiplier: cfg.residual_multiplier.filter(|_| granite),
        logits_divisor: cfg.logits_scaling.filter(|_| granite),
        activation,
        attn_scale,
        attn_scale_by_layer: arch == Architecture::Gpt2 && cfg.scale_attn_by_inverse_layer_idx.unwrap_or(false),
        attn_softcap: cfg.attn_logit_softcapping,
        final_softcap: cfg.final_logit_softcapping,
        eos_token_ids: cfg.eos_token_id.map(TokenIds::into_vec).unwrap_or_default(),
        bos_token_id: cfg.bos_token_id.and_then(|ids| ids.into_vec().first().copied()),
        moe,
        attn_sinks: arch == Architecture::GptOss,
        bidirectional,
        embedding_pooling: None,
    };
    // GPT-2 and GPT-NeoX name their norms' epsilon after LayerNorm.
    let experts_key = if cfg.num_experts.is_some() { "num_experts" } else { "num_local_experts" };
    config.validate(path, &|name| match name {
        "rms_norm_eps" if gpt => "layer_norm_eps".to_owned(),
        "num_experts" => experts_key.to_owned(),
        "moe_intermediate_size" if !matches!(arch, Architecture::Qwen3Moe | Architecture::Qwen2Moe) => {
            "intermediate_size".to_owned()
        }
        other => other.to_owned(),
    })?;
    Ok(config)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unknown_model_type_is_unsupported() {
        let err = parse_config(r#"{"model_type": "mamba"}"#, "x").unwrap_err();
        assert!(matches!(err, CandleError::UnsupportedArchitecture { ref name, .. } if name == "mamba"));
        let message = err.to_string();
        assert!(message.contains("config.json: llama, mistral") && message.contains("qwen2_moe"), "{message}");
    }

    const LLAMA: &str = r#"{"model_type":"llama","hidden_size":64,"num_attention_heads":4,"num_key_value_heads":2,
        "num_hidden_layers":2,"intermediate_size":128,"vocab_size":10,"eos_token_id":2}"#;

    /// LLAMA with `key` set to the JSON `value`.
    fn with(key: &str, value: &str) -> Result<ArchConfig> {
        let mut cfg: Json = serde_json::from_str(LLAMA).unwrap();
        cfg.insert(key.into(), serde_json::from_str(value).unwrap());
        parse_config(&serde_json::to_string(&cfg).unwrap(), "config.json")
    }

    fn err_of(key: &str, value: &str) -> String {
        with(key, value).unwrap_err().to_string()
    }

    #[test]
    fn wrong_types_and_ranges_name_the_field() {
        for (key, value) in [
            ("max_position_embeddings", "-1"),
            ("hidden_act", "3"),
            ("tie_word_embeddings", "\"yes\""),
            ("eos_token_id", "-1"),
            ("eos_token_id", "4294967298"),
            ("bos_token_id", "[1, -2]"),
            ("rms_norm_eps", "-1.0"),
            ("num_hidden_layers", "10000000000"),
            ("head_dim", "1000000000000"),
            ("partial_rotary_factor", "0.0"),
            ("partial_rotary_factor", "2147483648"),
            ("attn_logit_softcapping", "1e308"),
        ] {
            let msg = err_of(key, value);
            assert!(msg.contains(key), "{key}={value}: {msg}");
        }
        assert!(err_of("rope_parameters", r#"{"rope_theta": 0.0}"#).contains("rope_theta"));
        assert!(err_of("rope_theta", "-1.0").contains("rope_theta"));
        assert!(err_of("rope_scaling", r#"{"type": "linear", "factor": 0.0}"#).contains("rope_scaling.factor"));
    }

    #[test]
    fn absent_or_null_optional_fields_take_defaults() {
        let cfg = with("sliding_window", "null").unwrap();
        assert_eq!(cfg.max_position_embeddings, 4096);
        assert_eq!(cfg.head_dim, 16);
        assert_eq!(cfg.eos_token_ids, vec![2]);
        assert_eq!(with("eos_token_id", "[1, 2]").unwrap().eos_token_ids, vec![1, 2]);
    }

    #[test]
    fn gemma_window_and_pattern_of_zero_are_errors() {
        let gemma = r#"{"model_type":"gemma3_text","hidden_size":64,"num_attention_heads":4,"num_key_value_heads":1,
                "num_hidden_layers":6,"intermediate_size":128,"vocab_size":10,"head_dim":16,"sliding_window":512,
                "sliding_window_pattern":0}"#;
        assert!(parse_config(gemma, "x").unwrap_err().to_string().contains("sliding_window_pattern"));
        let gemma = gemma.replace(r#""sliding_window_pattern":0"#, r#""sliding_window":0"#);
        assert!(parse_config(&gemma, "x").unwrap_err().to_string().contains("sliding_window"));
    }

    #[test]
    fn legacy_gemma3_keys_give_per_layer_rope_and_windows() {
        let cfg = parse_config(
            r#"{"model_type":"gemma3_text","hidden_size":64,"num_attention_heads":4,"num_key_value_heads":1,
                "num_hidden_layers":6,"intermediate_size":128,"vocab_size":10,"head_dim":16,"sliding_window":512,
                "rope_theta":1000000.0,"rope_local_base_freq":10000.0,"sliding_window_pattern":6,
                "query_pre_attn_scalar":256}"#,
            "x",
        )
        .unwrap();
        assert_eq!(cfg.layers[0].sliding_window, Some(512));
        assert_eq!(cfg.layers[0].rope.unwrap().theta, 10000.0);
        assert_eq!(cfg.layers[5].sliding_window, None);
        assert_eq!(cfg.layers[5].rope.unwrap().theta, 1_000_000.0);
        assert!((cfg.attn_scale - 1.0 / 16.0).abs() < 1e-12);
    }

    #[test]
    fn gpt2_keys_and_variants() {
        let cfg = parse_config(
            r#"{"model_type":"gpt2","n_embd":96,"n_layer":2,"n_head":6,"n_inner":null,"n_positions":512,
                "vocab_size":10,"activation_function":"relu","scale_attn_by_inverse_layer_idx":true,
                "layer_norm_epsilon":1e-5}"#,
            "x",
        )
        .unwrap();
        assert_eq!((cfg.hidden_size, cfg.head_dim, cfg.intermediate_size), (96, 16, 384));
        assert_eq!(cfg.activation, Activation::Relu);
        assert!(cfg.attn_scale_by_layer && cfg.learned_positions && cfg.tie_word_embeddings);
        assert!(cfg.layers.iter().all(|l| l.rope.is_none()));
        assert_eq!((cfg.norm_kind, cfg.mlp_gated, cfg.qkv_bias, cfg.mlp_bias), (NormKind::Layer, false, true, true));
    }

    #[test]
    fn neox_serial_and_legacy_rotary_keys() {
        let cfg = parse_config(
            r#"{"model_type":"gpt_neox","hidden_size":64,"num_hidden_layers":3,"num_attention_heads":4,
                "intermediate_size":128,"vocab_size":10,"use_parallel_residual":false,"hidden_act":"gelu_new",
                "rotary_pct":0.5,"rotary_emb_base":500.0}"#,
            "x",
        )
        .unwrap();
        assert!(!cfg.parallel_residual);
        assert_eq!((cfg.rotary_dim(), cfg.activation), (8, Activation::GeluTanh));
        assert_eq!(cfg.layers[0].rope.unwrap().theta, 500.0);
        assert!(cfg.o_bias && !cfg.tie_word_embeddings);
    }

    #[test]
    fn smollm3_rope_layers_from_the_list_or_the_interval() {
        let base = r#"{"model_type":"smollm3","hidden_size":64,"num_attention_heads":4,"num_hidden_layers":8,
                "intermediate_size":128,"vocab_size":10"#;
        let cfg = parse_config(&format!("{base}}}"), "x").unwrap();
        let rotating: Vec<bool> = cfg.layers.iter().map(|l| l.rope.is_some()).collect();
        assert_eq!(rotating, [true, true, true, false, true, true, true, false]);
        let err = parse_config(&format!(r#"{base},"no_rope_layers":[1,0]}}"#), "x").unwrap_err();
        assert!(err.to_string().contains("no_rope_layers"), "{err}");
    }

    #[test]
    fn gemma2_without_layer_types_slides_on_even_layers() {
        let cfg = parse_config(
            r#"{"model_type":"gemma2","hidden_size":64,"num_attention_heads":4,"num_key_value_heads":2,
                "num_hidden_layers":4,"intermediate_size":128,"vocab_size":10,"head_dim":32,"sliding_window":6,
                "query_pre_attn_scalar":64,"attn_logit_softcapping":50.0}"#,
            "x",
        )
        .unwrap();
        let windows: Vec<_> = cfg.layers.iter().map(|l| l.sliding_window).collect();
        assert_eq!(windows, [Some(6), None, Some(6), None]);
        assert_eq!((cfg.block_norms, cfg.qk_norm, cfg.attn_scale), (BlockNorms::Sandwich, QkNorm::None, 0.125));
        assert_eq!(cfg.attn_softcap, Some(50.0));
    }

    #[test]
    fn granite_multipliers_are_read_and_checked() {
        let base = r#"{"model_type":"granite","hidden_size":64,"num_attention_heads":4,"num_hidden_layers":2,
                "intermediate_size":128,"vocab_size":10,"embedding_multiplier":12.0,"attention_multiplier":0.0625,
                "logits_scaling":2.0"#;
        let cfg = parse_config(&format!(r#"{base},"residual_multiplier":0.22}}"#), "x").unwrap();
        assert_eq!(
            (cfg.embed_multiplier, cfg.residual_multiplier, cfg.logits_divisor),
            (Some(12.0), Some(0.22), Some(2.0))
        );
        assert_eq!(cfg.attn_scale, 0.0625);
        let err = parse_config(&format!(r#"{base},"residual_multiplier":-1.0}}"#), "x").unwrap_err();
        assert!(err.to_string().contains("residual_multiplier"), "{err}");
    }

    #[test]
    fn moe_layers_routing_and_yarn() {
        let base = r#"{"model_type":"qwen3_moe","hidden_size":64,"num_attention_heads":4,"num_hidden_layers":4,
                "intermediate_size":128,"moe_intermediate_size":32,"vocab_size":10,"num_experts":6,
                "num_experts_per_tok":2,"norm_topk_prob":true"#;
        let cfg = parse_config(&format!(r#"{base},"decoder_sparse_step":2,"mlp_only_layers":[3]}}"#), "x").unwrap();
        let moe = cfg.moe.as_ref().unwrap();
        assert_eq!(moe.sparse_layers, [false, true, false, false]);
        assert_eq!((moe.expert_intermediate_size, moe.routing), (32, Routing::SoftmaxTopK { renormalize: true }));
        let err = parse_config(
            &format!(r#"{base},"num_experts_per_tok":7}}"#).replace(r#""num_experts_per_tok":2,"#, ""),
            "x",
        )
        .unwrap_err();
        assert!(err.to_string().contains("num_experts_per_tok"), "{err}");
        let err = parse_config(&format!(r#"{base},"mlp_only_layers":[9]}}"#), "x").unwrap_err();
        assert!(err.to_string().contains("mlp_only_layers"), "{err}");
        let oss = parse_config(
            r#"{"model_type":"gpt_oss","hidden_size":64,"num_attention_heads":4,"num_hidden_layers":2,
                "intermediate_size":48,"vocab_size":10,"num_local_experts":4,"num_experts_per_tok":2,"head_dim":16,
                "sliding_window":6,"swiglu_limit":1.0,"attention_bias":true,
                "rope_parameters":{"rope_type":"yarn","factor":4.0,"original_max_position_embeddings":64,
                                   "rope_theta":150000.0,"truncate":false}}"#,
            "x",
        )
        .unwrap();
        assert!(oss.attn_sinks && oss.qkv_bias && oss.o_bias);
        assert_eq!(oss.layers[0].sliding_window, Some(6));
        assert_eq!(oss.layers[1].sliding_window, None);
        let moe = oss.moe.unwrap();
        assert_eq!(
            (moe.routing, moe.router_bias, moe.glu),
            (Routing::TopKSoftmax, true, ExpertGlu::ClampedSwiGlu { alpha: 1.702, limit: 1.0 })
        );
        match oss.layers[0].rope.unwrap().scaling {
            RopeScaling::Yarn { factor, original_max_position_embeddings, truncate, attention_factor, .. } => {
                assert_eq!((factor, original_max_position_embeddings, truncate), (4.0, 64.0, false));
                assert!((attention_factor - (0.1 * 4f64.ln() + 1.0)).abs() < 1e-12);
            }
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn shared_experts_of_qwen2_moe_and_granite_moe_shared() {
        let qwen = r#"{"model_type":"qwen2_moe","hidden_size":64,"num_attention_heads":4,"num_hidden_layers":2,
                "intermediate_size":128,"moe_intermediate_size":32,"vocab_size":10,"num_experts":4,
                "num_experts_per_tok":2,"shared_expert_intermediate_size":96"#;
        let cfg = parse_config(&format!("{qwen}}}"), "x").unwrap();
        assert!(cfg.qkv_bias && !cfg.o_bias);
        let moe = cfg.moe.unwrap();
        assert_eq!(moe.shared_expert, Some(SharedExpert { intermediate_size: 96, gated: true }));
        assert_eq!(moe.routing, Routing::SoftmaxTopK { renormalize: false });
        assert!(!parse_config(&format!(r#"{qwen},"qkv_bias":false}}"#), "x").unwrap().qkv_bias);
        let granite = r#"{"model_type":"granitemoeshared","hidden_size":64,"num_attention_heads":4,
                "num_hidden_layers":2,"intermediate_size":128,"vocab_size":10,"num_local_experts":4,
                "num_experts_per_tok":2,"shared_intermediate_size""#;
        let cfg = parse_config(&format!("{granite}:96}}"), "x").unwrap();
        assert_eq!(cfg.architecture, Architecture::GraniteMoe);
        assert_eq!(cfg.moe.unwrap().shared_expert, Some(SharedExpert { intermediate_size: 96, gated: false }));
        // transformers' "none": a width of 0.
        assert_eq!(parse_config(&format!("{granite}:0}}"), "x").unwrap().moe.unwrap().shared_expert, None);
        // A shared expert the architecture's decoder does not have.
        let mixtral = r#"{"model_type":"mixtral","hidden_size":64,"num_attention_heads":4,"num_hidden_layers":2,
                "intermediate_size":128,"vocab_size":10,"num_local_experts":4,"shared_expert_intermediate_size":8}"#;
        let err = parse_config(mixtral, "x").unwrap_err().to_string();
        assert!(err.contains("shared experts") && err.contains("mixtral"), "{err}");
    }
}
