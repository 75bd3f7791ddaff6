//! Chat templates: the Jinja programs Hugging Face checkpoints ship to turn a conversation
//! into a prompt, rendered with minijinja configured like transformers' sandboxed Jinja2
//! environment (`trim_blocks`, `lstrip_blocks`, loop controls, `raise_exception`, `tojson`,
//! `strftime_now`, Python string and dict methods).

use std::sync::Arc;

use minijinja::syntax::SyntaxConfig;
use minijinja::value::{from_args, Kwargs, Rest, Value, ValueKind, ValueOrKwargs};
use minijinja::{Environment, Error, ErrorKind};
use serde::{Deserialize, Serialize};

use super::error::TextError;
use super::python_json_dumps::{dumps, DumpOptions, OrderedValue};

/// The name the template is registered under; no extension, so no auto-escaping.
const TEMPLATE_NAME: &str = "chat_template";

/// The work one render may do (minijinja fuel: about one unit per instruction or 64 bytes
/// produced). Real templates over long conversations use well under 1%; a template that loops
/// without end stops in about a second with a typed error instead of hanging the caller.
pub const TEMPLATE_FUEL: u64 = 10_000_000;
/// The largest prompt a template may render.
pub const MAX_TEMPLATE_OUTPUT: usize = 64 << 20;
/// The widest `tojson` indent accepted (the allocation is `indent × depth` per line).
pub const MAX_TOJSON_INDENT: usize = 256;
/// The largest width or precision accepted in `str.format` specs, which minijinja allocates
/// before any fuel is charged.
pub const MAX_FORMAT_WIDTH: u64 = 4096;

/// One turn of a conversation.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ChatMessage {
    /// `system`, `user`, `assistant`, `tool`, ... as the template expects.
    pub role: String,
    /// The turn's text.
    pub content: String,
}

impl ChatMessage {
    /// A message with the given role and content.
    pub fn new(role: impl Into<String>, content: impl Into<String>) -> Self {
        Self { role: role.into(), content: content.into() }
    }

    fn to_value(&self) -> Value {
        Value::from_pairs([("role", Value::from(self.role.as_str())), ("content", Value::from(self.content.as_str()))])
    }
}

/// The error `raise_exception` attaches, so its message reaches the user verbatim.
#[derive(Debug)]
struct RaisedException(String);

