//! The description the one vision encoder is parameterised by (DESIGN §13): a SigLIP or CLIP
//! stack, which of its layers the projector reads, and the projector that maps an image's
//! patches into the decoder's embedding space.

use serde_json::Value;

use crate::backend::error::{CandleError, Result};

/// The vision-language families the runtime takes images for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum VisionFamily {
    /// Gemma 3 (`Gemma3ForConditionalGeneration`): SigLIP, the pooled projector, bidirectional
    /// attention over each image's tokens in the decoder.
    Gemma3,
    /// LLaVA-1.5 (`LlavaForConditionalGeneration`): CLIP, a two-layer MLP projector.
    Llava,
}

impl VisionFamily {
    /// The `model_type` of the family's config.json (what `supported_architectures(images=True)` lists).
    pub fn name(self) -> &'static str {
        match self {
            Self::Gemma3 => "gemma3",
            Self::Llava => "llava",
        }
    }

    /// Every family, in the order `supported_architectures` lists them.
    pub const ALL: [VisionFamily; 2] = [Self::Gemma3, Self::Llava];
}

/// The vision MLP's activation.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum VisionActivation {
    /// GELU with the tanh approximation (SigLIP's `gelu_pytorch_tanh`).
    GeluTanh,
    /// GELU with erf (`gelu`).
    Gelu,
    /// CLIP's `quick_gelu`: x · sigmoid(1.702 x).
    QuickGelu,
}

impl VisionActivation {
    /// Parses transformers' `hidden_act` names.
    pub fn parse(name: &str, field: &str, path: &str) -> Result<Self> {
        Ok(match name {
            "gelu_pytorch_tanh" | "gelu_new" | "gelu_fast" => Self::GeluTanh,
            "gelu" => Self::Gelu,
            "quick_gelu" => Self::QuickGelu,
            other => {
                return Err(CandleError::UnsupportedConfig {
                    what: format!("{path}: {field} = {other:?} (accepted: gelu_pytorch_tanh, gelu, quick_gelu)"),
                })
            }
        })
    }
}

/// The projector from the encoder's width into the decoder's.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum ProjectorConfig {
    /// Gemma 3: average-pool the patch grid to `tokens_per_side`², RMS-norm (1 + w), one matmul.
    Pooled {
        /// Side of the pooled grid (√`mm_tokens_per_image`).
        tokens_per_side: usize,
        /// The soft-embedding norm's epsilon.
        eps: f64,
    },
    /// LLaVA: linear, activation, linear (both with biases).
    Mlp {
        /// The activation between the two layers.
        activation: VisionActivation,
    },
}

/// A vision encoder and projector.
#[derive(Debug, Clone, PartialEq)]
pub struct VisionConfig {
    /// The family.
    pub family: VisionFamily,
    /// Encoder width.
    pub hidden_size: usize,
    /// Encoder MLP width.
    pub intermediate_size: usize,
    /// Encoder layers the checkpoint holds.
    pub num_layers: usize,
    /// Encoder layers run: the projector reads the output of the last of them.
    pub layers_run: usize,
    /// Attention heads of the encoder.
    pub num_heads: usize,
    /// Side of a square patch, in pixels.
    pub patch_size: usize,
    /// Side of the square input image, in pixels.
    pub image_size: usize,
    /// LayerNorm epsilon.
    pub layer_norm_eps: f64,
    /// The MLP activation.
    pub activation: VisionActivation,
    /// CLIP: a learned class embedding before the patches, and a LayerNorm before the layers.
    pub clip: bool,
    /// SigLIP as Gemma 3 reads it: the post LayerNorm applied to the last layer's output.
    pub post_norm: bool,
    /// Whether the class token's row is dropped before the projector (LLaVA's "default" strategy).
    pub drop_class_token: bool,
    /// The projector.
    pub projector: ProjectorConfig,
    /// The decoder's width (the projector's output).
    pub text_hidden_size: usize,
    /// The token id whose positions take the image's embeddings.
    pub image_token_id: u32,
    /// Whether an image's tokens attend each other in both directions in the decoder (Gemma 3).
    pub bidirectional: bool,
}

impl VisionConfig {
    /// Patches along a side.
    pub fn patches_per_side(&self) -> usize {
        self.image_size / self.patch_size
    }

    /// Rows the encoder's layers see per image: the patches, and CLIP's class token.
    pub fn encoder_rows(&self) -> usize {
        self.patches_per_side().pow(2) + usize::from(self.clip)
    }

    /// The tokens one image fills in the decoder.
    pub fn tokens_per_image(&self) -> usize {
        match self.projector {
            ProjectorConfig::Pooled { tokens_per_side, .. } => tokens_per_side * tokens_per_side,
            ProjectorConfig::Mlp { .. } => self.encoder_rows() - usize::from(self.drop_class_token),
        }
    }

