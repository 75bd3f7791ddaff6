//! One decode step's attention over a float32 or float16 KV cache, read in place.
//!
//! Through candle, a decoded token's scores and weighted values are two batched GEMMs of one
//! row each, and the `gemm` crate packs its operands first: every step copied the layer's whole
//! cache before reading it (perf on SmolLM2-135M at 512 tokens: `pack_lhs` and the micro-kernels
//! 15% of decode). Here each key and value row is read once, straight from the cache, for every
//! query head of its group; kv heads run in parallel. A float16 cache (quantized models) is
//! widened in registers (F16C) as it is read, on x86 CPUs that have it.

use candle_core::{CpuStorage, DType, Storage, Tensor};
use half::f16;

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

/// Whether `decode` takes one query row against this cache view: a float32 query and a float32
/// or float16 cache on the CPU, each key row contiguous.
pub fn takes(q: &Tensor, k: &Tensor, v: &Tensor) -> bool {
    let rows_contiguous = |t: &Tensor| {
        let s = t.stride();
        t.dims().len() == 4 && s[3] == 1 && s[2] == t.dims()[3]
    };
    q.device().is_cpu()
        && q.dtype() == DType::F32
        && k.dtype() == v.dtype()
        && matches!(k.dtype(), DType::F32 | DType::F16)
        && rows_contiguous(k)
        && rows_contiguous(v)
        && k.dims()[3] % 8 == 0
}

/// `softmax(q·Kᵀ·scale)·V` for one query row `q` `[heads · d]` (float32, any layout) against
/// the cache views `k`, `v` `[1, kv_heads, keys, d]`: each head's output, `[1, heads, d]`.
pub fn decode(q: &Tensor, k: &Tensor, v: &Tensor, p: Params) -> candle_core::Result<Tensor> {
    decode_with(q, k, v, p, true)
}

/// `decode`, on this CPU's SIMD code where it has it (`simd`) or on the portable code.
fn decode_with(q: &Tensor, k: &Tensor, v: &Tensor, p: Params, simd: bool) -> candle_core::Result<Tensor> {
    let d = p.head_dim;
    let keys = k.dim(2)?;
    let q = q.flatten_all()?.to_vec1::<f32>()?;
    if q.len() != p.heads * d || p.kv_heads == 0 || p.heads % p.kv_heads != 0 {
        candle_core::bail!("decode attention: {} query values for {} heads of {d}", q.len(), p.heads)
    }
    let group = p.heads / p.kv_heads;
    let mut out = vec![0f32; p.heads * d];
    let (ks, kl) = k.storage_and_layout();
    let (vs, vl) = v.storage_and_layout();
    let (k_head, v_head) = (kl.stride()[1], vl.stride()[1]);
    let (k0, v0) = (kl.start_offset(), vl.start_offset());
    let ptr = super::OutPtr(out.as_mut_ptr());
    // Runs `f(queries, keys, values, out)` for each kv head's group of query heads, in parallel.
    let each_head = |f: &(dyn Fn(&[f32], usize, usize, &mut [f32]) + Sync)| {
        super::parallel_for(p.kv_heads, |h| {
            // The closure must capture the whole `Send` wrapper, not its raw-pointer field.
            #[allow(clippy::redundant_locals)]
            let ptr = ptr;
            // SAFETY: kv head h alone writes its group's query heads' outputs.
            let oh = unsafe { std::slice::from_raw_parts_mut(ptr.0.add(h * group * d), group * d) };
            f(&q[h * group * d..(h + 1) * group * d], k0 + h * k_head, v0 + h * v_head, oh);
        })
    };
    match (&*ks, &*vs) {
        (Storage::Cpu(CpuStorage::F32(kd)), Storage::Cpu(CpuStorage::F32(vd))) => each_head(&|qh, ko, vo, oh| {
            head_group(qh, &kd[ko..][..keys * d], &vd[vo..][..keys * d], oh, d, p.scale, p.softcap, dot, axpy)
        }),
        (Storage::Cpu(CpuStorage::F16(kd)), Storage::Cpu(CpuStorage::F16(vd))) => each_head(&|qh, ko, vo, oh| {
            let (kh, vh) = (&kd[ko..][..keys * d], &vd[vo..][..keys * d]);
            #[cfg(target_arch = "x86_64")]
            if simd && x86::available() {
                // SAFETY: AVX2, FMA and F16C were detected.
                return unsafe { x86::head_group_f16c(qh, kh, vh, oh, d, p.scale, p.softcap) };
            }
            head_group(qh, kh, vh, oh, d, p.scale, p.softcap, dot, axpy)
        }),
        _ => candle_core::bail!("decode attention expects a float32 or float16 CPU cache"),
    }
    drop((ks, vs));
    Tensor::from_vec(out, (1, p.heads, d), k.device())
}

/// A cache element the portable code widens one at a time.
trait Element: Copy {
    fn widen(self) -> f32;
}

impl Element for f32 {
    #[inline(always)]
    fn widen(self) -> f32 {
        self
    }
}

impl Element for f16 {
    #[inline(always)]
    fn widen(self) -> f32 {
        self.to_f32()
    }
}

