//! Whole documents run on fresh caches for embeddings and reranking (DESIGN §17): every
//! position's hidden state after the final norm, or the last position's logits. The session's own
//! cache, tokens and kept edits are not touched, so a failed call leaves it as it was.

use candle_core::Tensor;

use super::CandleSession;
use crate::backend::blocks::hooks::NoHooks;
use crate::backend::decoder::{BatchItem, LogitsRows, StepKind};
use crate::backend::error::{CandleContext, CandleError, Result};
use crate::backend::kv_cache::KvCache;

/// The most tokens one batched step runs (several short documents share a step; a document is
/// never split, so a bidirectional model sees the whole of it at once).
pub const DOCUMENT_BATCH_TOKENS: usize = 4096;

impl CandleSession {
    /// Each document's hidden states after the final norm, float32 `[tokens, hidden]`, with no
    /// output projection (what embedding models pool).
    pub fn hidden_rows(&self, documents: &[Vec<u32>]) -> Result<Vec<Tensor>> {
        self.run_documents("embed", documents, LogitsRows::Hidden)
    }

    /// Each document's logits at its last position, `[1, vocab]` (what a yes/no reranker reads).
    pub fn last_logits(&self, documents: &[Vec<u32>]) -> Result<Vec<Tensor>> {
        self.run_documents("rerank", documents, LogitsRows::Last)
    }

    /// Refuses a document that is empty, longer than the context, or holds an id outside the
    /// vocabulary (`noun` names one in the message), before anything runs.
    pub(super) fn check_documents(&self, operation: &'static str, noun: &str, documents: &[Vec<u32>]) -> Result<()> {
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
        let mut start = 0;
        while start < documents.len() {
            let (mut end, mut tokens) = (start, 0);
            while end < documents.len() && (end == start || tokens + documents[end].len() <= DOCUMENT_BATCH_TOKENS) {
                tokens += documents[end].len();
                end += 1;
            }
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
            start = end;
        }
        Ok(out)
    }
}
