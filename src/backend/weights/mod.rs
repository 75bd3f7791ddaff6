//! Where weights come from: a checkpoint format behind one small interface.

/// The GGUF types candle lacks, de-quantized in the kernels crate.
pub use candlewick_kernels::extra_types;
pub mod adapter;
pub mod embedding;
pub mod finite;
pub mod gguf;
pub mod names;
pub mod prefixed;
pub mod quantize;
pub mod relayout;
pub mod requant;
pub mod sae;
pub mod safetensors;

use std::sync::Mutex;

use candle_core::quantized::{GgmlDType, QMatMul};

use crate::backend::kernels::Weight;
use candle_core::{DType, Device, Tensor};

use quantize::{QuantizeReport, WeightRole};

use crate::backend::error::{CandleContext, CandleError, Result};
use crate::backend::weights::embedding::Embedding;

/// A checkpoint's named tensors.
pub trait WeightSource: Send + Sync {
    /// The names of every tensor the checkpoint holds.
    fn names(&self) -> Vec<String>;
    /// The stored shape of `name`, or `None` when the checkpoint lacks it.
    fn shape(&self, name: &str) -> Option<Vec<usize>>;
    /// Loads `name` as a dense tensor of `dtype` on `device`.
    fn dense(&self, name: &str, dtype: DType, device: &Device) -> Result<Tensor>;
    /// Loads `name` as a matmul weight; formats that store quantized blocks keep them quantized.
    fn matmul(&self, name: &str, dtype: DType, device: &Device) -> Result<Weight> {
        Ok(Weight::Candle(QMatMul::Tensor(self.dense(name, dtype, device)?)))
    }
    /// Expert `expert` of a 3-D `[experts, out, in]` tensor (GGUF's `ffn_*_exps`) as an
    /// `[out, in]` matmul weight; formats that store quantized blocks keep that expert's blocks.
    fn expert_matmul(&self, name: &str, expert: usize, dtype: DType, device: &Device) -> Result<Weight> {
        let one = self
            .dense(name, dtype, device)?
            .get(expert)
            .and_then(|t| t.contiguous())
            .ctx(|| format!("expert {expert} of `{name}`"))?;
        Ok(Weight::Candle(QMatMul::Tensor(one)))
    }
    /// Expert `expert` of a 3-D tensor as a dense `[out, in]` tensor of `dtype` (what quantization
    /// at load starts from); formats that can read one expert's slice read only that.
    fn expert_dense(&self, name: &str, expert: usize, dtype: DType, device: &Device) -> Result<Tensor> {
        self.dense(name, dtype, device)?
            .get(expert)
            .and_then(|t| t.contiguous())
            .ctx(|| format!("expert {expert} of `{name}`"))
    }
    /// Loads `name` as an embedding table; formats that store quantized blocks keep them quantized.
    fn embedding(&self, name: &str, dtype: DType, device: &Device) -> Result<Embedding> {
        Ok(Embedding::Dense(self.dense(name, dtype, device)?))
    }
}

/// Loads tensors for one model, checking each against the shape its configuration implies.
pub struct WeightLoader<'a> {
    source: &'a dyn WeightSource,
    dtype: DType,
    device: &'a Device,
    /// The requested quantization at load and what it has done so far.
    quantize: Option<(GgmlDType, Mutex<QuantizeReport>)>,
}

impl<'a> WeightLoader<'a> {
    /// A loader producing `dtype` tensors on `device`.
    pub fn new(source: &'a dyn WeightSource, dtype: DType, device: &'a Device) -> Self {
        Self { source, dtype, device, quantize: None }
    }

    /// The same loader, quantizing matmul weights and embeddings to `dtype` as they load.
    pub fn quantizing(mut self, dtype: Option<GgmlDType>) -> Self {
        self.quantize = dtype.map(|d| (d, Mutex::new(QuantizeReport::new(d))));
        self
    }

    /// What quantization at load did, when it was asked for.
    pub fn quantize_report(&self) -> Option<QuantizeReport> {
        self.quantize.as_ref().map(|(_, r)| r.lock().unwrap_or_else(|e| e.into_inner()).clone())
    }

    /// `name` quantized for `role` when quantization was asked for and its rows fit a block type.
    fn quantized(&self, name: &str, role: WeightRole) -> Result<Option<candle_core::quantized::QTensor>> {
        let cols = self.source.shape(name).and_then(|s| s.last().copied()).unwrap_or(0);
        self.quantized_from(name, role, cols, || self.source.dense(name, DType::F32, self.device))
    }

    /// `quantized` for a tensor `load` gives (read only when it is to be quantized).
    fn quantized_from(
        &self,
        name: &str,
        role: WeightRole,
        cols: usize,
        load: impl FnOnce() -> Result<Tensor>,
    ) -> Result<Option<candle_core::quantized::QTensor>> {
        let Some((base, report)) = &self.quantize else { return Ok(None) };
        let decision = quantize::decide(*base, role, cols);
        let mut report = report.lock().unwrap_or_else(|e| e.into_inner());
        if let quantize::Decision::Dense { reason } = decision {
            report.dense.insert(name.to_owned(), reason);
            return Ok(None);
        }
        let dense = load()?;
        quantize::apply(name, &dense, decision, self.device, &mut report)
    }

    /// The dtype activations run in.
    pub fn dtype(&self) -> DType {
        self.dtype
    }

    /// The device tensors go to.
    pub fn device(&self) -> &Device {
        self.device
    }

