//! One vision encoder for every supported family, parameterised by `VisionConfig` as the decoder
//! is by `ArchConfig` (DESIGN §13): patch embedding, positions, CLIP's class token and pre-norm,
//! LayerNorm encoder layers with bidirectional attention, SigLIP's post-norm, then the family's
//! projector into the decoder's embedding space (Gemma 3's pooling, LLaVA's MLP, Idefics3's pixel
//! shuffle). Its points are `vision.layers.{i}.output`,
//! `vision.output` and `vision.projector.output`.

use std::collections::VecDeque;
use std::sync::Mutex;

use candle_core::quantized::QMatMul;
use candle_core::{DType, Device, Tensor};

use crate::backend::blocks::activation;
use crate::backend::blocks::linear::Linear;
use crate::backend::blocks::norm::Norm;
use crate::backend::config::vision::{ProjectorConfig, VisionActivation, VisionConfig};
use crate::backend::config::{Activation, NormKind};
use crate::backend::error::{CandleContext, CandleError, Result};
use crate::backend::kernels::Weight;
use crate::backend::weights::names::{Naming, VisionSlot};
use crate::backend::weights::WeightLoader;

/// A named point of the vision encoder.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum VisionPoint {
    /// `vision.layers.{i}.output`: layer `i`'s output, `[rows, Hv]` per image.
    Layer(usize),
    /// `vision.output`: what the projector reads, `[rows, Hv]` per image.
    Output,
    /// `vision.projector.output`: the image's embeddings in the decoder's space, `[tokens, H]`.
    Projector,
}

impl VisionPoint {
    /// The point's path.
    pub fn path(self) -> String {
        match self {
            Self::Layer(i) => format!("vision.layers.{i}.output"),
            Self::Output => "vision.output".into(),
            Self::Projector => "vision.projector.output".into(),
        }
    }

    /// Parses a path of `path`'s form.
    pub fn parse(path: &str) -> Option<Self> {
        match path {
            "vision.output" => Some(Self::Output),
            "vision.projector.output" => Some(Self::Projector),
            _ => path
                .strip_prefix("vision.layers.")
                .and_then(|r| r.strip_suffix(".output"))
                .and_then(|i| i.parse().ok())
                .map(Self::Layer),
        }
    }
}

#[derive(Debug)]
struct Layer {
    attn_norm: Norm,
    q: Linear,
    k: Linear,
    v: Linear,
    o: Linear,
    mlp_norm: Norm,
    up: Linear,
    down: Linear,
}

#[derive(Debug)]
enum Projector {
    Pooled { norm: Norm, proj: Linear, tokens_per_side: usize },
    Mlp { first: Linear, second: Linear, activation: VisionActivation },
    Shuffle { proj: Linear, scale: usize },
}

/// How many encoded images the encoder keeps at least, keyed by their pixels: a second question
/// about the same image skips the encoder.
pub const ENCODER_CACHE_IMAGES: usize = 16;

/// Past `ENCODER_CACHE_IMAGES`, the encoder keeps more while their embeddings fit in this many
/// bytes: a split image (Idefics3, SmolVLM) is up to 17 encoder images, its tiles and the whole
/// image, each cached on its own, and 16 would not hold one of them.
pub const ENCODER_CACHE_BYTES: usize = 64 << 20;

/// The most encoded images the encoder keeps, however small (16 images split 4 x 4).
pub const ENCODER_CACHE_MAX_IMAGES: usize = 16 * 17;

/// The vision encoder and projector of a vision-language model.
#[derive(Debug)]
pub struct VisionModel {
    config: VisionConfig,
    /// The patch embedding as a matmul over a patch's `3·p·p` pixels (channel, row, column).
    patch: Linear,
    positions: Tensor,
    class: Option<Tensor>,
    pre_norm: Option<Norm>,
    layers: Vec<Layer>,
    post_norm: Option<Norm>,
    projector: Projector,
    device: Device,
    /// Projected embeddings of recent images (hash of the pixels → `[tokens, H]`), newest last.
    cache: Mutex<VecDeque<(u64, Tensor)>>,
    /// Images encoded, and images served from the cache.
    counts: Mutex<(u64, u64)>,
    /// The token id whose positions take an image's embeddings (the configuration's, or the one a
    /// GGUF's tokenizer names, set at load).
    image_token: std::sync::atomic::AtomicU32,
}

