//! The description the one BERT-family encoder is parameterised by (DESIGN §17): BERT,
//! RoBERTa / XLM-RoBERTa, ModernBERT and nomic-bert differ only in data here (where positions
//! start or whether they rotate, where the norms sit, a gated MLP, biases, windowed layers, which
//! classification head a cross-encoder carries), never in a model file of their own.

use serde_json::Value;

use super::metadata::Metadata;
use super::{
    check_layer_count, invalid, Activation, ArchConfig, Architecture, BlockNorms, LayerConfig, NormKind, QkNorm,
    MAX_HEADS, MAX_WIDTH,
};
use crate::backend::error::{CandleError, Result};

/// The encoder families the runtime embeds and reranks with.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum EncoderFamily {
    /// BERT (`BertModel`, `BertForSequenceClassification`): all-MiniLM, bge-small/base/large.
    Bert,
    /// RoBERTa (`RobertaModel`, `RobertaForSequenceClassification`): positions after the padding index.
    Roberta,
    /// XLM-RoBERTa (`XLMRobertaModel`, `XLMRobertaForSequenceClassification`): bge-m3, bge-reranker.
    XlmRoberta,
    /// ModernBERT (`ModernBertModel`, `ModernBertForSequenceClassification`): modernbert-embed,
    /// gte-modernbert, gte-reranker-modernbert. Pre-norm, rotary, GeGLU, no biases, every third
    /// layer global and the others in a sliding window.
    ModernBert,
    /// nomic-bert (`NomicBertModel`): nomic-embed-text v1 / v1.5. Post-norm, rotary, SwiGLU, no
    /// biases.
    NomicBert,
}

impl EncoderFamily {
    /// The `model_type` of the family's config.json (what `supported_architectures` lists).
    pub fn name(self) -> &'static str {
        match self {
            Self::Bert => "bert",
            Self::Roberta => "roberta",
            Self::XlmRoberta => "xlm-roberta",
            Self::ModernBert => "modernbert",
            Self::NomicBert => "nomic_bert",
        }
    }

    /// llama.cpp's `general.architecture` for the family's GGUF files, where its converter writes
    /// them and they load here (`None`: RoBERTa and XLM-RoBERTa, which the converter writes as
    /// `bert` with other tokenizers, are not read from GGUF).
    pub fn gguf_name(self) -> Option<&'static str> {
        match self {
            Self::Bert => Some("bert"),
            Self::ModernBert => Some("modern-bert"),
            Self::NomicBert => Some("nomic-bert"),
            Self::Roberta | Self::XlmRoberta => None,
        }
    }

    /// Every family, in the order `supported_architectures` lists them.
    pub const ALL: [EncoderFamily; 5] =
        [Self::Bert, Self::Roberta, Self::XlmRoberta, Self::ModernBert, Self::NomicBert];

    fn parse(model_type: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|f| f.name() == model_type)
    }
}

/// The head of a cross-encoder, `BertForSequenceClassification`'s pooler (a linear map and tanh
/// on the first token) and classifier, RoBERTa's classification head (the same two maps under
/// other names), or ModernBERT's (a linear map, its activation and a LayerNorm on the first token
/// or the mean, then the classifier).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ClassifierConfig {
    /// Scores per input (`num_labels`).
    pub num_labels: usize,
    /// What a rerank applies to the logit (sentence-transformers' CrossEncoder's activation).
    pub activation: ScoreActivation,
    /// What the head reads: the first token (BERT, RoBERTa; ModernBERT's `classifier_pooling =
    /// "cls"`) or the mean over the tokens (`"mean"`, gte-reranker-modernbert).
    pub pooling: EncoderPooling,
    /// What follows the head's first map.
    pub transform: HeadTransform,
}

/// What a cross-encoder's head applies after its first linear map.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum HeadTransform {
    /// tanh (BERT's pooler, RoBERTa's classification head).
    Tanh,
    /// An activation then a LayerNorm (ModernBERT's `head`).
    ActivationNorm {
        /// `classifier_activation`.
        activation: Activation,
        /// Whether the first map has a bias (`classifier_bias`).
        bias: bool,
    },
}

/// Where the norms of an encoder layer sit.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum EncoderNorms {
    /// After each branch's residual sum (BERT, nomic-bert): the embeddings' norm, then
    /// `norm(x + branch(x))` twice a layer.
    Post,
    /// Before each branch (ModernBERT): `x + branch(norm(x))`, the first layer's attention taking
    /// the embeddings' norm as its own, and a final norm after the last layer.
    Pre,
}

/// How an encoder knows where its tokens are.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum EncoderPositions {
    /// A learned table added to the embeddings; RoBERTa's counts from its padding index + 1
    /// (`padding_idx`), BERT's from 0.
    Table {
        /// RoBERTa's padding index.
        padding_idx: Option<u32>,
    },
    /// Rotary embeddings (rotate-half, on every dimension) on queries and keys; each layer's base
    /// is in `EncoderLayer`.
    Rotary,
}

