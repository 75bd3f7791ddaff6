//! Images into a vision-language model (DESIGN §13): find each image's tokens in a prompt,
//! encode the image (observing and editing the vision points), and stage its embeddings on the
//! session for the call that runs those positions.

use candle_core::Tensor;

use super::{Model, ModelError};
use crate::backend::session::images::ImageSpan;
use crate::backend::vision::{VisionModel, VisionPoint};
use crate::backend::CandleError;
use crate::core::{BackendSession, EditOp, Intervention, ObservationRequest, ObservationSet, ObservationValue};

/// Images as the model's processor returns them: float32 `[n, 3, S, S]`, row-major (Idefics3's
/// processor returns one prompt's tiles as `[1, n, 3, S, S]`, which reads the same).
#[derive(Debug, Clone, PartialEq)]
pub struct PixelValues {
    /// The values.
    pub data: Vec<f32>,
    /// Their shape.
    pub shape: Vec<usize>,
}

fn refused(reason: String) -> ModelError {
    ModelError::Backend(CandleError::InvalidInput { operation: "images", reason })
}

/// Whether `point` names a vision point (`vision.…`).
pub fn is_vision_point(point: &str) -> bool {
    point == "vision" || point.starts_with("vision.")
}

/// `edits` split into those on the vision points and the rest.
pub fn split_vision_edits(edits: Vec<Intervention>) -> (Vec<Intervention>, Vec<Intervention>) {
    edits.into_iter().partition(|e| is_vision_point(&e.point))
}

/// What a vision-language model's processor reads: config.json's `model_type`, the image
/// processor's configuration (`preprocessor_config.json` with `processor_config.json` over it)
/// and config.json itself, as JSON text.
#[derive(Debug, Clone, PartialEq)]
pub struct ProcessorFiles {
    /// `gemma3`, `llava`, ...
    pub model_type: String,
    /// The merged processor configuration (`{}` when the directory has neither file).
    pub processor: String,
    /// config.json.
    pub config: String,
}

impl ProcessorFiles {
    /// What the family's processor reads, from an mmproj file's configuration (llama.cpp's
    /// converters keep the image size, mean and std). Gemma 3: a bilinear resize to the square;
    /// LLaVA: transformers' `CLIPImageProcessor` (bicubic resize of the shortest edge, centre
    /// crop), as the Hugging Face checkpoints configure it; Idefics3: the longest edge resized to
    /// the file's `preproc_image_size` (lanczos), split into tiles of the encoder's image size.
    pub fn from_mmproj(c: &crate::backend::config::vision::VisionConfig) -> Self {
        use crate::backend::config::vision::VisionFamily;
        let tokens = c.tokens_per_image();
        let s = c.image_size;
        let (mean, std) = c.normalization.unwrap_or(match c.family {
            VisionFamily::Gemma3 | VisionFamily::Idefics3 => ([0.5; 3], [0.5; 3]),
            // OpenAI CLIP's.
            VisionFamily::Llava => {
                ([0.481_454_66, 0.457_827_5, 0.408_210_73], [0.268_629_54, 0.261_302_58, 0.275_777_11])
            }
        });
        let strategy = if c.drop_class_token { "default" } else { "full" };
        let (processor, config) = match c.family {
            VisionFamily::Gemma3 => (
                serde_json::json!({
                    "image_processor_type": "Gemma3ImageProcessor",
                    "size": {"height": s, "width": s},
                    "image_mean": mean,
                    "image_std": std,
                    "resample": 2,
                    "image_seq_length": tokens,
                }),
                serde_json::json!({"model_type": "gemma3", "mm_tokens_per_image": tokens}),
            ),
            VisionFamily::Llava => (
                serde_json::json!({
                    "image_processor_type": "CLIPImageProcessor",
                    "size": {"shortest_edge": s},
                    "crop_size": {"height": s, "width": s},
                    "do_center_crop": true,
                    "image_mean": mean,
                    "image_std": std,
                    "resample": 3,
                    "patch_size": c.patch_size,
                }),
                serde_json::json!({
                    "model_type": "llava",
                    "image_seq_length": tokens,
                    "vision_config": {"patch_size": c.patch_size, "image_size": s},
                    "vision_feature_select_strategy": strategy,
                }),
            ),
            VisionFamily::Idefics3 => {
                let scale = match c.projector {
                    crate::backend::config::vision::ProjectorConfig::PixelShuffle { scale } => scale,
                    _ => 2,
                };
                (
                    serde_json::json!({
                        "image_processor_type": "Idefics3ImageProcessor",
                        // transformers' default: four tiles a side.
                        "size": {"longest_edge": c.preproc_longest_edge.unwrap_or(4 * s)},
                        "max_image_size": {"longest_edge": s},
                        "do_image_splitting": true,
                        "image_mean": mean,
                        "image_std": std,
                        "resample": 1,
                        "image_seq_len": tokens,
                    }),
                    serde_json::json!({
                        "model_type": "idefics3",
                        "scale_factor": scale,
                        "vision_config": {"patch_size": c.patch_size, "image_size": s},
                    }),
                )
            }
        };
        Self { model_type: c.family.name().into(), processor: processor.to_string(), config: config.to_string() }
    }

