"""OpenAI's Responses API, ``POST /v1/responses`` and ``GET /v1/responses/{id}``, over the chat
path (turns.py; docs/server.md).

A request's ``input`` (a string, or items: messages, ``function_call`` and
``function_call_output``), its ``instructions`` (a system message) and, with
``previous_response_id``, the stored conversation it continues become one chat-completions body;
``tools`` (functions), ``tool_choice`` and ``text.format`` become chat's ``tools``, ``tool_choice``
and ``response_format``, so they go through the same tool-call and constraint code. The answer is
a ``response`` object (``output``: a message and/or ``function_call`` items), or with ``stream``
the Responses events (``response.created`` ... ``response.completed``). Responses are stored (unless
``store: false``) in a bounded store, least recently used out, for ``previous_response_id``.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections import OrderedDict
from typing import Optional

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from .app import ApiError, Server, refuse_unknown
from .turns import Turn, function_tools, sse_event, start_turn, text_of

# The fields /v1/responses honours: OpenAI's, then llama-cpp-python's sampling extensions and
# candlewick's own (the `openai` client passes those with `extra_body`). Any other is a 400.
FIELDS = {
    "model", "input", "instructions", "max_output_tokens", "temperature", "top_p", "stream", "tools",
    "tool_choice", "parallel_tool_calls", "text", "previous_response_id", "store", "metadata", "user",
    "seed", "top_k", "min_p", "repeat_penalty", "presence_penalty", "frequency_penalty", "stop",
    "interventions", "control_vector", "observe", "grammar", "grammar_format", "sae_edits", "adapters",
}
# Passed to the chat body as they are.
PASSED = ("temperature", "top_p", "seed", "top_k", "min_p", "repeat_penalty", "presence_penalty", "frequency_penalty",
          "stop", "user", "interventions", "control_vector", "observe", "grammar", "grammar_format", "stream",
          "parallel_tool_calls", "sae_edits", "adapters", "model")
# The conversations kept for `previous_response_id`: the most recently used this many.
STORE_SIZE = 1024
MESSAGE_PARTS = ("input_text", "output_text", "text")
ROLES = {"user": "user", "assistant": "assistant", "system": "system", "developer": "system"}


class ResponseStore:
    """Stored responses, the most recently used `size` (each with the chat conversation that led
    to it and its own answer, which a later request continues)."""

    def __init__(self, size: int = STORE_SIZE):
        self.size = size
        self.items: OrderedDict[str, tuple[dict, list]] = OrderedDict()

    def put(self, response: dict, conversation: list) -> None:
        self.items[response["id"]] = (response, conversation)
        self.items.move_to_end(response["id"])
        while len(self.items) > self.size:
            self.items.popitem(last=False)

    def get(self, rid: str, param: str) -> tuple[dict, list]:
        """The stored response `rid` and its conversation; a 404 naming `param` when it is not
        (or no longer) stored."""
        if rid not in self.items:
            raise ApiError(404, f"no stored response with id {rid!r} (responses are kept while they are among the "
                           f"{self.size} most recently used, and only with store: true)", param=param,
                           code="response_not_found")
        self.items.move_to_end(rid)
        return self.items[rid]


def chat_tools(tools, tool_choice) -> tuple[Optional[list], object]:
    """Responses' flat function tools and tool choice in chat's shape; any other kind of tool
    (web search, files, computer use, MCP) is a 400 naming it."""
    if tools is None:
        return None, tool_choice
    out = function_tools(tools, ("function",), {"type", "name", "description", "parameters", "strict"}, "parameters",
                         "function tools are")
    if isinstance(tool_choice, dict):
        if tool_choice.get("type") != "function" or not isinstance(tool_choice.get("name"), str):
            raise ApiError(400, "tool_choice: this server takes \"auto\", \"none\", \"required\" or "
                           "{\"type\": \"function\", \"name\": ...}", param="tool_choice")
        tool_choice = {"type": "function", "function": {"name": tool_choice["name"]}}
    return out, tool_choice


def response_format(text) -> Optional[dict]:
    """`text.format` as chat's `response_format`."""
    if text is None:
        return None
    if not isinstance(text, dict):
        raise ApiError(400, "text must be an object", param="text")
    refuse_unknown(text, {"format"}, "text.")
    fmt = text.get("format")
    if fmt is None:
        return None
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        refuse_unknown(fmt, {"type"}, "text.format.")
        return {"type": "json_object"}
    if kind == "json_schema":
        refuse_unknown(fmt, {"type", "name", "schema", "strict", "description"}, "text.format.")
        return {"type": "json_schema", "json_schema": {"name": fmt.get("name", "output"), "schema": fmt.get("schema"),
                                                       "strict": fmt.get("strict")}}
    raise ApiError(400, "text.format.type must be \"text\", \"json_object\" or \"json_schema\"",
                   param="text.format.type")


