//! The formats whose 4-bit values index a table of 16 int8 levels (IQ4_NL, IQ4_XS, MXFP4) in
//! 16-row tiles. candle lacks them (`weights::extra_types` decodes them); here they run on the
//! tiles' kernels with one extra step: `vpshufb` maps each nibble through the table (replicated
//! in each 128-bit lane) to `level + 128` as an unsigned byte, and the integer sums start at
//! `−128·Σq_x`, as Q8_0's do. The integer products equal ggml's exactly.
//!
//! Their values are laid out as Q4_0's (byte `j` of a 32-value group holds value `j` in its low
//! nibble, `j + 16` in its high one), so the records are the 32-value formats' (`mod.rs`):
//! each block field of the 16 rows contiguous, then one 64-byte vector per group of 4 bytes.
//!
//! - IQ4_NL (18 bytes a row): `d` (float16), then the values: Q4_0's record.
//! - MXFP4 (17 bytes a row): the E8M0 exponent byte, then the values. The scale is
//!   `ggml_e8m0_to_fp32_half` (2^(e − 128), exact in float32 for every byte), decoded in the
//!   kernel 16 rows at a time.
//! - IQ4_XS (136 bytes a row, a 256-value block): `d`, the 16-bit `scales_h` (the top two bits of
//!   the 8 scales), the 4 bytes of `scales_l` (their low nibbles, two to a byte), each of the 16
//!   rows contiguous (`IQ4XS_FIELDS`), then the values of the 8 units of 32 in turn. Unit `u` is
//!   `d·(ls_u − 32)·level[q]`: the kernel multiplies its integer sum (under 2^24, so converted
//!   exactly) by `d·(ls_u − 32)` (exact in float32) computed once for every row, as the k-quants
//!   apply their sub-block scales.

use super::{HALVES, LANES};

/// Byte widths of an IQ4_XS block's fields before its values: `d`, `scales_h`, `scales_l`
/// byte by byte.
pub(super) const IQ4XS_FIELDS: [usize; 6] = [2, 2, 1, 1, 1, 1];
/// Where an IQ4_XS record's `scales_h` start.
const IQ4XS_SC_H: usize = HALVES;
/// Where an IQ4_XS record's `scales_l` start: byte `i` of the 16 rows from `IQ4XS_SC_L + 16·i`.
const IQ4XS_SC_L: usize = 2 * HALVES;

/// Row `lane`'s signed integer scale `ls − 32` of unit `u` (values `32u..32u + 32`) of an IQ4_XS
/// record: the low nibble of `scales_l[u / 2]` (the high one for odd `u`), bits `2u, 2u + 1` of
/// `scales_h` above it.
pub(super) fn iq4xs_scale(record: &[u8], lane: usize, u: usize) -> i32 {
    let low = (record[IQ4XS_SC_L + (u / 2) * LANES + lane] >> (4 * (u % 2))) & 0xF;
    let high = u16::from_le_bytes([record[IQ4XS_SC_H + 2 * lane], record[IQ4XS_SC_H + 2 * lane + 1]]) >> (2 * u) & 3;
    (low as i32 | (high as i32) << 4) - 32
}

#[cfg(target_arch = "x86_64")]
pub(super) mod x86 {
    use super::super::Format;
    use super::*;
    use std::arch::x86_64::*;

    /// `format`'s levels plus 128 as unsigned bytes, in each 128-bit lane (for `vpshufb`; for
    /// `vpermb`, which reads six bits of each index, the same 16 repeated four times).
    #[inline(always)]
    pub(in super::super) unsafe fn levels(format: Format) -> __m512i {
        let levels = format.levels().copied().unwrap_or([0; 16]);
        let shifted: [u8; 16] = std::array::from_fn(|i| levels[i] as u8 ^ 0x80);
        _mm512_broadcast_i32x4(_mm_loadu_si128(shifted.as_ptr() as *const __m128i))
    }

    /// The 16 rows' MXFP4 scales of a record: `e8m0_half` of each exponent byte.
    #[inline(always)]
    pub(in super::super) unsafe fn e8m0_scales(rec: *const u8) -> __m512 {
        let e = _mm512_cvtepu8_epi32(_mm_loadu_si128(rec as *const __m128i));
        let normal = _mm512_slli_epi32(_mm512_sub_epi32(e, _mm512_set1_epi32(1)), 23);
        // Below 2: the subnormals 2^-128 and 2^-127.
        let subnormal = _mm512_sllv_epi32(_mm512_set1_epi32(0x0020_0000), e);
        let small = _mm512_cmplt_epu32_mask(e, _mm512_set1_epi32(2));
        _mm512_castsi512_ps(_mm512_mask_blend_epi32(small, normal, subnormal))
    }

