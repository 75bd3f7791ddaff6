//! The Arm instructions our NEON kernels need whose intrinsics are not stable Rust yet (1.95:
//! `stdarch_neon_dotprod`, `stdarch_neon_i8mm`), each as one instruction of inline assembly, and
//! which of them this CPU has.
//!
//! Every caller checks the extension at run time (`Features::get`) before entering a function
//! compiled with it: candle 0.11's own NEON Q4_0/Q8_0 dot products do not, which is why
//! `kernels::candle_runs` keeps those formats away from candle on cores without dotprod.

use std::arch::aarch64::{float32x4_t, int32x4_t, int8x16_t, vld1q_u16};
use std::arch::asm;

/// The optional Arm extensions the kernels use, detected once.
#[derive(Debug, Clone, Copy)]
pub struct Features {
    /// `sdot`/`udot` (FEAT_DotProd: Cortex-A76, Neoverse N1, Apple M1 and later).
    pub dotprod: bool,
    /// `smmla` (FEAT_I8MM: Neoverse V1/N2, Apple M2 and later).
    pub i8mm: bool,
}

impl Features {
    /// What this CPU has (cached by the standard library's detection).
    pub fn get() -> Self {
        Self {
            dotprod: std::arch::is_aarch64_feature_detected!("dotprod"),
            i8mm: std::arch::is_aarch64_feature_detected!("i8mm"),
        }
    }
}

/// `acc + a·b` per 4-byte group: lane `i` adds the dot product of bytes `4i..4i + 4`.
///
/// # Safety
/// The CPU has FEAT_DotProd (`Features::get`).
#[inline]
#[target_feature(enable = "dotprod")]
pub unsafe fn sdot(acc: int32x4_t, a: int8x16_t, b: int8x16_t) -> int32x4_t {
    let mut acc = acc;
    asm!(
        "sdot {acc:v}.4s, {a:v}.16b, {b:v}.16b",
        acc = inout(vreg) acc, a = in(vreg) a, b = in(vreg) b,
        options(pure, nomem, nostack, preserves_flags)
    );
    acc
}

/// `acc + a·b[L]`: lane `i` adds the dot product of bytes `4i..4i + 4` of `a` with the 4-byte
/// group `L` of `b` (the by-element form: one activation register serves four groups).
///
/// # Safety
/// The CPU has FEAT_DotProd (`Features::get`).
#[inline]
#[target_feature(enable = "dotprod")]
pub unsafe fn sdot_lane<const L: i32>(acc: int32x4_t, a: int8x16_t, b: int8x16_t) -> int32x4_t {
    let mut acc = acc;
    asm!(
        "sdot {acc:v}.4s, {a:v}.16b, {b:v}.4b[{l}]",
        acc = inout(vreg) acc, a = in(vreg) a, b = in(vreg) b, l = const L,
        options(pure, nomem, nostack, preserves_flags)
    );
    acc
}

/// `acc + a·b` for `a`, `b` as 2×8 matrices of int8 rows, `acc` as a 2×2 int32 one:
/// lanes `[a0·b0, a0·b1, a1·b0, a1·b1]`, each a dot product of 8 bytes.
///
/// # Safety
/// The CPU has FEAT_I8MM (`Features::get`).
#[inline]
#[target_feature(enable = "i8mm")]
pub unsafe fn smmla(acc: int32x4_t, a: int8x16_t, b: int8x16_t) -> int32x4_t {
    let mut acc = acc;
    asm!(
        "smmla {acc:v}.4s, {a:v}.16b, {b:v}.16b",
        acc = inout(vreg) acc, a = in(vreg) a, b = in(vreg) b,
        options(pure, nomem, nostack, preserves_flags)
    );
    acc
}

/// Eight float16 values at `p` widened to float32 (`fcvtl`/`fcvtl2`: base ARMv8, unlike the
/// float16 arithmetic of FEAT_FP16; asm because Rust's `float16x4_t` is not stable yet).
///
/// # Safety
/// `p` points to 8 readable float16 values.
#[inline(always)]
pub unsafe fn widen_f16x8(p: *const half::f16) -> [float32x4_t; 2] {
    let h = vld1q_u16(p as *const u16);
    let (lo, hi): (float32x4_t, float32x4_t);
    asm!(
        "fcvtl {lo:v}.4s, {h:v}.4h",
        "fcvtl2 {hi:v}.4s, {h:v}.8h",
        h = in(vreg) h, lo = out(vreg) lo, hi = out(vreg) hi,
        options(pure, nomem, nostack, preserves_flags)
    );
    [lo, hi]
}

#[cfg(test)]
mod probe {
    use super::super::{attention, dense, int8_gemm, interleaved};
    use candle_core::quantized::{GgmlDType, QMatMul, QTensor};
    use candle_core::{DType, Device, Module, Tensor};

