//! The grid i-quants (IQ1_S, IQ1_M, IQ2_XXS, IQ2_XS, IQ2_S, IQ3_XXS, IQ3_S) and the ternary
//! TQ1_0 / TQ2_0 in 16-row tiles of their own bytes (1.56–3.44 bits a value), instead of the
//! Q8_0 re-encoding (8.5 bits) they were multiplied through before: a model a user picked
//! IQ2_XXS for, to fit it in memory, now takes the memory IQ2_XXS takes.
//!
//! Their values are no nibbles the int8 product can read in place: each 8 (IQ3: 4) come from a
//! grid of points indexed by 8–11 bits, with signs from a 7-bit index (whose eighth bit is its
//! parity), explicit sign bytes, or a shift of ±1/8 (IQ1); TQ1_0 packs five base-3 digits a
//! byte. So a record (16 rows' blocks of 256 values) is decoded first into int8 values in
//! cache, then multiplied as Q8_0's values are. One activation row (decode) decodes a record
//! and multiplies it at once; more rows decode the tile's records once and run every group of
//! 4 activation rows over them.
//!
//! Layouts. A record holds the 16 rows' source blocks, field by field (`runs`): each field of
//! the 16 rows contiguous (row `r`'s at `16·width·f + width·r`), so the 16 rows' grid indices,
//! sign bytes or scales of one group of values are one load; a record is as large as its
//! blocks, and `row_into` reassembles a row's block and decodes it with the reference decoder
//! (`ExtraType::decode`): bit for bit as `gguf.quants`.
//!
//! Decoded values (`Decoded`): per 8-value group of a block, 128 bytes: rows 0–7's 8 values
//! (one 64-bit lane each), then rows 8–15's. The dot product of such a vector with an 8-byte
//! group of activations broadcast to every 64-bit lane leaves each row's sum split over two
//! 32-bit lanes ("pairs"), added once a tile's rows are done. Every scale of these types is
//! `D·mult` with `D` a float per block (the float16 `d` times a power of two: exact) and `mult`
//! a small odd integer per 16 values (IQ2_XXS: `d·(0.5 + s)/4 = (d/8)·(2s + 1)`), so a 32-value
//! unit's integer sum is `Σ_h mult_h·Σ q·x` (under 2^24: exact in float32), scaled once by
//! `D·x_d`. On x86 the decoded values are stored plus 128 (`vpdpbusd` multiplies unsigned by
//! signed bytes) and each half unit's sum starts at `−128·Σx`; on Arm they stay signed (`sdot`).

use super::{Format, Interleaved, LANES, QK};
use crate::extra_types::ExtraType;
use crate::int8_gemm::QuantizedRows;
#[cfg(target_arch = "x86_64")]
use crate::iquant_grids::*;

/// Values of a block.
pub(super) const QK_K: usize = 256;
/// 8-value groups of a block.
const GROUPS: usize = QK_K / 8;
/// 16-value scale slots of a block.
const SLOTS: usize = QK_K / 16;
/// Bytes of a block's decoded values for 16 rows.
const VALUES_BYTES: usize = QK_K * LANES;
/// What the decoded values add to `q`: 128 on x86 (`vpdpbusd`'s unsigned operand), nothing on
/// Arm (`sdot` multiplies signed bytes).
const BIAS: u8 = if cfg!(target_arch = "x86_64") { 0x80 } else { 0 };

/// The grid and ternary formats (for the tests).
#[cfg(test)]
pub(super) const GRID_FORMATS: [Format; 9] = [
    Format::IQ2XXS,
    Format::IQ2XS,
    Format::IQ2S,
    Format::IQ3XXS,
    Format::IQ3S,
    Format::IQ1S,
    Format::IQ1M,
    Format::TQ1_0,
    Format::TQ2_0,
];

impl Format {
    /// Whether `self` is a grid or ternary format (this file's).
    pub(super) const fn is_grid(self) -> bool {
        matches!(
            self,
            Self::IQ2XXS
                | Self::IQ2XS
                | Self::IQ2S
                | Self::IQ3XXS
                | Self::IQ3S
                | Self::IQ1S
                | Self::IQ1M
                | Self::TQ1_0
                | Self::TQ2_0
        )
    }

    /// The `extra_types` type of a grid format.
    pub(super) fn grid_type(self) -> ExtraType {
        match self {
            Self::IQ2XXS => ExtraType::IQ2_XXS,
            Self::IQ2XS => ExtraType::IQ2_XS,
            Self::IQ2S => ExtraType::IQ2_S,
            Self::IQ3XXS => ExtraType::IQ3_XXS,
            Self::IQ3S => ExtraType::IQ3_S,
            Self::IQ1S => ExtraType::IQ1_S,
            Self::IQ1M => ExtraType::IQ1_M,
            Self::TQ1_0 => ExtraType::TQ1_0,
            Self::TQ2_0 => ExtraType::TQ2_0,
            _ => unreachable!("{self:?} is not a grid format"),
        }
    }
}

/// A block's fields in order, as runs of `(count, widths)`: `count` times the fields of
/// `widths` bytes. A record stores each field of its 16 rows contiguously, in this order.
fn runs(format: Format) -> &'static [(usize, &'static [usize])] {
    match format {
        // d; per 32 values the 4 grid indices, then the u32 of signs and scale.
        Format::IQ2XXS => &[(1, &[2]), (8, &[1, 1, 1, 1, 4])],
        // d; per 8 values a u16 (9-bit index, 7-bit signs); the scale bytes.
        Format::IQ2XS => &[(1, &[2]), (32, &[2]), (8, &[1])],
        // d; index low bytes; sign bytes; index high bits; scale bytes.
        Format::IQ2S => &[(1, &[2]), (32, &[1]), (32, &[1]), (8, &[1]), (8, &[1])],
        // d; 64 index bytes; per 32 values the u32 of signs and scale.
        Format::IQ3XXS => &[(1, &[2]), (64, &[1]), (8, &[4])],
        // d; index low bytes; index high bits; sign bytes; scale bytes.
        Format::IQ3S => &[(1, &[2]), (64, &[1]), (8, &[1]), (32, &[1]), (4, &[1])],
        // d; index low bytes; per 32 values the u16 of high bits, scale and shift sign.
        Format::IQ1S => &[(1, &[2]), (32, &[1]), (8, &[2])],
        // index low bytes; high bits and shift signs; the four u16 of scales (and d's nibbles).
        Format::IQ1M => &[(32, &[1]), (16, &[1]), (4, &[2])],
        // The 48 bytes of five digits in 8-byte pieces; the 4 of four digits; d.
        Format::TQ1_0 => &[(6, &[8]), (1, &[4]), (1, &[2])],
        // The 64 bytes of 2-bit values in 8-byte pieces; d.
        Format::TQ2_0 => &[(8, &[8]), (1, &[2])],
        _ => unreachable!("{format:?} is not a grid format"),
    }
}

/// Writes row `lane`'s source `block` into its place in a tile `record`.
pub(super) fn place(format: Format, block: &[u8], lane: usize, record: &mut [u8]) {
    let (mut src, mut at) = (0, 0);
    for &(count, widths) in runs(format) {
        for _ in 0..count {
            for &w in widths {
                record[at + lane * w..][..w].copy_from_slice(&block[src..src + w]);
                (src, at) = (src + w, at + LANES * w);
            }
        }
    }
}

/// Row `lane`'s source block of a tile `record`, into `block`.
fn gather(format: Format, record: &[u8], lane: usize, block: &mut [u8]) {
    let (mut src, mut at) = (0, 0);
    for &(count, widths) in runs(format) {
        for _ in 0..count {
            for &w in widths {
                block[src..src + w].copy_from_slice(&record[at + lane * w..][..w]);
                (src, at) = (src + w, at + LANES * w);
            }
        }
    }
}

/// The largest block of these types (IQ3_S).
const MAX_BLOCK: usize = 110;

/// Row `r` de-quantized into `out` (`k` values), by the reference decoder.
pub(super) fn row_into(w: &Interleaved, r: usize, out: &mut [f32]) {
    let ty = w.format.grid_type();
    let (t, lane) = (r / LANES, r % LANES);
    let mut block = [0u8; MAX_BLOCK];
    let (mut scales, mut q) = ([0f32; SLOTS], [0i8; QK_K]);
    for (b, chunk) in out.chunks_exact_mut(QK_K).enumerate() {
        gather(w.format, w.record(t, b), lane, &mut block);
        ty.decode(&block[..ty.block_bytes()], &mut scales, &mut q);
        for (i, (o, &q)) in chunk.iter_mut().zip(&q).enumerate() {
            *o = scales[i / 16] * q as f32;
        }
    }
}

