//! The k-quants (256-value super-blocks) in 16-row tiles: their records' layout, and their
//! AVX-512 VNNI kernels. Like the 32-value formats, a record holds its 16 source blocks' bytes,
//! permuted in place, and activations come quantized in 32-value blocks. Two kernels serve four
//! formats: Q4_K's (a 6-bit scale and min per 32 values) runs Q5_K with a fifth bit, Q6_K's (a
//! signed scale per 16 values) runs Q3_K with other values and scales.
//!
//! candle repacks Q4_K and Q6_K too, but keeps its tiles beside the ggml blocks (with float32
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
//! Q5_K (176 bytes a row): a Q4_K record, then the fifth bits as 64 masks of 64 bits, one per
//! 32-value unit `u` and group `g` of 4 values (mask `8u + g`, bit `4·lane + t`, as the Q5_0
//! masks in `mod.rs`): the kernel adds 16 to the bytes a mask selects.
//!
//! Q6_K (210 bytes a row): `d`; the 16 signed scales, one byte per row and sub-block of 16
//! values; the low four bits as for Q4_K; the top two bits of four 32-value units in each byte.
//!
//! Q3_K (110 bytes a row): `d`; ggml's 12 bytes of packed 6-bit scales, byte by byte (one byte
//! per row; the kernel decodes them once per record and row tile into Q6_K's one signed byte per
//! sub-block, 64 at a time); the high bits as Q5_K's masks (the kernel adds 4); the two low bits
//! of four units in each byte, laid out as Q6_K's top bits. A value is `d·(sc − 32)·(q − 4)`
//! with `q` its two low bits plus 4 where its high bit is set, so the integer sums start at
//! `−4·Σx` per 16 values as Q6_K's start at `−32·Σx`.

use super::{half, high_bit, set_high_bits, Unit, LANES};

/// Values of a k-quant super-block.
pub(super) const QK_K: usize = 256;
/// Bytes of a ggml Q4_K block: `d`, `dmin`, 12 bytes of packed scales, 128 of nibbles.
pub(super) const Q4K_BYTES: usize = 4 + 12 + QK_K / 2;
/// Bytes of a ggml Q5_K block: Q4_K's fields with 32 bytes of fifth bits before the nibbles.
pub(super) const Q5K_BYTES: usize = Q4K_BYTES + QK_K / 8;
/// Bytes of a ggml Q6_K block: 128 of low nibbles, 64 of top bits, 16 scales, `d`.
pub(super) const Q6K_BYTES: usize = QK_K / 2 + QK_K / 4 + QK_K / 16 + 2;
/// Bytes of a ggml Q3_K block: 32 of high bits, 64 of low bit pairs, 12 of packed scales, `d`.
pub(super) const Q3K_BYTES: usize = QK_K / 8 + QK_K / 4 + 12 + 2;

/// Bytes of one 64-byte vector: a group of 4 values of each of the 16 rows.
const VECTOR: usize = LANES * 4;
/// Bytes of the 64 high-bit masks of a record (8 units × 8 groups of 4 values, 64 bits each).
const UNIT_MASKS: usize = 8 * 8 * 8;

// Offsets in a Q4_K record.
const Q4K_DMIN: usize = LANES * 2;
const Q4K_SC_LO: usize = Q4K_DMIN + LANES * 2;
const Q4K_SC_HI: usize = Q4K_SC_LO + 8 * LANES;
const Q4K_QS: usize = Q4K_SC_HI + 4 * LANES;
const _: () = assert!(Q4K_QS + QK_K / 2 * LANES == Q4K_BYTES * LANES);

// The fifth bits' masks in a Q5_K record, after a Q4_K record's fields.
const Q5K_QH: usize = Q4K_BYTES * LANES;
const _: () = assert!(Q5K_QH + UNIT_MASKS == Q5K_BYTES * LANES);

// Offsets in a Q6_K record.
const Q6K_SC: usize = LANES * 2;
const Q6K_QL: usize = Q6K_SC + 16 * LANES;
const Q6K_QH: usize = Q6K_QL + QK_K / 2 * LANES;
const _: () = assert!(Q6K_QH + QK_K / 4 * LANES == Q6K_BYTES * LANES);

// Offsets in a Q3_K record.
const Q3K_SC: usize = LANES * 2;
const Q3K_HMASK: usize = Q3K_SC + 12 * LANES;
const Q3K_QS: usize = Q3K_HMASK + UNIT_MASKS;
const _: () = assert!(Q3K_QS + QK_K / 4 * LANES == Q3K_BYTES * LANES);

/// Copies each byte of `src` to its lane of consecutive 16-byte rows from `at`.
fn scatter_bytes(src: &[u8], lane: usize, record: &mut [u8], at: usize) {
    for (i, &byte) in src.iter().enumerate() {
        record[at + i * LANES + lane] = byte;
    }
}

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
    let (fields, qs) = block.split_at(16);
    place_q4k_fields(fields, qs, lane, record);
}

/// Places one row's Q5_K block in a record: Q4_K's fields, then the fifth bits.
pub(super) fn place_q5k(block: &[u8], lane: usize, record: &mut [u8]) {
    let (fields, rest) = block.split_at(16);
    let (qh, qs) = rest.split_at(QK_K / 8);
    place_q4k_fields(fields, qs, lane, record);
    place_unit_bits(qh, lane, record, Q5K_QH);
}

/// Places one row's `d`, `dmin` and packed scales (`fields`, 16 bytes) and nibbles `qs` of a
/// Q4_K or Q5_K block.
fn place_q4k_fields(fields: &[u8], qs: &[u8], lane: usize, record: &mut [u8]) {
    record[lane * 2..][..2].copy_from_slice(&fields[0..2]);
    record[Q4K_DMIN + lane * 2..][..2].copy_from_slice(&fields[2..4]);
    for j in 0..8 {
        let (sc, m) = scale_min(j, &fields[4..16]);
        record[Q4K_SC_LO + j * LANES + lane] = (sc & 0xF) | (m & 0xF) << 4;
        record[Q4K_SC_HI + (j % 4) * LANES + lane] |= ((sc >> 4) | (m >> 4) << 2) << (4 * (j / 4));
    }
    // Vector 8c + g: byte t of group g of the 64-value chunk c (values 64c + 4g + t in its low
    // nibble, 64c + 32 + 4g + t in its high one), as in ggml's block.
    scatter_groups(qs, lane, record, Q4K_QS);
}

