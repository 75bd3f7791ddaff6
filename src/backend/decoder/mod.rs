//! One generic decoder for every supported architecture, with its observation points.
//!
//! Architectures differ only in data (`ArchConfig`): which norms exist, how q/k are
//! normalised, which layers slide, how embeddings are scaled. The observation points of
//! DESIGN §2 are places in this one forward pass, so every architecture can be inspected.

mod adapters;

use candle_core::{DType, Device, Tensor};

use crate::backend::blocks::attention::{Attention, QkNorms, QkvProj, StepTables};
use crate::backend::blocks::hooks::Hooks;
use crate::backend::blocks::linear::Linear;
use crate::backend::blocks::lora::{Adapter, AdapterRegistry, Site};
use crate::backend::blocks::mlp::{GateUp, Mlp};
use crate::backend::blocks::moe::{FeedForward, Moe};
use crate::backend::blocks::norm::Norm;
use crate::backend::blocks::rope::Rope;
use crate::backend::blocks::rows::split_rows;
use crate::backend::blocks::sae::SaeRegistry;
use crate::backend::weights::embedding::Embedding;
use crate::backend::weights::names::{Naming, Slot};

use crate::backend::config::{ArchConfig, ExpertGlu, LayerConfig, NormKind, QkNorm};
use crate::backend::encoder::Encoder;
use crate::backend::error::{CandleContext, Result};
use crate::backend::kv_cache::{KvCache, KvType};
use crate::backend::vision::VisionModel;
use crate::backend::weights::quantize::QuantizeReport;
use crate::backend::weights::WeightLoader;
use crate::core::{LayerPoint, Point, SaePoint};

/// One decoder layer.
#[derive(Debug, Clone)]
struct Block {
    attn_in_norm: Option<Norm>,
    attn: Attention,
    attn_out_norm: Option<Norm>,
    mlp_in_norm: Option<Norm>,
    mlp: FeedForward,
    mlp_out_norm: Option<Norm>,
    /// Index into the decoder's distinct layer variants (rope + window).
    variant: usize,
}

/// What a forward step runs: a prompt (or part of one, or a trace), or generated tokens.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StepKind {
    /// Prompt tokens: attention through batched products, whatever the row count.
    Prompt,
    /// One generated token per sequence: attention reads the cache in place.
    Decode,
}

/// Which rows of logits a step computes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LogitsRows {
    /// Only the last position's (prefill's default: skips the vocabulary matmul for the rest).
    Last,
    /// Every position's.
    All,
    /// No logits: every position's hidden state after the final norm `[rows, hidden]`
    /// (embeddings pool these; the output projection is skipped).
    Hidden,
}

/// The generic decoder: embeddings, blocks, final norm, output projection.
///
/// Weights and the KV cache are in the model's dtype; the residual stream, norms and
/// attention scores run in float32 (as llama.cpp does), so half-precision models lose
/// precision only inside their matmuls.
#[derive(Debug, Clone)]
pub struct Decoder {
    config: ArchConfig,
    embed: Embedding,
    blocks: Vec<Block>,
    /// The learned absolute positions `[max_positions, hidden]` (GPT-2), added after the embedding.
    positions: Option<Tensor>,
    norm: Norm,
    lm_head: Linear,
    /// The distinct layer variants (rope + sliding window) and their rotary tables.
    variants: Vec<(LayerConfig, Option<Rope>)>,
    /// The embedding multiplier, rounded to the weights' dtype as transformers does.
    embed_scale: Option<f64>,
    dtype: DType,
    device: Device,
    /// Identifies the model (architecture, weight types and a sample of the weights), so a
    /// snapshot is never restored onto another one.
    fingerprint: String,
    /// What quantization at load did, when it was asked for.
    quantized_at_load: Option<QuantizeReport>,
    /// The sparse autoencoders attached to this model, shared with every clone and session.
    saes: std::sync::Arc<SaeRegistry>,
    /// The vision encoder and projector of a vision-language model (DESIGN §13).
    vision: Option<std::sync::Arc<VisionModel>>,
    /// An embedding model's dense layers after pooling, where its GGUF file carries them
    /// (EmbeddingGemma's `dense_2` / `dense_3`, float32 `[out, in]`); a directory's are in its
    /// sentence-transformers folders instead.
    embedding_dense: Vec<Tensor>,
    /// The LoRA adapters loaded on this model, shared with every clone and session (`adapters.rs`).
    adapters: std::sync::Arc<AdapterRegistry>,
    /// The LoRA adapters merged into its weights (their descriptions, no factors), in merge order.
    merged: Vec<std::sync::Arc<Adapter>>,
    /// Where the token embedding sits, for adapters that adapt it (`[vocab] → [hidden]`).
    embed_site: Site,
    /// A BERT-family encoder (`backend/encoder`): the model is that encoder, and this decoder only
    /// stands in for it (no layers; every step is refused by the session).
    encoder: Option<std::sync::Arc<Encoder>>,
}

