//! Errors of the text layer.

use std::path::PathBuf;

/// Everything that can go wrong while loading a tokenizer, tokenizing or rendering a chat template.
///
/// Every message names what was being read or done, so an error surfacing through Python is
/// actionable without a backtrace.
#[derive(Debug, thiserror::Error)]
pub enum TextError {
    /// A metadata key the vocabulary cannot be built without is absent.
    #[error("GGUF metadata key `{key}` is missing; it is needed to build the tokenizer")]
    MissingMetadata {
        /// The missing key.
        key: String,
    },

    /// A metadata key holds a value of the wrong type or an impossible value.
    #[error("GGUF metadata key `{key}` is invalid: {message}")]
    InvalidMetadata {
        /// The offending key.
        key: String,
        /// What is wrong with it.
        message: String,
    },

    /// `tokenizer.ggml.model` names a tokenizer kind we cannot rebuild faithfully.
    #[error(
        "GGUF tokenizer model `{model}` is not supported (supported: `llama` sentencepiece, `gpt2` byte-level BPE)"
    )]
    UnsupportedTokenizerModel {
        /// The value of `tokenizer.ggml.model`.
        model: String,
    },

    /// `tokenizer.ggml.pre` names a pre-tokenizer whose split rules we do not know for certain.
    #[error("GGUF pre-tokenizer `{pre}` (tokenizer.ggml.pre) is not supported; refusing to guess its split rules")]
    UnsupportedPreTokenizer {
        /// The value of `tokenizer.ggml.pre`.
        pre: String,
    },

    /// Tools, a tool choice or a tool-call format that cannot be used.
    #[error("invalid tool call request: {reason}")]
    InvalidToolCall {
        /// What is wrong.
        reason: String,
    },

    /// The `tokenizers` crate failed while building, encoding or decoding.
    #[error("tokenizer error while {context}: {message}")]
    Tokenizer {
        /// What was being done.
        context: String,
        /// The underlying message.
        message: String,
    },

    /// `tokenizer.json` is absent from a Hugging Face checkpoint directory.
    #[error("no tokenizer.json in {}", dir.display())]
    TokenizerFileNotFound {
        /// The directory that was searched.
        dir: PathBuf,
    },

    /// A JSON side file (tokenizer_config.json, config.json, ...) is malformed.
    #[error("cannot parse {}: {message}", path.display())]
    Json {
        /// The file.
        path: PathBuf,
        /// The parser's message.
        message: String,
    },

    /// A token id the tokenizer has no token for (a model whose embedding is larger than its
    /// vocabulary can generate one).
    #[error("token id {id} is outside the tokenizer's vocabulary of {vocab_size} tokens; it has no text")]
    UnknownTokenId {
        /// The id.
        id: u32,
        /// The tokenizer's vocabulary size.
        vocab_size: usize,
    },

    /// A chat template failed to compile or render, or called `raise_exception`.
    #[error("chat template error: {message}")]
    Template {
        /// The template's own message for `raise_exception`, otherwise the engine's.
        message: String,
    },

    /// A chat template was requested but the model ships none.
    #[error(
        "the model has no chat template (neither tokenizer_config.json nor GGUF tokenizer.chat_template); pass \
         one (chat_template=...) or use a chat model"
    )]
    NoChatTemplate,

    /// A file is not a readable GGUF.
    #[error("cannot read GGUF file {}: {message}", path.display())]
    Gguf {
        /// The file.
        path: PathBuf,
        /// The reader's message.
        message: String,
    },

    /// Reading a file failed.
    #[error("cannot read {}: {source}", path.display())]
    Io {
        /// The file.
        path: PathBuf,
        /// The OS error.
        #[source]
        source: std::io::Error,
    },
}

impl TextError {
    /// Wraps an error of the `tokenizers` crate with what we were doing at the time.
    pub(crate) fn tokenizer(context: impl Into<String>, err: impl std::fmt::Display) -> Self {
        TextError::Tokenizer { context: context.into(), message: err.to_string() }
    }
}
