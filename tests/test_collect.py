"""Activation datasets (issue 40): `cw.collect` writes every document's rows, in batches stopped
after the last layer needed, resumes after an interruption, and `candlewick collect` does the
same from the command line."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest
from safetensors.numpy import load_file

import candlewick as cw

import sae_fixtures as fx

POINTS = ["model.layers.0.output", "model.layers.1.attention.heads"]


def corpus(n=9):
    rng = np.random.default_rng(5)
    return [rng.integers(3, 500, size=int(rng.integers(4, 30))).tolist() for _ in range(n)]


@pytest.fixture(scope="module")
def rt(tiny_with_tokenizer, tmp_path_factory):
    rt = cw.ModelRuntime.load(str(tiny_with_tokenizer))
    paths = fx.materialise(tmp_path_factory.mktemp("saes"))
    rt.attach_sae(str(paths["standard"]), name="res1")
    return rt


def read(out):
    index = json.loads((out / "index.json").read_text())
    shards = [load_file(str(out / s["file"])) for s in index["shards"]]
    return index, {k: np.concatenate([s[k] for s in shards]) for k in shards[0]}


def test_rows_equal_each_documents_trace(rt, tmp_path):
    docs = corpus()
    out = tmp_path / "acts"
    index = cw.collect(rt, docs, points=POINTS, out=out, dtype="float32", shard_size=40, batch_tokens=50,
                       sae_features=["res1"], progress=False)
    assert index["last_layer"] == 1 and index["documents"] == len(docs)
    index, rows = read(out)
    assert len(index["shards"]) > 1 and index["rows"] == sum(map(len, docs))
    np.testing.assert_array_equal(rows["token_ids"], np.concatenate(docs))
    np.testing.assert_array_equal(rows["document"], np.repeat(np.arange(len(docs)), list(map(len, docs))))
    np.testing.assert_array_equal(rows["position"], np.concatenate([np.arange(len(d)) for d in docs]))
    at = np.cumsum([0] + list(map(len, docs)))
    req = cw.ObservationRequest.exact(POINTS + ["sae.res1.features"])
    for d in (0, 4, len(docs) - 1):
        obs = rt.trace(docs[d], request=req).observations
        for p in POINTS:
            want = np.asarray(obs[p]).reshape(len(docs[d]), -1)
            np.testing.assert_allclose(rows[p][at[d]:at[d + 1]], want, rtol=1e-5, atol=1e-5)
    # Features: compressed rows over the shards (indptr restarts at each shard).
    shards = [load_file(str(out / s["file"])) for s in index["shards"]]
    dense = []
    for s in shards:
        n = len(s["token_ids"])
        a = np.zeros((n, fx.D_SAE), np.float32)
        r = np.repeat(np.arange(n), np.diff(s["sae.res1.indptr"]))
        a[r, s["sae.res1.indices"]] = s["sae.res1.values"]
        dense.append(a)
    dense = np.concatenate(dense)
    obs = rt.trace(docs[4], request=req).observations
    np.testing.assert_allclose(dense[at[4]:at[5]], obs["sae.res1.features"].toarray(), rtol=1e-5, atol=1e-5)


def test_an_engine_collects_through_its_runtime(rt, tmp_path):
    docs = corpus(3)
    with cw.Engine(rt) as engine:
        index = cw.collect(engine, docs, points=POINTS[:1], out=tmp_path / "e", progress=False)
    assert index["rows"] == sum(map(len, docs))


def test_stops_after_the_last_layer_needed(rt):
    exact = cw.ObservationRequest.exact
    assert rt.last_layer_needed(exact(["model.layers.0.output"])) == 0
    assert rt.last_layer_needed(exact(["model.embed_tokens"])) == 0
    assert rt.last_layer_needed(exact(["sae.res1.features"])) == 1
    assert rt.last_layer_needed(exact(["model.layers.2.input"])) == 2
    assert rt.last_layer_needed(exact(["model.norm"])) is None
    # A request for the logits still runs the whole pass.
    sets = rt.collect_batch([[5, 6, 7]], exact(["model.logits"]))
    np.testing.assert_allclose(sets[0]["model.logits"], rt.trace([5, 6, 7]).output.logits, rtol=1e-5, atol=1e-5)


def test_resumes_after_an_interruption(rt, tmp_path):
    docs = corpus(12)
    out = tmp_path / "acts"

    def interrupted():
        for i, d in enumerate(docs):
            if i == 8:
                raise KeyboardInterrupt
            yield d

    with pytest.raises(KeyboardInterrupt):
        cw.collect(rt, interrupted(), points=POINTS[:1], out=out, shard_size=20, batch_tokens=30, progress=False)
    partial = json.loads((out / "index.json").read_text())
    assert 0 < partial["documents"] < 8
    index = cw.collect(rt, docs, points=POINTS[:1], out=out, shard_size=20, batch_tokens=30, progress=False)
    assert index["documents"] == len(docs)
    _, rows = read(out)
    np.testing.assert_array_equal(rows["token_ids"], np.concatenate(docs))
    assert rows[POINTS[0]].dtype == np.float16
    fresh = tmp_path / "fresh"
    cw.collect(rt, docs, points=POINTS[:1], out=fresh, shard_size=20, batch_tokens=30, progress=False)
    np.testing.assert_array_equal(read(fresh)[1][POINTS[0]], rows[POINTS[0]])
    with pytest.raises(ValueError, match="attention.pattern"):
        cw.collect(rt, docs, points=["model.layers.0.attention.pattern"], out=tmp_path / "p", progress=False)
    with pytest.raises(ValueError, match="written with"):
        cw.collect(rt, docs, points=POINTS, out=out, progress=False)


def test_cli_collect(tiny_with_tokenizer, tmp_path):
    text = tmp_path / "corpus.txt"
    text.write_text("t5 t6 t7 t8\nt9 t10\n\nt11 t12 t13\n")
    out = tmp_path / "acts"
    r = subprocess.run([sys.executable, "-m", "candlewick", "collect", str(text), "--model", str(tiny_with_tokenizer),
                        "--point", "model.layers.1.output", "--out", str(out), "--device", "cpu"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    index, rows = read(out)
    assert index["documents"] == 3 and rows["model.layers.1.output"].shape == (index["rows"], 64)
    rt = cw.ModelRuntime.load(str(tiny_with_tokenizer))
    np.testing.assert_array_equal(rows["token_ids"][:4], rt.tokenizer.encode("t5 t6 t7 t8"))


def test_long_documents_run_in_chunks(tiny_with_tokenizer, rt):
    """Documents longer than the runtime's chunk run in steps of it, shorter ones leave the batch
    early, and every row is what one pass over the document gives."""
    chunked = cw.ModelRuntime.load(str(tiny_with_tokenizer), prefill_chunk=4)
    docs = corpus(5)
    req = cw.ObservationRequest.exact(POINTS)
    for got, d in zip(chunked.collect_batch(docs, req), docs):
        want = rt.trace(d, request=req).observations
        for p in POINTS:
            np.testing.assert_allclose(got[p], want[p], rtol=1e-5, atol=1e-5)
