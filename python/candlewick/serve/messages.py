"""Anthropic's Messages API, ``POST /v1/messages`` and ``POST /v1/messages/count_tokens``, over
the chat path (turns.py; docs/server.md).

``system`` (a string or text blocks) and ``messages`` (content as a string or blocks: ``text``,
``tool_use``, ``tool_result``) become chat messages; ``tools`` (``input_schema``) and
``tool_choice`` (``auto``, ``any``, ``tool``, ``none``) become chat's, so calls go through the same
tool-call format and constraint code. The answer is a ``message`` with ``text`` and ``tool_use``
blocks and a ``stop_reason`` (``end_turn``, ``max_tokens``, ``stop_sequence``, ``tool_use``), or
with ``stream`` Anthropic's events (``message_start`` ... ``message_stop``). Errors come in
Anthropic's shape, ``{"type": "error", "error": {"type", "message"}}``.
"""

from __future__ import annotations

import asyncio
import json
import uuid
from typing import Optional

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from .app import ApiError, Server, refuse_unknown
from .turns import Turn, function_tools, sse_event, start_turn, text_of

# The fields /v1/messages honours: Anthropic's, then the sampling extensions and candlewick's
# own (the `anthropic` client passes those with `extra_body`). Any other is a 400.
FIELDS = {
    "model", "max_tokens", "messages", "system", "stop_sequences", "temperature", "top_p", "top_k", "stream",
    "tools", "tool_choice", "metadata", "output_config", "cache_control",
    "seed", "min_p", "repeat_penalty", "presence_penalty", "frequency_penalty",
    "interventions", "control_vector", "observe", "grammar", "grammar_format", "sae_edits", "adapters",
}
# output_config constrains the answer, not the prompt: the count is the same with it.
COUNT_FIELDS = {"model", "messages", "system", "tools", "tool_choice", "output_config", "cache_control"}
PASSED = ("max_tokens", "temperature", "top_p", "top_k", "seed", "min_p", "repeat_penalty", "presence_penalty",
          "frequency_penalty", "interventions", "control_vector", "observe", "grammar", "grammar_format", "stream",
          "sae_edits", "adapters", "model")
# `cache_control` (on a block, or at the top for the last block) marks where Anthropic's prompt
# cache may cut: the engine's prefix cache reuses every prompt prefix it holds anyway, so the
# mark is honoured by being unnecessary.
TEXT_BLOCK = {"type", "text", "cache_control", "citations"}
# Anthropic's error types by status.
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
               404: "not_found_error", 408: "timeout_error", 413: "request_too_large", 415: "invalid_request_error",
               429: "rate_limit_error", 503: "overloaded_error", 504: "timeout_error"}


def error_response(e: ApiError) -> JSONResponse:
    """An error in Anthropic's shape, with the status and headers of `e`."""
    return JSONResponse(error_body(e), status_code=e.status, headers=e.headers)


def error_body(e: ApiError) -> dict:
    """Anthropic's error object has no `param`: the message names the field instead."""
    message = e.message if not e.param or e.param in e.message else f"{e.param}: {e.message}"
    return {"type": "error", "error": {"type": ERROR_TYPES.get(e.status, "api_error"), "message": message}}


def system_text(system) -> Optional[str]:
    if system is None:
        return None
    if isinstance(system, list):
        for j, block in enumerate(system):
            if isinstance(block, dict):
                refuse_unknown(block, TEXT_BLOCK, f"system[{j}].")
    return text_of(system, "system", ("text",))


def chat_messages(messages) -> list:
    """Anthropic's `messages` as chat messages: an assistant's `tool_use` blocks become its
    `tool_calls`, a user's `tool_result` blocks `tool` messages (before the user's own text)."""
    if not isinstance(messages, list) or not messages:
        raise ApiError(400, "messages must be a non-empty list", param="messages")
    out: list = []
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(m, dict) or m.get("role") not in ("user", "assistant"):
            raise ApiError(400, f"{where}.role must be \"user\" or \"assistant\"", param=where + ".role")
        refuse_unknown(m, {"role", "content"}, where + ".")
        content = m.get("content")
        if isinstance(content, str):
            out.append({"role": m["role"], "content": content})
            continue
        if not isinstance(content, list):
            raise ApiError(400, f"{where}.content must be a string or a list of blocks", param=where + ".content")
        texts, calls, results = [], [], []
        for j, block in enumerate(content):
            at = f"{where}.content[{j}]"
            kind = block.get("type") if isinstance(block, dict) else None
            if kind == "text":
                refuse_unknown(block, TEXT_BLOCK, at + ".")
                texts.append(text_of([block], at, ("text",)))
            elif kind == "tool_use" and m["role"] == "assistant":
                refuse_unknown(block, {"type", "id", "name", "input", "cache_control"}, at + ".")
                calls.append({"id": block.get("id"), "type": "function",
                              "function": {"name": block.get("name"), "arguments": json.dumps(block.get("input") or {})}})
            elif kind == "tool_result" and m["role"] == "user":
                refuse_unknown(block, {"type", "tool_use_id", "content", "is_error", "cache_control"}, at + ".")
                inner = block.get("content")
                if isinstance(inner, list):
                    for k, b in enumerate(inner):
                        if isinstance(b, dict):
                            refuse_unknown(b, TEXT_BLOCK, f"{at}.content[{k}].")
                text = "" if inner is None else text_of(inner, at + ".content", ("text",))
                # The model reads a failed call as such: the result says so.
                if block.get("is_error"):
                    text = "Error: " + text
                results.append({"role": "tool", "tool_call_id": block.get("tool_use_id"), "content": text})
            else:
                raise ApiError(400, f"{at}: {m['role']} content blocks of type {kind!r} are not supported by this "
                               "server (it takes text, tool_use from the assistant and tool_result from the user)",
                               param=at + ".type", code="unsupported_field")
        out.extend(results)
        if calls:
            out.append({"role": "assistant", "content": "".join(texts) or None, "tool_calls": calls})
        elif texts or not results:
            out.append({"role": m["role"], "content": "".join(texts)})
    return out


