"""The KV cache's size and the peak resident memory of long prompts, build beside build.

Each (build, cache type, prompt length) runs `_worker.py` in a fresh process, so its peak RSS is
that prompt's alone: load, prefill the prompt (in the session's chunks), generate a few tokens.
Builds alternate run by run; the table reports medians of `--runs`.

    python benches/kv_memory.py --build main=python --build kv=/work/venv/kv/bin/python \\
        --lens 4096,16384 --types default,q8_0 [--runs 3] [--model PATH]

A build without `kv_cache_type` (before issue 25's item 4) runs the default type only.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from compare import cpu_name, default_model  # noqa: E402


def one(python, model, threads, n, n_decode, kv_type):
    env = dict(os.environ, RAYON_NUM_THREADS=str(threads))
    env.pop("CANDLEWICK_BENCH_KV_CACHE_TYPE", None)
    if kv_type != "default":
        env["CANDLEWICK_BENCH_KV_CACHE_TYPE"] = kv_type
    cmd = [python, str(HERE / "_worker.py"), "candlewick", model, str(threads), str(n), str(n_decode)]
    p = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=3600)
    if p.returncode != 0:
        raise RuntimeError(p.stderr[-2000:])
    r = json.loads(p.stdout.strip().splitlines()[-1])
    row = r["runs"][str(n)]
    return {"cache_mb": row.get("cache_mb"), "peak_rss_mb": r["peak_rss_mb"], "prefill_tps": row["prefill_tps"],
            "decode_tps": row["decode_tps"]}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None)
    ap.add_argument("--build", action="append", required=True, metavar="LABEL=PYTHON")
    ap.add_argument("--lens", default="4096,16384")
    ap.add_argument("--types", default="default")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--decode-tokens", type=int, default=32)
    ap.add_argument("--out", default=str(HERE / "results" / "kv_memory.json"))
    args = ap.parse_args()
    model = args.model or default_model()
    builds = dict(b.split("=", 1) for b in args.build)
    lens = [int(x) for x in args.lens.split(",")]
    types = args.types.split(",")
    results = {}
    for i in range(args.runs):
        for n in lens:
            for ty in types:
                for label, python in builds.items():
                    try:
                        r = one(python, model, args.threads, n, args.decode_tokens, ty)
                    except RuntimeError as e:
                        if ty != "default" and "kv_cache_type" in str(e):
                            continue  # a build before cache types
                        raise
                    results.setdefault(f"{label}|{ty}|{n}", []).append(r)
                    print(f"run {i + 1}: {label} {ty} {n}: {r}", file=sys.stderr)
    print(f"CPU: {cpu_name()}, {args.threads} threads, medians of {args.runs} runs, {Path(model).name}")
    print("\n| build | cache | tokens | KV cache MB | peak RSS MB | prefill tok/s | decode tok/s |")
    print("|---|---|---|---|---|---|---|")
    summary = {}
    for key, rs in results.items():
        med = {k: statistics.median(r[k] for r in rs if r[k] is not None) if any(r[k] is not None for r in rs) else None
               for k in rs[0]}
        summary[key] = med
        label, ty, n = key.split("|")
        cache = f"{med['cache_mb']:.1f}" if med["cache_mb"] is not None else "-"
        print(f"| {label} | {ty} | {n} | {cache} | {med['peak_rss_mb']:.0f} | {med['prefill_tps']:.0f} | "
              f"{med['decode_tps']:.1f} |")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"cpu": cpu_name(), "threads": args.threads, "runs": args.runs,
                                         "model": model, "summary": summary, "raw": results}, indent=2))


if __name__ == "__main__":
    main()
