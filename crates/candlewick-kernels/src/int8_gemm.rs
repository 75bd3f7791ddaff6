//! A tiled int8 matrix product for ggml's 32-value block formats (Q4_0, Q4_1, Q5_0, Q5_1,
//! Q8_0): on x86-64 an AVX2 and an AVX-512 VNNI inner product, on aarch64 a NEON one (`smull`),
//! one with `sdot` (dotprod) and one with `smmla` (i8mm), chosen at run time.
//!
//! candle's quantized CPU matmul computes one dot product at a time, loading both blocks for
//! every (row, column) pair, and runs Q4_1, Q5_0 and Q5_1 with scalar code. Here an R×C tile
//! of activation rows and weight rows shares its loads: each weight block is unpacked to 32
//! bytes once per tile and feeds R products. Activations are quantized per 32-value block as
//! ggml's Q8_0/Q8_1 are (scale `d`, int8 values, and `s = d·Σq` for the formats with an
//! offset), so the result equals candle's up to the order of float additions and the f16
//! rounding ggml applies to `s`.
//!
//! Every format is `value = d·q + m` with `q` unsigned (0..16 or 0..32; `m = -8d` or `-16d`
//! for the symmetric ones) except Q8_0, whose `q` is signed and `m = 0`; a block's product
//! with activations `d'·q'` is `d·d'·Σ q·q' + m·s'`.

use candle_core::quantized::GgmlDType;
use candle_core::{CpuStorage, CustomOp1, Layout, Shape};
use half::f16;

const QK: usize = 32;

/// A block format the kernel multiplies.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BlockFormat {
    /// `d·(q − 8)`, 4-bit `q`.
    Q4_0,
    /// `d·q + m`, 4-bit `q`.
    Q4_1,
    /// `d·(q − 16)`, 5-bit `q`.
    Q5_0,
    /// `d·q + m`, 5-bit `q`.
    Q5_1,
    /// `d·q`, signed 8-bit `q`.
    Q8_0,
}

impl BlockFormat {
    /// The format of a ggml type, if the kernel multiplies it.
    pub fn of(dtype: GgmlDType) -> Option<Self> {
        Some(match dtype {
            GgmlDType::Q4_0 => Self::Q4_0,
            GgmlDType::Q4_1 => Self::Q4_1,
            GgmlDType::Q5_0 => Self::Q5_0,
            GgmlDType::Q5_1 => Self::Q5_1,
            GgmlDType::Q8_0 => Self::Q8_0,
            _ => return None,
        })
    }

    /// Bytes of one block.
    pub const fn block_bytes(self) -> usize {
        match self {
            Self::Q4_0 => 2 + QK / 2,
            Self::Q4_1 => 4 + QK / 2,
            Self::Q5_0 => 2 + 4 + QK / 2,
            Self::Q5_1 => 4 + 4 + QK / 2,
            Self::Q8_0 => 2 + QK,
        }
    }
}

/// Activations quantized per row into 32-value blocks: scale, int8 values, `Σq` and `d·Σq`.
pub(super) struct QuantizedRows {
    pub(super) scales: Vec<f32>,
    // Only the interleaved tiles (x86, Arm) start their integer sums from it.
    #[cfg_attr(not(any(target_arch = "x86_64", target_arch = "aarch64")), allow(dead_code))]
    pub(super) qsums: Vec<i32>,
    pub(super) sums: Vec<f32>,
    pub(super) values: Vec<i8>,
}

/// Quantizes float32 rows (a whole number of blocks each) as ggml's `quantize_row_q8_0/q8_1` do.
/// A prompt's rows are split over the worker threads: serial, this was 15% of a 512-token Gemma
/// 3 270M prefill on one thread, more on two.
pub(super) fn quantize_rows(x: &[f32]) -> QuantizedRows {
    let blocks = x.len() / QK;
    let mut out = QuantizedRows {
        scales: vec![0.0; blocks],
        qsums: vec![0; blocks],
        sums: vec![0.0; blocks],
        values: vec![0; blocks * QK],
    };
    // Blocks per task: about 16 KiB of input, so a decode step's row stays on one thread.
    const TASK_BLOCKS: usize = 128;
    let tasks = blocks.div_ceil(TASK_BLOCKS);
    if tasks <= 1 {
        quantize_blocks(x, (&mut out.scales, &mut out.qsums, &mut out.sums, &mut out.values));
        return out;
    }
    let ptr = QuantizedPtr(&mut out);
    super::parallel_for(tasks, |t| {
        // The closure must capture the whole `Send` wrapper, not its raw-pointer field.
        #[allow(clippy::redundant_locals)]
        let ptr = ptr;
        let range = t * TASK_BLOCKS..((t + 1) * TASK_BLOCKS).min(blocks);
        // SAFETY: tasks write disjoint block ranges of vectors sized above, which outlive the call.
        unsafe { quantize_blocks(&x[range.start * QK..range.end * QK], ptr.slices(range)) };
    });
    out
}

/// `QuantizedRows` shared with the workers that fill disjoint blocks of it.
#[derive(Clone, Copy)]
struct QuantizedPtr(*mut QuantizedRows);
// SAFETY: each task touches only its own block range (see `quantize_rows`).
unsafe impl Send for QuantizedPtr {}
unsafe impl Sync for QuantizedPtr {}

