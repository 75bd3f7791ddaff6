//! The engine: many requests over one model, stepped as one continuous batch in a background
//! thread (docs/engine.md). A request joins the running batch at the next step and leaves when
//! it finishes; each streams its own text; a bounded queue refuses work beyond it at once.

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::mpsc::{self, Receiver, RecvTimeoutError, Sender, SyncSender, TryRecvError, TrySendError};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::Duration;

use crate::backend::session::{PrefixCache, PrefixDisk};
use crate::backend::CandleError;
use crate::core::{BackendSession, Intervention};
use crate::generation::{
    step_together, Constraint, GenerateOptions, Generation, GenerationError, GenerationResult, PendingPrefill,
    TokenLogprobs,
};
use crate::model::{Model, ModelError};

/// Why the engine refused or failed a request.
#[derive(Debug, thiserror::Error)]
pub enum EngineError {
    /// The queue already holds `capacity` waiting requests.
    #[error("the engine's queue is full ({capacity} requests waiting); retry later")]
    QueueFull {
        /// The queue's capacity.
        capacity: usize,
    },
    /// The engine was closed.
    #[error("the engine is closed")]
    Closed,
    /// The request failed in the model (a bad option, intervention or prompt, or a step).
    #[error(transparent)]
    Model(#[from] ModelError),
}

/// How an engine schedules.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EngineOptions {
    /// The most sequences decoded together in one step.
    pub max_batch_size: usize,
    /// The most requests waiting to join; more are refused with `QueueFull`.
    pub max_queue: usize,
    /// While the running sequences' KV caches hold this many bytes, no new one joins.
    pub max_kv_bytes: Option<usize>,
    /// Prompt tokens a joining request prefills per step while others decode, so that a long
    /// prompt does not stall their streams; `None` prefills a prompt whole when it joins.
    pub prefill_chunk: Option<usize>,
    /// Bytes the prefix cache may hold: keys and values of prompt prefixes in blocks of
    /// `PREFIX_BLOCK_TOKENS`, reused by later requests that start the same way; 0 turns it off.
    pub prefix_cache_bytes: usize,
    /// A directory the prefix cache also writes its blocks to and reads them back from, so a
    /// later engine (a restarted server) reuses them (`backend::session::prefix_disk`).
    pub prefix_cache_dir: Option<std::path::PathBuf>,
    /// The most bytes of block files in `prefix_cache_dir`; least recently used go first.
    pub prefix_cache_disk_bytes: u64,
}

/// The default `prefix_cache_disk_bytes`: 4 GiB, about 200,000 cached tokens of Qwen2.5 0.5B
/// with its float16 cache.
pub const DEFAULT_PREFIX_CACHE_DISK_BYTES: u64 = 4 << 30;

/// The default `prefill_chunk`: on two CPU cores a 128-token chunk of a 270M model is a pause of
/// under 0.2 s for the running streams, and a 4,000-token prompt prefilled so takes about 10%
/// longer than whole (BENCHMARKS.md, `benches/engine_prefill.py`).
pub const DEFAULT_PREFILL_CHUNK: usize = 128;

/// The default `prefix_cache_bytes`: 256 MiB, about 14,000 cached tokens of Gemma 3 270M or
/// 21,000 of Qwen2.5 0.5B with their float16 caches.
pub const DEFAULT_PREFIX_CACHE_BYTES: usize = 256 << 20;

/// Positions per prefix-cache block: a prefix is reused in whole blocks, so a smaller block
/// reuses more of a prompt and costs more lookups and copies.
pub const PREFIX_BLOCK_TOKENS: usize = 64;

impl Default for EngineOptions {
    fn default() -> Self {
        Self {
            max_batch_size: 8,
            max_queue: 64,
            max_kv_bytes: None,
            prefill_chunk: Some(DEFAULT_PREFILL_CHUNK),
            prefix_cache_bytes: DEFAULT_PREFIX_CACHE_BYTES,
            prefix_cache_dir: None,
            prefix_cache_disk_bytes: DEFAULT_PREFIX_CACHE_DISK_BYTES,
        }
    }
}

