//! Dense float32 / bfloat16 / float16 matrix-vector products for decode on the CPU.
//!
//! A decode step multiplies one row of activations by every weight: the work is reading the
//! weights once, so the kernel must stream them at memory bandwidth. candle's `matmul` goes
//! through the `gemm` crate, which for half-precision weights converts and packs its operands
//! and for one row reaches a fraction of the bandwidth (measured in BENCHMARKS.md). Here each
//! weight row is read once and multiplied with the (small, cached) activation row, rows split
//! over candle's barrier pool (`kernels::parallel_for`).
//!
//! The activation row is rounded to the weight's type first, as the dense path always did
//! (half-precision weights multiply half-precision inputs): every kernel then forms the same
//! exact products and differs from the others only in the order of its float32 additions.
//! The kernel is chosen at run time — AVX-512 BF16 (`vdpbf16ps`), AVX-512F, AVX2 + FMA (+ F16C),
//! NEON on aarch64, or portable code — so one binary runs anywhere and uses what the CPU has.

use candle_core::{CpuStorage, DType, Storage, Tensor};
use half::{bf16, f16};

/// How dense CPU products run, from `CANDLEWICK_DENSE_KERNELS` (read once): unset or `auto`
/// for the kernels here on the best instruction set, `portable` for them in plain Rust, `candle`
/// for candle's own matmul everywhere (to measure against, or to rule these kernels out).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mode {
    /// The kernels here, on `detected()`.
    Auto,
    /// The kernels here, portable code only.
    Portable,
    /// candle's matmul.
    Candle,
}

/// The mode the environment asks for.
pub fn mode() -> Mode {
    static MODE: std::sync::OnceLock<Mode> = std::sync::OnceLock::new();
    *MODE.get_or_init(|| match std::env::var("CANDLEWICK_DENSE_KERNELS").as_deref() {
        Ok("portable") => Mode::Portable,
        Ok("candle") => Mode::Candle,
        _ => Mode::Auto,
    })
}

fn isa_for_mode() -> Isa {
    if mode() == Mode::Portable {
        Isa::Portable
    } else {
        detected()
    }
}

/// Whether `matmul` takes `x · wᵀ`: one float32 row on the CPU against a half-precision 2-D
/// weight. Float32 weights stay with candle: its GEMM streams them at least as fast as `gemv`
/// (measured with the `timing` test below: 262144 x 640, 2 threads, 9–12 GB/s candle,
/// 7–11 GB/s ours), while for bfloat16 it reaches 0.6 GB/s against our 10–15.
pub fn takes(x: &Tensor, w: &Tensor) -> bool {
    mode() != Mode::Candle
        && x.device().is_cpu()
        && x.dtype() == DType::F32
        && x.dims().len() == 2
        && x.dims()[0] == 1
        && w.dims().len() == 2
        && w.dims()[1] == x.dims()[1]
        && w.is_contiguous()
        && matches!(w.dtype(), DType::BF16 | DType::F16)
}

/// `x [1, k] · wᵀ` for a dense `w [n, k]` (see `takes`) through `gemv`, float32 out.
pub fn matmul(x: &Tensor, w: &Tensor) -> candle_core::Result<Tensor> {
    let n = w.dim(0)?;
    let xs = x.flatten_all()?.to_vec1::<f32>()?;
    let mut out = vec![0f32; n];
    let (storage, layout) = w.storage_and_layout();
    let range = layout.start_offset()..layout.start_offset() + w.elem_count();
    match &*storage {
        Storage::Cpu(CpuStorage::F32(v)) => gemv(&xs, Weight::F32(&v[range]), &mut out, isa_for_mode()),
        Storage::Cpu(CpuStorage::BF16(v)) => gemv(&xs, Weight::Bf16(&v[range]), &mut out, isa_for_mode()),
        Storage::Cpu(CpuStorage::F16(v)) => gemv(&xs, Weight::F16(&v[range]), &mut out, isa_for_mode()),
        _ => candle_core::bail!("dense gemv: unsupported weight storage {:?}", w.dtype()),
    }
    drop(storage);
    Tensor::from_vec(out, (1, n), x.device())
}

