//! `Norm`: an RMS norm or a LayerNorm over the last dimension, computed in float32.

use candle_core::{DType, Tensor};

use crate::backend::config::NormKind;

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
