"""Activation collection speed (issue 40): tokens/s collecting `model.layers.{L}.output` at the
middle layer of Qwen2.5-Coder 0.5B (GGUF) over a fixed corpus, three ways, plus the cost of SAE
features during decode.

- candlewick `collect_batch` (what `cw.collect` runs): documents batched, the pass stopped after
  layer L (no later layer, no logits); and `cw.collect` itself, writing float16 shards.
- candlewick's own full forward pass: the same batches with the pass run to the end
  (`model.norm` requested, so every layer and the final norm run), and one `inspect_prefill` per
  document (what a user without `collect` runs).
- transformers (the reference venv, `gguf_file=`, de-quantized to float32) with a forward hook on
  layer L and the layers after it cut, the same batches, the same thread count.
- decode: ms per step plain, and with `sae.x.features` of a 16k-wide random SAE at layer L
  observed every step (the SAE in float32, as the published formats store it).

Runs are interleaved, medians reported; the CPU is recorded (a shared machine: noisy).

    python benches/collect.py [--docs 16] [--doc-tokens 128] [--runs 3] [--out benches/results/collect.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from compare import cpu_name  # benches/compare.py: one way to name the host

MODEL = "/work/bench/qwen2.5-coder-0.5b.gguf"
REF_PY = "/work/bench/venv-ref/bin/python"


def corpus_ids(tokenizer_encode, docs: int, doc_tokens: int) -> list[list[int]]:
    """A fixed corpus: candlewick's own Python sources and docs, cut into documents of exactly
    `doc_tokens` tokens (equal lengths, so transformers needs no padding)."""
    root = Path(__file__).resolve().parent.parent
    text = "\n".join(p.read_text() for p in sorted((root / "python" / "candlewick").rglob("*.py")))
    text += "\n".join(p.read_text() for p in sorted((root / "docs").glob("*.md")))
    ids = tokenizer_encode(text)
    need = docs * doc_tokens
    while len(ids) < need:
        ids = ids + ids
    return [ids[i * doc_tokens:(i + 1) * doc_tokens] for i in range(docs)]


def transformers_side(args) -> None:
    """Runs in the reference venv: prints {"tokens_per_s": [...]} for the hooked, cut model."""
    import torch
    import transformers

    torch.set_num_threads(args.threads)
    docs = json.loads(Path(args.docs_file).read_text())
    d = Path(args.model)
    model = transformers.AutoModelForCausalLM.from_pretrained(str(d.parent), gguf_file=d.name,
                                                              dtype=torch.float32).eval()
    inner = model.model
    inner.layers = inner.layers[: args.layer + 1]  # the rest of the model cut
    kept = []
    inner.layers[args.layer].register_forward_hook(lambda _m, _i, out: kept.append(
        (out[0] if isinstance(out, tuple) else out).detach().numpy().copy()))
    batches = [docs[i:i + args.batch] for i in range(0, len(docs), args.batch)]
    rates = []
    for _ in range(args.runs):
        kept.clear()
        t = time.perf_counter()
        with torch.no_grad():
            for b in batches:
                inner(torch.tensor(b), use_cache=False)
        rates.append(sum(map(len, docs)) / (time.perf_counter() - t))
    print(json.dumps({"tokens_per_s": rates, "torch": torch.__version__, "transformers": transformers.__version__,
                      "rows": int(sum(k.shape[0] * k.shape[1] for k in kept))}))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=MODEL)
    ap.add_argument("--docs", type=int, default=16)
    ap.add_argument("--doc-tokens", type=int, default=128)
    ap.add_argument("--batch", type=int, default=8, help="documents per batched step")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--decode-tokens", type=int, default=32)
    ap.add_argument("--sae-width", type=int, default=16384)
    ap.add_argument("--out", default=None)
    ap.add_argument("--transformers-side", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--docs-file", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--layer", type=int, default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.transformers_side:
        return transformers_side(args)

    import candlewick as cw

    rt = cw.ModelRuntime.load(args.model, device="cpu", threads=args.threads)
    info = rt.model_info
    layer = info["num_layers"] // 2
    point = f"model.layers.{layer}.output"
    docs = corpus_ids(rt.tokenizer.encode, args.docs, args.doc_tokens)
    tokens = sum(map(len, docs))
    batches = [docs[i:i + args.batch] for i in range(0, len(docs), args.batch)]
    stop = cw.ObservationRequest.exact([point])
    full = cw.ObservationRequest.exact([point, "model.norm"])
    assert rt.last_layer_needed(stop) == layer and rt.last_layer_needed(full) is None

    def run_batches(req):
        t = time.perf_counter()
        for b in batches:
            rt.collect_batch(b, req)
        return tokens / (time.perf_counter() - t)

    def run_prefills():
        t = time.perf_counter()
        for d in docs:
            rt.session.reset()
            rt.inspect_prefill(d, stop)
        return tokens / (time.perf_counter() - t)

    def run_collect():
        with tempfile.TemporaryDirectory() as out:
            t = time.perf_counter()
            cw.collect(rt, docs, points=[point], out=out, dtype="float16", batch_tokens=args.batch * args.doc_tokens,
                       progress=False)
            return tokens / (time.perf_counter() - t)

    with tempfile.TemporaryDirectory() as tmp:
        docs_file = Path(tmp) / "docs.json"
        docs_file.write_text(json.dumps(docs))
        rates = {"collect_batch": [], "cw.collect": [], "full_pass_batched": [], "full_pass_prefill": []}
        run_batches(stop)  # warm up
        for _ in range(args.runs):
            rates["collect_batch"].append(run_batches(stop))
            rates["cw.collect"].append(run_collect())
            rates["full_pass_batched"].append(run_batches(full))
            rates["full_pass_prefill"].append(run_prefills())
        hf = None
        if Path(REF_PY).exists():
            proc = subprocess.run([REF_PY, __file__, "--transformers-side", "--model", args.model, "--docs-file",
                                   str(docs_file), "--layer", str(layer), "--batch", str(args.batch), "--runs",
                                   str(args.runs), "--threads", str(args.threads)],
                                  capture_output=True, text=True, timeout=3600)
            if proc.returncode == 0:
                hf = json.loads(proc.stdout.strip().splitlines()[-1])
            else:
                print(proc.stderr[-3000:], file=sys.stderr)

    # SAE features during decode: a random 16k-wide JumpReLU SAE (Gemma Scope's format) at `point`.
    h, w = info["hidden_size"], args.sae_width
    rng = np.random.default_rng(0)
    with tempfile.TemporaryDirectory() as tmp:
        f32 = np.float32
        np.savez(Path(tmp) / "params.npz", W_enc=f32(0.05) * rng.standard_normal((h, w), dtype=f32),
                 b_enc=np.zeros(w, f32), W_dec=f32(0.05) * rng.standard_normal((w, h), dtype=f32),
                 b_dec=np.zeros(h, f32), threshold=np.full(w, 0.5, f32))
        rt.attach_sae(str(Path(tmp) / "params.npz"), point=point, name="bench")
    feats = cw.ObservationRequest.exact(["sae.bench.features"])
    prompt = docs[0][:32]

    def decode_ms(request):
        rt.session.reset()
        tok = int(np.argmax(rt.prefill(prompt).wait().logits[-1]))
        t = time.perf_counter()
        for _ in range(args.decode_tokens):
            if request is None:
                logits = rt.decode([tok]).wait().logits
            else:
                logits = rt.inspect_decode([tok], request).output.logits
            tok = int(np.argmax(logits[-1]))
        return 1000 * (time.perf_counter() - t) / args.decode_tokens

    decode = {"plain": [], "sae_features": []}
    decode_ms(None)
    for _ in range(args.runs):
        decode["plain"].append(decode_ms(None))
        decode["sae_features"].append(decode_ms(feats))

    med = {k: statistics.median(v) for k, v in rates.items()}
    result = {
        "cpu": cpu_name(),
        "machine_note": "2 vCPUs shared with other jobs during the run: figures are noisy; medians of interleaved runs",
        "model": Path(args.model).name,
        "threads": args.threads,
        "layer": layer,
        "point": point,
        "corpus": {"documents": args.docs, "tokens_per_document": args.doc_tokens, "batch_documents": args.batch},
        "tokens_per_s": {k: v for k, v in rates.items()},
        "median_tokens_per_s": med,
        "transformers": hf and {**hf, "median_tokens_per_s": statistics.median(hf["tokens_per_s"]),
                                "setup": "gguf_file= de-quantized to float32, layers after L cut, forward hook on L"},
        "speedup": {
            "collect_batch_vs_transformers": hf and med["collect_batch"] / statistics.median(hf["tokens_per_s"]),
            "collect_batch_vs_full_pass_batched": med["collect_batch"] / med["full_pass_batched"],
            "collect_batch_vs_full_pass_prefill": med["collect_batch"] / med["full_pass_prefill"],
        },
        "decode_ms_per_token": decode,
        "decode_sae": {"sae_width": w, "median_plain_ms": statistics.median(decode["plain"]),
                       "median_with_features_ms": statistics.median(decode["sae_features"]),
                       "overhead": statistics.median(decode["sae_features"]) / statistics.median(decode["plain"]) - 1},
    }
    text = json.dumps(result, indent=1)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")


if __name__ == "__main__":
    main()
