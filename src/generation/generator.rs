//! The token loop: prefill what the session does not already hold, then sample and decode.
//!
//! Written over the contract only (`core`): any backend whose session takes plain token ids
//! runs it, and nothing here knows which one it is.

use std::collections::HashSet;
use std::sync::Arc;
use std::time::Instant;

use super::constraint::{Constraint, ConstraintSpec};
use super::sampling::{argmax, draw, softmax_prob, Sampler, SamplingParams};
use super::speculative::{accept_or_resample, Proposal, DEFAULT_DRAFT_TOKENS, DRAFT_P_MIN, MAX_DRAFT};
use super::stopping::{StopScan, StopStrings};
use crate::core::{BackendProvider, BackendSession, ModelRuntime, RuntimeError};
use crate::text::{IncrementalDecoder, TextError, Tokenizer};

/// Why generation failed; `E` is the backend's error.
#[derive(Debug, thiserror::Error)]
pub enum GenerationError<E: std::error::Error + 'static> {
    /// The runtime refused or failed a step.
    #[error(transparent)]
    Runtime(#[from] RuntimeError<E>),
    /// Detokenization failed.
    #[error(transparent)]
    Text(#[from] TextError),
    /// A generation option is out of range.
    #[error("invalid generation option: {0}")]
    InvalidOptions(String),
    /// The session was moved by someone else (a step, truncate or reset, another generation)
    /// between two steps of this generation, so its context is no longer this generation's.
    #[error("the session changed under this generation (another call stepped, rewound or reset it); start a new one")]
    SessionChanged,
    /// The output constraint failed while following the generated tokens.
    #[error("the output constraint failed: {0}")]
    Constraint(String),
    /// The model produced logits that are not finite (NaN or infinite), so no token can be chosen.
    #[error("the model produced non-finite logits at position {position}; the weights or an intervention are broken")]
    NonFiniteLogits {
        /// The position whose next token was being chosen.
        position: usize,
    },
}

/// Why generation ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FinishReason {
    /// A stop string was produced (and cut).
    Stop,
    /// `max_tokens` was reached, or the context filled up.
    Length,
    /// The model produced an end-of-sequence token.
    Eos,
    /// The caller stopped the generation before it ended (a stream closed early).
    Cancelled,
}

impl FinishReason {
    /// The OpenAI-style name: `stop`, `length`, `eos`, `cancelled`.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Stop => "stop",
            Self::Length => "length",
            Self::Eos => "eos",
            Self::Cancelled => "cancelled",
        }
    }
}

/// How to generate.
#[derive(Debug, Clone)]
pub struct GenerateOptions {
    /// The most tokens to generate.
    pub max_tokens: usize,
    /// Text at which generation stops (the stop string itself is not returned).
    pub stop: Vec<String>,
    /// Sampling controls.
    pub sampling: SamplingParams,
    /// Extra end-of-sequence ids (besides the tokenizer's and the model's).
    pub eos_ids: Vec<u32>,
    /// Keep going past end-of-sequence tokens.
    pub ignore_eos: bool,
    /// Report each generated token's log-probability and this many most likely alternatives.
    pub logprobs: Option<usize>,
    /// Leave control tokens (special tokens, markup such as `<start_of_image>`) out of the text,
    /// as llama-cpp-python does; their ids and log-probabilities stay in the result.
    pub skip_special_tokens: bool,
    /// What the output must match (a JSON schema, a grammar, ...); `None` leaves it free.
    pub constraint: Option<ConstraintSpec>,
    /// Prompt-lookup speculation: up to this many draft tokens copied from earlier in the
    /// context are checked with each generated token in one step (`speculative`); 0: off.
    pub prompt_lookup: usize,
    /// Draft-model speculation: the most tokens the draft model proposes per step (`None`: the
    /// default, `speculative::DEFAULT_DRAFT_TOKENS`; 0: off). Used only when the generation is
    /// stepped with a draft model (`Generation::step_with`, a model loaded with one).
    pub draft_tokens: Option<usize>,
    /// The LoRA adapters this generation runs with, by loaded name and scale (`None`: the
    /// adapter's load scale); `None`: the session's own (`Model::set_adapters`).
    pub adapters: Option<AdapterChoice>,
}

/// LoRA adapters chosen by name, each with a scale or `None` for the scale it was loaded with.
pub type AdapterChoice = Vec<(String, Option<f32>)>;

/// The default number of tokens to generate (a macro, not a constant, so that the Python
/// signatures can spell the same literal that the defaults table below uses).
#[macro_export]
macro_rules! default_max_tokens {
    () => {
        256
    };
}

