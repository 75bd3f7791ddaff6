"""candlewick beside transformers on one Hugging Face directory: dense dtypes and quantize-at-load.

Each measurement runs in a fresh process, configurations alternate run by run, the table
reports medians. Both runtimes are driven the same way from Python: one prefill of the prompt,
then one decode step per token with a numpy/torch argmax.

    python benches/compare_hf.py --model /work/bench/gemma3-270m-hf \\
        --peer-python /work/bench-venv-hf/bin/python --runs 3 --threads 2

The directory can be written from a GGUF with benches/make_hf_dir.py. torch and transformers
live only in the peer interpreter (outside the repository, never in CI).
"""

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
QUANTIZE = ["q8_0", "q6_k", "q5_k", "q5_0", "q4_k", "q4_0"]
DEFAULT_CONFIGS = ["transformers:f32", "transformers:bf16", "candlewick:f32", "candlewick:bf16"] + [
    f"candlewick:{q}" for q in QUANTIZE
]


def prompt_ids(n, vocab):
    import numpy as np

    rng = np.random.default_rng(1234)
    return [2] + rng.integers(1000, min(vocab, 50000), size=n - 1).tolist()


def worker_candlewick(model, kind, prompt_len, n_decode):
    import numpy as np

    import candlewick as cw

    kw = {"dtype": kind} if kind in ("f32", "bf16", "f16") else {"quantize": kind}
    t = time.perf_counter()
    rt = cw.ModelRuntime.load(model, device="cpu", **kw)
    load = time.perf_counter() - t
    ids = prompt_ids(prompt_len, rt.model_info["vocab_size"])
    rt.prefill(ids[:8]).wait()  # warm-up: first-touch allocations, thread pool
    rt.session.reset()
    t = time.perf_counter()
    tok = int(np.argmax(rt.prefill(ids).wait().logits[-1]))
    prefill = time.perf_counter() - t
    t = time.perf_counter()
    for _ in range(n_decode):
        tok = int(np.argmax(rt.decode([tok]).wait().logits[-1]))
    decode = time.perf_counter() - t
    return {"load_s": load, "prefill_tps": prompt_len / prefill, "decode_tps": n_decode / decode}


def worker_transformers(model, kind, prompt_len, n_decode, threads):
    import torch
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(threads)
    dtype = {"f32": torch.float32, "bf16": torch.bfloat16, "f16": torch.float16}[kind]
    t = time.perf_counter()
    m = AutoModelForCausalLM.from_pretrained(model, dtype=dtype).eval()
    load = time.perf_counter() - t
    ids = torch.tensor([prompt_ids(prompt_len, m.config.vocab_size)])
    with torch.inference_mode():
        m(ids[:, :8], use_cache=True)  # warm-up
        t = time.perf_counter()
        r = m(ids, use_cache=True)
        tok = r.logits[0, -1].argmax().view(1, 1)
        prefill = time.perf_counter() - t
        past = r.past_key_values
        t = time.perf_counter()
        for _ in range(n_decode):
            r = m(tok, past_key_values=past, use_cache=True)
            past = r.past_key_values
            tok = r.logits[0, -1].argmax().view(1, 1)
        decode = time.perf_counter() - t
    return {"load_s": load, "prefill_tps": prompt_len / prefill, "decode_tps": n_decode / decode}


def run(config, python, model, threads, prompt_len, n_decode):
    env = dict(os.environ, RAYON_NUM_THREADS=str(threads), OMP_NUM_THREADS=str(threads),
               TOKENIZERS_PARALLELISM="false")
    # A third field: for candlewick, its dense kernels (CANDLEWICK_DENSE_KERNELS: candle,
    # portable); for transformers, OpenMP's wait policy (passive: threads sleep at barriers
    # instead of spinning, which is what survives a machine shared with other work).
    parts = config.split(":")
    if len(parts) == 3:
        key = "CANDLEWICK_DENSE_KERNELS" if parts[0] == "candlewick" else "OMP_WAIT_POLICY"
        env[key] = parts[2]
        config = ":".join(parts[:2])
    cmd = [python, __file__, "--worker", config, "--model", model, "--threads", str(threads),
           "--prompt-len", str(prompt_len), "--decode-tokens", str(n_decode)]
    p = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=1800)
    if p.returncode != 0:
        raise RuntimeError(f"{config} failed:\n{p.stderr[-2000:]}")
    return json.loads(p.stdout.strip().splitlines()[-1])


def cpu_name():
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
        return next(line.split(":", 1)[1].strip() for line in out.splitlines() if line.startswith("Model name"))
    except Exception:
        return platform.processor()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True, help="a Hugging Face directory")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--decode-tokens", type=int, default=64)
    ap.add_argument("--configs", default=",".join(DEFAULT_CONFIGS),
                    help="runtime:kind[:dense kernels], comma-separated (e.g. candlewick:bf16:candle)")
    ap.add_argument("--peer-python", default=os.environ.get("BENCH_PYTHON", sys.executable),
                    help="interpreter with torch and transformers")
    ap.add_argument("--out", default=str(HERE / "results" / "hf_latest.json"))
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        runtime, kind = args.worker.split(":")
        if runtime == "candlewick":
            out = worker_candlewick(args.model, kind, args.prompt_len, args.decode_tokens)
        else:
            out = worker_transformers(args.model, kind, args.prompt_len, args.decode_tokens, args.threads)
        print(json.dumps(out))
        return
    configs = args.configs.split(",")
    results = {c: [] for c in configs}
    for i in range(args.runs):
        for c in configs:
            python = sys.executable if c.startswith("candlewick") else args.peer_python
            results[c].append(run(c, python, args.model, args.threads, args.prompt_len, args.decode_tokens))
            print(f"run {i + 1}/{args.runs} {c}: {results[c][-1]}", file=sys.stderr)
    summary = {c: {k: statistics.median(r[k] for r in rs) for k in ("load_s", "prefill_tps", "decode_tps")}
               for c, rs in results.items()}
    meta = {"date": time.strftime("%Y-%m-%d %H:%M:%S"), "model": args.model, "threads": args.threads,
            "runs": args.runs, "prompt_len": args.prompt_len, "decode_tokens": args.decode_tokens, "cpu": cpu_name()}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"meta": meta, "summary": summary, "runs": results}, indent=1))
    base = {k: summary.get(f"transformers:{k}") for k in ("f32", "bf16")}
    print(f"| runtime | dtype / quantize | decode tok/s | prefill tok/s ({args.prompt_len}) | "
          "decode vs torch f32 / bf16 | prefill vs torch f32 / bf16 | load s |")
    print("|---|---|---|---|---|---|---|")
    for c, s in summary.items():
        def ratio(key):
            return " / ".join(f"{s[key] / b[key]:.2f}×" if b else "–" for b in base.values())

        runtime, kind = c.split(":", 1)
        print(f"| {runtime} | {kind} | {s['decode_tps']:.1f} | {s['prefill_tps']:.0f} | {ratio('decode_tps')} | "
              f"{ratio('prefill_tps')} | {s['load_s']:.2f} |")


if __name__ == "__main__":
    main()
