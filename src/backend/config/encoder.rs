//! The description the one BERT-family encoder is parameterised by (DESIGN §17): BERT and
//! RoBERTa / XLM-RoBERTa differ only in data here (where positions start, how many token types
//! there are, which classification head a cross-encoder carries), never in a model file of
//! their own.

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
}

impl EncoderFamily {
    /// The `model_type` of the family's config.json (what `supported_architectures` lists).
    pub fn name(self) -> &'static str {
        match self {
            Self::Bert => "bert",
            Self::Roberta => "roberta",
            Self::XlmRoberta => "xlm-roberta",
        }
    }

    /// Every family, in the order `supported_architectures` lists them.
    pub const ALL: [EncoderFamily; 3] = [Self::Bert, Self::Roberta, Self::XlmRoberta];

    fn parse(model_type: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|f| f.name() == model_type)
    }
}

/// The head of a cross-encoder, `BertForSequenceClassification`'s pooler (a linear map and tanh
/// on the first token) and classifier, or RoBERTa's classification head (the same two maps under
/// other names).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ClassifierConfig {
    /// Scores per input (`num_labels`).
    pub num_labels: usize,
    /// What a rerank applies to the logit (sentence-transformers' CrossEncoder's activation).
    pub activation: ScoreActivation,
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
    /// Rows of the learned position table.
    pub max_position_embeddings: usize,
    /// Rows of the token type table (2 for BERT's sentence pairs, 1 for XLM-RoBERTa).
    pub type_vocab_size: usize,
    /// LayerNorm epsilon.
    pub layer_norm_eps: f64,
    /// The MLP activation.
    pub activation: Activation,
    /// RoBERTa's padding index: positions count from `pad + 1` (`None`: from 0, BERT).
    pub position_padding_idx: Option<u32>,
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
        let offset = self.position_padding_idx.map_or(0, |p| p as usize + 1);
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
            qkv_bias: true,
            o_bias: true,
            mlp_bias: true,
            mlp_gated: false,
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
    let num = |key: &str| -> Result<usize> {
        v.get(key)
            .and_then(Value::as_u64)
            .map(|n| n as usize)
            .ok_or_else(|| invalid(path, key, "missing or not a whole number"))
    };
    let width = |key: &str| -> Result<usize> {
        let n = num(key)?;
        if n == 0 || n > MAX_WIDTH {
            return Err(invalid(path, key, format!("{n} is outside 1..={MAX_WIDTH}")));
        }
        Ok(n)
    };
    let num_layers = num("num_hidden_layers")?;
    check_layer_count(num_layers, path, "num_hidden_layers")?;
    let hidden_size = width("hidden_size")?;
    let num_heads = num("num_attention_heads")?;
    if num_heads == 0 || num_heads > MAX_HEADS || hidden_size % num_heads != 0 {
        return Err(invalid(path, "num_attention_heads", format!("{num_heads} heads do not divide {hidden_size}")));
    }
    let act = v.get("hidden_act").and_then(Value::as_str).unwrap_or("gelu");
    let activation = match act {
        "gelu" => Activation::Gelu,
        "gelu_new" | "gelu_pytorch_tanh" => Activation::GeluTanh,
        "relu" => Activation::Relu,
        other => {
            return Err(CandleError::UnsupportedConfig {
                what: format!("{path}: hidden_act = {other:?} (accepted: gelu, gelu_new, relu)"),
            })
        }
    };
    if let Some(kind) = v.get("position_embedding_type").and_then(Value::as_str) {
        if kind != "absolute" {
            return Err(CandleError::UnsupportedConfig {
                what: format!("{path}: position_embedding_type = {kind:?} (only \"absolute\" is supported)"),
            });
        }
    }
    let position_padding_idx = match family {
        EncoderFamily::Bert => None,
        EncoderFamily::Roberta | EncoderFamily::XlmRoberta => Some(num("pad_token_id").unwrap_or(1) as u32),
    };
    let classifier = classifier_of(&v, path)?;
    let config = EncoderConfig {
        family,
        vocab_size: width("vocab_size")?,
        hidden_size,
        intermediate_size: width("intermediate_size")?,
        num_layers,
        num_heads,
        max_position_embeddings: width("max_position_embeddings")?,
        type_vocab_size: num("type_vocab_size").unwrap_or(2).max(1),
        layer_norm_eps: v.get("layer_norm_eps").and_then(Value::as_f64).unwrap_or(1e-12),
        activation,
        position_padding_idx,
        classifier,
        pooling: None,
    };
    if config.max_tokens() == 0 {
        return Err(invalid(path, "max_position_embeddings", "leaves no position after the padding index"));
    }
    Ok(Some(config))
}

/// The encoder a GGUF file describes (`general.architecture` = `bert`, as llama.cpp's converter
/// writes BERT), or `None` for any other architecture. `type_rows` is the row count of its
/// `token_types` table. The converter drops the pooler and writes no classification head that
/// reranks as sentence-transformers does, so a GGUF encoder embeds only.
pub fn from_gguf(md: &Metadata<'_>, vocab_size: usize, type_rows: usize, path: &str) -> Result<Option<EncoderConfig>> {
    if md.string("general.architecture").ok().as_deref() != Some("bert") {
        return Ok(None);
    }
    let key = |k: &str| format!("bert.{k}");
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
    let pooling = EncoderPooling::from_gguf(md.opt_usize(&key("pooling_type"))?, path, "bert")?;
    let config = EncoderConfig {
        family: EncoderFamily::Bert,
        vocab_size,
        hidden_size,
        intermediate_size: md.usize(&key("feed_forward_length"))?,
        num_layers,
        num_heads,
        max_position_embeddings: md.usize(&key("context_length"))?,
        type_vocab_size: type_rows.max(1),
        layer_norm_eps: md.opt_f64(&key("attention.layer_norm_epsilon"))?.unwrap_or(1e-12),
        activation: Activation::Gelu,
        position_padding_idx: None,
        classifier: None,
        pooling,
    };
    if config.intermediate_size == 0 || config.intermediate_size > MAX_WIDTH || config.max_tokens() == 0 {
        return Err(invalid(path, &key("feed_forward_length"), "a width or context of 0"));
    }
    Ok(Some(config))
}

/// The classification head a `*ForSequenceClassification` checkpoint declares.
fn classifier_of(v: &Value, path: &str) -> Result<Option<ClassifierConfig>> {
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
    Ok(Some(ClassifierConfig { num_labels, activation }))
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
        assert_eq!((bert.family, bert.position_padding_idx, bert.max_tokens()), (EncoderFamily::Bert, None, 64));
        assert!(bert.classifier.is_none());
        let xlmr = BERT
            .replace("\"bert\"", "\"xlm-roberta\"")
            .replace("\"BertModel\"", "\"XLMRobertaForSequenceClassification\"");
        let xlmr = xlmr.replace(
            "\"type_vocab_size\": 2",
            "\"type_vocab_size\": 1, \"pad_token_id\": 1, \"id2label\": {\"0\": \"LABEL_0\"}",
        );
        let x = from_hf(&xlmr, "c").unwrap().unwrap();
        assert_eq!((x.position_padding_idx, x.max_tokens(), x.type_vocab_size), (Some(1), 62, 1));
        assert_eq!(x.classifier, Some(ClassifierConfig { num_labels: 1, activation: ScoreActivation::Sigmoid }));
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
}
