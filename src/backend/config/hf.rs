//! `config.json` of a Hugging Face checkpoint to an `ArchConfig`.

use serde_json::{Map, Value};

use super::{Activation, ArchConfig, Architecture, LayerConfig, RopeConfig, RopeScaling};
use crate::backend::error::{CandleError, Result};

type Json = Map<String, Value>;

fn unsupported(what: impl Into<String>) -> CandleError {
    CandleError::UnsupportedConfig { what: what.into() }
}

fn usize_key(cfg: &Json, key: &str) -> Result<usize> {
    cfg.get(key)
        .and_then(Value::as_u64)
        .map(|v| v as usize)
        .ok_or_else(|| unsupported(format!("config.json lacks a positive integer `{key}`")))
}

fn opt_usize(cfg: &Json, key: &str) -> Option<usize> {
    cfg.get(key).and_then(Value::as_u64).map(|v| v as usize)
}

fn opt_f64(cfg: &Json, key: &str) -> Option<f64> {
    cfg.get(key).and_then(Value::as_f64)
}

fn opt_bool(cfg: &Json, key: &str) -> Option<bool> {
    cfg.get(key).and_then(Value::as_bool)
}

fn token_ids(v: Option<&Value>) -> Vec<u32> {
    match v {
        Some(Value::Number(n)) => n.as_u64().map(|x| vec![x as u32]).unwrap_or_default(),
        Some(Value::Array(a)) => a.iter().filter_map(Value::as_u64).map(|x| x as u32).collect(),
        _ => Vec::new(),
    }
}

/// Reads one rope description: `rope_theta` plus a `rope_type`/`type` and its factors.
fn parse_rope(params: &Json, default_theta: f64) -> Result<RopeConfig> {
    let theta = opt_f64(params, "rope_theta").unwrap_or(default_theta);
    let kind = params.get("rope_type").or_else(|| params.get("type")).and_then(Value::as_str).unwrap_or("default");
    let factor =
        || opt_f64(params, "factor").ok_or_else(|| unsupported(format!("rope scaling `{kind}` without a `factor`")));
    let scaling = match kind {
        "default" => RopeScaling::None,
        "linear" => RopeScaling::Linear { factor: factor()? },
        "llama3" => RopeScaling::Llama3 {
            factor: factor()?,
            low_freq_factor: opt_f64(params, "low_freq_factor").unwrap_or(1.0),
            high_freq_factor: opt_f64(params, "high_freq_factor").unwrap_or(4.0),
            original_max_position_embeddings: opt_f64(params, "original_max_position_embeddings").unwrap_or(8192.0),
        },
        other => return Err(unsupported(format!("rope scaling type `{other}`"))),
    };
    Ok(RopeConfig { theta, scaling })
}

/// The rope of each layer type (`full_attention`, `sliding_attention`), from either config style.
fn rope_by_layer_type(cfg: &Json, arch: Architecture) -> Result<(RopeConfig, RopeConfig)> {
    let theta = opt_f64(cfg, "rope_theta").unwrap_or(10_000.0);
    if let Some(Value::Object(params)) = cfg.get("rope_parameters") {
        // transformers 5: either one flat description or one per layer type.
        if let (Some(Value::Object(full)), sliding) = (params.get("full_attention"), params.get("sliding_attention")) {
            let full = parse_rope(full, theta)?;
            let sliding = match sliding {
                Some(Value::Object(s)) => parse_rope(s, theta)?,
                _ => full,
            };
            return Ok((full, sliding));
        }
        let rope = parse_rope(params, theta)?;
        return Ok((rope, rope));
    }
    let full = match cfg.get("rope_scaling") {
        Some(Value::Object(s)) => parse_rope(s, theta)?,
        _ => RopeConfig { theta, scaling: RopeScaling::None },
    };
    let sliding = if arch == Architecture::Gemma3 {
        RopeConfig { theta: opt_f64(cfg, "rope_local_base_freq").unwrap_or(10_000.0), scaling: RopeScaling::None }
    } else {
        full
    };
    Ok((full, sliding))
}

/// Which layers use sliding-window attention, from `layer_types` or the older per-family keys.
fn sliding_layers(cfg: &Json, arch: Architecture, n_layers: usize) -> Result<Vec<bool>> {
    if let Some(Value::Array(types)) = cfg.get("layer_types") {
        if types.len() != n_layers {
            return Err(unsupported(format!("`layer_types` has {} entries for {n_layers} layers", types.len())));
        }
        return types
            .iter()
            .map(|t| match t.as_str() {
                Some("sliding_attention") => Ok(true),
                Some("full_attention") => Ok(false),
                other => Err(unsupported(format!("layer type {other:?}"))),
            })
            .collect();
    }
    let has_window = cfg.get("sliding_window").is_some_and(|v| !v.is_null());
    Ok(match arch {
        Architecture::Gemma3 => {
            let pattern = opt_usize(cfg, "sliding_window_pattern")
                .or_else(|| opt_usize(cfg, "_sliding_window_pattern"))
                .unwrap_or(6);
            (0..n_layers).map(|i| (i + 1) % pattern != 0).collect()
        }
        Architecture::Qwen2 | Architecture::Qwen3 => {
            let on = has_window && opt_bool(cfg, "use_sliding_window").unwrap_or(false);
            let from = opt_usize(cfg, "max_window_layers").unwrap_or(n_layers);
            (0..n_layers).map(|i| on && i >= from).collect()
        }
        Architecture::Mistral | Architecture::Phi3 => vec![has_window; n_layers],
        Architecture::Llama => vec![false; n_layers],
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
        other => return Err(CandleError::UnsupportedArchitecture { name: other.to_owned() }),
    })
}

