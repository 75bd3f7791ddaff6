"""The engine's prefix cache (issue 25, item 5): time to first token of a request whose long
prefix is cached, beside the same request computed from nothing.

    python benches/prefix_cache.py [--model PATH] [--prefix-tokens 2000] [--tail-tokens 40] [--runs 5]

Each run draws a fresh `--prefix-tokens` prefix (random ids of the vocabulary) and three tails:
  uncached  prefix + tail A on an engine whose prefix cache is off and whose sessions never held it;
  cached    prefix + tail C after prefix + tail B ran and another request took the idle session, so
            the prefix comes from the cache's blocks (a copy) and only the rest is computed.
Time to first token is measured by the client, from `submit` to the first streamed piece (the copy
out of the cache included). Reports medians and their ratio, and the engine's hit counters.
"""

import argparse
import json
import statistics
import time

from compare import cpu_name, default_model  # benches/compare.py: one way to name the host and the model


def ttft(engine, ids):
    t = time.perf_counter()
    req = engine.submit(ids, max_tokens=2, temperature=0.0, ignore_eos=True)
    next(iter(req))
    first = time.perf_counter() - t
    req.wait()
    return first, req.result.usage["cached_tokens"]


def main():
    import candlewick as cw
    import numpy as np

    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None)
    ap.add_argument("--prefix-tokens", type=int, default=2000)
    ap.add_argument("--tail-tokens", type=int, default=40)
    ap.add_argument("--runs", type=int, default=5)
    args = ap.parse_args()
    model = args.model or default_model()
    rt = cw.ModelRuntime.load(model)
    vocab = rt.model_info["vocab_size"]
    rng = np.random.default_rng(0)
    draw = lambda n: [int(x) for x in rng.integers(1000, min(vocab, 20000), n)]  # noqa: E731

    off = cw.Engine(rt, max_batch_size=1, prefix_cache_bytes=0)
    on = cw.Engine(rt, max_batch_size=1)
    uncached, cached, reused = [], [], []
    for _ in range(args.runs):
        prefix = draw(args.prefix_tokens)
        t, _ = ttft(off, prefix + draw(args.tail_tokens))
        uncached.append(t)
        ttft(on, prefix + draw(args.tail_tokens))  # fills the cache
        ttft(on, draw(8))  # takes the idle session: the next prefix must come from the blocks
        t, n = ttft(on, prefix + draw(args.tail_tokens))
        cached.append(t)
        reused.append(n)
    stats = on.stats()
    off.close()
    on.close()
    row = {
        "cpu": cpu_name(),
        "model": str(model),
        "prefix_tokens": args.prefix_tokens,
        "tail_tokens": args.tail_tokens,
        "runs": args.runs,
        "ttft_uncached_s": statistics.median(uncached),
        "ttft_cached_s": statistics.median(cached),
        "ratio": statistics.median(cached) / statistics.median(uncached),
        "cached_tokens": statistics.median(reused),
        "engine": {k: stats[k] for k in ("prompt_tokens", "cached_tokens", "prefix_hits", "prefix_cache_bytes",
                                         "prefix_cache_evictions")},
    }
    print(json.dumps(row, indent=1))


if __name__ == "__main__":
    main()