/// The one table of generation defaults (llama-cpp-python's): every API and the CLI use it.
impl Default for GenerateOptions {
    fn default() -> Self {
        Self {
            max_tokens: crate::default_max_tokens!(),
            stop: Vec::new(),
            sampling: SamplingParams {
                temperature: 0.8,
                top_k: 40,
                top_p: 0.95,
                min_p: 0.05,
                ..SamplingParams::default()
            },
            eos_ids: Vec::new(),
            ignore_eos: false,
            logprobs: None,
            skip_special_tokens: true,
            constraint: None,
            prompt_lookup: 0,
            draft_tokens: None,
            adapters: None,
        }
    }
}

impl GenerateOptions {
    /// Checks every option against a model whose steps yield `vocab_size` logits a row, so that
    /// a bad option is refused before any step touches a session.
    pub fn validate(&self, vocab_size: usize) -> Result<(), String> {
        self.sampling.validate()?;
        if let Some(&(id, _)) = self.sampling.logit_bias.iter().find(|(id, _)| *id as usize >= vocab_size) {
            return Err(format!("logit_bias names token {id}, outside the vocabulary of {vocab_size}"));
        }
        if self.prompt_lookup > MAX_DRAFT {
            return Err(format!("prompt_lookup_num_tokens must be at most {MAX_DRAFT}, got {}", self.prompt_lookup));
        }
        if let Some(n) = self.draft_tokens.filter(|&n| n > MAX_DRAFT) {
            return Err(format!("num_draft_tokens must be at most {MAX_DRAFT}, got {n}"));
        }
        Ok(())
    }
}

/// Token counts and timings of one generation.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Usage {
    /// Tokens in the prompt.
    pub prompt_tokens: usize,
    /// Prompt tokens the session already held and did not prefill again.
    pub cached_tokens: usize,
    /// Tokens generated.
    pub completion_tokens: usize,
    /// Seconds from the start to the first generated token.
    pub time_to_first_token: f64,
    /// Seconds spent prefilling.
    pub prefill_seconds: f64,
    /// Seconds spent decoding.
    pub decode_seconds: f64,
    /// With an output constraint: seconds spent compiling it (before the first step).
    pub constraint_compile_seconds: f64,
    /// With an output constraint: the median and 99th-percentile seconds it took a token
    /// (checking the pick, the mask when the pick did not fit, moving past the token).
    pub constraint_seconds_p50: f64,
    /// See `constraint_seconds_p50`.
    pub constraint_seconds_p99: f64,
    /// With an output constraint: the tokens whose first pick it rejected (a mask computed).
    pub constraint_masks: usize,
    /// With speculation (prompt lookup or a draft model): draft tokens checked.
    pub draft_tokens: usize,
    /// With speculation: draft tokens the model accepted (each saved a step).
    pub accepted_draft_tokens: usize,
}

impl Usage {
    /// Prefilled tokens per second.
    pub fn prefill_tokens_per_second(&self) -> f64 {
        rate(self.prompt_tokens - self.cached_tokens, self.prefill_seconds)
    }

    /// Decoded tokens per second.
    pub fn decode_tokens_per_second(&self) -> f64 {
        rate(self.completion_tokens.saturating_sub(1), self.decode_seconds)
    }
}

/// The `q` quantile (nearest rank) of `times`, 0 when there are none.
fn percentile(times: &[f32], q: f64) -> f64 {
    if times.is_empty() {
        return 0.0;
    }
    let mut sorted = times.to_vec();
    sorted.sort_by(f32::total_cmp);
    let rank = ((q * sorted.len() as f64).ceil() as usize).clamp(1, sorted.len());
    f64::from(sorted[rank - 1])
}

fn rate(n: usize, secs: f64) -> f64 {
    if secs > 0.0 {
        n as f64 / secs
    } else {
        0.0
    }
}

/// What a finished generation produced.
#[derive(Debug, Clone)]
pub struct GenerationResult {
    /// The generated text, cut before any stop string.
    pub text: String,
    /// The generated token ids (without an end-of-sequence token).
    pub token_ids: Vec<u32>,
    /// Why it ended.
    pub finish_reason: FinishReason,
    /// Counts and timings.
    pub usage: Usage,
    /// Per generated token, when asked: its log-probability and the top alternatives.
    pub logprobs: Option<Vec<TokenLogprobs>>,
}

