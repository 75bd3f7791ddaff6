//! JSON the way Hugging Face chat templates see it: a byte-exact Python `json.dumps`.
//!
//! Two directions: `dumps` writes a template value exactly as Python's `json.dumps` does
//! (transformers' `tojson` filter), because tool schemas rendered into prompts must match
//! byte for byte; `OrderedValue` reads JSON into template values keeping object key order,
//! because Python dicts keep insertion order and templates iterate them.

use std::fmt::{self, Write as _};

use minijinja::value::{Value, ValueKind};
use minijinja::{Error, ErrorKind};
use serde::de::{Deserialize, Deserializer, MapAccess, SeqAccess, Visitor};

/// Options of Python's `json.dumps` that transformers' `tojson` forwards.
#[derive(Debug, Clone, Default)]
pub(crate) struct DumpOptions {
    pub ensure_ascii: bool,
    /// `None`: one line; `Some(s)`: newline plus `s` per nesting level.
    pub indent: Option<String>,
    /// `(item_separator, key_separator)`; Python's defaults depend on `indent`.
    pub separators: Option<(String, String)>,
    pub sort_keys: bool,
}

fn serialization_error(msg: impl Into<String>) -> Error {
    Error::new(ErrorKind::InvalidOperation, msg.into())
}

/// `repr(float)` as Python prints it (shortest round-trip digits, `e+XX` exponents).
pub(crate) fn py_float_repr(x: f64) -> String {
    if x.is_nan() {
        return "NaN".into();
    }
    if x.is_infinite() {
        return if x > 0.0 { "Infinity".into() } else { "-Infinity".into() };
    }
    if x == 0.0 {
        return if x.is_sign_negative() { "-0.0".into() } else { "0.0".into() };
    }
    // Rust's `{:e}` gives the shortest round-trip digits: "-1.2345e6", "5e-7".
    let sci = format!("{x:e}");
    let (mantissa, exp) = sci.split_once('e').expect("`{:e}` always has an exponent");
    let exp: i32 = exp.parse().expect("`{:e}` exponent is an integer");
    let (sign, mantissa) = match mantissa.strip_prefix('-') {
        Some(m) => ("-", m),
        None => ("", mantissa),
    };
    let digits: String = mantissa.chars().filter(|c| *c != '.').collect();
    if (-4..16).contains(&exp) {
        // Fixed notation, as Python's repr uses for 1e-4 <= |x| < 1e16.
        let point = exp + 1; // digits before the decimal point
        let body = if point <= 0 {
            format!("0.{}{}", "0".repeat((-point) as usize), digits)
        } else if point as usize >= digits.len() {
            format!("{}{}.0", digits, "0".repeat(point as usize - digits.len()))
        } else {
            let (int, frac) = digits.split_at(point as usize);
            format!("{int}.{frac}")
        };
        format!("{sign}{body}")
    } else {
        let (first, rest) = digits.split_at(1);
        let frac = if rest.is_empty() { String::new() } else { format!(".{rest}") };
        let exp_sign = if exp < 0 { '-' } else { '+' };
        format!("{sign}{first}{frac}e{exp_sign}{:02}", exp.abs())
    }
}

fn write_string(out: &mut String, s: &str, ensure_ascii: bool) {
    out.push('"');
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            '\u{08}' => out.push_str("\\b"),
            '\u{0c}' => out.push_str("\\f"),
            c if (c as u32) < 0x20 => {
                let _ = write!(out, "\\u{:04x}", c as u32);
            }
            c if ensure_ascii && (c as u32) > 0x7e => {
                let mut buf = [0u16; 2];
                for unit in c.encode_utf16(&mut buf) {
                    let _ = write!(out, "\\u{unit:04x}");
                }
            }
            c => out.push(c),
        }
    }
    out.push('"');
}

