//! The feed-forward of a block: a dense MLP or a mixture of experts.
//!
//! A mixture routes each token to a few experts: the router's logits (the
//! `mlp.router_logits` point) become mixing weights by the architecture's rule (the
//! `mlp.expert_weights` point, zero where an expert was not selected), and every expert with a
//! non-zero weight runs over the tokens that selected it, one matmul per expert over its tokens.
//! A decode step therefore reads only the selected experts' weights. The experts are ordinary
//! `Mlp`s over `Linear`s, so quantized experts run on the same kernels as any projection. A shared
//! expert (Qwen2-MoE, Granite MoE Shared) runs over every token outside the routing, so the
//! router points neither show nor steer it.

use candle_core::quantized::QMatMul;
use candle_core::{DType, Tensor};

use super::linear::Linear;
use super::mlp::{GateUp, Mlp};
use crate::backend::config::{Activation, Architecture, MoeConfig, Routing, SharedExpert};
use crate::backend::error::{CandleContext, Result};
use crate::backend::kernels::Weight;
use crate::backend::weights::names::Naming;
use crate::backend::weights::WeightLoader;
use crate::core::LayerPoint;

/// A block's feed-forward.
#[derive(Debug, Clone)]
pub enum FeedForward {
    /// One MLP for every token.
    Dense(Mlp),
    /// A mixture of experts.
    Moe(Moe),
}

impl FeedForward {
    /// Every projection, for summaries.
    pub fn linears(&self) -> Vec<&Linear> {
        match self {
            Self::Dense(mlp) => mlp.linears(),
            Self::Moe(moe) => {
                let shared = moe.shared.iter().flat_map(|s| s.mlp.linears().into_iter().chain(&s.gate));
                std::iter::once(&moe.router).chain(moe.experts.iter().flat_map(Mlp::linears)).chain(shared).collect()
            }
        }
    }

    /// Every projection, to change their weights (`linears`' order).
    pub fn linears_mut(&mut self) -> Vec<&mut Linear> {
        match self {
            Self::Dense(mlp) => mlp.linears_mut(),
            Self::Moe(moe) => {
                let shared = moe.shared.iter_mut().flat_map(|s| s.mlp.linears_mut().into_iter().chain(&mut s.gate));
                std::iter::once(&mut moe.router)
                    .chain(moe.experts.iter_mut().flat_map(Mlp::linears_mut))
                    .chain(shared)
                    .collect()
            }
        }
    }

    /// Applies the feed-forward to float32 `[rows, hidden]`; `at` is offered `mlp.hidden` (dense)
    /// or `mlp.router_logits` and `mlp.expert_weights` (mixture), and returns them, edited or not.
    pub fn forward(
        &self,
        x: &Tensor,
        mut at: impl FnMut(LayerPoint, Tensor) -> candle_core::Result<Tensor>,
    ) -> candle_core::Result<Tensor> {
        match self {
            Self::Dense(mlp) => mlp.forward(x, |h| at(LayerPoint::MlpHidden, h)),
            Self::Moe(moe) => moe.forward(x, at),
        }
    }
}

/// One layer's mixture of experts.
#[derive(Debug, Clone)]
pub struct Moe {
    /// `[experts, hidden]` scores (with gpt-oss's bias).
    router: Linear,
    /// The experts, each a gated MLP.
    experts: Vec<Mlp>,
    /// Experts selected per token.
    top_k: usize,
    /// How logits become weights.
    routing: Routing,
    /// The expert every token runs, where the architecture has one.
    shared: Option<Shared>,
}

/// An always-on expert and its optional gate.
#[derive(Debug, Clone)]
struct Shared {
    /// The expert.
    mlp: Mlp,
    /// `[1, hidden]`: the output is scaled per token by the sigmoid of this score (Qwen2-MoE).
    gate: Option<Linear>,
}

impl Shared {
    /// The expert's contribution for float32 `x` `[rows, hidden]`.
    fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        let y = self.mlp.forward(x, Ok)?;
        match &self.gate {
            Some(gate) => y.broadcast_mul(&candle_nn::ops::sigmoid(&gate.forward(x)?)?),
            None => Ok(y),
        }
    }
}

