//! One BERT-family encoder for every supported family, parameterised by `EncoderConfig` as the
//! decoder is by `ArchConfig` (DESIGN §17): word + position + token-type embeddings and their
//! LayerNorm, then post-LayerNorm layers (biased q/k/v/o, an ungated MLP) with every token
//! attending every other, and a cross-encoder's classification head. BERT and RoBERTa /
//! XLM-RoBERTa differ only in data: where positions start, how many token types there are, what
//! their head is called.
//!
//! Inputs are never padded: each input's rows go through every matrix product together with the
//! other inputs' (one product per weight per batch), and attention runs per input over its own
//! rows, so no padding mask is needed and an input's result does not depend on its batch.

use candle_core::{DType, Device, Tensor};

use crate::backend::blocks::activation;
use crate::backend::blocks::linear::Linear;
use crate::backend::blocks::norm::Norm;
use crate::backend::blocks::rows::split_rows;
use crate::backend::config::encoder::EncoderConfig;
use crate::backend::config::NormKind;
use crate::backend::error::{CandleContext, CandleError, Result};
use crate::backend::weights::embedding::Embedding;
use crate::backend::weights::names::Naming;
use crate::backend::weights::WeightLoader;

/// Where a checkpoint's encoder tensors live: a bare model (`BertModel.save_pretrained`, what
/// sentence-transformers ships) or under a task model's base prefix.
const PREFIXES: [&str; 4] = ["", "bert.", "roberta.", "model."];

#[derive(Debug)]
struct Layer {
    q: Linear,
    k: Linear,
    v: Linear,
    o: Linear,
    attn_norm: Norm,
    up: Linear,
    down: Linear,
    mlp_norm: Norm,
}

/// A cross-encoder's head on the first token: `second(tanh(first(h₀)))`. BERT calls the first map
/// the pooler and the second the classifier; RoBERTa calls them `classifier.dense` and
/// `classifier.out_proj`.
#[derive(Debug)]
struct Head {
    first: Linear,
    second: Linear,
}

