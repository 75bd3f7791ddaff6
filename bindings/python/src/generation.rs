//! Text generation for Python: `generate`, `stream` and `chat`, with the GIL released and Ctrl-C honoured.

use std::sync::Mutex;

use pyo3::exceptions::PyStopIteration;
use pyo3::prelude::*;
use pyo3::types::PyDict;

use super::errors::{catch_panic, generation_err, invalid_option, model_err, GenerationOptionError, InternalError};
use super::gil::lock_released;
use super::runtime::PyModelRuntime;
use candlewick::generation::{ConstraintSpec, GenerateOptions, Generation, GenerationResult, TokenLogprobs};

/// An `InvalidOptionError` (a `ValueError` too) naming the argument.
fn value_err(arg: &str, why: &str) -> PyErr {
    Python::attach(|py| invalid_option(py, format!("{arg}: {why}")))
}

fn type_err(arg: &str, want: &str, v: &Bound<'_, PyAny>) -> PyErr {
    let got = v.get_type().name().map(|n| n.to_string()).unwrap_or_default();
    pyo3::exceptions::PyTypeError::new_err(format!("{arg} must be {want}, not {got}"))
}

fn count(arg: &str, v: &Bound<'_, PyAny>) -> PyResult<usize> {
    let n: i64 = v.extract().map_err(|_| int_err(arg, v))?;
    usize::try_from(n).map_err(|_| value_err(arg, &format!("must be >= 0, got {n}")))
}

/// The error for a value that is not an int of 64 bits: out of range if it is an int at all.
fn int_err(arg: &str, v: &Bound<'_, PyAny>) -> PyErr {
    if v.is_instance_of::<pyo3::types::PyInt>() {
        value_err(arg, &format!("{v} is out of range"))
    } else {
        type_err(arg, "an int", v)
    }
}

fn number(arg: &str, v: &Bound<'_, PyAny>) -> PyResult<f32> {
    v.extract::<f64>().map(|x| x as f32).map_err(|_| type_err(arg, "a number", v))
}

/// A keyword argument as given, told apart from one left out: `max_tokens=None` means "until
/// the context is full", while leaving it out means the model's default.
pub enum Given<'py> {
    /// Not passed.
    Omitted,
    /// Passed (possibly `None`).
    Value(Bound<'py, PyAny>),
}

impl<'a, 'py> FromPyObject<'a, 'py> for Given<'py> {
    type Error = PyErr;

    fn extract(obj: Borrowed<'a, 'py, PyAny>) -> PyResult<Self> {
        Ok(Given::Value(obj.to_owned()))
    }
}

/// The sampling keywords `generate`, `stream`, `chat`, `generate_batch` and `Engine.submit`
/// share, as Python passed them; `None` (or left out) keeps the model's default.
pub struct SamplingArgs<'py> {
    /// The most tokens; `None`: until the context is full.
    pub max_tokens: Given<'py>,
    /// Softmax temperature; 0 is greedy.
    pub temperature: Option<Bound<'py, PyAny>>,
    /// Keep the k most likely tokens (0: all).
    pub top_k: Option<Bound<'py, PyAny>>,
    /// Nucleus sampling mass.
    pub top_p: Option<Bound<'py, PyAny>>,
    /// Drop tokens below this fraction of the most likely one's probability.
    pub min_p: Option<Bound<'py, PyAny>>,
    /// llama.cpp's repeat penalty.
    pub repetition_penalty: Option<Bound<'py, PyAny>>,
    /// OpenAI's presence penalty.
    pub presence_penalty: Option<Bound<'py, PyAny>>,
    /// OpenAI's frequency penalty.
    pub frequency_penalty: Option<Bound<'py, PyAny>>,
    /// `{token_id: bias}` added to the logits.
    pub logit_bias: Option<Bound<'py, PyAny>>,
    /// A string or strings that end generation.
    pub stop: Option<Bound<'py, PyAny>>,
    /// A seed; `None` or -1: random.
    pub seed: Option<Bound<'py, PyAny>>,
    /// Keep going past end-of-sequence tokens.
    pub ignore_eos: bool,
    /// `N`: each token's log-probability and the N most likely alternatives.
    pub logprobs: Option<Bound<'py, PyAny>>,
    /// Leave control tokens out of the generated text.
    pub skip_special_tokens: bool,
    /// OpenAI's `response_format` dict.
    pub response_format: Option<Bound<'py, PyAny>>,
    /// A Lark grammar.
    pub grammar: Option<String>,
    /// A regular expression.
    pub regex: Option<String>,
    /// Strings, one of which is the output.
    pub choice: Option<Vec<String>>,
    /// Draft tokens per step from prompt lookup (n-gram speculation); `None` or 0: off.
    pub prompt_lookup_num_tokens: Option<Bound<'py, PyAny>>,
    /// Tokens the draft model proposes per step; `None`: the default; 0: off.
    pub num_draft_tokens: Option<Bound<'py, PyAny>>,
}

