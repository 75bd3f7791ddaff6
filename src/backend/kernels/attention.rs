//! One decode step's attention over a float32 or float16 KV cache, read in place.
//!
//! Through candle, a decoded token's scores and weighted values are two batched GEMMs of one
//! row each, and the `gemm` crate packs its operands first: every step copied the layer's whole
//! cache before reading it (perf on SmolLM2-135M at 512 tokens: `pack_lhs` and the micro-kernels
//! 15% of decode). Here each key and value row is read once, straight from the cache, for every
//! query head of its group; kv heads run in parallel. A float16 cache (quantized models) is
//! widened in registers as it is read: F16C on x86 CPUs that have it, `fcvtl` on every aarch64 one.

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
pub(super) fn decode_with(q: &Tensor, k: &Tensor, v: &Tensor, p: Params, simd: bool) -> candle_core::Result<Tensor> {
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
            #[cfg(target_arch = "aarch64")]
            if simd {
                // SAFETY: NEON and its half-precision conversions are part of every aarch64 CPU.
                return unsafe { arm::head_group_f16(qh, kh, vh, oh, d, p.scale, p.softcap) };
            }
            head_group(qh, kh, vh, oh, d, p.scale, p.softcap, dot, axpy)
        }),
        _ => candle_core::bail!("decode attention expects a float32 or float16 CPU cache"),
    }
    drop((ks, vs));
    Tensor::from_vec(out, (1, p.heads, d), k.device())
}

/// Keys per block of the prompt kernel: the block's keys and values are widened to float32 once
/// (64 × 256 × 4 bytes each at most, in L2) and read by every query row of a tile.
const KEY_BLOCK: usize = 64;
/// Query rows per task of the prompt kernel: with a group of query heads per kv head, the
/// running sums of a task are `QUERY_TILE × group × head_dim` float32.
const QUERY_TILE: usize = 16;

/// Where a prompt step's queries sit among the keys it attends.
#[derive(Debug, Clone, Copy)]
pub struct PromptSpan {
    /// The index, in the key views, of query row 0's own key (its position minus the first
    /// key's); row `i` sees keys up to `offset + i`.
    pub offset: usize,
    /// The absolute position of key 0 in the views, so key blocks start at the same positions
    /// however a prompt was cut into steps (a row's result does not depend on the cut).
    pub first_key: usize,
    /// A row sees only the `window` keys ending at its own (transformers' convention), if set.
    pub window: Option<usize>,
}