/// What llama.cpp's converter (`gguf`'s `TensorNameMap` for `bert`) calls a tensor whose Hugging
/// Face stem is `hf` (without the base model's prefix).
fn gguf_stem(hf: &str) -> String {
    let top = match hf {
        "embeddings.word_embeddings" => Some("token_embd"),
        "embeddings.position_embeddings" => Some("position_embd"),
        "embeddings.token_type_embeddings" => Some("token_types"),
        "embeddings.LayerNorm" => Some("token_embd_norm"),
        _ => None,
    };
    if let Some(top) = top {
        return top.to_owned();
    }
    let rest = hf.strip_prefix("encoder.layer.").unwrap_or(hf);
    let (layer, part) = rest.split_once('.').unwrap_or((rest, ""));
    let part = match part {
        "attention.self.query" => "attn_q",
        "attention.self.key" => "attn_k",
        "attention.self.value" => "attn_v",
        "attention.output.dense" => "attn_output",
        "attention.output.LayerNorm" => "attn_output_norm",
        "intermediate.dense" => "ffn_up",
        "output.dense" => "ffn_down",
        "output.LayerNorm" => "layer_output_norm",
        other => other,
    };
    format!("blk.{layer}.{part}")
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
    positions: Tensor,
    types: Tensor,
    embed_norm: Norm,
    layers: Vec<Layer>,
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
                let word_name = |p: &str| format!("{p}embeddings.word_embeddings.weight");
                PREFIXES.into_iter().find(|p| w.contains(&word_name(p))).ok_or_else(|| CandleError::MissingTensor {
                    name: format!("embeddings.word_embeddings.weight (tried the prefixes {PREFIXES:?})"),
                })?
            }
        };
        // A tensor's stem in the checkpoint's format, from its Hugging Face stem.
        let stem = |hf: &str| -> String {
            match naming {
                Naming::HuggingFace => format!("{prefix}{hf}"),
                Naming::Gguf => gguf_stem(hf),
            }
        };
        let layer_norm = |stem: &str| -> Result<Norm> {
            let weight = w.dense_f32(&format!("{stem}.weight"), &[h])?;
            let bias = w.dense_f32(&format!("{stem}.bias"), &[h])?;
            Norm::new(NormKind::Layer, weight, Some(bias), c.layer_norm_eps, false)
                .ctx(|| format!("preparing norm `{stem}`"))
        };
        let linear = |stem: &str, out: usize, inp: usize| -> Result<Linear> {
            let weight = w.matmul(&format!("{stem}.weight"), out, inp)?;
            Ok(Linear::new(weight, Some(w.dense_f32(&format!("{stem}.bias"), &[out])?)))
        };
        let word = w.embedding(&format!("{}.weight", stem("embeddings.word_embeddings")), c.vocab_size, h, false)?;
        let positions = w.dense_f32(
            &format!("{}.weight", stem("embeddings.position_embeddings")),
            &[c.max_position_embeddings, h],
        )?;
        let types =
            w.dense_f32(&format!("{}.weight", stem("embeddings.token_type_embeddings")), &[c.type_vocab_size, h])?;
        let embed_norm = layer_norm(&stem("embeddings.LayerNorm"))?;
        let layers = (0..c.num_layers)
            .map(|i| -> Result<Layer> {
                let l = |part: &str| stem(&format!("encoder.layer.{i}.{part}"));
                Ok(Layer {
                    q: linear(&l("attention.self.query"), h, h)?,
                    k: linear(&l("attention.self.key"), h, h)?,
                    v: linear(&l("attention.self.value"), h, h)?,
                    o: linear(&l("attention.output.dense"), h, h)?,
                    attn_norm: layer_norm(&l("attention.output.LayerNorm"))?,
                    up: linear(&l("intermediate.dense"), inter, h)?,
                    down: linear(&l("output.dense"), h, inter)?,
                    mlp_norm: layer_norm(&l("output.LayerNorm"))?,
                })
            })
            .collect::<Result<Vec<_>>>()?;
        let head = match &c.classifier {
            None => None,
            Some(cls) if w.contains("classifier.out_proj.weight") => Some(Head {
                first: linear("classifier.dense", h, h)?,
                second: linear("classifier.out_proj", cls.num_labels, h)?,
            }),
            Some(cls) => Some(Head {
                first: linear(&format!("{prefix}pooler.dense"), h, h)?,
                second: linear("classifier", cls.num_labels, h)?,
            }),
        };
        Ok(Self { config, word, positions, types, embed_norm, layers, head, device: w.device().clone() })
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
        let mut parts = vec![self.word.summary(), f32s(&self.positions), f32s(&self.types), self.embed_norm.summary()];
        for l in &self.layers {
            for lin in [&l.q, &l.k, &l.v, &l.o, &l.up, &l.down] {
                parts.extend(lin.summary());
            }
            parts.extend([l.attn_norm.summary(), l.mlp_norm.summary()]);
        }
        if let Some(head) = &self.head {
            parts.extend(head.first.summary());
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
        let Some(head) = &self.head else { candle_core::bail!("this encoder has no classification head") };
        let lens: Vec<usize> = inputs.iter().map(|i| i.ids.len()).collect();
        let x = self.forward(inputs, &lens)?;
        // The first token of each input: [CLS] / <s>.
        let mut starts = Vec::with_capacity(lens.len());
        let mut offset = 0u32;
        for &t in &lens {
            starts.push(offset);
            offset += t as u32;
        }
        let first = x.index_select(&Tensor::new(starts.as_slice(), &self.device)?, 0)?;
        let y = head.second.forward(&head.first.forward(&first)?.tanh()?)?;
        y.to_dtype(DType::F32)?.to_vec2::<f32>()
    }

    /// The last layer's output of every input's rows, stacked `[Σ tokens, hidden]`.
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
            match c.position_padding_idx {
                None => positions.extend(0..input.ids.len() as u32),
                // RoBERTa's `create_position_ids_from_input_ids`: padding_idx + the running count
                // of non-padding tokens; a padding token itself sits at padding_idx.
                Some(pad) => {
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
        let x = ((self.word.forward(&Tensor::new(ids.as_slice(), dev)?)? + rows(&self.positions, &positions)?)?
            + rows(&self.types, &types)?)?;
        let mut x = self.embed_norm.forward(&x)?;
        let (heads, d) = (c.num_heads, c.hidden_size / c.num_heads);
        let scale = (d as f64).powf(-0.5);
        for l in &self.layers {
            let (q, k, v) = (l.q.forward(&x)?, l.k.forward(&x)?, l.v.forward(&x)?);
            let mut parts = Vec::with_capacity(lens.len());
            let mut offset = 0;
            for &t in lens {
                let split = |y: &Tensor| y.narrow(0, offset, t)?.reshape((t, heads, d))?.transpose(0, 1)?.contiguous();
                let (q, k, v) = (split(&q)?, split(&k)?, split(&v)?);
                let probs = candle_nn::ops::softmax_last_dim(&(q.matmul(&k.t()?)? * scale)?)?;
                parts.push(probs.matmul(&v)?.transpose(0, 1)?.reshape((t, c.hidden_size))?);
                offset += t;
            }
            let a = if parts.len() == 1 { parts.remove(0) } else { Tensor::cat(&parts, 0)? };
            x = l.attn_norm.forward(&(l.o.forward(&a)? + &x)?)?;
            let m = l.down.forward(&activation::apply(c.activation, &l.up.forward(&x)?)?)?;
            x = l.mlp_norm.forward(&(m + &x)?)?;
        }
        Ok(x)
    }
}