impl SamplingArgs<'_> {
    /// The options these arguments ask for, over the model's `defaults`; a value of the wrong
    /// kind or range names its argument.
    pub fn options(&self, defaults: &GenerateOptions) -> PyResult<GenerateOptions> {
        let mut o = defaults.clone();
        match &self.max_tokens {
            Given::Omitted => {}
            // As in llama-cpp-python: until the context is full.
            Given::Value(v) if v.is_none() => o.max_tokens = usize::MAX,
            Given::Value(v) => o.max_tokens = count("max_tokens", v)?,
        }
        let s = &mut o.sampling;
        let set = |slot: &mut f32, name: &str, v: &Option<Bound<'_, PyAny>>| -> PyResult<()> {
            if let Some(v) = v.as_ref().filter(|v| !v.is_none()) {
                *slot = number(name, v)?;
            }
            Ok(())
        };
        set(&mut s.temperature, "temperature", &self.temperature)?;
        set(&mut s.top_p, "top_p", &self.top_p)?;
        set(&mut s.min_p, "min_p", &self.min_p)?;
        set(&mut s.repetition_penalty, "repetition_penalty", &self.repetition_penalty)?;
        set(&mut s.presence_penalty, "presence_penalty", &self.presence_penalty)?;
        set(&mut s.frequency_penalty, "frequency_penalty", &self.frequency_penalty)?;
        if let Some(v) = self.top_k.as_ref().filter(|v| !v.is_none()) {
            s.top_k = count("top_k", v)?;
        }
        if let Some(v) = self.seed.as_ref().filter(|v| !v.is_none()) {
            let n: i64 = v.extract().map_err(|_| int_err("seed", v))?;
            s.seed = match n {
                -1 => None,
                n if n >= 0 => Some(n as u64),
                n => return Err(value_err("seed", &format!("must be >= 0 or -1 (random), got {n}"))),
            };
        }
        if let Some(v) = self.logit_bias.as_ref().filter(|v| !v.is_none()) {
            let d = v.cast::<PyDict>().map_err(|_| type_err("logit_bias", "a dict {token_id: bias}", v))?;
            s.logit_bias = Vec::new();
            for (id, bias) in d.iter() {
                let id: i64 = id.extract().map_err(|_| int_err("logit_bias key", &id))?;
                let id = u32::try_from(id).map_err(|_| value_err("logit_bias", &format!("{id} is not a token id")))?;
                s.logit_bias.push((id, number("logit_bias value", &bias)?));
            }
        }
        if let Some(v) = self.stop.as_ref().filter(|v| !v.is_none()) {
            o.stop = if let Ok(one) = v.extract::<String>() {
                vec![one]
            } else {
                v.extract::<Vec<String>>().map_err(|_| type_err("stop", "a string or a list of strings", v))?
            };
        }
        o.ignore_eos = o.ignore_eos || self.ignore_eos;
        if let Some(v) = self.logprobs.as_ref().filter(|v| !v.is_none()) {
            o.logprobs = if let Ok(b) = v.cast::<pyo3::types::PyBool>() {
                b.is_true().then_some(0)
            } else {
                Some(count("logprobs", v)?)
            };
        }
        o.skip_special_tokens = self.skip_special_tokens;
        o.constraint = self.constraint()?;
        if let Some(v) = self.prompt_lookup_num_tokens.as_ref().filter(|v| !v.is_none()) {
            o.prompt_lookup = count("prompt_lookup_num_tokens", v)?;
        }
        if let Some(v) = self.num_draft_tokens.as_ref().filter(|v| !v.is_none()) {
            o.draft_tokens = Some(count("num_draft_tokens", v)?);
        }
        o.sampling.validate().map_err(GenerationOptionError::new_err)?;
        Ok(o)
    }
}