/// A block's scales as `D·mult[h]` (`mult` per 16 values): `D` the float16 `d` times a power of
/// two (exact), `mult` a small positive integer, their product ggml's float32 scale exactly.
fn scale_parts(ty: ExtraType, b: &[u8]) -> (f32, [i32; SLOTS]) {
    let half = |i: usize| half::f16::from_bits(u16::from_le_bytes([b[i], b[i + 1]])).to_f32();
    let u16_at = |i: usize| u16::from_le_bytes([b[i], b[i + 1]]) as u32;
    let u32_at = |i: usize| u32::from_le_bytes([b[i], b[i + 1], b[i + 2], b[i + 3]]);
    let nibble = |at: usize, h: usize| (b[at + h / 2] >> (4 * (h % 2)) & 15) as i32;
    match ty {
        ExtraType::IQ2_XXS => {
            (half(0) * 0.125, std::array::from_fn(|h| 2 * (u32_at(6 + 8 * (h / 2)) >> 28) as i32 + 1))
        }
        ExtraType::IQ2_XS => (half(0) * 0.125, std::array::from_fn(|h| 2 * nibble(66, h) + 1)),
        ExtraType::IQ2_S => (half(0) * 0.125, std::array::from_fn(|h| 2 * nibble(74, h) + 1)),
        ExtraType::IQ3_XXS => {
            (half(0) * 0.25, std::array::from_fn(|h| 2 * (u32_at(66 + 4 * (h / 2)) >> 28) as i32 + 1))
        }
        ExtraType::IQ3_S => (half(0), std::array::from_fn(|h| 2 * nibble(106, h / 2) + 1)),
        ExtraType::IQ1_S => {
            (half(0) * 0.125, std::array::from_fn(|h| 2 * (u16_at(34 + 2 * (h / 2)) >> 12 & 7) as i32 + 1))
        }
        ExtraType::IQ1_M => {
            let s: [u32; 4] = std::array::from_fn(|i| u16_at(48 + 2 * i));
            let d = (s[0] >> 12) | ((s[1] >> 8) & 0x00f0) | ((s[2] >> 4) & 0x0f00) | (s[3] & 0xf000);
            let d = half::f16::from_bits(d as u16).to_f32() * 0.125;
            (d, std::array::from_fn(|h| 2 * (s[h / 4] >> (3 * (h % 4)) & 7) as i32 + 1))
        }
        ExtraType::TQ1_0 => (half(52), [1; SLOTS]),
        ExtraType::TQ2_0 => (half(64), [1; SLOTS]),
        _ => unreachable!("{ty:?} is not a grid type"),
    }
}

/// A tile's records decoded (one record or all of a tile's, `slots` of them): the values of
/// each 8-value group as 128 bytes (rows 0–7, then 8–15, 8 bytes each, plus `BIAS`), the
/// multipliers of each 16-value slot for the 16 rows in pairs (`2r`, `2r + 1` both row `r`'s),
/// and each block's `D` in pairs.
#[derive(Default)]
pub(super) struct Decoded {
    values: Vec<u8>,
    mult: Vec<i32>,
    d: Vec<f32>,
}

impl Decoded {
    /// Room for `slots` decoded records.
    fn reserve(&mut self, slots: usize) {
        if self.d.len() < slots * 2 * LANES {
            self.values.resize(slots * VALUES_BYTES, 0);
            self.mult.resize(slots * SLOTS * 2 * LANES, 0);
            self.d.resize(slots * 2 * LANES, 0.0);
        }
    }
}

thread_local! {
    /// Each worker's decoded records, kept between products.
    static DECODED: std::cell::RefCell<Decoded> = std::cell::RefCell::new(Decoded::default());
}

/// Decodes record `b` of tile `t` into `slot` of `dec` with the reference decoder, row by row:
/// the portable path's, Arm's, and the reference the SIMD decoders are tested against.
fn decode_scalar(w: &Interleaved, t: usize, b: usize, dec: &mut Decoded, slot: usize) {
    let ty = w.format.grid_type();
    let mut block = [0u8; MAX_BLOCK];
    let (mut scales, mut q) = ([0f32; SLOTS], [0i8; QK_K]);
    let record = w.record(t, b);
    for lane in 0..LANES {
        let block = &mut block[..ty.block_bytes()];
        gather(w.format, record, lane, block);
        ty.decode(block, &mut scales, &mut q);
        let (d, mult) = scale_parts(ty, block);
        debug_assert!((0..SLOTS).all(|h| (d * mult[h] as f32).to_bits() == scales[h].to_bits() || scales[h].is_nan()));
        let values = &mut dec.values[slot * VALUES_BYTES..];
        for g in 0..GROUPS {
            for j in 0..8 {
                values[g * 128 + lane * 8 + j] = q[8 * g + j] as u8 ^ BIAS;
            }
        }
        for (h, &m) in mult.iter().enumerate() {
            dec.mult[(slot * SLOTS + h) * 2 * LANES + 2 * lane..][..2].fill(m);
        }
        dec.d[slot * 2 * LANES + 2 * lane..][..2].fill(d);
    }
}

/// Tiles `t0..t0 + tiles` against every activation row, in plain Rust over the reference
/// decoder's records.
pub(super) fn portable_columns(
    w: &Interleaved,
    xq: &QuantizedRows,
    m: usize,
    t0: usize,
    tiles: usize,
    out: crate::OutPtr,
) {
    let nb = w.blocks();
    let units = nb * QK_K / QK;
    DECODED.with(|cell| {
        let dec = &mut *cell.borrow_mut();
        dec.reserve(nb);
        for t in t0..t0 + tiles {
            for b in 0..nb {
                decode_scalar(w, t, b, dec, b);
            }
            for lane in 0..LANES.min(w.n - t * LANES) {
                for r in 0..m {
                    let mut total = 0f32;
                    for b in 0..nb {
                        let d = dec.d[b * 2 * LANES + 2 * lane];
                        for u in 0..QK_K / QK {
                            let xi = r * units + b * QK_K / QK + u;
                            let xs = &xq.values[xi * QK..][..QK];
                            let mut sum = 0i32;
                            for h in 0..2 {
                                let mult = dec.mult[(b * SLOTS + 2 * u + h) * 2 * LANES + 2 * lane];
                                let mut dot = 0i32;
                                for i in 0..16 {
                                    let g = 4 * u + 2 * h + i / 8;
                                    let q = (dec.values[b * VALUES_BYTES + g * 128 + lane * 8 + i % 8] ^ BIAS) as i8;
                                    dot += q as i32 * xs[16 * h + i] as i32;
                                }
                                sum += mult * dot;
                            }
                            total += sum as f32 * (d * xq.scales[xi]);
                        }
                    }
                    // SAFETY: this worker alone writes the columns of tiles t0..t0 + tiles.
                    unsafe { *out.0.add(r * w.n + t * LANES + lane) = total };
                }
            }
        }
    });
}

/// `IQ1S_GRID` with the shift: entry `i | s << 11` holds the 8 values `8·g + δ` (`δ = +1`, or
/// `−1` where `s` is set) plus `BIAS`, one a byte: IQ1_S's and IQ1_M's decoded values in one load.
#[cfg(target_arch = "x86_64")]
static IQ1_SHIFTED: std::sync::LazyLock<Vec<u64>> = std::sync::LazyLock::new(|| {
    (0..4096)
        .map(|i| {
            let delta: i8 = if i >> 11 == 1 { -1 } else { 1 };
            let grid = IQ1S_GRID[i & 2047].to_le_bytes();
            u64::from_le_bytes(grid.map(|g| (8 * g as i8 + delta) as u8 ^ BIAS))
        })
        .collect()
});

#[cfg(target_arch = "x86_64")]
pub(super) mod x86 {
    use super::super::x86::store;
    use super::*;
    use std::arch::x86_64::*;

    /// Tiles `t0..t0 + tiles` against every activation row (`half_sums`: the activations' sums
    /// per 16 values).
    #[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
    pub(in super::super) unsafe fn columns(
        w: &Interleaved,
        xq: &QuantizedRows,
        half_sums: &[i32],
        m: usize,
        t0: usize,
        tiles: usize,
        out: *mut f32,
    ) {
        let nb = w.blocks();
        DECODED.with(|cell| {
            let dec = &mut *cell.borrow_mut();
            for t in t0..t0 + tiles {
                if m <= 4 {
                    // Each record decoded and multiplied at once, in L1.
                    dec.reserve(1);
                    rows_by_four!(m, 0, |R, row0| tile::<R>(w, dec, xq, half_sums, row0, t, true, out));
                    continue;
                }
                dec.reserve(nb);
                for b in 0..nb {
                    decode(w, t, b, dec, b);
                }
                rows_by_four!(m, 0, |R, row0| tile::<R>(w, dec, xq, half_sums, row0, t, false, out));
            }
        })
    }

