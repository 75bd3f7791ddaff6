"""Every tiny fixture through GGUF files written from it as llama.cpp's converter writes them
(`gguf_convert.py`), against the same transformers references as the Hugging Face directories.

Bounds are DESIGN §7's for GGUF, fixed in advance:

- all-F32 file de-quantized at load (``dtype="f32"``): relative L2 ≤ 1e-3 on the top-20 logits of
  every teacher-forced row (prompt + the reference's greedy continuation), argmax equal wherever
  the reference's top-1 leads its top-2 by more than 0.25, the free-running greedy continuation
  equal, and every observation point within 1e-3 (relative L2 of the whole point, as
  test_inspection.py compares them);
- Q8_0 file run quantized (the default): median relative L2 over rows ≤ 0.05 on the top-20 logits,
  top-5 overlap ≥ 3 on at least 95% of rows, argmax equal wherever the margin exceeds 1.0; each
  observation point held to the same median-over-rows bound (a row: one position of a [T, H]
  point, one head's query of a pattern).

Measured figures are printed (``pytest -s``). The five mixtures of experts are written with 3-D
`ffn_*_exps` tensors, as the converter writes them.
"""

import json

import numpy as np
import pytest

import candlewick as cw
import gguf_convert
from conftest import DEVICE, TINY, llama_cpp_or_skip, reference, rel_l2
from test_inspection import EDIT_POINTS, points

DENSE = ["llama", "mistral", "qwen2", "qwen3", "gemma3", "phi3", "gemma2", "olmo2", "smollm3", "granite", "gpt_neox", "gpt2"]
MOE = ["qwen3_moe", "mixtral", "olmoe", "granitemoe", "gpt_oss"]

F32_TOL = 1e-3
F32_ARGMAX_MARGIN = 0.25
Q_MEDIAN_TOL = 0.05
Q_TOP5_MIN_OVERLAP = 3
Q_TOP5_MIN_FRACTION = 0.95
Q_ARGMAX_MARGIN = 1.0


@pytest.fixture(scope="session")
def gguf_file(tmp_path_factory):
    """`gguf_file(case, outtype)`: the fixture's GGUF file, written once per session."""
    root = tmp_path_factory.mktemp("tiny-gguf")
    made = {}

    def make(case, outtype):
        if (case, outtype) not in made:
            made[case, outtype] = gguf_convert.convert(TINY / case, root / f"{case}.{outtype}.gguf", outtype)
        return made[case, outtype]

    return make


def _skip_unsupported(case):
    if case not in cw.supported_architectures("gguf"):
        pytest.skip(f"{case!r} is not in supported_architectures('gguf') yet (the MoE decoder lands separately)")


@pytest.fixture(params=DENSE + MOE)
def case(request):
    """Each tiny fixture; the mixtures of experts skip until their GGUF files load."""
    if request.param in MOE:
        _skip_unsupported(request.param)
    return request.param


@pytest.fixture
def ref(case):
    return reference(case)


def _runtime(gguf_file, case, outtype):
    path = gguf_file(case, outtype)
    # The all-F32 file is de-quantized at load (it is already float32); Q8_0 runs quantized.
    return cw.ModelRuntime.load(path, device=DEVICE, **({"dtype": "f32"} if outtype == "f32" else {}))


def teacher_forced(rt, ref):
    """Logits of every row of prompt + the reference's greedy continuation, in one prefill."""
    ids = ref["input_ids"].tolist() + ref["greedy_ids"].tolist()
    logits = rt.prefill(ids, all_logits=True).wait().logits
    assert logits.shape == ref["sequence_logits"].shape
    return logits


def top20_errors(logits, want):
    """Relative L2 of each row's logits at the reference's top-20 ids."""
    ids = np.argsort(-want, axis=1)[:, :20]
    a = np.take_along_axis(logits, ids, axis=1).astype(np.float64)
    r = np.take_along_axis(want, ids, axis=1).astype(np.float64)
    return np.linalg.norm(a - r, axis=1) / np.linalg.norm(r, axis=1)


