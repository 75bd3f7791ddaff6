//! The candle session: the decoder, its KV cache and position, stepped by submissions.

pub mod kv_cache;

use candle_core::{Device, Tensor};

use crate::backend::decoder::observer::{to_host_f32, NoObserver, Observer, Recorder};
use crate::backend::decoder::{Decoder, LogitsRows};
use crate::backend::error::{CandleContext, CandleError, Result};
use crate::backend::CandleBackend;
use crate::core::{
    BackendSession, Completion, InspectableBackendSession, InspectedOutput, ObservationRequest, ObservationSet,
    ObservationValue, SessionCapabilities, Submission,
};
use kv_cache::KvCache;

/// What a prefill takes: tokens and whether every position's logits are wanted.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PrefillInput {
    /// Token ids appended at the current position.
    pub tokens: Vec<u32>,
    /// Whether logits of every position are returned (default: only the last).
    pub all_logits: bool,
}

impl PrefillInput {
    /// A prefill returning only the last position's logits.
    pub fn new(tokens: Vec<u32>) -> Self {
        Self { tokens, all_logits: false }
    }
}

/// What a decode takes: one or more tokens, each of which gets its logits.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DecodeInput {
    /// Token ids appended at the current position.
    pub tokens: Vec<u32>,
}

/// A step's logits, still on the device.
#[derive(Debug, Clone)]
pub struct StepOutput {
    /// Logits `[rows, vocab]` in the model's dtype.
    pub logits: Tensor,
    /// The position of the first token of the step.
    pub start_position: usize,
    /// The number of tokens the step appended.
    pub tokens: usize,
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

/// The one execution session of a prepared model.
#[derive(Debug)]
pub struct CandleSession {
    decoder: Decoder,
    cache: KvCache,
    /// The token ids the cache holds, so a new prompt can reuse a shared prefix.
    tokens: Vec<u32>,
    capabilities: SessionCapabilities,
}

impl CandleSession {
    /// A session over `decoder` with a cache of `max_context` positions.
    pub(crate) fn new(decoder: Decoder, max_context: usize, capabilities: SessionCapabilities) -> Self {
        let n = decoder.config().num_layers();
        Self { decoder, cache: KvCache::new(n, max_context), tokens: Vec::new(), capabilities }
    }

    /// The decoder this session runs.
    pub fn decoder(&self) -> &Decoder {
        &self.decoder
    }

    /// Tokens held in the cache.
    pub fn position(&self) -> usize {
        self.cache.len()
    }

    /// The token ids the cache holds, oldest first.
    pub fn tokens(&self) -> &[u32] {
        &self.tokens
    }

    /// The most tokens the cache may hold.
    pub fn max_context(&self) -> usize {
        self.cache.max_context()
    }

    /// Bytes held by the KV cache.
    pub fn cache_bytes(&self) -> usize {
        self.cache.allocated_bytes()
    }

    /// Rewinds the cache to its first `n` tokens.
    pub fn truncate(&mut self, n: usize) -> Result<()> {
        if n > self.cache.len() {
            return Err(CandleError::InvalidInput {
                operation: "truncate",
                reason: format!("cannot truncate to {n} tokens: the session holds only {}", self.cache.len()),
            });
        }
        self.cache.truncate(n);
        self.tokens.truncate(n);
        Ok(())
    }

    /// Empties the cache and frees its memory.
    pub fn reset(&mut self) {
        self.cache.reset();
        self.tokens.clear();
    }

    fn check(&self, operation: &'static str, tokens: &[u32]) -> Result<()> {
        if tokens.is_empty() {
            return Err(CandleError::InvalidInput { operation, reason: "no tokens given".into() });
        }
        let vocab_size = self.decoder.config().vocab_size;
        if let Some((index, &token)) = tokens.iter().enumerate().find(|(_, &t)| t as usize >= vocab_size) {
            return Err(CandleError::TokenOutOfRange { token, index, vocab_size });
        }
        let (position, max_context) = (self.cache.len(), self.cache.max_context());
        if position + tokens.len() > max_context {
            return Err(CandleError::ContextFull { position, requested: tokens.len(), max_context });
        }
        Ok(())
    }

    /// Validates, runs and, on failure, rewinds the cache so the session is as it was.
    fn step(
        &mut self,
        operation: &'static str,
        tokens: &[u32],
        rows: LogitsRows,
        obs: &mut impl Observer,
    ) -> Result<StepOutput> {
        self.check(operation, tokens)?;
        let start = self.cache.len();
        match self.decoder.forward(tokens, &mut self.cache, rows, obs) {
            Ok(logits) => {
                self.tokens.extend_from_slice(tokens);
                Ok(StepOutput { logits, start_position: start, tokens: tokens.len() })
            }
            Err(source) => {
                self.cache.truncate(start);
                Err(CandleError::Candle {
                    context: format!("running {operation} at position {start}"),
                    source: crate::backend::error::without_backtrace(source),
                })
            }
        }
    }

    fn inspect(
        &mut self,
        operation: &'static str,
        tokens: &[u32],
        rows: LogitsRows,
        request: &ObservationRequest,
    ) -> Result<InspectedOutput<StepOutput>> {
        request.validate(self.decoder.observation_points().iter().map(String::as_str))?;
        let mut rec = Recorder::new(request);
        let output = self.step(operation, tokens, rows, &mut rec)?;
        Ok(InspectedOutput { output, observations: rec.finish()? })
    }

    fn completion(&self) -> CandleCompletion {
        CandleCompletion { device: self.decoder.device().clone() }
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

    fn prefill(&mut self, _b: &CandleBackend, input: PrefillInput) -> Result<Submission<StepOutput, CandleCompletion>> {
        let rows = if input.all_logits { LogitsRows::All } else { LogitsRows::Last };
        let out = self.step("prefill", &input.tokens, rows, &mut NoObserver)?;
        Ok(Submission::new(out, self.completion()))
    }

    fn decode(&mut self, _b: &CandleBackend, input: DecodeInput) -> Result<Submission<StepOutput, CandleCompletion>> {
        let out = self.step("decode", &input.tokens, LogitsRows::All, &mut NoObserver)?;
        Ok(Submission::new(out, self.completion()))
    }

    fn observe_output(&self, _b: &CandleBackend, output: &StepOutput) -> Result<ObservationSet> {
        let (shape, data) = output.logits_f32()?;
        let mut set = ObservationSet::new();
        set.insert("model.logits", ObservationValue::Tensor { shape, data })?;
        Ok(set)
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
        self.inspect("inspect_prefill", &input.tokens, rows, request)
    }

    fn inspect_decode(
        &mut self,
        _b: &CandleBackend,
        input: DecodeInput,
        request: &ObservationRequest,
    ) -> Result<InspectedOutput<StepOutput>> {
        self.inspect("inspect_decode", &input.tokens, LogitsRows::All, request)
    }
}
