//! `ModelRuntime` for Python, with its bound `backend` and `session` views and step outputs.

use std::path::Path;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

use numpy::ndarray::{ArrayD, IxDyn};
use numpy::PyArray;
use pyo3::prelude::*;
use pyo3::types::{PyAny, PyDict};

use super::errors::{
    backend_err, guard, load_err, runtime_err, text_err, InternalError, SessionError, TokenOutOfRangeError,
    TokenizerError,
};
use super::generation::{options_from_kwargs, run_to_end, PyGenerationStream};
use super::observation::{to_python, PyObservationRequest, PyObservationSet};
use super::text::PyTokenizer;
use crate::backend::session::CandleCompletion;
use crate::backend::{parse_dtype, CandleBackend, DecodeInput, LoadOptions, PrefillInput, StepOutput};
use crate::core::{BackendProvider, Completion, InspectedOutput, ModelRuntime, ObservationRequest};
use crate::text::Tokenizer;

/// The tokenizer that goes with an artifact: tokenizer.json beside a checkpoint, or the GGUF's vocabulary.
fn load_tokenizer(path: &Path) -> Result<Arc<Tokenizer>, String> {
    let loaded = if path.is_dir() { Tokenizer::from_hf_dir(path) } else { Tokenizer::from_gguf_file(path) };
    crate::memory::release_freed_memory();
    loaded.map(Arc::new).map_err(|e| format!("this model has no usable tokenizer: {e}"))
}

static NEXT_RUNTIME_ID: AtomicU64 = AtomicU64::new(1);

/// A loaded model, the backend that prepared it and its one session.
#[pyclass(name = "ModelRuntime", module = "candlewick._native", frozen)]
pub struct PyModelRuntime {
    pub(crate) inner: Mutex<ModelRuntime<CandleBackend>>,
    /// The model's tokenizer, or why it could not be built (the model stays usable on ids).
    pub(crate) tokenizer: Result<Arc<Tokenizer>, String>,
    pub(crate) id: u64,
    pub(crate) path: String,
    pub(crate) format: &'static str,
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

impl PyModelRuntime {
    /// The tokenizer, or a TokenizerError saying why there is none.
    pub(crate) fn tokenizer_arc(&self) -> PyResult<Arc<Tokenizer>> {
        self.tokenizer.clone().map_err(TokenizerError::new_err)
    }

    /// Token ids of a prompt given as text (encoded with special tokens) or as ids.
    fn prompt_ids(&self, py: Python<'_>, prompt: &Bound<'_, PyAny>) -> PyResult<Vec<u32>> {
        if let Ok(text) = prompt.extract::<String>() {
            let tok = self.tokenizer_arc()?;
            return py.detach(|| tok.encode(&text, true)).map_err(text_err);
        }
        token_ids(prompt.extract()?)
    }

    /// Token ids of a chat rendered through the model's template.
    fn chat_ids(&self, py: Python<'_>, messages: &Bound<'_, PyAny>, template: Option<&str>) -> PyResult<Vec<u32>> {
        let tok = PyTokenizer { inner: self.tokenizer_arc()? };
        let text = tok.render_chat(py, messages, true, None, template)?;
        // The template writes the special tokens itself, as transformers' apply_chat_template does.
        py.detach(|| tok.inner.encode(&text, false)).map_err(text_err)
    }