    /// Reads them from a Hugging Face directory.
    pub fn from_hf_dir(dir: &std::path::Path) -> Result<Self, ModelError> {
        let read = |name: &str| -> Result<Option<serde_json::Map<String, serde_json::Value>>, ModelError> {
            let path = dir.join(name);
            if !path.is_file() {
                return Ok(None);
            }
            let text = std::fs::read_to_string(&path)
                .map_err(|source| CandleError::Io { path: path.display().to_string(), source })?;
            match serde_json::from_str(&text) {
                Ok(serde_json::Value::Object(m)) => Ok(Some(m)),
                _ => Err(ModelError::Backend(CandleError::Malformed {
                    what: "processor configuration",
                    path: path.display().to_string(),
                    reason: "not a JSON object".into(),
                })),
            }
        };
        let config = read("config.json")?.unwrap_or_default();
        let mut processor = read("preprocessor_config.json")?.unwrap_or_default();
        processor.extend(read("processor_config.json")?.unwrap_or_default());
        let model_type = config.get("model_type").and_then(|v| v.as_str()).unwrap_or_default().to_owned();
        Ok(Self {
            model_type,
            processor: serde_json::Value::Object(processor).to_string(),
            config: serde_json::Value::Object(config).to_string(),
        })
    }
}

impl Model {
    /// The processor configuration of a vision-language model (`None` for a text-only one).
    pub fn processor_files(&self) -> Option<&ProcessorFiles> {
        self.processor.as_ref()
    }

    /// The vision encoder, or a typed error naming the model as text-only.
    pub fn vision(&self) -> Result<&std::sync::Arc<VisionModel>, ModelError> {
        self.runtime.session().decoder().vision().ok_or_else(|| {
            refused(format!(
                "this model ({}) takes no images: it has no vision encoder (supported_architectures(images=True) lists those that do)",
                self.info.architecture
            ))
        })
    }

    /// Encodes `pixels` (observing what `request` selects among the vision points, applying
    /// `edits` there) and stages each image at `base` + its position in `ids` on the session.
    /// Returns the vision observations. The images stay staged until `clear_images`.
    pub fn stage_images(
        &mut self,
        ids: &[u32],
        base: usize,
        pixels: &PixelValues,
        request: Option<&ObservationRequest>,
        edits: &[Intervention],
    ) -> Result<ObservationSet, ModelError> {
        let vision = std::sync::Arc::clone(self.vision()?);
        let max_context = self.runtime.session().max_context();
        let (spans, set) = encode_images(&vision, max_context, ids, base, pixels, request, edits)?;
        self.stage_spans(spans)?;
        Ok(set)
    }

