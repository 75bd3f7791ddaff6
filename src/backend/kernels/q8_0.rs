//! A tiled Q8_0 × Q8_0 matrix product for prefill on x86-64 (AVX2, FMA).
//!
//! candle's quantized CPU matmul computes one dot product at a time, loading both blocks
//! for every (row, column) pair. Here a 4×4 tile of rows and weight columns shares its loads:
//! each 32-value block of activations and weights is read once per tile and feeds 4 products.
//! Activations are quantized to Q8_0 exactly as candle (and ggml) do, so the result equals the
//! quantized path's up to the order of float additions.

use candle_core::{CpuStorage, CustomOp1, Layout, Shape};
use half::f16;
use rayon::prelude::*;

const QK: usize = 32;
const BLOCK_BYTES: usize = 2 + QK;

/// Activations quantized per row into Q8_0: one scale and 32 int8 values per block.
struct QuantizedRows {
    scales: Vec<f32>,
    values: Vec<i8>,
}

/// Quantizes float32 rows (a whole number of 32-value blocks each) as candle's `BlockQ8_0::from_float` does.
fn quantize_rows(x: &[f32]) -> QuantizedRows {
    let blocks = x.len() / QK;
    let mut scales = Vec::with_capacity(blocks);
    let mut values = vec![0i8; x.len()];
    for (b, chunk) in x.chunks_exact(QK).enumerate() {
        let amax = chunk.iter().fold(0f32, |a, &v| a.max(v.abs()));
        let d = amax / 127.0;
        let id = if d != 0.0 { 1.0 / d } else { 0.0 };
        scales.push(f16::from_f32(d).to_f32());
        for (q, &v) in values[b * QK..(b + 1) * QK].iter_mut().zip(chunk) {
            *q = (v * id).round() as i8;
        }
    }
    QuantizedRows { scales, values }
}

/// The weight's block scales as float32, and a pointer to its int8 values, per block.
struct Weights<'a> {
    bytes: &'a [u8],
}

impl Weights<'_> {
    #[inline(always)]
    fn scale(&self, block: usize) -> f32 {
        let o = block * BLOCK_BYTES;
        f16::from_bits(u16::from_le_bytes([self.bytes[o], self.bytes[o + 1]])).to_f32()
    }
    #[inline(always)]
    fn values(&self, block: usize) -> *const u8 {
        self.bytes[block * BLOCK_BYTES + 2..].as_ptr()
    }
}

#[cfg(target_arch = "x86_64")]
mod avx2 {
    use super::*;
    use std::arch::x86_64::*;

    #[inline(always)]
    unsafe fn hsum(v: __m256) -> f32 {
        let hi = _mm256_extractf128_ps(v, 1);
        let s = _mm_add_ps(hi, _mm256_castps256_ps128(v));
        let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
        let s = _mm_add_ss(s, _mm_movehdup_ps(s));
        _mm_cvtss_f32(s)
    }

