//! Sentence embeddings and reranking (DESIGN §17): a decoder's final hidden states pooled as the
//! checkpoint's sentence-transformers files declare (`modules.json`, `1_Pooling/config.json`,
//! `N_Dense/`, `Normalize`, `config_sentence_transformers.json` prompts,
//! `sentence_bert_config.json`), and Qwen3-Reranker's yes/no relevance score.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use candle_core::{DType, Device, Tensor};
use serde_json::Value as Json;

use crate::backend::config::encoder::EncoderPooling;

/// How the hidden states of a text's tokens become one vector.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Pooling {
    /// The mean over the text's tokens.
    Mean,
    /// The first token's state (BERT's `[CLS]`).
    Cls,
    /// The last token's state (Qwen3-Embedding: the end-of-text token the tokenizer appends).
    LastToken,
    /// The element-wise maximum over the text's tokens.
    Max,
}

impl Pooling {
    /// Parses `mean`, `cls`, `lasttoken` (or `last`), `max`.
    pub fn parse(s: &str) -> Option<Self> {
        Some(match s.to_ascii_lowercase().as_str() {
            "mean" => Self::Mean,
            "cls" | "first" => Self::Cls,
            "lasttoken" | "last" | "last_token" => Self::LastToken,
            "max" => Self::Max,
            _ => return None,
        })
    }

    /// The name `parse` reads and sentence-transformers writes (`pooling_mode`).
    pub fn name(self) -> &'static str {
        match self {
            Self::Mean => "mean",
            Self::Cls => "cls",
            Self::LastToken => "lasttoken",
            Self::Max => "max",
        }
    }

    /// The pooled `[hidden]` vector of one text's `[tokens, hidden]` states.
    fn apply(self, rows: &Tensor) -> candle_core::Result<Tensor> {
        let t = rows.dim(0)?;
        match self {
            Self::Mean => rows.mean(0),
            Self::Cls => rows.get(0),
            Self::LastToken => rows.get(t - 1),
            Self::Max => rows.max(0),
        }
    }
}

/// The activation after a Dense module's linear map.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum DenseActivation {
    Identity,
    Tanh,
    Relu,
    Sigmoid,
    Gelu,
}

impl DenseActivation {
    /// sentence-transformers stores the torch class's path (`torch.nn.modules.activation.Tanh`).
    fn parse(s: &str) -> Option<Self> {
        Some(match s.rsplit('.').next().unwrap_or(s) {
            "Identity" => Self::Identity,
            "Tanh" => Self::Tanh,
            "ReLU" => Self::Relu,
            "Sigmoid" => Self::Sigmoid,
            "GELU" => Self::Gelu,
            _ => return None,
        })
    }

    fn apply(self, x: Tensor) -> candle_core::Result<Tensor> {
        match self {
            Self::Identity => Ok(x),
            Self::Tanh => x.tanh(),
            Self::Relu => x.relu(),
            Self::Sigmoid => candle_nn::ops::sigmoid(&x),
            Self::Gelu => x.gelu_erf(),
        }
    }
}

/// One sentence-transformers Dense module: `activation(x · Wᵀ + b)`, in float32.
#[derive(Debug, Clone)]
struct Dense {
    weight: Tensor,
    bias: Option<Tensor>,
    activation: DenseActivation,
}

impl Dense {
    fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        let y = x.matmul(&self.weight.t()?)?;
        let y = match &self.bias {
            Some(b) => y.broadcast_add(b)?,
            None => y,
        };
        self.activation.apply(y)
    }
}

/// Why the embedding setup of a checkpoint could not be read, or a call was refused.
#[derive(Debug, thiserror::Error)]
pub enum EmbeddingError {
    /// A sentence-transformers file is missing a field, malformed, or names what is not supported.
    #[error("{path}: {reason}")]
    Config {
        /// The file.
        path: String,
        /// What is wrong with it.
        reason: String,
    },
    /// An argument of `embed` / `rerank` is out of range.
    #[error("{argument}: {reason}")]
    InvalidArgument {
        /// The argument.
        argument: &'static str,
        /// Why it was refused.
        reason: String,
    },
    /// Computing the pooled vectors or the dense layers failed.
    #[error("{context}: {source}")]
    Compute {
        /// What was being done.
        context: String,
        /// candle's error.
        #[source]
        source: candle_core::Error,
    },
}

