//! The candle session: a shared decoder, its own KV cache, position and kept edits.

mod adapters;
pub mod embed;
pub mod images;
pub mod prefix_cache;
pub mod prefix_disk;
pub mod sae;
pub mod snapshot;

use std::sync::Arc;

use candle_core::{Device, Tensor};

use crate::backend::blocks::hooks::{NoHooks, ReadyEdits, StepHooks};
use crate::backend::blocks::lora::{self, cached, computed_under, ActiveAdapters, CachedAdapters};
use crate::backend::decoder::{BatchItem, Decoder, LogitsRows, StepKind};
use crate::backend::device::CandleBackend;
use crate::backend::error::{CandleContext, CandleError, Result};
use crate::backend::host::to_host_f32;
use crate::backend::kv_cache::{HeldKv, KvCache};
use images::{ImageHooks, ImageSpan};
pub use prefix_cache::{PrefixCache, PrefixCacheStats};
pub use prefix_disk::{PrefixDisk, PrefixDiskStats};
pub use snapshot::SessionSnapshot;

use crate::core::{
    BackendSession, BatchSession, Completion, DecodeInput, HostLogits, InspectableBackendSession, InspectedOutput,
    Intervention, InterventionError, InterventionSession, InterventionSet, ObservationRequest, ObservationSet,
    ObservationValue, PrefillInput, SessionCapabilities, SnapshotSession, Submission,
};

/// A step's logits, still on the device.
#[derive(Debug, Clone)]
pub struct StepOutput {
    /// Logits `[rows, vocab]` in the model's dtype.
    pub logits: Tensor,
    /// The position of the first token of the step.
    pub start_position: usize,
    /// The number of tokens the step appended.
    pub num_tokens: usize,
}

impl StepOutput {
    /// Copies the logits to the host as float32 `[rows, vocab]` in row-major order.
    pub fn logits_f32(&self) -> Result<(Vec<usize>, Vec<f32>)> {
        to_host_f32(&self.logits).ctx(|| "copying logits to the host".into())
    }
}

/// Completion of one step: CPU work is done when returned; accelerators synchronise on wait.
#[derive(Debug, Clone)]
pub struct CandleCompletion {
    device: Device,
}

impl Completion for CandleCompletion {
    type Error = CandleError;

    fn is_complete(&self) -> Result<bool> {
        // candle exposes no per-submission events, so an accelerator is asked to finish its
        // queue; on the CPU the work finished before the submission was returned.
        if self.device.is_cpu() {
            return Ok(true);
        }
        self.device.synchronize().ctx(|| "synchronising the device".into())?;
        Ok(true)
    }

    fn wait(self) -> Result<()> {
        self.device.synchronize().ctx(|| "synchronising the device".into())
    }
}

/// Edits kept on a session: as given (validated) and made ready for the device.
#[derive(Debug, Clone, Default)]
struct KeptEdits {
    set: InterventionSet,
    ready: ReadyEdits,
}

/// The one execution session of a prepared model; the decoder is shared, the cache its own.
#[derive(Debug)]
pub struct CandleSession {
    decoder: Arc<Decoder>,
    cache: KvCache,
    /// The token ids the cache holds, so a new prompt can reuse a shared prefix.
    tokens: Vec<u32>,
    capabilities: SessionCapabilities,
    edits: KeptEdits,
    /// How many leading cached positions were computed under the kept edits as they are now
    /// (and no per-call edit): a cache filled under other edits must not serve a new prompt.
    reusable: usize,
    /// Positions a ring keeps beyond its window, when not `RING_SLACK` (tests).
    ring_slack: Option<usize>,
    /// The most tokens one step of a longer call runs (`PREFILL_CHUNK` unless the model was
    /// loaded with `prefill_chunk`).
    prefill_chunk: usize,
    /// Images staged for the next calls that cover their positions (`stage_images`).
    images: Vec<ImageSpan>,
    /// The LoRA adapters its steps run with (swapped per call through a shared reference, so a
    /// generation in progress does not count the swap as a change of its session), and those its
    /// reusable positions were computed under (`adapters.rs`).
    adapters: std::sync::Mutex<ActiveAdapters>,
    cache_adapters: CachedAdapters,
    /// Counts the changes of this session's state (`BackendSession::changes`).
    changes: u64,
}