/// One generated token's log-probability under the model (log-softmax of its raw logits, before
/// penalties and temperature, as llama.cpp and the OpenAI API report it) and the most likely
/// alternatives at that step, most likely first.
#[derive(Debug, Clone, PartialEq)]
pub struct TokenLogprobs {
    /// The chosen token.
    pub token: u32,
    /// Its log-probability.
    pub logprob: f32,
    /// The most likely tokens with their log-probabilities.
    pub top: Vec<(u32, f32)>,
}

impl TokenLogprobs {
    /// The chosen token's entry from a step's raw logits, with the `top` most likely alternatives.
    pub fn of(logits: &[f32], token: u32, top: usize) -> Self {
        let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        let lse = max + logits.iter().map(|&l| ((l - max) as f64).exp()).sum::<f64>().ln() as f32;
        let mut best: Vec<(u32, f32)> = Vec::new();
        if top > 0 {
            let mut idx: Vec<u32> = (0..logits.len() as u32).collect();
            let k = top.min(idx.len());
            let by = |a: &u32, b: &u32| logits[*b as usize].total_cmp(&logits[*a as usize]).then(a.cmp(b));
            idx.select_nth_unstable_by(k - 1, by);
            idx.truncate(k);
            idx.sort_unstable_by(by);
            best = idx.into_iter().map(|t| (t, logits[t as usize] - lse)).collect();
        }
        Self { token, logprob: logits[token as usize] - lse, top: best }
    }
}

/// What `Generation::advance` decided.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Advance {
    /// Decode this token and hand its logits to `accept_logits`.
    Feed(u32),
    /// Generation ended; the last text that became final.
    Done(String),
}

/// One generation in progress; each `step` samples one token and feeds it back.
pub struct Generation {
    sampler: Sampler,
    stops: StopStrings,
    detok: IncrementalDecoder,
    eos: HashSet<u32>,
    max_tokens: usize,
    context: Vec<u32>,
    generated: Vec<u32>,
    logits: Vec<f32>,
    text: String,
    emitted: usize,
    scanned: usize,
    finish: Option<FinishReason>,
    usage: Usage,
    started: Instant,
    /// `Some(top)` when log-probabilities are reported.
    logprobs_top: Option<usize>,
    logprobs: Vec<TokenLogprobs>,
    /// How many of `logprobs` `take_logprobs` has handed out.
    logprobs_taken: usize,
    /// The runtime's epoch after this generation's last step: any other change to the session
    /// moves it (see `ModelRuntime::epoch`).
    epoch: u64,
    /// What the output must match, following the generated tokens.
    constraint: Option<Constraint>,
    /// Seconds the constraint took at each token.
    constraint_times: Vec<f32>,
    /// Draft tokens per step from prompt lookup (0: off).
    prompt_lookup: usize,
    /// Tokens a draft model proposes per step, when the generation is stepped with one.
    draft_tokens: usize,
    /// The model's vocabulary: a draft model's guesses past it are not proposed.
    vocab: usize,
    /// A sampled token not yet fed: the one that refuted a draft, fed with the next draft.
    pending: Option<u32>,
    /// The adapters it was asked to run with (`GenerateOptions::adapters`).
    adapters: Option<AdapterChoice>,
}

/// The last row of a step's logits on the host, refusing NaN or infinite values.
fn last_row<B: BackendProvider>(
    rt: &ModelRuntime<B>,
    out: &<B::Session as BackendSession<B>>::Output,
) -> Result<Vec<f32>, GenerationError<B::Error>> {
    let host = rt.session().logits_to_host(out).map_err(RuntimeError::Backend)?;
    let row = host.last_row().to_vec();
    if row.iter().any(|l| !l.is_finite()) {
        return Err(GenerationError::NonFiniteLogits { position: rt.session().position() });
    }
    Ok(row)
}

/// A generation whose prompt is still being prefilled (`Generation::begin`).
pub struct PendingPrefill {
    tokenizer: Arc<Tokenizer>,
    prompt: Vec<u32>,
    /// Prompt tokens the session holds so far.
    done: usize,
    /// Of those, the ones it held before (a reused prefix).
    common: usize,
    options: GenerateOptions,
    constraint: Option<Constraint>,
    constraint_compile_seconds: f64,
    started: Instant,
}

impl PendingPrefill {
    /// Prompt tokens the session already held when the generation began (not prefilled again).
    pub fn reused(&self) -> usize {
        self.common
    }

    /// Prompt tokens still to prefill.
    pub fn remaining(&self) -> usize {
        self.prompt.len().saturating_sub(self.done)
    }

