//! Rebuilding a `tokenizers::Tokenizer` from the vocabulary a GGUF file carries.
//!
//! A GGUF holds no `tokenizer.json`: only llama.cpp's description of one (tokens, scores,
//! token types, merges, the name of a pre-tokenizer). The reference we must equal token for
//! token is Hugging Face transformers (5.x, `integrations/gguf/gguf_tokenizer_mapping.py`), which
//! hands the vocabulary to its own tokenizer classes (`GemmaTokenizer`, `LlamaTokenizer`,
//! `GPT2Tokenizer`); the pipelines below reproduce those step by step, including the order in
//! which merges are derived. Where transformers has no answer (pre-tokenizers it does not list)
//! we take llama.cpp's split rules or refuse.

use std::cmp::Ordering;

use rayon::prelude::*;
use std::collections::HashMap;

use candle_core::quantized::gguf_file::Value;
use tokenizers::decoders::byte_fallback::ByteFallback;
use tokenizers::decoders::fuse::Fuse;
use tokenizers::decoders::sequence::Sequence as DecoderSequence;
use tokenizers::decoders::strip::Strip;
use tokenizers::models::bpe::{Vocab, BPE};
use tokenizers::normalizers::{Prepend, Replace, Sequence as NormalizerSequence};
use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::pre_tokenizers::digits::Digits;
use tokenizers::pre_tokenizers::metaspace::{Metaspace, PrependScheme};
use tokenizers::pre_tokenizers::sequence::Sequence as PreTokenizerSequence;
use tokenizers::pre_tokenizers::split::{Split, SplitPattern};
use tokenizers::processors::template::{SpecialToken, TemplateProcessing};
use tokenizers::{AddedToken, DecoderWrapper, Model as _, PreTokenizerWrapper, SplitDelimiterBehavior};

use super::error::TextError;
use crate::backend::config::metadata::integer;

/// llama.cpp's token types (`llama_token_type`).
const TOKEN_TYPE_CONTROL: i64 = 3;
const TOKEN_TYPE_USER_DEFINED: i64 = 4;

/// The sentencepiece word-boundary marker.
const SPIECE_UNDERLINE: &str = "\u{2581}";

/// Control-token texts llama.cpp treats as end of generation besides `eos_token_id`; without
/// them a chat model's turn never ends (Gemma's `<end_of_turn>`, ChatML's `<|im_end|>`...).
const END_OF_GENERATION_TEXTS: &[&str] = &[
    "<|eot_id|>",
    "<|im_end|>",
    "<|end|>",
    "<|return|>",
    "<|call|>",
    "<end_of_turn>",
    "<|endoftext|>",
    "<|eom_id|>",
    "<EOT>",
    "_<EOT>",
    "<|end_of_text|>",
    "<end_of_utterance>",
];

// Split regexes, verbatim from transformers' `GGUF_PRE_TOKENIZER_SPLITS` (the originals recorded
// in each model's tokenizer.json, not llama.cpp's rewrites of them).
const LLAMA3_SPLIT: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
const QWEN2_SPLIT: &str =
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
const QWEN35_SPLIT: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
const TEKKEN_SPLIT: &str = r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+";
const GPT4O_SPLIT: &str = r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+";

/// How a byte-level vocabulary cuts text before BPE.
#[derive(Debug, Clone, Copy)]
enum ByteLevelSplit {
    /// GPT-2's own regex, built into `ByteLevel`.
    Gpt2,
    /// Every digit on its own, then GPT-2's regex (StarCoder-style tokenizers, SmolLM).
    DigitsThenGpt2,
    /// A model-specific regex in front of a regex-free `ByteLevel`.
    Regex(&'static str),
}

/// Maps the pre-tokenizer names we know for certain; anything else is refused, never guessed.
fn byte_level_split(pre: &str) -> Option<ByteLevelSplit> {
    Some(match pre {
        // llama.cpp writes these for vocabularies cut by GPT-2's regex; transformers leaves
        // GPT2Tokenizer's `ByteLevel` in place for them (ModernBERT's is OLMo's, which llama.cpp
        // cuts with GPT-2's regex too).
        "default" | "gpt-2" | "phi-2" | "mpt" | "olmo" | "modern-bert" => ByteLevelSplit::Gpt2,
        "llama3" | "llama-v3" | "llama-bpe" | "falcon3" | "falcon-h1" | "pixtral" | "midm-2.0" | "lfm2"
        | "jina-v5-nano" | "dbrx" | "smaug-bpe" => ByteLevelSplit::Regex(LLAMA3_SPLIT),
        "tekken" => ByteLevelSplit::Regex(TEKKEN_SPLIT),
        "qwen2" | "deepseek-r1-qwen" | "kormo" | "f2llmv2" | "megrez" => ByteLevelSplit::Regex(QWEN2_SPLIT),
        "qwen35" => ByteLevelSplit::Regex(QWEN35_SPLIT),
        "gpt-4o" | "llama4" | "kanana2" | "talkie" | "minimax-m2" => ByteLevelSplit::Regex(GPT4O_SPLIT),
        // transformers does not list these and would keep plain GPT-2, which joins digit runs;
        // llama.cpp (and the models' own tokenizer.json) isolate every digit first.
        "smollm" | "starcoder" | "refact" => ByteLevelSplit::DigitsThenGpt2,
        _ => return None,
    })
}

/// The sentencepiece-family builders transformers picks between.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Sentencepiece {
    /// `GemmaTokenizer` fed a respelled vocabulary with merges ranked by position (gemma 1-3).
    Gemma,
    /// `GemmaTokenizer` with merges from the file or the scores (`tokenizer.ggml.model` gemma4).
    Gemma4,
    /// `LlamaTokenizer`: Metaspace, byte fallback, no normalizer.
    Llama,
    /// Phi-3: the prefix space comes from a normalizer instead of Metaspace.
    Phi3,
}

