//! LoRA adapters for Python (DESIGN §16): `load_adapter`, `unload_adapter`, `loaded_adapters`
//! (and the `adapters` property), `set_adapters` and `active_adapters`. The per-call `adapters=`
//! of generate, stream, chat, trace and `Engine.submit` is converted by `convert::adapter_choice`.

use pyo3::prelude::*;
use pyo3::types::{PyAny, PyDict};

use super::convert::adapter_choice;
use super::errors::{catch_panic, model_err};
use super::runtime::PyModelRuntime;
use candlewick::model::AdapterInfo;

fn info_dict<'py>(py: Python<'py>, info: AdapterInfo) -> PyResult<Bound<'py, PyDict>> {
    let d = PyDict::new(py);
    d.set_item("name", info.name)?;
    d.set_item("path", info.path)?;
    d.set_item("format", info.format)?;
    d.set_item("rank", info.rank)?;
    d.set_item("modules", info.modules)?;
    d.set_item("scale", info.scale)?;
    d.set_item("merged", info.merged)?;
    Ok(d)
}

#[pymethods]
impl PyModelRuntime {
    /// Loads a LoRA adapter beside the model's weights (not merged into them): a PEFT directory
    /// (``adapter_config.json`` + ``adapter_model.safetensors``), an mlx-lm one (``adapters.safetensors``)
    /// or a llama.cpp GGUF LoRA. It is
    /// shared by every session of the model (an ``Engine`` made from this runtime included) and is
    /// not switched on: ``set_adapters`` or ``adapters=`` on a call chooses it.
    ///
    /// With ``merge=True`` it is folded into the model's dense weights instead (``W + scale · B A``):
    /// every call runs with it from then on at the base model's speed, the session's cache is
    /// emptied, and it cannot be unloaded. Quantized weights are refused (re-quantizing would lose
    /// the adapter's small change), as is a model an open ``Engine`` shares.
    ///
    /// Args:
    ///     path (str | os.PathLike): the adapter's directory or file.
    ///     name (str | None): its name; default the directory's or file's name.
    ///     scale (float): the scale it runs with where it is chosen by name alone (merged: the
    ///         scale it is merged with).
    ///     merge (bool): fold it into the weights.
    ///
    /// Returns:
    ///     dict: name, path, format (``peft``, ``mlx`` or ``gguf``), rank, modules (weights it adapts),
    ///     scale, merged.
    ///
    /// Raises:
    ///     AdapterError: no adapter there, DoRA or another unsupported feature, a module this
    ///         model lacks, a shape of another base model, the name already loaded; with
    ///         ``merge=True``, a quantized weight or a model shared with an Engine. Nothing
    ///         changes.
    ///
    /// Example:
    ///     >>> rt.load_adapter("adapters/sql-lora", name="sql")["rank"]
    ///     16
    #[pyo3(signature = (path, name=None, scale=1.0, merge=false))]
    fn load_adapter<'py>(
        &self,
        py: Python<'py>,
        path: std::path::PathBuf,
        name: Option<String>,
        scale: f32,
        merge: bool,
    ) -> PyResult<Bound<'py, PyDict>> {
        let info = py.detach(|| {
            catch_panic(|| self.lock_detached()?.load_adapter(&path, name.as_deref(), scale, merge).map_err(model_err))
        })?;
        info_dict(py, info)
    }

    /// Unloads the adapter called ``name``.
    ///
    /// Args:
    ///     name (str): the adapter's name.
    ///
    /// Raises:
    ///     AdapterError: none is loaded under that name, a session still runs with it (the
    ///         runtime's ``set_adapters`` default, or an engine request), or it was merged.
    ///
    /// Example:
    ///     >>> rt.unload_adapter("sql")
    fn unload_adapter(&self, py: Python<'_>, name: String) -> PyResult<()> {
        py.detach(|| catch_panic(|| self.lock_detached()?.unload_adapter(&name).map_err(model_err)))
    }

    /// The adapters loaded on this model, in load order (dicts as ``load_adapter`` returns).
    ///
    /// Example:
    ///     >>> [a["name"] for a in rt.loaded_adapters()]
    ///     ['sql']
    fn loaded_adapters<'py>(&self, py: Python<'py>) -> PyResult<Vec<Bound<'py, PyDict>>> {
        let list = self.lock(py)?.adapters();
        list.into_iter().map(|a| info_dict(py, a)).collect()
    }

    /// The adapters loaded on this model (the same list as ``loaded_adapters()``).
    #[getter]
    fn adapters<'py>(&self, py: Python<'py>) -> PyResult<Vec<Bound<'py, PyDict>>> {
        self.loaded_adapters(py)
    }

    /// The adapters this runtime's calls run with unless a call chooses its own, as
    /// ``{name: scale}`` (empty: the base model).
    #[getter]
    fn active_adapters<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let d = PyDict::new(py);
        for (name, scale) in self.lock(py)?.active_adapters() {
            d.set_item(name, scale)?;
        }
        Ok(d)
    }

    /// Chooses the adapters this runtime's calls run with unless a call passes ``adapters=``.
    /// Several are summed, each with its scale, as llama.cpp does.
    ///
    /// Args:
    ///     adapters (str | list | dict | None): ``"name"``, ``["a", ("b", 0.5)]`` or
    ///         ``{"a": 1.0, "b": 0.5}`` (a scale of None: the one given at load); None or empty:
    ///         the base model.
    ///
    /// Raises:
    ///     AdapterError: a name not loaded, or a scale that is not finite (nothing changes).
    ///
    /// Example:
    ///     >>> rt.set_adapters({"sql": 1.0})
    ///     >>> rt.generate("SELECT", max_tokens=8, adapters={})  # this call: the base model
    #[pyo3(signature = (adapters=None))]
    fn set_adapters(&self, py: Python<'_>, adapters: Option<Bound<'_, PyAny>>) -> PyResult<()> {
        let choice = match adapters.filter(|a| !a.is_none()) {
            Some(a) => adapter_choice("adapters", &a)?,
            None => Vec::new(),
        };
        py.detach(|| catch_panic(|| self.lock_detached()?.set_adapters(&choice).map_err(model_err)))
    }
}
