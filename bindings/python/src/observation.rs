//! `ObservationRequest` and `ObservationSet` for Python: selectors in, read-only numpy arrays out.

use numpy::ndarray::{ArrayD, IxDyn};
use numpy::PyArray;
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyList};

use super::convert::py_repr;
use super::errors::{observation_err, InternalError};
use candlewick::core::{self, ObservationSelector, ObservationValue};

/// Which observation points to materialise.
#[pyclass(name = "ObservationRequest", module = "candlewick._native", frozen)]
pub struct PyObservationRequest {
    pub(crate) inner: core::ObservationRequest,
}

#[pymethods]
impl PyObservationRequest {
    /// Every point the model offers.
    ///
    /// Returns:
    ///     ObservationRequest: a request for all points.
    ///
    /// Example:
    ///     >>> rt.inspect_prefill([2, 651], ObservationRequest.all()).observations.keys()[:1]
    ///     ['model.embed_tokens']
    #[staticmethod]
    fn all() -> Self {
        Self { inner: core::ObservationRequest::all() }
    }

    /// The points under each prefix; prefixes match whole dotted segments, so
    /// ``model.layers.2`` selects ``model.layers.2.output`` but not ``model.layers.20.output``.
    ///
    /// Args:
    ///     prefixes (Sequence[str]): dotted prefixes; an empty list selects nothing.
    ///
    /// Returns:
    ///     ObservationRequest: the request.
    ///
    /// Example:
    ///     >>> ObservationRequest.select(["model.layers.2"]).matches("model.layers.20.output")
    ///     False
    #[staticmethod]
    fn select(prefixes: Vec<String>) -> PyResult<Self> {
        let sel = prefixes.into_iter().map(ObservationSelector::Prefix);
        Ok(Self { inner: core::ObservationRequest::select(sel).map_err(observation_err)? })
    }

    /// Exactly the named points.
    ///
    /// Args:
    ///     paths (Sequence[str]): full observation paths.
    ///
    /// Returns:
    ///     ObservationRequest: the request.
    ///
    /// Example:
    ///     >>> ObservationRequest.exact(["model.logits"]).matches("model.logits")
    ///     True
    #[staticmethod]
    fn exact(paths: Vec<String>) -> PyResult<Self> {
        let sel = paths.into_iter().map(ObservationSelector::Exact);
        Ok(Self { inner: core::ObservationRequest::select(sel).map_err(observation_err)? })
    }

    /// The selectors as `(kind, text)` pairs; empty for `all()`.
    #[getter]
    fn selectors(&self) -> Vec<(&'static str, String)> {
        self.inner
            .selectors()
            .iter()
            .map(|s| match s {
                ObservationSelector::Exact(p) => ("exact", p.clone()),
                ObservationSelector::Prefix(p) => ("prefix", p.clone()),
            })
            .collect()
    }

    /// Whether every point is selected.
    #[getter]
    fn is_all(&self) -> bool {
        self.inner.is_all()
    }

    /// Whether a path is selected.
    ///
    /// Args:
    ///     path (str): an observation path.
    ///
    /// Returns:
    ///     bool: whether this request selects it.
    ///
    /// Example:
    ///     >>> ObservationRequest.select(["model.layers.2"]).matches("model.layers.2.output")
    ///     True
    fn matches(&self, path: &str) -> bool {
        self.inner.matches(path)
    }

    fn __repr__(&self, py: Python<'_>) -> String {
        if self.inner.is_all() {
            return "ObservationRequest.all()".into();
        }
        let list = |kind: &str| {
            let paths: Vec<String> =
                self.selectors().into_iter().filter(|(k, _)| *k == kind).map(|(_, p)| py_repr(py, &p)).collect();
            paths.join(", ")
        };
        let (select, exact) = (list("prefix"), list("exact"));
        match (select.is_empty(), exact.is_empty()) {
            (false, true) => format!("ObservationRequest.select([{select}])"),
            (true, false) => format!("ObservationRequest.exact([{exact}])"),
            _ => format!("ObservationRequest(select=[{select}], exact=[{exact}])"),
        }
    }
}

/// A read-only mapping from observation path to a numpy array (or a scalar).
#[pyclass(name = "ObservationSet", module = "candlewick._native", frozen, mapping)]
pub struct PyObservationSet {
    values: Py<PyDict>,
    keys: Vec<String>,
}