/// Causal (and sliding-window) attention of prompt rows, tiled: `q` `[1, heads, t, d]` float32
/// against the cache views `k`, `v` `[1, kv_heads, keys, d]` (float32 or float16, read in
/// place), with an online softmax over blocks of keys, so no `t × keys` score matrix, mask or
/// widened copy of the cache is ever made. Returns each row's heads, `[t, heads, d]`.
pub fn prompt(q: &Tensor, k: &Tensor, v: &Tensor, span: PromptSpan, p: Params) -> candle_core::Result<Tensor> {
    let d = p.head_dim;
    let t = q.dim(2)?;
    let keys = k.dim(2)?;
    if q.dims() != [1, p.heads, t, d] || p.kv_heads == 0 || p.heads % p.kv_heads != 0 {
        candle_core::bail!("prompt attention: queries {:?} for {} heads of {d}", q.dims(), p.heads)
    }
    if span.offset + t > keys {
        candle_core::bail!("prompt attention: {t} rows from key {} past the {keys} keys held", span.offset)
    }
    let group = p.heads / p.kv_heads;
    let q = q.contiguous()?.flatten_all()?.to_vec1::<f32>()?; // [heads, t, d]
    let mut out = vec![0f32; t * p.heads * d];
    let (ks, kl) = k.storage_and_layout();
    let (vs, vl) = v.storage_and_layout();
    let (k_head, v_head) = (kl.stride()[1], vl.stride()[1]);
    let (k0, v0) = (kl.start_offset(), vl.start_offset());
    let ptr = super::OutPtr(out.as_mut_ptr());
    let tiles = t.div_ceil(QUERY_TILE);
    let each_tile = |f: &(dyn Fn(usize, std::ops::Range<usize>, usize, usize) + Sync)| {
        super::parallel_for(p.kv_heads * tiles, |task| {
            let (h, tile) = (task / tiles, task % tiles);
            let rows = tile * QUERY_TILE..((tile + 1) * QUERY_TILE).min(t);
            f(h, rows, k0 + h * k_head, v0 + h * v_head)
        })
    };
    let run = |h: usize, rows: std::ops::Range<usize>, kh: &dyn Fn(usize, &mut [f32]), vh: &dyn Fn(usize, &mut [f32])| {
        #[allow(clippy::redundant_locals)]
        let ptr = ptr;
        let tile = PromptTile { q: &q, t, d, group, h, rows, span, p };
        tile.run(kh, vh, |row, head, values| {
            // SAFETY: each (row, head) is written by the one task that owns its row tile and kv head.
            let o = unsafe { std::slice::from_raw_parts_mut(ptr.0.add((row * p.heads + head) * d), d) };
            o.copy_from_slice(values);
        });
    };
    match (&*ks, &*vs) {
        (Storage::Cpu(CpuStorage::F32(kd)), Storage::Cpu(CpuStorage::F32(vd))) => each_tile(&|h, rows, ko, vo| {
            let key = |j: usize, dst: &mut [f32]| dst.copy_from_slice(&kd[ko + j * d..][..dst.len()]);
            let value = |j: usize, dst: &mut [f32]| dst.copy_from_slice(&vd[vo + j * d..][..dst.len()]);
            run(h, rows, &key, &value)
        }),
        (Storage::Cpu(CpuStorage::F16(kd)), Storage::Cpu(CpuStorage::F16(vd))) => each_tile(&|h, rows, ko, vo| {
            use half::slice::HalfFloatSliceExt;
            let key = |j: usize, dst: &mut [f32]| kd[ko + j * d..][..dst.len()].convert_to_f32_slice(dst);
            let value = |j: usize, dst: &mut [f32]| vd[vo + j * d..][..dst.len()].convert_to_f32_slice(dst);
            run(h, rows, &key, &value)
        }),
        _ => candle_core::bail!("prompt attention expects a float32 or float16 CPU cache"),
    }
    drop((ks, vs));
    Tensor::from_vec(out, (t, p.heads, d), k.device())
}

/// One task of `prompt`: a tile of query rows of one kv head's group of query heads.
struct PromptTile<'a> {
    /// All queries, `[heads, t, d]`.
    q: &'a [f32],
    t: usize,
    d: usize,
    group: usize,
    /// The kv head.
    h: usize,
    rows: std::ops::Range<usize>,
    span: PromptSpan,
    p: Params,
}

