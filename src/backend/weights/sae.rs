//! Sparse autoencoders as published (DESIGN §15): SAELens (`cfg.json` + `sae_weights.safetensors`),
//! Gemma Scope (`params.npz`) and EleutherAI's sparsify (`cfg.json` + `sae.safetensors`), read
//! into one description with the point each was trained on, in our names.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use candle_core::{DType, Device, Tensor};

pub use crate::backend::error::SaeError;
use crate::core::{LayerPoint, Point};

/// How an SAE turns pre-activations into features.
#[derive(Debug, Clone)]
pub enum SaeEncoder {
    /// `relu(pre)` (SAELens `standard`).
    Relu,
    /// `relu(pre) · [pre > threshold]`, one threshold per feature `[d_sae]`.
    JumpRelu(Tensor),
    /// The `k` largest pre-activations of each position, ReLU'd; the rest 0.
    TopK(usize),
    /// SAELens `gated`: `[x W_enc + b_gate > 0] · relu(x (W_enc · exp(r_mag)) + b_mag)`.
    Gated {
        /// `b_gate` `[d_sae]`.
        b_gate: Tensor,
        /// `W_enc · exp(r_mag)` `[d_in, d_sae]`.
        w_mag: Tensor,
        /// `b_mag` `[d_sae]`.
        b_mag: Tensor,
    },
}

/// How the input is normalised before encoding (and the reconstruction scaled back).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SaeNorm {
    /// No normalisation (`none`, and `expected_average_only_in`, whose factor SAELens folds into
    /// the weights when it saves).
    None,
    /// Each position scaled to norm `sqrt(d_in)` (`constant_norm_rescale`).
    ConstantNorm,
    /// Each position's mean removed and divided by its standard deviation (`layer_norm`).
    LayerNorm,
}

/// An SAE as read from disk: float32 weights on the host and the point it reads, if named.
#[derive(Debug, Clone)]
pub struct SaeWeights {
    /// The file or directory read.
    pub path: PathBuf,
    /// Which format it was (`saelens`, `gemma-scope`, `sparsify`).
    pub format: &'static str,
    /// The hook as the file names it, and that hook in our names.
    pub hook: Option<(String, Point)>,
    /// `[d_in, d_sae]`.
    pub w_enc: Tensor,
    /// `[d_sae]`.
    pub b_enc: Tensor,
    /// `[d_sae, d_in]`.
    pub w_dec: Tensor,
    /// `[d_in]`.
    pub b_dec: Tensor,
    /// The activation.
    pub encoder: SaeEncoder,
    /// Whether `b_dec` is subtracted from the input before encoding.
    pub apply_b_dec_to_input: bool,
    /// The input normalisation.
    pub norm: SaeNorm,
}

impl SaeWeights {
    /// The input width.
    pub fn d_in(&self) -> usize {
        self.w_enc.dims()[0]
    }

    /// The number of features.
    pub fn d_sae(&self) -> usize {
        self.w_enc.dims()[1]
    }
}

/// Maps a TransformerLens / SAELens hook name to our point (`blocks.6.hook_resid_post` →
/// `model.layers.6.output`); sparsify's module names (`layers.6`, `layers.6.mlp`) too.
pub fn point_of_hook(hook: &str) -> Option<Point> {
    let (layer, rest) = if let Some(r) = hook.strip_prefix("blocks.") {
        r.split_once('.')?
    } else {
        let r = hook.strip_prefix("model.").unwrap_or(hook).strip_prefix("layers.")?;
        match r.split_once('.') {
            Some(p) => p,
            None => (r, ""),
        }
    };
    let layer: usize = layer.parse().ok()?;
    let p = match rest {
        "hook_resid_pre" => LayerPoint::Input,
        "hook_resid_post" | "" => LayerPoint::Output,
        "hook_mlp_out" | "mlp" => LayerPoint::MlpOutput,
        "hook_attn_out" | "self_attn" => LayerPoint::AttentionOutput,
        "attn.hook_z" | "hook_z" => LayerPoint::AttentionHeads,
        _ => return None,
    };
    Some(Point::Layer(layer, p))
}

/// Reads the SAE at `path` (a directory, or a file inside one); `point` is the caller's point,
/// which must agree with the file's hook where it names one.
pub fn load_sae(path: &Path, point: Option<Point>) -> Result<SaeWeights, SaeError> {
    let dir = if path.is_dir() { path.to_path_buf() } else { path.parent().unwrap_or(Path::new(".")).to_path_buf() };
    let not_found = || SaeError::NotFound { path: path.display().to_string() };
    let mut sae = if path.is_file() && path.extension().is_some_and(|e| e == "npz") {
        gemma_scope(path)?
    } else if dir.join("params.npz").is_file() {
        gemma_scope(&dir.join("params.npz"))?
    } else if dir.join("cfg.json").is_file() && dir.join("sae_weights.safetensors").is_file() {
        saelens(&dir)?
    } else if dir.join("cfg.json").is_file() && dir.join("sae.safetensors").is_file() {
        sparsify(&dir)?
    } else {
        return Err(not_found());
    };
    let shown = sae.path.display().to_string();
    match (&sae.hook, point) {
        (Some((hook, file_point)), Some(given)) if *file_point != given => {
            return Err(SaeError::PointMismatch {
                path: shown,
                given: given.to_string(),
                hook: hook.clone(),
                file_point: file_point.to_string(),
            })
        }
        (None, None) => return Err(SaeError::NeedsPoint { path: shown }),
        (None, Some(given)) => sae.hook = Some((given.to_string(), given)),
        _ => {}
    }
    Ok(sae)
}

