//! Rows of several sequences stacked in one tensor (a batched step's layout), split apart again.

use candle_core::Tensor;

/// `x`'s rows split into consecutive blocks of `lens` rows.
pub fn split_rows(x: &Tensor, lens: &[usize]) -> candle_core::Result<Vec<Tensor>> {
    if lens.len() == 1 {
        return Ok(vec![x.clone()]);
    }
    let mut offset = 0;
    lens.iter()
        .map(|&t| {
            let part = x.narrow(0, offset, t);
            offset += t;
            part
        })
        .collect()
}
