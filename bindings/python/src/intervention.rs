//! Interventions for Python: `Intervention` values built by `candlewick.interventions`.

use pyo3::prelude::*;

use super::convert::py_repr;
use super::errors::{invalid_option, ArtifactError};

use candlewick::core::{EditOp, Intervention};

/// One edit of a named point (build it with `candlewick.interventions.add/set/scale/project_out`).
#[pyclass(name = "Intervention", module = "candlewick._native", frozen)]
#[derive(Clone)]
pub struct PyIntervention {
    pub(crate) inner: Intervention,
}

/// Absolute positions from Python integers (a negative one is an `InvalidOptionError`).
pub(crate) fn positions_of(positions: Option<Vec<i64>>) -> PyResult<Option<Vec<usize>>> {
    positions
        .map(|ps| {
            ps.into_iter()
                .map(|p| {
                    usize::try_from(p).map_err(|_| {
                        Python::attach(|py| invalid_option(py, format!("positions: {p} is not a valid position")))
                    })
                })
                .collect()
        })
        .transpose()
}

#[pymethods]
impl PyIntervention {
    /// Steering: ``x + scale * vector``.
    ///
    /// Args:
    ///     point (str): the point's dotted name.
    ///     vector (Sequence[float]): the point's last dimension, or its per-position shape flattened.
    ///     scale (float): multiplies the vector.
    ///     positions (Sequence[int] | None): absolute positions to edit; None: every position.
    ///
    /// Returns:
    ///     Intervention: the edit.
    ///
    /// Example:
    ///     >>> Intervention.add("model.layers.6.output", direction, scale=4.0)
    #[staticmethod]
    #[pyo3(signature = (point, vector, scale=1.0, positions=None))]
    fn add(point: String, vector: Vec<f32>, scale: f32, positions: Option<Vec<i64>>) -> PyResult<Self> {
        let op = EditOp::Add { vector, scale };
        Ok(Self { inner: Intervention { point, op, positions: positions_of(positions)? } })
    }

    /// Patching: ``x[positions] = values``.
    ///
    /// Args:
    ///     point (str): the point's dotted name.
    ///     values (Sequence[float]): one flattened row per position.
    ///     positions (Sequence[int]): the absolute positions to overwrite.
    ///
    /// Returns:
    ///     Intervention: the edit.
    ///
    /// Example:
    ///     >>> Intervention.set("model.layers.2.output", clean_row, positions=[4])
    #[staticmethod]
    #[pyo3(signature = (point, values, positions))]
    fn set(point: String, values: Vec<f32>, positions: Vec<i64>) -> PyResult<Self> {
        let op = EditOp::Set { values };
        Ok(Self { inner: Intervention { point, op, positions: positions_of(Some(positions))? } })
    }

    /// Scales units (heads, neurons, channels) by a factor; 0 ablates.
    ///
    /// Args:
    ///     point (str): the point's dotted name.
    ///     index (Sequence[int]): the units along the point's unit axis (heads for ``attention.heads``).
    ///     factor (float): the multiplier.
    ///     positions (Sequence[int] | None): absolute positions to edit; None: every position.
    ///
    /// Returns:
    ///     Intervention: the edit.
    ///
    /// Example:
    ///     >>> Intervention.scale("model.layers.3.attention.heads", [2], 0.0)
    #[staticmethod]
    #[pyo3(signature = (point, index, factor, positions=None))]
    fn scale(point: String, index: Vec<i64>, factor: f32, positions: Option<Vec<i64>>) -> PyResult<Self> {
        let index = positions_of(Some(index))
            .map_err(|_| Python::attach(|py| invalid_option(py, "index: unit indices must be >= 0".into())))?
            .unwrap_or_default();
        let op = EditOp::Scale { index, factor };
        Ok(Self { inner: Intervention { point, op, positions: positions_of(positions)? } })
    }

