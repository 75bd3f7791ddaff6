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
    /// Idefics3 and SmolVLM (`Idefics3ForConditionalGeneration`, `SmolVLMForConditionalGeneration`):
    /// SigLIP on each tile of a split image, pixel shuffle, one linear projection.
    Idefics3,
}

impl VisionFamily {
    /// The `model_type` of the family's config.json (what `supported_architectures(images=True)` lists).
    pub fn name(self) -> &'static str {
        match self {
            Self::Gemma3 => "gemma3",
            Self::Llava => "llava",
            Self::Idefics3 => "idefics3",
        }
    }

    /// Every `model_type` of the family's checkpoints (SmolVLM is Idefics3's model under its own
    /// name).
    pub fn model_types(self) -> &'static [&'static str] {
        match self {
            Self::Gemma3 => &["gemma3"],
            Self::Llava => &["llava"],
            Self::Idefics3 => &["idefics3", "smolvlm"],
        }
    }

    /// The family of a config.json `model_type`.
    pub fn from_model_type(model_type: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|f| f.model_types().contains(&model_type))
    }

    /// Every family, in the order `supported_architectures` lists them.
    pub const ALL: [VisionFamily; 3] = [Self::Gemma3, Self::Llava, Self::Idefics3];
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
    /// Idefics3: pixel shuffle (each `scale`×`scale` block of patches folded into one row of
    /// `scale² · Hv` values), then one linear map without bias.
    PixelShuffle {
        /// Side of the folded block (`scale_factor`).
        scale: usize,
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
    /// The processor's per-channel mean and standard deviation, where the checkpoint carries
    /// them in its own configuration (an mmproj file's `clip.vision.image_mean` / `image_std`;
    /// a Hugging Face directory's are in its processor configuration instead).
    pub normalization: Option<([f64; 3], [f64; 3])>,
    /// Idefics3's processor resizes an image's longest edge to this before splitting it, where
    /// the checkpoint carries it in its own configuration (an mmproj file's
    /// `clip.vision.preproc_image_size`; a Hugging Face directory's processor configuration
    /// holds it as `size.longest_edge`).
    pub preproc_longest_edge: Option<usize>,
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
            ProjectorConfig::PixelShuffle { scale } => (self.patches_per_side() / scale).pow(2),
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
    let Some(family) = root.get("model_type").and_then(Value::as_str).and_then(VisionFamily::from_model_type) else {
        return Ok(None);
    };
    let Some(Value::Object(v)) = root.get("vision_config") else {
        // Gemma 3 1B's config says `gemma3_text`; a `gemma3` one without a vision tower is text only.
        return Ok(None);
    };
    let top = root.as_object().expect("an object: model_type was read from it");
    let gemma = family == VisionFamily::Gemma3;
    // SigLIP (Gemma 3's tower, and Idefics3's with its own defaults) or CLIP (LLaVA's).
    let siglip = family != VisionFamily::Llava;
    // transformers' SiglipVisionConfig / CLIPVisionConfig / Idefics3VisionConfig defaults.
    let idefics = family == VisionFamily::Idefics3;
    let hidden_size = count(v, "hidden_size", Some(if idefics { 1152 } else { 768 }), path)?;
    let num_heads = count(v, "num_attention_heads", Some(if idefics { 16 } else { 12 }), path)?;
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
    let act_default = if siglip { "gelu_pytorch_tanh" } else { "quick_gelu" };
    let act = field(v, "hidden_act").and_then(Value::as_str).unwrap_or(act_default);
    let layer_norm_eps = field(v, "layer_norm_eps").and_then(Value::as_f64).unwrap_or(if siglip { 1e-6 } else { 1e-5 });
    if let Some(n) = field(v, "num_channels").and_then(Value::as_u64).filter(|&n| n != 3) {
        return Err(CandleError::UnsupportedConfig {
            what: format!("{path}: vision_config.num_channels = {n} (RGB only)"),
        });
    }
    let image_token_id = field(top, "image_token_id")
        .or_else(|| field(top, "image_token_index"))
        .and_then(Value::as_u64)
        .map(|n| n as u32)
        .unwrap_or(match family {
            VisionFamily::Gemma3 => 262_144,
            VisionFamily::Llava => 32_000,
            VisionFamily::Idefics3 => 128_257,
        });
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
        VisionFamily::Idefics3 => {
            let scale = count(top, "scale_factor", Some(2), path)?;
            if patches % scale != 0 {
                return Err(malformed(format!("scale_factor {scale} does not divide the {patches} patches per side")));
            }
            (num_layers, false, ProjectorConfig::PixelShuffle { scale })
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
        clip: !siglip,
        post_norm: siglip,
        drop_class_token,
        projector,
        text_hidden_size: text_hidden,
        image_token_id,
        bidirectional: gemma,
        normalization: None,
        preproc_longest_edge: None,
    }))
}

