//! The tokenizer the runtime uses: a `tokenizers::Tokenizer` plus the special-token facts
//! (BOS, end-of-generation ids, chat template) that live outside `tokenizer.json`.

use std::collections::HashMap;
use std::path::Path;

use candle_core::quantized::gguf_file;
use serde_json::Value as Json;

use super::chat_template::{ChatRenderOptions, ChatTemplate, TemplateValue};
use super::error::TextError;
use super::gguf::tokenizer_from_gguf;

/// How our `encode` corrects the inner post-processor so BOS follows `add_bos_token`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum BosFix {
    /// The inner tokenizer already does the right thing.
    None,
    /// `add_bos_token` is true but tokenizer.json's post-processor adds no BOS.
    Prepend,
    /// `add_bos_token` is false but tokenizer.json's post-processor adds one.
    Strip,
}

/// A tokenizer with the special-token facts generation needs.
///
/// Built from a Hugging Face checkpoint directory or from GGUF metadata; either way the
/// tokenization equals what transformers produces for the same files.
#[derive(Clone)]
pub struct Tokenizer {
    inner: tokenizers::Tokenizer,
    bos_id: Option<u32>,
    eos_ids: Vec<u32>,
    add_bos: bool,
    bos_fix: BosFix,
    chat_template: Option<String>,
    bos_token: Option<String>,
    eos_token: Option<String>,
    vocab_size: usize,
    /// Added tokens that are not text: the special ones, and markup (`<start_of_image>`,
    /// `[multimodal]`) that a vocabulary lists as user-defined. Left out of generated text.
    control_ids: std::collections::HashSet<u32>,
    /// llguidance's parser factory over the vocabulary, built at the first constrained generation.
    constraint_env: std::sync::OnceLock<(usize, std::sync::Arc<llguidance::ParserFactory>)>,
}

impl std::fmt::Debug for Tokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // The inner tokenizer's Debug prints the whole vocabulary.
        f.debug_struct("Tokenizer")
            .field("vocab_size", &self.vocab_size)
            .field("bos_id", &self.bos_id)
            .field("eos_ids", &self.eos_ids)
            .field("add_bos", &self.add_bos)
            .field("bos_token", &self.bos_token)
            .field("eos_token", &self.eos_token)
            .field("has_chat_template", &self.chat_template.is_some())
            .finish()
    }
}

// The runtime shares one tokenizer across threads (and the GIL-free Python layer).
const _: () = {
    const fn assert_send_sync<T: Send + Sync>() {}
    assert_send_sync::<Tokenizer>();
};

/// The ids of `inner`'s control tokens: its special added tokens, and added tokens that read as
/// markup, `<...>` or `[...]` without spaces (Gemma's GGUF lists `<start_of_image>` as
/// user-defined, where llama.cpp and the Hugging Face tokenizer treat it as a control token).
fn control_ids(inner: &tokenizers::Tokenizer) -> std::collections::HashSet<u32> {
    let markup = |t: &str| {
        let bracketed = (t.starts_with('<') && t.ends_with('>')) || (t.starts_with('[') && t.ends_with(']'));
        bracketed && t.len() > 2 && !t.chars().any(char::is_whitespace)
    };
    inner
        .get_added_tokens_decoder()
        .into_iter()
        .filter(|(_, t)| t.special || markup(&t.content))
        .map(|(id, _)| id)
        .collect()
}

fn read_json_opt(path: &Path) -> Result<Option<Json>, TextError> {
    let text = match std::fs::read_to_string(path) {
        Ok(text) => text,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(source) => return Err(TextError::Io { path: path.to_path_buf(), source }),
    };
    serde_json::from_str(&text)
        .map(Some)
        .map_err(|e| TextError::Json { path: path.to_path_buf(), message: e.to_string() })
}

fn read_text_opt(path: &Path) -> Result<Option<String>, TextError> {
    match std::fs::read_to_string(path) {
        Ok(text) => Ok(Some(text)),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
        Err(source) => Err(TextError::Io { path: path.to_path_buf(), source }),
    }
}

/// A special token in tokenizer_config.json: a string or an `AddedToken` object.
fn token_text(v: Option<&Json>) -> Option<String> {
    match v? {
        Json::String(s) => Some(s.clone()),
        Json::Object(o) => o.get("content")?.as_str().map(str::to_string),
        _ => None,
    }
}

