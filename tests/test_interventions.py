"""Interventions against transformers' torch-hook references on the six tiny checkpoints
(docs/interventions.md; fixtures/tiny/<arch>/interventions.{json,safetensors}), and the
guarantees of the API: bad edits are typed errors that change nothing, kept edits persist,
`trace` leaves the session alone."""

import json

import numpy as np
import pytest
from safetensors.numpy import load_file

import candlewick as cw
from candlewick import interventions as iv
from conftest import TINY, rel_l2

TOL = 1e-4


def fixture(case):
    meta = json.loads((TINY / case / "interventions.json").read_text())
    return meta, load_file(str(TINY / case / "interventions.safetensors"))


def edits_of(spec, tensors):
    """The JSON edits of one reference case as candlewick interventions."""
    out = []
    for e in spec:
        point, op, pos = e["point"], e["op"], e.get("positions")
        if op == "add":
            out.append(iv.add(point, tensors[e["tensor"]], scale=e.get("scale", 1.0), positions=pos))
        elif op == "set":
            out.append(iv.set(point, tensors[e["tensor"]], positions=pos))
        elif op == "scale":
            out.append(iv.scale(point, e["index"], e["scale"], positions=pos))
        elif op == "project_out":
            out.append(iv.project_out(point, tensors[e["tensor"]], positions=pos))
        else:
            raise AssertionError(op)
    return out


CASE_NAMES = ["steer", "steer_positions", "head_ablation", "neuron_ablation", "patch", "project_out", "combined"]


@pytest.mark.parametrize("name", CASE_NAMES)
def test_kept_edits_reproduce_every_row_step_by_step(runtime, case, name):
    meta, t = fixture(case)
    assert name in meta["cases"]
    ids = t["sequence_ids"].tolist()
    want = t[f"{name}.sequence_logits"]
    n_prompt = meta["prompt_tokens"]
    runtime.interventions = edits_of(meta["cases"][name], t)
    rows = list(runtime.prefill(ids[:n_prompt], all_logits=True).wait().logits)
    for tok in ids[n_prompt:]:
        rows.append(runtime.decode([tok]).wait().logits[-1])
    # The last decode predicts past the sequence: the rest are the reference's rows.
    for row in range(len(ids)):
        assert rel_l2(rows[row], want[row]) <= TOL, f"{name} row {row}"
    # The edits really changed something: the clean run differs.
    assert rel_l2(want, t["clean.sequence_logits"]) > 1e-3


@pytest.mark.parametrize("name", CASE_NAMES)
def test_call_edits_in_one_prefill_reproduce_every_row(runtime, case, name):
    meta, t = fixture(case)
    ids = t["sequence_ids"].tolist()
    out = runtime.prefill(ids, all_logits=True, interventions=edits_of(meta["cases"][name], t)).wait().logits
    for row, (a, r) in enumerate(zip(out, t[f"{name}.sequence_logits"])):
        assert rel_l2(a, r) <= TOL, f"{name} row {row}"
    # A call's edits are for that call only.
    assert runtime.interventions == []
    runtime.session.reset()
    clean = runtime.prefill(ids, all_logits=True).wait().logits
    for row, (a, r) in enumerate(zip(clean, t["clean.sequence_logits"])):
        assert rel_l2(a, r) <= TOL, f"clean row {row}"


def test_new_points_match_the_reference(runtime, case):
    meta, t = fixture(case)
    prompt = t["sequence_ids"][: meta["prompt_tokens"]].tolist()
    got = runtime.inspect_prefill(prompt).observations
    for key in t:
        if key.endswith(("attention.heads", "mlp.hidden")):
            assert got[key].shape == t[key].shape, key
            assert rel_l2(got[key], t[key]) <= TOL, key


def test_unembed_is_the_logit_lens(runtime, case):
    meta, t = fixture(case)
    prompt = t["sequence_ids"][: meta["prompt_tokens"]].tolist()
    got = runtime.trace(prompt).observations
    for key in t:
        if key.startswith("lens."):
            point = key[len("lens.") :]
            lens = runtime.unembed(got[point])
            assert lens.shape == t[key].shape
            for row, (a, r) in enumerate(zip(lens, t[key])):
                assert rel_l2(a, r) <= TOL, f"{key} row {row}"


def test_edited_point_is_what_its_observation_returns(runtime, case):
    _, t = fixture(case)
    ids = t["sequence_ids"][:8].tolist()
    h = runtime.model_info["hidden_size"]
    v = np.arange(h, dtype=np.float32) / h
    plain = runtime.trace(ids, cw.ObservationRequest.exact(["model.layers.0.output"])).observations
    edited = runtime.trace(ids, cw.ObservationRequest.exact(["model.layers.0.output"]), [iv.add("model.layers.0.output", v)])
    np.testing.assert_allclose(
        edited.observations["model.layers.0.output"], plain["model.layers.0.output"] + v, rtol=0, atol=1e-6
    )


