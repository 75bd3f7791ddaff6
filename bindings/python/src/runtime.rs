//! `ModelRuntime` for Python: a wrapper of the Rust model layer (`candlewick::model::Model`) with
//! bound `backend` and `session` views and step outputs. Arguments are converted here; every
//! decision (formats, tokenizers, defaults) is the model layer's.

use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, LockResult, Mutex, MutexGuard};

use numpy::ndarray::{ArrayD, IxDyn};
use numpy::{PyArray, PyReadonlyArray2};
use pyo3::prelude::*;
use pyo3::types::{PyAny, PyDict};

use super::errors::{
    backend_err, catch_panic, invalid_option, model_err, runtime_err, text_err, GenerationOptionError, InternalError,
    RuntimeClosedError, SessionError, TokenOutOfRangeError,
};
use super::generation::{py_repr, run_to_end, Given, PyGenerationResult, PyGenerationStream, SamplingArgs};
use super::gil::lock_released;
use super::hub::resolve_model;
use super::intervention::{edits_of, PyIntervention};
use super::observation::{to_python, PyObservationRequest, PyObservationSet};
use super::text::{conversation, template_value, tool_calls_to_py, tool_choice_of, tools_of, PyTokenizer};
use candlewick::backend::session::CandleCompletion;
use candlewick::backend::session::SessionSnapshot;
use candlewick::backend::StepOutput;
use candlewick::core::{
    BackendProvider, BackendSession, Completion, DecodeInput, InspectedOutput, ObservationRequest, PrefillInput,
    SnapshotSession,
};
use candlewick::model::{Model, ModelOptions, Prompt};
use candlewick::text::ToolChoice;

static NEXT_RUNTIME_ID: AtomicU64 = AtomicU64::new(1);

/// A loaded model, the backend that prepared it and its one session (the KV cache).
///
/// Load one with ``ModelRuntime.load``; step it with ``prefill`` / ``decode``, generate with
/// ``generate`` / ``stream`` / ``chat``, inspect with ``inspect_prefill`` / ``trace``. A runtime
/// is a context manager: leaving the ``with`` block (or ``close()``) frees the model.
///
/// Example:
///     >>> with candlewick.ModelRuntime.load(path) as rt:
///     ...     print(rt.generate("The capital of France is", max_tokens=8).text)
#[pyclass(name = "ModelRuntime", module = "candlewick._native", frozen)]
pub struct PyModelRuntime {
    /// `None` once closed.
    pub(crate) inner: Mutex<Option<Model>>,
    pub(crate) id: u64,
}

/// The locked model of an open runtime.
pub(crate) struct ModelGuard<'a>(MutexGuard<'a, Option<Model>>);

impl std::ops::Deref for ModelGuard<'_> {
    type Target = Model;

    fn deref(&self) -> &Model {
        // A guard is only made over an open runtime, and closing needs the same lock.
        self.0.as_ref().expect("a ModelGuard holds an open model")
    }
}

impl std::ops::DerefMut for ModelGuard<'_> {
    fn deref_mut(&mut self) -> &mut Model {
        self.0.as_mut().expect("a ModelGuard holds an open model")
    }
}

