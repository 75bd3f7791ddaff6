//! Attention over the KV cache read in place: a decode step's rows, and prompt rows tiled.
//!
//! Through candle, a decoded token's scores and weighted values are two batched GEMMs of one
//! row each, and the `gemm` crate packs its operands first: every step copied the layer's whole
//! cache before reading it (perf on SmolLM2-135M at 512 tokens: `pack_lhs` and the micro-kernels
//! 15% of decode). Here each key and value row is read once, straight from the cache, for every
//! query head of its group; kv heads, and segments of a long context's keys, run in parallel.
//! A float16 cache (quantized models) is widened in registers as it is read (F16C on x86 CPUs
//! that have it, `fcvtl` on every aarch64 one); a q8_0 cache is de-quantized in registers as it
//! is read (each key row's blocks times the float32 query; AVX2, AVX-512 or NEON), so both
//! kernels read q8_0 blocks directly, never a widened copy of the cache. Where the CPU has
//! AVX-512F, a decode step widens each row once for its whole group of query heads.
//!
//! Keys are read in position order, whatever the slots of a ring (`KvView::runs`), so a ring
//! and a full cache give the same sums.

use candle_core::{CpuStorage, DType, Storage, Tensor};
use half::f16;

use crate::kv_layout::{dequantize_q8_0, KvView, Q8_BLOCK, Q8_BYTES};

/// What `decode` needs besides the tensors.
#[derive(Debug, Clone, Copy)]
pub struct Params {
    /// Query heads.
    pub heads: usize,
    /// Key/value heads (each serves `heads / kv_heads` query heads).
    pub kv_heads: usize,
    /// Values per head.
    pub head_dim: usize,
    /// Multiplier of the scores.
    pub scale: f32,
    /// `cap · tanh(score / cap)` after scaling, when set.
    pub softcap: Option<f32>,
}

/// Whether the kernels take queries `q` against this cache view: float32 queries and a float32,
/// float16 or q8_0 cache on the CPU, in the cache's own contiguous buffers.
pub fn takes(q: &Tensor, kv: &KvView<'_>) -> bool {
    let (k, v) = (kv.k, kv.v);
    q.device().is_cpu()
        && q.dtype() == DType::F32
        && k.dtype() == v.dtype()
        && matches!(k.dtype(), DType::F32 | DType::F16 | DType::U8)
        && k.dims().len() == 4
        && k.is_contiguous()
        && v.is_contiguous()
        && k.dims() == v.dims()
        && (k.dtype() != DType::U8 || k.dims()[3] % Q8_BYTES == 0)
        && (k.dtype() == DType::U8 || k.dims()[3] % 8 == 0)
}

/// Elements per key row, and values per head, of a cache buffer.
fn row_and_head_dim(k: &Tensor) -> (usize, usize) {
    let row = k.dims()[3];
    if k.dtype() == DType::U8 {
        (row, row / Q8_BYTES * Q8_BLOCK)
    } else {
        (row, row)
    }
}

/// `softmax(q·Kᵀ·scale)·V` for one query row `q` `[heads · d]` (float32, any layout) against
/// the cache view `kv`: each head's output, `[1, heads, d]`.
pub fn decode(q: &Tensor, kv: &KvView<'_>, p: Params) -> candle_core::Result<Tensor> {
    decode_with(q, kv, p, TilePath::best())
}

/// `decode` on the code of `path` (the prompt kernel's paths: both kernels' tests force each).
pub(super) fn decode_with(q: &Tensor, kv: &KvView<'_>, p: Params, path: TilePath) -> candle_core::Result<Tensor> {
    let d = p.head_dim;
    let (row, head_dim) = row_and_head_dim(kv.k);
    let q = q.flatten_all()?.to_vec1::<f32>()?;
    if q.len() != p.heads * d || head_dim != d || p.kv_heads == 0 || p.heads % p.kv_heads != 0 {
        candle_core::bail!("decode attention: {} query values for {} heads of {d}", q.len(), p.heads)
    }
    let group = p.heads / p.kv_heads;
    let mut out = vec![0f32; p.heads * d];
    let (ks, kl) = kv.k.storage_and_layout();
    let (vs, vl) = kv.v.storage_and_layout();
    let head = kv.capacity() * row;
    // Runs of slots, as offsets into each kv head's rows (the buffers are contiguous from their
    // start offsets: `takes`).
    let (k0, v0) = (kl.start_offset(), vl.start_offset());
    let runs: Vec<(usize, usize)> = kv.runs().collect();
    let keys: usize = runs.iter().map(|r| r.1).sum();
    let split = Split { group, d, row, head, keys, segments: keys.div_ceil(DECODE_SEGMENT).max(1) };
    let tasks = p.kv_heads * split.segments;
    // One segment writes its group's outputs in place; several write partial sums beside them.
    let mut partial = if split.segments > 1 { vec![0f32; tasks * group * d] } else { Vec::new() };
    let mut stats = vec![(0f32, 0f32); tasks * group];
    let dst = super::OutPtr(if split.segments > 1 { partial.as_mut_ptr() } else { out.as_mut_ptr() });
    let sums = StatsPtr(stats.as_mut_ptr());
    let (s, cap) = (p.scale, p.softcap);
    // Which x86 code runs, decided once for every task.
    #[cfg(target_arch = "x86_64")]
    let (avx2, avx512) = {
        let simd = path != TilePath::Portable && x86::available();
        (simd, simd && path == TilePath::Avx512 && d % 16 == 0)
    };
    match (&*ks, &*vs) {
        (Storage::Cpu(CpuStorage::F32(kd)), Storage::Cpu(CpuStorage::F32(vd))) => {
            split.run(&kd[k0..], &vd[v0..], &q, &runs, tasks, dst, sums, &|qh, kh, vh, oh, st| {
                #[cfg(target_arch = "x86_64")]
                if avx512 {
                    // SAFETY: AVX-512F and F16C were detected and `d` is a multiple of 16.
                    return unsafe { decode_avx512::head_group(qh, kh, vh, oh, st, d, s, cap) };
                }
                head_group(qh, kh, vh, oh, st, d, row, s, cap, dot, axpy)
            })
        }
        (Storage::Cpu(CpuStorage::F16(kd)), Storage::Cpu(CpuStorage::F16(vd))) => {
            split.run(&kd[k0..], &vd[v0..], &q, &runs, tasks, dst, sums, &|qh, kh, vh, oh, st| {
                #[cfg(target_arch = "x86_64")]
                if avx512 {
                    // SAFETY: AVX-512F and F16C were detected and `d` is a multiple of 16.
                    return unsafe { decode_avx512::head_group(qh, kh, vh, oh, st, d, s, cap) };
                }
                #[cfg(target_arch = "x86_64")]
                if avx2 {
                    // SAFETY: AVX2, FMA and F16C were detected.
                    return unsafe { x86::head_group_f16c(qh, kh, vh, oh, st, d, s, cap) };
                }
                #[cfg(target_arch = "aarch64")]
                if path == TilePath::Neon {
                    // SAFETY: NEON and its half-precision conversions are part of every aarch64 CPU;
                    // `d` is a multiple of 8 (`arm::dot_f16`).
                    let (dot, axpy) = (
                        |a: &[f32], b: &[f16]| unsafe { arm::dot_f16(a, b) },
                        |o: &mut [f32], w, x: &[f16]| unsafe { arm::axpy_f16(o, w, x) },
                    );
                    return head_group(qh, kh, vh, oh, st, d, d, s, cap, dot, axpy);
                }
                head_group(qh, kh, vh, oh, st, d, row, s, cap, dot, axpy)
            })
        }
        (Storage::Cpu(CpuStorage::U8(kd)), Storage::Cpu(CpuStorage::U8(vd))) => {
            split.run(&kd[k0..], &vd[v0..], &q, &runs, tasks, dst, sums, &|qh, kh, vh, oh, st| {
                #[cfg(target_arch = "x86_64")]
                if avx512 {
                    // SAFETY: AVX-512F and F16C were detected; `d` is whole q8_0 blocks (`takes`).
                    return unsafe { decode_avx512::head_group(qh, kh, vh, oh, st, d, s, cap) };
                }
                #[cfg(target_arch = "x86_64")]
                if avx2 {
                    // SAFETY: AVX2, FMA and F16C were detected.
                    return unsafe { x86::head_group_q8(qh, kh, vh, oh, st, d, row, s, cap) };
                }
                #[cfg(target_arch = "aarch64")]
                if path == TilePath::Neon {
                    // SAFETY: NEON is part of every aarch64 CPU; `d` is a multiple of 32 and `row`
                    // its blocks' bytes (`arm::dot_q8`).
                    let (dot, axpy) = (
                        |a: &[f32], r: &[u8]| unsafe { arm::dot_q8(a, r) },
                        |o: &mut [f32], w, r: &[u8]| unsafe { arm::axpy_q8(o, w, r) },
                    );
                    return head_group(qh, kh, vh, oh, st, d, row, s, cap, dot, axpy);
                }
                head_group(qh, kh, vh, oh, st, d, row, s, cap, dot_q8, axpy_q8)
            })
        }
        _ => candle_core::bail!("decode attention expects a float32, float16 or q8_0 CPU cache"),
    }
    split.combine(&partial, &stats, &mut out, p.kv_heads);
    drop((ks, vs));
    Tensor::from_vec(out, (1, p.heads, d), kv.k.device())
}

/// Keys per task of a decode step: a kv head's keys beyond this are split into segments that run
/// in parallel (Gemma 3 has one kv head, so a long context's attention ran on one thread), and
/// their partial softmax sums are combined. The split depends on the number of keys only, so
/// the result does not depend on the thread count. 256 rather than 512: Gemma 3's sliding layers
/// attend 512 keys, which as one task left the second thread idle.
const DECODE_SEGMENT: usize = 256;

/// Where decode tasks write their softmax statistics: for each query head of a group, the
/// largest score and the sum of `exp(score - largest)`.
#[derive(Clone, Copy)]
struct StatsPtr(*mut (f32, f32));
// SAFETY: each task writes its own disjoint part of the statistics, which outlive the tasks.
unsafe impl Send for StatsPtr {}
unsafe impl Sync for StatsPtr {}

/// How a decode step's keys are cut into tasks: (kv head, segment of `DECODE_SEGMENT` keys).
#[derive(Clone, Copy)]
struct Split {
    group: usize,
    d: usize,
    row: usize,
    /// Elements of one kv head's rows in the buffers.
    head: usize,
    keys: usize,
    segments: usize,
}