/// What differs between an encoder's layers: ModernBERT's global layers and its sliding ones.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct EncoderLayer {
    /// A sliding layer's reach: a token attends those at most this many positions away on either
    /// side (ModernBERT's `local_attention / 2`); `None`: every token.
    pub window: Option<usize>,
    /// The rotary base (`EncoderPositions::Rotary`).
    pub rope_theta: f64,
}

/// What sentence-transformers' CrossEncoder applies to a one-label logit: `Sigmoid` unless the
/// config names another (`sentence_transformers.activation_fn`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ScoreActivation {
    /// 1 / (1 + e^-x): CrossEncoder's default for one label.
    Sigmoid,
    /// The logit itself.
    Identity,
}

/// A BERT-family encoder.
#[derive(Debug, Clone, PartialEq)]
pub struct EncoderConfig {
    /// The family.
    pub family: EncoderFamily,
    /// Vocabulary size (rows of the word embedding).
    pub vocab_size: usize,
    /// Residual width.
    pub hidden_size: usize,
    /// MLP width.
    pub intermediate_size: usize,
    /// Layers.
    pub num_layers: usize,
    /// Attention heads.
    pub num_heads: usize,
    /// Rows of the learned position table; with rotary positions, the most tokens an input has.
    pub max_position_embeddings: usize,
    /// Rows of the token type table (2 for BERT's sentence pairs, 1 for XLM-RoBERTa; 0: no table,
    /// ModernBERT).
    pub type_vocab_size: usize,
    /// LayerNorm epsilon.
    pub layer_norm_eps: f64,
    /// The MLP activation (of the gate where the MLP is gated).
    pub activation: Activation,
    /// A learned position table or rotary positions.
    pub positions: EncoderPositions,
    /// Where the norms sit.
    pub norms: EncoderNorms,
    /// A gated MLP, `down(act(gate(x)) · up(x))` (ModernBERT's GeGLU, nomic-bert's SwiGLU); else
    /// `down(act(up(x)))`.
    pub mlp_gated: bool,
    /// Whether the attention and MLP maps have biases.
    pub linear_bias: bool,
    /// Whether the LayerNorms have a shift.
    pub norm_bias: bool,
    /// Each layer's window and rotary base, one per layer.
    pub layers: Vec<EncoderLayer>,
    /// A cross-encoder's head (`*ForSequenceClassification`).
    pub classifier: Option<ClassifierConfig>,
    /// The pooling the file itself declares (a GGUF's `bert.pooling_type`; a directory's is in
    /// its sentence-transformers files).
    pub pooling: Option<EncoderPooling>,
}

/// llama.cpp's `pooling_type` of an embedding model.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum EncoderPooling {
    /// The mean over the tokens (1).
    Mean,
    /// The first token (2).
    Cls,
    /// The last token (3).
    Last,
}

impl EncoderPooling {
    /// A GGUF's `{arch}.pooling_type` (none, or 0: not declared); llama.cpp's rank pooling (4) and
    /// any other value are refused by name.
    pub fn from_gguf(value: Option<usize>, path: &str, arch: &str) -> Result<Option<Self>> {
        match value {
            None | Some(0) => Ok(None),
            Some(1) => Ok(Some(Self::Mean)),
            Some(2) => Ok(Some(Self::Cls)),
            Some(3) => Ok(Some(Self::Last)),
            Some(other) => Err(CandleError::UnsupportedConfig {
                what: format!("{path}: {arch}.pooling_type = {other} (mean 1, cls 2 and last 3 are supported)"),
            }),
        }
    }
}

impl EncoderConfig {
    /// The most tokens one input may have: the position table's rows after RoBERTa's offset.
    pub fn max_tokens(&self) -> usize {
        let offset = match self.positions {
            EncoderPositions::Table { padding_idx: Some(p) } => p as usize + 1,
            _ => 0,
        };
        self.max_position_embeddings.saturating_sub(offset)
    }

    /// The decoder description that stands in for an encoder-only model in the session (its
    /// sizes, no layers): what `model_info` and the session's checks read. The decoder never runs
    /// it; every decoder step on such a model is refused (`CandleError::EncoderOnly`).
    pub fn stand_in(&self) -> ArchConfig {
        let heads = self.num_heads;
        ArchConfig {
            // Nothing reads the family of a stand-in: `model_info` names the encoder's.
            architecture: Architecture::Gpt2,
            vocab_size: self.vocab_size,
            hidden_size: self.hidden_size,
            intermediate_size: self.intermediate_size,
            num_heads: heads,
            num_kv_heads: heads,
            head_dim: self.hidden_size / heads,
            layers: Vec::<LayerConfig>::new(),
            rms_norm_eps: self.layer_norm_eps,
            norm_kind: NormKind::Layer,
            block_norms: BlockNorms::Pre,
            parallel_residual: false,
            learned_positions: false,
            max_position_embeddings: self.max_tokens(),
            tie_word_embeddings: true,
            partial_rotary_factor: 1.0,
            rope_interleaved: false,
            qkv_bias: self.linear_bias,
            o_bias: self.linear_bias,
            mlp_bias: self.linear_bias,
            mlp_gated: self.mlp_gated,
            qk_norm: QkNorm::None,
            norm_weight_offset: false,
            embed_scale: None,
            embed_multiplier: None,
            residual_multiplier: None,
            logits_divisor: None,
            activation: self.activation,
            attn_scale: 1.0 / ((self.hidden_size / heads) as f64).sqrt(),
            attn_scale_by_layer: false,
            attn_softcap: None,
            final_softcap: None,
            eos_token_ids: Vec::new(),
            bos_token_id: None,
            moe: None,
            attn_sinks: false,
            bidirectional: true,
            embedding_pooling: self.pooling,
        }
    }
}