    /// Locks the runtime; a poisoned lock (a panic mid-step) is reported, not propagated.
    pub(crate) fn lock(&self) -> PyResult<MutexGuard<'_, ModelRuntime<CandleBackend>>> {
        self.inner.lock().map_err(|_| InternalError::new_err("the runtime was poisoned by an earlier internal error"))
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

#[pymethods]
impl PyModelRuntime {
    /// Loads a Hugging Face directory or GGUF file onto a device (GIL released while loading).
    #[staticmethod]
    #[pyo3(signature = (path, device="auto", dtype=None, max_context=None))]
    fn load(
        py: Python<'_>,
        path: PathBuf,
        device: &str,
        dtype: Option<&str>,
        max_context: Option<usize>,
    ) -> PyResult<Self> {
        let dtype = dtype.map(parse_dtype).transpose().map_err(backend_err)?;
        let device = device.to_owned();
        let options = LoadOptions { dtype, max_context };
        let p = path.clone();
        // The tokenizer first: its conversion's temporaries are freed (and handed back to the
        // OS) before the weights arrive, so the two never add up in the peak resident size.
        let tokenizer = py.detach(|| load_tokenizer(&path));
        let rt = py.detach(move || {
            guard(|| {
                let backend = CandleBackend::new(&device).map_err(backend_err)?;
                ModelRuntime::load(backend, &p, &options).map_err(load_err)
            })
        })?;
        let format = if path.is_dir() { "huggingface" } else { "gguf" };
        Ok(Self {
            inner: Mutex::new(rt),
            tokenizer,
            id: NEXT_RUNTIME_ID.fetch_add(1, Ordering::Relaxed),
            path: path.display().to_string(),
            format,
        })
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
    fn capabilities(&self) -> PyResult<PySessionCapabilities> {
        let c = self.lock()?.capabilities();
        Ok(PySessionCapabilities {
            persistent_cache: c.persistent_cache,
            output_observation: c.output_observation,
            activation_inspection: c.activation_inspection,
        })
    }

    /// Architecture, sizes, dtype and context of the loaded model.
    #[getter]
    fn model_info<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let rt = self.lock()?;
        let dec = rt.session().decoder();
        let c = dec.config();
        let d = PyDict::new(py);
        d.set_item("architecture", c.architecture.name())?;
        d.set_item("num_layers", c.num_layers())?;
        d.set_item("hidden_size", c.hidden_size)?;
        d.set_item("intermediate_size", c.intermediate_size)?;
        d.set_item("num_heads", c.num_heads)?;
        d.set_item("num_kv_heads", c.num_kv_heads)?;
        d.set_item("head_dim", c.head_dim)?;
        d.set_item("vocab_size", c.vocab_size)?;
        d.set_item("dtype", format!("{:?}", dec.dtype()).to_lowercase())?;
        d.set_item("context_length", c.max_position_embeddings)?;
        d.set_item("max_context", rt.session().max_context())?;
        d.set_item("sliding_window", c.layers.iter().find_map(|l| l.sliding_window))?;
        d.set_item("tie_word_embeddings", c.tie_word_embeddings)?;
        d.set_item("format", self.format)?;
        d.set_item("path", &self.path)?;
        d.set_item("device", rt.backend().descriptor().device.to_string())?;
        Ok(d)
    }

    /// Appends tokens at the current position; logits of the last one (or of all, on request).
    #[pyo3(signature = (tokens, all_logits=false))]
    fn prefill(&self, py: Python<'_>, tokens: Vec<i64>, all_logits: bool) -> PyResult<PySubmission> {
        let tokens = token_ids(tokens)?;
        let sub =
            py.detach(|| guard(|| self.lock()?.prefill(PrefillInput { tokens, all_logits }).map_err(runtime_err)))?;
        self.wrap_output(py, sub.output, Some(sub.completion))
    }

    /// Appends tokens and returns logits for each of them.
    fn decode(&self, py: Python<'_>, tokens: Vec<i64>) -> PyResult<PySubmission> {
        let tokens = token_ids(tokens)?;
        let sub = py.detach(|| guard(|| self.lock()?.decode(DecodeInput { tokens }).map_err(runtime_err)))?;
        self.wrap_output(py, sub.output, Some(sub.completion))
    }

