"""An OpenAI-compatible HTTP server over the engine (docs/server.md), on Starlette.

Routes: ``GET /health``, ``GET /v1/models``, ``POST /v1/completions``,
``POST /v1/chat/completions`` (both with ``stream: true`` as server-sent events ending in
``[DONE]``), ``POST /v1/embeddings`` and ``POST /v1/rerank`` (embeddings.py), ``GET /metrics``
(Prometheus text). The request body may carry candlewick's
extensions: ``interventions`` (docs/interventions.md as JSON), ``sae_edits`` (feature edits of
an SAE attached at start, by its name), ``control_vector`` (a name
loaded at start, with a scale) and ``observe`` (point names: the prompt's activations come back
under a ``candlewick`` key as base64 float32 with their shape).
"""

from __future__ import annotations

import asyncio
import base64
import json
import os
from contextlib import asynccontextmanager
import time
import uuid
import weakref
from dataclasses import dataclass, field
from typing import Any, Optional

import numpy as np
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.routing import Route

from .. import (
    CandlewickError,
    ContextFullError,
    Engine,
    GenerationOptionError,
    InvalidInterventionError,
    ModelRuntime,
    ObservationError,
    ObservationRequest,
    QueueFullError,
    TokenizerError,
    TokenOutOfRangeError,
)
from .. import interventions as iv
from ..images import ImageError
from .images import ImagePolicy, request_images

MAX_BODY_BYTES = 8 << 20