    /// Prefills up to `max_tokens` more of the prompt; once the last of it is in, the
    /// generation, ready for its first token.
    pub fn advance<B: BackendProvider>(
        &mut self,
        rt: &mut ModelRuntime<B>,
        max_tokens: usize,
    ) -> Result<Option<Generation>, GenerationError<B::Error>> {
        let end = self.prompt.len().min(self.done.saturating_add(max_tokens.max(1)));
        // Never through an image's tokens (they run in one step).
        let end = rt.session().step_end(self.done, end).min(self.prompt.len());
        if rt.session().tokens() != &self.prompt[..self.done] {
            return Err(GenerationError::SessionChanged);
        }
        let out = rt.prefill(self.prompt[self.done..end].to_vec().into())?.wait().map_err(RuntimeError::Backend)?;
        self.done = end;
        if end < self.prompt.len() {
            return Ok(None);
        }
        let logits = last_row(rt, &out)?;
        let options = std::mem::take(&mut self.options);
        let mut eos: HashSet<u32> = self.tokenizer.eos_ids().iter().copied().collect();
        eos.extend(rt.session().stop_token_ids());
        eos.extend(options.eos_ids.iter().copied());
        if options.ignore_eos {
            eos.clear();
        }
        let usage = Usage {
            prompt_tokens: self.prompt.len(),
            cached_tokens: self.common,
            prefill_seconds: self.started.elapsed().as_secs_f64(),
            constraint_compile_seconds: self.constraint_compile_seconds,
            ..Usage::default()
        };
        Ok(Some(Generation {
            adapters: options.adapters.clone(),
            sampler: Sampler::new(options.sampling),
            stops: StopStrings::new(options.stop),
            detok: IncrementalDecoder::new(Arc::clone(&self.tokenizer), options.skip_special_tokens),
            eos,
            max_tokens: options.max_tokens,
            context: std::mem::take(&mut self.prompt),
            generated: Vec::new(),
            logits,
            text: String::new(),
            emitted: 0,
            scanned: 0,
            finish: if options.max_tokens == 0 { Some(FinishReason::Length) } else { None },
            usage,
            started: self.started,
            logprobs_top: options.logprobs,
            logprobs: Vec::new(),
            logprobs_taken: 0,
            epoch: rt.epoch(),
            constraint: self.constraint.take(),
            constraint_times: Vec::new(),
            prompt_lookup: options.prompt_lookup,
            draft_tokens: options.draft_tokens.unwrap_or(DEFAULT_DRAFT_TOKENS),
            vocab: rt.session().vocab_size(),
            pending: None,
        }))
    }
}

impl Generation {
    /// The adapters it was asked to run with (`None`: the session's own).
    pub fn adapters(&self) -> Option<&AdapterChoice> {
        self.adapters.as_ref()
    }

    /// Prefills the part of `prompt` the session does not already hold and readies the first token.
    ///
    /// Everything is validated before the session is touched, so a refused start leaves the
    /// session's position, tokens and cache as they were.
    pub fn start<B: BackendProvider>(
        rt: &mut ModelRuntime<B>,
        tokenizer: Arc<Tokenizer>,
        prompt: &[u32],
        options: GenerateOptions,
    ) -> Result<Self, GenerationError<B::Error>> {
        let mut pending = Self::begin(rt, tokenizer, prompt, options)?;
        loop {
            if let Some(generation) = pending.advance(rt, usize::MAX)? {
                return Ok(generation);
            }
        }
    }

    /// Validates everything and rewinds the session to the prefix it shares with `prompt`; the
    /// rest of the prompt is prefilled by `PendingPrefill::advance`, all at once or a chunk at a
    /// time (the engine interleaves chunks with other requests' decode steps). A refused begin
    /// leaves the session as it was.
    pub fn begin<B: BackendProvider>(
        rt: &mut ModelRuntime<B>,
        tokenizer: Arc<Tokenizer>,
        prompt: &[u32],
        options: GenerateOptions,
    ) -> Result<PendingPrefill, GenerationError<B::Error>> {
        options.validate(rt.session().vocab_size()).map_err(GenerationError::InvalidOptions)?;
        if prompt.is_empty() {
            return Err(GenerationError::InvalidOptions("the prompt has no tokens".into()));
        }
        let compiling = Instant::now();
        let constraint = match &options.constraint {
            Some(spec) => {
                let factory = tokenizer.constraint_factory(rt.session().vocab_size())?;
                Some(Constraint::new(spec, &factory).map_err(GenerationError::InvalidOptions)?)
            }
            None => None,
        };
        let constraint_compile_seconds = if constraint.is_some() { compiling.elapsed().as_secs_f64() } else { 0.0 };
        let started = Instant::now();
        // Reuse the longest prefix the session holds (computed under the edits on now); at least
        // one token is run to get logits.
        let held = rt.session().reusable_tokens();
        let common = held.iter().zip(prompt).take_while(|(a, b)| a == b).count().min(prompt.len() - 1);
        // A rewind past what a sliding window kept starts over instead (the prompt recomputed).
        let common = if rt.session().can_truncate(common) { common } else { 0 };
        rt.session().check_append(common, &prompt[common..]).map_err(RuntimeError::Backend)?;
        rt.session_mut().truncate(common).map_err(RuntimeError::Backend)?;
        // The cache is sized once for the prompt and the tokens asked for, up to 512 of them (a
        // long or unlimited generation grows from there, so an idle limit reserves nothing big).
        rt.session_mut().reserve(prompt.len().saturating_add(options.max_tokens.min(512)));
        Ok(PendingPrefill {
            tokenizer,
            prompt: prompt.to_vec(),
            done: common,
            common,
            options,
            constraint,
            constraint_compile_seconds,
            started,
        })
    }

