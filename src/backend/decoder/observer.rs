//! Collecting named activations during a forward pass, only when asked.

use candle_core::{DType, Tensor};

use crate::backend::error::{CandleContext, Result};
use crate::core::{ObservationRequest, ObservationSet, ObservationValue};

/// A tensor's shape and its values as row-major float32 on the host.
pub fn to_host_f32(t: &Tensor) -> candle_core::Result<(Vec<usize>, Vec<f32>)> {
    Ok((t.dims().to_vec(), t.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?))
}

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
            let (shape, data) = to_host_f32(&t).ctx(|| format!("copying observation `{path}` to the host"))?;
            set.insert(path, ObservationValue::Tensor { shape, data })?;
        }
        Ok(set)
    }
}

/// Where the decoder reports its activations. The plain path uses `NoObserver`, whose
/// methods are empty and inline away: ordinary inference formats no path, keeps no tensor
/// and takes no branch for observation.
pub trait Observer {
    /// Whether anything may be observed at all (false for `NoObserver`, statically).
    fn active(&self) -> bool;
    /// Whether `path` is wanted (decides how many rows the final points cover).
    fn wants(&self, path: &str) -> bool;
    /// Offers the tensor at the path `name()` builds.
    fn observe(&mut self, name: impl FnOnce() -> String, t: &Tensor);
}

/// Observes nothing.
pub struct NoObserver;

impl Observer for NoObserver {
    #[inline(always)]
    fn active(&self) -> bool {
        false
    }
    #[inline(always)]
    fn wants(&self, _path: &str) -> bool {
        false
    }
    #[inline(always)]
    fn observe(&mut self, _name: impl FnOnce() -> String, _t: &Tensor) {}
}

impl Observer for Recorder<'_> {
    fn active(&self) -> bool {
        true
    }
    fn wants(&self, path: &str) -> bool {
        self.request.matches(path)
    }
    fn observe(&mut self, name: impl FnOnce() -> String, t: &Tensor) {
        self.record(name(), t);
    }
}