impl Decoder {
    /// Builds the decoder from a checkpoint, checking every tensor's shape against `config`.
    pub fn load(config: ArchConfig, w: &WeightLoader<'_>, naming: Naming) -> Result<Self> {
        let c = &config;
        let arch = c.architecture;
        let (h, d, nh, nkv, inter) = (c.hidden_size, c.head_dim, c.num_heads, c.num_kv_heads, c.intermediate_size);
        let name = |slot: Slot, layer: usize, suffix: &str| format!("{}.{suffix}", naming.stem(arch, slot, layer));
        let norm = |slot: Slot, layer: usize, width: usize| -> Result<Norm> {
            let n = name(slot, layer, "weight");
            let t = w.dense_f32(&n, &[width])?;
            let bias = match c.norm_kind {
                NormKind::Layer => Some(w.dense_f32(&name(slot, layer, "bias"), &[width])?),
                NormKind::Rms => None,
            };
            Norm::new(c.norm_kind, t, bias, c.rms_norm_eps, c.norm_weight_offset)
                .ctx(|| format!("preparing norm `{n}`"))
        };
        // q/k norms are RMS norms whatever the block norms are.
        let qk_norm = |slot: Slot, layer: usize, width: usize| -> Result<Norm> {
            let n = name(slot, layer, "weight");
            Norm::rms(w.dense_f32(&n, &[width])?, c.rms_norm_eps, c.norm_weight_offset)
                .ctx(|| format!("preparing norm `{n}`"))
        };
        let linear = |slot: Slot, layer: usize, out: usize, inp: usize, bias: bool| -> Result<Linear> {
            let weight = w.matmul(&name(slot, layer, "weight"), out, inp)?;
            let bias = if bias { Some(w.dense_f32(&name(slot, layer, "bias"), &[out])?) } else { None };
            Ok(Linear::new(weight, bias).at_site(Site::one(slot, layer, out, inp)))
        };
        let embed_name = name(Slot::Embed, 0, "weight");
        let embed = w.embedding(&embed_name, c.vocab_size, h, c.tie_word_embeddings)?;

        let mut variants: Vec<(LayerConfig, Option<Rope>)> = Vec::new();
        let mut blocks = Vec::with_capacity(c.num_layers());
        for (i, lc) in c.layers.iter().enumerate() {
            let variant = match variants.iter().position(|(k, _)| k == lc) {
                Some(k) => k,
                None => {
                    variants.push((*lc, lc.rope.as_ref().map(|r| Rope::new(r, c.rotary_dim()))));
                    variants.len() - 1
                }
            };
            let fused_qkv = w.contains(&name(Slot::Qkv, i, "weight"));
            let qkv = if fused_qkv {
                QkvProj::Fused(linear(Slot::Qkv, i, (nh + 2 * nkv) * d, h, c.qkv_bias)?)
            } else {
                let (q, k, v) = (
                    linear(Slot::Q, i, nh * d, h, c.qkv_bias)?,
                    linear(Slot::K, i, nkv * d, h, c.qkv_bias)?,
                    linear(Slot::V, i, nkv * d, h, c.qkv_bias)?,
                );
                // One product where the three stack (same tiled format): a decode step then
                // quantizes its row and dispatches to the workers once, not three times.
                match Linear::stack(&[&q, &k, &v]).ctx(|| format!("stacking layer {i}'s q, k and v"))? {
                    Some(qkv) => QkvProj::Fused(qkv),
                    None => QkvProj::Separate { q, k, v },
                }
            };
            let qk_norm = match c.qk_norm {
                QkNorm::None => None,
                QkNorm::PerHead => {
                    Some(QkNorms { q: qk_norm(Slot::QNorm, i, d)?, k: qk_norm(Slot::KNorm, i, d)?, whole: false })
                }
                QkNorm::Whole => Some(QkNorms {
                    q: qk_norm(Slot::QNorm, i, nh * d)?,
                    k: qk_norm(Slot::KNorm, i, nkv * d)?,
                    whole: true,
                }),
            };
            let o = linear(Slot::O, i, h, nh * d, c.o_bias)?;
            let sinks = if c.attn_sinks {
                Some(w.dense_f32(&crate::backend::blocks::moe::sinks_name(naming, arch, i), &[nh])?)
            } else {
                None
            };
            let cache_type = default_cache_type(w.dtype(), w.device(), o.is_quantized());
            let attn = Attention {
                qkv,
                o,
                qk_norm,
                num_heads: nh,
                num_kv_heads: nkv,
                head_dim: d,
                scale: if c.attn_scale_by_layer { c.attn_scale / (i + 1) as f64 } else { c.attn_scale },
                softcap: c.attn_softcap,
                sinks,
                rope_interleaved: c.rope_interleaved,
                cache_type,
                product_dtype: w.dtype(),
            };
            // Phi-3 fuses gate and up; GGUF names the fused one like the plain up projection.
            let fused_gate_up = !w.contains(&name(Slot::Gate, i, "weight"));
            let gate_up = if c.is_sparse(i) {
                None
            } else if !c.mlp_gated {
                Some(GateUp::Ungated(linear(Slot::Up, i, inter, h, c.mlp_bias)?))
            } else if fused_gate_up {
                Some(GateUp::Fused(linear(Slot::GateUp, i, 2 * inter, h, c.mlp_bias)?))
            } else {
                let (gate, up) =
                    (linear(Slot::Gate, i, inter, h, c.mlp_bias)?, linear(Slot::Up, i, inter, h, c.mlp_bias)?);
                match Linear::stack(&[&gate, &up]).ctx(|| format!("stacking layer {i}'s gate and up"))? {
                    Some(gate_up) => Some(GateUp::Fused(gate_up)),
                    None => Some(GateUp::Separate { gate, up }),
                }
            };
            let mlp = match (gate_up, &c.moe) {
                (Some(gate_up), _) => FeedForward::Dense(Mlp {
                    gate_up,
                    down: linear(Slot::Down, i, h, inter, c.mlp_bias)?,
                    activation: c.activation,
                    glu: ExpertGlu::Gated,
                }),
                (None, Some(m)) => FeedForward::Moe(Moe::load(w, arch, naming, i, h, m, c.activation)?),
                (None, None) => unreachable!("is_sparse(i) implies a MoE configuration"),
            };
            let (pre, post) = (c.block_norms.pre(), c.block_norms.post());
            blocks.push(Block {
                attn_in_norm: if pre { Some(norm(Slot::AttnInNorm, i, h)?) } else { None },
                attn,
                attn_out_norm: if post { Some(norm(Slot::AttnOutNorm, i, h)?) } else { None },
                mlp_in_norm: if pre { Some(norm(Slot::MlpInNorm, i, h)?) } else { None },
                mlp,
                mlp_out_norm: if post { Some(norm(Slot::MlpOutNorm, i, h)?) } else { None },
                variant,
            });
        }
        let head_name = name(Slot::LmHead, 0, "weight");
        let lm_head = if c.tie_word_embeddings {
            Linear::tied(&embed).ctx(|| format!("tying the output projection to `{embed_name}`"))?
        } else {
            Linear::new(w.output(&head_name, c.vocab_size, h)?, None)
        }
        .at_site(Site::one(Slot::LmHead, 0, c.vocab_size, h));
        let positions = if c.learned_positions {
            Some(w.dense(&name(Slot::PosEmbed, 0, "weight"), &[c.max_position_embeddings, h])?)
        } else {
            None
        };
        let embed_site = Site::one(Slot::Embed, 0, h, c.vocab_size);
        let mut decoder = Self {
            positions,
            norm: norm(Slot::FinalNorm, 0, h)?,
            embed,
            blocks,
            lm_head,
            variants,
            embed_scale: c.embed_scale.map(|s| round_to(s, w.dtype())),
            dtype: w.dtype(),
            device: w.device().clone(),
            config,
            fingerprint: String::new(),
            quantized_at_load: w.quantize_report(),
            saes: Default::default(),
            vision: None,
            embedding_dense: Vec::new(),
            adapters: Default::default(),
            merged: Vec::new(),
            embed_site,
            encoder: None,
        };
        decoder.fingerprint = decoder.compute_fingerprint().ctx(|| "fingerprinting the model".into())?;
        Ok(decoder)
    }