impl Moe {
    /// The mixing weights of one token's router logits: the selected experts' weights, the others 0.
    fn route(&self, logits: &[f32], weights: &mut [f32]) {
        let k = self.top_k;
        let mut order: Vec<usize> = (0..logits.len()).collect();
        // Descending; ties keep the lower index first, as torch.topk does on CPU.
        order.sort_by(|&a, &b| logits[b].total_cmp(&logits[a]).then(a.cmp(&b)));
        let top = &order[..k];
        let softmax = |xs: &mut dyn Iterator<Item = f32>| -> Vec<f64> {
            let xs: Vec<f64> = xs.map(f64::from).collect();
            let max = xs.iter().copied().fold(f64::NEG_INFINITY, f64::max);
            let e: Vec<f64> = xs.iter().map(|x| (x - max).exp()).collect();
            let sum: f64 = e.iter().sum();
            e.into_iter().map(|v| v / sum).collect()
        };
        match self.routing {
            Routing::SoftmaxTopK { renormalize } => {
                let p = softmax(&mut logits.iter().copied());
                let sum: f64 = if renormalize { top.iter().map(|&e| p[e]).sum() } else { 1.0 };
                for &e in top {
                    weights[e] = (p[e] / sum) as f32;
                }
            }
            Routing::TopKSoftmax => {
                let p = softmax(&mut top.iter().map(|&e| logits[e]));
                for (&e, w) in top.iter().zip(p) {
                    weights[e] = w as f32;
                }
            }
        }
    }

    /// The mixture over float32 `x` `[rows, hidden]`.
    fn forward(
        &self,
        x: &Tensor,
        mut at: impl FnMut(LayerPoint, Tensor) -> candle_core::Result<Tensor>,
    ) -> candle_core::Result<Tensor> {
        let logits = at(LayerPoint::RouterLogits, self.router.forward(x)?)?;
        let (rows, n) = logits.dims2()?;
        if n != self.experts.len() {
            candle_core::bail!("router logits have {n} columns for {} experts", self.experts.len())
        }
        // Selection runs on the host after the hook, so an edit of the logits changes it.
        let host = logits.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?;
        let mut weights = vec![0f32; rows * n];
        for (l, w) in host.chunks_exact(n).zip(weights.chunks_exact_mut(n)) {
            self.route(l, w);
        }
        let weights = Tensor::from_vec(weights, (rows, n), x.device())?;
        // The mix uses the weights as the hook returns them: a zero ablates, a non-zero runs.
        let weights = at(LayerPoint::ExpertWeights, weights)?.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?;
        let mut out = match &self.shared {
            Some(shared) => shared.forward(x)?.to_dtype(DType::F32)?,
            None => x.zeros_like()?.to_dtype(DType::F32)?,
        };
        for (e, expert) in self.experts.iter().enumerate() {
            let selected: Vec<u32> = (0..rows).filter(|&r| weights[r * n + e] != 0.0).map(|r| r as u32).collect();
            if selected.is_empty() {
                continue;
            }
            let coef: Vec<f32> = selected.iter().map(|&r| weights[r as usize * n + e]).collect();
            let coef = Tensor::from_vec(coef, (selected.len(), 1), x.device())?;
            if selected.len() == rows {
                out = (out + expert.forward(x, Ok)?.broadcast_mul(&coef)?)?;
            } else {
                let index = Tensor::new(selected.as_slice(), x.device())?;
                let y = expert.forward(&x.index_select(&index, 0)?, Ok)?.broadcast_mul(&coef)?;
                out = out.index_add(&index, &y, 0)?;
            }
        }
        Ok(out)
    }

