"""nomic-bert and ModernBERT against llama.cpp itself (marked `llama_cpp`): the GGUF files
llama.cpp's own convert_hf_to_gguf.py writes of tests/encoder_fixtures.py's directories
(tests/llama_convert.py), read by candlewick and by llama-cpp-python.

The converter needs a Python with torch and transformers: `CANDLEWICK_CONVERTER_PYTHON` (default:
this one), and llama.cpp's source (tests/llama_convert.py says where it is looked for). Without
either, these skip. Why llama.cpp: for nomic-bert it was to be the only reference (its released
checkpoints are remote code); transformers 5.25 turned out to have its own `nomic_bert`, so
sentence-transformers is the reference (tests/test_encoders.py) and llama.cpp agrees with it
within 5e-7. For ModernBERT llama.cpp is a peer only: see test_encoders.LLAMA_GELU_PEER.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import candlewick as cw

import encoder_fixtures as fx
import llama_convert
from conftest import llama_cpp_or_skip, rel_l2
from test_encoders import LLAMA_GELU_PEER, META, REF, TOL

pytestmark = pytest.mark.llama_cpp
PYTHON = os.environ.get("CANDLEWICK_CONVERTER_PYTHON", sys.executable)
FAMILIES = ["nomic-embed", "modernbert-embed"]


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    """{key: (the converter's file, its llama.cpp-loadable twin)} for each family."""
    llama_cpp_or_skip()
    if llama_convert.source() is None:
        pytest.skip("llama.cpp's convert_hf_to_gguf.py is not here (tests/llama_convert.py)")
    if subprocess.run([PYTHON, "-c", "import torch, transformers"], capture_output=True).returncode != 0:
        pytest.skip(f"{PYTHON} has no torch/transformers for the converter (set CANDLEWICK_CONVERTER_PYTHON)")
    root = tmp_path_factory.mktemp("encoder-gguf")
    dirs = fx.materialise(root / "dirs")
    out = {}
    for key in FAMILIES:
        plain = llama_convert.convert(dirs[key], root / f"{key}.gguf", python=PYTHON)
        loadable = llama_convert.convert(dirs[key], root / f"{key}-loadable.gguf", python=PYTHON, loadable=True)
        out[key] = (dirs[key], plain, loadable)
    return out


def _read(path: Path):
    import gguf

    r = gguf.GGUFReader(str(path))
    # The name and size label are the converter's guesses from the directory's name.
    kv = {k: v.contents() for k, v in r.fields.items()
          if not k.startswith("GGUF.") and k not in ("general.name", "general.size_label")}
    return kv, {t.name: (t.tensor_type.name, np.array(t.data)) for t in r.tensors}


@pytest.mark.parametrize("key", FAMILIES)
def test_gguf_convert_writes_what_the_converter_writes(converted, tmp_path, key):
    from gguf_convert import convert

    src, real, _ = converted[key]
    (kv, tensors), (kv_real, tensors_real) = _read(convert(src, tmp_path / "mine.gguf")), _read(real)
    # A newer `gguf` package's SpecialVocab also writes the WordPiece normaliser's lower-casing
    # (candlewick lower-cases a `bert` vocabulary either way).
    kv_real.pop("tokenizer.ggml.normalizer.lowercase", None)
    kv.pop("tokenizer.ggml.normalizer.lowercase", None)
    assert kv == kv_real
    assert tensors.keys() == tensors_real.keys()
    for name, (kind, data) in tensors.items():
        assert kind == tensors_real[name][0] and np.array_equal(data, tensors_real[name][1]), name


@pytest.mark.parametrize("key", FAMILIES)
def test_the_converters_file_embeds_as_llama_cpp_does(converted, key):
    llama_cpp = llama_cpp_or_skip()
    _, plain, loadable = converted[key]
    rt = cw.ModelRuntime.load(plain, device="cpu")
    ours = rt.embed(fx.TEXTS)
    for i in range(len(fx.TEXTS)):
        assert rel_l2(ours[i], REF[f"{key}/default"][i]) <= TOL, i
    llm = llama_cpp.Llama(model_path=str(loadable), embedding=True, verbose=False, n_ctx=512, n_batch=512,
                          n_ubatch=512)
    assert [llm.tokenize(t.encode()) for t in fx.TEXTS] == [rt.tokenizer.encode(t) for t in fx.TEXTS]
    theirs = np.array([llm.embed(t) for t in fx.TEXTS], dtype=np.float64)
    theirs /= np.linalg.norm(theirs, axis=1, keepdims=True)
    bound = TOL if key == "nomic-embed" else LLAMA_GELU_PEER
    assert max(rel_l2(ours[i], theirs[i]) for i in range(len(fx.TEXTS))) <= bound


def test_modern_bert_cross_encoder_gguf_ranks_as_llama_cpp_does(tmp_path):
    """gte-reranker-modernbert's shape: the converter's file equals tests/gguf_convert.py's,
    candlewick's scores are sentence-transformers' (1e-4), and llama.cpp's rank pooling (the
    sigmoid of its score, as CrossEncoder applies) agrees as a peer (its GELU table)."""
    from gguf_convert import convert

    llama_cpp = llama_cpp_or_skip()
    if llama_convert.source() is None:
        pytest.skip("llama.cpp's convert_hf_to_gguf.py is not here (tests/llama_convert.py)")
    if subprocess.run([PYTHON, "-c", "import torch, transformers"], capture_output=True).returncode != 0:
        pytest.skip(f"{PYTHON} has no torch/transformers for the converter (set CANDLEWICK_CONVERTER_PYTHON)")
    src = fx.materialise(tmp_path / "dirs")["modernbert-rerank"]
    real = llama_convert.convert(src, tmp_path / "real.gguf", python=PYTHON)
    (kv, tensors), (kv_real, tensors_real) = _read(convert(src, tmp_path / "mine.gguf")), _read(real)
    assert kv == kv_real and tensors.keys() == tensors_real.keys()
    for name, (kind, data) in tensors.items():
        assert kind == tensors_real[name][0] and np.array_equal(data, tensors_real[name][1]), name
    rt = cw.ModelRuntime.load(real, device="cpu")
    ours = np.array([r["relevance_score"] for r in sorted(rt.rerank(fx.QUERY, fx.DOCUMENTS), key=lambda r: r["index"])])
    assert rel_l2(ours, REF["modernbert-rerank/default"]) <= TOL
    loadable = llama_convert.convert(src, tmp_path / "loadable.gguf", python=PYTHON, loadable=True)
    llm = llama_cpp.Llama(model_path=str(loadable), embedding=True, pooling_type=llama_cpp.LLAMA_POOLING_TYPE_RANK,
                          verbose=False, n_ctx=256, n_batch=256, n_ubatch=256)
    # llama-cpp-python forms no pairs: each document's pair ids (the directory tokenizer's, which
    # candlewick's scores above were formed from) go in as its "text".
    pairs = {d.encode(): ids for d, ids in zip(fx.DOCUMENTS, META["input_ids"]["modernbert-rerank"])}
    llm.tokenize = lambda text, add_bos=True, special=False: pairs[text]
    logits = np.array([llm.embed(d)[0] for d in fx.DOCUMENTS], dtype=np.float64)
    assert rel_l2(1.0 / (1.0 + np.exp(-logits)), ours) <= LLAMA_GELU_PEER


def test_embeddinggemma_gguf_is_what_the_converter_writes(tmp_path):
    """EmbeddingGemma (`gemma-embedding`, `--sentence-transformers-dense-modules`): the converter's
    file equals tests/gguf_convert.py's and embeds the directory's ids as sentence-transformers
    does. llama.cpp itself is not asked: llama-cpp-python 0.3.36 aborts embedding this tiny Gemma
    (GGML_ASSERT(buffer) in process_ubatch, with or without the dense layers), and its `gpt2`
    vocabulary loader wants merges the fixture's WordLevel tokenizer has none of."""
    import json

    from gguf_convert import convert
    from safetensors.numpy import load_file

    import embedding_fixtures as efx

    llama_cpp_or_skip()
    if llama_convert.source() is None:
        pytest.skip("llama.cpp's convert_hf_to_gguf.py is not here (tests/llama_convert.py)")
    if subprocess.run([PYTHON, "-c", "import torch, transformers"], capture_output=True).returncode != 0:
        pytest.skip(f"{PYTHON} has no torch/transformers for the converter (set CANDLEWICK_CONVERTER_PYTHON)")
    src = efx.materialise(tmp_path / "dirs")["embeddinggemma"]
    real = llama_convert.convert(src, tmp_path / "real.gguf", python=PYTHON,
                                 extra=("--sentence-transformers-dense-modules",))
    (kv, tensors), (kv_real, tensors_real) = _read(convert(src, tmp_path / "mine.gguf", dense_modules=True)), _read(real)
    assert kv == kv_real and tensors.keys() == tensors_real.keys()
    for name, (kind, data) in tensors.items():
        assert kind == tensors_real[name][0] and np.array_equal(data, tensors_real[name][1]), name
    data = Path(__file__).resolve().parent / "data" / "embeddings"
    ref = load_file(str(data / "reference.safetensors"))["embeddinggemma/default"]
    ids = json.loads((data / "reference.json").read_text())["input_ids"]["embeddinggemma"]
    out = cw.ModelRuntime.load(real, device="cpu").embed(ids)
    assert max(rel_l2(out[i], ref[i]) for i in range(len(ids))) <= TOL