/// An id field that may be one integer or a list of them (generation_config.json, config.json);
/// a negative, too large or non-integer id is an error naming the file and key, never dropped
/// or wrapped.
fn id_list(v: Option<&Json>, file: &Path, key: &str) -> Result<Vec<u32>, TextError> {
    let id = |x: &Json| {
        x.as_u64().and_then(|x| u32::try_from(x).ok()).ok_or_else(|| TextError::Json {
            path: file.to_path_buf(),
            message: format!("`{key}`: {x} is not a token id (an integer in 0..2^32)"),
        })
    };
    match v {
        None | Some(Json::Null) => Ok(Vec::new()),
        Some(Json::Array(items)) => items.iter().map(id).collect(),
        Some(other) => id(other).map(|x| vec![x]),
    }
}

/// `chat_template` in tokenizer_config.json: a string, or a list of named templates.
fn config_chat_template(v: Option<&Json>) -> Option<String> {
    match v? {
        Json::String(s) => Some(s.clone()),
        Json::Array(items) => items.iter().find_map(|item| {
            (item.get("name")?.as_str()? == "default")
                .then(|| item.get("template")?.as_str().map(str::to_string))
                .flatten()
        }),
        _ => None,
    }
}

fn push_unique(ids: &mut Vec<u32>, id: u32) {
    if !ids.contains(&id) {
        ids.push(id);
    }
}

impl Tokenizer {
    /// Loads `tokenizer.json` and the optional side files of a Hugging Face checkpoint.
    ///
    /// Reads `tokenizer_config.json` (special tokens, `add_bos_token`, chat template),
    /// `chat_template.jinja` / `chat_template.json` (newer checkpoints keep the template there),
    /// `generation_config.json` and `config.json` (end-of-generation and BOS ids).
    pub fn from_hf_dir(dir: &Path) -> Result<Self, TextError> {
        let path = dir.join("tokenizer.json");
        if !path.is_file() {
            return Err(TextError::TokenizerFileNotFound { dir: dir.to_path_buf() });
        }
        let mut inner = tokenizers::Tokenizer::from_file(&path)
            .map_err(|e| TextError::tokenizer(format!("loading {}", path.display()), e))?;
        // transformers ignores the truncation/padding a tokenizer.json may carry unless asked.
        inner.with_truncation(None).map_err(|e| TextError::tokenizer("disabling truncation", e))?;
        inner.with_padding(None);

        let config = read_json_opt(&dir.join("tokenizer_config.json"))?.unwrap_or(Json::Null);
        let (generation_path, config_path) = (dir.join("generation_config.json"), dir.join("config.json"));
        let generation = read_json_opt(&generation_path)?.unwrap_or(Json::Null);
        let model_config = read_json_opt(&config_path)?.unwrap_or(Json::Null);

        let chat_template = match read_text_opt(&dir.join("chat_template.jinja"))? {
            Some(t) => Some(t),
            None => {
                let json_path = dir.join("chat_template.json");
                let from_json = read_json_opt(&json_path)?.and_then(|j| config_chat_template(j.get("chat_template")));
                from_json.or_else(|| config_chat_template(config.get("chat_template")))
            }
        };

        // Does tokenizer.json's post-processor put a token in front? Probe instead of parsing it.
        let probe = |special: bool| {
            inner
                .encode("a", special)
                .map(|e| e.get_ids().to_vec())
                .map_err(|e| TextError::tokenizer("probing the post-processor", e))
        };
        let (with, without) = (probe(true)?, probe(false)?);
        let prepended = (with.len() > without.len() && with[1..].starts_with(&without)).then(|| with[0]);

        let bos_text = token_text(config.get("bos_token"));
        let bos_id = bos_text
            .as_deref()
            .and_then(|t| inner.token_to_id(t))
            .or(id_list(model_config.get("bos_token_id"), &config_path, "bos_token_id")?.first().copied())
            .or(id_list(generation.get("bos_token_id"), &generation_path, "bos_token_id")?.first().copied())
            .or(prepended);
        let bos_token = bos_text.or_else(|| bos_id.and_then(|id| inner.id_to_token(id)));

        let eos_text = token_text(config.get("eos_token"));
        let mut eos_ids = Vec::new();
        if let Some(id) = eos_text.as_deref().and_then(|t| inner.token_to_id(t)) {
            push_unique(&mut eos_ids, id);
        }
        let generation_eos = id_list(generation.get("eos_token_id"), &generation_path, "eos_token_id")?;
        for id in
            generation_eos.into_iter().chain(id_list(model_config.get("eos_token_id"), &config_path, "eos_token_id")?)
        {
            push_unique(&mut eos_ids, id);
        }
        let eos_token = eos_text.or_else(|| eos_ids.first().and_then(|&id| inner.id_to_token(id)));

        let post_adds_bos = bos_id.is_some() && prepended == bos_id;
        let bos_fix = match config.get("add_bos_token").and_then(Json::as_bool) {
            Some(true) if !post_adds_bos && bos_id.is_some() => BosFix::Prepend,
            Some(false) if post_adds_bos => BosFix::Strip,
            _ => BosFix::None,
        };
        let add_bos = match bos_fix {
            BosFix::Prepend => true,
            BosFix::Strip => false,
            BosFix::None => post_adds_bos,
        };

        let vocab_size = inner.get_vocab(true).values().map(|&id| id as usize + 1).max().unwrap_or(0);
        let control_ids = control_ids(&inner);
        Ok(Self {
            inner,
            bos_id,
            eos_ids,
            add_bos,
            bos_fix,
            chat_template,
            bos_token,
            eos_token,
            vocab_size,
            control_ids,
            constraint_env: Default::default(),
        })
    }

