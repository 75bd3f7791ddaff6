//! Grouped-query self-attention over the session's KV cache.

use candle_core::{DType, Device, Tensor};

use super::hooks::Hooks;
use super::linear::Linear;
use super::norm::Norm;
use super::rope;
use crate::backend::kernels;
use crate::backend::kv_cache::{KvType, LayerKv};
use crate::core::{LayerPoint, Point};

/// The attention's input projections.
#[derive(Debug, Clone)]
pub enum QkvProj {
    /// Three maps.
    Separate {
        /// Queries.
        q: Linear,
        /// Keys.
        k: Linear,
        /// Values.
        v: Linear,
    },
    /// One map whose output is queries, keys, values side by side (Phi-3).
    Fused(Linear),
}

/// The q and k norms of one layer.
#[derive(Debug, Clone)]
pub struct QkNorms {
    /// The query norm.
    pub q: Norm,
    /// The key norm.
    pub k: Norm,
    /// Whether they normalise the whole projection (`[heads · head_dim]`) rather than each head.
    pub whole: bool,
}

/// One layer's self-attention.
#[derive(Debug, Clone)]
pub struct Attention {
    /// Input projections.
    pub qkv: QkvProj,
    /// Output projection.
    pub o: Linear,
    /// Norms of q and k before RoPE: per head (Qwen3, Gemma 3) or over the whole projection (OLMo 2).
    pub qk_norm: Option<QkNorms>,
    /// Query heads.
    pub num_heads: usize,
    /// Key/value heads.
    pub num_kv_heads: usize,
    /// Width of a head.
    pub head_dim: usize,
    /// Multiplier of q·k.
    pub scale: f64,
    /// Soft cap of scores.
    pub softcap: Option<f64>,
    /// One learned logit per head that joins the softmax as an extra key with no value (gpt-oss),
    /// float32 `[heads]`.
    pub sinks: Option<Tensor>,
    /// Whether RoPE rotates adjacent pairs.
    pub rope_interleaved: bool,
    /// How keys and values are cached (see `decoder::default_cache_type`).
    pub cache_type: KvType,
    /// The dtype of the score and value products of a prompt: the weights' dtype.
    pub product_dtype: DType,
}

/// What one forward step shares between the layers of one variant.
pub struct StepTables {
    /// RoPE cos and sin tables `[t, rot/2]`; `None` where the layer rotates nothing.
    pub rope: Option<(Tensor, Tensor)>,
    /// The first key any query of the step can see (0 unless a sliding window cuts earlier ones).
    pub key_start: usize,
    /// The step's first position, its rows, and the layer's sliding window.
    pos: usize,
    t: usize,
    window: Option<usize>,
    device: Device,
    /// Whether this step decodes generated tokens, one per sequence: its attention may read the
    /// cache with `kernels::attention` (prompts keep the batched products, so a prompt's last row
    /// is the same number whether it ran with the prompt or alone after a reused prefix).
    pub decoding: bool,
    /// Absolute position ranges `[start, end)` attended in both directions (an image's tokens in
    /// Gemma 3): a query sees the later keys of its own block too. Such a step materialises its
    /// scores (the tiled kernel masks causally).
    pub blocks: Vec<(usize, usize)>,
    /// Whether queries also attend the step's later keys (embedding models: `ArchConfig::bidirectional`);
    /// a sliding window then keeps keys closer than it on either side.
    pub bidirectional: bool,
}

impl StepTables {
    /// Tables for queries `pos..pos + t` of a layer variant with an optional sliding window.
    pub fn new(
        rope: Option<(Tensor, Tensor)>,
        pos: usize,
        t: usize,
        window: Option<usize>,
        device: &Device,
    ) -> candle_core::Result<Self> {
        // Transformers' convention: a window of w keeps the query and the w - 1 keys before it,
        // so keys before the first query's window are never attended and are not even read.
        let key_start = window.map_or(0, |w| (pos + 1).saturating_sub(w));
        Ok(Self {
            rope,
            key_start,
            pos,
            t,
            window,
            device: device.clone(),
            decoding: false,
            blocks: Vec::new(),
            bidirectional: false,
        })
    }

    /// The additive mask `[t, pos + t - key_start]` (0 or -inf), or `None` when nothing is
    /// masked; made only where the scores are materialised (the tiled kernel masks per tile).
    pub fn mask(&self) -> candle_core::Result<Option<Tensor>> {
        let (pos, t, key_start, window) = (self.pos, self.t, self.key_start, self.window);
        if t == 1 || (self.bidirectional && window.is_none_or(|w| pos + t <= w)) {
            return Ok(None);
        }
        let keys = pos + t - key_start;
        let mut m = vec![0f32; t * keys];
        for i in 0..t {
            let q = pos + i;
            for (j, cell) in m[i * keys..(i + 1) * keys].iter_mut().enumerate() {
                let k = key_start + j;
                let same_block = || self.blocks.iter().any(|&(s, e)| (s..e).contains(&q) && (s..e).contains(&k));
                let masked = match self.bidirectional {
                    true => window.is_some_and(|w| q.abs_diff(k) >= w),
                    false => (k > q && !same_block()) || window.is_some_and(|w| q.saturating_sub(k) >= w),
                };
                if masked {
                    *cell = f32::NEG_INFINITY;
                }
            }
        }
        Ok(Some(Tensor::from_vec(m, (t, keys), &self.device)?))
    }
}

