//! Sparse autoencoders for Python: `attach_sae`, `detach_sae`, `saes`, `top_features`, the
//! batched activation collection `cw.collect` runs on (`collect_batch`), and the feature edits
//! (`Intervention.sae_steer/sae_clamp/sae_splice`, built by `candlewick.interventions`).

use pyo3::prelude::*;
use pyo3::types::{PyAny, PyDict, PyList};

use super::convert::{extract_ids, prompt_of};
use super::errors::{backend_err, catch_panic, model_err, runtime_err};
use super::intervention::{positions_of, PyIntervention};
use super::observation::{to_python, PyObservationRequest, PyObservationSet};
use super::runtime::PyModelRuntime;
use candlewick::backend::session::sae::SaeInfo;
use candlewick::core::{
    EditOp, Intervention, ObservationRequest, ObservationSelector, ObservationValue, PrefillInput, SaeEdit, SaePoint,
};

fn info_dict<'py>(py: Python<'py>, info: SaeInfo) -> PyResult<Bound<'py, PyDict>> {
    let d = PyDict::new(py);
    d.set_item("name", info.name)?;
    d.set_item("point", info.point)?;
    d.set_item("d_in", info.d_in)?;
    d.set_item("d_sae", info.d_sae)?;
    d.set_item("path", info.path)?;
    d.set_item("format", info.format)?;
    Ok(d)
}

