//! Text: tokenizers, streaming detokenization and chat templates.
//!
//! Everything here is backend-neutral and free of tensor types: token ids are `u32`, text is
//! `String`. Tokenization must equal Hugging Face transformers' token for token, so the GGUF
//! conversion mirrors transformers' own rather than llama.cpp's tokenizer, and chat templates
//! run in a Jinja environment configured the way transformers configures Jinja2.

mod chat_template;
mod detokenizer;
mod error;
mod gguf;
mod merge_cache;
mod python_json_dumps;
mod token_bytes;
mod tokenizer;
pub mod tool_calls;

#[cfg(test)]
mod tests;

pub use chat_template::{ChatMessage, ChatRenderOptions, ChatTemplate, TemplateValue};
pub use detokenizer::IncrementalDecoder;
pub use error::TextError;
pub use tokenizer::Tokenizer;
pub use tool_calls::{ToolCall, ToolCallFormat, ToolChoice};
