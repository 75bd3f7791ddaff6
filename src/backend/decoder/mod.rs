//! One generic decoder for every supported architecture, with its observation points.
//!
//! Architectures differ only in data (`ArchConfig`): which norms exist, how q/k are
//! normalised, which layers slide, how embeddings are scaled. The observation points of
//! DESIGN §2 are places in this one forward pass, so every architecture can be inspected.

pub mod activation;
pub mod attention;
pub mod layers;
pub mod names;
pub mod observer;
pub mod rope;

use candle_core::{DType, Device, Tensor};

use attention::{Attention, QkvProj, StepTables};
use layers::{Embedding, GateUp, Linear, Mlp, RmsNorm};
use names::{Naming, Slot};
use observer::Observer;
use rope::Rope;

use crate::backend::config::{ArchConfig, LayerConfig};
use crate::backend::error::{CandleContext, Result};
use crate::backend::session::kv_cache::KvCache;
use crate::backend::weights::WeightLoader;

/// One decoder layer.
#[derive(Debug, Clone)]
struct Block {
    attn_in_norm: RmsNorm,
    attn: Attention,
    attn_out_norm: Option<RmsNorm>,
    mlp_in_norm: RmsNorm,
    mlp: Mlp,
    mlp_out_norm: Option<RmsNorm>,
    /// Index into the decoder's distinct layer kinds (rope + window).
    kind: usize,
}

/// Which rows of logits a step computes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LogitsRows {
    /// Only the last position's (prefill's default: skips the vocabulary matmul for the rest).
    Last,
    /// Every position's.
    All,
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
    norm: RmsNorm,
    lm_head: Linear,
    kinds: Vec<(LayerConfig, Rope)>,
    /// The embedding multiplier, rounded to the weights' dtype as transformers does.
    embed_scale: Option<f64>,
    dtype: DType,
    device: Device,
}

impl Decoder {
    /// Builds the decoder from a checkpoint, checking every tensor's shape against `config`.
    pub fn load(config: ArchConfig, w: &WeightLoader<'_>, naming: Naming) -> Result<Self> {
        let c = &config;
        let arch = c.architecture;
        let (h, d, nh, nkv, inter) = (c.hidden_size, c.head_dim, c.num_heads, c.num_kv_heads, c.intermediate_size);
        let name = |slot: Slot, layer: usize, suffix: &str| format!("{}.{suffix}", naming.stem(arch, slot, layer));
        let norm = |slot: Slot, layer: usize, width: usize| -> Result<RmsNorm> {
            let n = name(slot, layer, "weight");
            let t = w.dense_f32(&n, &[width])?;
            RmsNorm::new(t, c.rms_norm_eps, c.norm_weight_offset).ctx(|| format!("preparing norm `{n}`"))
        };
        let linear = |slot: Slot, layer: usize, out: usize, inp: usize, bias: bool| -> Result<Linear> {
            let weight = w.matmul(&name(slot, layer, "weight"), out, inp)?;
            let bias = if bias { Some(w.dense_f32(&name(slot, layer, "bias"), &[out])?) } else { None };
            Ok(Linear::new(weight, bias))
        };
        let embed_name = name(Slot::Embed, 0, "weight");
        let embed = w.embedding(&embed_name, c.vocab_size, h)?;

        let mut kinds: Vec<(LayerConfig, Rope)> = Vec::new();
        let mut blocks = Vec::with_capacity(c.num_layers());
        for (i, lc) in c.layers.iter().enumerate() {
            let kind = match kinds.iter().position(|(k, _)| k == lc) {
                Some(k) => k,
                None => {
                    kinds.push((*lc, Rope::new(&lc.rope, c.rotary_dim())));
                    kinds.len() - 1
                }
            };
            let fused_qkv = w.contains(&name(Slot::Qkv, i, "weight"));
            let qkv = if fused_qkv {
                QkvProj::Fused(linear(Slot::Qkv, i, (nh + 2 * nkv) * d, h, c.qkv_bias)?)
            } else {
                QkvProj::Separate {
                    q: linear(Slot::Q, i, nh * d, h, c.qkv_bias)?,
                    k: linear(Slot::K, i, nkv * d, h, c.qkv_bias)?,
                    v: linear(Slot::V, i, nkv * d, h, c.qkv_bias)?,
                }
            };
            let qk_norm = if c.qk_norm { Some((norm(Slot::QNorm, i, d)?, norm(Slot::KNorm, i, d)?)) } else { None };
            let attn = Attention {
                qkv,
                o: linear(Slot::O, i, h, nh * d, c.o_bias)?,
                qk_norm,
                num_heads: nh,
                num_kv_heads: nkv,
                head_dim: d,
                scale: c.attn_scale,
                softcap: c.attn_softcap,
                rope_interleaved: c.rope_interleaved,
                cache_dtype: w.dtype(),
            };
            // Phi-3 fuses gate and up; GGUF names the fused one like the plain up projection.
            let fused_gate_up = !w.contains(&name(Slot::Gate, i, "weight"));
            let gate_up = if fused_gate_up {
                GateUp::Fused(linear(Slot::GateUp, i, 2 * inter, h, c.mlp_bias)?)
            } else {
                GateUp::Separate {
                    gate: linear(Slot::Gate, i, inter, h, c.mlp_bias)?,
                    up: linear(Slot::Up, i, inter, h, c.mlp_bias)?,
                }
            };
            let mlp = Mlp { gate_up, down: linear(Slot::Down, i, h, inter, c.mlp_bias)?, activation: c.activation };
            blocks.push(Block {
                attn_in_norm: norm(Slot::AttnInNorm, i, h)?,
                attn,
                attn_out_norm: if c.sandwich_norms { Some(norm(Slot::AttnOutNorm, i, h)?) } else { None },
                mlp_in_norm: norm(Slot::MlpInNorm, i, h)?,
                mlp,
                mlp_out_norm: if c.sandwich_norms { Some(norm(Slot::MlpOutNorm, i, h)?) } else { None },
                kind,
            });
        }
        let head_name = name(Slot::LmHead, 0, "weight");
        let lm_head = if c.tie_word_embeddings {
            embed.as_linear().ctx(|| format!("tying the output projection to `{embed_name}`"))?
        } else {
            Linear::new(w.matmul(&head_name, c.vocab_size, h)?, None)
        };
        Ok(Self {
            norm: norm(Slot::FinalNorm, 0, h)?,
            embed,
            blocks,
            lm_head,
            kinds,
            embed_scale: c.embed_scale.map(|s| round_to(s, w.dtype())),
            dtype: w.dtype(),
            device: w.device().clone(),
            config,
        })
    }

