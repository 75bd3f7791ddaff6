//! The top of the backend: `CandleBackend` as the contract's `BackendProvider` and
//! `ModelLoadingBackend`. It reads an artifact's config and weights, builds the decoder and hands
//! it to a new session; nothing below it knows it exists.

use std::path::Path;
use std::sync::Arc;

use candle_core::quantized::GgmlDType;
use candle_core::{DType, Tensor};

use super::config::encoder::EncoderConfig;
use super::config::metadata::Metadata;
use super::config::vision::VisionConfig;
use super::config::ArchConfig;
use super::decoder::Decoder;
use super::device::{self, CandleBackend};
use super::encoder::Encoder;
use super::error::{CandleError, Result};
use super::kv_cache::KvType;
use super::session::{CandleSession, PREFILL_CHUNK};
use super::vision::VisionModel;
use super::weights::gguf::GgufWeights;
use super::weights::names::Naming;
use super::weights::relayout;
use super::weights::safetensors::SafetensorsWeights;
use super::weights::{WeightLoader, WeightSource};
use crate::core::{
    BackendDescriptor, BackendProvider, DeviceCapabilities, DeviceDescriptor, ModelLoadingBackend, PreparedModel,
    SessionCapabilities,
};

/// How to load an artifact.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct LoadOptions {
    /// Element type to compute in; `None` keeps the checkpoint's (float32 on the CPU for half types).
    pub dtype: Option<DType>,
    /// Context size of the session; `None` uses the model's trained context.
    pub max_context: Option<usize>,
    /// Quantize the matmul weights and embeddings to this type at load (a GGUF is de-quantized first).
    pub quantize: Option<GgmlDType>,
    /// Skip the check that every weight and block scale is finite (llama.cpp's `--check-tensors`,
    /// which candlewick runs by default).
    pub skip_tensor_check: bool,
    /// How the KV cache holds keys and values (llama.cpp's `-ctk`/`-ctv`); `None`: float16 for a
    /// quantized model on the CPU, the activations' dtype otherwise.
    pub kv_cache_type: Option<KvType>,
    /// The most tokens one step of a longer prompt runs (its activations and attention scores
    /// are one chunk's); `None`: `PREFILL_CHUNK`.
    pub prefill_chunk: Option<usize>,
    /// llama.cpp's mmproj GGUF beside a GGUF language model: its vision encoder and projector.
    pub mmproj: Option<std::path::PathBuf>,
}

/// Parses a KV cache type: `f32`, `f16`, `bf16` or `q8_0`.
pub fn parse_kv_cache_type(s: &str) -> Result<KvType> {
    KvType::parse(s).ok_or_else(|| CandleError::InvalidOption {
        argument: "kv_cache_type",
        value: s.to_owned(),
        accepted: KvType::ACCEPTED.into(),
    })
}

/// Parses `f32`, `f16`, `bf16` (and their long names).
pub fn parse_dtype(s: &str) -> Result<DType> {
    Ok(match s.to_ascii_lowercase().as_str() {
        "f32" | "float32" | "float" => DType::F32,
        "f16" | "float16" | "half" => DType::F16,
        "bf16" | "bfloat16" => DType::BF16,
        other => {
            return Err(CandleError::InvalidOption {
                argument: "dtype",
                value: other.to_owned(),
                accepted: "f32, f16, bf16".into(),
            })
        }
    })
}

/// Which kind of artifact a model came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ArtifactFormat {
    /// A Hugging Face directory of safetensors.
    HuggingFace,
    /// A GGUF file.
    Gguf,
}

impl ArtifactFormat {
    /// The format of the artifact at `path`: a directory is a Hugging Face checkpoint, a file GGUF.
    pub fn detect(path: &Path) -> Result<Self> {
        if path.is_dir() {
            Ok(Self::HuggingFace)
        } else if path.exists() {
            Ok(Self::Gguf)
        } else {
            Err(CandleError::MissingFile { what: "model artifact", path: path.display().to_string() })
        }
    }

    /// The format's name: `huggingface` or `gguf`.
    pub fn name(self) -> &'static str {
        match self {
            Self::HuggingFace => "huggingface",
            Self::Gguf => "gguf",
        }
    }
}

/// Everything needed to prepare a model: its architecture, its weights and how to run them.
pub struct CandleModelConfig {
    /// The architecture.
    pub arch: ArchConfig,
    /// Where the tensors come from.
    pub weights: Box<dyn WeightSource>,
    /// How the format names tensors.
    pub naming: Naming,
    /// The element type activations run in.
    pub dtype: DType,
    /// The session's context size.
    pub max_context: usize,
    /// The artifact's format.
    pub format: ArtifactFormat,
    /// The block type to quantize matmul weights and embeddings to at load, if any.
    pub quantize: Option<GgmlDType>,
    /// How the KV cache holds keys and values; `None`: the decoder's default.
    pub kv_cache_type: Option<KvType>,
    /// The most tokens one step of its sessions runs.
    pub prefill_chunk: usize,
    /// The vision encoder of a vision-language model, and where its tensors come from when not
    /// from `weights` (llama.cpp's mmproj file).
    pub vision: Option<(VisionConfig, Option<(Box<dyn WeightSource>, Naming)>)>,
    /// A BERT-family encoder: the model is it, and `arch` only describes its stand-in decoder.
    pub encoder: Option<EncoderConfig>,
}

