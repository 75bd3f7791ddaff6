//! Text generation for Python: `generate`, `stream` and `chat`, with the GIL released and Ctrl-C honoured.

use std::sync::Mutex;

use pyo3::exceptions::PyStopIteration;
use pyo3::prelude::*;
use pyo3::types::PyDict;

use super::errors::{guard, runtime_err, text_err, InternalError, SessionError};
use super::runtime::PyModelRuntime;
use crate::generation::{GenerateOptions, Generation, GenerationError, GenerationResult, SamplingParams};

/// Maps a generation error onto the exception hierarchy.
pub fn generation_err(e: GenerationError) -> PyErr {
    match e {
        GenerationError::Runtime(e) => runtime_err(e),
        GenerationError::Text(e) => text_err(e),
        GenerationError::InvalidOptions(m) => SessionError::new_err(m),
    }
}

/// Builds the options from the keyword arguments of `generate` / `stream` / `chat`,
/// with llama-cpp-python's defaults; an unknown keyword is a TypeError.
pub fn options_from_kwargs(kwargs: Option<&Bound<'_, PyDict>>) -> PyResult<GenerateOptions> {
    let mut o = GenerateOptions {
        max_tokens: 256,
        sampling: SamplingParams { temperature: 0.8, top_k: 40, top_p: 0.95, min_p: 0.05, ..SamplingParams::default() },
        ..GenerateOptions::default()
    };
    if let Some(kw) = kwargs {
        for (k, v) in kw.iter() {
            let key: String = k.extract()?;
            let s = &mut o.sampling;
            match key.as_str() {
                "max_tokens" => o.max_tokens = v.extract()?,
                "temperature" => s.temperature = v.extract()?,
                "top_k" => s.top_k = v.extract()?,
                "top_p" => s.top_p = v.extract()?,
                "min_p" => s.min_p = v.extract()?,
                "repetition_penalty" => s.repetition_penalty = v.extract()?,
                "presence_penalty" => s.presence_penalty = v.extract()?,
                "frequency_penalty" => s.frequency_penalty = v.extract()?,
                "seed" => s.seed = v.extract()?,
                "logit_bias" => {
                    let m: Option<std::collections::HashMap<u32, f32>> = v.extract()?;
                    s.logit_bias = m.map(|m| m.into_iter().collect()).unwrap_or_default();
                }
                "stop" => {
                    o.stop = if let Ok(one) = v.extract::<String>() {
                        vec![one]
                    } else {
                        v.extract::<Option<Vec<String>>>()?.unwrap_or_default()
                    }
                }
                "ignore_eos" => o.ignore_eos = v.extract()?,
                other => {
                    return Err(pyo3::exceptions::PyTypeError::new_err(format!(
                        "unexpected keyword argument `{other}`"
                    )))
                }
            }
        }
    }
    o.sampling.validate().map_err(SessionError::new_err)?;
    Ok(o)
}

/// A finished generation: text, ids, why it ended and what it cost.
#[pyclass(name = "GenerationResult", module = "candlewick._native", frozen, get_all)]
pub struct PyGenerationResult {
    /// The generated text (cut before any stop string).
    text: String,
    /// The generated token ids.
    token_ids: Vec<u32>,
    /// `stop`, `length` or `eos`.
    finish_reason: &'static str,
    /// Token counts and timings.
    usage: Py<PyDict>,
}

#[pymethods]
impl PyGenerationResult {
    fn __repr__(&self) -> String {
        format!(
            "GenerationResult(finish_reason={:?}, tokens={}, text={:?})",
            self.finish_reason,
            self.token_ids.len(),
            self.text
        )
    }
}

/// Converts a Rust result into its Python form.
pub fn to_result(py: Python<'_>, r: GenerationResult) -> PyResult<PyGenerationResult> {
    let u = r.usage;
    let d = PyDict::new(py);
    d.set_item("prompt_tokens", u.prompt_tokens)?;
    d.set_item("cached_tokens", u.cached_tokens)?;
    d.set_item("completion_tokens", u.completion_tokens)?;
    d.set_item("total_tokens", u.prompt_tokens + u.completion_tokens)?;
    d.set_item("time_to_first_token", u.time_to_first_token)?;
    d.set_item("prefill_seconds", u.prefill_seconds)?;
    d.set_item("decode_seconds", u.decode_seconds)?;
    d.set_item("prefill_tokens_per_second", u.prefill_tokens_per_second())?;
    d.set_item("decode_tokens_per_second", u.decode_tokens_per_second())?;
    Ok(PyGenerationResult {
        text: r.text,
        token_ids: r.token_ids,
        finish_reason: r.finish_reason.as_str(),
        usage: d.unbind(),
    })
}

