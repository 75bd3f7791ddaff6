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
    DeviceError,
    GenerationOptionError,
    GenerationResult,
    GenerationStream,
    InspectedOutput,
    InternalError,
    Intervention,
    InvalidInterventionError,
    ModelRuntime,
    NonFiniteLogitsError,
    ObservationError,
    ObservationRequest,
    ObservationSet,
    Session,
    SessionCapabilities,
    SessionError,
    StepOutput,
    Submission,
    Tokenizer,
    TokenizerError,
    TokenOutOfRangeError,
    UnsupportedArchitectureError,
    UnsupportedError,
    UnsupportedTensorTypeError,
    __version__,
)
from . import interventions

# ObservationSet implements the mapping protocol natively; registering it makes
# isinstance(obs, Mapping) true so it works wherever a read-only mapping is expected.
Mapping.register(ObservationSet)

__all__ = [
    "ArtifactError",
    "Backend",
    "CandlewickError",
    "ContextFullError",
    "DeviceError",
    "GenerationOptionError",
    "GenerationResult",
    "GenerationStream",
    "InspectedOutput",
    "InternalError",
    "Intervention",
    "InvalidInterventionError",
    "ModelRuntime",
    "NonFiniteLogitsError",
    "ObservationError",
    "ObservationRequest",
    "ObservationSet",
    "Session",
    "SessionCapabilities",
    "SessionError",
    "StepOutput",
    "Submission",
    "Tokenizer",
    "TokenizerError",
    "TokenOutOfRangeError",
    "UnsupportedArchitectureError",
    "UnsupportedError",
    "UnsupportedTensorTypeError",
    "__version__",
    "interventions",
]
