//! The tiles on x86 CPUs with AVX2 but without AVX-512 VNNI (AMD Zen 2 and 3, Intel cores
//! before Ice Lake, most laptops of the last decade): the 32-value formats here, the k-quants in
//! `k_quants::avx2`, the grid i-quants and ternary types in `grid::avx2`. Without them such a CPU
//! left k-quant weights in ggml's layout for candle's row-by-row kernels and re-encoded the table
//! and grid formats as Q8_0.
//!
//! A 256-bit register holds 8 of a tile's 16 rows (4 values each), so a tile runs as two halves
//! of 8 rows (rows 0–7 are the first 32 bytes of each 64-byte vector, rows 8–15 the second),
//! each with its own accumulators: 16 registers do not hold both halves' for several
//! activation rows. AVX2 has no `vpdpbusd`: `vpmaddubsw` multiplies unsigned by signed bytes
//! into 16-bit sums of pairs, which saturate above 32767, and `vpmaddwd` by ones widens them.
//! The 4- and 5-bit values (at most 31) give pairs of at most 2·31·127 = 7874, so 4 of them (8
//! for the 4-bit ones) add in 16 bits before one widening. The 8-bit values (Q8_0's, and the
//! table formats' levels) take ggml's AVX2 form instead: `|q|` times `x` with `q`'s sign
//! (`vpsignb`), at most 2·128·127 a pair, widened at once; their sums then need no offset.
//!
//! The records are the AVX-512 kernels' (`mod.rs`), bit for bit: the same repacked weights run
//! on either, and the integer products equal ggml's exactly.

use std::arch::x86_64::*;

use super::x86::prefetch_next;
use super::{i_quants, Format, Interleaved, HALVES, LANES, QK};
use super::{IQ4NL, IQ4XS, MXFP4, Q4_1, Q5_0, Q5_1, Q8_0};
use crate::int8_gemm::QuantizedRows;

/// Rows of a tile in one 256-bit register (4 bytes each).
pub(super) const HALF: usize = LANES / 2;

/// The 4-byte group at `p`, broadcast to every 32-bit lane.
#[inline(always)]
pub(super) unsafe fn x4(p: *const i8) -> __m256i {
    _mm256_set1_epi32((p as *const i32).read_unaligned())
}

/// `acc` plus the 32-bit sums of 4 products of unsigned `w` and signed `x` bytes (`vpdpbusd`'s
/// result), for `w` whose pairs of products stay under 2^15 (values below 128).
#[inline(always)]
pub(super) unsafe fn dot_u(acc: __m256i, w: __m256i, x: __m256i) -> __m256i {
    _mm256_add_epi32(acc, widen(_mm256_maddubs_epi16(w, x)))
}

/// `acc` plus the 32-bit sums of 4 products of signed `q` and `x` bytes.
#[inline(always)]
pub(super) unsafe fn dot_s(acc: __m256i, q: __m256i, x: __m256i) -> __m256i {
    dot_u(acc, _mm256_abs_epi8(q), _mm256_sign_epi8(x, q))
}

/// The 16-bit sums of pairs `v` as 32-bit sums of 4 (`vpmaddwd` by ones).
#[inline(always)]
pub(super) unsafe fn widen(v: __m256i) -> __m256i {
    _mm256_madd_epi16(v, _mm256_set1_epi16(1))
}

/// The 8 half-precision fields of rows `8h..8h + 8` whose 16 rows' fields start at `p`.
#[inline(always)]
pub(super) unsafe fn halves(p: *const u8, h: usize) -> __m256 {
    _mm256_cvtph_ps(_mm_loadu_si128(p.add(h * HALF * 2) as *const __m128i))
}

/// Bytes `8h..8h + 8` of the 16 at `p`, zero-extended to 32 bits.
#[inline(always)]
pub(super) unsafe fn bytes_u32(p: *const u8, h: usize) -> __m256i {
    _mm256_cvtepu8_epi32(_mm_loadl_epi64(p.add(h * HALF) as *const __m128i))
}