    /// Activation rows `row0..row0 + R` times tile `t`: its records decoded one at a time into
    /// slot 0 (`fresh`), or read from their slots.
    #[allow(clippy::too_many_arguments)]
    #[inline(always)]
    unsafe fn tile<const R: usize>(
        w: &Interleaved,
        dec: &mut Decoded,
        xq: &QuantizedRows,
        half_sums: &[i32],
        row0: usize,
        t: usize,
        fresh: bool,
        out: *mut f32,
    ) {
        let nb = w.blocks();
        let units = nb * QK_K / QK;
        let mut acc = [[_mm512_setzero_ps(); 2]; R];
        let evens = 0x5555;
        for b in 0..nb {
            let slot = if fresh {
                decode(w, t, b, dec, 0);
                0
            } else {
                b
            };
            let values = dec.values.as_ptr().add(slot * VALUES_BYTES);
            let mult = dec.mult.as_ptr().add(slot * SLOTS * 2 * LANES);
            let dp = dec.d.as_ptr().add(slot * 2 * LANES);
            let d = [_mm512_loadu_ps(dp), _mm512_loadu_ps(dp.add(LANES))];
            for u in 0..QK_K / QK {
                let unit = |r: usize| (row0 + r) * units + b * QK_K / QK + u;
                let mut total = [[_mm512_setzero_si512(); 2]; R];
                for h in 0..2 {
                    let mut sums: [[__m512i; 2]; R] = std::array::from_fn(|r| {
                        let s = *half_sums.get_unchecked(unit(r) * 2 + h);
                        [_mm512_maskz_set1_epi32(evens, -128 * s); 2]
                    });
                    for gg in 0..2 {
                        let g = 4 * u + 2 * h + gg;
                        let wa = _mm512_loadu_si512(values.add(g * 128) as *const _);
                        let wb = _mm512_loadu_si512(values.add(g * 128 + 64) as *const _);
                        for r in 0..R {
                            let xp = xq.values.as_ptr().add(unit(r) * QK + 8 * (2 * h + gg)) as *const i64;
                            let x = _mm512_set1_epi64(xp.read_unaligned());
                            sums[r][0] = _mm512_dpbusd_epi32(sums[r][0], wa, x);
                            sums[r][1] = _mm512_dpbusd_epi32(sums[r][1], wb, x);
                        }
                    }
                    let mp = mult.add((2 * u + h) * 2 * LANES);
                    let m = [_mm512_loadu_si512(mp as *const _), _mm512_loadu_si512(mp.add(LANES) as *const _)];
                    for r in 0..R {
                        for p in 0..2 {
                            total[r][p] = _mm512_add_epi32(total[r][p], _mm512_mullo_epi32(sums[r][p], m[p]));
                        }
                    }
                }
                for r in 0..R {
                    let xd = _mm512_set1_ps(*xq.scales.get_unchecked(unit(r)));
                    for p in 0..2 {
                        // A row's two lanes added as integers (both then hold the row's sum): each
                        // alone carries half the −128·Σx offset, large beside small values (the
                        // ternary types'), which added as floats would cancel to rounding noise.
                        let t = total[r][p];
                        let t = _mm512_add_epi32(t, _mm512_shuffle_epi32(t, _MM_PERM_CDAB));
                        acc[r][p] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(t), _mm512_mul_ps(d[p], xd), acc[r][p]);
                    }
                }
            }
        }
        // Each row's sum is in both its lanes: rows 0–7 from the first vector's even lanes, 8–15
        // from the second's.
        let even = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
        for (r, [a, b]) in acc.into_iter().enumerate() {
            store(_mm512_permutex2var_ps(a, even, b), out, row0 + r, w.n, t * LANES);
        }
    }

    /// The 16 rows' sign bytes of 7-bit sign indices (`v`: one per 32-bit lane, 7 bits): the
    /// index with its parity as the eighth bit (ggml's `ksigns_iq2xs`), as two 64-bit masks
    /// (rows 0–7, rows 8–15) of one bit per value.
    #[inline(always)]
    unsafe fn ksigns(v: __m512i) -> [u64; 2] {
        let mut p = _mm512_xor_si512(v, _mm512_srli_epi32(v, 4));
        p = _mm512_xor_si512(p, _mm512_srli_epi32(p, 2));
        p = _mm512_xor_si512(p, _mm512_srli_epi32(p, 1));
        let s = _mm512_or_si512(v, _mm512_slli_epi32(_mm512_and_si512(p, _mm512_set1_epi32(1)), 7));
        masks(_mm512_cvtepi32_epi8(s))
    }

    /// 16 sign bytes as two masks.
    #[inline(always)]
    unsafe fn masks(bytes: __m128i) -> [u64; 2] {
        [_mm_cvtsi128_si64(bytes) as u64, _mm_extract_epi64::<1>(bytes) as u64]
    }

    /// Grid magnitudes (below 128) with their signs, plus 128: `128 + g` or `128 − g`.
    #[inline(always)]
    unsafe fn signed(mag: __m512i, signs: u64) -> __m512i {
        let bias = _mm512_set1_epi8(-128);
        _mm512_mask_sub_epi8(_mm512_xor_si512(mag, bias), signs, bias, mag)
    }

    /// The 8 rows' grid entries `entry(r)` (rows `8p..8p + 8`) as one vector.
    #[inline(always)]
    unsafe fn rows8(p: usize, entry: impl Fn(usize) -> u64) -> __m512i {
        let e = |i: usize| entry(8 * p + i) as i64;
        _mm512_set_epi64(e(7), e(6), e(5), e(4), e(3), e(2), e(1), e(0))
    }

    /// A 16-lane vector in pairs: two vectors, lanes `2r`, `2r + 1` row `r`'s (rows 0–7, 8–15).
    #[inline(always)]
    unsafe fn pairs(v: __m512i) -> [__m512i; 2] {
        let lo = _mm512_setr_epi32(0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 7, 7);
        let hi = _mm512_setr_epi32(8, 8, 9, 9, 10, 10, 11, 11, 12, 12, 13, 13, 14, 14, 15, 15);
        [_mm512_permutexvar_epi32(lo, v), _mm512_permutexvar_epi32(hi, v)]
    }

    /// Stores `D` (the 16 rows' float16 `d` at `rec` times `scale`) in pairs.
    #[inline(always)]
    unsafe fn store_d(dec: &mut Decoded, slot: usize, d: __m512) {
        let [lo, hi] = pairs(_mm512_castps_si512(d));
        let p = dec.d.as_mut_ptr().add(slot * 2 * LANES);
        _mm512_storeu_ps(p, _mm512_castsi512_ps(lo));
        _mm512_storeu_ps(p.add(LANES), _mm512_castsi512_ps(hi));
    }

    /// The 16 rows' float16 at `p` times `scale`.
    #[inline(always)]
    unsafe fn halves(p: *const u8, scale: f32) -> __m512 {
        _mm512_mul_ps(_mm512_cvtph_ps(_mm256_loadu_si256(p as *const __m256i)), _mm512_set1_ps(scale))
    }

    /// Stores slot `h`'s multipliers (one per row) in pairs.
    #[inline(always)]
    unsafe fn store_mult(dec: &mut Decoded, slot: usize, h: usize, mult: __m512i) {
        let [lo, hi] = pairs(mult);
        let p = dec.mult.as_mut_ptr().add((slot * SLOTS + h) * 2 * LANES);
        _mm512_storeu_si512(p as *mut _, lo);
        _mm512_storeu_si512(p.add(LANES) as *mut _, hi);
    }

    /// Each 32-bit lane shifted right by `n` (not a constant).
    #[inline(always)]
    unsafe fn srl32(v: __m512i, n: u32) -> __m512i {
        _mm512_srl_epi32(v, _mm_cvtsi32_si128(n as i32))
    }

    /// `2·s + 1` for 4-bit `s` in each 32-bit lane.
    #[inline(always)]
    unsafe fn odd(s: __m512i) -> __m512i {
        _mm512_add_epi32(_mm512_slli_epi32(s, 1), _mm512_set1_epi32(1))
    }

    /// The 16 rows' bytes at `p`, one per 32-bit lane.
    #[inline(always)]
    unsafe fn bytes16(p: *const u8) -> __m512i {
        _mm512_cvtepu8_epi32(_mm_loadu_si128(p as *const __m128i))
    }

    /// The 16 rows' u16 at `p`, one per 32-bit lane.
    #[inline(always)]
    unsafe fn words16(p: *const u8) -> __m512i {
        _mm512_cvtepu16_epi32(_mm256_loadu_si256(p as *const __m256i))
    }

    /// Decodes record `b` of tile `t` into `slot` of `dec`: the same bytes as `decode_scalar`.
    #[inline(always)]
    pub(super) unsafe fn decode(w: &Interleaved, t: usize, b: usize, dec: &mut Decoded, slot: usize) {
        let rec = w.record(t, b).as_ptr();
        let values = dec.values.as_mut_ptr().add(slot * VALUES_BYTES);
        let put = |g: usize, p: usize, v: __m512i| _mm512_storeu_si512(values.add(g * 128 + 64 * p) as *mut _, v);
        let byte = |at: usize| *rec.add(at) as usize;
        let word = |at: usize| (rec.add(at) as *const u16).read_unaligned() as usize;
        let nib = _mm512_set1_epi32(15);
        match w.format {
            Format::IQ2XXS => {
                store_d(dec, slot, halves(rec, 0.125));
                for ib in 0..8 {
                    let base = 32 + 128 * ib;
                    let aux = _mm512_loadu_si512(rec.add(base + 64) as *const _);
                    let mult = odd(_mm512_srli_epi32(aux, 28));
                    store_mult(dec, slot, 2 * ib, mult);
                    store_mult(dec, slot, 2 * ib + 1, mult);
                    for l in 0..4 {
                        let signs = ksigns(_mm512_and_si512(srl32(aux, 7 * l as u32), _mm512_set1_epi32(127)));
                        for p in 0..2 {
                            let mag = rows8(p, |r| *IQ2XXS_GRID.get_unchecked(byte(base + 16 * l + r)));
                            put(4 * ib + l, p, signed(mag, signs[p]));
                        }
                    }
                }
            }
            Format::IQ2XS => {
                store_d(dec, slot, halves(rec, 0.125));
                for ib in 0..8 {
                    let sc = bytes16(rec.add(32 + 1024 + 16 * ib));
                    store_mult(dec, slot, 2 * ib, odd(_mm512_and_si512(sc, nib)));
                    store_mult(dec, slot, 2 * ib + 1, odd(_mm512_srli_epi32(sc, 4)));
                }
                for k in 0..GROUPS {
                    let at = 32 + 32 * k;
                    let signs = ksigns(_mm512_srli_epi32(words16(rec.add(at)), 9));
                    for p in 0..2 {
                        let mag = rows8(p, |r| *IQ2XS_GRID.get_unchecked(word(at + 2 * r) & 511));
                        put(k, p, signed(mag, signs[p]));
                    }
                }
            }
            Format::IQ2S => {
                store_d(dec, slot, halves(rec, 0.125));
                for ib in 0..8 {
                    let sc = bytes16(rec.add(32 + 1152 + 16 * ib));
                    store_mult(dec, slot, 2 * ib, odd(_mm512_and_si512(sc, nib)));
                    store_mult(dec, slot, 2 * ib + 1, odd(_mm512_srli_epi32(sc, 4)));
                }
                for k in 0..GROUPS {
                    let signs = masks(_mm_loadu_si128(rec.add(32 + 512 + 16 * k) as *const __m128i));
                    let (qs, qh, shift) = (32 + 16 * k, 32 + 1024 + 16 * (k / 4), 2 * (k % 4));
                    for p in 0..2 {
                        let mag =
                            rows8(p, |r| *IQ2S_GRID.get_unchecked(byte(qs + r) | (byte(qh + r) >> shift & 3) << 8));
                        put(k, p, signed(mag, signs[p]));
                    }
                }
            }
            Format::IQ3XXS => {
                store_d(dec, slot, halves(rec, 0.25));
                for ib in 0..8 {
                    let aux = _mm512_loadu_si512(rec.add(32 + 1024 + 64 * ib) as *const _);
                    let mult = odd(_mm512_srli_epi32(aux, 28));
                    store_mult(dec, slot, 2 * ib, mult);
                    store_mult(dec, slot, 2 * ib + 1, mult);
                    for l in 0..4 {
                        let signs = ksigns(_mm512_and_si512(srl32(aux, 7 * l as u32), _mm512_set1_epi32(127)));
                        let at = 32 + 16 * (8 * ib + 2 * l);
                        for p in 0..2 {
                            let mag = rows8(p, |r| {
                                let lo = *IQ3XXS_GRID.get_unchecked(byte(at + r)) as u64;
                                lo | (*IQ3XXS_GRID.get_unchecked(byte(at + 16 + r)) as u64) << 32
                            });
                            put(4 * ib + l, p, signed(mag, signs[p]));
                        }
                    }
                }
            }
            Format::IQ3S => {
                store_d(dec, slot, halves(rec, 1.0));
                for j in 0..4 {
                    let sc = bytes16(rec.add(1696 + 16 * j));
                    for (ib, s) in [(2 * j, _mm512_and_si512(sc, nib)), (2 * j + 1, _mm512_srli_epi32(sc, 4))] {
                        store_mult(dec, slot, 2 * ib, odd(s));
                        store_mult(dec, slot, 2 * ib + 1, odd(s));
                    }
                }
                for k in 0..GROUPS {
                    let signs = masks(_mm_loadu_si128(rec.add(1184 + 16 * k) as *const __m128i));
                    // Indices 2k and 2k + 1: their ninth bits are bits of qh[k / 4].
                    let (qs, qh) = (32 + 16 * 2 * k, 1056 + 16 * (k / 4));
                    let shift = 2 * (k % 4);
                    for p in 0..2 {
                        let mag = rows8(p, |r| {
                            let high = byte(qh + r) >> shift;
                            let lo = *IQ3S_GRID.get_unchecked(byte(qs + r) | (high & 1) << 8) as u64;
                            lo | (*IQ3S_GRID.get_unchecked(byte(qs + 16 + r) | (high >> 1 & 1) << 8) as u64) << 32
                        });
                        put(k, p, signed(mag, signs[p]));
                    }
                }
            }
            Format::IQ1S => {
                store_d(dec, slot, halves(rec, 0.125));
                let table = IQ1_SHIFTED.as_ptr();
                for ib in 0..8 {
                    let qh_at = 544 + 32 * ib;
                    let mult =
                        odd(_mm512_and_si512(_mm512_srli_epi32(words16(rec.add(qh_at)), 12), _mm512_set1_epi32(7)));
                    store_mult(dec, slot, 2 * ib, mult);
                    store_mult(dec, slot, 2 * ib + 1, mult);
                    for l in 0..4 {
                        let k = 4 * ib + l;
                        for p in 0..2 {
                            let v = rows8(p, |r| {
                                let qh = word(qh_at + 2 * r);
                                *table.add(byte(32 + 16 * k + r) | (qh >> (3 * l) & 7) << 8 | (qh >> 15) << 11)
                            });
                            put(k, p, v);
                        }
                    }
                }
            }
            Format::IQ1M => {
                let s: [__m512i; 4] = std::array::from_fn(|i| words16(rec.add(768 + 32 * i)));
                let bits = _mm512_or_si512(
                    _mm512_or_si512(
                        _mm512_srli_epi32(s[0], 12),
                        _mm512_and_si512(_mm512_srli_epi32(s[1], 8), _mm512_set1_epi32(0x00f0)),
                    ),
                    _mm512_or_si512(
                        _mm512_and_si512(_mm512_srli_epi32(s[2], 4), _mm512_set1_epi32(0x0f00)),
                        _mm512_and_si512(s[3], _mm512_set1_epi32(0xf000)),
                    ),
                );
                let d = _mm512_mul_ps(_mm512_cvtph_ps(_mm512_cvtepi32_epi16(bits)), _mm512_set1_ps(0.125));
                store_d(dec, slot, d);
                for h in 0..SLOTS {
                    let sc = srl32(s[h / 4], 3 * (h % 4) as u32);
                    store_mult(dec, slot, h, odd(_mm512_and_si512(sc, _mm512_set1_epi32(7))));
                }
                let table = IQ1_SHIFTED.as_ptr();
                for k in 0..GROUPS {
                    let (qh, shift) = (512 + 16 * (k / 2), 4 * (k % 2));
                    for p in 0..2 {
                        let v = rows8(p, |r| {
                            let nibble = byte(qh + r) >> shift & 15;
                            *table.add(byte(16 * k + r) | (nibble & 7) << 8 | (nibble >> 3) << 11)
                        });
                        put(k, p, v);
                    }
                }
            }
            Format::TQ2_0 => {
                store_d(dec, slot, halves(rec.add(1024), 1.0));
                store_ones(dec, slot);
                let three = _mm512_set1_epi8(3);
                let bias = _mm512_set1_epi8(127);
                for g in 0..GROUPS {
                    // Value 128c + 32l + m is bits 2l of byte 32c + m.
                    let (c, l, piece) = (g / 16, g % 16 / 4, g % 4);
                    for p in 0..2 {
                        let bytes = _mm512_loadu_si512(rec.add(128 * (4 * c + piece) + 64 * p) as *const _);
                        let v = _mm512_and_si512(_mm512_srl_epi64(bytes, _mm_cvtsi32_si128(2 * l as i32)), three);
                        put(g, p, _mm512_add_epi8(v, bias));
                    }
                }
            }
            Format::TQ1_0 => {
                store_d(dec, slot, halves(rec.add(832), 1.0));
                store_ones(dec, slot);
                const POW3: [i16; 5] = [1, 3, 9, 27, 81];
                for g in 0..30 {
                    // Values 32n + m (bytes 0..32, digit n), then 160 + 16n + m (bytes 32..48).
                    let (n, piece) = if g < 20 { (g / 4, g % 4) } else { ((g - 20) / 2, 4 + (g - 20) % 2) };
                    for p in 0..2 {
                        let bytes = _mm512_loadu_si512(rec.add(128 * piece + 64 * p) as *const _);
                        put(g, p, trits(bytes, _mm512_set1_epi16(POW3[n])));
                    }
                }
                // Values 240 + 4n + m: digit n of the last 4 bytes; a group holds digits n, n + 1.
                for (g, n) in [(30, 0), (31, 2)] {
                    let pow = |i: usize| POW3[i] as i64 as u64 & 0xffff;
                    let c = (pow(n) | pow(n) << 16 | pow(n + 1) << 32 | pow(n + 1) << 48) as i64;
                    for p in 0..2 {
                        let four = _mm512_cvtepu32_epi64(_mm256_loadu_si256(rec.add(768 + 32 * p) as *const __m256i));
                        let both = _mm512_or_si512(four, _mm512_slli_epi64(four, 32));
                        put(g, p, trits(both, _mm512_set1_epi64(c)));
                    }
                }
            }
            _ => unreachable!("{:?} is not a grid format", w.format),
        }
    }

    /// Multipliers of 1 for every slot (the ternary types' one scale a block).
    #[inline(always)]
    unsafe fn store_ones(dec: &mut Decoded, slot: usize) {
        for h in 0..SLOTS {
            store_mult(dec, slot, h, _mm512_set1_epi32(1));
        }
    }

    /// TQ1_0's base-3 digit of each byte for the power of 3 in its 16-bit lane `pow`:
    /// `((byte·pow mod 256)·3) >> 8` (ggml's uint8 arithmetic), plus 127 (`BIAS − 1`).
    #[inline(always)]
    unsafe fn trits(bytes: __m512i, pow: __m512i) -> __m512i {
        let low = _mm512_set1_epi16(0x00ff);
        let three = _mm512_set1_epi16(3);
        // Each byte times pow, mod 256: the low bytes' products (kept low), the high bytes'
        // (their low byte zero, so the product's high byte is theirs alone).
        let even = _mm512_and_si512(_mm512_mullo_epi16(bytes, pow), low);
        let odd = _mm512_mullo_epi16(_mm512_andnot_si512(low, bytes), pow);
        let even = _mm512_mulhi_epu16(_mm512_slli_epi16(even, 8), three);
        let odd = _mm512_slli_epi16(_mm512_mulhi_epu16(odd, three), 8);
        _mm512_add_epi8(_mm512_or_si512(even, odd), _mm512_set1_epi8(127))
    }
}