/// The most prompt tokens one step runs by default: a longer prompt runs in chunks. The KV
/// cache's ring slack is sized for it, so a chunk fits beside a sliding window without growing it.
pub const PREFILL_CHUNK: usize = crate::backend::kv_cache::RING_SLACK;

impl CandleSession {
    /// A session over a shared `decoder` with a cache of `max_context` positions.
    /// A call longer than `prefill_chunk` tokens runs in steps of that many.
    pub(crate) fn new(
        decoder: Arc<Decoder>,
        max_context: usize,
        prefill_chunk: usize,
        capabilities: SessionCapabilities,
    ) -> Self {
        Self {
            cache: decoder.new_cache(max_context),
            decoder,
            tokens: Vec::new(),
            capabilities,
            edits: KeptEdits::default(),
            reusable: 0,
            ring_slack: None,
            prefill_chunk: prefill_chunk.max(1),
            images: Vec::new(),
            adapters: Default::default(),
            cache_adapters: Vec::new(),
            changes: 0,
        }
    }

    /// Stages images: a later call covering an image's positions reads its embeddings there
    /// (each `[tokens, hidden]`, float32) instead of the tokens'. They stay staged until
    /// `clear_images`. Refused (nothing staged) when one is the wrong width or images overlap.
    pub fn stage_images(&mut self, mut images: Vec<ImageSpan>) -> Result<()> {
        let h = self.decoder.config().hidden_size;
        images.sort_by_key(|s| s.start);
        for (i, s) in images.iter().enumerate() {
            let dims = s.embeds.dims();
            if dims.len() != 2 || dims[1] != h || dims[0] == 0 {
                return Err(CandleError::InvalidInput {
                    operation: "images",
                    reason: format!("image {i}'s embeddings are {dims:?}; [tokens, {h}] expected"),
                });
            }
            if i > 0 && images[i - 1].end() > s.start {
                return Err(CandleError::InvalidInput {
                    operation: "images",
                    reason: format!("image {i} overlaps the image before it"),
                });
            }
        }
        // Nothing staged over nothing staged changes nothing.
        if !(images.is_empty() && self.images.is_empty()) {
            self.images = images;
            self.changes += 1;
        }
        Ok(())
    }

    /// Unstages every image.
    pub fn clear_images(&mut self) {
        if !self.images.is_empty() {
            self.images.clear();
            self.changes += 1;
        }
    }

    /// The images lying in positions `start..end`; an image cut by either end is refused.
    fn images_in(&self, operation: &'static str, start: usize, end: usize) -> Result<Vec<ImageSpan>> {
        let mut inside = Vec::new();
        for s in &self.images {
            if s.end() <= start || s.start >= end {
                continue;
            }
            if s.start < start || s.end() > end {
                return Err(CandleError::InvalidInput {
                    operation,
                    reason: format!(
                        "positions {start}..{end} cut the image at positions {}..{}: an image's tokens run in one call",
                        s.start,
                        s.end()
                    ),
                });
            }
            inside.push(s.clone());
        }
        Ok(inside)
    }

    /// The decoder this session runs (shared with every session of the same model).
    pub fn decoder(&self) -> &Arc<Decoder> {
        &self.decoder
    }

    /// Runs `change` on the decoder (to change its weights: a merged LoRA adapter) where no other
    /// session shares it. When it succeeds, the cache, computed with the old weights, is emptied;
    /// when it fails, nothing changed. Err: how many other holders the decoder has.
    pub fn change_decoder<T, E>(
        &mut self,
        change: impl FnOnce(&mut Decoder) -> std::result::Result<T, E>,
    ) -> std::result::Result<std::result::Result<T, E>, usize> {
        let others = Arc::strong_count(&self.decoder) - 1;
        let Some(decoder) = Arc::get_mut(&mut self.decoder) else { return Err(others) };
        let result = change(decoder);
        if result.is_ok() {
            self.changes += 1;
            self.cache.reset();
            self.tokens.clear();
            self.reusable = 0;
            self.cache_adapters = Vec::new();
        }
        Ok(result)
    }

    /// The most tokens one step runs: a longer call runs in steps of this many.
    pub fn prefill_chunk(&self) -> usize {
        self.prefill_chunk
    }

    /// Bytes held by the KV cache.
    pub fn cache_bytes(&self) -> usize {
        self.cache.allocated_bytes()
    }