/// The tokenizer rebuilt from GGUF metadata, with what the wrapper needs besides it.
pub(crate) struct GgufTokenizer {
    pub tokenizer: tokenizers::Tokenizer,
    pub bos_id: Option<u32>,
    pub eos_ids: Vec<u32>,
    pub add_bos: bool,
    pub bos_token: Option<String>,
    pub eos_token: Option<String>,
    pub chat_template: Option<String>,
    pub vocab_size: usize,
}

/// Typed access to the metadata map, with errors naming the key.
struct Metadata<'a>(&'a HashMap<String, Value>);

fn invalid(key: &str, message: impl Into<String>) -> TextError {
    TextError::InvalidMetadata { key: key.to_string(), message: message.into() }
}

/// Any integer value that fits an `i64` (the model config's reader widens the same way).
fn value_as_i64(v: &Value) -> Option<i64> {
    integer(v).and_then(|x| i64::try_from(x).ok())
}

fn value_as_f64(v: &Value) -> Option<f64> {
    match v {
        Value::F32(x) => Some(*x as f64),
        Value::F64(x) => Some(*x),
        other => value_as_i64(other).map(|x| x as f64),
    }
}

impl<'a> Metadata<'a> {
    fn string(&self, key: &str) -> Result<Option<&'a str>, TextError> {
        match self.0.get(key) {
            None => Ok(None),
            Some(Value::String(s)) => Ok(Some(s.as_str())),
            Some(_) => Err(invalid(key, "expected a string")),
        }
    }

    fn boolean(&self, key: &str) -> Result<Option<bool>, TextError> {
        match self.0.get(key) {
            None => Ok(None),
            Some(Value::Bool(b)) => Ok(Some(*b)),
            Some(_) => Err(invalid(key, "expected a boolean")),
        }
    }

    /// A token id; llama.cpp writes -1 (as a signed or wrapped unsigned value) for "none".
    fn token_id(&self, key: &str, n_tokens: usize) -> Result<Option<u32>, TextError> {
        let Some(v) = self.0.get(key) else {
            return Ok(None);
        };
        if matches!(v, Value::U32(u32::MAX) | Value::U64(u64::MAX)) {
            return Ok(None);
        }
        let id = value_as_i64(v).ok_or_else(|| invalid(key, "expected an integer token id"))?;
        // Only -1 is llama.cpp's "none"; any other negative id is damage, not a choice.
        if id == -1 {
            return Ok(None);
        }
        if id < 0 {
            return Err(invalid(key, format!("token id {id} is negative")));
        }
        if id as u64 >= n_tokens as u64 {
            return Err(invalid(key, format!("token id {id} is outside the vocabulary of {n_tokens} tokens")));
        }
        Ok(Some(id as u32))
    }

    fn array(&self, key: &str) -> Result<Option<&'a Vec<Value>>, TextError> {
        match self.0.get(key) {
            None => Ok(None),
            Some(Value::Array(a)) => Ok(Some(a)),
            Some(_) => Err(invalid(key, "expected an array")),
        }
    }

    /// An array of strings, borrowed: a vocabulary is copied once, into the tokenizer's own map.
    fn strings(&self, key: &str) -> Result<Option<Vec<&'a str>>, TextError> {
        let Some(items) = self.array(key)? else {
            return Ok(None);
        };
        items
            .iter()
            .map(|v| match v {
                Value::String(s) => Ok(s.as_str()),
                _ => Err(invalid(key, "expected an array of strings")),
            })
            .collect::<Result<Vec<_>, _>>()
            .map(Some)
    }

    fn floats(&self, key: &str) -> Result<Option<Vec<f64>>, TextError> {
        let Some(items) = self.array(key)? else {
            return Ok(None);
        };
        items
            .iter()
            .map(|v| value_as_f64(v).ok_or_else(|| invalid(key, "expected an array of numbers")))
            .collect::<Result<Vec<_>, _>>()
            .map(Some)
    }

    fn integers(&self, key: &str) -> Result<Option<Vec<i64>>, TextError> {
        let Some(items) = self.array(key)? else {
            return Ok(None);
        };
        items
            .iter()
            .map(|v| value_as_i64(v).ok_or_else(|| invalid(key, "expected an array of integers")))
            .collect::<Result<Vec<_>, _>>()
            .map(Some)
    }
}

/// The GGUF vocabulary, read once and validated (its strings borrowed from the metadata).
struct Vocabulary<'a> {
    /// Tokens exactly as the file spells them.
    tokens: Vec<&'a str>,
    scores: Option<Vec<f64>>,
    token_types: Option<Vec<i64>>,
    merges: Option<Vec<&'a str>>,
    bos_id: Option<u32>,
    eos_id: Option<u32>,
    eot_id: Option<u32>,
    eom_id: Option<u32>,
    unk_id: Option<u32>,
    pad_id: Option<u32>,
    add_bos: Option<bool>,
    add_eos: Option<bool>,
    /// Whether a separator goes between a pair's two texts: the converter writes it for the
    /// BERT family only (its `SpecialVocab` reads it from their tokenizer configs).
    add_sep: Option<bool>,
    sep_id: Option<u32>,
    add_space_prefix: Option<bool>,
    pre: Option<String>,
    chat_template: Option<String>,
}

