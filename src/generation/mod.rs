//! Generation: sampling, stopping and the token loop over a runtime's session.

pub mod generator;
pub mod sampling;
pub mod stopping;

pub use generator::{FinishReason, GenerateOptions, Generation, GenerationError, GenerationResult, Usage};
pub use sampling::{Sampler, SamplingParams};
pub use stopping::StopStrings;