class ApiError(Exception):
    """An error answered the OpenAI way: ``{"error": {"message", "type", "param", "code"}}``."""

    def __init__(self, status: int, message: str, type_: str = "invalid_request_error",
                 param: Optional[str] = None, code: Optional[str] = None, headers: Optional[dict] = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code
        self.headers = headers or {}

    def response_body(self) -> dict:
        """The JSON body of the answer."""
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        """The answer: the body, the status and the headers."""
        return JSONResponse(self.response_body(), status_code=self.status, headers=self.headers)


def api_error_of(e: Exception) -> ApiError:
    """The HTTP answer for an exception raised while serving a request."""
    if isinstance(e, ApiError):
        return e
    if isinstance(e, QueueFullError):
        # The server is saturated, not the client over a quota: 503, as load balancers and the
        # `openai` client read it (retry, after the delay the header gives).
        return ApiError(503, f"the server is at capacity ({e}); retry later", "server_error", code="queue_full",
                        headers={"Retry-After": "1"})
    if isinstance(e, ImageError):  # a bad, missing or unfetchable image: the client's to fix
        return ApiError(400, str(e), param="messages", code="invalid_image")
    if isinstance(e, ContextFullError):
        return ApiError(400, str(e), param="max_tokens", code="context_length_exceeded")
    if isinstance(e, (GenerationOptionError, InvalidInterventionError, TokenOutOfRangeError, ObservationError,
                      TokenizerError, ValueError, TypeError)):
        return ApiError(400, str(e))
    if isinstance(e, CandlewickError):
        return ApiError(500, str(e), "server_error")
    return ApiError(500, f"internal error: {type(e).__name__}: {e}", "server_error")


@dataclass
class Metrics:
    """Counters and sums behind ``/metrics``."""

    requests: dict = field(default_factory=dict)
    prompt_tokens: int = 0
    completion_tokens: int = 0
    ttft_sum: float = 0.0
    ttft_count: int = 0
    token_latency_sum: float = 0.0
    token_latency_count: int = 0
    timeouts: int = 0
    disconnects: int = 0
    cached_tokens: int = 0
    # /v1/embeddings: the requests answered and the `embed` calls that answered them (fewer
    # when concurrent requests were batched).
    embedding_requests: int = 0
    embedding_batches: int = 0

    def count(self, route: str, status: int) -> None:
        key = (route, status)
        self.requests[key] = self.requests.get(key, 0) + 1

    def record(self, usage: dict) -> None:
        self.prompt_tokens += usage["prompt_tokens"]
        self.completion_tokens += usage["completion_tokens"]
        self.cached_tokens += usage.get("cached_tokens", 0)
        self.ttft_sum += usage["time_to_first_token"]
        self.ttft_count += 1
        if usage["completion_tokens"] > 1:
            self.token_latency_sum += usage["decode_seconds"]
            self.token_latency_count += usage["completion_tokens"] - 1


# The request fields each endpoint honours (OpenAI's, llama-cpp-python's sampling extensions,
# vLLM's skip_special_tokens and candlewick's own); any other field is a 400 naming it, never
# silently ignored. A field sent as null counts as absent.
COMMON_FIELDS = {
    "model", "max_tokens", "temperature", "top_p", "seed", "presence_penalty", "frequency_penalty", "stop",
    "logit_bias", "logprobs", "n", "stream", "stream_options", "response_format", "user",
    "top_k", "min_p", "repeat_penalty", "ignore_eos", "skip_special_tokens",
    "interventions", "control_vector", "observe", "prompt_lookup_num_tokens", "num_draft_tokens",
    "sae_edits", "adapters",
    "grammar", "grammar_format",
}
FIELDS = {
    "completions": COMMON_FIELDS | {"prompt"},
    "chat_completions": COMMON_FIELDS | {"messages", "max_completion_tokens", "top_logprobs", "tools", "tool_choice",
                                         "parallel_tool_calls"},
}


# `stream_options` keys the server honours; OpenAI's others (`include_obfuscation`, ...) are a 400.
STREAM_OPTIONS = {"include_usage"}
# The longest `user` accepted: it is written to the request log, which a client must not flood.
MAX_USER_CHARS = 256


def refuse_unknown(body: dict, honoured, where: str = "") -> None:
    """A 400 naming the fields of `body` (an object at `where` in the request) not in `honoured`;
    a field sent as null counts as absent."""
    unknown = sorted(k for k, v in body.items() if v is not None and k not in honoured)
    if unknown:
        names = ", ".join(repr(where + k) for k in unknown)
        raise ApiError(400, f"unsupported field{'s' if len(unknown) > 1 else ''} {names}: "
                       "this server does not honour it", param=where + unknown[0], code="unsupported_field")


def check_fields(body: dict, route: str) -> None:
    """Refuses a field the server does not honour (OpenAI's `best_of`, `echo`, `suffix`,
    `audio`, `prediction`, ...) with a 400 naming it, and a known field given where it would do
    nothing (`stream_options` without `stream`, an unknown `stream_options` key, `top_logprobs`
    without `logprobs`, `parallel_tool_calls` without `tools`), as OpenAI refuses them."""
    refuse_unknown(body, FIELDS[route])
    options = body.get("stream_options")
    if options is not None:
        if not isinstance(options, dict):
            raise ApiError(400, "stream_options must be an object", param="stream_options")
        stray = sorted(set(options) - STREAM_OPTIONS)
        if stray:
            raise ApiError(400, f"stream_options: unsupported key{'s' if len(stray) > 1 else ''} "
                           f"{', '.join(map(repr, stray))} (this server honours {sorted(STREAM_OPTIONS)})",
                           param="stream_options", code="unsupported_field")
        if not body.get("stream"):
            raise ApiError(400, "stream_options is only allowed with stream: true", param="stream_options")
    if body.get("top_logprobs") is not None and not body.get("logprobs"):
        raise ApiError(400, "top_logprobs needs logprobs: true", param="top_logprobs")
    if body.get("parallel_tool_calls") is not None and body.get("tools") is None:
        raise ApiError(400, "parallel_tool_calls is only allowed with tools", param="parallel_tool_calls")
    user = body.get("user")
    if user is not None and (not isinstance(user, str) or len(user) > MAX_USER_CHARS):
        raise ApiError(400, f"user must be a string of at most {MAX_USER_CHARS} characters", param="user")


SAMPLING = {
    "max_tokens": "max_tokens", "temperature": "temperature", "top_p": "top_p", "seed": "seed",
    "presence_penalty": "presence_penalty", "frequency_penalty": "frequency_penalty", "stop": "stop",
    # llama-cpp-python's extensions.
    "top_k": "top_k", "min_p": "min_p", "repeat_penalty": "repetition_penalty", "ignore_eos": "ignore_eos",
    # vLLM's: control tokens (special tokens, markup such as <start_of_image>) in the text or not.
    "skip_special_tokens": "skip_special_tokens",
    # Constrained output (JSON object or schema), checked by the engine before any step.
    "response_format": "response_format",
    # llama-server's `grammar` (GBNF; Lark is taken too, detected unless `grammar_format` says).
    "grammar": "grammar", "grammar_format": "grammar_format",
    # Speculative decoding (used while a request runs alone; output unchanged either way).
    "prompt_lookup_num_tokens": "prompt_lookup_num_tokens", "num_draft_tokens": "num_draft_tokens",
}


def sae_edits(items: list) -> list:
    """``sae_edits``: ``{"sae": NAME, "op": "steer"|"clamp"|"ablate"|"splice", ...}`` as
    ``candlewick.interventions.sae_*`` takes them (``feature``/``scale``, ``features``/``value``,
    ``features``, ``keep_error``; ``positions`` optional)."""
    edits = []
    for k, e in enumerate(items):
        try:
            op, name, pos = e["op"], e["sae"], e.get("positions")
            if op == "steer":
                edits.append(iv.sae_steer(name, e["feature"], e["scale"], positions=pos))
            elif op == "clamp":
                edits.append(iv.sae_clamp(name, e["features"], e["value"], positions=pos))
            elif op == "ablate":
                edits.append(iv.sae_ablate(name, e["features"], positions=pos))
            elif op == "splice":
                edits.append(iv.sae_splice(name, e.get("keep_error", True), positions=pos))
            else:
                raise ApiError(400, f"sae_edits[{k}]: unknown op `{op}` (steer, clamp, ablate, splice)",
                               param="sae_edits")
        except (KeyError, TypeError, ValueError) as err:
            raise ApiError(400, f"sae_edits[{k}] is malformed: {err}", param="sae_edits") from None
    return edits


class Server:
    """The state of one server: the engine, the model's name, control vectors, metrics.

    `request_timeout` (seconds; 0 or None: none) bounds each request from its arrival to its
    last byte: past it the request is cancelled in the engine and answered 504 (or, once its
    stream has begun, ended with an error event). `prefill_chunk` and `prefix_cache_bytes` are
    the engine's (`candlewick.Engine`), as are `prefix_cache_dir` and `prefix_cache_disk_bytes`."""

    def __init__(self, runtime: ModelRuntime, model_name: str, api_key: Optional[str] = None,
                 max_batch_size: int = 8, max_queue: int = 64,
                 control_vectors: Optional[dict[str, list]] = None, chat_template: Optional[str] = None, log=None,
                 request_timeout: Optional[float] = 600.0, prefill_chunk: Optional[int] = 128,
                 prefix_cache_bytes: int = 256 << 20, image_policy: Optional[ImagePolicy] = None,
                 prefix_cache_dir: Optional[str] = None, prefix_cache_disk_bytes: int = 4 << 30):
        if request_timeout is not None and request_timeout < 0:
            raise ValueError("request_timeout must be positive, or 0 or None for none")
        self.request_timeout = request_timeout or None
        self.runtime = runtime
        self.model_name = model_name
        self.api_key = api_key
        self.engine = Engine(runtime, max_batch_size=max_batch_size, max_queue=max_queue,
                             prefill_chunk=prefill_chunk, prefix_cache_bytes=prefix_cache_bytes,
                             prefix_cache_dir=prefix_cache_dir, prefix_cache_disk_bytes=prefix_cache_disk_bytes)
        self.control_vectors = control_vectors or {}
        self.chat_template = chat_template
        self.metrics = Metrics()
        self.created = int(time.time())
        self.log = log
        # The engine requests of the HTTP requests being answered, for `cancel_all`; weak, so
        # a request answered (or abandoned) leaves it by itself.
        self.inflight: weakref.WeakSet = weakref.WeakSet()
        self.shutting_down = False
        # Chat image parts: data: URLs always, http(s) URLs only as the policy allows.
        self.image_policy = image_policy or ImagePolicy()

    def cancel_all(self) -> None:
        """Cancels every request in flight, at the end of a shutdown's grace period: each is
        then answered 503 (or its stream ends with an error event) and the server can stop."""
        self.shutting_down = True
        for r in list(self.inflight):
            r.cancel()

    def shutdown_error(self) -> ApiError:
        """The answer to a request cancelled by `cancel_all`."""
        return ApiError(503, "the server shut down before the request finished", "server_error",
                        code="shutting_down")

    def deadline(self) -> Optional[float]:
        """When a request arriving now must be done by (`time.monotonic()`), or None."""
        return None if self.request_timeout is None else time.monotonic() + self.request_timeout

    def timeout_error(self) -> ApiError:
        """The answer to a request that ran past `request_timeout`."""
        self.metrics.timeouts += 1
        return ApiError(504, f"the request ran past the server's limit of {self.request_timeout:g} s "
                        "(--request-timeout) and was cancelled", "timeout_error", code="request_timeout")

    async def guard(self, request: Request, work, reqs: list, deadline: Optional[float]):
        """Awaits `work` (a coroutine over the engine requests `reqs`) unless the client
        disconnects or the deadline passes first: then `reqs` are cancelled at once, freeing
        their slots, and the ApiError to answer is raised (499 for a client that went away, as
        nginx logs it; 504 past the deadline)."""
        work = asyncio.ensure_future(work)
        gone = asyncio.ensure_future(client_gone(request))
        try:
            done, _ = await asyncio.wait({work, gone}, timeout=seconds_left(deadline),
                                         return_when=asyncio.FIRST_COMPLETED)
            if work in done:
                return work.result()
        finally:
            work.cancel()
            gone.cancel()
        # Not waiting for the engine to acknowledge: a cancelled request still in the queue
        # only leaves it when a slot frees, and the client should not wait for that.
        for r in reqs:
            r.cancel()
        if gone in done:
            self.metrics.disconnects += 1
            raise ApiError(499, "the client closed the connection", code="client_closed_request")
        raise self.timeout_error()

    async def started(self, request: Request, reqs: list, deadline: Optional[float]) -> None:
        """Waits (under `guard`) for each of a streamed request's first event: until its first
        token a request may still be refused, time out or be abandoned while queued, all
        answered as plain HTTP errors; then its requests are cancelled."""
        try:
            await self.guard(request, started_all(reqs), reqs, deadline)
            if any(r.cancelled for r in reqs):  # by a shutdown
                raise self.shutdown_error()
        except BaseException:
            for r in reqs:
                r.cancel()
            raise

    # -- request parsing -------------------------------------------------------------------

    def check_key(self, request: Request) -> None:
        if self.api_key is None:
            return
        # OpenAI's clients send the key as a bearer token, Anthropic's as `x-api-key`.
        if (request.headers.get("authorization", "") != f"Bearer {self.api_key}"
                and request.headers.get("x-api-key") != self.api_key):
            raise ApiError(401, "missing or wrong API key", "authentication_error", code="invalid_api_key")

    async def body_within(self, request: Request, deadline: Optional[float]) -> dict:
        """The request's JSON body (`body`), held to the request's deadline: a client slow to
        send it is answered 408 (a slow-loris would otherwise keep a connection forever)."""
        try:
            return await within(self.body(request), deadline)
        except asyncio.TimeoutError:
            raise ApiError(408, "the request body did not arrive within the server's limit",
                           code="request_timeout") from None

    async def body(self, request: Request) -> dict:
        ctype = request.headers.get("content-type", "")
        if not ctype.split(";")[0].strip().lower() == "application/json":
            raise ApiError(415, f"the body must be application/json, not {ctype or 'missing'}")
        length = request.headers.get("content-length")
        if length is not None and length.isdigit() and int(length) > MAX_BODY_BYTES:
            raise ApiError(413, f"the body is over {MAX_BODY_BYTES} bytes", code="body_too_large")
        raw = b""
        async for chunk in request.stream():
            raw += chunk
            if len(raw) > MAX_BODY_BYTES:
                raise ApiError(413, f"the body is over {MAX_BODY_BYTES} bytes", code="body_too_large")
        try:
            body = json.loads(raw)
        except (ValueError, UnicodeDecodeError) as e:
            raise ApiError(400, f"the body is not valid JSON: {e}") from None
        if not isinstance(body, dict):
            raise ApiError(400, "the body must be a JSON object")
        model = body.get("model")
        if model is not None and model not in self.model_ids():
            raise ApiError(404, f"the model `{model}` does not exist; this server serves {', '.join(self.model_ids())}",
                           code="model_not_found", param="model")
        return body

    def model_ids(self) -> list:
        """The names requests may give as `model`: the base model, and `base:ADAPTER` for each
        LoRA adapter loaded (``serve --lora NAME=PATH``), as vLLM lists its LoRA modules."""
        return [self.model_name] + [f"{self.model_name}:{a['name']}" for a in self.runtime.loaded_adapters()]

    def adapters(self, body: dict) -> Optional[dict]:
        """The request's LoRA adapters: ``"adapters": {name: scale}`` (candlewick's extension), or
        the adapter its `model` names (``base:NAME``); None: the base model."""
        loaded = {a["name"] for a in self.runtime.loaded_adapters()}
        given = body.get("adapters")
        if given is not None:
            if not isinstance(given, dict) or not all(
                    isinstance(k, str) and (v is None or isinstance(v, (int, float))) for k, v in given.items()):
                raise ApiError(400, "adapters must be an object {name: scale}", param="adapters")
            unknown = sorted(set(given) - loaded)
            if unknown:
                raise ApiError(400, f"unknown adapter(s) {unknown} (loaded: {sorted(loaded)})", param="adapters")
            return dict(given)
        model = body.get("model")
        prefix = f"{self.model_name}:"
        if isinstance(model, str) and model.startswith(prefix) and model[len(prefix):] in loaded:
            return {model[len(prefix):]: None}
        return None

    def sampling(self, body: dict) -> dict:
        kw: dict[str, Any] = {}
        for key, name in SAMPLING.items():
            if body.get(key) is not None:
                kw[name] = body[key]
        if "max_tokens" in kw and (not isinstance(kw["max_tokens"], int) or kw["max_tokens"] < 0):
            raise ApiError(400, "max_tokens must be a non-negative integer", param="max_tokens")
        if body.get("max_tokens") is None and body.get("max_completion_tokens") is not None:
            kw["max_tokens"] = body["max_completion_tokens"]
        if "max_tokens" not in kw:
            kw["max_tokens"] = 16 if "messages" not in body else 256
        adapters = self.adapters(body)
        if adapters is not None:
            kw["adapters"] = adapters
        bias = body.get("logit_bias")
        if bias:
            try:
                kw["logit_bias"] = {int(k): float(v) for k, v in bias.items()}
            except (AttributeError, ValueError, TypeError):
                raise ApiError(400, "logit_bias must map token ids to numbers", param="logit_bias") from None
        lp = body.get("logprobs")
        if lp:
            if "messages" in body:  # chat: logprobs is a flag, top_logprobs the count
                top = body.get("top_logprobs") or 0
            else:  # completions: logprobs is the count
                top = lp
            if isinstance(top, bool) or not isinstance(top, int) or not 0 <= top <= 20:
                raise ApiError(400, "the number of top logprobs must be an integer from 0 to 20", param="logprobs")
            kw["logprobs"] = top
        return kw

    def tools(self, body: dict, kw: dict) -> Optional[ToolRequest]:
        """A chat request's `tools`, `tool_choice` and `parallel_tool_calls`: the prompt rendered
        with the tools and, for "required" or a named function, the grammar of a call added to
        `kw`; None without tools."""
        tools = body.get("tools")
        if tools is None:
            if body.get("tool_choice") not in (None, "none", "auto"):
                raise ApiError(400, "tool_choice needs tools", param="tool_choice")
            return None
        if not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools):
            raise ApiError(400, "tools must be a list of tool objects", param="tools")
        choice = body.get("tool_choice") or "auto"
        tok = self.runtime.tokenizer
        grammar = tok.tool_call_grammar(tools, choice, body.get("parallel_tool_calls") is not False,
                                        chat_template=self.chat_template) if choice not in ("auto", "none") else None
        if grammar is not None:
            for given in ("response_format", "grammar"):
                if given in kw:
                    raise ApiError(400, "tool_choice \"required\" or a named function constrains the output: "
                                   f"{given} cannot be given with it", param=given)
            kw["grammar"] = grammar
        ids = tok.apply_chat_template(body["messages"], tools=tools, chat_template=self.chat_template,
                                      add_generation_prompt=True)
        return ToolRequest(prompt=list(ids), runtime=self.runtime, template=self.chat_template,
                           parsed=choice != "none")

    def piece(self, token: int) -> str:
        return self.runtime.tokenizer.decode([token])

    def logprobs_of(self, result, chat: bool) -> Optional[dict]:
        """A result's log-probabilities in the OpenAI shape of the endpoint."""
        if result.logprobs is None:
            return None
        return self.logprobs_json(result.logprobs, chat)

    def logprobs_json(self, entries: list, chat: bool, offset: int = 0) -> dict:
        """Log-probability entries (``GenerationResult.logprobs``) in the OpenAI shape: chat's
        ``{"content": [...]}`` or completions' parallel lists, text offsets counted from
        ``offset`` (where these tokens start in the completion)."""
        if chat:
            def entry(tok, lp):
                text = self.piece(tok)
                return {"token": text, "logprob": lp, "bytes": list(text.encode())}
            return {"content": [{**entry(e["token"], e["logprob"]),
                                 "top_logprobs": [entry(t, lp) for t, lp in e["top_logprobs"]]}
                                for e in entries]}
        tokens = [self.piece(e["token"]) for e in entries]
        offsets, at = [], offset
        for t in tokens:
            offsets.append(at)
            at += len(t)
        return {"tokens": tokens, "token_logprobs": [e["logprob"] for e in entries],
                "top_logprobs": [{self.piece(t): lp for t, lp in e["top_logprobs"]} for e in entries],
                "text_offset": offsets}

    def interventions(self, body: dict) -> list:
        edits = []
        for k, e in enumerate(body.get("interventions") or []):
            try:
                op, point = e["op"], e["point"]
                pos = e.get("positions")
                if op == "add":
                    edits.append(iv.add(point, e["vector"], scale=e.get("scale", 1.0), positions=pos))
                elif op == "set":
                    edits.append(iv.set(point, e["values"], positions=pos))
                elif op == "scale":
                    edits.append(iv.scale(point, e["index"], e.get("factor", e.get("scale", 0.0)), positions=pos))
                elif op == "project_out":
                    edits.append(iv.project_out(point, e["direction"], positions=pos))
                else:
                    raise ApiError(400, f"interventions[{k}]: unknown op `{op}`", param="interventions")
            except (KeyError, TypeError, ValueError) as err:
                raise ApiError(400, f"interventions[{k}] is malformed: {err}", param="interventions") from None
        edits.extend(sae_edits(body.get("sae_edits") or []))
        cv = body.get("control_vector")
        if cv:
            name = cv if isinstance(cv, str) else cv.get("name")
            scale = 1.0 if isinstance(cv, str) else float(cv.get("scale", 1.0))
            if name not in self.control_vectors:
                raise ApiError(400, f"unknown control vector `{name}` (loaded: {sorted(self.control_vectors)})",
                               param="control_vector")
            for e in self.control_vectors[name]:
                edits.append(iv.add(e.point, e.values, scale=e.scale_factor * scale))
        return edits

    def observe(self, body: dict, prompt: Any, chat: bool) -> Optional[dict]:
        points = body.get("observe")
        if not points:
            return None
        if chat:
            ids = self.runtime.tokenizer.apply_chat_template(
                prompt, add_generation_prompt=True, tokenize=True, chat_template=self.chat_template)
        else:
            ids = self.runtime.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        edits = self.interventions(body)
        obs = self.runtime.trace(ids, ObservationRequest.exact(list(points)), edits,
                                 adapters=self.adapters(body)).observations
        out = {}
        for name in points:
            a = np.ascontiguousarray(obs[name], dtype=np.float32)
            out[name] = {"shape": list(a.shape), "dtype": "float32", "data": base64.b64encode(a.tobytes()).decode()}
        return {"observations": out}

    # -- generation ------------------------------------------------------------------------

    def submit_all(self, prompt: Any, chat: bool, kw: dict, edits: list, n: int, images: Optional[list] = None) -> list:
        """Submits the `n` choices of one request; if one is refused (a full queue), those
        already queued are cancelled, so a refused request holds no slot."""
        reqs = []
        try:
            for i in range(n):
                k = dict(kw)
                if n > 1 and "seed" in k and k["seed"] is not None:
                    k["seed"] = k["seed"] + i
                if chat:
                    k["chat_template"] = self.chat_template
                if images:
                    k["images"] = images
                reqs.append(self.engine.submit(prompt, interventions=edits, **k))
                self.inflight.add(reqs[-1])
        except BaseException:
            for r in reqs:
                r.cancel()
            raise
        return reqs