/// Spreads one row's 32 bytes of high bits (bit `u` of byte `i` for value `32u + i`: Q5_K's
/// `qh`, Q3_K's `hmask`) over the masks from `at`: mask `8u + g` holds group `g` of unit `u`.
fn place_unit_bits(bits: &[u8], lane: usize, record: &mut [u8], at: usize) {
    for u in 0..8 {
        for (g, quad) in bits.chunks_exact(4).enumerate() {
            let nibble = quad.iter().enumerate().fold(0, |n, (t, &b)| n | ((b >> u) & 1) << t);
            set_high_bits(&mut record[at + (u * 8 + g) * 8..][..8], lane, nibble);
        }
    }
}

/// Row `lane`'s high bit of value `i` of unit `u`, from the masks at `at`.
fn unit_bit(record: &[u8], at: usize, lane: usize, u: usize, i: usize) -> i32 {
    high_bit(&record[at + (u * 8 + i / 4) * 8..][..8], lane, i % 4) as i32
}

/// Row `lane`'s two bits of value `i` of unit `u` from vectors laid out as ggml's arrays of
/// bit pairs (Q6_K's `qh`, Q3_K's `qs`): byte `32n + i` holds units `4n..4n + 4`, low bits first.
fn bit_pair(record: &[u8], at: usize, lane: usize, u: usize, i: usize) -> i32 {
    ((record[at + ((u / 4) * 8 + i / 4) * VECTOR + lane * 4 + i % 4] >> (2 * (u % 4))) & 3) as i32
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

/// Row `lane`'s 32-value unit `u` (sub-block `u`) of a Q5_K record.
pub(super) fn unpack_q5k(record: &[u8], lane: usize, u: usize) -> Unit {
    let mut unit = unpack_q4k(record, lane, u);
    for (i, q) in unit.q.iter_mut().enumerate() {
        *q |= unit_bit(record, Q5K_QH, lane, u, i) << 4;
    }
    unit
}

/// Places one row's Q6_K block in a record.
pub(super) fn place_q6k(block: &[u8], lane: usize, record: &mut [u8]) {
    let (ql, rest) = block.split_at(QK_K / 2);
    let (qh, rest) = rest.split_at(QK_K / 4);
    let (scales, d) = rest.split_at(QK_K / 16);
    record[lane * 2..][..2].copy_from_slice(d);
    scatter_bytes(scales, lane, record, Q6K_SC);
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
        let low = record[Q6K_QL + ((2 * n + w % 2) * 8 + i / 4) * VECTOR + lane * 4 + i % 4];
        let low = if w >= 2 { low >> 4 } else { low & 0xF };
        (low as i32 | bit_pair(record, Q6K_QH, lane, u, i) << 4) - 32
    });
    let scale = |s: usize| record[Q6K_SC + s * LANES + lane] as i8 as i32;
    Unit { d: half(record, 0, lane), m: 0.0, scale: [scale(2 * u), scale(2 * u + 1)], q }
}

/// Places one row's Q3_K block in a record.
pub(super) fn place_q3k(block: &[u8], lane: usize, record: &mut [u8]) {
    let (hmask, rest) = block.split_at(QK_K / 8);
    let (qs, rest) = rest.split_at(QK_K / 4);
    let (scales, d) = rest.split_at(12);
    record[lane * 2..][..2].copy_from_slice(d);
    scatter_bytes(scales, lane, record, Q3K_SC);
    place_unit_bits(hmask, lane, record, Q3K_HMASK);
    // Vector 8n + g: bytes 32n + 4g + t (units 4n..4n + 4 in bits 0-1, 2-3, 4-5, 6-7).
    scatter_groups(qs, lane, record, Q3K_QS);
}

/// Row `lane`'s signed scale `sc − 32` of sub-block `s` (16 values) of a Q3_K record. ggml packs
/// scale `s`'s low four bits in byte `s % 8` (the high nibble from `s = 8` on) and its top two
/// in byte `8 + s % 4` (bits `2·(s / 4)` up).
fn q3k_scale(record: &[u8], lane: usize, s: usize) -> i32 {
    let low = (record[Q3K_SC + (s % 8) * LANES + lane] >> (4 * (s / 8))) & 0xF;
    let top = (record[Q3K_SC + (8 + s % 4) * LANES + lane] >> (2 * (s / 4))) & 3;
    (low | top << 4) as i32 - 32
}

/// Row `lane`'s 32-value unit `u` (sub-blocks `2u`, `2u + 1`) of a Q3_K record.
pub(super) fn unpack_q3k(record: &[u8], lane: usize, u: usize) -> Unit {
    // The high bit set means no subtraction of 4 (ggml's `dequantize_row_q3_K`).
    let q = std::array::from_fn(|i| {
        (bit_pair(record, Q3K_QS, lane, u, i) | unit_bit(record, Q3K_HMASK, lane, u, i) << 2) - 4
    });
    let scale = [q3k_scale(record, lane, 2 * u), q3k_scale(record, lane, 2 * u + 1)];
    Unit { d: half(record, 0, lane), m: 0.0, scale, q }
}

/// The sums of each 16 quantized activations: Q6_K's offset of 32 (Q3_K's of 4) is undone per
/// sub-block.
#[cfg(any(target_arch = "x86_64", target_arch = "aarch64"))]
pub(super) fn half_sums(values: &[i8]) -> Vec<i32> {
    values.chunks_exact(super::QK / 2).map(|c| c.iter().map(|&v| v as i32).sum()).collect()
}

#[cfg(target_arch = "x86_64")]
pub(super) mod x86 {
    use super::super::x86::{prefetch_next, store, with_high_bits};
    use super::super::{Format, Interleaved, Q3K, Q4K, Q5K, Q6K, QK};
    use super::*;
    use crate::int8_gemm::QuantizedRows;
    use std::arch::x86_64::*;

    /// Tiles `t0..t0 + tiles` of Q4_K (`F = Q4K`) or Q5_K (`Q5K`) against every activation row,
    /// 4 rows at a time.
    #[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
    pub(in super::super) unsafe fn q4k_columns<const F: u8>(
        w: &Interleaved,
        xq: &QuantizedRows,
        m: usize,
        t0: usize,
        tiles: usize,
        out: *mut f32,
    ) {
        for t in t0..t0 + tiles {
            rows_by_four!(m, 0, |R, row0| q4k_tile::<F, R>(w, xq, row0, t, out));
        }
    }