/// What a request's handle receives, in order: text pieces, then one `Done` or `Failed`.
#[derive(Debug)]
pub enum EngineEvent {
    /// Text that became final, with the log-probabilities of the tokens behind it when they
    /// were asked for.
    Text(String, Option<Vec<TokenLogprobs>>),
    /// The finished generation.
    Done(GenerationResult),
    /// The request failed; nothing more follows.
    Failed(EngineError),
    /// The request ended without a result: it was cancelled.
    Cancelled,
}

/// Counters of an engine, for monitoring.
#[derive(Debug, Default)]
pub struct EngineStats {
    /// Requests submitted.
    pub submitted: AtomicUsize,
    /// Requests finished (done, failed or cancelled).
    pub finished: AtomicUsize,
    /// Requests waiting to join.
    pub queued: AtomicUsize,
    /// Sequences in the running batch.
    pub running: AtomicUsize,
    /// Tokens generated.
    pub generated_tokens: AtomicUsize,
    /// Batched steps run.
    pub steps: AtomicUsize,
    /// Prompt tokens of the requests started.
    pub prompt_tokens: AtomicUsize,
    /// Of those, the tokens not computed again: restored from the prefix cache or still held by
    /// the session a request was given.
    pub cached_tokens: AtomicUsize,
    /// Requests that reused at least one token so.
    pub prefix_hits: AtomicUsize,
    /// Bytes the prefix cache holds.
    pub prefix_cache_bytes: AtomicUsize,
    /// Blocks the prefix cache evicted to stay within its budget.
    pub prefix_cache_evictions: AtomicUsize,
    /// Block files in the prefix cache's directory, and their bytes.
    pub prefix_disk_files: AtomicUsize,
    /// Bytes of those files.
    pub prefix_disk_bytes: AtomicUsize,
    /// Blocks brought back from the directory.
    pub prefix_disk_loaded: AtomicUsize,
    /// Blocks written to the directory.
    pub prefix_disk_written: AtomicUsize,
    /// Files skipped (damaged, truncated or another model's), never loaded.
    pub prefix_disk_skipped: AtomicUsize,
    /// Files deleted to stay within the directory's cap.
    pub prefix_disk_evictions: AtomicUsize,
}

struct Job {
    /// The request's images, encoded at submission, at their positions in `prompt`.
    images: Vec<crate::backend::session::images::ImageSpan>,
    prompt: Vec<u32>,
    options: GenerateOptions,
    interventions: Vec<Intervention>,
    events: Sender<EngineEvent>,
    cancel: Arc<AtomicBool>,
}

/// A submitted request: its events, and a way to cancel it.
#[derive(Debug)]
pub struct RequestHandle {
    events: Mutex<Receiver<EngineEvent>>,
    cancel: Arc<AtomicBool>,
}

impl RequestHandle {
    /// The next event, waiting at most `timeout`; `None` when none came in time.
    pub fn next_event(&self, timeout: Duration) -> Option<EngineEvent> {
        let rx = self.events.lock().ok()?;
        match rx.recv_timeout(timeout) {
            Ok(e) => Some(e),
            Err(RecvTimeoutError::Timeout) => None,
            // The engine dropped the request without a last word: it was cancelled.
            Err(RecvTimeoutError::Disconnected) => Some(EngineEvent::Cancelled),
        }
    }

    /// Asks the engine to stop this request at its next step and free its slot.
    pub fn cancel(&self) {
        self.cancel.store(true, Ordering::Relaxed);
    }
}

/// Many requests over one model, stepped together in a background thread.
#[derive(Debug)]
pub struct Engine {
    queue: Option<SyncSender<Job>>,
    worker: Option<JoinHandle<()>>,
    stats: Arc<EngineStats>,
    shutdown: Arc<AtomicBool>,
    options: EngineOptions,
    /// The model's vocabulary, context and tokenizer, to refuse a bad request at submission.
    vocab_size: usize,
    max_context: usize,
    tokenizer: Option<Arc<crate::text::Tokenizer>>,
    /// The model's vision encoder, which encodes a request's images as it is submitted.
    vision: Option<Arc<crate::backend::vision::VisionModel>>,
}

