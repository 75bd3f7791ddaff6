//! One BERT-family encoder for every supported family, parameterised by `EncoderConfig` as the
//! decoder is by `ArchConfig` (DESIGN §17): word (+ position + token-type) embeddings and their
//! LayerNorm, then layers with every token attending every other (or those within a sliding
//! layer's window), and a cross-encoder's classification head. BERT and RoBERTa / XLM-RoBERTa
//! (post-norm, a position table, biased q/k/v/o, an ungated MLP), ModernBERT (pre-norm, rotary,
//! fused `Wqkv`, GeGLU from a fused `Wi`, no biases, alternating global and sliding layers, a
//! final norm) and nomic-bert (post-norm, rotary, fused `Wqkv`, SwiGLU) differ only in data.
//!
//! Inputs are never padded: each input's rows go through every matrix product together with the
//! other inputs' (one product per weight per batch), and attention runs per input over its own
//! rows, so no padding mask is needed and an input's result does not depend on its batch.

use std::collections::HashMap;

use candle_core::{DType, Device, Tensor, D};

use crate::backend::blocks::activation;
use crate::backend::blocks::linear::Linear;
use crate::backend::blocks::norm::Norm;
use crate::backend::blocks::rope::{self, Rope};
use crate::backend::blocks::rows::split_rows;
use crate::backend::config::encoder::{
    EncoderConfig, EncoderFamily, EncoderNorms, EncoderPooling, EncoderPositions, HeadTransform,
};
use crate::backend::config::{NormKind, RopeConfig, RopeScaling};
use crate::backend::error::{CandleContext, CandleError, Result};
use crate::backend::weights::embedding::Embedding;
use crate::backend::weights::names::Naming;
use crate::backend::weights::WeightLoader;

/// Where a checkpoint's encoder tensors live: a bare model (`BertModel.save_pretrained`, what
/// sentence-transformers ships) or under a task model's base prefix.
const PREFIXES: [&str; 4] = ["", "bert.", "roberta.", "model."];

/// A tensor of the encoder, named once here and spelt per checkpoint format by `hf_stem` and
/// `gguf_stem`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Part {
    Word,
    Positions,
    Types,
    EmbedNorm,
    FinalNorm,
    Q,
    K,
    V,
    /// q, k and v stacked in one map (ModernBERT's and nomic-bert's `Wqkv`).
    Qkv,
    O,
    AttnNorm,
    MlpNorm,
    Up,
    Gate,
    /// ModernBERT's `Wi`: the gate's rows, then the up map's.
    GateUp,
    Down,
}

/// The Hugging Face stem (without the base model's prefix) of `part` of layer `i` in `family`'s
/// checkpoints.
fn hf_stem(family: EncoderFamily, part: Part, i: usize) -> String {
    use Part::*;
    let fixed = |s: &str| s.to_owned();
    match family {
        EncoderFamily::Bert | EncoderFamily::Roberta | EncoderFamily::XlmRoberta => {
            let l = |s: &str| format!("encoder.layer.{i}.{s}");
            match part {
                Word => fixed("embeddings.word_embeddings"),
                Positions => fixed("embeddings.position_embeddings"),
                Types => fixed("embeddings.token_type_embeddings"),
                EmbedNorm => fixed("embeddings.LayerNorm"),
                Q => l("attention.self.query"),
                K => l("attention.self.key"),
                V => l("attention.self.value"),
                O => l("attention.output.dense"),
                AttnNorm => l("attention.output.LayerNorm"),
                Up => l("intermediate.dense"),
                Down => l("output.dense"),
                MlpNorm => l("output.LayerNorm"),
                FinalNorm | Qkv | Gate | GateUp => fixed("(none)"),
            }
        }
        EncoderFamily::ModernBert => {
            let l = |s: &str| format!("layers.{i}.{s}");
            match part {
                Word => fixed("embeddings.tok_embeddings"),
                EmbedNorm => fixed("embeddings.norm"),
                FinalNorm => fixed("final_norm"),
                Qkv => l("attn.Wqkv"),
                O => l("attn.Wo"),
                AttnNorm => l("attn_norm"),
                MlpNorm => l("mlp_norm"),
                GateUp => l("mlp.Wi"),
                Down => l("mlp.Wo"),
                Positions | Types | Q | K | V | Up | Gate => fixed("(none)"),
            }
        }
        EncoderFamily::NomicBert => {
            let l = |s: &str| format!("encoder.layers.{i}.{s}");
            match part {
                Word => fixed("embeddings.word_embeddings"),
                Types => fixed("embeddings.token_type_embeddings"),
                EmbedNorm => fixed("emb_ln"),
                Qkv => l("attn.Wqkv"),
                O => l("attn.out_proj"),
                AttnNorm => l("norm1"),
                // SwiGLU: `fc11(x) · silu(fc12(x))`.
                Up => l("mlp.fc11"),
                Gate => l("mlp.fc12"),
                Down => l("mlp.fc2"),
                MlpNorm => l("norm2"),
                Positions | FinalNorm | Q | K | V | GateUp => fixed("(none)"),
            }
        }
    }
}

