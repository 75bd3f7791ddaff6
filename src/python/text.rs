//! The tokenizer of a runtime, for Python: encode, decode, chat templates.

use std::sync::Arc;

use pyo3::prelude::*;
use pyo3::types::{PyAny, PyBool, PyDict, PyFloat, PyInt, PyList, PyString, PyTuple};

use super::errors::{invalid_option, text_err};
use crate::text::{ChatRenderOptions, ChatTemplate, TemplateValue, Tokenizer};

/// How deep chat data may nest (messages, parts, tool schemas); deeper is surely a mistake,
/// and the conversion recurses.
const MAX_DEPTH: usize = 64;

/// A model's tokenizer (converted from GGUF metadata or read from tokenizer.json), with its
/// chat template.
///
/// Example:
///     >>> tok = rt.tokenizer
///     >>> tok.decode(tok.encode("Hello"), skip_special_tokens=True)
///     'Hello'
#[pyclass(name = "Tokenizer", module = "candlewick._native", frozen)]
pub struct PyTokenizer {
    pub(crate) inner: Arc<Tokenizer>,
    /// The model's chat template, compiled once at load.
    pub(crate) template: Option<ChatTemplate>,
}

/// Converts Python chat data (dicts, lists, tuples, strings, numbers, booleans, None) into
/// template values directly, keeping dict order; `what` names the argument in errors.
pub fn template_value(what: &str, value: &Bound<'_, PyAny>) -> PyResult<TemplateValue> {
    to_value(what, value, 0)
}

fn to_value(what: &str, v: &Bound<'_, PyAny>, depth: usize) -> PyResult<TemplateValue> {
    if depth > MAX_DEPTH {
        return Err(invalid_option(v.py(), format!("{what} nests deeper than {MAX_DEPTH} levels")));
    }
    if v.is_none() {
        return Ok(TemplateValue::none());
    }
    if let Ok(b) = v.cast::<PyBool>() {
        return Ok(TemplateValue::bool(b.is_true()));
    }
    if let Ok(s) = v.cast::<PyString>() {
        return Ok(TemplateValue::string(s.to_str()?));
    }
    if v.is_instance_of::<PyInt>() {
        let n: i64 = v
            .extract()
            .map_err(|_| invalid_option(v.py(), format!("{what}: the integer {v} does not fit in 64 bits")))?;
        return Ok(TemplateValue::int(n));
    }
    if let Ok(f) = v.cast::<PyFloat>() {
        return Ok(TemplateValue::float(f.value()));
    }
    if let Ok(d) = v.cast::<PyDict>() {
        let mut pairs = Vec::with_capacity(d.len());
        for (k, item) in d.iter() {
            // As json.dumps: non-string keys become their string form.
            let key = match k.cast::<PyString>() {
                Ok(s) => s.to_str()?.to_owned(),
                Err(_) => k.str()?.to_str()?.to_owned(),
            };
            pairs.push((key, to_value(what, &item, depth + 1)?));
        }
        return Ok(TemplateValue::map(pairs));
    }
    if v.is_instance_of::<PyList>() || v.is_instance_of::<PyTuple>() {
        let items = v.try_iter()?.map(|item| to_value(what, &item?, depth + 1)).collect::<PyResult<Vec<_>>>()?;
        return Ok(TemplateValue::list(items));
    }
    Err(pyo3::exceptions::PyTypeError::new_err(format!(
        "{what} may hold dicts, lists, strings, numbers, booleans and None, not {}",
        v.get_type().name()?
    )))
}

/// A conversation as template values: a list of message dicts.
pub fn conversation(what: &str, messages: &Bound<'_, PyAny>) -> PyResult<TemplateValue> {
    let is_list = messages.is_instance_of::<PyList>() || messages.is_instance_of::<PyTuple>();
    if !is_list || messages.try_iter()?.any(|m| m.map(|m| !m.is_instance_of::<PyDict>()).unwrap_or(true)) {
        return Err(pyo3::exceptions::PyTypeError::new_err(format!(
            "{what} must be a list of {{\"role\", \"content\"}} dicts"
        )));
    }
    template_value(what, messages)
}

#[pymethods]
impl PyTokenizer {
    /// Token ids of a text.
    ///
    /// Args:
    ///     text (str): the text to encode.
    ///     add_special_tokens (bool): add BOS where the model wants it.
    ///
    /// Returns:
    ///     list[int]: the token ids.
    ///
    /// Example:
    ///     >>> rt.tokenizer.encode("Hello")
    ///     [2, 9259]
    #[pyo3(signature = (text, add_special_tokens=true))]
    fn encode(&self, py: Python<'_>, text: &str, add_special_tokens: bool) -> PyResult<Vec<u32>> {
        py.detach(|| self.inner.encode(text, add_special_tokens)).map_err(text_err)
    }

    /// The text of token ids (special tokens kept unless asked otherwise, as transformers does).
    ///
    /// Args:
    ///     ids (Sequence[int]): the token ids.
    ///     skip_special_tokens (bool): leave out BOS, EOS and the like.
    ///
    /// Returns:
    ///     str: the text.
    ///
    /// Example:
    ///     >>> rt.tokenizer.decode([2, 9259], skip_special_tokens=True)
    ///     'Hello'
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
    ///
    /// Args:
    ///     token (str): the token as the vocabulary spells it.
    ///
    /// Returns:
    ///     int | None: its id.
    ///
    /// Example:
    ///     >>> rt.tokenizer.token_to_id("<bos>")
    ///     2
    fn token_to_id(&self, token: &str) -> Option<u32> {
        self.inner.token_to_id(token)
    }