    /// Deterministic values in [-1, 1) (the probe's counts must not depend on a random seed).
    fn values(len: usize, seed: u64) -> Vec<f32> {
        let mut state = seed.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
        (0..len)
            .map(|_| {
                state = state.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
                ((state >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
            })
            .collect()
    }

    fn dtype(name: &str) -> GgmlDType {
        match name {
            "q4_0" => GgmlDType::Q4_0,
            "q4_1" => GgmlDType::Q4_1,
            "q5_0" => GgmlDType::Q5_0,
            "q5_1" => GgmlDType::Q5_1,
            "q8_0" => GgmlDType::Q8_0,
            "q3_k" => GgmlDType::Q3K,
            "q4_k" => GgmlDType::Q4K,
            "q5_k" => GgmlDType::Q5K,
            "q6_k" => GgmlDType::Q6K,
            other => panic!("unknown format {other}"),
        }
    }

    /// One kernel run `reps` times, for `benches/arm/count.sh` to count instructions under qemu
    /// (ignored: it checks nothing). `CANDLEWICK_PROBE` is `int8:PATH:FORMAT:M:K:N:REPS` (our int8
    /// GEMM on `Path::name` PATH), `tiles:PATH:FORMAT:M:K:N:REPS` (the interleaved tiles, on
    /// `portable` or `neon-dotprod`; repacking is not counted), `candle:FORMAT:M:K:N:REPS`
    /// (candle's quantized matmul), `dense:ISA:DTYPE:N:K:REPS` (`neon` or `portable`; f32, bf16,
    /// f16) or
    /// `attn:SIMD:KEYS:REPS` (f16 cache; `neon` or `portable`).
    #[test]
    #[ignore]
    fn kernel_probe() {
        let spec = std::env::var("CANDLEWICK_PROBE").expect("CANDLEWICK_PROBE");
        let f: Vec<&str> = spec.split(':').collect();
        let num = |i: usize| f[i].parse::<usize>().expect("a number");
        let dev = Device::Cpu;
        // Our GEMMs' probes: the path by name, the weight's blocks, the activations.
        let gemm = || {
            let path = *int8_gemm::Path::runnable().iter().find(|p| p.name() == f[1]).expect("a path this CPU runs");
            let (m, k, n, reps) = (num(3), num(4), num(5), num(6));
            let w = Tensor::from_vec(values(n * k, 1), (n, k), &dev).unwrap();
            let data = QTensor::quantize(&w, dtype(f[2])).unwrap().data().unwrap().to_vec();
            (path, data, values(m * k, 2), (m, k, n, reps))
        };
        match f[0] {
            "int8" => {
                let format = int8_gemm::BlockFormat::of(dtype(f[2])).expect("a 32-value format");
                let (path, data, x, (m, k, n, reps)) = gemm();
                for _ in 0..reps {
                    std::hint::black_box(int8_gemm::matmul_with(format, &x, m, k, &data, n, path));
                }
            }
            "tiles" => {
                let format = interleaved::Format::of(dtype(f[2])).expect("a tile format");
                let (path, data, x, (m, k, n, reps)) = gemm();
                let tiles = interleaved::Interleaved::repack(format, &data, n, k).unwrap();
                for _ in 0..reps {
                    std::hint::black_box(tiles.matmul_with(&x, m, path));
                }
            }
            "candle" => {
                let (m, k, n, reps) = (num(2), num(3), num(4), num(5));
                let w = Tensor::from_vec(values(n * k, 1), (n, k), &dev).unwrap();
                let q = QMatMul::from_qtensor(QTensor::quantize(&w, dtype(f[1])).unwrap()).unwrap();
                let x = Tensor::from_vec(values(m * k, 2), (m, k), &dev).unwrap();
                for _ in 0..reps {
                    std::hint::black_box(q.forward(&x).unwrap());
                }
            }
            "dense" => {
                let isa = if f[1] == "neon" { dense::Isa::Neon } else { dense::Isa::Portable };
                let (n, k, reps) = (num(3), num(4), num(5));
                let (x, w) = (values(k, 2), values(n * k, 1));
                let wb: Vec<half::bf16> = w.iter().map(|&v| half::bf16::from_f32(v)).collect();
                let wh: Vec<half::f16> = w.iter().map(|&v| half::f16::from_f32(v)).collect();
                let weight = match f[2] {
                    "f32" => dense::Weight::F32(&w),
                    "bf16" => dense::Weight::Bf16(&wb),
                    _ => dense::Weight::F16(&wh),
                };
                let mut out = vec![0f32; n];
                for _ in 0..reps {
                    dense::gemv(&x, weight, &mut out, isa);
                    std::hint::black_box(&out);
                }
            }
            "attn" => {
                let (keys, reps) = (num(2), num(3));
                let (heads, kv_heads, d) = (8, 2, 64);
                let cache = |seed| {
                    Tensor::from_vec(values(kv_heads * keys * d, seed), (1, kv_heads, keys, d), &dev)
                        .unwrap()
                        .to_dtype(DType::F16)
                        .unwrap()
                };
                let (k, v) = (cache(3), cache(4));
                let q = Tensor::from_vec(values(heads * d, 5), (1, heads, 1, d), &dev).unwrap();
                let p = attention::Params { heads, kv_heads, head_dim: d, scale: 0.125, softcap: None };
                for _ in 0..reps {
                    let view = crate::kv_layout::KvView { k: &k, v: &v, first: 0, len: keys };
                    std::hint::black_box(
                        attention::decode_with(
                            &q,
                            &view,
                            p,
                            if f[1] == "neon" { attention::TilePath::Neon } else { attention::TilePath::Portable },
                        )
                        .unwrap(),
                    );
                }
            }
            other => panic!("unknown probe {other}"),
        }
    }
}