    /// The architecture description.
    pub fn config(&self) -> &ArchConfig {
        &self.config
    }

    /// The dtype activations run in.
    pub fn dtype(&self) -> DType {
        self.dtype
    }

    /// The device the weights live on.
    pub fn device(&self) -> &Device {
        &self.device
    }

    /// Every observation path this decoder offers, in forward order.
    pub fn observation_points(&self) -> Vec<String> {
        let mut v = vec!["model.embed_tokens".to_owned()];
        for i in 0..self.blocks.len() {
            for p in ["input", "attention.pattern", "attention.output", "mlp.output", "output"] {
                v.push(format!("model.layers.{i}.{p}"));
            }
        }
        v.push("model.norm".into());
        v.push("model.logits".into());
        v
    }

    /// Runs `ids` at the cache's current position, appends them to the cache and returns
    /// logits `[rows, vocab]`; records selected activations when `rec` is given.
    pub fn forward(
        &self,
        ids: &[u32],
        cache: &mut KvCache,
        rows: LogitsRows,
        obs: &mut impl Observer,
    ) -> candle_core::Result<Tensor> {
        let t = ids.len();
        let pos = cache.len();
        let max_context = cache.max_context();
        let ids_t = Tensor::new(ids, &self.device)?;
        let mut x = self.embed.forward(&ids_t)?;
        if let Some(s) = self.embed_scale {
            x = (x * s)?;
        }
        obs.observe(|| "model.embed_tokens".into(), &x);
        let tables = self
            .kinds
            .iter()
            .map(|(lc, rope)| {
                let (cos, sin) = rope.tables(pos, t, &self.device)?;
                StepTables::new(cos, sin, pos, t, lc.sliding_window, &self.device)
            })
            .collect::<candle_core::Result<Vec<_>>>()?;
        for (i, b) in self.blocks.iter().enumerate() {
            obs.observe(|| format!("model.layers.{i}.input"), &x);
            let a = b.attn.forward(
                &b.attn_in_norm.forward(&x)?,
                pos,
                cache.layer(i),
                max_context,
                &tables[b.kind],
                i,
                obs,
            )?;
            let a = match &b.attn_out_norm {
                Some(n) => n.forward(&a)?,
                None => a,
            };
            obs.observe(|| format!("model.layers.{i}.attention.output"), &a);
            x = (x + a)?;
            let m = b.mlp.forward(&b.mlp_in_norm.forward(&x)?)?;
            let m = match &b.mlp_out_norm {
                Some(n) => n.forward(&m)?,
                None => m,
            };
            obs.observe(|| format!("model.layers.{i}.mlp.output"), &m);
            x = (x + m)?;
            obs.observe(|| format!("model.layers.{i}.output"), &x);
        }
        cache.advance(t);
        // The final norm covers every row only when it is observed; the vocabulary matmul
        // (the most expensive one) every row only when all logits are returned or observed.
        let all_logits = rows == LogitsRows::All || obs.wants("model.logits");
        if !all_logits && !obs.wants("model.norm") {
            x = x.narrow(0, t - 1, 1)?;
        }
        let mut h = self.norm.forward(&x)?;
        obs.observe(|| "model.norm".into(), &h);
        if !all_logits && h.dim(0)? > 1 {
            h = h.narrow(0, t - 1, 1)?;
        }
        let mut logits = self.lm_head.forward(&h)?;
        if let Some(cap) = self.config.final_softcap {
            logits = ((logits / cap)?.tanh()? * cap)?;
        }
        obs.observe(|| "model.logits".into(), &logits);
        if rows == LogitsRows::Last && logits.dim(0)? > 1 {
            logits = logits.narrow(0, t - 1, 1)?;
        }
        Ok(logits)
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
