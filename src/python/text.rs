//! The tokenizer of a runtime, for Python: encode, decode, chat templates.

use std::sync::Arc;

use pyo3::prelude::*;
use pyo3::types::PyAny;

use super::errors::text_err;
use crate::text::{ChatTemplate, Tokenizer};

/// A model's tokenizer (converted from GGUF metadata or read from tokenizer.json).
#[pyclass(name = "Tokenizer", module = "candlewick._native", frozen)]
pub struct PyTokenizer {
    pub(crate) inner: Arc<Tokenizer>,
}

/// Serialises Python chat messages (and extra variables) to JSON for the template engine.
pub fn to_json(py: Python<'_>, value: &Bound<'_, PyAny>) -> PyResult<String> {
    py.import("json")?.call_method1("dumps", (value,))?.extract()
}

impl PyTokenizer {
    /// Renders messages through `template` (a Jinja source) or else the model's chat template.
    pub fn render_chat(
        &self,
        py: Python<'_>,
        messages: &Bound<'_, PyAny>,
        add_generation_prompt: bool,
        extra: Option<&Bound<'_, PyAny>>,
        template: Option<&str>,
    ) -> PyResult<String> {
        let template = match template {
            Some(src) => ChatTemplate::new(
                src,
                self.inner.bos_token().map(str::to_owned),
                self.inner.eos_token().map(str::to_owned),
            ),
            None => self.inner.chat_template_engine(),
        }
        .map_err(text_err)?;
        let messages = to_json(py, messages)?;
        let extra = extra.map(|e| to_json(py, e)).transpose()?;
        // Rendering runs code from the model file, bounded by fuel but possibly for a second:
        // other Python threads keep running meanwhile.
        py.detach(|| template.render_json(&messages, add_generation_prompt, extra.as_deref())).map_err(text_err)
    }
}

#[pymethods]
impl PyTokenizer {
    /// Token ids of `text`; with `add_special_tokens`, BOS is added where the model wants it.
    #[pyo3(signature = (text, add_special_tokens=true))]
    fn encode(&self, py: Python<'_>, text: &str, add_special_tokens: bool) -> PyResult<Vec<u32>> {
        py.detach(|| self.inner.encode(text, add_special_tokens)).map_err(text_err)
    }

    /// The text of `ids` (special tokens kept unless asked otherwise, as transformers does).
    #[pyo3(signature = (ids, skip_special_tokens=false))]
    fn decode(&self, ids: Vec<u32>, skip_special_tokens: bool) -> PyResult<String> {
        self.inner.decode(&ids, skip_special_tokens).map_err(text_err)
    }

    /// The beginning-of-sequence id, if the model has one.
    #[getter]
    fn bos_id(&self) -> Option<u32> {
        self.inner.bos_id()
    }

    /// The ids that end generation.
    #[getter]
    fn eos_ids(&self) -> Vec<u32> {
        self.inner.eos_ids().to_vec()
    }

    /// Number of tokens in the vocabulary.
    #[getter]
    fn vocab_size(&self) -> usize {
        self.inner.vocab_size()
    }

    /// The id of a token string, if it is in the vocabulary.
    fn token_to_id(&self, token: &str) -> Option<u32> {
        self.inner.token_to_id(token)
    }

    /// The token string of an id.
    fn id_to_token(&self, id: u32) -> Option<String> {
        self.inner.id_to_token(id)
    }

    /// The Jinja chat template, if the model ships one.
    #[getter]
    fn chat_template(&self) -> Option<String> {
        self.inner.chat_template().map(str::to_owned)
    }

    /// Renders `messages` (dicts with `role` and `content`) through the chat template (or
    /// `chat_template`, a Jinja source, for models without one); extra keywords become
    /// template variables. With `tokenize`, returns the ids (the template writes special tokens).
    #[pyo3(signature = (messages, add_generation_prompt=true, tokenize=false, chat_template=None, **kwargs))]
    fn apply_chat_template<'py>(
        &self,
        py: Python<'py>,
        messages: &Bound<'py, PyAny>,
        add_generation_prompt: bool,
        tokenize: bool,
        chat_template: Option<&str>,
        kwargs: Option<&Bound<'py, pyo3::types::PyDict>>,
    ) -> PyResult<Bound<'py, PyAny>> {
        let text = self.render_chat(py, messages, add_generation_prompt, kwargs.map(|k| k.as_any()), chat_template)?;
        if tokenize {
            let ids = self.inner.encode(&text, false).map_err(text_err)?;
            Ok(ids.into_pyobject(py)?.into_any())
        } else {
            Ok(text.into_pyobject(py)?.into_any())
        }
    }

    fn __repr__(&self) -> String {
        format!(
            "Tokenizer(vocab_size={}, bos_id={:?}, eos_ids={:?})",
            self.inner.vocab_size(),
            self.inner.bos_id(),
            self.inner.eos_ids()
        )
    }
}