/// Whether prompt rows go through the tiled kernel (`CANDLEWICK_TILED_ATTENTION=0` forces the
/// materialised scores, to compare the two).
fn tiled_prompts() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ON.get_or_init(|| std::env::var("CANDLEWICK_TILED_ATTENTION").map_or(true, |v| v != "0"))
}

impl Attention {
    /// Attends `x` `[t, hidden]` at positions `pos..pos + t`, appending its keys and values to `kv`.
    #[allow(clippy::too_many_arguments)]
    pub fn forward(
        &self,
        x: &Tensor,
        pos: usize,
        kv: &mut LayerKv,
        max_context: usize,
        tables: &StepTables,
        layer: usize,
        hooks: &mut impl Hooks,
    ) -> candle_core::Result<Tensor> {
        let (q, k, v) = self.project(x)?;
        let heads = self.attend(&q, &k, &v, pos, kv, max_context, tables, layer, hooks)?;
        self.output(&heads)
    }

    /// The query, key and value projections of `x` `[rows, hidden]` (rows of one sequence or of
    /// several stacked: the weights are read once for all of them).
    pub fn project(&self, x: &Tensor) -> candle_core::Result<(Tensor, Tensor, Tensor)> {
        let (nh, nkv, d) = (self.num_heads, self.num_kv_heads, self.head_dim);
        Ok(match &self.qkv {
            QkvProj::Separate { q, k, v } => (q.forward(x)?, k.forward(x)?, v.forward(x)?),
            QkvProj::Fused(qkv) => {
                let y = qkv.forward(x)?;
                (y.narrow(1, 0, nh * d)?, y.narrow(1, nh * d, nkv * d)?, y.narrow(1, (nh + nkv) * d, nkv * d)?)
            }
        })
    }

    /// The output projection of heads `[rows, heads, head_dim]`.
    pub fn output(&self, heads: &Tensor) -> candle_core::Result<Tensor> {
        let rows = heads.dim(0)?;
        self.o.forward(&heads.reshape((rows, self.num_heads * self.head_dim))?)
    }

