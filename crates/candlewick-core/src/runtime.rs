//! `ModelRuntime`: a backend, its prepared model and the model's one session, owned together.

use std::path::Path;

use crate::backend::{
    BackendProvider, BackendSession, BatchSession, InspectableBackendSession, InspectedOutput, InterventionSession,
    ModelLoadingBackend, PreparedModel, SnapshotSession,
};
use crate::capabilities::SessionCapabilities;
use crate::completion::Submission;
use crate::error::{ModelLoadError, RuntimeError};
use crate::intervention::Intervention;
use crate::observation::{ObservationRequest, ObservationSet};

type SessionOf<B> = <B as BackendProvider>::Session;
type SubmissionOf<B> =
    Submission<<SessionOf<B> as BackendSession<B>>::Output, <SessionOf<B> as BackendSession<B>>::Completion>;

/// The one owner of a backend and its session: a session never runs through another backend.
#[derive(Debug)]
pub struct ModelRuntime<B: BackendProvider> {
    backend: B,
    session: B::Session,
    capabilities: SessionCapabilities,
    /// Counts the steps run through the runtime (see `epoch`; the session counts its own changes).
    epoch: u64,
}

impl<B: BackendProvider> ModelRuntime<B> {
    /// Prepares `config` on `backend` and opens its session.
    pub fn prepare(backend: B, config: B::ModelConfig) -> Result<Self, ModelLoadError<B::Error>> {
        let model = backend
            .prepare_model(config)
            .map_err(|source| ModelLoadError::Backend { operation: "preparing the model", source })?;
        Self::from_prepared(backend, model)
    }

    /// Opens the session of a prepared model, refusing one whose capabilities differ from those admitted.
    pub fn from_prepared(backend: B, model: PreparedModel<B::Model>) -> Result<Self, ModelLoadError<B::Error>> {
        let admitted = model.capabilities();
        let session = backend
            .create_session(model)
            .map_err(|source| ModelLoadError::Backend { operation: "creating the session", source })?;
        let realised = session.capabilities();
        if realised != admitted {
            return Err(RuntimeError::CapabilityMismatch { admitted, realised }.into());
        }
        Ok(Self { backend, session, capabilities: admitted, epoch: 0 })
    }

    /// The backend this runtime's session runs through.
    pub fn backend(&self) -> &B {
        &self.backend
    }

    /// The session, read-only.
    pub fn session(&self) -> &B::Session {
        &self.session
    }

    /// The session, for backend-specific operations (truncate, reset). Borrowing it changes
    /// nothing: what its methods change, the session counts (`BackendSession::changes`).
    pub fn session_mut(&mut self) -> &mut B::Session {
        &mut self.session
    }

    /// The backend and the session together, borrowed at once.
    pub fn parts_mut(&mut self) -> (&B, &mut B::Session) {
        (&self.backend, &mut self.session)
    }

    /// A number that moves whenever the session changed (a step, a rewind, a reset, a restore:
    /// the runtime's steps and the session's own count of its changes), so that a caller holding
    /// state across calls, such as a generation in progress, can tell that someone else used the
    /// session in between. A read, or a call that changes nothing, leaves it where it was.
    pub fn epoch(&self) -> u64 {
        self.epoch.wrapping_add(self.session.changes())
    }

    /// The capabilities admitted and realised.
    pub fn capabilities(&self) -> SessionCapabilities {
        self.capabilities
    }

    /// Submits a prefill.
    pub fn prefill(
        &mut self,
        input: <B::Session as BackendSession<B>>::PrefillInput,
    ) -> Result<SubmissionOf<B>, RuntimeError<B::Error>> {
        self.epoch += 1;
        self.session.prefill(&self.backend, input).map_err(RuntimeError::Backend)
    }

    /// Submits a decode.
    pub fn decode(
        &mut self,
        input: <B::Session as BackendSession<B>>::DecodeInput,
    ) -> Result<SubmissionOf<B>, RuntimeError<B::Error>> {
        self.epoch += 1;
        self.session.decode(&self.backend, input).map_err(RuntimeError::Backend)
    }

    /// Brings an output's values to the host.
    pub fn observe_output(
        &self,
        output: &<B::Session as BackendSession<B>>::Output,
    ) -> Result<ObservationSet, RuntimeError<B::Error>> {
        if !self.capabilities.output_observation {
            return Err(RuntimeError::MissingCapability {
                operation: "observe_output",
                capability: "output_observation",
            });
        }
        self.session.observe_output(&self.backend, output).map_err(RuntimeError::Backend)
    }
}

impl<B: ModelLoadingBackend> ModelRuntime<B> {
    /// Loads an artifact (GGUF file or Hugging Face directory), prepares it and opens its session.
    pub fn load(backend: B, artifact: &Path, options: &B::LoadOptions) -> Result<Self, ModelLoadError<B::Error>> {
        let config = backend
            .load_config(artifact, options)
            .map_err(|source| ModelLoadError::Artifact { path: artifact.display().to_string(), source })?;
        Self::prepare(backend, config)
    }
}

