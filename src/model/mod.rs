//! The model layer: a loaded model with its tokenizer, chat template, generation defaults and
//! description — the thing a Rust user holds (the Python `ModelRuntime` wraps exactly this).

mod adapters;
pub mod control_vector;
pub mod embedding;
mod info;
pub mod vision;

use std::path::{Path, PathBuf};
use std::sync::Arc;

pub use adapters::{default_adapter_name, AdapterInfo};
pub use info::ModelInfo;

use crate::backend::weights::quantize::parse_quantize;
use crate::backend::{
    parse_dtype, parse_kv_cache_type, ArtifactFormat, CandleBackend, CandleError, GgufWeights, LoadOptions,
};
use crate::core::{ModelLoadError, ModelRuntime, RuntimeError};
use crate::generation::{
    generate_batch, GenerateOptions, Generation, GenerationError, GenerationResult, PendingPrefill,
};
use crate::text::{ChatRenderOptions, ChatTemplate, TemplateValue, TextError, Tokenizer};

/// The runtime a model layer drives: the candle backend and its session.
pub type Runtime = ModelRuntime<CandleBackend>;

/// Why a model-layer operation failed.
#[derive(Debug, thiserror::Error)]
pub enum ModelError {
    /// The artifact could not be loaded or prepared.
    #[error(transparent)]
    Load(#[from] ModelLoadError<CandleError>),
    /// A backend operation failed (a device that is not there, a bad option).
    #[error(transparent)]
    Backend(#[from] CandleError),
    /// A step was refused or failed.
    #[error(transparent)]
    Runtime(#[from] RuntimeError<CandleError>),
    /// Generation failed.
    #[error(transparent)]
    Generation(#[from] GenerationError<CandleError>),
    /// Tokenization or a chat template failed.
    #[error(transparent)]
    Text(#[from] TextError),
    /// The model has no usable tokenizer, so text cannot be used (token ids still can).
    #[error("this model has no usable tokenizer: {reason}")]
    NoTokenizer {
        /// Why it could not be built.
        reason: String,
    },
    /// A control vector could not be read or does not fit this model.
    #[error(transparent)]
    ControlVector(#[from] control_vector::ControlVectorError),
    /// The draft model cannot propose tokens for this one.
    #[error("the draft model {path} cannot draft for this model: {reason}")]
    DraftModel {
        /// The draft model's path.
        path: String,
        /// What does not match (its tokenizer, usually).
        reason: String,
    },
    /// The model ships no chat template and none was given.
    #[error("this model has no chat template; pass one (chat_template=...) or use a chat model")]
    NoChatTemplate,
    /// The embedding setup could not be read, or an embedding or rerank argument was refused.
    #[error(transparent)]
    Embedding(#[from] embedding::EmbeddingError),
}

/// How to load a model.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ModelOptions {
    /// `cpu`, `cuda[:N]`, `metal[:N]` or `auto`.
    pub device: String,
    /// `f32`, `f16` or `bf16`; `None` keeps a GGUF quantized and runs a checkpoint in float32 on the CPU.
    pub dtype: Option<String>,
    /// Context size of the session; `None` uses the model's trained context.
    pub max_context: Option<usize>,
    /// CPU compute threads; `None` keeps the process's count (by default one per physical core).
    /// Process-wide: the first load fixes it (see `backend::threads`).
    pub threads: Option<usize>,
    /// Quantize matmul weights and embeddings at load: `q8_0`, `q4_k`, ... (see
    /// `backend::weights::quantize::ACCEPTED`); `None` keeps the checkpoint's types.
    pub quantize: Option<String>,
    /// Check that every weight and block scale is finite as it loads (llama.cpp's
    /// `--check-tensors`); a NaN or infinity is then an artifact error naming the tensor.
    pub check_tensors: bool,
    /// How the KV cache holds keys and values: `f16`, `q8_0`, `f32`, `bf16` (llama.cpp's
    /// `-ctk`/`-ctv`); `None`: float16 for a quantized model on the CPU, else the compute dtype.
    pub kv_cache_type: Option<String>,
    /// The most tokens one step of a longer prompt runs (`None`: 512); a smaller chunk lowers
    /// the peak memory of a long prompt, a larger one may prefill faster.
    pub prefill_chunk: Option<usize>,
    /// A smaller model sharing the tokenizer that proposes tokens for speculative decoding
    /// (loaded with the same device, dtype, context, threads, quantization and checks).
    pub draft_model: Option<PathBuf>,
    /// llama.cpp's mmproj GGUF beside a GGUF language model (its vision encoder; docs/vision.md).
    pub mmproj: Option<PathBuf>,
}

impl Default for ModelOptions {
    fn default() -> Self {
        Self {
            device: "auto".into(),
            dtype: None,
            max_context: None,
            threads: None,
            quantize: None,
            check_tensors: true,
            kv_cache_type: None,
            prefill_chunk: None,
            draft_model: None,
            mmproj: None,
        }
    }
}

/// A prompt: text (encoded with the model's special tokens) or token ids.
#[derive(Debug, Clone, PartialEq)]
pub enum Prompt {
    /// Text to encode.
    Text(String),
    /// Token ids, used as they are.
    Ids(Vec<u32>),
}

/// A loaded model: runtime, tokenizer, chat template, defaults and description, owned together.
#[derive(Debug)]
pub struct Model {
    runtime: Runtime,
    tokenizer: Result<Arc<Tokenizer>, String>,
    chat_template: Option<ChatTemplate>,
    defaults: GenerateOptions,
    info: ModelInfo,
    /// The draft model's runtime, when speculative decoding has one (its own session).
    draft: Option<Runtime>,
    /// A vision-language model's processor configuration (what `candlewick.images` reads).
    processor: Option<vision::ProcessorFiles>,
    /// How hidden states become embeddings, read on the first `embed` (shared by forks).
    embedding: Arc<std::sync::Mutex<Option<Arc<embedding::EmbeddingSetup>>>>,
}

impl Model {
    /// Loads a GGUF file or a Hugging Face directory with its tokenizer.
    pub fn load(path: &Path, options: &ModelOptions) -> Result<Self, ModelError> {
        let format = ArtifactFormat::detect(path)?;
        // Before anything computes: the pools are sized at their first use.
        let threads = crate::backend::threads::configure(options.threads)?;
        let dtype = options.dtype.as_deref().map(parse_dtype).transpose()?;
        let quantize = options.quantize.as_deref().map(parse_quantize).transpose()?;
        let kv_cache_type = options.kv_cache_type.as_deref().map(parse_kv_cache_type).transpose()?;
        let backend = CandleBackend::new(&options.device)?;
        let load = LoadOptions {
            dtype,
            max_context: options.max_context,
            quantize,
            skip_tensor_check: !options.check_tensors,
            kv_cache_type,
            prefill_chunk: options.prefill_chunk,
            mmproj: options.mmproj.clone(),
        };
        if options.mmproj.is_some() && format != ArtifactFormat::Gguf {
            return Err(ModelError::Backend(CandleError::InvalidOption {
                argument: "mmproj",
                value: path.display().to_string(),
                accepted:
                    "an mmproj file beside a GGUF language model (a Hugging Face directory holds its own vision tower)"
                        .into(),
            }));
        }
        let (tokenizer, runtime) = match format {
            // The tokenizer first: its conversion's temporaries are freed (and handed back to the
            // OS) before the weights arrive, so the two never add up in the peak resident size.
            ArtifactFormat::HuggingFace => {
                (load_tokenizer(|| Tokenizer::from_hf_dir(path)), ModelRuntime::load(backend, path, &load)?)
            }
            ArtifactFormat::Gguf => {
                // One read of the header serves the tokenizer and the weights.
                let artifact = |source| ModelLoadError::Artifact { path: path.display().to_string(), source };
                let mut weights = GgufWeights::open(path, dtype.is_some() || quantize.is_some()).map_err(artifact)?;
                let vocabulary = weights.take_tokenizer_metadata();
                // The tokenizer's conversion is mostly one thread's work (the `tokenizers` crate's
                // BPE builder): the weights load beside it. Gemma 3 270M's 262k vocabulary takes
                // longer to convert than its weights take to read and repack.
                std::thread::scope(|s| {
                    let weights = s.spawn(|| -> Result<_, ModelError> {
                        let config = backend.gguf_config(path, weights, &load).map_err(artifact)?;
                        Ok(ModelRuntime::prepare(backend, config)?)
                    });
                    // The vocabulary is freed with the closure, before `load_tokenizer` trims the heap.
                    let tokenizer = load_tokenizer(move || Tokenizer::from_gguf(&vocabulary));
                    // A panic while loading re-raises here, where PyO3 turns it into an exception.
                    let runtime = weights.join().unwrap_or_else(|panic| std::panic::resume_unwind(panic));
                    runtime.map(|runtime| (tokenizer, runtime))
                })?
            }
        };
        let mut info = ModelInfo::describe(&runtime, path, format, threads);
        // A template that does not compile is reported when chat is used, not at load.
        let chat_template = tokenizer.as_ref().ok().and_then(|t| t.chat_template_engine().ok());
        let draft = match &options.draft_model {
            Some(draft_path) => {
                let draft = Self::load(draft_path, &ModelOptions { draft_model: None, ..options.clone() })?;
                let mismatch =
                    |reason: String| ModelError::DraftModel { path: draft_path.display().to_string(), reason };
                match (&tokenizer, draft.tokenizer()) {
                    (Ok(ours), Ok(theirs)) => ours.draft_mismatch(theirs).map_or(Ok(()), |r| Err(mismatch(r)))?,
                    _ => return Err(mismatch("both models need a tokenizer".into())),
                }
                info.draft_model = Some(draft_path.display().to_string());
                Some(draft.runtime)
            }
            None => None,
        };
        let processor = match (format, runtime.session().decoder().vision()) {
            (ArtifactFormat::HuggingFace, Some(_)) => Some(vision::ProcessorFiles::from_hf_dir(path)?),
            (ArtifactFormat::Gguf, Some(v)) => {
                // The mmproj file does not name the image token: the language model's tokenizer does.
                let token = match v.config().family {
                    crate::backend::config::vision::VisionFamily::Gemma3 => "<image_soft_token>",
                    crate::backend::config::vision::VisionFamily::Llava
                    | crate::backend::config::vision::VisionFamily::Idefics3 => "<image>",
                };
                if let Some(id) = tokenizer.as_ref().ok().and_then(|t| t.token_to_id(token)) {
                    v.set_image_token_id(id);
                }
                Some(vision::ProcessorFiles::from_mmproj(v.config()))
            }
            _ => None,
        };
        Ok(Self {
            runtime,
            tokenizer,
            chat_template,
            defaults: GenerateOptions::default(),
            info,
            draft,
            processor,
            embedding: Default::default(),
        })
    }

    /// A second model over the same weights (no copy: only a new KV cache) whose session
    /// starts as a copy of this one's tokens, cache and kept interventions.
    pub fn fork(&self) -> Result<Self, ModelError> {
        self.with_runtime(self.runtime.fork()?)
    }

    /// A second model over the same weights with an empty session and this one's kept edits.
    pub fn fork_empty(&self) -> Result<Self, ModelError> {
        self.with_runtime(self.runtime.fork_empty()?)
    }

    /// This model's tokenizer, template, defaults, description and draft model (with an empty
    /// session of its own) around another runtime.
    fn with_runtime(&self, runtime: Runtime) -> Result<Self, ModelError> {
        Ok(Self {
            runtime,
            tokenizer: self.tokenizer.clone(),
            chat_template: self.chat_template.clone(),
            defaults: self.defaults.clone(),
            info: self.info.clone(),
            draft: self.draft.as_ref().map(Runtime::fork_empty).transpose()?,
            processor: self.processor.clone(),
            embedding: self.embedding.clone(),
        })
    }

    /// The runtime (backend and session).
    pub fn runtime(&self) -> &Runtime {
        &self.runtime
    }

    /// The runtime, for stepping.
    pub fn runtime_mut(&mut self) -> &mut Runtime {
        &mut self.runtime
    }

    /// The tokenizer, or why there is none.
    pub fn tokenizer(&self) -> Result<&Arc<Tokenizer>, ModelError> {
        self.tokenizer.as_ref().map_err(|reason| ModelError::NoTokenizer { reason: reason.clone() })
    }

    /// The model's own chat template, compiled once (None when it ships none, or one that does
    /// not compile: using it then reports why).
    pub fn chat_template(&self) -> Option<&ChatTemplate> {
        self.chat_template.as_ref()
    }

    /// The model's description.
    pub fn info(&self) -> &ModelInfo {
        &self.info
    }

    /// The generation options used where a caller sets none (llama-cpp-python's defaults).
    pub fn defaults(&self) -> &GenerateOptions {
        &self.defaults
    }

    /// The token ids of a prompt.
    pub fn prompt_ids(&self, prompt: &Prompt) -> Result<Vec<u32>, ModelError> {
        match prompt {
            Prompt::Text(text) => Ok(self.tokenizer()?.encode(text, true)?),
            Prompt::Ids(ids) => Ok(ids.clone()),
        }
    }

    /// Renders a conversation through `template` (a Jinja source) or else the model's own chat
    /// template, with transformers' `apply_chat_template` options.
    pub fn render_chat(
        &self,
        messages: &TemplateValue,
        options: &ChatRenderOptions,
        template: Option<&str>,
    ) -> Result<String, ModelError> {
        self.tokenizer()?.render_chat(messages, options, template, self.chat_template.as_ref()).map_err(|e| match e {
            TextError::NoChatTemplate => ModelError::NoChatTemplate,
            e => ModelError::Text(e),
        })
    }

    /// The token ids of a conversation ending in an assistant turn's header: the template writes
    /// the special tokens itself, as transformers' `apply_chat_template` does.
    pub fn chat_ids(&self, messages: &TemplateValue, template: Option<&str>) -> Result<Vec<u32>, ModelError> {
        let options = ChatRenderOptions { add_generation_prompt: true, ..ChatRenderOptions::default() };
        let text = self.render_chat(messages, &options, template)?;
        Ok(self.tokenizer()?.encode(&text, false)?)
    }

    /// `chat_ids` with one more template variable (`tools`, `documents`, ...).
    pub fn chat_ids_with(
        &self,
        messages: &TemplateValue,
        template: Option<&str>,
        extra: Option<(&str, TemplateValue)>,
    ) -> Result<Vec<u32>, ModelError> {
        let extra = extra.map(|(k, v)| TemplateValue::map(vec![(k.to_owned(), v)]));
        let options = ChatRenderOptions { add_generation_prompt: true, extra, ..ChatRenderOptions::default() };
        let text = self.render_chat(messages, &options, template)?;
        Ok(self.tokenizer()?.encode(&text, false)?)
    }

    /// Reads a llama.cpp control vector and adds its edits to the kept interventions (returned).
    pub fn load_control_vector(
        &mut self,
        path: &Path,
        scale: f32,
        layer_range: Option<(usize, usize)>,
    ) -> Result<Vec<crate::core::Intervention>, ModelError> {
        let edits = control_vector::load(path, scale, layer_range, self.info.hidden_size, self.info.num_layers)?;
        let mut kept = self.runtime.interventions();
        kept.extend(edits.iter().cloned());
        self.runtime.set_interventions(kept)?;
        Ok(edits)
    }

    /// Starts a generation from `prompt` on this model's session.
    pub fn start_generation(&mut self, prompt: &[u32], options: GenerateOptions) -> Result<Generation, ModelError> {
        let tokenizer = Arc::clone(self.tokenizer()?);
        let choice = options.adapters.clone();
        Ok(self.with_adapters(choice.as_ref(), |m| Generation::start(&mut m.runtime, tokenizer, prompt, options))??)
    }

    /// Begins a generation from `prompt` whose prompt is prefilled a chunk at a time
    /// (`PendingPrefill::advance`).
    pub fn begin_generation(&mut self, prompt: &[u32], options: GenerateOptions) -> Result<PendingPrefill, ModelError> {
        let tokenizer = Arc::clone(self.tokenizer()?);
        let choice = options.adapters.clone();
        Ok(self.with_adapters(choice.as_ref(), |m| Generation::begin(&mut m.runtime, tokenizer, prompt, options))??)
    }

    /// Whether speculative decoding has a draft model here.
    pub fn has_draft_model(&self) -> bool {
        self.draft.is_some()
    }

    /// One step of `generation` on this model's session, with the draft model proposing tokens
    /// when there is one (`Generation::step_with`).
    pub fn step_generation(&mut self, generation: &mut Generation) -> Result<String, GenerationError<CandleError>> {
        let choice = generation.adapters().cloned();
        self.with_generation_adapters(choice.as_ref(), |m| generation.step_with(&mut m.runtime, m.draft.as_mut()))
    }

    /// Runs `generation` to the end on this model's session (`Generation::run_with`).
    pub fn run_generation(
        &mut self,
        generation: Generation,
        on_text: impl FnMut(&str),
        interrupted: impl FnMut() -> bool,
    ) -> Result<(GenerationResult, bool), GenerationError<CandleError>> {
        let choice = generation.adapters().cloned();
        self.with_generation_adapters(choice.as_ref(), |m| {
            generation.run_with(&mut m.runtime, m.draft.as_mut(), on_text, interrupted)
        })
    }

    /// Generates from `prompt` to the end.
    pub fn generate(&mut self, prompt: &Prompt, options: GenerateOptions) -> Result<GenerationResult, ModelError> {
        let ids = self.prompt_ids(prompt)?;
        let generation = self.start_generation(&ids, options)?;
        let (result, _) = self.run_generation(generation, |_| {}, || false)?;
        Ok(result)
    }
}

impl Model {
    /// Generates from every prompt at once: each runs on its own session over the shared weights
    /// (with this model's kept interventions) and unfinished ones decode together in one
    /// batched step. This model's own session is left as it was.
    pub fn generate_batch(
        &self,
        prompts: &[Prompt],
        options: GenerateOptions,
    ) -> Result<Vec<GenerationResult>, ModelError> {
        let ids = prompts.iter().map(|p| self.prompt_ids(p)).collect::<Result<Vec<_>, _>>()?;
        let mut runtimes = Vec::with_capacity(ids.len());
        let active = options.adapters.as_ref().map(|c| self.resolve_adapters(c)).transpose()?;
        for _ in &ids {
            let rt = self.runtime.fork_empty()?;
            if let Some(active) = &active {
                rt.session().set_adapters(active.clone())?;
            }
            runtimes.push(rt);
        }
        let tokenizer = Arc::clone(self.tokenizer()?);
        let options = vec![options; ids.len()];
        Ok(generate_batch(&mut runtimes, tokenizer, &ids, options)?)
    }
}

/// The tokenizer that goes with an artifact: tokenizer.json beside a checkpoint, or the GGUF's vocabulary.
fn load_tokenizer(build: impl FnOnce() -> Result<Tokenizer, TextError>) -> Result<Arc<Tokenizer>, String> {
    let loaded = build();
    crate::memory::release_freed_memory();
    loaded.map(Arc::new).map_err(|e| e.to_string())
}
