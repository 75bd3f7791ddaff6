//! Q4_K and Q6_K (256-value super-blocks) in 16-row tiles: their records' layout, and their
//! AVX-512 VNNI kernels. Like the 32-value formats, a record holds its 16 source blocks' bytes,
//! permuted in place, and activations come quantized in 32-value blocks.
//!
//! candle repacks these two types too, but keeps its tiles beside the ggml blocks (with float32
//! sub-block scales) and builds them at the first product of two rows or more; its one-row
//! Q6_K kernel adds in another order than its repacked one. Here each weight is held once,
//! repacked at load, and every row count takes the same path.
//!
//! Q4_K (144 bytes a row): `d` and `dmin` of the 16 rows as two half vectors; the 6-bit scales
//! `sc_j` and mins `m_j` of the 8 sub-blocks as their low nibbles (one byte per row and
//! sub-block, `sc | m << 4`) and their top two bits (one byte per row and pair of sub-blocks `j`,
//! `j + 4`); then the values, one 64-byte vector per group of 4 values of each row, holding two
//! sub-blocks in its low and high nibbles as ggml's blocks do.
//!
//! Q6_K (210 bytes a row): `d`; the 16 signed scales, one byte per row and sub-block of 16
//! values; the low four bits as for Q4_K; the top two bits of four 32-value units in each byte.

use super::{half, Unit, LANES};

/// Values of a k-quant super-block.
pub(super) const QK_K: usize = 256;
/// Bytes of a ggml Q4_K block: `d`, `dmin`, 12 bytes of packed scales, 128 of nibbles.
pub(super) const Q4K_BYTES: usize = 4 + 12 + QK_K / 2;
/// Bytes of a ggml Q6_K block: 128 of low nibbles, 64 of top bits, 16 scales, `d`.
pub(super) const Q6K_BYTES: usize = QK_K / 2 + QK_K / 4 + QK_K / 16 + 2;

/// Bytes of one 64-byte vector: a group of 4 values of each of the 16 rows.
const VECTOR: usize = LANES * 4;

// Offsets in a Q4_K record.
const Q4K_DMIN: usize = LANES * 2;
const Q4K_SC_LO: usize = Q4K_DMIN + LANES * 2;
const Q4K_SC_HI: usize = Q4K_SC_LO + 8 * LANES;
const Q4K_QS: usize = Q4K_SC_HI + 4 * LANES;
const _: () = assert!(Q4K_QS + QK_K / 2 * LANES == Q4K_BYTES * LANES);

// Offsets in a Q6_K record.
const Q6K_SC: usize = LANES * 2;
const Q6K_QL: usize = Q6K_SC + 16 * LANES;
const Q6K_QH: usize = Q6K_QL + QK_K / 2 * LANES;
const _: () = assert!(Q6K_QH + QK_K / 4 * LANES == Q6K_BYTES * LANES);

/// Copies the 4 bytes of each group of `src` to their lane of consecutive vectors from `at`.
fn scatter_groups(src: &[u8], lane: usize, record: &mut [u8], at: usize) {
    for (v, quad) in src.chunks_exact(4).enumerate() {
        record[at + v * VECTOR + lane * 4..][..4].copy_from_slice(quad);
    }
}

/// Sub-block `j`'s 6-bit scale and min from a ggml Q4_K block's 12 packed bytes.
fn scale_min(j: usize, q: &[u8]) -> (u8, u8) {
    if j < 4 {
        (q[j] & 63, q[j + 4] & 63)
    } else {
        ((q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4), (q[j + 4] >> 4) | ((q[j] >> 6) << 4))
    }
}

/// Places one row's Q4_K block in a record.
pub(super) fn place_q4k(block: &[u8], lane: usize, record: &mut [u8]) {
    record[lane * 2..][..2].copy_from_slice(&block[0..2]);
    record[Q4K_DMIN + lane * 2..][..2].copy_from_slice(&block[2..4]);
    for j in 0..8 {
        let (sc, m) = scale_min(j, &block[4..16]);
        record[Q4K_SC_LO + j * LANES + lane] = (sc & 0xF) | (m & 0xF) << 4;
        record[Q4K_SC_HI + (j % 4) * LANES + lane] |= ((sc >> 4) | (m >> 4) << 2) << (4 * (j / 4));
    }
    // Vector 8c + g: byte t of group g of the 64-value chunk c (values 64c + 4g + t in its low
    // nibble, 64c + 32 + 4g + t in its high one), as in ggml's block.
    scatter_groups(&block[16..], lane, record, Q4K_QS);
}