def conversation_of(input_) -> list:
    """`input` (a string, or a list of items) as chat messages."""
    if isinstance(input_, str):
        return [{"role": "user", "content": input_}]
    if not isinstance(input_, list):
        raise ApiError(400, "input must be a string or a list of items", param="input")
    messages: list = []
    for i, item in enumerate(input_):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise ApiError(400, f"{where} must be an object", param=where)
        kind = item.get("type", "message")
        if kind == "message":
            refuse_unknown(item, {"type", "role", "content", "id", "status"}, where + ".")
            role = ROLES.get(str(item.get("role")))
            if role is None:
                raise ApiError(400, f"{where}.role must be one of {', '.join(ROLES)}", param=where + ".role")
            messages.append({"role": role, "content": text_of(item.get("content"), where + ".content",
                                                              MESSAGE_PARTS)})
        elif kind == "function_call":
            refuse_unknown(item, {"type", "call_id", "name", "arguments", "id", "status"}, where + ".")
            call = {"id": item.get("call_id"), "type": "function",
                    "function": {"name": item.get("name"), "arguments": item.get("arguments") or "{}"}}
            last = messages[-1] if messages else None
            # Calls made together are one assistant turn.
            if last is not None and last["role"] == "assistant" and last.get("tool_calls") and not last["content"]:
                last["tool_calls"].append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            refuse_unknown(item, {"type", "call_id", "output", "id", "status"}, where + ".")
            output = item.get("output")
            messages.append({"role": "tool", "tool_call_id": item.get("call_id"),
                             "content": output if isinstance(output, str) else json.dumps(output)})
        else:
            raise ApiError(400, f"{where}: input items of type {kind!r} are not supported by this server (it takes "
                           "message, function_call and function_call_output)", param=where + ".type",
                           code="unsupported_field")
    return messages


def output_items(message: dict) -> list:
    """The `output` of a response: the assistant message's text as a message item, its tool
    calls as `function_call` items."""
    items = []
    if message.get("content"):
        items.append({"type": "message", "id": "msg_" + uuid.uuid4().hex, "status": "completed", "role": "assistant",
                      "content": [{"type": "output_text", "text": message["content"], "annotations": []}]})
    for call in message.get("tool_calls") or []:
        items.append({"type": "function_call", "id": "fc_" + uuid.uuid4().hex, "call_id": call["id"],
                      "name": call["function"]["name"], "arguments": call["function"]["arguments"],
                      "status": "completed"})
    return items


def usage_of(result) -> dict:
    u = result.usage
    return {"input_tokens": u["prompt_tokens"], "input_tokens_details": {"cached_tokens": u.get("cached_tokens", 0)},
            "output_tokens": u["completion_tokens"], "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": u["prompt_tokens"] + u["completion_tokens"]}


