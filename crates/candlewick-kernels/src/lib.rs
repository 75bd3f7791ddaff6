//! The matrix products of the decoder, and the CPU kernels candle lacks (plugged in as custom ops).
//!
//! This crate imports nothing of candlewick's: it sees tensors, slices and block formats, never a
//! model, a session or a checkpoint, so it is tested and benchmarked on its own and every stack
//! above it (the decoder today; encoders and adapters tomorrow) multiplies through the same code.
//!
//! `matmul` is the one place that decides which kernel multiplies a weight: candle's own, the
//! int8 GEMM over weights repacked at load into 16-row tiles (`interleaved`: Q8_0, Q4_0, Q4_1,
//! Q5_0, Q5_1, Q3_K, Q4_K, Q5_K, Q6_K, IQ4_NL, IQ4_XS, MXFP4, the grid i-quants IQ1_S … IQ3_S
//! and the ternary TQ1_0 / TQ2_0 on CPUs with AVX-512 VNNI; all but IQ4_NL, IQ4_XS and MXFP4 on
//! Arm with the dot product), the tiled int8 GEMM over ggml's own layout
//! (`int8_gemm`: the 32-value formats on CPUs without either), our half-precision GEMV
//! (`dense`), our bfloat16 GEMM (`bf16_gemm`), or a dense GEMM over de-quantized slabs. Our
//! kernels run on the CPU only: on CUDA and Metal every product is candle's.

#[cfg(target_arch = "aarch64")]
pub mod arm;
pub mod attention;
pub mod bf16_gemm;
pub mod block_scales;
pub mod dense;
pub mod extra_types;
pub mod int8_gemm;
pub mod interleaved;
mod iquant_grids;
pub mod kv_layout;

use std::sync::Arc;

use candle_core::quantized::{GgmlDType, QMatMul, QTensor};
use candle_core::{DType, Device, Module, Tensor};

use crate::extra_types::ExtraType;

/// A matmul weight as the kernels hold it: candle's (dense or ggml blocks), or block formats
/// repacked into 16-row tiles for `interleaved`.
#[derive(Debug, Clone)]
pub enum Weight {
    /// A dense tensor or quantized blocks in ggml's layout.
    Candle(QMatMul),
    /// A block format in interleaved tiles (CPU with AVX-512 VNNI, or Arm with dotprod).
    Interleaved(Arc<interleaved::Interleaved>),
}

impl Weight {
    /// Whether the weight is stored in quantized blocks (rather than a dense float tensor).
    pub fn is_quantized(&self) -> bool {
        matches!(self, Self::Interleaved(_) | Self::Candle(QMatMul::QTensor(_)))
    }

    /// The weight in the layout its fastest kernel reads: block formats on a CPU that runs
    /// `interleaved` are repacked (the tensor is copied once; `GgufWeights` repacks straight
    /// from the file instead), everything else stays as it is.
    pub fn prepare(q: QTensor, device: &Device) -> candle_core::Result<Self> {
        match repacked_format(q.dtype(), device) {
            Some(format) => {
                let (n, k) = q.shape().dims2()?;
                let tiles =
                    interleaved::Interleaved::repack(format, &q.data()?, n, k).map_err(candle_core::Error::Msg)?;
                Ok(Self::Interleaved(Arc::new(tiles)))
            }
            None => Ok(Self::Candle(QMatMul::from_arc(Arc::new(q))?)),
        }
    }
}

/// The tile format `dtype` weights on `device` are repacked into, if they are.
pub fn repacked_format(dtype: GgmlDType, device: &Device) -> Option<interleaved::Format> {
    runs_tiled(interleaved::Format::of(dtype), device)
}

/// The tile format weights of a type candle lacks are read into on `device`, if they are
/// (elsewhere they are re-encoded as Q8_0 blocks).
pub fn repacked_extra_format(ty: ExtraType, device: &Device) -> Option<interleaved::Format> {
    runs_tiled(interleaved::Format::of_extra(ty), device)
}

fn runs_tiled(format: Option<interleaved::Format>, device: &Device) -> Option<interleaved::Format> {
    format.filter(|f| device.is_cpu() && f.runs_fast())
}

