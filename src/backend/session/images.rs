//! Images staged on a session: each one's projected embeddings and the absolute position of its
//! first token. A step covering an image's positions reads them in place of the token
//! embeddings (after any embedding scale: transformers scales the text's only) and, where the
//! model says so, attends the image's tokens in both directions.

use candle_core::Tensor;

use crate::backend::blocks::hooks::Hooks;
use crate::core::Point;

/// One image's embeddings `[tokens, H]` (float32) at positions `start..start + tokens`.
#[derive(Debug, Clone)]
pub struct ImageSpan {
    /// The absolute position of the image's first token.
    pub start: usize,
    /// The projected embeddings, one row per image token.
    pub embeds: Tensor,
}

impl ImageSpan {
    /// One past the image's last position.
    pub fn end(&self) -> usize {
        self.start + self.embeds.dims().first().copied().unwrap_or(0)
    }
}

/// The ends of the steps that run positions `start..start + len` in chunks of about `chunk`
/// tokens, moved forward so that no step cuts an image.
pub fn step_ends(start: usize, len: usize, chunk: usize, images: &[ImageSpan]) -> Vec<usize> {
    let mut ends = Vec::new();
    let (mut at, stop) = (start, start + len);
    while at < stop {
        let end = unsplit(images, (at + chunk.max(1)).min(stop)).min(stop);
        ends.push(end);
        at = end;
    }
    ends
}

/// `end`, moved to the end of the image it would cut, if any.
pub fn unsplit(images: &[ImageSpan], end: usize) -> usize {
    images.iter().find(|s| s.start < end && end < s.end()).map_or(end, ImageSpan::end)
}

/// Hooks that put the images of a step in place at `model.embed`, then hand every point to `inner`.
pub struct ImageHooks<'a, H: Hooks> {
    /// The step's own hooks.
    pub inner: H,
    /// The images lying wholly inside the step.
    pub images: &'a [ImageSpan],
    /// The step's first position.
    pub start: usize,
    /// Whether an image's tokens attend each other in both directions.
    pub bidirectional: bool,
}

impl<H: Hooks> Hooks for ImageHooks<'_, H> {
    fn wants(&self, point: Point) -> bool {
        point == Point::Embed || self.inner.wants(point)
    }

    fn at(&mut self, point: Point, x: Tensor) -> candle_core::Result<Tensor> {
        if point != Point::Embed || self.images.is_empty() {
            return self.inner.at(point, x);
        }
        let rows = x.dim(0)?;
        let mut parts = Vec::with_capacity(2 * self.images.len() + 1);
        let mut at = 0;
        for s in self.images {
            let (from, to) = (s.start - self.start, s.end() - self.start);
            if from > at {
                parts.push(x.narrow(0, at, from - at)?);
            }
            parts.push(s.embeds.to_dtype(x.dtype())?);
            at = to;
        }
        if at < rows {
            parts.push(x.narrow(0, at, rows - at)?);
        }
        let x = Tensor::cat(&parts, 0)?;
        self.inner.at(point, x)
    }

    fn bidirectional_blocks(&self) -> Vec<(usize, usize)> {
        if self.bidirectional {
            self.images.iter().map(|s| (s.start, s.end())).collect()
        } else {
            Vec::new()
        }
    }
}