    /// The 4-byte group `g` of activation row `row`'s unit `u`, broadcast.
    #[inline(always)]
    unsafe fn x4(xq: &QuantizedRows, units: usize, row: usize, u: usize, g: usize) -> __m512i {
        let at = (row * units + u) * QK + g * 4;
        _mm512_set1_epi32((xq.values.as_ptr().add(at) as *const i32).read_unaligned())
    }

    /// Activation rows `row0..row0 + R` times the 16 rows of Q4_K (Q5_K) tile `t`.
    #[inline(always)]
    unsafe fn q4k_tile<const F: u8, const R: usize>(
        w: &Interleaved,
        xq: &QuantizedRows,
        row0: usize,
        t: usize,
        out: *mut f32,
    ) {
        debug_assert!(F == Q4K || F == Q5K);
        let size = if F == Q4K { Format::Q4K.record_bytes() } else { Format::Q5K.record_bytes() };
        let nb = w.blocks();
        let units = nb * 8;
        let nibble = _mm512_set1_epi8(0x0F);
        let sixteen = _mm512_set1_epi8(16);
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
                    // As in `q6k_tile`.
                    if R == 1 {
                        prefetch_next(rec, size, c * 8 + g, 32);
                    }
                    let v = _mm512_loadu_si512(rec.add(Q4K_QS + (c * 8 + g) * VECTOR) as *const _);
                    let mut lo = _mm512_and_si512(v, nibble);
                    let mut hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), nibble);
                    if F == Q5K {
                        lo = with_high_bits(lo, rec.add(Q5K_QH), 2 * c * 8 + g, sixteen);
                        hi = with_high_bits(hi, rec.add(Q5K_QH), (2 * c + 1) * 8 + g, sixteen);
                    }
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
                    // d·sc_j once for every row: the integer sums go to float as they are (under
                    // 2^24, so exactly), which spares each row and unit a `vpmulld` (two uops)
                    // and a multiply. One thread, CPU time, [128, 1024] x [1024 -> 4096]: 5.7 ->
                    // 4.5 ms (Q5_K 6.2 -> 5.3); [8, 1024] x [1024 -> 151936]: 19.5 -> 16.4.
                    let dsc = _mm512_mul_ps(d, _mm512_cvtepi32_ps(sc));
                    for r in 0..R {
                        let xi = (row0 + r) * units + b * 8 + j;
                        let scaled = _mm512_mul_ps(_mm512_cvtepi32_ps(dot[r][h]), dsc);
                        acc[r] = _mm512_fmadd_ps(scaled, _mm512_set1_ps(*xq.scales.get_unchecked(xi)), acc[r]);
                        acc[r] = _mm512_fmadd_ps(neg_min, _mm512_set1_ps(*xq.sums.get_unchecked(xi)), acc[r]);
                    }
                }
            }
        }
        for (r, acc) in acc.into_iter().enumerate() {
            store(acc, out, row0 + r, w.n, t * LANES);
        }
    }

    /// Tiles `t0..t0 + tiles` of Q6_K (`F = Q6K`) or Q3_K (`Q3K`) against every activation
    /// row, 2 rows at a time (each row holds 8 integer accumulators).
    #[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
    pub(in super::super) unsafe fn q6k_columns<const F: u8>(
        w: &Interleaved,
        xq: &QuantizedRows,
        half_sums: &[i32],
        m: usize,
        t0: usize,
        tiles: usize,
        out: *mut f32,
    ) {
        for t in t0..t0 + tiles {
            rows_by_two!(m, |R, row0| q6k_tile::<F, R>(w, xq, half_sums, row0, t, out));
        }
    }

    /// The unsigned values (`q + 4`) of units `4n..4n + 4`, group `g`, of a Q3_K record.
    #[inline(always)]
    unsafe fn q3k_values(rec: *const u8, n: usize, g: usize) -> [__m512i; 4] {
        let three = _mm512_set1_epi8(3);
        let four = _mm512_set1_epi8(4);
        let bits = _mm512_loadu_si512(rec.add(Q3K_QS + (n * 8 + g) * VECTOR) as *const _);
        let pairs = [bits, _mm512_srli_epi16(bits, 2), _mm512_srli_epi16(bits, 4), _mm512_srli_epi16(bits, 6)];
        std::array::from_fn(|j| {
            with_high_bits(_mm512_and_si512(pairs[j], three), rec.add(Q3K_HMASK), (4 * n + j) * 8 + g, four)
        })
    }

    /// The signed scales `sc − 32` of a Q3_K record's 16 sub-blocks into `out`, one byte per
    /// sub-block and row as Q6_K's: decoded once per record and row tile (as `q3k_scale`, 64
    /// bytes at a time), not once per sub-block and 32-bit lane.
    #[inline(always)]
    unsafe fn q3k_scales(rec: *const u8, out: &mut [i8; 16 * LANES]) {
        let nibble = _mm512_set1_epi8(0x0F);
        let three = _mm512_set1_epi8(3);
        let offset = _mm512_set1_epi8(32);
        // Bytes 0-3 (scales 0-3 low, 8-11 high nibbles), 4-7 (4-7, 12-15), 8-11 (top bit pairs).
        let first = _mm512_loadu_si512(rec.add(Q3K_SC) as *const _);
        let second = _mm512_loadu_si512(rec.add(Q3K_SC + 4 * LANES) as *const _);
        let top = _mm512_loadu_si512(rec.add(Q3K_SC + 8 * LANES) as *const _);
        let lows = [
            _mm512_and_si512(first, nibble),
            _mm512_and_si512(second, nibble),
            _mm512_and_si512(_mm512_srli_epi16(first, 4), nibble),
            _mm512_and_si512(_mm512_srli_epi16(second, 4), nibble),
        ];
        let tops = [top, _mm512_srli_epi16(top, 2), _mm512_srli_epi16(top, 4), _mm512_srli_epi16(top, 6)];
        for (q, (low, top)) in lows.into_iter().zip(tops).enumerate() {
            let sc = _mm512_or_si512(low, _mm512_slli_epi16(_mm512_and_si512(top, three), 4));
            _mm512_storeu_si512(out.as_mut_ptr().add(q * 4 * LANES) as *mut _, _mm512_sub_epi8(sc, offset));
        }
    }

    /// Activation rows `row0..row0 + R` times the 16 rows of Q6_K (Q3_K) tile `t`.
    #[inline(always)]
    unsafe fn q6k_tile<const F: u8, const R: usize>(
        w: &Interleaved,
        xq: &QuantizedRows,
        half_sums: &[i32],
        row0: usize,
        t: usize,
        out: *mut f32,
    ) {
        debug_assert!(F == Q6K || F == Q3K);
        let offset = if F == Q6K { Format::Q6K.offset() } else { Format::Q3K.offset() };
        let size = if F == Q6K { Format::Q6K.record_bytes() } else { Format::Q3K.record_bytes() };
        let nb = w.blocks();
        let units = nb * 8;
        let nibble = _mm512_set1_epi8(0x0F);
        let top = _mm512_set1_epi8(0x30);
        // a | (b & c) for vpternlogd.
        const OR_AND: i32 = 0xF8;
        let mut acc = [_mm512_setzero_ps(); R];
        let mut decoded = [0i8; 16 * LANES];
        for b in 0..nb {
            let rec = w.record(t, b).as_ptr();
            let d = _mm512_cvtph_ps(_mm256_loadu_si256(rec as *const __m256i));
            // One signed byte per sub-block and row: Q6_K's as they are, Q3_K's decoded.
            let scales = if F == Q6K {
                rec.add(Q6K_SC) as *const i8
            } else {
                q3k_scales(rec, &mut decoded);
                decoded.as_ptr()
            };
            for n in 0..2 {
                // Units 4n..4n + 4, one sum each per row over its two sub-blocks, `d·sc`-scaled.
                let mut sums = [[_mm512_setzero_ps(); 4]; R];
                for h in 0..2 {
                    let mut dot = [[_mm512_setzero_si512(); 4]; R];
                    for (r, dot) in dot.iter_mut().enumerate() {
                        for (u, dot) in dot.iter_mut().enumerate() {
                            let unit = (row0 + r) * units + b * 8 + 4 * n + u;
                            *dot = _mm512_set1_epi32(-offset * *half_sums.get_unchecked(unit * 2 + h));
                        }
                    }
                    for g in 4 * h..4 * h + 4 {
                        // Two rows or more compute long enough per byte for memory to keep up.
                        if R == 1 {
                            prefetch_next(rec, size, (2 * n + h) * 4 + g % 4, 16);
                        }
                        // Q6_K's values stay inline: behind a function, LLVM stopped unrolling
                        // the two-row tile's loop over `h` (128 rows x [1024 -> 4096], one
                        // thread: 7.1 -> 7.9 ms).
                        let values = if F == Q6K {
                            let bits = _mm512_loadu_si512(rec.add(Q6K_QH + (n * 8 + g) * VECTOR) as *const _);
                            let a = _mm512_loadu_si512(rec.add(Q6K_QL + (2 * n * 8 + g) * VECTOR) as *const _);
                            let c = _mm512_loadu_si512(rec.add(Q6K_QL + ((2 * n + 1) * 8 + g) * VECTOR) as *const _);
                            [
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
                            ]
                        } else {
                            q3k_values(rec, n, g)
                        };
                        for (r, dot) in dot.iter_mut().enumerate() {
                            for (u, dot) in dot.iter_mut().enumerate() {
                                *dot =
                                    _mm512_dpbusd_epi32(*dot, values[u], x4(xq, units, row0 + r, b * 8 + 4 * n + u, g));
                            }
                        }
                    }
                    for u in 0..4 {
                        let at = scales.add((8 * n + 2 * u + h) * LANES);
                        let sc = _mm512_cvtepi8_epi32(_mm_loadu_si128(at as *const __m128i));
                        // As in `q4k_tile`: d·sc once for every row, the integer sums (under
                        // 2^24) to float as they are; one thread, [128, 1024] x [1024 -> 4096]
                        // 7.3 -> 6.6-7.0 ms.
                        let dsc = _mm512_mul_ps(d, _mm512_cvtepi32_ps(sc));
                        for r in 0..R {
                            sums[r][u] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot[r][u]), dsc, sums[r][u]);
                        }
                    }
                }
                for (r, sums) in sums.iter().enumerate() {
                    for (u, &sum) in sums.iter().enumerate() {
                        let xi = (row0 + r) * units + b * 8 + 4 * n + u;
                        acc[r] = _mm512_fmadd_ps(sum, _mm512_set1_ps(*xq.scales.get_unchecked(xi)), acc[r]);
                    }
                }
            }
        }
        for (r, acc) in acc.into_iter().enumerate() {
            store(acc, out, row0 + r, w.n, t * LANES);
        }
    }
}