/// The guard of an open, unpoisoned runtime, or the error that says why there is none.
fn open_guard(locked: LockResult<MutexGuard<'_, Option<Model>>>) -> PyResult<ModelGuard<'_>> {
    let guard = locked.map_err(|_| {
        InternalError::new_err(
            "the runtime stopped after an internal error; call session.reset() to start over with an empty session",
        )
    })?;
    if guard.is_none() {
        return Err(closed_err());
    }
    Ok(ModelGuard(guard))
}

fn closed_err() -> PyErr {
    RuntimeClosedError::new_err("this ModelRuntime was closed; load the model again to use it")
}

/// Converts Python token ids, refusing negatives with the same error as ids past the vocabulary.
pub fn token_ids(ids: Vec<i64>) -> PyResult<Vec<u32>> {
    ids.iter()
        .enumerate()
        .map(|(i, &t)| {
            u32::try_from(t).map_err(|_| {
                TokenOutOfRangeError::new_err(format!("token id {t} at input index {i} is not a valid token id"))
            })
        })
        .collect()
}

/// Extracts token ids from any Python sequence of ints, naming the argument when it is not one
/// (an int too large for 64 bits is reported like any other id out of range).
pub fn extract_ids(arg: &str, value: &Bound<'_, PyAny>) -> PyResult<Vec<u32>> {
    let items: Vec<Bound<'_, PyAny>> = value
        .try_iter()
        .and_then(|it| it.collect::<PyResult<_>>())
        .map_err(|_| pyo3::exceptions::PyTypeError::new_err(format!("{arg} must be a sequence of token ids")))?;
    let mut ids = Vec::with_capacity(items.len());
    for (i, item) in items.iter().enumerate() {
        let id: i64 = match item.extract::<i64>() {
            Ok(v) => v,
            Err(_) if item.is_instance_of::<pyo3::types::PyInt>() => {
                return Err(TokenOutOfRangeError::new_err(format!(
                    "token id {item} at input index {i} is not a valid token id"
                )))
            }
            Err(_) => {
                return Err(pyo3::exceptions::PyTypeError::new_err(format!(
                    "{arg}[{i}] must be an int token id, not {}",
                    item.get_type().name()?
                )))
            }
        };
        ids.push(id);
    }
    token_ids(ids)
}

impl PyModelRuntime {
    /// Locks the model from a thread holding the GIL, waiting with the GIL released (see
    /// `gil::lock_released`). After an internal error (a Rust panic mid-step) the lock is
    /// poisoned: the session may be half-updated, so every call but `session.reset()` says so.
    pub(crate) fn lock(&self, py: Python<'_>) -> PyResult<ModelGuard<'_>> {
        open_guard(lock_released(py, &self.inner))
    }

    /// Locks the model from inside `py.detach`, where the GIL is not held; a thread holding the
    /// GIL must use `lock`.
    pub(crate) fn lock_detached(&self) -> PyResult<ModelGuard<'_>> {
        open_guard(self.inner.lock())
    }

    /// Locks the model even after an internal error, clearing it by resetting the session.
    fn lock_and_recover(&self, py: Python<'_>) -> PyResult<ModelGuard<'_>> {
        let mut guard = match lock_released(py, &self.inner) {
            Ok(g) => g,
            Err(poisoned) => {
                let mut g = poisoned.into_inner();
                if let Some(m) = g.as_mut() {
                    m.runtime_mut().session_mut().reset();
                }
                self.inner.clear_poison();
                g
            }
        };
        match guard.as_mut() {
            Some(_) => Ok(ModelGuard(guard)),
            None => Err(closed_err()),
        }
    }

    /// A runtime owning `model`.
    fn wrap(model: Model) -> Self {
        Self { inner: Mutex::new(Some(model)), id: NEXT_RUNTIME_ID.fetch_add(1, Ordering::Relaxed) }
    }

    /// Token ids of a prompt given as text (encoded with special tokens) or as ids.
    pub(crate) fn prompt_ids(&self, py: Python<'_>, prompt: &Bound<'_, PyAny>) -> PyResult<Vec<u32>> {
        let prompt = match prompt.extract::<String>() {
            Ok(text) => Prompt::Text(text),
            Err(_) => Prompt::Ids(extract_ids("prompt", prompt)?),
        };
        py.detach(|| catch_panic(|| self.lock_detached()?.prompt_ids(&prompt).map_err(model_err)))
    }

    /// Token ids of a chat rendered through the model's template (or `template`).
    pub(crate) fn chat_ids(
        &self,
        py: Python<'_>,
        messages: &Bound<'_, PyAny>,
        template: Option<&str>,
    ) -> PyResult<Vec<u32>> {
        let messages = conversation("messages", messages)?;
        py.detach(|| catch_panic(|| self.lock_detached()?.chat_ids(&messages, template).map_err(model_err)))
    }

    fn wrap_output(
        &self,
        py: Python<'_>,
        out: StepOutput,
        completion: Option<CandleCompletion>,
    ) -> PyResult<PySubmission> {
        let output = Py::new(py, PyStepOutput { inner: out, runtime_id: self.id })?;
        Ok(PySubmission { output, completion })
    }

    fn inspected(&self, py: Python<'_>, r: InspectedOutput<StepOutput>) -> PyResult<PyInspectedOutput> {
        let output = Py::new(py, PyStepOutput { inner: r.output, runtime_id: self.id })?;
        let observations = Py::new(py, to_python(py, r.observations)?)?;
        Ok(PyInspectedOutput { output, observations })
    }
}

fn request_of(request: Option<PyRef<'_, PyObservationRequest>>) -> ObservationRequest {
    request.map(|r| r.inner.clone()).unwrap_or_else(ObservationRequest::all)
}

fn non_negative(arg: &str, v: Option<i64>) -> PyResult<Option<usize>> {
    v.map(|v| {
        usize::try_from(v).map_err(|_| Python::attach(|py| invalid_option(py, format!("{arg} must be >= 0, got {v}"))))
    })
    .transpose()
}

/// A count given to `load` (`max_context`, `threads`): an int from 0 up, any larger int (even
/// past 64 bits) an `InvalidOptionError` naming it, not a bare `OverflowError`.
fn count_option(py: Python<'_>, arg: &str, v: Option<&Bound<'_, PyAny>>) -> PyResult<Option<usize>> {
    let Some(v) = v.filter(|v| !v.is_none()) else { return Ok(None) };
    if !v.is_instance_of::<pyo3::types::PyInt>() || v.is_instance_of::<pyo3::types::PyBool>() {
        let kind = v.get_type().name()?;
        return Err(pyo3::exceptions::PyTypeError::new_err(format!("{arg} must be an int or None, not {kind}")));
    }
    match v.extract::<u64>().ok().and_then(|n| usize::try_from(n).ok()) {
        Some(n) => Ok(Some(n)),
        None => Err(invalid_option(py, format!("{arg} must be an int from 0 up to {}, got {v}", u64::MAX))),
    }
}

#[pymethods]
impl PyModelRuntime {
    /// Loads a Hugging Face directory or a GGUF file onto a device (the GIL is released while
    /// loading).
    ///
    /// Args:
    ///     path (str | os.PathLike): a GGUF file, a directory with config.json, safetensors
    ///         weights and tokenizer.json, or a Hugging Face Hub name (``"org/name"``, or
    ///         ``"org/name:Q4_K_M"`` for a GGUF repository's quantization), fetched through
    ///         ``huggingface_hub``'s cache (``candlewick.hub.resolve_model``). A local path that
    ///         exists always wins.
    ///     device (str): ``"cpu"``, ``"cuda"``, ``"cuda:N"``, ``"metal"`` or ``"auto"`` (the best
    ///         this build has).
    ///     dtype (str | None): ``"f32"``, ``"f16"`` or ``"bf16"``; None keeps a GGUF quantized and
    ///         runs a checkpoint in float32 on the CPU.
    ///     max_context (int | None): the session's context in tokens; None: the model's trained
    ///         context.
    ///     threads (int | None): CPU compute threads; None keeps the process's count (one per
    ///         physical core unless ``CANDLE_NUM_THREADS``/``RAYON_NUM_THREADS`` say otherwise).
    ///         Process-wide: the first load fixes it, and a later load asking another count
    ///         raises ``ValueError``.
    ///     quantize (str | None): quantize the matmul weights at load (``"q8_0"``, ``"q4_k"``, ...;
    ///         a GGUF is de-quantized first; docs/cpu.md); None keeps the checkpoint's types.
    ///     check_tensors (bool): check that every weight and block scale is finite as it loads
    ///         (llama.cpp's ``--check-tensors``, on by default here): a NaN or infinity raises
    ///         ``ArtifactError`` naming the tensor. False skips the check.
    ///     kv_cache_type (str | None): how the KV cache holds keys and values: ``"f16"``,
    ///         ``"q8_0"`` (about half of float16's memory; the CPU only, docs/cpu.md), ``"f32"`` or
    ///         ``"bf16"`` (llama.cpp's ``-ctk``/``-ctv``); None: float16 for a quantized model on
    ///         the CPU, the compute dtype otherwise. Another name raises ``ValueError``.
    ///     prefill_chunk (int | None): the most tokens one step runs; a longer prompt runs in
    ///         chunks of this many, so its activations and attention scores are one chunk's
    ///         (observations and interventions span the chunks). None: 512. Below 1 raises
    ///         ``ValueError``.
    ///     draft_model (str | os.PathLike | None): a smaller model sharing the tokenizer (same
    ///         vocabulary, BOS and EOS) that proposes tokens for speculative decoding in
    ///         ``generate``, ``stream`` and ``chat``; loaded with the same options. Output and
    ///         sampling distribution are unchanged (``num_draft_tokens`` sets how many a step).
    ///         A Hub name too.
    ///     filename (str | None): with a Hub name, the file of the repository to load: a name or
    ///         a glob (``"*Q8_0.gguf"``), as llama-cpp-python's ``Llama.from_pretrained``.
    ///     revision (str | None): with a Hub name, the branch, tag or commit to load.
    ///
    /// Returns:
    ///     ModelRuntime: the loaded model with an empty session.
    ///
    /// Example:
    ///     >>> rt = candlewick.ModelRuntime.load("gemma-3-270m.gguf", device="cpu", max_context=2048)
    #[staticmethod]
    #[pyo3(signature = (path, device="auto", dtype=None, max_context=None, threads=None, quantize=None, check_tensors=true, draft_model=None, kv_cache_type=None, prefill_chunk=None, filename=None, revision=None))]
    #[allow(clippy::too_many_arguments)]
    fn load(
        py: Python<'_>,
        path: PathBuf,
        device: &str,
        dtype: Option<String>,
        max_context: Option<Bound<'_, PyAny>>,
        threads: Option<Bound<'_, PyAny>>,
        quantize: Option<String>,
        check_tensors: bool,
        draft_model: Option<PathBuf>,
        kv_cache_type: Option<String>,
        prefill_chunk: Option<Bound<'_, PyAny>>,
        filename: Option<String>,
        revision: Option<String>,
    ) -> PyResult<Self> {
        let path = resolve_model(py, &path, filename.as_deref(), revision.as_deref())?;
        let draft_model = draft_model.map(|d| resolve_model(py, &d, None, None)).transpose()?;
        let options = ModelOptions {
            device: device.to_owned(),
            dtype,
            max_context: count_option(py, "max_context", max_context.as_ref())?,
            threads: count_option(py, "threads", threads.as_ref())?,
            quantize,
            check_tensors,
            draft_model,
            kv_cache_type,
            prefill_chunk: count_option(py, "prefill_chunk", prefill_chunk.as_ref())?,
        };
        let model = py.detach(|| catch_panic(|| Model::load(&path, &options).map_err(model_err)))?;
        if let Some(report) = &model.info().quantized_at_load {
            // Quantization changes what runs, so say what it did where Python logging sees it.
            let logger = py.import("logging")?.call_method1("getLogger", ("candlewick",))?;
            logger.call_method1("info", ("%s: %s", path.display().to_string(), report.summary()))?;
        }
        Ok(Self::wrap(model))
    }

    /// Frees the model: its session, and its weights once no fork or engine shares them. Later
    /// calls raise ``RuntimeClosedError``; closing twice does nothing.
    ///
    /// Example:
    ///     >>> rt.close()
    ///     >>> rt.generate("Hi")  # raises candlewick.RuntimeClosedError
    fn close(&self, py: Python<'_>) -> PyResult<()> {
        let model = match lock_released(py, &self.inner) {
            Ok(mut g) => g.take(),
            Err(poisoned) => poisoned.into_inner().take(),
        };
        self.inner.clear_poison();
        // Dropping the weights can take a moment: other Python threads run meanwhile.
        py.detach(move || drop(model));
        Ok(())
    }

    /// Whether ``close()`` was called.
    #[getter]
    fn closed(&self, py: Python<'_>) -> bool {
        match lock_released(py, &self.inner) {
            Ok(g) => g.is_none(),
            Err(poisoned) => poisoned.into_inner().is_none(),
        }
    }

    fn __enter__(slf: PyRef<'_, Self>) -> PyResult<PyRef<'_, Self>> {
        slf.lock(slf.py())?;
        Ok(slf)
    }

    fn __exit__(
        &self,
        py: Python<'_>,
        _ty: Option<&Bound<'_, PyAny>>,
        _value: Option<&Bound<'_, PyAny>>,
        _tb: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<bool> {
        self.close(py)?;
        Ok(false)
    }

    /// A new runtime over the same weights (only a new KV cache costs memory) whose session
    /// starts as a copy of this one's: tokens, position, cache and kept interventions.
    ///
    /// Returns:
    ///     ModelRuntime: the fork; stepping either leaves the other as it was.
    ///
    /// Example:
    ///     >>> child = rt.fork()
    ///     >>> child.session.position == rt.session.position
    ///     True
    fn fork(&self, py: Python<'_>) -> PyResult<Self> {
        let model = py.detach(|| catch_panic(|| self.lock_detached()?.fork().map_err(model_err)))?;
        Ok(Self::wrap(model))
    }

    /// The backend this runtime's session runs through (a view bound to this runtime).
    #[getter]
    fn backend(slf: &Bound<'_, Self>) -> PyBackend {
        PyBackend { runtime: slf.clone().unbind() }
    }

    /// The runtime's one session (a view bound to this runtime).
    #[getter]
    fn session(slf: &Bound<'_, Self>) -> PySession {
        PySession { runtime: slf.clone().unbind() }
    }

    /// The capabilities admitted at preparation and realised by the session.
    #[getter]
    fn capabilities(&self, py: Python<'_>) -> PyResult<PySessionCapabilities> {
        let c = self.lock(py)?.runtime().capabilities();
        Ok(PySessionCapabilities {
            persistent_cache: c.persistent_cache,
            output_observation: c.output_observation,
            activation_inspection: c.activation_inspection,
            activation_intervention: c.activation_intervention,
        })
    }

    /// Architecture, sizes, weight types, dtype and context of the loaded model (a dict); for a
    /// mixture of experts also `num_experts`, `experts_per_token`, `expert_intermediate_size`,
    /// `shared_expert_intermediate_size` (`None` without a shared expert) and `moe_layers`
    /// (`None` / 0 for a dense model).
    #[getter]
    fn model_info<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let info = self.lock(py)?.info().clone();
        let d = PyDict::new(py);
        d.set_item("architecture", info.architecture)?;
        d.set_item("num_layers", info.num_layers)?;
        d.set_item("hidden_size", info.hidden_size)?;
        d.set_item("intermediate_size", info.intermediate_size)?;
        d.set_item("num_heads", info.num_heads)?;
        d.set_item("num_kv_heads", info.num_kv_heads)?;
        d.set_item("head_dim", info.head_dim)?;
        d.set_item("vocab_size", info.vocab_size)?;
        d.set_item("dtype", &info.dtype)?;
        d.set_item("context_length", info.context_length)?;
        d.set_item("max_context", info.max_context)?;
        d.set_item("sliding_window", info.sliding_window)?;
        d.set_item("kv_cache_type", &info.kv_cache_type)?;
        d.set_item("tie_word_embeddings", info.tie_word_embeddings)?;
        d.set_item("num_experts", info.num_experts)?;
        d.set_item("experts_per_token", info.experts_per_token)?;
        d.set_item("expert_intermediate_size", info.expert_intermediate_size)?;
        d.set_item("shared_expert_intermediate_size", info.shared_expert_intermediate_size)?;
        d.set_item("moe_layers", info.moe_layers)?;
        d.set_item("weight_types", info.weight_types.clone())?;
        d.set_item("parameters", info.parameters)?;
        d.set_item("file_size", info.file_size)?;
        d.set_item("format", info.format)?;
        d.set_item("path", &info.path)?;
        d.set_item("device", &info.device)?;
        d.set_item("threads", info.threads)?;
        let quantized = match &info.quantized_at_load {
            Some(r) => {
                let q = PyDict::new(py);
                q.set_item("requested", &r.requested)?;
                q.set_item("tensors", r.quantized.clone())?;
                q.set_item("notes", r.notes.clone())?;
                q.set_item("dense", r.dense.clone())?;
                q.set_item("summary", r.summary())?;
                Some(q)
            }
            None => None,
        };
        d.set_item("quantized_at_load", quantized)?;
        d.set_item("draft_model", &info.draft_model)?;
        Ok(d)
    }

    /// Appends tokens at the session's position and computes their logits.
    ///
    /// Args:
    ///     tokens (Sequence[int]): token ids to append.
    ///     all_logits (bool): return every position's logits, not only the last one's.
    ///     interventions (Sequence[Intervention] | None): edits for this step only, on top of
    ///         the kept ones.
    ///
    /// Returns:
    ///     Submission: ``.wait()`` gives the ``StepOutput`` (logits ``[rows, vocab]``).
    ///
    /// Example:
    ///     >>> out = rt.prefill([2, 651, 6037]).wait()
    ///     >>> out.logits.shape
    ///     (1, 262144)
    #[pyo3(signature = (tokens, all_logits=false, interventions=None))]
    fn prefill(
        &self,
        py: Python<'_>,
        tokens: &Bound<'_, PyAny>,
        all_logits: bool,
        interventions: Option<Vec<PyRef<'_, PyIntervention>>>,
    ) -> PyResult<PySubmission> {
        let input = PrefillInput::new(extract_ids("tokens", tokens)?)
            .all_logits(all_logits)
            .with_interventions(edits_of(interventions));
        let sub =
            py.detach(|| catch_panic(|| self.lock_detached()?.runtime_mut().prefill(input).map_err(runtime_err)))?;
        self.wrap_output(py, sub.output, Some(sub.completion))
    }

    /// Appends tokens and computes the logits of each of them.
    ///
    /// Args:
    ///     tokens (Sequence[int]): token ids to append (usually one).
    ///     interventions (Sequence[Intervention] | None): edits for this step only.
    ///
    /// Returns:
    ///     Submission: ``.wait()`` gives the ``StepOutput``, one logits row per token.
    ///
    /// Example:
    ///     >>> rt.decode([9079]).wait().logits.shape
    ///     (1, 262144)
    #[pyo3(signature = (tokens, interventions=None))]
    fn decode(
        &self,
        py: Python<'_>,
        tokens: &Bound<'_, PyAny>,
        interventions: Option<Vec<PyRef<'_, PyIntervention>>>,
    ) -> PyResult<PySubmission> {
        let input = DecodeInput::new(extract_ids("tokens", tokens)?).with_interventions(edits_of(interventions));
        let sub =
            py.detach(|| catch_panic(|| self.lock_detached()?.runtime_mut().decode(input).map_err(runtime_err)))?;
        self.wrap_output(py, sub.output, Some(sub.completion))
    }

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
    ///
    /// Returns:
    ///     InspectedOutput: ``.output`` and ``.observations`` (path -> numpy array).
    ///
    /// Example:
    ///     >>> r = rt.inspect_prefill([2, 651], candlewick.ObservationRequest.select(["model.layers.1"]))
    ///     >>> r.observations["model.layers.1.output"].shape
    ///     (2, 640)
    #[pyo3(signature = (tokens, request=None, all_logits=false, interventions=None))]
    fn inspect_prefill(
        &self,
        py: Python<'_>,
        tokens: &Bound<'_, PyAny>,
        request: Option<PyRef<'_, PyObservationRequest>>,
        all_logits: bool,
        interventions: Option<Vec<PyRef<'_, PyIntervention>>>,
    ) -> PyResult<PyInspectedOutput> {
        let input = PrefillInput::new(extract_ids("tokens", tokens)?)
            .all_logits(all_logits)
            .with_interventions(edits_of(interventions));
        let req = request_of(request);
        let r = py.detach(|| {
            catch_panic(|| self.lock_detached()?.runtime_mut().inspect_prefill(input, &req).map_err(runtime_err))
        })?;
        self.inspected(py, r)
    }

    /// A decode that also returns the requested observation points.
    ///
    /// Args:
    ///     tokens (Sequence[int]): token ids to append.
    ///     request (ObservationRequest | None): which points; None: all of them.
    ///     interventions (Sequence[Intervention] | None): edits for this step only.
    ///
    /// Returns:
    ///     InspectedOutput: ``.output`` and ``.observations``.
    ///
    /// Example:
    ///     >>> rt.inspect_decode([9079]).observations["model.norm"].shape
    ///     (1, 640)
    #[pyo3(signature = (tokens, request=None, interventions=None))]
    fn inspect_decode(
        &self,
        py: Python<'_>,
        tokens: &Bound<'_, PyAny>,
        request: Option<PyRef<'_, PyObservationRequest>>,
        interventions: Option<Vec<PyRef<'_, PyIntervention>>>,
    ) -> PyResult<PyInspectedOutput> {
        let input = DecodeInput::new(extract_ids("tokens", tokens)?).with_interventions(edits_of(interventions));
        let req = request_of(request);
        let r = py.detach(|| {
            catch_panic(|| self.lock_detached()?.runtime_mut().inspect_decode(input, &req).map_err(runtime_err))
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
    ///
    /// Returns:
    ///     InspectedOutput: every row's logits and the requested points.
    ///
    /// Example:
    ///     >>> r = rt.trace([2, 651, 6037], interventions=[iv.scale("model.layers.3.attention.heads", [2], 0.0)])
    ///     >>> rt.unembed(r.observations["model.layers.5.output"]).shape
    ///     (3, 262144)
    #[pyo3(signature = (tokens, request=None, interventions=None))]
    fn trace(
        &self,
        py: Python<'_>,
        tokens: &Bound<'_, PyAny>,
        request: Option<PyRef<'_, PyObservationRequest>>,
        interventions: Option<Vec<PyRef<'_, PyIntervention>>>,
    ) -> PyResult<PyInspectedOutput> {
        let input = PrefillInput::new(extract_ids("tokens", tokens)?).with_interventions(edits_of(interventions));
        let req = request_of(request);
        let r =
            py.detach(|| catch_panic(|| self.lock_detached()?.runtime().trace(input, &req).map_err(runtime_err)))?;
        self.inspected(py, r)
    }

    /// Runs each token list on a fresh context of its own, as ``trace`` does; the session is
    /// left as it was.
    ///
    /// Args:
    ///     prompts (Sequence[Sequence[int]]): one token list per run.
    ///     request (ObservationRequest | None): which points; None: all of them.
    ///     interventions (Sequence[Intervention] | None): edits for every run.
    ///
    /// Returns:
    ///     list[InspectedOutput]: one per token list.
    ///
    /// Example:
    ///     >>> [r.output.num_tokens for r in rt.trace_batch([[2, 651], [2, 651, 6037]])]
    ///     [2, 3]
    #[pyo3(signature = (prompts, request=None, interventions=None))]
    fn trace_batch(
        &self,
        py: Python<'_>,
        prompts: Vec<Bound<'_, PyAny>>,
        request: Option<PyRef<'_, PyObservationRequest>>,
        interventions: Option<Vec<PyRef<'_, PyIntervention>>>,
    ) -> PyResult<Vec<PyInspectedOutput>> {
        let edits = edits_of(interventions);
        let inputs = prompts
            .iter()
            .map(|p| Ok(PrefillInput::new(extract_ids("prompts[i]", p)?).with_interventions(edits.clone())))
            .collect::<PyResult<Vec<_>>>()?;
        let req = request_of(request);
        let outs = py.detach(|| {
            catch_panic(|| {
                let model = self.lock_detached()?;
                inputs
                    .into_iter()
                    .map(|i| model.runtime().trace(i, &req).map_err(runtime_err))
                    .collect::<PyResult<Vec<_>>>()
            })
        })?;
        outs.into_iter().map(|r| self.inspected(py, r)).collect()
    }

    #[doc = concat!("generate_batch($self, prompts, *, ", sampling_signature!(), ")\n--\n")]
    /// Generates from every prompt at once, the unfinished ones decoding together in one
    /// batched step. Each gets what ``generate`` would give it alone; the session is left as it
    /// was.
    ///
    /// Args:
    ///     prompts (Sequence[str | Sequence[int]]): texts or token lists.
    #[doc = sampling_args_doc!()]
    ///
    /// Returns:
    ///     list[GenerationResult]: one per prompt.
    ///
    /// Example:
    ///     >>> [r.text for r in rt.generate_batch(["Hello", "Bonjour"], max_tokens=4, temperature=0)]
    #[pyo3(text_signature = None, signature = (prompts, *, max_tokens=Given::Omitted, temperature=None, top_k=None,
        top_p=None, min_p=None, repetition_penalty=None, presence_penalty=None, frequency_penalty=None,
        logit_bias=None, stop=None, seed=None, ignore_eos=false, logprobs=None, skip_special_tokens=true, response_format=None, grammar=None, regex=None,
        choice=None, prompt_lookup_num_tokens=None, num_draft_tokens=None))]
    #[allow(clippy::too_many_arguments)]
    fn generate_batch<'py>(
        &self,
        py: Python<'py>,
        prompts: Vec<Bound<'py, PyAny>>,
        max_tokens: Given<'py>,
        temperature: Option<Bound<'py, PyAny>>,
        top_k: Option<Bound<'py, PyAny>>,
        top_p: Option<Bound<'py, PyAny>>,
        min_p: Option<Bound<'py, PyAny>>,
        repetition_penalty: Option<Bound<'py, PyAny>>,
        presence_penalty: Option<Bound<'py, PyAny>>,
        frequency_penalty: Option<Bound<'py, PyAny>>,
        logit_bias: Option<Bound<'py, PyAny>>,
        stop: Option<Bound<'py, PyAny>>,
        seed: Option<Bound<'py, PyAny>>,
        ignore_eos: bool,
        logprobs: Option<Bound<'py, PyAny>>,
        skip_special_tokens: bool,
        response_format: Option<Bound<'py, PyAny>>,
        grammar: Option<String>,
        regex: Option<String>,
        choice: Option<Vec<String>>,
        prompt_lookup_num_tokens: Option<Bound<'py, PyAny>>,
        num_draft_tokens: Option<Bound<'py, PyAny>>,
    ) -> PyResult<Vec<PyGenerationResult>> {
        let args = SamplingArgs {
            max_tokens,
            temperature,
            top_k,
            top_p,
            min_p,
            repetition_penalty,
            presence_penalty,
            frequency_penalty,
            logit_bias,
            stop,
            seed,
            ignore_eos,
            logprobs,
            skip_special_tokens,
            response_format,
            grammar,
            regex,
            choice,
            prompt_lookup_num_tokens,
            num_draft_tokens,
        };
        let opts = args.options(self.lock(py)?.defaults())?;
        let prompts = prompts
            .iter()
            .map(|p| match p.extract::<String>() {
                Ok(text) => Ok(Prompt::Text(text)),
                Err(_) => Ok(Prompt::Ids(extract_ids("prompts[i]", p)?)),
            })
            .collect::<PyResult<Vec<_>>>()?;
        let results =
            py.detach(|| catch_panic(|| self.lock_detached()?.generate_batch(&prompts, opts).map_err(model_err)))?;
        results.into_iter().map(|r| super::generation::to_result(py, r)).collect()
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

    /// The interventions kept on for every later step, generation included; setting a list
    /// validates it first (a bad one changes nothing), ``[]`` turns them off.
    #[getter]
    fn get_interventions(&self, py: Python<'_>) -> PyResult<Vec<PyIntervention>> {
        Ok(self.lock(py)?.runtime().interventions().into_iter().map(|inner| PyIntervention { inner }).collect())
    }

    #[setter]
    fn set_interventions(&self, py: Python<'_>, interventions: Option<Vec<PyRef<'_, PyIntervention>>>) -> PyResult<()> {
        let edits = edits_of(interventions);
        self.lock(py)?.runtime_mut().set_interventions(edits).map_err(runtime_err)
    }

    /// Reads a llama.cpp control vector (GGUF) and adds its edits to ``interventions``, with
    /// llama.cpp's ``--control-vector-scaled FILE SCALE`` and ``--control-vector-layer-range``
    /// meaning.
    ///
    /// Args:
    ///     path (str | os.PathLike): the control-vector GGUF.
    ///     scale (float): multiplies every direction.
    ///     layer_range (tuple[int, int] | None): the first and last layer (counting from 1)
    ///         to apply it to; None: all.
    ///
    /// Returns:
    ///     list[Intervention]: the edits added.
    ///
    /// Example:
    ///     >>> rt.load_control_vector("happy.gguf", scale=0.8)
    #[pyo3(signature = (path, scale=1.0, layer_range=None))]
    fn load_control_vector(
        &self,
        py: Python<'_>,
        path: PathBuf,
        scale: f32,
        layer_range: Option<(i64, i64)>,
    ) -> PyResult<Vec<PyIntervention>> {
        let range = layer_range
            .map(|(a, b)| {
                Ok::<_, PyErr>((
                    non_negative("layer_range", Some(a))?.unwrap_or(0),
                    non_negative("layer_range", Some(b))?.unwrap_or(0),
                ))
            })
            .transpose()?;
        let edits = py.detach(|| {
            catch_panic(|| self.lock_detached()?.load_control_vector(&path, scale, range).map_err(model_err))
        })?;
        Ok(edits.into_iter().map(|inner| PyIntervention { inner }).collect())
    }

    /// A context manager that keeps ``interventions`` on inside a ``with`` block, then puts
    /// back what was kept before.
    ///
    /// Args:
    ///     interventions (Sequence[Intervention]): the edits to keep on inside the block.
    ///
    /// Returns:
    ///     InterventionScope: use it in a ``with`` statement.
    ///
    /// Example:
    ///     >>> with rt.intervene([iv.add("model.layers.6.output", direction, scale=4.0)]):
    ///     ...     rt.generate("Today I feel", max_tokens=20)
    fn intervene(slf: &Bound<'_, Self>, interventions: Vec<PyRef<'_, PyIntervention>>) -> PyInterventionScope {
        PyInterventionScope {
            runtime: slf.clone().unbind(),
            edits: edits_of(Some(interventions)),
            saved: Mutex::new(None),
        }
    }

    /// The model's tokenizer, with its chat template.
    #[getter]
    fn tokenizer(&self, py: Python<'_>) -> PyResult<PyTokenizer> {
        let model = self.lock(py)?;
        Ok(PyTokenizer {
            inner: model.tokenizer().map_err(model_err)?.clone(),
            template: model.chat_template().cloned(),
        })
    }

    #[doc = concat!("generate($self, prompt, *, stream=False, ", sampling_signature!(), ")\n--\n")]
    /// Generates text from a prompt; a new prompt that shares a prefix with what the session
    /// holds prefills only the rest. Ctrl-C stops it within one step.
    ///
    /// Args:
    ///     prompt (str | Sequence[int]): text (encoded with the model's special tokens) or ids.
    ///     stream (bool): return a ``GenerationStream`` of text pieces instead of the result.
    #[doc = sampling_args_doc!()]
    ///
    /// Returns:
    ///     GenerationResult: ``text``, ``token_ids``, ``finish_reason``, ``usage`` and
    ///     ``logprobs`` (or a ``GenerationStream`` with ``stream=True``).
    ///
    /// Example:
    ///     >>> r = rt.generate("The capital of France is", max_tokens=16, temperature=0.7, seed=1)
    ///     >>> r.finish_reason, r.usage["completion_tokens"]
    ///     ('length', 16)
    #[pyo3(text_signature = None, signature = (prompt, *, stream=false, max_tokens=Given::Omitted, temperature=None,
        top_k=None, top_p=None, min_p=None, repetition_penalty=None, presence_penalty=None, frequency_penalty=None,
        logit_bias=None, stop=None, seed=None, ignore_eos=false, logprobs=None, skip_special_tokens=true, response_format=None, grammar=None, regex=None,
        choice=None, prompt_lookup_num_tokens=None, num_draft_tokens=None))]
    #[allow(clippy::too_many_arguments)]
    fn generate<'py>(
        slf: &Bound<'py, Self>,
        prompt: &Bound<'py, PyAny>,
        stream: bool,
        max_tokens: Given<'py>,
        temperature: Option<Bound<'py, PyAny>>,
        top_k: Option<Bound<'py, PyAny>>,
        top_p: Option<Bound<'py, PyAny>>,
        min_p: Option<Bound<'py, PyAny>>,
        repetition_penalty: Option<Bound<'py, PyAny>>,
        presence_penalty: Option<Bound<'py, PyAny>>,
        frequency_penalty: Option<Bound<'py, PyAny>>,
        logit_bias: Option<Bound<'py, PyAny>>,
        stop: Option<Bound<'py, PyAny>>,
        seed: Option<Bound<'py, PyAny>>,
        ignore_eos: bool,
        logprobs: Option<Bound<'py, PyAny>>,
        skip_special_tokens: bool,
        response_format: Option<Bound<'py, PyAny>>,
        grammar: Option<String>,
        regex: Option<String>,
        choice: Option<Vec<String>>,
        prompt_lookup_num_tokens: Option<Bound<'py, PyAny>>,
        num_draft_tokens: Option<Bound<'py, PyAny>>,
    ) -> PyResult<Bound<'py, PyAny>> {
        let args = SamplingArgs {
            max_tokens,
            temperature,
            top_k,
            top_p,
            min_p,
            repetition_penalty,
            presence_penalty,
            frequency_penalty,
            logit_bias,
            stop,
            seed,
            ignore_eos,
            logprobs,
            skip_special_tokens,
            response_format,
            grammar,
            regex,
            choice,
            prompt_lookup_num_tokens,
            num_draft_tokens,
        };
        let py = slf.py();
        let opts = args.options(slf.get().lock(py)?.defaults())?;
        let ids = slf.get().prompt_ids(py, prompt)?;
        if stream {
            return Ok(Bound::new(py, PyGenerationStream::start(py, slf, ids, opts)?)?.into_any());
        }
        Ok(Bound::new(py, run_to_end(py, slf.get(), ids, opts)?)?.into_any())
    }

    #[doc = concat!("stream($self, prompt, *, ", sampling_signature!(), ")\n--\n")]
    /// Generates from a prompt, yielding text pieces as they become final.
    ///
    /// Args:
    ///     prompt (str | Sequence[int]): text (encoded with the model's special tokens) or ids.
    #[doc = sampling_args_doc!()]
    ///
    /// Returns:
    ///     GenerationStream: an iterator of ``str`` pieces; ``.logprobs`` holds the last piece's
    ///     log-probabilities, ``.result`` the whole generation once it ends or is closed.
    ///
    /// Example:
    ///     >>> for piece in rt.stream("def fibonacci(n):", max_tokens=64, stop=["\n\n"]):
    ///     ...     print(piece, end="", flush=True)
    #[pyo3(text_signature = None, signature = (prompt, *, max_tokens=Given::Omitted, temperature=None, top_k=None,
        top_p=None, min_p=None, repetition_penalty=None, presence_penalty=None, frequency_penalty=None,
        logit_bias=None, stop=None, seed=None, ignore_eos=false, logprobs=None, skip_special_tokens=true, response_format=None, grammar=None, regex=None,
        choice=None, prompt_lookup_num_tokens=None, num_draft_tokens=None))]
    #[allow(clippy::too_many_arguments)]
    fn stream<'py>(
        slf: &Bound<'py, Self>,
        prompt: &Bound<'py, PyAny>,
        max_tokens: Given<'py>,
        temperature: Option<Bound<'py, PyAny>>,
        top_k: Option<Bound<'py, PyAny>>,
        top_p: Option<Bound<'py, PyAny>>,
        min_p: Option<Bound<'py, PyAny>>,
        repetition_penalty: Option<Bound<'py, PyAny>>,
        presence_penalty: Option<Bound<'py, PyAny>>,
        frequency_penalty: Option<Bound<'py, PyAny>>,
        logit_bias: Option<Bound<'py, PyAny>>,
        stop: Option<Bound<'py, PyAny>>,
        seed: Option<Bound<'py, PyAny>>,
        ignore_eos: bool,
        logprobs: Option<Bound<'py, PyAny>>,
        skip_special_tokens: bool,
        response_format: Option<Bound<'py, PyAny>>,
        grammar: Option<String>,
        regex: Option<String>,
        choice: Option<Vec<String>>,
        prompt_lookup_num_tokens: Option<Bound<'py, PyAny>>,
        num_draft_tokens: Option<Bound<'py, PyAny>>,
    ) -> PyResult<PyGenerationStream> {
        let args = SamplingArgs {
            max_tokens,
            temperature,
            top_k,
            top_p,
            min_p,
            repetition_penalty,
            presence_penalty,
            frequency_penalty,
            logit_bias,
            stop,
            seed,
            ignore_eos,
            logprobs,
            skip_special_tokens,
            response_format,
            grammar,
            regex,
            choice,
            prompt_lookup_num_tokens,
            num_draft_tokens,
        };
        let py = slf.py();
        let opts = args.options(slf.get().lock(py)?.defaults())?;
        let ids = slf.get().prompt_ids(py, prompt)?;
        PyGenerationStream::start(py, slf, ids, opts)
    }

    #[doc = concat!(
        "chat($self, messages, *, stream=False, chat_template=None, tools=None, tool_choice=None, ",
        "parallel_tool_calls=True, tool_call_format=None, ",
        sampling_signature!(),
        ")\n--\n"
    )]
    /// Answers a conversation through the model's chat template (base models such as the
    /// default Gemma 3 270M ship none: pass ``chat_template``, or use an instruction-tuned model).
    ///
    /// Args:
    ///     messages (Sequence[dict]): ``{"role", "content"}`` dicts; a content may be a string
    ///         or a list of ``{"type": "text", "text": ...}`` parts, as OpenAI clients send it.
    ///     stream (bool): return a ``GenerationStream`` of text pieces instead of the result.
    ///     chat_template (str | None): a Jinja template to use instead of the model's.
    ///     tools (list[dict] | None): OpenAI tool objects, rendered by the template; the answer's
    ///         calls come back parsed in ``result.tool_calls`` (``finish_reason`` ``"tool_calls"``).
    ///     tool_choice (str | dict | None): ``"auto"`` (the default), ``"none"``, ``"required"`` or
    ///         ``{"type": "function", "function": {"name": ...}}``; the last two constrain the output
    ///         to a call whose arguments validate against the function's parameter schema.
    ///     parallel_tool_calls (bool): allow several calls in one answer.
    ///     tool_call_format (str | None): ``"hermes"``, ``"mistral"`` or ``"llama3"``; None detects
    ///         it from the chat template. ``tool_choice``, ``tool_call_format`` and
    ///         ``parallel_tool_calls=False`` without ``tools`` raise ``InvalidOptionError``.
    #[doc = sampling_args_doc!()]
    ///
    /// Returns:
    ///     GenerationResult: the assistant's answer (or a ``GenerationStream`` with ``stream=True``,
    ///     whose ``result.tool_calls`` holds the calls once it ends).
    ///
    /// Example:
    ///     >>> rt.chat([{"role": "user", "content": "Hi!"}], max_tokens=32).text
    #[pyo3(text_signature = None, signature = (messages, *, stream=false, chat_template=None, tools=None,
        tool_choice=None, parallel_tool_calls=true, tool_call_format=None, max_tokens=Given::Omitted, temperature=None, top_k=None, top_p=None, min_p=None, repetition_penalty=None,
        presence_penalty=None, frequency_penalty=None, logit_bias=None, stop=None, seed=None, ignore_eos=false,
        logprobs=None, skip_special_tokens=true, response_format=None, grammar=None, regex=None,
        choice=None, prompt_lookup_num_tokens=None, num_draft_tokens=None))]
    #[allow(clippy::too_many_arguments)]
    fn chat<'py>(
        slf: &Bound<'py, Self>,
        messages: &Bound<'py, PyAny>,
        stream: bool,
        chat_template: Option<&str>,
        tools: Option<Bound<'py, PyAny>>,
        tool_choice: Option<Bound<'py, PyAny>>,
        parallel_tool_calls: bool,
        tool_call_format: Option<&str>,
        max_tokens: Given<'py>,
        temperature: Option<Bound<'py, PyAny>>,
        top_k: Option<Bound<'py, PyAny>>,
        top_p: Option<Bound<'py, PyAny>>,
        min_p: Option<Bound<'py, PyAny>>,
        repetition_penalty: Option<Bound<'py, PyAny>>,
        presence_penalty: Option<Bound<'py, PyAny>>,
        frequency_penalty: Option<Bound<'py, PyAny>>,
        logit_bias: Option<Bound<'py, PyAny>>,
        stop: Option<Bound<'py, PyAny>>,
        seed: Option<Bound<'py, PyAny>>,
        ignore_eos: bool,
        logprobs: Option<Bound<'py, PyAny>>,
        skip_special_tokens: bool,
        response_format: Option<Bound<'py, PyAny>>,
        grammar: Option<String>,
        regex: Option<String>,
        choice: Option<Vec<String>>,
        prompt_lookup_num_tokens: Option<Bound<'py, PyAny>>,
        num_draft_tokens: Option<Bound<'py, PyAny>>,
    ) -> PyResult<Bound<'py, PyAny>> {
        let args = SamplingArgs {
            max_tokens,
            temperature,
            top_k,
            top_p,
            min_p,
            repetition_penalty,
            presence_penalty,
            frequency_penalty,
            logit_bias,
            stop,
            seed,
            ignore_eos,
            logprobs,
            skip_special_tokens,
            response_format,
            grammar,
            regex,
            choice,
            prompt_lookup_num_tokens,
            num_draft_tokens,
        };
        let py = slf.py();
        let mut opts = args.options(slf.get().lock(py)?.defaults())?;
        let tools = tools.filter(|t| !t.is_none());
        let Some(tools) = tools else {
            // Without tools these would change nothing: refused, naming them, rather than ignored.
            let stray: Vec<&str> = [
                ("tool_choice", tool_choice.is_some()),
                ("tool_call_format", tool_call_format.is_some()),
                ("parallel_tool_calls", !parallel_tool_calls),
            ]
            .into_iter()
            .filter_map(|(name, given)| given.then_some(name))
            .collect();
            if !stray.is_empty() {
                return Err(invalid_option(py, format!("{}: only with tools, and none were given", stray.join(", "))));
            }
            let ids = slf.get().chat_ids(py, messages, chat_template)?;
            if stream {
                return Ok(Bound::new(py, PyGenerationStream::start(py, slf, ids, opts)?)?.into_any());
            }
            return Ok(Bound::new(py, run_to_end(py, slf.get(), ids, opts)?)?.into_any());
        };
        let tool_values = tools_of(&tools)?;
        let choice = tool_choice_of(tool_choice.as_ref())?;
        let rt = slf.get();
        let (format, ids) = {
            let messages = conversation("messages", messages)?;
            let tools_value = template_value("tools", &tools)?;
            py.detach(|| {
                catch_panic(|| {
                    let model = rt.lock_detached()?;
                    let tokenizer = model.tokenizer().map_err(model_err)?;
                    let format = tokenizer.tool_call_format(tool_call_format, chat_template).map_err(text_err)?;
                    let grammar = tokenizer
                        .tool_call_grammar(format, &tool_values, &choice, parallel_tool_calls)
                        .map_err(text_err)?;
                    if let Some(g) = grammar {
                        if opts.constraint.is_some() {
                            return Err(GenerationOptionError::new_err(
                                "tool_choice \"required\" or a named function constrains the output already: give no other constraint",
                            ));
                        }
                        opts.constraint = Some(candlewick::generation::ConstraintSpec::Lark(g));
                    }
                    let ids = model.chat_ids_with(&messages, chat_template, Some(("tools", tools_value))).map_err(model_err)?;
                    Ok((format, ids))
                })
            })?
        };
        if stream {
            let s = PyGenerationStream::start(py, slf, ids, opts)?;
            let s = if choice == ToolChoice::None { s } else { s.with_tool_calls(format) };
            return Ok(Bound::new(py, s)?.into_any());
        }
        let result = run_to_end(py, rt, ids, opts)?;
        if choice == ToolChoice::None {
            return Ok(Bound::new(py, result)?.into_any());
        }
        let (text, calls) = {
            let model = rt.lock(py)?;
            model.tokenizer().map_err(model_err)?.parse_tool_calls(format, result.ids()).map_err(text_err)?
        };
        let calls = tool_calls_to_py(py, &calls)?;
        Ok(Bound::new(py, result.with_tool_calls(text, calls))?.into_any())
    }

    /// The token ids the session holds, oldest first.
    ///
    /// Returns:
    ///     list[int]: the ids in the KV cache.
    ///
    /// Example:
    ///     >>> rt.prefill([2, 651]).wait(); rt.cached_tokens()
    ///     [2, 651]
    fn cached_tokens(&self, py: Python<'_>) -> PyResult<Vec<u32>> {
        Ok(self.lock(py)?.runtime().session().tokens().to_vec())
    }

    /// Every observation path the loaded model offers.
    ///
    /// Returns:
    ///     list[str]: dotted paths such as ``model.layers.0.attention.pattern``.
    ///
    /// Example:
    ///     >>> rt.observation_points()[:2]
    ///     ['model.embed_tokens', 'model.layers.0.input']
    fn observation_points(&self, py: Python<'_>) -> PyResult<Vec<String>> {
        Ok(self.lock(py)?.runtime().observation_points())
    }

    fn __repr__(&self, py: Python<'_>) -> PyResult<String> {
        let m = match self.lock(py) {
            Ok(m) => m,
            Err(e) if e.is_instance_of::<RuntimeClosedError>(py) => return Ok("ModelRuntime(closed)".into()),
            Err(e) => return Err(e),
        };
        let (info, s) = (m.info(), m.runtime().session());
        Ok(format!(
            "ModelRuntime(architecture={}, num_layers={}, device={}, position={}, max_context={})",
            py_repr(py, &info.architecture),
            info.num_layers,
            py_repr(py, &info.device),
            s.position(),
            s.max_context()
        ))
    }
}

