//! Errors of the contract layer.

use crate::capabilities::SessionCapabilities;
use crate::intervention::InterventionError;
use crate::observation::ObservationError;

/// Why `ModelRuntime::load` failed: the artifact, the backend, or a capability mismatch.
#[derive(Debug, thiserror::Error)]
pub enum ModelLoadError<E: std::error::Error + 'static> {
    /// The artifact (file or directory) could not be turned into a model configuration.
    #[error("cannot load artifact {path}: {source}")]
    Artifact {
        /// The artifact's path as given.
        path: String,
        /// The backend's description of what is wrong with it.
        #[source]
        source: E,
    },
    /// The backend failed to prepare the model or create its session.
    #[error("backend failed while {operation}: {source}")]
    Backend {
        /// What was being done.
        operation: &'static str,
        /// The backend's error.
        #[source]
        source: E,
    },
    /// The realised session does not have the capabilities the model was admitted with.
    #[error(transparent)]
    Runtime(#[from] RuntimeError<E>),
}

/// Why a `ModelRuntime` operation failed.
#[derive(Debug, thiserror::Error)]
pub enum RuntimeError<E: std::error::Error + 'static> {
    /// The backend reported an error.
    #[error(transparent)]
    Backend(E),
    /// The session's realised capabilities differ from those admitted at preparation.
    #[error("session capabilities ({realised}) differ from those admitted at preparation ({admitted})")]
    CapabilityMismatch {
        /// What preparation admitted.
        admitted: SessionCapabilities,
        /// What the created session reports.
        realised: SessionCapabilities,
    },
    /// The operation needs a capability this session does not have.
    #[error("{operation} needs the `{capability}` capability, which this session does not have")]
    MissingCapability {
        /// The operation that was refused.
        operation: &'static str,
        /// The missing capability's name.
        capability: &'static str,
    },
    /// An observation request or set was invalid.
    #[error(transparent)]
    Observation(#[from] ObservationError),
    /// An intervention was invalid; none of its list was applied.
    #[error(transparent)]
    Intervention(#[from] InterventionError),
}