impl QuantizedPtr {
    /// Blocks `range` of scales, sums of values, scaled sums and values.
    ///
    /// # Safety
    /// No other live reference may overlap `range`.
    #[allow(clippy::mut_from_ref)]
    unsafe fn slices(&self, range: std::ops::Range<usize>) -> (&mut [f32], &mut [i32], &mut [f32], &mut [i8]) {
        let q = &mut *self.0;
        let n = range.len();
        (
            std::slice::from_raw_parts_mut(q.scales.as_mut_ptr().add(range.start), n),
            std::slice::from_raw_parts_mut(q.qsums.as_mut_ptr().add(range.start), n),
            std::slice::from_raw_parts_mut(q.sums.as_mut_ptr().add(range.start), n),
            std::slice::from_raw_parts_mut(q.values.as_mut_ptr().add(range.start * QK), n * QK),
        )
    }
}

/// Quantizes whole blocks of `x` into `(scales, qsums, sums, values)`, written so that the
/// compiler vectorizes each block (the obvious `fold(max)` and `round()` kept it scalar): the
/// largest magnitude as the maximum of the magnitudes' bit patterns (ordered as the values are,
/// NaN counted as 0, as `f32::max` ignores it), and `round` as `trunc(|q| + 0.49999997)` with
/// `q`'s sign, which equals it for every `|q| < 2^23` (a block's values are within ±127, or
/// infinite where its scale is subnormal) and for infinities and NaN.
fn quantize_blocks(x: &[f32], (scales, qsums, sums, values): (&mut [f32], &mut [i32], &mut [f32], &mut [i8])) {
    const HALF_BELOW: f32 = 0.499_999_97;
    for (b, chunk) in x.chunks_exact(QK).enumerate() {
        let chunk: &[f32; QK] = chunk.try_into().expect("whole blocks");
        let magnitude = |v: f32| match v.to_bits() & 0x7FFF_FFFF {
            nan if nan > 0x7F80_0000 => 0,
            bits => bits,
        };
        let top = chunk.iter().map(|&v| magnitude(v)).max().unwrap_or(0);
        let d = f32::from_bits(top) / 127.0;
        let id = if d != 0.0 { 1.0 / d } else { 0.0 };
        let q: &mut [i8; QK] = (&mut values[b * QK..(b + 1) * QK]).try_into().expect("whole blocks");
        let mut sum = 0i32;
        for (q, &v) in q.iter_mut().zip(chunk) {
            let scaled = v * id;
            let r = (scaled.abs() + HALF_BELOW).trunc().copysign(scaled);
            // `as i8`'s saturation and NaN → 0, spelled out: its own form stays scalar.
            let r = if r.is_nan() { 0.0 } else { r.clamp(-128.0, 127.0) };
            // SAFETY: `r` is a whole number in -128..=127.
            *q = unsafe { r.to_int_unchecked::<i32>() } as i8;
            sum += *q as i32;
        }
        let d = f16::from_f32(d).to_f32();
        scales[b] = d;
        qsums[b] = sum;
        sums[b] = d * sum as f32;
    }
}

#[inline(always)]
fn half_at(bytes: &[u8], o: usize) -> f32 {
    f16::from_bits(u16::from_le_bytes([bytes[o], bytes[o + 1]])).to_f32()
}

/// A block's scale and offset.
#[inline(always)]
fn scale_and_min(format: BlockFormat, block: &[u8]) -> (f32, f32) {
    let d = half_at(block, 0);
    match format {
        BlockFormat::Q4_0 => (d, -8.0 * d),
        BlockFormat::Q5_0 => (d, -16.0 * d),
        BlockFormat::Q4_1 | BlockFormat::Q5_1 => (d, half_at(block, 2)),
        BlockFormat::Q8_0 => (d, 0.0),
    }
}

/// A block's 32 values `q` (unsigned, or signed for Q8_0), portable code.
fn unpack(format: BlockFormat, block: &[u8]) -> [i32; QK] {
    let mut out = [0i32; QK];
    let nibbles = |qs: &[u8], j: usize| if j < QK / 2 { qs[j] & 0x0F } else { qs[j - QK / 2] >> 4 };
    match format {
        BlockFormat::Q8_0 => {
            for (o, &b) in out.iter_mut().zip(&block[2..]) {
                *o = b as i8 as i32;
            }
        }
        BlockFormat::Q4_0 | BlockFormat::Q4_1 => {
            let qs = &block[format.block_bytes() - QK / 2..];
            for (j, o) in out.iter_mut().enumerate() {
                *o = nibbles(qs, j) as i32;
            }
        }
        BlockFormat::Q5_0 | BlockFormat::Q5_1 => {
            let at = format.block_bytes() - QK / 2 - 4;
            let qh = u32::from_le_bytes([block[at], block[at + 1], block[at + 2], block[at + 3]]);
            let qs = &block[at + 4..];
            for (j, o) in out.iter_mut().enumerate() {
                *o = (nibbles(qs, j) | ((((qh >> j) & 1) as u8) << 4)) as i32;
            }
        }
    }
    out
}

#[cfg(target_arch = "x86_64")]
mod x86 {
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