impl PromptTile<'_> {
    /// The keys row `i` sees, as indices into the views.
    fn visible(&self, i: usize) -> std::ops::Range<usize> {
        let own = self.span.offset + i;
        let first_abs = self.span.window.map_or(0, |w| (self.span.first_key + own + 1).saturating_sub(w));
        first_abs.saturating_sub(self.span.first_key)..own + 1
    }

    /// Runs the tile: `key(j, dst)` / `value(j, dst)` write `dst.len() / d` float32 rows from
    /// key `j` on; `emit(row, head, out)` receives each finished output.
    fn run(&self, key: &dyn Fn(usize, &mut [f32]), value: &dyn Fn(usize, &mut [f32]), emit: impl Fn(usize, usize, &[f32])) {
        let (d, group, n_rows) = (self.d, self.group, self.rows.len());
        let vectors = n_rows * group;
        let lo = self.visible(self.rows.start).start;
        let hi = self.visible(self.rows.end - 1).end;
        let mut max = vec![f32::NEG_INFINITY; vectors];
        let mut sum = vec![0f32; vectors];
        let mut acc = vec![0f32; vectors * d];
        let mut kb = vec![0f32; KEY_BLOCK * d];
        let mut vb = vec![0f32; KEY_BLOCK * d];
        let mut scores = vec![0f32; KEY_BLOCK];
        // Blocks start at absolute multiples of KEY_BLOCK, whatever the views' first key.
        let first = self.span.first_key;
        let mut start = lo;
        while start < hi {
            let end = hi.min(((first + start) / KEY_BLOCK + 1) * KEY_BLOCK - first);
            let n = end - start;
            key(start, &mut kb[..n * d]);
            value(start, &mut vb[..n * d]);
            for (r, row) in self.rows.clone().enumerate() {
                let seen = self.visible(row);
                let (a, b) = (seen.start.max(start), seen.end.min(end));
                if a >= b {
                    continue;
                }
                for g in 0..group {
                    let head = self.h * group + g;
                    let qv = &self.q[(head * self.t + row) * d..][..d];
                    let slot = r * group + g;
                    let s = &mut scores[..b - a];
                    let mut block_max = f32::NEG_INFINITY;
                    for (j, sj) in (a..b).zip(s.iter_mut()) {
                        let mut x = dot(qv, &kb[(j - start) * d..][..d]) * self.p.scale;
                        if let Some(cap) = self.p.softcap {
                            x = cap * (x / cap).tanh();
                        }
                        *sj = x;
                        block_max = block_max.max(x);
                    }
                    let new_max = max[slot].max(block_max);
                    let correction = (max[slot] - new_max).exp();
                    max[slot] = new_max;
                    let out = &mut acc[slot * d..][..d];
                    if correction != 1.0 {
                        sum[slot] *= correction;
                        out.iter_mut().for_each(|o| *o *= correction);
                    }
                    for (j, &sj) in (a..b).zip(s.iter()) {
                        let w = (sj - new_max).exp();
                        sum[slot] += w;
                        axpy(out, w, &vb[(j - start) * d..][..d]);
                    }
                }
            }
            start = end;
        }
        for (r, row) in self.rows.clone().enumerate() {
            for g in 0..group {
                let slot = r * group + g;
                let inv = 1.0 / sum[slot];
                let out = &mut acc[slot * d..][..d];
                out.iter_mut().for_each(|o| *o *= inv);
                emit(row, self.h * group + g, out);
            }
        }
    }
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

#[cfg(target_arch = "aarch64")]
mod arm {
    use super::*;
    use std::arch::aarch64::*;