    /// The 16 rows' integer scales `ls − 32` of unit `u` of an IQ4_XS record, as `iq4xs_scale`.
    #[inline(always)]
    pub(in super::super) unsafe fn iq4xs_scales(rec: *const u8, u: usize) -> __m512i {
        let low = _mm512_cvtepu8_epi32(_mm_loadu_si128(rec.add(IQ4XS_SC_L + (u / 2) * LANES) as *const __m128i));
        let low = _mm512_srlv_epi32(low, _mm512_set1_epi32(4 * (u as i32 % 2)));
        let high = _mm512_cvtepu16_epi32(_mm256_loadu_si256(rec.add(IQ4XS_SC_H) as *const __m256i));
        let high = _mm512_srlv_epi32(high, _mm512_set1_epi32(2 * u as i32));
        let ls = _mm512_or_si512(
            _mm512_and_si512(low, _mm512_set1_epi32(0xF)),
            _mm512_slli_epi32(_mm512_and_si512(high, _mm512_set1_epi32(3)), 4),
        );
        _mm512_sub_epi32(ls, _mm512_set1_epi32(32))
    }
}

/// The AVX2 forms of `x86`'s helpers, for 8 rows at a time (`h`: rows `8h..8h + 8`).
#[cfg(target_arch = "x86_64")]
pub(super) mod avx2 {
    use super::super::avx2::{bytes_u32, HALF};
    use super::super::Format;
    use super::*;
    use std::arch::x86_64::*;

    /// `format`'s levels as signed bytes, in each 128-bit lane (for `vpshufb`): the AVX2
    /// kernel multiplies them signed (`avx2::dot_s`), so they carry no offset.
    #[inline(always)]
    pub(in super::super) unsafe fn levels(format: Format) -> __m256i {
        let levels = format.levels().copied().unwrap_or([0; 16]);
        _mm256_broadcastsi128_si256(_mm_loadu_si128(levels.as_ptr() as *const __m128i))
    }

    /// Rows `8h..8h + 8`'s MXFP4 scales of a record: `e8m0_half` of each exponent byte.
    #[inline(always)]
    pub(in super::super) unsafe fn e8m0_scales(rec: *const u8, h: usize) -> __m256 {
        let e = bytes_u32(rec, h);
        let normal = _mm256_slli_epi32(_mm256_sub_epi32(e, _mm256_set1_epi32(1)), 23);
        // Below 2: the subnormals 2^-128 and 2^-127.
        let subnormal = _mm256_sllv_epi32(_mm256_set1_epi32(0x0020_0000), e);
        let small = _mm256_cmpgt_epi32(_mm256_set1_epi32(2), e);
        _mm256_castsi256_ps(_mm256_blendv_epi8(normal, subnormal, small))
    }

    /// Rows `8h..8h + 8`'s integer scales `ls − 32` of unit `u` of an IQ4_XS record, as
    /// `iq4xs_scale`.
    #[inline(always)]
    pub(in super::super) unsafe fn iq4xs_scales(rec: *const u8, u: usize, h: usize) -> __m256i {
        let low = bytes_u32(rec.add(IQ4XS_SC_L + (u / 2) * LANES), h);
        let low = _mm256_srlv_epi32(low, _mm256_set1_epi32(4 * (u as i32 % 2)));
        let high = _mm256_cvtepu16_epi32(_mm_loadu_si128(rec.add(IQ4XS_SC_H + h * HALF * 2) as *const __m128i));
        let high = _mm256_srlv_epi32(high, _mm256_set1_epi32(2 * u as i32));
        let ls = _mm256_or_si256(
            _mm256_and_si256(low, _mm256_set1_epi32(0xF)),
            _mm256_slli_epi32(_mm256_and_si256(high, _mm256_set1_epi32(3)), 4),
        );
        _mm256_sub_epi32(ls, _mm256_set1_epi32(32))
    }
}

#[cfg(all(test, target_arch = "x86_64"))]
mod tests {
    use super::*;
    use crate::extra_types::e8m0_half;

    /// The kernel's MXFP4 scales equal ggml's for every exponent byte, subnormals included
    /// (whose products are too small for the product tests' absolute bound to see).
    #[test]
    fn the_kernel_decodes_every_e8m0_byte_as_ggml() {
        if !super::super::avx512() {
            return;
        }
        for first in (0..=255u8).step_by(LANES) {
            let bytes: [u8; LANES] = std::array::from_fn(|i| first + i as u8);
            let mut got = [0f32; LANES];
            // SAFETY: AVX-512 was detected; 16 bytes are read and 16 floats written.
            unsafe {
                #[target_feature(enable = "avx512f")]
                unsafe fn decode(bytes: &[u8; LANES], out: &mut [f32; LANES]) {
                    std::arch::x86_64::_mm512_storeu_ps(out.as_mut_ptr(), x86::e8m0_scales(bytes.as_ptr()));
                }
                decode(&bytes, &mut got);
            }
            for (&e, &g) in bytes.iter().zip(&got) {
                assert_eq!(g.to_bits(), e8m0_half(e).to_bits(), "exponent byte {e}");
            }
        }
    }
}
