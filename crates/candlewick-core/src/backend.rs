//! The traits a backend implements, and the proofs it hands out.

use std::path::Path;

use crate::capabilities::SessionCapabilities;
use crate::completion::{Completion, Submission};
use crate::intervention::{Intervention, InterventionError};
use crate::observation::{ObservationRequest, ObservationSet};
use crate::step::HostLogits;

/// Names a backend and the device it runs a model on.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BackendDescriptor {
    /// The backend's name, e.g. `candle`.
    pub name: String,
    /// The device it runs on.
    pub device: DeviceDescriptor,
}

/// One device a backend can run on.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct DeviceDescriptor {
    /// The device kind: `cpu`, `cuda`, `metal`.
    pub kind: String,
    /// The ordinal among devices of its kind.
    pub ordinal: usize,
}

impl std::fmt::Display for DeviceDescriptor {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        if self.kind == "cpu" {
            f.write_str("cpu")
        } else {
            write!(f, "{}:{}", self.kind, self.ordinal)
        }
    }
}

/// What a device can do.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct DeviceCapabilities {
    /// Element types the device computes in, e.g. `f32`, `f16`, `bf16`.
    pub dtypes: Vec<String>,
    /// Whether work on it completes asynchronously.
    pub asynchronous: bool,
}

/// Proof that a backend prepared `M`, carrying the capabilities admitted at preparation.
#[derive(Debug)]
pub struct PreparedModel<M> {
    model: M,
    capabilities: SessionCapabilities,
}

impl<M> PreparedModel<M> {
    /// Wraps a model the calling backend has prepared; only backends should call this.
    pub fn new(model: M, capabilities: SessionCapabilities) -> Self {
        Self { model, capabilities }
    }

    /// The prepared model.
    pub fn model(&self) -> &M {
        &self.model
    }

    /// The capabilities admitted at preparation.
    pub fn capabilities(&self) -> SessionCapabilities {
        self.capabilities
    }

    /// Gives up the proof for the model itself (for `create_session`).
    pub fn into_parts(self) -> (M, SessionCapabilities) {
        (self.model, self.capabilities)
    }
}

/// One backend chosen for a whole model.
pub trait BackendProvider: Sized {
    /// What `prepare_model` takes: weights and architecture, backend-specific.
    type ModelConfig;
    /// The backend's executable model.
    type Model;
    /// The backend's execution session.
    type Session: BackendSession<Self>;
    /// The backend's error.
    type Error: std::error::Error + Send + Sync + 'static;

    /// The backend's name and device.
    fn descriptor(&self) -> BackendDescriptor;
    /// Every device this backend could run on, with what each can do.
    fn devices(&self) -> Result<Vec<(DeviceDescriptor, DeviceCapabilities)>, Self::Error>;
    /// Prepares a model for execution on this backend.
    fn prepare_model(&self, config: Self::ModelConfig) -> Result<PreparedModel<Self::Model>, Self::Error>;
    /// Creates the one session for a prepared model, consuming it.
    fn create_session(&self, model: PreparedModel<Self::Model>) -> Result<Self::Session, Self::Error>;
}

/// An execution session: a model and its cache, stepped by submissions.
///
/// Everything a generic caller needs (generation, the engine) is here, so that none of them
/// names a backend type: plain token-id inputs, position and cached tokens, rewinding, the
/// model's own stop ids, and logits on the host.
pub trait BackendSession<B: BackendProvider> {
    /// What a prefill takes; plain token ids convert into it.
    type PrefillInput: From<Vec<u32>>;
    /// What a decode takes; plain token ids convert into it.
    type DecodeInput: From<Vec<u32>>;
    /// What a step yields, still on the device.
    type Output;
    /// The completion handle of one submission.
    type Completion: Completion<Error = B::Error>;

    /// The capabilities this session realises.
    fn capabilities(&self) -> SessionCapabilities;
    /// Appends a chunk of tokens at the current position.
    fn prefill(
        &mut self,
        backend: &B,
        input: Self::PrefillInput,
    ) -> Result<Submission<Self::Output, Self::Completion>, B::Error>;
    /// Appends tokens one step at a time and yields logits for each.
    fn decode(
        &mut self,
        backend: &B,
        input: Self::DecodeInput,
    ) -> Result<Submission<Self::Output, Self::Completion>, B::Error>;
    /// Synchronises and copies an output's values to the host; ordinary inference never calls it.
    fn observe_output(&self, backend: &B, output: &Self::Output) -> Result<ObservationSet, B::Error>;
    /// Synchronises and copies an output's logits to the host (what a sampler reads).
    fn logits_to_host(&self, output: &Self::Output) -> Result<HostLogits, B::Error>;

