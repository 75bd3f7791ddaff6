//! The check that a checkpoint's numbers are finite, as llama.cpp's `--check-tensors` makes it:
//! a NaN or infinite weight (or block scale) would otherwise load silently and turn every
//! logit into NaN.
//!
//! It runs on the raw bytes as they are read, before anything is built from them: float values
//! are tested by their exponent bits (all ones: infinity or NaN) in branch-free loops the
//! compiler vectorises; quantized blocks by their float scales, the only part of a block that
//! can be non-finite.

use candle_core::quantized::GgmlDType;

use candlewick_kernels::block_scales::scales;
use candlewick_kernels::extra_types::ExtraType;

/// The exponent bits of a float16 / bfloat16 / float32, all ones for infinity and NaN.
const F16_EXP: u16 = 0x7c00;
const BF16_EXP: u16 = 0x7f80;
const F32_EXP: u32 = 0x7f80_0000;

fn u16_at(b: &[u8], at: usize) -> u16 {
    u16::from_le_bytes([b[at], b[at + 1]])
}

/// The index of the first element (float types) or block (quantized types) of `bytes` that is
/// not finite; `bytes` holds whole elements or blocks of `dtype`, little-endian as GGUF and
/// safetensors store them. Types without float scales are always finite.
fn first_bad(dtype: GgmlDType, bytes: &[u8]) -> Option<usize> {
    let f32_bad = |c: &[u8]| u32::from_le_bytes([c[0], c[1], c[2], c[3]]) & F32_EXP == F32_EXP;
    // A branch-free pass (vectorised) says whether to look; only a bad tensor pays for `position`.
    match dtype {
        GgmlDType::F32 => {
            let any = bytes.chunks_exact(4).fold(false, |bad, c| bad | f32_bad(c));
            any.then(|| bytes.chunks_exact(4).position(f32_bad)).flatten()
        }
        GgmlDType::F16 | GgmlDType::BF16 => {
            let exp = if dtype == GgmlDType::F16 { F16_EXP } else { BF16_EXP };
            let bad = |c: &[u8]| u16::from_le_bytes([c[0], c[1]]) & exp == exp;
            let any = bytes.chunks_exact(2).fold(false, |b, c| b | bad(c));
            any.then(|| bytes.chunks_exact(2).position(bad)).flatten()
        }
        _ => {
            let (size, halves, single) = scales(dtype)?;
            let bad = |b: &[u8]| {
                halves.iter().any(|&at| u16_at(b, at) & F16_EXP == F16_EXP)
                    || single.is_some_and(|at| f32_bad(&b[at..]))
            };
            bytes.chunks_exact(size).position(bad)
        }
    }
}

/// Checks that every value of `bytes` (whole elements or blocks of `dtype`) is finite, on all
/// of rayon's threads; `first` is the index of its first element or block in the tensor, so
/// that the error names the place in the whole tensor.
pub fn check(dtype: GgmlDType, bytes: &[u8], first: usize) -> Result<(), String> {
    let unit = match dtype {
        GgmlDType::F32 => 4,
        GgmlDType::F16 | GgmlDType::BF16 => 2,
        _ => match scales(dtype) {
            Some((size, ..)) => size,
            None => return Ok(()),
        },
    };
    match first_bad_unit(bytes, unit, first, |c| first_bad(dtype, c)) {
        None => Ok(()),
        Some(i) if matches!(dtype, GgmlDType::F32 | GgmlDType::F16 | GgmlDType::BF16) => {
            Err(format!("value {i} is not finite (NaN or infinity)"))
        }
        Some(i) => Err(bad_block(i)),
    }
}

/// `check` for the types candle lacks (`extra_types`): each block's one float16 scale (MXFP4:
/// a power-of-two scale so large that its values overflow float32).
pub fn check_extra(ty: ExtraType, bytes: &[u8], first: usize) -> Result<(), String> {
    let bad = |b: &[u8]| !ty.finite_scale(b);
    match first_bad_unit(bytes, ty.block_bytes(), first, |c| c.chunks_exact(ty.block_bytes()).position(bad)) {
        None => Ok(()),
        Some(i) => Err(bad_block(i)),
    }
}