    /// Loads layer `layer`'s router and experts from a Hugging Face or GGUF checkpoint.
    pub fn load(
        w: &WeightLoader<'_>,
        arch: Architecture,
        naming: Naming,
        layer: usize,
        hidden: usize,
        moe: &MoeConfig,
        activation: Activation,
    ) -> Result<Self> {
        let (e_count, inter) = (moe.num_experts, moe.expert_intermediate_size);
        let stem = format!("{}{layer}", naming.layer_prefix(arch));
        let linear = |name: String, out: usize, inp: usize, bias: bool| -> Result<Linear> {
            let weight = w.matmul(&format!("{name}.weight"), out, inp)?;
            let bias = if bias { Some(w.dense_f32(&format!("{name}.bias"), &[out])?) } else { None };
            Ok(Linear::new(weight, bias))
        };
        let mlp = |gate_up: GateUp, down: Linear| Mlp { gate_up, down, activation, glu: moe.glu };
        // The router stays dense even when quantization at load is asked for, as llama.cpp's
        // quantizer leaves `ffn_gate_inp` alone: it is small, and its rounding moves near-tie
        // selections to other experts.
        let router_linear = |name: String, bias: bool| -> Result<Linear> {
            let weight = w.dense(&format!("{name}.weight"), &[e_count, hidden])?;
            let bias = if bias { Some(w.dense_f32(&format!("{name}.bias"), &[e_count])?) } else { None };
            Ok(Linear::new(Weight::Candle(QMatMul::Tensor(weight)), bias))
        };
        let (router, experts) = match (naming, arch) {
            // llama.cpp's names: the router `ffn_gate_inp`, each projection of every expert in one
            // 3-D `ffn_{gate,up,down}_exps` tensor, whose expert slices load as their own weights.
            (Naming::Gguf, _) => {
                let p = format!("blk.{layer}");
                let router = router_linear(format!("{p}.ffn_gate_inp"), moe.router_bias)?;
                let bias = |part: &str, width: usize| -> Result<Option<Tensor>> {
                    if !moe.expert_bias {
                        return Ok(None);
                    }
                    let name = format!("{p}.ffn_{part}_exps.bias");
                    Ok(Some(w.dense_f32(&name, &[e_count, width])?))
                };
                let (gate_b, up_b, down_b) = (bias("gate", inter)?, bias("up", inter)?, bias("down", hidden)?);
                let experts = (0..e_count)
                    .map(|e| {
                        let piece = |part: &str, out: usize, inp: usize, b: &Option<Tensor>| -> Result<Linear> {
                            let name = format!("{p}.ffn_{part}_exps");
                            let weight = w.expert_matmul(&format!("{name}.weight"), e, e_count, out, inp)?;
                            let bias = b
                                .as_ref()
                                .map(|b| b.get(e))
                                .transpose()
                                .ctx(|| format!("expert {e} of `{name}.bias`"))?;
                            Ok(Linear::new(weight, bias))
                        };
                        Ok(mlp(
                            GateUp::Separate {
                                gate: piece("gate", inter, hidden, &gate_b)?,
                                up: piece("up", inter, hidden, &up_b)?,
                            },
                            piece("down", hidden, inter, &down_b)?,
                        ))
                    })
                    .collect::<Result<Vec<_>>>()?;
                (router, experts)
            }
            // Per-expert tensors: gate, up, down of each expert under `experts.{e}`.
            (_, Architecture::Qwen3Moe | Architecture::Qwen2Moe | Architecture::Olmoe | Architecture::Mixtral) => {
                let (block, gate, up, down) = match arch {
                    Architecture::Mixtral => ("block_sparse_moe", "w1", "w3", "w2"),
                    _ => ("mlp", "gate_proj", "up_proj", "down_proj"),
                };
                let router = router_linear(format!("{stem}.{block}.gate"), false)?;
                let experts = (0..e_count)
                    .map(|e| {
                        let p = format!("{stem}.{block}.experts.{e}");
                        Ok(mlp(
                            GateUp::Separate {
                                gate: linear(format!("{p}.{gate}"), inter, hidden, false)?,
                                up: linear(format!("{p}.{up}"), inter, hidden, false)?,
                            },
                            linear(format!("{p}.{down}"), hidden, inter, false)?,
                        ))
                    })
                    .collect::<Result<Vec<_>>>()?;
                (router, experts)
            }
            // Granite MoE: `input_linear` [experts, 2·inter, hidden] (gate rows, then up rows) and
            // `output_linear` [experts, hidden, inter], both in the [out, in] layout.
            (_, Architecture::GraniteMoe) => {
                let p = format!("{stem}.block_sparse_moe");
                let router = router_linear(format!("{p}.router.layer"), false)?;
                let (gu_name, down_name) = (format!("{p}.input_linear.weight"), format!("{p}.output_linear.weight"));
                let gate_up = w.dense(&gu_name, &[e_count, 2 * inter, hidden])?;
                let down = w.dense(&down_name, &[e_count, hidden, inter])?;
                let experts = (0..e_count)
                    .map(|e| {
                        let piece = |t: &Tensor, name: &str| -> Result<Linear> {
                            let one = t.get(e).ctx(|| format!("expert {e} of `{name}`"))?;
                            Ok(Linear::new(w.matmul_from(&format!("{name}[{e}]"), one)?, None))
                        };
                        Ok(mlp(GateUp::Fused(piece(&gate_up, &gu_name)?), piece(&down, &down_name)?))
                    })
                    .collect::<Result<Vec<_>>>()?;
                (router, experts)
            }
            // gpt-oss: `gate_up_proj` [experts, hidden, 2·inter] in the [in, out] layout with gate
            // and up interleaved column by column, `down_proj` [experts, inter, hidden], and biases.
            (_, Architecture::GptOss) => {
                let p = format!("{stem}.mlp");
                let router = router_linear(format!("{p}.router"), moe.router_bias)?;
                let names = ["gate_up_proj", "gate_up_proj_bias", "down_proj", "down_proj_bias"]
                    .map(|n| format!("{p}.experts.{n}"));
                let gate_up = w.dense(&names[0], &[e_count, hidden, 2 * inter])?;
                let gate_up_bias = w.dense_f32(&names[1], &[e_count, 2 * inter])?;
                let down = w.dense(&names[2], &[e_count, inter, hidden])?;
                let down_bias = w.dense_f32(&names[3], &[e_count, hidden])?;
                let experts = (0..e_count)
                    .map(|e| {
                        let ctx = |what: &str| format!("expert {e} of `{what}`");
                        // [hidden, 2·inter] → [inter, 2, hidden]: row pairs (gate, up) per unit.
                        let gu =
                            gate_up.get(e).and_then(|t| t.t()?.reshape((inter, 2, hidden))).ctx(|| ctx(&names[0]))?;
                        let gub = gate_up_bias.get(e).and_then(|t| t.reshape((inter, 2))).ctx(|| ctx(&names[1]))?;
                        let half = |k: usize, what: &str| -> Result<Linear> {
                            let weight = gu.narrow(1, k, 1).and_then(|t| t.squeeze(1)).ctx(|| ctx(&names[0]))?;
                            let bias =
                                gub.narrow(1, k, 1).and_then(|t| t.squeeze(1)?.contiguous()).ctx(|| ctx(&names[1]))?;
                            Ok(Linear::new(w.matmul_from(&format!("{}[{e}].{what}", names[0]), weight)?, Some(bias)))
                        };
                        let down_w = down.get(e).and_then(|t| t.t()).ctx(|| ctx(&names[2]))?;
                        let down_b = down_bias.get(e).ctx(|| ctx(&names[3]))?;
                        let down = Linear::new(w.matmul_from(&format!("{}[{e}]", names[2]), down_w)?, Some(down_b));
                        Ok(mlp(GateUp::Separate { gate: half(0, "gate")?, up: half(1, "up")? }, down))
                    })
                    .collect::<Result<Vec<_>>>()?;
                (router, experts)
            }
            (_, other) => {
                return Err(crate::backend::error::CandleError::UnsupportedConfig {
                    what: format!("a mixture of experts in {} checkpoints", other.name()),
                })
            }
        };
        let shared = match moe.shared_expert {
            Some(shared) => Some(Shared::load(w, arch, naming, &stem, layer, hidden, shared, &mlp)?),
            None => None,
        };
        Ok(Self { router, experts, top_k: moe.experts_per_token, routing: moe.routing, shared })
    }
}

