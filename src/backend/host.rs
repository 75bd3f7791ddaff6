//! Copies from the device to the host: the one place tensors become plain float32 vectors.

use candle_core::{DType, Tensor};

/// A tensor's shape and its values as row-major float32 on the host.
pub fn to_host_f32(t: &Tensor) -> candle_core::Result<(Vec<usize>, Vec<f32>)> {
    Ok((t.dims().to_vec(), t.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?))
}