/// A decoder ready to run, with the context its session will get; sessions share its weights.
#[derive(Debug, Clone)]
pub struct CandleModel {
    decoder: Arc<Decoder>,
    max_context: usize,
    prefill_chunk: usize,
}

impl BackendProvider for CandleBackend {
    type ModelConfig = CandleModelConfig;
    type Model = CandleModel;
    type Session = CandleSession;
    type Error = CandleError;

    fn descriptor(&self) -> BackendDescriptor {
        BackendDescriptor { name: "candle".into(), device: device::describe(self.device()) }
    }

    fn devices(&self) -> Result<Vec<(DeviceDescriptor, DeviceCapabilities)>> {
        Ok(device::available_devices())
    }

    fn prepare_model(&self, config: CandleModelConfig) -> Result<PreparedModel<CandleModel>> {
        let loader =
            WeightLoader::new(config.weights.as_ref(), config.dtype, self.device()).quantizing(config.quantize);
        let mut decoder = match config.encoder {
            Some(encoder) => {
                Decoder::around_encoder(config.arch, Encoder::load(encoder, &loader, config.naming)?, config.dtype)?
            }
            None => Decoder::load(config.arch, &loader, config.naming)?,
        };
        if matches!(config.naming, Naming::Gguf) {
            decoder.set_embedding_dense(gguf_embedding_dense(&loader, decoder.config().hidden_size)?);
        }
        if let Some((vision, source)) = config.vision {
            // The encoder runs dense in float32 (or the requested dtype): quantization at load
            // is for the decoder's matmuls, as llama.cpp's mmproj is converted on its own.
            let model = match &source {
                Some((weights, naming)) => VisionModel::load(
                    vision,
                    &WeightLoader::new(weights.as_ref(), config.dtype, self.device()),
                    *naming,
                )?,
                None => VisionModel::load(
                    vision,
                    &WeightLoader::new(config.weights.as_ref(), config.dtype, self.device()),
                    config.naming,
                )?,
            };
            decoder.set_vision(model);
        }
        if let Some(ty) = config.kv_cache_type {
            decoder.set_cache_type(ty)?;
        }
        // Every capability below is implemented by CandleSession for every decoder.
        Ok(PreparedModel::new(
            CandleModel {
                decoder: Arc::new(decoder),
                max_context: config.max_context,
                prefill_chunk: config.prefill_chunk,
            },
            SessionCapabilities::ALL,
        ))
    }

    fn create_session(&self, model: PreparedModel<CandleModel>) -> Result<CandleSession> {
        let (model, caps) = model.into_parts();
        Ok(CandleSession::new(model.decoder, model.max_context, model.prefill_chunk, caps))
    }
}

impl ModelLoadingBackend for CandleBackend {
    type LoadOptions = LoadOptions;

    fn load_config(&self, artifact: &Path, options: &LoadOptions) -> Result<CandleModelConfig> {
        match ArtifactFormat::detect(artifact)? {
            ArtifactFormat::HuggingFace => self.load_hf_dir(artifact, options),
            ArtifactFormat::Gguf => self.load_gguf(artifact, options),
        }
    }
}