impl SamplingArgs<'_> {
    /// The one output constraint these arguments ask for, if any.
    fn constraint(&self) -> PyResult<Option<ConstraintSpec>> {
        let format = match &self.response_format {
            Some(v) if !v.is_none() => response_format(v)?,
            _ => None,
        };
        let given: Vec<(&str, ConstraintSpec)> = [
            ("response_format", format),
            ("grammar", self.grammar.clone().map(ConstraintSpec::Lark)),
            ("regex", self.regex.clone().map(ConstraintSpec::Regex)),
            ("choice", self.choice.clone().map(ConstraintSpec::Choice)),
        ]
        .into_iter()
        .filter_map(|(name, spec)| spec.map(|s| (name, s)))
        .collect();
        match given.len() {
            0 => Ok(None),
            1 => Ok(given.into_iter().next().map(|(_, s)| s)),
            _ => {
                let names: Vec<&str> = given.iter().map(|(n, _)| *n).collect();
                Err(GenerationOptionError::new_err(format!(
                    "give one output constraint at most, not {}",
                    names.join(" and ")
                )))
            }
        }
    }
}

/// OpenAI's `response_format`: `{"type": "text"}` (none), `{"type": "json_object"}` (llama.cpp's
/// server also takes a `schema` there), `{"type": "json_schema", "json_schema": {"name", "schema",
/// "strict"}}`.
pub fn response_format(v: &Bound<'_, PyAny>) -> PyResult<Option<ConstraintSpec>> {
    let text: String = v.py().import("json")?.call_method1("dumps", (v,))?.extract()?;
    let value: serde_json::Value =
        serde_json::from_str(&text).map_err(|e| value_err("response_format", &e.to_string()))?;
    let bad = |why: &str| Err(GenerationOptionError::new_err(format!("response_format: {why}")));
    let Some(kind) = value.get("type").and_then(|t| t.as_str()) else {
        return bad("a dict with a \"type\" (\"text\", \"json_object\" or \"json_schema\")");
    };
    match kind {
        "text" => Ok(None),
        "json_object" => Ok(Some(match value.get("schema") {
            Some(schema) if !schema.is_null() => ConstraintSpec::JsonSchema(schema.clone()),
            _ => ConstraintSpec::JsonObject,
        })),
        "json_schema" => match value.get("json_schema").and_then(|j| j.get("schema")) {
            Some(schema) if schema.is_object() || schema.is_boolean() => {
                Ok(Some(ConstraintSpec::JsonSchema(schema.clone())))
            }
            _ => bad("\"json_schema\" needs {\"name\", \"schema\"} with the schema an object"),
        },
        other => bad(&format!("unknown type {other:?} (\"text\", \"json_object\" or \"json_schema\")")),
    }
}

/// The generation defaults every API uses where a caller passes none (llama-cpp-python's), as
/// a dict; the CLI shows these.
///
/// Returns:
///     dict: ``max_tokens``, ``temperature``, ``top_k``, ``top_p``, ``min_p``,
///     ``repetition_penalty``, ``presence_penalty`` and ``frequency_penalty``.
///
/// Example:
///     >>> candlewick._native.generation_defaults()["max_tokens"]
///     256
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

/// Python's `repr` of a string, so reprs read as Python, not Rust.
pub fn py_repr(py: Python<'_>, s: &str) -> String {
    pyo3::types::PyString::new(py, s).repr().map(|r| r.to_string()).unwrap_or_else(|_| format!("{s:?}"))
}

/// A finished generation: text, ids, why it ended and what it cost.
#[pyclass(name = "GenerationResult", module = "candlewick._native", frozen, get_all)]
pub struct PyGenerationResult {
    /// The generated text (cut before any stop string).
    text: String,
    /// The generated token ids.
    token_ids: Vec<u32>,
    /// `stop`, `length`, `eos`, `tool_calls` (with tools), or `cancelled` for a stream closed early.
    finish_reason: &'static str,
    /// Token counts and timings.
    usage: Py<PyDict>,
    /// With `logprobs=N`: per generated token a dict `{"token", "logprob", "top_logprobs": [(id, logprob)]}`.
    logprobs: Option<Vec<Py<PyDict>>>,
    /// With `chat(..., tools=...)`: the calls the model made, as OpenAI's `tool_calls`
    /// entries; None otherwise (and `text` holds the text outside them).
    tool_calls: Option<Vec<Py<PyDict>>>,
}