/// Runs a whole generation in Rust; Ctrl-C raises KeyboardInterrupt within one step.
pub fn run_to_end(
    py: Python<'_>,
    rt: &PyModelRuntime,
    prompt: Vec<u32>,
    opts: GenerateOptions,
) -> PyResult<PyGenerationResult> {
    let tokenizer = rt.tokenizer_arc()?;
    let mut pending: Option<PyErr> = None;
    let result = py.detach(|| {
        guard(|| {
            let mut inner = rt.lock()?;
            let generation = Generation::start(&mut inner, tokenizer, &prompt, opts).map_err(generation_err)?;
            let (result, _) = generation
                .run(
                    &mut inner,
                    |_| {},
                    || {
                        // Signals are only delivered with the GIL held: take it briefly between steps.
                        match Python::attach(|py| py.check_signals()) {
                            Ok(()) => false,
                            Err(e) => {
                                pending = Some(e);
                                true
                            }
                        }
                    },
                )
                .map_err(generation_err)?;
            Ok(result)
        })
    })?;
    if let Some(e) = pending {
        return Err(e);
    }
    to_result(py, result)
}

/// An iterator of text pieces; `result` holds the whole generation once it is exhausted.
#[pyclass(name = "GenerationStream", module = "candlewick._native", frozen)]
pub struct PyGenerationStream {
    runtime: Py<PyModelRuntime>,
    state: Mutex<Option<Generation>>,
    result: Mutex<Option<Py<PyGenerationResult>>>,
}

impl PyGenerationStream {
    /// Starts a generation (prefilling the prompt) whose tokens are produced on iteration.
    pub fn start(
        py: Python<'_>,
        runtime: &Bound<'_, PyModelRuntime>,
        prompt: Vec<u32>,
        opts: GenerateOptions,
    ) -> PyResult<Self> {
        let rt = runtime.get();
        let tokenizer = rt.tokenizer_arc()?;
        let generation = py.detach(|| {
            guard(|| {
                let mut inner = rt.lock()?;
                Generation::start(&mut inner, tokenizer, &prompt, opts).map_err(generation_err)
            })
        })?;
        Ok(Self { runtime: runtime.clone().unbind(), state: Mutex::new(Some(generation)), result: Mutex::new(None) })
    }
}

#[pymethods]
impl PyGenerationStream {
    fn __iter__(slf: PyRef<'_, Self>) -> PyRef<'_, Self> {
        slf
    }

    fn __next__(&self, py: Python<'_>) -> PyResult<String> {
        let mut state = self.state.lock().map_err(|_| InternalError::new_err("generation stream poisoned"))?;
        let Some(generation) = state.as_mut() else {
            return Err(PyStopIteration::new_err(()));
        };
        let rt = self.runtime.get();
        loop {
            if generation.finish_reason().is_some() {
                let result = to_result(py, generation.result())?;
                *self.result.lock().map_err(|_| InternalError::new_err("generation stream poisoned"))? =
                    Some(Py::new(py, result)?);
                *state = None;
                return Err(PyStopIteration::new_err(()));
            }
            let piece = py.detach(|| guard(|| generation.step(&mut *rt.lock()?).map_err(generation_err)))?;
            if !piece.is_empty() {
                return Ok(piece);
            }
            py.check_signals()?;
        }
    }

    /// The finished generation (None until the stream is exhausted).
    #[getter]
    fn result(&self, py: Python<'_>) -> PyResult<Option<Py<PyGenerationResult>>> {
        Ok(self
            .result
            .lock()
            .map_err(|_| InternalError::new_err("generation stream poisoned"))?
            .as_ref()
            .map(|r| r.clone_ref(py)))
    }
}