fn config_err(path: &Path, reason: impl Into<String>) -> EmbeddingError {
    EmbeddingError::Config { path: path.display().to_string(), reason: reason.into() }
}

fn compute<T>(context: &str, r: candle_core::Result<T>) -> Result<T, EmbeddingError> {
    r.map_err(|source| EmbeddingError::Compute { context: context.to_owned(), source })
}

/// What a checkpoint declares about turning its hidden states into embeddings.
#[derive(Debug, Clone)]
pub struct EmbeddingSetup {
    /// The pooling of `1_Pooling/config.json` (last token where the directory has none: a bare
    /// decoder, as llama-server pools one).
    pub pooling: Pooling,
    /// Whether a Normalize module ends the pipeline.
    pub normalize: bool,
    /// The named prompts of `config_sentence_transformers.json` (`query`, `document`, ...).
    pub prompts: BTreeMap<String, String>,
    /// The prompt used where a call names none.
    pub default_prompt_name: Option<String>,
    /// The most tokens a text keeps (`sentence_bert_config.json`'s `max_seq_length`).
    pub max_seq_length: Option<usize>,
    /// Whether the directory has sentence-transformers files at all.
    pub sentence_transformers: bool,
    dense: Vec<Dense>,
    hidden_size: usize,
}

fn read_json(path: &Path) -> Result<Option<Json>, EmbeddingError> {
    match std::fs::read_to_string(path) {
        Ok(text) => serde_json::from_str(&text).map(Some).map_err(|e| config_err(path, e.to_string())),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
        Err(e) => Err(config_err(path, e.to_string())),
    }
}

/// A module's folder inside the model directory, refused unless it stays inside it.
fn module_dir(dir: &Path, path: &str, modules: &Path) -> Result<PathBuf, EmbeddingError> {
    use std::path::Component;
    let rel = Path::new(path);
    if !rel.components().all(|c| matches!(c, Component::Normal(_))) {
        return Err(config_err(modules, format!("module path {path:?} is not a folder inside the model directory")));
    }
    Ok(dir.join(rel))
}

