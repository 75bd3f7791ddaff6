//! Inspection for Python: the `ModelRuntime` methods that return observation points with a step
//! (`inspect_prefill`, `inspect_decode`), on a fresh context (`trace`, `trace_batch`) or from an
//! output (`observe_output`), the logit lens (`unembed`), and `InspectedOutput`.

use numpy::ndarray::{ArrayD, IxDyn};
use numpy::{PyArray, PyReadonlyArray2};
use pyo3::prelude::*;
use pyo3::types::PyAny;

use super::convert::{adapter_choice, extract_ids};
use super::errors::{backend_err, catch_panic, model_err, runtime_err, InternalError, SessionError};
use super::intervention::{edits_of, PyIntervention};
use super::observation::{to_python, PyObservationRequest, PyObservationSet};
use super::runtime::{call_edits, ImageCall, PyModelRuntime, PyStepOutput};
use candlewick::backend::StepOutput;
use candlewick::core::{DecodeInput, InspectedOutput, ObservationRequest, ObservationSet, PrefillInput};

impl PyModelRuntime {
    /// An inspected step's output and observations, as Python objects.
    fn inspected(&self, py: Python<'_>, r: InspectedOutput<StepOutput>) -> PyResult<PyInspectedOutput> {
        let output = Py::new(py, PyStepOutput { inner: r.output, runtime_id: self.id })?;
        let observations = Py::new(py, to_python(py, r.observations)?)?;
        Ok(PyInspectedOutput { output, observations })
    }
}

/// `r` with the vision points recorded while its images were encoded, those first (forward order).
fn with_vision(mut r: InspectedOutput<StepOutput>, vision: ObservationSet) -> PyResult<InspectedOutput<StepOutput>> {
    if vision.is_empty() {
        return Ok(r);
    }
    let mut all = vision;
    for (k, v) in std::mem::take(&mut r.observations).into_entries() {
        all.insert(k, v).map_err(|e| InternalError::new_err(e.to_string()))?;
    }
    r.observations = all;
    Ok(r)
}

/// The ids of an inspected call: its images' (placeholders expanded), or `tokens` as given.
fn ids_of(call: &Option<ImageCall>, tokens: &Bound<'_, PyAny>) -> PyResult<Vec<u32>> {
    match call {
        Some(c) => Ok(c.ids.clone()),
        None => extract_ids("tokens", tokens),
    }
}

/// The request a caller passed, or every point (as the docstrings say) where it passed none.
fn request_of(request: Option<PyRef<'_, PyObservationRequest>>) -> ObservationRequest {
    request.map(|r| r.inner.clone()).unwrap_or_else(ObservationRequest::all)
}

#[pymethods]
impl PyModelRuntime {
    /// Brings an output of this runtime to the host as an observation set.
    ///
    /// Args:
    ///     output (StepOutput): an output of this runtime.
    ///
    /// Returns:
    ///     ObservationSet: ``{"model.logits": array}``.
    ///
    /// Example:
    ///     >>> rt.observe_output(rt.decode([9079]).wait())["model.logits"].shape
    ///     (1, 262144)
    fn observe_output(&self, py: Python<'_>, output: &Bound<'_, PyStepOutput>) -> PyResult<PyObservationSet> {
        let output = output.get();
        if output.runtime_id != self.id {
            return Err(SessionError::new_err("this output was produced by another runtime"));
        }
        let set = py.detach(|| {
            catch_panic(|| self.lock_detached()?.runtime().observe_output(&output.inner).map_err(runtime_err))
        })?;
        to_python(py, set)
    }