def margins(want):
    top2 = -np.sort(-want, axis=1)[:, :2]
    return top2[:, 0] - top2[:, 1]


def row_errors(got, want, path):
    """Relative L2 of each row of a point: a position of [T, H], a head's query of a pattern."""
    g = got.reshape(-1, got.shape[-1]).astype(np.float64)
    w = want.reshape(-1, want.shape[-1]).astype(np.float64)
    norms = np.maximum(np.linalg.norm(w, axis=1), 1e-30)
    return np.linalg.norm(g - w, axis=1) / norms


def observe_all(rt, ref):
    got = rt.inspect_prefill(ref["input_ids"].tolist(), cw.ObservationRequest.all()).observations
    # Besides the edit points, a mixture's `mlp.expert_weights` has no transformers value of its
    # own: tests/test_reference_moe.py derives it from the reference's router logits.
    derived = EDIT_POINTS + ("mlp.expert_weights",)
    assert sorted(k for k in got.keys() if not k.endswith(derived)) == points(ref)
    return got


# -- all-F32 file, de-quantized at load --


def test_f32_teacher_forced_top20(gguf_file, case, ref):
    rt = _runtime(gguf_file, case, "f32")
    want = ref["sequence_logits"]
    logits = teacher_forced(rt, ref)
    errs = top20_errors(logits, want)
    decided = margins(want) > F32_ARGMAX_MARGIN
    argmax_ok = logits.argmax(axis=1)[decided] == want.argmax(axis=1)[decided]
    print(f"\n[gguf f32] {case}: top-20 rel L2 max {errs.max():.2e} (bound {F32_TOL}); argmax equal on "
          f"{argmax_ok.sum()}/{decided.sum()} rows with margin > {F32_ARGMAX_MARGIN}")
    worst = int(errs.argmax())
    assert errs.max() <= F32_TOL, f"row {worst}: {errs[worst]:.3e}"
    assert argmax_ok.all()


def test_f32_greedy_continuation(gguf_file, case, ref):
    rt = _runtime(gguf_file, case, "f32")
    greedy = ref["greedy_ids"].tolist()
    out = [int(np.argmax(rt.prefill(ref["input_ids"].tolist()).wait().logits[-1]))]
    while len(out) < len(greedy):
        out.append(int(np.argmax(rt.decode([out[-1]]).wait().logits[-1])))
    assert out == greedy


def test_f32_every_observation_point(gguf_file, case, ref):
    rt = _runtime(gguf_file, case, "f32")
    got = observe_all(rt, ref)
    errs = {path: rel_l2(got[path], ref[path]) for path in points(ref)}
    for path in points(ref):
        assert got[path].shape == ref[path].shape, path
    worst = max(errs, key=errs.get)
    print(f"\n[gguf f32] {case}: observation points rel L2 max {errs[worst]:.2e} ({worst})")
    bad = {p: e for p, e in errs.items() if e > F32_TOL}
    assert not bad, f"above {F32_TOL}: {bad}"


# -- Q8_0 file, run quantized --


def test_q8_0_teacher_forced(gguf_file, case, ref):
    rt = _runtime(gguf_file, case, "q8_0")
    want = ref["sequence_logits"]
    logits = teacher_forced(rt, ref)
    errs = top20_errors(logits, want)
    top5 = np.argsort(-logits, axis=1)[:, :5]
    ref5 = np.argsort(-want, axis=1)[:, :5]
    overlap = np.array([len(set(a.tolist()) & set(b.tolist())) for a, b in zip(top5, ref5)])
    good = float(np.mean(overlap >= Q_TOP5_MIN_OVERLAP))
    decided = margins(want) > Q_ARGMAX_MARGIN
    misses = np.flatnonzero(decided & (logits.argmax(axis=1) != want.argmax(axis=1)))
    print(f"\n[gguf q8_0] {case}: top-20 rel L2 median {np.median(errs):.4f} (max {errs.max():.4f}, bound "
          f"{Q_MEDIAN_TOL}); top-5 overlap >= {Q_TOP5_MIN_OVERLAP} on {100 * good:.0f}% of rows; argmax misses "
          f"{len(misses)} of {decided.sum()} rows with margin > {Q_ARGMAX_MARGIN}")
    assert np.median(errs) <= Q_MEDIAN_TOL
    assert good >= Q_TOP5_MIN_FRACTION
    assert len(misses) == 0, misses.tolist()