impl<B> ModelRuntime<B>
where
    B: BackendProvider,
    B::Session: InspectableBackendSession<B>,
{
    fn require_inspection(&self, operation: &'static str) -> Result<(), RuntimeError<B::Error>> {
        if self.capabilities.activation_inspection {
            Ok(())
        } else {
            Err(RuntimeError::MissingCapability { operation, capability: "activation_inspection" })
        }
    }

    /// Every observation path the model offers.
    pub fn observation_points(&self) -> Vec<String> {
        self.session.observation_points()
    }

    /// A prefill that also materialises the requested observation points.
    pub fn inspect_prefill(
        &mut self,
        input: <B::Session as BackendSession<B>>::PrefillInput,
        request: &ObservationRequest,
    ) -> Result<InspectedOutput<<B::Session as BackendSession<B>>::Output>, RuntimeError<B::Error>> {
        self.require_inspection("inspect_prefill")?;
        self.validate(request)?;
        self.epoch += 1;
        self.session.inspect_prefill(&self.backend, input, request).map_err(RuntimeError::Backend)
    }

    /// A decode that also materialises the requested observation points.
    pub fn inspect_decode(
        &mut self,
        input: <B::Session as BackendSession<B>>::DecodeInput,
        request: &ObservationRequest,
    ) -> Result<InspectedOutput<<B::Session as BackendSession<B>>::Output>, RuntimeError<B::Error>> {
        self.require_inspection("inspect_decode")?;
        self.validate(request)?;
        self.epoch += 1;
        self.session.inspect_decode(&self.backend, input, request).map_err(RuntimeError::Backend)
    }

    /// Runs `input` on a fresh, empty context and returns every row's logits with the requested
    /// points, leaving the session exactly as it was (TransformerLens' `run_with_cache`).
    pub fn trace(
        &self,
        input: <B::Session as BackendSession<B>>::PrefillInput,
        request: &ObservationRequest,
    ) -> Result<InspectedOutput<<B::Session as BackendSession<B>>::Output>, RuntimeError<B::Error>> {
        self.require_inspection("trace")?;
        self.validate(request)?;
        self.session.trace(&self.backend, input, request).map_err(RuntimeError::Backend)
    }

    fn validate(&self, request: &ObservationRequest) -> Result<(), RuntimeError<B::Error>> {
        let points = self.session.observation_points();
        request.validate(points.iter().map(String::as_str))?;
        Ok(())
    }
}

impl<B> ModelRuntime<B>
where
    B: BackendProvider,
    B::Session: InterventionSession<B>,
{
    fn require_intervention(&self, operation: &'static str) -> Result<(), RuntimeError<B::Error>> {
        if self.capabilities.activation_intervention {
            Ok(())
        } else {
            Err(RuntimeError::MissingCapability { operation, capability: "activation_intervention" })
        }
    }

    /// Keeps `edits` on for every later step (generation included); `[]` turns them off.
    /// A bad edit is an error and leaves the kept edits as they were.
    pub fn set_interventions(&mut self, edits: Vec<Intervention>) -> Result<(), RuntimeError<B::Error>> {
        // Turning edits off needs no capability.
        if !edits.is_empty() {
            self.require_intervention("set_interventions")?;
        }
        self.session.set_interventions(edits).map_err(RuntimeError::from)
    }

    /// The edits kept on.
    pub fn interventions(&self) -> Vec<Intervention> {
        self.session.interventions()
    }
}

impl<B> ModelRuntime<B>
where
    B: BackendProvider + Clone,
    B::Session: SnapshotSession<B>,
{
    /// A second runtime over the same weights whose session starts as a copy of this one's.
    pub fn fork(&self) -> Result<Self, RuntimeError<B::Error>> {
        let session = self.session.fork().map_err(RuntimeError::Backend)?;
        Ok(Self { backend: self.backend.clone(), session, capabilities: self.capabilities, epoch: 0 })
    }

    /// A second runtime over the same weights with an empty session and this one's kept edits.
    pub fn fork_empty(&self) -> Result<Self, RuntimeError<B::Error>> {
        let session = self.session.fork_empty().map_err(RuntimeError::Backend)?;
        Ok(Self { backend: self.backend.clone(), session, capabilities: self.capabilities, epoch: 0 })
    }
}

impl<B> ModelRuntime<B>
where
    B: BackendProvider,
    B::Session: BatchSession<B>,
{
    /// One decode step of several runtimes of the same model together (see `BatchSession`).
    pub fn decode_batch(
        runtimes: &mut [&mut ModelRuntime<B>],
        inputs: Vec<<B::Session as BackendSession<B>>::DecodeInput>,
    ) -> Result<Vec<SubmissionOf<B>>, RuntimeError<B::Error>> {
        let mut backend: Option<&B> = None;
        let mut sessions: Vec<&mut B::Session> = Vec::with_capacity(runtimes.len());
        for rt in runtimes.iter_mut() {
            rt.epoch += 1;
            let ModelRuntime { backend: b, session, .. } = &mut **rt;
            // Any runtime's backend serves: sessions of one model share one device.
            backend.get_or_insert(b);
            sessions.push(session);
        }
        let Some(backend) = backend else { return Ok(Vec::new()) };
        B::Session::decode_batch(backend, &mut sessions, inputs).map_err(RuntimeError::Backend)
    }
}