    /// Rows of `vision.output` per image (what the projector reads).
    pub fn output_rows(&self) -> usize {
        self.encoder_rows() - usize::from(self.drop_class_token)
    }
}

fn field<'a>(map: &'a serde_json::Map<String, Value>, key: &str) -> Option<&'a Value> {
    map.get(key).filter(|v| !v.is_null())
}

fn count(map: &serde_json::Map<String, Value>, key: &str, default: Option<usize>, path: &str) -> Result<usize> {
    match field(map, key) {
        Some(v) => v.as_u64().filter(|&n| n > 0 && n <= super::MAX_WIDTH as u64).map(|n| n as usize).ok_or_else(|| {
            CandleError::Malformed {
                what: "config.json",
                path: path.to_owned(),
                reason: format!("`{key}` must be a positive integer up to {}, not {v}", super::MAX_WIDTH),
            }
        }),
        None => default.ok_or_else(|| CandleError::Malformed {
            what: "config.json",
            path: path.to_owned(),
            reason: format!("no `{key}`"),
        }),
    }
}

/// The vision configuration of a Hugging Face `config.json` (`None` for a text-only model).
/// `text_hidden` is the decoder's width.
pub fn from_hf(text: &str, text_hidden: usize, path: &str) -> Result<Option<VisionConfig>> {
    let malformed = |reason: String| CandleError::Malformed { what: "config.json", path: path.to_owned(), reason };
    let root: Value = serde_json::from_str(text).map_err(|e| malformed(e.to_string()))?;
    let family = match root.get("model_type").and_then(Value::as_str) {
        Some("gemma3") => VisionFamily::Gemma3,
        Some("llava") => VisionFamily::Llava,
        _ => return Ok(None),
    };
    let Some(Value::Object(v)) = root.get("vision_config") else {
        // Gemma 3 1B's config says `gemma3_text`; a `gemma3` one without a vision tower is text only.
        return Ok(None);
    };
    let top = root.as_object().expect("an object: model_type was read from it");
    let gemma = family == VisionFamily::Gemma3;
    // transformers' SiglipVisionConfig / CLIPVisionConfig defaults.
    let hidden_size = count(v, "hidden_size", Some(768), path)?;
    let num_heads = count(v, "num_attention_heads", Some(12), path)?;
    if hidden_size % num_heads != 0 {
        return Err(malformed(format!(
            "vision_config.hidden_size {hidden_size} is not a multiple of its {num_heads} heads"
        )));
    }
    let num_layers = count(v, "num_hidden_layers", Some(12), path)?;
    let patch_size = count(v, "patch_size", Some(if gemma { 16 } else { 32 }), path)?;
    let image_size = count(v, "image_size", Some(224), path)?;
    if image_size % patch_size != 0 {
        return Err(malformed(format!(
            "vision_config.image_size {image_size} is not a multiple of patch_size {patch_size}"
        )));
    }
    let act_default = if gemma { "gelu_pytorch_tanh" } else { "quick_gelu" };
    let act = field(v, "hidden_act").and_then(Value::as_str).unwrap_or(act_default);
    let layer_norm_eps = field(v, "layer_norm_eps").and_then(Value::as_f64).unwrap_or(if gemma { 1e-6 } else { 1e-5 });
    if let Some(n) = field(v, "num_channels").and_then(Value::as_u64).filter(|&n| n != 3) {
        return Err(CandleError::UnsupportedConfig {
            what: format!("{path}: vision_config.num_channels = {n} (RGB only)"),
        });
    }
    let image_token_id = field(top, "image_token_id")
        .or_else(|| field(top, "image_token_index"))
        .and_then(Value::as_u64)
        .map(|n| n as u32)
        .unwrap_or(if gemma { 262_144 } else { 32_000 });
    let patches = image_size / patch_size;
    let (layers_run, drop_class_token, projector) = match family {
        VisionFamily::Gemma3 => {
            let tokens = count(top, "mm_tokens_per_image", Some(256), path)?;
            let side = (tokens as f64).sqrt().round() as usize;
            if side * side != tokens || side == 0 || patches % side != 0 {
                return Err(malformed(format!(
                    "mm_tokens_per_image {tokens} is not a square whose side divides the {patches} patches per side"
                )));
            }
            (num_layers, false, ProjectorConfig::Pooled { tokens_per_side: side, eps: layer_norm_eps })
        }
        VisionFamily::Llava => {
            let layer = match field(top, "vision_feature_layer") {
                None => -2,
                Some(Value::Number(n)) if n.as_i64().is_some() => n.as_i64().unwrap_or(-2),
                Some(other) => {
                    return Err(CandleError::UnsupportedConfig {
                        what: format!("{path}: vision_feature_layer = {other} (one layer index only)"),
                    })
                }
            };
            // hidden_states[0] is the embeddings (after the pre-LayerNorm), [i] layer i - 1's output.
            let states = num_layers as i64 + 1;
            let index = if layer < 0 { states + layer } else { layer };
            if !(0..states).contains(&index) {
                return Err(malformed(format!("vision_feature_layer {layer} is outside the {num_layers} layers")));
            }
            let strategy = field(top, "vision_feature_select_strategy").and_then(Value::as_str).unwrap_or("default");
            let drop = match strategy {
                "default" => true,
                "full" => false,
                other => {
                    return Err(CandleError::UnsupportedConfig {
                        what: format!("{path}: vision_feature_select_strategy = {other:?} (default or full)"),
                    })
                }
            };
            if field(top, "multimodal_projector_bias").and_then(Value::as_bool) == Some(false) {
                return Err(CandleError::UnsupportedConfig {
                    what: format!("{path}: multimodal_projector_bias = false"),
                });
            }
            let act = field(top, "projector_hidden_act").and_then(Value::as_str).unwrap_or("gelu");
            let activation = VisionActivation::parse(act, "projector_hidden_act", path)?;
            (index as usize, drop, ProjectorConfig::Mlp { activation })
        }
    };
    Ok(Some(VisionConfig {
        family,
        hidden_size,
        intermediate_size: count(v, "intermediate_size", Some(3072), path)?,
        num_layers,
        layers_run,
        num_heads,
        patch_size,
        image_size,
        layer_norm_eps,
        activation: VisionActivation::parse(act, "vision_config.hidden_act", path)?,
        clip: !gemma,
        post_norm: gemma,
        drop_class_token,
        projector,
        text_hidden_size: text_hidden,
        image_token_id,
        bidirectional: gemma,
    }))
}

