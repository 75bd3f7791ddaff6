"""What a build says about itself: the CPU baseline it was compiled for, and the kernels it
picks at run time (a portable wheel must still find the AVX-512 paths on a CPU that has them)."""

import os
import platform
from pathlib import Path

import pytest

import candlewick


def cpu_flags():
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return None
    for line in text.splitlines():
        if line.startswith("flags"):
            return set(line.split(":", 1)[1].split())
    return None


def test_build_info_describes_this_build():
    info = candlewick.build_info()
    assert info["version"] == candlewick.__version__
    assert set(info["features"]) <= {"cuda", "metal"}
    assert "cpu:0" in info["devices"]
    if "cuda" not in info["features"]:
        assert not any(d.startswith("cuda") for d in info["devices"])


def arm_features():
    """The `Features` line of an Arm Linux /proc/cpuinfo (asimddp: dotprod; i8mm)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return None
    for line in text.splitlines():
        if line.startswith("Features"):
            return set(line.split(":", 1)[1].split())
    return None


def test_int8_kernel_is_chosen_by_this_cpu_not_by_the_build():
    if platform.machine() in ("aarch64", "arm64"):
        features = arm_features()
        if features is None:
            pytest.skip("no /proc/cpuinfo")
        want = "neon-i8mm" if {"asimddp", "i8mm"} <= features else "neon-dotprod" if "asimddp" in features else "neon"
        assert candlewick.build_info()["int8_kernel"] == want
        # The tiles' NEON kernels need the dot product (`sdot`), as the int8 GEMM's faster paths.
        assert candlewick.build_info()["interleaved_tiles"] == ("asimddp" in features)
        return
    flags = cpu_flags() if platform.machine() in ("x86_64", "AMD64") else set()
    if flags is None:
        pytest.skip("no /proc/cpuinfo")
    if {"avx512_vnni", "avx512vl"} <= flags:
        want = "avx512vnni"
    elif {"avx2", "fma"} <= flags:
        want = "avx2"
    else:
        want = "portable"
    assert candlewick.build_info()["int8_kernel"] == want
    # Weights are repacked into 16-row tiles exactly where the AVX-512 VNNI kernels or the AVX2
    # ones can run them.
    avx512 = {"avx512_vnni", "avx512vl", "avx512bw"} <= flags
    tiles = avx512 or {"avx2", "fma", "f16c"} <= flags
    assert candlewick.build_info()["interleaved_tiles"] == tiles
    # AVX-512 and AVX2 tile every block type, the grid i-quants and the ternary types included.
    grid = {"iq1_s", "iq1_m", "iq2_xxs", "iq2_xs", "iq2_s", "iq3_xxs", "iq3_s", "tq1_0", "tq2_0"}
    tiled = set(candlewick.build_info()["tiled_types"])
    assert len(tiled) == (21 if tiles else 0)
    assert not tiles or grid <= tiled


def test_portable_build_keeps_to_its_baseline():
    # .ci/run sets this for the wheel it builds with RUSTFLAGS="-C target-cpu=x86-64-v3", which
    # must win over .cargo/config.toml's target-cpu=native.
    baseline = os.environ.get("CANDLEWICK_EXPECT_CPU_BASELINE")
    if not baseline:
        pytest.skip("set CANDLEWICK_EXPECT_CPU_BASELINE=x86-64-v3 to check a portable build")
    assert baseline == "x86-64-v3", "only the x86-64-v3 baseline is checked"
    compiled = set(candlewick.build_info()["cpu_target_features"])
    assert {"avx", "avx2", "fma", "f16c"} <= compiled
    assert not {f for f in compiled if f.startswith("avx512")}, compiled