/// Whether `widened_matmul` takes `x · wᵀ`: float32 rows on the CPU against a half-precision weight.
pub fn widens(x: &Tensor, w: &Tensor) -> bool {
    mode() != Mode::Candle
        && x.device().is_cpu()
        && x.dtype() == DType::F32
        && x.dims().len() == 2
        && w.dims().len() == 2
        && matches!(w.dtype(), DType::BF16 | DType::F16)
}

/// Elements of one widened slab (16 MiB of float32): bounds the temporary memory even for a
/// 262k-row vocabulary projection.
const SLAB_ELEMS: usize = 4 << 20;

/// `x [m, k] · wᵀ` for a half-precision `w [n, k]`, widened to float32 slab by slab and
/// multiplied by candle's float32 GEMM. candle's bfloat16 GEMM runs far below its float32 one on
/// CPUs (no bf16 micro-kernel: it converts inside the loop); widening costs one pass over the
/// weight, which a prefill of many rows amortises. `x` stays float32, so this is also a little
/// more accurate than rounding the activations to the weight's type.
pub fn widened_matmul(x: &Tensor, w: &Tensor) -> candle_core::Result<Tensor> {
    let (n, k) = w.dims2()?;
    let slab_rows = (SLAB_ELEMS / k.max(1)).max(1);
    if n <= slab_rows {
        return x.matmul(&w.to_dtype(DType::F32)?.t()?);
    }
    let mut parts = Vec::with_capacity(n.div_ceil(slab_rows));
    for start in (0..n).step_by(slab_rows) {
        let rows = slab_rows.min(n - start);
        parts.push(x.matmul(&w.narrow(0, start, rows)?.to_dtype(DType::F32)?.t()?)?);
    }
    Tensor::cat(&parts, 1)
}

/// The instruction sets a GEMV kernel can use, best first.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Isa {
    /// Plain Rust: any CPU.
    Portable,
    /// NEON (every aarch64 CPU; half types widened in registers). Ordered below the x86 sets,
    /// which an aarch64 CPU never reports, so `isa.min(detected())` keeps to it there.
    Neon,
    /// AVX2 with FMA and F16C.
    Avx2,
    /// AVX-512F (16 floats per instruction; half types widened in registers).
    Avx512,
    /// AVX-512 BF16: `vdpbf16ps` multiplies and accumulates 32 bfloat16 pairs per instruction.
    Avx512Bf16,
}

/// The best instruction set this CPU offers (detected once).
pub fn detected() -> Isa {
    static ISA: std::sync::OnceLock<Isa> = std::sync::OnceLock::new();
    *ISA.get_or_init(|| {
        #[cfg(target_arch = "x86_64")]
        {
            let avx512 = is_x86_feature_detected!("avx512f") && is_x86_feature_detected!("avx512bw");
            if avx512 && is_x86_feature_detected!("avx512bf16") {
                return Isa::Avx512Bf16;
            }
            if avx512 {
                return Isa::Avx512;
            }
            if is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma") && is_x86_feature_detected!("f16c") {
                return Isa::Avx2;
            }
        }
        if cfg!(target_arch = "aarch64") {
            Isa::Neon
        } else {
            Isa::Portable
        }
    })
}