/// The k-quants' tiles on AVX2 (`super::avx2`): each tile as two halves of 8 rows. Q4_K's
/// 4-bit values add 8 vectors' pairs of products in 16 bits before widening them, Q5_K's 4;
/// Q6_K's (at most 63) and Q3_K's are widened at once.
#[cfg(target_arch = "x86_64")]
pub(super) mod avx2 {
    use super::super::avx2::{bytes_i32, bytes_u32, dot_u, halves, load, store, widen, with_high_bits, x4};
    use super::super::x86::prefetch_next;
    use super::super::{Format, Interleaved, Q4K, Q5K, Q6K, QK};
    use super::*;
    use crate::int8_gemm::QuantizedRows;
    use std::arch::x86_64::*;

    /// Tiles `t0..t0 + tiles` of Q4_K (`F = Q4K`, 4 activation rows at a time) or Q5_K (`Q5K`,
    /// 2: its 16-bit sums are widened twice a unit) against every activation row.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(in super::super) unsafe fn q4k_columns<const F: u8>(
        w: &Interleaved,
        xq: &QuantizedRows,
        m: usize,
        t0: usize,
        tiles: usize,
        out: *mut f32,
    ) {
        for t in t0..t0 + tiles {
            for h in 0..2 {
                if F == Q4K {
                    rows_by_four!(m, 0, |R, row0| q4k_tile::<F, R>(w, xq, row0, t, h, out));
                } else {
                    rows_by_two!(m, |R, row0| q4k_tile::<F, R>(w, xq, row0, t, h, out));
                }
            }
        }
    }

    /// The 4-byte group `g` of activation row `row`'s unit `u`, broadcast.
    #[inline(always)]
    unsafe fn xg(xq: &QuantizedRows, units: usize, row: usize, u: usize, g: usize) -> __m256i {
        x4(xq.values.as_ptr().add((row * units + u) * QK + g * 4))
    }

    /// Activation rows `row0..row0 + R` times rows `8h..8h + 8` of Q4_K (Q5_K) tile `t`.
    #[inline(always)]
    unsafe fn q4k_tile<const F: u8, const R: usize>(
        w: &Interleaved,
        xq: &QuantizedRows,
        row0: usize,
        t: usize,
        h: usize,
        out: *mut f32,
    ) {
        let size = if F == Q4K { Format::Q4K.record_bytes() } else { Format::Q5K.record_bytes() };
        let nb = w.blocks();
        let units = nb * 8;
        let nibble = _mm256_set1_epi8(0x0F);
        let sixteen = _mm256_set1_epi8(16);
        let (low2, four) = (_mm256_set1_epi32(3), _mm256_set1_epi32(0xF));
        let mut acc = [_mm256_setzero_ps(); R];
        for b in 0..nb {
            let rec = w.record(t, b).as_ptr();
            let d = halves(rec, h);
            let dmin = halves(rec.add(Q4K_DMIN), h);
            for c in 0..4 {
                if R == 1 && h == 0 {
                    prefetch_next(rec, size, c, 4);
                }
                // Units 2c (low nibbles) and 2c + 1 (high nibbles).
                let mut dot = [[_mm256_setzero_si256(); 2]; R];
                let mut lo16 = [_mm256_setzero_si256(); R];
                let mut hi16 = [_mm256_setzero_si256(); R];
                for g in 0..8 {
                    let v = load(rec.add(Q4K_QS + (c * 8 + g) * VECTOR), h);
                    let mut lo = _mm256_and_si256(v, nibble);
                    let mut hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), nibble);
                    if F == Q5K {
                        lo = with_high_bits(lo, rec.add(Q5K_QH), 2 * c * 8 + g, h, sixteen);
                        hi = with_high_bits(hi, rec.add(Q5K_QH), (2 * c + 1) * 8 + g, h, sixteen);
                    }
                    for r in 0..R {
                        let row = row0 + r;
                        let plo = _mm256_maddubs_epi16(lo, xg(xq, units, row, b * 8 + 2 * c, g));
                        let phi = _mm256_maddubs_epi16(hi, xg(xq, units, row, b * 8 + 2 * c + 1, g));
                        lo16[r] = _mm256_add_epi16(lo16[r], plo);
                        hi16[r] = _mm256_add_epi16(hi16[r], phi);
                    }
                    if F == Q5K && g % 4 == 3 {
                        for r in 0..R {
                            dot[r][0] = _mm256_add_epi32(dot[r][0], widen(lo16[r]));
                            dot[r][1] = _mm256_add_epi32(dot[r][1], widen(hi16[r]));
                            lo16[r] = _mm256_setzero_si256();
                            hi16[r] = _mm256_setzero_si256();
                        }
                    }
                }
                if F == Q4K {
                    for r in 0..R {
                        dot[r] = [widen(lo16[r]), widen(hi16[r])];
                    }
                }
                for (k, j) in [2 * c, 2 * c + 1].into_iter().enumerate() {
                    let lo = bytes_u32(rec.add(Q4K_SC_LO + j * LANES), h);
                    let hi = bytes_u32(rec.add(Q4K_SC_HI + (j % 4) * LANES), h);
                    let hi = if j >= 4 { _mm256_srli_epi32(hi, 4) } else { hi };
                    let sc =
                        _mm256_or_si256(_mm256_and_si256(lo, four), _mm256_slli_epi32(_mm256_and_si256(hi, low2), 4));
                    let mins = _mm256_or_si256(
                        _mm256_srli_epi32(lo, 4),
                        _mm256_slli_epi32(_mm256_and_si256(_mm256_srli_epi32(hi, 2), low2), 4),
                    );
                    // -(dmin·m_j) and d·sc_j, as the AVX-512 kernel computes them.
                    let neg_min = _mm256_sub_ps(_mm256_setzero_ps(), _mm256_mul_ps(dmin, _mm256_cvtepi32_ps(mins)));
                    let dsc = _mm256_mul_ps(d, _mm256_cvtepi32_ps(sc));
                    for r in 0..R {
                        let xi = (row0 + r) * units + b * 8 + j;
                        let scaled = _mm256_mul_ps(_mm256_cvtepi32_ps(dot[r][k]), dsc);
                        acc[r] = _mm256_fmadd_ps(scaled, _mm256_set1_ps(*xq.scales.get_unchecked(xi)), acc[r]);
                        acc[r] = _mm256_fmadd_ps(neg_min, _mm256_set1_ps(*xq.sums.get_unchecked(xi)), acc[r]);
                    }
                }
            }
        }
        for (r, acc) in acc.into_iter().enumerate() {
            store(acc, out, row0 + r, w.n, t * LANES, h);
        }
    }

    /// Tiles `t0..t0 + tiles` of Q6_K (`F = Q6K`) or Q3_K (`Q3K`) against every activation
    /// row, 2 rows at a time (each row holds 4 integer accumulators).
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(in super::super) unsafe fn q6k_columns<const F: u8>(
        w: &Interleaved,
        xq: &QuantizedRows,
        half_sums: &[i32],
        m: usize,
        t0: usize,
        tiles: usize,
        out: *mut f32,
    ) {
        for t in t0..t0 + tiles {
            for h in 0..2 {
                rows_by_two!(m, |R, row0| q6k_tile::<F, R>(w, xq, half_sums, row0, t, h, out));
            }
        }
    }

    /// Rows `8h..8h + 8`'s unsigned values (`q + 4`) of units `4n..4n + 4`, group `g`, of a Q3_K
    /// record.
    #[inline(always)]
    unsafe fn q3k_values(rec: *const u8, n: usize, g: usize, h: usize) -> [__m256i; 4] {
        let three = _mm256_set1_epi8(3);
        let four = _mm256_set1_epi8(4);
        let bits = load(rec.add(Q3K_QS + (n * 8 + g) * VECTOR), h);
        let pairs = [bits, _mm256_srli_epi16(bits, 2), _mm256_srli_epi16(bits, 4), _mm256_srli_epi16(bits, 6)];
        std::array::from_fn(|j| {
            with_high_bits(_mm256_and_si256(pairs[j], three), rec.add(Q3K_HMASK), (4 * n + j) * 8 + g, h, four)
        })
    }

    /// The signed scales `sc − 32` of a Q3_K record's 16 sub-blocks into `out`, laid out as
    /// Q6_K's (as `x86::q3k_scales` writes them): bytewise, so the 64-byte vectors of fields run
    /// as two 32-byte halves whatever rows the caller reads.
    #[inline(always)]
    unsafe fn q3k_scales(rec: *const u8, out: &mut [i8; 16 * LANES]) {
        let nibble = _mm256_set1_epi8(0x0F);
        let three = _mm256_set1_epi8(3);
        let offset = _mm256_set1_epi8(32);
        for half in 0..2 {
            let first = load(rec.add(Q3K_SC), half);
            let second = load(rec.add(Q3K_SC + 4 * LANES), half);
            let top = load(rec.add(Q3K_SC + 8 * LANES), half);
            let lows = [
                _mm256_and_si256(first, nibble),
                _mm256_and_si256(second, nibble),
                _mm256_and_si256(_mm256_srli_epi16(first, 4), nibble),
                _mm256_and_si256(_mm256_srli_epi16(second, 4), nibble),
            ];
            let tops = [top, _mm256_srli_epi16(top, 2), _mm256_srli_epi16(top, 4), _mm256_srli_epi16(top, 6)];
            for (q, (low, top)) in lows.into_iter().zip(tops).enumerate() {
                let sc = _mm256_or_si256(low, _mm256_slli_epi16(_mm256_and_si256(top, three), 4));
                let at = out.as_mut_ptr().add(q * 4 * LANES + half * 32);
                _mm256_storeu_si256(at as *mut _, _mm256_sub_epi8(sc, offset));
            }
        }
    }

    /// Activation rows `row0..row0 + R` times rows `8h..8h + 8` of Q6_K (Q3_K) tile `t`.
    #[inline(always)]
    unsafe fn q6k_tile<const F: u8, const R: usize>(
        w: &Interleaved,
        xq: &QuantizedRows,
        half_sums: &[i32],
        row0: usize,
        t: usize,
        h: usize,
        out: *mut f32,
    ) {
        let offset = if F == Q6K { Format::Q6K.offset() } else { Format::Q3K.offset() };
        let size = if F == Q6K { Format::Q6K.record_bytes() } else { Format::Q3K.record_bytes() };
        let nb = w.blocks();
        let units = nb * 8;
        let nibble = _mm256_set1_epi8(0x0F);
        let top = _mm256_set1_epi8(0x30);
        let mut acc = [_mm256_setzero_ps(); R];
        let mut decoded = [0i8; 16 * LANES];
        for b in 0..nb {
            let rec = w.record(t, b).as_ptr();
            let d = halves(rec, h);
            let scales = if F == Q6K {
                rec.add(Q6K_SC)
            } else {
                q3k_scales(rec, &mut decoded);
                decoded.as_ptr() as *const u8
            };
            for n in 0..2 {
                for s in 0..2 {
                    if R == 1 && h == 0 {
                        prefetch_next(rec, size, 2 * n + s, 4);
                    }
                    // Sub-block s of units 4n..4n + 4.
                    let mut dot = [[_mm256_setzero_si256(); 4]; R];
                    for (r, dot) in dot.iter_mut().enumerate() {
                        for (u, dot) in dot.iter_mut().enumerate() {
                            let unit = (row0 + r) * units + b * 8 + 4 * n + u;
                            *dot = _mm256_set1_epi32(-offset * *half_sums.get_unchecked(unit * 2 + s));
                        }
                    }
                    for g in 4 * s..4 * s + 4 {
                        let values = if F == Q6K {
                            let bits = load(rec.add(Q6K_QH + (n * 8 + g) * VECTOR), h);
                            let a = load(rec.add(Q6K_QL + (2 * n * 8 + g) * VECTOR), h);
                            let c = load(rec.add(Q6K_QL + ((2 * n + 1) * 8 + g) * VECTOR), h);
                            let with_top = |low: __m256i, high: __m256i| {
                                _mm256_or_si256(_mm256_and_si256(low, nibble), _mm256_and_si256(high, top))
                            };
                            [
                                with_top(a, _mm256_slli_epi16(bits, 4)),
                                with_top(c, _mm256_slli_epi16(bits, 2)),
                                with_top(_mm256_srli_epi16(a, 4), bits),
                                with_top(_mm256_srli_epi16(c, 4), _mm256_srli_epi16(bits, 2)),
                            ]
                        } else {
                            q3k_values(rec, n, g, h)
                        };
                        for (r, dot) in dot.iter_mut().enumerate() {
                            for (u, dot) in dot.iter_mut().enumerate() {
                                *dot = dot_u(*dot, values[u], xg(xq, units, row0 + r, b * 8 + 4 * n + u, g));
                            }
                        }
                    }
                    for u in 0..4 {
                        let sc = bytes_i32(scales.add((8 * n + 2 * u + s) * LANES), h);
                        let dsc = _mm256_mul_ps(d, _mm256_cvtepi32_ps(sc));
                        for r in 0..R {
                            let xi = (row0 + r) * units + b * 8 + 4 * n + u;
                            let scaled = _mm256_mul_ps(dsc, _mm256_set1_ps(*xq.scales.get_unchecked(xi)));
                            acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot[r][u]), scaled, acc[r]);
                        }
                    }
                }
            }
        }
        for (r, acc) in acc.into_iter().enumerate() {
            store(acc, out, row0 + r, w.n, t * LANES, h);
        }
    }
}

