"""Sizes from the input (issue 23): an absurd size is a typed error before anything is allocated,
and a long prompt runs in chunks instead of one step sized by its length."""

import numpy as np
import pytest

import candlewick as cw

from conftest import TINY, rel_l2

MODEL = TINY / "llama"


@pytest.mark.parametrize("value", [2**64 - 1, 2**64, 2**70, -1, 2**32])
def test_an_absurd_max_context_is_an_invalid_option_naming_it(value):
    with pytest.raises(cw.InvalidOptionError, match="max_context"):
        cw.ModelRuntime.load(MODEL, device="cpu", max_context=value)


@pytest.mark.parametrize("value", [2**64 - 1, 2**64, -5])
def test_an_absurd_thread_count_is_a_value_error_naming_it(value):
    with pytest.raises(ValueError, match="threads"):
        cw.ModelRuntime.load(MODEL, device="cpu", threads=value)


def test_a_huge_max_context_alone_allocates_nothing():
    rt = cw.ModelRuntime.load(MODEL, device="cpu", max_context=10**9)
    rt.prefill([3, 4, 5]).wait()
    assert rt.session.max_context == 10**9
    assert rt.session.cache_bytes < 10 << 20


@pytest.fixture
def long_rt():
    rt = cw.ModelRuntime.load(MODEL, device="cpu", max_context=10**9)
    rt.prefill([5, 6]).wait()
    return rt


def _ids(n, seed=0):
    return [int(x) for x in np.random.default_rng(seed).integers(3, 500, n)]


# The refusals below are of steps too big for the memory left. What a host has free varies (a
# 40 GiB request fits on some), so each runs in a child whose address space is capped (RLIMIT_AS)
# 1 GiB above what it maps once the model is loaded: the runtime counts what is left under such a
# cap as free (src/memory.rs), so every host looks alike, and a step that was not refused fails
# its allocation in the child rather than taking the host's memory.
LITTLE_MEMORY = r"""
import json, os, resource, sys
import numpy as np
import candlewick as cw

rt = cw.ModelRuntime.load(sys.argv[1], device="cpu", max_context=10**9)
rt.prefill([5, 6]).wait()
ids = [int(x) for x in np.random.default_rng(0).integers(3, 500, int(sys.argv[3]))]
req = cw.ObservationRequest.select(["model.layers.0.attention.pattern", "model.layers.2.attention.pattern"])
calls = {
    "inspect_prefill": lambda: rt.inspect_prefill(ids, req),
    "trace": lambda: rt.trace(ids, req),
    "prefill all rows": lambda: rt.prefill(ids, all_logits=True),
}
with open("/proc/self/statm") as f:
    mapped = int(f.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")
resource.setrlimit(resource.RLIMIT_AS, (mapped + (1 << 30), resource.getrlimit(resource.RLIMIT_AS)[1]))
try:
    calls[sys.argv[2]]()
    out = {"refused": None}
except cw.OutOfMemoryError as e:
    out = {"refused": str(e)}
resource.setrlimit(resource.RLIMIT_AS, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
out["after"] = [rt.session.position, rt.cached_tokens()]
rt.decode([7]).wait()
print(json.dumps(out))
"""


def with_little_memory(call, tokens):
    """Runs `call` with `tokens` random ids on the tiny Llama (2 tokens prefilled) in a child
    that has 1 GiB of address space left; returns its OutOfMemoryError's text (or None) and
    the session's position and tokens after it."""
    import json
    import subprocess
    import sys

    if not sys.platform.startswith("linux"):
        pytest.skip("the runtime reads what memory is left from /proc (Linux)")
    r = subprocess.run([sys.executable, "-c", LITTLE_MEMORY, str(MODEL), call, str(tokens)], capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0, f"the step was not refused and failed its allocation: {r.stderr[-2000:]}"
    out = json.loads(r.stdout.strip().splitlines()[-1])
    return out["refused"], out["after"]


@pytest.mark.parametrize("call", ["inspect_prefill", "trace"])
def test_a_step_that_cannot_fit_is_refused_before_allocating_and_the_session_is_unchanged(call):
    # Two layers' attention patterns of 100,000 tokens: hundreds of GB.
    refused, after = with_little_memory(call, 100_000)
    assert refused is not None and "100000 tokens" in refused
    assert after == [2, [5, 6]]


def test_every_row_of_a_huge_prompt_is_refused_with_a_hint():
    # Each 512-token chunk fits in the 1 GiB left; 2,000,000 rows of logits (4 GiB) would not.
    refused, after = with_little_memory("prefill all rows", 2_000_000)
    assert refused is not None and "last row" in refused
    assert after == [2, [5, 6]]


def test_a_prompt_longer_than_a_chunk_matches_the_one_step_run(long_rt):
    ids = _ids(1300, seed=1)
    one_step = long_rt.trace([5, 6] + ids, cw.ObservationRequest.exact(["model.logits"])).output.logits
    chunked = long_rt.prefill(ids, all_logits=True).wait().logits
    assert chunked.shape == (1300, one_step.shape[1])
    assert rel_l2(chunked, one_step[2:]) < 1e-5
    assert long_rt.session.position == 1302
    # And the last row alone, as generation asks for it.
    long_rt.session.truncate(2)
    last = long_rt.prefill(ids).wait().logits
    assert rel_l2(last[-1], one_step[-1]) < 1e-5


def test_a_chunked_prompt_that_overruns_the_context_leaves_the_session_as_it_was():
    rt = cw.ModelRuntime.load(MODEL, device="cpu", max_context=1000)
    rt.prefill([5, 6]).wait()
    with pytest.raises(cw.ContextFullError):
        rt.prefill(_ids(1200)).wait()
    assert rt.session.position == 2 and rt.cached_tokens() == [5, 6]