/// The `group` query heads `q` `[group · d]` sharing keys `k` and values `v` `[keys · d]`, with
/// `dot(query, key)` and `axpy(out, weight, value)` for the cache's element type.
#[allow(clippy::too_many_arguments)]
#[inline(always)]
fn head_group<T>(
    q: &[f32],
    k: &[T],
    v: &[T],
    out: &mut [f32],
    d: usize,
    scale: f32,
    softcap: Option<f32>,
    dot: impl Fn(&[f32], &[T]) -> f32,
    axpy: impl Fn(&mut [f32], f32, &[T]),
) {
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
            axpy(og, scores[g * keys + i], value);
        }
    }
}

/// A dot product in 8 running sums (which the compiler keeps in one vector register).
#[inline(always)]
fn dot<T: Element>(a: &[f32], b: &[T]) -> f32 {
    let mut acc = [0f32; 8];
    for (x, y) in a.chunks_exact(8).zip(b.chunks_exact(8)) {
        for l in 0..8 {
            acc[l] += x[l] * y[l].widen();
        }
    }
    acc.iter().sum()
}

/// `out += w · x`.
#[inline(always)]
fn axpy<T: Element>(out: &mut [f32], w: f32, x: &[T]) {
    for (o, &x) in out.iter_mut().zip(x) {
        *o += w * x.widen();
    }
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use super::*;
    use std::arch::x86_64::*;

    /// Whether this CPU widens float16 in registers.
    pub(super) fn available() -> bool {
        is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma") && is_x86_feature_detected!("f16c")
    }

    /// `head_group` over a float16 cache, 8 values per instruction (`d` is a multiple of 8).
    #[allow(clippy::too_many_arguments)]
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) unsafe fn head_group_f16c(
        q: &[f32],
        k: &[f16],
        v: &[f16],
        out: &mut [f32],
        d: usize,
        scale: f32,
        softcap: Option<f32>,
    ) {
        head_group(q, k, v, out, d, scale, softcap, |a, b| dot_f16(a, b), |o, w, x| axpy_f16(o, w, x))
    }

    /// Eight float16 values widened.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn load8(p: &[f16], i: usize) -> __m256 {
        _mm256_cvtph_ps(_mm_loadu_si128(p.as_ptr().add(i) as *const __m128i))
    }

    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn dot_f16(a: &[f32], b: &[f16]) -> f32 {
        let mut acc = _mm256_setzero_ps();
        for i in (0..a.len().min(b.len()) / 8 * 8).step_by(8) {
            acc = _mm256_fmadd_ps(_mm256_loadu_ps(a.as_ptr().add(i)), load8(b, i), acc);
        }
        let mut lanes = [0f32; 8];
        _mm256_storeu_ps(lanes.as_mut_ptr(), acc);
        lanes.iter().sum()
    }

    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn axpy_f16(out: &mut [f32], w: f32, x: &[f16]) {
        let wv = _mm256_set1_ps(w);
        for i in (0..out.len().min(x.len()) / 8 * 8).step_by(8) {
            let o = out.as_mut_ptr().add(i);
            _mm256_storeu_ps(o, _mm256_fmadd_ps(wv, load8(x, i), _mm256_loadu_ps(o)));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::{Device, D};

    /// Equals candle's grouped matmul / softmax / matmul on a cache view narrowed from a larger
    /// buffer (as the session's cache is), with and without a softcap, for a float32 and a
    /// float16 cache (candle's products on the float16 values widened), on the SIMD code and on
    /// the portable code forced.
    #[test]
    fn equals_candles_attention_on_a_narrowed_cache() {
        let dev = Device::Cpu;
        let (heads, kv_heads, d, cap, keys) = (6, 2, 16, 40, 29);
        for (dtype, simd) in [(DType::F32, true), (DType::F16, true), (DType::F16, false)] {
            let k_buf = Tensor::randn(0f32, 1.0, (1, kv_heads, cap, d), &dev).unwrap().to_dtype(dtype).unwrap();
            let v_buf = Tensor::randn(0f32, 1.0, (1, kv_heads, cap, d), &dev).unwrap().to_dtype(dtype).unwrap();
            let (k, v) = (k_buf.narrow(2, 3, keys).unwrap(), v_buf.narrow(2, 3, keys).unwrap());
            let q = Tensor::randn(0f32, 1.0, (1, heads, 1, d), &dev).unwrap();
            for softcap in [None, Some(5.0f32)] {
                let p = Params { heads, kv_heads, head_dim: d, scale: 0.25, softcap };
                assert!(takes(&q, &k, &v));
                let got = decode_with(&q, &k, &v, p, simd).unwrap();
                let (k, v) = (k.to_dtype(DType::F32).unwrap(), v.to_dtype(DType::F32).unwrap());
                let qg = q.reshape((1, kv_heads, heads / kv_heads, d)).unwrap();
                let mut s = (qg.matmul(&k.t().unwrap()).unwrap() * 0.25).unwrap();
                if let Some(c) = softcap {
                    s = ((s / c as f64).unwrap().tanh().unwrap() * c as f64).unwrap();
                }
                let probs = candle_nn::ops::softmax(&s, D::Minus1).unwrap();
                let want = probs.matmul(&v.contiguous().unwrap()).unwrap().reshape((1, heads, d)).unwrap();
                let diff = (got - want).unwrap().abs().unwrap().max_all().unwrap().to_scalar::<f32>().unwrap();
                assert!(diff < 1e-5, "{dtype:?} simd {simd} softcap {softcap:?}: max difference {diff}");
            }
        }
    }
}