fn malformed(path: &Path, reason: impl Into<String>) -> SaeError {
    SaeError::Malformed { path: path.display().to_string(), reason: reason.into() }
}

fn read_cfg(path: &Path) -> Result<serde_json::Value, SaeError> {
    let text = std::fs::read_to_string(path).map_err(|e| malformed(path, e.to_string()))?;
    serde_json::from_str(&text).map_err(|e| malformed(path, format!("not JSON: {e}")))
}

fn read_safetensors(path: &Path) -> Result<HashMap<String, Tensor>, SaeError> {
    candle_core::safetensors::load(path, &Device::Cpu).map_err(|e| malformed(path, e.to_string()))
}

/// Takes `name` from `tensors` as float32 of `shape`.
fn take(tensors: &mut HashMap<String, Tensor>, path: &Path, name: &str, shape: &[usize]) -> Result<Tensor, SaeError> {
    let t = tensors.remove(name).ok_or_else(|| malformed(path, format!("tensor `{name}` is missing")))?;
    if t.dims() != shape {
        return Err(malformed(path, format!("tensor `{name}` has shape {:?}, expected {shape:?}", t.dims())));
    }
    t.to_dtype(DType::F32).map_err(|e| malformed(path, format!("tensor `{name}`: {e}")))
}

/// `[d_in, d_sae]` from `W_enc`'s shape.
fn widths(tensors: &HashMap<String, Tensor>, path: &Path, name: &str) -> Result<(usize, usize), SaeError> {
    match tensors.get(name).map(|t| t.dims().to_vec()).as_deref() {
        Some(&[a, b]) => Ok((a, b)),
        Some(other) => Err(malformed(path, format!("tensor `{name}` has shape {other:?}, expected 2 dimensions"))),
        None => Err(malformed(path, format!("tensor `{name}` is missing"))),
    }
}

fn saelens(dir: &Path) -> Result<SaeWeights, SaeError> {
    let cfg_path = dir.join("cfg.json");
    let cfg = read_cfg(&cfg_path)?;
    let path = dir.join("sae_weights.safetensors");
    let mut t = read_safetensors(&path)?;
    let (d_in, d_sae) = widths(&t, &path, "W_enc")?;
    for (key, want) in [("d_in", d_in), ("d_sae", d_sae)] {
        if let Some(v) = cfg.get(key).and_then(|v| v.as_u64()) {
            if v as usize != want {
                return Err(malformed(&cfg_path, format!("{key} is {v} but W_enc is {d_in}x{d_sae}")));
            }
        }
    }
    let arch = cfg.get("architecture").and_then(|v| v.as_str()).unwrap_or("standard");
    let unsupported = |what: String| SaeError::Unsupported { path: cfg_path.display().to_string(), what };
    let encoder = match arch {
        "standard" => SaeEncoder::Relu,
        "jumprelu" => SaeEncoder::JumpRelu(take(&mut t, &path, "threshold", &[d_sae])?),
        "topk" => {
            let k = cfg
                .get("k")
                .or_else(|| cfg.get("activation_fn_kwargs").and_then(|a| a.get("k")))
                .and_then(|v| v.as_u64())
                .ok_or_else(|| malformed(&cfg_path, "a topk SAE needs `k`"))?;
            SaeEncoder::TopK(k as usize)
        }
        "gated" => {
            let w_enc = take(&mut t, &path, "W_enc", &[d_in, d_sae])?;
            let r_mag = take(&mut t, &path, "r_mag", &[d_sae])?;
            let w_mag =
                r_mag.exp().and_then(|e| w_enc.broadcast_mul(&e)).map_err(|e| malformed(&path, e.to_string()))?;
            t.insert("W_enc".into(), w_enc);
            SaeEncoder::Gated {
                b_gate: take(&mut t, &path, "b_gate", &[d_sae])?,
                w_mag,
                b_mag: take(&mut t, &path, "b_mag", &[d_sae])?,
            }
        }
        other => return Err(unsupported(format!("architecture `{other}`"))),
    };
    let norm = match cfg.get("normalize_activations").and_then(|v| v.as_str()).unwrap_or("none") {
        "none" | "expected_average_only_in" => SaeNorm::None,
        "constant_norm_rescale" => SaeNorm::ConstantNorm,
        "layer_norm" => SaeNorm::LayerNorm,
        other => return Err(unsupported(format!("normalize_activations `{other}`"))),
    };
    let hook = match cfg.get("hook_name").and_then(|v| v.as_str()) {
        Some(h) => Some((
            h.to_string(),
            point_of_hook(h)
                .ok_or_else(|| SaeError::UnknownHook { path: cfg_path.display().to_string(), hook: h.to_string() })?,
        )),
        None => None,
    };
    // SAELens's gated SAEs have no b_enc (the gate and magnitude biases stand for it).
    let b_enc = match &encoder {
        SaeEncoder::Gated { b_mag, .. } => b_mag.clone(),
        _ => take(&mut t, &path, "b_enc", &[d_sae])?,
    };
    Ok(SaeWeights {
        path: dir.to_path_buf(),
        format: "saelens",
        hook,
        w_enc: take(&mut t, &path, "W_enc", &[d_in, d_sae])?,
        b_enc,
        w_dec: take(&mut t, &path, "W_dec", &[d_sae, d_in])?,
        b_dec: take(&mut t, &path, "b_dec", &[d_in])?,
        encoder,
        apply_b_dec_to_input: cfg.get("apply_b_dec_to_input").and_then(|v| v.as_bool()).unwrap_or(false),
        norm,
    })
}

