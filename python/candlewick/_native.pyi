"""Type stubs of the native module (Rust, PyO3)."""

from collections.abc import Iterator, Mapping, Sequence
from os import PathLike
from typing import Any, Literal, final, overload

import numpy as np
import numpy.typing as npt

# LoRA adapters chosen for a call: a name, names or (name, scale) pairs, or {name: scale}.
_AdapterChoice = str | Sequence[str | tuple[str, float | None]] | Mapping[str, float | None]

__version__: str
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
    "InterventionScope",
    "InvalidInterventionError",
    "InvalidOptionError",
    "ModelRuntime",
    "NonFiniteLogitsError",
    "SaeError",
    "AdapterError",
    "ObservationError",
    "ObservationRequest",
    "ObservationSet",
    "RuntimeClosedError",
    "Session",
    "SessionCapabilities",
    "SessionSnapshot",
    "Engine",
    "EngineRequest",
    "QueueFullError",
    "SessionError",
    "StepOutput",
    "Submission",
    "TokenOutOfRangeError",
    "Tokenizer",
    "TokenizerError",
    "UnsupportedArchitectureError",
    "UnsupportedError",
    "UnsupportedTensorTypeError",
    "__version__",
    "build_info",
    "supported_architectures",
    "generation_defaults",
    "save_control_vector",
]

class CandlewickError(Exception): ...
class ArtifactError(CandlewickError): ...
class UnsupportedError(CandlewickError): ...
class UnsupportedArchitectureError(UnsupportedError): ...
class UnsupportedTensorTypeError(UnsupportedError): ...
class DeviceError(CandlewickError): ...
class SessionError(CandlewickError): ...
class TokenOutOfRangeError(SessionError): ...
class ContextFullError(SessionError): ...
class OutOfMemoryError(SessionError): ...
class RuntimeClosedError(SessionError): ...
class ObservationError(CandlewickError): ...
class TokenizerError(CandlewickError): ...
class InternalError(CandlewickError): ...
class InvalidInterventionError(CandlewickError): ...
class GenerationOptionError(CandlewickError): ...
class NonFiniteLogitsError(SessionError): ...
class SaeError(CandlewickError): ...
class AdapterError(CandlewickError): ...
class InvalidOptionError(CandlewickError, ValueError): ...

@final
class Intervention:
    """One edit of a named point (build it with ``candlewick.interventions``)."""

    @staticmethod
    def add(
        point: str, vector: Sequence[float], scale: float = 1.0, positions: Sequence[int] | None = None
    ) -> Intervention: ...
    @staticmethod
    def set(point: str, values: Sequence[float], positions: Sequence[int]) -> Intervention: ...
    @staticmethod
    def scale(
        point: str, index: Sequence[int], factor: float, positions: Sequence[int] | None = None
    ) -> Intervention: ...
    @staticmethod
    def project_out(
        point: str, direction: Sequence[float], positions: Sequence[int] | None = None
    ) -> Intervention: ...
    @staticmethod
    def sae_steer(sae: str, feature: int, scale: float, positions: Sequence[int] | None = None) -> Intervention: ...
    @staticmethod
    def sae_clamp(
        sae: str, features: Sequence[int], value: float, positions: Sequence[int] | None = None
    ) -> Intervention: ...
    @staticmethod
    def sae_splice(sae: str, keep_error: bool = True, positions: Sequence[int] | None = None) -> Intervention: ...
    @property
    def point(self) -> str: ...
    @property
    def op(self) -> Literal["add", "set", "scale", "project_out"]: ...
    @property
    def positions(self) -> list[int] | None: ...
    @property
    def values(self) -> list[float] | None: ...
    @property
    def scale_factor(self) -> float | None: ...
    @property
    def index(self) -> list[int] | None: ...
    def __eq__(self, other: object, /) -> bool: ...

def build_info() -> dict[str, Any]: ...
def supported_architectures(format: str | None = None, images: bool = False) -> list[str]: ...
def generation_defaults() -> dict[str, Any]: ...
def save_control_vector(
    path: str | PathLike[str], directions: Mapping[int, Sequence[float]], model_hint: str = ""
) -> None: ...

