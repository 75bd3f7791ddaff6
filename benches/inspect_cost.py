"""The cost of asking: decode tokens/s plain vs inspect_decode selecting one layer's output.

    python benches/inspect_cost.py [--model PATH] [--tokens 64] [--runs 5]
"""

import statistics
import time

import numpy as np

import candlewick as cw
from compare import model_parser, parse_model_args  # benches/compare.py: the shared options


def main():
    ap = model_parser(tokens=64, runs=5)
    ap.add_argument("--layer", type=int, default=None, help="layer whose output is observed (default: the middle one)")
    args = parse_model_args(ap)
    rt = cw.ModelRuntime.load(args.model, device="cpu")
    layer = args.layer if args.layer is not None else rt.model_info["num_layers"] // 2
    request = cw.ObservationRequest.exact([f"model.layers.{layer}.output"])
    prompt = list(range(1000, 1032))

    def decode_loop(inspect):
        rt.session.reset()
        tok = int(np.argmax(rt.prefill(prompt).wait().logits[-1]))
        t = time.perf_counter()
        for _ in range(args.tokens):
            if inspect:
                out = rt.inspect_decode([tok], request).output
            else:
                out = rt.decode([tok]).wait()
            tok = int(np.argmax(out.logits[-1]))
        return args.tokens / (time.perf_counter() - t)

    plain, inspected = [], []
    for _ in range(args.runs):
        plain.append(decode_loop(False))
        inspected.append(decode_loop(True))
    p, i = statistics.median(plain), statistics.median(inspected)
    print(f"model {args.model}")
    print(f"decode, plain:                        {p:7.1f} tok/s (median of {args.runs})")
    print(f"decode, inspecting layer {layer} output:    {i:7.1f} tok/s")
    print(f"cost of asking: {100 * (p - i) / p:+.1f}%")


if __name__ == "__main__":
    main()