    /// Brings an output of this runtime to the host: `model.logits`.
    fn observe_output(&self, py: Python<'_>, output: &Bound<'_, PyStepOutput>) -> PyResult<PyObservationSet> {
        let output = output.get();
        if output.runtime_id != self.id {
            return Err(SessionError::new_err("this output was produced by another runtime"));
        }
        let set = py.detach(|| guard(|| self.lock()?.observe_output(&output.inner).map_err(runtime_err)))?;
        to_python(py, set)
    }

    /// A prefill that also returns the requested observation points (default: all).
    #[pyo3(signature = (tokens, request=None, all_logits=false))]
    fn inspect_prefill(
        &self,
        py: Python<'_>,
        tokens: Vec<i64>,
        request: Option<PyRef<'_, PyObservationRequest>>,
        all_logits: bool,
    ) -> PyResult<PyInspectedOutput> {
        let tokens = token_ids(tokens)?;
        let req = request_of(request);
        let r = py.detach(|| {
            guard(|| self.lock()?.inspect_prefill(PrefillInput { tokens, all_logits }, &req).map_err(runtime_err))
        })?;
        self.inspected(py, r)
    }

    /// A decode that also returns the requested observation points (default: all).
    #[pyo3(signature = (tokens, request=None))]
    fn inspect_decode(
        &self,
        py: Python<'_>,
        tokens: Vec<i64>,
        request: Option<PyRef<'_, PyObservationRequest>>,
    ) -> PyResult<PyInspectedOutput> {
        let tokens = token_ids(tokens)?;
        let req = request_of(request);
        let r =
            py.detach(|| guard(|| self.lock()?.inspect_decode(DecodeInput { tokens }, &req).map_err(runtime_err)))?;
        self.inspected(py, r)
    }

    /// The model's tokenizer.
    #[getter]
    fn tokenizer(&self) -> PyResult<PyTokenizer> {
        Ok(PyTokenizer { inner: self.tokenizer_arc()? })
    }

    /// Generates from a prompt (text or ids); with `stream=True` returns an iterator of text pieces.
    #[pyo3(signature = (prompt, *, stream=false, **kwargs))]
    fn generate<'py>(
        slf: &Bound<'py, Self>,
        prompt: &Bound<'py, PyAny>,
        stream: bool,
        kwargs: Option<&Bound<'py, PyDict>>,
    ) -> PyResult<Bound<'py, PyAny>> {
        let py = slf.py();
        let opts = options_from_kwargs(kwargs)?;
        let ids = slf.get().prompt_ids(py, prompt)?;
        if stream {
            return Ok(Bound::new(py, PyGenerationStream::start(py, slf, ids, opts)?)?.into_any());
        }
        Ok(Bound::new(py, run_to_end(py, slf.get(), ids, opts)?)?.into_any())
    }

    /// Generates from a prompt, yielding text pieces as they become final.
    #[pyo3(signature = (prompt, **kwargs))]
    fn stream(
        slf: &Bound<'_, Self>,
        prompt: &Bound<'_, PyAny>,
        kwargs: Option<&Bound<'_, PyDict>>,
    ) -> PyResult<PyGenerationStream> {
        let py = slf.py();
        let opts = options_from_kwargs(kwargs)?;
        let ids = slf.get().prompt_ids(py, prompt)?;
        PyGenerationStream::start(py, slf, ids, opts)
    }