impl Split {
    /// Runs `f(queries, key runs, value runs, out, stats)` for every task, in parallel; task `i`
    /// writes `group · d` outputs at `dst + i · group · d` and `group` statistics at `sums + i · group`.
    #[allow(clippy::too_many_arguments)]
    fn run<T: Sync>(
        &self,
        kd: &[T],
        vd: &[T],
        q: &[f32],
        runs: &[(usize, usize)],
        tasks: usize,
        dst: super::OutPtr,
        sums: StatsPtr,
        f: &(dyn Fn(&[f32], [&[T]; 2], [&[T]; 2], &mut [f32], &mut [(f32, f32)]) + Sync),
    ) {
        let Split { group, d, row, head, keys, segments } = *self;
        super::parallel_for(tasks, |i| {
            // The closure must capture the whole `Send` wrappers, not their raw-pointer fields.
            #[allow(clippy::redundant_locals)]
            let (dst, sums) = (dst, sums);
            let (h, segment) = (i / segments, i % segments);
            // SAFETY: task i alone writes these parts of the buffers.
            let (oh, st) = unsafe {
                (
                    std::slice::from_raw_parts_mut(dst.0.add(i * group * d), group * d),
                    std::slice::from_raw_parts_mut(sums.0.add(i * group), group),
                )
            };
            // Keys `a..b` of the head, in position order across the (at most two) runs of slots.
            let (a, b) = (segment * DECODE_SEGMENT, ((segment + 1) * DECODE_SEGMENT).min(keys));
            let mut before = 0;
            let mut parts = [(0usize, 0usize); 2];
            for (part, &(slot, n)) in parts.iter_mut().zip(runs) {
                let (from, to) = (a.clamp(before, before + n) - before, b.clamp(before, before + n) - before);
                *part = (h * head + (slot + from) * row, (to - from) * row);
                before += n;
            }
            let (k, v) = (parts.map(|(at, len)| &kd[at..at + len]), parts.map(|(at, len)| &vd[at..at + len]));
            f(&q[h * group * d..(h + 1) * group * d], k, v, oh, st);
        })
    }

    /// The step's outputs from the tasks' unnormalised sums: in place for one segment; for
    /// several, each segment's weighted by `exp(its largest score - the largest)`, as
    /// flash-decoding combines them.
    fn combine(&self, partial: &[f32], stats: &[(f32, f32)], out: &mut [f32], kv_heads: usize) {
        let Split { group, d, segments, .. } = *self;
        for h in 0..kv_heads {
            for g in 0..group {
                let o = &mut out[(h * group + g) * d..][..d];
                let stat = |s: usize| stats[(h * segments + s) * group + g];
                if segments == 1 {
                    let inv = 1.0 / stat(0).1;
                    o.iter_mut().for_each(|x| *x *= inv);
                    continue;
                }
                let largest = (0..segments).map(|s| stat(s).0).fold(f32::NEG_INFINITY, f32::max);
                let mut total = 0f32;
                o.fill(0.0);
                for s in 0..segments {
                    let (max, sum) = stat(s);
                    let w = (max - largest).exp();
                    total += w * sum;
                    let part = &partial[((h * segments + s) * group + g) * d..][..d];
                    o.iter_mut().zip(part).for_each(|(x, &y)| *x += w * y);
                }
                let inv = 1.0 / total;
                o.iter_mut().for_each(|x| *x *= inv);
            }
        }
    }
}

/// Keys per block of the prompt kernel: the block's keys and values are widened to float32 once
/// (64 × 256 × 4 bytes each at most, in L2) and read by every query row of a tile.
const KEY_BLOCK: usize = 64;
/// Query rows per task of the prompt kernel: with a group of query heads per kv head, the
/// running sums of a task are `QUERY_TILE × group × head_dim` float32.
const QUERY_TILE: usize = 32;

/// Where a prompt step's queries sit among the keys it attends.
#[derive(Debug, Clone, Copy)]
pub struct PromptSpan {
    /// The index, in the key views, of query row 0's own key (its position minus the first
    /// key's); row `i` sees keys up to `offset + i`.
    pub offset: usize,
    /// The absolute position of key 0 in the views, so key blocks start at the same positions
    /// however a prompt was cut into steps (a row's result does not depend on the cut).
    pub first_key: usize,
    /// A row sees only the `window` keys ending at its own (transformers' convention), if set.
    pub window: Option<usize>,
}

/// Causal (and sliding-window) attention of prompt rows, tiled: `q` `[1, heads, t, d]` float32
/// against the cache view `kv` (float32, float16 or q8_0, read in place), with an online softmax
/// over blocks of keys, so no `t × keys` score matrix, mask or widened copy of the cache is ever
/// made. Returns each row's heads, `[t, heads, d]`.
pub fn prompt(q: &Tensor, kv: &KvView<'_>, span: PromptSpan, p: Params) -> candle_core::Result<Tensor> {
    prompt_with(q, kv, span, p, TilePath::best())
}

/// `prompt` on the code `path` (which the CPU must run: `TilePath::best` or below).
fn prompt_with(
    q: &Tensor,
    kv: &KvView<'_>,
    span: PromptSpan,
    p: Params,
    path: TilePath,
) -> candle_core::Result<Tensor> {
    let d = p.head_dim;
    let t = q.dim(2)?;
    let keys = kv.len;
    let (row, head_dim) = row_and_head_dim(kv.k);
    if q.dims() != [1, p.heads, t, d] || head_dim != d || p.kv_heads == 0 || p.heads % p.kv_heads != 0 {
        candle_core::bail!("prompt attention: queries {:?} for {} heads of {d}", q.dims(), p.heads)
    }
    if span.offset + t > keys {
        candle_core::bail!("prompt attention: {t} rows from key {} past the {keys} keys held", span.offset)
    }
    let group = p.heads / p.kv_heads;
    let q = q.contiguous()?.flatten_all()?.to_vec1::<f32>()?; // [heads, t, d]
    let mut out = vec![0f32; t * p.heads * d];
    let (ks, kl) = kv.k.storage_and_layout();
    let (vs, vl) = kv.v.storage_and_layout();
    let (k0, v0) = (kl.start_offset(), vl.start_offset());
    let (cap, head) = (kv.capacity(), kv.capacity() * row);
    let first_slot = kv.first % cap.max(1);
    let ptr = super::OutPtr(out.as_mut_ptr());
    let tiles = t.div_ceil(QUERY_TILE);
    let each_tile = |f: &(dyn Fn(usize, std::ops::Range<usize>) + Sync)| {
        super::parallel_for(p.kv_heads * tiles, |task| {
            let (h, tile) = (task / tiles, task % tiles);
            f(h, tile * QUERY_TILE..((tile + 1) * QUERY_TILE).min(t))
        })
    };
    let run =
        |h: usize, rows: std::ops::Range<usize>, kh: &dyn Fn(usize, &mut [f32]), vh: &dyn Fn(usize, &mut [f32])| {
            #[allow(clippy::redundant_locals)]
            let ptr = ptr;
            let tile = PromptTile { q: &q, t, d, group, h, rows, span, p, path };
            tile.run(kh, vh, |row, head, values| {
                // SAFETY: each (row, head) is written by the one task that owns its row tile and kv head.
                let o = unsafe { std::slice::from_raw_parts_mut(ptr.0.add((row * p.heads + head) * d), d) };
                o.copy_from_slice(values);
            });
        };
    // Rows `j..` of the view (as many as `dst` holds) of kv head `h`, widened by `widen`, a run
    // of consecutive slots at a time.
    fn rows_of<T>(
        data: &[T],
        base: usize,
        row: usize,
        d: usize,
        first_slot: usize,
        cap: usize,
        j: usize,
        dst: &mut [f32],
        widen: impl Fn(&[T], &mut [f32]),
    ) {
        let n = dst.len() / d;
        let start = (first_slot + j) % cap;
        let head = n.min(cap - start);
        for (slot, count, at) in [(start, head, 0), (0, n - head, head)] {
            if count > 0 {
                widen(&data[base + slot * row..][..count * row], &mut dst[at * d..(at + count) * d]);
            }
        }
    }
    match (&*ks, &*vs) {
        (Storage::Cpu(CpuStorage::F32(kd)), Storage::Cpu(CpuStorage::F32(vd))) => each_tile(&|h, rows| {
            let widen = |src: &[f32], dst: &mut [f32]| dst.copy_from_slice(src);
            let key = |j: usize, dst: &mut [f32]| rows_of(kd, k0 + h * head, row, d, first_slot, cap, j, dst, widen);
            let value = |j: usize, dst: &mut [f32]| rows_of(vd, v0 + h * head, row, d, first_slot, cap, j, dst, widen);
            run(h, rows, &key, &value)
        }),
        (Storage::Cpu(CpuStorage::F16(kd)), Storage::Cpu(CpuStorage::F16(vd))) => each_tile(&|h, rows| {
            use half::slice::HalfFloatSliceExt;
            let widen = |src: &[f16], dst: &mut [f32]| src.convert_to_f32_slice(dst);
            let key = |j: usize, dst: &mut [f32]| rows_of(kd, k0 + h * head, row, d, first_slot, cap, j, dst, widen);
            let value = |j: usize, dst: &mut [f32]| rows_of(vd, v0 + h * head, row, d, first_slot, cap, j, dst, widen);
            run(h, rows, &key, &value)
        }),
        (Storage::Cpu(CpuStorage::U8(kd)), Storage::Cpu(CpuStorage::U8(vd))) => each_tile(&|h, rows| {
            // A q8_0 block of keys de-quantized once per tile, as the float16 cache is widened.
            let widen = |src: &[u8], dst: &mut [f32]| {
                for (block, out) in src.chunks_exact(Q8_BYTES).zip(dst.chunks_exact_mut(Q8_BLOCK)) {
                    dequantize_q8_0(block, out);
                }
            };
            let key = |j: usize, dst: &mut [f32]| rows_of(kd, k0 + h * head, row, d, first_slot, cap, j, dst, widen);
            let value = |j: usize, dst: &mut [f32]| rows_of(vd, v0 + h * head, row, d, first_slot, cap, j, dst, widen);
            run(h, rows, &key, &value)
        }),
        _ => candle_core::bail!("prompt attention expects a float32, float16 or q8_0 CPU cache"),
    }
    drop((ks, vs));
    Tensor::from_vec(out, (t, p.heads, d), kv.k.device())
}

/// One task of `prompt`: a tile of query rows of one kv head's group of query heads.
struct PromptTile<'a> {
    /// All queries, `[heads, t, d]`.
    q: &'a [f32],
    t: usize,
    d: usize,
    group: usize,
    /// The kv head.
    h: usize,
    rows: std::ops::Range<usize>,
    span: PromptSpan,
    p: Params,
    path: TilePath,
}