impl std::fmt::Display for RaisedException {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for RaisedException {}

fn raise_exception(message: String) -> Result<Value, Error> {
    Err(Error::new(ErrorKind::InvalidOperation, message.clone()).with_source(RaisedException(message)))
}

/// transformers' `tojson`: `json.dumps(x, ensure_ascii=False, indent=None, separators=None,
/// sort_keys=False)`, positional arguments in that order.
fn tojson(value: &Value, args: Rest<ValueOrKwargs>) -> Result<Value, Error> {
    let args = args.into_values();
    let (ensure_ascii, indent, separators, sort_keys, kwargs) =
        from_args::<(Option<Value>, Option<Value>, Option<Value>, Option<Value>, Kwargs)>(&args)?;
    let pick = |positional: Option<Value>, name: &str| -> Result<Option<Value>, Error> {
        match kwargs.get::<Option<Value>>(name)? {
            Some(v) => Ok(Some(v)),
            None => Ok(positional),
        }
    };
    let ensure_ascii = pick(ensure_ascii, "ensure_ascii")?.is_some_and(|v| v.is_true());
    let sort_keys = pick(sort_keys, "sort_keys")?.is_some_and(|v| v.is_true());
    let indent = match pick(indent, "indent")? {
        None => None,
        Some(v) if v.is_none() || v.is_undefined() => None,
        Some(v) if v.as_str().is_some_and(|s| s.len() > MAX_TOJSON_INDENT) => {
            return Err(Error::new(
                ErrorKind::InvalidOperation,
                format!("tojson indent string is longer than the {MAX_TOJSON_INDENT} bytes allowed"),
            ))
        }
        Some(v) if v.as_str().is_some() => Some(v.as_str().unwrap_or_default().to_string()),
        Some(v) => {
            let n = i64::try_from(v)?;
            if n > MAX_TOJSON_INDENT as i64 {
                return Err(Error::new(
                    ErrorKind::InvalidOperation,
                    format!("tojson indent {n} is larger than the {MAX_TOJSON_INDENT} allowed"),
                ));
            }
            Some(" ".repeat(n.max(0) as usize))
        }
    };
    let separators = match pick(separators, "separators")? {
        None => None,
        Some(v) if v.is_none() || v.is_undefined() => None,
        Some(v) => {
            let parts: Vec<Value> = v.try_iter()?.collect();
            match parts.as_slice() {
                [item, key] => match (item.as_str(), key.as_str()) {
                    (Some(item), Some(key)) => Some((item.to_string(), key.to_string())),
                    _ => None,
                },
                _ => None,
            }
            .ok_or_else(|| Error::new(ErrorKind::InvalidOperation, "separators must be two strings"))
            .map(Some)?
        }
    };
    kwargs.assert_all_used()?;
    let opts = DumpOptions { ensure_ascii, indent, separators, sort_keys };
    Ok(Value::from_safe_string(dumps(value, &opts)?))
}

/// C `strftime` over a Unix timestamp in UTC (no time-zone database is available to us), by
/// jiff (which minijinja-contrib's `datetime` feature brings), GNU flags such as `%-d` included.
fn strftime_utc(format: &str, unix_seconds: i64) -> Result<String, Error> {
    let invalid = |e: jiff::Error| Error::new(ErrorKind::InvalidOperation, format!("strftime_now({format:?}): {e}"));
    let now = jiff::Timestamp::from_second(unix_seconds).map_err(invalid)?.to_zoned(jiff::tz::TimeZone::UTC);
    jiff::fmt::strtime::format(format, &now).map_err(invalid)
}

/// transformers' `strftime_now`; the clock is read in UTC.
fn strftime_now(format: String) -> Result<String, Error> {
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_err(|e| Error::new(ErrorKind::InvalidOperation, format!("system clock before 1970: {e}")))?;
    strftime_utc(&format, now.as_secs() as i64)
}

/// The largest width or precision a Python format string asks for (`{:>99}`, `{:.5}`), or an
/// error for a nested field (`{:{w}}`), whose width comes from an argument we cannot bound here.
fn format_spec_width(format: &str) -> Result<u64, Error> {
    let mut widest = 0u64;
    let mut rest = format;
    while let Some(open) = rest.find('{') {
        rest = &rest[open + 1..];
        if let Some(after) = rest.strip_prefix('{') {
            rest = after; // `{{` is a literal brace
            continue;
        }
        let close = rest.find('}').unwrap_or(rest.len());
        let field = &rest[..close];
        if field.contains('{') {
            return Err(Error::new(
                ErrorKind::InvalidOperation,
                "nested replacement fields in str.format specs are not supported in chat templates",
            ));
        }
        if let Some((_, spec)) = field.split_once(':') {
            for digits in spec.split(|c: char| !c.is_ascii_digit()).filter(|d| !d.is_empty()) {
                widest = widest.max(digits.parse::<u64>().unwrap_or(u64::MAX));
            }
        }
        rest = &rest[close.min(rest.len())..];
    }
    Ok(widest)
}

/// minijinja-contrib's Python methods, with `str.format` refused when its specs ask for more than
/// [`MAX_FORMAT_WIDTH`] (minijinja would allocate the padding before charging any fuel).
fn python_methods(state: &mut minijinja::State, value: &Value, method: &str, args: &[Value]) -> Result<Value, Error> {
    if method == "format" {
        if let Some(format) = value.as_str() {
            let width = format_spec_width(format)?;
            if width > MAX_FORMAT_WIDTH {
                return Err(Error::new(
                    ErrorKind::InvalidOperation,
                    format!("str.format width or precision {width} is larger than the {MAX_FORMAT_WIDTH} allowed"),
                ));
            }
        }
    }
    minijinja_contrib::pycompat::unknown_method_callback(state, value, method, args)
}

/// A sink that refuses output past [`MAX_TEMPLATE_OUTPUT`] bytes.
struct BoundedOutput {
    buf: Vec<u8>,
    overflowed: bool,
}

impl std::io::Write for BoundedOutput {
    fn write(&mut self, data: &[u8]) -> std::io::Result<usize> {
        if self.buf.len() + data.len() > MAX_TEMPLATE_OUTPUT {
            self.overflowed = true;
            return Err(std::io::Error::other("chat template output limit"));
        }
        self.buf.extend_from_slice(data);
        Ok(data.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// Rewrites `{% generation %}` / `{% endgeneration %}` (transformers' assistant-mask tags, which
/// minijinja cannot parse) into an always-true `if`, keeping their whitespace control.
fn neutralize_generation_tags(source: &str) -> String {
    let mut out = String::with_capacity(source.len());
    let mut rest = source;
    while let Some(start) = rest.find("{%") {
        out.push_str(&rest[..start]);
        let tag = &rest[start..];
        let Some(end) = tag.find("%}") else {
            out.push_str(tag);
            return out;
        };
        let inner = &tag[2..end];
        let (left, body) = match inner.strip_prefix(['-', '+']) {
            Some(b) => (&inner[..1], b),
            None => ("", inner),
        };
        let (body, right) = match body.strip_suffix(['-', '+']) {
            Some(b) => (b, &body[b.len()..]),
            None => (body, ""),
        };
        let replacement = match body.trim() {
            "generation" => Some("if true"),
            "endgeneration" => Some("endif"),
            _ => None,
        };
        match replacement {
            Some(r) => {
                let _ = std::fmt::Write::write_fmt(&mut out, format_args!("{{%{left} {r} {right}%}}"));
            }
            None => out.push_str(&tag[..end + 2]),
        }
        rest = &tag[end + 2..];
    }
    out.push_str(rest);
    out
}

/// A compiled chat template and the special-token texts it is rendered with.
#[derive(Clone)]
pub struct ChatTemplate {
    env: Arc<Environment<'static>>,
    bos_token: Option<String>,
    eos_token: Option<String>,
    /// Whether the template iterates a message's `content` itself (OpenAI-style parts); when it
    /// does not, text parts are joined into one string before rendering.
    reads_content_parts: bool,
}

impl std::fmt::Debug for ChatTemplate {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ChatTemplate")
            .field("bos_token", &self.bos_token)
            .field("eos_token", &self.eos_token)
            .finish_non_exhaustive()
    }
}

fn template_error(err: Error) -> TextError {
    let mut source: Option<&(dyn std::error::Error + 'static)> = Some(&err);
    while let Some(e) = source {
        if let Some(raised) = e.downcast_ref::<RaisedException>() {
            return TextError::Template { message: raised.0.clone() };
        }
        source = e.source();
    }
    if err.kind() == ErrorKind::OutOfFuel {
        return TextError::Template {
            message: format!(
                "the chat template did more work than the {TEMPLATE_FUEL} fuel allowed (does it loop without end \
                 or build a huge string?): {err:#}"
            ),
        };
    }
    TextError::Template { message: format!("{err:#}") }
}

impl ChatTemplate {
    /// Compiles `source`; `bos_token`/`eos_token` become the template variables of that name.
    pub fn new(source: &str, bos_token: Option<String>, eos_token: Option<String>) -> Result<Self, TextError> {
        let mut env = Environment::new();
        let syntax = SyntaxConfig::builder().trim_blocks(true).lstrip_blocks(true).build().map_err(template_error)?;
        env.set_syntax(syntax);
        env.set_unknown_method_callback(python_methods);
        env.set_fuel(Some(TEMPLATE_FUEL));
        minijinja_contrib::add_to_environment(&mut env);
        env.add_function("raise_exception", raise_exception);
        env.add_function("strftime_now", strftime_now);
        env.add_filter("tojson", tojson);
        env.add_template_owned(TEMPLATE_NAME, neutralize_generation_tags(source)).map_err(template_error)?;
        Ok(Self { env: Arc::new(env), bos_token, eos_token, reads_content_parts: iterates_content(source) })
    }

    /// Renders a conversation as transformers' `apply_chat_template` does (`continue_final_message`
    /// included). Message contents given as OpenAI-style parts (`[{"type": "text", "text": ...}]`)
    /// reach templates that iterate them unchanged and are joined into one string for the others.
    pub fn render_conversation(
        &self,
        messages: &TemplateValue,
        options: &ChatRenderOptions,
    ) -> Result<String, TextError> {
        if options.continue_final_message && options.add_generation_prompt {
            return Err(template_msg(
                "continue_final_message and add_generation_prompt are not compatible: use \
                 continue_final_message to continue the final message and add_generation_prompt to start a new \
                 assistant message",
            ));
        }
        let messages = if self.reads_content_parts { messages.0.clone() } else { flatten_content_parts(&messages.0)? };
        let extra = match &options.extra {
            Some(extra) => extra_pairs(extra.0.clone())?,
            None => Vec::new(),
        };
        let rendered = self.render_value(messages.clone(), options.add_generation_prompt, extra)?;
        if !options.continue_final_message {
            return Ok(rendered);
        }
        let last = messages.try_iter().ok().and_then(|it| it.last()).and_then(|m| m.get_attr("content").ok());
        let text = last.and_then(|c| match c.as_str() {
            Some(s) => Some(s.to_owned()),
            None => c
                .try_iter()
                .ok()?
                .collect::<Vec<_>>()
                .into_iter()
                .rev()
                .find_map(|part| part.get_attr("text").ok().and_then(|t| t.as_str().map(str::to_owned))),
        });
        let text = text.ok_or_else(|| {
            template_msg("continue_final_message is set but the final message has no text to continue")
        })?;
        let text = text.trim();
        match rendered.rfind(text) {
            Some(at) => Ok(rendered[..at + text.len()].to_owned()),
            None => Err(template_msg(
                "continue_final_message is set but the final message does not appear in the rendered chat",
            )),
        }
    }

    /// Renders a plain conversation.
    pub fn render(&self, messages: &[ChatMessage], add_generation_prompt: bool) -> Result<String, TextError> {
        let messages = Value::from(messages.iter().map(ChatMessage::to_value).collect::<Vec<_>>());
        self.render_value(messages, add_generation_prompt, Vec::new())
    }

    /// Renders messages given as JSON (tool calls, multimodal parts...) plus extra template
    /// variables from the `extra` object (`tools`, `documents`, `enable_thinking`...).
    ///
    /// `serde_json::Value` objects are sorted by key unless serde_json's `preserve_order` is on;
    /// use [`ChatTemplate::render_json`] when key order matters (e.g. tool schemas).
    pub fn render_with(
        &self,
        messages: &serde_json::Value,
        add_generation_prompt: bool,
        extra: &serde_json::Value,
    ) -> Result<String, TextError> {
        let to_value = |v: &serde_json::Value| {
            OrderedValue::deserialize(v)
                .map(|o| o.0)
                .map_err(|e| TextError::Template { message: format!("cannot convert JSON to a template value: {e}") })
        };
        self.render_value(to_value(messages)?, add_generation_prompt, extra_pairs(to_value(extra)?)?)
    }

    /// Like [`ChatTemplate::render_with`], from JSON text, keeping every object's key order as
    /// Python dicts do.
    pub fn render_json(
        &self,
        messages_json: &str,
        add_generation_prompt: bool,
        extra_json: Option<&str>,
    ) -> Result<String, TextError> {
        let parse = |s: &str, what: &str| {
            serde_json::from_str::<OrderedValue>(s)
                .map(|o| o.0)
                .map_err(|e| TextError::Template { message: format!("cannot parse {what} JSON: {e}") })
        };
        let messages = parse(messages_json, "messages")?;
        let extra = match extra_json {
            Some(s) => extra_pairs(parse(s, "extra variables")?)?,
            None => Vec::new(),
        };
        self.render_value(messages, add_generation_prompt, extra)
    }

    fn render_value(
        &self,
        messages: Value,
        add_generation_prompt: bool,
        extra: Vec<(String, Value)>,
    ) -> Result<String, TextError> {
        // What transformers' apply_chat_template passes: tools/documents default to None.
        let mut ctx: Vec<(String, Value)> = vec![
            ("messages".into(), messages),
            ("add_generation_prompt".into(), Value::from(add_generation_prompt)),
            ("tools".into(), Value::from(())),
            ("documents".into(), Value::from(())),
        ];
        if let Some(bos) = &self.bos_token {
            ctx.push(("bos_token".into(), Value::from(bos.as_str())));
        }
        if let Some(eos) = &self.eos_token {
            ctx.push(("eos_token".into(), Value::from(eos.as_str())));
        }
        for (key, value) in extra {
            match ctx.iter_mut().find(|(k, _)| *k == key) {
                Some(slot) => slot.1 = value,
                None => ctx.push((key, value)),
            }
        }
        let template = self.env.get_template(TEMPLATE_NAME).map_err(template_error)?;
        let mut out = BoundedOutput { buf: Vec::new(), overflowed: false };
        // The engine runs code the model's author wrote: a panic in it (a bug of the engine on
        // some odd input) becomes a template error, never an abort of the caller.
        let rendered = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            template.render_captured_to(Value::from_pairs(ctx), &mut out).map(|_| ())
        }));
        match rendered {
            Err(panic) => {
                let what = panic
                    .downcast_ref::<&str>()
                    .map(|s| s.to_string())
                    .or_else(|| panic.downcast_ref::<String>().cloned())
                    .unwrap_or_default();
                return Err(TextError::Template { message: format!("the template engine failed: {what}") });
            }
            Ok(Err(_)) if out.overflowed => {
                return Err(TextError::Template {
                    message: format!("the chat template's output exceeds {MAX_TEMPLATE_OUTPUT} bytes"),
                })
            }
            Ok(Err(e)) => return Err(template_error(e)),
            Ok(Ok(())) => {}
        }
        String::from_utf8(out.buf)
            .map_err(|e| TextError::Template { message: format!("the chat template wrote invalid UTF-8: {e}") })
    }
}

/// How to render a conversation: transformers' `apply_chat_template` arguments.
#[derive(Debug, Clone, Default)]
pub struct ChatRenderOptions {
    /// End with the header of a new assistant turn.
    pub add_generation_prompt: bool,
    /// Leave the final message open (no end-of-turn), for the model to continue it.
    pub continue_final_message: bool,
    /// Extra template variables (`tools`, `documents`, `enable_thinking`...): a map.
    pub extra: Option<TemplateValue>,
}

/// A value handed to a chat template (messages, tools, extra variables), built directly from
/// the caller's data or parsed from JSON; map keys keep the order they were given in, as
/// Python dicts do, because templates iterate them.
#[derive(Debug, Clone)]
pub struct TemplateValue(Value);

impl TemplateValue {
    /// `None`.
    pub fn none() -> Self {
        Self(Value::from(()))
    }

