"""`/v1/embeddings` through the official `openai` client and `/v1/rerank` (the Jina/Cohere shape)
on `candlewick serve` over the tiny checkpoints of tests/embedding_fixtures.py; the vectors and
scores are the sentence-transformers / transformers references of test_embeddings.py (relative
L2 ≤ 1e-4)."""

from __future__ import annotations

import base64
import urllib.request

import numpy as np
import pytest

import embedding_fixtures as fx
from conftest import rel_l2
from server_helpers import get_json, launch, post, stop
from test_embeddings import META, REF, TOL

openai = pytest.importorskip("openai")
pytest.importorskip("starlette")
pytest.importorskip("uvicorn")


def start(model) -> tuple:
    """The server over `model`, with the name it serves it under."""
    proc, base = launch("--model", str(model))
    return proc, base, get_json(base, "/v1/models")["data"][0]["id"]


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    return fx.materialise(tmp_path_factory.mktemp("embedding-server"))


@pytest.fixture(scope="module")
def embed_server(dirs):
    proc, base, name = start(dirs["qwen3"])
    yield base, name
    stop(proc)


@pytest.fixture(scope="module")
def rerank_server(dirs):
    proc, base, name = start(dirs["rerank"])
    yield base, name
    stop(proc)


@pytest.fixture(scope="module")
def client(embed_server):
    return openai.OpenAI(base_url=embed_server[0] + "/v1", api_key="unused", max_retries=0, timeout=60)


def close(rows, ref):
    rows = np.asarray(rows, dtype=np.float32)
    assert rows.shape == ref.shape, (rows.shape, ref.shape)
    return max(rel_l2(rows[i], ref[i]) for i in range(len(ref))) <= TOL


def test_openai_client_embeddings_float(client, embed_server):
    r = client.embeddings.create(model=embed_server[1], input=fx.TEXTS, encoding_format="float")
    assert [d.index for d in r.data] == list(range(len(fx.TEXTS)))
    assert close([d.embedding for d in r.data], REF["qwen3/default"])
    assert r.usage.prompt_tokens == sum(len(i) for i in META["input_ids"]["qwen3"]) == r.usage.total_tokens


def test_openai_client_default_base64_and_dimensions(client, embed_server):
    # The openai client asks for base64 by default and decodes it itself.
    r = client.embeddings.create(model=embed_server[1], input=fx.TEXTS, dimensions=32)
    assert close([d.embedding for d in r.data], REF["qwen3/dim32"])


def test_raw_base64_token_ids_and_prompt_name(embed_server):
    base, name = embed_server
    status, body, _ = post(base, "/v1/embeddings", {"model": name, "input": META["input_ids"]["qwen3"],
                                                    "encoding_format": "base64"})
    assert status == 200, body
    rows = [np.frombuffer(base64.b64decode(d["embedding"]), dtype="<f4") for d in body["data"]]
    assert close(rows, REF["qwen3/default"])
    status, body, _ = post(base, "/v1/embeddings", {"input": fx.TEXTS, "prompt_name": "query"})
    assert status == 200, body
    assert close([d["embedding"] for d in body["data"]], REF["qwen3/query"])
    status, body, _ = post(base, "/v1/embeddings", {"input": fx.TEXTS[0]})
    assert status == 200 and len(body["data"]) == 1


@pytest.mark.parametrize("body,param", [
    ({"input": fx.TEXTS, "encoding_format": "int8"}, "encoding_format"),
    ({"input": fx.TEXTS, "dimensions": 0}, "dimensions"),
    ({"input": []}, "input"),
    ({"input": [1.5]}, "input"),
    ({"input": "a", "truncate_prompt_tokens": 3}, "truncate_prompt_tokens"),
])
def test_embeddings_refusals_name_the_field(embed_server, body, param):
    status, answer, _ = post(embed_server[0], "/v1/embeddings", body)
    assert status == 400 and answer["error"]["param"] == param, answer


def test_embeddings_dimensions_too_wide_is_a_400(embed_server):
    status, answer, _ = post(embed_server[0], "/v1/embeddings", {"input": "a", "dimensions": 65})
    assert status == 400 and "dimensions" in answer["error"]["message"]


