//! The backend-neutral contract: traits and types every backend implements.
//!
//! Nothing here names a candle type, so a second backend (or a test double) can stand
//! behind the same `ModelRuntime` without pulling in the tensor framework.

pub mod backend;
pub mod capabilities;
pub mod completion;
pub mod error;
pub mod observation;
pub mod runtime;

pub use backend::{
    BackendDescriptor, BackendProvider, BackendSession, DeviceCapabilities, DeviceDescriptor,
    InspectableBackendSession, InspectedOutput, ModelLoadingBackend, PreparedModel,
};
pub use capabilities::SessionCapabilities;
pub use completion::{Completion, ReadyCompletion, Submission};
pub use error::{ModelLoadError, RuntimeError};
pub use observation::{ObservationError, ObservationRequest, ObservationSelector, ObservationSet, ObservationValue};
pub use runtime::ModelRuntime;

#[cfg(test)]
mod tests;
