//! Quantization at load: a dense checkpoint's matmul weights become the block types GGUF files
//! store, so they run through the same kernels (and the same inspection and edits) as a GGUF.
//!
//! Which tensor gets which type follows llama.cpp's `llama-quantize` (src/llama-quant.cpp) for a
//! single-type request: every projection gets the requested type; the output projection (and the
//! token embedding when the two are tied) gets Q6_K, or Q8_0 when Q8_0 was asked for or its rows
//! do not fit the requested type's block; an untied token embedding gets the requested type;
//! norms and biases stay float32. A row length that is not a multiple of a type's block falls
//! back as llama.cpp does (Q2_K/Q3_K → Q4_0, Q4_K → Q5_0, Q5_K → Q5_1, Q6_K → Q8_0); one that fits
//! no fallback either stays dense (llama.cpp writes F16 there; we keep the model's dtype).
//! llama.cpp's per-layer mixes (the `_M` / `_S` variants) are not applied: `q4_k` means Q4_K.

use std::collections::BTreeMap;

use candle_core::quantized::{ggml_file, GgmlDType, QTensor};
use candle_core::{DType, Device, Tensor};
use rayon::prelude::*;

use crate::backend::error::{CandleContext, CandleError, Result};
use crate::backend::weights::embedding::ggml_name;

/// The types `quantize=` accepts, by the names llama.cpp gives them.
pub const ACCEPTED: [(&str, GgmlDType); 10] = [
    ("q4_0", GgmlDType::Q4_0),
    ("q4_1", GgmlDType::Q4_1),
    ("q5_0", GgmlDType::Q5_0),
    ("q5_1", GgmlDType::Q5_1),
    ("q8_0", GgmlDType::Q8_0),
    ("q2_k", GgmlDType::Q2K),
    ("q3_k", GgmlDType::Q3K),
    ("q4_k", GgmlDType::Q4K),
    ("q5_k", GgmlDType::Q5K),
    ("q6_k", GgmlDType::Q6K),
];

/// Parses a `quantize=` value (`q8_0`, `Q4_K`, ...), refusing anything else with the accepted list.
pub fn parse_quantize(s: &str) -> Result<GgmlDType> {
    let wanted = s.trim().to_ascii_lowercase();
    ACCEPTED.iter().find(|(name, _)| *name == wanted).map(|(_, t)| *t).ok_or_else(|| CandleError::InvalidOption {
        argument: "quantize",
        value: s.to_owned(),
        accepted: ACCEPTED.iter().map(|(n, _)| *n).collect::<Vec<_>>().join(", "),
    })
}

/// What a weight is to the model, which decides its type as llama.cpp's quantizer does.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WeightRole {
    /// A projection inside a block (attention or MLP).
    Projection,
    /// The output projection (`lm_head`, GGUF `output`).
    Output,
    /// The token embedding; `tied` when it is also the output projection.
    TokenEmbedding {
        /// Whether the output projection is this table.
        tied: bool,
    },
}

/// The type a weight gets, or why it stays dense.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Decision {
    /// Quantize to `dtype`; `note` says why it is not the requested type, when it is not.
    Quantize {
        /// The block type.
        dtype: GgmlDType,
        /// Why another type than requested (the output rule, or a fallback for the row length).
        note: Option<String>,
    },
    /// Keep the weight dense.
    Dense {
        /// Why.
        reason: String,
    },
}

/// The type llama.cpp's quantizer gives a weight of `role` with rows of `cols` values when `base` is asked for.
pub fn decide(base: GgmlDType, role: WeightRole, cols: usize) -> Decision {
    let output_like = matches!(role, WeightRole::Output | WeightRole::TokenEmbedding { tied: true });
    let (target, mut note) = if output_like {
        // llama.cpp keeps the output projection at 6+ bits whatever the rest gets.
        let t = if base == GgmlDType::Q8_0 || !cols.is_multiple_of(base.block_size()) {
            GgmlDType::Q8_0
        } else {
            GgmlDType::Q6K
        };
        let note = (t != base).then(|| format!("output projection: {} as llama.cpp quantizes it", ggml_name(t)));
        (t, note)
    } else {
        (base, None)
    };
    if cols.is_multiple_of(target.block_size()) {
        return Decision::Quantize { dtype: target, note };
    }
    let fallback = match target {
        GgmlDType::Q2K | GgmlDType::Q3K => Some(GgmlDType::Q4_0),
        GgmlDType::Q4K => Some(GgmlDType::Q5_0),
        GgmlDType::Q5K => Some(GgmlDType::Q5_1),
        GgmlDType::Q6K => Some(GgmlDType::Q8_0),
        _ => None,
    };
    let why =
        format!("rows of {cols} values are not a multiple of {}'s block of {}", ggml_name(target), target.block_size());
    match fallback {
        Some(f) if cols.is_multiple_of(f.block_size()) => {
            note = Some(format!("{} ({why})", ggml_name(f)));
            Decision::Quantize { dtype: f, note }
        }
        _ => Decision::Dense { reason: why },
    }
}

/// Rows quantized per parallel task: large enough to amortise the task, small enough to spread a
/// 262k-row vocabulary over every core.
const ROWS_PER_TASK: usize = 1024;

