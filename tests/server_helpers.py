"""`candlewick serve` in a subprocess on the loopback, for the server tests (and benches): a free
port, start-up until the server answers, a raw JSON POST, shutdown. The model-specific starts
(test_server.py's Gemma GGUF with a chat template, the embedding checkpoints) are built on these."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(*args, timeout: float = 120, env=None, stderr=subprocess.PIPE) -> tuple[subprocess.Popen, str]:
    """`python -m candlewick serve --device cpu --port <free> *args`, once `/health` answers 200:
    `(process, base URL)`. The server's stderr stays readable on the process (the request log);
    a server that exits first raises with it, one not up within `timeout` seconds is killed."""
    port = free_port()
    cmd = [sys.executable, "-m", "candlewick", "serve", *args, "--device", "cpu", "--port", str(port)]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=stderr, text=True)
    base = f"http://127.0.0.1:{port}"
    deadline = time.time() + timeout
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited: {proc.stderr.read() if proc.stderr else proc.returncode}")
        try:
            with urllib.request.urlopen(base + "/health", timeout=1) as r:
                if r.status == 200:
                    return proc, base
        except OSError:
            time.sleep(0.2)
    proc.kill()
    raise RuntimeError("the server did not come up in time")


def stop(proc, timeout: float = 20) -> None:
    """SIGTERM, then SIGKILL if the server has not exited within `timeout` seconds."""
    proc.terminate()
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()


def get_json(base: str, path: str, timeout: float = 10):
    """The JSON body of `GET base+path`."""
    with urllib.request.urlopen(base + path, timeout=timeout) as r:
        return json.loads(r.read())


def post(base, path, body, headers=None, raw=None):
    """`POST base+path` with `body` as JSON (or the bytes `raw`): `(status, JSON answer, headers)`,
    an HTTP error answered the same way."""
    data = raw if raw is not None else json.dumps(body).encode()
    h = {"Content-Type": "application/json", **(headers or {})}
    req = urllib.request.Request(base + path, data=data, headers=h, method="POST")
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            return r.status, json.loads(r.read()), dict(r.headers)
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read()), dict(e.headers)
