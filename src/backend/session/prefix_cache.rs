//! A prefix cache shared by the sessions of one model: the keys and values of prompt prefixes,
//! in blocks of whole tokens, kept after the requests that computed them are gone.
//!
//! A block is `block_tokens` positions of every layer's keys and values, identified by its
//! tokens and its parent block (the one before it), as vLLM's and llama.cpp's prefix caches do:
//! two prompts that share a system prompt share its blocks, stored once. Lookups compare token
//! ids exactly (no hash stands in for them). Only positions computed with no edit are stored
//! (`BackendSession::reusable_tokens`), so a restored prefix is what a plain run computes.
//!
//! Memory is bounded by a byte budget; past it the least recently used blocks go first. A
//! lookup marks a path's blocks from its last to its first, so a block is always older than
//! its children and eviction never strands a child under a missing parent.

use std::collections::HashMap;

use candle_core::Tensor;

use super::CandleSession;
use crate::backend::error::{CandleContext, Result};
use crate::backend::kv_cache::owned_copy;
use crate::core::BackendSession;

/// The identity of the (absent) block before a prompt's first.
const ROOT: u64 = 0;

/// Counters of a prefix cache.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct PrefixCacheStats {
    /// Prompts looked up.
    pub lookups: usize,
    /// Lookups that restored at least one block.
    pub hits: usize,
    /// Prompt tokens looked up.
    pub prompt_tokens: usize,
    /// Of those, the tokens restored from the cache instead of computed.
    pub cached_tokens: usize,
    /// Blocks held now.
    pub blocks: usize,
    /// Bytes held now.
    pub bytes: usize,
    /// Blocks evicted to stay within the budget.
    pub evictions: usize,
}

/// One block: its tokens' keys and values in every layer, `[1, kv_heads, block_tokens, head_dim]`.
#[derive(Debug)]
struct Block {
    key: (u64, Vec<u32>),
    layers: Vec<(Tensor, Tensor)>,
    bytes: usize,
    last_used: u64,
}

/// Keys and values of prompt prefixes, in blocks, under a byte budget (see the module's notes).
#[derive(Debug)]
pub struct PrefixCache {
    block_tokens: usize,
    budget_bytes: usize,
    /// (parent id, the block's tokens) → block id.
    index: HashMap<(u64, Vec<u32>), u64>,
    blocks: HashMap<u64, Block>,
    next_id: u64,
    clock: u64,
    stats: PrefixCacheStats,
}

impl PrefixCache {
    /// An empty cache of blocks of `block_tokens` positions holding at most `budget_bytes`.
    pub fn new(block_tokens: usize, budget_bytes: usize) -> Self {
        Self {
            block_tokens: block_tokens.max(1),
            budget_bytes,
            index: HashMap::new(),
            blocks: HashMap::new(),
            next_id: ROOT + 1,
            clock: 0,
            stats: PrefixCacheStats::default(),
        }
    }

    /// Positions per block.
    pub fn block_tokens(&self) -> usize {
        self.block_tokens
    }

    /// The counters, with the blocks and bytes held now.
    pub fn stats(&self) -> PrefixCacheStats {
        PrefixCacheStats { blocks: self.blocks.len(), ..self.stats }
    }

    /// The ids of the cached blocks that start `prompt`, in order. At least one token of the
    /// prompt is left out, so a restored session still runs a step to get logits.
    fn path(&self, prompt: &[u32]) -> Vec<u64> {
        let usable = prompt.len().saturating_sub(1);
        let mut parent = ROOT;
        let mut ids = Vec::new();
        for chunk in prompt[..usable].chunks_exact(self.block_tokens) {
            // The key is built per block; a miss ends the walk.
            match self.index.get(&(parent, chunk.to_vec())) {
                Some(&id) => {
                    ids.push(id);
                    parent = id;
                }
                None => break,
            }
        }
        ids
    }

    /// How many leading tokens of `prompt` the cache could restore (whole blocks), without
    /// counting a lookup.
    pub fn peek(&self, prompt: &[u32]) -> usize {
        self.path(prompt).len() * self.block_tokens
    }

    /// Counts a lookup of `prompt` of which `reused` tokens were not computed again (restored
    /// here, or held by the session the caller picked).
    pub fn count_lookup(&mut self, prompt: &[u32], reused: usize) {
        self.stats.lookups += 1;
        self.stats.prompt_tokens += prompt.len();
        if reused > 0 {
            self.stats.hits += 1;
            self.stats.cached_tokens += reused;
        }
    }