/// What llama.cpp's converter (`gguf`'s `TensorNameMap` for `bert`, `modern-bert`,
/// `nomic-bert`) calls `part` of layer `i`; a pre-norm encoder's norms are the decoders' names.
fn gguf_stem(part: Part, i: usize, norms: EncoderNorms) -> String {
    use Part::*;
    let top = match part {
        Word => Some("token_embd"),
        Positions => Some("position_embd"),
        Types => Some("token_types"),
        EmbedNorm => Some("token_embd_norm"),
        FinalNorm => Some("output_norm"),
        _ => None,
    };
    if let Some(top) = top {
        return top.to_owned();
    }
    let name = match (part, norms) {
        (Q, _) => "attn_q",
        (K, _) => "attn_k",
        (V, _) => "attn_v",
        (Qkv, _) => "attn_qkv",
        (O, _) => "attn_output",
        (AttnNorm, EncoderNorms::Post) => "attn_output_norm",
        (AttnNorm, EncoderNorms::Pre) => "attn_norm",
        (MlpNorm, EncoderNorms::Post) => "layer_output_norm",
        (MlpNorm, EncoderNorms::Pre) => "ffn_norm",
        (Up | GateUp, _) => "ffn_up",
        (Gate, _) => "ffn_gate",
        _ => "ffn_down",
    };
    format!("blk.{i}.{name}")
}

/// A layer's query, key and value maps: three, or one stacked.
#[derive(Debug)]
enum Qkv {
    Separate { q: Linear, k: Linear, v: Linear },
    Fused(Linear),
}

/// A layer's MLP input maps.
#[derive(Debug)]
enum MlpIn {
    /// `act(up(x))`.
    Plain(Linear),
    /// `act(gate(x)) · up(x)`.
    Gated { gate: Linear, up: Linear },
    /// The same from one map whose output is the gate's then the up map's.
    Fused(Linear),
}

#[derive(Debug)]
struct Layer {
    qkv: Qkv,
    o: Linear,
    /// ModernBERT's first layer has none: its input is the embeddings' norm already.
    attn_norm: Option<Norm>,
    mlp_in: MlpIn,
    down: Linear,
    mlp_norm: Norm,
}

/// A cross-encoder's head on the first token (or the mean): `second(transform(first(h)))`. BERT
/// calls the first map the pooler and the second the classifier; RoBERTa calls them
/// `classifier.dense` and `classifier.out_proj`; ModernBERT `head.dense` (then its activation and
/// `head.norm`) and `classifier`.
#[derive(Debug)]
struct Head {
    first: Linear,
    norm: Option<Norm>,
    second: Linear,
}

