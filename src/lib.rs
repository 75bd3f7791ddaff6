//! candlewick: a local language-model runtime on candle.
//!
//! The layers, each using only those above it in this list (docs/architecture.md):
//! `core` is the backend-neutral contract, `backend` the candle implementation of it,
//! `text` tokenizers and chat templates, `generation` the token loop over the contract,
//! `model` a loaded model with its tokenizer and defaults, `engine` many requests over one
//! model in a continuous batch, `python` the thin PyO3 layer.

pub mod backend;
pub mod core;
pub mod engine;
pub mod generation;
pub mod memory;
pub mod model;
#[cfg(feature = "python")]
pub mod python;
pub mod text;