/// The tiles on x86 CPUs with AVX2 but without AVX-512 VNNI: the AVX-512 kernel's structure and
/// `Decoded` layout (so `decode_scalar` is the reference of both decoders), in 256-bit vectors.
/// A 32-byte vector of decoded values holds 4 rows' 8 values of a group (quarter `q`: rows
/// `4q..4q + 4`, at `g·128 + 32q`). Without `vpdpbusd`, the stored values (plus 128, the full
/// 8-bit range) are flipped back to signed and multiplied as ggml's AVX2 code multiplies signed
/// bytes: `|q|` by `x` with `q`'s sign (`vpmaddubsw`, pairs of products in 16 bits), so no
/// `−128·Σx` start is needed. The grid entries are scalar loads, as on AVX-512: a `vpgatherdq`
/// of 4 rows' entries made IQ2_XXS's one-row product 25% slower on an AMD EPYC (Zen).
#[cfg(target_arch = "x86_64")]
pub(super) mod avx2 {
    use super::super::avx2::{bytes_u32, store};
    use super::*;
    use std::arch::x86_64::*;

    /// Tiles `t0..t0 + tiles` against every activation row.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(in super::super) unsafe fn columns(
        w: &Interleaved,
        xq: &QuantizedRows,
        m: usize,
        t0: usize,
        tiles: usize,
        out: *mut f32,
    ) {
        let nb = w.blocks();
        DECODED.with(|cell| {
            let dec = &mut *cell.borrow_mut();
            for t in t0..t0 + tiles {
                if m <= 4 {
                    // Each record decoded and multiplied at once, in L1.
                    dec.reserve(1);
                    rows_by_four!(m, 0, |R, row0| tile::<R>(w, dec, xq, row0, t, true, out));
                    continue;
                }
                dec.reserve(nb);
                for b in 0..nb {
                    decode(w, t, b, dec, b);
                }
                rows_by_four!(m, 0, |R, row0| tile::<R>(w, dec, xq, row0, t, false, out));
            }
        })
    }

    /// Activation rows `row0..row0 + R` times tile `t`: its records decoded one at a time into
    /// slot 0 (`fresh`), or read from their slots.
    #[inline(always)]
    unsafe fn tile<const R: usize>(
        w: &Interleaved,
        dec: &mut Decoded,
        xq: &QuantizedRows,
        row0: usize,
        t: usize,
        fresh: bool,
        out: *mut f32,
    ) {
        let nb = w.blocks();
        let units = nb * QK_K / QK;
        let flip = _mm256_set1_epi8(-128);
        // Per row and quarter, 4 rows' pairs of lanes.
        let mut acc = [[_mm256_setzero_ps(); 4]; R];
        for b in 0..nb {
            let slot = if fresh {
                decode(w, t, b, dec, 0);
                0
            } else {
                b
            };
            let values = dec.values.as_ptr().add(slot * VALUES_BYTES);
            let mult = dec.mult.as_ptr().add(slot * SLOTS * 2 * LANES);
            let dp = dec.d.as_ptr().add(slot * 2 * LANES);
            for u in 0..QK_K / QK {
                let unit = |r: usize| (row0 + r) * units + b * QK_K / QK + u;
                let xd: [__m256; R] = std::array::from_fn(|r| _mm256_set1_ps(*xq.scales.get_unchecked(unit(r))));
                for q in 0..4 {
                    let mut total = [_mm256_setzero_si256(); R];
                    for h in 0..2 {
                        // The two groups' pairs of products add in 16 bits: grid values are at
                        // most 62 (IQ3), activations 127, so 2·2·62·127 < 2^15.
                        let mut sums = [_mm256_setzero_si256(); R];
                        for gg in 0..2 {
                            let g = 4 * u + 2 * h + gg;
                            let v =
                                _mm256_xor_si256(_mm256_loadu_si256(values.add(g * 128 + 32 * q) as *const _), flip);
                            let mag = _mm256_abs_epi8(v);
                            for r in 0..R {
                                let xp = xq.values.as_ptr().add(unit(r) * QK + 8 * (2 * h + gg)) as *const i64;
                                let x = _mm256_sign_epi8(_mm256_set1_epi64x(xp.read_unaligned()), v);
                                sums[r] = _mm256_add_epi16(sums[r], _mm256_maddubs_epi16(mag, x));
                            }
                        }
                        // The slot's multipliers (at most 31) in both 16-bit halves of each
                        // lane: `vpmaddwd` widens the sums and multiplies them at once.
                        let m = _mm256_loadu_si256(mult.add((2 * u + h) * 2 * LANES + 8 * q) as *const _);
                        let m = _mm256_or_si256(m, _mm256_slli_epi32(m, 16));
                        for r in 0..R {
                            total[r] = _mm256_add_epi32(total[r], _mm256_madd_epi16(sums[r], m));
                        }
                    }
                    let d = _mm256_loadu_ps(dp.add(8 * q));
                    for r in 0..R {
                        acc[r][q] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(total[r]), _mm256_mul_ps(d, xd[r]), acc[r][q]);
                    }
                }
            }
        }
        for (r, acc) in acc.into_iter().enumerate() {
            for hh in 0..2 {
                // A row's two lanes hold halves of its sum (no offset in either, so adding them
                // as floats at the end loses nothing): `vhaddps` adds the pairs of quarters
                // 2hh and 2hh + 1 in the order rows 0, 1, 4, 5 | 2, 3, 6, 7 (of 8hh..).
                let rows = _mm256_hadd_ps(acc[2 * hh], acc[2 * hh + 1]);
                let rows = _mm256_castsi256_ps(_mm256_permute4x64_epi64::<0b11_01_10_00>(_mm256_castps_si256(rows)));
                store(rows, out, row0 + r, w.n, t * LANES, hh);
            }
        }
    }

    /// Two vectors of rows 0–7 and 8–15, `f(h)` for half `h`.
    #[inline(always)]
    unsafe fn both<T>(f: impl FnMut(usize) -> T) -> [T; 2] {
        std::array::from_fn(f)
    }

    /// The 16 rows' sign bytes of 7-bit sign indices (`v`: one per 32-bit lane, rows 0–7 and
    /// 8–15): the index with its parity as the eighth bit (ggml's `ksigns_iq2xs`), as 4 words of
    /// 4 rows' sign bytes.
    #[inline(always)]
    unsafe fn ksigns(v: [__m256i; 2]) -> [u32; 4] {
        let first = _mm256_setr_epi8(
            0, 4, 8, 12, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, 0, 4, 8, 12, -1, -1, -1, -1, -1, -1, -1, -1,
            -1, -1, -1, -1,
        );
        let mut out = [0u32; 4];
        for (h, v) in v.into_iter().enumerate() {
            let mut p = _mm256_xor_si256(v, _mm256_srli_epi32(v, 4));
            p = _mm256_xor_si256(p, _mm256_srli_epi32(p, 2));
            p = _mm256_xor_si256(p, _mm256_srli_epi32(p, 1));
            let s = _mm256_or_si256(v, _mm256_slli_epi32(_mm256_and_si256(p, _mm256_set1_epi32(1)), 7));
            // Each lane's low byte, 4 rows to a word of each 128-bit half.
            let bytes = _mm256_shuffle_epi8(s, first);
            out[2 * h] = _mm256_extract_epi32::<0>(bytes) as u32;
            out[2 * h + 1] = _mm256_extract_epi32::<4>(bytes) as u32;
        }
        out
    }

    /// 16 sign bytes at `p` as 4 words of 4 rows'.
    #[inline(always)]
    unsafe fn masks(p: *const u8) -> [u32; 4] {
        std::array::from_fn(|q| (p.add(4 * q) as *const u32).read_unaligned())
    }

    /// Grid magnitudes (below 128) of 4 rows with their sign bytes `signs` (one a row, bit `j`
    /// for value `j`), plus 128: `128 + g` or `128 − g`. The sign bits spread to bytes as
    /// `avx2::with_high_bits` spreads its masks.
    #[inline(always)]
    unsafe fn signed(mag: __m256i, signs: u32) -> __m256i {
        let spread = _mm256_shuffle_epi8(
            _mm256_set1_epi32(signs as i32),
            _mm256_setr_epi8(
                0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1, 2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3,
            ),
        );
        let select = _mm256_set1_epi64x(0x8040_2010_0804_0201u64 as i64);
        let negative = _mm256_cmpeq_epi8(_mm256_and_si256(spread, select), select);
        let bias = _mm256_set1_epi8(-128);
        _mm256_blendv_epi8(_mm256_xor_si256(mag, bias), _mm256_sub_epi8(bias, mag), negative)
    }

    /// The 4 rows' grid entries `entry(r)` (rows `4q..4q + 4`) as one vector.
    #[inline(always)]
    unsafe fn rows4(q: usize, entry: impl Fn(usize) -> u64) -> __m256i {
        let e = |i: usize| entry(4 * q + i) as i64;
        _mm256_set_epi64x(e(3), e(2), e(1), e(0))
    }

    /// An 8-lane vector (rows `8h..8h + 8`) in pairs: lanes `2r`, `2r + 1` row `r`'s.
    #[inline(always)]
    unsafe fn pairs(v: __m256i) -> [__m256i; 2] {
        let lo = _mm256_setr_epi32(0, 0, 1, 1, 2, 2, 3, 3);
        let hi = _mm256_setr_epi32(4, 4, 5, 5, 6, 6, 7, 7);
        [_mm256_permutevar8x32_epi32(v, lo), _mm256_permutevar8x32_epi32(v, hi)]
    }

    /// Stores `D` (rows 0–7, 8–15) in pairs.
    #[inline(always)]
    unsafe fn store_d(dec: &mut Decoded, slot: usize, d: [__m256; 2]) {
        let p = dec.d.as_mut_ptr().add(slot * 2 * LANES);
        for (h, d) in d.into_iter().enumerate() {
            let [lo, hi] = pairs(_mm256_castps_si256(d));
            _mm256_storeu_ps(p.add(16 * h), _mm256_castsi256_ps(lo));
            _mm256_storeu_ps(p.add(16 * h + 8), _mm256_castsi256_ps(hi));
        }
    }

    /// The 16 rows' float16 at `p` times `scale`.
    #[inline(always)]
    unsafe fn halves(p: *const u8, scale: f32) -> [__m256; 2] {
        both(|h| _mm256_mul_ps(super::super::avx2::halves(p, h), _mm256_set1_ps(scale)))
    }

    /// Stores slot `s`'s multipliers (one per row) in pairs.
    #[inline(always)]
    unsafe fn store_mult(dec: &mut Decoded, slot: usize, s: usize, mult: [__m256i; 2]) {
        let p = dec.mult.as_mut_ptr().add((slot * SLOTS + s) * 2 * LANES);
        for (h, m) in mult.into_iter().enumerate() {
            let [lo, hi] = pairs(m);
            _mm256_storeu_si256(p.add(16 * h) as *mut _, lo);
            _mm256_storeu_si256(p.add(16 * h + 8) as *mut _, hi);
        }
    }

    /// Each 32-bit lane shifted right by `n` (not a constant).
    #[inline(always)]
    unsafe fn srl32(v: [__m256i; 2], n: u32) -> [__m256i; 2] {
        v.map(|v| _mm256_srl_epi32(v, _mm_cvtsi32_si128(n as i32)))
    }

    /// Each 32-bit lane and `mask`.
    #[inline(always)]
    unsafe fn and32(v: [__m256i; 2], mask: i32) -> [__m256i; 2] {
        v.map(|v| _mm256_and_si256(v, _mm256_set1_epi32(mask)))
    }

    /// `2·s + 1` for 4-bit `s` in each 32-bit lane.
    #[inline(always)]
    unsafe fn odd(s: [__m256i; 2]) -> [__m256i; 2] {
        s.map(|s| _mm256_add_epi32(_mm256_slli_epi32(s, 1), _mm256_set1_epi32(1)))
    }

    /// The 16 rows' bytes at `p`, one per 32-bit lane.
    #[inline(always)]
    unsafe fn bytes16(p: *const u8) -> [__m256i; 2] {
        both(|h| bytes_u32(p, h))
    }

    /// The 16 rows' u16 at `p`, one per 32-bit lane.
    #[inline(always)]
    unsafe fn words16(p: *const u8) -> [__m256i; 2] {
        both(|h| _mm256_cvtepu16_epi32(_mm_loadu_si128(p.add(16 * h) as *const __m128i)))
    }

    /// The 16 rows' u32 at `p`.
    #[inline(always)]
    unsafe fn dwords16(p: *const u8) -> [__m256i; 2] {
        both(|h| _mm256_loadu_si256(p.add(32 * h) as *const __m256i))
    }

    /// Decodes record `b` of tile `t` into `slot` of `dec`: the same bytes as `decode_scalar`.
    #[inline(always)]
    pub(super) unsafe fn decode(w: &Interleaved, t: usize, b: usize, dec: &mut Decoded, slot: usize) {
        let rec = w.record(t, b).as_ptr();
        let values = dec.values.as_mut_ptr().add(slot * VALUES_BYTES);
        let put = |g: usize, q: usize, v: __m256i| _mm256_storeu_si256(values.add(g * 128 + 32 * q) as *mut _, v);
        let byte = |at: usize| *rec.add(at) as usize;
        let word = |at: usize| (rec.add(at) as *const u16).read_unaligned() as usize;
        match w.format {
            Format::IQ2XXS => {
                store_d(dec, slot, halves(rec, 0.125));
                for ib in 0..8 {
                    let base = 32 + 128 * ib;
                    let aux = dwords16(rec.add(base + 64));
                    let mult = odd(srl32(aux, 28));
                    store_mult(dec, slot, 2 * ib, mult);
                    store_mult(dec, slot, 2 * ib + 1, mult);
                    for l in 0..4 {
                        let signs = ksigns(and32(srl32(aux, 7 * l as u32), 127));
                        for q in 0..4 {
                            let mag = rows4(q, |r| *IQ2XXS_GRID.get_unchecked(byte(base + 16 * l + r)));
                            put(4 * ib + l, q, signed(mag, signs[q]));
                        }
                    }
                }
            }
            Format::IQ2XS => {
                store_d(dec, slot, halves(rec, 0.125));
                for ib in 0..8 {
                    let sc = bytes16(rec.add(32 + 1024 + 16 * ib));
                    store_mult(dec, slot, 2 * ib, odd(and32(sc, 15)));
                    store_mult(dec, slot, 2 * ib + 1, odd(srl32(sc, 4)));
                }
                for k in 0..GROUPS {
                    let at = 32 + 32 * k;
                    let signs = ksigns(srl32(words16(rec.add(at)), 9));
                    for q in 0..4 {
                        let mag = rows4(q, |r| *IQ2XS_GRID.get_unchecked(word(at + 2 * r) & 511));
                        put(k, q, signed(mag, signs[q]));
                    }
                }
            }
            Format::IQ2S => {
                store_d(dec, slot, halves(rec, 0.125));
                for ib in 0..8 {
                    let sc = bytes16(rec.add(32 + 1152 + 16 * ib));
                    store_mult(dec, slot, 2 * ib, odd(and32(sc, 15)));
                    store_mult(dec, slot, 2 * ib + 1, odd(srl32(sc, 4)));
                }
                for k in 0..GROUPS {
                    let signs = masks(rec.add(32 + 512 + 16 * k));
                    let (qs, qh, shift) = (32 + 16 * k, 32 + 1024 + 16 * (k / 4), 2 * (k % 4));
                    for q in 0..4 {
                        let mag =
                            rows4(q, |r| *IQ2S_GRID.get_unchecked(byte(qs + r) | (byte(qh + r) >> shift & 3) << 8));
                        put(k, q, signed(mag, signs[q]));
                    }
                }
            }
            Format::IQ3XXS => {
                store_d(dec, slot, halves(rec, 0.25));
                for ib in 0..8 {
                    let aux = dwords16(rec.add(32 + 1024 + 64 * ib));
                    let mult = odd(srl32(aux, 28));
                    store_mult(dec, slot, 2 * ib, mult);
                    store_mult(dec, slot, 2 * ib + 1, mult);
                    for l in 0..4 {
                        let signs = ksigns(and32(srl32(aux, 7 * l as u32), 127));
                        let at = 32 + 16 * (8 * ib + 2 * l);
                        for q in 0..4 {
                            let mag = rows4(q, |r| {
                                let lo = *IQ3XXS_GRID.get_unchecked(byte(at + r)) as u64;
                                lo | (*IQ3XXS_GRID.get_unchecked(byte(at + 16 + r)) as u64) << 32
                            });
                            put(4 * ib + l, q, signed(mag, signs[q]));
                        }
                    }
                }
            }
            Format::IQ3S => {
                store_d(dec, slot, halves(rec, 1.0));
                for j in 0..4 {
                    let sc = bytes16(rec.add(1696 + 16 * j));
                    for (ib, s) in [(2 * j, and32(sc, 15)), (2 * j + 1, srl32(sc, 4))] {
                        store_mult(dec, slot, 2 * ib, odd(s));
                        store_mult(dec, slot, 2 * ib + 1, odd(s));
                    }
                }
                for k in 0..GROUPS {
                    let signs = masks(rec.add(1184 + 16 * k));
                    // Indices 2k and 2k + 1: their ninth bits are bits of qh[k / 4].
                    let (qs, qh) = (32 + 16 * 2 * k, 1056 + 16 * (k / 4));
                    let shift = 2 * (k % 4);
                    for q in 0..4 {
                        let mag = rows4(q, |r| {
                            let high = byte(qh + r) >> shift;
                            let lo = *IQ3S_GRID.get_unchecked(byte(qs + r) | (high & 1) << 8) as u64;
                            lo | (*IQ3S_GRID.get_unchecked(byte(qs + 16 + r) | (high >> 1 & 1) << 8) as u64) << 32
                        });
                        put(k, q, signed(mag, signs[q]));
                    }
                }
            }
            Format::IQ1S => {
                store_d(dec, slot, halves(rec, 0.125));
                let table = IQ1_SHIFTED.as_ptr();
                for ib in 0..8 {
                    let qh_at = 544 + 32 * ib;
                    let mult = odd(and32(srl32(words16(rec.add(qh_at)), 12), 7));
                    store_mult(dec, slot, 2 * ib, mult);
                    store_mult(dec, slot, 2 * ib + 1, mult);
                    for l in 0..4 {
                        let k = 4 * ib + l;
                        for q in 0..4 {
                            let v = rows4(q, |r| {
                                let qh = word(qh_at + 2 * r);
                                *table.add(byte(32 + 16 * k + r) | (qh >> (3 * l) & 7) << 8 | (qh >> 15) << 11)
                            });
                            put(k, q, v);
                        }
                    }
                }
            }
            Format::IQ1M => {
                let s: [[__m256i; 2]; 4] = std::array::from_fn(|i| words16(rec.add(768 + 32 * i)));
                // d's float16 bits, the top nibbles of the four scale words.
                let d = both(|h| {
                    let bits = _mm256_or_si256(
                        _mm256_or_si256(
                            _mm256_srli_epi32(s[0][h], 12),
                            _mm256_and_si256(_mm256_srli_epi32(s[1][h], 8), _mm256_set1_epi32(0x00f0)),
                        ),
                        _mm256_or_si256(
                            _mm256_and_si256(_mm256_srli_epi32(s[2][h], 4), _mm256_set1_epi32(0x0f00)),
                            _mm256_and_si256(s[3][h], _mm256_set1_epi32(0xf000)),
                        ),
                    );
                    // At most 0xffff: packing to u16 without saturation.
                    let words = _mm_packus_epi32(_mm256_castsi256_si128(bits), _mm256_extracti128_si256::<1>(bits));
                    _mm256_mul_ps(_mm256_cvtph_ps(words), _mm256_set1_ps(0.125))
                });
                store_d(dec, slot, d);
                for h in 0..SLOTS {
                    store_mult(dec, slot, h, odd(and32(srl32(s[h / 4], 3 * (h % 4) as u32), 7)));
                }
                let table = IQ1_SHIFTED.as_ptr();
                for k in 0..GROUPS {
                    let (qh, shift) = (512 + 16 * (k / 2), 4 * (k % 2));
                    for q in 0..4 {
                        let v = rows4(q, |r| {
                            let nibble = byte(qh + r) >> shift & 15;
                            *table.add(byte(16 * k + r) | (nibble & 7) << 8 | (nibble >> 3) << 11)
                        });
                        put(k, q, v);
                    }
                }
            }
            Format::TQ2_0 => {
                store_d(dec, slot, halves(rec.add(1024), 1.0));
                store_ones(dec, slot);
                let three = _mm256_set1_epi8(3);
                let bias = _mm256_set1_epi8(127);
                for g in 0..GROUPS {
                    // Value 128c + 32l + m is bits 2l of byte 32c + m.
                    let (c, l, piece) = (g / 16, g % 16 / 4, g % 4);
                    for q in 0..4 {
                        let bytes = _mm256_loadu_si256(rec.add(128 * (4 * c + piece) + 32 * q) as *const _);
                        let v = _mm256_and_si256(_mm256_srl_epi64(bytes, _mm_cvtsi32_si128(2 * l as i32)), three);
                        put(g, q, _mm256_add_epi8(v, bias));
                    }
                }
            }
            Format::TQ1_0 => {
                store_d(dec, slot, halves(rec.add(832), 1.0));
                store_ones(dec, slot);
                const POW3: [i16; 5] = [1, 3, 9, 27, 81];
                for g in 0..30 {
                    // Values 32n + m (bytes 0..32, digit n), then 160 + 16n + m (bytes 32..48).
                    let (n, piece) = if g < 20 { (g / 4, g % 4) } else { ((g - 20) / 2, 4 + (g - 20) % 2) };
                    for q in 0..4 {
                        let bytes = _mm256_loadu_si256(rec.add(128 * piece + 32 * q) as *const _);
                        put(g, q, trits(bytes, _mm256_set1_epi16(POW3[n])));
                    }
                }
                // Values 240 + 4n + m: digit n of the last 4 bytes; a group holds digits n, n + 1.
                for (g, n) in [(30, 0), (31, 2)] {
                    let pow = |i: usize| POW3[i] as i64 as u64 & 0xffff;
                    let c = (pow(n) | pow(n) << 16 | pow(n + 1) << 32 | pow(n + 1) << 48) as i64;
                    for q in 0..4 {
                        let four = _mm256_cvtepu32_epi64(_mm_loadu_si128(rec.add(768 + 16 * q) as *const __m128i));
                        let both = _mm256_or_si256(four, _mm256_slli_epi64(four, 32));
                        put(g, q, trits(both, _mm256_set1_epi64x(c)));
                    }
                }
            }
            _ => unreachable!("{:?} is not a grid format", w.format),
        }
    }

    /// Multipliers of 1 for every slot (the ternary types' one scale a block).
    #[inline(always)]
    unsafe fn store_ones(dec: &mut Decoded, slot: usize) {
        for h in 0..SLOTS {
            store_mult(dec, slot, h, [_mm256_set1_epi32(1); 2]);
        }
    }

    /// TQ1_0's base-3 digit of each byte for the power of 3 in its 16-bit lane `pow`, plus 127:
    /// `x86::trits` in 256 bits.
    #[inline(always)]
    unsafe fn trits(bytes: __m256i, pow: __m256i) -> __m256i {
        let low = _mm256_set1_epi16(0x00ff);
        let three = _mm256_set1_epi16(3);
        let even = _mm256_and_si256(_mm256_mullo_epi16(bytes, pow), low);
        let odd = _mm256_mullo_epi16(_mm256_andnot_si256(low, bytes), pow);
        let even = _mm256_mulhi_epu16(_mm256_slli_epi16(even, 8), three);
        let odd = _mm256_slli_epi16(_mm256_mulhi_epu16(odd, three), 8);
        _mm256_add_epi8(_mm256_or_si256(even, odd), _mm256_set1_epi8(127))
    }
}

