"""candlewick's OpenAI-compatible server (docs/server.md): ``candlewick serve``."""

from __future__ import annotations

import signal
import sys
import threading
from contextlib import contextmanager
from typing import Optional

from .._options import parse_control_vector, served_name
from .app import ApiError, Server, build_app

__all__ = ["ApiError", "Server", "build_app", "serve"]


def load_control_vectors(runtime, specs) -> dict:
    """``NAME=FILE[:SCALE]`` specs as named lists of edits (read with llama.cpp's semantics)."""
    named = {}
    scratch = runtime.fork()
    for spec in specs or []:
        name, sep, rest = spec.partition("=")
        if not sep or not name:
            raise SystemExit(f"--control-vector wants NAME=FILE[:SCALE], got {spec!r}")
        file, scale = parse_control_vector(rest)
        named[name] = scratch.load_control_vector(file, scale=scale)
        scratch.interventions = []
    return named


def connection_limit(max_batch_size: int, max_queue: int) -> int:
    """The most connections uvicorn holds at once (beyond it, it answers 503 before reading a
    body): room for a full batch and queue twice over (keep-alive connections of the same
    clients, requests being refused) and for probes, so memory stays bounded however many
    clients come."""
    return 2 * (max_batch_size + max_queue) + 32


@contextmanager
def sigterm_ends_cleanly():
    """uvicorn answers SIGTERM with a graceful shutdown, then raises the signal again under the
    handler it found, which by default kills the process (status 143). With a no-op handler
    found instead, the shutdown that already happened is the whole answer and `serve`
    returns: status 0, as service managers expect of a clean stop."""
    if threading.current_thread() is not threading.main_thread():
        yield  # signals belong to the main thread; uvicorn leaves them alone too
        return
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: None)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def graceful_server(config, server: Server, grace: float):
    """A uvicorn server that, once a shutdown's `grace` seconds have passed, cancels the
    engine's requests itself (`Server.cancel_all`): each handler then ends with a proper answer
    (503, or an error event in its stream) and its connection closes. uvicorn's own cut-off,
    which cancels the handlers' tasks and logs each as a crash, stays as a backstop a few
    seconds later."""
    import asyncio

    import uvicorn

    config.timeout_graceful_shutdown = grace + 5.0
    graceful = uvicorn.Server(config)
    # Wrapped on the instance rather than subclassed: a class made inside this function (uvicorn
    # is an optional import) would look like an export of the package to the stub checker.
    shutdown = graceful.shutdown

    async def shutdown_with_grace(sockets=None) -> None:
        timer = asyncio.get_running_loop().call_later(grace, server.cancel_all)
        try:
            await shutdown(sockets)
        finally:
            timer.cancel()

    graceful.shutdown = shutdown_with_grace  # type: ignore[method-assign]
    return graceful


def attach_saes(runtime, specs) -> None:
    """``--sae NAME=PATH[@POINT]``: attaches each SAE to the runtime, so requests name it in ``sae_edits``."""
    for spec in specs or []:
        name, sep, rest = spec.partition("=")
        if not sep or not name or not rest:
            raise SystemExit(f"--sae wants NAME=PATH[@POINT], got {spec!r}")
        path, _, point = rest.partition("@")
        runtime.attach_sae(path, point=point or None, name=name)


def load_loras(runtime, specs) -> None:
    """``--lora NAME=PATH[:SCALE]``: loads each LoRA adapter, served as the model ``BASE:NAME``
    (and by name in a request's ``adapters``)."""
    from .._options import parse_lora

    for spec in specs or []:
        name, sep, rest = spec.partition("=")
        if not sep or not name or not rest:
            raise SystemExit(f"--lora wants NAME=PATH[:SCALE] for serve, got {spec!r}")
        path, scale = parse_lora(rest)
        runtime.load_adapter(path, name=name, scale=scale)


def serve(model: str, host: str = "127.0.0.1", port: int = 8000, api_key: Optional[str] = None,
          max_batch_size: int = 8, max_queue: int = 64, control_vectors=None, device: str = "auto",
          chat_template: Optional[str] = None, log_level: str = "info", threads: Optional[int] = None,
          request_timeout: Optional[float] = 600.0, shutdown_grace: float = 30.0,
          prefill_chunk: Optional[int] = 128, prefix_cache_bytes: int = 256 << 20,
          draft_model: Optional[str] = None, kv_cache_type: Optional[str] = None,
          filename: Optional[str] = None, revision: Optional[str] = None,
          allow_image_urls: bool = False, image_url_max_bytes: int = 20 << 20,
          image_url_timeout: Optional[float] = 10.0, saes=None, loras=None,
          prefix_cache_dir: Optional[str] = None, prefix_cache_disk_bytes: int = 4 << 30,
          mmproj: Optional[str] = None) -> None:
    """Loads `model` and serves it until interrupted (the loopback unless `host` says otherwise).

    `model` is a local path or a Hub name (``org/name[:TAG]``, with `filename` and `revision` as
    ``candlewick.hub.resolve_model`` reads them), fetched before the server starts; a Hub name
    is also the name the server answers to.

    Each request is cancelled after `request_timeout` seconds (0 or None: never). On SIGTERM
    the server stops accepting connections, lets the requests in flight finish for up to
    `shutdown_grace` seconds, cancels the rest and returns.

    Chat image parts are taken as data: URLs; http(s) image URLs are fetched only with
    `allow_image_urls`, each up to `image_url_max_bytes` and `image_url_timeout` seconds. A GGUF
    `model` takes images with `mmproj`, llama.cpp's mmproj file (``ModelRuntime.load``'s)."""
    import uvicorn

    from .. import ModelRuntime
    from .images import ImagePolicy
    from ..hub import resolve_model

    def log(line: str) -> None:
        print(line, file=sys.stderr, flush=True)

    local = resolve_model(model, filename, revision)
    log(f"loading {local}")
    runtime = ModelRuntime.load(local, device=device, threads=threads,
                                draft_model=draft_model,
                                kv_cache_type=kv_cache_type, mmproj=mmproj)
    attach_saes(runtime, saes)
    load_loras(runtime, loras)
    server = Server(runtime, served_name(model, local), api_key=api_key, max_batch_size=max_batch_size,
                    max_queue=max_queue, control_vectors=load_control_vectors(runtime, control_vectors),
                    chat_template=chat_template, log=log, request_timeout=request_timeout,
                    prefill_chunk=prefill_chunk, prefix_cache_bytes=prefix_cache_bytes,
                    image_policy=ImagePolicy(allow_image_urls, image_url_max_bytes, image_url_timeout),
                    prefix_cache_dir=prefix_cache_dir, prefix_cache_disk_bytes=prefix_cache_disk_bytes)
    log(f"serving {server.model_name} on http://{host}:{port}/v1")
    config = uvicorn.Config(build_app(server), host=host, port=port, log_level=log_level, access_log=False,
                            limit_concurrency=connection_limit(max_batch_size, max_queue))
    # On SIGTERM (or Ctrl-C) uvicorn stops listening and waits for the requests in flight;
    # past the grace period they are cancelled; then the app's shutdown closes the engine.
    http = graceful_server(config, server, shutdown_grace)
    with sigterm_ends_cleanly():
        try:
            http.run()
        except KeyboardInterrupt:  # uvicorn raises Ctrl-C again once it has shut down
            pass
    if not http.started:
        raise SystemExit(3)  # as uvicorn.run: the server never listened (a port in use)
    log("stopped")
