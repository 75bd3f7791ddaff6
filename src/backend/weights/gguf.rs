//! GGUF files: metadata and (quantized) tensors through candle's reader.

use std::collections::HashMap;
use std::fs::File;
use std::io::{BufReader, Read, Seek, SeekFrom};
use std::path::{Path, PathBuf};
use std::sync::Arc;

use candle_core::quantized::gguf_file::{Content, Value};
use candle_core::quantized::{GgmlDType, QMatMul, QTensor};
use candle_core::{DType, Device, Tensor};

use super::{convert, WeightSource};
use crate::backend::decoder::layers::Embedding;
use crate::backend::error::{CandleContext, CandleError, Result};

/// The ggml type names, by id, of every type a GGUF file may hold (for error messages).
fn ggml_type_name(id: u32) -> String {
    const NAMES: [&str; 40] = [
        "F32",
        "F16",
        "Q4_0",
        "Q4_1",
        "Q4_2",
        "Q4_3",
        "Q5_0",
        "Q5_1",
        "Q8_0",
        "Q8_1",
        "Q2_K",
        "Q3_K",
        "Q4_K",
        "Q5_K",
        "Q6_K",
        "Q8_K",
        "IQ2_XXS",
        "IQ2_XS",
        "IQ3_XXS",
        "IQ1_S",
        "IQ4_NL",
        "IQ3_S",
        "IQ2_S",
        "IQ4_XS",
        "I8",
        "I16",
        "I32",
        "I64",
        "F64",
        "IQ1_M",
        "BF16",
        "Q4_0_4_4",
        "Q4_0_4_8",
        "Q4_0_8_8",
        "TQ1_0",
        "TQ2_0",
        "IQ4_NL_4_4",
        "IQ4_NL_4_8",
        "IQ4_NL_8_8",
        "MXFP4",
    ];
    NAMES.get(id as usize).map(|s| s.to_string()).unwrap_or_else(|| format!("unknown type {id}"))
}

/// Whether candle can run a ggml type id.
fn candle_runs(id: u32) -> bool {
    matches!(id, 0..=3 | 6..=15 | 30)
}

/// Walks the header only to find each tensor's name and raw type id, so a type candle cannot
/// run is reported with the tensor's name (candle's reader reports only the number).
/// Lengths are bounded by the file size before anything is read or allocated.
fn scan_tensor_types<R: Read + Seek>(r: &mut R, file_size: u64) -> std::io::Result<Vec<(String, u32)>> {
    fn u32_<R: Read>(r: &mut R) -> std::io::Result<u32> {
        let mut b = [0u8; 4];
        r.read_exact(&mut b)?;
        Ok(u32::from_le_bytes(b))
    }
    fn u64_<R: Read>(r: &mut R) -> std::io::Result<u64> {
        let mut b = [0u8; 8];
        r.read_exact(&mut b)?;
        Ok(u64::from_le_bytes(b))
    }
    let bad = |m: String| std::io::Error::new(std::io::ErrorKind::InvalidData, m);
    let _magic = u32_(r)?;
    let version = u32_(r)?;
    let len = |r: &mut R| -> std::io::Result<u64> {
        if version == 1 {
            u32_(r).map(u64::from)
        } else {
            u64_(r)
        }
    };
    let skip = |r: &mut R, n: u64| -> std::io::Result<()> {
        let pos = r.stream_position()?;
        if n > file_size.saturating_sub(pos) {
            return Err(bad(format!("a length of {n} bytes at offset {pos} runs past the end of the file")));
        }
        r.seek(SeekFrom::Current(n as i64)).map(|_| ())
    };
    fn skip_value<R: Read + Seek>(
        r: &mut R,
        ty: u32,
        depth: usize,
        len: &dyn Fn(&mut R) -> std::io::Result<u64>,
        skip: &dyn Fn(&mut R, u64) -> std::io::Result<()>,
    ) -> std::io::Result<()> {
        let fixed = |t: u32| match t {
            0 | 1 | 7 => Some(1),
            2 | 3 => Some(2),
            4..=6 => Some(4),
            10..=12 => Some(8),
            _ => None,
        };
        match ty {
            8 => {
                let n = len(r)?;
                skip(r, n)
            }
            9 if depth < 64 => {
                let mut b = [0u8; 4];
                r.read_exact(&mut b)?;
                let et = u32::from_le_bytes(b);
                let n = len(r)?;
                if let Some(size) = fixed(et) {
                    return skip(r, n.saturating_mul(size));
                }
                for _ in 0..n {
                    skip_value(r, et, depth + 1, len, skip)?;
                }
                Ok(())
            }
            t => match fixed(t) {
                Some(size) => skip(r, size),
                None => Err(std::io::Error::new(std::io::ErrorKind::InvalidData, format!("metadata value type {t}"))),
            },
        }
    }
    let n_tensors = len(r)?;
    let n_kv = len(r)?;
    for _ in 0..n_kv {
        let key_len = len(r)?;
        skip(r, key_len)?;
        let ty = u32_(r)?;
        skip_value(r, ty, 0, &len, &skip)?;
    }
    let mut out = Vec::new();
    for _ in 0..n_tensors {
        let name_len = len(r)?;
        let pos = r.stream_position()?;
        if name_len > file_size.saturating_sub(pos) {
            return Err(bad(format!("tensor name of {name_len} bytes runs past the end of the file")));
        }
        let mut name = vec![0u8; name_len as usize];
        r.read_exact(&mut name)?;
        let n_dims = u32_(r)?;
        if n_dims > 4 {
            return Err(bad(format!("tensor has {n_dims} dimensions")));
        }
        skip(r, n_dims as u64 * if version == 1 { 4 } else { 8 })?;
        let ty = u32_(r)?;
        let _offset = u64_(r)?;
        out.push((String::from_utf8_lossy(&name).into_owned(), ty));
    }
    Ok(out)
}

