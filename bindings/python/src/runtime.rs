//! `ModelRuntime` for Python: the class, its lock, and what is not another file's domain: loading
//! and closing, the model's description and tokenizer, and the step API (`prefill`, `decode`) with
//! its `StepOutput` and `Submission`. Arguments are converted here; every decision (formats,
//! tokenizers, defaults) is the model layer's.
//!
//! The class's other methods live with their domain, each file a `#[pymethods]` block of its own
//! (pyo3's `multiple-pymethods`): `session.rs` (`backend`, `session`, `capabilities`, `fork`),
//! `inspection.rs` (observations, `trace`, `unembed`), `steering.rs` (kept interventions, control
//! vectors), `generation.rs` (`generate`, `stream`, `chat`, `generate_batch`).

use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{LockResult, Mutex, MutexGuard};

use numpy::ndarray::{ArrayD, IxDyn};
use numpy::{PyArray, PyReadonlyArrayDyn};
use pyo3::prelude::*;
use pyo3::types::{PyAny, PyDict};

use super::convert::{count_option, extract_ids, prompt_of, py_repr};
use super::errors::{
    backend_err, catch_panic, invalid_option, model_err, runtime_err, InternalError, RuntimeClosedError,
};
use super::gil::lock_released;
use super::hub::resolve_model;
use super::intervention::{edits_of, PyIntervention};
use super::text::{conversation, PyTokenizer};
use candlewick::backend::session::CandleCompletion;
use candlewick::backend::StepOutput;
use candlewick::core::{
    BackendSession, Completion, DecodeInput, Intervention, ObservationRequest, ObservationSet, PrefillInput,
};
use candlewick::model::vision::{split_vision_edits, PixelValues};
use candlewick::model::{Model, ModelOptions};

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
    pub(crate) fn lock_and_recover(&self, py: Python<'_>) -> PyResult<ModelGuard<'_>> {
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
    pub(crate) fn wrap(model: Model) -> Self {
        Self { inner: Mutex::new(Some(model)), id: NEXT_RUNTIME_ID.fetch_add(1, Ordering::Relaxed) }
    }

    /// Token ids of a prompt given as text (encoded with special tokens) or as ids.
    pub(crate) fn prompt_ids(&self, py: Python<'_>, prompt: &Bound<'_, PyAny>) -> PyResult<Vec<u32>> {
        let prompt = prompt_of("prompt", prompt)?;
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
    ///     mmproj (str | os.PathLike | None): llama.cpp's mmproj GGUF (its vision encoder and
    ///         projector: Gemma 3's as ``convert_hf_to_gguf.py --mmproj`` writes it, LLaVA-1.5's as
    ///         ``convert_image_encoder_to_gguf.py`` does) beside a GGUF language model: the model
    ///         then takes images (docs/vision.md).
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
    #[pyo3(signature = (path, device="auto", dtype=None, max_context=None, threads=None, quantize=None, check_tensors=true, draft_model=None, kv_cache_type=None, prefill_chunk=None, filename=None, revision=None, mmproj=None))]
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
        mmproj: Option<PathBuf>,
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
            mmproj,
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
    ///         the kept ones (with images, also on the ``vision.*`` points).
    ///     images (list | None): a vision-language model's images (paths, bytes, data: URLs, PIL
    ///         images, HxWxC uint8 arrays), run through the model's processor; each placeholder
    ///         of ``tokens`` (text or ids) is expanded to the image's tokens (docs/vision.md).
    ///     pixel_values (numpy.ndarray | None): processed images ``[n, 3, S, S]`` as the model's
    ///         transformers processor returns them; ``tokens`` then hold the image tokens.
    ///
    /// Returns:
    ///     Submission: ``.wait()`` gives the ``StepOutput`` (logits ``[rows, vocab]``).
    ///
    /// Example:
    ///     >>> out = rt.prefill([2, 651, 6037]).wait()
    ///     >>> out.logits.shape
    ///     (1, 262144)
    #[pyo3(signature = (tokens, all_logits=false, interventions=None, *, images=None, pixel_values=None))]
    fn prefill(
        &self,
        py: Python<'_>,
        tokens: &Bound<'_, PyAny>,
        all_logits: bool,
        interventions: Option<Vec<PyRef<'_, PyIntervention>>>,
        images: Option<&Bound<'_, PyAny>>,
        pixel_values: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<PySubmission> {
        let call = self.image_call(py, tokens, images, pixel_values)?;
        let (vision_edits, edits) = call_edits(&call, edits_of(interventions));
        let ids = match &call {
            Some(c) => c.ids.clone(),
            None => extract_ids("tokens", tokens)?,
        };
        if let Some(c) = &call {
            self.stage(py, c, None, None, &vision_edits)?;
        }
        let input = PrefillInput::new(ids).all_logits(all_logits).with_interventions(edits);
        let sub = py.detach(|| catch_panic(|| self.lock_detached()?.runtime_mut().prefill(input).map_err(runtime_err)));
        if call.is_some() {
            self.unstage(py);
        }
        let sub = sub?;
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

    /// The model's tokenizer, with its chat template.
    #[getter]
    fn tokenizer(&self, py: Python<'_>) -> PyResult<PyTokenizer> {
        let model = self.lock(py)?;
        Ok(PyTokenizer {
            inner: model.tokenizer().map_err(model_err)?.clone(),
            template: model.chat_template().cloned(),
        })
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

/// A step's output: logits, still owned by the runtime that produced it.
#[pyclass(name = "StepOutput", module = "candlewick._native", frozen)]
pub struct PyStepOutput {
    pub(crate) inner: StepOutput,
    pub(crate) runtime_id: u64,
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

/// A call's images: the prompt's ids holding each image's tokens, and the pixel values to encode.
pub(crate) struct ImageCall {
    /// The ids, placeholders expanded.
    pub ids: Vec<u32>,
    /// Float32 `[images, 3, S, S]`.
    pub pixels: PixelValues,
}

/// A call's edits split into those on the vision points and the rest, when it has images; without
/// images every edit goes to the session (which refuses a vision point's as unknown there).
pub(crate) fn call_edits(call: &Option<ImageCall>, edits: Vec<Intervention>) -> (Vec<Intervention>, Vec<Intervention>) {
    match call {
        Some(_) => split_vision_edits(edits),
        None => (Vec::new(), edits),
    }
}

/// Pixel values from a numpy array (or anything `numpy.asarray` reads, a torch tensor included).
fn pixels_of(py: Python<'_>, v: &Bound<'_, PyAny>) -> PyResult<PixelValues> {
    let array = py.import("numpy")?.call_method1("ascontiguousarray", (v, "float32"))?;
    let array: PyReadonlyArrayDyn<'_, f32> = array.extract()?;
    let view = array.as_array();
    Ok(PixelValues { shape: view.shape().to_vec(), data: view.iter().copied().collect() })
}

impl PyModelRuntime {
    /// The model's processor files and tokenizer, as `candlewick.images._runtime` takes them;
    /// a text-only model is refused with the runtime's typed error.
    fn image_glue<'py>(&self, py: Python<'py>) -> PyResult<(Bound<'py, PyAny>, Bound<'py, PyAny>, PyTokenizer)> {
        let model = self.lock(py)?;
        model.vision().map_err(model_err)?;
        let files = model.processor_files().ok_or_else(|| {
            model_err(candlewick::model::ModelError::Backend(candlewick::backend::CandleError::InvalidInput {
                operation: "images",
                reason: "this model has no processor configuration: pass pixel_values= (as its processor returns them)"
                    .into(),
            }))
        })?;
        let files = (files.model_type.clone(), files.processor.clone(), files.config.clone()).into_pyobject(py)?;
        let tokenizer = PyTokenizer {
            inner: model.tokenizer().map_err(model_err)?.clone(),
            template: model.chat_template().cloned(),
        };
        Ok((py.import("candlewick.images._runtime")?.into_any(), files.into_any(), tokenizer))
    }

    /// `prompt`'s ids and pixel values when `images` (raw images, run through the model's
    /// processor and its placeholders expanded) or `pixel_values` (processed already; the ids
    /// hold the image tokens) is given; `None` when neither is.
    pub(crate) fn image_call(
        &self,
        py: Python<'_>,
        prompt: &Bound<'_, PyAny>,
        images: Option<&Bound<'_, PyAny>>,
        pixel_values: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<Option<ImageCall>> {
        let images = images.filter(|v| !v.is_none());
        let pixel_values = pixel_values.filter(|v| !v.is_none());
        match (images, pixel_values) {
            (None, None) => Ok(None),
            (Some(_), Some(_)) => {
                Err(invalid_option(py, "images and pixel_values: give one (raw images, or processed ones)".into()))
            }
            (None, Some(p)) => Ok(Some(ImageCall { ids: self.prompt_ids(py, prompt)?, pixels: pixels_of(py, p)? })),
            (Some(images), None) => {
                let (glue, files, tokenizer) = self.image_glue(py)?;
                let out = glue.call_method1("prepare", (files, tokenizer, prompt, images))?;
                let (expanded, pixels): (Bound<'_, PyAny>, Bound<'_, PyAny>) = out.extract()?;
                Ok(Some(ImageCall { ids: self.prompt_ids(py, &expanded)?, pixels: pixels_of(py, &pixels)? }))
            }
        }
    }

    /// Chat `messages` with image content parts as ids and pixel values (`None` without images);
    /// with `images`, the messages' bare `{"type": "image"}` parts stand for them, in order.
    pub(crate) fn chat_image_call(
        &self,
        py: Python<'_>,
        messages: &Bound<'_, PyAny>,
        template: Option<&str>,
        images: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<Option<ImageCall>> {
        let images = images.filter(|v| !v.is_none());
        if images.is_none() {
            let has = py.import("candlewick.images._runtime")?.call_method1("has_images", (messages,))?;
            if !has.is_truthy()? {
                return Ok(None);
            }
        }
        let (glue, files, tokenizer) = self.image_glue(py)?;
        let out = glue.call_method1("prepare_chat", (files, tokenizer, messages, template, images))?;
        let (ids, pixels): (Vec<u32>, Bound<'_, PyAny>) = out.extract()?;
        Ok(Some(ImageCall { ids, pixels: pixels_of(py, &pixels)? }))
    }

    /// Encodes and stages a call's images at `base` (`None`: the session's position), applying
    /// `edits` on the vision points and recording what `request` selects of them.
    pub(crate) fn stage(
        &self,
        py: Python<'_>,
        call: &ImageCall,
        base: Option<usize>,
        request: Option<&ObservationRequest>,
        edits: &[Intervention],
    ) -> PyResult<ObservationSet> {
        py.detach(|| {
            catch_panic(|| {
                let mut model = self.lock_detached()?;
                let base = base.unwrap_or_else(|| model.runtime().session().position());
                model.stage_images(&call.ids, base, &call.pixels, request, edits).map_err(model_err)
            })
        })
    }

    /// `stage` at position 0 without touching the session's cache: a trace runs on a scratch
    /// session, which takes the staged images along.
    pub(crate) fn stage_for_trace(
        &self,
        py: Python<'_>,
        call: &ImageCall,
        request: &ObservationRequest,
        edits: &[Intervention],
    ) -> PyResult<ObservationSet> {
        py.detach(|| {
            catch_panic(|| {
                let mut model = self.lock_detached()?;
                let vision = std::sync::Arc::clone(model.vision().map_err(model_err)?);
                let max = model.runtime().session().max_context();
                let (spans, set) = candlewick::model::vision::encode_images(
                    &vision,
                    max,
                    &call.ids,
                    0,
                    &call.pixels,
                    Some(request),
                    edits,
                )
                .map_err(model_err)?;
                model.runtime_mut().session_mut().stage_images(spans).map_err(backend_err)?;
                Ok(set)
            })
        })
    }

    /// Unstages the images of the call that ran.
    pub(crate) fn unstage(&self, py: Python<'_>) {
        if let Ok(mut model) = self.lock(py) {
            model.clear_images();
        }
    }
}
