"""Every GGUF tensor type llama.cpp writes de-quantizes bit for bit as the `gguf` package's
`gguf.quants.dequantize` (DESIGN §10).

Each type is written as the token embedding of a tiny Llama (hidden 256, one super-block a
row) from random but valid block bytes (finite float16 scales), loaded through candlewick,
and read back through the `model.embed_tokens` observation point of a prompt of every token
id. De-quantized runs (`dtype="f32"`) must equal the reference's float32 bit patterns; the
quantized run re-encodes the types candle lacks as Q8_0 blocks, exact for the types whose
scale float16 always holds (IQ4_NL, TQ1_0, TQ2_0, MXFP4 in range), except IQ4_NL, IQ4_XS and
MXFP4, the grid i-quants and the ternary types on a CPU with the interleaved tiles, which keep
their own blocks (exact, all of them).
"""

import os
import re
import subprocess
import sys

import numpy as np
import pytest

import candlewick as cw
from test_gguf import default_vocab, write_tiny_gguf

gguf = pytest.importorskip("gguf")
T = gguf.GGMLQuantizationType
HIDDEN = 256

# Where each type keeps its float16 scales (byte offsets in a block), as ggml's `block_*`.
HALF_SCALES = {
    T.Q4_0: [0], T.Q4_1: [0, 2], T.Q5_0: [0], T.Q5_1: [0, 2], T.Q8_0: [0],
    T.Q2_K: [80, 82], T.Q3_K: [108], T.Q4_K: [0, 2], T.Q5_K: [0, 2], T.Q6_K: [208],
    T.IQ2_XXS: [0], T.IQ2_XS: [0], T.IQ2_S: [0], T.IQ3_XXS: [0], T.IQ3_S: [0], T.IQ1_S: [0],
    T.IQ4_NL: [0], T.IQ4_XS: [0], T.TQ1_0: [52], T.TQ2_0: [64],
}
QUANTIZED = [*HALF_SCALES, T.IQ1_M, T.MXFP4]
FLOATS = [T.F32, T.F16, T.BF16]
# The types candle lacks whose Q8_0 re-encoding keeps every value (see `extra_types.rs`).
EXACT_AS_Q8_0 = [T.IQ4_NL, T.TQ1_0, T.TQ2_0, T.MXFP4]
# The types candle lacks that run in interleaved tiles of their own blocks where the CPU has them
# (AVX-512 VNNI or AVX2), with the bits a value of those blocks: the table formats, and since issue 43 the
# grid i-quants and the ternary types (re-encoded as Q8_0 before, 8.5 bits a value).
OWN_TILES = {
    T.IQ4_NL: 4.5, T.IQ4_XS: 4.25, T.MXFP4: 4.25,
    T.IQ1_S: 1.5625, T.IQ1_M: 1.75, T.IQ2_XXS: 2.0625, T.IQ2_XS: 2.3125, T.IQ2_S: 2.5625,
    T.IQ3_XXS: 3.0625, T.IQ3_S: 3.4375, T.TQ1_0: 1.6875, T.TQ2_0: 2.0625,
}
# The types this CPU keeps in tiles of their own (AVX-512 VNNI and AVX2: all; Arm: the grid ones).
TILED = {t for t in OWN_TILES if t.name.lower() in cw.build_info()["tiled_types"]}