/// The k-quants' tiles with NEON `sdot` by element, as `super::neon` runs the 32-value formats:
/// Q4_K's kernel runs Q5_K with a fifth bit, Q6_K's runs Q3_K, as on x86.
#[cfg(target_arch = "aarch64")]
pub(super) mod neon {
    use super::super::neon::{
        activations, dot_lane, each_lane, halves, quads_s8, quads_u8, row_blocks, store, with_high_bits,
    };
    use super::super::{Format, Interleaved, Q3K, Q4K, Q5K, Q6K};
    use super::*;
    use crate::int8_gemm::QuantizedRows;
    use std::arch::aarch64::*;

    /// Tiles `t0..t0 + tiles` of Q4_K (`F = Q4K`) or Q5_K (`Q5K`) against every activation row.
    #[target_feature(enable = "dotprod")]
    pub(in super::super) unsafe fn q4k_columns<const F: u8>(
        w: &Interleaved,
        xq: &QuantizedRows,
        m: usize,
        t0: usize,
        tiles: usize,
        out: *mut f32,
    ) {
        for t in t0..t0 + tiles {
            row_blocks!(m, |R, V, row0, v0| q4k_tile::<F, R, V>(w, xq, row0, t, v0, out));
        }
    }

    /// Activation rows `row0..row0 + R` times quads `v0..v0 + V` of Q4_K (Q5_K) tile `t`, one
    /// 32-value unit at a time: each unit's integer sums are scaled by its own `sc_j`.
    #[inline(always)]
    unsafe fn q4k_tile<const F: u8, const R: usize, const V: usize>(
        w: &Interleaved,
        xq: &QuantizedRows,
        row0: usize,
        t: usize,
        v0: usize,
        out: *mut f32,
    ) {
        let nb = w.blocks();
        let mut acc = [[vdupq_n_f32(0.0); V]; R];
        for b in 0..nb {
            let rec = w.record(t, b).as_ptr();
            let at = Q4kRecord { rec, d: halves::<V>(rec, v0), dmin: halves::<V>(rec.add(Q4K_DMIN), v0), v0 };
            // Activation blocks of row r's unit u: (row0 + r)·units + 8b + u.
            let xi: [usize; R] = std::array::from_fn(|r| (row0 + r) * nb * 8 + b * 8);
            for c in 0..4 {
                // Units 2c (low nibbles) and 2c + 1 (high ones): the nibble a constant.
                q4k_unit::<F, R, V, false>(&at, xq, xi.map(|i| i + 2 * c), c, &mut acc);
                q4k_unit::<F, R, V, true>(&at, xq, xi.map(|i| i + 2 * c + 1), c, &mut acc);
            }
        }
        for (r, acc) in acc.iter().enumerate() {
            for (v, &acc) in acc.iter().enumerate() {
                store(acc, out, row0 + r, w.n, t * LANES + 4 * (v0 + v));
            }
        }
    }

