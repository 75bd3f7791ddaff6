//! bfloat16 weights times several float32 activation rows (prefill, batched decode): a GEMM on
//! AVX-512 BF16's `vdpbf16ps`, with a portable path that computes the same products.
//!
//! candle's bfloat16 GEMM has no bf16 micro-kernel on CPUs, and widening the weight to float32
//! for its float32 GEMM (`dense::widened_matmul`) reached 0.75× torch's oneDNN bf16 prefill on
//! Gemma 3 270M: float32 FMAs do half the multiplies of `vdpbf16ps` per instruction. Here each
//! task packs a panel of 32 weight rows, pairs of values interleaved across 16 lanes (the layout
//! of `interleaved`'s int8 tiles: lanes are output columns, so no horizontal sums), and runs every
//! activation row against it while it sits in cache. Weights stay row-major in memory, so the
//! one-row GEMV, embedding lookups and inspection read them as before.
//!
//! Activations are rounded to bfloat16, as the GEMV rounds its row: a row's result then depends
//! on the same products whether it is decoded alone or prefilled with others.

use std::cell::RefCell;

use candle_core::{CpuStorage, DType, Storage, Tensor};
use half::bf16;

use super::dense::{self, Mode};

/// Output columns in one tile (the 16 float32 lanes of a 512-bit register).
const LANES: usize = 16;
/// Tiles packed and multiplied by one task.
const TILES: usize = 2;
/// Activation rows multiplied at once: 8 rows × 2 tiles of accumulators, 2 weight registers and
/// a broadcast fit in the 32 vector registers.
#[cfg(target_arch = "x86_64")]
const ROWS: usize = 8;

/// Whether this CPU has `vdpbf16ps` (and AVX-512 BW for the masked stores).
pub fn available() -> bool {
    dense::detected() == dense::Isa::Avx512Bf16
}

/// Whether `matmul` takes `x · wᵀ`: two or more float32 rows on the CPU against a contiguous 2-D
/// bfloat16 weight, on a CPU with `vdpbf16ps` (forced to the portable path, there too: elsewhere
/// the prompt rows go through the widened float32 GEMM in either mode, so that forcing the
/// portable kernels changes kernels, not the rounding: this GEMM rounds the activations to
/// bfloat16, as `vdpbf16ps` reads them, the widened GEMM keeps them float32, 1e-2 apart on
/// Gemma 3's tiny checkpoint); one row goes through the GEMV.
pub fn takes(x: &Tensor, w: &Tensor) -> bool {
    let path_ok = match dense::mode() {
        Mode::Auto | Mode::Portable => available(),
        Mode::Candle => false,
    };
    path_ok
        && x.device().is_cpu()
        && x.dtype() == DType::F32
        && x.dims().len() == 2
        && x.dims()[0] >= 2
        && w.dtype() == DType::BF16
        && w.dims().len() == 2
        && w.dims()[1] == x.dims()[1]
        && w.is_contiguous()
}

/// `x [m, k] · wᵀ` for a bfloat16 `w [n, k]` (see `takes`), float32 out.
pub fn matmul(x: &Tensor, w: &Tensor) -> candle_core::Result<Tensor> {
    let (m, k) = x.dims2()?;
    let n = w.dim(0)?;
    let xs = x.flatten_all()?.to_vec1::<f32>()?;
    let (storage, layout) = w.storage_and_layout();
    let Storage::Cpu(CpuStorage::BF16(v)) = &*storage else {
        candle_core::bail!("bf16 gemm: weight storage is {:?}", w.dtype())
    };
    let weight = &v[layout.start_offset()..layout.start_offset() + n * k];
    let path = if dense::mode() == Mode::Auto && available() { Path::Avx512Bf16 } else { Path::Portable };
    let out = gemm(&xs, m, weight, n, k, path);
    drop(storage);
    Tensor::from_vec(out, (m, n), x.device())
}

/// The kernels `gemm` can run.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Path {
    Portable,
    Avx512Bf16,
}

/// Two bfloat16 values as one 32-bit word, the first in the low half (`vdpbf16ps`'s pairs).
fn pair(lo: bf16, hi: bf16) -> u32 {
    lo.to_bits() as u32 | (hi.to_bits() as u32) << 16
}

