//! Control vectors in llama.cpp's GGUF format (architecture `controlvector`, one `direction.{n}`
//! tensor per layer, as written by llama.cpp's cvector tools and by repeng), turned into
//! interventions with llama.cpp's semantics.
//!
//! llama.cpp (common.cpp, llama-adapter.cpp) stores `direction.{n}` (n ≥ 1) for layer n and adds
//! it, times the scale, to that layer's output (the residual stream leaving layer n); layer 0 is
//! never steered. `--control-vector-layer-range START END` keeps layers START..=END, and the
//! default range is 1..=n_layer.

use std::collections::BTreeMap;
use std::path::Path;

use candle_core::quantized::gguf_file::{self, Value};
use candle_core::quantized::{GgmlDType, QTensor};
use candle_core::{Device, Tensor};

use crate::core::{EditOp, Intervention};

/// Why a control vector cannot be read, written or applied.
#[derive(Debug, thiserror::Error)]
pub enum ControlVectorError {
    /// The file could not be opened or written.
    #[error("control vector {path}: {source}")]
    Io {
        /// The file.
        path: String,
        /// The OS error.
        #[source]
        source: std::io::Error,
    },
    /// The file is not a well-formed control vector.
    #[error("control vector {path}: {reason}")]
    Malformed {
        /// The file.
        path: String,
        /// What is wrong.
        reason: String,
    },
    /// The vector was made for a model of another hidden size.
    #[error("control vector {path}: `{tensor}` has {got} values but this model's hidden size is {hidden}")]
    WrongModel {
        /// The file.
        path: String,
        /// The offending tensor.
        tensor: String,
        /// Its length.
        got: usize,
        /// The model's hidden size.
        hidden: usize,
    },
}

/// Reads `path` and returns one `add` on `model.layers.{n}.output` per direction inside the
/// (inclusive) `layer_range`, each scaled by `scale`.
pub fn load(
    path: &Path,
    scale: f32,
    layer_range: Option<(usize, usize)>,
    hidden: usize,
    num_layers: usize,
) -> Result<Vec<Intervention>, ControlVectorError> {
    let p = path.display().to_string();
    let malformed = |reason: String| ControlVectorError::Malformed { path: p.clone(), reason };
    let mut file = std::fs::File::open(path).map_err(|source| ControlVectorError::Io { path: p.clone(), source })?;
    let content = gguf_file::Content::read(&mut file).map_err(|e| malformed(format!("not a GGUF file: {e}")))?;
    if let Some(arch) = content.metadata.get("general.architecture") {
        if arch.to_string().ok().map(String::as_str) != Some("controlvector") {
            return Err(malformed("general.architecture is not `controlvector`".into()));
        }
    }
    let (start, end) = layer_range.unwrap_or((1, num_layers));
    let mut by_layer = BTreeMap::new();
    for (name, info) in &content.tensor_infos {
        let Some(n) = name.strip_prefix("direction.") else { continue };
        let layer: usize = n.parse().map_err(|_| malformed(format!("tensor `{name}` has no layer number")))?;
        if layer == 0 {
            return Err(malformed("`direction.0` is not a layer llama.cpp steers (layers count from 1)".into()));
        }
        let got = info.shape.elem_count();
        if got != hidden {
            return Err(ControlVectorError::WrongModel { path: p.clone(), tensor: name.clone(), got, hidden });
        }
        if layer < start || layer > end || layer >= num_layers {
            continue;
        }
        let t = info
            .read(&mut file, content.tensor_data_offset, &Device::Cpu)
            .and_then(|q| q.dequantize(&Device::Cpu))
            .and_then(|t| t.flatten_all())
            .and_then(|t| t.to_vec1::<f32>())
            .map_err(|e| malformed(format!("cannot read `{name}`: {e}")))?;
        by_layer.insert(layer, t);
    }
    if by_layer.is_empty() && content.tensor_infos.keys().all(|k| !k.starts_with("direction.")) {
        return Err(malformed("no `direction.{n}` tensor".into()));
    }
    Ok(by_layer
        .into_iter()
        .map(|(layer, vector)| Intervention {
            point: format!("model.layers.{layer}.output"),
            op: EditOp::Add { vector, scale },
            positions: None,
        })
        .collect())
}

/// Writes `directions` (layer → vector, layers counting from 1) as a control vector llama.cpp loads.
pub fn save(path: &Path, directions: &BTreeMap<usize, Vec<f32>>, model_hint: &str) -> Result<(), ControlVectorError> {
    let p = path.display().to_string();
    let malformed = |reason: String| ControlVectorError::Malformed { path: p.clone(), reason };
    if directions.contains_key(&0) {
        return Err(malformed("layer 0 cannot be steered (llama.cpp's layers count from 1)".into()));
    }
    let mut tensors = Vec::new();
    for (layer, v) in directions {
        let t = Tensor::from_slice(v, v.len(), &Device::Cpu).and_then(|t| QTensor::quantize(&t, GgmlDType::F32));
        tensors.push((format!("direction.{layer}"), t.map_err(|e| malformed(e.to_string()))?));
    }
    let metadata = [
        ("general.architecture", Value::String("controlvector".into())),
        ("controlvector.model_hint", Value::String(model_hint.into())),
        ("controlvector.layer_count", Value::U32(directions.len() as u32)),
    ];
    let mut file = std::fs::File::create(path).map_err(|source| ControlVectorError::Io { path: p.clone(), source })?;
    let md: Vec<(&str, &Value)> = metadata.iter().map(|(k, v)| (*k, v)).collect();
    let ts: Vec<(&str, &QTensor)> = tensors.iter().map(|(k, t)| (k.as_str(), t)).collect();
    gguf_file::write(&mut file, &md, &ts).map_err(|e| malformed(format!("cannot write: {e}")))
}