# Measured when the MoE decoder and this converter first met (not a loosened bound): in the
# Q8_0 file of the tiny Qwen3-MoE, layer 2's mlp.output has a median row error of 0.070 (layer 0:
# 0.025, logits 0.043), and its attention.output 0.064 from an input 0.022 off. The cause is the
# file's rounded weights, not our kernels: the same file de-quantized at load (`dtype="f32"`: the
# Q8_0 weights in float32, no int8 products) misses transformers by as much (mlp.output 0.064,
# attention.output 0.063), and so does the HF directory quantized at load (0.068; that test
# bounds only the logits). Our quantized run stays within 0.021 of the de-quantized one at every
# point (`test_q8_0_known_miss_is_the_files_own_rounding`). Layer 2's attention in this 64-wide
# random model (initializer range 0.1) turns a 2% input error into 6%.
Q8_0_KNOWN_MISSES = {"qwen3_moe"}


def test_q8_0_every_observation_point(gguf_file, case, ref, request):
    if case in Q8_0_KNOWN_MISSES:
        request.applymarker(pytest.mark.xfail(strict=True, reason="routing flips under Q8_0 (see Q8_0_KNOWN_MISSES)"))
    rt = _runtime(gguf_file, case, "q8_0")
    got = observe_all(rt, ref)
    medians = {}
    for path in points(ref):
        assert got[path].shape == ref[path].shape, path
        medians[path] = float(np.median(row_errors(got[path], ref[path], path)))
    worst = max(medians, key=medians.get)
    print(f"\n[gguf q8_0] {case}: observation points, worst median row rel L2 {medians[worst]:.4f} ({worst})")
    bad = {p: e for p, e in medians.items() if e > Q_MEDIAN_TOL}
    assert not bad, f"median above {Q_MEDIAN_TOL}: {bad}"


def test_model_info_names_the_gguf_architecture(gguf_file, case):
    rt = _runtime(gguf_file, case, "q8_0")
    info = rt.model_info
    cfg = json.loads((TINY / case / "config.json").read_text())
    # llama.cpp's converter writes Mistral (and Mixtral) checkpoints as `llama`; a `llama` file
    # with experts is reported as the mixture it is.
    want = {"mistral": "llama"}.get(case, case)
    assert (info["architecture"], info["format"], info["vocab_size"]) == (want, "gguf", cfg["vocab_size"])
    assert info["num_layers"] == cfg.get("num_hidden_layers", cfg.get("n_layer"))


def test_supported_architectures_lists_the_dense_ones():
    assert set(DENSE) <= set(cw.supported_architectures("gguf"))


@pytest.mark.parametrize("moe", MOE)
def test_moe_files_hold_stacked_experts(gguf_file, moe):
    """The converter's MoE files, for the MoE decoder: 3-D expert tensors and the router, F32."""
    import gguf

    reader = gguf.GGUFReader(gguf_file(moe, "q8_0"))
    tensors = {t.name: t for t in reader.tensors}
    cfg = json.loads((TINY / moe / "config.json").read_text())
    n_experts = cfg.get("num_local_experts") or cfg["num_experts"]
    for name in ("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps"):
        t = tensors[f"blk.0.{name}.weight"]
        assert len(t.shape) == 3 and int(t.shape[2]) == n_experts, (name, t.shape)
    assert tensors["blk.0.ffn_gate_inp.weight"].tensor_type == gguf.GGMLQuantizationType.F32
    arch = reader.fields["general.architecture"].contents()
    assert reader.fields[f"{arch}.expert_count"].contents() == n_experts
    assert reader.fields[f"{arch}.expert_used_count"].contents() == cfg["num_experts_per_tok"]