impl<'a> Vocabulary<'a> {
    fn read(md: &Metadata<'a>) -> Result<Self, TextError> {
        const TOKENS: &str = "tokenizer.ggml.tokens";
        let tokens = md.strings(TOKENS)?.ok_or_else(|| TextError::MissingMetadata { key: TOKENS.to_string() })?;
        let n = tokens.len();
        let scores = md.floats("tokenizer.ggml.scores")?;
        let token_types = md.integers("tokenizer.ggml.token_type")?;
        for (key, len) in [
            ("tokenizer.ggml.scores", scores.as_ref().map(Vec::len)),
            ("tokenizer.ggml.token_type", token_types.as_ref().map(Vec::len)),
        ] {
            if let Some(len) = len {
                if len != n {
                    return Err(invalid(key, format!("has {len} entries for {n} tokens")));
                }
            }
        }
        Ok(Self {
            scores,
            token_types,
            merges: md.strings("tokenizer.ggml.merges")?,
            bos_id: md.token_id("tokenizer.ggml.bos_token_id", n)?,
            eos_id: md.token_id("tokenizer.ggml.eos_token_id", n)?,
            unk_id: md.token_id("tokenizer.ggml.unknown_token_id", n)?,
            // Only hints for stopping and special-token marking: a bad value is dropped rather
            // than failing the load.
            eot_id: md.token_id("tokenizer.ggml.eot_token_id", n).unwrap_or(None),
            eom_id: md.token_id("tokenizer.ggml.eom_token_id", n).unwrap_or(None),
            pad_id: md.token_id("tokenizer.ggml.padding_token_id", n).unwrap_or(None),
            add_bos: md.boolean("tokenizer.ggml.add_bos_token")?,
            add_eos: md.boolean("tokenizer.ggml.add_eos_token")?,
            add_sep: md.boolean("tokenizer.ggml.add_sep_token")?,
            // llama.cpp's key is spelt so.
            sep_id: md.token_id("tokenizer.ggml.seperator_token_id", n).unwrap_or(None),
            add_space_prefix: md.boolean("tokenizer.ggml.add_space_prefix")?,
            pre: md.string("tokenizer.ggml.pre")?.map(str::to_string),
            chat_template: md.string("tokenizer.chat_template")?.map(str::to_string),
            tokens,
        })
    }

    fn token_type(&self, id: usize) -> Option<i64> {
        self.token_types.as_ref().map(|t| t[id])
    }

    /// Ids llama.cpp stops generation at: EOS first, then EOT/EOM and known end-of-turn texts.
    fn end_of_generation_ids(&self) -> Vec<u32> {
        let mut ids: Vec<u32> = Vec::new();
        let mut push = |id: u32| {
            if !ids.contains(&id) {
                ids.push(id);
            }
        };
        for id in [self.eos_id, self.eot_id, self.eom_id].into_iter().flatten() {
            push(id);
        }
        for (id, token) in self.tokens.iter().enumerate() {
            let is_control = self.token_type(id) == Some(TOKEN_TYPE_CONTROL);
            if is_control && END_OF_GENERATION_TEXTS.contains(token) {
                push(id as u32);
            }
        }
        ids
    }
}

/// Python's `str.isspace` for one character (it includes the ASCII separators 0x1C-0x1F).
fn py_isspace(c: char) -> bool {
    c.is_whitespace() || ('\u{1c}'..='\u{1f}').contains(&c)
}

/// transformers' Gemma respelling: a whitespace-only token containing a space is stored as
/// spaces in the file but looked up as that many `▁`.
fn gemma_spelled(token: &str) -> String {
    if token.contains(' ') && token.chars().all(py_isspace) {
        SPIECE_UNDERLINE.repeat(token.chars().count())
    } else {
        token.to_string()
    }
}

/// `{token: id}` where a repeated token keeps its last id, as a Python dict comprehension does.
fn vocab_map(tokens: Vec<String>) -> Vocab {
    let mut vocab = Vocab::with_capacity(tokens.len());
    for (i, t) in tokens.into_iter().enumerate() {
        vocab.insert(t, i as u32);
    }
    vocab
}

/// A set of strings that answers "certainly not in it" or "maybe": two bits of a 2^22-bit set
/// per string, about 1% false positives for a 262k vocabulary.
struct TokenFilter {
    bits: Vec<u64>,
    hasher: ahash::RandomState,
}

impl TokenFilter {
    const BITS: u32 = 22;

    fn new(tokens: &[String]) -> Self {
        let mut filter =
            Self { bits: vec![0; 1 << (Self::BITS - 6)], hasher: ahash::RandomState::with_seeds(1, 2, 3, 4) };
        for t in tokens {
            for bit in filter.positions(t) {
                filter.bits[bit / 64] |= 1 << (bit % 64);
            }
        }
        filter
    }

    fn positions(&self, s: &str) -> [usize; 2] {
        let h = self.hasher.hash_one(s);
        let mask = (1u64 << Self::BITS) - 1;
        [(h & mask) as usize, ((h >> 32) & mask) as usize]
    }

    fn may_hold(&self, s: &str) -> bool {
        self.positions(s).iter().all(|&bit| self.bits[bit / 64] & (1 << (bit % 64)) != 0)
    }
}