/// A row-major `[n, k]` weight in one of the dense float types.
#[derive(Debug, Clone, Copy)]
pub enum Weight<'a> {
    /// float32.
    F32(&'a [f32]),
    /// bfloat16.
    Bf16(&'a [bf16]),
    /// float16.
    F16(&'a [f16]),
}

/// The fewest output rows per parallel task (a 640-row projection still splits over a few threads).
const MIN_ROWS_PER_TASK: usize = 16;
/// Tasks per thread: enough to balance uneven threads, few enough that a 262k-row vocabulary
/// projection is not thousands of tiny tasks (their scheduling cost halved the bandwidth).
const TASKS_PER_THREAD: usize = 4;

/// `out[j] = Σ_i x[i] · w[j, i]` for `w` `[out.len(), x.len()]`, on `isa` (at most `detected()`).
pub fn gemv(x: &[f32], w: Weight<'_>, out: &mut [f32], isa: Isa) {
    let k = x.len();
    let isa = isa.min(detected());
    match w {
        Weight::F32(w) => {
            assert_eq!(w.len(), k * out.len(), "weight shape");
            par_rows(out, |rows, o| kernel_f32(x, &w[rows * k..], k, o, isa));
        }
        Weight::Bf16(w) => {
            assert_eq!(w.len(), k * out.len(), "weight shape");
            let xh: Vec<bf16> = x.iter().map(|&v| bf16::from_f32(v)).collect();
            par_rows(out, |rows, o| kernel_bf16(&xh, &w[rows * k..], k, o, isa));
        }
        Weight::F16(w) => {
            assert_eq!(w.len(), k * out.len(), "weight shape");
            let xh: Vec<f32> = x.iter().map(|&v| f16::from_f32(v).to_f32()).collect();
            par_rows(out, |rows, o| kernel_f16(&xh, &w[rows * k..], k, o, isa));
        }
    }
}

/// Runs `f(first_row, out_chunk)` over chunks of the output in parallel.
fn par_rows(out: &mut [f32], f: impl Fn(usize, &mut [f32]) + Sync) {
    let tasks = (candle_core::utils::barrier_pool().n_workers() + 1) * TASKS_PER_THREAD;
    let rows = out.len().div_ceil(tasks).max(MIN_ROWS_PER_TASK);
    let (len, ptr) = (out.len(), super::OutPtr(out.as_mut_ptr()));
    super::parallel_for(len.div_ceil(rows), |i| {
        // The closure must capture the whole `Send` wrapper, not its raw-pointer field.
        #[allow(clippy::redundant_locals)]
        let ptr = ptr;
        let start = i * rows;
        // SAFETY: chunk i is rows start..start + rows of `out`, written by this task alone.
        let chunk = unsafe { std::slice::from_raw_parts_mut(ptr.0.add(start), rows.min(len - start)) };
        f(start, chunk);
    });
}

fn kernel_f32(x: &[f32], w: &[f32], k: usize, out: &mut [f32], isa: Isa) {
    #[cfg(target_arch = "x86_64")]
    // SAFETY: `isa` is at most what `detected()` found on this CPU.
    unsafe {
        match isa {
            Isa::Avx512 | Isa::Avx512Bf16 => return x86::f32_avx512(x, w, k, out),
            Isa::Avx2 => return x86::f32_avx2(x, w, k, out),
            Isa::Portable | Isa::Neon => {}
        }
    }
    #[cfg(target_arch = "aarch64")]
    if isa == Isa::Neon {
        // SAFETY: NEON is part of every aarch64 CPU.
        return unsafe { arm::f32_neon(x, w, k, out) };
    }
    let _ = isa;
    for (j, o) in out.iter_mut().enumerate() {
        *o = dot_portable(x, &w[j * k..(j + 1) * k], |v| v);
    }
}

fn kernel_bf16(x: &[bf16], w: &[bf16], k: usize, out: &mut [f32], isa: Isa) {
    #[cfg(target_arch = "x86_64")]
    // SAFETY: `isa` is at most what `detected()` found on this CPU.
    unsafe {
        match isa {
            Isa::Avx512Bf16 => return x86::bf16_avx512bf16(x, w, k, out),
            Isa::Avx512 => return x86::bf16_avx512(x, w, k, out),
            Isa::Avx2 => return x86::bf16_avx2(x, w, k, out),
            Isa::Portable | Isa::Neon => {}
        }
    }
    #[cfg(target_arch = "aarch64")]
    if isa == Isa::Neon {
        // SAFETY: NEON is part of every aarch64 CPU.
        return unsafe { arm::bf16_neon(x, w, k, out) };
    }
    let _ = isa;
    let xf: Vec<f32> = x.iter().map(|v| v.to_f32()).collect();
    for (j, o) in out.iter_mut().enumerate() {
        *o = dot_portable(&xf, &w[j * k..(j + 1) * k], bf16::to_f32);
    }
}

fn kernel_f16(x: &[f32], w: &[f16], k: usize, out: &mut [f32], isa: Isa) {
    #[cfg(target_arch = "x86_64")]
    // SAFETY: `isa` is at most what `detected()` found on this CPU.
    unsafe {
        match isa {
            Isa::Avx512 | Isa::Avx512Bf16 => return x86::f16_avx512(x, w, k, out),
            Isa::Avx2 => return x86::f16_avx2(x, w, k, out),
            Isa::Portable | Isa::Neon => {}
        }
    }
    #[cfg(target_arch = "aarch64")]
    if isa == Isa::Neon {
        // SAFETY: NEON is part of every aarch64 CPU.
        return unsafe { arm::f16_neon(x, w, k, out) };
    }
    let _ = isa;
    for (j, o) in out.iter_mut().enumerate() {
        *o = dot_portable(x, &w[j * k..(j + 1) * k], f16::to_f32);
    }
}

/// A dot product with eight running sums, which the compiler can keep in registers (and vectorise).
#[inline(always)]
fn dot_portable<T: Copy>(x: &[f32], w: &[T], to_f32: impl Fn(T) -> f32) -> f32 {
    let mut acc = [0f32; 8];
    let (xc, xt) = x.split_at(x.len() / 8 * 8);
    let (wc, wt) = w.split_at(xc.len());
    for (xs, ws) in xc.chunks_exact(8).zip(wc.chunks_exact(8)) {
        for l in 0..8 {
            acc[l] += xs[l] * to_f32(ws[l]);
        }
    }
    let mut s: f32 = acc.iter().sum();
    for (a, b) in xt.iter().zip(wt) {
        s += a * to_f32(*b);
    }
    s
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use super::*;
    // std::arch has its own `bf16` type; ours is half's.
    use half::bf16;
    use std::arch::x86_64::*;

    // One row at a time, two running sums along it. Measured (262144 x 640, 2 threads): four
    // rows interleaved reached 7 GB/s on float32 and 6 GB/s on bfloat16, one row 11 and 15 GB/s.
    macro_rules! gemv_rows {
        ($out:ident, $k:ident, $step:expr, $zero:expr, $fma:expr, $reduce:expr, $tail:expr) => {{
            let main = $k / $step * $step;
            let main2 = $k / (2 * $step) * (2 * $step);
            for j in 0..$out.len() {
                let (mut a0, mut a1) = ($zero, $zero);
                let mut i = 0;
                while i < main2 {
                    a0 = $fma(a0, j, i);
                    a1 = $fma(a1, j, i + $step);
                    i += 2 * $step;
                }
                if i < main {
                    a0 = $fma(a0, j, i);
                }
                $out[j] = $reduce(a0) + $reduce(a1) + $tail(j, main);
            }
        }};
    }

    #[target_feature(enable = "avx512f")]
    pub(super) unsafe fn f32_avx512(x: &[f32], w: &[f32], k: usize, out: &mut [f32]) {
        let (xp, wp) = (x.as_ptr(), w.as_ptr());
        gemv_rows!(
            out,
            k,
            16,
            _mm512_setzero_ps(),
            |a, row: usize, i: usize| _mm512_fmadd_ps(
                _mm512_loadu_ps(wp.add(row * k + i)),
                _mm512_loadu_ps(xp.add(i)),
                a
            ),
            |a| _mm512_reduce_add_ps(a),
            |row: usize, from: usize| (from..k).map(|i| x[i] * w[row * k + i]).sum::<f32>()
        )
    }

    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn f32_avx2(x: &[f32], w: &[f32], k: usize, out: &mut [f32]) {
        let (xp, wp) = (x.as_ptr(), w.as_ptr());
        gemv_rows!(
            out,
            k,
            8,
            _mm256_setzero_ps(),
            |a, row: usize, i: usize| _mm256_fmadd_ps(
                _mm256_loadu_ps(wp.add(row * k + i)),
                _mm256_loadu_ps(xp.add(i)),
                a
            ),
            |a| hsum256(a),
            |row: usize, from: usize| (from..k).map(|i| x[i] * w[row * k + i]).sum::<f32>()
        )
    }

    #[target_feature(enable = "avx512f,avx512bw,avx512bf16")]
    pub(super) unsafe fn bf16_avx512bf16(x: &[bf16], w: &[bf16], k: usize, out: &mut [f32]) {
        let (xp, wp) = (x.as_ptr() as *const __m512i, w.as_ptr());
        gemv_rows!(
            out,
            k,
            32,
            _mm512_setzero_ps(),
            |a, row: usize, i: usize| {
                let wv: __m512bh = std::mem::transmute(_mm512_loadu_si512(wp.add(row * k + i) as *const __m512i));
                let xv: __m512bh =
                    std::mem::transmute(_mm512_loadu_si512((xp as *const bf16).add(i) as *const __m512i));
                _mm512_dpbf16_ps(a, wv, xv)
            },
            |a| _mm512_reduce_add_ps(a),
            |row: usize, from: usize| (from..k).map(|i| x[i].to_f32() * w[row * k + i].to_f32()).sum::<f32>()
        )
    }

    /// Sixteen bfloat16 values widened to float32 (a bfloat16 is the top half of a float32).
    #[inline(always)]
    unsafe fn widen_bf16_16(p: *const bf16) -> __m512 {
        let h = _mm256_loadu_si256(p as *const __m256i);
        _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16))
    }

    #[target_feature(enable = "avx512f,avx512bw")]
    pub(super) unsafe fn bf16_avx512(x: &[bf16], w: &[bf16], k: usize, out: &mut [f32]) {
        let xf: Vec<f32> = x.iter().map(|v| v.to_f32()).collect();
        let (xp, wp) = (xf.as_ptr(), w.as_ptr());
        gemv_rows!(
            out,
            k,
            16,
            _mm512_setzero_ps(),
            |a, row: usize, i: usize| _mm512_fmadd_ps(
                widen_bf16_16(wp.add(row * k + i)),
                _mm512_loadu_ps(xp.add(i)),
                a
            ),
            |a| _mm512_reduce_add_ps(a),
            |row: usize, from: usize| (from..k).map(|i| xf[i] * w[row * k + i].to_f32()).sum::<f32>()
        )
    }

    #[inline(always)]
    unsafe fn widen_bf16_8(p: *const bf16) -> __m256 {
        let h = _mm_loadu_si128(p as *const __m128i);
        _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16))
    }

    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn bf16_avx2(x: &[bf16], w: &[bf16], k: usize, out: &mut [f32]) {
        let xf: Vec<f32> = x.iter().map(|v| v.to_f32()).collect();
        let (xp, wp) = (xf.as_ptr(), w.as_ptr());
        gemv_rows!(
            out,
            k,
            8,
            _mm256_setzero_ps(),
            |a, row: usize, i: usize| _mm256_fmadd_ps(widen_bf16_8(wp.add(row * k + i)), _mm256_loadu_ps(xp.add(i)), a),
            |a| hsum256(a),
            |row: usize, from: usize| (from..k).map(|i| xf[i] * w[row * k + i].to_f32()).sum::<f32>()
        )
    }

    #[target_feature(enable = "avx512f")]
    pub(super) unsafe fn f16_avx512(x: &[f32], w: &[f16], k: usize, out: &mut [f32]) {
        let (xp, wp) = (x.as_ptr(), w.as_ptr());
        gemv_rows!(
            out,
            k,
            16,
            _mm512_setzero_ps(),
            |a, row: usize, i: usize| {
                let h = _mm256_loadu_si256(wp.add(row * k + i) as *const __m256i);
                _mm512_fmadd_ps(_mm512_cvtph_ps(h), _mm512_loadu_ps(xp.add(i)), a)
            },
            |a| _mm512_reduce_add_ps(a),
            |row: usize, from: usize| (from..k).map(|i| x[i] * w[row * k + i].to_f32()).sum::<f32>()
        )
    }

    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) unsafe fn f16_avx2(x: &[f32], w: &[f16], k: usize, out: &mut [f32]) {
        let (xp, wp) = (x.as_ptr(), w.as_ptr());
        gemv_rows!(
            out,
            k,
            8,
            _mm256_setzero_ps(),
            |a, row: usize, i: usize| {
                let h = _mm_loadu_si128(wp.add(row * k + i) as *const __m128i);
                _mm256_fmadd_ps(_mm256_cvtph_ps(h), _mm256_loadu_ps(xp.add(i)), a)
            },
            |a| hsum256(a),
            |row: usize, from: usize| (from..k).map(|i| x[i] * w[row * k + i].to_f32()).sum::<f32>()
        )
    }

    #[inline(always)]
    unsafe fn hsum256(a: __m256) -> f32 {
        let s = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
        let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
        let s = _mm_add_ss(s, _mm_shuffle_ps(s, s, 1));
        _mm_cvtss_f32(s)
    }
}