    /// 16 bytes of nibbles as 32 bytes: low nibbles first, then high ones (ggml's order).
    #[inline(always)]
    unsafe fn nibbles(p: *const u8) -> __m256i {
        let tmp = _mm_loadu_si128(p as *const __m128i);
        let bytes = _mm256_set_m128i(_mm_srli_epi16(tmp, 4), tmp);
        _mm256_and_si256(bytes, _mm256_set1_epi8(0x0F))
    }

    /// Bit j of the 32-bit word at `p` as byte j: 0x10 where set, 0 where not.
    #[inline(always)]
    unsafe fn fifth_bits(p: *const u8) -> __m256i {
        let x32 = u32::from_le_bytes([*p, *p.add(1), *p.add(2), *p.add(3)]) as i32;
        let shuf = _mm256_set_epi64x(0x0303030303030303, 0x0202020202020202, 0x0101010101010101, 0);
        let bytes = _mm256_shuffle_epi8(_mm256_set1_epi32(x32), shuf);
        let bytes = _mm256_or_si256(bytes, _mm256_set1_epi64x(0x7fbfdfeff7fbfdfe));
        _mm256_and_si256(_mm256_cmpeq_epi8(bytes, _mm256_set1_epi64x(-1)), _mm256_set1_epi8(0x10))
    }

    /// A weight block's 32 values (unsigned, or signed for Q8_0), scale and offset.
    #[inline(always)]
    unsafe fn load(format: BlockFormat, block: *const u8) -> (__m256i, f32, f32) {
        let bytes = std::slice::from_raw_parts(block, format.block_bytes());
        let (d, m) = scale_and_min(format, bytes);
        let q = match format {
            BlockFormat::Q8_0 => _mm256_loadu_si256(block.add(2) as *const __m256i),
            BlockFormat::Q4_0 => nibbles(block.add(2)),
            BlockFormat::Q4_1 => nibbles(block.add(4)),
            BlockFormat::Q5_0 => _mm256_or_si256(nibbles(block.add(6)), fifth_bits(block.add(2))),
            BlockFormat::Q5_1 => _mm256_or_si256(nibbles(block.add(8)), fifth_bits(block.add(4))),
        };
        (q, d, m)
    }

    /// The products of `R` rows from `row0` with `C` weight rows from `col0`, into `out`.
    /// `dot` is the int8 dot product of 32 unsigned by 32 signed bytes, as 8 int32 lanes.
    #[inline(always)]
    #[allow(clippy::too_many_arguments)]
    unsafe fn tile_with<const R: usize, const C: usize>(
        format: BlockFormat,
        xq: &QuantizedRows,
        w: &[u8],
        nb: usize,
        row0: usize,
        col0: usize,
        out: *mut f32,
        n: usize,
        dot: impl Fn(__m256i, __m256i) -> __m256i,
    ) {
        let bb = format.block_bytes();
        let signed = format == BlockFormat::Q8_0;
        let mut acc = [[_mm256_setzero_ps(); C]; R];
        let mut offsets = [[0f32; C]; R];
        for b in 0..nb {
            let mut wv = [_mm256_setzero_si256(); C];
            let mut aw = [_mm256_setzero_si256(); C];
            let mut wd = [0f32; C];
            let mut wm = [0f32; C];
            for c in 0..C {
                let (q, d, m) = load(format, w.as_ptr().add(((col0 + c) * nb + b) * bb));
                wv[c] = q;
                // Signed weights: |w| times x carrying w's sign, as the unsigned × signed dot needs.
                aw[c] = if signed { _mm256_sign_epi8(q, q) } else { q };
                wd[c] = d;
                wm[c] = m;
            }
            for r in 0..R {
                let xi = (row0 + r) * nb + b;
                let xv = _mm256_loadu_si256(xq.values.as_ptr().add(xi * QK) as *const __m256i);
                let xd = *xq.scales.get_unchecked(xi);
                for c in 0..C {
                    let xs = if signed { _mm256_sign_epi8(xv, wv[c]) } else { xv };
                    let p = dot(aw[c], xs);
                    acc[r][c] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), _mm256_set1_ps(xd * wd[c]), acc[r][c]);
                }
                if !signed {
                    let xs = *xq.sums.get_unchecked(xi);
                    for c in 0..C {
                        offsets[r][c] += wm[c] * xs;
                    }
                }
            }
        }
        for r in 0..R {
            for c in 0..C {
                *out.add((row0 + r) * n + col0 + c) = hsum(acc[r][c]) + offsets[r][c];
            }
        }
    }

    /// The AVX2 tile: `maddubs` then `madd` for the int8 dot product.
    #[target_feature(enable = "avx2,fma")]
    #[allow(clippy::too_many_arguments)]
    pub(super) unsafe fn tile<const R: usize, const C: usize>(
        format: BlockFormat,
        xq: &QuantizedRows,
        w: &[u8],
        nb: usize,
        row0: usize,
        col0: usize,
        out: *mut f32,
        n: usize,
    ) {
        let ones = _mm256_set1_epi16(1);
        tile_with::<R, C>(format, xq, w, nb, row0, col0, out, n, |a, b| {
            _mm256_madd_epi16(_mm256_maddubs_epi16(a, b), ones)
        })
    }

    /// The AVX-512 VNNI tile: one `vpdpbusd` per int8 dot product.
    #[target_feature(enable = "avx2,fma,avx512f,avx512vl,avx512vnni")]
    #[allow(clippy::too_many_arguments)]
    pub(super) unsafe fn tile_vnni<const R: usize, const C: usize>(
        format: BlockFormat,
        xq: &QuantizedRows,
        w: &[u8],
        nb: usize,
        row0: usize,
        col0: usize,
        out: *mut f32,
        n: usize,
    ) {
        tile_with::<R, C>(format, xq, w, nb, row0, col0, out, n, |a, b| {
            _mm256_dpbusd_epi32(_mm256_setzero_si256(), a, b)
        })
    }
}

