//! Tool calls as models write them, and back: each chat format's way of calling a function,
//! parsed into OpenAI's `tool_calls`, and the grammar that makes a model call one (for
//! `tool_choice` "required" or a named function), so that its arguments always parse and
//! validate against the function's parameter schema.

use serde_json::{json, Value};

/// How a model writes tool calls.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ToolCallFormat {
    /// Hermes / Qwen 2.5+: `<tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call>`, one
    /// block per call.
    Hermes,
    /// Mistral: `[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]`.
    Mistral,
    /// Llama 3.1+: a JSON object `{"name": ..., "parameters": {...}}` as the whole message
    /// (after an optional `<|python_tag|>`).
    Llama3,
}

/// One call the model made: a function's name and its arguments (a JSON value).
#[derive(Debug, Clone, PartialEq)]
pub struct ToolCall {
    /// The function called.
    pub name: String,
    /// Its arguments, as the model wrote them (an object for a well-formed call).
    pub arguments: Value,
}

/// What `tool_choice` asks for.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ToolChoice {
    /// The model decides whether to call (OpenAI's default with tools).
    Auto,
    /// No call: the output is text.
    None,
    /// At least one call, of any of the tools.
    Required,
    /// A call of this function.
    Function(String),
}

impl ToolCallFormat {
    /// The format a `name` spells (`hermes`, `mistral`, `llama3`).
    pub fn from_name(name: &str) -> Option<Self> {
        match name.to_ascii_lowercase().as_str() {
            "hermes" | "qwen" => Some(Self::Hermes),
            "mistral" => Some(Self::Mistral),
            "llama3" | "llama3_json" | "llama" => Some(Self::Llama3),
            _ => None,
        }
    }

    /// The format's name, as `from_name` reads it.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Hermes => "hermes",
            Self::Mistral => "mistral",
            Self::Llama3 => "llama3",
        }
    }

    /// The format a chat template writes calls in, from the markup it uses (Hermes when it
    /// shows none: the most common among open models).
    pub fn detect(template: &str) -> Self {
        if template.contains("[TOOL_CALLS]") {
            Self::Mistral
        } else if template.contains("<tool_call>") {
            Self::Hermes
        } else if template.contains("<|python_tag|>") || template.contains("ipython") {
            Self::Llama3
        } else {
            Self::Hermes
        }
    }

    /// The key a call's arguments sit under.
    fn arguments_key(self) -> &'static str {
        match self {
            Self::Llama3 => "parameters",
            _ => "arguments",
        }
    }

    /// Splits generated text (decoded with its special tokens) into the message's text and the
    /// calls it makes. A block that does not parse stays in the text.
    pub fn parse(self, text: &str) -> (String, Vec<ToolCall>) {
        let call_of = |v: &Value| -> Option<ToolCall> {
            let name = v.get("name")?.as_str()?.to_owned();
            let mut arguments =
                v.get(self.arguments_key()).or_else(|| v.get("arguments")).cloned().unwrap_or(json!({}));
            // Arguments written as a JSON string (OpenAI's wire form, copied from a history) are
            // the object inside it.
            if let Some(inner) = arguments.as_str().and_then(|s| serde_json::from_str::<Value>(s).ok()) {
                if inner.is_object() {
                    arguments = inner;
                }
            }
            Some(ToolCall { name, arguments })
        };
        match self {
            Self::Hermes => {
                let (mut content, mut calls, mut rest) = (String::new(), Vec::new(), text);
                while let Some(start) = rest.find("<tool_call>") {
                    let body = &rest[start + "<tool_call>".len()..];
                    let (inner, after) = match body.find("</tool_call>") {
                        Some(end) => (&body[..end], &body[end + "</tool_call>".len()..]),
                        None => (body, ""),
                    };
                    match serde_json::from_str::<Value>(inner.trim()).ok().as_ref().and_then(call_of) {
                        Some(call) => {
                            content.push_str(&rest[..start]);
                            calls.push(call);
                        }
                        // A block cut off at the end (the token budget ran out) is no text either.
                        None if after.is_empty() && !body.contains("</tool_call>") => content.push_str(&rest[..start]),
                        None => content.push_str(&rest[..start + "<tool_call>".len() + inner.len()]),
                    }
                    rest = after;
                }
                content.push_str(rest);
                (content.trim().to_owned(), calls)
            }
            Self::Mistral => match text.find("[TOOL_CALLS]") {
                Some(at) => {
                    let json_text = text[at + "[TOOL_CALLS]".len()..].trim();
                    let mut stream = serde_json::Deserializer::from_str(json_text).into_iter::<Value>();
                    match stream.next() {
                        Some(Ok(Value::Array(items))) => {
                            let calls: Vec<ToolCall> = items.iter().filter_map(call_of).collect();
                            (text[..at].trim().to_owned(), calls)
                        }
                        Some(Ok(v)) => match call_of(&v) {
                            Some(call) => (text[..at].trim().to_owned(), vec![call]),
                            None => (text.trim().to_owned(), Vec::new()),
                        },
                        _ => (text.trim().to_owned(), Vec::new()),
                    }
                }
                None => (text.trim().to_owned(), Vec::new()),
            },
            Self::Llama3 => {
                let body = text.trim().trim_start_matches("<|python_tag|>").trim();
                let body = body.strip_suffix("<|eom_id|>").unwrap_or(body).trim();
                match serde_json::from_str::<Value>(body).ok().as_ref().and_then(call_of) {
                    Some(call) => (String::new(), vec![call]),
                    None => (text.trim().to_owned(), Vec::new()),
                }
            }
        }
    }

    /// A Lark grammar (llguidance's dialect) for output that calls `tools` (OpenAI tool
    /// objects) as `choice` asks (`Required` or `Function`; the others need none), one call or
    /// (`parallel`) several. `is_token` says whether a markup string (`<tool_call>`) is one
    /// control token of the vocabulary, written bare in the grammar, or text, quoted.
    pub fn grammar(
        self,
        tools: &[Value],
        choice: &ToolChoice,
        parallel: bool,
        is_token: impl Fn(&str) -> bool,
    ) -> Result<Option<String>, String> {
        let wanted: Vec<&Value> = match choice {
            ToolChoice::Auto | ToolChoice::None => return Ok(None),
            ToolChoice::Required => tools.iter().collect(),
            ToolChoice::Function(name) => {
                let found: Vec<&Value> = tools.iter().filter(|t| function(t).0 == Some(name.as_str())).collect();
                if found.is_empty() {
                    return Err(format!("tool_choice names the function {name:?}, which is not among the tools"));
                }
                found
            }
        };
        if wanted.is_empty() {
            return Err("tool_choice \"required\" needs at least one tool".into());
        }
        let schemas = wanted
            .iter()
            .map(|t| {
                let (name, parameters) = function(t);
                let name = name.ok_or("every tool needs function.name")?;
                let parameters = parameters.cloned().unwrap_or(json!({"type": "object"}));
                Ok(json!({
                    "type": "object",
                    "properties": {"name": {"const": name}, self.arguments_key(): parameters},
                    "required": ["name", self.arguments_key()],
                    "additionalProperties": false,
                }))
            })
            .collect::<Result<Vec<Value>, String>>()?;
        let one = if schemas.len() == 1 { schemas[0].clone() } else { json!({"anyOf": schemas}) };
        let mark = |m: &str| if is_token(m) { m.to_owned() } else { serde_json::to_string(m).unwrap_or_default() };
        let repeat = if parallel { "+" } else { "" };
        Ok(Some(match self {
            Self::Hermes => format!(
                "start: call{repeat}\ncall: {} \"\\n\" %json {one} \"\\n\" {} \"\\n\"?\n",
                mark("<tool_call>"),
                mark("</tool_call>")
            ),
            Self::Mistral => {
                let calls = if parallel {
                    json!({"type": "array", "items": one, "minItems": 1})
                } else {
                    json!({"type": "array", "items": one, "minItems": 1, "maxItems": 1})
                };
                format!("start: {} %json {calls}\n", mark("[TOOL_CALLS]"))
            }
            // Llama 3 writes one call a message.
            Self::Llama3 => format!("start: %json {one}\n"),
        }))
    }
}

