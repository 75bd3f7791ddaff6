//! The contract's rules, exercised through a minimal backend of the tests' own.

use super::*;

#[derive(Debug, thiserror::Error)]
#[error("fake backend error: {0}")]
struct FakeError(&'static str);

/// A backend whose sessions realise whatever capabilities it is told to, so mismatches can be provoked.
#[derive(Debug)]
struct FakeBackend {
    realise: SessionCapabilities,
}

#[derive(Debug)]
struct FakeSession {
    caps: SessionCapabilities,
    position: usize,
    tokens: Vec<u32>,
    edits: Vec<Intervention>,
    changes: u64,
}

impl BackendProvider for FakeBackend {
    type ModelConfig = SessionCapabilities;
    type Model = ();
    type Session = FakeSession;
    type Error = FakeError;

    fn descriptor(&self) -> BackendDescriptor {
        BackendDescriptor { name: "fake".into(), device: DeviceDescriptor { kind: "cpu".into(), ordinal: 0 } }
    }
    fn devices(&self) -> Result<Vec<(DeviceDescriptor, DeviceCapabilities)>, FakeError> {
        Ok(vec![(self.descriptor().device, DeviceCapabilities::default())])
    }
    fn prepare_model(&self, admitted: SessionCapabilities) -> Result<PreparedModel<()>, FakeError> {
        Ok(PreparedModel::new((), admitted))
    }
    fn create_session(&self, _model: PreparedModel<()>) -> Result<FakeSession, FakeError> {
        Ok(FakeSession { caps: self.realise, position: 0, tokens: Vec::new(), edits: Vec::new(), changes: 0 })
    }
}

impl BackendSession<FakeBackend> for FakeSession {
    type PrefillInput = PrefillInput;
    type DecodeInput = DecodeInput;
    type Output = usize;
    type Completion = ReadyCompletion<FakeError>;

    fn capabilities(&self) -> SessionCapabilities {
        self.caps
    }
    fn prefill(&mut self, _b: &FakeBackend, i: PrefillInput) -> Result<Submission<usize, Self::Completion>, FakeError> {
        self.position += i.tokens.len();
        self.tokens.extend(i.tokens);
        Ok(Submission::new(self.position, ReadyCompletion::new()))
    }
    fn decode(&mut self, b: &FakeBackend, i: DecodeInput) -> Result<Submission<usize, Self::Completion>, FakeError> {
        self.prefill(b, i.tokens.into())
    }
    fn logits_to_host(&self, out: &usize) -> Result<HostLogits, FakeError> {
        Ok(HostLogits { rows: 1, vocab: 1, data: vec![*out as f32] })
    }
    fn position(&self) -> usize {
        self.position
    }
    fn max_context(&self) -> usize {
        64
    }
    fn tokens(&self) -> &[u32] {
        &self.tokens
    }
    fn vocab_size(&self) -> usize {
        1
    }
    fn check_append(&self, at: usize, tokens: &[u32]) -> Result<(), FakeError> {
        if at + tokens.len() > 64 {
            return Err(FakeError("context full"));
        }
        Ok(())
    }
    fn truncate(&mut self, n: usize) -> Result<(), FakeError> {
        self.position = self.position.min(n);
        self.tokens.truncate(n);
        self.changes += 1;
        Ok(())
    }
    fn reset(&mut self) {
        self.position = 0;
        self.tokens.clear();
        self.changes += 1;
    }
    fn stop_token_ids(&self) -> Vec<u32> {
        Vec::new()
    }
    fn changes(&self) -> u64 {
        self.changes
    }
    fn observe_output(&self, _b: &FakeBackend, out: &usize) -> Result<ObservationSet, FakeError> {
        let mut set = ObservationSet::new();
        set.insert("model.position", ObservationValue::Int(*out as i64)).map_err(|_| FakeError("insert"))?;
        Ok(set)
    }
}

impl InspectableBackendSession<FakeBackend> for FakeSession {
    fn observation_points(&self) -> Vec<String> {
        vec!["model.position".into()]
    }
    fn inspect_prefill(
        &mut self,
        b: &FakeBackend,
        i: PrefillInput,
        _r: &ObservationRequest,
    ) -> Result<InspectedOutput<usize>, FakeError> {
        let output = self.prefill(b, i)?.wait()?;
        Ok(InspectedOutput { output, observations: self.observe_output(b, &output)? })
    }
    fn inspect_decode(
        &mut self,
        b: &FakeBackend,
        i: DecodeInput,
        r: &ObservationRequest,
    ) -> Result<InspectedOutput<usize>, FakeError> {
        self.inspect_prefill(b, i.tokens.into(), r)
    }
    fn trace(
        &self,
        b: &FakeBackend,
        i: PrefillInput,
        _r: &ObservationRequest,
    ) -> Result<InspectedOutput<usize>, FakeError> {
        let output = i.tokens.len();
        Ok(InspectedOutput { output, observations: self.observe_output(b, &output)? })
    }
}

impl InterventionSession<FakeBackend> for FakeSession {
    fn set_interventions(&mut self, edits: Vec<Intervention>) -> Result<(), InterventionError> {
        self.edits = edits;
        Ok(())
    }
    fn interventions(&self) -> Vec<Intervention> {
        self.edits.clone()
    }
}

#[test]
fn session_with_other_capabilities_than_admitted_is_refused() {
    let admitted = SessionCapabilities { persistent_cache: true, ..SessionCapabilities::NONE };
    let err = ModelRuntime::prepare(FakeBackend { realise: SessionCapabilities::ALL }, admitted).unwrap_err();
    assert!(matches!(err, ModelLoadError::Runtime(RuntimeError::CapabilityMismatch { .. })), "{err}");
}

#[test]
fn matching_capabilities_are_accepted_and_steps_go_through() {
    let mut rt =
        ModelRuntime::prepare(FakeBackend { realise: SessionCapabilities::ALL }, SessionCapabilities::ALL).unwrap();
    assert_eq!(rt.prefill(vec![1, 2, 3].into()).unwrap().wait().unwrap(), 3);
    let out = rt.decode(vec![4].into()).unwrap().wait().unwrap();
    let set = rt.observe_output(&out).unwrap();
    assert_eq!(set.get("model.position"), Some(&ObservationValue::Int(4)));
}

#[test]
fn capabilities_default_to_false() {
    assert_eq!(SessionCapabilities::default(), SessionCapabilities::NONE);
}

#[test]
fn inspection_without_the_capability_is_refused() {
    let caps = SessionCapabilities { activation_inspection: false, ..SessionCapabilities::ALL };
    let mut rt = ModelRuntime::prepare(FakeBackend { realise: caps }, caps).unwrap();
    let err = rt.inspect_prefill(vec![1, 2].into(), &ObservationRequest::all()).unwrap_err();
    assert!(matches!(err, RuntimeError::MissingCapability { capability: "activation_inspection", .. }), "{err}");
    // The refused call left the session where it was.
    assert_eq!(rt.session().position, 0);
}

#[test]
fn observation_without_the_capability_is_refused() {
    let caps = SessionCapabilities { persistent_cache: true, ..SessionCapabilities::NONE };
    let mut rt = ModelRuntime::prepare(FakeBackend { realise: caps }, caps).unwrap();
    let out = rt.prefill(vec![1].into()).unwrap().wait().unwrap();
    assert!(matches!(rt.observe_output(&out), Err(RuntimeError::MissingCapability { .. })));
}

#[test]
fn unknown_observation_point_is_refused_before_stepping() {
    let mut rt =
        ModelRuntime::prepare(FakeBackend { realise: SessionCapabilities::ALL }, SessionCapabilities::ALL).unwrap();
    let req = ObservationRequest::select([ObservationSelector::exact("model.nothing")]).unwrap();
    assert!(matches!(
        rt.inspect_prefill(vec![1].into(), &req),
        Err(RuntimeError::Observation(ObservationError::UnknownPoint { .. }))
    ));
    assert_eq!(rt.session().position, 0);
}

#[test]
fn interventions_without_the_capability_are_refused_and_off_is_always_allowed() {
    let caps = SessionCapabilities { activation_intervention: false, ..SessionCapabilities::ALL };
    let mut rt = ModelRuntime::prepare(FakeBackend { realise: caps }, caps).unwrap();
    let edit = Intervention {
        point: "model.layers.0.output".into(),
        op: EditOp::Scale { index: vec![0], factor: 0.0 },
        positions: None,
    };
    let err = rt.set_interventions(vec![edit]).unwrap_err();
    assert!(matches!(err, RuntimeError::MissingCapability { capability: "activation_intervention", .. }), "{err}");
    assert!(rt.interventions().is_empty());
    rt.set_interventions(Vec::new()).unwrap();
}

#[test]
fn the_epoch_moves_on_changes_not_on_borrows() {
    let mut rt =
        ModelRuntime::prepare(FakeBackend { realise: SessionCapabilities::ALL }, SessionCapabilities::ALL).unwrap();
    let start = rt.epoch();
    rt.prefill(vec![1, 2].into()).unwrap();
    let stepped = rt.epoch();
    assert_ne!(stepped, start);
    // A borrow that changes nothing leaves it; a truncate, even to where the session is, moves it.
    let _ = rt.session_mut().position;
    assert_eq!(rt.epoch(), stepped);
    rt.session_mut().truncate(2).unwrap();
    assert_ne!(rt.epoch(), stepped);
}
