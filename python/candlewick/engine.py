"""The engine (docs/engine.md): many requests over one model, stepped as one continuous batch.

    engine = cw.Engine(rt, max_batch_size=8, max_queue=64)
    req = engine.submit("The capital of France is", max_tokens=16, temperature=0.0)
    for piece in req:                  # or: async for piece in req
        print(piece, end="")
    req.result                         # the GenerationResult once iteration ended
"""

from __future__ import annotations

import asyncio
import os
from concurrent.futures import ThreadPoolExecutor
from collections.abc import Mapping
from typing import Any, Optional, Sequence

from . import _native
from ._native import GenerationResult, Intervention, InvalidOptionError, ModelRuntime


_WAITERS: Optional[ThreadPoolExecutor] = None


def _waiters() -> ThreadPoolExecutor:
    """Threads that wait on engine events for asyncio callers (each wait releases the GIL and
    lasts at most 0.1 s): enough for a full batch and queue of waiting requests at once."""
    global _WAITERS
    if _WAITERS is None:
        _WAITERS = ThreadPoolExecutor(max_workers=256, thread_name_prefix="candlewick-wait")
    return _WAITERS


class EngineRequest:
    """One submitted request: iterate its text (sync or async), read its result, cancel it."""

    def __init__(self, native: _native.EngineRequest) -> None:
        self._native = native
        self._pending: list = []
        self._ended = False
        self.result: Optional[GenerationResult] = None
        self.cancelled = False
        #: With ``logprobs=N``: the log-probabilities of the tokens behind the piece last yielded.
        self.logprobs: Optional[list[dict[str, Any]]] = None

    def _take(self, event) -> Optional[str]:
        kind, value = event
        if kind == "text":
            text, self.logprobs = value
            return text
        self._ended = True
        if kind == "done":
            self.result = value
        else:
            self.cancelled = True
        return None

    def __iter__(self) -> "EngineRequest":
        return self

    def __next__(self) -> str:
        while not self._ended:
            event = self._pending.pop() if self._pending else self._native.next_event(0.1)  # GIL released
            if event is not None:
                text = self._take(event)
                if text is not None:
                    return text
        raise StopIteration

    def __aiter__(self) -> "EngineRequest":
        return self

    async def __anext__(self) -> str:
        while not self._ended:
            event = self._pending.pop() if self._pending else await self._next_event_async()
            if event is not None:
                text = self._take(event)
                if text is not None:
                    return text
        raise StopAsyncIteration

    async def _next_event_async(self):
        """The next event: taken at once when the engine already queued one (most tokens of a
        busy engine are), else waited for off the event loop, in a thread of the engine's own
        pool so that many waiting requests never queue behind asyncio's small default pool."""
        event = self._native.next_event(0.0)
        if event is not None:
            return event
        return await asyncio.get_running_loop().run_in_executor(_waiters(), self._native.next_event, 0.1)

    def wait(self) -> Optional[GenerationResult]:
        """Runs the request to its end and returns its result (None if it was cancelled)."""
        for _ in self:
            pass
        return self.result

    async def wait_async(self) -> Optional[GenerationResult]:
        """`wait` for asyncio: runs the request to its end without blocking the event loop."""
        async for _ in self:
            pass
        return self.result

    async def started(self) -> None:
        """Waits for the request's first event, so a request the engine refuses (a token out of
        range, a bad intervention) raises here, before anything was streamed."""
        while not self._pending and not self._ended:
            event = await self._next_event_async()
            if event is not None:
                self._pending.append(event)

    def cancel(self) -> None:
        """Stops the request at the engine's next step and frees its slot."""
        self._native.cancel()