/// The backend of one runtime; it cannot be constructed or moved to another runtime.
#[pyclass(name = "Backend", module = "candlewick._native", frozen)]
pub struct PyBackend {
    runtime: Py<PyModelRuntime>,
}

#[pymethods]
impl PyBackend {
    /// The backend's name (`candle`).
    #[getter]
    fn name(&self, py: Python<'_>) -> PyResult<String> {
        Ok(self.runtime.get().lock(py)?.runtime().backend().descriptor().name)
    }

    /// The device the model runs on (`cpu`, `cuda:0`, ...).
    #[getter]
    fn device(&self, py: Python<'_>) -> PyResult<String> {
        Ok(self.runtime.get().lock(py)?.runtime().backend().descriptor().device.to_string())
    }

    /// Every device this build can run on, with the dtypes each computes in.
    ///
    /// Returns:
    ///     list[tuple[str, list[str]]]: ``(device, dtypes)`` pairs.
    ///
    /// Example:
    ///     >>> rt.backend.devices()[0][0]
    ///     'cpu'
    fn devices(&self, py: Python<'_>) -> PyResult<Vec<(String, Vec<String>)>> {
        let devs = self.runtime.get().lock(py)?.runtime().backend().devices().map_err(backend_err)?;
        Ok(devs.into_iter().map(|(d, c)| (d.to_string(), c.dtypes)).collect())
    }