    /// Replaces what the session holds by `tokens` and their keys and values `held` (per layer,
    /// the positions it needs, in buffers the cache may own), computed with no edit: the prefix
    /// cache's restore. The caller checked that no edit is kept.
    fn install_prefix(&mut self, tokens: Vec<u32>, held: Vec<Option<HeldKv>>) -> Result<()> {
        let n = tokens.len();
        let windows = self.cache.windows();
        let mut cache = KvCache::from_held(held, n, self.cache.max_context(), &windows)
            .ctx(|| format!("installing a cached prefix of {n} tokens"))?;
        cache.set_ring_slack(self.ring_slack());
        self.cache = cache;
        self.tokens = tokens;
        self.reusable = n;
        self.cache_adapters = Vec::new();
        self.changes += 1;
        Ok(())
    }

    /// Positions each sliding-window layer keeps beyond its window.
    fn ring_slack(&self) -> usize {
        self.ring_slack.unwrap_or(crate::backend::kv_cache::RING_SLACK)
    }

    /// Makes every sliding-window layer keep only its window plus `slack` positions (tests: the
    /// rings then wrap within a few tokens).
    #[doc(hidden)]
    pub fn set_ring_slack(&mut self, slack: usize) {
        self.ring_slack = Some(slack);
        self.cache.set_ring_slack(slack);
        self.changes += 1;
    }

    /// Makes this session's cache hold every position of every layer, windows or not (tests:
    /// the reference a windowed cache must equal). Empties the session.
    #[doc(hidden)]
    pub fn use_full_cache(&mut self) {
        self.cache = KvCache::new(&vec![None; self.decoder.config().num_layers()], self.cache.max_context());
        self.tokens.clear();
        self.reusable = 0;
        self.changes += 1;
    }

    /// The smallest position above 0 the session can be truncated to (0 when it holds every
    /// position it needs to rewind anywhere).
    pub fn earliest_truncate(&self) -> usize {
        self.cache.earliest_truncate()
    }

    /// Validates `edits` against this model and readies them for its device.
    fn ready(&self, edits: Vec<Intervention>) -> Result<KeptEdits> {
        let d = &self.decoder;
        let saes = d.saes().current();
        let named: Vec<_> = saes.iter().map(|s| (s.name.clone(), s.point, s.d_sae())).collect();
        let set = InterventionSet::with_saes(edits, |p| d.point_shape(p), &named, self.cache.max_context())?;
        let ready = ReadyEdits::new(&set, |p| d.point_shape(p).unwrap_or_default(), &saes, d.device())?;
        Ok(KeptEdits { set, ready })
    }

    /// The kept edits followed by a call's own.
    fn edits_for_call(&self, call: Vec<Intervention>) -> Result<ReadyEdits> {
        if call.is_empty() {
            return Ok(self.edits.ready.clone());
        }
        if !self.capabilities.activation_intervention {
            return Err(CandleError::InvalidInput {
                operation: "intervention",
                reason: "this session cannot apply interventions".into(),
            });
        }
        Ok(self.edits.ready.then(&self.ready(call)?.ready))
    }

    /// Refuses a call of `tokens` tokens run in steps of `t` that would need more memory than the
    /// machine has free. `kept` counts what the call holds besides (observations, every row's logits).
    fn check_memory(
        &self,
        operation: &'static str,
        tokens: usize,
        t: usize,
        rows: LogitsRows,
        kept: u64,
    ) -> Result<()> {
        let position = self.cache.len();
        let needed = self.decoder.step_bytes(position, t, rows).saturating_add(kept);
        match crate::memory::available_bytes() {
            Some(available) if needed > available => Err(CandleError::OutOfMemory {
                operation,
                tokens,
                position,
                needed_mib: needed >> 20,
                available_mib: available >> 20,
                hint: if rows == LogitsRows::All && operation == "prefill" {
                    "; every row's logits were asked for: ask for the last row's only, or run fewer tokens".into()
                } else {
                    "; run fewer tokens at once, or a smaller context".into()
                },
            }),
            _ => Ok(()),
        }
    }

    /// About how many bytes the points `request` selects hold for a step of `t` tokens: every
    /// layer's attention pattern spans the whole cache.
    fn observation_bytes(&self, request: &ObservationRequest, t: usize) -> u64 {
        let c = self.decoder.config();
        let keys = (self.cache.len() + t) as u64;
        let row = [c.hidden_size, c.intermediate_size, c.vocab_size, c.num_heads * c.head_dim].into_iter().max();
        let (pattern, other) = (
            (c.num_heads as u64).saturating_mul(t as u64).saturating_mul(keys).saturating_mul(4),
            (t as u64).saturating_mul(row.unwrap_or(0) as u64 * 4),
        );
        self.decoder
            .observation_points()
            .iter()
            .filter(|p| request.matches(p))
            .map(|p| if p.ends_with("attention.pattern") { pattern } else { other })
            .fold(0u64, u64::saturating_add)
    }