    /// A Q4_K (Q5_K) record and what `q4k_unit` reads of it for quads `v0..v0 + V`.
    struct Q4kRecord<const V: usize> {
        rec: *const u8,
        d: [float32x4_t; V],
        dmin: [float32x4_t; V],
        v0: usize,
    }

    /// Unit `2c + HIGH` of a Q4_K (Q5_K) record (the high nibbles of chunk `c` if `HIGH`) times
    /// the activation blocks `xi` of `R` rows, added to `acc`.
    #[inline(always)]
    unsafe fn q4k_unit<const F: u8, const R: usize, const V: usize, const HIGH: bool>(
        at: &Q4kRecord<V>,
        xq: &QuantizedRows,
        xi: [usize; R],
        c: usize,
        acc: &mut [[float32x4_t; V]; R],
    ) {
        debug_assert!(F == Q4K || F == Q5K);
        let (rec, v0) = (at.rec, at.v0);
        let u = 2 * c + HIGH as usize;
        let (nibble, three, sixteen) = (vdupq_n_u8(0x0F), vdupq_n_u8(3), vdupq_n_u8(16));
        let x = activations::<R>(xq, |r| xi[r]);
        let mut dot = [[vdupq_n_s32(0); V]; R];
        for (h, x) in x.iter().enumerate() {
            each_lane!(l => {
                let g = 4 * h + l;
                let packed = rec.add(Q4K_QS + (c * 8 + g) * VECTOR);
                let mut q: [uint8x16_t; V] = std::array::from_fn(|v| {
                    let packed = vld1q_u8(packed.add((v0 + v) * 16));
                    if HIGH { vshrq_n_u8::<4>(packed) } else { vandq_u8(packed, nibble) }
                });
                if F == Q5K {
                    q = with_high_bits(q, rec.add(Q5K_QH), u * 8 + g, v0, sixteen);
                }
                for r in 0..R {
                    for v in 0..V {
                        dot[r][v] = dot_lane(dot[r][v], q[v], x[r], l);
                    }
                }
            });
        }
        // The 6-bit scale and min of unit u for the 16 rows, as `unpack_q4k` reads them.
        let lo = vld1q_u8(rec.add(Q4K_SC_LO + u * LANES));
        let hi = vld1q_u8(rec.add(Q4K_SC_HI + (u % 4) * LANES));
        let hi = if u >= 4 { vshrq_n_u8::<4>(hi) } else { hi };
        let sc = quads_u8::<V>(vsliq_n_u8::<4>(lo, vandq_u8(hi, three)), v0);
        let mins = vsliq_n_u8::<4>(vshrq_n_u8::<4>(lo), vandq_u8(vshrq_n_u8::<2>(hi), three));
        let mins = quads_u8::<V>(mins, v0);
        // -(dmin·m_j), as the portable path and candle's de-quantization compute it.
        let neg_min: [float32x4_t; V] =
            std::array::from_fn(|v| vnegq_f32(vmulq_f32(at.dmin[v], vcvtq_f32_s32(mins[v]))));
        for (r, &xi) in xi.iter().enumerate() {
            let xd = *xq.scales.get_unchecked(xi);
            let xs = *xq.sums.get_unchecked(xi);
            for v in 0..V {
                let scaled = vcvtq_f32_s32(vmulq_s32(dot[r][v], sc[v]));
                acc[r][v] = vfmaq_f32(acc[r][v], scaled, vmulq_n_f32(at.d[v], xd));
                acc[r][v] = vfmaq_n_f32(acc[r][v], neg_min[v], xs);
            }
        }
    }