    /// Whether the checkpoint holds `name`.
    pub fn contains(&self, name: &str) -> bool {
        self.source.shape(name).is_some()
    }

    /// The shape the checkpoint gives `name`, if it holds it.
    pub fn shape(&self, name: &str) -> Option<Vec<usize>> {
        self.source.shape(name)
    }

    fn check(&self, name: &str, expected: &[usize]) -> Result<()> {
        let found = self.source.shape(name).ok_or_else(|| CandleError::MissingTensor { name: name.to_owned() })?;
        if found != expected {
            return Err(CandleError::TensorShape { name: name.to_owned(), expected: expected.to_vec(), found });
        }
        Ok(())
    }

    /// A dense tensor of exactly `shape`.
    pub fn dense(&self, name: &str, shape: &[usize]) -> Result<Tensor> {
        self.check(name, shape)?;
        self.source.dense(name, self.dtype, self.device)
    }

    /// A dense float32 tensor of exactly `shape` (norm weights are applied in float32).
    pub fn dense_f32(&self, name: &str, shape: &[usize]) -> Result<Tensor> {
        self.check(name, shape)?;
        self.source.dense(name, DType::F32, self.device)
    }

    /// A `[rows, cols]` embedding table (`tied` when it is also the output projection),
    /// quantized where the checkpoint is or quantization at load asks.
    pub fn embedding(&self, name: &str, rows: usize, cols: usize, tied: bool) -> Result<Embedding> {
        self.check(name, &[rows, cols])?;
        if let Some(q) = self.quantized(name, WeightRole::TokenEmbedding { tied })? {
            return Weight::prepare(q, self.device).map(embedding_of).ctx(|| format!("preparing embedding `{name}`"));
        }
        self.source.embedding(name, self.dtype, self.device)
    }

    /// A `[out, in]` projection weight, quantized where the checkpoint is or quantization at load asks.
    pub fn matmul(&self, name: &str, out_dim: usize, in_dim: usize) -> Result<Weight> {
        self.matmul_as(name, out_dim, in_dim, WeightRole::Projection)
    }

    /// The `[vocab, hidden]` output projection (untied), quantized as `matmul`, with llama.cpp's output type.
    pub fn output(&self, name: &str, out_dim: usize, in_dim: usize) -> Result<Weight> {
        self.matmul_as(name, out_dim, in_dim, WeightRole::Output)
    }

    /// A `[out, in]` projection weight cut from a larger tensor (one expert of a fused 3-D
    /// checkpoint tensor; `name` names the piece in errors and reports), quantized where
    /// quantization at load asks, like `matmul`.
    pub fn matmul_from(&self, name: &str, t: Tensor) -> Result<Weight> {
        let cols = t.dims().last().copied().unwrap_or(0);
        let to_f32 = || t.to_dtype(DType::F32).and_then(|x| x.contiguous()).ctx(|| format!("reading `{name}`"));
        match self.quantized_from(name, WeightRole::Projection, cols, to_f32)? {
            Some(q) => {
                let q = requant::fast_encoding(q, self.device).ctx(|| format!("re-encoding `{name}`"))?;
                Weight::prepare(q, self.device).ctx(|| format!("preparing matmul weight `{name}`"))
            }
            None => {
                let t = convert(t, name, self.dtype)?.contiguous().ctx(|| format!("laying out `{name}`"))?;
                Ok(Weight::Candle(QMatMul::Tensor(t)))
            }
        }
    }

    /// Expert `expert` of a `[experts, out_dim, in_dim]` tensor as an `[out_dim, in_dim]` projection
    /// weight, quantized where the checkpoint is or quantization at load asks.
    pub fn expert_matmul(
        &self,
        name: &str,
        expert: usize,
        experts: usize,
        out_dim: usize,
        in_dim: usize,
    ) -> Result<Weight> {
        self.check(name, &[experts, out_dim, in_dim])?;
        if self.quantize.is_some() {
            let one = self.source.expert_dense(name, expert, DType::F32, self.device)?;
            return self.matmul_from(&format!("{name}[{expert}]"), one);
        }
        self.source.expert_matmul(name, expert, self.dtype, self.device)
    }

    fn matmul_as(&self, name: &str, out_dim: usize, in_dim: usize, role: WeightRole) -> Result<Weight> {
        self.check(name, &[out_dim, in_dim])?;
        match self.quantized(name, role)? {
            Some(q) => {
                let q = requant::fast_encoding(q, self.device).ctx(|| format!("re-encoding `{name}`"))?;
                Weight::prepare(q, self.device).ctx(|| format!("preparing matmul weight `{name}`"))
            }
            None => self.source.matmul(name, self.dtype, self.device),
        }
    }
}

/// Converts a loaded tensor to the requested dtype, naming the tensor on failure.
pub(crate) fn convert(t: Tensor, name: &str, dtype: DType) -> Result<Tensor> {
    if t.dtype() == dtype {
        return Ok(t);
    }
    t.to_dtype(dtype).ctx(|| format!("converting `{name}` to {dtype:?}"))
}

/// An embedding table held as the matmul weight it was prepared as.
pub(crate) fn embedding_of(weight: Weight) -> Embedding {
    match weight {
        Weight::Interleaved(tiles) => Embedding::Interleaved(tiles),
        Weight::Candle(QMatMul::QTensor(q)) => Embedding::Quantized(q),
        Weight::Candle(QMatMul::Tensor(t) | QMatMul::TensorF16(t)) => Embedding::Dense(t),
    }
}
