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
    # The whole package, as a user runs it: every module imports without side effects
    # (`candlewick.__main__` included) and every native signature matches its stub.
    proc = subprocess.run(
        [sys.executable, "-m", "mypy.stubtest", "candlewick"],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_importing_main_does_not_run_the_cli():
    proc = subprocess.run(
        [sys.executable, "-c", "import candlewick.__main__; print('imported')"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0 and proc.stdout.strip() == "imported", proc.stdout + proc.stderr