class QueueFullError(CandlewickError): ...

@final
class Engine:
    """Many requests over one model, stepped together in a background thread."""

    def __new__(
        cls,
        runtime: ModelRuntime,
        max_batch_size: int = 8,
        max_queue: int = 64,
        max_kv_bytes: int | None = None,
        prefill_chunk: int | None = 128,
        prefix_cache_bytes: int = 268435456,
        prefix_cache_dir: str | PathLike[str] | None = None,
        prefix_cache_disk_bytes: int = 4294967296,
    ) -> Engine: ...
    def submit(
        self,
        prompt: Any,
        *,
        interventions: Sequence[Intervention] | None = None,
        chat: bool = False,
        chat_template: str | None = None,
        images: Sequence[Any] | None = None,
        pixel_values: Any | None = None,
        max_tokens: int | None = 256,
        temperature: float | None = None,
        top_k: int | None = None,
        top_p: float | None = None,
        min_p: float | None = None,
        repetition_penalty: float | None = None,
        presence_penalty: float | None = None,
        frequency_penalty: float | None = None,
        logit_bias: Mapping[int, float] | None = None,
        stop: str | Sequence[str] | None = None,
        seed: int | None = None,
        ignore_eos: bool = False,
        logprobs: int | bool | None = None,
        skip_special_tokens: bool = True,
        response_format: Mapping[str, Any] | None = None,
        grammar: str | None = None,
        grammar_format: str | None = None,
        regex: str | None = None,
        choice: Sequence[str] | None = None,
        prompt_lookup_num_tokens: int | None = None,
        num_draft_tokens: int | None = None,
        adapters: _AdapterChoice | None = None,
    ) -> EngineRequest: ...
    def stats(self) -> dict[str, int]: ...
    def close(self) -> None: ...

@final
class EngineRequest:
    """A request of an Engine: its events, and a way to cancel it."""

    def next_event(self, timeout: float = 0.1) -> tuple[str, Any] | None:
        """``("text", (str, logprobs | None))``, ``("done", GenerationResult)``, ``("cancelled", None)`` or None."""
    def cancel(self) -> None: ...

@final
class InterventionScope:
    """``with rt.intervene([...]):`` keeps the edits on inside the block."""

    def __enter__(self) -> InterventionScope: ...
    def __exit__(self, ty: object, value: object, tb: object, /) -> bool: ...

@final
class ObservationRequest:
    """Which observation points to materialise."""

    @staticmethod
    def all() -> ObservationRequest: ...
    @staticmethod
    def select(prefixes: Sequence[str]) -> ObservationRequest: ...
    @staticmethod
    def exact(paths: Sequence[str]) -> ObservationRequest: ...
    @property
    def selectors(self) -> list[tuple[str, str]]: ...
    @property
    def is_all(self) -> bool: ...
    def matches(self, path: str) -> bool: ...

@final
class ObservationSet:
    """A read-only mapping from observation path to a float32 numpy array (or a scalar)."""

    def __getitem__(self, path: str, /) -> Any: ...
    def __len__(self) -> int: ...
    def __contains__(self, path: object, /) -> bool: ...
    def __iter__(self) -> Iterator[str]: ...
    def keys(self) -> list[str]: ...
    def values(self) -> list[Any]: ...
    def items(self) -> list[tuple[str, Any]]: ...
    def get(self, path: str, default: Any | None = None) -> Any | None: ...

@final
class SessionCapabilities:
    """What the session was proven able to do (false unless proven)."""

    @property
    def persistent_cache(self) -> bool: ...
    @property
    def output_observation(self) -> bool: ...
    @property
    def activation_inspection(self) -> bool: ...
    @property
    def activation_intervention(self) -> bool: ...

@final
class StepOutput:
    """A step's logits, owned by the runtime that produced them."""

    @property
    def logits(self) -> npt.NDArray[np.float32]: ...
    @property
    def start_position(self) -> int: ...
    @property
    def num_tokens(self) -> int: ...