/// transformers' `generate_merges(vocab, vocab_scores)` (vocab = `{token: index}`).
///
/// Every split of a token into two vocabulary pieces is a merge, ordered within the token by
/// the pieces' ids; then all are stably sorted by (token score, left length, right length),
/// descending. `scores[i]` is token `i`'s score; as in a dict, a repeated token keeps the score
/// and index of its last occurrence but the position of its first.
///
/// A 262k vocabulary means more than a million splits, over half of them with a piece that is
/// not a token (Gemma 3: 1.21M splits, 515k merges): a bit set of the tokens' hashes (512 KiB,
/// in the core's cache) turns those away before the map (tens of MB, a cache miss a probe) is
/// asked.
fn generate_merge_ids(tokens: &[String], scores: &[f64]) -> Vec<(u32, u32)> {
    let mut last: ahash::AHashMap<&str, (u32, f64)> = ahash::AHashMap::with_capacity(tokens.len());
    // Each distinct token once, in order of first appearance, with the index of its first.
    let mut order: Vec<(&str, u32)> = Vec::with_capacity(tokens.len());
    let filter = TokenFilter::new(tokens);
    let mut repeated = false;
    for (i, t) in tokens.iter().enumerate() {
        match last.insert(t.as_str(), (i as u32, scores[i])) {
            None => order.push((t.as_str(), i as u32)),
            Some(_) => repeated = true,
        }
    }
    // Tokens are independent until the final sort: split them over the threads, keeping order.
    let per_task = order.len().div_ceil(rayon::current_num_threads().max(1) * 4).max(1024);
    let parts: Vec<Vec<(f64, u32, u32, u32, u32)>> = order
        .par_chunks(per_task)
        .map(|tokens| {
            let mut merges = Vec::new();
            let mut local: Vec<(u32, u32, &str, &str)> = Vec::new();
            for &(token, first) in tokens {
                // A token's score is its last occurrence's: a second look only when there is one.
                let score = if repeated { last[token].1 } else { scores[first as usize] };
                local.clear();
                for (at, _) in token.char_indices().skip(1) {
                    let (l, r) = token.split_at(at);
                    if !(filter.may_hold(l) && filter.may_hold(r)) {
                        continue;
                    }
                    if let Some(&(li, _)) = last.get(l) {
                        if let Some(&(ri, _)) = last.get(r) {
                            local.push((li, ri, l, r));
                        }
                    }
                }
                // Each split has its own left piece, so the (left id, right id) keys are distinct.
                local.sort_unstable_by_key(|&(li, ri, _, _)| (li, ri));
                merges.extend(
                    local
                        .iter()
                        .map(|&(li, ri, l, r)| (score, l.chars().count() as u32, r.chars().count() as u32, li, ri)),
                );
            }
            merges
        })
        .collect();
    let mut merges = parts.concat();
    // Python compares floats numerically (-0.0 == 0.0), which `partial_cmp` matches; the sort is
    // stable like `sorted(..., reverse=True)` (rayon's `par_sort_by` is stable too).
    merges.par_sort_by(|a, b| b.0.partial_cmp(&a.0).unwrap_or(Ordering::Equal).then(b.1.cmp(&a.1)).then(b.2.cmp(&a.2)));
    // A piece's id is its last occurrence's, whose spelling is the piece's.
    merges.into_iter().map(|(_, _, _, l, r)| (l, r)).collect()
}

/// [`generate_merge_ids`] as the strings the BPE builder takes, from the cache
/// (`merge_cache.rs`) when an earlier load generated them for the same tokens and scores.
fn generate_merges(tokens: &[String], scores: &[f64]) -> Vec<(String, String)> {
    use super::merge_cache;
    // The vocabulary is hashed only where there is a cache to look in.
    let cache = merge_cache::dir().map(|dir| (dir, merge_cache::key(tokens, scores)));
    let token_bytes = || tokens.iter().map(String::len).sum();
    let cached = cache.as_ref().and_then(|(dir, key)| merge_cache::read(dir, key, tokens.len(), token_bytes()));
    let ids = cached.unwrap_or_else(|| {
        let ids = generate_merge_ids(tokens, scores);
        if let Some((dir, key)) = &cache {
            merge_cache::write(dir, key, &ids);
        }
        ids
    });
    // On this thread: strings allocated on rayon's workers live in their malloc arenas, which
    // keep the freed memory once the BPE builder is done with them (Gemma 3 270M: 30 MB more
    // resident for the model's lifetime).
    ids.into_iter().map(|(l, r)| (tokens[l as usize].clone(), tokens[r as usize].clone())).collect()
}

/// Merges stated by the file, as `"left right"` strings.
fn parse_merges(merges: &[&str]) -> Result<Vec<(String, String)>, TextError> {
    merges
        .iter()
        .map(|m| {
            m.split_once(' ').filter(|(_, r)| !r.contains(' ')).map(|(l, r)| (l.to_string(), r.to_string())).ok_or_else(
                || invalid("tokenizer.ggml.merges", format!("merge {m:?} is not two tokens separated by one space")),
            )
        })
        .collect()
}

/// The file's merges, or those its vocabulary implies given each token's score.
fn merges_or_generated(
    v: &Vocabulary<'_>,
    tokens: &[String],
    scores: Option<Vec<f64>>,
) -> Result<Vec<(String, String)>, TextError> {
    if let Some(merges) = &v.merges {
        return parse_merges(merges);
    }
    let scores = scores
        .or_else(|| v.scores.clone())
        .ok_or_else(|| TextError::MissingMetadata { key: "tokenizer.ggml.scores".to_string() })?;
    Ok(generate_merges(tokens, &scores))
}

