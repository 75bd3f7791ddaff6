//! What a session has been proven able to do.

use std::fmt;

/// Fail-closed capability flags: each is false unless the backend proved it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct SessionCapabilities {
    /// The session keeps its KV cache between submissions.
    pub persistent_cache: bool,
    /// `observe_output` can bring an output's values to the host.
    pub output_observation: bool,
    /// `inspect_prefill` / `inspect_decode` can materialise named activations.
    pub activation_inspection: bool,
    /// Steps can apply edits to named points (docs/interventions.md).
    pub activation_intervention: bool,
}

impl SessionCapabilities {
    /// No capability at all: the safe default.
    pub const NONE: Self = Self {
        persistent_cache: false,
        output_observation: false,
        activation_inspection: false,
        activation_intervention: false,
    };

    /// Every capability this contract knows.
    pub const ALL: Self = Self {
        persistent_cache: true,
        output_observation: true,
        activation_inspection: true,
        activation_intervention: true,
    };
}

impl fmt::Display for SessionCapabilities {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "persistent_cache={}, output_observation={}, activation_inspection={}, activation_intervention={}",
            self.persistent_cache, self.output_observation, self.activation_inspection, self.activation_intervention
        )
    }
}
