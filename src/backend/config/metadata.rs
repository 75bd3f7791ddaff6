//! Typed access to a GGUF file's metadata, the one reader of it for the architecture's config and
//! the weights (the tokenizer's vocabulary keys are read by `text::gguf`, over the same map).

use std::collections::HashMap;

use candle_core::quantized::gguf_file::Value;

use crate::backend::error::{CandleError, Result};

/// Any integer value, widened so that no width or sign is lost.
pub(crate) fn integer(v: &Value) -> Option<i128> {
    Some(match v {
        Value::U8(x) => (*x).into(),
        Value::I8(x) => (*x).into(),
        Value::U16(x) => (*x).into(),
        Value::I16(x) => (*x).into(),
        Value::U32(x) => (*x).into(),
        Value::I32(x) => (*x).into(),
        Value::U64(x) => (*x).into(),
        Value::I64(x) => (*x).into(),
        _ => return None,
    })
}

/// Typed access to GGUF metadata, with the key named in every error.
pub struct Metadata<'a> {
    map: &'a HashMap<String, Value>,
}

impl<'a> Metadata<'a> {
    /// Wraps a metadata map.
    pub fn new(map: &'a HashMap<String, Value>) -> Self {
        Self { map }
    }

    /// Whether `key` is present.
    pub fn has(&self, key: &str) -> bool {
        self.map.contains_key(key)
    }

    /// A string value.
    pub fn string(&self, key: &str) -> Result<String> {
        match self.map.get(key) {
            Some(Value::String(s)) => Ok(s.clone()),
            Some(other) => Err(self.wrong(key, other)),
            None => Err(self.missing(key)),
        }
    }

    /// An unsigned integer value (any integer width; a per-layer array gives its first entry).
    pub fn usize(&self, key: &str) -> Result<usize> {
        let v = self.map.get(key).ok_or_else(|| self.missing(key))?;
        let v = match v {
            Value::Array(a) if !a.is_empty() => &a[0],
            v => v,
        };
        match integer(v) {
            Some(x) if x >= 0 => usize::try_from(x).map_err(|_| self.out_of_range(key, x)),
            // A negative size is not a size: clamping it to 0 would hide the damage.
            Some(x) => Err(self.out_of_range(key, x)),
            None => Err(self.wrong(key, v)),
        }
    }

    /// The length of an array value, if `key` holds one.
    pub fn array_len(&self, key: &str) -> Option<usize> {
        match self.map.get(key) {
            Some(Value::Array(a)) => Some(a.len()),
            _ => None,
        }
    }

    /// A token id; llama.cpp's "none" (-1, or its unsigned wrap) is `None`, any other negative
    /// or wider-than-u32 value is an error (never wrapped or clamped to a real id).
    pub fn token_id(&self, key: &str) -> Result<Option<u32>> {
        let Some(v) = self.map.get(key) else {
            return Ok(None);
        };
        match (v, integer(v)) {
            (Value::U32(u32::MAX) | Value::U64(u64::MAX), _) | (_, Some(-1)) => Ok(None),
            (_, Some(x)) => u32::try_from(x).map(Some).map_err(|_| self.out_of_range(key, x)),
            (_, None) => Err(self.wrong(key, v)),
        }
    }

    /// An optional unsigned integer.
    pub fn opt_usize(&self, key: &str) -> Result<Option<usize>> {
        if self.has(key) {
            self.usize(key).map(Some)
        } else {
            Ok(None)
        }
    }

    /// A float value (f32 or f64).
    pub fn opt_f64(&self, key: &str) -> Result<Option<f64>> {
        match self.map.get(key) {
            None => Ok(None),
            Some(v) => v.to_f32().map(f64::from).or_else(|_| v.to_f64()).map(Some).map_err(|_| self.wrong(key, v)),
        }
    }

    /// A float value that must be present.
    pub fn f64(&self, key: &str) -> Result<f64> {
        self.opt_f64(key)?.ok_or_else(|| self.missing(key))
    }

    /// An optional boolean.
    pub fn opt_bool(&self, key: &str) -> Result<Option<bool>> {
        match self.map.get(key) {
            None => Ok(None),
            Some(Value::Bool(b)) => Ok(Some(*b)),
            Some(other) => Err(self.wrong(key, other)),
        }
    }

    /// An optional array of floats (a per-layer value such as `swiglu_clamp_exp`); a single float
    /// is an array of one.
    pub fn opt_f64_array(&self, key: &str) -> Result<Option<Vec<f64>>> {
        let float = |v: &Value| v.to_f32().map(f64::from).or_else(|_| v.to_f64()).map_err(|_| self.wrong(key, v));
        match self.map.get(key) {
            None => Ok(None),
            Some(Value::Array(items)) => items.iter().map(float).collect::<Result<Vec<f64>>>().map(Some),
            Some(v) => float(v).map(|x| Some(vec![x])),
        }
    }

    /// An optional array of unsigned integers (a single one is an array of one).
    pub fn opt_usize_array(&self, key: &str) -> Result<Option<Vec<usize>>> {
        let one = |v: &Value| match integer(v) {
            Some(x) => usize::try_from(x).map_err(|_| self.out_of_range(key, x)),
            None => Err(self.wrong(key, v)),
        };
        match self.map.get(key) {
            None => Ok(None),
            Some(Value::Array(items)) => items.iter().map(one).collect::<Result<Vec<usize>>>().map(Some),
            Some(v) => one(v).map(|x| Some(vec![x])),
        }
    }

    /// An optional array of booleans (a per-layer flag such as `attention.sliding_window_pattern`).
    pub fn opt_bool_array(&self, key: &str) -> Result<Option<Vec<bool>>> {
        match self.map.get(key) {
            None => Ok(None),
            Some(Value::Array(items)) => items
                .iter()
                .map(|v| match v {
                    Value::Bool(b) => Ok(*b),
                    other => Err(self.wrong(key, other)),
                })
                .collect::<Result<Vec<bool>>>()
                .map(Some),
            Some(other) => Err(self.wrong(key, other)),
        }
    }

    fn out_of_range(&self, key: &str, x: i128) -> CandleError {
        CandleError::UnsupportedConfig { what: format!("GGUF metadata `{key}` = {x} is out of range") }
    }

    fn missing(&self, key: &str) -> CandleError {
        CandleError::MissingMetadata { key: key.to_owned() }
    }

    fn wrong(&self, key: &str, v: &Value) -> CandleError {
        CandleError::UnsupportedConfig {
            what: format!("GGUF metadata `{key}` has unexpected type {:?}", v.value_type()),
        }
    }
}