def responses_routes(server: Server, route) -> list:
    """The routes of the Responses API, made by `route(path, fn, methods, name)`."""
    store = ResponseStore()

    def envelope(rid: str, body: dict, status: str, output: list, usage: Optional[dict]) -> dict:
        """A response object: the request's settings and what is known of the answer so far."""
        return {
            "id": rid, "object": "response", "created_at": int(time.time()), "status": status, "error": None,
            "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
            "instructions": body.get("instructions"), "max_output_tokens": body.get("max_output_tokens"),
            "model": server.model_name, "output": output, "parallel_tool_calls": body.get("parallel_tool_calls", True),
            "previous_response_id": body.get("previous_response_id"), "temperature": body.get("temperature"),
            "top_p": body.get("top_p"), "tool_choice": body.get("tool_choice") or "auto", "tools": body.get("tools") or [],
            "text": body.get("text") or {"format": {"type": "text"}}, "metadata": body.get("metadata") or {},
            "store": body.get("store", True) is not False, "usage": usage,
        }

    def chat_body(body: dict) -> tuple[dict, list]:
        """The chat-completions body of a Responses request, and the conversation it stores
        (without the instructions, which a continuation does not inherit)."""
        refuse_unknown(body, FIELDS)
        if body.get("input") is None:
            raise ApiError(400, "input is required", param="input")
        history: list = []
        if body.get("previous_response_id") is not None:
            history = list(store.get(body["previous_response_id"], "previous_response_id")[1])
        conversation = history + conversation_of(body["input"])
        messages = list(conversation)
        if body.get("instructions") is not None:
            if not isinstance(body["instructions"], str):
                raise ApiError(400, "instructions must be a string", param="instructions")
            messages.insert(0, {"role": "system", "content": body["instructions"]})
        metadata = body.get("metadata")
        if metadata is not None and not isinstance(metadata, dict):
            raise ApiError(400, "metadata must be an object", param="metadata")
        chat: dict = {k: body[k] for k in PASSED if body.get(k) is not None}
        chat["messages"] = messages
        if body.get("max_output_tokens") is not None:
            chat["max_tokens"] = body["max_output_tokens"]
        tools, choice = chat_tools(body.get("tools"), body.get("tool_choice"))
        if tools is not None:
            chat["tools"] = tools
        if choice is not None:
            chat["tool_choice"] = choice
        fmt = response_format(body.get("text"))
        if fmt is not None:
            chat["response_format"] = fmt
        return chat, conversation

    def keep(body: dict, response: dict, conversation: list, message: dict) -> None:
        if body.get("store", True) is not False:
            store.put(response, conversation + [message])

    async def create(request: Request) -> Response:
        deadline = server.deadline()
        body = await server.body_within(request, deadline)
        request.state.user = body.get("user")
        chat, conversation = chat_body(body)
        turn = await start_turn(server, request, chat, deadline)
        rid = "resp_" + uuid.uuid4().hex
        if body.get("stream"):
            return StreamingResponse(events(turn, rid, body, conversation), media_type="text/event-stream")
        result = await turn.result()
        message, _ = turn.message(result)
        status = "incomplete" if result.finish_reason == "length" else "completed"
        response = envelope(rid, body, status, output_items(message), usage_of(result))
        keep(body, response, conversation, message)
        if turn.extension:
            response["candlewick"] = turn.extension
        return JSONResponse(response)

    async def events(turn: Turn, rid: str, body: dict, conversation: list):
        seq = 0

        def event(kind: str, **data) -> str:
            nonlocal seq
            seq += 1
            return sse_event(kind, {"type": kind, "sequence_number": seq - 1, **data})

        try:
            head = envelope(rid, body, "in_progress", [], None)
            if turn.extension:
                head["candlewick"] = turn.extension
            yield event("response.created", response=head)
            yield event("response.in_progress", response=envelope(rid, body, "in_progress", [], None))
            mid = "msg_" + uuid.uuid4().hex
            text, index = "", 0
            try:
                async for piece in turn.pieces():
                    if not text:
                        yield event("response.output_item.added", output_index=0, item={
                            "type": "message", "id": mid, "status": "in_progress", "role": "assistant", "content": []})
                        yield event("response.content_part.added", item_id=mid, output_index=0, content_index=0,
                                    part={"type": "output_text", "text": "", "annotations": []})
                    text += piece
                    yield event("response.output_text.delta", item_id=mid, output_index=0, content_index=0,
                                delta=piece, logprobs=[])
            except ApiError as e:
                yield event("error", code=e.code, message=e.message, param=e.param)
                failed = envelope(rid, body, "failed", [], None)
                failed["error"] = {"code": e.code or "server_error", "message": e.message}
                yield event("response.failed", response=failed)
                return
            result = turn.final
            message, _ = turn.message(result)
            items = output_items(message)
            if items and items[0]["type"] == "message":
                items[0]["id"] = mid
                if not text:  # held back (a possible tool call) and text after all: sent whole
                    yield event("response.output_item.added", output_index=0, item={
                        "type": "message", "id": mid, "status": "in_progress", "role": "assistant", "content": []})
                    yield event("response.content_part.added", item_id=mid, output_index=0, content_index=0,
                                part={"type": "output_text", "text": "", "annotations": []})
                    yield event("response.output_text.delta", item_id=mid, output_index=0, content_index=0,
                                delta=message["content"], logprobs=[])
                part = items[0]["content"][0]
                yield event("response.output_text.done", item_id=mid, output_index=0, content_index=0,
                            text=part["text"], logprobs=[])
                yield event("response.content_part.done", item_id=mid, output_index=0, content_index=0, part=part)
                yield event("response.output_item.done", output_index=0, item=items[0])
                index = 1
            for k, item in enumerate(items[index:], start=index):
                # As OpenAI streams a call: the item with empty arguments, then its arguments.
                yield event("response.output_item.added", output_index=k, item={**item, "arguments": "",
                                                                               "status": "in_progress"})
                yield event("response.function_call_arguments.delta", item_id=item["id"], output_index=k,
                            delta=item["arguments"])
                yield event("response.function_call_arguments.done", item_id=item["id"], output_index=k,
                            name=item["name"], arguments=item["arguments"])
                yield event("response.output_item.done", output_index=k, item=item)
            status = "incomplete" if result.finish_reason == "length" else "completed"
            response = envelope(rid, body, status, items, usage_of(result))
            keep(body, response, conversation, message)
            yield event("response.completed" if status == "completed" else "response.incomplete", response=response)
        except (GeneratorExit, asyncio.CancelledError):
            turn.disconnected()
            raise
        finally:
            turn.close()

    async def retrieve(request: Request) -> Response:
        return JSONResponse(store.get(request.path_params["rid"], "response_id")[0])

    return [
        route("/v1/responses", create, ["POST"], "responses"),
        route("/v1/responses/{rid}", retrieve, ["GET"], "responses"),
    ]
