//! The inputs of one step, as any caller writes them: token ids, which logits to return, and
//! the edits to apply for this call only.

use crate::intervention::Intervention;

/// What a prefill takes: tokens appended at the session's position.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct PrefillInput {
    /// Token ids appended at the current position.
    pub tokens: Vec<u32>,
    /// Whether logits of every position are returned (default: only the last).
    pub all_logits: bool,
    /// Edits for this call only, applied after the ones kept on the session.
    pub interventions: Vec<Intervention>,
}

impl PrefillInput {
    /// A prefill returning only the last position's logits.
    pub fn new(tokens: Vec<u32>) -> Self {
        Self { tokens, ..Self::default() }
    }

    /// The same prefill returning every position's logits.
    pub fn all_logits(mut self, all: bool) -> Self {
        self.all_logits = all;
        self
    }

    /// The same prefill with edits for this call.
    pub fn with_interventions(mut self, interventions: Vec<Intervention>) -> Self {
        self.interventions = interventions;
        self
    }
}

impl From<Vec<u32>> for PrefillInput {
    fn from(tokens: Vec<u32>) -> Self {
        Self::new(tokens)
    }
}

/// What a decode takes: one or more tokens, each of which gets its logits.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct DecodeInput {
    /// Token ids appended at the current position.
    pub tokens: Vec<u32>,
    /// Edits for this call only, applied after the ones kept on the session.
    pub interventions: Vec<Intervention>,
}

impl DecodeInput {
    /// A decode of `tokens`.
    pub fn new(tokens: Vec<u32>) -> Self {
        Self { tokens, ..Self::default() }
    }

    /// The same decode with edits for this call.
    pub fn with_interventions(mut self, interventions: Vec<Intervention>) -> Self {
        self.interventions = interventions;
        self
    }
}

impl From<Vec<u32>> for DecodeInput {
    fn from(tokens: Vec<u32>) -> Self {
        Self::new(tokens)
    }
}

/// A step's logits brought to the host: `rows × vocab` float32, row-major.
#[derive(Debug, Clone, PartialEq)]
pub struct HostLogits {
    /// Number of rows (positions) returned.
    pub rows: usize,
    /// Vocabulary size (row width).
    pub vocab: usize,
    /// The values.
    pub data: Vec<f32>,
}

impl HostLogits {
    /// The last row (the logits that predict the next token).
    pub fn last_row(&self) -> &[f32] {
        &self.data[self.data.len() - self.vocab..]
    }
}