    /// Answers a conversation (a list of `{"role", "content"}` dicts) through the chat template
    /// (or `chat_template`, a Jinja source, for models that ship none).
    #[pyo3(signature = (messages, *, stream=false, chat_template=None, **kwargs))]
    fn chat<'py>(
        slf: &Bound<'py, Self>,
        messages: &Bound<'py, PyAny>,
        stream: bool,
        chat_template: Option<&str>,
        kwargs: Option<&Bound<'py, PyDict>>,
    ) -> PyResult<Bound<'py, PyAny>> {
        let py = slf.py();
        let opts = options_from_kwargs(kwargs)?;
        let ids = slf.get().chat_ids(py, messages, chat_template)?;
        if stream {
            return Ok(Bound::new(py, PyGenerationStream::start(py, slf, ids, opts)?)?.into_any());
        }
        Ok(Bound::new(py, run_to_end(py, slf.get(), ids, opts)?)?.into_any())
    }

    /// The token ids the session holds, oldest first.
    fn cached_tokens(&self) -> PyResult<Vec<u32>> {
        Ok(self.lock()?.session().tokens().to_vec())
    }

    /// Every observation path the loaded model offers.
    fn observation_points(&self) -> PyResult<Vec<String>> {
        Ok(self.lock()?.observation_points())
    }

    fn __repr__(&self) -> PyResult<String> {
        let rt = self.lock()?;
        let c = rt.session().decoder().config();
        Ok(format!(
            "ModelRuntime({} layers={} on {}, position {}/{})",
            c.architecture.name(),
            c.num_layers(),
            rt.backend().descriptor().device,
            rt.session().position(),
            rt.session().max_context()
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
    fn name(&self) -> PyResult<String> {
        Ok(self.runtime.get().lock()?.backend().descriptor().name)
    }

    /// The device the model runs on (`cpu`, `cuda:0`, ...).
    #[getter]
    fn device(&self) -> PyResult<String> {
        Ok(self.runtime.get().lock()?.backend().descriptor().device.to_string())
    }

    /// Every device this build can run on, with the dtypes each computes in.
    fn devices(&self) -> PyResult<Vec<(String, Vec<String>)>> {
        let devs = self.runtime.get().lock()?.backend().devices().map_err(backend_err)?;
        Ok(devs.into_iter().map(|(d, c)| (d.to_string(), c.dtypes)).collect())
    }

    fn __repr__(&self) -> PyResult<String> {
        Ok(format!("Backend({} on {})", self.name()?, self.device()?))
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
    fn position(&self) -> PyResult<usize> {
        Ok(self.runtime.get().lock()?.session().position())
    }

    /// The most tokens the session may hold.
    #[getter]
    fn max_context(&self) -> PyResult<usize> {
        Ok(self.runtime.get().lock()?.session().max_context())
    }

    /// Bytes held by the KV cache.
    #[getter]
    fn cache_bytes(&self) -> PyResult<usize> {
        Ok(self.runtime.get().lock()?.session().cache_bytes())
    }

    /// Rewinds the cache to its first `n` tokens.
    fn truncate(&self, n: usize) -> PyResult<()> {
        self.runtime.get().lock()?.session_mut().truncate(n).map_err(backend_err)
    }

    /// Empties the cache.
    fn reset(&self) -> PyResult<()> {
        self.runtime.get().lock()?.session_mut().reset();
        Ok(())
    }

    fn __repr__(&self) -> PyResult<String> {
        Ok(format!("Session(position={}, max_context={})", self.position()?, self.max_context()?))
    }
}

/// What the session was proven able to do.
#[pyclass(name = "SessionCapabilities", module = "candlewick._native", frozen, get_all, eq)]
#[derive(PartialEq)]
pub struct PySessionCapabilities {
    persistent_cache: bool,
    output_observation: bool,
    activation_inspection: bool,
}

#[pymethods]
impl PySessionCapabilities {
    fn __repr__(&self) -> String {
        format!(
            "SessionCapabilities(persistent_cache={}, output_observation={}, activation_inspection={})",
            self.persistent_cache, self.output_observation, self.activation_inspection
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
        self.inner.tokens
    }

    fn __repr__(&self) -> String {
        format!(
            "StepOutput(start_position={}, num_tokens={}, logits={:?})",
            self.inner.start_position,
            self.inner.tokens,
            self.inner.logits.dims()
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
    /// Whether the step's work has finished.
    fn is_complete(&self) -> PyResult<bool> {
        match &self.completion {
            Some(c) => c.is_complete().map_err(backend_err),
            None => Ok(true),
        }
    }

    /// Waits for the step and returns its output.
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
