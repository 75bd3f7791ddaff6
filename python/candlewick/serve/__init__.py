"""candlewick's OpenAI-compatible server (docs/server.md): ``candlewick serve``."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Optional

from .app import ApiError, Server, build_app

__all__ = ["ApiError", "Server", "build_app", "serve"]


def load_control_vectors(runtime, specs) -> dict:
    """``NAME=FILE[:SCALE]`` specs as named lists of edits (read with llama.cpp's semantics)."""
    from ..cli import parse_control_vector

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


def serve(model: str, host: str = "127.0.0.1", port: int = 8000, api_key: Optional[str] = None,
          max_batch_size: int = 8, max_queue: int = 64, control_vectors=None, device: str = "auto",
          chat_template: Optional[str] = None, log_level: str = "info", threads: Optional[int] = None) -> None:
    """Loads `model` and serves it until interrupted (the loopback unless `host` says otherwise)."""
    import uvicorn

    from .. import ModelRuntime

    def log(line: str) -> None:
        print(line, file=sys.stderr, flush=True)

    log(f"loading {model}")
    runtime = ModelRuntime.load(model, device=device, threads=threads)
    server = Server(runtime, Path(model).name, api_key=api_key, max_batch_size=max_batch_size,
                    max_queue=max_queue, control_vectors=load_control_vectors(runtime, control_vectors),
                    chat_template=chat_template, log=log)
    log(f"serving {server.model_name} on http://{host}:{port}/v1")
    uvicorn.run(build_app(server), host=host, port=port, log_level=log_level, access_log=False)
