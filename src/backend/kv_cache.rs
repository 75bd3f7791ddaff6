//! The KV cache: per layer, the keys and values a later step can still attend, in the cache's type.
//!
//! A layer without a window holds every position at slot = position. A sliding-window layer
//! (Gemma 2/3's local layers, Mistral, gpt-oss's windowed layers) holds a ring, as llama.cpp's SWA
//! cache does: slot = position mod capacity, the capacity being the window plus the largest step in
//! flight (`RING_SLACK` at least), so its memory stops growing at the window however long the
//! sequence. Kernels read keys in position order whatever the slots (`KvView::runs`), so a ring,
//! a full layer, a fork and a restored snapshot give the same numbers bit for bit.
//!
//! What a ring has overwritten is gone: a truncate that would need it is refused
//! (`KvCache::can_truncate`), never answered with a different state.

use candle_core::Tensor;
pub use candlewick_kernels::kv_layout::{dequantize_q8_0, quantize_q8_0, KvType, KvView, Q8_BLOCK, Q8_BYTES};

/// Positions a ring keeps beyond its window, at least: the session's prompt chunk
/// (`PREFILL_CHUNK`, the largest plain step, is defined as this) fits beside the window without
/// growing it, and a rewind of up to this many tokens (a rejected draft, a stop string's tail)
/// stays possible.
pub const RING_SLACK: usize = 512;

/// The fewest positions a layer's buffers grow by when a step overruns them.
const GROWTH_MIN: usize = 64;

/// A regrown buffer from this size on is handed back to the operating system once freed.
const TRIM_BYTES: usize = 4 << 20;

/// Keys and values of one layer, `[1, kv_heads, capacity, row]`, positions at `slot` (see the
/// module's notes), valid from `first` up to the session's length.
///
/// Not `Clone`: appends write into the buffers in place, so a clone sharing them would see the
/// other's writes. `KvCache::deep_copy` makes an independent one.
#[derive(Debug)]
pub struct LayerKv {
    k: Option<Tensor>,
    v: Option<Tensor>,
    /// Positions the session expects to hold (`KvCache::reserve`): the first allocation past
    /// what is held takes this size at once rather than growing by doubling.
    reserve: usize,
    /// The layer's sliding window: its buffers are then a ring.
    window: Option<usize>,
    /// Positions a ring keeps beyond its window, at least.
    slack: usize,
    /// The first position still held (above 0 only once a ring has wrapped).
    first: usize,
}

/// One layer's held positions copied out in position order (snapshots, forks, the prefix cache).
#[derive(Debug, Clone)]
pub struct HeldKv {
    /// The first position held.
    pub first: usize,
    /// Keys `[1, kv_heads, positions, row]` in the cache's storage type.
    pub k: Tensor,
    /// Values, as `k`.
    pub v: Tensor,
}

/// The whole model's cache and how many positions it holds.
#[derive(Debug)]
pub struct KvCache {
    layers: Vec<LayerKv>,
    len: usize,
    max_context: usize,
}

impl KvCache {
    /// An empty cache for layers with these sliding windows (`None`: the layer attends every
    /// position) that never grows past `max_context` positions.
    pub fn new(windows: &[Option<usize>], max_context: usize) -> Self {
        let layers = windows.iter().map(|&window| LayerKv::empty(window)).collect();
        Self { layers, len: 0, max_context }
    }

    /// Makes every ring keep at least `slack` positions beyond its window (`RING_SLACK` unless
    /// set; 0 makes each ring exactly the window plus the step in flight, as tests want).
    pub fn set_ring_slack(&mut self, slack: usize) {
        for l in &mut self.layers {
            l.slack = slack;
        }
    }

    /// A copy that shares no buffer with this cache, holding exactly its positions.
    pub fn deep_copy(&self) -> candle_core::Result<Self> {
        let held = self.held()?;
        let mut copy = Self::from_held(held, self.len, self.max_context, &self.windows())?;
        copy.set_ring_slack(self.layers.first().map_or(RING_SLACK, |l| l.slack));
        Ok(copy)
    }

    /// Each layer's sliding window.
    pub fn windows(&self) -> Vec<Option<usize>> {
        self.layers.iter().map(|l| l.window).collect()
    }