/// The encoder a config.json describes, or `None` when its `model_type` is not a BERT-family
/// encoder (a decoder, which `hf::parse_config` reads).
pub fn from_hf(text: &str, path: &str) -> Result<Option<EncoderConfig>> {
    let v: Value = serde_json::from_str(text).map_err(|e| CandleError::Malformed {
        what: "config.json",
        path: path.to_owned(),
        reason: e.to_string(),
    })?;
    let Some(family) = v.get("model_type").and_then(Value::as_str).and_then(EncoderFamily::parse) else {
        return Ok(None);
    };
    let keys = Keys { v: &v, path };
    let config = match family {
        EncoderFamily::Bert | EncoderFamily::Roberta | EncoderFamily::XlmRoberta => bert_like(family, &keys)?,
        EncoderFamily::ModernBert => modernbert(&keys)?,
        EncoderFamily::NomicBert => nomic_bert(&keys)?,
    };
    if config.max_tokens() == 0 {
        return Err(invalid(path, "max_position_embeddings", "leaves no position after the padding index"));
    }
    Ok(Some(config))
}

/// A config.json's values, read with the file named in errors.
struct Keys<'a> {
    v: &'a Value,
    path: &'a str,
}

impl Keys<'_> {
    fn num(&self, key: &str) -> Result<usize> {
        self.v
            .get(key)
            .and_then(Value::as_u64)
            .map(|n| n as usize)
            .ok_or_else(|| invalid(self.path, key, "missing or not a whole number"))
    }

    fn width(&self, key: &str) -> Result<usize> {
        let n = self.num(key)?;
        if n == 0 || n > MAX_WIDTH {
            return Err(invalid(self.path, key, format!("{n} is outside 1..={MAX_WIDTH}")));
        }
        Ok(n)
    }

    fn flag(&self, key: &str, default: bool) -> bool {
        self.v.get(key).and_then(Value::as_bool).unwrap_or(default)
    }

    fn float(&self, key: &str) -> Option<f64> {
        self.v.get(key).and_then(Value::as_f64)
    }

    fn text(&self, key: &str) -> Option<&str> {
        self.v.get(key).and_then(Value::as_str)
    }

    /// Layers and heads under their keys, heads dividing `hidden`.
    fn shape(&self, layers_key: &str, heads_key: &str, hidden: usize) -> Result<(usize, usize)> {
        let num_layers = self.num(layers_key)?;
        check_layer_count(num_layers, self.path, layers_key)?;
        let num_heads = self.num(heads_key)?;
        if num_heads == 0 || num_heads > MAX_HEADS || hidden % num_heads != 0 {
            return Err(invalid(self.path, heads_key, format!("{num_heads} heads do not divide {hidden}")));
        }
        Ok((num_layers, num_heads))
    }

    /// The activation named under `key` (`default` when absent).
    fn activation(&self, key: &str, default: &str) -> Result<Activation> {
        match self.text(key).unwrap_or(default) {
            "gelu" => Ok(Activation::Gelu),
            "gelu_new" | "gelu_pytorch_tanh" => Ok(Activation::GeluTanh),
            "relu" => Ok(Activation::Relu),
            "silu" | "swish" => Ok(Activation::Silu),
            other => Err(CandleError::UnsupportedConfig {
                what: format!("{}: {key} = {other:?} (accepted: gelu, gelu_new, relu, silu)", self.path),
            }),
        }
    }
}

/// A rotary base that is finite and positive.
fn theta(value: f64, path: &str, key: &str) -> Result<f64> {
    if value.is_finite() && value > 0.0 {
        Ok(value)
    } else {
        Err(invalid(path, key, format!("{value} is not a finite positive number")))
    }
}