impl EmbeddingSetup {
    /// The setup of the model in `dir` (a GGUF file or a directory without sentence-transformers
    /// files gets `default_pooling` and normalisation: llama-server's last token for a decoder,
    /// the mean for an encoder, as sentence-transformers pools a bare one).
    pub fn read(
        dir: &Path,
        hidden_size: usize,
        default_pooling: Pooling,
        device: &Device,
    ) -> Result<Self, EmbeddingError> {
        let mut setup = Self {
            pooling: default_pooling,
            normalize: true,
            prompts: BTreeMap::new(),
            default_prompt_name: None,
            max_seq_length: None,
            sentence_transformers: false,
            dense: Vec::new(),
            hidden_size,
        };
        if !dir.is_dir() {
            return Ok(setup);
        }
        let modules_path = dir.join("modules.json");
        let Some(modules) = read_json(&modules_path)? else { return Ok(setup) };
        setup.sentence_transformers = true;
        setup.normalize = false;
        let list = modules.as_array().ok_or_else(|| config_err(&modules_path, "not a list of modules"))?;
        let mut width = hidden_size;
        let mut pooled = false;
        for m in list {
            let kind = m.get("type").and_then(Json::as_str).unwrap_or_default();
            let path = m.get("path").and_then(Json::as_str).unwrap_or_default();
            // Older and newer sentence-transformers name the same classes under other modules.
            match kind.rsplit('.').next().unwrap_or(kind) {
                "Transformer" => {
                    if !path.is_empty() {
                        return Err(config_err(
                            &modules_path,
                            format!("a Transformer module in {path:?}: only the directory itself is read"),
                        ));
                    }
                }
                "Pooling" => {
                    let p = module_dir(dir, path, &modules_path)?.join("config.json");
                    let cfg = read_json(&p)?.ok_or_else(|| config_err(&p, "missing"))?;
                    setup.pooling = pooling_of(&cfg, &p)?;
                    pooled = true;
                }
                "Dense" => {
                    let d = module_dir(dir, path, &modules_path)?;
                    let dense = read_dense(&d, width, device)?;
                    width = dense.weight.dim(0).map_err(|e| config_err(&d, e.to_string()))?;
                    setup.dense.push(dense);
                }
                "Normalize" => setup.normalize = true,
                other => {
                    return Err(config_err(
                        &modules_path,
                        format!("module type `{other}` is not supported (Transformer, Pooling, Dense, Normalize are)"),
                    ));
                }
            }
        }
        if !pooled {
            return Err(config_err(&modules_path, "no Pooling module"));
        }
        setup.hidden_size = width;
        let st_path = dir.join("config_sentence_transformers.json");
        if let Some(cfg) = read_json(&st_path)? {
            if let Some(prompts) = cfg.get("prompts").and_then(Json::as_object) {
                for (k, v) in prompts {
                    let v = v.as_str().ok_or_else(|| config_err(&st_path, format!("prompt `{k}` is not a string")))?;
                    setup.prompts.insert(k.clone(), v.to_owned());
                }
            }
            setup.default_prompt_name = cfg.get("default_prompt_name").and_then(Json::as_str).map(str::to_owned);
        }
        let sb_path = dir.join("sentence_bert_config.json");
        if let Some(cfg) = read_json(&sb_path)? {
            setup.max_seq_length = cfg.get("max_seq_length").and_then(Json::as_u64).map(|n| n as usize);
        }
        Ok(setup)
    }

    /// Adds the dense layers a GGUF file carries after pooling (EmbeddingGemma's `dense_2` /
    /// `dense_3`: a weight each, no bias, no activation, as llama.cpp applies them); a directory
    /// with Dense modules of its own keeps those.
    fn with_file_dense(mut self, weights: &[Tensor]) -> Self {
        if self.dense.is_empty() && !weights.is_empty() {
            self.dense = weights
                .iter()
                .map(|w| Dense { weight: w.clone(), bias: None, activation: DenseActivation::Identity })
                .collect();
        }
        self
    }

    /// The width of the embeddings before any truncation.
    pub fn dimension(&self) -> usize {
        self.hidden_size
    }

    /// The text to prepend: `prompt` itself, else the named one, else the default one.
    pub fn prompt_text(&self, prompt: Option<&str>, prompt_name: Option<&str>) -> Result<String, EmbeddingError> {
        if let Some(p) = prompt {
            return Ok(p.to_owned());
        }
        match prompt_name.or(self.default_prompt_name.as_deref()) {
            None => Ok(String::new()),
            Some(name) => self.prompts.get(name).cloned().ok_or_else(|| EmbeddingError::InvalidArgument {
                argument: "prompt_name",
                reason: format!(
                    "{name:?} is not one of this model's prompts ({})",
                    if self.prompts.is_empty() {
                        "it declares none".to_owned()
                    } else {
                        self.prompts.keys().cloned().collect::<Vec<_>>().join(", ")
                    }
                ),
            }),
        }
    }

