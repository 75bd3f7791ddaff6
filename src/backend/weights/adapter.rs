//! LoRA adapters as published (DESIGN §16): PEFT directories (`adapter_config.json` +
//! `adapter_model.safetensors`), mlx-lm's (`adapter_config.json` + `adapters.safetensors`) and
//! llama.cpp's GGUF LoRA (`general.type = adapter`, as written by
//! `convert_lora_to_gguf.py`), read into one list of `(module, A, B, scale)` in the file's naming.
//! Fitting them to a model's linears is `blocks::lora::Adapter::prepare`.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use candle_core::quantized::gguf_file;
use candle_core::{DType, Device, Tensor};

pub use crate::backend::error::AdapterError;
use crate::backend::weights::names::Naming;

/// One adapted linear: `y += scale · B (A x)`.
#[derive(Debug, Clone)]
pub struct AdapterModule {
    /// The linear's name stem in the file's naming (`model.layers.0.self_attn.q_proj`,
    /// `blk.0.attn_q`, `lm_head`, `output`).
    pub module: String,
    /// `A` `[r, in]`, float32 on the host.
    pub a: Tensor,
    /// `B` `[out, r]`, float32 on the host.
    pub b: Tensor,
    /// `alpha / r`, or `alpha / √r` with rsLoRA.
    pub scale: f64,
}

/// An adapter as read from disk.
#[derive(Debug, Clone)]
pub struct AdapterWeights {
    /// The file or directory read.
    pub path: PathBuf,
    /// Which format it was (`peft`, `mlx`, `gguf`).
    pub format: &'static str,
    /// How its module names are spelled.
    pub naming: Naming,
    /// The adapted linears, in name order.
    pub modules: Vec<AdapterModule>,
}

impl AdapterWeights {
    /// Reads a PEFT directory (or its `adapter_model.safetensors`) or a GGUF LoRA file.
    pub fn read(path: &Path) -> Result<Self, AdapterError> {
        let p = path.display().to_string();
        if path.is_dir() {
            let config = path.join("adapter_config.json");
            let weights = path.join("adapter_model.safetensors");
            if config.is_file() && weights.is_file() {
                return read_peft(path, &config, &weights);
            }
            if config.is_file() && path.join("adapters.safetensors").is_file() {
                return read_mlx(path, &config, &path.join("adapters.safetensors"));
            }
            if config.is_file() && path.join("adapter_model.bin").is_file() {
                return Err(AdapterError::Unsupported {
                    path: p,
                    what: "adapter_model.bin (a pickle); save the adapter with safe_serialization=True".into(),
                });
            }
            return Err(AdapterError::NotFound { path: p });
        }
        if !path.is_file() {
            return Err(AdapterError::NotFound { path: p });
        }
        if path.file_name().is_some_and(|n| n == "adapter_model.safetensors") {
            let dir = path.parent().unwrap_or(Path::new("."));
            return read_peft(dir, &dir.join("adapter_config.json"), path);
        }
        if path.file_name().is_some_and(|n| n == "adapters.safetensors") {
            let dir = path.parent().unwrap_or(Path::new("."));
            return read_mlx(dir, &dir.join("adapter_config.json"), path);
        }
        let mut magic = [0u8; 4];
        let mut file = std::fs::File::open(path).map_err(|e| malformed(path, e.to_string()))?;
        std::io::Read::read_exact(&mut file, &mut magic).map_err(|_| AdapterError::NotFound { path: p.clone() })?;
        if &magic == b"GGUF" {
            return read_gguf(path);
        }
        Err(AdapterError::NotFound { path: p })
    }
}

fn malformed(path: &Path, reason: String) -> AdapterError {
    AdapterError::Malformed { path: path.display().to_string(), reason }
}

fn unsupported(path: &Path, what: impl Into<String>) -> AdapterError {
    AdapterError::Unsupported { path: path.display().to_string(), what: what.into() }
}

/// The factors read so far, by module name: `(A, B)`, each format's loader filling them in
/// whatever order its file holds them.
#[derive(Default)]
struct FactorPairs(BTreeMap<String, (Option<Tensor>, Option<Tensor>)>);

impl FactorPairs {
    /// Records `t` as `module`'s A (`is_a`) or B factor.
    fn insert(&mut self, module: String, is_a: bool, t: Tensor) {
        let slot = self.0.entry(module).or_default();
        if is_a {
            slot.0 = Some(t);
        } else {
            slot.1 = Some(t);
        }
    }