    /// The token ids the session holds while this generation runs on it (prompt and generated),
    /// so a caller can tell whether someone else moved the session underneath.
    pub fn context(&self) -> &[u32] {
        &self.context
    }

    /// Why generation ended, once it has.
    pub fn finish_reason(&self) -> Option<FinishReason> {
        self.finish
    }

    /// Samples one token, feeds it to the session unless generation ends, and returns the
    /// newly final text (possibly empty).
    pub fn step<B: BackendProvider>(&mut self, rt: &mut ModelRuntime<B>) -> Result<String, GenerationError<B::Error>> {
        self.step_with(rt, None)
    }

    /// `step`, with a draft model (same tokenizer, its own session) proposing the next tokens
    /// when prompt lookup has none; several tokens may then become final in one step.
    pub fn step_with<B: BackendProvider>(
        &mut self,
        rt: &mut ModelRuntime<B>,
        draft: Option<&mut ModelRuntime<B>>,
    ) -> Result<String, GenerationError<B::Error>> {
        if self.finish.is_some() {
            return Ok(String::new());
        }
        // The epoch catches every change by someone else, even one that leaves the same tokens
        // (a rewind and a re-prefill under other edits, a restore); the tokens, a runtime that
        // was driven step by step through `advance` instead.
        // A pending token is in the context but not yet in the session.
        let fed = &self.context[..self.context.len() - usize::from(self.pending.is_some())];
        if rt.epoch() != self.epoch || rt.session().tokens() != fed {
            return Err(GenerationError::SessionChanged);
        }
        let session = rt.session();
        let (position, max_context) = (session.position(), session.max_context());
        let next = self.advance(position, max_context)?;
        match next {
            Advance::Done(text) => Ok(text),
            Advance::Feed(token) => {
                // The context now ends with `token`; room is left for it and every draft token,
                // and no more is drafted than is left to generate.
                let room =
                    max_context.saturating_sub(position + 1).min(self.max_tokens.saturating_sub(self.generated.len()));
                let mut proposals: Vec<Proposal> =
                    super::speculative::prompt_lookup(&self.context, self.prompt_lookup.min(room))
                        .iter()
                        .map(|&t| Proposal::certain(t))
                        .collect();
                if let Some(draft) = draft.filter(|_| proposals.is_empty()) {
                    proposals = self.draft_from(draft, self.draft_tokens.min(room))?;
                }
                if !proposals.is_empty() {
                    return self.speculate(rt, token, proposals);
                }
                let t = Instant::now();
                let out = rt.decode(vec![token].into())?.wait().map_err(RuntimeError::Backend)?;
                self.epoch = rt.epoch();
                self.logits = last_row(rt, &out)?;
                self.usage.decode_seconds += t.elapsed().as_secs_f64();
                Ok(self.take_safe())
            }
        }
    }