/// A candle error's message without the backtrace candle appends when `RUST_BACKTRACE` is set
/// (a reason shown to users, not a crash report).
fn reason_of(e: &candle_core::Error) -> String {
    match e {
        candle_core::Error::WithBacktrace { inner, .. } => reason_of(inner),
        e => e.to_string(),
    }
}

/// Reads a GGUF file's header, refusing bad magic, truncation, absurd counts and tensor types candle cannot run.
pub fn read_content(path: &Path) -> Result<Content> {
    let malformed =
        |reason: String| CandleError::Malformed { what: "GGUF file", path: path.display().to_string(), reason };
    let file = File::open(path).map_err(|source| CandleError::Io { path: path.display().to_string(), source })?;
    let file_size = file.metadata().map(|m| m.len()).unwrap_or(0);
    let mut r = BufReader::new(file);
    let content = Content::read(&mut r).map_err(|e| malformed(reason_of(&e)));
    let content = match content {
        Ok(c) => c,
        Err(e) => {
            // A type candle does not know makes its reader fail; name the tensor if that is why.
            r.seek(SeekFrom::Start(0)).map_err(|e| malformed(e.to_string()))?;
            if let Ok(types) = scan_tensor_types(&mut r, file_size) {
                if let Some((name, ty)) = types.into_iter().find(|(_, ty)| !candle_runs(*ty)) {
                    return Err(CandleError::UnsupportedTensorType { tensor: name, dtype: ggml_type_name(ty) });
                }
            }
            return Err(e);
        }
    };
    // Every tensor's data must lie inside the file: a truncated file is refused up front.
    for (name, info) in &content.tensor_infos {
        // Multiplied with overflow checks: absurd dimensions must not wrap to a small count.
        let elems = info.shape.dims().iter().try_fold(1u64, |n, &d| n.checked_mul(d as u64)).unwrap_or(u64::MAX);
        let block = info.ggml_dtype.block_size() as u64;
        let bytes = (elems / block).saturating_mul(info.ggml_dtype.type_size() as u64);
        let end = content.tensor_data_offset.saturating_add(info.offset).saturating_add(bytes);
        if elems % block != 0 || end > file_size {
            return Err(malformed(format!(
                "tensor `{name}` ({:?}, shape {:?}) needs bytes up to offset {end}, but the file has {file_size}",
                info.ggml_dtype,
                info.shape.dims()
            )));
        }
    }
    Ok(content)
}