    /// Tiles `t0..t0 + tiles` of Q6_K (`F = Q6K`) or Q3_K (`Q3K`) against every activation row.
    #[target_feature(enable = "dotprod")]
    pub(in super::super) unsafe fn q6k_columns<const F: u8>(
        w: &Interleaved,
        xq: &QuantizedRows,
        half_sums: &[i32],
        m: usize,
        t0: usize,
        tiles: usize,
        out: *mut f32,
    ) {
        // Q3_K's scales decoded once per tile into Q6_K's form, then read by every row block.
        let mut decoded = if F == Q3K { vec![0i8; w.blocks() * 16 * LANES] } else { Vec::new() };
        for t in t0..t0 + tiles {
            if F == Q3K {
                for (b, out) in decoded.chunks_exact_mut(16 * LANES).enumerate() {
                    q3k_scales(w.record(t, b).as_ptr(), out);
                }
            }
            let decoded = &decoded;
            row_blocks!(m, |R, V, row0, v0| q6k_tile::<F, R, V>(w, xq, half_sums, decoded, row0, t, v0, out));
        }
    }

    /// The signed scales `sc − 32` of a Q3_K record's 16 sub-blocks into `out`, one byte per
    /// sub-block and row as Q6_K's (16 rows a register, as `q3k_scale` reads them).
    #[inline(always)]
    unsafe fn q3k_scales(rec: *const u8, out: &mut [i8]) {
        let byte = |i: usize| vld1q_u8(rec.add(Q3K_SC + i * LANES));
        for s in 0..16 {
            let low = vandq_u8(vshlq_u8(byte(s % 8), vdupq_n_s8(-4 * (s / 8) as i8)), vdupq_n_u8(0xF));
            let top = vandq_u8(vshlq_u8(byte(8 + s % 4), vdupq_n_s8(-2 * (s / 4) as i8)), vdupq_n_u8(3));
            let sc = vsubq_s8(vreinterpretq_s8_u8(vsliq_n_u8::<4>(low, top)), vdupq_n_s8(32));
            vst1q_s8(out.as_mut_ptr().add(s * LANES), sc);
        }
    }