    /// One call's tokens, in steps of at most `prefill_chunk` tokens so that its attention scores
    /// and activations are one chunk's however long the prompt. Edits apply at their absolute
    /// positions in whichever chunk holds them, and observations are assembled from the chunks
    /// into what one step would have recorded. On failure the session is as it was.
    fn run_steps(
        &mut self,
        operation: &'static str,
        tokens: &[u32],
        rows: LogitsRows,
        request: Option<&ObservationRequest>,
        edits: &ReadyEdits,
    ) -> Result<InspectedOutput<StepOutput>> {
        self.check_append(self.cache.len(), tokens).map_err(|e| match e {
            CandleError::InvalidInput { reason, .. } => CandleError::InvalidInput { operation, reason },
            other => other,
        })?;
        let chunk = self.prefill_chunk;
        let chunked = tokens.len() > chunk;
        let mut kept = request.map_or(0, |r| self.observation_bytes(r, tokens.len()));
        if chunked && rows == LogitsRows::All {
            // Every chunk's logits are kept, then joined: twice the whole prompt's.
            let vocab = self.decoder.config().vocab_size as u64;
            kept = kept.saturating_add((tokens.len() as u64).saturating_mul(vocab).saturating_mul(8));
        }
        self.check_memory(operation, tokens.len(), tokens.len().min(chunk), rows, kept)?;
        let start = self.cache.len();
        if chunked {
            self.cache.reserve(start + tokens.len());
        }
        let kind = if matches!(operation, "decode" | "inspect_decode") { StepKind::Decode } else { StepKind::Prompt };
        let plain = request.is_none() && edits.is_empty();
        let saes = self.decoder.saes().current();
        let active = self.adapters();
        let mut hooks = StepHooks::new(request, edits, start, tokens.len()).with_saes(&saes);
        let mut logits = Vec::new();
        let images = self.images_in(operation, start, start + tokens.len())?;
        let bidirectional = self.decoder.vision().is_some_and(|v| v.config().bidirectional);
        let mut at = start;
        for end in images::step_ends(start, tokens.len(), chunk, &images) {
            let part = &tokens[at - start..end - start];
            let here: Vec<ImageSpan> = images.iter().filter(|s| s.start >= at && s.end() <= end).cloned().collect();
            let step_start = at;
            at = end;
            // The plain forward pass: no hook is even consulted.
            let (decoder, cache) = (&self.decoder, &mut self.cache);
            let step = lora::with_plan(&[Some(&active)], &[part.len()], || match (plain, here.is_empty()) {
                (true, true) => decoder.forward(part, cache, rows, kind, &mut NoHooks),
                (false, true) => decoder.forward(part, cache, rows, kind, &mut hooks),
                (true, false) => {
                    let mut h = ImageHooks { inner: NoHooks, images: &here, start: step_start, bidirectional };
                    decoder.forward(part, cache, rows, kind, &mut h)
                }
                (false, false) => {
                    let mut h = ImageHooks { inner: &mut hooks, images: &here, start: step_start, bidirectional };
                    decoder.forward(part, cache, rows, kind, &mut h)
                }
            });
            let step = step
                .map_err(|source| CandleError::Candle {
                    context: format!("running {operation} at position {}", self.cache.len()),
                    source: crate::backend::error::without_backtrace(source),
                })
                .and_then(|out| if plain { Ok(out) } else { hooks.end_step(part.len()).map(|()| out) });
            match step {
                Ok(out) => {
                    // Only the last chunk's row is the prompt's: an earlier one kept until the end
                    // cost a vocabulary row per chunk (Gemma 3: 1 MiB, 195 MiB over 100,000 tokens).
                    if rows == LogitsRows::Last {
                        logits.clear();
                    }
                    logits.push(out);
                    self.tokens.extend_from_slice(part);
                }
                Err(e) => {
                    self.cache.truncate(start);
                    self.tokens.truncate(start);
                    return Err(e);
                }
            }
        }
        let logits = match logits.len() {
            1 => logits.pop().expect("one step's logits"),
            _ => Tensor::cat(&logits, 0).ctx(|| format!("joining the logits of {operation}'s chunks"))?,
        };
        if chunked {
            // A long call's chunk buffers are free now (`memory::release_freed_memory` says why).
            crate::memory::release_freed_memory();
        }
        let observations = if plain { ObservationSet::new() } else { hooks.finish()? };
        Ok(InspectedOutput {
            output: StepOutput { logits, start_position: start, num_tokens: tokens.len() },
            observations,
        })
    }

