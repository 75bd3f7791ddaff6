"""A prompt run in chunks (issue 25, DESIGN §12) against one step through the naive path, on every
tiny architecture: with `prefill_chunk` forced small, the tiled attention kernel's chunks give the
logits of one step that materialises every softmax (1e-5 relative L2, row by row); observations
are assembled from the chunks into what one step records (attention patterns included, padded
with the keys a chunk could not see); interventions apply at their absolute positions in
whichever chunk holds them.

The prompt (150 tokens) spans three of the kernel's 64-key blocks and five 32-row query tiles;
chunks of 1, 5, 7 and 64 tokens put boundaries inside and across the 6-token windows of gemma2,
gemma3 and gpt_oss and across key blocks."""

import numpy as np
import pytest

import candlewick as cw
from conftest import DEVICE, TINY, rel_l2

ARCHS = sorted(p.name for p in TINY.iterdir() if (p / "config.json").is_file())
CHUNKS = [1, 5, 7, 64]
N = 150
TOL = 1e-5


def _ids(n, seed=0):
    return [int(x) for x in np.random.default_rng(seed).integers(3, 500, n)]


def _load(arch, **kw):
    return cw.ModelRuntime.load(TINY / arch, device=DEVICE, dtype="f32", **kw)


_NAIVE = {}


def naive(arch):
    """One step over the whole prompt with every point observed: every layer's attention is the
    materialised softmax (the pattern is asked for), nothing is chunked (150 < 512)."""
    if arch not in _NAIVE:
        rt = _load(arch)
        out = rt.inspect_prefill(_ids(N), cw.ObservationRequest.all(), all_logits=True)
        _NAIVE[arch] = (out.output.logits, dict(out.observations.items()), rt.observation_points())
    return _NAIVE[arch]


def _assert_rows_close(got, want, what):
    assert got.shape == want.shape, what
    for row in range(got.shape[0]):
        assert rel_l2(got[row], want[row]) <= TOL, f"{what} row {row}"


@pytest.mark.parametrize("chunk", CHUNKS)
@pytest.mark.parametrize("arch", ARCHS)
def test_chunks_through_the_tiled_kernel_equal_one_naive_step(arch, chunk):
    logits, observed, points = naive(arch)
    rt = _load(arch, prefill_chunk=chunk)
    assert rt.session.prefill_chunk == chunk
    _assert_rows_close(rt.prefill(_ids(N), all_logits=True).wait().logits, logits, "logits")
    assert rt.session.position == N

    # Observing everything but the patterns keeps the tiled kernel; each point is assembled.
    rt.session.reset()
    plain_points = [p for p in points if not p.endswith("attention.pattern")]
    out = rt.inspect_prefill(_ids(N), cw.ObservationRequest.exact(plain_points), all_logits=True)
    assert sorted(out.observations.keys()) == sorted(plain_points)
    for point in plain_points:
        _assert_rows_close(out.observations[point], observed[point], point)
    _assert_rows_close(out.output.logits, logits, "inspected logits")


@pytest.mark.parametrize("arch", ["llama", "gemma3", "gpt_oss"])
def test_patterns_assembled_from_chunks_equal_one_steps(arch):
    _, observed, points = naive(arch)
    rt = _load(arch, prefill_chunk=7)
    patterns = [p for p in points if p.endswith("attention.pattern")]
    out = rt.inspect_prefill(_ids(N), cw.ObservationRequest.exact(patterns))
    for point in patterns:
        got, want = out.observations[point], observed[point]
        assert got.shape == want.shape == (want.shape[0], N, N), point
        for h in range(got.shape[0]):
            _assert_rows_close(got[h], want[h], f"{point} head {h}")
        # Causal: no row of any chunk sees a later key.
        assert np.all(np.triu(got, k=1) == 0), point


@pytest.mark.parametrize("arch", ["qwen2", "gemma2"])
def test_a_chunked_continuation_sees_the_cached_prefix(arch):
    """T_total counts cached positions: a 100-token call after 50 cached ones observes
    [heads, 100, 150] patterns, as one step would."""
    ids = _ids(N)
    ref = _load(arch)
    ref.prefill(ids[:50]).wait()
    point = "model.layers.1.attention.pattern"
    want = ref.inspect_prefill(ids[50:], cw.ObservationRequest.exact([point, "model.layers.1.output"]))
    rt = _load(arch, prefill_chunk=7)
    rt.prefill(ids[:50]).wait()
    got = rt.inspect_prefill(ids[50:], cw.ObservationRequest.exact([point, "model.layers.1.output"]))
    assert got.observations[point].shape == want.observations[point].shape == (
        want.observations[point].shape[0], 100, 150)
    for h in range(got.observations[point].shape[0]):
        _assert_rows_close(got.observations[point][h], want.observations[point][h], f"{point} head {h}")
    _assert_rows_close(got.observations["model.layers.1.output"], want.observations["model.layers.1.output"],
                       "model.layers.1.output")
    assert rt.session.position == N


@pytest.mark.parametrize("arch", ["llama", "gemma3", "qwen3_moe"])
def test_interventions_apply_at_their_positions_in_whichever_chunk(arch):
    rt = _load(arch)
    hidden = rt.model_info["hidden_size"]
    rng = np.random.default_rng(5)
    edits = [
        cw.Intervention.add("model.layers.1.input", rng.normal(size=hidden).tolist(), scale=2.0,
                            positions=[3, 40, 130]),
        cw.Intervention.set("model.layers.0.output", rng.normal(size=hidden).tolist(), positions=[70]),
    ]
    ids = _ids(N)
    clean = rt.prefill(ids, all_logits=True).wait().logits
    rt.session.reset()
    one_step = rt.prefill(ids, all_logits=True, interventions=edits).wait().logits
    # The edits change the rows at and after their positions, not before.
    assert rel_l2(one_step[3], clean[3]) > 1e-3
    _assert_rows_close(one_step[:3], clean[:3], "rows before the first edit")
    chunked = _load(arch, prefill_chunk=7)
    _assert_rows_close(chunked.prefill(ids, all_logits=True, interventions=edits).wait().logits, one_step,
                       "edited logits")
    # Kept edits (set on the session) too, observed along the way.
    chunked.session.reset()
    chunked.interventions = edits
    out = chunked.inspect_prefill(ids, cw.ObservationRequest.exact(["model.layers.1.input"]), all_logits=True)
    _assert_rows_close(out.output.logits, one_step, "logits under kept edits")
    assert out.observations["model.layers.1.input"].shape == (N, hidden)


def test_the_default_chunk_is_512_tokens_and_forks_keep_the_runtimes():
    assert _load("llama").session.prefill_chunk == 512
    rt = _load("llama", prefill_chunk=9)
    assert rt.fork().session.prefill_chunk == 9


@pytest.mark.parametrize("value", [0, -1])
def test_a_chunk_below_one_token_is_refused(value):
    with pytest.raises(cw.InvalidOptionError, match="prefill_chunk"):
        _load("llama", prefill_chunk=value)


def test_a_chunk_that_is_not_an_int_is_a_type_error():
    with pytest.raises(TypeError, match="prefill_chunk"):
        _load("llama", prefill_chunk=2.5)