#[cfg(target_arch = "aarch64")]
mod arm {
    use super::*;
    use crate::arm::{sdot, smmla};
    use std::arch::aarch64::*;

    /// A block's 32 values as two vectors (values 0..16 and 16..32).
    type Block = [int8x16_t; 2];

    /// 16 bytes of nibbles as values 0..16 (low nibbles) and 16..32 (high ones), ggml's order.
    #[inline(always)]
    unsafe fn nibbles(p: *const u8) -> [uint8x16_t; 2] {
        let v = vld1q_u8(p);
        [vandq_u8(v, vdupq_n_u8(0x0F)), vshrq_n_u8::<4>(v)]
    }

    /// Bit j of the 32-bit word at `p` as byte j of the two vectors: 0x10 where set, 0 where not.
    #[inline(always)]
    unsafe fn fifth_bits(p: *const u8) -> [uint8x16_t; 2] {
        const BITS: [u8; 16] = [1, 2, 4, 8, 16, 32, 64, 128, 1, 2, 4, 8, 16, 32, 64, 128];
        let bits = vld1q_u8(BITS.as_ptr());
        let spread = |a: u8, b: u8| vcombine_u8(vdup_n_u8(a), vdup_n_u8(b));
        let sixteen = vdupq_n_u8(0x10);
        [
            vandq_u8(vtstq_u8(spread(*p, *p.add(1)), bits), sixteen),
            vandq_u8(vtstq_u8(spread(*p.add(2), *p.add(3)), bits), sixteen),
        ]
    }

    /// A weight block's 32 values (unsigned ones fit in i8 as they are; Q8_0's are signed),
    /// scale and offset.
    #[inline(always)]
    unsafe fn load(format: BlockFormat, block: *const u8) -> (Block, f32, f32) {
        let bytes = std::slice::from_raw_parts(block, format.block_bytes());
        let (d, m) = scale_and_min(format, bytes);
        let or = |a: [uint8x16_t; 2], b: [uint8x16_t; 2]| [vorrq_u8(a[0], b[0]), vorrq_u8(a[1], b[1])];
        let q = match format {
            BlockFormat::Q8_0 => {
                return ([vld1q_s8(block.add(2) as *const i8), vld1q_s8(block.add(18) as *const i8)], d, m)
            }
            BlockFormat::Q4_0 => nibbles(block.add(2)),
            BlockFormat::Q4_1 => nibbles(block.add(4)),
            BlockFormat::Q5_0 => or(nibbles(block.add(6)), fifth_bits(block.add(2))),
            BlockFormat::Q5_1 => or(nibbles(block.add(8)), fifth_bits(block.add(4))),
        };
        ([vreinterpretq_s8_u8(q[0]), vreinterpretq_s8_u8(q[1])], d, m)
    }

    /// An activation block's 32 values.
    #[inline(always)]
    unsafe fn activations(xq: &QuantizedRows, xi: usize) -> Block {
        let p = xq.values.as_ptr().add(xi * QK);
        [vld1q_s8(p), vld1q_s8(p.add(16))]
    }

    /// The products of `R` rows from `row0` with `C` weight rows from `col0`, into `out`.
    /// `dot` is the int8 dot product of two blocks, as 4 int32 lanes to be summed.
    #[inline(always)]
    #[allow(clippy::too_many_arguments)]
    unsafe fn tile_with<const R: usize, const C: usize>(
        format: BlockFormat,
        xq: &QuantizedRows,
        w: &[u8],
        nb: usize,
        row0: usize,
        col0: usize,
        out: *mut f32,
        n: usize,
        dot: impl Fn(Block, Block) -> int32x4_t,
    ) {
        let bb = format.block_bytes();
        let offset = format != BlockFormat::Q8_0;
        let mut acc = [[vdupq_n_f32(0.0); C]; R];
        let mut offsets = [[0f32; C]; R];
        for b in 0..nb {
            let loaded: [(Block, f32, f32); C] =
                std::array::from_fn(|c| load(format, w.as_ptr().add(((col0 + c) * nb + b) * bb)));
            for r in 0..R {
                let xi = (row0 + r) * nb + b;
                let xv = activations(xq, xi);
                let xd = *xq.scales.get_unchecked(xi);
                for c in 0..C {
                    let (wv, wd, _) = loaded[c];
                    acc[r][c] = vfmaq_n_f32(acc[r][c], vcvtq_f32_s32(dot(wv, xv)), xd * wd);
                }
                if offset {
                    let xs = *xq.sums.get_unchecked(xi);
                    for c in 0..C {
                        offsets[r][c] += loaded[c].2 * xs;
                    }
                }
            }
        }
        for r in 0..R {
            for c in 0..C {
                *out.add((row0 + r) * n + col0 + c) = vaddvq_f32(acc[r][c]) + offsets[r][c];
            }
        }
    }