    /// Converts a GGUF vocabulary into a tokenizer, as transformers' GGUF loader does.
    ///
    /// `tokenizer.ggml.model` = `llama` (sentencepiece: Gemma or Llama-2 style BPE with byte
    /// fallback) or `gpt2` (byte-level BPE with the pre-tokenizer `tokenizer.ggml.pre` names).
    pub fn from_gguf(metadata: &HashMap<String, gguf_file::Value>) -> Result<Self, TextError> {
        let g = tokenizer_from_gguf(metadata)?;
        Ok(Self {
            constraint_env: Default::default(),
            control_ids: control_ids(&g.tokenizer),
            inner: g.tokenizer,
            bos_id: g.bos_id,
            eos_ids: g.eos_ids,
            add_bos: g.add_bos,
            // BOS is already in the converted tokenizer's post-processor.
            bos_fix: BosFix::None,
            chat_template: g.chat_template,
            bos_token: g.bos_token,
            eos_token: g.eos_token,
            vocab_size: g.vocab_size,
        })
    }

    /// Whether `id` is a control token (special, or markup listed as user-defined), which
    /// generated text leaves out unless asked to keep it.
    pub fn is_control(&self, id: u32) -> bool {
        self.control_ids.contains(&id)
    }

    /// llguidance's parser factory over this vocabulary, for a model with `vocab_size` logits a
    /// row: built once (the token trie and its bias slices; a few hundred milliseconds for a
    /// 262k-token vocabulary) and kept.
    pub fn constraint_factory(
        &self,
        vocab_size: usize,
    ) -> Result<std::sync::Arc<llguidance::ParserFactory>, TextError> {
        if let Some((n, factory)) = self.constraint_env.get() {
            if *n == vocab_size {
                return Ok(factory.clone());
            }
        }
        let specials = super::token_bytes::Specials {
            is_control: &|id| self.is_control(id),
            eos: self.eos_ids().first().copied(),
            bos: self.bos_id(),
        };
        let env = super::token_bytes::tok_env(self.inner(), specials, vocab_size)?;
        let mut factory = llguidance::ParserFactory::new_simple(&env)
            .map_err(|e| TextError::tokenizer("preparing constrained decoding", e))?;
        // Grammar errors come back as values; nothing is written to stderr.
        factory.quiet();
        let factory = std::sync::Arc::new(factory);
        let _ = self.constraint_env.set((vocab_size, factory.clone()));
        Ok(factory)
    }

