//! candlewick: a local language-model runtime on candle.
//!
//! The layers, each using only those above it in this list (docs/architecture.md):
//! `core` is the backend-neutral contract, `backend` the candle implementation of it,
//! `text` tokenizers and chat templates, `generation` the token loop over the contract,
//! `model` a loaded model with its tokenizer and defaults, `engine` many requests over one
//! model in a continuous batch, `python` the thin PyO3 layer.

/// The backend-neutral contract (the `candlewick-core` crate), under the path it always had.
pub use candlewick_core as core;

pub mod backend;
pub mod engine;
pub mod generation;
pub mod memory;
pub mod model;
pub mod text;