# llama.cpp itself on the same files: proof that they are what its loader reads. Phi-3 is left out
# because llama.cpp's Phi-3 vocabulary setup looks up tokens (`unordered_map::at`) that the minimal
# vocabulary the fixtures get does not have; OLMoE because llama.cpp expects its k norm as wide as
# the residual (true of the released OLMoE, which has as many key/value heads as query heads), and
# the tiny one groups its queries; gpt-oss because llama.cpp clamps its SwiGLU at 7.0, not at the
# fixture's `swiglu_limit` 1.0, and rounds YaRN's ramp bounds, which the fixture's
# `truncate: false` leaves as they are (test_llama_cpp_agrees_on_gpt_oss checks the rest of it).
LLAMA_CPP_CASES = [c for c in DENSE if c != "phi3"] + ["qwen3_moe", "mixtral", "granitemoe"]


@pytest.mark.llama_cpp
@pytest.mark.parametrize("case_", LLAMA_CPP_CASES)
def test_llama_cpp_reads_the_files_as_the_reference(gguf_file, case_):
    """llama.cpp (llama-cpp-python) on the all-F32 file, with a float32 KV cache, teacher-forced:
    the de-quantized bound on the top-20 logits of every row."""
    llama_cpp_reads_as_the_reference(gguf_file(case_, "f32"), reference(case_), case_)


def llama_cpp_reads_as_the_reference(path, ref, name):
    """llama.cpp's teacher-forced logits of the all-F32 file `path` within the de-quantized bound
    of `ref`'s (skipped where llama-cpp-python is not installed)."""
    llama_cpp = llama_cpp_or_skip()
    ids = ref["input_ids"].tolist() + ref["greedy_ids"].tolist()
    f32 = 0  # GGML_TYPE_F32
    llm = llama_cpp.Llama(str(path), n_ctx=64, logits_all=True, verbose=False, n_threads=1, type_k=f32, type_v=f32)
    llm.eval(ids)
    errs = top20_errors(np.array(llm.scores[: len(ids)]), ref["sequence_logits"])
    print(f"\n[llama.cpp f32] {name}: top-20 rel L2 max {errs.max():.2e}")
    assert errs.max() <= F32_TOL


# gpt-oss as llama.cpp computes it: its experts clamped at 7.0 (as the released models are) and
# no YaRN, the two things its graph hard-codes that the tiny fixture does otherwise. The fixture's
# weights, written as that model, are then one model to both runtimes, and they are compared with
# each other on the same file (no transformers reference says what this model computes).
GPT_OSS_AS_LLAMA_CPP = {"swiglu_limit": 7.0, "rope_parameters": {"rope_type": "default", "rope_theta": 150000.0}}


