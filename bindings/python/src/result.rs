//! Finished generations for Python: `GenerationResult`, and per-token log-probabilities as dicts
//! (the generation methods, streams and the engine all hand these out).

use pyo3::prelude::*;
use pyo3::types::PyDict;

use super::convert::py_repr;
use candlewick::generation::{GenerationResult, TokenLogprobs};

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
