//! The candle session: a shared decoder, its own KV cache, position and kept edits.

use std::sync::Arc;

use candle_core::{Device, Tensor};

use crate::backend::decoder::hooks::{Hooks, NoHooks, ReadyEdits, StepHooks};
use crate::backend::decoder::{Decoder, LogitsRows};
use crate::backend::error::{CandleContext, CandleError, Result};
use crate::backend::host::to_host_f32;
use crate::backend::kv_cache::KvCache;
use crate::backend::CandleBackend;
use crate::core::{
    BackendSession, Completion, DecodeInput, HostLogits, InspectableBackendSession, InspectedOutput, Intervention,
    InterventionError, InterventionSession, InterventionSet, ObservationRequest, ObservationSet, ObservationValue,
    PrefillInput, SessionCapabilities, Submission,
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
#[derive(Debug, Clone)]
pub struct CandleSession {
    decoder: Arc<Decoder>,
    cache: KvCache,
    /// The token ids the cache holds, so a new prompt can reuse a shared prefix.
    tokens: Vec<u32>,
    capabilities: SessionCapabilities,
    edits: KeptEdits,
}

impl CandleSession {
    /// A session over a shared `decoder` with a cache of `max_context` positions.
    pub(crate) fn new(decoder: Arc<Decoder>, max_context: usize, capabilities: SessionCapabilities) -> Self {
        let n = decoder.config().num_layers();
        Self {
            decoder,
            cache: KvCache::new(n, max_context),
            tokens: Vec::new(),
            capabilities,
            edits: KeptEdits::default(),
        }
    }

    /// The decoder this session runs (shared with every session of the same model).
    pub fn decoder(&self) -> &Arc<Decoder> {
        &self.decoder
    }

    /// A new session over the same weights that starts as a copy of this one (cache, tokens, edits).
    pub fn fork(&self) -> Self {
        self.clone()
    }

    /// Bytes held by the KV cache.
    pub fn cache_bytes(&self) -> usize {
        self.cache.allocated_bytes()
    }

    /// Validates `edits` against this model and readies them for its device.
    fn ready(&self, edits: Vec<Intervention>) -> Result<KeptEdits> {
        let d = &self.decoder;
        let set = InterventionSet::new(edits, |p| d.point_shape(p), self.cache.max_context())?;
        let ready = ReadyEdits::new(&set, |p| d.point_shape(p).unwrap_or_default(), d.device())?;
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

    /// Validates, runs and, on failure, rewinds the cache so the session is as it was.
    fn step(
        &mut self,
        operation: &'static str,
        tokens: &[u32],
        rows: LogitsRows,
        hooks: &mut impl Hooks,
    ) -> Result<StepOutput> {
        self.check_append(self.cache.len(), tokens).map_err(|e| match e {
            CandleError::InvalidInput { reason, .. } => CandleError::InvalidInput { operation, reason },
            other => other,
        })?;
        let start = self.cache.len();
        match self.decoder.forward(tokens, &mut self.cache, rows, hooks) {
            Ok(logits) => {
                self.tokens.extend_from_slice(tokens);
                Ok(StepOutput { logits, start_position: start, num_tokens: tokens.len() })
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

    /// One step with the kept and the call's edits, recording what `request` selects.
    fn run(
        &mut self,
        operation: &'static str,
        tokens: &[u32],
        rows: LogitsRows,
        call_edits: Vec<Intervention>,
        request: Option<&ObservationRequest>,
    ) -> Result<InspectedOutput<StepOutput>> {
        if let Some(r) = request {
            r.validate(self.decoder.observation_points().iter().map(String::as_str))?;
        }
        let edits = self.edits_for_call(call_edits)?;
        if request.is_none() && edits.is_empty() {
            // The plain forward pass: no hook is even consulted.
            let output = self.step(operation, tokens, rows, &mut NoHooks)?;
            return Ok(InspectedOutput { output, observations: ObservationSet::new() });
        }
        let mut hooks = StepHooks::new(request, &edits, self.cache.len());
        let output = self.step(operation, tokens, rows, &mut hooks)?;
        Ok(InspectedOutput { output, observations: hooks.finish()? })
    }

    /// The logit lens: final norm, output projection and soft-capping of float32 `[T, H]`.
    pub fn unembed(&self, shape: &[usize], data: Vec<f32>) -> Result<(Vec<usize>, Vec<f32>)> {
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

    fn check_append(&self, at: usize, tokens: &[u32]) -> Result<()> {
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
        self.cache.truncate(n);
        self.tokens.truncate(n);
        Ok(())
    }

    fn reset(&mut self) {
        self.cache.reset();
        self.tokens.clear();
    }

    fn stop_token_ids(&self) -> Vec<u32> {
        self.decoder.config().eos_token_ids.clone()
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
        let mut scratch = CandleSession {
            decoder: Arc::clone(&self.decoder),
            cache: KvCache::new(self.decoder.config().num_layers(), self.cache.max_context()),
            tokens: Vec::new(),
            capabilities: self.capabilities,
            edits: self.edits.clone(),
        };
        scratch.run("trace", &input.tokens, LogitsRows::All, input.interventions, Some(request))
    }
}

impl InterventionSession<CandleBackend> for CandleSession {
    fn set_interventions(&mut self, edits: Vec<Intervention>) -> std::result::Result<(), InterventionError> {
        if edits.is_empty() {
            self.edits = KeptEdits::default();
            return Ok(());
        }
        self.edits = self.ready(edits).map_err(|e| match e {
            CandleError::Intervention(e) => e,
            // Validation passed; only moving the vectors onto the device can fail here.
            other => InterventionError::Invalid {
                point: "(all)".into(),
                op: "prepare",
                reason: format!("cannot place the edits on the device: {other}"),
            },
        })?;
        Ok(())
    }

    fn interventions(&self) -> Vec<Intervention> {
        self.edits.set.interventions()
    }
}