fn gemma_scope(path: &Path) -> Result<SaeWeights, SaeError> {
    let mut t: HashMap<String, Tensor> =
        Tensor::read_npz(path).map_err(|e| malformed(path, e.to_string()))?.into_iter().collect();
    let (d_in, d_sae) = widths(&t, path, "W_enc")?;
    Ok(SaeWeights {
        path: path.to_path_buf(),
        format: "gemma-scope",
        hook: None,
        encoder: SaeEncoder::JumpRelu(take(&mut t, path, "threshold", &[d_sae])?),
        w_enc: take(&mut t, path, "W_enc", &[d_in, d_sae])?,
        b_enc: take(&mut t, path, "b_enc", &[d_sae])?,
        w_dec: take(&mut t, path, "W_dec", &[d_sae, d_in])?,
        b_dec: take(&mut t, path, "b_dec", &[d_in])?,
        apply_b_dec_to_input: false,
        norm: SaeNorm::None,
    })
}

fn sparsify(dir: &Path) -> Result<SaeWeights, SaeError> {
    let cfg_path = dir.join("cfg.json");
    let cfg = read_cfg(&cfg_path)?;
    let path = dir.join("sae.safetensors");
    let unsupported = |what: &str| SaeError::Unsupported { path: cfg_path.display().to_string(), what: what.into() };
    if cfg.get("transcode").and_then(|v| v.as_bool()).unwrap_or(false) {
        return Err(unsupported("a transcoder (transcode: true)"));
    }
    if cfg.get("skip_connection").and_then(|v| v.as_bool()).unwrap_or(false) {
        return Err(unsupported("skip_connection"));
    }
    let activation = cfg.get("activation").and_then(|v| v.as_str()).unwrap_or("topk");
    if activation != "topk" {
        return Err(unsupported(&format!("activation `{activation}`")));
    }
    let k = cfg.get("k").and_then(|v| v.as_u64()).ok_or_else(|| malformed(&cfg_path, "`k` is missing"))? as usize;
    let mut t = read_safetensors(&path)?;
    let (d_sae, d_in) = widths(&t, &path, "encoder.weight")?;
    let enc = take(&mut t, &path, "encoder.weight", &[d_sae, d_in])?;
    let w_enc = enc.t().and_then(|e| e.contiguous()).map_err(|e| malformed(&path, e.to_string()))?;
    // sparsify saves one directory per hookpoint, named after the module (`layers.6`).
    let name = dir.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
    let hook = point_of_hook(&name).map(|p| (name, p));
    Ok(SaeWeights {
        path: dir.to_path_buf(),
        format: "sparsify",
        hook,
        w_enc,
        b_enc: take(&mut t, &path, "encoder.bias", &[d_sae])?,
        w_dec: take(&mut t, &path, "W_dec", &[d_sae, d_in])?,
        b_dec: take(&mut t, &path, "b_dec", &[d_in])?,
        encoder: SaeEncoder::TopK(k),
        apply_b_dec_to_input: true,
        norm: SaeNorm::None,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hooks_map_to_our_points() {
        let l = |i, p| Some(Point::Layer(i, p));
        assert_eq!(point_of_hook("blocks.3.hook_resid_pre"), l(3, LayerPoint::Input));
        assert_eq!(point_of_hook("blocks.3.hook_resid_post"), l(3, LayerPoint::Output));
        assert_eq!(point_of_hook("blocks.0.hook_mlp_out"), l(0, LayerPoint::MlpOutput));
        assert_eq!(point_of_hook("blocks.1.hook_attn_out"), l(1, LayerPoint::AttentionOutput));
        assert_eq!(point_of_hook("blocks.1.attn.hook_z"), l(1, LayerPoint::AttentionHeads));
        assert_eq!(point_of_hook("layers.4"), l(4, LayerPoint::Output));
        assert_eq!(point_of_hook("layers.4.mlp"), l(4, LayerPoint::MlpOutput));
        assert_eq!(point_of_hook("blocks.1.hook_resid_mid"), None);
        assert_eq!(point_of_hook("embed"), None);
    }
}