/// One input to the encoder: its token ids and their token types (sentence A is 0, B is 1).
#[derive(Debug, Clone, Copy)]
pub struct EncoderInput<'a> {
    /// Token ids.
    pub ids: &'a [u32],
    /// Token type ids, one per id (`None`: all 0).
    pub types: Option<&'a [u32]>,
}

/// A BERT-family encoder, with a cross-encoder's head where the checkpoint has one.
#[derive(Debug)]
pub struct Encoder {
    config: EncoderConfig,
    word: Embedding,
    /// The learned position table (`None`: rotary positions).
    positions: Option<Tensor>,
    /// The token type table (`None`: a family without one, ModernBERT).
    types: Option<Tensor>,
    embed_norm: Norm,
    layers: Vec<Layer>,
    final_norm: Option<Norm>,
    head: Option<Head>,
    device: Device,
}

impl Encoder {
    /// Loads the encoder `config` describes from a Hugging Face checkpoint or a GGUF file
    /// (`naming`), checking every tensor's shape.
    pub fn load(config: EncoderConfig, w: &WeightLoader<'_>, naming: Naming) -> Result<Self> {
        let c = &config;
        let (h, inter) = (c.hidden_size, c.intermediate_size);
        let prefix = match naming {
            // llama.cpp's converter names every tensor at the top level.
            Naming::Gguf => "",
            Naming::HuggingFace => {
                let word = hf_stem(c.family, Part::Word, 0);
                let word_name = |p: &str| format!("{p}{word}.weight");
                PREFIXES.into_iter().find(|p| w.contains(&word_name(p))).ok_or_else(|| CandleError::MissingTensor {
                    name: format!("{word}.weight (tried the prefixes {PREFIXES:?})"),
                })?
            }
        };
        // A tensor's stem in the checkpoint's format.
        let stem = |part: Part, i: usize| -> String {
            match naming {
                Naming::HuggingFace => format!("{prefix}{}", hf_stem(c.family, part, i)),
                Naming::Gguf => gguf_stem(part, i, c.norms),
            }
        };
        let layer_norm = |stem: &str, bias: bool| -> Result<Norm> {
            let weight = w.dense_f32(&format!("{stem}.weight"), &[h])?;
            let bias = if bias { Some(w.dense_f32(&format!("{stem}.bias"), &[h])?) } else { None };
            Norm::new(NormKind::Layer, weight, bias, c.layer_norm_eps, false).ctx(|| format!("preparing norm `{stem}`"))
        };
        let norm = |part: Part, i: usize| layer_norm(&stem(part, i), c.norm_bias);
        let linear_with = |stem: &str, out: usize, inp: usize, bias: bool| -> Result<Linear> {
            let weight = w.matmul(&format!("{stem}.weight"), out, inp)?;
            let bias = if bias { Some(w.dense_f32(&format!("{stem}.bias"), &[out])?) } else { None };
            Ok(Linear::new(weight, bias))
        };
        let linear =
            |part: Part, i: usize, out: usize, inp: usize| linear_with(&stem(part, i), out, inp, c.linear_bias);
        let word = w.embedding(&format!("{}.weight", stem(Part::Word, 0)), c.vocab_size, h, false)?;
        let positions = match c.positions {
            EncoderPositions::Table { .. } => {
                Some(w.dense_f32(&format!("{}.weight", stem(Part::Positions, 0)), &[c.max_position_embeddings, h])?)
            }
            EncoderPositions::Rotary => None,
        };
        let types = match c.type_vocab_size {
            0 => None,
            rows => Some(w.dense_f32(&format!("{}.weight", stem(Part::Types, 0)), &[rows, h])?),
        };
        let embed_norm = norm(Part::EmbedNorm, 0)?;
        let fused = matches!(c.family, EncoderFamily::ModernBert | EncoderFamily::NomicBert);
        let layers = (0..c.num_layers)
            .map(|i| -> Result<Layer> {
                let qkv = if fused {
                    Qkv::Fused(linear(Part::Qkv, i, 3 * h, h)?)
                } else {
                    Qkv::Separate {
                        q: linear(Part::Q, i, h, h)?,
                        k: linear(Part::K, i, h, h)?,
                        v: linear(Part::V, i, h, h)?,
                    }
                };
                let mlp_in = match (c.mlp_gated, c.family) {
                    (false, _) => MlpIn::Plain(linear(Part::Up, i, inter, h)?),
                    (true, EncoderFamily::ModernBert) => MlpIn::Fused(linear(Part::GateUp, i, 2 * inter, h)?),
                    (true, _) => {
                        MlpIn::Gated { gate: linear(Part::Gate, i, inter, h)?, up: linear(Part::Up, i, inter, h)? }
                    }
                };
                // ModernBERT's first layer has an identity for its attention norm (llama.cpp reads
                // the norm as optional there too).
                let attn_norm =
                    if c.norms == EncoderNorms::Pre && i == 0 { None } else { Some(norm(Part::AttnNorm, i)?) };
                Ok(Layer {
                    qkv,
                    o: linear(Part::O, i, h, h)?,
                    attn_norm,
                    mlp_in,
                    down: linear(Part::Down, i, h, inter)?,
                    mlp_norm: norm(Part::MlpNorm, i)?,
                })
            })
            .collect::<Result<Vec<_>>>()?;
        let final_norm = match c.norms {
            EncoderNorms::Pre => Some(norm(Part::FinalNorm, 0)?),
            EncoderNorms::Post => None,
        };
        let head = match &c.classifier {
            None => None,
            Some(cls) => Some(match cls.transform {
                // ModernBERT's head: `head.dense`, `head.norm`, `classifier`; llama.cpp's
                // converter calls them `cls`, `cls.norm`, `cls.output`.
                HeadTransform::ActivationNorm { bias, .. } => {
                    let [first, norm, second] = match naming {
                        Naming::HuggingFace => ["head.dense", "head.norm", "classifier"],
                        Naming::Gguf => ["cls", "cls.norm", "cls.output"],
                    };
                    Head {
                        first: linear_with(first, h, h, bias)?,
                        norm: Some(layer_norm(norm, c.norm_bias)?),
                        second: linear_with(second, cls.num_labels, h, true)?,
                    }
                }
                HeadTransform::Tanh if w.contains("classifier.out_proj.weight") => Head {
                    first: linear_with("classifier.dense", h, h, true)?,
                    norm: None,
                    second: linear_with("classifier.out_proj", cls.num_labels, h, true)?,
                },
                HeadTransform::Tanh => Head {
                    first: linear_with(&format!("{prefix}pooler.dense"), h, h, true)?,
                    norm: None,
                    second: linear_with("classifier", cls.num_labels, h, true)?,
                },
            }),
        };
        Ok(Self { config, word, positions, types, embed_norm, layers, final_norm, head, device: w.device().clone() })
    }