/// Bytes `8h..8h + 8` of the 16 at `p`, sign-extended to 32 bits.
#[inline(always)]
pub(super) unsafe fn bytes_i32(p: *const u8, h: usize) -> __m256i {
    _mm256_cvtepi8_epi32(_mm_loadl_epi64(p.add(h * HALF) as *const __m128i))
}

/// Half `h` (rows `8h..8h + 8`) of the 64-byte vector at `p`.
#[inline(always)]
pub(super) unsafe fn load(p: *const u8, h: usize) -> __m256i {
    _mm256_loadu_si256(p.add(h * 32) as *const __m256i)
}

/// `v` (half `h` of a 64-byte vector) with `amount` added to the bytes that 64-bit mask `index`
/// of the masks at `masks` selects (bit `4·lane + t`, as AVX-512's masked `vpaddb` reads it):
/// the mask's 32 bits for these rows spread to one byte each (`vpshufb` sends mask byte `i / 8`
/// to byte `i`, which keeps bit `i % 8`).
#[inline(always)]
pub(super) unsafe fn with_high_bits(v: __m256i, masks: *const u8, index: usize, h: usize, amount: __m256i) -> __m256i {
    let bits = (masks.add(index * 8 + h * 4) as *const i32).read_unaligned();
    let spread = _mm256_shuffle_epi8(
        _mm256_set1_epi32(bits),
        _mm256_setr_epi8(
            0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1, 2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3,
        ),
    );
    let select = _mm256_set1_epi64x(0x8040_2010_0804_0201u64 as i64);
    let set = _mm256_cmpeq_epi8(_mm256_and_si256(spread, select), select);
    _mm256_add_epi8(v, _mm256_and_si256(set, amount))
}

/// Writes rows `8h..8h + 8` of a tile's columns from `col` of output row `row` (of `n`): those
/// that exist.
#[inline(always)]
pub(super) unsafe fn store(acc: __m256, out: *mut f32, row: usize, n: usize, col: usize, h: usize) {
    let col = col + h * HALF;
    if col >= n {
        return;
    }
    let dst = out.add(row * n + col);
    if col + HALF <= n {
        _mm256_storeu_ps(dst, acc);
    } else {
        let mut lanes = [0f32; HALF];
        _mm256_storeu_ps(lanes.as_mut_ptr(), acc);
        std::ptr::copy_nonoverlapping(lanes.as_ptr(), dst, n - col);
    }
}

/// Tiles `t0..t0 + tiles` of format `F` against every activation row, 4 rows at a time.
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn columns<const F: u8>(
    w: &Interleaved,
    xq: &QuantizedRows,
    m: usize,
    t0: usize,
    tiles: usize,
    out: *mut f32,
) {
    for t in t0..t0 + tiles {
        for h in 0..2 {
            rows_by_four!(m, 0, |R, row0| tile::<F, R>(w, xq, row0, t, h, out));
        }
    }
}

