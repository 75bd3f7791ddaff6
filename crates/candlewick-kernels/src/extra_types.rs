//! The GGUF tensor types llama.cpp writes that candle's `GgmlDType` lacks: the i-quants (IQ1_S,
//! IQ1_M, IQ2_XXS, IQ2_XS, IQ2_S, IQ3_XXS, IQ3_S, IQ4_NL, IQ4_XS), the ternary TQ1_0 / TQ2_0
//! and MXFP4. Layouts as ggml's `block_*` structs (`ggml-common.h`); values bit for bit as the
//! `gguf` package's `gguf.quants.dequantize` computes them.
//!
//! Every one of these types stores, per 16 or 32 values, one float32 scale (a float16 super-block
//! scale times a small integer, which float32 holds exactly) and small integers that fit an
//! `i8`: grid values with their signs (at most 62), IQ4's non-linear levels (-127..113),
//! MXFP4's doubled e2m1 levels (at most 12), IQ1's `8·(grid ± 1/8)`, the ternary `-1, 0, 1`.
//! Decoding to that pair first gives both uses with one decoder each: the float32 value is the
//! scale times the integer, one rounding, exactly as gguf's numpy (and ggml's C) rounds it; and
//! a 32-value group with one scale is a Q8_0 block, whose scale is the float32 scale rounded to
//! float16 (exact whenever float16 holds it) — the int8 kernels' format (`to_q8_0`).

use half::f16;
use rayon::prelude::*;

use super::iquant_grids::*;

/// A ggml tensor type candle cannot hold, by its ggml name.
#[allow(non_camel_case_types)]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ExtraType {
    /// 2.06 bits a value: 8-value grid points of {8, 25, 43}, signs, a 4-bit scale per 32.
    IQ2_XXS,
    /// 2.31 bits: a larger grid, a 4-bit scale per 16.
    IQ2_XS,
    /// 3.06 bits: 4-value grid points, a 4-bit scale per 32.
    IQ3_XXS,
    /// 1.56 bits: 8-value ternary grid points with a shift of ±1/8, a 3-bit scale per 32.
    IQ1_S,
    /// 4.5 bits: 16 non-linear levels, a float16 scale per 32.
    IQ4_NL,
    /// 3.44 bits: a 512-point grid, a 4-bit odd scale per 32.
    IQ3_S,
    /// 2.56 bits: a 1024-point grid, explicit signs, a 4-bit scale per 16.
    IQ2_S,
    /// 4.25 bits: IQ4_NL's levels, a 6-bit scale per 32.
    IQ4_XS,
    /// 1.75 bits: IQ1_S's grid, a 3-bit scale per 16, the float16 scale split over the scales.
    IQ1_M,
    /// 1.69 bits: ternary values packed five to a byte in base 3.
    TQ1_0,
    /// 2.06 bits: ternary values in 2 bits each.
    TQ2_0,
    /// 4.25 bits: OCP microscaling FP4 (e2m1) values, a power-of-two (E8M0) scale per 32.
    MXFP4,
}

/// Values of a 256-value super-block.
const QK_K: usize = 256;
/// The finest scale granularity of these types: one scale per this many values.
pub const SCALE_VALUES: usize = 16;

/// ggml's `kvalues_iq4nl`: IQ4_NL's and IQ4_XS's 16 levels (the interleaved tiles look them up too).
pub(crate) const KVALUES_IQ4NL: [i8; 16] = [-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113];
/// ggml's `kvalues_mxfp4`: the e2m1 values doubled (the scale is halved to match).
pub(crate) const KVALUES_MXFP4: [i8; 16] = [0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12];

impl ExtraType {
    /// Every type, for tests and tables.
    pub const ALL: [Self; 12] = [
        Self::IQ2_XXS,
        Self::IQ2_XS,
        Self::IQ3_XXS,
        Self::IQ1_S,
        Self::IQ4_NL,
        Self::IQ3_S,
        Self::IQ2_S,
        Self::IQ4_XS,
        Self::IQ1_M,
        Self::TQ1_0,
        Self::TQ2_0,
        Self::MXFP4,
    ];

    /// The type of a ggml type id, if it is one of these.
    pub fn from_id(id: u32) -> Option<Self> {
        Self::ALL.into_iter().find(|t| t.id() == id)
    }