    /// `head_group` over a float16 cache, 8 values per step (`d` is a multiple of 8).
    #[allow(clippy::too_many_arguments)]
    pub(super) unsafe fn head_group_f16(
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

    /// Eight float16 values from `p[i]` widened.
    #[inline(always)]
    unsafe fn load8(p: &[f16], i: usize) -> [float32x4_t; 2] {
        crate::backend::kernels::arm::widen_f16x8(p.as_ptr().add(i))
    }

    #[inline(always)]
    unsafe fn dot_f16(a: &[f32], b: &[f16]) -> f32 {
        let (mut acc0, mut acc1) = (vdupq_n_f32(0.0), vdupq_n_f32(0.0));
        for i in (0..a.len().min(b.len()) / 8 * 8).step_by(8) {
            let [lo, hi] = load8(b, i);
            acc0 = vfmaq_f32(acc0, vld1q_f32(a.as_ptr().add(i)), lo);
            acc1 = vfmaq_f32(acc1, vld1q_f32(a.as_ptr().add(i + 4)), hi);
        }
        vaddvq_f32(vaddq_f32(acc0, acc1))
    }

    #[inline(always)]
    unsafe fn axpy_f16(out: &mut [f32], w: f32, x: &[f16]) {
        for i in (0..out.len().min(x.len()) / 8 * 8).step_by(8) {
            let [lo, hi] = load8(x, i);
            let o = out.as_mut_ptr().add(i);
            vst1q_f32(o, vfmaq_n_f32(vld1q_f32(o), lo, w));
            vst1q_f32(o.add(4), vfmaq_n_f32(vld1q_f32(o.add(4)), hi, w));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::{Device, D};

    /// The tiled prompt kernel equals materialised scores under the causal and sliding-window
    /// masks within 1e-5 relative L2: several query tiles and key blocks, the views starting at
    /// a key that is not a block boundary, float32 and float16 caches, with and without softcap.
    #[test]
    fn tiled_prompt_attention_equals_masked_softmax() {
        let dev = Device::Cpu;
        let (heads, kv_heads, d) = (4, 2, 16);
        for (dtype, window, first_key, held, t) in [
            (DType::F32, None, 0, 0, 37),
            (DType::F16, None, 0, 150, 40),
            (DType::F32, Some(50), 101, 90, 33),
            (DType::F16, Some(7), 13, 6, 70),
            (DType::F32, Some(500), 0, 0, 130),
        ] {
            let keys = held + t;
            let cap = keys + 5;
            let k_buf = Tensor::randn(0f32, 1.0, (1, kv_heads, cap, d), &dev).unwrap().to_dtype(dtype).unwrap();
            let v_buf = Tensor::randn(0f32, 1.0, (1, kv_heads, cap, d), &dev).unwrap().to_dtype(dtype).unwrap();
            let (k, v) = (k_buf.narrow(2, 2, keys).unwrap(), v_buf.narrow(2, 2, keys).unwrap());
            let q = Tensor::randn(0f32, 1.0, (1, heads, t, d), &dev).unwrap();
            for softcap in [None, Some(3.0f32)] {
                let p = Params { heads, kv_heads, head_dim: d, scale: 0.3, softcap };
                let span = PromptSpan { offset: held, first_key, window };
                let got = prompt(&q, &k, &v, span, p).unwrap(); // [t, heads, d]
                let (kf, vf) = (k.to_dtype(DType::F32).unwrap(), v.to_dtype(DType::F32).unwrap());
                let qg = q.reshape((1, kv_heads, heads / kv_heads * t, d)).unwrap();
                let mut s = (qg.matmul(&kf.t().unwrap()).unwrap() * 0.3).unwrap();
                if let Some(c) = softcap {
                    s = ((s / c as f64).unwrap().tanh().unwrap() * c as f64).unwrap();
                }
                let mut mask = vec![0f32; t * keys];
                for i in 0..t {
                    for j in 0..keys {
                        let (qa, ka) = (first_key + held + i, first_key + j);
                        if ka > qa || window.is_some_and(|w| qa - ka >= w) {
                            mask[i * keys + j] = f32::NEG_INFINITY;
                        }
                    }
                }
                let mask = Tensor::from_vec(mask, (t, keys), &dev).unwrap();
                let s = s.reshape((1, heads, t, keys)).unwrap().broadcast_add(&mask).unwrap();
                let probs = candle_nn::ops::softmax(&s, D::Minus1).unwrap().reshape((1, kv_heads, heads / kv_heads * t, keys)).unwrap();
                let want = probs.matmul(&vf.contiguous().unwrap()).unwrap().reshape((heads, t, d)).unwrap();
                let want = want.transpose(0, 1).unwrap();
                let err = (&got - &want).unwrap().sqr().unwrap().sum_all().unwrap().to_scalar::<f32>().unwrap().sqrt()
                    / want.sqr().unwrap().sum_all().unwrap().to_scalar::<f32>().unwrap().sqrt();
                assert!(err < 1e-5, "{dtype:?} window {window:?} first {first_key} held {held} t {t} softcap {softcap:?}: rel L2 {err}");
            }
        }
    }

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