    /// The token string of an id.
    ///
    /// Args:
    ///     id (int): a token id.
    ///
    /// Returns:
    ///     str | None: the token as the vocabulary spells it.
    ///
    /// Example:
    ///     >>> rt.tokenizer.id_to_token(2)
    ///     '<bos>'
    fn id_to_token(&self, id: u32) -> Option<String> {
        self.inner.id_to_token(id)
    }

    /// The Jinja chat template, if the model ships one.
    #[getter]
    fn chat_template(&self) -> Option<String> {
        self.inner.chat_template().map(str::to_owned)
    }

    /// Renders a conversation through the chat template, with transformers'
    /// ``apply_chat_template`` arguments and defaults.
    ///
    /// Args:
    ///     conversation (list[dict] | list[list[dict]]): ``{"role", "content"}`` dicts (a content
    ///         may be a list of ``{"type": "text", "text": ...}`` parts), or a batch of them.
    ///     tools (list[dict] | None): tool schemas, for templates that render them.
    ///     documents (list[dict] | None): documents, for retrieval templates.
    ///     chat_template (str | None): a Jinja template to use instead of the model's (base
    ///         models ship none).
    ///     add_generation_prompt (bool): end with the header of a new assistant turn.
    ///     continue_final_message (bool): leave the final message open for the model to continue.
    ///     tokenize (bool): return token ids (the template writes the special tokens) instead of text.
    ///     return_dict (bool): with ``tokenize``, return ``{"input_ids", "attention_mask"}``.
    ///     **kwargs: more template variables (``enable_thinking=False``, ...).
    ///
    /// Returns:
    ///     str | list[int] | dict: the prompt (a list of them for a batch).
    ///
    /// Example:
    ///     >>> tok.apply_chat_template([{"role": "user", "content": "Hi!"}], tokenize=False,
    ///     ...                         add_generation_prompt=True)
    ///     '<bos><start_of_turn>user\nHi!<end_of_turn>\n<start_of_turn>model\n'
    #[pyo3(signature = (conversation, tools=None, documents=None, chat_template=None, add_generation_prompt=false,
        continue_final_message=false, tokenize=true, return_dict=false, **kwargs))]
    #[allow(clippy::too_many_arguments)]
    fn apply_chat_template<'py>(
        &self,
        py: Python<'py>,
        conversation: &Bound<'py, PyAny>,
        tools: Option<&Bound<'py, PyAny>>,
        documents: Option<&Bound<'py, PyAny>>,
        chat_template: Option<&str>,
        add_generation_prompt: bool,
        continue_final_message: bool,
        tokenize: bool,
        return_dict: bool,
        kwargs: Option<&Bound<'py, PyDict>>,
    ) -> PyResult<Bound<'py, PyAny>> {
        let mut extra = Vec::new();
        if let Some(t) = tools {
            extra.push(("tools".to_owned(), template_value("tools", t)?));
        }
        if let Some(d) = documents {
            extra.push(("documents".to_owned(), template_value("documents", d)?));
        }
        if let Some(kw) = kwargs {
            for (k, v) in kw.iter() {
                let name: String = k.extract()?;
                extra.push((name.clone(), template_value(&name, &v)?));
            }
        }
        let options =
            ChatRenderOptions { add_generation_prompt, continue_final_message, extra: Some(TemplateValue::map(extra)) };
        // A batch is a list of conversations, as transformers accepts.
        let first = conversation.try_iter().ok().and_then(|mut it| it.next()).and_then(Result::ok);
        let batched = first.is_some_and(|m| m.is_instance_of::<PyList>() || m.is_instance_of::<PyTuple>());
        let conversations: Vec<Bound<'py, PyAny>> =
            if batched { conversation.try_iter()?.collect::<PyResult<_>>()? } else { vec![conversation.clone()] };
        let mut out = Vec::with_capacity(conversations.len());
        for c in &conversations {
            let messages = super::text::conversation("conversation", c)?;
            // Rendering runs code from the model file, bounded by fuel but possibly for a second:
            // other Python threads keep running meanwhile.
            let text = py
                .detach(|| self.inner.render_chat(&messages, &options, chat_template, self.template.as_ref()))
                .map_err(text_err)?;
            let item = if !tokenize {
                text.into_pyobject(py)?.into_any()
            } else {
                let ids = py.detach(|| self.inner.encode(&text, false)).map_err(text_err)?;
                if return_dict {
                    let d = PyDict::new(py);
                    d.set_item("attention_mask", vec![1u32; ids.len()])?;
                    d.set_item("input_ids", ids)?;
                    d.into_any()
                } else {
                    ids.into_pyobject(py)?.into_any()
                }
            };
            out.push(item);
        }
        if batched {
            return Ok(PyList::new(py, out)?.into_any());
        }
        Ok(out.pop().expect("one conversation rendered"))
    }

    fn __repr__(&self) -> String {
        let bos = match self.inner.bos_id() {
            Some(id) => id.to_string(),
            None => "None".into(),
        };
        let eos = self.inner.eos_ids().iter().map(u32::to_string).collect::<Vec<_>>().join(", ");
        let template = if self.inner.chat_template().is_some() { "True" } else { "False" };
        format!(
            "Tokenizer(vocab_size={}, bos_id={bos}, eos_ids=[{eos}], chat_template={template})",
            self.inner.vocab_size()
        )
    }
}