/// A dict key as Python's encoder coerces it.
fn key_string(key: &Value) -> Result<String, Error> {
    match key.kind() {
        ValueKind::String => Ok(key.as_str().unwrap_or_default().to_string()),
        ValueKind::Bool => Ok(if key.is_true() { "true" } else { "false" }.into()),
        ValueKind::None => Ok("null".into()),
        ValueKind::Number if key.is_integer() => Ok(key.to_string()),
        ValueKind::Number => Ok(py_float_repr(f64::try_from(key.clone())?)),
        other => Err(serialization_error(format!("keys must be str, int, float, bool or None, not {other}"))),
    }
}

struct Dumper<'o> {
    opts: &'o DumpOptions,
    item_sep: String,
    key_sep: String,
    out: String,
}

impl Dumper<'_> {
    fn newline(&mut self, level: usize) {
        if let Some(indent) = &self.opts.indent {
            self.out.push('\n');
            for _ in 0..level {
                self.out.push_str(indent);
            }
        }
    }

    fn write(&mut self, value: &Value, level: usize) -> Result<(), Error> {
        match value.kind() {
            ValueKind::Undefined => {
                return Err(serialization_error("Object of type Undefined is not JSON serializable"))
            }
            ValueKind::None => self.out.push_str("null"),
            ValueKind::Bool => self.out.push_str(if value.is_true() { "true" } else { "false" }),
            ValueKind::Number if value.is_integer() => {
                let _ = write!(self.out, "{value}");
            }
            ValueKind::Number => self.out.push_str(&py_float_repr(f64::try_from(value.clone())?)),
            ValueKind::String => {
                write_string(&mut self.out, value.as_str().unwrap_or_default(), self.opts.ensure_ascii)
            }
            ValueKind::Map => {
                let mut entries = Vec::new();
                for key in value.try_iter()? {
                    let item = value.get_item(&key)?;
                    entries.push((key_string(&key)?, item));
                }
                if self.opts.sort_keys {
                    entries.sort_by(|a, b| a.0.cmp(&b.0));
                }
                if entries.is_empty() {
                    self.out.push_str("{}");
                    return Ok(());
                }
                self.out.push('{');
                for (i, (key, item)) in entries.iter().enumerate() {
                    if i > 0 {
                        let sep = self.item_sep.clone();
                        self.out.push_str(&sep);
                    }
                    self.newline(level + 1);
                    write_string(&mut self.out, key, self.opts.ensure_ascii);
                    let sep = self.key_sep.clone();
                    self.out.push_str(&sep);
                    self.write(item, level + 1)?;
                }
                self.newline(level);
                self.out.push('}');
            }
            ValueKind::Seq | ValueKind::Iterable => {
                let items: Vec<Value> = value.try_iter()?.collect();
                if items.is_empty() {
                    self.out.push_str("[]");
                    return Ok(());
                }
                self.out.push('[');
                for (i, item) in items.iter().enumerate() {
                    if i > 0 {
                        let sep = self.item_sep.clone();
                        self.out.push_str(&sep);
                    }
                    self.newline(level + 1);
                    self.write(item, level + 1)?;
                }
                self.newline(level);
                self.out.push(']');
            }
            other => return Err(serialization_error(format!("Object of type {other} is not JSON serializable"))),
        }
        Ok(())
    }
}

/// `json.dumps(value, ...)` with Python's exact spacing and escaping.
pub(crate) fn dumps(value: &Value, opts: &DumpOptions) -> Result<String, Error> {
    let (item_sep, key_sep) = match &opts.separators {
        Some((item, key)) => (item.clone(), key.clone()),
        None if opts.indent.is_some() => (",".into(), ": ".into()),
        None => (", ".into(), ": ".into()),
    };
    let mut dumper = Dumper { opts, item_sep, key_sep, out: String::new() };
    dumper.write(value, 0)?;
    Ok(dumper.out)
}

/// A template value deserialized from JSON with object key order kept.
pub(crate) struct OrderedValue(pub Value);