    /// The adapted modules in name order, each scaled by `scale(module, A)`; a module with only
    /// one factor, or none at all, is a malformed `path`. `factors` spells the two as the format
    /// does (`lora_A`, `lora_B`), for the errors.
    fn into_modules(
        self,
        path: &Path,
        factors: (&str, &str),
        mut scale: impl FnMut(&str, &Tensor) -> f64,
    ) -> Result<Vec<AdapterModule>, AdapterError> {
        let (fa, fb) = factors;
        let mut modules = Vec::with_capacity(self.0.len());
        for (module, (a, b)) in self.0 {
            let (Some(a), Some(b)) = (a, b) else {
                return Err(malformed(path, format!("`{module}` has only one of {fa} and {fb}")));
            };
            let scale = scale(&module, &a);
            modules.push(AdapterModule { module, a, b, scale });
        }
        if modules.is_empty() {
            return Err(malformed(path, format!("no {fa} / {fb} tensors")));
        }
        Ok(modules)
    }
}

/// The value of the first pattern of `patterns` that names `module` (PEFT matches a key as the
/// module name's trailing dotted segments: `q_proj`, `layers.0.self_attn.q_proj`).
fn pattern_value(patterns: &serde_json::Map<String, serde_json::Value>, module: &str) -> Option<f64> {
    patterns.iter().find_map(|(key, value)| {
        let hit = module == key || module.ends_with(&format!(".{key}"));
        if hit {
            value.as_f64()
        } else {
            None
        }
    })
}

/// A PEFT LoRA directory.
fn read_peft(dir: &Path, config_path: &Path, weights: &Path) -> Result<AdapterWeights, AdapterError> {
    let text = std::fs::read_to_string(config_path).map_err(|e| malformed(config_path, e.to_string()))?;
    let config: serde_json::Value = serde_json::from_str(&text).map_err(|e| malformed(config_path, e.to_string()))?;
    let field = |k: &str| config.get(k).filter(|v| !v.is_null());
    if let Some(kind) = field("peft_type").and_then(|v| v.as_str()) {
        if kind != "LORA" {
            return Err(unsupported(dir, format!("peft_type {kind} (only LORA)")));
        }
    }
    if field("use_dora").and_then(|v| v.as_bool()) == Some(true) {
        return Err(unsupported(dir, "DoRA (use_dora = true)"));
    }
    if field("modules_to_save").and_then(|v| v.as_array()).is_some_and(|a| !a.is_empty()) {
        return Err(unsupported(dir, "modules_to_save (whole modules trained beside the adapter)"));
    }
    if let Some(bias) = field("bias").and_then(|v| v.as_str()) {
        if bias != "none" {
            return Err(unsupported(dir, format!("bias = {bias} (trained biases)")));
        }
    }
    let r = field("r").and_then(|v| v.as_f64()).ok_or_else(|| malformed(config_path, "no `r`".into()))?;
    let alpha = field("lora_alpha").and_then(|v| v.as_f64()).unwrap_or(8.0);
    let rslora = field("use_rslora").and_then(|v| v.as_bool()).unwrap_or(false);
    let empty = serde_json::Map::new();
    let rank_pattern = field("rank_pattern").and_then(|v| v.as_object()).unwrap_or(&empty);
    let alpha_pattern = field("alpha_pattern").and_then(|v| v.as_object()).unwrap_or(&empty);

    let tensors =
        candle_core::safetensors::load(weights, &Device::Cpu).map_err(|e| malformed(weights, e.to_string()))?;
    let mut pairs = FactorPairs::default();
    for (key, t) in tensors {
        let name = key.strip_prefix("base_model.model.").unwrap_or(&key);
        let name = name.replace(".default.", ".");
        // An embedding's factors are `lora_embedding_A` [r, vocab] and `_B` [hidden, r]: the
        // orientation of a linear's with the one-hot token as input.
        let name = name.strip_suffix(".weight").filter(|n| n.contains(".lora_embedding_")).unwrap_or(&name);
        let (module, is_a) = if let Some(m) = name.strip_suffix(".lora_A.weight") {
            (m.to_owned(), true)
        } else if let Some(m) = name.strip_suffix(".lora_B.weight") {
            (m.to_owned(), false)
        } else if let Some(m) = name.strip_suffix(".lora_embedding_A") {
            (m.to_owned(), true)
        } else if let Some(m) = name.strip_suffix(".lora_embedding_B") {
            (m.to_owned(), false)
        } else if name.contains("lora_magnitude_vector") {
            return Err(unsupported(dir, "DoRA (lora_magnitude_vector)"));
        } else if name.ends_with(".lora_B.bias") {
            return Err(unsupported(dir, format!("LoRA biases (`{key}`)")));
        } else {
            return Err(unsupported(dir, format!("tensor `{key}` (not a lora_A / lora_B factor)")));
        };
        let t = t.to_dtype(DType::F32).map_err(|e| malformed(weights, e.to_string()))?;
        pairs.insert(module, is_a, t);
    }
    let modules = pairs.into_modules(weights, ("lora_A", "lora_B"), |module, _a| {
        let r_m = pattern_value(rank_pattern, module).unwrap_or(r);
        let alpha_m = pattern_value(alpha_pattern, module).unwrap_or(alpha);
        if rslora {
            alpha_m / r_m.sqrt()
        } else {
            alpha_m / r_m
        }
    })?;
    Ok(AdapterWeights { path: dir.to_path_buf(), format: "peft", naming: Naming::HuggingFace, modules })
}