    /// Each layer's held positions, read in place (`None` when empty).
    pub fn views(&self) -> Vec<Option<KvView<'_>>> {
        self.layers.iter().map(|l| l.view(self.len)).collect()
    }

    /// Each layer's held positions copied out in position order (`None` when empty).
    pub fn held(&self) -> candle_core::Result<Vec<Option<HeldKv>>> {
        self.layers
            .iter()
            .map(|l| match l.view(self.len) {
                Some(view) => {
                    let (k, v) = view.stored()?;
                    Ok(Some(HeldKv { first: view.first, k, v }))
                }
                None => Ok(None),
            })
            .collect()
    }

    /// A cache of `len` positions holding `layers` (owned by the new cache), for layers with these
    /// windows; a ring given more positions than it keeps takes the latest. Positions a layer
    /// needs but `layers` lacks (a full layer not starting at 0, a window reaching before the
    /// first position given) are an error.
    pub fn from_held(
        layers: Vec<Option<HeldKv>>,
        len: usize,
        max_context: usize,
        windows: &[Option<usize>],
    ) -> candle_core::Result<Self> {
        if layers.len() != windows.len() {
            candle_core::bail!("{} layers of keys and values for {} layers", layers.len(), windows.len())
        }
        let mut out = Vec::with_capacity(layers.len());
        for (i, (held, &window)) in layers.into_iter().zip(windows).enumerate() {
            let mut layer = LayerKv::empty(window);
            if let Some(h) = held {
                let n = h.k.dim(2)?;
                if h.first + n != len || h.v.dims() != h.k.dims() {
                    candle_core::bail!("layer {i} holds positions {}..{} of {len}", h.first, h.first + n)
                }
                if h.first > layer.needed_from(len) {
                    candle_core::bail!(
                        "layer {i} holds positions from {} on; continuing at {len} needs them from {}",
                        h.first,
                        layer.needed_from(len)
                    )
                }
                // A ring keeps what it would have kept had it computed them: its target size.
                let keep_from = match window {
                    Some(w) => h.first.max(len.saturating_sub(layer.ring_target(w, 1, max_context))),
                    None => h.first,
                };
                let (k, v) = (
                    h.k.narrow(2, keep_from - h.first, len - keep_from)?,
                    h.v.narrow(2, keep_from - h.first, len - keep_from)?,
                );
                let cap = len - keep_from;
                if cap > 0 {
                    layer.k = Some(place(&k, keep_from, cap)?);
                    layer.v = Some(place(&v, keep_from, cap)?);
                    layer.first = keep_from;
                }
            } else if len > 0 && layer.needed_from(len) < len {
                candle_core::bail!("layer {i} holds nothing of the {len} positions")
            }
            out.push(layer);
        }
        Ok(Self { layers: out, len, max_context })
    }

    /// Number of layers.
    pub fn num_layers(&self) -> usize {
        self.layers.len()
    }

    /// Positions held.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether nothing is held.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The largest number of positions it may hold.
    pub fn max_context(&self) -> usize {
        self.max_context
    }

    /// The cache of layer `i`.
    pub fn layer(&mut self, i: usize) -> &mut LayerKv {
        &mut self.layers[i]
    }

    /// Says the session will hold `total` positions (a prompt and the tokens to generate), so
    /// that a layer that must grow allocates that much at once: a 4,000-token prompt then holds
    /// a cache of its size, not of the next power of two, and is not copied at every doubling.
    /// Never past `max_context` (nor past a ring's size); a later append beyond it grows
    /// geometrically as before. A smaller hint than one already given keeps the larger; `reset`
    /// forgets it.
    pub fn reserve(&mut self, total: usize) {
        let total = total.min(self.max_context);
        for l in &mut self.layers {
            l.reserve = l.reserve.max(total);
        }
    }

    /// Marks `n` more positions as held, after every layer appended them.
    pub fn advance(&mut self, n: usize) {
        self.len += n;
    }

    /// The smallest `n` above 0 that `truncate` takes: a step at `n` must find every key its
    /// windows reach back to, and a ring has overwritten what lies further back than its slack.
    /// 0 when every position is held.
    pub fn earliest_truncate(&self) -> usize {
        self.layers
            .iter()
            .filter_map(|l| l.window.filter(|_| l.first > 0).map(|w| l.first + w - 1))
            .max()
            .unwrap_or(0)
            .min(self.len)
    }

    /// Whether `truncate(n)` keeps a state a step can continue from (0 always does).
    pub fn can_truncate(&self, n: usize) -> bool {
        n <= self.len && (n == 0 || n >= self.earliest_truncate())
    }

    /// Keeps only the first `n` positions; later appends overwrite the rest. The caller checked
    /// `can_truncate(n)` (or is undoing a failed step, which a ring always keeps room for).
    pub fn truncate(&mut self, n: usize) {
        self.len = self.len.min(n);
        for l in &mut self.layers {
            l.first = l.first.min(self.len);
        }
    }

    /// Forgets everything and frees the memory.
    pub fn reset(&mut self) {
        self.len = 0;
        for l in &mut self.layers {
            l.k = None;
            l.v = None;
            l.reserve = 0;
            l.first = 0;
        }
    }

    /// Bytes held by the cache's buffers.
    pub fn allocated_bytes(&self) -> usize {
        self.layers
            .iter()
            .flat_map(|l| [&l.k, &l.v])
            .flatten()
            .map(|t| t.elem_count() * t.dtype().size_in_bytes())
            .sum()
    }
}