#[pymethods]
impl PyGenerationResult {
    fn __repr__(&self, py: Python<'_>) -> String {
        format!(
            "GenerationResult(finish_reason={}, tokens={}, text={})",
            py_repr(py, self.finish_reason),
            self.token_ids.len(),
            py_repr(py, &self.text)
        )
    }
}

/// Per-token log-probabilities as Python dicts: `{"token", "logprob", "top_logprobs": [(id, logprob)]}`.
pub fn logprobs_to_py(py: Python<'_>, steps: Vec<TokenLogprobs>) -> PyResult<Vec<Py<PyDict>>> {
    steps
        .into_iter()
        .map(|t| {
            let e = PyDict::new(py);
            e.set_item("token", t.token)?;
            e.set_item("logprob", t.logprob)?;
            e.set_item("top_logprobs", t.top)?;
            Ok(e.unbind())
        })
        .collect()
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
    if u.constraint_compile_seconds > 0.0 || u.constraint_seconds_p50 > 0.0 {
        d.set_item("constraint_compile_seconds", u.constraint_compile_seconds)?;
        d.set_item("constraint_seconds_p50", u.constraint_seconds_p50)?;
        d.set_item("constraint_seconds_p99", u.constraint_seconds_p99)?;
        d.set_item("constraint_masks", u.constraint_masks)?;
    }
    if u.draft_tokens > 0 {
        d.set_item("draft_tokens", u.draft_tokens)?;
        d.set_item("accepted_draft_tokens", u.accepted_draft_tokens)?;
    }
    let logprobs = r.logprobs.map(|steps| logprobs_to_py(py, steps)).transpose()?;
    Ok(PyGenerationResult {
        text: r.text,
        token_ids: r.token_ids,
        finish_reason: r.finish_reason.as_str(),
        usage: d.unbind(),
        logprobs,
        tool_calls: None,
    })
}

impl PyGenerationResult {
    /// This result with the model's tool calls split out of its text (when it made any).
    pub fn with_tool_calls(mut self, text: String, calls: Vec<Py<PyDict>>) -> Self {
        if !calls.is_empty() {
            self.text = text;
            self.finish_reason = "tool_calls";
            self.tool_calls = Some(calls);
        } else {
            self.tool_calls = Some(Vec::new());
        }
        self
    }