fn build_err(what: &str) -> impl Fn(tokenizers::Error) -> TextError + '_ {
    move |e| TextError::tokenizer(format!("building the {what} from GGUF metadata"), e)
}

/// What a BPE model is built from, converted from the GGUF vocabulary.
struct BpeInputs {
    vocab: Vocab,
    merges: Vec<(String, String)>,
    unk: Option<&'static str>,
    byte_fallback: bool,
}

fn bpe(inputs: BpeInputs) -> Result<BPE, TextError> {
    let BpeInputs { vocab, merges, unk, byte_fallback } = inputs;
    let mut builder =
        BPE::builder().vocab_and_merges(vocab, merges).fuse_unk(byte_fallback).byte_fallback(byte_fallback);
    if let Some(unk) = unk {
        builder = builder.unk_token(unk.to_string());
    }
    builder.build().map_err(build_err("BPE model"))
}

/// The sentencepiece family's BPE inputs (`tokenizer.ggml.model` = `llama` or `gemma4`).
fn sentencepiece_inputs(v: &Vocabulary<'_>, kind: Sentencepiece) -> Result<BpeInputs, TextError> {
    let tokens: Vec<String> = match kind {
        Sentencepiece::Gemma => v.tokens.iter().map(|t| gemma_spelled(t)).collect(),
        _ => v.tokens.iter().map(|t| t.to_string()).collect(),
    };
    // Gemma's scores are ranks punched through with -1000 placeholders; its merge order is the
    // order tokens appear in the file.
    let positions = (kind == Sentencepiece::Gemma).then(|| (0..tokens.len()).map(|i| -(i as f64)).collect());
    let merges = merges_or_generated(v, &tokens, positions)?;
    let vocab = vocab_map(tokens);
    let gemma = matches!(kind, Sentencepiece::Gemma | Sentencepiece::Gemma4);
    // GemmaTokenizer builds its BPE with unk "<unk>"; LlamaTokenizer with none.
    let unk = (gemma && vocab.contains_key("<unk>")).then_some("<unk>");
    Ok(BpeInputs { vocab, merges, unk, byte_fallback: true })
}

/// The sentencepiece family's tokenizer around its BPE model.
fn build_sentencepiece(
    v: &Vocabulary<'_>,
    kind: Sentencepiece,
    model: BPE,
) -> Result<tokenizers::Tokenizer, TextError> {
    let mut tokenizer = tokenizers::Tokenizer::new(model);

    let replace = |from: &str, to: &str| Replace::new(from, to).map_err(build_err("normalizer"));
    let mut decoders: Vec<DecoderWrapper> =
        vec![replace(SPIECE_UNDERLINE, " ")?.into(), ByteFallback::new().into(), Fuse::new().into()];
    match kind {
        Sentencepiece::Gemma | Sentencepiece::Gemma4 => {
            // Spaces become `▁` up front and nothing is prepended; the split on " " never fires
            // once the normalizer has run, but GemmaTokenizer installs it, so we do too.
            tokenizer.with_normalizer(Some(replace(" ", SPIECE_UNDERLINE)?)).map_err(build_err("normalizer"))?;
            let split = Split::new(" ", SplitDelimiterBehavior::MergedWithPrevious, false)
                .map_err(build_err("pre-tokenizer"))?;
            tokenizer.with_pre_tokenizer(Some(split));
        }
        Sentencepiece::Llama => {
            // transformers always prepends (LlamaTokenizer's default); a file that explicitly
            // says otherwise is honoured, as llama.cpp does, since the flag is the original
            // sentencepiece model's `add_dummy_prefix`.
            let prepend = v.add_space_prefix != Some(false);
            let scheme = if prepend { PrependScheme::First } else { PrependScheme::Never };
            tokenizer.with_pre_tokenizer(Some(Metaspace::new('\u{2581}', scheme, false)));
            if prepend {
                decoders.push(Strip::new(' ', 1, 0).into());
            }
        }
        Sentencepiece::Phi3 => {
            let normalizer = NormalizerSequence::new(vec![
                Prepend::new(SPIECE_UNDERLINE.to_string()).into(),
                replace(" ", SPIECE_UNDERLINE)?.into(),
            ]);
            tokenizer.with_normalizer(Some(normalizer)).map_err(build_err("normalizer"))?;
            decoders.push(Strip::new(' ', 1, 0).into());
        }
    }
    tokenizer.with_decoder(Some(DecoderSequence::new(decoders)));
    add_gguf_tokens(&mut tokenizer, v, |_| true)?;
    Ok(tokenizer)
}

/// GPT-2's byte-to-character table (`bytes_to_unicode`).
pub(crate) fn bytes_to_unicode() -> [char; 256] {
    let mut table = ['\0'; 256];
    let printable = |b: u32| (0x21..=0x7e).contains(&b) || (0xa1..=0xac).contains(&b) || (0xae..=0xff).contains(&b);
    let mut n = 0u32;
    for b in 0u32..256 {
        table[b as usize] = if printable(b) {
            char::from_u32(b).unwrap()
        } else {
            n += 1;
            char::from_u32(255 + n).unwrap()
        };
    }
    table
}

/// Whether a token is spelled in GPT-2's byte alphabet.
fn byte_level_alphabet() -> impl Fn(&str) -> bool {
    let table = bytes_to_unicode();
    move |t: &str| t.chars().all(|c| table.contains(&c))
}

