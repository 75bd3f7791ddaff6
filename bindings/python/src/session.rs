//! The views a runtime hands out (`rt.backend`, `rt.session`, `rt.capabilities`) and the copies
//! of its session: `fork` (a new runtime over the same weights) and `SessionSnapshot`.

use std::path::PathBuf;
use std::sync::Arc;

use pyo3::prelude::*;
use pyo3::types::PyAny;

use super::convert::{count_option, py_repr};
use super::errors::{backend_err, catch_panic, model_err};
use super::runtime::PyModelRuntime;
use candlewick::backend::device::parse_device;
use candlewick::backend::session::SessionSnapshot;
use candlewick::core::{BackendProvider, BackendSession, SnapshotSession};

#[pymethods]
impl PyModelRuntime {
    /// A new runtime over the same weights (only a new KV cache costs memory) whose session
    /// starts as a copy of this one's: tokens, position, cache and kept interventions.
    ///
    /// Returns:
    ///     ModelRuntime: the fork; stepping either leaves the other as it was.
    ///
    /// Example:
    ///     >>> child = rt.fork()
    ///     >>> child.session.position == rt.session.position
    ///     True
    fn fork(&self, py: Python<'_>) -> PyResult<Self> {
        let model = py.detach(|| catch_panic(|| self.lock_detached()?.fork().map_err(model_err)))?;
        Ok(Self::wrap(model))
    }

    /// The backend this runtime's session runs through (a view bound to this runtime).
    #[getter]
    fn backend(slf: &Bound<'_, Self>) -> PyBackend {
        PyBackend { runtime: slf.clone().unbind() }
    }

    /// The runtime's one session (a view bound to this runtime).
    #[getter]
    fn session(slf: &Bound<'_, Self>) -> PySession {
        PySession { runtime: slf.clone().unbind() }
    }

    /// The capabilities admitted at preparation and realised by the session.
    #[getter]
    fn capabilities(&self, py: Python<'_>) -> PyResult<PySessionCapabilities> {
        let c = self.lock(py)?.runtime().capabilities();
        Ok(PySessionCapabilities {
            persistent_cache: c.persistent_cache,
            output_observation: c.output_observation,
            activation_inspection: c.activation_inspection,
            activation_intervention: c.activation_intervention,
        })
    }
}

/// The backend of one runtime; it cannot be constructed or moved to another runtime.
#[pyclass(name = "Backend", module = "candlewick._native", frozen)]
pub struct PyBackend {
    runtime: Py<PyModelRuntime>,
}

#[pymethods]
impl PyBackend {
    /// The backend's name (`candle`).
    #[getter]
    fn name(&self, py: Python<'_>) -> PyResult<String> {
        Ok(self.runtime.get().lock(py)?.runtime().backend().descriptor().name)
    }

    /// The device the model runs on (`cpu`, `cuda:0`, ...).
    #[getter]
    fn device(&self, py: Python<'_>) -> PyResult<String> {
        Ok(self.runtime.get().lock(py)?.runtime().backend().descriptor().device.to_string())
    }

    /// Every device this build can run on, with the dtypes each computes in.
    ///
    /// Returns:
    ///     list[tuple[str, list[str]]]: ``(device, dtypes)`` pairs.
    ///
    /// Example:
    ///     >>> rt.backend.devices()[0][0]
    ///     'cpu'
    fn devices(&self, py: Python<'_>) -> PyResult<Vec<(String, Vec<String>)>> {
        let devs = self.runtime.get().lock(py)?.runtime().backend().devices().map_err(backend_err)?;
        Ok(devs.into_iter().map(|(d, c)| (d.to_string(), c.dtypes)).collect())
    }

    fn __repr__(&self, py: Python<'_>) -> PyResult<String> {
        Ok(format!("Backend(name={}, device={})", py_repr(py, &self.name(py)?), py_repr(py, &self.device(py)?)))
    }
}

/// The session of one runtime: position, context, rewinding.
#[pyclass(name = "Session", module = "candlewick._native", frozen)]
pub struct PySession {
    runtime: Py<PyModelRuntime>,
}

#[pymethods]
impl PySession {
    /// Tokens held in the KV cache.
    #[getter]
    fn position(&self, py: Python<'_>) -> PyResult<usize> {
        Ok(self.runtime.get().lock(py)?.runtime().session().position())
    }

    /// The most tokens the session may hold.
    #[getter]
    fn max_context(&self, py: Python<'_>) -> PyResult<usize> {
        Ok(self.runtime.get().lock(py)?.runtime().session().max_context())
    }

    /// The most tokens one step runs: a longer prompt runs in chunks of this many.
    #[getter]
    fn prefill_chunk(&self, py: Python<'_>) -> PyResult<usize> {
        Ok(self.runtime.get().lock(py)?.runtime().session().prefill_chunk())
    }

    /// Bytes held by the KV cache.
    #[getter]
    fn cache_bytes(&self, py: Python<'_>) -> PyResult<usize> {
        Ok(self.runtime.get().lock(py)?.runtime().session().cache_bytes())
    }

    /// Rewinds the cache to its first ``n`` tokens.
    ///
    /// Args:
    ///     n (int): how many tokens to keep (at most the position).
    ///
    /// Returns:
    ///     None
    ///
    /// Example:
    ///     >>> rt.session.truncate(4); rt.session.position
    ///     4
    fn truncate(&self, py: Python<'_>, n: &Bound<'_, PyAny>) -> PyResult<()> {
        let n = count_option(py, "n", Some(n))?.unwrap_or(0);
        self.runtime.get().lock(py)?.runtime_mut().session_mut().truncate(n).map_err(backend_err)
    }