    /// Pools each text's hidden `rows` `[tokens, hidden]` and runs the rest of the pipeline:
    /// the dense layers, truncation to `dimensions` (Matryoshka), and normalisation where
    /// `normalize` (or, when it is `None`, the model) asks. Returns `[texts, dimension]` rows.
    pub fn finish(
        &self,
        rows: &[Tensor],
        pooling: Option<Pooling>,
        normalize: Option<bool>,
        dimensions: Option<usize>,
    ) -> Result<Vec<Vec<f32>>, EmbeddingError> {
        if let Some(d) = dimensions {
            if d == 0 || d > self.hidden_size {
                return Err(EmbeddingError::InvalidArgument {
                    argument: "dimensions",
                    reason: format!("{d} is outside 1..={} (this model's embedding width)", self.hidden_size),
                });
            }
        }
        if rows.is_empty() {
            return Ok(Vec::new());
        }
        let pooling = pooling.unwrap_or(self.pooling);
        let pooled = rows
            .iter()
            .map(|r| r.to_dtype(DType::F32).and_then(|r| pooling.apply(&r)))
            .collect::<candle_core::Result<Vec<_>>>();
        let mut x = compute("pooling", pooled.and_then(|p| Tensor::stack(&p, 0)))?;
        for (i, d) in self.dense.iter().enumerate() {
            x = compute(&format!("dense layer {i}"), d.forward(&x))?;
        }
        if let Some(d) = dimensions {
            x = compute("truncating", x.narrow(1, 0, d))?;
        }
        if normalize.unwrap_or(self.normalize) {
            // sentence-transformers' `F.normalize`: divided by max(‖x‖, 1e-12).
            let norm = compute("normalising", x.sqr().and_then(|s| s.sum_keepdim(1)).and_then(|s| s.sqrt()))?;
            x = compute("normalising", norm.clamp(1e-12f32, f32::MAX).and_then(|n| x.broadcast_div(&n)))?;
        }
        compute("copying embeddings", x.to_vec2::<f32>())
    }
}

fn pooling_of(cfg: &Json, path: &Path) -> Result<Pooling, EmbeddingError> {
    if let Some(mode) = cfg.get("pooling_mode").and_then(Json::as_str) {
        return Pooling::parse(mode).ok_or_else(|| config_err(path, format!("pooling_mode `{mode}` is not supported")));
    }
    let on = |k: &str| cfg.get(k).and_then(Json::as_bool).unwrap_or(false);
    let modes = [
        ("pooling_mode_cls_token", Pooling::Cls),
        ("pooling_mode_mean_tokens", Pooling::Mean),
        ("pooling_mode_max_tokens", Pooling::Max),
        ("pooling_mode_lasttoken", Pooling::LastToken),
    ];
    let chosen: Vec<Pooling> = modes.iter().filter(|(k, _)| on(k)).map(|(_, p)| *p).collect();
    for k in ["pooling_mode_mean_sqrt_len_tokens", "pooling_mode_weightedmean_tokens"] {
        if on(k) {
            return Err(config_err(path, format!("`{k}` is not supported (cls, mean, max and lasttoken are)")));
        }
    }
    if cfg.get("include_prompt").and_then(Json::as_bool) == Some(false) {
        return Err(config_err(path, "`include_prompt: false` (pooling without the prompt's tokens) is not supported"));
    }
    match chosen.as_slice() {
        [one] => Ok(*one),
        [] => Err(config_err(path, "no pooling mode is on")),
        _ => Err(config_err(path, "several pooling modes at once (concatenated) are not supported")),
    }
}

fn read_dense(dir: &Path, in_width: usize, device: &Device) -> Result<Dense, EmbeddingError> {
    let cfg_path = dir.join("config.json");
    let cfg = read_json(&cfg_path)?.ok_or_else(|| config_err(&cfg_path, "missing"))?;
    let size = |k: &str| {
        cfg.get(k).and_then(Json::as_u64).map(|n| n as usize).ok_or_else(|| config_err(&cfg_path, format!("no `{k}`")))
    };
    let (inp, out) = (size("in_features")?, size("out_features")?);
    if inp != in_width {
        return Err(config_err(&cfg_path, format!("in_features {inp} does not follow the previous width {in_width}")));
    }
    let bias = cfg.get("bias").and_then(Json::as_bool).unwrap_or(true);
    let act_name = cfg.get("activation_function").and_then(Json::as_str).unwrap_or("torch.nn.modules.activation.Tanh");
    let activation = DenseActivation::parse(act_name)
        .ok_or_else(|| config_err(&cfg_path, format!("activation `{act_name}` is not supported")))?;
    let weights_path = dir.join("model.safetensors");
    if !weights_path.is_file() {
        return Err(config_err(&weights_path, "missing (only safetensors Dense weights are read)"));
    }
    let tensors =
        candle_core::safetensors::load(&weights_path, device).map_err(|e| config_err(&weights_path, e.to_string()))?;
    let take = |name: &str, shape: &[usize]| -> Result<Tensor, EmbeddingError> {
        let t = tensors.get(name).ok_or_else(|| config_err(&weights_path, format!("no tensor `{name}`")))?;
        if t.dims() != shape {
            return Err(config_err(&weights_path, format!("`{name}` has shape {:?}, expected {shape:?}", t.dims())));
        }
        t.to_dtype(DType::F32).map_err(|e| config_err(&weights_path, e.to_string()))
    };
    let weight = take("linear.weight", &[out, inp])?;
    let bias = if bias { Some(take("linear.bias", &[out])?) } else { None };
    Ok(Dense { weight, bias, activation })
}

