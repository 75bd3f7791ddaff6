"""LoRA adapters (DESIGN §16, docs/adapters.md) against peft + transformers on the tiny
checkpoints: PEFT directories and llama.cpp's GGUF LoRA, per call, per session, in the engine,
and the errors of adapters that do not fit. References: tests/adapter_fixtures.py."""

import json
import urllib.error
import shutil
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

import candlewick as cw
from adapter_fixtures import ADAPTERS, materialise
from conftest import TINY, rel_l2

DATA = Path(__file__).resolve().parent / "data" / "adapters"
REF = load_file(str(DATA / "reference.safetensors"))
META = json.loads((DATA / "reference.json").read_text())["adapters"]
TOL = 1e-4  # DESIGN §7, float32 against float32
GREEDY = dict(max_tokens=8, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def adapters(tmp_path_factory):
    return materialise(tmp_path_factory.mktemp("adapters"))


def prompt_of(arch):
    return load_file(str(TINY / arch / "reference.safetensors"))["input_ids"].astype(np.int64).tolist()


def points_of(name):
    return {k.split("/", 1)[1]: v for k, v in REF.items() if k.startswith(name + "/")}


def check_against_peft(out, name):
    """Every stored point of the adapter's PEFT run, within DESIGN §7's bound."""
    obs = out.observations
    for point, want in points_of(name).items():
        got = out.output.logits if point == "logits" else obs[f"model.{point}"]
        assert rel_l2(got, want) <= TOL, (name, point, rel_l2(got, want))


@pytest.fixture(scope="module")
def with_tokenizer(tmp_path_factory):
    """The tiny qwen2 checkpoint with a word-level tokenizer, so generation runs."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    dest = tmp_path_factory.mktemp("tiny-tok") / "qwen2"
    shutil.copytree(TINY / "qwen2", dest)
    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(512)}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(dest / "tokenizer.json"))
    return dest


def request():
    points = ["model.logits", "model.norm"] + [f"model.layers.{i}.output" for i in range(3)]
    return cw.ObservationRequest.exact(points)


@pytest.mark.parametrize("name", list(ADAPTERS))
def test_peft_adapter_matches_peft(adapters, name):
    arch = ADAPTERS[name][0]
    rt = cw.ModelRuntime.load(TINY / arch, device="cpu")
    info = rt.load_adapter(adapters[name], name=name)
    assert info["format"] == "peft" and info["name"] == name
    ids = prompt_of(arch)
    out = rt.trace(ids, request(), adapters=name)
    check_against_peft(out, name)
    # The adapter changes the output (the comparison above is not the base model's).
    base = rt.trace(ids, request())
    assert rel_l2(base.output.logits, REF[f"{name}/logits"]) > 1e-2


@pytest.mark.parametrize("name", [n for n in ADAPTERS if n != "qwen2_embed"])
def test_merged_adapter_matches_peft_with_no_adapter_chosen(adapters, name):
    arch = ADAPTERS[name][0]
    rt = cw.ModelRuntime.load(TINY / arch, device="cpu")
    ids = prompt_of(arch)
    rt.trace(ids, request())
    info = rt.load_adapter(adapters[name], name=name, merge=True)
    assert info["merged"] and info["name"] == name
    # Folded into the weights: every call runs with it, and nothing is chosen per call.
    check_against_peft(rt.trace(ids, request()), name)
    assert rt.active_adapters == {} and [a["merged"] for a in rt.adapters] == [True]
    with pytest.raises(cw.AdapterError, match="merged into the weights"):
        rt.unload_adapter(name)
    with pytest.raises(cw.AdapterError, match="already loaded"):
        rt.load_adapter(adapters[name], name=name, merge=True)


def test_embedding_lora_runs_beside_the_table_and_is_not_merged(adapters, with_tokenizer):
    rt = cw.ModelRuntime.load(with_tokenizer, device="cpu")
    ids = prompt_of("qwen2")
    rt.load_adapter(adapters["qwen2_embed"], name="e")
    check_against_peft(rt.trace(ids, request(), adapters="e"), "qwen2_embed")
    # Batched beside the base model: each sequence as PEFT's greedy run and the base alone.
    plain = rt.generate(ids, **GREEDY).token_ids
    with cw.Engine(rt, max_batch_size=4) as engine:
        reqs = [engine.submit(ids, adapters=a, **GREEDY) for a in ["e", None, "e"]]
        for r in reqs:
            "".join(r)
        got = [r.result.token_ids for r in reqs]
    want = META["qwen2_embed"]["greedy_ids"]
    assert got == [want, plain, want]
    base = rt.trace(ids, request()).output.logits
    with pytest.raises(cw.AdapterError, match="embedding LoRA"):
        rt.load_adapter(adapters["qwen2_embed"], name="m", merge=True)
    np.testing.assert_array_equal(rt.trace(ids, request()).output.logits, base)


def test_merge_is_refused_for_quantized_weights_and_shared_models(adapters, with_tokenizer):
    rt = cw.ModelRuntime.load(TINY / "qwen2", device="cpu", quantize="q8_0")
    ids = prompt_of("qwen2")
    before = rt.trace(ids, request()).output.logits
    with pytest.raises(cw.AdapterError, match="merge needs dense weights"):
        rt.load_adapter(adapters["qwen2_r4"], name="a", merge=True)
    # Nothing changed: no adapter, the same outputs, the cached prompt still reused.
    assert rt.adapters == []
    np.testing.assert_array_equal(rt.trace(ids, request()).output.logits, before)
    rt = cw.ModelRuntime.load(with_tokenizer, device="cpu")
    with cw.Engine(rt, max_batch_size=2):
        with pytest.raises(cw.AdapterError, match="shared with"):
            rt.load_adapter(adapters["qwen2_r4"], name="a", merge=True)
    # Once the engine is closed the model is the runtime's alone again.
    rt.load_adapter(adapters["qwen2_r4"], name="a", merge=True)
    assert rt.generate(prompt_of("qwen2"), **GREEDY).token_ids == META["qwen2_r4"]["greedy_ids"]


def test_gguf_lora_from_convert_lora_to_gguf_matches_peft():
    rt = cw.ModelRuntime.load(TINY / "qwen2", device="cpu")
    info = rt.load_adapter(DATA / "qwen2_r4.gguf")
    assert info["format"] == "gguf" and info["name"] == "qwen2_r4" and info["rank"] == 4
    out = rt.trace(prompt_of("qwen2"), request(), adapters="qwen2_r4")
    check_against_peft(out, "qwen2_r4")


def test_llama_q_k_rows_between_gguf_and_hugging_face(adapters, tmp_path):
    """llama.cpp's converter permutes the Llama family's q/k rows, and its LoRA converter permutes
    q's and k's lora_B alike: a PEFT adapter on a GGUF llama base, and a GGUF LoRA on a Hugging
    Face llama base, are reordered to fit (llama_r8 adapts q_proj)."""
    import gguf_convert
    from adapter_fixtures import ADAPTERS as SPECS, write_gguf_lora

    ids = prompt_of("llama")
    base = gguf_convert.convert(TINY / "llama", tmp_path / "llama.gguf", gguf_convert.F32)
    rt = cw.ModelRuntime.load(base, device="cpu")
    rt.load_adapter(adapters["llama_r8"], name="peft")
    check_against_peft(rt.trace(ids, request(), adapters="peft"), "llama_r8")
    config = json.loads((TINY / "llama" / "config.json").read_text())
    heads = (config["num_attention_heads"], config["num_key_value_heads"])
    factors = load_file(str(adapters["llama_r8"] / "adapter_model.safetensors"))
    lora = write_gguf_lora(tmp_path / "llama_r8.gguf", factors, "llama", SPECS["llama_r8"][2], heads)
    rt.load_adapter(lora, name="gguf")
    check_against_peft(rt.trace(ids, request(), adapters="gguf"), "llama_r8")
    hf = cw.ModelRuntime.load(TINY / "llama", device="cpu")
    hf.load_adapter(lora, name="gguf")
    check_against_peft(hf.trace(ids, request(), adapters="gguf"), "llama_r8")


@pytest.mark.llama_cpp
@pytest.mark.parametrize("name", ["qwen2_r4", "llama_r8"])
def test_llama_cpp_reads_the_gguf_loras_as_peft_and_candlewick(adapters, name, tmp_path):
    """llama.cpp (llama-cpp-python) runs the same all-F32 base and GGUF LoRA: its logits on the
    fixture's prompt within DESIGN §7's de-quantized bound of PEFT's and of candlewick's.
    qwen2_r4.gguf is convert_lora_to_gguf.py's own output; the llama one is written as it writes
    the Llama family (q/k lora_B permuted), which llama.cpp's reading checks here."""
    from conftest import llama_cpp_or_skip

    import gguf_convert
    from adapter_fixtures import ADAPTERS as SPECS, write_gguf_lora
    from test_reference_gguf import F32_TOL, top20_errors

    llama_cpp = llama_cpp_or_skip()
    arch = SPECS[name][0]
    base = gguf_convert.convert(TINY / arch, tmp_path / f"{arch}.gguf", gguf_convert.F32)
    if name == "qwen2_r4":
        lora = DATA / "qwen2_r4.gguf"
    else:
        config = json.loads((TINY / arch / "config.json").read_text())
        factors = load_file(str(adapters[name] / "adapter_model.safetensors"))
        lora = write_gguf_lora(tmp_path / f"{name}.gguf", factors, arch, SPECS[name][2],
                               (config["num_attention_heads"], config["num_key_value_heads"]))
    ids = prompt_of(arch)
    f32 = 0  # GGML_TYPE_F32
    llm = llama_cpp.Llama(str(base), n_ctx=64, logits_all=True, verbose=False, n_threads=1, type_k=f32, type_v=f32,
                          lora_path=str(lora))
    llm.eval(ids)
    theirs = np.array(llm.scores[: len(ids)])
    rt = cw.ModelRuntime.load(base, device="cpu")
    rt.load_adapter(lora, name="lora")
    ours = rt.trace(ids, request(), adapters="lora").output.logits
    for want, what in ((REF[f"{name}/logits"], "peft"), (ours, "candlewick")):
        errs = top20_errors(theirs, np.asarray(want))
        print(f"\n[llama.cpp + {name}.gguf vs {what}] top-20 rel L2 max {errs.max():.2e}")
        assert errs.max() <= F32_TOL, what


def test_mlx_lm_adapter_matches_peft(adapters, tmp_path):
    """mlx-lm's layout of the same factors (lora_a = Aᵀ, lora_b = Bᵀ, its scale = alpha / r):
    mlx-lm computes y + scale · (x a) b, which is PEFT's y + (alpha / r) · B A x."""
    from safetensors.numpy import save_file

    from adapter_fixtures import ADAPTERS as SPECS

    for name in ("qwen2_r4", "llama_r8"):
        arch, r, alpha = SPECS[name][:3]
        peft = load_file(str(adapters[name] / "adapter_model.safetensors"))
        mlx = {}
        for key, t in peft.items():
            module, factor = key.removeprefix("base_model.model.").rsplit(".lora_", 1)
            mlx[f"{module}.lora_{factor[0].lower()}"] = np.ascontiguousarray(t.T)
        d = tmp_path / name
        d.mkdir()
        save_file(mlx, str(d / "adapters.safetensors"))
        (d / "adapter_config.json").write_text(json.dumps(
            {"fine_tune_type": "lora", "num_layers": 3, "lora_parameters": {"rank": r, "scale": alpha / r, "dropout": 0.0}}))
        rt = cw.ModelRuntime.load(TINY / arch, device="cpu")
        info = rt.load_adapter(d, name="m")
        assert info["format"] == "mlx" and info["rank"] == r
        check_against_peft(rt.trace(prompt_of(arch), request(), adapters="m"), name)
    (d / "adapter_config.json").write_text(json.dumps({"fine_tune_type": "dora", "lora_parameters": {"scale": 1.0}}))
    with pytest.raises(cw.AdapterError, match="DoRA"):
        rt.load_adapter(d, name="d")


def test_set_adapters_is_the_default_and_a_call_overrides_it(adapters):
    rt = cw.ModelRuntime.load(TINY / "qwen2", device="cpu")
    rt.load_adapter(adapters["qwen2_r4"], name="a")
    ids = prompt_of("qwen2")
    base = rt.trace(ids, request()).output.logits
    rt.set_adapters({"a": 1.0})
    assert rt.active_adapters == {"a": 1.0}
    check_against_peft(rt.trace(ids, request()), "qwen2_r4")
    # {} runs the base model for this call only.
    np.testing.assert_allclose(rt.trace(ids, request(), adapters={}).output.logits, base, rtol=0, atol=1e-5)
    check_against_peft(rt.trace(ids, request()), "qwen2_r4")
    rt.set_adapters(None)
    assert rt.active_adapters == {}
    np.testing.assert_allclose(rt.trace(ids, request()).output.logits, base, rtol=0, atol=1e-5)


def test_scales_and_several_adapters_sum(adapters):
    rt = cw.ModelRuntime.load(TINY / "qwen2", device="cpu")
    rt.load_adapter(adapters["qwen2_r4"], name="a")
    rt.load_adapter(adapters["qwen2_rslora_head"], name="b", scale=0.0)
    ids = prompt_of("qwen2")
    base = rt.trace(ids, request()).output.logits
    # Scale 0 (here b's load scale) is the base model; a summed with a zero b is a alone.
    np.testing.assert_allclose(rt.trace(ids, request(), adapters="b").output.logits, base, atol=1e-5)
    check_against_peft(rt.trace(ids, request(), adapters=["a", "b"]), "qwen2_r4")
    check_against_peft(rt.trace(ids, request(), adapters=[("a", 1.0), ("b", 0.0)]), "qwen2_r4")
    # Two halves of a sum to a.
    rt.load_adapter(adapters["qwen2_r4"], name="a2")
    check_against_peft(rt.trace(ids, request(), adapters={"a": 0.5, "a2": 0.5}), "qwen2_r4")
    assert [a["name"] for a in rt.adapters] == ["a", "b", "a2"] == [a["name"] for a in rt.loaded_adapters()]


def test_inspect_prefill_with_adapters_keeps_the_points(adapters):
    rt = cw.ModelRuntime.load(TINY / "phi3", device="cpu")
    rt.load_adapter(adapters["phi3_fused"], name="p")
    out = rt.inspect_prefill(prompt_of("phi3"), request(), all_logits=True, adapters="p")
    check_against_peft(out, "phi3_fused")
    assert rt.active_adapters == {}


def test_generate_stream_and_batch_follow_peft_greedy(adapters, with_tokenizer):
    rt = cw.ModelRuntime.load(with_tokenizer, device="cpu")
    rt.load_adapter(adapters["qwen2_r4"], name="a")
    ids = prompt_of("qwen2")
    want = META["qwen2_r4"]["greedy_ids"]
    assert rt.generate(ids, adapters="a", **GREEDY).token_ids == want
    base = rt.generate(ids, **GREEDY).token_ids
    assert base != want
    with rt.stream(ids, adapters="a", **GREEDY) as s:
        "".join(s)
    assert s.result.token_ids == want
    # The stream's adapter was its own: the runtime is back to the base model.
    assert rt.generate(ids, **GREEDY).token_ids == base
    assert [r.token_ids for r in rt.generate_batch([ids, ids], adapters="a", **GREEDY)] == [want, want]


def test_engine_batches_requests_with_different_adapters(adapters, with_tokenizer):
    rt = cw.ModelRuntime.load(with_tokenizer, device="cpu")
    rt.load_adapter(adapters["qwen2_r4"], name="a")
    rt.load_adapter(adapters["qwen2_rslora_head"], name="b")
    ids = prompt_of("qwen2")
    base = rt.generate(ids, **GREEDY).token_ids
    with cw.Engine(rt, max_batch_size=8) as engine:
        reqs = [engine.submit(ids, adapters=a, **GREEDY) for a in ["a", "b", None, "a", {}, {"b": 1.0}]]
        for r in reqs:
            "".join(r)
        got = [r.result.token_ids for r in reqs]
    a, b = META["qwen2_r4"]["greedy_ids"], META["qwen2_rslora_head"]["greedy_ids"]
    assert got == [a, b, base, a, base, b]


def write_peft(dir_: Path, config: dict, tensors: dict) -> Path:
    dir_.mkdir(parents=True, exist_ok=True)
    (dir_ / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 2, "lora_alpha": 2, **config}))
    save_file(tensors, str(dir_ / "adapter_model.safetensors"))
    return dir_


