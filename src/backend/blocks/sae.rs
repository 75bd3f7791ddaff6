//! A sparse autoencoder on the model's device (DESIGN §15): encode a point's rows into
//! features, decode them, and rewrite the point for a feature edit. `hooks.rs` calls it where
//! the point is produced, so the features of a prefill, a decode step or a batched row are
//! computed on the same tensors the forward pass holds.

use std::sync::{Arc, RwLock};

use candle_core::{DType, Device, Tensor, D};

use crate::backend::error::{CandleContext, Result};
use crate::backend::weights::sae::{SaeEncoder, SaeNorm, SaeWeights};
use crate::core::{Point, SaeEdit};

/// One SAE attached to a point, its weights on the model's device.
#[derive(Debug)]
pub struct Sae {
    /// The name its points and edits use (`sae.{name}.features`).
    pub name: String,
    /// The point it reads (and a feature edit writes).
    pub point: Point,
    /// The point's per-position shape (`[heads, head_dim]` for `attention.heads`, read flat).
    shape: Vec<usize>,
    w_enc: Tensor,
    b_enc: Tensor,
    w_dec: Tensor,
    b_dec: Tensor,
    encoder: SaeEncoder,
    apply_b_dec_to_input: bool,
    norm: SaeNorm,
    /// Where it was read from and in which format (for `saes()`).
    pub source: (String, &'static str),
}

/// What scales a normalised row back: per-row factor and mean, `[t, 1]` each.
struct Denorm {
    scale: Option<Tensor>,
    mean: Option<Tensor>,
}

impl Sae {
    /// Moves `w` onto `device` as the SAE `name` at `point`, whose per-position shape is `shape`.
    pub fn new(name: String, point: Point, shape: Vec<usize>, w: SaeWeights, device: &Device) -> Result<Self> {
        let to =
            |t: &Tensor, what: &str| t.to_device(device).ctx(|| format!("moving SAE `{name}`'s {what} to the device"));
        let encoder = match &w.encoder {
            SaeEncoder::JumpRelu(th) => SaeEncoder::JumpRelu(to(th, "threshold")?),
            SaeEncoder::Gated { b_gate, w_mag, b_mag } => SaeEncoder::Gated {
                b_gate: to(b_gate, "b_gate")?,
                w_mag: to(w_mag, "magnitude weights")?,
                b_mag: to(b_mag, "b_mag")?,
            },
            other => other.clone(),
        };
        Ok(Self {
            point,
            shape,
            w_enc: to(&w.w_enc, "W_enc")?,
            b_enc: to(&w.b_enc, "b_enc")?,
            w_dec: to(&w.w_dec, "W_dec")?,
            b_dec: to(&w.b_dec, "b_dec")?,
            encoder,
            apply_b_dec_to_input: w.apply_b_dec_to_input,
            norm: w.norm,
            source: (w.path.display().to_string(), w.format),
            name,
        })
    }

    /// The number of features.
    pub fn d_sae(&self) -> usize {
        self.w_enc.dims()[1]
    }

    /// The input width.
    pub fn d_in(&self) -> usize {
        self.w_enc.dims()[0]
    }

    /// `x` (`[t, ...]` at the point) as float32 `[t, d_in]`.
    fn flat(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        let t = x.dim(0)?;
        x.to_dtype(DType::F32)?.reshape((t, self.d_in()))
    }

    fn normalize(&self, x: &Tensor) -> candle_core::Result<(Tensor, Denorm)> {
        match self.norm {
            SaeNorm::None => Ok((x.clone(), Denorm { scale: None, mean: None })),
            SaeNorm::ConstantNorm => {
                // SAELens: x · sqrt(d_in) / |x|, and the reconstruction divided by the same factor.
                let norm = x.sqr()?.sum_keepdim(D::Minus1)?.sqrt()?;
                let factor = ((norm.recip()?) * (self.d_in() as f64).sqrt())?;
                Ok((x.broadcast_mul(&factor)?, Denorm { scale: Some(factor.recip()?), mean: None }))
            }
            SaeNorm::LayerNorm => {
                // SAELens: (x − μ) / (σ + 1e-5), σ torch's (unbiased) standard deviation; back as y·σ + μ.
                let mean = x.mean_keepdim(D::Minus1)?;
                let centred = x.broadcast_sub(&mean)?;
                let n = x.dim(D::Minus1)?;
                let std = (centred.sqr()?.sum_keepdim(D::Minus1)? / (n.saturating_sub(1).max(1) as f64))?.sqrt()?;
                let normed = centred.broadcast_div(&(&std + 1e-5)?)?;
                Ok((normed, Denorm { scale: Some(std), mean: Some(mean) }))
            }
        }
    }

    fn denorm(&self, y: Tensor, d: &Denorm, with_mean: bool) -> candle_core::Result<Tensor> {
        let y = match &d.scale {
            Some(s) => y.broadcast_mul(s)?,
            None => y,
        };
        match (&d.mean, with_mean) {
            (Some(m), true) => y.broadcast_add(m),
            _ => Ok(y),
        }
    }

