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
//!
//! A sliding-window layer's ring keeps only its last positions, so a block stores that layer's
//! keys and values only where the session still held them (`None` otherwise, filled in when a
//! later session that holds them stores the block again). A prefix is restored only up to a
//! block boundary where every windowed layer's window is in the blocks: what a ring needs to
//! continue, never less.
//!
//! With a disk tier (`with_disk`, `prefix_disk.rs`) every block stored is also written to a
//! directory, and `load_from_disk` brings the blocks of a prompt that memory lacks back from it
//! (checked, exact tokens), so the cache outlives the process.

use std::collections::HashMap;

use candle_core::Tensor;

use super::prefix_disk::{BlockIdentity, PrefixDisk, PrefixDiskStats};
use super::CandleSession;
use crate::backend::error::{CandleContext, Result};
use crate::backend::kv_cache::{HeldKv, KvView};
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
    /// The disk tier's counters (all 0 without one).
    pub disk: PrefixDiskStats,
}

/// One block: its tokens' keys and values in every layer, `[1, kv_heads, block_tokens, row]`
/// (`None` for a windowed layer whose ring no longer held them when the block was stored).
#[derive(Debug)]
struct Block {
    key: (u64, Vec<u32>),
    layers: Vec<Option<(Tensor, Tensor)>>,
    bytes: usize,
    last_used: u64,
}

/// Keys and values of prompt prefixes, in blocks, under a byte budget (see the module's notes).
#[derive(Debug)]
pub struct PrefixCache {
    block_tokens: usize,
    /// Each layer's sliding window (learnt from the first session stored or restored).
    windows: Vec<Option<usize>>,
    budget_bytes: usize,
    /// (parent id, the block's tokens) → block id.
    index: HashMap<(u64, Vec<u32>), u64>,
    blocks: HashMap<u64, Block>,
    next_id: u64,
    clock: u64,
    stats: PrefixCacheStats,
    /// Where blocks are also written, and read back from after a restart.
    disk: Option<PrefixDisk>,
}

impl PrefixCache {
    /// An empty cache of blocks of `block_tokens` positions holding at most `budget_bytes`.
    pub fn new(block_tokens: usize, budget_bytes: usize) -> Self {
        Self {
            block_tokens: block_tokens.max(1),
            windows: Vec::new(),
            budget_bytes,
            index: HashMap::new(),
            blocks: HashMap::new(),
            next_id: ROOT + 1,
            clock: 0,
            stats: PrefixCacheStats::default(),
            disk: None,
        }
    }

    /// The cache with a disk tier: blocks are written to `disk` as they are stored and read
    /// back by `load_from_disk`.
    pub fn with_disk(mut self, disk: PrefixDisk) -> Self {
        self.disk = Some(disk);
        self
    }

    /// What a block file of `session`'s model must match.
    fn identity(&self, session: &CandleSession) -> BlockIdentity {
        let d = &session.decoder;
        let c = d.config();
        let ty = d.cache_type();
        let (dtype, row) = ty.storage(c.head_dim);
        BlockIdentity {
            fingerprint: d.fingerprint().to_owned(),
            kv_cache_type: ty,
            block_tokens: self.block_tokens,
            layers: c.num_layers(),
            shape: [1, c.num_kv_heads, self.block_tokens, row],
            dtype,
        }
    }

    /// Brings the blocks that start `prompt` and that memory lacks back from the disk tier (as
    /// far as they are there and pass their checks), for `session`'s model; the number of
    /// blocks loaded. Without a disk tier, or for a session that keeps edits, nothing.
    pub fn load_from_disk(&mut self, session: &CandleSession, prompt: &[u32]) -> usize {
        if self.disk.is_none() || self.budget_bytes == 0 || !session.edits.set.is_empty() {
            return 0;
        }
        if self.windows.is_empty() {
            self.windows = session.cache.windows();
        }
        let id = self.identity(session);
        let device = session.decoder.device().clone();
        let usable = prompt.len().saturating_sub(1);
        let mut parent = ROOT;
        let mut path = Vec::new();
        let mut loaded = 0;
        for (b, chunk) in prompt[..usable].chunks_exact(self.block_tokens).enumerate() {
            let key = (parent, chunk.to_vec());
            let id_of_block = match self.index.get(&key) {
                Some(&known) => known,
                None => {
                    let end = (b + 1) * self.block_tokens;
                    let disk = self.disk.as_mut().expect("checked above");
                    let Some(layers) = disk.read(&id, &prompt[..end], &device) else { break };
                    let bytes = layers
                        .iter()
                        .flatten()
                        .map(|(k, v)| (k.elem_count() + v.elem_count()) * k.dtype().size_in_bytes())
                        .sum();
                    let new = self.next_id;
                    self.next_id += 1;
                    self.index.insert(key.clone(), new);
                    self.blocks.insert(new, Block { key, layers, bytes, last_used: 0 });
                    self.stats.bytes += bytes;
                    loaded += 1;
                    new
                }
            };
            path.push(id_of_block);
            parent = id_of_block;
        }
        // Newest first from the last block back, as a lookup marks them; then the budget holds.
        for b in path.iter().rev() {
            self.clock += 1;
            if let Some(block) = self.blocks.get_mut(b) {
                block.last_used = self.clock;
            }
        }
        self.evict();
        loaded
    }