    /// One call with the kept and the call's edits, recording what `request` selects.
    fn run(
        &mut self,
        operation: &'static str,
        tokens: &[u32],
        rows: LogitsRows,
        call_edits: Vec<Intervention>,
        request: Option<&ObservationRequest>,
    ) -> Result<InspectedOutput<StepOutput>> {
        self.refuse_encoder(operation)?;
        if let Some(r) = request {
            r.validate(self.decoder.observation_points().iter().map(String::as_str))?;
        }
        let start = self.cache.len();
        // Positions computed from an image are not reusable by token ids alone.
        let clean = call_edits.is_empty() && self.images_in(operation, start, start + tokens.len())?.is_empty();
        let edits = self.edits_for_call(call_edits)?;
        let result = self.run_steps(operation, tokens, rows, request, &edits)?;
        self.appended(start, clean);
        Ok(result)
    }

    /// Keeps `reusable` true after positions `start..` were appended, with (`clean`) or without
    /// only the kept edits.
    fn appended(&mut self, start: usize, clean: bool) {
        self.changes += 1;
        if !self.cache_under_adapters(start) {
            return;
        }
        if clean && self.reusable == start {
            self.reusable = self.cache.len();
        }
    }

    /// Refuses a decoder step on an encoder-only model (its decoder only stands in).
    pub(crate) fn refuse_encoder(&self, operation: &'static str) -> Result<()> {
        match self.decoder.encoder() {
            Some(e) => Err(CandleError::EncoderOnly { operation, family: e.config().family.name() }),
            None => Ok(()),
        }
    }

    /// The logit lens: final norm, output projection and soft-capping of float32 `[T, H]`.
    pub fn unembed(&self, shape: &[usize], data: Vec<f32>) -> Result<(Vec<usize>, Vec<f32>)> {
        self.refuse_encoder("unembed")?;
        let h = self.decoder.config().hidden_size;
        if shape.len() != 2 || shape[1] != h || data.len() != shape[0] * h {
            return Err(CandleError::InvalidInput {
                operation: "unembed",
                reason: format!("expected a float32 array of shape [T, {h}], got {shape:?}"),
            });
        }
        let x = Tensor::from_vec(data, (shape[0], h), self.decoder.device()).ctx(|| "unembed input".into())?;
        let y = self.decoder.unembed(&x).ctx(|| "running unembed".into())?;
        to_host_f32(&y).ctx(|| "copying unembed logits to the host".into())
    }

    fn completion(&self, backend: &CandleBackend) -> CandleCompletion {
        CandleCompletion { device: backend.device().clone() }
    }
}

impl BackendSession<CandleBackend> for CandleSession {
    type PrefillInput = PrefillInput;
    type DecodeInput = DecodeInput;
    type Output = StepOutput;
    type Completion = CandleCompletion;

    fn capabilities(&self) -> SessionCapabilities {
        self.capabilities
    }

    fn prefill(&mut self, b: &CandleBackend, input: PrefillInput) -> Result<Submission<StepOutput, CandleCompletion>> {
        let rows = if input.all_logits { LogitsRows::All } else { LogitsRows::Last };
        let out = self.run("prefill", &input.tokens, rows, input.interventions, None)?.output;
        Ok(Submission::new(out, self.completion(b)))
    }

    fn decode(&mut self, b: &CandleBackend, input: DecodeInput) -> Result<Submission<StepOutput, CandleCompletion>> {
        let out = self.run("decode", &input.tokens, LogitsRows::All, input.interventions, None)?.output;
        Ok(Submission::new(out, self.completion(b)))
    }

    fn observe_output(&self, _b: &CandleBackend, output: &StepOutput) -> Result<ObservationSet> {
        let (shape, data) = output.logits_f32()?;
        let mut set = ObservationSet::new();
        set.insert("model.logits", ObservationValue::Tensor { shape, data })?;
        Ok(set)
    }

