"""One chat turn through the engine, for the APIs that speak chat in other shapes.

``/v1/responses`` (responses.py) and ``/v1/messages`` (messages.py) translate their request into
a chat-completions body (``messages``, ``tools``, ``tool_choice``, ``response_format``, the
sampling fields and candlewick's ``interventions`` / ``control_vector`` / ``observe``) and run it
here, through the same `Server` methods as ``/v1/chat/completions``: sampling options, per-request
edits and observations, the tool-call format and its constraint, the queue, the deadline and the
client's disconnection. Each API then writes the result, or the stream of pieces, in its own shape.
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Optional

from starlette.requests import Request

from .app import ApiError, Server, ToolRequest, finish, refuse_unknown, wait_all, within


@dataclass
class Turn:
    """A chat turn submitted to the engine (one choice)."""

    server: Server
    request: Request
    reqs: list
    tools: Optional[ToolRequest]
    extension: Optional[dict]
    deadline: Optional[float]
    final: Any = field(default=None)

    @property
    def holds_back(self) -> bool:
        """Whether the answer may be tool calls, so its text is only known at the end (as chat
        streams it)."""
        return self.tools is not None and self.tools.parsed

    async def result(self):
        """The finished `GenerationResult` (recorded in the metrics); the ApiError of a client
        gone, a deadline past or a shutdown otherwise."""
        try:
            results = await self.server.guard(self.request, wait_all(self.reqs), self.reqs, self.deadline)
        finally:
            self.close()
        if results[0] is None:  # cancelled by a shutdown
            raise self.server.shutdown_error()
        self.server.metrics.record(results[0].usage)
        self.final = results[0]
        return self.final

    async def pieces(self) -> AsyncIterator[str]:
        """The text as it is generated (nothing when `holds_back`); then `final` holds the
        result. A deadline past or a shutdown raises its ApiError: the stream's status is long
        sent, so the caller writes it as an error event."""
        r = self.reqs[0]
        it = r.__aiter__()
        while True:
            try:
                piece = await within(it.__anext__(), self.deadline)
            except StopAsyncIteration:
                break
            except asyncio.TimeoutError:
                raise self.server.timeout_error() from None
            if not self.holds_back:
                yield piece
        if r.result is None:
            raise self.server.shutdown_error()
        self.server.metrics.record(r.result.usage)
        self.final = r.result

    def message(self, result) -> tuple[dict, str]:
        """The assistant message of `result` (``content`` and, when it called tools,
        ``tool_calls`` in OpenAI's shape) and chat's finish reason."""
        if self.tools is not None:
            return self.tools.message(result)
        return {"role": "assistant", "content": result.text}, finish(result)

    def close(self) -> None:
        """Cancels the engine request (a no-op once it finished): frees its slot."""
        for r in self.reqs:
            r.cancel()

    def disconnected(self) -> None:
        """Counts a client that went away mid-stream (how Starlette stops a stream)."""
        self.server.metrics.disconnects += 1


async def start_turn(server: Server, request: Request, body: dict, deadline: Optional[float]) -> Turn:
    """Submits the chat-completions-shaped `body` (its fields already checked by the caller's
    API). With ``stream`` it waits for the first event, so that a request refused, timed out or
    abandoned while queued is still answered as a plain HTTP error."""
    kw = server.sampling(body)
    edits = server.interventions(body)
    messages = body["messages"]
    extension = server.observe(body, messages, True)
    tools = server.tools(body, kw)
    prompt, chat = (tools.prompt, False) if tools is not None else (messages, True)
    reqs = server.submit_all(prompt, chat, kw, edits, 1)
    if body.get("stream"):
        await server.started(request, reqs, deadline)
    return Turn(server, request, reqs, tools, extension, deadline)


def function_tools(tools, kinds: tuple, honoured: set, schema: str, takes: str) -> list:
    """An API's tools in chat's shape: each an object whose ``type`` is one of `kinds` (None: no
    type given), with ``name``, ``description`` and its parameters' JSON schema under `schema`.
    Another kind of tool is a 400 naming it (`takes`: what the server takes instead), as is a
    field not in `honoured`."""
    if not isinstance(tools, list):
        raise ApiError(400, "tools must be a list", param="tools")
    out = []
    for i, t in enumerate(tools):
        if not isinstance(t, dict) or t.get("type") not in kinds:
            kind = t.get("type") if isinstance(t, dict) else type(t).__name__
            raise ApiError(400, f"tools[{i}]: tools of type {kind!r} are not supported by this server ({takes})",
                           param=f"tools[{i}].type", code="unsupported_field")
        refuse_unknown(t, honoured, f"tools[{i}].")
        fn = {"name": t.get("name"), "parameters": t.get(schema) or {"type": "object", "properties": {}}}
        if t.get("description") is not None:
            fn["description"] = t["description"]
        out.append({"type": "function", "function": fn})
    return out


def sse_event(name: str, data: dict) -> str:
    """One server-sent event with its name (as the Responses and Messages APIs stream them)."""
    return f"event: {name}\ndata: {json.dumps(data)}\n\n"


def text_of(content, where: str, kinds: tuple) -> str:
    """The text of a message's `content`: a string, or a list of parts whose ``type`` is one of
    `kinds` (their ``text`` joined); any other part is a 400 naming it."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise ApiError(400, f"{where} must be a string or a list of content parts", param=where)
    out = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in kinds or not isinstance(part.get("text"), str):
            raise ApiError(400, f"{where}[{j}]: content of type {kind!r} is not supported by this server "
                           f"(it takes {', '.join(kinds)})", param=f"{where}[{j}].type", code="unsupported_field")
        out.append(part["text"])
    return "".join(out)