    /// The configuration.
    pub fn config(&self) -> &EncoderConfig {
        &self.config
    }

    /// The device the weights live on.
    pub fn device(&self) -> &Device {
        &self.device
    }

    /// The word embedding table (the stand-in decoder shares it).
    pub fn word_embedding(&self) -> &Embedding {
        &self.word
    }

    /// The embeddings' LayerNorm (the stand-in decoder shares it).
    pub fn embedding_norm(&self) -> &Norm {
        &self.embed_norm
    }

    /// Whether the checkpoint has a cross-encoder's classification head.
    pub fn has_classifier(&self) -> bool {
        self.head.is_some()
    }

    /// Parameters by storage type (`f32`, `q8_0`, ...).
    pub fn weight_summary(&self) -> Vec<(String, usize)> {
        let f32s = |t: &Tensor| ("f32".to_owned(), t.elem_count());
        let mut parts = vec![self.word.summary(), self.embed_norm.summary()];
        parts.extend(self.positions.iter().chain(&self.types).map(f32s));
        for l in &self.layers {
            let mut maps: Vec<&Linear> = match &l.qkv {
                Qkv::Separate { q, k, v } => vec![q, k, v],
                Qkv::Fused(qkv) => vec![qkv],
            };
            match &l.mlp_in {
                MlpIn::Plain(up) | MlpIn::Fused(up) => maps.push(up),
                MlpIn::Gated { gate, up } => maps.extend([gate, up]),
            }
            maps.extend([&l.o, &l.down]);
            for lin in maps {
                parts.extend(lin.summary());
            }
            parts.extend(l.attn_norm.iter().chain([&l.mlp_norm]).map(Norm::summary));
        }
        parts.extend(self.final_norm.iter().map(Norm::summary));
        if let Some(head) = &self.head {
            parts.extend(head.first.summary());
            parts.extend(head.norm.iter().map(Norm::summary));
            parts.extend(head.second.summary());
        }
        parts
    }

