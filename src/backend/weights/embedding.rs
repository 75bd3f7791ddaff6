//! The token embedding table as it is stored (dense, candle's blocks or our tiles), its row
//! lookup, and the names of storage types as llama.cpp spells them.

use std::sync::Arc;

use candle_core::quantized::{GgmlDType, QTensor};
use candle_core::{DType, Tensor};

use crate::backend::kernels::interleaved::Interleaved;

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