    /// Tokens held in the cache.
    fn position(&self) -> usize;
    /// The most tokens the session may hold.
    fn max_context(&self) -> usize;
    /// The token ids the cache holds, oldest first.
    fn tokens(&self) -> &[u32];
    /// The number of logits a step yields for each row (the vocabulary the output covers).
    fn vocab_size(&self) -> usize;
    /// The leading tokens whose cached keys and values were computed under the edits kept on
    /// the session now (and no per-call edit): only these may be reused for a new prompt.
    fn reusable_tokens(&self) -> &[u32] {
        self.tokens()
    }
    /// Checks, without changing anything, that `tokens` could be appended at position `at`
    /// (ids in the vocabulary, the context not exceeded): a caller that must rewind first
    /// validates before it touches the session.
    fn check_append(&self, at: usize, tokens: &[u32]) -> Result<(), B::Error>;
    /// A hint that the session will soon hold `total` tokens (a prompt and the tokens to be
    /// generated after it), so a cache can allocate once rather than grow; nothing else changes.
    fn reserve(&mut self, _total: usize) {}
    /// Rewinds the cache to its first `n` tokens.
    fn truncate(&mut self, n: usize) -> Result<(), B::Error>;
    /// Whether `truncate(n)` would succeed: `n` up to the position, where a cache that keeps
    /// only recent keys (sliding windows) still holds what a step at `n` attends. 0 always does.
    fn can_truncate(&self, n: usize) -> bool {
        n <= self.position()
    }
    /// Where a step of prompt positions `start..end` should end instead so that it cuts no unit
    /// the model must run whole (an image's tokens): `end`, or later. A chunked prefill asks.
    fn step_end(&self, start: usize, end: usize) -> usize {
        let _ = start;
        end
    }
    /// Empties the cache (and clears any earlier internal failure).
    fn reset(&mut self);
    /// The ids the model itself declares as ending a sequence.
    fn stop_token_ids(&self) -> Vec<u32>;
    /// A number that moves whenever the session's state is changed through it: every step,
    /// truncate (even to where it is), reset and restore, and whatever else a backend's own
    /// methods change (staged inputs, the cache's layout); never by a read, nor by a call that
    /// changes nothing. `ModelRuntime::epoch` adds it to its own count.
    fn changes(&self) -> u64;
}

/// Sessions of one model that can decode together: one step carries every session's rows
/// through each matrix product (the weights are read once), attention runs per session.
pub trait BatchSession<B: BackendProvider>: BackendSession<B> + Sized {
    /// Appends each session's tokens and returns each one's output, as `decode` would alone.
    /// On failure every session is left as it was.
    fn decode_batch(
        backend: &B,
        sessions: &mut [&mut Self],
        inputs: Vec<Self::DecodeInput>,
    ) -> Result<Vec<Submission<Self::Output, Self::Completion>>, B::Error>;
}

/// A session whose state can be copied: forks over the same weights, and snapshots to restore.
pub trait SnapshotSession<B: BackendProvider>: BackendSession<B> + Sized {
    /// A copy of a session's tokens and cache, independent of the session.
    type Snapshot;
    /// A new session over the same (shared) weights starting as a copy of this one: tokens,
    /// position, cache and kept edits. Only the cache costs memory.
    fn fork(&self) -> Result<Self, B::Error>;
    /// A new, empty session over the same weights with this one's kept edits (no cache copied).
    fn fork_empty(&self) -> Result<Self, B::Error> {
        let mut s = self.fork()?;
        s.reset();
        Ok(s)
    }
    /// Copies the tokens and cache.
    fn snapshot(&self) -> Result<Self::Snapshot, B::Error>;
    /// Puts a snapshot's tokens and cache back; a snapshot of another model is an error and
    /// leaves the session unchanged.
    fn restore(&mut self, snapshot: &Self::Snapshot) -> Result<(), B::Error>;
}

/// A session that applies edits to named points (docs/interventions.md) while it steps.
pub trait InterventionSession<B: BackendProvider>: BackendSession<B> {
    /// Validates and keeps `edits` for every later step; on error nothing changes.
    fn set_interventions(&mut self, edits: Vec<Intervention>) -> Result<(), InterventionError>;
    /// The edits kept on the session.
    fn interventions(&self) -> Vec<Intervention>;
}

/// An output together with the named activations that were asked for.
#[derive(Debug)]
pub struct InspectedOutput<O> {
    /// The ordinary output of the step.
    pub output: O,
    /// Only the requested observation points, on the host.
    pub observations: ObservationSet,
}

/// A session that can materialise named activations while it steps.
pub trait InspectableBackendSession<B: BackendProvider>: BackendSession<B> {
    /// Every observation path this session's model offers.
    fn observation_points(&self) -> Vec<String>;
    /// A prefill that runs to completion and materialises the requested points.
    fn inspect_prefill(
        &mut self,
        backend: &B,
        input: Self::PrefillInput,
        request: &ObservationRequest,
    ) -> Result<InspectedOutput<Self::Output>, B::Error>;
    /// A decode that runs to completion and materialises the requested points.
    fn inspect_decode(
        &mut self,
        backend: &B,
        input: Self::DecodeInput,
        request: &ObservationRequest,
    ) -> Result<InspectedOutput<Self::Output>, B::Error>;
    /// Runs `input` on a fresh context of its own (every row's logits, the requested points)
    /// without touching this session's cache, position or tokens.
    fn trace(
        &self,
        backend: &B,
        input: Self::PrefillInput,
        request: &ObservationRequest,
    ) -> Result<InspectedOutput<Self::Output>, B::Error>;
}

/// A backend that can turn an artifact on disk into its own model configuration.
pub trait ModelLoadingBackend: BackendProvider {
    /// Options for loading (dtype, context size, ...).
    type LoadOptions;
    /// Reads the artifact (a GGUF file, a Hugging Face directory) into a model configuration.
    fn load_config(&self, artifact: &Path, options: &Self::LoadOptions) -> Result<Self::ModelConfig, Self::Error>;
}
