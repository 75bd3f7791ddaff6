"""candlewick: a local language-model runtime on candle.

``ModelRuntime`` owns a loaded model, the backend that prepared it and its one
session (the KV cache). Step it with ``prefill`` / ``decode``, read logits as numpy,
and ask for named activations with ``inspect_prefill`` / ``inspect_decode``.
"""

from collections.abc import Mapping

from ._native import (
    ArtifactError,
    Backend,
    CandlewickError,
    ContextFullError,
    OutOfMemoryError,
    DeviceError,
    GenerationOptionError,
    GenerationResult,
    GenerationStream,
    InspectedOutput,
    InternalError,
    Intervention,
    InvalidInterventionError,
    InvalidOptionError,
    ModelRuntime,
    NonFiniteLogitsError,
    ObservationError,
    ObservationRequest,
    ObservationSet,
    RuntimeClosedError,
    Session,
    SessionCapabilities,
    SessionError,
    SessionSnapshot,
    StepOutput,
    Submission,
    Tokenizer,
    TokenizerError,
    TokenOutOfRangeError,
    UnsupportedArchitectureError,
    UnsupportedError,
    UnsupportedTensorTypeError,
    __version__,
    build_info,
    supported_architectures,
)
from . import _native, interventions
from ._native import QueueFullError
from .engine import Engine, EngineRequest
from . import hub
from . import sae
from ._native import SaeError
from ._native import AdapterError
from .sae import SparseFeatures
from .collect import collect
from .hub import (
    DownloadError,
    GatedRepositoryError,
    HubError,
    HubOfflineError,
    UnknownFileError,
    UnknownRepositoryError,
    UnknownRevisionError,
    UnknownTagError,
)


def save_control_vector(path, directions, model_hint: str = "") -> None:
    """Writes ``{layer: vector}`` (layers counting from 1, as llama.cpp's) as a control-vector GGUF
    that llama.cpp (``--control-vector``) and ``ModelRuntime.load_control_vector`` load."""
    import numpy as np

    flat = {int(k): np.asarray(v, dtype=np.float32).ravel().tolist() for k, v in directions.items()}
    _native.save_control_vector(path, flat, model_hint)


# ObservationSet implements the mapping protocol natively; registering it makes
# isinstance(obs, Mapping) true so it works wherever a read-only mapping is expected.
Mapping.register(ObservationSet)

__all__ = [
    "ArtifactError",
    "Backend",
    "CandlewickError",
    "ContextFullError",
    "OutOfMemoryError",
    "DeviceError",
    "GenerationOptionError",
    "GenerationResult",
    "GenerationStream",
    "InspectedOutput",
    "InternalError",
    "Intervention",
    "InvalidInterventionError",
    "InvalidOptionError",
    "ModelRuntime",
    "NonFiniteLogitsError",
    "ObservationError",
    "ObservationRequest",
    "ObservationSet",
    "RuntimeClosedError",
    "Session",
    "SessionCapabilities",
    "SessionError",
    "SessionSnapshot",
    "StepOutput",
    "Submission",
    "Tokenizer",
    "TokenizerError",
    "TokenOutOfRangeError",
    "UnsupportedArchitectureError",
    "UnsupportedError",
    "UnsupportedTensorTypeError",
    "__version__",
    "build_info",
    "supported_architectures",
    "interventions",
    "save_control_vector",
    "Engine",
    "EngineRequest",
    "QueueFullError",
    "hub",
    "HubError",
    "UnknownRepositoryError",
    "UnknownRevisionError",
    "UnknownTagError",
    "UnknownFileError",
    "GatedRepositoryError",
    "HubOfflineError",
    "DownloadError",
    "sae",
    "SaeError",
    "AdapterError",
    "SparseFeatures",
    "collect",
]
