//! The registry of named points (docs/observations.md): one list that both names the points a
//! model offers and tells the decoder which one it is at, so the two can never disagree.

use std::fmt;

/// A point inside one decoder layer.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum LayerPoint {
    /// The residual stream entering the layer, `[T, H]`.
    Input,
    /// Softmax attention probabilities, `[heads, T, T_total]` (observable, not editable).
    AttentionPattern,
    /// Each head's output before the output projection, `[T, heads, head_dim]`.
    AttentionHeads,
    /// What attention adds to the residual, `[T, H]`.
    AttentionOutput,
    /// The MLP's hidden activation, the input of the down projection, `[T, intermediate]` (dense
    /// MLP layers only: a mixture has one per selected expert).
    MlpHidden,
    /// A mixture's router scores before softmax and top-k (bias included), `[T, experts]`.
    RouterLogits,
    /// The weight each expert's output got in the mix, 0 where not selected, `[T, experts]`.
    ExpertWeights,
    /// What the MLP adds to the residual, `[T, H]`.
    MlpOutput,
    /// The residual stream leaving the layer, `[T, H]`.
    Output,
}

impl LayerPoint {
    /// Every layer point any layer may have, in forward order.
    pub const ALL: [LayerPoint; 9] = [
        Self::Input,
        Self::AttentionPattern,
        Self::AttentionHeads,
        Self::AttentionOutput,
        Self::MlpHidden,
        Self::RouterLogits,
        Self::ExpertWeights,
        Self::MlpOutput,
        Self::Output,
    ];

    /// Whether a layer has this point: a dense MLP's layer has `mlp.hidden`, a mixture of
    /// experts' layer `mlp.router_logits` and `mlp.expert_weights` instead.
    pub fn in_layer(self, sparse: bool) -> bool {
        match self {
            Self::MlpHidden => !sparse,
            Self::RouterLogits | Self::ExpertWeights => sparse,
            _ => true,
        }
    }

    /// The name's suffix after `model.layers.{i}.`.
    pub fn suffix(self) -> &'static str {
        match self {
            Self::Input => "input",
            Self::AttentionPattern => "attention.pattern",
            Self::AttentionHeads => "attention.heads",
            Self::AttentionOutput => "attention.output",
            Self::MlpHidden => "mlp.hidden",
            Self::RouterLogits => "mlp.router_logits",
            Self::ExpertWeights => "mlp.expert_weights",
            Self::MlpOutput => "mlp.output",
            Self::Output => "output",
        }
    }
}

/// One named point of the forward pass.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Point {
    /// `model.embed_tokens`: token embeddings after any scaling, `[T, H]`.
    Embed,
    /// `model.layers.{i}.…`.
    Layer(usize, LayerPoint),
    /// `model.norm`: the final norm's output, `[T, H]`.
    Norm,
    /// `model.logits`, `[T, V]`.
    Logits,
}

impl Point {
    /// Every point of a dense model with `num_layers` layers, in forward order.
    pub fn all(num_layers: usize) -> Vec<Point> {
        Self::for_layers(&vec![false; num_layers])
    }

    /// Every point of a model whose layer `i` mixes experts where `sparse[i]`, in forward order.
    pub fn for_layers(sparse: &[bool]) -> Vec<Point> {
        let mut v = vec![Point::Embed];
        for (i, &s) in sparse.iter().enumerate() {
            v.extend(LayerPoint::ALL.iter().filter(|p| p.in_layer(s)).map(|&p| Point::Layer(i, p)));
        }
        v.push(Point::Norm);
        v.push(Point::Logits);
        v
    }

    /// Reads a dotted path; `None` when it names no point of any model.
    pub fn parse(path: &str) -> Option<Point> {
        match path {
            "model.embed_tokens" => return Some(Point::Embed),
            "model.norm" => return Some(Point::Norm),
            "model.logits" => return Some(Point::Logits),
            _ => {}
        }
        let rest = path.strip_prefix("model.layers.")?;
        let (index, suffix) = rest.split_once('.')?;
        // Only canonical decimal indices name a layer ("01" or "+1" would alias another path).
        if index.is_empty() || !index.bytes().all(|b| b.is_ascii_digit()) || (index.len() > 1 && index.starts_with('0'))
        {
            return None;
        }
        let layer = index.parse().ok()?;
        LayerPoint::ALL.iter().find(|p| p.suffix() == suffix).map(|&p| Point::Layer(layer, p))
    }

    /// The layer this point belongs to, if any.
    pub fn layer(self) -> Option<usize> {
        match self {
            Point::Layer(i, _) => Some(i),
            _ => None,
        }
    }
}

impl fmt::Display for Point {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Point::Embed => f.write_str("model.embed_tokens"),
            Point::Layer(i, p) => write!(f, "model.layers.{i}.{}", p.suffix()),
            Point::Norm => f.write_str("model.norm"),
            Point::Logits => f.write_str("model.logits"),
        }
    }
}

/// A point a sparse autoencoder attached to a model adds (`sae.{name}.{suffix}`, DESIGN §15):
/// computed from the value at the SAE's own point, where the decoder produces it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum SaePoint {
    /// The SAE's features, sparse per position (`ObservationValue::Sparse`, `[T, d_sae]`).
    Features,
    /// `f W_dec + b_dec` (de-normalised), `[T, d_in]`.
    Reconstruction,
    /// `x − reconstruction`, `[T, d_in]`.
    Error,
}

impl SaePoint {
    /// Every SAE point, in the order they are computed.
    pub const ALL: [SaePoint; 3] = [Self::Features, Self::Reconstruction, Self::Error];

    /// The name's last segment.
    pub fn suffix(self) -> &'static str {
        match self {
            Self::Features => "features",
            Self::Reconstruction => "reconstruction",
            Self::Error => "error",
        }
    }

    /// The full name of this point of the SAE called `sae`.
    pub fn path(self, sae: &str) -> String {
        format!("sae.{sae}.{}", self.suffix())
    }

    /// Reads `sae.{name}.{suffix}` into the SAE's name and the point.
    pub fn parse(path: &str) -> Option<(&str, SaePoint)> {
        let rest = path.strip_prefix("sae.")?;
        let (name, suffix) = rest.rsplit_once('.')?;
        let point = Self::ALL.into_iter().find(|p| p.suffix() == suffix)?;
        (!name.is_empty()).then_some((name, point))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sae_points_read_back() {
        for p in SaePoint::ALL {
            assert_eq!(SaePoint::parse(&p.path("res.6")), Some(("res.6", p)));
        }
        assert_eq!(SaePoint::parse("sae..features"), None);
        assert_eq!(SaePoint::parse("sae.x.other"), None);
    }

    #[test]
    fn every_point_reads_back_from_its_name() {
        for p in Point::all(12).into_iter().chain(Point::for_layers(&[true, false])) {
            assert_eq!(Point::parse(&p.to_string()), Some(p));
        }
        let moe = Point::for_layers(&[true]);
        assert!(moe.contains(&Point::Layer(0, LayerPoint::RouterLogits)));
        assert!(!moe.contains(&Point::Layer(0, LayerPoint::MlpHidden)));
        for bad in ["model.layers.01.output", "model.layers..output", "model.layers.1", "model.layers.1.foo", "x"] {
            assert_eq!(Point::parse(bad), None, "{bad}");
        }
    }
}