    /// The format this model writes tool calls in: named (`hermes`, `mistral`, `llama3`), or
    /// detected from `template` or the model's own chat template.
    pub fn tool_call_format(
        &self,
        name: Option<&str>,
        template: Option<&str>,
    ) -> Result<super::ToolCallFormat, TextError> {
        match name {
            Some(n) => super::ToolCallFormat::from_name(n).ok_or_else(|| TextError::InvalidToolCall {
                reason: format!("unknown tool-call format {n:?} (hermes, mistral, llama3)"),
            }),
            None => Ok(super::ToolCallFormat::detect(template.or(self.chat_template.as_deref()).unwrap_or(""))),
        }
    }

    /// The Lark grammar that makes the model call `tools` as `choice` asks, in `format` (None
    /// when the choice needs no constraint: `auto`, `none`). Markup the vocabulary holds as one
    /// control token (`<tool_call>`) is written as that token.
    pub fn tool_call_grammar(
        &self,
        format: super::ToolCallFormat,
        tools: &[serde_json::Value],
        choice: &super::ToolChoice,
        parallel: bool,
    ) -> Result<Option<String>, TextError> {
        let is_token = |m: &str| self.inner.token_to_id(m).is_some_and(|id| self.is_control(id));
        format.grammar(tools, choice, parallel, is_token).map_err(|reason| TextError::InvalidToolCall { reason })
    }

    /// The text and tool calls of generated `ids` (decoded with their control tokens, which
    /// some formats call with).
    pub fn parse_tool_calls(
        &self,
        format: super::ToolCallFormat,
        ids: &[u32],
    ) -> Result<(String, Vec<super::ToolCall>), TextError> {
        Ok(format.parse(&self.decode(ids, false)?))
    }

    /// Reads only the metadata of a GGUF file and converts its vocabulary.
    pub fn from_gguf_file(path: &Path) -> Result<Self, TextError> {
        // The validating reader the weights use: a malformed header is refused, never parsed
        // on trust (an alignment of 0 would divide by zero).
        let content = crate::backend::weights::gguf::read_content(path).map_err(|e| match e {
            crate::backend::CandleError::Io { source, .. } => TextError::Io { path: path.to_path_buf(), source },
            other => TextError::Gguf { path: path.to_path_buf(), message: other.to_string() },
        })?;
        Self::from_gguf(&content.metadata)
    }

    /// Token ids of `text`; with `add_special_tokens`, BOS (and EOS where configured) are added.
    pub fn encode(&self, text: &str, add_special_tokens: bool) -> Result<Vec<u32>, TextError> {
        let encoding =
            self.inner.encode(text, add_special_tokens).map_err(|e| TextError::tokenizer("encoding text", e))?;
        let mut ids = encoding.get_ids().to_vec();
        if add_special_tokens {
            match (self.bos_fix, self.bos_id) {
                (BosFix::Prepend, Some(bos)) => ids.insert(0, bos),
                (BosFix::Strip, Some(bos)) if ids.first() == Some(&bos) => {
                    ids.remove(0);
                }
                _ => {}
            }
        }
        Ok(ids)
    }

    /// The ids and token types of a sentence pair with the tokenizer's special tokens (BERT's
    /// `[CLS] a [SEP] b [SEP]`, types 0 then 1), as transformers' `tokenizer(a, b)` gives them;
    /// with `max_length`, a longer pair is cut longest-first, as its `truncation=True` cuts it.
    pub fn encode_pair(&self, a: &str, b: &str, max_length: Option<usize>) -> Result<(Vec<u32>, Vec<u32>), TextError> {
        let err = |e| TextError::tokenizer("encoding a text pair", e);
        let mut encoding = self.inner.encode((a, b), true).map_err(err)?;
        if let Some(max) = max_length.filter(|&m| encoding.len() > m) {
            // Only an over-long pair pays for a truncating copy of the tokenizer.
            let mut cut = self.inner.clone();
            cut.with_truncation(Some(tokenizers::TruncationParams {
                max_length: max,
                strategy: tokenizers::TruncationStrategy::LongestFirst,
                ..Default::default()
            }))
            .map_err(err)?;
            encoding = cut.encode((a, b), true).map_err(err)?;
        }
        Ok((encoding.get_ids().to_vec(), encoding.get_type_ids().to_vec()))
    }

