//! How a layer's keys and values are laid out for the kernels: the cache's element types
//! (`KvType`: a float dtype, or ggml's q8_0 blocks per head row), the q8_0 block codec, and
//! `KvView`, positions of one layer's buffers read in place (a ring's wrap included). The cache
//! itself (growth, rings, snapshots) is the runtime's `kv_cache`; it stores what this describes.

use candle_core::{DType, Tensor};
use half::f16;

/// Values per q8_0 block (ggml's `QK8_0`).
pub const Q8_BLOCK: usize = 32;
/// Bytes per q8_0 block: a float16 scale, then 32 signed bytes (ggml's `block_q8_0`).
pub const Q8_BYTES: usize = 34;

/// How keys and values are stored.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum KvType {
    /// A float dtype (float32, float16, bfloat16).
    Dense(DType),
    /// ggml's q8_0 blocks per head row (llama.cpp's `-ctk q8_0 -ctv q8_0`), held as bytes
    /// `[1, kv_heads, capacity, head_dim / 32 · 34]`; the CPU only.
    Q8_0,
}

impl KvType {
    /// The names `parse` takes, as error messages list them.
    pub const ACCEPTED: &'static str = "f32, f16, bf16, q8_0";

    /// The type a name gives (`f16`, `float16`, `q8_0`, ...), or `None`.
    pub fn parse(s: &str) -> Option<Self> {
        Some(match s.to_ascii_lowercase().as_str() {
            "f32" | "float32" => Self::Dense(DType::F32),
            "f16" | "float16" => Self::Dense(DType::F16),
            "bf16" | "bfloat16" => Self::Dense(DType::BF16),
            "q8_0" => Self::Q8_0,
            _ => return None,
        })
    }

    /// Its name (`f32`, `f16`, `bf16`, `q8_0`).
    pub fn name(self) -> &'static str {
        match self {
            Self::Dense(DType::F32) => "f32",
            Self::Dense(DType::F16) => "f16",
            Self::Dense(DType::BF16) => "bf16",
            Self::Dense(_) => "other",
            Self::Q8_0 => "q8_0",
        }
    }

    /// The element type and elements per head row of its buffers.
    pub fn storage(self, head_dim: usize) -> (DType, usize) {
        match self {
            Self::Dense(d) => (d, head_dim),
            Self::Q8_0 => (DType::U8, head_dim / Q8_BLOCK * Q8_BYTES),
        }
    }

    /// Keys or values `x` `[1, kv_heads, t, head_dim]` in this type's storage.
    pub fn encode(self, x: &Tensor) -> candle_core::Result<Tensor> {
        match self {
            Self::Dense(d) => x.to_dtype(d),
            Self::Q8_0 => {
                let (b, h, t, d) = x.dims4()?;
                let values = x.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?;
                let mut bytes = vec![0u8; values.len() / Q8_BLOCK * Q8_BYTES];
                for (block, out) in values.chunks_exact(Q8_BLOCK).zip(bytes.chunks_exact_mut(Q8_BYTES)) {
                    quantize_q8_0(block, out);
                }
                Tensor::from_vec(bytes, (b, h, t, d / Q8_BLOCK * Q8_BYTES), x.device())
            }
        }
    }

    /// Stored rows `x` `[1, kv_heads, n, row]` as `dtype` values `[1, kv_heads, n, head_dim]`.
    pub fn decode(self, x: &Tensor, dtype: DType) -> candle_core::Result<Tensor> {
        match self {
            Self::Dense(_) => x.to_dtype(dtype),
            Self::Q8_0 => {
                let (b, h, n, row) = x.dims4()?;
                let bytes = x.flatten_all()?.to_vec1::<u8>()?;
                let mut values = vec![0f32; bytes.len() / Q8_BYTES * Q8_BLOCK];
                for (block, out) in bytes.chunks_exact(Q8_BYTES).zip(values.chunks_exact_mut(Q8_BLOCK)) {
                    dequantize_q8_0(block, out);
                }
                Tensor::from_vec(values, (b, h, n, row / Q8_BYTES * Q8_BLOCK), x.device())?.to_dtype(dtype)
            }
        }
    }

    /// The type of buffers holding `dtype` elements.
    pub fn of_storage(dtype: DType) -> Self {
        if dtype == DType::U8 {
            Self::Q8_0
        } else {
            Self::Dense(dtype)
        }
    }
}