/// BERT, RoBERTa and XLM-RoBERTa: post-norm, a position table, biased maps, an ungated MLP.
fn bert_like(family: EncoderFamily, k: &Keys<'_>) -> Result<EncoderConfig> {
    let hidden_size = k.width("hidden_size")?;
    let (num_layers, num_heads) = k.shape("num_hidden_layers", "num_attention_heads", hidden_size)?;
    let activation = k.activation("hidden_act", "gelu")?;
    if activation == Activation::Silu {
        return Err(CandleError::UnsupportedConfig {
            what: format!("{}: hidden_act = \"silu\" (accepted: gelu, gelu_new, relu)", k.path),
        });
    }
    if let Some(kind) = k.text("position_embedding_type") {
        if kind != "absolute" {
            return Err(CandleError::UnsupportedConfig {
                what: format!("{}: position_embedding_type = {kind:?} (only \"absolute\" is supported)", k.path),
            });
        }
    }
    let padding_idx = match family {
        EncoderFamily::Roberta | EncoderFamily::XlmRoberta => Some(k.num("pad_token_id").unwrap_or(1) as u32),
        _ => None,
    };
    Ok(EncoderConfig {
        family,
        vocab_size: k.width("vocab_size")?,
        hidden_size,
        intermediate_size: k.width("intermediate_size")?,
        num_layers,
        num_heads,
        max_position_embeddings: k.width("max_position_embeddings")?,
        type_vocab_size: k.num("type_vocab_size").unwrap_or(2).max(1),
        layer_norm_eps: k.float("layer_norm_eps").unwrap_or(1e-12),
        activation,
        positions: EncoderPositions::Table { padding_idx },
        norms: EncoderNorms::Post,
        mlp_gated: false,
        linear_bias: true,
        norm_bias: true,
        layers: vec![EncoderLayer { window: None, rope_theta: 0.0 }; num_layers],
        classifier: classifier_of(k.v, k.path, HeadTransform::Tanh)?,
        pooling: None,
    })
}

/// ModernBERT: pre-norm, rotary, GeGLU from one fused `Wi`, no biases by default, global layers
/// every `global_attn_every_n_layers` (from the first) with their own rotary base and the others
/// in a window of `local_attention` tokens. Reads the keys the Hub's configs have
/// (`global_attn_every_n_layers`, `global_rope_theta`, `local_rope_theta`) and those transformers
/// 5 writes (`layer_types`, `rope_parameters`).
fn modernbert(k: &Keys<'_>) -> Result<EncoderConfig> {
    let path = k.path;
    let hidden_size = k.width("hidden_size")?;
    let (num_layers, num_heads) = k.shape("num_hidden_layers", "num_attention_heads", hidden_size)?;
    let activation = k.activation("hidden_activation", "gelu")?;
    let local = k.v.get("local_attention").map_or(Ok(128), |_| k.num("local_attention"))?;
    let rope = k.v.get("rope_parameters");
    let rope_of = |kind: &str| rope.and_then(|r| r.get(kind)).and_then(|r| r.get("rope_theta")).and_then(Value::as_f64);
    let global_theta = theta(
        rope_of("full_attention").or_else(|| k.float("global_rope_theta")).unwrap_or(160_000.0),
        path,
        "global_rope_theta",
    )?;
    let local_theta = theta(
        rope_of("sliding_attention").or_else(|| k.float("local_rope_theta")).unwrap_or(10_000.0),
        path,
        "local_rope_theta",
    )?;
    let sliding: Vec<bool> = match k.v.get("layer_types").and_then(Value::as_array) {
        Some(types) => {
            if types.len() != num_layers {
                return Err(invalid(path, "layer_types", format!("{} entries for {num_layers} layers", types.len())));
            }
            types
                .iter()
                .map(|t| match t.as_str() {
                    Some("sliding_attention") => Ok(true),
                    Some("full_attention") => Ok(false),
                    other => Err(invalid(path, "layer_types", format!("{other:?} is neither full nor sliding"))),
                })
                .collect::<Result<_>>()?
        }
        None => {
            let every = k.v.get("global_attn_every_n_layers").map_or(Ok(3), |_| k.num("global_attn_every_n_layers"))?;
            if every == 0 {
                return Err(invalid(path, "global_attn_every_n_layers", "0"));
            }
            (0..num_layers).map(|i| i % every != 0).collect()
        }
    };
    // transformers' `sliding_window` is `local_attention // 2`, and a token attends those at most
    // that far on either side (`sliding_window_bidirectional_overlay`), as llama.cpp's symmetric
    // window of `n_swa / 2` does.
    let layers = sliding
        .iter()
        .map(|&s| EncoderLayer {
            window: s.then_some(local / 2),
            rope_theta: if s { local_theta } else { global_theta },
        })
        .collect();
    let classifier_activation = k.activation("classifier_activation", "gelu")?;
    let mut classifier = classifier_of(
        k.v,
        path,
        HeadTransform::ActivationNorm { activation: classifier_activation, bias: k.flag("classifier_bias", false) },
    )?;
    if let Some(c) = classifier.as_mut() {
        c.pooling = match k.text("classifier_pooling").unwrap_or("cls") {
            "cls" => EncoderPooling::Cls,
            "mean" => EncoderPooling::Mean,
            other => {
                return Err(CandleError::UnsupportedConfig {
                    what: format!("{path}: classifier_pooling = {other:?} (accepted: cls, mean)"),
                })
            }
        };
    }
    let bias = k.flag("attention_bias", false);
    if bias != k.flag("mlp_bias", false) {
        return Err(CandleError::UnsupportedConfig {
            what: format!("{path}: attention_bias and mlp_bias differ (both or neither are supported)"),
        });
    }
    Ok(EncoderConfig {
        family: EncoderFamily::ModernBert,
        vocab_size: k.width("vocab_size")?,
        hidden_size,
        intermediate_size: k.width("intermediate_size")?,
        num_layers,
        num_heads,
        max_position_embeddings: k.width("max_position_embeddings")?,
        type_vocab_size: 0,
        layer_norm_eps: k.float("norm_eps").unwrap_or(1e-5),
        activation,
        positions: EncoderPositions::Rotary,
        norms: EncoderNorms::Pre,
        mlp_gated: true,
        linear_bias: bias,
        norm_bias: k.flag("norm_bias", false),
        layers,
        classifier,
        pooling: None,
    })
}

