"""`candlewick serve --ray` honours every option `serve` takes (issue 38): `--shutdown-grace` had
been accepted and dropped under Ray. Neither test starts a server or a Ray cluster."""

import pytest

import candlewick.cli
import candlewick.serve.ray


def test_serve_ray_passes_shutdown_grace_to_the_replicas(monkeypatch):
    seen = {}
    monkeypatch.setattr(candlewick.serve.ray, "run", lambda model, **options: seen.update(options, model=model))
    assert candlewick.cli.main(["serve", "--ray", "--model", "m.gguf", "--shutdown-grace", "7.5"]) == 0
    assert seen["model"] == "m.gguf" and seen["shutdown_grace"] == 7.5
    # Every option `run` receives is one `application` takes: none is dropped on the way.
    import inspect

    taken = set(inspect.signature(candlewick.serve.ray.application).parameters)
    assert set(seen) - {"model", "host", "port", "address"} <= taken


def test_shutdown_grace_is_the_deployments_graceful_shutdown_timeout():
    pytest.importorskip("ray.serve")
    app = candlewick.serve.ray.application("m.gguf", replicas=1, shutdown_grace=7.5)
    # Ray Serve has no public reader of a bound deployment's settings; this is where it keeps them.
    assert app._bound_deployment._deployment_config.graceful_shutdown_timeout_s == 7.5
    with pytest.raises(ValueError, match="shutdown_grace"):
        candlewick.serve.ray.application("m.gguf", shutdown_grace=-1)