    /// Up to `k` tokens proposed by the draft model after the context (which ends with the token
    /// about to be fed): greedy guesses when the model's sampling is greedy or constrained,
    /// else draws from the draft's distribution under the same sampling controls. The draft's
    /// session is brought to the context first, reusing the prefix it holds.
    fn draft_from<B: BackendProvider>(
        &mut self,
        draft: &mut ModelRuntime<B>,
        k: usize,
    ) -> Result<Vec<Proposal>, GenerationError<B::Error>> {
        let ctx = &self.context;
        let k = k.min(draft.session().max_context().saturating_sub(ctx.len()));
        if k == 0 {
            return Ok(Vec::new());
        }
        let held = draft.session().tokens();
        let common = held.iter().zip(ctx).take_while(|(a, b)| a == b).count().min(ctx.len() - 1);
        // Past what a sliding window kept, the draft starts over rather than rewinds.
        let common = if draft.session().can_truncate(common) { common } else { 0 };
        draft.session_mut().truncate(common).map_err(RuntimeError::Backend)?;
        let out = draft.prefill(ctx[common..].to_vec().into())?.wait().map_err(RuntimeError::Backend)?;
        let mut logits = draft.session().logits_to_host(&out).map_err(RuntimeError::Backend)?.last_row().to_vec();
        let sampled = !self.sampler.params().is_greedy() && self.constraint.is_none();
        let mut seen = ctx.clone();
        let mut proposals = Vec::with_capacity(k);
        while proposals.len() < k && logits.iter().all(|l| l.is_finite()) {
            // An unsure draft is mostly refused and costs a row, so drafting stops where the
            // draft's most likely token is below `DRAFT_P_MIN`. The test is made before a draw
            // (on the distribution, not on the token drawn), so that a token that is proposed is
            // still distributed as `q`, which the acceptance rule needs.
            let (token, q) = if sampled {
                self.sampler.adjust(&mut logits, &seen);
                let q = self.sampler.distribution(&logits);
                if q.first().is_none_or(|e| e.1 < DRAFT_P_MIN) {
                    break;
                }
                let Some(token) = draw(&q, self.sampler.uniform()) else { break };
                (token, Some(q))
            } else {
                let token = argmax(&logits);
                if softmax_prob(&logits, token) < DRAFT_P_MIN {
                    break;
                }
                (token, None)
            };
            // An end of sequence ends the generation anyway, and the model samples it itself.
            if token as usize >= self.vocab || self.eos.contains(&token) {
                break;
            }
            proposals.push(Proposal { token, q });
            seen.push(token);
            if proposals.len() < k {
                let out = draft.decode(vec![token].into())?.wait().map_err(RuntimeError::Backend)?;
                logits = draft.session().logits_to_host(&out).map_err(RuntimeError::Backend)?.last_row().to_vec();
            }
        }
        Ok(proposals)
    }

    /// Feeds `token` and the `draft` guesses after it in one step, then samples on along the rows
    /// of logits while each guess is accepted (`speculative` gives the rule); the first token
    /// that replaces a guess is fed alone. The session ends holding exactly the tokens a plain
    /// run would have fed.
    fn speculate<B: BackendProvider>(
        &mut self,
        rt: &mut ModelRuntime<B>,
        token: u32,
        draft: Vec<Proposal>,
    ) -> Result<String, GenerationError<B::Error>> {
        let t = Instant::now();
        let start = rt.session().position();
        let max_context = rt.session().max_context();
        let mut fed = Vec::with_capacity(1 + draft.len());
        fed.push(token);
        fed.extend(draft.iter().map(|p| p.token));
        // A decode of several tokens yields every row's logits.
        let out = rt.decode(fed.into())?.wait().map_err(RuntimeError::Backend)?;
        self.epoch = rt.epoch();
        let host = rt.session().logits_to_host(&out).map_err(RuntimeError::Backend)?;
        let row = |i: usize| -> Result<Vec<f32>, GenerationError<B::Error>> {
            let r = host.data[i * host.vocab..(i + 1) * host.vocab].to_vec();
            if r.iter().any(|l| !l.is_finite()) {
                return Err(GenerationError::NonFiniteLogits { position: start + i });
            }
            Ok(r)
        };
        self.usage.draft_tokens += draft.len();
        self.logits = row(0)?;
        let mut text = self.take_safe();
        // Tokens of this step the session keeps: `token`, then each confirmed draft token.
        let mut kept = 1;
        for (i, d) in draft.iter().enumerate() {
            let generated = self.generated.len();
            match self.advance_with(start + kept, max_context, Some(d))? {
                Advance::Done(end) => {
                    // The last token may still be the guess (one the session need not keep).
                    if self.generated.len() > generated && self.generated.last() == Some(&d.token) {
                        self.usage.accepted_draft_tokens += 1;
                    }
                    text.push_str(&end);
                    break;
                }
                Advance::Feed(s) if s == d.token => {
                    kept += 1;
                    self.usage.accepted_draft_tokens += 1;
                    self.logits = row(i + 1)?;
                    text.push_str(&self.take_safe());
                }
                Advance::Feed(s) => {
                    // The guess was wrong from here: drop it; the sampled token is fed at the
                    // next step, with that step's draft (a step saved on every miss).
                    rt.session_mut().truncate(start + kept).map_err(RuntimeError::Backend)?;
                    self.epoch = rt.epoch();
                    self.pending = Some(s);
                    self.usage.decode_seconds += t.elapsed().as_secs_f64();
                    return Ok(text);
                }
            }
        }
        if rt.session().position() > start + kept {
            rt.session_mut().truncate(start + kept).map_err(RuntimeError::Backend)?;
            self.epoch = rt.epoch();
        }
        self.usage.decode_seconds += t.elapsed().as_secs_f64();
        Ok(text)
    }