/// The SIMD features this build was compiled for: what the compiler may use in every loop it
/// vectorizes, and what code gated by `cfg(target_feature)` assumes (candle's f16 conversions).
/// candle 0.11's quantized dot products and repacked kernels, and our int8 GEMM, check the CPU
/// at run time instead, so a portable wheel (x86-64-v3: avx2, fma, f16c, no avx512f) still takes
/// their AVX-512 VNNI paths where the CPU has them.
pub fn compiled_cpu_features() -> Vec<&'static str> {
    #[allow(unused_mut)]
    let mut out = Vec::new();
    macro_rules! feature {
        ($($f:literal),*) => {$(
            if cfg!(target_feature = $f) {
                out.push($f);
            }
        )*};
    }
    feature!("sse4.1", "sse4.2", "avx", "avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512vnni", "neon");
    out
}

/// Seconds of CPU time on `clock` (`libc::CLOCK_THREAD_CPUTIME_ID` or `CLOCK_PROCESS_CPUTIME_ID`)
/// for the timing tests: on a shared machine, less moved by the neighbours than the wall clock.
#[cfg(test)]
pub(crate) fn cpu_seconds(clock: libc::clockid_t) -> f64 {
    let mut ts = libc::timespec { tv_sec: 0, tv_nsec: 0 };
    // SAFETY: a valid clock id and a timespec to write.
    unsafe { libc::clock_gettime(clock, &mut ts) };
    ts.tv_sec as f64 + ts.tv_nsec as f64 * 1e-9
}

/// An output buffer the tasks of `parallel_for` write into, each its own disjoint part.
#[derive(Clone, Copy)]
pub struct OutPtr(pub *mut f32);
// SAFETY: every user hands each task a disjoint range of the buffer, which outlives the tasks.
unsafe impl Send for OutPtr {}
unsafe impl Sync for OutPtr {}

/// Runs `f(i)` for every `i < items` on candle's barrier pool, the calling thread included.
/// Its workers spin between the many small products of a decode step: waking rayon's sleeping
/// workers cost more than a small product itself, and rayon's threads beside candle's spinning
/// ones fought them for the cores (Qwen2.5-Coder 0.5B decode, AMD EPYC, 2 threads: 28 → 38 tok/s).
pub fn parallel_for(items: usize, f: impl Fn(usize) + Sync) {
    candle_core::utils::barrier_pool().execute_chunked(items, |range| range.for_each(&f));
}

/// Where weights stay in ggml's layout (CPUs without the interleaved tiles), from this many rows
/// on Q8_0 weights go through the tiled kernel (`int8_gemm.rs`); below it, candle's row-by-row
/// kernel is faster. Measured before the tiles existed on Gemma 3 270M, batched decode of 2 / 4 / 8
/// sequences (aggregate tok/s relative to one sequence, AMD EPYC, 2 threads): tiled 0.75–0.91 /
/// 1.22–1.31 / 1.67–1.71, candle's 1.17 / 1.14 / 1.30.
pub const Q8_0_TILED_ROWS: usize = 4;

/// `x [rows, in] · Wᵀ` for a dense or quantized weight, float32 in and out.
pub fn matmul(x: &Tensor, weight: &Weight) -> candle_core::Result<Tensor> {
    match weight {
        Weight::Interleaved(w) => x.contiguous()?.apply_op1_no_bwd(&interleaved::InterleavedMatMul(w)),
        Weight::Candle(w) => candle_matmul(x, w),
    }
}

/// `x [rows, in] · Wᵀ` for a weight in candle's layouts.
fn candle_matmul(x: &Tensor, weight: &QMatMul) -> candle_core::Result<Tensor> {
    match weight {
        // One row streams the weights once: our GEMV reaches the bandwidth, candle's GEMM does not.
        QMatMul::Tensor(w) | QMatMul::TensorF16(w) if dense::takes(x, w) => dense::matmul(x, w),
        QMatMul::Tensor(w) | QMatMul::TensorF16(w) if bf16_gemm::takes(x, w) => bf16_gemm::matmul(x, w),
        QMatMul::Tensor(w) | QMatMul::TensorF16(w) if dense::widens(x, w) => dense::widened_matmul(x, w),
        // Half-precision weights multiply half-precision inputs; the result rejoins the
        // float32 residual stream, which keeps long residual sums accurate.
        QMatMul::Tensor(w) | QMatMul::TensorF16(w) if w.dtype() != x.dtype() => {
            weight.forward(&x.to_dtype(w.dtype())?)?.to_dtype(DType::F32)
        }
        QMatMul::QTensor(q) if x.device().is_cpu() && int8_gemm::available() && ours(q.dtype(), x.dim(0)?) => {
            let (n, k) = q.shape().dims2()?;
            let data = q.data()?;
            let format = int8_gemm::BlockFormat::of(q.dtype()).expect("checked by `ours`");
            x.contiguous()?.apply_op1_no_bwd(&int8_gemm::BlockMatMul { format, weight: &data, n, k })
        }
        QMatMul::QTensor(q) if x.dim(0)? >= DEQUANTIZED_GEMM_ROWS && x.device().is_cpu() && !candle_tiles(q) => {
            dequantized_matmul(x, q)
        }
        // Slow (the weight is expanded at every product) but correct, where candle's kernel
        // would stop the process: k-quants on Arm cores without dotprod.
        QMatMul::QTensor(q) if x.device().is_cpu() && !candle_runs(q.dtype()) => dequantized_matmul(x, q),
        // candle takes its repacked Q6_K kernel from 2 rows on and a row-by-row one below, which
        // adds in another order: a prompt's last row would then differ from the same row
        // computed alone after a reused prefix, or inside a batch. One row goes through the
        // repacked kernel too, as two (the copy costs one more row of products, not bandwidth).
        QMatMul::QTensor(q)
            if q.dtype() == GgmlDType::Q6K && candle_tiles(q) && x.dim(0)? == 1 && x.device().is_cpu() =>
        {
            weight.forward(&Tensor::cat(&[x, x], 0)?)?.narrow(0, 0, 1)
        }
        _ => weight.forward(x),
    }
}