    /// Quads `v0..v0 + V` of the 6-bit values of unit `4n + j`, group `g`, of a Q6_K record:
    /// a nibble of the low-bit vector, the bit pair `j` of the top-bit one in bits 4 and 5.
    #[inline(always)]
    unsafe fn q6k_values<const V: usize>(rec: *const u8, n: usize, j: usize, g: usize, v0: usize) -> [uint8x16_t; V] {
        let (nibble, top) = (vdupq_n_u8(0x0F), vdupq_n_u8(0x30));
        std::array::from_fn(|v| {
            let low = vld1q_u8(rec.add(Q6K_QL + ((2 * n + j % 2) * 8 + g) * VECTOR + (v0 + v) * 16));
            let low = if j >= 2 { vshrq_n_u8::<4>(low) } else { vandq_u8(low, nibble) };
            let bits = vld1q_u8(rec.add(Q6K_QH + (n * 8 + g) * VECTOR + (v0 + v) * 16));
            let bits = match j {
                0 => vshlq_n_u8::<4>(bits),
                1 => vshlq_n_u8::<2>(bits),
                2 => bits,
                _ => vshrq_n_u8::<2>(bits),
            };
            vbslq_u8(top, bits, low)
        })
    }

    /// Quads `v0..v0 + V` of the unsigned values (`q + 4`) of unit `4n + j`, group `g`, of a
    /// Q3_K record: bit pair `j` of the low-bit vector, 4 added where the high bit is set.
    #[inline(always)]
    unsafe fn q3k_values<const V: usize>(rec: *const u8, n: usize, j: usize, g: usize, v0: usize) -> [uint8x16_t; V] {
        let (three, four) = (vdupq_n_u8(3), vdupq_n_u8(4));
        let pairs = std::array::from_fn(|v| {
            let bits = vld1q_u8(rec.add(Q3K_QS + (n * 8 + g) * VECTOR + (v0 + v) * 16));
            let bits = match j {
                0 => bits,
                1 => vshrq_n_u8::<2>(bits),
                2 => vshrq_n_u8::<4>(bits),
                _ => vshrq_n_u8::<6>(bits),
            };
            vandq_u8(bits, three)
        });
        with_high_bits(pairs, rec.add(Q3K_HMASK), (4 * n + j) * 8 + g, v0, four)
    }

    /// Activation rows `row0..row0 + R` times quads `v0..v0 + V` of Q6_K (Q3_K) tile `t`:
    /// integer sums per 16 values scaled by their signed `sc`, summed per 32-value unit.
    #[inline(always)]
    #[allow(clippy::too_many_arguments)]
    unsafe fn q6k_tile<const F: u8, const R: usize, const V: usize>(
        w: &Interleaved,
        xq: &QuantizedRows,
        half_sums: &[i32],
        decoded: &[i8],
        row0: usize,
        t: usize,
        v0: usize,
        out: *mut f32,
    ) {
        debug_assert!(F == Q6K || F == Q3K);
        let offset = if F == Q6K { Format::Q6K.offset() } else { Format::Q3K.offset() };
        let nb = w.blocks();
        let units = nb * 8;
        let mut acc = [[vdupq_n_f32(0.0); V]; R];
        for b in 0..nb {
            let rec = w.record(t, b).as_ptr();
            let d = halves::<V>(rec, v0);
            // One signed byte per sub-block and row: Q6_K's as they are, Q3_K's decoded.
            let scales = if F == Q6K { rec.add(Q6K_SC) as *const i8 } else { decoded.as_ptr().add(b * 16 * LANES) };
            for n in 0..2 {
                each_lane!(j => {
                    let u = 4 * n + j;
                    let mut sums = [[vdupq_n_s32(0); V]; R];
                    let x = activations::<R>(xq, |r| (row0 + r) * units + b * 8 + u);
                    for (h, x) in x.iter().enumerate() {
                        let mut dot: [[int32x4_t; V]; R] = std::array::from_fn(|r| {
                            let unit = (row0 + r) * units + b * 8 + u;
                            [vdupq_n_s32(-offset * *half_sums.get_unchecked(unit * 2 + h)); V]
                        });
                        each_lane!(l => {
                            let g = 4 * h + l;
                            let q = if F == Q6K { q6k_values::<V>(rec, n, j, g, v0) } else { q3k_values::<V>(rec, n, j, g, v0) };
                            for r in 0..R {
                                for v in 0..V {
                                    dot[r][v] = dot_lane(dot[r][v], q[v], x[r], l);
                                }
                            }
                        });
                        let sc = quads_s8::<V>(vld1q_s8(scales.add((2 * u + h) * LANES)), v0);
                        for r in 0..R {
                            for v in 0..V {
                                sums[r][v] = vmlaq_s32(sums[r][v], dot[r][v], sc[v]);
                            }
                        }
                    }
                    for r in 0..R {
                        let xd = *xq.scales.get_unchecked((row0 + r) * units + b * 8 + u);
                        for v in 0..V {
                            acc[r][v] = vfmaq_f32(acc[r][v], vcvtq_f32_s32(sums[r][v]), vmulq_n_f32(d[v], xd));
                        }
                    }
                });
            }
        }
        for (r, acc) in acc.iter().enumerate() {
            for (v, &acc) in acc.iter().enumerate() {
                store(acc, out, row0 + r, w.n, t * LANES + 4 * (v0 + v));
            }
        }
    }
}
