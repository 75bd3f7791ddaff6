//! Text generation for Python: `generate`, `stream` and `chat`, with the GIL released and Ctrl-C honoured.

use std::sync::Mutex;

use pyo3::exceptions::PyStopIteration;
use pyo3::prelude::*;
use pyo3::types::PyDict;

use super::errors::{catch_panic, generation_err, model_err, GenerationOptionError, InternalError};
use super::runtime::PyModelRuntime;
use crate::generation::{GenerateOptions, Generation, GenerationResult};

fn value_err(arg: &str, why: &str) -> PyErr {
    pyo3::exceptions::PyValueError::new_err(format!("{arg}: {why}"))
}

fn type_err(arg: &str, want: &str, v: &Bound<'_, PyAny>) -> PyErr {
    let got = v.get_type().name().map(|n| n.to_string()).unwrap_or_default();
    pyo3::exceptions::PyTypeError::new_err(format!("{arg} must be {want}, not {got}"))
}

fn count(arg: &str, v: &Bound<'_, PyAny>) -> PyResult<usize> {
    let n: i64 = v.extract().map_err(|_| type_err(arg, "an int", v))?;
    usize::try_from(n).map_err(|_| value_err(arg, &format!("must be >= 0, got {n}")))
}

fn number(arg: &str, v: &Bound<'_, PyAny>) -> PyResult<f32> {
    v.extract::<f64>().map(|x| x as f32).map_err(|_| type_err(arg, "a number", v))
}

/// Builds the options of `generate` / `stream` / `chat` from keyword arguments over the model's
/// defaults; an unknown keyword is a TypeError, a value of the wrong kind or range names its argument.
pub fn options_from_kwargs(
    defaults: &GenerateOptions,
    kwargs: Option<&Bound<'_, PyDict>>,
) -> PyResult<GenerateOptions> {
    let mut o = defaults.clone();
    if let Some(kw) = kwargs {
        for (k, v) in kw.iter() {
            let key: String = k.extract()?;
            let s = &mut o.sampling;
            match key.as_str() {
                // None: until the context is full (as llama-cpp-python).
                "max_tokens" => o.max_tokens = if v.is_none() { usize::MAX } else { count("max_tokens", &v)? },
                "temperature" => s.temperature = number("temperature", &v)?,
                "top_k" => s.top_k = count("top_k", &v)?,
                "top_p" => s.top_p = number("top_p", &v)?,
                "min_p" => s.min_p = number("min_p", &v)?,
                "repetition_penalty" => s.repetition_penalty = number("repetition_penalty", &v)?,
                "presence_penalty" => s.presence_penalty = number("presence_penalty", &v)?,
                "frequency_penalty" => s.frequency_penalty = number("frequency_penalty", &v)?,
                // None or -1: a random seed.
                "seed" => {
                    s.seed = if v.is_none() {
                        None
                    } else {
                        let n: i64 = v.extract().map_err(|_| type_err("seed", "an int", &v))?;
                        match n {
                            -1 => None,
                            n if n >= 0 => Some(n as u64),
                            n => return Err(value_err("seed", &format!("must be >= 0 or -1 (random), got {n}"))),
                        }
                    }
                }
                "logit_bias" => {
                    s.logit_bias = Vec::new();
                    if !v.is_none() {
                        let d =
                            v.cast::<PyDict>().map_err(|_| type_err("logit_bias", "a dict {token_id: bias}", &v))?;
                        for (id, bias) in d.iter() {
                            let id: i64 =
                                id.extract().map_err(|_| type_err("logit_bias key", "an int token id", &id))?;
                            let id = u32::try_from(id)
                                .map_err(|_| value_err("logit_bias", &format!("{id} is not a token id")))?;
                            s.logit_bias.push((id, number("logit_bias value", &bias)?));
                        }
                    }
                }
                "stop" => {
                    o.stop = if v.is_none() {
                        Vec::new()
                    } else if let Ok(one) = v.extract::<String>() {
                        vec![one]
                    } else {
                        v.extract::<Vec<String>>().map_err(|_| type_err("stop", "a string or a list of strings", &v))?
                    }
                }
                "ignore_eos" => o.ignore_eos = v.extract().map_err(|_| type_err("ignore_eos", "a bool", &v))?,
                // None: off; N: the chosen token's log-probability and the N most likely.
                "logprobs" => {
                    o.logprobs = if v.is_none() {
                        None
                    } else if let Ok(b) = v.cast::<pyo3::types::PyBool>() {
                        b.is_true().then_some(0)
                    } else {
                        Some(count("logprobs", &v)?)
                    }
                }
                other => {
                    return Err(pyo3::exceptions::PyTypeError::new_err(format!(
                        "unexpected keyword argument `{other}`"
                    )))
                }
            }
        }
    }
    o.sampling.validate().map_err(GenerationOptionError::new_err)?;
    Ok(o)
}

/// The generation defaults every API uses (llama-cpp-python's), as a dict: the CLI shows these.
#[pyfunction]
pub fn generation_defaults(py: Python<'_>) -> PyResult<Bound<'_, PyDict>> {
    let o = GenerateOptions::default();
    let d = PyDict::new(py);
    d.set_item("max_tokens", o.max_tokens)?;
    d.set_item("temperature", o.sampling.temperature)?;
    d.set_item("top_k", o.sampling.top_k)?;
    d.set_item("top_p", o.sampling.top_p)?;
    d.set_item("min_p", o.sampling.min_p)?;
    d.set_item("repetition_penalty", o.sampling.repetition_penalty)?;
    d.set_item("presence_penalty", o.sampling.presence_penalty)?;
    d.set_item("frequency_penalty", o.sampling.frequency_penalty)?;
    Ok(d)
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
    /// With `logprobs=N`: per generated token a dict `{"token", "logprob", "top_logprobs": [(id, logprob)]}`.
    logprobs: Option<Vec<Py<PyDict>>>,
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
    let logprobs = r
        .logprobs
        .map(|steps| {
            steps
                .into_iter()
                .map(|t| {
                    let e = PyDict::new(py);
                    e.set_item("token", t.token)?;
                    e.set_item("logprob", t.logprob)?;
                    e.set_item("top_logprobs", t.top)?;
                    Ok(e.unbind())
                })
                .collect::<PyResult<Vec<_>>>()
        })
        .transpose()?;
    Ok(PyGenerationResult {
        text: r.text,
        token_ids: r.token_ids,
        finish_reason: r.finish_reason.as_str(),
        usage: d.unbind(),
        logprobs,
    })
}

/// Runs a whole generation in Rust; Ctrl-C raises KeyboardInterrupt within one step.
pub fn run_to_end(
    py: Python<'_>,
    rt: &PyModelRuntime,
    prompt: Vec<u32>,
    opts: GenerateOptions,
) -> PyResult<PyGenerationResult> {
    let mut pending: Option<PyErr> = None;
    let result = py.detach(|| {
        catch_panic(|| {
            let mut model = rt.lock()?;
            let generation = model.start_generation(&prompt, opts).map_err(model_err)?;
            let (result, _) = generation
                .run(
                    model.runtime_mut(),
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
        let generation = py.detach(|| catch_panic(|| rt.lock()?.start_generation(&prompt, opts).map_err(model_err)))?;
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
            let piece =
                py.detach(|| catch_panic(|| generation.step(rt.lock()?.runtime_mut()).map_err(generation_err)))?;
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
