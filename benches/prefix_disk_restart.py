"""The prefix cache on disk (issue 42, item 5): time to first token of a long prompt sent to a
restarted `candlewick serve --prefix-cache-dir`, beside the same prompt computed from nothing.

    python benches/prefix_disk_restart.py [--model PATH] [--prompt-tokens 8000] [--runs 3] [--plain-runs 1] [--out FILE]

Each run draws a fresh prompt (random token ids of the vocabulary) and times, from sending a
streamed `/v1/completions` request (`max_tokens: 2`) to its first chunk:
  plain     a server without --prefix-cache-dir (the prompt computed whole; the first
            --plain-runs runs only: it is the cost of writing the blocks, not the ratio);
  uncached  a fresh server with an empty --prefix-cache-dir (computed whole, its blocks written);
  restart   that server stopped and started again on the same directory, the same prompt: its
            blocks come back from disk and only the tail past the last whole block is computed.
Reports each run and the medians; the ratio is restart / uncached.
"""

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from compare import cpu_name  # benches/compare.py: one way to name the host

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from server_helpers import launch  # noqa: E402  (the server tests' start-up on a loopback port)

DEFAULT_MODEL = "/work/bench/qwen2.5-coder-0.5b.gguf"


def start(model, directory=None):
    extra = ["--prefix-cache-dir", str(directory)] if directory is not None else []
    return launch("--model", model, "--request-timeout", "0", *extra, timeout=300, stderr=subprocess.DEVNULL)


def stop(proc):
    proc.terminate()
    proc.wait(timeout=120)


def ttft(base, ids):
    """Seconds from sending the request to its first streamed chunk, and the cached tokens."""
    body = json.dumps({"prompt": ids, "max_tokens": 2, "temperature": 0, "ignore_eos": True, "stream": True,
                       "stream_options": {"include_usage": True}}).encode()
    req = urllib.request.Request(base + "/v1/completions", data=body, headers={"Content-Type": "application/json"})
    t = time.perf_counter()
    first, cached = None, None
    with urllib.request.urlopen(req, timeout=3600) as r:
        for line in r:
            if not line.startswith(b"data: ") or line.strip() == b"data: [DONE]":
                continue
            if first is None:
                first = time.perf_counter() - t
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                cached = chunk["usage"]["prompt_tokens_details"]["cached_tokens"]
    return first, cached


def metric(base, name):
    with urllib.request.urlopen(base + "/metrics") as r:
        for line in r.read().decode().splitlines():
            if line.startswith(name + " "):
                return float(line.split()[1])
    return None


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=DEFAULT_MODEL)
    ap.add_argument("--prompt-tokens", type=int, default=8000)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--plain-runs", type=int, default=1)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    import numpy as np

    rng = np.random.default_rng(0)
    rows = []
    for run in range(args.runs):
        ids = [int(x) for x in rng.integers(1000, 20000, args.prompt_tokens)]
        plain = None
        if run < args.plain_runs:
            proc, base = start(args.model)
            plain, _ = ttft(base, ids)
            stop(proc)
        directory = Path(tempfile.mkdtemp(prefix="cw-prefix-disk-"))
        try:
            proc, base = start(args.model, directory)
            uncached, _ = ttft(base, ids)
            written = metric(base, "candlewick_prefix_disk_written_blocks_total")
            stop(proc)
            disk_mb = sum(p.stat().st_size for p in directory.glob("*.cwkv")) / 1e6
            proc, base = start(args.model, directory)
            restart, cached = ttft(base, ids)
            loaded = metric(base, "candlewick_prefix_disk_loaded_blocks_total")
            stop(proc)
        finally:
            shutil.rmtree(directory, ignore_errors=True)
        row = {"run": run, "plain_s": plain, "uncached_s": uncached, "restart_s": restart, "cached_tokens": cached,
               "blocks_written": written, "blocks_loaded": loaded, "disk_mb": round(disk_mb, 1)}
        print(json.dumps(row), flush=True)
        rows.append(row)
    med = {k: statistics.median(r[k] for r in rows if r[k] is not None) for k in ("plain_s", "uncached_s", "restart_s")}
    out = {
        "cpu": cpu_name(),
        "note": "2 vCPUs shared with other builds and tests during the run: absolute times are noisy",
        "model": args.model,
        "prompt_tokens": args.prompt_tokens,
        "runs": rows,
        "median": med,
        "ratio_restart_to_uncached": med["restart_s"] / med["uncached_s"],
        "write_overhead": med["uncached_s"] / med["plain_s"] - 1,
    }
    print(json.dumps(out, indent=1))
    if args.out:
        Path(args.out).write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