    /// Directional ablation: ``x - (x . d) d`` with ``d`` the unit direction.
    ///
    /// Args:
    ///     point (str): the point's dotted name.
    ///     direction (Sequence[float]): the direction to remove (normalised here).
    ///     positions (Sequence[int] | None): absolute positions to edit; None: every position.
    ///
    /// Returns:
    ///     Intervention: the edit.
    ///
    /// Example:
    ///     >>> Intervention.project_out("model.layers.6.output", refusal_direction)
    #[staticmethod]
    #[pyo3(signature = (point, direction, positions=None))]
    fn project_out(point: String, direction: Vec<f32>, positions: Option<Vec<i64>>) -> PyResult<Self> {
        let op = EditOp::ProjectOut { direction };
        Ok(Self { inner: Intervention { point, op, positions: positions_of(positions)? } })
    }

    /// The point's dotted name.
    #[getter]
    fn point(&self) -> &str {
        &self.inner.point
    }

    /// `add`, `set`, `scale` or `project_out`.
    #[getter]
    fn op(&self) -> &'static str {
        self.inner.op.name()
    }

    /// Absolute positions, or None for every position.
    #[getter]
    fn positions(&self) -> Option<Vec<usize>> {
        self.inner.positions.clone()
    }

    /// The vector (add), values (set) or direction (project_out); None for scale.
    #[getter]
    fn values(&self) -> Option<Vec<f32>> {
        match &self.inner.op {
            EditOp::Add { vector, .. } => Some(vector.clone()),
            EditOp::Set { values } => Some(values.clone()),
            EditOp::ProjectOut { direction } => Some(direction.clone()),
            EditOp::Scale { .. } | EditOp::Sae { .. } => None,
        }
    }

    /// The multiplier of `add` or the factor of `scale`; None otherwise.
    #[getter]
    fn scale_factor(&self) -> Option<f32> {
        match &self.inner.op {
            EditOp::Add { scale, .. } => Some(*scale),
            EditOp::Scale { factor, .. } => Some(*factor),
            _ => None,
        }
    }

    /// The unit indices of `scale`; None otherwise.
    #[getter]
    fn index(&self) -> Option<Vec<usize>> {
        match &self.inner.op {
            EditOp::Scale { index, .. } => Some(index.clone()),
            _ => None,
        }
    }

    fn __eq__(&self, other: &Self) -> bool {
        self.inner == other.inner
    }

    fn __repr__(&self, py: Python<'_>) -> String {
        let pos = match &self.inner.positions {
            Some(p) => format!(", positions={p:?}"),
            None => String::new(),
        };
        let detail = match &self.inner.op {
            EditOp::Add { vector, scale } => format!("vector=<{} values>, scale={scale:?}", vector.len()),
            EditOp::Set { values } => format!("values=<{} values>", values.len()),
            EditOp::Scale { index, factor } => format!("index={index:?}, factor={factor:?}"),
            EditOp::ProjectOut { direction } => format!("direction=<{} values>", direction.len()),
            EditOp::Sae { edit, .. } => format!("{edit:?}"),
        };
        format!("Intervention.{}({}, {detail}{pos})", self.inner.op.name(), py_repr(py, &self.inner.point))
    }
}

/// The Rust edits of an optional Python list.
pub fn edits_of(list: Option<Vec<PyRef<'_, PyIntervention>>>) -> Vec<Intervention> {
    list.map(|l| l.iter().map(|i| i.inner.clone()).collect()).unwrap_or_default()
}

/// Writes ``{layer: vector}`` (layers counting from 1, as llama.cpp's) as a control vector GGUF
/// that llama.cpp and ``ModelRuntime.load_control_vector`` load.
///
/// Args:
///     path (str | os.PathLike): the file to write.
///     directions (dict[int, Sequence[float]]): one hidden-size vector per layer.
///     model_hint (str): the architecture name llama.cpp checks (``general.architecture``).
///
/// Returns:
///     None
///
/// Example:
///     >>> candlewick._native.save_control_vector("happy.gguf", {7: list(direction)})
#[pyfunction]
#[pyo3(signature = (path, directions, model_hint=""))]
pub fn save_control_vector(
    path: std::path::PathBuf,
    directions: std::collections::BTreeMap<usize, Vec<f32>>,
    model_hint: &str,
) -> PyResult<()> {
    candlewick::model::control_vector::save(&path, &directions, model_hint)
        .map_err(|e| ArtifactError::new_err(e.to_string()))
}
