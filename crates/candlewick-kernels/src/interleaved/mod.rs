//! Weights of ggml's block formats repacked at load into tiles of 16 interleaved rows, and the
//! int8 GEMM over them: an AVX-512 VNNI path, an AVX2 one (`avx2.rs`, for the x86 CPUs without
//! AVX-512) and a NEON `sdot` one (FEAT_DotProd), chosen at run time, and a portable one (ggml's `block_q8_0x8` / `block_q4_Kx8` idea, candle's x86 repack).
//! The 32-value formats (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1) are laid out here; the 256-value k-quants
//! (Q3_K, Q4_K, Q5_K, Q6_K) in `k_quants.rs`; the formats whose 4-bit values index a table of
//! levels (IQ4_NL, IQ4_XS, MXFP4, x86 only) in `i_quants.rs`; the grid i-quants and the ternary
//! types (IQ1_S … IQ3_S, TQ1_0, TQ2_0), decoded record by record in cache, in `grid.rs`.
//!
//! In ggml's row-major layout every (activation row, weight row) pair needs its own dot product
//! and a horizontal sum, and the per-block scale arithmetic costs as much as the multiply.
//! Here the 32-bit lanes of one `vpdpbusd` are 16 weight rows: it multiplies 4 values of each
//! by one broadcast group of 4 activations, so an accumulator holds 16 output columns, the
//! scales of 16 rows load as one vector, and a weight vector feeds every activation row of the
//! tile. A batch of a few rows (the engine's decode step) reads each weight byte once, and
//! prefill costs several times fewer instructions per product.
//!
//! On Arm, one `sdot` by element multiplies 4 values of each of 4 rows (a quarter of a 64-byte
//! vector) by one 4-byte group of an activation register: four of them cover the 16 rows, and an
//! accumulator holds 4 output columns (`neon`).
//!
//! `vpdpbusd` multiplies unsigned by signed bytes. Q8_0 values are stored offset by 128 on x86
//! (a flip of the sign bit; unchanged on Arm, whose `sdot` is signed × signed) and Q4_0's
//! (Q5_0's, Q6_K's, Q3_K's) values are unsigned with an offset of 8 (16, 32, 4), so each block's
//! sum starts at `-offset·Σq_x`; Q4_1's and Q5_1's offset `m` is a float, added as `m·Σx` (Q4_K's
//! and Q5_K's per 32 values, `-dmin·m_j·Σx`). The integer products equal ggml's exactly; only the
//! order of the float additions differs. Activations are quantized in 32-value blocks for every
//! format (ggml quantizes them per 256 for the k-quants: ours is finer).
//!
//! A tile's record holds the same bytes as its 16 source blocks (scales, then offsets for
//! Q4_1/Q5_1, then the fifth bits of Q5 values, then the values of each group of 4 for each of
//! the 16 rows) and a tile covers the bytes its 16 rows occupied, so repacking permutes the
//! loaded bytes in place: no second copy of a 180 MB vocabulary, and Q5 weights stay 5.5 bits a
//! value (re-encoding them as Q8_0 cost Qwen2.5-Coder 0.5B 145 MB). The fifth bits are stored
//! as one 64-bit mask per 64-byte vector of nibbles, bit `4·lane + t` for value `t` of a row's
//! group, so the kernel adds 16 to the masked bytes with one masked `vpaddb` (Q5_K's fifth bits
//! and Q3_K's third bits the same way, in `k_quants.rs`).

/// Runs `$call`, a tile of `$r` activation rows from row `$row0` (`$r` a constant, so each tile
/// size is its own monomorphised, inlined kernel), over the activation rows `$from..$m`: 4 rows
/// at a time, then the last 1-3 rows together.
#[cfg(target_arch = "x86_64")]
macro_rules! rows_by_four {
    ($m:expr, $from:expr, |$r:ident, $row0:ident| $call:expr) => {{
        let m = $m;
        let mut $row0 = $from;
        while $row0 + 4 <= m {
            const $r: usize = 4;
            $call;
            $row0 += 4;
        }
        match m - $row0 {
            1 => {
                const $r: usize = 1;
                $call
            }
            2 => {
                const $r: usize = 2;
                $call
            }
            3 => {
                const $r: usize = 3;
                $call
            }
            _ => {}
        }
    }};
}

/// `rows_by_four`'s loop for the tiles that hold 8 integer accumulators a row: every activation
/// row 2 at a time, then the last one alone.
#[cfg(any(target_arch = "x86_64", target_arch = "aarch64"))]
macro_rules! rows_by_two {
    ($m:expr, |$r:ident, $row0:ident| $call:expr) => {{
        let m = $m;
        let mut $row0 = 0;
        while $row0 + 2 <= m {
            const $r: usize = 2;
            $call;
            $row0 += 2;
        }
        if $row0 < m {
            const $r: usize = 1;
            $call
        }
    }};
}

// After the macros: they are in scope in these files.
#[cfg(target_arch = "x86_64")]
mod avx2;
mod grid;
mod i_quants;
mod k_quants;

use candle_core::quantized::GgmlDType;
use half::f16;
use rayon::prelude::*;

use super::int8_gemm::{quantize_rows, Path, QuantizedRows};
use crate::extra_types::ExtraType;

/// Values of one activation block, and of the 32-value formats' blocks.
const QK: usize = 32;
/// Weight rows interleaved in one tile.
pub const LANES: usize = 16;
/// Bytes of one half-precision field for every row of a tile.
const HALVES: usize = LANES * 2;

/// A block format the tiles hold.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Format {
    /// `d·q`, signed 8-bit `q` (stored as `q + 128` on x86).
    Q8_0,
    /// `d·(q − 8)`, 4-bit `q`.
    Q4_0,
    /// `d·q + m`, 4-bit `q`.
    Q4_1,
    /// `d·(q − 16)`, 5-bit `q`.
    Q5_0,
    /// `d·q + m`, 5-bit `q`.
    Q5_1,
    /// `d·sc_j·q − dmin·m_j`, 4-bit `q`, 6-bit `sc_j`, `m_j` per 32 values of a 256-value block.
    Q4K,
    /// `d·sc_j·q − dmin·m_j`, 5-bit `q`, with Q4_K's scales and mins.
    Q5K,
    /// `d·sc_j·(q − 32)`, 6-bit `q`, 8-bit signed `sc_j` per 16 values of a 256-value block.
    Q6K,
    /// `d·(sc_j − 32)·(q − 4)`, 3-bit `q`, 6-bit `sc_j` per 16 values of a 256-value block.
    Q3K,
    /// `d·level[q]`, 4-bit `q` indexing IQ4's 16 non-linear levels.
    IQ4NL,
    /// `d·(ls_j − 32)·level[q]`, IQ4_NL's levels, 6-bit `ls_j` per 32 values of a 256-value block.
    IQ4XS,
    /// `e8m0(e)·level[q]`, 4-bit `q` indexing the doubled e2m1 levels, a power-of-two scale.
    MXFP4,
    /// IQ2_XXS (2.06 bits a value): 8-value points of a 256-point grid, signs, a scale per 32.
    IQ2XXS,
    /// IQ2_XS (2.31 bits): a 512-point grid, a scale per 16.
    IQ2XS,
    /// IQ2_S (2.56 bits): a 1024-point grid, explicit signs, a scale per 16.
    IQ2S,
    /// IQ3_XXS (3.06 bits): 4-value points of a 256-point grid, a scale per 32.
    IQ3XXS,
    /// IQ3_S (3.44 bits): a 512-point grid, explicit signs, a scale per 32.
    IQ3S,
    /// IQ1_S (1.56 bits): 8-value ternary points shifted by ±1/8, a scale per 32.
    IQ1S,
    /// IQ1_M (1.75 bits): IQ1_S's grid, a shift per 8 values, a scale per 16.
    IQ1M,
    /// TQ1_0 (1.69 bits): ternary values five to a byte in base 3.
    TQ1_0,
    /// TQ2_0 (2.06 bits): ternary values in 2 bits each.
    TQ2_0,
}

impl Format {
    /// Every format, in the order `build_info()["tiled_types"]` lists them.
    pub const ALL: [Format; 21] = [
        Self::Q8_0,
        Self::Q4_0,
        Self::Q4_1,
        Self::Q5_0,
        Self::Q5_1,
        Self::Q3K,
        Self::Q4K,
        Self::Q5K,
        Self::Q6K,
        Self::IQ4NL,
        Self::IQ4XS,
        Self::MXFP4,
        Self::IQ1S,
        Self::IQ1M,
        Self::IQ2XXS,
        Self::IQ2XS,
        Self::IQ2S,
        Self::IQ3XXS,
        Self::IQ3S,
        Self::TQ1_0,
        Self::TQ2_0,
    ];

    /// The tile format of a ggml type, if there is one.
    pub fn of(dtype: GgmlDType) -> Option<Self> {
        Some(match dtype {
            GgmlDType::Q8_0 => Self::Q8_0,
            GgmlDType::Q4_0 => Self::Q4_0,
            GgmlDType::Q4_1 => Self::Q4_1,
            GgmlDType::Q5_0 => Self::Q5_0,
            GgmlDType::Q5_1 => Self::Q5_1,
            GgmlDType::Q4K => Self::Q4K,
            GgmlDType::Q5K => Self::Q5K,
            GgmlDType::Q6K => Self::Q6K,
            GgmlDType::Q3K => Self::Q3K,
            _ => return None,
        })
    }

    /// The tile format of a ggml type candle lacks (`extra_types`), if there is one.
    pub fn of_extra(ty: ExtraType) -> Option<Self> {
        Some(match ty {
            ExtraType::IQ4_NL => Self::IQ4NL,
            ExtraType::IQ4_XS => Self::IQ4XS,
            ExtraType::MXFP4 => Self::MXFP4,
            ExtraType::IQ2_XXS => Self::IQ2XXS,
            ExtraType::IQ2_XS => Self::IQ2XS,
            ExtraType::IQ2_S => Self::IQ2S,
            ExtraType::IQ3_XXS => Self::IQ3XXS,
            ExtraType::IQ3_S => Self::IQ3S,
            ExtraType::IQ1_S => Self::IQ1S,
            ExtraType::IQ1_M => Self::IQ1M,
            ExtraType::TQ1_0 => Self::TQ1_0,
            ExtraType::TQ2_0 => Self::TQ2_0,
        })
    }

    /// The ggml type, where candle holds it.
    pub fn dtype(self) -> Option<GgmlDType> {
        Some(match self {
            Self::Q8_0 => GgmlDType::Q8_0,
            Self::Q4_0 => GgmlDType::Q4_0,
            Self::Q4_1 => GgmlDType::Q4_1,
            Self::Q5_0 => GgmlDType::Q5_0,
            Self::Q5_1 => GgmlDType::Q5_1,
            Self::Q4K => GgmlDType::Q4K,
            Self::Q5K => GgmlDType::Q5K,
            Self::Q6K => GgmlDType::Q6K,
            Self::Q3K => GgmlDType::Q3K,
            _ => return None,
        })
    }