/// Whether our int8 GEMM multiplies a `dtype` weight by `rows` activation rows: always for the
/// types candle runs with scalar code (Q4_1, Q5_0, Q5_1), from `Q8_0_TILED_ROWS` rows for Q8_0
/// and Q4_0 (whose one-row products candle has SIMD kernels for), and always for those two where
/// candle's kernels cannot run (`candle_runs`). Measured on SmolLM2-135M Q4_1, one thread, AMD
/// EPYC (tok/s per CPU-second, candle's scalar kernel → ours): 128-token prefill 48 → 287,
/// decode 38 → 52.
fn ours(dtype: GgmlDType, rows: usize) -> bool {
    match dtype {
        GgmlDType::Q4_1 | GgmlDType::Q5_0 | GgmlDType::Q5_1 => true,
        GgmlDType::Q8_0 | GgmlDType::Q4_0 => rows >= Q8_0_TILED_ROWS || !candle_runs(dtype),
        _ => false,
    }
}

/// Whether candle 0.11's CPU kernels for `dtype` weights run on this CPU. Its NEON dot products
/// of Q4_0, Q8_0 and k-quant blocks (`vec_dot_q4_0_q8_0`, `vec_dot_q8_0_q8_0`,
/// `vec_dot_q{2..6}k_q8k`) issue `sdot` without checking for the dot-product extension, so on Arm
/// cores that lack it (Cortex-A72: Raspberry Pi 4, Graviton 1) they stop the process with
/// SIGILL; its repacked kernels do check, and its Q4_1/Q5_0/Q5_1 ones are scalar.
pub fn candle_runs(dtype: GgmlDType) -> bool {
    #[cfg(target_arch = "aarch64")]
    if matches!(
        dtype,
        GgmlDType::Q4_0
            | GgmlDType::Q8_0
            | GgmlDType::Q2K
            | GgmlDType::Q3K
            | GgmlDType::Q4K
            | GgmlDType::Q5K
            | GgmlDType::Q6K
            | GgmlDType::Q8K
    ) {
        return arm::Features::get().dotprod;
    }
    let _ = dtype;
    true
}

/// From this many rows on, a quantized weight that has no tiled kernel (neither ours for Q8_0
/// nor candle's for Q4_K/Q6_K) is expanded to float32 slab by slab and multiplied with the dense
/// GEMM: candle's generic quantized CPU matmul computes one dot product at a time, which suits
/// decode (bandwidth-bound) and short chunks, but a long prefill is compute-bound and a blocked
/// float32 GEMM goes further once the per-call de-quantization is spread over enough rows.
/// Measured on Gemma 3 270M with Q8_0 weights through that generic path, 2 cores (tok/s
/// quantized / de-quantized): 128 rows 233 / 164, 256 rows 234 / 189, 512 rows 170 / 262.
pub const DEQUANTIZED_GEMM_ROWS: usize = 384;

/// Whether candle multiplies this weight with its own tiled (repacked) CPU kernels, which beat
/// the de-quantized GEMM: Q4_K and Q6_K whose rows are whole 256-value super-blocks (measured on
/// Gemma 3 270M: 512-token prefill 278 tok/s with those through the GEMM, 353 without).
fn candle_tiles(q: &QTensor) -> bool {
    let k = q.shape().dims().last().copied().unwrap_or(0);
    matches!(q.dtype(), GgmlDType::Q4K | GgmlDType::Q6K) && k % 256 == 0
}

