//! The conversions the binding files share: Python arguments into Rust values (token ids, counts,
//! numbers, prompts, JSON), and strings into Python's reprs. Nothing here decides anything: an
//! argument of the wrong kind or out of range is an error that names it.
//!
//! It imports `errors` only, and every file above it may import it (lib.rs lists the order).

use pyo3::prelude::*;
use pyo3::types::{PyAny, PyBool, PyInt};

use super::errors::{invalid_option, TokenOutOfRangeError};
use candlewick::model::Prompt;

/// Python's `repr` of a string, so reprs read as Python, not Rust.
pub fn py_repr(py: Python<'_>, s: &str) -> String {
    pyo3::types::PyString::new(py, s).repr().map(|r| r.to_string()).unwrap_or_else(|_| format!("{s:?}"))
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

/// An `InvalidOptionError` (a `ValueError` too) naming the argument.
pub fn value_err(arg: &str, why: &str) -> PyErr {
    Python::attach(|py| invalid_option(py, format!("{arg}: {why}")))
}

/// A `TypeError` naming the argument, what it must be and what it was.
pub fn type_err(arg: &str, want: &str, v: &Bound<'_, PyAny>) -> PyErr {
    let got = v.get_type().name().map(|n| n.to_string()).unwrap_or_default();
    pyo3::exceptions::PyTypeError::new_err(format!("{arg} must be {want}, not {got}"))
}

/// A count (an int from 0 up) of a keyword argument.
pub fn count(arg: &str, v: &Bound<'_, PyAny>) -> PyResult<usize> {
    let n: i64 = v.extract().map_err(|_| int_err(arg, v))?;
    usize::try_from(n).map_err(|_| value_err(arg, &format!("must be >= 0, got {n}")))
}

/// The error for a value that is not an int of 64 bits: out of range if it is an int at all.
pub fn int_err(arg: &str, v: &Bound<'_, PyAny>) -> PyErr {
    if v.is_instance_of::<PyInt>() {
        value_err(arg, &format!("{v} is out of range"))
    } else {
        type_err(arg, "an int", v)
    }
}

/// A number (int or float) as `f32`.
pub fn number(arg: &str, v: &Bound<'_, PyAny>) -> PyResult<f32> {
    v.extract::<f64>().map(|x| x as f32).map_err(|_| type_err(arg, "a number", v))
}

/// An optional int from 0 up; a negative one is an `InvalidOptionError` naming it.
pub fn non_negative(arg: &str, v: Option<i64>) -> PyResult<Option<usize>> {
    v.map(|v| {
        usize::try_from(v).map_err(|_| Python::attach(|py| invalid_option(py, format!("{arg} must be >= 0, got {v}"))))
    })
    .transpose()
}

/// A count given to `load` (`max_context`, `threads`): an int from 0 up, any larger int (even
/// past 64 bits) an `InvalidOptionError` naming it, not a bare `OverflowError`.
pub fn count_option(py: Python<'_>, arg: &str, v: Option<&Bound<'_, PyAny>>) -> PyResult<Option<usize>> {
    let Some(v) = v.filter(|v| !v.is_none()) else { return Ok(None) };
    if !v.is_instance_of::<PyInt>() || v.is_instance_of::<PyBool>() {
        let kind = v.get_type().name()?;
        return Err(pyo3::exceptions::PyTypeError::new_err(format!("{arg} must be an int or None, not {kind}")));
    }
    match v.extract::<u64>().ok().and_then(|n| usize::try_from(n).ok()) {
        Some(n) => Ok(Some(n)),
        None => Err(invalid_option(py, format!("{arg} must be an int from 0 up to {}, got {v}", u64::MAX))),
    }
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
            Err(_) if item.is_instance_of::<PyInt>() => {
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

/// A prompt given as text (`str`) or as token ids (any other sequence); `arg` names it in errors.
pub fn prompt_of(arg: &str, value: &Bound<'_, PyAny>) -> PyResult<Prompt> {
    match value.extract::<String>() {
        Ok(text) => Ok(Prompt::Text(text)),
        Err(_) => Ok(Prompt::Ids(extract_ids(arg, value)?)),
    }
}

/// A Python value (dicts, lists, strings, numbers) as JSON, through Python's own `json`.
pub fn json_of(what: &str, v: &Bound<'_, PyAny>) -> PyResult<serde_json::Value> {
    let text: String = v.py().import("json")?.call_method1("dumps", (v,))?.extract()?;
    serde_json::from_str(&text).map_err(|e| invalid_option(v.py(), format!("{what}: {e}")))
}

/// LoRA adapters chosen for a call: a name, a list of names or `(name, scale)` pairs, or a dict
/// `{name: scale}` (a scale of None: the adapter's load scale); empty: the base model.
pub fn adapter_choice(arg: &str, v: &Bound<'_, PyAny>) -> PyResult<candlewick::generation::AdapterChoice> {
    let scale_of = |s: &Bound<'_, PyAny>| -> PyResult<Option<f32>> {
        if s.is_none() {
            Ok(None)
        } else {
            number(arg, s).map(Some)
        }
    };
    if let Ok(name) = v.extract::<String>() {
        return Ok(vec![(name, None)]);
    }
    if let Ok(d) = v.cast::<pyo3::types::PyDict>() {
        return d
            .iter()
            .map(|(k, s)| Ok((k.extract::<String>().map_err(|_| type_err(arg, "adapter names", &k))?, scale_of(&s)?)))
            .collect();
    }
    let items = v
        .try_iter()
        .map_err(|_| type_err(arg, "a name, a list of names or (name, scale) pairs, or a dict {name: scale}", v))?;
    let mut out = Vec::new();
    for item in items {
        let item = item?;
        if let Ok(name) = item.extract::<String>() {
            out.push((name, None));
        } else if let Ok((name, s)) = item.extract::<(String, Bound<'_, PyAny>)>() {
            out.push((name, scale_of(&s)?));
        } else {
            return Err(type_err(arg, "a name or a (name, scale) pair", &item));
        }
    }
    Ok(out)
}