    /// The ggml type as llama.cpp spells it (`q4_k`, `iq4_xs`).
    pub fn name(self) -> &'static str {
        match self {
            Self::Q8_0 => "q8_0",
            Self::Q4_0 => "q4_0",
            Self::Q4_1 => "q4_1",
            Self::Q5_0 => "q5_0",
            Self::Q5_1 => "q5_1",
            Self::Q4K => "q4_k",
            Self::Q5K => "q5_k",
            Self::Q6K => "q6_k",
            Self::Q3K => "q3_k",
            Self::IQ4NL => "iq4_nl",
            Self::IQ4XS => "iq4_xs",
            Self::MXFP4 => "mxfp4",
            Self::IQ2XXS => "iq2_xxs",
            Self::IQ2XS => "iq2_xs",
            Self::IQ2S => "iq2_s",
            Self::IQ3XXS => "iq3_xxs",
            Self::IQ3S => "iq3_s",
            Self::IQ1S => "iq1_s",
            Self::IQ1M => "iq1_m",
            Self::TQ1_0 => "tq1_0",
            Self::TQ2_0 => "tq2_0",
        }
    }

    /// Whether this CPU multiplies `self`'s tiles fast: the one place that decides, per format,
    /// whether weights are repacked (Arm's kernels cover only some formats: `fast_path`).
    pub fn runs_fast(self) -> bool {
        fast_path(self).is_some()
    }

    /// Values of one source block.
    const fn block_values(self) -> usize {
        match self {
            Self::Q3K | Self::Q4K | Self::Q5K | Self::Q6K | Self::IQ4XS => k_quants::QK_K,
            _ if self.is_grid() => grid::QK_K,
            _ => QK,
        }
    }

    /// Source blocks' 32-value units: a tile's record holds this many of each row's units.
    const fn units_per_block(self) -> usize {
        self.block_values() / QK
    }

    /// Bytes of one source block.
    const fn block_bytes(self) -> usize {
        match self {
            Self::Q4K => k_quants::Q4K_BYTES,
            Self::Q5K => k_quants::Q5K_BYTES,
            Self::Q6K => k_quants::Q6K_BYTES,
            Self::Q3K => k_quants::Q3K_BYTES,
            Self::IQ2XXS | Self::TQ2_0 => 66,
            Self::IQ2XS => 74,
            Self::IQ2S => 82,
            Self::IQ3XXS => 98,
            Self::IQ3S => 110,
            Self::IQ1S => 50,
            Self::IQ1M => 56,
            Self::TQ1_0 => 54,
            _ => (self.header_bytes() + self.high_bytes()) / LANES + self.value_bytes(),
        }
    }

    /// Bytes of a block's values (Q5's low four bits).
    const fn value_bytes(self) -> usize {
        match self {
            Self::Q8_0 => QK,
            _ => self.block_values() / 2,
        }
    }

    /// Widths in bytes of a block's fields before its values (and Q5's fifth bits): a tile
    /// record holds field `f` of its 16 rows contiguously, in this order.
    const fn fields(self) -> &'static [usize] {
        match self {
            // d, m.
            Self::Q4_1 | Self::Q5_1 => &[2, 2],
            // d, the top two bits of the 8 scales, their low nibbles two to a byte.
            Self::IQ4XS => &i_quants::IQ4XS_FIELDS,
            // The E8M0 exponent.
            Self::MXFP4 => &[1],
            // d.
            _ => &[2],
        }
    }

    /// Bytes of a tile record's fields (scales, offsets) for its 16 rows.
    const fn header_bytes(self) -> usize {
        let (fields, mut i, mut bytes) = (self.fields(), 0, 0);
        while i < fields.len() {
            bytes += fields[i];
            i += 1;
        }
        bytes * LANES
    }

    /// Bytes of a 32-value tile record's fifth bits for its 16 rows (a `u32` a row in ggml's blocks).
    const fn high_bytes(self) -> usize {
        match self {
            Self::Q5_0 | Self::Q5_1 => LANES * 4,
            _ => 0,
        }
    }

    /// Where a 32-value tile record's values start.
    const fn values_at(self) -> usize {
        self.header_bytes() + self.high_bytes()
    }

    /// Whether values carry a float offset `m` (`d·q + m`) rather than a fixed integer one.
    const fn has_min(self) -> bool {
        matches!(self, Self::Q4_1 | Self::Q5_1 | Self::Q4K | Self::Q5K)
    }

    /// The fixed integer offset of the symmetric formats' stored values (the table formats':
    /// of the unsigned bytes the kernel maps their indices to, `level + 128`).
    const fn offset(self) -> i32 {
        match self {
            Self::Q8_0 => Q8_0_BIAS as i32,
            Self::IQ4NL | Self::IQ4XS | Self::MXFP4 => 128,
            Self::Q4_0 => 8,
            Self::Q5_0 => 16,
            Self::Q6K => 32,
            Self::Q3K => 4,
            Self::Q4_1 | Self::Q5_1 | Self::Q4K | Self::Q5K => 0,
            // Decoded (`grid.rs`) to values plus 128.
            _ => 128,
        }
    }

    /// Bytes of one tile record: 16 source blocks.
    const fn record_bytes(self) -> usize {
        LANES * self.block_bytes()
    }

    /// The 16 levels the table formats' 4-bit values index.
    fn levels(self) -> Option<&'static [i8; 16]> {
        match self {
            Self::IQ4NL | Self::IQ4XS => Some(&crate::extra_types::KVALUES_IQ4NL),
            Self::MXFP4 => Some(&crate::extra_types::KVALUES_MXFP4),
            _ => None,
        }
    }

    /// Writes row `lane`'s source `block` into its place in a tile `record` (zeroed before).
    fn place(self, block: &[u8], lane: usize, record: &mut [u8]) {
        match self {
            Self::Q4K => return k_quants::place_q4k(block, lane, record),
            Self::Q5K => return k_quants::place_q5k(block, lane, record),
            Self::Q6K => return k_quants::place_q6k(block, lane, record),
            Self::Q3K => return k_quants::place_q3k(block, lane, record),
            _ if self.is_grid() => return grid::place(self, block, lane, record),
            _ => {}
        }
        let (header, rest) = record.split_at_mut(self.header_bytes());
        let (high, values) = rest.split_at_mut(self.high_bytes());
        let (fields, qs) = block.split_at(block.len() - self.value_bytes());
        let (mut fields, qh) = fields.split_at(self.header_bytes() / LANES);
        // Each field of the 16 rows is contiguous.
        let mut at = 0;
        for &width in self.fields() {
            let (field, rest) = fields.split_at(width);
            header[at + lane * width..][..width].copy_from_slice(field);
            (fields, at) = (rest, at + LANES * width);
        }
        // Bit i of a Q5 block's `qh` is value i's fifth bit: group g's bits t go to bit
        // 4·lane + t of mask g.
        if let Ok(qh) = <[u8; 4]>::try_from(qh) {
            let qh = u32::from_le_bytes(qh);
            for (g, mask) in high.chunks_exact_mut(8).enumerate() {
                set_high_bits(mask, lane, ((qh >> (4 * g)) & 0xF) as u8);
            }
        }
        // Vector j: bytes 4j..4j + 4 of each row (a 256-value block's 32-value unit u in vectors
        // 4u..4u + 4).
        for (j, quad) in qs.chunks_exact(4).enumerate() {
            let at = (j * LANES + lane) * 4;
            for (o, &q) in values[at..at + 4].iter_mut().zip(quad) {
                *o = if self == Self::Q8_0 { q ^ Q8_0_BIAS } else { q };
            }
        }
    }
}

/// What Q8_0's stored bytes add to `q`: 128 (a flip of the sign bit) on x86, for `vpdpbusd`'s
/// unsigned operand; nothing elsewhere (Arm's `sdot` multiplies signed bytes, and a flip back in
/// registers would cost one instruction per weight vector).
const Q8_0_BIAS: u8 = if cfg!(target_arch = "x86_64") { 0x80 } else { 0 };

/// Whether this CPU runs the tiled kernels fast (AVX-512 VNNI and BW, or AVX2 with FMA and F16C,
/// on x86; `sdot` on Arm); elsewhere weights stay in ggml's layout for candle's kernels and
/// `int8_gemm`.
pub fn available() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        avx512() || avx2()
    }
    #[cfg(target_arch = "aarch64")]
    {
        super::arm::Features::get().dotprod
    }
    #[cfg(not(any(target_arch = "x86_64", target_arch = "aarch64")))]
    {
        false
    }
}

/// Whether this CPU runs the AVX-512 tiles (the nibble unpacking needs AVX-512 BW besides the
/// VNNI dot product).
#[cfg(target_arch = "x86_64")]
fn avx512() -> bool {
    super::int8_gemm::best_path() == Path::Avx512Vnni && is_x86_feature_detected!("avx512bw")
}

/// Whether this CPU runs the AVX2 tiles (`avx2.rs`).
#[cfg(target_arch = "x86_64")]
fn avx2() -> bool {
    is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma") && is_x86_feature_detected!("f16c")
}

/// The SIMD path that multiplies `format`'s tiles on this CPU, if there is one: weights are
/// repacked only then. x86 (AVX-512 VNNI or AVX2) has kernels for every format; Arm for some
/// (`neon::runs`), the others staying in ggml's layout there.
#[cfg_attr(target_arch = "x86_64", allow(unused_variables))]
pub fn fast_path(format: Format) -> Option<Path> {
    if !available() {
        return None;
    }
    #[cfg(target_arch = "x86_64")]
    {
        Some(if avx512() { Path::Avx512Vnni } else { Path::Avx2 })
    }
    #[cfg(target_arch = "aarch64")]
    {
        neon::runs(format).then_some(Path::NeonDot)
    }
    #[cfg(not(any(target_arch = "x86_64", target_arch = "aarch64")))]
    {
        let _ = format;
        None
    }
}

/// Whether this CPU has AVX-512 VBMI's `vpermb`, which maps the table formats' nibbles to their
/// levels without masking them first (Ice Lake, Sapphire Rapids, Zen 4; not Cascade Lake, which
/// has VNNI).
fn vbmi() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        avx512() && is_x86_feature_detected!("avx512vbmi")
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

/// ORs row `lane`'s four high bits `nibble` (bit `t`: value `t` of its group of 4) into a
/// 64-bit mask (8 little-endian bytes) at bits `4·lane..4·lane + 4`.
fn set_high_bits(mask: &mut [u8], lane: usize, nibble: u8) {
    mask[lane / 2] |= nibble << (4 * (lane % 2));
}

/// Row `lane`'s high bit of value `t` of its group of 4 in a 64-bit mask.
fn high_bit(mask: &[u8], lane: usize, t: usize) -> u8 {
    (mask[lane / 2] >> (4 * (lane % 2) + t)) & 1
}

/// One row's 32 values of a tile: value `i` is `(d·scale[i / 16])·q[i] + m` (the symmetric
/// formats' offsets applied to `q`, their `m` zero and their scales 1, as ggml de-quantizes).
struct Unit {
    d: f32,
    m: f32,
    scale: [i32; 2],
    q: [i32; QK],
}

/// Row `lane`'s half-precision field of a record whose 16 rows' fields start at `at`.
fn half(record: &[u8], at: usize, lane: usize) -> f32 {
    f16::from_le_bytes([record[at + lane * 2], record[at + lane * 2 + 1]]).to_f32()
}

/// A `[n, k]` weight in 16-row tiles (the last tile padded with zero rows).
#[derive(Debug)]
pub struct Interleaved {
    format: Format,
    n: usize,
    k: usize,
    /// `tiles × blocks` records.
    data: Vec<u8>,
}