/// Qwen3-Reranker's prompt around each query/document pair (its model card's).
pub mod qwen3_reranker {
    /// Before the pair.
    pub const PREFIX: &str = "<|im_start|>system\nJudge whether the Document meets the requirements based on the Query and the Instruct provided. Note that the answer can only be \"yes\" or \"no\".<|im_end|>\n<|im_start|>user\n";
    /// After the pair.
    pub const SUFFIX: &str = "<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n";
    /// The instruction used where a call gives none.
    pub const DEFAULT_INSTRUCTION: &str = "Given a web search query, retrieve relevant passages that answer the query";

    /// The pair as the model card formats it.
    pub fn pair(instruction: &str, query: &str, document: &str) -> String {
        format!("<Instruct>: {instruction}\n<Query>: {query}\n<Document>: {document}")
    }

    /// The relevance score from the last position's logits of "yes" and "no":
    /// softmax([no, yes])[yes], computed as a logistic of the difference.
    pub fn score(yes: f32, no: f32) -> f32 {
        let d = (yes - no) as f64;
        (1.0 / (1.0 + (-d).exp())) as f32
    }
}

/// One reranked document.
#[derive(Debug, Clone, PartialEq)]
pub struct RerankResult {
    /// Its index in the documents given.
    pub index: usize,
    /// Its relevance to the query: in 0..1, except from a cross-encoder whose configured
    /// activation is Identity (its raw logit).
    pub relevance_score: f32,
}

/// How `Model::embed` runs.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct EmbedOptions {
    /// The pooling; `None`: the model's.
    pub pooling: Option<Pooling>,
    /// Whether vectors are scaled to unit length; `None`: as the model declares (a Normalize module).
    pub normalize: Option<bool>,
    /// Keep only the first this many dimensions (Matryoshka), before normalising.
    pub dimensions: Option<usize>,
    /// One of the model's named prompts (`query`, `document`, ...) put in front of every text.
    pub prompt_name: Option<String>,
    /// A prompt of one's own put in front of every text (overrides `prompt_name`).
    pub prompt: Option<String>,
}

/// What `Model::embed` returns.
#[derive(Debug, Clone, PartialEq)]
pub struct Embeddings {
    /// One vector per input.
    pub vectors: Vec<Vec<f32>>,
    /// The tokens each input ran as (prompt and special tokens included, after truncation).
    pub token_counts: Vec<usize>,
}

impl super::Model {
    /// How this model turns hidden states into embeddings (read once, on first use).
    pub fn embedding_setup(&self) -> Result<std::sync::Arc<EmbeddingSetup>, super::ModelError> {
        let mut slot = self.embedding.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(s) = slot.as_ref() {
            return Ok(s.clone());
        }
        let decoder = self.runtime.session().decoder();
        // A GGUF declares its pooling (`{arch}.pooling_type`); where nothing says, a bare encoder
        // pools the mean and a decoder its last token.
        let declared = match decoder.encoder() {
            Some(e) => e.config().pooling.or(Some(EncoderPooling::Mean)),
            None => decoder.config().embedding_pooling,
        };
        let default_pooling = match declared {
            None | Some(EncoderPooling::Last) => Pooling::LastToken,
            Some(EncoderPooling::Mean) => Pooling::Mean,
            Some(EncoderPooling::Cls) => Pooling::Cls,
        };
        let setup = EmbeddingSetup::read(
            Path::new(&self.info.path),
            decoder.config().hidden_size,
            default_pooling,
            decoder.device(),
        )?
        .with_file_dense(decoder.embedding_dense());
        let setup = std::sync::Arc::new(setup);
        *slot = Some(setup.clone());
        Ok(setup)
    }