impl VisionModel {
    /// Loads the encoder and projector `config` describes from `w`, named as `naming` names them.
    pub fn load(config: VisionConfig, w: &WeightLoader<'_>, naming: Naming) -> Result<Self> {
        let token = config.image_token_id;
        let c = &config;
        let (h, p) = (c.hidden_size, c.patch_size);
        let name =
            |slot: VisionSlot, layer: usize, suffix: &str| format!("{}.{suffix}", naming.vision_stem(slot, layer));
        let f32s = |slot: VisionSlot, layer: usize, suffix: &str, shape: &[usize]| {
            w.dense_f32(&name(slot, layer, suffix), shape)
        };
        let layer_norm = |slot: VisionSlot, layer: usize| -> Result<Norm> {
            let n = name(slot, layer, "weight");
            Norm::new(
                NormKind::Layer,
                w.dense_f32(&n, &[h])?,
                Some(f32s(slot, layer, "bias", &[h])?),
                c.layer_norm_eps,
                false,
            )
            .ctx(|| format!("preparing norm `{n}`"))
        };
        let linear = |slot: VisionSlot, layer: usize, out: usize, inp: usize| -> Result<Linear> {
            let weight = w.matmul(&name(slot, layer, "weight"), out, inp)?;
            Ok(Linear::new(weight, Some(f32s(slot, layer, "bias", &[out])?)))
        };
        let dense = |t: Tensor, n: &str| -> Result<Weight> {
            let t = t.contiguous().ctx(|| format!("laying out `{n}`"))?;
            Ok(Weight::Candle(QMatMul::Tensor(t)))
        };
        let patch_name = name(VisionSlot::PatchEmbed, 0, "weight");
        let patch_w =
            w.dense(&patch_name, &[h, 3, p, p])?.reshape((h, 3 * p * p)).ctx(|| format!("reshaping `{patch_name}`"))?;
        let patch_bias = if c.clip { None } else { Some(f32s(VisionSlot::PatchEmbed, 0, "bias", &[h])?) };
        let patch = Linear::new(dense(patch_w, &patch_name)?, patch_bias);
        let positions = f32s(VisionSlot::PosEmbed, 0, "weight", &[c.encoder_rows(), h])?;
        // Both formats name the class embedding without a `.weight`.
        let class =
            if c.clip { Some(w.dense_f32(&naming.vision_stem(VisionSlot::ClassEmbed, 0), &[h])?) } else { None };
        let pre_norm = if c.clip { Some(layer_norm(VisionSlot::PreNorm, 0)?) } else { None };
        let layers = (0..c.layers_run)
            .map(|i| -> Result<Layer> {
                // llama.cpp's older converter (LLaVA's `convert_image_encoder_to_gguf.py`) names
                // CLIP's fc1 `ffn_down` and fc2 `ffn_up`: as clip.cpp does, the shapes tell.
                let inter = c.intermediate_size;
                let swapped = inter != h && w.shape(&name(VisionSlot::Up, i, "weight")) == Some(vec![h, inter]);
                let (up, down) =
                    if swapped { (VisionSlot::Down, VisionSlot::Up) } else { (VisionSlot::Up, VisionSlot::Down) };
                Ok(Layer {
                    attn_norm: layer_norm(VisionSlot::AttnNorm, i)?,
                    q: linear(VisionSlot::Q, i, h, h)?,
                    k: linear(VisionSlot::K, i, h, h)?,
                    v: linear(VisionSlot::V, i, h, h)?,
                    o: linear(VisionSlot::O, i, h, h)?,
                    mlp_norm: layer_norm(VisionSlot::MlpNorm, i)?,
                    up: linear(up, i, inter, h)?,
                    down: linear(down, i, h, inter)?,
                })
            })
            .collect::<Result<Vec<_>>>()?;
        let post_norm = if c.post_norm { Some(layer_norm(VisionSlot::PostNorm, 0)?) } else { None };
        let th = c.text_hidden_size;
        let projector = match c.projector {
            ProjectorConfig::Pooled { tokens_per_side, eps } => {
                let n = name(VisionSlot::ProjNorm, 0, "weight");
                // llama.cpp's converter stores the norm with Gemma's 1 added already.
                let offset = naming == Naming::HuggingFace;
                let norm = Norm::rms(w.dense_f32(&n, &[h])?, eps, offset).ctx(|| format!("preparing norm `{n}`"))?;
                // Both formats store the matrix as the product reads it, `[Hv, H]`: Hugging Face
                // as a bare parameter, llama.cpp under `.weight`.
                let bare = naming.vision_stem(VisionSlot::ProjInput, 0);
                let n = if w.contains(&bare) { bare } else { name(VisionSlot::ProjInput, 0, "weight") };
                let t = w.dense(&n, &[h, th])?.t().ctx(|| format!("transposing `{n}`"))?;
                Projector::Pooled { norm, proj: Linear::new(dense(t, &n)?, None), tokens_per_side }
            }
            ProjectorConfig::Mlp { activation } => Projector::Mlp {
                first: linear(VisionSlot::ProjFirst, 0, th, h)?,
                second: linear(VisionSlot::ProjSecond, 0, th, th)?,
                activation,
            },
            ProjectorConfig::PixelShuffle { scale } => Projector::Shuffle {
                proj: Linear::new(w.matmul(&name(VisionSlot::ProjShuffle, 0, "weight"), th, h * scale * scale)?, None),
                scale,
            },
        };
        Ok(Self {
            config,
            patch,
            positions,
            class,
            pre_norm,
            layers,
            post_norm,
            projector,
            device: w.device().clone(),
            cache: Mutex::new(VecDeque::new()),
            counts: Mutex::new((0, 0)),
            image_token: std::sync::atomic::AtomicU32::new(token),
        })
    }

