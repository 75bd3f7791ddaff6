//! The backend-neutral contract: traits and types every backend implements.
//!
//! Nothing here names a candle type, so a second backend (or a test double) can stand
//! behind the same `ModelRuntime` without pulling in the tensor framework.

pub mod backend;
pub mod capabilities;
pub mod completion;
pub mod error;
pub mod intervention;
pub mod observation;
pub mod points;
pub mod runtime;
pub mod step;

pub use backend::{
    BackendDescriptor, BackendProvider, BackendSession, BatchSession, DeviceCapabilities, DeviceDescriptor,
    InspectableBackendSession, InspectedOutput, InterventionSession, ModelLoadingBackend, PreparedModel,
    SnapshotSession,
};
pub use capabilities::SessionCapabilities;
pub use completion::{Completion, ReadyCompletion, Submission};
pub use error::{ModelLoadError, RuntimeError};
pub use intervention::{EditOp, Intervention, InterventionError, InterventionSet, PointShape, SaeEdit};
pub use observation::{ObservationError, ObservationRequest, ObservationSelector, ObservationSet, ObservationValue};
pub use points::{LayerPoint, Point, SaePoint};
pub use runtime::ModelRuntime;
pub use step::{DecodeInput, HostLogits, PrefillInput};

#[cfg(test)]
mod tests;