    /// The stand-in for an encoder-only model: `config` (the encoder's `stand_in`), the encoder's
    /// word table and embedding norm, no layers. A session over it embeds and classifies with
    /// the encoder and refuses every decoder step (`CandleError::EncoderOnly`).
    pub fn around_encoder(config: ArchConfig, encoder: Encoder, dtype: DType) -> Result<Self> {
        let embed = encoder.word_embedding().clone();
        let lm_head = Linear::tied(&embed).ctx(|| "tying the stand-in output projection".into())?;
        let device = encoder.device().clone();
        let embed_site = Site::one(Slot::Embed, 0, config.hidden_size, config.vocab_size);
        let mut decoder = Self {
            positions: None,
            norm: encoder.embedding_norm().clone(),
            embed,
            blocks: Vec::new(),
            lm_head,
            variants: Vec::new(),
            embed_scale: None,
            dtype,
            device,
            config,
            fingerprint: String::new(),
            quantized_at_load: None,
            saes: Default::default(),
            vision: None,
            embedding_dense: Vec::new(),
            adapters: Default::default(),
            merged: Vec::new(),
            embed_site,
            encoder: Some(std::sync::Arc::new(encoder)),
        };
        decoder.fingerprint = decoder.compute_fingerprint().ctx(|| "fingerprinting the model".into())?;
        Ok(decoder)
    }