/// A tool object's function name and parameter schema (OpenAI's `{"type": "function",
/// "function": {"name", "parameters"}}`, or the function object itself).
fn function(tool: &Value) -> (Option<&str>, Option<&Value>) {
    let f = tool.get("function").unwrap_or(tool);
    (f.get("name").and_then(Value::as_str), f.get("parameters"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_format_parses_its_calls_and_keeps_the_text() {
        let (text, calls) = ToolCallFormat::Hermes.parse(
            "Let me look.\n<tool_call>\n{\"name\": \"weather\", \"arguments\": {\"city\": \"Paris\"}}\n</tool_call>\n<tool_call>{\"name\": \"time\", \"arguments\": {}}</tool_call>",
        );
        assert_eq!(text, "Let me look.");
        assert_eq!(calls.len(), 2);
        assert_eq!(calls[0], ToolCall { name: "weather".into(), arguments: json!({"city": "Paris"}) });
        let (text, calls) = ToolCallFormat::Hermes.parse("<tool_call>not json</tool_call> done");
        assert!(calls.is_empty() && text.contains("not json"));
        let (_, calls) = ToolCallFormat::Mistral
            .parse("[TOOL_CALLS][{\"name\": \"f\", \"arguments\": {\"x\": 1}}, {\"name\": \"g\", \"arguments\": {}}]");
        assert_eq!(calls.iter().map(|c| c.name.as_str()).collect::<Vec<_>>(), ["f", "g"]);
        let (text, calls) = ToolCallFormat::Llama3.parse("<|python_tag|>{\"name\": \"f\", \"parameters\": {\"x\": 2}}");
        assert_eq!((text.as_str(), calls[0].arguments.clone()), ("", json!({"x": 2})));
        assert!(ToolCallFormat::Llama3.parse("Just text.").1.is_empty());
    }

    #[test]
    fn the_format_is_detected_from_the_template() {
        assert_eq!(ToolCallFormat::detect("{{ '<tool_call>' }}"), ToolCallFormat::Hermes);
        assert_eq!(ToolCallFormat::detect("[TOOL_CALLS] {{ x }}"), ToolCallFormat::Mistral);
        assert_eq!(ToolCallFormat::detect("<|python_tag|>"), ToolCallFormat::Llama3);
    }

    #[test]
    fn grammars_name_the_wanted_function_and_refuse_unknown_ones() {
        let tools = [json!({"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}})];
        let g = ToolCallFormat::Hermes.grammar(&tools, &ToolChoice::Required, false, |_| true).unwrap().unwrap();
        assert!(g.starts_with("start: call\ncall: <tool_call> ") && g.contains("\"const\":\"f\""), "{g}");
        let g = ToolCallFormat::Hermes.grammar(&tools, &ToolChoice::Required, true, |_| false).unwrap().unwrap();
        assert!(g.contains("call+") && g.contains("\"<tool_call>\""), "{g}");
        assert!(ToolCallFormat::Hermes.grammar(&tools, &ToolChoice::Function("g".into()), false, |_| true).is_err());
        assert_eq!(ToolCallFormat::Hermes.grammar(&tools, &ToolChoice::Auto, false, |_| true), Ok(None));
    }
}
