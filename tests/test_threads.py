"""`threads=` on load and `--threads` on the CLI: one process-wide count, fixed by the first load."""

import json
import subprocess
import sys

import pytest

from candlewick import ModelRuntime

from conftest import TINY

MODEL = str(TINY / "llama")

# A fresh interpreter: the count is process-wide, and this test process has loaded models already.
PROBE = """
import json, sys
from candlewick import ModelRuntime
rt = ModelRuntime.load(sys.argv[1], device="cpu", threads=int(sys.argv[2]))
again = ModelRuntime.load(sys.argv[1], device="cpu")
try:
    ModelRuntime.load(sys.argv[1], device="cpu", threads=int(sys.argv[2]) + 1)
    refused = None
except ValueError as e:
    refused = str(e)
print(json.dumps({"threads": rt.model_info["threads"], "again": again.model_info["threads"], "refused": refused}))
"""


@pytest.mark.parametrize("n", [1, 3])
def test_threads_on_load_fix_the_count_for_the_process(n):
    out = subprocess.run([sys.executable, "-c", PROBE, MODEL, str(n)], capture_output=True, text=True, check=True)
    got = json.loads(out.stdout)
    assert got["threads"] == n and got["again"] == n
    assert "threads" in got["refused"] and "fixed by the first model loaded" in got["refused"]


def test_the_count_in_force_is_reported_and_can_be_asked_again():
    rt = ModelRuntime.load(MODEL, device="cpu")
    n = rt.model_info["threads"]
    assert n >= 1
    assert ModelRuntime.load(MODEL, device="cpu", threads=n).model_info["threads"] == n


@pytest.mark.parametrize("bad", [0, -1, 100000])
def test_absurd_thread_counts_are_value_errors(bad):
    with pytest.raises(ValueError, match="threads"):
        ModelRuntime.load(MODEL, device="cpu", threads=bad)


def test_cli_threads_reach_the_runtime():
    out = subprocess.run([sys.executable, "-m", "candlewick", "info", "--model", MODEL, "--threads", "1", "--json"],
                         capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["threads"] == 1