impl Engine {
    /// An engine over `model`'s weights (shared, not copied); its sequences start empty and
    /// carry no interventions but their own.
    pub fn new(model: &Model, options: EngineOptions) -> Result<Self, EngineError> {
        let mut template = model.fork_empty()?;
        let vocab_size = template.runtime().session().vocab_size();
        let max_context = template.runtime().session().max_context();
        let tokenizer = template.tokenizer().ok().cloned();
        let vision = template.vision().ok().cloned();
        template.runtime_mut().set_interventions(Vec::new()).map_err(ModelError::from)?;
        let mut prefix =
            (options.prefix_cache_bytes > 0).then(|| PrefixCache::new(PREFIX_BLOCK_TOKENS, options.prefix_cache_bytes));
        if let Some(dir) = &options.prefix_cache_dir {
            // The disk tier stages blocks through memory: without a memory budget it has none.
            let Some(cache) = prefix.take() else {
                return Err(ModelError::Backend(crate::backend::CandleError::InvalidInput {
                    operation: "engine",
                    reason: "prefix_cache_dir needs a prefix cache in memory (prefix_cache_bytes > 0)".into(),
                })
                .into());
            };
            let disk = PrefixDisk::open(dir, options.prefix_cache_disk_bytes).map_err(ModelError::Backend)?;
            prefix = Some(cache.with_disk(disk));
        }
        let (tx, rx) = mpsc::sync_channel(options.max_queue.max(1));
        let stats = Arc::new(EngineStats::default());
        let shutdown = Arc::new(AtomicBool::new(false));
        let worker = {
            let (stats, shutdown, options) = (Arc::clone(&stats), Arc::clone(&shutdown), options.clone());
            std::thread::Builder::new()
                .name("candlewick-engine".into())
                .spawn(move || {
                    Worker {
                        template,
                        options,
                        stats,
                        shutdown,
                        slots: Vec::new(),
                        joining: Vec::new(),
                        idle: Vec::new(),
                        prefix,
                    }
                    .run(rx)
                })
                .map_err(|e| {
                    ModelError::Backend(crate::backend::CandleError::InvalidInput {
                        operation: "engine",
                        reason: format!("cannot start the engine thread: {e}"),
                    })
                })?
        };
        Ok(Self {
            queue: Some(tx),
            worker: Some(worker),
            stats,
            shutdown,
            options,
            vocab_size,
            max_context,
            tokenizer,
            vision,
        })
    }

    /// Queues a request; it joins the running batch at the next step. A full queue refuses at once.
    pub fn submit(
        &self,
        prompt: Vec<u32>,
        options: GenerateOptions,
        interventions: Vec<Intervention>,
    ) -> Result<RequestHandle, EngineError> {
        self.check(&prompt, &options)?;
        self.queue_job(Vec::new(), prompt, options, interventions)
    }

    /// `submit` with images: `pixels` as the model's processor returns them, one image per run of
    /// image tokens in `prompt`. They are encoded here, on the caller's thread (the encoder
    /// cache serves a repeated image), so the batch's other requests keep decoding meanwhile.
    pub fn submit_with_images(
        &self,
        prompt: Vec<u32>,
        options: GenerateOptions,
        interventions: Vec<Intervention>,
        pixels: &crate::model::vision::PixelValues,
    ) -> Result<RequestHandle, EngineError> {
        self.queue.as_ref().ok_or(EngineError::Closed)?;
        self.check(&prompt, &options)?;
        let vision = self.vision.as_ref().ok_or_else(|| {
            EngineError::Model(ModelError::Backend(CandleError::InvalidInput {
                operation: "images",
                reason: "this model takes no images: it has no vision encoder".into(),
            }))
        })?;
        let (vision_edits, interventions) = crate::model::vision::split_vision_edits(interventions);
        let (spans, _) =
            crate::model::vision::encode_images(vision, self.max_context, &prompt, 0, pixels, None, &vision_edits)?;
        self.queue_job(spans, prompt, options, interventions)
    }

