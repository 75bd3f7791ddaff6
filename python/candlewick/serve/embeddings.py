"""``POST /v1/embeddings`` (OpenAI's shape) and ``POST /v1/rerank`` (the Jina/Cohere shape
llama-server and vLLM accept), over ``ModelRuntime.embed`` and ``ModelRuntime.rerank``
(docs/embeddings.md).

Embeddings: ``input`` as a string, a list of strings, a list of token ids or a list of such
lists; ``encoding_format`` ``float`` or ``base64`` (little-endian float32, as OpenAI's); 
``dimensions`` (Matryoshka truncation, then normalisation); candlewick's ``prompt_name`` /
``prompt`` (the model's query/document prompts). Rerank: ``query``, ``documents`` (strings, or
``{"text": ...}`` objects), ``top_n``, ``return_documents``, candlewick's ``instruction``. Any
other field is a 400 naming it. The work runs in a thread beside the engine (its own fresh
contexts over the shared weights); the runtime's lock serialises these requests.
"""

from __future__ import annotations

import asyncio
import base64
from typing import Any

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


def embeddings_routes(server: Server, route) -> list:
    """The routes of this module, made with app.py's `route` (errors in OpenAI's shape)."""

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
        vectors = await asyncio.to_thread(server.runtime.embed, inputs, dimensions=dims, **kw)
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