/// An mlx-lm LoRA directory (`mlx_lm.lora`'s output): `adapters.safetensors` holding
/// `{module}.lora_a` `[in, r]` and `.lora_b` `[r, out]` (PEFT's factors transposed), and
/// `adapter_config.json`, whose `lora_parameters.scale` multiplies the product as it is
/// (mlx-lm computes `y + scale · (x a) b`; there is no alpha).
fn read_mlx(dir: &Path, config_path: &Path, weights: &Path) -> Result<AdapterWeights, AdapterError> {
    let text = std::fs::read_to_string(config_path).map_err(|e| malformed(config_path, e.to_string()))?;
    let config: serde_json::Value = serde_json::from_str(&text).map_err(|e| malformed(config_path, e.to_string()))?;
    match config.get("fine_tune_type").and_then(|v| v.as_str()).unwrap_or("lora") {
        "lora" => {}
        "dora" => return Err(unsupported(dir, "DoRA (fine_tune_type = dora)")),
        other => return Err(unsupported(dir, format!("fine_tune_type {other} (only lora)"))),
    }
    let params = config.get("lora_parameters").filter(|v| v.is_object());
    let scale = params.and_then(|p| p.get("scale")).and_then(|v| v.as_f64()).unwrap_or(20.0);
    if !scale.is_finite() {
        return Err(malformed(config_path, format!("lora_parameters.scale {scale} is not finite")));
    }
    let tensors =
        candle_core::safetensors::load(weights, &Device::Cpu).map_err(|e| malformed(weights, e.to_string()))?;
    let mut pairs = FactorPairs::default();
    for (key, t) in tensors {
        let (module, is_a) = if let Some(m) = key.strip_suffix(".lora_a") {
            (m.to_owned(), true)
        } else if let Some(m) = key.strip_suffix(".lora_b") {
            (m.to_owned(), false)
        } else {
            return Err(unsupported(dir, format!("tensor `{key}` (not a lora_a / lora_b factor)")));
        };
        if t.rank() != 2 {
            return Err(unsupported(dir, format!("`{key}` of shape {:?} (per-expert factors)", t.dims())));
        }
        let t =
            t.to_dtype(DType::F32).and_then(|t| t.t()?.contiguous()).map_err(|e| malformed(weights, e.to_string()))?;
        pairs.insert(module, is_a, t);
    }
    let modules = pairs.into_modules(weights, ("lora_a", "lora_b"), |_, _| scale)?;
    Ok(AdapterWeights { path: dir.to_path_buf(), format: "mlx", naming: Naming::HuggingFace, modules })
}

/// A llama.cpp GGUF LoRA: `{stem}.weight.lora_a` `[r, in]` and `.lora_b` `[out, r]`, scaled by
/// `adapter.lora.alpha / r` as llama.cpp does (no alpha: 1).
fn read_gguf(path: &Path) -> Result<AdapterWeights, AdapterError> {
    let mut file = std::fs::File::open(path).map_err(|e| malformed(path, e.to_string()))?;
    let content = gguf_file::Content::read(&mut file).map_err(|e| malformed(path, format!("not a GGUF file: {e}")))?;
    let text = |k: &str| content.metadata.get(k).and_then(|v| v.to_string().ok()).cloned();
    if text("general.type").as_deref() != Some("adapter") {
        return Err(malformed(path, "general.type is not `adapter` (a model, not an adapter?)".into()));
    }
    if let Some(kind) = text("adapter.type") {
        if kind != "lora" {
            return Err(unsupported(path, format!("adapter.type {kind} (only lora)")));
        }
    }
    let alpha = content.metadata.get("adapter.lora.alpha").and_then(|v| v.to_f32().ok()).unwrap_or(0.0) as f64;
    let mut pairs = FactorPairs::default();
    for (name, info) in &content.tensor_infos {
        let (module, is_a) = if let Some(m) = name.strip_suffix(".weight.lora_a") {
            (m, true)
        } else if let Some(m) = name.strip_suffix(".weight.lora_b") {
            (m, false)
        } else {
            return Err(unsupported(path, format!("tensor `{name}` (not a lora_a / lora_b factor)")));
        };
        let t = info
            .read(&mut file, content.tensor_data_offset, &Device::Cpu)
            .and_then(|q| q.dequantize(&Device::Cpu))
            .map_err(|e| malformed(path, format!("cannot read `{name}`: {e}")))?;
        pairs.insert(module.to_owned(), is_a, t);
    }
    let modules = pairs.into_modules(path, ("lora_a", "lora_b"), |_module, a| {
        let rank = a.dims().first().copied().unwrap_or(1).max(1) as f64;
        if alpha != 0.0 {
            alpha / rank
        } else {
            1.0
        }
    })?;
    Ok(AdapterWeights { path: path.to_path_buf(), format: "gguf", naming: Naming::Gguf, modules })
}