    fn queue_job(
        &self,
        images: Vec<crate::backend::session::images::ImageSpan>,
        prompt: Vec<u32>,
        options: GenerateOptions,
        interventions: Vec<Intervention>,
    ) -> Result<RequestHandle, EngineError> {
        let queue = self.queue.as_ref().ok_or(EngineError::Closed)?;
        let (events, rx) = mpsc::channel();
        let cancel = Arc::new(AtomicBool::new(false));
        let job = Job { images, prompt, options, interventions, events, cancel: Arc::clone(&cancel) };
        self.stats.queued.fetch_add(1, Ordering::Relaxed);
        match queue.try_send(job) {
            Ok(()) => {
                self.stats.submitted.fetch_add(1, Ordering::Relaxed);
                Ok(RequestHandle { events: Mutex::new(rx), cancel })
            }
            Err(e) => {
                self.stats.queued.fetch_sub(1, Ordering::Relaxed);
                Err(match e {
                    TrySendError::Full(_) => EngineError::QueueFull { capacity: self.options.max_queue },
                    TrySendError::Disconnected(_) => EngineError::Closed,
                })
            }
        }
    }

    /// Refuses, before it is queued, a request that could only fail: a bad option, an empty
    /// prompt, a token outside the vocabulary, a prompt longer than the context.
    fn check(&self, prompt: &[u32], options: &GenerateOptions) -> Result<(), EngineError> {
        let refused = |e: CandleError| EngineError::Model(ModelError::Backend(e));
        options
            .validate(self.vocab_size)
            .map_err(|why| EngineError::Model(ModelError::Generation(GenerationError::InvalidOptions(why))))?;
        if prompt.is_empty() {
            return Err(refused(CandleError::InvalidInput {
                operation: "submit",
                reason: "the prompt has no tokens".into(),
            }));
        }
        if let (Some(spec), Some(tokenizer)) = (&options.constraint, &self.tokenizer) {
            // Compiled here once to refuse a schema llguidance cannot take; the request compiles
            // its own when it starts (a grammar's state is the request's).
            let factory = tokenizer.constraint_factory(self.vocab_size).map_err(|e| EngineError::Model(e.into()))?;
            Constraint::new(spec, &factory)
                .map_err(|why| EngineError::Model(ModelError::Generation(GenerationError::InvalidOptions(why))))?;
        }
        if let Some((index, &token)) = prompt.iter().enumerate().find(|(_, &t)| t as usize >= self.vocab_size) {
            return Err(refused(CandleError::TokenOutOfRange { token, index, vocab_size: self.vocab_size }));
        }
        if prompt.len() > self.max_context {
            return Err(refused(CandleError::ContextFull {
                position: 0,
                requested: prompt.len(),
                max_context: self.max_context,
            }));
        }
        Ok(())
    }

    /// The engine's counters.
    pub fn stats(&self) -> &EngineStats {
        &self.stats
    }

    /// How it schedules.
    pub fn options(&self) -> &EngineOptions {
        &self.options
    }

    /// Stops taking requests, cancels the running ones and waits for the thread to end.
    pub fn close(&mut self) {
        self.shutdown.store(true, Ordering::Relaxed);
        self.queue = None;
        if let Some(w) = self.worker.take() {
            let _ = w.join();
        }
    }
}

impl Drop for Engine {
    fn drop(&mut self) {
        self.close();
    }
}

/// One running sequence.
struct Slot {
    generation: Generation,
    model: Model,
    events: Sender<EngineEvent>,
    cancel: Arc<AtomicBool>,
}

/// A request whose prompt is still being prefilled, a chunk a step.
struct Joining {
    pending: PendingPrefill,
    model: Model,
    events: Sender<EngineEvent>,
    cancel: Arc<AtomicBool>,
}