    fn __repr__(&self, py: Python<'_>) -> PyResult<String> {
        Ok(format!("Backend(name={}, device={})", py_repr(py, &self.name(py)?), py_repr(py, &self.device(py)?)))
    }
}

/// The session of one runtime: position, context, rewinding.
#[pyclass(name = "Session", module = "candlewick._native", frozen)]
pub struct PySession {
    runtime: Py<PyModelRuntime>,
}

#[pymethods]
impl PySession {
    /// Tokens held in the KV cache.
    #[getter]
    fn position(&self, py: Python<'_>) -> PyResult<usize> {
        Ok(self.runtime.get().lock(py)?.runtime().session().position())
    }

    /// The most tokens the session may hold.
    #[getter]
    fn max_context(&self, py: Python<'_>) -> PyResult<usize> {
        Ok(self.runtime.get().lock(py)?.runtime().session().max_context())
    }

    /// The most tokens one step runs: a longer prompt runs in chunks of this many.
    #[getter]
    fn prefill_chunk(&self, py: Python<'_>) -> PyResult<usize> {
        Ok(self.runtime.get().lock(py)?.runtime().session().prefill_chunk())
    }

    /// Bytes held by the KV cache.
    #[getter]
    fn cache_bytes(&self, py: Python<'_>) -> PyResult<usize> {
        Ok(self.runtime.get().lock(py)?.runtime().session().cache_bytes())
    }