/// Elements of one de-quantized slab (16 MiB of float32): bounds the temporary memory even
/// for a 262k-row vocabulary projection.
const SLAB_ELEMS: usize = 4 << 20;

/// `x [m, k] · qᵀ` for a quantized `q [n, k]`, de-quantizing `q` in bounded slabs of rows.
fn dequantized_matmul(x: &Tensor, q: &QTensor) -> candle_core::Result<Tensor> {
    dequantized_matmul_in_slabs(x, q, SLAB_ELEMS)
}

fn dequantized_matmul_in_slabs(x: &Tensor, q: &QTensor, slab_elems: usize) -> candle_core::Result<Tensor> {
    let device = x.device();
    let (n, k) = q.shape().dims2()?;
    if n * k <= slab_elems {
        return x.matmul(&q.dequantize(device)?.t()?);
    }
    let dtype = q.dtype();
    let row_bytes = k / dtype.block_size() * dtype.type_size();
    let data = q.data()?;
    let slab_rows = (slab_elems / k).max(1);
    let mut parts = Vec::with_capacity(n.div_ceil(slab_rows));
    for start in (0..n).step_by(slab_rows) {
        let rows = slab_rows.min(n - start);
        let bytes = &data[start * row_bytes..(start + rows) * row_bytes];
        let slab = candle_core::quantized::ggml_file::qtensor_from_ggml(dtype, bytes, vec![rows, k], device)?;
        parts.push(x.matmul(&slab.dequantize(device)?.t()?)?);
    }
    Tensor::cat(&parts, 1)
}

/// What the kernels' tests compare against.
#[cfg(test)]
pub(crate) mod reference {
    use candle_core::quantized::{GgmlDType, QMatMul, QTensor};
    use candle_core::{Module, Tensor};

    /// candle's quantized product `x · qᵀ`, and `|x| · |q|ᵀ` (the scale a kernel's difference
    /// from it is bounded relative to: the two add the same products in other orders, and
    /// candle rounds the offset formats' `d·Σq` to f16), both flattened.
    pub fn candle_product(q: QTensor, x: &Tensor) -> (Vec<f32>, Vec<f32>) {
        let dev = x.device();
        let magnitude = x.abs().unwrap().matmul(&q.dequantize(dev).unwrap().abs().unwrap().t().unwrap()).unwrap();
        let want = if super::candle_runs(q.dtype()) {
            QMatMul::from_qtensor(q).unwrap().forward(x).unwrap()
        } else {
            // What candle's kernel computes (x quantized as its kernel quantizes it, times the
            // de-quantized weight), where that kernel would SIGILL.
            let blocks =
                if matches!(q.dtype(), GgmlDType::Q4_0 | GgmlDType::Q8_0) { GgmlDType::Q8_0 } else { GgmlDType::Q8K };
            let xq = QTensor::quantize(x, blocks).unwrap().dequantize(dev).unwrap();
            xq.matmul(&q.dequantize(dev).unwrap().t().unwrap()).unwrap()
        };
        (want.flatten_all().unwrap().to_vec1().unwrap(), magnitude.flatten_all().unwrap().to_vec1().unwrap())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;

    /// Q5_K: a type neither our int8 GEMM nor candle's tiles take, so the GEMM path runs.
    #[test]
    fn dequantized_gemm_equals_the_dense_product_whole_and_in_slabs() {
        let dev = Device::Cpu;
        let w = Tensor::randn(0f32, 1.0, (50, 256), &dev).unwrap();
        let q = QTensor::quantize(&w, GgmlDType::Q5K).unwrap();
        let x = Tensor::randn(0f32, 1.0, (DEQUANTIZED_GEMM_ROWS, 256), &dev).unwrap();
        let want = x.matmul(&q.dequantize(&dev).unwrap().t().unwrap()).unwrap();
        let via_matmul = matmul(&x, &Weight::Candle(QMatMul::from_qtensor(q).unwrap())).unwrap();
        let QMatMul::QTensor(q) = QMatMul::from_qtensor(QTensor::quantize(&w, GgmlDType::Q5K).unwrap()).unwrap() else {
            panic!("Q5_K stays quantized")
        };
        let in_slabs = dequantized_matmul_in_slabs(&x, &q, 256 * 7).unwrap();
        for got in [via_matmul, in_slabs] {
            let diff = (got - &want).unwrap().abs().unwrap().max_all().unwrap().to_scalar::<f32>().unwrap();
            assert!(diff < 1e-4, "max difference {diff}");
        }
    }
}