impl PromptTile<'_> {
    /// The keys row `i` sees, as indices into the views.
    fn visible(&self, i: usize) -> std::ops::Range<usize> {
        let own = self.span.offset + i;
        let first_abs = self.span.window.map_or(0, |w| (self.span.first_key + own + 1).saturating_sub(w));
        first_abs.saturating_sub(self.span.first_key)..own + 1
    }

    /// Runs the tile: `key(j, dst)` / `value(j, dst)` write `dst.len() / d` float32 rows from
    /// key `j` on; `emit(row, head, out)` receives each finished output. On x86 CPUs with AVX2
    /// and FMA the micro-kernels are compiled for them (detected at run time, so the portable
    /// wheel takes them too); elsewhere the same code is built for the target's baseline.
    fn run(
        &self,
        key: &dyn Fn(usize, &mut [f32]),
        value: &dyn Fn(usize, &mut [f32]),
        emit: impl Fn(usize, usize, &[f32]),
    ) {
        match self.path {
            #[cfg(target_arch = "x86_64")]
            // SAFETY: `TilePath::best` chose it where AVX-512F, AVX2 and FMA were detected.
            TilePath::Avx512 => unsafe { self.run_avx512(key, value, &emit) },
            #[cfg(target_arch = "x86_64")]
            // SAFETY: `TilePath::best` chose it (or a test forced it) where AVX2 and FMA were detected.
            TilePath::Avx2 => unsafe { self.run_avx2(key, value, &emit) },
            #[cfg(target_arch = "aarch64")]
            TilePath::Neon => self.run_with::<false, false, true>(key, value, &emit),
            TilePath::Portable => self.run_with::<false, false, false>(key, value, &emit),
        }
    }

    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx512f,avx2,fma")]
    unsafe fn run_avx512(
        &self,
        key: &dyn Fn(usize, &mut [f32]),
        value: &dyn Fn(usize, &mut [f32]),
        emit: &dyn Fn(usize, usize, &[f32]),
    ) {
        self.run_with::<true, true, false>(key, value, emit)
    }

    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx2,fma")]
    unsafe fn run_avx2(
        &self,
        key: &dyn Fn(usize, &mut [f32]),
        value: &dyn Fn(usize, &mut [f32]),
        emit: &dyn Fn(usize, usize, &[f32]),
    ) {
        self.run_with::<true, false, false>(key, value, emit)
    }

    /// The tile as small matrix products: for each block of keys (widened once, keys transposed),
    /// `QUERY_BLOCK` query vectors at a time are scored against every key of the block at once,
    /// masked and exponentiated a row of the block at a time (online softmax), and their weights
    /// times the block's values added to their sums, each product in register-sized tiles.
    /// `AVX2`: the products run on `tile_x86`'s AVX2/FMA code (only ever set on x86 CPUs that
    /// have both), or with `AVX512` on `tile_avx512`'s; `NEON` on `tile_neon`'s (aarch64); else
    /// on the portable code.
    #[inline(always)]
    fn run_with<const AVX2: bool, const AVX512: bool, const NEON: bool>(
        &self,
        key: &dyn Fn(usize, &mut [f32]),
        value: &dyn Fn(usize, &mut [f32]),
        emit: &dyn Fn(usize, usize, &[f32]),
    ) {
        let (d, group, n_rows) = (self.d, self.group, self.rows.len());
        let vectors = n_rows * group;
        let padded = vectors.next_multiple_of(QUERY_BLOCK);
        // Vector `v` is row `v / group`'s query head `v % group`; the padding repeats the last
        // vector (its results are dropped), so every block of vectors is whole.
        let row_of = |v: usize| self.rows.start + v.min(vectors - 1) / group;
        // Queries times the scale: as rows `[padded][d]` for the portable products, each block of
        // QUERY_BLOCK vectors transposed (`[d][QUERY_BLOCK]`) for the SIMD ones. Either way a
        // block's QUERY_BLOCK vectors are the buffer's `[v0 · d, (v0 + QUERY_BLOCK) · d)`.
        let simd = AVX2 || AVX512 || NEON;
        let mut qs = vec![0f32; padded * d];
        for v in 0..padded {
            let u = v.min(vectors - 1);
            let head = self.h * group + u % group;
            let qv = &self.q[(head * self.t + row_of(v)) * d..][..d];
            let (block, lane) = (v / QUERY_BLOCK, v % QUERY_BLOCK);
            for (i, &x) in qv.iter().enumerate() {
                let at = if simd { (block * d + i) * QUERY_BLOCK + lane } else { v * d + i };
                qs[at] = x * self.p.scale;
            }
        }
        let lo = self.visible(self.rows.start).start;
        let hi = self.visible(self.rows.end - 1).end;
        let mut max = vec![f32::NEG_INFINITY; padded];
        let mut sum = vec![0f32; padded];
        let mut acc = vec![0f32; padded * d];
        let mut kb = vec![0f32; KEY_BLOCK * d];
        let mut kt = vec![0f32; if simd { d * KEY_BLOCK } else { 0 }];
        let mut vb = vec![0f32; KEY_BLOCK * d];
        let mut s = [[0f32; KEY_BLOCK]; QUERY_BLOCK];
        // Blocks start at absolute multiples of KEY_BLOCK, whatever the views' first key.
        let first = self.span.first_key;
        let mut start = lo;
        while start < hi {
            let end = hi.min(((first + start) / KEY_BLOCK + 1) * KEY_BLOCK - first);
            let n = end - start;
            key(start, &mut kb[..n * d]);
            value(start, &mut vb[..n * d]);
            // Columns past `n` keep an earlier block's keys: their scores are masked below.
            for (j, krow) in kb.chunks_exact(d).take(if simd { n } else { 0 }).enumerate() {
                for (i, &x) in krow.iter().enumerate() {
                    kt[i * KEY_BLOCK + j] = x;
                }
            }
            let scored = n.next_multiple_of(KEY_LANES);
            for v0 in (0..padded).step_by(QUERY_BLOCK) {
                // Each vector's visible keys in this block, as offsets from `start`.
                let mut seen = [(0usize, 0usize); QUERY_BLOCK];
                for (lane, seen) in seen.iter_mut().enumerate() {
                    let keys = self.visible(row_of(v0 + lane));
                    let (a, b) = (keys.start.max(start), keys.end.min(end));
                    if a < b {
                        *seen = (a - start, b - start);
                    }
                }
                if seen.iter().all(|&(a, b)| a == b) {
                    continue;
                }
                let q = &qs[v0 * d..(v0 + QUERY_BLOCK) * d];
                if AVX512 {
                    #[cfg(target_arch = "x86_64")]
                    // SAFETY: as below, and AVX-512F was detected.
                    unsafe {
                        tile_avx512::scores(q, &kt, scored, &mut s)
                    }
                } else if AVX2 {
                    #[cfg(target_arch = "x86_64")]
                    // SAFETY: AVX2 and FMA were detected (`run`); `q` holds QUERY_BLOCK vectors of
                    // `d` and `kt` d rows of KEY_BLOCK keys, `scored` of them whole blocks of 16.
                    unsafe {
                        tile_x86::scores(q, &kt, scored, &mut s)
                    }
                } else if NEON {
                    #[cfg(target_arch = "aarch64")]
                    // SAFETY: `q` holds QUERY_BLOCK transposed vectors of `d`, `kt` `d` rows of
                    // KEY_BLOCK keys, `scored` is a multiple of 16 up to KEY_BLOCK.
                    unsafe {
                        tile_neon::scores(q, &kt, scored, &mut s)
                    }
                } else {
                    scores_portable(q, &kb, d, n, &mut s);
                }
                for (lane, &(a, b)) in seen.iter().enumerate() {
                    let v = v0 + lane;
                    let row = &mut s[lane][..scored];
                    if a == b {
                        row.fill(0.0);
                        continue;
                    }
                    if let Some(cap) = self.p.softcap {
                        row[a..b].iter_mut().for_each(|x| *x = cap * (*x / cap).tanh());
                    }
                    row[..a].fill(f32::NEG_INFINITY);
                    row[b..].fill(f32::NEG_INFINITY);
                    let block_max = row_max(row);
                    let new_max = max[v].max(block_max);
                    let correction = (max[v] - new_max).exp();
                    max[v] = new_max;
                    if correction != 1.0 {
                        sum[v] *= correction;
                        acc[v * d..][..d].iter_mut().for_each(|o| *o *= correction);
                    }
                    sum[v] += if AVX512 {
                        #[cfg(target_arch = "x86_64")]
                        // SAFETY: AVX-512F was detected (`run`); the row is whole blocks of 16.
                        unsafe {
                            tile_avx512::exp_shifted(row, new_max)
                        }
                        #[cfg(not(target_arch = "x86_64"))]
                        unreachable!()
                    } else {
                        exp_shifted(row, new_max)
                    };
                }
                let out = &mut acc[v0 * d..(v0 + QUERY_BLOCK) * d];
                if AVX512 {
                    #[cfg(target_arch = "x86_64")]
                    // SAFETY: as below, and AVX-512F was detected.
                    unsafe {
                        tile_avx512::weighted_values(&s, &vb[..n * d], d, out)
                    }
                } else if AVX2 {
                    #[cfg(target_arch = "x86_64")]
                    // SAFETY: AVX2 and FMA were detected (`run`); `vb` holds `n` rows of `d`
                    // (a multiple of 8) and `out` QUERY_BLOCK of them.
                    unsafe {
                        tile_x86::weighted_values(&s, &vb[..n * d], d, out)
                    }
                } else if NEON {
                    #[cfg(target_arch = "aarch64")]
                    // SAFETY: `vb` holds `n` rows of `d` (a multiple of 8) and `out` QUERY_BLOCK of them.
                    unsafe {
                        tile_neon::weighted_values(&s, &vb[..n * d], d, out)
                    }
                } else {
                    weighted_values_portable(&s, &vb[..n * d], d, out);
                }
            }
            start = end;
        }
        for v in 0..vectors {
            let inv = 1.0 / sum[v];
            let out = &mut acc[v * d..][..d];
            out.iter_mut().for_each(|o| *o *= inv);
            emit(self.rows.start + v / group, self.h * group + v % group, out);
        }
    }
}

/// The code the prompt kernel's products run on: each architecture has its own.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum TilePath {
    /// Plain Rust, any CPU.
    Portable,
    /// AVX2 and FMA registers.
    #[cfg(target_arch = "x86_64")]
    Avx2,
    /// AVX-512F registers.
    #[cfg(target_arch = "x86_64")]
    Avx512,
    /// NEON registers (every aarch64 CPU has them).
    #[cfg(target_arch = "aarch64")]
    Neon,
}