/// `x [m, k] · wᵀ` for a row-major bfloat16 `w [n, k]`.
fn gemm(x: &[f32], m: usize, w: &[bf16], n: usize, k: usize, path: Path) -> Vec<f32> {
    assert_eq!(x.len(), m * k, "activation shape");
    assert_eq!(w.len(), n * k, "weight shape");
    let pairs = k.div_ceil(2);
    // Activations rounded to bfloat16 in pairs (an odd width padded with a zero).
    let at = |r: usize, i: usize| if i < k { bf16::from_f32(x[r * k + i]) } else { bf16::ZERO };
    let xb: Vec<u32> = (0..m).flat_map(|r| (0..pairs).map(move |p| pair(at(r, 2 * p), at(r, 2 * p + 1)))).collect();
    let mut out = vec![0f32; m * n];
    let ptr = super::OutPtr(out.as_mut_ptr());
    thread_local! {
        static PANEL: RefCell<Vec<u32>> = const { RefCell::new(Vec::new()) };
    }
    super::parallel_for(n.div_ceil(TILES * LANES), |t| {
        // The closure must capture the whole `Send` wrapper, not its raw-pointer field.
        #[allow(clippy::redundant_locals)]
        let ptr = ptr;
        PANEL.with_borrow_mut(|panel| {
            let col0 = t * TILES * LANES;
            pack(panel, w, n, k, col0);
            let cols = (n - col0).min(TILES * LANES);
            match path {
                #[cfg(target_arch = "x86_64")]
                // SAFETY: `vdpbf16ps` and AVX-512 BW were detected; this task alone writes
                // columns col0..col0 + cols of every output row.
                Path::Avx512Bf16 => unsafe { x86::panel(panel, &xb, m, pairs, ptr.0, n, col0, cols) },
                _ => portable_panel(panel, &xb, m, pairs, ptr, n, col0, cols),
            }
        });
    });
    out
}

/// Packs weight rows `col0..col0 + 32` (zeros past `n`) as `[tile][pair][lane]` words.
fn pack(panel: &mut Vec<u32>, w: &[bf16], n: usize, k: usize, col0: usize) {
    let pairs = k.div_ceil(2);
    panel.clear();
    panel.resize(TILES * pairs * LANES, 0);
    for c in 0..(n - col0).min(TILES * LANES) {
        let (g, lane) = (c / LANES, c % LANES);
        let row = &w[(col0 + c) * k..][..k];
        for p in 0..pairs {
            let hi = row.get(2 * p + 1).copied().unwrap_or(bf16::ZERO);
            panel[(g * pairs + p) * LANES + lane] = pair(row[2 * p], hi);
        }
    }
}

/// `vdpbf16ps` for one lane: the odd products first, then the even ones, each rounded to
/// float32 (a product of two bfloat16 values is exact in float32).
fn dot_pair(acc: f32, w: u32, x: u32) -> f32 {
    let f = |v: u32, shift: u32| f32::from_bits(((v >> shift) & 0xFFFF) << 16);
    let acc = acc + f(w, 16) * f(x, 16);
    acc + f(w, 0) * f(x, 0)
}