    /// Positions per block.
    pub fn block_tokens(&self) -> usize {
        self.block_tokens
    }

    /// The counters, with the blocks and bytes held now.
    pub fn stats(&self) -> PrefixCacheStats {
        let disk = self.disk.as_ref().map(PrefixDisk::stats).unwrap_or_default();
        PrefixCacheStats { blocks: self.blocks.len(), disk, ..self.stats }
    }

    /// The ids of the cached blocks that start `prompt`, in order, up to the last whose end a
    /// session can continue from (every window's keys in the blocks). At least one token of the
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
        while !ids.is_empty() && !self.continuable(&ids) {
            ids.pop();
        }
        ids
    }

    /// The block that holds the first position layer `layer` needs to continue after `ids`.
    fn first_needed(&self, ids: &[u64], layer: usize) -> usize {
        let n = ids.len() * self.block_tokens;
        self.windows.get(layer).copied().flatten().map_or(0, |w| (n + 1).saturating_sub(w) / self.block_tokens)
    }

    /// Whether the blocks `ids` hold every position a session needs to continue after them.
    fn continuable(&self, ids: &[u64]) -> bool {
        (0..self.windows.len())
            .all(|layer| ids[self.first_needed(ids, layer)..].iter().all(|id| self.blocks[id].layers[layer].is_some()))
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
        if self.windows.len() != session.cache.num_layers() {
            return Ok(0);
        }
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
            // A windowed layer's blocks from the one holding the first key it needs.
            let from = self.first_needed(&ids, layer);
            let parts: Vec<&(Tensor, Tensor)> =
                ids[from..].iter().filter_map(|id| self.blocks[id].layers[layer].as_ref()).collect();
            let ks: Vec<&Tensor> = parts.iter().map(|kv| &kv.0).collect();
            let vs: Vec<&Tensor> = parts.iter().map(|kv| &kv.1).collect();
            let ctx = || format!("assembling layer {layer}'s cached prefix of {n} tokens");
            // `cat` writes a buffer of the session's own: the blocks stay shared and unchanged.
            let (k, v) = (Tensor::cat(&ks, 2).ctx(ctx)?, Tensor::cat(&vs, 2).ctx(ctx)?);
            held.push(Some(HeldKv { first: from * self.block_tokens, k, v }));
        }
        session.install_prefix(prompt[..n].to_vec(), held)?;
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
        let tokens = if session.plain_cache() { session.reusable_tokens() } else { &[] };
        let whole = tokens.len() / self.block_tokens;
        if whole == 0 || self.budget_bytes == 0 {
            return Ok(());
        }
        if self.windows.is_empty() {
            self.windows = session.cache.windows();
        }
        let identity = self.disk.as_ref().map(|_| self.identity(session));
        let views: Vec<Option<KvView<'_>>> = session.cache.views();
        if views.len() != self.windows.len() {
            return Ok(());
        }
        let mut parent = ROOT;
        let mut path = Vec::with_capacity(whole);
        for (b, chunk) in tokens.chunks_exact(self.block_tokens).enumerate() {
            let key = (parent, chunk.to_vec());
            let start = b * self.block_tokens;
            let existing = self.index.get(&key).copied();
            // The layers this block lacks that the session still holds (all of them when new).
            let lacking: Vec<usize> = match existing {
                Some(id) => (0..views.len()).filter(|&l| self.blocks[&id].layers[l].is_none()).collect(),
                None => (0..views.len()).collect(),
            };
            let mut layers: Vec<Option<(Tensor, Tensor)>> = vec![None; views.len()];
            let mut bytes = 0;
            for &l in &lacking {
                let Some(view) = views[l].filter(|v| v.first <= start) else { continue };
                let ctx = || format!("copying block {b} of a prompt into the prefix cache");
                // Buffers of the block's own: the session overwrites its cache in place.
                let (k, v) = view.range(start, self.block_tokens).ctx(ctx)?.stored().ctx(ctx)?;
                bytes += (k.elem_count() + v.elem_count()) * k.dtype().size_in_bytes();
                layers[l] = Some((k, v));
            }
            if existing.is_none() && layers.iter().all(Option::is_none) {
                break;
            }
            if bytes > self.budget_bytes {
                break;
            }
            let gained = bytes > 0;
            let id = match existing {
                Some(id) => {
                    let block = self.blocks.get_mut(&id).expect("indexed blocks exist");
                    for (slot, kv) in block.layers.iter_mut().zip(layers) {
                        if kv.is_some() {
                            *slot = kv;
                        }
                    }
                    block.bytes += bytes;
                    self.stats.bytes += bytes;
                    id
                }
                None => {
                    let id = self.next_id;
                    self.next_id += 1;
                    self.index.insert(key.clone(), id);
                    self.blocks.insert(id, Block { key, layers, bytes, last_used: 0 });
                    self.stats.bytes += bytes;
                    id
                }
            };
            if let (Some(disk), Some(identity)) = (self.disk.as_mut(), identity.as_ref()) {
                let prefix = &tokens[..start + self.block_tokens];
                // Written when new or when it gained layers; a block already on disk is only
                // marked as used.
                if gained || !disk.has(identity, prefix) {
                    disk.write(identity, prefix, &self.blocks[&id].layers);
                } else {
                    disk.touch(identity, prefix);
                }
            }
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