def chat_tools(tools, tool_choice) -> dict:
    """Anthropic's `tools` and `tool_choice` as chat's `tools`, `tool_choice` and
    `parallel_tool_calls`."""
    out: dict = {}
    if tools is not None:
        out["tools"] = function_tools(tools, (None, "custom"), {"type", "name", "description", "input_schema",
                                                                "cache_control"}, "input_schema",
                                      "client tools with an input_schema are")
    if tool_choice is not None:
        if not isinstance(tool_choice, dict):
            raise ApiError(400, "tool_choice must be an object", param="tool_choice")
        refuse_unknown(tool_choice, {"type", "name", "disable_parallel_tool_use"}, "tool_choice.")
        kind = tool_choice.get("type")
        if kind == "auto":
            out["tool_choice"] = "auto"
        elif kind == "any":
            out["tool_choice"] = "required"
        elif kind == "none":
            out["tool_choice"] = "none"
        elif kind == "tool" and isinstance(tool_choice.get("name"), str):
            out["tool_choice"] = {"type": "function", "function": {"name": tool_choice["name"]}}
        else:
            raise ApiError(400, "tool_choice.type must be \"auto\", \"any\", \"none\" or \"tool\" (with a name)",
                           param="tool_choice.type")
        if tool_choice.get("disable_parallel_tool_use") and tools is not None:
            out["parallel_tool_calls"] = False
    return out


def chat_body(body: dict, fields=FIELDS) -> dict:
    """The chat-completions body of a Messages request."""
    refuse_unknown(body, fields)
    messages = chat_messages(body.get("messages"))
    system = system_text(body.get("system"))
    if system is not None:
        messages.insert(0, {"role": "system", "content": system})
    chat: dict = {k: body[k] for k in PASSED if body.get(k) is not None}
    chat["messages"] = messages
    if body.get("stop_sequences") is not None:
        chat["stop"] = body["stop_sequences"]
    metadata = body.get("metadata")
    if metadata is not None:
        if not isinstance(metadata, dict):
            raise ApiError(400, "metadata must be an object", param="metadata")
        refuse_unknown(metadata, {"user_id"}, "metadata.")
        if metadata.get("user_id") is not None:
            chat["user"] = metadata["user_id"]
    chat.update(chat_tools(body.get("tools"), body.get("tool_choice")))
    fmt = output_format(body.get("output_config"))
    if fmt is not None:
        chat["response_format"] = fmt
    return chat


def output_format(config) -> Optional[dict]:
    """`output_config.format` (structured outputs: `{"type": "json_schema", "schema"}`) as chat's
    `response_format`, through the same constraint code."""
    if config is None:
        return None
    if not isinstance(config, dict):
        raise ApiError(400, "output_config must be an object", param="output_config")
    refuse_unknown(config, {"format"}, "output_config.")
    fmt = config.get("format")
    if fmt is None:
        return None
    if not isinstance(fmt, dict) or fmt.get("type") != "json_schema" or not isinstance(fmt.get("schema"), dict):
        raise ApiError(400, "output_config.format must be {\"type\": \"json_schema\", \"schema\": {...}}",
                       param="output_config.format")
    refuse_unknown(fmt, {"type", "schema"}, "output_config.format.")
    return {"type": "json_schema", "json_schema": {"name": "output", "schema": fmt["schema"], "strict": True}}


def content_blocks(message: dict) -> list:
    blocks = []
    if message.get("content"):
        blocks.append({"type": "text", "text": message["content"]})
    for call in message.get("tool_calls") or []:
        blocks.append({"type": "tool_use", "id": call["id"], "name": call["function"]["name"],
                       "input": json.loads(call["function"]["arguments"] or "{}")})
    return blocks


