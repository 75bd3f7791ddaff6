"""Shared helpers: where the reference fixtures live and how results are compared (DESIGN §7)."""

import os
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import load_file

REPO = Path(__file__).resolve().parent.parent
FIXTURES = Path(os.environ.get("CANDLEWICK_FIXTURES", REPO.parent / "shared" / "fixtures"))
TINY = FIXTURES / "tiny"
CASES = ["llama", "mistral", "qwen2", "qwen3", "gemma3", "phi3"]
# The device of the `runtime` fixture (and so of every test that takes it): benches/device_check.sh
# sets `cuda` to hold a GPU build to the same references; everything else stays on the CPU.
DEVICE = os.environ.get("CANDLEWICK_TEST_DEVICE", "cpu")
# The merge cache (src/text/merge_cache.rs) in a directory of this run's own, unless one is
# given: the suite starts cold, so the generated and the cached merges both run, and nothing
# lands in the user's cache.
if "CANDLEWICK_CACHE_DIR" not in os.environ:
    import atexit
    import shutil
    import tempfile

    os.environ["CANDLEWICK_CACHE_DIR"] = tempfile.mkdtemp(prefix="candlewick-test-cache-")
    atexit.register(shutil.rmtree, os.environ["CANDLEWICK_CACHE_DIR"], ignore_errors=True)


# `benches/llama_cpp_checks.sh` sets this: there the llama.cpp cross-checks must run, so a missing
# llama-cpp-python fails them instead of skipping (a command that passes having run nothing
# would prove nothing).
REQUIRE_LLAMA_CPP = os.environ.get("CANDLEWICK_REQUIRE_LLAMA_CPP") == "1"


def llama_cpp_or_skip():
    """The `llama_cpp` module (llama-cpp-python) for a cross-check marked `llama_cpp`: a skip where
    it is not installed, as in CI (it must be built from source), a failure where
    `CANDLEWICK_REQUIRE_LLAMA_CPP=1` asks for the checks to run."""
    try:
        import llama_cpp
    except ImportError as e:
        if REQUIRE_LLAMA_CPP:
            pytest.fail(f"CANDLEWICK_REQUIRE_LLAMA_CPP=1 but llama-cpp-python does not import: {e}")
        pytest.skip("llama-cpp-python is not installed (run benches/llama_cpp_checks.sh where it is)")
    return llama_cpp


def rel_l2(a, r):
    """Relative L2 error ‖a − r‖ / ‖r‖ in float64."""
    a = np.asarray(a, dtype=np.float64)
    r = np.asarray(r, dtype=np.float64)
    assert a.shape == r.shape, (a.shape, r.shape)
    return float(np.linalg.norm(a - r) / max(np.linalg.norm(r), 1e-30))


def reference(case):
    """transformers' outputs for a tiny checkpoint."""
    return load_file(str(TINY / case / "reference.safetensors"))


@pytest.fixture(params=CASES)
def case(request):
    """Each of the six tiny architectures."""
    return request.param


@pytest.fixture
def ref(case):
    return reference(case)


@pytest.fixture
def runtime(case):
    import candlewick

    return candlewick.ModelRuntime.load(TINY / case, device=DEVICE)


@pytest.fixture(scope="session")
def tiny_with_tokenizer(tmp_path_factory):
    """The tiny llama checkpoint with a word-level tokenizer (`t0` … `t511`), so text generation
    runs in float32 against exact expectations."""
    import shutil

    from tokenizers import Tokenizer, models, pre_tokenizers

    dest = tmp_path_factory.mktemp("tiny-tok") / "llama"
    shutil.copytree(TINY / "llama", dest)
    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(512)}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(dest / "tokenizer.json"))
    return dest


def _bf16_gemm_rounds_activations() -> bool:
    """Whether a bfloat16 model's prompt rows are multiplied with their activations rounded to
    bfloat16: on x86 CPUs with AVX-512 BF16 (`vdpbf16ps`, kernels/bf16_gemm.rs). Elsewhere on x86
    they stay float32 (the widened GEMM), which keeps the few rows that miss the bfloat16 bound
    where the activations are rounded inside it. Other architectures: assumed rounded, as before."""
    import platform

    if platform.machine() not in ("x86_64", "AMD64"):
        return True
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return "avx512_bf16" in line.split()
    except OSError:
        pass
    return True


BF16_GEMM_ROUNDS_ACTIVATIONS = _bf16_gemm_rounds_activations()