impl TilePath {
    /// The fastest this CPU runs.
    pub(super) fn best() -> Self {
        #[cfg(target_arch = "x86_64")]
        if is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma") {
            return if is_x86_feature_detected!("avx512f") { Self::Avx512 } else { Self::Avx2 };
        }
        #[cfg(target_arch = "aarch64")]
        return Self::Neon;
        #[allow(unreachable_code)]
        Self::Portable
    }

    /// Every path this CPU can run (for the tests that compare them).
    #[cfg(test)]
    fn all() -> Vec<Self> {
        let mut all = vec![Self::Portable];
        #[cfg(target_arch = "x86_64")]
        match Self::best() {
            Self::Avx512 => all.extend([Self::Avx2, Self::Avx512]),
            Self::Avx2 => all.push(Self::Avx2),
            _ => {}
        }
        #[cfg(target_arch = "aarch64")]
        all.push(Self::Neon);
        all
    }
}

/// Query vectors the prompt kernel scores together (each key's row is loaded once for all).
const QUERY_BLOCK: usize = 4;
/// Keys in one row of score accumulators (two AVX2 registers, one AVX-512 or four NEON).
const KEY_LANES: usize = 16;

/// The portable `scores`: each of the `QUERY_BLOCK` query rows `q` (`[QUERY_BLOCK][d]`) dotted
/// with the first `keys` key rows of `kb` (`[keys][d]`), as the compiler vectorizes `dot`.
#[inline(always)]
fn scores_portable(q: &[f32], kb: &[f32], d: usize, keys: usize, s: &mut [[f32; KEY_BLOCK]; QUERY_BLOCK]) {
    for (s, qv) in s.iter_mut().zip(q.chunks_exact(d)) {
        for (s, kj) in s.iter_mut().zip(kb.chunks_exact(d).take(keys)) {
            *s = dot(qv, kj);
        }
    }
}

/// The portable `weighted_values`: `out[r] += Σ_j p[r][j] · v[j]` over the block's value rows
/// `v` (`[keys][d]`) for the `QUERY_BLOCK` vectors' sums `out` (`[QUERY_BLOCK][d]`).
#[inline(always)]
fn weighted_values_portable(p: &[[f32; KEY_BLOCK]; QUERY_BLOCK], v: &[f32], d: usize, out: &mut [f32]) {
    for (p, o) in p.iter().zip(out.chunks_exact_mut(d)) {
        for (&w, vj) in p.iter().zip(v.chunks_exact(d)) {
            axpy(o, w, vj);
        }
    }
}

/// The prompt kernel's two products in AVX2/FMA registers: what `scores` and `weighted_values`
/// compute, written out because the compiler leaves their fixed-size loops scalar.
#[cfg(target_arch = "x86_64")]
mod tile_x86 {
    use super::{KEY_BLOCK, QUERY_BLOCK};
    use std::arch::x86_64::*;

    /// `scores`: `q` `[d][QUERY_BLOCK]`, `kt` `[d][KEY_BLOCK]`, `keys` a multiple of 16.
    #[target_feature(enable = "avx2,fma")]
    #[inline]
    pub(super) unsafe fn scores(q: &[f32], kt: &[f32], keys: usize, s: &mut [[f32; KEY_BLOCK]; QUERY_BLOCK]) {
        let d = q.len() / QUERY_BLOCK;
        debug_assert!(kt.len() >= d * KEY_BLOCK && keys % 16 == 0 && keys <= KEY_BLOCK);
        for c in (0..keys).step_by(16) {
            let mut acc = [_mm256_setzero_ps(); 2 * QUERY_BLOCK];
            for i in 0..d {
                let k = kt.as_ptr().add(i * KEY_BLOCK + c);
                let (k0, k1) = (_mm256_loadu_ps(k), _mm256_loadu_ps(k.add(8)));
                let x = q.as_ptr().add(i * QUERY_BLOCK);
                for r in 0..QUERY_BLOCK {
                    let xr = _mm256_broadcast_ss(&*x.add(r));
                    acc[2 * r] = _mm256_fmadd_ps(xr, k0, acc[2 * r]);
                    acc[2 * r + 1] = _mm256_fmadd_ps(xr, k1, acc[2 * r + 1]);
                }
            }
            for (r, s) in s.iter_mut().enumerate() {
                _mm256_storeu_ps(s.as_mut_ptr().add(c), acc[2 * r]);
                _mm256_storeu_ps(s.as_mut_ptr().add(c + 8), acc[2 * r + 1]);
            }
        }
    }

    /// `weighted_values`: `v` `[keys][d]`, `out` `[QUERY_BLOCK][d]`, `d` a multiple of 8.
    #[target_feature(enable = "avx2,fma")]
    #[inline]
    pub(super) unsafe fn weighted_values(p: &[[f32; KEY_BLOCK]; QUERY_BLOCK], v: &[f32], d: usize, out: &mut [f32]) {
        let keys = v.len() / d;
        debug_assert!(d % 8 == 0 && keys <= KEY_BLOCK && out.len() == QUERY_BLOCK * d);
        let o = out.as_mut_ptr();
        let mut c = 0;
        while c + 16 <= d {
            let mut acc = [_mm256_setzero_ps(); 2 * QUERY_BLOCK];
            for r in 0..QUERY_BLOCK {
                acc[2 * r] = _mm256_loadu_ps(o.add(r * d + c));
                acc[2 * r + 1] = _mm256_loadu_ps(o.add(r * d + c + 8));
            }
            for j in 0..keys {
                let x = v.as_ptr().add(j * d + c);
                let (v0, v1) = (_mm256_loadu_ps(x), _mm256_loadu_ps(x.add(8)));
                for r in 0..QUERY_BLOCK {
                    let w = _mm256_broadcast_ss(p.get_unchecked(r).get_unchecked(j));
                    acc[2 * r] = _mm256_fmadd_ps(w, v0, acc[2 * r]);
                    acc[2 * r + 1] = _mm256_fmadd_ps(w, v1, acc[2 * r + 1]);
                }
            }
            for r in 0..QUERY_BLOCK {
                _mm256_storeu_ps(o.add(r * d + c), acc[2 * r]);
                _mm256_storeu_ps(o.add(r * d + c + 8), acc[2 * r + 1]);
            }
            c += 16;
        }
        if c < d {
            let mut acc = [_mm256_setzero_ps(); QUERY_BLOCK];
            for (r, acc) in acc.iter_mut().enumerate() {
                *acc = _mm256_loadu_ps(o.add(r * d + c));
            }
            for j in 0..keys {
                let v0 = _mm256_loadu_ps(v.as_ptr().add(j * d + c));
                for (r, acc) in acc.iter_mut().enumerate() {
                    *acc = _mm256_fmadd_ps(_mm256_broadcast_ss(p.get_unchecked(r).get_unchecked(j)), v0, *acc);
                }
            }
            for (r, acc) in acc.iter().enumerate() {
                _mm256_storeu_ps(o.add(r * d + c), *acc);
            }
        }
    }
}

/// The same products in AVX-512 registers (16 floats), where the CPU has AVX-512F: twice the
/// multiply-adds of an AVX2 instruction for the same loads.
#[cfg(target_arch = "x86_64")]
mod tile_avx512 {
    use super::{EXP_POLY, KEY_BLOCK, LN2_HI, LN2_LO, QUERY_BLOCK};
    use std::arch::x86_64::*;

    /// `scores`: `q` `[d][QUERY_BLOCK]`, `kt` `[d][KEY_BLOCK]`, `keys` a multiple of 16.
    #[target_feature(enable = "avx512f,avx2,fma")]
    #[inline]
    pub(super) unsafe fn scores(q: &[f32], kt: &[f32], keys: usize, s: &mut [[f32; KEY_BLOCK]; QUERY_BLOCK]) {
        let d = q.len() / QUERY_BLOCK;
        debug_assert!(kt.len() >= d * KEY_BLOCK && keys % 16 == 0 && keys <= KEY_BLOCK);
        let mut c = 0;
        while c < keys {
            // 32 keys at a time, the last 16 alone.
            let two = c + 32 <= keys;
            let mut acc = [_mm512_setzero_ps(); 2 * QUERY_BLOCK];
            for i in 0..d {
                let k = kt.as_ptr().add(i * KEY_BLOCK + c);
                let k0 = _mm512_loadu_ps(k);
                let k1 = if two { _mm512_loadu_ps(k.add(16)) } else { _mm512_setzero_ps() };
                let x = q.as_ptr().add(i * QUERY_BLOCK);
                for r in 0..QUERY_BLOCK {
                    let xr = _mm512_set1_ps(*x.add(r));
                    acc[2 * r] = _mm512_fmadd_ps(xr, k0, acc[2 * r]);
                    if two {
                        acc[2 * r + 1] = _mm512_fmadd_ps(xr, k1, acc[2 * r + 1]);
                    }
                }
            }
            for (r, s) in s.iter_mut().enumerate() {
                _mm512_storeu_ps(s.as_mut_ptr().add(c), acc[2 * r]);
                if two {
                    _mm512_storeu_ps(s.as_mut_ptr().add(c + 16), acc[2 * r + 1]);
                }
            }
            c += if two { 32 } else { 16 };
        }
    }

    /// `exp_shifted` (the same reduction and polynomial), 16 scores at a time, the power of two
    /// applied by `vscalefps`.
    #[target_feature(enable = "avx512f,avx2,fma")]
    #[inline]
    pub(super) unsafe fn exp_shifted(row: &mut [f32], shift: f32) -> f32 {
        debug_assert!(row.len() % 16 == 0);
        let (shift, floor) = (_mm512_set1_ps(shift), _mm512_set1_ps(-87.0));
        let c = |x: f32| _mm512_set1_ps(x);
        let mut total = _mm512_setzero_ps();
        for chunk in row.chunks_exact_mut(16) {
            let y = _mm512_sub_ps(_mm512_loadu_ps(chunk.as_ptr()), shift);
            let keep = _mm512_cmp_ps_mask::<_CMP_GE_OQ>(y, floor);
            let z = _mm512_max_ps(y, floor);
            let n = _mm512_roundscale_ps::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(_mm512_mul_ps(
                z,
                c(std::f32::consts::LOG2_E),
            ));
            let r = _mm512_fnmadd_ps(n, c(LN2_LO), _mm512_fnmadd_ps(n, c(LN2_HI), z));
            let mut p = c(EXP_POLY[0]);
            for &k in &EXP_POLY[1..] {
                p = _mm512_fmadd_ps(p, r, c(k));
            }
            let e = _mm512_add_ps(_mm512_fmadd_ps(p, _mm512_mul_ps(r, r), r), c(1.0));
            let e = _mm512_maskz_scalef_ps(keep, e, n);
            _mm512_storeu_ps(chunk.as_mut_ptr(), e);
            total = _mm512_add_ps(total, e);
        }
        _mm512_reduce_add_ps(total)
    }