def messages_routes(server: Server, route) -> list:
    """The routes of the Messages API, made by `route(path, fn, methods, name, errors)`."""

    def prompt_tokens(chat: dict) -> int:
        """How many tokens `chat`'s conversation is, rendered as the engine renders it."""
        tools = chat.get("tools")
        ids = server.runtime.tokenizer.apply_chat_template(
            chat["messages"], tools=tools, chat_template=server.chat_template, add_generation_prompt=True)
        return len(ids)

    def stop_of(result, chat: dict) -> tuple[str, Optional[str]]:
        """Anthropic's stop reason and stop sequence for a result without tool calls."""
        if result.finish_reason == "length":
            return "max_tokens", None
        stops = chat.get("stop") or []
        if result.finish_reason == "stop" and stops:
            # The text is cut where the stop sequence began: which one is in the rest.
            rest = server.runtime.tokenizer.decode(result.token_ids)[len(result.text):]
            for s in sorted(stops, key=lambda s: rest.find(s) if s in rest else len(rest)):
                if s in rest:
                    return "stop_sequence", s
        return "end_turn", None

    def answer(turn: Turn, result, chat: dict) -> tuple[dict, str, Optional[str]]:
        message, reason = turn.message(result)
        if reason == "tool_calls":
            return message, "tool_use", None
        return (message, *stop_of(result, chat))

    def usage(result) -> dict:
        u = result.usage
        return {"input_tokens": u["prompt_tokens"], "output_tokens": u["completion_tokens"],
                "cache_read_input_tokens": u.get("cached_tokens", 0), "cache_creation_input_tokens": 0}

    async def create(request: Request) -> Response:
        deadline = server.deadline()
        body = await server.body_within(request, deadline)
        if body.get("max_tokens") is None:
            raise ApiError(400, "max_tokens is required", param="max_tokens")
        chat = chat_body(body)
        request.state.user = chat.get("user")
        turn = await start_turn(server, request, chat, deadline)
        mid = "msg_" + uuid.uuid4().hex
        if body.get("stream"):
            return StreamingResponse(events(turn, mid, chat), media_type="text/event-stream")
        result = await turn.result()
        message, reason, sequence = answer(turn, result, chat)
        out = {"id": mid, "type": "message", "role": "assistant", "model": server.model_name,
               "content": content_blocks(message), "stop_reason": reason, "stop_sequence": sequence,
               "usage": usage(result)}
        if turn.extension:
            out["candlewick"] = turn.extension
        return JSONResponse(out)

    async def events(turn: Turn, mid: str, chat: dict):
        try:
            head: dict = {"id": mid, "type": "message", "role": "assistant", "model": server.model_name, "content": [],
                    "stop_reason": None, "stop_sequence": None,
                    "usage": {"input_tokens": prompt_tokens(chat), "output_tokens": 0}}
            if turn.extension:
                head["candlewick"] = turn.extension
            yield sse_event("message_start", {"type": "message_start", "message": head})
            yield sse_event("ping", {"type": "ping"})
            started = False
            try:
                async for piece in turn.pieces():
                    if not started:
                        yield sse_event("content_block_start", {"type": "content_block_start", "index": 0,
                                                                "content_block": {"type": "text", "text": ""}})
                        started = True
                    yield sse_event("content_block_delta", {"type": "content_block_delta", "index": 0,
                                                            "delta": {"type": "text_delta", "text": piece}})
            except ApiError as e:
                yield sse_event("error", error_body(e))
                return
            result = turn.final
            message, reason, sequence = answer(turn, result, chat)
            blocks = content_blocks(message)
            index = 0
            if blocks and blocks[0]["type"] == "text":
                if not started:  # held back (a possible tool call), text after all: sent whole
                    yield sse_event("content_block_start", {"type": "content_block_start", "index": 0,
                                                            "content_block": {"type": "text", "text": ""}})
                    yield sse_event("content_block_delta", {"type": "content_block_delta", "index": 0,
                                                            "delta": {"type": "text_delta", "text": blocks[0]["text"]}})
                    started = True
                blocks = blocks[1:]
            if started:
                yield sse_event("content_block_stop", {"type": "content_block_stop", "index": 0})
                index = 1
            for k, block in enumerate(blocks, start=index):
                yield sse_event("content_block_start", {"type": "content_block_start", "index": k,
                                                        "content_block": {**block, "input": {}}})
                yield sse_event("content_block_delta", {"type": "content_block_delta", "index": k, "delta": {
                    "type": "input_json_delta", "partial_json": json.dumps(block["input"])}})
                yield sse_event("content_block_stop", {"type": "content_block_stop", "index": k})
            yield sse_event("message_delta", {"type": "message_delta",
                                              "delta": {"stop_reason": reason, "stop_sequence": sequence},
                                              "usage": usage(result)})
            yield sse_event("message_stop", {"type": "message_stop"})
        except (GeneratorExit, asyncio.CancelledError):
            turn.disconnected()
            raise
        finally:
            turn.close()

    async def count_tokens(request: Request) -> Response:
        body = await server.body_within(request, server.deadline())
        chat = chat_body(body, COUNT_FIELDS)
        return JSONResponse({"input_tokens": prompt_tokens(chat)})

    return [
        route("/v1/messages", create, ["POST"], "messages", error_response),
        route("/v1/messages/count_tokens", count_tokens, ["POST"], "messages_count_tokens", error_response),
    ]
