//! The Python exception hierarchy and the mapping of every Rust error onto it.

use pyo3::exceptions::PyException;
use pyo3::prelude::*;

use candlewick::backend::CandleError;
use candlewick::core::{InterventionError, ModelLoadError, ObservationError, RuntimeError};
use candlewick::engine::EngineError;
use candlewick::generation::GenerationError;
use candlewick::model::embedding::EmbeddingError;
use candlewick::model::ModelError;

pyo3::create_exception!(candlewick, CandlewickError, PyException, "Base class of every candlewick error.");
pyo3::create_exception!(
    candlewick,
    ArtifactError,
    CandlewickError,
    "A model file or directory is missing, malformed or truncated."
);
pyo3::create_exception!(candlewick, UnsupportedError, CandlewickError, "Something candlewick does not implement.");
pyo3::create_exception!(
    candlewick,
    SaeError,
    CandlewickError,
    "A sparse autoencoder cannot be loaded or attached (missing file, width or point mismatch)."
);
pyo3::create_exception!(
    candlewick,
    AdapterError,
    CandlewickError,
    "A LoRA adapter cannot be loaded or used (missing file, shapes or modules of another base, in use)."
);
pyo3::create_exception!(
    candlewick,
    UnsupportedArchitectureError,
    UnsupportedError,
    "The checkpoint's architecture is not supported."
);
pyo3::create_exception!(
    candlewick,
    UnsupportedTensorTypeError,
    UnsupportedError,
    "A tensor is stored in a type candlewick cannot run."
);
pyo3::create_exception!(
    candlewick,
    DeviceError,
    CandlewickError,
    "The requested device is not in this build or not present."
);
pyo3::create_exception!(
    candlewick,
    SessionError,
    CandlewickError,
    "A step, truncation or call the session cannot take."
);
pyo3::create_exception!(candlewick, TokenOutOfRangeError, SessionError, "A token id outside the vocabulary.");
pyo3::create_exception!(candlewick, ContextFullError, SessionError, "The step would run past the session's context.");
pyo3::create_exception!(
    candlewick,
    OutOfMemoryError,
    SessionError,
    "The step would need more memory than the machine has free; it was refused before allocating."
);
pyo3::create_exception!(
    candlewick,
    RuntimeClosedError,
    SessionError,
    "The runtime was closed (``ModelRuntime.close()``, or the end of its ``with`` block); load the model again."
);
/// Holds the Python `ObservationError` apart from the core's Rust type of the same name.
mod observation_exc {
    pyo3::create_exception!(
        candlewick,
        ObservationError,
        super::CandlewickError,
        "An observation request the model cannot serve."
    );
}
pub use observation_exc::ObservationError as PyObservationError;
pyo3::create_exception!(
    candlewick,
    InvalidInterventionError,
    CandlewickError,
    "An intervention names no point of the model, has the wrong size, or is out of range; nothing was applied."
);
pyo3::create_exception!(
    candlewick,
    GenerationOptionError,
    CandlewickError,
    "A generation option is out of range or of the wrong kind."
);
pyo3::create_exception!(
    candlewick,
    NonFiniteLogitsError,
    SessionError,
    "The model produced NaN or infinite logits, so no token can be chosen."
);
pyo3::create_exception!(
    candlewick,
    TokenizerError,
    CandlewickError,
    "Tokenization, detokenization or a chat template failed."
);
pyo3::create_exception!(
    candlewick,
    InternalError,
    CandlewickError,
    "A failure inside candlewick or candle (a bug: please report it)."
);
pyo3::create_exception!(
    candlewick,
    QueueFullError,
    CandlewickError,
    "The engine's queue is full: the request was refused; retry later."
);

/// `InvalidOptionError(CandlewickError, ValueError)`: a bad option value is both a candlewick
/// error and what Python code catches as `ValueError`; `create_exception!` takes one base only.
static INVALID_OPTION: pyo3::sync::PyOnceLock<Py<pyo3::types::PyType>> = pyo3::sync::PyOnceLock::new();