impl LayerKv {
    fn empty(window: Option<usize>) -> Self {
        Self { k: None, v: None, reserve: 0, window: window.map(|w| w.max(1)), slack: RING_SLACK, first: 0 }
    }

    /// The layer's sliding window, if it has one.
    pub fn window(&self) -> Option<usize> {
        self.window
    }

    /// The first position a step at `pos` attends in this layer.
    fn needed_from(&self, pos: usize) -> usize {
        self.window.map_or(0, |w| (pos + 1).saturating_sub(w))
    }

    /// The size a ring of window `w` takes for steps of up to `t` positions.
    fn ring_target(&self, w: usize, t: usize, max_context: usize) -> usize {
        (w - 1 + t.max(self.slack)).min(max_context)
    }

    /// The positions `first..len` held (`None` when none are).
    fn view(&self, len: usize) -> Option<KvView<'_>> {
        match (&self.k, &self.v) {
            (Some(k), Some(v)) if len > self.first => Some(KvView { k, v, first: self.first, len: len - self.first }),
            _ => None,
        }
    }

    /// Writes `k`, `v` `[1, kv_heads, t, row]` (in the cache's storage, `KvType::encode`) at
    /// positions `pos..pos + t` and returns a view of every position held up to `pos + t`: all
    /// of them, or for a ring at least the window of each of the step's rows.
    pub fn append(
        &mut self,
        k: &Tensor,
        v: &Tensor,
        pos: usize,
        max_context: usize,
    ) -> candle_core::Result<KvView<'_>> {
        let t = k.dim(2)?;
        let capacity = self.k.as_ref().map(|k| k.dim(2)).transpose()?.unwrap_or(0);
        // Slots that must coexist: every position, or for a ring the window of the step's first
        // row through its last (a row's window reaches `w - 1` back).
        let needed = match self.window {
            None => pos + t,
            Some(w) => (pos + t).min(w - 1 + t),
        };
        if needed > capacity {
            let limit = match self.window {
                None => max_context.max(pos + t),
                Some(w) => self.ring_target(w, t, max_context).max(needed),
            };
            // To the reserved size when it covers this append; otherwise geometrically, so a long
            // generation reallocates O(log n) times; never past max_context (or a ring's size).
            // By an eighth rather than doubling: the first decode after a 100,000-token prompt
            // would otherwise hold twice the prompt's cache (Gemma 3 270M: +300 MiB), and a
            // regrow copies one layer at a time, each copy far cheaper than the attention that
            // reads the whole cache at every step between two regrows.
            let new_cap = if self.reserve >= needed {
                self.reserve.min(limit).max(needed)
            } else {
                needed.max(capacity + (capacity / 8).max(GROWTH_MIN)).min(limit)
            };
            // Held positions the new buffers keep: those this step does not overwrite.
            let keep_from = self.first.max((pos + t).saturating_sub(new_cap)).min(pos);
            // A large old buffer, freed, is returned before the next one grows: glibc keeps
            // buffers under its (adaptive) mmap threshold in its arenas, and the layers' freed
            // buffers then add up (a 32,768-token Gemma 3 270M cache: 70 MiB more at its first
            // decode). Small ones are not worth a trim.
            let large = self.k.as_ref().is_some_and(|t| t.elem_count() * t.dtype().size_in_bytes() >= TRIM_BYTES);
            for (buffer, like) in [(&mut self.k, k), (&mut self.v, v)] {
                *buffer = Some(regrow(buffer.take(), like, keep_from, pos, new_cap)?);
                if large {
                    crate::memory::release_freed_memory();
                }
            }
            self.first = keep_from;
        }
        let (kc, vc) = (self.k.as_ref().expect("allocated above"), self.v.as_ref().expect("allocated above"));
        let cap = kc.dim(2)?;
        let (k, v) = (k.contiguous()?, v.contiguous()?);
        let written = KvView { k: kc, v: vc, first: pos, len: t };
        let mut done = 0;
        for (slot, n) in written.runs() {
            if n == t {
                kc.slice_set(&k, 2, slot)?;
                vc.slice_set(&v, 2, slot)?;
            } else {
                // A step wrapping past a ring's end: each part in its own contiguous copy.
                kc.slice_set(&k.narrow(2, done, n)?.contiguous()?, 2, slot)?;
                vc.slice_set(&v.narrow(2, done, n)?.contiguous()?, 2, slot)?;
            }
            done += n;
        }
        self.first = self.first.min(pos).max((pos + t).saturating_sub(cap));
        Ok(KvView { k: kc, v: vc, first: self.first, len: pos + t - self.first })
    }
}