    /// Refuses an input that is empty, longer than the position table, has an id outside the
    /// vocabulary or a token type outside the type table, before anything runs.
    pub fn check(&self, operation: &'static str, inputs: &[EncoderInput<'_>]) -> Result<()> {
        let c = &self.config;
        for (d, input) in inputs.iter().enumerate() {
            let refuse = |reason: String| CandleError::InvalidInput { operation, reason };
            if input.ids.is_empty() {
                return Err(refuse(format!("input {d} has no tokens")));
            }
            if input.ids.len() > c.max_tokens() {
                return Err(refuse(format!(
                    "input {d} has {} tokens, more than this encoder's {} positions",
                    input.ids.len(),
                    c.max_tokens()
                )));
            }
            if let Some((index, &token)) = input.ids.iter().enumerate().find(|(_, &t)| t as usize >= c.vocab_size) {
                return Err(CandleError::TokenOutOfRange { token, index, vocab_size: c.vocab_size });
            }
            if let Some(types) = input.types {
                if types.len() != input.ids.len() {
                    return Err(refuse(format!(
                        "input {d} has {} token types for {} ids",
                        types.len(),
                        input.ids.len()
                    )));
                }
                // A one-type model (XLM-RoBERTa) reads every token as type 0, as its tokenizer
                // returns no types at all.
                if c.type_vocab_size > 1 {
                    if let Some(&t) = types.iter().find(|&&t| t as usize >= c.type_vocab_size) {
                        return Err(refuse(format!(
                            "input {d} has token type {t}; this model has {} types",
                            c.type_vocab_size
                        )));
                    }
                }
            }
        }
        Ok(())
    }

    /// Each input's last hidden states, float32 `[tokens, hidden]` (what sentence-transformers
    /// pools). Inputs must have passed `check`.
    pub fn hidden(&self, inputs: &[EncoderInput<'_>]) -> candle_core::Result<Vec<Tensor>> {
        let lens: Vec<usize> = inputs.iter().map(|i| i.ids.len()).collect();
        split_rows(&self.forward(inputs, &lens)?, &lens)
    }

    /// Each input's classification logits `[num_labels]` (a cross-encoder's scores before its
    /// activation). Inputs must have passed `check`.
    pub fn classify(&self, inputs: &[EncoderInput<'_>]) -> candle_core::Result<Vec<Vec<f32>>> {
        let (Some(head), Some(cls)) = (&self.head, &self.config.classifier) else {
            candle_core::bail!("this encoder has no classification head")
        };
        let lens: Vec<usize> = inputs.iter().map(|i| i.ids.len()).collect();
        let x = self.forward(inputs, &lens)?;
        let pooled = match cls.pooling {
            // The first token of each input: [CLS] / <s>.
            EncoderPooling::Cls | EncoderPooling::Last => {
                let mut starts = Vec::with_capacity(lens.len());
                let mut offset = 0u32;
                for &t in &lens {
                    starts.push(offset);
                    offset += t as u32;
                }
                x.index_select(&Tensor::new(starts.as_slice(), &self.device)?, 0)?
            }
            EncoderPooling::Mean => {
                let rows = split_rows(&x, &lens)?;
                let means = rows.iter().map(|r| r.mean_keepdim(0)).collect::<candle_core::Result<Vec<_>>>()?;
                Tensor::cat(&means, 0)?
            }
        };
        let y = head.first.forward(&pooled)?;
        let y = match (cls.transform, &head.norm) {
            (HeadTransform::ActivationNorm { activation: act, .. }, Some(norm)) => {
                norm.forward(&activation::apply(act, &y)?)?
            }
            _ => y.tanh()?,
        };
        head.second.forward(&y)?.to_dtype(DType::F32)?.to_vec2::<f32>()
    }

    /// The cos and sin tables of each rotary base the layers use, for positions `0..t`.
    fn rotary_tables(&self, t: usize) -> candle_core::Result<HashMap<u64, (Tensor, Tensor)>> {
        let mut out = HashMap::new();
        if self.config.positions != EncoderPositions::Rotary {
            return Ok(out);
        }
        let head_dim = self.config.hidden_size / self.config.num_heads;
        for l in &self.config.layers {
            if let std::collections::hash_map::Entry::Vacant(e) = out.entry(l.rope_theta.to_bits()) {
                let rope = Rope::new(&RopeConfig { theta: l.rope_theta, scaling: RopeScaling::None }, head_dim);
                e.insert(rope.tables(0, t, &self.device)?);
            }
        }
        Ok(out)
    }

    /// The last layer's output of every input's rows (after the final norm where the family has
    /// one), stacked `[Σ tokens, hidden]`.
    fn forward(&self, inputs: &[EncoderInput<'_>], lens: &[usize]) -> candle_core::Result<Tensor> {
        let c = &self.config;
        let total: usize = lens.iter().sum();
        let (mut ids, mut types, mut positions) =
            (Vec::with_capacity(total), Vec::with_capacity(total), Vec::with_capacity(total));
        for input in inputs {
            ids.extend_from_slice(input.ids);
            match input.types {
                Some(t) if c.type_vocab_size > 1 => types.extend_from_slice(t),
                _ => types.extend(std::iter::repeat_n(0u32, input.ids.len())),
            }
            match c.positions {
                EncoderPositions::Rotary => {}
                EncoderPositions::Table { padding_idx: None } => positions.extend(0..input.ids.len() as u32),
                // RoBERTa's `create_position_ids_from_input_ids`: padding_idx + the running count
                // of non-padding tokens; a padding token itself sits at padding_idx.
                EncoderPositions::Table { padding_idx: Some(pad) } => {
                    let mut count = 0u32;
                    for &id in input.ids {
                        if id != pad {
                            count += 1;
                            positions.push(pad + count);
                        } else {
                            positions.push(pad);
                        }
                    }
                }
            }
        }
        let dev = &self.device;
        let rows = |table: &Tensor, idx: &[u32]| table.index_select(&Tensor::new(idx, dev)?, 0);
        let mut x = self.word.forward(&Tensor::new(ids.as_slice(), dev)?)?;
        if let Some(table) = &self.positions {
            x = (x + rows(table, &positions)?)?;
        }
        if let Some(table) = &self.types {
            x = (x + rows(table, &types)?)?;
        }
        let mut x = self.embed_norm.forward(&x)?;
        let (heads, d) = (c.num_heads, c.hidden_size / c.num_heads);
        let scale = (d as f64).powf(-0.5);
        let tables = self.rotary_tables(lens.iter().copied().max().unwrap_or(0))?;
        let pre = c.norms == EncoderNorms::Pre;
        // A sliding layer's mask per (input length, window), built once for every layer.
        let mut masks: HashMap<(usize, usize), Tensor> = HashMap::new();
        for (l, lc) in self.layers.iter().zip(&c.layers) {
            let h = match (&l.attn_norm, pre) {
                (Some(norm), true) => norm.forward(&x)?,
                _ => x.clone(),
            };
            let (q, k, v) = match &l.qkv {
                Qkv::Separate { q, k, v } => (q.forward(&h)?, k.forward(&h)?, v.forward(&h)?),
                Qkv::Fused(qkv) => {
                    let y = qkv.forward(&h)?;
                    let w = c.hidden_size;
                    (y.narrow(1, 0, w)?, y.narrow(1, w, w)?, y.narrow(1, 2 * w, w)?)
                }
            };
            let rotary = tables.get(&lc.rope_theta.to_bits());
            let mut parts = Vec::with_capacity(lens.len());
            let mut offset = 0;
            for &t in lens {
                let split = |y: &Tensor| y.narrow(0, offset, t)?.reshape((t, heads, d))?.transpose(0, 1)?.contiguous();
                let (mut q, mut k, v) = (split(&q)?, split(&k)?, split(&v)?);
                if let Some((cos, sin)) = rotary {
                    let (cos, sin) = (cos.narrow(0, 0, t)?, sin.narrow(0, 0, t)?);
                    q = rope::apply(&q.unsqueeze(0)?, &cos, &sin, false)?.squeeze(0)?;
                    k = rope::apply(&k.unsqueeze(0)?, &cos, &sin, false)?.squeeze(0)?;
                }
                let mut scores = (q.matmul(&k.t()?)? * scale)?;
                if let Some(w) = lc.window.filter(|&w| t > w + 1) {
                    let mask = match masks.entry((t, w)) {
                        std::collections::hash_map::Entry::Occupied(e) => e.into_mut(),
                        std::collections::hash_map::Entry::Vacant(e) => {
                            e.insert(window_mask(t, w, dev)?.to_dtype(scores.dtype())?)
                        }
                    };
                    scores = scores.broadcast_add(mask)?;
                }
                let probs = candle_nn::ops::softmax_last_dim(&scores)?;
                parts.push(probs.matmul(&v)?.transpose(0, 1)?.reshape((t, c.hidden_size))?);
                offset += t;
            }
            let a = if parts.len() == 1 { parts.remove(0) } else { Tensor::cat(&parts, 0)? };
            let a = l.o.forward(&a)?;
            let mlp = |x: &Tensor| -> candle_core::Result<Tensor> {
                let y = match &l.mlp_in {
                    MlpIn::Plain(up) => activation::apply(c.activation, &up.forward(x)?)?,
                    MlpIn::Gated { gate, up } => activation::gated(c.activation, &gate.forward(x)?, &up.forward(x)?)?,
                    MlpIn::Fused(gate_up) => {
                        let y = gate_up.forward(x)?;
                        let n = c.intermediate_size;
                        activation::gated(c.activation, &y.narrow(D::Minus1, 0, n)?, &y.narrow(D::Minus1, n, n)?)?
                    }
                };
                l.down.forward(&y)
            };
            if pre {
                x = (x + a)?;
                x = (&x + mlp(&l.mlp_norm.forward(&x)?)?)?;
            } else {
                let attn_norm =
                    l.attn_norm.as_ref().ok_or_else(|| candle_core::Error::Msg("no attention norm".into()))?;
                x = attn_norm.forward(&(a + &x)?)?;
                x = l.mlp_norm.forward(&(mlp(&x)? + &x)?)?;
            }
        }
        match &self.final_norm {
            Some(norm) => norm.forward(&x),
            None => Ok(x),
        }
    }
}

/// The additive mask `[t, t]` of a sliding layer: 0 where two positions are at most `window`
/// apart, -inf elsewhere.
fn window_mask(t: usize, window: usize, device: &Device) -> candle_core::Result<Tensor> {
    let mask: Vec<f32> = (0..t)
        .flat_map(|i| (0..t).map(move |j| if i.abs_diff(j) <= window { 0.0 } else { f32::NEG_INFINITY }))
        .collect();
    Tensor::from_vec(mask, (t, t), device)
}