    /// A boolean.
    pub fn bool(v: bool) -> Self {
        Self(Value::from(v))
    }

    /// An integer.
    pub fn int(v: i64) -> Self {
        Self(Value::from(v))
    }

    /// A float.
    pub fn float(v: f64) -> Self {
        Self(Value::from(v))
    }

    /// A string.
    pub fn string(v: impl Into<String>) -> Self {
        Self(Value::from(v.into()))
    }

    /// A list.
    pub fn list(items: Vec<TemplateValue>) -> Self {
        Self(Value::from(items.into_iter().map(|v| v.0).collect::<Vec<_>>()))
    }

    /// A map, keys in the given order.
    pub fn map(pairs: Vec<(String, TemplateValue)>) -> Self {
        Self(Value::from_pairs(pairs.into_iter().map(|(k, v)| (Value::from(k), v.0)).collect::<Vec<_>>()))
    }

    /// Parses JSON text, keeping every object's key order.
    pub fn from_json(json: &str) -> Result<Self, TextError> {
        serde_json::from_str::<OrderedValue>(json)
            .map(|o| Self(o.0))
            .map_err(|e| template_msg(format!("cannot parse chat JSON: {e}")))
    }
}

impl From<&[ChatMessage]> for TemplateValue {
    fn from(messages: &[ChatMessage]) -> Self {
        Self(Value::from(messages.iter().map(ChatMessage::to_value).collect::<Vec<_>>()))
    }
}

fn template_msg(message: impl Into<String>) -> TextError {
    TextError::Template { message: message.into() }
}

/// Whether a template loops over a message's `content` (`for part in message['content']`, as
/// the templates of multimodal and recent chat models do, reading `{"type": "text", ...}`
/// parts): vLLM's test for templates that take OpenAI-style content.
fn iterates_content(source: &str) -> bool {
    let is_ident = |c: char| c.is_alphanumeric() || c == '_';
    [".content", "['content']", "[\"content\"]"].iter().any(|pattern| {
        source.match_indices(pattern).any(|(at, _)| {
            let before = &source[..at];
            let owner = before.trim_end_matches(is_ident);
            if owner.len() == before.len() {
                return false;
            }
            let head = owner.trim_end();
            head.len() < owner.len()
                && head.strip_suffix("in").is_some_and(|h| h.ends_with(|c: char| c.is_whitespace()))
        })
    })
}

/// The messages with every content given as text parts joined into one string (parts separated
/// by a newline, as vLLM does), for templates that only read string contents.
fn flatten_content_parts(messages: &Value) -> Result<Value, TextError> {
    let Ok(iter) = messages.try_iter() else { return Ok(messages.clone()) };
    let mut out = Vec::new();
    for message in iter {
        let content = message.get_attr("content").unwrap_or(Value::UNDEFINED);
        if message.kind() != ValueKind::Map || content.kind() != ValueKind::Seq {
            out.push(message);
            continue;
        }
        let mut texts = Vec::new();
        for part in content.try_iter().map_err(|e| template_msg(e.to_string()))? {
            let kind = part.get_attr("type").ok().and_then(|t| t.as_str().map(str::to_owned));
            match (kind.as_deref(), part.get_attr("text").ok().and_then(|t| t.as_str().map(str::to_owned))) {
                (Some("text"), Some(text)) => texts.push(text),
                (Some(other), _) if other != "text" => {
                    return Err(template_msg(format!(
                        "a message content part of type `{other}` cannot be rendered: this model reads text only"
                    )))
                }
                _ => return Err(template_msg("a message content part must be {\"type\": \"text\", \"text\": str}")),
            }
        }
        let mut pairs = Vec::new();
        for key in message.try_iter().map_err(|e| template_msg(e.to_string()))? {
            let value = if key.as_str() == Some("content") {
                Value::from(texts.join("\n"))
            } else {
                message.get_item(&key).unwrap_or(Value::UNDEFINED)
            };
            pairs.push((key, value));
        }
        out.push(Value::from_pairs(pairs));
    }
    Ok(Value::from(out))
}

/// The entries of an `extra` object; `null` means none.
fn extra_pairs(extra: Value) -> Result<Vec<(String, Value)>, TextError> {
    if extra.is_none() || extra.is_undefined() {
        return Ok(Vec::new());
    }
    let not_object = || TextError::Template { message: "extra template variables must be a JSON object".into() };
    if extra.kind() != ValueKind::Map {
        return Err(not_object());
    }
    let mut pairs = Vec::new();
    for key in extra.try_iter().map_err(|_| not_object())? {
        let name = key.as_str().ok_or_else(not_object)?.to_string();
        let value = extra.get_item(&key).map_err(|_| not_object())?;
        pairs.push((name, value));
    }
    Ok(pairs)
}

#[cfg(test)]
mod tests {
    use super::*;

