"""The architectures beyond the first six (DESIGN §10) against transformers' float32 references
in fixtures/tiny/<arch>/: the same step-API and inspection comparisons as the first six, run
here with the `case` fixture over these architectures, plus the two edit points of DESIGN §8
checked against the checkpoint's own output projections (the references do not store them)."""

import json

import numpy as np
import pytest
from safetensors.numpy import load_file

import candlewick as cw
from conftest import BF16_GEMM_ROUNDS_ACTIVATIONS, DEVICE, TINY, rel_l2

# The comparisons of the first six, collected again in this module under its own `case`.
from test_inspection import (  # noqa: F401
    test_decode_after_prefill_gives_the_same_rows_as_full_prefill,
    test_empty_selection_yields_only_the_output,
    test_every_observation_point_matches,
    test_exact_selection,
    test_inspection_advances_the_session_like_plain_steps,
    test_observation_points_lists_every_path,
)
import test_reference_tiny
from test_reference_tiny import (  # noqa: F401
    test_chunked_prefill_equals_one_prefill,
    test_decode_of_several_tokens_returns_a_row_for_each,
    test_model_info_describes_the_checkpoint,
    test_prefill_then_decode_reproduces_sequence_logits,
    test_prompt_logits_match_row_by_row,
    test_reset_then_same_prompt_gives_same_logits,
    test_truncate_then_prefill_rest_equals_full,
)

MORE = ["gemma2", "olmo2", "smollm3", "granite", "gpt_neox", "gpt2"]
TOL = 1e-4


@pytest.fixture(params=MORE)
def case(request):
    """Each of the dense architectures added after the first six."""
    return request.param


# OLMo 2 in bfloat16 misses the bound on one row (row 10: 0.0202 against 0.02; the whole matrix
# 0.011, as llama's 0.009). The checkpoint's weights rounded to bfloat16 alone, computed in float32,
# already put its worst row at 0.0143 (llama's at 0.0118): this random checkpoint is more sensitive,
# not computed differently. The bound stays; the miss is recorded here and must keep happening
# (strict), so that a change that fixes it is noticed.
HALF_MISSES = {("olmo2", "bf16"): "one row at 0.0202 > 0.02 (weights' bf16 rounding alone: 0.0143)"}


@pytest.mark.parametrize("dtype,bound", [("bf16", 2e-2), ("f16", 5e-3)])
def test_half_precision_stays_within_stated_bound(request, case, ref, dtype, bound):
    # The bfloat16 misses come from activations rounded to bfloat16 (conftest): where the CPU
    # keeps them float32, those rows are within the bound.
    if (case, dtype) in HALF_MISSES and (dtype != "bf16" or BF16_GEMM_ROUNDS_ACTIVATIONS):
        request.applymarker(pytest.mark.xfail(strict=True, reason=HALF_MISSES[(case, dtype)]))
    test_reference_tiny.test_half_precision_stays_within_stated_bound(case, ref, dtype, bound)


def test_supported_architectures_lists_every_case():
    names = cw.supported_architectures()
    assert set(MORE) <= set(names)
    assert {"llama", "mistral", "qwen2", "qwen3", "gemma3", "phi3"} <= set(names)
    assert set(cw.supported_architectures("gguf")) <= set(names)


# (output projection of the heads, down projection of the MLP hidden state, post-norm after
# each or None, whether the weights are GPT-2 Conv1D [in, out]) by architecture.
PROJECTIONS = {
    "gemma2": ("model.layers.{i}.self_attn.o_proj", "model.layers.{i}.mlp.down_proj",
               ("model.layers.{i}.post_attention_layernorm", "model.layers.{i}.post_feedforward_layernorm"), False),
    "olmo2": ("model.layers.{i}.self_attn.o_proj", "model.layers.{i}.mlp.down_proj",
              ("model.layers.{i}.post_attention_layernorm", "model.layers.{i}.post_feedforward_layernorm"), False),
    "smollm3": ("model.layers.{i}.self_attn.o_proj", "model.layers.{i}.mlp.down_proj", None, False),
    "granite": ("model.layers.{i}.self_attn.o_proj", "model.layers.{i}.mlp.down_proj", None, False),
    "gpt_neox": ("gpt_neox.layers.{i}.attention.dense", "gpt_neox.layers.{i}.mlp.dense_4h_to_h", None, False),
    "gpt2": ("transformer.h.{i}.attn.c_proj", "transformer.h.{i}.mlp.c_proj", None, True),
}


def test_edit_points_are_the_inputs_of_the_output_projections(runtime, ref, case):
    """`attention.heads` and `mlp.hidden` (DESIGN §8) are what the attention output projection and
    the MLP down projection read: projecting them with the checkpoint's weights (and the post-norm
    where the architecture has one) gives the reference's `attention.output` / `mlp.output`."""
    weights = load_file(str(TINY / case / "model.safetensors"))
    cfg = json.loads((TINY / case / "config.json").read_text())
    o_name, down_name, post, conv1d = PROJECTIONS[case]
    got = runtime.inspect_prefill(ref["input_ids"].tolist()).observations
    gemma = case.startswith("gemma")

    def linear(x, stem):
        w = weights[stem + ".weight"].astype(np.float64)
        y = x @ (w if conv1d else w.T)
        return y + weights[stem + ".bias"] if stem + ".bias" in weights else y

    def rms(x, stem):
        w = weights[stem + ".weight"].astype(np.float64) + (1.0 if gemma else 0.0)
        return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + cfg["rms_norm_eps"]) * w

    for i in range(runtime.model_info["num_layers"]):
        heads = got[f"model.layers.{i}.attention.heads"].astype(np.float64)
        hidden = got[f"model.layers.{i}.mlp.hidden"].astype(np.float64)
        assert heads.shape == (20, runtime.model_info["num_heads"], runtime.model_info["head_dim"])
        a = linear(heads.reshape(20, -1), o_name.format(i=i))
        m = linear(hidden, down_name.format(i=i))
        if post:
            a, m = rms(a, post[0].format(i=i)), rms(m, post[1].format(i=i))
        assert rel_l2(a, ref[f"model.layers.{i}.attention.output"]) <= TOL, i
        assert rel_l2(m, ref[f"model.layers.{i}.mlp.output"]) <= TOL, i


def test_smollm3_layers_without_rope_see_no_positions():
    """Layer 3 of the tiny SmolLM3 has no RoPE (`no_rope_layers`): a repeated token gets the same
    query and key at every position, so its first attention row is uniform over equal keys."""
    rt = cw.ModelRuntime.load(TINY / "smollm3", device=DEVICE)
    obs = rt.inspect_prefill([7] * 6, cw.ObservationRequest.select(["model.layers.3.attention.pattern"]))
    pattern = obs.observations["model.layers.3.attention.pattern"]
    np.testing.assert_allclose(pattern[:, 5, :], 1 / 6, rtol=1e-5)


def test_gpt2_positions_past_the_learned_table_are_an_error(tmp_path):
    import shutil

    dest = tmp_path / "gpt2"
    shutil.copytree(TINY / "gpt2", dest)
    rt = cw.ModelRuntime.load(dest, device=DEVICE, max_context=600)
    rt.prefill(list(range(3, 503)))
    with pytest.raises(cw.CandlewickError, match="learned positions"):
        rt.prefill(list(range(3, 23)))