class Engine:
    """Many requests over one model's weights (shared, not copied), in a background thread."""

    def __init__(
        self,
        model: ModelRuntime | str,
        max_batch_size: int = 8,
        max_queue: int = 64,
        max_kv_bytes: Optional[int] = None,
        prefill_chunk: Optional[int] = 128,
        prefix_cache_bytes: int = 256 << 20,
        *,
        prefix_cache_dir: Optional[str | os.PathLike] = None,
        prefix_cache_disk_bytes: int = 4 << 30,
        filename: Optional[str] = None,
        revision: Optional[str] = None,
        **load_options: Any,
    ) -> None:
        """`model`: a loaded runtime, or what to load: a local path or a Hub name
        (``org/name[:TAG]``, with `filename` and `revision` as ``candlewick.hub.resolve_model``
        reads them) and `load_options` as ``ModelRuntime.load`` takes them.

        `prefill_chunk`: prompt tokens a joining request prefills per step while others decode
        (a long prompt then delays their next tokens by one chunk's time, not its whole prefill);
        None prefills each prompt whole when it joins. `prefix_cache_bytes`: memory for the keys
        and values of prompt prefixes kept across requests (64-token blocks, least recently used
        evicted first), so a request that starts like an earlier one (a system prompt, few-shot
        examples, an agent's history) skips computing that part; 0 turns it off.
        `prefix_cache_dir`: a directory the prefix cache also writes its blocks to and reads them
        back from, so a later engine (a restarted server) skips the same prefixes; at most
        `prefix_cache_disk_bytes` of files, least recently used deleted first; a damaged or
        another model's file is skipped and counted (``stats()["prefix_disk_skipped"]``), never
        loaded (docs/engine.md). `load_options`,
        `filename` and `revision` go to loading when `model` is a path or a Hub name; with a runtime,
        loaded already, they are refused (`InvalidOptionError` naming them) rather than dropped."""
        if isinstance(model, ModelRuntime):
            given = sorted(load_options) + [n for n, v in (("filename", filename), ("revision", revision)) if v is not None]
            if given:
                raise InvalidOptionError(
                    f"{', '.join(given)}: load options apply when the Engine loads the model from a path or a Hub "
                    "name; this runtime is loaded already (pass them to ModelRuntime.load)")
            self.runtime = model
        else:
            self.runtime = ModelRuntime.load(model, filename=filename, revision=revision, **load_options)
        self._native = _native.Engine(self.runtime, max_batch_size, max_queue, max_kv_bytes, prefill_chunk,
                                      prefix_cache_bytes, prefix_cache_dir, prefix_cache_disk_bytes)

    def submit(
        self,
        prompt: str | Sequence[int] | Sequence[Mapping[str, Any]],
        *,
        interventions: Optional[Sequence[Intervention]] = None,
        chat_template: Optional[str] = None,
        images: Optional[Sequence[Any]] = None,
        pixel_values: Any = None,
        **sampling: Any,
    ) -> EngineRequest:
        """Queues a prompt (text, token ids, or chat messages) with sampling keywords and this
        request's own interventions; a full queue raises ``QueueFullError`` at once.
        `images` / `pixel_values`: a vision-language model's images, as ``ModelRuntime.generate``
        takes them (chat messages may carry their own image parts instead); they are encoded
        before the request is queued, and the request joins the running batch (docs/vision.md).
        `chat_template` renders chat messages; with a text or token-id prompt, which no template
        renders, it is refused (`InvalidOptionError`) rather than ignored."""
        chat = isinstance(prompt, (list, tuple)) and len(prompt) > 0 and isinstance(prompt[0], Mapping)
        if chat_template is not None and not chat:
            raise _native.InvalidOptionError(
                "chat_template: only chat messages (a list of {\"role\", \"content\"} dicts) go through a chat "
                "template; this prompt is text or token ids")
        native = self._native.submit(
            prompt, interventions=interventions, chat=chat, chat_template=chat_template, images=images,
            pixel_values=pixel_values, **sampling
        )
        return EngineRequest(native)

    def stats(self) -> dict[str, int]:
        """Counters: submitted, finished, queued, running, generated_tokens, steps."""
        return self._native.stats()

    def close(self) -> None:
        """Stops taking requests and ends the background thread."""
        self._native.close()

    def __enter__(self) -> "Engine":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
