"""Speculative decoding (issue 27, item 5): decode speed with prompt lookup
(`prompt_lookup_num_tokens`) and with a draft model (`draft_model=`) beside the plain run,
greedy, on a code-editing prompt (rewrite a given ~300-token function with one change: the output
mostly copies the input) and on free text.

    python benches/speculative.py [--model PATH] [--runs 3] [--draft 10] [--draft-model PATH]

Runs alternate plain / lookup / draft model; reports median decode tokens/s of each, the ratios,
the drafts accepted, and whether the outputs were identical (they must be: greedy).
"""

import argparse
import json
import statistics

from compare import cpu_name

FUNCTION = '''def summarize_orders(orders, currency="EUR", include_cancelled=False):
    """Totals a list of orders by customer and returns the rows sorted by amount."""
    totals = {}
    counts = {}
    for order in orders:
        if order.get("status") == "cancelled" and not include_cancelled:
            continue
        customer = order["customer"]
        amount = order["amount"]
        if order.get("currency", currency) != currency:
            amount = convert(amount, order["currency"], currency)
        totals[customer] = totals.get(customer, 0.0) + amount
        counts[customer] = counts.get(customer, 0) + 1
    rows = []
    for customer, total in totals.items():
        average = total / counts[customer]
        rows.append({"customer": customer, "total": round(total, 2), "orders": counts[customer],
                     "average": round(average, 2), "currency": currency})
    rows.sort(key=lambda row: row["total"], reverse=True)
    return rows
'''

PROMPTS = {
    "code edit": [{"role": "user", "content": "Rewrite this function so that the parameter `orders` is called "
                   "`purchases` everywhere. Reply with the whole function only.\n\n```python\n" + FUNCTION + "```"}],
    "free text": [{"role": "user", "content": "Write a short story about a lighthouse keeper who finds a "
                   "message in a bottle."}],
}


def main():
    import candlewick as cw

    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="/work/bench/qwen2.5-coder-0.5b.gguf")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--draft", type=int, default=10)
    ap.add_argument("--max-tokens", type=int, default=400)
    ap.add_argument("--draft-model", default=None, help="a smaller model with the same tokenizer")
    ap.add_argument("--draft-tokens", type=int, default=None, help="num_draft_tokens (default: the runtime's)")
    args = ap.parse_args()
    rt = cw.ModelRuntime.load(args.model)
    runtimes = {"plain": rt, "lookup": rt}
    if args.draft_model:
        runtimes["draft"] = cw.ModelRuntime.load(args.model, draft_model=args.draft_model)
    rows = []
    for name, messages in PROMPTS.items():
        speeds = {mode: [] for mode in runtimes}
        outputs, accepted = {}, {}
        for _ in range(args.runs):
            for mode, r_ in runtimes.items():
                r_.session.reset()
                extra = {"prompt_lookup_num_tokens": args.draft} if mode == "lookup" else {}
                if mode == "draft" and args.draft_tokens is not None:
                    extra["num_draft_tokens"] = args.draft_tokens
                r = r_.chat(messages, max_tokens=args.max_tokens, temperature=0.0, **extra)
                # Decode time here includes the draft model's own steps (and its prefill).
                speeds[mode].append(r.usage["completion_tokens"] / r.usage["decode_seconds"])
                outputs[mode] = r.token_ids
                accepted[mode] = (r.usage.get("accepted_draft_tokens", 0), r.usage.get("draft_tokens", 0),
                                  r.usage["completion_tokens"])
        plain = statistics.median(speeds["plain"])
        row = {"prompt": name, "plain_tps": plain}
        for mode in runtimes:
            if mode == "plain":
                continue
            tps = statistics.median(speeds[mode])
            row[mode] = {"tps": tps, "speedup": tps / plain, "accepted/drafted/generated": accepted[mode],
                         "identical": outputs["plain"] == outputs[mode]}
        rows.append(row)
    print(json.dumps({"cpu": cpu_name(), "model": args.model, "draft": args.draft, "draft_model": args.draft_model,
                      "runs": args.runs, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