/// The vision configuration of llama.cpp's mmproj GGUF (`clip.*` metadata, as
/// `convert_hf_to_gguf.py --mmproj` writes it); `text_hidden` is the language model's width.
/// Gemma 3's projector only (`clip.projector_type` = `gemma3`).
pub fn from_mmproj(md: &super::metadata::Metadata<'_>, text_hidden: usize, path: &str) -> Result<VisionConfig> {
    let projector = md.string("clip.projector_type")?;
    if projector != "gemma3" {
        return Err(CandleError::UnsupportedConfig {
            what: format!("{path}: mmproj projector type {projector:?} (candlewick reads gemma3's)"),
        });
    }
    let malformed = |reason: String| CandleError::Malformed { what: "mmproj GGUF", path: path.to_owned(), reason };
    let hidden_size = md.usize("clip.vision.embedding_length")?;
    let num_heads = md.usize("clip.vision.attention.head_count")?;
    let patch_size = md.usize("clip.vision.patch_size")?;
    let image_size = md.usize("clip.vision.image_size")?;
    if num_heads == 0 || hidden_size % num_heads != 0 || patch_size == 0 || image_size % patch_size != 0 {
        return Err(malformed("inconsistent clip.vision sizes".into()));
    }
    let num_layers = md.usize("clip.vision.block_count")?;
    if num_layers > super::MAX_LAYERS {
        return Err(malformed(format!("clip.vision.block_count {num_layers} is over {}", super::MAX_LAYERS)));
    }
    let eps = md.opt_f64("clip.vision.attention.layer_norm_epsilon")?.unwrap_or(1e-6);
    // llama.cpp pools by 4 unless the converter wrote another factor (test models).
    let scale = md.opt_usize("clip.vision.projector.scale_factor")?.unwrap_or(4);
    let patches = image_size / patch_size;
    if scale == 0 || patches % scale != 0 {
        return Err(malformed(format!("projector scale factor {scale} does not divide {patches} patches")));
    }
    Ok(VisionConfig {
        family: VisionFamily::Gemma3,
        hidden_size,
        intermediate_size: md.usize("clip.vision.feed_forward_length")?,
        num_layers,
        layers_run: num_layers,
        num_heads,
        patch_size,
        image_size,
        layer_norm_eps: eps,
        activation: VisionActivation::GeluTanh,
        clip: false,
        post_norm: true,
        drop_class_token: false,
        projector: ProjectorConfig::Pooled { tokens_per_side: patches / scale, eps },
        text_hidden_size: text_hidden,
        // Gemma 3's `<image_soft_token>`; the model layer reads the file's own from its tokenizer.
        image_token_id: 262_144,
        bidirectional: true,
    })
}
