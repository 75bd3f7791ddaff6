//! `ObservationRequest` and `ObservationSet` for Python: selectors in, read-only numpy arrays out.

use numpy::ndarray::{ArrayD, IxDyn};
use numpy::PyArray;
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyList};

use super::errors::{observation_err, InternalError};
use crate::core::{self, ObservationSelector, ObservationValue};

/// Which observation points to materialise.
#[pyclass(name = "ObservationRequest", module = "candlewick._native", frozen)]
pub struct PyObservationRequest {
    pub(crate) inner: core::ObservationRequest,
}

#[pymethods]
impl PyObservationRequest {
    /// Every point the model offers.
    #[staticmethod]
    fn all() -> Self {
        Self { inner: core::ObservationRequest::all() }
    }

    /// The points under each prefix (whole dotted segments); an empty list selects nothing.
    #[staticmethod]
    fn select(prefixes: Vec<String>) -> PyResult<Self> {
        let sel = prefixes.into_iter().map(ObservationSelector::Prefix);
        Ok(Self { inner: core::ObservationRequest::select(sel).map_err(observation_err)? })
    }

    /// Exactly the named points.
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

    /// Whether `path` is selected.
    fn matches(&self, path: &str) -> bool {
        self.inner.matches(path)
    }

    fn __repr__(&self) -> String {
        if self.inner.is_all() {
            return "ObservationRequest.all()".into();
        }
        let parts: Vec<String> = self.selectors().into_iter().map(|(k, p)| format!("{k}:{p}")).collect();
        format!("ObservationRequest({})", parts.join(", "))
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
    fn keys(&self) -> Vec<String> {
        self.keys.clone()
    }

    /// The values, in path order.
    fn values<'py>(&self, py: Python<'py>) -> PyResult<Vec<Bound<'py, PyAny>>> {
        self.keys.iter().map(|k| self.__getitem__(py, k)).collect()
    }

    /// `(path, value)` pairs, in path order.
    fn items<'py>(&self, py: Python<'py>) -> PyResult<Vec<(String, Bound<'py, PyAny>)>> {
        self.keys.iter().map(|k| Ok((k.clone(), self.__getitem__(py, k)?))).collect()
    }

    /// The value at `path`, or `default`.
    #[pyo3(signature = (path, default=None))]
    fn get<'py>(
        &self,
        py: Python<'py>,
        path: &str,
        default: Option<Bound<'py, PyAny>>,
    ) -> PyResult<Option<Bound<'py, PyAny>>> {
        Ok(self.values.bind(py).get_item(path)?.or(default))
    }

    fn __repr__(&self) -> String {
        format!("ObservationSet({} points: {})", self.keys.len(), self.keys.join(", "))
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
        };
        dict.set_item(&path, obj)?;
        keys.push(path);
    }
    Ok(PyObservationSet { values: dict.unbind(), keys })
}
