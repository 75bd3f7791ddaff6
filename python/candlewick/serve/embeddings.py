"""``POST /v1/embeddings`` (OpenAI's shape) and ``POST /v1/rerank`` (the Jina/Cohere shape
llama-server and vLLM accept), over ``ModelRuntime.embed`` and ``ModelRuntime.rerank``
(docs/embeddings.md).

Embeddings: ``input`` as a string, a list of strings, a list of token ids or a list of such
lists; ``encoding_format`` ``float`` or ``base64`` (little-endian float32, as OpenAI's); 
``dimensions`` (Matryoshka truncation, then normalisation); candlewick's ``prompt_name`` /
``prompt`` (the model's query/document prompts). Rerank: ``query``, ``documents`` (strings, or
``{"text": ...}`` objects), ``top_n``, ``return_documents``, candlewick's ``instruction``. Any
other field is a 400 naming it. The work runs in a thread beside the engine (its own fresh
contexts over the shared weights); the runtime's lock serialises these requests. Concurrent
embedding requests are batched (`EmbeddingBatcher`): while one ``embed`` call runs, those that
arrive wait, and the next call embeds them together.
"""

from __future__ import annotations

import asyncio
import base64
from typing import Any, Optional

import numpy as np
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from .app import ApiError, Server, refuse_unknown

EMBEDDING_FIELDS = {"model", "input", "encoding_format", "dimensions", "user", "prompt_name", "prompt"}
RERANK_FIELDS = {"model", "query", "documents", "top_n", "return_documents", "instruction"}


def embedding_inputs(value: Any) -> list:
    """OpenAI's `input` as a list of inputs (strings or token-id lists)."""

    def ids(v) -> bool:
        return isinstance(v, list) and bool(v) and all(isinstance(t, int) and not isinstance(t, bool) for t in v)

    if isinstance(value, str):
        return [value]
    if ids(value):
        return [value]
    if isinstance(value, list) and value and all(isinstance(v, str) or ids(v) for v in value):
        return value
    raise ApiError(400, "input must be a string, a list of strings, a list of token ids or a list of such lists "
                   "(none empty)", param="input")


def token_count(runtime, item, kw: dict) -> int:
    """The tokens `item` runs as: its ids, or its text after the prompt with the special tokens,
    at most the model's `max_seq_length` (what `embed` computes over)."""
    info = runtime.embedding_info()
    if isinstance(item, list):
        n = len(item)
    else:
        prompt = kw.get("prompt")
        name = kw.get("prompt_name") or info["default_prompt_name"]
        if prompt is None and name is not None:
            prompt = info["prompts"].get(name, "")
        n = len(runtime.tokenizer.encode((prompt or "") + item, True))
    limit = info["max_seq_length"]
    return n if limit is None else min(n, limit)


class EmbeddingBatcher:
    """Gathers concurrent embedding requests into one ``embed`` call, as vLLM batches its pooling
    requests: while a call runs, the requests that arrive wait, and the next call takes every
    waiting request with the same options (``dimensions``, ``prompt_name``, ``prompt``), up to
    ``max_inputs`` inputs, so an encoder multiplies each weight once for all of them (one product
    per weight per batch, and an input's vector does not depend on its batch: the inputs are
    never padded). A call that fails is repeated request by request, so a bad input fails its own
    request only; a request whose client has gone is dropped before its call."""

    def __init__(self, runtime, metrics, max_inputs: int = 256):
        self.runtime = runtime
        self.metrics = metrics
        self.max_inputs = max_inputs
        self.pending: list = []
        self.worker: Optional[asyncio.Task] = None

    async def embed(self, inputs: list, options: dict) -> np.ndarray:
        """The vectors of `inputs` (one request's), embedded with `options` beside the other
        requests waiting."""
        future = asyncio.get_running_loop().create_future()
        self.pending.append((inputs, options, future))
        if self.worker is None or self.worker.done():
            self.worker = asyncio.create_task(self._drain())
        return await future

    async def _drain(self) -> None:
        while self.pending:
            await self._run(self._take())

    def _take(self) -> list:
        """The next batch: the oldest request, and the later ones with its options that fit."""
        key = sorted(self.pending[0][1].items())
        batch: list = []
        rest: list = []
        count = 0
        for item in self.pending:
            if sorted(item[1].items()) == key and (not batch or count + len(item[0]) <= self.max_inputs):
                batch.append(item)
                count += len(item[0])
            else:
                rest.append(item)
        self.pending = rest
        return batch

    async def _run(self, batch: list) -> None:
        live = [item for item in batch if not item[2].done()]
        if not live:
            return
        inputs = [x for item in live for x in item[0]]
        try:
            vectors = await asyncio.to_thread(self.runtime.embed, inputs, **live[0][1])
        except Exception as e:
            if len(live) == 1:
                if not live[0][2].done():
                    live[0][2].set_exception(e)
                return
            for item in live:
                await self._run([item])
            return
        self.metrics.embedding_batches += 1
        self.metrics.embedding_requests += len(live)
        at = 0
        for item_inputs, _, future in live:
            if not future.done():
                future.set_result(vectors[at:at + len(item_inputs)])
            at += len(item_inputs)


