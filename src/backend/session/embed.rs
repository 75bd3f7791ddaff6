//! Whole documents run on fresh caches for embeddings and reranking (DESIGN §17): every
//! position's hidden state after the final norm, or the last position's logits. The session's own
//! cache, tokens and kept edits are not touched, so a failed call leaves it as it was.

use candle_core::Tensor;

use super::CandleSession;
use crate::backend::blocks::hooks::NoHooks;
use crate::backend::decoder::{BatchItem, LogitsRows, StepKind};
use crate::backend::encoder::{Encoder, EncoderInput};
use crate::backend::error::{CandleContext, CandleError, Result};
use crate::backend::kv_cache::KvCache;

/// The most tokens one batched step runs (several short documents share a step; a document is
/// never split, so a bidirectional model sees the whole of it at once).
pub const DOCUMENT_BATCH_TOKENS: usize = 4096;

impl CandleSession {
    /// Each document's hidden states after the final norm, float32 `[tokens, hidden]`, with no
    /// output projection (what embedding models pool).
    pub fn hidden_rows(&self, documents: &[Vec<u32>]) -> Result<Vec<Tensor>> {
        if let Some(encoder) = self.decoder.encoder() {
            // An encoder's last hidden states: it has no final norm beyond its last layer's.
            let inputs: Vec<EncoderInput<'_>> =
                documents.iter().map(|d| EncoderInput { ids: d, types: None }).collect();
            let mut out = Vec::with_capacity(documents.len());
            run_encoder(encoder, "embed", &inputs, |group| {
                out.extend(encoder.hidden(group)?);
                Ok(())
            })?;
            return Ok(out);
        }
        self.run_documents("embed", documents, LogitsRows::Hidden)
    }

    /// A cross-encoder's logits `[num_labels]` for each (ids, token types) input, its
    /// classification head applied to the first token.
    pub fn classify(&self, inputs: &[(Vec<u32>, Vec<u32>)]) -> Result<Vec<Vec<f32>>> {
        let refuse = |reason: &str| CandleError::InvalidInput { operation: "rerank", reason: reason.into() };
        let encoder = self.decoder.encoder().ok_or_else(|| refuse("this model is not a cross-encoder"))?;
        if !encoder.has_classifier() {
            return Err(refuse(
                "this encoder has no classification head (a *ForSequenceClassification checkpoint has)",
            ));
        }
        let inputs: Vec<EncoderInput<'_>> =
            inputs.iter().map(|(ids, types)| EncoderInput { ids, types: Some(types.as_slice()) }).collect();
        let mut out = Vec::with_capacity(inputs.len());
        run_encoder(encoder, "rerank", &inputs, |group| {
            out.extend(encoder.classify(group)?);
            Ok(())
        })?;
        Ok(out)
    }

    /// Each document's logits at its last position, `[1, vocab]` (what a yes/no reranker reads).
    pub fn last_logits(&self, documents: &[Vec<u32>]) -> Result<Vec<Tensor>> {
        self.run_documents("rerank", documents, LogitsRows::Last)
    }

    /// Refuses a document that is empty, longer than the context, or holds an id outside the
    /// vocabulary (`noun` names one in the message), before anything runs.
    pub(super) fn check_documents(&self, operation: &'static str, noun: &str, documents: &[Vec<u32>]) -> Result<()> {
        self.refuse_encoder(operation)?;
        let vocab = self.decoder.config().vocab_size;
        for (d, doc) in documents.iter().enumerate() {
            let refuse = |reason: String| CandleError::InvalidInput { operation, reason };
            if doc.is_empty() {
                return Err(refuse(format!("{noun} {d} has no tokens")));
            }
            if doc.len() > self.cache.max_context() {
                return Err(refuse(format!(
                    "{noun} {d} has {} tokens, more than the context of {}",
                    doc.len(),
                    self.cache.max_context()
                )));
            }
            if let Some((index, &token)) = doc.iter().enumerate().find(|(_, &t)| t as usize >= vocab) {
                return Err(CandleError::TokenOutOfRange { token, index, vocab_size: vocab });
            }
        }
        Ok(())
    }

    fn run_documents(&self, operation: &'static str, documents: &[Vec<u32>], rows: LogitsRows) -> Result<Vec<Tensor>> {
        self.check_documents(operation, "input", documents)?;
        // Every layer keeps every position: a document runs in one step, windows or not.
        let full = vec![None; self.decoder.config().num_layers()];
        let mut out = Vec::with_capacity(documents.len());
        for (start, end) in batches(&documents.iter().map(Vec::len).collect::<Vec<_>>()) {
            let tokens: usize = documents[start..end].iter().map(Vec::len).sum();
            let group = &documents[start..end];
            // Each document holds its own cache and scores: refused, as a step is, before
            // anything is allocated when the machine has not the memory free.
            let needed =
                group.iter().map(|d| self.decoder.step_bytes(0, d.len(), rows)).fold(0u64, u64::saturating_add);
            if let Some(available) = crate::memory::available_bytes().filter(|&a| needed > a) {
                return Err(CandleError::OutOfMemory {
                    operation,
                    tokens,
                    position: 0,
                    needed_mib: needed >> 20,
                    available_mib: available >> 20,
                    hint: "; embed fewer or shorter texts at once".into(),
                });
            }
            let mut caches: Vec<KvCache> = group
                .iter()
                .map(|d| {
                    let mut c = KvCache::new(&full, d.len());
                    c.reserve(d.len());
                    c
                })
                .collect();
            let mut items: Vec<BatchItem<'_, NoHooks>> = group
                .iter()
                .zip(caches.iter_mut())
                .map(|(d, cache)| BatchItem { ids: d, cache, hooks: NoHooks })
                .collect();
            let rows = self
                .decoder
                .forward_batch(&mut items, rows, StepKind::Prompt)
                .ctx(|| format!("{operation}: running inputs {start}..{end}"))?;
            out.extend(rows);
        }
        Ok(out)
    }
}

/// Runs `inputs` through `encoder` in groups of at most `DOCUMENT_BATCH_TOKENS` tokens (an input
/// is never split), after checking them all, handing each group to `each`.
fn run_encoder<'a>(
    encoder: &Encoder,
    operation: &'static str,
    inputs: &[EncoderInput<'a>],
    mut each: impl FnMut(&[EncoderInput<'a>]) -> candle_core::Result<()>,
) -> Result<()> {
    encoder.check(operation, inputs)?;
    for (start, end) in batches(&inputs.iter().map(|i| i.ids.len()).collect::<Vec<_>>()) {
        each(&inputs[start..end]).ctx(|| format!("{operation}: running inputs {start}..{end}"))?;
    }
    Ok(())
}

/// Consecutive groups `(start, end)` of documents of lengths `lens`, each of at most
/// `DOCUMENT_BATCH_TOKENS` tokens unless one document alone is longer (a document is never split).
fn batches(lens: &[usize]) -> Vec<(usize, usize)> {
    let mut out = Vec::new();
    let mut start = 0;
    while start < lens.len() {
        let (mut end, mut tokens) = (start, 0);
        while end < lens.len() && (end == start || tokens + lens[end] <= DOCUMENT_BATCH_TOKENS) {
            tokens += lens[end];
            end += 1;
        }
        out.push((start, end));
        start = end;
    }
    out
}