    /// The products of `R` rows from `row0` with `C` weight rows from `col0`, into `out`.
    /// `dot` is the int8 dot product of 32 unsigned by 32 signed bytes, as 8 int32 lanes.
    #[inline(always)]
    unsafe fn tile_with<const R: usize, const C: usize>(
        xq: &QuantizedRows,
        w: &Weights<'_>,
        nb: usize,
        row0: usize,
        col0: usize,
        out: *mut f32,
        n: usize,
        dot: impl Fn(__m256i, __m256i) -> __m256i,
    ) {
        let mut acc = [[_mm256_setzero_ps(); C]; R];
        for b in 0..nb {
            let mut wv = [_mm256_setzero_si256(); C];
            let mut aw = [_mm256_setzero_si256(); C];
            let mut wd = [0f32; C];
            for c in 0..C {
                let blk = (col0 + c) * nb + b;
                wv[c] = _mm256_loadu_si256(w.values(blk) as *const __m256i);
                // |w|, so the product is unsigned × (x with w's sign), as the int8 dot needs.
                aw[c] = _mm256_sign_epi8(wv[c], wv[c]);
                wd[c] = w.scale(blk);
            }
            for r in 0..R {
                let xi = (row0 + r) * nb + b;
                let xv = _mm256_loadu_si256(xq.values.as_ptr().add(xi * QK) as *const __m256i);
                let xd = *xq.scales.get_unchecked(xi);
                for c in 0..C {
                    let p = dot(aw[c], _mm256_sign_epi8(xv, wv[c]));
                    acc[r][c] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), _mm256_set1_ps(xd * wd[c]), acc[r][c]);
                }
            }
        }
        for r in 0..R {
            for c in 0..C {
                *out.add((row0 + r) * n + col0 + c) = hsum(acc[r][c]);
            }
        }
    }

    /// The AVX2 tile: `maddubs` then `madd` for the int8 dot product.
    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn tile<const R: usize, const C: usize>(
        xq: &QuantizedRows,
        w: &Weights<'_>,
        nb: usize,
        row0: usize,
        col0: usize,
        out: *mut f32,
        n: usize,
    ) {
        let ones = _mm256_set1_epi16(1);
        tile_with::<R, C>(xq, w, nb, row0, col0, out, n, |a, b| _mm256_madd_epi16(_mm256_maddubs_epi16(a, b), ones))
    }

    /// The AVX-512 VNNI tile: one `vpdpbusd` per int8 dot product.
    #[target_feature(enable = "avx2,fma,avx512f,avx512vl,avx512vnni")]
    pub(super) unsafe fn tile_vnni<const R: usize, const C: usize>(
        xq: &QuantizedRows,
        w: &Weights<'_>,
        nb: usize,
        row0: usize,
        col0: usize,
        out: *mut f32,
        n: usize,
    ) {
        tile_with::<R, C>(xq, w, nb, row0, col0, out, n, |a, b| _mm256_dpbusd_epi32(_mm256_setzero_si256(), a, b))
    }
}

/// Whether this machine runs the kernel.
pub fn available() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma")
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

/// Whether AVX-512 VNNI (the one-instruction int8 dot product) is there.
fn has_vnni() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        is_x86_feature_detected!("avx512vnni") && is_x86_feature_detected!("avx512vl")
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

#[derive(Clone, Copy)]
struct OutPtr(*mut f32);
// SAFETY: every worker writes a disjoint set of columns of the output.
unsafe impl Send for OutPtr {}
unsafe impl Sync for OutPtr {}

/// `x [m, k] · wᵀ` for Q8_0 weight blocks `w` of `n` rows of `k` values.
pub fn matmul(x: &[f32], m: usize, k: usize, w: &[u8], n: usize) -> Vec<f32> {
    matmul_with(x, m, k, w, n, has_vnni())
}

