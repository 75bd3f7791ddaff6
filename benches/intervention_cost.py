"""The cost of editing: decode tokens/s plain, with one steering vector on one layer, and with a
head ablation (runs interleaved, medians of several runs; the CPU is printed).

    python benches/intervention_cost.py [--model PATH] [--tokens 64] [--runs 5]
"""

import statistics
import time

import numpy as np

import candlewick as cw
from candlewick import interventions as iv
from compare import cpu_name, model_parser, parse_model_args  # benches/compare.py: the host, the shared options


def main():
    ap = model_parser(tokens=64, runs=5)
    args = parse_model_args(ap)
    rt = cw.ModelRuntime.load(args.model, device="cpu")
    info = rt.model_info
    layer = info["num_layers"] // 2
    steer = [iv.add(f"model.layers.{layer}.output", np.random.default_rng(0).standard_normal(info["hidden_size"]))]
    ablate = [iv.scale(f"model.layers.{layer}.attention.heads", [0], 0.0)]
    prompt = list(range(1000, 1032))

    def decode_loop(edits):
        rt.interventions = edits
        rt.session.reset()
        tok = int(np.argmax(rt.prefill(prompt).wait().logits[-1]))
        t = time.perf_counter()
        for _ in range(args.tokens):
            tok = int(np.argmax(rt.decode([tok]).wait().logits[-1]))
        rt.interventions = []
        return args.tokens / (time.perf_counter() - t)

    runs = {"plain": [], "steer": [], "ablate": []}
    for _ in range(args.runs):
        runs["plain"].append(decode_loop([]))
        runs["steer"].append(decode_loop(steer))
        runs["ablate"].append(decode_loop(ablate))
    med = {k: statistics.median(v) for k, v in runs.items()}
    print(f"model {args.model}")
    print(f"cpu {cpu_name()}")
    print(f"decode, plain:                              {med['plain']:7.1f} tok/s (median of {args.runs})")
    print(f"decode, one steering vector on layer {layer}:    {med['steer']:7.1f} tok/s "
          f"({100 * (med['steer'] - med['plain']) / med['plain']:+.1f}%)")
    print(f"decode, head 0 of layer {layer} ablated:         {med['ablate']:7.1f} tok/s "
          f"({100 * (med['ablate'] - med['plain']) / med['plain']:+.1f}%)")


if __name__ == "__main__":
    main()
