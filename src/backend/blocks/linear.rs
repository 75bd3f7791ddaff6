//! `Linear`: `x Wᵀ + b` over any weight the kernels multiply (dense, candle's blocks, our tiles).

use candle_core::quantized::QMatMul;
use std::sync::Arc;

use candle_core::{DType, Tensor};

use super::lora::Site;
use crate::backend::kernels::interleaved::Interleaved;
use crate::backend::kernels::Weight;
use crate::backend::weights::embedding::{dtype_name, ggml_name, Embedding};

/// `x Wᵀ + b` with a dense or quantized weight.
#[derive(Debug, Clone)]
pub struct Linear {
    weight: Weight,
    bias: Option<Tensor>,
    /// Where it sits in the model, for LoRA adapters (`None`: no adapter reaches it).
    site: Option<Arc<Site>>,
}

impl Linear {
    /// The output projection that reads the embedding table (tied embeddings), quantized where it is.
    pub fn tied(embedding: &Embedding) -> candle_core::Result<Linear> {
        Ok(match embedding {
            Embedding::Dense(table) => Self::new(Weight::Candle(QMatMul::Tensor(table.clone())), None),
            Embedding::Quantized(q) => Self::new(Weight::Candle(QMatMul::from_arc(q.clone())?), None),
            Embedding::Interleaved(q) => Self::new(Weight::Interleaved(q.clone()), None),
        })
    }

    /// A linear map from its weight and optional bias.
    pub fn new(weight: Weight, bias: Option<Tensor>) -> Self {
        Self { weight, bias, site: None }
    }

    /// This map placed at `site`, where LoRA adapters find it.
    pub fn at_site(mut self, site: Site) -> Self {
        self.site = Some(Arc::new(site));
        self
    }

    /// Where it sits, for LoRA adapters.
    pub fn site(&self) -> Option<&Site> {
        self.site.as_deref()
    }

    /// The weight's storage type (`q4_k`, `f32`, ...) and number of parameters (bias included).
    pub fn summary(&self) -> Vec<(String, usize)> {
        let mut v = vec![weight_summary(&self.weight)];
        if let Some(b) = &self.bias {
            v.push((dtype_name(b.dtype()), b.elem_count()));
        }
        v
    }

    /// The weight's storage type (`q4_k`, `bf16`, ...).
    pub fn storage(&self) -> String {
        weight_summary(&self.weight).0
    }

    /// Adds `delta` (`[out, in]`, float32) to the weight, which must be dense: a LoRA adapter
    /// merged into it (`Decoder::merge_adapter`). The sum is taken in float32 and stored back in
    /// the weight's own type.
    pub fn add_to_weight(&mut self, delta: &Tensor) -> candle_core::Result<()> {
        let add = |t: &Tensor| (t.to_dtype(DType::F32)? + delta.to_device(t.device())?)?.to_dtype(t.dtype());
        self.weight = match &self.weight {
            Weight::Candle(QMatMul::Tensor(t)) => Weight::Candle(QMatMul::Tensor(add(t)?)),
            Weight::Candle(QMatMul::TensorF16(t)) => Weight::Candle(QMatMul::TensorF16(add(t)?)),
            w => candle_core::bail!("cannot add to a {} weight", weight_summary(w).0),
        };
        Ok(())
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
        let sites: Option<Vec<&Site>> = parts.iter().map(|l| l.site.as_deref()).collect();
        let site = sites.and_then(|s| Site::stack(&s)).map(Arc::new);
        Ok(Some(Self { weight: Weight::Interleaved(Arc::new(weight)), bias, site }))
    }

    /// Applies the map to float32 `[rows, in]`, returning float32 (the kernel is `kernels::matmul`'s choice).
    pub fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        let y = crate::backend::kernels::matmul(x, &self.weight)?;
        let y = match &self.bias {
            Some(b) => y.broadcast_add(b)?,
            None => y,
        };
        match &self.site {
            Some(site) => super::lora::apply(site, x, y),
            None => Ok(y),
        }
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