struct Worker {
    template: Model,
    options: EngineOptions,
    stats: Arc<EngineStats>,
    shutdown: Arc<AtomicBool>,
    slots: Vec<Slot>,
    /// Requests prefilling their prompts, oldest first; they hold a batch place.
    joining: Vec<Joining>,
    /// Sessions of finished requests, kept so a new prompt that shares a prefix reuses its cache.
    idle: Vec<Model>,
    /// Prompt prefixes' keys and values, kept across requests (`None`: turned off).
    prefix: Option<PrefixCache>,
}

impl Worker {
    fn run(mut self, rx: Receiver<Job>) {
        loop {
            if self.shutdown.load(Ordering::Relaxed) {
                for s in self.slots.drain(..) {
                    let _ = s.events.send(EngineEvent::Failed(EngineError::Closed));
                }
                for j in self.joining.drain(..) {
                    let _ = j.events.send(EngineEvent::Failed(EngineError::Closed));
                }
                return;
            }
            if !self.admit(&rx) {
                return;
            }
            self.prefill_chunk();
            self.stats.running.store(self.slots.len() + self.joining.len(), Ordering::Relaxed);
            if self.slots.is_empty() {
                continue;
            }
            self.step();
            self.stats.running.store(self.slots.len() + self.joining.len(), Ordering::Relaxed);
        }
    }

    /// Takes waiting requests into free slots; false when the engine is closed and idle.
    fn admit(&mut self, rx: &Receiver<Job>) -> bool {
        while self.slots.len() + self.joining.len() < self.options.max_batch_size.max(1) && !self.kv_full() {
            let job = if self.slots.is_empty() && self.joining.is_empty() {
                // Nothing runs: wait for work (waking now and then to notice a shutdown).
                match rx.recv_timeout(Duration::from_millis(100)) {
                    Ok(j) => j,
                    Err(RecvTimeoutError::Timeout) => return !self.shutdown.load(Ordering::Relaxed),
                    Err(RecvTimeoutError::Disconnected) => return false,
                }
            } else {
                match rx.try_recv() {
                    Ok(j) => j,
                    Err(TryRecvError::Empty | TryRecvError::Disconnected) => break,
                }
            };
            self.stats.queued.fetch_sub(1, Ordering::Relaxed);
            if job.cancel.load(Ordering::Relaxed) {
                self.finish_one();
                continue;
            }
            self.start(job);
        }
        true
    }

    fn kv_full(&self) -> bool {
        let Some(limit) = self.options.max_kv_bytes else { return false };
        let sessions = self.slots.iter().map(|s| &s.model).chain(self.joining.iter().map(|j| &j.model));
        let held: usize = sessions.map(|m| m.runtime().session().cache_bytes()).sum();
        !(self.slots.is_empty() && self.joining.is_empty()) && held >= limit
    }

    /// The session that holds the longest prefix of `prompt`: an idle one, or a fresh one the
    /// prefix cache restores a prefix into (only for a request with no edits of its own,
    /// `plain`), or an empty one.
    fn session_for(&mut self, prompt: &[u32], plain: bool) -> Result<Model, ModelError> {
        // A session counts only what it can rewind to (a ring keeps its window's keys only); the
        // generation keeps one prompt token to run, so rewinding to below the whole shared part.
        let shared = |m: &Model| {
            let s = m.runtime().session();
            let n = s.reusable_tokens().iter().zip(prompt).take_while(|(a, b)| a == b).count();
            let n = n.min(prompt.len().saturating_sub(1));
            if s.can_truncate(n) {
                n
            } else {
                0
            }
        };
        let best = (0..self.idle.len()).max_by_key(|&i| shared(&self.idle[i]));
        let idle_shared = best.map_or(0, |i| shared(&self.idle[i]));
        if plain {
            if let Some(cache) = &mut self.prefix {
                // What memory lacks of the prompt's blocks, from the disk tier (when there is one).
                cache.load_from_disk(self.template.runtime().session(), prompt);
            }
        }
        let cached = match &self.prefix {
            Some(cache) if plain => cache.peek(prompt),
            _ => 0,
        };
        if cached > idle_shared {
            let mut model = self.template.fork_empty()?;
            if let Some(cache) = &mut self.prefix {
                cache.restore_into(model.runtime_mut().session_mut(), prompt)?;
            }
            return Ok(model);
        }
        match best {
            Some(i) if idle_shared > 0 => Ok(self.idle.swap_remove(i)),
            _ => self.template.fork_empty(),
        }
    }