/// The tiles on Arm with `sdot`: records decoded by the reference decoder (`decode_scalar`),
/// signed values multiplied 8 at a time (a 16-byte vector is two rows' 8 values; the activation
/// group is repeated in both halves).
#[cfg(target_arch = "aarch64")]
pub(super) mod neon {
    use super::super::neon::store;
    use super::*;
    use crate::arm::sdot;
    use std::arch::aarch64::*;

    /// Tiles `t0..t0 + tiles` against every activation row.
    #[target_feature(enable = "dotprod")]
    pub(in super::super) unsafe fn columns(
        w: &Interleaved,
        xq: &QuantizedRows,
        m: usize,
        t0: usize,
        tiles: usize,
        out: *mut f32,
    ) {
        let nb = w.blocks();
        DECODED.with(|cell| {
            let dec = &mut *cell.borrow_mut();
            dec.reserve(nb);
            for t in t0..t0 + tiles {
                for b in 0..nb {
                    decode_scalar(w, t, b, dec, b);
                }
                rows_by_two!(m, |R, row0| tile::<R>(w, dec, xq, row0, t, out));
            }
        })
    }

    /// Activation rows `row0..row0 + R` times tile `t`, its records decoded in their slots.
    #[inline(always)]
    unsafe fn tile<const R: usize>(
        w: &Interleaved,
        dec: &Decoded,
        xq: &QuantizedRows,
        row0: usize,
        t: usize,
        out: *mut f32,
    ) {
        let nb = w.blocks();
        let units = nb * QK_K / QK;
        // 8 vectors of two rows' pairs of lanes.
        let mut acc = [[vdupq_n_f32(0.0); 8]; R];
        for b in 0..nb {
            let values = dec.values.as_ptr().add(b * VALUES_BYTES);
            let mult = dec.mult.as_ptr().add(b * SLOTS * 2 * LANES);
            let dp = dec.d.as_ptr().add(b * 2 * LANES);
            let d: [float32x4_t; 8] = std::array::from_fn(|q| vld1q_f32(dp.add(4 * q)));
            for u in 0..QK_K / QK {
                let unit = |r: usize| (row0 + r) * units + b * QK_K / QK + u;
                let mut total = [[vdupq_n_s32(0); 8]; R];
                for h in 0..2 {
                    let mut sums = [[vdupq_n_s32(0); 8]; R];
                    for gg in 0..2 {
                        let g = 4 * u + 2 * h + gg;
                        let wv: [int8x16_t; 8] =
                            std::array::from_fn(|q| vld1q_s8(values.add(g * 128 + 16 * q) as *const i8));
                        for r in 0..R {
                            let x8 = vld1_s8(xq.values.as_ptr().add(unit(r) * QK + 8 * (2 * h + gg)));
                            let x = vcombine_s8(x8, x8);
                            for q in 0..8 {
                                sums[r][q] = sdot(sums[r][q], wv[q], x);
                            }
                        }
                    }
                    let mp = mult.add((2 * u + h) * 2 * LANES);
                    for q in 0..8 {
                        let m = vld1q_s32(mp.add(4 * q));
                        for r in 0..R {
                            total[r][q] = vmlaq_s32(total[r][q], sums[r][q], m);
                        }
                    }
                }
                for r in 0..R {
                    let xd = *xq.scales.get_unchecked(unit(r));
                    for q in 0..8 {
                        acc[r][q] = vfmaq_f32(acc[r][q], vcvtq_f32_s32(total[r][q]), vmulq_n_f32(d[q], xd));
                    }
                }
            }
        }
        for (r, acc) in acc.iter().enumerate() {
            // Lanes 2r, 2r + 1 are row r's: pairwise sums give 4 rows from two vectors.
            for v in 0..4 {
                let rows = vpaddq_f32(acc[2 * v], acc[2 * v + 1]);
                store(rows, out, row0 + r, w.n, t * LANES + 4 * v);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The SIMD decoder writes the reference decoder's bytes, multipliers and scales, for
    /// random records of every format.
    #[test]
    #[cfg(target_arch = "x86_64")]
    fn the_simd_decoder_matches_the_reference() {
        if !super::super::avx512() {
            return;
        }
        use rand::{rngs::StdRng, Rng, SeedableRng};
        for format in GRID_FORMATS {
            let ty = format.grid_type();
            let mut rng = StdRng::seed_from_u64(ty.id() as u64);
            let (n, k) = (61, 2048);
            let mut data: Vec<u8> = (0..n * k / QK_K * ty.block_bytes()).map(|_| rng.random()).collect();
            for block in data.chunks_exact_mut(ty.block_bytes()) {
                super::super::tests::finite_extra(ty, block);
            }
            let w = Interleaved::repack(format, &data, n, k).unwrap();
            let (mut want, mut got) = (Decoded::default(), Decoded::default());
            want.reserve(8);
            got.reserve(8);
            for t in 0..4 {
                for b in 0..8 {
                    decode_scalar(&w, t, b, &mut want, b);
                    // SAFETY: AVX-512 was detected; the record and slot exist.
                    unsafe {
                        #[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
                        unsafe fn run(w: &Interleaved, t: usize, b: usize, dec: &mut Decoded) {
                            x86::decode(w, t, b, dec, b)
                        }
                        run(&w, t, b, &mut got);
                    }
                }
                for (i, (a, b)) in got.values.iter().zip(&want.values).enumerate() {
                    assert_eq!(a, b, "{format:?} tile {t} value byte {i}");
                }
                assert_eq!(got.mult, want.mult, "{format:?} tile {t} multipliers");
                let bits = |d: &[f32]| d.iter().map(|v| v.to_bits()).collect::<Vec<_>>();
                assert_eq!(bits(&got.d), bits(&want.d), "{format:?} tile {t} scales");
            }
        }
    }

    /// The AVX2 decoder writes the reference decoder's bytes, multipliers and scales, for
    /// random records of every format.
    #[test]
    #[cfg(target_arch = "x86_64")]
    fn the_avx2_decoder_matches_the_reference() {
        if !super::super::avx2() {
            return;
        }
        use rand::{rngs::StdRng, Rng, SeedableRng};
        for format in GRID_FORMATS {
            let ty = format.grid_type();
            let mut rng = StdRng::seed_from_u64(ty.id() as u64);
            let (n, k) = (61, 2048);
            let mut data: Vec<u8> = (0..n * k / QK_K * ty.block_bytes()).map(|_| rng.random()).collect();
            for block in data.chunks_exact_mut(ty.block_bytes()) {
                super::super::tests::finite_extra(ty, block);
            }
            let w = Interleaved::repack(format, &data, n, k).unwrap();
            let (mut want, mut got) = (Decoded::default(), Decoded::default());
            want.reserve(8);
            got.reserve(8);
            for t in 0..4 {
                for b in 0..8 {
                    decode_scalar(&w, t, b, &mut want, b);
                    // SAFETY: AVX2, FMA and F16C were detected; the record and slot exist.
                    unsafe {
                        #[target_feature(enable = "avx2,fma,f16c")]
                        unsafe fn run(w: &Interleaved, t: usize, b: usize, dec: &mut Decoded) {
                            avx2::decode(w, t, b, dec, b)
                        }
                        run(&w, t, b, &mut got);
                    }
                }
                for (i, (a, b)) in got.values.iter().zip(&want.values).enumerate() {
                    assert_eq!(a, b, "{format:?} tile {t} value byte {i}");
                }
                assert_eq!(got.mult, want.mult, "{format:?} tile {t} multipliers");
                let bits = |d: &[f32]| d.iter().map(|v| v.to_bits()).collect::<Vec<_>>();
                assert_eq!(bits(&got.d), bits(&want.d), "{format:?} tile {t} scales");
            }
        }
    }

    /// `D·mult` is ggml's float32 scale of every slot, bit for bit.
    #[test]
    fn scale_parts_multiply_to_the_reference_scales() {
        use rand::{rngs::StdRng, Rng, SeedableRng};
        for format in GRID_FORMATS {
            let ty = format.grid_type();
            let mut rng = StdRng::seed_from_u64(7);
            for _ in 0..200 {
                let mut block: Vec<u8> = (0..ty.block_bytes()).map(|_| rng.random()).collect();
                super::super::tests::finite_extra(ty, &mut block);
                let (mut scales, mut q) = ([0f32; SLOTS], [0i8; QK_K]);
                ty.decode(&block, &mut scales, &mut q);
                let (d, mult) = scale_parts(ty, &block);
                for h in 0..SLOTS {
                    assert_eq!((d * mult[h] as f32).to_bits(), scales[h].to_bits(), "{format:?} slot {h}");
                }
            }
        }
    }
}