    /// Rewinds the cache to its first ``n`` tokens.
    ///
    /// Args:
    ///     n (int): how many tokens to keep (at most the position).
    ///
    /// Returns:
    ///     None
    ///
    /// Example:
    ///     >>> rt.session.truncate(4); rt.session.position
    ///     4
    fn truncate(&self, py: Python<'_>, n: &Bound<'_, PyAny>) -> PyResult<()> {
        let n = count_option(py, "n", Some(n))?.unwrap_or(0);
        self.runtime.get().lock(py)?.runtime_mut().session_mut().truncate(n).map_err(backend_err)
    }

    /// Copies the session's tokens and KV cache; ``restore`` puts them back exactly.
    ///
    /// Returns:
    ///     SessionSnapshot: the copy (``save()`` writes it to a file).
    ///
    /// Example:
    ///     >>> snap = rt.session.snapshot()
    fn snapshot(&self, py: Python<'_>) -> PyResult<PySessionSnapshot> {
        let rt = self.runtime.get();
        let snap =
            py.detach(|| catch_panic(|| rt.lock_detached()?.runtime().session().snapshot().map_err(backend_err)))?;
        Ok(PySessionSnapshot { inner: Arc::new(snap) })
    }

    /// Puts a snapshot's tokens and cache back; one of another model is an error that changes
    /// nothing.
    ///
    /// Args:
    ///     snapshot (SessionSnapshot): a snapshot of a runtime of the same model.
    ///
    /// Returns:
    ///     None
    ///
    /// Example:
    ///     >>> rt.session.restore(snap)
    fn restore(&self, py: Python<'_>, snapshot: PyRef<'_, PySessionSnapshot>) -> PyResult<()> {
        let (rt, snap) = (self.runtime.get(), Arc::clone(&snapshot.inner));
        py.detach(|| {
            catch_panic(|| rt.lock_detached()?.runtime_mut().session_mut().restore(&snap).map_err(backend_err))
        })
    }