    /// Embeds each input (text, with the chosen prompt in front and the tokenizer's special
    /// tokens, or token ids as given) as sentence-transformers does for the same directory:
    /// the final hidden states pooled, the dense layers, truncation, normalisation. Texts
    /// longer than the model's `max_seq_length` keep their first tokens. The session is not touched.
    pub fn embed(&self, inputs: &[super::Prompt], options: &EmbedOptions) -> Result<Embeddings, super::ModelError> {
        let setup = self.embedding_setup()?;
        let prefix = setup.prompt_text(options.prompt.as_deref(), options.prompt_name.as_deref())?;
        // An encoder cannot read past its position table: without a max_seq_length its texts are
        // cut there, as transformers' tokenizer cuts them at model_max_length.
        let encoder_max = self.runtime.session().decoder().encoder().map(|e| e.config().max_tokens());
        let mut ids = Vec::with_capacity(inputs.len());
        for input in inputs {
            let one = match (input, setup.max_seq_length.or(encoder_max)) {
                (super::Prompt::Text(text), Some(max)) => {
                    truncated(self.tokenizer()?, &format!("{prefix}{text}"), max)?
                }
                (super::Prompt::Text(text), None) => self.tokenizer()?.encode(&format!("{prefix}{text}"), true)?,
                (super::Prompt::Ids(ids), max) => ids[..max.unwrap_or(usize::MAX).min(ids.len())].to_vec(),
            };
            ids.push(one);
        }
        let rows = self.runtime.session().hidden_rows(&ids)?;
        let vectors = setup.finish(&rows, options.pooling, options.normalize, options.dimensions)?;
        Ok(Embeddings { vectors, token_counts: ids.iter().map(Vec::len).collect() })
    }

    /// Scores each document's relevance to `query`, best first, the `top_n` best where given:
    /// with a cross-encoder (a BERT-family `*ForSequenceClassification`), its one logit for the
    /// tokenizer's (query, document) pair with sentence-transformers' CrossEncoder activation
    /// (a sigmoid unless the config names another); with a Qwen3-Reranker-style decoder, the
    /// probability of "yes" against "no" after its prompt. The session is not touched.
    pub fn rerank(
        &self,
        query: &str,
        documents: &[String],
        top_n: Option<usize>,
        instruction: Option<&str>,
    ) -> Result<Vec<RerankResult>, super::ModelError> {
        let mut results = if let Some(encoder) = self.runtime.session().decoder().encoder() {
            if instruction.is_some() {
                return Err(EmbeddingError::InvalidArgument {
                    argument: "instruction",
                    reason: "a cross-encoder takes no instruction (Qwen3-Reranker-style models do)".into(),
                }
                .into());
            }
            self.cross_encoder_scores(encoder.config(), query, documents)?
        } else {
            self.yes_no_scores(query, documents, instruction)?
        };
        results.sort_by(|a, b| b.relevance_score.total_cmp(&a.relevance_score).then(a.index.cmp(&b.index)));
        if let Some(n) = top_n {
            results.truncate(n);
        }
        Ok(results)
    }

