"""Structured output over a corpus of real-world JSON schemas (issue 26): does the constrained
model finish, and does what it finishes validate?

    python benches/schemas.py [--model PATH] [--threads 2] [--max-tokens 384] [--only NAME ...]

`benches/schemas/*.json` holds 37 schemas written in the style of JSONSchemaBench's public
subsets (GitHub workflow and config files, Kubernetes objects, OpenAPI-ish payloads,
function-calling parameters, package manifests, e-commerce, profiles, log events...), each with a
`description` saying where its shape comes from; three (`refused_*`) use keywords the constraint
engine does not implement (if/then/else, dependentSchemas, uniqueItems) to exercise the error
path. For each schema the model is asked, through its chat template, "Produce a realistic
example of <title> (<description>) as JSON." with the schema as `response_format`, greedy,
`--max-tokens` tokens. Recorded per schema: finish_reason, completion tokens, seconds, compile
time, decode tokens/s, whether the output validates (jsonschema, Draft 2020-12, with
`FormatChecker`: llguidance enforces string formats) when it stopped, and for a refused schema the
error message (which must name the keyword). Writes JSON to --out and prints a table.
"""

import argparse
import json
import re
import statistics
import time
from pathlib import Path

from compare import cpu_name  # benches/compare.py: one way to name the host

HERE = Path(__file__).parent
DEFAULT_MODEL = "/work/bench/qwen2.5-coder-0.5b.gguf"
# Keywords expected in the refusal message of each refused_* schema.
EXPECTED_REFUSALS = {
    "refused_shipping_if_then": ["if"],
    "refused_billing_dependent_schemas": ["dependentSchemas"],
    "refused_feature_flags_unique_items": ["uniqueItems"],
}


