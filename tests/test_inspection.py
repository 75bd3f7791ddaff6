"""Named activation inspection against transformers' observation points (DESIGN §2)."""

import json
import shutil
from collections.abc import Mapping

import numpy as np
import pytest
from safetensors.numpy import save_file

import candlewick as cw
from conftest import TINY, rel_l2

TOL = 1e-4


def points(ref):
    return sorted(k for k in ref if k.startswith("model."))


# The two points that interventions added (docs/interventions.md); their reference values are in
# interventions.safetensors and are checked in test_interventions.py.
EDIT_POINTS = ("attention.heads", "mlp.hidden")


def test_every_observation_point_matches(runtime, ref, case):
    got = runtime.inspect_prefill(ref["input_ids"].tolist(), cw.ObservationRequest.all()).observations
    assert sorted(k for k in got.keys() if not k.endswith(EDIT_POINTS)) == points(ref)
    assert sum(k.endswith(EDIT_POINTS) for k in got.keys()) == 2 * runtime.model_info["num_layers"]
    for path in points(ref):
        assert got[path].shape == ref[path].shape, path
        assert rel_l2(got[path], ref[path]) <= TOL, path


def test_gemma_sliding_window_zeros_are_where_the_references_are():
    from conftest import reference

    ref = reference("gemma3")
    rt = cw.ModelRuntime.load(TINY / "gemma3", device="cpu")
    got = rt.inspect_prefill(ref["input_ids"].tolist()).observations
    for layer in range(4):
        path = f"model.layers.{layer}.attention.pattern"
        np.testing.assert_array_equal(got[path] == 0, ref[path] == 0, err_msg=path)
    # Layers 0-2 slide with a window of 6: query 19 sees keys 14..19 only.
    assert np.all(got["model.layers.0.attention.pattern"][:, 19, :14] == 0)
    assert np.all(got["model.layers.3.attention.pattern"][:, 19, :] > 0)


def row_slice(path, value, rows):
    """Rows of a point: [T, *] points by position, patterns [heads, T, L] by query."""
    return value[:, rows] if path.endswith("attention.pattern") else value[rows]


@pytest.mark.parametrize("one_call", [True, False])
def test_decode_after_prefill_gives_the_same_rows_as_full_prefill(runtime, ref, one_call):
    ids = ref["input_ids"].tolist()
    full = runtime.inspect_prefill(ids).observations
    runtime.session.reset()
    runtime.prefill(ids[:12])
    if one_call:
        parts = [runtime.inspect_decode(ids[12:]).observations]
    else:
        parts = [runtime.inspect_decode([t]).observations for t in ids[12:]]
    start = 12
    for part in parts:
        n = part["model.embed_tokens"].shape[0]
        for path in full.keys():
            got = part[path]
            want = row_slice(path, full[path], slice(start, start + n))
            if path.endswith("attention.pattern"):
                # The decode's pattern spans the cache so far; later keys are masked in the full pass.
                assert got.shape == (want.shape[0], n, start + n), path
                assert np.all(want[:, :, start + n:] == 0)
                want = want[:, :, : start + n]
            assert rel_l2(got, want) <= TOL, (path, start)
        start += n
    assert start == 20


def test_inspection_advances_the_session_like_plain_steps(runtime, ref):
    ids = ref["input_ids"].tolist()
    a = runtime.inspect_prefill(ids[:10], cw.ObservationRequest.select(["model.layers.0"]))
    assert runtime.session.position == 10
    b = runtime.decode(ids[10:12]).wait()
    assert b.start_position == 10
    assert a.output.logits.shape == (1, 512)
    assert rel_l2(b.logits[1], ref["model.logits"][11]) <= TOL


def test_empty_selection_yields_only_the_output(runtime, ref):
    r = runtime.inspect_prefill(ref["input_ids"].tolist(), cw.ObservationRequest.select([]))
    assert len(r.observations) == 0
    assert rel_l2(r.output.logits[0], ref["model.logits"][-1]) <= TOL


