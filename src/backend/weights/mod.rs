//! Where weights come from: a checkpoint format behind one small interface.

pub mod gguf;
pub mod requant;
pub mod safetensors;

use candle_core::quantized::QMatMul;
use candle_core::{DType, Device, Tensor};

use crate::backend::decoder::layers::Embedding;
use crate::backend::error::{CandleContext, CandleError, Result};

/// A checkpoint's named tensors.
pub trait WeightSource: Send + Sync {
    /// The names of every tensor the checkpoint holds.
    fn names(&self) -> Vec<String>;
    /// The stored shape of `name`, or `None` when the checkpoint lacks it.
    fn shape(&self, name: &str) -> Option<Vec<usize>>;
    /// Loads `name` as a dense tensor of `dtype` on `device`.
    fn dense(&self, name: &str, dtype: DType, device: &Device) -> Result<Tensor>;
    /// Loads `name` as a matmul weight; formats that store quantized blocks keep them quantized.
    fn matmul(&self, name: &str, dtype: DType, device: &Device) -> Result<QMatMul> {
        Ok(QMatMul::Tensor(self.dense(name, dtype, device)?))
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
}

impl<'a> WeightLoader<'a> {
    /// A loader producing `dtype` tensors on `device`.
    pub fn new(source: &'a dyn WeightSource, dtype: DType, device: &'a Device) -> Self {
        Self { source, dtype, device }
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

    /// A `[rows, cols]` embedding table, quantized where the checkpoint is.
    pub fn embedding(&self, name: &str, rows: usize, cols: usize) -> Result<Embedding> {
        self.check(name, &[rows, cols])?;
        self.source.embedding(name, self.dtype, self.device)
    }

    /// A `[out, in]` matmul weight, quantized where the checkpoint is.
    pub fn matmul(&self, name: &str, out_dim: usize, in_dim: usize) -> Result<QMatMul> {
        self.check(name, &[out_dim, in_dim])?;
        self.source.matmul(name, self.dtype, self.device)
    }
}

/// Converts a loaded tensor to the requested dtype, naming the tensor on failure.
pub(crate) fn convert(t: Tensor, name: &str, dtype: DType) -> Result<Tensor> {
    if t.dtype() == dtype {
        return Ok(t);
    }
    t.to_dtype(dtype).ctx(|| format!("converting `{name}` to {dtype:?}"))
}