/// The byte-level family's BPE inputs (`tokenizer.ggml.model` = `gpt2`).
fn byte_level_inputs(v: &Vocabulary<'_>) -> Result<BpeInputs, TextError> {
    // llama.cpp writes tokens in byte-level spelling, except ones whose bytes do not decode
    // (written raw); respell those so the merges naming them resolve.
    let table = bytes_to_unicode();
    let in_alphabet = byte_level_alphabet();
    let tokens: Vec<String> = v
        .tokens
        .iter()
        .map(|t| if in_alphabet(t) { t.to_string() } else { t.bytes().map(|b| table[b as usize]).collect() })
        .collect();
    let merges = merges_or_generated(v, &tokens, None)?;
    let vocab = vocab_map(tokens);
    Ok(BpeInputs { vocab, merges, unk: None, byte_fallback: false })
}

/// The byte-level family's tokenizer around its BPE model, as transformers' GPT2Tokenizer.
fn build_byte_level(v: &Vocabulary<'_>, split: ByteLevelSplit, model: BPE) -> Result<tokenizers::Tokenizer, TextError> {
    let mut tokenizer = tokenizers::Tokenizer::new(model);

    let pre_tokenizer: PreTokenizerWrapper = match split {
        ByteLevelSplit::Gpt2 => ByteLevel::new(false, true, true).into(),
        ByteLevelSplit::DigitsThenGpt2 => {
            PreTokenizerSequence::new(vec![Digits::new(true).into(), ByteLevel::new(false, true, true).into()]).into()
        }
        ByteLevelSplit::Regex(regex) => {
            let split = Split::new(SplitPattern::Regex(regex.to_string()), SplitDelimiterBehavior::Isolated, false)
                .map_err(build_err("pre-tokenizer split"))?;
            PreTokenizerSequence::new(vec![split.into(), ByteLevel::new(false, true, false).into()]).into()
        }
    };
    tokenizer.with_pre_tokenizer(Some(pre_tokenizer));
    tokenizer.with_decoder(Some(ByteLevel::new(false, true, true)));
    // A control token outside the byte alphabet is a byte sequence llama.cpp mislabelled;
    // registering it would take it out of the merges, so transformers skips it.
    add_gguf_tokens(&mut tokenizer, v, byte_level_alphabet())?;
    Ok(tokenizer)
}

/// llama.cpp's BERT vocabulary back as WordPiece's: the converter writes it in "phantom space"
/// (a word-initial piece `▁word`, a continuation `piece` bare, control tokens as they are), so a
/// `▁` is taken off and a bare piece gets `##`. Normalised and split as BERT's tokenizer does, with
/// lower-casing (llama.cpp's WPM tokenizer lower-cases every model).
fn build_wordpiece(v: &Vocabulary<'_>) -> Result<tokenizers::Tokenizer, TextError> {
    use tokenizers::models::wordpiece::WordPiece;
    let mut vocab = Vocab::default();
    for (id, token) in v.tokens.iter().enumerate() {
        let piece = if v.token_type(id) == Some(TOKEN_TYPE_CONTROL) {
            token.to_string()
        } else if let Some(word) = token.strip_prefix('\u{2581}') {
            word.to_string()
        } else {
            format!("##{token}")
        };
        vocab.entry(piece).or_insert(id as u32);
    }
    let unk = v.unk_id.map_or_else(|| "[UNK]".to_string(), |id| v.tokens[id as usize].to_string());
    let model = WordPiece::builder()
        .vocab(vocab)
        .unk_token(unk)
        .continuing_subword_prefix("##".into())
        .max_input_chars_per_word(100)
        .build()
        .map_err(build_err("WordPiece model"))?;
    let mut tokenizer = tokenizers::Tokenizer::new(model);
    tokenizer
        .with_normalizer(Some(tokenizers::normalizers::bert::BertNormalizer::new(true, true, None, true)))
        .map_err(build_err("BERT normaliser"))?;
    tokenizer.with_pre_tokenizer(Some(tokenizers::pre_tokenizers::bert::BertPreTokenizer));
    tokenizer.with_decoder(Some(tokenizers::decoders::wordpiece::WordPiece::new("##".into(), true)));
    add_gguf_tokens(&mut tokenizer, v, |_| true)?;
    Ok(tokenizer)
}

/// transformers' `add_gguf_special_tokens` plus the special tokens its tokenizer classes add.
///
/// Control tokens become special (chat markup typed as text is one id, and is skipped when
/// decoding with `skip_special_tokens`); user-defined tokens found in the vocabulary are matched
/// whole but kept when decoding; BOS/EOS/UNK/PAD are special whatever their type.
fn add_gguf_tokens(
    tokenizer: &mut tokenizers::Tokenizer,
    v: &Vocabulary<'_>,
    control_allowed: impl Fn(&str) -> bool,
) -> Result<(), TextError> {
    // The BPE model's vocabulary (added tokens live apart from it).
    let in_vocab = |token: &str| tokenizer.get_model().token_to_id(token).is_some();
    let mut special: Vec<AddedToken> = Vec::new();
    let mut user_defined: Vec<AddedToken> = Vec::new();
    if v.token_types.is_some() {
        for (id, token) in v.tokens.iter().enumerate() {
            match v.token_type(id) {
                Some(TOKEN_TYPE_CONTROL) if control_allowed(token) => {
                    special.push(AddedToken::from(token.to_string(), true).normalized(false))
                }
                Some(TOKEN_TYPE_USER_DEFINED) if in_vocab(token) => {
                    user_defined.push(AddedToken::from(token.to_string(), false).normalized(false))
                }
                _ => {}
            }
        }
    }
    for id in [v.bos_id, v.eos_id, v.unk_id, v.pad_id].into_iter().flatten() {
        let token = v.tokens[id as usize];
        let known = special.iter().chain(&user_defined).any(|t| t.content == token);
        if !known && in_vocab(token) {
            special.push(AddedToken::from(token.to_string(), true).normalized(false));
        }
    }
    if !special.is_empty() {
        tokenizer.add_special_tokens(special).map_err(build_err("special tokens"))?;
    }
    if !user_defined.is_empty() {
        tokenizer.add_tokens(user_defined).map_err(build_err("user-defined tokens"))?;
    }
    Ok(())
}