fn invalid_option_type(py: Python<'_>) -> PyResult<&Bound<'_, pyo3::types::PyType>> {
    INVALID_OPTION
        .get_or_try_init(py, || {
            let bases = (py.get_type::<CandlewickError>(), py.get_type::<pyo3::exceptions::PyValueError>());
            let ns = pyo3::types::PyDict::new(py);
            ns.set_item(
                "__doc__",
                "An option was given a value it does not take (names the option and the accepted values).",
            )?;
            ns.set_item("__module__", "candlewick")?;
            let t = py.get_type::<pyo3::types::PyType>().call1(("InvalidOptionError", bases, ns))?;
            Ok(t.cast_into::<pyo3::types::PyType>()?.unbind())
        })
        .map(|t| t.bind(py))
}

/// An `InvalidOptionError` with `msg` (which names the option).
pub fn invalid_option(py: Python<'_>, msg: String) -> PyErr {
    match invalid_option_type(py) {
        Ok(t) => PyErr::from_type(t.clone(), msg),
        Err(e) => e,
    }
}

/// Registers the exception classes on the module.
pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    let py = m.py();
    m.add("InvalidOptionError", invalid_option_type(py)?)?;
    m.add("CandlewickError", py.get_type::<CandlewickError>())?;
    m.add("ArtifactError", py.get_type::<ArtifactError>())?;
    m.add("UnsupportedError", py.get_type::<UnsupportedError>())?;
    m.add("UnsupportedArchitectureError", py.get_type::<UnsupportedArchitectureError>())?;
    m.add("UnsupportedTensorTypeError", py.get_type::<UnsupportedTensorTypeError>())?;
    m.add("DeviceError", py.get_type::<DeviceError>())?;
    m.add("SessionError", py.get_type::<SessionError>())?;
    m.add("TokenOutOfRangeError", py.get_type::<TokenOutOfRangeError>())?;
    m.add("ContextFullError", py.get_type::<ContextFullError>())?;
    m.add("OutOfMemoryError", py.get_type::<OutOfMemoryError>())?;
    m.add("RuntimeClosedError", py.get_type::<RuntimeClosedError>())?;
    m.add("ObservationError", py.get_type::<PyObservationError>())?;
    m.add("TokenizerError", py.get_type::<TokenizerError>())?;
    m.add("InvalidInterventionError", py.get_type::<InvalidInterventionError>())?;
    m.add("GenerationOptionError", py.get_type::<GenerationOptionError>())?;
    m.add("NonFiniteLogitsError", py.get_type::<NonFiniteLogitsError>())?;
    m.add("InternalError", py.get_type::<InternalError>())?;
    m.add("SaeError", py.get_type::<SaeError>())?;
    m.add("AdapterError", py.get_type::<AdapterError>())?;
    Ok(())
}

/// The Python exception for a backend error.
pub fn backend_err(e: CandleError) -> PyErr {
    let msg = e.to_string();
    match e {
        CandleError::Device { .. } => DeviceError::new_err(msg),
        CandleError::MissingFile { .. }
        | CandleError::Malformed { .. }
        | CandleError::MissingSplitPart { .. }
        | CandleError::NotFirstSplitPart { .. }
        | CandleError::SplitMismatch { .. }
        | CandleError::MissingTensor { .. }
        | CandleError::MissingMetadata { .. }
        | CandleError::TensorShape { .. }
        | CandleError::Io { .. } => ArtifactError::new_err(msg),
        CandleError::UnsupportedArchitecture { .. } => UnsupportedArchitectureError::new_err(msg),
        CandleError::UnsupportedTensorType { .. } => UnsupportedTensorTypeError::new_err(msg),
        CandleError::UnsupportedConfig { .. } | CandleError::EncoderOnly { .. } => UnsupportedError::new_err(msg),
        CandleError::TokenOutOfRange { .. } => TokenOutOfRangeError::new_err(msg),
        CandleError::ContextFull { .. } => ContextFullError::new_err(msg),
        CandleError::OutOfMemory { .. } => OutOfMemoryError::new_err(msg),
        CandleError::InvalidInput { .. } | CandleError::WindowRewind { .. } => SessionError::new_err(msg),
        CandleError::InvalidOption { .. } => Python::attach(|py| invalid_option(py, msg)),
        CandleError::Observation(_) => PyObservationError::new_err(msg),
        CandleError::Intervention(_) => InvalidInterventionError::new_err(msg),
        CandleError::Candle { .. } => InternalError::new_err(msg),
        CandleError::Sae(_) => SaeError::new_err(msg),
        CandleError::Adapter(_) => AdapterError::new_err(msg),
    }
}

/// The Python exception for an invalid intervention.
pub fn intervention_err(e: InterventionError) -> PyErr {
    InvalidInterventionError::new_err(e.to_string())
}