/// Row `lane`'s 32-value unit `u` (sub-block `u`) of a Q4_K record.
pub(super) fn unpack_q4k(record: &[u8], lane: usize, u: usize) -> Unit {
    let lo = record[Q4K_SC_LO + u * LANES + lane];
    let hi = record[Q4K_SC_HI + (u % 4) * LANES + lane] >> (4 * (u / 4));
    let sc = (lo & 0xF) | (hi & 3) << 4;
    let m = (lo >> 4) | ((hi >> 2) & 3) << 4;
    let (c, high) = (u / 2, u % 2 == 1);
    let q = std::array::from_fn(|i| {
        let byte = record[Q4K_QS + (c * 8 + i / 4) * VECTOR + lane * 4 + i % 4];
        (if high { byte >> 4 } else { byte & 0xF }) as i32
    });
    Unit { d: half(record, 0, lane), m: -(half(record, Q4K_DMIN, lane) * m as f32), scale: [sc as i32; 2], q }
}

/// Places one row's Q6_K block in a record.
pub(super) fn place_q6k(block: &[u8], lane: usize, record: &mut [u8]) {
    let (ql, rest) = block.split_at(QK_K / 2);
    let (qh, rest) = rest.split_at(QK_K / 4);
    let (scales, d) = rest.split_at(QK_K / 16);
    record[lane * 2..][..2].copy_from_slice(d);
    for (s, &sc) in scales.iter().enumerate() {
        record[Q6K_SC + s * LANES + lane] = sc;
    }
    // Vector 8·(2n + part) + g: low-bit bytes 64n + 32·part + 4g + t (units 4n + part in the
    // low nibbles, 4n + 2 + part in the high ones); vector 8n + g: top-bit bytes 32n + 4g + t
    // (units 4n..4n + 4 in bits 0-1, 2-3, 4-5, 6-7), as in ggml's block.
    scatter_groups(ql, lane, record, Q6K_QL);
    scatter_groups(qh, lane, record, Q6K_QH);
}

/// Row `lane`'s 32-value unit `u` (sub-blocks `2u`, `2u + 1`) of a Q6_K record.
pub(super) fn unpack_q6k(record: &[u8], lane: usize, u: usize) -> Unit {
    let (n, w) = (u / 4, u % 4);
    let q = std::array::from_fn(|i| {
        let (g, t) = (i / 4, i % 4);
        let low = record[Q6K_QL + ((2 * n + w % 2) * 8 + g) * VECTOR + lane * 4 + t];
        let top = record[Q6K_QH + (n * 8 + g) * VECTOR + lane * 4 + t];
        let low = if w >= 2 { low >> 4 } else { low & 0xF };
        (low | ((top >> (2 * w)) & 3) << 4) as i32 - 32
    });
    let scale = |s: usize| record[Q6K_SC + s * LANES + lane] as i8 as i32;
    let s = 8 * n + 2 * w;
    Unit { d: half(record, 0, lane), m: 0.0, scale: [scale(s), scale(s + 1)], q }
}

/// The sums of each 16 quantized activations: Q6_K's offset of 32 is undone per sub-block.
#[cfg(target_arch = "x86_64")]
pub(super) fn half_sums(values: &[i8]) -> Vec<i32> {
    values.chunks_exact(super::QK / 2).map(|c| c.iter().map(|&v| v as i32).sum()).collect()
}

#[cfg(target_arch = "x86_64")]
pub(super) mod x86 {
    use super::super::x86::store;
    use super::super::{Interleaved, QK};
    use super::*;
    use crate::backend::kernels::int8_gemm::QuantizedRows;
    use std::arch::x86_64::*;

    /// Tiles `t0..t0 + tiles` of Q4_K against every activation row, 4 rows at a time.
    #[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
    pub(in super::super) unsafe fn q4k_columns(
        w: &Interleaved,
        xq: &QuantizedRows,
        m: usize,
        t0: usize,
        tiles: usize,
        out: *mut f32,
    ) {
        for t in t0..t0 + tiles {
            let mut row0 = 0;
            while row0 + 4 <= m {
                q4k_tile::<4>(w, xq, row0, t, out);
                row0 += 4;
            }
            match m - row0 {
                1 => q4k_tile::<1>(w, xq, row0, t, out),
                2 => q4k_tile::<2>(w, xq, row0, t, out),
                3 => q4k_tile::<3>(w, xq, row0, t, out),
                _ => {}
            }
        }
    }

