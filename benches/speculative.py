"""Speculative decoding by prompt lookup (issue 27, item 5): decode speed with
`prompt_lookup_num_tokens` beside the plain run, greedy, on a code-editing prompt (rewrite a
given ~300-token function with one change: the output mostly copies the input) and on free text.

    python benches/speculative.py [--model PATH] [--runs 3] [--draft 10]

Runs alternate plain / lookup; reports median decode tokens/s of each, their ratio, the drafts
accepted, and whether the outputs were identical (they must be: greedy).
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
    args = ap.parse_args()
    rt = cw.ModelRuntime.load(args.model)
    rows = []
    for name, messages in PROMPTS.items():
        speeds = {"plain": [], "lookup": []}
        outputs, accepted = {}, []
        for _ in range(args.runs):
            for mode in ("plain", "lookup"):
                rt.session.reset()
                extra = {"prompt_lookup_num_tokens": args.draft} if mode == "lookup" else {}
                r = rt.chat(messages, max_tokens=args.max_tokens, temperature=0.0, **extra)
                speeds[mode].append(r.usage["completion_tokens"] / r.usage["decode_seconds"])
                outputs[mode] = r.token_ids
                if mode == "lookup":
                    accepted.append((r.usage.get("accepted_draft_tokens", 0), r.usage.get("draft_tokens", 0),
                                     r.usage["completion_tokens"]))
        plain, lookup = statistics.median(speeds["plain"]), statistics.median(speeds["lookup"])
        rows.append({"prompt": name, "plain_tps": plain, "lookup_tps": lookup, "speedup": lookup / plain,
                     "accepted/drafted/generated": accepted[-1], "identical": outputs["plain"] == outputs["lookup"]})
    print(json.dumps({"cpu": cpu_name(), "model": args.model, "draft": args.draft, "runs": args.runs, "rows": rows},
                     indent=1))


if __name__ == "__main__":
    main()
