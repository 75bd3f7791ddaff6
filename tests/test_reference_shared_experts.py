"""Mixtures with a shared expert (DESIGN §10): Qwen2-MoE (a sigmoid-gated shared expert) and
Granite MoE Shared, against transformers' float32 references
(tests/shared_expert_fixtures.py: the checkpoints are rebuilt from a seed, the references stored),
as Hugging Face directories and as the GGUF files llama.cpp's converter writes from them, with
the bounds of tests/test_reference_tiny.py (1e-4) and tests/test_reference_gguf.py (DESIGN §7)."""

import json

import numpy as np
import pytest
from safetensors.numpy import load_file

import candlewick as cw
import gguf_convert
import shared_expert_fixtures as fixtures
from candlewick import interventions as iv
from conftest import DEVICE, rel_l2

# The step-API comparisons of the first six and the GGUF comparisons of every tiny fixture,
# collected again here over this module's `runtime`, `ref` and `gguf_file`.
from test_reference_tiny import (  # noqa: F401
    test_chunked_prefill_equals_one_prefill,
    test_decode_of_several_tokens_returns_a_row_for_each,
    test_prefill_then_decode_reproduces_sequence_logits,
    test_prompt_logits_match_row_by_row,
    test_truncate_then_prefill_rest_equals_full,
)
from test_reference_moe import experts_of, softmax
from test_reference_gguf import (  # noqa: F401
    llama_cpp_reads_as_the_reference,
    test_f32_every_observation_point,
    test_f32_greedy_continuation,
    test_f32_teacher_forced_top20,
    test_q8_0_every_observation_point,
    test_q8_0_teacher_forced,
)

CASES = list(fixtures.CASES)
TOL = 1e-4


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("shared-experts")
    return {case: fixtures.materialise(case, root / case) for case in CASES}


@pytest.fixture(params=CASES)
def case(request):
    return request.param


@pytest.fixture
def ref(case):
    return fixtures.reference(case)


@pytest.fixture
def runtime(checkpoints, case):
    return cw.ModelRuntime.load(checkpoints[case], device=DEVICE)


@pytest.fixture(scope="module")
def gguf_file(checkpoints, tmp_path_factory):
    root = tmp_path_factory.mktemp("shared-experts-gguf")
    made = {}

    def make(case, outtype):
        if (case, outtype) not in made:
            made[case, outtype] = gguf_convert.convert(checkpoints[case], root / f"{case}.{outtype}.gguf", outtype)
        return made[case, outtype]

    return make


def config(case):
    return json.loads((fixtures.DATA / case / "config.json").read_text())


def route(case, logits, k):
    """[T, E] mixing weights: Qwen2-MoE's softmax then top-k (renormalised only with
    `norm_topk_prob`), Granite's softmax over the top-k logits."""
    order = np.argsort(-logits, axis=-1, kind="stable")[:, :k]
    weights = np.zeros_like(logits)
    if case == "granitemoeshared":
        top = softmax(np.take_along_axis(logits, order, -1))
    else:
        top = np.take_along_axis(softmax(logits), order, -1)
        if config(case).get("norm_topk_prob"):
            top = top / top.sum(-1, keepdims=True)
    np.put_along_axis(weights, order, top, -1)
    return weights


def test_supported_and_described(runtime, case):
    arch = {"granitemoeshared": "granitemoe"}.get(case, case)
    assert arch in cw.supported_architectures("hf") and arch in cw.supported_architectures("gguf")
    info, cfg = runtime.model_info, config(case)
    assert info["architecture"] == arch
    assert (info["num_experts"], info["experts_per_token"]) == (experts_of(cfg), cfg["num_experts_per_tok"])
    width = cfg.get("shared_expert_intermediate_size") or cfg["shared_intermediate_size"]
    assert info["shared_expert_intermediate_size"] == width


def test_every_observation_point_matches(runtime, ref, case):
    """Every point the reference stores (`mlp.output` with the shared expert added), and the
    expert weights by the routing rule."""
    got = runtime.inspect_prefill(ref["input_ids"].tolist(), cw.ObservationRequest.all()).observations
    stored = sorted(k for k in ref if k.startswith("model."))
    derived = ("attention.heads", "mlp.expert_weights")
    assert sorted(k for k in got.keys() if not k.endswith(derived)) == stored
    for path in stored:
        assert got[path].shape == ref[path].shape, path
        assert rel_l2(got[path], ref[path]) <= TOL, path
    k = config(case)["num_experts_per_tok"]
    for i in range(runtime.model_info["num_layers"]):
        want = route(case, ref[f"model.layers.{i}.mlp.router_logits"].astype(np.float64), k)
        assert rel_l2(got[f"model.layers.{i}.mlp.expert_weights"], want) <= TOL, i


def _lin(x, w):
    return x @ w.T


def _swiglu(x, gate, up, down):
    g, u = _lin(x, gate), _lin(x, up)
    return _lin(g / (1 + np.exp(-g)) * u, down)