fn matmul_with(x: &[f32], m: usize, k: usize, w: &[u8], n: usize, vnni: bool) -> Vec<f32> {
    assert!(available(), "the Q8_0 kernel needs AVX2 and FMA");
    assert_eq!(k % QK, 0);
    assert_eq!(x.len(), m * k);
    assert_eq!(w.len(), n * (k / QK) * BLOCK_BYTES);
    let nb = k / QK;
    let xq = quantize_rows(x);
    let weights = Weights { bytes: w };
    let mut out = vec![0f32; m * n];
    let ptr = OutPtr(out.as_mut_ptr());
    // Work items are groups of 4 weight rows (output columns); each covers every activation row.
    let col_groups = n.div_ceil(4);
    (0..col_groups).into_par_iter().with_min_len(8).for_each(|g| {
        let ptr = ptr;
        let col0 = g * 4;
        let cols = 4.min(n - col0);
        let full_rows = m / 4 * 4;
        #[cfg(target_arch = "x86_64")]
        // SAFETY: the features were checked; indices stay inside x, w and out by construction.
        unsafe {
            macro_rules! run {
                ($tile:ident) => {{
                    for row0 in (0..full_rows).step_by(4) {
                        if cols == 4 {
                            avx2::$tile::<4, 4>(&xq, &weights, nb, row0, col0, ptr.0, n)
                        } else {
                            for c in 0..cols {
                                avx2::$tile::<4, 1>(&xq, &weights, nb, row0, col0 + c, ptr.0, n)
                            }
                        }
                    }
                    // The last 1-3 rows still share each weight load across the 4 columns
                    // (a decode batch of 2 or 3 rows is all remainder).
                    let rest = m - full_rows;
                    if cols == 4 && rest > 0 {
                        match rest {
                            1 => avx2::$tile::<1, 4>(&xq, &weights, nb, full_rows, col0, ptr.0, n),
                            2 => avx2::$tile::<2, 4>(&xq, &weights, nb, full_rows, col0, ptr.0, n),
                            _ => avx2::$tile::<3, 4>(&xq, &weights, nb, full_rows, col0, ptr.0, n),
                        }
                    } else {
                        for row0 in full_rows..m {
                            for c in 0..cols {
                                avx2::$tile::<1, 1>(&xq, &weights, nb, row0, col0 + c, ptr.0, n)
                            }
                        }
                    }
                }};
            }
            if vnni {
                run!(tile_vnni)
            } else {
                run!(tile)
            }
        }
    });
    out
}

/// The kernel as a candle op on `x [m, k]`, the weight captured with its shape.
pub struct Q8_0MatMul<'a> {
    /// Q8_0 blocks of the `[n, k]` weight.
    pub weight: &'a [u8],
    /// Weight rows (output width).
    pub n: usize,
    /// Weight columns (input width).
    pub k: usize,
}

impl CustomOp1 for Q8_0MatMul<'_> {
    fn name(&self) -> &'static str {
        "candlewick-q8_0-matmul"
    }

    fn cpu_fwd(&self, storage: &CpuStorage, layout: &Layout) -> candle_core::Result<(CpuStorage, Shape)> {
        let CpuStorage::F32(data) = storage else { candle_core::bail!("Q8_0 matmul expects float32 input") };
        let Some((start, end)) = layout.contiguous_offsets() else {
            candle_core::bail!("Q8_0 matmul expects a contiguous input")
        };
        let (m, k) = layout.shape().dims2()?;
        if k != self.k {
            candle_core::bail!("Q8_0 matmul: input width {k}, weight width {}", self.k)
        }
        let out = matmul(&data[start..end], m, k, self.weight, self.n);
        Ok((CpuStorage::F32(out), Shape::from((m, self.n))))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::quantized::{GgmlDType, QMatMul, QTensor};
    use candle_core::{Device, Module, Tensor};

    #[test]
    fn equals_candles_quantized_matmul() {
        if !available() {
            return;
        }
        let dev = Device::Cpu;
        for (m, k, n) in [(1, 64, 5), (2, 64, 8), (3, 128, 12), (6, 96, 16), (7, 96, 9), (16, 640, 36), (33, 128, 4)] {
            let w = Tensor::randn(0f32, 1.0, (n, k), &dev).unwrap();
            let x = Tensor::randn(0f32, 1.0, (m, k), &dev).unwrap();
            let q = QTensor::quantize(&w, GgmlDType::Q8_0).unwrap();
            let data = q.data().unwrap().to_vec();
            let want = QMatMul::from_qtensor(q).unwrap().forward(&x).unwrap();
            let want = want.flatten_all().unwrap().to_vec1::<f32>().unwrap();
            let xs = x.flatten_all().unwrap().to_vec1::<f32>().unwrap();
            for vnni in [false, has_vnni()] {
                let got = matmul_with(&xs, m, k, &data, n, vnni);
                for (a, b) in got.iter().zip(&want) {
                    assert!((a - b).abs() <= 1e-4 * (1.0 + b.abs()), "({m},{k},{n}) vnni={vnni}: {a} vs {b}");
                }
            }
        }
    }
}