/// `update_post_processor`: BOS/EOS insertion lives in the inner tokenizer, so
/// `inner().encode` agrees with ours.
fn special_token_processor(
    v: &Vocabulary<'_>,
    add_bos: bool,
    add_eos: bool,
) -> Result<Option<TemplateProcessing>, TextError> {
    let bos = v.bos_id.filter(|_| add_bos);
    let eos = v.eos_id.filter(|_| add_eos);
    if bos.is_none() && eos.is_none() {
        return Ok(None);
    }
    let err = |e: String| TextError::tokenizer("building the BOS/EOS template", e);
    // A BERT-family vocabulary (`add_sep_token` written) pairs texts as llama.cpp's rerank does
    // and transformers' BERT tokenizers do: `BOS A EOS [SEP] B EOS`, the SEP only where added
    // (ModernBERT's and BERT's EOS is their [SEP] already).
    let bert_pair = v.add_sep.is_some();
    let sep = v.sep_id.filter(|_| v.add_sep == Some(true));
    // Internal piece names, so token texts containing spaces or colons cannot break the template.
    let mut specials = Vec::new();
    for (name, id) in [("BOS", bos), ("EOS", eos), ("SEP", sep)] {
        if let Some(id) = id {
            let text = v.tokens[id as usize].to_string();
            specials.push(SpecialToken::new(name.into(), vec![id], vec![text]).map_err(|e| err(e.to_string()))?);
        }
    }
    // transformers' shape: `BOS $A EOS` and `BOS $A EOS BOS $B EOS` (type ids 0, then 1).
    let sequence = |seq: &str, type_id: u32| {
        let mut pieces = Vec::new();
        if bos.is_some() {
            pieces.push(format!("BOS:{type_id}"));
        }
        pieces.push(format!("{seq}:{type_id}"));
        if eos.is_some() {
            pieces.push(format!("EOS:{type_id}"));
        }
        pieces
    };
    let single = sequence("$A", 0);
    let pair: Vec<String> = match bert_pair {
        false => single.iter().cloned().chain(sequence("$B", 1)).collect(),
        true => {
            let mut pair = single.clone();
            if sep.is_some() {
                pair.push("SEP:1".into());
            }
            pair.push("$B:1".into());
            if eos.is_some() {
                pair.push("EOS:1".into());
            }
            pair
        }
    };
    let processor = TemplateProcessing::builder()
        .try_single(single)
        .map_err(err)?
        .try_pair(pair)
        .map_err(err)?
        .special_tokens(specials)
        .build()
        .map_err(|e| err(e.to_string()))?;
    Ok(Some(processor))
}

/// Which tokenizer family a GGUF vocabulary belongs to.
#[derive(Debug, Clone, Copy)]
enum Family {
    Sentencepiece(Sentencepiece),
    ByteLevel(ByteLevelSplit),
    /// BERT's WordPiece (`tokenizer.ggml.model` = `bert`).
    WordPiece,
}

/// A GGUF vocabulary converted up to its BPE model's inputs: the part of the conversion that
/// runs on every thread (merges parsed or generated). [`PreparedTokenizer::build`] does the
/// rest, which is one thread's work (`Model::load` runs the whole conversion beside the
/// weights' load).
pub(crate) struct PreparedTokenizer<'a> {
    v: Vocabulary<'a>,
    family: Family,
    add_bos: bool,
    /// `None` for WordPiece, which has no BPE model.
    inputs: Option<BpeInputs>,
}

/// The first step of [`tokenizer_from_gguf`]: reads and validates the vocabulary, and derives
/// the merges.
pub(crate) fn prepare_gguf(md: &HashMap<String, Value>) -> Result<PreparedTokenizer<'_>, TextError> {
    let md = Metadata(md);
    const MODEL: &str = "tokenizer.ggml.model";
    let model = md.string(MODEL)?.ok_or_else(|| TextError::MissingMetadata { key: MODEL.to_string() })?;
    let architecture = md.string("general.architecture")?.unwrap_or("");
    let v = Vocabulary::read(&md)?;
    // transformers: sentencepiece files add BOS unless they say otherwise; gemma4 files never
    // do (their chat template writes `<bos>`); byte-level files only when they say so.
    let (family, add_bos) = match model {
        "llama" => {
            let kind = match architecture {
                "gemma" | "gemma2" | "gemma3" => Sentencepiece::Gemma,
                "phi3" => Sentencepiece::Phi3,
                _ => Sentencepiece::Llama,
            };
            (Family::Sentencepiece(kind), v.add_bos.unwrap_or(true))
        }
        "gemma4" => (Family::Sentencepiece(Sentencepiece::Gemma4), false),
        "gpt2" => {
            let pre = v.pre.as_deref().unwrap_or("default");
            let split =
                byte_level_split(pre).ok_or_else(|| TextError::UnsupportedPreTokenizer { pre: pre.to_string() })?;
            (Family::ByteLevel(split), v.add_bos.unwrap_or(false))
        }
        // llama.cpp's WPM tokenizer: `[CLS]` first and `[SEP]` last (the converter writes them as
        // BOS and EOS with add_bos / add_eos).
        "bert" => (Family::WordPiece, v.add_bos.unwrap_or(true)),
        other => return Err(TextError::UnsupportedTokenizerModel { model: other.to_string() }),
    };
    let inputs = match family {
        Family::Sentencepiece(kind) => Some(sentencepiece_inputs(&v, kind)?),
        Family::ByteLevel(_) => Some(byte_level_inputs(&v)?),
        Family::WordPiece => None,
    };
    Ok(PreparedTokenizer { v, family, add_bos, inputs })
}

