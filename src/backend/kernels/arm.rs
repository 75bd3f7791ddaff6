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

/// `acc + a·b` for `a`, `b` as 2×8 matrices of int8 rows, `acc` as a 2×2 int32 one:
/// lanes `[a0·b0, a0·b1, a1·b0, a1·b1]`, each a dot product of 8 bytes.
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