/// Positions `regrow` copies at once: bounds the temporary a piece needs where a narrowed view
/// is not contiguous (several kv heads) to a few MiB, whatever the cache's size.
const REGROW_PIECE: usize = 4096;

/// A new buffer of `capacity` rows like `like` (`[1, kv_heads, _, row]`), holding positions
/// `from..to` of `old` at their slots (position mod capacity). The rows move piece by piece from
/// slot to slot: while it runs, the old and the new buffer are all it holds (a copy of the old
/// rows in position order first cost a 100,000-token Gemma 3 cache 70 MiB more at its first decode).
fn regrow(old: Option<Tensor>, like: &Tensor, from: usize, to: usize, capacity: usize) -> candle_core::Result<Tensor> {
    let (b, h, _, d) = like.dims4()?;
    let fresh = Tensor::zeros((b, h, capacity, d), like.dtype(), like.device())?;
    if let Some(old) = old {
        let old_capacity = old.dim(2)?.max(1);
        let mut p = from;
        while p < to {
            let (src, dst) = (p % old_capacity, p % capacity);
            let n = (to - p).min(old_capacity - src).min(capacity - dst).min(REGROW_PIECE);
            fresh.slice_set(&old.narrow(2, src, n)?.contiguous()?, 2, dst)?;
            p += n;
        }
    }
    Ok(fresh)
}

/// Rows `rows` `[1, kv_heads, n, row]` of positions `first..first + n` in a buffer of their own
/// with `capacity` rows, each at its slot.
fn place(rows: &Tensor, first: usize, capacity: usize) -> candle_core::Result<Tensor> {
    let (b, h, _, d) = rows.dims4()?;
    let fresh = Tensor::zeros((b, h, capacity, d), rows.dtype(), rows.device())?;
    write_at(&fresh, &rows.contiguous()?, first)?;
    Ok(fresh)
}

/// Writes contiguous `rows` of positions from `first` on into `buffer` at their slots.
fn write_at(buffer: &Tensor, rows: &Tensor, first: usize) -> candle_core::Result<()> {
    let n = rows.dim(2)?;
    let view = KvView { k: buffer, v: buffer, first, len: n };
    let mut done = 0;
    for (slot, count) in view.runs() {
        buffer.slice_set(&rows.narrow(2, done, count)?.contiguous()?, 2, slot)?;
        done += count;
    }
    Ok(())
}

/// A `[1, kv_heads, len, row]` tensor in a buffer of its own (never a view sharing storage,
/// even when `t` is contiguous), as a cache layer or a prefix block needs.
pub fn owned_copy(t: &Tensor) -> candle_core::Result<Tensor> {
    place(t, 0, t.dim(2)?)
}