    /// Publishes the prefix cache's size in the engine's counters.
    fn publish_prefix_stats(&self) {
        if let Some(cache) = &self.prefix {
            let s = cache.stats();
            self.stats.prefix_cache_bytes.store(s.bytes, Ordering::Relaxed);
            self.stats.prefix_cache_evictions.store(s.evictions, Ordering::Relaxed);
            let d = s.disk;
            self.stats.prefix_disk_files.store(d.files, Ordering::Relaxed);
            self.stats.prefix_disk_bytes.store(d.bytes as usize, Ordering::Relaxed);
            self.stats.prefix_disk_loaded.store(d.loaded, Ordering::Relaxed);
            self.stats.prefix_disk_written.store(d.written, Ordering::Relaxed);
            self.stats.prefix_disk_skipped.store(d.skipped, Ordering::Relaxed);
            self.stats.prefix_disk_evictions.store(d.evictions, Ordering::Relaxed);
        }
    }

    fn start(&mut self, job: Job) {
        // The request's adapters, or the engine's default ones (the template's).
        let adapters = match &job.options.adapters {
            Some(choice) => self.template.resolve_adapters(choice),
            None => Ok(self.template.runtime().session().adapters()),
        };
        let adapters = match adapters {
            Ok(a) => a,
            Err(e) => return self.fail(&job.events, e.into()),
        };
        let plain = job.interventions.is_empty() && adapters.is_empty();
        // A prompt with images is never restored from the prefix cache by its token ids.
        let mut model = match self.session_for(&job.prompt, plain && job.images.is_empty()) {
            Ok(m) => m,
            Err(e) => return self.fail(&job.events, e.into()),
        };
        // This session is the request's own: its adapters stay on for all its steps.
        if let Err(e) = model.runtime().session().set_adapters(adapters) {
            self.idle.push(model);
            return self.fail(&job.events, ModelError::from(e).into());
        }
        if let Err(e) = model.stage_spans(job.images) {
            self.idle.push(model);
            return self.fail(&job.events, e.into());
        }
        self.publish_prefix_stats(); // blocks read back from disk, files skipped
        if let Err(e) = model.runtime_mut().set_interventions(job.interventions) {
            model.clear_images();
            self.idle.push(model);
            return self.fail(&job.events, ModelError::from(e).into());
        }
        match model.begin_generation(&job.prompt, job.options) {
            Ok(pending) => {
                let reused = pending.reused();
                self.stats.prompt_tokens.fetch_add(job.prompt.len(), Ordering::Relaxed);
                self.stats.cached_tokens.fetch_add(reused, Ordering::Relaxed);
                if reused > 0 {
                    self.stats.prefix_hits.fetch_add(1, Ordering::Relaxed);
                }
                if let Some(cache) = &mut self.prefix {
                    cache.count_lookup(&job.prompt, reused);
                }
                self.joining.push(Joining { pending, model, events: job.events, cancel: job.cancel })
            }
            Err(e) => {
                model.clear_images();
                self.idle.push(model);
                self.fail(&job.events, e.into());
            }
        }
    }

    /// Prefills the oldest joining request's next chunk (its whole prompt when nothing else
    /// runs, or without `prefill_chunk`); a request whose prompt is in starts decoding.
    fn prefill_chunk(&mut self) {
        let stats = Arc::clone(&self.stats);
        self.joining.retain(|j| {
            let keep = !j.cancel.load(Ordering::Relaxed);
            if !keep {
                stats.finished.fetch_add(1, Ordering::Relaxed);
            }
            keep
        });
        if self.joining.is_empty() {
            return;
        }
        let budget = match self.options.prefill_chunk {
            Some(n) if !self.slots.is_empty() => n.max(1),
            _ => usize::MAX,
        };
        let j = &mut self.joining[0];
        match j.pending.advance(j.model.runtime_mut(), budget) {
            Ok(None) => {}
            Ok(Some(generation)) => {
                let mut j = self.joining.remove(0);
                j.model.clear_images();
                if let Some(cache) = &mut self.prefix {
                    // A prompt that cannot be kept (no memory for the copy) is only not cached:
                    // its request goes on.
                    let _ = cache.store_from(j.model.runtime().session());
                }
                self.publish_prefix_stats();
                self.slots.push(Slot { generation, model: j.model, events: j.events, cancel: j.cancel });
            }
            Err(e) => {
                let j = self.joining.remove(0);
                self.fail(&j.events, ModelError::from(e).into());
                self.retire(j.model);
            }
        }
    }