@final
class Submission:
    """A submitted step: its output and completion."""

    def is_complete(self) -> bool: ...
    def wait(self) -> StepOutput: ...
    @property
    def output(self) -> StepOutput: ...

@final
class InspectedOutput:
    """A step's output with the observation points that were asked for."""

    @property
    def output(self) -> StepOutput: ...
    @property
    def observations(self) -> ObservationSet: ...

@final
class Backend:
    """The backend of one runtime (a bound view)."""

    @property
    def name(self) -> str: ...
    @property
    def device(self) -> str: ...
    def devices(self) -> list[tuple[str, list[str]]]: ...

@final
class Session:
    """The session of one runtime (a bound view)."""

    @property
    def position(self) -> int: ...
    @property
    def max_context(self) -> int: ...
    @property
    def cache_bytes(self) -> int: ...
    @property
    def prefill_chunk(self) -> int: ...
    def truncate(self, n: int) -> None: ...
    def reset(self) -> None: ...
    def snapshot(self) -> SessionSnapshot: ...
    def restore(self, snapshot: SessionSnapshot) -> None: ...

@final
class SessionSnapshot:
    """A copy of a session's tokens and KV cache, restorable onto a runtime of the same model."""

    def save(self, path: str | PathLike[str]) -> None: ...
    @staticmethod
    def load(path: str | PathLike[str]) -> SessionSnapshot: ...
    @property
    def position(self) -> int: ...
    @property
    def tokens(self) -> list[int]: ...
    @property
    def fingerprint(self) -> str: ...

@final
class Tokenizer:
    """A model's tokenizer (from tokenizer.json or the GGUF vocabulary)."""

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]: ...
    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str: ...
    @property
    def bos_id(self) -> int | None: ...
    @property
    def eos_ids(self) -> list[int]: ...
    @property
    def vocab_size(self) -> int: ...
    def token_to_id(self, token: str) -> int | None: ...
    def id_to_token(self, id: int) -> str | None: ...
    def tool_call_format(self, name: str | None = None, chat_template: str | None = None) -> str: ...
    def tool_call_grammar(
        self,
        tools: Sequence[Mapping[str, Any]],
        tool_choice: str | Mapping[str, Any] | None = None,
        parallel_tool_calls: bool = True,
        format: str | None = None,
        chat_template: str | None = None,
    ) -> str | None: ...
    def parse_tool_calls(
        self, ids: Sequence[int], format: str | None = None, chat_template: str | None = None
    ) -> tuple[str, list[dict[str, Any]]]: ...
    @property
    def chat_template(self) -> str | None: ...
    def apply_chat_template(
        self,
        conversation: Sequence[Mapping[str, Any]] | Sequence[Sequence[Mapping[str, Any]]],
        tools: Sequence[Mapping[str, Any]] | None = None,
        documents: Sequence[Mapping[str, Any]] | None = None,
        chat_template: str | None = None,
        add_generation_prompt: bool = False,
        continue_final_message: bool = False,
        tokenize: bool = True,
        return_dict: bool = False,
        **kwargs: Any,
    ) -> Any:
        """The prompt: text (``tokenize=False``), ids, ``{"input_ids", "attention_mask"}``
        (``return_dict=True``), or a list of those for a batch of conversations."""

@final
class GenerationResult:
    """A finished generation."""

    @property
    def text(self) -> str: ...
    @property
    def token_ids(self) -> list[int]: ...
    @property
    def finish_reason(self) -> Literal["stop", "length", "eos", "cancelled", "tool_calls"]: ...
    @property
    def usage(self) -> dict[str, Any]: ...
    @property
    def logprobs(self) -> list[dict[str, Any]] | None: ...
    @property
    def tool_calls(self) -> list[dict[str, Any]] | None: ...

@final
class GenerationStream:
    """An iterator of text pieces; `result` is set once it is exhausted."""

    def __iter__(self) -> GenerationStream: ...
    def __next__(self) -> str: ...
    def close(self) -> None: ...
    def __enter__(self) -> GenerationStream: ...
    def __exit__(self, ty: object, value: object, tb: object, /) -> bool: ...
    @property
    def result(self) -> GenerationResult | None: ...
    @property
    def logprobs(self) -> list[dict[str, Any]] | None: ...