def seconds_left(deadline: Optional[float]) -> Optional[float]:
    """Seconds until `deadline` (never negative), or None for no deadline."""
    return None if deadline is None else max(0.0, deadline - time.monotonic())


async def within(aw, deadline: Optional[float]):
    """Awaits `aw`, raising TimeoutError once `deadline` has passed."""
    if deadline is None:
        return await aw
    return await asyncio.wait_for(aw, seconds_left(deadline))


async def client_gone(request: Request) -> None:
    """Returns when the client disconnects. Called once the body has been read: the server
    then has no other message for this request than the disconnect."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def started_all(reqs: list) -> None:
    """Waits until each request has its first event (see `EngineRequest.started`)."""
    for r in reqs:
        await r.started()


async def wait_all(reqs: list) -> list:
    """The results of the requests, in order (None for one that was cancelled)."""
    return [await r.wait_async() for r in reqs]


def usage_of(results) -> dict:
    prompt = results[0].usage["prompt_tokens"]
    completion = sum(r.usage["completion_tokens"] for r in results)
    # OpenAI's field for prompt tokens served from a cache: the first choice's reuse (the others
    # share its prompt).
    cached = results[0].usage["cached_tokens"]
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached}}


def tool_chunk(base: dict, call: dict) -> dict:
    """A chat chunk whose delta carries one tool-call fragment."""
    base["choices"][0]["delta"] = {"tool_calls": [call]}
    return base


@dataclass
class ToolRequest:
    """A chat request with `tools`: its prompt rendered with them, and how its answer is read."""

    prompt: list
    runtime: Any
    template: Optional[str]
    parsed: bool  # false for tool_choice "none": the answer is text

    def message(self, result) -> tuple:
        """The assistant message of `result` and its finish reason: its tool calls split out of
        the text (finish "tool_calls") when it made any."""
        if not self.parsed:
            return {"role": "assistant", "content": result.text}, finish(result)
        text, calls = self.runtime.tokenizer.parse_tool_calls(result.token_ids, chat_template=self.template)
        if not calls:
            return {"role": "assistant", "content": result.text}, finish(result)
        return {"role": "assistant", "content": text or None, "tool_calls": calls}, "tool_calls"


def finish(r) -> str:
    return "stop" if r.finish_reason in ("stop", "eos") else "length"


def build_app(server: Server) -> Starlette:
    """The Starlette application serving `server`'s engine."""

    async def handle(request: Request, route: str, fn, errors=None) -> Response:
        started = time.perf_counter()
        try:
            # Health and metrics stay open to probes and scrapers; the API needs the key.
            if request.url.path.startswith("/v1/"):
                server.check_key(request)
            response = await fn(request)
        except Exception as e:  # every failure becomes an error answer (OpenAI's shape unless the
            # route's API has its own); the server goes on
            response = (errors or ApiError.response)(api_error_of(e))
        # Which process answered: replicas (under Ray Serve) are told apart by it.
        response.headers["X-Candlewick-Replica"] = str(os.getpid())
        server.metrics.count(route, response.status_code)
        if server.log:
            # OpenAI's `user` (an end user's id, for abuse monitoring) is honoured by recording it
            # with the request, JSON-quoted so that no value can forge a log line.
            user = getattr(request.state, "user", None)
            server.log(f"{request.method} {request.url.path} {response.status_code} "
                       f"{(time.perf_counter() - started) * 1000:.0f} ms"
                       + (f" user={json.dumps(user)}" if user is not None else ""))
        return response

    async def completions(request: Request, chat: bool) -> Response:
        deadline = server.deadline()
        body = await server.body_within(request, deadline)
        check_fields(body, "chat_completions" if chat else "completions")
        request.state.user = body.get("user")
        if chat:
            prompt = body.get("messages")
            if not isinstance(prompt, list) or not prompt:
                raise ApiError(400, "messages must be a non-empty list", param="messages")
            # Image parts become the template's {"type": "image"}; the images go to the engine.
            prompt, images = await request_images(prompt, server.image_policy)
            for field_ in ("tools", "observe"):
                if images and body.get(field_) is not None:
                    raise ApiError(400, f"{field_} cannot be given with images yet", param=field_,
                                   code="unsupported_field")
        else:
            prompt = body.get("prompt")
            if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
                prompt = prompt[0]
            if not isinstance(prompt, (str, list)) or (isinstance(prompt, list) and
                                                       not all(isinstance(t, int) for t in prompt)):
                raise ApiError(400, "prompt must be a string or a list of token ids", param="prompt")
        kw = server.sampling(body)
        edits = server.interventions(body)
        n = body.get("n") or 1
        if not isinstance(n, int) or not 1 <= n <= 16:
            raise ApiError(400, "n must be an integer from 1 to 16", param="n")
        extension = server.observe(body, prompt, chat)
        tools = server.tools(body, kw) if chat else None
        if tools is not None:
            # The prompt is rendered here, with the tools; the engine gets its ids.
            prompt, chat = tools.prompt, False
        reqs = server.submit_all(prompt, chat, kw, edits, n, images=images if chat else None)
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        obj = "chat.completion" if chat else "text_completion"
        if body.get("stream"):
            await server.started(request, reqs, deadline)
            include_usage = bool((body.get("stream_options") or {}).get("include_usage"))
            return StreamingResponse(stream(reqs, rid, chat or tools is not None, include_usage, extension, deadline,
                                            tools), media_type="text/event-stream")
        try:
            results = await server.guard(request, wait_all(reqs), reqs, deadline)
        finally:
            # Also when this task is cancelled (a shutdown past its grace period).
            for r in reqs:
                r.cancel()
        if any(r is None for r in results):  # cancelled by a shutdown
            raise server.shutdown_error()
        for r in results:
            server.metrics.record(r.usage)
        if tools is not None:
            choices = []
            for i, r in enumerate(results):
                message, reason = tools.message(r)
                choices.append({"index": i, "message": message, "finish_reason": reason,
                                "logprobs": server.logprobs_of(r, True)})
        elif chat:
            choices = [{"index": i, "message": {"role": "assistant", "content": r.text},
                        "finish_reason": finish(r), "logprobs": server.logprobs_of(r, True)}
                       for i, r in enumerate(results)]
        else:
            choices = [{"index": i, "text": r.text, "finish_reason": finish(r),
                        "logprobs": server.logprobs_of(r, False)} for i, r in enumerate(results)]
        out = {"id": rid, "object": obj, "created": int(time.time()), "model": server.model_name,
               "choices": choices, "usage": usage_of(results)}
        if extension:
            out["candlewick"] = extension
        return JSONResponse(out)

    async def stream(reqs, rid, chat, include_usage, extension, deadline, tools=None):
        obj = "chat.completion.chunk" if chat else "text_completion"

        def chunk(i, text=None, reason=None, role=False, logprobs=None):
            if chat:
                delta = {"role": "assistant", "content": ""} if role else ({"content": text} if text else {})
                choice = {"index": i, "delta": delta, "finish_reason": reason, "logprobs": logprobs}
            else:
                choice = {"index": i, "text": text or "", "finish_reason": reason, "logprobs": logprobs}
            return {"id": rid, "object": obj, "created": int(time.time()), "model": server.model_name,
                    "choices": [choice]}

        def sse(data) -> str:
            return f"data: {json.dumps(data)}\n\n"

        try:
            if extension:
                head = chunk(0, role=chat) if chat else chunk(0)
                head["candlewick"] = extension
                yield sse(head)
            elif chat:
                for i in range(len(reqs)):
                    yield sse(chunk(i, role=True))
            results = []
            for i, r in enumerate(reqs):
                # Each piece carries the log-probabilities of the tokens behind it; tokens whose
                # text never became a piece (a stop string, an end of sequence) come with the end.
                sent, at = 0, 0
                pieces = r.__aiter__()
                while True:
                    try:
                        piece = await within(pieces.__anext__(), deadline)
                    except StopAsyncIteration:
                        break
                    except asyncio.TimeoutError:
                        # The status line is long sent: the error goes in the stream, where
                        # the `openai` client raises it, and the stream ends without [DONE].
                        yield sse(server.timeout_error().response_body())
                        return
                    lp = None
                    if r.logprobs is not None:
                        lp = server.logprobs_json(r.logprobs, chat, at)
                        sent += len(r.logprobs)
                    at += len(piece)
                    if tools is not None and tools.parsed:
                        continue  # held back: the answer may be tool calls, known at the end
                    yield sse(chunk(i, text=piece, logprobs=lp))
                if r.result is None:  # cancelled by a shutdown: say so, as for a timeout
                    yield sse(server.shutdown_error().response_body())
                    return
                results.append(r.result)
                server.metrics.record(r.result.usage)
                rest = r.result.logprobs[sent:] if r.result.logprobs is not None else []
                lp = server.logprobs_json(rest, chat, at) if rest else None
                reason = finish(r.result)
                if tools is not None and tools.parsed:
                    message, reason = tools.message(r.result)
                    if message["content"]:
                        yield sse(chunk(i, text=message["content"]))
                    # As OpenAI streams them: each call's id and name, then its arguments.
                    for k, call in enumerate(message.get("tool_calls") or []):
                        head = {"index": k, "id": call["id"], "type": "function",
                                "function": {"name": call["function"]["name"], "arguments": ""}}
                        yield sse(tool_chunk(chunk(i), head))
                        yield sse(tool_chunk(chunk(i), {"index": k, "function": {
                            "arguments": call["function"]["arguments"]}}))
                yield sse(chunk(i, reason=reason, logprobs=lp))
            if include_usage:
                last = {"id": rid, "object": obj, "created": int(time.time()), "model": server.model_name,
                        "choices": [], "usage": usage_of(results)}
                yield sse(last)
            yield "data: [DONE]\n\n"
        except (GeneratorExit, asyncio.CancelledError):
            # How Starlette stops the stream of a client that went away.
            server.metrics.disconnects += 1
            raise
        finally:
            # A client that went away cancels what it asked for and frees the slots.
            for r in reqs:
                r.cancel()

    async def models(request: Request) -> Response:
        return JSONResponse({"object": "list", "data": [
            {"id": name, "object": "model", "created": server.created, "owned_by": "candlewick"}
            for name in server.model_ids()]})

    async def health(request: Request) -> Response:
        return JSONResponse({"status": "ok"})

    async def metrics(request: Request) -> Response:
        m, s = server.metrics, server.engine.stats()
        lines = ["# TYPE candlewick_requests_total counter"]
        for (route, status), n in sorted(m.requests.items()):
            lines.append(f'candlewick_requests_total{{route="{route}",status="{status}"}} {n}')
        lines += [
            "# TYPE candlewick_prompt_tokens_total counter", f"candlewick_prompt_tokens_total {m.prompt_tokens}",
            "# TYPE candlewick_completion_tokens_total counter",
            f"candlewick_completion_tokens_total {m.completion_tokens}",
            "# TYPE candlewick_queue_depth gauge", f"candlewick_queue_depth {s.get('queued', 0)}",
            "# TYPE candlewick_batch_size gauge", f"candlewick_batch_size {s.get('running', 0)}",
            "# TYPE candlewick_time_to_first_token_seconds summary",
            f"candlewick_time_to_first_token_seconds_sum {m.ttft_sum}",
            f"candlewick_time_to_first_token_seconds_count {m.ttft_count}",
            "# TYPE candlewick_token_latency_seconds summary",
            f"candlewick_token_latency_seconds_sum {m.token_latency_sum}",
            f"candlewick_token_latency_seconds_count {m.token_latency_count}",
            "# TYPE candlewick_request_timeouts_total counter", f"candlewick_request_timeouts_total {m.timeouts}",
            "# TYPE candlewick_client_disconnects_total counter",
            f"candlewick_client_disconnects_total {m.disconnects}",
            "# TYPE candlewick_embedding_requests_total counter",
            f"candlewick_embedding_requests_total {m.embedding_requests}",
            "# TYPE candlewick_embedding_batches_total counter",
            f"candlewick_embedding_batches_total {m.embedding_batches}",
            # The engine's prefix reuse: prompt tokens not computed again (restored from the
            # prefix cache or still held by an idle session), over all prompt tokens started.
            "# TYPE candlewick_prefix_cache_prompt_tokens_total counter",
            f"candlewick_prefix_cache_prompt_tokens_total {s.get('prompt_tokens', 0)}",
            "# TYPE candlewick_prefix_cache_cached_tokens_total counter",
            f"candlewick_prefix_cache_cached_tokens_total {s.get('cached_tokens', 0)}",
            "# TYPE candlewick_prefix_cache_hits_total counter",
            f"candlewick_prefix_cache_hits_total {s.get('prefix_hits', 0)}",
            "# TYPE candlewick_prefix_cache_hit_rate gauge",
            f"candlewick_prefix_cache_hit_rate {s.get('cached_tokens', 0) / max(s.get('prompt_tokens', 0), 1):.6f}",
            "# TYPE candlewick_prefix_cache_bytes gauge",
            f"candlewick_prefix_cache_bytes {s.get('prefix_cache_bytes', 0)}",
            "# TYPE candlewick_prefix_cache_evictions_total counter",
            f"candlewick_prefix_cache_evictions_total {s.get('prefix_cache_evictions', 0)}",
            # The disk tier (--prefix-cache-dir): blocks read back, written, files refused.
            "# TYPE candlewick_prefix_disk_bytes gauge", f"candlewick_prefix_disk_bytes {s.get('prefix_disk_bytes', 0)}",
            "# TYPE candlewick_prefix_disk_loaded_blocks_total counter",
            f"candlewick_prefix_disk_loaded_blocks_total {s.get('prefix_disk_loaded', 0)}",
            "# TYPE candlewick_prefix_disk_written_blocks_total counter",
            f"candlewick_prefix_disk_written_blocks_total {s.get('prefix_disk_written', 0)}",
            "# TYPE candlewick_prefix_disk_skipped_files_total counter",
            f"candlewick_prefix_disk_skipped_files_total {s.get('prefix_disk_skipped', 0)}",
        ]
        return PlainTextResponse("\n".join(lines) + "\n", media_type="text/plain; version=0.0.4")

    def route(path, fn, methods, name, errors=None):
        async def endpoint(request: Request) -> Response:
            return await handle(request, name, fn, errors)
        return Route(path, endpoint, methods=methods)

    # The APIs that speak chat in other shapes, over the same chat path (turns.py).
    from .embeddings import embeddings_routes
    from .messages import messages_routes
    from .responses import responses_routes

    routes = [
        route("/health", health, ["GET"], "health"),
        route("/v1/models", models, ["GET"], "models"),
        route("/v1/completions", lambda r: completions(r, False), ["POST"], "completions"),
        route("/v1/chat/completions", lambda r: completions(r, True), ["POST"], "chat_completions"),
        route("/metrics", metrics, ["GET"], "metrics"),
        *responses_routes(server, route),
        *messages_routes(server, route),
        *embeddings_routes(server, route),
    ]
    @asynccontextmanager
    async def lifespan(app):
        yield
        server.engine.close()

    app = Starlette(routes=routes, lifespan=lifespan)
    app.state.server = server
    return app