    /// Attention of one sequence's projected rows `q` `[t, heads·d]`, `k`, `v` `[t, kv_heads·d]`
    /// at positions `pos..pos + t` over its own cache; returns each head's output `[t, heads, d]`.
    #[allow(clippy::too_many_arguments)]
    pub fn attend(
        &self,
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        pos: usize,
        kv: &mut LayerKv,
        max_context: usize,
        tables: &StepTables,
        layer: usize,
        hooks: &mut impl Hooks,
    ) -> candle_core::Result<Tensor> {
        let t = q.dim(0)?;
        let (nh, nkv, d) = (self.num_heads, self.num_kv_heads, self.head_dim);
        let (mut q, mut k) = (q.clone(), k.clone());
        if let Some(n) = self.qk_norm.as_ref().filter(|n| n.whole) {
            (q, k) = (n.q.forward(&q)?, n.k.forward(&k)?);
        }
        let mut q = q.reshape((t, nh, d))?;
        let mut k = k.reshape((t, nkv, d))?;
        if let Some(n) = self.qk_norm.as_ref().filter(|n| !n.whole) {
            (q, k) = (n.q.forward(&q)?, n.k.forward(&k)?);
        }
        // [1, heads, t, d]
        let q = q.transpose(0, 1)?.unsqueeze(0)?;
        let k = k.transpose(0, 1)?.unsqueeze(0)?;
        let v = v.reshape((t, nkv, d))?.transpose(0, 1)?.unsqueeze(0)?;
        let (q, k) = match &tables.rope {
            Some((cos, sin)) => {
                (rope::apply(&q, cos, sin, self.rope_interleaved)?, rope::apply(&k, cos, sin, self.rope_interleaved)?)
            }
            // The same contiguous layout the rotation would have produced, for the cache's append.
            None => (q.contiguous()?, k.contiguous()?),
        };
        // Keys and values are rounded to the cache's type before anything reads them, so a
        // prompt's rows see the same keys a later decode step reads back.
        let (k, v) = (self.cache_type.encode(&k)?, self.cache_type.encode(&v)?);
        let held = kv.append(&k, &v, pos, max_context)?;
        let q = q.to_dtype(self.product_dtype)?;
        let total = pos + t;
        let start = tables.key_start;
        let keys = total - start;
        // A ring holds at least every key the step's rows attend (`LayerKv::append`).
        let view = held.range(start, keys)?;
        let pattern_wanted = hooks.wants(Point::Layer(layer, LayerPoint::AttentionPattern));
        let p = kernels::attention::Params {
            heads: nh,
            kv_heads: nkv,
            head_dim: d,
            scale: self.scale as f32,
            softcap: self.softcap.map(|c| c as f32),
        };
        // Attention sinks (gpt-oss) take their share in the materialised softmax below only.
        // The tiled kernels mask causally: bidirectional steps and image blocks materialise their scores.
        if !pattern_wanted
            && self.sinks.is_none()
            && tables.blocks.is_empty()
            && !tables.bidirectional
            && kernels::attention::takes(&q, &view)
        {
            if tables.decoding && t == 1 {
                let heads = kernels::attention::decode(&q, &view, p)?; // [1, nh, d]
                return hooks.at(Point::Layer(layer, LayerPoint::AttentionHeads), heads);
            }
            if tables.decoding {
                // Several generated tokens in one step (a speculative draft being checked): each
                // row attends exactly as it would decoded alone (its own window, the decode
                // kernel's sums), so a confirmed draft token's logits are those of a plain run.
                let mut rows = Vec::with_capacity(t);
                for i in 0..t {
                    let end = pos + i + 1;
                    let first = tables.window.map_or(0, |w| end.saturating_sub(w)).max(start);
                    rows.push(kernels::attention::decode(&q.narrow(2, i, 1)?, &view.range(first, end - first)?, p)?);
                }
                let heads = Tensor::cat(&rows, 0)?; // [t, nh, d]
                return hooks.at(Point::Layer(layer, LayerPoint::AttentionHeads), heads);
            }
            if tiled_prompts() {
                // Every prompt row, however the prompt was cut into steps, goes through the same
                // tiled kernel (key blocks at absolute positions), so a reused prefix changes nothing.
                let span =
                    kernels::attention::PromptSpan { offset: pos - start, first_key: start, window: tables.window };
                let heads = kernels::attention::prompt(&q, &view, span, p)?; // [t, nh, d]
                return hooks.at(Point::Layer(layer, LayerPoint::AttentionHeads), heads);
            }
        }
        // Keys and values in position order, widened for the products where the cache is
        // narrower (a prompt's products are compute-bound, not memory-bound).
        let (k_all, v_all) = view.dense(self.product_dtype)?;
        // Grouped-query attention without copying keys: fold each group's query heads into rows.
        let group = nh / nkv;
        let q = q.contiguous()?.reshape((1, nkv, group * t, d))?;
        let scores = q.matmul(&k_all.t()?)?.to_dtype(DType::F32)?;
        let mut scores = (scores * self.scale)?.reshape((1, nh, t, keys))?;
        if let Some(cap) = self.softcap {
            scores = ((scores / cap)?.tanh()? * cap)?;
        }
        if let Some(mask) = tables.mask()? {
            scores = scores.broadcast_add(&mask)?;
        }
        let probs = match &self.sinks {
            None => candle_nn::ops::softmax_last_dim(&scores)?,
            Some(sinks) => {
                // The sink takes its share of each row's probability and is then dropped, so the
                // pattern's rows sum to less than 1.
                let sink = sinks.reshape((1, nh, 1, 1))?.broadcast_as((1, nh, t, 1))?;
                let with_sink = Tensor::cat(&[&scores, &sink.contiguous()?], 3)?;
                candle_nn::ops::softmax_last_dim(&with_sink)?.narrow(3, 0, keys)?.contiguous()?
            }
        };
        if pattern_wanted {
            // The pattern spans the whole cache: keys outside the window get probability 0.
            let pattern = probs.squeeze(0)?;
            let pattern = if start > 0 {
                Tensor::cat(&[Tensor::zeros((nh, t, start), DType::F32, pattern.device())?, pattern], 2)?
            } else {
                pattern
            };
            hooks.at(Point::Layer(layer, LayerPoint::AttentionPattern), pattern)?;
        }
        let probs = probs.to_dtype(v_all.dtype())?.reshape((1, nkv, group * t, keys))?;
        let out = probs.matmul(&v_all)?; // [1, nkv, group * t, d]
        let heads = out.reshape((nh, t, d))?.transpose(0, 1)?.to_dtype(DType::F32)?; // [t, nh, d]
        hooks.at(Point::Layer(layer, LayerPoint::AttentionHeads), heads)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_bidirectional_step_masks_only_past_the_window_on_either_side() {
        let dev = Device::Cpu;
        let mut windowed = StepTables::new(None, 0, 5, Some(2), &dev).unwrap();
        windowed.bidirectional = true;
        let m: Vec<Vec<f32>> = windowed.mask().unwrap().unwrap().to_vec2().unwrap();
        for (q, row) in m.iter().enumerate() {
            for (k, &cell) in row.iter().enumerate() {
                assert_eq!(cell == 0.0, q.abs_diff(k) < 2, "query {q}, key {k}");
            }
        }
        let mut full = StepTables::new(None, 0, 5, None, &dev).unwrap();
        full.bidirectional = true;
        assert!(full.mask().unwrap().is_none(), "nothing to mask without a window");
    }
}