/// Quantizes a `[rows, cols]` weight to `dtype` on the CPU, rows in parallel, and places it on `device`.
pub fn quantize(weight: &Tensor, dtype: GgmlDType, device: &Device) -> candle_core::Result<QTensor> {
    let (rows, cols) = weight.dims2()?;
    let host = weight.to_device(&Device::Cpu)?.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?;
    // Each chunk gets its own tensor: candle 0.11's `QTensor::quantize` reads the storage from
    // its start, ignoring a view's offset, so a `narrow`ed chunk would quantize the first rows.
    let chunks: Vec<Vec<u8>> = (0..rows)
        .step_by(ROWS_PER_TASK)
        .collect::<Vec<_>>()
        .into_par_iter()
        .map(|start| {
            let n = ROWS_PER_TASK.min(rows - start);
            let chunk = Tensor::from_slice(&host[start * cols..(start + n) * cols], (n, cols), &Device::Cpu)?;
            QTensor::quantize(&chunk, dtype)?.data().map(|d| d.into_owned())
        })
        .collect::<candle_core::Result<_>>()?;
    ggml_file::qtensor_from_ggml(dtype, &chunks.concat(), vec![rows, cols], device)
}

/// What quantization at load did, tensor by tensor.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct QuantizeReport {
    /// The requested type (`q8_0`, ...).
    pub requested: String,
    /// Each quantized tensor's stored type.
    pub quantized: BTreeMap<String, String>,
    /// Tensors whose type is not the requested one, and why.
    pub notes: BTreeMap<String, String>,
    /// Tensors left dense, and why.
    pub dense: BTreeMap<String, String>,
}

impl QuantizeReport {
    /// A report for a request of `requested`.
    pub fn new(requested: GgmlDType) -> Self {
        Self { requested: ggml_name(requested), ..Self::default() }
    }

    /// One line for a log: how many tensors of each type, and what stayed dense.
    pub fn summary(&self) -> String {
        let mut by_type: BTreeMap<&str, usize> = BTreeMap::new();
        for t in self.quantized.values() {
            *by_type.entry(t).or_default() += 1;
        }
        let types: Vec<String> = by_type.iter().map(|(t, n)| format!("{n} {t}")).collect();
        let mut line =
            format!("quantized at load to {}: {} tensors ({})", self.requested, self.quantized.len(), types.join(", "));
        if !self.notes.is_empty() {
            let notes: Vec<String> = self.notes.iter().map(|(n, why)| format!("{n}: {why}")).collect();
            line.push_str(&format!("; not {}: {}", self.requested, notes.join("; ")));
        }
        if !self.dense.is_empty() {
            let dense: Vec<String> = self.dense.iter().map(|(n, why)| format!("{n} ({why})")).collect();
            line.push_str(&format!("; kept dense: {}", dense.join("; ")));
        }
        line
    }
}

/// Quantizes `weight` (named `name`) as `decision` says, recording it in `report`; `None` when it stays dense.
pub(crate) fn apply(
    name: &str,
    weight: &Tensor,
    decision: Decision,
    device: &Device,
    report: &mut QuantizeReport,
) -> Result<Option<QTensor>> {
    match decision {
        Decision::Dense { reason } => {
            report.dense.insert(name.to_owned(), reason);
            Ok(None)
        }
        Decision::Quantize { dtype, note } => {
            let q = quantize(weight, dtype, device).ctx(|| format!("quantizing `{name}` to {}", ggml_name(dtype)))?;
            report.quantized.insert(name.to_owned(), ggml_name(dtype));
            if let Some(note) = note {
                report.notes.insert(name.to_owned(), note);
            }
            Ok(Some(q))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn follows_llama_cpp_for_projections_outputs_and_fallbacks() {
        use GgmlDType::*;
        let q = |dtype| Decision::Quantize { dtype, note: None };
        assert_eq!(decide(Q8_0, WeightRole::Projection, 64), q(Q8_0));
        assert_eq!(decide(Q8_0, WeightRole::TokenEmbedding { tied: true }, 640), q(Q8_0));
        assert_eq!(decide(Q4_0, WeightRole::TokenEmbedding { tied: false }, 512), q(Q4_0));
        assert!(matches!(decide(Q4K, WeightRole::Output, 512), Decision::Quantize { dtype: Q6K, .. }));
        // Rows that do not fit the requested block: output to Q8_0, projections to the fallback.
        assert!(matches!(decide(Q4K, WeightRole::Output, 640), Decision::Quantize { dtype: Q8_0, .. }));
        assert!(matches!(decide(Q4K, WeightRole::Projection, 640), Decision::Quantize { dtype: Q5_0, .. }));
        assert!(matches!(decide(Q6K, WeightRole::Projection, 640), Decision::Quantize { dtype: Q8_0, .. }));
        assert!(matches!(decide(Q8_0, WeightRole::Projection, 48), Decision::Dense { .. }));
    }

    #[test]
    fn parallel_quantization_equals_one_call() {
        let dev = Device::Cpu;
        let w = Tensor::randn(0f32, 1.0, (2 * ROWS_PER_TASK + 3, 64), &dev).unwrap();
        for dtype in [GgmlDType::Q8_0, GgmlDType::Q4_0] {
            let ours = quantize(&w, dtype, &dev).unwrap();
            let once = QTensor::quantize(&w, dtype).unwrap();
            assert_eq!(ours.shape(), once.shape());
            // Not assert_eq!: a failure would print megabytes of bytes.
            assert!(ours.data().unwrap() == once.data().unwrap(), "{dtype:?} differs");
        }
    }

    #[test]
    fn a_bad_value_names_the_argument_and_the_accepted_values() {
        let e = parse_quantize("q9_9").unwrap_err().to_string();
        assert!(e.contains("quantize") && e.contains("q9_9") && e.contains("q8_0") && e.contains("q4_k"), "{e}");
        assert_eq!(parse_quantize("Q4_K").unwrap(), GgmlDType::Q4K);
    }
}
