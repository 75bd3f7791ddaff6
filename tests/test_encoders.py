"""BERT-family encoders and cross-encoders against sentence-transformers (DESIGN §17).

The checkpoints are written by tests/encoder_fixtures.py (numpy, seeded; a WordPiece tokenizer
built with `tokenizers`); the references in tests/data/encoders/ were computed from them by
tests/encoder_reference.py (SentenceTransformer with Transformer + Pooling + Normalize modules,
CrossEncoder). Tolerance (DESIGN §7, float32 against float32): relative L2 ≤ 1e-4 for every
embedding and for the vector of rerank scores.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import load_file

import candlewick as cw

import encoder_fixtures as fx
from conftest import rel_l2

DATA = Path(__file__).resolve().parent / "data" / "encoders"
REF = load_file(str(DATA / "reference.safetensors"))
META = json.loads((DATA / "reference.json").read_text())
# llama.cpp's embeddings of the GGUF files its own converter writes of nomic-embed and
# modernbert-embed (tests/encoder_llama_reference.py).
LLAMA = load_file(str(DATA / "llama_cpp.safetensors"))
LLAMA_META = json.loads((DATA / "llama_cpp.json").read_text())
TOL = 1e-4
# llama.cpp computes GELU from a float16 table of its input (ggml's GGML_GELU_FP16, the tanh
# form): its ModernBERT (GeGLU) is 5e-4 to 9e-4 from the float32 reference, sentence-transformers,
# which candlewick matches within 1.4e-6. That is llama.cpp's rounding, not a tolerance on
# candlewick: this bound only says the two agree as peers.
LLAMA_GELU_PEER = 2e-3
EMBED_CASES = sorted(k for k in META["cases"] if "-embed/" in k)
RERANKERS = ["bert-rerank", "xlmr-rerank", "modernbert-rerank"]


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    return fx.materialise(tmp_path_factory.mktemp("encoder-models"))


@pytest.fixture(scope="module")
def models(dirs):
    return {k: cw.ModelRuntime.load(v, device="cpu") for k, v in dirs.items()}


@pytest.mark.parametrize("name", EMBED_CASES)
def test_embeddings_match_sentence_transformers(models, name):
    rt = models[name.split("/")[0]]
    texts = META["texts"].get(name, fx.TEXTS)
    out = rt.embed(texts, **META["cases"][name])
    ref = REF[name]
    assert out.dtype == np.float32 and out.shape == ref.shape, (out.shape, ref.shape)
    for i in range(len(texts)):
        assert rel_l2(out[i], ref[i]) <= TOL, (name, i, rel_l2(out[i], ref[i]))


@pytest.mark.parametrize("key", ["bert-embed", "xlmr-embed", "modernbert-embed", "nomic-embed"])
def test_tokenization_and_ids_match_the_reference(models, key):
    rt = models[key]
    assert [rt.tokenizer.encode(t) for t in fx.TEXTS] == META["input_ids"][key]
    ids = META["input_ids"][key]
    by_ids = rt.embed(ids)
    ref = REF[f"{key}/default"]
    # Ids past max_seq_length (16) are cut at their end, [SEP] included, where a text keeps its
    # [SEP]: only the inputs that fit compare.
    limit = rt.embedding_info()["max_seq_length"]
    fit = [i for i in range(len(ids)) if len(ids[i]) <= limit]
    assert len(fit) >= 4 and max(rel_l2(by_ids[i], ref[i]) for i in fit) <= TOL
    one = rt.embed(fx.TEXTS[1])
    assert one.shape == ref[1].shape and rel_l2(one, ref[1]) <= TOL


@pytest.mark.parametrize("key", RERANKERS)
def test_cross_encoder_scores_match_sentence_transformers(models, key):
    results = models[key].rerank(fx.QUERY, fx.DOCUMENTS)
    ref = REF[f"{key}/default"]
    scores = np.zeros(len(fx.DOCUMENTS), dtype=np.float32)
    for r in results:
        scores[r["index"]] = r["relevance_score"]
    assert sorted(r["index"] for r in results) == list(range(len(fx.DOCUMENTS)))
    assert rel_l2(scores, ref) <= TOL, (scores, ref)
    assert [r["index"] for r in results] == list(np.argsort(-ref, kind="stable"))
    assert models[key].rerank(fx.QUERY, fx.DOCUMENTS, top_n=2) == results[:2]


@pytest.mark.parametrize("key", RERANKERS)
def test_long_pairs_are_cut_longest_first(models, key):
    scores = [models[key].rerank(q, [d])[0]["relevance_score"] for q, d in fx.LONG_PAIRS]
    assert rel_l2(np.array(scores, dtype=np.float32), REF[f"{key}/long"]) <= TOL


def test_modernbert_head_reads_the_first_token_when_configured(dirs, tmp_path):
    # gte-reranker-modernbert pools the mean before its head; classifier_pooling = "cls" reads
    # the first token.
    d = tmp_path / "cls"
    shutil.copytree(dirs["modernbert-rerank"], d)
    cfg = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps(cfg | {"classifier_pooling": "cls"}))
    results = cw.ModelRuntime.load(d, device="cpu").rerank(fx.QUERY, fx.DOCUMENTS)
    scores = np.array([r["relevance_score"] for r in sorted(results, key=lambda r: r["index"])], dtype=np.float32)
    assert rel_l2(scores, REF["modernbert-rerank/cls"]) <= TOL, (scores, REF["modernbert-rerank/cls"])


def test_modernbert_sliding_layers_see_their_window_only(models, dirs, tmp_path):
    # The same weights with a window wider than any text give other vectors for the texts longer
    # than the window, the same for the others: the references above exercise the window.
    rt = models["modernbert-embed"]
    assert rt.model_info["architecture"] == "modernbert"
    e = rt.embedding_info()
    assert e["pooling"] == "mean" and e["prompts"] == fx.NOMIC_PROMPTS and e["max_seq_length"] == 128
    d = tmp_path / "wide"
    shutil.copytree(dirs["modernbert-embed"], d)
    cfg = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps(cfg | {"local_attention": 512}))
    wide = cw.ModelRuntime.load(d, device="cpu").embed(fx.TEXTS)
    ref = REF["modernbert-embed/default"]
    lens = [len(ids) for ids in META["input_ids"]["modernbert-embed"]]
    # A token sees those at most local_attention / 2 away: a text of more tokens than that + 1
    # has pairs the window separates.
    reach = fx.MODERNBERT_LOCAL // 2
    for i, n in enumerate(lens):
        if n > reach + 1:
            assert rel_l2(wide[i], ref[i]) > 1e-3, (i, n)
        else:
            assert rel_l2(wide[i], ref[i]) <= TOL, (i, n)
    assert sum(n > reach + 1 for n in lens) >= 3 and min(lens) <= reach + 1


def test_identity_activation_gives_the_logits(dirs, tmp_path):
    # sentence-transformers reads the CrossEncoder activation from config.json.
    d = tmp_path / "identity"
    shutil.copytree(dirs["bert-rerank"], d)
    cfg = json.loads((d / "config.json").read_text())
    cfg["sentence_transformers"] = {"activation_fn": "torch.nn.modules.linear.Identity"}
    (d / "config.json").write_text(json.dumps(cfg))
    results = cw.ModelRuntime.load(d, device="cpu").rerank(fx.QUERY, fx.DOCUMENTS)
    scores = np.array([r["relevance_score"] for r in sorted(results, key=lambda r: r["index"])], dtype=np.float32)
    assert rel_l2(scores, REF["bert-rerank/logits"]) <= TOL


def test_model_info_and_embedding_info(models):
    info = models["bert-embed"].model_info
    assert info["architecture"] == "bert" and info["num_layers"] == 2 and info["hidden_size"] == 32
    assert models["xlmr-rerank"].model_info["architecture"] == "xlm-roberta"
    e = models["bert-embed"].embedding_info()
    assert e["pooling"] == "mean" and e["normalize"] and e["prompts"] == fx.PROMPTS
    assert e["max_seq_length"] == fx.MAX_SEQ_LENGTH
    assert models["xlmr-embed"].embedding_info()["pooling"] == "cls"
    # Without sentence-transformers files an encoder pools the mean, as sentence-transformers does.
    assert models["bert-rerank"].embedding_info()["pooling"] == "mean"
    for name in ("bert", "roberta", "xlm-roberta", "modernbert", "nomic_bert"):
        assert name in cw.supported_architectures()
    gguf = cw.supported_architectures("gguf")
    assert {"bert", "modernbert", "nomic_bert"} <= set(gguf) and "xlm-roberta" not in gguf


def test_decoder_calls_are_refused(models):
    rt = models["bert-embed"]
    for call in (
        lambda: rt.generate("the cat", max_tokens=2),
        lambda: rt.prefill([5, 6]),
        lambda: rt.trace([5, 6]),
    ):
        with pytest.raises(cw.UnsupportedError, match="bert encoder"):
            call()
    assert rt.session.position == 0
    # An encoder without a classification head cannot rerank; a cross-encoder takes no instruction.
    with pytest.raises(cw.InvalidOptionError, match="classification head"):
        rt.rerank("q", ["d"])
    with pytest.raises(cw.InvalidOptionError, match="instruction"):
        models["bert-rerank"].rerank("q", ["d"], instruction="x")
    with pytest.raises(cw.TokenOutOfRangeError):
        rt.embed([[2, 1000, 3]])
    with pytest.raises(cw.SessionError, match="no tokens"):
        rt.embed([[]])
    assert rt.embed([]).shape == (0, 32)


def test_long_inputs_are_cut_at_the_positions(models):
    # No max_seq_length (a bare cross-encoder's directory embeds): texts stop at the 64 positions,
    # ids alike; a pair longer than the positions is cut longest-first.
    rt = models["bert-rerank"]
    words = "the cat sat on the mat".split() * 20
    long = " ".join(words)
    # [CLS] + 62 words + [SEP].
    assert rel_l2(rt.embed(long), rt.embed(" ".join(words[:62]))) <= 1e-6
    assert len(rt.rerank(long, [long, "a dog"])) == 2


def test_command_line_and_server_paths(dirs):
    import subprocess
    import sys

    r = subprocess.run(
        [sys.executable, "-m", "candlewick", "embed", "--model", str(dirs["bert-embed"]), "--device", "cpu", "-q",
         "--prompt-name", "query", *fx.TEXTS[:2]],
        capture_output=True, text=True, timeout=120,
    )
    assert r.returncode == 0, r.stderr
    rows = [json.loads(line) for line in r.stdout.splitlines()]
    for i, row in enumerate(rows):
        assert rel_l2(row["embedding"], REF["bert-embed/query"][i]) <= TOL
    r = subprocess.run(
        [sys.executable, "-m", "candlewick", "rerank", "--model", str(dirs["xlmr-rerank"]), "--device", "cpu", "-q",
         "--top-n", "1", fx.QUERY, *fx.DOCUMENTS],
        capture_output=True, text=True, timeout=120,
    )
    assert r.returncode == 0, r.stderr
    best = json.loads(r.stdout)
    assert best["index"] == int(np.argmax(REF["xlmr-rerank/default"]))


def test_server_embeddings_and_rerank(dirs):
    # /v1/embeddings over an encoder and /v1/rerank over a cross-encoder, as for any model.
    pytest.importorskip("starlette")
    pytest.importorskip("uvicorn")
    from test_embeddings_server import start
    from test_server import post, stop

    proc, base, name = start(dirs["bert-embed"])
    try:
        status, body, _ = post(base, "/v1/embeddings", {"model": name, "input": fx.TEXTS, "dimensions": 12})
        assert status == 200, body
        rows = np.array([d["embedding"] for d in body["data"]], dtype=np.float32)
        assert max(rel_l2(rows[i], REF["bert-embed/dim12"][i]) for i in range(len(fx.TEXTS))) <= TOL
        status, body, _ = post(base, "/v1/completions", {"model": name, "prompt": "the cat", "max_tokens": 2})
        assert status >= 400 and "encoder" in json.dumps(body), body
    finally:
        stop(proc)
    proc, base, name = start(dirs["xlmr-rerank"])
    try:
        status, body, _ = post(base, "/v1/rerank", {"model": name, "query": fx.QUERY, "documents": fx.DOCUMENTS})
        assert status == 200, body
        scores = np.zeros(len(fx.DOCUMENTS), dtype=np.float32)
        for r in body["results"]:
            scores[r["index"]] = r["relevance_score"]
        assert rel_l2(scores, REF["xlmr-rerank/default"]) <= TOL
    finally:
        stop(proc)


def test_gguf_bert_embeds_as_sentence_transformers(dirs, tmp_path):
    # llama.cpp's converter's file of the same weights (tests/gguf_convert.py writes it as the
    # converter does): WordPiece in "phantom space", mean pooling from `bert.pooling_type`.
    pytest.importorskip("gguf")
    from gguf_convert import convert

    path = convert(dirs["bert-embed"], tmp_path / "bert.gguf")
    rt = cw.ModelRuntime.load(path, device="cpu")
    assert rt.model_info["architecture"] == "bert" and rt.model_info["format"] == "gguf"
    assert [rt.tokenizer.encode(t) for t in fx.TEXTS] == META["input_ids"]["bert-embed"]
    assert rt.embedding_info()["pooling"] == "mean"
    out, ref = rt.embed(fx.TEXTS), REF["bert-embed/default"]
    # The file has no max_seq_length: only the texts the directory's 16 tokens do not cut compare.
    fit = [i for i, ids in enumerate(META["input_ids"]["bert-embed"]) if len(ids) <= fx.MAX_SEQ_LENGTH]
    assert len(fit) >= 4 and max(rel_l2(out[i], ref[i]) for i in fit) <= TOL
    with pytest.raises(cw.UnsupportedError, match="encoder"):
        rt.generate("the cat", max_tokens=1)


def test_nomic_directory_matches_llama_cpp(models):
    # The same texts (with and without the query prompt) through llama.cpp's file of the same
    # weights: its tokens are the directory's, its vectors within 1e-4 (SwiGLU: no table).
    rt = models["nomic-embed"]
    assert LLAMA_META["input_ids"]["nomic-embed/default"] == META["input_ids"]["nomic-embed"]
    for case, args in (("default", {}), ("query", {"prompt_name": "query"})):
        out, ref = rt.embed(fx.TEXTS, **args), LLAMA[f"nomic-embed/{case}"]
        assert max(rel_l2(out[i], ref[i]) for i in range(len(fx.TEXTS))) <= TOL, case


@pytest.mark.parametrize("key", ["nomic-embed", "modernbert-embed"])
def test_gguf_nomic_bert_and_modern_bert_embed_as_the_directory(dirs, tmp_path, key):
    # llama.cpp's converter's file (tests/gguf_convert.py writes it as convert_hf_to_gguf.py
    # does, checked against it key for key in tests/test_encoders_llama_cpp.py): nomic-bert's
    # WordPiece vocabulary, ModernBERT's byte-level BPE (`modern-bert` pre-tokenizer, [CLS] / [SEP]
    # added), the pooling from `{arch}.pooling_type`, ModernBERT's window and both rotary bases.
    pytest.importorskip("gguf")
    from gguf_convert import convert

    path = convert(dirs[key], tmp_path / f"{key}.gguf")
    rt = cw.ModelRuntime.load(path, device="cpu")
    family = {"nomic-embed": "nomic_bert", "modernbert-embed": "modernbert"}[key]
    assert rt.model_info["architecture"] == family and rt.model_info["format"] == "gguf"
    assert [rt.tokenizer.encode(t) for t in fx.TEXTS] == META["input_ids"][key]
    assert LLAMA_META["input_ids"][f"{key}/default"] == META["input_ids"][key]
    assert rt.embedding_info()["pooling"] == "mean"
    out = rt.embed(fx.TEXTS)
    for i in range(len(fx.TEXTS)):
        assert rel_l2(out[i], REF[f"{key}/default"][i]) <= TOL, i
    peer = TOL if key == "nomic-embed" else LLAMA_GELU_PEER
    assert max(rel_l2(out[i], LLAMA[f"{key}/default"][i]) for i in range(len(fx.TEXTS))) <= peer
    query = rt.embed([fx.NOMIC_PROMPTS["query"] + t for t in fx.TEXTS])
    assert max(rel_l2(query[i], REF[f"{key}/query"][i]) for i in range(len(fx.TEXTS))) <= TOL
    with pytest.raises(cw.UnsupportedError, match="encoder"):
        rt.generate("the cat", max_tokens=1)


def test_gguf_modern_bert_cross_encoder_reranks_as_sentence_transformers(dirs, tmp_path):
    # The converter keeps ModernBERT's head whole (`cls`, `cls.norm`, `cls.output`) and its
    # `classifier.pooling_type`; pairs are `[CLS] q [SEP] d [SEP]` as llama.cpp's rerank forms
    # them from a BERT-family vocabulary (`add_sep_token` written, false here).
    pytest.importorskip("gguf")
    from gguf_convert import convert

    for config, case in (({}, "default"), ({"classifier_pooling": "cls"}, "cls")):
        path = convert(dirs["modernbert-rerank"], tmp_path / f"{case}.gguf", config=config)
        rt = cw.ModelRuntime.load(path, device="cpu")
        results = rt.rerank(fx.QUERY, fx.DOCUMENTS)
        scores = np.array([r["relevance_score"] for r in sorted(results, key=lambda r: r["index"])], dtype=np.float32)
        assert rel_l2(scores, REF[f"modernbert-rerank/{case}"]) <= TOL, (case, scores)
    # The long pairs' reference is the mean head's, cut longest-first to the 128 positions.
    path = convert(dirs["modernbert-rerank"], tmp_path / "mean.gguf")
    long = [cw.ModelRuntime.load(path, device="cpu").rerank(q, [d])[0]["relevance_score"] for q, d in fx.LONG_PAIRS]
    assert rel_l2(np.array(long, dtype=np.float32), REF["modernbert-rerank/long"]) <= TOL


def test_nomic_bert_config_with_transformers_names_only(dirs, tmp_path):
    # A config transformers' own `nomic_bert` wrote from scratch has only BERT's key names (the
    # tensors it saves keep the released names): the same model.
    d = tmp_path / "native"
    shutil.copytree(dirs["nomic-embed"], d)
    cfg = json.loads((d / "config.json").read_text())
    for key in ("n_embd", "n_layer", "n_head", "n_inner", "n_positions", "layer_norm_epsilon", "rotary_emb_base"):
        cfg.pop(key)
    (d / "config.json").write_text(json.dumps(cfg))
    out, ref = cw.ModelRuntime.load(d, device="cpu").embed(fx.TEXTS), REF["nomic-embed/default"]
    assert max(rel_l2(out[i], ref[i]) for i in range(len(fx.TEXTS))) <= TOL
