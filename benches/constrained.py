"""The cost of constrained output: decode tokens/s with a JSON-schema constraint beside the same
run without one, on one GGUF, plus the constraint's own time per token and its compile time
(issue 26; goal: constrained decode >= 0.9x unconstrained).

    python benches/constrained.py [--model PATH] [--runs 5] [--tokens 128] [--threads 2]

Each run generates `--tokens` tokens greedily from the same prompt, once unconstrained and once
under a JSON schema (alternating, medians reported). The constrained run's usage carries the
constraint's per-token time (median and p99: the pick checked, a mask computed when the pick
did not fit, the token accepted) and its compile time; the first constrained run also builds the
vocabulary's token trie, reported apart. Writes JSON to --out.
"""

import argparse
import json
import statistics
import time
from pathlib import Path

from compare import cpu_name, default_model  # benches/compare.py: one way to name the host and the model

# A schema with nesting, enums, arrays and bounded strings, of the kind function-calling and
# extraction workloads send.
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 40},
        "language": {"enum": ["python", "rust", "c", "go", "javascript"]},
        "functions": {
            "type": "array",
            "maxItems": 8,
            "items": {
                "type": "object",
                "properties": {
                    "name": {"type": "string", "maxLength": 40},
                    "arguments": {"type": "array", "items": {"type": "string", "maxLength": 24}, "maxItems": 6},
                    "returns": {"type": "string", "maxLength": 24},
                    "pure": {"type": "boolean"},
                },
                "required": ["name", "arguments", "returns", "pure"],
                "additionalProperties": False,
            },
        },
        "lines": {"type": "integer", "minimum": 0},
    },
    "required": ["name", "language", "functions", "lines"],
    "additionalProperties": False,
}
PROMPT = ("Describe this code as JSON.\n\ndef add(a, b):\n    return a + b\n\ndef scale(v, k):\n"
          "    return [x * k for x in v]\n\nJSON:\n")


def main():
    import candlewick as cw

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="a GGUF (default: the Gemma 3 270M GGUF from PyPI)")
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "constrained.json"))
    args = ap.parse_args()
    args.model = args.model or default_model()
    rt = cw.ModelRuntime.load(args.model, device="cpu", threads=args.threads)
    fmt = {"type": "json_schema", "json_schema": {"name": "code", "schema": SCHEMA}}
    # Decode rates compare like with like: ignore_eos keeps both runs at --tokens tokens unless the
    # constraint completes first (then it stops, and its rate covers the tokens it made).
    kw = dict(max_tokens=args.tokens, temperature=0.0, ignore_eos=True)
    started = time.perf_counter()
    first = rt.generate(PROMPT, response_format=fmt, **kw)
    first_seconds = time.perf_counter() - started
    plain, constrained, p50, p99, compile_s, masks, tokens = [], [], [], [], [], [], []
    for _ in range(args.runs):
        rt.session.reset()
        r = rt.generate(PROMPT, **kw)
        plain.append(r.usage["decode_tokens_per_second"])
        rt.session.reset()
        c = rt.generate(PROMPT, response_format=fmt, **kw)
        constrained.append(c.usage["decode_tokens_per_second"])
        p50.append(c.usage["constraint_seconds_p50"])
        p99.append(c.usage["constraint_seconds_p99"])
        compile_s.append(c.usage["constraint_compile_seconds"])
        masks.append(c.usage["constraint_masks"])
        tokens.append(c.usage["completion_tokens"])
    valid = True
    try:
        json.loads(c.text)
    except ValueError:
        valid = c.finish_reason == "length"
    out = {
        "cpu": cpu_name(), "model": Path(args.model).name, "threads": args.threads, "runs": args.runs,
        "decode_tokens_per_second": {"plain": statistics.median(plain), "constrained": statistics.median(constrained)},
        "ratio": statistics.median(constrained) / statistics.median(plain),
        "constraint_ms_per_token": {"p50": 1e3 * statistics.median(p50), "p99": 1e3 * statistics.median(p99)},
        "compile_ms": 1e3 * statistics.median(compile_s),
        "first_constrained_generation_s": first_seconds,
        "first_compile_ms_with_vocabulary": 1e3 * first.usage["constraint_compile_seconds"],
        "masks_computed": statistics.median(masks), "constrained_tokens": statistics.median(tokens),
        "output_parses_or_was_cut": valid, "sample": c.text[:300],
        "all": {"plain": plain, "constrained": constrained},
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=2))
    print(f"{out['model']} on {out['cpu']}, {args.threads} threads, medians of {args.runs}:")
    print(f"  decode tok/s: plain {out['decode_tokens_per_second']['plain']:.1f}, "
          f"JSON schema {out['decode_tokens_per_second']['constrained']:.1f} -> {out['ratio']:.3f}x (goal >= 0.9x)")
    print(f"  constraint per token: p50 {out['constraint_ms_per_token']['p50']:.3f} ms, "
          f"p99 {out['constraint_ms_per_token']['p99']:.3f} ms; masks computed {out['masks_computed']} "
          f"of {out['constrained_tokens']} tokens")
    print(f"  schema compile {out['compile_ms']:.2f} ms (first, with the vocabulary's trie: "
          f"{out['first_compile_ms_with_vocabulary']:.0f} ms)")


if __name__ == "__main__":
    main()