impl<'de> Deserialize<'de> for OrderedValue {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        deserializer.deserialize_any(OrderedVisitor).map(OrderedValue)
    }
}

struct OrderedVisitor;

impl<'de> Visitor<'de> for OrderedVisitor {
    type Value = Value;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("any JSON value")
    }
    fn visit_bool<E>(self, v: bool) -> Result<Value, E> {
        Ok(Value::from(v))
    }
    fn visit_i64<E>(self, v: i64) -> Result<Value, E> {
        Ok(Value::from(v))
    }
    fn visit_u64<E>(self, v: u64) -> Result<Value, E> {
        Ok(Value::from(v))
    }
    fn visit_f64<E>(self, v: f64) -> Result<Value, E> {
        Ok(Value::from(v))
    }
    fn visit_str<E>(self, v: &str) -> Result<Value, E> {
        Ok(Value::from(v))
    }
    fn visit_string<E>(self, v: String) -> Result<Value, E> {
        Ok(Value::from(v))
    }
    fn visit_unit<E>(self) -> Result<Value, E> {
        Ok(Value::from(()))
    }
    fn visit_none<E>(self) -> Result<Value, E> {
        Ok(Value::from(()))
    }
    fn visit_some<D: Deserializer<'de>>(self, d: D) -> Result<Value, D::Error> {
        OrderedValue::deserialize(d).map(|v| v.0)
    }
    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Value, A::Error> {
        let mut items = Vec::new();
        while let Some(OrderedValue(v)) = seq.next_element()? {
            items.push(v);
        }
        Ok(Value::from(items))
    }
    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Value, A::Error> {
        let mut entries: Vec<(Value, Value)> = Vec::new();
        while let Some((k, OrderedValue(v))) = map.next_entry::<String, OrderedValue>()? {
            entries.push((Value::from(k), v));
        }
        Ok(Value::from_pairs(entries))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(json: &str) -> Value {
        serde_json::from_str::<OrderedValue>(json).unwrap().0
    }

    #[test]
    fn float_repr_matches_python() {
        for (x, want) in [
            (1.0, "1.0"),
            (0.1, "0.1"),
            (1e16, "1e+16"),
            (1.5e-5, "1.5e-05"),
            (0.0001, "0.0001"),
            (123456789.125, "123456789.125"),
            (-2.5, "-2.5"),
            (1e15, "1000000000000000.0"),
            (1.7976931348623157e308, "1.7976931348623157e+308"),
        ] {
            assert_eq!(py_float_repr(x), want, "{x}");
        }
    }

    #[test]
    fn dumps_matches_python_defaults() {
        let v = parse(r#"{"b": [1, 2.5, "é\n\"x\""], "a": null, "c": {}, "d": [], "t": true}"#);
        // json.dumps(v, ensure_ascii=False)
        assert_eq!(
            dumps(&v, &DumpOptions::default()).unwrap(),
            r#"{"b": [1, 2.5, "é\n\"x\""], "a": null, "c": {}, "d": [], "t": true}"#
        );
        // json.dumps(v, ensure_ascii=False, indent=2)
        let opts = DumpOptions { indent: Some("  ".into()), ..Default::default() };
        assert_eq!(
            dumps(&v, &opts).unwrap(),
            "{\n  \"b\": [\n    1,\n    2.5,\n    \"é\\n\\\"x\\\"\"\n  ],\n  \"a\": null,\n  \"c\": {},\n  \"d\": [],\n  \"t\": true\n}"
        );
        // json.dumps(v, ensure_ascii=True, sort_keys=True, separators=(",", ":"))
        let opts = DumpOptions {
            ensure_ascii: true,
            sort_keys: true,
            separators: Some((",".into(), ":".into())),
            ..Default::default()
        };
        assert_eq!(dumps(&parse(r#"{"z": "😀é", "a": 1}"#), &opts).unwrap(), r#"{"a":1,"z":"\ud83d\ude00\u00e9"}"#);
    }
}