impl Interleaved {
    /// Builds the tiles of `n` rows of `k` values of `format` blocks in ggml's layout, whose
    /// bytes from `offset` on `read(offset, buf)` fills `buf` with. The bytes go from a small
    /// buffer per task straight to their place in the tiles: a weight is never held twice, and
    /// its memory is written once.
    pub fn read(
        format: Format,
        n: usize,
        k: usize,
        read: impl Fn(usize, &mut [u8]) -> Result<(), String> + Sync,
    ) -> Result<Self, String> {
        let qk = format.block_values();
        if k == 0 || !k.is_multiple_of(qk) {
            return Err(format!("rows of {k} values are not whole {qk}-value blocks"));
        }
        let nb = k / qk;
        let bb = format.block_bytes();
        let row_bytes = nb * bb;
        let tiles = n.div_ceil(LANES);
        let size = tiles.checked_mul(nb * format.record_bytes());
        let size =
            size.filter(|&s| s <= isize::MAX as usize).ok_or_else(|| format!("{n} rows of {k} values overflow"))?;
        // Zeroed memory the OS hands over untouched; all-zero blocks (scale 0) pad the last tile.
        // Small pages: transparent huge ones (asked for with madvise) made loads slower and
        // more variable on this project's virtual machines, where a fresh 2 MiB block is likely
        // one the host has taken back (BENCHMARKS.md).
        let mut data = vec![0u8; size];
        let tile_bytes = nb * format.record_bytes();
        // Enough tiles a task for one read of about 64 KiB.
        let per_task = (64usize << 10).div_ceil(tile_bytes.max(1)).max(1);
        let buffers = || (Vec::new(), vec![0u8; format.record_bytes()]);
        data.par_chunks_mut(per_task * tile_bytes).enumerate().try_for_each_init(
            buffers,
            |(source, record), (i, out)| {
                let row0 = i * per_task * LANES;
                let rows = (n - row0).min(per_task * LANES);
                source.resize(rows * row_bytes, 0);
                read(row0 * row_bytes, source)?;
                for (t, tile) in out.chunks_exact_mut(tile_bytes).enumerate() {
                    let lanes = (rows - t * LANES).min(LANES);
                    for (b, dst) in tile.chunks_exact_mut(format.record_bytes()).enumerate() {
                        // Assembled in cache and written once: building a record in place reads
                        // fresh pages before writing them, which faults each of them in twice.
                        record.fill(0);
                        for lane in 0..lanes {
                            format.place(&source[((t * LANES + lane) * nb + b) * bb..][..bb], lane, record);
                        }
                        dst.copy_from_slice(record);
                    }
                }
                Ok::<(), String>(())
            },
        )?;
        Ok(Self { format, n, k, data })
    }

    /// Repacks `n` rows of `k` values of `format` blocks held in `blocks` (ggml's layout).
    pub fn repack(format: Format, blocks: &[u8], n: usize, k: usize) -> Result<Self, String> {
        // Rows that are not whole blocks are refused by `read`.
        let expected = (k / format.block_values() * format.block_bytes()).checked_mul(n);
        if expected != Some(blocks.len()) {
            return Err(format!("{} bytes for {n} rows of {k} {format:?} values", blocks.len()));
        }
        Self::read(format, n, k, |offset, buf| {
            buf.copy_from_slice(&blocks[offset..offset + buf.len()]);
            Ok(())
        })
    }

    /// Weights of one format and width stacked into one whose outputs are theirs side by side
    /// (a layer's query, key and value projections as one product: one activation quantization
    /// and one parallel pass instead of three). A tile holds `LANES` rows, so every part but the
    /// last must fill its tiles; `None` where they do not, or differ in format or width.
    pub fn stack(parts: &[&Interleaved]) -> Option<Interleaved> {
        let first = parts.first()?;
        let fits = |w: &&Interleaved| w.format == first.format && w.k == first.k;
        let whole = parts[..parts.len() - 1].iter().all(|w| w.n.is_multiple_of(LANES));
        if !parts.iter().all(fits) || !whole {
            return None;
        }
        let mut data = Vec::with_capacity(parts.iter().map(|w| w.data.len()).sum());
        parts.iter().for_each(|w| data.extend_from_slice(&w.data));
        let n = parts.iter().map(|w| w.n).sum();
        Some(Self { format: first.format, n, k: first.k, data })
    }

    /// `(rows, values per row)` of the original weight.
    pub fn shape(&self) -> (usize, usize) {
        (self.n, self.k)
    }

    /// The block format.
    pub fn format(&self) -> Format {
        self.format
    }

    /// Source blocks in a row.
    fn blocks(&self) -> usize {
        self.k / self.format.block_values()
    }

    fn tiles(&self) -> usize {
        self.n.div_ceil(LANES)
    }

    /// The record of tile `t`, block `b`.
    fn record(&self, t: usize, b: usize) -> &[u8] {
        let size = self.format.record_bytes();
        &self.data[(t * self.blocks() + b) * size..][..size]
    }

    /// Row `lane` of tile `t`, values `32·u..32·u + 32`.
    fn unpack(&self, t: usize, u: usize, lane: usize) -> Unit {
        let per_block = self.format.units_per_block();
        let (record, part) = (self.record(t, u / per_block), u % per_block);
        match self.format {
            Format::Q4K => return k_quants::unpack_q4k(record, lane, part),
            Format::Q5K => return k_quants::unpack_q5k(record, lane, part),
            Format::Q6K => return k_quants::unpack_q6k(record, lane, part),
            Format::Q3K => return k_quants::unpack_q3k(record, lane, part),
            _ => {}
        }
        let field = |f: usize| half(record, f * HALVES, lane);
        let high = &record[self.format.header_bytes()..self.format.values_at()];
        let values = &record[self.format.values_at() + part * QK / 2 * LANES..];
        let levels = self.format.levels();
        let mut q = [0i32; QK];
        for (i, v) in q.iter_mut().enumerate() {
            let (j, t) = (i / 4, i % 4);
            *v = match self.format {
                // `q + 128` as an unsigned byte on x86, `q` as a signed one elsewhere.
                Format::Q8_0 if Q8_0_BIAS == 0 => values[(j * LANES + lane) * 4 + t] as i8 as i32,
                Format::Q8_0 => values[(j * LANES + lane) * 4 + t] as i32,
                // Byte i of a Q4 block holds value i (low nibble) and value i + 16 (high).
                _ if j < 4 => (values[(j * LANES + lane) * 4 + t] & 0x0F) as i32,
                _ => (values[((j - 4) * LANES + lane) * 4 + t] >> 4) as i32,
            };
            if !high.is_empty() {
                *v |= (high_bit(&high[j * 8..], lane, t) as i32) << 4;
            }
            *v = match levels {
                Some(levels) => levels[*v as usize] as i32,
                None => *v - self.format.offset(),
            };
        }
        let m = if self.format.has_min() { field(1) } else { 0.0 };
        let (d, scale) = match self.format {
            Format::MXFP4 => (crate::extra_types::e8m0_half(record[lane]), [1, 1]),
            Format::IQ4XS => (field(0), [i_quants::iq4xs_scale(record, lane, part); 2]),
            _ => (field(0), [1, 1]),
        };
        Unit { d, m, scale, q }
    }

    /// Row `r` de-quantized into `out` (`k` values): an embedding lookup.
    pub fn row_into(&self, r: usize, out: &mut [f32]) {
        if self.format.is_grid() {
            return grid::row_into(self, r, out);
        }
        let (t, lane) = (r / LANES, r % LANES);
        for (u, chunk) in out.chunks_exact_mut(QK).enumerate() {
            let Unit { d, m, scale, q } = self.unpack(t, u, lane);
            for (i, (o, q)) in chunk.iter_mut().zip(q).enumerate() {
                let d = d * scale[i / 16] as f32;
                *o = if self.format.has_min() { d * q as f32 + m } else { d * q as f32 };
            }
        }
    }

    /// `x [m, k] · Wᵀ` as `[m, n]`, on the fastest path this CPU has.
    pub fn matmul(&self, x: &[f32], m: usize) -> Vec<f32> {
        self.matmul_with(x, m, fast_path(self.format).unwrap_or(Path::Portable))
    }

    /// `matmul` on a given path (at most what this CPU runs for the format: the tests and the
    /// Arm instruction-count probe force each one).
    pub(crate) fn matmul_with(&self, x: &[f32], m: usize, path: Path) -> Vec<f32> {
        self.matmul_on(x, m, path, path == Path::Avx512Vnni && vbmi())
    }