/// nomic-bert (nomic-embed-text v1 / v1.5, the remote code's `NomicBertModel`): GPT-2-style keys,
/// post-norm, rotary on every dimension (rotate-half), fused `Wqkv`, SwiGLU from `fc11` (up) and
/// `fc12` (gate), no biases. The MoE variant (v2) and anything llama.cpp's converter also refuses
/// are refused by name.
fn nomic_bert(k: &Keys<'_>) -> Result<EncoderConfig> {
    let path = k.path;
    let refuse = |what: String| Err(CandleError::UnsupportedConfig { what: format!("{path}: {what}") });
    if k.num("moe_every_n_layers").unwrap_or(0) != 0 {
        return refuse("moe_every_n_layers (nomic-bert's mixture of experts, nomic-embed-text-v2-moe)".into());
    }
    if k.text("activation_function").unwrap_or("swiglu") != "swiglu" {
        return refuse(format!("activation_function = {:?} (swiglu is supported)", k.text("activation_function")));
    }
    for key in ["qkv_proj_bias", "mlp_fc1_bias", "mlp_fc2_bias", "prenorm", "rotary_emb_interleaved", "causal"] {
        if k.flag(key, false) {
            return refuse(format!("{key} = true (nomic-embed-text has none)"));
        }
    }
    if k.float("rotary_emb_fraction").unwrap_or(1.0) != 1.0
        || !k.v.get("rotary_emb_scale_base").is_none_or(Value::is_null)
    {
        return refuse("a partial or scaled rotary embedding (rotary_emb_fraction, rotary_emb_scale_base)".into());
    }
    // The released config's GPT-2-style keys, else the BERT names transformers' own `nomic_bert`
    // writes (a config it made from scratch has only those; the tensors it saves are the released
    // names either way).
    let named = |gpt2: &'static str, bert: &'static str| if k.v.get(gpt2).is_some() { gpt2 } else { bert };
    let hidden_size = k.width(named("n_embd", "hidden_size"))?;
    let (num_layers, num_heads) =
        k.shape(named("n_layer", "num_hidden_layers"), named("n_head", "num_attention_heads"), hidden_size)?;
    let rope_base = k
        .float("rotary_emb_base")
        .or_else(|| k.v.get("rope_parameters").and_then(|r| r.get("rope_theta")).and_then(Value::as_f64))
        .unwrap_or(1_000.0);
    let rope_theta = theta(rope_base, path, "rotary_emb_base")?;
    let inner = named("n_inner", "intermediate_size");
    let intermediate_size = match k.v.get(inner) {
        Some(Value::Null) | None => 4 * hidden_size,
        Some(_) => k.width(inner)?,
    };
    Ok(EncoderConfig {
        family: EncoderFamily::NomicBert,
        vocab_size: k.width("vocab_size")?,
        hidden_size,
        intermediate_size,
        num_layers,
        num_heads,
        max_position_embeddings: k.width(named("n_positions", "max_position_embeddings"))?,
        type_vocab_size: k.num("type_vocab_size").unwrap_or(2),
        layer_norm_eps: k.float(named("layer_norm_epsilon", "layer_norm_eps")).unwrap_or(1e-12),
        activation: Activation::Silu,
        positions: EncoderPositions::Rotary,
        norms: EncoderNorms::Post,
        mlp_gated: true,
        linear_bias: false,
        norm_bias: true,
        layers: vec![EncoderLayer { window: None, rope_theta }; num_layers],
        classifier: None,
        pooling: None,
    })
}

