"""A 100,000-token prompt on Gemma 3 270M with `max_context=131072` (issue 25's last goal): runs it
to completion in a fresh process and checks peak resident memory against the weights (the GGUF
file's bytes) plus the KV cache the session holds, plus 10%.

    python benches/long_100k.py [--tokens 100000] [--max-context 131072] [--threads 2] [--model PATH]
        [--generate] [--prefill-chunk N]

The prompt runs through `prefill` and then `decode` steps (the step API), or with `--generate`
through `generate` (which sizes the cache for the prompt and the tokens asked for at once).
Prints one JSON line: the peak as the process saw it, and above what the interpreter held before
loading the model (`peak_over_interpreter_mb`); the exit status is 1 when the first misses the goal.
"""

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from _worker import peak_rss_mb, prompt_ids, status_mb  # noqa: E402
from compare import cpu_name, default_model  # noqa: E402


def measure(model, tokens, max_context, threads, n_decode, kv_type, through_generate, prefill_chunk):
    import numpy as np

    import candlewick as cw

    kv = {"kv_cache_type": kv_type} if kv_type else {}
    before_load = status_mb("VmRSS")
    t = time.perf_counter()
    rt = cw.ModelRuntime.load(model, threads=threads, max_context=max_context, prefill_chunk=prefill_chunk, **kv)
    load_s = time.perf_counter() - t
    after_load = status_mb("VmRSS")
    ids = prompt_ids(tokens, rt.model_info["vocab_size"])
    if through_generate:
        r = rt.generate(ids, max_tokens=n_decode + 1, temperature=0.0, ignore_eos=True)
        prefill_s, decode_s = r.usage["time_to_first_token"], r.usage["decode_seconds"]
    else:
        t = time.perf_counter()
        tok = int(np.argmax(rt.prefill(ids).wait().logits[-1]))
        prefill_s = time.perf_counter() - t
        t = time.perf_counter()
        for _ in range(n_decode):
            tok = int(np.argmax(rt.decode([tok]).wait().logits[-1]))
        decode_s = time.perf_counter() - t
    weights_mb = os.path.getsize(model) / 2**20
    cache_mb = rt.session.cache_bytes / 2**20
    peak = peak_rss_mb()
    bound = (weights_mb + cache_mb) * 1.10
    # The interpreter (and numpy) was resident before the model: the part of the peak the model
    # and its prompt account for is above it.
    peak_over = peak - before_load
    return {
        "model": Path(model).name, "tokens": tokens, "max_context": max_context, "threads": threads,
        "kv_cache_type": rt.model_info["kv_cache_type"], "through": "generate" if through_generate else "prefill+decode",
        "prefill_chunk": rt.session.prefill_chunk,
        "load_s": load_s, "prefill_s": prefill_s,
        "prefill_tps": tokens / prefill_s, "decode_tps": n_decode / decode_s if n_decode else None,
        "rss_before_load_mb": before_load, "rss_after_load_mb": after_load, "weights_mb": weights_mb,
        "cache_mb": cache_mb, "peak_rss_mb": peak, "peak_over_interpreter_mb": peak_over,
        "bound_mb": bound, "met": peak <= bound, "met_over_interpreter": peak_over <= bound, "cpu": cpu_name(),
    }


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None)
    ap.add_argument("--tokens", type=int, default=100_000)
    ap.add_argument("--max-context", type=int, default=131_072)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--decode-tokens", type=int, default=16)
    ap.add_argument("--kv-cache-type", default=None)
    ap.add_argument("--prefill-chunk", type=int, default=None, help="the runtime's prefill_chunk (default 512)")
    ap.add_argument("--generate", action="store_true", help="run the prompt through generate")
    ap.add_argument("--out", default=None)
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    model = args.model or default_model()
    if args.child:
        print(json.dumps(measure(model, args.tokens, args.max_context, args.threads, args.decode_tokens,
                                 args.kv_cache_type, args.generate, args.prefill_chunk)))
        return 0
    # A fresh process, so that the peak is this prompt's alone.
    cmd = [sys.executable, __file__, "--child", "--model", model, "--tokens", str(args.tokens), "--max-context",
           str(args.max_context), "--threads", str(args.threads), "--decode-tokens", str(args.decode_tokens)]
    if args.kv_cache_type:
        cmd += ["--kv-cache-type", args.kv_cache_type]
    if args.generate:
        cmd += ["--generate"]
    if args.prefill_chunk:
        cmd += ["--prefill-chunk", str(args.prefill_chunk)]
    env = dict(os.environ, RAYON_NUM_THREADS=str(args.threads))
    p = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if p.returncode != 0:
        print(p.stderr[-3000:], file=sys.stderr)
        return p.returncode
    result = json.loads(p.stdout.strip().splitlines()[-1])
    print(json.dumps(result, indent=1))
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    return 0 if result["met"] else 1


if __name__ == "__main__":
    sys.exit(main())