    /// Empties the cache; after an internal error this also gives back a working session.
    ///
    /// Example:
    ///     >>> rt.session.reset(); rt.session.position
    ///     0
    fn reset(&self, py: Python<'_>) -> PyResult<()> {
        self.runtime.get().lock_and_recover(py)?.runtime_mut().session_mut().reset();
        Ok(())
    }

    fn __repr__(&self, py: Python<'_>) -> PyResult<String> {
        Ok(format!("Session(position={}, max_context={})", self.position(py)?, self.max_context(py)?))
    }
}

/// What the session was proven able to do.
#[pyclass(name = "SessionCapabilities", module = "candlewick._native", frozen, get_all, eq)]
#[derive(PartialEq)]
pub struct PySessionCapabilities {
    persistent_cache: bool,
    output_observation: bool,
    activation_inspection: bool,
    activation_intervention: bool,
}

#[pymethods]
impl PySessionCapabilities {
    fn __repr__(&self) -> String {
        let b = |v: bool| if v { "True" } else { "False" };
        format!(
            "SessionCapabilities(persistent_cache={}, output_observation={}, activation_inspection={}, \
             activation_intervention={})",
            b(self.persistent_cache),
            b(self.output_observation),
            b(self.activation_inspection),
            b(self.activation_intervention)
        )
    }
}

