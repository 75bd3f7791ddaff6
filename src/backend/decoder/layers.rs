//! The decoder's small building blocks: linear maps, norms, embeddings, the MLP.

use std::sync::Arc;

use candle_core::quantized::{GgmlDType, QMatMul, QTensor};
use candle_core::{DType, Tensor, D};

use crate::backend::config::{Activation, ExpertGlu, NormKind};
use crate::backend::kernels::interleaved::Interleaved;
use crate::backend::kernels::Weight;

/// `x Wᵀ + b` with a dense or quantized weight.
#[derive(Debug, Clone)]
pub struct Linear {
    weight: Weight,
    bias: Option<Tensor>,
}

impl Linear {
    /// A linear map from its weight and optional bias.
    pub fn new(weight: Weight, bias: Option<Tensor>) -> Self {
        Self { weight, bias }
    }

    /// The weight's storage type (`q4_k`, `f32`, ...) and number of parameters (bias included).
    pub fn summary(&self) -> Vec<(String, usize)> {
        let mut v = vec![weight_summary(&self.weight)];
        if let Some(b) = &self.bias {
            v.push((dtype_name(b.dtype()), b.elem_count()));
        }
        v
    }

    /// Whether the weight is stored in quantized blocks.
    pub fn is_quantized(&self) -> bool {
        self.weight.is_quantized()
    }

    /// The maps `parts` as one whose output is theirs side by side, where their weights are
    /// interleaved tiles that stack (`Interleaved::stack`) and all or none have a bias; `None`
    /// otherwise. Each output is computed as the part's own would be, bit for bit.
    pub fn stack(parts: &[&Linear]) -> candle_core::Result<Option<Linear>> {
        let tiles: Option<Vec<&Interleaved>> = parts
            .iter()
            .map(|l| match &l.weight {
                Weight::Interleaved(w) => Some(&**w),
                Weight::Candle(_) => None,
            })
            .collect();
        let Some(weight) = tiles.and_then(|t| Interleaved::stack(&t)) else { return Ok(None) };
        let biases: Option<Vec<&Tensor>> = parts.iter().map(|l| l.bias.as_ref()).collect();
        let bias = match biases {
            Some(b) => Some(Tensor::cat(&b, 0)?),
            None if parts.iter().all(|l| l.bias.is_none()) => None,
            None => return Ok(None),
        };
        Ok(Some(Self { weight: Weight::Interleaved(Arc::new(weight)), bias }))
    }

    /// Applies the map to float32 `[rows, in]`, returning float32 (the kernel is `kernels::matmul`'s choice).
    pub fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        let y = crate::backend::kernels::matmul(x, &self.weight)?;
        match &self.bias {
            Some(b) => y.broadcast_add(b),
            None => Ok(y),
        }
    }
}

/// An RMS norm or a LayerNorm over the last dimension, computed in float32.
#[derive(Debug, Clone)]
pub struct Norm {
    kind: NormKind,
    /// The effective scale (Gemma's 1 + w already added).
    weight: Tensor,
    /// LayerNorm's shift (zero where a LayerNorm has none).
    bias: Option<Tensor>,
    eps: f32,
}

impl Norm {
    /// The parameters' storage type and count (stored as float32).
    pub fn summary(&self) -> (String, usize) {
        ("f32".into(), self.weight.elem_count() + self.bias.as_ref().map_or(0, Tensor::elem_count))
    }

    /// An RMS norm with a float32 scale; `offset` adds Gemma's 1 to the stored weight.
    pub fn rms(weight: Tensor, eps: f64, offset: bool) -> candle_core::Result<Self> {
        let weight = if offset { (weight + 1.0)? } else { weight };
        Ok(Self { kind: NormKind::Rms, weight, bias: None, eps: eps as f32 })
    }

    /// A norm of `kind` with a float32 scale and, for a LayerNorm, an optional shift.
    pub fn new(
        kind: NormKind,
        weight: Tensor,
        bias: Option<Tensor>,
        eps: f64,
        offset: bool,
    ) -> candle_core::Result<Self> {
        let mut norm = Self::rms(weight, eps, offset)?;
        norm.kind = kind;
        norm.bias = bias;
        Ok(norm)
    }

    /// Normalises `x` over its last dimension, returning its dtype.
    pub fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        let dtype = x.dtype();
        let xf = x.to_dtype(DType::F32)?.contiguous()?;
        let y = match (self.kind, &self.bias) {
            (NormKind::Rms, _) => candle_nn::ops::rms_norm(&xf, &self.weight, self.eps)?,
            (NormKind::Layer, Some(b)) => candle_nn::ops::layer_norm(&xf, &self.weight, b, self.eps)?,
            (NormKind::Layer, None) => {
                candle_nn::ops::layer_norm(&xf, &self.weight, &self.weight.zeros_like()?, self.eps)?
            }
        };
        y.to_dtype(dtype)
    }
}

/// The token embedding table, dense or quantized (a large vocabulary stays compact).
#[derive(Debug, Clone)]
pub enum Embedding {
    /// A dense `[vocab, hidden]` table.
    Dense(Tensor),
    /// A quantized `[vocab, hidden]` table whose rows are de-quantized on lookup.
    Quantized(Arc<QTensor>),
    /// A table in `interleaved`'s tiles (the output projection's layout when tied).
    Interleaved(Arc<Interleaved>),
}