    /// Stages encoded images on the session, first rewinding it to before the first image:
    /// positions before it may be reused from the cache, from there on the call recomputes (the
    /// same ids may have held another image before).
    pub fn stage_spans(&mut self, spans: Vec<ImageSpan>) -> Result<(), ModelError> {
        let first = spans.iter().map(|s| s.start).min();
        let session = self.runtime.session_mut();
        if let Some(first) = first.filter(|&f| f < BackendSession::position(&*session)) {
            let to = if BackendSession::can_truncate(&*session, first) { first } else { 0 };
            BackendSession::truncate(session, to).map_err(ModelError::Backend)?;
        }
        session.stage_images(spans).map_err(ModelError::Backend)
    }

    /// Unstages every image (after the call that read them).
    pub fn clear_images(&mut self) {
        self.runtime.session_mut().clear_images();
    }
}

/// The positions of each image's tokens in `ids`: runs of the model's image token, one image
/// per `tokens_per_image` of them, in order. Refused unless there are exactly `images` images.
pub fn image_starts(vision: &VisionModel, ids: &[u32], images: usize) -> Result<Vec<usize>, ModelError> {
    let c = vision.config();
    let (token, per) = (vision.image_token_id(), c.tokens_per_image());
    let at: Vec<usize> = ids.iter().enumerate().filter(|(_, &t)| t == token).map(|(i, _)| i).collect();
    if at.len() != images * per {
        // Idefics3's pixel values hold a split image's tiles, each its own run of tokens.
        let what = if matches!(c.projector, crate::backend::config::vision::ProjectorConfig::PixelShuffle { .. }) {
            "tile(s) (a split image's tiles and its whole image)"
        } else {
            "image(s)"
        };
        return Err(refused(format!(
            "the prompt holds {} image tokens (id {token}); {images} {what} of {per} tokens each need {}",
            at.len(),
            images * per
        )));
    }
    let mut starts = Vec::with_capacity(images);
    for (i, run) in at.chunks(per).enumerate() {
        if run.last().copied() != Some(run[0] + per - 1) {
            return Err(refused(format!("image {i}'s {per} tokens are not consecutive in the prompt")));
        }
        starts.push(run[0]);
    }
    Ok(starts)
}

/// Encodes the images of a call whose first token is at position `base`: each image's
/// embeddings at its tokens' positions in `ids`, and the vision points `request` selects
/// (`[images · rows, width]` each), with `edits` on the vision points applied.
pub fn encode_images(
    vision: &VisionModel,
    max_context: usize,
    ids: &[u32],
    base: usize,
    pixels: &PixelValues,
    request: Option<&ObservationRequest>,
    edits: &[Intervention],
) -> Result<(Vec<ImageSpan>, ObservationSet), ModelError> {
    let s = vision.config().image_size;
    let n = match pixels.shape.as_slice() {
        // Idefics3's processor nests one prompt's tiles (each an image to the encoder) in a batch of one.
        [n, 3, h, w] | [1, n, 3, h, w] if *h == s && *w == s && pixels.data.len() == n * 3 * s * s => *n,
        other => {
            return Err(refused(format!(
            "pixel_values must be float32 [images, 3, {s}, {s}] as the model's processor returns them, not {other:?}"
        )))
        }
    };
    let starts = image_starts(vision, ids, n)?;
    if let Some(end) = starts.iter().map(|&p| base + p + vision.config().tokens_per_image()).max() {
        if end > max_context {
            return Err(ModelError::Backend(CandleError::ContextFull {
                position: base,
                requested: end - base,
                max_context,
            }));
        }
    }
    for e in edits {
        let point = VisionPoint::parse(&e.point).filter(|p| vision.point_width(*p).is_some());
        if point.is_none() {
            return Err(refused(format!("no vision point `{}` (rt.observation_points() lists them)", e.point)));
        }
    }
    let mut recorded: Vec<(VisionPoint, Vec<f32>)> = Vec::new();
    let mut spans = Vec::with_capacity(n);
    let per_image = 3 * s * s;
    let observed = request.is_some_and(|r| vision.points().iter().any(|p| r.matches(p)));
    let cacheable = edits.is_empty() && !observed;
    for (i, &start) in starts.iter().enumerate() {
        let wanted = |p: VisionPoint| request.is_some_and(|r| r.matches(&p.path()));
        let mut at = |p: VisionPoint, x: Tensor| -> candle_core::Result<Tensor> {
            let x = apply_edits(vision, p, i, x, edits)?;
            if wanted(p) {
                let rows = x.flatten_all()?.to_vec1::<f32>()?;
                match recorded.iter_mut().find(|(q, _)| *q == p) {
                    Some((_, v)) => v.extend(rows),
                    None => recorded.push((p, rows)),
                }
            }
            Ok(x)
        };
        let embeds = vision.encode(&pixels.data[i * per_image..(i + 1) * per_image], cacheable, &mut at)?;
        spans.push(ImageSpan { start: base + start, embeds });
    }
    let mut set = ObservationSet::new();
    for (p, data) in recorded {
        let width = vision.point_width(p).unwrap_or(1);
        let shape = vec![data.len() / width, width];
        set.insert(p.path(), ObservationValue::Tensor { shape, data }).map_err(|e| refused(e.to_string()))?;
    }
    Ok((spans, set))
}