    /// `matmul_with`, the table formats' AVX-512 kernel with (`vbmi`) or without `vpermb`.
    #[cfg_attr(not(target_arch = "x86_64"), allow(unused_variables))]
    fn matmul_on(&self, x: &[f32], m: usize, path: Path, vbmi: bool) -> Vec<f32> {
        assert_eq!(x.len(), m * self.k);
        // What makes the SIMD kernels below safe to enter.
        assert!(
            path == Path::Portable || Some(path) == fast_path(self.format),
            "{path:?} does not run {:?} here",
            self.format
        );
        let xq = quantize_rows(x);
        // Q6_K's and Q3_K's scales change every 16 values: their offsets need the activations'
        // sums per 16.
        #[cfg(any(target_arch = "x86_64", target_arch = "aarch64"))]
        let half_sums = if matches!(self.format, Format::Q6K | Format::Q3K) || self.format.is_grid() {
            k_quants::half_sums(&xq.values)
        } else {
            Vec::new()
        };
        let mut out = vec![0f32; m * self.n];
        let ptr = super::OutPtr(out.as_mut_ptr());
        // Work items are pairs of tiles (32 output columns) over every activation row.
        let pairs = self.tiles().div_ceil(2);
        super::parallel_for(pairs, |p| {
            // The closure must capture the whole `Send` wrapper, not its raw-pointer field.
            #[allow(clippy::redundant_locals)]
            let ptr = ptr;
            let t0 = p * 2;
            let tiles = 2.min(self.tiles() - t0);
            match path {
                #[cfg(target_arch = "x86_64")]
                Path::Avx512Vnni => {
                    // SAFETY: AVX-512 VNNI and BW were detected; indices stay inside the weight,
                    // the quantized rows and the output by construction.
                    unsafe {
                        match self.format {
                            Format::Q8_0 => x86::columns::<Q8_0>(self, &xq, m, t0, tiles, ptr.0),
                            Format::Q4_0 => x86::columns::<Q4_0>(self, &xq, m, t0, tiles, ptr.0),
                            Format::Q4_1 => x86::columns::<Q4_1>(self, &xq, m, t0, tiles, ptr.0),
                            Format::Q5_0 => x86::columns::<Q5_0>(self, &xq, m, t0, tiles, ptr.0),
                            Format::Q5_1 => x86::columns::<Q5_1>(self, &xq, m, t0, tiles, ptr.0),
                            Format::Q4K => k_quants::x86::q4k_columns::<Q4K>(self, &xq, m, t0, tiles, ptr.0),
                            Format::Q5K => k_quants::x86::q4k_columns::<Q5K>(self, &xq, m, t0, tiles, ptr.0),
                            Format::Q6K => {
                                k_quants::x86::q6k_columns::<Q6K>(self, &xq, &half_sums, m, t0, tiles, ptr.0)
                            }
                            Format::Q3K => {
                                k_quants::x86::q6k_columns::<Q3K>(self, &xq, &half_sums, m, t0, tiles, ptr.0)
                            }
                            // SAFETY (as above, and): `vbmi` only where AVX-512 VBMI was detected.
                            Format::IQ4NL if vbmi => x86::columns_vbmi::<IQ4NL>(self, &xq, m, t0, tiles, ptr.0),
                            Format::IQ4XS if vbmi => x86::columns_vbmi::<IQ4XS>(self, &xq, m, t0, tiles, ptr.0),
                            Format::MXFP4 if vbmi => x86::columns_vbmi::<MXFP4>(self, &xq, m, t0, tiles, ptr.0),
                            Format::IQ4NL => x86::columns::<IQ4NL>(self, &xq, m, t0, tiles, ptr.0),
                            Format::IQ4XS => x86::columns::<IQ4XS>(self, &xq, m, t0, tiles, ptr.0),
                            Format::MXFP4 => x86::columns::<MXFP4>(self, &xq, m, t0, tiles, ptr.0),
                            _ => grid::x86::columns(self, &xq, &half_sums, m, t0, tiles, ptr.0),
                        }
                    }
                }
                #[cfg(target_arch = "x86_64")]
                Path::Avx2 => {
                    // SAFETY: AVX2, FMA and F16C were detected (`fast_path`, asserted above);
                    // indices stay inside the weight, the quantized rows and the output.
                    unsafe {
                        match self.format {
                            Format::Q8_0 => avx2::columns::<Q8_0>(self, &xq, m, t0, tiles, ptr.0),
                            Format::Q4_0 => avx2::columns::<Q4_0>(self, &xq, m, t0, tiles, ptr.0),
                            Format::Q4_1 => avx2::columns::<Q4_1>(self, &xq, m, t0, tiles, ptr.0),
                            Format::Q5_0 => avx2::columns::<Q5_0>(self, &xq, m, t0, tiles, ptr.0),
                            Format::Q5_1 => avx2::columns::<Q5_1>(self, &xq, m, t0, tiles, ptr.0),
                            Format::IQ4NL => avx2::columns::<IQ4NL>(self, &xq, m, t0, tiles, ptr.0),
                            Format::IQ4XS => avx2::columns::<IQ4XS>(self, &xq, m, t0, tiles, ptr.0),
                            Format::MXFP4 => avx2::columns::<MXFP4>(self, &xq, m, t0, tiles, ptr.0),
                            Format::Q4K => k_quants::avx2::q4k_columns::<Q4K>(self, &xq, m, t0, tiles, ptr.0),
                            Format::Q5K => k_quants::avx2::q4k_columns::<Q5K>(self, &xq, m, t0, tiles, ptr.0),
                            Format::Q6K => {
                                k_quants::avx2::q6k_columns::<Q6K>(self, &xq, &half_sums, m, t0, tiles, ptr.0)
                            }
                            Format::Q3K => {
                                k_quants::avx2::q6k_columns::<Q3K>(self, &xq, &half_sums, m, t0, tiles, ptr.0)
                            }
                            _ if self.format.is_grid() => grid::avx2::columns(self, &xq, m, t0, tiles, ptr.0),
                            _ => self.portable_columns(&xq, m, t0, tiles, ptr),
                        }
                    }
                }
                #[cfg(target_arch = "aarch64")]
                Path::NeonDot => {
                    // SAFETY: dotprod was detected (`fast_path`, asserted above); indices stay
                    // inside the weight, the quantized rows and the output by construction.
                    unsafe {
                        match self.format {
                            Format::Q8_0 => neon::columns::<Q8_0>(self, &xq, m, t0, tiles, ptr.0),
                            Format::Q4_0 => neon::columns::<Q4_0>(self, &xq, m, t0, tiles, ptr.0),
                            Format::Q4_1 => neon::columns::<Q4_1>(self, &xq, m, t0, tiles, ptr.0),
                            Format::Q5_0 => neon::columns::<Q5_0>(self, &xq, m, t0, tiles, ptr.0),
                            Format::Q5_1 => neon::columns::<Q5_1>(self, &xq, m, t0, tiles, ptr.0),
                            Format::Q4K => k_quants::neon::q4k_columns::<Q4K>(self, &xq, m, t0, tiles, ptr.0),
                            Format::Q5K => k_quants::neon::q4k_columns::<Q5K>(self, &xq, m, t0, tiles, ptr.0),
                            Format::Q6K => {
                                k_quants::neon::q6k_columns::<Q6K>(self, &xq, &half_sums, m, t0, tiles, ptr.0)
                            }
                            Format::Q3K => {
                                k_quants::neon::q6k_columns::<Q3K>(self, &xq, &half_sums, m, t0, tiles, ptr.0)
                            }
                            _ if self.format.is_grid() => grid::neon::columns(self, &xq, m, t0, tiles, ptr.0),
                            // A format without a NEON kernel is never repacked on Arm (`neon::runs`).
                            #[allow(unreachable_patterns)]
                            _ => self.portable_columns(&xq, m, t0, tiles, ptr),
                        }
                    }
                }
                _ if self.format.is_grid() => grid::portable_columns(self, &xq, m, t0, tiles, ptr),
                _ => self.portable_columns(&xq, m, t0, tiles, ptr),
            }
        });
        out
    }

    /// Tiles `t0..t0 + tiles` against every activation row, in plain Rust.
    fn portable_columns(&self, xq: &QuantizedRows, m: usize, t0: usize, tiles: usize, out: super::OutPtr) {
        let units = self.k / QK;
        for t in t0..t0 + tiles {
            for lane in 0..LANES.min(self.n - t * LANES) {
                for r in 0..m {
                    let mut total = 0f32;
                    for u in 0..units {
                        let Unit { d, m, scale, q } = self.unpack(t, u, lane);
                        let xi = r * units + u;
                        let xs = &xq.values[xi * QK..(xi + 1) * QK];
                        let dot = |h: usize| -> i32 {
                            q[h * 16..][..16].iter().zip(&xs[h * 16..][..16]).map(|(&w, &x)| w * x as i32).sum()
                        };
                        let dot = scale[0] * dot(0) + scale[1] * dot(1);
                        total += dot as f32 * (d * xq.scales[xi]) + m * xq.sums[xi];
                    }
                    // SAFETY: this worker alone writes the columns of tiles t0..t0 + tiles.
                    unsafe { *out.0.add(r * self.n + t * LANES + lane) = total };
                }
            }
        }
    }
}

/// Format tags for the SIMD tile, as const generics.
#[cfg(any(target_arch = "x86_64", target_arch = "aarch64"))]
mod tags {
    pub(super) const Q8_0: u8 = 0;
    pub(super) const Q4_0: u8 = 1;
    pub(super) const Q4_1: u8 = 2;
    pub(super) const Q5_0: u8 = 3;
    pub(super) const Q5_1: u8 = 4;
    pub(super) const Q4K: u8 = 5;
    pub(super) const Q5K: u8 = 6;
    pub(super) const Q6K: u8 = 7;
    pub(super) const Q3K: u8 = 8;
    // The table formats have x86 kernels only.
    #[cfg(target_arch = "x86_64")]
    pub(super) const IQ4NL: u8 = 9;
    #[cfg(target_arch = "x86_64")]
    pub(super) const IQ4XS: u8 = 10;
    #[cfg(target_arch = "x86_64")]
    pub(super) const MXFP4: u8 = 11;
}
#[cfg(any(target_arch = "x86_64", target_arch = "aarch64"))]
use tags::*;

#[cfg(target_arch = "x86_64")]
mod x86 {
    use super::*;
    use std::arch::x86_64::*;

    /// Tiles `t0..t0 + tiles` (1 or 2) of format `F` against every activation row, 4 rows at a time.
    #[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
    pub(super) unsafe fn columns<const F: u8>(
        w: &Interleaved,
        xq: &QuantizedRows,
        m: usize,
        t0: usize,
        tiles: usize,
        out: *mut f32,
    ) {
        columns_with::<F, false>(w, xq, m, t0, tiles, out)
    }

    /// `columns` for the table formats on a CPU with AVX-512 VBMI: their nibbles go through
    /// `vpermb`, which reads six index bits, against the 16 levels repeated four times, so the
    /// masks before the lookup go: a weight vector decodes in 3 operations, as Q4_0's does, not
    /// 5. One thread, CPU time, [128, 1024] x [1024 -> 4096] against the Q8_0 tiles of the same
    /// values: 0.83-0.91x without, 0.89-0.97x with.
    #[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni,avx512vbmi")]
    pub(super) unsafe fn columns_vbmi<const F: u8>(
        w: &Interleaved,
        xq: &QuantizedRows,
        m: usize,
        t0: usize,
        tiles: usize,
        out: *mut f32,
    ) {
        columns_with::<F, true>(w, xq, m, t0, tiles, out)
    }

    #[inline(always)]
    unsafe fn columns_with<const F: u8, const VBMI: bool>(
        w: &Interleaved,
        xq: &QuantizedRows,
        m: usize,
        t0: usize,
        tiles: usize,
        out: *mut f32,
    ) {
        // The table formats decode a weight vector in 5 operations where Q4_0 takes 3: one
        // tile at a time over 8 rows spreads them over twice the products.
        if (F == IQ4NL || F == IQ4XS || F == MXFP4) && m >= 8 {
            for t in t0..t0 + tiles {
                let mut eights = 0;
                while eights + 8 <= m {
                    tile::<F, VBMI, 8, 1>(w, xq, eights, t, out);
                    eights += 8;
                }
                rows_by_four!(m, eights, |R, row0| tile::<F, VBMI, R, 1>(w, xq, row0, t, out));
            }
            return;
        }
        if tiles == 2 {
            rows_by_four!(m, 0, |R, row0| tile::<F, VBMI, R, 2>(w, xq, row0, t0, out))
        } else {
            rows_by_four!(m, 0, |R, row0| tile::<F, VBMI, R, 1>(w, xq, row0, t0, out))
        }
    }