    /// ggml's type id (`enum ggml_type`).
    pub fn id(self) -> u32 {
        match self {
            Self::IQ2_XXS => 16,
            Self::IQ2_XS => 17,
            Self::IQ3_XXS => 18,
            Self::IQ1_S => 19,
            Self::IQ4_NL => 20,
            Self::IQ3_S => 21,
            Self::IQ2_S => 22,
            Self::IQ4_XS => 23,
            Self::IQ1_M => 29,
            Self::TQ1_0 => 34,
            Self::TQ2_0 => 35,
            Self::MXFP4 => 39,
        }
    }

    /// Values of one block.
    pub fn block_values(self) -> usize {
        match self {
            Self::IQ4_NL | Self::MXFP4 => 32,
            _ => QK_K,
        }
    }

    /// Bytes of one block.
    pub fn block_bytes(self) -> usize {
        match self {
            Self::IQ2_XXS => 66,
            Self::IQ2_XS => 74,
            Self::IQ3_XXS => 98,
            Self::IQ1_S => 50,
            Self::IQ4_NL => 18,
            Self::IQ3_S => 110,
            Self::IQ2_S => 82,
            Self::IQ4_XS => 136,
            Self::IQ1_M => 56,
            Self::TQ1_0 => 54,
            Self::TQ2_0 => 66,
            Self::MXFP4 => 17,
        }
    }

    /// Whether a block's values are all finite: its float16 scale is, or for MXFP4, whose
    /// power-of-two scale is finite whatever its bits, the largest level (12) times the scale
    /// stays below float32's maximum (exponent bytes below 253).
    pub fn finite_scale(self, block: &[u8]) -> bool {
        match self {
            Self::MXFP4 => block[0] < 253,
            _ => self.half_scale(block).is_finite(),
        }
    }

    /// The float16 scale of a block of the types that have one (all but MXFP4).
    fn half_scale(self, block: &[u8]) -> f16 {
        let at = |i: usize| u16::from_le_bytes([block[i], block[i + 1]]);
        f16::from_bits(match self {
            Self::TQ1_0 => at(52),
            Self::TQ2_0 => at(64),
            // The scale's four nibbles are the top nibbles of the four u16 block scales.
            Self::IQ1_M => {
                let s = [at(48), at(50), at(52), at(54)];
                (s[0] >> 12) | ((s[1] >> 8) & 0x00f0) | ((s[2] >> 4) & 0x0f00) | (s[3] & 0xf000)
            }
            _ => at(0),
        })
    }

