//! Generation: sampling, stopping and the token loop over a runtime's session.

pub mod batch;
pub mod constraint;
pub mod generator;
pub mod sampling;
pub mod speculative;
pub mod stopping;

pub use batch::{generate_batch, step_together};
pub use constraint::{Constraint, ConstraintSpec};
pub use generator::{
    AdapterChoice, Advance, FinishReason, GenerateOptions, Generation, GenerationError, GenerationResult,
    PendingPrefill, TokenLogprobs, Usage,
};
pub use sampling::{Sampler, SamplingParams};
pub use stopping::StopStrings;
