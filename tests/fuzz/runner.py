"""Runs the fuzz cases in child processes and classifies how each ended.

Usage (from the repository root):

    python tests/fuzz/runner.py            # quick mode, as CI runs it (under 2 minutes)
    python tests/fuzz/runner.py --long     # long mode: many more random mutations
    python tests/fuzz/runner.py --seed 7 --random 500 --verbose

`CANDLEWICK_FUZZ_LONG=1` selects long mode too. Each input runs in a worker process with a
memory cap (RLIMIT_AS) and a per-input timeout; a worker that dies (abort) or does not answer
(hang) is replaced. Results:

- typed: a CandlewickError subclass (the expected end of a broken input)
- untyped: any other exception (PanicException, OverflowError, ...)
- internal: candlewick.InternalError (a caught panic: still a bug)
- abort: the worker process died
- hang: no answer within the timeout
- accepted: loaded, prefilled and decoded with finite logits (or a template rendered)
- accepted-then-typed: loaded, then its first step failed with a typed error
- corrupt: loaded, then non-finite logits or an untyped/internal error at the first step
- silent: a `must_reject` input that was accepted (invalid by construction)
- setup-failed: the case's own fixture (the model whose tokenizer renders the templates) did not
  load, so the input was never tried: the family proved nothing, which is a failure too

One summary line is printed; the exit status is 1 if any input was untyped, internal, abort,
hang, corrupt, silent or setup-failed.
"""

import argparse
import json
import os
import random
import resource
import select
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import cases as fuzz_cases  # noqa: E402
from image_cases import image_cases  # noqa: E402

WORKER = Path(__file__).resolve().parent / "worker.py"
FAILING = ("untyped", "internal", "abort", "hang", "corrupt", "silent", "setup-failed")
MEMORY_CAP = 4 << 30


def _limit_memory():
    resource.setrlimit(resource.RLIMIT_AS, (MEMORY_CAP, MEMORY_CAP))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))


class Worker:
    """One child process answering requests line by line."""

    def __init__(self):
        env = dict(os.environ, RUST_BACKTRACE="0", RAYON_NUM_THREADS="1")
        self.proc = subprocess.Popen(
            [sys.executable, str(WORKER)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL, text=True, preexec_fn=_limit_memory, env=env,
        )
        ready = self._read(60)
        if ready is None or not ready.get("ready"):
            raise RuntimeError("the fuzz worker did not start")

    def _read(self, timeout):
        ready, _, _ = select.select([self.proc.stdout], [], [], timeout)
        if not ready:
            return None
        line = self.proc.stdout.readline()
        return json.loads(line) if line else {"result": "abort", "error": f"exit status {self.proc.wait()}"}

    def run(self, request, timeout):
        try:
            self.proc.stdin.write(json.dumps(request) + "\n")
            self.proc.stdin.flush()
        except BrokenPipeError:
            return {"result": "abort", "error": "worker gone"}
        answer = self._read(timeout)
        if answer is None:
            return {"result": "hang", "error": f"no answer in {timeout} s"}
        return answer

    def alive(self):
        return self.proc.poll() is None

    def close(self):
        if self.alive():
            self.proc.kill()
        self.proc.wait()


def generate(seed, long_mode, n_random, scratch):
    rng = random.Random(seed)
    archs = fuzz_cases.ARCHS
    yield from fuzz_cases.config_cases(rng, scratch, archs, n_random)
    yield from fuzz_cases.safetensors_cases(rng, scratch, archs, n_random)
    yield from fuzz_cases.gguf_cases(rng, scratch, n_random * 3)
    yield from fuzz_cases.template_cases(rng, scratch, n_random)
    # Issue 23's classes: non-finite weights, hostile sizes and options on the API, threads.
    yield from fuzz_cases.nonfinite_cases(rng, scratch, archs, n_random)
    yield from fuzz_cases.api_cases(rng, scratch, n_random)
    yield from fuzz_cases.thread_cases(rng, scratch, n_random)
    # Issue 39: image bytes (PNG, JPEG, GIF) through candlewick.images.
    yield from image_cases(rng, scratch, n_random)


def run(seed=0, long_mode=False, n_random=None, timeout=None, verbose=False, out=sys.stdout):
    """Runs every case; returns (Counter of results, list of failing (case, answer))."""
    n_random = n_random if n_random is not None else (400 if long_mode else 25)
    timeout = timeout or (30 if long_mode else 10)
    counts, failures = Counter(), []
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="candlewick-fuzz-") as tmp:
        worker = Worker()
        try:
            for case in generate(seed, long_mode, n_random, Path(tmp)):
                answer = worker.run(case.request, timeout)
                result = answer["result"]
                if result in ("accepted", "accepted-then-typed") and case.must_reject:
                    result = "silent"
                counts[result] += 1
                if verbose or result in FAILING:
                    print(f"  [{result}] {case.family}: {case.label} -- {answer.get('error', '')}", file=out)
                if result in FAILING:
                    failures.append((case, answer))
                if result in ("abort", "hang") or not worker.alive():
                    worker.close()
                    worker = Worker()
        finally:
            worker.close()
    total = sum(counts.values())
    order = ["typed", "accepted", "accepted-then-typed", "untyped", "internal", "abort", "hang", "corrupt", "silent",
             "setup-failed"]
    figures = " ".join(f"{k}={counts.get(k, 0)}" for k in order)
    extra = " ".join(f"{k}={v}" for k, v in counts.items() if k not in order)
    mode = "long" if long_mode else "quick"
    print(f"fuzz {mode} seed={seed}: {total} inputs in {time.monotonic() - started:.0f}s: {figures} {extra}".rstrip(),
          file=out, flush=True)
    return counts, failures


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--long", action="store_true", default=os.environ.get("CANDLEWICK_FUZZ_LONG") == "1")
    ap.add_argument("--seed", type=int, default=int(os.environ.get("CANDLEWICK_FUZZ_SEED", "0")))
    ap.add_argument("--random", type=int, default=None, help="random mutations per family and seed file")
    ap.add_argument("--timeout", type=float, default=None, help="seconds per input")
    ap.add_argument("--verbose", action="store_true")
    args = ap.parse_args(argv)
    _, failures = run(args.seed, args.long, args.random, args.timeout, args.verbose)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
