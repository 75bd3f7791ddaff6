//! The vocabulary as byte strings, for llguidance's token trie (constrained decoding).
//!
//! llguidance reads a tokenizer's bytes from its `tokenizer.json` form (`decoder`, `model.vocab`,
//! `added_tokens`). Ours is a `tokenizers::Tokenizer` of another version than the one its own
//! adapter crate builds on, so the three parts it reads are written out as JSON and handed over:
//! JSON is the interface both versions share. Control tokens (`Specials::is_control`) are
//! marked special, so a grammar never spells text with them.

use std::sync::Arc;

use llguidance::toktrie::{ApproximateTokEnv, TokEnv, TokRxInfo, TokTrie};
use serde_json::{json, Value};

use super::error::TextError;

/// What llguidance needs of a vocabulary besides its bytes: which ids are control tokens, and the
/// end and beginning of sequence. Passed in, so this module sits below `tokenizer` (which calls it).
pub struct Specials<'a> {
    /// Whether an id is a control token (special, or markup such as `<start_of_image>`).
    pub is_control: &'a dyn Fn(u32) -> bool,
    /// The first end-of-sequence id, if any.
    pub eos: Option<u32>,
    /// The beginning-of-sequence id, if any.
    pub bos: Option<u32>,
}

/// llguidance's view of the vocabulary `inner` for a model whose steps yield `vocab_size` logits
/// (ids the tokenizer lacks, padding of the output layer, are empty: never allowed).
pub fn tok_env(inner: &tokenizers::Tokenizer, specials: Specials<'_>, vocab_size: usize) -> Result<TokEnv, TextError> {
    let err = |e: &dyn std::fmt::Display| TextError::tokenizer("listing the vocabulary's bytes for constraints", e);
    let decoder = serde_json::to_value(inner.get_decoder()).map_err(|e| err(&e))?;
    let added: Vec<Value> = inner
        .get_added_tokens_decoder()
        .into_iter()
        .map(|(id, t)| json!({"id": id, "content": t.content, "special": (specials.is_control)(id)}))
        .collect();
    let vocab = inner.get_vocab(false);
    // llguidance insists that a byte-fallback vocabulary spells its bytes as `<0xAB>` only.
    if let Some(odd) = vocab.keys().find(|t| t.starts_with("<0x") && t.len() != 6) {
        return Err(err(&format!("the token {odd:?} looks like a byte token but is not one")));
    }
    let json = json!({"decoder": decoder, "added_tokens": added, "model": {"vocab": vocab}});
    let mut words = llguidance::token_bytes_from_tokenizer_json(&json).map_err(|e| err(&e))?;
    if words.len() > vocab_size {
        return Err(err(&format!("the tokenizer has {} tokens, the model's output {vocab_size}", words.len())));
    }
    words.resize(vocab_size, Vec::new());
    let eos = specials.eos.unwrap_or(0);
    let mut info = TokRxInfo::new(vocab_size as u32, eos);
    info.tok_bos = specials.bos;
    let trie = TokTrie::from(&info, &words);
    Ok(Arc::new(ApproximateTokEnv::new(trie)))
}