    fn logits_to_host(&self, output: &StepOutput) -> Result<HostLogits> {
        let (shape, data) = output.logits_f32()?;
        Ok(HostLogits { rows: shape[0], vocab: shape[1], data })
    }

    fn position(&self) -> usize {
        self.cache.len()
    }

    fn max_context(&self) -> usize {
        self.cache.max_context()
    }

    fn tokens(&self) -> &[u32] {
        &self.tokens
    }

    fn reserve(&mut self, total: usize) {
        self.cache.reserve(total);
    }

    fn vocab_size(&self) -> usize {
        self.decoder.config().vocab_size
    }

    fn reusable_tokens(&self) -> &[u32] {
        // Positions computed under other adapters serve no prompt run with these.
        if !computed_under(&self.adapters(), &self.cache_adapters) {
            return &[];
        }
        &self.tokens[..self.reusable.min(self.tokens.len())]
    }

    fn check_append(&self, at: usize, tokens: &[u32]) -> Result<()> {
        self.refuse_encoder("a decoder step")?;
        if tokens.is_empty() {
            return Err(CandleError::InvalidInput { operation: "step", reason: "no tokens given".into() });
        }
        let vocab_size = self.decoder.config().vocab_size;
        if let Some((index, &token)) = tokens.iter().enumerate().find(|(_, &t)| t as usize >= vocab_size) {
            return Err(CandleError::TokenOutOfRange { token, index, vocab_size });
        }
        let max_context = self.cache.max_context();
        if at + tokens.len() > max_context {
            return Err(CandleError::ContextFull { position: at, requested: tokens.len(), max_context });
        }
        Ok(())
    }

    fn truncate(&mut self, n: usize) -> Result<()> {
        if n > self.cache.len() {
            return Err(CandleError::InvalidInput {
                operation: "truncate",
                reason: format!("cannot truncate to {n} tokens: the session holds only {}", self.cache.len()),
            });
        }
        if !self.cache.can_truncate(n) {
            return Err(CandleError::WindowRewind {
                requested: n,
                position: self.cache.len(),
                earliest: self.cache.earliest_truncate(),
            });
        }
        self.cache.truncate(n);
        self.tokens.truncate(n);
        self.reusable = self.reusable.min(n);
        // Even a truncate to where the session is counts: a caller between two steps of its own
        // cannot tell what happened in between.
        self.changes += 1;
        Ok(())
    }

    fn can_truncate(&self, n: usize) -> bool {
        self.cache.can_truncate(n)
    }

    fn reset(&mut self) {
        self.cache.reset();
        self.tokens.clear();
        self.reusable = 0;
        self.changes += 1;
    }

    fn stop_token_ids(&self) -> Vec<u32> {
        self.decoder.config().eos_token_ids.clone()
    }

    fn changes(&self) -> u64 {
        self.changes
    }

    fn step_end(&self, _start: usize, end: usize) -> usize {
        images::unsplit(&self.images, end)
    }
}

impl InspectableBackendSession<CandleBackend> for CandleSession {
    fn observation_points(&self) -> Vec<String> {
        self.decoder.observation_points()
    }

    fn inspect_prefill(
        &mut self,
        _b: &CandleBackend,
        input: PrefillInput,
        request: &ObservationRequest,
    ) -> Result<InspectedOutput<StepOutput>> {
        let rows = if input.all_logits { LogitsRows::All } else { LogitsRows::Last };
        self.run("inspect_prefill", &input.tokens, rows, input.interventions, Some(request))
    }

    fn inspect_decode(
        &mut self,
        _b: &CandleBackend,
        input: DecodeInput,
        request: &ObservationRequest,
    ) -> Result<InspectedOutput<StepOutput>> {
        self.run("inspect_decode", &input.tokens, LogitsRows::All, input.interventions, Some(request))
    }

    fn trace(
        &self,
        _b: &CandleBackend,
        input: PrefillInput,
        request: &ObservationRequest,
    ) -> Result<InspectedOutput<StepOutput>> {
        // A scratch session over the same weights and edits: this one's cache is never touched.
        let mut scratch = self.fork_empty()?;
        scratch.run("trace", &input.tokens, LogitsRows::All, input.interventions, Some(request))
    }
}

