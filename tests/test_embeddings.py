"""Embeddings and reranking against sentence-transformers and transformers (DESIGN §17).

The checkpoints are written by tests/embedding_fixtures.py (numpy, seeded); the references in
tests/data/embeddings/ were computed from them by tests/embedding_reference.py. Tolerance
(DESIGN §7, float32 against float32): relative L2 ≤ 1e-4 for every embedding and for the
vector of rerank scores.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import load_file

import candlewick as cw

import embedding_fixtures as fx
from conftest import rel_l2

DATA = Path(__file__).resolve().parent / "data" / "embeddings"
REF = load_file(str(DATA / "reference.safetensors"))
META = json.loads((DATA / "reference.json").read_text())
TOL = 1e-4
EMBED_CASES = sorted(k for k in META["cases"] if not k.startswith("rerank/"))
RERANK_CASES = sorted(k for k in META["cases"] if k.startswith("rerank/"))


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    return fx.materialise(tmp_path_factory.mktemp("embedding-models"))


@pytest.fixture(scope="module")
def models(dirs):
    return {k: cw.ModelRuntime.load(v, device="cpu") for k, v in dirs.items()}


@pytest.mark.parametrize("name", EMBED_CASES)
def test_embeddings_match_sentence_transformers(models, name):
    rt = models[name.split("/")[0]]
    out = rt.embed(fx.TEXTS, **META["cases"][name])
    ref = REF[name]
    assert out.dtype == np.float32 and out.shape == ref.shape, (out.shape, ref.shape)
    for i in range(len(fx.TEXTS)):
        assert rel_l2(out[i], ref[i]) <= TOL, (name, i, rel_l2(out[i], ref[i]))


@pytest.mark.parametrize("name", RERANK_CASES)
def test_rerank_matches_transformers(models, name):
    rt = models["rerank"]
    results = rt.rerank(fx.QUERY, fx.DOCUMENTS, **META["cases"][name])
    ref = REF[name]
    scores = np.zeros(len(fx.DOCUMENTS), dtype=np.float32)
    for r in results:
        scores[r["index"]] = r["relevance_score"]
    assert sorted(r["index"] for r in results) == list(range(len(fx.DOCUMENTS)))
    assert rel_l2(scores, ref) <= TOL, (scores, ref)
    # Best first.
    assert [r["index"] for r in results] == list(np.argsort(-ref, kind="stable"))


def test_rerank_top_n(models):
    rt = models["rerank"]
    every = rt.rerank(fx.QUERY, fx.DOCUMENTS)
    assert rt.rerank(fx.QUERY, fx.DOCUMENTS, top_n=2) == every[:2]


@pytest.mark.parametrize("key", ["qwen3", "gemma"])
def test_tokenization_matches_the_reference(models, key):
    tok = models[key].tokenizer
    assert [tok.encode(t) for t in fx.TEXTS] == META["input_ids"][key]


@pytest.mark.parametrize("key", ["qwen3", "gemma"])
def test_token_ids_and_single_inputs(models, key):
    rt = models[key]
    ref = REF[f"{key}/default"]
    ids = META["input_ids"][key]
    by_ids = rt.embed(ids)
    assert by_ids.shape == ref.shape
    assert max(rel_l2(by_ids[i], ref[i]) for i in range(len(ids))) <= TOL
    one = rt.embed(fx.TEXTS[2])
    assert one.shape == ref[2].shape and rel_l2(one, ref[2]) <= TOL
    one_ids = rt.embed(ids[2])
    assert one_ids.shape == ref[2].shape and rel_l2(one_ids, ref[2]) <= TOL


def test_embedding_info(models):
    q = models["qwen3"].embedding_info()
    assert q["pooling"] == "lasttoken" and q["normalize"] and q["dimension"] == 64
    assert q["prompts"] == fx.QWEN_PROMPTS and q["max_seq_length"] == fx.MAX_SEQ_LENGTH
    g = models["gemma"].embedding_info()
    assert g["pooling"] == "mean" and g["dimension"] == 48 and g["prompts"] == fx.GEMMA_PROMPTS
    assert g["sentence_transformers"]


def test_truncation_keeps_the_end_of_text_token(models):
    # With the query prompt the long texts pass max_seq_length: cut as transformers cuts them.
    rt = models["qwen3"]
    n = len(rt.tokenizer.encode(fx.QWEN_PROMPTS["query"] + fx.TEXTS[4]))
    assert n > fx.MAX_SEQ_LENGTH


def test_refusals(models, tiny_with_tokenizer):
    rt = models["qwen3"]
    with pytest.raises(cw.InvalidOptionError, match="pooling"):
        rt.embed(["a"], pooling="median")
    with pytest.raises(cw.InvalidOptionError, match="dimensions"):
        rt.embed(["a"], dimensions=65)
    with pytest.raises(cw.InvalidOptionError, match="prompt_name"):
        rt.embed(["a"], prompt_name="passage")
    with pytest.raises(cw.TokenOutOfRangeError):
        rt.embed([[1, 2, 100000]])
    with pytest.raises(cw.SessionError, match="no tokens"):
        rt.embed([[]])
    assert rt.embed([]).shape == (0, 64)
    assert rt.embed([], dimensions=8).shape == (0, 8)
    # A model without yes/no tokens cannot rerank.
    with pytest.raises(cw.InvalidOptionError, match="yes"):
        cw.ModelRuntime.load(tiny_with_tokenizer, device="cpu").rerank("q", ["d"])


def test_the_session_is_left_alone(models):
    rt = models["qwen3"]
    rt.prefill([5, 6, 7])
    before = rt.session.position
    rt.embed(fx.TEXTS)
    assert rt.session.position == before
    rt.session.reset()


def test_bidirectional_attention_is_what_matches(dirs, tmp_path):
    # The same Gemma weights with causal attention give other embeddings: the reference needs
    # the bidirectional mask (and its halved sliding window).
    causal = tmp_path / "causal"
    shutil.copytree(dirs["gemma"], causal)
    cfg = json.loads((causal / "config.json").read_text())
    cfg["use_bidirectional_attention"] = False
    (causal / "config.json").write_text(json.dumps(cfg))
    out = cw.ModelRuntime.load(causal, device="cpu").embed(fx.TEXTS)
    ref = REF["gemma/default"]
    assert min(rel_l2(out[i], ref[i]) for i in range(len(fx.TEXTS)) if len(fx.TEXTS[i].split()) > 1) > 1e-2


def test_a_bare_checkpoint_still_generates(models):
    # The embedding table stands in for the missing lm_head: the model runs as any other.
    r = models["qwen3"].generate("the cat", max_tokens=3, temperature=0, ignore_eos=True)
    assert len(r.token_ids) == 3


def test_command_line_embed_and_rerank(dirs, tmp_path):
    import subprocess
    import sys

    run = lambda *a: subprocess.run([sys.executable, "-m", "candlewick", *a, "--device", "cpu", "-q"],  # noqa: E731
                                    capture_output=True, text=True, timeout=120)
    r = run("embed", "--model", str(dirs["qwen3"]), "--prompt-name", "query", *fx.TEXTS[:2])
    assert r.returncode == 0, r.stderr
    rows = [json.loads(line) for line in r.stdout.splitlines()]
    assert [row["index"] for row in rows] == [0, 1]
    for i, row in enumerate(rows):
        assert rel_l2(row["embedding"], REF["qwen3/query"][i]) <= TOL
    out = tmp_path / "v.npy"
    r = run("embed", "--model", str(dirs["gemma"]), "--dimensions", "24", "--output", str(out), *fx.TEXTS)
    assert r.returncode == 0, r.stderr
    v = np.load(out)
    assert max(rel_l2(v[i], REF["gemma/dim24"][i]) for i in range(len(fx.TEXTS))) <= TOL
    r = run("rerank", "--model", str(dirs["rerank"]), "--top-n", "1", fx.QUERY, *fx.DOCUMENTS)
    assert r.returncode == 0, r.stderr
    best = json.loads(r.stdout)
    assert best["index"] == int(np.argmax(REF["rerank/default"]))


@pytest.mark.parametrize("mode,code", [("mean", 1), ("cls", 2), ("lasttoken", 3)])
def test_a_gguf_pools_as_it_declares(dirs, models, tmp_path, mode, code):
    """A decoder GGUF written by the converter (`_try_set_pooling_type`: the directory's Pooling
    module as `qwen3.pooling_type`) embeds with that pooling and no other setting: as the
    directory it came from (held to sentence-transformers above) with that pooling."""
    import gguf

    import gguf_convert

    src = tmp_path / "qwen3-embed"
    shutil.copytree(dirs["qwen3"], src)
    (src / "1_Pooling" / "config.json").write_text(json.dumps(fx._pooling(mode, 64)))
    path = gguf_convert.convert(src, tmp_path / f"{mode}.gguf", gguf_convert.F32)
    field = gguf.GGUFReader(str(path)).fields["qwen3.pooling_type"]
    assert int(field.parts[field.data[0]][0]) == code
    ids = [models["qwen3"].tokenizer.encode(t) for t in fx.TEXTS]
    want = models["qwen3"].embed(ids, pooling=mode)
    got = cw.ModelRuntime.load(path, device="cpu").embed(ids)
    for g, w in zip(got, want):
        assert rel_l2(g, w) <= TOL, (mode, rel_l2(g, w))


def test_embeddinggemma_gguf_embeds_as_the_directory(dirs, tmp_path):
    """EmbeddingGemma as llama.cpp's converter writes it with `--sentence-transformers-dense-modules`
    (`gemma-embedding`: Gemma 3 with bidirectional attention and a window symmetric about each
    token, `dense_2` / `dense_3` after the mean; tests/gguf_convert.py writes it, checked key for key
    against the converter in tests/test_encoders_llama_cpp.py) embeds the directory's token ids as
    sentence-transformers does; without the dense tensors it embeds as the directory without its
    Dense modules."""
    pytest.importorskip("gguf")
    import gguf_convert

    path = gguf_convert.convert(dirs["embeddinggemma"], tmp_path / "eg.gguf", gguf_convert.F32, dense_modules=True)
    rt = cw.ModelRuntime.load(path, device="cpu")
    assert rt.model_info["architecture"] == "gemma3" and rt.model_info["format"] == "gguf"
    info = rt.embedding_info()
    assert info["pooling"] == "mean" and info["normalize"] and info["dimension"] == 64
    ids = META["input_ids"]["embeddinggemma"]
    out, ref = rt.embed(ids), REF["embeddinggemma/default"]
    assert max(rel_l2(out[i], ref[i]) for i in range(len(ids))) <= TOL
    # Without the dense layers: the directory with only its Pooling and Normalize modules.
    bare = gguf_convert.convert(dirs["embeddinggemma"], tmp_path / "bare.gguf", gguf_convert.F32)
    src = tmp_path / "no-dense"
    shutil.copytree(dirs["embeddinggemma"], src)
    modules = [m for m in json.loads((src / "modules.json").read_text()) if not m["type"].endswith("Dense")]
    (src / "modules.json").write_text(json.dumps(modules))
    want = cw.ModelRuntime.load(src, device="cpu").embed(ids)
    got = cw.ModelRuntime.load(bare, device="cpu").embed(ids)
    assert got.shape == want.shape and max(rel_l2(got[i], want[i]) for i in range(len(ids))) <= TOL
