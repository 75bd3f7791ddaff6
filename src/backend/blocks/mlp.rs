//! `Mlp`: the feed-forward of a dense layer, gated or plain, over `Linear`s.

use candle_core::{Tensor, D};

use super::linear::Linear;
use crate::backend::config::{Activation, ExpertGlu};

/// The MLP: gated, `down(act(gate(x)) * up(x))`, or plain, `down(act(up(x)))`.
#[derive(Debug, Clone)]
pub struct Mlp {
    /// Separate gate and up, one fused map whose output halves are gate then up, or up alone.
    pub gate_up: GateUp,
    /// The down projection.
    pub down: Linear,
    /// The gate's activation.
    pub activation: Activation,
    /// How gate and up combine: `act(gate) · up`, or gpt-oss's clamped SwiGLU.
    pub glu: ExpertGlu,
}

/// The MLP's input projections.
#[derive(Debug, Clone)]
pub enum GateUp {
    /// Two maps.
    Separate {
        /// The gate.
        gate: Linear,
        /// The up projection.
        up: Linear,
    },
    /// One map of twice the width (Phi-3).
    Fused(Linear),
    /// No gate: the activation of the up projection is the hidden state (GPT-2, GPT-NeoX).
    Ungated(Linear),
}

impl Mlp {
    /// The MLP's projections, for summaries.
    pub fn linears(&self) -> Vec<&Linear> {
        match &self.gate_up {
            GateUp::Separate { gate, up } => vec![gate, up, &self.down],
            GateUp::Fused(l) | GateUp::Ungated(l) => vec![l, &self.down],
        }
    }

    /// The MLP's projections, to change their weights (`linears`' order).
    pub fn linears_mut(&mut self) -> Vec<&mut Linear> {
        match &mut self.gate_up {
            GateUp::Separate { gate, up } => vec![gate, up, &mut self.down],
            GateUp::Fused(l) | GateUp::Ungated(l) => vec![l, &mut self.down],
        }
    }

    /// Applies the MLP to `[rows, hidden]`, passing its hidden activation through `at_hidden`
    /// (where hooks observe or edit it).
    pub fn forward(
        &self,
        x: &Tensor,
        at_hidden: impl FnOnce(Tensor) -> candle_core::Result<Tensor>,
    ) -> candle_core::Result<Tensor> {
        let (gate, up) = match &self.gate_up {
            GateUp::Separate { gate, up } => (gate.forward(x)?, up.forward(x)?),
            GateUp::Fused(gu) => {
                let y = gu.forward(x)?;
                let half = y.dim(D::Minus1)? / 2;
                (y.narrow(D::Minus1, 0, half)?, y.narrow(D::Minus1, half, half)?)
            }
            GateUp::Ungated(up) => {
                let hidden = at_hidden(super::activation::apply(self.activation, &up.forward(x)?)?)?;
                return self.down.forward(&hidden);
            }
        };
        let hidden = match self.glu {
            ExpertGlu::Gated => super::activation::gated(self.activation, &gate, &up)?,
            ExpertGlu::ClampedSwiGlu { alpha, limit } => {
                let gate = gate.minimum(limit)?;
                let up = up.clamp(-limit, limit)?;
                let glu = (&gate * candle_nn::ops::sigmoid(&(&gate * alpha)?)?)?;
                ((up + 1.0)? * glu)?
            }
        };
        let hidden = at_hidden(hidden)?;
        self.down.forward(&hidden)
    }
}