def test_unknown_point_is_an_error_naming_it(runtime):
    with pytest.raises(cw.ObservationError, match=r"model\.layers\.99"):
        runtime.inspect_prefill([3, 4], cw.ObservationRequest.select(["model.layers.99"]))
    with pytest.raises(cw.ObservationError, match="model.layers.0.outpu"):
        runtime.inspect_prefill([3, 4], cw.ObservationRequest.exact(["model.layers.0.outpu"]))
    assert runtime.session.position == 0


def test_exact_selection(runtime, ref):
    r = runtime.inspect_prefill(ref["input_ids"].tolist(), cw.ObservationRequest.exact(["model.logits", "model.norm"]))
    assert sorted(r.observations.keys()) == ["model.logits", "model.norm"]
    assert r.observations["model.logits"].shape == ref["model.logits"].shape


def test_observation_set_is_a_read_only_mapping(runtime, ref):
    obs = runtime.inspect_prefill(ref["input_ids"].tolist(), cw.ObservationRequest.select(["model.norm"])).observations
    assert isinstance(obs, Mapping)
    assert "model.norm" in obs and "model.logits" not in obs
    assert dict(obs.items()).keys() == {"model.norm"}
    arr = obs["model.norm"]
    assert arr.dtype == np.float32
    with pytest.raises(ValueError):
        arr[0, 0] = 1.0
    with pytest.raises(KeyError):
        obs["model.logits"]
    with pytest.raises(TypeError):
        obs["model.norm"] = arr


def test_observation_points_lists_every_path(runtime, ref):
    listed = runtime.observation_points()
    assert sorted(k for k in listed if not k.endswith(EDIT_POINTS)) == points(ref)
    layers = runtime.model_info["num_layers"]
    assert sorted(k for k in listed if k.endswith(EDIT_POINTS)) == sorted(
        f"model.layers.{i}.{p}" for i in range(layers) for p in EDIT_POINTS
    )


@pytest.fixture(scope="module")
def deep_llama(tmp_path_factory):
    """The tiny llama config with 12 layers and fresh random weights."""
    dest = tmp_path_factory.mktemp("deep") / "llama12"
    shutil.copytree(TINY / "llama", dest)
    cfg = json.loads((dest / "config.json").read_text())
    cfg["num_hidden_layers"] = 12
    (dest / "config.json").write_text(json.dumps(cfg))
    rng = np.random.default_rng(0)
    t = {"model.embed_tokens.weight": (512, 64), "model.norm.weight": (64,), "lm_head.weight": (512, 64)}
    for i in range(12):
        p = f"model.layers.{i}."
        t.update({p + "input_layernorm.weight": (64,), p + "post_attention_layernorm.weight": (64,),
                  p + "self_attn.q_proj.weight": (64, 64), p + "self_attn.k_proj.weight": (32, 64),
                  p + "self_attn.v_proj.weight": (32, 64), p + "self_attn.o_proj.weight": (64, 64),
                  p + "mlp.gate_proj.weight": (128, 64), p + "mlp.up_proj.weight": (128, 64),
                  p + "mlp.down_proj.weight": (64, 128)})
    save_file({k: (0.1 * rng.standard_normal(s)).astype(np.float32) for k, s in t.items()},
              str(dest / "model.safetensors"))
    return dest


def test_prefix_matches_whole_segments(deep_llama):
    rt = cw.ModelRuntime.load(deep_llama, device="cpu")
    obs = rt.inspect_prefill([3, 4, 5], cw.ObservationRequest.select(["model.layers.1"])).observations
    assert sorted(obs.keys()) == sorted(
        f"model.layers.1.{p}"
        for p in ["input", "attention.output", "attention.pattern", "mlp.output", "output", *EDIT_POINTS]
    )
    obs = rt.inspect_prefill([6], cw.ObservationRequest.select(["model.layers.11.output", "model.logits"])).observations
    assert sorted(obs.keys()) == ["model.layers.11.output", "model.logits"]
    assert obs["model.logits"].shape == (1, 512)