#[cfg(target_arch = "aarch64")]
mod arm {
    use super::*;
    use crate::arm::widen_f16x8;
    use std::arch::aarch64::*;

    /// One weight row at a time, 8 values a step in two running sums (as the x86 kernels), the
    /// last `k % 8` values in plain Rust. `load(j, i)` gives values `i..i + 8` of row `j` and of
    /// `x` as float32 pairs of vectors.
    #[inline(always)]
    unsafe fn rows(
        k: usize,
        out: &mut [f32],
        load: impl Fn(usize, usize) -> ([float32x4_t; 2], [float32x4_t; 2]),
        tail: impl Fn(usize, usize) -> f32,
    ) {
        let main = k / 8 * 8;
        for (j, o) in out.iter_mut().enumerate() {
            let (mut a0, mut a1) = (vdupq_n_f32(0.0), vdupq_n_f32(0.0));
            for i in (0..main).step_by(8) {
                let (xv, wv) = load(j, i);
                a0 = vfmaq_f32(a0, xv[0], wv[0]);
                a1 = vfmaq_f32(a1, xv[1], wv[1]);
            }
            *o = vaddvq_f32(vaddq_f32(a0, a1)) + tail(j, main);
        }
    }

    pub(super) unsafe fn f32_neon(x: &[f32], w: &[f32], k: usize, out: &mut [f32]) {
        let pair = |p: *const f32| [vld1q_f32(p), vld1q_f32(p.add(4))];
        rows(
            k,
            out,
            |j, i| (pair(x.as_ptr().add(i)), pair(w.as_ptr().add(j * k + i))),
            |j, i| dot_portable(&x[i..], &w[j * k + i..(j + 1) * k], |v| v),
        )
    }

