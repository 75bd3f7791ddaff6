//! Collecting named activations during a forward pass, only when asked.

use candle_core::{DType, Tensor};

use crate::backend::error::{CandleContext, Result};
use crate::core::{ObservationRequest, ObservationSet, ObservationValue};

/// Holds the tensors a request selected, on the device, until the pass ends.
pub struct Recorder<'r> {
    request: &'r ObservationRequest,
    kept: Vec<(String, Tensor)>,
}

impl<'r> Recorder<'r> {
    /// A recorder for `request`.
    pub fn new(request: &'r ObservationRequest) -> Self {
        Self { request, kept: Vec::new() }
    }

    /// Whether `path` is selected.
    pub fn wants(&self, path: &str) -> bool {
        self.request.matches(path)
    }

    /// Keeps `t` under `path` when selected.
    pub fn record(&mut self, path: String, t: &Tensor) {
        if self.request.matches(&path) {
            self.kept.push((path, t.clone()));
        }
    }

    /// Copies the kept tensors to the host as float32.
    pub fn finish(self) -> Result<ObservationSet> {
        let mut set = ObservationSet::new();
        for (path, t) in self.kept {
            let shape = t.dims().to_vec();
            let data = t
                .to_dtype(DType::F32)
                .and_then(|t| t.flatten_all())
                .and_then(|t| t.to_vec1::<f32>())
                .ctx(|| format!("copying observation `{path}` to the host"))?;
            set.insert(path, ObservationValue::Tensor { shape, data })?;
        }
        Ok(set)
    }
}

/// Records `t` under the path `name()` builds, only when a recorder is present: the
/// path string is never formatted on the plain inference path.
#[inline]
pub fn observe(rec: &mut Option<&mut Recorder<'_>>, name: impl FnOnce() -> String, t: &Tensor) {
    if let Some(r) = rec.as_deref_mut() {
        r.record(name(), t);
    }
}
