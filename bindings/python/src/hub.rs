//! Model arguments that name a Hugging Face Hub repository: handed to the Python package's
//! `candlewick.hub.resolve_model`, which fetches through `huggingface_hub` (its cache, token and
//! offline mode), so no download code lives in Rust.

use std::path::{Path, PathBuf};

use pyo3::prelude::*;

/// The local path `model` stands for, as `candlewick.hub.resolve_model` decides it (a local path
/// comes back unchanged, as does one that is not a Hub name, so the loader's own "not found"
/// still answers it).
pub(crate) fn resolve_model(
    py: Python<'_>,
    model: &Path,
    filename: Option<&str>,
    revision: Option<&str>,
) -> PyResult<PathBuf> {
    let resolved = py.import("candlewick.hub")?.getattr("resolve_model")?.call1((model, filename, revision))?;
    resolved.extract()
}