def pair(module, r, inp, out):
    return {
        f"base_model.model.{module}.lora_A.weight": np.zeros((r, inp), np.float32),
        f"base_model.model.{module}.lora_B.weight": np.zeros((out, r), np.float32),
    }


def test_bad_adapters_are_typed_errors(adapters, tmp_path):
    rt = cw.ModelRuntime.load(TINY / "qwen2", device="cpu")
    with pytest.raises(cw.AdapterError, match="no LoRA adapter"):
        rt.load_adapter(tmp_path / "missing")
    # Another architecture's modules (phi3's fused qkv_proj) are not this model's.
    with pytest.raises(cw.AdapterError, match="is not a linear of this model"):
        rt.load_adapter(adapters["phi3_fused"])
    # A layer the model lacks.
    bad = write_peft(tmp_path / "layer9", {}, pair("model.layers.9.self_attn.q_proj", 2, 64, 64))
    with pytest.raises(cw.AdapterError, match="model.layers.9.self_attn.q_proj"):
        rt.load_adapter(bad)
    # Shapes of another base.
    bad = write_peft(tmp_path / "shape", {}, pair("model.layers.0.self_attn.q_proj", 2, 32, 64))
    with pytest.raises(cw.AdapterError, match=r"lora_A has shape \[2, 32\]"):
        rt.load_adapter(bad)
    bad = write_peft(tmp_path / "shapeb", {}, pair("model.layers.0.self_attn.k_proj", 2, 64, 64))
    with pytest.raises(cw.AdapterError, match="lora_B"):
        rt.load_adapter(bad)
    bad = write_peft(tmp_path / "dora", {"use_dora": True}, pair("model.layers.0.self_attn.q_proj", 2, 64, 64))
    with pytest.raises(cw.AdapterError, match="DoRA"):
        rt.load_adapter(bad)
    half = pair("model.layers.0.self_attn.q_proj", 2, 64, 64)
    half.pop("base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight")
    with pytest.raises(cw.AdapterError, match="only one of"):
        rt.load_adapter(write_peft(tmp_path / "half", {}, half))
    with pytest.raises(cw.AdapterError, match="general.type"):
        rt.load_adapter(write_gguf_model(tmp_path / "model.gguf"))
    assert rt.loaded_adapters() == []