def random_blocks(qtype, rows, rng, extremes=False, scales=(2e-4, 2e-2), exponents=(100, 135)):
    """`rows` rows of HIDDEN values of `qtype` as raw block bytes, with random bits everywhere
    but in the float scales, which are finite and drawn from `scales` (MXFP4: exponent bytes
    from `exponents`; `extremes`: MXFP4's
    first three blocks take the exponents ggml special-cases, 0 and 1, and one beyond float16)."""
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    if qtype in FLOATS:
        values = rng.standard_normal((rows, HIDDEN)).astype(np.float32)
        if qtype == T.F16:
            return values.astype(np.float16).view(np.uint8)
        if qtype == T.BF16:
            return (values.view(np.uint32) >> 16).astype(np.uint16).view(np.uint8)
        return values.view(np.uint8)
    raw = rng.integers(0, 256, size=(rows * HIDDEN // block, size), dtype=np.uint8)
    d = rng.uniform(*scales, size=len(raw)).astype(np.float16)
    for at in HALF_SCALES.get(qtype, []):
        raw[:, at : at + 2] = d.view(np.uint8).reshape(-1, 2)
    if qtype == T.IQ1_M:
        # The scale's four nibbles are the top nibbles of the block's four u16 scales.
        s = raw[:, 48:56].copy().view(np.uint16) & 0x0FFF
        bits = d.view(np.uint16)
        for k in range(4):
            s[:, k] |= ((bits >> (4 * k)) & 0xF) << 12
        raw[:, 48:56] = s.view(np.uint8)
    if qtype == T.MXFP4:
        raw[:, 0] = rng.integers(*exponents, size=len(raw))
        if extremes:
            raw[:3, 0] = [0, 1, 252]
    return raw.reshape(rows, -1)


def embedding_table(path, **load):
    """The model's embedding of every token id, through `model.embed_tokens`."""
    rt = cw.ModelRuntime.load(path, device="cpu", **load)
    vocab = rt.model_info["vocab_size"]
    out = rt.inspect_prefill(list(range(vocab)), cw.ObservationRequest.exact(["model.embed_tokens"]))
    table = np.array(out.observations["model.embed_tokens"], dtype=np.float32)
    rt.close()
    return table


def write(tmp_path, qtype, raw, tensor="token_embd.weight"):
    """A tiny model with `tensor` (a [vocab, HIDDEN] table) stored as `raw` blocks of `qtype`."""
    tmp_path.mkdir(exist_ok=True)
    return write_tiny_gguf(
        tmp_path / f"{qtype.name}.gguf", hidden=HIDDEN, ff=HIDDEN, raw_tensors={tensor: (raw, qtype)}
    )


def assert_bits_equal(got, want, what):
    assert got.shape == want.shape, what
    diff = got.view(np.uint32) != want.view(np.uint32)
    assert not diff.any(), f"{what}: {diff.sum()} of {diff.size} values differ, first at {np.argwhere(diff)[0]}"


@pytest.mark.parametrize("qtype", FLOATS + QUANTIZED, ids=lambda t: t.name)
def test_every_type_dequantizes_bit_for_bit_as_gguf(tmp_path, qtype):
    rows = len(default_vocab()["tokens"])
    raw = random_blocks(qtype, rows, np.random.default_rng(int(qtype)), extremes=True)
    want = gguf.quants.dequantize(raw, qtype).astype(np.float32, copy=False)
    assert np.isfinite(want).all()
    path = write(tmp_path, qtype, raw)
    assert_bits_equal(embedding_table(path, dtype="f32"), want, f"{qtype.name} de-quantized")
    if qtype in EXACT_AS_Q8_0 or qtype in TILED:
        # MXFP4's exponent 252 is beyond any Q8_0 scale: that tensor stays float32, still exact
        # (in its own tiles, every exponent is).
        assert_bits_equal(embedding_table(path), want, f"{qtype.name} quantized")
    if qtype == T.MXFP4:
        # Scales float16 holds (2^-24 to 2^15): the Q8_0 re-encoding itself.
        raw = random_blocks(qtype, rows, np.random.default_rng(1), exponents=(104, 144))
        path = write(tmp_path / "in_range", qtype, raw)
        assert_bits_equal(embedding_table(path), gguf.quants.dequantize(raw, qtype), "MXFP4 as Q8_0")


@pytest.mark.parametrize("qtype", [T.IQ2_XXS, T.IQ2_XS, T.IQ3_S, T.IQ4_XS, T.IQ1_M, T.MXFP4], ids=lambda t: t.name)
def test_projections_of_the_new_types_run_quantized(tmp_path, qtype):
    # Every projection of layer 0 in the type, with weights of a trained model's magnitude (~0.02):
    # the quantized run (Q8_0 tiles, or IQ4_XS's and MXFP4's own) and the de-quantized float32 run
    # agree as a quantized model does with its float weights.
    rng = np.random.default_rng(7)
    small = {"scales": (2e-5, 2e-4), "exponents": (116, 122)}
    names = ["attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down"]
    kv = HIDDEN // 2
    shapes = {"attn_k": kv, "attn_v": kv}
    raw = {f"blk.0.{n}.weight": (random_blocks(qtype, shapes.get(n, HIDDEN), rng, **small), qtype) for n in names}
    path = write_tiny_gguf(tmp_path / "p.gguf", hidden=HIDDEN, ff=HIDDEN, raw_tensors=raw)
    tokens = list(range(2, 40))
    ref = cw.ModelRuntime.load(path, device="cpu", dtype="f32").prefill(tokens, all_logits=True).wait().logits
    got = cw.ModelRuntime.load(path, device="cpu").prefill(tokens, all_logits=True).wait().logits
    assert np.isfinite(got).all()
    # The bound DESIGN §7 sets a quantized run against float weights.
    assert np.linalg.norm(got - ref) / np.linalg.norm(ref) < 0.05


def test_a_non_finite_scale_names_the_tensor_and_block(tmp_path):
    rows = len(default_vocab()["tokens"])
    raw = random_blocks(T.IQ4_XS, rows, np.random.default_rng(3))
    raw[5, :2] = np.array([np.inf], dtype=np.float16).view(np.uint8)
    path = write(tmp_path, T.IQ4_XS, raw)
    with pytest.raises(cw.CandlewickError, match=r"token_embd\.weight.*block 5 is not finite"):
        cw.ModelRuntime.load(path, device="cpu")
    cw.ModelRuntime.load(path, device="cpu", check_tensors=False).close()


def test_a_truncated_tensor_is_a_typed_error(tmp_path):
    rows = len(default_vocab()["tokens"])
    # The output projection is the file's last tensor: the cut lands in its blocks.
    path = write(tmp_path, T.IQ3_S, random_blocks(T.IQ3_S, rows, np.random.default_rng(4)), "output.weight")
    data = path.read_bytes()
    path.write_bytes(data[: len(data) - 100])
    with pytest.raises(cw.CandlewickError, match=r"output\.weight.*IQ3_S"):
        cw.ModelRuntime.load(path, device="cpu")


# Resident memory a fresh process adds loading `path` (one that allocated nothing before, so the
# allocator has no freed pages to hand the weights).
LOAD_RSS = """
import os, sys, candlewick as cw
def rss():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
before = rss()
rt = cw.ModelRuntime.load(sys.argv[1], device="cpu", max_context=64)
print(rss() - before)
"""


@pytest.mark.skipif(not os.path.exists("/proc/self/statm"), reason="resident memory is read from /proc")
@pytest.mark.parametrize("qtype", list(OWN_TILES), ids=lambda t: t.name)
def test_types_with_own_tiles_load_at_their_own_size(tmp_path, qtype):
    """IQ4_NL, IQ4_XS, MXFP4, the grid i-quants and the ternary types (dense projections and the
    embedding) load into tiles of their own blocks, 1.56–4.5 bits a value, not as Q8_0 (8.5): `model_info` counts them under
    their type, the resident memory the load adds is that size (plus the model's small float32
    norms and buffers), and the run agrees with the de-quantized one."""
    if qtype not in TILED:
        pytest.skip(f"this CPU has no tiles for {qtype.name} (build_info()['tiled_types'])")
    hidden, ff = 1024, 8192
    rng = np.random.default_rng(11)
    small = {"scales": (2e-5, 2e-4), "exponents": (116, 122)}
    kv = hidden // 2  # 4 heads, 2 of them for keys and values
    rows = {"attn_q": hidden, "attn_k": kv, "attn_v": kv, "attn_output": hidden, "ffn_gate": ff, "ffn_up": ff}
    raw = {}
    for name, n in rows.items():
        raw[f"blk.0.{name}.weight"] = (random_blocks(qtype, n * hidden // HIDDEN, rng, **small).reshape(n, -1), qtype)
    raw["blk.0.ffn_down.weight"] = (random_blocks(qtype, hidden * ff // HIDDEN, rng, **small).reshape(hidden, -1), qtype)
    vocab = len(default_vocab()["tokens"])
    for name in ("token_embd.weight", "output.weight"):
        raw[name] = (random_blocks(qtype, vocab * hidden // HIDDEN, rng, **small).reshape(vocab, -1), qtype)
    path = write_tiny_gguf(tmp_path / "big.gguf", hidden=hidden, ff=ff, n_layers=1, raw_tensors=raw)
    values = sum(a.size // gguf.GGML_QUANT_SIZES[qtype][1] * gguf.GGML_QUANT_SIZES[qtype][0] for a, _ in raw.values())
    added = subprocess.run([sys.executable, "-c", LOAD_RSS, str(path)], capture_output=True, text=True, check=True)
    bits = 8 * int(added.stdout) / values
    rt = cw.ModelRuntime.load(path, device="cpu", max_context=64)
    types = rt.model_info["weight_types"]
    print(f"\n[{qtype.name}] {values} values in their own tiles: {bits:.2f} bits a value resident; {types}")
    assert types[qtype.name.lower()] == values and "q8_0" not in types
    # Above the blocks' own size by what any load adds (the runtime, tokenizer and threads: about
    # 4 MB, 1.2 bits a value of this model); below the 8.5 bits of Q8_0 blocks.
    assert OWN_TILES[qtype] <= bits < 6.5
    tokens = list(range(2, 20))
    got = rt.prefill(tokens, all_logits=True).wait().logits
    ref = cw.ModelRuntime.load(path, device="cpu", dtype="f32").prefill(tokens, all_logits=True).wait().logits
    assert np.linalg.norm(got - ref) / np.linalg.norm(ref) < 0.05


def readme_types(after, until):
    """The ggml type names the README lists between the phrases `after` and `until`."""
    from pathlib import Path

    text = " ".join((Path(__file__).resolve().parent.parent / "README.md").read_text().split())
    start = text.index(after) + len(after)
    part = text[start:text.index(until, start)]
    return {n for n in re.findall(r"\b[A-Z][A-Z0-9_]*\b", part) if n in T.__members__}


def test_the_readme_lists_what_each_gguf_tensor_type_does_at_load(tmp_path):
    """The README says which tensor types are read and which refused (issue 38: it had claimed
    "every tensor type llama.cpp writes" while NVFP4 and Q1_0 were refused): every type a GGUF file
    can name (the `gguf` package's enum) is in exactly one of its lists, and behaves as listed."""
    read = readme_types("GGUF tensor types read:", "Refused at load")
    refused = readme_types("naming the tensor and its type:", "Not read either")
    unread = readme_types("Not read either:", "ggml's intermediate")
    assert read and refused and unread
    assert not (read & refused or read & unread or refused & unread)
    assert read | refused | unread == set(T.__members__), "a type the README does not place"
    rows = len(default_vocab()["tokens"])
    for name in sorted(T.__members__):
        qtype = T[name]
        block, size = gguf.GGML_QUANT_SIZES[qtype]
        # Zero bytes are valid blocks of every type (finite scales): what is tested is the type.
        raw = np.zeros((rows, HIDDEN // block * size), dtype=np.uint8)
        path = write(tmp_path, qtype, raw)
        if name in read:
            cw.ModelRuntime.load(path, device="cpu").close()
        elif name in refused:
            with pytest.raises(cw.UnsupportedTensorTypeError, match=rf"token_embd\.weight.*\b{name}\b"):
                cw.ModelRuntime.load(path, device="cpu")
        else:
            with pytest.raises(cw.CandlewickError):
                cw.ModelRuntime.load(path, device="cpu")