    /// Decodes one block into a float32 scale per `SCALE_VALUES` values and an integer per
    /// value: value `i` is `scales[i / 16] * q[i]`.
    pub(crate) fn decode(self, b: &[u8], scales: &mut [f32], q: &mut [i8]) {
        let half = |i: usize| f16::from_bits(u16::from_le_bytes([b[i], b[i + 1]])).to_f32();
        let u32_at = |i: usize| u32::from_le_bytes([b[i], b[i + 1], b[i + 2], b[i + 3]]);
        let sign = |bits: u8, j: usize| if bits >> j & 1 == 0 { 1i8 } else { -1 };
        // Scales per 32 values fill two 16-value slots.
        let mut per_32 = |ib: usize, s: f32| {
            scales[2 * ib] = s;
            scales[2 * ib + 1] = s;
        };
        match self {
            Self::IQ2_XXS => {
                let d = half(0);
                for ib in 0..QK_K / 32 {
                    let (aux0, aux1) = (u32_at(2 + 8 * ib), u32_at(6 + 8 * ib));
                    // Products of a half and a 5-bit odd number by 1/8: exact in float32.
                    per_32(ib, d * (0.5 + (aux1 >> 28) as f32) * 0.25);
                    for l in 0..4 {
                        let grid = IQ2XXS_GRID[(aux0 >> (8 * l) & 0xff) as usize].to_le_bytes();
                        let signs = KSIGNS_IQ2XS[(aux1 >> (7 * l) & 127) as usize];
                        for j in 0..8 {
                            q[32 * ib + 8 * l + j] = grid[j] as i8 * sign(signs, j);
                        }
                    }
                }
            }
            Self::IQ2_XS => {
                let d = half(0);
                for g in 0..QK_K / 16 {
                    let s = b[66 + g / 2] >> (4 * (g % 2)) & 15;
                    scales[g] = d * (0.5 + s as f32) * 0.25;
                }
                for k in 0..QK_K / 8 {
                    let v = u16::from_le_bytes([b[2 + 2 * k], b[3 + 2 * k]]);
                    let grid = IQ2XS_GRID[(v & 511) as usize].to_le_bytes();
                    let signs = KSIGNS_IQ2XS[(v >> 9) as usize];
                    for j in 0..8 {
                        q[8 * k + j] = grid[j] as i8 * sign(signs, j);
                    }
                }
            }
            Self::IQ2_S => {
                let d = half(0);
                let (qs, signs, qh, sc) = (&b[2..34], &b[34..66], &b[66..74], &b[74..82]);
                for g in 0..QK_K / 16 {
                    scales[g] = d * (0.5 + (sc[g / 2] >> (4 * (g % 2)) & 15) as f32) * 0.25;
                }
                for k in 0..QK_K / 8 {
                    let index = qs[k] as usize | ((qh[k / 4] >> (2 * (k % 4)) & 3) as usize) << 8;
                    let grid = IQ2S_GRID[index].to_le_bytes();
                    for j in 0..8 {
                        q[8 * k + j] = grid[j] as i8 * sign(signs[k], j);
                    }
                }
            }
            Self::IQ3_XXS => {
                let d = half(0);
                let qs = &b[2..66];
                for ib in 0..QK_K / 32 {
                    let aux = u32_at(66 + 4 * ib);
                    per_32(ib, d * (0.5 + (aux >> 28) as f32) * 0.5);
                    for l in 0..4 {
                        let signs = KSIGNS_IQ2XS[(aux >> (7 * l) & 127) as usize];
                        for j in 0..8 {
                            let grid = IQ3XXS_GRID[qs[8 * ib + 2 * l + j / 4] as usize].to_le_bytes();
                            q[32 * ib + 8 * l + j] = grid[j % 4] as i8 * sign(signs, j);
                        }
                    }
                }
            }
            Self::IQ3_S => {
                let d = half(0);
                let (qs, qh, signs, sc) = (&b[2..66], &b[66..74], &b[74..106], &b[106..110]);
                for ib in 0..QK_K / 32 {
                    per_32(ib, d * (1 + 2 * (sc[ib / 2] >> (4 * (ib % 2)) & 15)) as f32);
                }
                for k in 0..QK_K / 4 {
                    let index = qs[k] as usize | ((qh[k / 8] >> (k % 8) & 1) as usize) << 8;
                    let grid = IQ3S_GRID[index].to_le_bytes();
                    for j in 0..4 {
                        let i = 4 * k + j;
                        q[i] = grid[j] as i8 * sign(signs[i / 8], i % 8);
                    }
                }
            }
            Self::IQ1_S => {
                let d = half(0);
                let qs = &b[2..34];
                for ib in 0..QK_K / 32 {
                    let qh = u16::from_le_bytes([b[34 + 2 * ib], b[35 + 2 * ib]]);
                    // `dl·(g ± 1/8)` is `(dl/8)·(8g ± 1)`: the same exact product, one rounding.
                    per_32(ib, d * (2 * (qh >> 12 & 7) + 1) as f32 * 0.125);
                    let delta: i8 = if qh & 0x8000 == 0 { 1 } else { -1 };
                    for l in 0..4 {
                        let index = qs[4 * ib + l] as usize | ((qh >> (3 * l) & 7) as usize) << 8;
                        let grid = IQ1S_GRID[index].to_le_bytes();
                        for j in 0..8 {
                            q[32 * ib + 8 * l + j] = 8 * grid[j] as i8 + delta;
                        }
                    }
                }
            }
            Self::IQ1_M => {
                let d = self.half_scale(b).to_f32();
                let (qs, qh, sc) = (&b[0..32], &b[32..48], &b[48..56]);
                for g in 0..QK_K / 16 {
                    let s = u16::from_le_bytes([sc[2 * (g / 4)], sc[2 * (g / 4) + 1]]) >> (3 * (g % 4)) & 7;
                    scales[g] = d * (2 * s + 1) as f32 * 0.125;
                }
                for k in 0..QK_K / 8 {
                    let nibble = qh[k / 2] >> (4 * (k % 2)) & 15;
                    let grid = IQ1S_GRID[qs[k] as usize | ((nibble & 7) as usize) << 8].to_le_bytes();
                    let delta: i8 = if nibble & 8 == 0 { 1 } else { -1 };
                    for j in 0..8 {
                        q[8 * k + j] = 8 * grid[j] as i8 + delta;
                    }
                }
            }
            Self::IQ4_NL => {
                per_32(0, half(0));
                for j in 0..16 {
                    q[j] = KVALUES_IQ4NL[(b[2 + j] & 15) as usize];
                    q[j + 16] = KVALUES_IQ4NL[(b[2 + j] >> 4) as usize];
                }
            }
            Self::IQ4_XS => {
                let d = half(0);
                let scales_h = u16::from_le_bytes([b[2], b[3]]);
                for ib in 0..QK_K / 32 {
                    let lo = b[4 + ib / 2] >> (4 * (ib % 2)) & 15;
                    let hi = (scales_h >> (2 * ib) & 3) as u8;
                    per_32(ib, d * ((lo | hi << 4) as i8 - 32) as f32);
                    for j in 0..16 {
                        let byte = b[8 + 16 * ib + j];
                        q[32 * ib + j] = KVALUES_IQ4NL[(byte & 15) as usize];
                        q[32 * ib + j + 16] = KVALUES_IQ4NL[(byte >> 4) as usize];
                    }
                }
            }
            Self::TQ1_0 => {
                per_32_all(scales, half(52));
                // Five base-3 digits a byte, scaled so that digit n is the top bits of the byte
                // times 3ⁿ (wrapping, as ggml's uint8 arithmetic), times 3, over 256.
                let trit = |byte: u8, n: u32| (((byte.wrapping_mul(3u8.pow(n)) as u16) * 3) >> 8) as i8 - 1;
                for n in 0..5 {
                    for m in 0..32 {
                        q[32 * n as usize + m] = trit(b[m], n);
                    }
                    for m in 0..16 {
                        q[160 + 16 * n as usize + m] = trit(b[32 + m], n);
                    }
                }
                for n in 0..4 {
                    for m in 0..4 {
                        q[240 + 4 * n as usize + m] = trit(b[48 + m], n);
                    }
                }
            }
            Self::TQ2_0 => {
                per_32_all(scales, half(64));
                for c in 0..2 {
                    for l in 0..4 {
                        for m in 0..32 {
                            q[128 * c + 32 * l + m] = (b[32 * c + m] >> (2 * l) & 3) as i8 - 1;
                        }
                    }
                }
            }
            Self::MXFP4 => {
                per_32(0, e8m0_half(b[0]));
                for j in 0..16 {
                    q[j] = KVALUES_MXFP4[(b[1 + j] & 15) as usize];
                    q[j + 16] = KVALUES_MXFP4[(b[1 + j] >> 4) as usize];
                }
            }
        }
    }