    /// Features `[t, d_sae]` of normalised rows.
    fn encode(&self, xn: &Tensor) -> candle_core::Result<Tensor> {
        let input = if self.apply_b_dec_to_input { xn.broadcast_sub(&self.b_dec)? } else { xn.clone() };
        if let SaeEncoder::Gated { b_gate, w_mag, b_mag } = &self.encoder {
            let gate = input.matmul(&self.w_enc)?.broadcast_add(b_gate)?.gt(0.0)?.to_dtype(DType::F32)?;
            let mag = input.matmul(w_mag)?.broadcast_add(b_mag)?.relu()?;
            return gate * mag;
        }
        let pre = input.matmul(&self.w_enc)?.broadcast_add(&self.b_enc)?;
        match &self.encoder {
            SaeEncoder::Relu => pre.relu(),
            SaeEncoder::JumpRelu(threshold) => pre.relu()? * pre.broadcast_gt(threshold)?.to_dtype(DType::F32)?,
            SaeEncoder::TopK(k) => top_k(&pre, *k),
            SaeEncoder::Gated { .. } => unreachable!("handled above"),
        }
    }

    /// The features of `x`'s rows, `[t, d_sae]`, dense on the device.
    pub fn features(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        self.encode(&self.normalize(&self.flat(x)?)?.0)
    }

    /// Features, reconstruction and error of `x`'s rows (the last two in the point's shape).
    pub fn run(&self, x: &Tensor) -> candle_core::Result<(Tensor, Tensor, Tensor)> {
        let flat = self.flat(x)?;
        let (xn, d) = self.normalize(&flat)?;
        let f = self.encode(&xn)?;
        let recon = self.denorm(f.matmul(&self.w_dec)?.broadcast_add(&self.b_dec)?, &d, true)?;
        let error = (&flat - &recon)?;
        let dims = x.dims();
        Ok((f, recon.reshape(dims)?, error.reshape(dims)?))
    }

    /// `x` with `edit` applied on the rows `mask` selects (`[t, 1]` of 0/1, `None`: every row).
    pub fn apply(&self, edit: &SaeEdit, x: &Tensor, mask: Option<&Tensor>) -> candle_core::Result<Tensor> {
        let flat = self.flat(x)?;
        let delta = match edit {
            SaeEdit::Steer { feature, scale } => {
                self.w_dec.narrow(0, *feature, 1)?.affine(*scale as f64, 0.0)?.broadcast_as(flat.shape())?
            }
            SaeEdit::Clamp { features, value } => {
                let (xn, d) = self.normalize(&flat)?;
                let f = self.encode(&xn)?;
                // f' − f is non-zero only at the listed features: (value − f) there, through W_dec.
                let picked = Tensor::new(features.iter().map(|&i| i as u32).collect::<Vec<_>>(), x.device())?;
                let diff = (f.index_select(&picked, 1)?.neg()? + *value as f64)?;
                let rows = self.w_dec.index_select(&picked, 0)?;
                self.denorm(diff.matmul(&rows)?, &d, false)?
            }
            SaeEdit::Splice { keep_error } => {
                if *keep_error {
                    // reconstruction + error is x itself.
                    return Ok(x.clone());
                }
                let (_, recon, _) = self.run(x)?;
                (recon.reshape(flat.shape())? - &flat)?
            }
        };
        let delta = match mask {
            Some(m) => delta.broadcast_mul(m)?,
            None => delta,
        };
        (flat + delta)?.reshape(x.dims())?.to_dtype(x.dtype())
    }

    /// The per-position shape of the point it reads.
    pub fn point_shape(&self) -> &[usize] {
        &self.shape
    }
}

/// The `k` largest entries of each row kept, ReLU'd, the rest 0 (sparsify and SAELens TopK).
fn top_k(pre: &Tensor, k: usize) -> candle_core::Result<Tensor> {
    let (t, n) = pre.dims2()?;
    let k = k.min(n);
    let host = pre.to_device(&Device::Cpu)?.to_vec2::<f32>()?;
    let mut out = vec![0f32; t * n];
    let mut order: Vec<usize> = (0..n).collect();
    for (r, row) in host.iter().enumerate() {
        order.iter_mut().enumerate().for_each(|(i, o)| *o = i);
        if k < n {
            // Ties resolved towards the lower index, as torch.topk does on the CPU in practice.
            order.select_nth_unstable_by(k, |&a, &b| row[b].total_cmp(&row[a]).then(a.cmp(&b)));
        }
        for &i in &order[..k] {
            out[r * n + i] = row[i].max(0.0);
        }
    }
    Tensor::from_vec(out, (t, n), pre.device())
}

/// The SAEs attached to one model, shared by every session over it (the engine's included), so
/// an SAE attached after an engine started is one its requests can name.
#[derive(Debug, Default)]
pub struct SaeRegistry {
    saes: RwLock<Arc<Vec<Arc<Sae>>>>,
}

impl SaeRegistry {
    /// The SAEs attached now (a snapshot: attaching later does not change it).
    pub fn current(&self) -> Arc<Vec<Arc<Sae>>> {
        Arc::clone(&self.saes.read().unwrap_or_else(|e| e.into_inner()))
    }

    /// Adds `sae`; a name already attached is refused by the caller before it gets here.
    pub fn attach(&self, sae: Sae) {
        let mut guard = self.saes.write().unwrap_or_else(|e| e.into_inner());
        let mut next = (**guard).clone();
        next.push(Arc::new(sae));
        *guard = Arc::new(next);
    }

    /// Removes the SAE called `name`; whether there was one.
    pub fn detach(&self, name: &str) -> bool {
        let mut guard = self.saes.write().unwrap_or_else(|e| e.into_inner());
        let before = guard.len();
        let next: Vec<_> = guard.iter().filter(|s| s.name != name).cloned().collect();
        let removed = next.len() != before;
        *guard = Arc::new(next);
        removed
    }
}