    /// Activation rows `row0..row0 + R` times the 16·G weight rows of tiles `t0..t0 + G`, one
    /// 32-value unit at a time (an IQ4_XS record holds 8). Two sets of integer sums (alternate
    /// groups of 4 for Q8_0, low and high nibbles for the 4-bit formats) give a one-row tile
    /// independent `vpdpbusd` chains to overlap.
    #[inline(always)]
    unsafe fn tile<const F: u8, const VBMI: bool, const R: usize, const G: usize>(
        w: &Interleaved,
        xq: &QuantizedRows,
        row0: usize,
        t0: usize,
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
        let levels = if lookup { i_quants::x86::levels(w.format) } else { _mm512_setzero_si512() };
        let nibble = _mm512_set1_epi8(0x0F);
        let sixteen = _mm512_set1_epi8(16);
        let mut acc = [[_mm512_setzero_ps(); G]; R];
        for u in 0..units {
            let (b, part) = (u / per_block, u % per_block);
            let records: [*const u8; G] = std::array::from_fn(|g| w.data.as_ptr().add(((t0 + g) * nb + b) * size));
            let values = w.format.values_at() + part * QK / 2 * LANES;
            let xs: [*const u8; R] =
                std::array::from_fn(|r| xq.values.as_ptr().add(((row0 + r) * units + u) * QK) as *const u8);
            let x4 = |r: usize, j: usize| _mm512_set1_epi32((xs[r].add(j * 4) as *const i32).read_unaligned());
            // The symmetric formats' integer sums start at -offset·Σq_x, undoing the offset.
            let mut even = [[_mm512_setzero_si512(); G]; R];
            let mut odd = [[_mm512_setzero_si512(); G]; R];
            if !asymmetric {
                let offset = -w.format.offset();
                for r in 0..R {
                    let start = _mm512_set1_epi32(offset * *xq.qsums.get_unchecked((row0 + r) * units + u));
                    for g in 0..G {
                        even[r][g] = start;
                    }
                }
            }
            if F == Q8_0 {
                for j in (0..QK / 4).step_by(2) {
                    // As in `k_quants::x86::q6k_tile`.
                    if R == 1 {
                        for rec in records {
                            prefetch_next(rec, size, j / 2, QK / 8);
                        }
                    }
                    let wa: [__m512i; G] =
                        std::array::from_fn(|g| _mm512_loadu_si512(records[g].add(values + j * 64) as *const _));
                    let wb: [__m512i; G] =
                        std::array::from_fn(|g| _mm512_loadu_si512(records[g].add(values + (j + 1) * 64) as *const _));
                    for r in 0..R {
                        let (xa, xb) = (x4(r, j), x4(r, j + 1));
                        for g in 0..G {
                            even[r][g] = _mm512_dpbusd_epi32(even[r][g], wa[g], xa);
                            odd[r][g] = _mm512_dpbusd_epi32(odd[r][g], wb[g], xb);
                        }
                    }
                }
            } else {
                // Byte j of a Q4 block holds value j (low nibble) and value j + 16 (high).
                for j in 0..QK / 8 {
                    if R == 1 {
                        for rec in records {
                            prefetch_next(rec, size, part * QK / 8 + j, per_block * QK / 8);
                        }
                    }
                    let packed: [__m512i; G] =
                        std::array::from_fn(|g| _mm512_loadu_si512(records[g].add(values + j * 64) as *const _));
                    let (mut lo, mut hi): ([__m512i; G], [__m512i; G]) = if lookup && VBMI {
                        // `vpermb` reads the low six bits of each index: against the levels
                        // repeated four times, a byte's other nibble (or the neighbour's bits
                        // a 16-bit shift brings in) selects the same level.
                        (
                            std::array::from_fn(|g| _mm512_permutexvar_epi8(packed[g], levels)),
                            std::array::from_fn(|g| _mm512_permutexvar_epi8(_mm512_srli_epi16(packed[g], 4), levels)),
                        )
                    } else {
                        (
                            std::array::from_fn(|g| _mm512_and_si512(packed[g], nibble)),
                            std::array::from_fn(|g| _mm512_and_si512(_mm512_srli_epi16(packed[g], 4), nibble)),
                        )
                    };
                    if five {
                        for g in 0..G {
                            lo[g] = with_high_bits(lo[g], records[g].add(header), j, sixteen);
                            hi[g] = with_high_bits(hi[g], records[g].add(header), j + 4, sixteen);
                        }
                    }
                    if lookup && !VBMI {
                        for g in 0..G {
                            lo[g] = _mm512_shuffle_epi8(levels, lo[g]);
                            hi[g] = _mm512_shuffle_epi8(levels, hi[g]);
                        }
                    }
                    for r in 0..R {
                        let (xa, xb) = (x4(r, j), x4(r, j + 4));
                        for g in 0..G {
                            even[r][g] = _mm512_dpbusd_epi32(even[r][g], lo[g], xa);
                            odd[r][g] = _mm512_dpbusd_epi32(odd[r][g], hi[g], xb);
                        }
                    }
                }
            }
            let wd: [__m512; G] = std::array::from_fn(|g| {
                if F == MXFP4 {
                    i_quants::x86::e8m0_scales(records[g])
                } else {
                    let d = _mm512_cvtph_ps(_mm256_loadu_si256(records[g] as *const __m256i));
                    // IQ4_XS: d·(ls − 32) once for every row (exact: a half times a 6-bit
                    // integer), as the k-quants apply their sub-block scales; the integer sums
                    // (under 2^24) go to float as they are.
                    if F == IQ4XS {
                        _mm512_mul_ps(d, _mm512_cvtepi32_ps(i_quants::x86::iq4xs_scales(records[g], part)))
                    } else {
                        d
                    }
                }
            });
            let wm: [__m512; G] = std::array::from_fn(|g| {
                if asymmetric {
                    _mm512_cvtph_ps(_mm256_loadu_si256(records[g].add(HALVES) as *const __m256i))
                } else {
                    _mm512_setzero_ps()
                }
            });
            for r in 0..R {
                let xi = (row0 + r) * units + u;
                let xd = _mm512_set1_ps(*xq.scales.get_unchecked(xi));
                let xs = _mm512_set1_ps(*xq.sums.get_unchecked(xi));
                for g in 0..G {
                    let sum = _mm512_cvtepi32_ps(_mm512_add_epi32(even[r][g], odd[r][g]));
                    acc[r][g] = _mm512_fmadd_ps(sum, _mm512_mul_ps(wd[g], xd), acc[r][g]);
                    if asymmetric {
                        acc[r][g] = _mm512_fmadd_ps(wm[g], xs, acc[r][g]);
                    }
                }
            }
        }
        for r in 0..R {
            for g in 0..G {
                store(acc[r][g], out, row0 + r, w.n, (t0 + g) * LANES);
            }
        }
    }

    /// Asks the cache for part `step` of `steps` of the first `size`-byte record at least 3 KiB
    /// ahead of the one at `rec` in memory (later blocks of its tile, then the next tile's):
    /// one record ahead for Q6_K, two for the other k-quants, 6 to 11 for the 32-value formats.
    /// One activation row reads each weight byte once and does little with it, so the kernel
    /// waits on memory unless the bytes are on their way; the hardware prefetchers do not keep
    /// up, least of all with a kernel that reads a record's vectors out of order. One thread,
    /// [1, 1024] x [1024 -> 151936]: Q6_K 15.0 -> 4.8-5.6 ms, Q4_K 6.1 -> 3.2, Q4_0 5.7 -> 3.4,
    /// Q8_0 10.3 -> 6.3 (1.5 KiB ahead: 8.2-11). Spread over a record's steps, the requests
    /// stay few at a time. `wrapping_add`: past the weight's end a prefetch is harmless, a
    /// pointer offset is not.
    #[inline(always)]
    pub(super) unsafe fn prefetch_next(rec: *const u8, size: usize, step: usize, steps: usize) {
        const PREFETCH_BYTES: usize = 3072;
        let lines = size.div_ceil(64).div_ceil(steps);
        let from = rec.wrapping_add(PREFETCH_BYTES.div_ceil(size) * size + step * lines * 64);
        for line in 0..lines {
            // Not `_mm_prefetch`: LLVM hoists those of an unrolled loop into one burst (32 at
            // the top of each half record), which fills the line buffers the loads need
            // (9.6 ms where these, left in place, take 5.0).
            std::arch::asm!(
                "prefetcht0 [{line}]",
                line = in(reg) from.wrapping_add(line * 64),
                options(nostack, preserves_flags, readonly)
            );
        }
    }

    /// `v` with `amount` added to the bytes that 64-bit mask `index` of the masks at `masks` selects.
    #[inline(always)]
    pub(super) unsafe fn with_high_bits(v: __m512i, masks: *const u8, index: usize, amount: __m512i) -> __m512i {
        _mm512_mask_add_epi8(v, (masks as *const u64).add(index).read_unaligned(), v, amount)
    }

    /// Writes a tile's 16 columns from `col` of output row `row` (of `n` columns): those that exist.
    #[inline(always)]
    pub(super) unsafe fn store(acc: __m512, out: *mut f32, row: usize, n: usize, col: usize) {
        let dst = out.add(row * n + col);
        if col + LANES <= n {
            _mm512_storeu_ps(dst, acc);
        } else {
            let mut lanes = [0f32; LANES];
            _mm512_storeu_ps(lanes.as_mut_ptr(), acc);
            std::ptr::copy_nonoverlapping(lanes.as_ptr(), dst, n - col);
        }
    }
}

/// The tiles on Arm with `sdot` by element (FEAT_DotProd). A 64-byte vector is four `int8x16_t`
/// quads of 4 rows each; one activation register holds 4 groups of 4 values, each the operand of
/// every quad's `sdot` for its group. With 4-column accumulators, 4 activation rows run over half
/// a tile at a time (`row_blocks`).
///
/// `smmla` (i8mm) is left out: it multiplies 8 consecutive values of 2 rows, where a tile holds
/// 4 of each row per vector, so each `smmla` would need a `zip` of two vectors first, and the
/// result lanes (2 × 2 pairs of activation and weight rows) a transpose before every block's
/// scaling. Counted per 8 values of 4 weight rows and `R` activation rows, `sdot` takes `2R`
/// instructions, `smmla` `R + 2`: nothing saved below 4 rows, a quarter of the dot products at 4,
/// which the unpacking and per-block scaling around them dilute to a few percent.
#[cfg(target_arch = "aarch64")]
mod neon {
    use super::*;
    use crate::arm::{sdot_lane, widen_f16x8};
    use std::arch::aarch64::*;

    /// Whether a NEON kernel multiplies `format`'s tiles: a format without one is not repacked on
    /// Arm (its weights stay in ggml's layout for candle's kernels).
    pub(super) fn runs(format: Format) -> bool {
        matches!(
            format,
            Format::Q8_0
                | Format::Q4_0
                | Format::Q4_1
                | Format::Q5_0
                | Format::Q5_1
                | Format::Q4K
                | Format::Q5K
                | Format::Q6K
                | Format::Q3K
        ) || format.is_grid()
    }

    /// `$body` four times with `$l` the literal lane 0, 1, 2, 3: `sdot`'s lane must be a
    /// constant, and a loop LLVM chose not to unroll would leave it a run-time switch.
    macro_rules! each_lane {
        ($l:ident => $body:block) => {{
            {
                let $l = 0usize;
                $body
            }
            {
                let $l = 1usize;
                $body
            }
            {
                let $l = 2usize;
                $body
            }
            {
                let $l = 3usize;
                $body
            }
        }};
    }
    pub(super) use each_lane;

    /// Runs `$call` (a tile of `$r` activation rows from `$row0` by weight quads `$v0..$v0 + $v`)
    /// over every activation row: 4 rows at a time over each half of the tile (their 8 integer
    /// and 8 float accumulators and 8 activation registers leave the weights 8 of the 32 NEON
    /// registers), the last 1-2 rows over the whole tile, 3 over halves.
    macro_rules! row_blocks {
        ($m:expr, |$r:ident, $v:ident, $row0:ident, $v0:ident| $call:expr) => {{
            let m = $m;
            let mut $row0 = 0;
            while $row0 + 4 <= m {
                const $r: usize = 4;
                const $v: usize = 2;
                // Each half written out: a loop over them, not unrolled, left `v0` a variable.
                {
                    let $v0 = 0;
                    $call
                }
                {
                    let $v0 = 2;
                    $call
                }
                $row0 += 4;
            }
            match m - $row0 {
                1 => {
                    const $r: usize = 1;
                    const $v: usize = 4;
                    let $v0 = 0;
                    $call
                }
                2 => {
                    const $r: usize = 2;
                    const $v: usize = 4;
                    let $v0 = 0;
                    $call
                }
                3 => {
                    const $r: usize = 3;
                    const $v: usize = 2;
                    {
                        let $v0 = 0;
                        $call
                    }
                    {
                        let $v0 = 2;
                        $call
                    }
                }
                _ => {}
            }
        }};
    }
    pub(super) use row_blocks;