    /// Copies the session's tokens and KV cache; ``restore`` puts them back exactly.
    ///
    /// Returns:
    ///     SessionSnapshot: the copy (``save()`` writes it to a file).
    ///
    /// Example:
    ///     >>> snap = rt.session.snapshot()
    fn snapshot(&self, py: Python<'_>) -> PyResult<PySessionSnapshot> {
        let rt = self.runtime.get();
        let snap =
            py.detach(|| catch_panic(|| rt.lock_detached()?.runtime().session().snapshot().map_err(backend_err)))?;
        Ok(PySessionSnapshot { inner: Arc::new(snap) })
    }

    /// Puts a snapshot's tokens and cache back; one of another model is an error that changes
    /// nothing.
    ///
    /// Args:
    ///     snapshot (SessionSnapshot): a snapshot of a runtime of the same model.
    ///
    /// Returns:
    ///     None
    ///
    /// Example:
    ///     >>> rt.session.restore(snap)
    fn restore(&self, py: Python<'_>, snapshot: PyRef<'_, PySessionSnapshot>) -> PyResult<()> {
        let (rt, snap) = (self.runtime.get(), Arc::clone(&snapshot.inner));
        py.detach(|| {
            catch_panic(|| rt.lock_detached()?.runtime_mut().session_mut().restore(&snap).map_err(backend_err))
        })
    }

    /// Empties the cache; after an internal error this also gives back a working session.
    ///
    /// Example:
    ///     >>> rt.session.reset(); rt.session.position
    ///     0
    fn reset(&self, py: Python<'_>) -> PyResult<()> {
        self.runtime.get().lock_and_recover(py)?.runtime_mut().session_mut().reset();
        Ok(())
    }

    fn __repr__(&self, py: Python<'_>) -> PyResult<String> {
        Ok(format!("Session(position={}, max_context={})", self.position(py)?, self.max_context(py)?))
    }
}

/// What the session was proven able to do.
#[pyclass(name = "SessionCapabilities", module = "candlewick._native", frozen, get_all, eq)]
#[derive(PartialEq)]
pub struct PySessionCapabilities {
    persistent_cache: bool,
    output_observation: bool,
    activation_inspection: bool,
    activation_intervention: bool,
}

#[pymethods]
impl PySessionCapabilities {
    fn __repr__(&self) -> String {
        let b = |v: bool| if v { "True" } else { "False" };
        format!(
            "SessionCapabilities(persistent_cache={}, output_observation={}, activation_inspection={}, \
             activation_intervention={})",
            b(self.persistent_cache),
            b(self.output_observation),
            b(self.activation_inspection),
            b(self.activation_intervention)
        )
    }
}

/// A copy of a session's tokens and KV cache (`rt.session.snapshot()`), restorable onto any
/// runtime of the same model, and savable to a file.
#[pyclass(name = "SessionSnapshot", module = "candlewick._native", frozen)]
pub struct PySessionSnapshot {
    inner: Arc<SessionSnapshot>,
}

#[pymethods]
impl PySessionSnapshot {
    /// Writes the snapshot to a file (safetensors with a version, the model's fingerprint and
    /// a checksum; docs/snapshots.md).
    ///
    /// Args:
    ///     path (str | os.PathLike): the file to write.
    ///
    /// Returns:
    ///     None
    ///
    /// Example:
    ///     >>> rt.session.snapshot().save("s.cwsnap")
    fn save(&self, py: Python<'_>, path: PathBuf) -> PyResult<()> {
        py.detach(|| self.inner.save(&path)).map_err(backend_err)
    }

    /// Reads a snapshot written by ``save``; a damaged or truncated file is an ``ArtifactError``.
    ///
    /// Args:
    ///     path (str | os.PathLike): the file to read.
    ///
    /// Returns:
    ///     SessionSnapshot: restorable onto a runtime of the same model.
    ///
    /// Example:
    ///     >>> rt.session.restore(SessionSnapshot.load("s.cwsnap"))
    #[staticmethod]
    fn load(py: Python<'_>, path: PathBuf) -> PyResult<Self> {
        let snap = py.detach(|| {
            catch_panic(|| {
                // A snapshot file is read into host memory.
                let cpu = parse_device("cpu").map_err(backend_err)?;
                SessionSnapshot::load(&path, &cpu).map_err(backend_err)
            })
        })?;
        Ok(Self { inner: Arc::new(snap) })
    }

    /// Tokens held.
    #[getter]
    fn position(&self) -> usize {
        self.inner.tokens().len()
    }

    /// The token ids held, oldest first.
    #[getter]
    fn tokens(&self) -> Vec<u32> {
        self.inner.tokens().to_vec()
    }

    /// The fingerprint of the model it was taken from.
    #[getter]
    fn fingerprint(&self) -> &str {
        self.inner.fingerprint()
    }

    fn __repr__(&self, py: Python<'_>) -> String {
        format!(
            "SessionSnapshot(position={}, fingerprint={})",
            self.inner.tokens().len(),
            py_repr(py, self.inner.fingerprint())
        )
    }
}
