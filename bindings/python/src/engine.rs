//! The engine for Python: `Engine` and the handles of its requests (the package's
//! `candlewick.Engine` adds iteration, `async for` and chat prompts on top).

use std::sync::Mutex;
use std::time::Duration;

use pyo3::prelude::*;
use pyo3::types::{PyAny, PyDict};

use super::convert::Given;
use super::errors::{catch_panic, engine_err, InternalError};
use super::gil::lock_released;
use super::intervention::{edits_of, PyIntervention};
use super::result::{logprobs_to_py, to_result};
use super::runtime::PyModelRuntime;
use super::sampling::SamplingArgs;
use candlewick::engine::{Engine, EngineError, EngineEvent, EngineOptions, RequestHandle};

const _: () = assert!(candlewick::engine::DEFAULT_PREFILL_CHUNK == 128, "update Engine's text_signature");
const _: () = assert!(candlewick::engine::DEFAULT_PREFIX_CACHE_BYTES == 268_435_456, "update Engine's text_signature");
const _: () =
    assert!(candlewick::engine::DEFAULT_PREFIX_CACHE_DISK_BYTES == 4_294_967_296, "update Engine's text_signature");

/// Many requests over one model, stepped together in a background thread.
#[pyclass(name = "Engine", module = "candlewick._native", frozen)]
pub struct PyEngine {
    inner: Mutex<Option<Engine>>,
    runtime: Py<PyModelRuntime>,
}