    /// `weighted_values`: `v` `[keys][d]`, `out` `[QUERY_BLOCK][d]`, `d` a multiple of 8.
    #[target_feature(enable = "avx512f,avx2,fma")]
    #[inline]
    pub(super) unsafe fn weighted_values(p: &[[f32; KEY_BLOCK]; QUERY_BLOCK], v: &[f32], d: usize, out: &mut [f32]) {
        let keys = v.len() / d;
        debug_assert!(d % 8 == 0 && keys <= KEY_BLOCK && out.len() == QUERY_BLOCK * d);
        let o = out.as_mut_ptr();
        let mut c = 0;
        while c + 32 <= d {
            let mut acc = [_mm512_setzero_ps(); 2 * QUERY_BLOCK];
            for r in 0..QUERY_BLOCK {
                acc[2 * r] = _mm512_loadu_ps(o.add(r * d + c));
                acc[2 * r + 1] = _mm512_loadu_ps(o.add(r * d + c + 16));
            }
            for j in 0..keys {
                let x = v.as_ptr().add(j * d + c);
                let (v0, v1) = (_mm512_loadu_ps(x), _mm512_loadu_ps(x.add(16)));
                for r in 0..QUERY_BLOCK {
                    let w = _mm512_set1_ps(*p.get_unchecked(r).get_unchecked(j));
                    acc[2 * r] = _mm512_fmadd_ps(w, v0, acc[2 * r]);
                    acc[2 * r + 1] = _mm512_fmadd_ps(w, v1, acc[2 * r + 1]);
                }
            }
            for r in 0..QUERY_BLOCK {
                _mm512_storeu_ps(o.add(r * d + c), acc[2 * r]);
                _mm512_storeu_ps(o.add(r * d + c + 16), acc[2 * r + 1]);
            }
            c += 32;
        }
        // What is left: 16 values, or 8 (a masked half register), at a time.
        while c < d {
            let m: __mmask16 = if c + 16 <= d { 0xFFFF } else { 0x00FF };
            let mut acc = [_mm512_setzero_ps(); QUERY_BLOCK];
            for (r, acc) in acc.iter_mut().enumerate() {
                *acc = _mm512_maskz_loadu_ps(m, o.add(r * d + c));
            }
            for j in 0..keys {
                let v0 = _mm512_maskz_loadu_ps(m, v.as_ptr().add(j * d + c));
                for (r, acc) in acc.iter_mut().enumerate() {
                    *acc = _mm512_fmadd_ps(_mm512_set1_ps(*p.get_unchecked(r).get_unchecked(j)), v0, *acc);
                }
            }
            for (r, acc) in acc.iter().enumerate() {
                _mm512_mask_storeu_ps(o.add(r * d + c), m, *acc);
            }
            c += if m == 0xFFFF { 16 } else { 8 };
        }
    }
}

/// The same products in NEON registers (4 floats): 16 accumulators of 4 keys (or values) for the
/// 4 query vectors, each key row loaded once for all of them. Every aarch64 CPU has NEON.
#[cfg(target_arch = "aarch64")]
mod tile_neon {
    use super::{KEY_BLOCK, QUERY_BLOCK};
    use std::arch::aarch64::*;

    /// `scores`: `q` `[d][QUERY_BLOCK]`, `kt` `[d][KEY_BLOCK]`, `keys` a multiple of 16.
    #[inline]
    pub(super) unsafe fn scores(q: &[f32], kt: &[f32], keys: usize, s: &mut [[f32; KEY_BLOCK]; QUERY_BLOCK]) {
        let d = q.len() / QUERY_BLOCK;
        debug_assert!(kt.len() >= d * KEY_BLOCK && keys % 16 == 0 && keys <= KEY_BLOCK);
        for c in (0..keys).step_by(16) {
            let mut acc = [[vdupq_n_f32(0.0); 4]; QUERY_BLOCK];
            for i in 0..d {
                let k = kt.as_ptr().add(i * KEY_BLOCK + c);
                let ks = [vld1q_f32(k), vld1q_f32(k.add(4)), vld1q_f32(k.add(8)), vld1q_f32(k.add(12))];
                // The 4 query vectors' values at index i, one lane each.
                let x = vld1q_f32(q.as_ptr().add(i * QUERY_BLOCK));
                for (col, &kc) in ks.iter().enumerate() {
                    acc[0][col] = vfmaq_laneq_f32::<0>(acc[0][col], kc, x);
                    acc[1][col] = vfmaq_laneq_f32::<1>(acc[1][col], kc, x);
                    acc[2][col] = vfmaq_laneq_f32::<2>(acc[2][col], kc, x);
                    acc[3][col] = vfmaq_laneq_f32::<3>(acc[3][col], kc, x);
                }
            }
            for (s, acc) in s.iter_mut().zip(&acc) {
                for (col, &a) in acc.iter().enumerate() {
                    vst1q_f32(s.as_mut_ptr().add(c + 4 * col), a);
                }
            }
        }
    }

    /// `weighted_values`: `v` `[keys][d]`, `out` `[QUERY_BLOCK][d]`, `d` a multiple of 8.
    #[inline]
    pub(super) unsafe fn weighted_values(p: &[[f32; KEY_BLOCK]; QUERY_BLOCK], v: &[f32], d: usize, out: &mut [f32]) {
        let keys = v.len() / d;
        debug_assert!(d % 8 == 0 && keys <= KEY_BLOCK && out.len() == QUERY_BLOCK * d);
        let o = out.as_mut_ptr();
        let mut c = 0;
        while c < d {
            // 16 values of each sum at a time, the last 8 alone.
            let width = if c + 16 <= d { 4 } else { 2 };
            let mut acc = [[vdupq_n_f32(0.0); 4]; QUERY_BLOCK];
            for (r, acc) in acc.iter_mut().enumerate() {
                for (col, a) in acc.iter_mut().enumerate().take(width) {
                    *a = vld1q_f32(o.add(r * d + c + 4 * col));
                }
            }
            for j in 0..keys {
                let x = v.as_ptr().add(j * d + c);
                for col in 0..width {
                    let vc = vld1q_f32(x.add(4 * col));
                    for (r, acc) in acc.iter_mut().enumerate() {
                        acc[col] = vfmaq_n_f32(acc[col], vc, *p.get_unchecked(r).get_unchecked(j));
                    }
                }
            }
            for (r, acc) in acc.iter().enumerate() {
                for (col, &a) in acc.iter().enumerate().take(width) {
                    vst1q_f32(o.add(r * d + c + 4 * col), a);
                }
            }
            c += 4 * width;
        }
    }
}

/// ln 2 in two parts (Cephes), so that `x − n·ln 2` loses nothing for the `n` an `f32` score gives.
const LN2_HI: f32 = 0.693_359_4;
const LN2_LO: f32 = -2.121_944_4e-4;
/// Cephes' `expf` polynomial for `(exp(r) − 1 − r) / r²` on |r| ≤ ln 2 / 2, highest degree first.
const EXP_POLY: [f32; 6] = [1.987_569_1e-4, 1.398_199_9e-3, 8.333_452e-3, 4.166_579_6e-2, 0.166_666_65, 0.5];

/// `x ← exp(x − shift)` over a row of scores (`−∞` gives 0), returning the row's sum: Cephes'
/// `expf` (range reduction by ln 2 in two parts, a degree-6 polynomial, the power of two set in
/// the exponent bits; relative error ~1e-7), written so the compiler vectorizes it, where
/// `f32::exp` is a library call per score.
#[inline(always)]
fn exp_shifted(row: &mut [f32], shift: f32) -> f32 {
    // Adding and subtracting 1.5·2^23 rounds to the nearest integer (|x·log2 e| < 2^22 here).
    const ROUND: f32 = 12_582_912.0;
    for x in row.iter_mut() {
        let y = *x - shift;
        let z = if y < -87.0 { -87.0 } else { y };
        let n = (z * std::f32::consts::LOG2_E + ROUND) - ROUND;
        // Separate multiplies and adds: `mul_add` is a library call where the build lacks FMA.
        let r = z - n * LN2_HI - n * LN2_LO;
        let p = EXP_POLY[1..].iter().fold(EXP_POLY[0], |p, &k| p * r + k);
        let e = p * (r * r) + r + 1.0;
        let two_n = f32::from_bits(((n as i32 + 127) as u32) << 23);
        *x = if y < -87.0 { 0.0 } else { e * two_n };
    }
    // In KEY_LANES running sums: one sum in order would keep the loop scalar.
    let mut lanes = [0f32; KEY_LANES];
    let chunks = row.chunks_exact(KEY_LANES);
    let rest: f32 = chunks.remainder().iter().sum();
    for chunk in chunks {
        lanes.iter_mut().zip(chunk).for_each(|(l, &x)| *l += x);
    }
    lanes.iter().sum::<f32>() + rest
}

/// The largest of a row of scores, in `KEY_LANES` running maxima so that it vectorizes.
#[inline(always)]
fn row_max(row: &[f32]) -> f32 {
    let mut lanes = [f32::NEG_INFINITY; KEY_LANES];
    let chunks = row.chunks_exact(KEY_LANES);
    let rest = chunks.remainder().iter().fold(f32::NEG_INFINITY, |m, &x| m.max(x));
    for chunk in chunks {
        lanes.iter_mut().zip(chunk).for_each(|(l, &x)| *l = if x > *l { x } else { *l });
    }
    lanes.iter().fold(rest, |m, &x| m.max(x))
}

/// A cache element the portable code widens one at a time.
trait Element: Copy {
    fn widen(self) -> f32;
}

impl Element for f32 {
    #[inline(always)]
    fn widen(self) -> f32 {
        self
    }
}

impl Element for f16 {
    #[inline(always)]
    fn widen(self) -> f32 {
        self.to_f32()
    }
}

/// The `group` query heads `q` `[group · d]` sharing keys `k` and values `v` (each one or two
/// runs of rows of `row` elements, in position order), with `dot(query, key row)` and
/// `axpy(out, weight, value row)` for the cache's element type. `out` gets each head's values
/// weighted by `exp(score - largest)`, unnormalised, and `stats` each head's (largest score, sum
/// of those weights): `Split::combine` normalises.
#[allow(clippy::too_many_arguments)]
#[inline(always)]
fn head_group<T>(
    q: &[f32],
    k: [&[T]; 2],
    v: [&[T]; 2],
    out: &mut [f32],
    stats: &mut [(f32, f32)],
    d: usize,
    row: usize,
    scale: f32,
    softcap: Option<f32>,
    dot: impl Fn(&[f32], &[T]) -> f32,
    axpy: impl Fn(&mut [f32], f32, &[T]),
) {
    let keys = (k[0].len() + k[1].len()) / row;
    let group = q.len() / d;
    let mut scores = vec![0f32; group * keys];
    for (i, key) in k[0].chunks_exact(row).chain(k[1].chunks_exact(row)).enumerate() {
        for (g, qg) in q.chunks_exact(d).enumerate() {
            scores[g * keys + i] = dot(qg, key) * scale;
        }
    }
    weigh_scores(&mut scores, keys, softcap, stats);
    out.fill(0.0);
    for (i, value) in v[0].chunks_exact(row).chain(v[1].chunks_exact(row)).enumerate() {
        for (g, og) in out.chunks_exact_mut(d).enumerate() {
            axpy(og, scores[g * keys + i], value);
        }
    }
}