impl Shared {
    /// Loads layer `layer`'s shared expert (`stem` is the layer's Hugging Face prefix), its
    /// projections built into an `Mlp` by `mlp`.
    #[allow(clippy::too_many_arguments)]
    fn load(
        w: &WeightLoader<'_>,
        arch: Architecture,
        naming: Naming,
        stem: &str,
        layer: usize,
        hidden: usize,
        shared: SharedExpert,
        mlp: &dyn Fn(GateUp, Linear) -> Mlp,
    ) -> Result<Self> {
        let inter = shared.intermediate_size;
        let linear = |name: String, out: usize, inp: usize| -> Result<Linear> {
            Ok(Linear::new(w.matmul(&format!("{name}.weight"), out, inp)?, None))
        };
        // The gate's `[1, hidden]` weight (GGUF files hold it as that or as `[hidden]`), as a map
        // to one score.
        let gate = |name: String| -> Result<Linear> {
            let dims = if w.shape(&name) == Some(vec![hidden]) { vec![hidden] } else { vec![1, hidden] };
            let weight = w.dense(&name, &dims)?.reshape((1, hidden)).ctx(|| format!("`{name}` as [1, {hidden}]"))?;
            Ok(Linear::new(Weight::Candle(QMatMul::Tensor(weight)), None))
        };
        let (mlp, gate) = match (naming, arch) {
            (Naming::Gguf, _) => {
                let p = format!("blk.{layer}");
                let part = |part: &str, out: usize, inp: usize| linear(format!("{p}.ffn_{part}_shexp"), out, inp);
                let gate_up = GateUp::Separate { gate: part("gate", inter, hidden)?, up: part("up", inter, hidden)? };
                let g = if shared.gated { Some(gate(format!("{p}.ffn_gate_inp_shexp.weight"))?) } else { None };
                (mlp(gate_up, part("down", hidden, inter)?), g)
            }
            (_, Architecture::GraniteMoe) => {
                // `input_linear` [2·inter, hidden]: gate rows, then up rows.
                let p = format!("{stem}.shared_mlp");
                let gate_up = GateUp::Fused(linear(format!("{p}.input_linear"), 2 * inter, hidden)?);
                (mlp(gate_up, linear(format!("{p}.output_linear"), hidden, inter)?), None)
            }
            (_, Architecture::Qwen2Moe) => {
                let p = format!("{stem}.mlp.shared_expert");
                let part = |part: &str, out: usize, inp: usize| linear(format!("{p}.{part}_proj"), out, inp);
                let gate_up = GateUp::Separate { gate: part("gate", inter, hidden)?, up: part("up", inter, hidden)? };
                let g = gate(format!("{stem}.mlp.shared_expert_gate.weight"))?;
                (mlp(gate_up, part("down", hidden, inter)?), Some(g))
            }
            (_, other) => {
                return Err(crate::backend::error::CandleError::UnsupportedConfig {
                    what: format!("a shared expert in {} checkpoints", other.name()),
                })
            }
        };
        Ok(Self { mlp, gate })
    }
}