    /// A cross-encoder's score of each (query, document) pair.
    fn cross_encoder_scores(
        &self,
        config: &crate::backend::config::encoder::EncoderConfig,
        query: &str,
        documents: &[String],
    ) -> Result<Vec<RerankResult>, super::ModelError> {
        use crate::backend::config::encoder::ScoreActivation;
        let refuse = |reason: String| EmbeddingError::InvalidArgument { argument: "model", reason };
        let Some(head) = config.classifier else {
            return Err(refuse(format!(
                "rerank needs a cross-encoder or a yes/no reranker: this {} encoder has no classification \
                 head (a *ForSequenceClassification checkpoint has one); it embeds",
                config.family.name()
            ))
            .into());
        };
        if head.num_labels != 1 {
            return Err(refuse(format!(
                "a cross-encoder with {} labels has no single relevance score (rerank takes num_labels = 1)",
                head.num_labels
            ))
            .into());
        }
        let tok = self.tokenizer()?;
        let pairs = documents
            .iter()
            .map(|d| tok.encode_pair(query, d, Some(config.max_tokens())))
            .collect::<Result<Vec<_>, _>>()?;
        let logits = self.runtime.session().classify(&pairs)?;
        Ok(logits
            .iter()
            .enumerate()
            .map(|(index, l)| {
                let x = l[0];
                let relevance_score = match head.activation {
                    ScoreActivation::Sigmoid => (1.0 / (1.0 + (-(x as f64)).exp())) as f32,
                    ScoreActivation::Identity => x,
                };
                RerankResult { index, relevance_score }
            })
            .collect())
    }

    /// Qwen3-Reranker's score of each document: the probability of "yes" against "no" at the
    /// last position of its model card's prompt.
    fn yes_no_scores(
        &self,
        query: &str,
        documents: &[String],
        instruction: Option<&str>,
    ) -> Result<Vec<RerankResult>, super::ModelError> {
        use qwen3_reranker as q;
        let tok = self.tokenizer()?;
        let (yes, no) = match (tok.token_to_id("yes"), tok.token_to_id("no")) {
            (Some(y), Some(n)) => (y, n),
            _ => return Err(EmbeddingError::InvalidArgument {
                argument: "model",
                reason:
                    "rerank needs a yes/no reranker (Qwen3-Reranker style): this tokenizer has no `yes` and `no` tokens"
                        .into(),
            }
            .into()),
        };
        let (prefix, suffix) = (tok.encode(q::PREFIX, false)?, tok.encode(q::SUFFIX, false)?);
        let instruction = instruction.unwrap_or(q::DEFAULT_INSTRUCTION);
        let mut ids = Vec::with_capacity(documents.len());
        for d in documents {
            let mut one = prefix.clone();
            one.extend(tok.encode(&q::pair(instruction, query, d), true)?);
            one.extend(&suffix);
            ids.push(one);
        }
        let logits = self.runtime.session().last_logits(&ids)?;
        let mut results = Vec::with_capacity(documents.len());
        for (index, row) in logits.iter().enumerate() {
            let row = compute("reading logits", row.flatten_all().and_then(|r| r.to_dtype(DType::F32)))?;
            let pick = |id: u32| compute("reading logits", row.get(id as usize).and_then(|v| v.to_scalar::<f32>()));
            results.push(RerankResult { index, relevance_score: q::score(pick(yes)?, pick(no)?) });
        }
        Ok(results)
    }
}

/// `text`'s ids with special tokens, at most `max` of them, cut as transformers truncates: the
/// text's own tokens lose their end, the special tokens around them stay (an embedding model that
/// pools its end-of-text token still finds it last).
fn truncated(tok: &crate::text::Tokenizer, text: &str, max: usize) -> Result<Vec<u32>, super::ModelError> {
    let ids = tok.encode(text, true)?;
    if ids.len() <= max {
        return Ok(ids);
    }
    let plain = tok.encode(text, false)?;
    let specials = ids.len().saturating_sub(plain.len());
    let lead = (0..=specials).find(|&l| ids[l..].starts_with(&plain));
    Ok(match lead {
        Some(lead) if specials < max => {
            let keep = max - specials;
            let mut out = ids[..lead].to_vec();
            out.extend_from_slice(&plain[..keep]);
            out.extend_from_slice(&ids[lead + plain.len()..]);
            out
        }
        _ => ids[..max].to_vec(),
    })
}