def embeddings_routes(server: Server, route) -> list:
    """The routes of this module, made with app.py's `route` (errors in OpenAI's shape)."""
    batcher = EmbeddingBatcher(server.runtime, server.metrics)

    async def embeddings(request: Request) -> Response:
        body = await server.body_within(request, server.deadline())
        refuse_unknown(body, EMBEDDING_FIELDS)
        request.state.user = body.get("user")
        inputs = embedding_inputs(body.get("input"))
        fmt = body.get("encoding_format") or "float"
        if fmt not in ("float", "base64"):
            raise ApiError(400, f"encoding_format must be float or base64, not {fmt!r}", param="encoding_format")
        dims = body.get("dimensions")
        if dims is not None and (not isinstance(dims, int) or isinstance(dims, bool) or dims < 1):
            raise ApiError(400, "dimensions must be a positive integer", param="dimensions")
        kw = {k: body[k] for k in ("prompt_name", "prompt") if body.get(k) is not None}
        vectors = await batcher.embed(inputs, dict(kw, dimensions=dims))
        tokens = sum(token_count(server.runtime, i, kw) for i in inputs)
        data = []
        for i, v in enumerate(np.asarray(vectors, dtype=np.float32)):
            emb = base64.b64encode(v.astype("<f4").tobytes()).decode() if fmt == "base64" else v.tolist()
            data.append({"object": "embedding", "index": i, "embedding": emb})
        return JSONResponse({"object": "list", "data": data, "model": server.model_name,
                             "usage": {"prompt_tokens": tokens, "total_tokens": tokens}})

    async def rerank(request: Request) -> Response:
        body = await server.body_within(request, server.deadline())
        refuse_unknown(body, RERANK_FIELDS)
        query = body.get("query")
        if not isinstance(query, str):
            raise ApiError(400, "query must be a string", param="query")
        docs = body.get("documents")
        if not isinstance(docs, list) or not docs:
            raise ApiError(400, "documents must be a non-empty list", param="documents")
        texts = []
        for d in docs:
            if isinstance(d, dict) and isinstance(d.get("text"), str):
                d = d["text"]
            if not isinstance(d, str):
                raise ApiError(400, "each document must be a string or {\"text\": string}", param="documents")
            texts.append(d)
        top_n = body.get("top_n")
        if top_n is not None and (not isinstance(top_n, int) or isinstance(top_n, bool) or top_n < 1):
            raise ApiError(400, "top_n must be a positive integer", param="top_n")
        results = await asyncio.to_thread(server.runtime.rerank, query, texts, top_n=top_n,
                                          instruction=body.get("instruction"))
        if body.get("return_documents"):
            for r in results:
                r["document"] = {"text": texts[r["index"]]}
        return JSONResponse({"object": "list", "model": server.model_name, "results": results})

    return [
        route("/v1/embeddings", embeddings, ["POST"], "embeddings"),
        route("/v1/rerank", rerank, ["POST"], "rerank"),
        # llama-server's and vLLM's other spellings of the same endpoint.
        route("/v1/reranking", rerank, ["POST"], "rerank"),
        route("/rerank", rerank, ["POST"], "rerank"),
    ]