    /// The BERT-family encoder this model is, when it is one (its decoder only stands in).
    pub fn encoder(&self) -> Option<&std::sync::Arc<Encoder>> {
        self.encoder.as_ref()
    }

    /// CRC-32 of the configuration, the weight types and the first and last embedding rows.
    fn compute_fingerprint(&self) -> candle_core::Result<String> {
        let mut crc = crc32fast::Hasher::new();
        crc.update(format!("{:?}{:?}{:?}", self.config, self.weight_summary(), self.dtype).as_bytes());
        let last = (self.config.vocab_size - 1) as u32;
        let rows = self.embed.forward(&Tensor::new(&[0u32, last], &self.device)?)?;
        for v in rows.flatten_all()?.to_vec1::<f32>()? {
            crc.update(&v.to_le_bytes());
        }
        Ok(format!("{:08x}", crc.finalize()))
    }

    /// The model's fingerprint (see `compute_fingerprint`).
    pub fn fingerprint(&self) -> &str {
        &self.fingerprint
    }

    /// The architecture description.
    pub fn config(&self) -> &ArchConfig {
        &self.config
    }

    /// About how many bytes one step of `t` tokens at position `pos` allocates beyond what the
    /// session holds, at its peak: one layer's attention scores and probabilities over every key
    /// (with the mask), the activations, the logits rows asked for, and the cache's growth. A
    /// step that cannot fit is refused with this before anything is allocated.
    pub fn step_bytes(&self, pos: usize, t: usize, rows: LogitsRows) -> u64 {
        let c = &self.config;
        let (t, keys, f) = (t as u64, (pos + t) as u64, 4u64);
        let mul = |xs: &[u64]| xs.iter().fold(1u64, |a, &x| a.saturating_mul(x));
        // Scores, probabilities and one copy on the way (soft-capping, a dtype change).
        let attention = mul(&[3, c.num_heads as u64, t, keys, f]).saturating_add(mul(&[t, keys, f]));
        let width = 4 * c.hidden_size + 3 * c.intermediate_size + 3 * (c.num_heads + 2 * c.num_kv_heads) * c.head_dim;
        let activations = mul(&[t, width as u64, f]);
        let logits = match rows {
            LogitsRows::All => mul(&[t, c.vocab_size as u64, f]),
            LogitsRows::Last => mul(&[c.vocab_size as u64, f]),
            LogitsRows::Hidden => mul(&[t, c.hidden_size as u64, f]),
        };
        // Keys and values of every layer in the cache's storage, at most twice over while the
        // cache grows by copying: every position, or a ring's window and the step.
        let (dtype, row) = self.cache_type().storage(c.head_dim);
        let per_position = mul(&[2, c.num_kv_heads as u64, row as u64, dtype.size_in_bytes() as u64]);
        let held: u64 = c
            .layers
            .iter()
            .map(|l| match l.sliding_window {
                Some(w) => keys.min(w as u64 + t.max(crate::backend::kv_cache::RING_SLACK as u64)),
                None => keys,
            })
            .fold(0u64, u64::saturating_add);
        let cache = mul(&[2, per_position, held]);
        attention.saturating_add(activations).saturating_add(logits).saturating_add(cache)
    }