impl CandleBackend {
    fn load_hf_dir(&self, dir: &Path, options: &LoadOptions) -> Result<CandleModelConfig> {
        let config_path = dir.join("config.json");
        if !config_path.is_file() {
            return Err(CandleError::MissingFile { what: "config.json", path: config_path.display().to_string() });
        }
        let text = std::fs::read_to_string(&config_path)
            .map_err(|source| CandleError::Io { path: config_path.display().to_string(), source })?;
        if let Some(encoder) = super::config::encoder::from_hf(&text, &config_path.display().to_string())? {
            return self.load_encoder_dir(dir, encoder, options);
        }
        let mut arch = super::config::hf::parse_config(&text, &config_path.display().to_string())?;
        let vision = super::config::vision::from_hf(&text, arch.hidden_size, &config_path.display().to_string())?;
        let mut weights = SafetensorsWeights::open_dir(dir)?;
        weights.set_check_tensors(!options.skip_tensor_check);
        let prefix = Naming::HuggingFace.layer_prefix(arch.architecture).trim_end_matches("layers.");
        if prefix == "model." && weights.prefix_bare_names(prefix) && weights.shape("lm_head.weight").is_none() {
            // A base model saved alone (an embedding model) has no output projection; its logits
            // are never what it is for, so the embedding table stands in for one.
            arch.tie_word_embeddings = true;
        }
        let stored = weights.dominant_dtype().unwrap_or(DType::F32);
        let weights = super::weights::prefixed::renamed(relayout::for_architecture(weights, &arch));
        check_no_extra_layers(
            &weights.names(),
            arch.num_layers(),
            Naming::HuggingFace.layer_prefix(arch.architecture),
            &config_path.display().to_string(),
        )?;
        let dtype = self.choose_dtype(options.dtype, stored);
        let max_context = options.max_context.unwrap_or(arch.max_position_embeddings);
        validate_context(max_context)?;
        Ok(CandleModelConfig {
            arch,
            weights,
            naming: Naming::HuggingFace,
            dtype,
            max_context,
            format: ArtifactFormat::HuggingFace,
            quantize: options.quantize,
            kv_cache_type: options.kv_cache_type,
            prefill_chunk: prefill_chunk(options)?,
            vision: vision.map(|v| (v, None)),
            encoder: None,
        })
    }

    /// A BERT-family encoder's directory: the encoder's weights under their own names, and a
    /// stand-in decoder description whose context is the encoder's positions.
    fn load_encoder_dir(&self, dir: &Path, encoder: EncoderConfig, options: &LoadOptions) -> Result<CandleModelConfig> {
        let mut weights = SafetensorsWeights::open_dir(dir)?;
        weights.set_check_tensors(!options.skip_tensor_check);
        let stored = weights.dominant_dtype().unwrap_or(DType::F32);
        let max_context = options.max_context.unwrap_or(encoder.max_tokens()).min(encoder.max_tokens());
        validate_context(max_context)?;
        Ok(CandleModelConfig {
            arch: encoder.stand_in(),
            weights: Box::new(weights),
            naming: Naming::HuggingFace,
            dtype: self.choose_dtype(options.dtype, stored),
            max_context,
            format: ArtifactFormat::HuggingFace,
            quantize: options.quantize,
            kv_cache_type: options.kv_cache_type,
            prefill_chunk: prefill_chunk(options)?,
            vision: None,
            encoder: Some(encoder),
        })
    }

    fn load_gguf(&self, path: &Path, options: &LoadOptions) -> Result<CandleModelConfig> {
        // Without a dtype the weights stay quantized and activations run in float32; a dtype
        // de-quantizes every weight at load (f32 for exact comparison with a reference). Quantizing
        // at load starts from de-quantized weights, as llama-quantize --allow-requantize does.
        let dequantize = options.dtype.is_some() || options.quantize.is_some();
        self.gguf_config(path, GgufWeights::open(path, dequantize)?, options)
    }

    /// The configuration of an opened GGUF file, whose header the caller may have read the
    /// tokenizer from first (one read of the header serves both).
    pub fn gguf_config(
        &self,
        path: &Path,
        mut weights: GgufWeights,
        options: &LoadOptions,
    ) -> Result<CandleModelConfig> {
        let md = Metadata::new(weights.metadata());
        let embed = weights
            .shape("token_embd.weight")
            .ok_or_else(|| CandleError::MissingTensor { name: "token_embd.weight".into() })?;
        let vocab_size = embed.first().copied().unwrap_or(0);
        let source = path.display().to_string();
        if let Some(encoder) = super::config::encoder::from_gguf(&md, vocab_size, &|t| weights.shape(t), &source)? {
            let max_context = options.max_context.unwrap_or(encoder.max_tokens()).min(encoder.max_tokens());
            validate_context(max_context)?;
            weights.drop_vocabulary();
            weights.set_check_tensors(!options.skip_tensor_check);
            return Ok(CandleModelConfig {
                arch: encoder.stand_in(),
                weights: Box::new(weights),
                naming: Naming::Gguf,
                dtype: options.dtype.unwrap_or(DType::F32),
                max_context,
                format: ArtifactFormat::Gguf,
                quantize: options.quantize,
                kv_cache_type: options.kv_cache_type,
                prefill_chunk: prefill_chunk(options)?,
                vision: None,
                encoder: Some(encoder),
            });
        }
        let n_tokens = weights.vocabulary_len();
        let arch =
            super::config::gguf::parse_config(&md, &|t| weights.shape(t).is_some(), vocab_size, n_tokens, &source)?;
        check_no_extra_layers(&weights.names(), arch.num_layers(), "blk.", &source)?;
        let vision = match &options.mmproj {
            Some(mmproj) => Some(self.mmproj(mmproj, arch.hidden_size, options)?),
            None => None,
        };
        let max_context = options.max_context.unwrap_or(arch.max_position_embeddings);
        validate_context(max_context)?;
        // The vocabulary has served the configuration's check; tens of MB not to hold while
        // the weights arrive.
        weights.drop_vocabulary();
        weights.set_check_tensors(!options.skip_tensor_check);
        Ok(CandleModelConfig {
            arch,
            weights: Box::new(weights),
            naming: Naming::Gguf,
            dtype: options.dtype.unwrap_or(DType::F32),
            max_context,
            format: ArtifactFormat::Gguf,
            quantize: options.quantize,
            kv_cache_type: options.kv_cache_type,
            prefill_chunk: prefill_chunk(options)?,
            vision,
            encoder: None,
        })
    }