    /// `acc + w·x[lane]`, `lane` a literal (`each_lane`).
    #[inline(always)]
    pub(super) unsafe fn dot_lane(acc: int32x4_t, w: uint8x16_t, x: int8x16_t, lane: usize) -> int32x4_t {
        // Unsigned values below 128 are the same signed.
        let w = vreinterpretq_s8_u8(w);
        match lane {
            0 => sdot_lane::<0>(acc, w, x),
            1 => sdot_lane::<1>(acc, w, x),
            2 => sdot_lane::<2>(acc, w, x),
            _ => sdot_lane::<3>(acc, w, x),
        }
    }

    /// Quads `v0..v0 + V` (`V` even) of the 16 rows' half-precision field at `p`, widened.
    #[inline(always)]
    pub(super) unsafe fn halves<const V: usize>(p: *const u8, v0: usize) -> [float32x4_t; V] {
        // Quad q's rows' fields are bytes 8q..8q + 8; `widen_f16x8` takes two quads.
        std::array::from_fn(|i| widen_f16x8(p.add((v0 + i / 2 * 2) * 8) as *const f16)[i % 2])
    }

    /// Quads `v0..v0 + V` of the 16 rows' bytes `b`, widened to 32 bits by `widen8` (16 rows to
    /// 2 × 8) and `widen16` (8 to 2 × 4; each takes the low half, or the high one if told).
    #[inline(always)]
    pub(super) unsafe fn quads<const V: usize, B: Copy, H: Copy>(
        b: B,
        v0: usize,
        widen8: impl Fn(B, bool) -> H,
        widen16: impl Fn(H, bool) -> int32x4_t,
    ) -> [int32x4_t; V] {
        std::array::from_fn(|i| {
            let q = v0 + i;
            widen16(widen8(b, q >= 2), q % 2 == 1)
        })
    }

    /// Quads `v0..v0 + V` of 16 unsigned bytes, as 32-bit lanes.
    #[inline(always)]
    pub(super) unsafe fn quads_u8<const V: usize>(b: uint8x16_t, v0: usize) -> [int32x4_t; V] {
        quads::<V, _, _>(
            b,
            v0,
            |b, high| if high { vmovl_high_u8(b) } else { vmovl_u8(vget_low_u8(b)) },
            |h, high| vreinterpretq_s32_u32(if high { vmovl_high_u16(h) } else { vmovl_u16(vget_low_u16(h)) }),
        )
    }

    /// Quads `v0..v0 + V` of 16 signed bytes, as 32-bit lanes.
    #[inline(always)]
    pub(super) unsafe fn quads_s8<const V: usize>(b: int8x16_t, v0: usize) -> [int32x4_t; V] {
        quads::<V, _, _>(
            b,
            v0,
            |b, high| if high { vmovl_high_s8(b) } else { vmovl_s8(vget_low_s8(b)) },
            |h, high| if high { vmovl_high_s16(h) } else { vmovl_s16(vget_low_s16(h)) },
        )
    }

    /// Quads `v` of a 64-byte vector with `amount` added to the bytes that 64-bit mask `index`
    /// of the masks at `masks` selects (bit `i` for byte `i`: quad `q`'s are bits `16q..16q + 16`).
    #[inline(always)]
    pub(super) unsafe fn with_high_bits<const V: usize>(
        v: [uint8x16_t; V],
        masks: *const u8,
        index: usize,
        v0: usize,
        amount: uint8x16_t,
    ) -> [uint8x16_t; V] {
        const BITS: [u8; 16] = [1, 2, 4, 8, 16, 32, 64, 128, 1, 2, 4, 8, 16, 32, 64, 128];
        let mask = vcombine_u8(vld1_u8(masks.add(index * 8)), vdup_n_u8(0));
        let bits = vld1q_u8(BITS.as_ptr());
        std::array::from_fn(|i| {
            // Bytes 2q and 2q + 1 of the mask over 8 lanes each, tested bit by bit: all ones
            // (−1) where set, so `v − set·amount` adds.
            let q = (v0 + i) as u8;
            let set = vtstq_u8(vqtbl1q_u8(mask, vcombine_u8(vdup_n_u8(2 * q), vdup_n_u8(2 * q + 1))), bits);
            vmlsq_u8(v[i], set, amount)
        })
    }

    /// The 32 values of block (unit) `block(r)` of each of `R` activation rows, as two halves
    /// of 4 groups (half `h`, row `r`).
    #[inline(always)]
    pub(super) unsafe fn activations<const R: usize>(
        xq: &QuantizedRows,
        block: impl Fn(usize) -> usize,
    ) -> [[int8x16_t; R]; 2] {
        std::array::from_fn(|h| std::array::from_fn(|r| vld1q_s8(xq.values.as_ptr().add(block(r) * QK + 16 * h))))
    }

    /// Writes 4 columns from `col` of output row `row` (of `n` columns): those that exist.
    #[inline(always)]
    pub(super) unsafe fn store(acc: float32x4_t, out: *mut f32, row: usize, n: usize, col: usize) {
        if col + 4 <= n {
            vst1q_f32(out.add(row * n + col), acc);
        } else if col < n {
            let mut lanes = [0f32; 4];
            vst1q_f32(lanes.as_mut_ptr(), acc);
            std::ptr::copy_nonoverlapping(lanes.as_ptr(), out.add(row * n + col), n - col);
        }
    }

    /// Tiles `t0..t0 + tiles` of format `F` against every activation row.
    #[target_feature(enable = "dotprod")]
    pub(super) unsafe fn columns<const F: u8>(
        w: &Interleaved,
        xq: &QuantizedRows,
        m: usize,
        t0: usize,
        tiles: usize,
        out: *mut f32,
    ) {
        for t in t0..t0 + tiles {
            row_blocks!(m, |R, V, row0, v0| tile::<F, R, V>(w, xq, row0, t, v0, out));
        }
    }

    /// Activation rows `row0..row0 + R` times weight quads `v0..v0 + V` (rows `4·v0..4·(v0 + V)`)
    /// of tile `t`.
    #[inline(always)]
    unsafe fn tile<const F: u8, const R: usize, const V: usize>(
        w: &Interleaved,
        xq: &QuantizedRows,
        row0: usize,
        t: usize,
        v0: usize,
        out: *mut f32,
    ) {
        let nb = w.blocks();
        let values = w.format.values_at();
        let header = w.format.header_bytes();
        let asymmetric = F == Q4_1 || F == Q5_1;
        let nibble = vdupq_n_u8(0x0F);
        let sixteen = vdupq_n_u8(16);
        let mut acc = [[vdupq_n_f32(0.0); V]; R];
        for b in 0..nb {
            let rec = w.record(t, b).as_ptr();
            let x = activations::<R>(xq, |r| (row0 + r) * nb + b);
            // The symmetric formats' integer sums start at -offset·Σq_x, undoing the offset
            // (Q8_0's values are signed here).
            let mut dot: [[int32x4_t; V]; R] = std::array::from_fn(|r| {
                let qsum = *xq.qsums.get_unchecked((row0 + r) * nb + b);
                [vdupq_n_s32(if asymmetric || F == Q8_0 { 0 } else { -w.format.offset() * qsum }); V]
            });
            let load = |j: usize| -> [uint8x16_t; V] {
                std::array::from_fn(|v| vld1q_u8(rec.add(values + j * 64 + (v0 + v) * 16)))
            };
            if F == Q8_0 {
                for (h, x) in x.iter().enumerate() {
                    each_lane!(l => {
                        let wv = load(4 * h + l);
                        for r in 0..R {
                            for v in 0..V {
                                dot[r][v] = dot_lane(dot[r][v], wv[v], x[r], l);
                            }
                        }
                    });
                }
            } else {
                // Byte j of a Q4 block holds value j (low nibble) and value j + 16 (high).
                each_lane!(j => {
                    let packed = load(j);
                    let mut lo = packed.map(|p| vandq_u8(p, nibble));
                    let mut hi = packed.map(|p| vshrq_n_u8::<4>(p));
                    if F == Q5_0 || F == Q5_1 {
                        lo = with_high_bits(lo, rec.add(header), j, v0, sixteen);
                        hi = with_high_bits(hi, rec.add(header), j + 4, v0, sixteen);
                    }
                    for r in 0..R {
                        for v in 0..V {
                            dot[r][v] = dot_lane(dot[r][v], lo[v], x[0][r], j);
                            dot[r][v] = dot_lane(dot[r][v], hi[v], x[1][r], j);
                        }
                    }
                });
            }
            let wd = halves::<V>(rec, v0);
            let wm = if asymmetric { halves::<V>(rec.add(HALVES), v0) } else { [vdupq_n_f32(0.0); V] };
            for r in 0..R {
                let xi = (row0 + r) * nb + b;
                let xd = *xq.scales.get_unchecked(xi);
                let xs = *xq.sums.get_unchecked(xi);
                for v in 0..V {
                    acc[r][v] = vfmaq_f32(acc[r][v], vcvtq_f32_s32(dot[r][v]), vmulq_n_f32(wd[v], xd));
                    if asymmetric {
                        acc[r][v] = vfmaq_n_f32(acc[r][v], wm[v], xs);
                    }
                }
            }
        }
        for (r, acc) in acc.iter().enumerate() {
            for (v, &acc) in acc.iter().enumerate() {
                store(acc, out, row0 + r, w.n, t * LANES + 4 * (v0 + v));
            }
        }
    }
}

/// The kernel as a candle op on float32 `x [m, k]`.
pub struct InterleavedMatMul<'a>(pub &'a Interleaved);