def layer_parts(case, w, i):
    """Layer `i`'s router, experts and shared expert (gate, up, down as [out, in] float64) and
    the shared expert's gate (or None), from the checkpoint's own tensors."""
    cfg, p = config(case), f"model.layers.{i}."
    E = experts_of(cfg)
    if case == "qwen2_moe":
        m = p + "mlp."
        names = ("gate_proj", "up_proj", "down_proj")
        experts = [tuple(w[f"{m}experts.{e}.{n}.weight"] for n in names) for e in range(E)]
        shared = tuple(w[f"{m}shared_expert.{n}.weight"] for n in names)
        return w[m + "gate.weight"], experts, shared, w[m + "shared_expert_gate.weight"]
    m = p + "block_sparse_moe."
    gu, down = w[m + "input_linear.weight"], w[m + "output_linear.weight"]
    inter = gu.shape[1] // 2
    experts = [(gu[e, :inter], gu[e, inter:], down[e]) for e in range(E)]
    sgu, sinter = w[p + "shared_mlp.input_linear.weight"], cfg["shared_intermediate_size"]
    shared = (sgu[:sinter], sgu[sinter:], w[p + "shared_mlp.output_linear.weight"])
    return w[m + "router.layer.weight"], experts, shared, None


def test_forcing_and_ablating_experts_leaves_the_shared_expert_running(checkpoints, case):
    """Forcing one expert and ablating another through the router points changes the routed mix
    only: layer 2's MLP output follows a float64 re-computation in which the shared expert (and
    Qwen2-MoE's sigmoid gate on it) runs for every token as before."""
    cfg = config(case)
    w = {k: v.astype(np.float64) for k, v in load_file(str(checkpoints[case] / "model.safetensors")).items()}
    rt = cw.ModelRuntime.load(checkpoints[case], device=DEVICE)
    ids = fixtures.reference(case)["input_ids"].tolist()
    E, k, layer = experts_of(cfg), cfg["num_experts_per_tok"], 2
    pre = f"model.layers.{layer}.mlp."
    plain = rt.trace(ids).observations
    base = route(case, plain[pre + "router_logits"].astype(np.float64), k)
    forced, ablated = int(np.argmin((base > 0).sum(0))), int(np.argmax((base > 0).sum(0)))
    assert forced != ablated
    onehot = np.zeros(E, dtype=np.float32)
    onehot[forced] = 50.0
    got = rt.trace(ids, interventions=[iv.add(pre + "router_logits", onehot),
                                       iv.scale(pre + "expert_weights", [ablated], 0.0)]).observations

    x = got[f"model.layers.{layer}.input"].astype(np.float64)
    rm = cfg.get("residual_multiplier", 1.0)
    h = x + rm * got[f"model.layers.{layer}.attention.output"].astype(np.float64)
    hn = h / np.sqrt((h * h).mean(-1, keepdims=True) + cfg["rms_norm_eps"])
    hn = hn * w[f"model.layers.{layer}.post_attention_layernorm.weight"]
    router, experts, shared, shared_gate = layer_parts(case, w, layer)
    logits = _lin(hn, router)
    logits[:, forced] += 50.0
    weights = route(case, logits, k)
    weights[:, ablated] = 0.0
    mix = _swiglu(hn, *shared)
    if shared_gate is not None:
        mix = mix / (1 + np.exp(-_lin(hn, shared_gate)))
    for e in range(E):
        rows = weights[:, e] != 0
        if rows.any():
            mix[rows] += weights[rows, e, None] * _swiglu(hn[rows], *experts[e])

    assert rel_l2(got[pre + "router_logits"], logits) <= TOL
    assert rel_l2(got[pre + "expert_weights"], weights) <= TOL
    assert rel_l2(got[pre + "output"], mix) <= TOL
    assert rel_l2(got[f"model.layers.{layer}.output"], h + rm * mix) <= TOL
    assert rel_l2(got[pre + "output"], plain[pre + "output"]) > 1e-2


def test_gguf_files_hold_the_shared_expert(gguf_file, case):
    """The converter's files: `ffn_{gate,up,down}_shexp`, Qwen2-MoE's `ffn_gate_inp_shexp`, and
    `expert_shared_feed_forward_length`."""
    import gguf

    reader = gguf.GGUFReader(gguf_file(case, "f32"))
    names = {t.name for t in reader.tensors}
    for part in ("gate", "up", "down"):
        assert f"blk.0.ffn_{part}_shexp.weight" in names
    assert ("blk.0.ffn_gate_inp_shexp.weight" in names) == (case == "qwen2_moe")
    arch = reader.fields["general.architecture"].contents()
    cfg = config(case)
    width = cfg.get("shared_expert_intermediate_size") or cfg["shared_intermediate_size"]
    assert reader.fields[f"{arch}.expert_shared_feed_forward_length"].contents() == width


@pytest.mark.llama_cpp
def test_llama_cpp_reads_the_files_as_the_reference(gguf_file, case, ref):
    """The same files through llama.cpp, where it is installed (measured with llama-cpp-python
    0.3.36: top-20 rel L2 max 4.7e-7 on Qwen2-MoE, 2.7e-7 on Granite MoE Shared)."""
    llama_cpp_reads_as_the_reference(gguf_file(case, "f32"), ref, case)


def test_shared_expert_without_its_width_is_a_typed_error(checkpoints, tmp_path):
    import shutil

    dest = tmp_path / "no-width"
    shutil.copytree(checkpoints["qwen2_moe"], dest)
    cfg = config("qwen2_moe")
    del cfg["shared_expert_intermediate_size"]
    (dest / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(cw.CandlewickError, match="shared_expert_intermediate_size"):
        cw.ModelRuntime.load(dest, device=DEVICE)
