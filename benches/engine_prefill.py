"""Streams beside a long prompt (issue 25, item 6): the inter-token latency of requests that are
decoding while another request's long prompt joins the engine, with the prompt prefilled a chunk
per step (`prefill_chunk`, the default) and whole at admission (`prefill_chunk=None`).

    python benches/engine_prefill.py [--model PATH] [--prompt-tokens 4000] [--streams 4]

For each setting: `--streams` requests decode greedily (ignore_eos); once they run, a request
with a `--prompt-tokens` prompt is submitted; the gaps between consecutive tokens of the
running streams while that prompt is prefilled (from its submission to its first token) are
collected. Reports their p50/p99/max and the long request's time to first token.
"""

import argparse
import json
import statistics
import threading
import time
from pathlib import Path

from compare import cpu_name, default_model  # benches/compare.py: one way to name the host and the model


def run(rt, prefill_chunk, prompt_tokens, streams, rng_seed=0):
    import candlewick as cw
    import numpy as np

    stamps = [[] for _ in range(streams)]
    long_ids = [int(x) for x in np.random.default_rng(rng_seed).integers(1000, 20000, prompt_tokens)]
    with cw.Engine(rt, max_batch_size=streams + 1, prefill_chunk=prefill_chunk) as engine:
        reqs = [engine.submit(f"Story number {i}: once upon a time", max_tokens=100_000, temperature=0.0,
                              ignore_eos=True) for i in range(streams)]

        def consume(i, r):
            try:
                for _ in r:
                    stamps[i].append(time.perf_counter())
            except cw.CandlewickError:
                pass  # the engine closed under a cancelled stream: the measurement is over

        threads = [threading.Thread(target=consume, args=(i, r), daemon=True) for i, r in enumerate(reqs)]
        for t in threads:
            t.start()
        while min(len(s) for s in stamps) < 10:
            time.sleep(0.01)
        submitted = time.perf_counter()
        long = engine.submit(long_ids, max_tokens=1, temperature=0.0)
        long.wait()
        first = time.perf_counter()
        time.sleep(0.5)
        for r in reqs:
            r.cancel()
    gaps = []
    for s in stamps:
        gaps += [b - a for a, b in zip(s, s[1:]) if a >= submitted and b <= first + 0.05]
        # The gap that straddles the submission counts too.
        before = [t for t in s if t < submitted]
        after = [t for t in s if t >= submitted]
        if before and after:
            gaps.append(after[0] - before[-1])
    gaps.sort()
    q = lambda p: gaps[min(len(gaps) - 1, int(p * len(gaps)))] if gaps else float("nan")
    return {"prefill_chunk": prefill_chunk, "long_ttft_s": first - submitted, "gaps": len(gaps),
            "itl_p50_ms": 1e3 * q(0.5), "itl_p99_ms": 1e3 * q(0.99), "itl_max_ms": 1e3 * (gaps[-1] if gaps else 0)}


def main():
    import candlewick as cw

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None)
    ap.add_argument("--prompt-tokens", type=int, default=4000)
    ap.add_argument("--streams", type=int, default=4)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "engine_prefill.json"))
    args = ap.parse_args()
    args.model = args.model or default_model()
    rt = cw.ModelRuntime.load(args.model, device="cpu", threads=args.threads)
    rows = [run(rt, chunk, args.prompt_tokens, args.streams) for chunk in (128, 512, None)]
    out = {"cpu": cpu_name(), "model": Path(args.model).name, "threads": args.threads,
           "prompt_tokens": args.prompt_tokens, "streams": args.streams, "rows": rows}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=2))
    print(f"{out['model']} on {out['cpu']}: {args.streams} streams decoding while a {args.prompt_tokens}-token prompt joins")
    for r in rows:
        print(f"  prefill_chunk={r['prefill_chunk']}: inter-token p50 {r['itl_p50_ms']:.0f} ms, p99 "
              f"{r['itl_p99_ms']:.0f} ms, max {r['itl_max_ms']:.0f} ms ({r['gaps']} gaps); "
              f"long prompt's first token after {r['long_ttft_s']:.1f} s")


if __name__ == "__main__":
    main()