    /// The token id whose positions take an image's embeddings.
    pub fn image_token_id(&self) -> u32 {
        self.image_token.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// Sets the image token id (a GGUF's tokenizer names it; the mmproj file does not).
    pub fn set_image_token_id(&self, id: u32) {
        self.image_token.store(id, std::sync::atomic::Ordering::Relaxed);
    }

    /// The configuration.
    pub fn config(&self) -> &VisionConfig {
        &self.config
    }

    /// Every vision point's path, in forward order.
    pub fn points(&self) -> Vec<String> {
        let mut v: Vec<String> = (0..self.layers.len()).map(|i| VisionPoint::Layer(i).path()).collect();
        v.push(VisionPoint::Output.path());
        v.push(VisionPoint::Projector.path());
        v
    }

    /// The per-row width of a point (`None` for a layer it does not have).
    pub fn point_width(&self, point: VisionPoint) -> Option<usize> {
        match point {
            VisionPoint::Layer(i) if i >= self.layers.len() => None,
            VisionPoint::Layer(_) | VisionPoint::Output => Some(self.config.hidden_size),
            VisionPoint::Projector => Some(self.config.text_hidden_size),
        }
    }

    /// Rows of a point per image.
    pub fn point_rows(&self, point: VisionPoint) -> usize {
        match point {
            VisionPoint::Layer(_) => self.config.encoder_rows(),
            VisionPoint::Output => self.config.output_rows(),
            VisionPoint::Projector => self.config.tokens_per_image(),
        }
    }

    /// Images encoded and images served from the encoder cache since load.
    pub fn cache_counts(&self) -> (u64, u64) {
        *self.counts.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Encodes one image `[3, S, S]` (float32 pixel values as the processor returns them) into
    /// `[tokens, H]`; `at` sees (and may replace) every vision point's value. With `cacheable`
    /// (no point observed or edited) a recent identical image is served from the cache.
    pub fn encode(
        &self,
        pixels: &[f32],
        cacheable: bool,
        at: &mut dyn FnMut(VisionPoint, Tensor) -> candle_core::Result<Tensor>,
    ) -> Result<Tensor> {
        let s = self.config.image_size;
        if pixels.len() != 3 * s * s {
            return Err(CandleError::InvalidInput {
                operation: "images",
                reason: format!(
                    "an image's pixel values must be [3, {s}, {s}] ({} values), not {}",
                    3 * s * s,
                    pixels.len()
                ),
            });
        }
        if let Some(bad) = pixels.iter().position(|v| !v.is_finite()) {
            return Err(CandleError::InvalidInput {
                operation: "images",
                reason: format!("pixel value {bad} is not finite"),
            });
        }
        let key = if cacheable { Some(hash_pixels(pixels)) } else { None };
        if let Some(key) = key {
            let cache = self.cache.lock().unwrap_or_else(|e| e.into_inner());
            if let Some((_, t)) = cache.iter().find(|(k, _)| *k == key) {
                self.counts.lock().unwrap_or_else(|e| e.into_inner()).1 += 1;
                return Ok(t.clone());
            }
        }
        let out = self.forward(pixels, at).map_err(|source| CandleError::Candle {
            context: "encoding an image".into(),
            source: crate::backend::error::without_backtrace(source),
        })?;
        self.counts.lock().unwrap_or_else(|e| e.into_inner()).0 += 1;
        if let Some(key) = key {
            let mut cache = self.cache.lock().unwrap_or_else(|e| e.into_inner());
            let bytes = |t: &Tensor| t.elem_count() * t.dtype().size_in_bytes();
            let mut held: usize = cache.iter().map(|(_, t)| bytes(t)).sum::<usize>() + bytes(&out);
            while cache.len() >= ENCODER_CACHE_MAX_IMAGES
                || (cache.len() >= ENCODER_CACHE_IMAGES && held > ENCODER_CACHE_BYTES)
            {
                held -= cache.front().map_or(0, |(_, t)| bytes(t));
                cache.pop_front();
            }
            cache.push_back((key, out.clone()));
        }
        Ok(out)
    }

    fn forward(
        &self,
        pixels: &[f32],
        at: &mut dyn FnMut(VisionPoint, Tensor) -> candle_core::Result<Tensor>,
    ) -> candle_core::Result<Tensor> {
        let c = &self.config;
        let (s, p, n) = (c.image_size, c.patch_size, c.patches_per_side());
        // [3, S, S] → [n·n, 3·p·p], each patch's pixels in the convolution weight's order.
        let patches = Tensor::from_slice(pixels, (3, n, p, n, p), &self.device)?
            .permute((1, 3, 0, 2, 4))?
            .contiguous()?
            .reshape((n * n, 3 * p * p))?;
        debug_assert_eq!(s, n * p);
        let mut x = self.patch.forward(&patches)?;
        if let Some(class) = &self.class {
            x = Tensor::cat(&[&class.unsqueeze(0)?, &x], 0)?;
        }
        x = (x + &self.positions)?;
        if let Some(norm) = &self.pre_norm {
            x = norm.forward(&x)?;
        }
        let (heads, d) = (c.num_heads, c.hidden_size / c.num_heads);
        let scale = (d as f64).powf(-0.5);
        let rows = x.dim(0)?;
        for (i, l) in self.layers.iter().enumerate() {
            let y = l.attn_norm.forward(&x)?;
            let split = |t: Tensor| t.reshape((rows, heads, d))?.transpose(0, 1)?.contiguous();
            let (q, k, v) = (split(l.q.forward(&y)?)?, split(l.k.forward(&y)?)?, split(l.v.forward(&y)?)?);
            let scores = (q.matmul(&k.t()?)? * scale)?;
            let probs = candle_nn::ops::softmax_last_dim(&scores)?;
            let a = probs.matmul(&v)?.transpose(0, 1)?.reshape((rows, c.hidden_size))?;
            x = (x + l.o.forward(&a)?)?;
            let y = l.up.forward(&l.mlp_norm.forward(&x)?)?;
            x = (x + l.down.forward(&activate(c.activation, &y)?)?)?;
            x = at(VisionPoint::Layer(i), x)?;
        }
        if let Some(norm) = &self.post_norm {
            x = norm.forward(&x)?;
        }
        if c.drop_class_token {
            x = x.narrow(0, 1, rows - 1)?;
        }
        let x = at(VisionPoint::Output, x)?;
        let y = match &self.projector {
            Projector::Pooled { norm, proj, tokens_per_side } => {
                let (t, k, hv) = (*tokens_per_side, n / tokens_per_side, c.hidden_size);
                // Average pooling of k×k patches: [n, n, Hv] → [t, k, t, k, Hv] → mean over the ks.
                let pooled = x.reshape((t, k, t, k, hv))?.mean(3)?.mean(1)?.reshape((t * t, hv))?;
                proj.forward(&norm.forward(&pooled)?)?
            }
            Projector::Mlp { first, second, activation } => {
                second.forward(&activate(*activation, &first.forward(&x)?)?)?
            }
            Projector::Shuffle { proj, scale } => proj.forward(&pixel_shuffle(&x, n, *scale)?)?,
        };
        at(VisionPoint::Projector, y.to_dtype(DType::F32)?)
    }
}

/// Idefics3's pixel shuffle of one image's `[n·n, D]` patch rows into `[(n/s)², s²·D]`, as
/// transformers' `Idefics3Connector.pixel_shuffle` lays it out: row-major `[n, n, D]` viewed as
/// `[n, n/s, s·D]` (s neighbours along a row side by side), rows and columns swapped, viewed as
/// `[n/s, n/s, s²·D]` (s of those along a column), swapped back.
fn pixel_shuffle(x: &Tensor, n: usize, s: usize) -> candle_core::Result<Tensor> {
    let d = x.dim(1)?;
    let m = n / s;
    x.reshape((n, m, s * d))?
        .transpose(0, 1)?
        .contiguous()?
        .reshape((m, m, s * s * d))?
        .transpose(0, 1)?
        .contiguous()?
        .reshape((m * m, s * s * d))
}

/// `activation` of `x`.
fn activate(activation: VisionActivation, x: &Tensor) -> candle_core::Result<Tensor> {
    match activation {
        VisionActivation::GeluTanh => activation::apply(Activation::GeluTanh, x),
        VisionActivation::Gelu => activation::apply(Activation::Gelu, x),
        VisionActivation::QuickGelu => x * candle_nn::ops::sigmoid(&(x * 1.702)?)?,
    }
}

/// A 64-bit hash of an image's pixel values (the encoder cache's key).
fn hash_pixels(pixels: &[f32]) -> u64 {
    use std::hash::{Hash, Hasher};
    let mut h = std::collections::hash_map::DefaultHasher::new();
    pixels.len().hash(&mut h);
    for v in pixels {
        v.to_bits().hash(&mut h);
    }
    h.finish()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pixel_shuffle_folds_each_block_of_patches_as_transformers_does() {
        // A 4 x 4 grid of one-value patches numbered row by row, folded by 2: each output row is
        // one 2 x 2 block, its patches row by row (Idefics3Connector.pixel_shuffle's layout).
        let x = Tensor::arange(0f32, 16f32, &Device::Cpu).unwrap().reshape((16, 1)).unwrap();
        let y = pixel_shuffle(&x, 4, 2).unwrap().to_vec2::<f32>().unwrap();
        let want: Vec<Vec<f32>> =
            vec![vec![0., 1., 4., 5.], vec![2., 3., 6., 7.], vec![8., 9., 12., 13.], vec![10., 11., 14., 15.]];
        assert_eq!(y, want);
    }
}