    /// The vision configuration and weights of llama.cpp's mmproj file (its blocks de-quantized
    /// as they load: the encoder runs dense).
    #[allow(clippy::type_complexity)]
    fn mmproj(
        &self,
        path: &Path,
        text_hidden: usize,
        options: &LoadOptions,
    ) -> Result<(VisionConfig, Option<(Box<dyn WeightSource>, Naming)>)> {
        let mut weights = GgufWeights::open(path, true)?;
        weights.set_check_tensors(!options.skip_tensor_check);
        let md = Metadata::new(weights.metadata());
        let config = super::config::vision::from_mmproj(&md, text_hidden, &path.display().to_string())?;
        Ok((config, Some((Box::new(weights), Naming::Gguf))))
    }

    /// The requested dtype, else the checkpoint's; half types run as float32 on the CPU unless asked for.
    fn choose_dtype(&self, requested: Option<DType>, stored: DType) -> DType {
        match requested {
            Some(d) => d,
            None if self.device().is_cpu() => DType::F32,
            None => stored,
        }
    }
}

/// The largest context a session takes: llama.cpp counts positions in 32 bits too, and no
/// machine holds the cache of more.
pub const MAX_CONTEXT_LIMIT: usize = u32::MAX as usize;

/// The chunk `options` asks for: at least one token.
fn prefill_chunk(options: &LoadOptions) -> Result<usize> {
    match options.prefill_chunk {
        None => Ok(PREFILL_CHUNK),
        Some(0) => Err(CandleError::InvalidOption {
            argument: "prefill_chunk",
            value: "0".into(),
            accepted: "a number of tokens from 1".into(),
        }),
        Some(n) => Ok(n),
    }
}

fn validate_context(max_context: usize) -> Result<()> {
    if max_context == 0 || max_context > MAX_CONTEXT_LIMIT {
        return Err(CandleError::InvalidOption {
            argument: "max_context",
            value: max_context.to_string(),
            accepted: format!("token counts from 1 to {MAX_CONTEXT_LIMIT}"),
        });
    }
    Ok(())
}

/// Refuses a checkpoint holding layers past the configured count: transformers warns about
/// unused weights, and a `num_hidden_layers` set too low would otherwise run a truncated model.
fn check_no_extra_layers(names: &[String], n_layers: usize, prefix: &str, source: &str) -> Result<()> {
    let extra = names.iter().find(|name| {
        let index = name.strip_prefix(prefix).and_then(|rest| rest.split('.').next());
        index.and_then(|i| i.parse::<usize>().ok()).is_some_and(|i| i >= n_layers)
    });
    match extra {
        Some(name) => Err(CandleError::Malformed {
            what: "checkpoint",
            path: source.to_owned(),
            reason: format!("tensor `{name}` belongs to a layer past the {n_layers} the configuration declares"),
        }),
        None => Ok(()),
    }
}

/// The dense layers llama.cpp's converter writes after an embedding model's pooling
/// (`--sentence-transformers-dense-modules`: EmbeddingGemma's `2_Dense` as `dense_2`, `3_Dense` as
/// `dense_3`, weights only, as its graph applies them: no bias, no activation), each `[out, in]`
/// and chained from the hidden width back to it, as llama.cpp requires.
fn gguf_embedding_dense(w: &WeightLoader<'_>, hidden: usize) -> Result<Vec<Tensor>> {
    let mut out = Vec::new();
    let mut width = hidden;
    for name in ["dense_2.weight", "dense_3.weight"] {
        let Some(shape) = w.shape(name) else { continue };
        let [rows, cols] = shape[..] else {
            return Err(CandleError::TensorShape { name: name.into(), expected: vec![0, width], found: shape });
        };
        if cols != width {
            return Err(CandleError::TensorShape { name: name.into(), expected: vec![rows, width], found: shape });
        }
        out.push(w.dense_f32(name, &[rows, cols])?);
        width = rows;
    }
    if width != hidden {
        return Err(CandleError::UnsupportedConfig {
            what: format!("dense layers ending at width {width}, not the model's {hidden} (llama.cpp requires it)"),
        });
    }
    Ok(out)
}