    /// The plain NEON tile (any aarch64 CPU): `smull` into 16-bit products, pairwise added into
    /// 32-bit lanes (two products of at most 127·128 fit 16 bits).
    #[allow(clippy::too_many_arguments)]
    pub(super) unsafe fn tile<const R: usize, const C: usize>(
        format: BlockFormat,
        xq: &QuantizedRows,
        w: &[u8],
        nb: usize,
        row0: usize,
        col0: usize,
        out: *mut f32,
        n: usize,
    ) {
        tile_with::<R, C>(format, xq, w, nb, row0, col0, out, n, |a, b| {
            let mut p = vdupq_n_s32(0);
            for h in 0..2 {
                p = vpadalq_s16(p, vmull_s8(vget_low_s8(a[h]), vget_low_s8(b[h])));
                p = vpadalq_s16(p, vmull_high_s8(a[h], b[h]));
            }
            p
        })
    }

    /// The dotprod tile: two `sdot` per pair of blocks.
    #[target_feature(enable = "dotprod")]
    #[allow(clippy::too_many_arguments)]
    pub(super) unsafe fn tile_dot<const R: usize, const C: usize>(
        format: BlockFormat,
        xq: &QuantizedRows,
        w: &[u8],
        nb: usize,
        row0: usize,
        col0: usize,
        out: *mut f32,
        n: usize,
    ) {
        tile_with::<R, C>(format, xq, w, nb, row0, col0, out, n, |a, b| {
            sdot(sdot(vdupq_n_s32(0), a[0], b[0]), a[1], b[1])
        })
    }

    /// Two blocks as four 2×8 matrices for `smmla`: rows `a`, `b` of values `8i..8i + 8`.
    #[inline(always)]
    unsafe fn pairs(a: Block, b: Block) -> [int8x16_t; 4] {
        let zip = |a: int8x16_t, b: int8x16_t, high: bool| {
            let (a, b) = (vreinterpretq_s64_s8(a), vreinterpretq_s64_s8(b));
            vreinterpretq_s8_s64(if high { vzip2q_s64(a, b) } else { vzip1q_s64(a, b) })
        };
        [zip(a[0], b[0], false), zip(a[0], b[0], true), zip(a[1], b[1], false), zip(a[1], b[1], true)]
    }

    /// The i8mm tile: rows `row0..row0 + 2·R2` by weight rows `col0..col0 + 2·C2`, each 2×2 of
    /// them one `smmla` per 8 values (a one-row product wastes half of it: odd rows go to `tile_dot`).
    #[target_feature(enable = "dotprod,i8mm")]
    #[allow(clippy::too_many_arguments)]
    pub(super) unsafe fn tile_mm<const R2: usize, const C2: usize>(
        format: BlockFormat,
        xq: &QuantizedRows,
        w: &[u8],
        nb: usize,
        row0: usize,
        col0: usize,
        out: *mut f32,
        n: usize,
    ) {
        let bb = format.block_bytes();
        let offset = format != BlockFormat::Q8_0;
        // Lanes [r0·c0, r0·c1, r1·c0, r1·c1] of each pair of rows and pair of weight rows.
        let mut acc = [[vdupq_n_f32(0.0); C2]; R2];
        let mut offsets = [[[0f32; 4]; C2]; R2];
        for b in 0..nb {
            let mut wz = [[vdupq_n_s8(0); 4]; C2];
            let mut wd = [vdupq_n_f32(0.0); C2];
            let mut wm = [[0f32; 2]; C2];
            for cp in 0..C2 {
                let at = |c: usize| w.as_ptr().add(((col0 + 2 * cp + c) * nb + b) * bb);
                let ((w0, d0, m0), (w1, d1, m1)) = (load(format, at(0)), load(format, at(1)));
                wz[cp] = pairs(w0, w1);
                wd[cp] = vcombine_f32(vset_lane_f32::<1>(d1, vdup_n_f32(d0)), vset_lane_f32::<1>(d1, vdup_n_f32(d0)));
                wm[cp] = [m0, m1];
            }
            for rp in 0..R2 {
                let (x0, x1) = ((row0 + 2 * rp) * nb + b, (row0 + 2 * rp + 1) * nb + b);
                let xz = pairs(activations(xq, x0), activations(xq, x1));
                let (d0, d1) = (*xq.scales.get_unchecked(x0), *xq.scales.get_unchecked(x1));
                let xd = vcombine_f32(vdup_n_f32(d0), vdup_n_f32(d1));
                for cp in 0..C2 {
                    let mut p = vdupq_n_s32(0);
                    for i in 0..4 {
                        p = smmla(p, xz[i], wz[cp][i]);
                    }
                    acc[rp][cp] = vfmaq_f32(acc[rp][cp], vcvtq_f32_s32(p), vmulq_f32(xd, wd[cp]));
                }
                if offset {
                    let (s0, s1) = (*xq.sums.get_unchecked(x0), *xq.sums.get_unchecked(x1));
                    for cp in 0..C2 {
                        let o = &mut offsets[rp][cp];
                        let [m0, m1] = wm[cp];
                        o[0] += m0 * s0;
                        o[1] += m1 * s0;
                        o[2] += m0 * s1;
                        o[3] += m1 * s1;
                    }
                }
            }
        }
        for rp in 0..R2 {
            for cp in 0..C2 {
                let mut lanes = [0f32; 4];
                vst1q_f32(lanes.as_mut_ptr(), acc[rp][cp]);
                for (i, v) in lanes.into_iter().enumerate() {
                    let (r, c) = (row0 + 2 * rp + i / 2, col0 + 2 * cp + i % 2);
                    *out.add(r * n + c) = v + offsets[rp][cp][i];
                }
            }
        }
    }
}