    fn fail(&self, events: &Sender<EngineEvent>, e: EngineError) {
        self.finish_one();
        let _ = events.send(EngineEvent::Failed(e));
    }

    /// Counts a request as finished: before its last event is sent, so that a client holding
    /// its answer never reads statistics that have not counted it yet.
    fn finish_one(&self) {
        self.stats.finished.fetch_add(1, Ordering::Relaxed);
    }

    fn step(&mut self) {
        // Cancelled requests (or ones whose handle is gone) leave before the step.
        let mut k = 0;
        while k < self.slots.len() {
            if self.slots[k].cancel.load(Ordering::Relaxed) {
                let s = self.slots.swap_remove(k);
                self.retire(s.model);
                self.finish_one();
            } else {
                k += 1;
            }
        }
        if self.slots.is_empty() {
            return;
        }
        // A request running alone may guess ahead (speculative decoding: prompt lookup, a draft
        // model), which checks several of its tokens in one step; with others running, every
        // step carries one token per request, batched, which is the better use of the weights'
        // read (llama.cpp's server and vLLM also speculate for a lone sequence only).
        let result = match &mut self.slots[..] {
            [alone] if self.joining.is_empty() && alone.generation.speculates(alone.model.has_draft_model()) => {
                alone.model.step_generation(&mut alone.generation).map(|text| vec![text])
            }
            slots => {
                let mut active: Vec<_> = slots.iter_mut().map(|s| (&mut s.generation, s.model.runtime_mut())).collect();
                step_together(&mut active)
            }
        };
        self.stats.steps.fetch_add(1, Ordering::Relaxed);
        match result {
            Ok(texts) => {
                for (s, text) in self.slots.iter_mut().zip(texts) {
                    if text.is_empty() {
                        continue;
                    }
                    let logprobs = s.generation.take_logprobs();
                    if s.events.send(EngineEvent::Text(text, logprobs)).is_err() {
                        // The handle is gone: nobody reads this request any more.
                        s.cancel.store(true, Ordering::Relaxed);
                    }
                }
                let (done, running): (Vec<Slot>, Vec<Slot>) =
                    self.slots.drain(..).partition(|s| s.generation.finish_reason().is_some());
                self.slots = running;
                for s in done {
                    let result = s.generation.result();
                    self.stats.generated_tokens.fetch_add(result.token_ids.len(), Ordering::Relaxed);
                    self.finish_one();
                    let _ = s.events.send(EngineEvent::Done(result));
                    self.retire(s.model);
                }
            }
            Err(e) => {
                let message = e.to_string();
                for s in self.slots.drain(..).collect::<Vec<_>>() {
                    let err = ModelError::Backend(crate::backend::CandleError::InvalidInput {
                        operation: "engine step",
                        reason: message.clone(),
                    });
                    self.finish_one();
                    let _ = s.events.send(EngineEvent::Failed(err.into()));
                    self.retire(s.model);
                }
            }
        }
    }

    /// Keeps a finished request's session for prefix reuse (at most a batch's worth).
    fn retire(&mut self, mut model: Model) {
        model.clear_images();
        if model.runtime_mut().set_interventions(Vec::new()).is_err() {
            return;
        }
        self.idle.push(model);
        if self.idle.len() > self.options.max_batch_size.max(1) {
            self.idle.remove(0);
        }
    }
}
