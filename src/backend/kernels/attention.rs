//! One decode step's attention over a float32 KV cache, read in place.
//!
//! Through candle, a decoded token's scores and weighted values are two batched GEMMs of one
//! row each, and the `gemm` crate packs its operands first: every step copied the layer's whole
//! cache before reading it (perf on SmolLM2-135M at 512 tokens: `pack_lhs` and the micro-kernels
//! 15% of decode). Here each key and value row is read once, straight from the cache, for every
//! query head of its group; kv heads run in parallel.

use candle_core::{CpuStorage, Storage, Tensor};

/// What `decode` needs besides the tensors.
#[derive(Debug, Clone, Copy)]
pub struct Params {
    /// Query heads.
    pub heads: usize,
    /// Key/value heads (each serves `heads / kv_heads` query heads).
    pub kv_heads: usize,
    /// Values per head.
    pub head_dim: usize,
    /// Multiplier of the scores.
    pub scale: f32,
    /// `cap · tanh(score / cap)` after scaling, when set.
    pub softcap: Option<f32>,
}

/// Whether `decode` takes one query row against this cache view: float32 on the CPU, each key
/// row contiguous.
pub fn takes(q: &Tensor, k: &Tensor, v: &Tensor) -> bool {
    let rows_contiguous = |t: &Tensor| {
        let s = t.stride();
        t.dims().len() == 4 && s[3] == 1 && s[2] == t.dims()[3]
    };
    q.device().is_cpu()
        && [q, k, v].iter().all(|t| t.dtype() == candle_core::DType::F32)
        && rows_contiguous(k)
        && rows_contiguous(v)
        && k.dims()[3] % 8 == 0
}

/// `softmax(q·Kᵀ·scale)·V` for one query row `q` `[heads · d]` (float32, any layout) against
/// the cache views `k`, `v` `[1, kv_heads, keys, d]`: each head's output, `[1, heads, d]`.
pub fn decode(q: &Tensor, k: &Tensor, v: &Tensor, p: Params) -> candle_core::Result<Tensor> {
    let d = p.head_dim;
    let keys = k.dim(2)?;
    let q = q.flatten_all()?.to_vec1::<f32>()?;
    if q.len() != p.heads * d || p.kv_heads == 0 || p.heads % p.kv_heads != 0 {
        candle_core::bail!("decode attention: {} query values for {} heads of {d}", q.len(), p.heads)
    }
    let group = p.heads / p.kv_heads;
    let mut out = vec![0f32; p.heads * d];
    {
        let (ks, kl) = k.storage_and_layout();
        let (vs, vl) = v.storage_and_layout();
        let (Storage::Cpu(CpuStorage::F32(kd)), Storage::Cpu(CpuStorage::F32(vd))) = (&*ks, &*vs) else {
            candle_core::bail!("decode attention expects a float32 CPU cache")
        };
        let (k_head, v_head) = (kl.stride()[1], vl.stride()[1]);
        let (k0, v0) = (kl.start_offset(), vl.start_offset());
        let ptr = super::OutPtr(out.as_mut_ptr());
        super::parallel_for(p.kv_heads, |h| {
            // The closure must capture the whole `Send` wrapper, not its raw-pointer field.
            #[allow(clippy::redundant_locals)]
            let ptr = ptr;
            let kh = &kd[k0 + h * k_head..][..keys * d];
            let vh = &vd[v0 + h * v_head..][..keys * d];
            let qh = &q[h * group * d..(h + 1) * group * d];
            // SAFETY: kv head h alone writes its group's query heads' outputs.
            let oh = unsafe { std::slice::from_raw_parts_mut(ptr.0.add(h * group * d), group * d) };
            head_group(qh, kh, vh, oh, d, p.scale, p.softcap);
        });
    }
    Tensor::from_vec(out, (1, p.heads, d), k.device())
}

/// The `group` query heads `q` `[group · d]` sharing keys `k` and values `v` `[keys · d]`.
fn head_group(q: &[f32], k: &[f32], v: &[f32], out: &mut [f32], d: usize, scale: f32, softcap: Option<f32>) {
    let keys = k.len() / d;
    let group = q.len() / d;
    let mut scores = vec![0f32; group * keys];
    for (i, key) in k.chunks_exact(d).enumerate() {
        for (g, qg) in q.chunks_exact(d).enumerate() {
            let mut s = dot(qg, key) * scale;
            if let Some(cap) = softcap {
                s = cap * (s / cap).tanh();
            }
            scores[g * keys + i] = s;
        }
    }
    for row in scores.chunks_exact_mut(keys) {
        let max = row.iter().fold(f32::NEG_INFINITY, |m, &s| m.max(s));
        let mut sum = 0f32;
        for s in row.iter_mut() {
            *s = (*s - max).exp();
            sum += *s;
        }
        let inv = 1.0 / sum;
        row.iter_mut().for_each(|s| *s *= inv);
    }
    out.fill(0.0);
    for (i, value) in v.chunks_exact(d).enumerate() {
        for (g, og) in out.chunks_exact_mut(d).enumerate() {
            let w = scores[g * keys + i];
            for (o, &x) in og.iter_mut().zip(value) {
                *o += w * x;
            }
        }
    }
}

/// A dot product in 8 running sums (which the compiler keeps in one vector register).
#[inline(always)]
fn dot(a: &[f32], b: &[f32]) -> f32 {
    let mut acc = [0f32; 8];
    for (x, y) in a.chunks_exact(8).zip(b.chunks_exact(8)) {
        for l in 0..8 {
            acc[l] += x[l] * y[l];
        }
    }
    acc.iter().sum()
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::{Device, D};

    /// Equals candle's grouped matmul / softmax / matmul on a cache view narrowed from a larger
    /// buffer (as the session's cache is), with and without a softcap.
    #[test]
    fn equals_candles_attention_on_a_narrowed_cache() {
        let dev = Device::Cpu;
        let (heads, kv_heads, d, cap, keys) = (6, 2, 16, 40, 29);
        let k_buf = Tensor::randn(0f32, 1.0, (1, kv_heads, cap, d), &dev).unwrap();
        let v_buf = Tensor::randn(0f32, 1.0, (1, kv_heads, cap, d), &dev).unwrap();
        let (k, v) = (k_buf.narrow(2, 3, keys).unwrap(), v_buf.narrow(2, 3, keys).unwrap());
        let q = Tensor::randn(0f32, 1.0, (1, heads, 1, d), &dev).unwrap();
        for softcap in [None, Some(5.0f32)] {
            let p = Params { heads, kv_heads, head_dim: d, scale: 0.25, softcap };
            assert!(takes(&q, &k, &v));
            let got = decode(&q, &k, &v, p).unwrap();
            let qg = q.reshape((1, kv_heads, heads / kv_heads, d)).unwrap();
            let mut s = (qg.matmul(&k.t().unwrap()).unwrap() * 0.25).unwrap();
            if let Some(c) = softcap {
                s = ((s / c as f64).unwrap().tanh().unwrap() * c as f64).unwrap();
            }
            let probs = candle_nn::ops::softmax(&s, D::Minus1).unwrap();
            let want = probs.matmul(&v.contiguous().unwrap()).unwrap().reshape((1, heads, d)).unwrap();
            let diff = (got - want).unwrap().abs().unwrap().max_all().unwrap().to_scalar::<f32>().unwrap();
            assert!(diff < 1e-5, "softcap {softcap:?}: max difference {diff}");
        }
    }
}