/// Which inner product runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Path {
    /// Plain Rust: any CPU (the fallback, and the reference the fast paths are tested against).
    Portable,
    /// AVX2 + FMA.
    Avx2,
    /// AVX-512 VNNI.
    Avx512Vnni,
    /// NEON without extensions (`smull`): every aarch64 CPU.
    Neon,
    /// NEON with the dot-product extension (`sdot`; the interleaved tiles' only Arm path).
    NeonDot,
    /// NEON with the int8 matrix-multiply extension (`smmla`; `sdot` for an odd last row).
    NeonI8mm,
}

impl Path {
    /// The name `build_info()["int8_kernel"]` gives the path.
    pub fn name(self) -> &'static str {
        match self {
            Self::Portable => "portable",
            Self::Avx2 => "avx2",
            Self::Avx512Vnni => "avx512vnni",
            Self::Neon => "neon",
            Self::NeonDot => "neon-dotprod",
            Self::NeonI8mm => "neon-i8mm",
        }
    }

    /// Every path this CPU can run, the portable one first (what the tests force one by one).
    pub fn runnable() -> Vec<Self> {
        #[allow(unused_mut)]
        let mut out = vec![Self::Portable];
        #[cfg(target_arch = "x86_64")]
        {
            if is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma") {
                out.push(Self::Avx2);
            }
            if best_path() == Self::Avx512Vnni {
                out.push(Self::Avx512Vnni);
            }
        }
        #[cfg(target_arch = "aarch64")]
        {
            let f = super::arm::Features::get();
            out.push(Self::Neon);
            if f.dotprod {
                out.push(Self::NeonDot);
                if f.i8mm {
                    out.push(Self::NeonI8mm);
                }
            }
        }
        out
    }
}

/// The fastest path this CPU runs.
pub fn best_path() -> Path {
    #[cfg(target_arch = "x86_64")]
    {
        if is_x86_feature_detected!("avx512vnni") && is_x86_feature_detected!("avx512vl") {
            return Path::Avx512Vnni;
        }
        if is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma") {
            return Path::Avx2;
        }
    }
    arm_path().unwrap_or(Path::Portable)
}

/// The best NEON path of this aarch64 CPU.
#[cfg(target_arch = "aarch64")]
fn arm_path() -> Option<Path> {
    let f = super::arm::Features::get();
    Some(match (f.dotprod, f.i8mm) {
        (true, true) => Path::NeonI8mm,
        (true, false) => Path::NeonDot,
        _ => Path::Neon,
    })
}

/// No NEON path off aarch64.
#[cfg(not(target_arch = "aarch64"))]
fn arm_path() -> Option<Path> {
    None
}

/// Whether this CPU has a SIMD path (without one, candle's own kernels are the better choice).
pub fn available() -> bool {
    best_path() != Path::Portable
}

/// `x [m, k] · wᵀ` for `format` weight blocks `w` of `n` rows of `k` values.
pub fn matmul(format: BlockFormat, x: &[f32], m: usize, k: usize, w: &[u8], n: usize) -> Vec<f32> {
    matmul_with(format, x, m, k, w, n, best_path())
}

/// One column group (up to 4 weight rows) against every activation row, portable code.
#[allow(clippy::too_many_arguments)]
fn portable_columns(
    format: BlockFormat,
    xq: &QuantizedRows,
    w: &[u8],
    nb: usize,
    m: usize,
    col0: usize,
    cols: usize,
    out: super::OutPtr,
    n: usize,
) {
    let bb = format.block_bytes();
    for c in col0..col0 + cols {
        for r in 0..m {
            let mut total = 0f32;
            for b in 0..nb {
                let block = &w[(c * nb + b) * bb..(c * nb + b + 1) * bb];
                let (d, mn) = scale_and_min(format, block);
                let q = unpack(format, block);
                let xi = r * nb + b;
                let xs = &xq.values[xi * QK..(xi + 1) * QK];
                let dot: i32 = q.iter().zip(xs).map(|(&a, &b)| a * b as i32).sum();
                total += dot as f32 * d * xq.scales[xi] + mn * xq.sums[xi];
            }
            // SAFETY: this worker alone writes column c.
            unsafe { *out.0.add(r * n + c) = total };
        }
    }
}