    /// Parameters by storage type (`q4_k`, `q8_0`, `f32`, ...), counting a tied table once.
    pub fn weight_summary(&self) -> std::collections::BTreeMap<String, usize> {
        let mut parts = vec![self.embed.summary(), self.norm.summary()];
        if let Some(e) = &self.encoder {
            // The stand-in's table and norm are the encoder's own.
            parts = e.weight_summary();
        }
        for b in &self.blocks {
            for n in [&b.attn_in_norm, &b.attn_out_norm, &b.mlp_in_norm, &b.mlp_out_norm] {
                parts.extend(n.as_ref().map(Norm::summary));
            }
            if let Some(n) = &b.attn.qk_norm {
                parts.extend([n.q.summary(), n.k.summary()]);
            }
            let attn: Vec<&Linear> = match &b.attn.qkv {
                QkvProj::Separate { q, k, v } => vec![q, k, v],
                QkvProj::Fused(qkv) => vec![qkv],
            };
            for l in attn.into_iter().chain([&b.attn.o]).chain(b.mlp.linears()) {
                parts.extend(l.summary());
            }
            if let Some(s) = &b.attn.sinks {
                parts.push(("f32".into(), s.elem_count()));
            }
        }
        if !self.config.tie_word_embeddings {
            parts.extend(self.lm_head.summary());
        }
        if let Some(p) = &self.positions {
            parts.push((crate::backend::weights::embedding::dtype_name(p.dtype()), p.elem_count()));
        }
        let mut by_type = std::collections::BTreeMap::new();
        for (ty, n) in parts {
            *by_type.entry(ty).or_insert(0) += n;
        }
        by_type
    }

    /// What quantization at load did (`None` when none was asked for).
    pub fn quantized_at_load(&self) -> Option<&QuantizeReport> {
        self.quantized_at_load.as_ref()
    }

    /// The dtype activations run in.
    pub fn dtype(&self) -> DType {
        self.dtype
    }

    /// How the KV cache holds keys and values.
    pub fn cache_type(&self) -> KvType {
        self.blocks.first().map_or(KvType::Dense(self.dtype), |b| b.attn.cache_type)
    }

    /// Caches keys and values as `ty` instead of the default (float16 for a quantized model on
    /// the CPU, the activations' dtype otherwise). q8_0 runs on the CPU only, and its blocks of
    /// 32 must tile a head.
    pub fn set_cache_type(&mut self, ty: KvType) -> Result<()> {
        if ty == KvType::Q8_0 {
            if !self.device.is_cpu() {
                return Err(crate::backend::error::CandleError::UnsupportedConfig {
                    what: "kv_cache_type=q8_0 runs on the CPU only; use f16 on this device".into(),
                });
            }
            let d = self.config.head_dim;
            if d % crate::backend::kv_cache::Q8_BLOCK != 0 {
                return Err(crate::backend::error::CandleError::UnsupportedConfig {
                    what: format!(
                        "kv_cache_type=q8_0 needs a head width that is a multiple of 32; this model's is {d}"
                    ),
                });
            }
        }
        for b in &mut self.blocks {
            b.attn.cache_type = ty;
        }
        Ok(())
    }

    /// Each layer's sliding window (`None` where the layer attends every position).
    pub fn layer_windows(&self) -> Vec<Option<usize>> {
        self.config.layers.iter().map(|l| l.sliding_window).collect()
    }

    /// An empty KV cache for this decoder's layers, of `max_context` positions.
    pub fn new_cache(&self, max_context: usize) -> KvCache {
        KvCache::new(&self.layer_windows(), max_context)
    }

    /// The device the weights live on.
    pub fn device(&self) -> &Device {
        &self.device
    }

    /// Every named point this decoder offers, in forward order.
    pub fn points(&self) -> Vec<Point> {
        let sparse: Vec<bool> = (0..self.blocks.len()).map(|i| self.config.is_sparse(i)).collect();
        Point::for_layers(&sparse)
    }

    /// Every observation path this decoder offers, in forward order, then the attached SAEs' points.
    pub fn observation_points(&self) -> Vec<String> {
        if self.encoder.is_some() {
            return Vec::new();
        }
        // A vision-language model's encoder runs first.
        let mut names: Vec<String> = self.vision.iter().flat_map(|v| v.points()).collect();
        names.extend(self.points().iter().map(Point::to_string));
        for sae in self.saes.current().iter() {
            names.extend(SaePoint::ALL.iter().map(|p| p.path(&sae.name)));
        }
        names
    }

    /// The vision encoder of a vision-language model (`None` for a text-only one).
    pub fn vision(&self) -> Option<&std::sync::Arc<VisionModel>> {
        self.vision.as_ref()
    }

    /// Gives the model its vision encoder (loaded beside the decoder), and folds its
    /// configuration into the fingerprint.
    pub fn set_vision(&mut self, vision: VisionModel) {
        self.fingerprint =
            format!("{}-v{:08x}", self.fingerprint, crc32fast::hash(format!("{:?}", vision.config()).as_bytes()));
        self.vision = Some(std::sync::Arc::new(vision));
    }