    /// Checks that `bytes` is whole blocks; the error names the type.
    fn blocks<'a>(self, bytes: &'a [u8]) -> Result<std::slice::ChunksExact<'a, u8>, String> {
        if bytes.len() % self.block_bytes() != 0 {
            return Err(format!("{} bytes are not whole {self:?} blocks of {}", bytes.len(), self.block_bytes()));
        }
        Ok(bytes.chunks_exact(self.block_bytes()))
    }

    /// De-quantizes whole blocks to float32, bit for bit as `gguf.quants.dequantize`.
    pub fn dequantize(self, bytes: &[u8]) -> Result<Vec<f32>, String> {
        let blocks = self.blocks(bytes)?.len();
        let mut out = vec![0f32; blocks * self.block_values()];
        let per = self.block_values();
        out.par_chunks_mut(per).zip(bytes.par_chunks(self.block_bytes())).for_each(|(out, block)| {
            let (mut scales, mut q) = ([0f32; QK_K / SCALE_VALUES], [0i8; QK_K]);
            self.decode(block, &mut scales, &mut q);
            for (i, o) in out.iter_mut().enumerate() {
                *o = scales[i / SCALE_VALUES] * q[i] as f32;
            }
        });
        Ok(out)
    }

    /// Bytes of the Q8_0 blocks (34 bytes per 32 values) `bytes` re-encodes into.
    pub fn q8_0_bytes(self, bytes: usize) -> usize {
        bytes / self.block_bytes() * self.block_values() / 32 * Q8_0_BYTES
    }

    /// Re-encodes whole blocks into `out` as ggml Q8_0 blocks (a float16 scale, 32 `i8`),
    /// `q8_0_bytes` long. A 32-value group with one scale keeps its integers and takes the scale
    /// rounded to float16: the same values exactly where float16 holds the scale (always for
    /// IQ4_NL and the ternary types; MXFP4 for scales 2⁻²⁴…2¹⁵), otherwise each off by at most
    /// 2⁻¹¹ of itself. A group with two scales (IQ2_XS, IQ2_S, IQ1_M), or whose scale float16
    /// cannot hold as a normal number, is quantized afresh from its float32 values as ggml
    /// quantizes Q8_0 (`d = amax/127`, values rounded to nearest); where even that scale is
    /// beyond float16 the group is counted `unrepresentable` (its bytes are then meaningless).
    pub fn to_q8_0(self, bytes: &[u8], out: &mut [u8]) -> Result<Q8Conversion, String> {
        use candle_core::quantized::k_quants::{BlockQ8_0, GgmlType};
        let blocks = self.blocks(bytes)?.len();
        let groups = self.block_values() / 32;
        if out.len() != blocks * groups * Q8_0_BYTES {
            return Err(format!("{} bytes cannot hold the Q8_0 form of {blocks} {self:?} blocks", out.len()));
        }
        let tally = out
            .par_chunks_mut(groups * Q8_0_BYTES)
            .zip(bytes.par_chunks(self.block_bytes()))
            .map(|(out, block)| {
                let (mut scales, mut q) = ([0f32; QK_K / SCALE_VALUES], [0i8; QK_K]);
                self.decode(block, &mut scales, &mut q);
                let mut tally = Q8Conversion::default();
                for (g, o) in out.chunks_exact_mut(Q8_0_BYTES).enumerate() {
                    let (s, qs) = (scales[2 * g], &q[32 * g..32 * g + 32]);
                    let d = f16::from_f32(s);
                    let one_scale = s.to_bits() == scales[2 * g + 1].to_bits();
                    if one_scale && (d.to_f32() == s || d.is_normal()) {
                        if d.to_f32() == s {
                            tally.exact += 1;
                        } else {
                            tally.rounded_scale += 1;
                        }
                        o[..2].copy_from_slice(&d.to_le_bytes());
                        for (o, &v) in o[2..].iter_mut().zip(qs) {
                            *o = v as u8;
                        }
                    } else {
                        tally.requantized += 1;
                        let values: Vec<f32> = (0..32).map(|i| scales[2 * g + i / 16] * qs[i] as f32).collect();
                        // SAFETY: a Q8_0 block is plain data (a half and 32 bytes), valid all zero;
                        // viewed as its 34 bytes once candle's quantizer has written it.
                        let mut block: [BlockQ8_0; 1] = unsafe { std::mem::zeroed() };
                        BlockQ8_0::from_float(&values, &mut block);
                        let raw = unsafe { std::slice::from_raw_parts(block.as_ptr() as *const u8, Q8_0_BYTES) };
                        o.copy_from_slice(raw);
                        if !f16::from_le_bytes([o[0], o[1]]).is_finite() {
                            tally.unrepresentable += 1;
                        }
                    }
                }
                tally
            })
            .reduce(Q8Conversion::default, |a, b| Q8Conversion {
                exact: a.exact + b.exact,
                rounded_scale: a.rounded_scale + b.rounded_scale,
                requantized: a.requantized + b.requantized,
                unrepresentable: a.unrepresentable + b.unrepresentable,
            });
        Ok(tally)
    }
}

