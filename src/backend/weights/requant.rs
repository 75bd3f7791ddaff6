//! Lossless re-encoding of quantized blocks into a type candle has SIMD kernels for.
//!
//! candle 0.11 multiplies Q5_0 weights with scalar code (its AVX2/NEON kernels cover Q4_0,
//! Q8_0 and the k-quants), and llama.cpp's Q4_K_M files store most projections of models whose
//! width is not a multiple of 256 (Gemma 3 270M: 640) as Q5_0. A Q5_0 value is `d * (q - 16)`
//! with `q` in 0..32, which a Q8_0 block stores exactly as `d * q'` with `q' = q - 16`: same
//! scale, same products, so the numbers do not change — only the kernel that computes them.

use candle_core::quantized::k_quants::BlockQ8_0;
use candle_core::quantized::{GgmlDType, QStorage, QTensor};
use candle_core::Device;

const QK: usize = 32;
const Q5_0_BYTES: usize = 2 + 4 + QK / 2;
const Q8_0_BYTES: usize = 2 + QK;
const _: () = assert!(std::mem::size_of::<BlockQ8_0>() == Q8_0_BYTES);

/// Re-encodes Q5_0 blocks as Q8_0 blocks with identical values into `out`, which holds exactly
/// as many Q8_0 blocks as `src` Q5_0 ones (in parallel: it is a noticeable part of loading a
/// model stored mostly as Q5_0).
fn q5_0_into_q8_0(src: &[u8], out: &mut [u8]) {
    use rayon::prelude::*;
    const PER_TASK: usize = 4096;
    out.par_chunks_mut(PER_TASK * Q8_0_BYTES).zip(src.par_chunks(PER_TASK * Q5_0_BYTES)).for_each(|(dst, src)| {
        for (o, block) in dst.chunks_exact_mut(Q8_0_BYTES).zip(src.chunks_exact(Q5_0_BYTES)) {
            let (d, rest) = block.split_at(2);
            let (qh, qs) = rest.split_at(4);
            let qh = u32::from_le_bytes([qh[0], qh[1], qh[2], qh[3]]);
            o[..2].copy_from_slice(d);
            // Element j < 16 is the low nibble of qs[j], element j + 16 its high nibble; bit j
            // of qh is the fifth bit of element j.
            for j in 0..QK / 2 {
                let lo = (qs[j] & 0x0F) | ((((qh >> j) & 1) as u8) << 4);
                let hi = (qs[j] >> 4) | ((((qh >> (j + QK / 2)) & 1) as u8) << 4);
                o[2 + j] = (lo as i8 - 16) as u8;
                o[2 + j + QK / 2] = (hi as i8 - 16) as u8;
            }
        }
    });
}

/// A tensor in the fastest lossless encoding candle runs: Q5_0 becomes Q8_0, others stay.
///
/// Even beside our int8 GEMM, which multiplies Q5_0 directly, Q8_0 is faster: unpacking the
/// fifth bits costs more than the 3 extra bits a value read (measured on Qwen2.5-Coder 0.5B, one
/// thread, AMD EPYC: decode 15 vs 23 tok/s, 128-token prefill 91 vs 100 tok/s).
pub fn fast_encoding(q: QTensor, device: &Device) -> candle_core::Result<QTensor> {
    // The interleaved tiles run Q5_0 as it is, at 5.5 bits a value instead of 8.5.
    let tiled = crate::backend::kernels::repacked_format(q.dtype(), device).is_some();
    if q.dtype() != GgmlDType::Q5_0 || !device.is_cpu() || tiled {
        return Ok(q);
    }
    // Written straight into the new tensor's blocks: no intermediate byte buffer to copy from.
    let src = q.data()?;
    let blocks = src.len() / Q5_0_BYTES;
    let mut out: Vec<BlockQ8_0> = Vec::with_capacity(blocks);
    // SAFETY: a Q8_0 block is plain data (a half and 32 bytes), valid when all zero; every byte
    // is then overwritten by the re-encoding.
    unsafe {
        std::ptr::write_bytes(out.as_mut_ptr(), 0, blocks);
        out.set_len(blocks);
        let bytes = std::slice::from_raw_parts_mut(out.as_mut_ptr() as *mut u8, blocks * Q8_0_BYTES);
        q5_0_into_q8_0(&src, bytes);
    }
    QTensor::new(QStorage::Cpu(Box::new(out)), q.shape().dims().to_vec())
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::quantized::ggml_file;
    use candle_core::Tensor;

    /// The re-encoding itself, whether or not this CPU's tiles make `fast_encoding` skip it.
    #[test]
    fn q5_0_re_encoded_as_q8_0_dequantizes_identically() {
        let dev = Device::Cpu;
        let x = Tensor::randn(0f32, 1.0, (8, 64), &dev).unwrap();
        let q5 = QTensor::quantize(&x, GgmlDType::Q5_0).unwrap();
        let want = q5.dequantize(&dev).unwrap().flatten_all().unwrap().to_vec1::<f32>().unwrap();
        let src = q5.data().unwrap();
        let mut bytes = vec![0u8; src.len() / Q5_0_BYTES * Q8_0_BYTES];
        q5_0_into_q8_0(&src, &mut bytes);
        let q8 = ggml_file::qtensor_from_ggml(GgmlDType::Q8_0, &bytes, vec![8, 64], &dev).unwrap();
        let got = q8.dequantize(&dev).unwrap().flatten_all().unwrap().to_vec1::<f32>().unwrap();
        assert_eq!(got, want);
        let kept = crate::backend::kernels::repacked_format(GgmlDType::Q5_0, &dev).is_some();
        let expected = if kept { GgmlDType::Q5_0 } else { GgmlDType::Q8_0 };
        assert_eq!(fast_encoding(q5, &dev).unwrap().dtype(), expected);
    }
}
