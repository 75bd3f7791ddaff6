//! The candle backend: devices, checkpoint loading, the generic decoder and the session.
//!
//! Its floors, each using only those before it (a test over the `use` lines holds them):
//! `error`, `device`, `host`, `threads` → `config` → `weights` → `kv_cache` → `blocks` →
//! `decoder`, `encoder`, `vision` → `session` → `provider`. This file only names them and re-exports what the
//! layers above the backend use.

pub mod blocks;
pub mod config;
pub mod decoder;
pub mod device;
pub mod encoder;
pub mod error;
pub mod host;
/// The CPU kernels (the `candlewick-kernels` crate), under the path the decoder names them by.
pub use candlewick_kernels as kernels;
pub mod kv_cache;
pub mod provider;
pub mod session;
pub mod threads;
pub mod vision;
pub mod weights;

pub use device::CandleBackend;
pub use error::CandleError;
pub use kv_cache::KvType;
pub use provider::{
    parse_dtype, parse_kv_cache_type, ArtifactFormat, CandleModel, CandleModelConfig, LoadOptions, MAX_CONTEXT_LIMIT,
};
pub use session::{CandleSession, StepOutput, PREFILL_CHUNK};
pub use weights::gguf::GgufWeights;

#[cfg(test)]
mod tests;
#[cfg(test)]
mod window_tests;
