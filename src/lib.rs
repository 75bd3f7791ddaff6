//! candlewick: a local language-model runtime on candle.
//!
//! `core` is the backend-neutral contract, `backend` the candle implementation of it,
//! `text` tokenizers and chat templates, `python` the thin PyO3 layer.

pub mod backend;
pub mod core;
pub mod generation;
pub mod memory;
#[cfg(feature = "python")]
pub mod python;
pub mod text;