/// The encoder a GGUF file describes (`general.architecture` = `bert`, `modern-bert` or
/// `nomic-bert`, as llama.cpp's converter writes them), or `None` for any other architecture.
/// `shape` gives a tensor's shape where the file has it (the `token_types` table's rows, a
/// classification head). The converter drops BERT's pooler, so a BERT GGUF has no head that
/// reranks as sentence-transformers does and embeds only; ModernBERT's head it keeps whole
/// (`cls`, `cls.norm`, `cls.output`), which reranks as llama.cpp's rank pooling does.
pub fn from_gguf(
    md: &Metadata<'_>,
    vocab_size: usize,
    shape: &dyn Fn(&str) -> Option<Vec<usize>>,
    path: &str,
) -> Result<Option<EncoderConfig>> {
    let type_rows = shape("token_types.weight").and_then(|s| s.first().copied()).unwrap_or(0);
    let arch = md.string("general.architecture").ok();
    let Some(family) =
        EncoderFamily::ALL.into_iter().find(|f| f.gguf_name().is_some() && f.gguf_name() == arch.as_deref())
    else {
        return Ok(None);
    };
    let name = family.gguf_name().unwrap_or("bert");
    let key = |k: &str| format!("{name}.{k}");
    let num_layers = md.usize(&key("block_count"))?;
    check_layer_count(num_layers, path, &key("block_count"))?;
    let hidden_size = md.usize(&key("embedding_length"))?;
    let num_heads = md.usize(&key("attention.head_count"))?;
    if hidden_size == 0
        || hidden_size > MAX_WIDTH
        || num_heads == 0
        || num_heads > MAX_HEADS
        || hidden_size % num_heads != 0
    {
        return Err(invalid(
            path,
            &key("attention.head_count"),
            format!("{num_heads} heads do not divide {hidden_size}"),
        ));
    }
    let pooling = EncoderPooling::from_gguf(md.opt_usize(&key("pooling_type"))?, path, name)?;
    // The converter writes ModernBERT's `norm_eps` under the RMS norm's key (its name list for
    // LayerNorm's does not hold it); the norms are LayerNorms all the same.
    let eps = match md.opt_f64(&key("attention.layer_norm_epsilon"))? {
        Some(eps) => Some(eps),
        None => md.opt_f64(&key("attention.layer_norm_rms_epsilon"))?,
    };
    let base = |k: &str, default: f64| -> Result<f64> { theta(md.opt_f64(k)?.unwrap_or(default), path, k) };
    let mut config = EncoderConfig {
        family,
        vocab_size,
        hidden_size,
        intermediate_size: md.usize(&key("feed_forward_length"))?,
        num_layers,
        num_heads,
        max_position_embeddings: md.usize(&key("context_length"))?,
        type_vocab_size: type_rows.max(1),
        layer_norm_eps: eps.unwrap_or(1e-12),
        activation: Activation::Gelu,
        positions: EncoderPositions::Table { padding_idx: None },
        norms: EncoderNorms::Post,
        mlp_gated: false,
        linear_bias: true,
        norm_bias: true,
        layers: vec![EncoderLayer { window: None, rope_theta: 0.0 }; num_layers],
        classifier: None,
        pooling,
    };
    match family {
        EncoderFamily::ModernBert => {
            // llama.cpp's `llama_model_modern_bert::load_arch_hparams`: a symmetric window of
            // `sliding_window / 2` on either side; `load_swa_pattern(3, dense_first)` unless the
            // file says which layers slide; GeGLU unless `hidden_act` names SiLU.
            let window = md.opt_usize(&key("attention.sliding_window"))?.filter(|&w| w > 0);
            let global = base(&key("rope.freq_base"), 160_000.0)?;
            let local = base(&key("rope.freq_base_swa"), 10_000.0)?;
            let pattern_key = key("attention.sliding_window_pattern");
            let sliding: Vec<bool> = match (window, md.opt_bool_array(&pattern_key).ok().flatten()) {
                (None, _) => vec![false; num_layers],
                (Some(_), Some(p)) if p.len() == num_layers => p,
                (Some(_), Some(p)) => {
                    return Err(invalid(path, &pattern_key, format!("{} entries for {num_layers} layers", p.len())))
                }
                (Some(_), None) => {
                    let every = md.opt_usize(&pattern_key)?.unwrap_or(3).max(1);
                    (0..num_layers).map(|i| i % every != 0).collect()
                }
            };
            config.layers = sliding
                .iter()
                .map(|&s| EncoderLayer {
                    window: if s { window.map(|w| w / 2) } else { None },
                    rope_theta: if s { local } else { global },
                })
                .collect();
            config.activation = match md.string(&key("hidden_act")).ok().as_deref() {
                None | Some("gelu") => Activation::Gelu,
                Some("silu") | Some("swish") => Activation::Silu,
                Some(other) => {
                    return Err(CandleError::UnsupportedConfig {
                        what: format!("{path}: {} = {other:?} (gelu and silu are supported)", key("hidden_act")),
                    })
                }
            };
            // llama.cpp's rank pooling: the head on the mean unless `classifier.pooling_type`
            // says the first token (2), GELU after its first map, the classifier's one bias.
            if let Some(labels) = shape("cls.output.weight").and_then(|s| s.first().copied()) {
                let pooling = match md.opt_usize(&key("classifier.pooling_type"))? {
                    None | Some(1) => EncoderPooling::Mean,
                    Some(2) => EncoderPooling::Cls,
                    Some(other) => {
                        return Err(CandleError::UnsupportedConfig {
                            what: format!(
                                "{path}: {} = {other} (mean 1 and cls 2 are supported)",
                                key("classifier.pooling_type")
                            ),
                        })
                    }
                };
                if labels == 0 || shape("cls.weight").is_none() || shape("cls.norm.weight").is_none() {
                    return Err(invalid(
                        path,
                        "cls.output.weight",
                        "a classification head needs cls, cls.norm and at least one label",
                    ));
                }
                config.classifier = Some(ClassifierConfig {
                    num_labels: labels,
                    activation: ScoreActivation::Sigmoid,
                    pooling,
                    transform: HeadTransform::ActivationNorm {
                        activation: Activation::Gelu,
                        bias: shape("cls.bias").is_some(),
                    },
                });
            }
            config.type_vocab_size = 0;
            config.layer_norm_eps = eps.unwrap_or(1e-5);
            config.positions = EncoderPositions::Rotary;
            config.norms = EncoderNorms::Pre;
            config.mlp_gated = true;
            config.linear_bias = false;
            config.norm_bias = false;
        }
        EncoderFamily::NomicBert => {
            let rope_theta = base(&key("rope.freq_base"), 10_000.0)?;
            config.layers = vec![EncoderLayer { window: None, rope_theta }; num_layers];
            config.activation = Activation::Silu;
            config.positions = EncoderPositions::Rotary;
            config.mlp_gated = true;
            config.linear_bias = false;
        }
        _ => {}
    }
    if config.intermediate_size == 0 || config.intermediate_size > MAX_WIDTH || config.max_tokens() == 0 {
        return Err(invalid(path, &key("feed_forward_length"), "a width or context of 0"));
    }
    Ok(Some(config))
}