/// A GGUF file's tensors: kept quantized for matmuls, or de-quantized at load to a float dtype.
pub struct GgufWeights {
    path: PathBuf,
    content: Content,
    dequantize: bool,
}

impl GgufWeights {
    /// Opens and validates `path`; `dequantize` expands every weight to the model dtype at load.
    pub fn open(path: &Path, dequantize: bool) -> Result<Self> {
        Ok(Self { path: path.to_owned(), content: read_content(path)?, dequantize })
    }

    /// The file's metadata.
    pub fn metadata(&self) -> &HashMap<String, Value> {
        &self.content.metadata
    }

    /// The dominant quantization of the matmul weights (e.g. `Q4_K`), for display.
    pub fn quantization(&self) -> String {
        let mut counts: HashMap<GgmlDType, usize> = HashMap::new();
        for info in self.content.tensor_infos.values() {
            if info.shape.rank() == 2 {
                *counts.entry(info.ggml_dtype).or_default() += 1;
            }
        }
        counts.into_iter().max_by_key(|(_, n)| *n).map(|(d, _)| format!("{d:?}")).unwrap_or_default()
    }

    fn qtensor(&self, name: &str, device: &Device) -> Result<QTensor> {
        if !self.content.tensor_infos.contains_key(name) {
            return Err(CandleError::MissingTensor { name: name.to_owned() });
        }
        let file = File::open(&self.path)
            .map_err(|source| CandleError::Io { path: self.path.display().to_string(), source })?;
        let mut r = BufReader::new(file);
        self.content.tensor(&mut r, name, device).map_err(|e| CandleError::Malformed {
            what: "GGUF file",
            path: self.path.display().to_string(),
            reason: format!("reading tensor `{name}`: {}", reason_of(&e)),
        })
    }
}

impl WeightSource for GgufWeights {
    fn shape(&self, name: &str) -> Option<Vec<usize>> {
        self.content.tensor_infos.get(name).map(|i| i.shape.dims().to_vec())
    }

    fn dense(&self, name: &str, dtype: DType, device: &Device) -> Result<Tensor> {
        let t = self.qtensor(name, device)?.dequantize(device).ctx(|| format!("de-quantizing `{name}`"))?;
        convert(t, name, dtype)
    }

    fn matmul(&self, name: &str, dtype: DType, device: &Device) -> Result<QMatMul> {
        if self.dequantize {
            return Ok(QMatMul::Tensor(self.dense(name, dtype, device)?));
        }
        let q = super::requant::fast_encoding(self.qtensor(name, device)?, device)
            .ctx(|| format!("re-encoding `{name}`"))?;
        QMatMul::from_arc(Arc::new(q)).ctx(|| format!("preparing matmul weight `{name}`"))
    }

    fn embedding(&self, name: &str, dtype: DType, device: &Device) -> Result<Embedding> {
        let q = self.qtensor(name, device)?;
        if self.dequantize || matches!(q.dtype(), GgmlDType::F32) {
            let t = q.dequantize(device).ctx(|| format!("de-quantizing `{name}`"))?;
            return Ok(Embedding::Dense(convert(t, name, dtype)?));
        }
        Ok(Embedding::Quantized(Arc::new(q)))
    }
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
        v.to_u64()
            .or_else(|_| v.to_u32().map(u64::from))
            .or_else(|_| v.to_i32().map(|x| x.max(0) as u64))
            .or_else(|_| v.to_i64().map(|x| x.max(0) as u64))
            .or_else(|_| v.to_u16().map(u64::from))
            .or_else(|_| v.to_u8().map(u64::from))
            .map(|x| x as usize)
            .map_err(|_| self.wrong(key, v))
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

    fn missing(&self, key: &str) -> CandleError {
        CandleError::MissingMetadata { key: key.to_owned() }
    }

    fn wrong(&self, key: &str, v: &Value) -> CandleError {
        CandleError::UnsupportedConfig {
            what: format!("GGUF metadata `{key}` has unexpected type {:?}", v.value_type()),
        }
    }
}