/// A step's output: logits, still owned by the runtime that produced it.
#[pyclass(name = "StepOutput", module = "candlewick._native", frozen)]
pub struct PyStepOutput {
    pub(crate) inner: StepOutput,
    runtime_id: u64,
}

#[pymethods]
impl PyStepOutput {
    /// Logits as float32 `[rows, vocab]`: one row per returned position.
    #[getter]
    fn logits<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyArray<f32, IxDyn>>> {
        let (shape, data) = py.detach(|| self.inner.logits_f32()).map_err(backend_err)?;
        let arr = ArrayD::from_shape_vec(IxDyn(&shape), data).map_err(|e| InternalError::new_err(e.to_string()))?;
        Ok(PyArray::from_owned_array(py, arr))
    }

    /// Position of the step's first token.
    #[getter]
    fn start_position(&self) -> usize {
        self.inner.start_position
    }

    /// Number of tokens the step appended.
    #[getter]
    fn num_tokens(&self) -> usize {
        self.inner.num_tokens
    }

    fn __repr__(&self) -> String {
        let dims = self.inner.logits.dims().iter().map(usize::to_string).collect::<Vec<_>>();
        let shape = if dims.len() == 1 { format!("({},)", dims[0]) } else { format!("({})", dims.join(", ")) };
        format!(
            "StepOutput(start_position={}, num_tokens={}, logits_shape={shape})",
            self.inner.start_position, self.inner.num_tokens
        )
    }
}

