"""Aggregate completion tokens/s of `candlewick serve` with 1 and with 8 concurrent clients
(the official `openai` client, loopback, greedy); medians of several runs; the CPU is printed.

    python benches/server.py [--model PATH] [--tokens 32] [--runs 3]
"""

import statistics
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

from compare import cpu_name, model_parser, parse_model_args  # benches/compare.py: the host, the shared options


def main():
    ap = model_parser(tokens=32, runs=3)
    ap.add_argument("--port", type=int, default=8391)
    args = parse_model_args(ap)
    import openai

    proc = subprocess.Popen([sys.executable, "-m", "candlewick", "serve", "--model", args.model, "--device", "cpu",
                             "--port", str(args.port)], stderr=subprocess.DEVNULL)
    base = f"http://127.0.0.1:{args.port}"
    try:
        for _ in range(300):
            try:
                urllib.request.urlopen(base + "/health", timeout=1)
                break
            except OSError:
                time.sleep(0.2)
        client = openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0)
        name = Path(args.model).name
        print(f"model {args.model}\ncpu {cpu_name()}")

        def one(i, out):
            r = client.completions.create(model=name, prompt=f"Story number {i}:", max_tokens=args.tokens,
                                          temperature=0.0, extra_body={"ignore_eos": True})
            out.append(r.usage.completion_tokens)

        rates = {}
        for n in (1, 8):
            runs = []
            for _ in range(args.runs):
                out = []
                threads = [threading.Thread(target=one, args=(i, out)) for i in range(n)]
                t = time.perf_counter()
                for th in threads:
                    th.start()
                for th in threads:
                    th.join()
                runs.append(sum(out) / (time.perf_counter() - t))
            rates[n] = statistics.median(runs)
            print(f"{n} client(s): {rates[n]:7.1f} completion tok/s aggregate ({rates[n] / rates[1]:4.2f}x one)")
    finally:
        proc.terminate()
        proc.wait()


if __name__ == "__main__":
    main()
