//! Sparse autoencoders on a session's model, and activation collection: documents run as one
//! batched step that stops after the last layer the request needs.

use std::path::Path;
use std::sync::Arc;

use super::CandleSession;
use crate::backend::blocks::hooks::StepHooks;
use crate::backend::blocks::sae::Sae;
use crate::backend::decoder::{BatchItem, LogitsRows, StepKind};
use crate::backend::error::{CandleError, Result};
use crate::backend::weights::sae::{load_sae, SaeError};
use crate::core::{LayerPoint, ObservationRequest, ObservationSet, Point, SaePoint};

/// What `saes()` reports of one attached SAE.
#[derive(Debug, Clone, PartialEq)]
pub struct SaeInfo {
    /// Its name.
    pub name: String,
    /// The point it reads.
    pub point: String,
    /// Input width.
    pub d_in: usize,
    /// Number of features.
    pub d_sae: usize,
    /// The file or directory it was read from.
    pub path: String,
    /// `saelens`, `gemma-scope` or `sparsify`.
    pub format: String,
}

impl CandleSession {
    /// Reads the SAE at `path` and attaches it to this model (every session over it) as `name`
    /// (default: the file's point, `model.layers.6.output` → `layers.6.output`). `point` is
    /// needed where the file names none; where it does, the two must agree.
    pub fn attach_sae(&self, path: &Path, point: Option<&str>, name: Option<&str>) -> Result<SaeInfo> {
        let bad_point = |p: &str, name: &str| SaeError::BadPoint { name: name.into(), point: p.into() };
        let given = match point {
            Some(p) => Some(Point::parse(p).ok_or_else(|| bad_point(p, name.unwrap_or("?")))?),
            None => None,
        };
        let weights = load_sae(path, given)?;
        let point = weights.hook.as_ref().expect("load_sae resolves the point").1;
        let default_name = point.to_string();
        let name = name.map(str::to_owned).unwrap_or_else(|| default_name.trim_start_matches("model.").to_owned());
        let readable = !matches!(point, Point::Logits | Point::Layer(_, LayerPoint::AttentionPattern));
        let shape =
            self.decoder.point_shape(point).filter(|_| readable).ok_or_else(|| bad_point(&default_name, &name))?;
        let width: usize = shape.iter().product();
        if width != weights.d_in() {
            return Err(SaeError::WidthMismatch { name, point: default_name, d_in: weights.d_in(), width }.into());
        }
        if name.is_empty() || self.decoder.saes().current().iter().any(|s| s.name == name) {
            return Err(SaeError::Duplicate { name }.into());
        }
        let sae = Sae::new(name, point, shape, weights, self.decoder.device())?;
        let info = info_of(&sae);
        self.decoder.saes().attach(sae);
        Ok(info)
    }

    /// Removes the SAE called `name` from this model; whether one was attached. Edits already
    /// kept that name it keep running with it.
    pub fn detach_sae(&self, name: &str) -> bool {
        self.decoder.saes().detach(name)
    }

    /// The SAEs attached to this model.
    pub fn saes(&self) -> Vec<SaeInfo> {
        self.decoder.saes().current().iter().map(|s| info_of(s)).collect()
    }

    /// The last layer a request needs, or `None` when it needs the whole pass (`model.norm`,
    /// `model.logits`, or everything).
    pub fn last_layer_needed(&self, request: &ObservationRequest) -> Option<usize> {
        let saes = self.decoder.saes().current();
        let mut last = 0;
        for p in self.decoder.points() {
            if request.matches_point(p) {
                match p.layer() {
                    Some(i) => last = last.max(i),
                    None if p == Point::Embed => {}
                    None => return None,
                }
            }
        }
        for s in saes.iter() {
            if SaePoint::ALL.iter().any(|p| request.matches(&p.path(&s.name))) {
                match s.point.layer() {
                    Some(i) => last = last.max(i),
                    None => return None,
                }
            }
        }
        Some(last)
    }

    /// Runs each document from position 0 on a scratch cache of its own, all in one batched
    /// step under the kept edits, stopped after the last layer `request` needs, and returns each
    /// one's observations. This session's own cache is not touched.
    pub fn collect(&self, documents: &[Vec<u32>], request: &ObservationRequest) -> Result<Vec<ObservationSet>> {
        request.validate(self.decoder.observation_points().iter().map(String::as_str))?;
        self.check_documents("collect", "document", documents)?;
        let last = self.last_layer_needed(request);
        let saes: Arc<Vec<Arc<Sae>>> = self.decoder.saes().current();
        let edits = self.edits.ready.clone();
        let mut caches: Vec<_> = documents
            .iter()
            .map(|d| {
                let mut c = self.decoder.new_cache(d.len());
                c.reserve(d.len());
                c
            })
            .collect();
        let mut hooks: Vec<StepHooks<'_>> =
            documents.iter().map(|d| StepHooks::new(Some(request), &edits, 0, d.len()).with_saes(&saes)).collect();
        // Documents longer than the session's chunk run in steps of it, as a long prompt does, so
        // a step's attention scores are a chunk's; shorter ones leave the batch when done.
        let chunk = self.prefill_chunk;
        let longest = documents.iter().map(Vec::len).max().unwrap_or(0);
        for from in (0..longest).step_by(chunk.max(1)) {
            let mut items: Vec<BatchItem<'_, &mut StepHooks<'_>>> = documents
                .iter()
                .zip(caches.iter_mut())
                .zip(hooks.iter_mut())
                .filter(|((d, _), _)| d.len() > from)
                .map(|((d, cache), h)| BatchItem { ids: &d[from..(from + chunk).min(d.len())], cache, hooks: h })
                .collect();
            let lens: Vec<usize> = items.iter().map(|it| it.ids.len()).collect();
            let adapters = self.adapters();
            let active = vec![Some(&adapters); items.len()];
            crate::backend::blocks::lora::with_plan(&active, &lens, || {
                self.decoder.forward_batch_until(&mut items, LogitsRows::Last, StepKind::Prompt, last)
            })
            .map_err(|source| CandleError::Candle {
                context: format!("collecting activations of {} documents at position {from}", documents.len()),
                source: crate::backend::error::without_backtrace(source),
            })?;
            for (it, t) in items.iter_mut().zip(lens) {
                it.hooks.end_step(t)?;
            }
        }
        hooks.into_iter().map(StepHooks::finish).collect()
    }
}

fn info_of(s: &Sae) -> SaeInfo {
    SaeInfo {
        name: s.name.clone(),
        point: s.point.to_string(),
        d_in: s.d_in(),
        d_sae: s.d_sae(),
        path: s.source.0.clone(),
        format: s.source.1.into(),
    }
}