    /// A prefill that also returns the requested observation points.
    ///
    /// Args:
    ///     tokens (Sequence[int]): token ids to append.
    ///     request (ObservationRequest | None): which points; None: all of them.
    ///     all_logits (bool): return every position's logits.
    ///     interventions (Sequence[Intervention] | None): edits for this step only.
    ///     adapters (str | list | dict | None): LoRA adapters for this step only (None: the runtime's).
    ///     images (Sequence | None): images for the prompt's image tokens (paths, bytes, PIL images,
    ///         arrays), prepared as the model's processor does (docs/vision.md).
    ///     pixel_values (numpy.ndarray | None): already prepared pixel values instead of ``images``.
    ///
    /// Returns:
    ///     InspectedOutput: ``.output`` and ``.observations`` (path -> numpy array).
    ///
    /// Example:
    ///     >>> r = rt.inspect_prefill([2, 651], candlewick.ObservationRequest.select(["model.layers.1"]))
    ///     >>> r.observations["model.layers.1.output"].shape
    ///     (2, 640)
    #[pyo3(signature = (tokens, request=None, all_logits=false, interventions=None, adapters=None, *, images=None, pixel_values=None))]
    #[allow(clippy::too_many_arguments)]
    fn inspect_prefill(
        &self,
        py: Python<'_>,
        tokens: &Bound<'_, PyAny>,
        request: Option<PyRef<'_, PyObservationRequest>>,
        all_logits: bool,
        interventions: Option<Vec<PyRef<'_, PyIntervention>>>,
        adapters: Option<Bound<'_, PyAny>>,
        images: Option<&Bound<'_, PyAny>>,
        pixel_values: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<PyInspectedOutput> {
        let call = self.image_call(py, tokens, images, pixel_values)?;
        let (vision_edits, edits) = call_edits(&call, edits_of(interventions));
        let input = PrefillInput::new(ids_of(&call, tokens)?).all_logits(all_logits).with_interventions(edits);
        let req = request_of(request);
        let choice = adapters.map(|a| adapter_choice("adapters", &a)).transpose()?;
        let vision = match &call {
            Some(c) => self.stage(py, c, None, Some(&req), &vision_edits)?,
            None => ObservationSet::new(),
        };
        let r = py.detach(|| {
            catch_panic(|| {
                self.lock_detached()?
                    .with_adapters(choice.as_ref(), |m| m.runtime_mut().inspect_prefill(input, &req))
                    .map_err(model_err)?
                    .map_err(runtime_err)
            })
        });
        if call.is_some() {
            self.unstage(py);
        }
        self.inspected(py, with_vision(r?, vision)?)
    }

    /// A decode that also returns the requested observation points.
    ///
    /// Args:
    ///     tokens (Sequence[int]): token ids to append.
    ///     request (ObservationRequest | None): which points; None: all of them.
    ///     interventions (Sequence[Intervention] | None): edits for this step only.
    ///     adapters (str | list | dict | None): LoRA adapters for this step only (None: the runtime's).
    ///
    /// Returns:
    ///     InspectedOutput: ``.output`` and ``.observations``.
    ///
    /// Example:
    ///     >>> rt.inspect_decode([9079]).observations["model.norm"].shape
    ///     (1, 640)
    #[pyo3(signature = (tokens, request=None, interventions=None, adapters=None))]
    fn inspect_decode(
        &self,
        py: Python<'_>,
        tokens: &Bound<'_, PyAny>,
        request: Option<PyRef<'_, PyObservationRequest>>,
        interventions: Option<Vec<PyRef<'_, PyIntervention>>>,
        adapters: Option<Bound<'_, PyAny>>,
    ) -> PyResult<PyInspectedOutput> {
        let input = DecodeInput::new(extract_ids("tokens", tokens)?).with_interventions(edits_of(interventions));
        let req = request_of(request);
        let choice = adapters.map(|a| adapter_choice("adapters", &a)).transpose()?;
        let r = py.detach(|| {
            catch_panic(|| {
                self.lock_detached()?
                    .with_adapters(choice.as_ref(), |m| m.runtime_mut().inspect_decode(input, &req))
                    .map_err(model_err)?
                    .map_err(runtime_err)
            })
        })?;
        self.inspected(py, r)
    }

    /// Runs ``tokens`` on a fresh context with the kept interventions plus ``interventions``,
    /// leaving the session as it was.
    ///
    /// Args:
    ///     tokens (Sequence[int]): the whole input.
    ///     request (ObservationRequest | None): which points; None: all of them.
    ///     interventions (Sequence[Intervention] | None): edits for this run only.
    ///     adapters (str | list | dict | None): LoRA adapters for this run only (None: the runtime's).
    ///     images (Sequence | None): images for the prompt's image tokens (paths, bytes, PIL images,
    ///         arrays), prepared as the model's processor does (docs/vision.md).
    ///     pixel_values (numpy.ndarray | None): already prepared pixel values instead of ``images``.
    ///
    /// Returns:
    ///     InspectedOutput: every row's logits and the requested points.
    ///
    /// Example:
    ///     >>> r = rt.trace([2, 651, 6037], interventions=[iv.scale("model.layers.3.attention.heads", [2], 0.0)])
    ///     >>> rt.unembed(r.observations["model.layers.5.output"]).shape
    ///     (3, 262144)
    #[pyo3(signature = (tokens, request=None, interventions=None, adapters=None, *, images=None, pixel_values=None))]
    #[allow(clippy::too_many_arguments)]
    fn trace(
        &self,
        py: Python<'_>,
        tokens: &Bound<'_, PyAny>,
        request: Option<PyRef<'_, PyObservationRequest>>,
        interventions: Option<Vec<PyRef<'_, PyIntervention>>>,
        adapters: Option<Bound<'_, PyAny>>,
        images: Option<&Bound<'_, PyAny>>,
        pixel_values: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<PyInspectedOutput> {
        let call = self.image_call(py, tokens, images, pixel_values)?;
        let (vision_edits, edits) = call_edits(&call, edits_of(interventions));
        let input = PrefillInput::new(ids_of(&call, tokens)?).with_interventions(edits);
        let req = request_of(request);
        let choice = adapters.map(|a| adapter_choice("adapters", &a)).transpose()?;
        // A trace runs from position 0 on a scratch session that takes the staged images along.
        let vision = match &call {
            Some(c) => self.stage_for_trace(py, c, &req, &vision_edits)?,
            None => ObservationSet::new(),
        };
        let r = py.detach(|| {
            catch_panic(|| {
                self.lock_detached()?
                    .with_adapters(choice.as_ref(), |m| m.runtime().trace(input, &req))
                    .map_err(model_err)?
                    .map_err(runtime_err)
            })
        });
        if call.is_some() {
            self.unstage(py);
        }
        self.inspected(py, with_vision(r?, vision)?)
    }

    /// Runs each token list on a fresh context of its own, as ``trace`` does; the session is
    /// left as it was.
    ///
    /// Args:
    ///     prompts (Sequence[Sequence[int]]): one token list per run.
    ///     request (ObservationRequest | None): which points; None: all of them.
    ///     interventions (Sequence[Intervention] | None): edits for every run.
    ///     adapters (str | list | dict | None): LoRA adapters for every run (None: the runtime's).
    ///
    /// Returns:
    ///     list[InspectedOutput]: one per token list.
    ///
    /// Example:
    ///     >>> [r.output.num_tokens for r in rt.trace_batch([[2, 651], [2, 651, 6037]])]
    ///     [2, 3]
    #[pyo3(signature = (prompts, request=None, interventions=None, adapters=None))]
    fn trace_batch(
        &self,
        py: Python<'_>,
        prompts: Vec<Bound<'_, PyAny>>,
        request: Option<PyRef<'_, PyObservationRequest>>,
        interventions: Option<Vec<PyRef<'_, PyIntervention>>>,
        adapters: Option<Bound<'_, PyAny>>,
    ) -> PyResult<Vec<PyInspectedOutput>> {
        let edits = edits_of(interventions);
        let inputs = prompts
            .iter()
            .map(|p| Ok(PrefillInput::new(extract_ids("prompts[i]", p)?).with_interventions(edits.clone())))
            .collect::<PyResult<Vec<_>>>()?;
        let req = request_of(request);
        let choice = adapters.map(|a| adapter_choice("adapters", &a)).transpose()?;
        let outs = py.detach(|| {
            catch_panic(|| {
                let mut model = self.lock_detached()?;
                model
                    .with_adapters(choice.as_ref(), |m| {
                        inputs
                            .into_iter()
                            .map(|i| m.runtime().trace(i, &req).map_err(runtime_err))
                            .collect::<PyResult<Vec<_>>>()
                    })
                    .map_err(model_err)?
            })
        })?;
        outs.into_iter().map(|r| self.inspected(py, r)).collect()
    }

    /// The logit lens: the final norm, the output projection and any soft-capping applied to
    /// hidden states, on the model's own (quantized) weights.
    ///
    /// Args:
    ///     x (numpy.ndarray): float32 ``[T, hidden]``, e.g. a residual-stream observation.
    ///
    /// Returns:
    ///     numpy.ndarray: float32 logits ``[T, vocab]``.
    ///
    /// Example:
    ///     >>> rt.unembed(r.observations["model.layers.5.output"]).argmax(-1)
    fn unembed<'py>(
        &self,
        py: Python<'py>,
        x: PyReadonlyArray2<'py, f32>,
    ) -> PyResult<Bound<'py, PyArray<f32, IxDyn>>> {
        let array = x.as_array();
        let shape = array.shape().to_vec();
        let data = array.iter().copied().collect::<Vec<f32>>();
        let (shape, data) = py.detach(|| {
            catch_panic(|| self.lock_detached()?.runtime().session().unembed(&shape, data).map_err(backend_err))
        })?;
        let arr = ArrayD::from_shape_vec(IxDyn(&shape), data).map_err(|e| InternalError::new_err(e.to_string()))?;
        Ok(PyArray::from_owned_array(py, arr))
    }
}

/// A step's output with the observation points that were asked for.
#[pyclass(name = "InspectedOutput", module = "candlewick._native", frozen)]
pub struct PyInspectedOutput {
    output: Py<PyStepOutput>,
    observations: Py<PyObservationSet>,
}

#[pymethods]
impl PyInspectedOutput {
    /// The ordinary output.
    #[getter]
    fn output(&self, py: Python<'_>) -> Py<PyStepOutput> {
        self.output.clone_ref(py)
    }

    /// The requested observation points.
    #[getter]
    fn observations(&self, py: Python<'_>) -> Py<PyObservationSet> {
        self.observations.clone_ref(py)
    }
}