#[pymethods]
impl PyModelRuntime {
    /// Attaches a sparse autoencoder to this model: adds the points ``sae.{name}.features``
    /// (sparse), ``sae.{name}.reconstruction`` and ``sae.{name}.error``, and lets the
    /// ``candlewick.interventions.sae_*`` edits name it. Every session over the model sees it
    /// (an ``Engine`` made from this runtime included).
    ///
    /// Args:
    ///     path (str | os.PathLike): an SAELens directory (cfg.json + sae_weights.safetensors),
    ///         a sparsify directory (cfg.json + sae.safetensors) or a Gemma Scope params.npz.
    ///     point (str | None): the point it reads; needed only where the file names none
    ///         (Gemma Scope), and must agree with the file's hook where it does.
    ///     name (str | None): its name; default the point without ``model.``
    ///         (``layers.6.output``).
    ///
    /// Returns:
    ///     dict: name, point, d_in, d_sae, path, format.
    ///
    /// Example:
    ///     >>> rt.attach_sae("saes/blocks.6.hook_resid_post", name="res6")["d_sae"]
    ///     16384
    #[pyo3(signature = (path, point=None, name=None))]
    fn attach_sae<'py>(
        &self,
        py: Python<'py>,
        path: std::path::PathBuf,
        point: Option<String>,
        name: Option<String>,
    ) -> PyResult<Bound<'py, PyDict>> {
        let info = py.detach(|| {
            catch_panic(|| {
                self.lock_detached()?
                    .runtime()
                    .session()
                    .attach_sae(&path, point.as_deref(), name.as_deref())
                    .map_err(backend_err)
            })
        })?;
        info_dict(py, info)
    }

    /// Detaches the SAE called ``name``; kept edits naming it keep running with it.
    ///
    /// Args:
    ///     name (str): the SAE's name.
    ///
    /// Returns:
    ///     bool: whether one was attached.
    ///
    /// Example:
    ///     >>> rt.detach_sae("res6")
    ///     True
    fn detach_sae(&self, py: Python<'_>, name: String) -> PyResult<bool> {
        py.detach(|| Ok(self.lock_detached()?.runtime().session().detach_sae(&name)))
    }

    /// The SAEs attached to this model.
    ///
    /// Returns:
    ///     list[dict]: one dict per SAE (name, point, d_in, d_sae, path, format).
    ///
    /// Example:
    ///     >>> [s["name"] for s in rt.saes()]
    ///     ['res6']
    fn saes<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyList>> {
        let infos = py.detach(|| Ok::<_, PyErr>(self.lock_detached()?.runtime().session().saes()))?;
        let list = PyList::empty(py);
        for info in infos {
            list.append(info_dict(py, info)?)?;
        }
        Ok(list)
    }

    /// Each token's strongest features of an attached SAE, as Neuronpedia lists them; runs the
    /// text on a fresh context (the session is left as it was), with the kept edits.
    ///
    /// Args:
    ///     text (str | Sequence[int]): the text (encoded as ``generate`` does) or token ids.
    ///     sae (str): the SAE's name.
    ///     k (int): features per token.
    ///
    /// Returns:
    ///     list[dict]: per position ``{"position", "token_id", "token", "features": [(index, value), ...]}``,
    ///     strongest first, only features that fired.
    ///
    /// Example:
    ///     >>> rt.top_features("The cat sat", sae="res6", k=3)[1]["features"]
    ///     [(812, 4.1), (77, 2.3), (9001, 0.7)]
    #[pyo3(signature = (text, sae, k=10))]
    fn top_features<'py>(
        &self,
        py: Python<'py>,
        text: &Bound<'py, PyAny>,
        sae: String,
        k: usize,
    ) -> PyResult<Bound<'py, PyList>> {
        let prompt = prompt_of("text", text)?;
        let path = SaePoint::Features.path(&sae);
        let (ids, pieces, value) = py.detach(|| {
            catch_panic(|| {
                let model = self.lock_detached()?;
                let ids = model.prompt_ids(&prompt).map_err(model_err)?;
                let pieces: Vec<String> = match model.tokenizer() {
                    Ok(t) => ids.iter().map(|&i| t.id_to_token(i).unwrap_or_default()).collect(),
                    Err(_) => vec![String::new(); ids.len()],
                };
                let request = ObservationRequest::select([ObservationSelector::exact(path.clone())])
                    .map_err(|e| backend_err(e.into()))?;
                let r = model.runtime().trace(PrefillInput::new(ids.clone()), &request).map_err(runtime_err)?;
                Ok((ids, pieces, r.observations.get(&path).cloned()))
            })
        })?;
        let out = PyList::empty(py);
        let Some(ObservationValue::Sparse { offsets, indices, values, .. }) = value else {
            return Ok(out);
        };
        for (pos, (&id, piece)) in ids.iter().zip(pieces).enumerate() {
            let (a, b) = (offsets[pos], offsets[pos + 1]);
            let mut row: Vec<(u32, f32)> = indices[a..b].iter().copied().zip(values[a..b].iter().copied()).collect();
            row.sort_by(|x, y| y.1.total_cmp(&x.1).then(x.0.cmp(&y.0)));
            row.truncate(k);
            let d = PyDict::new(py);
            d.set_item("position", pos)?;
            d.set_item("token_id", id)?;
            d.set_item("token", piece)?;
            d.set_item("features", row)?;
            out.append(d)?;
        }
        Ok(out)
    }

    /// Runs each token list from position 0 on a scratch cache of its own, all in one batched
    /// step with the kept edits, stopped after the last layer ``request`` needs (no later layer,
    /// no logits), and returns each one's observations. ``cw.collect`` runs a corpus through it.
    ///
    /// Args:
    ///     documents (Sequence[Sequence[int]]): token lists, each within the context.
    ///     request (ObservationRequest): the points to record.
    ///
    /// Returns:
    ///     list[ObservationSet]: one per document.
    ///
    /// Example:
    ///     >>> rt.collect_batch([[1, 2, 3]], cw.ObservationRequest.exact("model.layers.2.output"))[0]
    fn collect_batch(
        &self,
        py: Python<'_>,
        documents: Vec<Bound<'_, PyAny>>,
        request: PyRef<'_, PyObservationRequest>,
    ) -> PyResult<Vec<PyObservationSet>> {
        let docs = documents.iter().map(|d| extract_ids("documents", d)).collect::<PyResult<Vec<_>>>()?;
        let req = request.inner.clone();
        let sets = py.detach(|| {
            catch_panic(|| self.lock_detached()?.runtime().session().collect(&docs, &req).map_err(backend_err))
        })?;
        sets.into_iter().map(|s| to_python(py, s)).collect()
    }

    /// The last layer an ``ObservationRequest`` needs, or None when it needs the logits or the
    /// final norm (``collect_batch`` stops there).
    ///
    /// Args:
    ///     request (ObservationRequest): the points.
    ///
    /// Returns:
    ///     int | None: the layer.
    ///
    /// Example:
    ///     >>> rt.last_layer_needed(cw.ObservationRequest.exact("model.layers.2.output"))
    ///     2
    fn last_layer_needed(&self, py: Python<'_>, request: PyRef<'_, PyObservationRequest>) -> PyResult<Option<usize>> {
        let req = request.inner.clone();
        py.detach(|| Ok(self.lock_detached()?.runtime().session().last_layer_needed(&req)))
    }
}