impl Embedding {
    /// The table's storage type and number of parameters.
    pub fn summary(&self) -> (String, usize) {
        match self {
            Self::Dense(t) => (dtype_name(t.dtype()), t.elem_count()),
            Self::Quantized(q) => (ggml_name(q.dtype()), q.shape().elem_count()),
            Self::Interleaved(q) => (q.format().name().to_owned(), q.shape().0 * q.shape().1),
        }
    }

    /// The rows of `ids` `[t]` as float32 `[t, hidden]`.
    pub fn forward(&self, ids: &Tensor) -> candle_core::Result<Tensor> {
        match self {
            Self::Dense(table) => table.index_select(ids, 0)?.to_dtype(DType::F32),
            Self::Quantized(q) => q.embedding(ids)?.to_dtype(DType::F32),
            Self::Interleaved(q) => {
                let (rows, cols) = q.shape();
                let list = ids.to_vec1::<u32>()?;
                let mut out = vec![0f32; list.len() * cols];
                for (&id, row) in list.iter().zip(out.chunks_exact_mut(cols)) {
                    if id as usize >= rows {
                        candle_core::bail!("token id {id} is outside the embedding table's {rows} rows")
                    }
                    q.row_into(id as usize, row);
                }
                Tensor::from_vec(out, (list.len(), cols), ids.device())
            }
        }
    }

    /// The same table as an output projection (tied embeddings), quantized where it is.
    pub fn as_linear(&self) -> candle_core::Result<Linear> {
        Ok(match self {
            Self::Dense(table) => Linear::new(Weight::Candle(QMatMul::Tensor(table.clone())), None),
            Self::Quantized(q) => Linear::new(Weight::Candle(QMatMul::from_arc(q.clone())?), None),
            Self::Interleaved(q) => Linear::new(Weight::Interleaved(q.clone()), None),
        })
    }
}

/// The MLP: gated, `down(act(gate(x)) * up(x))`, or plain, `down(act(up(x)))`.
#[derive(Debug, Clone)]
pub struct Mlp {
    /// Separate gate and up, one fused map whose output halves are gate then up, or up alone.
    pub gate_up: GateUp,
    /// The down projection.
    pub down: Linear,
    /// The gate's activation.
    pub activation: Activation,
    /// How gate and up combine: `act(gate) · up`, or gpt-oss's clamped SwiGLU.
    pub glu: ExpertGlu,
}

/// The MLP's input projections.
#[derive(Debug, Clone)]
pub enum GateUp {
    /// Two maps.
    Separate {
        /// The gate.
        gate: Linear,
        /// The up projection.
        up: Linear,
    },
    /// One map of twice the width (Phi-3).
    Fused(Linear),
    /// No gate: the activation of the up projection is the hidden state (GPT-2, GPT-NeoX).
    Ungated(Linear),
}

impl Mlp {
    /// The MLP's projections, for summaries.
    pub fn linears(&self) -> Vec<&Linear> {
        match &self.gate_up {
            GateUp::Separate { gate, up } => vec![gate, up, &self.down],
            GateUp::Fused(l) | GateUp::Ungated(l) => vec![l, &self.down],
        }
    }

    /// Applies the MLP to `[rows, hidden]`, passing its hidden activation through `at_hidden`
    /// (where hooks observe or edit it).
    pub fn forward(
        &self,
        x: &Tensor,
        at_hidden: impl FnOnce(Tensor) -> candle_core::Result<Tensor>,
    ) -> candle_core::Result<Tensor> {
        let (gate, up) = match &self.gate_up {
            GateUp::Separate { gate, up } => (gate.forward(x)?, up.forward(x)?),
            GateUp::Fused(gu) => {
                let y = gu.forward(x)?;
                let half = y.dim(D::Minus1)? / 2;
                (y.narrow(D::Minus1, 0, half)?, y.narrow(D::Minus1, half, half)?)
            }
            GateUp::Ungated(up) => {
                let hidden = at_hidden(super::activation::apply(self.activation, &up.forward(x)?)?)?;
                return self.down.forward(&hidden);
            }
        };
        let hidden = match self.glu {
            ExpertGlu::Gated => super::activation::gated(self.activation, &gate, &up)?,
            ExpertGlu::ClampedSwiGlu { alpha, limit } => {
                let gate = gate.minimum(limit)?;
                let up = up.clamp(-limit, limit)?;
                let glu = (&gate * candle_nn::ops::sigmoid(&(&gate * alpha)?)?)?;
                ((up + 1.0)? * glu)?
            }
        };
        let hidden = at_hidden(hidden)?;
        self.down.forward(&hidden)
    }
}

/// The name of a dense element type as GGUF tools spell it (`f32`, `f16`, `bf16`).
pub fn dtype_name(d: DType) -> String {
    format!("{d:?}").to_lowercase()
}

/// A quantized type as llama.cpp spells it (`q4_k`, `q8_0`), not as candle's `Debug` does (`Q4K`).
pub fn ggml_name(d: GgmlDType) -> String {
    let s = format!("{d:?}").to_lowercase();
    match s.strip_suffix('k') {
        Some(stem) if stem.starts_with('q') => format!("{stem}_k"),
        _ => s,
    }
}

/// A matmul weight's storage type and number of parameters.
fn weight_summary(w: &Weight) -> (String, usize) {
    match w {
        Weight::Candle(QMatMul::QTensor(q)) => (ggml_name(q.dtype()), q.shape().elem_count()),
        Weight::Candle(QMatMul::Tensor(t) | QMatMul::TensorF16(t)) => (dtype_name(t.dtype()), t.elem_count()),
        Weight::Interleaved(q) => (q.format().name().to_owned(), q.shape().0 * q.shape().1),
    }
}