    /// The generated token ids.
    pub fn ids(&self) -> &[u32] {
        &self.token_ids
    }
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
            let mut model = rt.lock_detached()?;
            let generation = model.start_generation(&prompt, opts).map_err(model_err)?;
            let (result, _) = model
                .run_generation(
                    generation,
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

/// An iterator of text pieces, each final (never a broken character or a stop string's start).
///
/// ``result`` holds the whole generation (text, finish reason, usage) once the stream ends, or
/// once ``close()`` stops it early; ``logprobs`` holds the log-probabilities of the tokens
/// behind the piece last yielded when ``logprobs=N`` was asked for. A stream is a context
/// manager that closes itself.
///
/// Example:
///     >>> with rt.stream("The capital of France is", max_tokens=8, logprobs=2) as s:
///     ...     for piece in s:
///     ...         print(piece, s.logprobs)
///     >>> s.result.finish_reason
///     'length'
#[pyclass(name = "GenerationStream", module = "candlewick._native", frozen)]
pub struct PyGenerationStream {
    runtime: Py<PyModelRuntime>,
    state: Mutex<Option<Generation>>,
    result: Mutex<Option<Py<PyGenerationResult>>>,
    logprobs: Mutex<Option<Vec<Py<PyDict>>>>,
    /// With `chat(..., tools=...)`: the format whose calls `result` parses out of the text.
    tool_format: Option<candlewick::text::ToolCallFormat>,
}

fn poisoned<T>(_: T) -> PyErr {
    InternalError::new_err("generation stream poisoned")
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
        let generation =
            py.detach(|| catch_panic(|| rt.lock_detached()?.start_generation(&prompt, opts).map_err(model_err)))?;
        Ok(Self {
            runtime: runtime.clone().unbind(),
            state: Mutex::new(Some(generation)),
            result: Mutex::new(None),
            logprobs: Mutex::new(None),
            tool_format: None,
        })
    }

    /// This stream with the model's tool calls parsed into `result.tool_calls` when it ends (the
    /// pieces stream as the model writes them).
    pub fn with_tool_calls(mut self, format: candlewick::text::ToolCallFormat) -> Self {
        self.tool_format = Some(format);
        self
    }

    /// Keeps the finished generation's result and drops its state.
    fn finish(&self, py: Python<'_>, state: &mut Option<Generation>) -> PyResult<()> {
        if let Some(generation) = state.take() {
            let mut result = to_result(py, generation.result())?;
            if let Some(format) = self.tool_format {
                let (text, calls) = {
                    let model = self.runtime.get().lock(py)?;
                    model
                        .tokenizer()
                        .map_err(model_err)?
                        .parse_tool_calls(format, result.ids())
                        .map_err(super::errors::text_err)?
                };
                result = result.with_tool_calls(text, super::text::tool_calls_to_py(py, &calls)?);
            }
            *self.result.lock().map_err(poisoned)? = Some(Py::new(py, result)?);
        }
        Ok(())
    }

    /// Records the log-probabilities behind the piece about to be yielded.
    fn keep_logprobs(&self, py: Python<'_>, generation: &mut Generation) -> PyResult<()> {
        let taken = generation.take_logprobs().map(|l| logprobs_to_py(py, l)).transpose()?;
        *self.logprobs.lock().map_err(poisoned)? = taken;
        Ok(())
    }
}

#[pymethods]
impl PyGenerationStream {
    fn __iter__(slf: PyRef<'_, Self>) -> PyRef<'_, Self> {
        slf
    }

    fn __next__(&self, py: Python<'_>) -> PyResult<String> {
        let mut state = lock_released(py, &self.state).map_err(poisoned)?;
        let Some(generation) = state.as_mut() else {
            return Err(PyStopIteration::new_err(()));
        };
        let rt = self.runtime.get();
        loop {
            if generation.finish_reason().is_some() {
                self.finish(py, &mut state)?;
                return Err(PyStopIteration::new_err(()));
            }
            let piece =
                py.detach(|| catch_panic(|| rt.lock_detached()?.step_generation(generation).map_err(generation_err)))?;
            if !piece.is_empty() {
                self.keep_logprobs(py, generation)?;
                return Ok(piece);
            }
            py.check_signals()?;
        }
    }

    /// Stops the generation where it stands; ``result`` then holds what was generated, its usage
    /// and the finish reason ``"cancelled"`` (a stream that already ended keeps its own).
    /// ``result.text`` also has the text not yet yielded (a possible stop string's start, held
    /// back). Closing twice does nothing.
    ///
    /// Example:
    ///     >>> s = rt.stream("Once upon a time", max_tokens=100)
    ///     >>> first = next(s)
    ///     >>> s.close()
    ///     >>> s.result.finish_reason, s.result.usage["completion_tokens"]
    ///     ('cancelled', 1)
    fn close(&self, py: Python<'_>) -> PyResult<()> {
        let mut state = lock_released(py, &self.state).map_err(poisoned)?;
        if let Some(generation) = state.as_mut() {
            generation.cancel().map_err(super::errors::text_err)?;
        }
        self.finish(py, &mut state)
    }

    fn __enter__(slf: PyRef<'_, Self>) -> PyRef<'_, Self> {
        slf
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

    /// The finished generation (None until the stream ends or is closed).
    #[getter]
    fn result(&self, py: Python<'_>) -> PyResult<Option<Py<PyGenerationResult>>> {
        Ok(self.result.lock().map_err(poisoned)?.as_ref().map(|r| r.clone_ref(py)))
    }

    /// With ``logprobs=N``: the log-probabilities of the tokens behind the piece last yielded
    /// (entries as in ``GenerationResult.logprobs``); None otherwise. Tokens whose text is
    /// still held back come with a later piece; ``result.logprobs`` has every token's.
    #[getter]
    fn logprobs(&self, py: Python<'_>) -> PyResult<Option<Vec<Py<PyDict>>>> {
        Ok(self.logprobs.lock().map_err(poisoned)?.as_ref().map(|l| l.iter().map(|d| d.clone_ref(py)).collect()))
    }

    fn __repr__(&self, py: Python<'_>) -> PyResult<String> {
        let running = lock_released(py, &self.state).map_err(poisoned)?.is_some();
        Ok(format!("GenerationStream({})", if running { "running" } else { "ended" }))
    }
}
