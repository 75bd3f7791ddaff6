//! Steering for Python: the interventions a runtime keeps on (`ModelRuntime.interventions`,
//! `intervene` scopes) and llama.cpp control vectors (`load_control_vector`). The edits themselves
//! are `intervention.rs`'s.

use std::path::PathBuf;
use std::sync::Mutex;

use pyo3::prelude::*;
use pyo3::types::PyAny;

use super::convert::non_negative;
use super::errors::{catch_panic, model_err, runtime_err, InternalError};
use super::intervention::{edits_of, PyIntervention};
use super::runtime::PyModelRuntime;

#[pymethods]
impl PyModelRuntime {
    /// The interventions kept on for every later step, generation included; setting a list
    /// validates it first (a bad one changes nothing), ``[]`` turns them off.
    #[getter]
    fn get_interventions(&self, py: Python<'_>) -> PyResult<Vec<PyIntervention>> {
        Ok(self.lock(py)?.runtime().interventions().into_iter().map(|inner| PyIntervention { inner }).collect())
    }

    #[setter]
    fn set_interventions(&self, py: Python<'_>, interventions: Option<Vec<PyRef<'_, PyIntervention>>>) -> PyResult<()> {
        let edits = edits_of(interventions);
        self.lock(py)?.runtime_mut().set_interventions(edits).map_err(runtime_err)
    }

    /// Reads a llama.cpp control vector (GGUF) and adds its edits to ``interventions``, with
    /// llama.cpp's ``--control-vector-scaled FILE SCALE`` and ``--control-vector-layer-range``
    /// meaning.
    ///
    /// Args:
    ///     path (str | os.PathLike): the control-vector GGUF.
    ///     scale (float): multiplies every direction.
    ///     layer_range (tuple[int, int] | None): the first and last layer (counting from 1)
    ///         to apply it to; None: all.
    ///
    /// Returns:
    ///     list[Intervention]: the edits added.
    ///
    /// Example:
    ///     >>> rt.load_control_vector("happy.gguf", scale=0.8)
    #[pyo3(signature = (path, scale=1.0, layer_range=None))]
    fn load_control_vector(
        &self,
        py: Python<'_>,
        path: PathBuf,
        scale: f32,
        layer_range: Option<(i64, i64)>,
    ) -> PyResult<Vec<PyIntervention>> {
        let range = layer_range
            .map(|(a, b)| {
                Ok::<_, PyErr>((
                    non_negative("layer_range", Some(a))?.unwrap_or(0),
                    non_negative("layer_range", Some(b))?.unwrap_or(0),
                ))
            })
            .transpose()?;
        let edits = py.detach(|| {
            catch_panic(|| self.lock_detached()?.load_control_vector(&path, scale, range).map_err(model_err))
        })?;
        Ok(edits.into_iter().map(|inner| PyIntervention { inner }).collect())
    }

    /// A context manager that keeps ``interventions`` on inside a ``with`` block, then puts
    /// back what was kept before.
    ///
    /// Args:
    ///     interventions (Sequence[Intervention]): the edits to keep on inside the block.
    ///
    /// Returns:
    ///     InterventionScope: use it in a ``with`` statement.
    ///
    /// Example:
    ///     >>> with rt.intervene([iv.add("model.layers.6.output", direction, scale=4.0)]):
    ///     ...     rt.generate("Today I feel", max_tokens=20)
    fn intervene(slf: &Bound<'_, Self>, interventions: Vec<PyRef<'_, PyIntervention>>) -> PyInterventionScope {
        PyInterventionScope {
            runtime: slf.clone().unbind(),
            edits: edits_of(Some(interventions)),
            saved: Mutex::new(None),
        }
    }
}

/// `with rt.intervene([...]):` — the edits are on inside the block, the earlier ones after it.
#[pyclass(name = "InterventionScope", module = "candlewick._native", frozen)]
pub struct PyInterventionScope {
    runtime: Py<PyModelRuntime>,
    edits: Vec<candlewick::core::Intervention>,
    saved: Mutex<Option<Vec<candlewick::core::Intervention>>>,
}

#[pymethods]
impl PyInterventionScope {
    fn __enter__(slf: PyRef<'_, Self>) -> PyResult<PyRef<'_, Self>> {
        {
            let mut model = slf.runtime.get().lock(slf.py())?;
            let before = model.runtime().interventions();
            model.runtime_mut().set_interventions(slf.edits.clone()).map_err(runtime_err)?;
            *slf.saved.lock().map_err(|_| InternalError::new_err("intervention scope poisoned"))? = Some(before);
        }
        Ok(slf)
    }

    fn __exit__(
        &self,
        py: Python<'_>,
        _ty: Option<&Bound<'_, PyAny>>,
        _value: Option<&Bound<'_, PyAny>>,
        _tb: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<bool> {
        let saved = self.saved.lock().map_err(|_| InternalError::new_err("intervention scope poisoned"))?.take();
        if let Some(before) = saved {
            self.runtime.get().lock(py)?.runtime_mut().set_interventions(before).map_err(runtime_err)?;
        }
        Ok(false)
    }
}
