"""The engine's prefix cache (DESIGN §12): prompt prefixes' keys and values kept across requests
in 64-token blocks, reused by later requests that start the same way, within a byte budget."""

import numpy as np
import pytest

import candlewick as cw
from candlewick import interventions as iv

BLOCK = 64
GREEDY = dict(max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=True)


@pytest.fixture
def rt(tiny_with_tokenizer):
    return cw.ModelRuntime.load(tiny_with_tokenizer, device="cpu")


def ids(seed, n):
    return np.random.default_rng(seed).integers(3, 512, size=n).tolist()


def alone(rt, prompt, **options):
    """The answer of a plain generate on an empty session."""
    rt.session.reset()
    r = rt.generate(prompt, **{**GREEDY, **options})
    rt.session.reset()
    return r


def run(engine, prompt, **options):
    req = engine.submit(prompt, **{**GREEDY, **options})
    assert req.wait() is not None
    return req.result


def logprobs_of(result):
    return np.array([t["logprob"] for t in result.logprobs])


def test_a_shared_prefix_is_restored_and_gives_the_same_answer(rt):
    system = ids(0, 3 * BLOCK + 10)  # three whole blocks and a partial one
    first, second = system + ids(1, 20), system + ids(2, 30)
    want = alone(rt, second)
    with cw.Engine(rt, max_batch_size=1) as engine:
        run(engine, first)
        # Another request in between takes the idle session, so the second must come from the cache.
        run(engine, ids(3, 40))
        got = run(engine, second)
        stats = engine.stats()
    assert got.usage["cached_tokens"] == 3 * BLOCK
    assert got.token_ids == want.token_ids
    np.testing.assert_allclose(logprobs_of(got), logprobs_of(want), rtol=0, atol=1e-5)
    assert stats["prefix_hits"] >= 1 and stats["cached_tokens"] >= 3 * BLOCK
    assert 0 < stats["prefix_cache_bytes"] <= 256 << 20


def test_a_restored_prefix_serves_many_requests_at_once(rt):
    system = ids(10, 2 * BLOCK)
    prompts = [system + ids(20 + i, 5 + i) for i in range(4)]
    want = [alone(rt, p).token_ids for p in prompts]
    with cw.Engine(rt, max_batch_size=4) as engine:
        run(engine, system + ids(19, 3))
        reqs = [engine.submit(p, **GREEDY) for p in prompts]
        got = [r.wait() and r.result for r in reqs]
    assert [g.token_ids for g in got] == want
    # Each of the four restored the two blocks (the idle session serves at most one of them).
    assert sum(g.usage["cached_tokens"] for g in got) >= 3 * 2 * BLOCK


def test_off_means_nothing_is_kept(rt):
    system = ids(4, 2 * BLOCK + 1)
    with cw.Engine(rt, max_batch_size=1, prefix_cache_bytes=0) as engine:
        run(engine, system + [5])
        run(engine, ids(5, 30))
        got = run(engine, system + [6])
        stats = engine.stats()
    assert got.usage["cached_tokens"] == 0
    assert stats["prefix_cache_bytes"] == 0


def test_the_budget_holds_and_the_least_recently_used_go_first(rt):
    block_bytes = 2 * rt.model_info["num_layers"] * BLOCK * rt.model_info["num_kv_heads"] * rt.model_info[
        "head_dim"] * 4
    budget = 3 * block_bytes
    a, b = ids(6, 2 * BLOCK + 1), ids(7, 2 * BLOCK + 1)
    with cw.Engine(rt, max_batch_size=1, prefix_cache_bytes=budget) as engine:
        run(engine, a)  # two blocks of a
        run(engine, b)  # two of b: a's last block goes
        stats = engine.stats()
        assert stats["prefix_cache_bytes"] <= budget and stats["prefix_cache_evictions"] == 1
        run(engine, ids(8, 10))  # takes the idle session
        # b is cached whole, a only its first block.
        assert run(engine, b[:-1] + [9]).usage["cached_tokens"] == 2 * BLOCK
        run(engine, ids(9, 10))
        assert run(engine, a[:-1] + [9]).usage["cached_tokens"] == BLOCK


def test_requests_with_edits_neither_use_nor_fill_the_cache(rt):
    system = ids(11, 2 * BLOCK + 1)
    edit = [iv.add("model.layers.0.output", np.full(rt.model_info["hidden_size"], 0.5, np.float32))]
    with cw.Engine(rt, max_batch_size=1) as engine:
        run(engine, system, interventions=edit)
        assert engine.stats()["prefix_cache_bytes"] == 0
        run(engine, system)
        run(engine, ids(12, 10))
        edited = run(engine, system[:-1] + [7], interventions=edit)
        stats = engine.stats()
    assert edited.usage["cached_tokens"] == 0
    assert stats["prefix_cache_bytes"] > 0
    rt.session.reset()
    with rt.intervene(edit):
        want = rt.generate(system[:-1] + [7], **GREEDY)
    assert edited.token_ids == want.token_ids


def test_server_metrics_report_the_hit_rate(rt):
    from candlewick.serve.app import Server, build_app
    from starlette.testclient import TestClient

    system = " ".join(f"t{i}" for i in ids(13, 2 * BLOCK))
    server = Server(rt, "tiny")
    with TestClient(build_app(server)) as client:
        for tail in ("t1 t2", "t3 t4"):
            r = client.post("/v1/completions", json={"model": "tiny", "prompt": system + " " + tail,
                                                     "max_tokens": 2, "temperature": 0})
            assert r.status_code == 200
        usage = r.json()["usage"]
        metrics = client.get("/metrics").text
    assert usage["prompt_tokens_details"]["cached_tokens"] == 2 * BLOCK
    values = dict(line.split(" ") for line in metrics.splitlines() if not line.startswith("#") and "{" not in line)
    assert int(values["candlewick_prefix_cache_cached_tokens_total"]) >= 2 * BLOCK
    assert float(values["candlewick_prefix_cache_hit_rate"]) > 0
    server.engine.close()