    /// The dense layers an embedding model's GGUF file carries after pooling (none for others).
    pub fn embedding_dense(&self) -> &[Tensor] {
        &self.embedding_dense
    }

    /// Gives the model the dense layers its file carries after pooling.
    pub fn set_embedding_dense(&mut self, dense: Vec<Tensor>) {
        self.embedding_dense = dense;
    }

    /// The sparse autoencoders attached to this model (shared by all its sessions).
    pub fn saes(&self) -> &SaeRegistry {
        &self.saes
    }

    /// The per-position shape of a point this decoder has (`None` for any other point).
    pub fn point_shape(&self, point: Point) -> Option<Vec<usize>> {
        let c = &self.config;
        match point {
            Point::Embed | Point::Norm => Some(vec![c.hidden_size]),
            Point::Logits => Some(vec![c.vocab_size]),
            Point::Layer(i, _) if i >= self.blocks.len() => None,
            Point::Layer(_, LayerPoint::AttentionPattern) => None,
            Point::Layer(_, LayerPoint::AttentionHeads) => Some(vec![c.num_heads, c.head_dim]),
            Point::Layer(i, p) if !p.in_layer(c.is_sparse(i)) => None,
            Point::Layer(_, LayerPoint::MlpHidden) => Some(vec![c.intermediate_size]),
            Point::Layer(_, LayerPoint::RouterLogits | LayerPoint::ExpertWeights) => {
                c.moe.as_ref().map(|m| vec![m.num_experts])
            }
            Point::Layer(_, _) => Some(vec![c.hidden_size]),
        }
    }

    /// Runs `ids` at the cache's current position, appends them to the cache and returns
    /// logits `[rows, vocab]`; `hooks` sees (and may edit) every named point. `kind` says
    /// whether they are a prompt's or a generated token.
    pub fn forward(
        &self,
        ids: &[u32],
        cache: &mut KvCache,
        rows: LogitsRows,
        kind: StepKind,
        hooks: &mut impl Hooks,
    ) -> candle_core::Result<Tensor> {
        let mut one = [BatchItem { ids, cache, hooks }];
        Ok(self.forward_batch(&mut one, rows, kind)?.remove(0))
    }