    /// Puts the longest cached prefix of `prompt` into `session` (replacing what it held) and
    /// returns its length; 0, and the session untouched, when nothing is cached or the session
    /// keeps edits (a cache computed without them would not be what it computes).
    pub fn restore_into(&mut self, session: &mut CandleSession, prompt: &[u32]) -> Result<usize> {
        let ids = self.path(prompt);
        if ids.is_empty() || !session.edits.set.is_empty() {
            return Ok(0);
        }
        let n = ids.len() * self.block_tokens;
        if n > session.cache.max_context() {
            return Ok(0);
        }
        let n_layers = session.cache.num_layers();
        let mut held = Vec::with_capacity(n_layers);
        for layer in 0..n_layers {
            let ks: Vec<&Tensor> = ids.iter().map(|id| &self.blocks[id].layers[layer].0).collect();
            let vs: Vec<&Tensor> = ids.iter().map(|id| &self.blocks[id].layers[layer].1).collect();
            let ctx = || format!("assembling layer {layer}'s cached prefix of {n} tokens");
            // `cat` writes a buffer of the session's own: the blocks stay shared and unchanged.
            held.push(Some((Tensor::cat(&ks, 2).ctx(ctx)?, Tensor::cat(&vs, 2).ctx(ctx)?)));
        }
        session.install_prefix(prompt[..n].to_vec(), held);
        // Newest first from the last block back, so parents stay older than their children.
        for id in ids.iter().rev() {
            self.clock += 1;
            if let Some(b) = self.blocks.get_mut(id) {
                b.last_used = self.clock;
            }
        }
        Ok(n)
    }

    /// Stores the whole blocks of `session`'s reusable prefix that the cache lacks (none when the
    /// session keeps edits), then evicts the least recently used blocks beyond the budget.
    pub fn store_from(&mut self, session: &CandleSession) -> Result<()> {
        // Reusable tokens are those computed under the session's kept edits: the cache serves
        // sessions without any, so only an unedited session's positions may go in.
        let tokens = if session.edits.set.is_empty() { session.reusable_tokens() } else { &[] };
        let whole = tokens.len() / self.block_tokens;
        if whole == 0 || self.budget_bytes == 0 {
            return Ok(());
        }
        let held = session.cache.held().ctx(|| "reading the KV cache for the prefix cache".to_string())?;
        let mut parent = ROOT;
        let mut path = Vec::with_capacity(whole);
        for (b, chunk) in tokens.chunks_exact(self.block_tokens).enumerate() {
            let key = (parent, chunk.to_vec());
            let id = match self.index.get(&key) {
                Some(&id) => id,
                None => {
                    let start = b * self.block_tokens;
                    let ctx = || format!("copying block {b} of a prompt into the prefix cache");
                    let mut layers = Vec::with_capacity(held.len());
                    for kv in &held {
                        let Some((k, v)) = kv else { return Ok(()) };
                        // A buffer of the block's own: the session overwrites its cache in place.
                        let k = owned_copy(&k.narrow(2, start, self.block_tokens).ctx(ctx)?).ctx(ctx)?;
                        let v = owned_copy(&v.narrow(2, start, self.block_tokens).ctx(ctx)?).ctx(ctx)?;
                        layers.push((k, v));
                    }
                    let bytes = layers
                        .iter()
                        .map(|(k, v)| (k.elem_count() + v.elem_count()) * k.dtype().size_in_bytes())
                        .sum();
                    if bytes > self.budget_bytes {
                        break;
                    }
                    let id = self.next_id;
                    self.next_id += 1;
                    self.index.insert(key.clone(), id);
                    self.blocks.insert(id, Block { key, layers, bytes, last_used: 0 });
                    self.stats.bytes += bytes;
                    id
                }
            };
            path.push(id);
            parent = id;
        }
        for id in path.iter().rev() {
            self.clock += 1;
            if let Some(b) = self.blocks.get_mut(id) {
                b.last_used = self.clock;
            }
        }
        self.evict();
        Ok(())
    }

    /// Drops least recently used blocks until the budget holds.
    fn evict(&mut self) {
        while self.stats.bytes > self.budget_bytes {
            let Some((&id, _)) = self.blocks.iter().min_by_key(|(_, b)| b.last_used) else { break };
            let b = self.blocks.remove(&id).expect("found above");
            self.index.remove(&b.key);
            self.stats.bytes -= b.bytes;
            self.stats.evictions += 1;
        }
    }
}
