//! The building blocks a stack composes: linear maps, norms, rotary embeddings, attention over a
//! KV cache, the dense MLP and the mixture of experts, and the hooks through which every named
//! point is observed and edited. Each block knows its weights and its kernels, never the stack
//! around it: the decoder (`backend::decoder`) is one composition of them, and an encoder or an
//! adapter is another over the same blocks.

pub mod activation;
pub mod attention;
pub mod hooks;
pub mod linear;
pub mod lora;
pub mod mlp;
pub mod moe;
pub mod norm;
pub mod rope;
pub mod rows;
pub mod sae;