    /// One step of several sequences at once: their rows go through every matrix product
    /// together (the weights are read once for all), attention runs per sequence over its own
    /// cache, and each sequence's hooks see only its own rows. Returns each sequence's logits.
    pub fn forward_batch<H: Hooks>(
        &self,
        items: &mut [BatchItem<'_, H>],
        rows: LogitsRows,
        kind: StepKind,
    ) -> candle_core::Result<Vec<Tensor>> {
        Ok(self.forward_batch_until(items, rows, kind, None)?.unwrap_or_default())
    }

    /// `forward_batch`, or with `last_layer` the pass stopped after that layer's output point:
    /// no later layer, final norm or logits is computed (activation collection), `None` is
    /// returned, and the caches hold keys of layers up to `last_layer` only, so the caller must
    /// discard them (or truncate them to where they were) before any ordinary step.
    pub fn forward_batch_until<H: Hooks>(
        &self,
        items: &mut [BatchItem<'_, H>],
        rows: LogitsRows,
        kind: StepKind,
        last_layer: Option<usize>,
    ) -> candle_core::Result<Option<Vec<Tensor>>> {
        if self.encoder.is_some() {
            // The session refuses first with a typed error; this is the last guard.
            candle_core::bail!("this model is an encoder: it has no decoder to run");
        }
        let lens: Vec<usize> = items.iter().map(|it| it.ids.len()).collect();
        let positions: Vec<usize> = items.iter().map(|it| it.cache.len()).collect();
        let ids: Vec<u32> = items.iter().flat_map(|it| it.ids.iter().copied()).collect();
        let ids = Tensor::new(ids.as_slice(), &self.device)?;
        let mut x = self.embed.forward(&ids)?;
        // An adapter's embedding term joins the table's row before the scale, as PEFT adds it to
        // the (scaled) embedding module's output scaled alike.
        x = crate::backend::blocks::lora::apply_embedding(&self.embed_site, &ids, x)?;
        if let Some(s) = self.embed_scale {
            x = (x * s)?;
        }
        x = at_each(items, &lens, Point::Embed, x)?;
        if let Some(m) = self.config.embed_multiplier {
            x = (x * m)?;
        }
        if let Some(table) = &self.positions {
            x = (x + self.position_rows(table, &lens, &positions)?)?;
        }
        let tables = items
            .iter()
            .zip(&positions)
            .map(|(it, &pos)| {
                let t = it.ids.len();
                self.variants
                    .iter()
                    .map(|(lc, rope)| {
                        let rope = rope.as_ref().map(|r| r.tables(pos, t, &self.device)).transpose()?;
                        let mut tables = StepTables::new(rope, pos, t, lc.sliding_window, &self.device)?;
                        tables.decoding = kind == StepKind::Decode;
                        tables.blocks = it.hooks.bidirectional_blocks();
                        tables.bidirectional = self.config.bidirectional;
                        Ok(tables)
                    })
                    .collect::<candle_core::Result<Vec<_>>>()
            })
            .collect::<candle_core::Result<Vec<_>>>()?;
        for (i, b) in self.blocks.iter().enumerate() {
            x = at_each(items, &lens, Point::Layer(i, LayerPoint::Input), x)?;
            let (q, k, v) = b.attn.project(&norm_or_same(&b.attn_in_norm, &x)?)?;
            let mut heads = Vec::with_capacity(items.len());
            let mut offset = 0;
            for (s, it) in items.iter_mut().enumerate() {
                let (t, pos, max_context) = (lens[s], positions[s], it.cache.max_context());
                let rows_of = |y: &Tensor| if lens.len() == 1 { Ok(y.clone()) } else { y.narrow(0, offset, t) };
                let (qs, ks, vs) = (rows_of(&q)?, rows_of(&k)?, rows_of(&v)?);
                let tables = &tables[s][b.variant];
                heads.push(b.attn.attend(
                    &qs,
                    &ks,
                    &vs,
                    pos,
                    it.cache.layer(i),
                    max_context,
                    tables,
                    i,
                    &mut it.hooks,
                )?);
                offset += t;
            }
            let heads = if heads.len() == 1 { heads.remove(0) } else { Tensor::cat(&heads, 0)? };
            let a = b.attn.output(&heads)?;
            let a = match &b.attn_out_norm {
                Some(n) => n.forward(&a)?,
                None => a,
            };
            let a = at_each(items, &lens, Point::Layer(i, LayerPoint::AttentionOutput), a)?;
            let a = self.to_residual(a)?;
            // A parallel residual's MLP reads the layer's input; a sequential one reads it after attention's add.
            if !self.config.parallel_residual {
                x = (x + &a)?;
            }
            let m = b
                .mlp
                .forward(&norm_or_same(&b.mlp_in_norm, &x)?, |p, h| at_each(items, &lens, Point::Layer(i, p), h))?;
            let m = match &b.mlp_out_norm {
                Some(n) => n.forward(&m)?,
                None => m,
            };
            let m = at_each(items, &lens, Point::Layer(i, LayerPoint::MlpOutput), m)?;
            let m = self.to_residual(m)?;
            x = if self.config.parallel_residual { ((x + a)? + m)? } else { (x + m)? };
            x = at_each(items, &lens, Point::Layer(i, LayerPoint::Output), x)?;
            if last_layer == Some(i) {
                break;
            }
        }
        for (it, &t) in items.iter_mut().zip(&lens) {
            it.cache.advance(t);
        }
        if last_layer.is_some() {
            return Ok(None);
        }
        // The final norm covers every row only when it is observed or edited; the vocabulary
        // matmul (the most expensive one) every row only when all logits are returned or observed.
        let wants = |p: Point| items.iter().any(|it| it.hooks.wants(p));
        let all_logits = matches!(rows, LogitsRows::All | LogitsRows::Hidden) || wants(Point::Logits);
        let keep_last = |y: Tensor, lens: &[usize]| -> candle_core::Result<(Tensor, Vec<usize>)> {
            let mut last = Vec::with_capacity(lens.len());
            let mut end = 0;
            for &t in lens {
                end += t;
                last.push(y.narrow(0, end - 1, 1)?);
            }
            let y = if last.len() == 1 { last.remove(0) } else { Tensor::cat(&last, 0)? };
            Ok((y, vec![1; lens.len()]))
        };
        let (mut x, mut lens) = (x, lens);
        if !all_logits && !wants(Point::Norm) && lens.iter().any(|&t| t > 1) {
            (x, lens) = keep_last(x, &lens)?;
        }
        let mut h = at_each(items, &lens, Point::Norm, self.norm.forward(&x)?)?;
        if rows == LogitsRows::Hidden {
            return split_rows(&h, &lens).map(Some);
        }
        if !all_logits && lens.iter().any(|&t| t > 1) {
            (h, lens) = keep_last(h, &lens)?;
        }
        let logits = at_each(items, &lens, Point::Logits, self.project(&h)?)?;
        let logits =
            if rows == LogitsRows::Last && lens.iter().any(|&t| t > 1) { keep_last(logits, &lens)?.0 } else { logits };
        let per_item = if rows == LogitsRows::Last { vec![1; lens.len()] } else { lens };
        split_rows(&logits, &per_item).map(Some)
    }

    /// A branch's output as it joins the residual (scaled by Granite's `residual_multiplier`).
    fn to_residual(&self, branch: Tensor) -> candle_core::Result<Tensor> {
        match self.config.residual_multiplier {
            Some(m) => branch * m,
            None => Ok(branch),
        }
    }

    /// The learned position rows of each sequence's tokens, stacked like the batch's rows.
    fn position_rows(&self, table: &Tensor, lens: &[usize], starts: &[usize]) -> candle_core::Result<Tensor> {
        let rows = table.dim(0)?;
        let mut ids = Vec::with_capacity(lens.iter().sum());
        for (&t, &start) in lens.iter().zip(starts) {
            if start + t > rows {
                candle_core::bail!(
                    "position {} is past the {rows} learned positions of this model (`max_position_embeddings`)",
                    start + t - 1
                );
            }
            ids.extend((start..start + t).map(|p| p as u32));
        }
        table.index_select(&Tensor::new(ids.as_slice(), &self.device)?, 0)?.to_dtype(DType::F32)
    }

    /// The output projection of normed states, with any logit scaling and final soft-capping.
    fn project(&self, h: &Tensor) -> candle_core::Result<Tensor> {
        let mut logits = self.lm_head.forward(h)?;
        if let Some(d) = self.config.logits_divisor {
            logits = (logits / d)?;
        }
        match self.config.final_softcap {
            Some(cap) => (logits / cap)?.tanh()? * cap,
            None => Ok(logits),
        }
    }

    /// The logit lens: the final norm, the output projection (the model's own weights,
    /// quantized where they are) and any soft-capping, applied to float32 `[T, H]`.
    pub fn unembed(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        self.project(&self.norm.forward(&x.to_dtype(DType::F32)?)?)
    }
}

/// `x` normalised by `norm`, or `x` itself where the block has no such norm (OLMo 2's inputs).
fn norm_or_same(norm: &Option<Norm>, x: &Tensor) -> candle_core::Result<Tensor> {
    match norm {
        Some(n) => n.forward(x),
        None => Ok(x.clone()),
    }
}

/// How a layer caches keys and values unless told: float16 for a quantized model computing in
/// float32 on the CPU, as llama.cpp does (half the bytes a decode step reads and the cache holds;
/// quantized weights already round far more than float16's 11 bits), otherwise the activations'
/// own dtype (a dense checkpoint keeps its reference precision).
fn default_cache_type(activations: DType, device: &Device, quantized: bool) -> KvType {
    if quantized && activations == DType::F32 && device.is_cpu() {
        KvType::Dense(DType::F16)
    } else {
        KvType::Dense(activations)
    }
}

/// `x` as the nearest value of `dtype` (transformers casts the Gemma embedding scale to it).
fn round_to(x: f64, dtype: DType) -> f64 {
    match dtype {
        DType::F16 => half::f16::from_f64(x).to_f64(),
        DType::BF16 => half::bf16::from_f64(x).to_f64(),
        _ => x as f32 as f64,
    }
}

/// One sequence of a batched step: its new tokens, its own cache and its own hooks.
pub struct BatchItem<'a, H: Hooks> {
    /// Token ids appended at the cache's position.
    pub ids: &'a [u32],
    /// The sequence's KV cache.
    pub cache: &'a mut KvCache,
    /// What observes and edits this sequence's rows.
    pub hooks: H,
}

/// Offers each sequence's rows of `x` at `point` to that sequence's hooks, and stacks the results.
fn at_each<H: Hooks>(
    items: &mut [BatchItem<'_, H>],
    lens: &[usize],
    point: Point,
    x: Tensor,
) -> candle_core::Result<Tensor> {
    if items.iter().all(|it| it.hooks.is_noop()) {
        return Ok(x);
    }
    if items.len() == 1 {
        return items[0].hooks.at(point, x);
    }
    let parts = split_rows(&x, lens)?
        .into_iter()
        .zip(items.iter_mut())
        .map(|(part, it)| it.hooks.at(point, part))
        .collect::<candle_core::Result<Vec<_>>>()?;
    Tensor::cat(&parts, 0)
}
