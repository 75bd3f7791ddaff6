//! The KV cache: per layer, keys and values of every position held, grown on demand.

use candle_core::Tensor;

/// Keys and values of one layer, `[1, kv_heads, capacity, head_dim]`, valid up to the session's length.
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
}

/// The whole model's cache and how many positions it holds.
#[derive(Debug)]
pub struct KvCache {
    layers: Vec<LayerKv>,
    len: usize,
    max_context: usize,
}

impl KvCache {
    /// An empty cache for `n_layers` layers that never grows past `max_context` positions.
    pub fn new(n_layers: usize, max_context: usize) -> Self {
        Self { layers: (0..n_layers).map(|_| LayerKv { k: None, v: None, reserve: 0 }).collect(), len: 0, max_context }
    }

    /// A copy that shares no buffer with this cache, holding exactly its positions.
    pub fn deep_copy(&self) -> candle_core::Result<Self> {
        let held = self
            .held()?
            .into_iter()
            .map(|kv| kv.map(|(k, v)| Ok::<_, candle_core::Error>((owned_copy(&k)?, owned_copy(&v)?))).transpose())
            .collect::<candle_core::Result<Vec<_>>>()?;
        Ok(Self::from_held(held, self.len, self.max_context))
    }

    /// Views of each layer's held keys and values, `[1, kv_heads, len, head_dim]` (`None` when empty).
    pub fn held(&self) -> candle_core::Result<Vec<Option<(Tensor, Tensor)>>> {
        self.layers
            .iter()
            .map(|l| match (&l.k, &l.v) {
                (Some(k), Some(v)) if self.len > 0 => Ok(Some((k.narrow(2, 0, self.len)?, v.narrow(2, 0, self.len)?))),
                _ => Ok(None),
            })
            .collect()
    }

    /// A cache holding `layers` (each `[1, kv_heads, len, head_dim]`, owned by the new cache) at `len` positions.
    pub fn from_held(layers: Vec<Option<(Tensor, Tensor)>>, len: usize, max_context: usize) -> Self {
        let layers = layers
            .into_iter()
            .map(|kv| match kv {
                Some((k, v)) => LayerKv { k: Some(k), v: Some(v), reserve: 0 },
                None => LayerKv { k: None, v: None, reserve: 0 },
            })
            .collect();
        Self { layers, len, max_context }
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
    /// Never past `max_context`; a later append beyond it grows geometrically as before.
    /// A smaller hint than one already given keeps the larger; `reset` forgets it.
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

    /// Keeps only the first `n` positions; later appends overwrite the rest.
    pub fn truncate(&mut self, n: usize) {
        self.len = self.len.min(n);
    }

    /// Forgets everything and frees the memory.
    pub fn reset(&mut self) {
        self.len = 0;
        for l in &mut self.layers {
            l.k = None;
            l.v = None;
            l.reserve = 0;
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
    /// Writes `k`, `v` `[1, kv_heads, t, head_dim]` at positions `pos..pos + t` and returns
    /// views of all `pos + t` positions.
    pub fn append(
        &mut self,
        k: &Tensor,
        v: &Tensor,
        pos: usize,
        max_context: usize,
    ) -> candle_core::Result<(Tensor, Tensor)> {
        let t = k.dim(2)?;
        let needed = pos + t;
        let capacity = self.k.as_ref().map(|k| k.dim(2)).transpose()?.unwrap_or(0);
        if needed > capacity {
            // To the reserved size when it covers this append; otherwise geometrically, so a long
            // generation reallocates O(log n) times; never past max_context.
            let new_cap = if self.reserve >= needed {
                self.reserve
            } else {
                needed.max(capacity * 2).max(64).min(max_context.max(needed))
            };
            self.k = Some(grow(self.k.take(), k, pos, new_cap)?);
            self.v = Some(grow(self.v.take(), v, pos, new_cap)?);
        }
        let (kc, vc) = (self.k.as_ref().expect("allocated above"), self.v.as_ref().expect("allocated above"));
        kc.slice_set(&k.contiguous()?, 2, pos)?;
        vc.slice_set(&v.contiguous()?, 2, pos)?;
        Ok((kc.narrow(2, 0, needed)?, vc.narrow(2, 0, needed)?))
    }
}

fn grow(old: Option<Tensor>, like: &Tensor, keep: usize, capacity: usize) -> candle_core::Result<Tensor> {
    let (b, h, _, d) = like.dims4()?;
    let fresh = Tensor::zeros((b, h, capacity, d), like.dtype(), like.device())?;
    if let Some(old) = old {
        if keep > 0 {
            fresh.slice_set(&old.narrow(2, 0, keep)?.contiguous()?, 2, 0)?;
        }
    }
    Ok(fresh)
}

/// A `[1, kv_heads, len, head_dim]` tensor in a buffer of its own (never a view sharing storage,
/// even when `t` is contiguous), as a cache layer needs before it appends in place.
pub fn owned_copy(t: &Tensor) -> candle_core::Result<Tensor> {
    let len = t.dim(2)?;
    grow(Some(t.clone()), t, len, len)
}
