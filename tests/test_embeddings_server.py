"""`/v1/embeddings` through the official `openai` client and `/v1/rerank` (the Jina/Cohere shape)
on `candlewick serve` over the tiny checkpoints of tests/embedding_fixtures.py; the vectors and
scores are the sentence-transformers / transformers references of test_embeddings.py (relative
L2 ≤ 1e-4)."""

from __future__ import annotations

import base64

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