/// `matmul` on a given path (at most what this CPU runs: the tests and probes force each one).
pub(super) fn matmul_with(
    format: BlockFormat,
    x: &[f32],
    m: usize,
    k: usize,
    w: &[u8],
    n: usize,
    path: Path,
) -> Vec<f32> {
    assert_eq!(k % QK, 0);
    assert_eq!(x.len(), m * k);
    assert_eq!(w.len(), n * (k / QK) * format.block_bytes());
    let nb = k / QK;
    let xq = quantize_rows(x);
    let mut out = vec![0f32; m * n];
    let ptr = super::OutPtr(out.as_mut_ptr());
    // Work items are groups of 4 weight rows (output columns); each covers every activation row.
    let col_groups = n.div_ceil(4);
    super::parallel_for(col_groups, |g| {
        // The closure must capture the whole `Send` wrapper, not its raw-pointer field.
        #[allow(clippy::redundant_locals)]
        let ptr = ptr;
        let col0 = g * 4;
        let cols = 4.min(n - col0);
        // 4×4 tiles over whole groups of 4 rows, then the last 1-3 rows still sharing each
        // weight load across the 4 columns (decode, one row, is all remainder); a last group of
        // fewer than 4 weight rows one column at a time.
        #[allow(unused_macros)]
        macro_rules! tiles {
            ($($tile:ident)::+) => {{
                let full_rows = m / 4 * 4;
                for row0 in (0..full_rows).step_by(4) {
                    if cols == 4 {
                        $($tile)::+::<4, 4>(format, &xq, w, nb, row0, col0, ptr.0, n)
                    } else {
                        for c in 0..cols {
                            $($tile)::+::<4, 1>(format, &xq, w, nb, row0, col0 + c, ptr.0, n)
                        }
                    }
                }
                let rest = m - full_rows;
                if cols == 4 && rest > 0 {
                    match rest {
                        1 => $($tile)::+::<1, 4>(format, &xq, w, nb, full_rows, col0, ptr.0, n),
                        2 => $($tile)::+::<2, 4>(format, &xq, w, nb, full_rows, col0, ptr.0, n),
                        _ => $($tile)::+::<3, 4>(format, &xq, w, nb, full_rows, col0, ptr.0, n),
                    }
                } else {
                    for row0 in full_rows..m {
                        for c in 0..cols {
                            $($tile)::+::<1, 1>(format, &xq, w, nb, row0, col0 + c, ptr.0, n)
                        }
                    }
                }
            }};
        }
        #[cfg(not(any(target_arch = "x86_64", target_arch = "aarch64")))]
        portable_columns(format, &xq, w, nb, m, col0, cols, ptr, n);
        #[cfg(target_arch = "x86_64")]
        // SAFETY: the path's features were checked; indices stay inside x, w and out by construction.
        unsafe {
            match path {
                Path::Avx512Vnni => tiles!(x86::tile_vnni),
                Path::Avx2 => tiles!(x86::tile),
                _ => portable_columns(format, &xq, w, nb, m, col0, cols, ptr, n),
            }
        }
        #[cfg(target_arch = "aarch64")]
        // SAFETY: as above; `tile_mm` runs only where i8mm (and dotprod) were detected.
        unsafe {
            match path {
                Path::NeonI8mm => {
                    // Pairs of rows through `smmla`; an odd last row through `sdot`.
                    let pairs = m / 2;
                    if cols == 4 {
                        for rp in (0..pairs / 2 * 2).step_by(2) {
                            arm::tile_mm::<2, 2>(format, &xq, w, nb, 2 * rp, col0, ptr.0, n)
                        }
                        if pairs % 2 == 1 {
                            arm::tile_mm::<1, 2>(format, &xq, w, nb, 2 * (pairs - 1), col0, ptr.0, n)
                        }
                        if m % 2 == 1 {
                            arm::tile_dot::<1, 4>(format, &xq, w, nb, m - 1, col0, ptr.0, n)
                        }
                    } else {
                        for row0 in 0..m {
                            for c in 0..cols {
                                arm::tile_dot::<1, 1>(format, &xq, w, nb, row0, col0 + c, ptr.0, n)
                            }
                        }
                    }
                }
                Path::NeonDot => tiles!(arm::tile_dot),
                Path::Neon => tiles!(arm::tile),
                _ => portable_columns(format, &xq, w, nb, m, col0, cols, ptr, n),
            }
        }
    });
    out
}

/// The kernel as a candle op on `x [m, k]`, the weight captured with its format and shape.
pub struct BlockMatMul<'a> {
    /// The weight's block format.
    pub format: BlockFormat,
    /// Blocks of the `[n, k]` weight.
    pub weight: &'a [u8],
    /// Weight rows (output width).
    pub n: usize,
    /// Weight columns (input width).
    pub k: usize,
}

impl CustomOp1 for BlockMatMul<'_> {
    fn name(&self) -> &'static str {
        "candlewick-int8-block-matmul"
    }

    fn cpu_fwd(&self, storage: &CpuStorage, layout: &Layout) -> candle_core::Result<(CpuStorage, Shape)> {
        let CpuStorage::F32(data) = storage else { candle_core::bail!("block matmul expects float32 input") };
        let Some((start, end)) = layout.contiguous_offsets() else {
            candle_core::bail!("block matmul expects a contiguous input")
        };
        let (m, k) = layout.shape().dims2()?;
        if k != self.k {
            candle_core::bail!("block matmul: input width {k}, weight width {}", self.k)
        }
        let out = matmul(self.format, &data[start..end], m, k, self.weight, self.n);
        Ok((CpuStorage::F32(out), Shape::from((m, self.n))))
    }
}