impl BatchSession<CandleBackend> for CandleSession {
    fn decode_batch(
        backend: &CandleBackend,
        sessions: &mut [&mut CandleSession],
        inputs: Vec<DecodeInput>,
    ) -> Result<Vec<Submission<StepOutput, CandleCompletion>>> {
        let refuse = |reason: String| CandleError::InvalidInput { operation: "decode_batch", reason };
        if sessions.len() != inputs.len() {
            return Err(refuse(format!("{} sessions but {} inputs", sessions.len(), inputs.len())));
        }
        let Some(first) = sessions.first() else { return Ok(Vec::new()) };
        let decoder = Arc::clone(&first.decoder);
        // Everything is checked before any session moves, so a refused batch changes nothing.
        let mut edits = Vec::with_capacity(sessions.len());
        for (s, input) in sessions.iter().zip(&inputs) {
            if !Arc::ptr_eq(&s.decoder, &decoder) {
                return Err(refuse("the sessions belong to different models".into()));
            }
            s.check_append(s.cache.len(), &input.tokens)?;
            edits.push(s.edits_for_call(input.interventions.clone())?);
        }
        let starts: Vec<usize> = sessions.iter().map(|s| s.cache.len()).collect();
        let active: Vec<ActiveAdapters> = sessions.iter().map(|s| s.adapters()).collect();
        let active: Vec<Option<&ActiveAdapters>> = active.iter().map(Some).collect();
        let lens: Vec<usize> = inputs.iter().map(|i| i.tokens.len()).collect();
        let result = lora::with_plan(&active, &lens, || {
            if edits.iter().all(ReadyEdits::is_empty) {
                let mut items: Vec<BatchItem<'_, NoHooks>> = sessions
                    .iter_mut()
                    .zip(&inputs)
                    .map(|(s, i)| BatchItem { ids: &i.tokens, cache: &mut s.cache, hooks: NoHooks })
                    .collect();
                decoder.forward_batch(&mut items, LogitsRows::All, StepKind::Decode)
            } else {
                let mut items: Vec<BatchItem<'_, StepHooks<'_>>> = sessions
                    .iter_mut()
                    .zip(&inputs)
                    .zip(&edits)
                    .zip(&starts)
                    .map(|(((s, i), e), &pos)| BatchItem {
                        ids: &i.tokens,
                        cache: &mut s.cache,
                        hooks: StepHooks::new(None, e, pos, i.tokens.len()),
                    })
                    .collect();
                decoder.forward_batch(&mut items, LogitsRows::All, StepKind::Decode)
            }
        });
        match result {
            Ok(logits) => Ok(sessions
                .iter_mut()
                .zip(inputs)
                .zip(logits)
                .zip(starts)
                .map(|(((s, input), logits), start)| {
                    let num_tokens = input.tokens.len();
                    s.tokens.extend(input.tokens);
                    s.appended(start, input.interventions.is_empty());
                    Submission::new(StepOutput { logits, start_position: start, num_tokens }, s.completion(backend))
                })
                .collect()),
            Err(source) => {
                for (s, start) in sessions.iter_mut().zip(starts) {
                    s.cache.truncate(start);
                }
                Err(CandleError::Candle {
                    context: "running a batched decode".into(),
                    source: crate::backend::error::without_backtrace(source),
                })
            }
        }
    }
}

impl SnapshotSession<CandleBackend> for CandleSession {
    type Snapshot = SessionSnapshot;

    fn fork(&self) -> Result<Self> {
        Ok(Self {
            decoder: Arc::clone(&self.decoder),
            cache: self.cache.deep_copy().ctx(|| "copying the KV cache for a fork".into())?,
            tokens: self.tokens.clone(),
            capabilities: self.capabilities,
            edits: self.edits.clone(),
            reusable: self.reusable,
            ring_slack: self.ring_slack,
            prefill_chunk: self.prefill_chunk,
            images: Vec::new(),
            adapters: std::sync::Mutex::new(self.adapters()),
            cache_adapters: self.cache_adapters.clone(),
            changes: 0,
        })
    }

    fn fork_empty(&self) -> Result<Self> {
        let mut cache = KvCache::new(&self.cache.windows(), self.cache.max_context());
        cache.set_ring_slack(self.ring_slack());
        Ok(Self {
            decoder: Arc::clone(&self.decoder),
            cache,
            tokens: Vec::new(),
            capabilities: self.capabilities,
            edits: self.edits.clone(),
            reusable: 0,
            ring_slack: self.ring_slack,
            prefill_chunk: self.prefill_chunk,
            // A trace runs on an empty fork: the images staged for it go along.
            images: self.images.clone(),
            adapters: std::sync::Mutex::new(self.adapters()),
            cache_adapters: cached(&self.adapters()),
            changes: 0,
        })
    }