/// The classification head a `*ForSequenceClassification` checkpoint declares, with the family's
/// `transform` after its first map; on the first token unless the family says otherwise.
fn classifier_of(v: &Value, path: &str, transform: HeadTransform) -> Result<Option<ClassifierConfig>> {
    let classifies = v
        .get("architectures")
        .and_then(Value::as_array)
        .is_some_and(|a| a.iter().filter_map(Value::as_str).any(|s| s.ends_with("ForSequenceClassification")));
    if !classifies {
        return Ok(None);
    }
    // transformers writes `id2label` and derives num_labels from it.
    let num_labels = v
        .get("num_labels")
        .and_then(Value::as_u64)
        .or_else(|| v.get("id2label").and_then(Value::as_object).map(|m| m.len() as u64))
        .unwrap_or(2) as usize;
    if num_labels == 0 {
        return Err(invalid(path, "id2label", "a classifier with no labels"));
    }
    // sentence-transformers ≥ 4 stores the activation here; older ones under another key.
    let named = v
        .get("sentence_transformers")
        .and_then(|s| s.get("activation_fn"))
        .or_else(|| v.get("sbert_ce_default_activation_function"))
        .and_then(Value::as_str);
    let activation = match named.map(|s| s.rsplit('.').next().unwrap_or(s)) {
        None | Some("Sigmoid") => ScoreActivation::Sigmoid,
        Some("Identity") => ScoreActivation::Identity,
        Some(other) => {
            return Err(CandleError::UnsupportedConfig {
                what: format!(
                    "{path}: the cross-encoder's activation_fn `{other}` (Sigmoid and Identity are supported)"
                ),
            })
        }
    };
    Ok(Some(ClassifierConfig { num_labels, activation, pooling: EncoderPooling::Cls, transform }))
}

#[cfg(test)]
mod tests {
    use super::*;