def write_gguf_model(path):
    import gguf

    w = gguf.GGUFWriter(str(path), "qwen2")
    w.add_tensor("token_embd.weight", np.zeros((4, 4), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_names_in_use_and_unknown_are_refused(adapters, with_tokenizer):
    rt = cw.ModelRuntime.load(with_tokenizer, device="cpu")
    rt.load_adapter(adapters["qwen2_r4"], name="a")
    with pytest.raises(cw.AdapterError, match="already loaded"):
        rt.load_adapter(adapters["qwen2_r4"], name="a")
    with pytest.raises(cw.AdapterError, match="no LoRA adapter called `nope`"):
        rt.trace([1, 2, 3], adapters="nope")
    with pytest.raises(cw.AdapterError, match="nope"):
        rt.generate([1, 2, 3], adapters="nope", **GREEDY)
    with pytest.raises(cw.AdapterError, match="nope"):
        rt.set_adapters("nope")
    with pytest.raises(cw.AdapterError, match="finite"):
        rt.set_adapters({"a": float("nan")})
    assert rt.active_adapters == {}
    rt.set_adapters("a")
    with pytest.raises(cw.AdapterError, match="in use"):
        rt.unload_adapter("a")
    rt.set_adapters(None)
    rt.unload_adapter("a")
    with pytest.raises(cw.AdapterError, match="no LoRA adapter called `a`"):
        rt.unload_adapter("a")
    # A cache computed under an adapter does not keep it loaded: once chosen by no session, it unloads.
    rt.load_adapter(adapters["qwen2_r4"], name="a")
    rt.generate([1, 2, 3], adapters="a", **GREEDY)
    rt.set_adapters("a")
    rt.generate([1, 2, 3], **GREEDY)
    rt.set_adapters(None)
    rt.unload_adapter("a")
    assert rt.generate([1, 2, 3], **GREEDY).usage["cached_tokens"] == 0
    with pytest.raises(TypeError):
        rt.set_adapters(3)


def test_prefix_reuse_never_crosses_adapters(adapters, with_tokenizer):
    rt = cw.ModelRuntime.load(with_tokenizer, device="cpu")
    rt.load_adapter(adapters["qwen2_r4"], name="a")
    ids = prompt_of("qwen2")
    want = META["qwen2_r4"]["greedy_ids"]
    base = rt.generate(ids, **GREEDY)
    # The session holds the base model's cache of this prompt: the adapter's run recomputes it.
    r = rt.generate(ids, adapters="a", **GREEDY)
    assert r.token_ids == want and r.usage["cached_tokens"] == 0
    # The same adapter again reuses what it computed.
    r = rt.generate(ids, adapters="a", **GREEDY)
    assert r.token_ids == want and r.usage["cached_tokens"] > 0
    assert rt.generate(ids, **GREEDY).token_ids == base.token_ids


def test_cli_lora_flag_applies_the_adapter(adapters, with_tokenizer):
    import subprocess
    import sys

    rt = cw.ModelRuntime.load(with_tokenizer, device="cpu")
    rt.load_adapter(adapters["qwen2_r4"], name="a")
    prompt = " ".join(f"t{i}" for i in prompt_of("qwen2")[1:])
    want = rt.generate(prompt, adapters="a", **GREEDY).text
    assert want != rt.generate(prompt, **GREEDY).text
    cmd = [sys.executable, "-m", "candlewick", "generate", "--model", str(with_tokenizer), "--device", "cpu",
           "--lora", f"{adapters['qwen2_r4']}:1.0", "-n", "8", "--temp", "0", "-q", prompt]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.rstrip("\n") == want
    # --lora-merge folds it into the weights: the same greedy text.
    r = subprocess.run(cmd[:-1] + ["--lora-merge", prompt], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.rstrip("\n") == want


def test_server_routes_base_colon_adapter_and_adapters_field(adapters, with_tokenizer):
    pytest.importorskip("starlette")
    pytest.importorskip("uvicorn")
    import urllib.request

    from server_helpers import launch

    rt = cw.ModelRuntime.load(with_tokenizer, device="cpu")
    rt.load_adapter(adapters["qwen2_r4"], name="a")
    prompt = " ".join(f"t{i}" for i in prompt_of("qwen2")[1:])
    want = rt.generate(prompt, adapters="a", **GREEDY).text
    base = rt.generate(prompt, **GREEDY).text
    template = with_tokenizer.parent / "plain.jinja"
    template.write_text("{% for m in messages %}{{ m['content'] }} {% endfor %}")
    proc, url = launch("--model", str(with_tokenizer), "--lora", f"a={adapters['qwen2_r4']}",
                       "--chat-template", str(template), timeout=60)
    try:

        def call(path, body):
            req = urllib.request.Request(url + path, data=json.dumps(body).encode(),
                                         headers={"Content-Type": "application/json"})
            with urllib.request.urlopen(req, timeout=60) as r:
                return json.loads(r.read())

        def post(body):
            return call("/v1/completions", body)["choices"][0]["text"]

        with urllib.request.urlopen(url + "/v1/models", timeout=10) as r:
            ids = [m["id"] for m in json.loads(r.read())["data"]]
        assert ids == ["qwen2", "qwen2:a"]
        common = {"prompt": prompt, "max_tokens": 8, "temperature": 0, "ignore_eos": True}
        assert post({**common, "model": "qwen2:a"}) == want
        assert post({**common, "model": "qwen2"}) == base
        assert post({**common, "adapters": {"a": 1.0}}) == want
        assert post({**common, "adapters": {"a": 0.0}}) == base
        with pytest.raises(urllib.error.HTTPError) as e:
            post({**common, "adapters": {"b": 1.0}})
        assert e.value.code == 400
        with pytest.raises(urllib.error.HTTPError) as e:
            post({**common, "model": "qwen2:b"})
        assert e.value.code == 404
        # The agent APIs route adapters as chat completions does.
        words = prompt.split()
        msgs = [{"role": "user", "content": " ".join(words)}]
        chat = {"messages": msgs, "max_tokens": 8, "temperature": 0}

        def chat_text(body):
            return call("/v1/chat/completions", body)["choices"][0]["message"]["content"]

        def responses_text(body):
            out = call("/v1/responses", body)["output"]
            return "".join(p["text"] for item in out for p in item.get("content", []))

        def messages_text(body):
            return "".join(b["text"] for b in call("/v1/messages", body)["content"] if b["type"] == "text")

        tuned, plain = chat_text({**chat, "model": "qwen2:a"}), chat_text(chat)
        assert tuned != plain
        resp = {"input": msgs, "max_output_tokens": 8, "temperature": 0}
        assert responses_text({**resp, "model": "qwen2:a"}) == tuned
        assert responses_text({**resp, "adapters": {"a": 1.0}}) == tuned
        assert responses_text(resp) == plain
        anth = {"messages": msgs, "max_tokens": 8, "temperature": 0, "model": "qwen2"}
        assert messages_text({**anth, "model": "qwen2:a"}) == tuned
        assert messages_text({**anth, "adapters": {"a": 1.0}}) == tuned
        assert messages_text(anth) == plain
    finally:
        proc.terminate()
        proc.wait(timeout=30)