/// Activation rows `row0..row0 + R` times rows `8h..8h + 8` of tile `t`, one 32-value unit at a
/// time (an IQ4_XS record holds 8).
#[inline(always)]
unsafe fn tile<const F: u8, const R: usize>(
    w: &Interleaved,
    xq: &QuantizedRows,
    row0: usize,
    t: usize,
    h: usize,
    out: *mut f32,
) {
    let nb = w.blocks();
    let per_block = if F == IQ4XS { Format::IQ4XS.units_per_block() } else { 1 };
    let units = nb * per_block;
    let size = w.format.record_bytes();
    let header = w.format.header_bytes();
    let asymmetric = F == Q4_1 || F == Q5_1;
    let five = F == Q5_0 || F == Q5_1;
    let lookup = F == IQ4NL || F == IQ4XS || F == MXFP4;
    let levels = if lookup { i_quants::avx2::levels(w.format) } else { _mm256_setzero_si256() };
    let nibble = _mm256_set1_epi8(0x0F);
    let sixteen = _mm256_set1_epi8(16);
    // The offset the unsigned 4- and 5-bit values carry; 8-bit values are multiplied signed.
    let offset = if F == Q8_0 || lookup { 0 } else { w.format.offset() };
    let mut acc = [_mm256_setzero_ps(); R];
    for u in 0..units {
        let (b, part) = (u / per_block, u % per_block);
        let rec = w.data.as_ptr().add((t * nb + b) * size);
        let values = rec.add(w.format.values_at() + part * QK / 2 * LANES);
        let xs: [*const i8; R] = std::array::from_fn(|r| xq.values.as_ptr().add(((row0 + r) * units + u) * QK));
        let mut dot: [__m256i; R] =
            std::array::from_fn(|r| _mm256_set1_epi32(-offset * *xq.qsums.get_unchecked((row0 + r) * units + u)));
        if R == 1 && h == 0 {
            prefetch_next(rec, size, part, per_block);
        }
        if F == Q8_0 {
            let flip = _mm256_set1_epi8(-128);
            for j in 0..QK / 4 {
                let q = _mm256_xor_si256(load(values.add(j * 64), h), flip);
                for r in 0..R {
                    dot[r] = dot_s(dot[r], q, x4(xs[r].add(j * 4)));
                }
            }
        } else {
            // Byte j of a Q4 block holds value j (low nibble) and value j + 16 (high). The
            // 4-bit values' 16-bit sums of a unit's 8 vectors stay under 2^15, the 5-bit ones'
            // of its 4 low and 4 high vectors each.
            let mut lo16 = [_mm256_setzero_si256(); R];
            let mut hi16 = [_mm256_setzero_si256(); R];
            for j in 0..QK / 8 {
                let packed = load(values.add(j * 64), h);
                let mut lo = _mm256_and_si256(packed, nibble);
                let mut hi = _mm256_and_si256(_mm256_srli_epi16(packed, 4), nibble);
                if five {
                    lo = with_high_bits(lo, rec.add(header), j, h, sixteen);
                    hi = with_high_bits(hi, rec.add(header), j + 4, h, sixteen);
                }
                if lookup {
                    lo = _mm256_shuffle_epi8(levels, lo);
                    hi = _mm256_shuffle_epi8(levels, hi);
                    for r in 0..R {
                        dot[r] = dot_s(dot[r], lo, x4(xs[r].add(j * 4)));
                        dot[r] = dot_s(dot[r], hi, x4(xs[r].add(j * 4 + 16)));
                    }
                } else {
                    for r in 0..R {
                        lo16[r] = _mm256_add_epi16(lo16[r], _mm256_maddubs_epi16(lo, x4(xs[r].add(j * 4))));
                        hi16[r] = _mm256_add_epi16(hi16[r], _mm256_maddubs_epi16(hi, x4(xs[r].add(j * 4 + 16))));
                    }
                }
            }
            if !lookup {
                for r in 0..R {
                    let sum = if five {
                        _mm256_add_epi32(widen(lo16[r]), widen(hi16[r]))
                    } else {
                        widen(_mm256_add_epi16(lo16[r], hi16[r]))
                    };
                    dot[r] = _mm256_add_epi32(dot[r], sum);
                }
            }
        }
        let wd = match F {
            MXFP4 => i_quants::avx2::e8m0_scales(rec, h),
            // IQ4_XS: d·(ls − 32) once for every row, as on AVX-512.
            IQ4XS => _mm256_mul_ps(halves(rec, h), _mm256_cvtepi32_ps(i_quants::avx2::iq4xs_scales(rec, part, h))),
            _ => halves(rec, h),
        };
        let wm = if asymmetric { halves(rec.add(HALVES), h) } else { _mm256_setzero_ps() };
        for r in 0..R {
            let xi = (row0 + r) * units + u;
            let xd = _mm256_set1_ps(*xq.scales.get_unchecked(xi));
            acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot[r]), _mm256_mul_ps(wd, xd), acc[r]);
            if asymmetric {
                acc[r] = _mm256_fmadd_ps(wm, _mm256_set1_ps(*xq.sums.get_unchecked(xi)), acc[r]);
            }
        }
    }
    for (r, acc) in acc.into_iter().enumerate() {
        store(acc, out, row0 + r, w.n, t * LANES, h);
    }
}