/// One q8_0 block of `x` (32 values) into `out` (34 bytes), as ggml's `quantize_row_q8_0_ref`.
pub fn quantize_q8_0(x: &[f32], out: &mut [u8]) {
    let amax = x.iter().fold(0f32, |m, v| m.max(v.abs()));
    let d = amax / 127.0;
    let id = if d != 0.0 { 1.0 / d } else { 0.0 };
    out[..2].copy_from_slice(&f16::from_f32(d).to_le_bytes());
    for (o, &v) in out[2..].iter_mut().zip(x) {
        *o = ((v * id).round() as i8) as u8;
    }
}

/// One q8_0 block (34 bytes) as its 32 values.
pub fn dequantize_q8_0(block: &[u8], out: &mut [f32]) {
    let d = f16::from_le_bytes([block[0], block[1]]).to_f32();
    for (o, &q) in out.iter_mut().zip(&block[2..]) {
        *o = d * (q as i8) as f32;
    }
}

/// Positions `first..first + len` of one layer's keys and values, read in place: position `p`
/// is at row `p % capacity` of `k` and `v` `[1, kv_heads, capacity, row]`.
#[derive(Debug, Clone, Copy)]
pub struct KvView<'a> {
    /// The layer's key buffer.
    pub k: &'a Tensor,
    /// The layer's value buffer.
    pub v: &'a Tensor,
    /// The first position viewed.
    pub first: usize,
    /// Positions viewed.
    pub len: usize,
}

impl<'a> KvView<'a> {
    /// Rows of the buffers.
    pub fn capacity(&self) -> usize {
        self.k.dims()[2]
    }

    /// Positions `first..first + len`, which must lie inside this view.
    pub fn range(&self, first: usize, len: usize) -> candle_core::Result<KvView<'a>> {
        if first < self.first || first + len > self.first + self.len {
            candle_core::bail!(
                "KV view {first}..{} outside the positions {}..{} held",
                first + len,
                self.first,
                self.first + self.len
            )
        }
        Ok(KvView { first, len, ..*self })
    }

    /// The view's rows as runs `(slot, count)` of consecutive slots, in position order: one run,
    /// or two where a ring wraps.
    pub fn runs(&self) -> impl Iterator<Item = (usize, usize)> {
        let cap = self.capacity().max(1);
        let start = self.first % cap;
        let head = self.len.min(cap - start);
        [(start, head), (0, self.len - head)].into_iter().filter(|&(_, n)| n > 0)
    }

    /// Copies of the stored rows in position order, `[1, kv_heads, len, row]`, in buffers of
    /// their own (never sharing the cache's storage, which later appends overwrite in place).
    pub fn stored(&self) -> candle_core::Result<(Tensor, Tensor)> {
        let gather = |t: &Tensor| -> candle_core::Result<Tensor> {
            let (b, h, _, d) = t.dims4()?;
            let out = Tensor::zeros((b, h, self.len, d), t.dtype(), t.device())?;
            let mut done = 0;
            for (slot, n) in self.runs() {
                out.slice_set(&t.narrow(2, slot, n)?.contiguous()?, 2, done)?;
                done += n;
            }
            Ok(out)
        };
        Ok((gather(self.k)?, gather(self.v)?))
    }

    /// Keys and values in position order as `dtype` values `[1, kv_heads, len, head_dim]`: the
    /// operands of attention through materialised scores. A view that does not wrap over float
    /// buffers is a narrowed view of the cache (no copy unless `dtype` differs).
    pub fn dense(&self, dtype: DType) -> candle_core::Result<(Tensor, Tensor)> {
        let ty = KvType::of_storage(self.k.dtype());
        let (k, v) = match (self.runs().collect::<Vec<_>>().as_slice(), ty) {
            ([(s, n)], KvType::Dense(_)) => (self.k.narrow(2, *s, *n)?, self.v.narrow(2, *s, *n)?),
            _ => self.stored()?,
        };
        Ok((ty.decode(&k, dtype)?, ty.decode(&v, dtype)?))
    }
}
