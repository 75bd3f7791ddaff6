//! The vocabulary as byte strings, for llguidance's token trie (constrained decoding).
//!
//! llguidance reads a tokenizer's bytes from its `tokenizer.json` form (`decoder`, `model.vocab`,
//! `added_tokens`). Ours is a `tokenizers::Tokenizer` of another version than the one its own
//! adapter crate builds on, so the three parts it reads are written out as JSON and handed over:
//! JSON is the interface both versions share. Control tokens (`Tokenizer::is_control`) are
//! marked special, so a grammar never spells text with them.

use std::sync::Arc;

use llguidance::toktrie::{ApproximateTokEnv, TokEnv, TokRxInfo, TokTrie};
use serde_json::{json, Value};

use super::error::TextError;
use super::tokenizer::Tokenizer;

/// llguidance's view of `tokenizer` for a model whose steps yield `vocab_size` logits (ids the
/// tokenizer lacks, padding of the output layer, are empty: never allowed).
pub fn tok_env(tokenizer: &Tokenizer, vocab_size: usize) -> Result<TokEnv, TextError> {
    let inner = tokenizer.inner();
    let err = |e: &dyn std::fmt::Display| TextError::tokenizer("listing the vocabulary's bytes for constraints", e);
    let decoder = serde_json::to_value(inner.get_decoder()).map_err(|e| err(&e))?;
    let added: Vec<Value> = inner
        .get_added_tokens_decoder()
        .into_iter()
        .map(|(id, t)| json!({"id": id, "content": t.content, "special": tokenizer.is_control(id)}))
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
    let eos = tokenizer.eos_ids().first().copied().unwrap_or(0);
    let mut info = TokRxInfo::new(vocab_size as u32, eos);
    info.tok_bos = tokenizer.bos_id();
    let trie = TokTrie::from(&info, &words);
    Ok(Arc::new(ApproximateTokEnv::new(trie)))
}