    /// bfloat16 widens exactly by a shift into the top half of a float32.
    pub(super) unsafe fn bf16_neon(x: &[bf16], w: &[bf16], k: usize, out: &mut [f32]) {
        let widen = |p: *const bf16| {
            let h = vld1q_u16(p as *const u16);
            [
                vreinterpretq_f32_u32(vshll_n_u16::<16>(vget_low_u16(h))),
                vreinterpretq_f32_u32(vshll_high_n_u16::<16>(h)),
            ]
        };
        let xf: Vec<f32> = x[x.len() / 8 * 8..].iter().map(|v| v.to_f32()).collect();
        rows(
            k,
            out,
            |j, i| (widen(x.as_ptr().add(i)), widen(w.as_ptr().add(j * k + i))),
            |j, i| dot_portable(&xf, &w[j * k + i..(j + 1) * k], bf16::to_f32),
        )
    }

    pub(super) unsafe fn f16_neon(x: &[f32], w: &[f16], k: usize, out: &mut [f32]) {
        rows(
            k,
            out,
            |j, i| {
                (
                    [vld1q_f32(x.as_ptr().add(i)), vld1q_f32(x.as_ptr().add(i + 4))],
                    widen_f16x8(w.as_ptr().add(j * k + i)),
                )
            },
            |j, i| dot_portable(&x[i..], &w[j * k + i..(j + 1) * k], f16::to_f32),
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn data(n: usize, k: usize) -> (Vec<f32>, Vec<f32>) {
        // Deterministic values of mixed sign and magnitude; k not a multiple of any vector width.
        let x = (0..k).map(|i| ((i * 37 % 101) as f32 - 50.0) / 37.0).collect();
        let w = (0..n * k).map(|i| ((i * 53 % 97) as f32 - 48.0) / 61.0).collect();
        (x, w)
    }

    /// The reference: float64 sums of the exact products of the rounded operands.
    fn reference(x: &[f32], w: &[f32], n: usize) -> Vec<f32> {
        let k = x.len();
        (0..n).map(|j| (0..k).map(|i| x[i] as f64 * w[j * k + i] as f64).sum::<f64>() as f32).collect()
    }

    fn close(a: &[f32], b: &[f32], what: &str) {
        for (j, (p, q)) in a.iter().zip(b).enumerate() {
            assert!((p - q).abs() <= 1e-4 * (1.0 + q.abs()), "{what} row {j}: {p} vs {q}");
        }
    }

    #[test]
    fn every_kernel_equals_the_portable_fallback_and_the_reference() {
        let isas = [Isa::Portable, Isa::Neon, Isa::Avx2, Isa::Avx512, Isa::Avx512Bf16];
        for (n, k) in [(37, 93), (64, 640), (5, 7), (33, 1024)] {
            let (x, w) = data(n, k);
            let wb: Vec<bf16> = w.iter().map(|&v| bf16::from_f32(v)).collect();
            let wh: Vec<f16> = w.iter().map(|&v| f16::from_f32(v)).collect();
            let xb: Vec<f32> = x.iter().map(|&v| bf16::from_f32(v).to_f32()).collect();
            let xh: Vec<f32> = x.iter().map(|&v| f16::from_f32(v).to_f32()).collect();
            let want_f32 = reference(&x, &w, n);
            let want_bf16 = reference(&xb, &wb.iter().map(|v| v.to_f32()).collect::<Vec<_>>(), n);
            let want_f16 = reference(&xh, &wh.iter().map(|v| v.to_f32()).collect::<Vec<_>>(), n);
            for isa in isas.into_iter().filter(|&i| i <= detected()) {
                let mut out = vec![0f32; n];
                gemv(&x, Weight::F32(&w), &mut out, isa);
                close(&out, &want_f32, &format!("f32 {isa:?} {n}x{k}"));
                gemv(&x, Weight::Bf16(&wb), &mut out, isa);
                close(&out, &want_bf16, &format!("bf16 {isa:?} {n}x{k}"));
                gemv(&x, Weight::F16(&wh), &mut out, isa);
                close(&out, &want_f16, &format!("f16 {isa:?} {n}x{k}"));
            }
        }
    }
}

#[cfg(test)]
mod timing {
    use super::*;
    use candle_core::Device;

    /// `cargo test --release --lib dense_gemv_timing -- --ignored --nocapture`: our GEMV against
    /// candle's matmul on one decode row, for a vocabulary projection and a layer's projection.
    #[test]
    #[ignore]
    fn dense_gemv_timing() {
        let dev = Device::Cpu;
        for (n, k) in [(262144usize, 640usize), (2048, 640), (640, 2048)] {
            let x = Tensor::randn(0f32, 1.0, (1, k), &dev).unwrap();
            for dtype in [DType::F32, DType::BF16] {
                let w = Tensor::randn(0f32, 1.0, (n, k), &dev).unwrap().to_dtype(dtype).unwrap();
                let reps = if n > 100_000 { 10 } else { 500 };
                let time = |f: &dyn Fn() -> Tensor| {
                    f();
                    let mut best = f64::MAX;
                    for _ in 0..3 {
                        let t = std::time::Instant::now();
                        for _ in 0..reps {
                            f();
                        }
                        best = best.min(t.elapsed().as_secs_f64() / reps as f64);
                    }
                    best
                };
                let ours = time(&|| matmul(&x, &w).unwrap());
                let candle = time(&|| x.to_dtype(dtype).unwrap().matmul(&w.t().unwrap()).unwrap());
                let gb = (n * k * dtype.size_in_bytes()) as f64 / 1e9;
                println!(
                    "{n}x{k} {dtype:?}: ours {:.3} ms ({:.1} GB/s), candle {:.3} ms ({:.1} GB/s)",
                    ours * 1e3,
                    gb / ours,
                    candle * 1e3,
                    gb / candle
                );
            }
        }
    }
}