/// The name of a layer's attention sink logits `[heads]` (gpt-oss).
pub fn sinks_name(naming: Naming, arch: Architecture, layer: usize) -> String {
    match naming {
        Naming::HuggingFace => format!("{}{layer}.self_attn.sinks", naming.layer_prefix(arch)),
        Naming::Gguf => format!("blk.{layer}.attn_sinks.weight"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;

    use crate::backend::config::ExpertGlu;

    fn moe(routing: Routing, top_k: usize, experts: usize) -> Moe {
        let dev = Device::Cpu;
        let lin = |o: usize, i: usize| {
            Linear::new(Weight::Candle(QMatMul::Tensor(Tensor::ones((o, i), DType::F32, &dev).unwrap())), None)
        };
        let mlp = || Mlp {
            gate_up: GateUp::Separate { gate: lin(2, 3), up: lin(2, 3) },
            down: lin(3, 2),
            activation: Activation::Silu,
            glu: ExpertGlu::Gated,
        };
        Moe { router: lin(experts, 3), experts: (0..experts).map(|_| mlp()).collect(), top_k, routing, shared: None }
    }

    #[test]
    fn routing_rules() {
        let logits = [1.0f32, 3.0, 2.0, 0.0];
        let mut w = [0f32; 4];
        moe(Routing::SoftmaxTopK { renormalize: false }, 2, 4).route(&logits, &mut w);
        let z: f64 = logits.iter().map(|&l| (l as f64).exp()).sum();
        assert!((w[1] as f64 - 3f64.exp() / z).abs() < 1e-6 && w[0] == 0.0 && w[3] == 0.0);
        let mut w = [0f32; 4];
        moe(Routing::SoftmaxTopK { renormalize: true }, 2, 4).route(&logits, &mut w);
        assert!((w[1] + w[2] - 1.0).abs() < 1e-6);
        let mut w = [0f32; 4];
        moe(Routing::TopKSoftmax, 2, 4).route(&logits, &mut w);
        assert!((w[1] as f64 - 1.0 / (1.0 + (-1f64).exp())).abs() < 1e-6);
        // NaN logits select something without panicking.
        let mut w = [0f32; 4];
        moe(Routing::TopKSoftmax, 2, 4).route(&[f32::NAN, 1.0, 0.0, 2.0], &mut w);
    }

    #[test]
    fn ablated_weights_skip_experts() {
        let m = moe(Routing::TopKSoftmax, 2, 4);
        let x = Tensor::new(&[[0.1f32, 0.2, 0.3], [0.3, 0.2, 0.1]], &Device::Cpu).unwrap();
        let out = m.forward(&x, |p, t| if p == LayerPoint::ExpertWeights { t.zeros_like() } else { Ok(t) }).unwrap();
        assert_eq!(out.sum_all().unwrap().to_scalar::<f32>().unwrap(), 0.0);
    }
}