/// Turns each head's row of `keys` scaled scores into `exp(score - largest)` (after the soft cap,
/// if any) and writes the head's (largest score, sum of those weights) to `stats`: unnormalised,
/// as `Split::combine` divides by the sums of several segments at once.
#[inline(always)]
fn weigh_scores(scores: &mut [f32], keys: usize, softcap: Option<f32>, stats: &mut [(f32, f32)]) {
    if let Some(cap) = softcap {
        scores.iter_mut().for_each(|x| *x = cap * (*x / cap).tanh());
    }
    for (row, stat) in scores.chunks_exact_mut(keys).zip(stats.iter_mut()) {
        let max = row_max(row);
        *stat = (max, exp_shifted(row, max));
    }
}

/// The dot product of a float32 query with a q8_0 key row: each block's 32 products summed,
/// times the block's scale.
#[inline(always)]
fn dot_q8(a: &[f32], row: &[u8]) -> f32 {
    let mut total = 0f32;
    for (x, block) in a.chunks_exact(Q8_BLOCK).zip(row.chunks_exact(Q8_BYTES)) {
        let scale = f16::from_le_bytes([block[0], block[1]]).to_f32();
        let mut acc = [0f32; 8];
        for (xs, qs) in x.chunks_exact(8).zip(block[2..].chunks_exact(8)) {
            for l in 0..8 {
                acc[l] += xs[l] * (qs[l] as i8) as f32;
            }
        }
        total += scale * acc.iter().sum::<f32>();
    }
    total
}

/// `out += w · x` for a q8_0 value row.
#[inline(always)]
fn axpy_q8(out: &mut [f32], w: f32, row: &[u8]) {
    for (o, block) in out.chunks_exact_mut(Q8_BLOCK).zip(row.chunks_exact(Q8_BYTES)) {
        let ws = w * f16::from_le_bytes([block[0], block[1]]).to_f32();
        for (o, &q) in o.iter_mut().zip(&block[2..]) {
            *o += ws * (q as i8) as f32;
        }
    }
}

/// A dot product in 8 running sums (which the compiler keeps in one vector register).
#[inline(always)]
fn dot<T: Element>(a: &[f32], b: &[T]) -> f32 {
    let mut acc = [0f32; 8];
    for (x, y) in a.chunks_exact(8).zip(b.chunks_exact(8)) {
        for l in 0..8 {
            acc[l] += x[l] * y[l].widen();
        }
    }
    acc.iter().sum()
}

/// `out += w · x`.
#[inline(always)]
fn axpy<T: Element>(out: &mut [f32], w: f32, x: &[T]) {
    for (o, &x) in out.iter_mut().zip(x) {
        *o += w * x.widen();
    }
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use super::*;
    use std::arch::x86_64::*;

    /// Whether this CPU widens float16 in registers.
    pub(super) fn available() -> bool {
        is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma") && is_x86_feature_detected!("f16c")
    }

    /// `head_group` over a float16 cache, 8 values per instruction (`d` is a multiple of 8).
    #[allow(clippy::too_many_arguments)]
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) unsafe fn head_group_f16c(
        q: &[f32],
        k: [&[f16]; 2],
        v: [&[f16]; 2],
        out: &mut [f32],
        stats: &mut [(f32, f32)],
        d: usize,
        scale: f32,
        softcap: Option<f32>,
    ) {
        head_group(q, k, v, out, stats, d, d, scale, softcap, |a, b| dot_f16(a, b), |o, w, x| axpy_f16(o, w, x))
    }

    /// `head_group` over a q8_0 cache: each block's signed bytes widened 8 at a time and
    /// multiplied in float32 (`d` is a multiple of 32, `row` its blocks' bytes).
    #[allow(clippy::too_many_arguments)]
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) unsafe fn head_group_q8(
        q: &[f32],
        k: [&[u8]; 2],
        v: [&[u8]; 2],
        out: &mut [f32],
        stats: &mut [(f32, f32)],
        d: usize,
        row: usize,
        scale: f32,
        softcap: Option<f32>,
    ) {
        head_group(q, k, v, out, stats, d, row, scale, softcap, |a, b| dot_q8_avx(a, b), |o, w, x| axpy_q8_avx(o, w, x))
    }

    /// Eight signed bytes widened to float32.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn load8_i8(p: *const u8) -> __m256 {
        _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(p as *const __m128i)))
    }

    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn dot_q8_avx(a: &[f32], row: &[u8]) -> f32 {
        let mut total = _mm256_setzero_ps();
        for (x, block) in a.chunks_exact(Q8_BLOCK).zip(row.chunks_exact(Q8_BYTES)) {
            let qs = block.as_ptr().add(2);
            let mut acc = _mm256_mul_ps(_mm256_loadu_ps(x.as_ptr()), load8_i8(qs));
            for i in (8..Q8_BLOCK).step_by(8) {
                acc = _mm256_fmadd_ps(_mm256_loadu_ps(x.as_ptr().add(i)), load8_i8(qs.add(i)), acc);
            }
            let scale = _mm256_set1_ps(f16::from_le_bytes([block[0], block[1]]).to_f32());
            total = _mm256_fmadd_ps(scale, acc, total);
        }
        let mut lanes = [0f32; 8];
        _mm256_storeu_ps(lanes.as_mut_ptr(), total);
        lanes.iter().sum()
    }

    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn axpy_q8_avx(out: &mut [f32], w: f32, row: &[u8]) {
        for (o, block) in out.chunks_exact_mut(Q8_BLOCK).zip(row.chunks_exact(Q8_BYTES)) {
            let ws = _mm256_set1_ps(w * f16::from_le_bytes([block[0], block[1]]).to_f32());
            let qs = block.as_ptr().add(2);
            for i in (0..Q8_BLOCK).step_by(8) {
                let op = o.as_mut_ptr().add(i);
                _mm256_storeu_ps(op, _mm256_fmadd_ps(ws, load8_i8(qs.add(i)), _mm256_loadu_ps(op)));
            }
        }
    }

    /// Eight float16 values widened.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn load8(p: &[f16], i: usize) -> __m256 {
        _mm256_cvtph_ps(_mm_loadu_si128(p.as_ptr().add(i) as *const __m128i))
    }

    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn dot_f16(a: &[f32], b: &[f16]) -> f32 {
        let mut acc = _mm256_setzero_ps();
        for i in (0..a.len().min(b.len()) / 8 * 8).step_by(8) {
            acc = _mm256_fmadd_ps(_mm256_loadu_ps(a.as_ptr().add(i)), load8(b, i), acc);
        }
        let mut lanes = [0f32; 8];
        _mm256_storeu_ps(lanes.as_mut_ptr(), acc);
        lanes.iter().sum()
    }

    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn axpy_f16(out: &mut [f32], w: f32, x: &[f16]) {
        let wv = _mm256_set1_ps(w);
        for i in (0..out.len().min(x.len()) / 8 * 8).step_by(8) {
            let o = out.as_mut_ptr().add(i);
            _mm256_storeu_ps(o, _mm256_fmadd_ps(wv, load8(x, i), _mm256_loadu_ps(o)));
        }
    }
}

#[cfg(target_arch = "aarch64")]
mod arm {
    use super::*;
    use std::arch::aarch64::*;

    // `head_group`'s dot product and axpy over float16 rows (8 values per step) and q8_0 rows
    // (each block's signed bytes widened 8 at a time): NEON needs no `target_feature` wrapper,
    // so the decode kernel passes these to `head_group` itself.

    /// Eight signed bytes from `p` widened to float32.
    #[inline(always)]
    unsafe fn load8_i8(p: *const u8) -> [float32x4_t; 2] {
        let wide = vmovl_s8(vld1_s8(p as *const i8));
        [vcvtq_f32_s32(vmovl_s16(vget_low_s16(wide))), vcvtq_f32_s32(vmovl_s16(vget_high_s16(wide)))]
    }

    /// The dot product of a float32 query with a q8_0 key row (each block's sum times its scale).
    #[inline(always)]
    pub(super) unsafe fn dot_q8(a: &[f32], row: &[u8]) -> f32 {
        let mut total = vdupq_n_f32(0.0);
        for (x, block) in a.chunks_exact(Q8_BLOCK).zip(row.chunks_exact(Q8_BYTES)) {
            let qs = block.as_ptr().add(2);
            let (mut acc0, mut acc1) = (vdupq_n_f32(0.0), vdupq_n_f32(0.0));
            for i in (0..Q8_BLOCK).step_by(8) {
                let [lo, hi] = load8_i8(qs.add(i));
                acc0 = vfmaq_f32(acc0, vld1q_f32(x.as_ptr().add(i)), lo);
                acc1 = vfmaq_f32(acc1, vld1q_f32(x.as_ptr().add(i + 4)), hi);
            }
            let scale = f16::from_le_bytes([block[0], block[1]]).to_f32();
            total = vfmaq_n_f32(total, vaddq_f32(acc0, acc1), scale);
        }
        vaddvq_f32(total)
    }

    /// `out += w · x` for a q8_0 value row.
    #[inline(always)]
    pub(super) unsafe fn axpy_q8(out: &mut [f32], w: f32, row: &[u8]) {
        for (o, block) in out.chunks_exact_mut(Q8_BLOCK).zip(row.chunks_exact(Q8_BYTES)) {
            let ws = w * f16::from_le_bytes([block[0], block[1]]).to_f32();
            let qs = block.as_ptr().add(2);
            for i in (0..Q8_BLOCK).step_by(8) {
                let [lo, hi] = load8_i8(qs.add(i));
                let op = o.as_mut_ptr().add(i);
                vst1q_f32(op, vfmaq_n_f32(vld1q_f32(op), lo, ws));
                vst1q_f32(op.add(4), vfmaq_n_f32(vld1q_f32(op.add(4)), hi, ws));
            }
        }
    }

    /// Eight float16 values from `p[i]` widened.
    #[inline(always)]
    unsafe fn load8(p: &[f16], i: usize) -> [float32x4_t; 2] {
        crate::arm::widen_f16x8(p.as_ptr().add(i))
    }

