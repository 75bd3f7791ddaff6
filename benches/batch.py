"""Aggregate decode tokens/s with 1, 2, 4 and 8 sequences decoded together (generate_batch) on
one model, beside the single-sequence figure; medians of several runs; the CPU is printed.

    python benches/batch.py [--model PATH] [--tokens 32] [--runs 3]
"""

import statistics
import time

import candlewick as cw
from compare import cpu_name, model_parser, parse_model_args  # benches/compare.py: the host, the shared options

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time",
    "1, 2, 3, 4,",
    "The best way to learn",
    "In the beginning",
    "My favourite food is",
    "Rust is a language that",
]


def main():
    ap = model_parser(tokens=32, runs=3)
    args = parse_model_args(ap)
    rt = cw.ModelRuntime.load(args.model, device="cpu")
    print(f"model {args.model}\ncpu {cpu_name()}")
    base = None
    for n in (1, 2, 4, 8):
        rates, ttfts = [], []
        for _ in range(args.runs):
            t = time.perf_counter()
            out = rt.generate_batch(PROMPTS[:n], max_tokens=args.tokens, temperature=0.0, ignore_eos=True)
            wall = time.perf_counter() - t
            decode = max(r.usage["decode_seconds"] for r in out)
            rates.append(sum(r.usage["completion_tokens"] - 1 for r in out) / decode)
            ttfts.append(max(r.usage["time_to_first_token"] for r in out))
        rate = statistics.median(rates)
        base = base or rate
        print(f"{n} sequences: {rate:7.1f} tok/s aggregate decode ({rate / base:4.2f}x one), "
              f"time to first token (last of the batch) {statistics.median(ttfts):.3f} s")


if __name__ == "__main__":
    main()
