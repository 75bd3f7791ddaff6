//! Where the float scales of ggml's block formats sit: what a check of a block's finiteness reads.

use candle_core::quantized::GgmlDType;

/// Where the float scales sit in one ggml block of `dtype`: (block bytes, offsets of float16
/// scales, offset of a float32 scale). Layouts as ggml's `block_*` structs.
pub fn scales(dtype: GgmlDType) -> Option<(usize, &'static [usize], Option<usize>)> {
    Some(match dtype {
        GgmlDType::Q4_0 => (18, &[0], None),
        GgmlDType::Q4_1 => (20, &[0, 2], None),
        GgmlDType::Q5_0 => (22, &[0], None),
        GgmlDType::Q5_1 => (24, &[0, 2], None),
        GgmlDType::Q8_0 => (34, &[0], None),
        GgmlDType::Q8_1 => (36, &[0, 2], None),
        // scales[16], qs[64], d, dmin
        GgmlDType::Q2K => (84, &[80, 82], None),
        // hmask[32], qs[64], scales[12], d
        GgmlDType::Q3K => (110, &[108], None),
        GgmlDType::Q4K => (144, &[0, 2], None),
        GgmlDType::Q5K => (176, &[0, 2], None),
        // ql[128], qh[64], scales[16], d
        GgmlDType::Q6K => (210, &[208], None),
        // d (f32), qs[256], bsums[16]
        GgmlDType::Q8K => (292, &[], Some(0)),
        _ => return None,
    })
}