    #[inline(always)]
    pub(super) unsafe fn dot_f16(a: &[f32], b: &[f16]) -> f32 {
        let (mut acc0, mut acc1) = (vdupq_n_f32(0.0), vdupq_n_f32(0.0));
        for i in (0..a.len().min(b.len()) / 8 * 8).step_by(8) {
            let [lo, hi] = load8(b, i);
            acc0 = vfmaq_f32(acc0, vld1q_f32(a.as_ptr().add(i)), lo);
            acc1 = vfmaq_f32(acc1, vld1q_f32(a.as_ptr().add(i + 4)), hi);
        }
        vaddvq_f32(vaddq_f32(acc0, acc1))
    }

    #[inline(always)]
    pub(super) unsafe fn axpy_f16(out: &mut [f32], w: f32, x: &[f16]) {
        for i in (0..out.len().min(x.len()) / 8 * 8).step_by(8) {
            let [lo, hi] = load8(x, i);
            let o = out.as_mut_ptr().add(i);
            vst1q_f32(o, vfmaq_n_f32(vld1q_f32(o), lo, w));
            vst1q_f32(o.add(4), vfmaq_n_f32(vld1q_f32(o.add(4)), hi, w));
        }
    }
}

/// The decode kernel in AVX-512 registers (16 floats): each key and value row is widened (or
/// de-quantized, for a q8_0 cache) once for all the query heads of its group (the AVX2 code
/// widens it once per head: 7 times for Qwen2.5's groups), and the heads' weighted sums stay in
/// registers across the keys instead of being read and written back for every key (perf on
/// SmolLM2-135M at 512 tokens: the AVX2 kernel was a fifth of a decode step).
#[cfg(target_arch = "x86_64")]
mod decode_avx512 {
    use super::{weigh_scores, Q8_BLOCK, Q8_BYTES};
    use half::f16;
    use std::arch::x86_64::*;

    /// A cache element type whose rows load 16 values at a time as float32.
    pub(super) trait Wide: Copy {
        /// Elements of one row of `d` values.
        fn row_len(d: usize) -> usize;
        /// Values `c..c + 16` of the row at `row` as float32 (`c` a multiple of 16).
        ///
        /// # Safety
        /// The row holds them and the CPU has AVX-512F and F16C.
        unsafe fn load16(row: *const Self, c: usize) -> __m512;
    }

    impl Wide for f32 {
        fn row_len(d: usize) -> usize {
            d
        }

        #[inline]
        #[target_feature(enable = "avx512f")]
        unsafe fn load16(row: *const f32, c: usize) -> __m512 {
            _mm512_loadu_ps(row.add(c))
        }
    }

    impl Wide for f16 {
        fn row_len(d: usize) -> usize {
            d
        }

        #[inline]
        #[target_feature(enable = "avx512f,f16c")]
        unsafe fn load16(row: *const f16, c: usize) -> __m512 {
            _mm512_cvtph_ps(_mm256_loadu_si256(row.add(c) as *const __m256i))
        }
    }

    /// q8_0 blocks: a float16 scale, then 32 signed bytes.
    impl Wide for u8 {
        fn row_len(d: usize) -> usize {
            d / Q8_BLOCK * Q8_BYTES
        }

