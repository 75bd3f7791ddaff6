//! The LoRA adapters a session runs with (DESIGN §16): chosen per session (a runtime's default,
//! an engine request's own) and swapped per call by the model layer. Loaded adapters live on the
//! decoder (`Decoder::load_adapter`), shared by every session of the model.

use super::CandleSession;
use crate::backend::blocks::lora::{cached, computed_under, ActiveAdapters};
use crate::backend::error::{AdapterError, Result};

impl CandleSession {
    /// The adapters this session's steps run with, and their scales.
    pub fn adapters(&self) -> ActiveAdapters {
        self.adapters.lock().unwrap_or_else(|e| e.into_inner()).clone()
    }

    /// Runs the following steps with `adapters` (none: the base model). What the cache holds stays;
    /// positions computed under other adapters are not reused for a new prompt. Takes a shared
    /// reference so that a per-call swap does not move the runtime's epoch (a stream's steps swap
    /// their adapters in and out around each step).
    pub fn set_adapters(&self, adapters: ActiveAdapters) -> Result<()> {
        if let Some((a, scale)) = adapters.iter().find(|(_, s)| !s.is_finite()) {
            return Err(AdapterError::BadScale { name: a.name.clone(), scale: *scale }.into());
        }
        *self.adapters.lock().unwrap_or_else(|e| e.into_inner()) = adapters;
        Ok(())
    }

    /// Whether the positions a new prompt may reuse were computed with no edit and no adapter
    /// (what the prefix cache and a snapshot's clean prefix may hold).
    pub(crate) fn plain_cache(&self) -> bool {
        self.edits.set.is_empty() && self.cache_adapters.is_empty() && self.adapters().is_empty()
    }

    /// Before positions `start..` appended under the current adapters count as reusable: whether
    /// the reusable ones before `start` were computed under them too. A cache refilled from 0
    /// takes the current adapters as its own.
    pub(super) fn cache_under_adapters(&mut self, start: usize) -> bool {
        let adapters = self.adapters();
        if computed_under(&adapters, &self.cache_adapters) {
            return true;
        }
        if start == 0 {
            self.cache_adapters = cached(&adapters);
            self.reusable = 0;
            return true;
        }
        self.reusable = self.reusable.min(start);
        false
    }
}
