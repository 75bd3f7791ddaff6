"""The shipped type stubs agree with the native module (mypy's stubtest)."""

import subprocess
import sys
from pathlib import Path

import candlewick


def test_package_ships_stubs_and_marker():
    pkg = Path(candlewick.__file__).parent
    assert (pkg / "py.typed").exists()
    assert (pkg / "_native.pyi").exists()


def test_stubtest_finds_no_mismatch():
    proc = subprocess.run(
        [sys.executable, "-m", "mypy.stubtest", "candlewick._native"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