        #[inline]
        #[target_feature(enable = "avx512f,f16c")]
        unsafe fn load16(row: *const u8, c: usize) -> __m512 {
            let block = row.add(c / Q8_BLOCK * Q8_BYTES);
            let scale = f16::from_bits(u16::from_le_bytes([*block, *block.add(1)])).to_f32();
            let q = _mm_loadu_si128(block.add(2 + c % Q8_BLOCK) as *const __m128i);
            _mm512_mul_ps(_mm512_set1_ps(scale), _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(q)))
        }
    }

    /// `super::head_group` for `d` a multiple of 16 (32 for q8_0, whose blocks are whole).
    #[allow(clippy::too_many_arguments)]
    #[target_feature(enable = "avx512f,avx2,fma,f16c")]
    pub(super) unsafe fn head_group<T: Wide>(
        q: &[f32],
        k: [&[T]; 2],
        v: [&[T]; 2],
        out: &mut [f32],
        stats: &mut [(f32, f32)],
        d: usize,
        scale: f32,
        softcap: Option<f32>,
    ) {
        debug_assert!(d % 16 == 0);
        let row = T::row_len(d);
        let keys = (k[0].len() + k[1].len()) / row;
        let group = q.len() / d;
        let mut s = vec![0f32; group * keys];
        // Up to 8 heads' scores per pass over the keys (8 running sums in registers).
        let mut h = 0;
        while h < group {
            let n = (group - h).min(8);
            let (qh, sh) = (&q[h * d..(h + n) * d], &mut s[h * keys..(h + n) * keys]);
            let mut first = 0;
            for run in k {
                match n {
                    1 => scores::<T, 1>(qh, run, d, sh, keys, first, scale),
                    2 => scores::<T, 2>(qh, run, d, sh, keys, first, scale),
                    3 => scores::<T, 3>(qh, run, d, sh, keys, first, scale),
                    4 => scores::<T, 4>(qh, run, d, sh, keys, first, scale),
                    5 => scores::<T, 5>(qh, run, d, sh, keys, first, scale),
                    6 => scores::<T, 6>(qh, run, d, sh, keys, first, scale),
                    7 => scores::<T, 7>(qh, run, d, sh, keys, first, scale),
                    _ => scores::<T, 8>(qh, run, d, sh, keys, first, scale),
                }
                first += run.len() / row;
            }
            h += n;
        }
        weigh_scores(&mut s, keys, softcap, stats);
        // Up to 4 heads × 64 values per pass over the value rows (16 running sums).
        out.fill(0.0);
        let mut h = 0;
        while h < group {
            let n = (group - h).min(4);
            let (wh, oh) = (&s[h * keys..(h + n) * keys], &mut out[h * d..(h + n) * d]);
            let mut c = 0;
            while c < d {
                let wide = d - c >= 64;
                let mut first = 0;
                for run in v {
                    match (n, wide) {
                        (1, true) => values::<T, 1, 4>(wh, keys, first, run, d, c, oh),
                        (2, true) => values::<T, 2, 4>(wh, keys, first, run, d, c, oh),
                        (3, true) => values::<T, 3, 4>(wh, keys, first, run, d, c, oh),
                        (_, true) => values::<T, 4, 4>(wh, keys, first, run, d, c, oh),
                        (1, false) => values::<T, 1, 1>(wh, keys, first, run, d, c, oh),
                        (2, false) => values::<T, 2, 1>(wh, keys, first, run, d, c, oh),
                        (3, false) => values::<T, 3, 1>(wh, keys, first, run, d, c, oh),
                        (_, false) => values::<T, 4, 1>(wh, keys, first, run, d, c, oh),
                    }
                    first += run.len() / row;
                }
                c += if wide { 64 } else { 16 };
            }
            h += n;
        }
    }

    /// `s[g · stride + first + i] = scale · q_g · k_i` for the `G` heads of `q` (`[G][d]`) and
    /// the key rows of `k`: each row widened once, 16 values at a time.
    #[inline]
    #[target_feature(enable = "avx512f,avx2,fma,f16c")]
    unsafe fn scores<T: Wide, const G: usize>(
        q: &[f32],
        k: &[T],
        d: usize,
        s: &mut [f32],
        stride: usize,
        first: usize,
        scale: f32,
    ) {
        let row = T::row_len(d);
        debug_assert!(q.len() == G * d && s.len() >= (G - 1) * stride + first + k.len() / row);
        let qp = q.as_ptr();
        for (i, key) in k.chunks_exact(row).enumerate() {
            let mut acc = [_mm512_setzero_ps(); G];
            for c in (0..d).step_by(16) {
                let kc = T::load16(key.as_ptr(), c);
                for (g, acc) in acc.iter_mut().enumerate() {
                    *acc = _mm512_fmadd_ps(_mm512_loadu_ps(qp.add(g * d + c)), kc, *acc);
                }
            }
            for (g, acc) in acc.iter().enumerate() {
                *s.get_unchecked_mut(g * stride + first + i) = _mm512_reduce_add_ps(*acc) * scale;
            }
        }
    }

    /// `out[g][c..c + 16C] += Σ_i w[g · stride + first + i] · v_i[c..c + 16C]` for the `G`
    /// heads' sums `out` (`[G][d]`) over the value rows of `v`, the sums in registers.
    #[allow(clippy::too_many_arguments)]
    #[inline]
    #[target_feature(enable = "avx512f,avx2,fma,f16c")]
    unsafe fn values<T: Wide, const G: usize, const C: usize>(
        w: &[f32],
        stride: usize,
        first: usize,
        v: &[T],
        d: usize,
        c: usize,
        out: &mut [f32],
    ) {
        let row = T::row_len(d);
        debug_assert!(out.len() == G * d && c + 16 * C <= d && w.len() >= (G - 1) * stride + first + v.len() / row);
        let op = out.as_mut_ptr();
        let mut acc = [[_mm512_setzero_ps(); C]; G];
        for (g, acc) in acc.iter_mut().enumerate() {
            for (j, acc) in acc.iter_mut().enumerate() {
                *acc = _mm512_loadu_ps(op.add(g * d + c + 16 * j));
            }
        }
        for (i, value) in v.chunks_exact(row).enumerate() {
            let mut x = [_mm512_setzero_ps(); C];
            for (j, x) in x.iter_mut().enumerate() {
                *x = T::load16(value.as_ptr(), c + 16 * j);
            }
            for (g, acc) in acc.iter_mut().enumerate() {
                let wg = _mm512_set1_ps(*w.get_unchecked(g * stride + first + i));
                for (acc, &x) in acc.iter_mut().zip(&x) {
                    *acc = _mm512_fmadd_ps(wg, x, *acc);
                }
            }
        }
        for (g, acc) in acc.iter().enumerate() {
            for (j, &acc) in acc.iter().enumerate() {
                _mm512_storeu_ps(op.add(g * d + c + 16 * j), acc);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kv_layout::KvType;
    use candle_core::{Device, D};

    /// Random key and value buffers of `cap` rows in `ty`'s storage.
    fn buffers(ty: KvType, kv_heads: usize, cap: usize, d: usize) -> (Tensor, Tensor) {
        let dev = Device::Cpu;
        let r = || ty.encode(&Tensor::randn(0f32, 1.0, (1, kv_heads, cap, d), &dev).unwrap()).unwrap();
        (r(), r())
    }

    fn rel_l2(got: &Tensor, want: &Tensor) -> f32 {
        let diff = (got - want).unwrap().sqr().unwrap().sum_all().unwrap().to_scalar::<f32>().unwrap().sqrt();
        diff / want.sqr().unwrap().sum_all().unwrap().to_scalar::<f32>().unwrap().sqrt()
    }

    /// The tiled prompt kernel equals materialised scores under the causal and sliding-window
    /// masks within 1e-5 relative L2: several query tiles and key blocks, the view starting at
    /// a key that is not a block boundary, a ring whose view wraps, float32, float16 and q8_0
    /// caches, with and without softcap.
    #[test]
    fn tiled_prompt_attention_equals_masked_softmax() {
        let dev = Device::Cpu;
        let (heads, kv_heads) = (4, 2);
        let (f32_, f16_, q8) = (KvType::Dense(DType::F32), KvType::Dense(DType::F16), KvType::Q8_0);
        // (type, window, first key's position, keys held before the rows, rows, buffer rows),
        // for head widths of 32, 40 (the products' tails) and 256 (Gemma 3's).
        let cases = [
            (f32_, None, 0, 0, 37, 45),
            (f16_, None, 0, 150, 40, 195),
            (f32_, Some(50), 101, 90, 33, 130),
            (f16_, Some(7), 13, 6, 70, 80),
            (f32_, Some(500), 0, 0, 130, 135),
            // Rings: the view wraps past the buffer's end.
            (f32_, Some(9), 37, 8, 20, 29),
            (f16_, Some(30), 1000, 29, 64, 93),
            (q8, Some(12), 77, 11, 40, 51),
            (q8, None, 0, 20, 50, 80),
        ];
        for (d, (ty, window, first_key, held, t, cap)) in
            [32, 40, 256].into_iter().flat_map(|d| cases.map(move |c| (d, c)))
        {
            if d % 32 != 0 && ty == q8 {
                continue; // a q8_0 row is whole blocks of 32
            }
            let keys = held + t;
            let (k_buf, v_buf) = buffers(ty, kv_heads, cap, d);
            let view = KvView { k: &k_buf, v: &v_buf, first: first_key, len: keys };
            let q = Tensor::randn(0f32, 1.0, (1, heads, t, d), &dev).unwrap();
            for (softcap, path) in
                [None, Some(3.0f32)].into_iter().flat_map(|c| TilePath::all().into_iter().map(move |p| (c, p)))
            {
                let p = Params { heads, kv_heads, head_dim: d, scale: 0.3, softcap };
                let span = PromptSpan { offset: held, first_key, window };
                let got = prompt_with(&q, &view, span, p, path).unwrap(); // [t, heads, d]
                let (kf, vf) = view.dense(DType::F32).unwrap();
                let qg = q.reshape((1, kv_heads, heads / kv_heads * t, d)).unwrap();
                let mut s = (qg.matmul(&kf.t().unwrap()).unwrap() * 0.3).unwrap();
                if let Some(c) = softcap {
                    s = ((s / c as f64).unwrap().tanh().unwrap() * c as f64).unwrap();
                }
                let mut mask = vec![0f32; t * keys];
                for i in 0..t {
                    for j in 0..keys {
                        let (qa, ka) = (first_key + held + i, first_key + j);
                        if ka > qa || window.is_some_and(|w| qa - ka >= w) {
                            mask[i * keys + j] = f32::NEG_INFINITY;
                        }
                    }
                }
                let mask = Tensor::from_vec(mask, (t, keys), &dev).unwrap();
                let s = s.reshape((1, heads, t, keys)).unwrap().broadcast_add(&mask).unwrap();
                let probs = candle_nn::ops::softmax(&s, D::Minus1)
                    .unwrap()
                    .reshape((1, kv_heads, heads / kv_heads * t, keys))
                    .unwrap();
                let want = probs.matmul(&vf.contiguous().unwrap()).unwrap().reshape((heads, t, d)).unwrap();
                let want = want.transpose(0, 1).unwrap();
                let err = rel_l2(&got, &want);
                assert!(
                    err < 1e-5,
                    "{ty:?} {path:?} window {window:?} first {first_key} held {held} t {t} softcap {softcap:?}: rel L2 {err}"
                );
            }
        }
    }

    /// Equals candle's grouped matmul / softmax / matmul on a cache view inside a larger buffer
    /// (as the session's cache is) and on a ring's view that wraps, with and without a softcap,
    /// for a float32, float16 and q8_0 cache (candle's products on the values widened), on
    /// every code path this CPU runs (`TilePath::all`). 1,200 keys make five segments of keys
    /// run apart and combined, with a ring wrapping inside a segment and at a segment's
    /// boundary. Groups of 3 heads of 32 values, of 10 heads of 80 and of 5 of 64 (the AVX-512
    /// code's passes of 8 heads' scores and 4 heads' values, and its 64- and 16-value chunks).
    #[test]
    fn equals_candles_attention_on_a_cache_view() {
        let dev = Device::Cpu;
        let (f32_, f16_, q8) = (KvType::Dense(DType::F32), KvType::Dense(DType::F16), KvType::Q8_0);
        // At slots 3.. (a full layer's positions 3..), and wrapping from slot 31 (a ring); 1,200
        // keys from slot 3, and wrapping after 700 and after exactly 512 keys.
        let views: [(usize, usize, &[usize]); 2] = [(40, 29, &[3, 71]), (1300, 1200, &[3, 1900, 2088])];
        // q8_0 rows are whole blocks of 32.
        let (all, dense) = ([f32_, f16_, q8], [f32_, f16_]);
        let shapes = [(6, 2, 32, all.as_slice()), (10, 1, 80, dense.as_slice()), (5, 1, 64, all.as_slice())];
        let cases = shapes.iter().flat_map(|&(heads, kv_heads, d, types)| {
            types
                .iter()
                .flat_map(move |&ty| TilePath::all().into_iter().map(move |path| (heads, kv_heads, d, ty, path)))
        });
        for (heads, kv_heads, d, ty, path) in cases {
            for &(cap, keys, firsts) in &views {
                let (k_buf, v_buf) = buffers(ty, kv_heads, cap, d);
                for &first in firsts {
                    let view = KvView { k: &k_buf, v: &v_buf, first, len: keys };
                    let q = Tensor::randn(0f32, 1.0, (1, heads, 1, d), &dev).unwrap();
                    for softcap in [None, Some(5.0f32)] {
                        let p = Params { heads, kv_heads, head_dim: d, scale: 0.25, softcap };
                        assert!(takes(&q, &view));
                        let got = decode_with(&q, &view, p, path).unwrap();
                        let (k, v) = view.dense(DType::F32).unwrap();
                        let qg = q.reshape((1, kv_heads, heads / kv_heads, d)).unwrap();
                        let mut s = (qg.matmul(&k.t().unwrap()).unwrap() * 0.25).unwrap();
                        if let Some(c) = softcap {
                            s = ((s / c as f64).unwrap().tanh().unwrap() * c as f64).unwrap();
                        }
                        let probs = candle_nn::ops::softmax(&s, D::Minus1).unwrap();
                        let want = probs.matmul(&v.contiguous().unwrap()).unwrap().reshape((1, heads, d)).unwrap();
                        let diff = (got - want).unwrap().abs().unwrap().max_all().unwrap().to_scalar::<f32>().unwrap();
                        assert!(
                            diff < 1e-5,
                            "{ty:?} {path:?} {heads}/{kv_heads} heads of {d}, keys {keys} first {first} softcap {softcap:?}: \
                             max difference {diff}"
                        );
                    }
                }
            }
        }
    }
    /// `cargo test --release --lib attention_timing -- --ignored --nocapture`: the decode and
    /// prompt kernels over a float16 and a q8_0 cache of Gemma 3 270M's shape (4 query heads, 1
    /// kv head of 256), best of 5.
    #[test]
    #[ignore]
    fn attention_timing() {
        let dev = Device::Cpu;
        // This thread's CPU time (run with CANDLE_NUM_THREADS=1 so the kernels run on it): on a
        // shared machine, less moved by the neighbours than the wall clock. With
        // CANDLEWICK_TIMING_CLOCK=wall, the wall clock: what several threads gain.
        let clock = match std::env::var("CANDLEWICK_TIMING_CLOCK").as_deref() {
            Ok("wall") => libc::CLOCK_MONOTONIC,
            _ => libc::CLOCK_THREAD_CPUTIME_ID,
        };
        let cpu = || crate::cpu_seconds(clock);
        let best = |f: &dyn Fn(), reps: usize| {
            f();
            (0..5)
                .map(|_| {
                    let t = cpu();
                    for _ in 0..reps {
                        f();
                    }
                    (cpu() - t) / reps as f64
                })
                .fold(f64::MAX, f64::min)
        };
        // Gemma 3 270M's shape, Qwen2.5-Coder 0.5B's (14 query heads over 2 kv heads of 64), SmolLM2's.
        for ((heads, kv_heads, d), keys) in
            [(4, 1, 256), (14, 2, 64), (9, 3, 64)].into_iter().flat_map(|s| [(s, 512usize), (s, 2048), (s, 16384)])
        {
            let p = Params { heads, kv_heads, head_dim: d, scale: 0.0625, softcap: None };
            for ty in [KvType::Dense(DType::F16), KvType::Q8_0] {
                let (k, v) = buffers(ty, kv_heads, keys, d);
                let view = KvView { k: &k, v: &v, first: 0, len: keys };
                let q = Tensor::randn(0f32, 1.0, (1, heads, 1, d), &dev).unwrap();
                for path in TilePath::all() {
                    let t = best(&|| drop(decode_with(&q, &view, p, path).unwrap()), 50);
                    let bytes = (k.elem_count() * k.dtype().size_in_bytes() * 2) as f64;
                    println!(
                        "decode over {keys} keys, {heads}/{kv_heads} heads of {d}, {}, {path:?}: {:.1} us ({:.1} GB/s)",
                        ty.name(),
                        t * 1e6,
                        bytes / t / 1e9
                    );
                }
            }
        }
        // Gemma 3 270M's shape, then Qwen2.5-Coder 0.5B's (14 query heads over 2 kv heads of 64).
        for (heads, kv_heads, d, t, keys) in
            [(4, 1, 256, 512usize, 2048usize), (14, 2, 64, 512, 2048), (14, 2, 64, 512, 8192)]
        {
            let p = Params { heads, kv_heads, head_dim: d, scale: 0.125, softcap: None };
            for ty in [KvType::Dense(DType::F16), KvType::Q8_0] {
                let (k, v) = buffers(ty, kv_heads, keys, d);
                let view = KvView { k: &k, v: &v, first: 0, len: keys };
                let q = Tensor::randn(0f32, 1.0, (1, heads, t, d), &dev).unwrap();
                let span = PromptSpan { offset: keys - t, first_key: 0, window: None };
                for path in TilePath::all() {
                    let s = best(&|| drop(prompt_with(&q, &view, span, p, path).unwrap()), 2);
                    println!(
                        "prompt of {t} rows over {keys} keys, {heads}/{kv_heads} heads of {d}, {}, {path:?}: {:.2} ms",
                        ty.name(),
                        s * 1e3
                    );
                }
            }
        }
    }
}
