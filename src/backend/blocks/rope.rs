//! Rotary position embeddings: frequencies per layer kind, cos/sin per step.

use candle_core::{Device, Tensor};

use crate::backend::config::{RopeConfig, RopeScaling};

/// The inverse frequencies of one rotary embedding, scaling applied.
#[derive(Debug, Clone)]
pub struct Rope {
    inv_freq: Vec<f32>,
    position_scale: f32,
    /// Multiplier of the cos and sin tables (YaRN's attention factor; 1 otherwise).
    table_scale: f32,
}

impl Rope {
    /// Frequencies for `rotary_dim` rotated dimensions, as transformers computes them (in float32).
    pub fn new(cfg: &RopeConfig, rotary_dim: usize) -> Self {
        let mut inv_freq: Vec<f32> =
            (0..rotary_dim / 2).map(|i| (1.0 / cfg.theta.powf((2 * i) as f64 / rotary_dim as f64)) as f32).collect();
        let mut position_scale = 1.0;
        let mut table_scale = 1.0;
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
            RopeScaling::Yarn {
                factor,
                original_max_position_embeddings,
                beta_fast,
                beta_slow,
                truncate,
                attention_factor,
            } => {
                // transformers' `_compute_yarn_parameters`: the dimension a number of rotations over
                // the original context lands on bounds a linear ramp from extrapolated (original)
                // to interpolated (divided by `factor`) frequencies.
                let dim = rotary_dim as f64;
                let base = cfg.theta;
                let correction = |rotations: f64| {
                    dim * (original_max_position_embeddings / (rotations * 2.0 * std::f64::consts::PI)).ln()
                        / (2.0 * base.ln())
                };
                let (mut low, mut high) = (correction(beta_fast), correction(beta_slow));
                if truncate {
                    (low, high) = (low.floor(), high.ceil());
                }
                let (low, mut high) = (low.max(0.0), high.min(dim - 1.0));
                if low == high {
                    high += 0.001;
                }
                for (i, f) in inv_freq.iter_mut().enumerate() {
                    let ramp = ((i as f64 - low) / (high - low)).clamp(0.0, 1.0);
                    let extrapolation = 1.0 - ramp;
                    let freq = *f as f64;
                    *f = (freq / factor * (1.0 - extrapolation) + freq * extrapolation) as f32;
                }
                table_scale = attention_factor as f32;
            }
        }
        Self { inv_freq, position_scale, table_scale }
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
                cos.push(angle.cos() * self.table_scale);
                sin.push(angle.sin() * self.table_scale);
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