/// The Python exception for a generation error.
pub fn generation_err(e: GenerationError<CandleError>) -> PyErr {
    match e {
        GenerationError::Runtime(e) => runtime_err(e),
        GenerationError::Text(e) => text_err(e),
        GenerationError::InvalidOptions(m) => GenerationOptionError::new_err(m),
        e @ GenerationError::Constraint(_) => GenerationOptionError::new_err(e.to_string()),
        e @ GenerationError::NonFiniteLogits { .. } => NonFiniteLogitsError::new_err(e.to_string()),
        e @ GenerationError::SessionChanged => SessionError::new_err(e.to_string()),
    }
}

/// The Python exception for a model-layer error.
pub fn model_err(e: ModelError) -> PyErr {
    match e {
        ModelError::Load(e) => load_err(e),
        ModelError::Backend(e) => backend_err(e),
        ModelError::Runtime(e) => runtime_err(e),
        ModelError::Generation(e) => generation_err(e),
        ModelError::Text(e) => text_err(e),
        e @ (ModelError::NoTokenizer { .. } | ModelError::NoChatTemplate) => TokenizerError::new_err(e.to_string()),
        e @ ModelError::DraftModel { .. } => Python::attach(|py| invalid_option(py, e.to_string())),
        ModelError::ControlVector(e) => match e {
            candlewick::model::control_vector::ControlVectorError::WrongModel { .. } => {
                InvalidInterventionError::new_err(e.to_string())
            }
            _ => ArtifactError::new_err(e.to_string()),
        },
        ModelError::Embedding(e) => match e {
            EmbeddingError::Config { .. } => ArtifactError::new_err(e.to_string()),
            EmbeddingError::InvalidArgument { .. } => Python::attach(|py| invalid_option(py, e.to_string())),
            EmbeddingError::Compute { .. } => InternalError::new_err(e.to_string()),
        },
    }
}

/// The Python exception for a runtime error.
pub fn runtime_err(e: RuntimeError<CandleError>) -> PyErr {
    match e {
        RuntimeError::Backend(e) => backend_err(e),
        RuntimeError::Observation(e) => observation_err(e),
        RuntimeError::Intervention(e) => intervention_err(e),
        other => SessionError::new_err(other.to_string()),
    }
}

/// The Python exception for an invalid observation request or set.
pub fn observation_err(e: ObservationError) -> PyErr {
    PyObservationError::new_err(e.to_string())
}

/// The Python exception for a failed load, keeping the artifact's path in the message.
pub fn load_err(e: ModelLoadError<CandleError>) -> PyErr {
    match e {
        ModelLoadError::Artifact { path, source } => {
            let err = backend_err(source);
            Python::attach(|py| {
                // Most artifact errors name their file already; add the path only where not.
                let msg = err.value(py).to_string();
                if msg.contains(&path) {
                    err
                } else {
                    PyErr::from_type(err.get_type(py), format!("{path}: {msg}"))
                }
            })
        }
        ModelLoadError::Backend { source, .. } => backend_err(source),
        ModelLoadError::Runtime(e) => runtime_err(e),
    }
}

/// The Python exception for an engine error.
pub fn engine_err(e: EngineError) -> PyErr {
    match e {
        EngineError::QueueFull { .. } => QueueFullError::new_err(e.to_string()),
        EngineError::Closed => CandlewickError::new_err(e.to_string()),
        EngineError::Model(e) => model_err(e),
    }
}

/// The Python exception for a text error.
pub fn text_err(e: candlewick::text::TextError) -> PyErr {
    match e {
        // A bad `tools` / `tool_choice` is a generation option, not a tokenizer failure.
        e @ candlewick::text::TextError::InvalidToolCall { .. } => GenerationOptionError::new_err(e.to_string()),
        e => TokenizerError::new_err(e.to_string()),
    }
}

/// Runs `f` under `catch_unwind`, turning a Rust panic into `InternalError` instead of unwinding into Python.
pub fn catch_panic<T>(f: impl FnOnce() -> PyResult<T>) -> PyResult<T> {
    match std::panic::catch_unwind(std::panic::AssertUnwindSafe(f)) {
        Ok(r) => r,
        Err(payload) => {
            let what = payload
                .downcast_ref::<&str>()
                .map(|s| s.to_string())
                .or_else(|| payload.downcast_ref::<String>().cloned())
                .unwrap_or_else(|| "unknown panic".into());
            Err(InternalError::new_err(format!("internal error (Rust panic): {what}")))
        }
    }
}
