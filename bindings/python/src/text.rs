//! The tokenizer of a runtime, for Python: encode, decode, chat templates.

use std::sync::Arc;

use pyo3::prelude::*;
use pyo3::types::{PyAny, PyBool, PyDict, PyFloat, PyInt, PyList, PyString, PyTuple};

use super::convert::json_of;
use super::errors::{invalid_option, text_err};
use candlewick::text::{ChatRenderOptions, ChatTemplate, TemplateValue, TextError, Tokenizer, ToolCall, ToolChoice};

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

/// OpenAI's `tool_choice`: `"auto"`, `"none"`, `"required"` or `{"type": "function",
/// "function": {"name": ...}}`.
pub fn tool_choice_of(v: Option<&Bound<'_, PyAny>>) -> PyResult<ToolChoice> {
    let Some(v) = v.filter(|v| !v.is_none()) else { return Ok(ToolChoice::Auto) };
    if let Ok(s) = v.extract::<String>() {
        return match s.as_str() {
            "auto" => Ok(ToolChoice::Auto),
            "none" => Ok(ToolChoice::None),
            "required" => Ok(ToolChoice::Required),
            other => Err(text_err(TextError::InvalidToolCall {
                reason: format!("tool_choice {other:?} is not \"auto\", \"none\", \"required\" or a function"),
            })),
        };
    }
    let value = json_of("tool_choice", v)?;
    match value.get("function").and_then(|f| f.get("name")).and_then(|n| n.as_str()) {
        Some(name) => Ok(ToolChoice::Function(name.to_owned())),
        None => Err(text_err(TextError::InvalidToolCall {
            reason: "tool_choice must be \"auto\", \"none\", \"required\" or {\"type\": \"function\", \"function\": {\"name\": ...}}".into(),
        })),
    }
}

/// `tools` as a list of JSON values (OpenAI tool objects).
pub fn tools_of(v: &Bound<'_, PyAny>) -> PyResult<Vec<serde_json::Value>> {
    match json_of("tools", v)? {
        serde_json::Value::Array(items) => Ok(items),
        _ => Err(text_err(TextError::InvalidToolCall { reason: "tools must be a list of tool objects".into() })),
    }
}

/// Calls as OpenAI's `tool_calls` entries: `{"id", "type": "function", "function": {"name",
/// "arguments"}}`, the arguments a JSON string.
pub fn tool_calls_to_py(py: Python<'_>, calls: &[ToolCall]) -> PyResult<Vec<Py<PyDict>>> {
    calls
        .iter()
        .enumerate()
        .map(|(i, c)| {
            let f = PyDict::new(py);
            f.set_item("name", &c.name)?;
            f.set_item("arguments", c.arguments.to_string())?;
            let d = PyDict::new(py);
            // Unique within a process: a counter and the call's index.
            d.set_item("id", format!("call_{:x}{i}", next_call_id()))?;
            d.set_item("type", "function")?;
            d.set_item("function", f)?;
            Ok(d.unbind())
        })
        .collect()
}

fn next_call_id() -> u64 {
    use std::sync::atomic::{AtomicU64, Ordering};
    static NEXT: AtomicU64 = AtomicU64::new(0x5eed_0000);
    NEXT.fetch_add(1, Ordering::Relaxed)
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

    /// The format the model writes tool calls in (``"hermes"``, ``"mistral"`` or ``"llama3"``),
    /// detected from the chat template unless named.
    ///
    /// Args:
    ///     name (str | None): a format to use instead of the detected one.
    ///     chat_template (str | None): a template to detect from instead of the model's.
    ///
    /// Returns:
    ///     str: the format's name.
    #[pyo3(signature = (name=None, chat_template=None))]
    fn tool_call_format(&self, name: Option<&str>, chat_template: Option<&str>) -> PyResult<&'static str> {
        Ok(self.inner.tool_call_format(name, chat_template).map_err(text_err)?.as_str())
    }

    /// The Lark grammar (for ``grammar=``) that makes the model call ``tools`` as
    /// ``tool_choice`` asks, with arguments valid against each function's parameter schema.
    ///
    /// Args:
    ///     tools (list[dict]): OpenAI tool objects.
    ///     tool_choice (str | dict | None): ``"required"`` (the default) or ``{"type": "function",
    ///         "function": {"name": ...}}``; ``"auto"`` and ``"none"`` need no grammar.
    ///     parallel_tool_calls (bool): allow several calls.
    ///     format (str | None): the tool-call format; None detects it from the template.
    ///     chat_template (str | None): a template to detect from instead of the model's.
    ///
    /// Returns:
    ///     str | None: the grammar, or None when the choice needs none.
    #[pyo3(signature = (tools, tool_choice=None, parallel_tool_calls=true, format=None, chat_template=None))]
    fn tool_call_grammar(
        &self,
        tools: &Bound<'_, PyAny>,
        tool_choice: Option<&Bound<'_, PyAny>>,
        parallel_tool_calls: bool,
        format: Option<&str>,
        chat_template: Option<&str>,
    ) -> PyResult<Option<String>> {
        let format = self.inner.tool_call_format(format, chat_template).map_err(text_err)?;
        // Left out, the grammar is for a call of any tool.
        let choice =
            if tool_choice.is_none_or(|c| c.is_none()) { ToolChoice::Required } else { tool_choice_of(tool_choice)? };
        self.inner.tool_call_grammar(format, &tools_of(tools)?, &choice, parallel_tool_calls).map_err(text_err)
    }

    /// Splits generated token ids into the message's text and its tool calls.
    ///
    /// Args:
    ///     ids (Sequence[int]): the generated ids (``GenerationResult.token_ids``).
    ///     format (str | None): the tool-call format; None detects it from the template.
    ///     chat_template (str | None): a template to detect from instead of the model's.
    ///
    /// Returns:
    ///     tuple[str, list[dict]]: the text outside the calls, and OpenAI ``tool_calls`` entries.
    #[pyo3(signature = (ids, format=None, chat_template=None))]
    fn parse_tool_calls(
        &self,
        py: Python<'_>,
        ids: Vec<u32>,
        format: Option<&str>,
        chat_template: Option<&str>,
    ) -> PyResult<(String, Vec<Py<PyDict>>)> {
        let format = self.inner.tool_call_format(format, chat_template).map_err(text_err)?;
        let (text, calls) = self.inner.parse_tool_calls(format, &ids).map_err(text_err)?;
        Ok((text, tool_calls_to_py(py, &calls)?))
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
            let messages = self::conversation("conversation", c)?;
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