    const GEMMA_TEMPLATE: &str = r#"{{ bos_token }}
{%- if messages[0]['role'] == 'system' -%}
    {%- if messages[0]['content'] is string -%}
        {%- set first_user_prefix = messages[0]['content'] + '

' -%}
    {%- else -%}
        {%- set first_user_prefix = messages[0]['content'][0]['text'] + '

' -%}
    {%- endif -%}
    {%- set loop_messages = messages[1:] -%}
{%- else -%}
    {%- set first_user_prefix = "" -%}
    {%- set loop_messages = messages -%}
{%- endif -%}
{%- for message in loop_messages -%}
    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}
        {{ raise_exception("Conversation roles must alternate user/assistant/user/assistant/...") }}
    {%- endif -%}
    {%- if (message['role'] == 'assistant') -%}
        {%- set role = "model" -%}
    {%- else -%}
        {%- set role = message['role'] -%}
    {%- endif -%}
    {{ '<start_of_turn>' + role + '
' + (first_user_prefix if loop.first else "") }}
    {%- if message['content'] is string -%}
        {{ message['content'] | trim }}
    {%- elif message['content'] is iterable -%}
        {%- for item in message['content'] -%}
            {%- if item['type'] == 'image' -%}
                {{ '<start_of_image>' }}
            {%- elif item['type'] == 'text' -%}
                {{ item['text'] | trim }}
            {%- endif -%}
        {%- endfor -%}
    {%- else -%}
        {{ raise_exception("Invalid content type") }}
    {%- endif -%}
    {{ '<end_of_turn>
' }}
{%- endfor -%}
{%- if add_generation_prompt -%}
    {{'<start_of_turn>model
'}}
{%- endif -%}
"#;

    const CHATML_TEMPLATE: &str = "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}";

    fn conversation() -> Vec<ChatMessage> {
        vec![
            ChatMessage::new("system", "You are helpful."),
            ChatMessage::new("user", "  Hi  "),
            ChatMessage::new("assistant", "Hello!"),
            ChatMessage::new("user", "How are you?"),
        ]
    }

    #[test]
    fn gemma_template() {
        let t = ChatTemplate::new(GEMMA_TEMPLATE, Some("<bos>".into()), Some("<eos>".into())).unwrap();
        let out = t.render(&conversation(), true).unwrap();
        assert_eq!(
            out,
            "<bos><start_of_turn>user\nYou are helpful.\n\nHi<end_of_turn>\n<start_of_turn>model\nHello!<end_of_turn>\n<start_of_turn>user\nHow are you?<end_of_turn>\n<start_of_turn>model\n"
        );
        let out = t.render(&conversation()[1..2], false).unwrap();
        assert_eq!(out, "<bos><start_of_turn>user\nHi<end_of_turn>\n");
    }

    #[test]
    fn raise_exception_surfaces_its_message() {
        let t = ChatTemplate::new(GEMMA_TEMPLATE, Some("<bos>".into()), None).unwrap();
        let bad = vec![ChatMessage::new("assistant", "x")];
        match t.render(&bad, false) {
            Err(TextError::Template { message }) => {
                assert_eq!(message, "Conversation roles must alternate user/assistant/user/assistant/...")
            }
            other => panic!("expected a template error, got {other:?}"),
        }
    }

    #[test]
    fn chatml_template() {
        let t = ChatTemplate::new(CHATML_TEMPLATE, None, Some("<|im_end|>".into())).unwrap();
        let out = t.render(&conversation()[..2], true).unwrap();
        assert_eq!(
            out,
            "<|im_start|>system\nYou are helpful.<|im_end|>\n<|im_start|>user\n  Hi  <|im_end|>\n<|im_start|>assistant\n"
        );
    }

    #[test]
    fn trim_and_lstrip_blocks_python_methods_namespace_and_loop_controls() {
        // Multi-line template relying on trim_blocks/lstrip_blocks like HF's environment.
        let source = r#"{% set ns = namespace(count=0, sys='') %}
{% if messages[0]['content'] | trim %}
  {% set ns.sys = messages[0]['content'].strip() %}
{% endif %}
[{{ ns.sys }}]
{% for m in messages %}
  {% if m.role == 'system' %}{% continue %}{% endif %}
  {% set ns.count = ns.count + 1 %}
  {{ m.role.upper() }}:{{ m.content.split()|join('_') }}{% if not loop.last %},{% endif %}
  {% if m.content.startswith('How') %}{% break %}{% endif %}
{% endfor %}
n={{ ns.count }}"#;
        let t = ChatTemplate::new(source, None, None).unwrap();
        let out = t.render(&conversation(), false).unwrap();
        assert_eq!(out, "[You are helpful.]\n  USER:Hi,  ASSISTANT:Hello!,  USER:How_are_you?n=3");
    }

    #[test]
    fn tojson_and_extra_variables() {
        let source = "{{ tools | tojson }}|{{ tools[0] | tojson(indent=2) }}|{{ flag }}|{{ messages[0].content }}";
        let t = ChatTemplate::new(source, None, None).unwrap();
        let out = t
            .render_json(
                r#"[{"role": "user", "content": "é"}]"#,
                false,
                Some(r#"{"tools": [{"name": "f", "parameters": {"z": 1, "a": [true, null, 1.5]}}], "flag": "yes"}"#),
            )
            .unwrap();
        assert_eq!(
            out,
            "[{\"name\": \"f\", \"parameters\": {\"z\": 1, \"a\": [true, null, 1.5]}}]|{\n  \"name\": \"f\",\n  \"parameters\": {\n    \"z\": 1,\n    \"a\": [\n      true,\n      null,\n      1.5\n    ]\n  }\n}|yes|é"
        );
        // As in transformers, serializing an undefined value is an error, not "null".
        let err = t
            .render_with(
                &serde_json::json!([{"role": "user", "content": "x"}]),
                false,
                &serde_json::json!({"tools": [], "flag": 1}),
            )
            .unwrap_err();
        assert!(err.to_string().contains("not JSON serializable"), "{err}");
        let t = ChatTemplate::new("{{ tools | tojson }}|{{ flag }}|{{ messages[0].content }}", None, None).unwrap();
        let out = t
            .render_with(
                &serde_json::json!([{"role": "user", "content": "x"}]),
                false,
                &serde_json::json!({"tools": [], "flag": 1}),
            )
            .unwrap();
        assert_eq!(out, "[]|1|x");
    }

    #[test]
    fn generation_tags_and_strftime() {
        let source = "{%- generation -%}\n  {{ 'a' }}\n{%- endgeneration %}|{{ strftime_now('%Y') | length }}";
        let t = ChatTemplate::new(source, None, None).unwrap();
        assert_eq!(t.render(&[], false).unwrap(), "a|4");
        // 2024-07-23 13:05:09 UTC, a Tuesday.
        assert_eq!(
            strftime_utc("%d %b %Y %a %H:%M:%S %-d %j %p %I", 1_721_739_909).unwrap(),
            "23 Jul 2024 Tue 13:05:09 23 205 PM 01"
        );
        assert_eq!(strftime_utc("%F %A %B %Z %z", 0).unwrap(), "1970-01-01 Thursday January UTC +0000");
    }

    fn render_err(source: &str) -> String {
        let t = ChatTemplate::new(source, None, None).unwrap();
        match t.render(&conversation(), false) {
            Err(TextError::Template { message }) => message,
            other => panic!("{source}: expected a template error, got {other:?}"),
        }
    }

    #[test]
    fn endless_and_huge_templates_stop_with_typed_errors() {
        let loops = "{% for i in range(100000) %}{% for j in range(100000) %}{{ i }}{% endfor %}{% endfor %}";
        assert!(render_err(loops).contains("fuel"));
        assert!(render_err("{{ messages|tojson(indent=10**12) }}").contains("indent"));
        assert!(render_err("{{ '{:>99999999999}'.format('x') }}").contains("width"));
        assert!(render_err("{{ '{:.99999999999}'.format(1.5) }}").contains("precision"));
        assert!(render_err("{{ '{:>{w}}'.format('x', w=5) }}").contains("nested"));
        assert!(render_err("{{ '%99999999999d'|format(1) }}").contains("fuel"));
        // Output past the limit stops even when fuel would allow it.
        assert_eq!(format_spec_width("{{}} {:>12} {0:.3f} {:08}").unwrap(), 12);
        let t = ChatTemplate::new("{{ '{:>4}'.format('x') }}|{{ 'a'|tojson(indent=2) }}", None, None).unwrap();
        assert_eq!(t.render(&[], false).unwrap(), "   x|\"a\"");
    }

    #[test]
    fn output_is_bounded() {
        let mut out = BoundedOutput { buf: Vec::new(), overflowed: false };
        use std::io::Write;
        assert!(out.write_all(&vec![b'x'; MAX_TEMPLATE_OUTPUT]).is_ok());
        assert!(out.write_all(b"y").is_err() && out.overflowed);
    }

    #[test]
    fn undefined_variables_are_lenient_and_syntax_errors_are_typed() {
        let t = ChatTemplate::new("{% if foo %}x{% endif %}{{ bar }}ok", None, None).unwrap();
        assert_eq!(t.render(&[], false).unwrap(), "ok");
        assert!(matches!(ChatTemplate::new("{% if %}", None, None), Err(TextError::Template { .. })));
    }

    fn parts_conversation() -> TemplateValue {
        let part = |t: &str| {
            TemplateValue::map(vec![
                ("type".into(), TemplateValue::string("text")),
                ("text".into(), TemplateValue::string(t)),
            ])
        };
        TemplateValue::list(vec![TemplateValue::map(vec![
            ("role".into(), TemplateValue::string("user")),
            ("content".into(), TemplateValue::list(vec![part("Hi"), part("there")])),
        ])])
    }

    #[test]
    fn templates_that_iterate_content_are_told_apart() {
        assert!(iterates_content("{% for item in message['content'] %}"));
        assert!(iterates_content("{%- for p in m.content -%}"));
        assert!(iterates_content("{% for c in msg[\"content\"] | selectattr('type') %}"));
        assert!(!iterates_content("{{ message['content'] | trim }}"));
        assert!(!iterates_content("{% if message.content is string %}{% set content = message.content %}{% endif %}"));
        assert!(!iterates_content("{% for m in messages %}{{ m.content }}{% endfor %}"));
    }

    #[test]
    fn content_parts_are_joined_for_templates_that_read_strings() {
        let plain = ChatTemplate::new("{% for m in messages %}[{{ m.content }}]{% endfor %}", None, None).unwrap();
        let opts = ChatRenderOptions::default();
        assert_eq!(plain.render_conversation(&parts_conversation(), &opts).unwrap(), "[Hi\nthere]");
        let iterating = ChatTemplate::new(
            "{% for message in messages %}{% for p in message['content'] %}<{{ p.text }}>{% endfor %}{% endfor %}",
            None,
            None,
        )
        .unwrap();
        assert_eq!(iterating.render_conversation(&parts_conversation(), &opts).unwrap(), "<Hi><there>");
        let image = TemplateValue::from_json(r#"[{"role": "user", "content": [{"type": "image_url"}]}]"#).unwrap();
        let err = plain.render_conversation(&image, &opts).unwrap_err().to_string();
        assert!(err.contains("image_url"), "{err}");
    }

    #[test]
    fn continue_final_message_cuts_after_the_last_message() {
        let t = ChatTemplate::new("{% for m in messages %}<{{ m.role }}>{{ m.content }}</s>{% endfor %}", None, None)
            .unwrap();
        let conv = TemplateValue::from_json(
            r#"[{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello, I am "}]"#,
        )
        .unwrap();
        let opts = ChatRenderOptions { continue_final_message: true, ..ChatRenderOptions::default() };
        assert_eq!(t.render_conversation(&conv, &opts).unwrap(), "<user>Hi</s><assistant>Hello, I am");
        let both = ChatRenderOptions { add_generation_prompt: true, ..opts };
        assert!(t.render_conversation(&conv, &both).is_err());
    }
}