def main():
    import candlewick as cw
    import jsonschema

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=DEFAULT_MODEL)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--max-tokens", type=int, default=384)
    ap.add_argument("--schemas", default=str(HERE / "schemas"))
    ap.add_argument("--only", nargs="*", help="schema names (file stems) to run")
    ap.add_argument("--out", default=str(HERE / "results" / "schemas.json"))
    args = ap.parse_args()

    load_start = Path("/proc/loadavg").read_text().split()[:3] if Path("/proc/loadavg").exists() else None
    paths = sorted(Path(args.schemas).glob("*.json"))
    if args.only:
        paths = [p for p in paths if p.stem in set(args.only)]
    rt = cw.ModelRuntime.load(args.model, device="cpu", threads=args.threads)
    # Build the vocabulary's token trie outside the timings (the first constraint pays for it).
    warm = {"type": "json_schema", "json_schema": {"name": "warm", "schema": {"type": "object"}}}
    started = time.perf_counter()
    rt.generate("{", response_format=warm, max_tokens=1, temperature=0.0)
    warmup_s = time.perf_counter() - started

    rows = []
    for path in paths:
        schema = json.loads(path.read_text())
        title = schema.get("title", path.stem)
        desc = schema.get("description", "")
        prompt = f"Produce a realistic example of {title} ({desc}) as JSON."
        fmt = {"type": "json_schema", "json_schema": {"name": path.stem, "schema": schema}}
        row = {"name": path.stem, "title": title}
        rt.session.reset()
        started = time.perf_counter()
        try:
            r = rt.chat([{"role": "user", "content": prompt}], response_format=fmt,
                        max_tokens=args.max_tokens, temperature=0.0)
        except cw.GenerationOptionError as e:
            msg = str(e)
            row.update(refused=True, error=msg, seconds=time.perf_counter() - started)
            expected = EXPECTED_REFUSALS.get(path.stem, [])
            # The keywords the message names: quoted ("Unimplemented keys: [...]") or in the text
            # ("oneOf constraints are not supported").
            row["keywords"] = list(dict.fromkeys(re.findall(r'"([A-Za-z$]+)"', msg) or [
                k for k in re.findall(r"[A-Za-z$]+", msg) if f'"{k}"' in path.read_text()]))
            row["expected_refusal"] = bool(expected)
            row["error_names_keyword"] = (all(k in row["keywords"] for k in expected) if expected
                                          else bool(row["keywords"]))
            rows.append(row)
            print(f"{path.stem:38s} refused: {msg}", flush=True)
            continue
        u = r.usage
        row.update(refused=False, finish_reason=r.finish_reason, tokens=u.get("completion_tokens"),
                   seconds=time.perf_counter() - started,
                   compile_ms=1e3 * u.get("constraint_compile_seconds", float("nan")),
                   decode_tokens_per_second=u.get("decode_tokens_per_second"), text=r.text)
        if r.finish_reason == "stop":
            try:
                doc = json.loads(r.text)
                errors = sorted(jsonschema.Draft202012Validator(schema, format_checker=jsonschema.FormatChecker())
                                .iter_errors(doc), key=lambda e: list(e.absolute_path))
                row["valid"] = not errors
                row["validation_errors"] = [f"{'/'.join(map(str, e.absolute_path)) or '(root)'}: {e.message}"
                                            for e in errors][:5]
            except ValueError as e:
                row.update(valid=False, validation_errors=[f"not JSON: {e}"])
        if path.stem in EXPECTED_REFUSALS:
            row["error_names_keyword"] = False  # expected a refusal and got none
        rows.append(row)
        print(f"{path.stem:38s} {r.finish_reason:6s} {row['tokens']:4d} tok {row['seconds']:6.1f} s "
              f"compile {row['compile_ms']:6.1f} ms  valid={row.get('valid', '-')}", flush=True)

    accepted = [r for r in rows if not r["refused"]]
    refused = [r for r in rows if r["refused"]]
    stopped = [r for r in accepted if r["finish_reason"] == "stop"]
    valid = [r for r in stopped if r.get("valid")]
    summary = {
        "schemas": len(rows), "refused": len(refused),
        "refused_keywords": {r["name"]: r["keywords"] for r in refused},
        "refusals_name_keyword": all(r.get("error_names_keyword") for r in refused),
        "unexpected_refusals": [r["name"] for r in refused if not r["expected_refusal"]],
        "expected_refusals_missing": [r["name"] for r in rows if r["name"] in EXPECTED_REFUSALS and not r["refused"]],
        "accepted": len(accepted), "stopped": len(stopped),
        "stopped_pct": 100.0 * len(stopped) / max(1, len(accepted)),
        "stopped_valid": len(valid),
        "compile_ms_median": statistics.median(r["compile_ms"] for r in accepted) if accepted else None,
        "decode_tokens_per_second_median": statistics.median(r["decode_tokens_per_second"] for r in accepted)
        if accepted else None,
        "tokens_median": statistics.median(r["tokens"] for r in accepted) if accepted else None,
        "not_stopped": [r["name"] for r in accepted if r["finish_reason"] != "stop"],
        "not_valid": [r["name"] for r in stopped if not r.get("valid")],
    }
    out = {"cpu": cpu_name(), "model": Path(args.model).name, "threads": args.threads,
           "max_tokens": args.max_tokens, "format_checker": True, "warmup_seconds": warmup_s,
           "loadavg_start": load_start, "loadavg_end": Path("/proc/loadavg").read_text().split()[:3]
           if Path("/proc/loadavg").exists() else None,
           "summary": summary, "results": rows}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=2) + "\n")

    print(f"\n{out['model']} on {out['cpu']}, {args.threads} threads, greedy, max {args.max_tokens} tokens")
    print("| schema | finish | tokens | s | compile ms | decode tok/s | validates |")
    print("|---|---|---:|---:|---:|---:|---|")
    for r in rows:
        if r["refused"]:
            print(f"| {r['name']} | refused: {r['error']} | | | | | |")
        else:
            print(f"| {r['name']} | {r['finish_reason']} | {r['tokens']} | {r['seconds']:.1f} | "
                  f"{r['compile_ms']:.1f} | {r['decode_tokens_per_second']:.1f} | "
                  f"{ {True: 'yes', False: 'NO'}.get(r.get('valid'), '-') } |")
    s = summary
    print(f"\nschemas {s['schemas']}; refused {s['refused']} ({s['refused_keywords']}; message names the "
          f"keyword: {s['refusals_name_keyword']}); stopped within {args.max_tokens} tokens "
          f"{s['stopped']}/{s['accepted']} = {s['stopped_pct']:.0f}% (goal >= 90%); stopped and valid "
          f"{s['stopped_valid']}/{s['stopped']} (goal all); median compile {s['compile_ms_median']:.1f} ms; "
          f"median decode {s['decode_tokens_per_second_median']:.1f} tok/s")
    if s["unexpected_refusals"] or s["expected_refusals_missing"]:
        print("refused though not meant to be:", ", ".join(s["unexpected_refusals"]) or "none",
              "; accepted though meant to be refused:", ", ".join(s["expected_refusals_missing"]) or "none")
    if s["not_stopped"]:
        print("did not stop:", ", ".join(s["not_stopped"]))
    if s["not_valid"]:
        print("did not validate:", ", ".join(s["not_valid"]))


if __name__ == "__main__":
    main()