@pytest.mark.llama_cpp
@pytest.mark.parametrize("experts", ["f32", "mxfp4"])
def test_llama_cpp_agrees_on_gpt_oss(tmp_path, experts):
    """Sinks, biases, alternating windows, clamped SwiGLU experts (and MXFP4 experts, as the
    released gpt-oss files store them) through llama.cpp and candlewick, teacher-forced on the
    fixture's prompt + continuation. All-F32 file: both de-quantized, DESIGN §7's 1e-3 on the
    top-20 logits of every row. MXFP4 experts: both run them quantized (llama.cpp's MXFP4 dot
    product, candlewick's MXFP4 tiles, or Q8_0 where the CPU has none), the quantized bounds
    (median ≤ 0.05, top-5 overlap ≥ 3)."""
    llama_cpp = llama_cpp_or_skip()
    ref = reference("gpt_oss")
    ids = ref["input_ids"].tolist() + ref["greedy_ids"].tolist()
    path = gguf_convert.convert(TINY / "gpt_oss", tmp_path / f"gpt_oss.{experts}.gguf", "f32",
                                config=GPT_OSS_AS_LLAMA_CPP, experts=None if experts == "f32" else experts)
    f32 = 0  # GGML_TYPE_F32
    llm = llama_cpp.Llama(str(path), n_ctx=64, logits_all=True, verbose=False, n_threads=1, type_k=f32, type_v=f32)
    llm.eval(ids)
    want = np.array(llm.scores[: len(ids)])
    rt = cw.ModelRuntime.load(path, device=DEVICE, **({"dtype": "f32"} if experts == "f32" else {}))
    got = rt.prefill(ids, all_logits=True).wait().logits
    errs = top20_errors(got, want)
    top5 = np.argsort(-got, axis=1)[:, :5]
    ref5 = np.argsort(-want, axis=1)[:, :5]
    overlap = np.array([len(set(a.tolist()) & set(b.tolist())) for a, b in zip(top5, ref5)])
    print(f"\n[gpt-oss vs llama.cpp, {experts} experts] top-20 rel L2 max {errs.max():.2e}, median "
          f"{np.median(errs):.2e}; top-5 overlap >= 3 on {100 * np.mean(overlap >= 3):.0f}% of rows")
    if experts == "f32":
        assert errs.max() <= F32_TOL
    else:
        assert np.median(errs) <= Q_MEDIAN_TOL
        assert np.mean(overlap >= Q_TOP5_MIN_OVERLAP) >= Q_TOP5_MIN_FRACTION


@pytest.mark.parametrize("moe", ["qwen3_moe", "olmoe", "gpt_oss"])
def test_moe_file_quantized_at_load_equals_the_directory_quantized_at_load(gguf_file, moe):
    """An F32 GGUF mixture quantized at load (each expert read from its slice of the 3-D tensor)
    holds the same Q8_0 blocks as the Hugging Face directory quantized at load: their logits agree
    to float32 rounding (1e-4, the float32 bound), teacher-forced."""
    ref = reference(moe)
    ids = ref["input_ids"].tolist() + ref["greedy_ids"].tolist()
    from_file = cw.ModelRuntime.load(gguf_file(moe, "f32"), device=DEVICE, dtype="f32", quantize="q8_0")
    report = from_file.model_info["quantized_at_load"]
    assert report["tensors"]["blk.0.ffn_gate_exps.weight[1]"] == "q8_0"
    from_dir = cw.ModelRuntime.load(TINY / moe, device=DEVICE, quantize="q8_0")
    a = from_file.prefill(ids, all_logits=True).wait().logits
    b = from_dir.prefill(ids, all_logits=True).wait().logits
    errs = [rel_l2(x, y) for x, y in zip(a, b)]
    print(f"\n[{moe}] GGUF vs directory, both quantized at load: rel L2 max {max(errs):.2e}")
    assert max(errs) <= 1e-4


@pytest.mark.parametrize("case", sorted(Q8_0_KNOWN_MISSES))
def test_q8_0_known_miss_is_the_files_own_rounding(gguf_file, case):
    """A known miss is the Q8_0 weights' own: the file de-quantized to float32 misses the
    reference too, and the quantized run is within the quantized bound of that float32 run."""
    ref = reference(case)
    path = gguf_file(case, "q8_0")
    quantized = observe_all(cw.ModelRuntime.load(path, device=DEVICE), ref)
    rounded = observe_all(cw.ModelRuntime.load(path, device=DEVICE, dtype="f32"), ref)
    to_rounded = {p: float(np.median(row_errors(quantized[p], rounded[p], p))) for p in points(ref)}
    rounded_to_ref = {p: float(np.median(row_errors(rounded[p], ref[p], p))) for p in points(ref)}
    worst = max(to_rounded, key=to_rounded.get)
    print(f"\n[gguf q8_0] {case}: quantized vs de-quantized worst median {to_rounded[worst]:.4f} ({worst}); "
          f"de-quantized vs transformers worst {max(rounded_to_ref.values()):.4f}")
    assert max(rounded_to_ref.values()) > Q_MEDIAN_TOL, "the de-quantized file meets the bound: the miss is ours"
    assert to_rounded[worst] <= Q_MEDIAN_TOL, worst
