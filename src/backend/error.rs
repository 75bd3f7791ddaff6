//! The candle backend's error: every failure named with its context.

use crate::core::{InterventionError, ObservationError};

/// Everything the candle backend can fail with.
#[derive(Debug, thiserror::Error)]
pub enum CandleError {
    /// The requested device is not in this build or not present.
    #[error("device `{spec}` is not available: {reason}")]
    Device {
        /// The device as requested.
        spec: String,
        /// Why it cannot be used.
        reason: String,
    },
    /// A file of the artifact is missing.
    #[error("{what} not found at {path}")]
    MissingFile {
        /// Which file was looked for.
        what: &'static str,
        /// Where.
        path: String,
    },
    /// A file of the artifact is malformed or truncated.
    #[error("malformed {what} {path}: {reason}")]
    Malformed {
        /// The kind of file.
        what: &'static str,
        /// Its path.
        path: String,
        /// What is wrong.
        reason: String,
    },
    /// The artifact names an architecture this backend does not implement.
    #[error(
        "unsupported architecture `{name}` (this build loads these from {format}: {supported}; \
         candlewick.supported_architectures() lists every family, encoders and image models included)"
    )]
    UnsupportedArchitecture {
        /// The architecture as named in the artifact.
        name: String,
        /// The artifact's format: `config.json` or `GGUF`.
        format: &'static str,
        /// The decoder architectures that load from that format, by the name it uses.
        supported: String,
    },
    /// A configuration value this backend does not implement.
    #[error("unsupported configuration: {what}")]
    UnsupportedConfig {
        /// What is not supported.
        what: String,
    },
    /// A tensor is stored in an element type this backend cannot run.
    #[error("tensor `{tensor}` has type {dtype}, which candlewick cannot run")]
    UnsupportedTensorType {
        /// The tensor's name.
        tensor: String,
        /// Its element type.
        dtype: String,
    },
    /// A metadata key the architecture needs is not in the GGUF file.
    #[error("GGUF metadata key `{key}` is missing")]
    MissingMetadata {
        /// The key.
        key: String,
    },
    /// A part of a split GGUF file (llama.cpp's `gguf-split`: `name-00002-of-00003.gguf` beside
    /// the first) is not where the first part's name says it is.
    #[error("part {part} of {count} of the split GGUF file {first} not found at {path}")]
    MissingSplitPart {
        /// The first part, the file loaded.
        first: String,
        /// The missing part's number, from 1.
        part: usize,
        /// The number of parts the first declares (`split.count`).
        count: usize,
        /// Where the part was looked for.
        path: String,
    },
    /// A later part of a split GGUF file was given where the first is needed: only the first
    /// holds the metadata and names the others (llama.cpp refuses it too).
    #[error("{path} is part {part} of {count} of a split GGUF file; load its first part{}", first_part_hint(.first))]
    NotFirstSplitPart {
        /// The file given.
        path: String,
        /// Its part number, from 1 (`split.no` + 1).
        part: usize,
        /// The number of parts (`split.count`).
        count: usize,
        /// The first part's path, where the file name follows `-%05d-of-%05d.gguf`.
        first: Option<String>,
    },
    /// The parts of a split GGUF file do not make one model: a part of another split, out of
    /// place, a tensor in two parts, or a tensor count other than `split.tensors.count`.
    #[error("split GGUF file {first}: {path} {reason}")]
    SplitMismatch {
        /// The first part, the file loaded.
        first: String,
        /// The part at fault (the first itself for what the parts hold together).
        path: String,
        /// What is wrong.
        reason: String,
    },
    /// A tensor the architecture needs is not in the checkpoint.
    #[error("tensor `{name}` is missing from the checkpoint")]
    MissingTensor {
        /// The tensor's name.
        name: String,
    },
    /// A tensor's shape is not what the configuration implies.
    #[error("tensor `{name}` has shape {found:?}, expected {expected:?}")]
    TensorShape {
        /// The tensor's name.
        name: String,
        /// The shape the configuration implies.
        expected: Vec<usize>,
        /// The shape in the checkpoint.
        found: Vec<usize>,
    },
    /// A token id is outside the vocabulary.
    #[error("token id {token} at input index {index} is out of range for a vocabulary of {vocab_size}")]
    TokenOutOfRange {
        /// The offending id.
        token: u32,
        /// Where in the input it stood.
        index: usize,
        /// The vocabulary size.
        vocab_size: usize,
    },
    /// The step would run past the session's context.
    #[error("context is full: {position} tokens held + {requested} requested > max_context {max_context}")]
    ContextFull {
        /// Tokens already in the cache.
        position: usize,
        /// Tokens in the refused step.
        requested: usize,
        /// The session's context size.
        max_context: usize,
    },
    /// A step would need more memory than the machine has free: refused before allocating.
    #[error("{operation} of {tokens} tokens at position {position} needs about {needed_mib} MiB, but only {available_mib} MiB are free{hint}")]
    OutOfMemory {
        /// The operation refused.
        operation: &'static str,
        /// Tokens in the refused step.
        tokens: usize,
        /// Tokens already in the cache.
        position: usize,
        /// What the step would allocate, in MiB.
        needed_mib: u64,
        /// What the operating system has free, in MiB.
        available_mib: u64,
        /// What to do instead, if anything (starts with "; ").
        hint: String,
    },
    /// A truncate reaching back past what a sliding-window layer's ring kept: the keys a step
    /// there would attend are overwritten (rewind less, to 0, or run the prompt again).
    #[error("cannot truncate to {requested} tokens: the sliding-window layers keep only the latest keys, so from position {position} a rewind reaches back to {earliest} tokens at the earliest (or to 0, which starts over)")]
    WindowRewind {
        /// The length asked for.
        requested: usize,
        /// Tokens held.
        position: usize,
        /// The shortest length above 0 a truncate keeps.
        earliest: usize,
    },
    /// A step, truncation or option the session cannot take.
    #[error("invalid {operation}: {reason}")]
    InvalidInput {
        /// The operation refused.
        operation: &'static str,
        /// Why.
        reason: String,
    },
    /// A decoder step (generation, prefill, decode, tracing, the logit lens) asked of a model
    /// that is a BERT-family encoder: it embeds, and reranks where it has a classification head.
    #[error("{operation} needs a decoder, and this model is a {family} encoder: it embeds (embed) and, with a classification head, reranks (rerank)")]
    EncoderOnly {
        /// The operation refused.
        operation: &'static str,
        /// The encoder's family (`bert`, `xlm-roberta`, ...).
        family: &'static str,
    },
    /// An option given a value it does not take.
    #[error("invalid {argument}=`{value}`: accepted values are {accepted}")]
    InvalidOption {
        /// The option's name, as the caller spells it.
        argument: &'static str,
        /// The value given.
        value: String,
        /// The values it takes.
        accepted: String,
    },
    /// An observation request that the model cannot serve.
    #[error(transparent)]
    Observation(#[from] ObservationError),
    /// An intervention the model cannot apply; none of its list was applied.
    #[error(transparent)]
    Intervention(#[from] InterventionError),
    /// A sparse autoencoder cannot be loaded or attached.
    #[error(transparent)]
    Sae(#[from] SaeError),
    /// A LoRA adapter cannot be loaded, or does not fit this model.
    #[error(transparent)]
    Adapter(#[from] AdapterError),
    /// A tensor operation failed inside candle.
    #[error("{context}: {source}")]
    Candle {
        /// What was being done.
        context: String,
        /// candle's error.
        #[source]
        source: candle_core::Error,
    },
    /// Reading a file failed.
    #[error("cannot read {path}: {source}")]
    Io {
        /// The file.
        path: String,
        /// The OS error.
        #[source]
        source: std::io::Error,
    },
}

/// `NotFirstSplitPart`'s pointer to the first part, where its name is known.
fn first_part_hint(first: &Option<String>) -> String {
    match first {
        Some(first) => format!(", {first}"),
        None => " (its name does not follow `-%05d-of-%05d.gguf`, so which file that is is unknown)".into(),
    }
}

/// Attaches context to candle's errors.
pub(crate) trait CandleContext<T> {
    /// Wraps a candle error with what was being done.
    fn ctx(self, context: impl FnOnce() -> String) -> Result<T, CandleError>;
}

impl<T> CandleContext<T> for candle_core::Result<T> {
    fn ctx(self, context: impl FnOnce() -> String) -> Result<T, CandleError> {
        self.map_err(|source| CandleError::Candle { context: context(), source: without_backtrace(source) })
    }
}

/// candle attaches a backtrace to its errors when RUST_BACKTRACE is set; users get the message.
pub(crate) fn without_backtrace(e: candle_core::Error) -> candle_core::Error {
    match e {
        candle_core::Error::WithBacktrace { inner, .. } => without_backtrace(*inner),
        other => other,
    }
}

/// The backend's result type.
pub type Result<T, E = CandleError> = std::result::Result<T, E>;

/// Why an SAE cannot be loaded or attached; nothing is attached when one is returned.
#[derive(Debug, thiserror::Error)]
pub enum SaeError {
    /// No format this loader reads is at the path.
    #[error("no sparse autoencoder at {path}: expected cfg.json with sae_weights.safetensors (SAELens) or sae.safetensors (sparsify), or params.npz (Gemma Scope)")]
    NotFound {
        /// The path as given.
        path: String,
    },
    /// A file is malformed, or a tensor missing or misshapen.
    #[error("sparse autoencoder {path}: {reason}")]
    Malformed {
        /// The file.
        path: String,
        /// What is wrong.
        reason: String,
    },
    /// The configuration names an encoder or normalisation this loader does not implement.
    #[error("sparse autoencoder {path}: {what} is not supported")]
    Unsupported {
        /// The file.
        path: String,
        /// What.
        what: String,
    },
    /// The file's hook names no point of ours.
    #[error("sparse autoencoder {path}: hook `{hook}` maps to no candlewick point (known: blocks.L.hook_resid_pre, hook_resid_post, hook_mlp_out, hook_attn_out, attn.hook_z)")]
    UnknownHook {
        /// The file.
        path: String,
        /// The hook as written.
        hook: String,
    },
    /// The file names no point and none was given.
    #[error("sparse autoencoder {path} names no point: pass point= (for example point=\"model.layers.6.output\")")]
    NeedsPoint {
        /// The file.
        path: String,
    },
    /// `point=` contradicts the hook the file was trained on.
    #[error("sparse autoencoder {path} was trained on `{file_point}` (hook `{hook}`), not `{given}`")]
    PointMismatch {
        /// The file.
        path: String,
        /// The point given.
        given: String,
        /// The file's hook.
        hook: String,
        /// That hook in our names.
        file_point: String,
    },
    /// The point given is no point of this model, or one an SAE cannot read.
    #[error("sparse autoencoder `{name}`: `{point}` is not a point of this model an SAE can read")]
    BadPoint {
        /// The SAE's name.
        name: String,
        /// The point as given.
        point: String,
    },
    /// The SAE's input width is not the point's.
    #[error("sparse autoencoder `{name}` reads {d_in} values per position, but `{point}` has {width}")]
    WidthMismatch {
        /// The SAE's name.
        name: String,
        /// Its point.
        point: String,
        /// The SAE's `d_in`.
        d_in: usize,
        /// The point's per-position size.
        width: usize,
    },
    /// An SAE of that name is already attached.
    #[error("a sparse autoencoder called `{name}` is already attached (detach it first, or pass another name=)")]
    Duplicate {
        /// The name.
        name: String,
    },
}

/// Why a LoRA adapter cannot be loaded or used; nothing is loaded or changed when one is returned.
#[derive(Debug, thiserror::Error)]
pub enum AdapterError {
    /// No format this loader reads is at the path.
    #[error("no LoRA adapter at {path}: expected a PEFT directory (adapter_config.json + adapter_model.safetensors), an mlx-lm one (adapter_config.json + adapters.safetensors) or a llama.cpp GGUF LoRA (general.type = adapter)")]
    NotFound {
        /// The path as given.
        path: String,
    },
    /// A file is malformed, or a tensor missing or misshapen.
    #[error("LoRA adapter {path}: {reason}")]
    Malformed {
        /// The file.
        path: String,
        /// What is wrong.
        reason: String,
    },
    /// The adapter uses a feature this loader does not implement (DoRA, `modules_to_save`, ...).
    #[error("LoRA adapter {path}: {what} is not supported")]
    Unsupported {
        /// The file.
        path: String,
        /// What.
        what: String,
    },
    /// A module the adapter targets is no linear of this model (another architecture, or a part
    /// adapters cannot reach here, such as MoE experts or embeddings).
    #[error("LoRA adapter {path}: target module `{module}` is not a linear of this model (its linears are named like `{example}`)")]
    UnknownModule {
        /// The file.
        path: String,
        /// The module as the file names it.
        module: String,
        /// One of this model's linears, in the file's naming.
        example: String,
    },
    /// A factor's shape does not fit the base model's linear (an adapter made for another base).
    #[error("LoRA adapter {path}: `{module}` {factor} has shape {got:?}, but this model's linear needs {expected}")]
    Shape {
        /// The file.
        path: String,
        /// The module.
        module: String,
        /// `lora_A` or `lora_B`.
        factor: &'static str,
        /// The shape in the file.
        got: Vec<usize>,
        /// What fits, in words (`[r, 64]`).
        expected: String,
    },
    /// An adapter of that name is already loaded.
    #[error("a LoRA adapter called `{name}` is already loaded (unload it first, or pass another name=)")]
    Duplicate {
        /// The name.
        name: String,
    },
    /// No adapter of that name is loaded.
    #[error("no LoRA adapter called `{name}` is loaded (loaded: {loaded})")]
    Unknown {
        /// The name asked for.
        name: String,
        /// The names loaded, or `none`.
        loaded: String,
    },
    /// The adapter is still in use and cannot be unloaded.
    #[error(
        "LoRA adapter `{name}` is in use by {users} session(s) (set_adapters(None) or finish their requests first)"
    )]
    InUse {
        /// The name.
        name: String,
        /// How many sessions hold it.
        users: usize,
    },
    /// `merge=True` on a linear whose weight is quantized: folding would need a re-quantization
    /// that loses the adapter's small change, so it is run beside the weights instead.
    #[error("LoRA adapter {path}: cannot merge into `{module}`, whose weight is {storage} (merge needs dense weights: load the model as float, or run the adapter beside the weights without merge)")]
    MergeQuantized {
        /// The file.
        path: String,
        /// The module, in the file's naming.
        module: String,
        /// The weight's storage type (`q4_k`, ...).
        storage: String,
    },
    /// `merge=True` while the model's weights are shared with another session (an `Engine`, a
    /// speculative draft's target): changing them would change that session's model under it.
    #[error("cannot merge LoRA adapter `{name}`: the model's weights are shared with {others} other session(s) (close the Engine first)")]
    MergeShared {
        /// The adapter.
        name: String,
        /// How many other holders the weights have.
        others: usize,
    },
    /// A merged adapter is part of the weights and cannot be taken out.
    #[error("LoRA adapter `{name}` was merged into the weights and cannot be unloaded (reload the model)")]
    Merged {
        /// The name.
        name: String,
    },
    /// A scale is not a finite number.
    #[error("LoRA adapter `{name}`: scale {scale} is not a finite number")]
    BadScale {
        /// The adapter.
        name: String,
        /// The scale given.
        scale: f32,
    },
}