    const BERT: &str = r#"{"model_type": "bert", "architectures": ["BertModel"], "vocab_size": 100,
        "hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4, "intermediate_size": 64,
        "max_position_embeddings": 64, "type_vocab_size": 2, "layer_norm_eps": 1e-12, "hidden_act": "gelu"}"#;

    #[test]
    fn a_decoder_config_is_not_an_encoder() {
        assert!(from_hf(r#"{"model_type": "llama"}"#, "c").unwrap().is_none());
    }

    #[test]
    fn bert_and_xlm_roberta_differ_in_data() {
        let bert = from_hf(BERT, "c").unwrap().unwrap();
        assert_eq!(
            (bert.family, bert.positions, bert.max_tokens()),
            (EncoderFamily::Bert, EncoderPositions::Table { padding_idx: None }, 64)
        );
        assert!(bert.classifier.is_none());
        let xlmr = BERT
            .replace("\"bert\"", "\"xlm-roberta\"")
            .replace("\"BertModel\"", "\"XLMRobertaForSequenceClassification\"");
        let xlmr = xlmr.replace(
            "\"type_vocab_size\": 2",
            "\"type_vocab_size\": 1, \"pad_token_id\": 1, \"id2label\": {\"0\": \"LABEL_0\"}",
        );
        let x = from_hf(&xlmr, "c").unwrap().unwrap();
        assert_eq!(
            (x.positions, x.max_tokens(), x.type_vocab_size),
            (EncoderPositions::Table { padding_idx: Some(1) }, 62, 1)
        );
        assert_eq!(
            x.classifier,
            Some(ClassifierConfig {
                num_labels: 1,
                activation: ScoreActivation::Sigmoid,
                pooling: EncoderPooling::Cls,
                transform: HeadTransform::Tanh
            })
        );
        let stand_in = x.stand_in();
        assert_eq!((stand_in.num_layers(), stand_in.hidden_size, stand_in.vocab_size), (0, 32, 100));
    }

    #[test]
    fn bad_values_are_refused_with_their_field() {
        let e = from_hf(&BERT.replace("\"num_attention_heads\": 4", "\"num_attention_heads\": 5"), "c").unwrap_err();
        assert!(e.to_string().contains("num_attention_heads"), "{e}");
        let e = from_hf(&BERT.replace("\"gelu\"", "\"swish\""), "c").unwrap_err();
        assert!(e.to_string().contains("hidden_act"), "{e}");
        let rel = BERT.replace("\"hidden_act\"", "\"position_embedding_type\": \"relative_key\", \"hidden_act\"");
        assert!(from_hf(&rel, "c").unwrap_err().to_string().contains("relative_key"));
    }

    const MODERNBERT: &str = r#"{"model_type": "modernbert", "architectures": ["ModernBertForSequenceClassification"],
        "vocab_size": 100, "hidden_size": 32, "num_hidden_layers": 4, "num_attention_heads": 4,
        "intermediate_size": 48, "max_position_embeddings": 128, "norm_eps": 1e-5, "norm_bias": false,
        "hidden_activation": "gelu", "global_attn_every_n_layers": 3, "local_attention": 8,
        "global_rope_theta": 160000.0, "local_rope_theta": 10000.0, "classifier_pooling": "mean",
        "id2label": {"0": "LABEL_0"}}"#;

    #[test]
    fn modernbert_layers_alternate_global_and_local() {
        let m = from_hf(MODERNBERT, "c").unwrap().unwrap();
        assert_eq!(
            (m.norms, m.positions, m.mlp_gated, m.linear_bias, m.type_vocab_size),
            (EncoderNorms::Pre, EncoderPositions::Rotary, true, false, 0)
        );
        let windows: Vec<_> = m.layers.iter().map(|l| (l.window, l.rope_theta)).collect();
        assert_eq!(windows, [(None, 160000.0), (Some(4), 10000.0), (Some(4), 10000.0), (None, 160000.0)]);
        let head = m.classifier.unwrap();
        assert_eq!(head.pooling, EncoderPooling::Mean);
        assert_eq!(head.transform, HeadTransform::ActivationNorm { activation: Activation::Gelu, bias: false });
        // transformers 5 writes the pattern and the bases under other keys.
        let v5 = MODERNBERT.replace(
            "\"global_attn_every_n_layers\": 3",
            "\"layer_types\": [\"full_attention\", \"full_attention\", \"sliding_attention\", \"full_attention\"], \"rope_parameters\": {\"full_attention\": {\"rope_theta\": 5.0}, \"sliding_attention\": {\"rope_theta\": 7.0}}",
        );
        let m = from_hf(&v5, "c").unwrap().unwrap();
        let windows: Vec<_> = m.layers.iter().map(|l| (l.window, l.rope_theta)).collect();
        assert_eq!(windows, [(None, 5.0), (None, 5.0), (Some(4), 7.0), (None, 5.0)]);
        let e = from_hf(&MODERNBERT.replace("\"mean\"", "\"max\""), "c").unwrap_err();
        assert!(e.to_string().contains("classifier_pooling"), "{e}");
    }

    #[test]
    fn nomic_bert_reads_its_gpt2_style_keys_and_refuses_what_it_lacks() {
        let nomic = r#"{"model_type": "nomic_bert", "architectures": ["NomicBertModel"], "vocab_size": 100,
            "n_embd": 32, "n_layer": 2, "n_head": 4, "n_inner": 48, "n_positions": 64, "type_vocab_size": 2,
            "layer_norm_epsilon": 1e-12, "rotary_emb_base": 1000, "rotary_emb_fraction": 1.0,
            "activation_function": "swiglu", "qkv_proj_bias": false, "mlp_fc1_bias": false,
            "mlp_fc2_bias": false, "prenorm": false, "causal": false}"#;
        let n = from_hf(nomic, "c").unwrap().unwrap();
        assert_eq!(
            (n.family, n.norms, n.intermediate_size, n.activation),
            (EncoderFamily::NomicBert, EncoderNorms::Post, 48, Activation::Silu)
        );
        assert_eq!(n.layers[1], EncoderLayer { window: None, rope_theta: 1000.0 });
        // transformers' own config (BERT names only) reads the same.
        let native = r#"{"model_type": "nomic_bert", "architectures": ["NomicBertModel"], "vocab_size": 100,
            "hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4, "intermediate_size": 48,
            "max_position_embeddings": 64, "layer_norm_eps": 1e-12, "hidden_act": "silu",
            "rope_parameters": {"rope_type": "default", "rope_theta": 1000.0}}"#;
        let m = from_hf(native, "c").unwrap().unwrap();
        assert_eq!((m.hidden_size, m.num_layers, m.intermediate_size, m.max_tokens()), (32, 2, 48, 64));
        assert_eq!(m.layers[0].rope_theta, 1000.0);
        let e = from_hf(&nomic.replace("\"prenorm\": false", "\"prenorm\": true"), "c").unwrap_err();
        assert!(matches!(e, CandleError::UnsupportedConfig { .. }) && e.to_string().contains("prenorm"), "{e}");
    }
}
