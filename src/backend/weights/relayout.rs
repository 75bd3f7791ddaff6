//! Checkpoints whose tensors are stored otherwise than the decoder reads them, presented in its
//! layout: every projection `[out, in]`, a fused projection's output as all queries, then all
//! keys, then all values. The rewrite happens as a tensor is read, so nothing else learns of it.

use candle_core::{DType, Device, Tensor};

use super::WeightSource;
use crate::backend::config::{ArchConfig, Architecture};
use crate::backend::error::{CandleContext, Result};

/// How one stored tensor differs from the decoder's layout.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Rewrite {
    /// GPT-2's `Conv1D` stores `[in, out]`.
    Transpose,
    /// GPT-NeoX's `query_key_value` groups its output by head: q, k, v of head 0, then of head 1, ...
    QkvByHead { heads: usize },
}

/// A weight source rewriting the tensors of one architecture as they are read.
pub struct Relayout<S> {
    inner: S,
    arch: Architecture,
    heads: usize,
    /// Whether the checkpoint names GPT-2's tensors without the `transformer.` prefix (as the
    /// original OpenAI conversion does).
    bare_gpt2_names: bool,
}

/// `inner` as the decoder reads it for `config`: rewritten where the architecture needs it,
/// untouched otherwise.
pub fn for_architecture<S: WeightSource + 'static>(inner: S, config: &ArchConfig) -> Box<dyn WeightSource> {
    match config.architecture {
        Architecture::Gpt2 | Architecture::GptNeoX => {
            let bare_gpt2_names = config.architecture == Architecture::Gpt2
                && inner.shape("transformer.wte.weight").is_none()
                && inner.shape("wte.weight").is_some();
            Box::new(Relayout { inner, arch: config.architecture, heads: config.num_heads, bare_gpt2_names })
        }
        _ => Box::new(inner),
    }
}

impl<S: WeightSource> Relayout<S> {
    /// The stored name of the decoder's `name`.
    fn stored<'n>(&self, name: &'n str) -> &'n str {
        match self.bare_gpt2_names {
            true => name.strip_prefix("transformer.").unwrap_or(name),
            false => name,
        }
    }

    fn rewrite(&self, name: &str) -> Option<Rewrite> {
        match self.arch {
            Architecture::Gpt2 => {
                let conv1d = ["attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight"];
                conv1d.iter().any(|s| name.ends_with(s)).then_some(Rewrite::Transpose)
            }
            Architecture::GptNeoX => (name.ends_with("attention.query_key_value.weight")
                || name.ends_with("attention.query_key_value.bias"))
            .then_some(Rewrite::QkvByHead { heads: self.heads }),
            _ => None,
        }
    }
}

impl<S: WeightSource> WeightSource for Relayout<S> {
    fn names(&self) -> Vec<String> {
        let names = self.inner.names();
        match self.bare_gpt2_names {
            true => names.into_iter().map(|n| format!("transformer.{n}")).collect(),
            false => names,
        }
    }

    fn shape(&self, name: &str) -> Option<Vec<usize>> {
        let shape = self.inner.shape(self.stored(name))?;
        Some(match self.rewrite(name) {
            Some(Rewrite::Transpose) => shape.into_iter().rev().collect(),
            _ => shape,
        })
    }

    fn dense(&self, name: &str, dtype: DType, device: &Device) -> Result<Tensor> {
        let t = self.inner.dense(self.stored(name), dtype, device)?;
        let rewritten = match self.rewrite(name) {
            None => return Ok(t),
            Some(Rewrite::Transpose) => t.t().and_then(|t| t.contiguous()),
            Some(Rewrite::QkvByHead { heads }) => qkv_by_kind(&t, heads),
        };
        rewritten.ctx(|| format!("rearranging tensor `{name}` into the decoder's layout"))
    }
}

/// Rows grouped `[heads, 3, head_dim]` regrouped as `[3, heads, head_dim]` (a bias is one row).
fn qkv_by_kind(t: &Tensor, heads: usize) -> candle_core::Result<Tensor> {
    let dims = t.dims().to_vec();
    let rows = dims[0];
    if heads == 0 || !rows.is_multiple_of(3 * heads) {
        candle_core::bail!("{rows} rows do not split into q, k, v of {heads} heads");
    }
    let d = rows / (3 * heads);
    let rest: usize = dims[1..].iter().product();
    t.reshape((heads, 3, d, rest))?.transpose(0, 1)?.contiguous()?.reshape(dims)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn neox_rows_are_regrouped_by_kind() {
        // 2 heads of width 1: stored rows q0 k0 v0 q1 k1 v1.
        let t = Tensor::new(&[0f32, 1., 2., 3., 4., 5.], &Device::Cpu).unwrap();
        let got = qkv_by_kind(&t, 2).unwrap().to_vec1::<f32>().unwrap();
        assert_eq!(got, vec![0., 3., 1., 4., 2., 5.]);
    }
}
