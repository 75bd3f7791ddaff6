//! The PyO3 layer: a thin binding of the core, one file per domain.

mod engine;
mod errors;
mod generation;
mod intervention;
mod observation;
mod runtime;
mod text;

use pyo3::prelude::*;

/// The native module behind the `candlewick` package.
#[pymodule]
fn _native(m: &Bound<'_, PyModule>) -> PyResult<()> {
    errors::register(m)?;
    m.add_class::<runtime::PyModelRuntime>()?;
    m.add_class::<runtime::PyBackend>()?;
    m.add_class::<runtime::PySession>()?;
    m.add_class::<runtime::PySessionCapabilities>()?;
    m.add_class::<runtime::PyStepOutput>()?;
    m.add_class::<runtime::PySubmission>()?;
    m.add_class::<runtime::PyInspectedOutput>()?;
    m.add_class::<observation::PyObservationRequest>()?;
    m.add_class::<observation::PyObservationSet>()?;
    m.add_class::<text::PyTokenizer>()?;
    m.add_class::<generation::PyGenerationResult>()?;
    m.add_class::<generation::PyGenerationStream>()?;
    m.add_class::<intervention::PyIntervention>()?;
    m.add_class::<runtime::PyInterventionScope>()?;
    m.add_class::<runtime::PySessionSnapshot>()?;
    m.add_class::<engine::PyEngine>()?;
    m.add_class::<engine::PyEngineRequest>()?;
    m.add("QueueFullError", m.py().get_type::<engine::QueueFullError>())?;
    m.add_function(wrap_pyfunction!(intervention::save_control_vector, m)?)?;
    m.add_function(wrap_pyfunction!(generation::generation_defaults, m)?)?;
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    Ok(())
}