def test_rerank_jina_cohere_shape(rerank_server):
    base, name = rerank_server
    ref = REF["rerank/default"]
    docs = [fx.DOCUMENTS[0], {"text": fx.DOCUMENTS[1]}, *fx.DOCUMENTS[2:]]
    status, body, _ = post(base, "/v1/rerank", {"model": name, "query": fx.QUERY, "documents": docs,
                                                "return_documents": True})
    assert status == 200, body
    scores = np.zeros(len(ref), dtype=np.float32)
    for r in body["results"]:
        scores[r["index"]] = r["relevance_score"]
        assert r["document"]["text"] == fx.DOCUMENTS[r["index"]]
    assert rel_l2(scores, ref) <= TOL
    assert [r["index"] for r in body["results"]] == list(np.argsort(-ref, kind="stable"))
    status, top, _ = post(base, "/v1/rerank", {"query": fx.QUERY, "documents": fx.DOCUMENTS, "top_n": 1,
                                               "instruction": "Find the city"})
    assert status == 200 and len(top["results"]) == 1
    assert top["results"][0]["index"] == int(np.argmax(REF["rerank/instruction"]))
    status, answer, _ = post(base, "/v1/rerank", {"query": fx.QUERY, "documents": fx.DOCUMENTS, "rank_fields": ["x"]})
    assert status == 400 and answer["error"]["param"] == "rank_fields"


def test_concurrent_requests_each_get_their_reference_vectors(embed_server):
    # Requests sent together are batched into fewer `embed` calls (/metrics counts both); each
    # still gets its own texts' vectors, in order, whatever it was batched with.
    import re
    from concurrent.futures import ThreadPoolExecutor

    base, name = embed_server
    ref = REF["qwen3/default"]
    jobs = [[i % len(fx.TEXTS), (i + 1) % len(fx.TEXTS)] for i in range(12)]

    def one(rows):
        status, body, _ = post(base, "/v1/embeddings", {"model": name, "input": [fx.TEXTS[r] for r in rows]})
        assert status == 200, body
        return [d["embedding"] for d in body["data"]]

    def count(metric):
        with urllib.request.urlopen(base + "/metrics", timeout=10) as r:
            return int(re.search(rf"^{metric} (\d+)$", r.read().decode(), re.M).group(1))

    before = count("candlewick_embedding_requests_total"), count("candlewick_embedding_batches_total")
    with ThreadPoolExecutor(len(jobs)) as pool:
        answers = list(pool.map(one, jobs))
    for rows, got in zip(jobs, answers):
        assert close(got, ref[rows])
    requests = count("candlewick_embedding_requests_total") - before[0]
    batches = count("candlewick_embedding_batches_total") - before[1]
    assert requests == len(jobs) and 1 <= batches <= requests


def test_the_batcher_gathers_waiting_requests_and_isolates_a_failure():
    # In process, over a runtime whose `embed` waits until released: deterministic batching.
    import asyncio
    import threading

    from candlewick.serve.app import Metrics
    from candlewick.serve.embeddings import EmbeddingBatcher

    class Runtime:
        def __init__(self):
            self.calls, self.release = [], threading.Event()

        def embed(self, inputs, **options):
            self.calls.append((list(inputs), options))
            self.release.wait(10)
            if "bad" in inputs:
                raise ValueError("bad input")
            return np.array([[float(len(x)), float(options.get("dimensions") or 0)] for x in inputs], np.float32)

    async def scenario():
        rt, metrics = Runtime(), Metrics()
        b = EmbeddingBatcher(rt, metrics, max_inputs=4)
        first = asyncio.ensure_future(b.embed(["a"], {"dimensions": None}))
        await asyncio.sleep(0.05)   # the first call is running: the rest wait for the next one
        rest = [asyncio.ensure_future(b.embed(x, o)) for x, o in [
            (["bb", "ccc"], {"dimensions": None}), (["bad"], {"dimensions": None}),
            (["dddd"], {"dimensions": 8}), (["ee"], {"dimensions": None}), (["f"], {"dimensions": None})]]
        gone = asyncio.ensure_future(b.embed(["gone"], {"dimensions": None}))
        await asyncio.sleep(0.05)
        gone.cancel()
        rt.release.set()
        out = await asyncio.gather(first, *rest, return_exceptions=True)
        return rt, metrics, out

    rt, metrics, out = asyncio.run(scenario())
    assert out[0].tolist() == [[1, 0]]
    assert out[1].tolist() == [[2, 0], [3, 0]] and out[4].tolist() == [[2, 0]] and out[5].tolist() == [[1, 0]]
    assert isinstance(out[2], ValueError)
    assert out[3].tolist() == [[4, 8]]
    calls = [c[0] for c in rt.calls]
    # Same options together up to 4 inputs; the failed batch again request by request; the
    # cancelled request never embedded; other options in a call of their own.
    assert calls[0] == ["a"]
    assert calls[1] == ["bb", "ccc", "bad", "ee"]
    assert calls[2:5] == [["bb", "ccc"], ["bad"], ["ee"]]
    assert sorted(map(tuple, calls[5:])) == [("dddd",), ("f",)]
    assert "gone" not in sum(calls, [])
    # Counted: the calls that succeeded and the requests they answered (the failed one is not).
    assert metrics.embedding_requests == 5 and metrics.embedding_batches == 5
