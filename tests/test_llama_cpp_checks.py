"""The llama.cpp cross-checks have one command that runs them (issue 38: they always skipped in
CI, with no way to run them on purpose): every test that needs llama-cpp-python is marked
`llama_cpp`, goes through `conftest.llama_cpp_or_skip`, and under `benches/llama_cpp_checks.sh`'s
setting fails rather than skips when llama-cpp-python is missing."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent
SCRIPT = TESTS.parent / "benches" / "llama_cpp_checks.sh"


def pytest_run(*args, **env):
    return subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", *args], cwd=TESTS.parent,
                          capture_output=True, text=True, timeout=600, env={**os.environ, **env})


def test_every_llama_cpp_test_is_marked_and_goes_through_the_helper():
    skip_by_hand = "importorskip(" + '"llama_cpp")'
    users = []
    for path in TESTS.glob("test_*.py"):
        text = path.read_text()
        assert skip_by_hand not in text, f"{path.name}: use conftest.llama_cpp_or_skip()"
        if path.name != Path(__file__).name and re.search(r"llama_cpp_or_skip|llama_cpp_reads_as_the_reference", text):
            users.append(f"tests/{path.name}")
    listed = pytest_run("-m", "llama_cpp", "--collect-only", "-q").stdout
    marked = {line for line in listed.splitlines() if "::" in line}
    assert len(marked) >= 18, listed[-2000:]
    # No unmarked test reaches llama-cpp-python: with the checks' setting, one would fail here.
    r = pytest_run("-m", "not llama_cpp", "-q", *users, CANDLEWICK_REQUIRE_LLAMA_CPP="1")
    assert r.returncode == 0, r.stdout[-3000:]


def test_the_checks_command_refuses_to_pass_without_llama_cpp():
    try:
        import llama_cpp  # noqa: F401
    except ImportError:
        pass
    else:
        pytest.skip("llama-cpp-python is installed here: the checks run instead")
    r = subprocess.run(["bash", str(SCRIPT), sys.executable], capture_output=True, text=True, timeout=120)
    assert r.returncode != 0 and "llama_cpp" in r.stderr
    # And the tests themselves, asked to run, fail rather than skip.
    r = pytest_run("-m", "llama_cpp", "-q", "tests/test_reference_shared_experts.py",
                   CANDLEWICK_REQUIRE_LLAMA_CPP="1")
    assert r.returncode != 0 and "CANDLEWICK_REQUIRE_LLAMA_CPP=1" in r.stdout, r.stdout[-2000:]
