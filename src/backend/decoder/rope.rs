//! Rotary position embeddings: frequencies per layer kind, cos/sin per step.

use candle_core::{Device, Tensor};

use crate::backend::config::{RopeConfig, RopeScaling};

/// The inverse frequencies of one rotary embedding, scaling applied.
#[derive(Debug, Clone)]
pub struct Rope {
    inv_freq: Vec<f32>,
    position_scale: f32,
}

impl Rope {
    /// Frequencies for `rotary_dim` rotated dimensions, as transformers computes them (in float32).
    pub fn new(cfg: &RopeConfig, rotary_dim: usize) -> Self {
        let mut inv_freq: Vec<f32> =
            (0..rotary_dim / 2).map(|i| (1.0 / cfg.theta.powf((2 * i) as f64 / rotary_dim as f64)) as f32).collect();
        let mut position_scale = 1.0;
        match cfg.scaling {
            RopeScaling::None => {}
            RopeScaling::Linear { factor } => position_scale = (1.0 / factor) as f32,
            RopeScaling::Llama3 { factor, low_freq_factor, high_freq_factor, original_max_position_embeddings } => {
                let low_wavelen = original_max_position_embeddings / low_freq_factor;
                let high_wavelen = original_max_position_embeddings / high_freq_factor;
                for f in inv_freq.iter_mut() {
                    let freq = *f as f64;
                    let wavelen = 2.0 * std::f64::consts::PI / freq;
                    *f = if wavelen < high_wavelen {
                        freq
                    } else if wavelen > low_wavelen {
                        freq / factor
                    } else {
                        let smooth = (original_max_position_embeddings / wavelen - low_freq_factor)
                            / (high_freq_factor - low_freq_factor);
                        (1.0 - smooth) * freq / factor + smooth * freq
                    } as f32;
                }
            }
        }
        Self { inv_freq, position_scale }
    }

    /// Float32 cos and sin tables `[t, rotary_dim / 2]` for positions `start..start + t`.
    pub fn tables(&self, start: usize, t: usize, device: &Device) -> candle_core::Result<(Tensor, Tensor)> {
        let half = self.inv_freq.len();
        let mut cos = Vec::with_capacity(t * half);
        let mut sin = Vec::with_capacity(t * half);
        for p in start..start + t {
            let p = p as f32 * self.position_scale;
            for &f in &self.inv_freq {
                let angle = p * f;
                cos.push(angle.cos());
                sin.push(angle.sin());
            }
        }
        Ok((Tensor::from_vec(cos, (t, half), device)?, Tensor::from_vec(sin, (t, half), device)?))
    }
}

/// Rotates the first `cos.dim(1) * 2` dimensions of `x` `[1, heads, t, head_dim]`.
pub fn apply(x: &Tensor, cos: &Tensor, sin: &Tensor, interleaved: bool) -> candle_core::Result<Tensor> {
    let head_dim = x.dim(3)?;
    let rot = cos.dim(1)? * 2;
    let rope = |x: &Tensor| {
        if interleaved {
            candle_nn::rotary_emb::rope_i(x, cos, sin)
        } else {
            candle_nn::rotary_emb::rope(x, cos, sin)
        }
    };
    if rot == head_dim {
        rope(&x.contiguous()?)
    } else {
        let rotated = rope(&x.narrow(3, 0, rot)?.contiguous()?)?;
        let pass = x.narrow(3, rot, head_dim - rot)?;
        Tensor::cat(&[rotated, pass], 3)
    }
}