/// The vision configuration of llama.cpp's mmproj GGUF (`clip.*` metadata); `text_hidden` is the
/// language model's width. Three projectors: Gemma 3's (`clip.projector_type` = `gemma3`, as
/// `convert_hf_to_gguf.py --mmproj` writes it), Idefics3 / SmolVLM's pixel shuffle (`idefics3`,
/// the same converter) and LLaVA-1.5's MLP (`mlp`, as llama.cpp's
/// `convert_image_encoder_to_gguf.py --llava-projector` writes it: CLIP with its class token and
/// pre-LayerNorm, only the layers the projector reads, no post-LayerNorm).
pub fn from_mmproj(md: &super::metadata::Metadata<'_>, text_hidden: usize, path: &str) -> Result<VisionConfig> {
    let projector = md.string("clip.projector_type")?;
    let family = match projector.as_str() {
        "gemma3" => VisionFamily::Gemma3,
        "mlp" => VisionFamily::Llava,
        "idefics3" => VisionFamily::Idefics3,
        _ => {
            return Err(CandleError::UnsupportedConfig {
                what: format!(
                    "{path}: mmproj projector type {projector:?} (candlewick reads gemma3, idefics3 and mlp)"
                ),
            })
        }
    };
    let gemma = family == VisionFamily::Gemma3;
    // SigLIP towers (Gemma 3's, Idefics3's): no class token, a post-LayerNorm.
    let siglip = family != VisionFamily::Llava;
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
    let eps = md.opt_f64("clip.vision.attention.layer_norm_epsilon")?.unwrap_or(if siglip { 1e-6 } else { 1e-5 });
    let patches = image_size / patch_size;
    let channels = |key: &str| -> Result<Option<[f64; 3]>> {
        match md.opt_f64_array(key)? {
            None => Ok(None),
            Some(v) => <[f64; 3]>::try_from(v.as_slice())
                .map(Some)
                .map_err(|_| malformed(format!("`{key}` holds {} values, not 3", v.len()))),
        }
    };
    let normalization = match (channels("clip.vision.image_mean")?, channels("clip.vision.image_std")?) {
        (Some(mean), Some(std)) => Some((mean, std)),
        _ => None,
    };
    let (layers_run, activation, projector) = if siglip {
        // llama.cpp pools Gemma 3 by 4 unless the converter wrote another factor (test models);
        // Idefics3's converter always writes the config's `scale_factor` (transformers' default 2).
        let scale = md.opt_usize("clip.vision.projector.scale_factor")?.unwrap_or(if gemma { 4 } else { 2 });
        if scale == 0 || patches % scale != 0 {
            return Err(malformed(format!("projector scale factor {scale} does not divide {patches} patches")));
        }
        let projector = if gemma {
            ProjectorConfig::Pooled { tokens_per_side: patches / scale, eps }
        } else {
            ProjectorConfig::PixelShuffle { scale }
        };
        (num_layers, VisionActivation::GeluTanh, projector)
    } else {
        // The converter keeps the layers up to the one the projector reads (`feature_layer`,
        // counted as transformers' hidden states: k is layer k - 1's output); without the key,
        // the projector reads the last layer kept.
        let layers_run = match md.opt_usize_array("clip.vision.feature_layer")?.as_deref() {
            None => num_layers,
            Some([k]) if *k <= num_layers => *k,
            Some(other) => {
                return Err(CandleError::UnsupportedConfig {
                    what: format!("{path}: clip.vision.feature_layer = {other:?} (one layer of the {num_layers} kept)"),
                })
            }
        };
        // CLIP's quick GELU unless the converter says `gelu`; transformers' LLaVA projector
        // runs GELU.
        let activation = if md.opt_bool("clip.use_gelu")?.unwrap_or(false) {
            VisionActivation::Gelu
        } else {
            VisionActivation::QuickGelu
        };
        (layers_run, activation, ProjectorConfig::Mlp { activation: VisionActivation::Gelu })
    };
    Ok(VisionConfig {
        family,
        hidden_size,
        intermediate_size: md.usize("clip.vision.feed_forward_length")?,
        num_layers,
        layers_run,
        num_heads,
        patch_size,
        image_size,
        layer_norm_eps: eps,
        activation,
        clip: !siglip,
        post_norm: siglip,
        drop_class_token: !siglip,
        projector,
        text_hidden_size: text_hidden,
        // Gemma 3's `<image_soft_token>`, LLaVA's and Idefics3's `<image>`; the model layer reads
        // the file's own from its tokenizer.
        image_token_id: match family {
            VisionFamily::Gemma3 => 262_144,
            VisionFamily::Llava => 32_000,
            VisionFamily::Idefics3 => 128_257,
        },
        bidirectional: gemma,
        normalization,
        preproc_longest_edge: md.opt_usize("clip.vision.preproc_image_size")?,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn idefics3_and_smolvlm_read_as_siglip_with_a_pixel_shuffle() {
        for model_type in ["idefics3", "smolvlm"] {
            let text = format!(
                r#"{{"model_type":"{model_type}","scale_factor":4,"image_token_id":49190,
                "vision_config":{{"hidden_size":64,"num_attention_heads":4,"image_size":512,"patch_size":16}}}}"#
            );
            let c = from_hf(&text, 576, "config.json").unwrap().unwrap();
            assert_eq!(c.family, VisionFamily::Idefics3);
            assert_eq!(c.projector, ProjectorConfig::PixelShuffle { scale: 4 });
            // SmolVLM-256M's shape: 32 x 32 patches, folded by 4: 64 tokens a tile.
            assert_eq!(c.tokens_per_image(), 64);
            assert!(!c.clip && c.post_norm && !c.bidirectional && !c.drop_class_token);
            assert_eq!((c.image_token_id, c.activation, c.layers_run), (49190, VisionActivation::GeluTanh, 12));
        }
        let bad = r#"{"model_type":"idefics3","scale_factor":3,"vision_config":{"image_size":64,"patch_size":4}}"#;
        let err = from_hf(bad, 64, "config.json").unwrap_err().to_string();
        assert!(err.contains("scale_factor 3"), "{err}");
    }
}