def test_trace_leaves_the_session_as_it_was(runtime, case):
    _, t = fixture(case)
    ids = t["sequence_ids"].tolist()
    runtime.prefill(ids[:5])
    before = runtime.cached_tokens()
    out = runtime.trace(ids[:12], cw.ObservationRequest.exact(["model.logits"]))
    assert out.output.logits.shape[0] == 12 and out.output.start_position == 0
    assert runtime.session.position == 5 and runtime.cached_tokens() == before
    # The cache is intact: continuing gives the reference's clean rows.
    rows = runtime.prefill(ids[5:12], all_logits=True).wait().logits
    for k, row in enumerate(rows):
        assert rel_l2(row, t["clean.sequence_logits"][5 + k]) <= TOL


def test_intervene_scope_restores_what_was_kept(runtime, case):
    _, t = fixture(case)
    keep = [iv.scale("model.layers.0.mlp.hidden", [1, 2], 0.0)]
    runtime.interventions = keep
    inner = [iv.add("model.layers.0.output", t["steer.vector"])]
    with runtime.intervene(inner):
        assert runtime.interventions == inner
    assert runtime.interventions == keep
    runtime.interventions = []
    assert runtime.interventions == []


def bad_edits(runtime):
    info = runtime.model_info
    h, heads = info["hidden_size"], info["num_heads"]
    n = info["num_layers"]
    return [
        ("unknown point", iv.add(f"model.layers.{n}.output", np.zeros(h)), "no such point"),
        ("misspelt point", iv.add("model.layers.0.outptu", np.zeros(h)), "no such point"),
        ("pattern", iv.scale("model.layers.0.attention.pattern", [0], 0.0), "observed but not edited"),
        ("wrong vector length", iv.add("model.layers.0.output", np.zeros(h + 1)), "expected"),
        ("head out of range", iv.scale("model.layers.0.attention.heads", [heads], 0.0), "out of range"),
        ("position past context", iv.add("model.layers.0.output", np.zeros(h), positions=[10**6]), "past the context"),
        ("zero direction", iv.project_out("model.layers.0.output", np.zeros(h)), "zero"),
        ("NaN vector", iv.add("model.layers.0.output", np.full(h, np.nan)), "not finite"),
        ("set rows", iv.set("model.layers.0.output", np.zeros(2 * h), positions=[1]), "expected"),
    ]


def test_bad_edits_are_typed_errors_that_change_nothing(runtime, case):
    _, t = fixture(case)
    ids = t["sequence_ids"][:6].tolist()
    keep = [iv.add("model.layers.0.output", t["steer.vector"])]
    runtime.interventions = keep
    runtime.prefill(ids)
    for what, edit, message in bad_edits(runtime):
        with pytest.raises(cw.InvalidInterventionError, match=message):
            runtime.interventions = [iv.scale("model.layers.0.mlp.hidden", [0], 0.0), edit]
        assert runtime.interventions == keep, what
        with pytest.raises(cw.InvalidInterventionError):
            runtime.prefill([5], interventions=[edit])
        with pytest.raises(cw.InvalidInterventionError):
            runtime.trace([5], interventions=[edit])
        assert runtime.session.position == 6 and runtime.cached_tokens() == ids, what
    assert isinstance(cw.InvalidInterventionError("x"), cw.CandlewickError)


def test_positions_cover_decoded_tokens_and_only_those(runtime, case):
    _, t = fixture(case)
    ids = t["sequence_ids"].tolist()
    h = runtime.model_info["hidden_size"]
    v = np.ones(h, dtype=np.float32)
    plain = runtime.trace(ids[:10]).output.logits
    edited = runtime.trace(ids[:10], interventions=[iv.add("model.layers.0.output", v, positions=[7])]).output.logits
    # Causal: rows before the edited position are untouched, from it on they change.
    np.testing.assert_array_equal(plain[:7], edited[:7])
    assert rel_l2(edited[7], plain[7]) > 1e-4


def test_a_cache_filled_under_other_edits_is_never_reused(tiny_with_tokenizer):
    """Changing the kept edits may continue the cache, but a new prompt never reuses positions
    computed under other edits (or a call's own)."""
    rt = cw.ModelRuntime.load(tiny_with_tokenizer, device="cpu")
    prompt = [5, 17, 200, 33, 90, 41, 7]
    greedy = dict(max_tokens=6, temperature=0.0, ignore_eos=True)
    edit = [iv.add("model.layers.1.output", np.full(64, 2.0, dtype=np.float32))]
    rt.generate(prompt, **greedy)
    rt.interventions = edit
    steered = rt.generate(prompt, **greedy)
    assert steered.usage["cached_tokens"] == 0
    fresh = cw.ModelRuntime.load(tiny_with_tokenizer, device="cpu")
    fresh.interventions = edit
    assert steered.token_ids == fresh.generate(prompt, **greedy).token_ids
    # Under the same edits the prefix is reused again.
    assert rt.generate(prompt, **greedy).usage["cached_tokens"] == len(prompt) - 1
    # A call's own edits make their positions unusable for the next prompt.
    rt.interventions = []
    rt.session.reset()
    rt.prefill(prompt, interventions=edit)
    assert rt.generate(prompt, **greedy).usage["cached_tokens"] == 0