fn bad_block(i: usize) -> String {
    format!("the scale of block {i} is not finite (NaN or infinity)")
}

/// The index in the tensor of the first unit (`unit` bytes) `first_bad` finds in `bytes`,
/// searched about 1 MiB a task on rayon's threads.
fn first_bad_unit(
    bytes: &[u8],
    unit: usize,
    first: usize,
    first_bad: impl Fn(&[u8]) -> Option<usize> + Sync,
) -> Option<usize> {
    use rayon::prelude::*;
    let per_task = ((1usize << 20) / unit).max(1);
    bytes
        .par_chunks(per_task * unit)
        .enumerate()
        .find_map_first(|(i, c)| first_bad(c).map(|j| first + i * per_task + j))
}

/// The ggml type of a safetensors float dtype, for `check`.
pub fn of_float(dtype: candle_core::DType) -> Option<GgmlDType> {
    match dtype {
        candle_core::DType::F32 => Some(GgmlDType::F32),
        candle_core::DType::F16 => Some(GgmlDType::F16),
        candle_core::DType::BF16 => Some(GgmlDType::BF16),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn finite_values_pass_and_the_first_bad_one_is_named() {
        let mut f32s: Vec<u8> = [1.0f32, -2.5, 0.0, f32::MAX].iter().flat_map(|x| x.to_le_bytes()).collect();
        assert_eq!(check(GgmlDType::F32, &f32s, 0), Ok(()));
        f32s[8..12].copy_from_slice(&f32::NAN.to_le_bytes());
        assert_eq!(check(GgmlDType::F32, &f32s, 10).unwrap_err(), "value 12 is not finite (NaN or infinity)");
        let halves: Vec<u8> = [half::f16::ONE, half::f16::INFINITY].iter().flat_map(|x| x.to_le_bytes()).collect();
        assert!(check(GgmlDType::F16, &halves, 0).unwrap_err().starts_with("value 1 "));
        let b: Vec<u8> = [half::bf16::ONE, half::bf16::NEG_INFINITY].iter().flat_map(|x| x.to_le_bytes()).collect();
        assert!(check(GgmlDType::BF16, &b, 0).unwrap_err().starts_with("value 1 "));
    }

    #[test]
    fn block_scales_are_checked_where_each_layout_keeps_them() {
        for dtype in [
            GgmlDType::Q4_0,
            GgmlDType::Q4_1,
            GgmlDType::Q8_0,
            GgmlDType::Q2K,
            GgmlDType::Q3K,
            GgmlDType::Q4K,
            GgmlDType::Q5K,
            GgmlDType::Q6K,
        ] {
            let (size, halves, _) = scales(dtype).unwrap();
            assert_eq!(size, dtype.type_size(), "{dtype:?}");
            // Quantized values may hold any bits: only the scales matter.
            let mut blocks = vec![0xffu8; 3 * size];
            for b in 0..3 {
                for &at in halves {
                    blocks[b * size + at..][..2].copy_from_slice(&half::f16::ONE.to_le_bytes());
                }
            }
            assert_eq!(check(dtype, &blocks, 0), Ok(()), "{dtype:?}");
            let at = 2 * size + halves[halves.len() - 1];
            blocks[at..at + 2].copy_from_slice(&half::f16::NAN.to_le_bytes());
            assert_eq!(check(dtype, &blocks, 0).unwrap_err(), "the scale of block 2 is not finite (NaN or infinity)");
        }
    }

    #[test]
    fn the_extra_types_scales_are_checked() {
        for ty in ExtraType::ALL {
            let size = ty.block_bytes();
            let mut blocks = vec![0u8; 3 * size];
            assert_eq!(check_extra(ty, &blocks, 0), Ok(()), "{ty:?}");
            // All ones is a NaN scale wherever the type keeps one (IQ1_M's four nibbles included),
            // and MXFP4's largest exponent.
            blocks[2 * size..].fill(0xff);
            let got = check_extra(ty, &blocks, 5);
            assert_eq!(got.unwrap_err(), "the scale of block 7 is not finite (NaN or infinity)", "{ty:?}");
        }
    }
}