/// The panel's columns for every activation row, in plain Rust.
#[allow(clippy::too_many_arguments)]
fn portable_panel(
    panel: &[u32],
    xb: &[u32],
    m: usize,
    pairs: usize,
    out: super::OutPtr,
    n: usize,
    col0: usize,
    cols: usize,
) {
    for r in 0..m {
        for c in 0..cols {
            let (g, lane) = (c / LANES, c % LANES);
            let mut acc = 0f32;
            for p in 0..pairs {
                acc = dot_pair(acc, panel[(g * pairs + p) * LANES + lane], xb[r * pairs + p]);
            }
            // SAFETY: this task alone writes columns col0..col0 + cols.
            unsafe { *out.0.add(r * n + col0 + c) = acc };
        }
    }
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use super::*;
    use std::arch::x86_64::*;

    /// The panel's columns for every activation row, `ROWS` rows at a time.
    #[allow(clippy::too_many_arguments)]
    #[target_feature(enable = "avx512f,avx512bw,avx512bf16")]
    pub(super) unsafe fn panel(
        panel: &[u32],
        xb: &[u32],
        m: usize,
        pairs: usize,
        out: *mut f32,
        n: usize,
        col0: usize,
        cols: usize,
    ) {
        let mut r = 0;
        while r + ROWS <= m {
            rows::<ROWS>(panel, xb, r, pairs, out, n, col0, cols);
            r += ROWS;
        }
        match m - r {
            1 => rows::<1>(panel, xb, r, pairs, out, n, col0, cols),
            2 => rows::<2>(panel, xb, r, pairs, out, n, col0, cols),
            3 => rows::<3>(panel, xb, r, pairs, out, n, col0, cols),
            4 => rows::<4>(panel, xb, r, pairs, out, n, col0, cols),
            5 => rows::<5>(panel, xb, r, pairs, out, n, col0, cols),
            6 => rows::<6>(panel, xb, r, pairs, out, n, col0, cols),
            7 => rows::<7>(panel, xb, r, pairs, out, n, col0, cols),
            _ => {}
        }
    }

    /// Activation rows `row0..row0 + R` times the panel's 32 columns.
    #[allow(clippy::too_many_arguments)]
    #[inline(always)]
    unsafe fn rows<const R: usize>(
        panel: &[u32],
        xb: &[u32],
        row0: usize,
        pairs: usize,
        out: *mut f32,
        n: usize,
        col0: usize,
        cols: usize,
    ) {
        let mut acc = [[_mm512_setzero_ps(); TILES]; R];
        let wp = panel.as_ptr();
        let xp = xb.as_ptr().add(row0 * pairs);
        for p in 0..pairs {
            let wv: [__m512bh; TILES] = std::array::from_fn(|g| {
                std::mem::transmute(_mm512_loadu_si512(wp.add((g * pairs + p) * LANES) as *const _))
            });
            for r in 0..R {
                let xv: __m512bh = std::mem::transmute(_mm512_set1_epi32(*xp.add(r * pairs + p) as i32));
                for g in 0..TILES {
                    acc[r][g] = _mm512_dpbf16_ps(acc[r][g], wv[g], xv);
                }
            }
        }
        for (r, acc) in acc.iter().enumerate() {
            for (g, &v) in acc.iter().enumerate() {
                let c = g * LANES;
                if c >= cols {
                    break;
                }
                let dst = out.add((row0 + r) * n + col0 + c);
                let left = cols - c;
                if left >= LANES {
                    _mm512_storeu_ps(dst, v);
                } else {
                    _mm512_mask_storeu_ps(dst, ((1u32 << left) - 1) as u16, v);
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Both paths equal a float64 product of the bfloat16-rounded operands, for every row-count
    /// tail, odd widths and columns that do not fill the last panel.
    #[test]
    fn every_path_equals_the_rounded_product() {
        let mut paths = vec![Path::Portable];
        if available() {
            paths.push(Path::Avx512Bf16);
        }
        let mut seed = 7u64;
        let mut next = move || {
            seed = seed.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            ((seed >> 33) as f32 / (1u64 << 31) as f32) * 2.0 - 1.0
        };
        for (m, k, n) in [(2, 64, 16), (3, 33, 37), (8, 640, 64), (9, 96, 81), (17, 130, 5), (1, 8, 33)] {
            let x: Vec<f32> = (0..m * k).map(|_| next()).collect();
            let w: Vec<bf16> = (0..n * k).map(|_| bf16::from_f32(next())).collect();
            for &path in &paths {
                let got = gemm(&x, m, &w, n, k, path);
                for r in 0..m {
                    for c in 0..n {
                        let (mut want, mut magnitude) = (0f64, 0f64);
                        for i in 0..k {
                            let p = bf16::from_f32(x[r * k + i]).to_f64() * w[c * k + i].to_f64();
                            want += p;
                            magnitude += p.abs();
                        }
                        let g = got[r * n + c] as f64;
                        assert!(
                            (g - want).abs() <= 1e-5 * magnitude + 1e-6,
                            "({m},{k},{n}) {path:?} [{r},{c}]: {g} vs {want}"
                        );
                    }
                }
            }
        }
    }

    /// The SIMD path adds in the portable path's order: the results agree to the last bits.
    #[test]
    fn the_simd_path_equals_the_portable_one() {
        if !available() {
            return;
        }
        let (m, k, n) = (11, 200, 48);
        let x: Vec<f32> = (0..m * k).map(|i| ((i * 37 % 101) as f32 - 50.0) / 17.0).collect();
        let w: Vec<bf16> = (0..n * k).map(|i| bf16::from_f32(((i * 53 % 97) as f32 - 48.0) / 13.0)).collect();
        let a = gemm(&x, m, &w, n, k, Path::Portable);
        let b = gemm(&x, m, &w, n, k, Path::Avx512Bf16);
        for (a, b) in a.iter().zip(&b) {
            assert!((a - b).abs() <= 1e-5 * a.abs().max(1.0), "{a} vs {b}");
        }
    }
}