/// `x` (one image's rows at `point`) with the edits at that point applied; an edit's positions
/// count rows across the images in order (image `i`'s row `r` is `i · rows + r`).
fn apply_edits(
    vision: &VisionModel,
    point: VisionPoint,
    image: usize,
    x: Tensor,
    edits: &[Intervention],
) -> candle_core::Result<Tensor> {
    let path = point.path();
    let here: Vec<&Intervention> = edits.iter().filter(|e| e.point == path).collect();
    if here.is_empty() {
        return Ok(x);
    }
    let (rows, width) = x.dims2()?;
    let first = image * vision.point_rows(point);
    let mut data = x.flatten_all()?.to_vec1::<f32>()?;
    for e in here {
        let selected: Vec<(usize, usize)> = match &e.positions {
            None => (0..rows).map(|r| (r, r)).collect(),
            Some(ps) => ps
                .iter()
                .enumerate()
                .filter(|(_, &p)| p >= first && p < first + rows)
                .map(|(k, &p)| (p - first, k))
                .collect(),
        };
        let bad = |what: String| candle_core::Error::Msg(format!("intervention at `{path}`: {what}"));
        for (r, k) in selected {
            let row = &mut data[r * width..(r + 1) * width];
            match &e.op {
                EditOp::Add { vector, scale } if vector.len() == width => {
                    row.iter_mut().zip(vector).for_each(|(x, v)| *x += scale * v)
                }
                EditOp::Set { values } if values.len() >= (k + 1) * width => {
                    row.copy_from_slice(&values[k * width..(k + 1) * width])
                }
                EditOp::Scale { index, factor } => {
                    for &i in index {
                        *row.get_mut(i).ok_or_else(|| bad(format!("unit {i} is past the width {width}")))? *= factor;
                    }
                }
                EditOp::ProjectOut { direction } if direction.len() == width => {
                    let norm = direction.iter().map(|d| d * d).sum::<f32>().sqrt();
                    if norm > 0.0 {
                        let dot = row.iter().zip(direction).map(|(x, d)| x * d).sum::<f32>() / (norm * norm);
                        row.iter_mut().zip(direction).for_each(|(x, d)| *x -= dot * d);
                    }
                }
                EditOp::Sae { .. } => return Err(bad("SAE edits do not apply to vision points".into())),
                _ => return Err(bad(format!("its values do not fit rows of width {width}"))),
            }
        }
    }
    Tensor::from_vec(data, (rows, width), x.device())
}