    /// The 4-byte group `g` of activation row `row`'s unit `u`, broadcast.
    #[inline(always)]
    unsafe fn x4(xq: &QuantizedRows, units: usize, row: usize, u: usize, g: usize) -> __m512i {
        let at = (row * units + u) * QK + g * 4;
        _mm512_set1_epi32((xq.values.as_ptr().add(at) as *const i32).read_unaligned())
    }

    /// Activation rows `row0..row0 + R` times the 16 rows of Q4_K tile `t`.
    #[inline(always)]
    unsafe fn q4k_tile<const R: usize>(w: &Interleaved, xq: &QuantizedRows, row0: usize, t: usize, out: *mut f32) {
        let nb = w.blocks();
        let units = nb * 8;
        let nibble = _mm512_set1_epi8(0x0F);
        let (low2, four) = (_mm512_set1_epi32(3), _mm512_set1_epi32(0xF));
        let mut acc = [_mm512_setzero_ps(); R];
        for b in 0..nb {
            let rec = w.record(t, b).as_ptr();
            let d = _mm512_cvtph_ps(_mm256_loadu_si256(rec as *const __m256i));
            let dmin = _mm512_cvtph_ps(_mm256_loadu_si256(rec.add(Q4K_DMIN) as *const __m256i));
            for c in 0..4 {
                // Units 2c (low nibbles) and 2c + 1 (high nibbles).
                let mut dot = [[_mm512_setzero_si512(); 2]; R];
                for g in 0..8 {
                    let v = _mm512_loadu_si512(rec.add(Q4K_QS + (c * 8 + g) * VECTOR) as *const _);
                    let lo = _mm512_and_si512(v, nibble);
                    let hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), nibble);
                    for (r, dot) in dot.iter_mut().enumerate() {
                        let row = row0 + r;
                        dot[0] = _mm512_dpbusd_epi32(dot[0], lo, x4(xq, units, row, b * 8 + 2 * c, g));
                        dot[1] = _mm512_dpbusd_epi32(dot[1], hi, x4(xq, units, row, b * 8 + 2 * c + 1, g));
                    }
                }
                for h in 0..2 {
                    let j = 2 * c + h;
                    let lo = _mm512_cvtepu8_epi32(_mm_loadu_si128(rec.add(Q4K_SC_LO + j * LANES) as *const __m128i));
                    let hi =
                        _mm512_cvtepu8_epi32(_mm_loadu_si128(rec.add(Q4K_SC_HI + (j % 4) * LANES) as *const __m128i));
                    let hi = if j >= 4 { _mm512_srli_epi32(hi, 4) } else { hi };
                    let sc =
                        _mm512_or_si512(_mm512_and_si512(lo, four), _mm512_slli_epi32(_mm512_and_si512(hi, low2), 4));
                    let mins = _mm512_or_si512(
                        _mm512_srli_epi32(lo, 4),
                        _mm512_slli_epi32(_mm512_and_si512(_mm512_srli_epi32(hi, 2), low2), 4),
                    );
                    // -(dmin·m_j), as the portable path and candle's de-quantization compute it.
                    let neg_min = _mm512_sub_ps(_mm512_setzero_ps(), _mm512_mul_ps(dmin, _mm512_cvtepi32_ps(mins)));
                    for r in 0..R {
                        let xi = (row0 + r) * units + b * 8 + j;
                        let scaled = _mm512_cvtepi32_ps(_mm512_mullo_epi32(dot[r][h], sc));
                        let dx = _mm512_mul_ps(d, _mm512_set1_ps(*xq.scales.get_unchecked(xi)));
                        acc[r] = _mm512_fmadd_ps(scaled, dx, acc[r]);
                        acc[r] = _mm512_fmadd_ps(neg_min, _mm512_set1_ps(*xq.sums.get_unchecked(xi)), acc[r]);
                    }
                }
            }
        }
        for (r, acc) in acc.into_iter().enumerate() {
            store(acc, out, row0 + r, w.n, t * LANES);
        }
    }

    /// Tiles `t0..t0 + tiles` of Q6_K against every activation row, 2 rows at a time (each
    /// row holds 8 integer accumulators).
    #[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
    pub(in super::super) unsafe fn q6k_columns(
        w: &Interleaved,
        xq: &QuantizedRows,
        half_sums: &[i32],
        m: usize,
        t0: usize,
        tiles: usize,
        out: *mut f32,
    ) {
        for t in t0..t0 + tiles {
            let mut row0 = 0;
            while row0 + 2 <= m {
                q6k_tile::<2>(w, xq, half_sums, row0, t, out);
                row0 += 2;
            }
            if row0 < m {
                q6k_tile::<1>(w, xq, half_sums, row0, t, out);
            }
        }
    }

    /// Activation rows `row0..row0 + R` times the 16 rows of Q6_K tile `t`.
    #[inline(always)]
    unsafe fn q6k_tile<const R: usize>(
        w: &Interleaved,
        xq: &QuantizedRows,
        half_sums: &[i32],
        row0: usize,
        t: usize,
        out: *mut f32,
    ) {
        let nb = w.blocks();
        let units = nb * 8;
        let nibble = _mm512_set1_epi8(0x0F);
        let top = _mm512_set1_epi8(0x30);
        // a | (b & c) for vpternlogd.
        const OR_AND: i32 = 0xF8;
        let mut acc = [_mm512_setzero_ps(); R];
        for b in 0..nb {
            let rec = w.record(t, b).as_ptr();
            let d = _mm512_cvtph_ps(_mm256_loadu_si256(rec as *const __m256i));
            for n in 0..2 {
                // Units 4n..4n + 4, one integer sum each per row, over its two sub-blocks.
                let mut sums = [[_mm512_setzero_si512(); 4]; R];
                for h in 0..2 {
                    let mut dot = [[_mm512_setzero_si512(); 4]; R];
                    for (r, dot) in dot.iter_mut().enumerate() {
                        for (u, dot) in dot.iter_mut().enumerate() {
                            let unit = (row0 + r) * units + b * 8 + 4 * n + u;
                            *dot = _mm512_set1_epi32(-32 * *half_sums.get_unchecked(unit * 2 + h));
                        }
                    }
                    for g in 4 * h..4 * h + 4 {
                        let bits = _mm512_loadu_si512(rec.add(Q6K_QH + (n * 8 + g) * VECTOR) as *const _);
                        let a = _mm512_loadu_si512(rec.add(Q6K_QL + (2 * n * 8 + g) * VECTOR) as *const _);
                        let c = _mm512_loadu_si512(rec.add(Q6K_QL + ((2 * n + 1) * 8 + g) * VECTOR) as *const _);
                        let values = [
                            _mm512_ternarylogic_epi32(
                                _mm512_and_si512(a, nibble),
                                _mm512_slli_epi16(bits, 4),
                                top,
                                OR_AND,
                            ),
                            _mm512_ternarylogic_epi32(
                                _mm512_and_si512(c, nibble),
                                _mm512_slli_epi16(bits, 2),
                                top,
                                OR_AND,
                            ),
                            _mm512_ternarylogic_epi32(
                                _mm512_and_si512(_mm512_srli_epi16(a, 4), nibble),
                                bits,
                                top,
                                OR_AND,
                            ),
                            _mm512_ternarylogic_epi32(
                                _mm512_and_si512(_mm512_srli_epi16(c, 4), nibble),
                                _mm512_srli_epi16(bits, 2),
                                top,
                                OR_AND,
                            ),
                        ];
                        for (r, dot) in dot.iter_mut().enumerate() {
                            for (u, dot) in dot.iter_mut().enumerate() {
                                *dot =
                                    _mm512_dpbusd_epi32(*dot, values[u], x4(xq, units, row0 + r, b * 8 + 4 * n + u, g));
                            }
                        }
                    }
                    for u in 0..4 {
                        let s = 8 * n + 2 * u + h;
                        let sc = _mm512_cvtepi8_epi32(_mm_loadu_si128(rec.add(Q6K_SC + s * LANES) as *const __m128i));
                        for r in 0..R {
                            sums[r][u] = _mm512_add_epi32(sums[r][u], _mm512_mullo_epi32(dot[r][u], sc));
                        }
                    }
                }
                for (r, sums) in sums.iter().enumerate() {
                    for (u, &sum) in sums.iter().enumerate() {
                        let xi = (row0 + r) * units + b * 8 + 4 * n + u;
                        let dx = _mm512_mul_ps(d, _mm512_set1_ps(*xq.scales.get_unchecked(xi)));
                        acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum), dx, acc[r]);
                    }
                }
            }
        }
        for (r, acc) in acc.into_iter().enumerate() {
            store(acc, out, row0 + r, w.n, t * LANES);
        }
    }
}