#[pymethods]
impl PyEngine {
    /// An engine over a runtime's weights (shared, not copied).
    ///
    /// Args:
    ///     runtime (ModelRuntime): the model to serve.
    ///     max_batch_size (int): the most requests decoded together.
    ///     max_queue (int): the most requests waiting; more raise ``QueueFullError``.
    ///     max_kv_bytes (int | None): stop admitting requests while their caches hold this much.
    ///     prefill_chunk (int | None): prompt tokens a joining request prefills per step while
    ///         others decode (so a long prompt does not stall their streams); None: whole.
    ///     prefix_cache_bytes (int): memory for the prefix cache, the keys and values of prompt
    ///         prefixes kept across requests (in 64-token blocks, least recently used evicted
    ///         first) so a request that starts like an earlier one skips that part; 0: none.
    ///     prefix_cache_dir (str | None): a directory the prefix cache also writes its blocks to
    ///         and reads them back from (checked: a damaged or foreign file is skipped), so a
    ///         later engine, a restarted server, reuses them.
    ///     prefix_cache_disk_bytes (int): the most bytes of block files in that directory; the
    ///         least recently used go first.
    ///
    /// Returns:
    ///     Engine: running in a background thread until ``close()``.
    ///
    /// Example:
    ///     >>> engine = candlewick._native.Engine(rt, max_batch_size=8)
    #[new]
    // The default is spelled out for the text signature (a constant's path would show as `...`);
    // the assertion below keeps the two equal.
    #[pyo3(signature = (runtime, max_batch_size=8, max_queue=64, max_kv_bytes=None,
        prefill_chunk=Some(candlewick::engine::DEFAULT_PREFILL_CHUNK),
        prefix_cache_bytes=candlewick::engine::DEFAULT_PREFIX_CACHE_BYTES, prefix_cache_dir=None,
        prefix_cache_disk_bytes=candlewick::engine::DEFAULT_PREFIX_CACHE_DISK_BYTES),
        text_signature = "(runtime, max_batch_size=8, max_queue=64, max_kv_bytes=None, prefill_chunk=128, prefix_cache_bytes=268435456, prefix_cache_dir=None, prefix_cache_disk_bytes=4294967296)")]
    #[allow(clippy::too_many_arguments)]
    fn new(
        py: Python<'_>,
        runtime: Py<PyModelRuntime>,
        max_batch_size: usize,
        max_queue: usize,
        max_kv_bytes: Option<usize>,
        prefill_chunk: Option<usize>,
        prefix_cache_bytes: usize,
        prefix_cache_dir: Option<std::path::PathBuf>,
        prefix_cache_disk_bytes: u64,
    ) -> PyResult<Self> {
        if max_batch_size == 0 || max_queue == 0 {
            return Err(pyo3::exceptions::PyValueError::new_err("max_batch_size and max_queue must be >= 1"));
        }
        let options = EngineOptions {
            max_batch_size,
            max_queue,
            max_kv_bytes,
            prefill_chunk,
            prefix_cache_bytes,
            prefix_cache_dir,
            prefix_cache_disk_bytes,
        };
        let rt = runtime.get();
        let engine = py.detach(|| catch_panic(|| Engine::new(&*rt.lock_detached()?, options).map_err(engine_err)))?;
        Ok(Self { inner: Mutex::new(Some(engine)), runtime })
    }

    #[doc = concat!(
        "submit($self, prompt, *, interventions=None, chat=False, chat_template=None, images=None, pixel_values=None, ",
        sampling_signature!(),
        ")\n--\n"
    )]
    /// Queues a request; a full queue raises ``QueueFullError`` at once.
    ///
    /// Args:
    ///     prompt (str | Sequence[int] | list[dict]): text, token ids, or (with ``chat``) messages.
    ///     interventions (Sequence[Intervention] | None): this request's own edits.
    ///     chat (bool): ``prompt`` is a conversation, rendered through the chat template.
    ///     chat_template (str | None): a Jinja template to use instead of the model's.
    ///     images (list | None): a vision-language model's images: with text, one per placeholder
    ///         (docs/vision.md); with ``chat``, one per bare ``{"type": "image"}`` part (messages'
    ///         own image parts need none). Encoded here, before the request is queued.
    ///     pixel_values (numpy.ndarray | None): processed images; the prompt holds their tokens.
    #[doc = sampling_args_doc!()]
    ///
    /// Returns:
    ///     EngineRequest: the request's events and a way to cancel it.
    ///
    /// Example:
    ///     >>> req = engine.submit("The capital of France is", max_tokens=16)
    #[pyo3(text_signature = None, signature = (prompt, *, interventions=None, chat=false, chat_template=None,
        images=None, pixel_values=None, max_tokens=Given::Omitted, temperature=None, top_k=None, top_p=None, min_p=None, repetition_penalty=None,
        presence_penalty=None, frequency_penalty=None, logit_bias=None, stop=None, seed=None, ignore_eos=false,
        logprobs=None, skip_special_tokens=true, response_format=None, grammar=None, grammar_format=None, regex=None,
        choice=None, prompt_lookup_num_tokens=None, num_draft_tokens=None, adapters=None))]
    #[allow(clippy::too_many_arguments)]
    fn submit<'py>(
        &self,
        py: Python<'py>,
        prompt: &Bound<'py, PyAny>,
        interventions: Option<Vec<PyRef<'py, PyIntervention>>>,
        chat: bool,
        chat_template: Option<&str>,
        images: Option<Bound<'py, PyAny>>,
        pixel_values: Option<Bound<'py, PyAny>>,
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
        grammar_format: Option<String>,
        regex: Option<String>,
        choice: Option<Vec<String>>,
        prompt_lookup_num_tokens: Option<Bound<'py, PyAny>>,
        num_draft_tokens: Option<Bound<'py, PyAny>>,
        adapters: Option<Bound<'py, PyAny>>,
    ) -> PyResult<PyEngineRequest> {
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
            grammar_format,
            regex,
            choice,
            prompt_lookup_num_tokens,
            num_draft_tokens,
            adapters,
        };
        let rt = self.runtime.get();
        let opts = args.options(rt.lock(py)?.defaults())?;
        let call = match (chat, pixel_values.as_ref().filter(|v| !v.is_none())) {
            (true, None) => rt.chat_image_call(py, prompt, chat_template, images.as_ref())?,
            _ => rt.image_call(py, prompt, images.as_ref(), pixel_values.as_ref())?,
        };
        let ids = match &call {
            Some(c) => c.ids.clone(),
            None if chat => rt.chat_ids(py, prompt, chat_template)?,
            None => rt.prompt_ids(py, prompt)?,
        };
        let edits = edits_of(interventions);
        let guard = lock_released(py, &self.inner).map_err(|_| InternalError::new_err("engine poisoned"))?;
        let engine = guard.as_ref().ok_or_else(|| engine_err(EngineError::Closed))?;
        let handle = match &call {
            // The images are encoded on this thread, with the GIL released.
            Some(c) => py.detach(|| engine.submit_with_images(ids, opts, edits, &c.pixels)).map_err(engine_err)?,
            None => engine.submit(ids, opts, edits).map_err(engine_err)?,
        };
        Ok(PyEngineRequest { handle })
    }

    /// Counters: submitted, finished, queued, running, generated_tokens, steps, prompt_tokens,
    /// cached_tokens (prompt tokens not computed again), prefix_hits (requests that reused
    /// some), prefix_cache_bytes (held now) and prefix_cache_evictions.
    ///
    /// Returns:
    ///     dict[str, int]: the counters, with ``max_batch_size`` and ``max_queue``.
    fn stats<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let guard = lock_released(py, &self.inner).map_err(|_| InternalError::new_err("engine poisoned"))?;
        let d = PyDict::new(py);
        if let Some(e) = guard.as_ref() {
            let s = e.stats();
            use std::sync::atomic::Ordering::Relaxed;
            d.set_item("submitted", s.submitted.load(Relaxed))?;
            d.set_item("finished", s.finished.load(Relaxed))?;
            d.set_item("queued", s.queued.load(Relaxed))?;
            d.set_item("running", s.running.load(Relaxed))?;
            d.set_item("generated_tokens", s.generated_tokens.load(Relaxed))?;
            d.set_item("steps", s.steps.load(Relaxed))?;
            d.set_item("prompt_tokens", s.prompt_tokens.load(Relaxed))?;
            d.set_item("cached_tokens", s.cached_tokens.load(Relaxed))?;
            d.set_item("prefix_hits", s.prefix_hits.load(Relaxed))?;
            d.set_item("prefix_cache_bytes", s.prefix_cache_bytes.load(Relaxed))?;
            d.set_item("prefix_cache_evictions", s.prefix_cache_evictions.load(Relaxed))?;
            d.set_item("prefix_disk_files", s.prefix_disk_files.load(Relaxed))?;
            d.set_item("prefix_disk_bytes", s.prefix_disk_bytes.load(Relaxed))?;
            d.set_item("prefix_disk_loaded", s.prefix_disk_loaded.load(Relaxed))?;
            d.set_item("prefix_disk_written", s.prefix_disk_written.load(Relaxed))?;
            d.set_item("prefix_disk_skipped", s.prefix_disk_skipped.load(Relaxed))?;
            d.set_item("prefix_disk_evictions", s.prefix_disk_evictions.load(Relaxed))?;
            d.set_item("max_batch_size", e.options().max_batch_size)?;
            d.set_item("max_queue", e.options().max_queue)?;
        }
        Ok(d)
    }

    /// Stops taking requests, ends the running ones and the background thread.
    fn close(&self, py: Python<'_>) -> PyResult<()> {
        let engine = lock_released(py, &self.inner).map_err(|_| InternalError::new_err("engine poisoned"))?.take();
        if let Some(mut e) = engine {
            py.detach(move || e.close());
        }
        Ok(())
    }
}