    fn snapshot(&self) -> Result<SessionSnapshot> {
        Ok(SessionSnapshot {
            tokens: self.tokens.clone(),
            layers: self.cache.held().ctx(|| "copying the KV cache for a snapshot".into())?,
            kv_cache_type: self.decoder.cache_type(),
            fingerprint: self.decoder.fingerprint().to_owned(),
            // Only a cache computed with no edit at all is reusable by whoever restores it.
            clean_prefix: if self.plain_cache() { self.reusable } else { 0 },
        })
    }

    fn restore(&mut self, snap: &SessionSnapshot) -> Result<()> {
        let refuse = |reason: String| CandleError::InvalidInput { operation: "restore", reason };
        if snap.fingerprint != self.decoder.fingerprint() {
            return Err(refuse(format!(
                "the snapshot belongs to another model (fingerprint {}, this model's is {})",
                snap.fingerprint,
                self.decoder.fingerprint()
            )));
        }
        let c = self.decoder.config();
        let position = snap.tokens.len();
        if position > self.cache.max_context() {
            return Err(refuse(format!(
                "the snapshot holds {position} tokens, more than this session's context of {}",
                self.cache.max_context()
            )));
        }
        if let Some(&t) = snap.tokens.iter().find(|&&t| t as usize >= c.vocab_size) {
            return Err(refuse(format!("the snapshot holds token {t}, outside the vocabulary")));
        }
        let ty = self.decoder.cache_type();
        if position > 0 && snap.kv_cache_type != ty {
            return Err(refuse(format!(
                "the snapshot's KV cache is {}, this session's {}",
                snap.kv_cache_type.name(),
                ty.name()
            )));
        }
        if snap.layers.len() != c.num_layers() {
            return Err(refuse(format!("the snapshot has {} layers, the model {}", snap.layers.len(), c.num_layers())));
        }
        let (dtype, row) = ty.storage(c.head_dim);
        let mut layers = Vec::with_capacity(snap.layers.len());
        for (i, kv) in snap.layers.iter().enumerate() {
            layers.push(match kv {
                None => None,
                Some(h) => {
                    let want = [1, c.num_kv_heads, position.saturating_sub(h.first), row];
                    if h.first >= position || h.k.dims() != want || h.v.dims() != want || h.k.dtype() != dtype {
                        return Err(refuse(format!(
                            "layer {i}'s keys and values do not have shape {want:?} and dtype {dtype:?}"
                        )));
                    }
                    // Moved to this device; `from_held` copies into buffers of the session's own,
                    // so the snapshot stays reusable.
                    let dev = self.decoder.device();
                    let (k, v) = (h.k.to_device(dev), h.v.to_device(dev));
                    Some(HeldKv {
                        first: h.first,
                        k: k.ctx(|| "restoring keys".into())?,
                        v: v.ctx(|| "restoring values".into())?,
                    })
                }
            });
        }
        let mut cache = KvCache::from_held(layers, position, self.cache.max_context(), &self.cache.windows())
            .map_err(|e| refuse(e.to_string()))?;
        cache.set_ring_slack(self.ring_slack());
        self.cache = cache;
        self.tokens = snap.tokens.clone();
        self.reusable = if self.edits.set.is_empty() { snap.clean_prefix.min(position) } else { 0 };
        // A snapshot's clean prefix was computed with no adapter.
        self.cache_adapters = Vec::new();
        self.changes += 1;
        Ok(())
    }
}

impl InterventionSession<CandleBackend> for CandleSession {
    fn set_interventions(&mut self, edits: Vec<Intervention>) -> std::result::Result<(), InterventionError> {
        let before = self.edits.set.clone();
        if edits.is_empty() {
            self.edits = KeptEdits::default();
        } else {
            self.edits = self.ready(edits).map_err(|e| match e {
                CandleError::Intervention(e) => e,
                // Validation passed; only moving the vectors onto the device can fail here.
                other => InterventionError::Invalid {
                    point: "(all)".into(),
                    op: "prepare",
                    reason: format!("cannot place the edits on the device: {other}"),
                },
            })?;
        }
        if self.edits.set != before {
            // The cache was filled under other edits: it may be continued, never reused.
            self.reusable = 0;
        }
        Ok(())
    }

    fn interventions(&self) -> Vec<Intervention> {
        self.edits.set.interventions()
    }
}
