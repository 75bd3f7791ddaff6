//! LoRA adapters on a loaded model (DESIGN §16): load and unload by name, a session default, and
//! the per-call choice (`GenerateOptions::adapters`) swapped in for one call and swapped back.

use std::path::Path;
use std::sync::Arc;

use super::{Model, ModelError, Runtime};
use crate::backend::blocks::lora::{ActiveAdapters, Adapter};
use crate::backend::error::AdapterError;
use crate::backend::CandleError;
use crate::core::RuntimeError;
use crate::generation::{AdapterChoice, GenerationError};

/// What `Model::adapters` says of one loaded adapter.
#[derive(Debug, Clone, PartialEq)]
pub struct AdapterInfo {
    /// The name it is loaded under.
    pub name: String,
    /// The file or directory it came from.
    pub path: String,
    /// `peft`, `mlx` or `gguf`.
    pub format: String,
    /// Its largest rank.
    pub rank: usize,
    /// How many weight slots it adapts.
    pub modules: usize,
    /// The scale it runs with where chosen by name alone (merged: the scale it was merged with).
    pub scale: f32,
    /// Whether it was merged into the weights (always on, cannot be unloaded).
    pub merged: bool,
}

impl AdapterInfo {
    fn of(a: &Adapter, merged: bool) -> Self {
        Self {
            name: a.name.clone(),
            path: a.path.clone(),
            format: a.format.into(),
            rank: a.rank,
            modules: a.modules,
            scale: a.scale,
            merged,
        }
    }
}

/// The name an adapter gets when none is given: its directory's or file's name without extension.
pub fn default_adapter_name(path: &Path) -> String {
    let path = if path.file_name().is_some_and(|n| n == "adapter_model.safetensors") {
        path.parent().unwrap_or(path)
    } else {
        path
    };
    path.file_stem().map(|s| s.to_string_lossy().into_owned()).unwrap_or_else(|| "adapter".into())
}

impl Model {
    /// Loads the LoRA adapter at `path` (a PEFT directory or a GGUF LoRA) as `name` (default: its
    /// file or directory name), run with `scale` where it is chosen by name alone. It is not
    /// switched on: `set_adapters`, or `adapters` on a call, chooses it.
    ///
    /// With `merge`, `scale · B A` is folded into the model's dense weights instead: every call
    /// runs with it from then on, at the base model's speed, and it cannot be unloaded. That
    /// empties the session's cache, and is refused (nothing changes) for quantized weights or
    /// while another session (an `Engine`) shares the model.
    pub fn load_adapter(
        &mut self,
        path: &Path,
        name: Option<&str>,
        scale: f32,
        merge: bool,
    ) -> Result<AdapterInfo, ModelError> {
        let name = name.map_or_else(|| default_adapter_name(path), str::to_owned);
        if !merge {
            let adapter = self.decoder().load_adapter(path, &name, scale).map_err(CandleError::from)?;
            return Ok(AdapterInfo::of(&adapter, false));
        }
        let merged = self
            .runtime
            .session_mut()
            .change_decoder(|d| d.merge_adapter(path, &name, scale))
            .map_err(|others| CandleError::from(AdapterError::MergeShared { name: name.clone(), others }))?;
        let adapter = merged.map_err(CandleError::from)?;
        Ok(AdapterInfo::of(&adapter, true))
    }

    /// Unloads the adapter `name`; refused while a session runs with it, and for one merged into
    /// the weights.
    pub fn unload_adapter(&self, name: &str) -> Result<(), ModelError> {
        if self.decoder().merged_adapters().iter().any(|a| a.name == name) {
            return Err(CandleError::from(AdapterError::Merged { name: name.to_owned() }).into());
        }
        Ok(self.decoder().adapters().remove(name).map_err(CandleError::from)?)
    }

    /// The adapters on this model, in load order: those merged into its weights first.
    pub fn adapters(&self) -> Vec<AdapterInfo> {
        let merged = self.decoder().merged_adapters().iter().map(|a| AdapterInfo::of(a, true));
        merged.chain(self.decoder().adapters().list().iter().map(|a| AdapterInfo::of(a, false))).collect()
    }

    /// The adapters this model's session runs with now (its default between calls), and their scales.
    pub fn active_adapters(&self) -> Vec<(String, f32)> {
        self.runtime.session().adapters().iter().map(|(a, s)| (a.name.clone(), *s)).collect()
    }

    /// The loaded adapters `choice` names, each with its scale (or its load scale).
    pub fn resolve_adapters(&self, choice: &AdapterChoice) -> Result<ActiveAdapters, ModelError> {
        let registry = self.decoder().adapters();
        let mut active = Vec::with_capacity(choice.len());
        for (name, scale) in choice {
            let adapter = registry.get(name).map_err(CandleError::from)?;
            let scale = scale.unwrap_or(adapter.scale);
            if !scale.is_finite() {
                return Err(CandleError::from(AdapterError::BadScale { name: name.clone(), scale }).into());
            }
            active.push((adapter, scale));
        }
        Ok(active)
    }

    /// Makes `choice` the adapters this model's calls run with unless a call chooses its own
    /// (empty: the base model).
    pub fn set_adapters(&mut self, choice: &AdapterChoice) -> Result<(), ModelError> {
        let active = self.resolve_adapters(choice)?;
        Ok(self.runtime.session().set_adapters(active)?)
    }

    /// Runs `call` with `choice`'s adapters in place of the session's (none: as it is), and puts
    /// the session's back afterwards, whatever `call` returned. Err: `choice` names an adapter
    /// not loaded (nothing ran).
    pub fn with_adapters<T>(
        &mut self,
        choice: Option<&AdapterChoice>,
        call: impl FnOnce(&mut Self) -> T,
    ) -> Result<T, ModelError> {
        let Some(choice) = choice else { return Ok(call(self)) };
        let active = self.resolve_adapters(choice)?;
        let saved = swap_adapters(&self.runtime, active)?;
        let result = call(self);
        swap_adapters(&self.runtime, saved)?;
        Ok(result)
    }

    /// `with_adapters` for a generation's steps, whose errors are generation errors.
    pub(super) fn with_generation_adapters<T>(
        &mut self,
        choice: Option<&AdapterChoice>,
        call: impl FnOnce(&mut Self) -> Result<T, GenerationError<CandleError>>,
    ) -> Result<T, GenerationError<CandleError>> {
        let Some(choice) = choice else { return call(self) };
        let backend = |e: CandleError| GenerationError::Runtime(RuntimeError::Backend(e));
        let active = match self.resolve_adapters(choice) {
            Ok(a) => a,
            Err(ModelError::Backend(e)) => return Err(backend(e)),
            Err(e) => return Err(GenerationError::InvalidOptions(e.to_string())),
        };
        let saved = swap_adapters(&self.runtime, active).map_err(backend)?;
        let result = call(self);
        swap_adapters(&self.runtime, saved).map_err(backend)?;
        result
    }

    /// The decoder this model runs.
    fn decoder(&self) -> &Arc<crate::backend::decoder::Decoder> {
        self.runtime.session().decoder()
    }
}

/// Puts `active` on the runtime's session, returning what it had.
pub(super) fn swap_adapters(rt: &Runtime, active: ActiveAdapters) -> Result<ActiveAdapters, CandleError> {
    let saved = rt.session().adapters();
    rt.session().set_adapters(active)?;
    Ok(saved)
}
