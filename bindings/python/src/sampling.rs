//! The sampling keywords of `generate`, `stream`, `chat`, `generate_batch` and `Engine.submit`,
//! converted into the model layer's `GenerateOptions` over the model's defaults, and the one
//! table of those defaults (`generation_defaults`).

use pyo3::prelude::*;
use pyo3::types::PyDict;

use super::convert::{adapter_choice, count, int_err, number, type_err, value_err, Given};
use super::errors::GenerationOptionError;
use candlewick::generation::{ConstraintSpec, GenerateOptions};

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
    /// A Lark or GBNF grammar.
    pub grammar: Option<String>,
    /// `"lark"` or `"gbnf"`; `None`: detected from the grammar.
    pub grammar_format: Option<String>,
    /// A regular expression.
    pub regex: Option<String>,
    /// Strings, one of which is the output.
    pub choice: Option<Vec<String>>,
    /// Draft tokens per step from prompt lookup (n-gram speculation); `None` or 0: off.
    pub prompt_lookup_num_tokens: Option<Bound<'py, PyAny>>,
    /// Tokens the draft model proposes per step; `None`: the default; 0: off.
    pub num_draft_tokens: Option<Bound<'py, PyAny>>,
    /// LoRA adapters for this call (`convert::adapter_choice`); `None`: the runtime's.
    pub adapters: Option<Bound<'py, PyAny>>,
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
        if let Some(v) = self.adapters.as_ref().filter(|v| !v.is_none()) {
            o.adapters = Some(adapter_choice("adapters", v)?);
        }
        if let Some(v) = self.num_draft_tokens.as_ref().filter(|v| !v.is_none()) {
            o.draft_tokens = Some(count("num_draft_tokens", v)?);
        }
        o.sampling.validate().map_err(GenerationOptionError::new_err)?;
        Ok(o)
    }
}

impl SamplingArgs<'_> {
    /// `grammar` as the Lark grammar llguidance compiles: a GBNF one (`grammar_format="gbnf"`, or
    /// detected) converted by `candlewick.grammar.to_lark`, the one converter of the package.
    fn grammar(&self) -> PyResult<Option<ConstraintSpec>> {
        let Some(text) = &self.grammar else {
            if let Some(format) = &self.grammar_format {
                return Err(GenerationOptionError::new_err(format!("grammar_format={format:?} needs a grammar")));
            }
            return Ok(None);
        };
        Python::attach(|py| {
            let lark = py
                .import("candlewick.grammar")?
                .getattr("to_lark")?
                .call1((text, self.grammar_format.as_deref()))
                .map_err(|e| {
                    // A format or GBNF text that does not parse is a bad option, named as such.
                    if e.is_instance_of::<pyo3::exceptions::PyValueError>(py) {
                        GenerationOptionError::new_err(format!("grammar: {}", e.value(py)))
                    } else {
                        e
                    }
                })?;
            Ok(Some(ConstraintSpec::Lark(lark.extract()?)))
        })
    }

    /// The one output constraint these arguments ask for, if any.
    fn constraint(&self) -> PyResult<Option<ConstraintSpec>> {
        let format = match &self.response_format {
            Some(v) if !v.is_none() => response_format(v)?,
            _ => None,
        };
        let given: Vec<(&str, ConstraintSpec)> = [
            ("response_format", format),
            ("grammar", self.grammar()?),
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