fn sae_edit(sae: String, edit: SaeEdit, positions: Option<Vec<usize>>) -> PyIntervention {
    PyIntervention { inner: Intervention { point: format!("sae.{sae}"), op: EditOp::Sae { sae, edit }, positions } }
}

fn features_of(features: Vec<i64>) -> PyResult<Vec<usize>> {
    features
        .into_iter()
        .map(|f| {
            usize::try_from(f)
                .map_err(|_| super::convert::value_err("features", &format!("{f} is not a feature index")))
        })
        .collect()
}

#[pymethods]
impl PyIntervention {
    /// Feature steering: ``x + scale * W_dec[feature]`` at the SAE's point.
    ///
    /// Args:
    ///     sae (str): the attached SAE's name.
    ///     feature (int): the feature.
    ///     scale (float): the multiplier of its decoder row.
    ///     positions (Sequence[int] | None): absolute positions; None: every position.
    ///
    /// Returns:
    ///     Intervention: the edit.
    ///
    /// Example:
    ///     >>> Intervention.sae_steer("res6", 812, 8.0)
    #[staticmethod]
    #[pyo3(signature = (sae, feature, scale, positions=None))]
    fn sae_steer(sae: String, feature: i64, scale: f32, positions: Option<Vec<i64>>) -> PyResult<Self> {
        let feature = features_of(vec![feature])?[0];
        Ok(sae_edit(sae, SaeEdit::Steer { feature, scale }, positions_of(positions)?))
    }

    /// Feature clamping: the listed features set to ``value``, ``x + (f' - f) W_dec`` (the
    /// SAE's error kept); ``value=0`` ablates.
    ///
    /// Args:
    ///     sae (str): the attached SAE's name.
    ///     features (Sequence[int]): the features.
    ///     value (float): their new value.
    ///     positions (Sequence[int] | None): absolute positions; None: every position.
    ///
    /// Returns:
    ///     Intervention: the edit.
    ///
    /// Example:
    ///     >>> Intervention.sae_clamp("res6", [812], 10.0)
    #[staticmethod]
    #[pyo3(signature = (sae, features, value, positions=None))]
    fn sae_clamp(sae: String, features: Vec<i64>, value: f32, positions: Option<Vec<i64>>) -> PyResult<Self> {
        Ok(sae_edit(sae, SaeEdit::Clamp { features: features_of(features)?, value }, positions_of(positions)?))
    }

    /// Splicing: the point replaced by the SAE's reconstruction (plus its error where
    /// ``keep_error``, which leaves the value as it was).
    ///
    /// Args:
    ///     sae (str): the attached SAE's name.
    ///     keep_error (bool): add the error term back.
    ///     positions (Sequence[int] | None): absolute positions; None: every position.
    ///
    /// Returns:
    ///     Intervention: the edit.
    ///
    /// Example:
    ///     >>> Intervention.sae_splice("res6", keep_error=False)
    #[staticmethod]
    #[pyo3(signature = (sae, keep_error=true, positions=None))]
    fn sae_splice(sae: String, keep_error: bool, positions: Option<Vec<i64>>) -> PyResult<Self> {
        Ok(sae_edit(sae, SaeEdit::Splice { keep_error }, positions_of(positions)?))
    }
}