#[cfg(test)]
mod tests {
    /// The quantization as first written (scalar `fold(max)` and `round()`): the vectorizable
    /// form must equal it bit for bit, on ordinary rows, ties at .5, zeros, infinities, NaN and
    /// subnormal blocks, split over tasks or not.
    #[test]
    fn quantize_rows_equals_the_plain_loop() {
        use half::f16;
        fn plain(x: &[f32]) -> (Vec<f32>, Vec<i32>, Vec<f32>, Vec<i8>) {
            let (mut scales, mut qsums, mut sums, mut values) = (vec![], vec![], vec![], vec![0i8; x.len()]);
            for (b, chunk) in x.chunks_exact(QK).enumerate() {
                let amax = chunk.iter().fold(0f32, |a, &v| a.max(v.abs()));
                let d = amax / 127.0;
                let id = if d != 0.0 { 1.0 / d } else { 0.0 };
                let mut sum = 0i32;
                for (q, &v) in values[b * QK..(b + 1) * QK].iter_mut().zip(chunk) {
                    *q = (v * id).round() as i8;
                    sum += *q as i32;
                }
                let d = f16::from_f32(d).to_f32();
                scales.push(d);
                qsums.push(sum);
                sums.push(d * sum as f32);
            }
            (scales, qsums, sums, values)
        }
        let mut rng = 0x2545_f491_4f6c_dd1du64;
        let mut next = || {
            rng ^= rng << 13;
            rng ^= rng >> 7;
            rng ^= rng << 17;
            rng
        };
        let mut x: Vec<f32> = (0..QK * 300).map(|_| (next() % 20_001) as f32 / 1000.0 - 10.0).collect();
        // Exact ties: a block whose largest value is 127 scales by 1, so k + 0.5 stays a tie.
        for (i, v) in x[..QK].iter_mut().enumerate() {
            *v = if i == 0 { 127.0 } else { i as f32 - 15.5 };
        }
        x[QK..2 * QK].fill(0.0);
        x[2 * QK + 3] = f32::INFINITY;
        x[3 * QK + 5] = f32::NAN;
        x[4 * QK..5 * QK].fill(f32::NAN);
        for (i, v) in x[5 * QK..6 * QK].iter_mut().enumerate() {
            *v = f32::from_bits(1 + i as u32) * if i % 2 == 0 { 1.0 } else { -1.0 };
        }
        x[6 * QK + 7] = -1e-39;
        x[7 * QK + 1] = f32::NEG_INFINITY;
        for len in [QK, 6 * QK, x.len()] {
            let got = quantize_rows(&x[..len]);
            let (scales, qsums, sums, values) = plain(&x[..len]);
            let bits = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
            assert_eq!(got.values, values);
            assert_eq!(got.qsums, qsums);
            assert_eq!(bits(&got.scales), bits(&scales));
            assert_eq!(bits(&got.sums), bits(&sums));
        }
    }

    use super::*;
    use candle_core::quantized::QTensor;
    use candle_core::{Device, Tensor};

    const FORMATS: [(GgmlDType, BlockFormat); 5] = [
        (GgmlDType::Q4_0, BlockFormat::Q4_0),
        (GgmlDType::Q4_1, BlockFormat::Q4_1),
        (GgmlDType::Q5_0, BlockFormat::Q5_0),
        (GgmlDType::Q5_1, BlockFormat::Q5_1),
        (GgmlDType::Q8_0, BlockFormat::Q8_0),
    ];

    /// Every path this machine has, each forced in turn, agrees with candle's
    /// quantized matmul (which rounds `s` to f16 for the offset formats: hence the tolerance
    /// relative to the sum of the absolute products).
    #[test]
    fn every_path_equals_candles_quantized_matmul() {
        let dev = Device::Cpu;
        let paths = Path::runnable();
        for (dtype, format) in FORMATS {
            for (m, k, n) in
                [(1, 64, 5), (2, 64, 8), (3, 128, 12), (6, 96, 16), (7, 96, 9), (16, 640, 36), (33, 128, 4)]
            {
                let w = Tensor::randn(0f32, 1.0, (n, k), &dev).unwrap();
                let x = Tensor::randn(0f32, 1.0, (m, k), &dev).unwrap();
                let q = QTensor::quantize(&w, dtype).unwrap();
                assert_eq!(BlockFormat::of(q.dtype()), Some(format));
                let data = q.data().unwrap().to_vec();
                let (want, magnitude) = super::super::reference::candle_product(q, &x);
                let xs = x.flatten_all().unwrap().to_vec1::<f32>().unwrap();
                for &path in &paths {
                    let got = matmul_with(format, &xs, m, k, &data, n, path);
                    for ((a, b), s) in got.iter().zip(&want).zip(&magnitude) {
                        assert!((a - b).abs() <= 1e-3 * s + 1e-4, "{format:?} ({m},{k},{n}) {path:?}: {a} vs {b}");
                    }
                }
            }
        }
    }
}