/// A request of an `Engine`: its events, and a way to cancel it.
#[pyclass(name = "EngineRequest", module = "candlewick._native", frozen)]
pub struct PyEngineRequest {
    handle: RequestHandle,
}

#[pymethods]
impl PyEngineRequest {
    /// The next event, waiting at most ``timeout`` seconds (GIL released); a failed request
    /// raises its error.
    ///
    /// Args:
    ///     timeout (float): seconds to wait.
    ///
    /// Returns:
    ///     tuple | None: ``("text", (str, logprobs))`` (logprobs: the piece's tokens' entries, or
    ///     None when not asked for), ``("done", GenerationResult)``, ``("cancelled", None)``, or
    ///     None when nothing came in time.
    ///
    /// Example:
    ///     >>> req.next_event(1.0)
    ///     ('text', (' Paris', None))
    #[pyo3(signature = (timeout=0.1))]
    fn next_event<'py>(&self, py: Python<'py>, timeout: f64) -> PyResult<Option<(&'static str, Bound<'py, PyAny>)>> {
        let wait = Duration::from_secs_f64(timeout.clamp(0.0, 3600.0));
        match py.detach(|| self.handle.next_event(wait)) {
            None => Ok(None),
            Some(EngineEvent::Text(t, logprobs)) => {
                let logprobs = logprobs.map(|l| logprobs_to_py(py, l)).transpose()?;
                Ok(Some(("text", (t, logprobs).into_pyobject(py)?.into_any())))
            }
            Some(EngineEvent::Done(r)) => Ok(Some(("done", Bound::new(py, to_result(py, r)?)?.into_any()))),
            Some(EngineEvent::Failed(e)) => Err(engine_err(e)),
            Some(EngineEvent::Cancelled) => Ok(Some(("cancelled", py.None().into_bound(py)))),
        }
    }

    /// Stops the request at the engine's next step and frees its slot.
    ///
    /// Example:
    ///     >>> req.cancel()
    fn cancel(&self) {
        self.handle.cancel();
    }
}