impl candle_core::CustomOp1 for InterleavedMatMul<'_> {
    fn name(&self) -> &'static str {
        "candlewick-interleaved-matmul"
    }

    fn cpu_fwd(
        &self,
        storage: &candle_core::CpuStorage,
        layout: &candle_core::Layout,
    ) -> candle_core::Result<(candle_core::CpuStorage, candle_core::Shape)> {
        let candle_core::CpuStorage::F32(data) = storage else {
            candle_core::bail!("interleaved matmul expects float32 input")
        };
        let Some((start, end)) = layout.contiguous_offsets() else {
            candle_core::bail!("interleaved matmul expects a contiguous input")
        };
        let (m, k) = layout.shape().dims2()?;
        if k != self.0.k {
            candle_core::bail!("interleaved matmul: input width {k}, weight width {}", self.0.k)
        }
        let out = self.0.matmul(&data[start..end], m);
        Ok((candle_core::CpuStorage::F32(out), candle_core::Shape::from((m, self.0.n))))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::quantized::{ggml_file, QTensor};
    use candle_core::{Device, Tensor};
    use rand::{rngs::StdRng, Rng, SeedableRng};

    /// Every format: the block formats, then the grid formats (`grid::GRID_FORMATS`).
    fn formats() -> impl Iterator<Item = Format> {
        [
            Format::Q8_0,
            Format::Q4_0,
            Format::Q4_1,
            Format::Q5_0,
            Format::Q5_1,
            Format::Q3K,
            Format::Q4K,
            Format::Q5K,
            Format::Q6K,
            Format::IQ4NL,
            Format::IQ4XS,
            Format::MXFP4,
        ]
        .into_iter()
        .chain(grid::GRID_FORMATS)
    }

    /// The formats candle has a quantizer and a matmul for.
    fn candle_formats() -> impl Iterator<Item = Format> {
        formats().filter(|f| f.dtype().is_some())
    }

    /// The `extra_types` type of a format candle lacks.
    fn extra(format: Format) -> ExtraType {
        ExtraType::ALL.into_iter().find(|&t| Format::of_extra(t) == Some(format)).expect("a type candle lacks")
    }

    /// A weight in ggml's layout: its blocks, `n` rows of `k` values of `format`.
    struct Blocks {
        format: Format,
        data: Vec<u8>,
        n: usize,
        k: usize,
    }

    impl Blocks {
        /// The weight as candle holds it (the formats it has).
        fn qtensor(&self) -> Option<QTensor> {
            let dtype = self.format.dtype()?;
            Some(ggml_file::qtensor_from_ggml(dtype, &self.data, vec![self.n, self.k], &Device::Cpu).unwrap())
        }

        /// The rows de-quantized as the type's reference does: candle, or `ExtraType::dequantize`
        /// (bit for bit as `gguf.quants`).
        fn dequantized(&self) -> Vec<Vec<f32>> {
            let flat = match self.qtensor() {
                Some(q) => q.dequantize(&Device::Cpu).unwrap().flatten_all().unwrap().to_vec1::<f32>().unwrap(),
                None => extra(self.format).dequantize(&self.data).unwrap(),
            };
            flat.chunks_exact(self.k).map(<[f32]>::to_vec).collect()
        }

        fn tiles(&self) -> Interleaved {
            Interleaved::repack(self.format, &self.data, self.n, self.k).unwrap()
        }
    }

    /// `w` quantized by candle, and its tiles.
    fn repacked(w: &Tensor, format: Format) -> (Blocks, Interleaved) {
        let dtype = format.dtype().expect("candle quantizes it");
        let data = QTensor::quantize(w, dtype).unwrap().data().unwrap().into_owned();
        let (n, k) = w.dims2().unwrap();
        let blocks = Blocks { format, data, n, k };
        let p = blocks.tiles();
        (blocks, p)
    }

    /// Makes a random block of a type candle lacks finite: its float16 scale loses the
    /// exponent's top bit where all its bits are set (IQ1_M's scale is spread over the top
    /// nibbles of its four u16 scales: bit 14 is byte 55's bit 6).
    pub(super) fn finite_extra(ty: ExtraType, block: &mut [u8]) {
        let high = match ty {
            ExtraType::MXFP4 => return,
            ExtraType::TQ1_0 => 53,
            ExtraType::TQ2_0 => 65,
            ExtraType::IQ1_M => 55,
            _ => 1,
        };
        if !ty.finite_scale(block) {
            block[high] &= !0x40;
        }
        assert!(ty.finite_scale(block), "{ty:?}");
    }

    /// The largest MXFP4 exponent byte of `random` blocks: 2^72 scales, whose products with
    /// the test's activations stay far from float32's limit (the largest finite, 252, would not).
    const MXFP4_MAX_EXPONENT: u8 = 200;

    /// `n` rows of `k` values of `format` blocks of random bytes (every bit pattern of values
    /// and packed scales), their float16 scales of every finite magnitude, from subnormal to
    /// 65504 (MXFP4's exponents from the subnormal 0 and 1 to `MXFP4_MAX_EXPONENT`): the source
    /// blocks and our tiles of them.
    fn random(format: Format, n: usize, k: usize, seed: u64) -> (Blocks, Interleaved) {
        let mut rng = StdRng::seed_from_u64(seed);
        let bytes = n * k / format.block_values() * format.block_bytes();
        let mut data: Vec<u8> = (0..bytes).map(|_| rng.random()).collect();
        let (size, halves) = match format.dtype() {
            Some(dtype) => {
                let (size, halves, _) = crate::block_scales::scales(dtype).expect("float16 scales");
                (size, halves)
            }
            None if format == Format::MXFP4 || format.is_grid() => (format.block_bytes(), &[][..]),
            None => (format.block_bytes(), &[0][..]),
        };
        for (i, block) in data.chunks_exact_mut(size).enumerate() {
            if format.is_grid() {
                finite_extra(format.grid_type(), block);
            }
            for &at in halves {
                // Infinity and NaN (exponent all ones) lose the exponent's top bit.
                if block[at + 1] & 0x7C == 0x7C {
                    block[at + 1] &= !0x40;
                }
            }
            if format == Format::MXFP4 {
                block[0] = [0, 1, MXFP4_MAX_EXPONENT].get(i % 8).copied().unwrap_or(rng.random_range(0..=200));
            }
        }
        let blocks = Blocks { format, data, n, k };
        let p = blocks.tiles();
        (blocks, p)
    }

    /// `(m, k, n)` shapes that exercise every tile shape and weights whose rows do not fill the
    /// last tile (or one tile), with rows of whole blocks of `format` (several k-quant blocks).
    fn shapes(format: Format) -> [(usize, usize, usize); 10] {
        let w = format.block_values() / QK;
        [
            (1, 64, 16),
            (1, 640, 37),
            (2, 96, 32),
            (3, 128, 48),
            (5, 64, 9),
            (8, 640, 64),
            (13, 128, 81),
            (17, 64, 33),
            (4, 96, 1),
            (16, 64, 2),
        ]
        .map(|(m, k, n)| (m, k * w, n))
    }

    /// The product of the de-quantized weight and the de-quantized 32-value int8 activations,
    /// in float64: what every path computes, up to the order of float additions.
    fn exact(w: &[Vec<f32>], x: &[f32], m: usize) -> Vec<f64> {
        let xq = quantize_rows(x);
        let k = x.len() / m;
        let xd: Vec<f64> = xq.values.iter().enumerate().map(|(i, &v)| v as f64 * xq.scales[i / QK] as f64).collect();
        (0..m)
            .flat_map(|r| {
                let row = &xd[r * k..(r + 1) * k];
                w.iter().map(move |wr| wr.iter().zip(row).map(|(&a, &b)| a as f64 * b).sum::<f64>())
            })
            .collect()
    }

    /// Every path (the portable one, and this CPU's SIMD one for the format, each forced)
    /// computes the exact product of the quantized operands `q` (tiled as `p`) and `m` random
    /// rows, the SIMD one stays next to the portable one, and all next to candle's quantized
    /// matmul where candle has the type. Against candle, relative to the sum of the absolute
    /// products: candle rounds Q4_1's `d·Σq` to f16, and quantizes the activations of the
    /// k-quants in 256-value blocks where ours are 32.
    fn check_product(q: &Blocks, p: &Interleaved, m: usize) {
        let format = p.format();
        let (n, k) = p.shape();
        let paths: Vec<Path> = [Path::Portable].into_iter().chain(fast_path(format)).collect();
        let near_candle = if format.block_values() == QK { 1e-3 } else { 1e-2 };
        let x = Tensor::randn(0f32, 1.0, (m, k), &Device::Cpu).unwrap();
        let xs = x.flatten_all().unwrap().to_vec1::<f32>().unwrap();
        let w = q.dequantized();
        let want = exact(&w, &xs, m);
        // |x|·|w|ᵀ: the scale a difference is bounded relative to (the paths add the same
        // products in other orders).
        let magnitude: Vec<f64> = xs
            .chunks_exact(k)
            .flat_map(|x| {
                w.iter().map(move |w| w.iter().zip(x).map(|(&a, &b)| (a as f64 * b as f64).abs()).sum::<f64>())
            })
            .collect();
        let candle = q.qtensor().map(|q| super::super::reference::candle_product(q, &x).0);
        let portable = p.matmul_with(&xs, m, Path::Portable);
        // The AVX-512 path with and without `vpermb` for the table formats.
        let variants = paths.iter().map(|&p| (p, p == Path::Avx512Vnni && vbmi()));
        let variants: Vec<_> =
            variants.chain(paths.contains(&Path::Avx512Vnni).then_some((Path::Avx512Vnni, false))).collect();
        for &(path, vbmi) in &variants {
            let got = p.matmul_on(&xs, m, path, vbmi);
            assert_eq!(got.len(), m * n);
            for (i, ((&a, &b), &s)) in got.iter().zip(&want).zip(&magnitude).enumerate() {
                let at = format!("{format:?} ({m},{k},{n}) {path:?} vbmi {vbmi}: {a} vs");
                assert!((a as f64 - b).abs() <= 1e-5 * s + 1e-6, "{at} exact {b}");
                let d = portable[i];
                assert!(((a - d).abs() as f64) <= 1e-5 * s + 1e-6, "{at} portable {d}");
                if let Some(c) = candle.as_ref().map(|c| c[i]) {
                    assert!(((a - c).abs() as f64) <= near_candle * s + 1e-5, "{at} candle {c}");
                }
            }
        }
    }

    /// On x86 the tiles of every format run where AVX-512 VNNI and BW do; else where AVX2, FMA
    /// and F16C do; else nowhere.
    #[test]
    #[cfg(target_arch = "x86_64")]
    fn x86_tiles_follow_the_cpu() {
        for format in formats() {
            let want = if avx512() {
                Some(Path::Avx512Vnni)
            } else if avx2() {
                Some(Path::Avx2)
            } else {
                None
            };
            assert_eq!(fast_path(format), want, "{format:?}");
        }
    }

    /// On Arm the tiles of every format with a NEON kernel run exactly where `sdot` does: a core
    /// without it (Cortex-A72) keeps ggml's layout, and the tests above compare the portable path
    /// alone there. The table formats have no NEON kernel: never repacked on Arm.
    #[test]
    #[cfg(target_arch = "aarch64")]
    fn arm_tiles_follow_dotprod() {
        let dotprod = crate::arm::Features::get().dotprod;
        assert_eq!(available(), dotprod);
        for format in formats() {
            let want = (dotprod && neon::runs(format)).then_some(Path::NeonDot);
            assert_eq!(fast_path(format), want, "{format:?}");
            let repacked = match format.dtype() {
                Some(dtype) => crate::repacked_format(dtype, &Device::Cpu),
                None => crate::repacked_extra_format(extra(format), &Device::Cpu),
            };
            assert_eq!(repacked.is_some(), want.is_some(), "{format:?}");
        }
    }

    /// Every activation row count from 1 to 17 (whole blocks of 4 rows over half tiles and each
    /// remainder) on weights of one whole tile and a partial one, random blocks of every format
    /// and quantized ones of those candle quantizes.
    #[test]
    fn every_row_count_computes_the_product() {
        for format in formats() {
            let k = 2 * format.block_values();
            for m in 1..=17 {
                let (q, p) = random(format, 27, k, m as u64);
                check_product(&q, &p, m);
            }
            if format.dtype().is_some() {
                let w = Tensor::randn(0f32, 1.0, (21, k), &Device::Cpu).unwrap();
                let (q, p) = repacked(&w, format);
                check_product(&q, &p, 7);
            }
        }
    }

    /// Every path computes the quantized product, for every format candle quantizes and every
    /// shape.
    #[test]
    fn every_path_computes_the_quantized_product() {
        for format in candle_formats() {
            for (m, k, n) in shapes(format) {
                let w = Tensor::randn(0f32, 1.0, (n, k), &Device::Cpu).unwrap();
                let (q, p) = repacked(&w, format);
                check_product(&q, &p, m);
            }
        }
    }

    /// The same for blocks of random bytes, every format: scales, mins and high bits of every
    /// value, and float16 scales from subnormal to the largest.
    #[test]
    fn every_path_computes_the_product_of_random_blocks() {
        for format in formats() {
            for (i, (m, k, n)) in shapes(format).into_iter().enumerate() {
                let (q, p) = random(format, n, k, i as u64);
                check_product(&q, &p, m);
            }
        }
    }

    /// Stacked weights compute each part's outputs bit for bit, for 1 and 9 activation rows,
    /// the last part a partial tile; parts that leave a tile partial before the last, or differ
    /// in format or width, do not stack.
    #[test]
    fn stacked_weights_compute_their_parts_outputs() {
        for format in formats() {
            let k = 2 * format.block_values();
            let parts: Vec<Interleaved> =
                [32, 16, 21].iter().zip(1u64..).map(|(&n, s)| random(format, n, k, s).1).collect();
            let stacked = Interleaved::stack(&parts.iter().collect::<Vec<_>>()).expect("whole tiles stack");
            assert_eq!(stacked.shape(), (69, k));
            for m in [1, 9] {
                let x: Vec<f32> = (0..m * k).map(|i| ((i * 37 % 101) as f32 - 50.0) / 25.0).collect();
                let got = stacked.matmul(&x, m);
                for r in 0..m {
                    let want: Vec<f32> =
                        parts.iter().flat_map(|p| p.matmul(&x, m)[r * p.n..(r + 1) * p.n].to_vec()).collect();
                    let row = &got[r * 69..(r + 1) * 69];
                    assert!(row.iter().zip(&want).all(|(a, b)| a.to_bits() == b.to_bits()), "{format:?} row {r}");
                }
            }
            assert!(Interleaved::stack(&[&parts[2], &parts[0]]).is_none(), "{format:?}: a partial tile first");
            let other = random(if format == Format::Q8_0 { Format::Q4_0 } else { Format::Q8_0 }, 16, k, 9).1;
            assert!(Interleaved::stack(&[&parts[0], &other]).is_none(), "{format:?}: two formats");
            let wider = random(format, 16, 2 * k, 9).1;
            assert!(Interleaved::stack(&[&parts[0], &wider]).is_none(), "{format:?}: two widths");
        }
    }

    /// Repacked rows read back as the type's reference de-quantizes them, bit for bit.
    fn check_rows(q: &Blocks, p: &Interleaved) {
        let want = q.dequantized();
        let mut row = vec![0f32; p.shape().1];
        for (r, expected) in want.iter().enumerate() {
            p.row_into(r, &mut row);
            let same = row.iter().zip(expected).all(|(a, b)| a.to_bits() == b.to_bits());
            assert!(same, "{:?} row {r}: {row:?} vs {expected:?}", p.format());
        }
    }

    /// A repacked row reads back as candle (or `ExtraType`, for the types candle lacks)
    /// de-quantizes it, from quantized weights and from random blocks.
    #[test]
    fn rows_de_quantize_as_candle_does() {
        for format in formats() {
            let k = 2 * format.block_values().max(96);
            if format.dtype().is_some() {
                let w = Tensor::randn(0f32, 1.0, (19, k), &Device::Cpu).unwrap();
                let (q, p) = repacked(&w, format);
                check_rows(&q, &p);
            }
            for (seed, n) in [1, 2, 5, 16, 35].into_iter().enumerate() {
                let (q, p) = random(format, n, k, seed as u64);
                check_rows(&q, &p);
            }
        }
    }

    /// MXFP4 rows of every finite exponent byte (0 to 252, a subnormal 2^-128 to 2^124) read back
    /// bit for bit: its scale is exact in float32, no float16 bounds it.
    #[test]
    fn mxfp4_rows_of_every_exponent_de_quantize_exactly() {
        let (mut q, _) = random(Format::MXFP4, 17, 64, 9);
        for (i, block) in q.data.chunks_exact_mut(Format::MXFP4.block_bytes()).enumerate() {
            block[0] = (i * 7 % 253) as u8;
        }
        let p = q.tiles();
        check_rows(&q, &p);
    }

    #[test]
    fn wrong_sizes_are_errors() {
        assert!(Interleaved::repack(Format::Q8_0, &vec![0; 34], 1, 33).is_err());
        assert!(Interleaved::repack(Format::Q8_0, &vec![0; 33], 1, 32).is_err());
        assert!(Interleaved::repack(Format::Q4_1, &vec![0; 20], usize::MAX, 32).is_err());
        assert!(Interleaved::repack(Format::Q4K, &vec![0; 72], 1, 128).is_err());
        assert!(Interleaved::repack(Format::Q6K, &vec![0; 210], 2, 256).is_err());
        assert!(Interleaved::repack(Format::Q5K, &vec![0; 176], 1, 512).is_err());
        assert!(Interleaved::repack(Format::Q3K, &vec![0; 110], 1, 128).is_err());
        assert!(Interleaved::repack(Format::IQ4NL, &vec![0; 18], 1, 48).is_err());
        assert!(Interleaved::repack(Format::IQ4NL, &vec![0; 17], 1, 32).is_err());
        assert!(Interleaved::repack(Format::IQ4XS, &vec![0; 136], 1, 128).is_err());
        assert!(Interleaved::repack(Format::IQ4XS, &vec![0; 135], 1, 256).is_err());
        assert!(Interleaved::repack(Format::MXFP4, &vec![0; 18], 1, 32).is_err());
        assert!(Interleaved::repack(Format::MXFP4, &vec![0; 17], usize::MAX, 32).is_err());
        assert!(Interleaved::read(Format::MXFP4, 3, 32, |_, _| Err("short read".into())).is_err());
    }

    /// `CANDLE_NUM_THREADS=1 RAYON_NUM_THREADS=1 cargo test --release --lib interleaved_timing --
    /// --ignored --nocapture`: the tiles against candle's QMatMul on the same blocks (what Q3_K
    /// and Q5_K ran on before they had tiles) for the k-quants, on a decode row and a 128-row
    /// prompt chunk through a 1024 → 4096 projection, and on a decode row through a tied output
    /// projection of Qwen's vocabulary in four formats (1024 → 151,936: 87–165 MB, so its time
    /// is the weight stream's; a CPU with a larger L3, as this project's 260 MiB, keeps it
    /// there between repetitions, where a model's decode step reads it from memory). Process
    /// CPU time per product (candle's kernels run on rayon's thread, not the caller's), median
    /// of 7: the machine may be shared.
    #[test]
    #[ignore]
    fn interleaved_timing() {
        let projection: &[(usize, usize)] = &[(1, 40), (128, 2)];
        let vocabulary: &[(usize, usize)] = &[(1, 3)];
        let cases = [Format::Q3K, Format::Q4K, Format::Q5K, Format::Q6K]
            .map(|format| (format, 4096, projection))
            .into_iter()
            .chain([Format::Q8_0, Format::Q4_0, Format::Q4K, Format::Q6K].map(|format| (format, 151_936, vocabulary)));
        let k = 1024;
        for (format, n, rows) in cases {
            let w = Tensor::randn(0f32, 1.0, (n, k), &Device::Cpu).unwrap();
            let (q, p) = repacked(&w, format);
            let candle = candle_core::quantized::QMatMul::from_qtensor(q.qtensor().unwrap()).unwrap();
            for &(m, reps) in rows {
                let x = Tensor::randn(0f32, 1.0, (m, k), &Device::Cpu).unwrap();
                let xs = x.flatten_all().unwrap().to_vec1::<f32>().unwrap();
                let before = median(&|| drop(candle_core::Module::forward(&candle, &x).unwrap()), reps);
                let after = median(&|| drop(p.matmul(&xs, m)), reps);
                println!(
                    "{format:?} [{m}, {k}] x [{k} -> {n}]: candle {:.3} ms, tiles {:.3} ms ({:.2}x, {:.1} GB/s of weights)",
                    before * 1e3,
                    after * 1e3,
                    before / after,
                    p.data.len() as f64 / after / 1e9
                );
            }
        }
    }

    /// Seconds of process CPU time `f` takes, median of 7 runs of `reps` calls after one warm-up.
    fn median(f: &dyn Fn(), reps: usize) -> f64 {
        let cpu = || crate::cpu_seconds(libc::CLOCK_PROCESS_CPUTIME_ID);
        f();
        let mut times: Vec<f64> = (0..7)
            .map(|_| {
                let t = cpu();
                for _ in 0..reps {
                    f();
                }
                (cpu() - t) / reps as f64
            })
            .collect();
        times.sort_by(f64::total_cmp);
        times[times.len() / 2]
    }

    /// `CANDLE_NUM_THREADS=1 RAYON_NUM_THREADS=1 cargo test --release --lib iquant_timing --
    /// --ignored --nocapture`: the table formats' own tiles against what they ran on before,
    /// their Q8_0 re-encoding (`ExtraType::to_q8_0`) in Q8_0 tiles, on a decode row and a 128-row
    /// prompt chunk through a 1024 → 4096 projection. Random values, scales of a trained model's
    /// magnitude (float16 0.01, MXFP4 2^-8). As `interleaved_timing`, median CPU time.
    #[test]
    #[ignore]
    fn iquant_timing() {
        let (n, k) = (4096, 1024);
        // The grid formats' random float16 scales (`random`) are left as they are: their values do
        // not change the time.
        let formats = [Format::IQ4NL, Format::IQ4XS, Format::MXFP4].into_iter().chain(grid::GRID_FORMATS);
        for format in formats.filter(|f| std::env::var("FORMAT").map_or(true, |want| want == f.name())) {
            let (mut q, _) = random(format, n, k, 1);
            for block in q.data.chunks_exact_mut(format.block_bytes()) {
                match format {
                    Format::MXFP4 => block[0] = 120,
                    _ if format.is_grid() => {}
                    _ => block[..2].copy_from_slice(&f16::from_f32(0.01).to_le_bytes()),
                }
            }
            let p = q.tiles();
            let ty = extra(format);
            let mut q8 = vec![0u8; ty.q8_0_bytes(q.data.len())];
            // IQ4_XS's scales `d·(ls − 32)` round to float16; the others' are exact.
            let conversion = ty.to_q8_0(&q.data, &mut q8).unwrap();
            // (The grid formats with two scales per 32 values are quantized afresh.)
            assert!(format.is_grid() || conversion.exact + conversion.rounded_scale == n * k / QK);
            let before = Interleaved::repack(Format::Q8_0, &q8, n, k).unwrap();
            for (m, reps) in [(1, 40), (128, 2)] {
                let x: Vec<f32> = Tensor::randn(0f32, 1.0, m * k, &Device::Cpu).unwrap().to_vec1().unwrap();
                if format != Format::IQ4XS && !format.is_grid() {
                    assert_eq!(before.matmul(&x, m), p.matmul(&x, m), "{format:?}: the same values, the same sums");
                }
                let (old, new) =
                    (median(&|| drop(before.matmul(&x, m)), reps), median(&|| drop(p.matmul(&x, m)), reps));
                println!(
                    "{format:?} [{m}, {k}] x [{k} -> {n}]: as Q8_0 tiles {:.3} ms ({:.1} MB), own tiles {:.3} ms ({:.1} MB): {:.2}x",
                    old * 1e3,
                    before.data.len() as f64 / 1e6,
                    new * 1e3,
                    p.data.len() as f64 / 1e6,
                    old / new
                );
            }
        }
    }

    /// A tile record is the same size as its 16 source blocks (the repack permutes in place).
    #[test]
    fn records_are_their_blocks_size() {
        for format in formats() {
            let (values, bytes) = match format.dtype() {
                Some(dtype) => (dtype.block_size(), dtype.type_size()),
                None => (extra(format).block_values(), extra(format).block_bytes()),
            };
            assert_eq!(format.record_bytes(), LANES * bytes, "{format:?}");
            assert_eq!(format.block_values(), values, "{format:?}");
        }
    }
}
