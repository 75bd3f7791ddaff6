"""The step API against transformers' float32 reference on the six tiny checkpoints (DESIGN §7);
test_reference_more.py runs these comparisons on the architectures added since."""

import json

import numpy as np
import pytest

import candlewick
from conftest import DEVICE, TINY, rel_l2

TOL = 1e-4


def test_prompt_logits_match_row_by_row(runtime, ref):
    out = runtime.prefill(ref["input_ids"].tolist(), all_logits=True).wait()
    logits = out.logits
    assert logits.dtype == np.float32
    assert logits.shape == ref["model.logits"].shape
    for row, (a, r) in enumerate(zip(logits, ref["model.logits"])):
        assert rel_l2(a, r) <= TOL, f"row {row}"


def test_prefill_then_decode_reproduces_sequence_logits(runtime, ref):
    prompt, greedy, seq = ref["input_ids"].tolist(), ref["greedy_ids"].tolist(), ref["sequence_logits"]
    t = len(prompt)
    rows = [runtime.prefill(prompt).wait().logits[-1]]
    for g in greedy:
        rows.append(runtime.decode([g]).wait().logits[-1])
    # The last decode's row predicts past the reference sequence; the rest are checked.
    for k, row in enumerate(rows[:-1]):
        assert rel_l2(row, seq[t - 1 + k]) <= TOL, f"row {t - 1 + k}"
        assert int(np.argmax(row)) == greedy[k], f"greedy token {k}"
    assert runtime.session.position == t + len(greedy)


def test_decode_of_several_tokens_returns_a_row_for_each(runtime, ref):
    prompt, greedy, seq = ref["input_ids"].tolist(), ref["greedy_ids"].tolist(), ref["sequence_logits"]
    runtime.prefill(prompt)
    out = runtime.decode(greedy[:5]).wait()
    assert out.logits.shape == (5, seq.shape[1])
    assert out.start_position == len(prompt) and out.num_tokens == 5
    for k in range(5):
        assert rel_l2(out.logits[k], seq[len(prompt) + k]) <= TOL


def test_chunked_prefill_equals_one_prefill(runtime, ref):
    ids = ref["input_ids"].tolist()
    assert len(ids) == 20
    a = runtime.prefill(ids[:7], all_logits=True).wait().logits
    b = runtime.prefill(ids[7:], all_logits=True).wait().logits
    chunked = np.concatenate([a, b])
    for row in range(20):
        assert rel_l2(chunked[row], ref["model.logits"][row]) <= TOL


def test_truncate_then_prefill_rest_equals_full(runtime, ref):
    ids = ref["input_ids"].tolist()
    runtime.prefill(ids)
    runtime.session.truncate(10)
    assert runtime.session.position == 10
    rest = runtime.prefill(ids[10:], all_logits=True).wait().logits
    for k, row in enumerate(rest):
        assert rel_l2(row, ref["model.logits"][10 + k]) <= TOL


def test_reset_then_same_prompt_gives_same_logits(runtime, ref):
    ids = ref["input_ids"].tolist()
    first = runtime.prefill(ids).wait().logits
    runtime.session.reset()
    assert runtime.session.position == 0
    again = runtime.prefill(ids).wait().logits
    np.testing.assert_array_equal(first, again)


def test_submission_and_observe_output(runtime, ref):
    sub = runtime.prefill(ref["input_ids"].tolist())
    assert sub.is_complete() in (True, False)
    out = sub.wait()
    assert sub.is_complete()
    obs = runtime.observe_output(out)
    assert list(obs.keys()) == ["model.logits"]
    np.testing.assert_array_equal(obs["model.logits"], out.logits)


@pytest.mark.parametrize("dtype,bound", [("bf16", 2e-2), ("f16", 5e-3)])
def test_half_precision_stays_within_stated_bound(case, ref, dtype, bound):
    rt = candlewick.ModelRuntime.load(TINY / case, device=DEVICE, dtype=dtype)
    assert rt.model_info["dtype"] == dtype
    logits = rt.prefill(ref["input_ids"].tolist(), all_logits=True).wait().logits
    for row, (a, r) in enumerate(zip(logits, ref["model.logits"])):
        assert rel_l2(a, r) <= bound, f"{dtype} row {row}"


def test_model_info_describes_the_checkpoint(runtime, case):
    info = runtime.model_info
    cfg = json.loads((TINY / case / "config.json").read_text())
    assert info["architecture"] == case
    assert info["vocab_size"] == 512 and info["hidden_size"] == 64
    # GPT-2 spells the layer count `n_layer`.
    assert info["num_layers"] == cfg.get("num_hidden_layers", cfg.get("n_layer"))
    assert info["max_context"] == info["context_length"] == 512
    assert info["dtype"] == "f32" and info["device"] == DEVICE.split(":")[0]
    caps = runtime.capabilities
    assert caps.persistent_cache and caps.output_observation and caps.activation_inspection