    /// Text of `ids`; an id outside the vocabulary is an error (transformers drops it, which
    /// silently loses text when a model's embedding has more rows than its tokenizer has tokens).
    pub fn decode(&self, ids: &[u32], skip_special_tokens: bool) -> Result<String, TextError> {
        if let Some(&id) = ids.iter().find(|&&id| id as usize >= self.vocab_size) {
            return Err(TextError::UnknownTokenId { id, vocab_size: self.vocab_size });
        }
        self.inner.decode(ids, skip_special_tokens).map_err(|e| TextError::tokenizer("decoding ids", e))
    }

    /// Number of token ids (highest id + 1, added tokens included).
    pub fn vocab_size(&self) -> usize {
        self.vocab_size
    }

    /// The beginning-of-sequence id, if the model has one.
    pub fn bos_id(&self) -> Option<u32> {
        self.bos_id
    }

    /// Ids that end generation: EOS first, then end-of-turn tokens the model also stops at.
    pub fn eos_ids(&self) -> &[u32] {
        &self.eos_ids
    }

    /// Whether `encode(text, true)` puts BOS in front.
    pub fn add_bos(&self) -> bool {
        self.add_bos
    }

    /// The id of a token text (added tokens included).
    pub fn token_to_id(&self, token: &str) -> Option<u32> {
        self.inner.token_to_id(token)
    }

    /// Why a draft model with tokenizer `draft` cannot propose tokens for a model with this one
    /// (`None` when it can): llama.cpp's rule for speculative decoding — vocabulary sizes at most
    /// 128 apart, the same BOS and EOS, and the same token at every id both have.
    pub fn draft_mismatch(&self, draft: &Tokenizer) -> Option<String> {
        if self.vocab_size.abs_diff(draft.vocab_size) > 128 {
            return Some(format!("vocabularies of {} and {} tokens", self.vocab_size, draft.vocab_size));
        }
        if self.bos_id != draft.bos_id || self.eos_ids.first() != draft.eos_ids.first() {
            return Some(format!(
                "BOS/EOS ids {:?}/{:?} against the draft's {:?}/{:?}",
                self.bos_id,
                self.eos_ids.first(),
                draft.bos_id,
                draft.eos_ids.first()
            ));
        }
        (0..self.vocab_size.min(draft.vocab_size) as u32).find_map(|id| {
            let (a, b) = (self.id_to_token(id), draft.id_to_token(id));
            (a != b).then(|| format!("token {id} is {a:?} here and {b:?} in the draft"))
        })
    }

    /// The text of a token id, in the vocabulary's own spelling.
    pub fn id_to_token(&self, id: u32) -> Option<String> {
        self.inner.id_to_token(id)
    }

    /// The Jinja chat template source, if the model ships one.
    pub fn chat_template(&self) -> Option<&str> {
        self.chat_template.as_deref()
    }

    /// The chat template compiled with this tokenizer's BOS/EOS texts.
    pub fn chat_template_engine(&self) -> Result<ChatTemplate, TextError> {
        let source = self.chat_template.as_deref().ok_or(TextError::NoChatTemplate)?;
        ChatTemplate::new(source, self.bos_token.clone(), self.eos_token.clone())
    }

    /// Renders a conversation through `source` (a Jinja template the caller gives), else through
    /// `compiled` (this tokenizer's template, compiled once by its owner), else through this
    /// tokenizer's own template; the one place that chooses which template renders a chat.
    pub fn render_chat(
        &self,
        messages: &TemplateValue,
        options: &ChatRenderOptions,
        source: Option<&str>,
        compiled: Option<&ChatTemplate>,
    ) -> Result<String, TextError> {
        let own;
        let template = match (source, compiled) {
            (Some(src), _) => {
                own = ChatTemplate::new(src, self.bos_token.clone(), self.eos_token.clone())?;
                &own
            }
            (None, Some(t)) => t,
            (None, None) => {
                own = self.chat_template_engine()?;
                &own
            }
        };
        template.render_conversation(messages, options)
    }

    /// The BOS token's text (what chat templates see as `bos_token`).
    pub fn bos_token(&self) -> Option<&str> {
        self.bos_token.as_deref()
    }

    /// The EOS token's text (what chat templates see as `eos_token`).
    pub fn eos_token(&self) -> Option<&str> {
        self.eos_token.as_deref()
    }

    /// The underlying `tokenizers` tokenizer.
    pub fn inner(&self) -> &tokenizers::Tokenizer {
        &self.inner
    }
}