/// Parses a `config.json` document.
pub fn parse_config(text: &str, path: &str) -> Result<ArchConfig> {
    let root: Value = serde_json::from_str(text).map_err(|e| CandleError::Malformed {
        what: "config.json",
        path: path.to_owned(),
        reason: e.to_string(),
    })?;
    let Value::Object(mut cfg) = root else {
        return Err(CandleError::Malformed { what: "config.json", path: path.into(), reason: "not an object".into() });
    };
    let model_type = cfg
        .get("model_type")
        .and_then(Value::as_str)
        .ok_or_else(|| CandleError::Malformed {
            what: "config.json",
            path: path.into(),
            reason: "no `model_type`".into(),
        })?
        .to_owned();
    let arch = architecture(&model_type)?;
    // Multimodal Gemma 3 checkpoints nest the language model's config.
    if let Some(Value::Object(text_cfg)) = cfg.get("text_config").cloned() {
        for (k, v) in text_cfg {
            cfg.insert(k, v);
        }
    }
    let hidden = usize_key(&cfg, "hidden_size")?;
    let heads = usize_key(&cfg, "num_attention_heads")?;
    let n_layers = usize_key(&cfg, "num_hidden_layers")?;
    if heads == 0 || hidden == 0 || n_layers == 0 {
        return Err(unsupported("zero hidden size, heads or layers"));
    }
    let kv_heads = opt_usize(&cfg, "num_key_value_heads").unwrap_or(heads);
    if kv_heads == 0 || heads % kv_heads != 0 {
        return Err(unsupported(format!("{heads} query heads cannot be grouped over {kv_heads} key/value heads")));
    }
    let head_dim = opt_usize(&cfg, "head_dim").unwrap_or(hidden / heads);
    let gemma = arch == Architecture::Gemma3;
    let (full_rope, sliding_rope) = rope_by_layer_type(&cfg, arch)?;
    let window = opt_usize(&cfg, "sliding_window");
    let layers = sliding_layers(&cfg, arch, n_layers)?
        .into_iter()
        .map(|sliding| {
            Ok(if sliding {
                let w = window.ok_or_else(|| unsupported("sliding layers without a `sliding_window`"))?;
                LayerConfig { sliding_window: Some(w), rope: sliding_rope }
            } else {
                LayerConfig { sliding_window: None, rope: full_rope }
            })
        })
        .collect::<Result<Vec<_>>>()?;
    let partial_rotary_factor = opt_f64(&cfg, "partial_rotary_factor")
        .or_else(|| cfg.get("rope_parameters").and_then(|p| p.get("partial_rotary_factor")).and_then(Value::as_f64))
        .unwrap_or(1.0);
    let act_name = cfg
        .get("hidden_activation")
        .or_else(|| cfg.get("hidden_act"))
        .and_then(Value::as_str)
        .unwrap_or(if gemma { "gelu_pytorch_tanh" } else { "silu" });
    let activation = match act_name {
        "silu" | "swish" => Activation::Silu,
        "gelu_pytorch_tanh" | "gelu_new" | "gelu_fast" => Activation::GeluTanh,
        "gelu" => Activation::Gelu,
        other => return Err(unsupported(format!("activation `{other}`"))),
    };
    let attention_bias = opt_bool(&cfg, "attention_bias").unwrap_or(false);
    let attn_scale = if gemma {
        opt_f64(&cfg, "query_pre_attn_scalar").unwrap_or(head_dim as f64).powf(-0.5)
    } else {
        (head_dim as f64).powf(-0.5)
    };
    Ok(ArchConfig {
        architecture: arch,
        vocab_size: usize_key(&cfg, "vocab_size")?,
        hidden_size: hidden,
        intermediate_size: usize_key(&cfg, "intermediate_size")?,
        num_heads: heads,
        num_kv_heads: kv_heads,
        head_dim,
        layers,
        rms_norm_eps: opt_f64(&cfg, "rms_norm_eps").unwrap_or(1e-6),
        max_position_embeddings: opt_usize(&cfg, "max_position_embeddings").unwrap_or(4096),
        tie_word_embeddings: opt_bool(&cfg, "tie_word_embeddings").unwrap_or(gemma),
        partial_rotary_factor,
        rope_interleaved: false,
        qkv_bias: arch == Architecture::Qwen2 || attention_bias,
        o_bias: attention_bias && arch != Architecture::Qwen2,
        mlp_bias: opt_bool(&cfg, "mlp_bias").unwrap_or(false),
        qk_norm: matches!(arch, Architecture::Qwen3 | Architecture::Gemma3),
        norm_weight_offset: gemma,
        sandwich_norms: gemma,
        embed_scale: gemma.then(|| (hidden as f64).sqrt()),
        activation,
        attn_scale,
        attn_softcap: opt_f64(&cfg, "attn_logit_softcapping"),
        final_softcap: opt_f64(&cfg, "final_logit_softcapping"),
        eos_token_ids: token_ids(cfg.get("eos_token_id")),
        bos_token_id: token_ids(cfg.get("bos_token_id")).first().copied(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unknown_model_type_is_unsupported() {
        let err = parse_config(r#"{"model_type": "gpt_neox"}"#, "x").unwrap_err();
        assert!(matches!(err, CandleError::UnsupportedArchitecture { ref name } if name == "gpt_neox"));
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
        assert_eq!(cfg.layers[0].rope.theta, 10000.0);
        assert_eq!(cfg.layers[5].sliding_window, None);
        assert_eq!(cfg.layers[5].rope.theta, 1_000_000.0);
        assert!((cfg.attn_scale - 1.0 / 16.0).abs() < 1e-12);
    }
}