impl PreparedTokenizer<'_> {
    /// The second step of [`tokenizer_from_gguf`]: the BPE model (the `tokenizers` crate's
    /// builder, single-threaded), the pipeline around it and the special tokens.
    pub(crate) fn build(self) -> Result<GgufTokenizer, TextError> {
        let Self { v, family, add_bos, inputs } = self;
        let model = inputs.map(bpe).transpose()?;
        let mut tokenizer = match (family, model) {
            (Family::Sentencepiece(kind), Some(model)) => build_sentencepiece(&v, kind, model)?,
            (Family::ByteLevel(split), Some(model)) => build_byte_level(&v, split, model)?,
            (Family::WordPiece, _) => build_wordpiece(&v)?,
            (_, None) => unreachable!("prepare_gguf gives every BPE family its inputs"),
        };
        let add_bos = add_bos && v.bos_id.is_some();
        let add_eos = v.add_eos.unwrap_or(false) && v.eos_id.is_some();
        if let Some(processor) = special_token_processor(&v, add_bos, add_eos)? {
            tokenizer.with_post_processor(Some(processor));
        }
        let token_text = |id: Option<u32>| id.map(|id| v.tokens[id as usize].to_string());
        Ok(GgufTokenizer {
            bos_id: v.bos_id,
            eos_ids: v.end_of_generation_ids(),
            add_bos,
            bos_token: token_text(v.bos_id),
            eos_token: token_text(v.eos_id),
            chat_template: v.chat_template.clone(),
            vocab_size: v.tokens.len(),
            tokenizer,
        })
    }
}

/// Builds the tokenizer a GGUF file describes.
pub(crate) fn tokenizer_from_gguf(md: &HashMap<String, Value>) -> Result<GgufTokenizer, TextError> {
    prepare_gguf(md)?.build()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The generated merges as strings, without the disk cache.
    fn pairs<'a>(tokens: &'a [String], scores: &[f64]) -> Vec<(&'a str, &'a str)> {
        let ids = generate_merge_ids(tokens, scores);
        ids.into_iter().map(|(l, r)| (tokens[l as usize].as_str(), tokens[r as usize].as_str())).collect()
    }

    #[test]
    fn generated_merges_follow_transformers_ordering() {
        let tokens: Vec<String> = ["a", "b", "c", "ab", "bc", "abc"].iter().map(|s| s.to_string()).collect();
        // By score: "ab" (-1), "abc" (-2), "bc" (-3); within "abc" the longer left piece first.
        let scores = [-0.1, -0.2, -0.5, -1.0, -3.0, -2.0];
        assert_eq!(pairs(&tokens, &scores), [("a", "b"), ("ab", "c"), ("a", "bc"), ("b", "c")]);
        // By position (Gemma): "ab" (3), "bc" (4), "abc" (5).
        let positions: Vec<f64> = (0..6).map(|i| -(i as f64)).collect();
        assert_eq!(pairs(&tokens, &positions), [("a", "b"), ("b", "c"), ("ab", "c"), ("a", "bc")]);
    }

    #[test]
    fn bytes_to_unicode_matches_gpt2() {
        let t = bytes_to_unicode();
        assert_eq!(t[b' ' as usize], '\u{120}'); // Ġ
        assert_eq!(t[b'\n' as usize], '\u{10a}'); // Ċ
        assert_eq!(t[b'a' as usize], 'a');
        let alphabet = ByteLevel::alphabet();
        assert!(t.iter().all(|c| alphabet.contains(c)));
        assert_eq!(alphabet.len(), 256);
    }

    #[test]
    fn only_minus_one_means_no_token() {
        let map: HashMap<String, Value> = [
            ("none".to_string(), Value::I32(-1)),
            ("bad".to_string(), Value::I32(-7)),
            ("ok".to_string(), Value::U32(3)),
        ]
        .into_iter()
        .collect();
        let md = Metadata(&map);
        assert_eq!(md.token_id("none", 10).unwrap(), None);
        assert!(md.token_id("bad", 10).is_err());
        assert_eq!(md.token_id("ok", 10).unwrap(), Some(3));
        assert!(md.token_id("ok", 3).is_err());
    }

    #[test]
    fn gemma_respelling() {
        assert_eq!(gemma_spelled("   "), "\u{2581}\u{2581}\u{2581}");
        assert_eq!(gemma_spelled("\n\n"), "\n\n");
        assert_eq!(gemma_spelled(" a"), " a");
    }
}