@final
class ModelRuntime:
    """A loaded model, the backend that prepared it and its one session."""

    @staticmethod
    def load(
        path: str | PathLike[str],
        device: str = "auto",
        dtype: str | None = None,
        max_context: int | None = None,
        threads: int | None = None,
        quantize: str | None = None,
        check_tensors: bool = True,
        draft_model: str | PathLike[str] | None = None,
        kv_cache_type: str | None = None,
        prefill_chunk: int | None = None,
        filename: str | None = None,
        revision: str | None = None,
        mmproj: str | PathLike[str] | None = None,
    ) -> ModelRuntime: ...
    def close(self) -> None: ...
    @property
    def closed(self) -> bool: ...
    def __enter__(self) -> ModelRuntime: ...
    def __exit__(self, ty: object, value: object, tb: object, /) -> bool: ...
    @property
    def backend(self) -> Backend: ...
    @property
    def session(self) -> Session: ...
    @property
    def capabilities(self) -> SessionCapabilities: ...
    @property
    def model_info(self) -> dict[str, Any]: ...
    def prefill(
        self,
        tokens: str | Sequence[int],
        all_logits: bool = False,
        interventions: Sequence[Intervention] | None = None,
        *,
        images: Sequence[Any] | None = None,
        pixel_values: Any | None = None,
    ) -> Submission: ...
    def process(
        self, prompt: Any, images: Sequence[Any] | None = None, *, chat_template: str | None = None
    ) -> tuple[list[int], np.ndarray]: ...
    def decode(self, tokens: Sequence[int], interventions: Sequence[Intervention] | None = None) -> Submission: ...
    def observe_output(self, output: StepOutput) -> ObservationSet: ...
    def inspect_prefill(
        self,
        tokens: str | Sequence[int],
        request: ObservationRequest | None = None,
        all_logits: bool = False,
        interventions: Sequence[Intervention] | None = None,
        adapters: _AdapterChoice | None = None,
        *,
        images: Sequence[Any] | None = None,
        pixel_values: Any | None = None,
    ) -> InspectedOutput: ...
    def inspect_decode(
        self,
        tokens: Sequence[int],
        request: ObservationRequest | None = None,
        interventions: Sequence[Intervention] | None = None,
        adapters: _AdapterChoice | None = None,
    ) -> InspectedOutput: ...
    def trace(
        self,
        tokens: str | Sequence[int],
        request: ObservationRequest | None = None,
        interventions: Sequence[Intervention] | None = None,
        adapters: _AdapterChoice | None = None,
        *,
        images: Sequence[Any] | None = None,
        pixel_values: Any | None = None,
    ) -> InspectedOutput: ...
    def trace_batch(
        self,
        prompts: Sequence[Sequence[int]],
        request: ObservationRequest | None = None,
        interventions: Sequence[Intervention] | None = None,
        adapters: _AdapterChoice | None = None,
    ) -> list[InspectedOutput]: ...
    def generate_batch(
        self,
        prompts: Sequence[str | Sequence[int]],
        *,
        max_tokens: int | None = 256,
        temperature: float | None = None,
        top_k: int | None = None,
        top_p: float | None = None,
        min_p: float | None = None,
        repetition_penalty: float | None = None,
        presence_penalty: float | None = None,
        frequency_penalty: float | None = None,
        logit_bias: Mapping[int, float] | None = None,
        stop: str | Sequence[str] | None = None,
        seed: int | None = None,
        ignore_eos: bool = False,
        logprobs: int | bool | None = None,
        skip_special_tokens: bool = True,
        response_format: Mapping[str, Any] | None = None,
        grammar: str | None = None,
        grammar_format: str | None = None,
        regex: str | None = None,
        choice: Sequence[str] | None = None,
        prompt_lookup_num_tokens: int | None = None,
        num_draft_tokens: int | None = None,
        adapters: _AdapterChoice | None = None,
    ) -> list[GenerationResult]: ...
    def fork(self) -> ModelRuntime: ...
    def unembed(self, x: npt.NDArray[np.float32]) -> npt.NDArray[np.float32]: ...
    @property
    def interventions(self) -> list[Intervention]: ...
    @interventions.setter
    def interventions(self, interventions: Sequence[Intervention] | None) -> None: ...
    def intervene(self, interventions: Sequence[Intervention]) -> InterventionScope: ...
    def load_control_vector(
        self, path: str | PathLike[str], scale: float = 1.0, layer_range: tuple[int, int] | None = None
    ) -> list[Intervention]: ...
    def observation_points(self) -> list[str]: ...
    def load_adapter(self, path: str | PathLike[str], name: str | None = None, scale: float = 1.0, merge: bool = False) -> dict[str, Any]: ...
    def unload_adapter(self, name: str) -> None: ...
    def loaded_adapters(self) -> list[dict[str, Any]]: ...
    @property
    def adapters(self) -> list[dict[str, Any]]: ...
    @property
    def active_adapters(self) -> dict[str, float]: ...
    def set_adapters(self, adapters: _AdapterChoice | None = None) -> None: ...
    def attach_sae(
        self, path: str | PathLike[str], point: str | None = None, name: str | None = None
    ) -> dict[str, Any]: ...
    def detach_sae(self, name: str) -> bool: ...
    def saes(self) -> list[dict[str, Any]]: ...
    def top_features(self, text: str | Sequence[int], sae: str, k: int = 10) -> list[dict[str, Any]]: ...
    def collect_batch(
        self, documents: Sequence[Sequence[int]], request: ObservationRequest
    ) -> list[ObservationSet]: ...
    def last_layer_needed(self, request: ObservationRequest) -> int | None: ...
    def embed(
        self,
        texts: str | Sequence[str] | Sequence[int] | Sequence[Sequence[int]],
        pooling: str | None = None,
        normalize: bool | None = None,
        dimensions: int | None = None,
        prompt_name: str | None = None,
        prompt: str | None = None,
    ) -> npt.NDArray[np.float32]: ...
    def rerank(
        self, query: str, documents: Sequence[str], top_n: int | None = None, instruction: str | None = None
    ) -> list[dict[str, Any]]: ...
    def embedding_info(self) -> dict[str, Any]: ...
    @property
    def tokenizer(self) -> Tokenizer: ...
    def cached_tokens(self) -> list[int]: ...
    @overload
    def generate(
        self,
        prompt: str | Sequence[int],
        *,
        stream: Literal[False] = False,
        images: Sequence[Any] | None = None,
        pixel_values: Any | None = None,
        max_tokens: int | None = 256,
        temperature: float | None = None,
        top_k: int | None = None,
        top_p: float | None = None,
        min_p: float | None = None,
        repetition_penalty: float | None = None,
        presence_penalty: float | None = None,
        frequency_penalty: float | None = None,
        logit_bias: Mapping[int, float] | None = None,
        stop: str | Sequence[str] | None = None,
        seed: int | None = None,
        ignore_eos: bool = False,
        logprobs: int | bool | None = None,
        skip_special_tokens: bool = True,
        response_format: Mapping[str, Any] | None = None,
        grammar: str | None = None,
        grammar_format: str | None = None,
        regex: str | None = None,
        choice: Sequence[str] | None = None,
        prompt_lookup_num_tokens: int | None = None,
        num_draft_tokens: int | None = None,
        adapters: _AdapterChoice | None = None,
    ) -> GenerationResult: ...
    @overload
    def generate(
        self,
        prompt: str | Sequence[int],
        *,
        stream: Literal[True],
        images: Sequence[Any] | None = None,
        pixel_values: Any | None = None,
        max_tokens: int | None = 256,
        temperature: float | None = None,
        top_k: int | None = None,
        top_p: float | None = None,
        min_p: float | None = None,
        repetition_penalty: float | None = None,
        presence_penalty: float | None = None,
        frequency_penalty: float | None = None,
        logit_bias: Mapping[int, float] | None = None,
        stop: str | Sequence[str] | None = None,
        seed: int | None = None,
        ignore_eos: bool = False,
        logprobs: int | bool | None = None,
        skip_special_tokens: bool = True,
        response_format: Mapping[str, Any] | None = None,
        grammar: str | None = None,
        grammar_format: str | None = None,
        regex: str | None = None,
        choice: Sequence[str] | None = None,
        prompt_lookup_num_tokens: int | None = None,
        num_draft_tokens: int | None = None,
        adapters: _AdapterChoice | None = None,
    ) -> GenerationStream: ...
    def stream(
        self,
        prompt: str | Sequence[int],
        *,
        images: Sequence[Any] | None = None,
        pixel_values: Any | None = None,
        max_tokens: int | None = 256,
        temperature: float | None = None,
        top_k: int | None = None,
        top_p: float | None = None,
        min_p: float | None = None,
        repetition_penalty: float | None = None,
        presence_penalty: float | None = None,
        frequency_penalty: float | None = None,
        logit_bias: Mapping[int, float] | None = None,
        stop: str | Sequence[str] | None = None,
        seed: int | None = None,
        ignore_eos: bool = False,
        logprobs: int | bool | None = None,
        skip_special_tokens: bool = True,
        response_format: Mapping[str, Any] | None = None,
        grammar: str | None = None,
        grammar_format: str | None = None,
        regex: str | None = None,
        choice: Sequence[str] | None = None,
        prompt_lookup_num_tokens: int | None = None,
        num_draft_tokens: int | None = None,
        adapters: _AdapterChoice | None = None,
    ) -> GenerationStream: ...
    @overload
    def chat(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        stream: Literal[False] = False,
        chat_template: str | None = None,
        tools: Sequence[Mapping[str, Any]] | None = None,
        tool_choice: str | Mapping[str, Any] | None = None,
        parallel_tool_calls: bool = True,
        tool_call_format: str | None = None,
        max_tokens: int | None = 256,
        temperature: float | None = None,
        top_k: int | None = None,
        top_p: float | None = None,
        min_p: float | None = None,
        repetition_penalty: float | None = None,
        presence_penalty: float | None = None,
        frequency_penalty: float | None = None,
        logit_bias: Mapping[int, float] | None = None,
        stop: str | Sequence[str] | None = None,
        seed: int | None = None,
        ignore_eos: bool = False,
        logprobs: int | bool | None = None,
        skip_special_tokens: bool = True,
        response_format: Mapping[str, Any] | None = None,
        grammar: str | None = None,
        grammar_format: str | None = None,
        regex: str | None = None,
        choice: Sequence[str] | None = None,
        prompt_lookup_num_tokens: int | None = None,
        num_draft_tokens: int | None = None,
        adapters: _AdapterChoice | None = None,
    ) -> GenerationResult: ...
    @overload
    def chat(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        stream: Literal[True],
        chat_template: str | None = None,
        tools: Sequence[Mapping[str, Any]] | None = None,
        tool_choice: str | Mapping[str, Any] | None = None,
        parallel_tool_calls: bool = True,
        tool_call_format: str | None = None,
        max_tokens: int | None = 256,
        temperature: float | None = None,
        top_k: int | None = None,
        top_p: float | None = None,
        min_p: float | None = None,
        repetition_penalty: float | None = None,
        presence_penalty: float | None = None,
        frequency_penalty: float | None = None,
        logit_bias: Mapping[int, float] | None = None,
        stop: str | Sequence[str] | None = None,
        seed: int | None = None,
        ignore_eos: bool = False,
        logprobs: int | bool | None = None,
        skip_special_tokens: bool = True,
        response_format: Mapping[str, Any] | None = None,
        grammar: str | None = None,
        grammar_format: str | None = None,
        regex: str | None = None,
        choice: Sequence[str] | None = None,
        prompt_lookup_num_tokens: int | None = None,
        num_draft_tokens: int | None = None,
        adapters: _AdapterChoice | None = None,
    ) -> GenerationStream: ...