#[pymethods]
impl PyObservationSet {
    fn __getitem__<'py>(&self, py: Python<'py>, path: &str) -> PyResult<Bound<'py, PyAny>> {
        self.values.bind(py).get_item(path)?.ok_or_else(|| pyo3::exceptions::PyKeyError::new_err(path.to_owned()))
    }

    fn __len__(&self) -> usize {
        self.keys.len()
    }

    fn __contains__(&self, py: Python<'_>, path: &str) -> PyResult<bool> {
        self.values.bind(py).contains(path)
    }

    fn __iter__<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyAny>> {
        PyList::new(py, &self.keys)?.into_any().try_iter().map(Bound::into_any)
    }

    /// The paths, in path order.
    ///
    /// Returns:
    ///     list[str]: the observation paths held.
    fn keys(&self) -> Vec<String> {
        self.keys.clone()
    }

    /// The values, in path order.
    ///
    /// Returns:
    ///     list: read-only float32 arrays (or scalars).
    fn values<'py>(&self, py: Python<'py>) -> PyResult<Vec<Bound<'py, PyAny>>> {
        self.keys.iter().map(|k| self.__getitem__(py, k)).collect()
    }

    /// ``(path, value)`` pairs, in path order.
    ///
    /// Returns:
    ///     list[tuple[str, Any]]: the pairs.
    fn items<'py>(&self, py: Python<'py>) -> PyResult<Vec<(String, Bound<'py, PyAny>)>> {
        self.keys.iter().map(|k| Ok((k.clone(), self.__getitem__(py, k)?))).collect()
    }

    /// The value at a path, or a default.
    ///
    /// Args:
    ///     path (str): an observation path.
    ///     default (Any): what to return when the path is not held.
    ///
    /// Returns:
    ///     Any: the array, scalar or default.
    ///
    /// Example:
    ///     >>> obs.get("model.norm") is not None
    ///     True
    #[pyo3(signature = (path, default=None))]
    fn get<'py>(
        &self,
        py: Python<'py>,
        path: &str,
        default: Option<Bound<'py, PyAny>>,
    ) -> PyResult<Option<Bound<'py, PyAny>>> {
        Ok(self.values.bind(py).get_item(path)?.or(default))
    }

    fn __repr__(&self, py: Python<'_>) -> String {
        let keys: Vec<String> = self.keys.iter().map(|k| py_repr(py, k)).collect();
        format!("ObservationSet([{}])", keys.join(", "))
    }
}

/// Converts a host observation set to its Python form, arrays marked read-only.
pub fn to_python(py: Python<'_>, set: core::ObservationSet) -> PyResult<PyObservationSet> {
    let dict = PyDict::new(py);
    let mut keys = Vec::with_capacity(set.len());
    for (path, value) in set.into_entries() {
        let obj: Bound<'_, PyAny> = match value {
            ObservationValue::Tensor { shape, data } => {
                let arr = ArrayD::from_shape_vec(IxDyn(&shape), data)
                    .map_err(|e| InternalError::new_err(format!("observation `{path}`: {e}")))?;
                let arr = PyArray::from_owned_array(py, arr);
                arr.getattr("flags")?.setattr("writeable", false)?;
                arr.into_any()
            }
            ObservationValue::Int(v) => v.into_pyobject(py)?.into_any(),
            ObservationValue::Float(v) => v.into_pyobject(py)?.into_any(),
            ObservationValue::Bool(v) => pyo3::types::PyBool::new(py, v).to_owned().into_any(),
            ObservationValue::Text(v) => v.into_pyobject(py)?.into_any(),
            // Sparse rows become `candlewick.sae.SparseFeatures` (per-position indices and
            // values, `toarray()`), built from the three flat arrays without a dense copy.
            ObservationValue::Sparse { rows, width, offsets, indices, values } => {
                let offsets: Vec<i64> = offsets.into_iter().map(|o| o as i64).collect();
                let cls = py.import("candlewick.sae")?.getattr("SparseFeatures")?;
                cls.call1((
                    PyArray::from_vec(py, offsets),
                    PyArray::from_vec(py, indices),
                    PyArray::from_vec(py, values),
                    (rows, width),
                ))?
            }
        };
        dict.set_item(&path, obj)?;
        keys.push(path);
    }
    Ok(PyObservationSet { values: dict.unbind(), keys })
}
