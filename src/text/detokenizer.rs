//! Streaming detokenization.
//!
//! Decoding token by token and concatenating is wrong: a character may be spread over several
//! byte-fallback tokens, and decoders such as `Strip` or byte-level depend on neighbours. The
//! decoder here uses text-generation-inference's technique: decode a short window twice, once
//! up to the last emitted token (`read_offset`) and once including the new ones, and emit the
//! difference only when it does not end in U+FFFD, the mark of an incomplete byte sequence.

use std::sync::Arc;

use super::error::TextError;
use super::tokenizer::Tokenizer;

/// Emits text for a growing sequence of token ids, never a broken UTF-8 character.
///
/// Owns an `Arc<Tokenizer>` so it can live in a generation loop or a Python object without
/// borrowing. For well-formed output, the concatenation of every `push` result and `flush`
/// equals `decode(all_ids)` (minus the decode of any seeded context).
#[derive(Debug, Clone)]
pub struct IncrementalDecoder {
    tokenizer: Arc<Tokenizer>,
    skip_special_tokens: bool,
    ids: Vec<u32>,
    /// Start of the window decoded for context (so prefix-sensitive decoders behave).
    prefix_offset: usize,
    /// End of what has been emitted.
    read_offset: usize,
}

/// How many context tokens `with_context` keeps: enough for any decoder's look-behind.
const CONTEXT_TOKENS: usize = 5;

impl IncrementalDecoder {
    /// A decoder for a sequence starting from nothing.
    pub fn new(tokenizer: Arc<Tokenizer>, skip_special_tokens: bool) -> Self {
        Self { tokenizer, skip_special_tokens, ids: Vec::new(), prefix_offset: 0, read_offset: 0 }
    }

    /// A decoder whose output continues `context` (e.g. the prompt), which is not emitted.
    ///
    /// Without context, a decoder that strips the first leading space (Llama-2 style) would
    /// drop the space of the first generated word.
    pub fn with_context(tokenizer: Arc<Tokenizer>, context: &[u32], skip_special_tokens: bool) -> Self {
        let tail = &context[context.len().saturating_sub(CONTEXT_TOKENS)..];
        Self { tokenizer, skip_special_tokens, ids: tail.to_vec(), prefix_offset: 0, read_offset: tail.len() }
    }

    /// Adds one token; returns the text it completes, if any. When skipping special tokens,
    /// a control token (`Tokenizer::is_control`) adds no text.
    pub fn push(&mut self, id: u32) -> Result<Option<String>, TextError> {
        if self.skip_special_tokens && self.tokenizer.is_control(id) {
            return Ok(None);
        }
        self.ids.push(id);
        self.emit(false)
    }

    /// Emits whatever is still held back (an incomplete character decodes to U+FFFD here).
    pub fn flush(&mut self) -> Result<Option<String>, TextError> {
        if self.read_offset >= self.ids.len() {
            return Ok(None);
        }
        self.emit(true)
    }

    /// The ids pushed so far (after any retained context).
    pub fn ids(&self) -> &[u32] {
        &self.ids
    }

    fn emit(&mut self, force: bool) -> Result<Option<String>, TextError> {
        let tok = &self.tokenizer;
        let skip = self.skip_special_tokens;
        let prefix_text = tok.decode(&self.ids[self.prefix_offset..self.read_offset], skip)?;
        let new_text = tok.decode(&self.ids[self.prefix_offset..], skip)?;
        let complete = !new_text.ends_with('\u{FFFD}');
        if !(complete || force) {
            return Ok(None);
        }
        let Some(delta) = new_text.strip_prefix(prefix_text.as_str()) else {
            // The window's decode rewrote earlier text (a decoder with look-ahead); wait for more.
            if !force {
                return Ok(None);
            }
            let common = new_text
                .char_indices()
                .zip(prefix_text.chars())
                .find(|((_, a), b)| a != b)
                .map_or(prefix_text.len().min(new_text.len()), |((at, _), _)| at);
            self.prefix_offset = self.read_offset;
            self.read_offset = self.ids.len();
            let rest = &new_text[common..];
            return Ok((!rest.is_empty()).then(|| rest.to_string()));
        };
        if delta.is_empty() && !force {
            // Nothing visible yet (e.g. a skipped special token); keep the window as is.
            return Ok(None);
        }
        let delta = delta.to_string();
        self.prefix_offset = self.read_offset;
        self.read_offset = self.ids.len();
        Ok((!delta.is_empty()).then_some(delta))
    }
}
