"""The same server as replicas under Ray Serve (docs/server.md): each replica loads the model
and owns an engine; Ray Serve's HTTP proxy spreads requests over them and replaces a replica
whose process dies. Install with ``pip install 'candlewick[ray]'``.

    from ray import serve
    from candlewick.serve.ray import application
    serve.run(application("model.gguf", replicas=2), route_prefix="/")

Routing: Ray Serve's default router picks the less loaded of two random replicas; it does not
look at prompts, so a conversation's turns may land on different replicas. Each replica still
reuses any prefix it holds (its engine keeps finished sessions), so the cost of a miss is one
prefill of the shared prefix.
"""

from __future__ import annotations

from typing import Any, Optional, Sequence


def application(model: str, replicas: int = 2, api_key: Optional[str] = None, max_batch_size: int = 8,
                max_queue: int = 64, control_vectors: Optional[Sequence[str]] = None, device: str = "cpu",
                chat_template: Optional[str] = None, num_cpus: Optional[float] = None,
                threads: Optional[int] = None, request_timeout: Optional[float] = 600.0,
                prefill_chunk: Optional[int] = 128, prefix_cache_bytes: int = 256 << 20,
                draft_model: Optional[str] = None, kv_cache_type: Optional[str] = None,
                filename: Optional[str] = None, revision: Optional[str] = None,
                shutdown_grace: float = 30.0, mmproj: Optional[str] = None):
    """A Ray Serve application serving `model` (a local path, or a Hub name with `filename` and
    `revision` as ``candlewick.hub.resolve_model`` reads them) from `replicas` replicas, with the
    routes of ``candlewick serve``. `shutdown_grace` is ``serve --shutdown-grace``: when a replica
    stops, Ray Serve lets its requests in flight run this many seconds before it is killed (the
    deployment's ``graceful_shutdown_timeout_s``). `mmproj` is ``serve --mmproj`` (a path each
    replica's machine can read)."""
    from ray import serve

    if shutdown_grace < 0:
        raise ValueError(f"shutdown_grace must be >= 0 seconds, got {shutdown_grace}")

    def build():
        # Runs on each replica: the model, its engine and the Starlette app live there. A Hub
        # name is resolved here, on the replica's machine and into its cache, since a path
        # resolved by the driver need not exist on another node.
        import sys

        from .. import ModelRuntime
        from .._options import served_name
        from ..hub import resolve_model
        from . import load_control_vectors
        from .app import Server, build_app

        def log(line: str) -> None:
            # One line per request, as `candlewick serve` writes (Ray keeps each replica's stderr
            # in its logs): the request's `user` is recorded there.
            print(line, file=sys.stderr, flush=True)

        local = resolve_model(model, filename, revision)
        runtime = ModelRuntime.load(local, device=device, threads=threads,
                                    draft_model=draft_model,
                                    kv_cache_type=kv_cache_type, mmproj=mmproj)
        server = Server(runtime, served_name(model, local), api_key=api_key, max_batch_size=max_batch_size,
                        max_queue=max_queue, control_vectors=load_control_vectors(runtime, control_vectors),
                        chat_template=chat_template, request_timeout=request_timeout,
                        prefill_chunk=prefill_chunk, prefix_cache_bytes=prefix_cache_bytes, log=log)
        return build_app(server)

    options: dict[str, Any] = {"num_replicas": replicas, "graceful_shutdown_timeout_s": float(shutdown_grace)}
    if num_cpus is not None:
        options["ray_actor_options"] = {"num_cpus": num_cpus}

    # Built with type() rather than a class statement inside this function: mypy's stubtest
    # takes a local class for a module attribute that is missing at run time.
    replica = type("CandlewickReplica", (), {"__doc__": "One replica: a model and its engine behind the OpenAI routes."})
    return serve.deployment(**options)(serve.ingress(build)(replica)).bind()


def run(model: str, host: str = "127.0.0.1", port: int = 8000, address: Optional[str] = None,
        replicas: int = 2, **options) -> None:
    """Starts (or joins, with `address`) a Ray cluster and serves `model` until interrupted
    (Ctrl-C or SIGTERM); the replicas then stop within `shutdown_grace` (see `application`)."""
    import signal
    import threading
    import time

    import ray
    from ray import serve

    from .._options import served_name
    from ..hub import resolve_model

    # Fetched here first: a Hub name's errors show before any replica starts, and replicas on
    # this machine then find the files in the cache.
    local = resolve_model(model, options.get("filename"), options.get("revision"))
    ray.init(address=address, include_dashboard=False)
    serve.start(http_options={"host": host, "port": port})
    serve.run(application(model, replicas=replicas, **options), route_prefix="/")
    print(f"serving {served_name(model, local)} from {replicas} replicas on http://{host}:{port}/v1", flush=True)

    def interrupt(signum, frame):
        raise KeyboardInterrupt

    # SIGTERM (a service manager's stop) shuts the replicas down as Ctrl-C does, so that their
    # requests in flight get the grace period instead of dying with this process. Signals belong
    # to the main thread; elsewhere the caller's own handling stands.
    main = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGTERM, interrupt) if main else None
    try:
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        serve.shutdown()
    finally:
        if main:
            signal.signal(signal.SIGTERM, previous)