    /// Samples the next token from the pending logits: either the token to feed back (the caller
    /// decodes it and hands the logits to `accept_logits`), or the end with its last text.
    /// `position` and `max_context` are the session's.
    pub fn advance<E: std::error::Error + 'static>(
        &mut self,
        position: usize,
        max_context: usize,
    ) -> Result<Advance, GenerationError<E>> {
        // A token sampled at a refused guess was already chosen: it is the one to feed.
        if let Some(token) = self.pending.take() {
            return Ok(Advance::Feed(token));
        }
        self.advance_with(position, max_context, None)
    }

    /// Records the runtime's epoch after a step someone else ran for this generation (a batched
    /// step), so that `step` goes on from it.
    pub fn note_epoch(&mut self, epoch: u64) {
        self.epoch = epoch;
    }

    /// Whether `step_with` would guess tokens ahead: prompt lookup is on, or a draft model is
    /// there (`has_draft`) and not turned off.
    pub fn speculates(&self, has_draft: bool) -> bool {
        self.prompt_lookup > 0 || (has_draft && self.draft_tokens > 0)
    }

    /// `advance` at a position where `proposal` was guessed and fed: a guess drawn from a draft
    /// distribution goes through the acceptance rule (the token returned is the guess when
    /// accepted); any other is sampled as usual and kept by the caller when equal.
    fn advance_with<E: std::error::Error + 'static>(
        &mut self,
        position: usize,
        max_context: usize,
        proposal: Option<&Proposal>,
    ) -> Result<Advance, GenerationError<E>> {
        if self.finish.is_some() {
            return Ok(Advance::Done(String::new()));
        }
        let mut logits = std::mem::take(&mut self.logits);
        // Log-probabilities are the model's own (raw logits), so they are taken before adjusting.
        let raw = self.logprobs_top.map(|_| logits.clone());
        self.sampler.adjust(&mut logits, &self.context);
        let mut token = match proposal {
            Some(Proposal { token: x, q: Some(q) })
                if self.constraint.is_none() && !self.sampler.params().is_greedy() =>
            {
                let p = self.sampler.distribution(&logits);
                let (u, v) = (self.sampler.uniform(), self.sampler.uniform());
                accept_or_resample(&p, q, *x, u, v).unwrap_or_else(|| argmax(&logits))
            }
            _ => self.sampler.sample(&logits),
        };
        let constrained = Instant::now();
        if let Some(c) = self.constraint.as_mut() {
            // Sample first; mask and sample again only when the pick does not fit.
            if !c.allows(token) {
                if !c.mask(&mut logits).map_err(GenerationError::Constraint)? {
                    // Nothing may follow: the output is as complete as it can be.
                    return self.end(FinishReason::Stop).map(Advance::Done);
                }
                token = self.sampler.sample(&logits);
            }
        }
        if let (Some(top), Some(raw)) = (self.logprobs_top, raw) {
            if !self.eos.contains(&token) {
                self.logprobs.push(TokenLogprobs::of(&raw, token, top));
            }
        }
        if self.generated.is_empty() {
            self.usage.time_to_first_token = self.started.elapsed().as_secs_f64();
        }
        if self.eos.contains(&token) {
            return self.end(FinishReason::Eos).map(Advance::Done);
        }
        if let Some(c) = self.constraint.as_mut() {
            c.accept(token).map_err(GenerationError::Constraint)?;
            self.constraint_times.push(constrained.elapsed().as_secs_f32());
        }
        self.generated.push(token);
        self.context.push(token);
        self.sampler.observe(token);
        if let Some(piece) = self.detok.push(token)? {
            self.text.push_str(&piece);
        }
        match self.stops.scan(&self.text, self.scanned) {
            StopScan::Stopped(at) => {
                self.text.truncate(at);
                return self.end(FinishReason::Stop).map(Advance::Done);
            }
            StopScan::SafeUpTo(_) => self.scanned = self.text.len(),
        }
        if self.constraint.as_ref().is_some_and(Constraint::is_stopped) {
            // The output is complete and the constraint allows nothing after it.
            return self.end(FinishReason::Stop).map(Advance::Done);
        }
        if self.generated.len() >= self.max_tokens || position >= max_context {
            return self.end(FinishReason::Length).map(Advance::Done);
        }
        Ok(Advance::Feed(token))
    }

    /// Takes the logits of the token `advance` fed back (decoded in `seconds`), refusing
    /// non-finite values, and returns the text that became final.
    pub fn accept_logits<E: std::error::Error + 'static>(
        &mut self,
        row: Vec<f32>,
        position: usize,
        seconds: f64,
    ) -> Result<String, GenerationError<E>> {
        if row.iter().any(|l| !l.is_finite()) {
            return Err(GenerationError::NonFiniteLogits { position });
        }
        self.logits = row;
        self.usage.decode_seconds += seconds;
        Ok(self.take_safe())
    }

    fn take_safe(&mut self) -> String {
        let safe = match self.stops.scan(&self.text, self.text.len()) {
            StopScan::SafeUpTo(s) | StopScan::Stopped(s) => s,
        };
        if safe <= self.emitted {
            return String::new();
        }
        let out = self.text[self.emitted..safe].to_owned();
        self.emitted = safe;
        out
    }

    fn end<E: std::error::Error + 'static>(&mut self, reason: FinishReason) -> Result<String, GenerationError<E>> {
        self.finish = Some(reason);
        if reason != FinishReason::Stop {
            if let Some(rest) = self.detok.flush()? {
                self.text.push_str(&rest);
                if let StopScan::Stopped(at) = self.stops.scan(&self.text, self.scanned) {
                    self.text.truncate(at);
                    self.finish = Some(FinishReason::Stop);
                }
            }
        }
        let out = self.text[self.emitted.min(self.text.len())..].to_owned();
        self.emitted = self.text.len();
        Ok(out)
    }

    /// The log-probabilities of the tokens generated since the last call (`None` when they were
    /// not asked for), so a stream can hand out each piece's tokens with the piece.
    pub fn take_logprobs(&mut self) -> Option<Vec<TokenLogprobs>> {
        self.logprobs_top?;
        let new = self.logprobs[self.logprobs_taken..].to_vec();
        self.logprobs_taken = self.logprobs.len();
        Some(new)
    }

    /// Ends the generation where it stands (finish reason `Cancelled`) and returns the text held
    /// back so far (a possible stop string's prefix, an incomplete character), now final.
    pub fn cancel(&mut self) -> Result<String, TextError> {
        if self.finish.is_some() {
            return Ok(String::new());
        }
        self.finish = Some(FinishReason::Cancelled);
        if let Some(rest) = self.detok.flush()? {
            self.text.push_str(&rest);
        }
        let out = self.text[self.emitted.min(self.text.len())..].to_owned();
        self.emitted = self.text.len();
        Ok(out)
    }

    /// The result so far (final once `finish_reason` is set).
    pub fn result(&self) -> GenerationResult {
        GenerationResult {
            text: self.text.clone(),
            token_ids: self.generated.clone(),
            finish_reason: self.finish.unwrap_or(FinishReason::Length),
            usage: Usage {
                completion_tokens: self.generated.len(),
                constraint_seconds_p50: percentile(&self.constraint_times, 0.5),
                constraint_seconds_p99: percentile(&self.constraint_times, 0.99),
                constraint_masks: self.constraint.as_ref().map_or(0, Constraint::masks_computed),
                ..self.usage
            },
            logprobs: self.logprobs_top.map(|_| self.logprobs.clone()),
        }
    }

    /// Runs to the end, passing each piece of final text to `on_text`; `interrupted` is asked
    /// between steps and stops the loop (leaving the session consistent) when it answers true.
    pub fn run<B: BackendProvider>(
        self,
        rt: &mut ModelRuntime<B>,
        on_text: impl FnMut(&str),
        interrupted: impl FnMut() -> bool,
    ) -> Result<(GenerationResult, bool), GenerationError<B::Error>> {
        self.run_with(rt, None, on_text, interrupted)
    }

    /// `run`, stepping with a draft model (`step_with`).
    pub fn run_with<B: BackendProvider>(
        mut self,
        rt: &mut ModelRuntime<B>,
        mut draft: Option<&mut ModelRuntime<B>>,
        mut on_text: impl FnMut(&str),
        mut interrupted: impl FnMut() -> bool,
    ) -> Result<(GenerationResult, bool), GenerationError<B::Error>> {
        while self.finish.is_none() {
            if interrupted() {
                return Ok((self.result(), true));
            }
            let piece = self.step_with(rt, draft.as_deref_mut())?;
            if !piece.is_empty() {
                on_text(&piece);
            }
        }
        Ok((self.result(), false))
    }
}