/// Bytes of one ggml Q8_0 block.
const Q8_0_BYTES: usize = 34;

/// How `to_q8_0` encoded a tensor's 32-value groups.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Q8Conversion {
    /// Groups whose values are unchanged.
    pub exact: usize,
    /// Groups whose scale was rounded to float16 (integers kept).
    pub rounded_scale: usize,
    /// Groups quantized afresh from their float32 values.
    pub requantized: usize,
    /// Of those, groups whose values are too large for any Q8_0 scale (float16): the tensor
    /// must stay float32.
    pub unrepresentable: usize,
}

/// MXFP4's scale: ggml's `ggml_e8m0_to_fp32_half`, 2^(e − 128) (half the E8M0 value, as the
/// levels are doubled), subnormal below e = 2. Exact in float32 for every byte.
pub(crate) fn e8m0_half(e: u8) -> f32 {
    let e = e as u32;
    f32::from_bits(if e < 2 { 0x0020_0000 << e } else { (e - 1) << 23 })
}

/// One scale for all of a 256-value block's slots.
fn per_32_all(scales: &mut [f32], s: f32) {
    scales.iter_mut().for_each(|x| *x = s);
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Random blocks whose float16 scales are finite and moderate, as a quantizer writes them.
    fn random_blocks(t: ExtraType, n: usize, seed: u64) -> Vec<u8> {
        let mut state = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
        let mut bytes: Vec<u8> = (0..n * t.block_bytes())
            .map(|_| {
                state ^= state << 13;
                state ^= state >> 7;
                state ^= state << 17;
                state as u8
            })
            .collect();
        for (i, block) in bytes.chunks_exact_mut(t.block_bytes()).enumerate() {
            let d = f16::from_f32(0.001 * (1 + i % 7) as f32).to_le_bytes();
            match t {
                ExtraType::MXFP4 => block[0] = 110 + (i % 20) as u8,
                ExtraType::TQ1_0 => block[52..54].copy_from_slice(&d),
                ExtraType::TQ2_0 => block[64..66].copy_from_slice(&d),
                ExtraType::IQ1_M => {
                    let bits = u16::from_le_bytes(d);
                    for k in 0..4 {
                        let at = 48 + 2 * k;
                        let s = u16::from_le_bytes([block[at], block[at + 1]]) & 0x0fff | (bits >> (4 * k) & 15) << 12;
                        block[at..at + 2].copy_from_slice(&s.to_le_bytes());
                    }
                }
                _ => block[..2].copy_from_slice(&d),
            }
            assert!(t.finite_scale(block), "{t:?}");
        }
        bytes
    }

    #[test]
    fn q8_0_re_encoding_is_exact_where_documented() {
        for t in ExtraType::ALL {
            let bytes = random_blocks(t, 64, t.id() as u64);
            let values = t.dequantize(&bytes).unwrap();
            let mut q8 = vec![0u8; t.q8_0_bytes(bytes.len())];
            let tally = t.to_q8_0(&bytes, &mut q8).unwrap();
            assert_eq!(tally.exact + tally.rounded_scale + tally.requantized, values.len() / 32, "{t:?}");
            let mut worst = 0f32;
            for (g, block) in q8.chunks_exact(34).enumerate() {
                let d = f16::from_le_bytes([block[0], block[1]]).to_f32();
                for i in 0..32 {
                    let (want, got) = (values[32 * g + i], d * block[2 + i] as i8 as f32);
                    let amax = values[32 * g..32 * g + 32].iter().fold(0f32, |m, v| m.max(v.abs()));
                    worst = worst.max((got - want).abs() / amax.max(f32::MIN_POSITIVE));
                }
            }
            match t {
                ExtraType::IQ4_NL | ExtraType::TQ1_0 | ExtraType::TQ2_0 | ExtraType::MXFP4 => {
                    assert_eq!((tally.rounded_scale, tally.requantized, worst), (0, 0, 0.0), "{t:?}")
                }
                // Rounding to nearest, plus the float16 rounding of the new scale.
                ExtraType::IQ2_XS | ExtraType::IQ2_S | ExtraType::IQ1_M => {
                    assert!(worst <= 0.5 / 127.0 + 1.0 / 2048.0, "{t:?} {worst}")
                }
                _ => assert!(tally.requantized == 0 && worst <= 1.0 / 2048.0, "{t:?} {tally:?} {worst}"),
            }
        }
    }

    #[test]
    fn mxfp4_values_beyond_float16_are_unrepresentable_as_q8_0() {
        let mut blocks = random_blocks(ExtraType::MXFP4, 4, 1);
        blocks[17] = 145;
        blocks[34] = 200;
        let mut q8 = vec![0u8; 4 * 34];
        let tally = ExtraType::MXFP4.to_q8_0(&blocks, &mut q8).unwrap();
        assert_eq!((tally.exact, tally.requantized, tally.unrepresentable), (2, 2, 1));
    }

    #[test]
    fn partial_blocks_are_refused() {
        assert!(ExtraType::IQ4_XS.dequantize(&[0u8; 135]).unwrap_err().contains("IQ4_XS"));
        assert!(ExtraType::MXFP4.to_q8_0(&[0u8; 18], &mut [0u8; 34]).is_err());
        assert!(ExtraType::MXFP4.to_q8_0(&[0u8; 17], &mut [0u8; 33]).is_err());
    }
}
