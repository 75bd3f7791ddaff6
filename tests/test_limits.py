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


@pytest.mark.parametrize("call", ["inspect_prefill", "trace"])
def test_a_step_that_cannot_fit_is_refused_before_allocating_and_the_session_is_unchanged(long_rt, call):
    # Every layer's attention pattern of 100,000 tokens: hundreds of GB.
    req = cw.ObservationRequest.select(["model.layers.0.attention.pattern", "model.layers.2.attention.pattern"])
    before = (long_rt.session.position, long_rt.cached_tokens())
    with pytest.raises(cw.OutOfMemoryError, match="100000 tokens"):
        getattr(long_rt, call)(_ids(100_000), req)
    assert (long_rt.session.position, long_rt.cached_tokens()) == before
    long_rt.decode([7]).wait()


def test_every_row_of_a_huge_prompt_is_refused_with_a_hint(long_rt):
    # Each chunk would fit; their logits together would not.
    n = (40 << 30) // (4 * long_rt.model_info["vocab_size"])
    with pytest.raises(cw.OutOfMemoryError, match="last row"):
        long_rt.prefill([3] * n, all_logits=True)
    assert long_rt.session.position == 2


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
