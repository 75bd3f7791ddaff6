"""Mixtures of experts (DESIGN §10) against transformers' float32 references in fixtures/tiny/<arch>/:
the step-API and inspection comparisons of the dense architectures, every observation point
(the routers' logits included), the expert weights each architecture's routing rule gives, and
edits of the two MoE points checked against a float64 re-computation from the safetensors."""

import json

import numpy as np
import pytest
from safetensors.numpy import load_file

import candlewick as cw
from candlewick import interventions as iv
from conftest import BF16_GEMM_ROUNDS_ACTIVATIONS, DEVICE, TINY, rel_l2

# The comparisons of the first six, collected again in this module under its own `case`.
from test_inspection import (  # noqa: F401
    test_decode_after_prefill_gives_the_same_rows_as_full_prefill,
    test_empty_selection_yields_only_the_output,
    test_exact_selection,
    test_inspection_advances_the_session_like_plain_steps,
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

MOE = ["qwen3_moe", "mixtral", "olmoe", "granitemoe", "gpt_oss"]
TOL = 1e-4


@pytest.fixture(params=MOE)
def case(request):
    """Each mixture-of-experts architecture."""
    return request.param


def config(case):
    return json.loads((TINY / case / "config.json").read_text())


def experts_of(cfg):
    return cfg.get("num_experts") or cfg["num_local_experts"]


def softmax(x):
    e = np.exp(x - x.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


def route(case, logits, k):
    """[T, E] mixing weights from router logits by the architecture's rule (DESIGN §10)."""
    order = np.argsort(-logits, axis=-1, kind="stable")[:, :k]
    weights = np.zeros_like(logits)
    if case in ("granitemoe", "gpt_oss"):
        top = softmax(np.take_along_axis(logits, order, -1))
    else:
        top = np.take_along_axis(softmax(logits), order, -1)
        if case == "mixtral" or config(case).get("norm_topk_prob"):
            top = top / top.sum(-1, keepdims=True)
    np.put_along_axis(weights, order, top, -1)
    return weights


# Top-k routing is discontinuous: where the reference's k-th and (k+1)-th router logits nearly tie,
# half-precision rounding picks the other expert and that row's logits move far. Row 15 of Mixtral
# (layer 2, margin 7.0e-4) and of OLMoE (layer 1, margin 3.8e-3) flip this way; no other row of any
# case exceeds the bound. The bound stays; the misses are recorded and must keep happening (strict).
HALF_MISSES = {
    ("mixtral", "bf16"): "row 15 routes to another expert (layer 2 top-2/3 margin 7.0e-4)",
    ("mixtral", "f16"): "row 15 routes to another expert (layer 2 top-2/3 margin 7.0e-4)",
    ("olmoe", "bf16"): "row 15 routes to another expert (layer 1 top-2/3 margin 3.8e-3)",
}


@pytest.mark.parametrize("dtype,bound", [("bf16", 2e-2), ("f16", 5e-3)])
def test_half_precision_stays_within_stated_bound(request, case, ref, dtype, bound):
    # The bfloat16 misses come from activations rounded to bfloat16 (conftest): where the CPU
    # keeps them float32, those rows are within the bound.
    if (case, dtype) in HALF_MISSES and (dtype != "bf16" or BF16_GEMM_ROUNDS_ACTIVATIONS):
        request.applymarker(pytest.mark.xfail(strict=True, reason=HALF_MISSES[(case, dtype)]))
    test_reference_tiny.test_half_precision_stays_within_stated_bound(case, ref, dtype, bound)


def test_every_observation_point_matches(runtime, ref, case):
    """Every point the reference stores, and every point the model lists: `mlp.hidden` only on
    dense layers, `mlp.router_logits` and `mlp.expert_weights` on the mixtures."""
    got = runtime.inspect_prefill(ref["input_ids"].tolist(), cw.ObservationRequest.all()).observations
    layers = runtime.model_info["num_layers"]
    stored = sorted(k for k in ref if k.startswith("model."))
    extra = {f"model.layers.{i}.{p}" for i in range(layers) for p in ("attention.heads", "mlp.expert_weights")}
    assert sorted(set(got.keys()) - extra) == stored
    for path in stored:
        assert got[path].shape == ref[path].shape, path
        assert rel_l2(got[path], ref[path]) <= TOL, path
    k = config(case)["num_experts_per_tok"]
    for i in range(layers):
        want = route(case, ref[f"model.layers.{i}.mlp.router_logits"].astype(np.float64), k)
        assert rel_l2(got[f"model.layers.{i}.mlp.expert_weights"], want) <= TOL, i
        assert np.all((got[f"model.layers.{i}.mlp.expert_weights"] > 0).sum(-1) == k)


def test_observation_points_lists_every_path(runtime, ref):
    """In forward order: the reference's points, each layer's heads, and its expert weights right
    after its router logits, where a dense layer would have `mlp.hidden`."""
    listed = runtime.observation_points()
    layers = runtime.model_info["num_layers"]
    extra = [f"model.layers.{i}.{p}" for i in range(layers) for p in ("attention.heads", "mlp.expert_weights")]
    assert sorted(k for k in listed if k not in extra) == sorted(k for k in ref if k.startswith("model."))
    assert set(extra) <= set(listed)
    for i in range(layers):
        at = listed.index(f"model.layers.{i}.mlp.router_logits")
        assert listed[at + 1] == f"model.layers.{i}.mlp.expert_weights"
        assert listed[at + 2] == f"model.layers.{i}.mlp.output"


def test_supported_architectures_and_model_info_name_the_experts(runtime, case):
    assert case in cw.supported_architectures() and case in cw.supported_architectures("hf")
    info = runtime.model_info
    cfg = config(case)
    assert info["num_experts"] == experts_of(cfg)
    assert info["experts_per_token"] == cfg["num_experts_per_tok"]
    assert info["shared_expert_intermediate_size"] is None


# Per architecture: (router, per-expert (gate, up, down) as [out, in] float64 arrays, residual
# multiplier, eps). Mirrors transformers' modules, written from the checkpoint's own tensors.
def layer_moe(case, w, i):
    cfg = config(case)
    E = experts_of(cfg)
    p = f"model.layers.{i}."
    if case in ("qwen3_moe", "olmoe", "mixtral"):
        m = p + ("block_sparse_moe." if case == "mixtral" else "mlp.")
        names = ("w1", "w3", "w2") if case == "mixtral" else ("gate_proj", "up_proj", "down_proj")
        router = (w[m + "gate.weight"], None)
        experts = [tuple((w[f"{m}experts.{e}.{n}.weight"], None) for n in names) for e in range(E)]
    elif case == "granitemoe":
        m = p + "block_sparse_moe."
        router = (w[m + "router.layer.weight"], None)
        gu, down = w[m + "input_linear.weight"], w[m + "output_linear.weight"]
        inter = gu.shape[1] // 2
        experts = [((gu[e, :inter], None), (gu[e, inter:], None), (down[e], None)) for e in range(E)]
    else:
        m = p + "mlp."
        router = (w[m + "router.weight"], w[m + "router.bias"])
        gu, gub = w[m + "experts.gate_up_proj"], w[m + "experts.gate_up_proj_bias"]
        down, db = w[m + "experts.down_proj"], w[m + "experts.down_proj_bias"]
        experts = [((gu[e][:, ::2].T, gub[e][::2]), (gu[e][:, 1::2].T, gub[e][1::2]), (down[e].T, db[e]))
                   for e in range(E)]
    return router, experts


def expert_out(case, experts, e, x):
    def lin(x, wb):
        y = x @ wb[0].T
        return y if wb[1] is None else y + wb[1]

    (g, u, d), cfg = experts[e], config(case)
    gate, up = lin(x, g), lin(x, u)
    if case == "gpt_oss":
        limit, alpha = cfg["swiglu_limit"], cfg.get("swiglu_alpha", 1.702)
        gate, up = np.minimum(gate, limit), np.clip(up, -limit, limit)
        h = (up + 1) * gate / (1 + np.exp(-alpha * gate))
    else:
        h = gate / (1 + np.exp(-gate)) * up
    return lin(h, d)


@pytest.mark.parametrize("case", MOE)
def test_forcing_and_ablating_experts_matches_a_float64_recomputation(case):
    """Adding 50 to one expert's router logit selects it at every position; scaling another's
    weight to 0 drops it from the mix. Layer 1's router logits, expert weights, MLP output and
    layer output follow a float64 re-computation from the checkpoint, and the logits equal those
    of a plain run with that MLP output patched in."""
    cfg = config(case)
    w = {k: v.astype(np.float64) for k, v in load_file(str(TINY / case / "model.safetensors")).items()}
    rt = cw.ModelRuntime.load(TINY / case, device=DEVICE)
    ids = load_file(str(TINY / case / "reference.safetensors"))["input_ids"].tolist()
    E, k, layer = experts_of(cfg), cfg["num_experts_per_tok"], 1
    plain = rt.trace(ids).observations
    base = route(case, plain[f"model.layers.{layer}.mlp.router_logits"].astype(np.float64), k)
    # Force the expert chosen least often; ablate the one chosen most often.
    forced, ablated = int(np.argmin((base > 0).sum(0))), int(np.argmax((base > 0).sum(0)))
    assert forced != ablated
    pre = f"model.layers.{layer}.mlp."
    onehot = np.zeros(E, dtype=np.float32)
    onehot[forced] = 50.0
    edits = [iv.add(pre + "router_logits", onehot), iv.scale(pre + "expert_weights", [ablated], 0.0)]
    out = rt.trace(ids, interventions=edits)
    got = out.observations

    x = got[f"model.layers.{layer}.input"].astype(np.float64)
    rm = cfg.get("residual_multiplier", 1.0)
    h = x + rm * got[f"model.layers.{layer}.attention.output"].astype(np.float64)
    eps = cfg["rms_norm_eps"]
    hn = h / np.sqrt((h * h).mean(-1, keepdims=True) + eps) * w[f"model.layers.{layer}.post_attention_layernorm.weight"]
    (rw, rb), experts = layer_moe(case, w, layer)
    logits = hn @ rw.T + (0 if rb is None else rb)
    logits[:, forced] += 50.0
    weights = route(case, logits, k)
    assert np.all(weights[:, forced] > 0)
    weights[:, ablated] = 0.0
    mix = np.zeros_like(hn)
    for e in range(E):
        rows = weights[:, e] != 0
        if rows.any():
            mix[rows] += weights[rows, e, None] * expert_out(case, experts, e, hn[rows])

    assert rel_l2(got[pre + "router_logits"], logits) <= TOL
    assert rel_l2(got[pre + "expert_weights"], weights) <= TOL
    assert rel_l2(got[pre + "output"], mix) <= TOL
    assert rel_l2(got[f"model.layers.{layer}.output"], h + rm * mix) <= TOL
    assert rel_l2(got[pre + "output"], plain[pre + "output"]) > 1e-2
    patched = rt.trace(ids, interventions=[iv.set(pre + "output", mix.astype(np.float32), range(len(ids)))])
    assert rel_l2(out.output.logits, patched.output.logits) <= TOL
    assert rel_l2(out.output.logits, rt.trace(ids).output.logits) > 1e-3


def test_q8_0_at_load_quantizes_the_experts_and_keeps_the_router_dense(case, ref):
    """Quantized at load (per-expert tensors and slices of fused 3-D ones alike), within DESIGN §7's
    quantized bound on the median row; the router stays dense, as llama.cpp's quantizer leaves it."""
    rt = cw.ModelRuntime.load(TINY / case, device=DEVICE, quantize="q8_0")
    quantized = rt.model_info["quantized_at_load"]["tensors"]
    assert any("experts" in name or "input_linear" in name for name in quantized)
    assert not any(name.endswith(("gate.weight", "router.weight", "router.layer.weight")) for name in quantized)
    logits = rt.prefill(ref["input_ids"].tolist(), all_logits=True).wait().logits
    assert np.median([rel_l2(a, r) for a, r in zip(logits, ref["model.logits"])]) <= 0.05


def test_mixtures_have_no_mlp_hidden_and_dense_models_no_router_points():
    rt = cw.ModelRuntime.load(TINY / "mixtral", device=DEVICE)
    points = rt.observation_points()
    assert "model.layers.0.mlp.router_logits" in points and "model.layers.0.mlp.expert_weights" in points
    assert "model.layers.0.mlp.hidden" not in points
    with pytest.raises(cw.CandlewickError):
        rt.trace([5, 6], cw.ObservationRequest.select(["model.layers.0.mlp.hidden"]))
    dense = cw.ModelRuntime.load(TINY / "llama", device=DEVICE)
    assert not any("router" in p or "expert" in p for p in dense.observation_points())


def test_bad_expert_configurations_are_typed_errors(tmp_path):
    import shutil

    for key, value, needle in [("num_experts_per_tok", 9, "num_experts_per_tok"),
                               ("num_local_experts", 0, "num_local_experts")]:
        dest = tmp_path / f"{key}-{value}"
        shutil.copytree(TINY / "mixtral", dest)
        cfg = config("mixtral")
        cfg[key] = value
        (dest / "config.json").write_text(json.dumps(cfg))
        with pytest.raises(cw.CandlewickError, match=needle):
            cw.ModelRuntime.load(dest, device=DEVICE)
    # A missing expert tensor is named.
    from safetensors.numpy import save_file

    dest = tmp_path / "missing"
    shutil.copytree(TINY / "mixtral", dest)
    tensors = load_file(str(dest / "model.safetensors"))
    gone = "model.layers.2.block_sparse_moe.experts.3.w2.weight"
    del tensors[gone]
    save_file(tensors, str(dest / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(cw.CandlewickError, match=gone.replace(".", r"\.")):
        cw.ModelRuntime.load(dest, device=DEVICE)


def test_gpt_oss_sinks_leave_rows_summing_below_one():
    rt = cw.ModelRuntime.load(TINY / "gpt_oss", device=DEVICE)
    pattern = rt.trace(list(range(3, 13))).observations["model.layers.1.attention.pattern"]
    sums = pattern.sum(-1)
    assert np.all(sums < 1.0) and np.all(sums > 0.0)


# GGUF files as llama.cpp's converter writes them, by tests/gguf_convert.py (the GGUF architectures
# branch; this test runs once both are merged): Qwen3-MoE (`qwen3moe`) and Mixtral (`llama` with
# `llama.expert_count`), whose 3-D `ffn_*_exps` tensors load expert by expert.
GGUF_MOE = ["qwen3_moe", "mixtral"]


@pytest.mark.parametrize("case", GGUF_MOE)
def test_gguf_mixtures_match_the_reference(tmp_path, case):
    gguf_convert = pytest.importorskip("gguf_convert")
    ref = load_file(str(TINY / case / "reference.safetensors"))
    ids = ref["input_ids"].tolist()
    f32 = gguf_convert.convert(TINY / case, tmp_path / "f32.gguf", outtype="f32")
    obs = cw.ModelRuntime.load(f32, device=DEVICE).trace(ids).observations
    for path in (k for k in ref if k.startswith("model.")):
        assert rel_l2(obs[path], ref[path]) <= TOL, path
    q8 = gguf_convert.convert(TINY / case, tmp_path / "q8_0.gguf", outtype="q8_0")
    rt = cw.ModelRuntime.load(q8, device=DEVICE)
    assert rt.model_info["num_experts"] == experts_of(config(case)) and "q8_0" in rt.model_info["weight_types"]
    logits = rt.prefill(ids, all_logits=True).wait().logits
    # DESIGN §7's quantized bound (median over rows); single rows move far where a near-tie routes
    # to another expert (Qwen3-MoE rows 5-6, Mixtral row 15: 0.19-0.24).
    assert np.median([rel_l2(a, r) for a, r in zip(logits, ref["model.logits"])]) <= 0.05


def test_mlp_only_layers_keep_a_dense_mlp(tmp_path):
    """Qwen3-MoE's `mlp_only_layers`: layer 1 of the tiny checkpoint given a dense MLP of
    `intermediate_size` instead of its experts. That layer has `mlp.hidden` and no router points, and
    its MLP output is the dense MLP of its input (float64 re-computation); the other layers still mix."""
    import shutil

    from safetensors.numpy import save_file

    dest = tmp_path / "qwen3_moe-dense-1"
    shutil.copytree(TINY / "qwen3_moe", dest)
    cfg = config("qwen3_moe")
    cfg["mlp_only_layers"] = [1]
    (dest / "config.json").write_text(json.dumps(cfg))
    tensors = {k: v for k, v in load_file(str(dest / "model.safetensors")).items() if ".layers.1.mlp." not in k}
    rng = np.random.default_rng(5)
    inter, hidden = cfg["intermediate_size"], cfg["hidden_size"]
    dense = {n: (0.1 * rng.standard_normal(s)).astype(np.float32)
             for n, s in [("gate_proj", (inter, hidden)), ("up_proj", (inter, hidden)), ("down_proj", (hidden, inter))]}
    tensors.update({f"model.layers.1.mlp.{n}.weight": v for n, v in dense.items()})
    save_file(tensors, str(dest / "model.safetensors"), metadata={"format": "pt"})
    rt = cw.ModelRuntime.load(dest, device=DEVICE)
    assert rt.model_info["moe_layers"] == 2
    points = rt.observation_points()
    assert "model.layers.1.mlp.hidden" in points and "model.layers.1.mlp.router_logits" not in points
    assert "model.layers.0.mlp.router_logits" in points and "model.layers.0.mlp.hidden" not in points
    got = rt.trace(load_file(str(TINY / "qwen3_moe" / "reference.safetensors"))["input_ids"].tolist()).observations
    h = got["model.layers.1.input"].astype(np.float64) + got["model.layers.1.attention.output"]
    w = tensors["model.layers.1.post_attention_layernorm.weight"].astype(np.float64)
    x = h / np.sqrt((h * h).mean(-1, keepdims=True) + cfg["rms_norm_eps"]) * w
    gate, up = x @ dense["gate_proj"].T.astype(np.float64), x @ dense["up_proj"].T.astype(np.float64)
    hidden_act = gate / (1 + np.exp(-gate)) * up
    assert rel_l2(got["model.layers.1.mlp.hidden"], hidden_act) <= TOL
    assert rel_l2(got["model.layers.1.mlp.output"], hidden_act @ dense["down_proj"].T.astype(np.float64)) <= TOL


@pytest.mark.parametrize("case", ["gpt_oss", "mixtral"])
def test_batched_engine_steps_route_each_sequence_as_alone(tmp_path, case):
    """The engine runs several sequences' rows through each MoE layer together (each expert over
    the rows of every sequence that chose it); each still gets its own greedy continuation."""
    import shutil

    from tokenizers import Tokenizer, models, pre_tokenizers

    dest = tmp_path / case
    shutil.copytree(TINY / case, dest)
    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(512)}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(dest / "tokenizer.json"))
    rt = cw.ModelRuntime.load(dest, device=DEVICE)
    greedy = dict(max_tokens=8, temperature=0.0, ignore_eos=True)
    prompts = [np.random.default_rng(i).integers(3, 512, size=5 + 3 * i).tolist() for i in range(6)]
    want = []
    for p in prompts:
        rt.session.reset()
        want.append(rt.generate(p, **greedy).token_ids)
    with cw.Engine(rt, max_batch_size=6) as engine:
        reqs = [engine.submit(p, **greedy) for p in prompts]
        got = [r.wait().token_ids for r in reqs]
    assert got == want