/// A submitted step: its output and its completion.
#[pyclass(name = "Submission", module = "candlewick._native", frozen)]
pub struct PySubmission {
    output: Py<PyStepOutput>,
    completion: Option<CandleCompletion>,
}

#[pymethods]
impl PySubmission {
    /// Whether the step's work has finished (without waiting).
    ///
    /// Returns:
    ///     bool: True once the output can be read.
    fn is_complete(&self) -> PyResult<bool> {
        match &self.completion {
            Some(c) => c.is_complete().map_err(backend_err),
            None => Ok(true),
        }
    }

    /// Waits for the step and returns its output.
    ///
    /// Returns:
    ///     StepOutput: the step's logits.
    ///
    /// Example:
    ///     >>> rt.prefill([2, 651]).wait().num_tokens
    ///     2
    fn wait(&self, py: Python<'_>) -> PyResult<Py<PyStepOutput>> {
        if let Some(c) = self.completion.clone() {
            py.detach(|| c.wait()).map_err(backend_err)?;
        }
        Ok(self.output.clone_ref(py))
    }

    /// The step's output (read it after `wait()` on asynchronous devices).
    #[getter]
    fn output(&self, py: Python<'_>) -> Py<PyStepOutput> {
        self.output.clone_ref(py)
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

/// `with rt.intervene([...]):` — the edits are on inside the block, the earlier ones after it.
#[pyclass(name = "InterventionScope", module = "candlewick._native", frozen)]
pub struct PyInterventionScope {
    runtime: Py<PyModelRuntime>,
    edits: Vec<candlewick::core::Intervention>,
    saved: Mutex<Option<Vec<candlewick::core::Intervention>>>,
}

#[pymethods]
impl PyInterventionScope {
    fn __enter__(slf: PyRef<'_, Self>) -> PyResult<PyRef<'_, Self>> {
        {
            let mut model = slf.runtime.get().lock(slf.py())?;
            let before = model.runtime().interventions();
            model.runtime_mut().set_interventions(slf.edits.clone()).map_err(runtime_err)?;
            *slf.saved.lock().map_err(|_| InternalError::new_err("intervention scope poisoned"))? = Some(before);
        }
        Ok(slf)
    }

    fn __exit__(
        &self,
        py: Python<'_>,
        _ty: Option<&Bound<'_, PyAny>>,
        _value: Option<&Bound<'_, PyAny>>,
        _tb: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<bool> {
        let saved = self.saved.lock().map_err(|_| InternalError::new_err("intervention scope poisoned"))?.take();
        if let Some(before) = saved {
            self.runtime.get().lock(py)?.runtime_mut().set_interventions(before).map_err(runtime_err)?;
        }
        Ok(false)
    }
}

/// A copy of a session's tokens and KV cache (`rt.session.snapshot()`), restorable onto any
/// runtime of the same model, and savable to a file.
#[pyclass(name = "SessionSnapshot", module = "candlewick._native", frozen)]
pub struct PySessionSnapshot {
    inner: Arc<SessionSnapshot>,
}

#[pymethods]
impl PySessionSnapshot {
    /// Writes the snapshot to a file (safetensors with a version, the model's fingerprint and
    /// a checksum; docs/snapshots.md).
    ///
    /// Args:
    ///     path (str | os.PathLike): the file to write.
    ///
    /// Returns:
    ///     None
    ///
    /// Example:
    ///     >>> rt.session.snapshot().save("s.cwsnap")
    fn save(&self, py: Python<'_>, path: PathBuf) -> PyResult<()> {
        py.detach(|| self.inner.save(&path)).map_err(backend_err)
    }

    /// Reads a snapshot written by ``save``; a damaged or truncated file is an ``ArtifactError``.
    ///
    /// Args:
    ///     path (str | os.PathLike): the file to read.
    ///
    /// Returns:
    ///     SessionSnapshot: restorable onto a runtime of the same model.
    ///
    /// Example:
    ///     >>> rt.session.restore(SessionSnapshot.load("s.cwsnap"))
    #[staticmethod]
    fn load(py: Python<'_>, path: PathBuf) -> PyResult<Self> {
        let snap =
            py.detach(|| catch_panic(|| SessionSnapshot::load(&path, &candle_core::Device::Cpu).map_err(backend_err)))?;
        Ok(Self { inner: Arc::new(snap) })
    }

    /// Tokens held.
    #[getter]
    fn position(&self) -> usize {
        self.inner.tokens().len()
    }

    /// The token ids held, oldest first.
    #[getter]
    fn tokens(&self) -> Vec<u32> {
        self.inner.tokens().to_vec()
    }

    /// The fingerprint of the model it was taken from.
    #[getter]
    fn fingerprint(&self) -> &str {
        self.inner.fingerprint()
    }

    fn __repr__(&self, py: Python<'_>) -> String {
        format!(
            "SessionSnapshot(position={}, fingerprint={})",
            self.inner.tokens().len(),
            py_repr(py, self.inner.fingerprint())
        )
    }
}
